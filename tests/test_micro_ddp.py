"""MicroDDP (course_utils.micro_ddp) against torch DDP, and its checkers, on real gloo ranks."""
import sys

import cloudpickle
import pytest

from course_utils import Cluster

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the ranks cannot import this test module


@pytest.fixture(scope="module")
def cluster():
    with Cluster(world_size=2, timeout=120) as c:
        yield c


def _against_torch_ddp(bucket_cap_mb, accum_steps, steps):
    from course_utils.checks.micro_ddp import _compare
    from course_utils.micro_ddp import MicroDDP

    return _compare(lambda m, cap: MicroDDP(m, bucket_cap_mb=cap), "MicroDDP", bucket_cap_mb, accum_steps, steps)


@pytest.mark.parametrize("bucket_cap_mb, accum_steps", [(25, 1), (1e-9, 1), (1e-9, 3), (25, 4)],
                         ids=["25MiB", "tiny-buckets", "tiny-buckets-no_sync", "no_sync-4"])
def test_matches_torch_ddp_over_sgd_momentum_steps(cluster, bucket_cap_mb, accum_steps):
    problems = cluster.run(_against_torch_ddp, bucket_cap_mb, accum_steps, 4)
    assert problems == [None, None], f"MicroDDP differs from torch DDP by more than 1e-6: {problems}"


def _broadcast_and_average():
    import torch
    import torch.distributed as dist

    from course_utils.micro_ddp import MicroDDP
    from course_utils.models import make_model

    rank, ws = dist.get_rank(), dist.get_world_size()
    module = make_model(seed=10 + rank)
    module.register_buffer("counter", torch.tensor([float(rank + 1)]))
    model = MicroDDP(module, bucket_cap_mb=1e-9)
    state = [t.clone() for t in [*module.parameters(), *module.buffers()]]
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(rank))
    model(x).pow(2).mean().backward()
    grads = [p.grad.clone() for p in module.parameters()]
    reference = make_model(seed=10)
    reference(x).pow(2).mean().backward()
    expected = []
    for p in reference.parameters():
        g = p.grad.clone()
        dist.all_reduce(g)
        expected.append(g / ws)
    return state, grads, expected


def test_broadcasts_rank0_state_and_leaves_the_average_in_grad(cluster):
    import torch

    (state0, grads0, exp0), (state1, grads1, exp1) = cluster.run(_broadcast_and_average)
    for a, b in zip(state0, state1):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg="parameters/buffers differ after construction")
    assert state1[-1].item() == 1.0, "the buffer was not broadcast from rank 0"
    for got, want in zip(grads0 + grads1, exp0 + exp1):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-7, msg="after backward, .grad is not the average")
    for a, b in zip(grads0, grads1):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg="ranks hold different gradients")


def _timeline():
    import torch

    from course_utils.micro_ddp import MicroDDP
    from course_utils.models import make_model

    model = MicroDDP(make_model(seed=0), bucket_cap_mb=1e-9)
    model.events = []
    model(torch.randn(8, 16)).sum().backward()
    order = [(what, b) for what, b, _ in model.events]
    with model.no_sync():
        model.events = []
        model(torch.randn(8, 16)).sum().backward()
    quiet = [what for what, _, _ in model.events]
    names = {p: n for n, p in model.module.named_parameters()}
    return order, quiet, [[names[p] for p in b.params] for b in model.buckets]


def test_buckets_in_reverse_order_launch_during_backward(cluster):
    order, quiet, buckets = cluster.run(_timeline)[0]
    assert buckets == [["net.2.bias"], ["net.2.weight"], ["net.0.bias"], ["net.0.weight"]], \
        f"tiny buckets must hold one parameter each, last parameter first: {buckets}"
    launches = [i for i, (what, _) in enumerate(order) if what == "launch"]
    readies = [i for i, (what, _) in enumerate(order) if what == "grad ready"]
    end = order.index(("backward end", None))
    assert len(launches) == 4 and launches[0] < readies[-1] < end, \
        f"bucket 0 must start its all-reduce before backward computes the last gradient: {order}"
    assert [b for what, b in order if what == "launch"] == [0, 1, 2, 3], "buckets must launch in order"
    assert "launch" not in quiet and "backward end" not in quiet, f"no_sync() must not communicate: {quiet}"


def _compressed(name):
    import torch
    import torch.distributed as dist

    from course_utils.micro_ddp import MicroDDP
    from course_utils.models import make_model

    rank, ws = dist.get_rank(), dist.get_world_size()
    model = MicroDDP(make_model(seed=0, d_hidden=32), compressor=name)
    x = torch.randn(16, 16, generator=torch.Generator().manual_seed(rank))
    model(x).pow(2).mean().backward()
    errors = []
    ref = make_model(seed=0, d_hidden=32)
    ref(x).pow(2).mean().backward()
    for p, q in zip(model.module.parameters(), ref.parameters()):
        g = q.grad.clone()
        dist.all_reduce(g)
        g /= ws
        errors.append(((p.grad - g).abs().max() / g.abs().max()).item())
    return max(errors)


@pytest.mark.parametrize("name, tolerance", [("fp16", 2e-3), ("bf16", 2e-2)])
def test_cast_compressors_stay_close_to_the_average(cluster, name, tolerance):
    errors = cluster.run(_compressed, name)
    assert 0 < errors[0] < tolerance, f"{name}: relative error {errors[0]:.2e}, expected in (0, {tolerance})"


def _powersgd_feedback(rank_r, steps):
    import torch
    import torch.distributed as dist

    from course_utils.micro_ddp import MicroDDP, PowerSGD
    from course_utils.models import make_model

    rank, ws = dist.get_rank(), dist.get_world_size()
    comp = PowerSGD(rank=rank_r)
    model = MicroDDP(make_model(seed=0, d_hidden=32), compressor=comp)
    w = model.module.net[0].weight
    residuals, prev_error = [], torch.zeros_like(w)
    for step in range(steps):
        x = torch.randn(16, 16, generator=torch.Generator().manual_seed(100 * step + rank))
        ref = make_model(seed=0, d_hidden=32)
        ref.load_state_dict(model.module.state_dict())
        ref(x).pow(2).mean().backward()
        true = ref.net[0].weight.grad.clone()
        dist.all_reduce(true)
        true /= ws
        model.zero_grad()
        model(x).pow(2).mean().backward()
        b = next(b for b in model.buckets if any(p is w for p in b.params))
        i = next(i for i, p in enumerate(b.params) if p is w)
        error = comp.errors[b.index][b.offsets[i]:b.offsets[i] + w.numel()].view_as(w).clone()
        mean_err, mean_prev = error.clone(), prev_error.clone()
        dist.all_reduce(mean_err)
        dist.all_reduce(mean_prev)
        # error feedback: what was applied = true average + last step's mean error - this step's mean error
        residuals.append((w.grad - (true + mean_prev / ws - mean_err / ws)).abs().max().item())
        prev_error = error
    return max(residuals), error.abs().max().item()


def test_powersgd_error_feedback_loses_nothing(cluster):
    residual, error = cluster.run(_powersgd_feedback, 1, 3)[0]
    assert residual < 1e-5, f"applied gradient != true mean + error carried in - error carried out ({residual:.2e})"
    assert error > 1e-4, "rank-1 factors of a 32x16 gradient must miss something, kept as error"
    residual, error = cluster.run(_powersgd_feedback, 16, 2)[0]
    assert residual < 1e-5 and error < 1e-5, \
        f"full-rank PowerSGD must be exact: residual {residual:.2e}, error {error:.2e}"


def _unused():
    import torch

    from course_utils.micro_ddp import MicroDDP

    class HalfUsed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.unused = torch.nn.Linear(4, 1), torch.nn.Linear(4, 1)

        def forward(self, x):
            return self.used(x)

    model = MicroDDP(HalfUsed())
    try:
        model(torch.randn(2, 4)).sum().backward()
    except RuntimeError as exc:
        return str(exc)
    return None


def test_unused_parameter_is_explained(cluster):
    messages = cluster.run(_unused)
    assert messages[0] and "unused.weight" in messages[0] and "used.weight" not in messages[0].replace(
        "unused.weight", "") and "requires_grad=False" in messages[0], messages


# -- the checkers reject the classic mistakes ------------------------------------------------------

def _checker_verdicts():
    import contextlib

    import torch
    import torch.distributed as dist

    from course_utils import micro_ddp as ref
    from course_utils.checks.micro_ddp import (check_assign_buckets, check_broadcast_state, check_compressor,
                                               check_micro_ddp, check_start_allreduce)

    def forward_order(params, cap):
        return [list(reversed(b)) for b in reversed(ref.assign_buckets(params, cap))]

    def sum_only(flat):
        return dist.all_reduce(flat, async_op=True)

    def blocking(flat):
        flat /= dist.get_world_size()
        dist.all_reduce(flat)

    def params_only(module):
        for p in module.parameters():
            dist.broadcast(p.data, 0)

    class NoDivide(ref.AllReduce):
        def start(self, flat, bucket, group):
            return dist.all_reduce(flat, group=group, async_op=True), None

    class ArticleHook:  # the article's "compression": times 0.5, all-reduce, divide by 0.5
        def start(self, flat, bucket, group):
            half = flat * 0.5
            work = dist.all_reduce(half, async_op=True)
            return work, lambda: flat.copy_(half / 0.5 / dist.get_world_size())

    class Half:
        def start(self, flat, bucket, group):
            low = (flat / dist.get_world_size()).half()
            return dist.all_reduce(low, async_op=True), lambda: flat.copy_(low)

    cases = {
        "forward_order": lambda: check_assign_buckets(forward_order),
        "sum_only": lambda: check_start_allreduce(sum_only),
        "blocking": lambda: check_start_allreduce(blocking),
        "params_only": lambda: check_broadcast_state(params_only),
        "no_divide": lambda: check_micro_ddp(lambda m, cap: ref.MicroDDP(m, cap, compressor=NoDivide())),
        "article_hook": lambda: check_compressor(ArticleHook()),
        "good_ddp": lambda: check_micro_ddp(lambda m, cap: ref.MicroDDP(m, cap)),
        "good_pieces": lambda: (check_assign_buckets(ref.assign_buckets), check_broadcast_state(ref.broadcast_state),
                                check_start_allreduce(lambda f: ref.AllReduce().start(f, None, None)[0])),
        "good_half": lambda: check_compressor(Half(), max_rel_error=1e-3),
    }
    out = {}
    for name, run in cases.items():
        with contextlib.redirect_stdout(None):
            try:
                run()
                out[name] = None
            except AssertionError as exc:
                out[name] = str(exc)
    torch.distributed.barrier()
    return out


def test_checkers_explain_the_classic_mistakes(cluster):
    v = cluster.run(_checker_verdicts)[0]
    assert v["good_ddp"] is None and v["good_pieces"] is None and v["good_half"] is None, v
    assert v["forward_order"] and "REVERSE" in v["forward_order"], v["forward_order"]
    assert v["sum_only"] and "divide by world_size" in v["sum_only"], v["sum_only"]
    assert v["blocking"] and "async_op=True" in v["blocking"], v["blocking"]
    assert v["params_only"] and "buffer" in v["params_only"], v["params_only"]
    assert v["no_divide"] and "divide by world_size" in v["no_divide"], v["no_divide"]
    assert v["article_hook"] and "compresses nothing" in v["article_hook"], v["article_hook"]
