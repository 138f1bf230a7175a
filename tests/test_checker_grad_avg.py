"""check_grad_averaging (05_manual_gradient_averaging) tested against the learner, on real ranks: right versions
pass, written in several ways (dist.* or a name imported from torch.distributed, async_op=True then wait(), the
process group's method, the functional collectives); each classic mistake fails with a message that names its
factor; each exercise (1: scale before the sum, 2: buckets, 4: tokens in one all-reduce) rejects its typical wrong
answers with a reason and a hint that fits it, its verdicts counted apart from the other exercises'. The notebook's
wiring (its scaffolds fail, its solutions pass) is tested in tests/test_exercises_04_05.py.

    .venv/bin/python -m pytest -n 0 tests/test_checker_grad_avg.py -p no:randomly
"""
import re
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from conftest import register_by_value
from torch.distributed import all_reduce as imported_all_reduce   # bound before the checker patches anything

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


# -- near misses: the tolerance itself is pinned from both sides ----------------------------------
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


# -- unequal micro-batches: weighting by tokens, not by micro-batches -----------------------------
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
        import torch.distributed._functional_collectives as funcol
        return (dist.all_reduce.__module__, dist.all_reduce.__qualname__, repr(dist.ProcessGroup.allreduce),
                funcol.all_reduce.__qualname__)

    before = cluster.run(originals)
    check_grad_averaging(right_avg, cluster=cluster, collectives=10)
    assert cluster.run(originals) == before, "the counting wrappers must be removed after the check"


# == exercise 1: scale before the sum (prescaled=True) ================================================
def _backward_mean_not_by_k(model, micro_batches):
    for x, y in micro_batches:
        F.mse_loss(model(x), y).backward()


def scale_then_sum(model, micro_batches):   # the course's way
    _backward_mean_not_by_k(model, micro_batches)
    for p in model.parameters():
        p.grad /= len(micro_batches) * dist.get_world_size()
        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)


def scale_then_sum_imported(model, micro_batches):   # another import style, and mul_ instead of /=
    _backward_mean_not_by_k(model, micro_batches)
    for p in model.parameters():
        p.grad.mul_(1.0 / (len(micro_batches) * dist.get_world_size()))
        imported_all_reduce(p.grad)


def scale_then_sum_async(model, micro_batches):   # every all-reduce started, then each waited for
    _backward_mean_not_by_k(model, micro_batches)
    works = []
    for p in model.parameters():
        p.grad /= len(micro_batches) * dist.get_world_size()
        works.append(dist.all_reduce(p.grad, async_op=True))
    for work in works:
        work.wait()


def scale_then_sum_group(model, micro_batches):   # the process group's own method
    _backward_mean_not_by_k(model, micro_batches)
    for p in model.parameters():
        p.grad /= len(micro_batches) * dist.get_world_size()
        dist.group.WORLD.allreduce([p.grad]).wait()


def scale_then_sum_functional(model, micro_batches):   # the functional collective, its result copied back
    import torch.distributed._functional_collectives as funcol

    _backward_mean_not_by_k(model, micro_batches)
    for p in model.parameters():
        p.grad /= len(micro_batches) * dist.get_world_size()
        p.grad.copy_(funcol.all_reduce(p.grad, "sum", dist.group.WORLD))


def sum_then_divide(model, micro_batches):   # section 3's step: right gradient, divided after the all-reduce
    _backward_all(model, micro_batches)
    for p in model.parameters():
        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
        p.grad /= dist.get_world_size()


def scaled_by_k_only(model, micro_batches):   # scaled before, but by 1/K only: W x too large
    _backward_mean_not_by_k(model, micro_batches)
    for p in model.parameters():
        p.grad /= len(micro_batches)
        dist.all_reduce(p.grad)


def not_scaled(model, micro_batches):   # the first attempt: backward, then the sum
    _backward_mean_not_by_k(model, micro_batches)
    for p in model.parameters():
        dist.all_reduce(p.grad)


def scaled_but_never_waited(model, micro_batches):   # async_op=True, no wait()
    _backward_mean_not_by_k(model, micro_batches)
    works = []
    for p in model.parameters():
        p.grad /= len(micro_batches) * dist.get_world_size()
        works.append(dist.all_reduce(p.grad, async_op=True))
    model.works = works   # kept alive, never waited for (gloo finishes them on its own thread)


def scale_then_avg(model, micro_batches):   # right result, but AVG divides after the sum
    _backward_mean_not_by_k(model, micro_batches)
    for p in model.parameters():
        p.grad /= len(micro_batches)
        dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)


def _verdict_of(fn, cluster, **kwargs):
    try:
        check_grad_averaging(fn, cluster=cluster, **kwargs)
    except AssertionError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("fn", [scale_then_sum, scale_then_sum_imported, scale_then_sum_async, scale_then_sum_group,
                                scale_then_sum_functional])
def test_exercise_1_right_answers_written_differently_pass(cluster, fn):
    assert _verdict_of(fn, cluster, prescaled=True) is None


@pytest.mark.parametrize("fn, reason", [
    (sum_then_divide, r"scaled after the all-reduce .*BEFORE dist.all_reduce"),
    (scale_then_avg, r"ReduceOp.AVG .*divides by world_size AFTER the sum"),
    (scaled_by_k_only, r"2x too large: the factor is world_size\."),
    (not_scaled, r"6x too large: the factor is world_size x accum_steps\."),
    (scaled_but_never_waited, r"async_op=True was never waited for .*call \.wait\(\)"),
])
def test_exercise_1_wrong_answers_fail_with_a_reason(cluster, fn, reason):
    verdict = _verdict_of(fn, cluster, prescaled=True)
    assert verdict and re.search(reason, verdict, re.S), verdict
    assert "allreduce_hook" not in verdict, "DDP's default is the C++ reducer's division, not allreduce_hook"


def test_exercise_1_hints_fit_it_and_its_verdicts_are_counted_apart(cluster):
    """The lesson's demonstration (section 5, the article's loop through the plain check) and exercise 1's
    first wrong attempt give the same verdict text; the exercise's first attempt was told the demonstration's fix,
    "divide the all-reduced gradient by world_size, or ... AVG", which the exercise forbids."""
    from course_utils.checks import grad_avg

    grad_avg._SEEN.clear()
    demo = _verdict_of(no_division_by_world_size, cluster)                  # the lesson's demonstration
    first = _verdict_of(scaled_by_k_only, cluster, prescaled=True)
    second = _verdict_of(scaled_by_k_only, cluster, prescaled=True)
    assert demo.split(" (The same")[0] == first.split(" (The same")[0], "the same verdict text in both"
    assert "Hint:" not in first and "a second time comes with a hint" in first, first
    hint = second.split("Hint: ")[1]
    assert "BEFORE dist.all_reduce" in hint and "len(micro_batches) * dist.get_world_size()" in hint, hint
    assert "AVG" not in hint and "divide the all-reduced gradient" not in hint, hint
    for fn in (not_scaled, scaled_by_k_only):
        grad_avg._SEEN.clear()
        _verdict_of(fn, cluster, prescaled=True)
        hint = _verdict_of(fn, cluster, prescaled=True).split("Hint: ")[1]
        assert "AVG" not in hint and "before" in hint.lower(), (fn.__name__, hint)


# == exercise 2: buckets (bucket_numel=16) ===========================================================
def _buckets_of(model, cap, closed_at_cap=False):
    buckets, current = [], []
    for p in reversed(list(model.parameters())):
        size = sum(g.numel() for g in current) + p.numel()
        if current and (size >= cap if closed_at_cap else size > cap):
            buckets.append(current)
            current = []
        current.append(p.grad)
    buckets.append(current)
    return buckets


def _average_buckets(buckets, asynchronous=False, reduce=None):
    pending = []
    for grads in buckets:
        flat = torch.cat([g.flatten() for g in grads])
        if reduce is not None:
            reduce(flat)
            flat /= dist.get_world_size()
        elif asynchronous:
            pending.append((grads, flat, dist.all_reduce(flat, op=dist.ReduceOp.AVG, async_op=True)))
            continue
        else:
            dist.all_reduce(flat, op=dist.ReduceOp.AVG)
        pending.append((grads, flat, None))
    for grads, flat, work in pending:
        if work is not None:
            work.wait()
        for g, piece in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(piece.view_as(g))


def bucketed(model, micro_batches):
    _backward_all(model, micro_batches)
    _average_buckets(_buckets_of(model, 16))


def bucketed_async(model, micro_batches):   # every bucket started, then waited for
    _backward_all(model, micro_batches)
    _average_buckets(_buckets_of(model, 16), asynchronous=True)


def bucketed_imported_sum(model, micro_batches):   # another import style, SUM then / W
    _backward_all(model, micro_batches)
    _average_buckets(_buckets_of(model, 16), reduce=imported_all_reduce)


def bucketed_off_by_one(model, micro_batches):   # closes a bucket that would reach the cap exactly
    _backward_all(model, micro_batches)
    _average_buckets(_buckets_of(model, 16, closed_at_cap=True))


def one_flat_buffer(model, micro_batches):
    _backward_all(model, micro_batches)
    _average_buckets([[p.grad for p in model.parameters()]])


def per_parameter(model, micro_batches):
    _backward_all(model, micro_batches)
    _average_buckets([[p.grad] for p in reversed(list(model.parameters()))])


def registration_order(model, micro_batches):
    _backward_all(model, micro_batches)
    buckets, current = [], []
    for p in model.parameters():
        if current and sum(g.numel() for g in current) + p.numel() > 16:
            buckets.append(current)
            current = []
        current.append(p.grad)
    buckets.append(current)
    _average_buckets(buckets)


def buckets_not_averaged(model, micro_batches):   # SUM, no / W
    _backward_all(model, micro_batches)
    for grads in _buckets_of(model, 16):
        flat = torch.cat([g.flatten() for g in grads])
        dist.all_reduce(flat)
        for g, piece in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(piece.view_as(g))


def buckets_not_copied_back(model, micro_batches):
    _backward_all(model, micro_batches)
    for grads in _buckets_of(model, 16):
        dist.all_reduce(torch.cat([g.flatten() for g in grads]), op=dist.ReduceOp.AVG)


def test_exercise_2_the_checkers_model_has_a_bucket_exactly_at_the_cap():
    from course_utils.checks.grad_avg import _buckets, _model

    for case in _cases(WORLD_SIZE, bucket_numel=16):
        numels = [p.numel() for p in _model(case).parameters()]
        assert 16 in _buckets(numels, 16), f"no bucket lands on the cap: {numels}, {_buckets(numels, 16)}"
        assert _buckets(numels, 16) != _buckets(numels, 16, full_at_cap=True), "the off-by-one must differ"


@pytest.mark.parametrize("fn", [bucketed, bucketed_async, bucketed_imported_sum])
def test_exercise_2_right_answers_written_differently_pass(cluster, fn):
    assert _verdict_of(fn, cluster, bucket_numel=16) is None


@pytest.mark.parametrize("fn, reason", [
    (bucketed_off_by_one, r"all-reduce 1 carried 8 elements .*exactly the cap of 16.*total > cap, not >= cap"),
    (per_parameter, r"you all-reduced each of the 4 tensors on its own .*as few all-reduces as the cap allows"),
    (one_flat_buffer, r"all-reduce 0 carried 25 elements .*over the cap of 16"),
    (registration_order, r"follow the registration order"),
    (buckets_not_averaged, r"2x too large: the factor is world_size\."),
    (buckets_not_copied_back, r"The ranks end with different gradients"),
])
def test_exercise_2_wrong_answers_fail_with_a_reason(cluster, fn, reason):
    verdict = _verdict_of(fn, cluster, bucket_numel=16)
    assert verdict and re.search(reason, verdict, re.S), verdict


def test_exercise_2_hint_fits_it(cluster):
    from course_utils.checks import grad_avg

    grad_avg._SEEN.clear()
    _verdict_of(buckets_not_averaged, cluster, bucket_numel=16)
    hint = _verdict_of(buckets_not_averaged, cluster, bucket_numel=16).split("Hint: ")[1]
    assert "bucket" in hint and "ReduceOp.AVG" in hint, hint


# == exercise 4: tokens in one all-reduce (unequal=True, collectives=1) ================================
def tokens_in_one(model, micro_batches):
    for x, y in micro_batches:
        F.mse_loss(model(x), y, reduction="sum").backward()
    grads = [p.grad for p in model.parameters()]
    count = torch.tensor([float(sum(len(x) for x, _ in micro_batches))], dtype=grads[0].dtype)
    flat = torch.cat([g.flatten() for g in grads] + [count])
    imported_all_reduce(flat)
    for g, piece in zip(grads, (flat[:-1] / flat[-1]).split([g.numel() for g in grads])):
        g.copy_(piece.view_as(g))


def tokens_in_two(model, micro_batches):   # right, but the count travels in a collective of its own
    token_weighted(model, micro_batches)


def test_exercise_4(cluster):
    assert _verdict_of(tokens_in_one, cluster, unequal=True, collectives=1) is None
    verdict = _verdict_of(tokens_in_two, cluster, unequal=True, collectives=1)
    assert verdict and re.search(r"called 5 collectives .*this rank's sample count", verdict, re.S), verdict
    verdict = _verdict_of(local_count, cluster, unequal=True, collectives=1)
    assert verdict and "divides by its OWN sample count" in verdict, verdict
    verdict = _verdict_of(right_sum_then_divide, cluster, unequal=True, collectives=1)
    assert verdict and "mean of micro-batch means" in verdict, verdict


def test_a_route_around_dist_is_counted_too(cluster):
    """An alias bound before the check, and the process group's own method, are collectives like dist.*."""
    verdict = _verdict_of(scale_then_sum_imported, cluster, collectives=1)
    assert verdict and "called 4 collectives" in verdict, verdict
    verdict = _verdict_of(scale_then_sum_group, cluster, collectives=1)
    assert verdict and "called 4 collectives" in verdict, verdict
