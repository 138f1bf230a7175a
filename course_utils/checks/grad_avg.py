"""Checker for the gradient-averaging exercise.

Introduced in 05_manual_gradient_averaging::

    def accumulate_and_average(model, micro_batches):
        ...  # forward/backward on each (x, y), then average the gradients across ranks

    check_grad_averaging(accumulate_and_average)

The learner's function runs on every rank of a real process group. Each rank gets the same
model (float64) and its own ``accum_steps`` micro-batches of ``micro_batch_size`` samples. After
the call, every rank's ``p.grad`` must equal the gradient of the mean-squared error (mean over
samples) of ONE process on the whole global batch of ``micro_batch_size x accum_steps x
world_size`` samples. When it does not, the AssertionError says by which factor the gradient is
off and which division (or collective) that factor points to.
"""
import itertools
import math

import torch

__all__ = ["check_grad_averaging"]

D_IN = 16
RTOL = 1e-9  # the check runs in float64: a right answer agrees to ~1e-15, a factor is off by 10% or more

_CLUSTERS = {}  # world_size -> Cluster, reused across calls when no %%ddp cluster is running


def _pick_sizes(world_size):
    """accum_steps and micro_batch_size chosen so that W, K, B and their products are all distinct."""
    for k, b in itertools.product((3, 2, 5, 7), (5, 7, 11, 13, 17)):
        factors = [w * kk * bb for w, kk, bb in itertools.product((1, world_size), (1, k), (1, b))]
        if len(set(factors)) == len(factors):
            return k, b
    return 3, 5


def _cases(world_size):
    k, b = _pick_sizes(world_size)
    return [dict(accum_steps=k, micro_batch_size=b, seed=1), dict(accum_steps=1, micro_batch_size=b, seed=2)]


def _case_data(case, world_size):
    """The global batch of a case: the same tensors on every rank and in the notebook."""
    from course_utils.data import make_regression

    n = case["micro_batch_size"] * case["accum_steps"] * world_size
    return make_regression(n=n, d_in=D_IN, seed=100 + case["seed"], dtype=torch.float64)


def _model(case):
    from course_utils.models import make_model

    return make_model(seed=case["seed"], d_in=D_IN, d_hidden=8).double()


def _reference(case, world_size):
    """One process, the whole global batch, mean loss: the gradient every rank must end with."""
    import torch.nn.functional as F

    x, y = _case_data(case, world_size)
    model = _model(case)
    F.mse_loss(model(x), y).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def _run_on_rank(fn, cases):
    """Runs on every rank: call ``fn(model, micro_batches)`` for each case, return the gradients."""
    import torch.distributed as dist

    rank, world_size = dist.get_rank(), dist.get_world_size()
    out = []
    for case in cases:
        x, y = _case_data(case, world_size)
        k, b = case["accum_steps"], case["micro_batch_size"]
        per_rank = k * b
        x, y = x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank]
        micro_batches = [(x[i * b:(i + 1) * b], y[i * b:(i + 1) * b]) for i in range(k)]
        model = _model(case)
        fn(model, micro_batches)
        out.append({name: None if p.grad is None else p.grad.detach().clone()
                    for name, p in model.named_parameters()})
    return out


def _flat(grads):
    return torch.cat([g.flatten() for g in grads.values()])


def _explain_factor(ratio, world_size, accum_steps, micro_batch_size):
    """Name the mistake behind a gradient that is ``ratio`` times the right one, or return None."""
    names = {
        (1, 0, 0): "world_size. The all_reduce(SUM) adds up the W ranks' gradients: divide by world_size "
                   "after it, or use op=dist.ReduceOp.AVG",
        (-1, 0, 0): "1/world_size. You divided by world_size twice: ReduceOp.AVG already divides",
        (0, 1, 0): "accum_steps. backward() adds up the gradients of the K micro-batches: divide each "
                   "micro-batch's loss by accum_steps = len(micro_batches)",
        (0, -1, 0): "1/accum_steps. You divided by accum_steps twice",
        (0, 0, 1): "micro_batch_size. The loss is a SUM over samples: use the mean "
                   "(F.mse_loss(..., reduction='mean'), the default)",
        (1, 1, 0): "world_size x accum_steps. Neither division is there: divide each micro-batch's loss by "
                   "accum_steps and the all-reduced gradient by world_size",
    }
    for (a, b, c), text in names.items():
        factor = world_size ** a * accum_steps ** b * micro_batch_size ** c
        if math.isclose(ratio, factor, rel_tol=1e-6):
            return factor, text
    for a, b, c in itertools.product((-1, 0, 1), (-1, 0, 1), (-1, 0, 1)):  # any other combination
        factor = world_size ** a * accum_steps ** b * micro_batch_size ** c
        if (a, b, c) != (0, 0, 0) and math.isclose(ratio, factor, rel_tol=1e-6):
            parts = [f"{n}{'' if e == 1 else '^-1'}" for n, e in
                     (("world_size", a), ("accum_steps", b), ("micro_batch_size", c)) if e]
            return factor, " x ".join(parts)
    return None


def _size_word(factor):
    """4.0 -> '4x too large', 0.25 -> '4x too small'."""
    return f"{factor:.4g}x too large" if factor >= 1 else f"{1 / factor:.4g}x too small"


def _compare(rank_grads, ref, case, world_size):
    """An explanation of what is wrong in one case, or None when every rank is right."""
    k, b = case["accum_steps"], case["micro_batch_size"]
    where = f"(case: world_size={world_size}, accum_steps={k}, micro_batch_size={b})"
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
    right = [torch.allclose(f, ref_flat, rtol=RTOL, atol=RTOL * ref_norm) for f in flats]
    if all(right):
        return None

    def describe(flat, ref_vec):
        norm, rnorm = flat.norm().item(), ref_vec.norm().item()
        if norm == 0:
            return "all zero (did you zero the gradients after averaging them?)"
        ratio = norm / rnorm
        if (flat @ ref_vec).item() / (norm * rnorm) > 1 - 1e-9:  # same direction: a pure factor
            named = _explain_factor(ratio, world_size, k, b)
            if named:
                return f"{_size_word(named[0])}: the factor is {named[1]}"
            return (f"{_size_word(ratio)}, in the right direction (a hard-coded number? use len(micro_batches) "
                    "and dist.get_world_size())")
        rel = (flat - ref_vec).norm().item() / rnorm
        return f"wrong: relative error {rel:.3g}, not a simple factor (norm ratio {ratio:.4g})"

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

    # every rank agrees, and is wrong: is it one parameter, or all of them by the same factor?
    per_param = {name: describe(g.flatten(), ref[name].flatten()) for name, g in rank_grads[0].items()
                 if not torch.allclose(g, ref[name], rtol=RTOL, atol=RTOL * ref_norm)}
    if len(per_param) < len(ref):
        wrong = ", ".join(f"{n} is {d}" for n, d in per_param.items())
        return (f"Some parameters are right and others are not {where}: {wrong}. "
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
        c = _CLUSTERS[world_size] = Cluster(world_size=world_size)
    return c


def check_grad_averaging(fn, cluster=None, world_size=None, timeout=30):
    """Check ``fn(model, micro_batches)`` against one process on the whole batch; raise AssertionError if wrong.

    Introduced in 05_manual_gradient_averaging. ``micro_batches`` is this rank's list of
    ``accum_steps`` pairs ``(x, y)``; the loss is ``F.mse_loss(model(x), y)`` (mean over samples).
    After ``fn`` returns, every rank's ``p.grad`` must be the gradient of the mean loss over all
    ``micro_batch_size x accum_steps x world_size`` samples. Two cases run: accum_steps > 1 and
    accum_steps = 1.

    The ranks are ``cluster`` if given; else, in a notebook, the ``%%ddp`` cluster (a 2-rank one
    is started if none runs); else a ``Cluster(world_size or 2)`` kept for the next call. An error
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
    cases = _cases(ws)
    try:
        results = cluster.run(_run_on_rank, fn, cases, timeout=timeout)
    except DistributedTimeout as exc:
        raise AssertionError(
            f"Your function hung: {exc.summary.split(' (')[0]}. A collective waits until EVERY rank calls it, "
            "in the same order: is an all_reduce inside `if rank == 0:`, or called a different number of "
            "times on different ranks?") from None
    for i, case in enumerate(cases):
        problem = _compare([results[r][i] for r in range(ws)], _reference(case, ws), case, ws)
        if problem:
            raise AssertionError(problem)
