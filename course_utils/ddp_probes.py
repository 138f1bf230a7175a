"""Recording and plotting plumbing for looking inside torch DDP (lessons 06 and 07).

The hooks that teach something (the counting comm hook of 06, the bucket-recording hook of
07) are written in the notebooks; this module only holds what records, summarises and draws:

* ``GradReadyRecorder``: when each parameter's gradient is ready during backward.
* ``BucketLog``: a state object for a comm hook that records each bucket it sees.
* ``overlap``: how much of the communication ran while backward was still computing.
* ``plot_timelines``: backward compute against each bucket's all-reduce.
* ``grad_storage``: gradient bytes held apart from DDP's bucket buffers.
* ``step_time``: median wall time of a training step.
* ``table``: a plain-text table.
"""
import re
import statistics
import time

import torch


_NUMBER = re.compile(r"-?[\d,.]+( [A-Za-z/]+)?")  # 1,234 / 0.25 / 12.3 ms


def ring_bytes_per_rank(payload_bytes, world_size):
    """Bytes each rank sends in a ring all-reduce of ``payload_bytes``: 2(n-1)/n x S.

    Introduced in 06_ddp_accumulation_no_sync (the bound itself is derived in 03_all_reduce_by_hand).
    """
    return 2 * (world_size - 1) * payload_bytes // world_size


def table(headers, rows):
    """A plain-text table; columns of numbers are right-aligned. Introduced in 06_ddp_accumulation_no_sync."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    numeric = [i > 0 and all(_NUMBER.fullmatch(r[i].strip()) for r in cells[1:]) for i in range(len(headers))]
    lines = []
    for j, r in enumerate(cells):
        parts = [c.rjust(w) if num else c.ljust(w) for c, w, num in zip(r, widths, numeric)]
        lines.append(" | ".join(parts).rstrip())
        if j == 0:
            lines.append("-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def step_time(step, n=10, warmup=2):
    """Median wall time in seconds of ``step()`` over ``n`` calls after ``warmup`` calls.

    Every rank calls ``step`` the same number of times, so collectives inside it stay matched.
    Introduced in 06_ddp_accumulation_no_sync.
    """
    for _ in range(warmup):
        step()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class GradReadyRecorder:
    """Records the time each parameter's gradient is accumulated during backward.

    Uses ``Tensor.register_post_accumulate_grad_hook``, which fires after ``param.grad`` is
    written: the moment the gradient is "ready" for DDP. ``events`` is a list of
    ``(name, perf_counter time)`` in the order backward produced them.

        rec = GradReadyRecorder(model)      # model: a module or a DDP wrapper
        rec.clear(); loss.backward(); rec.events

    Introduced in 07_buckets_and_overlap.
    """

    def __init__(self, model):
        module = getattr(model, "module", model)
        self.events = []
        self._handles = []
        for name, p in module.named_parameters():
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(self._hook(name)))

    def _hook(self, name):
        def hook(param):
            self.events.append((name, time.perf_counter()))
        return hook

    def clear(self):
        self.events = []

    def order(self):
        """Parameter names in the order their gradients became ready."""
        return [name for name, _ in self.events]

    def remove(self):
        for h in self._handles:
            h.remove()
        self._handles = []


class BucketLog:
    """State for a comm hook that records every bucket DDP hands it.

    ``names`` maps ``id(param)`` to the parameter's name; the hook appends one dict per bucket
    to ``records`` (keys chosen by the hook, e.g. ``iteration``, ``index``, ``numel``,
    ``params``, ``start``, ``end``); the training loop sets ``iteration``.

    Introduced in 07_buckets_and_overlap.
    """

    def __init__(self, model):
        module = getattr(model, "module", model)
        self.names = {id(p): n for n, p in module.named_parameters()}
        self.iteration = 0
        self.records = []
        self.buffers = {}  # bucket index -> the bucket's flat buffer (latest seen)

    def layout(self, iteration):
        """``[(index, numel, [param names]), ...]`` of the buckets seen in ``iteration``, by index."""
        recs = sorted((r for r in self.records if r["iteration"] == iteration), key=lambda r: r["index"])
        return [(r["index"], r["numel"], list(r["params"])) for r in recs]

    def intervals(self, iteration):
        """``[(index, start, end), ...]`` of the all-reduces of ``iteration``, in launch order."""
        recs = sorted((r for r in self.records if r["iteration"] == iteration), key=lambda r: r["start"])
        return [(r["index"], r["start"], r["end"]) for r in recs]


def describe_cap_sweep(caps, buckets, seconds, close=0.05):
    """One sentence on lesson 07's ``bucket_cap_mb`` sweep, chosen from its numbers: which cap was fastest, and
    whether overlapping (several buckets) paid against one bucket that overlaps nothing. ``seconds`` are median
    forward+backward times; runs within ``close`` (5%) of each other count as a tie. Introduced in
    07_buckets_and_overlap."""
    fastest = min(range(len(caps)), key=lambda i: seconds[i])
    slowest = max(range(len(caps)), key=lambda i: seconds[i])
    one = buckets.index(1) if 1 in buckets else None
    spread = seconds[slowest] / seconds[fastest] - 1
    name = f"bucket_cap_mb={caps[fastest]:g} ({buckets[fastest]} bucket{'s' if buckets[fastest] > 1 else ''})"
    if spread < close:
        return (f"every cap took within {close:.0%} of the others (fastest {name}, {spread:.0%} ahead of the "
                "slowest): on this machine the bucket size made no measurable difference.")
    text = f"the fastest was {name}, {spread:.0%} faster than the slowest, bucket_cap_mb={caps[slowest]:g}"
    if one is None:
        return text + "."
    if fastest == one:
        return (text + ": one bucket, which overlaps nothing with backward, won here: on shared CPU cores the "
                "all-reduces running during backward slowed it more than overlap saved, and every extra message "
                "paid its latency.")
    gain = seconds[one] / seconds[fastest] - 1
    if gain < close:
        return (text + f"; within {close:.0%} of one bucket (bucket_cap_mb={caps[one]:g}, no overlap), so overlap "
                "barely paid here.")
    return (text + f"; {gain:.0%} faster than one bucket (bucket_cap_mb={caps[one]:g}, no overlap): overlapping "
            "the all-reduces with backward paid more than the extra messages cost.")


def short_names(names, width=60):
    """'0.weight, 0.bias, 2.weight' shortened to ``width`` characters."""
    text = ", ".join(names)
    return text if len(text) <= width else text[: width - 3] + "..."


def _merge(intervals):
    out = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def overlap(compute, comm):
    """How much communication ran while backward was computing.

    ``compute``: ``(start, end)`` of backward's compute (from its start to the last gradient
    ready); ``comm``: a list of ``(start, end)`` all-reduce intervals. Returns a dict with
    ``comm_s`` (length of the union of the comm intervals), ``hidden_s`` (the part of it inside
    ``compute``), ``exposed_s`` (``comm_s - hidden_s``) and ``hidden_fraction``.

    Introduced in 07_buckets_and_overlap.
    """
    c0, c1 = compute
    merged = _merge(comm)
    comm_s = sum(b - a for a, b in merged)
    hidden_s = sum(max(0.0, min(b, c1) - max(a, c0)) for a, b in merged)
    return {"comm_s": comm_s, "hidden_s": hidden_s, "exposed_s": comm_s - hidden_s,
            "hidden_fraction": hidden_s / comm_s if comm_s > 0 else 0.0}


def plot_timelines(timelines, titles, figsize=(9, 2.4)):
    """One panel per timeline: backward compute on top, one bar per bucket all-reduce below.

    Each timeline is a dict with ``t0`` (backward start), ``grads`` (``[(name, t), ...]``
    from ``GradReadyRecorder``), ``comm`` (``[(label, start, end), ...]``) and ``end`` (when
    the step's gradients were all reduced). Times are shown in ms from ``t0``; every panel
    shares the same x axis so the lengths compare. Returns the figure.

    Introduced in 07_buckets_and_overlap.
    """
    import matplotlib.pyplot as plt

    n = len(timelines)
    rows = [1 + len(tl["comm"]) for tl in timelines]
    fig, axes = plt.subplots(n, 1, figsize=(figsize[0], figsize[1] * n), sharex=True,
                             gridspec_kw={"height_ratios": rows}, squeeze=False)
    for ax, tl, title in zip(axes[:, 0], timelines, titles):
        t0 = tl["t0"]
        ms = lambda t: (t - t0) * 1e3
        last = tl["grads"][-1][1] if tl["grads"] else t0
        ax.barh(0, ms(last), left=0, height=0.6, color="tab:blue", alpha=0.35, label="backward compute")
        for j, (_, t) in enumerate(tl["grads"]):
            ax.plot([ms(t)] * 2, [-0.3, 0.3], color="tab:blue", lw=0.8, label="a gradient ready" if j == 0 else None)
        labels = ["backward"]
        for i, (label, a, b) in enumerate(tl["comm"], start=1):
            ax.barh(i, ms(b) - ms(a), left=ms(a), height=0.6, color="tab:orange",
                    label="bucket: hook call to done (includes queueing behind earlier buckets)" if i == 1 else None)
            labels.append(label)
        ax.axvline(ms(last), color="tab:blue", ls="--", lw=0.8)
        ax.axvline(ms(tl["end"]), color="k", ls=":", lw=1, label="all gradients reduced")
        ax.set_yticks(range(len(labels)))
        ax.set_yticklabels(labels)
        ax.invert_yaxis()
        ax.set_title(title, fontsize=10)
    axes[-1, 0].set_xlabel("time since backward started (ms)")
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=3, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.3 / (figsize[1] * n)))
    return fig


def _storage_span(t):
    s = t.untyped_storage()
    return s.data_ptr(), s.data_ptr() + s.nbytes()


def grad_storage(model, buffers):
    """Gradient memory of ``model`` measured against DDP's bucket ``buffers``.

    Returns a dict: ``grad_bytes`` (bytes of all ``param.grad``), ``bucket_bytes`` (bytes of
    the distinct bucket buffers' storages) and ``grad_bytes_outside_buckets`` (gradient
    bytes whose storage is not one of the bucket buffers: the copy that
    ``gradient_as_bucket_view=True`` removes). Storages are compared by address, so a
    gradient counts as "inside" only if it really is a view of a bucket buffer.

    Introduced in 07_buckets_and_overlap.
    """
    module = getattr(model, "module", model)
    spans = {_storage_span(b) for b in buffers}
    grad_bytes = outside = 0
    for p in module.parameters():
        if p.grad is None:
            continue
        nbytes = p.grad.numel() * p.grad.element_size()
        grad_bytes += nbytes
        if _storage_span(p.grad) not in spans:
            outside += nbytes
    bucket_bytes = sum(b - a for a, b in spans)
    return {"grad_bytes": grad_bytes, "bucket_bytes": bucket_bytes, "grad_bytes_outside_buckets": outside}


def tensors_equal_across_ranks(tensors, group=None):
    """True if every rank holds bit-identical ``tensors`` (compares rank 0's copy, broadcast).

    Introduced in 06_ddp_accumulation_no_sync.
    """
    import torch.distributed as dist

    flat = torch.cat([t.detach().reshape(-1).float() for t in tensors])
    ref = flat.clone()
    dist.broadcast(ref, src=0, group=group)
    same = torch.tensor([int(torch.equal(flat, ref))])
    dist.all_reduce(same, op=dist.ReduceOp.MIN, group=group)
    return bool(same.item())


# -- exercises of lessons 06 and 07: self-checks and the course's solutions ----------------------
def accumulate_with_flag(model, batches):
    """The course's solution of 06's exercise 2: one all-reduce for ``len(batches)`` micro-batches,
    with ``require_backward_grad_sync`` set by hand (no ``no_sync()``).

    Introduced in 06_ddp_accumulation_no_sync (used when ``USE_SOLUTION = True``)."""
    import torch.nn.functional as F

    K = len(batches)
    for k, (xb, yb) in enumerate(batches):
        model.require_backward_grad_sync = (k == K - 1)     # before the forward: DDP reads it there
        (F.mse_loss(model(xb), yb) / K).backward()


def _count_sync(accum_steps, use_no_sync, seed=0):
    """On every rank: all-reduces and bytes handed to them in one optimizer step of accum_steps micro-steps on a
    DDP-wrapped TinyMLP, with ``no_sync()`` around the first K-1 forwards and backwards or without it."""
    from contextlib import nullcontext

    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from course_utils.data import make_regression
    from course_utils.models import make_model

    counter = {"all_reduces": 0, "bytes": 0}

    def hook(state, bucket):
        state["all_reduces"] += 1
        state["bytes"] += bucket.buffer().numel() * bucket.buffer().element_size()
        buf = bucket.buffer().div_(dist.get_world_size())
        return dist.all_reduce(buf, async_op=True).get_future().then(lambda f: f.value()[0])

    model = DDP(make_model(seed=0))
    model.register_comm_hook(counter, hook)
    x, y = make_regression(n=16 * dist.get_world_size() * accum_steps, d_in=16, seed=seed)
    xs, ys = x.chunk(dist.get_world_size())[dist.get_rank()], y.chunk(dist.get_world_size())[dist.get_rank()]
    for k, (xb, yb) in enumerate(zip(xs.chunk(accum_steps), ys.chunk(accum_steps))):
        last = k == accum_steps - 1
        with nullcontext() if (last or not use_no_sync) else model.no_sync():
            (F.mse_loss(model(xb), yb) / accum_steps).backward()
    return counter, sum(p.numel() * p.element_size() for p in model.parameters())


def solution_sync_prediction(accum_steps=8):
    """06's exercise 1, the course's answer: K all-reduces of the whole gradient without no_sync, one with it."""
    from course_utils.models import make_model

    grad_bytes = sum(p.numel() * p.element_size() for p in make_model(seed=0).parameters())
    return ({"without no_sync": accum_steps, "with no_sync": 1},
            {"without no_sync": accum_steps * grad_bytes, "with no_sync": grad_bytes})


def check_sync_prediction(predicted, predicted_bytes, accum_steps=8):
    """Self-check of 06's exercise 1; call it on every rank (inside a ``%%ddp`` cell). ``predicted`` and
    ``predicted_bytes`` map "without no_sync" and "with no_sync" to the all-reduces per optimizer step of
    ``accum_steps`` micro-steps, and to the bytes handed to them; both runs are counted here, on this lesson's
    ranks. Raises ``AssertionError`` saying what is wrong (never the number); rank 0 prints one line when both
    are right. Introduced in 06_ddp_accumulation_no_sync."""
    __tracebackhide__ = True
    import torch.distributed as dist

    keys = ("without no_sync", "with no_sync")
    for name, value in (("predicted", predicted), ("predicted_bytes", predicted_bytes)):
        if not isinstance(value, dict) or set(value) != set(keys):
            raise AssertionError(f"{name} must be a dict with the keys {list(keys)}, got {value!r}.")
        missing = [k for k in keys if value[k] is None]
        if missing:
            raise AssertionError(f"{name}: fill in your prediction for {missing} (numbers, for accum_steps = "
                                 f"{accum_steps}), then run the cell.")
    measured = {k: _count_sync(accum_steps, use_no_sync=(k == "with no_sync")) for k in keys}
    grad_bytes = measured["with no_sync"][1]
    for k in keys:
        got = measured[k][0]["all_reduces"]
        if predicted[k] != got:
            why = ("DDP arms the reduction in every forward that runs outside no_sync(), and this model's "
                   "gradients fit in one bucket: how many backwards reduced?" if k == "without no_sync" else
                   "inside no_sync() DDP only accumulates; which micro-step's forward and backward ran outside it?")
            raise AssertionError(f"{k}: you predicted {predicted[k]} all-reduces per step, the ranks counted "
                                 f"otherwise. {why}")
    for k in keys:
        got = measured[k][0]["bytes"]
        if predicted_bytes[k] != got:
            raise AssertionError(f"{k}: you predicted {predicted_bytes[k]!r} bytes, the ranks counted otherwise. "
                                 f"Each all-reduce hands the whole gradient over: one float32 per parameter "
                                 f"({grad_bytes // 4:,} parameters here, 4 bytes each), times the all-reduces.")
    if dist.get_rank() == 0:
        print(f"self-check passed: both predictions match what the ranks counted for accum_steps = {accum_steps}")


def check_accumulate(accumulate, accum_steps=4, seed=0):
    """Self-check of 06's exercise 2; call it on every rank (inside a ``%%ddp`` cell).

    ``accumulate(model, batches)`` must run forward and backward over the micro-batches of
    ``batches`` (a list of ``(x, y)``) with exactly ONE all-reduce, at the last micro-step, by
    setting ``model.require_backward_grad_sync`` itself (not with ``model.no_sync()``), and leave
    in ``.grad`` the gradient of the mean loss over every rank's samples. Raises
    ``AssertionError`` saying what is wrong; rank 0 prints one line when it is right.

    Introduced in 06_ddp_accumulation_no_sync.
    """
    __tracebackhide__ = True
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from course_utils.data import make_regression
    from course_utils.models import make_model

    rank, world = dist.get_rank(), dist.get_world_size()
    K = accum_steps
    x, y = make_regression(n=32 * world * K, d_in=16, seed=seed)
    reference = make_model(seed=0)
    F.mse_loss(reference(x), y).backward()                 # one process, the whole batch
    ref = torch.cat([p.grad.reshape(-1) for p in reference.parameters()])

    model = DDP(make_model(seed=0))
    seen = {"forwards": 0, "flags": [], "reduced_at": [], "no_sync": 0}

    def hook(state, bucket):
        state["reduced_at"].append(state["forwards"] - 1)  # the micro-step whose backward reduces
        fut = dist.all_reduce(bucket.buffer().div_(world), async_op=True).get_future()
        return fut.then(lambda f: f.value()[0])

    model.register_comm_hook(seen, hook)

    def before_forward(module, args):
        seen["forwards"] += 1
        seen["flags"].append(bool(module.require_backward_grad_sync))

    model.register_forward_pre_hook(before_forward)
    real_no_sync = model.no_sync

    def recorded_no_sync():
        seen["no_sync"] += 1
        return real_no_sync()

    model.no_sync = recorded_no_sync                       # notice no_sync(): the exercise is without it
    xs, ys = x.chunk(world)[rank], y.chunk(world)[rank]
    batches = list(zip(xs.chunk(K), ys.chunk(K)))
    try:
        accumulate(model, batches)
    except NotImplementedError as exc:
        raise AssertionError(f"accumulate is not written yet ({exc}). Write the loop over the micro-batches, "
                             "then run the cell again.") from None
    if seen["no_sync"]:
        raise AssertionError("accumulate calls model.no_sync(): this exercise asks you to do what no_sync() does "
                             "by setting model.require_backward_grad_sync yourself.")
    if seen["forwards"] != K:
        raise AssertionError(f"accumulate ran {seen['forwards']} forward passes for {K} micro-batches: "
                             "one forward and one backward per micro-batch.")
    reduced_at = seen["reduced_at"]
    if reduced_at != [K - 1]:
        if reduced_at == [0]:
            why = (" The flag each forward saw was " + str(seen["flags"]) + ": you set it AFTER the forward, so "
                   "every forward obeyed the previous micro-step's value. DDP reads the flag in forward: "
                   "set it before calling the model.")
        elif len(reduced_at) == K:
            why = (" The flag was True at every forward: set model.require_backward_grad_sync = False for the "
                   "first K-1 micro-steps and True for the last.")
        elif not reduced_at:
            why = " The flag was never True at a forward: the last micro-step must sync."
        else:
            why = f" The flag each forward saw: {seen['flags']}."
        raise AssertionError(f"{len(reduced_at)} all-reduce(s), at micro-step(s) {reduced_at} of 0..{K - 1}: "
                             f"expected exactly one, at the last micro-step ({K - 1})." + why)
    got = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    if not torch.allclose(got, ref, rtol=1e-4, atol=1e-6):
        scale = float(got.dot(ref) / ref.dot(ref))
        if abs(scale - K) < 1e-2 * K:
            raise AssertionError(f"the gradients are {K} (= accum_steps) times too large: divide each "
                                 "micro-batch's loss by the number of micro-batches before backward().")
        raise AssertionError(f"one all-reduce at the right micro-step, but the gradients differ from the "
                             f"full-batch reference (they are {scale:.3g} times it along its direction): "
                             "each micro-batch's loss divided by K, one backward each?")
    if rank == 0:
        print(f"self-check passed: {K} micro-batches, 1 all-reduce at the last one, the reference gradients")


# The course's answer to 07's exercise 2: bucket 0 of the rebuilt ``Reordered`` model with
# bucket_cap_mb=0.25 (head is used last in forward, so its gradients are ready first).
REORDERED_BUCKET0 = ["head.bias", "head.weight", "blocks.3.bias", "blocks.3.weight"]


def check_bucket0_prediction(predicted, layout, registration):
    """Self-check of 07's exercise 2: is ``predicted`` (a list of parameter names) bucket 0 of the
    rebuilt layout?

    ``layout`` is ``BucketLog.layout(1)`` (``[(index, numel, names), ...]``) and ``registration``
    the names in ``named_parameters()`` order. Raises ``AssertionError`` with a hint; prints
    one line (rank 0 only, inside a ``%%ddp`` cell) when the prediction is right. Introduced in 07_buckets_and_overlap.
    """
    __tracebackhide__ = True
    actual = list(layout[0][2])
    if predicted is None:
        raise AssertionError("predicted_bucket0 is still None: write the parameter names you expect in bucket 0 "
                             "after the rebuild, as a list of strings such as ['embed.weight', ...].")
    predicted = list(predicted)
    unknown = [n for n in predicted if n not in registration]
    if unknown:
        raise AssertionError(f"{unknown} are not parameter names of this model; they are: {registration}.")
    if predicted == actual:
        import torch.distributed as dist

        if not dist.is_initialized() or dist.get_rank() == 0:
            # no names: the stored output of the lesson (USE_SOLUTION = True) must not give the answer away
            print(f"self-check passed: predicted_bucket0 is the bucket 0 DDP rebuilt ({len(actual)} tensors, in order)")
        return
    reverse = registration[::-1]
    if predicted == reverse[:len(predicted)]:
        raise AssertionError("that is the start of the reverse REGISTRATION order. After the rebuild the buckets "
                             "follow the order in which backward produced the gradients: which module does "
                             "forward use last?")
    if predicted == registration[:len(predicted)]:
        raise AssertionError("that is the registration order. Backward runs from the loss towards the input: "
                             "the gradients of the module forward used last are ready first.")
    if set(predicted) == set(actual):
        raise AssertionError("the right parameters, in the wrong order: within a Linear layer, which gradient does "
                             "backward finish first, the bias's or the weight's?")
    if set(predicted) < set(actual):
        raise AssertionError(f"bucket 0 holds more than that: it closes once it reaches bucket_cap_mb "
                             f"({len(actual)} tensors here). Add the next gradients in ready order.")
    if set(actual) < set(predicted):
        raise AssertionError("bucket 0 holds fewer parameters: a bucket closes as soon as its size reaches "
                             "bucket_cap_mb (at or above it): one 256 x 256 fp32 weight is exactly 262,144 bytes, "
                             "0.25 MiB, so it fills a 0.25 MiB bucket on its own, with what came before it.")
    raise AssertionError("not bucket 0. Bucket 0 is filled with the gradients backward produces first, until "
                         "it reaches bucket_cap_mb.")
