"""The self-checks of lessons 06-08's exercises, fed the scaffold, typical wrong answers and the solution.

Real processes (gloo, 2 ranks). Each wrong answer must fail with a reason a learner can act on; the
course's solution (the one the notebooks switch on with USE_SOLUTION) must pass.
"""
import sys

import pytest
import torch
import torch.distributed as dist

from course_utils.checks import check_comm_hook, check_fp16_wrapper
from course_utils.ddp_probes import REORDERED_BUCKET0, check_bucket0_prediction
from course_utils.hooks import avg_hook, fp16_wrap

from conftest import register_by_value
register_by_value(sys.modules[__name__])  # the ranks cannot import this test module


@pytest.fixture(scope="module")
def cluster2(make_cluster):
    return make_cluster(world_size=2, timeout=60)  # gloo, shared within this module


# -- 06, exercise 1: predict the all-reduces and bytes of accum_steps = 8, with and without no_sync -----------
def run_check_sync_prediction(predicted, predicted_bytes):
    """On a rank: the verdict of check_sync_prediction ("passed" or the message)."""
    from course_utils.ddp_probes import check_sync_prediction

    try:
        check_sync_prediction(predicted, predicted_bytes, accum_steps=8)
    except AssertionError as exc:
        return str(exc)
    return "passed"


GRAD_BYTES = 4 * 1153  # TinyMLP's 1,153 float32 gradients: one bucket


@pytest.mark.parametrize("predicted, predicted_bytes, reason", [
    ({"without no_sync": None, "with no_sync": None}, {"without no_sync": None, "with no_sync": None},
     r"predicted: fill in your prediction for \['without no_sync', 'with no_sync'\]"),
    ({"without no_sync": 8, "with no_sync": 1}, None, r"predicted_bytes must be a dict"),
    ({"without no_sync": 1, "with no_sync": 1}, {"without no_sync": GRAD_BYTES, "with no_sync": GRAD_BYTES},
     r"without no_sync: you predicted 1 all-reduces .*every forward that runs outside no_sync"),
    ({"without no_sync": 8, "with no_sync": 0}, {"without no_sync": 8 * GRAD_BYTES, "with no_sync": 0},
     r"with no_sync: you predicted 0 all-reduces .*which micro-step's forward and backward ran outside it"),
    ({"without no_sync": 8, "with no_sync": 1}, {"without no_sync": GRAD_BYTES, "with no_sync": GRAD_BYTES},
     r"without no_sync: you predicted 4612 bytes,.*times the all-reduces"),
    ({"without no_sync": 8, "with no_sync": 1}, {"without no_sync": 8 * GRAD_BYTES, "with no_sync": 1153},
     r"with no_sync: you predicted 1153 bytes,.*4 bytes each"),
])
def test_check_sync_prediction_rejects_wrong_predictions(cluster2, predicted, predicted_bytes, reason):
    import re

    verdicts = cluster2.run(run_check_sync_prediction, predicted, predicted_bytes)
    assert verdicts[0] == verdicts[1], "both ranks must reach the same verdict"
    assert re.search(reason, verdicts[0]), verdicts[0]
    assert "36896" not in verdicts[0] and "36,896" not in verdicts[0], "the verdict never gives the answer"


def test_check_sync_prediction_passes_the_answer(cluster2):
    from course_utils.ddp_probes import solution_sync_prediction

    predicted, predicted_bytes = solution_sync_prediction(accum_steps=8)
    assert predicted == {"without no_sync": 8, "with no_sync": 1}, predicted
    assert predicted_bytes == {"without no_sync": 8 * GRAD_BYTES, "with no_sync": GRAD_BYTES}, predicted_bytes
    assert cluster2.run(run_check_sync_prediction, predicted, predicted_bytes) == ["passed", "passed"]


# -- 06, exercise 2: accumulate(model, batches) with require_backward_grad_sync ------------------
def scaffold_accumulate(model, batches):
    raise NotImplementedError("exercise 2: write accumulate")


def flag_after_forward(model, batches):  # the build-nanogpt bug
    import torch.nn.functional as F

    K = len(batches)
    for k, (xb, yb) in enumerate(batches):
        loss = F.mse_loss(model(xb), yb) / K
        model.require_backward_grad_sync = (k == K - 1)
        loss.backward()


def flag_never_false(model, batches):  # forgets the flag: K all-reduces
    import torch.nn.functional as F

    for xb, yb in batches:
        (F.mse_loss(model(xb), yb) / len(batches)).backward()


def no_division(model, batches):  # one all-reduce at the right place, loss not divided by K
    import torch.nn.functional as F

    K = len(batches)
    for k, (xb, yb) in enumerate(batches):
        model.require_backward_grad_sync = (k == K - 1)
        F.mse_loss(model(xb), yb).backward()


def with_no_sync(model, batches):  # right, but not the exercise
    from contextlib import nullcontext

    import torch.nn.functional as F

    K = len(batches)
    for k, (xb, yb) in enumerate(batches):
        with nullcontext() if k == K - 1 else model.no_sync():
            (F.mse_loss(model(xb), yb) / K).backward()


def run_check_accumulate(name):
    """On a rank: the verdict of check_accumulate on one answer ("passed" or the message)."""
    from course_utils.ddp_probes import accumulate_with_flag, check_accumulate

    answers = {"scaffold": scaffold_accumulate, "flag_after_forward": flag_after_forward,
               "flag_never_false": flag_never_false, "no_division": no_division,
               "with_no_sync": with_no_sync, "solution": accumulate_with_flag}
    try:
        check_accumulate(answers[name])
    except AssertionError as exc:
        return str(exc)
    return "passed"


@pytest.mark.parametrize("answer, reason", [
    ("scaffold", r"accumulate is not written yet \(exercise 2: write accumulate\)"),
    ("flag_after_forward", r"at micro-step\(s\) \[0\] of 0..3: expected exactly one, at the last .* "
                           r"you set it AFTER the forward.* set it before calling the model"),
    ("flag_never_false", r"4 all-reduce\(s\), at micro-step\(s\) \[0, 1, 2, 3\] .* The flag was True at every forward"),
    ("no_division", r"4 \(= accum_steps\) times too large: divide each micro-batch's loss"),
    ("with_no_sync", r"accumulate calls model.no_sync\(\): .* setting model.require_backward_grad_sync yourself"),
])
def test_check_accumulate_rejects_wrong_answers(cluster2, answer, reason):
    verdicts = cluster2.run(run_check_accumulate, answer)
    assert verdicts[0] == verdicts[1], "both ranks must reach the same verdict"
    import re

    assert re.search(reason, verdicts[0]), verdicts[0]


def test_check_accumulate_passes_the_solution(cluster2):
    assert cluster2.run(run_check_accumulate, "solution") == ["passed", "passed"]


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


def test_describe_cap_sweep_follows_the_numbers():
    """07's verdict on its bucket_cap_mb sweep: the fastest cap, and whether overlap paid against one bucket."""
    from course_utils.ddp_probes import describe_cap_sweep

    caps, buckets = (0.25, 2, 4, 25), (7, 4, 2, 1)
    one_wins = describe_cap_sweep(caps, buckets, (0.0290, 0.0259, 0.0262, 0.0244))  # the review's stored run
    assert "the fastest was bucket_cap_mb=25 (1 bucket)" in one_wins and "one bucket" in one_wins, one_wins
    assert "19% faster than the slowest, bucket_cap_mb=0.25" in one_wins, one_wins
    overlap_pays = describe_cap_sweep(caps, buckets, (0.030, 0.020, 0.022, 0.028))
    assert "bucket_cap_mb=2 (4 buckets)" in overlap_pays and "40% faster than one bucket" in overlap_pays
    assert "overlapping the all-reduces with backward paid" in overlap_pays, overlap_pays
    barely = describe_cap_sweep(caps, buckets, (0.030, 0.0200, 0.022, 0.0205))
    assert "barely paid" in barely, barely
    tie = describe_cap_sweep(caps, buckets, (0.0250, 0.0251, 0.0252, 0.0255))
    assert "no measurable difference" in tie and "fastest" in tie, tie
