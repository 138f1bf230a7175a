"""Self-checks of 06_ddp_accumulation_no_sync's exercises, and the course's solutions to them. Both checks run on
every rank (inside a ``%%ddp`` cell).

- ``check_sync_prediction``: exercise 1, all-reduces and bytes per optimizer step with and without ``no_sync()``,
  counted on the ranks (``solution_sync_prediction`` is the course's answer);
- ``check_accumulate``: exercise 2, one all-reduce for micro-batches of unequal size, by setting
  ``require_backward_grad_sync`` by hand (``accumulate_with_flag`` is the course's answer).
"""
import torch

__all__ = ["check_sync_prediction", "check_accumulate", "solution_sync_prediction", "accumulate_with_flag",
           "MICRO_BATCH_SIZES"]


def accumulate_with_flag(model, batches):
    """The course's solution of 06's exercise 2: one all-reduce for the micro-batches of ``batches``, which may
    hold different numbers of samples, with ``require_backward_grad_sync`` set by hand (no ``no_sync()``), and
    the gradient of the mean loss over all the rank's samples.

    Introduced in 06_ddp_accumulation_no_sync (used when ``USE_SOLUTION = True``)."""
    import torch.nn.functional as F

    n_samples = sum(len(xb) for xb, _ in batches)
    for k, (xb, yb) in enumerate(batches):
        model.require_backward_grad_sync = k == len(batches) - 1   # before the forward: DDP reads it there
        share = len(xb) / n_samples                                 # a micro-batch weighs as many samples as it has
        (share * F.mse_loss(model(xb), yb)).backward()


def _count_sync(accum_steps, use_no_sync, seed=0):
    """On every rank: all-reduces and bytes handed to them in one optimizer step of accum_steps micro-steps on a
    DDP-wrapped TinyMLP, with ``no_sync()`` around the first K-1 forwards and backwards or without it."""
    from contextlib import nullcontext

    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from course_utils.data import make_regression
    from course_utils.models import make_model

    counter = {"all_reduces": 0, "bytes": 0}

    def hook(state, bucket):
        state["all_reduces"] += 1
        state["bytes"] += bucket.buffer().numel() * bucket.buffer().element_size()
        buf = bucket.buffer().div_(dist.get_world_size())
        return dist.all_reduce(buf, async_op=True).get_future().then(lambda f: f.value()[0])

    model = DDP(make_model(seed=0))
    model.register_comm_hook(counter, hook)
    x, y = make_regression(n=16 * dist.get_world_size() * accum_steps, d_in=16, seed=seed)
    xs, ys = x.chunk(dist.get_world_size())[dist.get_rank()], y.chunk(dist.get_world_size())[dist.get_rank()]
    for k, (xb, yb) in enumerate(zip(xs.chunk(accum_steps), ys.chunk(accum_steps))):
        last = k == accum_steps - 1
        with nullcontext() if (last or not use_no_sync) else model.no_sync():
            (F.mse_loss(model(xb), yb) / accum_steps).backward()
    return counter, sum(p.numel() * p.element_size() for p in model.parameters())


def solution_sync_prediction(accum_steps=8):
    """06's exercise 1, the course's answer: K all-reduces of the whole gradient without no_sync, one with it."""
    from course_utils.models import make_model

    grad_bytes = sum(p.numel() * p.element_size() for p in make_model(seed=0).parameters())
    return ({"without no_sync": accum_steps, "with no_sync": 1},
            {"without no_sync": accum_steps * grad_bytes, "with no_sync": grad_bytes})


def check_sync_prediction(predicted, predicted_bytes, accum_steps=8):
    """Self-check of 06's exercise 1; call it on every rank (inside a ``%%ddp`` cell). ``predicted`` and
    ``predicted_bytes`` map "without no_sync" and "with no_sync" to the all-reduces per optimizer step of
    ``accum_steps`` micro-steps, and to the bytes handed to them; both runs are counted here, on this lesson's
    ranks. Raises ``AssertionError`` saying what is wrong (never the number); rank 0 prints one line when both
    are right. Introduced in 06_ddp_accumulation_no_sync."""
    __tracebackhide__ = True
    import torch.distributed as dist

    keys = ("without no_sync", "with no_sync")
    for name, value in (("predicted", predicted), ("predicted_bytes", predicted_bytes)):
        if not isinstance(value, dict) or set(value) != set(keys):
            raise AssertionError(f"{name} must be a dict with the keys {list(keys)}, got {value!r}.")
        missing = [k for k in keys if value[k] is None]
        if missing:
            raise AssertionError(f"{name}: fill in your prediction for {missing} (numbers, for accum_steps = "
                                 f"{accum_steps}), then run the cell.")
    measured = {k: _count_sync(accum_steps, use_no_sync=(k == "with no_sync")) for k in keys}
    grad_bytes = measured["with no_sync"][1]
    for k in keys:
        got = measured[k][0]["all_reduces"]
        if predicted[k] != got:
            why = ("DDP arms the reduction in every forward that runs outside no_sync(), and this model's "
                   "gradients fit in one bucket: how many backwards reduced?" if k == "without no_sync" else
                   "inside no_sync() DDP only accumulates; which micro-step's forward and backward ran outside it?")
            raise AssertionError(f"{k}: you predicted {predicted[k]} all-reduces per step, the ranks counted "
                                 f"otherwise. {why}")
    for k in keys:
        got = measured[k][0]["bytes"]
        if predicted_bytes[k] != got:
            raise AssertionError(f"{k}: you predicted {predicted_bytes[k]!r} bytes, the ranks counted otherwise. "
                                 f"Each all-reduce hands the whole gradient over: one float32 per parameter "
                                 f"({grad_bytes // 4:,} parameters here, 4 bytes each), times the all-reduces.")
    if dist.get_rank() == 0:
        print(f"self-check passed: both predictions match what the ranks counted for accum_steps = {accum_steps}")


MICRO_BATCH_SIZES = (8, 24, 40, 56)   # 06's exercise 2: one rank's 128 samples in micro-batches of unequal size


def check_accumulate(accumulate, sizes=MICRO_BATCH_SIZES, seed=0):
    """Self-check of 06's exercise 2; call it on every rank (inside a ``%%ddp`` cell).

    ``accumulate(model, batches)`` must run forward and backward over the micro-batches of
    ``batches`` (a list of ``(x, y)`` holding ``sizes`` samples each, unequal) with exactly ONE all-reduce,
    at the last micro-step, by setting ``model.require_backward_grad_sync`` itself (not with
    ``model.no_sync()``), and leave in ``.grad`` the gradient of the mean loss over every rank's samples.
    Raises ``AssertionError`` saying what is wrong; rank 0 prints one line when it is right.

    Introduced in 06_ddp_accumulation_no_sync.
    """
    __tracebackhide__ = True
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from course_utils.data import make_regression
    from course_utils.models import make_model

    rank, world = dist.get_rank(), dist.get_world_size()
    K, per_rank = len(sizes), sum(sizes)
    x, y = make_regression(n=per_rank * world, d_in=16, seed=seed)

    def flat_grad(loss_of):
        one = make_model(seed=0)
        loss_of(one).backward()
        return torch.cat([p.grad.reshape(-1) for p in one.parameters()])

    shards = [list(zip(xr.split(list(sizes)), yr.split(list(sizes)))) for xr, yr in zip(x.chunk(world), y.chunk(world))]
    ref = flat_grad(lambda m: F.mse_loss(m(x), y))          # one process, the whole batch
    # the typical wrong weightings, replayed in one process: each loss / K, and no division at all
    per_k = flat_grad(lambda m: sum(F.mse_loss(m(xb), yb) for shard in shards for xb, yb in shard) / (K * world))

    model = DDP(make_model(seed=0))
    seen = {"forwards": 0, "flags": [], "at_backward": [], "reduced_at": [], "no_sync": 0}

    def hook(state, bucket):
        state["reduced_at"].append(state["forwards"] - 1)  # the micro-step whose backward reduces
        fut = dist.all_reduce(bucket.buffer().div_(world), async_op=True).get_future()
        return fut.then(lambda f: f.value()[0])

    model.register_comm_hook(seen, hook)

    def before_forward(module, args):
        seen["forwards"] += 1
        seen["flags"].append(bool(module.require_backward_grad_sync))

    def after_forward(module, args, out):
        if isinstance(out, torch.Tensor) and out.requires_grad:    # the flag when this micro-step's backward runs
            out.register_hook(lambda grad: seen["at_backward"].append(bool(module.require_backward_grad_sync)))

    model.register_forward_pre_hook(before_forward)
    model.register_forward_hook(after_forward)
    real_no_sync = model.no_sync

    def recorded_no_sync():
        seen["no_sync"] += 1
        return real_no_sync()

    model.no_sync = recorded_no_sync                       # notice no_sync(): the exercise is without it
    batches = shards[rank]
    try:
        accumulate(model, batches)
    except NotImplementedError as exc:
        raise AssertionError(f"accumulate is not written yet ({exc}). Write the loop over the micro-batches, "
                             "then run the cell again.") from None
    if seen["no_sync"]:
        raise AssertionError("accumulate calls model.no_sync(): this exercise asks you to do what no_sync() does "
                             "by setting model.require_backward_grad_sync yourself.")
    if seen["forwards"] != K:
        raise AssertionError(f"accumulate ran {seen['forwards']} forward passes for {K} micro-batches: "
                             "one forward and one backward per micro-batch.")
    reduced_at = seen["reduced_at"]
    if reduced_at != [K - 1]:
        moved = seen["at_backward"] != seen["flags"]      # the flag changed between a forward and its backward
        if moved:
            why = (" The flag each forward saw was " + str(seen["flags"]) + ", and at each backward "
                   + str(seen["at_backward"]) + ": you set it AFTER the forward, so every forward obeyed the "
                   "previous micro-step's value. DDP reads the flag in forward: set it before calling the model.")
        elif reduced_at == [0]:
            why = (" The flag each forward saw was " + str(seen["flags"]) + ": True at the FIRST micro-step. That "
                   "all-reduce averaged micro-batch 0's gradient alone; the later ones stayed local on each rank. "
                   "The sync must come once every micro-batch's gradient is in .grad: True only at the last.")
        elif len(reduced_at) == K:
            why = (" The flag was True at every forward: set model.require_backward_grad_sync = False for the "
                   "first K-1 micro-steps and True for the last.")
        elif not reduced_at:
            why = " The flag was never True at a forward: the last micro-step must sync."
        else:
            why = f" The flag each forward saw: {seen['flags']}."
        raise AssertionError(f"{len(reduced_at)} all-reduce(s), at micro-step(s) {reduced_at} of 0..{K - 1}: "
                             f"expected exactly one, at the last micro-step ({K - 1})." + why)
    got = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    if not torch.allclose(got, ref, rtol=1e-4, atol=1e-6):
        if torch.allclose(got, per_k, rtol=1e-4, atol=1e-6):
            raise AssertionError(f"one all-reduce at the right micro-step, but each loss divided by K = {K} weighs "
                                 f"every micro-batch alike, and these hold {list(sizes)} samples: a sample of a small "
                                 "micro-batch counts more than one of a big one. Weight each micro-batch's mean loss "
                                 "by its share of the rank's samples.")
        if torch.allclose(got, K * per_k, rtol=1e-4, atol=1e-6):
            raise AssertionError("one all-reduce at the right micro-step, but the losses are not weighted at all: "
                                 "the gradients of the micro-batches' mean losses add up in .grad. Weight each "
                                 "micro-batch's mean loss by its share of the rank's samples before backward().")
        scale = float(got.dot(ref) / ref.dot(ref))
        raise AssertionError(f"one all-reduce at the right micro-step, but the gradients differ from the "
                             f"full-batch reference (they are {scale:.3g} times it along its direction): the mean "
                             "loss over all the rank's samples, one backward per micro-batch?")
    if rank == 0:
        print(f"self-check passed: {K} micro-batches of unequal size, 1 all-reduce at the last one, "
              "the full-batch gradient")
