"""scripts/learner_copy.py, run by `make lab` first: my-notebooks/, outputs cleared, never overwritten."""
import json
import shutil
import subprocess
import sys

import nbformat
import pytest

from conftest import LESSONS, NOTEBOOKS, ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import learner_copy  # noqa: E402

def _outputs(nb):
    return [c for c in nb.cells if c.cell_type == "code" and (c.outputs or c.execution_count is not None)]


def test_the_copy_has_every_lesson_with_outputs_cleared_and_sources_kept(tmp_path):
    added, kept = learner_copy.sync(NOTEBOOKS, tmp_path / "my-notebooks")
    assert added == [p.name for p in LESSONS] and kept == [], (added, kept)
    stored_any = False
    for lesson in LESSONS:
        original = nbformat.read(lesson, as_version=4)
        copy = nbformat.read(tmp_path / "my-notebooks" / lesson.name, as_version=4)
        stored_any = stored_any or bool(_outputs(original))
        assert not _outputs(copy), f"{lesson.name}: the learner's copy still shows stored outputs"
        assert "widgets" not in copy.metadata, f"{lesson.name}: the copy keeps stored widget state"
        assert [c.source for c in copy.cells] == [c.source for c in original.cells], f"{lesson.name}: sources differ"
        assert [c.metadata.get("tags") for c in copy.cells] == [c.metadata.get("tags") for c in original.cells]
        nbformat.validate(copy)
    assert stored_any, "notebooks/ stores no output at all: this test would not see a copy that keeps them"


def test_an_existing_copy_is_kept_and_a_new_lesson_is_added(tmp_path):
    src, dest = tmp_path / "notebooks", tmp_path / "my-notebooks"
    src.mkdir()
    for lesson in LESSONS[:2]:
        shutil.copy(lesson, src / lesson.name)
    learner_copy.sync(src, dest)
    edited = dest / LESSONS[0].name
    nb = nbformat.read(edited, as_version=4)
    nb.cells[0].source = "my notes"
    nbformat.write(nb, edited)
    before = edited.read_bytes()
    # lessons 16 and 17 appear in notebooks/ later: the next `make lab` copies them and keeps the rest
    for new in ("15_later_lesson.ipynb", "16_another_one.ipynb"):
        shutil.copy(LESSONS[1], src / new)
    added, kept = learner_copy.sync(src, dest)
    assert added == ["15_later_lesson.ipynb", "16_another_one.ipynb"], added
    assert kept == [LESSONS[0].name, LESSONS[1].name], kept
    assert edited.read_bytes() == before, "the learner's edited lesson was overwritten"
    assert not _outputs(nbformat.read(dest / "15_later_lesson.ipynb", as_version=4))
    assert sorted(p.name for p in dest.iterdir()) == sorted(p.name for p in src.iterdir()), "no partial files left"
    # a fresh copy of one lesson: delete it and run again
    edited.unlink()
    added, _ = learner_copy.sync(src, dest)
    assert added == [LESSONS[0].name] and nbformat.read(edited, as_version=4).cells[0].source != "my notes"


def test_links_between_lessons_resolve_in_the_copy(tmp_path):
    """The copy sits beside notebooks/: every relative link of a lesson (next lesson, ../README.md) still resolves."""
    import re
    dest = ROOT / "my-notebooks"  # where `make lab` puts it: a sibling of notebooks/
    assert dest.parent == (NOTEBOOKS).parent
    broken = []
    for lesson in LESSONS:
        for cell in nbformat.read(lesson, as_version=4).cells:
            if cell.cell_type != "markdown":
                continue
            for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", cell.source):
                if re.match(r"[a-z]+:", target):
                    continue  # a web address
                if target.endswith(".ipynb"):  # another lesson: the copy holds every lesson of notebooks/
                    ok = (NOTEBOOKS / target).resolve().parent == NOTEBOOKS and (
                        NOTEBOOKS / target).exists()
                else:  # anything else (../README.md) as seen from my-notebooks/
                    ok = (dest / target).resolve().exists()
                if not ok:
                    broken.append((lesson.name, target))
    assert not broken, f"links that would not resolve from my-notebooks/: {broken}"


def test_the_script_says_what_it_did_and_refuses_an_empty_source(tmp_path):
    dest = tmp_path / "copy"
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "learner_copy.py"), "--dest", str(dest)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and f"added {len(LESSONS)} lesson(s)" in run.stdout, run.stdout + run.stderr
    again = subprocess.run([sys.executable, str(ROOT / "scripts" / "learner_copy.py"), "--dest", str(dest)],
                           capture_output=True, text=True, timeout=120)
    assert "added" not in again.stdout and f"kept your {len(LESSONS)}" in again.stdout, again.stdout
    assert "delete it there and run `make lab` again" in again.stdout
    with pytest.raises(SystemExit, match="holds no lesson"):
        learner_copy.sync(tmp_path / "empty", dest)
    assert json.loads((dest / LESSONS[0].name).read_text())["cells"], "the copy is a notebook"


def _probe_lesson():
    """A lesson with a prediction: the Predict cell, its run, a markdown and a code reveal cell, and a plain cell."""
    import nbformat.v4 as v4

    cells = [v4.new_markdown_cell("# 99 · Probe\n**Predict**: what does every rank hold?"),
             v4.new_code_cell("x = 1", outputs=[v4.new_output("stream", text="1\n")], execution_count=1),
             v4.new_markdown_cell("Every rank holds 4.", metadata={"tags": ["reveal"], "answer": ["4"]}),
             v4.new_code_cell("assert x == 1", outputs=[v4.new_output("stream", text="ok\n")], execution_count=2,
                              metadata={"tags": ["reveal", "raises-exception"]}),
             v4.new_code_cell("y = 2", metadata={"tags": ["other"]})]
    return v4.new_notebook(cells=cells)


def test_reveal_cells_arrive_collapsed_and_nothing_else_does(tmp_path):
    src = tmp_path / "notebooks"
    src.mkdir()
    nbformat.write(_probe_lesson(), src / "99_probe.ipynb")
    learner_copy.sync(src, tmp_path / "copy")
    copy = nbformat.read(tmp_path / "copy" / "99_probe.ipynb", as_version=4)
    hidden = [(i, c.metadata.get("jupyter", {})) for i, c in enumerate(copy.cells)]
    assert hidden == [(0, {}), (1, {}), (2, {"source_hidden": True}),
                      (3, {"source_hidden": True, "outputs_hidden": True}), (4, {})], hidden
    assert not _outputs(copy), "the copy of a reveal cell keeps its stored output"
    assert copy.cells[2].metadata["answer"] == ["4"], "the copy keeps the answer's key"
    assert copy.cells[3].metadata["tags"] == ["reveal", "raises-exception"], "the copy keeps the tags"
    nbformat.validate(copy)


def test_every_reveal_cell_of_every_lesson_is_collapsed_in_the_copy():
    """The lessons' own reveal cells, through the function `make lab`'s copy goes through (tests/test_predictions.py
    checks where they sit; tests/test_solutions_hidden.py that no solution shows)."""
    left_open = []
    for lesson in LESSONS:
        copy = learner_copy.learner_version(nbformat.read(lesson, as_version=4))
        for i, cell in enumerate(copy.cells):
            if "reveal" in cell.metadata.get("tags", []):
                jupyter = cell.metadata.get("jupyter", {})
                if not jupyter.get("source_hidden") or (cell.cell_type == "code" and not jupyter.get("outputs_hidden")):
                    left_open.append(f"{lesson.name} cell {i}")
    assert not left_open, f"reveal cells the learner's copy shows open: {left_open}"
