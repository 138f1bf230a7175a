"""check_all_reduce (03_all_reduce_by_hand) on real gloo ranks: it passes correct all-reduces,
catches each classic mistake with a plain-words reason, and the byte counter counts exactly.

    .venv/bin/python -m pytest tests/test_all_reduce_checker.py -p no:randomly
"""
import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist

from course_utils import Cluster
from course_utils.allreduce import chunked_ring_all_reduce, count_sent_bytes, naive_all_reduce, ring_all_reduce
from course_utils.checks import check_all_reduce

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the ranks cannot import this test file


@pytest.fixture(scope="module")
def clusters():
    made = {n: Cluster(world_size=n, backend="gloo", timeout=30) for n in (2, 3, 4)}
    yield made
    for c in made.values():
        c.shutdown()


# -- wrong implementations, one classic mistake each -------------------------------------------
def ring_dropping_remainder(tensor):
    """A chunked ring whose chunks are numel // n long: the last numel % n elements are never reduced."""
    rank, n = dist.get_rank(), dist.get_world_size()
    flat = tensor.view(-1)
    size = flat.numel() // n
    chunks = [flat[i * size:(i + 1) * size] for i in range(n)]
    left, right = (rank - 1) % n, (rank + 1) % n
    buf = torch.empty_like(chunks[0])
    for s in range(n - 1):
        req = dist.isend(chunks[(rank - s) % n], right)
        dist.recv(buf, left)
        chunks[(rank - s - 1) % n] += buf
        req.wait()
    for s in range(n - 1):
        req = dist.isend(chunks[(rank + 1 - s) % n], right)
        dist.recv(buf, left)
        chunks[(rank - s) % n].copy_(buf)
        req.wait()


def averaging_ring(tensor):
    chunked_ring_all_reduce(tensor)
    tensor /= dist.get_world_size()


def reduce_without_broadcast(tensor):
    """Rank 0 sums everything, but never sends the sum back."""
    if dist.get_rank() == 0:
        buf = torch.empty_like(tensor)
        for src in range(1, dist.get_world_size()):
            dist.recv(buf, src=src)
            tensor += buf
    else:
        dist.send(tensor, dst=0)


def using_the_collective(tensor):
    dist.all_reduce(tensor)


def gather_then_broadcast(tensor):
    """Right answer from collectives (reduce + broadcast): still not point-to-point."""
    dist.reduce(tensor, dst=0)
    dist.broadcast(tensor, src=0)


def returning_a_copy(tensor):
    out = tensor.clone()
    chunked_ring_all_reduce(out)
    return out


def raising_stub(tensor):
    raise NotImplementedError("write the chunked ring here")


def deadlocking(tensor):
    """Every rank waits to receive before anyone sends."""
    rank, n = dist.get_rank(), dist.get_world_size()
    buf = torch.empty_like(tensor)
    dist.recv(buf, (rank - 1) % n)
    dist.send(tensor, (rank + 1) % n)


# -- the checker passes correct implementations ------------------------------------------------
@pytest.mark.parametrize("impl", [chunked_ring_all_reduce, ring_all_reduce, naive_all_reduce])
def test_passes_correct_implementations(clusters, impl):
    check_all_reduce(impl, clusters=clusters)  # raises AssertionError if it wrongly rejects


@pytest.mark.parametrize("impl, words", [
    (ring_dropping_remainder, ["elements are wrong", "not divisible", "tensor_split"]),
    (averaging_ring, ["divided by", "average"]),
    (reduce_without_broadcast, ["only rank 0 holds the right sum"]),
    (using_the_collective, ["dist.all_reduce", "point-to-point"]),
    (gather_then_broadcast, ["dist.broadcast", "dist.reduce", "point-to-point"]),
    (returning_a_copy, ["returned the sum", "in place"]),
    (raising_stub, ["raised NotImplementedError on ranks 0, 1 of 2", "write the chunked ring here"]),
])
def test_catches_each_mistake(clusters, impl, words):
    with pytest.raises(AssertionError) as info:
        check_all_reduce(impl, clusters=clusters)
    message = str(info.value)
    for w in words:
        assert w in message, f"the checker's message for {impl.__name__} should mention {w!r}; it was:\n{message}"


def test_deadlock_becomes_an_assertion(clusters):
    with pytest.raises(AssertionError) as info:
        check_all_reduce(deadlocking, clusters={2: clusters[2]}, world_sizes=(2,), timeout=3)
    assert "did not finish within 3 s" in str(info.value), str(info.value)
    check_all_reduce(chunked_ring_all_reduce, clusters={2: clusters[2]}, world_sizes=(2,))  # usable after


def test_guard_is_removed_after_a_check(clusters):
    with pytest.raises(AssertionError):
        check_all_reduce(using_the_collective, clusters={2: clusters[2]}, world_sizes=(2,))
    wrapped = clusters[2].run("import torch.distributed as dist; dist.all_reduce.__name__")
    assert wrapped == ["all_reduce", "all_reduce"], f"dist.all_reduce is still wrapped on the ranks: {wrapped}"


# -- count_sent_bytes: exact byte counts per algorithm -----------------------------------------
def _bytes_per_rank(numel):
    from course_utils import allreduce

    out = {}
    for name in ("naive_all_reduce", "ring_all_reduce", "chunked_ring_all_reduce"):
        t = torch.ones(numel)
        with count_sent_bytes() as sent:
            getattr(allreduce, name)(t)
        assert torch.equal(t, torch.full((numel,), float(dist.get_world_size()))), name
        out[name] = sent["bytes"]
    return out


@pytest.mark.parametrize("n", [2, 3, 4])
def test_bytes_sent_match_the_formulas(clusters, n):
    numel = 120                      # divisible by 2, 3 and 4: the chunks are equal
    size = numel * 4                 # float32 bytes
    got = clusters[n].run(_bytes_per_rank, numel)
    for r, counts in enumerate(got):
        assert counts["chunked_ring_all_reduce"] == 2 * (n - 1) * size // n, (r, counts)
        assert counts["ring_all_reduce"] == (n - 1) * size, (r, counts)
        assert counts["naive_all_reduce"] == ((n - 1) * size if r == 0 else size), (r, counts)


def test_count_sent_bytes_restores_send(clusters):
    def probe():
        import torch.distributed as d
        before = (d.send, d.isend)
        with count_sent_bytes():
            pass
        return (d.send, d.isend) == before
    assert clusters[2].run(probe) == [True, True], "count_sent_bytes must put dist.send/isend back"
