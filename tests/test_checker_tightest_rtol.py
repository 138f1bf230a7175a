"""check_tightest_rtol, the self-check of 09_compression exercise 2 (the tightest power-of-ten rtol with which
check_comm_hook passes fp16_hook, and bf16_hook), against the learner: the untouched scaffold fails, each typical
wrong answer fails with a reason that fits its dtype and never names the answer, and right answers written
differently pass (a float copied from a printed output, a power written out, the rounding bound computed). The
notebook's own exercise cell runs in this process with the two lines replaced, its checks on one 2-rank gloo
cluster for the module.

    .venv/bin/python -m pytest -n 0 tests/test_checker_tightest_rtol.py
"""
import functools

import pytest

from course_utils import hooks
from course_utils.checks.comm_hook import check_tightest_rtol
from exercise_helpers import notebook_cell, solution_off

SCAFFOLD = {"fp16": "rtol_fp16 = None", "bf16": "rtol_bf16 = None"}
RIGHT_FP16, RIGHT_BF16 = "rtol_fp16 = 1e-3", "rtol_bf16 = 1e-2"


@pytest.fixture(scope="module")
def cluster(make_cluster):
    return make_cluster(2, timeout=120)


def run_exercise(cluster, fp16=None, bf16=None, solution=False):
    """Run the notebook's exercise cell here, its checks on ``cluster``: None if it passed, else the verdict."""
    source = notebook_cell("09_compression.ipynb", "check_tightest_rtol(", ddp_line=False)
    if not solution:
        source = solution_off(source)
    for key, line in (("fp16", fp16), ("bf16", bf16)):
        assert SCAFFOLD[key] in source, f"the scaffold line {SCAFFOLD[key]!r} is no longer in the exercise cell"
        if line is not None:
            source = source.replace(SCAFFOLD[key], line, 1)
    imported = "from course_utils.checks import check_tightest_rtol\n"
    assert imported in source, "the cell imports its self-check from course_utils.checks"
    source = source.replace(imported, "")   # this module's cluster instead: partial(..., cluster=cluster)
    try:
        exec(compile(source, "exercise_2", "exec"),
             {"hooks": hooks, "check_tightest_rtol": functools.partial(check_tightest_rtol, cluster=cluster)})
    except AssertionError as exc:
        return str(exc)
    return None


def test_the_stored_cell_passes_with_the_course_answers(cluster, capsys):
    assert (hooks.fp16_tightest_rtol(), hooks.bf16_tightest_rtol()) == (pytest.approx(1e-3), pytest.approx(1e-2))
    assert run_exercise(cluster, solution=True) is None
    assert "the course's answers passed" in capsys.readouterr().out


def test_the_untouched_scaffold_fails(cluster):
    message = run_exercise(cluster)
    assert message and "the rtol for fp16_hook is None" in message, message


WRONG = {  # name: (fp16 line, bf16 line, words the reason must hold)
    "2**-11 read as about 1e-4": ("rtol_fp16 = 1e-4", RIGHT_BF16, "too tight: check_comm_hook rejects fp16_hook"),
    "passes, but not the tightest": ("rtol_fp16 = 1e-2", RIGHT_BF16, "so does rtol=0.001"),
    "the rounding bound itself": ("rtol_fp16 = 2 ** -11", RIGHT_BF16, "is not a power of ten"),
    "bf16 left as the scaffold": (RIGHT_FP16, None, "the rtol for bf16_hook is None"),
    "float16's answer for bfloat16": (RIGHT_FP16, "rtol_bf16 = 1e-3", "3 significant bits fewer than float16"),
    "bf16 passes, but not the tightest": (RIGHT_FP16, "rtol_bf16 = 0.1", "so does rtol=0.01"),
    "bf16 as a string": (RIGHT_FP16, "rtol_bf16 = '1e-2'", "is not a power of ten"),
}


@pytest.mark.parametrize("case", list(WRONG))
def test_a_wrong_answer_fails_with_its_reason(cluster, case):
    fp16, bf16, words = WRONG[case]
    message = run_exercise(cluster, fp16, bf16)
    assert message and words in message, f"{case}: expected {words!r} in\n{message}"
    if "too tight" in message:
        bits = "8 significant bits" if "bf16_hook" in message else "11 significant bits"
        assert bits in message, f"{case}: the hint names its dtype's bits:\n{message}"


RIGHT = {
    "copied from a printed output": ("rtol_fp16 = 0.001", "rtol_bf16 = 0.01"),
    "powers written out": ("rtol_fp16 = 10 ** -3", "rtol_bf16 = 10.0 ** -2"),
    "computed from the significant bits": ("import math; rtol_fp16 = 10 ** math.ceil(math.log10(2 ** -11))",
                                           "rtol_bf16 = 1 / 100"),
}


@pytest.mark.parametrize("case", list(RIGHT))
def test_a_right_answer_written_differently_passes(cluster, case):
    assert run_exercise(cluster, *RIGHT[case]) is None, case
