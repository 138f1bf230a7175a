"""Lesson 04's self-checks (course_utils.checks.bandwidth: check_busbw, check_bucket_times, check_algbw_prediction)
tested against the learner: the untouched scaffold fails, each typical wrong answer fails with a reason the learner
can act on, and right answers written differently pass (exact, computed from the printed and rounded figures, or
rounded to 3 significant digits). The notebook's wiring is tested in tests/test_exercises_04_05.py.

    .venv/bin/python -m pytest -n 0 tests/test_checker_bench.py
"""
import math

import pytest

from course_utils import bench
from course_utils.checks import bandwidth, check_algbw_prediction, check_bucket_times, check_busbw

ROW = {"bytes": 4096, "iters": 20, "time_s": 2e-4, "algbw_Bps": 4096 / 2e-4, "busbw_Bps": 4096 / 2e-4 * 1.5}
# a measured row as format_table prints it: "4 KiB  20  5329.2 us" (time_s has more digits than the table shows)
MEASURED = {"bytes": 4096, "iters": 20, "time_s": 5.3291746e-3}
# section 4's fit as the stored lesson printed it: "alpha = 6172 us, 1/beta = 0.627 GB/s"; the exact values have
# more digits than the print shows
ALPHA, BETA = 6171.8437e-6, 1 / 0.62736e9
PRINTED_ALPHA, PRINTED_BETA = 6172e-6, 1 / 0.627e9
# section 7's peak as printed: "peak busbw 0.863 GB/s"
PEAK, PRINTED_PEAK = 0.86318e9, 0.863e9


def _verdict(check, *args):
    try:
        check(*args)
    except AssertionError as exc:
        return str(exc)
    return None


# == exercise 1: busbw by hand ===================================================================
def test_busbw_scaffold_and_wrong_answers_fail_with_a_reason():
    assert "Set my_busbw" in _verdict(check_busbw, None, ROW, 4)  # the unmodified scaffold
    algbw = ROW["bytes"] / ROW["time_s"]
    wrong = {
        "That is algbw": algbw,
        "reduce-scatter's or all-gather's": algbw * 3 / 4,
        "divided algbw by the bus factor": algbw / 1.5,
        "wrong unit": algbw * 1.5 / 1e9,
        "the busbw of this row": algbw * 2,
        "should be a number": "1.2e8",
    }
    for reason, value in wrong.items():
        verdict = _verdict(check_busbw, value, ROW, 4)
        assert verdict and reason in verdict, (reason, verdict)


def test_busbw_right_answers_written_differently_pass():
    right = bandwidth.solution_busbw(MEASURED, world_size=4)
    from_table = 4096 / 5329.2e-6 * 2 * 3 / 4            # the learner's arithmetic on the printed line
    for answer in (right, from_table, float(f"{right:.3g}"), float(f"{right:.4g}"), float(f"{from_table:.3g}"),
                   MEASURED["bytes"] / MEASURED["time_s"] * 1.5, int(right)):
        assert _verdict(check_busbw, answer, MEASURED, 4) is None, answer
    assert "5329.2 us" in bench.format_table([{**MEASURED, "algbw_Bps": 0.0, "busbw_Bps": 0.0}])


def test_busbw_near_misses_get_a_percentage_never_1x():
    right = bandwidth.solution_busbw(MEASURED, world_size=4)
    wrong = {
        r"0\.55% above the busbw of this row .*rounded": 4096 / 5.3e-3 * 1.5,    # the time rounded to 5.3 ms
        r"table prints microseconds \(us\)": 4096 / 5329.2 * 1.5,             # time taken in us, not s
        r"1 KiB = 1024 bytes.*Use row\['bytes'\] \(4096\)": 4000 / MEASURED["time_s"] * 1.5,
        r"That is algbw .*bus factor for n = 4": 4096 / 5329.2e-6,
        r"is 2x the busbw of this row .*Start from algbw": 2 * right,
    }
    import re

    for reason, value in wrong.items():
        verdict = _verdict(check_busbw, value, MEASURED, 4)
        assert verdict and re.search(reason, verdict), (reason, verdict)
    for k in range(-49, 50):
        verdict = _verdict(check_busbw, right * (1 + k / 1000), MEASURED, 4)
        assert verdict is None or ("1x the busbw" not in verdict and "%" in verdict), (k, verdict)


# == exercise 2: DDP's buckets on this machine ====================================================
def test_bucket_times_scaffold_and_wrong_answers_fail_with_a_reason():
    assert "Set my_times" in _verdict(check_bucket_times, {"first": None, "full": None}, ALPHA, BETA)
    assert "Set my_times" in _verdict(check_bucket_times, None, ALPHA, BETA)
    right = bandwidth.solution_bucket_times(ALPHA, BETA)
    wrong = {
        "binary": {"first": ALPHA + BETA * 10**6, "full": right["full"]},
        "left out alpha": {"first": BETA * 2**20, "full": right["full"]},
        "caps the FIRST bucket at 1 MiB": {"first": right["full"], "full": right["full"]},
        "what the model predicts": {"first": right["first"], "full": 2 * right["full"]},
        r"off by 10\*\*6": {"first": right["first"], "full": ALPHA * 1e6 * 1e-6 + BETA * 25 * 2**20 * 1e-6},
        "positive number of seconds": {"first": "7.8 ms", "full": right["full"]},
        # the printed figures, rounded further than they are printed: a percentage and what to keep
        r"above the right value": {"first": 7.9e-3, "full": right["full"]},
    }
    import re

    for reason, value in wrong.items():
        verdict = _verdict(check_bucket_times, value, ALPHA, BETA)
        assert verdict and re.search(reason, verdict), (reason, verdict)
        assert "is 1x" not in verdict and "1x what" not in verdict, verdict


def test_bucket_times_right_answers_written_differently_pass():
    """Answers computed from the printed, rounded alpha and 1/beta were refused with "is 1x"."""
    exact = bandwidth.solution_bucket_times(ALPHA, BETA)
    printed = {"first": PRINTED_ALPHA + PRINTED_BETA * 2**20, "full": PRINTED_ALPHA + PRINTED_BETA * 25 * 2**20}
    by_hand = {"first": 6172e-6 + 1048576 / 0.627e9, "full": 6172e-6 + 25 * 1048576 / 0.627e9}
    three_digits = {k: float(f"{v:.3g}") for k, v in exact.items()}
    assert printed != exact, "the printed figures must differ from the exact ones for this test to mean anything"
    for answer in (exact, printed, by_hand, three_digits):
        assert _verdict(check_bucket_times, answer, ALPHA, BETA) is None, answer
    assert math.isclose(exact["first"], ALPHA + BETA * 2**20) and math.isclose(exact["full"], ALPHA + BETA * 25 * 2**20)


# == exercise 3: algbw at other world sizes =======================================================
def test_algbw_prediction_scaffold_and_wrong_answers_fail_with_a_reason():
    assert "Set my_algbw" in _verdict(check_algbw_prediction, {2: None, 8: None}, PEAK)
    wrong = {
        "multiplied by the bus factor": {2: PEAK * 1.0, 8: PEAK * 7 / 4},
        "the algbw at 4 ranks": {2: PEAK / 1.5, 8: PEAK / 1.5},
        "keeps busbw constant": {2: PEAK, 8: PEAK},
        "not GB/s": {2: PEAK / 1e9, 8: PEAK * 4 / 7 / 1e9},
        r"n = 8: .* below the right value .*rounded": {2: PEAK, 8: 0.49e9},
    }
    import re

    for reason, value in wrong.items():
        verdict = _verdict(check_algbw_prediction, value, PEAK)
        assert verdict and re.search(reason, verdict), (reason, verdict)


def test_algbw_prediction_right_answers_written_differently_pass():
    exact = bandwidth.solution_algbw_prediction(PEAK)
    printed = {2: PRINTED_PEAK / 1, 8: PRINTED_PEAK / (2 * 7 / 8)}   # from "peak busbw 0.863 GB/s"
    three_digits = {n: float(f"{v:.3g}") for n, v in exact.items()}
    for answer in (exact, printed, three_digits, {2: 0.863e9, 8: 0.863e9 * 4 / 7}):
        assert _verdict(check_algbw_prediction, answer, PEAK) is None, answer
    assert math.isclose(exact[2], PEAK) and math.isclose(exact[8], PEAK * 4 / 7)


def test_a_failed_self_check_shows_the_learners_line_and_the_verdict():
    try:
        check_bucket_times(None, ALPHA, BETA)  # the learner's line
    except AssertionError as exc:
        shown = exc._render_traceback_()  # what IPython shows instead of the full traceback
    else:
        raise AssertionError("the scaffold must fail")
    assert not any("course_utils" in line for line in shown), f"the checker's frames are hidden:\n{shown}"
    assert "check_bucket_times(None, ALPHA, BETA)" in shown[-2], shown


@pytest.mark.parametrize("check, args", [(check_busbw, (ROW, 4)), (check_bucket_times, (ALPHA, BETA)),
                                         (check_algbw_prediction, (PEAK,))])
def test_a_boolean_or_a_string_is_not_a_number(check, args):
    for value in (True, "1e9"):
        answer = value if check is check_busbw else (
            {"first": value, "full": value} if check is check_bucket_times else {2: value, 8: value})
        assert _verdict(check, answer, *args), (check.__name__, value)
