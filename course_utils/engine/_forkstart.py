"""Ranks forked from a per-process fork server that has torch imported already (issue 16).

The server is multiprocessing's own forkserver: a fresh interpreter, started once per notebook
kernel, that imports torch, torch.distributed and the engine's worker module, and never
initialises CUDA or runs parallel work. A rank forked from it starts in a fraction of a second
instead of paying ``import torch`` again. Per-rank settings that libraries read when they load
(the OpenMP thread count) are applied after the fork, with ``torch.set_num_threads``.

Two servers (issue 41). A, started first, serves at once with torch imported. Once a cluster has started, A forks
B (an ordinary process of A's), which imports what ranks would otherwise import at their first optimizer or DDP
(``LATER``: torch._dynamo) while A goes on forking and reaping; from the moment B says it is ready, new ranks are
forked from B. Each server reaps its own children and reports their exit codes at once: neither ever imports on
the thread that serves forks.

``COURSE_UTILS_START=spawn`` starts every rank as a fresh interpreter instead (the fallback the
engine also takes, with a note, when the server cannot start).
"""
import contextlib
import multiprocessing
import os
import subprocess
import sys
import threading

# torch.distributed.nn before any rank has a process group: imported later (by torch._dynamo, which the
# first optimizer or DDP imports), its `group=group.WORLD` default arguments capture the live group and keep
# it, and its gloo threads, alive after destroy_process_group() (see scripts/train_micro_ddp.py's setup()).
PRELOAD = ["torch", "torch.distributed", "torch.distributed.distributed_c10d", "torch.distributed.nn",
           "cloudpickle",
           "course_utils.engine._wire", "course_utils.engine._worker", "course_utils.engine._forkstart"]
# Imported by a second server (B), never by the first (A): B is forked from A once a cluster has started, imports
# these while A goes on forking and reaping, and serves every rank asked for once it says it is ready. A rank forked
# from B has them for free (each rank's first optimizer or DDP would pay for them); one forked from A imports them
# when its code first needs them. A never imports on the thread that serves forks: while it imported, it neither
# forked nor reaped (issue 41: a dead rank's exit code came 5-7 s late, a new cluster waited seconds).
LATER = ["torch._dynamo"]
# Environment variables that torch._dynamo (and what it imports) reads when it is imported: a rank whose
# environment differs from B's in one of them is forked from A, so that it reads its own when it imports them.
LATER_READS = ("TORCHDYNAMO_", "TORCHINDUCTOR_", "TORCH_COMPILE_", "TORCH_LOGS", "PYTORCH_")

_SERVER_OF = "COURSE_UTILS_FORK_SERVER_OF"
_lock = threading.RLock()


def _end_with_the_parent(parent):
    """In a fork server: end when its parent (the notebook process for A, A for B) does, even if a child of the
    notebook still holds the pipe that multiprocessing watches; the ranks then see their parent gone and end too."""
    import time

    def watch():
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watch, name="course_utils-server-watchdog", daemon=True).start()


if os.environ.get(_SERVER_OF) and multiprocessing.parent_process() is None and os.getppid() == int(
        os.environ[_SERVER_OF]):
    _end_with_the_parent(int(os.environ.pop(_SERVER_OF)))
    import gc

    # In the server, after the preload (this module comes last): its ~280k objects (torch) are never
    # collected in the ranks, so their gc passes stay cheap and touch none of the shared pages.
    gc.freeze()
_state = {"ctx": None, "failed": None, "noted": False, "restarted": False,
          "b": None}  # the second server: {"address", "alive_w", "ready_r", "process", "env", "ready"}


@contextlib.contextmanager
def _sigint_ignored():
    """Jupyter's stop button signals the kernel's whole process group, and the server is in it: a
    server started with SIGINT ignored keeps ignoring it (Python installs its own handler only over
    the default one), also while it imports torch, so an early stop cannot kill it."""
    import signal

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


def _ensure_running():
    from multiprocessing import forkserver

    os.environ[_SERVER_OF] = str(os.getpid())  # read by this module, imported in the server
    try:
        with _sigint_ignored():
            forkserver.ensure_running()  # (re)starts it if needed; imports happen in the server, in the background
    finally:
        os.environ.pop(_SERVER_OF, None)


def wanted():
    """Fork server unless COURSE_UTILS_START=spawn; off Linux only with COURSE_UTILS_START=forkserver
    (macOS's system libraries are not fork-safe once loaded, which is why its multiprocessing spawns)."""
    default = "forkserver" if sys.platform.startswith("linux") else "spawn"
    return os.environ.get("COURSE_UTILS_START", default).strip().lower() == "forkserver"


def context():
    """The forkserver context with torch preloaded, started on first use; None: use fresh interpreters."""
    if not wanted():
        return None
    with _lock:
        if _state["ctx"] is None and _state["failed"] is None:
            try:
                if "forkserver" not in multiprocessing.get_all_start_methods():
                    raise OSError("this system has no forkserver start method")
                ctx = multiprocessing.get_context("forkserver")
                ctx.set_forkserver_preload(PRELOAD)
                _ensure_running()
                _state["ctx"] = ctx
            except Exception as exc:  # an unusual platform: fresh interpreters, said once
                _state["failed"] = f"could not start ({type(exc).__name__}: {exc})"
        if _state["failed"] is not None and not _state["noted"]:
            _state["noted"] = True
            print(f"note: the ranks start as fresh interpreters from now on (slower): the fork server "
                  f"{_state['failed']}.", file=sys.stderr)
        return _state["ctx"]


def prestart():
    """Start the server now, so that the first cluster does not wait for torch to import."""
    try:
        context()
    except Exception:
        pass


def restart(reason):
    """The server failed to fork a rank (it died, e.g. killed): start a new one, once per process, and
    return its context; after that, or if the restart fails, fall back to fresh interpreters (None)."""
    with _lock:
        _drop_second_server()
        if _state["ctx"] is not None and not _state["restarted"]:
            _state["restarted"] = True
            try:
                _reap_dying_server()
                _ensure_running()
                return _state["ctx"]
            except Exception as exc:
                reason = f"{reason}; a new one did not start either ({type(exc).__name__}: {exc})"
        _state["ctx"], _state["failed"] = None, f"it stopped ({reason})"
    return context()


def _reap_dying_server(wait_s=2.0):
    """Before a restart: reap the server that failed a fork if it is dying. A killed server with threads (its
    watchdog) shows as a zombie before its last thread has exited, and until then waitpid(WNOHANG) returns 0:
    multiprocessing's ensure_running then takes it for alive, keeps its dead address, and the retried fork fails
    too (CI saw "EOFError: unexpected EOF" and a fallback after one death). A server still alive after ``wait_s``
    is left to ensure_running, which keeps it: killing it would end the ranks of other clusters."""
    import time
    from multiprocessing import forkserver

    server = forkserver._forkserver
    pid = getattr(server, "_forkserver_pid", None)
    if pid is None:
        return
    deadline = time.monotonic() + wait_s
    while True:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            done = pid  # reaped already (not by multiprocessing): forget it all the same
        if done:
            break
        if time.monotonic() > deadline:
            return
        time.sleep(0.01)
    # what ensure_running does for a server it finds dead, without its waitpid (this one is reaped now)
    if getattr(server, "_forkserver_alive_fd", None) is not None:
        with contextlib.suppress(OSError):
            os.close(server._forkserver_alive_fd)
    server._forkserver_address = server._forkserver_alive_fd = server._forkserver_pid = None


def _serve_b(listener, alive_r, ready_w, env, later):
    """Server B, a process forked by A: import ``later`` (LATER) with the notebook's environment of the moment, say
    so on ``ready_w``, then serve forks as multiprocessing's forkserver does (its own loop: forks, reaps its children,
    writes their exit codes). It ends when the notebook closes ``alive_r``'s other end or when A ends."""
    import gc

    from multiprocessing import forkserver

    os.environ.clear()
    os.environ.update(env)
    _end_with_the_parent(os.getppid())
    for name in later:
        try:
            __import__(name)
        except ImportError:
            pass
    gc.freeze()  # as A does after its preload
    os.write(ready_w, b"1")
    os.close(ready_w)
    forkserver.main(listener, alive_r, [])


def _later_env(env):
    return {k: v for k, v in env.items() if k.startswith(LATER_READS)}


def start_second_server():
    """Once a cluster has started from A: fork server B from A (milliseconds), which imports LATER on its own while
    A keeps serving. Does nothing when B runs already, when the ranks are fresh interpreters, or when it fails."""
    import socket
    from multiprocessing import connection, util

    with _lock:
        ctx = _state["ctx"]
        if ctx is None or _state["b"] is not None:
            return
        fds = []
        try:
            address = connection.arbitrary_address("AF_UNIX")
            with socket.socket(socket.AF_UNIX) as listener:
                listener.bind(address)
                if not util.is_abstract_socket_namespace(address):
                    os.chmod(address, 0o600)
                listener.listen()
                alive_r, alive_w = os.pipe()
                ready_r, ready_w = os.pipe()
                fds = [alive_r, alive_w, ready_r, ready_w]
                env = dict(os.environ)
                process = ctx.Process(target=_serve_b, name="course_utils fork server B", daemon=True,
                                      args=(_Fd(listener.fileno()), _Fd(alive_r), _Fd(ready_w), env, list(LATER)))
                with _without_main():
                    process.start()  # through A: the globals of multiprocessing's forkserver point at A here
            for fd in (alive_r, ready_w):
                os.close(fd)
            os.set_blocking(ready_r, False)
            _state["b"] = {"address": address, "alive_w": alive_w, "ready_r": ready_r, "process": process,
                           "env": _later_env(env), "ready": False}
        except Exception:  # B is an optimisation: A serves every rank without it
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)


def second_server_ready():
    """Whether B has imported LATER and serves (it said so on its pipe). Call with _lock held or from tests."""
    b = _state["b"]
    if b is None:
        return False
    if not b["ready"]:
        try:
            b["ready"] = os.read(b["ready_r"], 1) == b"1"
        except BlockingIOError:
            return False
        except OSError:
            return False
    return b["ready"]


def _drop_second_server():
    """Forget B (dead, or its requests failed); closing its alive pipe ends it if it still runs."""
    b, _state["b"] = _state["b"], None
    if b is not None:
        for fd in (b["alive_w"], b["ready_r"]):
            with contextlib.suppress(OSError):
                os.close(fd)


@contextlib.contextmanager
def _served_by(env):
    """While a rank starts: multiprocessing's forkserver globals point at B when B is ready and ``env`` agrees with
    B's in what LATER reads, else at A (as they are the rest of the time: ensure_running checks A)."""
    from multiprocessing import forkserver

    server = forkserver._forkserver
    b = _state["b"]
    if b is None or not second_server_ready() or _later_env(env) != b["env"] or b["process"].exitcode is not None:
        yield "A"
        return
    a = (server._forkserver_address, server._forkserver_alive_fd)
    server._forkserver_address, server._forkserver_alive_fd = b["address"], b["alive_w"]
    try:
        yield "B"
    finally:
        server._forkserver_address, server._forkserver_alive_fd = a


def stop():
    """End the fork server (the extension's unload does, after the clusters are shut down): the next
    cluster starts a new one, which reads the environment and the installed packages afresh."""
    from multiprocessing import forkserver

    with _lock:
        _drop_second_server()
        server = forkserver._forkserver
        try:
            if getattr(server, "_forkserver_pid", None) is not None:
                server._stop()  # private, as multiprocessing's own tests use it: closes the pipe, waits
        except Exception:
            pass
        _state.update(ctx=None, failed=None, noted=False, restarted=False)


class _Fd:
    """A file descriptor that travels to the forked rank (multiprocessing passes it over a Unix socket)."""

    def __init__(self, fd):
        self.fd = fd

    def __reduce__(self):
        from multiprocessing import reduction

        return _detach, (reduction.DupFd(self.fd),)


def _detach(dup):
    return dup.detach()


@contextlib.contextmanager
def _without_main():
    """multiprocessing makes a child import the parent's main script (as __mp_main__), which would
    run a learner's script, or pytest, once more on every rank: the ranks get no main module."""
    from multiprocessing import spawn

    original = spawn.get_preparation_data

    def preparation_data(name):
        return {k: v for k, v in original(name).items() if not k.startswith("init_main_from")}

    spawn.get_preparation_data = preparation_data
    try:
        yield
    finally:
        spawn.get_preparation_data = original


class ForkedProcess:
    """A rank forked by the server, with the part of ``subprocess.Popen``'s interface the launcher uses."""

    def __init__(self, ctx, env, fds, threads):
        """``fds``: name -> this process's fd (stdout, stderr, cmd, res and maybe listen)."""
        args = (env, {k: _Fd(v) for k, v in fds.items()}, threads)
        # daemon: mp ends it at exit
        process = lambda: ctx.Process(target=_rank_main, args=args, name=f"rank {env['RANK']}", daemon=True)  # noqa: E731
        with _lock, _without_main():
            with _served_by(env) as server:
                self._p = process()
                try:
                    self._p.start()
                except Exception:
                    if server != "B":
                        raise
                    _drop_second_server()  # B is gone: A serves, as before B was ready
                    self._p = process()
                    self._p.start()
        self.pid = self._p.pid
        self.returncode = None
        # /proc/PID/stat held open: a pread answers "alive?" in microseconds (an open/read/close is 8x that, and
        # the check runs per rank before every call), and the fd stays bound to this process, never to a later
        # one that reuses the pid (once the rank is reaped, a read fails with ESRCH).
        try:
            self._stat_fd = os.open(f"/proc/{self.pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            self._stat_fd = None  # no /proc (macOS): multiprocessing's exitcode alone

    def _stat(self):
        if self._stat_fd is None:
            return None
        try:
            return _stat_fields(os.pread(self._stat_fd, 4096, 0))
        except OSError:
            return None

    def _close_stat(self):
        fd, self._stat_fd = self._stat_fd, None
        if fd is not None:
            os.close(fd)

    def __del__(self):
        self._close_stat()

    def poll(self):
        """The exit code, or None while the rank lives. Called before every call (Cluster.alive): where /proc
        exists one pread of the held /proc/PID/stat answers for a live rank (multiprocessing's own check builds a
        selector each time, and the warm round trip is a millisecond)."""
        if self.returncode is None:
            fields = self._stat()
            if fields and fields[0] not in ("Z", "X"):
                return None  # running or asleep: alive
            code = self._p.exitcode
            if code is not None:
                self.returncode = code
                self._p.close()  # the sentinel's fd
            elif fields and fields[0] in ("Z", "X"):  # dead, not reaped yet: the kernel keeps the code till then
                self.returncode = zombie_exit_code(self.pid)
            if self.returncode is not None:
                self._close_stat()
        return self.returncode

    def wait(self, timeout=None):
        if self.returncode is None:
            self._p.join(timeout)
            if self.poll() is None:
                raise subprocess.TimeoutExpired(f"rank {self.pid}", timeout)
        return self.returncode

    def kill(self):
        if self.returncode is None:
            try:
                os.kill(self.pid, 9)
            except OSError:
                pass


def _proc_stat(pid):
    """The fields of /proc/PID/stat after the command's name (the first is field 3, the state), or None where that
    cannot be read (no /proc, or the process is gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return _stat_fields(f.read())
    except OSError:
        return None


def _stat_fields(raw):
    """The fields of a /proc/PID/stat text after the command's name (which may hold spaces and parentheses: it
    ends at the last ")"), or None when the text has no name (an empty read)."""
    _, paren, fields = raw.rpartition(b")")
    return fields.decode().split() if paren else None


def zombie_exit_code(pid):
    """The exit code of ``pid`` as Popen gives it (negative: the signal), read from /proc while the process is a
    zombie that its parent has not reaped yet: field 52 of /proc/PID/stat holds its wait status (Linux 3.5+).
    None while any of its threads runs, once it is reaped, or where there is no /proc. A rank's death is then
    reported with its code whatever its server is doing (issue 41: a server that imported reported it 6 s late)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    for task in tasks:
        state = (_proc_stat(f"{pid}/task/{task}") or ["?"])[0]
        if state not in ("Z", "X"):
            return None
    fields = _proc_stat(pid)  # fields[0] is field 3 (the state)
    if not tasks or not fields or fields[0] not in ("Z", "X") or len(fields) < 50:
        return None
    status = int(fields[49])
    return -(status & 0x7F) if status & 0x7F else (status >> 8) & 0xFF


def _rank_main(env, fds, threads):
    """In the forked rank: its own session, its pipes on fds 1 and 2, its environment, its share
    of the cores; then the same Worker that a fresh interpreter runs."""
    os.setsid()  # the launcher kills the rank's process group; Ctrl-C in a terminal does not reach it
    os.dup2(fds["stdout"], 1)
    os.dup2(fds["stderr"], 2)
    for name in ("stdout", "stderr"):
        os.close(fds[name])
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    sys.stdout = open(1, "w", buffering=1, encoding="utf-8", errors="backslashreplace", closefd=False)
    sys.stderr = open(2, "w", buffering=1, encoding="utf-8", errors="backslashreplace", closefd=False)
    sys.stdin = open(0, "r", closefd=False)
    env = dict(env, COURSE_UTILS_CMD_FD=str(fds["cmd"]), COURSE_UTILS_RES_FD=str(fds["res"]))
    if "listen" in fds:
        env["COURSE_UTILS_LISTEN_FD"] = str(fds["listen"])
    os.environ.clear()
    os.environ.update(env)
    cwd = env.get("COURSE_UTILS_CWD")
    if cwd:
        os.chdir(cwd)
        if cwd not in sys.path:
            sys.path.insert(0, cwd)
    multiprocessing.current_process().daemon = False  # the rank may start its own workers (DataLoader)
    import faulthandler

    import torch

    torch.set_num_threads(threads)  # OMP_NUM_THREADS is read when torch loads: too late here
    faulthandler.enable()
    from course_utils.engine import _worker

    _worker._die_with_parent(os.getppid())  # the server, which ends when the notebook process does
    _worker.run_rank()
