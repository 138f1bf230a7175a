"""Checkers for the pieces of MicroDDP the learner writes in 11_capstone_micro_ddp.

Call them INSIDE a ``%%ddp`` cell: every rank runs the same checks on the process group that is
already there, and every rank raises the same ``AssertionError`` (the first failing rank's
explanation) or returns quietly. ``check_assign_buckets`` needs no process group.
"""
import contextlib

import torch
import torch.distributed as dist

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


def _first_problem(checks):
    """Run zero-argument callables that return None or an explanation; stop at the first problem."""
    for check in checks:
        problem = check()
        if problem:
            return problem
    return None


# -- piece 1: the broadcast ---------------------------------------------------------------------

def check_broadcast_state(broadcast_state):
    """``broadcast_state(module)`` must make every rank's parameters and buffers equal rank 0's."""
    from course_utils.models import make_model

    model = make_model(seed=100 + dist.get_rank())
    model.register_buffer("steps", torch.full((3,), float(dist.get_rank())))
    want = make_model(seed=100)
    want.register_buffer("steps", torch.zeros(3))
    broadcast_state(model)
    problem = None
    for (name, got), exp in zip([*model.named_parameters(), *model.named_buffers()],
                                [*want.parameters(), *want.buffers()]):
        if not torch.equal(got, exp):
            kind = "buffer" if name == "steps" else "parameter"
            problem = (f"after broadcast_state, {kind} {name!r} differs from rank 0's. Broadcast every parameter "
                       "AND every buffer (module.buffers()) from rank 0, in place (dist.broadcast(t, src=0)).")
            break
    _verdict(problem)
    if dist.get_rank() == 0:
        print("check_broadcast_state: every parameter and buffer now equals rank 0's.")


# -- piece 2: the bucket assignment -------------------------------------------------------------

def check_assign_buckets(assign_buckets):
    """``assign_buckets(params, bucket_cap_mb)`` -> lists of indices, in reverse order, closing at the cap."""
    mb = 1024 * 1024
    params = [torch.zeros(1000), torch.zeros(10), torch.zeros(1000), torch.zeros(10)]  # 4000, 40, 4000, 40 bytes
    cases = [(4000 / mb, "a cap of 4000 bytes"), (1e-9, "a tiny cap"), (25, "the default 25 MiB"),
             (8040 / mb, "a cap of 8040 bytes")]
    problem = None
    for cap, what in cases:
        want = ref.assign_buckets(params, cap)
        got = assign_buckets(params, cap)
        got = [list(map(int, b)) for b in got]
        flat = sorted(i for b in got for i in b)
        if flat != list(range(len(params))):
            problem = (f"with {what}, the buckets {got} do not hold every parameter exactly once. "
                       "Each parameter index 0..3 must be in exactly one bucket.")
        elif got and got[0] and got[0][0] == 0 and want[0][0] != 0:
            problem = (f"with {what}, you got {got}: the first bucket starts with parameter 0. Walk the "
                       "parameters in REVERSE: backward produces the last layer's gradient first.")
        elif got != want:
            problem = (f"with {what} (sizes 4000, 40, 4000, 40 bytes), expected {want}, got {got}. A bucket "
                       "closes as soon as it holds at least the cap (so it may overflow by one parameter).")
        if problem:
            break
    _verdict(problem)
    if not dist.is_initialized() or dist.get_rank() == 0:
        print("check_assign_buckets: reverse order, closing at the cap: as torch DDP does.")


# -- piece 3: one bucket's asynchronous all-reduce ----------------------------------------------

def check_start_allreduce(start_allreduce):
    """``start_allreduce(flat)`` starts an async all-reduce that leaves the average in ``flat``."""
    ws, rank = dist.get_world_size(), dist.get_rank()
    flat = torch.arange(6, dtype=torch.float32) * (rank + 1)
    want = torch.arange(6, dtype=torch.float32) * sum(r + 1 for r in range(ws)) / ws
    work = start_allreduce(flat)
    problem = None
    if work is None or not hasattr(work, "wait"):
        problem = ("start_allreduce returned no Work: call dist.all_reduce(flat, async_op=True) and return what it "
                   "returns, so backward goes on while the bucket travels.")
        dist.barrier()  # the collective (if any) ran synchronously; keep the ranks in step
    else:
        work.wait()
        if torch.allclose(flat, want * ws):
            problem = "flat holds the SUM over the ranks, not the average: divide by world_size."
        elif not torch.allclose(flat, want):
            problem = f"after wait(), flat is {flat.tolist()}, expected the average {want.tolist()}."
    _verdict(problem)
    if rank == 0:
        print("check_start_allreduce: asynchronous, and the bucket holds the average after wait().")


# -- piece 4: the whole class against torch DDP --------------------------------------------------

def _diagnose(name, got, want, local, ws):
    err = (got - want).abs().max().item()
    hint = ""
    if torch.allclose(got, want * ws, rtol=1e-5, atol=1e-7):
        hint = " It is world_size x the average: divide by world_size."
    elif torch.allclose(got, local, rtol=1e-5, atol=1e-7):
        hint = (" It equals this rank's local gradient: no averaging happened (did the hooks launch the bucket, "
                "and did you wait and copy the result back into .grad before backward() returned?).")
    return f"{name}.grad differs from torch DDP's by {err:.2e} (tolerance {TOL:g}).{hint}"


def _compare(make, case, bucket_cap_mb, accum_steps, steps=3):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from course_utils.data import make_regression
    from course_utils.models import make_model

    rank, ws = dist.get_rank(), dist.get_world_size()
    theirs = make(make_model(seed=7 if rank == 0 else 50 + rank), bucket_cap_mb)
    torch_ddp = DDP(make_model(seed=7), bucket_cap_mb=bucket_cap_mb)
    for (name, p), q in zip(theirs.module.named_parameters(), torch_ddp.module.parameters()):
        if not torch.equal(p, q):
            return (f"{case}: right after construction, parameter {name!r} differs from rank 0's. "
                    "Broadcast rank 0's parameters and buffers in __init__.")
    local = make_model(seed=7)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (theirs, torch_ddp, local)]
    x, y = make_regression(n=16 * ws * accum_steps * steps, seed=3)
    micro = 16
    for step in range(steps):
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        for k in range(accum_steps):
            i = ((step * ws + rank) * accum_steps + k) * micro
            xb, yb = x[i:i + micro], y[i:i + micro]
            for m in (theirs, torch_ddp, local):
                sync = k == accum_steps - 1 or m is local
                with (contextlib.nullcontext() if sync else m.no_sync()):
                    torch.nn.functional.mse_loss(m(xb), yb).div(accum_steps).backward()
        for (name, p), q, l in zip(theirs.module.named_parameters(), torch_ddp.module.parameters(), local.parameters()):
            if p.grad is None:
                return f"{case}, step {step}: {name}.grad is None after backward."
            if not torch.allclose(p.grad, q.grad, rtol=0, atol=TOL):
                return f"{case}, step {step}: " + _diagnose(name, p.grad, q.grad, l.grad, ws)
        for opt in opts:
            opt.step()
        local.load_state_dict(torch_ddp.module.state_dict())  # the local grad is the same step's, per rank
    return None


def check_micro_ddp(make):
    """``make(module, bucket_cap_mb)`` -> your DDP wrapper. Compared with torch DDP over SGD-with-momentum
    steps: default buckets, one bucket per parameter, and 3-step accumulation with no_sync()."""
    cases = [("25 MiB buckets", 25, 1), ("one bucket per parameter", 1e-9, 1),
             ("no_sync accumulation over 3 micro-batches", 1e-9, 3)]
    problem = _first_problem([lambda c=c: _compare(make, *c) for c in cases])
    _verdict(problem)
    if dist.get_rank() == 0:
        print(f"check_micro_ddp: matches torch DDP within {TOL:g} ({'; '.join(c[0] for c in cases)}).")


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
    x, y = make_regression(n=32 * ws, seed=5)
    xb, yb = x[rank * 32:(rank + 1) * 32], y[rank * 32:(rank + 1) * 32]
    model = ref.MicroDDP(make_model(seed=1), compressor=compressor)
    with _count_bytes() as sent:
        torch.nn.functional.mse_loss(model(xb), yb).backward()
    exact = make_model(seed=1)
    torch.nn.functional.mse_loss(exact(xb), yb).backward()
    fp32_bytes = 4 * sum(p.numel() for p in exact.parameters())
    problem = None
    for (name, p), q in zip(model.module.named_parameters(), exact.parameters()):
        avg = q.grad.clone()
        dist.all_reduce(avg)
        avg /= ws
        rel = ((p.grad - avg).abs().max() / avg.abs().max()).item()
        if rel > max_rel_error:
            problem = (f"{name}.grad is off the average by {rel:.1e} of its largest entry (allowed {max_rel_error:g}). "
                       "Divide by world_size, and cast back to fp32 in the bucket after wait().")
            break
    if problem is None and sum(sent) >= fp32_bytes:
        problem = (f"the compressor sent {sum(sent)} bytes, as many as fp32 ({fp32_bytes}): multiplying by 0.5 "
                   "compresses nothing. Change the dtype (fp16/bf16) or the representation (low rank).")
    _verdict(problem)
    if rank == 0:
        print(f"check_compressor: average within {max_rel_error:g}; {sum(sent)} bytes sent instead of {fp32_bytes}.")
