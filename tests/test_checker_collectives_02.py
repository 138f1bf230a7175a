"""The three self-checks of 02_collectives_sandbox's exercises (check_all_reduce_in_two_halves, check_ring_shift,
check_gather_to_rank0) against right answers written differently from the course's solutions: another import style
(names imported from torch.distributed at the top of a cell, as a notebook would), ``async_op=True`` then
``wait()``, blocking send/recv. The typical wrong answers and the notebook's scaffolds are in
tests/test_exercises_01_03.py. Real gloo ranks (4, and 3 for the ring shift).

    .venv/bin/python -m pytest -n 0 tests/test_checker_collectives_02.py
"""
import sys

import pytest
import torch
import torch.distributed as dist
from torch.distributed import all_gather, gather, irecv, isend, reduce_scatter   # a learner's import style

from conftest import register_by_value
from course_utils.checks import check_all_reduce_in_two_halves, check_gather_to_rank0, check_ring_shift

register_by_value(sys.modules[__name__])  # the ranks cannot import this test file


@pytest.fixture(scope="module")
def clusters(make_cluster):
    return {4: make_cluster(world_size=4, timeout=30), 3: make_cluster(world_size=3, timeout=30)}


def halves_imported(x):
    n, r = dist.get_world_size(), dist.get_rank()
    chunks = list(x.chunk(n))
    mine = torch.zeros_like(chunks[r])
    reduce_scatter(mine, chunks)
    pieces = [torch.zeros_like(c) for c in chunks]
    all_gather(pieces, mine)
    return torch.cat(pieces)


def halves_async(x):
    n, r = dist.get_world_size(), dist.get_rank()
    chunks = list(x.chunk(n))
    mine = torch.zeros_like(chunks[r])
    dist.reduce_scatter(mine, chunks, async_op=True).wait()
    pieces = [torch.zeros_like(c) for c in chunks]
    work = dist.all_gather(pieces, mine, async_op=True)
    work.wait()
    return torch.cat(pieces)


def shift_imported(x):
    r, n = dist.get_rank(), dist.get_world_size()
    send = x
    for _ in range(2):
        buf = torch.zeros_like(x)
        reqs = [isend(send, (r + 1) % n), irecv(buf, (r - 1) % n)]
        for req in reqs:
            req.wait()
        send = buf
    return buf


def shift_blocking(x):
    """Blocking send/recv, even ranks first (the lesson's section 8 ordering); on 3 ranks rank 2 and rank 0 are
    both even, so the odd-sized ring needs rank 0 to receive first."""
    r, n = dist.get_rank(), dist.get_world_size()
    send = x
    for _ in range(2):
        buf = torch.zeros_like(x)
        if r % 2 == 0 and r != n - 1 or n % 2 == 0 and r % 2 == 0:
            dist.send(send, (r + 1) % n)
            dist.recv(buf, (r - 1) % n)
        else:
            dist.recv(buf, (r - 1) % n)
            dist.send(send, (r + 1) % n)
        send = buf
    return buf


def gather_imported(x):
    r, n = dist.get_rank(), dist.get_world_size()
    out = [torch.zeros_like(x) for _ in range(n)] if r == 0 else None
    gather(x, out, dst=0)
    return out


def gather_async(x):
    r, n = dist.get_rank(), dist.get_world_size()
    out = [torch.zeros_like(x) for _ in range(n)] if r == 0 else None
    dist.gather(x, gather_list=out, dst=0, async_op=True).wait()
    return out


@pytest.mark.parametrize("fn", [halves_imported, halves_async])
def test_two_halves_accepts_right_answers_written_differently(clusters, fn):
    check_all_reduce_in_two_halves(fn, clusters=clusters)


@pytest.mark.parametrize("fn", [shift_imported, shift_blocking])
def test_ring_shift_accepts_right_answers_written_differently(clusters, fn):
    check_ring_shift(fn, clusters=clusters)


@pytest.mark.parametrize("fn", [gather_imported, gather_async])
def test_gather_accepts_right_answers_written_differently(clusters, fn):
    check_gather_to_rank0(fn, clusters=clusters)
