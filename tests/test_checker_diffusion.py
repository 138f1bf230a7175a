"""check_largest_micro_batch (18_diffusion_on_two_rtx_3060s's exercise): the scaffold and each typical wrong function
fail with the hint for their mistake; right functions written differently (a loop, integer division, a float that is
whole) pass.

    .venv/bin/python -m pytest -n 0 tests/test_checker_diffusion.py
"""
import math

import pytest

from course_utils.checks import check_largest_micro_batch as wrapped
from course_utils.checks.diffusion import check_largest_micro_batch
from course_utils.diffusion import solution_largest_micro_batch

GiB = 2 ** 30


def verdict(fn):
    try:
        check_largest_micro_batch(fn)
    except AssertionError as exc:
        return str(exc)
    return None


def scaffold(peak_at_1, peak_at_4, card_gib, usable=0.85):
    raise NotImplementedError("write largest_micro_batch")


def by_loop(peak_at_1, peak_at_4, card_gib, usable=0.85):
    per = (peak_at_4 - peak_at_1) / 3
    b = 0
    while peak_at_1 + b * per <= usable * card_gib * 2 ** 30:      # peak at b + 1 samples
        b += 1
    return b


def by_integer_division(peak_at_1, peak_at_4, card_gib, usable=0.85):
    slope = (peak_at_4 - peak_at_1) / 3
    return max(0, int((usable * card_gib * GiB - (peak_at_1 - slope)) // slope))


def as_float(peak_at_1, peak_at_4, card_gib, usable=0.85):
    return float(solution_largest_micro_batch(peak_at_1, peak_at_4, card_gib, usable))


@pytest.mark.parametrize("fn", [solution_largest_micro_batch, by_loop, by_integer_division, as_float])
def test_right_functions_pass(fn):
    assert verdict(fn) is None, verdict(fn)


def _line(peak_at_1, peak_at_4):
    per = (peak_at_4 - peak_at_1) / 3
    return per, peak_at_1 - per


def in_gb(p1, p4, card_gib, usable=0.85):
    per, fixed = _line(p1, p4)
    return max(0, math.floor((usable * card_gib * 1e9 - fixed) / per))


def no_margin(p1, p4, card_gib, usable=0.85):
    per, fixed = _line(p1, p4)
    return max(0, math.floor((card_gib * GiB - fixed) / per))


def rounded(p1, p4, card_gib, usable=0.85):
    per, fixed = _line(p1, p4)
    return max(0, round((usable * card_gib * GiB - fixed) / per))


def proportional(p1, p4, card_gib, usable=0.85):
    return math.floor(usable * card_gib * GiB / p1)


def share_of_four(p1, p4, card_gib, usable=0.85):
    return math.floor(usable * card_gib * GiB / (p4 / 4))


def negative(p1, p4, card_gib, usable=0.85):
    per, fixed = _line(p1, p4)
    return math.floor((usable * card_gib * GiB - fixed) / per)


def not_whole(p1, p4, card_gib, usable=0.85):
    per, fixed = _line(p1, p4)
    return (usable * card_gib * GiB - fixed) / per


def off_by_one(p1, p4, card_gib, usable=0.85):
    return solution_largest_micro_batch(p1, p4, card_gib, usable) + 1


@pytest.mark.parametrize("fn, reason", [
    (scaffold, "still raises NotImplementedError"),
    (in_gb, "multiply by 2**30, not 1e9"),
    (no_margin, "only `usable` of the card"),
    (rounded, "round down"),
    (proportional, "not proportional"),
    (share_of_four, "not a sample's share"),
    (negative, "0, not a negative"),
    (not_whole, "a whole number of samples"),
    (off_by_one, "the largest b with that peak"),
])
def test_wrong_functions_fail_with_their_reason(fn, reason):
    message = verdict(fn)
    assert message is not None and reason in message, f"{fn.__name__}: expected {reason!r}, got {message!r}"


def test_the_notebook_imports_the_wrapped_checker():
    assert getattr(wrapped, "_verdict_only", False), "course_utils.checks must wrap check_largest_micro_batch"
    with pytest.raises(AssertionError) as info:
        wrapped(scaffold)
    assert info.value.__traceback__ is None or "checks/diffusion.py" not in str(info.traceback[-1].path)
