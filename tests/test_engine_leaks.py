"""The engine's third review: what a rank keeps, how it ends, and what it says.

A rank kept every process group it ever made (against torch 2.13's deadlock in ~ProcessGroupGloo), so
each ``new_group``/``destroy`` pair and each recovery leaked 4-5 fds and 3 threads until the fds ran out.
"""
import os
import subprocess
import sys
import threading
import time

import pytest

from course_utils import Cluster, DistributedError
from engine_helpers import check_multiprocessing_with_cell_code

COUNTS = ("import os\n"
          "(len(os.listdir('/proc/self/fd')), len(os.listdir('/proc/self/task')))")

PAIRS = ("import torch, torch.distributed as dist\n"
         "def pairs(n):\n"
         "    for _ in range(n):\n"
         "        g = dist.new_group([0, 1])\n"
         "        t = torch.ones(1)\n"
         "        dist.all_reduce(t, group=g)\n"
         "        dist.destroy_process_group(g)\n"
         "pairs(10)")

FAIL = ("import torch, torch.distributed as dist\n"
        "if rank == 1:\n"
        "    raise ValueError('recover')\n"
        "dist.all_reduce(torch.ones(1))")


def _settled(cluster):
    """Counts on every rank after two empty commands (a destroyed group is freed at a later command)."""
    cluster.run("None")
    cluster.run("None")
    return cluster.run(COUNTS)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts fds and threads in /proc")
def test_new_groups_and_recoveries_leave_fds_and_threads_flat(make_cluster):
    c = make_cluster(2, timeout=60)
    c.run(PAIRS.replace("pairs(10)", "pairs(1)"))  # what a first group and a first recovery allocate for good
    with pytest.raises(DistributedError):
        c.run(FAIL)
    before = _settled(c)
    for _ in range(10):  # 100 new_group/destroy pairs
        c.run(PAIRS)
    after_groups = _settled(c)
    for _ in range(20):  # 20 recoveries: each one destroys the group and builds a new one
        with pytest.raises(DistributedError) as info:
            c.run(FAIL)
        assert "names you defined are kept" in str(info.value)
    after_recoveries = _settled(c)
    for r in range(2):
        (fds0, threads0), (fds1, threads1), (fds2, threads2) = before[r], after_groups[r], after_recoveries[r]
        # each leaked group costs 4-5 fds and 3 threads: 100 pairs leaked 500 fds, 20 recoveries 60 threads
        assert fds1 - fds0 <= 10 and threads1 - threads0 <= 6, \
            f"rank {r}: 100 new_group/destroy pairs: fds {fds0} -> {fds1}, threads {threads0} -> {threads1}"
        assert fds2 - fds0 <= 10 and threads2 - threads0 <= 6, \
            f"rank {r}: 20 recoveries: fds {fds0} -> {fds2}, threads {threads0} -> {threads2}"
    assert c.run("t = torch.ones(1)\ndist.all_reduce(t)\nt.item()") == [2.0, 2.0]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts fds in /proc")
def test_three_hundred_new_group_destroy_pairs_in_one_cell_fit_in_1024_fds(make_cluster):
    """Issue 41: groups were freed only between cells, so one cell's loop of 300 pairs ran out of fds at the usual
    limit of 1024 ("epoll_create: Too many open files", 4-5 fds a group). A destroy now frees the earlier ones."""
    c = make_cluster(2, timeout=240)
    got = c.run("import os, resource, torch, torch.distributed as dist\n"
                "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
                "resource.setrlimit(resource.RLIMIT_NOFILE, (min(1024, hard), hard))\n"
                "try:\n"
                "    for i in range(300):\n"
                "        g = dist.new_group([0, 1])\n"
                "        dist.destroy_process_group(g)\n"
                "finally:\n"
                "    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))\n"
                "t = torch.ones(1)\ndist.all_reduce(t)\n(t.item(), len(os.listdir('/proc/self/fd')))")
    for r, (total, fds) in enumerate(got):
        assert total == 2.0, got
        assert fds < 200, f"rank {r} holds {fds} fds after 300 pairs: the destroyed groups were not freed"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts fds in /proc")
def test_a_group_the_learner_still_holds_is_kept_until_dropped(make_cluster):
    c = make_cluster(2, timeout=60)
    c.run("import torch, torch.distributed as dist\nheld = dist.new_group([0, 1])\ndist.destroy_process_group(held)")
    before = _settled(c)
    c.run("del held")
    after = _settled(c)
    assert all(a[0] < b[0] for a, b in zip(after, before)), f"the dropped group's fds stayed: {before} -> {after}"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts fds in /proc")
def test_groups_freed_after_async_work_and_ddp_on_a_subgroup_never_deadlock(make_cluster):
    """What the keeping was for: a group whose last reference went right after its works (a DDP Reducer,
    an async all-reduce's work) deadlocked in ~ProcessGroupGloo. Freed at a later command, it does not."""
    c = make_cluster(2, timeout=60)
    c.run("import torch, torch.distributed as dist\nfrom torch.nn.parallel import DistributedDataParallel as DDP")
    before = _settled(c)
    for _ in range(20):
        c.run("g = dist.new_group([0, 1])\nwork = dist.all_reduce(torch.ones(1000), group=g, async_op=True)\n"
              "dist.destroy_process_group(g)\nwork.wait()\ndel g, work")
    for _ in range(5):
        c.run("g = dist.new_group([0, 1])\nmodel = DDP(torch.nn.Linear(8, 8), process_group=g)\n"
              "model(torch.randn(4, 8)).sum().backward()\ndist.destroy_process_group(g)\ndel g, model")
    after = _settled(c)
    assert all(b[0] - a[0] <= 10 for a, b in zip(before, after)), f"fds {before} -> {after}"


def test_a_shutdown_runs_the_atexit_handlers_and_flushes_open_files(tmp_path):
    """Every rank ended with os._exit: an unclosed open(..., 'w') left a 0-byte file, atexit handlers never ran."""
    with Cluster(world_size=2, backend="gloo") as c:
        c.run(f"import atexit\nlog = open({str(tmp_path)!r} + f'/open{{rank}}.txt', 'w')\nlog.write('written')\n"
              f"atexit.register(lambda: open({str(tmp_path)!r} + f'/atexit{{rank}}.txt', 'w').write('ran'))")
    deadline = time.monotonic() + 10
    while len(list(tmp_path.glob("atexit*.txt"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    for r in (0, 1):
        assert (tmp_path / f"open{r}.txt").read_text() == "written", "the open file was not flushed"
        assert (tmp_path / f"atexit{r}.txt").read_text() == "ran", "the atexit handler did not run"


def test_a_rank_that_dies_between_calls_is_reported_not_replaced_silently(make_cluster):
    c = make_cluster(2, timeout=60)
    c.run("x = rank\nimport os, threading\nif rank == 1:\n"
          "    print('going', flush=True)\n    threading.Timer(0.3, os._exit, (9,)).start()")
    deadline = time.monotonic() + 20
    while c.alive and time.monotonic() < deadline:
        time.sleep(0.1)
    with pytest.raises(DistributedError) as info:
        c.run("x")
    text = str(info.value)
    assert text.startswith("rank 1 died: it exited with code 9") and "died between calls" in text, text
    assert c.run("'x' in globals()") == [False, False], "fresh ranks after the report"


def test_output_after_a_call_ended_is_shown_with_a_note_and_an_endless_printer_does_not_hold_the_call(
        make_cluster, capfd, tmp_path):
    c = make_cluster(2, timeout=60)
    printed = tmp_path / "printed"  # written once the late words are in the pipe: the next call must show them
    c.run("import threading, time\nif rank == 0:\n"
          "    def late():\n        print('late words', flush=True)\n"
          f"        open({str(printed)!r}, 'w').close()\n"
          "    threading.Timer(0.5, late).start()")
    deadline = time.monotonic() + 60
    while not printed.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert printed.exists(), "rank 0's timer did not print within 60 s"
    c.run("None")
    out = capfd.readouterr().out
    assert "note: rank 0 printed this after its previous call had finished" in out and "[rank 0] late words" in out
    stop = tmp_path / "stop"
    # The printer stops when the test touches `stop`: after the call has returned, or after 60 s if the call
    # waits for the printer (which then fails the assert below). The cell returns only once the printer has
    # filled the pipe at least once over (64 KiB), so the call really ends with the printer still printing.
    release = threading.Timer(60, stop.touch)
    release.start()
    try:
        c.run("import os\nlines = 0\nstarted = threading.Event()\ndef printer():\n    global lines\n"
              f"    while not os.path.exists({str(stop)!r}):\n        print('x' * 200)\n        lines += 1\n"
              "        if lines == 400:\n            started.set()\n"
              "if rank == 1:\n    threading.Thread(target=printer, daemon=True).start()\n"
              "    assert started.wait(60), 'the printer did not start'")
        assert not stop.exists(), "the call waited for the endless printer to stop"
    finally:
        release.cancel()
        stop.touch()
    c.restart()
    capfd.readouterr()


def test_a_restart_from_another_thread_while_a_call_runs_is_refused_clearly(make_cluster, tmp_path):
    c = make_cluster(2, timeout=60)
    errors = []
    running, release = tmp_path / "running", tmp_path / "release"

    def restart_while_it_runs():  # once the call runs on the ranks; then the call may end
        try:
            deadline = time.monotonic() + 60
            while not running.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            c.restart()
        except RuntimeError as exc:
            errors.append(str(exc))
        finally:
            release.touch()

    t = threading.Thread(target=restart_while_it_runs)
    t.start()
    try:
        assert c.run(f"import os, time\nif rank == 0:\n    open({str(running)!r}, 'w').close()\n"
                     f"while not os.path.exists({str(release)!r}):\n    time.sleep(0.01)\nrank") == [0, 1]
    finally:
        release.touch()
        t.join()
    assert running.exists(), "the call never ran"
    assert errors and "busy with a call from another thread" in errors[0], errors


def test_killing_ranks_never_signals_a_process_that_reused_a_ranks_pid():
    """A forked rank is reaped by the fork server as soon as it ends; its pid may then be another process's."""
    from course_utils.engine import launcher

    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        class Ended:  # a rank that ended and was reaped, whose pid now belongs to `other`
            pid = other.pid
            returncode = 0

            def poll(self):
                return 0

            def wait(self, timeout=None):
                return 0

            def kill(self):
                raise AssertionError("kill() of an ended rank")

        rk = launcher._Rank(0, Ended(), *[os.open(os.devnull, os.O_RDONLY) for _ in range(4)])
        launcher._kill([rk])
        time.sleep(0.2)
        assert other.poll() is None, "an unrelated process with the dead rank's pid was killed"
    finally:
        other.kill()
        other.wait()


def test_shutdown_ends_every_cluster_and_unload_then_load_starts_a_new_fork_server():
    """%ddp shutdown left a checker's clusters running (5 processes of lesson 03); %unload_ext then %load_ext
    kept the same fork server, whose environment (TORCHDYNAMO_VERBOSE, read when torch._dynamo loads in the
    server) stayed the one it started with, though the README gave it as the remedy."""
    from course_utils.engine import _forkstart
    from engine_helpers import Kernel

    if not _forkstart.wanted():
        pytest.skip("the ranks start as fresh interpreters here: there is no fork server")
    k = Kernel()
    try:
        def run(code):
            status, out, _ = k.execute(code)
            assert status == "ok", (code, out, k.traceback)
            return out

        run("%load_ext course_utils")
        first = run("%%ddp -n 2 --backend gloo\nimport os\nos.getppid()")  # a forked rank's parent: the server
        run("from course_utils import Cluster\nchecker_like = Cluster(2, backend='gloo')")
        run("%ddp shutdown")
        assert run("print(checker_like.alive)") == "False\n", "%ddp shutdown left another cluster running"
        run("import os\nos.environ['TORCHDYNAMO_VERBOSE'] = '1'")
        run("%unload_ext course_utils")
        run("%load_ext course_utils")
        second = run("%%ddp -n 2 --backend gloo\nimport os\nos.getppid()")
        assert first != second, f"the same fork server after unload and load: {first!r}"
        assert run("%%ddp\nimport torch._dynamo.config\ntorch._dynamo.config.verbose") == \
            "[rank 0] True\n[rank 1] True\n", "the new server reads the environment afresh"
        assert run("print(checker_like.run('rank'))") == "[0, 1]\n", "a stopped cluster starts again when used"
        run("%ddp shutdown")
    finally:
        k.close()


def test_the_launch_benchmark_counts_cores_on_a_system_without_sched_getaffinity(monkeypatch):
    """make bench failed on macOS: benchmarks/launch_overhead.py called os.sched_getaffinity itself."""
    import importlib.util

    from conftest import ROOT

    spec = importlib.util.spec_from_file_location("launch_overhead", ROOT / "benchmarks" / "launch_overhead.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    assert bench.header("fork server", "fork server").startswith("launch overhead on 8 cores, torch ")


def test_multiprocessing_on_a_rank_works_with_what_the_cells_define_in_every_context(make_cluster):
    """A Pool in the fork, spawn and forkserver contexts maps a cell's function; what a child sends back (an
    instance of a cell's class, nested or redefined) is the rank's own class; a spawn DataLoader with 2 workers
    loads a cell's Dataset. Ranks have the platform's start method, as under torchrun (not the engine's own)."""
    import multiprocessing

    c = make_cluster(1, timeout=120)
    assert c.run("import multiprocessing as mp\nmp.get_start_method()") == [multiprocessing.get_start_method()]
    check_multiprocessing_with_cell_code(c)


def test_the_same_checker_verdict_on_every_rank_is_shown_once(make_cluster):
    """A checker's verdict raised on every rank printed twice (summary and traceback), then a 'rank N: then
    raised AssertionError' line per rank: one wrong answer read as many failures."""
    c = make_cluster(2, timeout=60)
    with pytest.raises(DistributedError) as info:
        c.run("from course_utils.checks import check_accumulate\n"
              "def accumulate(model, batches):\n    raise NotImplementedError('todo')\n"
              "check_accumulate(accumulate)")
    text = str(info.value)
    assert text.startswith("every rank failed the check with AssertionError:"), text
    assert text.count("accumulate is not written yet") == 1 and "then raised" not in text, text
    assert "check_accumulate(accumulate)" in text and "course_utils/checks" not in text, text
    with pytest.raises(DistributedError) as info:  # a verdict on one rank only is reported as before
        c.run("from course_utils.checks import verdict_only\n"
              "def judge():\n    assert rank != 1, 'wrong on rank 1'\nverdict_only(judge)()")
    assert str(info.value).startswith("rank 1 failed with AssertionError: wrong on rank 1"), str(info.value)


FIRST_START = """
import sys
sys.path.insert(0, {root!r})
from course_utils import Cluster
with Cluster(world_size=1, backend="gloo") as c:
    print(c.run("import sys\\n'torch.distributed.nn' in sys.modules, 'torch._dynamo' in sys.modules"))
"""


def test_the_first_start_does_not_wait_for_the_server_to_import_torch_dynamo():
    """The fork server imported torch._dynamo (1-4 s) before it served the first start: it now imports it
    once it has been idle, so the first ranks are forked without it (and import it when they need it)."""
    from conftest import ROOT
    from course_utils.engine import _forkstart

    if not _forkstart.wanted():
        pytest.skip("the ranks start as fresh interpreters here: there is no fork server")
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    run = subprocess.run([sys.executable, "-c", FIRST_START.format(root=str(ROOT))], capture_output=True,
                         text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip() == "[(True, False)]", run.stdout
