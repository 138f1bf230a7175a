"""Plumbing for 17_debugging_and_profiling: run a planted-bug job under torchrun and read what a cluster's tools
leave behind, then read a profiler trace.

* ``run_job``: ``torchrun -m course_utils.planted_bugs`` with a short process-group timeout; a ``Job`` with each
  rank's last words, torchrun's failure summary, the Flight Recorder dumps and (``spy=True``) py-spy's stacks.
* ``fix_gloo_dumps``, ``analyze``: torch's Flight Recorder analyzer (``fr_trace``) on a folder of dumps.
* ``read_dump``, ``dump_table``: one rank's recorded collectives, as a table.
* ``pyspy_dump``: the Python stack of a running process, by ``py-spy dump``.
* ``trace_events``, ``step_intervals``, ``plot_trace``: a ``torch.profiler`` Chrome trace, per thread.

Introduced in 17_debugging_and_profiling.
"""
import os
import pickle
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_TORCH_DIR = None


def _torch_dir():
    global _TORCH_DIR
    if _TORCH_DIR is None:
        import torch
        _TORCH_DIR = str(Path(torch.__file__).resolve().parent.parent)
    return _TORCH_DIR


# -- what a rank and torchrun print, made comparable between runs ------------------------------------------------

_CPP_WHERE = re.compile(r"\[(?:enforce fail at )?/[^\]]*\.(?:cc|cpp|h):\d+\] ?")
_PEER = re.compile(r"\[(127\.0\.0\.1|::1|localhost)\]:\d+")
_FINGERPRINT_TAIL = re.compile(r", TensorDeviceTypes=TensorOptions\(.*?memory_format=\(\w+\)\)\)")
_OWN_FINGERPRINT = re.compile(r"is running collective: CollectiveFingerPrint\(SequenceNumber=(\d+),? ?OpType=(\w+)"
                              r"(?:, TensorShape=(\[[\d, ]*\]), TensorDtypes=(\w+))?")
_SIGNALS = {-int(s): s.name for s in (signal.SIGABRT, signal.SIGKILL, signal.SIGTERM, signal.SIGSEGV)}


def clean(line):
    """A line a rank printed, without what differs between two runs of the same job: the C++ file and line torch
    was built from, the peer's port, and the device options DETAIL prints for every tensor."""
    line = _CPP_WHERE.sub("", line)
    line = _PEER.sub(r"[\1]:<port>", line)
    return _FINGERPRINT_TAIL.sub(")", line)


def _failures(output):
    """torchrun's failure summary as ``[(rank, exitcode), ...]``, the root cause first."""
    blocks = re.split(r"^(Failures:|Root Cause \(first observed failure\):)\s*$", output, flags=re.M)
    found = {}
    for head, body in zip(blocks[1::2], blocks[2::2]):
        for rank, code in re.findall(r"rank\s*:\s*(\d+).*?\n\s*exitcode\s*:\s*(-?\d+)", body):
            found.setdefault(head, []).append((int(rank), int(code)))
    root = found.get("Root Cause (first observed failure):", [])
    return root + [f for f in found.get("Failures:", []) if f not in root]


@dataclass
class Job:
    """What one torchrun of the planted-bug job left behind. ``lines``: what the ranks printed (cleaned, grouped
    by rank); ``failures``: torchrun's summary, ``[(rank, exitcode), ...]``, the root cause first; ``out``: the
    folder the job wrote its Flight Recorder dumps to when the caller gave one (``None`` when ``run_job`` made a
    temporary folder, removed when the job ended); ``flight_recorder``: the dumps, ``{rank: bytes}``; ``stacks``:
    ``{rank: [frames]}`` from py-spy, taken while the job hung (``spy=True``), or ``None``; ``spy_note``: why there
    are none."""
    bug: str
    returncode: int
    lines: list
    failures: list
    out: Path
    seconds: float
    output: str = ""
    flight_recorder: dict = field(default_factory=dict)
    stacks: dict = None
    spy_note: str = ""
    debug: str = "OFF"
    extra: dict = field(default_factory=dict)

    def dumps(self):
        """The Flight Recorder dumps the ranks wrote, ``{rank: the pickle's bytes}`` (``read_dump`` opens one;
        ``analyze``, ``dump_table`` and ``odd_one_out`` take the ``Job`` itself)."""
        return dict(sorted(self.flight_recorder.items()))

    def replicas_agree(self):
        """Whether every rank that finished ended with the same parameters (DDP's promise), or ``None`` when
        fewer than two finished."""
        params = list(self.extra.get("params", {}).values())
        if len(params) < 2:
            return None
        return all(p.dtype == params[0].dtype and p.shape == params[0].shape and bool((p == params[0]).all())
                   for p in params[1:])

    def step_seconds(self):
        """``{rank: [seconds, ...]}``: how long each step after the first took on each rank that finished (from
        one "step N done" line to the next; the first step also pays for one-time work, such as autograd's first
        backward and gloo's first use of each connection)."""
        steps = {}
        for rank, said in sorted(self.extra.get("said", {}).items()):
            ends = [t for t, line in said if re.fullmatch(rf"rank {rank}: step \d+ done", line)]
            steps[rank] = [b - a for a, b in zip(ends, ends[1:])]
        return steps

    def last_words(self, rank):
        """The last line rank ``rank`` printed (its error, if it caught one)."""
        mine = [line for line in self.lines if line.startswith(f"rank {rank}:")]
        return mine[-1] if mine else None

    def died(self):
        """The ranks that a signal killed, ``[(rank, "SIGKILL"), ...]``, in the order of torchrun's summary:
        a rank's own death (SIGKILL, a C++ abort's SIGABRT, ...), not torchrun's SIGTERM, which stops the others
        once one has failed (the planted job answers it with exit code 143 after reporting). Which failure
        torchrun observed first depends on the machine's timing; which ranks were killed does not."""
        return [(rank, _SIGNALS.get(code, f"signal {-code}")) for rank, code in self.failures
                if code < 0 and code != -signal.SIGTERM]

    def exit_summary(self):
        """torchrun's verdict in one line: which rank a signal killed, or that the ranks failed on their own."""
        if self.returncode == 0:
            return "torchrun: every rank finished (exit code 0)"
        if not self.failures:
            return f"torchrun: exit code {self.returncode}, no failure summary"
        if self.died():
            # not "the root cause": torchrun names the failure it observed first, and a rank that lost its peer
            # may fail in the same instant as the one that died
            rank, how = self.died()[0]
            return f"torchrun: rank {rank} died of {how}; torchrun then stopped the other ranks"
        # errors of the ranks' own (a timed-out collective): the others fail alike, or torchrun stops them first
        # (SIGTERM); which of the two depends on the machine's timing, so neither is named
        return (f"torchrun: exit code {self.failures[0][1]}, the ranks' own errors (the 'root cause' it names is "
                "whichever exited first)")

    def detail_summary(self):
        """What TORCH_DISTRIBUTED_DEBUG=DETAIL made each rank say: the collective it was calling itself (the first
        fingerprint of its mismatch message), or its last line."""
        shown = []
        for r in range(len({int(m) for m in re.findall(r"^rank (\d+):", "\n".join(self.lines), re.M)})):
            words = self.last_words(r) or ""
            m = _OWN_FINGERPRINT.search(words)
            if "Detected mismatch between collectives" in words and m:
                seq, op, shape, dtype = m.groups()
                tensor = f", tensor {shape} {dtype}" if shape is not None else ""
                shown.append(f"rank {r}: DETAIL: mismatch; this rank runs {op} #{seq}{tensor}")
            elif kind := barrier_error(words):
                shown.append(f"rank {r}: DETAIL: {kind}")
            else:
                shown.append(words)
        return "\n".join(shown)

    def report(self, ranks=None):
        """What the plain job says: each rank's last line, any C++ abort, and torchrun's verdict. gloo's two
        words for a broken collective are put in one class each (see ``gloo_error``): which rank times out
        first, and so which one reads "Connection closed by peer", is a race between their timers."""
        ranks = sorted({int(m) for m in re.findall(r"^rank (\d+):", "\n".join(self.lines), re.M)}
                       if ranks is None else ranks)
        shown = []
        for r in ranks:
            words = self.last_words(r)
            kind = gloo_error(words)
            shown.append(f"rank {r}: RuntimeError: {kind}" if kind else words)
        shown += [line for line in self.lines if not line.startswith("rank ")]
        return "\n".join([line for line in shown if line] + [self.exit_summary()])


_TIMED_OUT = re.compile(r"Timed out waiting (\d+)ms for (send|recv) operation to complete")
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer")


def gloo_error(line):
    """The class of a gloo error in a rank's last line, or ``None``: "timed out" (this rank's own timer fired),
    "lost its peer" (the connection closed under it: a peer crashed, was killed, or timed out first)."""
    if line is None:
        return None
    if _TIMED_OUT.search(line) or any(p in line for p in _PEER_GONE):
        return ("a collective failed: it timed out, or the peer that timed out first (or died) closed the "
                "connection")
    return None


_BARRIER_FAILED = re.compile(r"Ranks? [\d, ]+ failed to pass monitoredBarrier"
                             r"|Monitored Barrier encountered error running collective")


def barrier_error(line):
    """The class of a failure of DETAIL's monitored barrier in a rank's last line, or ``None``. Before every
    collective, DETAIL's wrapper runs a monitored barrier in which rank 0 receives from every other rank. When a
    rank has died, rank 0 says one of two things, by the machine's timing: if it was already waiting for that rank,
    the barrier names it ("Ranks 1 failed to pass monitoredBarrier in 60000 ms"); if the rank was gone before rank 0
    got there, rank 0's receive meets the closed connection at once and the wrapper names the collective rank 0 was
    about to run instead ("Monitored Barrier encountered error running collective: CollectiveFingerPrint(
    SequenceNumber=4, OpType=ALLREDUCE, ...). Error: ... Connection closed by peer"). Both are put in one class,
    as ``gloo_error`` does for gloo's two words."""
    if line is None:
        return None
    if _BARRIER_FAILED.search(line):
        return ("the monitored barrier before the next collective failed: a rank never arrived (named if rank 0 "
                "was already waiting for it; a closed connection if it was gone first)")
    return None


def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_lines(output):
    """The ranks' own lines (sorted by rank, in order within a rank) and a C++ abort's two lines."""
    ours = [clean(line) for line in output.splitlines() if re.match(r"rank \d+: ", line)]
    ours.sort(key=lambda line: int(line.split(":")[0].split()[1]))
    aborts = [clean(line.strip()) for line in output.splitlines()
              if line.startswith("terminate called") or line.strip().startswith("what():")]
    return ours + aborts


def run_jobs(*specs):
    """Several ``run_job(**spec)`` at once (each is a torchrun of its own, on its own port): a list of ``Job``."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(specs)) as pool:
        return list(pool.map(lambda spec: run_job(**spec), specs))


def _calls(dumps):
    """``{rank: {seq: (op, sizes, line)}}``: what each rank called as each collective number of its dump, and from
    which line of the job."""
    return {rank: {e["seq"]: (e["op"], str(e["sizes"]), e["line"]) for e in dump_entries(d)}
            for rank, d in _dumps_of(dumps).items()}


def _first_difference(calls, key=lambda call: call):
    """``(seq, rank, {rank: call})``: the first collective number at which the ranks' calls (compared by ``key``)
    differ, and the rank in the minority there (the lowest, if several); ``None`` if they agree."""
    for seq in sorted({s for mine in calls.values() for s in mine}):
        at = {r: mine.get(seq) for r, mine in calls.items()}
        keys = {r: None if c is None else key(c) for r, c in at.items()}
        counts = {k: list(keys.values()).count(k) for k in set(keys.values())}
        if len(counts) > 1:
            majority = max(counts, key=counts.get)
            return seq, min(r for r, k in keys.items() if k != majority), at
    return None


def odd_one_out(dumps):
    """``(rank, seq)``: the first collective number at which one rank's call differs from what the majority of
    the ranks called there (by operation, sizes, or the line of the job that made the call), and the rank in the
    minority. ``None`` if the records agree. ``dumps``: a ``Job``, or a folder of dumps ``fr_<rank>``."""
    found = _first_difference(_calls(dumps))
    return None if found is None else (found[1], found[0])


def run_job(bug, *, nproc=2, debug="OFF", flight_recorder=True, timeout=3.0, spy=False, out=None, limit=300,
            steps=None):
    """Run ``torchrun --nproc-per-node nproc -m course_utils.planted_bugs --bug bug`` on loopback and return a
    ``Job``. ``debug``: ``TORCH_DISTRIBUTED_DEBUG`` (OFF, INFO, DETAIL); ``flight_recorder``: leave the Flight
    Recorder on, as torch 2.13 has it by default (every ``TORCH_FR_*`` and ``TORCH_NCCL_*`` variable removed), or
    switch it off (``TORCH_FR_BUFFER_SIZE=0``); ``timeout``: the process group's, in seconds; ``spy``: when every
    rank has gone quiet for a second, take each rank's Python stack with py-spy while it hangs (py-spy does not
    stop a process: the job then runs on to its timeout, and reports and dumps as it would have without py-spy);
    ``limit``: seconds before the whole job is killed (it never should be); ``steps``: training steps (the job's
    own 4 by default: the planted bugs' collective numbers in the lesson assume them). ``out``: the folder for the
    Flight Recorder dumps; by default a temporary one, removed when the job ends (the ``Job`` keeps the dumps).

    Introduced in 17_debugging_and_profiling.
    """
    from course_utils.planted_bugs import BUGS

    if bug not in BUGS:
        raise ValueError(f"bug must be one of {BUGS}, not {bug!r}")
    if debug not in ("OFF", "INFO", "DETAIL"):
        raise ValueError(f"debug must be 'OFF', 'INFO' or 'DETAIL' (TORCH_DISTRIBUTED_DEBUG), not {debug!r}")
    temporary = out is None
    out = Path(tempfile.mkdtemp(prefix=f"fr_{bug}_") if temporary else out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        job = _run_torchrun(bug, nproc, debug, flight_recorder, timeout, spy, out, limit, steps)
        job.flight_recorder = _dumps_of(out)
        job.extra = _finished_ranks(out)
    finally:                                                  # whatever happened, the temporary folder goes
        if temporary:
            shutil.rmtree(out, ignore_errors=True)
    if temporary:
        job.out = None
    return job


def _finished_ranks(out):
    """What each rank that finished its ``train`` left in ``out``: ``{"said": {rank: [(seconds, line), ...]},
    "params": {rank: tensor}}``."""
    import json

    import torch

    found = {"said": {}, "params": {}}
    for path in Path(out).glob("said_[0-9]*"):
        found["said"][int(path.name.split("_")[1])] = [tuple(x) for x in json.loads(path.read_text())]
    for path in Path(out).glob("params_[0-9]*"):
        found["params"][int(path.name.split("_")[1])] = torch.load(path, weights_only=True)
    return found


# torchrun (``python -m torch.distributed.run``, its failure summary and exit code as they are), then out without the
# interpreter's teardown of torch: a CPU-second of the launcher's, after the job has ended
_TORCHRUN = """
import os, sys, traceback
from torch.distributed.run import main
try:
    main()
    code = 0
except SystemExit as exc:
    code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
except BaseException:
    traceback.print_exc()
    code = 1
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)
"""


def _run_torchrun(bug, nproc, debug, flight_recorder, timeout, spy, out, limit, steps):
    for old in out.glob("*"):
        if old.is_file():
            old.unlink()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCH_FR_", "TORCH_NCCL_", "PYTEST_"))}
    env.update(PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p),
               TORCH_DISTRIBUTED_DEBUG=debug, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               GLOO_SOCKET_IFNAME="lo" if sys.platform.startswith("linux") else env.get("GLOO_SOCKET_IFNAME", "lo0"),
               **({} if flight_recorder else {"TORCH_FR_BUFFER_SIZE": "0"}))   # on by default: 2000 entries
    script = ["-m", "course_utils.planted_bugs", "--bug", bug, "--timeout", str(timeout), "--out", str(out)]
    script += [] if steps is None else ["--steps", str(steps)]
    for attempt in range(4):
        port = _free_port()
        cmd = [sys.executable, "-c", _TORCHRUN, "--nnodes=1", f"--nproc-per-node={nproc}",
               "--rdzv-backend=static", "--master-addr=127.0.0.1", f"--master-port={port}", "--node-rank=0",
               "--monitor-interval=0.1", *script]
        start = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=str(ROOT), env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        lines, stacks, note = [], None, ""
        reader = threading.Thread(target=lambda: lines.extend((time.monotonic(), x) for x in proc.stdout), daemon=True)
        reader.start()   # a list's extend from one thread, read by another: each line appears whole
        try:
            if spy:
                stacks, note = _spy_when_stuck(proc, lines, out, nproc, limit)
            proc.wait(timeout=max(1.0, limit - (time.monotonic() - start)))
        except subprocess.TimeoutExpired:
            _kill_job(proc, out)
            reader.join(5)
            raise RuntimeError(f"the {bug!r} job did not end within {limit} s (it should end in seconds: its "
                               f"process group times out after {timeout} s). Its output:\n"
                               + "".join(x for _, x in lines)[-3000:])
        finally:
            if proc.poll() is None:
                _kill_job(proc, out)
        reader.join(10)
        output = "".join(x for _, x in lines)
        if "EADDRINUSE" in output or "address already in use" in output.lower():
            continue                                              # another program took the port: try another
        return Job(bug=bug, returncode=proc.returncode, lines=_rank_lines(output), failures=_failures(output),
                   out=out, seconds=time.monotonic() - start, output=output, stacks=stacks, spy_note=note,
                   debug=debug)
    raise RuntimeError("four free loopback ports were taken before torchrun could use them: run the cell again")


def _kill_job(proc, out):
    """SIGKILL torchrun and its ranks, and wait for torchrun. torchrun starts each rank in a session of its own, so
    killing torchrun's process group leaves them running (until their own timeout): each is killed by the pid it
    wrote to ``out/pid_<rank>``."""
    for path in out.glob("pid_*"):
        try:
            os.kill(int(path.read_text()), signal.SIGKILL)
        except (OSError, ValueError):
            pass                                                  # gone already, or its file half-written
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


# -- py-spy -------------------------------------------------------------------------------------------------------

def pyspy_available():
    """``(True, path)`` if py-spy is installed and can read another process here, else ``(False, why)``."""
    exe = shutil.which("py-spy") or (str(Path(sys.executable).parent / "py-spy")
                                     if (Path(sys.executable).parent / "py-spy").exists() else None)
    if exe is None:
        return False, "py-spy is not installed: `pip install py-spy` (a binary wheel; no compiler needed)"
    return True, exe


def pyspy_dump(pid, *, exe=None):
    """The Python frames of ``pid``'s main thread, most recent call last, as ``["func (file:line)", ...]``; file
    names shortened (``torch/...``, the planted job's ``planted_bugs.py``). Raises ``RuntimeError`` with py-spy's
    reason (often ptrace: run as the job's user, or as root, or set kernel.yama.ptrace_scope=0)."""
    if exe is None:
        ok, exe = pyspy_available()
        if not ok:
            raise RuntimeError(exe)
    for attempt in range(3):
        result = subprocess.run([exe, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=30,
                                env={**os.environ, "NO_COLOR": "1", "CLICOLOR_FORCE": "0", "FORCE_COLOR": "0"})
        result.stdout = _ANSI.sub("", result.stdout)             # colours, if a terminal setting forced them
        if result.returncode != 0:
            raise RuntimeError(f"py-spy could not read process {pid}: "
                               f"{(result.stderr or result.stdout).strip()[:300]}")
        threads, current = {}, None
        for line in result.stdout.splitlines():
            if line.startswith("Thread "):
                current = line
                threads[current] = []
                continue
            m = re.match(r"\s+(\S+) \((.+):(\d+)\)$", line)
            if current is not None and m and "<frozen " not in line:   # runpy's: their lines differ by Python
                func, path, lineno = m.groups()
                threads[current].append(f"{func} ({_short(path)}:{lineno})")
        main = [t for t in threads if '"MainThread"' in t] or [t for t in threads if threads[t]]
        if main and threads[main[0]]:
            return threads[main[0]][::-1]
        time.sleep(0.2)                                           # caught between two frames: look again
    raise RuntimeError(f"py-spy found no Python frames in process {pid}: {result.stdout.strip()[:300]}")


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _short(path):
    path = str(path)
    if path.startswith(_torch_dir()):
        return path[len(_torch_dir()) + 1:]
    if "/torch/" in path:
        return "torch/" + path.split("/torch/", 1)[1]
    return path if path.startswith("torch/") else os.path.basename(path)


def _spy_when_stuck(proc, lines, out, nproc, limit):
    """Wait until every rank wrote its pid, the job printed its first step and then nothing for a second (as a
    person notices that a job stopped making progress), then py-spy each rank."""
    ok, exe = pyspy_available()
    if not ok:
        return None, exe
    start = time.monotonic()
    while time.monotonic() - start < limit and proc.poll() is None:
        time.sleep(0.05)
        if lines and len(list(out.glob("pid_*"))) == nproc and time.monotonic() - lines[-1][0] >= 1.0:
            break
    stacks, note, said = {}, "", len(lines)
    for r in range(nproc):
        try:
            stacks[r] = pyspy_dump(int((out / f"pid_{r}").read_text()), exe=exe)
        except (RuntimeError, OSError, ValueError, subprocess.TimeoutExpired) as exc:
            note = str(exc)
    if len(lines) > said:     # a rank spoke meanwhile: its timeout fired, and its stack may be its error's
        return None, "the job's timeout fired while py-spy read the ranks: run it again, or with a longer timeout"
    return stacks, note


# -- Flight Recorder ---------------------------------------------------------------------------------------------

def read_dump(dump):
    """One rank's Flight Recorder dump, from its file or its bytes (a pickle written by its own rank: open only dumps
    your job wrote)."""
    if isinstance(dump, (bytes, bytearray)):
        return pickle.loads(dump)
    with open(dump, "rb") as f:
        return pickle.load(f)


def _dumps_of(source):
    """``{rank: bytes}``: the dumps of a ``Job``, or of a folder's ``fr_<rank>`` files."""
    if isinstance(source, Job):
        return source.dumps()
    files = sorted(Path(source).glob("fr_[0-9]*"), key=lambda p: int(p.name[3:]))
    return {int(p.name[3:]): p.read_bytes() for p in files}


def fix_gloo_dumps(folder):
    """torch 2.13's gloo dumps list the default group under the name ``''`` in ``pg_config`` while each entry
    names it ``'0'``; ``fr_trace`` then stops with ``KeyError: ('0', 0)``. Rename it in place, as NCCL's dumps
    name it. Returns the number of dumps changed."""
    changed = 0
    for path in sorted(Path(folder).glob("fr_[0-9]*")):
        dump = read_dump(path)
        config = dump.get("pg_config", {})
        if "" in config:
            group = config.pop("")
            config["0"] = {"name": "0", "desc": "default_pg", "ranks": group["ranks"]}
            with open(path, "wb") as f:
                pickle.dump(dump, f)
            changed += 1
    return changed


_ANALYZED = {}


def analyze(dumps, *args, first=0):
    """``python -m torch.distributed.flight_recorder.fr_trace <folder> --allow-incomplete-ranks *args``: torch's
    analyzer, its output with the folder and torch's install path shortened. ``dumps``: a ``Job`` (its dumps go to
    a temporary folder for the analyzer, removed after) or a folder of dumps ``fr_<rank>`` (fixed in place by
    ``fix_gloo_dumps`` first). The same dumps are analyzed once: a second call returns the first one's text.

    ``first``: the rank whose dump the analyzer reads first. fr_trace matches every rank's record against the
    first dump it loads and names as "culprit" the ranks that differ from it; on its own it loads the files in the
    order ``os.walk`` lists them (the file system's order), so ``analyze`` fixes it: rank ``first``'s dump, then
    the others sorted. Introduced in 17_debugging_and_profiling."""
    import hashlib

    if isinstance(dumps, Job):
        with tempfile.TemporaryDirectory(prefix="fr_") as folder:
            for rank, data in dumps.dumps().items():
                Path(folder, f"fr_{rank}").write_bytes(data)
            return analyze(folder, *args, first=first)
    folder = Path(dumps)
    fix_gloo_dumps(folder)
    key = (args, first, tuple((rank, hashlib.sha256(data).hexdigest()) for rank, data in _dumps_of(folder).items()))
    if key not in _ANALYZED:
        _ANALYZED[key] = _analyze(folder, args, first)
    return _ANALYZED[key]


def _analyze(folder, args, first=0):
    """fr_trace's ``main`` in this process (a Python of its own would import torch again: seconds), its stdout then
    its stderr, as ``python -m torch.distributed.flight_recorder.fr_trace`` prints them."""
    import contextlib
    import gc
    import io
    import logging
    import traceback

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err):            # what its modules say at import ("tabulate is not installed")
        from torch.distributed.flight_recorder.components.fr_logger import FlightRecorderLogger
        from torch.distributed.flight_recorder.fr_trace import main

    logger = FlightRecorderLogger().logger           # fr_trace's logger: a handler bound to stderr at its import
    handlers = [h for h in logger.handlers if isinstance(h, logging.StreamHandler)]
    saved = [h.stream for h in handlers], logger.level, logger.propagate, gc.isenabled(), os.walk
    walk = os.walk
    # fr_trace matches the ranks' records starting from the first dump os.walk lists: rank `first`'s here, on every
    # file system, so its "culprit" is named against that rank (tests/test_debugging.py reads it both ways)
    order = lambda name: (name != f"fr_{first}", name)
    os.walk = lambda *a, **k: ((r, d, sorted(f, key=order)) for r, d, f in walk(*a, **k))
    for h in handlers:
        h.setStream(err)
    logger.propagate = False                         # what it says goes to err only, not to pytest's or IPython's
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            main([str(folder), "-p", "fr_", "--allow-incomplete-ranks", *args])
    except SystemExit:
        pass
    except Exception:                                # as the analyzer's own Python would print it
        err.write(traceback.format_exc())
    finally:
        streams, level, propagate, gc_was_on, os.walk = saved
        for h, stream in zip(handlers, streams):
            h.setStream(stream)
        logger.setLevel(level)
        logger.propagate = propagate
        if gc_was_on:
            gc.enable()                              # fr_trace's loader switches the collector off for good
    return _tidy(out.getvalue() + err.getvalue(), folder)


def _tidy(text, folder):
    """fr_trace's output with the folder and torch's install path shortened, without what differs between two
    runs of the same analysis."""
    text = text.replace(str(folder), "<dumps>")
    lines = []
    for line in text.splitlines():
        if line.startswith("tabulate is not installed") or "<frozen " in line:
            continue   # a missing optional package; runpy's frames (their lines differ between Pythons)
        if lines and line.rstrip() == lines[-1]:
            continue   # the same sentence for every entry of a missing rank: once is enough
        line = re.sub(r"(\S+/)?(torch/[\w/]+\.py)", r"\2", line)
        line = re.sub(r"\S*/(planted_bugs\.py)", r"\1", line)
        lines.append(line.rstrip())
    return "\n".join(lines).strip()


def tool_verdict(job, tool):
    """What ``tool`` ("plain job", "Flight Recorder" or "DETAIL") made of ``job``, in a few words chosen from the
    run itself: lesson 17's table of the five planted bugs."""
    if tool == "plain job":
        if job.died():                                    # a rank killed by a signal (not torchrun's SIGTERM)
            rank, how = job.died()[0]
            return f"torchrun: rank {rank} died ({how})"
        if job.returncode == 0:
            return "finished, replicas differ; no word" if job.replicas_agree() is False else "finished"
        return "every rank timed out; nothing says where"
    if tool == "Flight Recorder":
        text = analyze(job)
        if "Culprit rank" in text:
            seq = text.split("Collective sequence number: ")[1].split()[0]
            what = "dtypes" if "DTYPE_MISMATCH" in text else "types"
            return f"names collective #{seq} and both {what}"
        return f"only rank(s) {sorted(job.dumps())} dumped: no verdict"
    summary = job.detail_summary()
    if "mismatch" in summary:
        return "names both sides' collective" + (" and tensors" if "tensor [9]" in summary else "")
    return "its barrier fails: a rank never arrived" if barrier_error(job.last_words(0)) else "nothing"


def verdict_table(jobs):
    """``jobs``: ``{bug: (plain job, the same bug with DETAIL)}``. One row per bug: what the plain job, the Flight
    Recorder with fr_trace, and DETAIL said (``tool_verdict``). Introduced in 17_debugging_and_profiling."""
    rows = [f"{'bug':<6} | {'plain job':<40} | {'Flight Recorder + fr_trace':<38} | DETAIL"]
    for bug, (plain, detail) in jobs.items():
        rows.append(f"{bug:<6} | {tool_verdict(plain, 'plain job'):<40} | "
                    f"{tool_verdict(plain, 'Flight Recorder'):<38} | {tool_verdict(detail, 'DETAIL')}")
    return "\n".join(rows)


def dump_entries(dump):
    """The collectives of one dump (its file or its bytes) as dicts: ``seq`` (the group's collective number),
    ``op`` (e.g. ``all_reduce``), ``sizes``, ``dtypes``, ``state`` and ``line`` (the job's line that called it)."""
    rows = []
    for e in read_dump(dump)["entries"]:
        frames = [f for f in e.get("frames", []) if f.get("filename", "").endswith("planted_bugs.py")]
        rows.append({"seq": e["collective_seq_id"], "op": e["profiling_name"].split(":")[-1],
                     "sizes": e["input_sizes"], "dtypes": e["input_dtypes"], "state": e["state"],
                     "line": frames[0]["line"] if frames else None})
    return rows


def dump_table(dumps, last=None, lines=False):
    """Every rank's recorded collectives, one column per rank, one row per collective number: what a learner
    reads to find the rank that left the others. ``dumps``: a ``Job``, or a folder of dumps ``fr_<rank>``;
    ``last``: only the last rows; ``lines``: add the line of the job (``planted_bugs.py``) that made each call."""
    dumps = {rank: dump_entries(d) for rank, d in _dumps_of(dumps).items()}
    seqs = sorted({e["seq"] for rows in dumps.values() for e in rows})
    if last:
        seqs = seqs[-last:]
    where = lambda e: f" line {e['line']}" if lines else ""
    cell = {(r, e["seq"]): f"{e['op']} {e['sizes']}{where(e)}" for r, rows in dumps.items() for e in rows}
    headers = ["#"] + [f"rank {r}" for r in dumps]
    rows = [[str(s)] + [cell.get((r, s), "-") for r in dumps] for s in seqs]
    widths = [max(len(x) for x in col) for col in zip(headers, *rows)]
    fmt = lambda row: "  ".join(x.ljust(w) for x, w in zip(row, widths)).rstrip()
    return "\n".join([fmt(headers)] + [fmt(r) for r in rows])


# -- what the Flight Recorder exercise's self-check reads (course_utils.checks.debugging) ------------------------

def analyzer_named(dumps):
    """``(seq, [rank, ...])``: the collective number of the first error fr_trace reports on these dumps (through
    ``analyze``), and the ranks it names there, as "Culprit rank" or as missing ranks; ``None`` if it reports
    none."""
    text = analyze(dumps)
    m = re.search(r"^(?:Collective sequence number|Not all ranks joining collective, sequence number): (\d+)",
                  text, re.M)
    if m is None:
        return None
    block = text[m.start():].split("collective stack trace:")[0]
    named = {int(r) for r in re.findall(r"Culprit rank (\d+)", block)}
    missing = re.search(r"^missing ranks: \{([\d, ]*)\}", block, re.M)
    named |= {int(r) for r in re.findall(r"\d+", missing.group(1))} if missing else set()
    return int(m.group(1)), sorted(named)


def _say(call):
    op, sizes, line = call
    return f"{op} {sizes} from line {line}"


def _ranks(ranks):
    ranks = [str(r) for r in sorted(ranks)]
    return ranks[0] if len(ranks) == 1 else f"{', '.join(ranks[:-1])} and {ranks[-1]}"


def _groups(at):
    """``[(call, [ranks that made it]), ...]`` at one collective number, the most common call first."""
    found = {}
    for r, c in sorted(at.items()):
        found.setdefault(c, []).append(r)
    return sorted(found.items(), key=lambda item: -len(item[1]))


# -- profiler traces ---------------------------------------------------------------------------------------------

_KINETO_LINE = re.compile(r"^(USDT|STAGE):\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \d+:\d+ \S+\] ")


class without_kineto_banner:
    """``with without_kineto_banner(): ...`` around ``torch.profiler.profile``: the profiler's C++ library (kineto)
    writes "USDT:<date> <time> <pid>:<tid> ...] profiler_start" to the process's stderr at every start and stop,
    whatever KINETO_LOG_LEVEL says; those lines differ on every run. This catches file descriptor 2 meanwhile
    and passes everything else on."""

    def __enter__(self):
        sys.stderr.flush()
        self._saved = os.dup(2)
        self._file = tempfile.TemporaryFile(mode="w+b")
        os.dup2(self._file.fileno(), 2)
        return self

    def __exit__(self, *exc):
        sys.stderr.flush()
        os.dup2(self._saved, 2)
        os.close(self._saved)
        self._file.seek(0)
        rest = [line for line in self._file.read().decode(errors="replace").splitlines(keepends=True)
                if not _KINETO_LINE.match(line)]
        self._file.close()
        if rest:
            sys.stderr.write("".join(rest))
            sys.stderr.flush()
        return False


def trace_events(path):
    """The complete events (``"ph": "X"``) of a ``torch.profiler`` Chrome trace, each with ``name``, ``tid``,
    ``ts`` and ``dur`` in microseconds."""
    import json

    with open(path, encoding="utf-8") as f:
        events = json.load(f)["traceEvents"]
    return [e for e in events if e.get("ph") == "X" and isinstance(e.get("tid"), int)]


def _named(events, name):
    return [e for e in events if e["name"] == name]


def step_intervals(events, comm="gloo:all_reduce"):
    """From a trace of one DDP step labelled with ``record_function`` ("step", "forward", "backward"): the
    step's ``(start, end)``, backward's compute ``(start, end)`` (its start to the end of its last autograd
    node: what 07's hand timeline calls compute, without DDP's wait at the end), and the communication events
    ``[(start, end), ...]`` inside the step, in seconds from the step's start."""
    step = _named(events, "step")
    backward = _named(events, "backward")
    if len(step) != 1 or len(backward) != 1:
        raise ValueError(f"expected one 'step' and one 'backward' range in the trace, found {len(step)} and "
                         f"{len(backward)}: label them with torch.profiler.record_function")
    s0, s1 = step[0]["ts"], step[0]["ts"] + step[0]["dur"]
    b0, b1 = backward[0]["ts"], backward[0]["ts"] + backward[0]["dur"]
    nodes = [e for e in events if e["tid"] == backward[0]["tid"] and e["name"].startswith("autograd::engine::")
             and b0 <= e["ts"] <= b1]
    c1 = max((e["ts"] + e["dur"] for e in nodes), default=b1)
    comms = [(e["ts"], e["ts"] + e["dur"]) for e in events if e["name"] == comm and s0 <= e["ts"] <= s1]
    to_s = lambda t: (t - s0) / 1e6
    return {"step": (0.0, to_s(s1)), "compute": (to_s(b0), to_s(c1)),
            "comm": [(to_s(a), to_s(b)) for a, b in sorted(comms)]}


def collectives_by_thread(events):
    """``{name: (on the thread that ran forward, on other threads)}``: how many of each collective (events named
    ``gloo:...`` or ``nccl:...``) a trace of one labelled step holds, and where they ran.

    Introduced in 17_debugging_and_profiling (FSDP2's step beside DDP's)."""
    forward = _named(events, "forward")
    if len(forward) != 1:
        raise ValueError(f"expected one 'forward' range in the trace, found {len(forward)}: label the step with "
                         "torch.profiler.record_function")
    main = forward[0]["tid"]
    counts = {}
    for e in events:
        if e["name"].startswith(("gloo:", "nccl:")):
            on_main, elsewhere = counts.get(e["name"], (0, 0))
            counts[e["name"]] = (on_main + 1, elsewhere) if e["tid"] == main else (on_main, elsewhere + 1)
    return dict(sorted(counts.items()))


def communication_share(events):
    """The fraction of the labelled ``step`` during which at least one collective ran (the union of the ``gloo:``
    and ``nccl:`` events inside it, however many ran at once)."""
    from course_utils.ddp_probes import _merge

    (step,) = _named(events, "step")
    s0, s1 = step["ts"], step["ts"] + step["dur"]
    spans = [(max(s0, e["ts"]), min(s1, e["ts"] + e["dur"])) for e in events
             if e["name"].startswith(("gloo:", "nccl:")) and e["ts"] < s1 and e["ts"] + e["dur"] > s0]
    return sum(b - a for a, b in _merge(spans)) / (s1 - s0) if s1 > s0 else 0.0


LAUNCH_MARK = "hook: launch"


def hand_made_extra(events, launched, comm="gloo:all_reduce", marker=LAUNCH_MARK):
    """How lesson 07's hand-made timeline of one profiled DDP step differs from the trace's runs of the same
    all-reduces. ``launched``: the hook's ``(launch, callback)`` times (``time.perf_counter``), each launch read
    inside a ``record_function(marker)`` range, so that the trace holds it too: the two clocks are aligned on the
    launches (the median of their differences). The runs are the ``comm`` events inside the step.

    Returns, in seconds, ``waited`` and ``after``: per all-reduce, paired with the launches in order (gloo's worker
    threads take the queued all-reduces in turn), the time from the launch to the run's start and from the run's
    end to the callback; and ``early``: how far the k-th run to start began before the k-th launch, at most
    (sorted, so no pairing is assumed; 0.0 when every run started after a launch of its own, as causality wants,
    up to the clocks' alignment). Introduced in 17_debugging_and_profiling."""
    import statistics

    marks = sorted(e["ts"] / 1e6 for e in _named(events, marker))
    hand = sorted(launched)
    if not marks or len(marks) != len(hand):
        raise ValueError(f"{len(marks)} '{marker}' ranges in the trace for {len(hand)} launches: read each launch's "
                         f"time inside torch.profiler.record_function({marker!r})")
    offset = statistics.median(m - a for m, (a, _) in zip(marks, hand))
    hand = [(a + offset, b + offset) for a, b in hand]
    (step,) = _named(events, "step")
    s0, s1 = step["ts"] / 1e6, (step["ts"] + step["dur"]) / 1e6
    runs = sorted((e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6) for e in _named(events, comm)
                  if s0 <= e["ts"] / 1e6 <= s1)
    if len(runs) != len(hand):
        raise ValueError(f"{len(runs)} '{comm}' events in the step for {len(hand)} launches")
    return {"waited": [r0 - a for (a, _), (r0, _) in zip(hand, runs)],
            "after": [b - r1 for (_, b), (_, r1) in zip(hand, runs)],
            "early": max(0.0, max(a - r0 for (a, _), (r0, _) in zip(hand, runs)))}


COMPUTE_END_LABEL = "backward's last autograd node ends"


def plot_trace(events, title="", ax=None, names=("forward", "backward", "optimizer step"), comm="gloo:all_reduce"):
    """Draw one step's trace per thread: the labelled ranges on the thread that ran them, each communication
    event on the thread that ran it (gloo's worker threads), in milliseconds from the step's start, and a dashed
    line where backward's last autograd node ends (``step_intervals``' compute end): the part of the "backward"
    bar after it is DDP waiting for the last all-reduces, the exposed tail."""
    import matplotlib.pyplot as plt

    step = _named(events, "step")[0]
    s0 = step["ts"]
    rows = {}
    for e in events:
        if e["name"] in names or e["name"] == comm:
            rows.setdefault(e["tid"], []).append(e)
    tids = sorted(rows, key=lambda t: (not any(e["name"] in names for e in rows[t]), t))
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 0.6 + 0.5 * len(tids)))
    colors = {"forward": "tab:blue", "backward": "tab:orange", "optimizer step": "tab:green", comm: "tab:red"}
    for y, tid in enumerate(tids):
        for e in rows[tid]:
            ax.barh(y, e["dur"] / 1e3, left=(e["ts"] - s0) / 1e3, color=colors.get(e["name"], "grey"),
                    edgecolor="black", linewidth=0.3)
    if _named(events, "backward"):   # where backward's compute ends: the rest of its bar is DDP's wait
        compute_end = 1e3 * step_intervals(events, comm)["compute"][1]
        ax.axvline(compute_end, color="black", linestyle="--", linewidth=1, label=COMPUTE_END_LABEL)
    labels = ["main thread" if any(e["name"] in names for e in rows[t]) else "gloo worker" for t in tids]
    ax.set_yticks(range(len(tids)), labels)
    ax.invert_yaxis()
    ax.set_xlabel("ms from the step's start")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()] + ax.get_lines()
    ax.legend(handles, list(colors) + [line.get_label() for line in ax.get_lines()], loc="upper left",
              bbox_to_anchor=(1.01, 1), fontsize=8)
    ax.set_title(title)
    return ax
