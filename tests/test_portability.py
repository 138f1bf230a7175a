"""The engine without Linux-only facilities: what macOS (and WSL2) learners get.

- A rank ends when the notebook process is gone through a watchdog thread (no PR_SET_PDEATHSIG,
  which is Linux-only and fires when the *thread* that started the rank exits).
- Ranks blocked in a collective are released by cutting their peer connections found without
  /proc (COURSE_UTILS_NO_PROC=1 switches the /proc path off on Linux).
- What must hold on both start paths, the fork server (Linux's default) and fresh interpreters (macOS's), runs
  once on each (``start_path``): a stop during a start, repeated launches, the notebook's death.
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
from engine_helpers import ranks_below
from course_utils import Cluster, DistributedError, DistributedTimeout, launch
from course_utils.engine import _forkstart


@pytest.fixture(params=["fork_server", "fresh_interpreters"])
def start_path(request, monkeypatch):
    """The test's ranks start from the fork server (as the suite's environment has it: the default on Linux) or as
    fresh interpreters (COURSE_UTILS_START=spawn, inherited by a child notebook process too)."""
    if request.param == "fresh_interpreters":
        monkeypatch.setenv("COURSE_UTILS_START", "spawn")
    return request.param


@pytest.fixture(scope="module")
def no_proc_cluster():
    os.environ["COURSE_UTILS_NO_PROC"] = "1"  # inherited by the ranks started here
    try:
        c = Cluster(world_size=3, backend="gloo", timeout=120)
    finally:
        del os.environ["COURSE_UTILS_NO_PROC"]
    yield c
    c.shutdown()


def test_the_fd_scan_finds_what_proc_lists(no_proc_cluster):
    got = no_proc_cluster.run("import os\nfrom course_utils.engine import _worker\n"
                              "(os.environ.get('COURSE_UTILS_NO_PROC'), sorted(_worker._open_fds()),"
                              " sorted(int(n) for n in os.listdir('/proc/self/fd'))"
                              " if os.path.isdir('/proc') else None)")
    for switch, scanned, listed in got:
        assert switch == "1"
        if listed is not None:  # Linux: the scan sees every descriptor /proc lists (but its own listing's)
            assert set(scanned) <= set(listed) and len(set(listed) - set(scanned)) <= 1, (scanned, listed)


def test_ranks_are_released_without_proc_after_torch_dynamo_is_imported(no_proc_cluster):
    c = no_proc_cluster
    c.run("import torch, torch._dynamo, torch.distributed as dist\nkept = rank\n"
          "opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)")
    with pytest.raises(DistributedError) as info:  # without the cut, a DistributedTimeout after 120 s
        c.run("if rank == 1:\n    raise ValueError('late')\ndist.all_reduce(torch.ones(1))")
    assert not isinstance(info.value, DistributedTimeout)
    assert ("rank 0: was waiting in all_reduce()" in str(info.value) or "rank 0: was running" in str(info.value)) \
        and "names you defined are kept" in str(info.value), str(info.value)
    assert c.pull("kept") == [0, 1, 2]


def test_a_deadlock_is_released_without_proc(no_proc_cluster):
    c = no_proc_cluster
    c.run("kept_too = rank")
    with pytest.raises(DistributedTimeout, match=r"rank 0: stuck in recv\(\)"):
        c.run("import torch, torch.distributed as dist\nbuf = torch.zeros(1)\n"
              "dist.recv(buf, src=(rank + 1) % world_size)", timeout=3)
    assert c.pull("kept_too") == [0, 1, 2]


NOTEBOOK = textwrap.dedent("""
    import json, os, sys, time
    sys.path.insert(0, {root!r})
    from course_utils import Cluster
    from course_utils.engine import _forkstart
    c = Cluster(world_size={world_size}, backend="gloo")
    holder = os.fork()
    if holder == 0:          # a child of the notebook that keeps every pipe to the ranks open
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1)     # (but not the test's stdout: the test reads it to the end)
        os.dup2(null, 2)
        time.sleep(120)
        os._exit(0)
    server = _forkstart._state["ctx"] and _forkstart._state["ctx"].pid  # None: the ranks are fresh interpreters
    print(json.dumps({{"ranks": c.pids, "holder": holder, "server": server}}), flush=True)
    os.kill(os.getpid(), 9)  # the notebook dies without a word
""")


def test_ranks_end_when_the_notebook_dies_even_if_their_pipes_stay_open(tmp_path, start_path):
    # output to files, not pipes: multiprocessing's resource tracker (started with the fork server)
    # inherits the notebook's stdout and lives as long as the holder does, as it would with any
    # multiprocessing user; the ranks and the fork server must end anyway
    out, err = tmp_path / "out", tmp_path / "err"
    notebook = NOTEBOOK.format(root=str(ROOT), world_size=1 if start_path == "fresh_interpreters" else 2)
    with open(out, "w") as o, open(err, "w") as e:
        proc = subprocess.Popen([sys.executable, "-c", notebook], stdout=o, stderr=e,
                                env={k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"})
        proc.wait(timeout=180)
    assert proc.returncode == -signal.SIGKILL, err.read_text()[-2000:]
    started = json.loads(out.read_text())
    pids, holder, server = started["ranks"], started["holder"], started["server"]
    if _forkstart.wanted():  # the fork server's path: it must end too
        assert server is not None and server not in pids, f"no fork server found: {started}"
    try:
        deadline = time.monotonic() + 20
        while any(alive(p) for p in [*pids, server] if p) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in pids if alive(p)], "the ranks outlived the notebook process"
        assert not (server and alive(server)), f"the fork server (pid {server}) outlived the notebook process"
    finally:
        try:
            os.kill(holder, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_interrupt_while_the_ranks_start_leaves_no_rank_running(monkeypatch, start_path):
    """Run alone, first or after other tests: the ranks are found wherever they are (children of the fork server,
    which this very start may create, or of this process). One stop, as one click of the stop button: a stop the
    engine lost would fail here."""
    if not os.path.isdir("/proc/self"):
        pytest.skip("finds the ranks in /proc")
    monkeypatch.setenv("COURSE_UTILS_TEST_HOLD_START_S", "30")  # every rank blocks before it says it is ready
    before = ranks_below(os.getpid())  # other clusters' ranks (module fixtures) are not this start's
    seen, done = set(), threading.Event()

    def stop_once_both_ranks_run():  # not a fixed delay: a start may start the fork server or import torch
        deadline = time.monotonic() + 120
        while not done.is_set() and time.monotonic() < deadline:
            seen.update(ranks_below(os.getpid()) - before)
            if len(seen) >= 2:
                os.kill(os.getpid(), signal.SIGINT)
                return
            time.sleep(0.05)

    # SIGINT raises KeyboardInterrupt here as it does in a kernel while a cell runs (ipykernel installs Python's
    # handler for the cell), also in a suite started in the background by a non-interactive shell, which inherits
    # SIGINT ignored (Python then installs no handler and the stop would never arrive)
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


def test_repeated_launches_leak_no_processes_or_fds(start_path):
    def open_fds():
        return len(os.listdir("/proc/self/fd" if os.path.isdir("/proc/self/fd") else "/dev/fd"))

    size, launches = (1, 3) if start_path == "fresh_interpreters" else (2, 4)  # a fresh interpreter: ~6 CPU-s
    launch(lambda: 0, world_size=size, backend="gloo")  # warm imports
    fds, pids = open_fds(), []
    for _ in range(launches):
        pids += launch(lambda: os.getpid(), world_size=size, backend="gloo")
    # a leaking engine leaks 4 or more per rank and launch (4 pipes per rank); a stray thread elsewhere, a few once
    assert open_fds() - fds < launches, f"file descriptors leaked: {open_fds() - fds} over {launches} launches"
    assert not [p for p in pids if alive(p)], "rank processes leaked"
