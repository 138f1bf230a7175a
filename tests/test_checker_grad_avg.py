"""check_grad_averaging (05_manual_gradient_averaging) on real ranks: right versions pass, each
classic mistake fails with a message that names its factor.

    .venv/bin/python -m pytest tests/test_grad_avg.py -p no:randomly
"""
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from conftest import register_by_value

from course_utils import DistributedError
from course_utils.checks import check_grad_averaging
from course_utils.checks.grad_avg import RTOL, _cases, _explain_factor, _pick_sizes, _unequal_sizes

register_by_value(sys.modules[__name__])  # the ranks cannot import this test module

WORLD_SIZE = 2  # the checker then uses accum_steps=3, micro_batch_size=5: every factor is distinct


@pytest.fixture(scope="module")
def cluster(make_cluster):
    return make_cluster(WORLD_SIZE, timeout=60)  # gloo pinned by make_cluster


def _backward_all(model, micro_batches, divide_by_k=True, reduction="mean"):
    for x, y in micro_batches:
        loss = F.mse_loss(model(x), y, reduction=reduction)
        if divide_by_k:
            loss = loss / len(micro_batches)
        loss.backward()


# -- right versions ---------------------------------------------------------------------------
def right_sum_then_divide(model, micro_batches):
    _backward_all(model, micro_batches)
    for p in model.parameters():
        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
        p.grad /= dist.get_world_size()


def right_avg(model, micro_batches):
    _backward_all(model, micro_batches)
    for p in model.parameters():
        dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)


def right_one_flat_buffer(model, micro_batches):  # one all_reduce for all gradients, as DDP's buckets do
    _backward_all(model, micro_batches)
    grads = [p.grad for p in model.parameters()]
    flat = torch.cat([g.flatten() for g in grads])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


# -- wrong versions ---------------------------------------------------------------------------
def no_division_by_world_size(model, micro_batches):  # the article's loop
    _backward_all(model, micro_batches)
    for p in model.parameters():
        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)


def no_division_by_accum_steps(model, micro_batches):
    _backward_all(model, micro_batches, divide_by_k=False)
    for p in model.parameters():
        dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)


def no_division_at_all(model, micro_batches):
    _backward_all(model, micro_batches, divide_by_k=False)
    for p in model.parameters():
        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)


def avg_and_divide_again(model, micro_batches):
    _backward_all(model, micro_batches)
    for p in model.parameters():
        dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
        p.grad /= dist.get_world_size()


def sum_loss(model, micro_batches):
    _backward_all(model, micro_batches, reduction="sum")
    for p in model.parameters():
        dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)


def only_rank_0_averages(model, micro_batches):  # reduce() leaves the result on rank 0 only
    _backward_all(model, micro_batches)
    for p in model.parameters():
        dist.reduce(p.grad, dst=0)
        p.grad /= dist.get_world_size()


def only_rank_0_calls_all_reduce(model, micro_batches):  # the other ranks never join: a hang
    _backward_all(model, micro_batches)
    if dist.get_rank() == 0:
        for p in model.parameters():
            dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)


def no_all_reduce(model, micro_batches):
    _backward_all(model, micro_batches)


def hard_coded_accum_steps(model, micro_batches):
    for x, y in micro_batches:
        (F.mse_loss(model(x), y) / 3).backward()
    for p in model.parameters():
        dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)


def biases_only(model, micro_batches):
    _backward_all(model, micro_batches)
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)


def zero_grad_at_the_end(model, micro_batches):
    right_avg(model, micro_batches)
    model.zero_grad(set_to_none=True)


def raises(model, micro_batches):
    raise ValueError("learner's bug")


def zero_grad_inside_the_loop(model, micro_batches):  # each micro-batch wipes the one before
    for x, y in micro_batches:
        model.zero_grad()
        (F.mse_loss(model(x), y) / len(micro_batches)).backward()
    for p in model.parameters():
        dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)


def zero_grad_inside_not_divided(model, micro_batches):  # the same, with the loss not divided by K
    for x, y in micro_batches:
        model.zero_grad(set_to_none=True)
        F.mse_loss(model(x), y).backward()
    for p in model.parameters():
        dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)


# -- tests ------------------------------------------------------------------------------------
@pytest.mark.parametrize("fn", [right_sum_then_divide, right_avg, right_one_flat_buffer])
def test_right_versions_pass(cluster, fn):
    check_grad_averaging(fn, cluster=cluster)  # raises AssertionError if a right version is rejected


@pytest.mark.parametrize("fn, expected", [
    (no_division_by_world_size, "2x too large: the factor is world_size."),
    (no_division_by_accum_steps, "3x too large: the factor is accum_steps."),
    (no_division_at_all, "6x too large: the factor is world_size x accum_steps."),
    (avg_and_divide_again, "2x too small: the factor is 1/world_size."),
    (sum_loss, "5x too large: the factor is micro_batch_size."),
    (hard_coded_accum_steps, "3x too small, in the right direction (a hard-coded number?"),
])
def test_wrong_factor_is_named(cluster, fn, expected):
    with pytest.raises(AssertionError) as info:
        check_grad_averaging(fn, cluster=cluster)
    assert expected in str(info.value), f"the message should say {expected!r}, got:\n{info.value}"


def test_only_rank_0_averaged(cluster):
    with pytest.raises(AssertionError) as info:
        check_grad_averaging(only_rank_0_averages, cluster=cluster)
    msg = str(info.value)
    assert "The ranks end with different gradients" in msg, msg
    assert "rank 0: right" in msg and "rank 1: wrong" in msg, f"rank 0 is right and rank 1 is not:\n{msg}"


def test_no_all_reduce_at_all(cluster):
    with pytest.raises(AssertionError, match="different gradients") as info:
        check_grad_averaging(no_all_reduce, cluster=cluster)
    assert "rank 0: wrong" in str(info.value), f"no rank holds the global gradient:\n{info.value}"


def test_only_some_parameters_averaged(cluster):
    with pytest.raises(AssertionError, match=r"disagree on net\.0\.weight, net\.2\.weight only"):
        check_grad_averaging(biases_only, cluster=cluster)


@pytest.mark.parametrize("fn", [zero_grad_inside_the_loop, zero_grad_inside_not_divided])
def test_zero_grad_inside_the_loop_is_named(cluster, fn):
    with pytest.raises(AssertionError) as info:
        check_grad_averaging(fn, cluster=cluster)
    msg = str(info.value)
    assert "only its LAST micro-batch's" in msg and "zero_grad() inside the micro-batch loop" in msg, msg
    assert "once per step, before the first micro-batch" in msg, msg


def test_missing_gradients(cluster):
    with pytest.raises(AssertionError, match="has no gradient for net.0.weight"):
        check_grad_averaging(zero_grad_at_the_end, cluster=cluster)


def test_hang_becomes_an_explanation_and_the_cluster_survives(cluster):
    with pytest.raises(AssertionError, match=r"Your function hung: .*inside `if rank == 0:`"):
        check_grad_averaging(only_rank_0_calls_all_reduce, cluster=cluster, timeout=5)
    check_grad_averaging(right_avg, cluster=cluster)  # the same ranks still work afterwards


def test_an_error_in_the_learners_code_shows_its_traceback(cluster):
    with pytest.raises(DistributedError) as info:
        check_grad_averaging(raises, cluster=cluster)
    assert info.value.exc_type == "ValueError" and "learner's bug" in str(info.value), str(info.value)
    check_grad_averaging(right_avg, cluster=cluster)


@pytest.mark.parametrize("world_size", [2, 3, 4, 8])
def test_sizes_make_every_factor_distinct(world_size):
    k, b = _pick_sizes(world_size)
    factors = {world_size ** i * k ** j * b ** m for i in (0, 1) for j in (0, 1) for m in (0, 1)}
    assert len(factors) == 8, f"world_size={world_size}, accum_steps={k}, micro_batch_size={b}: factors collide"
    assert [len(c["sizes"][0]) for c in _cases(world_size)] == [k, 1], "a case with accumulation, then one without"
    for case in _cases(world_size, unequal=True):
        sizes = case["sizes"]
        assert len(sizes) == world_size
        assert len({sum(row) for row in sizes}) > 1, f"the ranks must hold different sample counts: {sizes}"
    within = _unequal_sizes(world_size)
    assert all(len(set(row)) == len(row) for row in within), f"micro-batches must differ within a rank: {within}"


def test_factor_names():
    assert _explain_factor(4.0, 4, 3, 5)[1].startswith("world_size."), "4 ranks, 4x too large: world_size"
    assert _explain_factor(12.0, 4, 3, 5)[1].startswith("world_size x accum_steps."), "12 = 4 x 3"
    assert _explain_factor(1.7, 4, 3, 5) is None, "1.7 is no product of 4, 3 and 5"


# -- near misses: the tolerance itself is tested (issue 18) -------------------------------------
def just_above_tolerance(model, micro_batches):  # right, then scaled by 1 + 100 x RTOL
    right_avg(model, micro_batches)
    for p in model.parameters():
        p.grad *= 1 + 100 * RTOL


def rounding_below_tolerance(model, micro_batches):  # right, then scaled by 1 + RTOL / 100
    right_avg(model, micro_batches)
    for p in model.parameters():
        p.grad *= 1 + RTOL / 100


def reduced_in_bfloat16(model, micro_batches):  # all-reduce in bf16: right direction, ~1e-3 off
    _backward_all(model, micro_batches)
    for p in model.parameters():
        low = p.grad.to(torch.bfloat16)
        dist.all_reduce(low, op=dist.ReduceOp.SUM)
        p.grad.copy_(low.double() / dist.get_world_size())


def test_just_above_the_tolerance_fails(cluster):
    with pytest.raises(AssertionError, match="off by only 1e-07 relative") as info:
        check_grad_averaging(just_above_tolerance, cluster=cluster)
    assert f"allows {RTOL:g}" in str(info.value), str(info.value)


def test_rounding_below_the_tolerance_passes(cluster):
    check_grad_averaging(rounding_below_tolerance, cluster=cluster)


def test_a_bfloat16_reduction_is_close_but_rejected(cluster):
    with pytest.raises(AssertionError, match=r"close, but not exact: .*bfloat16"):
        check_grad_averaging(reduced_in_bfloat16, cluster=cluster)


# -- unequal micro-batches (issue 13) -------------------------------------------------------------
def token_weighted(model, micro_batches):
    n_global = torch.tensor(float(sum(len(x) for x, _ in micro_batches)), dtype=torch.float64)
    dist.all_reduce(n_global)
    for x, y in micro_batches:
        (F.mse_loss(model(x), y, reduction="sum") / n_global).backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)


def token_weighted_then_avg(model, micro_batches):  # divides by W twice
    n_global = torch.tensor(float(sum(len(x) for x, _ in micro_batches)), dtype=torch.float64)
    dist.all_reduce(n_global)
    for x, y in micro_batches:
        (F.mse_loss(model(x), y, reduction="sum") / n_global).backward()
    for p in model.parameters():
        dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)


def local_count(model, micro_batches):  # divides by this rank's count, then averages the ranks
    n_local = sum(len(x) for x, _ in micro_batches)
    for x, y in micro_batches:
        (F.mse_loss(model(x), y, reduction="sum") / n_local).backward()
    for p in model.parameters():
        dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)


def test_unequal_right_answer_passes(cluster):
    check_grad_averaging(token_weighted, cluster=cluster, unequal=True)


def test_equal_sizes_are_a_special_case_of_the_token_fix(cluster):
    check_grad_averaging(token_weighted, cluster=cluster)


def test_mean_of_means_fails_with_the_weights_explained(cluster):
    from course_utils.checks import grad_avg

    grad_avg._SEEN.clear()
    with pytest.raises(AssertionError) as info:
        check_grad_averaging(right_sum_then_divide, cluster=cluster, unequal=True)
    msg = str(info.value)
    assert "mean of micro-batch means" in msg and "N / (W x K x b)" in msg, msg
    assert "reduction='sum'" not in msg and "a hint" in msg, f"the first verdict gives factor and reason only:\n{msg}"
    with pytest.raises(AssertionError) as info:
        check_grad_averaging(right_sum_then_divide, cluster=cluster, unequal=True)
    msg = str(info.value)
    assert "Hint:" in msg and "reduction='sum'" in msg and "all-reduce" in msg, f"the second says what to do:\n{msg}"


@pytest.mark.parametrize("fn, fix", [(no_division_by_world_size, "ReduceOp.AVG"),
                                     (no_division_by_accum_steps, "divide each micro-batch's loss by accum_steps")])
def test_first_verdict_names_factor_and_reason_the_second_the_fix(cluster, fn, fix):
    from course_utils.checks import grad_avg

    grad_avg._SEEN.clear()
    with pytest.raises(AssertionError) as first:
        check_grad_averaging(fn, cluster=cluster)
    with pytest.raises(AssertionError) as second:
        check_grad_averaging(fn, cluster=cluster)
    assert "the factor is" in str(first.value) and fix not in str(first.value), str(first.value)
    assert "Hint: " in str(second.value) and fix in str(second.value).split("Hint: ")[1], str(second.value)


def test_a_mean_of_means_without_the_division_by_w_says_both(cluster):
    with pytest.raises(AssertionError, match="mean of micro-batch means.*not divided by world_size"):
        check_grad_averaging(no_division_by_world_size, cluster=cluster, unequal=True)


def test_per_rank_count_fails_with_the_ranks_counts(cluster):
    with pytest.raises(AssertionError, match=r"divides by its OWN sample count.*\(12, 13\)"):
        check_grad_averaging(local_count, cluster=cluster, unequal=True)


def test_global_count_and_avg_is_a_named_factor(cluster):
    with pytest.raises(AssertionError, match="2x too small: the factor is 1/world_size. Dividing by the global"):
        check_grad_averaging(token_weighted_then_avg, cluster=cluster, unequal=True)


# -- counting collectives ---------------------------------------------------------------------------
def test_collectives_are_counted(cluster):
    check_grad_averaging(right_one_flat_buffer, cluster=cluster, collectives=1)
    with pytest.raises(AssertionError, match=r"gradients are right, but rank 0 called 4 collectives .*all_reduce x 4"):
        check_grad_averaging(right_avg, cluster=cluster, collectives=1)


def test_counting_leaves_torch_distributed_as_it_was(cluster):
    def originals():
        import torch.distributed as dist
        return dist.all_reduce.__module__, dist.all_reduce.__qualname__

    before = cluster.run(originals)
    check_grad_averaging(right_avg, cluster=cluster, collectives=10)
    assert cluster.run(originals) == before, "the counting wrappers must be removed after the check"
