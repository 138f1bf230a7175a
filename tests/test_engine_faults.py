"""The engine faults of the second code review, each reproduced on 2 gloo ranks, and the
engine promises of the tests audit that need the engine itself.

Each test failed on the engine before the fix. test_engine_spawn_start.py checks the start path of fresh
interpreters on a few of them (a shared 2-rank cluster), test_portability.py runs the stop during a start on both
paths; the rest apply to the fork server's start.
"""
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from conftest import ROOT, in_ci
from engine_helpers import (asleep, check_cells_run_in_a_real_main_module, check_output_after_fd_1_is_redirected,
                            check_output_to_sys_stdout_none_keeps_the_ranks, check_settings_read_when_a_library_loads,
                            ranks_below)
from course_utils import Cluster, DistributedError
from course_utils.engine import _forkstart, export, magic, reports

CHILD_ENV = dict(os.environ, PYTHONPATH=str(ROOT))


@pytest.fixture(scope="module")
def two(make_cluster):
    return make_cluster(2, timeout=30)


# -- 1. output without end marks -----------------------------------------------------------------
def test_a_cell_that_redirects_fd_1_finishes_at_once_keeps_the_names_and_does_not_spin(make_cluster, capfd):
    check_output_after_fd_1_is_redirected(make_cluster(2, timeout=21), capfd)  # its own ranks: stdout stays closed


def test_a_cell_that_sets_sys_stdout_to_none_does_not_kill_the_rank(make_cluster, capfd):
    check_output_to_sys_stdout_none_keeps_the_ranks(make_cluster(2, timeout=22), capfd)


def test_output_is_grouped_by_rank_even_when_higher_ranks_print_first(two, capfd):
    two.run_cell("import time\ntime.sleep(0.6 * (world_size - 1 - rank))\nprint('first line of', rank)\n"
                 "time.sleep(0.2)\nprint('second line of', rank)")
    out = capfd.readouterr().out
    assert out == ("[rank 0] first line of 0\n[rank 0] second line of 0\n"
                   "[rank 1] first line of 1\n[rank 1] second line of 1\n"), out


# -- 2. the fork server survives an early stop, and is restarted once ---------------------------------
EARLY_STOP = textwrap.dedent("""
    import os, signal, sys, time
    from course_utils.engine import _forkstart
    _forkstart.prestart()
    pid = _forkstart._state["ctx"].pid
    time.sleep(0.2)
    os.kill(pid, signal.SIGINT)   # Jupyter's stop reaches the kernel's whole process group
    time.sleep(0.5)
    from course_utils import Cluster
    t0 = time.monotonic()
    with Cluster(world_size=2, backend="gloo") as c:
        print("ranks", c.run("rank"), "server alive", _forkstart._state["ctx"].pid == pid)
    os.kill(pid, signal.SIGKILL)  # gone for good: the next start makes a new server, once
    time.sleep(0.3)
    with Cluster(world_size=2, backend="gloo") as c:
        new = _forkstart._state["ctx"].pid
        print("after a kill", [ppid in (new, _forkstart._state["b"] and _forkstart._state["b"]["server"].pid)
                               for ppid in c.run("import os\\nos.getppid()")])
    print("new server", new not in (None, pid))
""")


def test_an_interrupt_while_the_fork_server_imports_torch_does_not_kill_it():
    if not _forkstart.wanted():
        pytest.skip("the ranks start as fresh interpreters here (COURSE_UTILS_START=spawn)")
    proc = subprocess.run([sys.executable, "-c", EARLY_STOP], capture_output=True, text=True, timeout=240,
                          env=CHILD_ENV, start_new_session=True)
    assert proc.returncode == 0, proc.stderr
    assert "ranks [0, 1] server alive True" in proc.stdout, proc.stdout + proc.stderr
    assert "after a kill [True, True]" in proc.stdout and "new server True" in proc.stdout, proc.stdout
    assert "fresh interpreters" not in proc.stderr, f"fell back after a restartable failure:\n{proc.stderr}"


# -- 2b. two fork servers: A never imports on the thread that serves forks ------------------
TWO_SERVERS = textwrap.dedent("""
    import os, sys, time
    sys.path.insert(0, sys.argv[1])          # the slow probe module, on the servers' path too
    from course_utils import Cluster
    from course_utils.engine import _forkstart

    def wait_for_b():
        deadline = time.monotonic() + 120
        while not _forkstart.second_server_ready():
            assert time.monotonic() < deadline, "B never became ready"
            time.sleep(0.05)

    PARENT = "import os, sys\\n(os.getppid(), 'torch._dynamo' in sys.modules)"
    if sys.argv[2] == "slow":   # B imports a module that takes 60 s: a rank of A dies meanwhile
        _forkstart.LATER = ["slow_import_probe"]
        with Cluster(world_size=2, backend="gloo") as c:
            a = _forkstart._state["ctx"].pid
            t0 = time.monotonic()
            try:
                c.run("import os, torch, torch.distributed as dist\\nif rank == 1:\\n    os._exit(3)\\n"
                      "dist.all_reduce(torch.ones(1))")
            except Exception as exc:
                print("report:", str(exc).splitlines()[0])
            print("while B imports:", _forkstart._state["b"] is not None and not _forkstart.second_server_ready(),
                  "seconds", round(time.monotonic() - t0, 1))
            print("next call:", c.run("rank"))
    else:                       # B imports torch._dynamo, as it does in a lesson
        with Cluster(world_size=2, backend="gloo") as c:
            a = _forkstart._state["ctx"].pid
            print("first cluster from A:", [p == a for p, _ in c.run(PARENT)])
        wait_for_b()
        b = _forkstart._state["b"]["server"].pid
        with Cluster(world_size=2, backend="gloo") as c:
            print("then from B, with torch._dynamo:", c.run(PARENT) == [(b, True)] * 2)
            try:                # a hang on B's ranks: its report's stack starts at the cell, as on A's
                c.run("import torch, torch.distributed as dist\\nbuf = torch.zeros(1)\\n"
                      "dist.recv(buf, src=(rank + 1) % world_size)", timeout=3)
            except Exception as exc:
                stack = str(exc).split("Python stack of", 1)[-1]
                print("a hang's stack on B's ranks starts at the cell:",
                      "multiprocessing" not in stack and "recv" in stack, stack[:2000].replace(chr(10), " | "))
        os.environ["TORCHDYNAMO_VERBOSE"] = "1"   # what torch._dynamo reads when it loads: B read another value
        with Cluster(world_size=2, backend="gloo") as c:
            print("a changed TORCHDYNAMO_ variable, from A without it:", c.run(PARENT) == [(a, False)] * 2,
                  "and it is read:", c.run("import torch._dynamo\\ntorch._dynamo.config.verbose"))
        del os.environ["TORCHDYNAMO_VERBOSE"]
        with Cluster(world_size=2, backend="gloo") as c:
            print("back to B:", c.run(PARENT) == [(b, True)] * 2,
                  c.run("import torch._dynamo\\ntorch._dynamo.config.verbose"))
""")


@pytest.mark.parametrize("case", ["slow", "dynamo"])
def test_the_first_fork_server_never_imports_and_the_second_serves_once_ready(tmp_path, case):
    """Issue 41: A (torch) serves at once; after a cluster started, A forks B, which imports _forkstart.LATER while
    A goes on forking and reaping. "slow": B imports a module that sleeps 60 s; a rank forked from A dies with
    code 3 meanwhile: the report names the code (A reaped it at once; when A itself imported, the code came 6 s late
    or, past EXIT_CODE_S, never) while B is still importing. "dynamo": the first cluster comes from A, the next
    from B with torch._dynamo (a hang's stack there shows none of the two servers' frames); a TORCHDYNAMO_ variable
    changed after B imported sends ranks to A, which read it."""
    if not _forkstart.wanted():
        pytest.skip("the ranks start as fresh interpreters here (COURSE_UTILS_START=spawn)")
    (tmp_path / "slow_import_probe.py").write_text("import time\ntime.sleep(60)\n")
    proc = subprocess.run([sys.executable, "-c", TWO_SERVERS, str(tmp_path), case], capture_output=True, text=True,
                          timeout=240, env=CHILD_ENV, start_new_session=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    if case == "slow":
        assert "report: rank 1 died: it exited with code 3." in proc.stdout, proc.stdout + proc.stderr
        assert "while B imports: True" in proc.stdout, proc.stdout + proc.stderr
        assert "next call: [0, 1]" in proc.stdout, proc.stdout
    else:
        for line in ["first cluster from A: [True, True]", "then from B, with torch._dynamo: True",
                     "a hang's stack on B's ranks starts at the cell: True",
                     "a changed TORCHDYNAMO_ variable, from A without it: True and it is read: [True, True]",
                     "back to B: True [False, False]"]:
            assert line in proc.stdout, f"expected {line!r} in:\n{proc.stdout}{proc.stderr}"


def test_the_fork_server_imports_the_notebooks_modules_not_those_of_its_working_directory(tmp_path):
    """The server is a fresh interpreter started in the notebook's working directory, and ``python -c`` puts that
    directory first on its path, ahead of the venv's editable install of course_utils (an import hook, consulted
    after the path). It takes the notebook's path instead: a notebook run as a script from a folder holding a
    ``course_utils`` of its own (an old checkout, say) got that folder's engine in the server (here one that ends
    the interpreter: the server died twice and the ranks fell back to fresh interpreters)."""
    if not _forkstart.wanted():
        pytest.skip("the ranks start as fresh interpreters here (COURSE_UTILS_START=spawn)")
    here, elsewhere = tmp_path / "notebook", tmp_path / "cwd"
    (elsewhere / "course_utils").mkdir(parents=True)
    here.mkdir()
    (elsewhere / "course_utils" / "__init__.py").write_text("raise SystemExit('the cwd\\'s course_utils')\n")
    (here / "notebook.py").write_text(textwrap.dedent("""
        import course_utils
        from course_utils import Cluster
        from course_utils.engine import _forkstart
        print("the notebook's course_utils:", course_utils.__file__)
        with Cluster(world_size=1, backend="gloo") as c:
            print("forked by the server:", c.run("import os\\nos.getppid()") == [_forkstart._state["ctx"].pid])
    """))
    env = {k: v for k, v in CHILD_ENV.items() if k != "PYTHONPATH"}   # course_utils from the venv, as a learner's
    proc = subprocess.run([sys.executable, str(here / "notebook.py")], capture_output=True, text=True, timeout=120,
                          env=env, cwd=elsewhere, start_new_session=True)
    if "No module named 'course_utils'" in proc.stderr and not in_ci():
        pytest.skip("course_utils is not installed in this venv (make installs it, editable)")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"the notebook's course_utils: {ROOT}" in proc.stdout, proc.stdout
    assert "forked by the server: True" in proc.stdout, proc.stdout + proc.stderr
    assert "fresh interpreters" not in proc.stderr and "cwd's course_utils" not in proc.stderr, proc.stderr


def test_a_reply_left_unread_by_an_interrupted_request_is_never_taken_for_the_next_ones():
    """The fork server's socket carries one request at a time; a stop between a request and its reply (or a reply
    that came past its deadline) leaves that reply unread. Every request has its own id, so the next request drops
    the stale reply (and closes any fd that came with it) instead of taking it for its own: without the ids, the
    fork of the next rank would read another request's answer. Nothing on that socket is unpickled: it is JSON."""
    if not _forkstart.wanted():
        pytest.skip("the ranks start as fresh interpreters here (COURSE_UTILS_START=spawn)")
    server = _forkstart.context()
    with _forkstart._lock:
        _forkstart._send(server.sock, {"op": "left unread", "id": 0})   # its reply is never read
        with pytest.raises(OSError) as raised:
            server.ask({"op": "this one"})
    assert "unknown request 'this one'" in str(raised.value), f"took another request's reply: {raised.value}"
    with Cluster(world_size=1, backend="gloo") as c:
        assert c.run("rank") == [0], "the server still forks ranks"


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads /proc")
def test_a_dead_ranks_exit_code_is_read_before_its_server_reaps_it():
    """A forked rank's parent is a fork server; until that server reaps it, /proc keeps its wait status
    (_forkstart.zombie_exit_code), so a busy server no longer delays the report of a death."""
    import signal
    import time

    for how, expected in [("exit 3", 3), ("exit 0", 0), ("SIGKILL", -9)]:
        pid = os.fork()
        if pid == 0:
            if how != "SIGKILL":
                os._exit(expected)
            time.sleep(60)
            os._exit(1)
        try:
            if how == "SIGKILL":
                assert _forkstart.zombie_exit_code(pid) is None, "a running process has no exit code"
                os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + 30
            while (code := _forkstart.zombie_exit_code(pid)) is None and time.monotonic() < deadline:
                time.sleep(0.01)
            assert code == expected, f"{how}: read {code} from /proc, expected {expected}"
        finally:
            os.waitpid(pid, 0)
        assert _forkstart.zombie_exit_code(pid) is None, "once reaped, the pid may be another process's"


# -- 3 and 4. what a fresh interpreter would have ---------------------------------------------------
def test_every_rank_and_every_restart_draws_its_own_random_state(make_cluster):
    c = make_cluster(2, timeout=30)
    # torch's, numpy's and Python's own random state (docs/engine.md: "Python's `random` reseeds itself at")
    code = ("import random, torch, numpy\n"
            "(torch.initial_seed(), float(torch.rand(())), float(numpy.random.rand()), random.getrandbits(64))")
    names = ("torch's seed", "torch.rand", "numpy.random", "Python's random")
    first = c.run(code)
    c.restart()
    again = c.run(code)
    for i, name in enumerate(names):    # each generator on its own: one that repeats fails, whatever the others do
        assert first[0][i] != first[1][i], f"both ranks have the same {name}: {first}"
        assert not {first[0][i], first[1][i]} & {again[0][i], again[1][i]}, (
            f"a restart repeats {name}: {first} then {again}")


def test_settings_read_when_a_library_loads_follow_the_notebooks_environment(monkeypatch):
    with Cluster(world_size=2, backend="gloo") as warm:  # the server is running before the variables change
        warm.run("rank")
    check_settings_read_when_a_library_loads(monkeypatch, world_size=2)


def test_the_ranks_argv_is_one_value_and_cells_run_in_a_real_main_module(two):
    check_cells_run_in_a_real_main_module(two)


# -- torch.distributed.nn imported before any group (the capstone's abort) --------------------------------------------
def test_torch_distributed_nn_never_captures_a_live_group_in_its_defaults(two):
    got = two.run("import gc, os, torch, torch.distributed as dist\n"
                  "torch.optim.AdamW(torch.nn.Linear(2, 2).parameters())  # imports torch._dynamo lazily\n"
                  "import torch.distributed.nn.functional as F\n"
                  "F.broadcast.__defaults__")
    for defaults in got:
        assert defaults == (None,), f"torch.distributed.nn captured a live group as a default: {defaults}"


# -- 7. export ------------------------------------------------------------------------------------
def test_export_hides_only_stdout_of_the_other_ranks_and_writes_the_backend(tmp_path):
    path = export.write_script(tmp_path / "s.py", [("--rank 0", "import sys\nprint('out')\n"
                                                               "print('err', file=sys.stderr)")],
                               world_size=2, backend="gloo")
    text = path.read_text()
    assert "BACKEND = 'gloo'" in text
    compile(text, str(path), "exec")
    ns = {"rank": 1, "os": os, "sys": sys}
    start = text.index("class _only_rank")
    exec(text[start:text.index("\n# %%ddp", start)], ns)
    saved_out, saved_err = sys.stdout, sys.stderr
    with pytest.raises(ValueError):
        with ns["_only_rank"](0):
            assert sys.stderr is saved_err, "stderr stays: an error on any rank must show"
            assert sys.stdout is not saved_out
            raise ValueError("boom")
    assert sys.stdout is saved_out, "stdout is restored after an error too"


def test_export_sessions_are_counted_not_ids():
    with Cluster(world_size=1, backend="gloo") as a, Cluster(world_size=1, backend="gloo") as b:
        assert a.serial != b.serial and magic._session(a)[0] != magic._session(b)[0]


# -- learner's view -------------------------------------------------------------------------------
def test_backend_gloo_on_a_cpu_machine_keeps_the_auto_cluster(monkeypatch):
    from course_utils.engine import launcher

    if launcher.choose_backend("auto", 2) != "gloo":
        pytest.skip("auto picks NCCL here")
    monkeypatch.setattr(magic, "_CLUSTER", None)
    try:
        c, _ = magic._cluster_for(2, "auto")
        c.run("named = 7")
        again, note = magic._cluster_for(2, "gloo")
        assert again is c and note is None and again.run("named") == [7, 7]
    finally:
        magic.shutdown_cluster()


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads /proc")
def test_an_interrupt_says_where_each_rank_was_without_engine_frames(two, tmp_path):
    done = threading.Event()

    def stop_once_both_wait():  # not a fixed delay: on a loaded machine a rank may take seconds to get there
        deadline = time.monotonic() + 60
        while not done.is_set() and time.monotonic() < deadline:
            if all((tmp_path / str(r)).exists() for r in (0, 1)) and all(asleep(p) for p in two.pids):
                os.kill(os.getpid(), signal.SIGINT)  # both ranks are in their sleep or barrier
                return
            time.sleep(0.05)

    stopper = threading.Thread(target=stop_once_both_wait, daemon=True)
    stopper.start()
    try:
        with pytest.raises(KeyboardInterrupt) as info:
            two.run_cell(f"import pathlib, time\npathlib.Path({str(tmp_path)!r}, str(rank)).touch()\n"
                         "if rank == 0:\n    time.sleep(60)\nelse:\n    import torch.distributed as dist\n"
                         "    dist.barrier()", timeout=60)
    finally:
        done.set()
        stopper.join()
    text = "\n".join(info.value._render_traceback_())
    assert "interrupted: every rank stopped" in text and "names you defined are kept" in text
    assert "rank 0: was running" in text and "time.sleep(60)" in text, text
    assert "rank 1: was running" in text and "barrier" in text, text
    assert "launcher.py" not in text and "run_cell_magic" not in text


def test_two_dead_ranks_name_the_lowest_and_each_exit_code_once():
    err = reports.dead_error({2: 5, 1: -9}, note="")
    text = str(err)
    assert err.rank == 1 and text.startswith("rank 1 died: it was killed by SIGKILL.")
    assert text.count("SIGKILL") == 1 and "rank 2: exited with code 5" in text


def test_two_ranks_that_die_are_both_named(make_cluster):
    c = make_cluster(3, timeout=20)
    with pytest.raises(DistributedError) as info:
        c.run_cell("import os, time\nif rank in (1, 2):\n    os._exit(5 + rank)\ntime.sleep(5)")  # at once
    text = str(info.value)
    assert text.startswith("rank 1 died: it exited with code 6") and "rank 2: exited with code 7" in text, text


def test_the_rank_finder_sees_the_ranks_on_this_start_path():
    """What test_portability.py's stop-during-start test relies on: a started cluster's ranks are exactly the new
    ones _ranks_below finds."""
    before = _ranks_below(os.getpid())
    with Cluster(world_size=2, backend="gloo") as c:
        assert _ranks_below(os.getpid()) - before == set(c.pids)
    deadline = time.monotonic() + 10
    while _ranks_below(os.getpid()) - before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _ranks_below(os.getpid()) - before


def _ranks_below(pid):
    """engine_helpers.ranks_below, which reads /proc: skipped where there is none."""
    if not os.path.isdir("/proc/self"):
        pytest.skip("reads /proc")
    return ranks_below(pid)


# -- the capstone script's abort at exit ----------------------------------------------------------------
AFTER_MAIN = textwrap.dedent("""
    import os, runpy, sys
    script = sys.argv.pop(1)
    ns = runpy.run_path(script, run_name="train")
    ns["main"]()
    import gc
    gc.collect()
    names = sorted(open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task"))
    # one write (print writes the text and its newline apart, unbuffered): the ranks share torchrun's pipe
    sys.stdout.flush()
    os.write(1, f"rank {os.environ['RANK']} threads after main: {names}\\n".encode())
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_capstone_script_frees_its_process_group_before_the_interpreter_ends(torchrun, tmp_path):
    """The abort at exit ("terminate called without an active exception"): gloo's threads
    were still alive when the interpreter shut down, because torch.distributed.nn, imported after
    init_process_group by the first optimizer (through torch._dynamo), held the group in default arguments."""
    from conftest import finish, retry_on_port_clash

    wrapper = tmp_path / "after_main.py"
    wrapper.write_text(AFTER_MAIN)

    def launch(port):
        proc = torchrun("--nnodes=1", "--nproc-per-node=2", "--master-addr=127.0.0.1", f"--master-port={port}",
                        script=wrapper, script_args=[ROOT / "scripts" / "train_micro_ddp.py", "--steps", "2"])
        return finish(proc, "the capstone script")

    out = retry_on_port_clash(launch)
    lines = [line for line in out.splitlines() if "threads after main" in line]
    assert len(lines) == 2, out[-3000:]
    for line in lines:
        assert "pt_gloo_runloop" not in line and "gloo_tcp_loop" not in line, \
            f"the destroyed group's gloo threads outlive main(): {line}"


# -- docs/engine.md's "Supported systems" off Linux ----------------------------------------------------
def test_ranks_start_as_fresh_interpreters_by_default_off_linux(monkeypatch):
    monkeypatch.delenv("COURSE_UTILS_START", raising=False)
    monkeypatch.setattr(sys, "platform", "darwin")
    assert not _forkstart.wanted(), "macOS's system libraries are not fork-safe: spawn is its default"
    monkeypatch.setenv("COURSE_UTILS_START", "forkserver")
    assert _forkstart.wanted()
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.delenv("COURSE_UTILS_START")
    assert _forkstart.wanted()


def test_gloo_binds_to_the_loopback_interface_of_each_system():
    from course_utils.engine.launcher import _loopback_interface

    assert _loopback_interface("linux", {"GLOO_SOCKET_IFNAME": "eth0"}) == "lo", "the ranks stay on loopback"
    assert _loopback_interface("darwin", {}) == "lo0"
    assert _loopback_interface("darwin", {"GLOO_SOCKET_IFNAME": "lo1"}) == "lo1"


def test_releasing_the_ranks_leaves_the_learners_own_loopback_connections_open(make_cluster):
    c = make_cluster(2, timeout=20)
    c.run("import socket\nserver = socket.create_server(('127.0.0.1', 0))\n"
          "client = socket.create_connection(server.getsockname())\npeer, _ = server.accept()")
    with pytest.raises(DistributedError):
        c.run("import torch, torch.distributed as dist\nif rank == 1:\n    raise ValueError('late')\n"
              "dist.all_reduce(torch.ones(1))")
    assert c.run("client.sendall(b'still open')\npeer.recv(100)") == [b"still open"] * 2


def test_a_spawn_rank_that_drops_its_ddp_and_group_ends_cleanly_every_time():
    """The last reference to a gloo group going with a DDP Reducer, right after its works, deadlocked a rank
    in ~ProcessGroupGloo (which joins its threads holding the GIL) once torch.distributed.nn no longer leaked
    the group: the ranks now keep every group until they exit."""
    from course_utils import spawn

    def demo(rank, world_size):
        import torch
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP

        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        model = DDP(torch.nn.Linear(4, 4))
        for _ in range(3):
            model(torch.randn(8, 4)).sum().backward()
        dist.destroy_process_group()
        return rank

    for _ in range(5):
        assert spawn(demo, args=(2,), nprocs=2, timeout=60) == [0, 1]


# -- a command's cost does not grow with what the ranks hold -----------------------------------------
COUNT_COLLECTIONS = """
import gc
if not hasattr(gc, "_counted"):
    gc._original_collect, gc._counted = gc.collect, []
    def _counting_collect(*args, **kwargs):
        gc._counted.append(1)
        return gc._original_collect(*args, **kwargs)
    gc.collect = _counting_collect
gc._counted.clear()
"""


def test_a_command_runs_no_full_collection_unless_a_group_was_destroyed(make_cluster):
    """A full gc.collect() before every command cost 0.27 ms per rank with nothing allocated and 414 ms with 300k
    small dicts on each rank. Now: none while no group was destroyed; one for a destroyed group that something
    else still holds; none when its last reference goes."""
    c = make_cluster(2, timeout=30)
    groups = "import sys\nlen(sys.modules['course_utils.engine._worker']._GROUPS)"
    before = c.run(groups)
    c.run(COUNT_COLLECTIONS)
    for _ in range(5):
        c.run("rank")
    assert c.run("len(gc._counted)") == [0, 0], "a full collection ran before commands while nothing was destroyed"
    c.run("import torch.distributed as dist\ng = dist.new_group([0, 1])\ndist.destroy_process_group(g)")
    for _ in range(4):
        c.run("rank")
    assert c.run("len(gc._counted)") == [1, 1], "a destroyed group still held: collect once, not per command"
    c.run("del g")
    for _ in range(3):
        c.run("rank")
    assert c.run("len(gc._counted)") == [1, 1], "its last reference gone, the group is freed without another collection"
    assert c.run(groups) == before, f"the destroyed group should be freed: {before} groups kept before, {c.run(groups)}"
    c.run("gc.collect = gc._original_collect\ndel gc._counted, gc._original_collect")


def test_a_rank_skips_the_libraries_finalizers_at_its_end_but_runs_the_cells(tmp_path):
    """torch's import leaves 134 weakref.finalize callbacks (torch.library's _del_library: 78-85 ms of CPU per rank
    at every restart and shutdown, for a process that then ends with os._exit). They are skipped; a finalizer a
    cell makes (a TemporaryDirectory's cleanup) still runs, as at a script's end."""
    with Cluster(world_size=2, backend="gloo", timeout=30) as c:
        at_exit = c.run("import weakref\nsum(f.atexit for f in list(weakref.finalize._registry))")
        assert at_exit == [0, 0], f"finalizers made before the first cell still run at the rank's end: {at_exit}"
        c.run(f"import shutil, weakref\nclass Box: pass\nkeep = Box()\nfolder = {str(tmp_path)!r} + f'/made{{rank}}'\n"
              "import os\nos.mkdir(folder)\nweakref.finalize(keep, shutil.rmtree, folder)")
        assert sorted(p.name for p in tmp_path.iterdir()) == ["made0", "made1"]
    deadline = time.monotonic() + 30
    while list(tmp_path.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not list(tmp_path.iterdir()), "a finalizer a cell made did not run at the rank's end"


def test_shutdown_all_stops_every_cluster_even_when_one_refuses(monkeypatch):
    """%ddp shutdown stopped at the first cluster that raised (a busy one) and left the rest running."""
    from course_utils.engine import launcher

    first, second = Cluster(world_size=1, backend="gloo"), Cluster(world_size=1, backend="gloo")
    try:
        refusing = first if list(launcher._LIVE).index(first) == 0 else second
        other = second if refusing is first else first

        def busy():
            raise RuntimeError("shutdown(): the cluster is busy")

        monkeypatch.setattr(refusing, "shutdown", busy)
        with pytest.raises(RuntimeError, match="busy"):
            launcher.shutdown_all()
        assert not other.alive, "shutdown_all left a cluster running after another refused"
    finally:
        monkeypatch.undo()
        first.shutdown()
        second.shutdown()


def test_a_dead_rank_whose_exit_code_never_came_is_reported_as_unknown():
    """After a kill the engine waits with a deadline (a wedged fork server never reaps): the code may stay None."""
    error = reports.dead_error({1: None, 2: 3}, "note")
    assert "rank 1 died: it ended, its exit code unknown" in str(error), str(error)
    assert "rank 2: exited with code 3" in str(error), str(error)


def test_a_stop_while_a_rank_starts_acts_once_the_rank_is_recorded():
    """Each rank's start holds SIGINT (on the spawn path a stop while Popen waited for the exec left a rank nothing
    killed): inside the block the stop waits; after it, the handler that was there gets it."""
    from course_utils.engine import launcher

    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        recorded = []
        with pytest.raises(KeyboardInterrupt):
            with launcher._sigint_held():
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.05)          # the signal is delivered here, and held
                recorded.append("rank")   # still reached: the stop acts after the block
        assert recorded == ["rank"]
        got = []
        signal.signal(signal.SIGINT, lambda *_: got.append(1))   # a call's deferring handler sets its flag
        with launcher._sigint_held():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
            assert got == []
        assert got == [1], "the stop must reach the handler that was there before the block"
    finally:
        signal.signal(signal.SIGINT, old)


def test_a_rank_waiting_in_a_gloo_collective_sees_a_stop_at_once(two):
    """torch's Work.wait is one C++ call: a SIGINT (the stop button, the engine's release) reached Python only when
    the collective ended, and a rank whose collective gloo never completes (it posted its receive on a connection
    that was closing: 1 error cell in about 300 on 4 ranks) was replaced, names lost. The engine waits in slices.
    Here rank 1 stops itself while rank 0 is still asleep: before, the stop landed after the all_reduce, 10 s on."""
    cell = textwrap.dedent("""\
        import os, signal, threading, time, torch, torch.distributed as dist
        if rank == 1:
            threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
        else:
            time.sleep(10)   # the engine stops this sleep once rank 1 has failed
        dist.all_reduce(torch.ones(1))
        """)
    start = time.monotonic()
    with pytest.raises(DistributedError) as err:
        two.run(cell)
    took = time.monotonic() - start
    text = str(err.value)
    own = text.split("The other ranks")[0]
    assert "rank 1 failed with KeyboardInterrupt" in own, text
    assert "in all_reduce" in own and "work.wait()" in own, f"the stop must land inside the collective:\n{text}"
    assert "rank 0: was running at <ddp>, line 5: time.sleep(10)" in text, text
    assert took < 8, f"the stop took {took:.1f} s: it waited for rank 0's sleep to end"
    assert two.run("rank") == [0, 1]  # the same ranks, released and regrouped


def test_a_wait_on_a_work_without_timed_waits_still_works(two):
    """The sliced wait falls back to one plain wait for a kind of work that has no timed wait (a future's)."""
    cell = ("import torch\nfrom torch._C._distributed_c10d import _create_work_from_future\n"
            "fut = torch.futures.Future()\nfut.set_result([torch.ones(1)])\n"
            "_create_work_from_future(fut).wait()")
    assert two.run(cell) == [True, True]


def test_a_recv_that_waits_longer_than_a_slice_still_gets_its_message(two):
    """gloo ends a recv whose timed wait runs out: the sliced wait leaves sends and recvs to one plain wait."""
    cell = textwrap.dedent("""\
        import time, torch, torch.distributed as dist
        buf = torch.full((3,), float(rank))
        if rank == 0:
            time.sleep(0.5)   # five slices
            dist.send(torch.arange(3.0), dst=1)
        else:
            dist.recv(buf, src=0)
        buf.tolist()
        """)
    assert two.run(cell) == [[0.0, 0.0, 0.0], [0.0, 1.0, 2.0]]
