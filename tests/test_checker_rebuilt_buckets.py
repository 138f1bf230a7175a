"""07's exercise 1 (how many buckets after the rebuild with bucket_cap_mb=0.25?): check_rebuilt_buckets fed the
scaffold, the typical wrong counts and right answers written differently, against the layouts DDP really builds
(gloo, 2 ranks)."""
import re
import sys

import pytest
import torch
import torch.distributed as dist

from course_utils.checks import check_rebuilt_buckets
from course_utils.checks.buckets import solution_rebuilt_buckets

from conftest import register_by_value
register_by_value(sys.modules[__name__])  # the ranks cannot import this test module


def deep_mlp_layouts():
    """On a rank: the rebuilt layouts of 07's deep_mlp() with bucket_cap_mb=0.25 and with 0.5 (section 2)."""
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from course_utils.ddp_probes import BucketLog

    def deep_mlp(width=256, depth=6, d_in=32, seed=0):  # as lesson 07 defines it
        torch.manual_seed(seed)
        layers = [nn.Linear(d_in, width), nn.ReLU()]
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.ReLU()]
        return nn.Sequential(*layers, nn.Linear(width, 1))

    def hook(log, bucket):
        log.records.append({"iteration": log.iteration, "index": bucket.index(), "numel": bucket.buffer().numel(),
                            "params": [log.names[id(p)] for p in bucket.parameters()]})
        fut = dist.all_reduce(bucket.buffer().div_(dist.get_world_size()), async_op=True).get_future()
        return fut.then(lambda f: f.value()[0])

    layouts = []
    for cap in (0.25, 0.5):
        model = DDP(deep_mlp(), bucket_cap_mb=cap)
        log = BucketLog(model)
        model.register_comm_hook(log, hook)
        x = torch.randn(64, 32, generator=torch.Generator().manual_seed(dist.get_rank()))
        for it in range(2):
            log.iteration = it
            model(x).pow(2).mean().backward()
        layouts.append(log.layout(1))
    return layouts


@pytest.fixture(scope="module")
def layouts(make_cluster):
    return make_cluster(world_size=2, timeout=60).run(deep_mlp_layouts)[0]


def verdict(predicted, layouts):
    small, section = layouts
    try:
        check_rebuilt_buckets(predicted, small, cap_mb=0.25, section_layout=section)
    except AssertionError as exc:
        return str(exc)
    return "passed"


def test_the_solution_is_what_ddp_builds(layouts, capsys):
    assert len(layouts[0]) == solution_rebuilt_buckets()
    assert verdict(solution_rebuilt_buckets(), layouts) == "passed"
    out = capsys.readouterr().out
    assert "self-check passed" in out and str(solution_rebuilt_buckets()) not in out, "never prints the number"


@pytest.mark.parametrize("predicted", [7, 7.0, "7", torch.tensor(7)])
def test_right_answers_written_differently_pass(layouts, predicted):
    assert verdict(predicted, layouts) == "passed"


@pytest.mark.parametrize("predicted, reason", [
    (None, r"predicted_buckets is still None: write the number"),
    ("seven", r"must be a number of buckets, got 'seven'"),
    (1, r"one bucket is iteration 0's layout.* the rebuilt one"),
    (4, r"section 2's count, with twice the cap.* exactly 0.25 MiB"),
    (8, r"Halving the cap does not simply double"),
    (6, r"total size / cap \(1.54 MiB / 0.25 MiB\).* never splits a tensor"),
    (3, r"not the number DDP built. Walk backward's ready order"),
])
def test_wrong_answers_fail_with_a_hint(layouts, predicted, reason):
    message = verdict(predicted, layouts)
    assert re.search(reason, message), message
    assert "7" not in message.replace("0.25", ""), f"the hint gives the number away: {message}"
