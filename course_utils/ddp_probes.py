"""Recording and plotting plumbing for looking inside torch DDP (lessons 06 and 07).

The hooks that teach something (the counting comm hook of 06, the bucket-recording hook of
07) are written in the notebooks; this module only holds what records, summarises and draws:

* ``GradReadyRecorder``: when each parameter's gradient is ready during backward.
* ``BucketLog``: a state object for a comm hook that records each bucket it sees.
* ``overlap``: how much of the communication ran while backward was still computing.
* ``step_parts``, ``typical_step``, ``typical_steps``, ``typical_time``, ``compare_in_turns``, ``parts_table``: a
  step's parts that add up, the typical step of many, two setups timed in turns compared, and their table.
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


def step_parts(tl):
    """One step of a lesson-07 timeline split into parts that add up to it, in seconds.

    ``tl`` is a dict with ``t0`` (backward starts), ``grads`` (``[(name, t), ...]``, in ready order), ``comm``
    (``[(label, start, end), ...]``) and ``end`` (every gradient reduced). Returns ``total`` = ``compute`` (``t0`` to
    the last gradient) + ``exposed`` (communication after the last gradient) + ``rest`` (the rest of the step after
    the last gradient: DDP's copies back, waiting); ``hidden`` and ``comm`` (the communication inside the compute
    window, and all of it) are not parts: hidden communication ran during ``compute``. Introduced in
    07_buckets_and_overlap.
    """
    last = tl["grads"][-1][1]
    ov = overlap((tl["t0"], last), [(a, b) for _, a, b in tl["comm"]])
    total, compute = tl["end"] - tl["t0"], last - tl["t0"]
    return {"total": total, "compute": compute, "exposed": ov["exposed_s"],
            "rest": max(total - compute - ov["exposed_s"], 0.0), "hidden": ov["hidden_s"], "comm": ov["comm_s"]}


def typical_steps(runs):
    """Lesson 07's timelines summarised: ``runs`` maps a name to its list of timelines (``step_parts``'s input).
    Returns ``(parts, stats, shown)``, per name: every step's parts, the typical step (``typical_step``), and the
    timeline whose step time is closest to the typical one (the one to draw). Introduced in 07_buckets_and_overlap."""
    parts = {name: [step_parts(tl) for tl in tls] for name, tls in runs.items()}
    stats = {name: typical_step(p) for name, p in parts.items()}
    shown = {name: min(tls, key=lambda tl: abs(tl["end"] - tl["t0"] - stats[name]["total"]))
             for name, tls in runs.items()}
    return parts, stats, shown


def parts_table(stats, label="typical step"):
    """Lesson 07's table of typical steps (``typical_step`` dicts by name): ``step = compute + comm exposed + rest``,
    and the communication hidden inside ``compute``, in ms. Introduced in 07_buckets_and_overlap."""
    columns = ("total", "compute", "exposed", "rest", "hidden")
    return table([label, "step", "= compute", "+ comm exposed", "+ rest", "comm hidden"],
                 [[name] + [f"{s[c] * 1e3:8.1f} ms" for c in columns] for name, s in stats.items()])


def _middle_half(totals):
    """Indices of the steps between the fastest and the slowest quarter, by total time."""
    order = sorted(range(len(totals)), key=lambda i: totals[i])
    cut = len(order) // 4
    return order[cut:len(order) - cut] if len(order) > 2 else order


def typical_step(steps):
    """The typical step of ``steps`` (a list of ``step_parts`` dicts): every part averaged over the same steps, the
    middle half by total time (the fastest and the slowest quarter left out, so one preempted step does not count).
    Unlike medians taken part by part, these parts add up: ``compute + exposed + rest == total``. Introduced in
    07_buckets_and_overlap."""
    keep = _middle_half([s["total"] for s in steps])
    return {k: sum(steps[i][k] for i in keep) / len(keep) for k in steps[0]}


def typical_time(seconds):
    """The typical one of ``seconds`` (step times): the mean of their middle half, the fastest and the slowest
    quarter left out. Introduced in 07_buckets_and_overlap."""
    keep = _middle_half(seconds)
    return sum(seconds[i] for i in keep) / len(keep)


def compare_in_turns(base, other):
    """Step times of two setups timed in turns (``base[i]`` and ``other[i]`` in the same round, seconds): the time
    ``other`` saves against ``base`` per typical step (the mean of the middle half of each), as seconds and as a
    fraction of ``base``'s step, how many rounds ``other`` won, and the verdict of a sign test over the rounds:
    ``"faster"`` or ``"slower"`` when ``other`` won or lost at least 3 in 4 rounds and the typical steps agree, else
    ``"no measurable difference"``. Introduced in 07_buckets_and_overlap."""
    assert len(base) == len(other) and base, "two lists of step times, one per round, timed in turns"
    saved = typical_time(base) - typical_time(other)
    won, n = sum(o < b for b, o in zip(base, other)), len(base)
    if 4 * won >= 3 * n and saved > 0:
        verdict = "faster"
    elif 4 * won <= n and saved < 0:
        verdict = "slower"
    else:
        verdict = "no measurable difference"
    return {"saved_s": saved, "saved_fraction": saved / typical_time(base), "won": won, "rounds": n, "verdict": verdict}


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
