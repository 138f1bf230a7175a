"""The distributed cell engine with real processes: gloo, 2-4 ranks on CPU."""
import os
import signal
import time

import pytest

from conftest import children_of
from course_utils import Cluster, DistributedError, DistributedTimeout, launch


# -- results, names, functions --------------------------------------------------------------
def test_code_returns_last_expression_per_rank(cluster4):
    assert cluster4.run("rank * 10") == [0, 10, 20, 30]
    assert cluster4.run("x = 1") == [None] * 4, "a cell without a final expression gives None"
    assert cluster4.run("world_size") == [4] * 4


def test_names_persist_and_push_pull(cluster4):
    cluster4.run("persisted = rank + 100")
    assert cluster4.run("persisted") == [100, 101, 102, 103]
    cluster4.push(lr=0.5, label="hi")
    assert cluster4.pull("lr") == [0.5] * 4
    assert cluster4.run("label * (rank + 1)") == ["hi", "hihi", "hihihi", "hihihihi"]


def test_pull_of_unknown_name_is_a_clear_error(cluster4):
    with pytest.raises(NameError, match="'no_such_name' is not defined on ranks 0, 1, 2, 3"):
        cluster4.pull("no_such_name")
    cluster4.run("only_on_two = 1 if rank == 2 else None\nif rank != 2:\n    del only_on_two")
    with pytest.raises(NameError, match="not defined on ranks 0, 1, 3"):
        cluster4.pull("only_on_two")
    assert cluster4.run("rank") == [0, 1, 2, 3], "the cluster stays usable"


def test_functions_lambdas_closures_and_classes_are_sent_by_value(cluster4):
    scale = 3

    def times_rank(x):
        return x * rank * scale  # noqa: F821  (rank is predefined on every rank)

    class Point:
        def __init__(self, v):
            self.v = v

        def double(self):
            return Point(self.v * 2)

    assert cluster4.run(times_rank, 2) == [0, 6, 12, 18]
    assert cluster4.run(lambda a, b=1: a + b, 1, b=2) == [3] * 4
    points = cluster4.run(lambda: Point(5).double())
    assert [p.v for p in points] == [10] * 4


def test_torch_distributed_is_initialised_with_torchrun_env(cluster4):
    env = cluster4.run(
        "import os, torch.distributed as dist\n"
        "(dist.get_rank(), dist.get_world_size(), dist.get_backend(), str(device),"
        " [os.environ[k] for k in ('RANK', 'LOCAL_RANK', 'WORLD_SIZE', 'LOCAL_WORLD_SIZE', 'MASTER_ADDR')],"
        " int(os.environ['MASTER_PORT']) > 0, os.environ['OMP_NUM_THREADS'])")
    threads = str(max(1, len(os.sched_getaffinity(0)) // 4))
    for r, (rank, ws, backend, dev, env_vars, port_ok, omp) in enumerate(env):
        assert (rank, ws, backend, dev) == (r, 4, "gloo", "cpu")
        assert env_vars == [str(r), str(r), "4", "4", "127.0.0.1"]
        assert port_ok
        assert omp == threads, "each rank gets its share of the cores"


def test_collective_result(cluster4):
    out = cluster4.run("import torch\nt = torch.ones(1) * rank\ndist.all_reduce(t)\nt.item()")
    assert out == [6.0] * 4


# -- output -----------------------------------------------------------------------------------
def test_output_is_prefixed_grouped_and_includes_fd_level_writes(cluster4, capfd):
    cluster4.run(
        "import os, sys, ctypes, warnings\n"
        "print('py', rank)\n"
        "os.write(1, b'fd-level ' + str(rank).encode() + b'\\n')\n"
        "libc = ctypes.CDLL(None); libc.printf(b'from C %d\\n', rank)\n"
        "print('to stderr', file=sys.stderr)\n"
        "warnings.warn('careful')\n"
        "print()\n"
        "sys.stdout.write('no newline')")
    out, err = capfd.readouterr()
    expected = "".join(f"[rank {r}] py {r}\n[rank {r}] fd-level {r}\n[rank {r}] from C {r}\n[rank {r}] \n"
                       f"[rank {r}] no newline\n"
                       for r in range(4))
    assert out == expected, f"stdout must be whole lines in rank order:\n{out}"
    for r in range(4):
        assert f"[rank {r}] to stderr\n" in err
        assert f"[rank {r}] Warning" not in err and "UserWarning: careful" in err


# -- failures -----------------------------------------------------------------------------------
def test_exception_names_first_rank_and_releases_the_others(cluster4):
    cluster4.run("persisted = rank + 100")
    t0 = time.monotonic()
    with pytest.raises(DistributedError) as info:
        cluster4.run("import torch, torch.distributed as dist\n"
                     "if rank == 2:\n    raise ValueError('bad shard')\ndist.all_reduce(torch.ones(1))")
    assert time.monotonic() - t0 < 15, "the waiting ranks must be released within seconds"
    e = info.value
    assert isinstance(e, RuntimeError)
    assert (e.rank, e.exc_type, e.exc_message) == (2, "ValueError", "bad shard")
    text = str(e)
    assert "rank 2 failed with ValueError: bad shard" in text
    assert "raise ValueError('bad shard')" in text, "the traceback shows the code's own lines"
    for r in (0, 1, 3):
        assert f"rank {r}: then raised" in text and "in all_reduce()" in text
    assert cluster4.run("persisted") == [100, 101, 102, 103], "soft recovery keeps the names"
    assert cluster4.run("import torch\nt = torch.ones(1)\ndist.all_reduce(t)\nt.item()") == [4.0] * 4


def test_ranks_are_released_after_torch_dynamo_is_imported(cluster4):
    # The first optimizer or DDP wrapper imports torch._dynamo, after which destroying the process
    # group no longer closes gloo's sockets; the engine must release the waiting ranks anyway.
    cluster4.run("import torch, torch._dynamo, torch.distributed as dist\n"
                 "opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)")
    t0 = time.monotonic()
    with pytest.raises(DistributedError) as info:
        cluster4.run("if rank == 1:\n    raise ValueError('late')\ndist.all_reduce(torch.ones(1))")
    assert time.monotonic() - t0 < 10
    assert "rank 0: then raised" in str(info.value) and "names you defined are kept" in str(info.value)


def test_a_deadlock_is_released_without_losing_names(cluster4):
    cluster4.run("kept_through_deadlock = rank")
    with pytest.raises(DistributedTimeout) as info:  # every rank waits to receive first
        cluster4.run("import torch\nbuf = torch.zeros(1)\ndist.recv(buf, src=(rank + 1) % world_size)", timeout=3)
    assert "rank 0: stuck in recv()" in str(info.value)
    assert "names you defined are kept" in str(info.value)
    assert cluster4.pull("kept_through_deadlock") == [0, 1, 2, 3]


def test_a_bug_on_every_rank_is_blamed_on_the_lowest_rank_every_time(cluster4):
    for _ in range(3):
        with pytest.raises(DistributedError) as info:
            cluster4.run("import time\ntime.sleep(0.01 * (3 - rank))\nraise KeyError(rank)")
        assert info.value.rank == 0, "the blamed rank must not depend on which rank was fastest"
        assert "rank 3: then raised KeyError" in str(info.value)


def test_function_traceback_shows_its_source(cluster4):
    def faulty(x):
        y = x + 1
        return y / 0

    with pytest.raises(DistributedError) as info:
        cluster4.run(faulty, 1)
    assert "return y / 0" in str(info.value) and "ZeroDivisionError" in str(info.value)


def test_skipped_collective_times_out_with_stacks_and_recovers(cluster4):
    cluster4.run("import torch.distributed as dist\npersisted = rank + 100")
    t0 = time.monotonic()
    with pytest.raises(DistributedTimeout) as info:
        cluster4.run("if rank != 3:\n    dist.barrier()", timeout=3)
    elapsed = time.monotonic() - t0
    assert 3 <= elapsed < 20
    e = info.value
    assert isinstance(e, TimeoutError) and isinstance(e, DistributedError)
    text = str(e)
    assert "ranks 0, 1, 2 did not finish within 3 s" in text and "rank 3 finished" in text
    assert "rank 0: stuck in barrier()" in text
    assert "Python stack of rank 1" in text and "distributed_c10d.py" in text
    assert cluster4.run("rank") == [0, 1, 2, 3]
    assert cluster4.run("persisted") == [100, 101, 102, 103]


def test_endless_loop_times_out_and_idle_time_does_not_count(cluster4):
    cluster4.run("import torch._dynamo")  # the ranks' idle-time pre-import is over (or done now)
    time.sleep(2.5)  # idle between cells: must not count towards the next call's timeout
    assert cluster4.run("import time\ntime.sleep(1.0)\nrank", timeout=3) == [0, 1, 2, 3]
    with pytest.raises(DistributedTimeout) as info:
        cluster4.run("import time\nwhile rank == 1:\n    time.sleep(0.05)", timeout=2)
    assert "rank 1 did not finish" in str(info.value)
    assert "rank 1: stuck" in str(info.value) and "time.sleep(0.05)" in str(info.value)
    assert cluster4.run("rank") == [0, 1, 2, 3]


@pytest.mark.parametrize("code, how", [
    ("os._exit(3)", "exited with code 3"),
    ("os.kill(os.getpid(), signal.SIGKILL)", "was killed by SIGKILL"),
    ("ctypes.string_at(0)", "was killed by SIGSEGV"),
])
def test_dead_worker_is_reported_and_replaced(code, how):
    with Cluster(world_size=2, backend="gloo", timeout=30) as c:
        t0 = time.monotonic()
        with pytest.raises(DistributedError) as info:
            c.run(f"import os, signal, ctypes, torch\nif rank == 1:\n    {code}\ndist.all_reduce(torch.ones(1))")
        assert time.monotonic() - t0 < 30
        assert f"rank 1 died: it {how}" in str(info.value)
        assert c.run("rank") == [0, 1], "the cluster replaces its ranks and stays usable"


# -- bad input --------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, words", [
    ({"world_size": 0}, "world_size must be an integer >= 1"),
    ({"world_size": 2, "backend": "mpi"}, "unknown backend 'mpi'"),
    ({"world_size": 2, "backend": "nccl"}, "needs one GPU per rank"),
    ({"world_size": 2, "timeout": -1}, "timeout must be a positive number"),
])
def test_bad_arguments_raise_value_error(kwargs, words):
    with pytest.raises(ValueError, match=words):
        Cluster(**kwargs)


def test_syntax_error_is_reported_before_any_rank_runs(cluster4):
    from course_utils import CellSyntaxError

    cluster4.run("marker = 'before'")
    with pytest.raises(CellSyntaxError, match="invalid syntax") as info:
        cluster4.run("marker = 'after'\nx = = 1")
    assert isinstance(info.value, ValueError) and "x = = 1" in str(info.value)
    assert cluster4.pull("marker") == ["before"] * 4, "nothing may run when the cell does not parse"


def test_unpicklable_argument_is_named(cluster4):
    import threading

    with pytest.raises(ValueError, match=r"argument 0 \(lock\) cannot be sent"):
        cluster4.run(lambda lock: 1, threading.Lock())
    with pytest.raises(ValueError, match="push: guard cannot be sent"):
        cluster4.push(guard=threading.Lock())
    with pytest.raises(ValueError, match="arguments are only for functions"):
        cluster4.run("1", 2)


# -- launch, security, leaks ------------------------------------------------------------------------------
def test_launch_runs_once_and_leaves_nothing(cluster4):
    def job(base):
        import torch.distributed as dist
        return base + dist.get_rank()

    before = set(children_of(os.getpid()))
    assert launch(job, 10, world_size=3, backend="gloo") == [10, 11, 12]
    assert set(children_of(os.getpid())) == before


def _listening_addresses(pids):
    """Local addresses of the TCP sockets the given processes listen on."""
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


def test_every_socket_listens_on_loopback_only(cluster4):
    pids = cluster4.pids
    addrs = _listening_addresses(pids)
    assert addrs, "the ranks should be listening somewhere (store, gloo): the check would be vacuous"
    loopback = {"0100007F", "00000000000000000000000001000000", "0000000000000000FFFF00000100007F"}
    assert set(addrs) <= loopback, f"a socket listens beyond 127.0.0.1: {addrs}"


def test_repeated_launches_leak_no_processes_or_fds():
    def open_fds():
        return len(os.listdir("/proc/self/fd"))

    launch(lambda: 0, world_size=2, backend="gloo")  # warm imports
    fds, kids = open_fds(), set(children_of(os.getpid()))
    for _ in range(3):
        assert launch(lambda: rank, world_size=2, backend="gloo") == [0, 1]  # noqa: F821
    assert open_fds() == fds, "file descriptors leaked"
    assert set(children_of(os.getpid())) == kids, "worker processes leaked"


def test_restart_and_shutdown():
    c = Cluster(world_size=2, backend="gloo")
    old = list(c.pids)
    c.run("kept = 1")
    c.restart()
    assert c.pids != old
    with pytest.raises(NameError, match="not defined"):
        c.pull("kept")
    c.shutdown()
    c.shutdown()  # twice is fine
    assert not c.alive
    for pid in old + c.pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert signal.SIGINT  # (imported for the parametrised cases)
