"""The distributed cell engine: a persistent pool of ranks that notebook cells run on.

Introduced in 00_launcher_tour. Each rank is a fresh Python interpreter (never a fork) with
torch.distributed initialised once, so a cell costs a pipe round trip, not a process start.
The notebook talks to its ranks over private pipes; the only sockets are torch's own
rendezvous store and the backend's connections, all on 127.0.0.1.
"""
import os
import select
import signal
import socket
import subprocess
import sys
import time
import weakref

from course_utils.engine import _wire

BACKENDS = ("auto", "gloo", "nccl")
ERROR_GRACE_S = 2.0    # after one rank fails, how long the others get to finish on their own
RELEASE_S = 5.0        # how long an abort may take before the ranks are replaced
START_TIMEOUT_S = 120  # importing torch on many ranks sharing two cores is slow


class DistributedError(RuntimeError):
    """A rank failed. ``str()`` names the first failing rank, its traceback and the others' state."""

    def __init__(self, summary, details="", *, rank=None, exc_type=None, exc_message=None,
                 rank_traceback=None, ranks=None):
        super().__init__(summary)
        self.summary, self.details = summary, details
        self.rank, self.exc_type, self.exc_message = rank, exc_type, exc_message
        self.rank_traceback = rank_traceback
        self.ranks = ranks or {}  # rank -> what it was doing

    def __str__(self):
        return self.summary + ("\n" + self.details if self.details else "")

    def _render_traceback_(self):  # IPython: show the ranks' story, not the engine's frames
        return [f"\x1b[31m{type(self).__name__}\x1b[0m: {self}"]


class DistributedTimeout(DistributedError, TimeoutError):
    """No result within ``timeout`` seconds: says which ranks finished and where the others are stuck."""


class CellSyntaxError(ValueError):
    """The code sent to the ranks does not parse; nothing ran. Shows just the offending line."""

    def __init__(self, error):
        import traceback

        self.error = error
        self.lines = traceback.format_exception_only(type(error), error)
        super().__init__("".join(self.lines).rstrip() + "\n(nothing ran on the ranks: fix the line above)")

    def _render_traceback_(self):
        return "".join(self.lines).rstrip().splitlines() + ["(nothing ran on the ranks: fix the line above)"]


def _gpu_count():
    """Visible CUDA devices, without initialising CUDA in this process."""
    torch = sys.modules.get("torch")
    if torch is None:
        import torch
    if not torch.version.cuda:
        return 0
    n = torch.cuda._device_count_nvml()
    if n >= 0:
        return n
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.device_count())"],
                         capture_output=True, text=True)
    return int(out.stdout.strip() or 0)


def choose_backend(backend="auto", world_size=2):
    """'nccl' when every rank can have its own GPU, else 'gloo'. Raises ValueError on bad input."""
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}. "
                         "Use world_size=2 for a first try.")
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}: use one of {', '.join(BACKENDS)}. "
                         "'auto' picks nccl when there is a GPU per rank, else gloo.")
    if backend == "gloo":
        return "gloo"
    gpus = _gpu_count()
    if backend == "nccl" and gpus < world_size:
        raise ValueError(f"backend='nccl' needs one GPU per rank: world_size={world_size} but "
                         f"{gpus} GPU(s) are visible. Use backend='gloo' (CPU) or a smaller world_size.")
    return "nccl" if gpus >= world_size else "gloo"


def _cpu_count():
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _under_nbval():
    return "PYTEST_CURRENT_TEST" in os.environ


def _plural(ranks):
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _signal_name(code):
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


class _Rank:
    """The notebook's end of one worker: its process and its four pipes."""

    def __init__(self, rank, proc, cmd_w, res_r, out_r, err_r):
        self.rank, self.proc = rank, proc
        self.cmd_w, self.res_r = cmd_w, res_r
        self.streams = {out_r: "stdout", err_r: "stderr"}
        self.frames = _wire.FrameReader()
        self.partial = {"stdout": b"", "stderr": b""}
        self.lines = {"stdout": [], "stderr": []}
        self.ended = {"stdout": 0, "stderr": 0}  # last run id whose end mark arrived
        self.last_line = ""
        self.progress = None
        self.dead = False

    def fds(self):
        return [self.res_r, *self.streams]

    def send(self, msg):
        _wire.write_all(self.cmd_w, _wire.dump(msg))

    def feed_stream(self, name, data):
        buf = self.partial[name] + data
        while True:
            cut = buf.find(_wire.END_MARK)
            if cut < 0:
                break
            end = buf.find(b"\n", cut)
            if end < 0:
                break
            self._add_final(name, buf[:cut])
            self.ended[name] = int(buf[cut + len(_wire.END_MARK):end])
            buf = buf[end + 1:]
        *whole, rest = buf.split(b"\n")
        for line in whole:
            self._add_line(name, line)
        self.partial[name] = rest

    def _add_final(self, name, data):
        """The last output of a command: whole lines, blank ones included; a final newline ends them."""
        if not data:
            return
        lines = data.split(b"\n")
        if lines[-1] == b"":
            lines.pop()
        for line in lines:
            self._add_line(name, line)

    def _add_line(self, name, raw):
        text = raw.decode("utf-8", "replace").rstrip("\r").split("\r")[-1]
        self.lines[name].append(text)
        self.last_line = text

    def flush_partial(self):
        for name, rest in self.partial.items():
            if rest:
                self._add_line(name, rest)
                self.partial[name] = b""

    def take_lines(self):
        out = self.lines
        self.lines = {"stdout": [], "stderr": []}
        return out

    def close(self):
        for fd in (self.cmd_w, *self.fds()):
            try:
                os.close(fd)
            except OSError:
                pass


def _spawn(world_size, backend, pg_timeout):
    """Start the ranks: fresh interpreters, rendezvous on a socket bound before anyone uses it."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))  # loopback only, and the port is ours from this moment
    listener.listen(128)
    port = listener.getsockname()[1]
    threads = max(1, _cpu_count() // world_size)
    ranks = []
    try:
        for r in range(world_size):
            cmd_r, cmd_w = os.pipe()
            res_r, res_w = os.pipe()
            out_r, out_w = os.pipe()
            err_r, err_w = os.pipe()
            env = dict(os.environ)
            env.update(
                RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world_size),
                LOCAL_WORLD_SIZE=str(world_size), GROUP_RANK="0",
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1",
                GLOO_SOCKET_IFNAME="lo", NCCL_SOCKET_IFNAME="lo",
                COURSE_UTILS_BACKEND=backend, COURSE_UTILS_PG_TIMEOUT=str(pg_timeout),
                COURSE_UTILS_CMD_FD=str(cmd_r), COURSE_UTILS_RES_FD=str(res_w),
                COURSE_UTILS_PARENT_PID=str(os.getpid()),
            )
            env.pop("PYTEST_CURRENT_TEST", None)
            env["PYTHONPATH"] = os.pathsep.join(p for p in [os.getcwd(), env.get("PYTHONPATH")] if p)
            pass_fds = [cmd_r, res_w]
            if r == 0:
                env["COURSE_UTILS_LISTEN_FD"] = str(listener.fileno())
                pass_fds.append(listener.fileno())
            proc = subprocess.Popen(
                [sys.executable, "-m", "course_utils.engine._worker"], env=env, pass_fds=pass_fds,
                stdin=subprocess.DEVNULL, stdout=out_w, stderr=err_w, start_new_session=True)
            for fd in (cmd_r, res_w, out_w, err_w):
                os.close(fd)
            for fd in (res_r, out_r, err_r):
                os.set_blocking(fd, False)
            ranks.append(_Rank(r, proc, cmd_w, res_r, out_r, err_r))
    except BaseException:
        _kill(ranks)
        raise
    finally:
        listener.close()
    return ranks


def _kill(ranks):
    for rk in ranks:
        if rk.proc.poll() is None:
            try:
                rk.proc.kill()
            except OSError:
                pass
    for rk in ranks:
        try:
            rk.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        rk.close()


def _shutdown(ranks):
    for rk in ranks:
        try:
            rk.send(("shutdown",))
        except OSError:
            pass
    deadline = time.monotonic() + 2
    for rk in ranks:
        try:
            rk.proc.wait(timeout=max(0.01, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    _kill(ranks)


class Cluster:
    """A persistent pool of ``world_size`` ranks with torch.distributed initialised.

    Introduced in 00_launcher_tour::

        with Cluster(world_size=4) as cluster:
            cluster.run("dist.get_rank()")      # -> [0, 1, 2, 3]
            cluster.run(train, lr=0.1)          # functions from notebook cells work

    Names defined by ``run`` persist on the ranks until ``restart()``. ``rank``, ``world_size``,
    ``local_rank`` and ``device`` are predefined on every rank.
    """

    def __init__(self, world_size=2, backend="auto", timeout=60):
        self.backend = choose_backend(backend, world_size)
        self.requested_backend = backend
        self.world_size = world_size
        self.timeout = self._check_timeout(timeout)
        self._ranks = []
        self._run_id = 0
        self._generation = 0
        self._stack_id = 0
        self._finalizer = None
        self._held = []  # (rank, lines) printed by ranks that were since replaced
        self._done = {}  # run id -> {rank: (ok, value or error info)}
        self._live = None
        self.started_at = None
        self.restarts = 0
        self._start()

    @staticmethod
    def _check_timeout(timeout):
        if not isinstance(timeout, (int, float)) or timeout <= 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        return float(timeout)

    # -- life cycle --------------------------------------------------------------------
    def _start(self):
        self._ranks = _spawn(self.world_size, self.backend, pg_timeout=max(self.timeout, 10))
        self._generation = 0
        self._finalizer = weakref.finalize(self, _kill, list(self._ranks))
        self.started_at = time.time()
        ready, errors = {}, {}
        deadline = time.monotonic() + START_TIMEOUT_S
        while len(ready) + len(errors) < self.world_size:
            for rk, msg in self._pump(0.1):
                if msg[0] == "ready":
                    (ready if msg[2] else errors)[rk.rank] = msg[3]
            dead = [rk for rk in self._ranks if rk.dead and rk.rank not in ready]
            if dead or time.monotonic() > deadline:
                break
        if len(ready) < self.world_size:
            out = {rk.rank: rk.take_lines() for rk in self._ranks}
            self._finalizer()
            self._ranks = []
            lines = [f"  rank {r}: {e['type']}: {e['message']}" for r, e in sorted(errors.items())]
            for r, streams in sorted(out.items()):
                lines += [f"  [rank {r}] {line}" for line in streams["stderr"][-5:]]
            raise DistributedError(
                f"the {self.world_size} ranks did not start ({len(ready)} ready).", "\n".join(lines))
        self.pids = [ready[r]["pid"] for r in range(self.world_size)]

    def restart(self):
        """Replace every rank with a fresh one: all names defined on the ranks are gone."""
        self._replace()

    def _replace(self, start=True):
        for rk in self._ranks:  # keep what the old ranks printed for this cell's output
            rk.flush_partial()
            self._held.append((rk.rank, rk.take_lines()))
        self.shutdown()
        self.restarts += 1
        if start:
            self._start()

    def shutdown(self):
        """Stop every rank. Safe to call twice."""
        if self._ranks:
            self._finalizer.detach()
            _shutdown(self._ranks)
            self._ranks = []

    @property
    def alive(self):
        return bool(self._ranks) and all(rk.proc.poll() is None for rk in self._ranks)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()

    def __repr__(self):
        state = "running" if self.alive else "stopped"
        return f"Cluster(world_size={self.world_size}, backend={self.backend!r}, timeout={self.timeout:g}) [{state}]"

    # -- public calls --------------------------------------------------------------------
    def run(self, code_or_fn, *args, timeout=None, **kwargs):
        """Run a string of code or a function on every rank; return the rank-ordered results.

        For a string, the result is the value of its last expression (None if there is none).
        ``timeout`` (seconds) overrides the cluster's for this call only (so a function's own
        ``timeout`` argument cannot be passed through ``run``: bind it with functools.partial).
        """
        if isinstance(code_or_fn, str):
            if args or kwargs:
                raise ValueError("arguments are only for functions: for code, push() the values first")
            return self._request(self._code_message(code_or_fn, "<ddp>"), timeout)
        if not callable(code_or_fn):
            raise ValueError(f"run() takes a string of code or a function, got {type(code_or_fn).__name__}")
        return self._request(self._call_message(code_or_fn, args, kwargs), timeout)

    def push(self, **values):
        """Set names on every rank: ``cluster.push(lr=0.1, data=tensor)``."""
        blob = _dumps_named(values, "push")
        self._request(lambda run_id: ("push", run_id, blob), None)

    def pull(self, name):
        """The value of ``name`` on every rank, rank-ordered. NameError if a rank lacks it."""
        values = self._request(lambda run_id: ("pull", run_id, name), None)
        missing = [r for r, v in enumerate(values) if isinstance(v, type(_wire.MISSING))]
        if missing:
            raise NameError(f"name {name!r} is not defined on {_plural(missing)}: define it in a %%ddp cell "
                            "(names do not survive a restart or a change of world size)")
        return values

    # -- messages ------------------------------------------------------------------------
    @staticmethod
    def _code_message(source, filename):
        try:
            compile(source, filename, "exec")
        except SyntaxError as exc:  # caught here, before any rank runs
            raise CellSyntaxError(exc) from None
        return lambda run_id: ("code", run_id, source, filename)

    @staticmethod
    def _call_message(fn, args, kwargs):
        for i, a in enumerate(args):
            _dumps_named({f"argument {i} ({type(a).__name__})": a}, "run")
        _dumps_named(kwargs, "run")
        sources, rename = _sources_of(fn)
        try:
            blob = _wire.dumps((fn, args, kwargs), rename)
        except Exception as exc:
            raise ValueError(f"the function {getattr(fn, '__name__', fn)!r} cannot be sent to the ranks: "
                             f"{exc}. Create what it needs inside the function instead.") from None
        return lambda run_id: ("call", run_id, sources, blob)

    # -- the loop ------------------------------------------------------------------------
    def _pump(self, wait):
        """Read whatever the ranks sent within ``wait`` seconds; return the messages."""
        fd_map = {}
        for rk in self._ranks:
            if not rk.dead:
                for fd in rk.fds():
                    fd_map[fd] = rk
        if not fd_map:
            time.sleep(wait)
            return []
        try:
            readable, _, _ = select.select(list(fd_map), [], [], wait)
        except InterruptedError:
            return []
        msgs = []
        for fd in readable:
            rk = fd_map[fd]
            try:
                data = os.read(fd, 1 << 20)
            except BlockingIOError:
                continue
            if fd == rk.res_r:
                if not data:
                    rk.dead = True  # the worker's end closed: it exited
                    self._drain_streams(rk)
                    continue
                msgs += [(rk, m) for m in rk.frames.feed(data)]
            elif data:
                rk.feed_stream(rk.streams[fd], data)
        for rk, m in msgs:
            if m[0] == "progress":
                rk.progress = m[1:]  # (desc, i, total)
            elif m[0] == "done":  # kept per run, whichever loop happens to read it
                self._done.setdefault(m[1], {}).setdefault(rk.rank, (m[3], m[4]))
        return [(rk, m) for rk, m in msgs if m[0] not in ("progress", "done")]

    def _drain_streams(self, rk):
        for fd, name in rk.streams.items():
            while True:
                try:
                    r, _, _ = select.select([fd], [], [], 0.5)
                    data = os.read(fd, 1 << 20) if r else b""
                except (BlockingIOError, OSError):
                    break
                if not data:
                    break
                rk.feed_stream(name, data)
        rk.flush_partial()

    def _send_all(self, make):
        for rk in self._ranks:
            try:
                rk.send(make(self._run_id))
            except (BrokenPipeError, OSError):
                rk.dead = True

    def _request(self, make, timeout, live=None, only_rank=None):
        __tracebackhide__ = True
        timeout = self.timeout if timeout is None else self._check_timeout(timeout)
        if not self._ranks:
            self._start()
        elif not self.alive:
            self.restart()
        for rk in self._ranks:  # the live status shows this cell's lines only
            rk.progress, rk.last_line = None, ""
        self._run_id += 1
        run_id = self._run_id
        self._done = {run_id: {}}
        results = self._done[run_id]
        self._live = live
        self._send_all(make)
        t0 = time.monotonic()
        first_error_at = None
        try:
            while True:
                self._pump(0.05)
                if first_error_at is None and any(not ok for ok, _ in results.values()):
                    first_error_at = time.monotonic()
                pending = [rk for rk in self._ranks if not self._complete(rk, results, run_id)]
                if not pending:
                    break
                dead = [rk for rk in pending if rk.dead]
                if dead:
                    raise self._dead_error(dead, only_rank)
                now = time.monotonic()
                if live is not None:
                    live.update(self._ranks, now - t0)
                if first_error_at is not None and now - first_error_at > ERROR_GRACE_S:
                    break
                if now - t0 > timeout:
                    raise self._timeout_error(results, run_id, timeout, only_rank)
        except KeyboardInterrupt:
            note = self._recover(run_id, interrupt=True)
            self._show(only_rank)
            raise KeyboardInterrupt(f"interrupted: every rank stopped. {note}") from None
        finally:
            self._close_live()
        if any(not ok for ok, _ in results.values()) or len(results) < self.world_size:
            raise self._rank_error(results, run_id, only_rank)
        self._show(only_rank)
        return [results[r][1] for r in range(self.world_size)]

    @staticmethod
    def _complete(rk, results, run_id):
        return rk.rank in results and rk.ended["stdout"] >= run_id and rk.ended["stderr"] >= run_id

    def _close_live(self):
        live, self._live = self._live, None
        if live is not None:
            live.close()

    def _show(self, only_rank):
        """Print every rank's output, grouped in rank order, so the stored output is deterministic."""
        self._close_live()
        for rk in self._ranks:
            rk.flush_partial()
        held, self._held = self._held, []
        merged = {}
        for rank, lines in held + [(rk.rank, rk.take_lines()) for rk in self._ranks]:
            for name in ("stdout", "stderr"):
                merged.setdefault(rank, {"stdout": [], "stderr": []})[name] += lines[name]
        for rank in sorted(merged):
            lines = merged[rank]
            if only_rank is not None and rank != only_rank:
                continue
            for name in ("stdout", "stderr"):
                if lines[name]:
                    stream = getattr(sys, name)
                    stream.write("".join(f"[rank {rank}] {line}\n" for line in lines[name]))
                    stream.flush()

    def _stacks(self, ranks):
        """Ask each busy rank's control thread where its main thread is."""
        self._stack_id += 1
        sid = self._stack_id
        for rk in ranks:
            try:
                rk.send(("stacks", sid))
            except OSError:
                pass
        got = {}
        deadline = time.monotonic() + 2
        while len(got) < len(ranks) and time.monotonic() < deadline:
            for rk, msg in self._pump(0.05):
                if msg[0] == "stacks" and msg[1] == sid:
                    got[rk.rank] = msg[3]
        return got

    def _recover(self, run_id, interrupt=False):
        """Release every rank and rebuild the process group; replace the ranks if that fails.

        Returns a note for the error message."""
        results = self._done.setdefault(run_id, {})
        live = [rk for rk in self._ranks if not rk.dead]
        for rk in live:
            try:
                rk.send(("abort",))  # idle ranks drop their connections: peers stuck on them error out
            except OSError:
                rk.dead = True
        for rk in live:
            if rk.rank not in results and rk.proc.poll() is None:
                try:
                    os.kill(rk.proc.pid, signal.SIGINT)  # Python loops and sleeps stop here
                except OSError:
                    pass
        deadline = time.monotonic() + RELEASE_S
        while time.monotonic() < deadline:
            self._pump(0.05)
            if all(self._complete(rk, results, run_id) for rk in self._ranks) or any(rk.dead for rk in self._ranks):
                break
        if all(self._complete(rk, results, run_id) for rk in self._ranks):
            self._generation += 1
            gen = self._generation
            self._run_id += 1
            reset_id = self._run_id
            done = self._done.setdefault(reset_id, {})
            self._send_all(lambda rid: ("reset", rid, gen))
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not any(rk.dead for rk in self._ranks):
                self._pump(0.05)
                if all(self._complete(rk, done, reset_id) for rk in self._ranks):
                    break
            if all(self._complete(rk, done, reset_id) and done[rk.rank][0] for rk in self._ranks):
                return "The ranks were released and the process group rebuilt; names you defined are kept."
        self._replace(start=not interrupt)  # after an interrupt, start lazily: the cell returns now
        return "The ranks were replaced with fresh ones; names you defined on them are gone."

    # -- errors ------------------------------------------------------------------------
    def _describe(self, rank, results, stacks, first):
        if rank in results:
            ok, payload = results[rank]
            if ok:
                return "finished"
            where = f" {payload['where']}" if payload.get("where") else ""
            if rank == first:
                return f"raised {payload['type']}{where}"
            return f"then raised {payload['type']}{where}"
        info = stacks.get(rank)
        if info and info.get("where"):
            return f"was running {info['where']}"
        return "was running"

    def _rank_error(self, results, run_id, only_rank):
        __tracebackhide__ = True
        errors = {r: p for r, (ok, p) in results.items() if not ok}
        first = _first_failure(errors)
        running = [rk for rk in self._ranks if rk.rank not in results]
        stacks = self._stacks(running) if running else {}
        results = dict(results)  # what the ranks had done when the error was noticed
        note = self._recover(run_id)
        self._show(only_rank)
        e = errors[first]
        others = {r: self._describe(r, results, stacks, first) for r in range(self.world_size) if r != first}
        details = [e["traceback"].rstrip(), "", "The other ranks:"]
        details += [f"  rank {r}: {s}" for r, s in others.items()]
        details += ["", note]
        return DistributedError(
            f"rank {first} failed with {e['type']}: {e['message']}", "\n".join(details),
            rank=first, exc_type=e["type"], exc_message=e["message"], rank_traceback=e["traceback"],
            ranks=others)

    def _timeout_error(self, results, run_id, timeout, only_rank):
        __tracebackhide__ = True
        stuck = [rk for rk in self._ranks if rk.rank not in results]
        stacks = self._stacks(stuck)
        finished = sorted(results)
        note = self._recover(run_id)
        self._show(only_rank)
        lines = [f"{_plural(finished)} finished." if finished else "No rank finished."]
        states = {}
        for rk in stuck:
            info = stacks.get(rk.rank, {})
            states[rk.rank] = f"stuck {info['where']}" if info.get("where") else "stuck (no Python stack)"
            lines.append(f"  rank {rk.rank}: {states[rk.rank]}")
        for rk in stuck:
            info = stacks.get(rk.rank, {})
            if info.get("stack"):
                lines += ["", f"Python stack of rank {rk.rank} (most recent call last):", info["stack"].rstrip()]
        lines += ["", note]
        return DistributedTimeout(
            f"{_plural([rk.rank for rk in stuck])} did not finish within {timeout:g} s "
            "(a rank skipped a collective, or is still computing: raise --timeout if so).",
            "\n".join(lines), ranks=states)

    def _dead_error(self, dead, only_rank):
        __tracebackhide__ = True
        for rk in dead:
            try:
                rk.proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                rk.proc.kill()
                rk.proc.wait()
        codes = {rk.rank: rk.proc.returncode for rk in dead}
        self._show(only_rank)
        how = {r: (f"was killed by {_signal_name(c)}" if c < 0 else f"exited with code {c}")
               for r, c in codes.items()}
        first = min(codes)
        self._replace()
        lines = [f"  rank {r}: {h}" for r, h in how.items()]
        lines += ["", "The ranks were replaced with fresh ones; names you defined on them are gone."]
        return DistributedError(f"rank {first} died: it {how[first]}.", "\n".join(lines), rank=first,
                                exc_type="ProcessExit", exc_message=how[first], ranks=how)


_RELEASED = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def _first_failure(errors):
    """The rank to blame: the lowest rank among the errors that are not just a rank being released
    from a collective, within a second of the earliest one (so that a bug hitting every rank at
    once is reported the same way every run)."""
    causes = {r: e for r, e in errors.items() if not any(m in e["message"] for m in _RELEASED)} or errors
    earliest = min(e["time"] for e in causes.values())
    return min(r for r, e in causes.items() if e["time"] <= earliest + 1.0)


def _dumps_named(values, what):
    for name, value in values.items():
        try:
            _wire.dumps(value)
        except Exception as exc:
            raise ValueError(f"{what}: {name!s} cannot be sent to the ranks ({type(value).__name__}: {exc}). "
                             "Send plain data or tensors, or create the object on the ranks.") from None
    return _wire.dumps(values)


def cell_names():
    """IPython's map from a cell's compiled filename to the 'Cell In[N]' it shows in tracebacks."""
    try:
        from IPython import get_ipython
    except ImportError:
        return {}
    ip = get_ipython()
    fmap = getattr(getattr(ip, "compile", None), "_filename_map", None) or {}
    return {name: f"Cell In[{n}]" for name, n in fmap.items()}


def _sources_of(fn):
    """Source of the notebook cells that define ``fn`` and the code it nests, and their 'Cell In[N]' names."""
    import linecache

    names = cell_names()
    sources, rename = {}, {}
    codes = [getattr(fn, "__code__", None) or getattr(getattr(fn, "__call__", None), "__code__", None)]
    while codes:
        code = codes.pop()
        if code is None:
            continue
        name = code.co_filename
        lines = linecache.cache.get(name)
        if lines and not os.path.exists(name):
            shown = rename[name] = names.get(name, name)
            sources[shown] = "".join(lines[2])
        codes += [c for c in code.co_consts if hasattr(c, "co_filename")]
    return sources, rename


def launch(fn, *args, world_size=2, backend="auto", timeout=60, **kwargs):
    """Run ``fn(*args, **kwargs)`` once on a short-lived pool; return the rank-ordered results.

    Introduced in 00_launcher_tour."""
    __tracebackhide__ = True
    with Cluster(world_size=world_size, backend=backend, timeout=timeout) as cluster:
        return cluster.run(fn, *args, **kwargs)

