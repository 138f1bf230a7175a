"""check_fit_tighter (14_will_it_fit, Going further: "Fit it tighter") against the learner: the untouched scaffold,
a plan that is not sharded and a plan that stays over the 4-unit budget fail, each with its reason; the course's
answer and a right answer written another way pass (MicroFSDP keeps fp32 shards whatever the model's dtype, so
pure bf16 is no plan it can run). Real gloo ranks, W = 4, the lesson's headline model: the over-budget and the
passing plans are measured as the lesson measures them.

    .venv/bin/python -m pytest -n 0 tests/test_checker_fit_tighter.py
"""
import functools
import sys

import pytest

from conftest import register_by_value

register_by_value(sys.modules[__name__])  # the plans below run on the ranks


@pytest.fixture(scope="module")
def cluster(make_cluster):
    return make_cluster(4, timeout=600)


def scaffold(model):
    raise NotImplementedError("wrap model in MicroFSDP with your change")


def unsharded(model):
    return model


def root_freed(model):                       # the change that does not help: the root is not what sets the peak
    from course_utils.fsdp import MicroFSDP

    return MicroFSDP(model, prefetch=False, reshard_root=True)


def _verdicts(names):
    import torch

    from course_utils.checks import check_fit_tighter
    from course_utils.checks.fsdp import solution_fit_tighter
    from course_utils.fsdp import MicroFSDP

    plans = {"scaffold": scaffold, "unsharded": unsharded, "root freed": root_freed,
             "solution": solution_fit_tighter,
             # written another way: a partial, bf16 compute and the root freed too
             "partial": functools.partial(MicroFSDP, prefetch=False, compute_dtype=torch.bfloat16, reshard_root=True)}
    out = {}
    for name in names:
        try:
            out[name] = ("pass", check_fit_tighter(plans[name]))
        except AssertionError as exc:
            out[name] = ("fail", str(exc))
    return out


def test_a_scaffold_and_an_unsharded_plan_fail_before_any_measurement(cluster):
    got = cluster.run(_verdicts, ["scaffold", "unsharded"])
    assert all(r == got[0] for r in got), "every rank gives the same verdict"
    got = got[0]
    assert got["scaffold"][0] == "fail" and "NotImplementedError" in got["scaffold"][1], got
    assert got["unsharded"][0] == "fail" and "not the MicroFSDP" in got["unsharded"][1], got


def test_an_over_budget_plan_fails_with_where_its_peak_sits_and_right_plans_pass(cluster):
    # the course's solution runs in the lesson under nbval; here a right answer written another way
    got = cluster.run(_verdicts, ["root freed", "partial"])
    assert all(r == got[0] for r in got), "every rank gives the same verdict"
    got = got[0]
    state, message = got["root freed"]
    assert state == "fail" and "over the 4-unit budget" in message and "activations" in message, got
    assert "reshard_root=True frees the root" in message, message
    state, message = got["partial"]
    assert state == "pass" and message.startswith("fits: 3.9"), message
    assert "bf16 compute over the fp32 shards" in message, message


def test_the_checker_refuses_a_world_that_is_not_the_lessons(make_cluster):
    def on_two():
        from course_utils.checks import check_fit_tighter
        from course_utils.checks.fsdp import solution_fit_tighter

        try:
            check_fit_tighter(solution_fit_tighter)
        except AssertionError as exc:
            return str(exc)

    assert "4-rank" in make_cluster(2, timeout=60).run(on_two)[0]


def test_the_lessons_cell_runs_the_scaffold_into_the_checker(cluster):
    from exercise_helpers import notebook_cell, run_exercise_cell

    source = notebook_cell("14_will_it_fit.ipynb", "check_fit_tighter(tighter)", solution=False)
    got = cluster.run(run_exercise_cell, source)
    assert all("NotImplementedError" in (message or "") for message in got), got
