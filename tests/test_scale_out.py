"""scripts/train_micro_ddp.py launched the ways docs/multi-node.md shows:

- ``torchrun --standalone --nproc-per-node=4`` (one node, 4 processes);
- two "nodes" x 2 ranks on loopback, with the static rendezvous (``--master-addr/--master-port``) and with
  the elastic one (``--rdzv-backend=c10d --rdzv-endpoint --rdzv-id``): the same final loss as one node x 4,
  to the last digit (data sharded by global rank, everything seeded);
- ``python scripts/train_micro_ddp.py``: one process, no torchrun, world size 1: the same micro-batches, so
  the same loss up to floating-point summation order (its ``main(argv)`` run in this process: the pytest process
  has torch imported already, and tests/test_train_script.py starts the script as a plain process).

    .venv/bin/python -m pytest tests/test_scale_out.py -p no:randomly

GPUs are hidden (conftest.torchrun_env), so the script picks gloo on any machine. Every torchrun runs in its
own session and its whole process group is killed when a test ends, so a failing test leaves no rank behind.
A fixed port (the static and c10d forms) is probed, then handed to torchrun: if another process takes it in
between, the launch is retried on a new port (conftest.retry_on_port_clash).
"""
import importlib.util
import re

import pytest
import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401  before any group of this process: see the script's setup()

from conftest import ROOT, finish, kill_process_group, retry_on_port_clash, start_torchrun, wait_until_listening

SCRIPT = ROOT / "scripts" / "train_micro_ddp.py"
TRAIN_ARGS = ["--steps", "3", "--global-batch-size", "16", "--micro-batch-size", "2", "--log-every", "1"]
STEP = re.compile(r"^step +(\d+) +loss (\S+)$", re.M)
FINAL = re.compile(r"^final_loss=(\S+)$", re.M)


class Run:
    """What one launch printed: the output of every node, rank 0's final loss and per-step losses."""

    def __init__(self, what, *outputs):
        self.what, self.out = what, "\n".join(outputs)
        found = FINAL.findall(self.out)
        assert len(found) == 1, (f"{what}: expected one final_loss= line (from global rank 0 only), "
                                 f"got {found}:\n{self.out[-3000:]}")
        self.final_loss = found[0]
        self.steps = STEP.findall(self.out)
        assert [s for s, _ in self.steps] == ["1", "2", "3"], f"{what}: expected steps 1..3:\n{self.out[-3000:]}"
        assert "backend=gloo" in self.out, f"{what}: GPUs are hidden, so the script must pick gloo:\n{self.out}"


@pytest.fixture(scope="module")
def one_node():
    """docs/multi-node.md's one-node command; --standalone picks its own free port, so nothing can clash."""
    proc = start_torchrun("--standalone", "--nproc-per-node=4", script=SCRIPT, script_args=TRAIN_ARGS)
    try:
        run = Run("1 node x 4 (--standalone)", finish(proc, "torchrun --standalone --nproc-per-node=4"))
    finally:
        kill_process_group(proc)
    assert "world_size=4 accum_steps=2" in run.out, f"--standalone must form a world of 4 ranks:\n{run.out}"
    return run


def _two_nodes(torchrun, what, node_args):
    """Node 0, then (once node 0 listens on the rendezvous port) node 1; retried on a port clash."""
    def launch(port):
        node0 = torchrun(*node_args(port, 0), script=SCRIPT, script_args=TRAIN_ARGS)
        wait_until_listening(node0, port, f"{what}, node 0")
        node1 = torchrun(*node_args(port, 1), script=SCRIPT, script_args=TRAIN_ARGS)
        try:
            return finish(node0, f"{what}, node 0"), finish(node1, f"{what}, node 1")
        finally:
            kill_process_group(node0)
            kill_process_group(node1)

    return retry_on_port_clash(launch)


def _assert_same_run(two, one):
    assert "world_size=4 accum_steps=2" in two.out, f"{two.what} must form a world of 4 ranks:\n{two.out}"
    assert two.final_loss == one.final_loss, (
        f"the final loss depends on the node layout: {two.what} gave {two.final_loss}, {one.what} {one.final_loss}")
    assert two.steps == one.steps, f"per-step losses differ: {two.what} {two.steps}, {one.what} {one.steps}"
    assert 2.0 < float(two.final_loss) < 4.5, (
        f"a character model's loss after 3 steps should be near ln(vocabulary size) = 4.0: {two.final_loss}")


def test_two_nodes_with_static_rendezvous_match_one_node(torchrun, one_node):
    def node_args(port, node_rank):  # docs/multi-node.md's two lines, with MASTER=127.0.0.1
        return ["--nnodes=2", f"--node-rank={node_rank}", "--nproc-per-node=2", "--master-addr=127.0.0.1",
                f"--master-port={port}", "--rdzv-backend=static"]

    out0, out1 = _two_nodes(torchrun, "2 nodes x 2 (static)", node_args)
    assert FINAL.search(out0) and not FINAL.search(out1), (
        "with --node-rank=0, node 0 holds global rank 0 (the one that prints final_loss); node 1 holds ranks 2, 3")
    two = Run("2 nodes x 2 (static)", out0, out1)
    _assert_same_run(two, one_node)
    print(f"2 nodes x 2 ranks (static): final_loss={two.final_loss}; 1 node x 4: final_loss={one_node.final_loss}")


def test_two_nodes_with_elastic_c10d_rendezvous_match_one_node(torchrun, one_node):
    def node_args(port, node_rank):  # docs/multi-node.md's elastic form: the same line on every node
        return ["--nnodes=2", "--nproc-per-node=2", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
                "--rdzv-id=test-scale-out"]

    out0, out1 = _two_nodes(torchrun, "2 nodes x 2 (c10d)", node_args)
    # c10d assigns node ranks itself, so global rank 0 may live on either node: Run checks there is one.
    _assert_same_run(Run("2 nodes x 2 (c10d)", out0, out1), one_node)


def test_one_process_without_torchrun(one_node, capsys, monkeypatch):
    """What `python scripts/train_micro_ddp.py` runs, its main(argv) with no torchrun variable set (RANK absent):
    a world of one, here in this process."""
    spec = importlib.util.spec_from_file_location("train_micro_ddp", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    monkeypatch.delenv("RANK", raising=False)
    capsys.readouterr()
    # one thread, as torchrun_env gives every rank (OMP_NUM_THREADS=1): beside the other pytest-xdist worker on 2
    # cores, torch's 2 intra-op threads wait on each other (this run: 0.3 s on 1 thread; on 2, 1.1 s beside one
    # busy process and 12-30 s on a loaded machine)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        script.main(TRAIN_ARGS)
    finally:
        torch.set_num_threads(threads)
        if dist.is_initialized():  # main() destroys its group when it ends; not when it fails
            dist.destroy_process_group()
    single = Run("python scripts/train_micro_ddp.py", capsys.readouterr().out)
    assert "world_size=1 accum_steps=8" in single.out, f"one process must be a world of 1 with 8 micro-steps:\n" \
                                                       f"{single.out}"
    # World size 1 with 8 micro-steps sees the same 8 micro-batches as 4 ranks x 2 (sharded by global rank);
    # only the order of the floating-point sums differs.
    got = [float(loss) for _, loss in single.steps] + [float(single.final_loss)]
    want = [float(loss) for _, loss in one_node.steps] + [float(one_node.final_loss)]
    assert got == pytest.approx(want, rel=1e-4), (
        f"one process without torchrun should train like 1 node x 4 ranks on the same global batch: "
        f"{got} against {want}")
