"""check_zero2_peak_units (14_will_it_fit's exercise): the scaffold and each typical wrong count fail with the
piece they miss; the count written another way (bytes, then units; a value copied from a 2-decimal print) passes.

    .venv/bin/python -m pytest -n 0 tests/test_checker_zero2_peak.py
"""
import pytest

from course_utils.checks.zero import check_zero2_peak_units, solution_zero2_peak_units


def verdict(answer):
    try:
        check_zero2_peak_units(answer)
    except AssertionError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("answer", [
    solution_zero2_peak_units(4),
    (4 + 8 / 4 + 4 + 4 + 4 / 4) * 14 / 16,       # bytes a parameter, then units
    13.12, 13.13,                                # copied from a print with 2 decimals
])
def test_right_counts_pass(answer):
    assert verdict(answer) is None, verdict(answer)


@pytest.mark.parametrize("answer, reason", [
    (None, "still None"),
    ("13.1", "should be a number"),
    (True, "should be a number"),
    ((4 + 2 + 1) * 14 / 16, "leaves out the bucket and gloo's copy"),
    ((4 + 2 + 4 + 1) * 14 / 16, "leaves out gloo's copy"),
    ((1 + 2 + 4 + 4 + 1) * 14 / 16, "shards the weights"),
    ((4 + 8 + 4 + 4 + 1) * 14 / 16, "keeps the moments whole"),
    (15.75, "W = 2 count"),
    (15, "bytes per parameter"),
    (12, "is not ZeRO-2's peak"),
])
def test_wrong_counts_fail_with_their_reason(answer, reason):
    message = verdict(answer)
    assert message is not None and reason in message, f"{answer!r}: expected a verdict with {reason!r}, got {message!r}"
