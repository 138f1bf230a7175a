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
what it sent. ``bandwidth_optimal=False`` accepts any correct all-reduce built from point-to-point operations.

Whatever the flag, the ranks together must hand send/isend at least 2(n-1) x S bytes, the least any
all-reduce computed by the ranks can send: a correct result with less traffic came through a collective
(``dist.*``, ``torch.distributed._functional_collectives``, a process group's own methods), and each of
those is also recorded by name where Python can see it.
"""
import re

import torch

__all__ = ["check_all_reduce", "all_reduce_verdict", "check_sent_bytes_prediction", "send_bound", "cluster",
           "close_clusters", "CASES", "ROUNDING"]

# A floating-point result is the sum when every element is within ROUNDING x n x eps(dtype) x sum|inputs| of the
# exact sum: n additions in any order round it by at most n x eps/2 x sum|inputs| in all, and ROUNDING leaves 4x room.
# tests/test_checker_all_reduce.py pins it from both sides: a right ring nudged by 3 x n x eps fails (a tolerance
# 2x wider passes it), one nudged by n x eps / 2 passes.
ROUNDING = 2

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
_SAVED = {}      # (owner, name) -> the original function, while the guard is installed
_SENT = {"bytes": 0, "messages": 0}   # what this rank handed to send/isend in the current case
_DEPTH = [0]     # > 0 inside a recorded call: what it calls underneath is not recorded again
_INPUTS = []     # (collective, numel of its second argument, positional or keyword, when a tensor), in call order
# torch.distributed._functional_collectives: the traced collectives, which do not go through dist.*
FUNCTIONAL = ("all_reduce", "all_reduce_inplace", "all_reduce_coalesced", "all_gather_tensor",
              "all_gather_tensor_inplace", "all_gather_inplace", "all_gather_single",
              "all_gather_into_tensor_coalesced",
              "reduce_scatter_tensor", "reduce_scatter_tensor_coalesced", "reduce_scatter_inplace",
              "all_to_all_single", "all_to_all_inplace", "broadcast", "permute_tensor")
# the process group's own methods, for code that calls dist.group.WORLD.allreduce(...) directly
GROUP_METHODS = ("allreduce", "allreduce_coalesced", "allgather", "allgather_coalesced",
                 "allgather_into_tensor_coalesced",
                 "_allgather_base", "reduce", "reduce_scatter", "reduce_scatter_tensor_coalesced",
                 "_reduce_scatter_base", "broadcast", "gather", "scatter", "alltoall", "alltoall_base", "barrier")


def _reset():
    _CALLED.clear()
    _INPUTS.clear()
    _SENT.update(bytes=0, messages=0)
    _DEPTH[0] = 0


def _second_parameter(original):
    """The name of ``original``'s second parameter (the input tensor of all_gather and friends), or None."""
    import inspect

    try:
        names = list(inspect.signature(original).parameters)
    except (TypeError, ValueError):  # a C++ method without a Python signature: positional only
        return None
    return names[1] if len(names) > 1 else None


def _recorder(label, original, method=False):
    second_name = None if method else _second_parameter(original)

    def recorder(*args, **kwargs):
        if _DEPTH[0] == 0:
            _CALLED.append(label)
            # positional or by keyword: all_gather(pieces, tensor=x) passes its input as a keyword
            second = args[1] if len(args) > 1 else kwargs.get(second_name) if second_name else None
            _INPUTS.append((label, second.numel() if isinstance(second, torch.Tensor) else None))
        _DEPTH[0] += 1
        try:
            return original(*args, **kwargs)
        finally:
            _DEPTH[0] -= 1
    recorder.__name__ = getattr(original, "__name__", label)
    return recorder


def _install_guard():
    """Wrap torch.distributed's collectives, however they are reached (dist.*, the functional collectives, the
    process group's methods), so that calls are recorded (and still run, so no rank hangs); count the bytes
    handed to send/isend."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    from course_utils.allreduce import counting_send

    if _SAVED:  # left half-installed by a rank the engine stopped inside a check: put the originals back first
        _remove_guard()
    for name in COLLECTIVES:
        original = getattr(c10d, name, None)
        if original is None:
            continue
        recorder = _recorder(name, original)
        for module in (dist, c10d):
            if getattr(module, name, None) is original:
                _SAVED[(module, name)] = original
                setattr(module, name, recorder)
    try:
        import torch.distributed._functional_collectives as fc
    except ImportError:   # pragma: no cover (torch without the functional collectives)
        fc = None
    for name in FUNCTIONAL if fc is not None else ():
        original = getattr(fc, name, None)
        if callable(original):
            _SAVED[(fc, name)] = original
            setattr(fc, name, _recorder(f"_functional_collectives.{name}", original))
    group_class = c10d.ProcessGroup
    for name in GROUP_METHODS:
        original = group_class.__dict__.get(name)
        if original is not None:
            _SAVED[(group_class, name)] = original
            setattr(group_class, name, _recorder(f"ProcessGroup.{name}", original))
    for name in ("send", "isend"):   # count the bytes; the same wrapper in dist and c10d, as P2POp expects
        original = getattr(c10d, name)
        counter = counting_send(original, _SENT, _DEPTH)
        for module in (dist, c10d):
            if getattr(module, name, None) is original:
                _SAVED[(module, name)] = original
                setattr(module, name, counter)


def _remove_guard():
    for (owner, name), original in _SAVED.items():
        setattr(owner, name, original)
    _SAVED.clear()
    _reset()


def _run_case(impl, case_index, dtype, shape, stderr_dir=None):
    import torch.distributed as dist

    r = dist.get_rank()
    g = torch.Generator().manual_seed(1000 * case_index + r)
    if dtype.is_floating_point:
        tensor = (torch.randn(shape, generator=g, dtype=torch.float64) * 3).to(dtype)
    else:
        tensor = torch.randint(-1000, 1000, shape, generator=g, dtype=dtype)
    given = tensor.clone()
    _reset()
    rebound = _rebind_globals(impl, [(owner, name, original) for (owner, name), original in _SAVED.items()])
    try:
        with _stderr_to_file(stderr_dir and f"{stderr_dir}/rank{r}.err"):
            returned = impl(tensor)
    finally:
        for names, key, value in rebound:
            names[key] = value
    called = list(dict.fromkeys(_CALLED))
    _CALLED.clear()
    if not isinstance(returned, torch.Tensor) or returned.shape != tensor.shape:
        returned = None
    return {"given": given, "result": tensor, "returned": returned, "collectives": called,
            "sent_bytes": _SENT["bytes"], "messages": _SENT["messages"]}


class _stderr_to_file:
    """While a case runs, this rank's file descriptor 2 goes to ``path``: when gloo aborts the rank (a message
    larger than its receive buffer), its one useful line and faulthandler's thread dumps land there, where the
    checker reads the line for its verdict, instead of in the notebook. Anything else written there (a warning)
    is copied back to stderr afterwards. ``path`` None: nothing is redirected."""

    def __init__(self, path):
        self.path = path

    def __enter__(self):
        import os
        import sys

        if self.path is None:
            return self
        sys.stderr.flush()
        self.saved = os.dup(2)
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(fd, 2)
        os.close(fd)
        return self

    def __exit__(self, *exc):
        import os
        import sys

        if self.path is None:
            return False
        sys.stderr.flush()
        os.dup2(self.saved, 2)
        os.close(self.saved)
        with open(self.path, errors="backslashreplace") as f:
            written = f.read()
        os.unlink(self.path)
        if written:
            sys.stderr.write(written)
            sys.stderr.flush()
        return False


# -- in the notebook ----------------------------------------------------------------------------
# gloo's abort when a message is longer than the buffer that receives it (pair.cc, torch 2.13):
# "... op.preamble.length <= op.nbytes. 48 vs 24. Received data size doesn't match expected size ..."
_SIZE_MISMATCH = re.compile(r"(\d+) vs (\d+)\. Received data size doesn't match")


def _gloo_abort_words(impl, stderr_dir, case, world_size):
    """One plain sentence for a rank that gloo aborted because a message did not fit its receive buffer, read from
    the line gloo wrote before the abort (in ``stderr_dir``); None if no rank wrote one."""
    import os

    dtype, shape = case
    n = world_size
    numel = 1
    for d in shape:
        numel *= d
    item = torch.empty(0, dtype=dtype).element_size()
    size = numel * item
    for r in range(n):
        path = os.path.join(stderr_dir, f"rank{r}.err")
        try:
            with open(path, errors="backslashreplace") as f:
                found = _SIZE_MISMATCH.search(f.read())
        except OSError:
            continue
        if not found:
            continue
        got, room = int(found.group(1)), int(found.group(2))
        head = (f"{_name(impl)} {_case_words(case, n)}: rank {r} received a message of {got} bytes into a "
                f"{room}-byte buffer, and gloo aborted the rank (\"{got} vs {room}. Received data size doesn't "
                "match\"): ")
        dtype_name = str(dtype).replace("torch.", "")
        if got == size and room < size:
            return head + ("that message is the whole tensor, sent where the neighbour receives one chunk; send one "
                           "chunk per step (chunks[(rank - s) % world_size] in reduce-scatter), never the tensor.")
        if item > 4 and got == room * item // 4:
            return head + (f"the buffer is float32 (4 bytes a value, as torch.empty(k) and torch.zeros(k) make) "
                           f"while the tensor is {dtype_name}; make every receive buffer with "
                           "torch.empty_like(chunk), which keeps the tensor's dtype.")
        return head + ("a send and the receive that matches it must have the same length and dtype; send one chunk "
                       "per step and receive it into torch.empty_like(the chunk it goes into).")
    return None


def _index_error_words(impl, exc, case, world_size):
    """One plain sentence for an IndexError that comes from tensor.chunk(n) giving fewer than n chunks; None
    when chunk() gives n chunks for this case (the IndexError has another cause, and its own message stays)."""
    dtype, shape = case
    n = world_size
    numel = 1
    for d in shape:
        numel *= d
    pieces = len(torch.empty(numel).chunk(n))
    if pieces >= n:
        return None
    return (f"{_name(impl)} raised IndexError ({exc.exc_message}) {_case_words(case, n)}: tensor.chunk({n}) of "
            f"{numel} value{'s' if numel != 1 else ''} returns only {pieces} chunk{'s' if pieces != 1 else ''}, "
            "so chunks[i] runs past the end; use tensor.tensor_split(world_size), which always returns world_size "
            "chunks (some may be empty).")


def _name(impl):
    return getattr(impl, "__name__", type(impl).__name__)


def _rounding_bound(given, dtype, n):
    """Per element, how far n additions in ``dtype`` may round the sum of ``given`` (float64 tensors)."""
    return ROUNDING * n * torch.finfo(dtype).eps * sum(g.abs() for g in given) + 1e-30


def _close(result, expected, bound):
    return bool(((result.double() - expected).abs() <= bound).all())


def _case_words(case, world_size):
    dtype, shape = case
    return f"on {world_size} ranks with a {str(dtype).replace('torch.', '')} tensor of shape {tuple(shape)}"


def _who(ranks, world_size):
    """'every rank', 'rank 1', 'ranks 0 and 2', 'ranks 0, 1 and 3'."""
    ranks = sorted(ranks)
    if len(ranks) == world_size and world_size > 1:
        return "every rank"
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(map(str, ranks[:-1])) + f" and {ranks[-1]}"


def _whose(coefficients, owner):
    """Plain words for a chunk that holds sum(c_q x rank q's input): 'only rank 0's own input', ..."""
    ones = [q for q, c in enumerate(coefficients) if c == 1]
    twice = [q for q, c in enumerate(coefficients) if c == 2]
    missing = [q for q, c in enumerate(coefficients) if c == 0]
    if not twice and ones == [owner]:
        return f"only rank {owner}'s own input: it was never reduced"
    parts = []
    if ones:
        plural = len(ones) > 1
        parts.append(("ranks " if plural else "rank ") + _and(ones) + "'s input" + ("s" if plural else ""))
    if twice:
        parts.append(("rank " if len(twice) == 1 else "ranks ") + _and(twice) + "'s input twice")
    held = " and ".join(parts) if parts else "nothing"
    lacks = (", without " + ("rank " if len(missing) == 1 else "ranks ") + _and(missing) + "'s") if missing else ""
    return f"{held}{lacks}"


def _members(coefficients):
    """'the full sum', 'only rank 1's input', 'ranks 0 and 2's inputs', with any input counted twice named."""
    ones = [q for q, c in enumerate(coefficients) if c == 1]
    twice = [q for q, c in enumerate(coefficients) if c == 2]
    if not twice and len(ones) == len(coefficients):
        return "the full sum"
    text = (f"only rank {ones[0]}'s input" if len(ones) == 1 else f"ranks {_and(ones)}'s inputs") if ones else ""
    if twice:
        text += (" and " if text else "") + ("rank " if len(twice) == 1 else "ranks ") + _and(twice) + "'s twice"
    return text or "nothing"


def _and(items):
    items = [str(i) for i in items]
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def _chunk_report(outs, wrong, bound, n):
    """Which chunk is wrong on which rank, and whose inputs it holds: up to two findings, in plain words."""
    import itertools

    numel = outs[0]["given"].numel()
    pieces = [torch.arange(numel).tensor_split(n)[c] for c in range(n)]
    flat_bound = bound.reshape(-1)
    findings = []
    for r in wrong:
        res = outs[r]["result"].reshape(-1).double()
        for c, idx in enumerate(pieces):
            if not idx.numel():
                continue
            inputs = [o["given"].reshape(-1).double()[idx] for o in outs]
            expected = sum(inputs)
            if bool(((res[idx] - expected).abs() <= flat_bound[idx]).all()):
                continue
            where = f"chunk {c} (elements {idx[0].item()}-{idx[-1].item()}) on rank {r}"
            what = None
            same_length = [c] + [c2 for c2, idx2 in enumerate(pieces) if c2 != c and idx2.numel() == idx.numel()]
            for c2 in same_length:   # this chunk's inputs first, then another chunk's (a chunk put in the wrong place)
                inputs2 = [o["given"].reshape(-1).double()[pieces[c2]] for o in outs]
                for coefficients in itertools.product((0, 1, 2), repeat=n):   # at most 81 combinations (n <= 4)
                    combo = sum(k * x for k, x in zip(coefficients, inputs2))
                    if bool(((res[idx] - combo).abs() <= flat_bound[idx] * 2 + flat_bound[pieces[c2]] * 2).all()):
                        if c2 == c:
                            what = f"{where} holds {_whose(coefficients, r)}"
                        else:
                            what = (f"{where} holds chunk {c2}'s elements ({_members(coefficients)}): it was written "
                                    "into the wrong chunk")
                        break
                if what is not None:
                    break
            findings.append(what or f"{where} holds no sum of the ranks' inputs")
            if len(findings) == 2:
                return findings
    return findings


def _diagnose(impl, outs, case, world_size):
    """The plain-words reason why the ranks' results are wrong, or None if they are right."""
    dtype, shape = case
    n = world_size
    what = _case_words(case, n)
    name = _name(impl)
    used = {r: o["collectives"] for r, o in enumerate(outs) if o["collectives"]}
    if used:
        calls = sorted({c for cs in used.values() for c in cs})
        shown = [c if c.startswith(("ProcessGroup.", "_functional")) else "dist." + c for c in calls]
        shown = ["torch.distributed." + c if c.startswith("_functional") else c for c in shown]
        return (f"{name} called the collective(s) {', '.join(shown)} "
                f"(on {_who(used, n)}) {what}. The exercise is to build all-reduce from point-to-point "
                "operations only: dist.send/dist.recv or dist.isend/dist.irecv between neighbours.")

    given = [o["given"].double() for o in outs]
    expected = sum(given)
    if dtype.is_floating_point:  # rounding of n additions in this dtype, element by element
        bound = _rounding_bound(given, dtype, n)
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
        return (f"the last {rem} of {numel} elements are wrong {what}, on {_who(wrong, n)} ({how}). "
                f"{numel} is not divisible by {n}, and the left-over elements were never reduced: "
                f"chunks of numel // world_size = {numel // n} elements drop the remainder. Let some "
                "chunks be one element longer (tensor.tensor_split(world_size) does that).")
    if dtype in (torch.float32, torch.float64):   # right only to the precision of a smaller float type?
        for low in (torch.bfloat16, torch.float16):
            low_bound = _rounding_bound(given, low, n)
            # a low type is named only for an error of its own size: over eps/8 of some element, not a tiny nudge
            rounded_as_low = any(bool(((o["result"].double() - expected).abs()
                                       > torch.finfo(low).eps / 8 * expected.abs()).any()) for o in outs)
            if rounded_as_low and all(_close(o["result"], expected, low_bound) for o in outs):
                low_name = str(low).replace("torch.", "")
                err = max(float((o["result"].double() - expected).abs().max()) for o in outs)
                return (f"the results are close to the sum but not exact {what}: they are off by up to "
                        f"{err:.3g}, the rounding error of {low_name}, far more than {n} additions in "
                        f"{str(dtype).replace('torch.', '')} make. Somewhere the data passes through a "
                        f"{low_name} tensor (a buffer made with the wrong dtype, or a .to()/.half()/.bfloat16()): "
                        "add and send in the tensor's own dtype (torch.empty_like(chunk) keeps it).")
    if dtype.is_floating_point and all(_close(o["result"], expected, 16 * bound) for o in outs):
        err = max(float((o["result"].double() - expected).abs().max()) for o in outs)
        return (f"the results are close to the sum but not exact {what}: they are off by up to {err:.3g}, more than "
                f"{n} additions in {str(dtype).replace('torch.', '')} round (at most {float(bound.max()):.3g} "
                "here). Each element must be the plain sum of the ranks' inputs, not the sum scaled or shifted "
                "a little.")
    findings = _chunk_report(outs, wrong, bound, n)
    r = wrong[0]
    count = int(((outs[r]["result"].double() - expected).abs() > bound).sum())
    detail = "; ".join(findings)
    return (f"wrong result {what}: the result differs from the sum over ranks on {_who(wrong, n)} "
            f"({count} of {numel} elements on rank {r}). Cut into {n} chunks as tensor_split cuts it, {detail}. "
            "Every chunk must end as the sum of all ranks' inputs, each counted once: follow that chunk "
            "through the schedule of section 4, step by step.")


def _too_few_bytes(impl, outs, case, world_size):
    """Why a correct result cannot have come from point-to-point operations alone, or None.

    Any all-reduce computed by the ranks needs, for every element, n-1 sends before its sum exists and n-1
    sends to deliver it (the argument of section 5): 2(n-1) x S bytes over all ranks together. Less than that
    through send/isend means the data travelled another way (a collective the guard did not see)."""
    n = world_size
    size = outs[0]["given"].numel() * outs[0]["given"].element_size()
    total = sum(o["sent_bytes"] for o in outs)
    need = 2 * (n - 1) * size
    if n < 2 or total >= need:
        return None
    return (f"{_name(impl)} gives every rank the right sum {_case_words(case, n)}, but the ranks handed only "
            f"{total} bytes to dist.send/dist.isend in total, and any all-reduce built from point-to-point "
            f"operations needs at least 2(n-1) x S = {need} bytes over all ranks (section 5: every element is sent "
            "n-1 times before its sum exists and n-1 times after). The rest travelled another way: a collective "
            "(torch.distributed._functional_collectives, a process group's own methods, another library). "
            "Send every chunk with dist.send/dist.isend (or batch_isend_irecv).")


def stuck_calls(exc):
    """Where each rank of a DistributedTimeout was stuck, for a checker's verdict: the learner's own line and the
    torch.distributed call it waits in ("rank 0: in recv() at Cell In[7], line 5: dist.recv(buf, left)"), read
    from the report's Python stacks; empty if the report has none."""
    out = []
    for rank, stack in sorted(getattr(exc, "stacks", {}).items()):
        lines = [line.strip() for line in stack.splitlines()]
        frames = [(line[5:], lines[i + 1] if i + 1 < len(lines) else "")
                  for i, line in enumerate(lines) if line.startswith("File ")]
        own = [f for f in frames if not f[0].startswith('"torch/') and "course_utils" not in f[0]]
        calls = [f[0].rsplit(" in ", 1)[-1] for f in frames if "distributed_c10d.py" in f[0]]
        if own:
            where, code = own[-1]
            where = where.rsplit(", in ", 1)[0]
            out.append(f"rank {rank}: " + (f"in {calls[0]}() " if calls else "") + f"at {where}: {code}")
    return ("\nWhere each rank was stuck:\n  " + "\n  ".join(out)) if out else ""


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
    return (f"{_name(impl)} gives every rank the right sum, but it is not bandwidth-optimal: {_case_words(case, n)} "
            f"(S = {size} bytes), rank {r} sent "
            f"{sent} bytes ({sent / size:.2f} x S) in {messages} messages"
            + (f" ({_who(over, n)} sent too much)" if len(over) > 1 else "") +
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
    import shutil
    import tempfile

    if not callable(impl):
        raise TypeError(f"check_all_reduce takes the all-reduce function itself, got {type(impl).__name__}")
    name = _name(impl)
    stderr_dir = tempfile.mkdtemp(prefix="check-all-reduce-")   # where an aborted rank's last words land
    try:
        _check_all_reduce(impl, name, bandwidth_optimal, clusters, world_sizes, timeout, stderr_dir)
    finally:
        shutil.rmtree(stderr_dir, ignore_errors=True)


def _check_all_reduce(impl, name, bandwidth_optimal, clusters, world_sizes, timeout, stderr_dir):
    __tracebackhide__ = True
    from course_utils import DistributedError, DistributedTimeout

    for n in world_sizes:
        cluster_n = cluster(n, clusters)
        cluster_n.run(_install_guard)
        try:
            for i, (dtype, shape) in enumerate(CASES):
                if shape == "fewer than ranks":
                    shape = (n - 1,)
                try:
                    outs = cluster_n.run(_run_case, impl, i, dtype, shape, stderr_dir, timeout=timeout)
                except DistributedTimeout as exc:
                    raise AssertionError(
                        f"{name} did not finish within {timeout} s on {n} ranks (shape {shape}): "
                        f"{exc.summary.split(' (')[0]}. Ranks are probably waiting for each other, "
                        "e.g. all sending with blocking dist.send before anyone receives, or a rank "
                        "receiving a message nobody sends. Use dist.isend + dist.recv, then wait()."
                        + stuck_calls(exc)) from None
                except DistributedError as exc:
                    # the aborted rank's line first: its neighbours may report "Connection closed by peer" sooner
                    words = (_gloo_abort_words(impl, stderr_dir, (dtype, shape), n)
                             or (_index_error_words(impl, exc, (dtype, shape), n) if exc.exc_type == "IndexError"
                                 else None))
                    if words:
                        raise AssertionError(words) from None
                    raised = [exc.rank] + [r for r, s in exc.ranks.items() if "raised" in str(s)]
                    raise AssertionError(
                        f"{name} raised {exc.exc_type} on {_ranks(raised)} of {n} (shape {shape}): "
                        f"{exc.exc_message}") from None
                reason = _diagnose(impl, outs, (dtype, shape), n)
                if reason is None:
                    reason = _too_few_bytes(impl, outs, (dtype, shape), n)
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
    from course_utils.allreduce import chunked_ring_sent_chunks

    n, size, r = world_size, numel * 4, rank
    lengths = [len(c) for c in torch.empty(numel).tensor_split(n)]
    scatter, gather = (sum(phase) * 4 for phase in chunked_ring_sent_chunks(numel, n, r))
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


def all_reduce_verdict(impl, **kwargs):
    """What :func:`check_all_reduce` says about ``impl``: its verdict as text, or None when it passes.

    Introduced in 03_all_reduce_by_hand, which asks the learner to predict a verdict and then prints it.
    ``kwargs`` go to check_all_reduce (``bandwidth_optimal``, ``clusters``, ...)."""
    try:
        check_all_reduce(impl, **kwargs)
    except AssertionError as exc:
        return str(exc)
    return None


def _rebind_globals(fn, saved):
    """Point the names that ``fn``'s module imported from torch.distributed before the guard was installed
    (``from torch.distributed import all_gather`` at the top of a cell) at the wrappers now in place, so the
    checker sees those calls too; ``saved`` lists (owner, name, original). Returns what to put back.
    tests/test_checker_collectives_02.py holds it."""
    names = getattr(fn, "__globals__", None)
    if names is None:
        return []
    current = {id(original): getattr(owner, name) for owner, name, original in saved}
    back = []
    for key, value in list(names.items()):
        wrapper = current.get(id(value))
        if wrapper is not None and wrapper is not value:
            back.append((names, key, value))
            names[key] = wrapper
    return back
