"""One rank of a Cluster: forked from the fork server (course_utils.engine._forkstart) or a fresh interpreter.

The main thread runs the learner's code, so signals and KeyboardInterrupt behave as in a
normal script. A control thread answers the notebook while the main thread is busy: it
reports where the main thread is stuck and releases the other ranks on an abort.
"""
import ast
import contextlib
import ctypes
import datetime
import faulthandler
import linecache
import os
import queue
import signal
import socket
import stat
import sys
import sysconfig
import threading
import time
import traceback
import types
import weakref

from course_utils.engine import _wire

_CHANNEL = None  # set in main(); course_utils.engine.progress uses it to report from a worker
_SERVER_TORCH_LOGS = os.environ.get("TORCH_LOGS")  # what import torch parsed, in the fork server (or this rank)
_WORKER = None  # this rank's Worker, once main() runs
_HERE = os.path.abspath(__file__)
_ENGINE_DIR = os.path.dirname(_HERE) + os.sep  # the engine's own frames are not shown to the learner


class Channel:
    def __init__(self, res_fd):
        self.res_fd = res_fd
        self.lock = threading.Lock()

    def send(self, msg):
        data = _wire.dump(msg)
        with self.lock:
            _wire.write_all(self.res_fd, data)


WATCHDOG_S = 0.5  # how often a rank checks that the notebook process still exists


def _die_with_parent(parent_pid):
    """End this rank when the notebook process is gone, also while a child of the notebook holds the command pipe
    open (no EOF then). Not PR_SET_PDEATHSIG: it fires when the starting *thread* exits, and only on Linux."""
    def watch():
        while True:
            if os.getppid() != parent_pid:
                if _WORKER is None:
                    os._exit(1)
                _WORKER.end_without_the_notebook()  # as on EOF: the exit work first
            time.sleep(WATCHDOG_S)

    if os.getppid() != parent_pid:
        os._exit(1)
    threading.Thread(target=watch, name="course_utils-watchdog", daemon=True).start()


def _open_fds():
    """This process's open file descriptors: /proc or /dev/fd where they exist, else a scan with fstat."""
    if not os.environ.get("COURSE_UTILS_NO_PROC"):  # set by the tests to run the fallback on Linux
        for d in ("/proc/self/fd", "/dev/fd"):
            try:
                return [int(n) for n in os.listdir(d)]
            except OSError:
                continue
    try:
        import resource

        limit = min(resource.getrlimit(resource.RLIMIT_NOFILE)[0], 65536)
    except Exception:
        limit = 4096
    fds = []
    for fd in range(limit):
        try:
            os.fstat(fd)
        except OSError:
            continue
        fds.append(fd)
    return fds


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
    frames = list(tb_or_stack)
    # what ran before this module's own frames (the fork server's loop that forked the rank, and for a rank of the
    # second server also the first's, which forked that server) is not shown either
    paths = [os.path.abspath(f.filename) for f in frames]
    start = paths.index(_HERE) if _HERE in paths else next(
        (i for i, path in enumerate(paths) if path.startswith(_ENGINE_DIR)), 0)
    for f, path in zip(frames[start:], paths[start:]):
        if path.startswith(_ENGINE_DIR) or f.filename.startswith("<frozen"):
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


def _in_collective(frames):
    """Whether the learner's innermost line is inside a torch.distributed call: the report then reads "was waiting
    in all_reduce() ... and was released" whichever came first (tests/test_engine_edges.py)."""
    frames = list(frames)
    user = [i for i, f in enumerate(frames) if f.filename in _SOURCES]
    return bool(user) and any("torch/distributed/" in f.filename.replace(os.sep, "/") for f in frames[user[-1] + 1:])


_SOURCES = set()  # filenames of code sent by the notebook (cells and functions)


def _note(text):
    print(f"note: {text}", file=sys.stderr, flush=True)


def _register_sources(sources):
    for filename, text in sources.items():
        lines = text.splitlines(keepends=True)
        linecache.cache[filename] = (len(text), None, lines, filename)
        _SOURCES.add(filename)


_COURSE_DIR = os.path.join(_PACKAGE_ROOT, "course_utils") + os.sep


def _verdict_frames(exc, raw):
    """A checker's verdict (an AssertionError raised inside course_utils: course_utils.checks, the
    probes' check_* functions, or re-raised by the checks' wrapper) ends at the learner's line that
    called the checker, as in the notebook: the checker's own frames are cut."""
    if not isinstance(exc, AssertionError) or not raw:
        return raw
    inside = [os.path.abspath(f.filename).startswith(_COURSE_DIR) for f in raw]
    if not inside[-1]:
        return raw  # raised by the learner's own code (which a checker may have called)
    cut = len(raw)
    while cut and inside[cut - 1]:
        cut -= 1
    return raw[:cut] if cut else raw


def _error_info(exc):
    raw = traceback.extract_tb(exc.__traceback__)
    cut = _verdict_frames(exc, raw)
    frames = _user_frames(cut)
    tb = "".join(traceback.format_list(frames))
    tb += "".join(traceback.format_exception_only(type(exc), exc))
    return {
        "type": type(exc).__name__,
        "message": str(exc),
        "traceback": "Traceback (most recent call last):\n" + tb if frames else tb,
        "where": _where(frames),
        "time": time.time(),
        "verdict": len(cut) < len(raw),  # a checker's verdict: every rank may say the same (reports.failure_error)
    }


DEFER_IMPORT_S = 30.0  # a stop waits at most this long for an import to finish (the launcher gives up sooner)


def _importing():
    """Whether a module is being imported right now (importlib marks its spec while the module runs)."""
    for mod in list(sys.modules.values()):
        spec = getattr(mod, "__spec__", None)
        if getattr(spec, "_initializing", False):
            return True
    return False


def _stopped_in_import(exc):
    """A KeyboardInterrupt that stopped an import half-way: the rank may be unusable from now on."""
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        tb = tb.tb_next
    return False


_GROUPS = []  # the process groups this rank made and has not freed yet (see keep_every_group_alive)
_DESTROYED = set()  # ids of the kept groups that torch had destroyed at the last safe point
_COLLECTED = set()  # ids of destroyed groups that a full gc.collect() already ran for


def keep_every_group_alive():
    """Keep every process group the rank makes (new_group, DeviceMesh, the engine's own) in _GROUPS, so that it is
    freed only at a safe point on the main thread (free_destroyed_groups): torch 2.13's ~ProcessGroupGloo joins its
    worker threads holding the GIL (a deadlock if one waits for it) and aborts the rank on one of its own threads."""
    import torch.distributed.distributed_c10d as c10d

    made = c10d._new_process_group_helper
    if getattr(made, "_keeps_groups", False):
        return

    def new_process_group_helper(*args, **kwargs):
        out = made(*args, **kwargs)
        pg = out[0] if isinstance(out, tuple) else out
        if isinstance(pg, c10d.ProcessGroup):  # not GroupMember.NON_GROUP_MEMBER
            _GROUPS.append(pg)
        return out

    new_process_group_helper._keeps_groups = True
    c10d._new_process_group_helper = new_process_group_helper


FREE_WAIT_S = 0.5  # how long a safe point waits for freed groups to end their worker threads
WAIT_SLICE_S = 0.1  # a gloo collective is waited for in slices this long, so that a release or a stop gets in


def release_collective_waits(worker):
    """Wait for a gloo collective in slices of WAIT_SLICE_S instead of one uninterruptible C++ call: a receive posted
    on a connection gloo is closing never completes, and between slices the rank sees the engine's release
    (worker.released) and a stop. Not for a send or a recv (a timed wait that runs out ends them; the engine's cut
    of the connections ends their wait), not on NCCL nor once CUDA is in use (a timed wait may abort there)."""
    import torch
    import torch.distributed as dist

    wait = dist.Work.wait
    if getattr(wait, "_sliced", False):
        return
    zero = datetime.timedelta(0)
    point_to_point = weakref.WeakSet()  # gloo ends a send or a recv whose timed wait ran out: never slice those
    for name in ("send", "recv", "recv_anysource"):
        def recorded(self, *args, _call=getattr(dist.ProcessGroup, name), **kwargs):
            work = _call(self, *args, **kwargs)
            point_to_point.add(work)
            return work
        setattr(dist.ProcessGroup, name, recorded)

    def sliced_wait(self, timeout=zero):
        if worker.backend == "nccl" or torch.cuda.is_initialized() or self in point_to_point:
            return wait(self, timeout)
        deadline = time.monotonic() + timeout.total_seconds() if timeout > zero else None
        while True:
            left = WAIT_SLICE_S if deadline is None else min(WAIT_SLICE_S, deadline - time.monotonic())
            try:
                return wait(self, datetime.timedelta(seconds=max(left, 0.001)))
            except RuntimeError as exc:
                if "not implemented" in str(exc):  # a kind of work without timed waits (one made from a future)
                    return wait(self, timeout)
                if "timed out" not in str(exc) or (deadline is not None and time.monotonic() >= deadline):
                    raise  # the collective's own error, or the caller's own timeout
            if worker.busy and worker.released == worker.run_id:
                raise RuntimeError("released by the engine while waiting in a collective: another rank failed or "
                                   "the cell was stopped")

    sliced_wait._sliced, sliced_wait.original = True, wait
    dist.Work.wait = sliced_wait


def free_destroyed_groups():
    """Free the kept groups that torch destroyed before the previous safe point and that nothing else holds from
    Python. Safe points: the main thread before each command, and each destroy_process_group(group) a cell calls.
    A group destroyed during one command is freed two commands later at the earliest, once its works have ended."""
    import gc

    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    world = getattr(c10d, "_world", None)
    if world is None or not _GROUPS:
        return
    live = {id(pg) for pg in list(world.pg_map)}
    if all(id(pg) in live for pg in _GROUPS):
        _DESTROYED.clear()  # nothing was destroyed: no work, however much the ranks hold
        return
    # cycles that hold a group (a failed cell's frames, a model the learner dropped) go first: one full collection
    # per destroyed group at most, and only when something besides _GROUPS still holds it (the list's slot, the
    # loop's name and getrefcount's argument make 3)
    held = False
    for pg in _GROUPS:
        if id(pg) not in live and id(pg) not in _COLLECTED and sys.getrefcount(pg) > 3:
            _COLLECTED.add(id(pg))
            held = True
    del pg
    if held:
        gc.collect()
    keep, free = [], []
    while _GROUPS:
        pg = _GROUPS.pop()
        # references: this name and getrefcount's argument; any more are the learner's (or a callback's)
        if id(pg) not in live and id(pg) in _DESTROYED and sys.getrefcount(pg) <= 2:
            free.append(pg)
        else:
            keep.append(pg)
        del pg
    keep.reverse()
    _GROUPS.extend(keep)
    _DESTROYED.clear()
    _DESTROYED.update(id(pg) for pg in keep if id(pg) not in live)
    _COLLECTED.intersection_update(id(pg) for pg in keep)
    if free:  # ~ProcessGroupGloo joins the group's worker threads (without the GIL). One still blocked in a work
        # that nothing will complete (a wait the engine released, a stop between posting a collective and waiting
        # for it) joins only at the group's timeout: the rank goes on after FREE_WAIT_S and leaves it to that thread
        ender = threading.Thread(target=free.clear, name="course_utils-free-groups", daemon=True)
        ender.start()
        ender.join(FREE_WAIT_S)


def send_cell_code_by_value(main_module):
    """What the cells define in __main__ goes by value (cloudpickle) when the rank itself pickles it for
    multiprocessing (a spawn or forkserver child has no cells to find it in by reference); anything else, and all
    a child sends back, is pickled as multiprocessing always does, so a cell's class comes back as the rank's own
    (load_into_main). The rank also gets the platform's start method back, not the fork server's "forkserver".
    tests/engine_helpers.py::check_multiprocessing_with_cell_code holds this on both start paths."""
    import multiprocessing

    import cloudpickle
    from multiprocessing import reduction

    global _RANK_MAIN
    _RANK_MAIN, owner = main_module, os.getpid()

    def reducer_override(self, obj):
        if isinstance(obj, (types.FunctionType, type)) and getattr(obj, "__module__", None) == "__main__" \
                and sys.modules.get("__main__") is main_module and os.getpid() == owner:
            return load_into_main, (obj.__qualname__, cloudpickle.dumps(obj))
        return NotImplemented

    reduction.ForkingPickler.reducer_override = reducer_override
    multiprocessing.set_start_method(None, force=True)  # forget the inherited method: the platform's default


_RANK_MAIN = None  # the rank's __main__; a fork child of the rank shares it


def load_into_main(name, payload):
    """In a child of a rank: a function or class a cell defined, sent by value. A fork child takes the rank's own
    from the shared __main__; a spawn or forkserver child keeps what it loads (and the cell-defined names it uses)
    in its own __main__, so that an instance sent back goes by reference to the rank's class."""
    import cloudpickle

    main = sys.modules.get("__main__")
    if main is not None and main is _RANK_MAIN and name in vars(main):
        return vars(main)[name]
    obj = cloudpickle.loads(payload)
    if main is not None:
        functions = [obj] + (list(vars(obj).values()) if isinstance(obj, type) else [])
        uses = [obj] + [v for f in functions for v in getattr(f, "__globals__", {}).values()
                        if isinstance(v, (types.FunctionType, type))]
        for used in uses:
            qualname = getattr(used, "__qualname__", "")
            if getattr(used, "__module__", None) == "__main__" and qualname.isidentifier():
                vars(main).setdefault(qualname, used)
    return obj


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
        self.store_port = int(env["MASTER_PORT"])  # the learner's code may change the variable (tutorials do)
        self.commands = queue.Queue()
        self.busy = False  # True while a command from the notebook runs
        self.interruptible = False  # True only while the learner's own code runs: SIGINT lands there
        self.manage_group = env.get("COURSE_UTILS_GROUP", "1") == "1"  # False under spawn(): fn sets it up
        self.original = {}  # torch.distributed's own init/destroy, before the learner-facing wrappers
        self.ending = False  # the notebook is gone and the rank is ending (end_without_the_notebook)
        self.ending_lock = threading.Lock()
        self.generation = 0
        self.run_id = 0
        self.store = None
        # The cells run in a real __main__ module, so that pickle finds a class or function defined in a
        # cell by reference (torch.save(Net()), multiprocessing's spawn and forkserver), as under torchrun.
        self.main_module = types.ModuleType("__main__")
        self.ns = self.main_module.__dict__
        self.ns["__builtins__"] = __builtins__
        self.libc = ctypes.CDLL(None)
        self.group_lock = threading.Lock()  # the control thread destroys the group of an idle rank
        self.deferred_since = 0.0  # when a stop was first deferred for an import in progress (0: none)
        self.poisoned = ""  # why this rank must be replaced rather than reused (a stop landed mid-import)
        self.released = 0  # the run whose collective waits the engine released (an abort while busy)

    # -- process group -----------------------------------------------------------------
    def init_process_group(self):
        import torch
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=self.pg_timeout)
        if self.store is None:
            kw = {"master_listen_fd": self.listen_fd} if self.rank == 0 else {}
            self.store = dist.TCPStore(
                "127.0.0.1", self.store_port, self.world_size,
                is_master=self.rank == 0, timeout=datetime.timedelta(seconds=60),
                wait_for_workers=False, **kw)
        # each restart's group under its own prefix. No prefix keeps other local processes out of the store: any can
        # list its keys (TCPStore.list_keys); loopback keeps other machines out (docs/engine.md, "Safety")
        store = dist.PrefixStore(f"generation{self.generation}", self.store)
        device = _default_device(self.backend)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        self.original.get("init", dist.init_process_group)(
            self.backend, store=store, rank=self.rank, world_size=self.world_size, timeout=timeout)
        self.predefine(device)
        self.wrap_group_calls()

    def predefine(self, device=None):
        if device is None:
            device = self.ns.get("device")
        if device is None:
            device = _default_device(self.backend)
        self.ns.update(rank=self.rank, world_size=self.world_size,
                       local_rank=int(os.environ["LOCAL_RANK"]), device=device)

    def wrap_group_calls(self):
        """Code written for torchrun or mp.spawn calls init_process_group and destroy_process_group
        itself; on a rank whose group the engine already set up, both become notes, so that such
        code runs unchanged and the next cell still has its group."""
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        if self.original:
            return
        self.original = {"init": c10d.init_process_group, "destroy": c10d.destroy_process_group}
        worker = self

        def init_process_group(backend=None, init_method=None, timeout=None, world_size=-1, rank=-1, *args, **kwargs):
            if not dist.is_initialized():  # e.g. after a destroy of our own: the learner's call is honoured
                return worker.original["init"](backend, init_method, timeout, world_size, rank, *args, **kwargs)
            wrong = []
            if world_size not in (-1, None) and int(world_size) != worker.world_size:
                wrong.append(f"world_size={world_size}, but this cluster has {worker.world_size} ranks")
            if rank not in (-1, None) and int(rank) != worker.rank:
                wrong.append(f"rank={rank}, but this is rank {worker.rank}")
            if backend and str(backend).lower() != worker.backend and ":" not in str(backend):
                wrong.append(f"backend={backend!r}, but this cluster runs {worker.backend!r}")
            if wrong:
                raise ValueError("init_process_group: " + "; ".join(wrong) + ". The ranks already have a process "
                                 "group; start matching ranks with %%ddp -n N --backend B (or Cluster(...)).")
            _note("init_process_group(): the process group is already initialised "
                  f"(rank {worker.rank} of {worker.world_size}, {worker.backend}); this call does nothing.")

        def destroy_process_group(group=None):
            if group is not None and group is not dist.GroupMember.WORLD:
                worker.original["destroy"](group)
                # groups destroyed by earlier calls are freed here too (a cell may make hundreds), this one at the
                # next call; sleep(0) first lets gloo's threads take the GIL and end what they were finishing.
                if threading.current_thread() is threading.main_thread():
                    time.sleep(0)
                    free_destroyed_groups()
                return None
            _note("destroy_process_group(): kept the process group for the next cell.")

        for module in (dist, c10d):
            module.init_process_group = init_process_group
            module.destroy_process_group = destroy_process_group

    def destroy_process_group(self):
        """Destroy the group (and every subgroup); _GROUPS keeps their objects until a later safe point
        (free_destroyed_groups), never freed on one of gloo's own threads."""
        import gc

        import torch.distributed as dist

        with self.group_lock:
            if not dist.is_initialized():
                return
            self.cut_peer_connections()
            with contextlib.suppress(Exception):
                self.original.get("destroy", dist.destroy_process_group)()
            gc.collect()  # the failed cell's garbage (DDP, hook state, frames) is freed here, not on gloo's threads

    def abort_nccl(self):
        """On NCCL a rank waits in a GPU kernel that neither a cut socket nor SIGINT reaches: abort every
        communicator (torch 2.13's _abort_process_group) so the host's wait returns with an error (make test-gpu)."""
        if self.backend != "nccl":
            return
        with contextlib.suppress(Exception):
            import torch.distributed.distributed_c10d as c10d

            if c10d.is_initialized():
                c10d._abort_process_group()

    def cut_peer_connections(self):
        """Shut down this rank's loopback TCP connections to the other ranks, so that ranks waiting for us in a
        collective get an error now (the kept groups keep gloo's sockets open). The store's connections, other
        addresses and the learner's own Python socket objects stay open: gloo's sockets live in C++ only."""
        import gc

        store_port = self.store_port
        learners = set()
        for obj in gc.get_objects():
            if issubclass(type(obj), socket.socket):  # type(): a lazy module attribute's __class__ would warn
                with contextlib.suppress(OSError):
                    learners.add(obj.fileno())
        for fd in _open_fds():
            try:
                if fd in learners or not stat.S_ISSOCK(os.fstat(fd).st_mode):
                    continue
                sock = socket.socket(fileno=fd)
            except OSError:
                continue
            try:
                if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
                    continue
                peer = sock.getpeername()
                if peer[0] in ("127.0.0.1", "::1", "::ffff:127.0.0.1") and store_port not in (sock.getsockname()[1],
                                                                                           peer[1]):
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
                self.end_without_the_notebook()
                return  # nothing more comes: never the previous command again
            kind = msg[0]
            if kind == "stacks":
                frame = sys._current_frames().get(main_id)
                stack = _user_frames(traceback.extract_stack(frame)) if frame else []
                self.channel.send(("stacks", msg[1], self.rank, {
                    "busy": self.busy,
                    "run_id": self.run_id,
                    "stack": "".join(traceback.format_list(stack)),
                    "where": _where(stack),
                    "collective": _in_collective(stack),
                }))
            elif kind == "abort":  # drop our connections so that every rank stuck in a collective errors out
                if self.busy:
                    self.released = self.run_id  # a gloo wait that the cut cannot end ends at its next slice
                self.abort_nccl()
                if not self.manage_group:
                    self.cut_peer_connections()
                elif self.busy:
                    self.cut_peer_connections()  # our own main thread too, if it waits in a recv
                else:
                    self.destroy_process_group()
            else:
                self.commands.put(msg)

    def end_without_the_notebook(self):
        """The notebook is gone (its kernel exited or was killed): end as a script does, never linger. An idle rank
        ends on its main thread, as after %ddp shutdown; one still running a cell gets 1 s, then the exit work
        (atexit handlers, open files flushed) runs here and the rank exits: an unclosed file keeps its text."""
        with self.ending_lock:  # once, whichever thread sees the notebook gone first (EOF, the watchdog)
            if self.ending:
                return
            self.ending = True
        self.commands.put(("shutdown",))
        deadline = time.monotonic() + 1.0
        while self.busy and time.monotonic() < deadline:
            time.sleep(0.02)
        if self.busy:
            _end_like_a_script()
            os._exit(0)
        time.sleep(5.0)  # the main thread ends the process; if it has not within 5 s, end it from here
        os._exit(0)

    def finish(self, run_id, ok, payload):
        # Flush before saying "done": the notebook then reads the stream pipes until they are empty.
        # A cell may have replaced or closed the streams (sys.stdout = None, os.dup2(devnull, 1)).
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        self.libc.fflush(None)  # C/C++ output (gloo, NCCL) buffered in stdio
        try:
            self.channel.send(("done", run_id, self.rank, ok, payload))
        except Exception as exc:  # the result could not be pickled
            info = _error_info(exc)
            info["message"] = f"the value could not be sent back to the notebook: {exc}"
            self.channel.send(("done", run_id, self.rank, False, info))

    def execute(self, msg):
        import cloudpickle

        kind, run_id = msg[0], msg[1]
        self.run_id = run_id
        if kind == "reset":
            if self.poisoned:  # refuse the new group: the launcher then replaces the ranks
                return self.finish(run_id, False, {"type": "RuntimeError", "message": self.poisoned,
                                                   "traceback": "", "where": "", "time": time.time()})
            self.destroy_process_group()
            self.generation = msg[2]
            if len(msg) > 3:
                self.pg_timeout = msg[3]
            try:
                self.init_process_group()
                return self.finish(run_id, True, None)
            except Exception as exc:
                return self.finish(run_id, False, _error_info(exc))
        ok, value = True, None
        try:
            self.busy = True
            if kind == "code":
                source, filename = msg[2], msg[3]
                _register_sources({filename: source})
                value = self.learner(self.run_code, source, filename)
            elif kind == "call":
                sources, blob = msg[2], msg[3]
                with_rank = len(msg) > 4 and msg[4]
                _register_sources(sources)
                fn, args, kwargs = cloudpickle.loads(blob)
                g = getattr(fn, "__globals__", None)
                module = sys.modules.get(g.get("__name__")) if g is not None else None
                if g is not None and getattr(module, "__dict__", None) is not g:  # sent by value
                    for name in ("rank", "world_size", "local_rank", "device"):
                        if name in self.ns:
                            g.setdefault(name, self.ns[name])
                if with_rank:  # spawn(): fn(rank, *args), as torch.multiprocessing.spawn calls it
                    args = (self.rank, *args)
                value = self.learner(fn, *args, **kwargs)
            elif kind == "push":
                self.ns.update(cloudpickle.loads(msg[2]))
            elif kind == "pull":  # a name that is not there is an answer, not a failure
                value = self.ns.get(msg[2], _wire.MISSING)
            else:
                raise ValueError(f"unknown command {kind!r}")
        except BaseException as exc:  # a SIGINT raises only inside learner(): none can land below
            ok, value = False, _error_info(exc)
            if isinstance(exc, KeyboardInterrupt) and _stopped_in_import(exc):
                self.poisoned = "stopped in the middle of an import"
        self.busy = False
        self.finish(run_id, ok, value)  # an error reaches the notebook before the errors it causes on the peers
        if ok:
            return
        if self.manage_group:
            self.destroy_process_group()  # releases the ranks waiting for us in a collective
        else:
            self.cut_peer_connections()

    def learner(self, fn, *args, **kwargs):
        """Run the learner's code: the only place where a SIGINT from the notebook interrupts."""
        self.interruptible, self.deferred_since = True, 0.0
        try:
            return fn(*args, **kwargs)
        finally:
            self.interruptible = False

    def run_code(self, source, filename):
        tree = ast.parse(source, filename)
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last = ast.Expression(tree.body.pop().value)
        exec(compile(tree, filename, "exec"), self.ns)
        if last is not None:
            return eval(compile(last, filename, "eval"), self.ns)
        return None

    def on_sigint(self, signum, frame):
        if not self.interruptible:
            return
        if _importing() and time.monotonic() - self.deferred_since < DEFER_IMPORT_S:
            # An import stopped half-way leaves a library half-registered: torch._dynamo, which DDP's
            # constructor imports lazily, then fails on this rank for good. Let the import finish,
            # then deliver the stop (checked again every 50 ms).
            if not self.deferred_since:
                self.deferred_since = time.monotonic()
            threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGINT)).start()
            return
        self.deferred_since = 0.0
        raise KeyboardInterrupt

    def settle(self):
        """What a fresh interpreter under torchrun would have, on both start paths: the cells' __main__
        module, one sys.argv, torch's distributed debug level read from the environment now, and on a
        forked rank its own random state (a fork copies the server's) and BLAS pools sized for its share
        of the cores (OpenBLAS reads OPENBLAS_NUM_THREADS when numpy loads, in the server)."""
        sys.modules["__main__"] = self.main_module
        sys.argv = ["ddp-cell"]  # never the kernel's or the engine's own argv: argparse sees no options
        import torch
        import torch.distributed as dist
        import torch.distributed.nn  # noqa: F401  before the group exists (see _forkstart.PRELOAD)

        keep_every_group_alive()
        release_collective_waits(self)
        send_cell_code_by_value(self.main_module)
        dist.set_debug_level_from_env()  # TORCH_DISTRIBUTED_DEBUG set after the server started
        if os.environ.get("TORCH_LOGS") != _SERVER_TORCH_LOGS:  # import torch parsed the server's value
            torch._logging._init_logs()
        torch.seed()  # a seed from the OS, as a fresh interpreter draws one
        numpy = sys.modules.get("numpy")
        if numpy is not None:
            numpy.random.seed()
        threads = os.environ.get("OMP_NUM_THREADS")
        try:
            from threadpoolctl import threadpool_limits
        except ImportError:
            return
        env = os.environ
        n = env.get("OPENBLAS_NUM_THREADS") or env.get("MKL_NUM_THREADS") or threads  # the learner's, or our share
        if n and n.isdigit():
            threadpool_limits(limits=int(n), user_api="blas")

    def main(self):
        global _CHANNEL, _WORKER
        _CHANNEL, _WORKER = self.channel, self
        self.settle()
        _skip_libraries_finalizers()
        signal.signal(signal.SIGINT, self.on_sigint)
        for fd in (self.cmd_fd, self.channel.res_fd, self.listen_fd):
            if fd >= 0:  # a program the learner starts (exec) does not inherit them; a fork still holds
                # them, which is why the notebook also polls each rank's exit instead of waiting for EOF
                os.set_inheritable(fd, False)
        threading.Thread(target=self.control_loop, daemon=True).start()
        try:
            if self.manage_group:
                self.init_process_group()
            else:
                self.predefine()
        except BaseException as exc:
            self.channel.send(("ready", self.rank, False, _error_info(exc)))
            return
        hold = float(os.environ.get("COURSE_UTILS_TEST_HOLD_START_S") or 0)  # the tests: a start slow enough to stop
        if hold:
            time.sleep(hold)
        self.channel.send(("ready", self.rank, True, {"pid": os.getpid()}))
        while True:
            try:
                msg = self.commands.get()
            except KeyboardInterrupt:
                continue
            if msg[0] == "shutdown":
                break  # no destroy_process_group: the process ends at once (os._exit), and so do its peers
            with self.group_lock:
                free_destroyed_groups()
            self.execute(msg)


def rank_status():
    """This rank's device (the one the engine predefines) and, once CUDA is in use, the memory torch's allocator
    holds on it now and at its peak, in bytes (None, None on CPU): one line of %ddp status."""
    import torch

    device = _WORKER.ns.get("device") if _WORKER is not None else None
    if not isinstance(device, torch.device):  # the learner rebound the name: the engine's own choice
        device = _default_device(_WORKER.backend)
    if device.type != "cuda" or not torch.cuda.is_initialized():
        return str(device), None, None
    return str(device), torch.cuda.memory_allocated(device), torch.cuda.max_memory_allocated(device)


def _default_device(backend):
    """The device the engine gives a rank: cuda:LOCAL_RANK on NCCL (== rank on one node), else the CPU."""
    import torch

    return torch.device("cuda", int(os.environ["LOCAL_RANK"])) if backend == "nccl" else torch.device("cpu")


def _skip_libraries_finalizers():
    """The libraries' weakref.finalize callbacks (those made before the first cell) do not run at the rank's end:
    it ends with os._exit, so nothing they free outlives it. Those the learner's cells make still run."""
    for finalizer in list(getattr(weakref.finalize, "_registry", ())):
        finalizer.atexit = False


def _end_like_a_script():
    """What a script's end does before the interpreter's shutdown: the atexit handlers run, then every file still
    open for writing is flushed (an unclosed open(..., 'w') keeps its text)."""
    import _io
    import atexit
    import gc

    try:
        atexit._run_exitfuncs()  # prints a failing handler's traceback and goes on, as at a script's end
    except BaseException:
        traceback.print_exc()
    # the C base classes (io.IOBase's ABC check over every object is slow): every file object derives from them
    files = [f for f in gc.get_objects() if isinstance(f, _io._IOBase)]
    for f in sorted(files, key=lambda f: not isinstance(f, _io._TextIOBase)):  # text first: into its buffer
        with contextlib.suppress(Exception):
            if not f.closed and f.writable():
                f.flush()


def run_rank():
    """Run this rank's Worker, then end with os._exit: the atexit handlers run and open files are flushed
    (_end_like_a_script), but not the interpreter's shutdown, which gloo's threads can abort (see
    _forkstart.PRELOAD). Both start paths end here."""
    code = 0
    try:
        Worker().main()
    except BaseException:
        traceback.print_exc()
        code = 1
    _end_like_a_script()
    with contextlib.suppress(Exception):
        sys.stdout.flush()  # a cell may have replaced or closed it
    os._exit(code)


def fresh_main():
    """A rank as a fresh interpreter: ``python -c "from course_utils.engine import _worker; _worker.fresh_main()"``.
    Imported, never run as ``__main__``: the cells' code alone is ``__main__`` and goes by value to a child."""
    faulthandler.enable()  # a segfault prints the Python stack, which the notebook relays
    _die_with_parent(int(os.environ["COURSE_UTILS_PARENT_PID"]))
    run_rank()
