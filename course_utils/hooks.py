"""DDP communication hooks and a byte counter for any hook.

Introduced in 08_comm_hooks (``ByteCounter``, ``flat_grad``, ``relative_error``) and
09_compression (``cast_allreduce``, ``fp16_hook``, ``bf16_hook``).

A DDP comm hook is ``hook(state, bucket) -> Future[Tensor]``: it gets a ``dist.GradBucket``
(the flat buffer of several gradients, NOT yet divided by the world size) and returns a Future
whose value is the reduced buffer, same shape as ``bucket.buffer()``. DDP copies that value back
into the parameters' ``.grad``.

``ByteCounter`` counts what a hook hands to the collectives::

    counter = ByteCounter()
    model.register_comm_hook(None, counter.wrap(allreduce_hook))
    ... train a few steps ...
    counter.bytes_per_step()     # e.g. [4612, 4612, 4612]

It counts the bytes of the tensor each rank passes to ``dist.all_reduce``, ``dist.all_gather``,
``dist.broadcast``... (the payload S: ``numel * element_size``). What the backend then moves per
rank depends on its algorithm: a ring all-reduce sends 2(n-1)/n x S (03_all_reduce_by_hand).
Counted are the collectives issued inside the wrapped hook and inside the ``then`` callbacks of
its futures (PowerSGD issues its P and Q all-reduces there, on the backend's thread). DDP's own
all-reduce (no hook registered) runs in C++ and is not visible: register ``allreduce_hook``
instead, which sends the same bytes (08_comm_hooks proves it gives the same gradients).
"""
import functools
import threading
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["ByteCounter", "Collective", "cast_allreduce", "fp16_hook", "bf16_hook", "flat_grad", "relative_error",
           "avg_hook", "fp16_wrap"]

# collective name -> how to find the tensors this rank contributes, from (args, kwargs)
_CONTRIBUTES = {
    "all_reduce": ("tensor", 0),
    "broadcast": ("tensor", 0),
    "reduce": ("tensor", 0),
    "all_gather": ("tensor", 1),
    "all_gather_into_tensor": ("input_tensor", 1),
    "reduce_scatter": ("input_list", 1),
    "reduce_scatter_tensor": ("input", 1),
    "all_to_all_single": ("input", 1),
    "all_to_all": ("input_tensor_list", 1),
}

_lock = threading.RLock()
_active = weakref.WeakSet()   # counters that have wrapped a hook and are not closed
_local = threading.local()    # .inside: the counter whose hook this thread is running, or None
_hook_threads = set()         # threads that have called a wrapped hook (the training threads)
_originals = {}


@dataclass(frozen=True)
class Collective:
    """One collective call seen by a ``ByteCounter``: ``op``, ``dtype``, ``numel``, ``nbytes``, ``step``."""

    op: str
    dtype: torch.dtype
    numel: int
    nbytes: int
    step: int


def _tensors_of(value):
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for t in value if isinstance(t, torch.Tensor)]
    return []


def _counting(name, original):
    keyword, position = _CONTRIBUTES[name]

    @functools.wraps(original)
    def collective(*args, **kwargs):
        counter = getattr(_local, "inside", None)
        if counter is None and threading.get_ident() not in _hook_threads:
            # a backend thread running a hook future's callback: count it for the counters
            # whose hook is in flight
            with _lock:
                targets = [c for c in list(_active) if c._in_flight]
        else:
            targets = [counter] if counter is not None and counter in _active else []
        if targets:
            value = kwargs.get(keyword, args[position] if len(args) > position else None)
            for t in _tensors_of(value):
                for c in targets:
                    c._record(name, t)
        return original(*args, **kwargs)

    return collective


def _install():
    """Replace ``torch.distributed.<collective>`` with counting versions (once per process)."""
    with _lock:
        if _originals:
            return
        for name in _CONTRIBUTES:
            if hasattr(dist, name):
                _originals[name] = getattr(dist, name)
                setattr(dist, name, _counting(name, _originals[name]))


class ByteCounter:
    """Count the bytes a DDP comm hook hands to collectives, per training step.

    Introduced in 08_comm_hooks. ``wrap(hook)`` returns a hook that behaves exactly like ``hook``
    (same name and signature, so DDP's checks still apply) and records every collective it
    issues, including those issued later by its futures' callbacks. A step ends with the
    bucket for which ``bucket.is_last()`` is true.
    """

    def __init__(self):
        self.calls = []          # list of Collective
        self.buckets = 0         # hook calls
        self.steps = 0           # completed steps (last bucket seen)
        self._step = 0           # the step the next collectives belong to
        self._new_step = False
        self._in_flight = 0      # hook futures not yet completed
        self._lock = threading.Lock()

    def wrap(self, hook):
        """``hook`` with byte counting: register the result with ``model.register_comm_hook``."""
        _install()
        with _lock:
            _active.add(self)

        @functools.wraps(hook)
        def counted(state, bucket):
            _hook_threads.add(threading.get_ident())
            last = bucket.is_last()
            with self._lock:
                if self._new_step:          # the previous call was a step's last bucket
                    self._step += 1
                    self._new_step = False
                self._new_step = last
                self._in_flight += 1
                self.buckets += 1
            previous, _local.inside = getattr(_local, "inside", None), self
            try:
                fut = hook(state, bucket)
            except BaseException:
                with self._lock:
                    self._in_flight -= 1
                raise
            finally:
                _local.inside = previous

            def done(f):
                with self._lock:
                    self._in_flight -= 1
                    if last:
                        self.steps += 1
                return f.value()

            return fut.then(done)

        return counted

    def _record(self, op, tensor):
        with self._lock:
            self.calls.append(Collective(op, tensor.dtype, tensor.numel(),
                                         tensor.numel() * tensor.element_size(), self._step))

    @property
    def bytes(self):
        """Total bytes handed to collectives since the last ``reset()``."""
        return sum(c.nbytes for c in self.calls)

    def bytes_per_step(self):
        """Bytes handed to collectives in each completed step, in order."""
        out = [0] * self.steps
        for c in self.calls:
            if c.step < self.steps:
                out[c.step] += c.nbytes
        return out

    def reset(self):
        """Forget what was counted (the wrapped hook keeps counting into this counter)."""
        with self._lock:
            self.calls, self.buckets, self.steps, self._step, self._new_step = [], 0, 0, 0, False

    def summary(self, step=None):
        """A small table of the collectives of one step (the last one by default)."""
        step = self.steps - 1 if step is None else step
        rows = {}
        for c in self.calls:
            if c.step == step:
                key = (c.op, str(c.dtype).replace("torch.", ""))
                n, numel, nbytes = rows.get(key, (0, 0, 0))
                rows[key] = (n + 1, numel + c.numel, nbytes + c.nbytes)
        lines = [f"{'collective':<12} {'dtype':<9} {'calls':>5} {'numel':>8} {'bytes':>8}"]
        for (op, dtype), (n, numel, nbytes) in rows.items():
            lines.append(f"{op:<12} {dtype:<9} {n:>5} {numel:>8} {nbytes:>8}")
        lines.append(f"{'total':<12} {'':<9} {sum(r[0] for r in rows.values()):>5} "
                     f"{sum(r[1] for r in rows.values()):>8} {sum(r[2] for r in rows.values()):>8}")
        return "\n".join(lines)

    def close(self):
        """Stop counting (the wrapped hook still works)."""
        with _lock:
            _active.discard(self)

    def __getstate__(self):  # picklable, so `%ddp pull counter` brings the counts to the notebook
        state = dict(self.__dict__)
        state.pop("_lock")
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def __repr__(self):
        return f"ByteCounter(steps={self.steps}, buckets={self.buckets}, bytes={self.bytes})"


# -- low-precision hooks that work on gloo ----------------------------------------------------
def cast_allreduce(dtype, process_group, bucket):
    """Average ``bucket`` in ``dtype``: cast, divide by the world size, all-reduce, copy back.

    Introduced in 09_compression (``fp16_hook`` and ``bf16_hook`` are this with a fixed dtype)."""
    group = process_group if process_group is not None else dist.group.WORLD
    buffer = bucket.buffer()
    compressed = buffer.to(dtype)
    compressed.div_(dist.get_world_size(group))       # divide BEFORE summing: no overflow
    fut = dist.all_reduce(compressed, group=group, async_op=True).get_future()

    def decompress(fut):
        buffer.copy_(fut.value()[0])                    # back to the bucket's dtype, in place
        return buffer

    return fut.then(decompress)


def fp16_hook(process_group, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket in float16: half the bytes of float32. Works on gloo and NCCL.

    Introduced in 09_compression. Divides by the world size before the all-reduce, so the sum
    cannot overflow float16 (largest finite value 65504) unless a single gradient already does.
    """
    return cast_allreduce(torch.float16, process_group, bucket)


def bf16_hook(process_group, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket in bfloat16: half the bytes, float32's range, 8 bits of mantissa.

    Introduced in 09_compression. DDP refuses its own ``bf16_compress_hook`` unless torch was
    built with CUDA and NCCL >= 2.10 (it checks the hook's name); gloo all-reduces bfloat16
    tensors fine, so this hand-written one runs on CPU.
    """
    return cast_allreduce(torch.bfloat16, process_group, bucket)


# -- comparing gradients ---------------------------------------------------------------------
def flat_grad(model):
    """All parameter gradients of ``model`` as one float64 vector (zeros where a grad is None).

    Introduced in 08_comm_hooks."""
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1).double()
                      for p in model.parameters()])


def relative_error(approx, exact):
    """``||approx - exact|| / ||exact||`` as a Python float (0.0 when both are zero).

    Introduced in 08_comm_hooks."""
    approx, exact = approx.double(), exact.double()
    denom = exact.norm().item()
    diff = (approx - exact).norm().item()
    return diff / denom if denom > 0 else diff


# -- exercises of 09_compression: the course's solutions (the self-checks are in checks.comm_hook) --
def powersgd_numbers(model, rank, min_compression_rate=2.0):
    """``(uncompressed, compressed)``: how many numbers torch's ``powerSGD_hook`` all-reduces per
    compressed step for ``model``'s gradients in one bucket. Tensors of one dimension, and matrices
    ``m x n`` for which ``(m + n) * rank * min_compression_rate >= m * n``, go as they are; every other
    matrix sends ``P`` (m x rank) and ``Q`` (n x rank). Introduced in 09_compression."""
    raw = compressed = 0
    for p in model.parameters():
        if not p.requires_grad:
            continue
        if p.dim() <= 1:
            raw += p.numel()
            continue
        m, n = p.shape[0], p.numel() // p.shape[0]
        if (m + n) * rank * min_compression_rate < m * n:
            compressed += (m + n) * rank
        else:
            raw += p.numel()
    return raw, compressed


def fp16_powersgd_bytes_solution(model, rank=1):
    """Exercise 1's solution: bytes per compressed step of ``fp16_compress_wrapper(powerSGD_hook)``.

    The wrapper casts the bucket to float16 before PowerSGD sees it, so every number PowerSGD
    all-reduces (the uncompressed tensors, then P, then Q) is 2 bytes."""
    raw, compressed = powersgd_numbers(model, rank)
    return 2 * (raw + compressed)


def tightest_rtol(significant_bits):
    """The tightest power of ten above the relative rounding error of a float that keeps ``significant_bits``:
    rounding to nearest moves a number by at most half a unit in its last place, ``2**-significant_bits`` of
    itself. A hook's gradient error, a norm over many such roundings, stays below that bound and above a tenth of
    it (09_compression's checks measure about 4e-4 for float16, 2e-3 for bfloat16)."""
    import math

    return 10.0 ** math.ceil(math.log10(2.0 ** -significant_bits))


def fp16_tightest_rtol():
    """Exercise 2's solution for ``fp16_hook``: float16 keeps 11 significant bits, so each number rounds to
    within 2**-11 (about 4.9e-4) of itself; the tightest power of ten above that is 1e-3."""
    return tightest_rtol(11)


def bf16_tightest_rtol():
    """Exercise 2's solution for ``bf16_hook``: bfloat16 keeps 8 significant bits, so each number rounds to
    within 2**-8 (about 3.9e-3) of itself; the tightest power of ten above that is 1e-2."""
    return tightest_rtol(8)


# -- the course's solutions of 08's exercises (used when USE_SOLUTION = True) -----------------
def avg_hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """08's exercise 1: average the bucket with ``ReduceOp.AVG`` (gloo and NCCL), no explicit division.

    Introduced in 08_comm_hooks."""
    group = state if state is not None else dist.group.WORLD
    fut = dist.all_reduce(bucket.buffer(), op=dist.ReduceOp.AVG, group=group, async_op=True).get_future()
    return fut.then(lambda fut: fut.value()[0])


def fp16_wrap(hook):
    """08's exercise 2: ``hook`` made to communicate in float16, like torch's ``fp16_compress_wrapper``.

    The wrapped hook hands ``hook`` a bucket whose buffer is the float16 copy
    (``bucket.set_buffer``), then copies the reduced float16 values back into the original
    float32 buffer. Introduced in 08_comm_hooks."""

    def fp16_wrapped(state, bucket):
        buffer = bucket.buffer()
        bucket.set_buffer(buffer.to(torch.float16))     # the wrapped hook now reduces 2-byte values

        def decompress(fut):
            buffer.copy_(fut.value())                   # back to float32, into the original buffer
            return buffer

        return hook(state, bucket).then(decompress)

    fp16_wrapped.__name__ = f"fp16_wrap({getattr(hook, '__name__', 'hook')})"
    return fp16_wrapped
