"""check_weighted_sync, the self-check of 10_tradeoffs exercise 2 (unequal shares), against the learner: the untouched
scaffold fails, each typical wrong answer fails with a reason that names the mistake, and right answers written
differently pass (another import style, async_op=True then wait(), one flat buffer, ReduceOp.AVG with the right
weights). Each answer replaces the scaffold's body in the notebook's own exercise cell and runs on 2 gloo ranks.

    .venv/bin/python -m pytest -n 0 tests/test_checker_weighted_sync.py
"""
import pytest

from course_utils import DistributedError
from exercise_helpers import notebook_cell, solution_off

SCAFFOLD = '    raise NotImplementedError("write my_weighted_sync'


@pytest.fixture(scope="module")
def cluster(make_cluster):
    cluster = make_cluster(2, timeout=60)
    cluster.run("import torch\nimport torch.distributed as dist")   # as the lesson's first %%ddp cell does
    return cluster


def exercise(body=None):
    """The notebook's exercise cell as the ranks run it: USE_SOLUTION off, the scaffold's body replaced by ``body``."""
    source = notebook_cell("10_tradeoffs.ipynb", "check_weighted_sync", ddp_line=False)
    if body is None:
        return source
    source = solution_off(source)
    old = next(line for line in source.splitlines() if line.startswith(SCAFFOLD))
    return source.replace(old, body, 1)


def verdict(cluster, source):
    """None if the cell passed on every rank, else the error's text."""
    try:
        cluster.run(source)
    except DistributedError as exc:
        return str(exc)
    return None


def test_the_stored_cell_passes_with_the_course_solution(cluster):
    assert verdict(cluster, exercise()) is None


def test_the_untouched_scaffold_fails(cluster):
    message = verdict(cluster, solution_off(exercise()))
    assert message is not None and "NotImplementedError" in message and "write my_weighted_sync" in message, message


WRONG = {
    "nothing all-reduced": ("    pass", "nothing was all-reduced"),
    "plain average (lesson 05)": (
        "    for p in model.parameters():\n"
        "        dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)", "equal weights"),
    "sum / world_size": (
        "    for p in model.parameters():\n"
        "        dist.all_reduce(p.grad)\n"
        "        p.grad /= world_size", "equal weights"),
    "sum, never divided": (
        "    for p in model.parameters():\n"
        "        dist.all_reduce(p.grad)", "never divided"),
    "weighted, divided by the ranks": (
        "    for p in model.parameters():\n"
        "        p.grad *= n_local\n"
        "        dist.all_reduce(p.grad)\n"
        "        p.grad /= world_size", "divided by the number of ranks"),
    "weighted, never divided": (
        "    for p in model.parameters():\n"
        "        p.grad *= n_local\n"
        "        dist.all_reduce(p.grad)", "never divided by the total"),
    "the first trial's total as a number": (
        "    for p in model.parameters():\n"
        "        p.grad *= n_local / 32\n"
        "        dist.all_reduce(p.grad)", "first trial's, written as a number"),
}


@pytest.mark.parametrize("case", list(WRONG))
def test_a_wrong_answer_fails_with_its_reason(cluster, case):
    body, reason = WRONG[case]
    message = verdict(cluster, exercise(body))
    assert message is not None and reason in message, f"{case}: expected {reason!r} in\n{message}"


RIGHT = {
    "imported by name": (
        "    from torch.distributed import all_reduce\n"
        "    total = torch.tensor([float(n_local)])\n"
        "    all_reduce(total)\n"
        "    for p in model.parameters():\n"
        "        p.grad.mul_(n_local / total.item())\n"
        "        all_reduce(p.grad)"),
    "async_op=True then wait()": (
        "    total = torch.tensor([n_local], dtype=torch.float64)\n"
        "    dist.all_reduce(total, async_op=True).wait()\n"
        "    works = []\n"
        "    for p in model.parameters():\n"
        "        p.grad *= n_local\n"
        "        works.append(dist.all_reduce(p.grad, async_op=True))\n"
        "    for w in works:\n"
        "        w.wait()\n"
        "    for p in model.parameters():\n"
        "        p.grad /= total.item()"),
    "one flat buffer": (
        "    grads = [p.grad for p in model.parameters()]\n"
        "    flat = torch.cat([g.reshape(-1) * n_local for g in grads] + [torch.tensor([float(n_local)])])\n"
        "    dist.all_reduce(flat)\n"
        "    flat = flat[:-1] / flat[-1]\n"
        "    for g, chunk in zip(grads, flat.split([g.numel() for g in grads])):\n"
        "        g.copy_(chunk.view_as(g))"),
    "ReduceOp.AVG, weighted": (
        "    total = torch.tensor([float(n_local)])\n"
        "    dist.all_reduce(total)\n"
        "    for p in model.parameters():\n"
        "        p.grad *= n_local * world_size / total.item()\n"
        "        dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)"),
}


@pytest.mark.parametrize("case", list(RIGHT))
def test_a_right_answer_written_differently_passes(cluster, case):
    assert verdict(cluster, exercise(RIGHT[case])) is None, case
