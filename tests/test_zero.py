"""course_utils.zero (12_zero_fsdp): ShardedOptimizer against DDP + the full optimizer, on real gloo ranks.

    .venv/bin/python -m pytest tests/test_zero.py -p no:randomly
"""
import sys
from fractions import Fraction

import pytest

from conftest import register_by_value

register_by_value(sys.modules[__name__])  # the ranks cannot import this test module


# models the course never shows: odd sizes, a parameter count not divisible by 2, 3 or 4, a frozen layer
def _conv_model():
    import torch
    from torch import nn

    torch.manual_seed(11)
    return nn.Sequential(nn.Conv1d(3, 5, 3), nn.ReLU(), nn.Flatten(), nn.Linear(5 * 6, 3), nn.Softplus(),
                         nn.Linear(3, 1))


def _embedding_model():
    import torch
    from torch import nn

    torch.manual_seed(12)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(11, 9)
            self.norm = nn.LayerNorm(9)
            self.out = nn.Linear(9, 1)

        def forward(self, x):
            return self.out(self.norm(self.emb(x)).mean(1))

    return Net()


def _frozen_model():
    import torch
    from torch import nn

    torch.manual_seed(13)
    net = nn.Sequential(nn.Linear(8, 17), nn.GELU(), nn.Linear(17, 3), nn.Linear(3, 1))
    net[0].bias.requires_grad_(False)            # frozen: no gradient, no optimizer state, not in the buffer
    return net


MODELS = {"conv": (_conv_model, (3, 8)), "embedding": (_embedding_model, "tokens"), "frozen": (_frozen_model, (8,))}


def _inputs(shape, gen):
    import torch

    if shape == "tokens":
        return torch.randint(0, 11, (6, 4), generator=gen)
    return torch.randn(6, *shape, generator=gen)


def _zero1_against_ddp(name, steps=5):
    """On every rank: max |difference| of every parameter after ``steps`` AdamW steps, and the state bytes."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from course_utils.zero import ShardedOptimizer

    make, shape = MODELS[name]
    reference, model = DDP(make()), DDP(make())
    ref_opt = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=3e-2, weight_decay=0.1)
    opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=3e-2, weight_decay=0.1)
    gen = torch.Generator().manual_seed(100 + dist.get_rank())   # every rank its own data: DDP averages
    worst = []
    for _ in range(steps):
        x = _inputs(shape, gen)
        y = torch.randn(6, 1, generator=gen)
        for m, o in ((reference, ref_opt), (model, opt)):
            o.zero_grad()
            F.mse_loss(m(x), y).backward()
            o.step()
        worst.append(max((a - b).abs().max().item() for a, b in zip(reference.parameters(), model.parameters())))
    full = sum(v.numel() * v.element_size() for s in ref_opt.state.values() for v in s.values())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    moved = max((a - b).abs().max().item() for a, b in zip(make().parameters(), model.parameters()))
    return {"worst": worst, "state_bytes": opt.state_bytes(), "full_bytes": full, "trainable": trainable,
            "tensors": len(ref_opt.state), "moved": moved}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_zero1_matches_ddp_with_full_adamw_on_4_ranks(make_cluster, name):
    results = make_cluster(4).run(_zero1_against_ddp, name)
    for rank, r in enumerate(results):
        assert max(r["worst"]) <= 1e-6, f"rank {rank}, {name}: parameters differ from DDP + AdamW: {r['worst']}"
        assert r["moved"] > 1e-3, f"rank {rank}, {name}: the parameters did not train at all"
        assert r["trainable"] % 4 != 0, "the test needs sizes not divisible by W"
        # 1/W of the full state, plus the remainder of the split (< 1 element of each moment: 8 bytes)
        # and one step counter (4 bytes) instead of one per tensor
        bound = (r["full_bytes"] - 4 * r["tensors"]) / 4 + 8 + 4
        assert r["state_bytes"] <= bound, (f"rank {rank}, {name}: {r['state_bytes']} bytes of optimizer state, "
                                           f"more than 1/4 of {r['full_bytes']} plus remainder and scalar ({bound})")
        assert r["state_bytes"] >= (r["full_bytes"] - 4 * r["tensors"]) / 4, "less state than 1/W: not all of it?"


def _zero2_against_ddp(steps=5):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from course_utils.zero import ShardedOptimizer, count_collectives, make_uneven_model, state_memory

    reference = DDP(make_uneven_model(seed=5))
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=3e-2)
    model = make_uneven_model(seed=5)                                  # no DDP: the step reduce-scatters
    opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=3e-2, reduce_scatter=True)
    gen = torch.Generator().manual_seed(200 + dist.get_rank())
    worst = []
    for _ in range(steps):
        x, y = torch.randn(6, 7, generator=gen), torch.randn(6, 1, generator=gen)
        ref_opt.zero_grad()
        F.mse_loss(reference(x), y).backward()
        ref_opt.step()
        opt.zero_grad()
        with count_collectives() as calls:                             # backward reduce-scatters, step gathers
            F.mse_loss(model(x), y).backward()
            opt.step()
        worst.append(max((a - b).abs().max().item() for a, b in zip(reference.parameters(), model.parameters())))
    return {"worst": worst, "kinds": calls.kinds(), "sent": calls.sent(), "memory": state_memory(model, opt),
            "padded": opt.flat.numel(), "numel": opt.numel}


def test_zero2_matches_ddp_sends_one_all_reduce_and_keeps_a_gradient_slice(make_cluster):
    results = make_cluster(4).run(_zero2_against_ddp)
    for rank, r in enumerate(results):
        assert max(r["worst"]) <= 1e-6, f"rank {rank}: ZeRO-2 differs from DDP + AdamW: {r['worst']}"
        assert r["kinds"] == {"reduce-scatter": 1, "all-gather": 1}, r["kinds"]
        S = 4 * r["padded"]
        assert r["sent"] == Fraction(2 * 3, 4) * S, "reduce-scatter + all-gather must be one all-reduce's bytes"
        assert r["memory"]["gradients"] == S // 4, "ZeRO-2 keeps only its slice of the gradient"
        assert r["memory"]["parameters"] == 4 * r["numel"]


def test_ring_bytes_and_the_zero_table_agree_with_the_cost_model():
    from course_utils import costmodel
    from course_utils.zero import ring_bytes, zero_table

    halves = ring_bytes("reduce-scatter", 1200, 4) + ring_bytes("all-gather", 1200, 4)
    assert ring_bytes("all-reduce", 1200, 4) == halves == 1800
    assert ring_bytes("all-gather", 1200, 4) == 900
    for w in (1, 2, 3, 4, 8):
        for strategy, per_kind in zero_table(w).items():
            gb = costmodel.memory_per_rank(10**9, w, strategy)
            assert abs(gb - float(sum(per_kind))) < 1e-9, (strategy, w, gb, per_kind)


def _counts_library_collectives():
    import torch
    import torch.distributed as dist

    from course_utils.zero import count_collectives

    t = torch.ones(12)
    with count_collectives() as calls:
        dist.all_reduce(t)
        out = torch.empty(12 * dist.get_world_size())
        dist.all_gather_into_tensor(out, t)          # the deprecated name calls all_gather_single: counted once
        dist.reduce_scatter_single(torch.empty(3), t)
    dist.all_reduce(t)                               # outside the block: not counted
    return list(calls), calls.sent()


def test_count_collectives_counts_each_call_once(make_cluster):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        calls, sent = make_cluster(4).run(_counts_library_collectives)[0]
    assert calls == [("all-reduce", 48, 4), ("all-gather", 192, 4), ("reduce-scatter", 48, 4)], calls
    assert sent == 72 + 144 + 36


def test_sharded_optimizer_refuses_mixed_dtypes(make_cluster):
    def build():
        import torch

        from course_utils.zero import ShardedOptimizer

        try:
            ShardedOptimizer([torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2).double())],
                             torch.optim.SGD, lr=0.1)
        except ValueError as exc:
            return str(exc)
        return None

    messages = make_cluster(4).run(build)
    assert all(m and "one dtype" in m for m in messages), messages
