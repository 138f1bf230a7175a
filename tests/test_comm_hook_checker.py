"""check_comm_hook with real processes (gloo, 3 ranks): right hooks pass, wrong hooks are explained.

3 ranks so that "off by world_size" (3) cannot be confused with a factor of 2.
"""
import sys

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook, fp16_compress_hook
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook

from course_utils.checks import check_comm_hook
from course_utils.hooks import bf16_hook, fp16_hook

from conftest import register_by_value
register_by_value(sys.modules[__name__])  # the ranks cannot import this test module


@pytest.fixture(scope="module")
def cluster3(make_cluster):
    return make_cluster(world_size=3, timeout=30)  # gloo, shared within this module


# -- hooks the checker must reject --------------------------------------------------------------
def verbatim_hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future:  # the article's, verbatim
    compressed = bucket.buffer() * 0.5
    fut = dist.all_reduce(compressed, async_op=True).get_future()

    def decompress(fut):
        return fut.value() / 0.5

    return fut.then(decompress)


def article_hook(state, bucket):  # the article's hook without its annotations
    compressed = bucket.buffer() * 0.5
    fut = dist.all_reduce(compressed, async_op=True).get_future()

    def decompress(fut):
        return fut.value() / 0.5

    return fut.then(decompress)


def sum_hook(state, bucket):  # the article's hook fixed to run: returns the SUM
    compressed = bucket.buffer() * 0.5
    fut = dist.all_reduce(compressed, async_op=True).get_future()
    return fut.then(lambda fut: fut.value()[0] / 0.5)


def twice_divided_hook(state, bucket):
    buf = bucket.buffer().div_(dist.get_world_size())
    fut = dist.all_reduce(buf, async_op=True).get_future()
    return fut.then(lambda fut: fut.value()[0] / dist.get_world_size())


def local_hook(state, bucket):  # no communication at all: every rank keeps its own gradient
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def zero_hook(state, bucket):
    fut = torch.futures.Future()
    fut.set_result(torch.zeros_like(bucket.buffer()))
    return fut


def shuffled_hook(state, bucket):  # averages, then copies back in the wrong order
    buf = bucket.buffer().div_(dist.get_world_size())
    fut = dist.all_reduce(buf, async_op=True).get_future()
    return fut.then(lambda fut: fut.value()[0].flip(0))


def overflow_hook(state, bucket):  # fp16, dividing AFTER the sum, on huge gradients
    half = (bucket.buffer() * 1e6).half()
    fut = dist.all_reduce(half, async_op=True).get_future()
    return fut.then(lambda fut: fut.value()[0].float() / dist.get_world_size() / 1e6)


def wrong_shape_hook(state, bucket):
    buf = bucket.buffer().div_(dist.get_world_size())
    fut = dist.all_reduce(buf, async_op=True).get_future()
    return fut.then(lambda fut: fut.value()[0][:-1].clone())


def mean_hook(state, bucket):  # the corrected article hook
    buf = bucket.buffer().div_(dist.get_world_size())
    fut = dist.all_reduce(buf, async_op=True).get_future()
    return fut.then(lambda fut: fut.value()[0])


def test_verbatim_article_hook_is_refused_for_its_annotation(cluster3):
    with pytest.raises(AssertionError) as info:
        check_comm_hook(verbatim_hook, cluster=cluster3)
    msg = str(info.value)
    assert "verbatim_hook raised on rank 0 (registering the hook): ValueError" in msg, msg
    assert "Future[torch.Tensor]" in msg, f"the hint should say which annotation DDP wants: {msg}"


def test_article_hook_raises_and_is_explained(cluster3):
    with pytest.raises(AssertionError) as info:
        check_comm_hook(article_hook, cluster=cluster3)
    msg = str(info.value)
    assert "article_hook raised on rank 0" in msg, msg
    assert "unsupported operand type(s) for /: 'list' and 'float'" in msg, msg
    assert "fut.value()[0]" in msg, f"the hint should say how to fix it: {msg}"


@pytest.mark.parametrize("hook, explanation", [
    (sum_hook, r"SUM .* 3 \(= world_size\) times the mean"),
    (twice_divided_hook, r"1/3 of DDP's: it divides by world_size twice"),
    (local_hook, r"rank 1's gradients differ from rank 0's"),
    (zero_hook, r"all ZERO"),
    (shuffled_hook, r"not a scaled copy either: garbage"),
    (overflow_hook, r"inf/nan .* 65504"),
    (wrong_shape_hook, r"wrong_shape_hook raised on rank 0"),
], ids=lambda v: getattr(v, "__name__", ""))
def test_each_wrong_hook_gets_its_explanation(cluster3, hook, explanation):
    with pytest.raises(AssertionError, match=explanation):
        check_comm_hook(hook, cluster=cluster3)


def test_fp16_fails_the_lossless_default_but_passes_a_loose_rtol(cluster3, capsys):
    lossy = r"close to DDP.s average .* rtol=1e-05. A lossy .* significant bits"
    with pytest.raises(AssertionError, match=lossy) as info:
        check_comm_hook(fp16_hook, cluster=cluster3)
    assert "rtol=0.001" not in str(info.value), "09's exercise 2 asks for that tolerance: never suggested"
    check_comm_hook(fp16_hook, rtol=1e-2, cluster=cluster3)
    check_comm_hook(fp16_compress_hook, rtol=1e-2, cluster=cluster3)
    check_comm_hook(bf16_hook, rtol=5e-2, cluster=cluster3)
    out = capsys.readouterr().out
    assert "check_comm_hook: fp16_hook matches DDP's all-reduce on 3 ranks" in out, out


# -- hooks the checker must accept -----------------------------------------------------------
def test_lossless_hooks_pass(cluster3, capsys):
    check_comm_hook(allreduce_hook, cluster=cluster3)
    check_comm_hook(mean_hook, cluster=cluster3)
    out = capsys.readouterr().out
    assert out.count("matches DDP's all-reduce") == 2, out


def test_powersgd_needs_a_loose_rtol_and_a_state_factory(cluster3):
    def state():
        return PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2)

    # the first 2 steps are plain all-reduce, step 2 is compressed: the lossless default fails there
    with pytest.raises(AssertionError, match=r"powerSGD_hook is wrong at step 2"):
        check_comm_hook(powerSGD_hook, state=state, cluster=cluster3)
    check_comm_hook(powerSGD_hook, state=state, rtol=1.0, cluster=cluster3)
    # with only the warm-up steps, PowerSGD is an exact all-reduce
    check_comm_hook(powerSGD_hook, state=state, steps=2, cluster=cluster3)


def test_bf16_builtin_refusal_is_reported(cluster3):
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook

    if torch.version.cuda is not None:
        pytest.skip("a CUDA build of torch accepts bf16_compress_hook")
    with pytest.raises(AssertionError, match=r"raised on rank 0 \(registering the hook\): TypeError: BF16"):
        check_comm_hook(bf16_compress_hook, cluster=cluster3)


def test_not_a_function_is_explained():
    with pytest.raises(AssertionError, match="not a function"):
        check_comm_hook(None)


def never_completes_hook(state, bucket):  # DDP waits for this future forever
    return torch.futures.Future()


def test_a_hanging_hook_times_out_with_an_explanation():
    # its own cluster: the stuck ranks may be replaced with fresh ones, which must not disturb the
    # cluster the other tests share (so this test can run in any order)
    from course_utils import Cluster

    with Cluster(world_size=3, backend="gloo", timeout=30) as own:
        # first a passing check: DDP's first construction imports torch._dynamo (seconds on a busy
        # machine), and the 5 s below must time out the hook, not that import
        check_comm_hook(allreduce_hook, cluster=own, quiet=True, timeout=120)
        with pytest.raises(AssertionError, match=r"did not finish within 5 s on 3 ranks"):
            check_comm_hook(never_completes_hook, cluster=own, timeout=5)
        check_comm_hook(allreduce_hook, cluster=own, quiet=True)  # the cluster is usable again


# -- near misses: the tolerance itself is tested ---------------------------------------------------
def scaled_hook(factor):
    """DDP's average times ``factor``: a relative error of |factor - 1| in every step."""
    def near_miss(state, bucket):
        buf = bucket.buffer().div_(dist.get_world_size())
        fut = dist.all_reduce(buf, async_op=True).get_future()
        return fut.then(lambda fut: fut.value()[0] * factor)
    return near_miss


def bf16_sum_then_divide(state, bucket):  # adds in bfloat16, divides afterwards: 8 bits of mantissa
    buffer = bucket.buffer()
    low = buffer.to(torch.bfloat16)
    fut = dist.all_reduce(low, async_op=True).get_future()

    def back(fut):
        buffer.copy_(fut.value()[0]).div_(dist.get_world_size())
        return buffer
    return fut.then(back)


def test_an_error_just_below_the_tolerance_passes(cluster3):
    check_comm_hook(scaled_hook(1 + 3e-6), cluster=cluster3, quiet=True)            # 3e-6 < rtol=1e-5
    check_comm_hook(scaled_hook(1 + 3e-4), rtol=1e-3, cluster=cluster3, quiet=True)


def test_an_error_just_above_the_tolerance_is_a_near_miss_not_a_wrong_scale(cluster3):
    with pytest.raises(AssertionError, match=r"close to DDP.s average but not within the tolerance: relative "
                                             r"error 3.0e-05, allowed rtol=1e-05"):
        check_comm_hook(scaled_hook(1 + 3e-5), cluster=cluster3)


def test_adding_in_bf16_is_caught_by_the_lossless_tolerance(cluster3):
    with pytest.raises(AssertionError, match=r"close to DDP.s average .* rtol=1e-05. A lossy .* significant bits"):
        check_comm_hook(bf16_sum_then_divide, cluster=cluster3)
    check_comm_hook(bf16_sum_then_divide, rtol=1e-2, cluster=cluster3, quiet=True)


def test_a_lossless_hook_prints_its_error_as_a_bound_that_survives_other_cpus(cluster3, capsys):
    check_comm_hook(allreduce_hook, cluster=cluster3)
    assert "(max relative error < 1e-06, rtol=1e-05)" in capsys.readouterr().out
