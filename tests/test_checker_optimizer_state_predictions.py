"""course_utils.checks.check_optimizer_state_predictions (lesson 01, exercise 2) against the learner: the notebook's
untouched scaffold fails, each typical wrong answer fails with a reason that fits the exercise, right answers written
another way pass, and the explanation comes back only once the check passes.

    .venv/bin/python -m pytest -n 0 tests/test_checker_optimizer_state_predictions.py
"""
import pytest

from course_utils.checks import check_optimizer_state_predictions
from course_utils.checks.basics import solution_optimizer_state
from course_utils.models import make_model
from exercise_helpers import notebook_cell

N = sum(p.numel() for p in make_model(seed=0, d_in=64, d_hidden=512).parameters())


def test_the_untouched_scaffold_fails():
    source = notebook_cell("01_data_parallelism.ipynb", "check_optimizer_state_predictions(", solution=False)
    ns = {"n_params": N, "check_optimizer_state_predictions": check_optimizer_state_predictions,
          "solution_optimizer_state": solution_optimizer_state, "print": lambda *a: None}
    with pytest.raises(AssertionError, match=r'predicted\["SGD"\] is still None'):
        exec(compile(source, "01:exercise-2", "exec"), ns)


WRONG = {
    "Adam's two buffers for momentum": ({"SGD": 0, "SGD + momentum": 8 * N}, ["SGD + momentum", "too high",
                                                                             "one running buffer"]),
    "a buffer for plain SGD": ({"SGD": 4 * N, "SGD + momentum": 4 * N}, ['predicted["SGD"]',
                                                                        "remember between steps"]),
    "parameters, not bytes": ({"SGD": 0, "SGD + momentum": N}, ["too low", "velocity"]),
    "a missing key": ({"SGD": 0}, ["keys"]),
    "a string": ({"SGD": "0", "SGD + momentum": 4 * N}, ["should be a number of bytes, got str"]),
}


@pytest.mark.parametrize("name", list(WRONG))
def test_a_typical_wrong_answer_fails_with_a_reason(name):
    predicted, words = WRONG[name]
    with pytest.raises(AssertionError) as info:
        check_optimizer_state_predictions(predicted, N)
    for w in words:
        assert w in str(info.value), f"the message should say {w!r}: {info.value}"


@pytest.mark.parametrize("predicted", [solution_optimizer_state(N), {"SGD": 0.0, "SGD + momentum": 4.0 * N},
                                       {"SGD": 0, "SGD + momentum": N * 32 // 8}], ids=["solution", "floats", "bits"])
def test_a_right_answer_written_another_way_passes_and_gets_the_explanation(predicted):
    why = check_optimizer_state_predictions(predicted, N)
    assert "keeps nothing between steps" in why and "one float32 velocity buffer" in why, why
