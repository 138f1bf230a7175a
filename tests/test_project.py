"""Project set-up: one list of dependencies, the README's two commands, and what CI runs.

    .venv/bin/python -m pytest tests/test_project.py -p no:randomly

The Makefile targets are checked with ``make -n`` (print, do not run) and, where behaviour matters
(a run that collects no tests must fail), run for real on a temporary test directory with
``-o .venv/.installed`` so that make never re-installs the venv from inside a test.
"""
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import LESSONS, NOTEBOOKS, ROOT, in_ci

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser, as a package (pyproject's test extra)
    import tomli as tomllib

BIN = Path(sys.executable).parent
STAMP = ".venv/.installed"  # the Makefile's "venv is installed" marker; -o treats it as up to date
BASELINE_CPU = {"ATEN_CPU_CAPABILITY": "default", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2", "ONEDNN_MAX_CPU_ISA": "SSE41"}


def _pyproject():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _pip_section(text):
    lines, inside = [], False
    for line in text.splitlines():
        if re.match(r"^\s*- pip:\s*$", line):
            inside = True
            continue
        if inside:
            m = re.match(r"^\s{6,}- (.+?)\s*$", line)
            if not m:
                break
            lines.append(m.group(1))
    return lines


def test_environment_yml_installs_the_same_packages_as_pyproject():
    project = _pyproject()["project"]
    wanted = project["dependencies"] + project["optional-dependencies"]["test"]
    env = (ROOT / "environment.yml").read_text()
    assert re.search(r"^\s*- python=3\.11\s*$", env, re.M), "environment.yml must pin python 3.11"
    pip = _pip_section(env)
    assert pip, "environment.yml has no pip section"
    assert pip[-1] == "-e .", "environment.yml must install the course_utils package itself"
    assert sorted(pip[:-1]) == sorted(wanted), (
        "environment.yml and pyproject.toml disagree:\n"
        f"  only in environment.yml: {sorted(set(pip[:-1]) - set(wanted))}\n"
        f"  only in pyproject.toml:  {sorted(set(wanted) - set(pip[:-1]))}")


def test_torch_is_pinned_to_the_cpu_build_version():
    deps = _pyproject()["project"]["dependencies"]
    torch = [d for d in deps if re.match(r"torch\b", d)]
    assert torch == ["torch==2.13.0"], f"torch must be pinned (an unpinned torch pulls a CUDA build): {torch}"


def test_python_version_promise_is_the_same_everywhere():
    readme = (ROOT / "README.md").read_text()
    promised = re.search(r"Python (3\.\d+)\+", readme)
    assert promised, "the README's quick start should say which Python it needs ('Python 3.N+')"
    project = _pyproject()
    assert project["project"]["requires-python"] == f">={promised.group(1)}", (
        f"README promises Python {promised.group(1)}+, pyproject says {project['project']['requires-python']}")
    target = "py" + promised.group(1).replace(".", "")
    assert project["tool"]["ruff"]["target-version"] == target, f"ruff should check against {target}"
    if promised.group(1) == "3.10":
        assert any(d.startswith("tomli") and "python_version < '3.11'" in d
                   for d in project["project"]["optional-dependencies"]["test"]), (
            "tests/test_project.py falls back to tomli on Python 3.10: the test extra must install it there")


# ---- the README's two commands ------------------------------------------------------------------

def _make(*args, env=None, timeout=120):
    if shutil.which("make") is None:
        if in_ci():
            pytest.fail("make is not installed: the README's two commands need it")
        pytest.skip("make is not installed (the README's two commands need it)")
    return subprocess.run(["make", "--no-print-directory", "-o", STAMP, f"BIN={BIN}", *args], cwd=ROOT,
                          env=dict(os.environ, **(env or {})), capture_output=True, text=True, timeout=timeout)


def _dry_run(target, *args):
    """The recipe lines ``make -n target`` would run, split into argv lists."""
    run = _make("-n", target, *args)
    assert run.returncode == 0, f"`make {target}` is not a working Makefile target:\n{run.stdout}{run.stderr}"
    text = run.stdout.replace("\\\n", " ")
    return [shlex.split(line) for line in text.splitlines() if line.strip() and not line.startswith("echo ")]


def _readme_quick_start():
    readme = (ROOT / "README.md").read_text()
    section = re.search(r"^## Quick start\s*$(.*?)^## ", readme, re.M | re.S)
    assert section, "README.md has no '## Quick start' section"
    block = re.search(r"```bash\n(.*?)```", section.group(1), re.S)
    assert block, "the README's quick start has no ```bash block"
    commands, above = {}, ""
    for line in block.group(1).splitlines():  # a command's comment: beside it, or on the line above it
        command, _, comment = line.partition("#")
        if command.strip():
            commands[command.strip()] = " ".join(filter(None, [above, comment.strip()]))
            above = ""
        else:
            above = comment.strip()
    return commands


def test_readme_quick_start_is_the_two_make_targets():
    commands = _readme_quick_start()
    cpu = f"make lab TORCH_INDEX_URL={CPU_INDEX}"
    assert list(commands) == [cpu, "make lab", "make test"], (
        f"the README's quick start: the first command's CPU-only variant (the line a GPU-less laptop needs) first, "
        f"then the two commands: {commands}")
    assert "CPU-only" in commands.pop(cpu), "README: the first line says it is the CPU-only build of torch"
    for command, says in commands.items():
        assert "creates (or reuses) .venv" in says, f"README: `{command}` # {says}"
        target = command.split()[1]
        # reuses: with the venv installed, the target runs only its own recipe
        reuse = _dry_run(target)
        assert not any("pip" in argv for argv in reuse), f"`{command}` reinstalls an installed venv: {reuse}"
        # creates: with pyproject.toml newer than the venv, it creates the venv and installs the course first
        create = subprocess.run(["make", "--no-print-directory", "-n", "-W", "pyproject.toml", target], cwd=ROOT,
                                capture_output=True, text=True)
        installs = re.search(r'uv pip install .*-e "?\.\[test\]', create.stdout)
        assert re.search(r"uv pip uninstall .*rfc3987-syntax", create.stdout), (
            f"`{command}` must drop rfc3987-syntax (4-5 s of CPU per nbformat import, the Makefile says why)")
        assert re.search(r"-m venv \.venv", create.stdout) and installs, (
            f"`{command}` must create .venv and install the course (with its test extra) when needed:\n{create.stdout}")


CPU_INDEX = "https://download.pytorch.org/whl/cpu"  # PyTorch's install page, "CPU" column


def _setup_lines(*args):
    """The recipe lines of the venv's set-up (pyproject.toml treated as newer than the venv), ``make -n``."""
    run = subprocess.run(["make", "--no-print-directory", "-n", "-W", "pyproject.toml", "lab", *args], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    return [shlex.split(line) for line in run.stdout.splitlines() if "pip install" in line]


def test_the_torch_wheel_index_is_one_make_variable_empty_by_default():
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    default = _setup_lines()
    assert not any("--index-url" in argv or "--extra-index-url" in argv for argv in default), (
        f"by default (CI, this course's machines) torch comes from PyPI like everything else: {default}")
    pin = [d for d in _pyproject()["project"]["dependencies"] if re.match(r"torch\b", d)]
    lines = _setup_lines(f"TORCH_INDEX_URL={CPU_INDEX}")
    first = [i for i, argv in enumerate(lines) if "--index-url" in argv]
    course = [i for i, argv in enumerate(lines) if "-e" in argv and ".[test]" in argv]
    assert len(first) == 1 and course and first[0] < course[0], f"torch from the index first, then the course: {lines}"
    argv = lines[first[0]]
    assert argv[argv.index("--index-url") + 1] == CPU_INDEX and argv[-1] == pin[0], (
        f"`make lab TORCH_INDEX_URL=...` must install pyproject.toml's own pin {pin} from that index: {argv}")
    makefile = (ROOT / "Makefile").read_text()
    assert f"make lab TORCH_INDEX_URL={CPU_INDEX}" in makefile, "the Makefile documents the CPU-only build"
    assert not re.search(r"torch==\d", makefile), "one torch pin, in pyproject.toml: the Makefile reads it from there"


def test_uv_installs_from_the_wheel_folder_pip_is_told_of():
    # uv reads no pip configuration: without this a machine whose CPU build of torch lies in PIP_FIND_LINKS (the
    # course's machines) would download several GB of CUDA torch from PyPI
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    course = [argv for argv in _setup_lines("PIP_FIND_LINKS=/srv/wheels") if ".[test]" in argv]
    assert course and Path(course[0][0]).name == "uv" and course[0][1:3] == ["pip", "install"], (
        f"uv installs the course: {course}")
    argv = course[0]
    assert "--find-links" in argv and argv[argv.index("--find-links") + 1] == "/srv/wheels", (
        f"PIP_FIND_LINKS must reach uv as --find-links: {argv}")


def test_make_lab_opens_the_first_lesson_of_the_learners_copy_on_loopback():
    copy, argv = _dry_run("lab")
    assert copy == [str(BIN / "python"), "scripts/learner_copy.py"], f"`make lab` first makes the copy: {copy}"
    assert argv[:2] == [str(BIN / "jupyter"), "lab"], f"`make lab` should start JupyterLab: {argv}"
    assert "--ip=127.0.0.1" in argv, f"README: JupyterLab listens on 127.0.0.1 only: {argv}"
    assert argv[-1] == "my-notebooks/00_launcher_tour.ipynb", f"README: open 00_launcher_tour of the copy first: {argv}"
    ignored = subprocess.run(["git", "check-ignore", "-q", "my-notebooks/00_launcher_tour.ipynb"], cwd=ROOT)
    assert ignored.returncode == 0, "my-notebooks/ must be git-ignored: saving a lesson there leaves git status clean"


def test_make_test_is_plain_pytest_over_tests_and_notebooks():
    (argv,) = _dry_run("test")
    # README's conda route says `python -m pytest` runs "the same tests as make test": no extra arguments.
    assert argv == [str(BIN / "python"), "-m", "pytest"], f"`make test` should run plain `python -m pytest`: {argv}"
    options = _pyproject()["tool"]["pytest"]["ini_options"]
    assert options["testpaths"] == ["tests", "notebooks"], f"make test must run tests/ and notebooks/: {options}"
    addopts = options["addopts"]
    assert "--nbval" in addopts.split() and "--nbval-sanitize-with tests/sanitize.cfg" in addopts, (
        f"make test must run the notebooks under nbval with tests/sanitize.cfg: {options['addopts']}")


def _tests_dir(tmp_path, body=None):
    """A folder of tests for a nested ``make test TESTS=...`` run (callers add ``-n 0``: one process, no workers)."""
    d = tmp_path / "tests_here"
    d.mkdir(parents=True)
    if body is not None:
        (d / "test_one.py").write_text(body)
    return d


PASSES = "def test_passes():\n    pass\n"


@pytest.mark.parametrize("target,variable", [("test", "TESTS"), ("test-baseline-cpu", "NOTEBOOKS")])
def test_make_targets_fail_when_pytest_collects_nothing(tmp_path, target, variable):
    empty = _make(target, f"{variable}=-n 0 {_tests_dir(tmp_path)}")
    assert empty.returncode != 0, f"`make {target}` passed with no tests collected:\n{empty.stdout}{empty.stderr}"
    assert "no tests ran" in empty.stdout, f"expected pytest's 'no tests ran':\n{empty.stdout}{empty.stderr}"


# uv installs without compiling (the Makefile): make's commands must then write bytecode the first time a module is
# imported, even where the environment says PYTHONDONTWRITEBYTECODE=1, or every process compiles torch again.
WRITES_BYTECODE = "import sys\ndef test_passes():\n    assert not sys.dont_write_bytecode\n"


def test_make_test_runs_pytest_on_what_it_is_given(tmp_path):
    passing = _make("test", f"TESTS=-n 0 {_tests_dir(tmp_path, WRITES_BYTECODE)}",
                    env={"PYTHONDONTWRITEBYTECODE": "1"})
    assert passing.returncode == 0 and "1 passed" in passing.stdout, (
        f"`make test TESTS=...` did not run and pass a passing test that needs bytecode written (the Makefile "
        f"unexports PYTHONDONTWRITEBYTECODE):\n{passing.stdout}{passing.stderr}")


def test_baseline_cpu_target_forces_the_instruction_set_down(tmp_path):
    body = ("import os, torch\n"
            "def test_isa():\n"
            f"    assert {{k: os.environ.get(k) for k in {sorted(BASELINE_CPU)!r}}} == {BASELINE_CPU!r}\n"
            "    assert torch.backends.cpu.get_cpu_capability() == 'DEFAULT'\n"
            f"    open({str(tmp_path / 'cache.txt')!r}, 'w').write(os.environ['MICRO_DDP_CACHE'])\n"
            "    for var in ('IPYTHONDIR', 'JUPYTER_CONFIG_DIR', 'JUPYTER_DATA_DIR', 'JUPYTER_RUNTIME_DIR'):\n"
            "        assert os.environ[var].startswith(os.environ['MICRO_DDP_CACHE']), var  # nbval's kernels\n")
    run = _make("test-baseline-cpu", f"NOTEBOOKS=-n 0 {_tests_dir(tmp_path, body)}", env={"MICRO_DDP_CACHE": ""},
                timeout=300)
    assert run.returncode == 0 and "1 passed" in run.stdout, (
        f"make test-baseline-cpu does not force the kernels down:\n{run.stdout}{run.stderr}")
    # `pytest notebooks` does not load tests/conftest.py: the target gives lesson 04 a temporary cache itself
    cache = Path((tmp_path / "cache.txt").read_text())
    assert cache.is_absolute() and ROOT not in cache.parents and ".cache" not in cache.parts, cache
    assert not cache.exists(), f"make test-baseline-cpu left its temporary cache {cache} behind"


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="MKL and oneDNN's x86 ISAs")
def test_torch_accepts_the_baseline_cpu_settings():
    code = ("import torch\n"
            "print('capability', torch.backends.cpu.get_cpu_capability())\n"
            "print('mkl', torch.backends.mkl.is_available())\n"
            "torch.randn(64, 64) @ torch.randn(64, 64)\n"
            "with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):\n"
            "    torch.nn.functional.conv2d(torch.randn(8, 64, 28, 28), torch.randn(64, 64, 3, 3))\n")
    run = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, MKL_VERBOSE="1", **BASELINE_CPU),
                         capture_output=True, text=True, timeout=300)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    assert "capability DEFAULT" in out, f"ATEN_CPU_CAPABILITY=default was not honoured:\n{out[-2000:]}"
    if "mkl True" in out and _cpu_vendor() in ("GenuineIntel", None):
        # MKL names the instruction set it dispatches to only on Intel CPUs; on AMD its banner reads
        # "Intel(R) Architecture processors" whatever MKL_ENABLE_INSTRUCTIONS says (ATen and oneDNN are checked)
        assert re.search(r"MKL_VERBOSE.*\(Intel\(R\) SSE4\.2\) enabled processors", out), (
            f"MKL_ENABLE_INSTRUCTIONS=SSE4_2 was not honoured:\n{out[-2000:]}")
    assert re.search(r"onednn_verbose.*isa:Intel SSE4\.1", out), f"ONEDNN_MAX_CPU_ISA=SSE41 was not honoured:\n{out}"


def _cpu_vendor():
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    found = re.search(r"^vendor_id\s*:\s*(\S+)", text, re.M)
    return found.group(1) if found else None


# ---- CI -----------------------------------------------------------------------------------------

CI_STEPS = ["install_browser", "test"]  # .ci/run's steps, in order (the baseline pass is inside `make test`)


def _ci_run(tmp_path, script, results):
    """``script`` (.ci/run's text) in a scratch checkout where each step has its own stub result: ``results``
    maps a step of CI_STEPS to its exit code (0 when absent). The stub install_browser.sh and `make` record
    which steps ran; returns (the finished run, the steps that ran, in order)."""
    ci = tmp_path / "checkout" / ".ci"
    ci.mkdir(parents=True)
    (ci / "run").write_text(script)
    calls = tmp_path / "steps.log"
    (ci / "install_browser.sh").write_text(f'echo install_browser >> "{calls}"\n'
                                           f'exit {results.get("install_browser", 0)}\n')
    stubs = tmp_path / "bin"
    stubs.mkdir()
    cases = "".join(f"    {step}) exit {results.get(step, 0)} ;;\n" for step in CI_STEPS[1:])
    (stubs / "make").write_text(f'#!/bin/sh\necho "$1" >> "{calls}"\ncase "$1" in\n{cases}    *) exit 99 ;;\nesac\n')
    (stubs / "make").chmod(0o755)
    env = dict(os.environ, PATH=f"{stubs}{os.pathsep}{os.environ['PATH']}")
    run = subprocess.run(["bash", str(ci / "run")], env=env, capture_output=True, text=True, timeout=60)
    return run, calls.read_text().splitlines() if calls.exists() else []


# every step passes; then each step alone fails, with pytest's usual codes (1 failed, 2 interrupted, 5 no tests)
CI_CASES = [{}] + [{step: rc} for step in CI_STEPS for rc in (1, 2, 5)]


def _ci_faults(tmp_path, script):
    """What is wrong with a .ci/run (its text) over CI_CASES: [] when it runs every step in order, stops at the
    first failing one and exits with that step's code, and passes only when every step passed."""
    faults = []
    for i, results in enumerate(CI_CASES):
        run, ran = _ci_run(tmp_path / f"case{i}", script, results)
        failed = next(iter(results), None)
        expected_steps = CI_STEPS if failed is None else CI_STEPS[:CI_STEPS.index(failed) + 1]
        expected_rc = results.get(failed, 0)
        if ran != expected_steps or run.returncode != expected_rc:
            faults.append(f"steps {results or 'all passing'}: ran {ran} and exited {run.returncode}, expected "
                          f"{expected_steps} and exit code {expected_rc}\n{run.stdout}{run.stderr}")
    return faults


def test_ci_run_fails_exactly_when_a_step_fails(tmp_path):
    faults = _ci_faults(tmp_path, (ROOT / ".ci" / "run").read_text())
    assert not faults, ".ci/run: " + "\n".join(faults)


@pytest.mark.parametrize("mutant", [
    ('step "make test" make test', "make test || true"),
    ('step "install chromium" bash .ci/install_browser.sh', "bash .ci/install_browser.sh || true"),
    ('        exit "$rc"', "        :"),
    ('step "make test" make test\n', ""),
], ids=["ignores-test", "ignores-browser-install", "step-never-exits", "skips-make-test"])
def test_the_ci_check_catches_a_run_that_ignores_a_step(tmp_path, mutant):
    """The check above is not vacuous: a .ci/run that ignores (or skips) one step fails it."""
    script = (ROOT / ".ci" / "run").read_text()
    old, new = mutant
    assert script.count(old) == 1, f"mutation {old!r} does not apply to .ci/run any more"
    assert _ci_faults(tmp_path, script.replace(old, new)), f".ci/run with {old!r} -> {new!r} passed the check"


def test_ci_installs_only_debians_chromium():
    script = (ROOT / ".ci" / "install_browser.sh").read_text()
    assert re.search(r"apt-get install -y -q chromium\s*$", script, re.M), "install Debian's chromium package"
    for path in [ROOT / ".ci" / "run", ROOT / ".ci" / "install_browser.sh", ROOT / "Makefile"]:
        text = path.read_text()
        assert not re.search(r"playwright\s+install|curl |wget ", text), (
            f"{path.name} downloads a browser or other files; CI uses Debian's chromium only")


# ---- what the tests leave behind ----------------------------------------------------------------

def test_a_tests_torchrun_keeps_its_logs_in_the_runs_own_temporary_folder(tmp_path):
    """torchrun's agent makes a torchelastic_* log folder in TMPDIR and never removes it: conftest's torchrun_env
    points TMPDIR into this run's pytest folder (pytest prunes old runs), never the machine's shared one. (Only the
    folder's place is checked: other processes on the machine may make torchelastic_* folders meanwhile.)"""
    import tempfile

    from conftest import finish, start_torchrun, torchrun_env

    env = torchrun_env()
    own, shared = Path(env["TMPDIR"]), Path(tempfile.gettempdir()).resolve()
    assert own.is_dir() and own.resolve() != shared and not list(own.iterdir()), (
        f"torchrun_env's TMPDIR should be a fresh folder of its own, not {shared}: {own}")
    script = tmp_path / "one.py"
    script.write_text("print('ran')\n")
    out = finish(start_torchrun("--standalone", "--nproc-per-node=1", script=script, env=env), "torchrun")
    assert "ran" in out, out
    assert [p.name[:13] for p in own.iterdir()] == ["torchelastic_"], (
        f"torchrun's log folder should be the one thing in its TMPDIR: {list(own.iterdir())}")


# ---- the README's map and the package -----------------------------------------------------------

STATED = re.compile(r"\*\*(?:Estimated time|Time):?\*\*:? about (\d+)(?:-(\d+))? minutes")  # test_lesson_lengths' own


def test_the_readmes_total_time_is_the_lessons_own():
    """The README's "about N hours" and lesson count, from each lesson's first cell (a range counts by its middle):
    the figures tests/test_lesson_lengths.py holds each lesson to."""
    import nbformat

    minutes = 0.0
    for path in LESSONS:
        found = STATED.search(nbformat.read(path, as_version=4).cells[0].source)
        assert found, f"{path.name}: its first cell should state '**Estimated time**: about N minutes'"
        low = int(found.group(1))
        minutes += (low + int(found.group(2) or low)) / 2
    readme = (ROOT / "README.md").read_text()
    said = re.search(r"\*\*Time:\*\* about (\d+) hours: (\d+) lessons", readme)
    assert said, "README: '**Time:** about N hours: M lessons ...' near the top"
    assert (int(said.group(1)), int(said.group(2))) == (round(minutes / 60), len(LESSONS)), (
        f"README says about {said.group(1)} hours over {said.group(2)} lessons; the lessons state {minutes:.0f} "
        f"minutes over {len(LESSONS)}: about {round(minutes / 60)} hours")


def test_every_lesson_of_the_readme_map_exists():
    readme = (ROOT / "README.md").read_text()
    linked = re.findall(r"\(notebooks/(\d\d_[a-z0-9_]+\.ipynb)\)", readme)
    assert len(linked) >= 12, f"the lesson map should link all 12 lessons, found {linked}"
    for name in linked:
        assert (NOTEBOOKS / name).exists(), f"README links a missing lesson: {name}"
    on_disk = sorted(p.name for p in LESSONS)
    assert on_disk == sorted(set(linked)), f"lessons not in the README map: {set(on_disk) - set(linked)}"


def test_package_imports_without_torch_side_effects():
    code = ("import sys, course_utils; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", "importing course_utils must stay cheap: it should not import torch"


def test_contributing_states_the_rule_for_stored_outputs():
    text = (ROOT / "CONTRIBUTING.md").read_text()
    for promise in ["any CPU", "1 to 16 cores", "both backends", "tests/sanitize.cfg", "make test-baseline-cpu"]:
        assert promise in text, f"CONTRIBUTING.md should state the rule for stored outputs: {promise!r} missing"
    assert "CONTRIBUTING.md" in (ROOT / "README.md").read_text(), "the README should link CONTRIBUTING.md"


def test_every_sanitize_rule_gives_its_reason():
    import configparser

    from nbval.plugin import get_sanitize_patterns
    text = (ROOT / "tests" / "sanitize.cfg").read_text()
    parser = configparser.ConfigParser(interpolation=None)
    parser.read_string(text)
    assert parser.sections(), "tests/sanitize.cfg has no rule"
    # nbval reads the file with its own regex (a 'regex:' line directly followed by a 'replace:' line),
    # not configparser: a rule it cannot read is silently dropped.
    read_by_nbval = get_sanitize_patterns(text)
    assert [r for r, _ in read_by_nbval] == [parser[s]["regex"] for s in parser.sections()], (
        "nbval does not read every [section] of tests/sanitize.cfg: write 'regex: ...' and 'replace: ...' on two "
        f"consecutive lines, one space after the colon. nbval reads: {read_by_nbval}")
    lines = text.splitlines()
    for section in parser.sections():
        assert set(parser[section]) == {"regex", "replace"}, f"[{section}] needs exactly regex and replace"
        re.compile(parser[section]["regex"])
        at = lines.index(f"[{section}]")
        comment = []
        for line in reversed(lines[:at]):
            if not line.startswith("#"):
                break
            comment.append(line)
        assert len(" ".join(comment)) > 40, (
            f"[{section}] in tests/sanitize.cfg needs a comment right above it saying why it honestly varies "
            "(see CONTRIBUTING.md)")
