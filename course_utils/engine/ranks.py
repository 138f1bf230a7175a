"""The ranks' processes, and the notebook's end of each: its command, result and output pipes.

Each rank is forked from the fork server (course_utils.engine._forkstart) or is a fresh interpreter; each leads its
own process group, so that what it starts ends with it. Used by the launcher's Cluster.
"""
import collections
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time

from course_utils.engine import _forkstart, _wire
from course_utils.engine._forkstart import _sigint_held
from course_utils.engine.env import _cpu_count
from course_utils.engine.reports import SERVER_GONE

LIVE_LINES = 3         # the last whole lines of each rank that the live view shows
DONE_DRAIN_S = 1.0     # how long the pipes of a rank that said "done" are read (a background thread may never stop)


def read_fd(fd):
    """What a non-blocking pipe holds now: bytes, b"" at EOF (or on an error: the other end is gone), None when
    it is empty."""
    try:
        return os.read(fd, 1 << 20)
    except (BlockingIOError, InterruptedError):
        return None
    except OSError:
        return b""


class _Rank:
    """The notebook's end of one worker: its process, its command and result pipes, and the pipes
    that carry its stdout and stderr (fd level, so C and C++ output arrives too)."""

    def __init__(self, rank, proc, cmd_w, res_r, out_r, err_r):
        self.rank, self.proc = rank, proc
        self.cmd_w, self.res_r = cmd_w, res_r
        self.outbox = bytearray()  # commands not yet written: the pipe was full (the rank is not reading)
        self.streams = {out_r: "stdout", err_r: "stderr"}
        self.frames = _wire.FrameReader()
        self.partial = {"stdout": b"", "stderr": b""}
        self.lines = []  # (stream name, line) in the order they arrived: each rank's output is shown in that order
        self.closed = set()  # stream fds at EOF (the rank closed or redirected its fd 1 or 2): never polled again
        self.recent = collections.deque(maxlen=LIVE_LINES)  # the last whole lines, for the live view
        self.progress = None
        self.dead = False
        self.died_at = None  # time.time() when the notebook saw it dead: the death's time in a report

    def fds(self):
        return [self.res_r, *(fd for fd in self.streams if fd not in self.closed)]

    def send(self, msg):
        """Queue a command and write what the pipe takes now; never blocks (a rank whose threads are all held
        reads nothing): the loop writes the rest as the pipe drains (flush). Raises OSError once the rank is gone."""
        self.outbox += _wire.dump(msg)
        self.flush()

    def flush(self):
        while self.outbox:
            try:
                n = os.write(self.cmd_w, self.outbox)
            except (BlockingIOError, InterruptedError):
                return
            del self.outbox[:n]

    def feed_stream(self, name, data):
        *whole, rest = (self.partial[name] + data).split(b"\n")
        for line in whole:
            self._add_line(name, line)
        self.partial[name] = rest

    def read_stream(self, fd):
        """Read what is in one stream pipe now; False when nothing was (empty, or at EOF: the rank closed or
        redirected the fd, as os.dup2(devnull, 1) does, and it is never polled again: POLLHUP would spin)."""
        data = read_fd(fd)
        if data is None:
            return False
        if not data:
            self.closed.add(fd)
            return False
        self.feed_stream(self.streams[fd], data)
        return True

    def drain_streams(self, seconds=DONE_DRAIN_S, quiet=0.0):
        """Read the stream pipes until they are empty, for at most ``seconds`` (a background thread may print
        without end); once the rank said "done", all it wrote before (it flushes first) is in the pipes. For a dead
        rank, ``quiet``: read until a pipe is at EOF or silent that long (a child it started may still write)."""
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
        self.lines.append((name, text))
        self.recent.append(text)

    def flush_partial(self):
        for name, rest in self.partial.items():
            if rest:
                self._add_line(name, rest)
                self.partial[name] = b""

    def take_lines(self):
        out, self.lines = self.lines, []
        return out

    def close(self):
        for fd in (self.cmd_w, self.res_r, *self.streams):  # also the streams already at EOF
            with contextlib.suppress(OSError):
                os.close(fd)


def _loopback_interface(platform, env):
    """The interface gloo binds the ranks to: Linux's loopback is ``lo``; macOS and the BSDs call it
    ``lo0`` (a GLOO_SOCKET_IFNAME the learner set is kept there)."""
    return "lo" if platform.startswith("linux") else env.get("GLOO_SOCKET_IFNAME", "lo0")


def _spawn(world_size, backend, pg_timeout, group=True):
    """Start the ranks, whose rendezvous socket is bound before anyone uses it. With ``group=False`` (``spawn``)
    the learner's function sets the group up from MASTER_ADDR and MASTER_PORT, a loopback port free a moment ago."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))  # loopback only, and the port is ours from this moment
    listener.listen(128)
    port = listener.getsockname()[1]
    threads = max(1, _cpu_count() // world_size)
    ranks = []
    try:
        for r in range(world_size):
            ranks.append(_start_rank(r, world_size, backend, pg_timeout, group, port, threads,
                                     listener.fileno() if r == 0 and group else None))
    except BaseException:
        _kill(ranks)
        raise
    finally:
        listener.close()
    return ranks


def _start_rank(r, world_size, backend, pg_timeout, group, port, threads, listen_fd):
    """One rank and the notebook's ends of its pipes (a _Rank); on any failure nothing of it is left open."""
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
    fds = {"stdout": out_w, "stderr": err_w, "cmd": cmd_r, "res": res_w}
    if listen_fd is not None:
        env["COURSE_UTILS_LISTEN_FD"] = str(listen_fd)
        fds["listen"] = listen_fd
    rank = None
    try:
        # a stop while the server forks the rank leaves it nothing to read: its closed pipes end it
        proc = _forkstart.start_rank(env, fds, threads)  # a fraction of a second; None: no server
        if proc is not None:
            rank = _Rank(r, proc, cmd_w, res_r, out_r, err_r)
        else:
            with _sigint_held():  # a stop while Popen waits for the exec acts once the rank is recorded
                proc = subprocess.Popen(  # imported, never run as __main__ (cells' code is what goes by value)
                    [sys.executable, "-c", "from course_utils.engine import _worker; _worker.fresh_main()"],
                    env=env, pass_fds=[fd for name, fd in fds.items() if name not in ("stdout", "stderr")],
                    stdin=subprocess.DEVNULL, stdout=out_w, stderr=err_w, start_new_session=True)
                rank = _Rank(r, proc, cmd_w, res_r, out_r, err_r)
    except BaseException:
        if rank is None:
            for fd in (cmd_w, res_r, out_r, err_r):
                os.close(fd)
        else:
            _kill([rank])
        raise
    finally:
        for fd in (cmd_r, res_w, out_w, err_w):
            os.close(fd)
    for fd in (cmd_w, res_r, out_r, err_r):
        os.set_blocking(fd, False)
    return rank


def _exit_of(proc):
    """What a dead rank's report says of its end: its exit code, or SERVER_GONE when its fork server ended first."""
    return SERVER_GONE if getattr(proc, "server_gone", False) else proc.returncode


def _kill_group(proc):
    """SIGKILL a rank's process group (the rank leads it: what it started goes too), never another process: once
    the rank is reaped its pid may be reused, so the group is then signalled only if no process has that pid and
    the group still has members (the rank's leftovers)."""
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
            with contextlib.suppress(OSError):
                proc.kill()


def _kill(ranks):
    """Kill the ranks and whatever they started (each rank leads its own process group)."""
    for rk in ranks:
        _kill_group(rk.proc)
    for rk in ranks:
        with contextlib.suppress(subprocess.TimeoutExpired):
            rk.proc.wait(timeout=5)
        rk.close()


def _shutdown(ranks, wait_s=2.0):
    """Ask every rank to end as a script does (its atexit handlers, its open files flushed), wait up to
    ``wait_s``, then kill what is left. Also what a Cluster's finalizer does when the notebook's kernel exits."""
    for rk in ranks:
        with contextlib.suppress(OSError):
            rk.send(("shutdown",))
    deadline = time.monotonic() + wait_s
    for rk in ranks:
        with contextlib.suppress(subprocess.TimeoutExpired):
            rk.proc.wait(timeout=max(0.01, deadline - time.monotonic()))
    _kill(ranks)
