"""Every self-check of the exercises in lessons 01, 02 and 03: the notebook's unmodified scaffold fails it, typical
wrong answers fail it with a reason a learner can act on, and the course's solution passes it.

The scaffolds are taken from the notebooks themselves (the exercise cell, run with ``USE_SOLUTION = False``), so
a scaffold that starts answering its own question is caught here.

    .venv/bin/python -m pytest tests/test_exercises_01_03.py -p no:randomly
"""
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from conftest import register_by_value
from exercise_helpers import notebook_cell
from course_utils.checks import (check_activation_predictions, check_all_reduce, check_all_reduce_in_two_halves,
                                 check_gather_to_rank0, check_optimizer_state_predictions, check_ring_shift,
                                 check_sent_bytes_prediction)
from course_utils.checks import all_reduce as all_reduce_checks
from course_utils.checks.basics import (solution_activation_predictions, solution_all_reduce_in_two_halves,
                                        solution_gather_to_rank0, solution_optimizer_state, solution_ring_shift)

register_by_value(sys.modules[__name__])  # the ranks cannot import this test file


@pytest.fixture(scope="module")
def clusters(make_cluster, request):
    """The 4-rank gloo cluster that the checkers use when a notebook cell calls them without ``clusters=``, and
    the 3-rank one that check_ring_shift also runs on."""
    c4, c3 = make_cluster(world_size=4, timeout=30), make_cluster(world_size=3, timeout=30)
    saved = dict(all_reduce_checks._CLUSTERS)
    all_reduce_checks._CLUSTERS.update({3: c3, 4: c4})
    yield {3: c3, 4: c4}
    all_reduce_checks._CLUSTERS.clear()
    all_reduce_checks._CLUSTERS.update(saved)


def run_scaffold(notebook, marker, namespace):
    """Run the exercise cell unmodified (but with the solution switched off): it must fail its self-check."""
    source = notebook_cell(notebook, marker, solution=False)
    with pytest.raises(AssertionError) as info:
        exec(compile(source, f"{notebook}:exercise", "exec"), namespace)
    return str(info.value)


def expect_failure(check, *args, words=(), **kwargs):
    with pytest.raises(AssertionError) as info:
        check(*args, **kwargs)
    message = str(info.value)
    for w in words:
        assert w in message, f"the self-check's message should mention {w!r}; it was:\n{message}"
    return message


# -- lesson 01 ----------------------------------------------------------------------------------
# The checkers' verdicts on wrong and right answers: tests/test_checker_activation_predictions.py and
# tests/test_checker_optimizer_state_predictions.py. Here: the notebook's wiring, and the myth cell's assert.
@pytest.fixture(scope="module")
def lesson01():
    """What the lesson's cells find in the notebook: one_device, measured, model_state, n_params."""
    from course_utils.data import make_regression
    from course_utils.memory import measure_step_memory
    from course_utils.models import make_model

    x, y = make_regression(n=64, d_in=64, seed=0)
    model = make_model(seed=0, d_in=64, d_hidden=512)
    m64 = measure_step_memory(model, torch.optim.Adam(model.parameters()), F.mse_loss, x, y)
    measured = {(0, n, 64): m64 for n in (1, 2, 4)}   # the world size does not change a rank's memory (lesson 01)
    n_params = sum(p.numel() for p in model.parameters())
    return {"one_device": {64: m64}, "measured": measured, "n_params": n_params,
            "model_state": ("parameters", "gradients", "optimizer_state")}


def test_01_exercise_1_scaffold_fails_and_solution_passes(lesson01):
    ns = {"check_activation_predictions": check_activation_predictions,
          "solution_activation_predictions": solution_activation_predictions, "print": lambda *a: None, **lesson01}
    message = run_scaffold("01_data_parallelism.ipynb", "check_activation_predictions(", ns)
    assert "still None" in message and "act_per_sample" in message, message
    exec(notebook_cell("01_data_parallelism.ipynb", "check_activation_predictions("), ns)
    assert "not the number of devices" in ns["why"], ns["why"]


def test_01_exercise_2_scaffold_fails_and_solution_passes(lesson01):
    ns = {"check_optimizer_state_predictions": check_optimizer_state_predictions,
          "solution_optimizer_state": solution_optimizer_state, "print": lambda *a: None, **lesson01}
    message = run_scaffold("01_data_parallelism.ipynb", "check_optimizer_state_predictions(", ns)
    assert "still None" in message, message
    exec(notebook_cell("01_data_parallelism.ipynb", "check_optimizer_state_predictions("), ns)
    assert "keeps nothing between steps" in ns["why"], ns["why"]


def _myth_cell(lesson01, scale=None):
    """Run section 5's cell (the article's 14 GB against an 8 GiB card) on the measurements, with
    ``scale`` = {(world_size, kind): factor} applied to them first: a wrong measurement must fail its assert."""
    measured = {key: dict(m) for key, m in lesson01["measured"].items()}
    for (n, kind), factor in (scale or {}).items():
        measured[0, n, 64][kind] *= factor
    ns = {**lesson01, "measured": measured, "print": lambda *a: None}
    exec(notebook_cell("01_data_parallelism.ipynb", "article_model = 14e9"), ns)
    return ns


def test_01_the_myth_cell_reads_the_measurement_and_a_wrong_one_fails_it(lesson01):
    ns = _myth_cell(lesson01)
    # the course's one reading: a card sold as "8 GB" has 8 GiB; a model's "14 GB" is 14 x 10^9 bytes (13.04 GiB)
    assert ns["article_model"] == 14e9 and ns["card"] == 8 * 2**30, "the model in bytes, the card in GiB"
    assert abs(ns["per_rank_state"](ns["big_model"], 4) - 14e9) < 1e7, "16 bytes per parameter, measured"
    zero3 = {(4, kind): 1 / 4 for kind in lesson01["model_state"]}       # model state per rank shrinking as 1/W
    no_adam = {(2, "optimizer_state"): 0.0}                               # 8 bytes per parameter: 7 GiB
    for scale, where in ((zero3, "world size 4"), (no_adam, "world size 2")):
        with pytest.raises(AssertionError, match=f"{where}: .* GiB of state per rank would fit the card"):
            _myth_cell(lesson01, scale)


# -- lesson 02 ----------------------------------------------------------------------------------
def _lesson02_namespace():
    return {"dist": dist, "torch": torch, "print": lambda *a: None,
            "check_all_reduce_in_two_halves": check_all_reduce_in_two_halves,
            "check_ring_shift": check_ring_shift, "check_gather_to_rank0": check_gather_to_rank0,
            "solution_all_reduce_in_two_halves": solution_all_reduce_in_two_halves,
            "solution_ring_shift": solution_ring_shift, "solution_gather_to_rank0": solution_gather_to_rank0}


def two_halves_with_all_reduce(x):
    out = x.clone()
    dist.all_reduce(out)
    return out


def reduce_scatter_only(x):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    chunks = list(x.chunk(world_size))
    mine = torch.zeros_like(chunks[rank])
    dist.reduce_scatter(mine, chunks)
    return mine


def gathered_in_reverse(x):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    chunks = list(x.chunk(world_size))
    mine = torch.zeros_like(chunks[rank])
    dist.reduce_scatter(mine, chunks)
    pieces = [torch.zeros_like(c) for c in chunks]
    dist.all_gather(pieces, mine)
    return torch.cat(pieces[::-1])


def gather_whole_and_sum(x):
    """The review's wrong method: all_gather every rank's whole x and add the copies up locally."""
    everyone = [torch.zeros_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, x)
    return sum(everyone)


def gather_whole_by_keyword(x):
    """The same wrong method, the input passed by keyword: all_gather(pieces, tensor=x)."""
    everyone = [torch.zeros_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, tensor=x)
    return sum(everyone)


def gather_whole_all_keywords(x):
    """The same, every argument by keyword, with the flat form."""
    out = torch.zeros(x.numel() * dist.get_world_size(), dtype=x.dtype)
    dist.all_gather_into_tensor(output_tensor=out, input_tensor=x)
    return out.view(dist.get_world_size(), -1).sum(0)


def both_halves_but_gather_whole(x):
    """Calls reduce_scatter for show, then sums whole gathered copies anyway."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    chunks = list(x.chunk(world_size))
    dist.reduce_scatter(torch.zeros_like(chunks[rank]), chunks)
    return gather_whole_and_sum(x)


def flat_halves(x):
    """Right, with the flat forms: reduce_scatter_single, then all_gather_single."""
    world_size = dist.get_world_size()
    mine = torch.zeros(x.numel() // world_size, dtype=x.dtype)
    dist.reduce_scatter_single(mine, x)
    out = torch.zeros_like(x)
    dist.all_gather_single(out, mine)
    return out


def test_02_exercise_1_all_reduce_in_two_halves(clusters):
    message = run_scaffold("02_collectives_sandbox.ipynb", "check_all_reduce_in_two_halves(", _lesson02_namespace())
    assert "NotImplementedError" in message and "write all_reduce_in_two_halves" in message, message
    expect_failure(check_all_reduce_in_two_halves, two_halves_with_all_reduce, clusters=clusters,
                   words=["dist.all_reduce", "reduce_scatter then dist.all_gather"])
    expect_failure(check_all_reduce_in_two_halves, reduce_scatter_only, clusters=clusters,
                   words=["only rank", "reduce-scatter half", "all_gather"])
    expect_failure(check_all_reduce_in_two_halves, gathered_in_reverse, clusters=clusters, words=["rank order"])
    for wrong in (gather_whole_and_sum, gather_whole_by_keyword, gather_whole_all_keywords,
                  both_halves_but_gather_whole):
        expect_failure(check_all_reduce_in_two_halves, wrong, clusters=clusters,
                       words=["all-gathered the whole x", "without its first half", "Gather only the chunk"])
    check_all_reduce_in_two_halves(solution_all_reduce_in_two_halves, clusters=clusters)
    check_all_reduce_in_two_halves(flat_halves, clusters=clusters)


def _exchange(send, right, left):
    buf = torch.zeros_like(send)
    reqs = [dist.isend(send, dst=right), dist.irecv(buf, src=left)]
    for req in reqs:
        req.wait()
    return buf


def shift_one_step(x):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    return _exchange(x, (rank + 1) % world_size, (rank - 1) % world_size)


def shift_sending_own_twice(x):
    """Step 2 sends x again instead of what arrived: ends one place away."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    _exchange(x, (rank + 1) % world_size, (rank - 1) % world_size)
    return _exchange(x, (rank + 1) % world_size, (rank - 1) % world_size)


def shift_the_wrong_way(x):
    """One step with left and right swapped (on 4 ranks, two steps either way land on the same rank)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    return _exchange(x, (rank - 1) % world_size, (rank + 1) % world_size)


def shift_two_steps_the_wrong_way(x):
    """Two steps to the left: on 4 ranks that lands on (rank + 2) % 4 = (rank - 2) % 4, the right tensor."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    first = _exchange(x, (rank - 1) % world_size, (rank + 1) % world_size)
    return _exchange(first, (rank - 1) % world_size, (rank + 1) % world_size)


def shift_two_steps_the_wrong_way_from_any_source(x):
    """Two steps to the left, receiving from any source (irecv without src): only the sends tell the direction."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    send = x
    for _ in range(2):
        buf = torch.zeros_like(x)
        reqs = [dist.isend(send, dst=(rank - 1) % world_size), dist.irecv(buf)]
        for req in reqs:
            req.wait()
        send = buf
    return buf


def shift_hard_coded_for_4_ranks(x):
    """Right on 4 ranks; on 3, rank 2 sends to a rank 3 that does not exist."""
    rank = dist.get_rank()
    first = _exchange(x, (rank + 1) % 4, (rank - 1) % 4)
    return _exchange(first, (rank + 1) % 4, (rank - 1) % 4)


def shift_jumping(x):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    return _exchange(x, (rank + 2) % world_size, (rank - 2) % world_size)


def shift_returning_own(x):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    first = _exchange(x, (rank + 1) % world_size, (rank - 1) % world_size)
    _exchange(first, (rank + 1) % world_size, (rank - 1) % world_size)
    return x


def shift_returning_unfilled_buffer(x):
    """Receives into buffers but returns another that nothing was written to."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    first = _exchange(x, (rank + 1) % world_size, (rank - 1) % world_size)
    _exchange(first, (rank + 1) % world_size, (rank - 1) % world_size)
    return torch.zeros_like(x)


def shift_with_all_gather(x):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    everyone = [torch.zeros_like(x) for _ in range(world_size)]
    dist.all_gather(everyone, x)
    return everyone[(rank - 2) % world_size]


def shift_with_isend_irecv(x):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    first = _exchange(x, (rank + 1) % world_size, (rank - 1) % world_size)
    return _exchange(first, (rank + 1) % world_size, (rank - 1) % world_size)


def test_02_exercise_2_ring_shift(clusters):
    message = run_scaffold("02_collectives_sandbox.ipynb", "check_ring_shift(", _lesson02_namespace())
    assert "NotImplementedError" in message and "write ring_shift" in message, message
    expect_failure(check_ring_shift, shift_one_step, clusters=clusters, words=["one step only", "Step 2"])
    expect_failure(check_ring_shift, shift_sending_own_twice, clusters=clusters, words=["one step only"])
    expect_failure(check_ring_shift, shift_the_wrong_way, clusters=clusters, words=["wrong way", "(rank + 1)"])
    expect_failure(check_ring_shift, shift_jumping, clusters=clusters, words=["neighbours only", "1 message"])
    # right tensor on 4 ranks, wrong direction: caught by the recorded peers (and on 3 ranks by the values)
    for wrong_way in (shift_two_steps_the_wrong_way, shift_two_steps_the_wrong_way_from_any_source):
        expect_failure(check_ring_shift, wrong_way, clusters=clusters,
                       words=["rank 0 sent to rank 3 and received from", "wrong way", "(rank + 1) % world_size"])
    expect_failure(check_ring_shift, shift_hard_coded_for_4_ranks, clusters=clusters,
                   words=["then on 3", "dist.get_world_size()"])
    expect_failure(check_ring_shift, shift_returning_own, clusters=clusters, words=["its own tensor"])
    expect_failure(check_ring_shift, shift_returning_unfilled_buffer, clusters=clusters, words=["req.wait()"])
    expect_failure(check_ring_shift, shift_with_all_gather, clusters=clusters,
                   words=["dist.all_gather", "point-to-point"])
    check_ring_shift(solution_ring_shift, clusters=clusters)
    check_ring_shift(shift_with_isend_irecv, clusters=clusters)


def gather_list_everywhere(x):
    world_size = dist.get_world_size()
    gather_list = [torch.zeros_like(x) for _ in range(world_size)]   # wrong: allocated on every rank
    dist.gather(x, gather_list, dst=0)
    return gather_list


def gather_with_all_gather(x):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    out = [torch.zeros_like(x) for _ in range(world_size)]
    dist.all_gather(out, x)
    return out if rank == 0 else None


def test_02_exercise_3_gather(clusters):
    message = run_scaffold("02_collectives_sandbox.ipynb", "check_gather_to_rank0(", _lesson02_namespace())
    assert "NotImplementedError" in message and "write gather_to_rank0" in message, message
    expect_failure(check_gather_to_rank0, gather_list_everywhere, clusters=clusters,
                   words=["raised ValueError", "gather_list"])
    expect_failure(check_gather_to_rank0, gather_with_all_gather, clusters=clusters,
                   words=["dist.all_gather", "dist.gather(x, gather_list, dst=0)"])
    check_gather_to_rank0(solution_gather_to_rank0, clusters=clusters)


# -- lesson 03 ----------------------------------------------------------------------------------
def test_03_exercise_1_chunked_ring(make_cluster, clusters):
    from course_utils.allreduce import chunked_ring_all_reduce

    all_sizes = {n: make_cluster(world_size=n, timeout=30) for n in (2, 3, 4)}
    source = notebook_cell("03_all_reduce_by_hand.ipynb", "def my_ring_all_reduce(tensor):", solution=False)
    ns = {"dist": dist, "torch": torch, "print": lambda *a: None, "chunked_ring_all_reduce": chunked_ring_all_reduce,
          "check_all_reduce": lambda impl: check_all_reduce(impl, clusters=all_sizes)}
    with pytest.raises(AssertionError) as info:
        exec(compile(source, "03:exercise 1", "exec"), ns)
    assert "NotImplementedError" in str(info.value) and "write the chunked ring" in str(info.value), str(info.value)
    # the checker's rejections (ring_all_reduce, naive_all_reduce, a ring dropping numel % n, ...) are tested once,
    # in test_checker_all_reduce.py: here the notebook's wiring, its scaffold failing and the solution passing
    check_all_reduce(chunked_ring_all_reduce, clusters=all_sizes)


def test_03_exercise_2_sent_bytes_prediction(clusters):
    from course_utils import allreduce

    ns = {"allreduce": allreduce, "check_sent_bytes_prediction": check_sent_bytes_prediction,
          "print": lambda *a: None}
    message = run_scaffold("03_all_reduce_by_hand.ipynb", "check_sent_bytes_prediction(", ns)
    assert "still None" in message, message
    answer = allreduce.chunked_ring_sent_bytes(numel=10, world_size=4, rank=1)
    for wrong, words in [(60, ["2(n-1)/n x S", "3, 3, 2, 2"]), (120, ["whole-tensor ring"]),
                         (answer // 4, ["count of values", "4 bytes"]), (72, ["long one"]),
                         (32, ["one phase only"]), (61, ["schedule of section 4"])]:
        message = expect_failure(check_sent_bytes_prediction, wrong, clusters=clusters, words=words)
        assert str(answer) not in message.replace(f"= {wrong} bytes", ""), f"the answer leaks: {message}"
    check_sent_bytes_prediction(answer, clusters=clusters)
    assert answer == 4 * (3 + 3 + 2) + 4 * (2 + 3 + 3), "rank 1 sends c1, c0, c3, then c2, c1, c0"
