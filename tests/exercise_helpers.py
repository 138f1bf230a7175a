"""Helpers shared by the tests of the lessons' exercises (tests/test_exercises_*.py): find an exercise cell
in a stored notebook, run it as the ranks would, and turn a self-check's AssertionError into its message.

The ranks cannot import test files, so this module is registered to be pickled by value.
"""
import contextlib

import nbformat

from conftest import NOTEBOOKS, register_by_value


def notebook_cell(notebook, marker, *, ddp_line=True, solution=True):
    """The source of the one code cell of ``notebooks/<notebook>`` that contains ``marker``, as stored: the one
    place the tests read a cell out of a notebook. ``ddp_line=False``: without its ``%%ddp`` line if it has one,
    as the ranks run it. ``solution=False``: with ``USE_SOLUTION = True`` switched off (see solution_off)."""
    path = NOTEBOOKS / notebook
    cells = [c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code" and marker in c.source]
    assert len(cells) == 1, f"expected one code cell of {path.name} containing {marker!r}, found {len(cells)}"
    source = cells[0] if solution else solution_off(cells[0])
    return source.split("\n", 1)[1] if not ddp_line and source.startswith("%%ddp") else source


def solution_off(source):
    """An exercise cell's ``source`` with ``USE_SOLUTION = True`` switched off: the learner's scaffold runs."""
    assert "USE_SOLUTION = True" in source, "the exercise cell should switch the solution on by a flag"
    return source.replace("USE_SOLUTION = True", "USE_SOLUTION = False", 1)


def verdict(check, *args, **kwargs):
    """None if ``check`` passed, else its AssertionError's message (on every rank)."""
    with contextlib.redirect_stdout(None):
        try:
            check(*args, **kwargs)
        except AssertionError as exc:
            return str(exc)
    return None


def run_exercise_cell(source):
    """Run a notebook's exercise cell as the ranks would (without its %%ddp line), with USE_SOLUTION as the
    source sets it: None if its self-check passed, else the verdict."""
    import torch
    import torch.distributed as dist

    body = "\n".join(line for line in source.splitlines() if not line.startswith("%%ddp"))
    namespace = {"torch": torch, "dist": dist, "rank": dist.get_rank(), "world_size": dist.get_world_size()}
    with contextlib.redirect_stdout(None):
        try:
            exec(compile(body, "exercise-cell", "exec"), namespace)
        except AssertionError as exc:
            return str(exc)
    return None


register_by_value(__name__)
