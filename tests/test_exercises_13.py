"""The self-checks of 13_fsdp_by_hand, fed the typical wrong answers (each must fail with a reason a learner can
act on) and the course's solution (which must pass); check_micro_fsdp's own cases are in
tests/test_checker_micro_fsdp.py. Real gloo ranks.

    .venv/bin/python -m pytest tests/test_exercises_13.py -p no:randomly
"""
import sys

import pytest
import torch

from conftest import register_by_value
from exercise_helpers import verdict

register_by_value(sys.modules[__name__])  # the wrong answers below run on the ranks

NOTEBOOK = "13_fsdp_by_hand.ipynb"


@pytest.fixture(scope="module")
def cluster(make_cluster):
    return make_cluster(2, timeout=120)


# -- check_pad_and_shard ------------------------------------------------------------------------------

def pad_no_padding(tensors, rank, world_size):       # the last rank gets a shorter slice
    flat = torch.cat([t.reshape(-1).float() for t in tensors])
    n = -(-flat.numel() // world_size)
    return flat[rank * n:(rank + 1) * n].clone(), flat.numel()


def pad_at_front(tensors, rank, world_size):
    flat = torch.cat([t.reshape(-1).float() for t in tensors])
    padded = -(-flat.numel() // world_size) * world_size
    flat = torch.nn.functional.pad(flat, (padded - flat.numel(), 0))
    n = padded // world_size
    return flat[rank * n:(rank + 1) * n].clone(), padded


def pad_strided(tensors, rank, world_size):          # every W-th element: not a contiguous slice
    flat = torch.cat([t.reshape(-1).float() for t in tensors])
    padded = -(-flat.numel() // world_size) * world_size
    flat = torch.nn.functional.pad(flat, (0, padded - flat.numel()))
    return flat[rank::world_size].clone(), padded


def pad_a_view(tensors, rank, world_size):           # no copy: shares memory with the model
    flat = tensors[0].reshape(-1) if len(tensors) == 1 else torch.cat([t.reshape(-1).float() for t in tensors])
    padded = -(-flat.numel() // world_size) * world_size
    n = padded // world_size
    if padded == flat.numel():
        return flat[rank * n:(rank + 1) * n], padded
    flat = torch.nn.functional.pad(flat, (0, padded - flat.numel()))
    return flat[rank * n:(rank + 1) * n].clone(), padded


@pytest.mark.parametrize("fn, words", [
    (pad_no_padding, ["padded length", "smallest multiple of W"]),
    (pad_at_front, ["pad with zeros at the END"]),
    (pad_strided, ["contiguous slice"]),
    (pad_a_view, ["shares memory", "copy"]),
], ids=["no-padding", "front-padding", "strided", "a-view"])
def test_check_pad_and_shard_explains_wrong_answers(fn, words):
    from course_utils.checks import check_pad_and_shard

    got = verdict(check_pad_and_shard, fn)
    assert got, f"{fn.__name__} must fail check_pad_and_shard"
    for w in words:
        assert w in got, f"the verdict on {fn.__name__} should mention {w!r}: {got}"


def test_check_pad_and_shard_passes_the_solution():
    from course_utils.checks import check_pad_and_shard
    from course_utils.fsdp import pad_and_shard

    assert verdict(check_pad_and_shard, pad_and_shard) is None


# -- the exercise cell of the stored notebook ----------------------------------------------------------------

def test_exercise_cell_passes_with_the_solution_and_its_scaffold_fails(cluster):
    from exercise_helpers import notebook_cell, run_exercise_cell

    source = notebook_cell(NOTEBOOK, "class MyReduceScatter")
    assert "USE_SOLUTION = True" in source, "the stored notebook must run the course's solution"
    assert cluster.run(run_exercise_cell, source) == [None, None], "the course's solution must pass"
    got = cluster.run(run_exercise_cell, source.replace("USE_SOLUTION = True", "USE_SOLUTION = False"))[0]
    assert got and "NotImplementedError" in got and "write MyReduceScatter.post_backward" in got, got
