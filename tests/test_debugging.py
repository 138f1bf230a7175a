"""course_utils.debugging and course_utils.planted_bugs (17_debugging_and_profiling): what the lesson's cells cannot
show, with one torchrun of the planted job for the whole module.

    .venv/bin/python -m pytest tests/test_debugging.py -p no:randomly

Each planted bug, plain and with TORCH_DISTRIBUTED_DEBUG=DETAIL, runs in the lesson, under nbval, and the lesson's
cells assert (and nbval compares the outputs of) what this module once ran the same jobs again to check (each
bug's asserts sit in the code cell after the text that explains its result, so that a prediction is not answered
before the learner runs it):
- a hang (skip, order) ends in the 3 s timeout on both ranks, both dump (the Flight Recorder on by default), fr_trace
  names the collective, its culprit and the job's line: the cells after `skip = run_job("skip", spy=True)`,
  `dump_table`, `report = analyze(skip)` and `order, order_detail = run_jobs(...)`;
- py-spy, on those same two runs while they hung, shows each rank in its collective, called from `train` (the
  stacks are printed, so nbval fails when py-spy cannot read the ranks, as under CI it must);
- DETAIL names each rank's collective (skip, order, shape, dtype): the `detail_summary().splitlines() == [...]`
  asserts;
- a shape mismatch aborts rank 1 (SIGABRT), leaves rank 0's dump only, and fr_trace cannot decide;
- a dtype mismatch (float32 against int32) finishes without an error, the replicas differ, fr_trace names
  COLLECTIVE_DTYPE_MISMATCH from the dumps written at the end, DETAIL names Float against Int;
- a dead rank is named whichever failure torchrun saw first, and DETAIL's monitored barrier failure is one class
  whether rank 0 was already waiting for the dead rank or not;
- the healthy job, plain and with DETAIL, finishes with equal replicas, 19 timed steps and dumps in which fr_trace
  finds nothing (the cost's verdict is printed under "Measured here:").
What those cells cannot show is tested here: that a job leaves no temporary folder behind, py-spy under CI when
only the tests run, the analyzer without the gloo fix and on its command line, the verdict with torchrun's
summary in either order, a stopped rank's report, the Flight Recorder's default and NCCL's default dump path.
"""
import gc
import json
import os
import subprocess
import sys
import tempfile

import pytest
import torch

from conftest import in_ci
from course_utils import debugging
from course_utils.checks.debugging import _cases
from course_utils.debugging import (COMPUTE_END_LABEL, Job, analyze, clean, fix_gloo_dumps, gloo_error, run_job,
                                    step_intervals)
from course_utils.describe import describe_communication_share, describe_detail_cost, describe_hidden_fractions
from course_utils.planted_bugs import fr_buffer_size


@pytest.fixture(scope="module")
def skip(tmp_path_factory):
    """The lesson's first job (rank 1 skips the last step's loss all-reduce), py-spy on, run with Python's
    temporary folder pointed at a folder of the test's, so that what the job and ``analyze`` leave there shows:
    ``(job, that folder)``. The one torchrun of this module."""
    temp = tmp_path_factory.mktemp("temp")
    saved, tempfile.tempdir = tempfile.tempdir, str(temp)
    try:
        job = run_job("skip", spy=True)
        analyze(job)                                          # through a temporary folder of its own
    finally:
        tempfile.tempdir = saved
    return job, temp


def test_a_job_and_its_analysis_leave_no_temporary_folder(skip, tmp_path, monkeypatch):
    job, temp = skip
    assert job.out is None and sorted(job.dumps()) == [0, 1], "the dumps kept, the temporary folder removed"
    assert sorted(p.name for p in temp.glob("fr_*")) == [], "run_job and analyze remove the folders they made"

    def fails(*args):
        raise RuntimeError("it failed")

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(debugging, "_run_torchrun", fails)    # torchrun could not start, or ran past its limit
    with pytest.raises(RuntimeError, match="it failed"):
        run_job("skip")
    ended = Job(bug="skip", returncode=1, lines=[], failures=[], out=None, seconds=0.0)
    monkeypatch.setattr(debugging, "_run_torchrun", lambda *args: ended)
    monkeypatch.setattr(debugging, "_finished_ranks", fails)  # the job ended, but what it left could not be read
    with pytest.raises(RuntimeError, match="it failed"):
        run_job("skip")
    assert list(tmp_path.glob("fr_*")) == [], "nor a job that failed"


def test_pyspy_shows_where_each_rank_hangs_and_the_job_still_times_out(skip):
    """The lesson prints these stacks (nbval compares them); this fails, not skips, under CI when only the tests
    run and py-spy cannot read the ranks."""
    job, _ = skip
    if not job.stacks:
        ok, why = debugging.pyspy_available()
        message = f"py-spy cannot read another process here: {job.spy_note or why}"
        if in_ci():
            pytest.fail(message + " (under CI this must work: run the job's ranks as the same user, or allow "
                                  "ptrace, e.g. kernel.yama.ptrace_scope=0)")
        pytest.skip(message)
    assert job.stacks[0][-1].startswith("all_reduce (torch/distributed/distributed_c10d.py:")
    assert job.stacks[1][-1].startswith("barrier (torch/distributed/distributed_c10d.py:")
    assert all(any(f.startswith("train (planted_bugs.py:") for f in s) for s in job.stacks.values())
    assert not any("<frozen" in f for s in job.stacks.values() for f in s)
    assert any("Timed out waiting 3000ms" in job.last_words(r) for r in (0, 1)), "read, not stopped: it timed out"


def test_torch_2_13s_analyzer_needs_the_gloo_dump_fix_and_analyze_says_what_its_command_line_says(skip, tmp_path):
    """If the first assert fails, torch names gloo's default group in pg_config now: drop fix_gloo_dumps. Then
    analyze() runs fr_trace's main in this process (no second Python importing torch): the same text as the command
    line, computed once per set of dumps, and the garbage collector, which fr_trace's loader switches off, switched
    on again."""
    job, _ = skip
    for rank, data in job.dumps().items():
        (tmp_path / f"fr_{rank}").write_bytes(data)
    unfixed = debugging._analyze(tmp_path, ())                # fr_trace's main on the dumps as the ranks wrote them
    assert "KeyError: ('0', 0)" in unfixed, unfixed[-2000:]
    assert fix_gloo_dumps(tmp_path) == 2 and fix_gloo_dumps(tmp_path) == 0
    mine = analyze(tmp_path)
    sorted_walk = ("import os, sys; walk = os.walk; os.walk = lambda *a, **k: ((r, d, sorted(f)) for r, d, f in "
                   "walk(*a, **k)); from torch.distributed.flight_recorder.fr_trace import main; main(sys.argv[1:])")
    cli = subprocess.run([sys.executable, "-c", sorted_walk, str(tmp_path), "-p", "fr_", "--allow-incomplete-ranks"],
                         capture_output=True, text=True, timeout=120)
    assert cli.returncode == 0 and "Traceback" not in cli.stdout + cli.stderr, cli.stdout + cli.stderr[-2000:]
    assert mine == debugging._tidy(cli.stdout + cli.stderr, tmp_path) and "Culprit rank 1" in mine, mine
    assert analyze(tmp_path) is mine, "the same dumps are analyzed once"
    assert gc.isenabled(), "fr_trace's loader switches the garbage collector off: analyze() must switch it on again"


# -- torch's defaults, each read in a child of one fresh interpreter ---------------------------------------------

_CHILDREN = r"""
import json, os, sys, traceback
import torch, torch.distributed
# torch reads the variables below when a process first uses the Flight Recorder or its dump writer, not at import:
# each case runs in a child forked from here, a process that has used neither, with the case's own variables
results = {}
for name, variables, code in json.loads(sys.argv[1]):
    read, write = os.pipe()
    sys.stdout.flush()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        os.dup2(write, 1)
        os.environ.update(variables)
        try:
            exec(code, {})
        except BaseException:
            traceback.print_exc()
            os._exit(1)
        sys.stdout.flush()
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        said = f.read()
    results[name] = (os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), said)
print(json.dumps(results))
"""

_FR_CASE = """
import json, torch, torch.distributed as dist
from course_utils.planted_bugs import fr_buffer_size
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
dist.all_reduce(torch.ones(3))
dist.barrier()
entries = json.loads(torch._C._distributed_c10d._dump_fr_trace_json()).get("entries", [])
print(json.dumps([fr_buffer_size(), [e["profiling_name"] for e in entries]]))
dist.destroy_process_group()
"""

_WRITER_CASE = """
import ctypes, os, torch
lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
get_writer = lib._ZN4c10d15DebugInfoWriter9getWriterEi          # c10d::DebugInfoWriter::getWriter(int rank)
get_writer.restype, get_writer.argtypes = ctypes.c_void_p, [ctypes.c_int]
writer = get_writer(3)
# the object: its vtable pointer, then filename_ (libstdc++'s std::string: data pointer, then length)
data, length = ctypes.c_void_p.from_address(writer + 8).value, ctypes.c_size_t.from_address(writer + 16).value
print(ctypes.string_at(data, length).decode())
"""

_SIGTERM_CASE = """
import os, signal, time
from course_utils import planted_bugs
signal.signal(signal.SIGTERM, lambda *_: planted_bugs.on_sigterm({out!r}, 0, 2.0))
os.kill(os.getpid(), signal.SIGTERM)
print('still here, stopping:', planted_bugs._STOPPING.is_set(), flush=True)
time.sleep(60)
print('never printed', flush=True)
"""

_FR_SIZES = {"no variable": ({}, 2000), "FR=0": ({"TORCH_FR_BUFFER_SIZE": "0"}, 0),
             "old name=0": ({"TORCH_NCCL_TRACE_BUFFER_SIZE": "0"}, 0),
             "the new name wins": ({"TORCH_FR_BUFFER_SIZE": "5", "TORCH_NCCL_TRACE_BUFFER_SIZE": "0"}, 5)}


def _writer_cases(tmp):
    """``{name: (variables, the dump path torch 2.13 should give rank 3)}``."""
    home, cache = tmp / "home", tmp / "cache"
    return {"HOME": ({"HOME": str(home)}, f"{home}/.cache/torch/comm_lib_trace_rank_3"),
            "XDG_CACHE_HOME": ({"HOME": str(home), "XDG_CACHE_HOME": str(cache)},
                               f"{cache}/torch/comm_lib_trace_rank_3"),
            "neither": ({}, "/tmp/.cache/torch/comm_lib_trace_rank_3"),
            "TORCH_FR_DUMP_TEMP_FILE": ({"HOME": str(home), "TORCH_FR_DUMP_TEMP_FILE": f"{tmp}/fr_"}, f"{tmp}/fr_3")}


@pytest.fixture(scope="module")
def children(tmp_path_factory):
    """``(tmp, {case: (exit code, what it printed)})``: every case of the three tests below in one fresh interpreter
    (one import of torch instead of nine), with every TORCH_FR_* and TORCH_NCCL_* variable, HOME and XDG_CACHE_HOME
    removed, then the case's own."""
    tmp = tmp_path_factory.mktemp("children")
    cases = [(f"fr {name}", variables, _FR_CASE) for name, (variables, _) in _FR_SIZES.items()]
    if sys.platform.startswith("linux"):                      # reads libstdc++'s std::string layout
        cases += [(f"writer {name}", variables, _WRITER_CASE) for name, (variables, _) in _writer_cases(tmp).items()]
    cases.append(("sigterm", {"TORCH_FR_BUFFER_SIZE": "0"}, _SIGTERM_CASE.format(out=str(tmp))))
    env = {k: v for k, v in os.environ.items()
           if k not in ("HOME", "XDG_CACHE_HOME") and not k.startswith(("TORCH_FR_", "TORCH_NCCL_"))}
    env["PYTHONPATH"] = str(debugging.ROOT)
    result = subprocess.run([sys.executable, "-c", _CHILDREN, json.dumps(cases)], env=env, capture_output=True,
                            text=True, timeout=300, cwd=tmp)
    assert result.returncode == 0, result.stderr[-3000:]
    return tmp, json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", list(_FR_SIZES))
def test_the_flight_recorder_is_on_by_default_and_fr_buffer_size_reads_it_as_torch_does(children, name):
    """torch 2.13's FlightRecorder.hpp: getCvarInt({"TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"}, 2000).
    A world of one on gloo: an all-reduce and a barrier are recorded unless the size is 0, and
    planted_bugs.fr_buffer_size (which decides whether the planted job dumps) reads the same size. Lesson 17 said
    the recorder was off unless a variable was set: the first case fails on that claim."""
    variables, size = _FR_SIZES[name]
    code, said = children[1][f"fr {name}"]
    assert code == 0, said
    read, names = json.loads(said.strip().splitlines()[-1])
    assert read == size == fr_buffer_size(variables)
    assert names == ([] if size == 0 else ["gloo:all_reduce", "gloo:barrier"]), names


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads libstdc++'s std::string layout")
def test_the_default_flight_recorder_dump_path_is_the_users_cache_not_tmp(children):
    """Lesson 17's NCCL cell: where NCCL's automatic dump goes by default, asked of this torch build's own
    c10d::DebugInfoWriter::getWriter (FlightRecorder.cpp, compiled into libtorch_cpu in 2.13): $XDG_CACHE_HOME/torch,
    else $HOME/.cache/torch, else /tmp/.cache/torch, then comm_lib_trace_rank_<rank>; TORCH_FR_DUMP_TEMP_FILE
    replaces the prefix. Not /tmp/nccl_trace_rank_<rank>, the default of older releases."""
    tmp, results = children
    for name, (variables, want) in _writer_cases(tmp).items():
        code, said = results[f"writer {name}"]
        assert code == 0 and said.strip() == want, (variables, code, said)


def test_a_rank_that_torchrun_stops_reports_first_then_leaves(children):
    """planted_bugs.on_sigterm: torchrun's SIGTERM does not cut a rank short (it goes on to report the error it is
    about to get, so that a lesson's output does not depend on which came first), and it still leaves by itself
    within the grace time, with exit code 143, when it has nothing to report."""
    code, said = children[1]["sigterm"]
    assert code == 143 and said == "still here, stopping: True\n", (code, said)


# -- torchrun's verdict, read from its summary -------------------------------------------------------------------

def _summary(*failures):
    """torchrun's failure summary with the given (rank, exitcode) pairs, the first as its root cause."""
    block = "[{i}]:\n  time      : 2026-12-01_21:20:05\n  host      : localhost\n  rank      : {rank} (local_rank: " \
            "{rank})\n  exitcode  : {code} (pid: 5458)\n"
    root, *rest = failures
    text = "Failures:\n" + "".join(block.format(i=i + 1, rank=r, code=c) for i, (r, c) in enumerate(rest))
    return text + "------\nRoot Cause (first observed failure):\n" + block.format(i=0, rank=root[0], code=root[1])


@pytest.mark.parametrize("failures", [[(1, -9), (0, 143)], [(0, 1), (1, -9)], [(0, 143), (1, -9)]],
                         ids=["killed rank first", "survivor's own error first", "survivor's SIGTERM first"])
def test_a_dead_rank_is_named_whichever_failure_torchrun_saw_first(failures):
    """Which failure torchrun observes first (its "root cause") depends on timing: the survivor may lose its peer and
    exit in the same instant as the killed rank. The verdict reads which rank a signal killed. (The lesson's cell
    `dead, dead_detail = run_jobs(...)` asserts it on a real run, under nbval, with DETAIL's monitored barrier.)"""
    parsed = debugging._failures(_summary(*failures))
    assert parsed == failures
    job = Job(bug="dead", returncode=1, lines=[], failures=parsed, out=None, seconds=0.0)
    assert job.died() == [(1, "SIGKILL")]
    assert job.exit_summary() == "torchrun: rank 1 died of SIGKILL; torchrun then stopped the other ranks"
    hang = Job(bug="skip", returncode=1, lines=[], failures=[(1, 1), (0, 143)], out=None, seconds=0.0)
    assert hang.died() == [] and "the ranks' own errors" in hang.exit_summary()


# rank 0's last line in the DETAIL job of the dead rank, both ways seen on this machine (cleaned as run_job keeps it):
# it was already waiting in the monitored barrier when rank 1 died, or rank 1 was gone before it got there
_WAITED = "rank 0: RuntimeError: [Rank 0]: Ranks 1 failed to pass monitoredBarrier in 60000 ms"
_GONE_FIRST = ("rank 0: RuntimeError: ProcessGroupWrapper: Monitored Barrier encountered error running collective: "
               "CollectiveFingerPrint(SequenceNumber=4, OpType=ALLREDUCE, TensorShape=[9], TensorDtypes=Float). "
               "Error: Connection closed by peer [127.0.0.1]:<port>. This is typically caused by a remote worker "
               "crashing. Check the logs of the remote worker before reporting an error. GLHF!")


def test_detail_reports_a_dead_rank_the_same_whether_rank_0_waited_for_it_or_not():
    """Which of DETAIL's two messages rank 0 prints depends on whether rank 1 died before or after rank 0 reached
    the monitored barrier (a clean-clone CI run met the second, which the lesson's check did not know). The
    summary the lesson prints, and its verdict, must be the same for both; a gloo error that is not the barrier's
    stays out of the class."""
    summaries = set()
    for last in (_WAITED, _GONE_FIRST):
        job = Job(bug="dead", returncode=1, lines=[last, "rank 1: step 1 done"], failures=[(1, -9), (0, 143)],
                  out=None, seconds=0.0, debug="DETAIL")
        assert debugging.barrier_error(job.last_words(0)), last
        summaries.add(job.detail_summary())
    assert len(summaries) == 1, summaries
    kind = debugging.barrier_error(_WAITED)
    assert summaries.pop().splitlines() == [f"rank 0: DETAIL: {kind}", "rank 1: step 1 done"]
    assert debugging.barrier_error("rank 0: RuntimeError: Connection closed by peer [127.0.0.1]:<port>.") is None
    assert debugging.barrier_error("rank 1: step 1 done") is None and debugging.barrier_error(None) is None


def test_bad_arguments_get_a_clear_error():
    with pytest.raises(ValueError, match="bug must be one of"):
        run_job("typo")
    with pytest.raises(ValueError, match="TORCH_DISTRIBUTED_DEBUG"):
        run_job("skip", debug="detail")
    if debugging.pyspy_available()[0]:
        with pytest.raises(RuntimeError, match="py-spy could not read process"):
            debugging.pyspy_dump(2 ** 22 + 12345)                  # above Linux's default pid_max: no process


def test_clean_keeps_what_is_the_same_on_every_run():
    line = ("rank 0: RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read "
            "error [127.0.0.1]:17799: Connection reset by peer.")
    assert clean(line) == "rank 0: RuntimeError: Read error [127.0.0.1]:<port>: Connection reset by peer."
    fp = ("CollectiveFingerPrint(SequenceNumber=0, OpType=ALLREDUCE, TensorShape=[8], TensorDtypes=Float, "
          "TensorDeviceTypes=TensorOptions(dtype=float (default), device=cpu, layout=Strided (default), "
          "requires_grad=false (default), pinned_memory=false (default), memory_format=(nullopt)))")
    assert clean(fp) == "CollectiveFingerPrint(SequenceNumber=0, OpType=ALLREDUCE, TensorShape=[8], TensorDtypes=Float)"
    assert gloo_error("rank 1: RuntimeError: Timed out waiting 3000ms for recv operation to complete")
    assert gloo_error("rank 1: RuntimeError: Connection closed by peer [127.0.0.1]:<port>.")
    assert gloo_error("rank 1: step 1 done") is None


def test_torchruns_failure_summary_is_parsed_root_cause_first():
    text = """Failures:
[1]:
  time      : 2026-12-01_21:20:05
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 5459)
------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-01_21:20:05
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -6 (pid: 5458)
"""
    assert debugging._failures(text) == [(1, -6), (0, -15)]


def test_step_intervals_read_backwards_compute_and_the_steps_communication():
    events = _cases()[0][1]
    iv = step_intervals(events)
    assert iv["step"] == (0.0, pytest.approx(0.1)) and iv["compute"] == (pytest.approx(0.02), pytest.approx(0.06))
    assert [tuple(round(x, 6) for x in c) for c in iv["comm"]] == [(0.03, 0.05), (0.045, 0.065), (0.062, 0.08)]
    with pytest.raises(ValueError, match="record_function"):
        step_intervals([e for e in events if e["name"] != "step"])


def test_the_two_hidden_fractions_are_compared_per_rank_with_the_measured_waits_for_a_gap():
    """Lesson 17 prints this sentence under "Measured here:" (in CI under load rank 1's hand-made figure once read
    0.58 against the trace's 1.00, so the band is a verdict, not an assert). A gap is explained by the waits
    measured in the same steps, printed beside it, never by a reason the numbers do not show."""
    extra = [{"waited": [0.0002, 0.0004], "after": [0.0, 0.0001]}, {"waited": [0.030, 0.050], "after": [0.0, 0.0]}]
    agree = describe_hidden_fractions([[0.7, 0.6, 0.8], [0.5, 0.5, 0.6]], [[0.6, 0.6, 0.6], [0.55, 0.4, 0.5]], extra)
    assert agree.endswith("The two agree within 0.25 on every rank.") and "rank 0 hid 0.60" in agree
    assert "0.70 by the hand-made timeline" in agree and "ms" not in agree
    lower = describe_hidden_fractions([[0.7], [0.58]], [[0.6], [1.0]], extra)
    assert "Rank 1's hand-made figure is 0.42 lower: its intervals began a median 40.0 ms before gloo ran" in lower
    assert "ended 0.0 ms after it" in lower and "rank 0's" not in lower, lower
    higher = describe_hidden_fractions([[0.9], [0.5]], [[0.3], [0.5]], extra, band=0.1)
    assert "Rank 0's hand-made figure is 0.60 higher: its intervals began a median 0.3 ms" in higher, higher
    assert "agree" not in higher and "\n" not in lower + higher   # one line: the sanitiser replaces it


def test_the_hand_made_timeline_is_aligned_on_the_launches_the_trace_holds():
    """hand_made_extra: the hook's perf_counter times and the trace's microseconds are two clocks; the launches,
    read inside record_function ranges, align them. A run that started before its launch is reported (early)."""
    from course_utils.debugging import LAUNCH_MARK, hand_made_extra

    events = [_ev("step", 1, 0, 100), _ev(LAUNCH_MARK, 1, 10, 10.1), _ev(LAUNCH_MARK, 1, 20, 20.1),
              _ev("gloo:all_reduce", 7, 12, 30), _ev("gloo:all_reduce", 8, 31, 40)]
    launched = [(5.020, 5.041), (5.010, 5.0305)]        # perf_counter seconds: 4.99 s behind the trace's clock
    got = hand_made_extra(events, launched)
    assert [round(1e3 * w, 3) for w in got["waited"]] == [2.0, 11.0] and got["early"] == 0.0, got
    assert [round(1e3 * a, 3) for a in got["after"]] == [0.5, 1.0], got
    early = hand_made_extra([dict(e) for e in events[:3]] + [_ev("gloo:all_reduce", 7, 8, 30),
                                                           _ev("gloo:all_reduce", 8, 31, 40)], launched)
    assert round(1e3 * early["early"], 3) == 2.0, early
    with pytest.raises(ValueError, match="record_function"):
        hand_made_extra(events[:1] + events[3:], launched)


def test_analyze_names_the_culprit_against_the_dump_it_reads_first(skip):
    """Raw fr_trace matches every rank against the first dump os.walk lists; analyze() reads rank `first`'s first,
    so the same dumps name rank 1 read from rank 0, and rank 0 read from rank 1 (lesson 17 shows both)."""
    job, _ = skip
    assert "Culprit rank 1" in analyze(job) and "Culprit rank 0" in analyze(job, first=1)
    assert "found collective type: 'all_reduce'" in analyze(job, first=1)


def test_plot_trace_draws_one_row_per_thread():
    import matplotlib
    matplotlib.use("Agg")
    ax = debugging.plot_trace(_cases()[0][1], "test")
    assert [t.get_text() for t in ax.get_yticklabels()] == ["main thread", "gloo worker", "gloo worker"]
    marker, = ax.get_lines()         # backward's last autograd node ends at 60 ms; the "backward" range at 70
    assert marker.get_label() == COMPUTE_END_LABEL and list(marker.get_xdata()) == [60.0, 60.0]
    assert COMPUTE_END_LABEL in [t.get_text() for t in ax.get_legend().get_texts()]


def test_details_cost_is_a_verdict_that_follows_the_numbers():
    """Lesson 17 prints it under "Measured here:". Two short jobs at once on 2 busy cores once read DETAIL's steps
    as fast as the plain ones (9.0 against 9.9 ms: within the noise band, no verdict on DETAIL's cost), and once
    4 times faster (6.1 against 24.4 ms): then the sentence says the load set the times, not "within 1.2x"."""
    slower = describe_detail_cost({0: [0.008, 0.008, 0.009], 1: [0.008]}, {0: [0.016, 0.015], 1: [0.016, 0.5]})
    assert "8.0 ms plain and 16.0 ms with DETAIL" in slower
    assert "2.0x slower, about 4.0 ms more per collective" in slower
    noise = describe_detail_cost({0: [0.0099], 1: [0.0099]}, {0: [0.0090], 1: [0.0090]})
    assert "cannot tell" in noise and "slower" not in noise
    loaded = describe_detail_cost({0: [0.0244], 1: [0.0244]}, {0: [0.0061], 1: [0.0061]})   # a busy run, once
    assert "plain steps were 4.0x slower" in loaded and "within" not in loaded and "DETAIL made" not in loaded
    assert "\n" not in slower + noise + loaded   # one line: the sanitiser replaces the line after "Measured here:"


def test_the_profilers_banner_is_dropped_and_other_stderr_kept(capfd):
    from torch.profiler import profile

    with debugging.without_kineto_banner():
        with profile():
            torch.ones(3).add_(1)
        os.write(2, b"a real warning\n")
    err = capfd.readouterr().err
    assert "profiler_start" not in err and "USDT:" not in err and "a real warning" in err


def test_gpu_checks_flight_recorder_script_computes_what_it_asserts_on_gloo(tmp_path):
    """scripts/gpu_check.py's lesson-16 row runs this script on NCCL; here on gloo and the CPU, so that a wrong
    expectation shows up before someone's GPU does."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", debugging.ROOT / "scripts" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    got = gpu_check.fr_and_trace("gloo", tmp_path)
    assert got["ops"] == ["gloo:all_reduce"] * 3, got
    assert got["kernels"] == [] and "gloo:all_reduce" in got["profiler_ops"], got
    assert (tmp_path / "fr_0").exists() and (tmp_path / "trace.json").exists()


def _ev(name, tid, start_ms, end_ms):
    return {"name": name, "tid": tid, "ts": start_ms * 1e3, "dur": (end_ms - start_ms) * 1e3, "ph": "X"}


def test_fsdp2s_collectives_are_counted_by_thread_and_their_share_of_the_step_is_a_union():
    """Lesson 17's FSDP2 step beside DDP's: what the cell prints is counted from the events, and the share of the
    step counts time when several collectives ran at once once."""
    fsdp = [_ev("step", 1, 0, 100), _ev("forward", 1, 0, 40), _ev("backward", 1, 40, 90),
            _ev("gloo:all_gather", 7, 0, 10), _ev("gloo:all_gather", 8, 5, 15),      # two at once: 15 ms, not 20
            _ev("gloo:all_reduce", 7, 60, 70), _ev("gloo:all_gather", 7, 95, 110)]   # the last one half inside
    assert debugging.collectives_by_thread(fsdp) == {"gloo:all_gather": (0, 3), "gloo:all_reduce": (0, 1)}
    on_main = fsdp + [_ev("gloo:broadcast", 1, 20, 21)]
    assert debugging.collectives_by_thread(on_main)["gloo:broadcast"] == (1, 0)
    assert debugging.communication_share(fsdp) == pytest.approx((15 + 10 + 5) / 100)
    ddp = [_ev("step", 1, 0, 100), _ev("forward", 1, 0, 40), _ev("gloo:all_reduce", 7, 50, 60)]
    said = describe_communication_share(ddp, fsdp)
    assert said.startswith("a collective ran during 10% of DDP's step and 30% of FSDP2's")
    assert "FSDP2's share is the larger here, its collectives also ran longer in all" in said, said
    # a larger share with less summed time: the other one's collectives overlapped each other
    crowded = [_ev("step", 1, 0, 100), _ev("forward", 1, 0, 40)] + [_ev("gloo:all_gather", 7 + i, 0, 20)
                                                                    for i in range(4)]
    ddp_long = [_ev("step", 1, 0, 100), _ev("forward", 1, 0, 40), _ev("gloo:all_reduce", 7, 50, 80)]
    said = describe_communication_share(ddp_long, crowded)
    assert "DDP's share is the larger here, although FSDP2's collectives ran longer in all" in said, said
    assert "about the same share" in describe_communication_share(ddp, ddp)
    with pytest.raises(ValueError, match="label the step"):
        debugging.collectives_by_thread([_ev("gloo:all_reduce", 7, 0, 1)])
