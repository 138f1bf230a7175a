"""Short-lived pools: ``launch`` (a function on a fresh Cluster) and ``spawn`` (``torch.multiprocessing.spawn``
for notebooks). Introduced in 00_launcher_tour."""
import math

from course_utils.engine.launcher import Cluster


def launch(fn, *args, world_size=2, backend="auto", timeout=60, **kwargs):
    """Run ``fn(*args, **kwargs)`` once on a short-lived pool; return the rank-ordered results.

    Introduced in 00_launcher_tour."""
    __tracebackhide__ = True
    with Cluster(world_size=world_size, backend=backend, timeout=timeout) as cluster:
        return cluster.run(fn, *args, **kwargs)



def spawn(fn, args=(), nprocs=1, join=True, daemon=False, start_method="spawn", *, timeout=None, backend="auto"):
    """``torch.multiprocessing.spawn`` for notebooks: run ``fn(rank, *args)`` on ``nprocs`` fresh ranks.

    Introduced in 00_launcher_tour. No process group is set up: ``fn`` calls ``init_process_group``
    itself, as the tutorials' code does, with ``MASTER_ADDR``/``MASTER_PORT`` preset to a free loopback
    port (``fn`` may set its own). Functions from notebook cells are sent by value; output is relayed
    per rank; a failure raises ``DistributedError`` and stops the other ranks. Returns the ranks'
    return values in rank order. ``timeout`` (seconds, default none, like ``mp.spawn``) turns a hang
    into ``DistributedTimeout``. ``daemon`` and ``start_method`` are accepted for compatibility: the
    ranks are always new processes (see Cluster) that end with the call.
    """
    __tracebackhide__ = True
    if not join:
        raise ValueError("spawn(join=False) is not supported: the notebook waits for the ranks. Use join=True.")
    if start_method not in ("spawn", "forkserver", "fork"):
        raise ValueError(f"unknown start_method {start_method!r}")
    if not callable(fn):
        raise ValueError(f"spawn() takes a function, got {type(fn).__name__}")
    if not isinstance(args, tuple):
        raise ValueError(f"args must be a tuple (as for torch.multiprocessing.spawn), got {type(args).__name__}")
    cluster = Cluster(world_size=nprocs, backend=backend, timeout=math.inf if timeout is None else timeout,
                      _group=False)
    try:
        return cluster._request(cluster._call_message(fn, args, {}, with_rank=True), None)
    finally:
        cluster.shutdown()
