"""Checkers for the pieces of MicroDDP the learner writes in 11_capstone_micro_ddp.

Call them INSIDE a ``%%ddp`` cell: every rank runs the same checks on the process group that is
already there, and every rank raises the same ``AssertionError`` (the first failing rank's
explanation) or returns quietly. ``check_assign_buckets`` needs no process group.
"""
import contextlib

import torch
import torch.distributed as dist
from torch import nn

from course_utils import micro_ddp as ref

TOL = 1e-6


def _verdict(problem):
    """Every rank learns whether any rank found a problem, and raises the first one's explanation."""
    if not dist.is_initialized():
        if problem:
            raise AssertionError(problem)
        return
    problems = [None] * dist.get_world_size()
    dist.all_gather_object(problems, problem)
    for r, p in enumerate(problems):
        if p:
            raise AssertionError(p if dist.get_world_size() == 1 else f"(seen on rank {r}) {p}")


def _device():
    """Where the checkers build their tensors: this rank's GPU on NCCL (which serves CUDA tensors only), the CPU
    otherwise. The engine has already called ``torch.cuda.set_device(local_rank)`` on NCCL ranks."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _first_problem(checks):
    """Run zero-argument callables that return None or an explanation; stop at the first problem."""
    for check in checks:
        problem = check()
        if problem:
            return problem
    return None


def _raised(what, exc):
    """A problem sentence for an exception raised by the learner's code."""
    return f"{what} raised {type(exc).__name__}: {exc}"


# -- piece 1: the broadcast ---------------------------------------------------------------------

def check_broadcast_state(broadcast_state):
    """``broadcast_state(module)`` must make every rank's parameters and buffers equal rank 0's."""
    from course_utils.models import make_model

    dev = _device()
    model = make_model(seed=100 + dist.get_rank()).to(dev)
    model.register_buffer("steps", torch.full((3,), float(dist.get_rank()), device=dev))
    want = make_model(seed=100).to(dev)
    want.register_buffer("steps", torch.zeros(3, device=dev))
    problem = None
    try:
        broadcast_state(model)
    except Exception as exc:  # noqa: BLE001 (the learner's code: any error becomes the verdict)
        problem = _raised("broadcast_state", exc)
    for (name, got), exp in zip([*model.named_parameters(), *model.named_buffers()],
                                [*want.parameters(), *want.buffers()]):
        if problem:
            break
        if not torch.equal(got, exp):
            kind = "buffer" if name == "steps" else "parameter"
            problem = (f"after broadcast_state, {kind} {name!r} differs from rank 0's. Broadcast every parameter "
                       "AND every buffer (module.buffers()) from rank 0, in place (dist.broadcast(t, src=0)).")
    _verdict(problem)
    if dist.get_rank() == 0:
        print("check_broadcast_state: every parameter and buffer now equals rank 0's.")


# -- piece 2: the bucket assignment -------------------------------------------------------------

def check_assign_buckets(assign_buckets):
    """``assign_buckets(params, bucket_cap_mb, order=None)`` -> lists of indices: walking ``order`` (by default
    the reverse of registration order), a bucket closing as soon as it holds at least the cap."""
    mb = 1024 * 1024
    params = [torch.zeros(1000), torch.zeros(10), torch.zeros(1000), torch.zeros(10)]  # 4000, 40, 4000, 40 bytes
    cases = [(4000 / mb, None, "a cap of 4000 bytes"), (1e-9, None, "a tiny cap"), (25, None, "the default 25 MiB"),
             (8040 / mb, None, "a cap of 8040 bytes"), (4000 / mb, [1, 0, 3, 2], "order=[1, 0, 3, 2], a 4000-byte cap"),
             (8040 / mb, [0, 2, 1, 3], "order=[0, 2, 1, 3], an 8040-byte cap")]
    problem = None
    for cap, order, what in cases:
        want = ref.assign_buckets(params, cap, order)
        try:
            got = assign_buckets(params, cap) if order is None else assign_buckets(params, cap, order)
            got = [list(map(int, b)) for b in got]
        except TypeError as exc:
            if order is not None and ("order" in str(exc) or "positional" in str(exc)):
                problem = (f"assign_buckets(params, cap, order) raised TypeError: {exc}. Give it a third parameter "
                           "order=None: the order to walk the parameters in (None: reverse registration order).")
            else:
                problem = _raised("assign_buckets", exc)
            break
        except Exception as exc:  # noqa: BLE001
            problem = _raised("assign_buckets", exc)
            break
        flat = sorted(i for b in got for i in b)
        if flat != list(range(len(params))):
            problem = (f"with {what}, the buckets {got} do not hold every parameter exactly once. "
                       "Each parameter index 0..3 must be in exactly one bucket.")
        elif order is None and got and got[0] and got[0][0] == 0 and want[0][0] != 0:
            problem = (f"with {what}, you got {got}: the first bucket starts with parameter 0. Without an order, "
                       "walk the parameters in REVERSE: before the first backward that is the best guess of the "
                       "order backward produces them (the last layer's gradient first).")
        elif order is not None and [i for b in got for i in b] != order:
            problem = (f"with {what}, you got {got}: walk the parameters in the given order (the order their "
                       "gradients became ready), so that a bucket fills as early as possible.")
        elif got != want:
            problem = (f"with {what} (sizes 4000, 40, 4000, 40 bytes), expected {want}, got {got}. A bucket "
                       "closes as soon as it holds at least the cap (so it may overflow by one parameter).")
        if problem:
            break
    _verdict(problem)
    if not dist.is_initialized() or dist.get_rank() == 0:
        print("check_assign_buckets: reverse registration order by default, the given order otherwise, "
              "closing at the cap.")


# -- piece 3: one bucket's asynchronous all-reduce ----------------------------------------------

def check_start_allreduce(start_allreduce):
    """``start_allreduce(flat)`` starts an async all-reduce that leaves the average in ``flat``."""
    ws, rank = dist.get_world_size(), dist.get_rank()
    flat = torch.arange(6, dtype=torch.float32, device=_device()) * (rank + 1)
    want = torch.arange(6, dtype=torch.float32, device=_device()) * sum(r + 1 for r in range(ws)) / ws
    problem = None
    try:
        work = start_allreduce(flat)
    except Exception as exc:  # noqa: BLE001
        problem, work = _raised("start_allreduce", exc), False
    if problem:
        pass
    elif work is None or not hasattr(work, "wait"):
        problem = ("start_allreduce returned no Work: call dist.all_reduce(flat, async_op=True) and return what it "
                   "returns, so backward goes on while the bucket travels.")
        dist.barrier()  # the collective (if any) ran synchronously; keep the ranks in step
    else:
        work.wait()
        if ws > 1 and torch.equal(flat, torch.arange(6, dtype=torch.float32, device=flat.device) * (rank + 1)):
            problem = ("after wait(), flat is unchanged: the all-reduce ran on a copy (flat / world_size makes a new "
                       "tensor). Divide flat in place (flat /= world_size) and all-reduce flat itself.")
        elif torch.allclose(flat, want * ws):
            problem = "flat holds the SUM over the ranks, not the average: divide by world_size."
        elif not torch.allclose(flat, want):
            problem = f"after wait(), flat is {flat.tolist()}, expected the average {want.tolist()}."
    _verdict(problem)
    if rank == 0:
        print("check_start_allreduce: asynchronous, and the bucket holds the average after wait().")


# -- piece 4: the whole class against torch DDP --------------------------------------------------

class _Tied(nn.Module):
    """``mid2`` shares its weight with ``mid`` (one Parameter, used twice in forward)."""

    def __init__(self, d_in=16, d=32):
        super().__init__()
        self.enc, self.mid, self.mid2, self.out = nn.Linear(d_in, d), nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, 1)
        self.mid2.weight = self.mid.weight

    def forward(self, x):
        return self.out(torch.relu(self.mid2(torch.relu(self.mid(torch.relu(self.enc(x)))))))


class _ByRank(nn.Module):
    """Two same-shaped branches whose forward order depends on the rank, so backward produces their gradients
    in a rank-dependent order (autograd runs the node created last first). A wrapper that launches each bucket
    as soon as it is full, instead of strictly in bucket order, then pairs rank 0's ``a`` with rank 1's ``b``
    in the same all-reduce: same shapes, no error, wrong sums."""

    def __init__(self, d_in=16, d=32):
        super().__init__()
        self.enc, self.a, self.b, self.out = nn.Linear(d_in, d), nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, 1)

    def forward(self, x):
        h = torch.relu(self.enc(x))
        if dist.get_rank() % 2 == 0:
            ya, yb = self.a(h), self.b(h)
        else:
            yb, ya = self.b(h), self.a(h)
        return self.out(torch.relu(ya) + torch.tanh(yb))  # two functions: the branches' gradients differ


class _Skippable(nn.Module):
    """``extra`` takes part in the forward unless ``skip=True``: a backward in which its hooks never fire."""

    def __init__(self, d_in=16, d=32):
        super().__init__()
        self.enc, self.extra, self.out = nn.Linear(d_in, d), nn.Linear(d, d), nn.Linear(d, 1)

    def forward(self, x, skip=False):
        h = torch.relu(self.enc(x))
        return self.out(h if skip else h + torch.relu(self.extra(h)))


class _Normed(nn.Module):
    """A BatchNorm layer between two Linear layers: its running statistics are buffers that every rank's forward
    updates from its own batch."""

    def __init__(self, d_in=16, d=32):
        super().__init__()
        self.enc, self.norm, self.out = nn.Linear(d_in, d), nn.BatchNorm1d(d), nn.Linear(d, 1)

    def forward(self, x):
        return self.out(torch.relu(self.norm(self.enc(x))))


def _make(kind, seed):
    """The models check_micro_ddp trains: the same weights for the same seed."""
    from course_utils.models import Reordered, make_model

    if kind == "mlp":
        return make_model(seed=seed).to(_device())
    torch.manual_seed(seed)
    if kind == "reordered":
        return Reordered(d_in=16, d_hidden=32, n_blocks=2).to(_device())
    if kind == "tied":
        return _Tied().to(_device())
    if kind == "by_rank":
        return _ByRank().to(_device())
    if kind == "skippable":
        return _Skippable().to(_device())
    if kind == "normed":
        return _Normed().to(_device())
    if kind == "frozen":
        model = make_model(seed=seed).to(_device())
        model.net[0].bias.requires_grad_(False)
        return model
    raise ValueError(kind)


def _diagnose(name, got, want, local, ws):
    err = (got - want).abs().max().item()
    hint = ""
    if torch.allclose(got, want * ws, rtol=1e-5, atol=1e-7):
        hint = " It is world_size x the average: divide by world_size."
    elif torch.allclose(got, local, rtol=1e-5, atol=1e-7):
        hint = (" It equals this rank's local gradient: no averaging happened (did the hooks launch the bucket, "
                "and did you wait and copy the result back into .grad before backward() returned?).")
    elif err < 1e-2 * want.abs().max().item():
        hint = (" That is close, but more than float32 rounding: is something travelling in 16 bits? "
                "Send fp32 here (compression comes later).")
    return f"{name}.grad differs from torch DDP's by {err:.2e} (tolerance {TOL:g}).{hint}"


@contextlib.contextmanager
def _spy_all_reduce(log):
    """Append ("all_reduce", async_op) to ``log`` at each dist.all_reduce call."""
    import torch.distributed.distributed_c10d as c10d

    original = dist.all_reduce

    def spy(tensor, *args, **kwargs):
        log.append(("all_reduce", bool(kwargs.get("async_op", args[2] if len(args) > 2 else False))))
        return original(tensor, *args, **kwargs)

    dist.all_reduce = c10d.all_reduce = spy
    try:
        yield
    finally:
        dist.all_reduce = c10d.all_reduce = original


def _overlap_problem(case, log, n_params, hint="", min_to_come=1):
    """None if an async all-reduce started while backward still had ``min_to_come`` gradients to compute
    (besides the one whose hook launched it)."""
    seen, early, blocking = 0, [], []
    for what, async_op in log:
        if what == "grad":
            seen += 1
        elif n_params - seen - 1 >= min_to_come:  # gradients still to come after this launch
            (early if async_op else blocking).append(seen)
    if early:
        return None
    if blocking:
        return (f"{case}: the gradients are numerically right, but the all-reduces started during backward block it "
                "(async_op=False), so nothing overlaps. Start them with async_op=True and wait at the end of backward.")
    return (f"{case}: the gradients are numerically right, but no all-reduce started before backward had computed "
            "(nearly) every gradient, so communication does not overlap backward. Launch a bucket's all-reduce "
            "(async_op=True) from the gradient hooks as soon as the bucket is full, not after backward." + hint)


def _agree(problem):
    """Every rank gets the lowest rank's problem (or None): a rank that stops alone would leave the
    others waiting in a collective forever."""
    problems = [None] * dist.get_world_size()
    dist.all_gather_object(problems, problem)
    return next((p for p in problems if p), None)


def _compare(make, case, bucket_cap_mb, accum_steps, steps=3, kind="mlp", overlap=False):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from course_utils.data import make_regression

    rank, ws = dist.get_rank(), dist.get_world_size()
    try:
        theirs = make(_make(kind, seed=7 if rank == 0 else 50 + rank), bucket_cap_mb)
    except Exception as exc:  # noqa: BLE001
        return f"{case}: " + _raised("constructing your wrapper", exc)
    torch_ddp = DDP(_make(kind, seed=7), bucket_cap_mb=bucket_cap_mb)
    problem = None
    for (name, p), q in zip(theirs.module.named_parameters(), torch_ddp.module.parameters()):
        if not torch.equal(p, q):
            problem = (f"{case}: right after construction, parameter {name!r} differs from rank 0's. "
                       "Broadcast rank 0's parameters (frozen ones too) and buffers in __init__.")
            break
    problem = _agree(problem)
    if problem:
        return problem
    from course_utils.checks.fsdp import CollectiveLog  # sees dist.*, functional collectives, group methods

    local = _make(kind, seed=7)
    opts = [torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.05, momentum=0.9)
            for m in (theirs, torch_ddp, local)]
    x, y = (t.to(_device()) for t in make_regression(n=16 * ws * accum_steps * steps, seed=3))
    micro = 16
    trainable = [p for p in theirs.module.parameters() if p.requires_grad]
    for step in range(steps):
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        for k in range(accum_steps):
            i = ((step * ws + rank) * accum_steps + k) * micro
            xb, yb = x[i:i + micro], y[i:i + micro]
            for m in (theirs, torch_ddp, local):
                sync = k == accum_steps - 1 or m is local
                watch = overlap and m is theirs and sync and step == steps - 1
                log, handles = [], []
                if watch:
                    handles = [p.register_post_accumulate_grad_hook(lambda p: log.append(("grad", None)))
                               for p in trainable]
                silent = CollectiveLog() if m is theirs and not sync else contextlib.nullcontext()
                try:
                    with (_spy_all_reduce(log) if watch else contextlib.nullcontext()):
                        with (contextlib.nullcontext() if sync else m.no_sync()), silent:
                            torch.nn.functional.mse_loss(m(xb), yb).div(accum_steps).backward()
                except Exception as exc:  # noqa: BLE001
                    if m is theirs:
                        return f"{case}, step {step}: " + _raised("a forward/backward through your wrapper", exc)
                    raise
                finally:
                    for h in handles:
                        h.remove()
                if watch:
                    watched = log
                if isinstance(silent, CollectiveLog) and _gradient_collectives(silent):
                    problem = _no_sync_problem(case, silent)
                    break
            if problem:
                break
        problem = _agree(problem or _grad_problem(case, step, theirs, torch_ddp, local, ws))
        if problem:
            return problem
        for opt in opts:
            opt.step()
        local.load_state_dict(torch_ddp.module.state_dict())  # the local grad is the same step's, per rank
    if overlap:
        hint = ("" if kind == "mlp" else " Here backward produces the gradients in another order than reverse "
                "registration: after the first backward, rebuild the buckets in the order the hooks fired.")
        if kind == "by_rank":
            hint = ""
        to_come = 1 if kind == "mlp" else len(trainable) // 2  # reordered: bucket 0 must not wait for embed
        return _agree(_overlap_problem(case, watched, len(trainable), hint, to_come))
    return None


def _gradient_collectives(log):
    """The collectives of ``log`` that could carry gradients: all but broadcasts (a forward may broadcast, as torch
    DDP's does inside no_sync too: the rebuilt bucket order, buffers)."""
    return [call for call in log.calls if not call[0].startswith("broadcast")]


def _no_sync_problem(case, log):
    """A micro-batch run inside ``no_sync()`` issued collectives (``log``: the CollectiveLog of its forward and
    backward, seen at the process group). Summing every micro-step's average gives the same gradient as one
    average at the end, so only this count tells a ``no_sync`` that does nothing from one that works."""
    calls = _gradient_collectives(log)
    kinds = sorted({kind for kind, _, _ in calls})
    return (f"{case}: inside no_sync() your wrapper issued {len(calls)} collective(s) ({', '.join(kinds)}), seen "
            "at the process group. The gradients come out right (every micro-step's average adds up to the same "
            "sum), but no_sync exists to skip that communication: set require_backward_grad_sync = False in "
            "no_sync(), read it in forward, and let grad_ready return at once when this forward does not sync.")


def _nesting_problem(make):
    """Nested ``no_sync()`` blocks: the inner one restores the outer one's False, the outer one True."""
    try:
        theirs = make(_make("mlp", seed=7), 25)
        with theirs.no_sync():
            with theirs.no_sync():
                pass
            inner = theirs.require_backward_grad_sync
        outer = theirs.require_backward_grad_sync
    except Exception as exc:  # noqa: BLE001
        return "nested no_sync() blocks: " + _raised("your wrapper", exc)
    if inner is not False or outer is not True:
        return (f"nested no_sync() blocks: after the inner block require_backward_grad_sync is {inner} (expected "
                f"False, the outer block's), after the outer one {outer} (expected True). On exit, restore the value "
                "you found on entry, not True.")
    return None


def _grad_problem(case, step, theirs, torch_ddp, local, ws):
    for (name, p), q, l in zip(theirs.module.named_parameters(), torch_ddp.module.parameters(), local.parameters()):
        if q.grad is None:
            if p.grad is not None:
                return (f"{case}, step {step}: {name} is frozen (requires_grad=False) but has a .grad: leave "
                        "frozen parameters out of the buckets and the hooks.")
            continue
        if p.grad is None:
            return f"{case}, step {step}: {name}.grad is None after backward."
        if not torch.allclose(p.grad, q.grad, rtol=0, atol=TOL):
            hint = _BY_RANK_HINT if "on each rank" in case else ""
            return f"{case}, step {step}: " + _diagnose(name, p.grad, q.grad, l.grad, ws) + hint
    return None


CASES = [("25 MiB buckets", 25, 1, "mlp", False),
         ("one bucket per parameter", 1e-9, 1, "mlp", True),
         ("no_sync accumulation over 3 micro-batches", 1e-9, 3, "mlp", False),
         ("a model whose forward uses its layers in another order than registered", 1e-9, 1, "reordered", False),
         ("a model with a tied (shared) weight", 1e-9, 1, "tied", False),
         ("a model with a frozen parameter", 1e-9, 1, "frozen", False),
         ("a model whose backward produces its gradients in another order on each rank", 1e-9, 1, "by_rank",
          False)]
_BY_RANK_HINT = (" Here backward produces the gradients of two same-shaped layers in another order on each rank: "
                 "launch the buckets strictly in bucket order (bucket i only once buckets 0..i-1 are launched), so "
                 "that every rank's n-th all-reduce is the same bucket; launched in ready order, rank 0's a is "
                 "summed with rank 1's b.")


def _stale_work_problem(make):
    """A synced backward in which one parameter gets no gradient must raise (as the reference and torch DDP do),
    not finish with the previous backward's all-reduce results. None when it does."""
    case = "a backward in which one layer takes no part"
    rank = dist.get_rank()
    try:
        theirs = make(_make("skippable", seed=7 if rank == 0 else 50 + rank), 1e-9)
    except Exception as exc:  # noqa: BLE001
        return f"{case}: " + _raised("constructing your wrapper", exc)
    from course_utils.data import make_regression

    x, y = (t.to(_device()) for t in make_regression(n=32, seed=5))
    xb, yb = x[16 * (rank % 2):16 * (rank % 2) + 16], y[16 * (rank % 2):16 * (rank % 2) + 16]
    try:
        torch.nn.functional.mse_loss(theirs(xb), yb).backward()      # every layer: each bucket launched once
    except Exception as exc:  # noqa: BLE001
        return f"{case}, the normal backward before it: " + _raised("a forward/backward through your wrapper", exc)
    before = {n: p.grad.clone() for n, p in theirs.module.named_parameters()}
    theirs.zero_grad(set_to_none=False)                                # zeros, so a stale copy shows
    try:
        torch.nn.functional.mse_loss(theirs(xb, skip=True), yb).backward()
    except Exception:  # noqa: BLE001 -- raising is right: the bucket of `extra` was never reduced
        return None
    # the skipped forward changes every other gradient, so a .grad equal to the previous backward's is a stale copy
    stale = [n for n, p in theirs.module.named_parameters()
             if p.grad is not None and p.grad.abs().sum() > 0 and torch.equal(p.grad, before[n])]
    if not stale:
        return None  # no error, and nothing stale (e.g. one all-reduce per gradient that fired): acceptable
    return (f"{case}: `extra` got no gradient in this synced backward, so its bucket (and, launched in order, every "
            "bucket after it) never started an all-reduce; yet backward returned without an error and "
            f"{', '.join(stale)} still hold the previous backward's average: finish() waited on a .work left "
            "over from the previous backward and copied its stale result. In "
            "finish, wait only for the buckets launched in this backward, and raise an error naming the "
            "parameters whose bucket was never launched (as the reference MicroDDP and torch DDP do).")


def _retained_graph_problem(make):
    """``loss.backward(retain_graph=True)`` then ``loss.backward()``, no forward in between: both backwards must
    sync, leaving twice the average gradient. None when they do.

    Compared with the exact average, not with torch DDP: torch 2.13's DDP leaves the second backward's gradient
    local (its reducer expects gradient hooks only between a forward and the end of the next backward)."""
    case = "a second backward through a retained graph (loss.backward(retain_graph=True), then loss.backward())"
    from course_utils.data import make_regression

    rank, ws = dist.get_rank(), dist.get_world_size()
    try:
        theirs = make(_make("mlp", seed=7 if rank == 0 else 50 + rank), 1e-9)
    except Exception as exc:  # noqa: BLE001
        return f"{case}: " + _raised("constructing your wrapper", exc)
    x, y = (t.to(_device()) for t in make_regression(n=16 * ws, seed=9))
    xb, yb = x[16 * rank:16 * rank + 16], y[16 * rank:16 * rank + 16]
    local = _make("mlp", seed=7)
    torch.nn.functional.mse_loss(local(xb), yb).backward()
    averages = []
    for p in local.parameters():
        avg = p.grad.clone()
        dist.all_reduce(avg)
        averages.append(avg / ws)
    try:
        loss = torch.nn.functional.mse_loss(theirs(xb), yb)
        loss.backward(retain_graph=True)
        loss.backward()
    except Exception as exc:  # noqa: BLE001
        return (f"{case}: " + _raised("the second backward", exc) + ". Each backward must start from a clean "
                "state: reset what one backward uses (queued, the next bucket to launch, the buckets' ready sets "
                "and works) when it ends, not only in forward.")
    for (name, p), avg, q in zip(theirs.module.named_parameters(), averages, local.parameters()):
        if p.grad is None:
            return f"{case}: {name}.grad is None after both backwards."
        if torch.allclose(p.grad, 2 * avg, rtol=0, atol=2 * TOL):
            continue
        if torch.allclose(p.grad, avg + q.grad, rtol=1e-5, atol=1e-7):
            return (f"{case}: {name}.grad is the first backward's average plus this rank's LOCAL gradient of the "
                    "second: the second backward queued no finish and launched no bucket, because what says so "
                    "(queued, the next bucket, the ready sets) is reset only in forward. Reset it when a backward "
                    "ends (at the end of finish), so that every backward syncs, with or without a forward before it.")
        err = (p.grad - 2 * avg).abs().max().item()
        return (f"{case}: {name}.grad differs from twice the average gradient (each backward adds the average) by "
                f"{err:.2e}. Every synced backward must all-reduce what it accumulated, with or without a forward "
                "before it.")
    return None


def _buffers_problem(make):
    """Duty 6: after a few training steps of a BatchNorm model, an eval forward gives the same output on every rank,
    and torch DDP's (which broadcasts rank 0's buffers at the start of a forward). None when it does."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from course_utils.data import make_regression

    case = "a model with BatchNorm (buffers that every rank's forward updates from its own batch)"
    rank, ws = dist.get_rank(), dist.get_world_size()
    try:
        theirs = make(_make("normed", seed=7 if rank == 0 else 50 + rank), 25)
    except Exception as exc:  # noqa: BLE001
        return f"{case}: " + _raised("constructing your wrapper", exc)
    torch_ddp = DDP(_make("normed", seed=7))
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (theirs, torch_ddp)]
    x, y = (t.to(_device()) for t in make_regression(n=16 * ws * 3, seed=13))
    x_eval = make_regression(n=8, seed=14)[0].to(_device())
    for step in range(3):
        i = (step * ws + rank) * 16
        for m, opt in zip((theirs, torch_ddp), opts):
            opt.zero_grad(set_to_none=True)
            try:
                torch.nn.functional.mse_loss(m(x[i:i + 16]), y[i:i + 16]).backward()
            except Exception as exc:  # noqa: BLE001
                if m is theirs:
                    return f"{case}, step {step}: " + _raised("a forward/backward through your wrapper", exc)
                raise
            opt.step()
    with torch.no_grad():
        theirs.eval(), torch_ddp.eval()
        try:
            got = theirs(x_eval)
        except Exception as exc:  # noqa: BLE001
            return f"{case}: " + _raised("an eval forward under torch.no_grad() through your wrapper", exc)
        want = torch_ddp(x_eval)
        theirs.train(), torch_ddp.train()
    outs = [torch.zeros_like(got) for _ in range(ws)]
    dist.all_gather(outs, got.contiguous())
    if not all(torch.allclose(o, outs[0], rtol=0, atol=TOL) for o in outs):
        return (f"{case}: after 3 training steps an eval forward gives different outputs on the ranks. BatchNorm's "
                "running_mean and running_var are buffers, not parameters: no gradient carries them, and each "
                "rank's forward updated its own copy from its own batch. torch DDP broadcasts rank 0's buffers at "
                "the start of every forward (duty 6): do that in sync_buffers, called from forward.")
    if not torch.allclose(got, want, rtol=0, atol=1e-5):
        return (f"{case}: after 3 training steps the ranks agree on an eval forward, but not with torch DDP (by "
                f"{(got - want).abs().max().item():.2e}). torch DDP keeps RANK 0's buffers (a broadcast from rank 0 at "
                "the start of each forward), not an average of the ranks' statistics.")
    return None


def check_micro_ddp(make, rebuild=False):
    """``make(module, bucket_cap_mb)`` -> your DDP wrapper. Compared with torch DDP over SGD-with-momentum
    steps: default buckets, one bucket per parameter (where it must also overlap: an all-reduce started
    while backward still computes gradients), 3-step accumulation with no_sync(), a model used in another
    order than registered, a tied weight, and a frozen parameter. ``rebuild=True`` also requires overlap on
    the model used out of registration order, from its third step: buckets rebuilt in grad-ready order.
    Each case compares every ``.grad`` with torch DDP's once per optimizer step (after the last micro-batch's
    backward); inside ``no_sync()`` it counts the collectives that reach the process group instead (a
    ``CollectiveLog``), and any but a broadcast is a problem. Nested ``no_sync()`` blocks must restore the outer
    one's value.
    Then a synced backward in which a layer takes no part must raise, a second backward through a retained
    graph (no forward before it) must sync too, and after a few steps of a BatchNorm model an eval forward must
    give every rank torch DDP's output (duty 6: rank 0's buffers broadcast at the start of every forward)."""
    cases = [c[:4] + (c[4] or (rebuild and c[3] == "reordered"),) for c in CASES]
    checks = [lambda c=c: _compare(make, c[0], c[1], c[2], kind=c[3], overlap=c[4]) for c in cases]
    problem = _first_problem(checks + [lambda: _agree(_nesting_problem(make)),
                                       lambda: _agree(_stale_work_problem(make)),
                                       lambda: _agree(_retained_graph_problem(make)),
                                       lambda: _agree(_buffers_problem(make))])
    _verdict(problem)
    if dist.get_rank() == 0:
        print(f"check_micro_ddp: matches torch DDP within {TOL:g} on {len(CASES)} cases"
              f"{' (overlapping after the rebuild)' if rebuild else ''}, with no collective inside no_sync, and "
              "keeps rank 0's BatchNorm buffers on every rank; nested no_sync, a skipped layer and a retained graph "
              "are handled.")


# -- exercise 2: the flag read at backward time ---------------------------------------------------

_LATE_KEYS = ("torch DDP", "yours")


def _late_flag_problem(make_late, predicted):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from course_utils.checks.fsdp import CollectiveLog
    from course_utils.data import make_regression

    rank, ws = dist.get_rank(), dist.get_world_size()
    try:
        theirs = make_late(_make("mlp", seed=7 if rank == 0 else 50 + rank), 25)
    except Exception as exc:  # noqa: BLE001
        return _raised("constructing your class", exc)
    torch_ddp = DDP(_make("mlp", seed=7))
    counted = {"all_reduces": 0}

    def counting_hook(state, bucket):
        state["all_reduces"] += 1
        fut = dist.all_reduce(bucket.buffer().div_(ws), async_op=True).get_future()
        return fut.then(lambda f: f.value()[0])

    torch_ddp.register_comm_hook(counted, counting_hook)
    x, y = (t.to(_device()) for t in make_regression(n=16 * ws * 3, seed=11))
    synced = {key: [] for key in _LATE_KEYS}
    for k in range(3):
        i = (rank * 3 + k) * 16
        for key, m in (("yours", theirs), ("torch DDP", torch_ddp)):
            loss = torch.nn.functional.mse_loss(m(x[i:i + 16]), y[i:i + 16]) / 3   # every forward outside no_sync
            log, before = CollectiveLog(), counted["all_reduces"]
            try:
                with (m.no_sync() if k < 2 else contextlib.nullcontext()), (
                        log if m is theirs else contextlib.nullcontext()):
                    loss.backward()                                                  # only 2 backwards inside it
            except Exception as exc:  # noqa: BLE001
                if m is theirs:
                    return f"micro-batch {k}: " + _raised("a backward through your class", exc)
                raise
            synced[key].append(bool(_gradient_collectives(log)) if m is theirs else counted["all_reduces"] > before)
    # the verdicts name no count: the counts are what `predicted` asks for
    if synced["yours"][:2] == [True, True]:
        return ("your class all-reduced in backwards that ran inside no_sync(): it still decides in forward, where "
                "every micro-batch ran outside no_sync(). In grad_ready, read self.require_backward_grad_sync "
                "itself, when the backward runs, instead of the value forward stored.")
    if synced["yours"] != [False, False, True]:
        return ("your class did not all-reduce in exactly the backwards that ran outside no_sync(): a class that "
                "reads the flag when each backward runs syncs those and no other.")
    for (name, p), q in zip(theirs.module.named_parameters(), torch_ddp.module.parameters()):
        if not torch.allclose(p.grad, q.grad, rtol=0, atol=TOL):
            return (f"{name}.grad differs from torch DDP's after the 3 micro-batches by "
                    f"{(p.grad - q.grad).abs().max().item():.2e}: the last backward must all-reduce everything the "
                    "three accumulated.")
    if not isinstance(predicted, dict) or set(predicted) != set(_LATE_KEYS):
        return f"predicted must be a dict with the keys {list(_LATE_KEYS)}, got {predicted!r}."
    missing = [key for key in _LATE_KEYS if predicted[key] is None]
    if missing:
        return (f"predicted: fill in {missing}: how many of the 3 backwards all-reduce (a number each), then run "
                "the cell again.")
    why = {"torch DDP": "torch DDP decides in forward (its forward arms the reduction when the flag is True): where "
                        "did the three forwards run?",
           "yours": "your class reads the flag when each backward runs: which backwards ran outside no_sync()?"}
    for key in _LATE_KEYS:
        if predicted[key] != sum(synced[key]):
            label = "your class" if key == "yours" else key
            return (f"{label}: your prediction, {predicted[key]!r}, is not the number of backwards that all-reduced "
                    "on the ranks. " + why[key])
    return None


def check_late_flag(make_late, predicted):
    """Self-check of 11_capstone_micro_ddp's exercise 2; call it on every rank (inside a ``%%ddp`` cell).

    ``make_late(module, bucket_cap_mb)`` builds the learner's ``MyMicroDDP`` that reads
    ``require_backward_grad_sync`` in ``grad_ready``, at backward time. Three micro-batches run their forwards
    outside ``no_sync()`` and the backwards of the first two inside it, through that class and through torch DDP;
    the checker sees which backwards issued a gradient collective (at the process group for the class, through a
    comm hook for torch DDP), compares the gradients, then ``predicted`` ({"torch DDP": n, "yours": n}, how many of
    the 3 backwards all-reduce) with the counts, never naming them. Raises ``AssertionError`` saying what is wrong;
    rank 0 prints one line when it is right."""
    _verdict(_agree(_late_flag_problem(make_late, predicted)))
    if dist.get_rank() == 0:
        print("check_late_flag: your class reads the flag when each backward runs, its gradients match torch DDP's, "
              "and both predictions match what the ranks counted.")


# -- exercise: a compressor -----------------------------------------------------------------------

@contextlib.contextmanager
def _count_bytes():
    """Count the bytes each all_reduce call puts on the wire (element size x numel)."""
    sent = []
    original = dist.all_reduce

    def spy(tensor, *args, **kwargs):
        sent.append(tensor.numel() * tensor.element_size())
        return original(tensor, *args, **kwargs)

    dist.all_reduce = spy
    try:
        yield sent
    finally:
        dist.all_reduce = original


def check_compressor(compressor, max_rel_error=1e-2):
    """Plug ``compressor`` into the reference MicroDDP: after backward, .grad must be the average within
    ``max_rel_error`` (relative to its largest entry), and fewer bytes than fp32 must go on the wire."""
    from course_utils.data import make_regression
    from course_utils.models import make_model

    rank, ws = dist.get_rank(), dist.get_world_size()
    x, y = (t.to(_device()) for t in make_regression(n=32 * ws, seed=5))
    xb, yb = x[rank * 32:(rank + 1) * 32], y[rank * 32:(rank + 1) * 32]
    model = ref.MicroDDP(make_model(seed=1).to(_device()), compressor=compressor)
    problem = None
    with _count_bytes() as sent:
        try:
            torch.nn.functional.mse_loss(model(xb), yb).backward()
        except Exception as exc:  # noqa: BLE001 (the learner's code: any error becomes the verdict)
            problem = _raised("your compressor", exc)
    exact = make_model(seed=1).to(_device())
    torch.nn.functional.mse_loss(exact(xb), yb).backward()
    fp32_bytes = 4 * sum(p.numel() for p in exact.parameters())
    for (name, p), q in zip(model.module.named_parameters(), exact.parameters()):
        if problem:
            break
        avg = q.grad.clone()
        dist.all_reduce(avg)
        avg /= ws
        rel = ((p.grad - avg).abs().max() / avg.abs().max()).item()
        if rel > max_rel_error:
            scale = avg.abs().max()
            if ((p.grad - avg * ws).abs().max() / scale).item() <= max(max_rel_error * ws, 1e-2):
                why = "It is world_size x the average (the SUM): divide by world_size before the all-reduce."
            elif ((p.grad - q.grad).abs().max() / scale).item() <= 1e-6:
                why = ("It is this rank's own gradient: the reduced values never came back into flat. In the "
                       "callable you return, copy them into flat (cast back to fp32), e.g. flat.copy_(low).")
            else:
                why = ("Divide by world_size before casting (fp16 overflows past 65504) and copy the reduced values "
                       "back into flat after wait(); a tighter tolerance needs more bits on the wire.")
            problem = (f"{name}.grad is off the average by {rel:.1e} of its largest entry "
                       f"(allowed {max_rel_error:g}). {why}")
            break
    if problem is None and sum(sent) >= fp32_bytes:
        problem = (f"the compressor sent {sum(sent)} bytes, as many as fp32 ({fp32_bytes}): the values still travel "
                   "as 32-bit floats (scaling them, by 0.5 or anything else, changes no byte). Change the dtype "
                   "(fp16/bf16) or the representation (low rank).")
    _verdict(problem)
    if rank == 0:
        print(f"check_compressor: average within {max_rel_error:g}; {sum(sent)} bytes sent instead of {fp32_bytes}.")
