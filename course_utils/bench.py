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
           "save_measurements", "load_measurements", "DEFAULT_PATH"]


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
