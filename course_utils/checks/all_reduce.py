"""``check_all_reduce(impl)``: does a hand-written all-reduce give every rank the SUM?

Introduced in 03_all_reduce_by_hand. Call it from the notebook process (not inside ``%%ddp``)::

    from course_utils.checks import check_all_reduce
    check_all_reduce(my_ring_all_reduce)     # quiet when right, AssertionError saying what is wrong

``impl(tensor)`` runs on every rank and must all-reduce ``tensor`` with SUM, in place, with
point-to-point operations only (``dist.send``/``recv``/``isend``/``irecv``/``batch_isend_irecv``).
The checker runs it on 2, 3 and 4 ranks (one ``Cluster`` per world size, kept and reused by later
calls), on float32, float64, int64 and bfloat16 tensors whose lengths are mostly not divisible by
the world size, and compares every rank's result with the exact sum, allowing the rounding error
of n additions in the tensor's dtype (none for integers).

By default (``bandwidth_optimal=True``) it also counts the bytes each rank hands to ``dist.send`` and
``dist.isend`` (``batch_isend_irecv`` goes through ``isend``). The chunked ring sends 2(n-1) chunks of
at most ceil(numel / n) elements; a correct all-reduce that sends more than that (the naive
reduce-and-broadcast, the whole-tensor ring) is rejected as correct but not bandwidth-optimal, with
what it sent. ``bandwidth_optimal=False`` accepts any correct all-reduce.
"""
import torch

__all__ = ["check_all_reduce", "check_sent_bytes_prediction", "send_bound", "cluster", "close_clusters", "CASES"]

# (dtype, shape): the first case is the easy one, so basic mistakes show on it
CASES = (
    (torch.float32, (12,)),
    (torch.float64, (7,)),
    (torch.int64, (13,)),
    (torch.bfloat16, (10,)),
    (torch.float32, (1001,)),
    (torch.float32, (5, 3)),
    (torch.float32, "fewer than ranks"),   # length world_size - 1: one rank's chunk is empty
)
WORLD_SIZES = (2, 3, 4)
COLLECTIVES = (
    "all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_into_tensor", "all_gather_object",
    "all_gather_coalesced", "_all_gather_base", "reduce", "reduce_scatter", "reduce_scatter_tensor",
    "_reduce_scatter_base", "broadcast", "broadcast_object_list", "gather", "gather_object", "scatter",
    "scatter_object_list", "all_to_all", "all_to_all_single", "barrier", "monitored_barrier",
    "all_gather_single", "reduce_scatter_single",
)

_CLUSTERS = {}  # world size -> Cluster, reused by every call in this process


def cluster(world_size, clusters=None):
    """The Cluster the checker runs ``world_size`` ranks on: ``clusters[world_size]`` if given, else
    the ``%%ddp`` cluster when it has that size, else one the checker starts and keeps for later calls.
    Introduced in 03_all_reduce_by_hand (the lesson measures bytes on the same clusters)."""
    import sys

    from course_utils import Cluster

    if clusters and world_size in clusters:
        return clusters[world_size]
    magic = sys.modules.get("course_utils.engine.magic")
    ddp = getattr(magic, "_CLUSTER", None)
    if ddp is not None and ddp.alive and ddp.world_size == world_size and ddp.backend == "gloo":
        return ddp
    c = _CLUSTERS.get(world_size)
    if c is None or not c.alive:
        c = _CLUSTERS[world_size] = Cluster(world_size=world_size, backend="gloo", timeout=30)
    return c


def close_clusters():
    """Stop the clusters the checker started (they also stop when the notebook's kernel exits)."""
    while _CLUSTERS:
        _CLUSTERS.popitem()[1].shutdown()


# -- on the ranks -------------------------------------------------------------------------------
_CALLED = []     # collectives the implementation called during the current case
_SAVED = {}      # (module, name) -> the original function, while the guard is installed
_SENT = {"bytes": 0, "messages": 0, "depth": 0}   # what this rank handed to send/isend in the current case


def _install_guard():
    """Wrap torch.distributed's collectives so that calls are recorded (and still run, so no rank hangs)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if _SAVED:
        return
    for name in COLLECTIVES:
        original = getattr(c10d, name, None)
        if original is None:
            continue

        def recorder(*args, _name=name, _original=original, **kwargs):
            _CALLED.append(_name)
            return _original(*args, **kwargs)

        for module in (dist, c10d):
            if getattr(module, name, None) is original:
                _SAVED[(module, name)] = original
                setattr(module, name, recorder)
    for name in ("send", "isend"):   # count the bytes; the same wrapper in dist and c10d, as P2POp expects
        original = getattr(c10d, name)

        def counter(tensor, *args, _original=original, **kwargs):
            if _SENT["depth"] == 0:       # dist.send may call isend inside: count the outer call only
                _SENT["bytes"] += tensor.numel() * tensor.element_size()
                _SENT["messages"] += 1
            _SENT["depth"] += 1
            try:
                return _original(tensor, *args, **kwargs)
            finally:
                _SENT["depth"] -= 1

        counter.__name__ = name
        for module in (dist, c10d):
            if getattr(module, name, None) is original:
                _SAVED[(module, name)] = original
                setattr(module, name, counter)


def _remove_guard():
    for (module, name), original in _SAVED.items():
        setattr(module, name, original)
    _SAVED.clear()
    _CALLED.clear()


def _run_case(impl, case_index, dtype, shape):
    import torch.distributed as dist

    r = dist.get_rank()
    g = torch.Generator().manual_seed(1000 * case_index + r)
    if dtype.is_floating_point:
        tensor = (torch.randn(shape, generator=g, dtype=torch.float64) * 3).to(dtype)
    else:
        tensor = torch.randint(-1000, 1000, shape, generator=g, dtype=dtype)
    given = tensor.clone()
    _CALLED.clear()
    _SENT.update(bytes=0, messages=0, depth=0)
    returned = impl(tensor)
    called = list(dict.fromkeys(_CALLED))
    _CALLED.clear()
    if not isinstance(returned, torch.Tensor) or returned.shape != tensor.shape:
        returned = None
    return {"given": given, "result": tensor, "returned": returned, "collectives": called,
            "sent_bytes": _SENT["bytes"], "messages": _SENT["messages"]}


# -- in the notebook ----------------------------------------------------------------------------
def _name(impl):
    return getattr(impl, "__name__", type(impl).__name__)


def _close(result, expected, bound):
    return bool(((result.double() - expected).abs() <= bound).all())


def _diagnose(impl, outs, case, world_size):
    """The plain-words reason why the ranks' results are wrong, or None if they are right."""
    dtype, shape = case
    n = world_size
    what = f"on {n} ranks with a {str(dtype).replace('torch.', '')} tensor of shape {tuple(shape)}"
    name = _name(impl)
    used = {r: o["collectives"] for r, o in enumerate(outs) if o["collectives"]}
    if used:
        calls = sorted({c for cs in used.values() for c in cs})
        return (f"{name} called the collective(s) {', '.join('dist.' + c for c in calls)} "
                f"(on {_ranks(used)}) {what}. The exercise is to build all-reduce from point-to-point "
                "operations only: dist.send/dist.recv or dist.isend/dist.irecv between neighbours.")

    given = [o["given"].double() for o in outs]
    expected = sum(given)
    if dtype.is_floating_point:  # rounding of n additions in this dtype, element by element
        bound = 2 * n * torch.finfo(dtype).eps * sum(g.abs() for g in given) + 1e-30
    else:
        bound = torch.zeros_like(expected)
    ok = [_close(o["result"], expected, bound) for o in outs]
    if all(ok):
        return None
    wrong = [r for r, good in enumerate(ok) if not good]

    if all(torch.equal(o["result"], o["given"]) for o in outs):
        if all(o["returned"] is not None and _close(o["returned"], expected, bound) for o in outs):
            return (f"{name} returned the sum but left the tensor it was given unchanged {what}. "
                    "All-reduce works in place, like dist.all_reduce: write the result into the "
                    "tensor (tensor.copy_(result) or tensor[:] = ...).")
        return (f"{name} left the tensor unchanged on every rank {what}: it must overwrite the "
                "tensor it is given with the sum over all ranks (in place).")
    if dtype.is_floating_point and all(_close(o["result"], expected / n, bound) for o in outs):
        return (f"every rank holds the sum divided by {n} (the average) {what}. "
                "all_reduce with SUM must not divide by the world size: averaging gradients is a "
                "separate step (done by DDP, or by you in lesson 05).")
    if ok[0] and wrong == list(range(1, n)):
        return (f"only rank 0 holds the right sum {what}; the other ranks do not. "
                "Every rank must end with the full sum: after reducing, send the result back to "
                "the others (the all-gather half of the ring).")
    numel = expected.numel()
    flat_bad = torch.zeros(numel, dtype=torch.bool)
    for o in outs:
        flat_bad |= ((o["result"].double() - expected).abs() > bound).reshape(-1)
    bad_idx = flat_bad.nonzero().view(-1).tolist()
    rem = numel % n
    tail_start = numel - rem
    if rem and all(i >= tail_start for i in bad_idx):
        stale = all(torch.equal(o["result"].reshape(-1)[tail_start:], o["given"].reshape(-1)[tail_start:])
                    for o in outs)
        how = "they still hold each rank's own input" if stale else "they do not hold the sum"
        return (f"the last {rem} of {numel} elements are wrong on {_ranks(wrong)} {what} ({how}). "
                f"{numel} is not divisible by {n}, and the left-over elements were never reduced: "
                f"chunks of numel // world_size = {numel // n} elements drop the remainder. Let some "
                "chunks be one element longer (tensor.tensor_split(world_size) does that).")
    if dtype in (torch.float32, torch.float64):   # right only to the precision of a smaller float type?
        for low in (torch.bfloat16, torch.float16):
            low_bound = 2 * n * torch.finfo(low).eps * sum(g.abs() for g in given) + 1e-30
            if all(_close(o["result"], expected, low_bound) for o in outs):
                low_name = str(low).replace("torch.", "")
                err = max(float((o["result"].double() - expected).abs().max()) for o in outs)
                return (f"the results are close to the sum but not exact {what}: they are off by up to "
                        f"{err:.3g}, the rounding error of {low_name}, far more than {n} additions in "
                        f"{str(dtype).replace('torch.', '')} make. Somewhere the data passes through a "
                        f"{low_name} tensor (a buffer made with the wrong dtype, or a .to()/.half()/.bfloat16()): "
                        "add and send in the tensor's own dtype (torch.empty_like(chunk) keeps it).")
    r = wrong[0]
    flat_res = outs[r]["result"].reshape(-1).double()
    flat_exp = expected.reshape(-1)
    first = next(i for i in range(numel) if abs(flat_res[i] - flat_exp[i]) > bound.reshape(-1)[i])
    count = sum(1 for i in range(numel) if abs(flat_res[i] - flat_exp[i]) > bound.reshape(-1)[i])
    return (f"wrong result on {_ranks(wrong)} {what}: on rank {r}, {count} of {numel} elements differ "
            f"from the sum over ranks; the first is element {first}: expected {flat_exp[first].item():.6g}, "
            f"got {flat_res[first].item():.6g}.")


def _ranks(ranks):
    ranks = sorted(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def send_bound(numel, world_size, element_size):
    """The most bytes one rank of a chunked ring may send: 2(n-1) chunks of at most ceil(numel / n) elements.

    Introduced in 03_all_reduce_by_hand. Equal to 2(n-1)/n x S when n divides numel; with uneven
    chunks (``tensor_split``: lengths differ by one) the longest chunk sets the bound.
    """
    n = world_size
    return 2 * (n - 1) * -(-numel // n) * element_size


def _too_many_bytes(impl, outs, case, world_size):
    """Why a correct all-reduce is not bandwidth-optimal, or None if no rank sent more than the bound."""
    dtype, shape = case
    n = world_size
    numel = outs[0]["given"].numel()
    size = numel * outs[0]["given"].element_size()
    bound = send_bound(numel, n, outs[0]["given"].element_size())
    over = [r for r, o in enumerate(outs) if o["sent_bytes"] > bound]
    if not over:
        return None
    r = max(over, key=lambda q: outs[q]["sent_bytes"])
    sent, messages = outs[r]["sent_bytes"], outs[r]["messages"]
    return (f"{_name(impl)} gives every rank the right sum, but it is not bandwidth-optimal: on {n} ranks with a "
            f"{str(dtype).replace('torch.', '')} tensor of shape {tuple(shape)} (S = {size} bytes), rank {r} sent "
            f"{sent} bytes ({sent / size:.2f} x S) in {messages} messages"
            + (f" ({_ranks(over)} all sent too much)" if len(over) > 1 else "") +
            f". A rank of the chunked ring sends at most {bound} bytes: 2(n-1) = {2 * (n - 1)} chunks of at most "
            f"{-(-numel // n)} elements (2(n-1)/n x S = {2 * (n - 1) / n:.2f} x S when n divides the length). "
            "Cut the tensor into n chunks "
            "(tensor.view(-1).tensor_split(world_size)) and send one chunk per step: n-1 reduce-scatter steps, "
            "then n-1 all-gather steps. (To check an all-reduce that is only meant to be correct, pass "
            "bandwidth_optimal=False.)")


def check_all_reduce(impl, *, bandwidth_optimal=True, clusters=None, world_sizes=WORLD_SIZES, timeout=20):
    """Run ``impl`` on 2, 3 and 4 ranks and raise AssertionError, in plain words, if any rank's result is wrong.

    Introduced in 03_all_reduce_by_hand. ``impl(tensor)`` must all-reduce with SUM, in place, with
    point-to-point operations only. With ``bandwidth_optimal=True`` (the default) no rank may send
    more than the chunked ring does (:func:`send_bound`): a correct but wasteful all-reduce fails,
    saying what it sent. ``bandwidth_optimal=False`` accepts any correct all-reduce.
    ``clusters`` ({world_size: Cluster}) lets you pass clusters you already have; otherwise the
    checker starts one per world size and keeps it for the next call.
    ``timeout`` (seconds) bounds each case: a deadlock becomes an AssertionError, not a hang.
    """
    __tracebackhide__ = True
    from course_utils import DistributedError, DistributedTimeout

    if not callable(impl):
        raise TypeError(f"check_all_reduce takes the all-reduce function itself, got {type(impl).__name__}")
    name = _name(impl)
    for n in world_sizes:
        cluster_n = cluster(n, clusters)
        cluster_n.run(_install_guard)
        try:
            for i, (dtype, shape) in enumerate(CASES):
                if shape == "fewer than ranks":
                    shape = (n - 1,)
                try:
                    outs = cluster_n.run(_run_case, impl, i, dtype, shape, timeout=timeout)
                except DistributedTimeout as exc:
                    raise AssertionError(
                        f"{name} did not finish within {timeout} s on {n} ranks (shape {shape}): "
                        f"{exc.summary.split(' (')[0]}. Ranks are probably waiting for each other, "
                        "e.g. all sending with blocking dist.send before anyone receives, or a rank "
                        "receiving a message nobody sends. Use dist.isend + dist.recv, then wait().") from None
                except DistributedError as exc:
                    raised = [exc.rank] + [r for r, s in exc.ranks.items() if "raised" in str(s)]
                    raise AssertionError(
                        f"{name} raised {exc.exc_type} on {_ranks(raised)} of {n} (shape {shape}): "
                        f"{exc.exc_message}") from None
                reason = _diagnose(impl, outs, (dtype, shape), n)
                if reason is None and bandwidth_optimal:
                    reason = _too_many_bytes(impl, outs, (dtype, shape), n)
                if reason:
                    raise AssertionError(reason)
        finally:
            try:
                cluster_n.run(_remove_guard)
            except Exception:
                pass


def _sent_bytes(numel):
    from course_utils.allreduce import chunked_ring_all_reduce, count_sent_bytes

    t = torch.ones(numel)
    with count_sent_bytes() as sent:
        chunked_ring_all_reduce(t)
    return sent["bytes"]


def check_sent_bytes_prediction(prediction, rank=1, numel=10, world_size=4, *, clusters=None):
    """Exercise 2 of 03_all_reduce_by_hand: the bytes ``rank`` sends in the chunked ring for a float32 tensor of
    ``numel`` values on ``world_size`` ranks, compared with a count on real ranks (``count_sent_bytes``).

    The message of a wrong prediction says which reasoning it matches, never the count itself.
    """
    __tracebackhide__ = True
    if prediction is None:
        raise AssertionError("prediction is still None: set it to your answer, in bytes, then run the cell again.")
    if not isinstance(prediction, (int, float)) or isinstance(prediction, bool):
        raise AssertionError(f"prediction should be a number of bytes, got {type(prediction).__name__}.")
    counted = cluster(world_size, clusters).run(_sent_bytes, numel)[rank]
    if prediction == counted:
        return
    n, size, r = world_size, numel * 4, rank
    lengths = [len(c) for c in torch.empty(numel).tensor_split(n)]
    scatter = sum(lengths[(r - s) % n] for s in range(n - 1)) * 4
    gather = sum(lengths[(r + 1 - s) % n] for s in range(n - 1)) * 4
    if prediction == 2 * (n - 1) * size / n:
        why = ("that is 2(n-1)/n x S, exact only when n divides the length. Here tensor_split makes chunks of "
               f"{', '.join(map(str, lengths))} values: which chunk does rank {r} send in each step?")
    elif prediction == (n - 1) * size:
        why = "that is what the whole-tensor ring sends, (n-1) x S: the chunked ring sends one chunk per step."
    elif prediction == 2 * (n - 1) * max(lengths) * 4:
        why = f"that assumes every chunk rank {r} sends is a long one: list the chunk of each of its 2(n-1) steps."
    elif prediction == 2 * (n - 1) * min(lengths) * 4:
        why = f"that assumes every chunk rank {r} sends is a short one: list the chunk of each of its 2(n-1) steps."
    elif prediction in (scatter, gather):
        why = f"that counts one phase only: rank {r} sends n-1 chunks in reduce-scatter AND n-1 in all-gather."
    elif prediction * 4 == counted:
        why = "that looks like a count of values: float32 values are 4 bytes each."
    else:
        why = (f"use the schedule of section 4: in reduce-scatter step s rank {r} sends chunk ({r} - s) % n, in "
               f"all-gather step s chunk ({r} + 1 - s) % n; add up those chunks' lengths, 4 bytes per value.")
    raise AssertionError(f"prediction = {prediction} bytes is not what rank {r} sends: {why}")
