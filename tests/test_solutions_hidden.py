"""No lesson shows the course's solution to its own exercise, and the learner's copy collapses every answer.

    .venv/bin/python -m pytest -n 0 tests/test_solutions_hidden.py

An exercise cell switches the course's solution on with ``USE_SOLUTION = True`` (CONTRIBUTING.md, "The learner does
the work"). The solutions it can switch on are what the flag selects, resolved through the lesson's imports from
``course_utils``: ``solution if USE_SOLUTION else mine``, the body of ``if USE_SOLUTION:`` (a call, a name, an
import), and for ``check(use_solution=USE_SOLUTION)`` the functions of the checker's module whose name holds
"solution"; where the scaffold subclasses the solution's class, the methods it overrides.
Each solution's source (``inspect.getsource``; its ``def``/``class`` lines and docstrings left out,
comments dropped) is cut into its non-trivial lines; the test fails when 3 of them in a row appear, in a row, in any
cell of the lesson: its source, or a stored output (a traceback's source lines, a printed listing). Any cell: the
learner's copy shows a reveal cell on a click. It also fails when scripts/learner_copy.py (what `make lab` runs)
leaves a reveal cell of the lesson open.

Every lesson is held the same way: none shows a solution its flag switches on (a lesson that did would be a strict
xfail in SHOWN_TODAY). What no flag switches on (code written out in the lesson while its text says "you write it")
this test cannot see: such a piece must become a scaffold with its solution behind USE_SOLUTION.
"""
import ast
import inspect
import re
import sys

import nbformat
import pytest

from conftest import LESSONS, ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import learner_copy  # noqa: E402

FLAG = "USE_SOLUTION"
WINDOW = 3  # consecutive non-trivial lines of a solution that make a leak
TRIVIAL = {"else:", "try:", "finally:", "pass", "continue", "break", "return", "return None", "return out"}
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
TRACEBACK_PREFIX = re.compile(r"^\s*(?:-*>\s*)?\d+\s")  # "---> 12 " / "     13 " before a traceback's source line
# lessons 06-17 that show a solution today (their issue moves it to course_utils or out of the lesson)
SHOWN_TODAY = {}


def python_of(source):
    """A cell's source as Python (a ``%%ddp`` cell's body as the ranks run it, line magics turned into calls), or
    None when it does not parse."""
    from IPython.core.inputtransformer2 import TransformerManager

    if source.startswith("%%"):
        source = source.split("\n", 1)[1] if "\n" in source else ""
    try:
        return ast.parse(TransformerManager().transform_cell(source))
    except SyntaxError:
        return None


def lesson_imports(nb):
    """{name: object} for every name a lesson binds with ``import``/``from ... import`` from course_utils."""
    import importlib

    names = {}
    for cell in nb.cells:
        tree = python_of(cell.source) if cell.cell_type == "code" else None
        for node in ast.walk(tree) if tree else ():
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("course_utils"):
                module = importlib.import_module(node.module)
                for alias in node.names:
                    try:
                        names[alias.asname or alias.name] = getattr(module, alias.name)
                    except AttributeError:
                        names[alias.asname or alias.name] = importlib.import_module(f"{node.module}.{alias.name}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("course_utils"):
                        names[alias.asname or alias.name.split(".")[0]] = importlib.import_module(
                            alias.name if alias.asname else alias.name.split(".")[0])
    return names


def _resolve(node, names):
    """The course_utils object an expression names (``f``, ``module.f``, ``f(...)``), or None."""
    if isinstance(node, ast.Call):
        return _resolve(node.func, names)
    if isinstance(node, ast.Name):
        return names.get(node.id)
    if isinstance(node, ast.Attribute):
        base = _resolve(node.value, names)
        return getattr(base, node.attr, None) if base is not None else None
    return None


def _mentions_flag(node):
    return any(isinstance(n, ast.Name) and n.id == FLAG for n in ast.walk(node))


def _named(tree, names):
    """Every course_utils object an expression or statement names (the outermost names of attribute chains)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Name, ast.Attribute)):
            obj = _resolve(node, names)
            if obj is not None:
                found.append(obj)
    return found


def switched_on(source, names):
    """Every course_utils object the flag switches on in an exercise cell's ``source`` (a value too: 07's answer)."""
    import importlib

    tree = python_of(source)
    if tree is None:
        return []
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.IfExp) and _mentions_flag(node.test):
            found += _named(node.body, names)
        elif isinstance(node, ast.If) and _mentions_flag(node.test):
            local = dict(names)
            for stmt in node.body:
                if isinstance(stmt, ast.ImportFrom) and (stmt.module or "").startswith("course_utils"):
                    module = importlib.import_module(stmt.module)
                    found += [getattr(module, a.name) for a in stmt.names if hasattr(module, a.name)]
                else:
                    found += _named(stmt, local)
        elif isinstance(node, ast.Call) and any(isinstance(k.value, ast.Name) and k.value.id == FLAG
                                                for k in node.keywords):
            checker = _resolve(node.func, names)
            module = inspect.getmodule(checker) if checker is not None else None
            found += [obj for name, obj in vars(module).items() if "solution" in name and inspect.isfunction(obj)
                      and obj.__module__ == module.__name__] if module else []
    return found


def solutions_switched_on(source, names):
    """The course_utils functions and classes the flag switches on in an exercise cell's ``source``: the code whose
    lines must not show (a value such as a list of names is an answer, held by tests/test_predictions.py's keys)."""
    tree = python_of(source)
    # a scaffold that subclasses the solution's class (13's MyReduceScatter(MicroFSDP)) asks for the methods it
    # defines: those are the solution, the rest of the class is the lesson's to show
    asked = {}
    for node in ast.walk(tree) if tree else ():
        if isinstance(node, ast.ClassDef):
            for base in node.bases:
                cls = _resolve(base, names)
                if inspect.isclass(cls):
                    asked.setdefault(cls, []).extend(
                        f.name for f in node.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)))
    keep = []
    for obj in switched_on(source, names):
        if not ((inspect.isfunction(obj) or inspect.isclass(obj)) and obj.__module__.startswith("course_utils")):
            continue
        for part in ([getattr(obj, m) for m in asked[obj] if hasattr(obj, m)] if asked.get(obj) else [obj]):
            if part not in keep:
                keep.append(part)
    return keep


def _strip_comment(line):
    """``line`` without a ``# comment`` (a ``#`` inside quotes stays)."""
    quote = None
    for k, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#":
            return line[:k]
    return line


def _normal(line):
    return " ".join(_strip_comment(line).split())


def _nontrivial(lines):
    out = []
    for line in lines:
        text = _normal(line)
        if len(text) >= 10 and text not in TRIVIAL and not re.fullmatch(r"[)\]}:,\s]*", text):
            out.append(text)
    return out


def solution_lines(obj):
    """The non-trivial lines of a solution's body: no ``def``/``class`` header, no docstring, no comment."""
    source = inspect.getsource(obj)
    lines = source.splitlines()
    tree = ast.parse(inspect.cleandoc("\n" + source) if source[:1].isspace() else source)
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            skip.update(range(first, node.body[0].lineno))
            doc = node.body[0]
            if isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str):
                skip.update(range(doc.lineno, doc.end_lineno + 1))
    return _nontrivial(line for n, line in enumerate(lines, 1) if n not in skip)


def _windows(lines):
    return {tuple(lines[k:k + WINDOW]) for k in range(len(lines) - WINDOW + 1)}


def cell_texts(cell):
    """What a learner can read of a cell: its source, and each stored output (ANSI and traceback prefixes gone)."""
    yield "source", cell.source
    for output in cell.get("outputs", []):
        if output.output_type == "stream":
            text = output.text
        elif output.output_type == "error":
            text = "\n".join(output.traceback)
        else:
            text = "".join(output.get("data", {}).get("text/plain", ""))
        text = ANSI.sub("", text)
        yield "output", "\n".join(TRACEBACK_PREFIX.sub("", line) for line in text.splitlines())


def leaks(nb, name):
    """Every place in ``nb`` that shows WINDOW lines in a row of a solution one of its exercise cells switches on."""
    names = lesson_imports(nb)
    solutions = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code" and FLAG in cell.source:
            solutions += [obj for obj in solutions_switched_on(cell.source, names) if obj not in solutions]
    found = []
    for obj in solutions:
        lines = solution_lines(obj)
        wanted = _windows(lines)
        for i, cell in enumerate(nb.cells):
            for what, text in cell_texts(cell):
                shown = _windows(_nontrivial(text.splitlines())) & wanted
                if shown:
                    first = min(shown, key=lambda w: lines.index(w[0]))
                    found.append(f"{name} cell {i} ({what}) shows {WINDOW}+ lines of the solution "
                                 f"{obj.__module__}.{obj.__qualname__}, from {first[0]!r}")
    return found, solutions


def uncollapsed(nb, name):
    copy = learner_copy.learner_version(nb)
    return [f"{name} cell {i}: a reveal cell the learner's copy shows open" for i, c in enumerate(copy.cells)
            if "reveal" in c.metadata.get("tags", []) and not (
                c.metadata.get("jupyter", {}).get("source_hidden")
                and (c.cell_type != "code" or c.metadata.get("jupyter", {}).get("outputs_hidden")))]


def _mark(path):
    number = path.name[:2]
    if number in SHOWN_TODAY:
        return pytest.param(path, id=number, marks=pytest.mark.xfail(strict=True, reason=SHOWN_TODAY[number]))
    return pytest.param(path, id=number)


@pytest.mark.parametrize("path", [_mark(p) for p in LESSONS])
def test_no_lesson_shows_its_solutions_and_the_copy_collapses_its_answers(path):
    nb = nbformat.read(path, as_version=4)
    names = lesson_imports(nb)
    unresolved = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and f"{FLAG} = True" in c.source
                  and not switched_on(c.source, names)]
    found, _ = leaks(nb, path.name)
    found += [f"{path.name} cell {i}: sets {FLAG} = True and switches on nothing this test finds in course_utils "
              "(see this module's docstring for the forms)" for i in unresolved]
    found += uncollapsed(nb, path.name)
    assert not found, "\n".join(found)


# ---- the detector on a probe: a solution shown, a solution hidden -------------------------------------------------

def test_the_detector_finds_a_shown_solution_and_passes_a_hidden_one():
    import nbformat.v4 as v4

    from course_utils.allreduce import chunked_ring_all_reduce

    body = solution_lines(chunked_ring_all_reduce)
    assert len(body) >= WINDOW, body
    exercise = v4.new_code_cell("from course_utils.allreduce import chunked_ring_all_reduce\nUSE_SOLUTION = True\n"
                                "ring = chunked_ring_all_reduce if USE_SOLUTION else my_ring\ncheck(ring)")
    hidden = v4.new_notebook(cells=[v4.new_markdown_cell("# 99"), exercise])
    found, solutions = leaks(hidden, "99")
    assert solutions == [chunked_ring_all_reduce] and found == [], (solutions, found)
    source = inspect.getsource(chunked_ring_all_reduce).splitlines()
    middle = "\n".join(source[len(source) // 2 - 3:len(source) // 2 + 3])
    for shown in (v4.new_code_cell("# the ring, by hand\n" + middle),
                  v4.new_code_cell("x = 1", outputs=[v4.new_output(
                      "error", ename="E", evalue="", traceback=[f"---> {n} {line}" for n, line in
                                                              enumerate(middle.splitlines(), 40)])])):
        nb = v4.new_notebook(cells=[v4.new_markdown_cell("# 99"), shown, exercise])
        found, _ = leaks(nb, "99")
        assert any("99 cell 1" in f and "chunked_ring_all_reduce" in f for f in found), (shown, found)


def test_the_flag_forms_resolve_to_their_solutions():
    from course_utils.checks import basics, tour

    names = {"basics": basics, "check": tour.check_sum_of_squares,
             "solution_ring_shift": basics.solution_ring_shift}
    assert solutions_switched_on("f(solution_ring_shift if USE_SOLUTION else mine)", names) == [
        basics.solution_ring_shift]
    assert solutions_switched_on("if USE_SOLUTION:\n    x = basics.solution_optimizer_state(3)", names) == [
        basics.solution_optimizer_state]
    assert solutions_switched_on(
        "if USE_SOLUTION:\n    from course_utils.checks.basics import solution_gather_to_rank0 as g", names) == [
        basics.solution_gather_to_rank0]
    via_checker = solutions_switched_on("check(use_solution=USE_SOLUTION)", names)
    assert via_checker and all("solution" in f.__name__ and f.__module__ == tour.__name__ for f in via_checker)


def test_an_open_reveal_cell_in_the_copy_is_named(monkeypatch):
    import nbformat.v4 as v4

    def probe():
        return v4.new_notebook(cells=[v4.new_markdown_cell("answer", metadata={"tags": ["reveal"]}),
                                      v4.new_code_cell("x", metadata={"tags": ["reveal"]})])

    assert uncollapsed(probe(), "99") == []
    monkeypatch.setattr(learner_copy, "learner_version", learner_copy.cleared)  # a copy that forgets to collapse
    assert uncollapsed(probe(), "99") == [f"99 cell {i}: a reveal cell the learner's copy shows open" for i in (0, 1)]
