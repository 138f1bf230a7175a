"""The learner's own copy of the lessons: my-notebooks/, outputs cleared, made once and never overwritten.

    .venv/bin/python scripts/learner_copy.py          # what `make lab` runs before it opens JupyterLab

notebooks/ holds the lessons with their stored outputs, which nbval (`make test`) compares against; the
learner works in my-notebooks/ (git-ignored), where no stored output answers a "Predict first" question and
saving a lesson leaves `git status` clean. Every cell tagged ``reveal`` (the answer to a prediction, right after its
run: CONTRIBUTING.md, "The learner does the work") arrives collapsed (``metadata.jupyter.source_hidden``, and
``outputs_hidden`` for a code cell): the learner opens it on purpose, after running the cell above it.
Each run copies the lessons that my-notebooks/ lacks (a lesson
added to the course later arrives on the next `make lab`) and keeps every file already there, edited or not.
A fresh copy of one lesson: delete (or rename) it in my-notebooks/ and run `make lab` again; of all of them:
move my-notebooks/ away. my-notebooks/ sits beside notebooks/, so the lessons' relative links
(`01_data_parallelism.ipynb`, `../README.md`) work in both.
"""
import argparse
import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent
LESSON_GLOB = "[0-9][0-9]_*.ipynb"


def cleared(nb):
    """``nb`` with every output and execution count removed and no stored widget state."""
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = []
            cell.execution_count = None
        cell.metadata.pop("execution", None)  # nbclient's timings
    nb.metadata.pop("widgets", None)
    return nb


REVEAL = "reveal"  # the tag of a cell that answers a prediction (tests/test_predictions.py holds where they sit)


def collapsed(nb):
    """``nb`` with every cell tagged ``reveal`` collapsed in JupyterLab: its source hidden and, for a code cell, its
    outputs too (a click on the cell's collapser opens it). tests/test_learner_copy.py holds it."""
    for cell in nb.cells:
        if REVEAL in cell.metadata.get("tags", []):
            jupyter = cell.metadata.setdefault("jupyter", {})
            jupyter["source_hidden"] = True
            if cell.cell_type == "code":
                jupyter["outputs_hidden"] = True
    return nb


def learner_version(nb):
    """What the learner's copy holds of ``nb``: outputs cleared, reveal cells collapsed."""
    return collapsed(cleared(nb))


def sync(src: Path, dest: Path):
    """Copy each lesson of ``src`` that ``dest`` lacks (``learner_version``); returns (added, kept) file names."""
    lessons = sorted(src.glob(LESSON_GLOB))
    if not lessons:
        raise SystemExit(f"{src} holds no lesson ({LESSON_GLOB}): run this from the course's repository")
    dest.mkdir(parents=True, exist_ok=True)
    added, kept = [], []
    for lesson in lessons:
        target = dest / lesson.name
        if target.exists():
            kept.append(lesson.name)
            continue
        nb = learner_version(nbformat.read(lesson, as_version=4))
        partial = target.with_name(f".{target.name}.partial")  # never a half-written lesson under its own name
        nbformat.write(nb, partial)
        partial.replace(target)
        added.append(lesson.name)
    return added, kept


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--src", type=Path, default=ROOT / "notebooks", help="the course's lessons")
    parser.add_argument("--dest", type=Path, default=ROOT / "my-notebooks", help="the learner's copy")
    args = parser.parse_args(argv)
    added, kept = sync(args.src, args.dest)
    where = args.dest.relative_to(ROOT) if args.dest.is_relative_to(ROOT) else args.dest
    if added:
        print(f"{where}/: added {len(added)} lesson(s) with outputs cleared: {', '.join(added)}")
    if kept:
        print(f"{where}/: kept your {len(kept)} existing lesson(s) as they are "
              f"(for a fresh one, delete it there and run `make lab` again)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
