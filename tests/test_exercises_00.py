"""Lesson 00, exercise 1, as the notebook wires it: the stored scaffold fails its self-check, the course's solution
passes, and a slow check shows a live status line. The checker's verdicts on wrong and right answers are held by
tests/test_checker_sum_of_squares.py."""
import pytest

from course_utils.checks import check_sum_of_squares
from exercise_helpers import notebook_cell


def _scaffold():
    """The %%ddp cell of the stored notebook that defines sum_of_squares, without its %%ddp line."""
    source = notebook_cell("00_launcher_tour.ipynb", "def sum_of_squares")
    assert source.startswith("%%ddp"), "exercise 1 runs on the ranks"
    return source.split("\n", 1)[1]


@pytest.fixture
def cluster(make_cluster):
    c = make_cluster(4, timeout=60)
    c.run("globals().pop('sum_of_squares', None)\nimport torch, torch.distributed as dist")
    return c


def test_the_course_solution_passes(cluster):
    check_sum_of_squares(use_solution=True, cluster=cluster)


def test_the_unmodified_scaffold_fails_and_says_it_is_not_written(cluster):
    cluster.run(_scaffold())
    with pytest.raises(AssertionError, match="still raises NotImplementedError: write it"):
        check_sum_of_squares(cluster=cluster)


def test_a_missing_definition_says_which_cell_to_run(cluster):
    with pytest.raises(AssertionError, match="not defined on the ranks: run the %%ddp cell"):
        check_sum_of_squares(cluster=cluster)


def test_a_slow_check_shows_a_live_status_line_in_a_notebook_and_blanks_it(cluster, monkeypatch):
    """A checker's Cluster.run from a notebook cell shows the %%ddp cell's live status line once it has
    run for a second, and blanks that line (only, no clear_output) when it ends."""
    import IPython
    import IPython.display

    from course_utils.engine import launcher, magic

    shown = []

    class Handle:
        def update(self, data, raw=False):
            shown.append(data["text/plain"])

    def display(data, raw=False, display_id=False):
        shown.append(data["text/plain"])
        return Handle()

    class Kernel:
        kernel = object()

    assert launcher.CALL_VIEW is magic.CallView, "loading the magic's module installs the checkers' status line"
    monkeypatch.setattr(IPython.display, "display", display)
    monkeypatch.setattr(IPython, "get_ipython", lambda: Kernel())
    monkeypatch.setattr(launcher, "_under_nbval", lambda: False)
    cluster.run("def sum_of_squares():\n    import time\n    time.sleep(2.5)   # a slow answer: the check runs 2.5 s\n"
                "    t = torch.tensor([float(rank) ** 2])\n    dist.all_reduce(t)\n    return t")
    shown.clear()
    check_sum_of_squares(cluster=cluster)
    assert any(line.startswith("running on 4 ranks: ") for line in shown), f"no live status line: {shown}"
    assert shown[-1] == "", f"the status line must be blanked when the check ends, not left behind: {shown}"
