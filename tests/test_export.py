"""``%ddp export PATH``: the %%ddp cells become a torchrun script that prints, rank by rank, what the
ranks printed and showed in the notebook (issue 17, fault 3).

Backend-aware (issue 22): on a machine with 2 or more GPUs the kernel's ``%%ddp -n 2`` cells run on NCCL with
``device = cuda:rank``, so the cells build their tensors on ``device`` and the script runs with the same GPUs
visible; elsewhere both run on gloo with the GPUs hidden (``torchrun_env``), as before."""
import ast
import os

from conftest import finish, retry_on_port_clash, start_torchrun, torchrun_env
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
        text.index("_show(a + lr)") < text.rindex("dist.destroy_process_group()")
