"""Lesson 00's exercise: its self-check and the course's solution (00_launcher_tour, exercise 1).

The solution is here, out of sight, so that the notebook's scaffold stays a scaffold;
``check_sum_of_squares(use_solution=True)`` checks it, as the stored notebook does.

The check watches the process group, not one Python name: a ``TorchDispatchMode`` on each rank sees every
collective that reaches the dispatcher, whichever route the learner took (``dist.all_reduce``,
``from torch.distributed import all_reduce``, ``distributed_c10d.all_reduce``, the process group's own
``allreduce``, functional collectives), records what went in, and reads what came out only once the work is done
(after ``wait()``, so ``async_op=True`` is read as finished). The returned value must equal what that all-reduce
produced; a number computed beside it that happens to equal it cannot be told apart by value, and passes.
tests/test_checker_sum_of_squares.py holds the verdicts.
"""

__all__ = ["check_sum_of_squares", "sum_of_squares_solution"]


def sum_of_squares_solution():
    """The course's answer: each rank contributes its own square, one all-reduce adds them up."""
    import torch
    import torch.distributed as dist

    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    squares = torch.tensor([float(dist.get_rank() ** 2)], device=device)
    dist.all_reduce(squares)  # SUM is the default op
    return squares


# What the learner may have called, by the dispatcher's op name, as the lesson names it.
_ALL_REDUCES = {"c10d::allreduce_", "_c10d_functional::all_reduce", "_c10d_functional::all_reduce_"}
_NOT_COLLECTIVES = {"c10d::barrier", "c10d::monitored_barrier_", "_c10d_functional::wait_tensor",
                    "_c10d_functional::_wrap_tensor_autograd"}


def _shown(op):
    """A dispatcher op name as a learner would write the call: c10d::allgather_ -> dist.allgather."""
    return "dist." + op.split("::")[1].strip("_")


def _recorder():
    """A TorchDispatchMode that records each all-reduce (its input, and how to read its output once finished) and
    the names of any other collective."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Recorder(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls, self.others = [], []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            op = func._schema.name
            if op not in _ALL_REDUCES:
                if op.startswith(("c10d::", "_c10d_functional::")) and op not in _NOT_COLLECTIVES:
                    self.others.append(_shown(op))
                return func(*args, **kwargs)
            if op == "c10d::allreduce_":             # dist.all_reduce, c10d.all_reduce, group.allreduce
                tensors = args[0]
                call = {"input": _values(tensors[0] if len(tensors) == 1 else None)}
                out = func(*args, **kwargs)
                call.update(result=tensors[0] if len(tensors) == 1 else None, work=out[1])
            else:                                    # functional collectives: the result is a new tensor
                call = {"input": _values(args[0])}
                out = func(*args, **kwargs)
                call.update(result=out, work=None)
            self.calls.append(call)
            return out

    return Recorder()


def _finish(call):
    """The all-reduced values of a recorded call, read after its work is done."""
    import torch

    if call["work"] is not None:
        call["work"].wait()                          # a second wait() after the learner's returns at once
    elif isinstance(call["result"], torch.Tensor):
        torch.ops._c10d_functional.wait_tensor(call["result"])
    return {"input": call["input"], "output": _values(call["result"])}


def _probe(fn, use_solution):
    """Runs on every rank: call the learner's sum_of_squares (or the solution), recording each all-reduce's input
    (before the call) and its result (after its work finished). Returns (kind, detail, calls, other collectives)."""
    import torch

    if use_solution:
        fn = sum_of_squares_solution
    if fn is None:
        return ("missing", None, [], [])
    recorder = _recorder()
    try:
        with recorder:
            value = fn()
    except NotImplementedError:
        return ("todo", None, [], recorder.others)
    except Exception as exc:
        return ("error", f"{type(exc).__name__}: {exc}", [], recorder.others)
    calls = [_finish(call) for call in recorder.calls]
    try:
        value = torch.as_tensor(value, dtype=torch.float64)
    except Exception:
        return ("type", type(value).__name__, calls, recorder.others)
    if value.numel() != 1:
        return ("shape", tuple(value.shape), calls, recorder.others)
    return ("value", value.item(), calls, recorder.others)


def _values(tensor):
    """A tensor's numbers as a list of floats (None for anything else): what went into or came out of a call."""
    import torch

    if not isinstance(tensor, torch.Tensor):
        return None
    return tensor.detach().double().cpu().flatten().tolist()


def _number(values):
    """A recorded tensor's values as the learner would read them: 4 for [4.0], the list otherwise."""
    if values is None:
        return "something that is not a tensor"
    return f"{values[0]:g}" if len(values) == 1 else str([float(f"{v:g}") for v in values])


def check_sum_of_squares(use_solution=False, cluster=None, timeout=30):
    """Self-check of exercise 1: ``sum_of_squares()``, defined on the ranks by a ``%%ddp`` cell, must return
    0² + 1² + ... + (world_size - 1)² on every rank, computed by exactly one all-reduce (SUM) of this rank's own
    square, and the value returned must be what that all-reduce produced: a right number typed in, or computed
    beside the all-reduce, fails.

    Raises AssertionError with what is wrong; returns quietly when it is right. ``cluster`` defaults
    to the notebook's ``%%ddp`` ranks."""
    from course_utils import DistributedTimeout, get_cluster

    __tracebackhide__ = True
    cluster = cluster or get_cluster()
    n = cluster.world_size
    try:
        got = cluster.run("from course_utils.checks.tour import _probe as _course_probe\n"
                          f"_course_probe(globals().get('sum_of_squares'), {bool(use_solution)})", timeout=timeout)
    except DistributedTimeout:
        raise AssertionError("sum_of_squares() hung: every rank must call the all-reduce, the same number of "
                             "times (a collective waits until all ranks have called it).") from None
    kinds = {kind for kind, *_ in got}
    if "missing" in kinds:
        raise AssertionError("sum_of_squares is not defined on the ranks: run the %%ddp cell that defines it first.")
    if "todo" in kinds:
        raise AssertionError("sum_of_squares still raises NotImplementedError: write it in the %%ddp cell above, "
                             "run that cell, then this one.")
    for kind, detail, _, _ in got:
        if kind == "error":
            raise AssertionError(f"sum_of_squares() raised {detail}")
        if kind == "type":
            raise AssertionError(f"sum_of_squares() returned a {detail}: return a tensor (or a number).")
    calls = [c for _, _, c, _ in got]
    others = sorted({o for *_, rank_others in got for o in rank_others})
    counts = [len(c) for c in calls]
    if any(c == 0 for c in counts):
        used = f" (it called {', '.join(others)})" if others else ""
        raise AssertionError(f"sum_of_squares() called no all-reduce on some rank{used}: each rank knows only its "
                             "own square, and dist.all_reduce is what adds them up across ranks.")
    if any(c != 1 for c in counts):
        raise AssertionError(f"sum_of_squares() called an all-reduce {max(counts)} times: one is enough.")
    for kind, detail, _, _ in got:
        if kind == "shape":
            raise AssertionError(f"sum_of_squares() returned shape {detail}: return one number, "
                                 "e.g. a tensor of one element.")
    values = [v for _, v, _, _ in got]
    if len(set(values)) > 1:
        raise AssertionError(f"the ranks returned different values ({', '.join(f'{v:g}' for v in values)}): after "
                             "an all-reduce every rank holds the same result.")
    value, right = values[0], sum(r * r for r in range(n))
    sent = [c[0]["input"] for c in calls]
    received = [c[0]["output"] for c in calls]
    if all(s == [float(r)] for r, s in enumerate(sent)):      # every rank all-reduced its rank, not its square
        if value == sum(range(n)) ** 2:
            raise AssertionError("that is the square of the sum: square each rank's number before reducing, "
                                 "not after.")
        raise AssertionError(f"each rank all-reduced its own rank number, so the sum is {sum(range(n))}, the sum of "
                             "the ranks: square each rank's number before the all-reduce.")
    for r, s in enumerate(sent):
        if s != [float(r * r)]:
            raise AssertionError(f"rank {r} all-reduced {_number(s)}, not its own square {r * r}: the sum must come "
                                 "out of the all-reduce, so put rank ** 2 in the tensor you all-reduce.")
    for r, out in enumerate(received):
        if out == [float((n - 1) ** 2)]:
            raise AssertionError(f"the all-reduce gave {(n - 1) ** 2}, the largest square: the reduction must add "
                                 "(op=dist.ReduceOp.SUM, the default), not take the maximum.")
        if out != [float(right)]:
            raise AssertionError(f"the all-reduce of the squares gave {_number(out)} on rank {r}, not their sum: "
                                 "reduce with op=dist.ReduceOp.SUM (the default).")
    if value != right:
        raise AssertionError(f"sum_of_squares() returned {value:g}, but its all-reduce gave {right} on every rank: "
                             "return the tensor the all-reduce filled, not a number computed or typed in beside it.")
