"""Ranks forked from the course's own fork server, which has torch imported already.

The server is a fresh interpreter, started once per notebook kernel (at ``%load_ext course_utils``), that imports
torch, torch.distributed and the engine's worker module, and never initialises CUDA or runs parallel work. A rank
forked from it starts in a fraction of a second instead of paying ``import torch`` again. Per-rank settings that
libraries read when they load (the OpenMP thread count) are applied after the fork, with ``torch.set_num_threads``.

The notebook and a server talk over a socketpair only the two of them hold (nothing listens): a request is JSON
(the rank's environment, the names of the fds attached with SCM_RIGHTS, its thread count), the reply the new pid;
nothing is unpickled. A server reaps its children at once (SIGCHLD) and writes each rank's exit code on the pipe
the notebook sent with the request.

Two servers. A, started first, serves at once with torch imported. Once a cluster has started, A forks B, which
imports ``LATER`` (torch._dynamo) while A goes on serving; once B says it is ready, new ranks fork from B. Neither
imports while it serves. Each ends when the notebook closes its socket or its parent ends; its ranks then end too.

``COURSE_UTILS_START=spawn`` starts every rank as a fresh interpreter instead (the fallback the engine also takes,
with a note, when the server cannot start or dies twice).
"""
import _signal
import contextlib
import itertools
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

# torch.distributed.nn before any rank has a process group: imported later (by torch._dynamo, which the
# first optimizer or DDP imports), its `group=group.WORLD` default arguments capture the live group and keep
# it, and its gloo threads, alive after destroy_process_group() (see scripts/train_micro_ddp.py's setup()).
PRELOAD = ["torch", "torch.distributed", "torch.distributed.distributed_c10d", "torch.distributed.nn",
           "cloudpickle", "course_utils.engine._wire", "course_utils.engine._worker"]
# Imported by the second server (B), never by the first (A), which never imports while it serves (a server that
# imports neither forks nor reaps). A rank forked from B has them for free; one forked from A imports them when its
# code first needs them.
LATER = ["torch._dynamo"]
# Environment variables that torch._dynamo (and what it imports) reads when it is imported: a rank whose
# environment differs from B's in one of them is forked from A, so that it reads its own when it imports them.
LATER_READS = ("TORCHDYNAMO_", "TORCHINDUCTOR_", "TORCH_COMPILE_", "TORCH_LOGS", "PYTORCH_")
REPLY_S = 120.0      # how long a fork may wait for the server's reply (the first waits while it imports torch)
WATCH_S = 0.5        # how often a server looks whether its parent is still there
_HEADER = struct.Struct("!I")
_REQUESTS = itertools.count(1)
_CODE = struct.Struct("!i")

_lock = threading.RLock()
_state = {"ctx": None, "failed": None, "noted": False, "restarted": False, "retired": [],
          "b": None}  # the second server: {"server", "env", "ready"}


# -- the wire: length-prefixed JSON, file descriptors attached to the first byte -----------------------------------
def _readable(fds, timeout):
    """The ones of ``fds`` (ints or sockets) with something to read (or EOF) within ``timeout`` seconds (None: no
    limit). poll, not select.select, which fails above fd 1024."""
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    ms = None if timeout is None else max(0, int(timeout * 1000))
    ready = {fd for fd, _ in poller.poll(ms)}
    return [fd for fd in fds if (fd if isinstance(fd, int) else fd.fileno()) in ready]


def _send(sock, obj, fds=()):
    data = json.dumps(obj).encode()
    data = _HEADER.pack(len(data)) + data
    sent = socket.send_fds(sock, [data], list(fds)) if fds else sock.send(data)
    if sent < len(data):
        sock.sendall(data[sent:])


def _recv_exactly(sock, n, deadline, fds):
    """``n`` bytes (and the fds that came with them, appended to ``fds``); None on EOF. Raises TimeoutError."""
    buf = b""
    while len(buf) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not _readable([sock], left):
                raise TimeoutError("the fork server did not answer")
        data, got, flags, _ = socket.recv_fds(sock, n - len(buf), 16)
        if flags & getattr(socket, "MSG_CTRUNC", 0):
            raise OSError("file descriptors were lost on the way from the fork server")
        fds.extend(got)
        if not data:
            return None
        buf += data
    return buf


def _recv(sock, timeout=None):
    """(message, fds), or (None, []) once the other end is closed."""
    deadline = None if timeout is None else time.monotonic() + timeout
    fds = []
    header = _recv_exactly(sock, _HEADER.size, deadline, fds)
    body = header and _recv_exactly(sock, _HEADER.unpack(header)[0], deadline, fds)
    if body is None:
        for fd in fds:
            os.close(fd)
        return None, []
    return json.loads(body), fds


# -- in a server ---------------------------------------------------------------------------------------------------
def serve(fd, parent, preload):
    """A server's main (A's, in a fresh interpreter the notebook started, on the notebook's sys.path): import
    ``preload``, then serve."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the stop button signals the kernel's whole process group
    _import_all(preload)
    import gc

    gc.freeze()  # its ~280k objects (torch) are never collected in the ranks: their gc passes touch no shared page
    _Server(socket.socket(fileno=fd), parent).loop()
    os._exit(0)


def _import_all(names):
    for name in names:
        with contextlib.suppress(ImportError):
            __import__(name)


class _Server:
    """The loop of a fork server: fork a rank or the second server when asked, reap children as they exit."""

    def __init__(self, sock, parent):
        self.sock, self.parent = sock, parent
        self.status = {}  # pid -> the write end of the pipe its exit code goes to

    def loop(self):
        wake_r, wake_w = os.pipe()
        for fd in (wake_r, wake_w):
            os.set_blocking(fd, False)
        self.wake = (wake_r, wake_w)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so that SIGCHLD wakes select
        while os.getppid() == self.parent:
            ready = _readable([self.sock, wake_r], WATCH_S)
            if wake_r in ready:
                with contextlib.suppress(OSError):
                    os.read(wake_r, 4096)
            self.reap()
            if self.sock in ready:
                message, fds = _recv(self.sock)
                if message is None:
                    return  # the notebook closed its end: the kernel is gone, or it stopped this server
                self.handle(message, fds)

    def reap(self):
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            fd = self.status.pop(pid, None)
            if fd is not None:  # B has none: A only reaps it
                with contextlib.suppress(OSError):
                    os.write(fd, _CODE.pack(os.waitstatus_to_exitcode(status)))
                os.close(fd)

    def in_child(self, keep=()):
        """After a fork, in the child: none of the server's descriptors or handlers."""
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        self.sock.close()
        for fd in [*self.wake, *self.status.values()]:
            if fd not in keep:
                with contextlib.suppress(OSError):
                    os.close(fd)

    def handle(self, message, fds):
        reply = {"id": message.get("id")}
        try:
            if message.get("op") == "fork":
                *given, status_w = fds
                pid = os.fork()
                if pid == 0:
                    try:
                        self.in_child(keep=given)
                        os.close(status_w)
                        signal.signal(signal.SIGINT, signal.default_int_handler)
                        _rank_main(message["env"], dict(zip(message["names"], given)), message["threads"])
                    finally:
                        os._exit(1)
                self.status[pid] = status_w
                fds = given
                _send(self.sock, dict(reply, pid=pid))
            elif message.get("op") == "second":
                mine, theirs = socket.socketpair()
                pid = os.fork()
                if pid == 0:
                    try:
                        self.in_child(keep=[mine.fileno()])
                        theirs.close()
                        _serve_b(mine, message["env"], message["later"])
                    finally:
                        os._exit(0)
                mine.close()
                _send(self.sock, dict(reply, pid=pid), [theirs.fileno()])
                theirs.close()
            else:
                _send(self.sock, dict(reply, error=f"unknown request {message.get('op')!r}"))
        except Exception as exc:  # a failed fork (EAGAIN, ENOMEM): the notebook says why and falls back
            with contextlib.suppress(OSError):
                _send(self.sock, dict(reply, error=f"{type(exc).__name__}: {exc}"))
        finally:
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)


def _serve_b(sock, env, later):
    """Server B, forked by A: import ``later`` with the notebook's environment of the moment, say so, then serve."""
    import gc

    os.environ.clear()
    os.environ.update(env)
    parent, importing = os.getppid(), threading.Event()
    importing.set()

    def watch():  # while it imports (seconds; the loop watches afterwards): end with A, which ends with the notebook
        while importing.is_set():
            if os.getppid() != parent:
                os._exit(0)
            time.sleep(0.1)

    watchdog = threading.Thread(target=watch, name="course_utils-server-watchdog", daemon=True)
    watchdog.start()
    _import_all(later)
    importing.clear()
    watchdog.join()  # no thread of its own is left when it forks
    gc.freeze()  # as A does after its preload
    _send(sock, {"ready": True})
    _Server(sock, parent).loop()


# -- in the notebook -----------------------------------------------------------------------------------------------
class Server:
    """The notebook's end of one server: its socket, its pid, and (A only) the process to reap."""

    def __init__(self, sock, pid, popen=None):
        self.sock, self.pid, self.popen = sock, pid, popen

    def ask(self, message, fds=(), timeout=REPLY_S):
        """Send a request, return (its reply, the fds that came with it). A reply to an earlier request that was
        never read (a stop landed between the two) is dropped, its fds closed: every request has its own id."""
        message = dict(message, id=next(_REQUESTS))
        deadline = time.monotonic() + timeout
        _send(self.sock, message, fds)
        while True:
            reply, got = _recv(self.sock, max(0.0, deadline - time.monotonic()))
            if reply is None:
                raise EOFError("the fork server is gone")
            if reply.get("id") == message["id"]:
                break
            for fd in got:
                os.close(fd)
        if "error" in reply:
            raise OSError(f"the fork server could not fork: {reply['error']}")
        return reply, got

    def close(self, wait_s=0.0):
        self.sock.close()  # the server reads EOF and ends
        if self.popen is not None:
            try:
                self.popen.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.popen.wait(timeout=1.0)


@contextlib.contextmanager
def _sigint_held(on_stop=None):
    """A stop (SIGINT) during the block does not interrupt it. Without ``on_stop`` it is handed, once the block
    ends, to the handler it would have reached (the default one raises KeyboardInterrupt): what the block started
    is then always recorded (and so cleaned up by the caller) before the stop acts. With ``on_stop``, each stop
    calls it instead (a request's loop sets its flag: a frame half written to a rank's pipe would break it, and a
    second stop must not start a nested recovery). Only on the main thread, where Python delivers signals."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    stopped = []
    old = _signal.signal(signal.SIGINT, lambda *_: on_stop() if on_stop else stopped.append(True))
    old = old if old is not None else signal.default_int_handler  # _signal: without signal's enum wrapping
    try:
        yield
    finally:
        _signal.signal(signal.SIGINT, old)
    if stopped and callable(old):  # delivered now to whoever was there: the default raises KeyboardInterrupt, a
        old(signal.SIGINT, None)   # request's handler sets its flag


def _ignore_sigint():
    """In the server's child before its exec: Jupyter's stop button signals the kernel's whole process group; a
    server started with SIGINT ignored keeps ignoring it, also while it imports torch."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _start_server():
    """Start A: a fresh interpreter with this process's path and environment; it imports PRELOAD in the background
    (the first fork request waits for that)."""
    mine, theirs = socket.socketpair()  # neither end is inherited by anything else this process starts
    # the notebook's sys.path, whole: python -c puts its working directory first, ahead of the venv's editable
    # course_utils (an import hook), so the server could import another checkout's engine than the notebook's
    code = ("import json, sys; args = json.loads(sys.argv[1]); sys.path[:] = args.pop('path'); "
            "from course_utils.engine._forkstart import serve; serve(**args)")
    args = {"fd": theirs.fileno(), "parent": os.getpid(), "path": sys.path, "preload": PRELOAD}
    try:
        popen = subprocess.Popen([sys.executable, *subprocess._args_from_interpreter_flags(), "-c", code,
                                  json.dumps(args)], pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
                                 preexec_fn=_ignore_sigint)
    except BaseException:
        mine.close()
        raise
    finally:
        theirs.close()
    return Server(mine, popen.pid, popen)


def _start_recorded():
    """Start a server and record it in _state; a stop pressed meanwhile acts once it is recorded (never lost:
    tests/test_engine_edges.py::test_the_stop_button_works_while_the_fork_server_imports_torch)."""
    with _sigint_held():
        _state["ctx"] = _start_server()
    return _state["ctx"]


def wanted():
    """Fork server unless COURSE_UTILS_START=spawn; off Linux only with COURSE_UTILS_START=forkserver
    (macOS's system libraries are not fork-safe once loaded, which is why its multiprocessing spawns)."""
    default = "forkserver" if sys.platform.startswith("linux") else "spawn"
    return os.environ.get("COURSE_UTILS_START", default).strip().lower() == "forkserver"


def context():
    """The first server (A), started on first use; None: use fresh interpreters."""
    if not wanted():
        return None
    with _lock:
        if _state["ctx"] is None and _state["failed"] is None:
            try:
                if not hasattr(os, "fork") or not hasattr(socket, "send_fds"):
                    raise OSError("this system cannot fork or pass file descriptors")
                _state["ctx"] = _start_recorded()
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
    return it; after that, or if the restart fails, fall back to fresh interpreters (None)."""
    with _lock:
        _drop_second_server()
        old = _state["ctx"]
        if old is not None and old.popen.poll() is None:
            _state["retired"].append(old)  # alive but failing: closing it would end other clusters' ranks
        elif old is not None:
            old.close()  # dead: reaped
        if old is not None and not _state["restarted"]:
            _state["restarted"] = True
            try:
                _state["ctx"] = _start_recorded()
                return _state["ctx"]
            except Exception as exc:
                reason = f"{reason}; a new one did not start either ({type(exc).__name__}: {exc})"
        _state["ctx"], _state["failed"] = None, f"it stopped ({reason})"
    return context()


def start_rank(env, fds, threads):
    """A rank forked from a server (a ForkedProcess), or None: start a fresh interpreter. A server that fails the
    fork (it died, or cannot fork) is replaced, once per process; a second failure falls back, with a note."""
    for _ in range(2):
        ctx = context()
        if ctx is None:
            return None
        try:
            return ForkedProcess(ctx, env, fds, threads)
        except Exception as exc:
            restart(f"{type(exc).__name__}: {exc}")
    return None


def _later_env(env):
    return {k: v for k, v in env.items() if k.startswith(LATER_READS)}


def start_second_server():
    """Once a cluster has started from A: ask A to fork server B (milliseconds), which imports LATER on its own
    while A keeps serving. Does nothing when B runs already, when the ranks are fresh interpreters, or when it fails."""
    with _lock:
        a = _state["ctx"]
        if a is None or _state["b"] is not None:
            return
        env = dict(os.environ)
        try:
            reply, fds = a.ask({"op": "second", "env": env, "later": list(LATER)}, timeout=10.0)
            (fd,) = fds
        except Exception:  # B is an optimisation: A serves every rank without it
            return
        sock = socket.socket(fileno=fd)
        sock.setblocking(True)
        _state["b"] = {"server": Server(sock, reply["pid"]), "env": _later_env(env), "ready": False}


def second_server_ready():
    """Whether B has imported LATER and serves (it said so on its socket). Call with _lock held or from tests."""
    b = _state["b"]
    if b is None:
        return False
    if not b["ready"]:
        sock = b["server"].sock
        try:
            if not _readable([sock], 0):
                return False
            message, _ = _recv(sock, timeout=1.0)
        except (OSError, ValueError):
            message = None
        if message is None:  # B ended before it was ready
            _drop_second_server()
            return False
        b["ready"] = bool(message.get("ready"))
    return b["ready"]


def _drop_second_server():
    """Forget B (dead, or its requests failed); closing its socket ends it if it still runs."""
    b, _state["b"] = _state["b"], None
    if b is not None:
        b["server"].close()


def _server_for(env):
    """B when it is ready and ``env`` agrees with B's in what LATER reads, else A."""
    b = _state["b"]
    if b is not None and second_server_ready() and _later_env(env) == b["env"]:
        return _state["b"]["server"]
    return _state["ctx"]


def stop():
    """End the fork servers (the extension's unload does, after the clusters are shut down): the next
    cluster starts a new one, which reads the environment and the installed packages afresh."""
    with _lock:
        _drop_second_server()
        for server in [_state["ctx"], *_state["retired"]]:
            if server is not None:
                server.close(wait_s=2.0)
        _state.update(ctx=None, failed=None, noted=False, restarted=False, retired=[])


class ForkedProcess:
    """A rank forked by a server, with the part of ``subprocess.Popen``'s interface the launcher uses."""

    def __init__(self, ctx, env, fds, threads):
        """``ctx``: A (context()); ``fds``: name -> this process's fd (stdout, stderr, cmd, res and maybe listen)."""
        status_r, status_w = os.pipe()
        try:
            with _lock:
                server = _server_for(env)
                message = {"op": "fork", "env": env, "names": list(fds), "threads": threads}
                try:
                    reply, _ = server.ask(message, [*fds.values(), status_w])
                except Exception:
                    if server is ctx:
                        raise
                    _drop_second_server()  # B is gone: A serves, as before B was ready
                    reply, _ = ctx.ask(message, [*fds.values(), status_w])
        except BaseException:
            os.close(status_r)
            raise
        finally:
            os.close(status_w)
        os.set_blocking(status_r, False)
        self._status = status_r  # the server writes the exit code here once it has reaped the rank
        self.pid = reply["pid"]
        self.returncode = None
        self.server_gone = False  # its server ended without reporting its exit code (it was stopped or killed)
        # /proc/PID/stat held open: a pread answers "alive?" in microseconds, and the fd stays bound to this
        # process, never to a later one that reuses the pid (once the rank is reaped, a read fails with ESRCH).
        try:
            self._stat_fd = os.open(f"/proc/{self.pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            self._stat_fd = None  # no /proc (macOS): the status pipe alone

    def _stat(self):
        if self._stat_fd is None:
            return None
        try:
            return _stat_fields(os.pread(self._stat_fd, 4096, 0))
        except OSError:
            return None

    def _close(self):
        for name in ("_stat_fd", "_status"):
            fd = getattr(self, name, None)
            setattr(self, name, None)
            if fd is not None:
                os.close(fd)

    def __del__(self):
        self._close()

    def _reported(self):
        """The exit code its server wrote, or None while there is none. A server that ended without writing one
        (killed) gives 255, as multiprocessing's own fork server client does, and sets ``server_gone``: the code
        is unknown, and the report says so rather than name 255."""
        if self._status is None:
            return None
        try:
            data = os.read(self._status, _CODE.size)
        except BlockingIOError:
            return None
        except OSError:
            data = b""
        if len(data) == _CODE.size:
            return _CODE.unpack(data)[0]
        self.server_gone = True
        return 255

    def poll(self):
        """The exit code, or None while the rank lives. Called before every call (Cluster.alive): where /proc
        exists one pread of the held /proc/PID/stat answers for a live rank."""
        if self.returncode is None:
            fields = self._stat()
            if fields and fields[0] not in ("Z", "X"):
                return None  # running or asleep: alive
            code = zombie_exit_code(self.pid) if fields else None  # dead, not reaped yet: the kernel keeps it
            reported = self._reported()  # read either way: it also tells whether the server ended first
            if code is None:
                code = reported
            if code is not None:
                self.returncode = code
                self._close()
        return self.returncode

    def wait(self, timeout=None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(f"rank {self.pid}", timeout)
            if self._status is None:
                time.sleep(0.05)
            else:
                _readable([self._status], 0.05 if left is None else min(0.05, left))
        return self.returncode

    def kill(self):
        if self.returncode is None and (self._stat_fd is None or self._stat() is not None):  # not reaped yet
            with contextlib.suppress(OSError):
                os.kill(self.pid, signal.SIGKILL)


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
    None while any of its threads runs, once it is reaped, or where there is no /proc."""
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
    import faulthandler

    import torch

    torch.set_num_threads(threads)  # OMP_NUM_THREADS is read when torch loads: too late here
    faulthandler.enable()
    from course_utils.engine import _worker

    _worker._die_with_parent(os.getppid())  # the server, which ends when the notebook process does
    _worker.run_rank()
