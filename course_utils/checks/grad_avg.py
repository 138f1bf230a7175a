"""Checker for the gradient-averaging exercises, and the course's solutions to them.

Introduced in 05_manual_gradient_averaging::

    def scale_then_sum(model, micro_batches):
        ...  # forward/backward on each (x, y), scale the gradients, then all_reduce(SUM)

    check_grad_averaging(scale_then_sum, prescaled=True)           # exercise 1: divide before reducing
    check_grad_averaging(bucketed, bucket_numel=16)                # exercise 2: all-reduce in buckets
    check_grad_averaging(tokens_in_one, unequal=True, collectives=1)   # exercise 4: any sizes, one collective
    check_adam_hides_the_bug(bad, good)                            # exercise 3

The learner's function runs on every rank of a real process group. Each rank gets the same
model (float64) and its own micro-batches: ``accum_steps`` of them, of ``micro_batch_size`` samples
each, or with ``unequal=True`` of sizes that differ between micro-steps and between ranks. After
the call, every rank's ``p.grad`` must equal the gradient of the mean-squared error (mean over
ALL samples) of ONE process on the whole global batch. When it does not, the AssertionError says
by which factor the gradient is off and which division (or collective) that factor points to.

Tolerance: the check runs in float64 and accepts a relative error up to ``RTOL`` = 1e-9 (a right
answer agrees to ~1e-15 whatever the summation order; a factor, a lower-precision reduction or a
mean of means is off by 1e-3 or far more).
"""
import itertools
import math

import torch

__all__ = ["check_grad_averaging", "check_adam_hides_the_bug", "RTOL"]

D_IN = 16
D_HIDDEN = 8   # the checker's model: Linear(16, 8), ReLU, Linear(8, 1); exercise 2 sizes it to its cap (_cases)
RTOL = 1e-9

# the collectives counted by ``collectives=``: every torch.distributed function that moves tensor data
_COLLECTIVES = ("all_reduce", "all_reduce_coalesced", "reduce", "broadcast", "all_gather", "all_gather_into_tensor",
                "all_gather_single", "all_gather_object", "reduce_scatter", "reduce_scatter_tensor",
                "reduce_scatter_single", "all_to_all", "all_to_all_single", "send", "recv", "isend", "irecv",
                "batch_isend_irecv", "gather", "scatter", "broadcast_object_list")

_CLUSTERS = {}  # world_size -> Cluster, reused across calls when no %%ddp cluster is running


def _pick_sizes(world_size):
    """accum_steps and micro_batch_size chosen so that W, K, B and their products are all distinct."""
    for k, b in itertools.product((3, 2, 5, 7), (5, 7, 11, 13, 17)):
        factors = [w * kk * bb for w, kk, bb in itertools.product((1, world_size), (1, k), (1, b))]
        if len(set(factors)) == len(factors):
            return k, b
    return 3, 5


_UNEQUAL_PATTERNS = [(2, 7, 3), (5, 1, 7), (3, 9, 2), (1, 4, 8)]  # rank totals 12, 13, 14, 13


def _unequal_sizes(world_size):
    """Three micro-batches per rank whose sizes differ between micro-steps AND between ranks."""
    sizes = []
    for r in range(world_size):
        row = list(_UNEQUAL_PATTERNS[r % len(_UNEQUAL_PATTERNS)])
        row[row.index(max(row))] += r // len(_UNEQUAL_PATTERNS)  # beyond 4 ranks: grow the largest, keep them distinct
        sizes.append(row)
    return sizes


def _cases(world_size, unequal=False, bucket_numel=None):
    """Each case: ``sizes[rank][micro_step]`` (samples per micro-batch), a seed and the model's ``d_hidden``.

    With ``bucket_numel=C`` (exercise 2) the model is sized so that a bucket holds exactly C elements: for an even
    C, one input and C/2 hidden units, whose tensors in reverse parameter order are 1, C/2, C/2 and C/2 elements,
    bucketed as [1 + C/2, C] (a bucket closed at ``>= C`` instead of ``> C`` sends [1 + C/2, C/2, C/2]; one
    tensor per all-reduce, one flat buffer and the registration order each send another layout); for an odd C,
    C - 1 hidden units (1 + (C - 1) = C)."""
    k, b = _pick_sizes(world_size)
    d_in, d_hidden = D_IN, D_HIDDEN
    if bucket_numel is not None and bucket_numel >= 4 and bucket_numel % 2 == 0:
        d_in, d_hidden = 1, bucket_numel // 2
    elif bucket_numel is not None and bucket_numel >= 2:
        d_hidden = bucket_numel - 1
    if unequal:
        one_each = [[3 + 2 * r] for r in range(world_size)]  # accum_steps = 1, ranks of different sizes
        cases = [dict(sizes=_unequal_sizes(world_size), seed=3), dict(sizes=one_each, seed=4)]
    else:
        cases = [dict(sizes=[[b] * k] * world_size, seed=1), dict(sizes=[[b]] * world_size, seed=2)]
    return [dict(case, d_in=d_in, d_hidden=d_hidden) for case in cases]


def _describe_case(case):
    sizes, ws = case["sizes"], len(case["sizes"])
    flat = {s for row in sizes for s in row}
    if len(flat) == 1:
        return f"(case: world_size={ws}, accum_steps={len(sizes[0])}, micro_batch_size={flat.pop()})"
    return f"(case: world_size={ws}, micro-batch sizes per rank {sizes})"


def _case_data(case):
    """The global batch of a case: the same tensors on every rank and in the notebook."""
    from course_utils.data import make_regression

    n = sum(sum(row) for row in case["sizes"])
    return make_regression(n=n, d_in=case.get("d_in", D_IN), seed=100 + case["seed"], dtype=torch.float64)


def _micro_batches(case, rank):
    """Rank ``rank``'s micro-batches: consecutive slices of the global batch."""
    x, y = _case_data(case)
    start = sum(sum(row) for row in case["sizes"][:rank])
    out = []
    for size in case["sizes"][rank]:
        out.append((x[start:start + size], y[start:start + size]))
        start += size
    return out


def _model(case):
    from course_utils.models import make_model

    return make_model(seed=case["seed"], d_in=case.get("d_in", D_IN), d_hidden=case.get("d_hidden", D_HIDDEN)).double()


def _grads_of(losses_and_weights, case):
    """Gradient of sum(weight x loss) over (x, y, weight, reduction) items, one process."""
    import torch.nn.functional as F

    model = _model(case)
    for x, y, weight in losses_and_weights:
        (weight * F.mse_loss(model(x), y, reduction="sum")).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def _reference(case):
    """One process, the whole global batch, mean loss: the gradient every rank must end with."""
    x, y = _case_data(case)
    return _grads_of([(x, y, 1.0 / len(x))], case)


def _wrong_weightings(case):
    """The gradients of the usual wrong weightings of unequal micro-batches (for the explanations)."""
    ws, sizes = len(case["sizes"]), case["sizes"]
    per_micro = [(x, y, r, len(x)) for r in range(ws) for x, y in _micro_batches(case, r)]
    rank_count = [sum(row) for row in sizes]
    return {  # rank means first: with one micro-batch per rank the two are the same thing
        "rank means": _grads_of([(x, y, 1.0 / (rank_count[r] * ws)) for x, y, r, b in per_micro], case),
        "mean of means": _grads_of([(x, y, 1.0 / (b * len(sizes[r]) * ws)) for x, y, r, b in per_micro], case),
    }


def _last_micro_batch_only(case):
    """The gradients a rank ends with when zero_grad() runs inside the micro-batch loop: the last micro-batch's
    alone, averaged over the ranks (with the loss divided by K, and without)."""
    ws, sizes = len(case["sizes"]), case["sizes"]
    if all(len(row) == 1 for row in sizes):
        return {}
    last = [(r, *_micro_batches(case, r)[-1]) for r in range(ws)]
    return {
        "last micro-batch": _grads_of([(x, y, 1.0 / (len(x) * len(sizes[r]) * ws)) for r, x, y in last], case),
        "last micro-batch, not / K": _grads_of([(x, y, 1.0 / (len(x) * ws)) for r, x, y in last], case),
    }


# the process group's own methods: what every route ends in (dist.*, an alias such as
# ``from torch.distributed import all_reduce`` bound before the check, ``dist.group.WORLD.allreduce``)
_GROUP_METHODS = ("allreduce", "allreduce_coalesced", "allgather", "allgather_coalesced", "_allgather_base",
                  "reduce", "reduce_scatter", "_reduce_scatter_base", "broadcast", "gather", "scatter", "alltoall",
                  "alltoall_base", "send", "recv")
_OP_NAMES = ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "PREMUL_SUM")


def _op_name(op):
    """'SUM', 'AVG', ... for a ReduceOp, a RedOpType, an AllreduceOptions or None (SUM, the default)."""
    import torch.distributed as dist

    op = getattr(op, "reduceOp", op)
    if op is None:
        return "SUM"
    if isinstance(op, str):  # the functional collectives take "sum", "avg"
        return op.upper()
    for name in _OP_NAMES:
        if hasattr(dist.ReduceOp, name) and op == getattr(dist.ReduceOp, name):
            return name
    return str(op).split(".")[-1].upper()


class _ReadAtWait:
    """A Work that records what its all-reduce produced when it is waited for: inside ``dist.all_reduce`` for a
    blocking call, at the learner's ``wait()`` for ``async_op=True``."""

    def __init__(self, work, tensors, call):
        self._work, self._tensors, self._call = work, tensors, call

    def wait(self, *args, **kwargs):
        done = self._work.wait(*args, **kwargs)
        self._call["sq_norm"] = float(sum(t.double().pow(2).sum() for t in self._tensors))
        return done

    def __getattr__(self, name):
        return getattr(self._work, name)


def _counting_collectives(counts, calls=None):
    """Patch torch.distributed so that each collective call adds 1 to ``counts[name]``, however it is reached:
    ``dist.*`` and ``c10d.*``, the process group's methods (what an alias bound before the patch, or
    ``dist.group.WORLD.allreduce``, calls) and ``torch.distributed._functional_collectives``; a call inside
    another counted call is not counted again. ``calls``: a list that gets, for each all-reduce, its op, its numel
    and the squared norm of what it produced, read when it completes (at ``wait()`` for ``async_op=True``; None
    if never waited for). Returns an undo."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    depth = [0]
    saved = []

    def count(name):
        if depth[0] == 0:
            counts[name] = counts.get(name, 0) + 1

    for module in (dist, c10d):
        for name in _COLLECTIVES:
            original = getattr(module, name, None)
            if original is None:
                continue

            def counted(*args, _name=name, _original=original, **kwargs):
                count(_name)
                depth[0] += 1
                try:
                    return _original(*args, **kwargs)
                finally:
                    depth[0] -= 1

            saved.append((module, name, original))
            setattr(module, name, counted)

    group_class = c10d.ProcessGroup
    for name in _GROUP_METHODS:
        original = group_class.__dict__.get(name)
        if original is None:
            continue

        def method(self, *args, _name=name, _original=original, **kwargs):
            count("all_reduce" if _name == "allreduce" else f"ProcessGroup.{_name}")
            depth[0] += 1
            try:
                work = _original(self, *args, **kwargs)
            finally:
                depth[0] -= 1
            if _name != "allreduce" or calls is None:
                return work
            tensors = args[0] if args else kwargs.get("tensors", kwargs.get("tensor"))
            tensors = list(tensors) if isinstance(tensors, (list, tuple)) else [tensors]
            op = args[1] if len(args) > 1 else kwargs.get("opts", kwargs.get("op"))
            call = {"op": _op_name(op), "numel": sum(t.numel() for t in tensors), "sq_norm": None}
            calls.append(call)
            return _ReadAtWait(work, tensors, call) if work is not None else work

        saved.append((group_class, name, original))
        setattr(group_class, name, method)

    try:
        import torch.distributed._functional_collectives as fc
    except ImportError:  # pragma: no cover (a torch without the functional collectives)
        fc = None
    for name in ("all_reduce", "all_reduce_coalesced", "all_gather_tensor", "reduce_scatter_tensor",
                 "all_to_all_single", "broadcast") if fc is not None else ():
        original = getattr(fc, name, None)
        if not callable(original):
            continue

        def functional(*args, _name=name, _original=original, **kwargs):
            count(_name)
            result = _original(*args, **kwargs)
            if _name == "all_reduce" and calls is not None and depth[0] == 0:
                op = args[1] if len(args) > 1 else kwargs.get("reduceOp")
                calls.append({"op": _op_name(op), "numel": result.numel(),
                              "sq_norm": float(result.double().pow(2).sum())})  # waits for the result
            return result

        saved.append((fc, name, original))
        setattr(fc, name, functional)

    def undo():
        for owner, name, original in reversed(saved):
            setattr(owner, name, original)
    return undo


def _run_on_rank(fn, cases):
    """Runs on every rank: call ``fn(model, micro_batches)`` for each case; the gradients and collective counts."""
    import torch.distributed as dist

    rank = dist.get_rank()
    out = []
    for case in cases:
        micro_batches = _micro_batches(case, rank)
        model = _model(case)
        counts, calls = {}, []
        undo = _counting_collectives(counts, calls)
        try:
            fn(model, micro_batches)
        finally:
            undo()
        out.append({"grads": {name: None if p.grad is None else p.grad.detach().clone()
                              for name, p in model.named_parameters()}, "collectives": counts,
                    "all_reduces": calls, "numels": [p.numel() for p in model.parameters()]})
    return out


def _flat(grads):
    return torch.cat([g.flatten() for g in grads.values()])


def _explain_factor(ratio, world_size, accum_steps, micro_batch_size):
    """Name the mistake behind a gradient that is ``ratio`` times the right one, or return None.

    ``accum_steps`` and ``micro_batch_size`` are None when the micro-batches differ in size.
    """
    names = {   # the factor's name and its reason; the fix is kept for a second identical failure (_FIXES)
        (1, 0, 0): "world_size. The all_reduce(SUM) adds up the W ranks' gradients, and nothing turns that sum "
                   "into a mean",
        (-1, 0, 0): "1/world_size. The W ranks' sum was divided by world_size twice",
        (0, 1, 0): "accum_steps. backward() adds the K micro-batches' gradients into .grad, so the K mean losses "
                   "became their sum, not their mean",
        (0, -1, 0): "1/accum_steps. The K micro-batches were divided by accum_steps twice",
        (0, 0, 1): "micro_batch_size. The loss adds up the samples of a micro-batch instead of averaging them",
        (1, 1, 0): "world_size x accum_steps. Neither the K micro-batches nor the W ranks are averaged: both are "
                   "sums",
    }
    if accum_steps is None:  # unequal micro-batches: the global count already divides by everything
        names = {
            (1, 0, 0): "world_size. The all_reduce(SUM) adds up the W ranks' gradients, and the loss was divided "
                       "by a count that covers one rank only",
            (-1, 0, 0): "1/world_size. Dividing by the global sample count already averages over every rank, and "
                        "the sum over ranks was divided by world_size on top",
        }
    dims = [("world_size", world_size), ("accum_steps", accum_steps), ("micro_batch_size", micro_batch_size)]
    for exps, text in names.items():
        factor = math.prod(v ** e for (_, v), e in zip(dims, exps) if e)
        if math.isclose(ratio, factor, rel_tol=1e-6):
            return factor, text
    usable = [(n, v) for n, v in dims if v is not None]
    for exps in itertools.product((-1, 0, 1), repeat=len(usable)):  # any other combination
        factor = math.prod(v ** e for (_, v), e in zip(usable, exps) if e)
        if any(exps) and math.isclose(ratio, factor, rel_tol=1e-6):
            parts = [f"{n}{'' if e == 1 else '^-1'}" for (n, _), e in zip(usable, exps) if e]
            return factor, " x ".join(parts)
    return None


_FIXES = {   # the fix for each named factor, per exercise, shown only when the same verdict comes a second time
    "plain": {
        "world_size.": "divide the all-reduced gradient by world_size, or all-reduce with op=dist.ReduceOp.AVG",
        "1/world_size.": "divide by world_size once: ReduceOp.AVG already does it, and so does a global sample count",
        "accum_steps.": "divide each micro-batch's loss by accum_steps = len(micro_batches) before backward()",
        "1/accum_steps.": "divide each micro-batch's loss by accum_steps once",
        "micro_batch_size.": "use the mean loss, F.mse_loss(model(x), y) (reduction='mean', the default)",
        "world_size x accum_steps.": "divide each micro-batch's loss by accum_steps and the all-reduced gradient "
                                     "by world_size",
        "mean of micro-batch means": "sum the per-sample losses (reduction='sum') and divide by N, the sample count "
                                     "of the WHOLE global batch (all-reduce this rank's count to get it)",
        "OWN sample count": "divide by N, the count of the WHOLE global batch: all-reduce this rank's count first",
    },
    # exercise 1 scales BEFORE the all-reduce and changes nothing after it: every fix is a factor applied first
    "prescaled": {
        "world_size.": "scale each gradient by 1 / (len(micro_batches) * dist.get_world_size()) BEFORE "
                       "dist.all_reduce(p.grad, op=dist.ReduceOp.SUM): dividing by K alone leaves the sum of W "
                       "ranks",
        "1/world_size.": "scale each gradient once, by 1 / (len(micro_batches) * dist.get_world_size()), before the "
                         "all-reduce, and sum with ReduceOp.SUM",
        "accum_steps.": "the one factor before the all-reduce covers the K micro-batches too: scale by 1 / "
                        "(len(micro_batches) * dist.get_world_size()), not by 1 / world_size",
        "1/accum_steps.": "the loss is the mean loss, not divided by K: then scale each gradient once, by 1 / "
                          "(len(micro_batches) * dist.get_world_size())",
        "micro_batch_size.": "backward() the mean loss, F.mse_loss(model(x), y) (reduction='mean', the default)",
        "world_size x accum_steps.": "between the backward passes and dist.all_reduce, scale every p.grad by 1 / "
                                     "(len(micro_batches) * dist.get_world_size())",
    },
    "buckets": {
        "world_size.": "all-reduce each bucket with op=dist.ReduceOp.AVG (or divide it by world_size) before you "
                       "copy its slices back into each p.grad",
        "1/world_size.": "divide by world_size once: ReduceOp.AVG already does it",
        "accum_steps.": "divide each micro-batch's loss by accum_steps = len(micro_batches) before backward()",
        "1/accum_steps.": "divide each micro-batch's loss by accum_steps once",
        "micro_batch_size.": "use the mean loss, F.mse_loss(model(x), y) (reduction='mean', the default)",
        "world_size x accum_steps.": "divide each micro-batch's loss by accum_steps, and average each bucket over "
                                     "the ranks (ReduceOp.AVG)",
    },
    "tokens": {
        "world_size.": "put this rank's sample count in the same all-reduce as the gradients and divide by the "
                       "summed count: it covers every rank",
        "1/world_size.": "the summed sample count already divides by everything: sum (ReduceOp.SUM), do not average",
        "micro_batch_size.": "sum the per-sample losses (reduction='sum') and divide once, by the global count",
        "mean of micro-batch means": "sum the per-sample losses (reduction='sum'); put this rank's sample count at "
                                     "the end of the one flat tensor you all-reduce, and divide by the summed count",
        "OWN sample count": "divide by N, the count of the WHOLE global batch: all-reduce this rank's count with the "
                            "gradients (one more element in the same tensor)",
    },
}
_SEEN = {}   # (exercise, verdict) -> how many times it was given in this process: counted per exercise


def _exercise(prescaled, bucket_numel, unequal):
    """Which exercise a call checks, for its hints and its verdict counts."""
    return "prescaled" if prescaled else "buckets" if bucket_numel is not None else "tokens" if unequal else "plain"


def _with_hint(problem, exercise="plain"):
    """The verdict, plus this exercise's fix when the same verdict is given a second time in this exercise (the
    first says factor and reason)."""
    fixes = [fix for key, fix in _FIXES[exercise].items()
             if f"the factor is {key}" in problem or f" {key} " in f" {problem} "]
    if not fixes:
        return problem
    _SEEN[exercise, problem] = _SEEN.get((exercise, problem), 0) + 1
    if _SEEN[exercise, problem] == 1:
        return problem + " (The same verdict a second time comes with a hint.)"
    return problem + " Hint: " + fixes[0] + "."


def _size_word(factor):
    """4.0 -> '4x too large', 0.25 -> '4x too small'."""
    return f"{factor:.4g}x too large" if factor >= 1 else f"{1 / factor:.4g}x too small"


def _close(a, b, ref_norm):
    return torch.allclose(a, b, rtol=RTOL, atol=RTOL * ref_norm)


def _compare(rank_grads, ref, case, wrong=None):
    """An explanation of what is wrong in one case, or None when every rank is right."""
    sizes = case["sizes"]
    world_size = len(sizes)
    equal = len({s for row in sizes for s in row}) == 1
    k, b = (len(sizes[0]), sizes[0][0]) if equal else (None, None)
    where = _describe_case(case)
    for r, grads in enumerate(rank_grads):
        missing = [name for name, g in grads.items() if g is None]
        if missing:
            return (f"rank {r} has no gradient for {', '.join(missing)} {where}: call loss.backward() on each "
                    "micro-batch, and do not set the gradients to None (zero_grad) at the end.")
    for r, grads in enumerate(rank_grads):
        bad = [name for name, g in grads.items() if g.shape != ref[name].shape]
        if bad:
            name = bad[0]
            return (f"rank {r}: the gradient of {name} has shape {tuple(grads[name].shape)}, "
                    f"expected {tuple(ref[name].shape)}.")

    ref_flat = _flat(ref)
    ref_norm = ref_flat.norm().item()
    flats = [_flat(g) for g in rank_grads]
    right = [_close(f, ref_flat, ref_norm) for f in flats]
    if all(right):
        return None

    def describe(flat, ref_vec):
        norm, rnorm = flat.norm().item(), ref_vec.norm().item()
        if norm == 0:
            return "all zero (did you zero the gradients after averaging them?)"
        ratio = norm / rnorm
        cosine = (flat @ ref_vec).item() / (norm * rnorm)
        rel = (flat - ref_vec).norm().item() / rnorm
        if cosine > 1 - 1e-12:  # same direction: a pure factor
            named = _explain_factor(ratio, world_size, k, b)
            if named:
                return f"{_size_word(named[0])}: the factor is {named[1]}"
            if abs(ratio - 1) < 1e-3:
                return (f"in the right direction and off by only {abs(ratio - 1):.2g} relative in size: "
                        f"the check runs in float64 and allows {RTOL:g}. Did something round to a lower "
                        "precision, or scale by a number close to 1?")
            return (f"{_size_word(ratio)}, in the right direction (a hard-coded number? use len(micro_batches) "
                    "and dist.get_world_size())")
        if rel < 0.01:
            return (f"close, but not exact: relative error {rel:.2g} (cosine similarity {cosine:.8f}); the check "
                    f"runs in float64 and allows {RTOL:g}. Did the gradients go through float32, float16 or "
                    "bfloat16 on the way (a cast before the all-reduce)?")
        return (f"wrong: relative error {rel:.3g}, cosine similarity {cosine:.4f} with the right gradient: it "
                f"points elsewhere, so this is not a simple factor (norm ratio {ratio:.4g})")

    same = all(torch.equal(flats[0], f) for f in flats[1:])
    if not same:
        lines = [f"The ranks end with different gradients {where}. Every rank must hold the same averaged "
                 "gradient, or their weights drift apart at the first optimizer step:"]
        for r, f in enumerate(flats):
            lines.append(f"  rank {r}: " + ("right" if right[r] else describe(f, ref_flat)))
        differ = [name for name in ref if not all(torch.equal(rank_grads[0][name], g[name]) for g in rank_grads[1:])]
        if len(differ) < len(ref):
            lines.append(f"The ranks disagree on {', '.join(differ)} only: average EVERY parameter's gradient "
                         "(loop over model.parameters()).")
        else:
            lines.append("Call dist.all_reduce on every rank, for every parameter (dist.reduce, or an all_reduce "
                         "inside `if rank == 0:`, leaves the other ranks with their own gradient).")
        return "\n".join(lines)

    # every rank agrees, and is wrong: a known wrong weighting of unequal micro-batches?
    n_global = sum(sum(row) for row in sizes)
    for name, g in (wrong or {}).items():
        g_flat = _flat(g)
        for scale, extra in ((1, ""), (world_size, " Also, the SUM over ranks is not divided by world_size.")):
            if not _close(flats[0], scale * g_flat, ref_norm):
                continue
            if name.startswith("last micro-batch"):
                ratio = flats[0].norm().item() / ref_norm
                return (f"Every rank's gradient is only its LAST micro-batch's {where} (norm ratio {ratio:.3g} of the "
                        "right one; about 1/accum_steps when the loss is divided by K): zero_grad() inside the "
                        "micro-batch loop (optimizer.zero_grad() or model.zero_grad()) wipes what the earlier "
                        "micro-batches accumulated in .grad. Zero the gradients once per step, before the first "
                        "micro-batch." + extra)
            if name == "mean of means":
                weights = sorted({n_global / (s * len(row) * world_size) for row in sizes for s in row})
                return (f"Every rank's gradient is a mean of micro-batch means {where}: each micro-batch's MEAN loss "
                        f"divided by accum_steps, then averaged over the ranks. With micro-batches of different "
                        f"sizes this weights each sample by N / (W x K x b) instead of 1 (N = {n_global} samples "
                        f"in all, b the size of its micro-batch): from {weights[0]:.3g}x to {weights[-1]:.3g}x "
                        "here: a sample in a small micro-batch counts more than one in a large one." + extra)
            counts = [sum(row) for row in sizes]
            lo, hi = n_global / (world_size * max(counts)), n_global / (world_size * min(counts))
            return (f"Every rank's gradient divides by its OWN sample count {where}, then averages the ranks. "
                    f"The ranks hold different numbers of samples ({', '.join(map(str, counts))}), so a sample "
                    f"on a small rank counts more: by N / (W x n_rank), from {lo:.3g}x to {hi:.3g}x here "
                    f"(N = {n_global} samples in all)." + extra)

    # is it one parameter, or all of them by the same factor?
    per_param = {name: describe(g.flatten(), ref[name].flatten()) for name, g in rank_grads[0].items()
                 if not _close(g, ref[name], ref_norm)}
    if len(per_param) < len(ref):
        wrong_text = ", ".join(f"{n} is {d}" for n, d in per_param.items())
        return (f"Some parameters are right and others are not {where}: {wrong_text}. "
                "Average the gradient of every parameter in model.parameters().")
    return f"Every rank's gradient is {describe(flats[0], ref_flat)}. {where}"


def _cluster_for(world_size):
    """The notebook's %%ddp cluster (started if needed) when no size is asked for, else one cached per size."""
    try:
        from IPython import get_ipython

        in_notebook = get_ipython() is not None
    except ImportError:
        in_notebook = False
    if in_notebook and world_size is None:
        from course_utils import get_cluster

        return get_cluster()  # the running %%ddp ranks: no new processes
    from course_utils import Cluster

    world_size = world_size or 2
    c = _CLUSTERS.get(world_size)
    if c is None or not c.alive:
        c = _CLUSTERS[world_size] = Cluster(world_size=world_size, backend="gloo")
    return c


def _buckets(numels, cap, full_at_cap=False):
    """The bucket layout (elements per all-reduce) of exercise 2: tensors in reverse parameter order, a bucket
    takes the next tensor while its total stays within ``cap``; a tensor larger than ``cap`` goes alone.
    ``full_at_cap=True``: the off-by-one layout, a bucket closed when the next tensor would bring it to the cap."""
    out, current = [], 0
    for n in reversed(numels):
        if current and (current + n >= cap if full_at_cap else current + n > cap):
            out.append(current)
            current = 0
        current += n
    out.append(current)
    return out


def _next_tensor(numels, consumed):
    """The numel of the tensor that follows the first ``consumed`` elements in reverse parameter order, or None."""
    total = 0
    for n in reversed(numels):
        if total == consumed:
            return n
        total += n
    return None


def _bucket_problem(sent, numels, cap, where):
    """Why the all-reduces of one call are not exercise 2's buckets, or None."""
    expected = _buckets(numels, cap)
    if sent == expected:
        return None
    shown = ", ".join(map(str, sent)) or "none"
    if sent == _buckets(numels, cap, full_at_cap=True):
        i = next(i for i, (n, e) in enumerate(zip(sent, expected)) if n != e)
        following = _next_tensor(numels, sum(sent[:i + 1]))
        carried = f"{sent[i]} element{'s' * (sent[i] != 1)}"
        return (f"Your gradients are right, but all-reduce {i} carried {carried} {where}: the next tensor in "
                f"reverse order ({following} elements) would have filled that bucket to exactly the cap of {cap}, "
                "which a bucket may hold. Close a bucket only when the next tensor would take it PAST the cap "
                "(total > cap, not >= cap).")
    if sum(sent) != sum(numels):
        return (f"Your gradients are right, but the all-reduces carried {shown} elements {where}, "
                f"{sum(sent)} in all, not the model's {sum(numels)}: all-reduce every gradient exactly once.")
    if len(sent) == len(numels) > len(expected) and sorted(sent) == sorted(numels):
        return (f"Your gradients are right, but you all-reduced each of the {len(numels)} tensors on its own {where}: "
                f"a bucket takes tensors until the next one would pass the cap of {cap}, so that there are as few "
                "all-reduces as the cap allows (each pays the latency alpha).")
    if sent == _buckets(numels[::-1], cap):
        return (f"Your gradients are right, but the buckets follow the registration order {where}: fill them in "
                "REVERSE order (reversed(list(model.parameters()))), as DDP does: backward produces the last "
                "layer's gradients first, so that bucket can leave first.")
    for i, (n, e) in enumerate(zip(sent, expected)):
        if n == e:
            continue
        if n > cap and n not in numels:
            return (f"Your gradients are right, but all-reduce {i} carried {n} elements {where}, over the cap of "
                    f"{cap}: close a bucket before the next tensor would take it past the cap (only a tensor "
                    "larger than the cap travels alone).")
        if n < e:
            return (f"Your gradients are right, but all-reduce {i} carried {n} elements {where}, and the next "
                    f"tensor in reverse order would still have fitted under the cap of {cap}: a bucket takes tensors "
                    "until the next one would pass the cap, so that there are as few all-reduces as the cap allows.")
        break
    return (f"Your gradients are right, but the all-reduces carried {shown} elements {where}: buckets of at most "
            f"{cap} elements, filled in reverse parameter order without splitting a tensor, are not that.")


def _prescale_problem(result, where):
    """Why one rank's call did not scale before reducing (exercise 1), or None."""
    calls = result["all_reduces"]
    if not calls:
        return f"No dist.all_reduce was called {where}: the gradients must be summed over the ranks."
    ops = sorted({c["op"] for c in calls if c["op"] != "SUM"})
    if ops:
        return (f"Your gradients are right, but you all-reduced with ReduceOp.{ops[0]} {where}: AVG divides by "
                "world_size AFTER the sum. This exercise scales each gradient BEFORE the all-reduce and sums "
                "(ReduceOp.SUM, the default), so the reduced values are already the mean.")
    if any(c["sq_norm"] is None for c in calls):
        return (f"An all-reduce started with async_op=True was never waited for {where}: call .wait() on the work "
                "it returns before your function returns, or its result may not be in the gradient yet.")
    reduced = math.sqrt(sum(c["sq_norm"] for c in calls))
    final = _flat(result["grads"]).norm().item()
    if not math.isclose(reduced, final, rel_tol=1e-9):
        return (f"Your gradients are right, but they were scaled after the all-reduce {where}: what came out of "
                f"the all-reduces is {reduced / final:.4g}x the final gradient. Scale each gradient (by 1/(K x W)) "
                "BEFORE dist.all_reduce, as DDP does (its reducer divides each gradient while it copies it into the "
                "bucket), and change nothing after it.")
    return None


def check_grad_averaging(fn, cluster=None, world_size=None, timeout=30, *, unequal=False, collectives=None,
                         prescaled=False, bucket_numel=None):
    """Check ``fn(model, micro_batches)`` against one process on the whole batch; raise AssertionError if wrong.

    Introduced in 05_manual_gradient_averaging. ``micro_batches`` is this rank's list of pairs
    ``(x, y)``; the loss is ``F.mse_loss(model(x), y)``. After ``fn`` returns, every rank's ``p.grad``
    must be the gradient of the mean loss over ALL samples of all ranks. Two cases run: accum_steps
    > 1 and accum_steps = 1.

    ``unequal=True``: the micro-batches differ in size between micro-steps and between ranks (as
    token counts do). A mean of micro-batch means, or a mean of per-rank means, then fails with the
    weights it gives each sample. ``collectives=N``: the function may call at most N collectives
    (``dist.all_reduce`` and friends, counted on every rank) per call. ``prescaled=True`` (exercise 1):
    the gradients must be scaled BEFORE an all_reduce(SUM), nothing changed after it. ``bucket_numel=C``
    (exercise 2): one all_reduce per bucket of at most C elements, filled in reverse parameter order
    without splitting a tensor (a tensor over C goes alone), and no other collective; the model is then sized so
    that one bucket holds exactly C elements (a bucket closed at ``>= C`` fails; ``_cases``).

    A collective is seen however it is reached (``dist.*``, a name imported from ``torch.distributed``, the
    process group's methods, the functional collectives), and an all-reduce's result is read when it completes
    (inside the call, or at ``wait()`` after ``async_op=True``). A verdict's hint, and the count that holds it
    back until the same verdict comes a second time, belong to the exercise (``prescaled``, ``bucket_numel``,
    ``unequal`` or none of them).

    The ranks are ``cluster`` if given; else, in a notebook, the ``%%ddp`` cluster (a 2-rank one
    is started if none runs); else a gloo ``Cluster(world_size or 2)`` kept for the next call. An error
    inside ``fn`` is raised as the usual ``DistributedError`` with the rank's traceback.
    """
    __tracebackhide__ = True
    from course_utils import DistributedTimeout

    if not callable(fn):
        raise TypeError(f"check_grad_averaging takes your function, got {type(fn).__name__}")
    if cluster is None:
        cluster = _cluster_for(world_size)
    ws = cluster.world_size
    if ws < 2:
        raise ValueError("check_grad_averaging needs at least 2 ranks: with one, there is nothing to average.")
    cases = _cases(ws, unequal=unequal, bucket_numel=bucket_numel)
    exercise = _exercise(prescaled, bucket_numel, unequal)
    try:
        results = cluster.run(_run_on_rank, fn, cases, timeout=timeout)
    except DistributedTimeout as exc:
        raise AssertionError(
            f"Your function hung: {exc.summary.split(' (')[0]}. A collective waits until EVERY rank calls it, "
            "in the same order: is an all_reduce inside `if rank == 0:`, or called a different number of "
            "times on different ranks?") from None
    for i, case in enumerate(cases):
        wrong = {**(_wrong_weightings(case) if unequal else {}), **_last_micro_batch_only(case)}
        problem = _compare([results[r][i]["grads"] for r in range(ws)], _reference(case), case, wrong)
        unwaited = [r for r in range(ws) if any(c["sq_norm"] is None for c in results[r][i]["all_reduces"])]
        if problem and unwaited:   # wrong gradients and an all-reduce nobody waited for: that is the first cause
            raise AssertionError(
                f"An all-reduce started with async_op=True was never waited for on rank {unwaited[0]} "
                f"{_describe_case(case)}, and the gradients are wrong: call .wait() on the work each "
                "dist.all_reduce(..., async_op=True) returns before your function returns; until then its "
                "result may not be in the tensor.")
        if problem:
            raise AssertionError(_with_hint(problem, exercise))
    if collectives is not None:
        for i, case in enumerate(cases):
            for r in range(ws):
                counts = results[r][i]["collectives"]
                total = sum(counts.values())
                if total > collectives:
                    calls = ", ".join(f"dist.{name} x {n}" for name, n in sorted(counts.items()))
                    count = (" and this rank's sample count (one more element at the end, all-reduced with "
                             "them; divide by it afterwards)") if unequal else ""
                    raise AssertionError(
                        f"Your gradients are right, but rank {r} called {total} collectives in one call ({calls}) "
                        f"{_describe_case(case)}; the exercise allows {collectives}. Each call pays the latency "
                        f"alpha once: flatten every gradient{count} into one tensor (torch.cat), all-reduce it "
                        "once, and copy the slices back into each p.grad.")
    for i, case in enumerate(cases):
        for r in range(ws):
            result, where = results[r][i], f"on rank {r} {_describe_case(case)}"
            problem = _prescale_problem(result, where) if prescaled else None
            if bucket_numel is not None and problem is None:
                others = {k: n for k, n in result["collectives"].items() if k != "all_reduce"}
                if others:
                    problem = (f"Your gradients are right, but you called {', '.join(others)} {where}: "
                               "exercise 2 averages with one dist.all_reduce per bucket and nothing else.")
                else:
                    problem = _bucket_problem([c["numel"] for c in result["all_reduces"]], result["numels"],
                                              bucket_numel, where)
            if problem:
                raise AssertionError(problem)


# -- exercise 3: Adam hides the bug -----------------------------------------------------------------
def check_adam_hides_the_bug(bad, good, sgd_difference=None, loop=None):
    """05's exercise 3: ``bad``/``good`` are the flat weights after ``article_loop()`` / ``article_loop(fix=True)``
    with Adam (lr=1e-3). They must differ, by less than 1e-4: Adam's step m / (sqrt(v) + eps) hardly changes
    when every gradient is W times larger. ``sgd_difference``: the same difference with SGD, if measured.
    ``loop``: the lesson's ``article_loop``; when given (on the ranks, where it runs), both weights must equal
    a reference run of the same loops with ``torch.optim.Adam(lr=1e-3)``, so that another optimizer that also
    keeps the two runs close (SGD with a tiny learning rate, Adagrad) does not pass.
    Introduced in 05_manual_gradient_averaging."""
    __tracebackhide__ = True
    if bad is None or good is None:
        raise AssertionError("Set bad and good to the weights after article_loop() and article_loop(fix=True), "
                             "both run with Adam, then run the cell again.")
    if not (isinstance(bad, torch.Tensor) and isinstance(good, torch.Tensor)) or bad.shape != good.shape:
        raise AssertionError("bad and good must be the two flat weight tensors that article_loop returns second "
                             "(its return value is (first gradient, weights)).")
    diff = (bad - good).abs().max().item()
    if bad is good or diff == 0:
        raise AssertionError("bad and good are identical: run the loop twice, once as the article wrote it "
                             "(fix=False) and once fixed (fix=True).")
    if diff >= 1e-4:
        hint = f" (SGD's was {sgd_difference:.3g})" if sgd_difference is not None else ""
        raise AssertionError(f"The weights differ by {diff:.3g}{hint}: that is the size of the W-times-too-large "
                             "gradient under SGD. Build the optimizer as torch.optim.Adam(model.parameters(), lr=1e-3) "
                             "in both runs.")
    if loop is not None:
        _, ref_bad = loop(make_optimizer=solution_make_adam)
        _, ref_good = loop(fix=True, make_optimizer=solution_make_adam)

        def near(a, b):
            return torch.allclose(a, b, rtol=1e-9, atol=1e-12)

        if near(bad, ref_good) and near(good, ref_bad):
            raise AssertionError("bad and good are swapped: bad is article_loop() as the article wrote it, good is "
                                 "article_loop(fix=True).")
        if not (near(bad, ref_bad) and near(good, ref_good)):
            off = max((bad - ref_bad).abs().max().item(), (good - ref_good).abs().max().item())
            raise AssertionError(
                f"The two runs stay close ({diff:.3g} apart), but these are not Adam's weights: they are "
                f"{off:.3g} away from the same loops run with torch.optim.Adam(params, lr=1e-3). A tiny "
                "learning rate, or another optimizer that rescales the step (Adagrad, RMSprop), also keeps "
                "the runs close, for another reason: the exercise is about Adam's m / (sqrt(v) + eps).")


# -- the course's solutions (try your own first) ---------------------------------------------------
def solution_scale_then_sum(model, micro_batches):
    """Exercise 1: the mean loss of each micro-batch, each gradient scaled by 1/(K x W), THEN summed."""
    import torch.distributed as dist
    import torch.nn.functional as F

    for x, y in micro_batches:
        F.mse_loss(model(x), y).backward()
    for p in model.parameters():
        p.grad /= len(micro_batches) * dist.get_world_size()
        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)


def solution_bucketed(model, micro_batches, bucket_numel=16):
    """Exercise 2: one all-reduce per bucket of at most ``bucket_numel`` elements, in reverse parameter order."""
    import torch.distributed as dist
    import torch.nn.functional as F

    for x, y in micro_batches:
        (F.mse_loss(model(x), y) / len(micro_batches)).backward()
    buckets, current = [], []
    for p in reversed(list(model.parameters())):
        if current and sum(g.numel() for g in current) + p.numel() > bucket_numel:
            buckets.append(current)
            current = []
        current.append(p.grad)
    buckets.append(current)
    for grads in buckets:
        flat = torch.cat([g.flatten() for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.AVG)
        for g, piece in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(piece.view_as(g))


def solution_tokens_in_one_all_reduce(model, micro_batches):
    """Exercise 4: per-sample losses summed, the gradients and this rank's count in ONE all-reduce, then / N."""
    import torch.distributed as dist
    import torch.nn.functional as F

    for x, y in micro_batches:
        F.mse_loss(model(x), y, reduction="sum").backward()
    grads = [p.grad for p in model.parameters()]
    n_local = torch.tensor([float(sum(len(x) for x, _ in micro_batches))], dtype=grads[0].dtype)
    flat = torch.cat([g.flatten() for g in grads] + [n_local])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    flat = flat[:-1] / flat[-1]
    for g, piece in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(piece.view_as(g))


def solution_accumulate_and_average(model, micro_batches):
    """The lesson's own averaging step: mean loss / K per micro-batch, then SUM over the ranks / W."""
    import torch.distributed as dist
    import torch.nn.functional as F

    accum_steps = len(micro_batches)
    for x, y in micro_batches:
        (F.mse_loss(model(x), y) / accum_steps).backward()
    for p in model.parameters():
        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
        p.grad /= dist.get_world_size()


def solution_one_all_reduce(model, micro_batches):
    """Lesson 01's flat all-reduce: every gradient flattened into one buffer, one all-reduce, copied back."""
    import torch.distributed as dist
    import torch.nn.functional as F

    accum_steps = len(micro_batches)
    for x, y in micro_batches:
        (F.mse_loss(model(x), y) / accum_steps).backward()
    grads = [p.grad for p in model.parameters()]
    flat = torch.cat([g.flatten() for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.AVG)
    for g, piece in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(piece.view_as(g))


def solution_make_adam(params):
    """Exercise 3: the optimizer that hides the article's bug."""
    return torch.optim.Adam(params, lr=1e-3)


def solution_token_weighted(model, micro_batches):
    """The lesson's sum over a global count: per-sample losses / the global sample count, then SUM over ranks."""
    import torch.distributed as dist
    import torch.nn.functional as F

    n_global = torch.tensor(float(sum(len(x) for x, _ in micro_batches)), dtype=torch.float64)
    dist.all_reduce(n_global)
    for x, y in micro_batches:
        (F.mse_loss(model(x), y, reduction="sum") / n_global).backward()
    for p in model.parameters():
        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
