"""MicroDDP: the course's own DistributedDataParallel, small enough to read in one sitting.

Introduced in 11_capstone_micro_ddp, where the learner writes it piece by piece; this is the
reference solution. It does what torch's DDP does for a model whose parameters all take part
in every backward:

1. at construction, broadcast rank 0's parameters and buffers, so every replica starts equal;
2. group the parameters into buckets in REVERSE order (backward produces the last layer's
   gradients first), a bucket closing once it holds ``bucket_cap_mb`` MiB;
3. one hook per parameter (``register_post_accumulate_grad_hook``) copies its gradient into its
   bucket; a full bucket starts an asynchronous all-reduce while backward goes on;
4. a callback queued on the autograd engine waits for every bucket at the end of backward, so
   when ``loss.backward()`` returns, every ``.grad`` holds the average over the ranks;
5. ``no_sync()`` skips all of it: gradients accumulate locally until the next synced backward.

The compressor decides what goes on the wire: ``None`` (fp32), ``"fp16"``, ``"bf16"`` or
``"powersgd"`` (rank-r factors with error feedback), or any object with the same ``start``.
"""
import contextlib
import time

import torch
import torch.distributed as dist
from torch import nn


def broadcast_state(module, group=None):
    """Overwrite every rank's parameters and buffers with those of the group's rank 0, in place."""
    src = 0 if group is None else dist.get_global_rank(group, 0)
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            dist.broadcast(t, src, group=group)


def assign_buckets(params, bucket_cap_mb=25):
    """Lists of indices into ``params``, walking them in reverse: a bucket closes once it holds
    ``bucket_cap_mb`` MiB (so it may overflow by one parameter) or when the dtype changes."""
    cap = bucket_cap_mb * 1024 * 1024
    buckets, current, size = [], [], 0
    for i in reversed(range(len(params))):
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


class Bucket:
    """Some parameters and one flat buffer that holds their gradients side by side."""

    def __init__(self, index, params):
        self.index, self.params = index, params
        self.offsets, n = [], 0
        for p in params:
            self.offsets.append(n)
            n += p.numel()
        self.buffer = torch.zeros(n, dtype=params[0].dtype, device=params[0].device)
        self.ready = 0         # parameters whose gradient is in the buffer, this backward
        self.pending = None    # (work, then) while the all-reduce is in flight

    def view(self, i):
        """The slice of the buffer that belongs to parameter ``i``, shaped like it."""
        p = self.params[i]
        return self.buffer[self.offsets[i]:self.offsets[i] + p.numel()].view_as(p)


class MicroDDP(nn.Module):
    """Wrap ``module`` so that ``loss.backward()`` leaves the average gradient on every rank.

    Introduced in 11_capstone_micro_ddp::

        model = MicroDDP(make_model(seed=rank), bucket_cap_mb=25, compressor=None)
        loss_fn(model(x), y).backward()      # .grad now holds the average over the ranks
        with model.no_sync():                # wrap forward AND backward, as with torch DDP
            loss_fn(model(x), y).backward()  # local accumulation only

    Set ``model.events = []`` to record a timeline (see ``plot_timeline``), ``None`` to stop.
    """

    def __init__(self, module, bucket_cap_mb=25, compressor=None, process_group=None):
        super().__init__()
        self.module = module
        self.group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.compressor = make_compressor(compressor)
        self.require_backward_grad_sync = True
        self.events = None
        broadcast_state(module, process_group)  # replicas must start equal, or they never agree
        params = [p for p in module.parameters() if p.requires_grad]
        self._names = {p: name for name, p in module.named_parameters()}
        self.buckets = [Bucket(b, [params[i] for i in idx])
                        for b, idx in enumerate(assign_buckets(params, bucket_cap_mb))]
        self._slot = {}  # parameter -> (bucket, position in the bucket)
        for bucket in self.buckets:
            for i, p in enumerate(bucket.params):
                self._slot[p] = (bucket, i)
                p.register_post_accumulate_grad_hook(self._grad_ready)
        self._sync = True
        self._reset()

    def _reset(self):
        self._next = 0          # the next bucket to launch: every rank launches in the same order
        self._queued = False    # is _finish queued on the autograd engine for this backward?
        self._seen = set()      # parameters whose hook fired in this backward
        for bucket in self.buckets:
            bucket.ready, bucket.pending = 0, None

    def forward(self, *args, **kwargs):
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
            self.require_backward_grad_sync = old

    def _grad_ready(self, p):  # runs inside backward, right after p.grad was accumulated
        if not self._sync:
            return
        if not self._queued:  # first hook of this backward: wait for the buckets when it ends
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        bucket, i = self._slot[p]
        bucket.view(i).copy_(p.grad)
        bucket.ready += 1
        self._seen.add(p)
        self._record("grad ready", bucket.index)
        while self._next < len(self.buckets) and self._full(self.buckets[self._next]):
            self._launch(self.buckets[self._next])
            self._next += 1

    @staticmethod
    def _full(bucket):
        return bucket.ready == len(bucket.params)

    def _launch(self, bucket):
        self._record("launch", bucket.index)
        work, then = self.compressor.start(bucket.buffer, bucket, self.group)  # async: returns at once
        bucket.pending = (work, then)
        if self.events is not None:
            work.get_future().add_done_callback(lambda fut, b=bucket.index: self._record("done", b))

    def _finish(self):  # queued on the autograd engine: runs when backward has computed every grad
        self._record("backward end")
        launched = self.buckets[:self._next]
        for bucket in launched:
            work, then = bucket.pending
            work.wait()
            if then is not None:
                then()  # e.g. cast fp16 back to fp32, or PowerSGD's second round
            for i, p in enumerate(bucket.params):
                p.grad.copy_(bucket.view(i))
        missing = [self._names[p] for b in self.buckets[self._next:] for p in b.params if p not in self._seen]
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


# -- compressors: start(flat, bucket, group) -> (async work, then-callable or None) --------------

class AllReduce:
    """No compression: divide by world size, then SUM in fp32 (torch DDP's default)."""

    name = "none"

    def start(self, flat, bucket, group):
        flat.div_(dist.get_world_size(group))
        return dist.all_reduce(flat, group=group, async_op=True), None


class Cast:
    """Send fp16 or bf16: half the bytes. Divide BEFORE casting: fp16 overflows past 65504."""

    def __init__(self, dtype):
        self.dtype = dtype
        self.name = {torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]

    def start(self, flat, bucket, group):
        low = flat.div(dist.get_world_size(group)).to(self.dtype)
        work = dist.all_reduce(low, group=group, async_op=True)
        return work, lambda: flat.copy_(low)


class PowerSGD:
    """Low-rank compression with error feedback (Vogels et al. 2019), as torch's powerSGD_hook.

    A gradient matrix M (m x n) is sent as P = M Q (m x r) and Q = M^T P (n x r): (m + n) r numbers
    instead of m n. What the approximation missed is added to the next step's gradient (error
    feedback). Vectors, and matrices too small to gain, go uncompressed. The first
    ``warmup_steps`` reductions of each bucket are plain all-reduces.
    """

    name = "powersgd"

    def __init__(self, rank=2, warmup_steps=0, seed=0):
        self.rank, self.warmup_steps, self.seed = rank, warmup_steps, seed
        self.errors, self.qs, self.calls = {}, {}, {}

    def _compress(self, p):
        m, n = p.shape[0], p.numel() // p.shape[0]
        return p.dim() >= 2 and (m + n) * self.rank < m * n

    def start(self, flat, bucket, group):
        ws = dist.get_world_size(group)
        b = bucket.index
        self.calls[b] = self.calls.get(b, 0) + 1
        if self.calls[b] <= self.warmup_steps:
            return AllReduce().start(flat, bucket, group)
        low_rank = [i for i, p in enumerate(bucket.params) if self._compress(p)]
        full = [i for i, p in enumerate(bucket.params) if not self._compress(p)]
        if b not in self.errors:
            self.errors[b] = torch.zeros_like(flat)
            g = torch.Generator().manual_seed(self.seed + b)  # the same Q on every rank
            self.qs[b] = [torch.randn(bucket.params[i].numel() // bucket.params[i].shape[0], self.rank,
                                      generator=g).to(flat) for i in low_rank]
        flat.add_(self.errors[b])                          # M = gradient + what last step missed
        mats = [bucket.view(i).reshape(bucket.params[i].shape[0], -1) for i in low_rank]  # views of flat
        vecs = [bucket.view(i) for i in full]
        ps = [m @ q for m, q in zip(mats, self.qs[b])]
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
            for j, (i, m, p, q) in enumerate(zip(low_rank, mats, ps_avg, qmsg.split([q.numel() for q in qs]))):
                q = q.view(m.shape[1], self.rank)
                self.qs[b][j] = q.clone()                  # warm start for the next step
                approx = p @ q.t()                         # the same on every rank
                self.errors[b][bucket.offsets[i]:bucket.offsets[i] + m.numel()].copy_((m - approx).reshape(-1))
                m.copy_(approx)
        return work, then


def make_compressor(spec):
    """``None``/"none", "fp16", "bf16", "powersgd", or an object with a ``start`` method."""
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
            dt = time.perf_counter() - t0
            if s >= warmup:
                times[k].append(dt)
    local = torch.tensor([statistics.median(t) for t in times], dtype=torch.float64)
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
        ax.barh(1 + b, max(done - start, 1e-3), left=start, color="tab:orange",
                label="bucket all-reduce (launch to done)" if b == 0 else None)
    ax.axvline(end, color="gray", ls="--", lw=1)
    ax.set_yticks(range(n + 1), ["backward"] + [f"bucket {b}" for b in range(n)])
    ax.invert_yaxis()
    ax.set_xlabel("time since backward started (ms)")
    ax.set_title(title)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
    fig.tight_layout()
    plt.show()
    plt.close(fig)
