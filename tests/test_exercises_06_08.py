"""The self-checks of lessons 07-08's exercises, fed the scaffold, typical wrong answers and the solution (lesson
06's have their own modules: tests/test_checker_sync_prediction.py, tests/test_checker_accumulate.py).

Real processes (gloo, 2 ranks). Each wrong answer must fail with a reason a learner can act on; the
course's solution (the one the notebooks switch on with USE_SOLUTION) must pass.
"""
import sys

import pytest
import torch
import torch.distributed as dist

from course_utils.checks import check_bucket0_prediction, check_comm_hook, check_fp16_wrapper
from course_utils.checks.buckets import REORDERED_BUCKET0
from course_utils.hooks import avg_hook, fp16_wrap

from conftest import register_by_value
register_by_value(sys.modules[__name__])  # the ranks cannot import this test module


@pytest.fixture(scope="module")
def cluster2(make_cluster):
    return make_cluster(world_size=2, timeout=60)  # gloo, shared within this module


# -- 07, exercise 2: predict bucket 0 of the rebuilt Reordered model -----------------------------
def reordered_layout():
    """On a rank: the rebuilt layout and the registration order of 07's Reordered model."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from course_utils.ddp_probes import BucketLog
    from course_utils.models import Reordered

    torch.manual_seed(0)
    model = DDP(Reordered(), bucket_cap_mb=0.25)
    log = BucketLog(model)

    def hook(log, bucket):
        log.records.append({"iteration": log.iteration, "index": bucket.index(), "numel": bucket.buffer().numel(),
                            "params": [log.names[id(p)] for p in bucket.parameters()]})
        fut = dist.all_reduce(bucket.buffer().div_(dist.get_world_size()), async_op=True).get_future()
        return fut.then(lambda f: f.value()[0])

    model.register_comm_hook(log, hook)
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(dist.get_rank()))
    for it in range(2):
        log.iteration = it
        model(x).pow(2).mean().backward()
    return log.layout(1), [n for n, _ in model.module.named_parameters()]


@pytest.fixture(scope="module")
def reordered(cluster2):
    return cluster2.run(reordered_layout)[0]


def test_bucket0_solution_is_what_ddp_builds(reordered, capsys):
    layout, registration = reordered
    check_bucket0_prediction(REORDERED_BUCKET0, layout, registration)
    out = capsys.readouterr().out
    assert "self-check passed: predicted_bucket0 is the bucket 0 DDP rebuilt (4 tensors, in order)" in out, out
    assert "head.bias" not in out, "the stored output must not give the answer away"


@pytest.mark.parametrize("predicted, reason", [
    (None, r"predicted_bucket0 is still None: write the parameter names"),
    (["embed.bias", "embed.weight"], r"reverse REGISTRATION order.* which module does forward use last"),
    (["head.weight", "head.bias", "blocks.0.weight"], r"registration order. Backward runs from the loss"),
    (["head.weight", "head.bias", "blocks.3.weight", "blocks.3.bias"],
     r"right parameters, in the wrong order: .* bias"),
    (["head.bias", "head.weight"], r"bucket 0 holds more than that: it closes once it reaches bucket_cap_mb"),
    (["head.bias", "head.weight", "blocks.3.bias", "blocks.3.weight", "blocks.2.bias"],
     r"bucket 0 holds fewer parameters"),
    (["head.bias", "nonsense"], r"\['nonsense'\] are not parameter names"),
])
def test_bucket0_wrong_predictions_are_explained(reordered, predicted, reason):
    layout, registration = reordered
    with pytest.raises(AssertionError, match=reason):
        check_bucket0_prediction(predicted, layout, registration)


# -- 08, exercise 1: avg_hook ----------------------------------------------------------------------
def avg_scaffold(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    raise NotImplementedError("exercise 1: write avg_hook")


def avg_and_divide(state, bucket):  # AVG already divides: dividing again halves the gradient
    buf = bucket.buffer().div_(dist.get_world_size())
    fut = dist.all_reduce(buf, op=dist.ReduceOp.AVG, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def sum_not_avg(state, bucket):  # the default op is SUM
    fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def divide_then_sum(state, bucket):  # right gradients, but the plain all-reduce-then-divide of section 3
    buf = bucket.buffer().div_(dist.get_world_size())
    fut = dist.all_reduce(buf, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def sum_then_divide(state, bucket):  # right gradients: SUM, divided in the callback
    fut = dist.all_reduce(bucket.buffer(), op=dist.ReduceOp.SUM, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0] / dist.get_world_size())


def avg_list_value(state, bucket):  # returns the future's list
    fut = dist.all_reduce(bucket.buffer(), op=dist.ReduceOp.AVG, async_op=True).get_future()
    return fut.then(lambda f: f.value())


@pytest.mark.parametrize("hook, reason", [
    (avg_scaffold, r"raised on rank 0 \(step 0\): NotImplementedError: exercise 1: write avg_hook. Hint: the hook is "
                   r"still the exercise's scaffold"),
    (avg_and_divide, r"1/2 of DDP's: it divides by world_size twice"),
    (sum_not_avg, r"all-reduced with ReduceOp.SUM on rank 0: the exercise asks for op=dist.ReduceOp.AVG"),
    (divide_then_sum, r"all-reduced with ReduceOp.SUM on rank 0: .*no division of your own"),
    (sum_then_divide, r"all-reduced with ReduceOp.SUM on rank 0"),
    (avg_list_value, r"raised on rank 0 \(step 0\)"),
], ids=lambda v: getattr(v, "__name__", ""))
def test_avg_hook_check_rejects_wrong_answers(cluster2, hook, reason):
    with pytest.raises(AssertionError, match=reason):
        check_comm_hook(hook, cluster=cluster2, op="AVG")


def test_without_op_a_divide_then_sum_hook_passes(cluster2):
    """What the review found: comparing gradients alone, the plain all-reduce-then-divide hook passes."""
    check_comm_hook(divide_then_sum, cluster=cluster2, quiet=True)
    check_comm_hook(sum_then_divide, cluster=cluster2, quiet=True)


def test_avg_hook_solution_passes(cluster2, capsys):
    check_comm_hook(avg_hook, cluster=cluster2, op="AVG")
    assert "avg_hook matches DDP's all-reduce on 2 ranks" in capsys.readouterr().out


# -- 08, exercise 2: fp16_wrap(hook) -------------------------------------------------------------
def wrap_scaffold(hook):
    raise NotImplementedError("exercise 2: write fp16_wrap")


def wrap_without_set_buffer(hook):  # casts a copy, but hands the hook the float32 bucket
    def wrapped(state, bucket):
        compressed = bucket.buffer().to(torch.float16)  # noqa: F841 (made, never used)
        return hook(state, bucket)

    return wrapped


def wrap_round_trip(hook):  # rounds to float16 and back BEFORE the hook: float32 on the wire
    def wrapped(state, bucket):
        bucket.set_buffer(bucket.buffer().to(torch.float16).float())
        return hook(state, bucket)

    return wrapped


def wrap_ignores_hook(hook):  # its own float16 all-reduce: never calls the hook it wraps
    def wrapped(state, bucket):
        buffer = bucket.buffer()
        half = buffer.to(torch.float16).div_(dist.get_world_size())
        fut = dist.all_reduce(half, async_op=True).get_future()
        return fut.then(lambda f: buffer.copy_(f.value()[0]))

    return wrapped


def wrap_forgets_return(hook):  # defines the wrapped hook, forgets to return it
    def wrapped(state, bucket):
        bucket.set_buffer(bucket.buffer().to(torch.float16))
        return hook(state, bucket)


@pytest.mark.parametrize("wrap, reason", [
    (wrap_scaffold, r"wrap_scaffold is not written yet \(exercise 2: write fp16_wrap\)"),
    (wrap_without_set_buffer, r"handed a float32 bucket, so it sent 4612 bytes per step for 1153 gradients \(4 per "
                              r"gradient\). Hand it the float16 copy: bucket.set_buffer"),
    (wrap_round_trip, r"handed a float32 bucket"),
    (wrap_ignores_hook, r"the hook it wraps was never called"),
    (wrap_forgets_return, r"returned None, not a hook"),
], ids=lambda v: getattr(v, "__name__", ""))
def test_fp16_wrapper_check_rejects_wrong_answers(cluster2, wrap, reason):
    with pytest.raises(AssertionError, match=reason):
        check_fp16_wrapper(wrap, cluster=cluster2)


def test_fp16_wrapper_solution_and_torchs_pass(cluster2, capsys):
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_wrapper

    check_fp16_wrapper(fp16_wrap, cluster=cluster2)
    check_fp16_wrapper(fp16_compress_wrapper, cluster=cluster2)
    out = capsys.readouterr().out
    assert out.count("sends 2306 bytes per step for 1153 gradients") == 2, out


def _rounds(typical_s, n=16, jitter=0.0005):
    """n step times around ``typical_s``, a deterministic jitter per round (the same in every setup's round)."""
    return [typical_s + jitter * ((3 * i) % 5 - 2) / 2 for i in range(n)]


def test_describe_cap_sweep_follows_the_numbers():
    """07's verdict on its bucket_cap_mb sweep, timed in turns: the fastest cap, and whether overlap measurably paid
    against one bucket (won or lost 3 rounds in 4); speed as time saved per step, in ms and as a share."""
    from course_utils.describe import describe_cap_sweep

    caps, buckets = (0.25, 2, 4, 25), (7, 4, 2, 1)
    # the review's stored run (medians 29.0, 25.9, 26.2, 24.4 ms): one bucket fastest, every round
    one_wins = describe_cap_sweep(caps, buckets, [_rounds(t) for t in (0.0290, 0.0259, 0.0262, 0.0244)])
    assert one_wins.startswith("one bucket (bucket_cap_mb=25), which overlaps nothing, was not beaten"), one_wins
    assert "with 7 buckets a step took 4.6 ms longer than with one bucket, 19% of that step (slower in 16 of 16" \
        in one_wins, one_wins
    overlap_pays = describe_cap_sweep(caps, buckets, [_rounds(t) for t in (0.030, 0.020, 0.022, 0.028)])
    assert overlap_pays.startswith("the fastest was bucket_cap_mb=2 (4 buckets): with 4 buckets a step took 8.0 ms "
                                   "less than with one bucket (bucket_cap_mb=25, no overlap), 29% of that step"), \
        overlap_pays
    assert "overlapping the all-reduces with backward paid" in overlap_pays, overlap_pays
    assert "% faster" not in overlap_pays, "one measure of speed: time saved, not 'x% faster'"
    # the review's sweep, caps one after another, n = 5: "7 buckets 63% faster than one bucket" from a typical step
    # that won only 3 of the 5 rounds; in turns that is no measurable gain
    one = [0.060, 0.061, 0.059, 0.060, 0.062]
    seven = [0.022, 0.090, 0.021, 0.095, 0.023]
    lucky = describe_cap_sweep(caps, buckets, [seven, one, one, one])
    assert lucky.startswith("no cap was measurably faster or slower than one bucket"), lucky
    assert "neither paid nor cost measurably" in lucky and "63%" not in lucky, lucky


def test_compare_in_turns_needs_three_rounds_in_four():
    from course_utils.ddp_probes import compare_in_turns

    base = _rounds(0.050)
    faster = compare_in_turns(base, [t - 0.002 for t in base])
    assert faster["verdict"] == "faster" and faster["won"] == 16, faster
    assert faster["saved_s"] == pytest.approx(0.002) and faster["saved_fraction"] == pytest.approx(0.04, rel=0.01)
    slower = compare_in_turns(base, [t + 0.002 for t in base])
    assert slower["verdict"] == "slower" and slower["won"] == 0 and slower["saved_s"] == pytest.approx(-0.002)
    half = compare_in_turns(base, [t - 0.002 if i % 2 else t + 0.001 for i, t in enumerate(base)])
    assert half["verdict"] == "no measurable difference" and half["won"] == 8, half
    with pytest.raises(AssertionError, match="timed in turns"):
        compare_in_turns(base, base[:-1])


def _steps(compute, exposed, rest, n=16):
    """n step_parts dicts around the given parts (seconds), with a small per-round jitter on compute."""
    out = []
    for c in _rounds(compute, n):
        out.append({"total": c + exposed + rest, "compute": c, "exposed": exposed, "rest": rest, "hidden": 0.0,
                    "comm": exposed})
    return out


def test_describe_overlap_reads_the_reason_from_parts_that_add_up():
    """07's verdict on its timelines. The review's run: 'the step with 7 buckets took 5% longer ... the communication
    competed with backward for the same cores' while compute read 32.6 against 31.6 ms (+3%) and the columns were
    medians that did not add up (57.1 != 32.6 + 12.2). Read from the parts of the typical steps, the reason is the
    part that grew: here the exposed communication, not the compute."""
    from course_utils.describe import describe_overlap

    one = _steps(0.0316, 0.0122, 0.0106)          # 54.4 ms
    many = _steps(0.0326, 0.0200, 0.0045)         # 57.1 ms: compute +1.0, exposed +7.8, rest -6.1
    text = describe_overlap(one, many)
    assert text.startswith("with 7 buckets a step took 2.7 ms longer than with one bucket, 5% of that step "
                           "(slower in 16 of 16 rounds timed in turns)"), text
    assert "backward's compute +1.0 ms, the exposed communication +7.8 ms, the rest after the last gradient -6.1 ms" \
        in text, text
    assert "more communication was left after backward" in text and "compute grew" not in text, text
    compute_bound = describe_overlap(one, _steps(0.0450, 0.0080, 0.0100))    # compute +13.4, exposed -4.2
    assert "backward's compute grew by 13.4 ms" in compute_bound, compute_bound
    assert "more than overlap took off the exposed communication (4.2 ms)" in compute_bound, compute_bound
    pays = describe_overlap(one, _steps(0.0350, 0.0020, 0.0100))             # compute +3.4, exposed -10.2
    assert pays.startswith("with 7 buckets a step took 7.4 ms less than with one bucket"), pays
    assert pays.endswith("overlap paid, the communication it hid was worth more than backward's compute grew."), pays
    wobble = [dict(st, total=st["total"] + d, rest=st["rest"] + d)          # 1 ms faster, 4 ms slower in turn
              for st, d in zip(one, [-0.001, 0.004] * 8)]
    noise = describe_overlap(one, wobble)
    assert noise.startswith("no measurable difference between 7 buckets and one bucket: 7 buckets was faster in 8 of "
                            "16 rounds"), noise
    assert "paid" not in noise and "grew by" not in noise, noise


def test_describe_agreement_says_when_two_cells_contradict():
    """The review's 07: the sweep said 7 buckets were 63% faster than one bucket ('overlapping paid'), the timelines,
    the same layouts timed in turns, 5% longer. The two cells' sentences must say they disagree."""
    from course_utils.ddp_probes import compare_in_turns
    from course_utils.describe import describe_agreement

    one = _rounds(0.060)
    sweep = compare_in_turns(one, [t * 0.37 for t in one])             # 63% less
    timeline = compare_in_turns(_rounds(0.0544), _rounds(0.0571))      # 5% longer
    text = describe_agreement(sweep, timeline)
    assert text.startswith("the two cells disagree"), text
    assert "found faster by 37.8 ms per step" in text and "found slower by 2.7 ms per step" in text, text
    assert describe_agreement(timeline, timeline).startswith("the two cells agree"), "same verdict: they agree"
    unclear = compare_in_turns(one, [t - 0.002 if i % 2 else t + 0.002 for i, t in enumerate(one)])
    assert describe_agreement(sweep, unclear).startswith("the two cells half agree"), describe_agreement(sweep, unclear)


def test_describe_compute_growth_follows_the_numbers():
    """The review's 07: 'x1.32 on the simulated link, x1.03 on the real gloo run: the simulated link's compute grew
    about as much'. Ten times more is not about as much: the simulated link's grew more, and gloo's transfers are not
    shown to cost backward anything."""
    from course_utils.describe import describe_compute_growth

    review = describe_compute_growth(1.32, 1.03)
    assert "x1.32 on the simulated link" in review and "x1.03 on the real gloo run" in review, review
    assert "about as much" not in review and "the simulated link's grew more" in review, review
    assert "no cost of gloo's transfers" in review, review
    assert "about as much" in describe_compute_growth(1.23, 1.31)
    assert "share of backward's cores that gloo's transfers took" in describe_compute_growth(1.05, 1.30)
    assert "neither grew" in describe_compute_growth(1.02, 1.08)
