"""The self-checks of 15_beyond_data_parallelism's exercises, fed the unmodified scaffold and typical wrong answers
(each must fail with a reason a learner can act on) and the course's solution (which must pass). Real gloo ranks.

    .venv/bin/python -m pytest tests/test_exercises_15.py -p no:randomly
"""
import sys

import pytest
import torch.distributed as dist

from conftest import register_by_value
from exercise_helpers import notebook_cell, run_exercise_cell, verdict

register_by_value(sys.modules[__name__])  # the wrong answers below run on the ranks

NOTEBOOK = "15_beyond_data_parallelism.ipynb"


@pytest.fixture(scope="module")
def cluster(make_cluster):
    return make_cluster(4, timeout=120)


def _same_verdict(verdicts):
    assert len(set(verdicts)) == 1, f"the ranks disagree: {verdicts}"
    return verdicts[0]


# -- exercise 1: the row-parallel linear's backward (check_row_parallel_backward) ------------------------------


def test_backward_cell_passes_with_the_solution_and_its_scaffold_fails(cluster):
    source = notebook_cell(NOTEBOOK, "check_row_parallel_backward(")
    assert "USE_SOLUTION = True" in source, "the stored notebook must run the course's solution"
    assert "grad_output @" not in source and ".sum(0)" not in source, "the scaffold must not hold the answer"
    assert cluster.run(run_exercise_cell, source) == [None] * 4, "the course's solution must pass"
    got = _same_verdict(cluster.run(run_exercise_cell, source.replace("USE_SOLUTION = True", "USE_SOLUTION = False")))
    assert got and "not written yet" in got and "NotImplementedError" in got, got


def _flat(t):
    return t.reshape(-1, t.shape[-1])


def all_reduces_grad_output(ctx, grad_output):      # "the forward all-reduced, so the backward must too"
    x, w = ctx.saved_tensors
    grad_output = grad_output.clone()
    dist.all_reduce(grad_output, group=ctx.group)
    return grad_output @ w, _flat(grad_output).T @ _flat(x), _flat(grad_output).sum(0), None


def bias_divided_by_world_size(ctx, grad_output):   # "the bias is shared by W ranks"
    x, w = ctx.saved_tensors
    return (grad_output @ w, _flat(grad_output).T @ _flat(x),
            _flat(grad_output).sum(0) / dist.get_world_size(ctx.group), None)


def no_transpose(ctx, grad_output):                 # grad_w = x^T @ grad_output: the shape of weight.T
    x, w = ctx.saved_tensors
    return grad_output @ w, _flat(x).T @ _flat(grad_output), _flat(grad_output).sum(0), None


def batch_dims_not_flattened(ctx, grad_output):     # works for 2-D inputs only
    x, w = ctx.saved_tensors
    return grad_output @ w, grad_output.T @ x, grad_output.sum(0), None


def forgets_the_group(ctx, grad_output):            # three gradients for four inputs
    x, w = ctx.saved_tensors
    return grad_output @ w, _flat(grad_output).T @ _flat(x), _flat(grad_output).sum(0)


def right_but_averages_over_ranks(ctx, grad_output):   # right numbers, but a needless all-reduce
    x, w = ctx.saved_tensors
    grad_output = grad_output.clone()
    dist.all_reduce(grad_output, group=ctx.group)
    grad_output /= dist.get_world_size(ctx.group)
    return grad_output @ w, _flat(grad_output).T @ _flat(x), _flat(grad_output).sum(0), None


def all_gathers_weight_grad(ctx, grad_output):       # sums every rank's weight gradient: other ranks' columns
    x, w = ctx.saved_tensors
    gw = _flat(grad_output).T @ _flat(x)
    dist.all_reduce(gw, group=ctx.group)
    return grad_output @ w, gw, _flat(grad_output).sum(0), None


WRONG_BACKWARD = {
    all_reduces_grad_output: ["4 times too large", "already the same on every rank"],
    bias_divided_by_world_size: ["gradient of bias is 4 times too small"],
    no_transpose: ["raised", "one gradient per input"],
    batch_dims_not_flattened: ["raised", "flatten the leading dimensions"],
    forgets_the_group: ["raised", "None for the group"],
    right_but_averages_over_ranks: ["gradients are right", "needs no communication"],
    all_gathers_weight_grad: ["gradient of weight_shard is wrong", "only its own slice"],
}


def _check_backward(backward):
    from course_utils.checks import check_row_parallel_backward

    return verdict(check_row_parallel_backward, backward)


@pytest.mark.parametrize("wrong", list(WRONG_BACKWARD), ids=[f.__name__ for f in WRONG_BACKWARD])
def test_typical_wrong_backwards_fail_with_a_reason(cluster, wrong):
    got = _same_verdict(cluster.run(_check_backward, wrong))
    assert got is not None, f"{wrong.__name__} passed check_row_parallel_backward"
    for words in WRONG_BACKWARD[wrong]:
        assert words in got, f"{wrong.__name__}: expected {words!r} in the verdict: {got}"


def test_the_backward_solution_passes_on_two_ranks(make_cluster):
    from course_utils.tensor_parallel import row_parallel_backward

    assert make_cluster(2, timeout=120).run(_check_backward, row_parallel_backward) == [None, None]


# -- exercise 2: a GPipe schedule (check_pipeline_schedule) ---------------------------------------------------


def test_schedule_cell_passes_with_the_solution_and_its_scaffold_fails(cluster):
    source = notebook_cell(NOTEBOOK, "check_pipeline_schedule(")
    assert "USE_SOLUTION = True" in source, "the stored notebook must run the course's solution"
    assert '("B", i) for i' not in source, "the scaffold must not hold the answer"
    assert cluster.run(run_exercise_cell, source) == [None] * 4, "the course's solution must pass"
    got = _same_verdict(cluster.run(run_exercise_cell, source.replace("USE_SOLUTION = True", "USE_SOLUTION = False")))
    assert got and "not written yet" in got and "NotImplementedError" in got, got


def one_by_one(stage, num_stages, num_microbatches):          # correct gradients, no overlap at all
    return [a for i in range(num_microbatches) for a in (("F", i), ("B", i))]


def first_stage_does_not_wait(stage, num_stages, num_microbatches):
    # the first stage runs each micro-batch's backward before the next forward, the others run GPipe: stage 0
    # waits for gradient 0 while stage 1 waits for activation 1, which stage 0 sends only after its backward
    if stage == 0:
        return one_by_one(stage, num_stages, num_microbatches)
    return [("F", i) for i in range(num_microbatches)] + [("B", i) for i in range(num_microbatches)]


def backward_in_reverse_on_odd_stages(stage, num_stages, num_microbatches):   # the messages cross out of order
    order = range(num_microbatches)[::-1] if stage % 2 else range(num_microbatches)
    return [("F", i) for i in range(num_microbatches)] + [("B", i) for i in order]


def backward_before_forward(stage, num_stages, num_microbatches):
    return [("B", i) for i in range(num_microbatches)] + [("F", i) for i in range(num_microbatches)]


def forgets_the_last_backward(stage, num_stages, num_microbatches):
    return [("F", i) for i in range(num_microbatches)] + [("B", i) for i in range(num_microbatches - 1)]


def depends_on_the_calling_rank(stage, num_stages, num_microbatches):   # rank 1 alone sees a deadlock
    if dist.get_rank() == 1 and stage == 0:
        return one_by_one(stage, num_stages, num_microbatches)
    return [("F", i) for i in range(num_microbatches)] + [("B", i) for i in range(num_microbatches)]


WRONG_SCHEDULES = {
    one_by_one: ["idle", "do not overlap"],
    first_stage_does_not_wait: ["deadlocks", "stage 0 waits to receive the gradient of micro-batch 0"],
    backward_in_reverse_on_odd_stages: ["different orders", "silently"],
    backward_before_forward: ["runs backward before its forward"],
    forgets_the_last_backward: ["exactly once", "missing [0]"],
    depends_on_the_calling_rank: ["(seen on rank 1)", "deadlocks"],
}


def _check_schedule(schedule):
    from course_utils.checks import check_pipeline_schedule

    return verdict(check_pipeline_schedule, schedule)


@pytest.mark.parametrize("wrong", list(WRONG_SCHEDULES), ids=[f.__name__ for f in WRONG_SCHEDULES])
def test_typical_wrong_schedules_fail_with_a_reason(cluster, wrong):
    got = _same_verdict(cluster.run(_check_schedule, wrong))
    assert got is not None, f"{wrong.__name__} passed check_pipeline_schedule"
    for words in WRONG_SCHEDULES[wrong]:
        assert words in got, f"{wrong.__name__}: expected {words!r} in the verdict: {got}"


def test_gpipe_and_1f1b_pass(cluster):
    from course_utils.pipeline import gpipe_schedule, one_f_one_b_schedule

    assert cluster.run(_check_schedule, gpipe_schedule) == [None] * 4
    assert cluster.run(_check_schedule, one_f_one_b_schedule) == [None] * 4


def test_the_simulator_finds_the_deadlock_without_sending(cluster):
    """The deadlocking schedule is caught by simulation: the ranks return promptly (no recv ever posted)."""
    import time

    start = time.monotonic()
    got = _same_verdict(cluster.run(_check_schedule, first_stage_does_not_wait))
    assert "before anything was sent" in got, got
    assert time.monotonic() - start < 60, "the deadlock must be reported, not waited out"
