"""The self-checks of 11_capstone_micro_ddp's exercises, fed the unmodified scaffold, typical wrong
answers and near misses (each must fail with a reason a learner can act on) and the course's
solution (which must pass). Real gloo ranks.

    .venv/bin/python -m pytest tests/test_exercises_11.py -p no:randomly
"""
import contextlib
import sys

import pytest
import torch
import torch.distributed as dist
from torch import nn

from conftest import register_by_value
from exercise_helpers import notebook_cell, run_exercise_cell, verdict

register_by_value(sys.modules[__name__])  # the wrong answers below run on the ranks

NOTEBOOK = "11_capstone_micro_ddp.ipynb"


@pytest.fixture(scope="module")
def cluster(make_cluster):
    return make_cluster(2, timeout=120)


# -- exercise 1: a compressor of your own (check_compressor) --------------------------------------


def test_exercise_1_cell_passes_with_the_solution_and_its_scaffold_fails(cluster):
    source = notebook_cell(NOTEBOOK, "class MyFp16")
    assert "USE_SOLUTION = True" in source, "the stored notebook must run the course's solution"
    assert cluster.run(run_exercise_cell, source) == [None, None], "the course's solution must pass"
    verdict = cluster.run(run_exercise_cell, source.replace("USE_SOLUTION = True", "USE_SOLUTION = False"))[0]
    assert verdict and "NotImplementedError" in verdict and "write MyFp16.start" in verdict, verdict


# -- the pieces of sections 2 to 5: each cell passes with the course's solution, its scaffold fails ---------

PIECES_PREAMBLE = """import contextlib
from course_utils import micro_ddp as course
from course_utils.checks import check_assign_buckets, check_broadcast_state, check_micro_ddp, check_start_allreduce
device = torch.device("cpu")
"""


@pytest.mark.parametrize("marker, message", [
    ("def my_broadcast_state", "write my_broadcast_state"),
    ("def my_assign_buckets", "write my_assign_buckets"),
    ("def my_start_allreduce", "write my_start_allreduce"),
    ("class MyMicroDDP", "write MyMicroDDP.__init__"),
])
def test_piece_cell_passes_with_the_solution_and_its_scaffold_fails(cluster, marker, message):
    source = notebook_cell(NOTEBOOK, marker, ddp_line=False)
    assert cluster.run(run_exercise_cell, PIECES_PREAMBLE + source) == [None, None], "the course's solution must pass"
    got = cluster.run(run_exercise_cell, PIECES_PREAMBLE + notebook_cell(NOTEBOOK, marker, ddp_line=False,
                                                                          solution=False))[0]
    assert got and "NotImplementedError" in got and message in got, got


class ArticleHook:  # the article's "compression", ported to run: times 0.5, all-reduce, divide by 0.5
    def start(self, flat, bucket, group):
        half = flat * 0.5
        work = dist.all_reduce(half, group=group, async_op=True)
        return work, lambda: flat.copy_(half / 0.5)


class ArticleHookDivided:  # the same, with the division by world size added: still fp32 on the wire
    def start(self, flat, bucket, group):
        half = flat * 0.5 / dist.get_world_size(group)
        work = dist.all_reduce(half, group=group, async_op=True)
        return work, lambda: flat.copy_(half / 0.5)


class Fp16NoCopyBack:  # sends fp16, but the result never comes back into the bucket
    def start(self, flat, bucket, group):
        low = flat.div(dist.get_world_size(group)).half()
        return dist.all_reduce(low, group=group, async_op=True), None


class Fp16Sum:  # casts and sends, forgets the division
    def start(self, flat, bucket, group):
        low = flat.half()
        return dist.all_reduce(low, group=group, async_op=True), lambda: flat.copy_(low)


class Bf16:  # a near miss for max_rel_error=1e-3: right idea, 8 significant bits only
    def start(self, flat, bucket, group):
        low = flat.div(dist.get_world_size(group)).bfloat16()
        return dist.all_reduce(low, group=group, async_op=True), lambda: flat.copy_(low)


def _compressor_verdict(compressor):
    from course_utils.checks import check_compressor

    return verdict(check_compressor, compressor, max_rel_error=1e-3)


@pytest.mark.parametrize("compressor, words", [
    (ArticleHook(), ["world_size x the average", "divide by world_size"]),
    (ArticleHookDivided(), ["as many as fp32", "32-bit", "Change the dtype"]),
    (Fp16NoCopyBack(), ["this rank's own gradient", "copy them into flat"]),
    (Fp16Sum(), ["world_size x the average"]),
    (Bf16(), ["off the average by", "allowed 0.001", "more bits"]),
], ids=["article-hook", "article-hook-divided", "no-copy-back", "fp16-sum", "bf16-near-miss"])
def test_check_compressor_explains_wrong_answers(cluster, compressor, words):
    verdict = cluster.run(_compressor_verdict, compressor)[0]
    assert verdict, f"{type(compressor).__name__} must fail check_compressor(max_rel_error=1e-3)"
    for w in words:
        assert w in verdict, f"the verdict should mention {w!r}: {verdict}"


def test_check_compressor_passes_the_solution_and_bf16_at_its_tolerance(cluster):
    from course_utils.micro_ddp import Cast

    assert cluster.run(_compressor_verdict, Cast(torch.float16)) == [None, None]
    assert cluster.run(lambda c: verdict(__import__("course_utils.checks", fromlist=["x"]).check_compressor, c,
                                          max_rel_error=1e-2), Bf16()) == [None, None], "bf16 is within 1e-2"


# -- check_micro_ddp: wrappers that are wrong, or right but do not overlap -------------------------

class _Wrapper(nn.Module):
    """Shared plumbing of the hand-written wrong wrappers: broadcast, hooks, no_sync."""

    def __init__(self, module, bucket_cap_mb=25, broadcast=True):
        super().__init__()
        from course_utils.micro_ddp import broadcast_state

        self.module = module
        if broadcast:
            broadcast_state(module)
        self.params = [p for p in module.parameters() if p.requires_grad]
        for p in self.params:
            p.register_post_accumulate_grad_hook(self.hook)
        self.require_backward_grad_sync = True

    def forward(self, *args, **kwargs):
        self.sync, self.queued = self.require_backward_grad_sync, False
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        old, self.require_backward_grad_sync = self.require_backward_grad_sync, False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old


class AfterBackward(_Wrapper):
    """Numerically right, but every all-reduce starts after backward has finished: no overlap."""

    def hook(self, p):
        if self.sync and not self.queued:
            self.queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)

    def finish(self):
        for p in self.params:
            p.grad /= dist.get_world_size()
            dist.all_reduce(p.grad)


class BlockingHooks(_Wrapper):
    """Numerically right, all-reduces during backward, but blocking: backward waits for each one."""

    def hook(self, p):
        if self.sync:
            p.grad /= dist.get_world_size()
            dist.all_reduce(p.grad)


class NoBroadcast(BlockingHooks):
    def __init__(self, module, bucket_cap_mb=25):
        super().__init__(module, bucket_cap_mb, broadcast=False)


class PerParameterAsync(_Wrapper):
    """One async all-reduce per gradient, launched from its hook (in ready order), waited at the end: right only
    while every rank's backward produces the gradients in the same order."""

    def hook(self, p):
        if not self.sync:
            return
        if not self.queued:
            self.queued, self.works = True, []
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)
        p.grad /= dist.get_world_size()
        self.works.append(dist.all_reduce(p.grad, async_op=True))

    def finish(self):
        for work in self.works:
            work.wait()


class StaleWork(nn.Module):
    """Lesson 11's MyMicroDDP as it stood before the review: buckets launched in order, but finish() waits on
    every bucket's .work, also one left over from a previous backward when a bucket was not launched."""

    def __init__(self, module, bucket_cap_mb=25):
        super().__init__()
        from course_utils.micro_ddp import Bucket, assign_buckets, broadcast_state

        self.module = module
        broadcast_state(module)
        params = [p for p in module.parameters() if p.requires_grad]
        layout = assign_buckets(params, bucket_cap_mb)
        self.buckets = [Bucket(b, [params[i] for i in idx]) for b, idx in enumerate(layout)]
        self.slot = {p: (bucket, i) for bucket in self.buckets for i, p in enumerate(bucket.params)}
        for p in params:
            p.register_post_accumulate_grad_hook(self.grad_ready)
        self.require_backward_grad_sync = True

    def forward(self, *args, **kwargs):
        self.sync = self.require_backward_grad_sync
        self.next_bucket, self.queued = 0, False
        for bucket in self.buckets:
            bucket.ready = set()
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        old, self.require_backward_grad_sync = self.require_backward_grad_sync, False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old

    def grad_ready(self, p):
        if not self.sync:
            return
        if not self.queued:
            self.queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)
        bucket, i = self.slot[p]
        bucket.view(i).copy_(p.grad)
        bucket.ready.add(i)
        while self.next_bucket < len(self.buckets):
            bucket = self.buckets[self.next_bucket]
            if len(bucket.ready) < len(bucket.params):
                break
            bucket.buffer.div_(dist.get_world_size())
            bucket.work = dist.all_reduce(bucket.buffer, async_op=True)
            self.next_bucket += 1

    def finish(self):
        for bucket in self.buckets:
            bucket.work.wait()
            for i, p in enumerate(bucket.params):
                p.grad.copy_(bucket.view(i))


class ResetInForwardOnly(StaleWork):
    """Lesson 11's MyMicroDDP with one slip: right on every forward-backward pair, but only forward
    resets `queued` (and the next bucket, the ready sets), so a second backward through a retained graph queues no
    finish, launches no bucket, and silently leaves this rank's local gradient added to the first average."""

    def finish(self):
        if self.next_bucket < len(self.buckets):
            raise RuntimeError("a parameter got no gradient in this backward: its bucket was never reduced")
        for bucket in self.buckets:
            bucket.work.wait()
            for i, p in enumerate(bucket.params):
                p.grad.copy_(bucket.view(i))
            bucket.work = None


class ResetInFinishButKeepsNextBucket(ResetInForwardOnly):
    """Resets `queued` when a backward ends, but not the next bucket: the second backward launches nothing and its
    finish waits on a bucket.work that is gone (None)."""

    def finish(self):
        super().finish()
        self.queued = False


def frozen_after_wrapping(module, bucket_cap_mb):
    """Buckets built while every parameter still required grad: the frozen one's bucket never fills."""
    from course_utils.micro_ddp import MicroDDP

    frozen = [p for p in module.parameters() if not p.requires_grad]
    for p in frozen:
        p.requires_grad_(True)
    wrapper = MicroDDP(module, bucket_cap_mb)
    for p in frozen:
        p.requires_grad_(False)
    return wrapper


def noop_no_sync(module, bucket_cap_mb):
    """The reference MicroDDP with a no_sync() that does nothing: every micro-step syncs."""
    import contextlib

    from course_utils.micro_ddp import MicroDDP

    class NoOpNoSync(MicroDDP):
        @contextlib.contextmanager
        def no_sync(self):
            yield

    return NoOpNoSync(module, bucket_cap_mb)


def no_rebuild(module, bucket_cap_mb):
    """Right, overlapping when registration order is backward's order, but never rebuilt."""
    from course_utils.micro_ddp import MicroDDP

    wrapper = MicroDDP(module, bucket_cap_mb)
    wrapper.rebuild_buckets = False
    return wrapper


def buffers_at_construction_only(module, bucket_cap_mb):
    """Duties 1 to 5, but the buffers broadcast only at construction: BatchNorm's statistics drift apart."""
    from course_utils.micro_ddp import LessonMicroDDP

    class AtConstructionOnly(LessonMicroDDP):
        def sync_buffers(self):
            pass
    return AtConstructionOnly(module, bucket_cap_mb)


def averaged_buffers(module, bucket_cap_mb):
    """The buffers averaged over the ranks at every forward: the ranks agree, on statistics torch DDP never keeps."""
    from course_utils.micro_ddp import LessonMicroDDP

    class Averaged(LessonMicroDDP):
        def sync_buffers(self):
            with torch.no_grad():
                for b in self.module.buffers():
                    if b.is_floating_point():
                        dist.all_reduce(b, op=dist.ReduceOp.AVG)
    return Averaged(module, bucket_cap_mb)


class _NoDivide:
    def start(self, flat, bucket, group):
        return dist.all_reduce(flat, group=group, async_op=True), None


class _Fp64:  # all-reduce in float64: differs from torch DDP by rounding only (a near miss that must pass)
    def start(self, flat, bucket, group):
        wide = flat.double()
        work = dist.all_reduce(wide, group=group, async_op=True)
        return work, lambda: flat.copy_(wide / dist.get_world_size(group))


def _micro_ddp_verdict(kind, rebuild=False):
    import torch

    from course_utils import micro_ddp as ref
    from course_utils.checks import check_micro_ddp

    makers = {
        "after-backward": AfterBackward,
        "blocking-hooks": BlockingHooks,
        "no-broadcast": NoBroadcast,
        "frozen-after-wrapping": frozen_after_wrapping,
        "per-parameter-async": PerParameterAsync,
        "no-divide": lambda m, cap: ref.MicroDDP(m, cap, compressor=_NoDivide()),
        "bf16-near-miss": lambda m, cap: ref.MicroDDP(m, cap, compressor=ref.Cast(torch.bfloat16)),
        "fp16-near-miss": lambda m, cap: ref.MicroDDP(m, cap, compressor=ref.Cast(torch.float16)),
        "fp64-rounding": lambda m, cap: ref.MicroDDP(m, cap, compressor=_Fp64()),
        "solution": lambda m, cap: ref.MicroDDP(m, cap),
        "stale-work": StaleWork,
        "reset-in-forward-only": ResetInForwardOnly,
        "reset-in-finish-keeps-next-bucket": ResetInFinishButKeepsNextBucket,
        "no-rebuild": no_rebuild,
        "noop-no-sync": noop_no_sync,
        "buffers-at-construction-only": buffers_at_construction_only,
        "averaged-buffers": averaged_buffers,
        "lesson-solution": lambda m, cap: ref.LessonMicroDDP(m, cap),
        "lesson-rebuilding": lambda m, cap: ref.RebuildingLessonMicroDDP(m, cap),
    }
    return verdict(check_micro_ddp, makers[kind], rebuild=rebuild)


@pytest.mark.parametrize("kind, words", [
    # first: a no_sync() that does nothing gives the same gradients; only the collectives inside it show it
    ("noop-no-sync", ["no_sync accumulation", "inside no_sync()", "collective(s)", "seen at the process group"]),
    ("after-backward", ["numerically right", "overlap", "from the gradient hooks"]),
    ("blocking-hooks", ["numerically right", "block", "async_op=True"]),
    ("no-broadcast", ["right after construction", "Broadcast rank 0's parameters"]),
    ("frozen-after-wrapping", ["a model with a frozen parameter", "raised RuntimeError", "net.0.bias"]),
    ("no-divide", ["world_size x the average", "divide by world_size"]),
    # duty 6: BatchNorm's running statistics are buffers, which no gradient carries
    ("buffers-at-construction-only", ["a model with BatchNorm", "different outputs on the ranks",
                                      "broadcasts rank 0's buffers at the start of every forward", "sync_buffers"]),
    ("averaged-buffers", ["a model with BatchNorm", "not with torch DDP", "not an average"]),
    ("bf16-near-miss", ["tolerance 1e-06", "16 bits"]),
    ("fp16-near-miss", ["tolerance 1e-06", "16 bits"]),
    # launched in ready order, not bucket order: right while every rank's backward runs in the same order
    ("per-parameter-async", ["another order on each rank", "strictly in bucket order", "rank 0's a is summed"]),
    ("stale-work", ["a backward in which one layer takes no part", "stale result", "raise an error"]),
    # a second backward through a retained graph has no forward before it
    ("reset-in-forward-only", ["a second backward through a retained graph", "LOCAL gradient of the second",
                               "reset only in forward", "at the end of finish"]),
    ("reset-in-finish-keeps-next-bucket", ["a second backward through a retained graph", "raised AttributeError",
                                           "the next bucket to launch", "when it ends"]),
])
def test_check_micro_ddp_explains_wrong_wrappers(cluster, kind, words):
    verdict = cluster.run(_micro_ddp_verdict, kind)[0]
    assert verdict, f"{kind} must fail check_micro_ddp"
    for w in words:
        assert w in verdict, f"the verdict on {kind} should mention {w!r}: {verdict}"


@pytest.mark.parametrize("kind", ["solution", "fp64-rounding", "lesson-solution"])
def test_check_micro_ddp_passes_the_solution_and_rounding_differences(cluster, kind):
    assert cluster.run(_micro_ddp_verdict, kind) == [None, None]


def test_exercise_3_rebuild_check(cluster):
    verdict = cluster.run(_micro_ddp_verdict, "no-rebuild", True)[0]
    assert verdict and "another order than registered" in verdict and "overlap" in verdict \
        and "rebuild the buckets in the order the hooks fired" in verdict, verdict
    assert cluster.run(_micro_ddp_verdict, "no-rebuild", False) == [None, None], "without rebuild=True it passes"
    assert cluster.run(_micro_ddp_verdict, "solution", True) == [None, None], "the reference rebuilds: it passes"


# -- exercise 3: the rebuild, in the notebook's own cell ------------------------------------------

REBUILD_PREAMBLE = PIECES_PREAMBLE + "MyMicroDDP = course.LessonMicroDDP   # section 5 written\n"


def test_exercise_3_cell_passes_with_the_solution_and_its_scaffold_fails(cluster):
    source = notebook_cell(NOTEBOOK, "class MyRebuildingMicroDDP", ddp_line=False)
    assert cluster.run(run_exercise_cell, REBUILD_PREAMBLE + source) == [None, None], "the course's solution passes"
    got = cluster.run(run_exercise_cell, REBUILD_PREAMBLE + notebook_cell(NOTEBOOK, "class MyRebuildingMicroDDP",
                                                                          ddp_line=False, solution=False))[0]
    assert got and "NotImplementedError" in got and "write MyRebuildingMicroDDP.forward" in got, got
    assert cluster.run(_micro_ddp_verdict, "lesson-rebuilding", True) == [None, None]
    without = cluster.run(_micro_ddp_verdict, "lesson-solution", True)[0]
    assert without and "rebuild the buckets in the order the hooks fired" in without, without
