"""course_utils.ddp_probes: recorders, overlap arithmetic and plots, checked on real DDP (gloo, 2 ranks)."""
import sys
import time

import pytest
import torch
from torch import nn

from course_utils import ddp_probes
from course_utils.ddp_probes import GradReadyRecorder, overlap, ring_bytes_per_rank, step_time, table

from conftest import register_by_value  # noqa: E402

register_by_value(sys.modules[__name__])  # the ranks cannot import this test module


@pytest.fixture(scope="module")
def cluster2(make_cluster):
    return make_cluster(world_size=2, timeout=60)  # gloo, shared within this module


def stack(width=64, depth=3, seed=0):
    torch.manual_seed(seed)
    layers = [nn.Linear(8, width)]
    for _ in range(depth):
        layers += [nn.ReLU(), nn.Linear(width, width)]
    return nn.Sequential(*layers, nn.ReLU(), nn.Linear(width, 1))


def recording_hook(log, bucket):
    """The hook of 07_buckets_and_overlap, as a learner writes it."""
    import torch.distributed as dist

    rec = {"iteration": log.iteration, "index": bucket.index(), "numel": bucket.buffer().numel(),
           "params": [log.names[id(p)] for p in bucket.parameters()], "start": time.perf_counter()}
    log.records.append(rec)
    log.buffers[bucket.index()] = bucket.buffer()
    fut = dist.all_reduce(bucket.buffer().div_(dist.get_world_size()), async_op=True).get_future()

    def done(f):
        rec["end"] = time.perf_counter()
        return f.value()[0]
    return fut.then(done)


# -- pure helpers ---------------------------------------------------------------------------

def test_ring_bytes_per_rank_is_the_2_n_minus_1_over_n_bound():
    assert ring_bytes_per_rank(1000, 2) == 1000, "2 ranks: each sends S"
    assert ring_bytes_per_rank(1000, 4) == 1500, "4 ranks: 2*3/4 of S"
    assert ring_bytes_per_rank(1000, 1) == 0, "a single rank sends nothing"


def test_table_aligns_numbers_right_and_text_left():
    text = table(["name", "count"], [["a", 1], ["long name", 100]])
    lines = text.splitlines()
    assert lines[0] == "name      | count", lines
    assert set(lines[1]) <= {"-", "+"}, f"second line must be a rule: {lines[1]!r}"
    assert lines[2] == "a         |     1", lines
    assert lines[3] == "long name |   100", lines
    names = table(["bucket", "parameters", "time"], [[0, "14.bias, 14.weight", "1.5 ms"], [1, "0.bias", "12.25 ms"]])
    assert names.splitlines()[3] == "1      | 0.bias             | 12.25 ms", (
        f"parameter names that start with a digit are text (left), timings are numbers (right):\n{names}")


def test_overlap_counts_only_comm_inside_the_compute_window():
    ov = overlap((0.0, 10.0), [(2.0, 4.0), (8.0, 12.0)])
    assert ov["comm_s"] == pytest.approx(6.0)
    assert ov["hidden_s"] == pytest.approx(4.0), "2 s of the first bar and 2 s of the second are inside"
    assert ov["exposed_s"] == pytest.approx(2.0)
    assert ov["hidden_fraction"] == pytest.approx(4 / 6)


def test_overlap_merges_concurrent_all_reduces_instead_of_counting_twice():
    ov = overlap((0.0, 10.0), [(1.0, 5.0), (3.0, 6.0)])
    assert ov["comm_s"] == pytest.approx(5.0), "two overlapping bars cover 1..6, not 4 + 3"
    assert ov["hidden_fraction"] == pytest.approx(1.0)
    assert overlap((0.0, 1.0), [])["hidden_fraction"] == 0.0, "no communication: nothing hidden"


def test_step_parts_add_up_to_the_step():
    tl = {"t0": 0.0, "grads": [("a", 0.010), ("b", 0.030)], "comm": [("bucket 0", 0.010, 0.020),
                                                                    ("bucket 1", 0.025, 0.040)], "end": 0.045}
    parts = ddp_probes.step_parts(tl)
    assert parts["total"] == pytest.approx(0.045) and parts["compute"] == pytest.approx(0.030)
    assert parts["hidden"] == pytest.approx(0.015), "10-20 ms and 25-30 ms ran during backward"
    assert parts["exposed"] == pytest.approx(0.010), "30-40 ms ran after the last gradient"
    assert parts["rest"] == pytest.approx(0.005), "40-45 ms: the step after its communication"
    assert parts["compute"] + parts["exposed"] + parts["rest"] == pytest.approx(parts["total"])


def test_the_typical_step_adds_up_where_medians_part_by_part_do_not():
    """The review's 07 printed medians column by column: a step of 57.1 ms with compute 32.6 and communication
    12.2, which do not add up. The typical step averages every part over the same steps (the middle half by total),
    so its parts add up, and a preempted step is left out."""
    import statistics

    steps = []
    for i, (compute, exposed) in enumerate([(30, 25), (35, 12), (33, 11), (31, 24), (32, 12), (34, 22), (29, 13),
                                            (36, 9)]):
        rest = 1 + i % 3
        steps.append({"total": (compute + exposed + rest) / 1e3, "compute": compute / 1e3, "exposed": exposed / 1e3,
                      "rest": rest / 1e3, "hidden": 0.0, "comm": exposed / 1e3})
    steps.append(dict(steps[0], total=0.500, rest=0.500 - 0.055))     # one preempted step
    medians = {k: statistics.median(s[k] for s in steps) for k in ("total", "compute", "exposed", "rest")}
    assert abs(medians["compute"] + medians["exposed"] + medians["rest"] - medians["total"]) > 1e-3, (
        f"these steps are chosen so that medians part by part do not add up: {medians}")
    typical = ddp_probes.typical_step(steps)
    assert typical["compute"] + typical["exposed"] + typical["rest"] == pytest.approx(typical["total"])
    assert typical["total"] < 0.060, f"the preempted 500 ms step is not part of the typical one: {typical}"
    assert ddp_probes.typical_time([s["total"] for s in steps]) == pytest.approx(typical["total"])
    text = ddp_probes.parts_table({"a run": typical})
    assert "= compute" in text and "+ comm exposed" in text and "+ rest" in text, text


def test_step_time_calls_warmup_plus_n_times_and_returns_the_median():
    calls = []

    def step():
        calls.append(1)
        time.sleep(0.002)
    t = step_time(step, n=5, warmup=2)
    assert len(calls) == 7, f"2 warm-up + 5 timed calls expected, got {len(calls)}"
    assert 0.001 < t < 1.0, f"a 2 ms sleep measured as {t} s"


def test_grad_ready_recorder_sees_backward_order_last_layer_first():
    model = stack()
    rec = GradReadyRecorder(model)
    model(torch.randn(4, 8)).sum().backward()
    names = rec.order()
    assert sorted(names) == sorted(n for n, _ in model.named_parameters()), "one event per parameter"
    assert names[:2] == ["8.bias", "8.weight"], f"the last layer's gradients come first: {names}"
    assert names[-1] == "0.weight", f"the first layer's weight comes last: {names}"
    times = [t for _, t in rec.events]
    assert times == sorted(times), "events are recorded in time order"
    rec.clear()
    rec.remove()
    model(torch.randn(4, 8)).sum().backward()
    assert rec.events == [], "remove() must detach the hooks"


def test_plot_timelines_draws_one_panel_per_timeline():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tl = {"t0": 0.0, "grads": [("a", 0.001), ("b", 0.002)], "comm": [("bucket 0", 0.0015, 0.003)], "end": 0.003}
    fig = ddp_probes.plot_timelines([tl, tl], ["one", "two"])
    assert len(fig.axes) == 2, "one axis per timeline"
    assert [ax.get_title() for ax in fig.axes] == ["one", "two"]
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == ["backward", "bucket 0"]
    plt.close(fig)


# -- on real DDP ----------------------------------------------------------------------------

def _buckets_and_memory():
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from course_utils.ddp_probes import BucketLog, grad_storage, tensors_equal_across_ranks

    out = {}
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(dist.get_rank()))
    for as_view in (False, True):
        model = DDP(stack(width=128), bucket_cap_mb=0.06, gradient_as_bucket_view=as_view)
        log = BucketLog(model)
        model.register_comm_hook(log, recording_hook)
        rec = GradReadyRecorder(model)
        for it in range(3):
            log.iteration = it
            rec.clear()
            model.zero_grad()
            model(x).pow(2).mean().backward()
            if it == 0:
                out["ready0"] = rec.order()
        out[as_view] = grad_storage(model, list(log.buffers.values()))
        out["layouts"] = [log.layout(i) for i in range(3)]
        out["intervals"] = log.intervals(2)
        out["n_params"] = sum(p.numel() for p in model.parameters())
        out["registration"] = [n for n, _ in model.module.named_parameters()]
        out["grads_equal"] = tensors_equal_across_ranks([p.grad for p in model.parameters()])
    out["differs"] = tensors_equal_across_ranks([torch.full((3,), float(dist.get_rank()))])
    return out


@pytest.fixture(scope="module")
def ddp_results(cluster2):
    return cluster2.run(_buckets_and_memory)


def test_bucket_log_sees_one_bucket_then_the_rebuild_in_ready_order(ddp_results):
    for r, out in enumerate(ddp_results):
        first, rebuilt, later = out["layouts"]
        assert len(first) == 1 and first[0][2] == out["registration"], (
            f"rank {r}: iteration 0 should be one bucket with every parameter: {first}")
        assert len(rebuilt) > 1, f"rank {r}: bucket_cap_mb=0.06 must split the model after the rebuild: {rebuilt}"
        assert [n for _, _, names in rebuilt for n in names] == out["ready0"], (
            f"rank {r}: rebuilt buckets should follow the grad-ready order {out['ready0']}: {rebuilt}")
        assert [i for i, _, _ in rebuilt] == list(range(len(rebuilt))), "layout() sorts by bucket index"
        assert sum(n for _, n, _ in rebuilt) == out["n_params"], "the buckets hold every gradient once"
        assert later == rebuilt, f"rank {r}: the rebuild happens once"


def test_bucket_log_intervals_have_start_before_end_in_launch_order(ddp_results):
    for r, out in enumerate(ddp_results):
        iv = out["intervals"]
        assert len(iv) == len(out["layouts"][2]), f"rank {r}: one interval per bucket"
        assert all(a <= b for _, a, b in iv), f"rank {r}: every all-reduce ends after it starts: {iv}"
        assert [a for _, a, _ in iv] == sorted(a for _, a, _ in iv), "intervals() sorts by start time"
        assert [i for i, _, _ in iv] == list(range(len(iv))), f"rank {r}: bucket 0 is launched first: {iv}"


def test_grad_storage_sees_the_copy_that_gradient_as_bucket_view_removes(ddp_results):
    for r, out in enumerate(ddp_results):
        n_bytes = 4 * out["n_params"]
        for as_view in (False, True):
            mem = out[as_view]
            assert mem["grad_bytes"] == n_bytes, f"rank {r}: fp32 gradients are 4 bytes per parameter: {mem}"
            assert mem["bucket_bytes"] == n_bytes, f"rank {r}: the bucket buffers hold every gradient: {mem}"
        assert out[False]["grad_bytes_outside_buckets"] == n_bytes, (
            f"rank {r}: by default each param.grad is a separate copy: {out[False]}")
        assert out[True]["grad_bytes_outside_buckets"] == 0, (
            f"rank {r}: with gradient_as_bucket_view=True every param.grad is a view of a bucket: {out[True]}")


def test_tensors_equal_across_ranks_detects_agreement_and_difference(ddp_results):
    for r, out in enumerate(ddp_results):
        assert out["grads_equal"] is True, f"rank {r}: DDP-averaged gradients must agree across ranks"
        assert out["differs"] is False, f"rank {r}: tensors holding the rank number differ across ranks"
