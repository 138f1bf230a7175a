"""Launch overhead of the %%ddp engine against torch.multiprocessing.spawn, measured in one run.

    .venv/bin/python benchmarks/launch_overhead.py          # or: make bench

Rows (4 ranks unless said): the first cluster of the process up to its first all_reduce (the fork
server, if used, starts inside it), a start after a crash (from the cell whose rank died to the next
good result), a start at another world size (a new 3-rank cluster), a full restart, an error with soft
recovery, the warm round trip of ``Cluster.run`` (median of 500), and ``mp.spawn`` of the same
one-all-reduce job. Issue 16's targets: first start <= 0.5x spawn, a start after a crash or at another
world size <= 0.15x, warm round trip <= 2 ms. ``COURSE_UTILS_START=spawn`` measures the fallback.
"""
import datetime
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from course_utils import Cluster, DistributedError  # noqa: E402

JOB = "import torch\nimport torch.distributed as dist\nt = torch.ones(1)\ndist.all_reduce(t)\nt.item()"


def _spawned(rank, world_size, init_file):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=60))
    t = torch.ones(1)
    dist.all_reduce(t)
    dist.destroy_process_group()


def time_mp_spawn(world_size):
    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        mp.spawn(_spawned, args=(world_size, os.path.join(d, "init")), nprocs=world_size, join=True)
        return time.perf_counter() - t0


def time_cold(world_size):
    t0 = time.perf_counter()
    c = Cluster(world_size=world_size, backend="gloo")
    assert c.run(JOB) == [float(world_size)] * world_size
    return time.perf_counter() - t0, c


def warm_round_trips(c, n=500):  # 500: the median of 100 moves by 20% with the load
    for _ in range(5):
        c.run("None")
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        c.run("None")
        times.append(time.perf_counter() - t0)
    return statistics.median(times), sorted(times)[int(0.9 * n)]


def time_error_recovery(c):
    t0 = time.perf_counter()
    try:
        c.run("import torch\nif rank == 1:\n    raise ValueError('x')\ndist.all_reduce(torch.ones(1))")
    except DistributedError:
        pass
    assert c.run("rank") == list(range(c.world_size))
    return time.perf_counter() - t0


def time_crash_restart(c):
    """From a cell whose rank dies to the next good result (the ranks are replaced)."""
    t0 = time.perf_counter()
    try:
        c.run("import os\nif rank == 1:\n    os._exit(3)\nNone")
    except DistributedError:
        pass
    assert c.run(JOB) == [float(c.world_size)] * c.world_size
    return time.perf_counter() - t0


def time_other_world_size(world_size):
    t0 = time.perf_counter()
    with Cluster(world_size=world_size, backend="gloo") as c:
        assert c.run(JOB) == [float(world_size)] * world_size
        return time.perf_counter() - t0


def header(start, started):
    """The table's first line. The cores this process may use: os.sched_getaffinity where the system has it
    (Linux), else the core count (macOS), as the engine counts them."""
    from course_utils.engine.launcher import _cpu_count

    return (f"launch overhead on {_cpu_count()} cores, torch {torch.__version__}, gloo, "
            f"4 ranks; ranks from: {start} (used: {started})")


def main():
    from course_utils.engine import _forkstart

    start = "fork server (torch preloaded)" if _forkstart.wanted() else "fresh interpreters (COURSE_UTILS_START=spawn)"
    first, c = time_cold(4)  # first: the fork server, if any, starts inside this measurement
    med, p90 = warm_round_trips(c)
    recover = time_error_recovery(c)
    crash = time_crash_restart(c)
    t0 = time.perf_counter()
    c.restart()
    c.run("None")
    restart = time.perf_counter() - t0
    c.shutdown()
    other = time_other_world_size(3)
    spawn = time_mp_spawn(4)
    started = "fork server" if _forkstart._state["ctx"] is not None else "fresh interpreters"
    print(header(start, started))
    rows = [("first Cluster(4) of the process, to its first all_reduce", first),
            ("start after a crash: failing cell to the next good result", crash),
            ("start at another world size: new Cluster(3) to its first all_reduce", other),
            ("full restart()", restart),
            ("error on one rank + soft recovery", recover),
            ("mp.spawn of the same 4-rank all_reduce job", spawn)]
    for name, t in rows:
        ratio = f"{t / spawn:5.2f}x spawn" if name[:8] != "mp.spawn" else ""
        print(f"{name:<70} {t:7.2f} s  {ratio}")
    print(f"{'warm round trip (median of 500 / p90)':<70} {med * 1e3:7.2f} ms / {p90 * 1e3:.2f} ms")
    print()
    for what, value, target in [("first start", first / spawn, 0.5), ("start after a crash", crash / spawn, 0.15),
                                ("start at another world size", other / spawn, 0.15)]:
        print(f"{what}: {value:.2f}x spawn (target <= {target}x): {'met' if value <= target else 'MISSED'}")
    print(f"warm round trip: {med * 1e3:.2f} ms (target <= 2 ms): {'met' if med <= 0.002 else 'MISSED'}")


if __name__ == "__main__":
    main()
