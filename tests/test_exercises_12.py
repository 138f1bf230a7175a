"""The self-checks of 12_zero_fsdp's exercises, fed the unmodified scaffold and typical wrong answers (each
must fail with a reason a learner can act on) and the course's solution (which must pass). Real gloo ranks.

    .venv/bin/python -m pytest tests/test_exercises_12.py -p no:randomly
"""
import contextlib
import sys
from fractions import Fraction

import pytest
import torch
import torch.distributed as dist

from conftest import register_by_value
from exercise_helpers import notebook_cell, run_exercise_cell, verdict

register_by_value(sys.modules[__name__])  # the wrong answers below run on the ranks

NOTEBOOK = "12_zero_fsdp.ipynb"


@pytest.fixture(scope="module")
def cluster(make_cluster):
    return make_cluster(4, timeout=120)


# -- exercise 1: ZeRO-1's step (check_zero_step) ------------------------------------------------------


def test_exercise_cell_passes_with_the_solution_and_its_scaffold_fails(cluster):
    source = notebook_cell(NOTEBOOK, "check_zero_step(")
    assert "USE_SOLUTION = True" in source, "the stored notebook must run the course's solution"
    assert "all_gather" not in source and "flatten_grads" not in source, "the scaffold must not hold the answer"
    assert cluster.run(run_exercise_cell, source) == [None] * 4, "the course's solution must pass"
    verdicts = cluster.run(run_exercise_cell, source.replace("USE_SOLUTION = True", "USE_SOLUTION = False"))
    assert len(set(verdicts)) == 1, "every rank must give the same verdict"
    assert verdicts[0] and "not written yet" in verdicts[0] and "NotImplementedError" in verdicts[0], verdicts[0]


def forgets_all_gather(self):
    flat_grad = self.flatten_grads()
    self.shard.grad = flat_grad[self.lo:self.hi]
    self.optimizer.step()
    self.shard.grad = None


def slice_without_padding(self):           # numel // W per rank: the wrong size when W does not divide P
    flat_grad = self.flatten_grads()
    n = self.numel // self.world_size
    self.shard.grad = flat_grad[self.rank * n:(self.rank + 1) * n]
    self.optimizer.step()
    dist.all_gather_single(self.flat, self.shard.detach().clone(), group=self.group)


def rank0_slice_everywhere(self):          # the right length, but always the first slice of the gradient
    flat_grad = self.flatten_grads()
    self.shard.grad = flat_grad[:self.shard_numel].clone()
    self.optimizer.step()
    dist.all_gather_single(self.flat, self.shard.detach().clone(), group=self.group)


def all_reduce_instead_of_all_gather(self):
    flat_grad = self.flatten_grads()
    self.shard.grad = flat_grad[self.lo:self.hi]
    self.optimizer.step()
    dist.all_reduce(self.flat, group=self.group)


def averages_again(self):                  # DDP has already averaged: this sums the gradients once more
    flat_grad = self.flatten_grads()
    dist.all_reduce(flat_grad, group=self.group)
    self.shard.grad = flat_grad[self.lo:self.hi]
    self.optimizer.step()
    dist.all_gather_single(self.flat, self.shard.detach().clone(), group=self.group)


def steps_the_whole_buffer(self):          # a full optimizer over every parameter: right numbers, no sharding
    if not hasattr(self, "full"):
        self.full = self.optimizer_class(self.params, **self.optimizer_kwargs)
    self.full.step()


def zero_padded_all_reduce(self):          # right numbers, but an all-reduce sends twice an all-gather's bytes
    flat_grad = self.flatten_grads()
    self.shard.grad = flat_grad[self.lo:self.hi]
    self.optimizer.step()
    mine = self.flat[self.lo:self.hi].clone()
    self.flat.zero_()
    self.flat[self.lo:self.hi] = mine
    dist.all_reduce(self.flat, group=self.group)


WRONG = {
    forgets_all_gather: ["the other ranks' slices never changed", "All-gather"],
    slice_without_padding: ["raised", "self.lo:self.hi"],
    rank0_slice_everywhere: ["your own slice", "flat_grad[self.lo:self.hi]"],
    all_reduce_instead_of_all_gather: ["added up", "Use an all-gather"],
    averages_again: ["more than", "already averaged"],    # Adam barely notices the scale; the bytes do
    steps_the_whole_buffer: ["bytes of optimizer state", "only self.optimizer"],
    zero_padded_all_reduce: ["more than", "one all-gather"],
}


def _check(step):
    from course_utils.checks import check_zero_step

    return verdict(check_zero_step, step)


@pytest.mark.parametrize("wrong", list(WRONG), ids=[f.__name__ for f in WRONG])
def test_typical_wrong_steps_fail_with_a_reason(cluster, wrong):
    verdicts = cluster.run(_check, wrong)
    assert len(set(verdicts)) == 1, f"the ranks disagree: {verdicts}"
    verdict = verdicts[0]
    assert verdict is not None, f"{wrong.__name__} passed check_zero_step"
    for words in WRONG[wrong]:
        assert words in verdict, f"{wrong.__name__}: expected {words!r} in the verdict: {verdict}"


def test_the_solution_passes(cluster):
    from course_utils.zero import zero1_step

    assert cluster.run(_check, zero1_step) == [None] * 4


# -- exercise 2: FSDP's bytes without resharding (check_fsdp_bytes_prediction) --------------------------

def _fsdp_ratios():
    """FSDP's bytes per step over DDP's, with and without resharding the blocks after forward."""
    import warnings

    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from course_utils.gpt import make_gpt
    from course_utils.zero import count_collectives

    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    x = torch.randint(0, 20, (2, 8), generator=torch.Generator().manual_seed(dist.get_rank()))
    sent = {}
    for reshard in (True, False):
        model = make_gpt(20, seed=0)
        for block in model.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh)
        with count_collectives() as calls:
            F.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
        sent[reshard] = calls.sent()
    ddp = Fraction(2 * (dist.get_world_size() - 1), dist.get_world_size()) * 4 * sum(
        p.numel() for p in make_gpt(20).parameters())
    return Fraction(sent[False]) / ddp, Fraction(sent[True]) / ddp


def test_exercise_2_self_check(cluster):
    from course_utils.checks import check_fsdp_bytes_prediction

    measured, resharded = cluster.run(_fsdp_ratios)[0]
    assert measured == 1, "without resharding, FSDP sends exactly DDP's bytes (the notebook's premise)"
    assert 1 < resharded < Fraction(3, 2)
    scaffold = contextlib.redirect_stdout(None)
    with scaffold:
        assert verdict(check_fsdp_bytes_prediction, None, measured, resharded) is None
    assert "Set prediction" in _printed(check_fsdp_bytes_prediction, None, measured, resharded)
    for wrong, words in [(resharded, "WITH resharding"), (Fraction(3, 2), "WITH resharding"),
                         (Fraction(1, 2), "too little"), (Fraction(2), "too much"), (Fraction(5, 4), "too much")]:
        said = verdict(check_fsdp_bytes_prediction, wrong, measured, resharded)
        assert said and words in said, (wrong, said)
        # a wrong guess gets a reason, never the measured answer
        assert "Measured" not in said and f"{measured} x DDP" not in said, (wrong, said)
    assert verdict(check_fsdp_bytes_prediction, Fraction(1), measured, resharded) is None
    assert verdict(check_fsdp_bytes_prediction, 1.0, measured, resharded) is None   # typed as a float
    assert "Right" in _printed(check_fsdp_bytes_prediction, 1, measured, resharded)


def _printed(fn, *args):
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        fn(*args)
    return out.getvalue()
