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

With ``reduce_scatter=True`` (ZeRO-2) the model is NOT wrapped in DDP: ``step()`` reduce-scatters
the local gradients (each rank receives the average of its own slice only), frees them, and keeps
just its slice of the gradient (``shard.grad``, 1/W of the gradient bytes) until ``zero_grad()``.
Here the whole gradient still exists at the end of backward; DeepSpeed's ZeRO-2 and FSDP reduce-scatter
bucket by bucket during backward, so their peak holds only a bucket of full-size gradient.

``count_collectives()`` counts what this rank hands to the library's collectives, and
``ring_bytes`` turns a payload into the bytes a bandwidth-optimal ring sends per rank
(03_all_reduce_by_hand: all-reduce 2(n-1)/n x S, reduce-scatter and all-gather (n-1)/n x S each).
``state_memory`` measures parameters, gradients and optimizer state per rank, counting only the
local shard of a DTensor (FSDP2).
"""
import contextlib
import math
import threading
from fractions import Fraction

import torch
import torch.distributed as dist

from course_utils.memory import tensor_bytes

__all__ = ["ShardedOptimizer", "zero1_step", "count_collectives", "CollectiveLog", "ring_bytes", "state_memory",
           "local_tensor",
           "partition_state_bytes", "zero_table", "make_uneven_model", "make_one_big_layer_model"]


# -- ZeRO-1 and ZeRO-2 -----------------------------------------------------------------------------
def zero1_step(self):
    """The course's solution of the exercise in 12_zero_fsdp: ZeRO-1's ``step()``.

    The gradients in ``p.grad`` are already averaged over the ranks (DDP or MicroDDP did that in
    backward). Step this rank's slice only, then all-gather the updated slices into every replica."""
    flat_grad = self.flatten_grads()                          # every parameter's .grad in one vector
    self.shard.grad = flat_grad[self.lo:self.hi]              # this rank's slice of it
    self.optimizer.step()                                     # updates self.flat[lo:hi] in place
    self.shard.grad = None
    dist.all_gather_single(self.flat, self.shard.detach().clone(), group=self.group)


class ShardedOptimizer:
    """ZeRO-1 (and, with ``reduce_scatter=True``, ZeRO-2) around any ``torch.optim`` optimizer.

    Introduced in 12_zero_fsdp. ``params``: the model's parameters (all of one dtype and device);
    ``optimizer_class`` and ``optimizer_kwargs`` build the optimizer of this rank's slice;
    ``group``: the process group to shard over (default: the world).

    Attributes the lesson uses: ``flat`` (every parameter, side by side, padded to ``W * shard_numel``;
    the parameters are views into it), ``lo``/``hi`` (this rank's slice), ``shard`` (a Parameter over
    ``flat[lo:hi]``, the only tensor the inner optimizer sees), ``optimizer`` (that inner optimizer),
    ``flatten_grads()`` (the parameters' ``.grad`` as one padded vector, zeros for missing gradients).
    """

    def __init__(self, params, optimizer_class, *, group=None, reduce_scatter=False, **optimizer_kwargs):
        self.params = [p for p in dict.fromkeys(params) if p.requires_grad]
        if not self.params:
            raise ValueError("ShardedOptimizer got no parameter that requires a gradient")
        dtypes = {(p.dtype, p.device) for p in self.params}
        if len(dtypes) > 1:
            raise ValueError(f"one flat buffer needs one dtype and device, got {sorted(map(str, dtypes))}")
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.reduce_scatter = reduce_scatter
        self.numel = sum(p.numel() for p in self.params)
        self.shard_numel = math.ceil(self.numel / self.world_size)
        p0 = self.params[0]
        self.flat = torch.zeros(self.shard_numel * self.world_size, dtype=p0.dtype, device=p0.device)
        self.offsets, offset = [], 0
        with torch.no_grad():
            for p in self.params:
                view = self.flat[offset:offset + p.numel()].view_as(p)
                view.copy_(p)
                p.data = view                                  # the parameter now lives in the flat buffer
                self.offsets.append(offset)
                offset += p.numel()
        self.lo, self.hi = self.rank * self.shard_numel, (self.rank + 1) * self.shard_numel
        self.shard = torch.nn.Parameter(self.flat[self.lo:self.hi])   # shares memory with flat
        self.optimizer = optimizer_class([self.shard], **optimizer_kwargs)
        self.optimizer_class, self.optimizer_kwargs = optimizer_class, optimizer_kwargs

    # what torch.optim users and the memory meter expect of an optimizer
    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def bounds(self, rank):
        """``(lo, hi)`` of ``rank``'s slice of the flat buffer."""
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def flatten_grads(self, free=False):
        """A new padded vector holding every parameter's ``.grad`` (zeros where it is None).

        ``free=True`` drops each ``p.grad`` once it is copied (ZeRO-2 keeps only its slice)."""
        flat_grad = torch.zeros_like(self.flat)
        for p, offset in zip(self.params, self.offsets):
            if p.grad is not None:
                flat_grad[offset:offset + p.numel()].copy_(p.grad.reshape(-1))
                if free:
                    p.grad = None
        return flat_grad

    def step(self):
        """ZeRO-1: step this rank's slice of the averaged gradient, then all-gather the slices.

        ZeRO-2 (``reduce_scatter=True``): first reduce-scatter the local gradients, so this rank
        receives the average of its slice only."""
        if self.reduce_scatter:
            return self._zero2_step()
        return zero1_step(self)

    def _zero2_step(self):
        flat_grad = self.flatten_grads(free=True)              # the full-size gradients are gone after this
        if self.shard.grad is None:
            self.shard.grad = torch.empty_like(self.shard)
        dist.reduce_scatter_single(self.shard.grad, flat_grad, op=dist.ReduceOp.SUM, group=self.group)
        del flat_grad
        self.shard.grad /= self.world_size                       # SUM, then divide: the average
        self.optimizer.step()
        dist.all_gather_single(self.flat, self.shard.detach().clone(), group=self.group)

    def zero_grad(self, set_to_none=True):
        """Forget the gradients: the parameters' and this rank's slice."""
        for p in [*self.params, self.shard]:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def state_bytes(self):
        """Bytes of optimizer state this rank holds (every tensor in the inner optimizer's state)."""
        return tensor_bytes(v for s in self.optimizer.state.values() for v in s.values() if torch.is_tensor(v))

    def gradient_bytes(self):
        """Bytes of gradient this rank holds: the parameters' ``.grad`` plus its slice's."""
        return tensor_bytes([*(p.grad for p in self.params), self.shard.grad])

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, state):
        self.optimizer.load_state_dict(state)

    def __repr__(self):
        return (f"ShardedOptimizer({self.optimizer_class.__name__}, {self.numel} parameters, rank {self.rank} owns "
                f"[{self.lo}, {self.hi}) of {self.flat.numel()}{', ZeRO-2' if self.reduce_scatter else ''})")


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
        grads.append(optimizer.shard.grad)
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
def zero_table(world_size):
    """Predicted bytes per parameter per rank with fp32 weights and gradients and Adam's two fp32 moments:
    ``{strategy: (parameters, gradients, optimizer_state)}`` as Fractions. Introduced in 12_zero_fsdp.

    The same stages as ``costmodel.memory_per_rank`` (10_tradeoffs), split by kind."""
    w = Fraction(1, world_size)
    return {"ddp": (Fraction(4), Fraction(4), Fraction(8)),
            "zero1": (Fraction(4), Fraction(4), 8 * w),
            "zero2": (Fraction(4), 4 * w, 8 * w),
            "fsdp": (4 * w, 4 * w, 8 * w)}
