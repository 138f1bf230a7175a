"""Launch overhead of the %%ddp engine against torch.multiprocessing.spawn, measured in one run.

    .venv/bin/python benchmarks/launch_overhead.py                 # or: make bench
    .venv/bin/python benchmarks/launch_overhead.py --against DIR   # and another checkout's engine, in turns

Rows (4 ranks unless said): the first cluster of the process up to its first all_reduce (the fork server starts
inside it); a Cluster(1) started 0.5 s after that (the second server is importing then); the first and second start
after a crash (from the cell whose rank died to the next good result); a start at another world size; a full
restart; an error with soft recovery; the warm round trip of ``Cluster.run`` right after the first start (the
second fork server imports beside it), then at 2 and 4 ranks after 4 s idle (median of 500)
beside a bare ``multiprocessing`` Pipe round trip to as many processes (the limit: what the engine adds is its
framing, pickling and output grouping), and with 300k objects held on each rank; ``mp.spawn`` of the same
one-all-reduce job. Issue 41's targets: first start <= 0.4x spawn; every later start and crash recovery <= 0.15x;
the warm round trip with 300k objects within 1.2x of the empty one. ``--against DIR`` runs the same rows with
DIR's ``course_utils`` (a `git worktree` of an older commit) in a second process, then this checkout's again, and
prints the two side by side. ``COURSE_UTILS_START=spawn`` measures the fallback.

``--failures`` measures only how soon a failure is reported (2 ranks, median of 3): from the moment the failing rank
fails (it stamps the time just before) to the DistributedError in the notebook, while the other rank waits in a
collective, sleeps or computes; ``COURSE_UTILS_BENCH_NO_PROC=1`` measures it as on a system without /proc (macOS).
Target: <= 0.5 s in every row, on both start paths. With ``--against DIR`` too: both side by side.
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

# --against runs this file with another checkout's engine: COURSE_UTILS_ROOT names it
sys.path.insert(0, os.environ.get("COURSE_UTILS_ROOT") or os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
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
    return statistics.median(times)


def _echo(conn):
    while True:
        msg = conn.recv()
        if msg is None:
            return
        conn.send(msg)


def pipe_round_trips(world_size, n=500):
    """The limit: a message to each of ``world_size`` forked processes over a multiprocessing Pipe and their
    replies, median of ``n``."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    ends, procs = [], []
    for _ in range(world_size):
        here, there = ctx.Pipe()
        p = ctx.Process(target=_echo, args=(there,), daemon=True)
        p.start()
        ends.append(here)
        procs.append(p)
    times = []
    for i in range(n + 5):
        t0 = time.perf_counter()
        for e in ends:
            e.send(("run", "None"))
        for e in ends:
            e.recv()
        times.append(time.perf_counter() - t0)
    for e, p in zip(ends, procs):
        e.send(None)
        p.join(5)
    return statistics.median(times[5:])


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


FAILURE_CASES = [  # (key, row name, what rank 0 does, how rank 1 fails)
    ("exit_collective", "report: rank 1 exits while rank 0 waits in a collective", "dist.all_reduce(torch.ones(1))",
     "os._exit(3)"),
    ("exit_sleep", "report: rank 1 exits while rank 0 sleeps", "time.sleep(60)", "os._exit(3)"),
    ("exit_compute", "report: rank 1 exits while rank 0 computes", "while True:\n        pass", "os._exit(3)"),
    ("raise_compute", "report: rank 1 raises while rank 0 computes", "while True:\n        pass",
     "raise ValueError('x')"),
    ("raise_collective", "report: rank 1 raises while rank 0 waits in a collective", "dist.all_reduce(torch.ones(1))",
     "raise ValueError('x')"),
]


def _without_proc():
    """The engine as on a system without /proc (macOS): exit codes from the fork server alone, no /proc sampling."""
    from course_utils.engine import _forkstart, launcher

    _forkstart.zombie_exit_code = lambda pid: None
    _forkstart.ForkedProcess._stat = lambda self: None
    if hasattr(launcher, "_task_states"):  # an engine that sampled the ranks' states there
        launcher._task_states = lambda pid: None


def time_failure_reports(repeats=int(os.environ.get("COURSE_UTILS_BENCH_REPEATS", 3))):
    """Seconds from a rank's failure (stamped by the rank just before it fails) to the DistributedError, per case
    of FAILURE_CASES (median of ``repeats``: COURSE_UTILS_BENCH_REPEATS, 3 unless set)."""
    from course_utils.engine import launcher

    launcher.START_TIMEOUT_S = max(launcher.START_TIMEOUT_S, 900)  # fresh interpreters on a loaded machine
    if os.environ.get("COURSE_UTILS_BENCH_NO_PROC"):
        _without_proc()
    got = {}
    with tempfile.TemporaryDirectory() as d, Cluster(world_size=2, backend="gloo", timeout=120) as c:
        stamp = os.path.join(d, "failed_at")
        for key, _, other, failure in FAILURE_CASES:
            times = []
            for _ in range(repeats):
                c.run("None")  # the ranks (fresh after a death) are up and the group rebuilt before the clock runs
                cell = (f"import os, time, torch, torch.distributed as dist\nif rank == 1:\n    time.sleep(0.3)\n"
                        f"    open({stamp!r}, 'w').write(repr(time.time()))\n    {failure}\nelse:\n    {other}")
                try:
                    c.run(cell)
                except DistributedError:
                    times.append(time.time() - float(open(stamp).read()))
            got[key] = statistics.median(times)
    return got


def header(start, started):
    """The table's first line. The cores this process may use: os.sched_getaffinity where the system has it
    (Linux), else the core count (macOS), as the engine counts them."""
    from course_utils.engine.launcher import _cpu_count

    return (f"launch overhead on {_cpu_count()} cores, torch {torch.__version__}, gloo, "
            f"4 ranks unless said; ranks from: {start} (used: {started})")


ROWS = [("first", "first Cluster(4) of the process, to its first all_reduce", "s"),
        ("soon", "Cluster(1) started 0.5 s after the first start", "s"),
        ("crash1", "first crash: failing cell to the next good result", "s"),
        ("crash2", "second crash: the same", "s"),
        ("other", "start at another world size: new Cluster(3) to its first all_reduce", "s"),
        ("restart", "full restart()", "s"),
        ("recover", "error on one rank + soft recovery", "s"),
        ("warm4_soon", "warm round trip, 4 ranks, right after the first start (median of 200)", "ms"),
        ("warm2", "warm round trip, 2 ranks (median of 500)", "ms"),
        ("warm4", "warm round trip, 4 ranks", "ms"),
        ("warm4_held", "warm round trip, 4 ranks holding 300k objects each", "ms"),
        ("pipe2", "bare multiprocessing Pipe round trip to 2 processes", "ms"),
        ("pipe4", "bare multiprocessing Pipe round trip to 4 processes", "ms"),
        ("spawn", "mp.spawn of the same 4-rank all_reduce job", "s")]


def measure():
    """Every row of ROWS, in seconds, with this process's course_utils."""
    from course_utils.engine import _forkstart

    got = {}
    got["first"], c = time_cold(4)  # the fork server, if any, starts inside this measurement
    time.sleep(0.5)
    t0 = time.perf_counter()
    with Cluster(world_size=1, backend="gloo") as one:
        one.run("None")
    got["soon"] = time.perf_counter() - t0
    # right after the first start the second fork server imports torch._dynamo beside the ranks (2 cores: they share
    # them); then the warm round trip as a learner's next cells see it, after a few seconds idle
    got["warm4_soon"] = warm_round_trips(c, n=200)
    time.sleep(4)
    got["warm4"] = warm_round_trips(c)
    got["recover"] = time_error_recovery(c)
    got["crash1"] = time_crash_restart(c)
    got["crash2"] = time_crash_restart(c)
    c.run("held = [{'i': i} for i in range(300_000)]\nNone")
    got["warm4_held"] = warm_round_trips(c)
    t0 = time.perf_counter()
    c.restart()
    c.run("None")
    got["restart"] = time.perf_counter() - t0
    c.shutdown()
    with Cluster(world_size=2, backend="gloo") as two:
        got["warm2"] = warm_round_trips(two)
    got["other"] = time_other_world_size(3)
    got["pipe2"], got["pipe4"] = pipe_round_trips(2), pipe_round_trips(4)
    got["spawn"] = time_mp_spawn(4)
    got["_started"] = "fork server" if _forkstart._state["ctx"] is not None else "fresh interpreters"
    return got


def _cell(got, key, unit):
    value = got[key] * (1e3 if unit == "ms" else 1)
    ratio = f" ({got[key] / got['spawn']:.2f}x)" if unit == "s" and key != "spawn" and "spawn" in got else ""
    return f"{value:7.2f} {unit}{ratio}"


def verdicts(got):
    lines = []
    for what, key, target in [("first start", "first", 0.4), ("Cluster(1) 0.5 s after it", "soon", 0.15),
                              ("first crash recovery", "crash1", 0.15), ("second crash recovery", "crash2", 0.15),
                              ("start at another world size", "other", 0.15), ("full restart", "restart", 0.15)]:
        value = got[key] / got["spawn"]
        lines.append(f"{what}: {value:.2f}x spawn (target <= {target}x): {'met' if value <= target else 'MISSED'}")
    held = got["warm4_held"] / got["warm4"]
    lines.append(f"warm round trip with 300k objects per rank: {held:.2f}x the empty one (target <= 1.2x): "
                 f"{'met' if held <= 1.2 else 'MISSED'}")
    for n in (2, 4):
        extra = (got[f"warm{n}"] - got[f"pipe{n}"]) * 1e3
        lines.append(f"warm round trip at {n} ranks: {got[f'warm{n}'] * 1e3:.2f} ms, {extra:.2f} ms above a bare Pipe "
                     f"round trip to {n} processes (the engine's framing, pickling, and the output it groups)")
    return lines


def _failure_verdicts(got):
    return [f"{name}: {got[key]:.2f} s (target <= 0.5 s): {'met' if got[key] <= 0.5 else 'MISSED'}"
            for key, name, _, _ in FAILURE_CASES]


def _measure_in(root, failures=False):
    """The rows measured in a fresh process with ``root``'s course_utils (``--against``)."""
    import json
    import subprocess

    # run from ``root``, with it first on the path: the ranks and the fork server import the engine from there too
    env = dict(os.environ, COURSE_UTILS_ROOT=root, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, os.path.abspath(__file__), "--json"] + (["--failures"] if failures else []),
                         env=env, cwd=root,
                         capture_output=True, text=True, timeout=900)
    if run.returncode != 0:
        sys.exit(f"the run with {root}'s engine failed:\n{run.stderr[-3000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def main(argv):
    import json

    from course_utils.engine import _forkstart

    failures = "--failures" in argv
    argv = [a for a in argv if a != "--failures"]
    rows = [(key, name, "s") for key, name, _, _ in FAILURE_CASES] if failures else ROWS
    if argv == ["--json"]:
        print(json.dumps(time_failure_reports() if failures else measure()))
        return
    start = "fork server (torch preloaded)" if _forkstart.wanted() else "fresh interpreters (COURSE_UTILS_START=spawn)"
    if os.environ.get("COURSE_UTILS_BENCH_NO_PROC"):
        start += ", as without /proc"
    if argv[:1] == ["--against"] and len(argv) == 2:
        here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        runs = [("this checkout", _measure_in(here, failures)), (argv[1], _measure_in(argv[1], failures)),
                ("this checkout, again", _measure_in(here, failures))]
        print(header(start, runs[0][1].get("_started", start)))
        print(f"{'':<70} " + " ".join(f"{name[-22:]:>22}" for name, _ in runs))
        for key, name, unit in rows:
            print(f"{name:<70} " + " ".join(f"{_cell(got, key, unit):>22}" for _, got in runs))
        print()
        for line in _failure_verdicts(runs[0][1]) if failures else verdicts(runs[0][1]):
            print(line)
        return
    if argv:
        sys.exit(f"usage: {sys.argv[0]} [--failures] [--against CHECKOUT]")
    got = time_failure_reports() if failures else measure()
    print(header(start, got.get("_started", start)))
    for key, name, unit in rows:
        print(f"{name:<70} {_cell(got, key, unit)}")
    print()
    for line in _failure_verdicts(got) if failures else verdicts(got):
        print(line)


if __name__ == "__main__":
    main(sys.argv[1:])
