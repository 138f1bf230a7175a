"""ZeRO by hand: shard the optimizer state (ZeRO-1), then the gradients (ZeRO-2), and count the bytes.

Introduced in 12_zero_fsdp. ``ShardedOptimizer`` flattens the parameters into one buffer (padded
to a multiple of the world size W) and makes every parameter a view into it. Rank r owns the
contiguous slice ``[r * n, (r + 1) * n)`` of that buffer (n = ceil(P / W)), and an ordinary
optimizer (``optimizer_class``) over that slice alone, so it keeps 1/W of the optimizer state::

    model = DDP(model)                                  # or MicroDDP: .grad is averaged by backward
    optimizer = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
    loss.backward()
    optimizer.step()        # ZeRO-1: step this rank's slice, then all-gather every updated slice
    optimizer.zero_grad()

With ``reduce_scatter=True`` (ZeRO-2) the model is NOT wrapped in DDP. The constructor broadcasts
rank 0's parameters (DDP's duty), and backward reduce-scatters the gradients **bucket by bucket**
(``register_post_accumulate_grad_hook``), freeing each full-size gradient as soon as it is copied
into its bucket: each rank receives the average of its own chunk of every bucket and keeps only that
(1/W of the gradient bytes). ``bucket_cap_mb`` caps a bucket, as DDP's does; a bucket is a run of
whole parameters, padded to a multiple of W, and rank r owns chunk r of every bucket (with one
bucket, that is the slice ``[lo, hi)`` above).

``clip_sharded_grad_norm_(optimizer_or_params, max_norm)`` clips by the global norm across shards.
``count_collectives()`` counts what this rank hands to the library's collectives, and
``ring_bytes`` turns a payload into the bytes a bandwidth-optimal ring sends per rank
(03_all_reduce_by_hand: all-reduce 2(n-1)/n x S, reduce-scatter and all-gather (n-1)/n x S each).
``state_memory`` measures parameters, gradients and optimizer state per rank, counting only the
local shard of a DTensor (FSDP2).
"""
import contextlib
import math
import threading
import warnings
from fractions import Fraction

import torch
import torch.distributed as dist

from course_utils.memory import tensor_bytes

__all__ = ["ShardedOptimizer", "zero1_step", "clip_sharded_grad_norm_", "EXACT_OPTIMIZERS",
           "count_collectives", "CollectiveLog", "ring_bytes", "state_memory", "local_tensor",
           "partition_state_bytes", "zero_table", "make_uneven_model", "make_one_big_layer_model"]


# -- ZeRO-1 and ZeRO-2 -----------------------------------------------------------------------------
def zero1_step(self):
    """The course's solution of the exercise in 12_zero_fsdp: ZeRO-1's ``step()``.

    The gradients in ``p.grad`` are already averaged over the ranks (DDP or MicroDDP did that in
    backward). Step this rank's slice only, then all-gather the updated slices into every replica.
    (The exercise's version: one parameter group, every parameter with a gradient. ``ShardedOptimizer.step``
    also handles several groups, LR schedulers and parameters whose gradient is None.)"""
    flat_grad = self.flatten_grads()                          # every parameter's .grad in one vector
    self.shard.grad = flat_grad[self.lo:self.hi]              # this rank's slice of it
    self.optimizer.step()                                     # updates self.flat[lo:hi] in place
    self.shard.grad = None
    dist.all_gather_single(self.flat, self.shard.detach().clone(), group=self.group)


# element-wise optimizers: each element's update depends only on that element's gradient, state and
# the group's scalar hyperparameters (and a per-tensor step count), so stepping a flat slice is exact
EXACT_OPTIMIZERS = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam,
                    torch.optim.RAdam, torch.optim.RMSprop, torch.optim.Adagrad, torch.optim.Adadelta)
_NOT_ELEMENT_WISE = {
    "Adafactor": "keeps row and column statistics of each 2-D weight and scales its update by the weight's RMS; "
                 "over a flat 1-D slice both are computed over the slice, not the weight, so the steps differ",
    "Muon": "orthogonalises each 2-D weight's whole update (Newton-Schulz); a flat slice is 1-D and holds "
            "pieces of several weights",
    "LBFGS": "keeps a history of whole-model directions and line-searches with a closure: every rank needs "
             "every parameter",
    "SparseAdam": "needs sparse gradients; a flat buffer's gradient is dense",
}


def _check_element_wise(optimizer_class, who="ShardedOptimizer", stacklevel=3):
    """Refuse a known non-element-wise optimizer over flat slices (``ValueError``), warn about an unknown one.
    ``who``: the sharding tool named in the message (ShardedOptimizer here, MicroFSDP in course_utils.fsdp)."""
    if isinstance(optimizer_class, type) and issubclass(optimizer_class, EXACT_OPTIMIZERS):
        return
    for klass in getattr(optimizer_class, "__mro__", ()):
        if klass.__name__ in _NOT_ELEMENT_WISE:
            raise ValueError(f"{who} cannot shard {klass.__name__}: it {_NOT_ELEMENT_WISE[klass.__name__]}. "
                             "Use an element-wise optimizer (SGD, Adam, AdamW, ...) or shard whole parameters "
                             "(ZeroRedundancyOptimizer, FSDP2's fully_shard with per-parameter DTensors).")
    name = getattr(optimizer_class, "__name__", repr(optimizer_class))
    warnings.warn(f"{who} cannot tell whether {name} is element-wise: over a flat slice it is exact only "
                  "if each element's update depends on that element alone (as in SGD, Adam, AdamW). Compare it "
                  "with the unsharded optimizer before trusting it.", stacklevel=stacklevel)


class _Bucket:
    """A run of whole parameters of one group, at ``[start, end)`` of the flat buffer; ``end - start`` is a
    multiple of W and rank r owns ``[start + r * chunk, start + (r + 1) * chunk)``."""

    def __init__(self, index, group_index, params, offsets, start, end, world_size):
        self.index, self.group_index, self.params, self.offsets = index, group_index, params, offsets
        self.start, self.end = start, end
        self.chunk = (end - start) // world_size
        self.pending = set()            # parameters accumulated into the buffer since the last reduce


class ShardedOptimizer(torch.optim.Optimizer):
    """ZeRO-1 (and, with ``reduce_scatter=True``, ZeRO-2) around an element-wise ``torch.optim`` optimizer.

    Introduced in 12_zero_fsdp. A real ``torch.optim.Optimizer``: LR schedulers drive it, and ``params``
    may be parameters or param-group dicts, each with its own hyperparameters (``lr``, ``weight_decay``, ...)::

        optimizer = ShardedOptimizer([{"params": decay, "weight_decay": 0.1},
                                      {"params": no_decay, "weight_decay": 0.0}], torch.optim.AdamW, lr=1e-3)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10)

    ``optimizer_class`` and ``optimizer_kwargs`` build the optimizer of this rank's shard (``self.optimizer``);
    ``group``: the process group to shard over (default: the world); ``reduce_scatter``: ZeRO-2 (see the
    module docstring); ``bucket_cap_mb``: ZeRO-2's bucket size (default 25, DDP's); ``broadcast_parameters``:
    copy rank 0's parameters to every rank at construction (default: only for ZeRO-2, which has no DDP to do it).

    **Which optimizers are exact.** The inner optimizer sees flat 1-D slices that cut across parameters. That
    is exact for element-wise optimizers (``EXACT_OPTIMIZERS``: SGD, Adam, AdamW, Adamax, NAdam, RAdam,
    RMSprop, Adagrad, Adadelta): each element's update needs only its own gradient and state. Adafactor,
    Muon, LBFGS and SparseAdam are refused (``ValueError`` says why); any other class gets a warning.

    **A parameter whose gradient is None** (an unused layer) is left alone, as torch's optimizers leave it:
    its elements and their optimizer state are restored after the shard's step. One difference remains:
    the shard has one step counter per bucket, so Adam's bias correction for such a parameter counts the
    steps it sat out. Frozen parameters (``requires_grad=False``) are not in the flat buffer at all. ZeRO-2
    assumes, like DDP without ``find_unused_parameters``, that the same parameters get gradients on every rank.

    **Mixed precision.** The flat buffer has one dtype, the parameters': an fp32 model under ``torch.autocast``
    (bf16 or fp16 compute) keeps fp32 parameters, gradients and optimizer state. ``torch.amp.GradScaler`` works
    with ZeRO-1 (after DDP every rank holds the whole averaged ``.grad``, so every rank unscales and checks the
    same numbers) and is refused with ZeRO-2 (``RuntimeError`` at ``scaler.step``: the ``.grad`` it would read
    were freed into the shards during backward, and an overflow seen by one rank's shard alone would desynchronise
    the ranks). The ZeRO paper's 2 + 2 + 12 layout (16-bit parameters and gradients, an fp32 master shard) is not
    implemented here: 12_zero_fsdp predicts it with ``zero_table(W, mixed_precision=True)``.

    **Checkpoints.** ``state_dict()`` is this rank's shard, tagged with rank, world size and layout;
    ``load_state_dict`` refuses a shard saved by another rank or world size, and says what to do. For one
    file (save on rank 0, load on every rank, lesson 11's habit): ``full = optimizer.consolidate_state_dict(to=0)``
    (every rank calls it) returns on rank 0 the state in torch's own per-parameter format, which any rank's
    ``load_state_dict`` accepts and slices (so does a plain ``torch.optim.AdamW``).

    Attributes the lesson uses: ``flat`` (every parameter, side by side, padded; the parameters are views
    into it), ``lo``/``hi`` (this rank's slice, with one bucket), ``shard`` (a Parameter over ``flat[lo:hi]``,
    the tensor the inner optimizer steps; ``shards``: one per bucket), ``optimizer`` (that inner optimizer),
    ``flatten_grads()`` (the parameters' ``.grad`` as one padded vector, zeros for missing gradients).
    """

    def __init__(self, params, optimizer_class, *, group=None, reduce_scatter=False, bucket_cap_mb=None,
                 broadcast_parameters=None, **optimizer_kwargs):
        _check_element_wise(optimizer_class)
        self._built = False
        self._own_state = None
        super().__init__(params, optimizer_kwargs)          # self.param_groups: the model's parameters
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.reduce_scatter = reduce_scatter
        self.optimizer_class, self.optimizer_kwargs = optimizer_class, optimizer_kwargs
        trainable = [[p for p in g["params"] if p.requires_grad] for g in self.param_groups]
        self.params = [p for ps in trainable for p in ps]
        if not self.params:
            raise ValueError("ShardedOptimizer got no parameter that requires a gradient")
        dtypes = {(p.dtype, p.device) for p in self.params}
        if len(dtypes) > 1:
            raise ValueError(f"one flat buffer needs one dtype and device, got {sorted(map(str, dtypes))}")
        self.numel = sum(p.numel() for p in self.params)
        W, p0 = self.world_size, self.params[0]
        cap = (25 if bucket_cap_mb is None else bucket_cap_mb) * 2**20 // p0.element_size() if reduce_scatter else None

        # the layout: group by group, runs of whole parameters (ZeRO-1: one run per group), each padded to W
        runs = []
        for gi, ps in enumerate(trainable):
            run = []
            for p in ps:
                if run and cap is not None and sum(q.numel() for q in run) + p.numel() > cap:
                    runs.append((gi, run))
                    run = []
                run.append(p)
            if run:
                runs.append((gi, run))
        layout, offset = [], 0
        for gi, run in runs:                 # the flat buffer itself is in the parameters' order
            n = sum(p.numel() for p in run)
            layout.append((gi, run, offset, offset + math.ceil(n / W) * W))
            offset += math.ceil(n / W) * W
        self.flat = torch.zeros(offset, dtype=p0.dtype, device=p0.device)
        self.shard_numel = offset // W
        self.offsets, self._bucket_of, self._offset_of = [], {}, {}
        by_order = []
        with torch.no_grad():
            for gi, run, start, end in layout:
                offs, o = [], start
                for p in run:
                    view = self.flat[o:o + p.numel()].view_as(p)
                    view.copy_(p)
                    p.data = view                                  # the parameter now lives in the flat buffer
                    offs.append(o)
                    o += p.numel()
                self.offsets += offs
                by_order.append(_Bucket(0, gi, run, offs, start, end, W))
        self.buckets = list(reversed(by_order))   # bucket 0 holds the last parameters: backward reaches them first
        for i, b in enumerate(self.buckets):
            b.index = i
            for p, o in zip(b.params, b.offsets):
                self._bucket_of[id(p)] = b
                self._offset_of[id(p)] = o
        if broadcast_parameters if broadcast_parameters is not None else reduce_scatter:
            src = 0 if group is None else dist.get_global_rank(group, 0)
            dist.broadcast(self.flat, src=src, group=group)            # every replica starts from rank 0's weights

        # this rank's chunk of each bucket, in the flat buffer's order: the only tensors the inner optimizer sees
        self.shards = [torch.nn.Parameter(self.flat[b.start + self.rank * b.chunk:b.start + (self.rank + 1) * b.chunk])
                       for b in by_order]
        self._shard_of = {id(b): s for b, s in zip(by_order, self.shards)}
        inner_groups = [{"params": [s for b, s in zip(by_order, self.shards) if b.group_index == gi],
                         **{k: v for k, v in g.items() if k != "params"}} for gi, g in enumerate(self.param_groups)]
        self.optimizer = optimizer_class(inner_groups, **optimizer_kwargs)
        for outer, inner in zip(self.param_groups, self.optimizer.param_groups):
            for k, v in inner.items():                                 # the class's defaults, visible to schedulers
                if k != "params":
                    outer.setdefault(k, v)
        self.shard = self.shards[0] if len(self.shards) == 1 else None
        self.lo, self.hi = self.bounds(self.rank) if self.shard is not None else (None, None)
        self._buffers, self._next, self._got_grad, self._hooks = {}, 0, set(), []
        if reduce_scatter:
            self._hooks = [p.register_post_accumulate_grad_hook(self._grad_ready) for p in self.params]
        self._built = True

    # torch.amp.GradScaler: ZeRO-1 needs nothing (after DDP every rank holds the whole averaged .grad, so the scaler
    # unscales and checks the same numbers on every rank). ZeRO-2 frees the .grad it would read: declaring that
    # step() handles scaling itself makes scaler.step(optimizer) reach step(), which refuses it in words.
    @property
    def _step_supports_amp_scaling(self):
        return bool(getattr(self, "reduce_scatter", False))

    # torch.optim.Optimizer keeps its state in self.state; ours is the inner optimizer's (this rank's shard)
    @property
    def state(self):
        return self.optimizer.state if self._built else self._own_state

    @state.setter
    def state(self, value):
        self._own_state = value

    def add_param_group(self, param_group):
        if self._built:
            raise NotImplementedError("ShardedOptimizer lays out its flat buffer once: pass every param group "
                                      "to the constructor")
        super().add_param_group(param_group)

    def bounds(self, rank):
        """``(lo, hi)`` of ``rank``'s slice of the flat buffer (one bucket)."""
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def flatten_grads(self, free=False):
        """A new padded vector holding every parameter's ``.grad`` (zeros where it is None).

        ``free=True`` drops each ``p.grad`` once it is copied."""
        flat_grad = torch.zeros_like(self.flat)
        for p, offset in zip(self.params, self.offsets):
            if p.grad is not None:
                flat_grad[offset:offset + p.numel()].copy_(p.grad.reshape(-1))
                if free:
                    p.grad = None
        return flat_grad

    # -- ZeRO-2: reduce-scatter bucket by bucket during backward ----------------------------------------
    def _grad_ready(self, p):
        """Post-accumulate-grad hook: move ``p.grad`` into its bucket, free it, launch the buckets that are full."""
        b = self._bucket_of[id(p)]
        buf = self._buffers.get(b.index)
        if buf is None:
            buf = self._buffers[b.index] = torch.zeros(b.end - b.start, dtype=p.dtype, device=p.device)
        o = self._offset_of[id(p)] - b.start
        with torch.no_grad():
            buf[o:o + p.numel()].add_(p.grad.reshape(-1))
        p.grad = None                                       # the full-size gradient is gone
        b.pending.add(id(p))
        self._got_grad.add(id(p))
        # launch strictly in bucket order (the same on every rank), each once it and all before it are full
        while self._next < len(self.buckets) and self._full(self.buckets[self._next]):
            self._reduce(self.buckets[self._next])
            self._next += 1
        if self._next == len(self.buckets):
            self._next = 0                                  # a next backward (gradient accumulation) starts over

    @staticmethod
    def _full(b):
        return len(b.pending) == len(b.params)

    def _reduce(self, b):
        buf = self._buffers.pop(b.index)
        out = torch.empty(b.chunk, dtype=buf.dtype, device=buf.device)
        dist.reduce_scatter_single(out, buf, op=dist.ReduceOp.SUM, group=self.group)
        del buf
        out /= self.world_size                              # SUM, then divide: the average
        shard = self._shard_of[id(b)]
        shard.grad = out if shard.grad is None else shard.grad.add_(out)
        b.pending.clear()

    def flush(self):
        """ZeRO-2: reduce-scatter the buckets backward left incomplete (a parameter without gradient), in order."""
        for b in self.buckets[self._next:] + self.buckets[:self._next]:
            if b.index in self._buffers:
                self._reduce(b)
        self._next = 0

    # -- the step ------------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        """Step this rank's shard with its averaged gradient, then all-gather every rank's updated shard.

        ZeRO-1: ``p.grad`` already holds the average (DDP); ZeRO-2: backward's reduce-scatters left it in
        the shards' ``.grad``."""
        if self.reduce_scatter and (getattr(self, "grad_scale", None) is not None or hasattr(self, "found_inf")):
            raise RuntimeError(
                "ShardedOptimizer(reduce_scatter=True) cannot be stepped by torch.amp.GradScaler: ZeRO-2 frees every "
                "parameter's .grad into this rank's shard during backward, so the scaler finds no gradient to unscale "
                "or to check for inf/NaN, and a rank whose shard overflowed would skip a step the others take (they "
                "would wait forever in the all-gather). Use bf16 autocast without a scaler (bf16 has fp32's range), "
                "or ZeRO-1 (DDP + ShardedOptimizer), where every rank holds the whole averaged gradient and "
                "GradScaler works as usual.")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.reduce_scatter:
            self.flush()
            missing = [p for p in self.params if id(p) not in self._got_grad]
        else:
            missing = [p for p in self.params if p.grad is None]
            for b in self.buckets:                          # only this rank's chunk of the gradient, copied
                self._shard_of[id(b)].grad = self._chunk_of_grads(b)
        self._step_shards(missing)
        if not self.reduce_scatter:
            for s in self.shards:
                s.grad = None
        for b in self.buckets:
            s = self._shard_of[id(b)]
            dist.all_gather_single(self.flat[b.start:b.end], s.detach().clone(), group=self.group)
        self._got_grad = set()
        return loss

    def _chunk_of_grads(self, b):
        """This rank's chunk of bucket ``b``'s gradients (``p.grad``, zeros where None); None if no gradient."""
        if all(p.grad is None for p in b.params):
            return None
        lo, hi = s_lo(b, self.rank), s_lo(b, self.rank) + b.chunk
        out = torch.zeros(b.chunk, dtype=self.flat.dtype, device=self.flat.device)
        for p, o in zip(b.params, b.offsets):
            a, z = max(lo, o), min(hi, o + p.numel())
            if p.grad is not None and a < z:
                out[a - lo:z - lo] = p.grad.reshape(-1)[a - o:z - o]
        return out

    def _step_shards(self, missing):
        """The inner optimizer's step, with the outer groups' hyperparameters and the parameters without
        gradient left exactly as they were (values and optimizer state)."""
        for outer, inner in zip(self.param_groups, self.optimizer.param_groups):
            for k, v in outer.items():
                if k != "params":
                    inner[k] = v                            # what a scheduler changed reaches the shard
        saved = []
        for p in missing:
            b = self._bucket_of[id(p)]
            s = self._shard_of[id(b)]
            if s.grad is None:
                continue                                    # the whole chunk is skipped by the optimizer anyway
            o = self._offset_of[id(p)] - b.start
            lo, hi = max(o, self.rank * b.chunk), min(o + p.numel(), (self.rank + 1) * b.chunk)
            if lo >= hi:
                continue                                    # p lies outside this rank's chunk
            sl = slice(lo - self.rank * b.chunk, hi - self.rank * b.chunk)
            st = self.optimizer.state.get(s, {})
            saved.append((s, sl, s.detach()[sl].clone(),
                          {k: v[sl].clone() if v is not None else None for k, v in
                           ((k, st.get(k)) for k in _like_shard(self.optimizer.state, s))}))
        self.optimizer.step()
        for s, sl, values, state in saved:
            s.detach()[sl] = values
            st = self.optimizer.state[s]
            for k, v in st.items():
                if torch.is_tensor(v) and v.shape == s.shape:
                    v[sl] = state[k] if state.get(k) is not None else 0

    def zero_grad(self, set_to_none=True):
        """Forget the gradients: the parameters', the shards' and ZeRO-2's unfinished buckets."""
        for p in [*self.params, *self.shards]:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()
        self._buffers.clear()
        for b in self.buckets:
            b.pending.clear()
        self._next, self._got_grad = 0, set()

    # -- gradient clipping across shards -----------------------------------------------------------------
    def clip_grad_norm_(self, max_norm, norm_type=2.0):
        """Clip the averaged gradient by its global norm, as ``torch.nn.utils.clip_grad_norm_`` would on one
        process; returns that norm. Call it between backward and ``step()``. ZeRO-1: ``p.grad`` is already the
        whole averaged gradient on every rank; ZeRO-2: each rank holds its shards, and the norm is all-reduced."""
        if not self.reduce_scatter:
            return torch.nn.utils.clip_grad_norm_(self.params, max_norm, norm_type)
        self.flush()
        return clip_sharded_grad_norm_(self.shards, max_norm, norm_type, group=self.group)

    # -- checkpoints --------------------------------------------------------------------------------------
    def _layout(self):
        return [(b.start, b.end) for b in self.buckets]

    def state_dict(self):
        """This rank's shard of the optimizer state, tagged with rank, world size and layout. Save one file per
        rank, or use ``consolidate_state_dict`` for one file that every rank can load."""
        self._step_shards_hyperparameters()
        sd = self.optimizer.state_dict()
        sd["sharded"] = {"rank": self.rank, "world_size": self.world_size, "layout": self._layout(),
                         "optimizer": self.optimizer_class.__name__}
        return sd

    def _step_shards_hyperparameters(self):
        for outer, inner in zip(self.param_groups, self.optimizer.param_groups):
            for k, v in outer.items():
                if k != "params":
                    inner[k] = v

    def consolidate_state_dict(self, to=0):
        """Collective (every rank calls it): the whole optimizer state, gathered onto rank ``to`` of the group,
        in torch's per-parameter format (``{"state": {index: {"step", "exp_avg", ...}}, "param_groups": ...}``,
        the indices those of a plain optimizer over the same param groups). Returns it on rank ``to``, None
        elsewhere. ``load_state_dict`` of any rank, any world size, accepts it."""
        mine = {b.index: {k: (v.detach().cpu() if torch.is_tensor(v) else v)
                          for k, v in self.optimizer.state.get(self._shard_of[id(b)], {}).items()}
                for b in self.buckets}
        gathered = [None] * self.world_size if self.rank == to else None
        dst = to if self.group is None else dist.get_global_rank(self.group, to)
        dist.gather_object(mine, gathered, dst=dst, group=self.group)
        if self.rank != to:
            return None
        self._step_shards_hyperparameters()
        state = {}
        index = {p: i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
        for b in self.buckets:
            per_rank = [g[b.index] for g in gathered]
            if not per_rank[0]:
                continue                                   # never stepped
            full = {k: torch.cat([r[k] for r in per_rank]) if _per_element(v, b.chunk) else v
                    for k, v in per_rank[0].items()}
            for p, o in zip(b.params, b.offsets):
                state[index[p]] = {k: (v[o - b.start:o - b.start + p.numel()].view(p.shape).clone()
                                       if _per_element(v, b.end - b.start) else
                                       (v.clone() if torch.is_tensor(v) else v)) for k, v in full.items()}
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [index[p] for p in g["params"]]}
                  for g in self.param_groups]
        return {"state": state, "param_groups": groups, "consolidated": {"world_size": self.world_size}}

    def load_state_dict(self, state_dict):
        """Load this rank's own shard (from ``state_dict()``), or a consolidated state (``consolidate_state_dict``,
        or a plain torch optimizer's over the same param groups), which every rank slices for itself."""
        if "sharded" in state_dict:
            tag = state_dict["sharded"]
            if (tag["rank"], tag["world_size"]) != (self.rank, self.world_size) or \
                    [tuple(x) for x in tag["layout"]] != [tuple(x) for x in self._layout()]:
                raise ValueError(
                    f"this optimizer state is rank {tag['rank']}'s shard of a {tag['world_size']}-rank "
                    "ShardedOptimizer, "
                    f"and this is rank {self.rank} of {self.world_size}"
                    + ("" if (tag["rank"], tag["world_size"]) != (self.rank, self.world_size) else
                       " with another parameter layout") + ": loading it would resume from wrong moments. Either let "
                    "each rank save and load its own file (f'optimizer_rank{rank}.pt'), or save "
                    "optimizer.consolidate_state_dict(to=0) on rank 0 and load that on every rank.")
            sd = {k: v for k, v in state_dict.items() if k != "sharded"}
            self.optimizer.load_state_dict(sd)
        else:
            self.optimizer.load_state_dict(self._slice_full(state_dict))
        for outer, inner in zip(self.param_groups, self.optimizer.param_groups):
            for k, v in inner.items():
                if k != "params":
                    outer[k] = v

    def _slice_full(self, full):
        all_params = [p for g in self.param_groups for p in g["params"]]
        if len(full["param_groups"]) != len(self.param_groups) or \
                sum(len(g["params"]) for g in full["param_groups"]) != len(all_params):
            raise ValueError("this state dict has other param groups than this optimizer: build the optimizer with "
                             "the same groups of the same model")
        index = {p: i for i, p in enumerate(all_params)}
        order = [self._bucket_for_shard(s) for s in self.shards]
        inner_index = {id(s): i for i, s in enumerate(s for g in self.optimizer.param_groups for s in g["params"])}
        state = {}
        for b in order:
            s = self._shard_of[id(b)]
            per_param = [full["state"].get(index[p]) for p in b.params]
            present = [(st, p) for st, p in zip(per_param, b.params) if st]
            if not present:
                continue
            new = {}
            for k, v in present[0][0].items():
                if _per_element(v, present[0][1].numel()):
                    flat = torch.zeros(b.end - b.start, dtype=self.flat.dtype, device=self.flat.device)
                    for st, p, o in zip(per_param, b.params, b.offsets):
                        if st:
                            if st[k].numel() != p.numel():
                                raise ValueError(f"state {k!r} of a parameter has shape {tuple(st[k].shape)}, the "
                                                 f"parameter {tuple(p.shape)}: not this model's optimizer state")
                            flat[o - b.start:o - b.start + p.numel()] = st[k].reshape(-1)
                    new[k] = flat[self.rank * b.chunk:(self.rank + 1) * b.chunk].clone()
                else:
                    new[k] = v.clone() if torch.is_tensor(v) else v
            state[inner_index[id(s)]] = new
        groups = []
        for g_full, g_inner in zip(full["param_groups"], self.optimizer.param_groups):
            groups.append({**{k: v for k, v in g_full.items() if k != "params"},
                           "params": [inner_index[id(s)] for s in g_inner["params"]]})
        return {"state": state, "param_groups": groups}

    def _bucket_for_shard(self, s):
        return next(b for b in self.buckets if self._shard_of[id(b)] is s)

    # -- memory ------------------------------------------------------------------------------------------
    def state_bytes(self):
        """Bytes of optimizer state this rank holds (every tensor in the inner optimizer's state)."""
        return tensor_bytes(v for s in self.optimizer.state.values() for v in s.values() if torch.is_tensor(v))

    def gradient_bytes(self):
        """Bytes of gradient this rank holds: the parameters' ``.grad``, its shards' and unfinished buckets."""
        return tensor_bytes([*(p.grad for p in self.params), *(s.grad for s in self.shards),
                             *self._buffers.values()])

    def __repr__(self):
        where = (f"[{self.lo}, {self.hi})" if self.shard is not None
                 else f"chunk {self.rank} of each of {len(self.buckets)} buckets")
        return (f"ShardedOptimizer({self.optimizer_class.__name__}, {self.numel} parameters, rank {self.rank} owns "
                f"{where} of {self.flat.numel()}{', ZeRO-2' if self.reduce_scatter else ''})")


def s_lo(b, rank):
    """Where ``rank``'s chunk of bucket ``b`` starts in the flat buffer."""
    return b.start + rank * b.chunk


def _per_element(v, n):
    """A state tensor with one number per element (a moment), not a scalar (Adam's step)."""
    return torch.is_tensor(v) and v.dim() >= 1 and v.numel() == n


def _like_shard(state, s):
    """Names of ``s``'s optimizer-state tensors that hold one number per element (moments, momentum)."""
    return [k for k, v in state.get(s, {}).items() if torch.is_tensor(v) and v.shape == s.shape]


def clip_sharded_grad_norm_(params_or_optimizer, max_norm, norm_type=2.0, group=None):
    """Clip gradients by their global norm when each rank holds a different shard of them; returns the norm.

    Introduced in 12_zero_fsdp (used in 13_fsdp_by_hand). ``params_or_optimizer``: a ``ShardedOptimizer``
    (its ``clip_grad_norm_``), or tensors whose ``.grad`` are this rank's shards, disjoint across the ranks of
    ``group`` (DTensor gradients count their local shard). The norm of each rank's shards is combined over the
    group (sum of p-th powers, or max for ``inf``), so every rank gets the norm of the whole gradient and
    scales its shards by ``min(1, max_norm / (norm + 1e-6))``, exactly as ``torch.nn.utils.clip_grad_norm_``
    on one process. Replicated gradients (DDP) must not be passed here: they would count W times."""
    if isinstance(params_or_optimizer, ShardedOptimizer):
        return params_or_optimizer.clip_grad_norm_(max_norm, norm_type)
    if torch.is_tensor(params_or_optimizer):
        params_or_optimizer = [params_or_optimizer]
    grads = [local_tensor(p.grad) for p in params_or_optimizer if p.grad is not None]
    norm_type = float(norm_type)
    device = grads[0].device if grads else torch.device("cpu")
    if grads:
        local = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.detach(), norm_type) for g in grads]),
                                         norm_type).to(torch.float64)
    else:
        local = torch.zeros((), dtype=torch.float64, device=device)
    if math.isinf(norm_type):
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
        total = local
    else:
        local = local ** norm_type
        dist.all_reduce(local, group=group)
        total = local ** (1.0 / norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.dtype))
    return total.to(grads[0].dtype if grads else torch.float32)

# -- measuring --------------------------------------------------------------------------------------
def local_tensor(t):
    """The part of ``t`` this rank holds: a DTensor's local shard, any other tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def state_memory(model, optimizer):
    """Bytes of model state on this rank now: ``{"parameters", "gradients", "optimizer_state"}``.

    Introduced in 12_zero_fsdp. Uses ``course_utils.memory.tensor_bytes`` (01_data_parallelism) on
    the local tensors: for FSDP2's DTensors only this rank's shard counts. Gradients are the
    parameters' ``.grad`` plus what a ``ShardedOptimizer`` holds of its own (ZeRO-2's slice)."""
    # lists, not generators: tensor_bytes skips repeated ids, and a DTensor's to_local() is a new object
    # each time, whose id a freed one could reuse
    params = list(dict.fromkeys(model.parameters()))
    grads = [local_tensor(p.grad) if p.grad is not None else None for p in params]
    if isinstance(optimizer, ShardedOptimizer):
        grads.extend(s.grad for s in optimizer.shards)
        grads.extend(optimizer._buffers.values())                # ZeRO-2's buckets not reduced yet
    state = [local_tensor(v) for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    return {"parameters": tensor_bytes([local_tensor(p) for p in params]),
            "gradients": tensor_bytes(grads),
            "optimizer_state": tensor_bytes(state)}


# collective -> (how to find the payload S in (args, kwargs), the ring's bytes per rank as a multiple of S)
_COLLECTIVES = {
    "all_reduce": (("tensor", 0), lambda n: Fraction(2 * (n - 1), n)),
    "reduce_scatter_tensor": (("input", 1), lambda n: Fraction(n - 1, n)),
    "reduce_scatter_single": (("input", 1), lambda n: Fraction(n - 1, n)),
    "all_gather_into_tensor": (("output_tensor", 0), lambda n: Fraction(n - 1, n)),
    "all_gather_single": (("output_tensor", 0), lambda n: Fraction(n - 1, n)),
    "broadcast": (("tensor", 0), lambda n: Fraction(1)),
}
KINDS = {"all_reduce": "all-reduce", "reduce_scatter_tensor": "reduce-scatter",
         "reduce_scatter_single": "reduce-scatter", "all_gather_into_tensor": "all-gather",
         "all_gather_single": "all-gather", "broadcast": "broadcast"}


def ring_bytes(op, payload_bytes, world_size):
    """Bytes one rank sends for a collective of ``payload_bytes`` S in a bandwidth-optimal ring.

    all-reduce 2(n-1)/n x S; reduce-scatter (S = its input) and all-gather (S = its output)
    (n-1)/n x S each: together exactly one all-reduce (03_all_reduce_by_hand). Returns a Fraction."""
    op = {v: k for k, v in KINDS.items()}.get(op, op)
    return _COLLECTIVES[op][1](world_size) * payload_bytes


@contextlib.contextmanager
def count_collectives():
    """Record every collective this rank calls inside the ``with`` block, through ``torch.distributed``.

    Introduced in 12_zero_fsdp::

        with count_collectives() as calls:
            loss.backward(); optimizer.step()
        calls             # [("all-reduce", payload bytes, world size), ...]
        calls.sent()      # bytes a ring sends per rank: an exact integer (or Fraction)
        calls.kinds()     # {"all-reduce": 1}

    The functions of ``torch.distributed`` are replaced by counting wrappers for the duration of the
    block (only the outermost call counts when one calls another). Anything that calls them through
    ``torch.distributed`` is seen: your code, MicroDDP, ``ZeroRedundancyOptimizer``, FSDP2. torch
    DDP's own all-reduce runs in C++ and is not seen: give DDP the ``allreduce_hook`` comm hook
    (08_comm_hooks), which sends the same bytes through ``dist.all_reduce``.
    """
    calls = CollectiveLog()
    saved = {name: getattr(dist, name) for name in _COLLECTIVES if hasattr(dist, name)}
    local = threading.local()

    def counting(name, original):
        (keyword, position), _ = _COLLECTIVES[name]

        def wrapper(*args, **kwargs):
            depth = getattr(local, "depth", 0)
            if depth == 0:
                t = kwargs.get(keyword, args[position] if len(args) > position else None)
                group = kwargs.get("group")
                n = dist.get_world_size(group)
                calls.append((KINDS[name], t.numel() * t.element_size(), n))
            local.depth = depth + 1
            try:
                return original(*args, **kwargs)
            finally:
                local.depth = depth
        wrapper.__name__ = name
        return wrapper

    try:
        for name, fn in saved.items():
            setattr(dist, name, counting(name, fn))
        yield calls
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


class CollectiveLog(list):
    """The list ``count_collectives`` fills: ``(kind, payload bytes, world size)`` per call."""

    def payload(self, kind=None):
        """Total payload bytes S handed to collectives (of one ``kind``, e.g. ``"all-gather"``)."""
        return sum(b for k, b, _ in self if kind is None or k == kind)

    def sent(self, kind=None):
        """Bytes a bandwidth-optimal ring sends per rank for these calls (see ``ring_bytes``)."""
        total = sum((ring_bytes(k, b, n) for k, b, n in self if kind is None or k == kind), Fraction(0))
        return int(total) if total.denominator == 1 else total

    def kinds(self):
        """``{kind: number of calls}``."""
        out = {}
        for k, _, _ in self:
            out[k] = out.get(k, 0) + 1
        return out


# -- torch's ZeroRedundancyOptimizer and the even split ------------------------------------------------
def partition_state_bytes(optimizer):
    """Bytes of optimizer state this rank holds, for a ``ZeroRedundancyOptimizer`` (its local optimizer),
    a ``ShardedOptimizer`` or any ``torch.optim`` optimizer."""
    inner = getattr(optimizer, "optim", optimizer)   # ZeroRedundancyOptimizer keeps its shard's optimizer in .optim
    return tensor_bytes([local_tensor(v) for s in inner.state.values() for v in s.values() if torch.is_tensor(v)])


# -- models the lesson and its tests use ------------------------------------------------------------------
def make_one_big_layer_model(seed=0, d_big=256, d_small=16):
    """One big Linear (``d_big`` x ``d_big``) between small ones: a per-parameter partition cannot balance it."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(d_small, d_big), torch.nn.ReLU(), torch.nn.Linear(d_big, d_big),
                               torch.nn.ReLU(), torch.nn.Linear(d_big, d_small), torch.nn.ReLU(),
                               torch.nn.Linear(d_small, 1))


def make_uneven_model(seed=0):
    """A small model of 189 parameters in 7 tensors: the count does not divide by 2 or 4."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.Tanh(), torch.nn.Linear(13, 5),
                               torch.nn.LayerNorm(5), torch.nn.Linear(5, 1, bias=False))


# -- the ZeRO table --------------------------------------------------------------------------------------
def zero_table(world_size, mixed_precision=False):
    """Predicted bytes per parameter per rank of model state with Adam, between steps:
    ``{strategy: (parameters, gradients, optimizer_state)}`` as Fractions. Introduced in 12_zero_fsdp.

    fp32 (default): 4 + 4 + 8 (weights, gradients, Adam's two moments). ``mixed_precision=True``: the ZeRO
    paper's 2 + 2 + 12 (fp16/bf16 weights and gradients; an fp32 master copy of the weights and Adam's two
    fp32 moments as optimizer state). The fp32 stages are those of ``costmodel.memory_per_rank``
    (10_tradeoffs), split by kind. Peaks add more: DDP's bucket copy of the gradients, activations,
    temporaries, FSDP's gathered layers."""
    w = Fraction(1, world_size)
    p, g, o = (Fraction(2), Fraction(2), Fraction(12)) if mixed_precision else (Fraction(4), Fraction(4), Fraction(8))
    return {"ddp": (p, g, o),
            "zero1": (p, g, o * w),
            "zero2": (p, g * w, o * w),
            "fsdp": (p * w, g * w, o * w)}
