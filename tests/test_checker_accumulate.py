"""check_accumulate, the self-check of 06_ddp_accumulation_no_sync exercise 2 (micro-batches of unequal size, one
all-reduce set by require_backward_grad_sync), against the learner: the untouched scaffold fails, each typical
wrong answer fails with a reason that names its mistake (the flag set after the forward is blamed on its
placement, a flag True at the first micro-step is not), and right answers written differently pass (another
import style, summed errors over the rank's samples, the flag set once before the loop and flipped at the last
micro-step). Each answer replaces the scaffold's body in the notebook's own exercise cell; 2 gloo ranks, one
cluster for the module.

    .venv/bin/python -m pytest -n 0 tests/test_checker_accumulate.py
"""
import pytest

from exercise_helpers import notebook_cell, run_exercise_cell

SCAFFOLD = '    raise NotImplementedError("exercise 2: write accumulate")'


@pytest.fixture(scope="module")
def cluster(make_cluster):
    return make_cluster(2, timeout=60)


def exercise(body=None):
    """The notebook's exercise cell with USE_SOLUTION off and the scaffold's body replaced by ``body``."""
    source = notebook_cell("06_ddp_accumulation_no_sync.ipynb", "check_accumulate(accumulate)", ddp_line=False,
                           solution=False)
    assert SCAFFOLD in source, "the scaffold's body is no longer in the exercise cell"
    return source if body is None else source.replace(SCAFFOLD, body, 1)


def verdicts(cluster, source):
    both = cluster.run(run_exercise_cell, source)
    assert both[0] == both[1], f"both ranks must reach the same verdict: {both}"
    return both[0]


def test_the_stored_cell_passes_with_the_course_solution(cluster):
    source = notebook_cell("06_ddp_accumulation_no_sync.ipynb", "check_accumulate(accumulate)", ddp_line=False)
    assert verdicts(cluster, source) is None


def test_the_untouched_scaffold_fails(cluster):
    message = verdicts(cluster, exercise())
    assert message and "accumulate is not written yet (exercise 2: write accumulate)" in message, message


WRONG = {  # name: (body, words the reason must hold)
    "the flag set after the forward (build-nanogpt)": (
        "    import torch.nn.functional as F\n"
        "    for k, (xb, yb) in enumerate(batches):\n"
        "        loss = F.mse_loss(model(xb), yb) / len(batches)\n"
        "        model.require_backward_grad_sync = k == len(batches) - 1\n"
        "        loss.backward()", "you set it AFTER the forward"),
    "True at the first micro-step": (
        "    import torch.nn.functional as F\n"
        "    for k, (xb, yb) in enumerate(batches):\n"
        "        model.require_backward_grad_sync = k == 0\n"
        "        (F.mse_loss(model(xb), yb) / len(batches)).backward()", "True at the FIRST micro-step"),
    "the flag never set": (
        "    import torch.nn.functional as F\n"
        "    for xb, yb in batches:\n"
        "        (F.mse_loss(model(xb), yb) / len(batches)).backward()", "The flag was True at every forward"),
    "the flag never True": (
        "    import torch.nn.functional as F\n"
        "    model.require_backward_grad_sync = False\n"
        "    for xb, yb in batches:\n"
        "        (F.mse_loss(model(xb), yb) / len(batches)).backward()", "the last micro-step must sync"),
    "each loss divided by K (equal micro-batches)": (
        "    import torch.nn.functional as F\n"
        "    for k, (xb, yb) in enumerate(batches):\n"
        "        model.require_backward_grad_sync = k == len(batches) - 1\n"
        "        (F.mse_loss(model(xb), yb) / len(batches)).backward()", "weighs every micro-batch alike"),
    "no weighting at all": (
        "    import torch.nn.functional as F\n"
        "    for k, (xb, yb) in enumerate(batches):\n"
        "        model.require_backward_grad_sync = k == len(batches) - 1\n"
        "        F.mse_loss(model(xb), yb).backward()", "the losses are not weighted at all"),
    "no_sync() instead of the flag": (
        "    import contextlib\n"
        "    import torch.nn.functional as F\n"
        "    n = sum(len(xb) for xb, _ in batches)\n"
        "    for k, (xb, yb) in enumerate(batches):\n"
        "        with contextlib.nullcontext() if k == len(batches) - 1 else model.no_sync():\n"
        "            (len(xb) / n * F.mse_loss(model(xb), yb)).backward()", "setting model.require_backward_grad_sync"),
    "a forward too many": (
        "    import torch.nn.functional as F\n"
        "    n = sum(len(xb) for xb, _ in batches)\n"
        "    model.require_backward_grad_sync = False\n"
        "    model(batches[0][0])\n"
        "    for k, (xb, yb) in enumerate(batches):\n"
        "        model.require_backward_grad_sync = k == len(batches) - 1\n"
        "        (len(xb) / n * F.mse_loss(model(xb), yb)).backward()", "one forward and one backward per micro-batch"),
}


@pytest.mark.parametrize("case", list(WRONG))
def test_a_wrong_answer_fails_with_its_reason(cluster, case):
    body, words = WRONG[case]
    message = verdicts(cluster, exercise(body))
    assert message and words in message, f"{case}: expected {words!r} in\n{message}"
    if not case.startswith("the flag set after"):
        assert "AFTER the forward" not in message, f"{case} sets the flag before the forward:\n{message}"


RIGHT = {
    "summed errors, imported by name": (
        "    from torch.nn.functional import mse_loss\n"
        "    total = sum(xb.shape[0] for xb, _ in batches)\n"
        "    for k, (xb, yb) in enumerate(batches):\n"
        "        model.require_backward_grad_sync = k + 1 == len(batches)\n"
        "        (mse_loss(model(xb), yb, reduction='sum') / total).backward()"),
    "the flag set once, flipped at the last micro-step": (
        "    import torch.nn.functional as F\n"
        "    n = sum(len(x) for x, _ in batches)\n"
        "    model.require_backward_grad_sync = False\n"
        "    for k, (xb, yb) in enumerate(batches):\n"
        "        if k == len(batches) - 1:\n"
        "            model.require_backward_grad_sync = True\n"
        "        loss = F.mse_loss(model(xb), yb) * (len(xb) / n)\n"
        "        loss.backward()"),
}


@pytest.mark.parametrize("case", list(RIGHT))
def test_a_right_answer_written_differently_passes(cluster, case):
    assert verdicts(cluster, exercise(RIGHT[case])) is None, case
