"""Self-checks of 04_measuring_bandwidth's exercises, and the course's solutions to them.

- ``check_busbw``: exercise 1, busbw computed by hand from one row of the sweep;
- ``check_bucket_times``: exercise 2, the alpha-beta model's time for DDP's first and full buckets;
- ``check_algbw_prediction``: exercise 3, algbw at 2 and 8 ranks if busbw stayed constant.

Each accepts an answer computed from the figures as the lesson prints them, and names the usual slips (a bus
factor upside down, GB/s for B/s, decimal for binary sizes); tests/test_checker_bench.py holds the verdicts.
"""
import math

from course_utils.bench import bus_factor, format_size

__all__ = ["check_busbw", "check_bucket_times", "check_algbw_prediction", "solution_busbw", "solution_bucket_times",
           "solution_algbw_prediction"]


# -- self-checks ---------------------------------------------------------------------
def _near(a, b, rtol=1e-6):
    return abs(a - b) <= rtol * abs(b)


def _written_rounding(x):
    """(significant digits of ``x`` as written, half a unit of its last digit): 1150000.0 -> (3, 5000.0)."""
    if not x or not math.isfinite(x):
        return 0, 0.0
    mantissa = f"{abs(x):.15e}".split("e")[0].replace(".", "").rstrip("0")  # 15 digits: a float's own noise
    digits = len(mantissa) if len(mantissa) < 15 else 15
    exponent = math.floor(math.log10(abs(x)))
    return digits, 0.5 * 10.0 ** (exponent - digits + 1)


PRINTED_TIME_S = 0.05e-6  # format_table prints time_s in microseconds with one decimal: within 0.05 us


def check_busbw(my_busbw, row, world_size):
    """Exercise 1 of 04: ``my_busbw`` (bytes per second) computed by hand from ``row``'s bytes and time_s.

    Rounding the printed figures is accepted: an answer computed from the time as ``format_table`` prints it
    (microseconds, one decimal: ``PRINTED_TIME_S / time_s`` relative), and an answer written with 3 or more
    significant digits, to within half a unit of its last digit (``1.15e6`` for 1152963.9). Fewer digits, or a time
    rounded further than the table's, fail with a message that says so (never a bare "1x").
    """
    __tracebackhide__ = True
    if my_busbw is None:
        raise AssertionError(
            "Set my_busbw (bytes per second, from row['bytes'] and row['time_s']) and run the cell again.")
    if not isinstance(my_busbw, (int, float)) or isinstance(my_busbw, bool):
        raise AssertionError(f"my_busbw should be a number of bytes per second, got {type(my_busbw).__name__}.")
    rtol = max(1e-6, 1.01 * PRINTED_TIME_S / row["time_s"])  # the printed time's rounding, with a little slack

    def near(a, b):
        return _near(a, b, rtol)

    n = world_size
    algbw_ = row["bytes"] / row["time_s"]
    right = algbw_ * 2 * (n - 1) / n
    digits, half_unit = _written_rounding(my_busbw)
    if near(my_busbw, right) or (digits >= 3 and abs(my_busbw - right) <= 1.01 * half_unit + rtol * abs(right)):
        return
    if near(my_busbw, algbw_):
        raise AssertionError("That is algbw (bytes / time), the speed the caller sees. busbw multiplies it by the "
                             f"all-reduce's bus factor for n = {n} ranks (section 1).")
    if near(my_busbw, algbw_ * (n - 1) / n):
        raise AssertionError(
            "That factor is reduce-scatter's or all-gather's. An all-reduce is a reduce-scatter AND an "
            "all-gather: each rank sends twice as much.")
    if near(my_busbw, algbw_ * n / (2 * (n - 1))):
        raise AssertionError("You divided algbw by the bus factor: busbw is larger than algbw for an all-reduce.")
    if near(my_busbw, right / 1e9) or near(my_busbw, right / 2**30):
        raise AssertionError("Right formula, wrong unit: my_busbw is in bytes per second, not GB/s.")
    if near(my_busbw, right * 1e-6) or near(my_busbw, right * 1e-3):
        raise AssertionError(
            "Right formula, wrong unit: row['time_s'] is in seconds; the table prints microseconds (us). "
            "my_busbw is in bytes per second.")
    for binary, decimal in ((2**10, 10**3), (2**20, 10**6)):
        if near(my_busbw, right * decimal / binary):
            raise AssertionError(
                f"Right formula, but the bytes are decimal: the table's sizes are binary (1 KiB = {2**10} "
                f"bytes, 1 MiB = {2**20}). Use row['bytes'] ({row['bytes']}).")
    ratio = my_busbw / right
    if abs(ratio - 1) < 0.05:
        raise AssertionError(
            f"{my_busbw:.6g} B/s is {abs(ratio - 1):.2%} {'above' if ratio > 1 else 'below'} the busbw of "
            f"this row ({right:.6g} B/s): right formula, but a rounded number. Compute it from row['bytes'] "
            "and row['time_s'] as they are (or from the table's time, to its 0.1 us), and keep at least 3 "
            "significant digits; a time rounded further than the table's (ms, or fewer digits) is too coarse.")
    raise AssertionError(
        f"{my_busbw:.4g} B/s is {ratio:.3g}x the busbw of this row ({right:.4g} B/s). Start from algbw = "
        f"row['bytes'] / row['time_s'], then apply the all-reduce's bus factor for n = {n} ranks (section 1).")


PRINTED_ALPHA_S = 0.5e-6          # section 4 prints alpha in microseconds, no decimal: within 0.5 us
PRINTED_BANDWIDTH_BPS = 0.0005e9  # it prints 1/beta, and section 7 the peak busbw, in GB/s with 3 decimals


def _accepts(got, right, rtol):
    """``got`` is ``right`` within ``rtol`` (what the printed figures' rounding allows), or written with 3 or more
    significant digits and within half a unit of its last digit (``1.15e6`` for 1152963.9)."""
    digits, half_unit = _written_rounding(got)
    rounded = any(got == float(f"{right:.{d}g}") for d in range(3, 16))  # 0.048 for 0.0479571: "0.0480", 3 digits
    return (_near(got, right, rtol) or rounded
            or (digits >= 3 and abs(got - right) <= 1.01 * half_unit + rtol * abs(right)))


def _near_miss(what, got, right, unit, printed):
    """The verdict for an answer within 5 % of ``right`` that ``_accepts`` refused, as a percentage (never "1x"),
    or None for an answer further off."""
    ratio = got / right
    if abs(ratio - 1) >= 0.05:
        return None
    return (f"{what}: {got:.6g} {unit} is {abs(ratio - 1):.2%} {'above' if ratio > 1 else 'below'} the right value "
            f"({right:.6g} {unit}): right formula, but a rounded number. Compute it from {printed} (or from the "
            "printed figures as they are printed), and keep at least 3 significant digits.")


def _is_number(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def check_bucket_times(my_times, alpha, beta):
    """Exercise 2 of 04: the alpha-beta model's time for DDP's first bucket and for a full default bucket.

    ``my_times`` maps "first" and "full" to seconds. The sizes are DDP's defaults, with ``bucket_cap_mb`` left
    unset: ``dist._DEFAULT_FIRST_BUCKET_BYTES`` (1 MiB) for the first bucket and 25 MiB for the others (passing
    any ``bucket_cap_mb``, even 25, makes the first cap ``bucket_cap_mb`` too: ``_BucketCapacityConfig.create``).
    An answer computed from the figures as section 4 prints them (alpha to 0.5 us, 1/beta to 0.0005 GB/s), or
    written with 3 or more significant digits, passes; a near miss gets a percentage and what to keep.
    """
    __tracebackhide__ = True
    import torch.distributed as dist

    if not isinstance(my_times, dict) or any(my_times.get(k) is None for k in ("first", "full")):
        raise AssertionError('Set my_times = {"first": ..., "full": ...} (seconds, from alpha and beta) and run again.')
    sizes = {"first": dist._DEFAULT_FIRST_BUCKET_BYTES, "full": 25 * 2**20}
    for key, size in sizes.items():
        t = my_times[key]
        if not _is_number(t):
            raise AssertionError(f'my_times["{key}"] should be a positive number of seconds, got {t!r}.')
        right = alpha + beta * size
        # the printed alpha's rounding, plus the printed 1/beta's (relative PRINTED_BANDWIDTH_BPS x beta) on beta S
        rtol = max(1e-6, 1.01 * (PRINTED_ALPHA_S + beta * size * PRINTED_BANDWIDTH_BPS * beta) / right)

        def near(a, b):
            return _near(a, b, rtol)

        if _accepts(t, right, rtol):
            continue
        decimal = {"first": 10**6, "full": 25 * 10**6}[key]
        if near(t, alpha + beta * decimal):
            raise AssertionError(
                f"{key}: DDP's sizes are binary: bucket_cap_mb=25 means 25 x 2**20 bytes, and the first "
                "bucket is 2**20 bytes (dist._DEFAULT_FIRST_BUCKET_BYTES), not 10**6.")
        if near(t, beta * size):
            raise AssertionError(f"{key}: you left out alpha, the fixed cost every all-reduce pays once.")
        if key == "first" and near(t, alpha + beta * 25 * 2**20):
            raise AssertionError("first: while bucket_cap_mb is left unset, DDP caps the FIRST bucket at 1 MiB "
                                 "(dist._DEFAULT_FIRST_BUCKET_BYTES), not at the 25 MiB default of the others.")
        if near(t, alpha * 1e-6 + beta * size) or near(t, alpha + beta * size * 1e-6) or near(t, right * 1e-6):
            raise AssertionError(
                f"{key}: a unit is off by 10**6: alpha and the times are in seconds (section 4 prints alpha "
                "in us), beta in seconds per byte, S in bytes.")
        miss = _near_miss(key, t, right, "s", "alpha and beta")
        if miss:
            raise AssertionError(miss)
        raise AssertionError(f"{key}: {t:.4g} s is {t / right:.3g}x what the model predicts for a bucket "
                             f"of {format_size(size)}: t = alpha + beta x S, with S in bytes.")


def check_algbw_prediction(my_algbw, busbw_Bps):
    """Exercise 3 of 04: algbw at 2 and 8 ranks if busbw stayed at ``busbw_Bps`` (an optimal all-reduce).

    An answer computed from the peak busbw as printed (GB/s, 3 decimals), or written with 3 or more significant
    digits, passes; a near miss gets a percentage and what to keep.
    """
    __tracebackhide__ = True
    if not isinstance(my_algbw, dict) or any(my_algbw.get(n) is None for n in (2, 8)):
        raise AssertionError("Set my_algbw = {2: ..., 8: ...} (bytes per second) and run the cell again.")
    rtol = max(1e-6, 1.01 * PRINTED_BANDWIDTH_BPS / busbw_Bps)   # the printed peak's rounding
    for n in (2, 8):
        right = busbw_Bps / bus_factor("all_reduce", n)
        got = my_algbw[n]
        if not _is_number(got):
            raise AssertionError(f"my_algbw[{n}] should be a positive number of bytes per second, got {got!r}.")
        if _accepts(got, right, rtol):
            continue
        if _near(got, busbw_Bps * bus_factor("all_reduce", n), rtol):
            raise AssertionError(
                f"n = {n}: you multiplied by the bus factor; busbw is algbw times it, so go the other way.")
        if _near(got, busbw_Bps / bus_factor("all_reduce", 4), rtol):
            raise AssertionError(f"n = {n}: that is the algbw at 4 ranks. The bus factor 2(n-1)/n depends on n: "
                                 "with busbw fixed, algbw changes with the number of ranks.")
        if _near(got, right / 1e9, rtol) or _near(got, right / 2**30, rtol):
            raise AssertionError(f"n = {n}: right formula, wrong unit: my_algbw is in bytes per second, not GB/s.")
        miss = _near_miss(f"n = {n}", got, right, "B/s", "peak")
        if miss:
            raise AssertionError(miss)
        raise AssertionError(f"n = {n}: {got:.4g} B/s is {got / right:.3g}x the algbw that keeps busbw constant: "
                             f"algbw = busbw / (2(n-1)/n) with n = {n}.")


# -- the course's solutions (try your own first) ------------------------------------------
def solution_busbw(row, world_size):
    return row["bytes"] / row["time_s"] * 2 * (world_size - 1) / world_size


def solution_bucket_times(alpha, beta):
    import torch.distributed as dist

    return {"first": alpha + beta * dist._DEFAULT_FIRST_BUCKET_BYTES, "full": alpha + beta * 25 * 2**20}


def solution_algbw_prediction(busbw_Bps):
    return {n: busbw_Bps / (2 * (n - 1) / n) for n in (2, 8)}
