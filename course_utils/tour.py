"""Lesson 00's exercise: its self-check and the course's solution (00_launcher_tour, exercise 2).

The solution is here, out of sight, so that the notebook's scaffold stays a scaffold;
``check_sum_of_squares(use_solution=True)`` checks it, as the stored notebook does.
"""


def sum_of_squares_solution():
    """The course's answer: each rank contributes its own square, one all-reduce adds them up."""
    import torch
    import torch.distributed as dist

    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    squares = torch.tensor([float(dist.get_rank() ** 2)], device=device)
    dist.all_reduce(squares)  # SUM is the default op
    return squares


def _probe(fn, use_solution):
    """Runs on every rank: call the learner's sum_of_squares (or the solution), recording each all_reduce's
    op, its input (before the call) and its result (after it). Returns (kind, detail, calls)."""
    import torch
    import torch.distributed as dist

    if use_solution:
        fn = sum_of_squares_solution
    if fn is None:
        return ("missing", None, [])
    real, calls = dist.all_reduce, []

    def recording(tensor, *args, **kwargs):
        call = {"op": kwargs.get("op", args[0] if args else None), "input": _values(tensor)}
        calls.append(call)
        result = real(tensor, *args, **kwargs)
        call["output"] = _values(tensor)
        return result

    dist.all_reduce = recording
    try:
        value = fn()
    except NotImplementedError:
        return ("todo", None, calls)
    except Exception as exc:
        return ("error", f"{type(exc).__name__}: {exc}", calls)
    finally:
        dist.all_reduce = real
    try:
        value = torch.as_tensor(value, dtype=torch.float64)
    except Exception:
        return ("type", type(value).__name__, calls)
    if value.numel() != 1:
        return ("shape", tuple(value.shape), calls)
    return ("value", value.item(), calls)


def _values(tensor):
    """A tensor's numbers as a list of floats (None for anything else): what went into or came out of a call."""
    import torch

    if not isinstance(tensor, torch.Tensor):
        return None
    return tensor.detach().double().cpu().flatten().tolist()


def check_sum_of_squares(use_solution=False, cluster=None, timeout=30):
    """Self-check of exercise 2: ``sum_of_squares()``, defined on the ranks by a ``%%ddp`` cell, must
    return 0² + 1² + ... + (world_size - 1)² on every rank, computed with exactly one all-reduce, of this
    rank's own square (the checker records what each rank all-reduced and what came back: a right number
    typed in beside an all-reduce of something else fails).

    Raises AssertionError with what is wrong; returns quietly when it is right. ``cluster`` defaults
    to the notebook's ``%%ddp`` ranks."""
    from course_utils import DistributedTimeout, get_cluster

    __tracebackhide__ = True
    cluster = cluster or get_cluster()
    n = cluster.world_size
    try:
        got = cluster.run("from course_utils.tour import _probe as _course_probe\n"
                          f"_course_probe(globals().get('sum_of_squares'), {bool(use_solution)})", timeout=timeout)
    except DistributedTimeout:
        raise AssertionError("sum_of_squares() hung: every rank must call dist.all_reduce, the same number of "
                             "times (a collective waits until all ranks have called it).") from None
    kinds = {kind for kind, _, _ in got}
    if "missing" in kinds:
        raise AssertionError("sum_of_squares is not defined on the ranks: run the %%ddp cell that defines it first.")
    if "todo" in kinds:
        raise AssertionError("sum_of_squares still raises NotImplementedError: write it in the %%ddp cell above, "
                             "run that cell, then this one.")
    for kind, detail, _ in got:
        if kind == "error":
            raise AssertionError(f"sum_of_squares() raised {detail}")
        if kind == "type":
            raise AssertionError(f"sum_of_squares() returned a {detail}: return a tensor (or a number).")
        if kind == "shape":
            raise AssertionError(f"sum_of_squares() returned shape {detail}: return one number, "
                                 "e.g. a tensor of one element.")
    values = [v for _, v, _ in got]
    counts = [len(calls) for _, _, calls in got]
    if any(c == 0 for c in counts):
        raise AssertionError("sum_of_squares() called no dist.all_reduce on some rank: each rank knows only its "
                             "own square, the all-reduce is what adds them up across ranks.")
    if any(c != 1 for c in counts):
        raise AssertionError(f"sum_of_squares() called dist.all_reduce {max(counts)} times: one is enough.")
    if len(set(values)) > 1:
        raise AssertionError(f"the ranks disagree ({values}): after an all-reduce every rank holds the same value.")
    value = values[0]
    if value == sum(range(n)) and n > 2:
        raise AssertionError("that is the sum of the ranks: square each rank's number before the all-reduce.")
    if value == sum(range(n)) ** 2 and n > 2:
        raise AssertionError("that is the square of the sum: square before reducing, not after.")
    if value == (n - 1) ** 2 and n > 2:
        raise AssertionError("that is the largest square: the reduction must add (op=dist.ReduceOp.SUM, the "
                             "default), not take the maximum.")
    if value != sum(r * r for r in range(n)):
        raise AssertionError(f"sum_of_squares() gave {value:g} on every rank: that is not 0² + 1² + ... + "
                             f"{n - 1}².")
    # The right number is not enough (14 can be typed in): it must be what the all-reduce of the squares gave.
    for r, (_, _, calls) in enumerate(got):
        sent = calls[0]["input"]
        if sent != [float(r * r)]:
            shown = "something that is not a tensor" if sent is None else f"{sent[0]:g}" if len(sent) == 1 else sent
            raise AssertionError(f"rank {r} all-reduced {shown}, not its own square {r * r}: the sum must come out "
                                 "of the all-reduce, so put rank ** 2 in the tensor you all-reduce, and return "
                                 "that tensor.")
    for r, (_, _, calls) in enumerate(got):
        received = calls[0]["output"]
        if received != [value]:
            raise AssertionError(f"sum_of_squares() returned {value:g}, but the all-reduce gave {received[0]:g} on "
                                 f"rank {r}: return the tensor the all-reduce filled, not a number computed or "
                                 "typed in beside it.")
