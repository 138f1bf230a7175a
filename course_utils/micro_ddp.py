"""MicroDDP: the course's own DistributedDataParallel, small enough to read in one sitting.

Introduced in 11_capstone_micro_ddp, where the learner writes it piece by piece; this is the
reference solution. It does what torch's DDP does to the gradients of a model whose trainable
parameters all take part in every synced backward:

1. at construction, broadcast rank 0's parameters and buffers, so every replica starts equal;
2. group the trainable parameters into buckets: first in REVERSE registration order (a guess at
   the order backward produces their gradients), a bucket closing once it holds
   ``bucket_cap_mb`` MiB; after the first synced backward, the buckets are rebuilt once, in the
   order the gradients actually became ready (rank 0's order, so every rank agrees), as torch
   DDP does. (torch DDP with ``find_unused_parameters=False`` starts from ONE bucket in
   iteration 0 instead of a guess; it keeps reverse registration order, never rebuilt, only
   with ``find_unused_parameters=True``.)
3. one hook per parameter (``register_post_accumulate_grad_hook``) copies its gradient into its
   bucket; a bucket whose distinct parameters are all in starts an asynchronous all-reduce
   while backward goes on, strictly in bucket order;
4. a callback queued on the autograd engine waits for every bucket at the end of backward, so
   when ``loss.backward()`` returns, every ``.grad`` holds the average over the ranks; it then resets
   the per-backward state, so a second backward through a retained graph (no forward before it) syncs
   too (torch 2.13's DDP leaves that one local);
5. ``no_sync()`` skips all of it: gradients accumulate locally until the next synced backward;
6. at the start of every forward, broadcast rank 0's buffers, as torch's DDP does (``_sync_buffers`` in
   ``_pre_forward``; torch 2.13's ``forward_sync_buffers``, on by default, replaces the deprecated
   ``broadcast_buffers``): running statistics such as BatchNorm's, which every rank's forward updates from its
   own batch, would otherwise drift apart, and an eval forward would differ from rank to rank. (torch's DDP
   skips the broadcast in a forward that follows one run under ``no_sync()`` or ``torch.no_grad()``; MicroDDP
   broadcasts in every forward, which leaves every rank with rank 0's buffers at the same points.)

Wrapping the same module again hands it to the new wrapper: the old wrapper's hooks are removed
(else every gradient would be all-reduced twice) and the old wrapper refuses to run.

The compressor decides what goes on the wire: ``None`` (fp32), ``"fp16"``, ``"bf16"`` or
``"powersgd"`` (rank-2 factors with error feedback, after ``POWERSGD_WARMUP_STEPS`` = 2 plain all-reduces of
each gradient, as torch's ``start_powerSGD_iter`` > 1 requires; ``PowerSGD(rank=2, warmup_steps=0)``
compresses from the first backward), or any object with the same ``start``.
Compressors with state (PowerSGD) have ``state_dict()``/``load_state_dict()``: save it in the
checkpoint, or a resumed run is not the same run.
"""
import contextlib
import time
import weakref
import zlib

import torch
import torch.distributed as dist
from torch import nn

_WRAPPERS = weakref.WeakKeyDictionary()  # module -> weak reference to the MicroDDP that owns its hooks


def broadcast_state(module, group=None):
    """Overwrite every rank's parameters and buffers with those of the group's rank 0, in place."""
    src = 0 if group is None else dist.get_global_rank(group, 0)
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            dist.broadcast(t, src, group=group)


def broadcast_buffers(module, group=None):
    """Overwrite every rank's buffers (BatchNorm's running statistics, ...) with those of the group's rank 0.

    The course's solution to duty 6 of 11_capstone_micro_ddp: torch's DDP does it at the start of a forward."""
    src = 0 if group is None else dist.get_global_rank(group, 0)
    with torch.no_grad():
        for b in module.buffers():
            dist.broadcast(b, src, group=group)


def assign_buckets(params, bucket_cap_mb=25, order=None):
    """Lists of indices into ``params``, walking them in ``order`` (default: reverse registration
    order, the guess before the first backward): a bucket closes once it holds ``bucket_cap_mb``
    MiB (so it may overflow by one parameter) or when the dtype changes."""
    cap = bucket_cap_mb * 1024 * 1024
    order = list(reversed(range(len(params)))) if order is None else list(order)
    buckets, current, size = [], [], 0
    for i in order:
        if current and params[i].dtype != params[current[0]].dtype:
            buckets.append(current)
            current, size = [], 0
        current.append(i)
        size += params[i].numel() * params[i].element_size()
        if size >= cap:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


def start_allreduce(flat, group=None):
    """Start averaging one bucket's flat buffer over the group and return at once, with the Work to wait on.

    The course's solution to piece 3 of 11_capstone_micro_ddp (the cell's ``USE_SOLUTION = True`` picks it)."""
    flat.div_(dist.get_world_size(group))   # divide first, as DDP does: the SUM of the parts is then the mean
    return dist.all_reduce(flat, group=group, async_op=True)


class Bucket:
    """Some parameters and one flat buffer that holds their gradients side by side."""

    def __init__(self, index, params, names=None):
        self.index, self.params = index, params
        self.names = list(names) if names is not None else [f"{index}.{i}" for i in range(len(params))]
        self.offsets, n = [], 0
        for p in params:
            self.offsets.append(n)
            n += p.numel()
        self.buffer = torch.zeros(n, dtype=params[0].dtype, device=params[0].device)
        self.ready = set()     # positions of the parameters whose gradient is in the buffer, this backward
        self.pending = None    # (work, then) while the all-reduce is in flight

    def view(self, i):
        """The slice of the buffer that belongs to parameter ``i``, shaped like it."""
        p = self.params[i]
        return self.buffer[self.offsets[i]:self.offsets[i] + p.numel()].view_as(p)

    @property
    def full(self):
        """Every one of the bucket's DISTINCT parameters has its gradient in (not: hooks fired n times)."""
        return len(self.ready) == len(self.params)


class MicroDDP(nn.Module):
    """Wrap ``module`` so that ``loss.backward()`` leaves the average gradient on every rank.

    Introduced in 11_capstone_micro_ddp::

        model = MicroDDP(make_model(seed=rank), bucket_cap_mb=25, compressor=None)
        loss_fn(model(x), y).backward()      # .grad now holds the average over the ranks
        with model.no_sync():                # wrap forward AND backward, as with torch DDP
            loss_fn(model(x), y).backward()  # local accumulation only

    Set ``model.events = []`` to record a timeline (see ``plot_timeline``), ``None`` to stop.
    ``model.rebuild_buckets = False`` keeps the first layout (to compare timelines).
    ``model.bucket_order()`` and ``load_bucket_order(names)`` carry the rebuilt layout through a checkpoint.
    """

    def __init__(self, module, bucket_cap_mb=25, compressor=None, process_group=None):
        super().__init__()
        previous = _WRAPPERS.get(module)
        if previous is not None and previous() is not None:
            previous().unwrap()               # its hooks would all-reduce every gradient a second time
        self.module = module
        self.group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.bucket_cap_mb = bucket_cap_mb
        self.compressor = make_compressor(compressor)
        self.require_backward_grad_sync = True
        self.rebuild_buckets = True
        self.events = None
        self._released = False
        broadcast_state(module, process_group)  # replicas must start equal, or they never agree
        self._params = [p for p in module.parameters() if p.requires_grad]
        self._names = {p: name for name, p in module.named_parameters()}
        self._index = {p: i for i, p in enumerate(self._params)}
        self._build(assign_buckets(self._params, bucket_cap_mb))
        self._handles = [p.register_post_accumulate_grad_hook(self._grad_ready) for p in self._params]
        _WRAPPERS[module] = weakref.ref(self)
        self._ready_order = None  # the grad-ready order of the first synced backward, until the rebuild
        self._rebuilt = False
        self._sync = True
        self._reset()

    def _build(self, layout):
        self.buckets = [Bucket(b, [self._params[i] for i in idx], [self._names[self._params[i]] for i in idx])
                        for b, idx in enumerate(layout)]
        self._slot = {}  # parameter -> (bucket, position in the bucket)
        for bucket in self.buckets:
            for i, p in enumerate(bucket.params):
                self._slot[p] = (bucket, i)

    def _rebuild(self):
        """Once, before the forward after the first synced backward: buckets in grad-ready order."""
        order = torch.tensor(self._ready_order, dtype=torch.long, device=self.buckets[0].buffer.device)
        src = 0 if self.group is None else dist.get_global_rank(self.group, 0)
        dist.broadcast(order, src, group=self.group)  # rank 0's order: every rank must build the same buckets
        self._order = order.tolist()
        self._build(assign_buckets(self._params, self.bucket_cap_mb, self._order))
        self._rebuilt = True
        self._record("rebuilt")

    def bucket_order(self):
        """The grad-ready order the buckets were rebuilt in, as parameter names (None before the rebuild).

        Put it in a checkpoint and give it to ``load_bucket_order`` on resume: the bucket layout fixes the
        order in which a ring all-reduce adds each element's contributions (with more than 2 ranks), and
        PowerSGD's message layout, so a resumed run that rebuilt its own buckets would differ in the last bits."""
        return None if not self._rebuilt else [self._names[self._params[i]] for i in self._order]

    def load_bucket_order(self, names):
        """Build the buckets now in a saved ``bucket_order()`` (on every rank, before the first forward)."""
        index = {self._names[p]: i for i, p in enumerate(self._params)}
        self._order = [index[name] for name in names]
        self._build(assign_buckets(self._params, self.bucket_cap_mb, self._order))
        self._rebuilt = True
        self._reset()

    def unwrap(self):
        """Remove this wrapper's hooks and return the module; the wrapper refuses to run afterwards."""
        for handle in self._handles:
            handle.remove()
        self._handles, self._released = [], True
        if _WRAPPERS.get(self.module) is not None and _WRAPPERS[self.module]() is self:
            del _WRAPPERS[self.module]
        return self.module

    def _reset(self):
        self._next = 0          # the next bucket to launch: every rank launches in the same order
        self._queued = False    # is _finish queued on the autograd engine for this backward?
        self._seen = []         # parameters whose hook fired in this backward, in order, once each
        for bucket in self.buckets:
            bucket.ready, bucket.pending = set(), None

    def forward(self, *args, **kwargs):
        if self._released:
            raise RuntimeError("MicroDDP: this wrapper was unwrapped, or its module was wrapped again by a newer "
                               "MicroDDP (which now owns the hooks). Use the newer wrapper.")
        if torch.is_grad_enabled() and self._ready_order is not None and not self._rebuilt and self.rebuild_buckets:
            self._rebuild()     # as torch DDP: before the forward, so peak memory does not grow
        broadcast_buffers(self.module, self.group)   # duty 6: rank 0's running statistics, before they are used
        self._sync = self.require_backward_grad_sync  # decided at forward time, as torch DDP does
        self._reset()
        out = self.module(*args, **kwargs)
        if self.events is not None and torch.is_tensor(out) and out.requires_grad:
            out.register_hook(lambda grad: self._record("backward start"))
        return out

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes of forwards run inside this block only accumulate ``.grad`` locally."""
        old = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old  # restore, not True: no_sync blocks may nest

    def _grad_ready(self, p):  # runs inside backward, right after p.grad was accumulated
        if not self._sync or self._released:
            return
        if not self._queued:  # first hook of this backward: wait for the buckets when it ends
            self._queued = True
            # Private API (underscore): torch's own DDP and FSDP use it; torch has no public "run this
            # when the whole backward has finished" callback. (The nearest public tool,
            # torch.autograd.graph.register_multi_grad_hook, fires once the gradients of given
            # tensors are computed, before they are accumulated into .grad.)
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        bucket, i = self._slot[p]
        if bucket.pending is not None:
            raise RuntimeError(
                f"MicroDDP: the gradient of {self._names[p]} changed after its bucket's all-reduce had started "
                "(its hook fired twice in one backward, e.g. reentrant activation checkpointing). Use "
                "torch.utils.checkpoint with use_reentrant=False, or call backward once per forward.")
        bucket.view(i).copy_(p.grad)
        if i not in bucket.ready:
            bucket.ready.add(i)
            self._seen.append(p)
        self._record("grad ready", bucket.index)
        while self._next < len(self.buckets) and self.buckets[self._next].full:
            self._launch(self.buckets[self._next])
            self._next += 1

    def _launch(self, bucket):
        self._record("launch", bucket.index)
        work, then = self.compressor.start(bucket.buffer, bucket, self.group)  # async: returns at once
        bucket.pending = (work, then)
        if self.events is not None:
            work.get_future().add_done_callback(lambda fut, b=bucket.index: self._record("done", b))

    def _finish(self):  # queued on the autograd engine: runs when backward has computed every grad
        self._record("backward end")
        try:
            for bucket in self.buckets[:self._next]:
                work, then = bucket.pending
                work.wait()
                if then is not None:
                    then()  # e.g. cast fp16 back to fp32, or PowerSGD's second round
                for i, p in enumerate(bucket.params):
                    p.grad.copy_(bucket.view(i))
            seen = set(self._seen)
            missing = [self._names[p] for b in self.buckets[self._next:] for p in b.params if p not in seen]
            if not missing and self._ready_order is None:
                self._ready_order = [self._index[p] for p in self._seen]  # the next forward rebuilds from it
        finally:
            # Reset here, when a backward ends, not only in forward: a second backward through a retained graph
            # (loss.backward(retain_graph=True), then loss.backward()) has no forward before it, and must queue
            # its own _finish and launch its own buckets. (torch 2.13's DDP leaves that one's gradients local.)
            self._reset()
        self._record("synced")
        if missing:
            raise RuntimeError(
                f"MicroDDP: no gradient reached the hooks of {', '.join(missing[:3])} in this backward, so "
                "their buckets were never reduced. Make every parameter take part in the loss, or freeze it "
                "(requires_grad=False) before wrapping.")

    def _record(self, what, bucket=None):
        if self.events is not None:
            self.events.append((what, bucket, time.perf_counter()))


class LessonMicroDDP(nn.Module):
    """The course's solution to piece 4 of 11_capstone_micro_ddp, ``MyMicroDDP``: duties 1 to 6 built from
    ``broadcast_state``, ``assign_buckets`` and ``start_allreduce``, without the reference's compressors,
    rebuild and timeline (the cell's ``USE_SOLUTION = True`` picks it)."""

    def __init__(self, module, bucket_cap_mb=25):
        super().__init__()
        broadcast_state(module)                                       # duty 1: every replica starts equal
        self.require_backward_grad_sync = True
        self.module = module
        trainable = [p for p in module.parameters() if p.requires_grad]   # a frozen one never gets a gradient
        layout = assign_buckets(trainable, bucket_cap_mb)             # duty 2: reverse registration order
        self.buckets = [Bucket(b, [trainable[i] for i in idx]) for b, idx in enumerate(layout)]
        self.slot = {}
        for bucket in self.buckets:
            for i, p in enumerate(bucket.params):
                self.slot[p] = (bucket, i)
                p.register_post_accumulate_grad_hook(self.grad_ready)   # duty 3: one hook per parameter

    def forward(self, *args, **kwargs):
        self.sync_buffers()
        self.sync, self.next_bucket, self.queued = self.require_backward_grad_sync, 0, False
        self._empty()
        return self.module(*args, **kwargs)

    def sync_buffers(self):                                           # duty 6, at the start of every forward
        with torch.no_grad():
            for b in self.module.buffers():
                dist.broadcast(b, 0)                                  # rank 0's running statistics everywhere

    def _empty(self):
        for bucket in self.buckets:
            bucket.ready, bucket.work = set(), None

    @contextlib.contextmanager
    def no_sync(self):                                                # duty 5, read by forward
        outer = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = outer                   # the outer block's value: blocks nest

    def grad_ready(self, p):                                          # inside backward, after p.grad accumulated
        if not self.sync:
            return
        if not self.queued:                                           # duty 4: wait when backward ends
            self.queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)
        bucket, i = self.slot[p]
        bucket.view(i).copy_(p.grad)
        bucket.ready.add(i)                                           # distinct parameters, not hook calls
        while self.next_bucket < len(self.buckets) and self.buckets[self.next_bucket].full:
            self.buckets[self.next_bucket].work = start_allreduce(self.buckets[self.next_bucket].buffer)
            self.next_bucket += 1                                     # strictly in bucket order, on every rank

    def finish(self):                                                 # queued on the autograd engine
        launched, self.queued = self.buckets[:self.next_bucket], False
        never = len(launched) < len(self.buckets)
        for bucket in launched:
            bucket.work.wait()
            for i, p in enumerate(bucket.params):
                p.grad.copy_(bucket.view(i))
        self.next_bucket = 0                                          # a second backward (retain_graph) syncs too
        self._empty()
        if never:
            raise RuntimeError("a parameter got no gradient in this synced backward: its bucket was never reduced")


class LateFlagLessonMicroDDP(LessonMicroDDP):
    """The course's solution to exercise 2 of 11_capstone_micro_ddp: ``LessonMicroDDP`` that reads
    ``require_backward_grad_sync`` in ``grad_ready``, at backward time, instead of the value its forward saw."""

    def grad_ready(self, p):
        self.sync = self.require_backward_grad_sync                   # decided per backward, not per forward
        super().grad_ready(p)


def late_flag_prediction():
    """Exercise 2's answer: of 3 micro-batches whose forwards all run outside ``no_sync()`` and whose first two
    backwards run inside it, torch DDP all-reduces in every backward (its forward armed the reduction), a class
    that reads the flag at backward time only in the last."""
    return {"torch DDP": 3, "yours": 1}


class RebuildingLessonMicroDDP(LessonMicroDDP):
    """The course's solution to exercise 3 of 11_capstone_micro_ddp: ``LessonMicroDDP`` that rebuilds its
    buckets once, before the forward after the first synced backward, in the order the gradients arrived there
    (rank 0's order, broadcast, so that every rank builds the same buckets)."""

    def __init__(self, module, bucket_cap_mb=25):
        super().__init__(module, bucket_cap_mb)
        self.bucket_cap_mb = bucket_cap_mb
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.arrived, self.rebuilt = {}, False                        # arrived: parameter -> None, in order

    def grad_ready(self, p):
        if self.sync and not self.rebuilt:
            self.arrived.setdefault(p)                                # first arrival only; a dict keeps the order
        super().grad_ready(p)

    def forward(self, *args, **kwargs):
        if torch.is_grad_enabled() and not self.rebuilt and len(self.arrived) == len(self.params):
            index = {p: i for i, p in enumerate(self.params)}
            order = torch.tensor([index[p] for p in self.arrived], device=self.params[0].device)
            dist.broadcast(order, 0)                                  # rank 0's order on every rank
            layout = assign_buckets(self.params, self.bucket_cap_mb, order.tolist())
            self.buckets = [Bucket(b, [self.params[i] for i in idx]) for b, idx in enumerate(layout)]
            self.slot = {p: (bucket, i) for bucket in self.buckets for i, p in enumerate(bucket.params)}
            self.rebuilt = True
        return super().forward(*args, **kwargs)


# -- compressors: start(flat, bucket, group) -> (async work, then-callable or None) --------------

class AllReduce:
    """No compression: divide by world size, then SUM in fp32 (torch DDP's default)."""

    name = "none"

    def start(self, flat, bucket, group):
        flat.div_(dist.get_world_size(group))
        return dist.all_reduce(flat, group=group, async_op=True), None

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


class Cast(AllReduce):
    """Send fp16 or bf16: half the bytes. Divide BEFORE casting: fp16 overflows past 65504.

    The solution of 11_capstone_micro_ddp's exercise 1 (``Cast(torch.float16)``)."""

    def __init__(self, dtype):
        self.dtype = dtype
        self.name = {torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]

    def start(self, flat, bucket, group):
        low = flat.div(dist.get_world_size(group)).to(self.dtype)
        work = dist.all_reduce(low, group=group, async_op=True)
        return work, lambda: flat.copy_(low)


POWERSGD_WARMUP_STEPS = 2  # plain all-reduces before PowerSGD compresses: torch's start_powerSGD_iter > 1


class PowerSGD:
    """Low-rank compression with error feedback (Vogels et al. 2019), as torch's powerSGD_hook.

    A gradient matrix M (m x n) is sent as P = M Q (m x r) and Q = M^T P (n x r): (m + n) r numbers
    instead of m n. What the approximation missed is added to the next step's gradient (error
    feedback). Vectors go uncompressed, and so does a matrix unless its compression rate
    m n / ((m + n) r) exceeds ``min_compression_rate`` (2, torch's default): below that the two
    rounds and the QR cost more than the bytes they save. The first ``warmup_steps`` reductions
    are plain all-reduces. The state (error feedback, warm-started Q, reductions so far) is kept
    per parameter name, so it survives the bucket rebuild, and ``state_dict()`` returns it (on the
    CPU) for a checkpoint.

    ``warmup_steps`` defaults to ``POWERSGD_WARMUP_STEPS`` (2), as ``make_compressor("powersgd")`` and
    ``scripts/train_micro_ddp.py --powersgd-warmup`` do: torch requires ``start_powerSGD_iter > 1`` with error
    feedback or warm start (09_compression). Of torch's two reasons, the first does not apply here: torch keys
    its state by ``bucket.index()``, and DDP's rebuild after the first iteration changes what each index holds,
    while MicroDDP keys it by parameter name, so ``warmup_steps=0`` is safe for the state (11_capstone_micro_ddp
    passes it to show one compressed backward). The second still holds: compressing the very first, large
    gradients can cost accuracy, so for real training keep the default warm-up of 2 (or pass a longer one).
    """

    name = "powersgd"

    def __init__(self, rank=2, warmup_steps=POWERSGD_WARMUP_STEPS, seed=0, min_compression_rate=2):
        self.rank, self.warmup_steps, self.seed = rank, warmup_steps, seed
        self.min_compression_rate = min_compression_rate
        self.errors, self.qs, self.calls = {}, {}, {}

    def _rank_for(self, p):
        m, n = p.shape[0], p.numel() // p.shape[0]
        return min(m, n, self.rank)

    def compresses(self, p):
        """torch's rule: a matrix, and (m + n) r x min_compression_rate < m n."""
        if p.dim() < 2:
            return False
        m, n = p.shape[0], p.numel() // p.shape[0]
        return (m + n) * self._rank_for(p) * self.min_compression_rate < m * n

    def state_dict(self):
        """Tensors and plain data only: torch.save / torch.load(weights_only=True) can carry it."""
        return {"errors": {k: v.detach().cpu().clone() for k, v in self.errors.items()},
                "qs": {k: v.detach().cpu().clone() for k, v in self.qs.items()}, "calls": dict(self.calls)}

    def load_state_dict(self, state):
        """Loaded on the CPU; ``start`` moves each tensor to its gradient's device at first use."""
        self.errors = {k: v.clone() for k, v in state["errors"].items()}
        self.qs = {k: v.clone() for k, v in state["qs"].items()}
        self.calls = dict(state["calls"])

    def start(self, flat, bucket, group):
        ws = dist.get_world_size(group)
        for name in bucket.names:  # counted per parameter: the same count whatever the bucket layout
            self.calls[name] = self.calls.get(name, 0) + 1
        if self.calls[bucket.names[0]] <= self.warmup_steps:
            return AllReduce().start(flat, bucket, group)
        low_rank = [i for i, p in enumerate(bucket.params) if self.compresses(p)]
        full = [i for i, p in enumerate(bucket.params) if not self.compresses(p)]
        mats = [bucket.view(i).reshape(bucket.params[i].shape[0], -1) for i in low_rank]  # views of flat
        for i, m in zip(low_rank, mats):
            name = bucket.names[i]
            if name not in self.errors:
                self.errors[name] = torch.zeros_like(m)
                g = torch.Generator().manual_seed(self.seed + zlib.crc32(name.encode()))  # the same Q on every rank
                self.qs[name] = torch.randn(m.shape[1], self._rank_for(bucket.params[i]), generator=g).to(m)
            self.errors[name], self.qs[name] = self.errors[name].to(m), self.qs[name].to(m)  # a loaded state: CPU
            m.add_(self.errors[name])                      # M = gradient + what last step missed
        vecs = [bucket.view(i) for i in full]
        ps = [m @ self.qs[bucket.names[i]] for i, m in zip(low_rank, mats)]
        # one message: the P factors (summed; only their span matters) and the rest (averaged)
        msg = torch.cat([p.reshape(-1) for p in ps] + [v.reshape(-1) / ws for v in vecs])
        work = dist.all_reduce(msg, group=group, async_op=True)

        def then():
            parts = iter(msg.split([t.numel() for t in ps + vecs]))
            ps_avg = [torch.linalg.qr(next(parts).view_as(p)).Q for p in ps]  # orthonormal columns
            for v in vecs:
                v.copy_(next(parts).view_as(v))
            if not mats:
                return
            qs = [m.t() @ p for m, p in zip(mats, ps_avg)]
            qmsg = torch.cat([q.reshape(-1) for q in qs])
            dist.all_reduce(qmsg, group=group)             # second round, blocking
            qmsg.div_(ws)
            for i, m, p, q in zip(low_rank, mats, ps_avg, qmsg.split([q.numel() for q in qs])):
                name = bucket.names[i]
                q = q.view(m.shape[1], -1)
                self.qs[name] = q.clone()                  # warm start for the next step
                approx = p @ q.t()                         # the same on every rank
                self.errors[name] = m - approx
                m.copy_(approx)
        return work, then


def make_compressor(spec):
    """``None``/"none", "fp16", "bf16", "powersgd", or an object with a ``start`` method.

    "powersgd" is ``PowerSGD()``: rank 2, ``warmup_steps=POWERSGD_WARMUP_STEPS`` (2). For another rank or
    warm-up, pass ``PowerSGD(rank=..., warmup_steps=...)`` itself."""
    if spec is None or spec == "none":
        return AllReduce()
    if isinstance(spec, str):
        table = {"fp16": lambda: Cast(torch.float16), "bf16": lambda: Cast(torch.bfloat16), "powersgd": PowerSGD}
        if spec not in table:
            raise ValueError(f"unknown compressor {spec!r}: use None, 'fp16', 'bf16', 'powersgd' "
                             "or an object with start(flat, bucket, group).")
        return table[spec]()
    if not hasattr(spec, "start"):
        raise ValueError(f"a compressor needs a start(flat, bucket, group) method; got {type(spec).__name__}")
    return spec


# -- measurement plumbing for the notebook and benchmarks/micro_ddp_vs_ddp.py -------------------

def time_steps(models, optimizers, batch, loss_fn, steps=20, warmup=3):
    """Median seconds per training step of each model, measured in interleaved rounds.

    Every rank must call this with the same arguments; ranks are synchronised before each step.
    """
    import statistics

    times = [[] for _ in models]
    for s in range(warmup + steps):
        for k, (model, opt) in enumerate(zip(models, optimizers)):
            dist.barrier()
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss_fn(model(batch[0]), batch[1]).backward()
            opt.step()
            if batch[0].is_cuda:
                torch.cuda.synchronize()  # CUDA kernels and NCCL run asynchronously: time their end
            dt = time.perf_counter() - t0
            if s >= warmup:
                times[k].append(dt)
    device = next(models[0].parameters()).device  # NCCL reduces CUDA tensors only
    local = torch.tensor([statistics.median(t) for t in times], dtype=torch.float64, device=device)
    dist.all_reduce(local, op=dist.ReduceOp.MAX)  # a step lasts as long as the slowest rank's
    return local.tolist()


def plot_timeline(events, title="One backward pass: bucket all-reduces overlap the backward"):
    """Draw what ``MicroDDP.events`` recorded: backward on top, one row per bucket's all-reduce."""
    import matplotlib.pyplot as plt

    t0 = next(t for what, _, t in events if what == "backward start")
    ms = {}
    for what, b, t in events:
        ms.setdefault((what, b), (t - t0) * 1e3)
    end = ms[("backward end", None)]
    n = 1 + max(b for what, b, _ in events if what == "launch")
    fig, ax = plt.subplots(figsize=(8, 1.2 + 0.35 * n))
    ax.barh(0, end, left=0, color="tab:blue", label="backward (autograd)")
    for what, b, t in events:
        if what == "grad ready":
            ax.plot([(t - t0) * 1e3] * 2, [-0.35, 0.35], color="white", lw=0.6)
    for b in range(n):
        start, done = ms[("launch", b)], ms.get(("done", b), ms[("synced", None)])
        label = "bucket all-reduce: launch to done\n(includes queueing behind\nearlier buckets)"
        ax.barh(1 + b, max(done - start, 1e-3), left=start, color="tab:orange", label=label if b == 0 else None)
    ax.axvline(end, color="gray", ls="--", lw=1)
    ax.set_yticks(range(n + 1), ["backward"] + [f"bucket {b}" for b in range(n)])
    ax.invert_yaxis()
    ax.set_xlabel("time since backward started (ms)")
    ax.set_title(title)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
    fig.tight_layout()
    plt.show()
    plt.close(fig)


# -- reading a recorded backward (11_capstone_micro_ddp's "Going further": overlap on a timeline) --------------

def timeline_facts(events):
    """What one backward recorded by ``MicroDDP.events`` shows, in ms since backward started (as ``plot_timeline``
    draws it): ``backward_ms`` (the blue bar: until ``finish`` ran), ``last_grad_ms`` (the last white tick),
    ``launch_ms`` (when each bucket's all-reduce started, by bucket), ``early`` (how many of them started before the
    last gradient was ready), ``wait_ms`` (from the end of backward to the end of the last orange bar, a bucket's
    "done", as drawn: the dashed line to the end of the last bar; 0 when every bar ended before it) and
    ``total_ms`` (the end of the blue bar plus that wait). One definition for the plot and the printed numbers
    (tests/test_micro_ddp.py: test_the_printed_wait_is_the_drawn_one)."""
    t0 = next(t for what, _, t in events if what == "backward start")
    first = {}
    for what, b, t in events:
        first.setdefault((what, b), (t - t0) * 1e3)
    last_grad = max((t - t0) * 1e3 for what, _, t in events if what == "grad ready")
    launches = [first[key] for key in sorted(k for k in first if k[0] == "launch")]
    end, synced = first[("backward end", None)], first[("synced", None)]
    bars_end = max((first.get(("done", b), synced) for what, b in first if what == "launch"), default=end)
    wait = max(bars_end - end, 0.0)            # plot_timeline draws a bar without "done" up to "synced"
    return {"backward_ms": end, "last_grad_ms": last_grad, "launch_ms": launches,
            "early": sum(t < last_grad for t in launches), "wait_ms": wait, "total_ms": end + wait}


def median_backward(timelines):
    """Of an odd number of recorded backwards (``MicroDDP.events`` lists), the one whose wait after backward is the
    median: a backward that really happened, so that its plot shows the very numbers printed beside it (the median
    of an even number is the mean of two backwards, and "the median backward by duration" is another backward)."""
    if len(timelines) % 2 == 0:
        raise ValueError(f"median_backward needs an odd number of backwards, got {len(timelines)}")
    return sorted(timelines, key=lambda events: timeline_facts(events)["wait_ms"])[len(timelines) // 2]


def overlap_verdict(rebuilt, guess, n_backwards):
    """Two sentences about the plotted backwards (``timeline_facts`` of each layout's ``median_backward``): what
    the plots show, and whether starting early made the wait after backward shorter. Chosen from the numbers, as
    one line each for "Measured here:". Introduced in 11_capstone_micro_ddp."""

    def started(facts, layout):
        if facts["early"] == 0:
            return (f"with the {layout} layout no bucket's all-reduce started before backward's last gradient (the "
                    "last white tick)")
        lead = facts["last_grad_ms"] - facts["launch_ms"][0]
        return (f"with the {layout} layout {facts['early']} of {len(facts['launch_ms'])} buckets started before "
                f"backward's last gradient, the first {lead:.1f} ms before it")

    plots = f"in the plots, {started(guess, 'guessed')}; {started(rebuilt, 'rebuilt')}."
    if guess["early"] == 0 < rebuilt["early"]:
        plots += (" The guessed layout's bucket 0 waited for `embed`, the last gradient, and the later buckets for "
                  "bucket 0; the rebuilt layout's buckets follow the order the gradients arrived in.")
    numbers = (f"the wait after backward: {rebuilt['wait_ms']:.1f} ms rebuilt, {guess['wait_ms']:.1f} ms guessed; "
               f"that backward {rebuilt['total_ms'] / guess['total_ms']:.2f}x the guessed one's; each plotted "
               f"backward is the median of {n_backwards} by its wait")
    shorter = 1 - rebuilt["wait_ms"] / guess["wait_ms"] if guess["wait_ms"] > 0 else 0.0
    if rebuilt["wait_ms"] < 0.8 * guess["wait_ms"]:
        verdict = (f"with the rebuilt buckets the wait after backward was {100 * shorter:.0f}% shorter ({numbers}): "
                   "part of the communication was done by the time backward ended.")
    elif rebuilt["wait_ms"] <= 1.25 * guess["wait_ms"]:
        verdict = (f"the wait after backward was about as long with the rebuilt buckets as with the guessed ones "
                   f"({numbers}): the all-reduces started earlier, but on shared CPU cores they did not finish "
                   "earlier.")
    else:
        verdict = (f"with the rebuilt buckets the wait after backward was "
                   f"{100 * (rebuilt['wait_ms'] / guess['wait_ms'] - 1):.0f}% longer ({numbers}): on shared CPU "
                   "cores the early all-reduces competed with backward for the cores.")
    return plots[0].upper() + plots[1:], verdict
