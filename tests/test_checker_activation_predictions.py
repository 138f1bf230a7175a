"""course_utils.checks.check_activation_predictions (lesson 01, exercise 1) against the learner: the notebook's
untouched scaffold fails, each typical wrong answer fails with a reason that fits the exercise and never states the
answer, and right answers written another way pass (worked out from a printed, rounded size; ints or floats).
The explanation it returns, printed only once the check passes, is the answer after the run.

    .venv/bin/python -m pytest -n 0 tests/test_checker_activation_predictions.py
"""
import pytest

from course_utils.checks import check_activation_predictions
from course_utils.checks.basics import _activation_bytes, solution_activation_predictions
from exercise_helpers import notebook_cell

ACT = (64 + 512 + 1 + 1) * 4                # bytes per sample of the MLP: input, ReLU output, prediction, target
RIGHT = 96 * ACT        # 384 samples: 96 per rank on 4 ranks, and 96 per micro-batch with accum_steps = 4


def test_the_rate_is_what_the_lesson_measures():
    assert _activation_bytes(96) == RIGHT and _activation_bytes(64) == 64 * ACT


def test_the_untouched_scaffold_fails():
    source = notebook_cell("01_data_parallelism.ipynb", "check_activation_predictions(", solution=False)
    ns = {"one_device": {64: {"activations": 64 * ACT}}, "check_activation_predictions": check_activation_predictions,
          "solution_activation_predictions": solution_activation_predictions, "print": lambda *a: None}
    with pytest.raises(AssertionError, match="predicted_4_ranks is still None: set it to your answer, in bytes, "
                                             "computed from act_per_sample"):
        exec(compile(source, "01:exercise-1", "exec"), ns)


WRONG = {
    "the whole global batch on each rank": ((384 * ACT, RIGHT), ["predicted_4_ranks", "all 384 samples",
                                                                 "its own micro-batch only"]),
    "the whole global batch on one device": ((RIGHT, 384 * ACT), ["predicted_1_device_accum_4", "frees",
                                                                  "one micro-batch is alive at a time"]),
    "divided twice": ((24 * ACT, RIGHT), ["predicted_4_ranks", "the global batch, split how?"]),
    "the lesson's old batch": ((64 * ACT, RIGHT), ["predicted_4_ranks", "64 samples' worth", "how many is that"]),
    "in KiB": ((RIGHT / 1024, RIGHT), ["looks like KiB", "wants bytes"]),
    "a string": (("96 samples", RIGHT), ["should be a number of bytes, got str"]),
    "one left as None": ((RIGHT, None), ["predicted_1_device_accum_4 is still None"]),
}


@pytest.mark.parametrize("name", list(WRONG))
def test_a_typical_wrong_answer_fails_with_a_reason(name):
    args, words = WRONG[name]
    with pytest.raises(AssertionError) as info:
        check_activation_predictions(*args)
    message = str(info.value)
    for w in words:
        assert w in message, f"the message should say {w!r}: {message}"
    for answer in (str(int(RIGHT)), f"{RIGHT / 1024:g}", "96"):
        assert answer not in message, f"the message states the answer {answer!r}: {message}"


@pytest.mark.parametrize("answers", [
    solution_activation_predictions(ACT),
    (int(RIGHT), int(RIGHT)),
    (144.5 * 1024 / 64 * 96, 144.5 * 1024 * 1.5),     # from "b=64: 144.5 KiB" printed by the lesson
    (36.1 * 1024 * 6, 36.1 * 1024 * 6),               # from "b=16: 36.1 KiB", rounded: 0.07 % off
    (216.8 * 1024, 216.8 * 1024),                     # the answer rounded as format_bytes would print it
], ids=["solution", "ints", "from 144.5 KiB", "from 36.1 KiB", "from 216.8 KiB"])
def test_a_right_answer_written_another_way_passes_and_gets_the_explanation(answers):
    why = check_activation_predictions(*answers)
    assert "96 samples of the 384" in why and "not the number of devices" in why, why
