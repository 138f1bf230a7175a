"""A tiny data-parallel training job with one bug planted on purpose, for 17_debugging_and_profiling.

Each rank trains a linear model on its own slice of a fixed data set, averages the gradients with one
``all_reduce`` per step (as in 05_manual_gradient_averaging) and all-reduces the loss for the log. ``--bug``
plants one of the classic faults at step 2 (``skip`` at the last step, ``shape`` from the start):

- ``none``:  a healthy run;
- ``skip``:  rank 1 skips the loss all-reduce of the last step (a rank-dependent ``if`` around a collective);
- ``order``: rank 0 broadcasts an early-stopping flag before the gradient all-reduce, the others after it;
- ``shape``: rank 1's model has no bias, so its gradient holds one number less;
- ``dtype``: rank 1 all-reduces its gradient as int32, rank 0 as float32 (the same number of bytes);
- ``dead``:  rank 1 is killed (SIGKILL, as the kernel's OOM killer does);
- ``mystery``: the exercise's job (4 ranks): which rank, which collective? Read its Flight Recorder dumps.

Every rank prints one line per step. When a collective fails, the rank prints the error in one line and, unless
the Flight Recorder is off (``fr_buffer_size()`` is 0: it is on by default, 2000 entries), writes its buffer to
``<out>/fr_<rank>``; a rank that finishes writes it too, with when it said each line (``said_<rank>``, to time its
steps) and its final parameters (``params_<rank>``). gloo never dumps by itself; NCCL can, see
TORCH_NCCL_DUMP_ON_TIMEOUT in the lesson. ``--timeout`` is the process group's timeout in seconds: how long a
rank waits in a collective before it gives up.

    torchrun --nproc-per-node 2 -m course_utils.planted_bugs --bug skip
    torchrun --nproc-per-node 2 -m course_utils.planted_bugs --bug skip --out /tmp/fr
    python -m torch.distributed.flight_recorder.fr_trace /tmp/fr      # after course_utils.debugging.fix_gloo_dumps
    TORCH_DISTRIBUTED_DEBUG=DETAIL torchrun --nproc-per-node 2 -m course_utils.planted_bugs --bug shape

Introduced in 17_debugging_and_profiling; the notebook runs it through ``course_utils.debugging.run_job``.
"""
import argparse
import datetime
import io
import json
import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist

BUGS = ("none", "skip", "order", "shape", "dtype", "dead", "mystery")
STEPS = 4
BUG_STEP = 2
LR = 0.1


def _mystery(step, steps, rank, grads, loss):
    """The exercise's job: the answer is not written here in words; the lesson's checker reads it from the dumps."""
    dist.all_reduce(grads)
    if rank == 0 and step == steps - 1:       # a last report, which only rank 0 writes
        dist.all_reduce(loss.clone())
    dist.all_reduce(loss)


_SAID = []     # (time.perf_counter(), line) of every line said: the lesson times the steps from them


def say(text):
    """One line in one write: the ranks share torchrun's pipe, and a line written in two pieces can interleave."""
    _SAID.append((time.perf_counter(), text))
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def train(bug, steps=STEPS):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    x, y = torch.randn(64, 8), torch.randn(64, 1)
    mine = slice(rank * 64 // world_size, (rank + 1) * 64 // world_size)
    model = torch.nn.Linear(8, 1, bias=not (bug == "shape" and rank == 1))
    stop = torch.zeros(1)
    for step in range(steps):
        loss = torch.nn.functional.mse_loss(model(x[mine]), y[mine])
        model.zero_grad()
        loss.backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters()])
        log = loss.detach().clone()
        if bug == "dtype" and step == BUG_STEP and rank == 1:
            grads = grads.to(torch.int32)                         # 4 bytes a number, as float32: no error
        if bug == "dead" and step == BUG_STEP and rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        if bug == "mystery":
            _mystery(step, steps, rank, grads, log)
        else:
            if bug == "order" and step == BUG_STEP and rank == 0:
                dist.broadcast(stop, src=0)                       # rank 0 decides first ...
            dist.all_reduce(grads)                                # gradient averaging (lesson 05)
            if bug == "order" and step == BUG_STEP and rank != 0:
                dist.broadcast(stop, src=0)                       # ... the others listen after the all-reduce
            if not (bug == "skip" and step == steps - 1 and rank == 1):
                dist.all_reduce(log)                              # the loss for the log
        offset = 0
        with torch.no_grad():          # SGD by hand (torch.optim's first optimizer imports torch._dynamo: seconds)
            for p in model.parameters():
                p -= LR * grads[offset:offset + p.numel()].view_as(p) / world_size
                offset += p.numel()
        say(f"rank {rank}: step {step} done")
    dist.barrier()
    say(f"rank {rank}: finished")
    return model


def fr_buffer_size(environ=None):
    """The Flight Recorder's size in entries, read as torch 2.13 reads it (``FlightRecorder.hpp``:
    ``getCvarInt({"TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"}, 2000)``): the first name wins over the
    older second one, and without either it is 2000. 0 (or less) switches the recorder off."""
    environ = os.environ if environ is None else environ
    for name in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"):
        if name in environ:
            return int(environ[name])
    return 2000


def _write(out, name, data):
    tmp = os.path.join(out, f".{name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, os.path.join(out, name))                      # whole or absent, never half-written


def dump_flight_recorder(out, rank):
    """Write this rank's Flight Recorder buffer (a pickle, as torch's analyzer reads it) to ``out/fr_<rank>``,
    unless the recorder is off (``fr_buffer_size() <= 0``)."""
    if out is None or fr_buffer_size() <= 0:
        return
    _write(out, f"fr_{rank}", torch._C._distributed_c10d._dump_fr_trace())


def linger(out, rank, seconds):
    """Stay until every rank has failed too (or ``seconds`` passed): a rank that exits first closes its
    connections, and a slower peer would report "Connection closed by peer" instead of its own timeout. A demo's
    courtesy, so that each rank reports what it saw itself; a real job just exits. A rank that torchrun is
    stopping (see ``on_sigterm``) does not linger."""
    if out is None:
        return
    open(os.path.join(out, f"failed_{rank}"), "w").close()
    world_size, deadline = dist.get_world_size(), time.monotonic() + seconds
    while time.monotonic() < deadline and not _STOPPING.is_set():
        if sum(os.path.exists(os.path.join(out, f"failed_{r}")) for r in range(world_size)) == world_size:
            return
        time.sleep(0.05)


_STOPPING = threading.Event()


def on_sigterm(out, rank, grace):
    """torchrun stops the other ranks (SIGTERM) as soon as one has failed. The same courtesy as ``linger``: the
    rank first finishes what it was doing, which fails within seconds (its peer is gone, or its collective times
    out), so that it reports, dumps and exits by itself; if it has not within ``grace`` seconds, it dumps and
    exits anyway. Without it, whether a rank said what it saw or was stopped first would be a race between
    torchrun's monitor and the rank's own error (a real job just exits)."""
    if _STOPPING.is_set():
        return
    _STOPPING.set()
    timer = threading.Timer(grace, lambda: (dump_flight_recorder(out, rank), os._exit(143)))
    timer.daemon = True
    timer.start()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bug", choices=BUGS, default="none")
    parser.add_argument("--timeout", type=float, default=3.0, help="process-group timeout, seconds")
    parser.add_argument("--steps", type=int, default=STEPS, help="training steps")
    parser.add_argument("--out", default=None, help="folder for the Flight Recorder dumps")
    args = parser.parse_args(argv)
    if args.bug == "shape" and int(os.environ.get("WORLD_SIZE", "1")) < 2:
        parser.error("--bug shape needs at least 2 ranks")
    # torch 2.13's Flight Recorder dump looks torch._inductor up (to name the frames of compiled code): a lazy
    # import of inductor, dynamo and sympy, seconds a rank. This job compiles nothing: None skips that import
    torch._inductor = None
    # A generous timeout while the ranks start (a busy machine may start one of them seconds late), then the
    # short one for the collectives: a planted hang ends in --timeout seconds
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=max(60.0, args.timeout)))
    dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=args.timeout))
    rank = dist.get_rank()
    if args.out is not None:                                      # who is who, for py-spy
        with open(os.path.join(args.out, f"pid_{rank}"), "w") as f:
            f.write(str(os.getpid()))
    # torchrun stops the other ranks with SIGTERM when one fails: report what this rank saw first, then leave
    signal.signal(signal.SIGTERM, lambda *_: on_sigterm(args.out, rank, args.timeout + 2.0))
    try:
        model = train(args.bug, args.steps)
    except Exception as exc:     # a failed collective: say it in one line, dump, and fail
        message = " ".join(str(exc).split())
        say(f"rank {rank}: {type(exc).__name__}: {message}")
        dump_flight_recorder(args.out, rank)
        linger(args.out, rank, 2 * args.timeout)
        os._exit(143 if _STOPPING.is_set() else 1)   # not destroy_process_group: the peers are gone or stuck
    dump_flight_recorder(args.out, rank)
    if args.out is not None:                                      # for the lesson: time, and the replicas' state
        _write(args.out, f"said_{rank}", json.dumps(_SAID).encode())
        buffer = io.BytesIO()
        torch.save(torch.cat([p.detach().flatten() for p in model.parameters()]), buffer)
        _write(args.out, f"params_{rank}", buffer.getvalue())
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)   # not the interpreter's teardown of torch: about a CPU-second a rank, after the job is done
