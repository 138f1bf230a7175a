"""The self-check of 16_fine_tuning_small_cards, ``check_lora_linear``, fed the typical wrong answers (each must fail
with a reason a learner can act on) and the course's solution (which must pass). One process, then real gloo ranks
(the base left trainable is caught by its bytes on the wire).

    .venv/bin/python -m pytest tests/test_exercises_16.py -p no:randomly
"""
import sys

import pytest
import torch

from conftest import register_by_value
from course_utils.lora import LoRALinear
from exercise_helpers import notebook_cell, run_exercise_cell, solution_off, verdict

register_by_value(sys.modules[__name__])  # the wrong answers below run on the ranks

NOTEBOOK = "16_fine_tuning_small_cards.ipynb"


class BNotZero(LoRALinear):
    def __init__(self, base, r=4, alpha=8):
        super().__init__(base, r, alpha)
        torch.nn.init.normal_(self.lora_B.data, std=0.1)


class NoScaling(LoRALinear):
    def __init__(self, base, r=4, alpha=8):
        super().__init__(base, r, alpha)
        self.scaling = 1.0


class InvertedScaling(LoRALinear):
    def __init__(self, base, r=4, alpha=8):
        super().__init__(base, r, alpha)
        self.scaling = r / alpha


class BaseTrainable(LoRALinear):
    def __init__(self, base, r=4, alpha=8):
        super().__init__(base, r, alpha)
        base.weight.requires_grad_(True)


class MergeTransposed(LoRALinear):
    @torch.no_grad()
    def merge(self):
        self.base.weight += self.scaling * (self.lora_A.t() @ self.lora_B.t())
        self.merged = True


class MergeWrongScale(LoRALinear):
    @torch.no_grad()
    def merge(self):
        self.base.weight += self.lora_B @ self.lora_A
        self.merged = True


class MergeTwice(LoRALinear):
    @torch.no_grad()
    def merge(self):
        self.base.weight += self.scaling * (self.lora_B @ self.lora_A)   # forgets to stop adding the update


class DetachedUpdate(LoRALinear):
    def forward(self, x):
        return self.base(x) + self.scaling * (x @ self.lora_A.detach().t()) @ self.lora_B.detach().t()


class TransposedShapes(LoRALinear):
    def __init__(self, base, r=4, alpha=8):
        super().__init__(base, r, alpha)
        self.lora_A = torch.nn.Parameter(torch.zeros(base.in_features, r))


class BothZero(LoRALinear):
    def __init__(self, base, r=4, alpha=8):
        super().__init__(base, r, alpha)
        torch.nn.init.zeros_(self.lora_A.data)           # equal to the base at init, but nothing ever trains


class ALargeNormal(LoRALinear):
    def __init__(self, base, r=4, alpha=8):
        super().__init__(base, r, alpha)
        torch.nn.init.normal_(self.lora_A.data, std=10.0)   # random, but at 60 times Kaiming uniform's scale


class Scaffold(torch.nn.Module):
    def __init__(self, base, r=4, alpha=8):
        super().__init__()
        raise NotImplementedError("write MyLoRALinear.__init__")


WRONG = [
    (Scaffold, ["not written yet"]),
    (TransposedShapes, ["lora_A has shape", "r x in_features"]),
    (BNotZero, ["lora_B must start at zero"]),
    (BothZero, ["lora_A starts at zero", "training never starts", "kaiming_uniform_"]),
    (ALargeNormal, ["standard deviation", "Kaiming uniform", "kaiming_uniform_"]),
    (BaseTrainable, ["must be frozen", "requires_grad_(False)"]),
    (NoScaling, ["scaling alpha / r is missing"]),
    (InvertedScaling, ["inverted"]),
    (DetachedUpdate, ["not from a detached copy"]),
    (MergeTransposed, ["B @ A", "not A.T @ B.T"]),
    (MergeWrongScale, ["(alpha / r) * B @ A"]),
    (MergeTwice, ["counted twice"]),
]


@pytest.mark.parametrize("cls, words", WRONG, ids=[c.__name__ for c, _ in WRONG])
def test_check_lora_linear_explains_wrong_answers(cls, words):
    from course_utils.checks import check_lora_linear

    got = verdict(check_lora_linear, cls)
    assert got, f"{cls.__name__} must fail check_lora_linear"
    for w in words:
        assert w in got, f"the verdict on {cls.__name__} should mention {w!r}: {got}"


def test_check_lora_linear_passes_the_solution(capsys):
    from course_utils.checks import check_lora_linear

    check_lora_linear(LoRALinear)
    assert "the course's solution" in capsys.readouterr().out


# -- on real ranks: the bytes on the wire ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster(make_cluster):
    return make_cluster(2, timeout=180)


def _verdict_on_ranks(cls):
    from course_utils.checks import check_lora_linear

    return verdict(check_lora_linear, cls)


def test_base_left_trainable_is_caught_by_its_bytes_on_the_wire(cluster):
    got = cluster.run(_verdict_on_ranks, BaseTrainable)
    for g in got:
        assert g and "under DDP one backward sent" in g and "freeze the base" in g, got


def test_the_notebook_cell_passes_with_the_solution_and_fails_as_the_scaffold(cluster):
    source = notebook_cell(NOTEBOOK, "class MyLoRALinear")
    assert cluster.run(run_exercise_cell, source) == [None, None], "the course's solution must pass"
    got = cluster.run(run_exercise_cell, solution_off(source))
    assert all(g and "not written yet" in g for g in got), got
