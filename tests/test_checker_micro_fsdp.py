"""check_micro_fsdp (13_fsdp_by_hand, exercise 1 and section 4) against the learner: the untouched scaffold and
the typical wrong MicroFSDPs fail, each with a reason the learner can act on; right answers written differently
pass. The collectives are watched at the process group (course_utils.checks.fsdp.CollectiveLog, a dispatch mode):
an all-reduce or an all-gather of full gradients is caught whichever route reaches the group (dist.*, the
functional collectives, the ProcessGroup's own methods). Real gloo ranks.

    .venv/bin/python -m pytest -n 0 tests/test_checker_micro_fsdp.py -p no:randomly
"""
import sys

import pytest
import torch
import torch.distributed as dist

from conftest import register_by_value
from course_utils.fsdp import MicroFSDP
from exercise_helpers import verdict

register_by_value(sys.modules[__name__])  # the wrong answers below run on the ranks


@pytest.fixture(scope="module")
def cluster(make_cluster):
    return make_cluster(2, timeout=120)


# -- the typical wrong MicroFSDPs ---------------------------------------------------------

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



class _Reducer(_Synchronous):
    """The learner's post_backward with its collective written another way: ``reduce(mine, grad)`` leaves in
    ``mine`` this rank's part of the SUM of every rank's ``grad`` (already divided by W)."""

    def post_backward(self, unit):
        if unit.reduced:
            return
        unit.reduced = True
        for flat in unit.trainable:
            grad = flat.flat_grad() / self.world_size
            mine = torch.empty_like(flat.shard)
            self.reduce(mine, grad)
            flat.shard.grad = mine if flat.shard.grad is None else flat.shard.grad + mine
            for view in flat.views:
                view.grad = None
        if unit is not self.root:
            for flat in unit.flats:
                flat.free()


# wrong: numerically right, but every rank receives the whole gradient (the checker watches the process group)
class GatherSummed(_Reducer):
    """All-gathers every rank's full gradient and sums the copies locally."""

    def reduce(self, mine, grad):
        everyone = torch.empty(self.world_size * grad.numel())
        dist.all_gather_into_tensor(everyone, grad, group=self.group)
        total = everyone.view(self.world_size, -1).sum(0)
        n = mine.numel()
        mine.copy_(total[self.rank * n:(self.rank + 1) * n])


class FunctionalAllReduce(_Reducer):
    """All-reduces through torch.distributed._functional_collectives (no dist.all_reduce call)."""

    def reduce(self, mine, grad):
        import torch.distributed._functional_collectives as fc

        total = fc.all_reduce(grad, "sum", self.group or dist.group.WORLD)
        n = mine.numel()
        mine.copy_(total[self.rank * n:(self.rank + 1) * n])


class GroupAllReduce(_Reducer):
    """All-reduces through the ProcessGroup object's own method."""

    def reduce(self, mine, grad):
        (self.group or dist.group.WORLD).allreduce([grad]).wait()
        n = mine.numel()
        mine.copy_(grad[self.rank * n:(self.rank + 1) * n])


class PerParameter(MicroFSDP):
    """Reduce-scatters each parameter's gradient on its own (padded): right numbers, one call per parameter."""

    def post_backward(self, unit):
        if unit.reduced:
            return
        unit.reduced = True
        for flat in unit.trainable:
            grad = flat.flat_grad() / self.world_size
            mine = torch.zeros_like(flat.shard)
            for piece in grad.tensor_split(2):            # two calls where one is due
                padded = torch.nn.functional.pad(piece, (0, -piece.numel() % self.world_size))
                part = torch.empty(padded.numel() // self.world_size)
                dist.reduce_scatter_tensor(part, padded, group=self.group)
                full = torch.empty(padded.numel())
                dist.all_gather_into_tensor(full, part, group=self.group)
                piece.copy_(full[:piece.numel()])
            n = mine.numel()
            mine.copy_(grad[self.rank * n:(self.rank + 1) * n])
            flat.shard.grad = mine if flat.shard.grad is None else flat.shard.grad + mine
            for view in flat.views:
                view.grad = None
        if unit is not self.root:
            for flat in unit.flats:
                flat.free()


class Scaffold(MicroFSDP):
    """Lesson 13's exercise 1 as handed out."""

    def post_backward(self, unit):
        raise NotImplementedError("write MyReduceScatter.post_backward (see its comment), then run this cell again")


# right, written differently
class TensorForm(_Reducer):
    def reduce(self, mine, grad):
        dist.reduce_scatter_tensor(mine, grad, group=self.group)


class ImportedForm(_Reducer):
    def reduce(self, mine, grad):
        from torch.distributed import reduce_scatter_tensor

        reduce_scatter_tensor(mine, grad, op=dist.ReduceOp.SUM, group=self.group)


class ListForm(_Reducer):
    def reduce(self, mine, grad):
        dist.reduce_scatter(mine, list(grad.chunk(self.world_size)), group=self.group)


class AsyncWait(_Reducer):
    def reduce(self, mine, grad):
        work = dist.reduce_scatter_tensor(mine, grad, group=self.group, async_op=True)
        work.wait()


class FunctionalForm(_Reducer):
    def reduce(self, mine, grad):
        import torch.distributed._functional_collectives as fc

        mine.copy_(fc.reduce_scatter_tensor(grad, "sum", 0, self.group or dist.group.WORLD))


def _micro_fsdp_verdict(kind):
    from course_utils.checks import check_micro_fsdp

    makers = {"not-freed": NotFreed, "not-regathered": NotRegathered, "all-reduced": AllReduced,
              "not-divided": NotDivided, "stale": Stale, "tied-twice": TiedTwice, "solution": MicroFSDP,
              "no-prefetch": lambda m: MicroFSDP(m, prefetch=False), "keeps-gathered": KeepsGathered,
              "keeps-view-grads": KeepsViewGrads, "overwrites": Overwrites, "synchronous": _Synchronous,
              "gather-summed": GatherSummed, "functional-all-reduce": FunctionalAllReduce,
              "group-all-reduce": GroupAllReduce, "per-parameter": PerParameter, "scaffold": Scaffold,
              "tensor-form": TensorForm, "imported-form": ImportedForm, "list-form": ListForm,
              "async-wait": AsyncWait, "functional-form": FunctionalForm}
    return verdict(check_micro_fsdp, makers[kind])


@pytest.mark.parametrize("kind, words", [
    ("not-freed", ["after forward", "still held", "Free a unit's gathered parameters"]),
    ("not-regathered", ["raised RuntimeError", "gather the unit's parameters again"]),
    ("all-reduced", ["all-reduces", "numerically right", "twice the gradient memory", "Reduce-scatter"]),
    ("functional-all-reduce", ["all-reduces", "functional all-reduce", "seen at the process group",
                               "twice the gradient memory"]),
    ("group-all-reduce", ["all-reduces", "seen at the process group", "twice the gradient memory"]),
    ("gather-summed", ["all-gathers every rank's full gradient", "sums the copies", "W times the gradient memory",
                       "Reduce-scatter the flat gradient"]),
    ("per-parameter", ["reduce-scatter(s) for", "units with trainable parameters", "ONE reduce-scatter"]),
    ("scaffold", ["NotImplementedError", "write MyReduceScatter.post_backward"]),
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


@pytest.mark.parametrize("kind", ["solution", "no-prefetch", "synchronous", "tensor-form", "imported-form",
                                  "list-form", "async-wait", "functional-form"])
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


def _routes():
    """Which collectives CollectiveLog records, called through each route (in backward, where the checker looks)."""
    import torch.distributed._functional_collectives as fc
    import torch.distributed.distributed_c10d as c10d

    from course_utils.checks.fsdp import CollectiveLog

    group = dist.group.WORLD
    t, out = torch.ones(4), torch.empty(2)
    routes = {
        "dist.all_reduce": lambda: dist.all_reduce(t),
        "c10d.all_reduce": lambda: c10d.all_reduce(t),
        "ProcessGroup.allreduce": lambda: group.allreduce([t]).wait(),
        "functional all_reduce": lambda: fc.all_reduce(t, "sum", group),
        "dist.reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(out, t),
        "dist.reduce_scatter": lambda: dist.reduce_scatter(out, list(t.chunk(2))),
        "async reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(out, t, async_op=True).wait(),
        "functional reduce_scatter_tensor": lambda: fc.reduce_scatter_tensor(t, "sum", 0, group),
        "ProcessGroup._reduce_scatter_base": lambda: group._reduce_scatter_base(out, t).wait(),
        "dist.all_gather_into_tensor": lambda: dist.all_gather_into_tensor(torch.empty(8), t),
        "functional all_gather_tensor": lambda: fc.all_gather_tensor(t, 0, group),
    }
    seen = {}
    for name, call in routes.items():
        x = torch.ones(2, requires_grad=True)
        y = x * 2
        y.register_hook(lambda grad, call=call: (call(), grad)[1])   # the collective runs inside backward
        with CollectiveLog() as log:
            y.sum().backward()
        seen[name] = [(kind, numel) for kind, _, numel in log.calls]
    return seen


def test_collective_log_sees_every_route_to_the_process_group(cluster):
    """dist.*, distributed_c10d, the functional collectives and the ProcessGroup's methods, sync or async: each
    collective is recorded once, with its kind and its input's size (torch 2.13's dispatcher ops)."""
    seen = cluster.run(_routes)[0]
    expected = {"all-reduce": ("dist.all_reduce", "c10d.all_reduce", "ProcessGroup.allreduce", "functional all_reduce"),
                "reduce-scatter": ("dist.reduce_scatter_tensor", "dist.reduce_scatter", "async reduce_scatter_tensor",
                                   "functional reduce_scatter_tensor", "ProcessGroup._reduce_scatter_base"),
                "all-gather": ("dist.all_gather_into_tensor", "functional all_gather_tensor")}
    for kind, names in expected.items():
        for name in names:
            assert seen[name] == [(kind, 4)], f"{name}: recorded {seen[name]}, expected one {kind} of 4 numbers"
