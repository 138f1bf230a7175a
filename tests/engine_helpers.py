"""Shared by the engine's test modules (a test module never imports another test module).

- ``Kernel``: a real IPython kernel driven through jupyter_client, as JupyterLab drives it.
- ``listening_addresses(pids)``: the local addresses the given processes listen on.
- ``ranks_below(pid)``: the live ranks started below ``pid``, on either start path.
- ``asleep(pid)``: every thread of a process is asleep (Linux).
- ``wait_until_the_fork_server_has_imported_everything()``: the second fork server has imported LATER and serves.
- ``check_multiprocessing_with_cell_code(cluster)``: multiprocessing on a rank with what the cells define.
- ``check_cells_run_in_a_real_main_module(cluster)``: sys.argv and __main__ on a rank, as under torchrun.
- ``check_an_exception_names_its_rank_and_releases_the_others(cluster)``: a raise on one rank, the others released.
- ``check_settings_read_when_a_library_loads(monkeypatch, world_size)``: the notebook's environment of the moment.
- ``check_output_*(cluster, capfd)``: how a rank's output reaches the notebook, on a cluster of either start path.
"""
import os
import re
import resource
import shutil
import sys
import tempfile
import time

import pytest


class Kernel:
    """Isolated as browser_helpers.JupyterLab's server is: its own temporary HOME, IPython directory (profile,
    history, no startup files of the learner's), Jupyter config, data and runtime folders (the connection file),
    all removed by close()."""

    def __init__(self, like_jupyterlab=False):
        from jupyter_client.manager import KernelManager

        self.home = tempfile.mkdtemp(prefix="micro-ddp-kernel-")
        dirs = {"HOME": self.home, "IPYTHONDIR": os.path.join(self.home, ".ipython"),
                "JUPYTER_CONFIG_DIR": os.path.join(self.home, "config"),
                "JUPYTER_DATA_DIR": os.path.join(self.home, "data"),
                "JUPYTER_RUNTIME_DIR": os.path.join(self.home, "runtime"),
                "MPLCONFIGDIR": os.environ.get("MPLCONFIGDIR") or os.path.join(self.home, "matplotlib")}
        os.makedirs(dirs["JUPYTER_RUNTIME_DIR"])
        self.km = KernelManager(kernel_name="python3",
                                connection_file=os.path.join(dirs["JUPYTER_RUNTIME_DIR"], "kernel.json"))
        env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"], **dirs)
        env.pop("JUPYTER_PATH", None)
        if like_jupyterlab:  # not under pytest: the engine shows its live status line
            env.pop("PYTEST_CURRENT_TEST", None)
        try:
            self.km.start_kernel(cwd=os.path.dirname(os.path.dirname(__file__)), env=env)
            self.kc = self.km.client()
            self.kc.start_channels()
            self.kc.wait_for_ready(timeout=60)
        except BaseException:
            self.close()
            raise
        self.traceback = ""  # the last error's traceback text, colours removed

    def execute(self, code, timeout=180):
        """Run code; return (status, output text: streams and results in order, error name)."""
        import re

        msg_id = self.kc.execute(code)
        out, ename = [], None
        self.traceback = ""
        deadline = time.monotonic() + timeout
        while True:
            msg = self.kc.get_iopub_msg(timeout=max(1, deadline - time.monotonic()))
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                out.append(content["text"])
            elif kind == "execute_result":
                out.append(content["data"]["text/plain"] + "\n")
            elif kind == "error":
                ename = content["ename"]
                self.traceback = re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(content["traceback"]))
            elif kind == "status" and content["execution_state"] == "idle":
                break
        reply = self.reply(msg_id)["content"]
        self.execution_count = reply.get("execution_count")
        return reply["status"], "".join(out), ename

    def reply(self, msg_id):
        while True:
            reply = self.kc.get_shell_msg(timeout=10)
            if reply["parent_header"].get("msg_id") == msg_id:
                return reply

    def worker_pids(self):
        status, out, _ = self.execute("import course_utils.engine.magic as m\nprint(m._CLUSTER.pids)")
        assert status == "ok", out
        return eval(out.strip())

    def close(self):
        try:
            if getattr(self, "kc", None) is not None:
                self.kc.stop_channels()
            if self.km.is_alive():
                self.km.shutdown_kernel(now=True)
            self.km.cleanup_resources()
        finally:
            shutil.rmtree(self.home, ignore_errors=True)


# ---- the fork server --------------------------------------------------------------------------------------------
def wait_until_the_fork_server_has_imported_everything(timeout=120.0):
    """Start the fork servers if needed (a cluster of 1 starts B, see _forkstart), then wait (up to ``timeout`` s)
    until B has imported _forkstart.LATER and serves. Raises AssertionError when that does not happen."""
    from course_utils.engine import _forkstart
    from course_utils.engine.launcher import Cluster

    assert _forkstart.context() is not None, "the fork server did not start"
    if _forkstart._state["b"] is None:
        with Cluster(world_size=1, backend="gloo"):
            pass
    assert _forkstart._state["b"] is not None, "no second fork server started after a cluster did"
    deadline = time.monotonic() + timeout
    while not _forkstart.second_server_ready():
        assert time.monotonic() < deadline, f"the second fork server still imports after {timeout:.0f} s"
        time.sleep(0.05)


# ---- processes and sockets --------------------------------------------------------------------------------------

def listening_addresses(pids):
    """Local addresses of the TCP sockets the given processes listen on (psutil, else Linux /proc)."""
    try:
        import psutil

        return [c.laddr.ip for pid in pids for c in psutil.Process(pid).net_connections(kind="inet")
                if c.status == psutil.CONN_LISTEN]
    except ImportError:
        pass
    inodes = set()
    for pid in pids:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                parts = line.split()
                if parts[3] == "0A" and parts[9] in inodes:  # 0A: LISTEN
                    found.append(parts[1].split(":")[0])
    return found


LOOPBACK = {"0100007F", "00000000000000000000000001000000", "0000000000000000FFFF00000100007F",
            "127.0.0.1", "::1", "::ffff:127.0.0.1"}  # as psutil or /proc/net/tcp{,6} write them


def asleep(pid):
    """Every thread of ``pid`` is asleep (state S: waiting on a peer, a pipe, a timer), as /proc shows it; False
    once it is gone. Linux only: tests that wait until ranks wait before they act."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
        states = []
        for task in tasks:
            with open(f"/proc/{pid}/task/{task}/stat") as f:
                states.append(f.read().rsplit(")", 1)[1].split()[0])
    except OSError:
        return False
    return bool(states) and all(state == "S" for state in states)


def ranks_below(pid):
    """Every live descendant of ``pid`` that leads its own session: on both start paths each rank calls
    setsid (the fork server's children) or is started with start_new_session (fresh interpreters); the fork
    server and multiprocessing's resource tracker do not. Linux only (/proc)."""
    from conftest import children_of

    found, todo = set(), [pid]
    while todo:
        for child in children_of(todo.pop()):
            todo.append(child)
            try:
                with open(f"/proc/{child}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == child:  # its session id is its own pid
                found.add(child)
    return found


# ---- multiprocessing on a rank ----------------------------------------------------------------------------------
MP_CELL = """\
import multiprocessing as mp
import torch

def sq(x):
    return x * x

class Box:
    def __init__(self, v):
        self.v = v

def make(v):
    return Box(v)

class Squares(torch.utils.data.Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        return torch.tensor(float(sq(i)))
"""


def check_multiprocessing_with_cell_code(cluster):
    """What docs/engine.md promises on a rank, on either start path: a Pool in every context maps a cell's function,
    and instances of a cell's class (also one redefined by a later cell) come back as the rank's own class;
    a spawn DataLoader with 2 workers loads a cell's Dataset. Raises AssertionError naming the case that failed."""
    def run(code):  # the value on rank 0, the others checked equal; spawn children import torch: slow under load
        values = cluster.run(code, timeout=120)
        assert all(v == values[0] for v in values), values
        return values[0]

    run(MP_CELL)
    pool = "with mp.get_context({!r}).Pool(2) as pool:\n    out = pool.map_async({}, [1, 2]).get(60)\n"
    for method in ("fork", "spawn", "forkserver"):
        assert run(pool.format(method, "sq") + "out") == [1, 4], method
        got = run(pool.format(method, "make") + "[(type(b) is Box, b.v) for b in out]")
        assert got == [(True, 1), (True, 2)], (method, got)
    run("class Box:\n    def __init__(self, v):\n        self.v = -v")
    got = run(pool.format("spawn", "make") + "[(type(b) is Box, b.v) for b in out]")
    assert got == [(True, -1), (True, -2)], ("redefined", got)
    got = run("loader = torch.utils.data.DataLoader(Squares(), batch_size=2, num_workers=2,\n"
                      "                                     multiprocessing_context='spawn', timeout=60)\n"
                      "[b.tolist() for b in loader]")
    assert got == [[0.0, 1.0], [4.0, 9.0]], ("DataLoader", got)


def check_cells_run_in_a_real_main_module(cluster):
    """On either start path: sys.argv is one value, and a cell's class and function pickle by reference from the
    cells' own __main__ (torch.save of a model, pickle round trips)."""
    got = cluster.run("import sys, io, pickle, torch\n"
                      "class Net(torch.nn.Module):\n"
                      "    def __init__(self):\n        super().__init__()\n        self.fc = torch.nn.Linear(2, 2)\n"
                      "def double(x):\n    return 2 * x\n"
                      "buf = io.BytesIO()\ntorch.save(Net(), buf)\n"
                      "(sys.argv, sys.modules['__main__'].Net is Net, type(pickle.loads(pickle.dumps(Net()))).__name__,"
                      " pickle.loads(pickle.dumps(double))(21))")
    assert got == [(["ddp-cell"], True, "Net", 42)] * cluster.world_size, got


def check_an_exception_names_its_rank_and_releases_the_others(cluster):
    """Rank world_size // 2 raises while the others wait in a collective: the report names it, its line and where
    each other rank was (never "raised"), the others are released (no timeout), and the names are kept."""
    from course_utils import DistributedError, DistributedTimeout

    n = cluster.world_size
    bad = n // 2
    cluster.run("persisted = rank + 100")
    with pytest.raises(DistributedError) as info:  # a 120 s limit: without the release, a DistributedTimeout
        cluster.run("import torch, torch.distributed as dist\n"
                    f"if rank == {bad}:\n    raise ValueError('bad shard')\ndist.all_reduce(torch.ones(1))",
                    timeout=120)
    e = info.value
    assert not isinstance(e, DistributedTimeout), "the waiting ranks must be released, not timed out"
    assert isinstance(e, RuntimeError)
    assert (e.rank, e.exc_type, e.exc_message) == (bad, "ValueError", "bad shard")
    text = str(e)
    assert f"rank {bad} failed with ValueError: bad shard" in text
    assert "raise ValueError('bad shard')" in text, "the traceback shows the code's own lines"
    for r in set(range(n)) - {bad}:  # where it was when the rank failed (its stack), or released from the
        assert re.search(rf"rank {r}: was (running|waiting)", text), text  # collective: never "raised"
    assert cluster.run("persisted") == [100 + r for r in range(n)], "soft recovery keeps the names"
    assert cluster.run("import torch, torch.distributed as dist\nt = torch.ones(1)\ndist.all_reduce(t)\nt.item()") \
        == [float(n)] * n


def check_settings_read_when_a_library_loads(monkeypatch, world_size):
    """TORCH_DISTRIBUTED_DEBUG and OPENBLAS_NUM_THREADS set in the notebook after the engine started reach a new
    cluster's ranks, though torch and numpy read them when they load (in the fork server, on that path)."""
    from course_utils import Cluster

    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "DETAIL")
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "1")
    with Cluster(world_size=world_size, backend="gloo") as c:
        got = c.run("import numpy, torch.distributed as dist\nfrom threadpoolctl import threadpool_info\n"
                    "(str(dist.get_debug_level()), sorted({p['num_threads'] for p in threadpool_info() "
                    "if p['internal_api'] == 'openblas'}))")  # numpy loads its OpenBLAS
    for level, blas in got:
        assert level.endswith("DETAIL"), level
        if not blas:
            pytest.skip("threadpoolctl finds no OpenBLAS in the ranks (numpy built against another BLAS): "
                        "OPENBLAS_NUM_THREADS cannot be checked here")
        assert blas == [1], f"OpenBLAS pools run {blas} threads with OPENBLAS_NUM_THREADS=1"


# ---- output, on a cluster of either start path -------------------------------------------------------------------
def check_output_is_prefixed_and_grouped(cluster, capfd, stagger_s=0.0):
    """Python, fd-level and C writes come back as whole "[rank N] " lines grouped in rank order (``stagger_s``: each
    higher rank prints that much earlier); stderr keeps its text and a warning is not prefixed twice."""
    cluster.run("import os, sys, ctypes, time, warnings\n"
                f"time.sleep({stagger_s} * (world_size - 1 - rank))\n"
                "print('py', rank)\n"
                "os.write(1, b'fd-level ' + str(rank).encode() + b'\\n')\n"
                "libc = ctypes.CDLL(None); libc.printf(b'from C %d\\n', rank)\n"
                "print('to stderr', file=sys.stderr)\n"
                "warnings.warn('careful')\n"
                "print()\n"
                "sys.stdout.write('no newline')")
    out, err = capfd.readouterr()
    ranks = range(cluster.world_size)
    expected = "".join(f"[rank {r}] py {r}\n[rank {r}] fd-level {r}\n[rank {r}] from C {r}\n[rank {r}] \n"
                       f"[rank {r}] no newline\n" for r in ranks)
    assert out == expected, f"stdout must be whole lines in rank order:\n{out}"
    for r in ranks:
        assert f"[rank {r}] to stderr\n" in err
        assert f"[rank {r}] Warning" not in err and "UserWarning: careful" in err


def check_output_to_sys_stdout_none_keeps_the_ranks(cluster, capfd):
    """A cell that sets sys.stdout = None leaves the same ranks, their names, and no engine frames in the output."""
    pids = list(cluster.pids)
    cluster.run_cell("import sys\nsys.stdout = None\nx = rank")
    err = capfd.readouterr().err
    assert cluster.run("x") == list(range(cluster.world_size)) and cluster.pids == pids
    assert "_worker.py" not in err, f"engine frames in the output:\n{err}"
    cluster.run_cell("import sys\nsys.stdout = sys.__stdout__")


def _cpu_seconds():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def check_output_after_fd_1_is_redirected(cluster, capfd):
    """A cell that redirects fd 1 finishes at once, the next cell's sleep is not stretched by the closed stdout
    pipe, the notebook does not spin on it, stderr still arrives, and the ranks keep their names. The cluster's
    ranks keep their stdout closed: it is shut down at the end."""
    cluster.run("kept = rank + 10")
    pids, last = list(cluster.pids), cluster.world_size - 1
    t0, cpu0 = time.monotonic(), _cpu_seconds()
    cluster.run_cell("import os, sys\nos.dup2(os.open(os.devnull, os.O_WRONLY), 1)\nprint('silenced')\n"
                     "print('still on stderr', file=sys.stderr)")
    cluster.run_cell("import time\ntime.sleep(2)")  # the closed stdout pipe must not keep the notebook busy
    took, cpu = time.monotonic() - t0, _cpu_seconds() - cpu0
    out, err = capfd.readouterr()
    assert took < 12, f"the cells took {took:.1f} s for 2 s of sleep: the notebook waited for output that never comes"
    assert cpu < 1.0, f"the notebook used {cpu:.2f} s of CPU in {took:.1f} s: a closed pipe is being polled"
    assert "silenced" not in out and f"[rank {last}] still on stderr" in err
    assert cluster.run("kept") == [10 + r for r in range(cluster.world_size)] and cluster.pids == pids, \
        "same ranks, names kept"
    cluster.shutdown()
