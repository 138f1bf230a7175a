"""course_utils.zero.ShardedOptimizer as a real torch.optim.Optimizer, and ZeRO-2's
bucketed reduce-scatter during backward, on real 2-rank gloo processes. Each test compares against plain
torch (DDP + the full optimizer) on the same data, from the same weights.

    .venv/bin/python -m pytest tests/test_sharded_optimizer.py -p no:randomly
"""
import sys

import pytest

from conftest import register_by_value

register_by_value(sys.modules[__name__])  # the ranks cannot import this test module

TOL = 1e-6


@pytest.fixture(scope="module")
def cluster(make_cluster):
    return make_cluster(2, timeout=120)


def _net(seed=3, unused=False):
    import torch
    from torch import nn

    torch.manual_seed(seed)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(7, 13)
            self.spare = nn.Linear(13, 13)       # used only when unused=False
            self.b = nn.Linear(13, 5)
            self.norm = nn.LayerNorm(5)
            self.head = nn.Linear(5, 1)

        def forward(self, x):
            h = torch.tanh(self.a(x))
            if not unused:
                h = h + self.spare(h)
            return self.head(self.norm(self.b(h)))

    return Net()


def _train(model, optimizer, steps, seed=0, scheduler=None, clip=None, accum=1):
    """Train on this rank's own data; returns the parameters after every step (flat) and the clip norms."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(seed + 100 * dist.get_rank())
    history, norms = [], []
    for _ in range(steps):
        optimizer.zero_grad()
        for _ in range(accum):
            x, y = torch.randn(6, 7, generator=gen), torch.randn(6, 1, generator=gen)
            (F.mse_loss(model(x), y) / accum).backward()
        if clip is not None:
            norms.append(float(clip(optimizer)))
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        history.append(torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()]))
    return history, norms


def _worst(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def _ddp_pair(zero2, make=_net, **kwargs):
    """(reference DDP model, model for ShardedOptimizer): DDP for ZeRO-1, the bare model for ZeRO-2."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(make(**kwargs)), (make(**kwargs) if zero2 else DDP(make(**kwargs)))


# -- a torch.optim.Optimizer: schedulers, param groups ---------------------------------------------------
def _scheduler_and_groups(zero2):
    import torch

    from course_utils.zero import ShardedOptimizer

    def groups(model):
        decay = [p for n, p in model.named_parameters() if n.endswith("weight") and "norm" not in n]
        rest = [p for n, p in model.named_parameters() if not (n.endswith("weight") and "norm" not in n)]
        return [{"params": decay, "weight_decay": 0.3, "lr": 2e-2}, {"params": rest, "weight_decay": 0.0}]

    reference, model = _ddp_pair(zero2)
    ref_opt = torch.optim.AdamW(groups(reference), lr=5e-2)
    opt = ShardedOptimizer(groups(model), torch.optim.AdamW, lr=5e-2, reduce_scatter=zero2, bucket_cap_mb=1e-4)
    out = {"is_optimizer": isinstance(opt, torch.optim.Optimizer), "groups": len(opt.param_groups)}
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=2, gamma=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.1)
    want, _ = _train(reference, ref_opt, 5, scheduler=ref_sched)
    got, _ = _train(model, opt, 5, scheduler=sched)
    out["worst"] = [_worst([a], [b]) for a, b in zip(got, want)]
    out["lrs"] = [g["lr"] for g in opt.optimizer.param_groups]
    out["ref_lrs"] = [g["lr"] for g in ref_opt.param_groups]
    out["buckets"] = len(opt.buckets)
    return out


@pytest.mark.parametrize("zero2", [False, True], ids=["zero1", "zero2"])
def test_lr_scheduler_and_param_groups_with_their_own_lr_and_weight_decay(cluster, zero2):
    for rank, r in enumerate(cluster.run(_scheduler_and_groups, zero2)):
        assert r["is_optimizer"], "ShardedOptimizer must be a torch.optim.Optimizer (StepLR checks)"
        assert r["groups"] == 2
        assert max(r["worst"]) <= TOL, f"rank {rank}: differs from DDP + AdamW with StepLR and 2 groups: {r['worst']}"
        assert r["lrs"] == pytest.approx(r["ref_lrs"]) and r["lrs"][0] == pytest.approx(2e-4), (
            f"the scheduler's lr must reach the shard's optimizer: {r['lrs']} against {r['ref_lrs']}")
        if zero2:
            assert r["buckets"] > 2, "the test must cover several buckets per group"


# -- a parameter whose gradient is None is left alone ---------------------------------------------------
def _unused_layer(zero2):
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from course_utils.zero import ShardedOptimizer

    reference = DDP(_net(unused=True), find_unused_parameters=True)
    model = _net(unused=True) if zero2 else DDP(_net(unused=True), find_unused_parameters=True)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=5e-2, weight_decay=0.5)
    # one bucket: the unused layer shares its bucket (and this rank's chunk) with layers that train
    opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=5e-2, weight_decay=0.5, reduce_scatter=zero2)
    before = [p.detach().clone() for p in model.module.spare.parameters()] if not zero2 else \
        [p.detach().clone() for p in model.spare.parameters()]
    want, _ = _train(reference, ref_opt, 4)
    got, _ = _train(model, opt, 4)
    spare = (model if zero2 else model.module).spare
    ref_spare = reference.module.spare
    return {"worst": [_worst([a], [b]) for a, b in zip(got, want)],
            "spare_moved": max((p - q).abs().max().item() for p, q in zip(spare.parameters(), before)),
            "ref_spare_grad": [p.grad is None for p in ref_spare.parameters()],
            "ref_spare_state": [p in ref_opt.state for p in ref_spare.parameters()]}


@pytest.mark.parametrize("zero2", [False, True], ids=["zero1", "zero2"])
def test_a_parameter_whose_grad_is_none_is_left_alone_as_torch_adamw_leaves_it(cluster, zero2):
    for rank, r in enumerate(cluster.run(_unused_layer, zero2)):
        assert r["ref_spare_grad"] == [True, True] and r["ref_spare_state"] == [False, False], (
            "the premise: torch's AdamW gets no gradient for the unused layer and leaves it alone")
        assert r["spare_moved"] == 0.0, (f"rank {rank}: the unused layer moved by {r['spare_moved']}: weight decay "
                                         "or momentum stepped a parameter without gradient")
        assert max(r["worst"]) <= TOL, f"rank {rank}: the used parameters differ from DDP + AdamW: {r['worst']}"


# -- checkpoints are never silently wrong ------------------------------------------------------------------
def _checkpoints(tmp, zero2):
    import torch
    import torch.distributed as dist

    from course_utils.zero import ShardedOptimizer

    rank = dist.get_rank()

    def build():
        model = _net() if zero2 else _ddp_pair(False)[1]
        return model, ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=5e-2, weight_decay=0.1,
                                       reduce_scatter=zero2, bucket_cap_mb=2e-4)

    out = {}
    model, opt = build()
    _train(model, opt, 3, seed=1)
    # one file, lesson 11's habit: consolidated on rank 0, loaded on every rank
    full = opt.consolidate_state_dict(to=0)
    out["full_on_others"] = full is None if rank != 0 else None
    if rank == 0:
        torch.save({"model": model.state_dict(), "optimizer": full}, f"{tmp}/full.pt")
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, f"{tmp}/rank0.pt")
    torch.save(opt.state_dict(), f"{tmp}/shard{rank}.pt")
    dist.barrier()
    straight, _ = _train(model, opt, 3, seed=2)                    # the run that was never interrupted

    ckpt = torch.load(f"{tmp}/full.pt", weights_only=False)
    model2, opt2 = build()
    model2.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["optimizer"])
    resumed, _ = _train(model2, opt2, 3, seed=2)
    out["consolidated"] = _worst(straight, resumed)

    model3, opt3 = build()                                          # per-rank files, each its own: exact
    model3.load_state_dict(ckpt["model"])
    opt3.load_state_dict(torch.load(f"{tmp}/shard{rank}.pt", weights_only=False))
    out["per_rank"] = _worst(straight, _train(model3, opt3, 3, seed=2)[0])

    model4, opt4 = build()                                          # rank 0's shard loaded everywhere: refused
    try:
        opt4.load_state_dict(torch.load(f"{tmp}/rank0.pt", weights_only=False)["optimizer"])
        out["wrong_rank"] = None
    except ValueError as exc:
        out["wrong_rank"] = str(exc)
    solo = dist.new_group([rank])                                   # another world size: refused too
    m5 = _net()
    opt5 = ShardedOptimizer(m5.parameters(), torch.optim.AdamW, lr=5e-2, group=solo)
    try:
        opt5.load_state_dict(torch.load(f"{tmp}/shard{rank}.pt", weights_only=False))
        out["wrong_size"] = None
    except ValueError as exc:
        out["wrong_size"] = str(exc)
    opt5.load_state_dict(ckpt["optimizer"])                         # ... but the consolidated one fits any world
    out["solo_state"] = opt5.state_bytes()
    return out


@pytest.mark.parametrize("zero2", [False, True], ids=["zero1", "zero2"])
def test_checkpoints_consolidated_or_per_rank_and_a_wrong_shard_is_refused(cluster, tmp_path, zero2):
    results = cluster.run(_checkpoints, str(tmp_path), zero2)
    assert results[1]["full_on_others"] is True, "consolidate_state_dict returns the state on rank `to` only"
    for rank, r in enumerate(results):
        assert r["consolidated"] <= TOL, f"rank {rank}: resumed from the consolidated file {r['consolidated']} off"
        assert r["per_rank"] <= TOL, f"rank {rank}: resumed from its own shard {r['per_rank']} off"
        assert r["solo_state"] > 0
        msg = r["wrong_size"]
        assert msg and "2-rank" in msg and "rank 0 of 1" in msg and "consolidate_state_dict" in msg, msg
    assert results[0]["wrong_rank"] is None, "rank 0 loading its own shard is right"
    msg = results[1]["wrong_rank"]
    assert msg and "rank 0's shard" in msg and "this is rank 1 of 2" in msg and "own file" in msg, msg


def _consolidated_is_torchs_format():
    import torch

    from course_utils.zero import ShardedOptimizer

    reference, model = _ddp_pair(False)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=5e-2)
    opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=5e-2)
    _train(reference, ref_opt, 3)
    _train(model, opt, 3)
    full, want = opt.consolidate_state_dict(to=0), ref_opt.state_dict()
    if full is None:
        return None
    worst = max((full["state"][i][k] - want["state"][i][k]).abs().max().item()
                for i in want["state"] for k in ("exp_avg", "exp_avg_sq", "step"))
    plain = torch.optim.AdamW(_net().parameters(), lr=5e-2)
    plain.load_state_dict(full)                                     # a plain torch optimizer takes it as it is
    return {"worst": worst, "keys": sorted(full["state"]) == sorted(want["state"])}


def test_consolidated_state_equals_the_full_optimizers_state(cluster):
    r = cluster.run(_consolidated_is_torchs_format)[0]
    assert r["keys"], "one entry per parameter, indexed as torch's optimizer indexes them"
    assert r["worst"] <= TOL, f"the consolidated moments differ from DDP + AdamW's by {r['worst']}"


# -- gradient clipping by the global norm across shards -----------------------------------------------------
def _clipping(zero2):
    import torch

    from course_utils.zero import ShardedOptimizer, clip_sharded_grad_norm_

    reference, model = _ddp_pair(zero2)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    opt = ShardedOptimizer(model.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9, reduce_scatter=zero2,
                           bucket_cap_mb=2e-4)
    want, ref_norms = _train(reference, ref_opt, 4,
                             clip=lambda o: torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05))
    got, norms = _train(model, opt, 4, clip=lambda o: clip_sharded_grad_norm_(o, 0.05))
    return {"worst": [_worst([a], [b]) for a, b in zip(got, want)], "norms": norms, "ref_norms": ref_norms}


@pytest.mark.parametrize("zero2", [False, True], ids=["zero1", "zero2"])
def test_clip_sharded_grad_norm_clips_by_the_global_norm(cluster, zero2):
    for rank, r in enumerate(cluster.run(_clipping, zero2)):
        assert r["norms"] == pytest.approx(r["ref_norms"], rel=1e-5), (
            f"rank {rank}: global norms {r['norms']}, DDP's {r['ref_norms']}")
        assert min(r["ref_norms"]) > 0.05, "the premise: every step is clipped"
        assert max(r["worst"]) <= TOL, f"rank {rank}: clipped training differs from DDP's: {r['worst']}"


def _clip_plain_shards():
    """Disjoint shards on each rank (FSDP's case): the norm of the whole gradient, on every rank."""
    import torch
    import torch.distributed as dist

    from course_utils.zero import clip_sharded_grad_norm_

    full = torch.arange(1.0, 11.0)
    mine = torch.nn.Parameter(full.chunk(2)[dist.get_rank()].clone())
    mine.grad = mine.detach().clone()
    norm = clip_sharded_grad_norm_([mine], 1.0)
    return float(norm), float(torch.linalg.vector_norm(full)), torch.cat([g for g in [mine.grad]]).tolist()


def test_clip_sharded_grad_norm_on_plain_shards(cluster):
    results = cluster.run(_clip_plain_shards)
    import torch

    full = torch.arange(1.0, 11.0)
    for norm, want, _ in results:
        assert norm == pytest.approx(want)
    clipped = torch.tensor(results[0][2] + results[1][2])
    torch.testing.assert_close(clipped, full / (full.norm() + 1e-6))


# -- which optimizers are exact over a flat slice ---------------------------------------------------------
def _optimizer_classes():
    import warnings

    import torch

    from course_utils.zero import ShardedOptimizer

    out = {}
    for cls in (torch.optim.Adafactor, torch.optim.Muon, torch.optim.LBFGS):
        try:
            ShardedOptimizer(_net().parameters(), cls, lr=1e-2)
            out[cls.__name__] = None
        except ValueError as exc:
            out[cls.__name__] = str(exc)

    class Custom(torch.optim.Optimizer):
        def __init__(self, params, lr=0.1):
            super().__init__(params, {"lr": lr})

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ShardedOptimizer(_net().parameters(), Custom)
        ShardedOptimizer(_net().parameters(), torch.optim.AdamW)
    out["warnings"] = [str(w.message) for w in caught]
    # and the element-wise ones are exact: SGD with Nesterov momentum, Adam with amsgrad
    for cls, kwargs in ((torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.1)),
                        (torch.optim.Adam, dict(lr=5e-2, amsgrad=True))):
        reference, model = _ddp_pair(False)
        want, _ = _train(reference, cls(reference.parameters(), **kwargs), 3)
        got, _ = _train(model, ShardedOptimizer(model.parameters(), cls, **kwargs), 3)
        out[cls.__name__ + "_worst"] = max(_worst([a], [b]) for a, b in zip(got, want))
    return out


def test_only_element_wise_optimizers_are_sharded_silently(cluster):
    r = cluster.run(_optimizer_classes)[0]
    for name, words in (("Adafactor", "row and column"), ("Muon", "2-D"), ("LBFGS", "every parameter")):
        assert r[name] and name in r[name] and words in r[name], f"{name} must be refused with a reason: {r[name]}"
    warned = r["warnings"]
    assert len(warned) == 1 and "Custom" in warned[0] and "element-wise" in warned[0], warned
    assert r["SGD_worst"] <= TOL and r["Adam_worst"] <= TOL, r


# -- ZeRO-2 without DDP: rank 0's weights, buckets during backward, accumulation ------------------------------
def _zero2_broadcast_and_buckets():
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from course_utils.zero import ShardedOptimizer, count_collectives

    rank = dist.get_rank()
    model = _net(seed=50 + rank)                                    # every rank a different initialisation
    opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=5e-2, reduce_scatter=True, bucket_cap_mb=2e-4)
    start = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    rank0 = torch.cat([p.detach().reshape(-1) for p in _net(seed=50).parameters()])
    reference, _ = _ddp_pair(False, seed=50)
    want, _ = _train(reference, torch.optim.AdamW(reference.parameters(), lr=5e-2), 3, accum=2)
    x, y = torch.randn(6, 7), torch.randn(6, 1)
    opt.zero_grad()
    with count_collectives() as in_backward:
        F.mse_loss(model(x), y).backward()
    grads_left = [p.grad for p in model.parameters() if p.grad is not None]
    got, _ = _train(model, opt, 3, accum=2)
    return {"start_is_rank0": torch.equal(start, rank0), "kinds": in_backward.kinds(), "buckets": len(opt.buckets),
            "grads_left": len(grads_left), "worst": [_worst([a], [b]) for a, b in zip(got, want)]}


def test_zero2_broadcasts_rank0_reduces_buckets_in_backward_and_accumulates(cluster):
    for rank, r in enumerate(cluster.run(_zero2_broadcast_and_buckets)):
        assert r["start_is_rank0"], f"rank {rank}: ZeRO-2 without DDP must start from rank 0's parameters"
        assert r["buckets"] > 2
        assert r["kinds"] == {"reduce-scatter": r["buckets"]}, (
            f"backward must reduce-scatter each bucket: {r['kinds']} for {r['buckets']} buckets")
        assert r["grads_left"] == 0, "every full-size gradient is freed once it is in its bucket"
        assert max(r["worst"]) <= TOL, f"rank {rank}: ZeRO-2 with 2 micro-batches differs from DDP's: {r['worst']}"


# -- peaks over a whole step: ZeRO-2's bucketed reduce-scatter really lowers it --------------------------------
def _peaks():
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from course_utils.memory import ddp_bucket_bytes, peak_memory
    from course_utils.zero import ShardedOptimizer, state_memory

    def make():                                  # gradients dominate: 6 square layers, a batch of 2
        torch.manual_seed(0)
        return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.Tanh())
                                     for _ in range(6)])

    x = torch.randn(2, 128)
    out = {}
    for s in ("ddp", "zero1", "zero2", "zero2_buckets"):
        model = make() if s.startswith("zero2") else DDP(make())
        if s == "ddp":
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        else:
            opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3, reduce_scatter=s != "zero1",
                                   bucket_cap_mb=0.07 if s == "zero2_buckets" else None)

        def step():
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()

        step()
        step()                                   # Adam's moments and DDP's rebuilt buckets exist from here on
        # Each byte once: the meter tracks DDP's buckets from backward's first gradient on (the reducer fills them
        # on this thread), so the step's peak holds them already; only forward, before that first gradient, holds
        # them untracked, and there they are added (tests/test_memory.py matches the storages by data_ptr).
        buckets = ddp_bucket_bytes(model)
        forward = peak_memory(lambda: model(x).square().mean(), model, opt)["total"]
        peak = peak_memory(step, model, opt)["total"]
        out[s] = {"total": max(peak, forward + buckets), "step_peak": peak, "buckets": buckets,
                  "after": sum(state_memory(model, opt).values())}
    out["S"] = 4 * sum(p.numel() for p in make().parameters())
    return out


def test_zero2_bucketed_reduce_scatter_lowers_the_peak_not_just_the_snapshot(cluster):
    r = cluster.run(_peaks)[0]
    S = r["S"]                                   # bytes of one fp32 copy of the model
    assert r["ddp"]["buckets"] == S, "DDP's default buckets hold a second copy of every gradient"
    assert r["zero1"]["buckets"] == S and r["zero2"]["buckets"] == 0
    # DDP's step peak holds the parameters, the gradients, their bucket copy and the moments (the bucket counted
    # once, by the meter): at least 5 copies, and fewer than 6 (a second bucket would be a sixth)
    assert 5 * S <= r["ddp"]["total"] < 6 * S, {k: v / S for k, v in r["ddp"].items()}
    # ZeRO-2 with one bucket still holds one full-size gradient buffer in backward; with buckets, a bucket
    assert r["zero2_buckets"]["total"] <= r["zero2"]["total"] - S / 2, r
    # ZeRO-2 with one bucket peaks at its reduce-scatter's wait(): the weights S, the moments' share 2S/2, the
    # bucket S, gloo's copy of it S, the output S/2 (AdamW's step counters apart): half a copy under DDP at least
    assert abs(r["zero2"]["total"] - 4.5 * S) <= 64, {k: v / S for k, v in r["zero2"].items()}
    assert r["zero2"]["total"] <= r["ddp"]["total"] - S / 2, r
    # the after-step snapshot hides the difference the peak shows: both ZeRO-2 runs end with the same state,
    # up to AdamW's 4-byte step counter per bucket
    assert 0 <= r["zero2_buckets"]["after"] - r["zero2"]["after"] <= 4 * 16, r


# -- torch.amp.GradScaler ----------------------------------------------------------------------------------
def _grad_scaler():
    """fp16 autocast + GradScaler: ZeRO-1 follows DDP + AdamW under the same scaler (an overflow included: the
    first scale, 2**24, overflows fp16 and every rank skips that step alike); ZeRO-2 is refused in words."""
    import torch
    import torch.nn.functional as F

    from course_utils.zero import ShardedOptimizer

    out = {}
    for zero2 in (False, True):
        ref, model = _ddp_pair(zero2)
        runs = {}
        for name, m, opt in (("ref", ref, torch.optim.AdamW(ref.parameters(), lr=1e-2)),
                             ("zero", model, ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2,
                                                              reduce_scatter=zero2))):
            scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 24)
            gen = torch.Generator().manual_seed(7)
            history, scales = [], []
            try:
                for _ in range(12):
                    opt.zero_grad()
                    x, y = torch.randn(6, 7, generator=gen), torch.randn(6, 1, generator=gen)
                    with torch.autocast("cpu", dtype=torch.float16):
                        loss = F.mse_loss(m(x).float(), y)
                    scaler.scale(loss).backward()
                    scaler.step(opt)
                    scaler.update()
                    scales.append(scaler.get_scale())
                    history.append(torch.cat([p.detach().reshape(-1).clone() for p in m.parameters()]))
            except RuntimeError as exc:
                runs[name] = str(exc)
                continue
            runs[name] = (history, scales)
        out[zero2] = runs
    return out


def test_grad_scaler_works_with_zero1_and_is_refused_clearly_by_zero2(cluster):
    import torch

    r = cluster.run(_grad_scaler)[0]
    (ref_hist, ref_scales), (z1_hist, z1_scales) = r[False]["ref"], r[False]["zero"]
    assert z1_scales == ref_scales and ref_scales[0] < 2.0 ** 24, "the same overflow skipped on every rank"
    assert _worst(ref_hist, z1_hist) < 1e-6, "ZeRO-1 under GradScaler follows DDP + AdamW"
    assert not torch.equal(ref_hist[0], ref_hist[-1]), "later steps were taken"
    message = r[True]["zero"]
    assert isinstance(message, str) and "cannot be stepped by torch.amp.GradScaler" in message, message
    assert "bf16 autocast without a scaler" in message and "ZeRO-1" in message, message
