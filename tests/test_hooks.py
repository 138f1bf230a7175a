"""course_utils.hooks with real processes (gloo, 2 ranks): byte counting and low-precision hooks."""
import sys

import pytest
import torch

from course_utils.hooks import flat_grad, relative_error

from conftest import register_by_value  # noqa: E402

register_by_value(sys.modules[__name__])  # the ranks cannot import this test module

D_IN, D_HIDDEN = 32, 128
N_PARAMS = D_IN * D_HIDDEN + D_HIDDEN + D_HIDDEN + 1  # TinyMLP(32, 128, 1)


@pytest.fixture(scope="module")
def cluster2(make_cluster):
    return make_cluster(world_size=2, timeout=60)  # gloo, shared within this module


def count(hook_name, steps=4, rank_r=2, start=2):
    """On a rank: train a TinyMLP with a counted hook; return the counter and the model."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    from course_utils.hooks import ByteCounter, bf16_hook, fp16_hook
    from course_utils.models import make_model

    hooks = {"allreduce": (allreduce_hook, None), "fp16": (fp16_hook, None), "bf16": (bf16_hook, None),
             "powersgd": (powerSGD_hook, PowerSGDState(None, matrix_approximation_rank=rank_r,
                                                       start_powerSGD_iter=start))}
    hook, state = hooks[hook_name]
    model = DDP(make_model(0, d_in=D_IN, d_hidden=D_HIDDEN))
    counter = ByteCounter()
    model.register_comm_hook(state, counter.wrap(hook))
    g = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(steps):
        model.zero_grad()
        model(torch.randn(8, D_IN, generator=g)).pow(2).mean().backward()
        loss = torch.ones(1)
        dist.all_reduce(loss)  # a collective outside the hook: must NOT be counted
    return counter, model


def test_allreduce_hook_counts_every_gradient_byte_once_per_step(cluster2):
    results = cluster2.run(lambda: count("allreduce")[0])
    for r, counter in enumerate(results):
        assert counter.steps == 4, f"rank {r}: 4 backward passes should be 4 steps, got {counter.steps}"
        assert counter.bytes_per_step() == [4 * N_PARAMS] * 4, (
            f"rank {r}: all_reduce of fp32 gradients sends 4 bytes per parameter per step "
            f"({4 * N_PARAMS}); got {counter.bytes_per_step()}. The loss all_reduce outside the "
            "hook must not be counted.")
        assert counter.buckets == 4, f"rank {r}: this small model's gradients fit one bucket: 4 hook calls"
        assert {c.op for c in counter.calls} == {"all_reduce"}
        assert "total" in counter.summary() and str(4 * N_PARAMS) in counter.summary(), counter.summary()


@pytest.mark.parametrize("name, dtype", [("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_half_precision_hooks_send_exactly_half(cluster2, name, dtype):
    results = cluster2.run(lambda: count(name)[0])
    for r, counter in enumerate(results):
        assert counter.bytes_per_step() == [2 * N_PARAMS] * 4, (
            f"rank {r}: {name} should send 2 bytes per parameter, got {counter.bytes_per_step()}")
        assert {c.dtype for c in counter.calls} == {dtype}


def test_powersgd_counts_p_and_q_issued_from_callbacks(cluster2):
    rank_r = 2
    results = cluster2.run(lambda: count("powersgd", steps=5, rank_r=rank_r, start=2)[0])
    uncompressed = D_HIDDEN + D_HIDDEN + 1           # biases and the 1 x 128 weight stay raw
    p, q = D_HIDDEN * rank_r, D_IN * rank_r          # the 128 x 32 weight becomes P (128 x r) and Q (32 x r)
    expected = [4 * N_PARAMS] * 2 + [4 * (uncompressed + p + q)] * 3
    for r, counter in enumerate(results):
        assert counter.bytes_per_step() == expected, (
            f"rank {r}: 2 warm-up steps of plain all-reduce, then uncompressed + P + Q: expected "
            f"{expected}, got {counter.bytes_per_step()}")
        after = [c for c in counter.calls if c.step == 4]
        assert [c.numel for c in after] == [uncompressed, p, q], (
            f"rank {r}: PowerSGD's three all-reduces (raw tensors, P, Q) in order, got {after}")


def test_reset_and_close(cluster2):
    def run():
        import torch.distributed as dist

        counter, model = count("allreduce", steps=2)
        counter.reset()
        assert (counter.bytes, counter.steps) == (0, 0)
        model(torch.ones(2, D_IN)).sum().backward()
        after_reset = counter.bytes_per_step()
        counter.close()
        model(torch.ones(2, D_IN)).sum().backward()
        t = torch.ones(3)
        dist.all_reduce(t)
        return after_reset, counter.bytes, t

    for r, (after_reset, total, t) in enumerate(cluster2.run(run)):
        assert after_reset == [4 * N_PARAMS], f"rank {r}: one step after reset, got {after_reset}"
        assert total == 4 * N_PARAMS, f"rank {r}: nothing is counted after close(), got {total}"
        torch.testing.assert_close(t, torch.full((3,), 2.0), msg="the patched all_reduce must still reduce")


def test_wrapping_keeps_name_and_ddp_checks(cluster2):
    def run():
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook
        from torch.nn.parallel import DistributedDataParallel as DDP

        from course_utils.hooks import ByteCounter
        from course_utils.models import make_model

        wrapped = ByteCounter().wrap(bf16_compress_hook)
        try:
            DDP(make_model(0)).register_comm_hook(None, wrapped)
        except TypeError as exc:
            return wrapped.__name__, str(exc)
        return wrapped.__name__, "registered"

    for name, outcome in cluster2.run(run):
        assert name == "bf16_compress_hook", "the wrapper must keep the hook's name"
        if torch.version.cuda is None:
            assert "NCCL" in outcome, f"DDP should still refuse bf16_compress_hook on a CPU build: {outcome}"


def test_fp16_hook_divides_before_reducing(cluster2):
    """Gradients near 65504: averaging fits in fp16 only if the division comes first."""
    def run():
        import torch.distributed as dist

        from course_utils.hooks import fp16_hook

        class Bucket:  # the one method fp16_hook uses
            def __init__(self, t):
                self.t = t

            def buffer(self):
                return self.t

        big = torch.full((4,), 60000.0)
        averaged = fp16_hook(None, Bucket(big.clone())).wait()
        summed = big.half()
        dist.all_reduce(summed)
        return averaged, summed

    for r, (averaged, summed) in enumerate(cluster2.run(run)):
        torch.testing.assert_close(averaged, torch.full((4,), 60000.0), msg=f"rank {r}: fp16_hook must average")
        assert torch.isinf(summed).all(), f"rank {r}: 60000 + 60000 in fp16 should overflow to inf, got {summed}"


def test_flat_grad_and_relative_error():
    model = torch.nn.Linear(3, 2)
    model(torch.ones(1, 3)).sum().backward()
    model.bias.grad = None
    g = flat_grad(model)
    assert g.dtype == torch.float64 and g.shape == (8,), g
    torch.testing.assert_close(g, torch.tensor([1.0] * 6 + [0.0, 0.0], dtype=torch.float64))
    assert relative_error(torch.tensor([1.0, 1.0]), torch.tensor([1.0, 0.0])) == pytest.approx(1.0)
    assert relative_error(torch.zeros(2), torch.zeros(2)) == 0.0
