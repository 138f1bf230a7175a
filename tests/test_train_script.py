"""scripts/train_micro_ddp.py outside torchrun's comfort zone: srun without torchrun (issue 17, fault 11)
and the end of a run on a loaded machine (fault 12: no rank may abort after final_loss)."""
import importlib.util
import os
import subprocess
import sys

import pytest

from conftest import (ROOT, PortClash, finish, is_port_clash, kill_process_group, retry_on_port_clash,
                      start_torchrun, torchrun_env)

SCRIPT = ROOT / "scripts" / "train_micro_ddp.py"


def _script():
    spec = importlib.util.spec_from_file_location("train_micro_ddp", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SRUN_2x2 = {  # what srun --nodes=2 --ntasks-per-node=2 sets for the second task of node 1, plus the README's lines
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


def _srun_like(port, world_size=2, steps=2):
    """world_size plain processes on one 'node', with only the variables srun and the README's recipe set."""
    procs = []
    for r in range(world_size):
        env = torchrun_env(RANK=str(r), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                           SLURM_PROCID=str(r), SLURM_LOCALID=str(r), SLURM_NTASKS=str(world_size),
                           SLURM_NTASKS_PER_NODE=str(world_size), SLURM_TASKS_PER_NODE=str(world_size))
        for k in ("LOCAL_RANK", "LOCAL_WORLD_SIZE"):
            env.pop(k, None)
        procs.append(subprocess.Popen([sys.executable, str(SCRIPT), "--steps", str(steps), "--log-every", "1"],
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


LOADED_RUNS = int(os.environ.get("TRAIN_SCRIPT_LOADED_RUNS", "2"))  # 20 for the proof run (see the closing note)


def test_the_script_ends_cleanly_on_a_loaded_machine():
    """final_loss printed, then every rank exits 0: no SIGABRT while tearing the group down."""
    load = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        for i in range(LOADED_RUNS):
            def run(port):
                proc = start_torchrun("--nnodes=1", "--nproc-per-node=4", "--rdzv-backend=static",
                                      "--master-addr=127.0.0.1", f"--master-port={port}", "--node-rank=0",
                                      script=SCRIPT, script_args=["--steps", "3"])
                try:
                    return finish(proc, f"loaded run {i}", check=False), proc.returncode
                finally:
                    kill_process_group(proc)
            out, rc = retry_on_port_clash(run)
            assert rc == 0 and "final_loss=" in out, f"run {i} of {LOADED_RUNS} failed (exit {rc}):\n{out[-3000:]}"
            assert "terminate called" not in out and "SIGABRT" not in out, out[-3000:]
    finally:
        for p in load:
            p.kill()
            p.wait()
