"""The self-checks of 13_fsdp_by_hand, fed the typical wrong answers (each must fail with a reason a learner can
act on) and the course's solution (which must pass). Real gloo ranks.

    .venv/bin/python -m pytest tests/test_exercises_13.py -p no:randomly
"""
import sys

import pytest
import torch
import torch.distributed as dist

from conftest import register_by_value
from course_utils.fsdp import MicroFSDP
from exercise_helpers import verdict

register_by_value(sys.modules[__name__])  # the wrong answers below run on the ranks

NOTEBOOK = "13_fsdp_by_hand.ipynb"


@pytest.fixture(scope="module")
def cluster(make_cluster):
    return make_cluster(2, timeout=120)


# -- check_pad_and_shard ------------------------------------------------------------------------------

def pad_no_padding(tensors, rank, world_size):       # the last rank gets a shorter slice
    flat = torch.cat([t.reshape(-1).float() for t in tensors])
    n = -(-flat.numel() // world_size)
    return flat[rank * n:(rank + 1) * n].clone(), flat.numel()


def pad_at_front(tensors, rank, world_size):
    flat = torch.cat([t.reshape(-1).float() for t in tensors])
    padded = -(-flat.numel() // world_size) * world_size
    flat = torch.nn.functional.pad(flat, (padded - flat.numel(), 0))
    n = padded // world_size
    return flat[rank * n:(rank + 1) * n].clone(), padded


def pad_strided(tensors, rank, world_size):          # every W-th element: not a contiguous slice
    flat = torch.cat([t.reshape(-1).float() for t in tensors])
    padded = -(-flat.numel() // world_size) * world_size
    flat = torch.nn.functional.pad(flat, (0, padded - flat.numel()))
    return flat[rank::world_size].clone(), padded


def pad_a_view(tensors, rank, world_size):           # no copy: shares memory with the model
    flat = tensors[0].reshape(-1) if len(tensors) == 1 else torch.cat([t.reshape(-1).float() for t in tensors])
    padded = -(-flat.numel() // world_size) * world_size
    n = padded // world_size
    if padded == flat.numel():
        return flat[rank * n:(rank + 1) * n], padded
    flat = torch.nn.functional.pad(flat, (0, padded - flat.numel()))
    return flat[rank * n:(rank + 1) * n].clone(), padded


@pytest.mark.parametrize("fn, words", [
    (pad_no_padding, ["padded length", "smallest multiple of W"]),
    (pad_at_front, ["pad with zeros at the END"]),
    (pad_strided, ["contiguous slice"]),
    (pad_a_view, ["shares memory", "copy"]),
], ids=["no-padding", "front-padding", "strided", "a-view"])
def test_check_pad_and_shard_explains_wrong_answers(fn, words):
    from course_utils.checks import check_pad_and_shard

    got = verdict(check_pad_and_shard, fn)
    assert got, f"{fn.__name__} must fail check_pad_and_shard"
    for w in words:
        assert w in got, f"the verdict on {fn.__name__} should mention {w!r}: {got}"


def test_check_pad_and_shard_passes_the_solution():
    from course_utils.checks import check_pad_and_shard
    from course_utils.fsdp import pad_and_shard

    assert verdict(check_pad_and_shard, pad_and_shard) is None


# -- check_micro_fsdp: the typical wrong MicroFSDPs ---------------------------------------------------------

class NotFreed(MicroFSDP):
    """Keeps every gathered unit from forward to backward: right numbers, full memory."""

    def post_forward(self, unit, out):
        if unit.state != "backward" and torch.is_grad_enabled():
            self._hook_outputs(unit, out)
        return out


class NotRegathered(MicroFSDP):
    """Frees after forward, never gathers again for backward."""

    def pre_backward(self, unit):
        unit.state = "backward"
        self._queue_finish()


class AllReduced(MicroFSDP):
    """All-reduces the full gradient and keeps its own slice: right numbers, twice the gradient memory."""

    def post_backward(self, unit):
        if unit.reduced:
            return
        unit.reduced = True
        for flat in unit.trainable:
            grad = flat.flat_grad() / self.world_size
            dist.all_reduce(grad, group=self.group)
            n = flat.shard.numel()
            mine = grad[self.rank * n:(self.rank + 1) * n].clone()
            flat.shard.grad = mine if flat.shard.grad is None else flat.shard.grad + mine
            for view in flat.views:
                view.grad = None
        if unit is not self.root:
            self._free(unit)


class NotDivided(MicroFSDP):
    """Reduce-scatters the SUM."""

    def post_backward(self, unit):
        ws = self.world_size
        self.world_size = 1
        try:
            super().post_backward(unit)
        finally:
            self.world_size = ws


class Stale(MicroFSDP):
    """Gathers from copies of the shards taken at construction: the optimizer's updates never reach forward."""

    def __init__(self, module, **kwargs):
        super().__init__(module, **kwargs)
        self.copies = {id(f): f.shard.detach().clone() for u in self.units for f in u.flats}

    def start_gather(self, unit):
        if unit.gathered or unit.pending is not None:
            return
        unit.pending = []
        for f in unit.flats:
            f.alloc()
            low = self.copies[id(f)].to(f.compute_dtype)
            unit.pending.append((dist.all_gather_single(f.full.data, low, group=self.group, async_op=True), low))


class TiedTwice(MicroFSDP):
    """Collects the parameters by name, not by identity: the tied embedding/head is stored (and trained) twice."""

    @staticmethod
    def collect(module, prefixes):
        from course_utils.fsdp import _owner_unit

        per_unit = [[] for _ in range(len(prefixes) + 1)]
        for mod_name, mod in module.named_modules():
            for attr, p in mod._parameters.items():
                if p is None:
                    continue
                fqn = f"{mod_name}.{attr}" if mod_name else attr
                per_unit[_owner_unit(fqn, prefixes)].append((fqn, p, [(mod, attr)]))
        return per_unit


class _Synchronous(MicroFSDP):
    """The learner's post_backward of lesson 13 (a blocking reduce-scatter), with one of its duties switchable."""
    frees, drops_grads, adds = True, True, True

    def post_backward(self, unit):
        if unit.reduced:
            return
        unit.reduced = True
        for flat in unit.trainable:
            grad = flat.flat_grad() / self.world_size
            mine = torch.empty_like(flat.shard)
            dist.reduce_scatter_single(mine, grad, group=self.group)
            if self.adds and flat.shard.grad is not None:
                flat.shard.grad += mine
            else:
                flat.shard.grad = mine
            if self.drops_grads:
                for view in flat.views:
                    view.grad = None
        if unit is not self.root and self.frees:
            for flat in unit.flats:
                flat.free()


class KeepsGathered(_Synchronous):
    """Never frees a unit's gathered weights in post_backward (only _finish does, at the end of backward)."""
    frees = False


class KeepsViewGrads(_Synchronous):
    """Reduce-scatters, but leaves the full-size gradients in the views."""
    drops_grads = False


class Overwrites(_Synchronous):
    """shard.grad = mine every time: accumulation keeps only the last micro-batch."""
    adds = False


def _micro_fsdp_verdict(kind):
    from course_utils.checks import check_micro_fsdp

    makers = {"not-freed": NotFreed, "not-regathered": NotRegathered, "all-reduced": AllReduced,
              "not-divided": NotDivided, "stale": Stale, "tied-twice": TiedTwice, "solution": MicroFSDP,
              "no-prefetch": lambda m: MicroFSDP(m, prefetch=False), "keeps-gathered": KeepsGathered,
              "keeps-view-grads": KeepsViewGrads, "overwrites": Overwrites, "synchronous": _Synchronous}
    return verdict(check_micro_fsdp, makers[kind])


@pytest.mark.parametrize("kind, words", [
    ("not-freed", ["after forward", "still held", "Free a unit's gathered parameters"]),
    ("not-regathered", ["raised RuntimeError", "gather the unit's parameters again"]),
    ("all-reduced", ["all-reduces", "numerically right", "twice the gradient memory", "Reduce-scatter"]),
    ("not-divided", ["world_size x the average", "divide by W"]),
    ("stale", ["matched one process at step 0", "from before the optimizer's step", "shard Parameters"]),
    ("tied-twice", ["tied weight is counted twice", "by identity"]),
    ("keeps-gathered", ["unit blocks.", "still holds its gathered weights", "after its reduce-scatter", "free them"]),
    ("keeps-view-grads", ["views still hold their full-size gradients", "view.grad = None"]),
    ("overwrites", ["2 accumulated micro-batches per step", "only the last micro-batch",
                    "Assign into .grad only when it is None; otherwise add"]),
])
def test_check_micro_fsdp_names_the_typical_wrong_answers(cluster, kind, words):
    got = cluster.run(_micro_fsdp_verdict, kind)
    assert got[0], f"{kind} must fail check_micro_fsdp"
    assert got[0] == got[1], "every rank raises the same verdict"
    for w in words:
        assert w in got[0], f"the verdict on {kind} should mention {w!r}: {got[0]}"


@pytest.mark.parametrize("kind", ["solution", "no-prefetch", "synchronous"])
def test_check_micro_fsdp_passes_the_solution(cluster, kind):
    assert cluster.run(_micro_fsdp_verdict, kind) == [None, None]


def _micro_fsdp_printout(kind):
    import contextlib
    import io

    from course_utils.checks import check_micro_fsdp

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        check_micro_fsdp({"solution": MicroFSDP, "synchronous": _Synchronous}[kind])
    return out.getvalue()


def test_check_micro_fsdp_says_when_the_course_s_solution_passed(cluster):
    solution = cluster.run(_micro_fsdp_printout, "solution")[0]
    assert "That was the course's solution" in solution and "USE_SOLUTION = False" in solution, solution
    mine = cluster.run(_micro_fsdp_printout, "synchronous")[0]
    assert mine.startswith("check_micro_fsdp: the full parameters equal") and "course's solution" not in mine, mine


# -- the exercise cell of the stored notebook ----------------------------------------------------------------

def test_exercise_cell_passes_with_the_solution_and_its_scaffold_fails(cluster):
    from exercise_helpers import notebook_cell, run_exercise_cell

    source = notebook_cell(NOTEBOOK, "class MyReduceScatter")
    assert "USE_SOLUTION = True" in source, "the stored notebook must run the course's solution"
    assert cluster.run(run_exercise_cell, source) == [None, None], "the course's solution must pass"
    got = cluster.run(run_exercise_cell, source.replace("USE_SOLUTION = True", "USE_SOLUTION = False"))[0]
    assert got and "NotImplementedError" in got and "write MyReduceScatter.post_backward" in got, got
