"""The engine's start-up promises on the fallback path: ranks as fresh interpreters (COURSE_UTILS_START=spawn).

test_engine.py and the other engine modules run on the default path (ranks forked from the per-process
fork server that has torch imported). This module runs a representative subset of test_engine.py again,
with the fallback forced: start-up, environment, output capture, failures, hangs, dead ranks, interrupts
while starting, loopback-only sockets and leaks. It also checks the fallback's one-time note.
"""
import os
import subprocess
import sys
import textwrap

import pytest

from conftest import ROOT
from test_engine import (  # noqa: F401  (collected here again, with this module's fixtures)
    test_torch_dynamo_is_imported_before_the_first_cell_and_ddp_works,
    test_dead_worker_is_reported_and_replaced,
    test_each_rank_runs_with_its_share_of_the_cores_and_blas_works,
    test_every_socket_listens_on_loopback_only,
    test_exception_names_first_rank_and_releases_the_others,
    test_output_is_prefixed_grouped_and_includes_fd_level_writes,
    test_ranks_are_forks_of_the_torch_server_or_fresh_interpreters,
    test_repeated_launches_leak_no_processes_or_fds,
    test_skipped_collective_times_out_with_stacks_and_recovers,
    test_torch_distributed_is_initialised_with_torchrun_env,
)
from test_engine_faults import (  # noqa: F401  (the review's faults, on this path too)
    test_a_cell_that_redirects_fd_1_finishes_at_once_keeps_the_names_and_does_not_spin,
    test_a_cell_that_sets_sys_stdout_to_none_does_not_kill_the_rank,
    test_torch_distributed_nn_never_captures_a_live_group_in_its_defaults,
    test_every_rank_and_every_restart_draws_its_own_random_state,
    test_interrupt_while_the_ranks_start_leaves_no_rank_running,
    test_the_rank_finder_sees_the_ranks_on_this_start_path,
    test_output_is_grouped_by_rank_even_when_higher_ranks_print_first,
    test_settings_read_when_a_library_loads_follow_the_notebooks_environment,
    test_the_ranks_argv_is_one_value_and_cells_run_in_a_real_main_module,
    two,
)
from test_portability import test_ranks_end_when_the_notebook_dies_even_if_their_pipes_stay_open  # noqa: F401

@pytest.fixture(scope="module", autouse=True)
def start_fresh_interpreters():
    saved = os.environ.get("COURSE_UTILS_START")
    os.environ["COURSE_UTILS_START"] = "spawn"
    yield
    if saved is None:
        os.environ.pop("COURSE_UTILS_START", None)
    else:
        os.environ["COURSE_UTILS_START"] = saved


BROKEN_SERVER = textwrap.dedent("""
    import sys
    sys.path.insert(0, {root!r})
    from multiprocessing import forkserver

    def cannot_start():
        raise OSError("no fork server here")

    forkserver.ensure_running = cannot_start
    from course_utils import Cluster
    for world_size in (2, 1):
        with Cluster(world_size=world_size, backend="gloo") as c:
            print(c.run("import sys\\nsys.modules['course_utils.engine._worker'].__name__"))
""")


def test_a_server_that_cannot_start_falls_back_to_fresh_interpreters_with_one_note():
    env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_CURRENT_TEST", "COURSE_UTILS_START")}
    run = subprocess.run([sys.executable, "-c", BROKEN_SERVER.format(root=str(ROOT))], capture_output=True, text=True,
                         timeout=180, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.splitlines() == ["['__main__', '__main__']", "['__main__']"]  # run as python -m ..._worker
    assert run.stderr.count("note: the ranks start as fresh interpreters") == 1, run.stderr
    assert "no fork server here" in run.stderr


def test_fresh_interpreters_import_torch_distributed_nn_before_the_group_but_not_torch_dynamo():
    """torch._dynamo (1-4 s) was imported on every start of a fresh-interpreter rank; only torch.distributed.nn,
    whose default arguments would capture the group, must come before the group (issue 30)."""
    from course_utils import Cluster

    with Cluster(world_size=2, backend="gloo") as c:
        assert c.run("import sys\n'torch.distributed.nn' in sys.modules, 'torch._dynamo' in sys.modules") \
            == [(True, False)] * 2
