"""How pytest-xdist shares every run of this repository's tests between its workers (pyproject.toml's addopts run
``-n 2 --dist loadscope``). It lives at the repository's root because pytest loads it for any path below, the
notebooks included (`pytest notebooks/03_all_reduce_by_hand.ipynb` does not load tests/conftest.py, which holds
the suite's fixtures).

- A notebook is one unit: nbval runs its cells in order in one kernel, so every cell goes to the same worker.
- A test module is one unit (its classes included): its module-scoped clusters and fixtures start once, on one
  worker.
- Work that times itself shares one unit, ``timed``: those modules and lessons run one after another on one
  worker, never beside each other (the other worker still runs untimed work beside them: their asserts and
  code-chosen sentences hold on a busy machine, as CONTRIBUTING's rule for stored outputs asks of every lesson).
- The longest units start first (lessons by their stored execution times), so that no worker idles at the end
  while the other finishes a long notebook.

It also chooses the CPU kernels of each lesson's kernel (one nbval pass, not two): a lesson whose checked outputs
hold a computed float (``scripts/stored_outputs.py``'s rule) runs with torch's CPU kernels forced down to the
baseline instruction set (``BASELINE_CPU``: another machine's arithmetic than the one that stored its outputs); the
others run natively. ``MICRO_DDP_KERNELS=native`` or ``=baseline`` runs every notebook one way.

`pytest -n 0 ...` runs in one process, as before (for a debugger, or to time one file alone).
"""
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT / "scripts"))
import stored_outputs  # noqa: E402  (scripts/ is not a package; the lessons' stored times are read there once)

TIMED = {
    # timed asserts (with 5x margins) and the dead-rank and straggler tests, whose verdicts follow the order in
    # which processes die or arrive
    "tests/test_engine.py", "tests/test_engine_faults.py", "tests/test_engine_leaks.py",
    "tests/test_train_script.py", "tests/test_debugging.py", "tests/test_exercises_09_10.py",
    # the lessons that time things and choose their sentences from the timings (bandwidth, overlap, the cost
    # model, the pipeline bubble)
    "notebooks/04_measuring_bandwidth.ipynb", "notebooks/07_buckets_and_overlap.ipynb",
    "notebooks/10_tradeoffs.ipynb", "notebooks/15_beyond_data_parallelism.ipynb",
}
# A module known to take long on 2 cores starts early (seconds on a quiet 2-core machine; a guess is enough: the
# order only balances the two workers). Lessons use their stored execution times instead.
LONG_MODULES = {"tests/test_browser.py": 170, "tests/test_finetune_script.py": 160,
                "tests/test_checker_fit_tighter.py": 130, "tests/test_will_it_fit.py": 110,
                "tests/test_true_size.py": 90, "tests/test_engine_faults.py": 90, "tests/test_scale_out.py": 90,
                "tests/test_kernel.py": 90, "tests/test_will_it_fit_nothing_fits.py": 70,
                "tests/test_readme_promises.py": 60, "tests/test_model_zoo.py": 60, "tests/test_export.py": 60,
                "tests/test_site.py": 90}  # one `make site` (about 45 s) shared by its page and Chromium checks


# torch 2.13 then reports torch.backends.cpu.get_cpu_capability() == "DEFAULT" (ATen without AVX2/AVX-512), MKL_VERBOSE
# "SSE4.2", oneDNN "isa:Intel SSE4.1" (tests/test_project.py checks each); the Makefile's BASELINE_CPU is the same.
BASELINE_CPU = {"ATEN_CPU_CAPABILITY": "default", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2", "ONEDNN_MAX_CPU_ISA": "SSE41"}
KERNEL_MODES = ("rule", "native", "baseline")


def kernels_for(path):
    """"baseline" or "native": the CPU kernels the notebook at ``path`` runs with (see the module's docstring)."""
    mode = os.environ.get("MICRO_DDP_KERNELS", "rule").strip().lower() or "rule"
    if mode not in KERNEL_MODES:
        raise pytest.UsageError(f"MICRO_DDP_KERNELS={mode!r}: use one of {', '.join(KERNEL_MODES)} (rule is the "
                                f"default: the lessons that print computed floats run forced down)")
    if mode != "rule":
        return mode
    return "baseline" if stored_outputs.computed_floats(path) else "native"


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_setup(item):
    """nbval starts a notebook's kernel when its first cell is set up, with this process's environment: for a
    notebook that runs forced down, BASELINE_CPU is in that environment while the kernel starts (its ranks, fork
    server and torchrun jobs inherit it), and taken out again before the next test."""
    starting = item.path.suffix == ".ipynb" and getattr(item.parent, "kernel", False) is None
    if not (starting and kernels_for(item.path) == "baseline"):
        yield
        return
    saved = {name: os.environ.get(name) for name in BASELINE_CPU}
    os.environ.update(BASELINE_CPU)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def pytest_report_header(config):
    mode = os.environ.get("MICRO_DDP_KERNELS", "rule").strip().lower() or "rule"
    if mode != "rule":
        return f"notebooks: every kernel {mode} (MICRO_DDP_KERNELS={mode})"
    forced = " ".join(path.name[:2] for path in stored_outputs.baseline_lessons())
    return f"notebooks: lessons {forced} run with CPU kernels forced down to the baseline (the rest natively)"


def _stored_seconds(path):
    """The sum of a notebook's stored cell execution times (scripts/stored_outputs.py reads them; 0 when none)."""
    try:
        return sum(seconds or 0.0 for _, seconds in stored_outputs.cell_times(path))
    except (OSError, ValueError, KeyError):
        return 0.0


def unit_of(path):
    """The xdist group of a test file or notebook, given its path relative to the repository."""
    return "timed" if path in TIMED else path


def unit_of_nodeid(nodeid):
    """The unit of a test id ("notebooks/03_all_reduce_by_hand.ipynb::Cell 4", "tests/test_x.py::TestY::test_z")."""
    return unit_of(nodeid.split("::", 1)[0])


def _path_of(item):
    try:
        return item.path.resolve().relative_to(ROOT).as_posix()
    except ValueError:          # a test file outside the repository (tests of the Makefile make their own)
        return item.path.as_posix()


def pytest_collection_modifyitems(config, items):
    """The longest units first (each worker collects in this order, and the scheduler hands out units in it)."""
    cost = {}
    for item in items:
        path = _path_of(item)
        if path not in cost:
            cost[path] = _stored_seconds(item.path) if path.endswith(".ipynb") else LONG_MODULES.get(path, 10.0)
    per_unit = {}
    for path, seconds in cost.items():
        per_unit[unit_of(path)] = per_unit.get(unit_of(path), 0.0) + seconds
    # a stable sort: within a unit the collection order (a notebook's cells, a module's tests) is kept
    items.sort(key=lambda item: -per_unit[unit_of(_path_of(item))])


@pytest.hookimpl(tryfirst=True)  # before xdist's own choice of scheduler
def pytest_xdist_make_scheduler(config, log):
    """--dist loadscope, with this file's units as the scopes: pytest-xdist's own loadscope splits a notebook's
    cells apart (their node ids read like a class's methods), and its loadgroup cannot see marks under pytest 9.2
    (it rewrites ``item._nodeid``, which pytest 9.2's ``nodeid`` no longer reads)."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByUnit(LoadScopeScheduling):
        def _split_scope(self, nodeid):
            return unit_of_nodeid(nodeid)

    config.option.loadscopereorder = False  # keep the collection's order: the longest units first
    return ByUnit(config, log)
