"""Lesson 00, exercise 2: the self-check fails the notebook's unmodified scaffold and typical wrong answers,
each with a reason a learner can act on, and passes the course's solution."""
import pytest

from course_utils.tour import check_sum_of_squares
from exercise_helpers import notebook_cell


def _scaffold():
    """The %%ddp cell of the stored notebook that defines sum_of_squares, without its %%ddp line."""
    source = notebook_cell("00_launcher_tour.ipynb", "def sum_of_squares")
    assert source.startswith("%%ddp"), "exercise 2 runs on the ranks"
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


WRONG = {
    "no all_reduce": ("return torch.tensor([float(rank ** 2)])", "called no dist.all_reduce"),
    "sum of ranks": ("t = torch.tensor([float(rank)])\n    dist.all_reduce(t)\n    return t",
                     "sum of the ranks: square each rank's number"),
    "square of the sum": ("t = torch.tensor([float(rank)])\n    dist.all_reduce(t)\n    return t ** 2",
                          "square of the sum: square before reducing"),
    "max": ("t = torch.tensor([float(rank ** 2)])\n    dist.all_reduce(t, op=dist.ReduceOp.MAX)\n    return t",
            "largest square: the reduction must add"),
    "two all_reduces": ("t = torch.tensor([float(rank ** 2)])\n    dist.all_reduce(t)\n    dist.all_reduce(t)\n"
                        "    return t / world_size", "called dist.all_reduce 2 times: one is enough"),
    "a vector": ("t = torch.zeros(world_size)\n    t[rank] = rank ** 2\n    dist.all_reduce(t)\n    return t",
                 r"returned shape \(4,\): return one number"),
    # the right number (14 on 4 ranks) next to an all-reduce of something else: what was all-reduced is checked
    "14 typed in": ("dist.all_reduce(torch.zeros(1))\n    return torch.tensor(14.0)",
                    r"rank 1 all-reduced 0, not its own square 1: the sum must come out of the all-reduce"),
    "sum computed beside": ("t = torch.tensor([float(rank)])\n    dist.all_reduce(t)\n"
                            "    return torch.tensor(float(sum(r * r for r in range(world_size))))",
                            "rank 2 all-reduced 2, not its own square 4"),
    "right input, answer typed in": ("t = torch.tensor([float(rank ** 2)])\n"
                                     "    dist.all_reduce(t, op=dist.ReduceOp.MAX)\n    return torch.tensor(14.0)",
                                     "returned 14, but the all-reduce gave 9 on rank 0: return the tensor"),
    "only rank 0 reduces": ("t = torch.tensor([float(rank ** 2)])\n    if rank == 0:\n        dist.all_reduce(t)\n"
                            "    return t", "hung: every rank must call dist.all_reduce"),
}


@pytest.mark.parametrize("name", list(WRONG))
def test_typical_wrong_answers_fail_with_a_reason(cluster, name):
    body, reason = WRONG[name]
    cluster.run(f"def sum_of_squares():\n    {body}")
    with pytest.raises(AssertionError, match=reason):
        check_sum_of_squares(cluster=cluster, timeout=5 if name == "only rank 0 reduces" else 60)


def test_a_right_answer_of_the_learners_own_passes(cluster):
    cluster.run("def sum_of_squares():\n    t = torch.tensor(float(rank) ** 2)\n    dist.all_reduce(t)\n    return t")
    check_sum_of_squares(cluster=cluster)


def test_a_slow_check_shows_a_live_status_line_in_a_notebook_and_blanks_it(cluster, monkeypatch):
    """Issue 42: a checker's Cluster.run from a notebook cell shows the %%ddp cell's live status line once it has
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
