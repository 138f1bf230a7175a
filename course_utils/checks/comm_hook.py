"""``check_comm_hook``: does a DDP comm hook produce DDP's averaged gradients?

Introduced in 08_comm_hooks (``check_fp16_powersgd_bytes`` and ``check_tightest_rtol``: 09_compression's
exercises). This module imports ``course_utils.hooks``, never the other way round. Called from the notebook
process; the ranks train a small model twice, once with DDP's built-in all-reduce and once with the hook,
and the notebook compares.
"""
import math

__all__ = ["check_comm_hook", "check_fp16_wrapper", "check_fp16_powersgd_bytes", "check_tightest_rtol"]

_CLUSTERS = {}  # world_size -> Cluster started by this checker, reused across calls


def _cluster_for(world_size):
    """The %%ddp cluster when one is running (and no size is asked), else one cached per size."""
    try:
        from course_utils.engine import magic

        running = magic._CLUSTER
    except (ImportError, AttributeError):
        running = None
    if running is not None and running.alive and running.world_size >= 2 and (
            world_size is None or world_size == running.world_size):
        return running
    size = world_size or 2
    cluster = _CLUSTERS.get(size)
    if cluster is None or not cluster.alive:
        from course_utils import Cluster

        cluster = _CLUSTERS[size] = Cluster(world_size=size, backend="gloo")
    return cluster


def _short_error(exc):
    """'Type: message' without torch's trailing 'At:' frames (their file names vary by machine)."""
    msg = str(exc).split("\n\nAt:")[0].strip()
    return f"{type(exc).__name__}: {msg}"


def _recording_all_reduce(ops):
    """Patch dist.all_reduce so that each call appends its op's name to ``ops``; returns an undo."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    saved = [(m, m.all_reduce) for m in (dist, c10d)]

    def recorded(*args, _original=c10d.all_reduce, **kwargs):
        op = args[1] if len(args) > 1 else kwargs.get("op", dist.ReduceOp.SUM)
        ops.append(str(op).split(".")[-1].upper())
        return _original(*args, **kwargs)

    for m, _ in saved:
        m.all_reduce = recorded

    def undo():
        for m, original in saved:
            m.all_reduce = original
    return undo


def _on_rank(hook, state, steps, seed, lr):
    """Runs on every rank: gradients of DDP's all-reduce and of the hook, step by step, and the ops of the
    all-reduces the hook called."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from course_utils.data import make_regression
    from course_utils.hooks import flat_grad
    from course_utils.models import make_model

    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    reference = DDP(make_model(seed).to(device))
    tested = DDP(make_model(seed).to(device))
    out = {"grads": [], "error": None, "ops": []}
    try:
        if callable(state):
            state = state()  # a factory: each rank builds its own state (PowerSGD keeps per-rank errors)
        tested.register_comm_hook(state, hook)
    except Exception as exc:
        out["error"] = ("registering the hook", _short_error(exc))
        return out
    for step in range(steps):
        x, y = make_regression(n=8 * world, d_in=16, seed=1000 + step)
        x, y = x[rank::world].to(device), y[rank::world].to(device)  # each rank its own shard
        reference.zero_grad()
        torch.nn.functional.mse_loss(reference(x), y).backward()
        tested.zero_grad()
        undo = _recording_all_reduce(out["ops"])
        try:
            torch.nn.functional.mse_loss(tested(x), y).backward()
        except Exception as exc:
            out["error"] = (f"step {step}", _short_error(exc))
            return out
        finally:
            undo()
        out["grads"].append((flat_grad(reference).cpu(), flat_grad(tested).cpu()))
        with torch.no_grad():  # both models take the reference step: they stay identical
            for p, q in zip(reference.parameters(), tested.parameters()):
                p -= lr * p.grad
                q.copy_(p)
    return out


def _hint(message):
    if message.startswith("NotImplementedError"):
        return " Hint: the hook is still the exercise's scaffold: write it, then run the cell again."
    if "return annotation" in message:
        return (" Hint: DDP inspects the hook's annotations: write "
                "'-> torch.futures.Future[torch.Tensor]' or leave the return annotation out.")
    if "'list'" in message:
        return (" Hint: fut.value() of an all-reduce future is a LIST holding one tensor: "
                "use fut.value()[0].")
    if "must be a single tensor" in message or "single tensor" in message:
        return " Hint: the future must hold ONE tensor, the reduced bucket buffer (same shape as bucket.buffer())."
    if "shape" in message or "size" in message:
        return " Hint: the future's tensor must have the shape of bucket.buffer()."
    return ""


def _diagnose(got, ref, world_size, rtol):
    """A sentence explaining how ``got`` differs from ``ref`` (both float64 vectors)."""
    from course_utils.hooks import relative_error

    ref_sq = float(ref.dot(ref))
    scale = float(got.dot(ref)) / ref_sq if ref_sq > 0 else 0.0

    if float(got.norm()) == 0.0:
        return ("the hook's gradients are all ZERO: did the future return a fresh tensor that was never "
                "filled, or the buffer before the all-reduce finished?")
    residual = relative_error(got, scale * ref) if scale != 0 else math.inf
    if residual <= max(rtol, 1e-4) and abs(scale - 1) > 1e-2:  # a scaled copy (a factor near 1 is a near miss)
        if abs(scale - world_size) <= 1e-3 * world_size:
            return (f"the hook returns the SUM of the ranks' gradients, {world_size} (= world_size) times the "
                    "mean DDP uses. DDP does not divide for you: divide the bucket by world_size "
                    "(before the all-reduce, to avoid overflow in low precision).")
        if abs(scale - 1 / world_size) <= 1e-3 / world_size:
            return (f"the hook's gradients are 1/{world_size} of DDP's: it divides by world_size twice.")
        return (f"the hook's gradients are {scale:.4g} times DDP's (same direction, wrong scale). "
                f"Look for a factor applied on one side of the all-reduce and not undone on the other.")
    err = relative_error(got, ref)
    if err < 0.5:
        return (f"the hook's gradients are close to DDP's average but not within the tolerance: relative "
                f"error {err:.1e}, allowed rtol={rtol:g}. A lossy (compressed) hook is never exact: if "
                "that is what you wrote, pass an rtol that admits the rounding of the dtype it sends (how many "
                "significant bits does that dtype keep?).")
    return (f"the hook's gradients differ from DDP's average by a relative error of {err:.2e} "
            f"(allowed: rtol={rtol:g}), and they are not a scaled copy either: garbage. Is every rank "
            "reducing the same elements, and is the result copied back in the right order?")


def check_comm_hook(hook, state=None, rtol=1e-5, *, steps=3, world_size=None, cluster=None,
                    seed=0, lr=0.1, timeout=60, quiet=False, op=None):
    """Check that DDP with ``hook`` gives the gradients of DDP's default all-reduce.

    Introduced in 08_comm_hooks. Each rank trains a TinyMLP for ``steps`` steps on its own shard
    of a regression batch, twice: with DDP's built-in all-reduce and with
    ``register_comm_hook(state, hook)``. After each step both models take the same (reference)
    SGD step, so every step compares like with like. DDP rebuilds its buckets after step 0, as
    in real training (this small model's gradients fit in one bucket).

    - ``state``: passed to ``register_comm_hook``; a zero-argument callable (e.g. a lambda
      building a ``PowerSGDState``) is called on each rank to build a fresh per-rank state.
    - ``rtol``: allowed relative error ``||g_hook - g_ddp|| / ||g_ddp||`` per step. The default
      suits lossless hooks; loosen it for compressed ones, by as much as the dtype they send rounds
      (09_compression's exercise 2 finds the tightest for fp16 and bf16), PowerSGD more.
    - Runs on the ``%%ddp`` cluster when one is running, else on a ``world_size``-rank cluster
      (default 2) that is started once and reused; or pass ``cluster=``.

    - ``op="AVG"`` (08's exercise 1): every ``dist.all_reduce`` the hook calls must use
      ``ReduceOp.AVG``, so that the hook has no division of its own to get wrong.

    Raises ``AssertionError`` explaining what is wrong: the hook raised (with the rank's
    exception), returned the sum (off by a factor of world_size), or returned garbage.
    Prints one line when the hook is right.
    """
    __tracebackhide__ = True
    import torch

    name = getattr(hook, "__name__", repr(hook))
    if not callable(hook):
        raise AssertionError(f"check_comm_hook: {name} is not a function. Pass the hook itself: "
                             "check_comm_hook(my_hook), not check_comm_hook(my_hook(...)).")
    cluster = cluster or _cluster_for(world_size)
    world = cluster.world_size
    from course_utils import DistributedTimeout

    try:
        results = cluster.run(_on_rank, hook, state, steps, seed, lr, timeout=timeout)
    except DistributedTimeout as exc:
        raise AssertionError(
            f"{name} did not finish within {timeout:g} s on {world} ranks: a hook that waits forever usually "
            "issues different collectives on different ranks (e.g. one inside `if rank == 0:`), or "
            f"waits on a future that never completes.\n{exc.summary}") from None

    for r, res in enumerate(results):
        if res["error"] is not None:
            when, message = res["error"]
            raise AssertionError(f"{name} raised on rank {r} ({when}): {message.rstrip('.')}.{_hint(message)}")
    if op is not None:
        for r, res in enumerate(results):
            if not res["ops"]:
                raise AssertionError(
                    f"{name} called no dist.all_reduce on rank {r}: the exercise averages the bucket with one "
                    f"dist.all_reduce(..., op=dist.ReduceOp.{op}, async_op=True) (call it as dist.all_reduce, "
                    "so that the check can see it).")
            other = sorted(set(res["ops"]) - {op})
            if other:
                raise AssertionError(
                    f"{name} all-reduced with ReduceOp.{other[0]} on rank {r}: the exercise asks for "
                    f"op=dist.ReduceOp.{op}, which does the averaging inside the collective, and no division "
                    "of your own (a hook that divides and sums is lesson 08's section 3, already written).")
    for r, res in enumerate(results):
        for step, (_, got) in enumerate(res["grads"]):
            if not bool(torch.isfinite(got).all()):
                raise AssertionError(
                    f"{name} produced inf/nan gradients on rank {r} at step {step}: an overflow? "
                    "float16 overflows above 65504: divide by world_size BEFORE the all-reduce.")
    errors = []
    for step in range(steps):
        ref = results[0]["grads"][step][0]
        got0 = results[0]["grads"][step][1]
        for r in range(1, world):
            if not torch.equal(results[r]["grads"][step][1], got0):
                gap = (results[r]["grads"][step][1] - got0).abs().max().item()
                raise AssertionError(
                    f"{name}: after step {step}, rank {r}'s gradients differ from rank 0's (max gap {gap:.3g}). "
                    "After an all-reduce every rank must hold the same values: does the hook "
                    "communicate at all, and do all ranks do the same thing?")
        err = _relative(got0, ref)
        errors.append(err)
        if not err <= rtol:
            raise AssertionError(f"{name} is wrong at step {step} on {world} ranks: "
                                 + _diagnose(got0, ref, world, rtol))
    if not quiet:
        print(f"check_comm_hook: {name} matches DDP's all-reduce on {world} ranks over {steps} steps "
              f"(max relative error {_error_text(max(errors))}, rtol={rtol:g})")


def _error_text(err):
    """The error as printed: float32 rounding (< 1e-6) differs in its digits between CPUs and
    kernel instruction sets, so it is printed as a bound; a lossy hook's error with 2 digits."""
    return "< 1e-06" if err < 1e-6 else f"{err:.1e}"


def _relative(got, ref):
    from course_utils.hooks import relative_error

    return relative_error(got, ref)


def _probe_hook(state, bucket):
    """The hook ``check_fp16_wrapper`` wraps: DDP's averaging, noting the dtype it was handed."""
    import torch.distributed as dist

    state["dtypes"].append(str(bucket.buffer().dtype).replace("torch.", ""))
    buffer = bucket.buffer().div_(dist.get_world_size())
    fut = dist.all_reduce(buffer, async_op=True).get_future()
    return fut.then(lambda fut: fut.value()[0])


def _probe_state():
    return {"dtypes": []}


def _bytes_on_rank(wrapped, steps):
    """Runs on every rank: bytes per step of ``wrapped`` and the dtypes the inner hook saw."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from course_utils.data import make_regression
    from course_utils.hooks import ByteCounter
    from course_utils.models import make_model

    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    model = DDP(make_model(0).to(device))
    counter, state = ByteCounter(), _probe_state()
    model.register_comm_hook(state, counter.wrap(wrapped))
    x, y = make_regression(n=8 * world, d_in=16, seed=7)
    for _ in range(steps):
        model.zero_grad()
        torch.nn.functional.mse_loss(model(x[rank::world].to(device)), y[rank::world].to(device)).backward()
    counter.close()
    dtypes = sorted({str(g.dtype).replace("torch.", "") for g in (p.grad for p in model.parameters())})
    return {"bytes": counter.bytes_per_step(), "inner_dtypes": state["dtypes"],
            "n_params": sum(p.numel() for p in model.parameters()), "grad_dtypes": dtypes}


def check_fp16_wrapper(wrap, rtol=1e-3, *, world_size=None, cluster=None, timeout=60):
    """Self-check of 08's exercise 2: ``wrap(hook)`` must return a hook that runs ``hook`` on a
    float16 copy of the bucket, so that it averages like DDP (within ``rtol``) and puts 2 bytes
    per gradient on the wire.

    Introduced in 08_comm_hooks. The wrapped hook is a probe that averages as DDP does and notes
    the dtype it is handed; ``check_comm_hook`` compares the gradients, a ``ByteCounter`` counts the
    bytes. Raises ``AssertionError`` explaining what is wrong; prints one line when it is right.
    """
    __tracebackhide__ = True
    name = getattr(wrap, "__name__", repr(wrap))
    try:
        wrapped = wrap(_probe_hook)
    except NotImplementedError as exc:
        raise AssertionError(f"{name} is not written yet ({exc}). Write it, then run the cell again.") from None
    if not callable(wrapped):
        raise AssertionError(f"{name}(hook) returned {wrapped!r}, not a hook: return the function you defined "
                             "inside it (without calling it).")
    cluster = cluster or _cluster_for(world_size)
    check_comm_hook(wrapped, state=_probe_state, rtol=rtol, cluster=cluster, timeout=timeout, quiet=True)
    res = cluster.run(_bytes_on_rank, wrapped, 2, timeout=timeout)[0]
    n, seen, sent = res["n_params"], res["inner_dtypes"], res["bytes"]
    if not seen:
        raise AssertionError(f"{name}: the hook it wraps was never called. The wrapper must call hook(state, bucket) "
                             "and return (a future derived from) its future.")
    if set(seen) != {"float16"}:
        raise AssertionError(f"{name}: the hook it wraps was handed a {'/'.join(sorted(set(seen)))} bucket, so it sent "
                             f"{sent[0]} bytes per step for {n} gradients ({sent[0] / n:g} per gradient). Hand it the "
                             "float16 copy: bucket.set_buffer(buffer.to(torch.float16)) before calling it.")
    if sent != [2 * n] * len(sent):
        raise AssertionError(f"{name}: {sent} bytes per step for {n} gradients; float16 is 2 bytes per gradient "
                             f"({2 * n}). Does the wrapper issue collectives of its own?")
    print(f"check_fp16_wrapper: {name} averages like DDP to float16's rounding and sends {2 * n} bytes per step for "
          f"{n} gradients: 2 per gradient, half of float32")


# -- self-checks of 09_compression's exercises (the solutions live in course_utils.hooks) -----------

def check_fp16_powersgd_bytes(predicted, measured, model, rank=1):
    """Self-check of 09_compression exercise 1: ``predicted`` bytes per compressed step of
    ``fp16_compress_wrapper(powerSGD_hook)`` at ``rank``, against the bytes ``measured`` by a
    ``ByteCounter``. Raises ``AssertionError`` with a hint a learner can act on; quiet when right."""
    __tracebackhide__ = True  # noqa: F841 (IPython and pytest hide this frame)
    from course_utils.hooks import powersgd_numbers

    raw, compressed = powersgd_numbers(model, rank)
    right = 2 * (raw + compressed)
    if measured != right:
        raise AssertionError(f"the counter measured {measured} bytes per compressed step, but PowerSGD's rule "
                             f"gives {right}: was the hook fp16_compress_wrapper(powerSGD_hook) at rank {rank}, "
                             "measured after the warm-up steps?")
    if predicted is None:
        raise AssertionError("predicted_bytes is None: put your prediction (a whole number of bytes per "
                             "compressed step) in predicted_bytes, then run the cell again.")
    if isinstance(predicted, bool) or not isinstance(predicted, int):
        raise AssertionError(f"predicted_bytes = {predicted!r}: give a whole number of bytes, e.g. 1234.")
    if predicted == right:
        return
    total = sum(p.numel() for p in model.parameters() if p.requires_grad)
    hints = {
        4 * (raw + compressed): "that is PowerSGD's count in float32. fp16_compress_wrapper casts the bucket to "
                                "float16 before PowerSGD sees it: how many bytes is each number then?",
        2 * total: "that is the whole gradient in float16. The wrapper still runs PowerSGD inside it, which "
                   "sends low-rank factors for the large matrix, not the matrix itself.",
        4 * total: "that is the uncompressed float32 gradient: both the wrapper and PowerSGD shrink it.",
        2 * compressed: "you counted P and Q only. The tensors PowerSGD does not compress (the biases and the "
                        "matrices too small to be worth it) are all-reduced too.",
        2 * raw: "you counted the uncompressed tensors only: add P and Q, (m + n) x r numbers for each "
                 "compressed m x n matrix.",
    }
    raise AssertionError(f"predicted_bytes = {predicted} is not what was sent. " + hints.get(
        predicted, "Count the numbers PowerSGD all-reduces per compressed step (the tensors it leaves alone, "
                   "then P and Q: (m + n) x r for each compressed m x n matrix) and multiply by the bytes per "
                   "number after the wrapper's cast."))


_SIGNIFICANT_BITS = {"fp16_hook": ("float16", 11), "bf16_hook": ("bfloat16", 8)}


def check_tightest_rtol(rtol, hook=None, **check_kwargs):
    """Self-check of 09_compression exercise 2: is ``rtol`` the tightest power of ten for which
    ``check_comm_hook(hook, rtol=rtol)`` passes (``hook`` defaults to ``fp16_hook``; the exercise asks it for
    ``fp16_hook`` and for ``bf16_hook``)?

    Runs the checker at ``rtol`` and at ``rtol / 10``. ``check_kwargs`` go to ``check_comm_hook``
    (e.g. ``cluster=``). Raises ``AssertionError`` with what is wrong, never the answer; quiet when right."""
    __tracebackhide__ = True  # noqa: F841
    from course_utils.hooks import fp16_hook

    hook = fp16_hook if hook is None else hook
    name = getattr(hook, "__name__", repr(hook))
    dtype, bits = _SIGNIFICANT_BITS.get(name, ("the dtype it sends", None))
    if rtol is None:
        raise AssertionError(f"the rtol for {name} is None: set it to the tightest power of ten (1e-1, 1e-2, ...) "
                             f"for which check_comm_hook({name}, rtol=...) passes, then run the cell again.")
    if isinstance(rtol, bool) or not isinstance(rtol, (int, float)) or not rtol > 0 or not math.isclose(
            10.0 ** round(math.log10(rtol)), rtol, rel_tol=1e-9):
        raise AssertionError(f"rtol = {rtol!r} for {name} is not a power of ten: the question asks for one of "
                             "1e-1, 1e-2, 1e-3, ..., the tightest that passes.")
    try:
        check_comm_hook(hook, rtol=rtol, quiet=True, **check_kwargs)
    except AssertionError:
        why = (f"How large is {dtype}'s rounding error relative to the number it rounds ({bits} significant bits)?"
               if bits else "How large is the rounding of the dtype it sends?")
        if name == "bf16_hook" and rtol < 1e-2:
            why += " bfloat16 keeps 3 significant bits fewer than float16: 8x its rounding error."
        raise AssertionError(f"rtol={rtol:g} is too tight: check_comm_hook rejects {name} with it. {why} "
                             "Loosen it.") from None
    try:
        check_comm_hook(hook, rtol=rtol / 10, quiet=True, **check_kwargs)
    except AssertionError:
        return
    raise AssertionError(f"rtol={rtol:g} passes for {name}, but so does rtol={rtol / 10:g}: the question asks for "
                         "the tightest power of ten. Tighten it.")
