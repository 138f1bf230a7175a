"""The engine's start-up promises on the fallback path: ranks as fresh interpreters (COURSE_UTILS_START=spawn).

test_engine.py and the other engine modules run on the default path (ranks forked from the per-process fork
server that has torch imported). This module checks again, with the fallback forced, what the start path
changes: start-up, environment and imports, output capture, failures, hangs, dead ranks, loopback-only sockets,
and the fallback's one-time note. test_portability.py runs a stop while starting, repeated launches and the
notebook's death once on each path (its ``start_path`` fixture).

A fresh interpreter costs about 6 CPU-s to start (it imports torch), so the checks share one 2-rank cluster
(``fresh``) and the others start as few ranks as their check needs. What the fork path alone can break (BLAS
after a fork, the server's idle imports) and what both paths share (how each kind of death is named, restart(),
the rank finder) is tested in test_engine.py and test_engine_faults.py only.
"""
import os

import pytest

from engine_helpers import (check_cells_run_in_a_real_main_module, check_multiprocessing_with_cell_code,
                            check_output_after_fd_1_is_redirected, check_output_is_prefixed_and_grouped,
                            check_output_to_sys_stdout_none_keeps_the_ranks,
                            check_an_exception_names_its_rank_and_releases_the_others,
                            check_settings_read_when_a_library_loads)
from course_utils import Cluster, DistributedError, DistributedTimeout
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
    check_cells_run_in_a_real_main_module(fresh)


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
    check_output_is_prefixed_and_grouped(fresh, capfd, stagger_s=0.5)  # rank 1 prints first, most of the time


def test_a_cell_that_sets_sys_stdout_to_none_does_not_kill_the_rank(fresh, capfd):
    check_output_to_sys_stdout_none_keeps_the_ranks(fresh, capfd)


def test_a_cell_that_redirects_fd_1_finishes_at_once_and_keeps_the_names(make_cluster, capfd):
    check_output_after_fd_1_is_redirected(make_cluster(1, timeout=21), capfd)  # its own rank: stdout stays closed


# -- failures, hangs, deaths -------------------------------------------------------------------------------------------
def test_an_exception_names_its_rank_and_releases_the_other(fresh):
    check_an_exception_names_its_rank_and_releases_the_others(fresh)

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
def test_settings_read_when_a_library_loads_follow_the_notebooks_environment(monkeypatch):
    check_settings_read_when_a_library_loads(monkeypatch, world_size=1)

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
