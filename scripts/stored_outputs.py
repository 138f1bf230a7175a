"""What the lessons' stored outputs hold, read without running anything: the rules CI uses to choose its work.

    .venv/bin/python scripts/stored_outputs.py --baseline   # the lessons `make test-baseline-cpu` re-checks
    .venv/bin/python scripts/stored_outputs.py --times      # each lesson's stored execution time, slowest cells

The baseline pass (CI's second nbval pass, with torch's CPU kernels forced down) exists to catch a stored number
that another CPU's arithmetic changes. A lesson needs it when one of its checked outputs (what nbval compares:
text/plain, text/html, both streams, after tests/sanitize.cfg) holds a **computed float**: a decimal number with a
non-zero fraction that is neither written in the lesson's code (a constant echoed back, such as ``lr=0.1``) nor a
version (``torch 2.13``). Integers, ``4.0`` and masked timings print the same on every CPU. A new lesson is
classified by this rule, never by hand (tests/test_ci_budget.py checks the rule and the Makefile's use of it).

The stored execution times are those `make notebooks` (scripts/execute_notebooks.py, through nbclient) records in
each code cell's ``metadata.execution``; tests/test_ci_budget.py holds every lesson to the course's budgets.
"""
import json
import re
import sys
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
SANITIZE = ROOT / "tests" / "sanitize.cfg"

FLOAT = re.compile(r"(?<![\w.])[-+]?\d+\.(\d+)(?:e[+-]?\d+)?(?![\w.]*\d)")
VERSION_BEFORE = re.compile(r"(?:torch|[Pp]ython|version|NCCL|nccl|CUDA|cuda|v)\s*[<>=]*\s*$")


def sanitizers(path=SANITIZE):
    """The (compiled regex, replacement) pairs of a sanitize.cfg, read as nbval reads them."""
    lines = Path(path).read_text().splitlines()
    return [(re.compile(line[len("regex: "):]), lines[i + 1][len("replace: "):])
            for i, line in enumerate(lines[:-1])
            if line.startswith("regex: ") and lines[i + 1].startswith("replace: ")]


def checked_texts(cell, rules=()):
    """The texts nbval compares for one code cell (streams, text/plain, text/html, tracebacks), sanitised."""
    texts = []
    for out in cell.get("outputs", []):
        if out["output_type"] == "stream":
            texts.append("".join(out["text"]))
        elif out["output_type"] == "error":
            texts.append("\n".join(out["traceback"]))
        else:
            texts += ["".join(out.get("data", {})[kind]) for kind in ("text/plain", "text/html")
                      if kind in out.get("data", {})]
    for i, text in enumerate(texts):
        for regex, replacement in rules:
            text = regex.sub(replacement, text)
        texts[i] = text
    return texts


def computed_floats(path, rules=None):
    """The computed floats in the checked outputs of the notebook at ``path`` (see the module's docstring)."""
    rules = sanitizers() if rules is None else rules
    cells = json.loads(Path(path).read_text())["cells"]
    code = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    found = []
    for cell in cells:
        if cell["cell_type"] != "code":
            continue
        for text in checked_texts(cell, rules):
            for m in FLOAT.finditer(text):
                number, fraction = m.group(), m.group(1)
                if set(fraction) <= {"0"} or number.lstrip("+-") in code:
                    continue
                if VERSION_BEFORE.search(text[max(0, m.start() - 12):m.start()]):
                    continue
                found.append(number)
    return found


def lessons():
    return sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))


def baseline_lessons():
    """The lessons whose checked outputs hold a computed float: the ones the baseline pass re-checks."""
    rules = sanitizers()
    return [path for path in lessons() if computed_floats(path, rules)]


def _seconds(execution):
    start, end = execution.get("iopub.execute_input"), execution.get("shell.execute_reply")
    if not (start and end):
        return None
    parse = lambda s: datetime.fromisoformat(s.replace("Z", "+00:00"))
    return (parse(end) - parse(start)).total_seconds()


# The machine the budgets are set for: a quiet 2-core machine on which a fresh `python -c "import torch"` takes
# about 1.5 s (the course's machines were documented at 1-2 s). scripts/execute_notebooks.py measures that import on
# the machine that executes a lesson (the median of 3, just before) and stores it in the notebook's metadata, so a
# lesson executed on a machine twice as slow is held to the budget at half its stored times: the times are
# compared as the reference machine would have taken them. A notebook without the measurement is taken as is.
REFERENCE_IMPORT_TORCH_S = 1.5


def import_torch_seconds(path):
    """The fresh `import torch` time stored with the notebook at ``path`` by scripts/execute_notebooks.py, or None."""
    meta = json.loads(Path(path).read_text()).get("metadata", {})
    return meta.get("micro_ddp", {}).get("import_torch_s")


def budget_scale(path):
    """The factor that turns the notebook's stored times into the reference machine's (REFERENCE_IMPORT_TORCH_S)."""
    measured = import_torch_seconds(path)
    return REFERENCE_IMPORT_TORCH_S / measured if measured else 1.0


def cell_times(path):
    """[(cell index, seconds or None when the cell has no stored time)] for every code cell of a notebook."""
    cells = json.loads(Path(path).read_text())["cells"]
    return [(i, _seconds(c.get("metadata", {}).get("execution", {})))
            for i, c in enumerate(cells) if c["cell_type"] == "code"]


def main(argv):
    if argv == ["--baseline"]:
        print(" ".join(str(p.relative_to(ROOT)) for p in baseline_lessons()))
    elif argv == ["--times"]:
        for path in lessons():
            times = [(i, s) for i, s in cell_times(path) if s is not None]
            slowest = sorted(times, key=lambda t: -t[1])[:3]
            print(f"{path.name:40} {sum(s for _, s in times):7.1f} s (x{budget_scale(path):.2f} on the reference "
                  f"machine)   slowest cells: " + ", ".join(f"{i} ({s:.1f} s)" for i, s in slowest))
    else:
        sys.exit(f"usage: {sys.argv[0]} --baseline | --times")


if __name__ == "__main__":
    main(sys.argv[1:])
