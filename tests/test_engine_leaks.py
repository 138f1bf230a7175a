"""The engine's third review (issue 30): what a rank keeps, how it ends, and what it says.

A rank kept every process group it ever made (against torch 2.13's deadlock in ~ProcessGroupGloo), so
each ``new_group``/``destroy`` pair and each recovery leaked 4-5 fds and 3 threads until the fds ran out.
"""
import sys
import time

import pytest

from course_utils import Cluster, DistributedError

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
