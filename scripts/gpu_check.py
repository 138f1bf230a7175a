"""The course on this machine's GPUs: one prepared check, for a machine with one or more CUDA devices.

    make test-gpu                                  # the same as the next line, with the course's .venv
    python scripts/gpu_check.py                    # every check; a few minutes on one GPU
    python scripts/gpu_check.py --quick            # without running the lessons' cells
    python scripts/gpu_check.py --lessons 02 11    # only these lessons' cells (and every other check)

CI runs on the CPU with gloo; this is what runs where a GPU is at hand. It starts ranks with the course's
own engine (``course_utils.Cluster``, what ``%%ddp`` uses) and checks, then prints one table of what ran
and what passed:

- the engine on NCCL at world size 1 (``device`` is ``cuda:0``, a collective runs, an error in a cell is
  reported and the cluster goes on, a rank stuck waiting on the GPU is released or replaced);
- two ranks on one GPU: the engine refuses NCCL (NCCL cannot put two ranks on one device) and gloo serves
  CUDA tensors instead, for each collective it supports (all_reduce and broadcast must work; the others
  are reported as gloo answers them); with 2+ GPUs, NCCL at world size 2 as well;
- MicroDDP (course_utils/micro_ddp.py) on CUDA against torch DDP; MicroFSDP (course_utils/fsdp.py) on CUDA
  against the unsharded model, when that module exists ("not available" otherwise);
- DDP's built-in ``bf16_compress_hook`` on NCCL (it registers on a CUDA build; the gradients match fp32 to
  bf16's precision);
- lesson 17's tools on NCCL: a Flight Recorder dump of three NCCL all-reduces and a profiler trace with
  ``ProfilerActivity.CUDA`` that shows NCCL's kernels;
- lesson 16's ``scripts/finetune.py`` under torchrun on NCCL (DDP and FSDP2 over LoRA, the tiny Llama);
- ``will_it_fit``'s meter (fake tensors, lesson 14) against ``torch.cuda.max_memory_allocated()`` of the same
  AdamW step of a 160M-parameter Llama shape on cuda:0, per phase: the gap that the 15% margin stands for;
- every lesson's ``%%ddp`` cells that can run on NCCL (no ``--backend gloo`` in force), in order, on NCCL at
  world size 1. A lesson stops at its first error: an error about devices (a CPU tensor on NCCL, tensors on
  two devices) fails the check; any other error (a cell written for several ranks, a name from a notebook
  cell that runs outside the ranks) is reported, not failed;
- last, that this process, which started every cluster above as a notebook does, never initialised CUDA
  (``torch.cuda.is_initialized()``): docs/gpus.md's promise, since a fork of a process with CUDA initialised breaks.

Exit code 0 when every check passed (or was skipped), 1 when one failed. Without CUDA it says so and exits 0
with every row "skipped (no CUDA)".
"""
import argparse
import contextlib
import io
import json
import os
import re
import signal
import sys
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PASSED, FAILED, NO_CUDA, NOT_AVAILABLE, INFO = "passed", "FAILED", "skipped (no CUDA)", "not available", "info"
DEVICE_ERRORS = re.compile(r"device|cuda|cpu tensor|nccl|backend type associated|Tensors must be", re.I)

# (area, name) of every row, in the order they run: what the no-CUDA path reports as skipped
PLAN = [
    ("environment", "GPUs, CUDA, NCCL, bf16"),
    ("engine", "NCCL at world size 1: device, all_reduce"),
    ("engine", "an error in a cell on NCCL: reported, cluster goes on"),
    ("engine", "a rank stuck waiting on the GPU: released or replaced"),
    ("engine", "2 ranks on 1 GPU: NCCL refused / NCCL at world size 2"),
    ("gloo + CUDA", "collectives on CUDA tensors, 2 ranks sharing one GPU"),
    ("MicroDDP", "on CUDA (gloo, 2 ranks on one GPU) == torch DDP"),
    ("MicroDDP", "on NCCL == torch DDP"),
    ("MicroFSDP", "on NCCL == the unsharded model"),
    ("DDP hooks", "bf16_compress_hook on NCCL"),
    ("DDP hooks", "bf16_compress_hook with gloo on CUDA tensors"),
    ("debugging", "a Flight Recorder dump and a profiler trace of an NCCL all-reduce (lesson 17)"),
    ("debugging", "the NCCL dump on <stem><rank>.pipe lands in $HOME/.cache/torch (lesson 17)"),
    ("fine-tuning", "finetune.py on NCCL: DDP, FSDP2 over LoRA (lesson 16)"),
    ("will it fit", "fake-tensor prediction against max_memory_allocated, one step per phase"),
    ("lessons", "%%ddp cells that can run on NCCL: NCCL, world size min(-n, GPUs)"),
    ("lessons", "the same cells at their -n, gloo, every rank's device = cuda:0"),
    ("engine", "the notebook process never initialised CUDA"),
]


# ---- running cells ------------------------------------------------------------------------------------------

class CellFailed(Exception):
    """A cell raised on the ranks; ``output`` is what they printed."""

    def __init__(self, error, output):
        self.error, self.output = error, output
        super().__init__(f"{type(error).__name__}: {first_line(error)}")


def first_line(exc):
    text = str(exc).strip()
    for line in reversed(text.splitlines()):  # the last line of a relayed traceback names the error
        if re.match(r"^\s*(\[rank \d+\]\s*)?\w+(Error|Exception|Timeout)\b", line):
            return line.strip()[:300]
    return (text.splitlines() or [""])[0][:300]


def run(cluster, source, timeout=120):
    """``cluster.run_cell(source)`` with the ranks' output captured; raises CellFailed."""
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            return cluster.run_cell(textwrap.dedent(source), timeout=timeout)
    except CheckTimeout:
        raise
    except Exception as exc:  # noqa: BLE001  (DistributedError, DistributedTimeout, CellSyntaxError)
        raise CellFailed(exc, out.getvalue()) from exc


def quiet(fn, *args, **kwargs):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        return fn(*args, **kwargs)


# ---- the checks ---------------------------------------------------------------------------------------------
# Each check gets the context (gpu count, clusters) and returns (status, detail) or a list of rows; an exception
# is a failure, reported with its first line.

class Context:
    def __init__(self, gpus, lessons=None, quick=False):
        self.gpus, self.lessons, self.quick = gpus, lessons, quick
        self._clusters = {}

    def cluster(self, world_size, backend, timeout=120):
        from course_utils import Cluster

        key = (world_size, backend)
        c = self._clusters.get(key)
        if c is None or not c.alive:
            c = self._clusters[key] = quiet(Cluster, world_size=world_size, backend=backend, timeout=timeout)
        return c

    def close(self):
        for c in self._clusters.values():
            with contextlib.suppress(Exception):
                quiet(c.shutdown)
        self._clusters.clear()


def check_environment(ctx):
    info = run(ctx.cluster(1, "nccl"), """
        import torch, torch.distributed as dist
        props = torch.cuda.get_device_properties(device)
        {"gpus": torch.cuda.device_count(), "name": props.name, "cc": f"{props.major}.{props.minor}",
         "memory_gib": round(props.total_memory / 2**30), "cuda": torch.version.cuda, "torch": torch.__version__,
         "nccl": ".".join(map(str, torch.cuda.nccl.version())), "bf16": torch.cuda.is_bf16_supported()}
    """)[0]
    bf16 = "bf16 in hardware" if info["bf16"] and float(info["cc"]) >= 8.0 else \
        "no bf16 in hardware (compute capability < 8.0): bf16 runs emulated, slowly"
    return INFO, (f"{info['gpus']} x {info['name']} (cc {info['cc']}, {info['memory_gib']} GiB); "
                  f"torch {info['torch']}, CUDA {info['cuda']}, NCCL {info['nccl']}; {bf16}")


def check_nccl_world_1(ctx):
    got = run(ctx.cluster(1, "nccl"), """
        import torch, torch.distributed as dist
        t = torch.ones(3, device=device) * (rank + 2)
        dist.all_reduce(t)
        (dist.get_backend(), str(device), t.device.type, t.tolist())
    """)[0]
    assert got == ("nccl", "cuda:0", "cuda", [2.0, 2.0, 2.0]), got
    return PASSED, "backend nccl, device cuda:0, all_reduce of a CUDA tensor"


def check_error_on_nccl(ctx):
    from course_utils import DistributedError

    c = ctx.cluster(1, "nccl")
    run(c, "kept = torch.arange(3, device=device)")
    try:
        run(c, "bad = torch.ones(2, device=device) + torch.ones(3, device=device)")
    except CellFailed as exc:
        assert isinstance(exc.error, DistributedError), f"expected DistributedError, got {exc}"
        shown = str(exc.error)
    else:
        raise AssertionError("a cell that raises on an NCCL rank did not raise DistributedError")
    assert "size of tensor a (2) must match" in shown, f"the report does not show the rank's error: {shown[-400:]}"
    after = run(c, "kept.sum().item()")[0]
    assert after == 3, after
    return PASSED, "DistributedError names the rank's RuntimeError; the next cell ran with its names kept"


def check_stuck_on_gpu(ctx):
    from course_utils import DistributedTimeout

    c = ctx.cluster(1, "nccl")
    run(c, "marker = 41")
    t0 = time.monotonic()
    try:  # about 20 s of GPU spin at 2 GHz, then the host waits for it: not interruptible by SIGINT
        run(c, "torch.cuda._sleep(40_000_000_000)\ntorch.cuda.synchronize()", timeout=3)
    except CellFailed as exc:
        assert isinstance(exc.error, DistributedTimeout), f"expected DistributedTimeout, got {exc}"
    else:
        raise AssertionError("a cell waiting 20 s on the GPU finished within its 3 s timeout")
    raised = time.monotonic() - t0
    t1 = time.monotonic()
    kept = run(c, "'marker' in globals()", timeout=120)[0]
    recovered = time.monotonic() - t1
    names = "names kept (the rank was released)" if kept else "names lost (the ranks were replaced)"
    return PASSED, f"DistributedTimeout after {raised:.1f} s; next cell ran {recovered:.1f} s later; {names}"


def check_two_ranks(ctx):
    from course_utils import Cluster

    if ctx.gpus < 2:
        try:
            quiet(Cluster, world_size=2, backend="nccl")
        except ValueError as exc:
            assert "one GPU per rank" in str(exc), exc
            return PASSED, f"refused: {str(exc).splitlines()[0][:120]}"
        raise AssertionError("Cluster(world_size=2, backend='nccl') started on one GPU")
    got = run(ctx.cluster(2, "nccl"), """
        import torch, torch.distributed as dist
        x = torch.arange(4., device=device) + 10 * rank
        s = x.clone(); dist.all_reduce(s)
        g = [torch.empty_like(x) for _ in range(world_size)]; dist.all_gather(g, x)
        out = torch.empty(2, device=device); dist.reduce_scatter_tensor(out, x)
        b = x.clone(); dist.broadcast(b, src=0)
        buf = torch.empty_like(x)
        ops = [dist.P2POp(dist.isend, x, (rank + 1) % world_size), dist.P2POp(dist.irecv, buf, (rank - 1) % world_size)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        (s.tolist(), torch.cat(g).tolist(), out.tolist(), b.tolist(), buf.tolist(), str(device))
    """)
    for r, (s, g, out, b, buf, dev) in enumerate(got):
        assert s == [10.0, 12.0, 14.0, 16.0] and dev == f"cuda:{r}", (r, s, dev)
        assert g == [0.0, 1.0, 2.0, 3.0, 10.0, 11.0, 12.0, 13.0] and b == [0.0, 1.0, 2.0, 3.0], (g, b)
        assert out == [10.0, 12.0] if r == 0 else out == [14.0, 16.0], out
        assert buf == [10.0 * ((r - 1) % 2) + i for i in range(4)], buf
    return PASSED, "NCCL at world size 2: all_reduce, all_gather, reduce_scatter_tensor, broadcast, send/recv"


GLOO_CUDA_COLLECTIVES = """
import torch, torch.distributed as dist
dev = torch.device("cuda", local_rank % torch.cuda.device_count())   # both ranks may share cuda:0
results = {}

def attempt(name, fn, want):
    try:
        got = fn()
        results[name] = "ok" if got == want else f"wrong result {got} (expected {want})"
    except Exception as exc:  # noqa: BLE001
        results[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:100]}"

def all_reduce():
    t = torch.ones(2, device=dev) * (rank + 1); dist.all_reduce(t); return (t.device.type, t.tolist())

def broadcast():
    t = torch.full((2,), float(rank), device=dev); dist.broadcast(t, src=1); return (t.device.type, t.tolist())

def all_gather():
    t = torch.full((1,), float(rank), device=dev); out = [torch.empty_like(t) for _ in range(world_size)]
    dist.all_gather(out, t); return [o.item() for o in out]

def reduce_scatter():
    t = torch.arange(2., device=dev); out = torch.empty(1, device=dev)
    dist.reduce_scatter_tensor(out, t); return out.item()

def reduce():
    t = torch.ones(1, device=dev); dist.reduce(t, dst=0); return t.item() if rank == 0 else 1.0

attempt("all_reduce", all_reduce, ("cuda", [3.0, 3.0]))
attempt("broadcast", broadcast, ("cuda", [1.0, 1.0]))
for name, fn, want in [("all_gather", all_gather, [0.0, 1.0]),
                       ("reduce_scatter_tensor", reduce_scatter, float(rank) * 2),
                       ("reduce", reduce, 2.0 if rank == 0 else 1.0)]:  # not send/recv: one side could hang
    dist.barrier()
    attempt(name, fn, want)
results
"""


def check_gloo_cuda(ctx):
    got = run(ctx.cluster(2, "gloo"), GLOO_CUDA_COLLECTIVES)
    rows, failed = [], False
    for name in got[0]:
        per_rank = {r[name] for r in got}
        ok = per_rank == {"ok"}
        required = name in ("all_reduce", "broadcast")
        failed |= required and not ok
        rows.append((name, "ok" if ok else "; ".join(sorted(per_rank))))
    detail = ", ".join(f"{n} {'ok' if v == 'ok' else '(' + v + ')'}" for n, v in rows)
    return (FAILED if failed else PASSED), detail


MICRO_DDP_VS_DDP = """
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from course_utils.micro_ddp import MicroDDP
from course_utils.models import make_model
dev = torch.device("cuda", local_rank % torch.cuda.device_count())
torch.manual_seed(100 + rank)
xs, ys = torch.randn(3, 16, 16, device=dev), torch.randn(3, 16, 1, device=dev)
models = [DDP(make_model(seed=0, d_hidden=64).to(dev)),
          MicroDDP(make_model(seed=0, d_hidden=64).to(dev), bucket_cap_mb=0.0002)]   # 210 bytes: 3 buckets
opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in models]
losses = [[], []]
for x, y in zip(xs, ys):
    for i, (m, o) in enumerate(zip(models, opts)):
        o.zero_grad()
        loss = torch.nn.functional.mse_loss(m(x), y)
        loss.backward()
        o.step()
        losses[i].append(loss.item())
for p, q in zip(models[0].parameters(), models[1].parameters()):
    assert p.device.type == "cuda" and q.device.type == "cuda", f"parameters on {p.device} and {q.device}"
    torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg="MicroDDP's weights differ from DDP's")
torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
(dist.get_backend(), str(next(models[1].parameters()).device), len(models[1].buckets))
"""


def check_micro_ddp_gloo_cuda(ctx):
    got = run(ctx.cluster(2, "gloo"), MICRO_DDP_VS_DDP)
    return PASSED, f"3 SGD steps equal to torch DDP on {got[0][1]} and {got[1][1]} ({got[0][2]} buckets), gloo"


def check_micro_ddp_nccl(ctx):
    ws = 2 if ctx.gpus >= 2 else 1
    got = run(ctx.cluster(ws, "nccl"), MICRO_DDP_VS_DDP)
    return PASSED, f"world size {ws}: 3 SGD steps equal to torch DDP ({got[0][2]} buckets, async all-reduce on NCCL)"


MICRO_FSDP_VS_PLAIN = """
import torch, torch.distributed as dist
from course_utils.fsdp import MicroFSDP
from course_utils.gpt import make_gpt
vocab, steps = 32, 3
g = torch.Generator().manual_seed(0)
batches = [torch.randint(0, vocab, (world_size * 2, 9), generator=g).to(device) for _ in range(steps)]
plain = make_gpt(vocab, seed=0, n_layer=2, n_embd=32).to(device)
sharded = MicroFSDP(make_gpt(vocab, seed=0, n_layer=2, n_embd=32).to(device))
opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (plain, sharded)]   # not Adam: it blows up rounding
# noise in gradients that are zero in exact arithmetic (the key bias), and the weights would differ by ~lr
losses = [[], []]
loss_fn = lambda m, b: torch.nn.functional.cross_entropy(m(b[:, :-1]).flatten(0, 1).float(), b[:, 1:].flatten())
for b in batches:
    mine = b[rank * 2:(rank + 1) * 2]
    for i, (m, o) in enumerate(zip((plain, sharded), opts)):
        o.zero_grad()
        if i == 0:
            loss = loss_fn(m, b)                        # the whole global batch on one model
        else:
            loss = loss_fn(m, mine)                     # this rank's share, gradients averaged over the ranks
        loss.backward()
        o.step()
        logged = loss.detach().clone()
        if i == 1:
            dist.all_reduce(logged)
            logged /= world_size
        losses[i].append(logged.item())
full = sharded.full_state_dict()
plain_params = dict(plain.named_parameters())
assert set(full) == set(plain_params), sorted(set(full) ^ set(plain_params))
for name, p in plain_params.items():
    torch.testing.assert_close(full[name].to(p.dtype), p.detach(), rtol=2e-4, atol=2e-5, msg=f"{name} differs")
torch.testing.assert_close(losses[1], losses[0], rtol=2e-4, atol=2e-5)
(str(next(sharded.parameters()).device), len(sharded.units))
"""


def check_micro_fsdp(ctx):
    try:
        quiet(__import__, "course_utils.fsdp")
    except ImportError as exc:
        return NOT_AVAILABLE, f"course_utils.fsdp does not import here ({exc})"
    ws = 2 if ctx.gpus >= 2 else 1
    got = run(ctx.cluster(ws, "nccl"), MICRO_FSDP_VS_PLAIN)
    return PASSED, f"world size {ws}: 3 SGD steps of a 2-block GPT equal to the unsharded model ({got[0][1]} units)"


BF16_HOOK = """
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook, bf16_compress_hook
from course_utils.models import make_model
dev = torch.device("cuda", local_rank % torch.cuda.device_count())
torch.manual_seed(7 + rank)
x, y = torch.randn(32, 16, device=dev), torch.randn(32, 1, device=dev)
exact, compressed = DDP(make_model(seed=0).to(dev)), DDP(make_model(seed=0).to(dev))
exact.register_comm_hook(None, allreduce_hook)
try:
    compressed.register_comm_hook(None, bf16_compress_hook)
    registered = "registered"
except TypeError as exc:
    registered = f"refused: {exc}"
if registered == "registered":
    for m in (exact, compressed):
        torch.nn.functional.mse_loss(m(x), y).backward()
    for p, q in zip(exact.parameters(), compressed.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=2e-2, atol=1e-3)   # bf16 keeps about 3 significant digits
(dist.get_backend(), registered)
"""


def check_bf16_nccl(ctx):
    got = run(ctx.cluster(1, "nccl"), BF16_HOOK)[0]
    assert got[1] == "registered", f"on NCCL, bf16_compress_hook was {got[1]}"
    return PASSED, "registers on NCCL; gradients equal fp32 all-reduce to bf16 precision"


def check_bf16_gloo(ctx):
    try:
        got = run(ctx.cluster(2, "gloo"), BF16_HOOK)[0]
    except CellFailed as exc:
        return INFO, f"registers (a CUDA build), then gloo fails on it: {first_line(exc.error)[:160]}"
    return INFO, f"{got[1]} with gloo on CUDA tensors; gradients equal fp32 to bf16 precision" \
        if got[1] == "registered" else f"gloo: {got[1]}"


# ---- lesson 17's tools on NCCL -------------------------------------------------------------------------------

# One fresh process (the Flight Recorder reads its buffer size when the process group is made): world size 1,
# an all-reduce under torch.profiler, then the Flight Recorder's dump and the trace's events. argv: the backend
# ("nccl" on a GPU; tests/test_debugging.py runs it with "gloo" on the CPU) and an output folder.
FR_TRACE_SCRIPT = r"""
import json, os, pickle, sys
import torch, torch.distributed as dist
from torch.profiler import ProfilerActivity, profile
backend, out = sys.argv[1], sys.argv[2]
device = torch.device("cuda:0" if backend == "nccl" else "cpu")
dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
x = torch.ones(1 << 20, device=device)
activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
with profile(activities=activities) as prof:
    for _ in range(3):
        dist.all_reduce(x)
    if device.type == "cuda":
        torch.cuda.synchronize()
prof.export_chrome_trace(os.path.join(out, "trace.json"))
c10d = torch._C._distributed_c10d
dump = getattr(c10d, "_dump_nccl_trace", None) if backend == "nccl" else None
raw = dump() if dump is not None else c10d._dump_fr_trace()
with open(os.path.join(out, "fr_0"), "wb") as f:
    f.write(raw)
entries = pickle.loads(raw)["entries"]
events = json.load(open(os.path.join(out, "trace.json")))["traceEvents"]
kernels = sorted({e["name"] for e in events if e.get("cat") == "kernel" and "nccl" in e.get("name", "").lower()})
print(json.dumps({"ops": [e["profiling_name"] for e in entries], "states": [e["state"] for e in entries],
                  "completed": sum(e.get("time_discovered_completed_ns") is not None for e in entries),
                  "kernels": kernels, "profiler_ops": sorted({e["name"] for e in events
                                                               if "all_reduce" in e.get("name", "")})}))
dist.destroy_process_group()
"""


def fr_and_trace(backend, out):
    """Run FR_TRACE_SCRIPT on ``backend`` in a fresh process with the Flight Recorder on: its JSON summary."""
    import subprocess

    env = dict(os.environ, TORCH_FR_BUFFER_SIZE="200", TORCH_NCCL_TRACE_BUFFER_SIZE="200", TORCH_NCCL_ENABLE_TIMING="1")
    result = subprocess.run([sys.executable, "-c", FR_TRACE_SCRIPT, backend, str(out)], capture_output=True,
                            text=True, env=env, timeout=180)
    if result.returncode != 0:
        raise RuntimeError(f"the {backend} Flight Recorder script failed: {result.stderr.strip()[-400:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def check_flight_recorder_and_trace(ctx):
    import tempfile

    with tempfile.TemporaryDirectory() as out:
        got = fr_and_trace("nccl", out)
    prefix = "nccl:all_reduce"
    assert got["ops"].count(prefix) == 3, f"the Flight Recorder recorded {got['ops']}, not 3 x {prefix}"
    assert got["kernels"], f"no NCCL kernel in the profiler's trace (CUDA activity on); its ops: {got['profiler_ops']}"
    return PASSED, (f"Flight Recorder: 3 x {prefix}, states {sorted(set(got['states']))}, {got['completed']} with a "
                    f"completion time; trace: {', '.join(got['kernels'])[:120]}")


# The NCCL dump lesson 17 describes: with TORCH_NCCL_DEBUG_INFO_PIPE_FILE=<stem>, writing to <stem><rank>.pipe makes
# the process group's monitor thread dump the Flight Recorder to the default file, $XDG_CACHE_HOME/torch (else
# $HOME/.cache/torch) + /comm_lib_trace_rank_<rank> (tests/test_debugging.py checks that path against 2.13's
# DebugInfoWriter::getWriter on the CPU). argv: the stem, the expected dump file.
NCCL_DUMP_SCRIPT = r"""
import os, pickle, sys, time
import torch, torch.distributed as dist
stem, expected = sys.argv[1], sys.argv[2]
dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=torch.device("cuda:0"))
x = torch.ones(1 << 20, device="cuda:0")
for _ in range(3):
    dist.all_reduce(x)
torch.cuda.synchronize()
pipe = stem + "0.pipe"
deadline = time.monotonic() + 30
while not os.path.exists(pipe) and time.monotonic() < deadline:
    time.sleep(0.1)
with open(pipe, "w") as f:                       # a FIFO the monitor thread reads: any byte asks for a dump
    f.write("1")
while not os.path.exists(expected) and time.monotonic() < deadline:
    time.sleep(0.2)
time.sleep(1)                                     # let the writer finish the file
entries = pickle.load(open(expected, "rb"))["entries"] if os.path.exists(expected) else None
print("DUMP", os.path.exists(pipe), None if entries is None else [e["profiling_name"] for e in entries])
dist.destroy_process_group()
"""


def check_nccl_dump_on_pipe(ctx):
    """Lesson 17's NCCL dump facts on a GPU: the pipe file is <stem><rank>.pipe, and the dump lands at the default
    path under $HOME/.cache/torch (XDG_CACHE_HOME unset, TORCH_NCCL_DEBUG_INFO_TEMP_FILE unset), not /tmp."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as home:
        env = {k: v for k, v in os.environ.items()
               if k not in ("XDG_CACHE_HOME", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "TORCH_FR_DUMP_TEMP_FILE")}
        stem = os.path.join(home, "pipe_")
        expected = os.path.join(home, ".cache", "torch", "comm_lib_trace_rank_0")
        env.update(HOME=home, TORCH_NCCL_DEBUG_INFO_PIPE_FILE=stem)
        result = subprocess.run([sys.executable, "-c", NCCL_DUMP_SCRIPT, stem, expected], capture_output=True,
                                text=True, env=env, timeout=120)
        out = result.stdout + result.stderr
        assert result.returncode == 0, f"exit code {result.returncode}: {out.strip()[-400:]}"
        line = next((ln for ln in result.stdout.splitlines() if ln.startswith("DUMP ")), "")
        assert line.startswith("DUMP True"), f"no {stem}0.pipe appeared: {out.strip()[-400:]}"
        assert "nccl:all_reduce" in line, (f"writing to the pipe left no Flight Recorder dump at {expected} "
                                           f"(the lesson's default path): {line or out.strip()[-400:]}")
    ops = line[len("DUMP True "):][:100]
    return PASSED, f"pipe_0.pipe -> $HOME/.cache/torch/comm_lib_trace_rank_0: {ops}"


# ---- lesson 16's script on NCCL -------------------------------------------------------------------------------

def check_finetune_script(ctx):
    """scripts/finetune.py, unchanged, under torchrun on NCCL (one rank per GPU, at most 2): DDP over the
    adapters and FSDP2 over the frozen base (bf16 compute), the tiny Llama, 6 steps each."""
    import re
    import subprocess

    ranks = min(2, ctx.gpus)
    losses, rates = {}, []
    for strategy in ("ddp", "fsdp"):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
               str(Path(__file__).resolve().parent / "finetune.py"), "--model", "tiny", "--method", "lora",
               "--strategy", strategy, "--steps", "6", "--log-every", "6"] + \
            (["--precision", "mixed"] if strategy == "fsdp" else [])
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        out = result.stdout + result.stderr
        assert result.returncode == 0, f"{strategy}: exit code {result.returncode}: {out.strip()[-400:]}"
        assert f"{ranks} ranks on cuda" in out, f"{strategy}: the script did not run on the GPUs: {out.strip()[-400:]}"
        losses[strategy] = float(re.search(r"final_loss=([0-9.]+)", out).group(1))
        rates += re.findall(r"on cuda: ([0-9,]+) tokens/s, peak memory ([0-9,]+) MiB", out)[:1]
    return PASSED, (f"{ranks} rank(s): final loss ddp {losses['ddp']:.4f}, fsdp bf16 {losses['fsdp']:.4f}; "
                    f"rank 0: {rates[0][0]} tokens/s, peak {rates[0][1]} MiB")


# A Llama-shaped model small enough for any GPU (160M parameters: 2.6 GB of fp32 AdamW state), one sequence of 1024
MEMORY_SHAPE = dict(name="gpu check", vocab_size=32000, d_model=1024, n_layer=8, d_ff=2816, n_head=16, n_kv_head=8)
MEMORY_STEP = dict(strategy="replica", seq_len=1024, micro_batch_size=1)
PHASES = ("forward", "backward", "step")


def predicted_peaks(shape=None, **kw):
    """Per phase, the peak bytes ``course_utils.true_size.measure_step`` (will_it_fit's meter) predicts for one
    AdamW step of ``shape`` with fake tensors on the CPU: the number a reader plans with."""
    from course_utils.true_size import LlamaShape, measure_step

    r = measure_step(shape or LlamaShape(**MEMORY_SHAPE), **{**MEMORY_STEP, **kw})
    return {phase: r[phase]["total"] for phase in PHASES}


def cuda_peaks():
    """The same step on cuda:0, in a process of its own: per phase, torch.cuda.max_memory_allocated() from the
    memory in use at the phase's start (reset_peak_memory_stats), after a whole first step has made AdamW's
    state, as measure_step's warm-up does. Run as ``python scripts/gpu_check.py --cuda-peaks``."""
    import torch
    import torch.nn.functional as F

    from course_utils.true_size import LlamaShape, LlamaShaped

    shape = LlamaShape(**MEMORY_SHAPE)
    torch.manual_seed(0)
    model = LlamaShaped(shape).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    idx = torch.randint(shape.vocab_size, (MEMORY_STEP["micro_batch_size"], MEMORY_STEP["seq_len"]), device="cuda")

    def forward():
        return F.cross_entropy(model(idx).flatten(0, 1).float(), idx.flatten())

    forward().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    peaks = {}
    for phase in PHASES:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        if phase == "forward":
            loss = forward()
        elif phase == "backward":
            loss.backward()
            del loss
        else:
            optimizer.step()
        torch.cuda.synchronize()
        peaks[phase] = torch.cuda.max_memory_allocated()
    return peaks


def memory_gap(predicted, measured):
    """(status, detail): passed when every phase's measured peak is within the prediction over will_it_fit's
    ``USABLE`` (the margin it keeps for what no tensor meter sees); the detail gives each phase's gap."""
    from course_utils.will_it_fit import USABLE as usable

    gaps = {p: measured[p] - predicted[p] for p in PHASES}
    worst = max(PHASES, key=lambda p: measured[p] / predicted[p])
    ok = all(measured[p] <= predicted[p] / usable for p in PHASES)
    detail = "; ".join(f"{p} predicted {predicted[p] / 2**30:.3f} GiB, measured {measured[p] / 2**30:.3f} "
                       f"({gaps[p] / 2**20:+.0f} MiB, {measured[p] / predicted[p] - 1:+.1%})" for p in PHASES)
    verdict = (f"within the {1 - usable:.0%} margin" if ok else f"{worst} over the {1 - usable:.0%} margin")
    return (PASSED if ok else FAILED), f"{verdict}: {detail}"


def check_will_it_fit(ctx):
    """will_it_fit's prediction (fake tensors, this process, no CUDA) beside the same step on cuda:0 (another
    process: this one must never initialise CUDA): the gap is the number the 15% margin stands for."""
    import subprocess

    predicted = predicted_peaks()
    result = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--cuda-peaks"], capture_output=True,
                            text=True, timeout=200)
    assert result.returncode == 0, f"exit code {result.returncode}: {(result.stdout + result.stderr).strip()[-400:]}"
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    return memory_gap(predicted, measured)


# ---- the lessons --------------------------------------------------------------------------------------------

def nccl_cells(nb):
    """(cell index, world size asked for or None, source without the magic line) of the %%ddp cells that can
    run on NCCL, in order. A cell runs on the last --backend asked for (the engine keeps it for the cells after
    it, also across a new -n), reset by %ddp shutdown; a cell without -n keeps the running size (first: 2)."""
    requested, cells = "auto", []
    for i, cell in enumerate(nb["cells"]):
        src = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
        if cell["cell_type"] != "code":
            continue
        if not src.startswith("%%ddp"):
            if re.search(r"^\s*%ddp\s+shutdown\b", src, re.M):
                requested = "auto"
            continue
        magic, _, body = src.partition("\n")
        asked = re.search(r"--backend[ =](\w+)", magic)
        if asked:
            requested = asked.group(1)
        size = re.search(r"(?:-n|--world-size)[ =](\d+)", magic)
        if requested != "gloo":
            cells.append((i, int(size.group(1)) if size else None, body))
    return cells


def _classify(exc):
    """(status, text) for a lesson cell's error: only a device error is a failure of the lesson."""
    line = first_line(exc.error)
    if re.search(r"gloo", line, re.I):
        return INFO, f"gloo does not serve this on CUDA tensors: {line}"
    if DEVICE_ERRORS.search(line):
        return FAILED, line
    return INFO, f"not a device error: {line}"


def run_lesson(path, backend, size_for, shared_gpu, deadline):
    """Run a lesson's NCCL-capable cells in order, on ``backend`` with ``size_for(asked size)`` ranks; with
    ``shared_gpu``, every rank's ``device`` is set to one GPU (gloo, CUDA tensors). One row's (status, detail)."""
    from course_utils import Cluster

    cells = nccl_cells(json.loads(path.read_text(encoding="utf-8")))
    if not cells:
        return PASSED, "every %%ddp cell runs on gloo (--backend gloo): nothing to run on the GPU"
    ran, status, detail, c, size = 0, PASSED, "", None, None
    cwd = os.getcwd()
    os.chdir(path.parent)  # cells open files relative to the notebook, as in JupyterLab
    try:
        for i, asked, body in cells:
            if time.monotonic() > deadline:
                status, detail = INFO, f"stopped before cell {i}: the time budget for the lessons is spent"
                break
            want = size_for(asked or size or 2)
            try:
                if c is None or want != size:  # a new -n starts fresh ranks, as %%ddp does
                    if c is not None:
                        quiet(c.shutdown)
                    c, size = quiet(Cluster, world_size=want, backend=backend, timeout=60), want
                    if shared_gpu:
                        run(c, "import torch\ndevice = torch.device('cuda', 0)  # every rank on the same GPU")
                run(c, body, timeout=60)
                ran += 1
            except CellFailed as exc:
                status, detail = _classify(exc)
                detail = f"cell {i}: {detail}"
                if os.environ.get("GPU_CHECK_VERBOSE"):
                    print(f"{path.name} cell {i}:\n{exc.error}\n{exc.output[-3000:]}", file=sys.stderr)
                break
    finally:
        os.chdir(cwd)
        if c is not None:
            with contextlib.suppress(Exception):
                quiet(c.shutdown)
    return status, f"{ran} of {len(cells)} cells ran" + (f"; {detail}" if detail else "")


def _lesson_rows(ctx, title, backend, size_for, shared_gpu, budget_s):
    rows, deadline = [], time.monotonic() + budget_s
    for path in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        if ctx.lessons and path.name[:2] not in ctx.lessons:
            continue
        t0 = time.monotonic()
        if t0 > deadline:
            rows.append(("lessons", f"{path.name[:2]} {title}", INFO, f"not run: the {budget_s} s budget is spent"))
            continue
        try:
            status, detail = run_lesson(path, backend, size_for, shared_gpu, deadline)
        except Exception as exc:  # noqa: BLE001  (the engine could not start the ranks, say)
            status, detail = FAILED, f"{type(exc).__name__}: {first_line(exc)}"
        rows.append(("lessons", f"{path.name[:2]} {title}", status, detail, time.monotonic() - t0))
    return rows


def check_lessons_nccl(ctx, budget_s=100):
    """Each lesson's NCCL-capable cells on NCCL, at world size min(asked, GPUs): 1 on a one-GPU machine."""
    return _lesson_rows(ctx, "on NCCL", "nccl", lambda n: min(n, ctx.gpus), False, budget_s)


def check_lessons_gloo_cuda(ctx, budget_s=100):
    """Each lesson's NCCL-capable cells at their own world size, gloo, every rank's tensors on cuda:0."""
    return _lesson_rows(ctx, "gloo+CUDA", "gloo", lambda n: n, True, budget_s)


# ---- the notebook process ------------------------------------------------------------------------------------

def cuda_in_this_process(modules=None):
    """(status, detail): FAILED if this process (``modules``: its ``sys.modules``) has initialised CUDA. It plays
    the notebook: it counts GPUs through NVML and starts every cluster, and the ranks alone may touch CUDA."""
    torch = (sys.modules if modules is None else modules).get("torch")
    if torch is None:
        return PASSED, "torch is not imported in this process"
    if torch.cuda.is_initialized():
        return FAILED, ("this process initialised CUDA (torch.cuda.is_initialized()): a notebook that starts "
                        "clusters must not, a fork of it after that breaks")
    return PASSED, "torch.cuda.is_initialized() is False after every check"


def check_notebook_process_cuda(ctx):
    """Last: nothing above initialised CUDA in this process, the notebook's part."""
    return cuda_in_this_process()


CHECKS = [check_environment, check_nccl_world_1, check_error_on_nccl, check_stuck_on_gpu, check_two_ranks,
          check_gloo_cuda, check_micro_ddp_gloo_cuda, check_micro_ddp_nccl, check_micro_fsdp, check_bf16_nccl,
          check_bf16_gloo, check_flight_recorder_and_trace, check_nccl_dump_on_pipe, check_finetune_script,
          check_will_it_fit,
          check_lessons_nccl, check_lessons_gloo_cuda, check_notebook_process_cuda]


# ---- the table ----------------------------------------------------------------------------------------------

class CheckTimeout(Exception):
    pass


def _over_time(signum, frame):
    raise CheckTimeout(f"the check ran over {CHECK_LIMIT_S} s (a hang the engine did not end?)")


CHECK_LIMIT_S = 240  # per check: a hang in the engine or the GPU must not hold the machine


def run_checks(ctx, checks=CHECKS, plan=PLAN):
    """Rows (area, check, status, detail, seconds): one per check, or the rows a check returns."""
    rows = []
    alarm = hasattr(signal, "SIGALRM")
    if alarm:
        previous = signal.signal(signal.SIGALRM, _over_time)
    for (area, name), check in zip(plan, checks):
        if check in (check_lessons_nccl, check_lessons_gloo_cuda) and ctx.quick:
            rows.append((area, name, INFO, "not run (--quick)", 0.0))
            continue
        t0 = time.monotonic()
        if alarm:
            signal.alarm(CHECK_LIMIT_S)
        try:
            result = check(ctx)
        except CellFailed as exc:
            result = FAILED, f"{exc}" + (f" | rank output: {exc.output.strip()[-300:]}" if exc.output.strip() else "")
        except Exception as exc:  # noqa: BLE001  (a failing check is a row, not the end of the run)
            result = FAILED, f"{type(exc).__name__}: {first_line(exc)}"
            if isinstance(exc, CheckTimeout):
                ctx.close()  # its ranks may be stuck: the next check starts fresh ones
        finally:
            if alarm:
                signal.alarm(0)
        seconds = time.monotonic() - t0
        if isinstance(result, list):
            rows += [r if len(r) == 5 else (*r, seconds / max(1, len(result))) for r in result]
        else:
            rows.append((area, name, result[0], result[1], seconds))
    if alarm:
        signal.signal(signal.SIGALRM, previous)
    return rows


def skipped_rows(plan=PLAN):
    return [(area, name, NO_CUDA, "", 0.0) for area, name in plan]


def format_table(rows, width=150):
    """The rows as a fixed-width text table; long details wrap under their row."""
    heads = ("area", "check", "status", "time", "detail")
    cols = [[r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows], [f"{r[4]:.1f} s" for r in rows]]
    w = [max(len(h), *(len(v) for v in col)) if col else len(h) for h, col in zip(heads, cols)]
    left = sum(w) + 2 * len(w)
    detail_w = max(30, width - left)
    lines = ["  ".join(h.ljust(n) for h, n in zip(heads[:4], w)) + "  detail", "-" * min(width, left + detail_w)]
    for r, t in zip(rows, cols[3]):
        wrapped = textwrap.wrap(r[3], detail_w) or [""]
        lines.append("  ".join(v.ljust(n) for v, n in zip((r[0], r[1], r[2], t), w)) + "  " + wrapped[0])
        lines += [" " * left + more for more in wrapped[1:]]
    return "\n".join(lines)


def exit_code(rows):
    return 1 if any(r[2] == FAILED for r in rows) else 0


def summary(rows):
    counts = {}
    for r in rows:
        counts[r[2]] = counts.get(r[2], 0) + 1
    return ", ".join(f"{n} {s}" for s, n in counts.items())


def main(argv=None):
    parser = argparse.ArgumentParser(description="The course on this machine's GPUs (make test-gpu).")
    parser.add_argument("--quick", action="store_true", help="skip running the lessons' cells")
    parser.add_argument("--lessons", nargs="*", default=None, help="two-digit lesson numbers to run (default: all)")
    parser.add_argument("--cuda-peaks", action="store_true", help=argparse.SUPPRESS)  # check_will_it_fit's child
    args = parser.parse_args(argv)
    if args.cuda_peaks:
        print(json.dumps(cuda_peaks()))
        return 0
    from course_utils.engine.launcher import _gpu_count  # NVML: this process never initialises CUDA

    gpus = _gpu_count()
    if gpus == 0:
        import torch

        why = "torch is a CPU-only build" if not torch.version.cuda else "no CUDA device is visible"
        rows = skipped_rows()
        print(f"No CUDA here ({why}): nothing to check on a GPU. The CPU path (gloo) is what CI tests: make test.")
        print(format_table(rows))
        print(f"gpu_check: {summary(rows)}")
        return 0
    print(f"gpu_check: {gpus} GPU(s) visible; starting ranks with the course's engine ...", flush=True)
    ctx = Context(gpus, lessons=set(args.lessons) if args.lessons else None, quick=args.quick)
    try:
        rows = run_checks(ctx)
    finally:
        ctx.close()
    print(format_table(rows))
    code = exit_code(rows)
    print(f"gpu_check: {summary(rows)}; {'FAILED' if code else 'passed'}")
    return code


if __name__ == "__main__":
    sys.exit(main())
