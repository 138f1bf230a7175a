"""Code written for torchrun or torch.multiprocessing.spawn runs unchanged: the PyTorch DDP tutorial's
``demo_basic`` (its ``setup()`` calls ``init_process_group``, its ``cleanup()`` calls
``destroy_process_group``) on a live cluster, and through ``course_utils.spawn``."""
import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.optim as optim
from torch.nn.parallel import DistributedDataParallel as DDP

from conftest import PortClash, alive, is_port_clash, register_by_value, retry_on_port_clash
from course_utils import DistributedError, spawn

register_by_value(sys.modules[__name__])


# -- the tutorial's code, as published (CPU: no device_ids, no .to(rank)) -----------------------
def setup(rank, world_size):
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = os.environ.get("TUTORIAL_PORT", "12355")  # the tutorial's port; the test's free one
    dist.init_process_group("gloo", rank=rank, world_size=world_size)


def cleanup():
    dist.destroy_process_group()


class ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


def demo_basic(rank, world_size):
    print(f"Running basic DDP example on rank {rank}.")
    setup(rank, world_size)
    torch.manual_seed(rank)
    model = ToyModel()
    ddp_model = DDP(model)
    loss_fn = nn.MSELoss()
    optimizer = optim.SGD(ddp_model.parameters(), lr=0.001)
    optimizer.zero_grad()
    outputs = ddp_model(torch.randn(20, 10))
    labels = torch.randn(20, 5)
    loss_fn(outputs, labels).backward()
    optimizer.step()
    weights = model.net1.weight.detach().clone()
    cleanup()
    print(f"Finished running basic DDP example on rank {rank}.")
    return weights


# -- on a live cluster ------------------------------------------------------------------------
def test_demo_basic_runs_on_a_live_cluster_and_the_cluster_works_afterwards(make_cluster, capfd):
    c = make_cluster(2, timeout=120)
    c.run("kept = rank")
    c.push(demo_basic=demo_basic)
    weights = c.run("demo_basic(rank, world_size)")
    torch.testing.assert_close(weights[0], weights[1])  # DDP kept the replicas equal
    out = capfd.readouterr()
    assert out.out.count("Finished running basic DDP example") == 2
    for r in (0, 1):
        assert (f"[rank {r}] note: init_process_group(): the process group is already initialised "
                f"(rank {r} of 2, gloo); this call does nothing.") in out.err
        assert f"[rank {r}] note: destroy_process_group(): kept the process group for the next cell." in out.err
    code = "import torch, torch.distributed as dist\nt = torch.ones(1)\ndist.all_reduce(t)\nt.item()"
    assert c.run(code) == [2.0] * 2
    assert c.pull("kept") == [0, 1], "nothing was restarted"


@pytest.mark.parametrize("call, words", [
    ("dist.init_process_group('gloo', rank=rank, world_size=3)", "world_size=3, but this cluster has 2 ranks"),
    ("dist.init_process_group('gloo', rank=1 - rank, world_size=2)", "but this is rank"),
    ("dist.init_process_group('nccl')", "backend='nccl', but this cluster runs 'gloo'"),
])
def test_an_incompatible_init_process_group_is_a_clear_error(make_cluster, call, words):
    c = make_cluster(2, timeout=120)
    with pytest.raises(DistributedError, match="ValueError: init_process_group: ") as info:
        c.run(f"import torch.distributed as dist\n{call}")
    assert words in str(info.value)
    assert c.run("rank") == [0, 1]


# -- spawn ------------------------------------------------------------------------------------
def _spawn(*args, port_env=None, **kwargs):
    """``spawn(*args, **kwargs)``, launched again on a fresh port when a rank's port was taken by someone else
    (conftest.retry_on_port_clash): the tutorial's own port, set in ``$port_env``, or the one spawn presets."""
    def launch(port):
        saved = os.environ.get(port_env) if port_env else None
        if port_env:
            os.environ[port_env] = str(port)
        try:
            return spawn(*args, **kwargs)
        except DistributedError as exc:
            if is_port_clash(str(exc)):
                raise PortClash(str(exc)[-500:]) from exc
            raise
        finally:
            if port_env:
                if saved is None:
                    os.environ.pop(port_env, None)
                else:
                    os.environ[port_env] = saved
    return retry_on_port_clash(launch)


def test_spawn_runs_the_tutorial_unchanged_and_returns_values_in_rank_order(capfd):
    # the tutorial's fixed 12355 could be taken here: a free port, retried if someone takes it first
    weights = _spawn(demo_basic, args=(2,), nprocs=2, join=True, backend="gloo", port_env="TUTORIAL_PORT")
    assert len(weights) == 2
    torch.testing.assert_close(weights[0], weights[1])
    out = capfd.readouterr().out
    assert "[rank 0] Running basic DDP example on rank 0.\n[rank 0] Finished running basic DDP example on rank 0.\n" \
        in out and "[rank 1] Finished running basic DDP example on rank 1.\n" in out


def _probe(rank, base):
    import os

    import torch.distributed as dist
    seen = (dist.is_initialized(), os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]) > 0)
    dist.init_process_group("gloo", rank=rank, world_size=3)  # env:// with the preset address and port
    out = [None] * 3
    dist.all_gather_object(out, rank + base)
    dist.destroy_process_group()
    return seen, out, os.getpid()


def test_spawn_starts_ranks_without_a_group_and_presets_a_loopback_port():
    got = _spawn(_probe, args=(100,), nprocs=3, backend="gloo")
    assert [g[:2] for g in got] == [((False, "127.0.0.1", True), [100, 101, 102])] * 3
    assert not [pid for *_, pid in got if alive(pid)], "spawn's ranks end with the call"


def test_spawn_sends_notebook_functions_by_value_and_reports_failures():
    scale = 7

    def job(rank):
        if rank == 1:
            raise ValueError(f"bad rank {rank * scale}")
        return rank

    with pytest.raises(DistributedError, match="rank 1 failed with ValueError: bad rank 7"):
        _spawn(job, nprocs=2, backend="gloo")
    assert _spawn(lambda rank, k: rank * k, args=(scale,), nprocs=2, backend="gloo") == [0, 7]


def test_spawn_stops_the_other_ranks_when_one_fails():
    def job(rank):
        import torch
        import torch.distributed as dist
        dist.init_process_group("gloo", rank=rank, world_size=2)
        if rank == 0:
            raise RuntimeError("rank 0 gives up")
        dist.all_reduce(torch.ones(1))  # waits for rank 0 forever (the group's timeout is 30 min)

    with pytest.raises(DistributedError) as info:
        _spawn(job, nprocs=2, backend="gloo", timeout=120)
    assert "rank 0 failed with RuntimeError: rank 0 gives up" in str(info.value)
    assert "rank 1: " in str(info.value) and "The other ranks were stopped." in str(info.value)


def test_spawn_rejects_what_it_cannot_do():
    with pytest.raises(ValueError, match=r"join=False\) is not supported"):
        spawn(print, nprocs=2, join=False)
    with pytest.raises(ValueError, match="args must be a tuple"):
        spawn(print, args=[1], nprocs=2)


def test_a_taken_port_is_retried_on_a_fresh_one(monkeypatch):
    import socket

    import conftest
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        handed = []

        def free_port():  # the taken port first, then really free ones
            handed.append(taken.getsockname()[1] if not handed else real_free_port())
            return handed[-1]

        real_free_port = conftest.free_port
        monkeypatch.setattr(conftest, "free_port", free_port)
        weights = _spawn(demo_basic, args=(2,), nprocs=2, backend="gloo", port_env="TUTORIAL_PORT", timeout=120)
    assert len(handed) == 2 and len(weights) == 2, f"one clash, then a free port: ports handed out {handed}"
