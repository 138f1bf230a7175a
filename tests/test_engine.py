"""The distributed cell engine with real processes: gloo, 2-4 ranks on CPU.

Every test defines the names and imports it uses, so the module's tests pass in any order on
the shared 4-rank cluster. Time limits are at least 5x what the engine needs on a loaded machine:
a release that fails shows up as a DistributedTimeout (the cell's limit), not as a slow pass.
"""
import os
import re
import signal
import threading
import time

import pytest

from conftest import alive
from engine_helpers import (check_an_exception_names_its_rank_and_releases_the_others,
                            check_output_is_prefixed_and_grouped)
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
        "(dist.get_rank(), dist.get_world_size(), dist.get_backend(), str(device), local_rank,"
        " [os.environ[k] for k in ('RANK', 'LOCAL_RANK', 'WORLD_SIZE', 'LOCAL_WORLD_SIZE', 'MASTER_ADDR')],"
        " int(os.environ['MASTER_PORT']) > 0, os.environ['OMP_NUM_THREADS'])")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = str(max(1, cores // 4))
    for r, (rank, ws, backend, dev, local_rank, env_vars, port_ok, omp) in enumerate(env):
        assert (rank, ws, backend, dev, local_rank) == (r, 4, "gloo", "cpu", r)
        assert env_vars == [str(r), str(r), "4", "4", "127.0.0.1"]
        assert port_ok
        assert omp == threads, "each rank gets its share of the cores"


def test_collective_result(cluster4):
    out = cluster4.run("import torch, torch.distributed as dist\n"
                       "t = torch.ones(1) * rank\ndist.all_reduce(t)\nt.item()")
    assert out == [6.0] * 4


def test_ranks_are_forks_of_the_torch_server_or_fresh_interpreters(cluster4):
    # never a fork of this process, which would carry pytest's modules and state; by default a fork
    # of the per-process fork server (torch preloaded), with COURSE_UTILS_START=spawn a fresh interpreter
    import psutil

    from course_utils.engine import _forkstart

    got = cluster4.run("import os, sys\n('pytest' in sys.modules, os.getppid())")
    assert [pytest_loaded for pytest_loaded, _ in got] == [False] * 4
    parents = {ppid for _, ppid in got}
    assert len(parents) == 1
    if _forkstart.wanted():
        # the first server (A), a child of this process, or, once it is ready, the second (B), a child of A
        server = psutil.Process(parents.pop())
        servers = [server] if server.ppid() == os.getpid() else [server, psutil.Process(server.ppid())]
        assert servers[-1].ppid() == os.getpid(), f"the ranks' server does not descend from this process: {servers}"
        for s in servers:
            assert "_forkstart import serve" in " ".join(s.cmdline()), f"not a fork server: {s.cmdline()}"
    else:
        assert parents == {os.getpid()}
        # run as `python -m course_utils.engine._worker`: the engine's module was the interpreter's main
        assert cluster4.run("import sys\nsys.modules['course_utils.engine._worker'].__name__") == ["__main__"] * 4


def test_each_rank_runs_with_its_share_of_the_cores_and_blas_works(make_cluster):
    # the thread count is applied after the fork (OMP_NUM_THREADS is read when torch loads); BLAS
    # (OpenBLAS/MKL, whose threads the fork server may have started) computes right on every rank
    import numpy as np

    from course_utils.engine.launcher import _cpu_count

    for world_size in (1, 2):
        cluster = make_cluster(world_size=world_size, backend="gloo")
        share = max(1, _cpu_count() // world_size)
        # Errors against the rounding bounds, not sums compared across thread counts (a blocked sum's rounding
        # depends on the thread count, and a sum of random entries may cancel). Each product element is
        # within n * eps * (|a| @ |a|) of the exact one (n = 300 terms); LU's backward error for a random
        # matrix is ~1e-16, far below 1e-10. A BLAS broken by the fork computes garbage: errors of order 1.
        got = cluster.run("import numpy as np, torch\n"
                          "a = np.random.default_rng(0).standard_normal((300, 300))\n"
                          "exact = np.einsum('ij,jk->ik', a, a, optimize=False)  # no BLAS: a loop in numpy\n"
                          "scale = np.abs(a) @ np.abs(a)\n"
                          "x = np.linalg.solve(a, np.ones(300))\n"
                          "t = torch.from_numpy(a)\n"
                          "(torch.get_num_threads(), float((np.abs(a @ a - exact) / scale).max()),\n"
                          " float((np.abs((t @ t).numpy() - exact) / scale).max()),\n"
                          " float(np.abs(a @ x - 1).max() / (np.abs(a).sum(1).max() * np.abs(x).max())))", timeout=120)
        bound = 2 * 300 * np.finfo(np.float64).eps  # both the product and the reference round: twice the bound
        for threads, numpy_err, torch_err, solve_err in got:
            assert threads == share
            assert numpy_err <= bound and torch_err <= bound, (numpy_err, torch_err, bound)
            assert solve_err < 1e-10, f"np.linalg.solve's backward error {solve_err:.1e}: BLAS/LAPACK is broken"


# -- output -----------------------------------------------------------------------------------
def test_output_is_prefixed_grouped_and_includes_fd_level_writes(cluster4, capfd):
    check_output_is_prefixed_and_grouped(cluster4, capfd)


# -- failures -----------------------------------------------------------------------------------
def test_exception_names_first_rank_and_releases_the_others(cluster4):
    check_an_exception_names_its_rank_and_releases_the_others(cluster4)

def test_ranks_are_released_after_torch_dynamo_is_imported(cluster4):
    # The first optimizer or DDP wrapper imports torch._dynamo, after which destroying the process
    # group no longer closes gloo's sockets; the engine must release the waiting ranks anyway.
    cluster4.run("import torch, torch._dynamo, torch.distributed as dist\n"
                 "opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)")
    with pytest.raises(DistributedError) as info:
        cluster4.run("if rank == 1:\n    raise ValueError('late')\ndist.all_reduce(torch.ones(1))", timeout=120)
    assert not isinstance(info.value, DistributedTimeout), "the waiting ranks must be released, not timed out"
    assert re.search(r"rank 0: was (running|waiting)", str(info.value)), str(info.value)
    assert "names you defined are kept" in str(info.value)


def test_torch_dynamo_is_imported_before_the_first_cell_and_ddp_works():
    # DDP's constructor and the first optimizer import torch._dynamo lazily: a stop in the middle of that
    # import used to leave it half-registered (every later DDP on the rank failed), and imported after
    # init_process_group it kept the group alive (through torch.distributed.nn's defaults). Forked ranks get
    # it from the second fork server, which imports it after the first cluster started (_forkstart.LATER, off the
    # first start's path); fresh interpreters import only torch.distributed.nn before their group.
    # A rank forked before B is ready comes from A and imports torch._dynamo itself, when it needs it: the test
    # waits until B says it is ready.
    from course_utils.engine import _forkstart
    from engine_helpers import wait_until_the_fork_server_has_imported_everything

    forked = _forkstart.wanted()
    if forked:
        wait_until_the_fork_server_has_imported_everything()
    with Cluster(world_size=2, backend="gloo") as cluster:
        got = cluster.run("import sys\n'torch.distributed.nn' in sys.modules, 'torch._dynamo' in sys.modules")
    assert got == [(True, forked)] * 2, "forked ranks have torch._dynamo from the server, fresh interpreters not yet"
    with Cluster(world_size=2, backend="gloo") as cluster:
        assert cluster.run("import torch\nmodel = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))\n"
                           "type(model).__name__") == ["DistributedDataParallel"] * 2


def test_a_failure_with_a_callback_holding_the_group_leaves_every_rank_alive(cluster4, tmp_path):
    # PowerSGD's hook chains futures whose callbacks hold the process group; gloo runs them on its
    # own threads when the failure errors out the pending work. The rank used to free the old group
    # there, in a callback: the group's destructor joined its own thread and the rank aborted
    # ("Resource deadlock avoided") after the report, so the next cell found it dead.
    # The callback's default arguments are (token, group); a tuple drops its items last to first, so the
    # callback's reference to the group goes first and the token's finalizer writes `released` only after it:
    # the test waits for that (or for rank 0 to die), not for a fixed time.
    pids = list(cluster4.pids)
    for attempt in range(2):
        released = tmp_path / f"released-{attempt}"
        with pytest.raises(DistributedError) as info:
            cluster4.run("import time, weakref, torch, torch.distributed as dist\n"
                         "class Token:\n    pass\n"
                         "def fail_with_a_callback_pending():\n"
                         "    group = dist.group.WORLD\n"
                         "    if rank == 0:  # the others never join: the failure releases it\n"
                         "        token = Token()\n"
                         f"        weakref.finalize(token, lambda: open({str(released)!r}, 'w').close())\n"
                         "        work = dist.all_reduce(torch.ones(1), group=group, async_op=True)\n"
                         "        work.get_future().then(lambda fut, token=token, group=group: time.sleep(0.5))\n"
                         "        del token\n"
                         "    raise ValueError('boom')\n"
                         "fail_with_a_callback_pending()", timeout=120)
        assert "names you defined are kept" in str(info.value)
        deadline = time.monotonic() + 120
        while not released.exists() and cluster4.alive and time.monotonic() < deadline:
            time.sleep(0.05)
        assert cluster4.alive and cluster4.pids == pids, "a rank died after the failure"
        assert released.exists(), "the callback still held the group after 120 s"
    assert cluster4.run("import torch, torch.distributed as dist\nt = torch.ones(1)\ndist.all_reduce(t)\nt.item()") \
        == [4.0] * 4


def test_a_deadlock_is_released_without_losing_names(cluster4):
    cluster4.run("kept_through_deadlock = rank")
    with pytest.raises(DistributedTimeout) as info:  # every rank waits to receive first
        cluster4.run("import torch, torch.distributed as dist\nbuf = torch.zeros(1)\n"
                     "dist.recv(buf, src=(rank + 1) % world_size)", timeout=3)
    assert "rank 0: stuck in recv()" in str(info.value)
    assert "names you defined are kept" in str(info.value)
    stack = str(info.value).split("Python stack of ranks 0, 1, 2, 3", 1)[1]  # one stack, shared by all
    assert "multiprocessing" not in stack and '"<string>"' not in stack, "the stack starts at the learner's cell"
    assert cluster4.pull("kept_through_deadlock") == [0, 1, 2, 3]


def test_the_first_failure_is_reported_at_once_whatever_the_others_do(cluster4, tmp_path):
    """The first error wins: the report comes as soon as it arrives (no grace for the others to fail too), names
    the failing rank as the root cause, and says where each other rank was: computing, asleep, or in a
    collective. Every rank is released and the names are kept."""
    cell = ("import os, time, torch, torch.distributed as dist\n"
            "if rank == 3:\n"
            f"    while len(os.listdir({str(tmp_path)!r})) < 3:\n"
            "        time.sleep(0.01)\n"
            "    raise KeyError(rank)\n"
            f"open(os.path.join({str(tmp_path)!r}, str(rank)), 'w').close()\n"
            "if rank == 0:\n    while True:\n        pass\n"
            "elif rank == 1:\n    time.sleep(60)\n"
            "else:\n    dist.all_reduce(torch.ones(1))")
    t0 = time.monotonic()
    with pytest.raises(DistributedError) as info:
        cluster4.run(cell, timeout=120)
    took = time.monotonic() - t0
    text = str(info.value)
    assert info.value.rank == 3 and text.startswith("rank 3 failed with KeyError"), text
    assert "rank 0: was running at <ddp>, line" in text and "rank 1: was running at <ddp>, line 11: time.sleep(60)" \
        in text, text
    assert re.search(r"rank 2: was (running|waiting) in all_reduce\(\)", text), text
    assert "names you defined are kept" in text and took < 30, took
    assert cluster4.run("rank") == [0, 1, 2, 3]


def test_function_traceback_shows_its_source(cluster4):
    def faulty(x):
        y = x + 1
        return y / 0

    with pytest.raises(DistributedError) as info:
        cluster4.run(faulty, 1)
    assert "return y / 0" in str(info.value) and "ZeroDivisionError" in str(info.value)


@pytest.mark.parametrize("get_checker", [
    "from course_utils.checks.accumulation import check_accumulate",  # a checker the ranks call unwrapped
    "from course_utils.checks import verdict_only\n"        # through the notebook-side wrapper
    "from course_utils.checks import accumulation\ncheck_accumulate = verdict_only(accumulation.check_accumulate)",
])
def test_a_checker_verdict_on_the_ranks_shows_the_learners_line_not_the_checker(cluster4, get_checker):
    with pytest.raises(DistributedError) as info:
        cluster4.run(get_checker + "\ndef accumulate(model, batches):\n    raise NotImplementedError('todo')\n"
                     "check_accumulate(accumulate)")
    text = str(info.value)
    assert info.value.exc_type == "AssertionError" and "accumulate is not written yet" in text
    assert "check_accumulate(accumulate)" in text, "the learner's line stays"
    assert "accumulation.py" not in text and "course_utils/checks" not in text, text
    with pytest.raises(DistributedError) as info:  # the learner's own assert keeps its frames
        cluster4.run("def mine():\n    assert rank < 0, 'mine'\nmine()")
    assert "assert rank < 0, 'mine'" in str(info.value)


def test_skipped_collective_times_out_with_stacks_and_recovers(cluster4):
    cluster4.run("import torch.distributed as dist\npersisted = rank + 100")
    t0 = time.monotonic()
    with pytest.raises(DistributedTimeout) as info:
        cluster4.run("if rank != 3:\n    dist.barrier()", timeout=3)
    assert time.monotonic() - t0 >= 3, "the cell's own limit decides"
    e = info.value
    assert isinstance(e, TimeoutError) and isinstance(e, DistributedError)
    text = str(e)
    assert "ranks 0, 1, 2 did not finish within 3 s" in text and "rank 3 finished" in text
    assert "rank 0: stuck in barrier()" in text
    assert text.count("Python stack of") == 1, "the three stuck ranks share one stack: printed once"
    assert "Python stack of ranks 0, 1, 2" in text and "distributed_c10d.py" in text
    assert cluster4.run("rank") == [0, 1, 2, 3]
    assert cluster4.run("persisted") == [100, 101, 102, 103]


def test_endless_loop_times_out_and_idle_time_does_not_count(cluster4):
    cluster4.run("rank")
    time.sleep(5.5)  # idle between cells, longer than the next cell's limit: it must not count
    # 5 s for 0.2 s of sleep and a round trip (0.3 s on 2 loaded cores): 25x the work. An engine that counted
    # the idle time is past its limit before the cell starts, and the 0.2 s gives its timer the time to fire.
    assert cluster4.run("import time\ntime.sleep(0.2)\nrank", timeout=5) == [0, 1, 2, 3]
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
def test_dead_worker_is_reported_and_replaced(make_cluster, capfd, code, how):
    c = make_cluster(2, timeout=120)  # a death is seen at once; 120 s would be a DistributedTimeout
    with pytest.raises(DistributedError) as info:
        c.run(f"import os, signal, ctypes, torch, torch.distributed as dist\nif rank == 1:\n"
              f"    print('last words', flush=True)\n    {code}\ndist.all_reduce(torch.ones(1))")
    assert not isinstance(info.value, DistributedTimeout)
    assert f"rank 1 died: it {how}" in str(info.value)
    assert "[rank 1] last words\n" in capfd.readouterr().out, "what a rank printed before it died is kept"
    assert c.run("rank") == [0, 1], "the cluster replaces its ranks and stays usable"


def test_a_rank_that_forked_a_child_is_seen_to_die(make_cluster, tmp_path):
    # the child inherits the rank's pipes, so no EOF tells the notebook that the rank is gone
    c = make_cluster(2, timeout=120)
    pid_file = tmp_path / "child.pid"
    with pytest.raises(DistributedError) as info:
        c.run("import os, time, torch, torch.distributed as dist\n"
              "if rank == 1:\n"
              "    child = os.fork()\n"
              "    if child == 0:\n"
              "        time.sleep(300)\n"
              "        os._exit(0)\n"
              f"    open({str(pid_file)!r}, 'w').write(str(child))\n"
              "    os._exit(3)\n"
              "dist.all_reduce(torch.ones(1))")
    assert "rank 1 died: it exited with code 3" in str(info.value), str(info.value)
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(child), "what a dead rank started is stopped with it"
    assert c.run("rank") == [0, 1]


def test_hang_report_names_the_collective_even_with_a_longer_cell_timeout():
    # The backend's own timeout used to be max(cell timeout, 10 s): a cell allowed 11 s raced gloo,
    # and the report contradicted itself. Now the engine alone decides, and names the collective.
    with Cluster(world_size=3, backend="gloo", timeout=3) as c:
        with pytest.raises(DistributedTimeout) as info:
            c.run("import torch, torch.distributed as dist\nif rank == 0:\n    dist.all_reduce(torch.ones(1))",
                  timeout=11)
        text = str(info.value)
        assert "rank 0 did not finish within 11 s" in text, text
        assert "ranks 1, 2 finished." in text and "rank 0: stuck in all_reduce() at <ddp>, line 3" in text, text
        assert info.value.ranks.keys() == {0}, "a rank is stuck or finished, never both"
        assert c.run("rank") == [0, 1, 2]


def test_a_reply_the_notebook_cannot_load_is_that_ranks_error_and_the_next_run_works(cluster4):
    with pytest.raises(DistributedError) as info:
        cluster4.run("class Later:\n    def __reduce__(self):\n        return (eval, ('no_such_name_here',))\n"
                     "Later() if rank == 1 else rank")
    assert "rank 1 failed with NameError: the rank's reply could not be loaded" in str(info.value)
    assert cluster4.run("rank") == [0, 1, 2, 3], "the pipe is not jammed by the bad frame"


def test_output_that_looks_like_the_engines_end_mark_is_shown_as_text(cluster4, capfd):
    cluster4.run("import os\nos.write(1, b'\\x00course_utils-end:xyz\\n')\nif rank == 0:\n    print('after')")
    out = capfd.readouterr().out
    assert "[rank 0] after" in out and out.count("course_utils-end:xyz") == 4


def test_cpp_frames_in_relayed_output_collapse_to_one_line(cluster4, capfd, monkeypatch):
    code = ("import sys\nif rank == 0:\n    print('Exception raised from run at gloo.cc:1', file=sys.stderr)\n"
            "    for i in range(40):\n"
            "        print(f'frame #{i}: <unknown function> + 0x1 (0x7f in /x/libtorch_python.so)', file=sys.stderr)\n"
            "    print('RuntimeError: the end', file=sys.stderr)")
    cluster4.run(code)
    err = capfd.readouterr().err
    assert "frame #" not in err
    assert ("[rank 0] Exception raised from run at gloo.cc:1\n"
            "[rank 0] [40 C++ frames hidden: set TORCH_SHOW_CPP_STACKTRACES=1 to see them]\n"
            "[rank 0] RuntimeError: the end\n") in err
    monkeypatch.setenv("TORCH_SHOW_CPP_STACKTRACES", "1")
    cluster4.run(code)
    assert capfd.readouterr().err.count("frame #") == 40


def test_interrupt_during_a_large_push_keeps_the_ranks_and_their_names(make_cluster, monkeypatch):
    """A stop while a frame is on its way to a rank (8 MB: far more than a pipe holds) ends the call, and the
    frame still arrives whole: the ranks and their names are kept."""
    from course_utils.engine import launcher

    c = make_cluster(2, timeout=120)
    c.run("kept_through_stop = rank")
    real = launcher._Rank.send

    def send_then_stop(self, msg):  # the stop button pressed in the middle of a frame
        held = msg[0] == "push" and self.rank == 0
        if held:  # rank 0 reads nothing while stopped: the pipe fills and the rest of the frame waits in outbox
            os.kill(self.proc.pid, signal.SIGSTOP)
        real(self, msg)
        if held:
            assert self.outbox, "the frame is still on its way"
            os.kill(self.proc.pid, signal.SIGCONT)
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(launcher._Rank, "send", send_then_stop)
    with pytest.raises(KeyboardInterrupt, match="names you defined are kept"):
        c.push(big=b"x" * (8 << 20))
    monkeypatch.undo()
    pids = list(c.pids)
    assert c.run("kept_through_stop", timeout=120) == [0, 1]
    assert c.pids == pids and c.pull("big") == [b"x" * (8 << 20)] * 2, "the whole frame arrived"


def test_a_cluster_created_in_a_thread_survives_the_thread():
    made = []
    t = threading.Thread(target=lambda: made.append(Cluster(world_size=2, backend="gloo")))
    t.start()
    t.join()
    c = made[0]
    try:
        pids = list(c.pids)
        time.sleep(1.0)
        assert c.alive and c.run("rank") == [0, 1]
        assert (c.pids, c.restarts) == (pids, 0), "the ranks must not die with the thread that started them"
    finally:
        c.shutdown()


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
def test_launch_runs_once_and_leaves_nothing():
    def job(base):
        import os

        import torch.distributed as dist
        return base + dist.get_rank(), os.getpid()

    out = launch(job, 10, world_size=3, backend="gloo")
    assert [v for v, _ in out] == [10, 11, 12]
    assert not [pid for _, pid in out if alive(pid)], "the ranks of launch() end with it"


def test_every_socket_listens_on_loopback_only(cluster4):
    from engine_helpers import LOOPBACK, listening_addresses

    addrs = listening_addresses(cluster4.pids)
    assert addrs, "the ranks should be listening somewhere (store, gloo): the check would be vacuous"
    assert set(addrs) <= LOOPBACK, f"a socket listens beyond 127.0.0.1: {addrs}"


def test_restart_and_shutdown():
    c = Cluster(world_size=2, backend="gloo")
    try:
        old = list(c.pids)
        c.run("kept = 1")
        c.restart()
        assert c.pids != old
        with pytest.raises(NameError, match="not defined"):
            c.pull("kept")
    finally:
        c.shutdown()
    c.shutdown()  # twice is fine
    assert not c.alive
    deadline = time.monotonic() + 10
    while any(alive(p) for p in old + c.pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in old + c.pids if alive(p)], "shutdown leaves no rank"


def test_default_timeout_is_60_seconds():
    import inspect

    from course_utils import launch as launch_fn

    assert inspect.signature(Cluster).parameters["timeout"].default == 60
    assert inspect.signature(launch_fn).parameters["timeout"].default == 60


def test_magic_uses_only_public_cluster_methods():
    import ast

    import course_utils.engine.magic as magic

    tree = ast.parse(open(magic.__file__).read())
    private = sorted({f"{n.value.id}.{n.attr}" for n in ast.walk(tree) if isinstance(n, ast.Attribute)
                      and isinstance(n.value, ast.Name) and n.value.id in ("cluster", "c", "_CLUSTER")
                      and n.attr.startswith("_")})
    assert not private, f"magic reaches into the Cluster: {private}"
