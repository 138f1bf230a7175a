"""course_utils.engine.export.write_script: %%ddp cells become a torchrun script that does what the ranks did."""
import ast
import os
import subprocess
import sys
from pathlib import Path

from course_utils.engine.export import write_script

ROOT = Path(__file__).resolve().parent.parent

CELLS = [
    ("-n 2", "import torch, torch.distributed as dist\n"
             "t = torch.ones(1) * (rank + 1)\n"
             "dist.all_reduce(t)\n"
             "print(f'rank {rank} of {world_size} on {device}: sum {t.item():g}')"),
    ("-n 2 --rank 0", "%time y = t * 2\n"
                      "for i in range(1):\n"
                      "    %timeit y + 1\n"
                      "!echo never runs\n"
                      "local_rank, y.item()"),
    ("-n 2", "x = 10; x + rank  # the last value is shown, as the cell did"),
    ("-n 2", "total = (sum(range(4))\n"
             "         % 5)  # a line starting with % inside an expression is not a magic\n"
             "dist.barrier()"),
]


def test_exported_script_is_valid_python_with_magics_commented(tmp_path):
    path = write_script(tmp_path / "exported.py", CELLS)
    text = path.read_text()
    ast.parse(text)  # raises if any magic was left in
    assert "    pass  # %timeit y + 1" in text, "an indented magic must become `pass`, keeping the block valid"
    assert "y = t * 2  # %time y = t * 2" in text, "%time's statement must still run"
    assert "# !echo never runs" in text
    assert "% 5)" in text and "# % 5)" not in text, "a continued expression must not be taken for a magic"
    assert text.index('dist.init_process_group("gloo")') < text.index("# %%ddp -n 2") < \
        text.rindex("dist.destroy_process_group()"), "preamble, cells, then destroy_process_group"


def test_exported_script_runs_under_torchrun(tmp_path):
    path = write_script(tmp_path / "exported.py", CELLS)
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    env.pop("PYTEST_CURRENT_TEST", None)
    logs = tmp_path / "logs"  # one stdout file per rank: on a shared stdout, two ranks' lines can mix mid-line
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           f"--log-dir={logs}", "--redirects=1", str(path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"the exported script failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    out = "".join(p.read_text() for p in sorted(logs.rglob("stdout.log")))
    assert len(list(logs.rglob("stdout.log"))) == 2, f"expected one stdout.log per rank under {logs}"
    lines = sorted(line for line in out.splitlines() if line.startswith(("rank ", "[rank ")))
    assert lines == [
        "[rank 0] (0, 6.0)", "[rank 0] 10", "[rank 1] (1, 6.0)", "[rank 1] 11",
        "rank 0 of 2 on cpu: sum 3", "rank 1 of 2 on cpu: sum 3",
    ], f"unexpected output of the exported script:\n{out}"
    assert "never runs" not in out + proc.stdout, "a !shell line must not run"
