"""Notebook hygiene: what is committed is what nbval can check, and every lesson is wired into the course.

    .venv/bin/python -m pytest tests/test_hygiene.py -p no:randomly

The stored outputs are the reference nbval compares against, so they must come from a clean,
in-order run (scripts/execute_notebooks.py) and hold nothing nbval cannot compare.
"""
import json
import re
import subprocess
import sys

import pytest

from conftest import LESSONS, ROOT, in_ci

LESSON_MAP = "../README.md#lesson-map"
# (notebook, cell id) pairs allowed an NBVAL_IGNORE_OUTPUT / nbval-ignore-output marker: only a cell whose
# sole output is a timing table the sanitizer (tests/sanitize.cfg) cannot tame. Keep it empty if at all possible.
IGNORE_OUTPUT_ALLOWED = set()
NBVAL_MARKERS = re.compile(r"#\s*NBVAL_(IGNORE_OUTPUT|SKIP)\b")
NBVAL_TAGS = {"nbval-ignore-output", "nbval-skip"}
# Everything the course ships, checked against pyproject's ruff settings (target py310: the README promises 3.10+).
RUFF_PATHS = ["course_utils", "tests", "notebooks", "scripts", "benchmarks"]
# --no-cache: ruff would otherwise leave .ruff_cache/ at the repository root (no test writes into the repository)
RUFF = [sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format=concise"]


def _load(path):
    return json.loads(path.read_text(encoding="utf-8"))


def _source(cell):
    return "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]


def _links(markdown):
    """Relative link targets of a markdown text: [text](target)."""
    return re.findall(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", markdown)


def _code(nb):
    return [(i, c) for i, c in enumerate(nb["cells"]) if c["cell_type"] == "code"]


def _id(path):
    return path.name


def test_lessons_exist_numbered_from_00_without_gaps():
    assert LESSONS, "no notebooks/[0-9][0-9]_*.ipynb found: the hygiene tests below would pass vacuously"
    numbers = [int(p.name[:2]) for p in LESSONS]
    assert numbers == list(range(len(LESSONS))), (
        f"lesson numbers must run 00, 01, ... without gaps or duplicates; found {[p.name for p in LESSONS]}")


@pytest.mark.parametrize("path", LESSONS, ids=_id)
def test_executed_in_order_from_a_fresh_kernel(path):
    nb = _load(path)
    counts = [(i, c.get("execution_count")) for i, c in _code(nb) if _source(c).strip()]
    assert counts, f"{path.name} has no code cell"
    missing = [i for i, n in counts if n is None]
    assert not missing, (f"{path.name}: code cells {missing} are not executed. Store outputs with "
                         f".venv/bin/python scripts/execute_notebooks.py notebooks/{path.name}")
    assert [n for _, n in counts] == list(range(1, len(counts) + 1)), (
        f"{path.name}: execution counts {[n for _, n in counts]} are not 1..{len(counts)} in order: the outputs "
        f"come from a partial or out-of-order run. Re-run scripts/execute_notebooks.py notebooks/{path.name}")
    empty = [i for i, c in _code(nb) if not _source(c).strip() and (c.get("execution_count") or c.get("outputs"))]
    assert not empty, f"{path.name}: empty code cells {empty} carry a count or outputs from another run"


sys.path.insert(0, str(ROOT / "scripts"))
from execute_notebooks import drop_blanked_status_lines, kernelspec  # noqa: E402  (scripts/ is not a package)

KERNELSPEC = kernelspec()


@pytest.mark.parametrize("path", LESSONS, ids=_id)
def test_outputs_are_checkable_by_nbval(path):
    nb = _load(path)
    assert "widgets" not in nb.get("metadata", {}), (
        f"{path.name} stores widget state (metadata.widgets), which nbval cannot check; "
        "scripts/execute_notebooks.py and the nbstripout pre-commit hook drop it")
    assert nb.get("metadata", {}).get("kernelspec", {}).get("name") == "python3", (
        f"{path.name}: kernelspec must be python3 (the venv's kernel), not {nb.get('metadata', {}).get('kernelspec')}")
    # JupyterLab rewrites a kernelspec that differs from the kernel's own, so an untouched lesson opened as
    # "unsaved" and asked to be saved on closing ("Python 3" against ipykernel's "Python 3 (ipykernel)").
    assert nb["metadata"]["kernelspec"] == KERNELSPEC, (
        f"{path.name}: stored kernelspec {nb['metadata']['kernelspec']}, the venv's kernel writes {KERNELSPEC}: "
        "re-execute with scripts/execute_notebooks.py, which stores the kernel's own")
    for i, cell in _code(nb):
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            if out["output_type"] in ("display_data", "execute_result") and "text/plain" not in data:
                # nbval compares text/plain (and skips images): an output without it is never checked.
                assert data and all(mime.startswith("image/") for mime in data), (
                    f"{path.name}: cell {i} has an output nbval cannot check (no text/plain): {sorted(data)}")
            assert "application/vnd.jupyter.widget-state+json" not in data, (
                f"{path.name}: cell {i} stores widget state")
            # a checker's live status line, blanked when its call ended: nbval's run never shows one
            assert data != {"text/plain": ""}, (
                f"{path.name}: cell {i} stores a blanked status line; scripts/execute_notebooks.py drops them")


def test_re_execution_drops_blanked_status_lines_and_keeps_everything_else():
    import nbformat

    kept = [nbformat.v4.new_output("stream", name="stdout", text="[rank 0] 4\n"),
            nbformat.v4.new_output("display_data", data={"text/plain": "<Figure>", "image/png": "iVBOR"})]
    cell = nbformat.v4.new_code_cell("check(answer)")
    cell.outputs = [kept[0], nbformat.v4.new_output("display_data", data={"text/plain": ""}), kept[1]]
    nb = nbformat.v4.new_notebook(cells=[cell, nbformat.v4.new_markdown_cell("text")])
    drop_blanked_status_lines(nb)
    assert nb.cells[0].outputs == kept, nb.cells[0].outputs


@pytest.mark.parametrize("path", LESSONS, ids=_id)
def test_no_cell_escapes_nbval(path):
    nb = _load(path)
    escaped = []
    for i, cell in _code(nb):
        tags = set(cell.get("metadata", {}).get("tags", []))
        marker = NBVAL_MARKERS.search(_source(cell))
        if (marker or tags & NBVAL_TAGS) and (path.name, cell.get("id")) not in IGNORE_OUTPUT_ALLOWED:
            escaped.append((i, cell.get("id"), marker.group(0) if marker else sorted(tags & NBVAL_TAGS)))
    assert not escaped, (
        f"{path.name}: cells (index, id, marker) {escaped} skip or ignore nbval's comparison. Print timings with "
        "their unit so tests/sanitize.cfg masks them, or add the cell to IGNORE_OUTPUT_ALLOWED with a reason")


@pytest.mark.parametrize("path", LESSONS, ids=_id)
def test_errors_only_in_cells_tagged_raises_exception(path):
    nb = _load(path)
    for i, cell in _code(nb):
        tagged = "raises-exception" in cell.get("metadata", {}).get("tags", [])
        errors = [f"{o['ename']}: {o['evalue']}" for o in cell.get("outputs", []) if o["output_type"] == "error"]
        assert tagged or not errors, (
            f"{path.name}: cell {i} stores an error but is not tagged raises-exception: {errors}")
        assert errors or not tagged, f"{path.name}: cell {i} is tagged raises-exception but stores no error"


@pytest.mark.parametrize("path", LESSONS, ids=_id)
def test_opens_with_title_and_setup_cell(path):
    nb = _load(path)
    first = nb["cells"][0]
    assert first["cell_type"] == "markdown" and _source(first).lstrip().startswith("# "), (
        f"{path.name}: the first cell must be markdown starting with a '# Title' line")
    title = _source(first).lstrip().splitlines()[0]
    assert title.startswith(f"# {path.name[:2]} · "), (
        f"{path.name}: its title {title!r} must start with its own number, '# {path.name[:2]} · '")
    code = _code(nb)
    assert code, f"{path.name} has no code cell"
    setup = _source(code[0][1])
    assert re.search(r"^%load_ext course_utils\s*$", setup, re.M), (
        f"{path.name}: the first code cell (the setup cell) must contain '%load_ext course_utils'")


@pytest.mark.parametrize("path", LESSONS, ids=_id)
def test_links_to_previous_next_and_lesson_map(path):
    nb = _load(path)
    k = LESSONS.index(path)
    wanted = {LESSON_MAP: "the README's lesson map"}
    if k > 0:
        wanted[LESSONS[k - 1].name] = "the previous lesson"
    if k + 1 < len(LESSONS):
        wanted[LESSONS[k + 1].name] = "the next lesson"
    code = [i for i, _ in _code(nb)]
    first, last = (code[0], code[-1]) if code else (len(nb["cells"]), -1)
    places = {"top (before the setup cell)": nb["cells"][:first],
              "bottom (after the last code cell)": nb["cells"][last + 1:]}
    for where, cells in places.items():
        links = {t.removeprefix("./") for c in cells if c["cell_type"] == "markdown" for t in _links(_source(c))}
        absent = [f"{what} ({target})" for target, what in wanted.items() if target not in links]
        for c in cells:   # a nav link's text carries the number of the lesson it links: [14 Will it fit? →](14_...)
            if c["cell_type"] == "markdown":
                for number, target in re.findall(r"\[(?:← )?(\d\d) [^\]]*\]\((\d\d)_[^)]*\.ipynb\)", _source(c)):
                    assert number == target, f"{path.name}: the nav link to {target}_... says {number}"
        assert not absent, f"{path.name}: the nav links at the {where} miss {absent}; found {sorted(links)}"
    stray = [t for c in nb["cells"] if c["cell_type"] == "markdown" for t in _links(_source(c))
             if t.endswith(".ipynb") and "://" not in t and not (path.parent / t).exists()]
    assert not stray, f"{path.name} links to notebooks that do not exist: {stray}"


def test_readme_has_the_lesson_map():
    readme = ROOT / "README.md"
    assert readme.exists(), "README.md is missing; every lesson links to its lesson map"
    text = readme.read_text(encoding="utf-8")
    assert re.search(r"^#+\s+Lesson map\s*$", text, re.M | re.I), (
        "README.md has no 'Lesson map' heading: the lessons' '../README.md#lesson-map' links land nowhere")
    unlisted = [p.name for p in LESSONS if f"notebooks/{p.name}" not in text]
    assert not unlisted, f"README.md's lesson map does not link these notebooks: {unlisted}"


def _needs_ruff():
    """Skip without ruff, except under CI, where a skip would hide that the check never ran: fail there."""
    try:
        import ruff  # noqa: F401
    except ImportError:
        message = "ruff is not installed in the venv (pip install -e '.[test]')"
        if in_ci():
            pytest.fail(message)
        pytest.skip(message)


def test_without_ruff_the_ruff_checks_skip_but_fail_under_ci(monkeypatch):
    monkeypatch.setitem(sys.modules, "ruff", None)  # `import ruff` raises ImportError
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="ruff is not installed"):
        _needs_ruff()
    monkeypatch.setenv("CI", "")
    with pytest.raises(pytest.skip.Exception, match="ruff is not installed"):
        _needs_ruff()


def test_ruff_is_clean():
    _needs_ruff()
    run = subprocess.run([*RUFF, *RUFF_PATHS], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, f"ruff check {' '.join(RUFF_PATHS)} found problems:\n{run.stdout}{run.stderr}"


def test_the_ruff_check_writes_no_cache(tmp_path):
    _needs_ruff()
    (tmp_path / "pyproject.toml").write_text("[tool.ruff]\n")
    (tmp_path / "one.py").write_text("x = 1\n")
    run = subprocess.run([*RUFF, "one.py"], cwd=tmp_path, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one.py", "pyproject.toml"], "ruff left a cache behind"
