"""scripts/train_micro_ddp.py outside torchrun's comfort zone: srun without torchrun, and
the same fallback in the scripts %ddp export writes; the end of a run (fault 12: no rank may abort after
final_loss, no gloo thread left at exit); a PowerSGD run whose rank is killed mid-way, resumed from its
--save-every checkpoint.

What the script decides (a resume refused, a finished run's loss) is checked by calling its ``main(argv)`` in
this process (``_in_process``): the world of one that `python scripts/train_micro_ddp.py` forms, without paying
for a fresh interpreter that imports torch; how its processes start, crash and end is checked with real ones."""
import importlib.util
import os
import argparse
import re
import runpy
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401  before any group of this process: see the script's setup()

from conftest import (ROOT, PortClash, finish, is_port_clash, kill_process_group, retry_on_port_clash,
                      start_torchrun, torchrun_env)

SCRIPT = ROOT / "scripts" / "train_micro_ddp.py"


def _script():
    spec = importlib.util.spec_from_file_location("train_micro_ddp", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SRUN_2x2 = {  # what srun --nodes=2 --ntasks-per-node=2 sets for the second task of node 1, plus the docs' lines
    "SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NTASKS": "4", "SLURM_NTASKS_PER_NODE": "2",
    "SLURM_TASKS_PER_NODE": "2(x2)", "RANK": "3", "WORLD_SIZE": "4",
}


def test_srun_layout_is_read_from_slurm_not_guessed_from_the_world_size():
    script = _script()
    assert script.local_layout(SRUN_2x2) == (1, 2), "2 tasks per node, not WORLD_SIZE=4"
    without_ntasks = {k: v for k, v in SRUN_2x2.items() if k != "SLURM_NTASKS_PER_NODE"}
    assert script.local_layout(without_ntasks) == (1, 2), "SLURM_TASKS_PER_NODE='2(x2)' is enough"
    assert script.choose_device(1, 2, gpus=2).type == "cuda", "2 GPUs for 2 local ranks: the GPU, not the CPU"
    assert script.choose_device(1, 2, gpus=1).type == "cpu"
    torchrun = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    assert script.local_layout(torchrun) == (1, 2)
    with pytest.raises(SystemExit, match="LOCAL_RANK and LOCAL_WORLD_SIZE not set"):
        script.local_layout({"RANK": "3", "WORLD_SIZE": "4"})


def _srun_like(port, world_size=2, steps=2, script=SCRIPT, args=None, slurm=None):
    """world_size plain processes on one 'node', with only the variables srun and docs/multi-node.md's recipe set (no
    torchrun variable); ``slurm(rank)`` may replace rank's SLURM_* variables."""
    procs = []
    for r in range(world_size):
        tasks = {"SLURM_PROCID": str(r), "SLURM_LOCALID": str(r), "SLURM_NTASKS": str(world_size),
                 "SLURM_NTASKS_PER_NODE": str(world_size), "SLURM_TASKS_PER_NODE": str(world_size)}
        env = {k: v for k, v in torchrun_env(**(slurm(r) if slurm else tasks)).items()
               if not k.startswith(("LOCAL_", "TORCHELASTIC_", "GROUP_", "ROLE_")) and k != "MASTER_PORT"}
        env.update(RANK=str(r), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        argv = args if args is not None else ["--steps", str(steps), "--log-every", "1"]
        procs.append(subprocess.Popen([sys.executable, str(script), *argv],
                                      cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, start_new_session=True))
    outs = []
    try:
        for r, p in enumerate(procs):
            outs.append(finish(p, f"srun-style rank {r}", check=False))
    finally:
        for p in procs:
            kill_process_group(p)
    if any(p.returncode for p in procs) and any(is_port_clash(o) for o in outs):
        raise PortClash("port taken")
    return procs, outs


def test_the_readme_srun_recipe_runs_without_torchrun():
    procs, outs = retry_on_port_clash(_srun_like)
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-1500:] for o in outs)
    assert "world_size=2 " in outs[0] and "backend=gloo" in outs[0] and "final_loss=" in outs[0], outs[0]


# what srun --ntasks=2 on one node sets, told two ways: rank 0 with SLURM_NTASKS_PER_NODE (--ntasks-per-node),
# rank 1 with SLURM_TASKS_PER_NODE's "2(x1)" only (srun --ntasks without --ntasks-per-node)
SRUN_ONE_NODE = [
    {"SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "2",
     "SLURM_TASKS_PER_NODE": "2"},
    {"SLURM_PROCID": "1", "SLURM_LOCALID": "1", "SLURM_NTASKS": "2", "SLURM_TASKS_PER_NODE": "2(x1)"},
]
EXPORTED_CELL = ("import torch, torch.distributed as dist\nt = torch.ones(1, device=device) * (rank + 1)\n"
                 "dist.all_reduce(t)\nprint(f'rank {rank} of {world_size}, local {local_rank} of {local_world_size}, '"
                 "f'{device}, {dist.get_backend()}: sum {t.item():g}')")


def test_an_exported_notebook_script_runs_under_srun_without_torchrun(tmp_path):
    """%ddp export's scripts read srun's variables when torchrun's are absent, as the train script does."""
    from course_utils.engine.export import write_script

    script = write_script(tmp_path / "exported.py", [("", EXPORTED_CELL)])
    procs, outs = retry_on_port_clash(lambda port: _srun_like(port, script=script, args=[],
                                                              slurm=SRUN_ONE_NODE.__getitem__))
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-1500:] for o in outs)
    for r in (0, 1):
        assert f"rank {r} of 2, local {r} of 2, cpu, gloo: sum 3" in outs[r].splitlines(), outs[r][-1500:]


def test_an_exported_notebook_script_refuses_srun_without_its_local_rank(tmp_path, monkeypatch):
    """Without SLURM_LOCALID (or LOCAL_RANK) the exported script stops at its first lines and says what to set. Run
    in this process: it stops before it sets up a group, and without MASTER_ADDR a script that went on would fail
    in init_process_group, before it replaced anything of torch's here."""
    from course_utils.engine.export import write_script

    script = write_script(tmp_path / "exported.py", [("", EXPORTED_CELL)])
    without = {k: v for k, v in SRUN_ONE_NODE[0].items() if k != "SLURM_LOCALID"}
    for name in ("SLURM_LOCALID", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in dict(without, SLURM_NTASKS="1", RANK="0", WORLD_SIZE="1").items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit, match="set LOCAL_RANK and LOCAL_WORLD_SIZE"):
        runpy.run_path(str(script), run_name="__main__")


# Imported by every process of the uninterrupted run below (first on PYTHONPATH): when the script has ended,
# before the interpreter tears down its modules, each rank says which gloo threads are still running.
AT_EXIT = '''import atexit, os, sys


def _gloo_threads():
    if os.environ.get("RANK") is None or not os.path.isdir("/proc/self/task"):
        return
    names = sorted(open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task"))
    # one write (print writes the text and its newline apart, unbuffered): the ranks share torchrun's pipe
    sys.stdout.flush()
    os.write(1, f"rank {os.environ['RANK']} gloo threads at exit: {[n for n in names if 'gloo' in n]}\\n".encode())


atexit.register(_gloo_threads)
'''

CRASH_STEPS = 8
PAUSED_AT = 4  # the killed run's ranks wait after step 4 and its checkpoint (MICRO_DDP_TEST_PAUSE_AFTER_STEP)
POWERSGD = ["--compressor", "powersgd", "--global-batch-size", "8", "--micro-batch-size", "4", "--log-every", "1",
            "--steps", str(CRASH_STEPS), "--powersgd-warmup", "1"]   # compressed from step 2 on


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The PowerSGD run on 2 ranks, start to end, with the at-exit hook: the reference of the killed-and-resumed
    run, and the run whose end is checked for fault 12. Returns (output, exit code, its final checkpoint)."""
    tmp = tmp_path_factory.mktemp("uninterrupted")
    (tmp / "hook").mkdir()
    (tmp / "hook" / "sitecustomize.py").write_text(AT_EXIT)
    env = torchrun_env()
    env["PYTHONPATH"] = os.pathsep.join([str(tmp / "hook"), env["PYTHONPATH"]])
    out, rc = _torchrun2(POWERSGD + ["--checkpoint", tmp / "straight.pt"], "uninterrupted run", env=env)
    return out, rc, tmp / "straight.pt"


def test_the_script_ends_cleanly_with_no_gloo_thread_left(uninterrupted):
    """final_loss printed, then every rank exits 0: no SIGABRT while tearing the group down. That abort
    comes, now and then, from gloo threads that outlived destroy_process_group into the
    interpreter's shutdown (torch.distributed.nn imported after init_process_group held the group): every rank's
    gloo threads must be gone when the script has ended, which that fault breaks on every run and every rank,
    loaded or not (with the script's top-level `import torch.distributed.nn` removed: ['gloo_tcp_loop',
    'pt_gloo_runloop', ...] on both ranks)."""
    out, rc, _ = uninterrupted
    assert rc == 0 and "final_loss=" in out, f"the run failed (exit {rc}):\n{out[-3000:]}"
    assert "terminate called" not in out and "SIGABRT" not in out, out[-3000:]
    found = dict(re.findall(r"rank (\d) gloo threads at exit: (\[[^\]]*\])", out))
    assert sorted(found) == ["0", "1"], f"every rank reports at exit:\n{out[-3000:]}"
    for r, threads in found.items():
        assert threads == "[]", f"rank {r}: the group's gloo threads were alive at exit: {threads}"


def _torchrun2(script_args, what, env=None):
    """The script on 2 ranks (gloo, one node); returns (output, exit code)."""
    def run(port):
        proc = start_torchrun("--nnodes=1", "--nproc-per-node=2", "--rdzv-backend=static", "--master-addr=127.0.0.1",
                              f"--master-port={port}", "--node-rank=0", script=SCRIPT, script_args=script_args,
                              env=env)
        try:
            return finish(proc, what, check=False), proc.returncode
        finally:
            kill_process_group(proc)
    return retry_on_port_clash(run)


def _assert_identical(a, b, where="checkpoint"):
    """Every tensor bit for bit, every other value equal, the same keys: the same run."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), f"{where}: keys {sorted(a)} vs {sorted(b)}"
        for k in a:
            _assert_identical(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: {len(a)} vs {len(b)} items"
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_identical(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), f"{where}: max difference {(a.double() - b.double()).abs().max().item()}"
    else:
        assert a == b, f"{where}: {a!r} vs {b!r}"


def _rank_pids(torchrun_proc):
    """{rank: pid} of the ranks a torchrun started (its children, told apart by their RANK)."""
    import psutil
    ranks = {}
    for child in psutil.Process(torchrun_proc.pid).children():
        try:
            env = child.environ()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if "RANK" in env:
            ranks[int(env["RANK"])] = child.pid
    return ranks


def _killed_mid_way(script_args):
    """The script on 2 ranks, rank 1 SIGKILLed (a crash, an OOM kill) once rank 0 reports that the ranks wait
    after step PAUSED_AT and its --save-every checkpoint: the kill lands mid-run, however slow this machine is.
    Returns (output, exit code, killed pid)."""
    import signal

    def crash(port):
        proc = start_torchrun("--nnodes=1", "--nproc-per-node=2", "--rdzv-backend=static", "--master-addr=127.0.0.1",
                              f"--master-port={port}", "--node-rank=0", script=SCRIPT, script_args=script_args,
                              env=torchrun_env(MICRO_DDP_TEST_PAUSE_AFTER_STEP=str(PAUSED_AT)))
        lines, killed = [], None
        try:
            for line in proc.stdout:
                lines.append(line)
                if killed is None and line.startswith(f"paused after step {PAUSED_AT} "):
                    killed = _rank_pids(proc)[1]
                    os.kill(killed, signal.SIGKILL)
            proc.wait(timeout=240)
        finally:
            kill_process_group(proc)
        out = "".join(lines)
        if proc.returncode and killed is None and is_port_clash(out):
            raise PortClash(out[-500:])
        return out, proc.returncode, killed

    return retry_on_port_clash(crash)


def test_a_powersgd_run_killed_mid_way_resumes_bit_for_bit_and_refuses_another_world_size(uninterrupted, tmp_path,
                                                                                         capsys):
    """docs/multi-node.md's recipe: --save-every N writes the checkpoint during the run; a rank killed
    mid-run ends the torchrun; the same line plus --resume continues from the last checkpoint and ends on the
    uninterrupted run's loss and checkpoint, bit for bit: weights, AdamW and every rank's PowerSGD error feedback
    and Q. PowerSGD's state is per rank, so 1 rank may not resume 2 ranks' run."""
    common = POWERSGD
    out, rc, straight = uninterrupted
    assert rc == 0 and "final_loss=" in out, f"uninterrupted run failed (exit {rc}):\n{out[-3000:]}"
    reference = re.search(r"final_loss=(\S+)", out).group(1)
    crashed = tmp_path / "crashed.pt"

    out, rc, killed = _killed_mid_way(common + ["--checkpoint", crashed, "--save-every", "2"])
    assert killed is not None, f"the run never paused after step {PAUSED_AT}:\n{out[-3000:]}"
    assert rc != 0 and "final_loss=" not in out, f"killing rank 1 did not end the run (exit {rc}):\n{out[-3000:]}"
    half = torch.load(crashed, weights_only=True)
    assert half["step"] == PAUSED_AT, f"--save-every 2 left a checkpoint at step {half['step']}, not {PAUSED_AT}"
    errors = [rank_state["errors"] for rank_state in half["compressor"]]
    assert len(errors) == 2 and errors[0], "the checkpoint must hold the PowerSGD error feedback of both ranks"
    assert any(not torch.equal(errors[0][k], errors[1][k]) for k in errors[0]), \
        "each rank has its own error feedback (its own gradient): the checkpoint must keep every rank's"
    assert any(e.abs().max() > 0 for e in errors[0].values()), "after 2 steps the error feedback is not zero"
    assert half["options"]["powersgd_warmup"] == 1 and half["options"]["bucket_cap_mb"] == 25, half["options"]

    resume = common + ["--checkpoint", crashed, "--save-every", "2", "--resume"]
    refused, printed = _in_process(resume, capsys)  # one process: a world of one
    assert refused is not None, f"1 rank resumed 2 ranks' PowerSGD state:\n{printed[-2000:]}"
    assert "holds the powersgd state of 2 ranks, and this run has 1: resume with 2 processes" in refused, refused

    # another bucket cap would silently change the bucket layout (and PowerSGD's messages): refused
    refused, printed = _in_process(resume + ["--bucket-cap-mb", "1"], capsys)
    assert refused is not None and "--bucket-cap-mb 25.0 there, 1.0 here" in refused, (refused, printed[-2000:])

    out, rc = _torchrun2(resume, "resumed run")
    assert rc == 0 and f"resumed from {crashed} at step {half['step']}" in out, f"exit {rc}:\n{out[-3000:]}"
    assert re.search(r"final_loss=(\S+)", out).group(1) == reference, "the resumed run ends on another loss"
    _assert_identical(torch.load(straight, weights_only=True), torch.load(crashed, weights_only=True))


def test_a_resume_with_other_options_is_refused_and_says_which():
    """The checkpoint records the options a resume must repeat; each one changed is named, old checkpoints refused."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_micro_ddp", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    args = argparse.Namespace(bucket_cap_mb=25.0, global_batch_size=32, micro_batch_size=4, lr=1e-2, seed=0,
                              compressor="powersgd", powersgd_warmup=2, bf16=False)
    saved = script.run_options(args)
    assert script.resume_mismatch(saved, args) is None
    for name, value, shown in [("bucket_cap_mb", 1.0, "--bucket-cap-mb 25.0 there, 1.0 here"),
                               ("micro_batch_size", 2, "--micro-batch-size 4 there, 2 here"),
                               ("global_batch_size", 64, "--global-batch-size 32 there, 64 here"),
                               ("lr", 3e-3, "--lr 0.01 there, 0.003 here"), ("seed", 1, "--seed 0 there, 1 here"),
                               ("powersgd_warmup", 0, "--powersgd-warmup 2 there, 0 here")]:
        changed = argparse.Namespace(**{**vars(args), name: value})
        assert shown in (script.resume_mismatch(saved, changed) or ""), (name, script.resume_mismatch(saved, changed))
    assert "records no options" in script.resume_mismatch(None, args)


def _in_process(args, capsys):
    """The script's ``main(args)`` in this process, as `python scripts/train_micro_ddp.py args` runs it (no
    torchrun: a world of one). Returns (the message it exits with, None when it ends normally; what it printed)."""
    capsys.readouterr()  # only this run's output
    try:
        _script().main([str(a) for a in args])
        refused = None
    except SystemExit as stop:  # `python script.py` would print its message and exit with 1
        refused = None if stop.code in (None, 0) else str(stop.code)
    finally:
        if dist.is_initialized():  # a refusal leaves the run's group of one behind
            dist.destroy_process_group()
    return refused, capsys.readouterr().out


def test_a_resume_of_a_finished_run_prints_its_final_loss_and_a_checkpoint_past_steps_is_refused(tmp_path, capsys):
    """Issue 42: --resume of a run that had already finished trained nothing and printed final_loss=0.0. It now
    prints the loss the run ended on (recorded in the checkpoint) and says the run had finished."""
    checkpoint = tmp_path / "done.pt"
    common = ["--steps", "2", "--global-batch-size", "4", "--micro-batch-size", "4", "--log-every", "1",
              "--checkpoint", checkpoint]
    refused, first = _in_process(common, capsys)
    assert refused is None, refused
    ended_on = re.search(r"final_loss=(\S+)", first).group(1)
    assert float(ended_on) > 0, first

    refused, again = _in_process(common + ["--resume"], capsys)
    assert refused is None, refused
    assert "already finished at step 2" in again, again
    assert re.search(r"final_loss=(\S+)", again).group(1) == ended_on, \
        f"a resume of the finished run must print the loss it ended on ({ended_on}):\n{again}"

    refused, past = _in_process([*common[:1], "1", *common[2:], "--resume"], capsys)
    assert refused is not None and "is at step 2, past --steps 1" in refused, (refused, past[-2000:])
