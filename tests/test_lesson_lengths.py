"""Each lesson states how long its main path takes, the statement follows the lesson's length, and every lesson fits
one sitting (75 minutes). The rule, one for every lesson (CONTRIBUTING.md, "The learner does the work"):

- the main path is every cell up to the first heading "Going further";
- words at 100 a minute: the markdown's, and those of the stored outputs a learner reads (stream text, text/plain);
- code at 8 non-blank lines a minute;
- each exercise by its kind, declared as the LAST parenthesis of its heading ("### Exercise: the ring (15 minutes)")
  or of its item in "## Exercises" (the item's lines up to the next item): ``(5 minutes)`` fill in a line,
  ``(15 minutes)`` write a function, ``(30 minutes)`` a class or a loop with communication. An item that sends the
  learner back to a section whose own exercise heading was counted ("... in section 2 ...") counts once, and one
  marked **Going further.** is an aside. An exercise without its kind fails, and counts 5 in the estimate meanwhile.

The first cell states "**Estimated time**: about N minutes" within SLACK of the estimate.

    .venv/bin/python tests/test_lesson_lengths.py      # prints every lesson's figures, for whoever edits one

Lessons not yet converted to the convention (NOT_CONVERTED) are strict xfails of the tests they fail today: an xfail
fails loudly once its lesson complies, and whoever converted it removes the mark; every other lesson is held.
"""
import re
import sys
from pathlib import Path

import nbformat
import pytest

if __name__ == "__main__":  # a script: conftest's import would set up a test run's temporary caches
    LESSONS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("[0-9][0-9]_*.ipynb"))
else:
    from conftest import LESSONS

WORDS_PER_MINUTE, CODE_LINES_PER_MINUTE = 100, 8
KINDS = {5: "fill in a line", 15: "write a function", 30: "a class or a loop with communication"}
ONE_SITTING = 75        # minutes: every lesson fits it
SLACK = 10              # minutes: how far a stated time may sit from the estimate
STATED = re.compile(r"\*\*(?:Estimated time|Time):?\*\*:? about (\d+)(?:-(\d+))? minutes")
GOING_FURTHER = re.compile(r"^#+ .*Going further", re.M)
KIND = re.compile(r"\((\d+) minutes?\)")
ITEM = re.compile(r"^\s{0,3}\d+\. ")
ADD_KIND = "end its line with (5 minutes), (15 minutes) or (30 minutes): fill in a line, a function, a class or loop"


class Estimate:
    """The figures of one lesson's main path."""

    def __init__(self):
        self.words = self.output_words = self.code = 0
        self.exercises = []     # (minutes, the line that declares it)
        self.undeclared = []    # exercise lines without a declared kind (or with another figure)

    @property
    def minutes(self):
        return ((self.words + self.output_words) / WORDS_PER_MINUTE + self.code / CODE_LINES_PER_MINUTE
                + sum(m for m, _ in self.exercises))


def _kind(text, where, estimate):
    """Record the exercise ``text`` declares (its last parenthesis), or that it declares none."""
    kinds = KIND.findall(text)
    parentheses = re.findall(r"\([^()]*\)", text)
    if kinds and parentheses[-1] == f"({kinds[-1]} minutes)" and int(kinds[-1]) in KINDS:
        estimate.exercises.append((int(kinds[-1]), where))
    else:
        estimate.undeclared.append(where)
        estimate.exercises.append((5, where))


def _output_words(cell):
    words = 0
    for output in cell.get("outputs", []):
        if output.output_type == "stream":
            words += len(output.text.split())
        elif output.output_type in ("execute_result", "display_data"):
            words += len("".join(output.get("data", {}).get("text/plain", "")).split())
    return words


def estimate(path):
    """The ``Estimate`` of the main path of the lesson at ``path``."""
    result = Estimate()
    in_exercises = False
    section = None                 # the number of the "## N. ..." section being read
    with_exercise = set()          # sections whose own exercise heading was counted
    for cell in nbformat.read(path, as_version=4).cells:
        text = cell.source
        if cell.cell_type != "markdown":
            result.code += sum(1 for line in text.splitlines() if line.strip())
            result.output_words += _output_words(cell)
            continue
        end = GOING_FURTHER.search(text)
        if end:
            text = text[:end.start()]
        lines = text.splitlines()
        for k, line in enumerate(lines):
            heading = re.match(r"(#+) (.*)", line)
            if heading and len(heading.group(1)) <= 2:          # a section starts: is it the exercises?
                in_exercises = heading.group(2).strip() == "Exercises"
                number = re.match(r"(\d+)\.", heading.group(2))
                section = int(number.group(1)) if number else None
            if heading and re.search(r"\bExercise\b", heading.group(2)):   # "### Exercise: ...": one exercise
                with_exercise.add(section)
                _kind(line, line.strip(), result)
            elif in_exercises and ITEM.match(line) and not repeats_an_exercise(line, with_exercise):
                item = [line]
                for more in lines[k + 1:]:      # the item's wrapped lines, up to the next item or heading
                    if ITEM.match(more) or more.startswith("#") or not more.strip():
                        break
                    item.append(more)
                _kind(" ".join(item), line.strip(), result)
        result.words += len(text.split())
        if end:
            break
    return result


def repeats_an_exercise(item, with_exercise):
    """An item of "## Exercises" that the rule has counted already, or that is an aside: it points back to a
    section whose own exercise heading was counted ("Write `step()` in section 2 ..."), or it is marked
    **Going further.** (an aside, outside the main path)."""
    if re.match(r"\s*\d+\. \*\*Going further\.?\*\*", item):
        return True
    return any(int(n) in with_exercise for n in re.findall(r"\bsection (\d+)\b", item))


def stated(path):
    """The (low, high) minutes the lesson's first cell states for its main path."""
    found = STATED.search(nbformat.read(path, as_version=4).cells[0].source)
    assert found, f"{path.name}: its first cell should state '**Estimated time**: about N minutes'"
    low = int(found.group(1))
    return low, int(found.group(2) or low)


# The lessons that fail a test until they are converted, by test: strict xfails.
NOT_CONVERTED = set()
FAILING_TODAY = {
    "kinds": set(),
    "stated": set(),
    "sitting": set(),
}


def _lessons(test):
    params = []
    for path in LESSONS:
        number = path.name[:2]
        marks = [pytest.mark.xfail(strict=True, reason="not yet converted: it must move material")] if (
            number in FAILING_TODAY[test] and number in NOT_CONVERTED) else []
        params.append(pytest.param(path, id=number, marks=marks))
    return params


def _figures(path, result):
    return (f"{result.words} words of prose, {result.output_words} of stored output, {result.code} code lines, "
            f"exercises {[m for m, _ in result.exercises]} minutes")


@pytest.mark.parametrize("path", _lessons("kinds"))
def test_each_exercise_declares_its_kind(path):
    result = estimate(path)
    assert not result.undeclared, (
        f"{path.name}: exercises without a declared kind ({ADD_KIND}):\n" + "\n".join(result.undeclared))


@pytest.mark.parametrize("path", _lessons("stated"))
def test_the_stated_time_follows_the_lessons_length(path):
    result = estimate(path)
    low, high = stated(path)
    assert low - SLACK <= result.minutes <= high + SLACK, (
        f"{path.name} states about {low}-{high} minutes for its main path, but its length gives "
        f"{result.minutes:.0f} ({_figures(path, result)}): state the estimate, or move asides to 'Going further'")


# The README: "Every lesson fits one sitting"
@pytest.mark.parametrize("path", _lessons("sitting"))
def test_every_lesson_fits_one_sitting(path):
    result = estimate(path)
    assert result.minutes <= ONE_SITTING and stated(path)[1] <= ONE_SITTING, (
        f"{path.name}: its main path takes about {result.minutes:.0f} minutes ({_figures(path, result)}), over one "
        f"sitting ({ONE_SITTING}): move asides to 'Going further', or split the lesson")


# ---- the rule itself, on small notebooks ---------------------------------------------------------------------------

def _probe(tmp_path, *cells):
    import nbformat.v4 as v4

    nb = v4.new_notebook(cells=list(cells))
    path = tmp_path / "99_probe.ipynb"
    nbformat.write(nb, path)
    return path


def test_the_rule_counts_what_it_says(tmp_path):
    import nbformat.v4 as v4

    prose = ["# Title\n" + "word " * 198,                                                   # 200 words
             "## 2. Exercise: the ring (15 minutes)\nWrite it.",                            # 9
             "## Exercises\n1. Fill in the line in section 2.\n"                            # 1. counted once
             "2. Write the loop with its all-reduce\n   over the micro-batches (30 minutes)\n"
             "3. **Going further.** An aside."]
    path = _probe(
        tmp_path, v4.new_markdown_cell(prose[0]),
        v4.new_code_cell("a = 1\n\nb = 2\n" * 4, outputs=[                                  # 8 lines
            v4.new_output("stream", text="three words here\n"),                             # 5 words of output
            v4.new_output("execute_result", data={"text/plain": "two words", "image/png": "AAAA"})]),
        v4.new_markdown_cell(prose[1]), v4.new_markdown_cell(prose[2]),
        v4.new_markdown_cell("## Going further\n" + "word " * 1000),                          # not the main path
        v4.new_code_cell("x = 1\n" * 100))
    result = estimate(path)
    words = sum(len(p.split()) for p in prose)
    assert (result.words, result.output_words, result.code) == (words, 5, 8), vars(result)
    assert [m for m, _ in result.exercises] == [15, 30] and not result.undeclared, vars(result)
    assert result.minutes == pytest.approx((words + 5) / 100 + 8 / 8 + 45)


def test_an_exercise_without_its_kind_is_named(tmp_path):
    import nbformat.v4 as v4

    path = _probe(tmp_path, v4.new_markdown_cell("# Title\n### Exercise: the step\nWrite it."),
                  v4.new_markdown_cell("## Exercises\n1. Predict the bytes (10 minutes)\n"
                                       "2. Write `step()` (15 minutes) and then check it (twice)\n"
                                       "3. Write the class (30 minutes)"))
    result = estimate(path)
    assert result.undeclared == ["### Exercise: the step", "1. Predict the bytes (10 minutes)",
                                 "2. Write `step()` (15 minutes) and then check it (twice)"], result.undeclared
    assert [m for m, _ in result.exercises] == [5, 5, 5, 30]


def test_an_exercise_is_counted_once(tmp_path):
    """A heading "## 2. Exercise: ..." and the item of "## Exercises" that sends the learner back to section 2 are
    one exercise; another item is another; an item marked **Going further.** is an aside."""
    import nbformat.v4 as v4

    path = _probe(tmp_path,
                  v4.new_markdown_cell("# Title\n## 1. Setup\ntext"),
                  v4.new_markdown_cell("## 2. Exercise: the step (15 minutes)\nWrite it."),
                  v4.new_markdown_cell("## Exercises\n1. Write `step()` in section 2 and make the check pass.\n"
                                       "2. **Predict, then count.** How many bytes? (5 minutes)\n"
                                       "3. **Going further.** An interleaved schedule."))
    assert [m for m, _ in estimate(path).exercises] == [15, 5]


def test_every_lesson_is_measured():
    assert len(LESSONS) >= 17 and all(estimate(p).code > 0 for p in LESSONS)
    assert set(FAILING_TODAY["stated"] | FAILING_TODAY["sitting"] | FAILING_TODAY["kinds"]) <= NOT_CONVERTED, (
        "only the lessons not yet converted may be marked")


def table(paths=LESSONS):
    """Every lesson's figures, one line each."""
    rows = [f"{'lesson':<36} {'prose':>6} {'output':>6} {'code':>5} {'exercises (min)':<22} {'estimate':>8} "
            f"{'stated':>7}  verdict"]
    for path in paths:
        result = estimate(path)
        try:
            low, high = stated(path)
            said = f"{low}" if low == high else f"{low}-{high}"
        except AssertionError:
            low = high = None
            said = "none"
        ok = (low is not None and low - SLACK <= result.minutes <= high + SLACK and result.minutes <= ONE_SITTING
              and high <= ONE_SITTING and not result.undeclared)
        kinds = ",".join(str(m) for m, _ in result.exercises) + (f" ({len(result.undeclared)} undeclared)"
                                                                  if result.undeclared else "")
        rows.append(f"{path.name[:36]:<36} {result.words:>6} {result.output_words:>6} {result.code:>5} "
                    f"{kinds:<22} {result.minutes:>8.0f} {said:>7}  {'ok' if ok else 'FAILS'}")
    return "\n".join(rows)


if __name__ == "__main__":
    print(table([Path(p).resolve() for p in sys.argv[1:]] or LESSONS))
