"""Project set-up: one list of dependencies, and the commands the README promises."""
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


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
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
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
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    torch = [d for d in deps if re.match(r"torch\b", d)]
    assert torch == ["torch==2.13.0"], f"torch must be pinned (an unpinned torch pulls a CUDA build): {torch}"


def test_readme_commands_are_what_ci_runs():
    readme = (ROOT / "README.md").read_text()
    assert "make lab" in readme and "make test" in readme
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^make test$", ci, re.M), ".ci/run must run exactly the README's test command"
    assert "5" in ci and "no tests" in ci, ".ci/run must treat pytest's exit code 5 as a failure"


def test_every_lesson_of_the_readme_map_exists():
    readme = (ROOT / "README.md").read_text()
    linked = re.findall(r"\(notebooks/(\d\d_[a-z0-9_]+\.ipynb)\)", readme)
    assert len(linked) >= 12, f"the lesson map should link all 12 lessons, found {linked}"
    for name in linked:
        assert (ROOT / "notebooks" / name).exists(), f"README links a missing lesson: {name}"
    on_disk = sorted(p.name for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    assert on_disk == sorted(set(linked)), f"lessons not in the README map: {set(on_disk) - set(linked)}"


def test_package_imports_without_torch_side_effects():
    code = ("import sys, course_utils; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", "importing course_utils must stay cheap: it should not import torch"
