"""CI's budget and how its work is chosen: every lesson runs in about 2 minutes with no cell over about 30 s (by
the execution times `make notebooks` stores), the baseline pass re-checks exactly the lessons whose checked outputs
hold computed floats (scripts/stored_outputs.py's rule), and the root conftest.py keeps each notebook and each
module on one pytest-xdist worker.

    .venv/bin/python -m pytest tests/test_ci_budget.py
"""
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from conftest import LESSONS, ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import stored_outputs  # noqa: E402  (scripts/ is not a package)

# the repository's root conftest.py (pytest loads it as a plugin; "conftest" here is tests/conftest.py)
_spec = importlib.util.spec_from_file_location("conftest_root", ROOT / "conftest.py")
conftest_root = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(conftest_root)

CELL_BUDGET = 30         # seconds: no cell keeps a learner waiting longer (CONTRIBUTING.md)
LESSON_BUDGET = 120      # seconds: a lesson top to bottom on a quiet 2-core machine
# Known debt, as a ceiling that only comes down: lesson 14 (its headline table's least-of-3 rows, the article's
# model at true size, Going further's two 4-rank measurements) takes 137 s on the reference machine, recorded
# quietly. It may not grow; once it fits LESSON_BUDGET it leaves this list (the test below says so).
OVER_BUDGET_TODAY = {"14": 140}


# ---- the stored execution times ----------------------------------------------------------------

@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.name[:2])
def test_every_code_cell_has_its_stored_time(path):
    missing = [i for i, seconds in stored_outputs.cell_times(path) if seconds is None]
    assert not missing, (f"{path.name}: code cells {missing} have no stored execution time: re-execute the lesson "
                         f"with `make notebooks` (scripts/execute_notebooks.py), never from an interactive session")


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.name[:2])
def test_each_lesson_runs_within_the_budget(path):
    """By the stored times, as the reference machine would have taken them (scripts/stored_outputs.py: a lesson
    executed where a fresh `import torch` took 3 s instead of 1.5 is held to half its stored times)."""
    scale = stored_outputs.budget_scale(path)
    times = [(i, s * scale) for i, s in stored_outputs.cell_times(path) if s is not None]
    slow = [f"cell {i}: {s:.0f} s" for i, s in times if s > CELL_BUDGET]
    total = sum(s for _, s in times)
    on = "" if scale == 1.0 else f" on the reference machine (stored times x {scale:.2f})"
    assert not slow, (f"{path.name}: {', '.join(slow)}{on}, over the {CELL_BUDGET} s a cell may keep a learner "
                      "waiting: measure what the claim needs and no more (fewer configurations, fp32 where the "
                      "dtype does not change the bytes, small bf16 runs)")
    budget = OVER_BUDGET_TODAY.get(path.name[:2], LESSON_BUDGET)
    assert total <= budget, (f"{path.name} takes {total:.0f} s top to bottom by its stored times{on}, over "
                             f"the {budget} s budget of {'this' if budget != LESSON_BUDGET else 'a'} lesson")
    if path.name[:2] in OVER_BUDGET_TODAY:
        assert total > LESSON_BUDGET, (f"{path.name} now fits the {LESSON_BUDGET} s budget ({total:.0f} s): take it "
                                       "out of OVER_BUDGET_TODAY")


def test_stored_times_are_compared_as_the_reference_machine_took_them(tmp_path):
    """A lesson executed on a machine whose fresh `import torch` took twice the reference's is held to half its
    stored times; one without the measurement (executed before it was stored) as it is."""
    path = _notebook(tmp_path, [("x = 1", "", 50.0)])
    assert stored_outputs.budget_scale(path) == 1.0
    nb = json.loads(path.read_text())
    nb["metadata"]["micro_ddp"] = {"import_torch_s": 2 * stored_outputs.REFERENCE_IMPORT_TORCH_S}
    path.write_text(json.dumps(nb))
    assert stored_outputs.budget_scale(path) == pytest.approx(0.5)
    source = (ROOT / "scripts" / "execute_notebooks.py").read_text()
    assert 'nb.metadata["micro_ddp"] = {"import_torch_s": speed}' in source, "make notebooks stores the speed"


def _notebook(tmp_path, cells):
    """A minimal notebook of code cells, each given as (source, stream text, seconds or None)."""
    nb_cells = []
    for source, text, seconds in cells:
        metadata = {}
        if seconds is not None:
            metadata["execution"] = {"iopub.execute_input": "2026-01-01T00:00:00.000000Z",
                                     "shell.execute_reply": f"2026-01-01T00:00:{seconds:09.6f}Z"}
        nb_cells.append({"cell_type": "code", "source": source, "metadata": metadata, "execution_count": 1,
                         "outputs": [{"output_type": "stream", "name": "stdout", "text": text}]})
    path = tmp_path / "00_probe.ipynb"
    path.write_text(json.dumps({"cells": nb_cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    return path


def test_the_stored_times_are_read_as_nbclient_writes_them(tmp_path):
    path = _notebook(tmp_path, [("x = 1", "", 12.5), ("y = 2", "", None)])
    code_cells = stored_outputs.cell_times(path)
    assert code_cells[0][1] == pytest.approx(12.5) and code_cells[1][1] is None, code_cells
    lesson = json.loads(LESSONS[0].read_text())
    recorded = next(c["metadata"]["execution"] for c in lesson["cells"] if c["cell_type"] == "code")
    assert {"iopub.execute_input", "shell.execute_reply"} <= set(recorded), (
        f"nbclient records other keys than the budget reads: {sorted(recorded)}")


# ---- the baseline pass ------------------------------------------------------------------------

@pytest.mark.parametrize("source,printed,computed", [
    ("print(loss)", "loss 2.3718\n", True),                       # a trained value: the arithmetic decides it
    ("print(err)", "relative error 3.2e-04\n", True),
    ("print(n)", "4,096 bytes, 16 of 16 ranks\n", False),        # integers print the same everywhere
    ("print(x)", "tensor([0., 1., 2.]) -> 4.0 and 10.00\n", False),   # integer-valued floats too
    ("print(t)", "all-reduce took 3.25 ms at 1.42 GB/s\n", False),      # masked by tests/sanitize.cfg
    ("print(v)", "[OK] torch 2.13 and Python 3.11\n", False),           # versions
    ("lr = 0.25\nprint(lr)", "lr 0.25\n", False),                       # a constant of the lesson echoed back
])
def test_the_baseline_rule_finds_computed_floats(tmp_path, source, printed, computed):
    path = _notebook(tmp_path, [(source, printed, 1.0)])
    found = stored_outputs.computed_floats(path)
    assert bool(found) == computed, f"{printed!r}: computed floats found {found}, expected {computed}"


def test_the_baseline_pass_rechecks_the_lessons_that_print_trained_values_and_not_the_rest():
    chosen = {p.name[:2] for p in stored_outputs.baseline_lessons()}
    assert {"01", "05", "11"} <= chosen, f"lessons that print trained losses and gradients must be re-checked: {chosen}"
    assert not {"00", "04"} & chosen, (
        f"00 (integers, versions) and 04 (masked timings) hold no computed float: {chosen}")


def test_make_test_baseline_cpu_runs_the_rule_unless_told_which_notebooks():
    default = subprocess.run(["make", "--no-print-directory", "-n", "-o", ".venv/.installed", "test-baseline-cpu"],
                             cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert default.returncode == 0, default.stdout + default.stderr
    assert "scripts/stored_outputs.py --baseline" in default.stdout, (
        f"make test-baseline-cpu must choose its lessons by the rule:\n{default.stdout}")
    narrowed = subprocess.run(["make", "--no-print-directory", "-n", "-o", ".venv/.installed", "test-baseline-cpu",
                               "NOTEBOOKS=notebooks/03_all_reduce_by_hand.ipynb"],
                              cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert "stored_outputs.py" not in narrowed.stdout and "03_all_reduce_by_hand" in narrowed.stdout, narrowed.stdout


def test_one_nbval_pass_runs_the_rules_lessons_forced_down_and_the_rest_natively(tmp_path):
    """`make test` runs each notebook once: the root conftest.py starts the kernel of a notebook that prints a
    computed float with BASELINE_CPU in its environment (its ranks inherit it) and every other kernel natively.
    Two probe notebooks, each printing the kernel's ATEN_CPU_CAPABILITY: the one with a computed float (0.5) stored
    passes only forced down, the other only natively (an unset variable)."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    floats = _notebook(tmp_path / "a", [("import os\nprint(os.environ.get('ATEN_CPU_CAPABILITY'), 1 / 2)",
                                         "default 0.5\n", 1.0)])
    integers = _notebook(tmp_path / "b", [("import os\nprint(os.environ.get('ATEN_CPU_CAPABILITY'), 4 // 2)",
                                           "None 2\n", 1.0)])
    assert stored_outputs.computed_floats(floats) and not stored_outputs.computed_floats(integers)
    env = {k: v for k, v in os.environ.items() if k not in conftest_root.BASELINE_CPU and k != "MICRO_DDP_KERNELS"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "conftest", "-p", "no:cacheprovider", "-n", "0",
                          "--nbval", "--nbval-current-env", str(floats), str(integers)],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0 and "2 passed" in run.stdout, run.stdout[-3000:] + run.stderr[-2000:]
    assert "lessons 01 " in run.stdout and "forced down" in run.stdout, f"the header names them:\n{run.stdout}"
    # the pytest process itself keeps its own environment: only the kernel got the variables
    assert conftest_root.kernels_for(floats) == "baseline" and conftest_root.kernels_for(integers) == "native"


def test_the_kernels_can_be_chosen_for_every_notebook(tmp_path, monkeypatch):
    path = _notebook(tmp_path, [("print(1 / 2)", "0.5\n", 1.0)])
    for mode, expected in [("native", "native"), ("baseline", "baseline"), ("", "baseline"), ("rule", "baseline")]:
        monkeypatch.setenv("MICRO_DDP_KERNELS", mode)
        assert conftest_root.kernels_for(path) == expected, mode
    monkeypatch.setenv("MICRO_DDP_KERNELS", "avx2")
    with pytest.raises(pytest.UsageError, match="use one of rule, native, baseline"):
        conftest_root.kernels_for(path)


def test_ci_runs_one_nbval_pass_and_make_test_baseline_cpu_still_forces_every_notebook_it_runs():
    """The baseline pass is in `make test` (above); .ci/run no longer runs the notebooks twice. The contributor's
    target stays: it runs the rule's lessons (or NOTEBOOKS) all forced down, in the Makefile's environment and the
    conftest's."""
    script = (ROOT / ".ci" / "run").read_text()
    assert "make test-baseline-cpu" not in script.split("set -euo pipefail", 1)[1], "CI runs the notebooks twice"
    recipe = subprocess.run(["make", "--no-print-directory", "-n", "-o", ".venv/.installed", "test-baseline-cpu"],
                            cwd=ROOT, capture_output=True, text=True, timeout=60).stdout
    assert "MICRO_DDP_KERNELS=baseline" in recipe, recipe
    makefile = (ROOT / "Makefile").read_text()
    for name, value in conftest_root.BASELINE_CPU.items():
        assert f"{name}={value}" in makefile, f"the Makefile's BASELINE_CPU lacks {name}={value}"


def test_the_rule_prints_paths_pytest_can_collect():
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "stored_outputs.py"), "--baseline"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    paths = run.stdout.split()
    assert paths and all((ROOT / p).is_file() and re.match(r"notebooks/\d\d_", p) for p in paths), run.stdout


# ---- sharing the work between two workers ---------------------------------------------------

def _root_conftest():
    spec = importlib.util.spec_from_file_location("root_conftest", ROOT / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_timed_units_name_files_that_exist():
    timed = _root_conftest().TIMED
    missing = sorted(p for p in timed if not (ROOT / p).is_file())
    assert not missing, f"conftest.py's TIMED names files that do not exist (renamed?): {missing}"


def test_each_unit_is_a_file_and_the_timed_files_are_one():
    conftest = _root_conftest()
    assert conftest.unit_of_nodeid("notebooks/03_all_reduce_by_hand.ipynb::Cell 4") == (
        "notebooks/03_all_reduce_by_hand.ipynb")
    assert conftest.unit_of_nodeid("tests/test_costmodel.py::TestFit::test_alpha[a::b]") == "tests/test_costmodel.py"
    assert conftest.unit_of_nodeid("notebooks/04_measuring_bandwidth.ipynb::Cell 1") == conftest.unit_of_nodeid(
        "tests/test_engine.py::test_x") == "timed"


PROBE_MODULE = """
import os, pytest

def _log():
    with open(os.environ["XDIST_PROBE_LOG"], "a") as f:
        f.write(f"{os.path.basename(__file__)} {os.environ.get('PYTEST_XDIST_WORKER')}\\n")

class TestOne:
    @pytest.mark.parametrize("i", range(3))
    def test_a(self, i):
        _log()

class TestTwo:
    @pytest.mark.parametrize("i", range(3))
    def test_b(self, i):
        _log()
"""


def test_a_module_with_two_classes_runs_on_one_worker(tmp_path):
    """pytest-xdist's own loadscope would hand TestOne and TestTwo to different workers (a class is its unit);
    the root conftest.py's scheduler keeps a file together. The probe lives in the repository (the root
    conftest.py applies only there) for the nested run alone."""
    text = (ROOT / "pyproject.toml").read_text()
    addopts = re.search(r'^addopts = "(.*)"', text, re.M).group(1).split()
    assert addopts[:4] == ["-n", "2", "--dist", "loadscope"], addopts
    probe = ROOT / "tests" / f".xdist-probe-{os.getpid()}"
    try:
        probe.mkdir()
        (probe / "test_probe_one.py").write_text(PROBE_MODULE)
        (probe / "test_probe_two.py").write_text(PROBE_MODULE)
        run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", str(probe)], cwd=ROOT,
                             capture_output=True, text=True, timeout=120,
                             env=dict(os.environ, XDIST_PROBE_LOG=str(tmp_path / "log")))
    finally:
        shutil.rmtree(probe, ignore_errors=True)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    workers = {}
    for line in (tmp_path / "log").read_text().splitlines():
        name, worker = line.split()
        workers.setdefault(name, set()).add(worker)
    assert sorted(workers) == ["test_probe_one.py", "test_probe_two.py"], workers
    assert all(len(w) == 1 for w in workers.values()), f"a module's tests ran on several workers: {workers}"
