"""``scripts/gpu_check.py`` (``make test-gpu``) on a machine without CUDA: its no-CUDA path, its table, its rules.

    .venv/bin/python -m pytest tests/test_gpu_check.py -q

The GPU checks themselves need a GPU. Here: the script says clearly that there is no CUDA and exits 0 with
every row skipped; a failing check makes a FAILED row and exit code 1; the lessons' cells it would run are
the ones ``%%ddp`` would put on NCCL; only a device error fails a lesson; and the cells of its collective,
MicroDDP and bf16-hook checks compute what they assert, run on CPU tensors over gloo (their device line
swapped for the CPU), so a wrong expected value shows up here and not first on someone's GPU; and the will_it_fit
check's prediction runs here and its verdict is the 15% margin.
"""
import importlib.util
import os
import subprocess
import sys

import pytest

from conftest import ROOT

SCRIPT = ROOT / "scripts" / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_without_cuda_it_says_so_and_exits_0_with_every_row_skipped(gpu_check):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    out = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.startswith("No CUDA here ("), out.stdout
    for area, name in gpu_check.PLAN:
        line = next((li for li in out.stdout.splitlines() if name in li), None)
        assert line is not None and "skipped (no CUDA)" in line and line.startswith(area), (name, out.stdout)
    assert out.stdout.rstrip().endswith(f"gpu_check: {len(gpu_check.PLAN)} skipped (no CUDA)"), out.stdout


def test_a_failing_check_is_a_failed_row_and_exit_code_1(gpu_check):
    def ok(ctx):
        return gpu_check.PASSED, "fine"

    def broken(ctx):
        raise AssertionError("the sum was 5, expected 6")

    def several(ctx):
        return [("lessons", "00", gpu_check.PASSED, "3 of 3 cells ran"), ("lessons", "01", gpu_check.INFO, "x")]

    ctx = gpu_check.Context(gpus=1)
    rows = gpu_check.run_checks(ctx, [ok, broken, several], [("a", "ok"), ("a", "broken"), ("a", "several")])
    assert [r[:3] for r in rows] == [("a", "ok", "passed"), ("a", "broken", "FAILED"), ("lessons", "00", "passed"),
                                     ("lessons", "01", "info")], rows
    assert rows[1][3] == "AssertionError: the sum was 5, expected 6", rows[1]
    assert gpu_check.exit_code(rows) == 1
    assert gpu_check.exit_code([r for r in rows if r[2] != "FAILED"]) == 0
    assert gpu_check.summary(rows) == "2 passed, 1 FAILED, 1 info"


def test_a_check_that_hangs_is_ended_and_reported(gpu_check, monkeypatch):
    import time

    closed = []
    monkeypatch.setattr(gpu_check, "CHECK_LIMIT_S", 1)
    ctx = gpu_check.Context(gpus=1)
    monkeypatch.setattr(ctx, "close", lambda: closed.append(True))
    rows = gpu_check.run_checks(ctx, [lambda ctx: time.sleep(30)], [("engine", "hangs")])
    assert rows[0][2:4] == ("FAILED", "CheckTimeout: the check ran over 1 s (a hang the engine did not end?)"), rows
    assert rows[0][4] < 10 and closed == [True], "the hung check's ranks are shut down"


def test_the_table_has_a_header_a_row_per_check_and_wraps_long_details(gpu_check):
    rows = [("engine", "NCCL at world size 1", "passed", "short", 1.25),
            ("lessons", "02 on NCCL", "FAILED", "word " * 60, 0.0)]
    table = gpu_check.format_table(rows, width=100).splitlines()
    assert table[0].split() == ["area", "check", "status", "time", "detail"], table[0]
    assert table[2].startswith("engine   NCCL at world size 1  passed  1.2 s") and table[2].endswith("short"), table
    assert table[3].startswith("lessons  02 on NCCL") and "FAILED" in table[3]
    assert len(table) > 4 and all(len(line) <= 100 for line in table), table
    detail = " ".join(line[len(table[2]) - len("short"):].strip() for line in table[3:])
    assert detail.split() == ["word"] * 60, "the wrapped detail keeps every word"


def test_the_lessons_cells_are_those_ddp_would_put_on_nccl(gpu_check):
    def cell(src):
        return {"cell_type": "code", "source": src}

    nb = {"cells": [cell("%%ddp -n 4\na = 1"), {"cell_type": "markdown", "source": "%%ddp -n 9\nno"},
                    cell("%%ddp\nb = 2"), cell("%%ddp -n 2 --backend gloo\nc = 3"), cell("%%ddp -n 3\nd = 4"),
                    cell("%ddp shutdown"), cell("%%ddp --world-size 2 --rank 0\ne = 5"),
                    cell("%%ddp --backend=gloo\nf = 6"), cell("%%ddp --backend nccl\ng = 7"), cell("x = 1")]}
    assert gpu_check.nccl_cells(nb) == [(0, 4, "a = 1"), (2, None, "b = 2"), (6, 2, "e = 5"), (8, None, "g = 7")]


def test_only_a_device_error_fails_a_lesson(gpu_check):
    def failed(text):
        return gpu_check.CellFailed(RuntimeError(f"rank 0 failed with {text}\nTraceback ...\n{text}"), "")

    status, detail = gpu_check._classify(failed("RuntimeError: No backend type associated with device type cpu"))
    assert status == "FAILED" and "device type cpu" in detail
    status, _ = gpu_check._classify(failed(
        "RuntimeError: Expected all tensors to be on the same device, but found cuda:0 and cpu"))
    assert status == "FAILED"
    status, detail = gpu_check._classify(failed("NameError: name 'scale' is not defined"))
    assert (status, detail) == ("info", "not a device error: NameError: name 'scale' is not defined")
    status, detail = gpu_check._classify(failed("RuntimeError: ProcessGroupGloo::scatter: unsupported device type"))
    assert status == "info" and detail.startswith("gloo does not serve this"), detail


def test_the_last_check_fails_when_the_notebook_process_initialised_cuda(gpu_check, monkeypatch):
    """docs/gpus.md's promise ("the notebook process never initialises CUDA itself") on the GPU: the check that runs
    last asks torch.cuda.is_initialized() in the script's own process, which started every cluster."""
    import types

    import torch

    assert gpu_check.CHECKS[-1] is gpu_check.check_notebook_process_cuda and len(gpu_check.CHECKS) == \
        len(gpu_check.PLAN), "it runs last, after everything that could initialise CUDA here"
    assert gpu_check.PLAN[-1] == ("engine", "the notebook process never initialised CUDA")

    def modules(initialised):
        return {"torch": types.SimpleNamespace(cuda=types.SimpleNamespace(is_initialized=lambda: initialised))}

    status, detail = gpu_check.cuda_in_this_process(modules(True))
    assert status == "FAILED" and "initialised CUDA" in detail, detail
    assert gpu_check.cuda_in_this_process(modules(False))[0] == "passed"
    assert gpu_check.cuda_in_this_process({})[0] == "passed", "no torch here: nothing initialised"
    assert gpu_check.check_notebook_process_cuda(None)[0] == "passed", "this CPU process never initialised CUDA"
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    rows = gpu_check.run_checks(gpu_check.Context(gpus=1), [gpu_check.check_notebook_process_cuda],
                                [gpu_check.PLAN[-1]])
    assert rows[0][2] == "FAILED" and gpu_check.exit_code(rows) == 1, rows


def _on_cpu(source):
    return (source.replace('torch.device("cuda", local_rank % torch.cuda.device_count())', 'torch.device("cpu")')
            .replace('== "cuda"', '== "cpu"').replace('("cuda", [', '("cpu", ['))


def test_its_cells_compute_what_they_assert_on_cpu_tensors(gpu_check, make_cluster):
    cluster = make_cluster(2, timeout=120)
    got = gpu_check.run(cluster, _on_cpu(gpu_check.GLOO_CUDA_COLLECTIVES))
    assert all(set(r.values()) == {"ok"} for r in got), got
    assert list(got[0]) == ["all_reduce", "broadcast", "all_gather", "reduce_scatter_tensor", "reduce"], got[0]
    backend, where, buckets = gpu_check.run(cluster, _on_cpu(gpu_check.MICRO_DDP_VS_DDP))[0]
    assert (backend, where) == ("gloo", "cpu") and buckets == 3, (backend, where, buckets)
    backend, registered = gpu_check.run(cluster, _on_cpu(gpu_check.BF16_HOOK))[0]
    if not __import__("torch").version.cuda:  # a CPU build refuses the hook at registration (lesson 09's fact)
        assert registered.startswith("refused: BF16 all reduce communication hook required CUDA"), registered
    with pytest.raises(gpu_check.CellFailed, match="ZeroDivisionError"):
        gpu_check.run(cluster, "print('visible in the output'); 1 / 0")


def test_make_test_gpu_runs_the_script():
    import shutil

    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    run = subprocess.run(["make", "--no-print-directory", "-n", "-o", ".venv/.installed", "test-gpu",
                          "GPU_CHECK_ARGS=--quick"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.split() == [".venv/bin/python", "scripts/gpu_check.py", "--quick"], run.stdout


def test_the_will_it_fit_check_passes_within_the_margin_and_names_the_phase_over_it(gpu_check):
    """Its prediction side runs here (fake tensors need no GPU); the verdict against a measurement is the 15% margin
    will_it_fit keeps, per phase."""
    from course_utils.true_size import LlamaShape

    tiny = LlamaShape("tiny", vocab_size=256, d_model=64, n_layer=2, d_ff=176, n_head=4, n_kv_head=2)
    predicted = gpu_check.predicted_peaks(tiny, seq_len=32)
    assert list(predicted) == list(gpu_check.PHASES) and all(b > 0 for b in predicted.values()), predicted
    status, detail = gpu_check.memory_gap(predicted, {p: b * 1.1 for p, b in predicted.items()})
    assert status == gpu_check.PASSED and detail.startswith("within the 15% margin") and "+10.0%" in detail, detail
    status, detail = gpu_check.memory_gap(predicted, {**predicted, "backward": predicted["backward"] * 1.2})
    assert status == gpu_check.FAILED and detail.startswith("backward over the 15% margin"), detail
