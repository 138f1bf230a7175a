"""The checkers of 11_capstone_micro_ddp's pieces, fed what a learner writes: the untouched scaffold, typical wrong
answers (each must fail with a reason the learner can act on and a hint that fits the piece) and right answers
written differently (each must pass). Real gloo ranks.

    .venv/bin/python -m pytest -n 0 tests/test_checker_micro_ddp_pieces.py
"""
import sys

import pytest
import torch
import torch.distributed as dist

from conftest import register_by_value
from exercise_helpers import verdict

register_by_value(sys.modules[__name__])  # the answers below run on the ranks


@pytest.fixture(scope="module")
def cluster(make_cluster):
    return make_cluster(2, timeout=60)


def _scaffold(*args, **kwargs):
    raise NotImplementedError("write it, then run this cell again")


# -- piece 1: broadcast_state ---------------------------------------------------------------------

def bs_parameters_only(module):
    with torch.no_grad():
        for p in module.parameters():
            dist.broadcast(p, src=0)


def bs_from_last_rank(module):
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            dist.broadcast(t, src=dist.get_world_size() - 1)


def bs_copies_not_in_place(module):
    for t in [*module.parameters(), *module.buffers()]:
        t = t.detach().clone()
        dist.broadcast(t, src=0)


def bs_by_name(module):
    from torch.distributed import broadcast
    for t in module.state_dict().values():          # detached views of every parameter and buffer
        broadcast(t, 0)


def bs_async(module):
    with torch.no_grad():
        works = [dist.broadcast(t, src=0, async_op=True) for t in [*module.parameters(), *module.buffers()]]
    for work in works:
        work.wait()


def _bs_verdict(fn):
    from course_utils.checks import check_broadcast_state
    return verdict(check_broadcast_state, fn)


@pytest.mark.parametrize("fn, words", [
    (_scaffold, ["NotImplementedError", "write it"]),
    (bs_parameters_only, ["buffer 'steps'", "AND every buffer"]),
    (bs_from_last_rank, ["differs from rank 0's", "src=0"]),
    (bs_copies_not_in_place, ["differs from rank 0's", "in place"]),
])
def test_check_broadcast_state_rejects(cluster, fn, words):
    got = cluster.run(_bs_verdict, fn)[0]
    assert got, f"{fn.__name__} must fail"
    for w in words:
        assert w in got, (w, got)


@pytest.mark.parametrize("fn", [bs_by_name, bs_async])
def test_check_broadcast_state_passes_right_answers(cluster, fn):
    from course_utils.micro_ddp import broadcast_state
    assert cluster.run(_bs_verdict, fn) == [None, None]
    assert cluster.run(_bs_verdict, broadcast_state) == [None, None]


# -- piece 2: assign_buckets ------------------------------------------------------------------------

def ab_registration_order(params, bucket_cap_mb=25, order=None):
    cap, buckets, current, size = bucket_cap_mb * 2**20, [], [], 0
    for i in (range(len(params)) if order is None else order):
        current.append(i)
        size += params[i].numel() * params[i].element_size()
        if size >= cap:
            buckets, current, size = buckets + [current], [], 0
    return buckets + [current] if current else buckets


def ab_never_overflows(params, bucket_cap_mb=25, order=None):   # closes BEFORE a parameter would overflow
    cap, buckets, current, size = bucket_cap_mb * 2**20, [], [], 0
    for i in (reversed(range(len(params))) if order is None else order):
        n = params[i].numel() * params[i].element_size()
        if current and size + n > cap:
            buckets, current, size = buckets + [current], [], 0
        current.append(i)
        size += n
    return buckets + [current] if current else buckets


def ab_ignores_order(params, bucket_cap_mb=25, order=None):
    return _ab_reverse(params, bucket_cap_mb)


def _ab_reverse(params, bucket_cap_mb):
    cap, buckets, current, size = bucket_cap_mb * 2**20, [], [], 0
    for i in reversed(range(len(params))):
        current.append(i)
        size += params[i].nbytes
        if size >= cap:
            buckets, current, size = buckets + [current], [], 0
    return buckets + [current] if current else buckets


def ab_no_order_parameter(params, bucket_cap_mb=25):
    return _ab_reverse(params, bucket_cap_mb)


def ab_written_differently(params, bucket_cap_mb=25, order=None):
    order = list(order) if order is not None else list(range(len(params)))[::-1]
    buckets = [[]]
    filled = 0
    for i in order:
        if filled >= bucket_cap_mb * 1024 * 1024:
            buckets.append([])
            filled = 0
        buckets[-1].append(i)
        filled += params[i].nbytes
    return buckets


def _ab_verdict(fn):
    from course_utils.checks import check_assign_buckets
    return verdict(check_assign_buckets, fn)


@pytest.mark.parametrize("fn, words", [
    (_scaffold, ["NotImplementedError"]),
    (ab_registration_order, ["starts with parameter 0", "REVERSE"]),
    (ab_never_overflows, ["closes as soon as it holds at least the cap", "overflow by one parameter"]),
    (ab_ignores_order, ["walk the parameters in the given order"]),
    (ab_no_order_parameter, ["TypeError", "order=None"]),
])
def test_check_assign_buckets_rejects(fn, words):
    got = _ab_verdict(fn)
    assert got, f"{fn.__name__} must fail"
    for w in words:
        assert w in got, (w, got)


def test_check_assign_buckets_passes_right_answers():
    from course_utils.micro_ddp import assign_buckets
    assert _ab_verdict(ab_written_differently) is None
    assert _ab_verdict(assign_buckets) is None


# -- piece 3: start_allreduce ---------------------------------------------------------------------

def sa_no_division(flat):
    return dist.all_reduce(flat, async_op=True)


def sa_blocking(flat):
    flat /= dist.get_world_size()
    dist.all_reduce(flat)


def sa_divides_a_copy(flat):
    return dist.all_reduce(flat / dist.get_world_size(), async_op=True)


def sa_imported_by_name(flat):
    from torch.distributed import all_reduce, get_world_size
    flat.mul_(1.0 / get_world_size())
    return all_reduce(flat, async_op=True)


def sa_group_method(flat):
    torch.div(flat, dist.get_world_size(), out=flat)
    return dist.group.WORLD.allreduce([flat])


def _sa_verdict(fn):
    from course_utils.checks import check_start_allreduce
    return verdict(check_start_allreduce, fn)


@pytest.mark.parametrize("fn, words", [
    (_scaffold, ["NotImplementedError"]),
    (sa_no_division, ["SUM over the ranks", "divide by world_size"]),
    (sa_blocking, ["returned no Work", "async_op=True"]),
    (sa_divides_a_copy, ["flat is unchanged", "a copy", "in place"]),
])
def test_check_start_allreduce_rejects(cluster, fn, words):
    got = cluster.run(_sa_verdict, fn)[0]
    assert got, f"{fn.__name__} must fail"
    for w in words:
        assert w in got, (w, got)


@pytest.mark.parametrize("fn", [sa_imported_by_name, sa_group_method])
def test_check_start_allreduce_passes_right_answers(cluster, fn):
    from course_utils.micro_ddp import start_allreduce
    assert cluster.run(_sa_verdict, fn) == [None, None]
    assert cluster.run(_sa_verdict, start_allreduce) == [None, None]


# -- piece 4: the class (check_micro_ddp): the no-op no_sync first ------------------------------

def _lesson_class():
    from course_utils.micro_ddp import LessonMicroDDP
    return LessonMicroDDP


def noop_no_sync(module, bucket_cap_mb):
    """Syncs every micro-step: the same gradients, so only counting the collectives inside no_sync() catches it."""
    import contextlib  # imported here: the function runs on the ranks, pickled by value


    class NoOpNoSync(_lesson_class()):
        @contextlib.contextmanager
        def no_sync(self):
            yield
    return NoOpNoSync(module, bucket_cap_mb)


def functional_in_no_sync(module, bucket_cap_mb):
    """no_sync works for the buckets, but a functional all-reduce (another route to the group) runs every step."""
    import torch.distributed._functional_collectives as fc

    class Functional(_lesson_class()):
        def forward(self, *args, **kwargs):
            if not self.require_backward_grad_sync:
                fc.all_reduce(torch.ones(1), "sum", dist.group.WORLD) + 0   # used, so it is waited for
            return super().forward(*args, **kwargs)
    return Functional(module, bucket_cap_mb)


def restores_true(module, bucket_cap_mb):
    import contextlib  # imported here: the function runs on the ranks, pickled by value


    class RestoresTrue(_lesson_class()):
        @contextlib.contextmanager
        def no_sync(self):
            self.require_backward_grad_sync = False
            try:
                yield
            finally:
                self.require_backward_grad_sync = True
    return RestoresTrue(module, bucket_cap_mb)


def class_scaffold(module, bucket_cap_mb):
    raise NotImplementedError("write MyMicroDDP.__init__, no_sync, grad_ready and finish, then run this cell again")


def _ddp_verdict(make):
    from course_utils.checks import check_micro_ddp
    return verdict(check_micro_ddp, make)


@pytest.mark.parametrize("make, words", [
    (noop_no_sync, ["no_sync accumulation", "inside no_sync()", "collective(s)", "require_backward_grad_sync"]),
    (functional_in_no_sync, ["inside no_sync()", "all-reduce"]),
    (restores_true, ["nested no_sync()", "expected False", "not True"]),
    (class_scaffold, ["NotImplementedError", "constructing your wrapper"]),
])
def test_check_micro_ddp_rejects(cluster, make, words):
    got = cluster.run(_ddp_verdict, make)[0]
    assert got, f"{make.__name__} must fail"
    for w in words:
        assert w in got, (w, got)


def test_check_micro_ddp_passes_the_lessons_solution(cluster):
    from course_utils.micro_ddp import LessonMicroDDP
    assert cluster.run(_ddp_verdict, lambda m, cap: LessonMicroDDP(m, cap)) == [None, None]
