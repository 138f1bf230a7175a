"""course_utils.checks.tour.check_sum_of_squares (lesson 00, exercise 1) against the learner, on 4 real gloo ranks: the
untouched scaffold fails, each typical wrong answer fails with a reason that fits the exercise, and right answers
written in other ways pass (three ways to name the all-reduce, the process group's own allreduce, functional
collectives, async_op=True then wait(), an explicit ReduceOp.SUM, a Python number returned).

    .venv/bin/python -m pytest -n 0 tests/test_checker_sum_of_squares.py
"""
import pytest

from course_utils.checks import check_sum_of_squares
from exercise_helpers import notebook_cell


@pytest.fixture
def cluster(make_cluster):
    c = make_cluster(4, timeout=60)
    c.run("globals().pop('sum_of_squares', None)\nimport torch, torch.distributed as dist")
    return c


def define(cluster, body, imports=""):
    """Define sum_of_squares on the ranks as a learner's %%ddp cell would: ``imports`` at the top of the cell."""
    cluster.run(f"{imports}\ndef sum_of_squares():\n    {body}")


def test_the_untouched_scaffold_fails(cluster):
    scaffold = notebook_cell("00_launcher_tour.ipynb", "def sum_of_squares", ddp_line=False)
    cluster.run(scaffold)
    with pytest.raises(AssertionError, match="still raises NotImplementedError: write it"):
        check_sum_of_squares(cluster=cluster)


SQUARE = "t = torch.tensor([float(rank ** 2)])\n    "

WRONG = {
    # the case: a correct all-reduce, then a number typed in beside it
    "return 5.0 after a correct all-reduce": (
        SQUARE + "dist.all_reduce(t)\n    return 5.0",
        "returned 5, but its all-reduce gave 14 on every rank: return the tensor"),
    "no all-reduce": ("return torch.tensor([float(rank ** 2)])", "called no all-reduce on some rank: each rank knows"),
    "all-gather instead": ("out = [torch.zeros(1) for _ in range(world_size)]\n"
                           "    dist.all_gather(out, torch.tensor([float(rank ** 2)]))\n    return sum(out)",
                           r"called no all-reduce on some rank \(it called dist.allgather\)"),
    "sum of ranks": ("t = torch.tensor([float(rank)])\n    dist.all_reduce(t)\n    return t",
                     "each rank all-reduced its own rank number, so the sum is 6, the sum of the ranks: square"),
    "square of the sum": ("t = torch.tensor([float(rank)])\n    dist.all_reduce(t)\n    return t ** 2",
                          "square of the sum: square each rank's number before reducing"),
    "max": (SQUARE + "dist.all_reduce(t, op=dist.ReduceOp.MAX)\n    return t",
            "the all-reduce gave 9, the largest square: the reduction must add"),
    "product": (SQUARE + "dist.all_reduce(t, op=dist.ReduceOp.PRODUCT)\n    return t",
                "the all-reduce of the squares gave 0 on rank 0, not their sum: reduce with op=dist.ReduceOp.SUM"),
    "two all-reduces": (SQUARE + "dist.all_reduce(t)\n    dist.all_reduce(t)\n    return t / world_size",
                        "called an all-reduce 2 times: one is enough"),
    "a vector": ("t = torch.zeros(world_size)\n    t[rank] = rank ** 2\n    dist.all_reduce(t)\n    return t",
                 r"returned shape \(4,\): return one number"),
    "14 typed in beside an all-reduce of zeros": ("dist.all_reduce(torch.zeros(1))\n    return torch.tensor(14.0)",
                                                  "rank 1 all-reduced 0, not its own square 1: the sum must come out"),
    "the sum computed beside an all-reduce of the ranks": (
        "t = torch.tensor([float(rank)])\n    dist.all_reduce(t)\n"
        "    return torch.tensor(float(sum(r * r for r in range(world_size))))",
        "each rank all-reduced its own rank number"),
    "an all-reduce of something else": ("t = torch.tensor([float(rank ** 2 + 1)])\n    dist.all_reduce(t)\n"
                                         "    return t - world_size",
                                         "rank 0 all-reduced 1, not its own square 0"),
    "only rank 0 reduces": (SQUARE + "if rank == 0:\n        dist.all_reduce(t)\n    return t",
                            "hung: every rank must call the all-reduce"),
    "returns nothing": (SQUARE + "dist.all_reduce(t)", "returned a NoneType: return a tensor"),
}


@pytest.mark.parametrize("name", list(WRONG))
def test_a_typical_wrong_answer_fails_with_a_reason(cluster, name):
    body, reason = WRONG[name]
    define(cluster, body)
    with pytest.raises(AssertionError, match=reason):
        check_sum_of_squares(cluster=cluster, timeout=5 if name == "only rank 0 reduces" else 60)


RIGHT = {
    "import torch.distributed as dist": ("", SQUARE + "dist.all_reduce(t)\n    return t"),
    "from torch.distributed import all_reduce": ("from torch.distributed import all_reduce",
                                                 SQUARE + "all_reduce(t)\n    return t"),
    "distributed_c10d.all_reduce": ("from torch.distributed import distributed_c10d as c10d",
                                    SQUARE + "c10d.all_reduce(t)\n    return t"),
    "the process group's allreduce": ("", SQUARE + "dist.group.WORLD.allreduce([t]).wait()\n    return t"),
    "functional collectives": ("import torch.distributed._functional_collectives as funcol",
                               SQUARE + "return funcol.all_reduce(t, 'sum', dist.group.WORLD)"),
    "async_op=True then wait()": ("", SQUARE + "work = dist.all_reduce(t, async_op=True)\n    work.wait()\n"
                                      "    return t"),
    "ReduceOp.SUM on a 0-d tensor, returned as a number": (
        "", "t = torch.tensor(float(rank) ** 2)\n    dist.all_reduce(t, op=dist.ReduceOp.SUM)\n    return t.item()"),
    "an int tensor": ("", "t = torch.tensor([rank * rank])\n    dist.all_reduce(t)\n    return t"),
}


@pytest.mark.parametrize("name", list(RIGHT))
def test_a_right_answer_written_another_way_passes(cluster, name):
    imports, body = RIGHT[name]
    define(cluster, body, imports)
    check_sum_of_squares(cluster=cluster)


def test_the_course_solution_passes(cluster):
    check_sum_of_squares(use_solution=True, cluster=cluster)
