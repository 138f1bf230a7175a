"""check_late_flag, the self-check of 11_capstone_micro_ddp's exercise 2 (a MyMicroDDP that reads
require_backward_grad_sync at backward time, and how many of 3 backwards all-reduce when only the backwards of the
first two run inside no_sync()), against the learner: the untouched scaffold fails, typical wrong answers fail with
a reason that names the mistake and never the counts, right answers written differently pass. Each answer replaces
the scaffold's lines in the notebook's own exercise cell, with section 5's MyMicroDDP written (the course's
LessonMicroDDP); 2 gloo ranks, one cluster for the module.

    .venv/bin/python -m pytest -n 0 tests/test_checker_late_flag.py
"""
import pytest

from exercise_helpers import notebook_cell, run_exercise_cell

NOTEBOOK = "11_capstone_micro_ddp.ipynb"
PREAMBLE = """import contextlib
from course_utils import micro_ddp as course
MyMicroDDP = course.LessonMicroDDP   # section 5 written
"""
SCAFFOLD_BODY = '        raise NotImplementedError("write LateFlagMicroDDP.grad_ready, then run this cell again")'
SCAFFOLD_PREDICTION = 'predicted = {"torch DDP": None, "yours": None}'
RIGHT_BODY = "        self.sync = self.require_backward_grad_sync\n        super().grad_ready(p)"
RIGHT_PREDICTION = 'predicted = {"torch DDP": 3, "yours": 1}'


@pytest.fixture(scope="module")
def cluster(make_cluster):
    return make_cluster(2, timeout=60)


def exercise(body=None, prediction=None, solution=False):
    source = notebook_cell(NOTEBOOK, "class LateFlagMicroDDP", ddp_line=False, solution=solution)
    for old, new in ((SCAFFOLD_BODY, body), (SCAFFOLD_PREDICTION, prediction)):
        assert old in source, f"{old!r} is no longer in the exercise cell"
        if new is not None:
            source = source.replace(old, new, 1)
    return PREAMBLE + source


def verdicts(cluster, source):
    both = cluster.run(run_exercise_cell, source)
    assert both[0] == both[1], f"both ranks must reach the same verdict: {both}"
    return both[0]


def test_the_stored_cell_passes_with_the_course_solution(cluster):
    assert verdicts(cluster, exercise(solution=True)) is None


def test_the_untouched_scaffold_fails(cluster):
    message = verdicts(cluster, exercise())
    assert message and "NotImplementedError: write LateFlagMicroDDP.grad_ready" in message, message


WRONG = {  # name: (body, prediction, words the reason must hold)
    "still decided in forward": ("        super().grad_ready(p)", RIGHT_PREDICTION, "it still decides in forward"),
    "the flag forced True": ("        self.require_backward_grad_sync = True\n        super().grad_ready(p)",
                             RIGHT_PREDICTION, "it still decides in forward"),
    "never syncs": ("        return", RIGHT_PREDICTION, "did not all-reduce in exactly the backwards that ran outside"),
    "prediction left as the scaffold": (RIGHT_BODY, None, "predicted: fill in ['torch DDP', 'yours']"),
    "torch DDP read at backward time too": (RIGHT_BODY, 'predicted = {"torch DDP": 1, "yours": 1}',
                                            "torch DDP decides in forward"),
    "yours as if decided in forward": (RIGHT_BODY, 'predicted = {"torch DDP": 3, "yours": 3}',
                                       "which backwards ran outside no_sync()"),
    "a list, not a dict": (RIGHT_BODY, "predicted = [3, 1]", "predicted must be a dict"),
}


@pytest.mark.parametrize("case", list(WRONG))
def test_a_wrong_answer_fails_with_its_reason(cluster, case):
    body, prediction, words = WRONG[case]
    message = verdicts(cluster, exercise(body, prediction))
    assert message and words in message, f"{case}: expected {words!r} in\n{message}"
    for count in ("1 backward", "all 3 backwards", "[True", "[False"):
        assert count not in message, f"{case}: the verdict must not give the counts away:\n{message}"


RIGHT = {
    "the course's two lines": (RIGHT_BODY, RIGHT_PREDICTION),
    "floats, the parent named": ("        self.sync = bool(getattr(self, 'require_backward_grad_sync'))\n"
                                 "        MyMicroDDP.grad_ready(self, p)",
                                 'predicted = {"yours": 1.0, "torch DDP": 3.0}'),
    "an early return of its own": ("        if not self.require_backward_grad_sync:\n"
                                   "            return\n"
                                   "        self.sync = True\n"
                                   "        super(LateFlagMicroDDP, self).grad_ready(p)",
                                   'predicted = dict(yours=1, **{"torch DDP": 3})'),
}


@pytest.mark.parametrize("case", list(RIGHT))
def test_a_right_answer_written_differently_passes(cluster, case):
    assert verdicts(cluster, exercise(*RIGHT[case])) is None, case
