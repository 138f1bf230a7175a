"""Bandwidth measurement in the style of nccl-tests / all_reduce_bench.

Introduced in 04_measuring_bandwidth (``fit_call_alpha_beta`` already in 03_all_reduce_by_hand). Its self-checks are
in ``course_utils.checks.bandwidth``.

The formulas (nccl-tests, doc/PERFORMANCE.md). For an operation on a buffer of S bytes that
takes t seconds on n ranks:

    algbw = S / t                               (what the caller sees)
    busbw = algbw x bus_factor(op, n)           (what each link carries: comparable across n and ops)

    bus_factor: all_reduce 2(n-1)/n; reduce_scatter, all_gather, all_to_all (n-1)/n; broadcast, reduce 1

S is the size of the whole buffer: for all_gather the gathered output, for reduce_scatter the
input (n times one rank's share). busbw equals the link speed when the algorithm is bandwidth
optimal, so it is the number to compare with the hardware's ceiling.

The alpha-beta (latency-bandwidth) model: sending a message of S bytes costs t = alpha + beta x S,
alpha in seconds (latency), beta in seconds per byte (1 / bandwidth). ``fit_call_alpha_beta`` fits it.

Saved measurements (``save_measurements`` / ``load_measurements``), a JSON object, by default in
``DEFAULT_PATH`` = ``$MICRO_DDP_CACHE`` or ``$XDG_CACHE_HOME/micro-ddp`` or ``~/.cache/micro-ddp``, then
``bandwidth.json``: outside the repository, since the numbers belong to this machine::

    {
      "format": 1,
      "op": "all_reduce",            # the operation of "rows"
      "backend": "gloo",
      "world_size": 4,
      "dtype": "float32",
      "rows": [                      # dist.all_reduce, one row per buffer size, sizes ascending
        {"bytes": 4096, "iters": 20, "time_s": 0.0002, "algbw_Bps": 2.0e7, "busbw_Bps": 3.0e7},
        ...
      ],
      "ring_rows": [...],            # the hand-written chunked ring, same keys (may be absent)
                                     # rows from ``race`` add "turns" and "turn_times_s" (one time per turn)
      "alpha_s": 0.0001,             # fitted latency of dist.all_reduce, seconds
      "beta_s_per_byte": 1.0e-9,     # fitted inverse bandwidth, seconds per byte
      "memcpy_Bps": 5.0e9,           # one process's tensor copy bandwidth (bytes copied per second)
      "peak_busbw_Bps": 1.0e9,
      "torch": "2.13.0+cpu", "created_unix": 1700000000.0
    }

Bandwidths are in bytes per second (divide by 1e9 for GB/s). ``time_s`` is the mean time of one
call, the slowest rank's (a collective is done when its last rank is done); in a row from ``race``, the
median over its turns of that mean.
"""
import json
import os
import time
from pathlib import Path

import torch

__all__ = ["BUS_FACTORS", "bus_factor", "algbw", "busbw", "default_sizes", "iterations_for", "time_op",
           "sweep", "time_in_turns", "race", "spread_overlaps", "gloo_ring_messages",
           "fit_call_alpha_beta", "memcpy_bandwidth", "format_size", "format_table",
           "save_measurements", "load_measurements", "DEFAULT_PATH", "describe_race", "describe_busbw_spread",
           "describe_throughput", "describe_model_fit", "describe_bucketing"]


def _cache_dir():
    if os.environ.get("MICRO_DDP_CACHE"):
        return Path(os.environ["MICRO_DDP_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "micro-ddp"


DEFAULT_PATH = _cache_dir() / "bandwidth.json"
FORMAT = 1

BUS_FACTORS = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
}


def bus_factor(op, world_size):
    """busbw / algbw for ``op`` on ``world_size`` ranks (nccl-tests). Introduced in 04_measuring_bandwidth."""
    if op not in BUS_FACTORS:
        raise ValueError(f"unknown op {op!r}: use one of {', '.join(BUS_FACTORS)}")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
    return BUS_FACTORS[op](world_size)


def algbw(nbytes, seconds):
    """Algorithm bandwidth S / t in bytes per second. Introduced in 04_measuring_bandwidth."""
    if seconds <= 0:
        raise ValueError(f"a time must be positive, got {seconds!r}")
    return nbytes / seconds


def busbw(nbytes, seconds, world_size, op="all_reduce"):
    """Bus bandwidth algbw x bus_factor(op, n) in bytes per second. Introduced in 04_measuring_bandwidth."""
    return algbw(nbytes, seconds) * bus_factor(op, world_size)


def default_sizes(smallest=4 * 1024, largest=64 * 2**20, factor=4):
    """Buffer sizes in bytes: 4 KiB, 16 KiB, ... 64 MiB (powers of ``factor``)."""
    sizes, s = [], smallest
    while s <= largest:
        sizes.append(s)
        s *= factor
    return sizes


def iterations_for(nbytes, budget_bytes=32 * 2**20, lo=2, hi=20):
    """How many timed calls for a buffer: many for small ones (noise), few for big ones (time)."""
    return int(max(lo, min(hi, budget_bytes // max(nbytes, 1))))


def _buffers(op, nbytes, world_size, dtype, device="cpu"):
    numel = max(1, nbytes // torch.tensor([], dtype=dtype).element_size())

    def ones(k):
        return torch.ones(k, dtype=dtype, device=device)

    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        numel -= numel % world_size
        whole, share = ones(numel), ones(numel // world_size)
        if op == "all_gather":
            return (whole, share)               # fn(output, input)
        if op == "reduce_scatter":
            return (share, whole)               # fn(output, input)
        return (whole, ones(numel))
    if op in ("broadcast", "reduce"):
        return (ones(numel), 0)                 # fn(tensor, src_or_dst)
    return (ones(numel),)                       # all_reduce: fn(tensor)


def _rank_device():
    """The device this rank's collectives run on: its GPU under NCCL, else the CPU."""
    import torch.distributed as dist

    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _sync(device):
    if torch.device(device).type == "cuda":   # NCCL calls return before the GPU is done: wait for it
        torch.cuda.synchronize(device)


def time_op(fn, op, nbytes, iters, warmup=1, dtype=torch.float32, device=None):
    """Run on every rank: mean seconds per call of ``fn`` on an ``nbytes`` buffer, slowest rank's.

    ``fn``'s arguments depend on ``op``: all_reduce ``fn(tensor)``; broadcast/reduce
    ``fn(tensor, 0)``; all_gather and reduce_scatter ``fn(output, input)`` (``dist.all_gather_single``
    / ``dist.reduce_scatter_single`` style). The buffers live on ``device`` (default: the rank's GPU under
    NCCL, else the CPU); on a GPU the clock stops after ``torch.cuda.synchronize``, as nccl-tests waits for
    its kernels. Introduced in 04_measuring_bandwidth.
    """
    import torch.distributed as dist

    device = _rank_device() if device is None else torch.device(device)
    args = _buffers(op, nbytes, dist.get_world_size(), dtype, device)
    for _ in range(warmup):
        fn(*args)
    _sync(device)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn(*args)
    _sync(device)
    elapsed = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64, device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def sweep(fn, sizes=None, op="all_reduce", dtype=torch.float32, budget_bytes=32 * 2**20, max_iters=20, device=None):
    """Run on every rank: time ``fn`` at each size; the same list of rows on every rank.

    Each row: {"bytes", "iters", "time_s", "algbw_Bps", "busbw_Bps"} (see the module docstring).
    ``device`` as in ``time_op``. Introduced in 04_measuring_bandwidth.
    """
    import torch.distributed as dist

    n = dist.get_world_size()
    rows = []
    for nbytes in sizes or default_sizes():
        iters = iterations_for(nbytes, budget_bytes, hi=max_iters)
        t = time_op(fn, op, nbytes, iters, dtype=dtype, device=device)
        rows.append({"bytes": int(nbytes), "iters": iters, "time_s": t,
                     "algbw_Bps": algbw(nbytes, t), "busbw_Bps": busbw(nbytes, t, n, op)})
    return rows


def time_in_turns(calls, turns=5, iters=1, warmup=1):
    """Run on every rank: time each zero-argument callable of ``calls`` ({name: fn}) in turns.

    Every call is warmed up ``warmup`` times; then each turn runs every callable in order, each after a
    ``dist.barrier()``, ``iters`` times in a row. Returns {name: [seconds per call in each turn]}, the slowest
    rank's (the same lists on every rank). Taking turns spreads a slow spell of a busy machine over all the
    callables instead of one, and the turns' range is the measured spread. Introduced in 04_measuring_bandwidth.
    """
    import torch.distributed as dist

    device = _rank_device()
    for fn in calls.values():
        for _ in range(warmup):
            fn()
    took = {name: [] for name in calls}
    for _ in range(turns):
        for name, fn in calls.items():
            _sync(device)
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            _sync(device)
            elapsed = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64, device=device)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            took[name].append(elapsed.item())
    return took


def race(fns, sizes=None, op="all_reduce", turns=3, dtype=torch.float32, budget_bytes=32 * 2**20, max_iters=20,
         device=None):
    """Run on every rank: ``sweep`` for several functions at once, timed in turns; {name: rows}.

    ``fns`` maps a name to a function called as in ``time_op``; ``op`` is one op for all, or {name: op}. At each
    size every function is warmed up once, then the functions take ``turns`` turns (``time_in_turns``), each turn
    ``ceil(iterations_for(size) / turns)`` calls, so the whole race costs about what one ``sweep`` per function
    costs. A row is a ``sweep`` row whose ``time_s`` is the median of its turns, plus ``turns`` and
    ``turn_times_s`` (the slowest rank's mean per call in each turn): the spread a verdict weighs a difference
    against (``spread_overlaps``). Introduced in 04_measuring_bandwidth.
    """
    import statistics

    import torch.distributed as dist

    n = dist.get_world_size()
    device = _rank_device() if device is None else torch.device(device)
    ops = op if isinstance(op, dict) else {name: op for name in fns}
    out = {name: [] for name in fns}
    for nbytes in sizes or default_sizes():
        per_turn = -(-iterations_for(nbytes, budget_bytes, hi=max_iters) // turns)
        calls = {}
        for name, fn in fns.items():
            args = _buffers(ops[name], nbytes, n, dtype, device)
            calls[name] = (lambda fn=fn, args=args: fn(*args))
        took = time_in_turns(calls, turns=turns, iters=per_turn)
        for name in fns:
            t = statistics.median(took[name])
            out[name].append({"bytes": int(nbytes), "iters": per_turn * turns, "time_s": t,
                              "algbw_Bps": algbw(nbytes, t), "busbw_Bps": busbw(nbytes, t, n, ops[name]),
                              "turns": turns, "turn_times_s": took[name]})
    return out


def spread_overlaps(a, b):
    """True when two lists of repeated times overlap (min of one <= max of the other, both ways): their
    difference is within the measured spread. Introduced in 04_measuring_bandwidth."""
    return min(a) <= max(b) and min(b) <= max(a)


def gloo_ring_messages(nbytes, world_size, element_size=4, max_segment_bytes=2**20):
    """(messages each rank sends, bytes per message) in gloo's ring all-reduce of ``nbytes``.

    From gloo's ``gloo/allreduce.cc`` (``ring``): the buffer is cut into ``numSegments`` segments of at most
    ``maxSegmentSize`` bytes (``kMaxSegmentSize`` = 1 MiB, which ``ProcessGroupGloo`` leaves at its default),
    at least 2 per rank and a multiple of the world size, so that a rank can send one segment while it adds
    another; reduce-scatter and all-gather each send ``numSegments - numSegments / n`` of them. The chunked ring
    of 03 sends 2(n-1) messages of S/n. Introduced in 04_measuring_bandwidth.
    """
    n = world_size
    max_seg = element_size * max(1, max_segment_bytes // element_size)
    segments = max(-(-nbytes // max_seg), 2 * n)
    segments = -(-segments // n) * n
    seg_bytes = -(-(-(-nbytes // segments)) // element_size) * element_size
    return 2 * (segments - segments // n), seg_bytes


def fit_call_alpha_beta(sizes, times):
    """Fit t = alpha + beta x S to measured (size in bytes, seconds) pairs; return (alpha, beta) of one whole call:
    alpha in seconds per call, beta in seconds per byte (``costmodel.fit_hop_alpha_beta`` spreads them over a ring's
    hops).

    Introduced in 03_all_reduce_by_hand; the one implementation of the fit (``costmodel`` builds on it).
    Least squares on the RELATIVE error (weights 1/t^2), so the
    small sizes, where alpha shows, count as much as the large ones, where beta does. alpha is kept
    >= 0 (a negative latency is noise): then beta alone is refitted. beta <= 0 (times that do not
    grow with the size) is returned as fitted: the caller decides (``costmodel`` raises).
    """
    s = [float(x) for x in sizes]
    t = [float(x) for x in times]
    if len(s) != len(t) or len(s) < 2:
        raise ValueError(f"need at least two (size, time) pairs of equal length, got {len(s)} sizes and {len(t)} times")
    if any(x <= 0 for x in t) or any(x < 0 for x in s):
        raise ValueError("times must be positive and sizes non-negative")
    w = [1.0 / x**2 for x in t]
    sw = sum(w)
    sws = sum(wi * si for wi, si in zip(w, s))
    swss = sum(wi * si * si for wi, si in zip(w, s))
    swt = sum(wi * ti for wi, ti in zip(w, t))
    swst = sum(wi * si * ti for wi, si, ti in zip(w, s, t))
    det = sw * swss - sws * sws
    if det <= 0:
        raise ValueError("the sizes must not all be equal: alpha and beta cannot be told apart")
    alpha = (swss * swt - sws * swst) / det
    beta = (sw * swst - sws * swt) / det
    if alpha < 0:
        alpha, beta = 0.0, swst / swss
    return alpha, beta


def memcpy_bandwidth(nbytes=64 * 2**20, repeats=5):
    """This process's tensor copy bandwidth, bytes copied per second (best of ``repeats``).

    Introduced in 04_measuring_bandwidth: the ceiling for moving data between ranks of one machine,
    since every byte a rank sends is copied at least once (usually several times) on the way.
    """
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch the pages once
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best


def format_size(nbytes):
    """'4 KiB', '64 MiB': sizes in binary units (no '/s', so the notebook sanitizer leaves them)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def format_table(rows, title=None):
    """A text table: size, iterations, time and bandwidths, every measured number with its unit."""
    lines = [title] if title else []
    lines.append(f"{'size':>8} {'iters':>5} {'time':>12} {'algbw':>12} {'busbw':>12}")
    for r in rows:
        lines.append(f"{format_size(r['bytes']):>8} {r['iters']:>5} {r['time_s'] * 1e6:>9.1f} us "
                     f"{r['algbw_Bps'] / 1e9:>7.3f} GB/s {r['busbw_Bps'] / 1e9:>7.3f} GB/s")
    return "\n".join(lines)


def save_measurements(rows, world_size, path=DEFAULT_PATH, op="all_reduce", **extra):
    """Write a sweep to ``path`` (JSON, format in the module docstring) with its alpha-beta fit; return the dict."""
    alpha, beta = fit_call_alpha_beta([r["bytes"] for r in rows], [r["time_s"] for r in rows])
    data = {"format": FORMAT, "op": op, "backend": extra.pop("backend", "gloo"), "world_size": world_size,
            "dtype": extra.pop("dtype", "float32"), "rows": rows, "alpha_s": alpha, "beta_s_per_byte": beta,
            "peak_busbw_Bps": max(r["busbw_Bps"] for r in rows), "torch": torch.__version__,
            "created_unix": time.time(), **extra}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)
    return data


def load_measurements(path=DEFAULT_PATH):
    """The saved sweep (a dict, format in the module docstring), or None if 04 has not been run here."""
    path = Path(path)
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    if data.get("format") != FORMAT:
        raise ValueError(f"{path} has format {data.get('format')!r}, this course_utils reads format {FORMAT}: "
                         "run 04_measuring_bandwidth again to rewrite it")
    return data


# -- sentences chosen from a measurement (04_measuring_bandwidth) ----------------------------------------
# What these return depends on this machine's timings, so the notebook prints them after "Measured here:",
# a prefix that tests/sanitize.cfg replaces: nbval checks that the cell runs, not what this machine measured.
def _turns(row):
    """A row's per-turn times (a ``race`` row), or None for a plain ``sweep`` row (no spread measured)."""
    return row.get("turn_times_s")


def describe_race(rows, ring_rows, world_size=4, cores=None):
    """Sentences comparing two sweeps of the same sizes (the library's all-reduce, the hand ring), from the data.

    One sentence for the two smallest sizes, one for the two largest. At each size the winner is named only when
    the two functions' turns do not overlap (``spread_overlaps``: rows from ``race`` carry their turns); plain
    ``sweep`` rows (no turns) fall back to a 1.1x margin and say that no spread was measured. When both sizes of a
    pair have the same outcome the sentence names it once; otherwise it names the outcome of each size (a ring
    faster at one size and the difference within the spread at the other is said as such, never as "neither").
    Each winner comes with its reason: the fixed cost per call at the small sizes, and at the large ones how
    gloo's ring cuts the buffer (``gloo_ring_messages``: segments of at most 1 MiB) against the hand ring's
    2(n-1) messages of S/n. Introduced in 04_measuring_bandwidth.
    """
    if [r["bytes"] for r in rows] != [r["bytes"] for r in ring_rows]:
        raise ValueError("the two sweeps must have the same sizes")
    n = world_size
    names = [format_size(r["bytes"]) for r in rows]
    on_cores = f" on {cores} shared core(s)" if cores else " on shared cores"
    turns = rows[0].get("turns")
    spread = f"beyond the spread of {turns} turns" if turns else "no spread measured: a 1.1x margin"

    def outcome(k):
        lib, hand = rows[k], ring_rows[k]
        ratio = hand["time_s"] / lib["time_s"]   # > 1: the library is faster
        if _turns(lib) and _turns(hand):
            if spread_overlaps(_turns(lib), _turns(hand)):
                return ratio, "within"
        elif 1 / 1.1 <= ratio <= 1.1:
            return ratio, "within"
        return ratio, "library" if ratio > 1 else "hand"

    def why(kind, k, small):
        """The reason that fits a win by ``kind`` at size index ``k`` (the largest of its pair for the large)."""
        size = rows[k]["bytes"]
        msgs, seg = gloo_ring_messages(size, n)
        if kind == "library":
            return (" the hand ring's every step is a Python send or recv, gloo's ring runs in C++ on a worker thread"
                    if small else
                    f" the bytes dominate, and gloo's ring adds in C++ and overlaps sending one segment with adding "
                    f"another ({msgs} messages of {format_size(seg)} per rank at {names[k]})")
        return (f" not the algorithm: the time is almost all fixed cost per call, and dist.all_reduce hands the "
                f"work to a worker thread and back, and its ring sends {msgs} messages of {format_size(seg)} per "
                f"rank where the hand ring sends {2 * (n - 1)}"
                if small else
                f" gloo's ring cuts the buffer into segments of at most 1 MiB, to overlap sending one with adding "
                f"another, so at {names[k]} each rank sends {msgs} messages where the hand ring sends "
                f"{2 * (n - 1)} of {format_size(size // n)}; with {n} ranks{on_cores} every message costs "
                "wake-ups, and the overlap needs a free core")

    def span(values):
        return f"{min(values):.2f}x" if f"{min(values):.2f}" == f"{max(values):.2f}" else \
            f"{min(values):.2f}x to {max(values):.2f}x"

    def sentence(idx, small):
        found = [outcome(k) for k in idx]
        ratios = [r for r, _ in found]
        kinds = [kind for _, kind in found]
        where = f"at the {'smallest' if small else 'largest'} sizes ({names[idx[0]]}, {names[idx[1]]})"
        beyond = "beyond the measured spread" if turns else "by a 1.1x margin (no spread measured)"
        if kinds == ["library"] * len(idx):
            return f"{where} the library is faster ({span(ratios)}, {spread}):" + why("library", idx[-1], small)
        if kinds == ["hand"] * len(idx):
            key = idx[0] if small else idx[-1]
            return (f"{where} the hand ring is faster ({span([1 / r for r in ratios])}, {spread}):"
                    + why("hand", key, small))
        if kinds == ["within"] * len(idx):
            return (f"{where} neither ring is faster {beyond} at either size (time ratios, hand ring / library, "
                    f"{min(ratios):.2f} to {max(ratios):.2f}" + ("; the turns overlap at both)" if turns else ")"))
        parts = []   # the outcomes differ between the two sizes: one clause per size, each with its own verdict
        for k, (ratio, kind) in zip(idx, found):
            if kind == "library":
                parts.append(f"at {names[k]} the library is faster ({ratio:.2f}x, {spread}):" + why(kind, k, small))
            elif kind == "hand":
                parts.append(f"at {names[k]} the hand ring is faster ({1 / ratio:.2f}x, {spread}):"
                             + why(kind, k, small))
            else:
                parts.append(f"at {names[k]} neither ring is faster {beyond} (time ratio, hand ring / library, "
                             f"{ratio:.2f}" + ("; the turns overlap there)" if turns else ")"))
        return f"{where}, size by size: " + "; ".join(parts)

    return [sentence([0, 1], small=True), sentence([len(rows) - 2, len(rows) - 1], small=False)]


def describe_bucketing(took, alpha, beta, n_grads=64, grad_bytes=16 * 1024):
    """Two sentences on 04's bucketing race, chosen from its numbers: ``took`` maps "one_by_one" and "bucketed"
    to the seconds of each turn (``time_in_turns``); ``alpha`` and ``beta`` are section 4's fit.

    The first says whether bucketing was faster beyond the measured spread (the turns do not overlap); the second
    holds the measured ratio and each part against the alpha-beta model (as ratios: the model's times are
    exercise 2), and says when a measured time falls below alpha itself. Introduced in 04_measuring_bandwidth.
    """
    import statistics

    one, bucket = took["one_by_one"], took["bucketed"]
    m_one, m_bucket = statistics.median(one), statistics.median(bucket)
    speedup = m_one / m_bucket
    k = len(one)
    if spread_overlaps(one, bucket):
        first = (f"bucketing's gain ({speedup:.2f}x, medians of {k} turns) is within the measured spread: the turns "
                 "of the two overlap, so this run cannot tell them apart")
    elif m_one > m_bucket:
        first = (f"bucketing was {speedup:.1f}x faster (medians of {k} turns; in every turn the {n_grads} small "
                 "all-reduces took longer than the one bucket)")
    else:
        first = (f"bucketing was slower ({speedup:.2f}x, in every one of {k} turns): the copies into and out of "
                 f"the bucket cost more than the {n_grads - 1} fixed costs saved (a small alpha here, or a busy "
                 "machine)")
    model_one = n_grads * (alpha + beta * grad_bytes)
    model_bucket = alpha + beta * n_grads * grad_bytes
    parts = []
    for label, times, model in ((f"the {n_grads} all-reduces", one, model_one), ("the bucket", bucket, model_bucket)):
        inside = min(times) <= model <= max(times)
        parts.append(f"{label} took {statistics.median(times) / model:.2f}x the model's time"
                     + (" (the model lies within the turns' range)" if inside else ""))
    second = (f"the alpha-beta model of section 4 predicts bucketing {model_one / model_bucket:.1f}x faster, "
              f"measured {speedup:.1f}x; " + ", ".join(parts))
    if m_bucket < alpha:
        second += (f"; the bucket's median is below alpha itself ({m_bucket / alpha:.2f}x): alpha is a least-squares "
                   "fit to section 3's sweep, timed earlier under other load, not a floor that every all-reduce pays")
    return [first, second + "."]


def describe_throughput(world_sizes, samples_per_step, compute_s, comm_s, cores):
    """Two sentences on a data-parallel throughput measurement, chosen from its numbers. Introduced in
    01_data_parallelism: is compute per rank flat from the smallest to the largest world, and what held
    the throughput back (the shared cores, the all-reduce, or nothing)? The culprit is the part that added
    more time per step from the smallest to the largest world (by 1.5x; closer than that: both).

    ``compute_s`` and ``comm_s`` are seconds per step (the slowest rank's median) at each world size.
    """
    n0, n1 = world_sizes[0], world_sizes[-1]
    step_s = [a + b for a, b in zip(compute_s, comm_s)]
    growth = compute_s[-1] / compute_s[0]
    ideal = samples_per_step[-1] / samples_per_step[0]
    speedup = (samples_per_step[-1] / step_s[-1]) / (samples_per_step[0] / step_s[0])
    comm_share = comm_s[-1] / step_s[-1]
    span = f"from {n0} to {n1} ranks"
    if growth < 0.8:
        compute = (f"compute per rank shrank {span} (x{growth:.2f}), which the work cannot explain (every rank "
                   "does the same): other load on this machine disturbed the measurement.")
    elif growth < 1.25:
        compute = (f"compute per rank stayed flat {span} (x{growth:.2f}): each rank did the same work, as on one "
                   f"device per rank ({cores} cores here).")
    elif growth < 1.5:
        compute = (f"compute per rank grew a little {span} (x{growth:.2f}): {cores} core(s) for {n1} ranks, so "
                   "the ranks partly queued for the CPU.")
    else:
        compute = (f"compute per rank grew x{growth:.1f} {span}: {cores} core(s) for {n1} ranks, so the ranks "
                   "queued for the CPU; here they are not independent devices.")
    # What each part ADDED from the smallest to the largest world decides what held the throughput back.
    added_compute, added_comm = compute_s[-1] - compute_s[0], comm_s[-1] - comm_s[0]
    added = (f"compute added {added_compute * 1e3:.1f} ms per step, the all-reduce and step "
             f"{added_comm * 1e3:.1f} ms")
    if speedup > 1.1 * ideal:
        limit = f"more than the ideal x{ideal:g}: the {n0}-rank steps were disturbed by other work on this machine"
    elif speedup >= 0.75 * ideal:
        limit = f"close to the ideal x{ideal:g}"
    elif growth < 0.8:
        limit = "but the disturbed compute times make the ratio unreliable"
    elif added_compute > 1.5 * added_comm:
        limit = f"held back by the shared CPU cores (compute grew) more than by the all-reduce: {added}"
    elif added_comm > 1.5 * added_compute:
        limit = (f"held back by the all-reduce more than by compute: {added}"
                 + (" (compute stayed flat)" if growth < 1.25 else ""))
    else:
        limit = f"held back both by the shared CPU cores (compute grew) and by the all-reduce: {added}"
    share = (f"the all-reduce (and step) took {comm_share:.0%} of a {n1}-rank step; throughput at {n1} ranks is "
             f"x{speedup:.1f} that of {n0} rank{'s' if n0 > 1 else ''}, {limit}.")
    return [compute, share]


MODEL_BAND = (1 / 1.5, 1.5)  # measured / model within this band: the model's scale is about right
MODEL_NAMES = {"dedicated": "dedicated-links model", "shared": "shared-link model"}


def describe_model_fit(agrees, n_sizes, ratios, cores, sizes=None):
    """Two lines on how 03_all_reduce_by_hand's two alpha-beta models fit a run, chosen from its numbers.

    ``agrees`` maps each model ("dedicated", "shared") to how many of the ``n_sizes`` sizes it ranked the
    algorithms as measured; ``ratios`` maps each model to {algorithm's short name: measured / that model's time,
    one per size}; ``cores`` is how many cores the ranks shared; ``sizes`` names the sizes ("16 KiB").
    Each algorithm is judged against the model that ranked the run as measured (against both when both or neither
    did), at each size on its own against ``MODEL_BAND`` (about 0.67x to 1.5x): within, above or below, so an
    algorithm within at one size and below at another is said to be so (a measurement on the model is never
    "below" it). Each side met gets one short reason. alpha and beta come from a ping-pong of Python
    ``send``/``recv`` over the same loopback, so Python's cost per message is in alpha already; what the 2-rank
    ping-pong did not see is 4 ranks at once. tests/test_bench.py holds it, with the runs that fooled it.
    Introduced in 03_all_reduce_by_hand.
    """
    if agrees["shared"] == n_sizes and agrees["dedicated"] < n_sizes:
        verdict = "this run ranks the algorithms as the shared-link model does (transfers queue for the same cores)."
    elif agrees["dedicated"] == n_sizes and agrees["shared"] < n_sizes:
        verdict = "this run ranks the algorithms as the dedicated-links model does (transfers ran side by side)."
    elif agrees["dedicated"] == agrees["shared"] == n_sizes:
        verdict = "both models rank the algorithms as this run measured them, at every size."
    else:
        verdict = ("neither model ranks the algorithms as measured at every size: this machine sits between one "
                   "shared link and dedicated links (and a busy machine's timings are noisy).")
    ranking = [links for links in ("shared", "dedicated") if agrees[links] == n_sizes]
    labels = list(sizes) if sizes else [f"size {k + 1}" for k in range(n_sizes)]
    lo_ok, hi_ok = MODEL_BAND
    reasons = {
        ("dedicated", "above"): f"the transfers queued for the same memory and {cores} core(s) instead of running "
                                "side by side",
        ("dedicated", "below"): "the other ranks' messages had often arrived before the busiest rank asked, so "
                                "their latencies overlapped",
        ("shared", "above"): (f"a message also waited for its receiver to get one of the {cores} core(s)"
                              if cores < 4 else "4 ranks copied through the same memory at once"),
        ("shared", "below"): f"some transfers overlapped ({cores} core(s) copy at once), as dedicated links would",
    }
    scales = []
    for links in ranking or ["shared", "dedicated"]:
        parts, met = [], []
        for name, rs in ratios[links].items():
            at = {}
            for label, r in zip(labels, rs):
                kind = "within" if lo_ok <= r <= hi_ok else "above" if r > hi_ok else "below"
                at.setdefault(kind, []).append(f"{label} ({r:.1f}x)")
                met += [kind] if kind not in met else []
            parts.append(f"{name} " + ", ".join(f"{kind} at {' and '.join(where)}" for kind, where in at.items()))
        scale = (f"measured / {MODEL_NAMES[links]} (within = {lo_ok:.2f}x to {hi_ok:.1f}x): " + "; ".join(parts) + ".")
        why = [f"{side}: {reasons[links, side]}" for side in ("above", "below") if side in met]
        scales.append(scale + (" " + "; ".join(why) + "." if why else ""))
    return [verdict, " ".join(scales)]   # two lines, whatever the outcome: the notebook prints each


def describe_busbw_spread(results, memcpy_Bps=None, world_size=4):
    """Sentences about busbw of several ops at one size: ``results`` maps op -> a ``sweep`` or ``race`` row.

    With ``race`` rows (their turns), reduce_scatter against all_reduce is weighed against the turns' spread;
    with ``memcpy_Bps`` (section 2's copy bandwidth), its extra time is held against what ProcessGroupGloo's
    clone of the input and copy of this rank's slice cost (S + S/n bytes copied), and the sentence says when the
    copies do not explain it (what does is then not known here). Introduced in 04_measuring_bandwidth.
    """
    import statistics

    bus = {op: r["busbw_Bps"] for op, r in results.items()}
    lo, hi = min(bus, key=bus.get), max(bus, key=bus.get)
    lines = [f"busbw spans {bus[hi] / bus[lo]:.1f}x, from {lo} (lowest) to {hi} (highest)"]
    if "reduce_scatter" not in results or "all_reduce" not in results:
        return lines
    rs, ar = results["reduce_scatter"], results["all_reduce"]
    turns_rs, turns_ar = _turns(rs), _turns(ar)
    spread = turns_rs is not None and turns_ar is not None
    within = spread and spread_overlaps(turns_rs, turns_ar)
    t = rs["time_s"] / ar["time_s"]
    if t > 1.25:
        how = "longer than the all-reduce itself"
    elif t >= 0.8:
        how = "about as long"
    elif t >= 0.6:
        how = "less, but more than the half that an optimal reduce-scatter, moving half the bytes, would take"
    else:
        how = "about half or less, as an optimal reduce-scatter, moving half the bytes, would take"
    if spread:
        how += (f"; the two ops' {len(turns_rs)} turns overlap: within the measured spread" if within else
                f"; beyond the spread of {len(turns_rs)} turns")
    lines.append(f"reduce_scatter took {t:.2f}x the time of all_reduce on the same buffer ({how})")
    ratio = bus["reduce_scatter"] / bus["all_reduce"]
    if ratio < 0.4:
        where = "below the 0.5 that a whole all-reduce and a slice would give: it costs even more than that"
    elif ratio <= 0.6:
        where = "near the 0.5 that a whole all-reduce and a slice give"
    elif ratio < 0.8:
        where = "between the 0.5 of a whole all-reduce and a slice and the 1 of a bandwidth-optimal reduce-scatter"
    else:
        where = "near the 1 of a bandwidth-optimal reduce-scatter: it moves no more than it must"
    if spread:
        k = ratio * rs["time_s"] / ar["time_s"]          # the bus factors' ratio: busbw ratio = k x t_ar / t_rs
        r_lo, r_hi = k * min(turns_ar) / max(turns_rs), k * max(turns_ar) / min(turns_rs)
        if r_lo <= 0.5 <= r_hi and not 0.4 <= ratio <= 0.6:
            where = ("away from the 0.5 that a whole all-reduce and a slice give, but within the measured spread of "
                     "it")
        where += (f" (the turns give {r_lo:.2f} to {r_hi:.2f}" + (", which includes 0.5)" if r_lo <= 0.5 <= r_hi
                                                                 else ")"))
    lines.append(f"reduce_scatter's busbw is {ratio:.2f}x all_reduce's, {where}")
    if memcpy_Bps:
        nbytes = rs["bytes"]
        copies = (nbytes + nbytes / world_size) / memcpy_Bps
        extra = rs["time_s"] - ar["time_s"]
        if spread:
            extra = statistics.median(turns_rs) - statistics.median(turns_ar)
        cost = (f"the clone and the slice copy {format_size(nbytes)} + 1/{world_size} of it, "
                f"{copies * 1e3:.2f} ms at section 2's copy bandwidth")
        if within:
            lines.append(f"reduce_scatter's extra time over all_reduce ({extra * 1e3:.1f} ms) is within the spread of "
                         f"the turns: this run cannot tell the copies from noise ({cost})")
        elif extra <= 0:
            lines.append(f"reduce_scatter came out {-extra * 1e3:.1f} ms faster than the all-reduce it runs inside "
                         "(a clone, a whole all-reduce, a slice): the load on this machine moved the two differently")
        elif extra <= 2 * copies:
            lines.append(f"reduce_scatter's extra time over all_reduce ({extra * 1e3:.1f} ms) is about what the copies "
                         f"cost: {cost}")
        else:
            lines.append(f"reduce_scatter's extra time over all_reduce ({extra * 1e3:.1f} ms) is {extra / copies:.0f}x "
                         f"what the copies cost ({cost}); what costs the rest is not known: this lesson does not "
                         "measure it (4 ranks copying at once on shared cores, each the slowest of 4, are slower than "
                         "one process alone, which is one suspect)")
    return lines
