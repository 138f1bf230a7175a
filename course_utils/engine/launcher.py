"""The distributed cell engine: a persistent pool of ranks that notebook cells run on.

Introduced in 00_launcher_tour. Each rank is forked from a per-process fork server that has torch
imported (course_utils.engine._forkstart), or is a fresh Python interpreter where that server cannot
start; never a fork of the notebook process. torch.distributed is initialised once, so a cell
costs a pipe round trip, not a process start.
``spawn`` is the drop-in for ``torch.multiprocessing.spawn``: fresh ranks without a process group.
The notebook talks to its ranks over private pipes (and to the fork servers over socketpairs); the only
listening sockets are torch's own rendezvous store and the backend's connections, all on 127.0.0.1.
"""
import _signal
import contextlib
import itertools
import math
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref

from course_utils.engine import _forkstart, _wire
from course_utils.engine.reports import (  # noqa: F401  (DistributedTimeout: public, re-exported)
    DistributedError, DistributedTimeout, dead_error, hide_cpp_frames, interrupt_error, plural, rank_error,
    timeout_error)

BACKENDS = ("auto", "gloo", "nccl")
ERROR_GRACE_S = 2.0    # after one rank fails, how long the others get to finish on their own; longer while one of
ERROR_GRACE_MAX_S = 10.0  # them is still running (its error on its way, on a loaded machine), at most this long
RELEASE_S = 5.0        # how long an abort may take before the ranks are replaced
REABORT_S = 0.5        # while it waits, a rank still busy is sent the abort again this often
DEAD_TOGETHER_S = 2.0  # after a rank dies, how long the report waits at most for others that die with it;
BLOCKED_SAMPLES = 2    # it stops sooner once every live rank is seen blocked this many times in a row (_blocked)
EXIT_CODE_S = 10.0     # at most this long for a dead rank's exit code: a forked rank's comes from /proc at once
                       # (_forkstart.zombie_exit_code), else from its server once it has reaped it (macOS)
START_TIMEOUT_S = 120  # importing torch on many ranks sharing two cores is slow
PG_TIMEOUT_MIN_S = 1800  # the backend's own timeout stays far above any cell's: the engine decides when a cell hung
POLL_S = 0.1           # how often the loop asks the OS whether a rank exited
DRAIN_S = 2.0          # how long the output of a dead rank is still read (a child it forked may hold the pipe)
DONE_DRAIN_S = 1.0     # how long the pipes of a rank that said "done" are read (a background thread may never stop)


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


# Makes the status display of a ``run()`` called without one (a checker's call, launch(fn)): set by the %%ddp
# magic's module when the notebook extension loads (``magic.CallView``), None in a plain Python process.
CALL_VIEW = None


class _Rank:
    """The notebook's end of one worker: its process, its command and result pipes, and the pipes
    that carry its stdout and stderr (fd level, so C and C++ output arrives too)."""

    def __init__(self, rank, proc, cmd_w, res_r, out_r, err_r):
        self.rank, self.proc = rank, proc
        self.cmd_w, self.res_r = cmd_w, res_r
        self.streams = {out_r: "stdout", err_r: "stderr"}
        self.frames = _wire.FrameReader()
        self.partial = {"stdout": b"", "stderr": b""}
        self.lines = {"stdout": [], "stderr": []}
        self.closed = set()  # stream fds at EOF (the rank closed or redirected its fd 1 or 2): never polled again
        self.last_line = ""
        self.progress = None
        self.dead = False

    def fds(self):
        return [self.res_r, *(fd for fd in self.streams if fd not in self.closed)]

    def send(self, msg):
        _wire.write_all(self.cmd_w, _wire.dump(msg))

    def feed_stream(self, name, data):
        *whole, rest = (self.partial[name] + data).split(b"\n")
        for line in whole:
            self._add_line(name, line)
        self.partial[name] = rest

    def read_stream(self, fd):
        """Read what is in one stream pipe now; False when nothing was (empty, or at EOF: the rank closed or
        redirected the fd, as os.dup2(devnull, 1) does, and it is never polled again: POLLHUP would spin)."""
        try:
            data = os.read(fd, 1 << 20)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            data = b""
        if not data:
            self.closed.add(fd)
            return False
        self.feed_stream(self.streams[fd], data)
        return True

    def drain_streams(self, seconds=DONE_DRAIN_S, quiet=0.0):
        """Read the stream pipes until they are empty, for at most ``seconds`` (a background thread of the
        rank may print without end). Called once the rank said it is done: whatever it wrote before that
        (it flushes first) is in the pipes now, so no end mark is needed. For a rank that died, ``quiet``: go
        on reading until a pipe is at EOF or has been silent that long (a child it started may still write)."""
        deadline = time.monotonic() + seconds
        for fd in self.streams:
            while fd not in self.closed and time.monotonic() < deadline:
                if self.read_stream(fd):
                    continue
                if not quiet or fd in self.closed or not _forkstart._readable(
                        [fd], min(quiet, deadline - time.monotonic())):
                    break

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


def _loopback_interface(platform, env):
    """The interface gloo binds the ranks to: Linux's loopback is ``lo``; macOS and the BSDs call it
    ``lo0`` (a GLOO_SOCKET_IFNAME the learner set is kept there)."""
    return "lo" if platform.startswith("linux") else env.get("GLOO_SOCKET_IFNAME", "lo0")


def _spawn(world_size, backend, pg_timeout, group=True):
    """Start the ranks: forked from the fork server (or fresh interpreters), rendezvous on a socket
    bound before anyone uses it.

    With ``group=False`` (``spawn``) the ranks get no process group: the learner's function sets it
    up from MASTER_ADDR and MASTER_PORT, a loopback port that was free a moment ago."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))  # loopback only, and the port is ours from this moment
    listener.listen(128)
    port = listener.getsockname()[1]
    threads = max(1, _cpu_count() // world_size)
    ranks = []
    try:
        for r in range(world_size):
            with _sigint_held():  # a stop while a rank starts (Popen waits for its exec) is raised once it is in ranks
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
                    GLOO_SOCKET_IFNAME=_loopback_interface(sys.platform, env),
                    NCCL_SOCKET_IFNAME="lo",
                    COURSE_UTILS_BACKEND=backend, COURSE_UTILS_PG_TIMEOUT=str(pg_timeout),
                    COURSE_UTILS_CMD_FD=str(cmd_r), COURSE_UTILS_RES_FD=str(res_w),
                    COURSE_UTILS_PARENT_PID=str(os.getpid()), COURSE_UTILS_GROUP="1" if group else "0",
                )
                env.pop("PYTEST_CURRENT_TEST", None)
                env["PYTHONPATH"] = os.pathsep.join(p for p in [os.getcwd(), env.get("PYTHONPATH")] if p)
                env["COURSE_UTILS_CWD"] = os.getcwd()
                pass_fds = [cmd_r, res_w]
                if r == 0 and group:
                    env["COURSE_UTILS_LISTEN_FD"] = str(listener.fileno())
                    pass_fds.append(listener.fileno())
                try:
                    fds = {"stdout": out_w, "stderr": err_w, "cmd": cmd_r, "res": res_w}
                    if r == 0 and group:
                        fds["listen"] = listener.fileno()
                    proc = _forkstart.start_rank(env, fds, threads)  # a fraction of a second; None: no server
                    if proc is None:
                        proc = subprocess.Popen(
                            [sys.executable, "-m", "course_utils.engine._worker"], env=env, pass_fds=pass_fds,
                            stdin=subprocess.DEVNULL, stdout=out_w, stderr=err_w, start_new_session=True)
                except BaseException:  # not started (or a stop while the server forks it: its pipes end it)
                    for fd in (cmd_w, res_r, out_r, err_r):
                        os.close(fd)
                    raise
                finally:
                    for fd in (cmd_r, res_w, out_w, err_w):
                        os.close(fd)
                for fd in (res_r, out_r, err_r):
                    os.set_blocking(fd, False)
                rk = _Rank(r, proc, cmd_w, res_r, out_r, err_r)
                ranks.append(rk)
    except BaseException:
        _kill(ranks)
        raise
    finally:
        listener.close()
    return ranks


def _kill_group(proc):
    """SIGKILL a rank's process group (the rank leads it: what it started goes too), never another process.

    Once a rank has ended and been reaped (by this process's poll(), or at once by the fork server), its
    pid is free for reuse, unless processes of its group (children it started) still hold it as their
    group id. So the group is signalled while the rank has not been seen to end; afterwards only if no
    process has that pid (it was not reused) and the group still has members (the rank's leftovers)."""
    pid = proc.pid
    if proc.poll() is not None:
        try:
            os.kill(pid, 0)
            return  # a process has this pid again: not ours
        except ProcessLookupError:
            pass
        except OSError:
            return  # it exists (another user's): not ours
        try:
            os.killpg(pid, 0)
        except OSError:
            return  # no process is left in the group: nothing to do
    try:
        os.killpg(pid, signal.SIGKILL)
    except (OSError, AttributeError):
        if proc.poll() is None:
            try:
                proc.kill()
            except OSError:
                pass


def _kill(ranks):
    """Kill the ranks and whatever they started (each rank leads its own process group)."""
    for rk in ranks:
        _kill_group(rk.proc)
    for rk in ranks:
        try:
            rk.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        rk.close()


def _shutdown(ranks, wait_s=2.0):
    """Ask every rank to end as a script does (its atexit handlers, its open files flushed), wait up to
    ``wait_s``, then kill what is left. Also what a Cluster's finalizer does when the notebook's kernel exits
    (1 s): a kill there lost what a rank had not yet written to an unclosed file (issue 41)."""
    for rk in ranks:
        try:
            rk.send(("shutdown",))
        except OSError:
            pass
    deadline = time.monotonic() + wait_s
    for rk in ranks:
        try:
            rk.proc.wait(timeout=max(0.01, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    _kill(ranks)


_SERIALS = itertools.count(1)
_LIVE = weakref.WeakSet()  # every Cluster of this process that has ranks, for shutdown_all()


@contextlib.contextmanager
def _sigint_held():
    """A stop (SIGINT) during the block is held until the block ends, then handed to the handler it would have
    reached (the default one raises KeyboardInterrupt): a rank whose process exists is always recorded (and so
    killed by the caller's cleanup) before the stop acts. On the spawn path a stop that landed while
    subprocess.Popen waited for the child's exec left a rank that nothing would kill (issue 41). Only on the
    main thread, where Python delivers signals."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    stopped = []
    old = _signal.signal(signal.SIGINT, lambda *_: stopped.append(True))
    old = old if old is not None else signal.default_int_handler
    try:
        yield
    finally:
        _signal.signal(signal.SIGINT, old)
    if stopped and callable(old):  # delivered now to whoever was there: the default raises KeyboardInterrupt, a
        old(signal.SIGINT, None)   # call's deferring handler sets its flag


def shutdown_all():
    """Stop the ranks of every cluster of this process (%ddp shutdown): the %%ddp ranks, a checker's, a
    Cluster made in a cell. A cluster stopped so starts fresh ranks when it is used again."""
    errors = []
    for cluster in list(_LIVE):
        try:  # a busy or broken cluster does not leave the others running
            cluster.shutdown()
        except Exception as exc:
            errors.append(exc)
    if errors:
        raise errors[0]


class Cluster:
    """A persistent pool of ``world_size`` ranks with torch.distributed initialised.

    Introduced in 00_launcher_tour::

        with Cluster(world_size=4) as cluster:
            cluster.run("dist.get_rank()")      # -> [0, 1, 2, 3]
            cluster.run(train, lr=0.1)          # functions from notebook cells work

    Names defined by ``run`` persist on the ranks until ``restart()``. ``rank``, ``world_size``,
    ``local_rank`` and ``device`` are predefined on every rank.
    """

    def __init__(self, world_size=2, backend="auto", timeout=60, *, _group=True):
        if sys.platform == "win32":
            raise RuntimeError("native Windows is not supported: the engine hands its ranks pipes by file "
                               "descriptor, which Windows cannot do. Run the course in WSL 2 (make lab there).")
        self.serial = next(_SERIALS)  # which cluster this is, never reused (unlike id())
        self.backend = choose_backend(backend, world_size)
        self.requested_backend = backend
        self.world_size = world_size
        self.timeout = self._check_timeout(timeout)
        self._group = _group  # False: spawn()'s ranks, whose process group is the learner's business
        self._pg_timeout = self._pg_timeout_for(self.timeout)
        self._ranks = []
        self._run_id = 0
        self._generation = 0
        self._stack_id = 0
        self._finalizer = None
        self._held = []  # (rank, lines) printed by ranks that were since replaced
        self._done = {}  # run id -> {rank: (ok, value or error info)}
        self._live = None
        self._interrupted = False
        self._inbox = []  # messages other than results and progress, for the loop that waits for them
        self._sel = None  # selector over the live ranks' pipes (see _selector)
        self._next_poll = 0.0  # when to ask the OS again whether a rank exited
        self.pids = []
        self.started_at = None
        self.restarts = 0
        self._lock = threading.RLock()  # one call at a time: see _exclusive
        self._start()

    @contextlib.contextmanager
    def _exclusive(self, what):
        """One call at a time on a cluster: a second thread's call (a restart() while a cell runs) is
        refused with a clear error instead of breaking the running call's pipes."""
        if not self._lock.acquire(blocking=False):
            raise RuntimeError(f"{what}: this cluster is busy with a call from another thread. Wait for that "
                               "call to return (one call at a time per cluster), or use a Cluster of its own.")
        try:
            yield
        finally:
            self._lock.release()

    @staticmethod
    def _check_timeout(timeout):
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        return float(timeout)

    @staticmethod
    def _pg_timeout_for(timeout):
        """The backend's timeout: far above the cell's, so that gloo or NCCL never gives up first."""
        return PG_TIMEOUT_MIN_S if math.isinf(timeout) else max(PG_TIMEOUT_MIN_S, 4 * timeout)

    # -- life cycle --------------------------------------------------------------------
    def _start(self):
        self._forget_selector()
        self._ranks = _spawn(self.world_size, self.backend, self._pg_timeout, self._group)
        self._generation = 0
        self._finalizer = weakref.finalize(self, _shutdown, list(self._ranks), 1.0)
        _LIVE.add(self)
        self.started_at = time.time()
        ready, errors = {}, {}
        try:
            def started():
                for rk, msg in self._take_messages():
                    if msg[0] == "ready":
                        (ready if msg[2] else errors)[rk.rank] = msg[3]
                return len(ready) + len(errors) == self.world_size or any(
                    rk.dead and rk.rank not in ready for rk in self._ranks)

            self._pump_until(started, time.monotonic() + START_TIMEOUT_S)
        except BaseException:  # a stop (KeyboardInterrupt) while the ranks start: none may be left running
            self._forget_selector()
            self._finalizer.detach()
            _kill(self._ranks)
            self._ranks = []
            raise
        if len(ready) < self.world_size:
            out = {rk.rank: rk.take_lines() for rk in self._ranks}
            self._forget_selector()
            self._finalizer.detach()
            _kill(self._ranks)
            self._ranks = []
            lines = [f"  rank {r}: {e['type']}: {e['message']}" for r, e in sorted(errors.items())]
            for r, streams in sorted(out.items()):
                lines += [f"  [rank {r}] {line}" for line in streams["stderr"][-5:]]
            raise DistributedError(
                f"the {self.world_size} ranks did not start ({len(ready)} ready).", "\n".join(lines))
        self.pids = [ready[r]["pid"] for r in range(self.world_size)]
        _forkstart.start_second_server()  # once: the server that has torch._dynamo too (see _forkstart.LATER)

    def restart(self):
        """Replace every rank with a fresh one: all names defined on the ranks are gone."""
        with self._exclusive("restart()"):
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
        with self._exclusive("shutdown()"):
            _LIVE.discard(self)
            if self._ranks:
                self._forget_selector()
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
            return self.run_cell(code_or_fn, timeout=timeout, live=self._call_view())
        if not callable(code_or_fn):
            raise ValueError(f"run() takes a string of code or a function, got {type(code_or_fn).__name__}")
        return self._request(self._call_message(code_or_fn, args, kwargs), timeout, live=self._call_view())

    def _call_view(self):
        """A status line for a ``run()`` from the notebook (a checker's call): shown once the call has taken a
        second, blanked when it ends; none under nbval or outside a notebook kernel."""
        return None if CALL_VIEW is None or _under_nbval() else CALL_VIEW(self.world_size)

    def run_cell(self, source, filename="<ddp>", timeout=None, live=None, only_rank=None):
        """Run a cell's source on every rank (what ``%%ddp`` does); return the rank-ordered values.

        ``filename`` names the code in tracebacks ("Cell In[7]"); ``live`` is a status display with
        ``update(ranks, elapsed)`` and ``close()``; ``only_rank`` shows that rank's output only.
        A cell that does not parse raises ``CellSyntaxError`` before any rank runs."""
        __tracebackhide__ = True
        return self._request(self._code_message(source, filename), timeout, live=live, only_rank=only_rank)

    def push(self, **values):
        """Set names on every rank: ``cluster.push(lr=0.1, data=tensor)``."""
        blob = _dumps_named(values, "push")
        self._request(lambda run_id: ("push", run_id, blob), None)

    def pull(self, name):
        """The value of ``name`` on every rank, rank-ordered. NameError if a rank lacks it."""
        values = self._request(lambda run_id: ("pull", run_id, name), None)
        missing = [r for r, v in enumerate(values) if isinstance(v, type(_wire.MISSING))]
        if missing:
            raise NameError(f"name {name!r} is not defined on {plural(missing)}: define it in a %%ddp cell "
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
    def _call_message(fn, args, kwargs, with_rank=False):
        for i, a in enumerate(args):
            _dumps_named({f"argument {i} ({type(a).__name__})": a}, "run")
        _dumps_named(kwargs, "run")
        sources, rename = _sources_of(fn)
        try:
            blob = _wire.dumps((fn, args, kwargs), rename)
        except Exception as exc:
            raise ValueError(f"the function {getattr(fn, '__name__', fn)!r} cannot be sent to the ranks: "
                             f"{exc}. Create what it needs inside the function instead.") from None
        return lambda run_id: ("call", run_id, sources, blob, with_rank)

    # -- the loop ------------------------------------------------------------------------
    def _pump(self, wait):
        """Read whatever the ranks sent within ``wait`` seconds; keep results, progress and output."""
        sel = self._selector()
        if sel is None:
            time.sleep(wait)
            return
        poller, owner = sel
        try:
            events = poller.poll(wait * 1000)
        except InterruptedError:
            events = []
        for fd, _ in events:
            self._read(owner[fd], fd)
        now = time.monotonic()
        if now >= self._next_poll:  # a rank whose forked child holds its pipes gives no EOF: ask the OS
            self._next_poll = now + POLL_S
            for rk in self._ranks:
                if not rk.dead and rk.proc.poll() is not None:
                    self._read(rk, rk.res_r)
                    self._mark_dead(rk)

    def _selector(self):
        """(poll object, fd -> rank) over the live ranks' pipes, registered once (poll, not select.select:
        it fails above fd 1024); rebuilt after ranks start, die or stop. None when no rank is alive."""
        if self._sel is None:
            live = [rk for rk in self._ranks if not rk.dead]
            if not live:
                return None
            poller, owner = select.poll(), {}
            for rk in live:
                for fd in rk.fds():
                    poller.register(fd, select.POLLIN)
                    owner[fd] = rk
            self._sel = poller, owner
        return self._sel

    def _forget_selector(self):
        self._sel = None

    def _read(self, rk, fd):
        if fd != rk.res_r:
            if not rk.read_stream(fd) and fd in rk.closed:
                self._forget_selector()  # registered again without the closed fd
            return
        try:
            data = os.read(fd, 1 << 20)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._mark_dead(rk)  # the worker's end closed: it exited
            return
        for m in rk.frames.feed(data):
            if isinstance(m, _wire.Undecodable):  # a reply the notebook cannot load is that rank's error
                m = ("done", self._run_id, rk.rank, False, _undecodable_info(m.error))
            if m[0] == "progress":
                rk.progress = m[1:]  # (desc, i, total)
            elif m[0] == "done":  # kept per run, whichever loop happens to read it
                rk.drain_streams()  # what the rank wrote before it said so is in its pipes already
                self._done.setdefault(m[1], {}).setdefault(rk.rank, (m[3], m[4]))
            else:
                self._inbox.append((rk, m))

    def _mark_dead(self, rk):
        if rk.dead:
            return
        rk.dead = True
        self._forget_selector()
        rk.drain_streams(DRAIN_S, quiet=0.2)  # what it printed before it died is kept
        rk.flush_partial()

    def _take_messages(self):
        out, self._inbox = self._inbox, []
        return out

    def _pump_until(self, condition, deadline, step=0.05):
        """Pump until ``condition()`` is true or ``deadline`` (time.monotonic) passes; return whether it held.
        (A stop during these loops, which are the engine's own, only sets the flag: no nested recovery.)"""
        while True:
            if condition():
                return True
            if time.monotonic() >= deadline:
                return False
            self._pump(min(step, max(0.0, deadline - time.monotonic())))

    def _send_all(self, make):
        for rk in self._ranks:
            try:
                rk.send(make(self._run_id))
            except (BrokenPipeError, OSError):
                self._mark_dead(rk)

    @contextlib.contextmanager
    def _sigint_deferred(self):
        """While a request runs, a stop (SIGINT) only sets a flag that the loop checks: a frame half
        written to a rank's pipe would break it, and a second stop must not start a nested recovery."""
        self._interrupted = False
        if threading.get_ident() != threading.main_thread().ident:
            yield
            return

        def flag(signum, frame):
            self._interrupted = True

        old = _signal.signal(signal.SIGINT, flag)  # _signal: the same call without signal's enum wrapping
        try:
            yield
        finally:
            _signal.signal(signal.SIGINT, old if old is not None else signal.default_int_handler)

    def _request(self, make, timeout, live=None, only_rank=None):
        __tracebackhide__ = True
        timeout = self.timeout if timeout is None else self._check_timeout(timeout)
        with self._exclusive("a call"):
            return self._request_exclusive(make, timeout, live, only_rank)

    def _died_between_calls(self):
        """A rank that died while no call ran (a background thread's os._exit, the OOM killer) is reported
        as a death during a call is: its exit code and last output; the ranks are replaced, the call not run."""
        dead = [rk for rk in self._ranks if rk.proc.poll() is not None]
        for rk in dead:
            self._mark_dead(rk)  # reads what it printed last
        codes = {rk.rank: rk.proc.returncode for rk in dead}
        self._show(None)
        self._replace(start=self._group)
        return dead_error(codes, "It died between calls: this call did not run. The ranks were replaced with "
                                 "fresh ones; names you defined on them are gone.")

    def _printing(self):
        """The live ranks with something in a stream pipe now: one poll over every pipe, rather than reading
        each empty one to its EAGAIN (before and after every call, per rank)."""
        sel = self._selector()
        if sel is None:
            return set()
        poller, owner = sel
        return {owner[fd].rank for fd, _ in poller.poll(0) if fd != owner[fd].res_r}

    def _late_output(self):
        """What a rank printed after its last call had finished (a background thread, a child process):
        shown now, under a note, rather than as the output of the call that starts."""
        printing = self._printing()
        for rk in self._ranks:
            if rk.rank in printing:
                rk.drain_streams(0.2)
            rk.flush_partial()
            lines = rk.take_lines()
            for name in ("stdout", "stderr"):
                if lines[name]:
                    stream = getattr(sys, name)
                    stream.write(f"note: rank {rk.rank} printed this after its previous call had finished "
                                 "(a background thread or a child process):\n")
                    stream.write("".join(f"[rank {rk.rank}] {line}\n" for line in hide_cpp_frames(lines[name])))
                    stream.flush()

    def _request_exclusive(self, make, timeout, live, only_rank):
        __tracebackhide__ = True
        if not self._ranks:
            self._start()
        elif not self.alive:
            raise self._died_between_calls()
        else:
            self._late_output()
        with self._sigint_deferred():
            if self._group and self._pg_timeout < self._pg_timeout_for(timeout):  # a long --timeout: the
                if not self._rebuild_group(self._pg_timeout_for(timeout)):    # backend must not give up first
                    self._replace(start=True)  # a rank could not join the new group: fresh ranks, said so
                    print("note: the ranks could not rebuild their process group for the longer --timeout and "
                          "were replaced; names you defined on them are gone.", file=sys.stderr)
            for rk in self._ranks:  # the live status shows this cell's lines only
                rk.progress, rk.last_line = None, ""
            self._run_id += 1
            run_id = self._run_id
            self._done = {run_id: {}}
            results = self._done[run_id]
            self._live = live
            try:
                self._send_all(make)
                if self._interrupted:
                    raise KeyboardInterrupt
                t0 = time.monotonic()
                deadline, first_error, ranks, waiting = t0 + timeout, None, self._ranks, 0
                while True:  # the hot loop of every cell: written out, not through _pump_until
                    if first_error is None and len(results) and not all(ok for ok, _ in results.values()):
                        first_error = time.monotonic()
                    pending = [rk for rk in ranks if rk.rank not in results]
                    if not pending or any(rk.dead for rk in pending):
                        break
                    now = time.monotonic()
                    if first_error is not None and now - first_error > ERROR_GRACE_S:
                        # the report says which ranks raised after the first and which were still running: those
                        # left are asleep (waiting), seen twice in a row, not on their way to an error of their own
                        # (under load one took over 2 s: lesson 00's report named it "was running" once in CI)
                        # (no /proc to tell: the grace is ERROR_GRACE_S, as before)
                        waiting = waiting + 1 if all(_blocked(rk.proc.pid, unknown=True) for rk in pending) else 0
                        if waiting >= BLOCKED_SAMPLES or now - first_error > ERROR_GRACE_MAX_S:
                            break
                    if now >= deadline:
                        raise self._report("timeout", run_id, only_rank, timeout=timeout)
                    if self._interrupted:
                        raise KeyboardInterrupt
                    self._pump(min(0.05, deadline - now))
                    if live is not None:
                        live.update(ranks, time.monotonic() - t0)
                dead = [rk for rk in self._ranks if rk.dead and rk.rank not in results]
                if dead:
                    raise self._report("dead", run_id, only_rank, dead=dead)
            except KeyboardInterrupt:
                snapshot = dict(self._done.get(run_id, {}))
                running = [rk for rk in self._ranks if rk.rank not in snapshot and not rk.dead]
                stacks = self._stacks(running) if running else {}
                note = self._recover(run_id, interrupt=True)
                self._show(only_rank)
                raise interrupt_error(self.world_size, snapshot, stacks, note) from None
            finally:
                self._close_live()
            if any(not ok for ok, _ in results.values()) or len(results) < self.world_size:
                raise self._report("error", run_id, only_rank)
        self._show(only_rank)
        return [results[r][1] for r in range(self.world_size)]

    def _close_live(self):
        live, self._live = self._live, None
        if live is not None:
            live.close()

    def _show(self, only_rank):
        """Print every rank's output, grouped in rank order, so the stored output is deterministic."""
        self._close_live()
        printing = self._printing()   # a dead rank's pipes were read when it was found dead
        for rk in self._ranks:
            if rk.rank in printing:
                rk.drain_streams()
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
                    stream.write("".join(f"[rank {rank}] {line}\n" for line in hide_cpp_frames(lines[name])))
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

        def answered():
            for rk, msg in self._take_messages():
                if msg[0] == "stacks" and msg[1] == sid:
                    got[rk.rank] = msg[3]
            return len(got) >= len(ranks)

        self._pump_until(answered, time.monotonic() + 2)
        return got

    def _rebuild_group(self, pg_timeout=None):
        """A new process group on the same ranks (names kept); False if a rank failed to join it."""
        self._generation += 1
        gen = self._generation
        if pg_timeout is not None:
            self._pg_timeout = pg_timeout
        self._run_id += 1
        reset_id = self._run_id
        done = self._done.setdefault(reset_id, {})
        self._send_all(lambda rid: ("reset", rid, gen, self._pg_timeout))
        self._pump_until(lambda: any(rk.dead for rk in self._ranks)
                         or all(rk.rank in done for rk in self._ranks), time.monotonic() + 30)
        return all(rk.rank in done and done[rk.rank][0] for rk in self._ranks)

    def _recover(self, run_id, interrupt=False):
        """Release every rank and rebuild the process group; replace the ranks if that fails.

        Returns a note for the error message."""
        results = self._done.setdefault(run_id, {})
        live = [rk for rk in self._ranks if not rk.dead]
        for rk in live:
            try:
                rk.send(("abort",))  # idle ranks drop their connections: peers stuck on them error out
            except OSError:
                self._mark_dead(rk)
        for rk in live:
            if rk.rank not in results and rk.proc.poll() is None:
                try:
                    os.kill(rk.proc.pid, signal.SIGINT)  # Python loops and sleeps stop here
                except OSError:
                    pass
        if not self._group:  # spawn(): one-shot ranks; stop them all, as torch.multiprocessing.spawn does
            self._pump_until(lambda: all(rk.rank in results for rk in self._ranks),
                             time.monotonic() + 1.0)
            self._replace(start=False)
            return "The other ranks were stopped."
        deadline = time.monotonic() + RELEASE_S
        while True:
            released = lambda: all(rk.rank in results for rk in self._ranks) or any(rk.dead for rk in self._ranks)
            if self._pump_until(released, min(deadline, time.monotonic() + REABORT_S)) or time.monotonic() >= deadline:
                break
            for rk in self._ranks:  # a rank that reached its collective after the abort (a loaded machine) has
                if rk.rank not in results and not rk.dead:  # opened connections since: cut those too
                    try:
                        rk.send(("abort",))
                    except OSError:
                        self._mark_dead(rk)
        if all(rk.rank in results for rk in self._ranks) and self._rebuild_group():
            return "The ranks were released and the process group rebuilt; names you defined are kept."
        self._replace(start=not interrupt)  # after an interrupt, start lazily: the cell returns now
        return "The ranks were replaced with fresh ones; names you defined on them are gone."

    # -- errors ------------------------------------------------------------------------
    def _report(self, kind, run_id, only_rank, timeout=None, dead=()):
        """Snapshot, stacks of the ranks still running, recovery, output, then the report."""
        __tracebackhide__ = True
        if kind == "dead":
            alive = [rk for rk in self._ranks if not rk.dead]
            deadline = time.monotonic() + DEAD_TOGETHER_S  # ranks that die together are named together
            blocked = 0  # a rank on its way out runs (or waits for a core); one asleep or waiting is staying
            while alive and time.monotonic() < deadline and blocked < BLOCKED_SAMPLES:
                for rk in alive:
                    if rk.proc.poll() is not None or _exited(rk.proc.pid):
                        self._mark_dead(rk)
                alive = [rk for rk in alive if not rk.dead]
                blocked = blocked + 1 if all(_blocked(rk.proc.pid) for rk in alive) else 0
                time.sleep(0.05)
            dead = [rk for rk in self._ranks if rk.dead and rk.rank not in self._done.get(run_id, {})]
            for rk in dead:
                try:
                    rk.proc.wait(timeout=EXIT_CODE_S)
                except subprocess.TimeoutExpired:
                    rk.proc.kill()
                    try:  # never a wait without a deadline here: SIGINT is deferred, and a wedged fork server
                        rk.proc.wait(timeout=EXIT_CODE_S)  # (which reaps the ranks) would hang the stop button
                    except subprocess.TimeoutExpired:
                        pass  # its exit code stays unknown (None)
            codes = {rk.rank: rk.proc.returncode for rk in dead}
            self._show(only_rank)
            self._replace(start=self._group)
            note = ("The ranks were replaced with fresh ones; names you defined on them are gone." if self._group
                    else "The other ranks were stopped.")
            return dead_error(codes, note)
        results = dict(self._done.get(run_id, {}))  # one moment: what had finished when the report began
        running = [rk for rk in self._ranks if rk.rank not in results and not rk.dead]
        stacks = self._stacks(running) if running else {}
        note = self._recover(run_id)
        self._show(only_rank)
        if kind == "timeout":
            return timeout_error(self.world_size, results, stacks, timeout, note, backend=self.backend)
        return rank_error(self.world_size, results, stacks, note)


def _task_states(pid):
    """The state letter of each thread of ``pid`` in /proc (S asleep, R running, Z zombie, ...): [] once the
    process is gone, None where /proc cannot tell."""
    if not os.path.isdir("/proc/self/task"):
        return None
    try:
        states = []
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/stat") as f:
                states.append(f.read().rsplit(")", 1)[1].split()[0])
        return states
    except FileNotFoundError:
        return []
    except (OSError, IndexError):
        return None


def _exited(pid):
    """The process has exited, as /proc shows it (every thread a zombie, or gone), before its parent reaps it.
    A forked rank's parent is the fork server, which reports the exit code only once it has reaped it: at load,
    seconds later (CI: 1 run in 8, and 10 of 20 here beside two busy loops, named only the first of two ranks
    that died together, because the second's exit was not yet reported; this, with the wait of EXIT_CODE_S
    for the code, made it 20 of 20). False where there is no /proc."""
    states = _task_states(pid)
    return states is not None and all(state in ("Z", "X") for state in states)


def _blocked(pid, unknown=False):
    """Every thread of ``pid`` asleep (waiting on a peer, a pipe, a timer) or stopped: none is running or
    waiting for a core, as a rank that is about to exit is. A zombie thread (Z, X) is a process on its way
    out, not a rank waiting (_exited tells those apart). False once the process is gone; ``unknown`` where
    /proc cannot tell."""
    states = _task_states(pid)
    if states is None:
        return unknown
    return bool(states) and all(state in ("S", "T", "t") for state in states)


def _undecodable_info(error):
    return {"type": type(error).__name__,
            "message": f"the rank's reply could not be loaded in the notebook: {error}",
            "traceback": f"{type(error).__name__}: {error}\n", "where": "", "time": time.time()}


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



def spawn(fn, args=(), nprocs=1, join=True, daemon=False, start_method="spawn", *, timeout=None, backend="auto"):
    """``torch.multiprocessing.spawn`` for notebooks: run ``fn(rank, *args)`` on ``nprocs`` fresh ranks.

    Introduced in 00_launcher_tour. No process group is set up: ``fn`` calls ``init_process_group``
    itself, as the tutorials' code does, with ``MASTER_ADDR``/``MASTER_PORT`` preset to a free loopback
    port (``fn`` may set its own). Functions from notebook cells are sent by value; output is relayed
    per rank; a failure raises ``DistributedError`` and stops the other ranks. Returns the ranks'
    return values in rank order. ``timeout`` (seconds, default none, like ``mp.spawn``) turns a hang
    into ``DistributedTimeout``. ``daemon`` and ``start_method`` are accepted for compatibility: the
    ranks are always new processes (see Cluster) that end with the call.
    """
    __tracebackhide__ = True
    if not join:
        raise ValueError("spawn(join=False) is not supported: the notebook waits for the ranks. Use join=True.")
    if start_method not in ("spawn", "forkserver", "fork"):
        raise ValueError(f"unknown start_method {start_method!r}")
    if not callable(fn):
        raise ValueError(f"spawn() takes a function, got {type(fn).__name__}")
    if not isinstance(args, tuple):
        raise ValueError(f"args must be a tuple (as for torch.multiprocessing.spawn), got {type(args).__name__}")
    cluster = Cluster(world_size=nprocs, backend=backend, timeout=math.inf if timeout is None else timeout,
                      _group=False)
    try:
        return cluster._request(cluster._call_message(fn, args, {}, with_rank=True), None)
    finally:
        cluster.shutdown()
