"""course_utils.tensor_parallel (15_beyond_data_parallelism) on models the lesson never shows: the split model's
forward output and every gradient equal one process's, on 2 and 4 real gloo ranks.

    .venv/bin/python -m pytest tests/test_tensor_parallel.py
"""
import sys

import pytest
import torch

from conftest import register_by_value

register_by_value(sys.modules[__name__])  # the functions below run on the ranks

TOL = dict(rtol=1e-5, atol=1e-5)


def _mlp_matches(bias):
    """A 20 -> 64 -> 20 MLP with Tanh (the lesson's is 48 -> 192 -> 48 with GELU), on a 3-D input."""
    import torch.distributed as dist
    from torch import nn

    from course_utils.tensor_parallel import TensorParallelMLP, gather_full, local_numel
    from course_utils.zero import count_collectives

    torch.manual_seed(5)
    mlp = nn.Sequential(nn.Linear(20, 64, bias=bias), nn.Tanh(), nn.Linear(64, 20, bias=bias))
    x = torch.randn(3, 5, 20)
    grad_y = torch.randn(3, 5, 20)
    x_ref = x.clone().requires_grad_()
    y_ref = mlp(x_ref)
    y_ref.backward(grad_y)
    tp = TensorParallelMLP(mlp)
    x_tp = x.clone().requires_grad_()
    with count_collectives() as calls:
        y = tp(x_tp)
        y.backward(grad_y)
    torch.testing.assert_close(y, y_ref, **TOL)
    torch.testing.assert_close(x_tp.grad, x_ref.grad, **TOL)
    full = gather_full(tp, grad=True)
    assert sorted(full) == sorted(n for n, _ in mlp.named_parameters())
    for name, p in mlp.named_parameters():
        torch.testing.assert_close(full[name], p.grad, **TOL, msg=lambda m: f"{name}: {m}")
    for name, p in gather_full(tp).items():                   # the weights, put back together
        torch.testing.assert_close(p, mlp.get_parameter(name).detach(), rtol=0, atol=0)
    split, replicated = local_numel(tp)
    W = dist.get_world_size()
    assert split * W == 2 * 20 * 64 + (64 if bias else 0) and replicated == (20 if bias else 0)
    assert calls.kinds() == {"all-reduce": 2} and calls.payload() == 2 * x.numel() * 4
    return True


def _gpt_matches(n_head, steps=2):
    """A 3-block GPT with 32 features (the lesson's has 2 blocks of 48) trained 2 SGD steps: the loss and every
    gradient equal one process's at every step, and so do the weights after them."""
    import torch.nn.functional as F

    from course_utils.gpt import make_gpt
    from course_utils.tensor_parallel import gather_full, tensor_parallel_gpt

    kw = dict(block_size=12, n_layer=3, n_head=n_head, n_embd=32)
    reference = make_gpt(27, seed=11, **kw)
    model = tensor_parallel_gpt(make_gpt(27, seed=11, **kw))
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (reference, model)]
    g = torch.Generator().manual_seed(2)
    for step in range(steps):
        x, y = torch.randint(27, (3, 12), generator=g), torch.randint(27, (3, 12), generator=g)
        losses = []
        for m, opt in zip((reference, model), optimizers):
            opt.zero_grad()
            logits = m(x)
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
            loss.backward()
            losses.append((logits.detach(), loss.detach()))
        torch.testing.assert_close(losses[1], losses[0], **TOL)
        full = gather_full(model, grad=True)
        for name, p in reference.named_parameters():
            torch.testing.assert_close(full[name], p.grad, **TOL, msg=lambda m: f"step {step}, {name}: {m}")
        for opt in optimizers:
            opt.step()
    full = gather_full(model)
    for name, p in reference.named_parameters():
        torch.testing.assert_close(full[name], p.detach(), **TOL)
    return True


@pytest.mark.parametrize("world_size", [2, 4])
def test_mlp_matches_one_process(make_cluster, world_size):
    cluster = make_cluster(world_size, timeout=120)
    assert cluster.run(_mlp_matches, True) == [True] * world_size
    assert cluster.run(_mlp_matches, False) == [True] * world_size


@pytest.mark.parametrize("world_size", [2, 4])
def test_gpt_matches_one_process(make_cluster, world_size):
    assert make_cluster(world_size, timeout=120).run(_gpt_matches, 8) == [True] * world_size


def _uneven_heads_refused():
    from course_utils.gpt import make_gpt
    from course_utils.tensor_parallel import tensor_parallel_gpt

    try:
        tensor_parallel_gpt(make_gpt(27, seed=0, n_head=2, n_embd=32))
    except ValueError as exc:
        return str(exc)
    return None


def test_heads_that_do_not_split_are_refused(make_cluster):
    got = make_cluster(4, timeout=120).run(_uneven_heads_refused)
    assert all(g and "2 heads do not split over 4 ranks" in g for g in got), got


def _conjugates():
    """f is the identity forward and sums the gradient backward; g the reverse."""
    import torch.distributed as dist

    from course_utils.tensor_parallel import copy_to_tp, reduce_from_tp

    r, W = dist.get_rank(), dist.get_world_size()
    x = torch.full((3,), float(r + 1), requires_grad=True)
    y = copy_to_tp(x)
    torch.testing.assert_close(y, x.detach())
    y.backward(torch.ones(3) * (r + 1))
    torch.testing.assert_close(x.grad, torch.full((3,), W * (W + 1) / 2))
    x.grad = None
    z = reduce_from_tp(x)
    torch.testing.assert_close(z, torch.full((3,), W * (W + 1) / 2))
    z.backward(torch.ones(3) * (r + 1))
    torch.testing.assert_close(x.grad, torch.full((3,), float(r + 1)))
    return True


def test_f_and_g_are_conjugate(make_cluster):
    assert make_cluster(4, timeout=120).run(_conjugates) == [True] * 4
