"""course_utils.debugging and course_utils.planted_bugs (16_debugging_and_profiling): every planted bug, run for real
under torchrun on gloo, is found by the tools the lesson says find it; each planted hang times out after 3 s.

    .venv/bin/python -m pytest tests/test_debugging.py -p no:randomly
"""
import os
import pickle
import shutil
import subprocess
import sys

import pytest
import torch

from course_utils import debugging
from course_utils.checks.debugging import _cases
from course_utils.debugging import (analyze, clean, dump_entries, fix_gloo_dumps, gloo_error, run_job, run_jobs,
                                    step_intervals)

TIMEOUT = 3.0


@pytest.fixture(scope="module")
def jobs():
    """Every planted bug, plain (Flight Recorder on) and with TORCH_DISTRIBUTED_DEBUG=DETAIL, and a healthy run."""
    bugs = ("skip", "order", "shape", "dead")
    plain = run_jobs(*[dict(bug=b, timeout=TIMEOUT) for b in ("none", *bugs)])
    detail = run_jobs(*[dict(bug=b, debug="DETAIL", flight_recorder=False, timeout=TIMEOUT) for b in bugs])
    return dict(zip(("none", *bugs), plain)), dict(zip(bugs, detail))


def test_a_healthy_run_finishes_and_its_dumps_agree(jobs):
    job = jobs[0]["none"]
    assert job.returncode == 0, job.output[-3000:]
    assert job.report().endswith("every rank finished (exit code 0)")
    assert analyze(job.out) == "", "fr_trace reports nothing for a run whose ranks agree"
    ops = [[e["op"] for e in dump_entries(p)] for p in job.dumps().values()]
    assert ops[0] == ops[1] and ops[0][-1] == "barrier" and ops[0].count("all_reduce") == 8, ops


@pytest.mark.parametrize("bug", ["skip", "order"])
def test_a_hang_ends_in_the_timeout_and_the_flight_recorder_names_the_collective(jobs, bug):
    job = jobs[0][bug]
    assert job.returncode != 0 and {r for r, _ in job.failures} == {0, 1}, job.output[-3000:]
    assert all(gloo_error(job.last_words(r)) for r in (0, 1)), job.lines
    assert any(f"Timed out waiting {int(TIMEOUT * 1000)}ms" in job.last_words(r) for r in (0, 1)), job.lines
    assert sorted(job.dumps()) == [0, 1]
    want = {"skip": "'all_reduce' does not match found collective type: 'barrier'",
            "order": "'broadcast' does not match found collective type: 'all_reduce'"}[bug]
    report = analyze(job.out)
    assert "Culprit rank 1" in report and want in report and "planted_bugs.py" in report, report


@pytest.mark.parametrize("bug, words", [
    ("skip", ["rank 0: DETAIL: mismatch; this rank runs ALLREDUCE #7, tensor [] Float",
              "rank 1: DETAIL: mismatch; this rank runs BARRIER #7"]),
    ("order", ["rank 0: DETAIL: mismatch; this rank runs BROADCAST #4, tensor [1] Float",
               "rank 1: DETAIL: mismatch; this rank runs ALLREDUCE #4, tensor [9] Float"]),
    ("shape", ["rank 0: DETAIL: mismatch; this rank runs ALLREDUCE #0, tensor [9] Float",
               "rank 1: DETAIL: mismatch; this rank runs ALLREDUCE #0, tensor [8] Float"]),
])
def test_detail_names_each_ranks_collective(jobs, bug, words):
    summary = jobs[1][bug].detail_summary()
    assert summary.splitlines() == words, summary


def test_a_shape_mismatch_aborts_the_smaller_rank_and_leaves_one_dump(jobs):
    job = jobs[0]["shape"]
    assert job.failures[0] == (1, -6), job.output[-3000:]
    assert "Received data size doesn't match expected size" in job.report()
    assert sorted(job.dumps()) == [0]
    assert "missed FR dumps from ranks ({1})" in analyze(job.out)


def test_a_dead_rank_is_named_by_torchrun_and_by_detail(jobs):
    job = jobs[0]["dead"]
    assert job.failures[0] == (1, -9) and "root cause rank 1, signal SIGKILL" in job.report(), job.output[-3000:]
    assert job.last_words(1) == "rank 1: step 1 done"
    assert "Ranks 1 failed to pass monitoredBarrier" in jobs[1]["dead"].last_words(0)


def test_torch_2_13s_analyzer_needs_the_gloo_dump_fix(jobs, tmp_path):
    """If this fails, torch names gloo's default group in pg_config now: drop fix_gloo_dumps."""
    src = jobs[0]["skip"].out
    for p in src.glob("fr_[0-9]*"):
        shutil.copy(p, tmp_path / p.name)
    raw = pickle.loads((tmp_path / "fr_0").read_bytes())
    if "" not in raw["pg_config"]:                                # already fixed by analyze() in an earlier test
        raw["pg_config"] = {"": {"name": "", "desc": "", "ranks": raw["pg_config"]["0"]["ranks"]}}
        for p in tmp_path.glob("fr_[0-9]*"):
            d = pickle.loads(p.read_bytes())
            d["pg_config"] = raw["pg_config"]
            p.write_bytes(pickle.dumps(d))
    cmd = [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", str(tmp_path), "-p", "fr_"]
    before = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert before.returncode != 0 and "KeyError: ('0', 0)" in before.stderr, before.stderr[-2000:]
    assert fix_gloo_dumps(tmp_path) == 2 and fix_gloo_dumps(tmp_path) == 0
    after = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert after.returncode == 0 and "Culprit rank 1" in after.stdout + after.stderr, after.stdout + after.stderr


def test_pyspy_shows_where_each_rank_hangs():
    ok, why = debugging.pyspy_available()
    if not ok:
        pytest.skip(why)
    job = run_job("skip", spy=True, timeout=6, flight_recorder=False)
    if not job.stacks:
        pytest.skip(f"py-spy cannot read another process here: {job.spy_note}")
    assert job.stacks[0][-1].startswith("all_reduce (torch/distributed/distributed_c10d.py:")
    assert job.stacks[1][-1].startswith("barrier (torch/distributed/distributed_c10d.py:")
    assert all(any(f.startswith("train (planted_bugs.py:") for f in s) for s in job.stacks.values())
    assert not any("<frozen" in f for s in job.stacks.values() for f in s)


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


def test_plot_trace_draws_one_row_per_thread():
    import matplotlib
    matplotlib.use("Agg")
    ax = debugging.plot_trace(_cases()[0][1], "test")
    assert [t.get_text() for t in ax.get_yticklabels()] == ["main thread", "gloo worker", "gloo worker"]


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
