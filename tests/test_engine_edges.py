"""Edges of the engine's life cycle: stops that land while it starts, restarts or writes, descriptors of dead
ranks, a dead fork server, the control thread at the notebook's end, and what ``--rank`` hides.

Each test holds one invariant, stated in its docstring, on the default start path (ranks forked from the fork
server); test_engine_spawn_start.py checks the fresh-interpreter path where the two differ.
"""
import os
import queue
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from conftest import ROOT
from course_utils import Cluster, DistributedError
from course_utils.engine import _forkstart, _wire, _worker

CHILD_ENV = dict(os.environ, PYTHONPATH=str(ROOT))


@pytest.fixture(scope="module")
def two(make_cluster):
    return make_cluster(2, timeout=30)


def _stop_after(seconds):
    """A stop (SIGINT to this process, as the stop button sends) in ``seconds``, from another thread."""
    timer = threading.Timer(seconds, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    return timer


def test_a_stop_during_restart_or_shutdown_never_reads_as_a_death_at_the_next_call():
    """A restart or a shutdown finishes stopping the ranks before a stop acts: the next call runs on fresh ranks,
    and no report says a rank died between calls."""
    c = Cluster(world_size=1, backend="gloo", timeout=60)
    try:
        for action in (c.restart, c.shutdown):
            c.run("import atexit, time\natexit.register(time.sleep, 1.0)")  # the rank takes a second to end
            timer = _stop_after(0.3)
            try:
                action()
            except KeyboardInterrupt:
                pass
            timer.join()
            assert c.run("rank") == [0], f"the call after a stop during {action.__name__}()"
    finally:
        c.shutdown()


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts /proc/self/fd")
def test_every_descriptor_of_a_dead_rank_is_closed():
    """A rank that died (its stream pipes read to their end) leaves no descriptor open in the notebook, also when
    it had redirected its stdout first."""
    c = Cluster(world_size=1, backend="gloo", timeout=60)
    crash = "import os\nos.dup2(os.open(os.devnull, os.O_WRONLY), 1)\nos._exit(3)"
    try:
        counts = []
        for _ in range(4):
            with pytest.raises(DistributedError, match="rank 0 died"):
                c.run(crash)
            counts.append(len(os.listdir("/proc/self/fd")))
        assert counts[1:] == [counts[0]] * 3, f"open fds after each crash: {counts}"
    finally:
        c.shutdown()


def test_a_push_to_a_rank_that_cannot_read_its_commands_ends_at_a_stop_and_at_the_deadline():
    """Writing to a rank never blocks the notebook: a push larger than the pipe's buffer to a rank whose every
    thread is held (a thread keeps the GIL) ends at the cell's deadline, and at a stop."""
    wedge = ("import ctypes, threading\n"
             "threading.Timer(0.3, ctypes.PyDLL(None).sleep, (25,)).start()  # holds the GIL for 25 s")
    big = bytes(4 << 20)
    c = Cluster(world_size=1, backend="gloo", timeout=2)
    try:
        c.run(wedge)
        time.sleep(0.6)
        t0 = time.monotonic()
        with pytest.raises(DistributedError, match="did not finish within 2 s"):
            c.push(big=big)
        took_deadline = time.monotonic() - t0
        c.timeout = 60.0
        c.run(wedge)
        time.sleep(0.6)
        timer = _stop_after(0.5)
        t0 = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            c.push(big=big)
        took_stop = time.monotonic() - t0
        timer.join()
        assert took_deadline < 15 and took_stop < 15, (took_deadline, took_stop)
        assert c.run("rank") == [0]
    finally:
        c.shutdown()


START_STOP = textwrap.dedent("""
    import os, signal, threading, time
    from course_utils import Cluster
    from course_utils.engine import _forkstart
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a kernel, also when started with SIGINT ignored
    threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()
    t0 = time.monotonic()
    try:
        Cluster(world_size=1, backend="gloo")
        print("no stop")
    except KeyboardInterrupt:
        print("stopped after", round(time.monotonic() - t0, 2))
    with Cluster(world_size=1, backend="gloo") as c:
        print("next", c.run("rank"))
""")


def test_the_stop_button_works_while_the_fork_server_imports_torch():
    """A stop while the first cluster waits for the fork server (importing torch takes seconds) acts at once, and
    the next cluster starts."""
    if not _forkstart.wanted():
        pytest.skip("the ranks start as fresh interpreters here")
    proc = subprocess.run([sys.executable, "-c", START_STOP], capture_output=True, text=True, timeout=240,
                          env=CHILD_ENV, start_new_session=True)
    assert "next [0]" in proc.stdout, proc.stdout + proc.stderr
    took = float(proc.stdout.split("stopped after ")[1].split()[0])
    assert took < 1.5, f"the stop acted {took} s after it was pressed: {proc.stdout}"


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="finds the rank's server in /proc")
def test_a_killed_fork_server_is_named_and_no_exit_code_is_made_up():
    """When a rank's fork server is killed its ranks end with it: the report says so, with no exit code that
    nobody reported."""
    if not _forkstart.wanted():
        pytest.skip("the ranks start as fresh interpreters here")
    c = Cluster(world_size=1, backend="gloo", timeout=30)
    try:
        (server,) = c.run("import os\nos.getppid()")
        os.kill(server, signal.SIGKILL)
        with pytest.raises(DistributedError) as info:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:  # the rank ends within a second or two of its server
                c.run("None")
                time.sleep(0.2)
        text = str(info.value)
        assert "fork server" in text and "255" not in text, text
    finally:
        c.shutdown()
        _forkstart.stop()  # the next test starts a new server, with its one restart still unused


def test_the_torch_logs_setting_is_the_notebooks_at_the_clusters_start(monkeypatch, make_cluster):
    """TORCH_LOGS set in the notebook after the fork server imported torch reaches the ranks, as it reaches a fresh
    interpreter."""
    make_cluster(1)  # the fork server runs and has imported torch already
    monkeypatch.setenv("TORCH_LOGS", "dynamo")
    with Cluster(world_size=1, backend="gloo") as c:
        (levels,) = c.run("import torch._logging._internal as L\nL.log_state.log_qname_to_level")
    assert levels.get("torch._dynamo") is not None, levels


def test_the_control_thread_ends_at_the_notebooks_end_without_handling_a_command_twice():
    """Once the command pipe is at its end the control thread stops reading: the last command is handled once."""
    sent = []
    worker = _worker.Worker.__new__(_worker.Worker)
    r, w = os.pipe()
    os.write(w, _wire.dump(("stacks", 7)))
    os.close(w)
    worker.cmd_fd, worker.rank, worker.busy, worker.run_id = r, 0, False, 0
    worker.channel = type("Channel", (), {"send": lambda self, msg: sent.append(msg)})()
    worker.ending, worker.ending_lock, worker.commands = True, threading.Lock(), queue.Queue()
    try:
        thread = threading.Thread(target=worker.control_loop, daemon=True)
        thread.start()
        thread.join(2.0)
        assert not thread.is_alive(), "the control thread went on after the end of its command pipe"
        assert [m[:2] for m in sent] == [("stacks", 7)], sent[:5]
    finally:
        os.close(r)


def test_rank_option_hides_only_the_other_ranks_stdout(two, capfd):
    """--rank R hides the other ranks' printed output, never their stderr (an error on any rank shows), as the
    exported script does."""
    capfd.readouterr()
    two.run_cell("import sys\nprint('out', rank)\nprint('err', rank, file=sys.stderr)", only_rank=0)
    out, err = capfd.readouterr()
    assert out == "[rank 0] out 0\n", out
    assert "[rank 0] err 0" in err and "[rank 1] err 1" in err, err
