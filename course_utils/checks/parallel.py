"""The checkers of 15_beyond_data_parallelism: the row-parallel layer's backward and a pipeline schedule.

Call them INSIDE a ``%%ddp`` cell (2 or more ranks): every rank runs the same check on the process group
that is already there, and every rank raises the same ``AssertionError`` (the first failing rank's
explanation) or returns quietly.
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F

from course_utils.pipeline import (Deadlock, OutOfOrder, bubble_fraction, gpt_stage, idle_fraction, run_schedule,
                                   simulate)
from course_utils.tensor_parallel import RowParallelLinearFunction
from course_utils.zero import count_collectives

TOL = 1e-5


def _agree(problem):
    """Every rank's problem (or None) gathered: the verdict is the first rank's that found one (named when the
    ranks disagree), the same on every rank."""
    problems = [None] * dist.get_world_size()
    dist.all_gather_object(problems, problem)
    if len(set(problems)) == 1:                 # every rank saw the same (or nothing): no rank to name
        return problems[0]
    for r, p in enumerate(problems):
        if p:
            return f"(seen on rank {r}) {p}"
    return None


def _close(a, b):
    return a is not None and a.shape == b.shape and torch.allclose(a, b, rtol=TOL, atol=TOL)


# -- exercise 1: the row-parallel linear's backward ---------------------------------------------------------
def _row_parallel_problem(backward, shape, out_features, seed):
    rank, ws = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(seed)             # the same full problem on every rank
    x = torch.randn(*shape, generator=g)
    w = torch.randn(out_features, shape[-1], generator=g)
    b = torch.randn(out_features, generator=g)
    r = torch.randn(*shape[:-1], out_features, generator=g)   # d loss / d output: not all ones
    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    x, w, b, r = (t.to(dev) for t in (x, w, b, r))           # the ranks' device: right on NCCL too
    full = [t.clone().requires_grad_() for t in (x, w, b)]
    ((full[0] @ full[1].T + full[2]) * r).sum().backward()
    n = shape[-1] // ws
    cols = slice(rank * n, (rank + 1) * n)
    want = (full[0].grad[..., cols], full[1].grad[:, cols], full[2].grad)
    mine = [x[..., cols].clone().requires_grad_(), w[:, cols].clone().requires_grad_(), b.clone().requires_grad_()]
    Yours = RowParallelLinearFunction.with_backward(backward)
    y = Yours.apply(*mine, None)
    where = f"with x_shard of shape {tuple(mine[0].shape)} and weight_shard {tuple(mine[1].shape)}"
    try:
        with count_collectives() as calls:
            (y * r).sum().backward()
    except NotImplementedError as exc:
        return f"your backward is not written yet (NotImplementedError: {exc}). Write it, then run the cell again."
    except Exception as exc:  # noqa: BLE001 (explained to the learner)
        text = f"{type(exc).__name__}: {exc}"
        hint = ""
        if "returned an incorrect number of gradients" in text or "returned an invalid" in text or "expected" in text:
            hint = (" backward returns one gradient per input of forward, in order: (grad of x_shard, grad of "
                    "weight_shard, grad of bias, None for the group), each with its input's shape.")
        elif "mat" in text or "shape" in text or "size" in text:
            hint = (" Check the shapes: grad_output is (..., out), x_shard (..., in / W), weight_shard "
                    "(out, in / W); flatten the leading dimensions before a matrix product over the batch.")
        return f"{where}, your backward raised {text}.{hint}"
    names = ("x_shard", "weight_shard", "bias")
    got = [t.grad for t in mine]
    for name, a, want_t in zip(names, got, want):
        if _close(a, want_t):
            continue
        if a is not None and a.shape == want_t.shape:
            if _close(a, ws * want_t):
                return (f"{where}, the gradient of {name} is {ws} times too large. grad_output is already the "
                        "same on every rank (the output was all-reduced in forward, so its gradient arrives "
                        "replicated): summing it again over the ranks multiplies it by the world size.")
            if _close(a * ws, want_t):
                return (f"{where}, the gradient of {name} is {ws} times too small. Nothing is averaged here: "
                        "every rank's loss is the whole loss.")
        return (f"{where}, the gradient of {name} is wrong"
                + ("" if a is None else f" (largest error {(a - want_t).abs().max().item():.3g})" if a.shape ==
                   want_t.shape else f": shape {tuple(a.shape)} instead of {tuple(want_t.shape)}")
                + ". Derive it from y = (x_shard @ weight_shard.T summed over the ranks) + bias: each rank's "
                  "gradients concern only its own slice, from its own x_shard and weight_shard.")
    if calls:
        kinds = ", ".join(f"{n} {k}" for k, n in calls.kinds().items())
        return (f"{where}, the gradients are right, but your backward calls {kinds}. "
                "A row-parallel layer's backward needs no communication: grad_output is replicated, and each "
                "rank's gradients concern only its own slice. Megatron's g is the identity in backward.")
    return None


def check_row_parallel_backward(backward):
    """``backward(ctx, grad_output)`` of ``RowParallelLinearFunction``: ``ctx.saved_tensors`` holds
    ``(x_shard, weight_shard)``; return the gradients of ``x_shard``, ``weight_shard``, ``bias`` and None.

    Introduced in 15_beyond_data_parallelism. Compared, on every rank, with the slices of the unsplit
    layer's gradients (autograd on one process) within 1e-5, for a 2-D and a 3-D input; no collective
    may run in backward."""
    ws = dist.get_world_size()
    if ws < 2:
        raise AssertionError("check_row_parallel_backward needs 2 or more ranks: run it in a %%ddp cell")
    problem = None
    cases = (((6, 4 * ws), 5), ((2, 3, 2 * ws), 7))
    for seed, (shape, out_features) in enumerate(cases):
        problem = _agree(_row_parallel_problem(backward, shape, out_features, seed))
        if problem:
            raise AssertionError(problem)
    if dist.get_rank() == 0:
        print(f"check_row_parallel_backward: every gradient equals the unsplit layer's slice within {TOL:g} on {ws} "
              "ranks (2-D and 3-D inputs), with no communication in backward.")


# -- exercise 2: a GPipe schedule ------------------------------------------------------------------------------
def _schedule_problem(schedule, p, m, given=None):
    """What is wrong with ``schedule`` for ``p`` stages and ``m`` micro-batches, without running anything.
    ``given``: the stages' lists of actions, already computed (then ``schedule`` is not called)."""
    schedules = []
    for s in range(p):
        try:
            actions = schedule(s, p, m) if given is None else given[s]
        except NotImplementedError as exc:
            return (f"your schedule is not written yet (NotImplementedError: {exc}). Write it, then run the "
                    "cell again.")
        except Exception as exc:  # noqa: BLE001 (explained to the learner)
            return f"schedule({s}, {p}, {m}) raised {type(exc).__name__}: {exc}."
        try:
            actions = [(str(k), int(i)) for k, i in actions]
        except (TypeError, ValueError):
            return (f"schedule({s}, {p}, {m}) must return a list of actions (\"F\", i) or (\"B\", i), "
                    f"got {actions!r:.80}.")
        seen_f = set()
        for kind, i in actions:
            if kind not in ("F", "B") or not 0 <= i < m:
                return (f"schedule({s}, {p}, {m}) holds {(kind, i)}: an action is (\"F\", i) or (\"B\", i) with "
                        f"0 <= i < {m}.")
            if kind == "B" and i not in seen_f:
                return (f"on stage {s} of {p}, micro-batch {i} runs backward before its forward: backward "
                        "needs the activations its forward keeps.")
            if kind == "F":
                seen_f.add(i)
        for kind in ("F", "B"):
            counts = [sum(1 for a in actions if a == (kind, i)) for i in range(m)]
            if counts != [1] * m:
                missing = [i for i, c in enumerate(counts) if c == 0]
                twice = [i for i, c in enumerate(counts) if c > 1]
                word = "forward" if kind == "F" else "backward"
                return (f"on stage {s} of {p} with {m} micro-batch{'es' if m > 1 else ''}, every micro-batch must run "
                        f"{word} exactly "
                        f"once: " + (f"missing {missing}" if missing else f"more than once: {twice}") + ".")
        schedules.append(actions)
    try:
        events = simulate(schedules)
    except Deadlock as exc:
        return (f"with {p} stages and {m} micro-batches this schedule deadlocks (caught by simulating it, before "
                f"anything was sent): {exc}. Each of them waits for a message that the stage it waits on will "
                "only send after its own receive: the stages must agree on the order in which micro-batches "
                "cross between them.")
    except OutOfOrder as exc:
        return (f"with {p} stages and {m} micro-batches: {exc}. dist.recv takes the messages from one peer in "
                "the order they were sent, so the data would silently belong to another micro-batch.")
    idle, bound = idle_fraction(events), bubble_fraction(p, m)
    if idle > bound + 1e-9:
        return (f"with {p} stages and {m} micro-batches the stages are idle {idle:.0%} of the time, more than "
                f"GPipe's (p - 1) / (m + p - 1) = {bound:.0%} (simulated, with backward twice as long as forward). "
                "The stages do not overlap: a stage should start the next micro-batch's forward while the next "
                "stage works on this one, not wait for its backward.")
    return None


def check_pipeline_schedule(schedule, num_microbatches=4):
    """``schedule(stage, num_stages, num_microbatches)``: the actions of one stage, ``("F", i)`` and ``("B", i)``.

    Introduced in 15_beyond_data_parallelism. First simulated for 2 and 4 stages and 1, 3 and 8 micro-batches
    (no process sends anything, so a deadlock is reported instead of hanging): every micro-batch forward and
    backward once per stage, backward after forward, no deadlock, the messages between two stages in one order,
    and an idle fraction no larger than GPipe's (p - 1) / (m + p - 1). Then the lists the ranks will run are
    simulated as they are, and run for real on this world's ranks, the tiny GPT cut into world-size stages: the
    output (the last stage's logits), the loss and every gradient equal one process's within 1e-5."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    if ws < 2:
        raise AssertionError("check_pipeline_schedule needs 2 or more ranks: run it in a %%ddp cell")
    for p in (2, 4):
        for m in (1, 3, 8):
            problem = _agree(_schedule_problem(schedule, p, m))   # agreed, in case it depends on the caller's rank
            if problem:
                raise AssertionError(problem)
    problem = _agree(_schedule_problem(schedule, ws, num_microbatches))
    if problem:
        raise AssertionError(problem)
    # the lists the ranks will run, simulated once more as they are: a schedule that answers differently when
    # called again (randomness, global state) cannot slip a deadlock past the simulation into the real run
    try:
        mine = [(str(k), int(i)) for k, i in schedule(rank, ws, num_microbatches)]
    except Exception:  # noqa: BLE001 (the verdict below explains it)
        mine = None
    lists = [None] * ws
    dist.all_gather_object(lists, mine)
    if any(actions is None for actions in lists):
        raise AssertionError(f"schedule(stage, {ws}, {num_microbatches}) raised when it was called again for the "
                             "real run: make it depend only on its arguments.")
    problem = _schedule_problem(schedule, ws, num_microbatches, given=lists)
    if problem:
        raise AssertionError(f"called again for the real run, your schedule gave other lists: {problem}")
    from course_utils.gpt import make_gpt

    vocab, micro, T = 20, 2, 8
    g = torch.Generator().manual_seed(7)
    x = torch.randint(vocab, (num_microbatches * micro, T), generator=g)
    y = torch.randint(vocab, (num_microbatches * micro, T), generator=g)
    kw = dict(block_size=T, n_layer=max(2, ws - 2), n_embd=16)

    def loss_fn(logits, t):
        return F.cross_entropy(logits.flatten(0, 1), t.flatten())

    reference = make_gpt(vocab, seed=3, **kw)
    ref_loss = loss_fn(reference(x), y)
    ref_loss.backward()
    model = make_gpt(vocab, seed=3, **kw)
    stage = gpt_stage(model, rank, ws)
    outputs = []

    def recording_loss(logits, t):                 # the last stage's output, kept for the comparison
        outputs.append(logits.detach())
        return loss_fn(logits, t)

    ref_logits = reference(x).detach()
    loss, _ = run_schedule(stage, lists[rank], stage=rank, num_stages=ws, inputs=list(x.chunk(num_microbatches)),
                           targets=list(y.chunk(num_microbatches)), loss_fn=recording_loss,
                           act_shape=(micro, T, 16))
    want = dict(reference.named_parameters())
    problem = None
    if loss is not None and not torch.allclose(loss, ref_loss.detach(), rtol=TOL, atol=TOL):
        problem = f"the pipeline's loss {loss.item():.6f} differs from one process's {ref_loss.item():.6f}."
    if problem is None and rank == ws - 1:
        order = [i for kind, i in lists[rank] if kind == "F"]
        got = torch.cat([outputs[order.index(i)] for i in range(num_microbatches)])
        if not _close(got, ref_logits):
            problem = "the pipeline's output (the last stage's logits) differs from one process's."
    for name, param in stage.named_parameters():
        full = next(n for n, q in model.named_parameters() if q is param)
        if problem is None and not _close(param.grad, want[full].grad):
            problem = f"the gradient of {full} (stage {rank}) differs from one process's."
    problem = _agree(problem)
    if problem:
        raise AssertionError(problem)
    if rank == 0:
        print(f"check_pipeline_schedule: no deadlock and no more idle time than GPipe's bound for 2 and 4 stages, "
              f"1, 3 and 8 micro-batches (simulated); on {ws} stages with {num_microbatches} micro-batches the output, "
              f"the loss and every gradient equal one process's within {TOL:g}.")
