"""Shared fixtures and helpers of the test suite. Use these instead of writing your own.

Fixtures (pytest injects them by name):

- ``make_cluster``: module-scoped factory. ``make_cluster(world_size=4, **kwargs)`` returns a
  ``course_utils.Cluster`` with backend ``"gloo"`` pinned (a GPU machine would otherwise pick NCCL and
  then fail on CPU tensors) unless ``kwargs`` sets ``backend``. Clusters are cached per
  ``(world_size, sorted kwargs)`` within one test module (starting ranks costs seconds); a cached
  cluster that a test shut down is replaced by a fresh one. All are shut down at the module's end.
- ``cluster4``: ``make_cluster(4, timeout=30)``, the 4-rank cluster of a module.
- ``torchrun``: function-scoped launcher, ``torchrun(*torchrun_args, script=..., script_args=...)``;
  see ``start_torchrun``. Every process it started is killed with its whole process group when the
  test ends, passed or failed.

Plain helpers, imported by test modules as ``from conftest import register_by_value, free_port, ...``
(pytest puts ``tests/`` on ``sys.path``, so ``conftest`` is importable; ``browser_helpers`` does the same):

- ``register_by_value(module)``: ``cloudpickle.register_pickle_by_value`` made idempotent; accepts a
  module or its name. Call it at the top of a test module whose functions run on the ranks (the ranks
  cannot import test files): ``register_by_value(sys.modules[__name__])``.
- ``free_port()``: a TCP port on 127.0.0.1 that was free a moment ago. Handing a probed port to another
  process races with everything else on the machine, so a launch on a fixed port goes through
  ``retry_on_port_clash(launch)``, which re-runs ``launch(port)`` with a new port when the port was taken.
- ``alive(pid_or_process)``: the process exists and is not a zombie (Linux /proc, else ``ps``).
- ``children_of(pid)``: live child pids of ``pid`` (Linux /proc, else ``ps``).
- ``start_torchrun(...)``, ``torchrun_env()``, ``finish(proc, what)``, ``kill_process_group(proc)``,
  ``wait_until_listening(proc, port, what)`` (start the other "nodes" only once node 0 hosts the store):
  torchrun in its own session (``start_new_session=True``), so that killing its process group also kills
  its ranks (killing the agent alone leaves them running). ``torchrun_env()`` hides GPUs
  (``CUDA_VISIBLE_DEVICES=""``) so scripts choose gloo on any machine, binds gloo to loopback, and gives
  torchrun a TMPDIR under this run's pytest temporary folder (its ``torchelastic_*`` logs land there).
"""
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent  # the repository; test modules import it from here
NOTEBOOKS = ROOT / "notebooks"  # the stored lessons
LESSONS = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))  # every lesson, in order
sys.path.insert(0, str(ROOT))


def in_ci():
    """True when CI=true (or 1, yes): where a skipped test would hide that it never ran, it fails instead."""
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


# ---- what the tests may write -----------------------------------------------------------------
# Lesson 04 (run by nbval in the same pytest process) and course_utils.bench save to $MICRO_DDP_CACHE, by default
# the learner's own ~/.cache/micro-ddp: every run of the suite gets a fresh temporary cache instead, set here at
# import (before nbval starts a kernel, which inherits it) and removed when pytest ends. A test that needs its
# own cache sets MICRO_DDP_CACHE itself. `pytest notebooks` alone does not load this file: the Makefile's
# test-baseline-cpu sets a temporary MICRO_DDP_CACHE itself.
TEST_CACHE = tempfile.mkdtemp(prefix="micro-ddp-test-cache-")
os.environ["MICRO_DDP_CACHE"] = TEST_CACHE

# The kernels nbval starts (and engine_helpers.Kernel's, which also gets its own HOME) inherit these: IPython's
# profile, history and startup files, and Jupyter's config, data (user kernel specs) and runtime (connection
# files) all live in a temporary folder, never the learner's ~/.ipython or ~/.local/share/jupyter.
TEST_JUPYTER = tempfile.mkdtemp(prefix="micro-ddp-test-jupyter-")
for _var, _sub in (("IPYTHONDIR", "ipython"), ("JUPYTER_CONFIG_DIR", "config"), ("JUPYTER_DATA_DIR", "data"),
                   ("JUPYTER_RUNTIME_DIR", "runtime"), ("MPLCONFIGDIR", "matplotlib")):
    os.environ[_var] = os.path.join(TEST_JUPYTER, _sub)
os.environ.pop("JUPYTER_PATH", None)

# The learner's HOME is no place for the tests either. Tools that the suite runs keep their settings and caches in
# the XDG folders (Chromium under the browser test writes ~/.config/chromium and ~/.cache/dconf, pip its cache): each
# pytest process points them into a temporary folder of its own, removed when it ends. A test that runs a tool which
# writes into HOME itself (git, pip, a build) gives it a temporary HOME. HomeCheck below reports what was written.
TEST_XDG = tempfile.mkdtemp(prefix="micro-ddp-test-xdg-")
for _var, _sub in (("XDG_CACHE_HOME", "cache"), ("XDG_CONFIG_HOME", "config"), ("XDG_DATA_HOME", "data"),
                   ("XDG_STATE_HOME", "state")):
    os.environ[_var] = os.path.join(TEST_XDG, _sub)
os.environ["PIP_CACHE_DIR"] = os.path.join(TEST_XDG, "cache", "pip")
# JupyterLab (the browser test's server) runs `npm prefix --global`, which logs into ~/.npm/_logs
os.environ["npm_config_cache"] = os.path.join(TEST_XDG, "cache", "npm")




def repository_extras():
    """Untracked and ignored entries of the repository (``git status --porcelain --ignored``, folders collapsed),
    without Python's bytecode caches: what a test would leave behind by writing into the repository. None
    outside a git checkout."""
    try:
        out = subprocess.run(["git", "status", "--porcelain", "--ignored"], cwd=ROOT, capture_output=True,
                             text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    return {line[3:] for line in out.stdout.splitlines()
            if line[:2] in ("??", "!!") and "__pycache__" not in line}


_EXTRAS_AT_START = repository_extras()


def pytest_sessionfinish(session, exitstatus):
    """No test may write into the repository: anything new since this file was imported is reported, and fails
    the run in CI (on a clean clone nobody else writes there; on a shared checkout another person may).
    Under pytest-xdist only the controller checks, once every worker has finished: a worker that ended early
    would otherwise take another worker's short-lived probe file (test_conftest.py's) for a test's leftover."""
    if _EXTRAS_AT_START is None or hasattr(session.config, "workerinput"):  # an xdist worker (not the env:
        return                                                               # a nested pytest inherits it)
    new = sorted((repository_extras() or set()) - _EXTRAS_AT_START)
    if new:
        _report_and_fail_in_ci(session, f"the tests wrote into the repository: {new}")


def _report_and_fail_in_ci(session, message):
    """Say what a test left behind at the end of the run, and fail the run in CI."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(f"\nconftest: {message}", red=True)
    if in_ci() and session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def home_entries(home=None, depth=4, limit=200_000, skip=()):
    """{path relative to ``home``: mtime in ns} of every entry of ``home`` (default: the user's HOME) down to
    ``depth`` levels, symbolic links not followed, at most ``limit`` entries; none below a folder in ``skip``.
    Names and mtimes only, no contents: a new or removed entry shows, and so does one written, or a folder at most
    ``depth`` levels down that gained or lost an entry (deeper writes are not seen)."""
    home = os.path.realpath(home or os.path.expanduser("~"))
    skip = {os.path.realpath(p) for p in skip}
    found, todo = {}, [(home, 1)]
    while todo and len(found) < limit:
        folder, level = todo.pop()
        try:
            with os.scandir(folder) as entries:
                for entry in entries:
                    if entry.path in skip:
                        continue
                    try:
                        st = entry.stat(follow_symlinks=False)
                        is_dir = entry.is_dir(follow_symlinks=False)
                    except OSError:
                        continue
                    found[os.path.relpath(entry.path, home)] = st.st_mtime_ns
                    if is_dir and level < depth:
                        todo.append((entry.path, level + 1))
        except OSError:
            continue
    return found


def home_changes(before, after):
    """The entries new, changed or gone between two ``home_entries`` snapshots, sorted; a folder that changed only
    because an entry listed here appeared in it or left it is not listed again."""
    changed = {p for p in before.keys() & after.keys() if before[p] != after[p]}
    moved = (after.keys() - before.keys()) | (before.keys() - after.keys())
    changed -= {os.path.dirname(p) for p in moved | changed}
    return sorted(moved | changed)


class HomeCheck:
    """No test may write into the user's HOME: what changed there between the start and the end of the run is
    reported, and fails the run in CI (on a CI machine nothing else writes there during the tests). Registered
    only in the process that runs the session, not in pytest-xdist's workers (which run inside it): told apart by
    ``config.workerinput``, not by PYTEST_XDIST_WORKER, which a pytest nested in a test inherits. The repository
    and the temporary folder are not looked at when they lie in HOME: the repository check covers the first, and
    pytest's temporary directories live in the second."""

    def __init__(self):
        self.skip = [str(ROOT), tempfile.gettempdir()]
        self.before = home_entries(skip=self.skip)

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session, exitstatus):
        new = home_changes(self.before, home_entries(skip=self.skip))
        if not new:
            return
        home = os.path.expanduser("~")
        shown = [os.path.join(home, p) for p in new[:30]] + ([f"... {len(new) - 30} more"] if len(new) > 30 else [])
        _report_and_fail_in_ci(session, f"the tests wrote into HOME ({home}): {shown}")


def pytest_configure(config):
    # before collection and before any worker starts: the snapshot is the HOME the run began with
    if not hasattr(config, "workerinput") and not config.pluginmanager.has_plugin("micro-ddp-home-check"):
        config.pluginmanager.register(HomeCheck(), "micro-ddp-home-check")
    config.add_cleanup(lambda: shutil.rmtree(TEST_XDG, ignore_errors=True))


def pytest_unconfigure(config):
    # An in-process IPython shell (the traceback tests) keeps its history database in TEST_JUPYTER and closes it
    # at interpreter exit, after this: end its session first, or it writes to the removed file ("attempt to
    # write a readonly database", printed after the summary).
    shell_module = sys.modules.get("IPython.core.interactiveshell")
    if shell_module is not None and shell_module.InteractiveShell.initialized():
        shell_module.InteractiveShell.instance()._atexit_once()
    shutil.rmtree(TEST_CACHE, ignore_errors=True)
    shutil.rmtree(TEST_JUPYTER, ignore_errors=True)


# ---- clusters ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def make_cluster():
    """Module-scoped factory of gloo clusters, cached per (world_size, kwargs); see the module docstring."""
    from course_utils import Cluster

    made = {}

    def make(world_size=4, **kwargs):
        kwargs.setdefault("backend", "gloo")
        key = (world_size, tuple(sorted(kwargs.items())))
        cluster = made.get(key)
        if cluster is None or not cluster.alive:
            if cluster is not None:
                cluster.shutdown()
            cluster = made[key] = Cluster(world_size=world_size, **kwargs)
        return cluster

    yield make
    errors = []
    for cluster in made.values():
        try:
            cluster.shutdown()
        except Exception as exc:  # shut the others down anyway, then report
            errors.append(repr(exc))
    assert not errors, f"shutting down the module's clusters failed: {errors}"


@pytest.fixture(scope="module")
def cluster4(make_cluster):
    """One 4-rank gloo cluster shared by a test module (starting ranks costs seconds)."""
    return make_cluster(4, timeout=30)


# ---- cloudpickle ------------------------------------------------------------------------------

def register_by_value(module):
    """Pickle the functions and classes of ``module`` (a module or its name) by value: the ranks cannot
    import test files. Idempotent."""
    import cloudpickle

    if isinstance(module, str):
        module = sys.modules[module]
    cloudpickle.register_pickle_by_value(module)  # a set underneath: registering twice is harmless
    return module


# ---- ports ------------------------------------------------------------------------------------

PORT_CLASH = re.compile(r"EADDRINUSE|[Aa]ddress already in use|failed to listen on any local network address")


def free_port():
    """A TCP port on 127.0.0.1 that was free when probed (another process may take it before you bind it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PortClash(Exception):
    """Raised by a ``launch(port)`` given to ``retry_on_port_clash`` when its port was taken."""


def retry_on_port_clash(launch, attempts=4):
    """``launch(port)`` with a fresh ``free_port()``, again (up to ``attempts`` times) while it raises
    ``PortClash`` (use ``is_port_clash(output)`` to decide). Returns what ``launch`` returns."""
    for attempt in range(attempts):
        try:
            return launch(free_port())
        except PortClash as clash:
            last = clash
    raise AssertionError(f"no free port after {attempts} attempts; last clash: {last}")


def is_port_clash(output):
    """True if a failed launch's output says its port was already taken."""
    return bool(PORT_CLASH.search(output or ""))


# ---- processes --------------------------------------------------------------------------------

def _ps(*fields):
    """(pid, *fields) rows of every process, from ``ps`` (the non-Linux fallback)."""
    out = subprocess.run(["ps", "-A", "-o", "pid=," + ",".join(f"{f}=" for f in fields)],
                         capture_output=True, text=True, check=True).stdout
    return [line.split(None, len(fields)) for line in out.splitlines() if line.strip()]


def _state(pid):
    """One-letter process state ('R', 'S', 'Z', ...) or None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        if os.path.isdir("/proc/self"):
            return None  # Linux: no /proc entry, no process
    except OSError:
        return None
    out = subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True, text=True).stdout.strip()
    return out[:1] or None


def alive(p):
    """True if process ``p`` (a pid, or a psutil.Process / Popen) exists and is not a zombie."""
    if hasattr(p, "is_running"):  # psutil.Process: also guards against a recycled pid
        import psutil
        try:
            return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False
    if isinstance(p, subprocess.Popen):
        return p.poll() is None
    try:
        os.kill(p, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by someone else
    state = _state(p)
    return state is not None and state != "Z"


def children_of(pid):
    """Live process ids whose parent is ``pid`` (Linux /proc; elsewhere ``ps``)."""
    if not os.path.isdir("/proc/self"):
        return [int(row[0]) for row in _ps("ppid", "stat") if int(row[1]) == pid and not row[2].startswith("Z")]
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                out.append(int(entry))
    return out


def kill_process_group(proc, grace=5.0):
    """SIGTERM the process group of ``proc`` (started with ``start_new_session=True``), SIGKILL what is left
    after ``grace`` seconds, and reap ``proc``. Safe to call twice or on a finished process."""
    try:
        pgid = os.getpgid(proc.pid)
    except ProcessLookupError:
        pgid = proc.pid  # the leader is gone (reaped); its group may still hold its children
    if pgid == os.getpgrp():
        raise RuntimeError(f"pid {proc.pid} shares pytest's process group: start it with start_new_session=True")
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                break
            proc.poll()  # reap the leader, or it stays a zombie member of the group
            time.sleep(0.05)
        else:
            continue
        break
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        pass


@pytest.fixture(autouse=True)
def _no_process_group_left_behind():
    """A test that leaves a default process group in the pytest process fails here, by name: every later test that
    measures true sizes in a fake world of its own (course_utils.true_size) would fail instead."""
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        pytest.fail("the test left a default process group in the pytest process: destroy_process_group() it "
                    "in a finally block")


# ---- torchrun ---------------------------------------------------------------------------------

_TMP_FACTORY = []  # pytest's tmp_path_factory of this run (the fixture below), for torchrun_env's TMPDIR


@pytest.fixture(scope="session", autouse=True)
def _temporary_folders_of_this_run(tmp_path_factory):
    _TMP_FACTORY.append(tmp_path_factory)
    yield
    _TMP_FACTORY.clear()


def torchrun_env(**extra):
    """The environment of a torchrun launched by a test: gloo on loopback, no GPUs, one thread per rank,
    the repository importable, and not 'under pytest' (the engine would hide its status line). Its TMPDIR is a
    fresh folder under this run's pytest temporary folder, where the agent's ``torchelastic_*`` log folder goes
    (it never removes it): nothing is left in the machine's shared temporary folder
    (tests/test_project.py::test_a_tests_torchrun_leaves_nothing_in_the_shared_temporary_folder)."""
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(ROOT), os.environ.get("PYTHONPATH")] if p)
    env.pop("PYTEST_CURRENT_TEST", None)
    if _TMP_FACTORY:
        env["TMPDIR"] = str(_TMP_FACTORY[0].mktemp("torchrun"))
    env.update(extra)
    return env


def start_torchrun(*torchrun_args, script, script_args=(), env=None, cwd=ROOT, stdout=subprocess.PIPE):
    """``python -m torch.distributed.run *torchrun_args script *script_args`` in a new session (so that
    ``kill_process_group`` reaches its ranks). stdout and stderr are merged; text mode."""
    cmd = [sys.executable, "-m", "torch.distributed.run", *torchrun_args, str(script), *map(str, script_args)]
    return subprocess.Popen(cmd, cwd=cwd, env=torchrun_env() if env is None else env, stdin=subprocess.DEVNULL,
                            stdout=stdout, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def finish(proc, what, timeout=240, check=True):
    """Wait for ``proc`` (from ``start_torchrun``) and return its output. On a timeout its process group is
    killed and the test fails; with ``check``, a non-zero exit fails the test too. A port clash raises
    ``PortClash`` instead, so that ``retry_on_port_clash`` can retry."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_process_group(proc)
        out, _ = proc.communicate()
        raise AssertionError(f"{what} did not finish within {timeout} s:\n{(out or '')[-6000:]}")
    if proc.returncode != 0 and is_port_clash(out):
        raise PortClash(f"{what}: {out[-500:]}")
    if check:
        assert proc.returncode == 0, f"{what} failed with exit code {proc.returncode}:\n{out[-6000:]}"
    return out


def _listens(proc, port):
    """True if ``proc`` or one of its descendants has a listening TCP socket on ``port``."""
    import psutil
    try:
        root = psutil.Process(proc.pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return False
    for p in tree:
        try:
            if any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port
                   for c in p.net_connections("tcp")):
                return True
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return False


def _anyone_listens(port):
    import psutil
    try:
        return any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port
                   for c in psutil.net_connections("tcp"))
    except psutil.AccessDenied:  # macOS without root: cannot tell, keep waiting
        return False


def wait_until_listening(proc, port, what, timeout=120.0):
    """Wait until ``proc`` (a torchrun hosting the rendezvous store) listens on ``port``: start the other nodes
    only then, so that they join this store and not a stranger's. Raises ``PortClash`` when another process
    holds the port (or ``proc`` failed on it), ``AssertionError`` when ``proc`` neither listens nor exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _listens(proc, port):
            return
        if proc.poll() is not None:
            out = proc.stdout.read() if proc.stdout else ""
            if is_port_clash(out):
                raise PortClash(f"{what}: {out[-500:]}")
            raise AssertionError(f"{what} exited with code {proc.returncode} before listening on port {port}:\n"
                                 f"{out[-3000:]}")
        if _anyone_listens(port) and not _listens(proc, port):
            kill_process_group(proc)
            raise PortClash(f"{what}: another process listens on port {port}")
        time.sleep(0.1)
    kill_process_group(proc)
    raise AssertionError(f"{what} did not listen on port {port} within {timeout:.0f} s")


@pytest.fixture
def torchrun():
    """``torchrun(*args, script=..., script_args=...)`` starts ``start_torchrun``; every process group it
    started is killed when the test ends, whether it passed or failed."""
    started = []

    def start(*args, **kwargs):
        proc = start_torchrun(*args, **kwargs)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        kill_process_group(proc)
        for stream in (proc.stdout, proc.stderr):
            if stream:
                stream.close()
