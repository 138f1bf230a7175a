"""Training memory of a real-size model, measured on the CPU in seconds with fake tensors.

Introduced in 14_will_it_fit (and used again in 16_fine_tuning_small_cards). The model is built on the
``meta`` device, sharded with FSDP2's ``fully_shard`` on a world from torch's ``fake`` process-group backend
(every collective returns at once, no other process exists), then materialised with ``to_empty`` under
``FakeTensorMode``: every tensor has a shape, a dtype and a storage size, and no bytes. torch's
``FSDPMemTracker`` (or ``MemTracker`` without FSDP) then follows one training step and records the peak,
by kind, exactly as it does for real tensors. A 6.74B-parameter model takes a few seconds.

What fake tensors measure right, checked against real tensors at small scale in the lesson: parameters,
gradients, activations, the buffers FSDP2 gathers and reduces, and the optimizer's state and temporaries
once the state exists. What they do not: see ``FOREACH_NOTE``. What no tensor meter sees at all: the
CUDA context, the allocator's fragmentation and cached blocks, NCCL's buffers and kernels' workspaces.
"""
import contextlib
import time
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from course_utils.memory import (_dispatch_and_track, _GlobalPeakOnly, _step_peak_tracker, _tracker_imports,
                                 skip_frozen, tracker_kinds)

GB = 1e9
GiB = 2 ** 30

FOREACH_NOTE = (
    "Under FakeTensorMode, a step whose ops on FSDP2's DTensor parameters are new to DTensor's sharding-propagation\n"
    "caches (the first, in which AdamW creates its state) is overcounted: DTensor works out each new op's output\n"
    "shape on fake tensors of the global shape under the run's own FakeTensorMode, and FSDPMemTracker counts them\n"
    "(at 14.5M parameters and W = 2: 9 parameter shards where real tensors hold 3 with foreach=True, 4.0 where\n"
    "they hold 2.6 with the for-loop). Later steps agree with real tensors. measure_step therefore runs one\n"
    "optimizer step before its tracker starts (warmup=True)."
)


@dataclass(frozen=True)
class LlamaShape:
    """The published shape of a Llama-family decoder: RMSNorm, grouped-query attention, SwiGLU, untied head.

    Optional, for the decoders of the same family that differ (their defaults keep the Llama shape): ``qkv_bias``
    (Qwen2: biases on q_proj, k_proj and v_proj), ``tie_embeddings`` (the head shares the embedding's weight, as the
    small Qwen2.5 models do), ``head_dim`` (when it is not ``d_model // n_head``)."""
    name: str
    vocab_size: int
    d_model: int
    n_layer: int
    d_ff: int
    n_head: int
    n_kv_head: int
    qkv_bias: bool = False
    tie_embeddings: bool = False
    head_dim: int = None

    @property
    def dims_per_head(self):
        return self.head_dim or self.d_model // self.n_head

    @property
    def n_params(self):
        head_dim = self.dims_per_head
        q, kv = self.n_head * head_dim, self.n_kv_head * head_dim
        attn = 2 * self.d_model * q + 2 * self.d_model * kv + (q + 2 * kv if self.qkv_bias else 0)
        block = attn + 3 * self.d_model * self.d_ff + 2 * self.d_model
        embeddings = (1 if self.tie_embeddings else 2) * self.vocab_size * self.d_model
        return embeddings + self.n_layer * block + self.d_model


# Llama 2 7B and Mistral 7B v0.1: the configurations their authors published (config.json on the hub).
LLAMA2_7B = LlamaShape("Llama-2-7B", vocab_size=32000, d_model=4096, n_layer=32, d_ff=11008, n_head=32, n_kv_head=32)
MISTRAL_7B = LlamaShape("Mistral-7B", vocab_size=32000, d_model=4096, n_layer=32, d_ff=14336, n_head=32, n_kv_head=8)
# The article's "model that alone needs 14 GB": 14 GB / 16 B per parameter = 875M parameters; this
# Llama-shaped model has 877.7M (14.04 GB of fp32 AdamW state).
ARTICLE_14GB = LlamaShape("the article's 14 GB", vocab_size=32000, d_model=2048, n_layer=16, d_ff=4864, n_head=16,
                          n_kv_head=16)


class LlamaBlock(nn.Module):
    def __init__(self, s):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = s.n_head, s.n_kv_head, s.dims_per_head
        q = s.n_head * self.head_dim
        self.attn_norm = nn.RMSNorm(s.d_model)
        self.q_proj = nn.Linear(s.d_model, q, bias=s.qkv_bias)
        self.k_proj = nn.Linear(s.d_model, s.n_kv_head * self.head_dim, bias=s.qkv_bias)
        self.v_proj = nn.Linear(s.d_model, s.n_kv_head * self.head_dim, bias=s.qkv_bias)
        self.o_proj = nn.Linear(q, s.d_model, bias=False)
        self.mlp_norm = nn.RMSNorm(s.d_model)
        self.gate_proj = nn.Linear(s.d_model, s.d_ff, bias=False)
        self.up_proj = nn.Linear(s.d_model, s.d_ff, bias=False)
        self.down_proj = nn.Linear(s.d_ff, s.d_model, bias=False)

    def forward(self, x):
        B, T, _ = x.shape
        h = self.attn_norm(x)
        q = self.q_proj(h).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = self.k_proj(h).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = self.v_proj(h).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_kv_head != self.n_head)
        x = x + self.o_proj(a.transpose(1, 2).reshape(B, T, self.n_head * self.head_dim))
        h = self.mlp_norm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class LlamaShaped(nn.Module):
    """A decoder with the shape of ``s`` (no rotary embedding: it has no parameters and changes no byte count)."""

    def __init__(self, s):
        super().__init__()
        self.embed_tokens = nn.Embedding(s.vocab_size, s.d_model)
        self.blocks = nn.ModuleList(LlamaBlock(s) for _ in range(s.n_layer))
        self.norm = nn.RMSNorm(s.d_model)
        self.lm_head = nn.Linear(s.d_model, s.vocab_size, bias=False)
        if s.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, idx):
        h = self.embed_tokens(idx)
        for block in self.blocks:
            h = block(h)
        return self.lm_head(self.norm(h))


@contextlib.contextmanager
def fake_world(world_size):
    """A default process group of ``world_size`` ranks from torch's ``fake`` backend, in this process only.

    This process plays rank 0; the collectives do nothing (so values are meaningless, sizes are right). Run
    it in the notebook's own process, not inside a ``%%ddp`` cell: a rank there already has its group.
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore
    if dist.is_initialized():
        raise RuntimeError("fake_world(): a default process group exists already in this process. Measure "
                           "true sizes in the notebook's own process (a plain cell, not a %%ddp cell).")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _kinds(snapshot):
    """A tracker's snapshot as this course's kinds (``memory.tracker_kinds``), in bytes: a module's buffers (a
    library model's rotary table) count with its parameters, FSDP's all-gather and reduce-scatter outputs as
    ``comm_buffers``."""
    return tracker_kinds(snapshot, fold={"buffers": "parameters"})


def _fsdp_step_peak_tracker(model, optimizer):
    """torch's ``FSDPMemTracker``, keeping only the global peak (what ``measure_step`` reads), as
    ``course_utils.memory._step_peak_tracker`` does for ``MemTracker``: after every op FSDPMemTracker also
    updates a peak per FSDP module that is running, a loop over every module it has seen (a fifth of a 7B
    step's time). Its global peak is torch 2.13's, kept by ``memory._GlobalPeakOnly``. Its
    ``__torch_dispatch__`` is torch 2.13's through ``course_utils.memory._dispatch_and_track`` (shared with the
    replica tracker): FSDP's all-gather and reduce-scatter outputs relabelled as its communication buffers, then
    every output tracked."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPRefType, _FSDPState

    _tracker_imports()
    c10d = torch.ops.c10d

    class FSDPStepPeakTracker(_GlobalPeakOnly, FSDPMemTracker):
        def _comm_buffers(self, func, args):
            if func is c10d._allgather_base_.default and self._fsdp_state in (_FSDPState.PRE_FW, _FSDPState.PRE_BW):
                self._update_and_maybe_create_winfos(args[0], _FSDPRefType.ALL_GATHER, update_existing=True)
            if func is c10d._reduce_scatter_base_.default and self._fsdp_state == _FSDPState.POST_BW:
                self._update_and_maybe_create_winfos(args[1], _FSDPRefType.REDUCE_SCATTER, update_existing=True)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return _dispatch_and_track(self, func, types, args, kwargs, _FSDPRefType, self._comm_buffers)

    return FSDPStepPeakTracker(model, optimizer)


def _restart_peak(tracker):
    # What MemTracker.__enter__ does to start its peak from the memory in use now (torch 2.13's own
    # attributes): the next phase's peak then starts from what the previous phase left behind.
    tracker._peak_mem_snap = tracker.get_tracker_snapshot()
    tracker._peak_mem = {dev: snap["Total"] for dev, snap in tracker._peak_mem_snap.items()}


def measure_step(shape, world_size=1, strategy="fsdp2", mixed_precision=False, micro_batch_size=1, seq_len=512,
                 checkpoint=False, foreach=False, modify=None, fake=True, warmup=True):
    """Peak memory of rank 0 in each phase of one AdamW training step of ``shape``, in bytes by kind.

    ``strategy``: ``"fsdp2"`` (``fully_shard`` per block and at the root, measured by ``FSDPMemTracker``) or
    ``"replica"`` (one whole model per rank, as DDP and ZeRO keep it, measured by ``MemTracker``; DDP's bucket
    copy and ZeRO's sharded state are then added by ``replica_strategies``). ``mixed_precision``: FSDP2's
    ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` (fp32 shards, bf16 gathered weights), or
    for a replica bf16 autocast over fp32 weights. ``checkpoint``: activation checkpointing per block.
    ``modify(model)``: called on the meta model before sharding (freeze a base, add adapters, ...).
    ``foreach``: AdamW's setting. The default is the for-loop (``foreach=False``: temporaries one parameter at a
    time), the setting lesson 14's tables state; ``foreach=TORCH_GPU_FOREACH`` (True) is what ``torch.optim.AdamW``
    runs on a GPU when no argument says otherwise, and holds one more list of temporaries at the step.
    ``fake=False``: real tensors instead (same fake world, so the values are meaningless, the bytes real): the
    check that the fake run measures what a real one would, at a size that fits this machine.
    ``warmup=False``: measure the very first step, the one in which AdamW creates its state (by default one step
    runs before the tracker starts, as in training every step but the first: an optimizer step on zero gradients,
    which leaves the bytes a whole step would; ``warmup="full"`` runs the whole step, forward and backward too).

    Returns ``{"forward": kinds, "backward": kinds, "step": kinds, "n_params": ..., "n_trainable": ...,
    "seconds": ..., "param_dtype": ..., "autocast": ..., "foreach": ...}``; each ``kinds`` is the phase's peak with
    its breakdown at that moment; ``param_dtype`` is the trainable parameters' dtype (None if mixed), ``autocast``
    whether the replica ran under bf16 autocast, ``foreach`` AdamW's setting.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.utils.checkpoint import checkpoint as ckpt

    t0 = time.perf_counter()
    with fake_world(world_size):
        with torch.device("meta"):
            model = LlamaShaped(shape)
        if modify is not None:
            modify(model)
        if checkpoint:
            for block in model.blocks:
                block.forward = (lambda f: lambda x: ckpt(f, x, use_reentrant=False))(block.forward)
        n_params = sum(p.numel() for p in model.parameters())
        n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        if strategy == "fsdp2":
            kw = {}
            if mixed_precision:
                kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            for block in model.blocks:
                fully_shard(block, **kw)
            fully_shard(model, **kw)
        elif strategy != "replica":
            raise ValueError(f"strategy={strategy!r}: use 'fsdp2' or 'replica' (DDP and ZeRO start from a replica)")
        with FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext():
            model.to_empty(device="cpu")
            if getattr(shape, "tie_embeddings", False) and strategy == "replica":
                model.lm_head.weight = model.embed_tokens.weight    # to_empty gave each its own (fully_shard: one)
            if not fake:
                # Real values are only there to be stepped, never compared, so DTensor's warning that its random
                # ops may not match a GPU mesh's on a CPU mesh says nothing here (and it printed the venv's path).
                with torch.no_grad(), warnings.catch_warnings():
                    warnings.filterwarnings("ignore", message="DTensor random operators may not have complete")
                    for p in model.parameters():
                        p.normal_(0, 0.02)
            trainable = [p for p in model.parameters() if p.requires_grad]
            optimizer = torch.optim.AdamW(trainable, lr=1e-4, foreach=foreach)
            idx = torch.randint(shape.vocab_size, (micro_batch_size, seq_len))
            autocast = (torch.autocast("cpu", dtype=torch.bfloat16) if mixed_precision and strategy == "replica"
                        else contextlib.nullcontext())
            def forward():
                with autocast:
                    logits = model(idx)
                return F.cross_entropy(logits.flatten(0, 1).float(), idx.flatten())

            if warmup == "full":
                loss = forward()                   # a whole first step: what the default below stands for
                loss.backward()
                del loss
            elif warmup:
                # A first step outside the tracker, in which AdamW makes its state. Its bytes do not depend on
                # the gradients' values, so the step runs on zero gradients: no forward and backward to pay for
                # (tests/test_true_size.py checks that a whole first step leaves the same bytes behind).
                for p in trainable:
                    p.grad = torch.zeros_like(p)
            if warmup:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            phases = tracked_step(model, optimizer, forward, strategy)
    return step_result(phases, model, n_params, n_trainable, t0, mixed_precision, strategy, foreach)


def tracked_step(model, optimizer, forward, strategy):
    """One forward, backward and optimizer step under the step's tracker: the peak per kind of each phase (FSDP2's
    tracker for ``strategy == "fsdp2"``, MemTracker without its per-module peaks otherwise: the same global peak).
    measure_step and model_zoo.measure_model_step share it, so a course shape and a library model are measured
    alike (tests/test_model_zoo.py's cross-check)."""
    if strategy == "fsdp2":
        tracker = _fsdp_step_peak_tracker(model, optimizer)
    else:
        tracker = _step_peak_tracker()
        tracker.track_external(model, optimizer)
    skip_frozen(tracker, model)                # a frozen base (LoRA): no gradient hook on it
    phases = {}
    with tracker:
        loss = forward()
        phases["forward"] = _kinds(tracker.get_tracker_snapshot("peak"))
        _restart_peak(tracker)
        loss.backward()
        del loss
        phases["backward"] = _kinds(tracker.get_tracker_snapshot("peak"))
        _restart_peak(tracker)
        optimizer.step()
        phases["step"] = _kinds(tracker.get_tracker_snapshot("peak"))
        optimizer.zero_grad(set_to_none=True)
    return phases


def step_result(phases, model, n_params, n_trainable, t0, mixed_precision, strategy, foreach):
    """``phases`` with what the step ran: its counts, seconds since ``t0``, trainable dtype, autocast, foreach."""
    dtypes = {p.dtype for p in model.parameters() if p.requires_grad}
    phases.update(n_params=n_params, n_trainable=n_trainable, seconds=time.perf_counter() - t0,
                  param_dtype=dtypes.pop() if len(dtypes) == 1 else None,
                  autocast=bool(mixed_precision and strategy == "replica"), foreach=bool(foreach))
    return phases


def step_peak(result):
    """The largest of a ``measure_step`` result's three phase peaks, and the phase it came from."""
    phase = max(("forward", "backward", "step"), key=lambda p: result[p]["total"])
    return result[phase]["total"], phase


# DDP's default bucket (bucket_cap_mb=25): ZeRO-2 holds one bucket of full gradients at a time while it is reduced.
BUCKET_BYTES = 25 * 2 ** 20
# The optimizer the printed commands run: torch.optim.AdamW with no foreach/fused argument. On a GPU torch then
# picks foreach=True (torch 2.13, torch/optim/optimizer.py: _default_to_fused_or_foreach, for CUDA tensors);
# on a CPU the for-loop. measure_step's default is the for-loop (foreach=False), the setting lesson 14's tables
# state they assume; pass foreach=TORCH_GPU_FOREACH to size the step a GPU runs by default.
TORCH_GPU_FOREACH = True


def replica_phases(replica, world_size, mixed_precision=False, foreach=None):
    """Per-rank bytes of DDP, ZeRO-1 and ZeRO-2 (and, with ``mixed_precision``, one card with ZeRO-Offload) in
    each phase of a step, counted on one measured replica (``measure_step(..., strategy="replica")``).

    Phase by phase: each phase's own kinds at the replica's peak in that phase (forward: the weights, the AdamW
    moments and the activations, no gradient; backward: the gradients made so far and what is still saved; step:
    every gradient and the step's temporaries, no activation), each kind sharded as the strategy shards it, plus the
    strategy's own buffers alive in that phase. Never the maxima of different phases summed (the replica's forward
    peak holds the activations and no gradient, its backward peak the reverse).

    - weights ``p`` B and gradients ``g`` B per parameter (4 and 4; mixed: the measured bf16 replica's 2 and 2);
    - AdamW's state, ``o`` B per trainable parameter (8: the two moments; mixed: 12, an fp32 master copy beside
      them), 1/W of it with ZeRO; its step temporaries, measured: the step's optimizer bytes beyond the state the
      forward phase holds. With the for-loop (``foreach=False``) they are two of the largest parameter's size,
      made one parameter at a time: ZeRO (whose partitions are whole parameters, as torch's
      ``ZeroRedundancyOptimizer``'s are) leaves them whole on the rank that steps that parameter. With
      ``foreach=True`` they cover the list the rank steps: 1/W with ZeRO. Mixed: the step runs on the fp32 master,
      so the bf16 replica's temporaries count twice their bytes;
    - DDP and ZeRO-1 (built on DDP): DDP's bucket copy of the gradients (``gradient_as_bucket_view=False``),
      ``g`` B per trainable parameter, in every phase: the reducer allocates the buckets when it is built and keeps
      them from step to step. The replica is measured *without* DDP, so no meter counted them: they are added once;
    - ZeRO-2: 1/W of the gradients, after each bucket's reduce-scatter; in backward one bucket of full gradients
      (``BUCKET_BYTES``, DDP's default 25 MiB, or every gradient when they are fewer) on top;
    - offload (mixed only): the bf16 weights, gradients, activations and temporaries on the card; the master and
      moments in host memory, stepped by the CPU (``cpu_adamw_seconds`` says what that costs).

    ``foreach``: the setting the replica was measured with (``measure_step`` records it; a replica without the
    record, as ``will_it_fit.measure_replica`` builds, is taken at this argument, default the for-loop).

    What one snapshot per phase cannot see: a moment other than the replica's own peak in a phase that becomes the
    peak once a strategy shrinks a kind (ZeRO-2's early backward, when every activation is still saved and the
    first gradients' temporaries are made: its forward count plus the backward temporaries bounds it).

    Returns ``{strategy: {"forward": bytes, "backward": bytes, "step": bytes}}``.
    """
    if mixed_precision and (replica.get("autocast") or replica.get("param_dtype") != torch.bfloat16):
        raise ValueError("mixed_precision=True counts bf16 weights and fp32 master state on a replica measured in pure "
                         "bf16: measure it with measure_step(..., strategy='replica', modify=lambda m: "
                         "m.to(torch.bfloat16)), not with mixed_precision=True (autocast's weight copies would be "
                         "counted twice)")
    measured = replica.get("foreach")
    if measured is not None and foreach is not None and bool(measured) != bool(foreach):
        raise ValueError(f"replica_phases(foreach={foreach}): the replica was measured with foreach={measured}; its "
                         "step temporaries are that setting's. Measure it again with measure_step(..., foreach=...)")
    foreach = bool(measured if measured is not None else foreach)
    n, W = replica["n_trainable"], world_size
    o = 12 if mixed_precision else 8
    g = 2 if mixed_precision else 4
    held = replica["forward"]["optimizer_state"]          # the replica's AdamW state (its moments), every phase
    out = {name: {} for name in ("DDP", "ZeRO-1", "ZeRO-2") + (("offload",) if mixed_precision else ())}
    for phase in ("forward", "backward", "step"):
        k = replica[phase]
        temps = max(k["optimizer_state"] - held, 0) * (2 if mixed_precision else 1)   # the step's own buffers
        rest = k["parameters"] + k["activations"] + k["temporaries"] + k["comm_buffers"]
        grads = k["gradients"]
        zero_temps = temps / W if foreach else temps
        out["DDP"][phase] = rest + grads + o * n + temps + g * n
        out["ZeRO-1"][phase] = rest + grads + o * n / W + zero_temps + g * n
        bucket = min(BUCKET_BYTES, g * n) if phase == "backward" else 0         # one bucket, at most every gradient
        out["ZeRO-2"][phase] = rest + grads / W + o * n / W + zero_temps + bucket
        if mixed_precision:
            out["offload"][phase] = rest + grads
    return out


def replica_strategies(replica, world_size, mixed_precision=False, foreach=None):
    """Per-rank peaks, ``{strategy: bytes}``: the largest phase of ``replica_phases`` (which says what is counted)."""
    return {name: max(ph.values()) for name, ph in
            replica_phases(replica, world_size, mixed_precision=mixed_precision, foreach=foreach).items()}


ADAMW_IMPLS = {"for-loop": dict(foreach=False), "foreach": dict(foreach=True), "fused": dict(fused=True)}
# How far from linear a probe's two sizes may be (time at the probe over twice the time at half of it) before
# cpu_adamw_seconds says its scaling is rough: AdamW does the same few operations on every element, so its time is
# linear in the parameters once the tensors are large (here 2**20 elements each, as the 14 GB model's are 4M).
LINEARITY_TOLERANCE = 0.25


def _time_adamw_step(impl, numel, repeats, chunk=2 ** 20):
    """Seconds of one AdamW step (``ADAMW_IMPLS[impl]``) over ``numel`` fp32 parameters in tensors of ``chunk``
    elements, on this CPU with torch's threads: the least of ``repeats`` steps after a first one makes the state."""
    sizes = [chunk] * (numel // chunk) + ([numel % chunk] if numel % chunk else [])
    params = [torch.zeros(k, requires_grad=True) for k in sizes]
    for p in params:
        p.grad = torch.full_like(p, 1e-3)
    opt = torch.optim.AdamW(params, lr=1e-4, **ADAMW_IMPLS[impl])
    opt.step()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        opt.step()
        best = min(best, time.perf_counter() - t0)
    return best


def cpu_adamw_seconds(n_params, probe_params=8 * 2 ** 20, impls=tuple(ADAMW_IMPLS), repeats=3, measure=None):
    """One AdamW step over ``n_params`` fp32 parameters on this machine's CPU, by implementation: what offload's
    CPU step costs every training step (ZeRO-Offload's master weights and moments live in host memory).

    Measured at ``probe_params`` (8M: about 0.05 s a step with the for-loop on a laptop core) and at half of it,
    scaled linearly to ``n_params``: ``seconds = t(probe) * n_params / probe``. ``measure(impl, numel)`` returns the
    seconds of one step (default: ``_time_adamw_step`` with ``repeats``; a test passes its own). Returns
    ``{impl: {"seconds": ..., "probe_seconds": ..., "probe_params": ..., "linearity": t(probe) / (2 t(probe / 2)),
    "linear": abs(linearity - 1) <= LINEARITY_TOLERANCE}}``."""
    measure = measure or (lambda impl, numel: _time_adamw_step(impl, numel, repeats))
    out = {}
    for impl in impls:
        half, full = measure(impl, probe_params // 2), measure(impl, probe_params)
        linearity = full / (2 * half) if half > 0 else float("inf")
        out[impl] = dict(seconds=full * n_params / probe_params, probe_seconds=full, probe_params=probe_params,
                         linearity=linearity,
                         linear=abs(linearity - 1) <= LINEARITY_TOLERANCE)
    return out
