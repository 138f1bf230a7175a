"""A step-time model for data-parallel training: alpha-beta communication plus compute.

Introduced in 10_tradeoffs. One training step of W ranks, each running ``accum_steps``
micro-batches of ``micro_batch`` samples through a model of P parameters, then one
all-reduce of the gradient (fp32, 4 bytes per parameter, divided by the compression ratio):

    compute  = accum_steps * (overhead + 6 * P * micro_batch / flop_rate)
    comm     = 2 (W-1) * alpha  +  2 (W-1)/W * bytes * beta          (ring all-reduce; gloo's
               algorithm. NCCL switches to trees, log W latency, for small messages at many ranks)
    exposed  = comm, or max(0, comm - backward of the last micro-step)  with overlap
    step     = compute + exposed + codec + update

6 FLOP per parameter per sample is the usual forward (2) + backward (4) count for
matmul-heavy models. ``alpha`` is the latency of one ring hop, ``beta`` the seconds per byte
of one link (1 / bandwidth). Every figure is calibrated on this machine by ``calibrate``.
The model assumes identical ranks, one device per rank and no contention: the lesson shows
where a real measurement leaves it.
"""
import base64
import dataclasses
import functools
import io
import time

FLOP_PER_PARAM_PER_SAMPLE = 6
BYTES_PER_PARAM = 4  # fp32 gradients
SLIDERS = ("world size", "model size", "bandwidth", "latency", "micro-batch", "accum steps", "compression")


# -- the model ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Calibration:
    """The machine's figures the model needs. Introduced in 10_tradeoffs.

    alpha: s per ring hop; beta: s per byte on one link; flop_rate: FLOP/s of one rank;
    overhead: s per micro-step that does not grow with the batch (Python, kernel launches);
    update_per_param: s per parameter for the optimizer step and gradient copies;
    codec_per_param: s per parameter to compress and decompress a gradient (a bf16 round trip);
    codec_overhead: s per step to compress at all (kernel launches; 0 when not measured);
    world_size: the world size alpha and beta were measured at.
    """
    alpha: float
    beta: float
    flop_rate: float
    overhead: float = 0.0
    update_per_param: float = 0.0
    codec_per_param: float = 0.0
    codec_overhead: float = 0.0
    world_size: int = 2

    @property
    def bandwidth(self):
        """Bytes per second of one link: 1 / beta."""
        return 1.0 / self.beta


@dataclasses.dataclass(frozen=True)
class StepTime:
    """Seconds per optimizer step, split by where they go. Introduced in 10_tradeoffs."""
    compute: float
    comm: float
    exposed: float
    codec: float
    update: float
    total: float
    samples: int

    @property
    def efficiency(self):
        """Scaling efficiency: one rank's step time (no communication) over this step time."""
        return (self.compute + self.update) / self.total

    @property
    def comm_share(self):
        """Fraction of the step spent in exposed communication and compression."""
        return (self.exposed + self.codec) / self.total


def allreduce_time(n_bytes, world_size, alpha, beta):
    """Ring all-reduce: 2(W-1) hops of latency alpha, each rank sends 2(W-1)/W x n_bytes.

    Introduced in 10_tradeoffs (the byte count is lesson 03's bound)."""
    if world_size <= 1:
        return 0.0
    return 2 * (world_size - 1) * alpha + 2 * (world_size - 1) / world_size * n_bytes * beta


def micro_step_time(cal, params, micro_batch):
    """Forward + backward of one micro-batch on one rank."""
    return cal.overhead + FLOP_PER_PARAM_PER_SAMPLE * params * micro_batch / cal.flop_rate


def predict(cal, *, world_size, params, micro_batch, accum_steps=1, compression=1.0, overlap=False):
    """The model's ``StepTime`` for one configuration. Introduced in 10_tradeoffs.

    ``compression``: bytes on the wire are divided by it (2 for bf16/fp16). It costs
    ``codec_overhead + codec_per_param * params`` when above 1. ``overlap``: the all-reduce runs during
    the last micro-step's backward (2/3 of its compute), as DDP's buckets do (lesson 07). It is the ideal
    case: the WHOLE all-reduce may hide behind that backward, as if every byte could leave as soon as
    backward starts and the transfer cost backward nothing; real buckets leave only once full (the last
    one after the last gradient) and, on shared cores, slow the backward they overlap.
    """
    if world_size < 1 or params <= 0 or micro_batch < 1 or accum_steps < 1 or compression < 1:
        raise ValueError("world_size, micro_batch and accum_steps must be >= 1, params > 0, compression >= 1")
    compute = accum_steps * micro_step_time(cal, params, micro_batch)
    n_bytes = BYTES_PER_PARAM * params / compression
    comm = allreduce_time(n_bytes, world_size, cal.alpha, cal.beta)
    hidden = 0.0
    if overlap and world_size > 1:
        hidden = 2 / 3 * FLOP_PER_PARAM_PER_SAMPLE * params * micro_batch / cal.flop_rate
    exposed = max(0.0, comm - hidden)
    codec = cal.codec_overhead + params * cal.codec_per_param if (compression > 1 and world_size > 1) else 0.0
    update = params * cal.update_per_param
    total = compute + exposed + codec + update
    return StepTime(compute, comm, exposed, codec, update, total, world_size * accum_steps * micro_batch)


def break_even_codec(cal, *, compression=2.0, **config):
    """Seconds per parameter that compressing and decompressing may cost before compression stops paying.

    The step time saved by sending ``compression`` times fewer bytes, less the fixed
    ``codec_overhead``, divided by the parameter count: a codec cheaper than this makes the step
    faster. Negative when the bytes saved cannot even pay the overhead (latency-bound or hidden by
    overlap). ``config``: ``predict``'s keywords. Introduced in 10_tradeoffs."""
    free = dataclasses.replace(cal, codec_per_param=0.0)
    plain = predict(free, compression=1.0, **config)
    squeezed = predict(free, compression=compression, **config)
    return (plain.total - squeezed.total) / config["params"]


def ring_and_tree_hops(world_size):
    """Latency terms in units of alpha: the ring's 2(W-1) hops and a binary tree's 2 ceil(log2 W).

    ``allreduce_time`` models the ring only. NCCL switches to trees (double binary trees) for small
    messages and many ranks, whose latency grows with log W; gloo always runs its ring.
    Introduced in 10_tradeoffs."""
    import math

    if world_size <= 1:
        return 0, 0
    return 2 * (world_size - 1), 2 * math.ceil(math.log2(world_size))


# -- calibration ----------------------------------------------------------------------------
def _line(xs, ts, what):
    """t = a + b x by lesson 03's ``bench.fit_call_alpha_beta`` (relative least squares, a kept >= 0).

    A slope that is not positive means the measurements cannot tell the size-dependent part from
    noise: raise instead of inventing a figure."""
    from course_utils.bench import fit_call_alpha_beta as fit_line

    a, b = fit_line(xs, ts)
    if not b > 0:
        raise ValueError(f"{what}: the times do not grow with the size (fitted slope {b:.3g}), so the "
                         "size-dependent cost cannot be told from noise: measure a wider range of sizes "
                         "or more repeats, on a quieter machine")
    return a, b


def fit_hop_alpha_beta(sizes, times, world_size):
    """Fit the ring model to all-reduce times: (alpha s per hop, beta s per byte).

    ``sizes`` in bytes, ``times`` in seconds, measured at ``world_size`` ranks. The line
    t = a + b S is lesson 03's ``bench.fit_call_alpha_beta``; the ring spreads it over 2(W-1) hops
    (a = 2(W-1) alpha) and 2(W-1)/W S bytes per link (b = 2(W-1)/W beta). Introduced in 10_tradeoffs."""
    if world_size < 2:
        raise ValueError("an all-reduce on one rank sends nothing: measure with world_size >= 2")
    a, b = _line(sizes, times, "all-reduce sweep")
    hops = 2 * (world_size - 1)
    return a / hops, b * world_size / hops


def fit_compute(params, micro_batches, times):
    """Fit t = overhead + 6 P mb / flop_rate to forward+backward times: (overhead s, flop_rate FLOP/s)."""
    a, b = _line(micro_batches, times, "forward+backward sweep")
    return a, FLOP_PER_PARAM_PER_SAMPLE * params / b


def _best_time(fn, repeats):
    """Best of ``repeats`` timings: other processes only ever add time, so the minimum is the
    least disturbed estimate of the cost itself."""
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return min(ts)


def measure_allreduce(sizes, repeats=7):
    """Run on every rank: best-of-``repeats`` seconds of ``dist.all_reduce`` of an fp32 tensor of each size.

    A barrier before each call starts the ranks together, so the time is the collective's, not
    another rank's lateness. Introduced in 10_tradeoffs."""
    import torch
    import torch.distributed as dist

    out = []
    for n_bytes in sizes:
        t = torch.ones(max(1, n_bytes // 4))
        dist.all_reduce(t)  # warm-up: connections, buffers

        def once():
            dist.all_reduce(t)
        ts = []
        for _ in range(repeats):
            dist.barrier()
            ts.append(_best_time(once, 1))
        out.append(min(ts))
    return out


def measure_compute(micro_batches, d_in, d_hidden, repeats=5):
    """Run on every rank: best-of-``repeats`` forward+backward seconds per micro-batch size for
    ``make_model(d_in=d_in, d_hidden=d_hidden)``, and the per-parameter cost of the optimizer
    step with its gradient copies and of a bf16 round trip of the gradient."""
    import torch
    import torch.distributed as dist

    from course_utils.models import make_model

    model = make_model(seed=0, d_in=d_in, d_hidden=d_hidden)
    params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    fwd_bwd = []
    for mb in micro_batches:
        x, y = torch.randn(mb, d_in, generator=g), torch.randn(mb, 1, generator=g)

        def once():
            torch.nn.functional.mse_loss(model(x), y).backward()
        once()
        dist.barrier()  # both ranks compute at the same time, as in training
        fwd_bwd.append(_best_time(once, repeats))

    grads = [p.grad for p in model.parameters()]

    def update():
        flat = torch.cat([gr.reshape(-1) for gr in grads])
        flat /= 2
        for gr, chunk in zip(grads, flat.split([gr.numel() for gr in grads])):
            gr.copy_(chunk.view_as(gr))
        optimizer.step()
    flat = torch.cat([gr.reshape(-1) for gr in grads])

    def codec():
        flat.to(torch.bfloat16).to(torch.float32)
    update()
    codec()
    return {"params": params, "fwd_bwd": fwd_bwd,
            "update_per_param": _best_time(update, repeats) / params,
            "codec_per_param": _best_time(codec, repeats) / params}


def sweep_allreduce(cluster, sizes):
    """All-reduce seconds per size on ``cluster``'s ranks, the slowest rank's best of several.

    Not lesson 04's ``bench.sweep``: that one reports the mean of a timed loop (right for its
    bandwidth tables), while a fit on a shared machine needs the least disturbed time."""
    return [max(ts) for ts in zip(*cluster.run(measure_allreduce, sizes))]


@dataclasses.dataclass
class CalibrationRun:
    """What ``calibrate`` measured, kept for the plots: the fitted ``Calibration`` and its data."""
    cal: Calibration
    params: int
    sizes: list
    allreduce_times: list
    micro_batches: list
    compute_times: list
    source: str


def calibrate(cluster, *, d_in, d_hidden, sizes=None, micro_batches=(1, 4, 16, 64)):
    """Measure this machine's figures on ``cluster``'s ranks and fit the model.

    alpha and beta from an all-reduce sweep (``sizes`` in bytes, 1 KiB to 8 MiB by default: about
    a second), the compute figures from forward + backward of the lesson's model. Everything is
    measured in this run, so the lesson needs no file from another notebook. The slowest rank's
    times count. Introduced in 10_tradeoffs."""
    sizes = list(sizes or [1 << 10, 1 << 14, 1 << 17, 1 << 20, 1 << 21, 1 << 22, 1 << 23])
    ar_times, source = sweep_allreduce(cluster, sizes), "measured here"
    alpha, beta = fit_hop_alpha_beta(sizes, ar_times, cluster.world_size)

    per_rank = cluster.run(measure_compute, list(micro_batches), d_in, d_hidden)
    params = per_rank[0]["params"]
    comp_times = [max(ts) for ts in zip(*(r["fwd_bwd"] for r in per_rank))]
    overhead, flop_rate = fit_compute(params, list(micro_batches), comp_times)
    cal = Calibration(alpha=alpha, beta=beta, flop_rate=flop_rate, overhead=overhead,
                      update_per_param=max(r["update_per_param"] for r in per_rank),
                      codec_per_param=max(r["codec_per_param"] for r in per_rank),
                      world_size=cluster.world_size)
    return CalibrationRun(cal, params, list(sizes), ar_times, list(micro_batches), comp_times, source)


def step_phases(per_rank, pick="median"):
    """The phases of repeated steps from every rank's timestamps.

    ``per_rank[r][j]`` is ``(t_compute, t_flat, t_reduced, t_step)`` of repeat ``j`` on rank ``r``:
    seconds since the repeat's common start at the end of forward+backward, of flattening the
    gradient, of the all-reduce and of the whole step. Per repeat: ``compute`` ends when the slowest
    rank's compute ends; ``comm`` is the all-reduce alone, from the last rank entering it to the last
    rank leaving it; ``update`` is the rest (flatten, copy back, ``optimizer.step``, ``zero_grad``),
    which the model calls ``update``; ``step`` ends with the last rank. ``pick="median"`` (lesson 10's
    sweep) returns each phase's median over the repeats (a single slow or lucky repeat moves none of them);
    ``pick="best"`` the repeat with the shortest step. Introduced in 10_tradeoffs."""
    if pick not in ("median", "best"):
        raise ValueError(f"pick={pick!r}: use 'median' (each phase's median over the repeats) or 'best'")
    repeats = []
    for j in range(len(per_rank[0])):
        compute = max(r[j][0] for r in per_rank)
        entered = max(r[j][1] for r in per_rank)
        left = max(r[j][2] for r in per_rank)
        step = max(r[j][3] for r in per_rank)
        repeats.append({"compute": compute, "comm": left - entered, "update": step - compute - (left - entered),
                        "step": step})
    if pick == "best":
        return min(repeats, key=lambda row: row["step"])
    return {k: _median([row[k] for row in repeats]) for k in ("compute", "comm", "update", "step")}


def _median(values):
    v = sorted(values)
    n = len(v)
    return v[n // 2] if n % 2 else (v[n // 2 - 1] + v[n // 2]) / 2


def allreduce_spread(in_step, alone, compute, n_bytes, repeats):
    """Why the same all-reduce takes different times in lesson 10's steps, in one line of Markdown.

    Per configuration (medians over ``repeats``, seconds): ``in_step``, the step's all-reduce (``step_phases``'s
    ``comm``); ``alone``, the same bytes all-reduced from a common start right after each of those steps, with no
    compute before it; ``compute``, the step's compute. The alone times say what the all-reduce costs on this
    machine in this run, whatever the configuration: if they spread as much as the in-step ones, the spread is the
    machine's noise; if the in-step ones sit above them, the step around the all-reduce slows it, and ``beside``
    (how much more in the half of the configurations with the most compute) says whether the compute does.
    Returns ``(facts, text)``. Introduced in 10_tradeoffs."""
    n = len(in_step)
    ratios = [s / a for s, a in zip(in_step, alone)]
    order = sorted(range(n), key=lambda i: compute[i])
    light, heavy = order[:n // 2], order[n - n // 2:]
    facts = {"ratio": _median(ratios), "spread_in": max(in_step) / min(in_step),
             "spread_alone": max(alone) / min(alone),
             "beside": _median([ratios[i] for i in heavy]) / _median([ratios[i] for i in light])}
    ms = lambda ts: f"{min(ts) * 1e3:.1f} to {max(ts) * 1e3:.1f} ms"  # noqa: E731
    text = (f"the same {n_bytes / 1e6:.1f} MB all-reduce took {ms(in_step)} inside the steps and {ms(alone)} timed "
            f"alone, right after each step (medians of {repeats}). ")
    if facts["ratio"] >= 1.3:
        text += (f"Inside a step it took **{facts['ratio']:.1f}x** as long as alone (median over the configurations): "
                 "the bytes are the same, so the time comes from what runs just before it in a step. ")
    elif facts["ratio"] <= 1 / 1.3:
        text += (f"Inside a step it took {facts['ratio']:.1f}x as long as alone (median over the configurations): "
                 "faster, so nothing in the step slowed it down. ")
    else:
        text += (f"Inside a step it took about as long as alone ({facts['ratio']:.1f}x, median over the "
                 "configurations): the step around it adds little. ")
    if facts["spread_alone"] * 1.25 >= facts["spread_in"]:
        text += (f"Alone, it spread as much ({facts['spread_alone']:.1f}x from its fastest configuration to its "
                 f"slowest, {facts['spread_in']:.1f}x in the steps): the spread is this machine's noise (other "
                 "processes, the scheduler, gloo's threads waking up), not the configuration.")
    elif facts["beside"] >= 1.3:
        text += (f"Alone it spread less ({facts['spread_alone']:.1f}x, against {facts['spread_in']:.1f}x in the "
                 f"steps), and beside the larger computes it slowed most: in the half of the configurations with "
                 f"the most compute its in-step / alone ratio was **{facts['beside']:.1f}x** the other half's (the "
                 "compute had just filled the caches with activations and kept the cores busy).")
    else:
        text += (f"Alone it spread less ({facts['spread_alone']:.1f}x, against {facts['spread_in']:.1f}x in the "
                 f"steps), but not with the size of the compute beside it (in-step / alone {facts['beside']:.1f}x "
                 "in the half with the most compute against the other half): the step adds time at random, as a "
                 "busy machine does.")
    return facts, text


def agreement(rows, predictions, band=2.0, alone=None):
    """Compare measured phases with the model's, and say what the comparison shows, in Markdown.

    ``rows``: dicts with measured ``compute``, ``comm``, ``update`` (``step_phases``) and the
    configuration's ``micro_batch`` and ``accum_steps``; ``predictions``: the model's ``StepTime``
    for each. Returns ``(facts, text)``: ``facts`` holds the counts and median ratios the text is
    built from, so the sentences always follow this run's numbers. ``text`` is one line, which the
    notebook shows after "Measured here:" (tests/sanitize.cfg's rule for sentences chosen from timings).
    ``alone``: the median seconds of the same all-reduce timed alone in the same run (``allreduce_spread``),
    compared with the model's all-reduce. Introduced in 10_tradeoffs."""
    # the measured step as the table prints it and plot_agreement draws it (its own median over the repeats, which
    # is not the sum of the phases' medians); rows without one (hand-made in tests) add their phases
    ratios = [r.get("step", r["compute"] + r["comm"] + r["update"]) / p.total for r, p in zip(rows, predictions)]
    phase = {
        "compute": _median([r["compute"] / p.compute for r, p in zip(rows, predictions)]),
        "all-reduce": _median([r["comm"] / p.comm for r, p in zip(rows, predictions)]),
        "update": _median([r["update"] / p.update for r, p in zip(rows, predictions)]),
    }
    n = len(rows)
    facts = {"n": n, "within": sum(1 / band <= x <= band for x in ratios), "above": sum(x > 1 for x in ratios),
             "median": _median(ratios), "phase": phase,
             "worst": max(phase, key=lambda k: max(phase[k], 1 / phase[k]))}
    if facts["within"] == n:
        band_text = f"All {n} configurations lie inside the grey band (within {band:g}x of the model)."
    elif facts["within"] == 0:
        band_text = f"None of the {n} configurations lies inside the grey band (within {band:g}x of the model)."
    else:
        band_text = (f"{facts['within']} of {n} configurations lie inside the grey band (within {band:g}x); "
                     f"{n - facts['within']} lie outside it.")
    if facts["above"] == n:
        side = (f"Every configuration sits above the diagonal: the model is **optimistic**, measured steps take "
                f"{facts['median']:.2g}x its prediction (median).")
    elif facts["above"] == 0:
        side = (f"Every configuration sits below the diagonal: the model is **pessimistic**, measured steps take "
                f"{facts['median']:.2g}x its prediction (median).")
    else:
        side = (f"Of the {n} configurations, {facts['above']} sit above the diagonal and {n - facts['above']} "
                f"below: no systematic bias, median measured / predicted {facts['median']:.2g}x.")
    by_phase = ", ".join(f"{k} {v:.2g}x" for k, v in phase.items())
    worst = facts["worst"]
    text = (f"{band_text} {side} Phase by phase (median of measured / model): {by_phase}. "
            f"The largest gap is in the **{worst}**")
    text += {
        "all-reduce": (": the calibration timed the all-reduce back to back on the same buffer, both ranks "
                       "released together by a barrier; in a step it starts when the later rank arrives, on a "
                       "freshly flattened buffer."),
        "compute": (": the calibration kept the best of several back-to-back forward + backward passes on "
                    "gradients that already existed; in a step each micro-batch runs once, after the previous "
                    "step's all-reduce and update went through the caches, and the first backward allocates "
                    "the gradients that `zero_grad` freed."),
        "update": (": the calibration timed flattening, copying back and the optimizer step back to back "
                   "on warm memory; in a step they follow the all-reduce."),
    }[worst]
    if facts["median"] > 1:
        text += (" Also, the measured phases are medians over repeated steps, while the calibration kept the "
                 "best run of each phase separately (a median is never below the best), which by itself can put "
                 "points above the diagonal on a busy machine.")
    if alone is not None:
        model_comm = _median([p.comm for p in predictions])
        facts["alone_vs_model"] = alone / model_comm
        text += f" The all-reduce timed alone in section 3 took {alone * 1e3:.1f} ms (median), "
        if facts["alone_vs_model"] >= 1.5:
            text += (f"{facts['alone_vs_model']:.1f}x the model's {model_comm * 1e3:.1f} ms: the model keeps the best "
                     "of 7 back-to-back all-reduces of each size, and on this machine a typical one takes longer, "
                     "before any step adds to it.")
        elif facts["alone_vs_model"] <= 1 / 1.5:
            text += (f"{facts['alone_vs_model']:.1f}x the model's {model_comm * 1e3:.1f} ms: faster than the model, "
                     "whose fit on the sweep from 1 KiB to 8 MiB overestimates this size.")
        else:
            text += (f"close to the model's {model_comm * 1e3:.1f} ms ({facts['alone_vs_model']:.1f}x): the model fits "
                     "the all-reduce itself; what a step adds around it is not in the model.")
    return facts, text


def describe(cal):
    """The calibration in words, every figure with a unit (so nbval's sanitizer hides the values)."""
    sec_per_gflop = 1e9 / cal.flop_rate
    return "\n".join([
        f"latency alpha:   {cal.alpha * 1e6:.1f} us per ring hop",
        f"bandwidth 1/beta: {cal.bandwidth / 1e9:.3f} GB/s per link",
        f"compute:         {sec_per_gflop * 1e3:.1f} ms per GFLOP (forward + backward = 6 FLOP/param/sample)",
        f"overhead:        {cal.overhead * 1e6:.1f} us per micro-step",
        f"optimizer step:  {cal.update_per_param * 1e9:.2f} ns per parameter",
        f"bf16 round trip: {cal.codec_per_param * 1e9:.2f} ns per parameter",
    ])


# -- memory (the FAQ) ------------------------------------------------------------------------------
GIB = 2 ** 30  # a card sold as "8 GB" holds 8 GiB (nvidia-smi: 8192MiB): compare memory with GiB


def memory_per_rank(params, world_size=1, strategy="ddp", *, weight_bytes=4, grad_bytes=None,
                    optimizer_bytes=8, trainable_params=None, unit=1e9):
    """Model state on one rank, in ``unit`` bytes (GB by default; ``unit=GIB`` beside a card's size):
    weights + gradients + optimizer state. Activations not counted.

    ``optimizer_bytes`` per trainable parameter: 8 for Adam's two fp32 moments, 12 with mixed
    precision's fp32 master copy. ``trainable_params``: fewer than ``params`` for LoRA (frozen
    base weights have no gradient and no optimizer state). ``strategy``: "ddp" keeps a full
    replica on every rank; "zero1" shards the optimizer state, "zero2" also the gradients,
    "fsdp" (ZeRO-3) also the weights. Introduced in 10_tradeoffs."""
    trainable = params if trainable_params is None else trainable_params
    grad_bytes = weight_bytes if grad_bytes is None else grad_bytes
    shard = {"ddp": (1, 1, 1), "zero1": (1, 1, world_size), "zero2": (1, world_size, world_size),
             "fsdp": (world_size, world_size, world_size)}
    if strategy not in shard:
        raise ValueError(f"unknown strategy {strategy!r}: use one of {', '.join(shard)}")
    sw, sg, so = shard[strategy]
    return (params * weight_bytes / sw + trainable * grad_bytes / sg + trainable * optimizer_bytes / so) / unit


# -- plots --------------------------------------------------------------------------------------
def _style(ax, title, xlabel, ylabel):
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)


def plot_calibration(run):
    """Two panels: all-reduce time against size with the fitted ring model, and forward+backward
    time against micro-batch with the fitted compute line."""
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    cal = run.cal
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.6))
    a1.loglog(run.sizes, [t * 1e3 for t in run.allreduce_times], "o", label=f"measured ({run.source})")
    xs = [run.sizes[0] * (run.sizes[-1] / run.sizes[0]) ** (i / 40) for i in range(41)]
    a1.loglog(xs, [allreduce_time(x, cal.world_size, cal.alpha, cal.beta) * 1e3 for x in xs], "-",
              label="ring model")
    a1.legend(fontsize=8)
    a1.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    a1.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    _style(a1, f"all-reduce on {cal.world_size} ranks", "bytes", "ms")
    a2.plot(run.micro_batches, [t * 1e3 for t in run.compute_times], "o", label="measured")
    mbs = range(1, max(run.micro_batches) + 1)
    a2.plot(mbs, [micro_step_time(cal, run.params, m) * 1e3 for m in mbs], "-", label="overhead + 6P mb / F")
    a2.legend(fontsize=8)
    _style(a2, f"forward + backward, {run.params:,} parameters", "micro-batch size", "ms")
    fig.tight_layout()
    return fig


def plot_ranks(compute, step, title="one step per rank, from a common start"):
    """Horizontal bars per rank: compute, then waiting in the all-reduce until the step ends."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 1.4 + 0.45 * len(compute)))
    ranks = range(len(compute))
    ax.barh(ranks, [c * 1e3 for c in compute], color="tab:blue", label="compute")
    ax.barh(ranks, [(s - c) * 1e3 for c, s in zip(compute, step)], left=[c * 1e3 for c in compute],
            color="tab:orange", label="flatten, all-reduce (incl. waiting), copy back, step")
    ax.axvline(max(compute) * 1e3, color="k", ls="--", lw=1, label="slowest compute")
    ax.set_yticks(list(ranks), [f"rank {r}" for r in ranks])
    ax.invert_yaxis()
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=3, frameon=False)
    _style(ax, title, "ms since the common start", "")
    fig.tight_layout()
    return fig


COMM_BOUND = 0.5  # lesson 10: a configuration is communication-bound when the all-reduce is over half of the two


def plot_sweep(rows, predictions=None):
    """Measured compute, communication (and update, when the rows have it) per configuration
    (stacked bars), and the model's predicted step time as markers. ``rows``: dicts with
    micro_batch, accum_steps, compute, comm and optionally update (``step_phases``)."""
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 3.8), gridspec_kw={"width_ratios": [3, 2]})
    labels = [f"mb={r['micro_batch']}\nK={r['accum_steps']}" for r in rows]
    xs = range(len(rows))
    a1.bar(xs, [r["compute"] * 1e3 for r in rows], color="tab:blue", label="compute (measured)")
    a1.bar(xs, [r["comm"] * 1e3 for r in rows], bottom=[r["compute"] * 1e3 for r in rows],
           color="tab:orange", label="all-reduce (measured)")
    if all("update" in r for r in rows):
        a1.bar(xs, [r["update"] * 1e3 for r in rows], bottom=[(r["compute"] + r["comm"]) * 1e3 for r in rows],
               color="tab:green", label="flatten, copy back, step (measured)")
    if predictions is not None:
        a1.plot(xs, [p.total * 1e3 for p in predictions], "k_", markersize=18, mew=2, label="model: step")
    a1.set_xticks(list(xs), labels, fontsize=7)
    a1.legend(fontsize=8)
    _style(a1, "one step: compute vs communication", "", "ms")
    share = [r["comm"] / (r["comm"] + r["compute"]) for r in rows]
    a2.bar(xs, share, color=["tab:orange" if s > COMM_BOUND else "tab:blue" for s in share])  # of compute + comm
    if predictions is not None:
        a2.plot(xs, [p.comm_share for p in predictions], "k_", markersize=14, mew=2, label="model")
        a2.legend(fontsize=8)
    a2.axhline(COMM_BOUND, color="k", lw=1, ls="--")
    a2.set_xticks(list(xs), labels, fontsize=7)
    a2.set_ylim(0, 1)
    _style(a2, "all-reduce's share of compute + all-reduce (orange: dominates)", "", "comm / (compute + comm)")
    fig.tight_layout()
    return fig


def plot_agreement(measured, predicted, labels):
    """Measured against predicted step time, with the y = x line and a factor-2 band."""
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, ax = plt.subplots(figsize=(4.8, 4.2))
    m = [t * 1e3 for t in measured]
    p = [t * 1e3 for t in predicted]
    lo, hi = min(m + p) / 2, max(m + p) * 2
    ax.plot([lo, hi], [lo, hi], "k-", lw=1, label="agree")
    ax.fill_between([lo, hi], [lo / 2, hi / 2], [lo * 2, hi * 2], color="0.9", label="within 2x")
    ax.scatter(p, m, zorder=3)
    for x, y, text in zip(p, m, labels):
        ax.annotate(text, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_xscale("log")
    ax.set_yscale("log")
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.legend(fontsize=8, loc="upper left")
    _style(ax, "model vs measurement", "predicted step (ms)", "measured step (ms)")
    fig.tight_layout()
    return fig


WORLD_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)


def draw_model(fig, cal, *, world_size, params, micro_batch, accum_steps, compression=1.0, overlap=False):
    """Draw the cost model's three panels on ``fig``: step time split by world size, scaling
    efficiency by world size, and the exposed communication share by accumulation steps."""
    kw = dict(params=params, micro_batch=micro_batch, compression=compression, overlap=overlap)
    now = predict(cal, world_size=world_size, accum_steps=accum_steps, **kw)
    sizes = sorted(set(WORLD_SIZES) | {world_size})
    rows = [predict(cal, world_size=w, accum_steps=accum_steps, **kw) for w in sizes]
    a1, a2, a3 = fig.subplots(1, 3)
    xs = range(len(sizes))
    ms = lambda v: [x * 1e3 for x in v]
    bottom = [0.0] * len(rows)
    for name, color in (("compute", "tab:blue"), ("update", "tab:green"), ("exposed", "tab:orange"),
                        ("codec", "tab:red")):
        vals = ms(getattr(r, name) for r in rows)
        label = {"exposed": "exposed comm", "update": "optimizer", "codec": "compress"}.get(name, name)
        a1.bar(xs, vals, bottom=bottom, color=color, label=label)
        bottom = [b + v for b, v in zip(bottom, vals)]
    i = sizes.index(world_size)
    a1.bar([i], [bottom[i]], color="none", edgecolor="tab:red", lw=2)
    a1.set_xticks(list(xs), [str(w) for w in sizes], fontsize=8)
    a1.legend(fontsize=7)
    _style(a1, "step time", "world size", "ms")
    a2.plot(sizes, [r.efficiency for r in rows], "o-")
    a2.plot([world_size], [now.efficiency], "o", color="tab:red", markersize=9)
    a2.set_xscale("log", base=2)
    a2.set_xticks(WORLD_SIZES, [str(x) for x in WORLD_SIZES], fontsize=8)  # not world_size: 96 would hit 128
    a2.minorticks_off()
    a2.set_ylim(0, 1.05)
    _style(a2, "scaling efficiency", "world size", "T(1) / T(W)")
    ks = [1, 2, 4, 8, 16, 32, 64]
    for mb, style in ((max(1, micro_batch // 4), ":"), (micro_batch, "-"), (micro_batch * 4, "--")):
        shares = [predict(cal, world_size=world_size, accum_steps=k, **{**kw, "micro_batch": mb}).comm_share
                  for k in ks]
        a3.plot(ks, shares, style, label=f"micro-batch {mb}")
    a3.plot([accum_steps], [now.comm_share], "o", color="tab:red", markersize=9)
    a3.axhline(0.5, color="k", lw=1, ls="--")
    a3.set_xscale("log", base=2)
    a3.set_xticks(ks, [str(k) for k in ks], fontsize=8)
    a3.minorticks_off()
    a3.set_ylim(0, 1)
    a3.legend(fontsize=7)
    _style(a3, f"exposed communication, W={world_size}", "accum steps", "share of the step")
    fig.suptitle(f"W={world_size}, P={params / 1e6:.3g}M, {cal.bandwidth / 1e9:.3g} GB/s, "
                 f"{cal.alpha * 1e6:.3g} us/hop, mb={micro_batch}, K={accum_steps}, compression {compression:.3g}x"
                 f" -> step {now.total * 1e3:.3g} ms, efficiency {now.efficiency:.0%}", fontsize=9)
    fig.tight_layout()
    return now


def plot_model(cal, **config):
    """The cost model's figure for one configuration (a static picture of the widget's state)."""
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(12, 3.8))
    draw_model(fig, cal, **config)
    return fig


def _png(cal, config):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 3.8))  # not pyplot: nothing is shown in the cell by accident
    draw_model(fig, cal, **config)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80)
    return buf.getvalue()


def cost_model_widget(cal, *, world_size, params, micro_batch, accum_steps=1, compression=1.0, overlap=False):
    """Sliders for the model's inputs and its figure, redrawn when a slider is released.

    Defaults: bandwidth and latency from ``cal`` (measured), the rest from the arguments.
    The figure is an image in an Output widget, set directly on the widget, so that no output
    reaches the cell itself (nbval then sees the same output in every run). The panel's text form
    names the sliders only, never their (measured) values. Introduced in 10_tradeoffs."""
    import ipywidgets as w

    common = dict(continuous_update=False, style={"description_width": "90px"},
                  layout=w.Layout(width="330px"))
    sliders = {
        # powers of two only: the sizes a ring or tree all-reduce is usually run at, and one tick each on the plots
        "world_size": w.SelectionSlider(options=sorted(set(WORLD_SIZES) | {world_size}), value=world_size,
                                        description="world size", **common),
        "model_m": w.FloatLogSlider(value=params / 1e6, base=10, min=-3, max=4, step=0.05,
                                    description="model size", readout_format=".3g", **common),
        "bandwidth_gbs": w.FloatLogSlider(value=cal.bandwidth / 1e9, base=10, min=-2, max=3, step=0.05,
                                          description="bandwidth", readout_format=".3g", **common),
        "latency_us": w.FloatLogSlider(value=cal.alpha * 1e6, base=10, min=-1, max=4, step=0.05,
                                       description="latency", readout_format=".3g", **common),
        "micro_batch": w.IntSlider(value=micro_batch, min=1, max=256, description="micro-batch", **common),
        "accum_steps": w.IntSlider(value=accum_steps, min=1, max=64, description="accum steps", **common),
        "compression": w.FloatLogSlider(value=compression, base=2, min=0, max=8, step=0.25,
                                        description="compression", readout_format=".3g", **common),
    }
    units = {"model_m": "M params", "bandwidth_gbs": "GB/s", "latency_us": "µs/hop", "compression": "x"}
    overlap_box = w.Checkbox(value=overlap, description="overlap with backward (DDP buckets)", indent=False)
    out = w.Output(layout=w.Layout(min_height="320px"))

    def config():
        v = {k: s.value for k, s in sliders.items()}
        c = dataclasses.replace(cal, beta=1.0 / (v["bandwidth_gbs"] * 1e9), alpha=v["latency_us"] * 1e-6)
        return c, dict(world_size=v["world_size"], params=v["model_m"] * 1e6, micro_batch=v["micro_batch"],
                       accum_steps=v["accum_steps"], compression=v["compression"], overlap=overlap_box.value)

    def redraw(_change=None):
        c, cfg = config()
        panel.png = _png(c, cfg)
        out.outputs = ({"output_type": "display_data", "metadata": {},
                        "data": {"image/png": base64.b64encode(panel.png).decode("ascii"),
                                 "text/plain": "<cost model figure>"}},)

    rows = [w.HBox([s, w.Label(units.get(k, ""))]) for k, s in sliders.items()]
    for s in [*sliders.values(), overlap_box]:
        s.observe(redraw, names="value")
    panel = _panel_class()([w.HBox([w.VBox(rows[:4]), w.VBox(rows[4:] + [overlap_box])]), out])
    panel.sliders, panel.overlap, panel.output, panel.redraw = sliders, overlap_box, out, redraw
    redraw()
    return panel


def static_figure(panel):
    """The panel's current figure as a plain image output, which a saved notebook keeps."""
    from IPython.display import Image

    return Image(data=panel.png, format="png")


@functools.lru_cache(maxsize=None)
def _panel_class():
    import ipywidgets as w

    class CostModelPanel(w.VBox):
        """A VBox whose text form names the sliders but never their values, which are measured."""

        def __repr__(self):
            return "CostModelPanel(sliders: " + ", ".join(SLIDERS) + ")"

    return CostModelPanel
