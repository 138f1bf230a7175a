"""check_lora_linear (16_fine_tuning_small_cards' exercise, LoRALinear): the scaffold and each typical wrong answer
fail with a reason the learner can act on; right answers written differently pass. One process (the bytes on the
wire under DDP are tested on real ranks in tests/test_exercises_16.py).

    .venv/bin/python -m pytest -n 0 tests/test_checker_lora_linear.py
"""
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from course_utils.lora import LoRALinear
from exercise_helpers import verdict


class Scaffold(nn.Module):                      # the notebook's MyLoRALinear, untouched
    def __init__(self, base, r=4, alpha=8):
        super().__init__()
        raise NotImplementedError("write MyLoRALinear.__init__ (see the docstring), then run this cell again")


# ---- wrong answers -------------------------------------------------------------------------------------------------
class IntegerScaling(LoRALinear):               # alpha // r: right whenever r divides alpha
    def __init__(self, base, r=4, alpha=8):
        super().__init__(base, r, alpha)
        self.scaling = alpha // r


class Swapped(LoRALinear):                      # A = 0, B random: equal to the base at init, the wrong way round
    def __init__(self, base, r=4, alpha=8):
        super().__init__(base, r, alpha)
        nn.init.zeros_(self.lora_A.data)
        nn.init.kaiming_uniform_(self.lora_B.data, a=math.sqrt(5))


class BothZero(LoRALinear):
    def __init__(self, base, r=4, alpha=8):
        super().__init__(base, r, alpha)
        nn.init.zeros_(self.lora_A.data)


class BNotZero(LoRALinear):
    def __init__(self, base, r=4, alpha=8):
        super().__init__(base, r, alpha)
        nn.init.normal_(self.lora_B.data, std=0.1)


class ALargeNormal(LoRALinear):
    def __init__(self, base, r=4, alpha=8):
        super().__init__(base, r, alpha)
        nn.init.normal_(self.lora_A.data, std=10.0)


class TwoDimensionalMm(LoRALinear):             # torch.mm takes 2-D input only
    def forward(self, x):
        return self.base(x) + self.scaling * torch.mm(torch.mm(x, self.lora_A.t()), self.lora_B.t())


class TransposedInput(LoRALinear):              # x.t() takes 2-D input only
    def forward(self, x):
        return self.base(x) + self.scaling * (self.lora_B @ (self.lora_A @ x.t())).t()


class NoScaling(LoRALinear):
    def __init__(self, base, r=4, alpha=8):
        super().__init__(base, r, alpha)
        self.scaling = 1.0


class InvertedScaling(LoRALinear):
    def __init__(self, base, r=4, alpha=8):
        super().__init__(base, r, alpha)
        self.scaling = r / alpha


class AlphaOnly(LoRALinear):
    def __init__(self, base, r=4, alpha=8):
        super().__init__(base, r, alpha)
        self.scaling = float(alpha)


class BaseTrainable(LoRALinear):
    def __init__(self, base, r=4, alpha=8):
        super().__init__(base, r, alpha)
        base.weight.requires_grad_(True)


class DetachedUpdate(LoRALinear):
    def forward(self, x):
        return self.base(x) + self.scaling * (x @ self.lora_A.detach().t()) @ self.lora_B.detach().t()


class TransposedShapes(LoRALinear):
    def __init__(self, base, r=4, alpha=8):
        super().__init__(base, r, alpha)
        self.lora_A = nn.Parameter(torch.zeros(base.in_features, r))


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


WRONG = [
    (Scaffold, ["not written yet"]),
    (TransposedShapes, ["lora_A has shape", "r x in_features"]),
    (BNotZero, ["lora_B must start at zero"]),
    (Swapped, ["swapped", "A random", "B at zero", "kaiming_uniform_"]),
    (BothZero, ["lora_A starts at zero", "training never starts", "kaiming_uniform_"]),
    (ALargeNormal, ["standard deviation", "Kaiming uniform", "kaiming_uniform_"]),
    (BaseTrainable, ["must be frozen", "requires_grad_(False)"]),
    (NoScaling, ["scaling alpha / r is missing"]),
    (InvertedScaling, ["inverted"]),
    (AlphaOnly, ["scaled by alpha, not alpha / r"]),
    (IntegerScaling, ["r = 16, alpha = 8", "alpha // r = 0", "integer division", "use alpha / r = 0.5"]),
    (TwoDimensionalMm, ["3-D input", "(batch, tokens, in_features)", "x @ self.lora_A.T", "not torch.mm"]),
    (TransposedInput, ["3-D input", "(batch, tokens, in_features)", "x.t()"]),
    (DetachedUpdate, ["not from a detached copy"]),
    (MergeTransposed, ["B @ A", "not A.T @ B.T"]),
    (MergeWrongScale, ["(alpha / r) * B @ A"]),
    (MergeTwice, ["counted twice"]),
]


@pytest.mark.parametrize("cls, words", WRONG, ids=[c.__name__ for c, _ in WRONG])
def test_wrong_answers_fail_with_their_reason(cls, words):
    from course_utils.checks import check_lora_linear

    got = verdict(check_lora_linear, cls)
    assert got, f"{cls.__name__} must fail check_lora_linear"
    for w in words:
        assert w in got, f"the verdict on {cls.__name__} should mention {w!r}: {got}"


def test_integer_scaling_passes_where_r_divides_alpha():
    """Why the second (r, alpha) is needed: at r = 3, alpha = 6 alone, alpha // r is alpha / r."""
    from course_utils.checks import lora

    layer = IntegerScaling(lora._base(), r=lora.R, alpha=lora.ALPHA)
    x = torch.randn(5, lora.IN)
    assert lora._check_scaled_update(layer, x, lora.R, lora.ALPHA) is not None
    with pytest.raises(AssertionError, match="integer division"):
        lora._check_scaled_update(IntegerScaling(lora._base(), r=lora.R2, alpha=lora.ALPHA2), x, lora.R2, lora.ALPHA2)


# ---- right answers, written differently ----------------------------------------------------------------------------
class WithFLinear(nn.Module):
    """F.linear for both factors, the scaling computed in forward, uniform init written out, a merged flag."""

    def __init__(self, base, r=4, alpha=8):
        super().__init__()
        self.base, self.r, self.alpha = base, r, alpha
        base.requires_grad_(False)
        bound = 1 / math.sqrt(base.in_features)          # kaiming_uniform_(a=sqrt(5)) on an r x in matrix
        self.lora_A = nn.Parameter(torch.empty(r, base.in_features).uniform_(-bound, bound))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, r))
        self.is_merged = False

    def forward(self, x):
        if self.is_merged:
            return self.base(x)
        return self.base(x) + F.linear(F.linear(x, self.lora_A), self.lora_B) * (self.alpha / self.r)

    def merge(self):
        with torch.no_grad():
            self.base.weight.add_(self.lora_B @ self.lora_A, alpha=self.alpha / self.r)
        self.is_merged = True


class WithEinsum(nn.Module):
    """einsum over any leading dimensions, the base's parameters frozen by a loop, merge as a weight.data update."""

    def __init__(self, base, r=4, alpha=8):
        super().__init__()
        for p in base.parameters():
            p.requires_grad = False
        self.base = base
        self.scaling = alpha / r
        self.lora_A = nn.Parameter(torch.empty(r, base.in_features))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, r))
        nn.init.kaiming_uniform_(self.lora_A, a=5 ** 0.5)
        self.done = False

    def forward(self, x):
        out = self.base(x)
        if not self.done:
            out = out + self.scaling * torch.einsum("...i,ri,or->...o", x, self.lora_A, self.lora_B)
        return out

    def merge(self):
        self.base.weight.data += self.scaling * torch.einsum("or,ri->oi", self.lora_B.data, self.lora_A.data)
        self.done = True


class WithMatmulT(nn.Module):
    """x @ A.mT, the update computed as x @ (B @ A).T, peft's attribute names kept as plain parameters."""

    def __init__(self, base, r=4, alpha=8):
        super().__init__()
        self.base = base.requires_grad_(False)
        self.lora_A = nn.Parameter(nn.init.kaiming_uniform_(torch.empty(r, base.in_features), a=math.sqrt(5)))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, r))
        self.scaling = alpha / r
        self.merged = False

    def forward(self, x):
        y = self.base(x)
        return y if self.merged else y + self.scaling * (x @ (self.lora_B @ self.lora_A).mT)

    @torch.no_grad()
    def merge(self):
        self.base.weight.copy_(self.base.weight + self.scaling * self.lora_B @ self.lora_A)
        self.merged = True


@pytest.mark.parametrize("cls", [LoRALinear, WithFLinear, WithEinsum, WithMatmulT],
                         ids=["solution", "F.linear", "einsum", "matmul"])
def test_right_answers_pass(cls, capsys):
    from course_utils.checks import check_lora_linear

    try:
        check_lora_linear(cls)
    except AssertionError as exc:
        raise AssertionError(f"{cls.__name__} is right and must pass: {exc}") from None
    said = capsys.readouterr().out
    assert "check_lora_linear: equal to the base" in said, said
    assert ("the course's solution" in said) == (cls is LoRALinear), said


class BiasAssumed(LoRALinear):                  # freezes base.bias by name: the tiny Llama's projections have none
    def __init__(self, base, r=4, alpha=8):
        super().__init__(base, r, alpha)
        base.bias.requires_grad_(False)


def test_a_class_that_needs_a_bias_is_told_on_the_tiny_llama():
    from course_utils.checks import check_lora_linear

    got = verdict(check_lora_linear, BiasAssumed)
    assert got and "on the tiny Llama" in got and "without a bias" in got, got
