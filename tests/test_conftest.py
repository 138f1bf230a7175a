"""The shared helpers of tests/conftest.py do what the other test modules rely on.

    .venv/bin/python -m pytest tests/test_conftest.py -p no:randomly
"""
import os
import signal
import subprocess
import tempfile
from pathlib import Path
import sys
import time

import pytest

from conftest import (ROOT, TEST_CACHE, PortClash, alive, children_of, free_port, in_ci, kill_process_group,
                      register_by_value, repository_extras, retry_on_port_clash)

register_by_value(sys.modules[__name__])


def _on_rank():
    import torch.distributed as dist
    return dist.get_backend(), dist.get_world_size()


def test_make_cluster_pins_gloo_and_caches_per_options(make_cluster, cluster4):
    two = make_cluster(2)
    assert make_cluster(2) is two, "the same options must return the cached cluster"
    assert make_cluster(4, timeout=30) is cluster4, "cluster4 is make_cluster(4, timeout=30)"
    assert make_cluster(2, timeout=45) is not two, "other options make another cluster"
    assert two.run(_on_rank) == [("gloo", 2)] * 2, "make_cluster must pin the gloo backend"
    two.shutdown()
    again = make_cluster(2)
    assert again is not two and again.alive, "a cluster a test shut down is replaced by a fresh one"


def test_register_by_value_is_idempotent_and_accepts_a_name():
    import cloudpickle
    assert register_by_value(__name__) is sys.modules[__name__]
    register_by_value(sys.modules[__name__])
    assert __name__ in cloudpickle.list_registry_pickle_by_value()


def test_free_port_is_bindable_and_a_clash_is_retried():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", free_port()))
    seen = []

    def launch(port):
        seen.append(port)
        if len(seen) < 3:
            raise PortClash(f"port {port} taken")
        return port

    assert retry_on_port_clash(launch) == seen[-1] and len(seen) == 3
    with pytest.raises(AssertionError, match="no free port after 2 attempts"):
        retry_on_port_clash(lambda port: (_ for _ in ()).throw(PortClash("taken")), attempts=2)


def test_kill_process_group_reaches_grandchildren():
    # A parent that starts a child and ignores SIGTERM: both must be gone afterwards.
    code = ("import subprocess, sys, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN);"
            "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']);"
            "print(c.pid, flush=True); time.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True)
    grandchild = None
    try:
        grandchild = int(proc.stdout.readline())
        assert alive(proc.pid) and alive(grandchild) and children_of(proc.pid) == [grandchild]
        kill_process_group(proc, grace=1.0)
        deadline = time.monotonic() + 10
        while alive(grandchild) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(proc.pid) and proc.returncode is not None, "the group's leader survived"
        assert not alive(grandchild), "the leader's child survived the group kill"
        kill_process_group(proc)  # twice is harmless
    finally:  # whatever failed above, no `sleep 600` outlives the test
        for pid in (proc.pid, grandchild):
            if pid is not None:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        proc.wait(timeout=10)
        proc.stdout.close()


def test_kill_process_group_refuses_pytests_own_group():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with pytest.raises(RuntimeError, match="start_new_session"):
            kill_process_group(proc)
    finally:
        proc.kill()
        proc.wait()


def test_alive_tells_a_zombie_from_a_live_process():
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    assert alive(proc.pid) and alive(proc), "a running child is alive"
    proc.stdin.close()  # the child exits; nobody reaps it yet, so it stays a zombie
    deadline = time.monotonic() + 60
    while alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(proc.pid), "an exited, unreaped child (a zombie) must not count as alive"
    assert proc.wait(timeout=10) == 0
    assert alive(os.getpid()) and not alive(proc.pid)


def test_the_tests_cache_is_a_fresh_temporary_directory():
    """Lesson 04 under nbval and course_utils.bench save to $MICRO_DDP_CACHE: never the repository, never the
    learner's ~/.cache/micro-ddp, in this process and in a kernel started now (nbval's inherits this env)."""
    cache = Path(TEST_CACHE).resolve()
    assert os.environ["MICRO_DDP_CACHE"] == TEST_CACHE and cache.is_dir()
    assert cache.parent == Path(tempfile.gettempdir()).resolve() and cache.name.startswith("micro-ddp-test-cache-")
    home_cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").resolve()
    for outside in (ROOT.resolve(), home_cache):
        assert outside not in cache.parents, f"{cache} lies in {outside}"
    from course_utils import bench
    assert Path(bench.DEFAULT_PATH).resolve().parent == cache, "course_utils.bench was imported before conftest"
    kernel = subprocess.run([sys.executable, "-c", "from course_utils import bench; print(bench.DEFAULT_PATH)"],
                            capture_output=True, text=True, timeout=120, check=True)
    assert Path(kernel.stdout.strip()).resolve().parent == cache, kernel.stdout


def test_a_file_written_into_the_repository_is_seen(tmp_path):
    """conftest's end-of-session check compares these entries: a new untracked or ignored file shows up."""
    before = repository_extras()
    if before is None:
        if in_ci():
            pytest.fail("CI runs from a git clone: the repository check needs git")
        pytest.skip("not a git checkout")
    probe = ROOT / "tests" / f".probe-{os.getpid()}.tmp"
    try:
        probe.write_text("")
        assert f"tests/{probe.name}" in repository_extras() - before
    finally:
        probe.unlink(missing_ok=True)
    assert f"tests/{probe.name}" not in repository_extras()


WRITE_PROBE = "MICRO_DDP_TEST_WRITE_PROBE"  # set by the test below for its inner pytest run only


@pytest.mark.skipif(not os.environ.get(WRITE_PROBE), reason="run by the test below, in its own pytest")
def test_writes_into_the_repository():
    Path(os.environ[WRITE_PROBE]).write_text("a test wrote here\n")


def test_a_run_that_writes_into_the_repository_fails_in_ci():
    if repository_extras() is None:
        pytest.skip("not a git checkout")
    probe = ROOT / "tests" / f".written-by-a-test-{os.getpid()}.tmp"
    try:
        run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:randomly",
                              f"{__file__}::test_writes_into_the_repository"], cwd=ROOT, capture_output=True, text=True,
                             env=dict(os.environ, CI="true", **{WRITE_PROBE: str(probe)}), timeout=300)
    finally:
        written = probe.exists()
        probe.unlink(missing_ok=True)
    assert written, f"the inner test did not run:\n{run.stdout[-2000:]}"
    assert run.returncode == pytest.ExitCode.TESTS_FAILED and "1 passed" in run.stdout, run.stdout[-2000:]
    assert "conftest: the tests wrote into the repository: [" in run.stdout, run.stdout[-2000:]
    assert f"'tests/{probe.name}'" in run.stdout, run.stdout[-2000:]
