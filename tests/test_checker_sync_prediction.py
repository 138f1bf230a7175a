"""check_sync_prediction, the self-check of 06_ddp_accumulation_no_sync exercise 1 (all-reduces and bytes per
optimizer step of accum_steps = 8, with and without no_sync), against the learner: the untouched scaffold fails,
each typical wrong prediction fails with a reason that names the mistake and never the number, and right answers
written differently pass (floats copied from a printed output, bytes written as a product or computed from the
model). Each answer replaces the scaffold's two lines in the notebook's own exercise cell; 2 gloo ranks, one
cluster for the module.

    .venv/bin/python -m pytest -n 0 tests/test_checker_sync_prediction.py
"""
import pytest

from exercise_helpers import notebook_cell, run_exercise_cell

GRAD_BYTES = 4 * 1153  # TinyMLP's 1,153 float32 gradients: one bucket
ONE_EACH = f'predicted_bytes = {{"without no_sync": {GRAD_BYTES}, "with no_sync": {GRAD_BYTES}}}'
SCAFFOLD = ('predicted = {"without no_sync": None, "with no_sync": None}',
            'predicted_bytes = {"without no_sync": None, "with no_sync": None}')


@pytest.fixture(scope="module")
def cluster(make_cluster):
    return make_cluster(2, timeout=60)


def exercise(predicted=None, predicted_bytes=None):
    """The notebook's exercise cell with USE_SOLUTION off and the learner's two lines (source text) in place."""
    source = notebook_cell("06_ddp_accumulation_no_sync.ipynb", "check_sync_prediction(", ddp_line=False,
                           solution=False)
    for old, new in zip(SCAFFOLD, (predicted, predicted_bytes)):
        assert old in source, f"the scaffold line {old!r} is no longer in the exercise cell"
        if new is not None:
            source = source.replace(old, new, 1)
    return source


def verdicts(cluster, source):
    both = cluster.run(run_exercise_cell, source)
    assert both[0] == both[1], f"both ranks must reach the same verdict: {both}"
    return both[0]


def test_the_stored_cell_passes_with_the_course_answer(cluster):
    source = notebook_cell("06_ddp_accumulation_no_sync.ipynb", "check_sync_prediction(", ddp_line=False)
    assert verdicts(cluster, source) is None


def test_the_untouched_scaffold_fails(cluster):
    message = verdicts(cluster, exercise())
    assert message and "fill in your prediction for ['without no_sync', 'with no_sync']" in message, message


WRONG = {  # name: (predicted, predicted_bytes, words the reason must hold)
    "bytes left as the scaffold": ('predicted = {"without no_sync": 8, "with no_sync": 1}', None,
                                   "predicted_bytes: fill in your prediction"),
    "a number instead of a dict": ('predicted = 8', None, "predicted must be a dict"),
    "one all-reduce either way": ('predicted = {"without no_sync": 1, "with no_sync": 1}', ONE_EACH,
                                  "every forward that runs outside no_sync"),
    "none with no_sync": ('predicted = {"without no_sync": 8, "with no_sync": 0}',
                          f'predicted_bytes = {{"without no_sync": {8 * GRAD_BYTES}, "with no_sync": 0}}',
                          "which micro-step's forward and backward ran outside it"),
    "one gradient's bytes without no_sync": (
        'predicted = {"without no_sync": 8, "with no_sync": 1}', ONE_EACH, "times the all-reduces"),
    "one byte per parameter": ('predicted = {"without no_sync": 8, "with no_sync": 1}',
                               f'predicted_bytes = {{"without no_sync": {8 * GRAD_BYTES}, "with no_sync": 1153}}',
                               "4 bytes each"),
}


@pytest.mark.parametrize("case", list(WRONG))
def test_a_wrong_prediction_fails_with_its_reason(cluster, case):
    predicted, predicted_bytes, words = WRONG[case]
    message = verdicts(cluster, exercise(predicted, predicted_bytes))
    assert message and words in message, f"{case}: expected {words!r} in\n{message}"
    assert str(8 * GRAD_BYTES) not in message and f"{8 * GRAD_BYTES:,}" not in message, "never the answer"


RIGHT = {
    "floats copied from a printed output": ('predicted = {"without no_sync": 8.0, "with no_sync": 1.0}',
                                            'predicted_bytes = {"with no_sync": 4612.0, "without no_sync": 36896.0}'),
    "bytes as a product": ('predicted = dict([("without no_sync", 8), ("with no_sync", 1)])',
                           'predicted_bytes = {"without no_sync": 8 * 1153 * 4, "with no_sync": 1153 * 4}'),
    "bytes computed from the model": (
        'predicted = {"without no_sync": 8, "with no_sync": 1}',
        "from course_utils.models import make_model; n = sum(p.numel() * p.element_size() for p in "
        'make_model().parameters()); predicted_bytes = {"without no_sync": 8 * n, "with no_sync": n}'),
}


@pytest.mark.parametrize("case", list(RIGHT))
def test_a_right_answer_written_differently_passes(cluster, case):
    assert verdicts(cluster, exercise(*RIGHT[case])) is None, case
