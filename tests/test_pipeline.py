"""course_utils.pipeline (15_beyond_data_parallelism): the schedules, the simulator and the runtime, on models the
lesson never shows. A pipelined step's output (the last stage's), its loss and every gradient equal one
process's on 2 and 4 real gloo ranks, under GPipe and 1F1B.

    .venv/bin/python -m pytest tests/test_pipeline.py
"""
import sys

import pytest
import torch

from conftest import register_by_value
from course_utils.pipeline import (Deadlock, OutOfOrder, bubble_fraction, gpipe_schedule, idle_fraction,
                                   one_f_one_b_schedule, sequential_schedule, simulate, split_layers)

register_by_value(sys.modules[__name__])  # the functions below run on the ranks

TOL = dict(rtol=1e-5, atol=1e-5)
SCHEDULES = {"gpipe": gpipe_schedule, "1f1b": one_f_one_b_schedule}


# -- pure functions ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("p", [2, 3, 4, 5])
@pytest.mark.parametrize("m", [1, 2, 4, 7])
def test_gpipe_and_1f1b_have_the_formula_bubble(p, m):
    for schedule in SCHEDULES.values():
        events = simulate([schedule(s, p, m) for s in range(p)], t_forward=1, t_backward=1)
        assert abs(idle_fraction(events) - bubble_fraction(p, m)) < 1e-12, (schedule.__name__, p, m)


def test_unequal_stages_idle_more_than_the_formula_and_the_slowest_sets_the_pace():
    """Per-stage times: with one stage k times slower, GPipe's step is (m + p - 1) slots of the slowest stage at
    best, and the idle fraction rises above (p-1)/(m+p-1); equal per-stage sequences give the formula back."""
    p, m = 4, 8
    schedules = [gpipe_schedule(s, p, m) for s in range(p)]
    equal = simulate(schedules, t_forward=[1, 1, 1, 1], t_backward=[2, 2, 2, 2])
    assert idle_fraction(equal) == pytest.approx(bubble_fraction(p, m))
    tf, tb = [0.1, 1.0, 1.0, 0.3], [0.2, 2.0, 2.0, 0.6]        # the GPT's shape: embedding, block, block, head
    events = simulate(schedules, t_forward=tf, t_backward=tb)
    busy = sum(m * (f + b) for f, b in zip(tf, tb))
    span = max(e[3] for e in events)
    assert idle_fraction(events) == pytest.approx(1 - busy / (p * span))
    assert idle_fraction(events) > bubble_fraction(p, m) + 0.1
    assert span >= m * (1.0 + 2.0), "the slowest stage runs every micro-batch's forward and backward"


def test_the_bubble_formula_is_p_minus_1_over_m_plus_p_minus_1():
    assert bubble_fraction(4, 8) == pytest.approx(3 / 11) and bubble_fraction(2, 1) == pytest.approx(1 / 2)


def _in_flight(actions):
    held = peak = 0
    for kind, _ in actions:
        held += 1 if kind == "F" else -1
        peak = max(peak, held)
    return peak


@pytest.mark.parametrize("p,m", [(2, 8), (4, 8), (4, 3), (5, 16)])
def test_1f1b_holds_at_most_p_minus_s_micro_batches(p, m):
    for s in range(p):
        assert _in_flight(one_f_one_b_schedule(s, p, m)) == min(p - s, m)
        assert _in_flight(gpipe_schedule(s, p, m)) == m


def test_one_by_one_has_no_overlap():
    p, m = 4, 8
    events = simulate([sequential_schedule(s, p, m) for s in range(p)], t_forward=1, t_backward=1)
    assert abs(idle_fraction(events) - (p - 1) / p) < 1e-12


def test_a_circular_wait_is_a_deadlock_and_crossed_orders_are_caught():
    p, m = 3, 2
    schedules = [gpipe_schedule(s, p, m) for s in range(p)]
    schedules[1] = sequential_schedule(1, p, m)                # stage 1 wants gradient 0 before sending activation 1
    with pytest.raises(Deadlock) as exc:
        simulate(schedules)
    want = {0: ("gradient", 0, 1), 1: ("gradient", 0, 2), 2: ("activation", 1, 1)}
    assert exc.value.waiting == want, exc.value.waiting
    schedules = [gpipe_schedule(s, p, m) for s in range(p)]
    schedules[2] = [("F", 0), ("F", 1), ("B", 1), ("B", 0)]    # sends gradient 1 first; stage 1 expects 0
    with pytest.raises(OutOfOrder, match="different orders"):
        simulate(schedules)


def test_split_layers_is_contiguous_and_even():
    assert split_layers(list(range(7)), 3) == [[0, 1, 2], [3, 4], [5, 6]]
    assert split_layers(list(range(4)), 4) == [[0], [1], [2], [3]]
    with pytest.raises(ValueError):
        split_layers([0, 1], 3)


# -- real ranks ------------------------------------------------------------------------------------------------
def _mlp_chain_matches(schedule_name, m):
    """A chain of 8 Linear+Tanh layers of width 10 with an MSE loss (no GPT), cut into world-size stages."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn

    from course_utils.pipeline import ActivationPeak, run_schedule, split_layers

    rank, p = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(3)
    layers = [nn.Sequential(nn.Linear(10, 10), nn.Tanh()) for _ in range(8)]
    reference = nn.Sequential(*[nn.Sequential(nn.Linear(10, 10), nn.Tanh()) for _ in range(8)])
    reference.load_state_dict(nn.Sequential(*layers).state_dict())
    g = torch.Generator().manual_seed(4)
    x, y = torch.randn(6 * m, 10, generator=g), torch.randn(6 * m, 10, generator=g)
    ref_loss = F.mse_loss(reference(x), y)
    ref_loss.backward()
    stage = nn.Sequential(*split_layers(layers, p)[rank])
    outputs = []

    def loss_fn(out, t):                       # keeps the pipeline's output: the last stage's, per micro-batch
        outputs.append(out.detach())
        return F.mse_loss(out, t)

    with ActivationPeak(exclude=stage.parameters()) as meter:
        loss, events = run_schedule(stage, SCHEDULES[schedule_name](rank, p, m), stage=rank, num_stages=p,
                                    inputs=list(x.chunk(m)), targets=list(y.chunk(m)), loss_fn=loss_fn,
                                    act_shape=(6, 10))
    assert meter.live == 0 and meter.peak > 0
    assert len(events) == 2 * m
    if rank == p - 1:
        torch.testing.assert_close(torch.cat(outputs), reference(x).detach(), **TOL)   # forwards run in order
        torch.testing.assert_close(loss, ref_loss.detach(), **TOL)
    else:
        assert loss is None
    offset = sum(len(s) for s in split_layers(list(range(8)), p)[:rank])
    for i, layer in enumerate(stage):
        for q, r in zip(layer.parameters(), reference[offset + i].parameters()):
            torch.testing.assert_close(q.grad, r.grad, **TOL)
    return meter.peak


def _gpt_matches(schedule_name, m):
    """A 6-block GPT with 24 features (the lesson's has 2 blocks of 48), cut into world-size stages."""
    import torch.distributed as dist
    import torch.nn.functional as F

    from course_utils.gpt import make_gpt
    from course_utils.pipeline import gpt_stage, run_schedule

    rank, p = dist.get_rank(), dist.get_world_size()
    kw = dict(block_size=10, n_layer=6, n_head=3, n_embd=24)

    outputs = []

    def loss_fn(logits, t):
        outputs.append(logits.detach())
        return F.cross_entropy(logits.flatten(0, 1), t.flatten())

    g = torch.Generator().manual_seed(9)
    x, y = torch.randint(31, (2 * m, 10), generator=g), torch.randint(31, (2 * m, 10), generator=g)
    reference = make_gpt(31, seed=8, **kw)
    ref_logits = reference(x)
    ref_loss = F.cross_entropy(ref_logits.flatten(0, 1), y.flatten())
    ref_loss.backward()
    model = make_gpt(31, seed=8, **kw)
    stage = gpt_stage(model, rank, p)
    loss, _ = run_schedule(stage, SCHEDULES[schedule_name](rank, p, m), stage=rank, num_stages=p,
                           inputs=list(x.chunk(m)), targets=list(y.chunk(m)), loss_fn=loss_fn, act_shape=(2, 10, 24))
    if rank == p - 1:
        torch.testing.assert_close(torch.cat(outputs), ref_logits.detach(), **TOL)
        torch.testing.assert_close(loss, ref_loss.detach(), **TOL)
    mine = {id(q) for q in stage.parameters()}
    want = dict(reference.named_parameters())
    for name, q in model.named_parameters():
        if id(q) in mine:
            torch.testing.assert_close(q.grad, want[name].grad, **TOL, msg=lambda msg: f"{name}: {msg}")
        else:
            assert q.grad is None, f"{name} is not on stage {rank} but got a gradient"
    covered = [None] * p
    dist.all_gather_object(covered, sorted(n for n, q in model.named_parameters() if id(q) in mine))
    assert sorted(n for names in covered for n in names) == sorted(want), "every parameter on exactly one stage"
    return True


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("schedule_name", list(SCHEDULES))
def test_pipelined_mlp_chain_matches_one_process(make_cluster, world_size, schedule_name):
    peaks = make_cluster(world_size, timeout=120).run(_mlp_chain_matches, schedule_name, 5)
    assert all(peak > 0 for peak in peaks)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("schedule_name", list(SCHEDULES))
def test_pipelined_gpt_matches_one_process(make_cluster, world_size, schedule_name):
    assert make_cluster(world_size, timeout=120).run(_gpt_matches, schedule_name, 3) == [True] * world_size


def test_1f1b_peaks_lower_than_gpipe(make_cluster):
    cluster = make_cluster(4, timeout=120)
    gpipe = cluster.run(_mlp_chain_matches, "gpipe", 8)
    one_f_one_b = cluster.run(_mlp_chain_matches, "1f1b", 8)
    # a middle stage s holds p - s of the m micro-batches; the first stage's inputs and the last stage's targets
    # stay in the caller's lists for the whole step (counted: they are saved for backward too)
    for s in (1, 2):
        assert one_f_one_b[s] * 8 == gpipe[s] * (4 - s), (s, gpipe, one_f_one_b)
    assert one_f_one_b[0] < gpipe[0] and one_f_one_b[3] < gpipe[3] / 2, (gpipe, one_f_one_b)
