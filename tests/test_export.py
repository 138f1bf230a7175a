"""``%ddp export PATH``: the %%ddp cells become a torchrun script that prints, rank by rank, what the
ranks printed and showed in the notebook.

Backend-aware: on a machine with 2 or more GPUs the kernel's ``%%ddp -n 2`` cells run on NCCL with
``device = cuda:rank``, so the cells build their tensors on ``device`` and the script runs with the same GPUs
visible; elsewhere both run on gloo with the GPUs hidden (``torchrun_env``), as before."""
import ast
import os
import re
import subprocess
import sys

import pytest

from conftest import finish, free_port, retry_on_port_clash, start_torchrun, torchrun_env
from course_utils import choose_backend
from course_utils.engine.export import write_script
from engine_helpers import Kernel

CELLS = [  # run in a real kernel, in this order
    "%%ddp -n 2\nimport torch, torch.distributed as dist\n"
    "t = torch.ones(1, device=device) * (rank + 1)\ndist.all_reduce(t)\n"
    "print(f'rank {rank} of {world_size} on {device}: sum {t.item():g}')",
    "%%ddp\nmsg = 'héllo wörld'; msg",                       # UTF-8 before the last expression
    "scale = 0.5",                                            # a notebook value ...
    "%ddp push scale",                                        # ... pushed to the ranks
    "%%ddp --rank 1\nprint('only rank', rank, 'sees', scale)\nrank * scale",
    "%%ddp\ntorch.arange(6.0).reshape(2, 3) + rank",          # a multi-line repr
    "%%ddp\nx = 10; x + rank  # the last value is shown, as the cell did",
    "%%ddp\ntotal = (sum(range(4))\n         % 5)  # a line starting with % is an expression here\ndist.barrier()",
]


def _per_rank(lines, world_size):
    """rank -> its lines without the '[rank N] ' prefix, in order."""
    out = {r: [] for r in range(world_size)}
    for line in lines:
        for r in out:
            if line.startswith(f"[rank {r}] "):
                out[r].append(line[len(f"[rank {r}] "):])
    return out


def _script_env(backend):
    """torchrun's environment: the GPUs the kernel's ranks used stay visible on NCCL, hidden on gloo."""
    env = torchrun_env()
    if backend == "nccl":
        if "CUDA_VISIBLE_DEVICES" in os.environ:
            env["CUDA_VISIBLE_DEVICES"] = os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            env.pop("CUDA_VISIBLE_DEVICES")
    return env


def test_the_exported_script_prints_what_the_cells_showed(tmp_path):
    backend = choose_backend("auto", 2)  # what the kernel's %%ddp -n 2 picks on this machine
    k = Kernel()
    try:
        assert k.execute("%load_ext course_utils")[0] == "ok"
        assert k.execute("%%ddp -n 3\nleft_out = rank")[0] == "ok"  # ranks replaced by the -n 2 below
        shown = []
        for cell in CELLS:
            status, out, _ = k.execute(cell)
            assert status == "ok", (cell, out, k.traceback)
            shown += out.splitlines()
        path = tmp_path / "exported.py"
        status, out, _ = k.execute(f"%ddp export {path}")
        assert status == "ok", out
    finally:
        k.close()
    assert out == (f"wrote {len([c for c in CELLS if c.startswith('%%ddp')])} %%ddp cells to {path} (left out: 1 "
                   f"cell(s) run on ranks replaced since); run it with: torchrun --standalone --nproc-per-node=2 "
                   f"{path}\n"), out
    text = path.read_text(encoding="utf-8")
    ast.parse(text)
    assert "torchrun --standalone --nproc-per-node=2" in text and "left_out" not in text
    logs = tmp_path / "logs"  # one stdout file per rank: on a shared stdout, two ranks' lines can mix mid-line

    def run(port):
        proc = start_torchrun("--nnodes=1", "--nproc-per-node=2", "--rdzv-backend=static", "--node-rank=0",
                              "--master-addr=127.0.0.1", f"--master-port={port}", f"--log-dir={logs}",
                              "--redirects=1", script=path, cwd=tmp_path, env=_script_env(backend))
        return finish(proc, "the exported script")

    retry_on_port_clash(run)
    logged = sorted(logs.rglob("stdout.log"))
    assert len(logged) == 2, f"expected one stdout.log per rank under {logs}"
    by_rank = {}
    for f in logged:
        r = int(f.parent.name)  # torchrun writes <log-dir>/<run>/attempt_0/<local rank>/stdout.log
        by_rank[r] = f.read_text(encoding="utf-8").splitlines()
    expected = _per_rank(shown, 2)
    for r in (0, 1):
        where = f"cuda:{r}" if backend == "nccl" else "cpu"
        assert f"rank {r} of 2 on {where}: sum 3" in expected[r], (backend, expected[r])
    for r in (0, 1):
        got = [line[len(f"[rank {r}] "):] if line.startswith(f"[rank {r}] ") else line for line in by_rank[r]]
        assert got == expected[r], f"rank {r}: the script printed\n{got}\nthe notebook showed\n{expected[r]}"
    assert "'héllo wörld'" in expected[0] and "only rank 1 sees 0.5" in expected[1]
    assert not any("only rank" in line for line in expected[0]), "--rank 1: rank 0's output stays hidden"
    assert "tensor([[1., 2., 3.]," in expected[1] and "        [4., 5., 6.]])" in expected[1], "every repr line"


def test_write_script_keeps_cells_and_pushes_in_order(tmp_path):
    import cloudpickle

    path = write_script(tmp_path / "s.py", [("cell", "-n 2", "a = 1"), ("push", "lr", cloudpickle.dumps({"lr": 0.1})),
                                            ("cell", "-n 2 --rank 0", "a + lr")], world_size=2)
    text = path.read_text()
    ast.parse(text)
    assert text.index("a = 1") < text.index("# %ddp push lr") < text.index("with _only_rank(0):") < \
        text.index("_show(a + lr)") < text.rindex("_torch_destroy()")


@pytest.mark.parametrize("drop", [None, "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_LOCALID"])
def test_an_exported_script_reads_srun_s_layout_like_the_training_script(tmp_path, monkeypatch, drop):
    """Under srun without torchrun the exported preamble takes local_rank and local_world_size from SLURM's
    variables as scripts/train_micro_ddp.py's local_layout does (2 tasks per node, never WORLD_SIZE=4), and without
    them it stops with one line that names the variables. Run as an import: the group never starts."""
    import runpy

    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    from test_train_script import SRUN_2x2, _script

    for module in (dist, distributed_c10d):   # the preamble swaps both for its own: put torch's back afterwards
        for name in ("init_process_group", "destroy_process_group"):
            monkeypatch.setattr(module, name, getattr(module, name))
    path = write_script(tmp_path / "srun.py", [("cell", "-n 2", "a = 1")], world_size=4, backend="gloo")
    env = {k: v for k, v in SRUN_2x2.items() if k != drop}
    for name in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", *SRUN_2x2):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    try:
        expected = _script().local_layout(env)
    except SystemExit:
        expected = None
    if drop == "SLURM_LOCALID" or expected is None:
        with pytest.raises(SystemExit, match="set LOCAL_RANK and LOCAL_WORLD_SIZE"):
            runpy.run_path(str(path), run_name="exported")
        return
    names = runpy.run_path(str(path), run_name="exported")
    assert (names["local_rank"], names["local_world_size"]) == expected == (1, 2)


DDP_ADAMW = ("import torch\nfrom torch.nn.parallel import DistributedDataParallel as DDP\n"
             "torch.manual_seed(0)\nmodel = DDP(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),\n"
             "                               torch.nn.Linear(32, 1)))\n"
             "optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)\n"
             "for step in range(3):\n"
             "    loss = model(torch.randn(8, 16)).pow(2).mean()\n"
             "    optimizer.zero_grad()\n    loss.backward()\n    optimizer.step()\n"
             "print(f'trained {rank}')")  # one write: the ranks share torchrun's unbuffered stdout

TORCHRUN_STYLE = '''import os
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.optim as optim
from torch.nn.parallel import DistributedDataParallel as DDP


def setup(rank, world_size):
    os.environ['MASTER_ADDR'] = 'localhost'
    os.environ['MASTER_PORT'] = '12355'
    dist.init_process_group("gloo", rank=rank, world_size=world_size)


def cleanup():
    dist.destroy_process_group()


def demo_basic(rank, world_size):
    print(f"Running basic DDP example on rank {rank}.")
    setup(rank, world_size)
    ddp_model = DDP(nn.Linear(10, 5))
    optimizer = optim.SGD(ddp_model.parameters(), lr=0.001)
    optimizer.zero_grad()
    nn.MSELoss()(ddp_model(torch.randn(20, 10)), torch.randn(20, 5)).backward()
    optimizer.step()
    cleanup()
    print(f"Finished running basic DDP example on rank {rank}.")


demo_basic(rank, world_size)'''

# Imported by every process of the torchrun below (first on PYTHONPATH): when the script has ended, before
# the interpreter tears down its modules, each rank says which gloo threads are still running.
AT_EXIT = '''import atexit, os, sys


def _gloo_threads():
    if os.environ.get("RANK") is None or not os.path.isdir("/proc/self/task"):
        return
    names = sorted(open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task"))
    gloo = [n for n in names if "gloo" in n]
    print(f"rank {os.environ['RANK']} gloo threads at exit: {gloo}", flush=True)


atexit.register(_gloo_threads)
'''


# One write per line: the two ranks share torchrun's unbuffered stdout, and print()'s separate writes of
# "sum", " ", "2.0" and "\n" interleaved as "sumsum  2.02.0" in CI.
SUM_CELL = "import sys\nt = torch.ones(1)\ndist.all_reduce(t)\nsys.stdout.write(f'sum {t.item()}\\n')"


@pytest.fixture(scope="module")
def exported_run(tmp_path_factory):
    """The output of one torchrun (2 ranks, gloo) of the script exported from DDP_ADAMW, TORCHRUN_STYLE and
    SUM_CELL, every rank saying at exit which gloo threads still run (AT_EXIT). The two tests below read it: a
    torchrun of fresh interpreters that import torch costs seconds."""
    tmp_path = tmp_path_factory.mktemp("exported")
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(AT_EXIT)
    env = torchrun_env()
    env["PYTHONPATH"] = os.pathsep.join([str(hook), env["PYTHONPATH"]])
    path = write_script(tmp_path / "exported.py", [("cell", "-n 2", c) for c in (DDP_ADAMW, TORCHRUN_STYLE, SUM_CELL)],
                        world_size=2, backend="gloo")

    def run(port):
        proc = start_torchrun("--nnodes=1", "--nproc-per-node=2", "--rdzv-backend=static", "--node-rank=0",
                              "--master-addr=127.0.0.1", f"--master-port={port}", script=path, cwd=tmp_path, env=env)
        return finish(proc, "the exported script")

    return retry_on_port_clash(run)


def test_an_exported_ddp_cell_frees_its_group_before_the_interpreter_ends(exported_run):
    """The abort at exit ("terminate called without an active exception"): the cells' global
    DDP model kept its Reducer and the gloo group alive into the interpreter's shutdown."""
    if not os.path.isdir("/proc/self/task"):
        pytest.skip("reads /proc")
    out = exported_run
    found = dict(re.findall(r"rank (\d) gloo threads at exit: (\[[^\]]*\])", out))  # two ranks share stdout
    assert sorted(found) == ["0", "1"] and "trained 0" in out and "trained 1" in out, out[-3000:]
    for r, threads in found.items():
        assert threads == "[]", f"rank {r}: the group's gloo threads were alive at exit: {threads}"


def test_an_exported_torchrun_style_cell_runs_and_keeps_the_group(exported_run):
    """A cell that calls init_process_group and destroy_process_group itself (lesson 00's demo_basic) failed in
    the script with "trying to initialize the default process group twice!"."""
    out = exported_run
    for r in (0, 1):
        assert f"Finished running basic DDP example on rank {r}." in out, out[-3000:]
    assert out.count("sum 2.0") == 2, out[-3000:]
    assert out.count("init_process_group(): the process group is already initialised") == 2
    assert out.count("destroy_process_group(): kept the process group for the next cell.") == 2


def test_an_exported_init_process_group_with_another_world_size_says_why(tmp_path):
    path = write_script(tmp_path / "bad.py", [("cell", "-n 2", "dist.init_process_group('gloo', world_size=3)")],
                        world_size=2, backend="gloo")

    def run(port):
        proc = start_torchrun("--nnodes=1", "--nproc-per-node=2", "--rdzv-backend=static", "--node-rank=0",
                              "--master-addr=127.0.0.1", f"--master-port={port}", script=path, cwd=tmp_path)
        return finish(proc, "the exported script", check=False)

    out = retry_on_port_clash(run)
    assert "world_size=3, but torchrun started 2 processes" in out, out[-3000:]


def test_an_exported_script_whose_cell_uses_a_spawn_pool_runs_once_per_rank(tmp_path):
    """A spawn (or forkserver) child imports the script again: only the cells' definitions run there, never the
    process group's start or the cells' statements, so a Pool of a cell's function works as in the notebook."""
    cell = ("import multiprocessing as mp\n"
            "def sq(x):\n    return x * x\n"
            "with mp.get_context('spawn').Pool(1) as pool:\n    got = pool.map(sq, [2, 3])\n"
            "print('squares', got)")
    path = write_script(tmp_path / "pool.py", [("cell", "-n 1", cell)], world_size=1, backend="gloo")
    env = torchrun_env(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(free_port()))
    proc = subprocess.run([sys.executable, str(path)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and "squares [4, 9]" in proc.stdout, proc.stdout + proc.stderr[-3000:]
