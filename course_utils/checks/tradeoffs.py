"""Self-checks of 10_tradeoffs' exercises, and the course's solutions to them.

- ``check_accum_steps``: exercise 1, the smallest accum_steps whose exposed communication is below a share of the
  step, in the calibrated model (``smallest_accum_steps`` is the course's answer);
- ``check_weighted_sync``: exercise 2, run on every rank, a gradient sync for ranks holding unequal numbers of
  samples (``weighted_sync_solution`` is the course's answer).
"""
import functools

from course_utils.costmodel import predict

__all__ = ["check_accum_steps", "check_weighted_sync", "smallest_accum_steps", "weighted_sync_solution",
           "SHARE_TRIALS"]


# -- exercise 1: the smallest accum_steps --------------------------------------------------------------------------
def smallest_accum_steps(cal, *, world_size, params, micro_batch, share=0.10, overlap=False, limit=1_000_000):
    """Exercise 1's solution: the smallest accum_steps whose exposed communication is below ``share``."""
    for k in range(1, limit + 1):
        if predict(cal, world_size=world_size, params=params, micro_batch=micro_batch, accum_steps=k,
                   overlap=overlap).comm_share < share:
            return k
    raise ValueError(f"no accum_steps up to {limit} brings exposed communication below {share:.0%}")


def check_accum_steps(answer, cal, *, world_size, params, micro_batch, share=0.10):
    """Self-check of 10_tradeoffs exercise 1: is ``answer`` the smallest accum_steps with exposed
    communication below ``share`` of the step, in the model calibrated as ``cal``?

    Raises ``AssertionError`` with what is wrong; quiet when right."""
    __tracebackhide__ = True  # noqa: F841 (IPython and pytest hide this frame)
    if answer is None:
        raise AssertionError("answer is None: set it to the smallest accum_steps for which exposed "
                             f"communication is below {share:.0%} of the step, then run the cell again.")
    if isinstance(answer, bool) or not isinstance(answer, int) or answer < 1:
        raise AssertionError(f"answer = {answer!r}: accum_steps counts micro-batches per optimizer step, "
                             "a whole number >= 1.")

    def exposed(k):
        return predict(cal, world_size=world_size, params=params, micro_batch=micro_batch,
                       accum_steps=k).comm_share

    if not exposed(answer) < share:
        raise AssertionError(
            f"accum_steps={answer}: exposed communication is still {exposed(answer):.0%} of the step, not below "
            f"{share:.0%}. Each step has one all-reduce whatever K is, so more micro-batches per step dilute it: "
            "try a larger value.")
    if answer > 1 and exposed(answer - 1) < share:
        raise AssertionError(
            f"accum_steps={answer} is below {share:.0%}, but accum_steps={answer - 1} already is too "
            f"({exposed(answer - 1):.0%}): the question asks for the smallest. Step down until the share "
            f"reaches {share:.0%}.")


# -- exercise 2: a sync for unequal shares -------------------------------------------------------------------------
SHARE_TRIALS = ((24, 8), (5, 11))  # samples per rank in each of check_weighted_sync's trials (rank r: trial[r % 2])


def weighted_sync_solution(model, n_local):
    """Exercise 2's solution: after ``backward()`` of this rank's mean loss over its ``n_local`` samples, make every
    ``.grad`` the gradient of the mean loss over all ranks' samples: weigh by ``n_local``, sum, divide by the total.

    Runs on every rank. Introduced in 10_tradeoffs."""
    import torch
    import torch.distributed as dist

    total = torch.tensor([float(n_local)], dtype=torch.float64)
    dist.all_reduce(total)
    for p in model.parameters():
        p.grad.mul_(n_local)
        dist.all_reduce(p.grad)
        p.grad.div_(total.item())


def _share_grads(model_fn, x, y):
    import torch

    model = model_fn()
    torch.nn.functional.mse_loss(model(x), y).backward()
    return model, torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def check_weighted_sync(sync, *, d_in=8, d_hidden=16):
    """Self-check of 10_tradeoffs exercise 2, run on every rank: ``sync(model, n_local)``, called after
    ``backward()`` of each rank's mean loss over its own ``n_local`` samples (the ranks hold different counts),
    must leave on every rank the gradient of the mean loss over all ranks' samples, as one process computes it.
    Two trials with other shares (``SHARE_TRIALS``), so a total written as a number fails the second. A wrong
    result is compared with what the typical mistakes give (the rank's own gradient, the plain average, the sum,
    a division by the number of ranks) to name the mistake. Raises ``AssertionError``; quiet when right."""
    __tracebackhide__ = True  # noqa: F841
    import torch
    import torch.distributed as dist
    from course_utils.models import make_model

    rank, world_size = dist.get_rank(), dist.get_world_size()
    model_fn = functools.partial(make_model, 0, d_in=d_in, d_hidden=d_hidden)
    for trial, shares in enumerate(SHARE_TRIALS):
        counts = [shares[r % len(shares)] for r in range(world_size)]
        g = torch.Generator().manual_seed(trial)
        x, y = torch.randn(sum(counts), d_in, generator=g), torch.randn(sum(counts), 1, generator=g)
        starts = [sum(counts[:r]) for r in range(world_size)]
        own = [_share_grads(model_fn, x[s:s + n], y[s:s + n])[1] for s, n in zip(starts, counts)]
        reference = _share_grads(model_fn, x, y)[1]
        model, _ = _share_grads(model_fn, x[starts[rank]:starts[rank] + counts[rank]],
                                y[starts[rank]:starts[rank] + counts[rank]])
        sync(model, counts[rank])
        if any(p.grad is None for p in model.parameters()):
            raise AssertionError("after my_weighted_sync a parameter's .grad is None: change the gradients in "
                                 "place (p.grad), do not remove them.")
        got = torch.cat([p.grad.reshape(-1) for p in model.parameters()])

        def close(a, b):
            return torch.allclose(a, b, rtol=1e-4, atol=1e-7)

        if close(got, reference):
            continue
        where = f"with {' and '.join(map(str, counts))} samples on the {world_size} ranks"
        weighted = sum(n * o for n, o in zip(counts, own))
        if close(got, own[rank]):
            why = ("the gradient is still this rank's own: nothing was all-reduced. Every rank must end with the "
                   "gradient over every rank's samples.")
        elif close(got, sum(own) / world_size):
            why = (f"you averaged the ranks' mean gradients with equal weights, so rank 0's {counts[0]} samples "
                   f"count as much as rank 1's {counts[1]}. Each rank's mean gradient stands for n_local samples: "
                   "weigh it by that.")
        elif close(got, sum(own)):
            why = "you summed the ranks' mean gradients and never divided: that is no mean over the samples."
        elif close(got, weighted / world_size):
            why = ("you weighed each rank by n_local but divided by the number of ranks: divide by the total "
                   "number of samples, which no rank knows alone.")
        elif close(got, weighted):
            why = "you weighed each rank by n_local and summed, but never divided by the total number of samples."
        elif trial > 0 and close(got, weighted / sum(SHARE_TRIALS[0][r % 2] for r in range(world_size))):
            why = ("your total is the first trial's, written as a number: the shares change, so the total must come "
                   "from the ranks (all-reduce n_local).")
        else:
            err = ((got - reference).norm() / reference.norm()).item()
            why = (f"the gradient is off the one-process gradient over all {sum(counts)} samples by a relative "
                   f"{err:.1e}.")
        raise AssertionError(f"rank {rank}, {where}: {why}")
