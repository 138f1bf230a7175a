"""The engine without Linux-only facilities: what macOS (and WSL2) learners get.

- A rank ends when the notebook process is gone through a watchdog thread (no PR_SET_PDEATHSIG,
  which is Linux-only and fires when the *thread* that started the rank exits).
- Ranks blocked in a collective are released by cutting their peer connections found without
  /proc (COURSE_UTILS_NO_PROC=1 switches the /proc path off on Linux).
"""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import ROOT, alive
from course_utils import Cluster, DistributedError, DistributedTimeout
from course_utils.engine import _forkstart


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
    c = Cluster(world_size=2, backend="gloo")
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


def test_ranks_end_when_the_notebook_dies_even_if_their_pipes_stay_open(tmp_path):
    # output to files, not pipes: multiprocessing's resource tracker (started with the fork server)
    # inherits the notebook's stdout and lives as long as the holder does, as it would with any
    # multiprocessing user; the ranks and the fork server must end anyway
    out, err = tmp_path / "out", tmp_path / "err"
    with open(out, "w") as o, open(err, "w") as e:
        proc = subprocess.Popen([sys.executable, "-c", NOTEBOOK.format(root=str(ROOT))], stdout=o, stderr=e,
                                env={k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"})
        proc.wait(timeout=180)
    assert proc.returncode == -signal.SIGKILL, err.read_text()[-2000:]
    started = json.loads(out.read_text())
    pids, holder, server = started["ranks"], started["holder"], started["server"]
    if _forkstart.wanted():  # the default on Linux; test_engine_spawn_start runs this test with fresh interpreters
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
