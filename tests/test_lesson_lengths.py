"""Each lesson states how long its main path takes; the statement must follow the lesson's length, and every lesson
fits one sitting (issue 31: 60-75 minutes; the README says so). The estimate is one rule for every lesson, the
README's: 100 words of prose and 8 lines of code a minute (reading, predicting, running, looking at the output), plus
5 minutes an exercise, each exercise counted once, up to "Going further"."""
import re

import nbformat
import pytest

from conftest import LESSONS, NOTEBOOKS

WORDS_PER_MINUTE, CODE_LINES_PER_MINUTE, MINUTES_PER_EXERCISE = 100, 8, 5
ONE_SITTING = 75        # minutes: every lesson fits it
SLACK = 10              # minutes: how far a stated time may sit from the estimate
STATED = re.compile(r"\*\*(?:Estimated time|Time):?\*\*:? about (\d+)(?:-(\d+))? minutes")
GOING_FURTHER = re.compile(r"^#+ .*Going further", re.M)


def estimate(path):
    """(minutes, words, code lines, exercises) of the main path of the lesson at ``path``."""
    words = code = exercises = 0
    in_exercises = False
    section = None                 # the number of the "## N. ..." section being read
    with_exercise = set()          # sections whose own exercise heading was counted
    for cell in nbformat.read(path, as_version=4).cells:
        text = cell.source
        if cell.cell_type != "markdown":
            code += sum(1 for line in text.splitlines() if line.strip())
            continue
        end = GOING_FURTHER.search(text)
        if end:
            words += len(text[:end.start()].split())
            break
        for line in text.splitlines():
            heading = re.match(r"(#+) (.*)", line)
            if heading and len(heading.group(1)) <= 2:          # a section starts: is it the exercises?
                in_exercises = heading.group(2).strip() == "Exercises"
                number = re.match(r"(\d+)\.", heading.group(2))
                section = int(number.group(1)) if number else None
            if heading and re.search(r"\bExercise\b", heading.group(2)):   # "### Exercise: ...": one exercise
                exercises += 1
                with_exercise.add(section)
            elif in_exercises and re.match(r"\d+\. ", line):            # an item of "## Exercises"
                exercises += not repeats_an_exercise(line, with_exercise)
        words += len(text.split())
    minutes = words / WORDS_PER_MINUTE + code / CODE_LINES_PER_MINUTE + MINUTES_PER_EXERCISE * exercises
    return minutes, words, code, exercises


def repeats_an_exercise(item, with_exercise):
    """An item of "## Exercises" that the rule has counted already, or that is an aside: it points back to a
    section whose own exercise heading was counted ("Write `step()` in section 2 ..."), or it is marked
    **Going further.** (an aside, outside the main path)."""
    if re.match(r"\d+\. \*\*Going further\.?\*\*", item):
        return True
    return any(int(n) in with_exercise for n in re.findall(r"\bsection (\d+)\b", item))


def stated(path):
    """The (low, high) minutes the lesson's first cell states for its main path."""
    found = STATED.search(nbformat.read(path, as_version=4).cells[0].source)
    assert found, f"{path.name}: its first cell should state '**Estimated time**: about N minutes'"
    low = int(found.group(1))
    return low, int(found.group(2) or low)


def test_the_rule_counts_what_it_says():
    assert len(LESSONS) >= 17
    minutes, words, code, exercises = estimate(NOTEBOOKS / "03_all_reduce_by_hand.ipynb")
    assert words > 1000 and code > 100 and exercises >= 2, (words, code, exercises)
    assert minutes == pytest.approx(words / 100 + code / 8 + 5 * exercises)


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.name[:2])
def test_the_stated_time_follows_the_lessons_length(path):
    minutes, words, code, exercises = estimate(path)
    low, high = stated(path)
    assert low - SLACK <= minutes <= high + SLACK, (
        f"{path.name} states about {low}-{high} minutes for its main path, but its length gives {minutes:.0f} "
        f"({words} words, {code} code lines, {exercises} exercises): state the estimate, or move asides to "
        "'Going further'")


def test_an_exercise_is_counted_once(tmp_path):
    """A heading "## 2. Exercise: ..." and the item of "## Exercises" that sends the learner back to section 2 are
    one exercise; another item is another; an item marked **Going further.** is an aside."""
    import nbformat.v4 as v4

    nb = v4.new_notebook(cells=[
        v4.new_markdown_cell("# Title\n## 1. Setup\ntext"),
        v4.new_markdown_cell("## 2. Exercise: the step\nWrite it."),
        v4.new_markdown_cell("## Exercises\n1. Write `step()` in section 2 and make the check pass.\n"
                             "2. **Predict, then count.** How many bytes?\n"
                             "3. **Going further.** An interleaved schedule."),
    ])
    path = tmp_path / "99_probe.ipynb"
    nbformat.write(nb, path)
    assert estimate(path)[3] == 2


# The README: "Every lesson fits one sitting" (issue 39: 12 and 15; issue 40: 16; lesson 13 was split into 13 and 14)
@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.name[:2])
def test_every_lesson_fits_one_sitting(path):
    minutes, *_ = estimate(path)
    assert minutes <= ONE_SITTING and stated(path)[1] <= ONE_SITTING, (
        f"{path.name}: its main path takes about {minutes:.0f} minutes, over one sitting ({ONE_SITTING}): move "
        "asides to 'Going further', or split the lesson")
