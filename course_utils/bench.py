"""Bandwidth measurement in the style of nccl-tests / all_reduce_bench.

Introduced in 04_measuring_bandwidth (``fit_alpha_beta`` already in 03_all_reduce_by_hand).

The formulas (nccl-tests, doc/PERFORMANCE.md). For an operation on a buffer of S bytes that
takes t seconds on n ranks:

    algbw = S / t                               (what the caller sees)
    busbw = algbw x bus_factor(op, n)           (what each link carries: comparable across n and ops)

    bus_factor: all_reduce 2(n-1)/n; reduce_scatter, all_gather, all_to_all (n-1)/n; broadcast, reduce 1

S is the size of the whole buffer: for all_gather the gathered output, for reduce_scatter the
input (n times one rank's share). busbw equals the link speed when the algorithm is bandwidth
optimal, so it is the number to compare with the hardware's ceiling.

The alpha-beta (latency-bandwidth) model: sending a message of S bytes costs t = alpha + beta x S,
alpha in seconds (latency), beta in seconds per byte (1 / bandwidth). ``fit_alpha_beta`` fits it.

Saved measurements (``save_measurements`` / ``load_measurements``), a JSON object::

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
      "alpha_s": 0.0001,             # fitted latency of dist.all_reduce, seconds
      "beta_s_per_byte": 1.0e-9,     # fitted inverse bandwidth, seconds per byte
      "memcpy_Bps": 5.0e9,           # one process's tensor copy bandwidth (bytes copied per second)
      "peak_busbw_Bps": 1.0e9,
      "torch": "2.13.0+cpu", "created_unix": 1700000000.0
    }

Bandwidths are in bytes per second (divide by 1e9 for GB/s). ``time_s`` is the mean time of one
call, the slowest rank's (a collective is done when its last rank is done).
"""
import json
import os
import time
from pathlib import Path

import torch

__all__ = ["BUS_FACTORS", "bus_factor", "algbw", "busbw", "default_sizes", "iterations_for", "time_op",
           "sweep", "fit_alpha_beta", "memcpy_bandwidth", "format_size", "format_table",
           "save_measurements", "load_measurements", "DEFAULT_PATH"]

DEFAULT_PATH = Path(__file__).resolve().parent.parent / "notebooks" / ".measurements" / "bandwidth.json"
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


def _buffers(op, nbytes, world_size, dtype):
    numel = max(1, nbytes // torch.tensor([], dtype=dtype).element_size())
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        numel -= numel % world_size
        whole, share = torch.ones(numel, dtype=dtype), torch.ones(numel // world_size, dtype=dtype)
        if op == "all_gather":
            return (whole, share)               # fn(output, input)
        if op == "reduce_scatter":
            return (share, whole)               # fn(output, input)
        return (whole, torch.ones(numel, dtype=dtype))
    if op in ("broadcast", "reduce"):
        return (torch.ones(numel, dtype=dtype), 0)  # fn(tensor, src_or_dst)
    return (torch.ones(numel, dtype=dtype),)        # all_reduce: fn(tensor)


def time_op(fn, op, nbytes, iters, warmup=1, dtype=torch.float32):
    """Run on every rank: mean seconds per call of ``fn`` on an ``nbytes`` buffer, slowest rank's.

    ``fn``'s arguments depend on ``op``: all_reduce ``fn(tensor)``; broadcast/reduce
    ``fn(tensor, 0)``; all_gather and reduce_scatter ``fn(output, input)`` (``dist.*_into_tensor``
    / ``dist.reduce_scatter_tensor`` style). Introduced in 04_measuring_bandwidth.
    """
    import torch.distributed as dist

    args = _buffers(op, nbytes, dist.get_world_size(), dtype)
    for _ in range(warmup):
        fn(*args)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn(*args)
    elapsed = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def sweep(fn, sizes=None, op="all_reduce", dtype=torch.float32, budget_bytes=32 * 2**20, max_iters=20):
    """Run on every rank: time ``fn`` at each size; the same list of rows on every rank.

    Each row: {"bytes", "iters", "time_s", "algbw_Bps", "busbw_Bps"} (see the module docstring).
    Introduced in 04_measuring_bandwidth.
    """
    import torch.distributed as dist

    n = dist.get_world_size()
    rows = []
    for nbytes in sizes or default_sizes():
        iters = iterations_for(nbytes, budget_bytes, hi=max_iters)
        t = time_op(fn, op, nbytes, iters, dtype=dtype)
        rows.append({"bytes": int(nbytes), "iters": iters, "time_s": t,
                     "algbw_Bps": algbw(nbytes, t), "busbw_Bps": busbw(nbytes, t, n, op)})
    return rows


def fit_alpha_beta(sizes, times):
    """Fit t = alpha + beta x S to measured (size in bytes, seconds) pairs; return (alpha, beta).

    Introduced in 03_all_reduce_by_hand. Least squares on the RELATIVE error (weights 1/t^2), so the
    small sizes, where alpha shows, count as much as the large ones, where beta does. alpha is kept
    >= 0 (a negative latency is noise): then beta alone is refitted.
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
    alpha, beta = fit_alpha_beta([r["bytes"] for r in rows], [r["time_s"] for r in rows])
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
