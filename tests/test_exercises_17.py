"""The self-checks of 17_debugging_and_profiling's exercises, fed the unmodified scaffold and typical wrong answers
(each must fail with a reason a learner can act on) and the course's solution (which must pass). The Flight
Recorder exercise is checked against a real run of the mystery job (planted_bugs' own 4 ranks on gloo; the lesson
runs it under torchrun, nbval compares what its checker prints): its answer must be the bug planted in
``planted_bugs._mystery``, torch's analyzer must miss it (so that the exercise needs the learner's reading), and
the checker's hints must say what the run's dumps say.

    .venv/bin/python -m pytest tests/test_exercises_17.py -p no:randomly
"""
import contextlib
import inspect
import io
import os
import pickle
import subprocess
import sys

import pytest

from course_utils import planted_bugs
from course_utils.checks import check_mystery_answer
from course_utils.checks import debugging as checks
from course_utils.debugging import (ROOT, _dumps_of, _free_port, analyze, analyzer_named, dump_entries, odd_one_out,
                                    read_dump)
from exercise_helpers import notebook_cell, solution_off, verdict

NOTEBOOK = "17_debugging_and_profiling.ipynb"


def _run_cell(source, **names):
    """Run a (non-%%ddp) exercise cell in a fresh namespace: None if its check passed, else the verdict."""
    namespace = dict(names)
    with contextlib.redirect_stdout(io.StringIO()):
        try:
            exec(compile(source, "exercise-cell", "exec"), namespace)
        except AssertionError as exc:
            return str(exc)
    return None


# planted_bugs.main on each rank, as torchrun would start it, but each rank a fork of one Python that imported torch
# once (torchrun and its 4 ranks import it 5 times: the lesson runs the job so)
_FORKED_RANKS = r"""
import os, sys
from course_utils import planted_bugs
bug, world_size, port, out = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
sys.stdout.flush()
for rank in range(world_size):
    if os.fork() == 0:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        os._exit(planted_bugs.main(["--bug", bug, "--out", out]))
print("exit codes", sorted(os.waitstatus_to_exitcode(os.wait()[1]) for _ in range(world_size)), flush=True)
os._exit(0)                                               # not the interpreter's teardown of torch: a CPU-second
"""


@pytest.fixture(scope="module")
def mystery(tmp_path_factory):
    """A folder of the mystery job's Flight Recorder dumps, ``fr_<rank>`` (each rank times out after 3 s)."""
    out = tmp_path_factory.mktemp("mystery")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCH_FR_", "TORCH_NCCL_"))}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", TORCH_DISTRIBUTED_DEBUG="OFF",
               GLOO_SOCKET_IFNAME="lo" if sys.platform.startswith("linux") else "lo0")        # as run_job's
    job = subprocess.run([sys.executable, "-c", _FORKED_RANKS, "mystery", "4", str(_free_port()), str(out)],
                         env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert "exit codes [1, 1, 1, 1]" in job.stdout, job.stdout[-3000:] + job.stderr[-3000:]
    return out


def _planted_lines():
    """The lines of planted_bugs.py of ``_mystery``'s extra all-reduce and of its loss all-reduce."""
    source, first = inspect.getsourcelines(planted_bugs._mystery)
    where = lambda text: first + next(i for i, line in enumerate(source) if line.strip() == text)
    return where("dist.all_reduce(loss.clone())"), where("dist.all_reduce(loss)")


# -- exercise 1: who hung the mystery job? ----------------------------------------------------------------------

def test_the_answer_is_the_planted_bug_and_the_analyzer_names_neither_its_rank_nor_its_number(mystery):
    assert sorted(_dumps_of(mystery)) == [0, 1, 2, 3]
    culprit, seq = odd_one_out(mystery)
    extra, loss = _planted_lines()
    calls = {r: {e["seq"]: (e["op"], e["line"]) for e in dump_entries(d)} for r, d in _dumps_of(mystery).items()}
    assert culprit == 0 and calls[0][seq] == ("all_reduce", extra), (culprit, seq, calls[0])
    assert all(calls[r][seq] == ("all_reduce", loss) for r in (1, 2, 3)), calls
    assert all(calls[r][s] == calls[0][s] for r in (1, 2, 3) for s in range(1, seq)), "the ranks agree before"
    report = analyze(mystery)
    assert analyzer_named(mystery) == (seq + 1, [1, 2, 3]), report
    assert "Culprit rank 0" not in report and report.count("found collective type: 'barrier'") == 3, report
    assert verdict(check_mystery_answer, mystery, culprit, seq) is None


@pytest.mark.parametrize("rank", [1, 2, 3])
def test_the_analyzers_culprits_fail_with_what_this_run_recorded(mystery, rank):
    stop, _ = analyzer_named(mystery)
    got = verdict(check_mystery_answer, mystery, rank, stop)
    twins = [r for r in (1, 2, 3) if r != rank]
    assert got and f"rank {rank} made the very calls ranks {twins[0]} and {twins[1]} made" in got, got
    assert f"fr_trace named ranks 1, 2 and 3 at #{stop} in this run" in got and "rank 0's" in got, got


def test_the_analyzers_number_fails_as_where_the_job_stopped(mystery):
    stop, _ = analyzer_named(mystery)
    got = verdict(check_mystery_answer, mystery, 0, stop)
    assert got and f"#{stop} is where the job stopped" in got and "barrier []" in got, got
    assert f"fr_trace reports in this run (#{stop})" in got and "lines=True" in got, got


def test_a_number_before_the_first_difference_fails(mystery):
    _, seq = odd_one_out(mystery)
    got = verdict(check_mystery_answer, mystery, 0, seq - 1)
    assert got and "they still agreed there" in got and "all_reduce [[9]]" in got, got


def test_the_hints_follow_the_dumps_not_a_fixed_story(mystery, tmp_path):
    """The same dumps with ranks 0 and 2 swapped: the culprit is now rank 2, which the analyzer names itself
    (it differs from the first dump it reads), so the hint for a wrong rank says nothing of fr_trace."""
    swap = {0: 2, 2: 0, 1: 1, 3: 3}
    for rank, data in _dumps_of(mystery).items():
        dump = read_dump(data)
        dump["rank"] = swap[rank]
        (tmp_path / f"fr_{swap[rank]}").write_bytes(pickle.dumps(dump))
    _, seq = odd_one_out(mystery)
    assert odd_one_out(tmp_path) == (2, seq)
    assert analyzer_named(tmp_path) == (seq + 1, [2]), analyze(tmp_path)
    assert verdict(check_mystery_answer, tmp_path, 2, seq) is None
    got = verdict(check_mystery_answer, tmp_path, 0, seq)
    assert got and "rank 0 made the very calls ranks 1 and 3 made" in got and "fr_trace" not in got, got


def test_fr_cell_passes_with_the_solution_and_its_scaffold_fails(mystery):
    source = notebook_cell(NOTEBOOK, "check_mystery_answer(")
    assert "USE_SOLUTION = True" in source, "the stored notebook must run the course's solution"
    _, seq = odd_one_out(mystery)
    assert "= 0" not in source and f"= {seq}" not in source, "the scaffold must not hold the answer"
    assert _run_cell(source, mystery=mystery) is None, "the course's solution must pass"
    got = _run_cell(solution_off(source), mystery=mystery)
    assert got and "not answered yet" in got, got


@pytest.mark.parametrize("answer, words", [
    ((4, 8), "there is no rank 4"),
    ((-1, 8), "there is no rank -1"),
    (("0", 8), "must be a rank number"),
    ((True, 8), "must be a rank number"),
    ((0.0, 8), "must be a rank number"),
    ((0, "8"), "must be the '#' of one of dump_table's rows"),
    ((0, 8.0), "must be the '#' of one of dump_table's rows"),
    ((0, 99), "no rank recorded a collective #99"),
    ((None, 8), "not answered yet"),
    ((0, None), "not answered yet"),
])
def test_wrong_answers_fail_with_a_reason(mystery, answer, words):
    got = verdict(check_mystery_answer, mystery, *answer)
    assert got and words in got, got


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
