"""course_utils.memory: the per-rank memory breakdown of 01_data_parallelism, measured.

    .venv/bin/python -m pytest tests/test_memory.py -p no:randomly
"""
import sys

import torch
import torch.nn.functional as F
from torch import nn

from course_utils.memory import MEMORY_KINDS, ActivationMeter, format_bytes, measure_step_memory, tensor_bytes
from course_utils.models import make_model

from conftest import register_by_value  # noqa: E402

register_by_value(sys.modules[__name__])  # the ranks cannot import this test module


def mlp(d_in=8, d_hidden=32, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d_in, d_hidden), nn.ReLU(), nn.Linear(d_hidden, 1))


def test_meter_counts_a_tensor_saved_twice_once():
    model, x = mlp(), torch.randn(16, 8)
    with ActivationMeter(exclude=model.parameters()) as meter:
        model(x)
    # Saved: x (by the first addmm) and the ReLU output (by the ReLU and again by the second addmm).
    expected = 16 * (8 + 32) * 4
    assert meter.bytes == expected, f"expected {expected} bytes (x and one ReLU output), got {meter.bytes}"
    assert meter.count == 2, f"expected 2 distinct storages, got {meter.count}: {meter.saved}"


def test_meter_excludes_only_what_it_is_told():
    model, x = mlp(), torch.randn(16, 8)
    with ActivationMeter(exclude=model.parameters()) as without_params:
        model(x)
    with ActivationMeter() as with_params:
        model(x)
    # The second addmm saves its weight (to compute the gradient of its input, the ReLU output); the first
    # does not, since x needs no gradient. Biases are never saved.
    weights = model[2].weight.numel() * 4
    assert with_params.bytes - without_params.bytes == weights, (
        f"not excluding the parameters should add exactly the second weight matrix ({weights} bytes), "
        f"added {with_params.bytes - without_params.bytes}")


def test_meter_counts_the_rows_a_slice_reaches_not_the_whole_batch():
    model = mlp()
    big = torch.randn(256, 8)
    with ActivationMeter(exclude=model.parameters()) as sliced:
        model(big[:16])
    with ActivationMeter(exclude=model.parameters()) as fresh:
        model(big[:16].clone())
    assert sliced.bytes == fresh.bytes, (
        f"a 16-row slice of a 256-row batch counted {sliced.bytes} bytes, a 16-row copy {fresh.bytes}")


def test_meter_is_linear_in_the_batch_and_changes_nothing():
    model = mlp()
    sizes = (4, 8, 32)
    counts = []
    for b in sizes:
        with ActivationMeter(exclude=model.parameters()) as meter:
            F.mse_loss(model(torch.randn(b, 8)), torch.randn(b, 1))
        counts.append(meter.bytes)
    assert [c * sizes[0] for c in counts] == [counts[0] * b for b in sizes], f"not linear in batch size: {counts}"

    x, y = torch.randn(8, 8), torch.randn(8, 1)
    plain, metered = mlp(), mlp()
    F.mse_loss(plain(x), y).backward()
    with ActivationMeter(exclude=metered.parameters()):
        loss = F.mse_loss(metered(x), y)
    loss.backward()
    for p, q in zip(plain.parameters(), metered.parameters()):
        torch.testing.assert_close(q.grad, p.grad, msg="the meter must not change the gradients")


def test_measure_step_memory_with_adam():
    model = make_model(seed=0, d_in=16, d_hidden=64)
    before = [p.detach().clone() for p in model.parameters()]
    n_params = sum(p.numel() for p in model.parameters())
    n_tensors = len(list(model.parameters()))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    x, y = torch.randn(32, 16), torch.randn(32, 1)
    m = measure_step_memory(model, optimizer, F.mse_loss, x, y)

    assert tuple(m) == MEMORY_KINDS, f"keys must be {MEMORY_KINDS}, got {tuple(m)}"
    assert all(type(v) is int for v in m.values()), f"sizes must be ints (bytes): {m}"
    assert m["parameters"] == 4 * n_params, f"fp32 parameters: expected {4 * n_params}, got {m['parameters']}"
    assert m["gradients"] == m["parameters"], "one fp32 gradient per parameter"
    assert m["optimizer_state"] == 2 * m["parameters"] + 4 * n_tensors, (
        f"Adam keeps exp_avg, exp_avg_sq and a 4-byte step per tensor: got {m['optimizer_state']}")
    assert m["activations"] == 32 * (16 + 64 + 1 + 1) * 4, f"input, ReLU output, prediction, target: {m}"
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters())), "the step must update weights"


def test_measure_step_memory_with_sgd():
    for momentum, factor in ((0.0, 0), (0.9, 1)):
        model = make_model(seed=0)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)
        m = measure_step_memory(model, optimizer, F.mse_loss, torch.randn(8, 16), torch.randn(8, 1))
        assert m["optimizer_state"] == factor * m["parameters"], (
            f"SGD(momentum={momentum}) should keep {factor} x the parameters' bytes, got {m['optimizer_state']}")


def test_after_backward_runs_between_backward_and_step():
    model = make_model(seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    before = [p.detach().clone() for p in model.parameters()]
    seen = []

    def zero_the_gradients(m):
        seen.append(all(p.grad is not None for p in m.parameters()))
        for p in m.parameters():
            p.grad.zero_()

    measure_step_memory(model, optimizer, F.mse_loss, torch.randn(8, 16), torch.randn(8, 1),
                        after_backward=zero_the_gradients)
    assert seen == [True], "after_backward must be called once, with the gradients already computed"
    for b, p in zip(before, model.parameters()):
        torch.testing.assert_close(p.detach(), b, msg="zeroed gradients: the step must not move the weights")


def test_tensor_bytes_and_format_bytes():
    w = torch.zeros(10, 10)
    assert tensor_bytes([w, w, None, torch.zeros(3, dtype=torch.float16)]) == 400 + 6, "tied tensors count once"
    assert format_bytes(512) == "512 B"
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(3 * 2**20) == "3.0 MiB"


def _per_rank_memory():
    """On every rank: one Adam step in worlds of 1, 2 and 4 ranks, gradients averaged in each."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from course_utils.memory import measure_step_memory
    from course_utils.models import make_model

    rank = dist.get_rank()
    torch.manual_seed(rank)
    x, y = torch.randn(32, 16), torch.randn(32, 1)          # different data on every rank
    groups = {n: dist.new_group(ranks=list(range(n))) for n in (1, 2, 4)}
    out = {}
    for n, group in groups.items():
        if rank >= n:
            continue

        def average(model):
            for p in model.parameters():
                dist.all_reduce(p.grad, group=group)
                p.grad /= n

        for hook in (average, None):
            model = make_model(seed=0)
            mem = measure_step_memory(model, torch.optim.Adam(model.parameters()), F.mse_loss, x, y,
                                      after_backward=hook)
            weights = torch.cat([p.detach().flatten() for p in model.parameters()])
            out[n, hook is not None] = (mem, weights)
    return out


def test_model_state_per_rank_is_flat_in_the_world_size(cluster4):
    results = cluster4.run(_per_rank_memory)
    reference = results[0][1, True][0]
    for r, per_world in enumerate(results):
        for (n, averaged), (mem, _) in per_world.items():
            assert mem == reference, f"rank {r}, world size {n}: {mem} differs from one rank alone: {reference}"
    for n in (2, 4):
        averaged = [results[r][n, True][1] for r in range(n)]
        local = [results[r][n, False][1] for r in range(n)]
        for r in range(1, n):
            torch.testing.assert_close(averaged[r], averaged[0],
                                       msg=f"world size {n}: averaged gradients must give equal weights (rank {r})")
        assert not torch.allclose(local[1], local[0]), (
            f"world size {n}: without averaging, different data should give different weights")


def _ddp_buckets():
    from torch.nn.parallel import DistributedDataParallel as DDP

    from course_utils.memory import ddp_bucket_bytes

    out = {}
    for view in (False, True):
        model = DDP(make_model(seed=0), gradient_as_bucket_view=view, bucket_cap_mb=0.001)   # several buckets
        model(torch.randn(4, 16)).sum().backward()
        out[view] = ddp_bucket_bytes(model)
    out["plain"] = ddp_bucket_bytes(make_model(seed=0))
    out["params"] = tensor_bytes(make_model(seed=0).parameters())
    return out


def test_ddp_bucket_bytes_counts_the_second_copy_of_the_gradients(make_cluster):
    r = make_cluster(2, timeout=180).run(_ddp_buckets)[0]   # DDP's first use imports torch._dynamo: slow
    assert r[False] == r["params"], f"DDP's default buckets copy every gradient: {r[False]} of {r['params']} bytes"
    assert r[True] == 0, "with gradient_as_bucket_view=True the gradients are the buckets: nothing extra"
    assert r["plain"] == 0, "a model without DDP has no buckets"


class _Deep(nn.Module):
    """Four blocks of Linear-ReLU-Linear-ReLU (each block saves three batch-sized tensors), checkpointed or not."""

    def __init__(self, checkpointed):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
                                    for _ in range(4))
        self.checkpointed = checkpointed

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.checkpointed else block(x)
        return x


def _peak_with_accumulation(checkpointed, micro_batches):
    from course_utils.memory import peak_memory

    model = _Deep(checkpointed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(8, 128, 64, generator=torch.Generator().manual_seed(1))

    def step():
        optimizer.zero_grad()
        for xb in x.chunk(micro_batches):
            (model(xb).square().mean() / micro_batches).backward()
        optimizer.step()

    step()                                            # Adam's moments exist from the second step on
    return peak_memory(step, model, optimizer), model


def test_peak_memory_measures_a_step_with_gradient_accumulation():
    """MemTracker alone raises NotImplementedError at the second micro-batch; peak_memory resets its module
    statistics there, keeps the step's peak, and the activations at the peak fall with the micro-batch."""
    one, model = _peak_with_accumulation(False, 1)
    eight, _ = _peak_with_accumulation(False, 8)
    n = sum(p.numel() for p in model.parameters())
    for peak in (one, eight):
        assert peak["parameters"] == 4 * n and peak["total"] >= 16 * n, peak  # the whole step: state is in
    act = 8 * 128 * 64 * 4                             # one batch-sized fp32 tensor
    assert one["activations"] >= 8 * act, one          # the whole batch's saved tensors, all blocks
    assert eight["activations"] <= one["activations"] / 4, (one, eight)
    assert eight["total"] < one["total"]


def test_peak_memory_with_accumulation_and_checkpointing():
    """Checkpointed blocks recompute their forward inside backward: not a new micro-batch, and no error."""
    plain, _ = _peak_with_accumulation(False, 4)
    checkpointed, _ = _peak_with_accumulation(True, 4)
    assert checkpointed["activations"] < plain["activations"], (plain, checkpointed)


def test_peak_memory_is_torch_s_own_peak_and_accepts_frozen_parameters(monkeypatch):
    """peak_memory's tracker skips MemTracker's per-module peaks and walks an op's outputs its own way: on one
    micro-batch (torch's MemTracker refuses a second) of a checkpointed model whose first block is frozen (LoRA's
    case, lesson 16), the peak by kind is torch's MemTracker's own, to the byte, and frozen weights are parameters."""
    from torch.distributed._tools.mem_tracker import MemTracker

    import course_utils.memory as memory

    model = _Deep(checkpointed=True)
    model.blocks[0].requires_grad_(False)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    x = torch.randn(4, 16, 64, generator=torch.Generator().manual_seed(1))

    def step():
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()

    step()                                            # Adam's moments exist from the second step on
    ours = memory.peak_memory(step, model, optimizer)
    monkeypatch.setattr(memory, "_step_peak_tracker", MemTracker)
    torch_s = memory.peak_memory(step, model, optimizer)
    assert ours == torch_s, (ours, torch_s)
    assert ours["parameters"] == 4 * sum(p.numel() for p in model.parameters()), ours


def test_tracker_kinds_names_every_category_of_torch_s_trackers():
    """One mapping from torch's tracker categories to the course's kinds: every category of MemTracker and
    FSDPMemTracker has its kind (one torch adds later counts as a temporary: this test fails first); a fold moves a
    kind's bytes and drops its key; only the first device is read."""
    from torch.distributed._tools.fsdp2_mem_tracker import _FSDPRefType
    from torch.distributed._tools.mem_tracker import _MemRefType

    from course_utils.memory import TRACKER_KINDS, tracker_kinds

    categories = {r.value for r in (*_MemRefType, *_FSDPRefType)}
    assert categories == set(TRACKER_KINDS), categories ^ set(TRACKER_KINDS)
    snapshot = {torch.device("cpu"): {_FSDPRefType.SHARDED_PARAM: 8, _MemRefType.BUFFER: 2, _MemRefType.OPT: 16,
                                      _FSDPRefType.ALL_GATHER: 4, "A later category": 1, "Total": 31},
                torch.device("meta"): {_MemRefType.PARAM: 100, "Total": 100}}
    assert tracker_kinds(snapshot) == dict(parameters=8, gradients=0, optimizer_state=16, activations=0,
                                           temporaries=1, comm_buffers=4, buffers=2, total=31)
    assert tracker_kinds(snapshot, fold={"buffers": "parameters"}) == dict(
        parameters=10, gradients=0, optimizer_state=16, activations=0, temporaries=1, comm_buffers=4, total=31)
    assert tracker_kinds({}) == dict.fromkeys(("parameters", "gradients", "optimizer_state", "activations",
                                               "temporaries", "comm_buffers", "buffers", "total"), 0)


# -- DDP's bucket: the meter sees it, so nothing may add it again (lessons 12 and 13) ---------------------------
def _bucket_in_the_tracker(with_hook):
    """A DDP step measured by peak_memory, with the tracker it used kept (course_utils.memory._step_peak_tracker
    wrapped): each bucket's storage, found by data_ptr (recorded by a comm hook from bucket.buffer(); without a hook,
    which torch 2.13 does not expose, the tracked temporaries that outlive the step), and how the tracker counted it."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    import course_utils.memory as memory

    torch.manual_seed(0)
    model = DDP(nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)]), bucket_cap_mb=0.02)   # 16.6 KB a layer

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    buckets = {}

    def recording_hook(state, bucket):
        buf = bucket.buffer()
        buckets[buf.untyped_storage().data_ptr()] = buf.untyped_storage().nbytes()
        return allreduce_hook(state, bucket)

    if with_hook:
        model.register_comm_hook(dist.group.WORLD, recording_hook)
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(dist.get_rank()))

    def step():
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()

    step()
    step()                                          # DDP's buckets are rebuilt in the second iteration
    buckets.clear()
    trackers = []
    original = memory._step_peak_tracker

    def keep():
        trackers.append(original())
        return trackers[-1]

    memory._step_peak_tracker = keep
    try:
        peak = memory.peak_memory(step, model, optimizer)
    finally:
        memory._step_peak_tracker = original
    tracked = {}
    for storage, (winfo, _) in trackers[0]._WINFO.items():     # the storages still alive after the step
        tracked.setdefault(storage.data_ptr(), []).append((winfo.reftype.value, winfo.mem_consumed))
    if not with_hook:                               # no hook: the temporaries that outlive the step, by size
        buckets = {p: kinds[0][1] for p, kinds in tracked.items() if kinds[0][0] == "Temp"}
    state = sum(t.numel() * t.element_size() for t in model.parameters()) * 4   # fp32 AdamW: 16 B/param
    return {"buckets": buckets, "tracked": {p: tracked.get(p, []) for p in buckets}, "peak": peak, "state": state,
            "bucket_bytes": memory.ddp_bucket_bytes(model)}


def test_peak_memory_counts_ddp_s_bucket_once(make_cluster):
    """The reducer writes each gradient into its bucket through aten.mul.out (bucket_view.copy_ under a comm hook)
    on the thread that runs backward, so MemTracker tracks each bucket's storage: one storage entry per bucket,
    its full size, a temporary. Adding ddp_bucket_bytes to the peak would count it twice (lessons 12 and 13 did)."""
    for with_hook in (True, False):
        r = make_cluster(2, timeout=180).run(_bucket_in_the_tracker, with_hook)[0]   # DDP imports dynamo: slow
        assert len(r["buckets"]) >= 2, f"several buckets expected: {r['buckets']}"
        # DDP's logging data keeps the sizes of its first buckets (before the rebuild): the bytes agree
        assert sum(r["buckets"].values()) == r["bucket_bytes"], (r["buckets"], r["bucket_bytes"])
        for ptr, nbytes in r["buckets"].items():
            assert r["tracked"][ptr] == [("Temp", nbytes)], (
                f"hook={with_hook}: bucket storage {ptr:#x} ({nbytes} bytes) is tracked as {r['tracked'][ptr]}: "
                "expected once, as a temporary of its full size")
        # the whole step's peak holds the model state and the buckets (backward's last gradient is in its bucket)
        assert r["peak"]["total"] >= r["state"] + r["bucket_bytes"], r
        assert r["peak"]["temporaries"] >= r["bucket_bytes"], r
