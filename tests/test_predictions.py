"""A prediction is answered after its run, never above it (CONTRIBUTING.md, "The learner does the work").

    .venv/bin/python -m pytest -n 0 tests/test_predictions.py

A prediction is a markdown cell with a bold **Predict** (``**Predict**``, or any bold that starts with it:
``**Predict, then run.**``). Its NEXT cell is the code cell that runs it (the run); the cell right after the run
is tagged ``reveal``, and so may the ones after it: they hold the answer and its proof. The first reveal cell
carries ``metadata["answer"]``, a list of short strings that state the answer. The test fails when:
- the run is not the next cell, no reveal cell follows it, or the first has no ``answer``;
- the run asserts (``assert``, ``assert_close``, a ``check_*`` call): the proof belongs to a reveal cell;
- an ``answer`` string appears (case-insensitive, ``*`` and backticks ignored, ``_`` read as a space, whitespace
  collapsed) in the lesson's
  objective list ("What you will learn" in the first cell), in a markdown cell from the prediction's section heading
  (the nearest ``#``/``##``/``###`` above) down to the Predict cell, or in the run's source;
- a reveal cell sits anywhere but in the run of reveal cells right after a prediction's run, or holds a heading
  (the site folds it in a box, where a heading cannot open a section).
An item of a numbered list that starts with the bold ("2. **Predict, then count.** ...") is an exercise: the
learner types the number into a scaffold that a ``check_*`` judges (the exercise pattern), not a prediction.

The lessons not yet converted (NOT_CONVERTED) are strict xfails, so the test fails once a lesson complies, and
whoever converted it removes the mark.
"""
import ast
import re

import nbformat
import nbformat.v4 as v4
import pytest

from conftest import LESSONS

PREDICT = re.compile(r"\*\*Predict\b")
EXERCISE_ITEM = re.compile(r"^\s*\d+\.\s+(?:\*\*Going further\.?\*\*\s*)?\*\*Predict\b", re.M)
HEADING = re.compile(r"^ {0,3}(#{1,3}) \S", re.M)
ANY_HEADING = re.compile(r"^ {0,3}#{1,6} \S", re.M)
GIVES_AWAY = re.compile(r"\bassert\b|assert_close|\bcheck_\w*\s*\(")
OBJECTIVES = re.compile(r"What you will learn(.*?)(?=^\*\*[A-Z]|^#|\Z)", re.S | re.M)
REVEAL = "reveal"
NOT_CONVERTED = set()


def _normal(text):
    """Lower case, ``*`` and backticks dropped, ``_`` read as a space (``every_rank_sums`` gives away "rank sums"),
    whitespace collapsed: the form in which an answer key is looked for."""
    return " ".join(re.sub(r"[*`]", "", text).replace("_", " ").lower().split())


def _tags(cell):
    return cell.metadata.get("tags", [])


def is_prediction(cell):
    """A markdown cell that asks a prediction: a bold **Predict... outside a numbered exercise item."""
    return cell.cell_type == "markdown" and bool(PREDICT.search(EXERCISE_ITEM.sub("", cell.source)))


def objectives(nb):
    """The lesson's objective list: the "What you will learn" block of its first cell."""
    found = OBJECTIVES.search(nb.cells[0].source) if nb.cells else None
    return found.group(1) if found else ""


def section_start(nb, i):
    """Index of the cell holding the nearest #/##/### heading at or above cell ``i`` (0 when none)."""
    for j in range(i, -1, -1):
        if nb.cells[j].cell_type == "markdown" and HEADING.search(nb.cells[j].source):
            return j
    return 0


def section_text(nb, start, i):
    """The markdown from the heading (its last heading line in cell ``start``) down to the Predict cell ``i``."""
    parts = []
    for j in range(start, i + 1):
        cell = nb.cells[j]
        if cell.cell_type != "markdown":
            continue
        text = cell.source
        if j == start:  # from the cell's last heading above the Predict on (a cell may end a section, open the next)
            end = PREDICT.search(text).start() if j == i else len(text)
            headings = [h for h in HEADING.finditer(text) if h.start() < end]
            text = text[headings[-1].start():] if headings else text
        parts.append(text)
    return "\n".join(parts)


def gives_away(source):
    """The lines of a run's ``source`` that assert: an ``assert`` statement, an ``assert_close`` or ``check_*`` call
    (read from the code, so a string that names a check is not one); by the words in a line magic (``%time``), or
    when the cell is not Python."""
    from IPython.core.inputtransformer2 import TransformerManager

    body = source.split("\n", 1)[1] if source.startswith("%%") and "\n" in source else source
    offset = len(source.splitlines()) - len(body.splitlines())
    try:
        tree = ast.parse(TransformerManager().transform_cell(body))
    except SyntaxError:
        return [line.strip() for line in source.splitlines() if GIVES_AWAY.search(line)]
    rows = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name == "assert_close" or name.startswith("check_"):
                rows.add(node.lineno)
        elif isinstance(node, ast.Assert):
            rows.add(node.lineno)
    lines = source.splitlines()
    magics = {n for n, line in enumerate(lines[offset:], 1)
              if line.lstrip().startswith("%") and GIVES_AWAY.search(line)}
    return [lines[offset + n - 1].strip() for n in sorted(rows | magics)]


def violations(nb, name):
    """Every breach of the rule in notebook ``nb`` (named ``name`` in the messages), as sentences."""
    found = []
    cells = nb.cells
    goals = _normal(objectives(nb))
    answered = set()  # indices of reveal cells that follow a prediction's run
    for i, cell in enumerate(cells):
        if not is_prediction(cell):
            continue
        where = f"{name} cell {i} (**Predict**)"
        if REVEAL in _tags(cell):
            found.append(f"{where}: the Predict cell is tagged reveal; only the cells after its run are")
        if i + 1 >= len(cells) or cells[i + 1].cell_type != "code":
            found.append(f"{where}: the next cell must be the code cell that runs the prediction; nothing between")
            continue
        run = cells[i + 1]
        if REVEAL in _tags(run):
            found.append(f"{where}: its run (cell {i + 1}) is tagged reveal; the answer goes in the cells after it")
        for line in gives_away(run.source):
            found.append(f"{where}: its run (cell {i + 1}) asserts before the learner sees the output: "
                         f"{line!r}; move the proof into a reveal cell after the run")
        j = i + 2
        while j < len(cells) and REVEAL in _tags(cells[j]) and not is_prediction(cells[j]):
            answered.add(j)
            j += 1
        if j == i + 2:
            found.append(f"{where}: no cell tagged reveal right after its run (cell {i + 1}): the answer and its "
                         "proof go there")
            continue
        first = cells[i + 2]
        answer = first.metadata.get("answer")
        if not (isinstance(answer, list) and answer and all(isinstance(a, str) and a.strip() for a in answer)):
            found.append(f"{where}: its first reveal cell (cell {i + 2}) needs metadata['answer'], a non-empty list "
                         f"of strings that state the answer; it has {answer!r}")
            continue
        start = section_start(nb, i)
        places = [("the objective list ('What you will learn', cell 0)", goals),
                  (f"the markdown from the section heading (cell {start}) down to the Predict",
                   _normal(section_text(nb, start, i))),
                  (f"the run's source (cell {i + 1})", _normal(run.source))]
        for key in answer:
            for place, text in places:
                if _normal(key) in text:
                    found.append(f"{where}: the answer {key!r} is given away in {place}")
    for j, cell in enumerate(cells):
        if REVEAL not in _tags(cell):
            continue
        if j not in answered:
            found.append(f"{name} cell {j}: tagged reveal but not among the cells right after a prediction's run "
                         "(a reveal cell answers the **Predict** above its run, never comes before it)")
        if cell.cell_type == "markdown" and ANY_HEADING.search(cell.source):
            found.append(f"{name} cell {j}: a reveal cell holds a heading; start the section in a cell of its own")
    return found


def _mark(path):
    number = path.name[:2]
    if number in NOT_CONVERTED:
        return pytest.param(path, id=number, marks=pytest.mark.xfail(strict=True, reason="not yet converted"))
    return pytest.param(path, id=number)


@pytest.mark.parametrize("path", [_mark(p) for p in LESSONS])
def test_each_prediction_is_answered_after_its_run(path):
    nb = nbformat.read(path, as_version=4)
    found = violations(nb, path.name)
    assert not found, f"{len(found)} breaches of predict -> run -> reveal:\n" + "\n".join(found)


# ---- the detector, on small notebooks: each way of giving the answer away, and a clean one ----------------------

def _lesson(*cells, objectives_text="- How all_reduce combines tensors."):
    title = v4.new_markdown_cell(f"# 99 · Probe\n\n**What you will learn**\n\n{objectives_text}\n\n"
                                 "**Prerequisites**: none.")
    return v4.new_notebook(cells=[title, *cells])


def _reveal(source, answer=None, code=False):
    metadata = {"tags": [REVEAL]}
    if answer is not None:
        metadata["answer"] = answer
    return (v4.new_code_cell if code else v4.new_markdown_cell)(source, metadata=metadata)


HEADING_CELL = "## 2. Summing across ranks"
PREDICT_CELL = "**Predict**: each rank holds `rank + 1`. What does every rank hold after the all-reduce?"
RUN = "x = torch.tensor([rank + 1.0])\ndist.all_reduce(x)\nprint(x)"
ANSWER = ["10.0", "the sum"]


def clean(**changes):
    parts = dict(heading=HEADING_CELL, predict=PREDICT_CELL, run=RUN,
                 reveals=[_reveal("Every rank holds 10.0: the sum of 1 to 4.", ANSWER),
                          _reveal("assert x.item() == 10.0", code=True)])
    parts.update(changes)
    return _lesson(v4.new_markdown_cell(parts["heading"]), v4.new_markdown_cell(parts["predict"]),
                   v4.new_code_cell(parts["run"]), *parts["reveals"],
                   objectives_text=changes.get("objectives_text", "- How all_reduce combines tensors."))


def test_a_clean_prediction_passes():
    assert violations(clean(), "99") == []


@pytest.mark.parametrize("case, nb, leaked, place", [
    ("heading", clean(heading="## 2. The all-reduce gives the sum"), "the sum", "section heading"),
    ("objective bullet", clean(objectives_text="- Why every rank ends with the sum."), "the sum", "objective list"),
    ("comment", clean(run=RUN + "  # 10.0 on every rank"), "10.0", "run's source"),
    ("print", clean(run=RUN + '\nprint("every rank holds the sum")'), "the sum", "run's source"),
    ("variable name", clean(run=RUN + "\nthe_sum = x"), "the sum", "run's source"),
    ("assert message", clean(run=RUN + '\nassert x.item() > 0, "10.0 on every rank"'), "10.0", "run's source"),
    ("text above the Predict", clean(predict="It will be the sum.\n\n" + PREDICT_CELL), "the sum", "section heading"),
])
def test_each_way_of_giving_the_answer_away_is_named(case, nb, leaked, place):
    found = violations(nb, "99_probe.ipynb")
    assert any(f"{leaked!r}" in f and place in f and "99_probe.ipynb cell 2" in f for f in found), (case, found)


def test_an_assert_in_the_run_fails_even_without_a_leak():
    for run in (RUN + "\nassert x.item() > 0, 'positive'", RUN + "\ntorch.testing.assert_close(x, x)",
                RUN + "\ncheck_sum(x)", "%%ddp\n" + RUN + "\nchecks.check_sum(\n    x)", RUN + "\n%time assert x"):
        found = violations(clean(run=run), "99")
        assert any("asserts before the learner sees the output" in f for f in found), (run, found)
    # a string that names a check is not a check
    assert violations(clean(run=RUN + '\nprint("check_sum(x) passed")'), "99") == []


def test_the_structure_is_held():
    # something between the Predict and its run
    nb = clean()
    nb.cells.insert(3, v4.new_markdown_cell("Think first."))
    assert any("the next cell must be the code cell" in f for f in violations(nb, "99"))
    # no reveal after the run
    assert any("no cell tagged reveal right after its run" in f for f in violations(clean(reveals=[]), "99"))
    # the first reveal cell has no answer, or an empty one
    for answer in (None, [], [""], "10.0"):
        found = violations(clean(reveals=[_reveal("10.0", answer)]), "99")
        assert any("needs metadata['answer']" in f for f in found), (answer, found)
    # a reveal cell before the Predict, or after an ordinary cell
    nb = clean()
    nb.cells.insert(1, _reveal("early", ["x"]))
    assert any("cell 1: tagged reveal but not among" in f for f in violations(nb, "99"))
    nb = clean()
    nb.cells.append(v4.new_markdown_cell("More text."))
    nb.cells.append(_reveal("late"))
    assert any("tagged reveal but not among" in f for f in violations(nb, "99"))
    # a heading inside a reveal cell
    found = violations(clean(reveals=[_reveal("### The answer\n10.0", ANSWER)]), "99")
    assert any("holds a heading" in f for f in found), found


def test_an_exercise_item_is_not_a_prediction():
    item = v4.new_markdown_cell("## Exercises\n\n2. **Predict, then count.** How many bytes does rank 1 send?")
    check = v4.new_code_cell("prediction = None\ncheck_sent_bytes_prediction(prediction)")
    assert violations(_lesson(item, check), "99") == []
    assert is_prediction(v4.new_markdown_cell("**Predict, then run.** How many?"))


def test_the_rule_fails_on_the_lessons_before_issue_54():
    """The lessons as they stood before the convention (00's first prediction, as stored then): answered by the
    run's own assert and no reveal cell; the detector says so."""
    nb = _lesson(v4.new_markdown_cell("## 3. Run it\n**Predict first:** on 4 ranks, what does each rank print?"),
                 v4.new_code_cell("%%ddp\nx = torch.ones(1) * rank\ndist.all_reduce(x)\n"
                                  "assert x.item() == 6, 'every rank holds 0 + 1 + 2 + 3 = 6'\nprint(x)"))
    found = violations(nb, "00")
    assert any("asserts before" in f for f in found) and any("no cell tagged reveal" in f for f in found), found
