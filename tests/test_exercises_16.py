"""The self-checks of 16_debugging_and_profiling's exercises, fed the unmodified scaffold and typical wrong answers
(each must fail with a reason a learner can act on) and the course's solution (which must pass). The Flight
Recorder exercise is also checked against a real run of the mystery job: the checker's answer must be what the
job's dumps say.

    .venv/bin/python -m pytest tests/test_exercises_16.py -p no:randomly
"""
import contextlib
import io

import pytest

from course_utils.checks import debugging as checks
from course_utils.debugging import analyze, dump_entries, odd_one_out, run_job
from exercise_helpers import notebook_cell, solution_off, verdict

NOTEBOOK = "16_debugging_and_profiling.ipynb"


def _run_cell(source, **names):
    """Run a (non-%%ddp) exercise cell in a fresh namespace: None if its check passed, else the verdict."""
    namespace = dict(names)
    with contextlib.redirect_stdout(io.StringIO()):
        try:
            exec(compile(source, "exercise-cell", "exec"), namespace)
        except AssertionError as exc:
            return str(exc)
    return None


@pytest.fixture(scope="module")
def mystery():
    return run_job("mystery", nproc=4)


# -- exercise 1: who hung the mystery job? ----------------------------------------------------------------------

def test_the_checkers_answer_is_what_the_mystery_jobs_dumps_say(mystery):
    assert sorted(mystery.dumps()) == [0, 1, 2, 3], mystery.output[-3000:]
    culprit, called = odd_one_out(mystery)
    assert verdict(checks.check_flight_recorder_answer, culprit, called) is None
    last = {r: dump_entries(p)[-1] for r, p in mystery.dumps().items()}
    assert [last[r]["op"] for r in range(4)].count("all_reduce") == 3, last
    assert len({last[r]["seq"] for r in range(4)}) == 1, f"the four ranks stopped at different numbers: {last}"
    assert checks._MYSTERY_SEQ == last[0]["seq"], "the checker's hints quote the collective number"
    report = analyze(mystery)
    assert "COLLECTIVE_TYPE_MISMATCH" in report and f"Culprit rank {culprit}" in report, report


def test_fr_cell_passes_with_the_solution_and_its_scaffold_fails(mystery):
    source = notebook_cell(NOTEBOOK, "check_flight_recorder_answer(")
    assert "USE_SOLUTION = True" in source, "the stored notebook must run the course's solution"
    assert "broadcast" not in source and "= 3" not in source, "the scaffold must not hold the answer"
    assert _run_cell(source, mystery=mystery) is None, "the course's solution must pass"
    got = _run_cell(solution_off(source), mystery=mystery)
    assert got and "not answered yet" in got, got


@pytest.mark.parametrize("rank", [0, 1, 2])
def test_a_rank_with_the_majority_is_not_the_culprit(rank):
    got = verdict(checks.check_flight_recorder_answer, rank, "broadcast")
    assert got and "did not leave them" in got and "rank 0's" in got, got


def test_naming_what_the_others_called_is_explained():
    got = verdict(checks.check_flight_recorder_answer, 3, "all_reduce")
    assert got and "is what the other three ranks called" in got, got
    got = verdict(checks.check_flight_recorder_answer, 3, "allreduce")
    assert got and "is what the other three ranks called" in got, got


@pytest.mark.parametrize("answer, words", [
    ((3, "all_gather"), "never called"),
    ((3, "barrier"), "never called"),
    ((4, "broadcast"), "there is no rank 4"),
    ((-1, "broadcast"), "there is no rank -1"),
    (("3", "broadcast"), "must be a rank number"),
    ((True, "broadcast"), "must be a rank number"),
    ((3.0, "broadcast"), "must be a rank number"),
    ((None, "broadcast"), "not answered yet"),
    ((3, None), "not answered yet"),
])
def test_wrong_answers_fail_with_a_reason(answer, words):
    got = verdict(checks.check_flight_recorder_answer, *answer)
    assert got and words in got, got


@pytest.mark.parametrize("name", ["broadcast", "gloo:broadcast", "dist.broadcast", "Broadcast", "broadcast()"])
def test_the_right_answer_passes_however_it_is_spelled(name):
    assert verdict(checks.check_flight_recorder_answer, 3, name) is None


# -- exercise 2: exposed communication from a trace -------------------------------------------------------------

def _comm(events):
    return sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e["name"] == "gloo:all_reduce")


def _step(events):
    step = next(e for e in events if e["name"] == "step")
    return step["ts"], step["ts"] + step["dur"]


def _compute(events, use_backward_end=False):
    backward = next(e for e in events if e["name"] == "backward")
    nodes = [e for e in events if e["name"].startswith("autograd::engine::")]
    end = backward["ts"] + backward["dur"] if use_backward_end else max(e["ts"] + e["dur"] for e in nodes)
    return backward["ts"], end


def _hidden(intervals, c0, c1):
    return sum(max(0.0, min(b, c1) - max(a, c0)) for a, b in intervals)


def _merge(intervals):
    out = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def _in_step(events, intervals):
    s0, s1 = _step(events)
    return [(a, b) for a, b in intervals if s0 <= a <= s1]


def no_merge(events):               # two overlapping all-reduces counted twice
    s0, s1 = _step(events)
    comm = _in_step(events, _comm(events))
    return (sum(b - a for a, b in comm) - _hidden(comm, *_compute(events))) / (s1 - s0)


def backward_end_as_compute(events):   # DDP's wait at the end of backward counted as compute
    s0, s1 = _step(events)
    comm = _merge(_in_step(events, _comm(events)))
    return (sum(b - a for a, b in comm) - _hidden(comm, *_compute(events, True))) / (s1 - s0)


def divided_by_comm(events):        # the exposed share of the communication, not of the step
    comm = _merge(_in_step(events, _comm(events)))
    total = sum(b - a for a, b in comm)
    return (total - _hidden(comm, *_compute(events))) / total if total else 0.0


def all_comm_exposed(events):       # forgot the overlap altogether
    s0, s1 = _step(events)
    return sum(b - a for a, b in _merge(_in_step(events, _comm(events)))) / (s1 - s0)


def events_outside_the_step(events):   # the previous step's all-reduce counted too
    s0, s1 = _step(events)
    comm = _merge(_comm(events))
    return (sum(b - a for a, b in comm) - _hidden(comm, *_compute(events))) / (s1 - s0)


def as_percent(events):
    return 100 * checks.exposed_fraction_solution(events)


@pytest.mark.parametrize("wrong, words", [
    (no_merge, "merge the intervals"),
    (backward_end_as_compute, "backward's last autograd node"),
    (divided_by_comm, "not by the communication's"),
    (all_comm_exposed, "is exposed communication"),
    (events_outside_the_step, "inside the step"),
    (as_percent, "between 0 and 1"),
    (lambda events: None, "should return a number"),
])
def test_typical_wrong_exposed_fractions_fail_with_a_reason(wrong, words):
    got = verdict(checks.check_exposed_fraction, wrong)
    assert got and words in got, got


def test_exposed_cell_passes_with_the_solution_and_its_scaffold_fails():
    source = notebook_cell(NOTEBOOK, "check_exposed_fraction(")
    assert "USE_SOLUTION = True" in source, "the stored notebook must run the course's solution"
    events = checks._cases()[0][1]
    assert _run_cell(source, events=events) is None, "the course's solution must pass"
    got = _run_cell(solution_off(source), events=events)
    assert got and "not written yet" in got and "NotImplementedError" in got, got


def test_the_solution_agrees_with_the_lessons_own_interval_helpers():
    from course_utils.ddp_probes import overlap
    from course_utils.debugging import step_intervals

    for _, events, want in checks._cases():
        iv = step_intervals(events)
        o = overlap(iv["compute"], iv["comm"])
        assert abs(o["exposed_s"] / (iv["step"][1] - iv["step"][0]) - want) < 1e-9
        assert abs(checks.exposed_fraction_solution(events) - want) < 1e-9
