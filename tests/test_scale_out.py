"""scripts/train_micro_ddp.py under torchrun: two "nodes" x 2 ranks on loopback give the same final
loss as one node x 4 ranks, to the last digit (data sharded by global rank, everything seeded)."""
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "train_micro_ddp.py"
TRAIN_ARGS = ["--steps", "3", "--global-batch-size", "16", "--micro-batch-size", "2", "--log-every", "1"]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env():
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(ROOT), env.get("PYTHONPATH")] if p)
    env.pop("PYTEST_CURRENT_TEST", None)
    return env


def _torchrun(*args):
    cmd = [sys.executable, "-m", "torch.distributed.run", *args, str(SCRIPT), *TRAIN_ARGS]
    return subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(proc, what):
    try:
        out, _ = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        raise AssertionError(f"{what} did not finish within 240 s:\n{out[-3000:]}")
    assert proc.returncode == 0, f"{what} failed with exit code {proc.returncode}:\n{out[-3000:]}"
    return out


def _final_loss(out, what):
    found = re.findall(r"^final_loss=(\S+)$", out, flags=re.M)
    assert len(found) == 1, f"{what}: expected one final_loss= line from rank 0, got {found}:\n{out[-3000:]}"
    return found[0]


def test_two_nodes_match_one_node():
    port, single_port = _free_port(), _free_port()
    common = ["--nnodes=2", "--nproc-per-node=2", "--master-addr=127.0.0.1", f"--master-port={port}",
              "--rdzv-backend=static", "--max-restarts=0"]
    node0 = _torchrun(*common, "--node-rank=0")
    node1 = _torchrun(*common, "--node-rank=1")
    one_node = _torchrun("--nnodes=1", "--nproc-per-node=4", "--master-addr=127.0.0.1",
                         f"--master-port={single_port}", "--rdzv-backend=static", "--node-rank=0", "--max-restarts=0")
    out0 = _finish(node0, "node 0 of 2")
    out1 = _finish(node1, "node 1 of 2")
    out_single = _finish(one_node, "1 node x 4")

    two = _final_loss(out0, "2 nodes x 2 (node 0 hosts rank 0)")
    assert "final_loss=" not in out1, "only global rank 0 prints final_loss; node 1 holds ranks 2 and 3"
    one = _final_loss(out_single, "1 node x 4")
    assert "world_size=4" in out0 and "world_size=4" in out_single, "both layouts must form a world of 4 ranks"
    assert two == one, f"final loss depends on the node layout: 2x2 gave {two}, 1x4 gave {one}"
    assert 2.0 < float(two) < 4.5, f"a character model's loss after 3 steps should be near ln(56) = 4.0: {two}"
    steps = re.findall(r"^step +(\d+) +loss (\S+)$", out0, flags=re.M)
    assert steps == re.findall(r"^step +(\d+) +loss (\S+)$", out_single, flags=re.M) and len(steps) == 3, \
        f"per-step losses differ between layouts:\n{out0}\n{out_single}"
    print(f"2 nodes x 2 ranks: final_loss={two}; 1 node x 4 ranks: final_loss={one}")
