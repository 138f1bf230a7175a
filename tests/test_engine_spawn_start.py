"""The engine's start-up promises on the fallback path: ranks as fresh interpreters (COURSE_UTILS_START=spawn).

test_engine.py and the other engine modules run on the default path (ranks forked from the per-process fork
server that has torch imported). This module checks again, with the fallback forced, what the start path
changes: start-up, environment and imports, output capture, failures, hangs, dead ranks, interrupts while
starting, loopback-only sockets, leaks, ranks ending with the notebook, and the fallback's one-time note.

A fresh interpreter costs about 6 CPU-s to start (it imports torch), so the checks share one 2-rank cluster
(``fresh``) and the others start as few ranks as their check needs: 16 starts in all. What the fork path alone
can break (BLAS after a fork, the server's idle imports) and what both paths share (how each kind of death is
named, restart(), the rank finder) is tested in test_engine.py and test_engine_faults.py only.
"""
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from conftest import ROOT, alive
from engine_helpers import check_multiprocessing_with_cell_code
from course_utils import Cluster, DistributedError, DistributedTimeout, launch
from course_utils.engine import _forkstart

AT_START = {}  # what the shared cluster's ranks had imported before their first cell


@pytest.fixture(scope="module", autouse=True)
def start_fresh_interpreters():
    saved = os.environ.get("COURSE_UTILS_START")
    os.environ["COURSE_UTILS_START"] = "spawn"
    yield
    if saved is None:
        os.environ.pop("COURSE_UTILS_START", None)
    else:
        os.environ["COURSE_UTILS_START"] = saved


@pytest.fixture(scope="module")
def fresh(make_cluster):
    """The module's 2-rank cluster of fresh interpreters; its first cell records what they had imported."""
    c = make_cluster(2, timeout=30)
    if "imports" not in AT_START:
        AT_START["imports"] = c.run("import sys\n'torch.distributed.nn' in sys.modules, 'torch._dynamo' in sys.modules")
    return c


# -- start-up and environment -------------------------------------------------------------------------------------
def test_ranks_are_fresh_interpreters_with_torchruns_environment_and_their_share_of_the_cores(fresh):
    from course_utils.engine.launcher import _cpu_count

    got = fresh.run(
        "import os, sys, torch, torch.distributed as dist\n"
        "('pytest' in sys.modules, os.getppid(), sys.modules['course_utils.engine._worker'].__name__,"
        " dist.get_rank(), dist.get_world_size(), dist.get_backend(), str(device), local_rank,"
        " [os.environ[k] for k in ('RANK', 'LOCAL_RANK', 'WORLD_SIZE', 'LOCAL_WORLD_SIZE', 'MASTER_ADDR')],"
        " int(os.environ['MASTER_PORT']) > 0, os.environ['OMP_NUM_THREADS'], torch.get_num_threads())")
    share = max(1, _cpu_count() // 2)
    for r, (pytest_loaded, ppid, worker, rank, ws, backend, dev, local_rank, env, port_ok, omp, threads) \
            in enumerate(got):
        assert not pytest_loaded and ppid == os.getpid(), "a fresh interpreter started by this process, not a fork"
        assert worker == "course_utils.engine._worker", "the worker module is imported, never __main__"
        assert (rank, ws, backend, dev, local_rank) == (r, 2, "gloo", "cpu", r)
        assert env == [str(r), str(r), "2", "2", "127.0.0.1"] and port_ok
        assert omp == str(share) and threads == share, f"rank {r}: {omp}/{threads} threads, its share is {share}"


def test_torch_distributed_nn_comes_before_the_group_torch_dynamo_later_and_ddp_works(fresh):
    """torch._dynamo (1-4 s) was imported on every start of a fresh interpreter; torch.distributed.nn
    must come before the group, or its default arguments capture it once torch._dynamo imports it."""
    assert AT_START["imports"] == [(True, False)] * 2, AT_START
    got = fresh.run("import torch, torch.distributed as dist\n"
                    "torch.optim.AdamW(torch.nn.Linear(2, 2).parameters())  # imports torch._dynamo lazily\n"
                    "import torch.distributed.nn.functional as F\n"
                    "model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))\n"
                    "(F.broadcast.__defaults__, type(model).__name__)")
    assert got == [((None,), "DistributedDataParallel")] * 2, f"a live group captured as a default, or no DDP: {got}"


def test_the_ranks_argv_is_one_value_and_cells_run_in_a_real_main_module(fresh):
    got = fresh.run("import sys, io, pickle, torch\n"
                    "class Net(torch.nn.Module):\n"
                    "    def __init__(self):\n        super().__init__()\n        self.fc = torch.nn.Linear(2, 2)\n"
                    "def double(x):\n    return 2 * x\n"
                    "buf = io.BytesIO()\ntorch.save(Net(), buf)\n"
                    "(sys.argv, sys.modules['__main__'].Net is Net, type(pickle.loads(pickle.dumps(Net()))).__name__,"
                    " pickle.loads(pickle.dumps(double))(21))")
    assert got == [(["ddp-cell"], True, "Net", 42)] * 2, got


def test_multiprocessing_on_a_rank_works_with_what_the_cells_define_in_every_context(fresh):
    """As on forked ranks: the worker module is imported, not run as __main__, so what it pickles by value is
    the cells' code only (run as __main__ it re-sent its own loader until pickling gave up)."""
    check_multiprocessing_with_cell_code(fresh)


def test_every_socket_listens_on_loopback_only(fresh):
    from engine_helpers import LOOPBACK, listening_addresses

    addrs = listening_addresses(fresh.pids)
    assert addrs, "the ranks should be listening somewhere (store, gloo): the check would be vacuous"
    assert set(addrs) <= LOOPBACK, f"a socket listens beyond 127.0.0.1: {addrs}"


# -- output ----------------------------------------------------------------------------------------------------------
def test_output_is_prefixed_grouped_by_rank_and_includes_fd_level_writes(fresh, capfd):
    fresh.run("import os, sys, ctypes, time, warnings\n"
              "time.sleep(0.5 * (world_size - 1 - rank))  # rank 1 prints first, most of the time\n"
              "print('py', rank)\n"
              "os.write(1, b'fd-level ' + str(rank).encode() + b'\\n')\n"
              "libc = ctypes.CDLL(None); libc.printf(b'from C %d\\n', rank)\n"
              "print('to stderr', file=sys.stderr)\n"
              "warnings.warn('careful')\n"
              "print()\n"
              "sys.stdout.write('no newline')")
    out, err = capfd.readouterr()
    expected = "".join(f"[rank {r}] py {r}\n[rank {r}] fd-level {r}\n[rank {r}] from C {r}\n[rank {r}] \n"
                       f"[rank {r}] no newline\n" for r in range(2))
    assert out == expected, f"stdout must be whole lines in rank order:\n{out}"
    for r in range(2):
        assert f"[rank {r}] to stderr\n" in err
        assert f"[rank {r}] Warning" not in err and "UserWarning: careful" in err


def test_a_cell_that_sets_sys_stdout_to_none_does_not_kill_the_rank(fresh, capfd):
    pids = list(fresh.pids)
    fresh.run_cell("import sys\nsys.stdout = None\nx = rank")
    err = capfd.readouterr().err
    assert fresh.run("x") == [0, 1] and fresh.pids == pids
    assert "_worker.py" not in err, f"engine frames in the output:\n{err}"
    fresh.run_cell("import sys\nsys.stdout = sys.__stdout__")


def test_a_cell_that_redirects_fd_1_finishes_at_once_and_keeps_the_names(make_cluster, capfd):
    c = make_cluster(1, timeout=21)  # its own rank: its stdout stays closed
    c.run("kept = rank + 10")
    pids = list(c.pids)
    t0 = time.monotonic()
    c.run_cell("import os, sys\nos.dup2(os.open(os.devnull, os.O_WRONLY), 1)\nprint('silenced')\n"
               "print('still on stderr', file=sys.stderr)")
    c.run_cell("import time\ntime.sleep(2)")  # the closed stdout pipe must not keep the notebook busy
    took = time.monotonic() - t0
    out, err = capfd.readouterr()
    assert took < 12, f"the cells took {took:.1f} s for 2 s of sleep: the notebook waited for output that never comes"
    assert "silenced" not in out and "[rank 0] still on stderr" in err
    assert c.run("kept") == [10] and c.pids == pids, "same rank, names kept"
    c.shutdown()


# -- failures, hangs, deaths -------------------------------------------------------------------------------------------
def test_an_exception_names_its_rank_and_releases_the_other(fresh):
    fresh.run("persisted = rank + 100")
    with pytest.raises(DistributedError) as info:  # a 120 s limit: without the release, a DistributedTimeout
        fresh.run("import torch, torch.distributed as dist\n"
                  "if rank == 1:\n    raise ValueError('bad shard')\ndist.all_reduce(torch.ones(1))", timeout=120)
    e = info.value
    assert not isinstance(e, DistributedTimeout), "the waiting rank must be released, not timed out"
    assert (e.rank, e.exc_type, e.exc_message) == (1, "ValueError", "bad shard")
    assert "raise ValueError('bad shard')" in str(e), str(e)
    assert "rank 0: was running" in str(e) or "rank 0: was waiting in all_reduce()" in str(e), str(e)
    assert fresh.run("persisted") == [100, 101], "soft recovery keeps the names"
    assert fresh.run("import torch, torch.distributed as dist\nt = torch.ones(1)\ndist.all_reduce(t)\nt.item()") \
        == [2.0, 2.0]


def test_a_skipped_collective_times_out_with_the_stack_and_recovers(fresh):
    fresh.run("import torch.distributed as dist\npersisted = rank + 100")
    with pytest.raises(DistributedTimeout) as info:
        fresh.run("if rank != 1:\n    dist.barrier()", timeout=3)
    text = str(info.value)
    assert "rank 0 did not finish within 3 s" in text and "rank 1 finished" in text, text
    assert "rank 0: stuck in barrier()" in text and "Python stack of rank 0" in text, text
    assert fresh.run("persisted") == [100, 101]


def test_a_dead_rank_is_reported_and_replaced_by_ranks_with_their_own_random_state(fresh, capfd):
    code = "import torch, numpy\n(torch.initial_seed(), float(torch.rand(())), float(numpy.random.rand()))"
    before = fresh.run(code)
    assert before[0] != before[1], f"both ranks have the same random state: {before}"
    pids = list(fresh.pids)
    with pytest.raises(DistributedError) as info:  # a death is seen at once; the limit would be a DistributedTimeout
        fresh.run("import os, signal, torch, torch.distributed as dist\nif rank == 1:\n"
                  "    print('last words', flush=True)\n    os.kill(os.getpid(), signal.SIGKILL)\n"
                  "dist.all_reduce(torch.ones(1))", timeout=120)
    assert not isinstance(info.value, DistributedTimeout)
    assert "rank 1 died: it was killed by SIGKILL" in str(info.value), str(info.value)
    assert "[rank 1] last words\n" in capfd.readouterr().out, "what a rank printed before it died is kept"
    assert fresh.run("rank") == [0, 1] and fresh.pids != pids, "the cluster replaces its ranks and stays usable"
    after = fresh.run(code)
    assert not set(before) & set(after), f"the new ranks repeat a random state: {before} then {after}"


# -- starting and ending -----------------------------------------------------------------------------------------------
def test_interrupt_while_the_ranks_start_leaves_no_rank_running(monkeypatch):
    """One stop, as one click of the stop button, once both ranks run (and block before they say they are ready)."""
    from engine_helpers import ranks_below

    if not os.path.isdir("/proc/self"):
        pytest.skip("finds the ranks in /proc")
    monkeypatch.setenv("COURSE_UTILS_TEST_HOLD_START_S", "30")  # every rank blocks before it says it is ready
    before = ranks_below(os.getpid())  # other clusters' ranks (the module's) are not this start's
    seen, done = set(), threading.Event()

    def stop_once_both_ranks_run():  # not a fixed delay: a fresh interpreter takes seconds to get there
        deadline = time.monotonic() + 120
        while not done.is_set() and time.monotonic() < deadline:
            seen.update(ranks_below(os.getpid()) - before)
            if len(seen) >= 2:
                os.kill(os.getpid(), signal.SIGINT)
                return
            time.sleep(0.05)

    # SIGINT raises KeyboardInterrupt as it does in a kernel while a cell runs, also in a suite started in the
    # background, which inherits SIGINT ignored (see test_engine_faults.py)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    stopper = threading.Thread(target=stop_once_both_ranks_run, daemon=True)
    stopper.start()
    made = []
    try:
        with pytest.raises(KeyboardInterrupt):
            made.append(Cluster(world_size=2, backend="gloo"))
    finally:
        done.set()
        stopper.join()
        signal.signal(signal.SIGINT, previous)
        for c in made:
            c.shutdown()
    assert not made and len(seen) == 2, f"the stop must land while both ranks start (saw {seen})"
    deadline = time.monotonic() + 10
    while True:
        ranks = ranks_below(os.getpid()) - before
        if not ranks or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert not ranks, f"ranks left running after a stop during start: {ranks}"


def test_settings_read_when_a_library_loads_follow_the_notebooks_environment(monkeypatch):
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "DETAIL")
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "1")
    with Cluster(world_size=1, backend="gloo") as c:
        (level, blas), = c.run("import numpy, torch.distributed as dist\nfrom threadpoolctl import threadpool_info\n"
                               "(str(dist.get_debug_level()), sorted({p['num_threads'] for p in threadpool_info() "
                               "if p['internal_api'] == 'openblas'}))")  # numpy loads its OpenBLAS
    assert level.endswith("DETAIL"), level
    if not blas:
        pytest.skip("threadpoolctl finds no OpenBLAS in the ranks (numpy built against another BLAS): "
                    "OPENBLAS_NUM_THREADS cannot be checked here")
    assert blas == [1], f"OpenBLAS pools run {blas} threads with OPENBLAS_NUM_THREADS=1"


def test_repeated_launches_leak_no_processes_or_fds():
    def open_fds():
        return len(os.listdir("/proc/self/fd" if os.path.isdir("/proc/self/fd") else "/dev/fd"))

    launch(lambda: 0, world_size=1, backend="gloo")  # warm imports
    fds, launches, pids = open_fds(), 3, []
    for _ in range(launches):
        pids += launch(lambda: os.getpid(), world_size=1, backend="gloo")
    # a leaking engine leaks 4 or more per launch (4 pipes per rank); a stray thread elsewhere, a few once
    assert open_fds() - fds < launches, f"file descriptors leaked: {open_fds() - fds} over {launches} launches"
    assert not [p for p in pids if alive(p)], "rank processes leaked"


NOTEBOOK = textwrap.dedent("""
    import json, os, sys, time
    sys.path.insert(0, {root!r})
    from course_utils import Cluster
    c = Cluster(world_size=1, backend="gloo")
    holder = os.fork()
    if holder == 0:          # a child of the notebook that keeps every pipe to the ranks open
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1)     # (but not the test's stdout: the test reads it to the end)
        os.dup2(null, 2)
        time.sleep(120)
        os._exit(0)
    print(json.dumps({{"ranks": c.pids, "holder": holder}}), flush=True)
    os.kill(os.getpid(), 9)  # the notebook dies without a word
""")


def test_ranks_end_when_the_notebook_dies_even_if_their_pipes_stay_open(tmp_path):
    out, err = tmp_path / "out", tmp_path / "err"
    with open(out, "w") as o, open(err, "w") as e:
        proc = subprocess.Popen([sys.executable, "-c", NOTEBOOK.format(root=str(ROOT))], stdout=o, stderr=e,
                                env={k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"})
        proc.wait(timeout=180)
    assert proc.returncode == -signal.SIGKILL, err.read_text()[-2000:]
    started = json.loads(out.read_text())
    try:
        deadline = time.monotonic() + 20
        while any(alive(p) for p in started["ranks"]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in started["ranks"] if alive(p)], "the ranks outlived the notebook process"
    finally:
        try:
            os.kill(started["holder"], signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_a_server_that_cannot_start_falls_back_to_fresh_interpreters_with_one_note(monkeypatch, capfd):
    def cannot_start():
        raise OSError("no fork server here")

    monkeypatch.setenv("COURSE_UTILS_START", "forkserver")  # ask for the server (the default on Linux)
    monkeypatch.setattr(_forkstart, "_state", {"ctx": None, "failed": None, "noted": False, "restarted": False,
                                               "retired": [], "b": None})
    monkeypatch.setattr(_forkstart, "_start_server", cannot_start)
    where = []
    for _ in range(2):
        with Cluster(world_size=1, backend="gloo") as c:
            where += c.run("import os\nos.getppid()")
    err = capfd.readouterr().err
    assert where == [os.getpid()] * 2, f"not fresh interpreters (started by this process): {where}"
    assert err.count("note: the ranks start as fresh interpreters") == 1, err
    assert "no fork server here" in err, "the note says why"
