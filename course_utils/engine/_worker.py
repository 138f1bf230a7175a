"""One rank of a Cluster: a fresh interpreter started by course_utils.engine.launcher.

The main thread runs the learner's code, so signals and KeyboardInterrupt behave as in a
normal script. A control thread answers the notebook while the main thread is busy: it
reports where the main thread is stuck and releases the other ranks on an abort.
"""
import ast
import ctypes
import datetime
import faulthandler
import linecache
import os
import queue
import signal
import socket
import sys
import sysconfig
import threading
import time
import traceback

from course_utils.engine import _wire

_CHANNEL = None  # set in main(); course_utils.engine.progress uses it to report from a worker
# idle this long, a rank pre-imports what training needs (see Worker.prewarm)
PREWARM_AFTER_S = float(os.environ.get("COURSE_UTILS_PREWARM_S", "1.0"))
_HERE = os.path.abspath(__file__)


class Channel:
    def __init__(self, res_fd):
        self.res_fd = res_fd
        self.lock = threading.Lock()

    def send(self, msg):
        data = _wire.dump(msg)
        with self.lock:
            _wire.write_all(self.res_fd, data)


def _die_with_parent(parent_pid):
    try:  # Linux: the kernel kills us if the notebook process dies, even by SIGKILL
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass
    if os.getppid() != parent_pid:
        os._exit(1)


def _short(path):
    """A path that reads the same on every machine: 'torch/distributed/...', 'course_utils/...'."""
    for marker in ("site-packages/", "dist-packages/"):
        if marker in path:
            return path.split(marker, 1)[1]
    for root in (_STDLIB, _PACKAGE_ROOT):
        if path.startswith(root + os.sep):
            return os.path.relpath(path, root)
    return path


_STDLIB = sysconfig.get_paths()["stdlib"]
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(_HERE)))  # holds course_utils/


def _user_frames(tb_or_stack):
    """Frames of the learner's code and libraries, without the engine's plumbing, paths shortened."""
    out = []
    for f in tb_or_stack:
        if os.path.abspath(f.filename) == _HERE or f.filename.startswith("<frozen"):
            continue
        out.append(traceback.FrameSummary(_short(f.filename), f.lineno, f.name, line=f.line))
    return out


def _where(frames):
    """'in all_reduce() at Cell In[7], line 4: dist.all_reduce(t)' from a stack, innermost last."""
    frames = list(frames)
    user = [i for i, f in enumerate(frames) if f.filename in _SOURCES]
    if not user:
        return ""
    i = user[-1]
    f = frames[i]
    text = f"at {f.filename}, line {f.lineno}"
    if f.line:
        text += f": {f.line.strip()}"
    for g in frames[i + 1:]:
        if g.name not in ("wrapper", "_fn", "inner"):
            return f"in {g.name}() " + text
    return text


_SOURCES = set()  # filenames of code sent by the notebook (cells and functions)


def _register_sources(sources):
    for filename, text in sources.items():
        lines = text.splitlines(keepends=True)
        linecache.cache[filename] = (len(text), None, lines, filename)
        _SOURCES.add(filename)


def _error_info(exc):
    frames = _user_frames(traceback.extract_tb(exc.__traceback__))
    tb = "".join(traceback.format_list(frames))
    tb += "".join(traceback.format_exception_only(type(exc), exc))
    return {
        "type": type(exc).__name__,
        "message": str(exc),
        "traceback": "Traceback (most recent call last):\n" + tb if frames else tb,
        "where": _where(frames),
        "time": time.time(),
    }


class Worker:
    def __init__(self):
        env = os.environ
        self.rank = int(env["RANK"])
        self.world_size = int(env["WORLD_SIZE"])
        self.backend = env["COURSE_UTILS_BACKEND"]
        self.pg_timeout = float(env["COURSE_UTILS_PG_TIMEOUT"])
        self.channel = Channel(int(env["COURSE_UTILS_RES_FD"]))
        self.cmd_fd = int(env["COURSE_UTILS_CMD_FD"])
        self.listen_fd = int(env.get("COURSE_UTILS_LISTEN_FD", "-1"))
        self.commands = queue.Queue()
        self.busy = False  # True while the learner's code runs
        self.generation = 0
        self.store = None
        self.ns = {"__name__": "__main__", "__builtins__": __builtins__}
        self.libc = ctypes.CDLL(None)

    # -- process group -----------------------------------------------------------------
    def init_process_group(self):
        import torch
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=self.pg_timeout)
        if self.store is None:
            kw = {"master_listen_fd": self.listen_fd} if self.rank == 0 else {}
            self.store = dist.TCPStore(
                "127.0.0.1", int(os.environ["MASTER_PORT"]), self.world_size,
                is_master=self.rank == 0, timeout=datetime.timedelta(seconds=60),
                wait_for_workers=False, **kw)
        store = dist.PrefixStore(f"generation{self.generation}", self.store)
        if self.backend == "nccl":
            device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))  # == rank on one node
            torch.cuda.set_device(device)
        else:
            device = torch.device("cpu")
        dist.init_process_group(self.backend, store=store, rank=self.rank,
                                world_size=self.world_size, timeout=timeout)
        self.ns.update(rank=self.rank, world_size=self.world_size,
                       local_rank=int(os.environ["LOCAL_RANK"]), device=device)

    def destroy_process_group(self):
        import torch.distributed as dist

        if dist.is_initialized():
            self.cut_peer_connections()
            try:
                dist.destroy_process_group()
            except Exception:
                pass

    @staticmethod
    def cut_peer_connections():
        """Shut down this rank's TCP connections to the other ranks (not those to the store), so
        that ranks waiting for us in a collective get an error now. Destroying the process group
        is not enough: once torch._dynamo is imported (by the first optimizer or DDP), something
        keeps the gloo context, and its sockets, alive after destroy_process_group()."""
        store_port = int(os.environ["MASTER_PORT"])
        for name in os.listdir("/proc/self/fd"):
            try:
                if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                    continue
                sock = socket.socket(fileno=int(name))
            except OSError:
                continue
            try:
                if sock.type == socket.SOCK_STREAM and store_port not in (sock.getsockname()[1], sock.getpeername()[1]):
                    sock.shutdown(socket.SHUT_RDWR)
            except (OSError, IndexError, TypeError):
                pass  # listening or not connected: nothing to cut
            finally:
                sock.detach()  # the fd stays gloo's

    # -- commands ----------------------------------------------------------------------
    def control_loop(self):
        """Runs in a thread: reads the notebook's commands; answers 'stacks' and 'abort' itself."""
        main_id = threading.main_thread().ident
        while True:
            try:
                msg = _wire.recv(self.cmd_fd)
            except (EOFError, OSError):
                os._exit(0)  # the notebook is gone: never linger
            kind = msg[0]
            if kind == "stacks":
                frame = sys._current_frames().get(main_id)
                stack = _user_frames(traceback.extract_stack(frame)) if frame else []
                self.channel.send(("stacks", msg[1], self.rank, {
                    "busy": self.busy,
                    "stack": "".join(traceback.format_list(stack)),
                    "where": _where(stack),
                }))
            elif kind == "abort":  # drop our connections so that every rank stuck in a collective errors out
                if self.busy:
                    self.cut_peer_connections()  # our own main thread too, if it waits in a recv
                else:
                    self.destroy_process_group()
            else:
                self.commands.put(msg)

    def finish(self, run_id, ok, payload):
        sys.stdout.flush()
        sys.stderr.flush()
        self.libc.fflush(None)  # C/C++ output (gloo, NCCL) buffered in stdio
        mark = _wire.END_MARK + b"%d\n" % run_id
        os.write(1, mark)
        os.write(2, mark)
        try:
            self.channel.send(("done", run_id, self.rank, ok, payload))
        except Exception as exc:  # the result could not be pickled
            info = _error_info(exc)
            info["message"] = f"the value could not be sent back to the notebook: {exc}"
            self.channel.send(("done", run_id, self.rank, False, info))

    def execute(self, msg):
        import cloudpickle

        kind, run_id = msg[0], msg[1]
        if kind == "reset":
            self.destroy_process_group()
            self.generation = msg[2]
            try:
                self.init_process_group()
                return self.finish(run_id, True, None)
            except Exception as exc:
                return self.finish(run_id, False, _error_info(exc))
        self.busy = True
        try:
            if kind == "code":
                source, filename = msg[2], msg[3]
                _register_sources({filename: source})
                value = self.run_code(source, filename)
            elif kind == "call":
                sources, blob = msg[2], msg[3]
                _register_sources(sources)
                fn, args, kwargs = cloudpickle.loads(blob)
                g = getattr(fn, "__globals__", None)
                module = sys.modules.get(g.get("__name__")) if g is not None else None
                if g is not None and getattr(module, "__dict__", None) is not g:  # sent by value
                    for name in ("rank", "world_size", "local_rank", "device"):
                        g.setdefault(name, self.ns[name])
                value = fn(*args, **kwargs)
            elif kind == "push":
                self.ns.update(cloudpickle.loads(msg[2]))
                value = None
            elif kind == "pull":  # a name that is not there is an answer, not a failure
                value = self.ns.get(msg[2], _wire.MISSING)
            else:
                raise ValueError(f"unknown command {kind!r}")
        except BaseException as exc:
            info = _error_info(exc)
            self.busy = False
            self.destroy_process_group()  # releases the ranks waiting for us in a collective
            return self.finish(run_id, False, info)
        self.busy = False
        self.finish(run_id, True, value)

    def run_code(self, source, filename):
        tree = ast.parse(source, filename)
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last = ast.Expression(tree.body.pop().value)
        exec(compile(tree, filename, "exec"), self.ns)
        if last is not None:
            return eval(compile(last, filename, "eval"), self.ns)
        return None

    @staticmethod
    def prewarm():
        """Import torch._dynamo, which the first optimizer or DDP wrapper on a rank imports lazily
        (seconds per rank on a laptop). Done in the main thread, only while the rank is idle."""
        try:
            import torch._dynamo  # noqa: F401
        except Exception:
            pass

    def on_sigint(self, signum, frame):
        if self.busy:
            raise KeyboardInterrupt

    def main(self):
        global _CHANNEL
        _CHANNEL = self.channel
        signal.signal(signal.SIGINT, self.on_sigint)
        threading.Thread(target=self.control_loop, daemon=True).start()
        try:
            self.init_process_group()
        except BaseException as exc:
            self.channel.send(("ready", self.rank, False, _error_info(exc)))
            return
        self.channel.send(("ready", self.rank, True, {"pid": os.getpid()}))
        warm = False
        while True:
            try:
                msg = self.commands.get(timeout=None if warm else PREWARM_AFTER_S)
            except queue.Empty:  # the learner is reading: pay for DDP's and optim's lazy import now
                warm = True
                self.prewarm()
                continue
            except KeyboardInterrupt:
                continue
            if msg[0] == "shutdown":
                break
            self.execute(msg)
        self.destroy_process_group()


if __name__ == "__main__":
    faulthandler.enable()  # a segfault prints the Python stack, which the notebook relays
    _die_with_parent(int(os.environ["COURSE_UTILS_PARENT_PID"]))
    sys.modules.setdefault("course_utils.engine._worker", sys.modules["__main__"])
    Worker().main()
    sys.stdout.flush()
    os._exit(0)
