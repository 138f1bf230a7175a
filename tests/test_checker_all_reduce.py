"""check_all_reduce (03_all_reduce_by_hand) on real gloo ranks: it passes correct all-reduces,
catches each classic mistake with a plain-words reason, and the byte counter counts exactly.

    .venv/bin/python -m pytest tests/test_checker_all_reduce.py -p no:randomly
"""
import sys

import pytest
import torch
import torch.distributed as dist

from course_utils.allreduce import chunked_ring_all_reduce, count_sent_bytes, naive_all_reduce, ring_all_reduce
from course_utils.checks import check_all_reduce
from conftest import register_by_value

register_by_value(sys.modules[__name__])  # the ranks cannot import this test file


@pytest.fixture(scope="module")
def clusters(make_cluster):
    """Gloo clusters of 2, 3 and 4 ranks, shared by this module (conftest's make_cluster)."""
    return {n: make_cluster(world_size=n, timeout=30) for n in (2, 3, 4)}


# -- wrong implementations, one classic mistake each -------------------------------------------
def ring_dropping_remainder(tensor):
    """A chunked ring whose chunks are numel // n long: the last numel % n elements are never reduced."""
    rank, n = dist.get_rank(), dist.get_world_size()
    flat = tensor.view(-1)
    size = flat.numel() // n
    chunks = [flat[i * size:(i + 1) * size] for i in range(n)]
    left, right = (rank - 1) % n, (rank + 1) % n
    buf = torch.empty_like(chunks[0])
    for s in range(n - 1):
        req = dist.isend(chunks[(rank - s) % n], right)
        dist.recv(buf, left)
        chunks[(rank - s - 1) % n] += buf
        req.wait()
    for s in range(n - 1):
        req = dist.isend(chunks[(rank + 1 - s) % n], right)
        dist.recv(buf, left)
        chunks[(rank - s) % n].copy_(buf)
        req.wait()


def averaging_ring(tensor):
    chunked_ring_all_reduce(tensor)
    tensor /= dist.get_world_size()


def reduce_without_broadcast(tensor):
    """Rank 0 sums everything, but never sends the sum back."""
    if dist.get_rank() == 0:
        buf = torch.empty_like(tensor)
        for src in range(1, dist.get_world_size()):
            dist.recv(buf, src=src)
            tensor += buf
    else:
        dist.send(tensor, dst=0)


def using_the_collective(tensor):
    dist.all_reduce(tensor)


def gather_then_broadcast(tensor):
    """Right answer from collectives (reduce + broadcast): still not point-to-point."""
    dist.reduce(tensor, dst=0)
    dist.broadcast(tensor, src=0)


def returning_a_copy(tensor):
    out = tensor.clone()
    chunked_ring_all_reduce(out)
    return out


def raising_stub(tensor):
    raise NotImplementedError("write the chunked ring here")


def functional_collective(tensor):
    import torch.distributed._functional_collectives as fc
    tensor.copy_(fc.all_reduce(tensor, "sum", dist.group.WORLD))


def process_group_method(tensor):
    dist.group.WORLD.allreduce([tensor]).wait()


def hidden_collective(tensor):
    """An all-reduce that no Python wrapper sees: torch's functional-collective operator, called directly."""
    import importlib

    ops = importlib.import_module("torch").ops._c10d_functional
    out = ops.all_reduce(tensor, "sum", dist.group.WORLD.group_name)
    tensor.copy_(ops.wait_tensor(out))


def ring_one_chunk_too_many(tensor):
    chunked_ring_all_reduce(tensor)
    rank, n = dist.get_rank(), dist.get_world_size()
    chunks = tensor.view(-1).tensor_split(n)
    buf = torch.empty_like(chunks[(rank - 1) % n])
    req = dist.isend(chunks[rank], (rank + 1) % n)
    dist.recv(buf, (rank - 1) % n)
    req.wait()


def _ring(tensor, scatter_into, gather_send):
    rank, n = dist.get_rank(), dist.get_world_size()
    left, right = (rank - 1) % n, (rank + 1) % n
    chunks = tensor.view(-1).tensor_split(n)
    for s in range(n - 1):
        out, into = chunks[(rank - s) % n], chunks[scatter_into(rank, s, n)]
        buf = torch.empty_like(into)
        req = dist.isend(out, right)
        dist.recv(buf, left)
        req.wait()
        into += buf
    for s in range(n - 1):
        out, into = chunks[gather_send(rank, s, n)], chunks[(rank - s) % n]
        buf = torch.empty_like(into)
        req = dist.isend(out, right)
        dist.recv(buf, left)
        req.wait()
        into.copy_(buf)


def gather_reuses_scatter_index(tensor):
    """The all-gather sends chunk (rank - s) % n, the reduce-scatter's index, instead of (rank + 1 - s) % n."""
    _ring(tensor, lambda r, s, n: (r - s - 1) % n, lambda r, s, n: (r - s) % n)


def scatter_adds_into_sent_chunk(tensor):
    """The reduce-scatter adds what arrives into the chunk it just sent, not the next one."""
    _ring(tensor, lambda r, s, n: (r - s) % n, lambda r, s, n: (r + 1 - s) % n)


def right_ring(tensor):
    _ring(tensor, lambda r, s, n: (r - s - 1) % n, lambda r, s, n: (r + 1 - s) % n)


def deadlocking(tensor):
    """Every rank waits to receive before anyone sends."""
    rank, n = dist.get_rank(), dist.get_world_size()
    buf = torch.empty_like(tensor)
    dist.recv(buf, (rank - 1) % n)
    dist.send(tensor, (rank + 1) % n)


def ring_in_bf16(tensor):
    """A near miss: the chunked ring, but every chunk travels and is added as bfloat16."""
    low = tensor.to(torch.bfloat16)
    chunked_ring_all_reduce(low)
    tensor.copy_(low.to(tensor.dtype))


def ring_plus_a_broadcast(tensor):
    """Correct, but after the chunked ring rank 0 also sends the whole tensor to everyone once more."""
    chunked_ring_all_reduce(tensor)
    rank, n = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        for dst in range(1, n):
            dist.send(tensor, dst=dst)
    else:
        dist.recv(tensor, src=0)


def reversed_order_sum(tensor):
    """Correct: gathers every rank's chunk and adds in a different order. Rounding differs, but stays
    within what n additions in the dtype allow, and it sends 2(n-1) chunks like the chunked ring."""
    rank, n = dist.get_rank(), dist.get_world_size()
    chunks = tensor.view(-1).tensor_split(n)
    mine = chunks[rank]
    pieces = {rank: mine.clone()}
    reqs = []
    for r in range(n):                                # everyone sends me its copy of my chunk
        if r != rank and chunks[r].numel():
            reqs.append(dist.isend(chunks[r], r))
    for r in range(n):
        if r != rank:
            buf = torch.empty_like(mine)
            if buf.numel():
                dist.recv(buf, r)
            pieces[r] = buf
    for q in reqs:
        q.wait()
    total = torch.zeros_like(mine)
    for r in reversed(range(n)):                      # a different order of additions
        total += pieces[r]
    mine.copy_(total)
    reqs = [dist.isend(mine, r) for r in range(n) if r != rank and mine.numel()]
    for r in range(n):
        if r != rank and chunks[r].numel():
            buf = torch.empty_like(chunks[r])
            dist.recv(buf, r)
            chunks[r].copy_(buf)
    for q in reqs:
        q.wait()


def batched_chunked_ring(tensor):
    """The chunked ring with batch_isend_irecv for each exchange: bytes are counted through isend."""
    rank, n = dist.get_rank(), dist.get_world_size()
    left, right = (rank - 1) % n, (rank + 1) % n
    chunks = tensor.view(-1).tensor_split(n)
    for phase in ("reduce-scatter", "all-gather"):
        for s in range(n - 1):
            if phase == "reduce-scatter":
                out, into = chunks[(rank - s) % n], chunks[(rank - s - 1) % n]
            else:
                out, into = chunks[(rank + 1 - s) % n], chunks[(rank - s) % n]
            buf = torch.empty_like(into)
            ops = ([dist.P2POp(dist.isend, out, right)] if out.numel() else []) + \
                  ([dist.P2POp(dist.irecv, buf, left)] if into.numel() else [])
            if ops:
                for req in dist.batch_isend_irecv(ops):
                    req.wait()
            if phase == "reduce-scatter":
                into += buf
            else:
                into.copy_(buf)


def _ring_steps(tensor, chunks, make_buffer, exchange):
    """The chunked ring's schedule over ``chunks``, each step's receive buffer from ``make_buffer(into)`` and its
    transfer done by ``exchange(out, buf, right, left)``: the typical mistakes and right answers below differ
    only there."""
    rank, n = dist.get_rank(), dist.get_world_size()
    left, right = (rank - 1) % n, (rank + 1) % n
    for s in range(n - 1):
        out, into = chunks[(rank - s) % n], chunks[(rank - s - 1) % n]
        buf = make_buffer(into)
        exchange(out, buf, right, left)
        into += buf
    for s in range(n - 1):
        out, into = chunks[(rank + 1 - s) % n], chunks[(rank - s) % n]
        buf = make_buffer(into)
        exchange(out, buf, right, left)
        into.copy_(buf)


def _isend_recv(out, buf, right, left):
    req = dist.isend(out, right)
    dist.recv(buf, left)
    req.wait()


def ring_with_chunk(tensor):
    """tensor.chunk(n) instead of tensor_split(n): fewer than n chunks when the tensor is shorter than n."""
    _ring_steps(tensor, tensor.view(-1).chunk(dist.get_world_size()), torch.empty_like, _isend_recv)


def ring_with_float32_buffers(tensor):
    """Receive buffers made with torch.empty(k): float32 whatever the tensor's dtype."""
    _ring_steps(tensor, tensor.view(-1).tensor_split(dist.get_world_size()), lambda into: torch.empty(into.shape),
                _isend_recv)


def ring_sending_the_whole_tensor(tensor):
    """Each step sends the whole tensor into the neighbour's one-chunk buffer."""
    _ring_steps(tensor, tensor.view(-1).tensor_split(dist.get_world_size()), torch.empty_like,
                lambda out, buf, right, left: _isend_recv(tensor, buf, right, left))


def ring_isend_irecv_wait(tensor):
    """Right, written with isend and irecv, both waited for."""
    def exchange(out, buf, right, left):
        reqs = ([dist.isend(out, dst=right)] if out.numel() else []) + ([dist.irecv(buf, src=left)] if buf.numel()
                                                                        else [])
        for req in reqs:
            req.wait()
    _ring_steps(tensor, tensor.view(-1).tensor_split(dist.get_world_size()), torch.empty_like, exchange)


def ring_blocking_send_recv(tensor):
    """Right, with blocking send and recv: even ranks send first, odd ranks receive first (no deadlock)."""
    def exchange(out, buf, right, left):
        if dist.get_rank() % 2 == 0:
            if out.numel():
                dist.send(out, right)
            if buf.numel():
                dist.recv(buf, left)
        else:
            if buf.numel():
                dist.recv(buf, left)
            if out.numel():
                dist.send(out, right)
    _ring_steps(tensor, tensor.view(-1).tensor_split(dist.get_world_size()), torch.empty_like, exchange)


def ring_from_imports(tensor):
    """Right, with another import style: the functions imported by name, the ranks taken from the group."""
    from torch.distributed import get_rank, get_world_size, irecv, isend

    def exchange(out, buf, right, left):
        sent = isend(out, right) if out.numel() else None
        got = irecv(buf, left) if buf.numel() else None
        for req in (sent, got):
            if req is not None:
                req.wait()
    assert get_rank() == dist.get_rank()
    _ring_steps(tensor, tensor.view(-1).tensor_split(get_world_size()), torch.empty_like, exchange)


# -- the checker passes correct implementations ------------------------------------------------
@pytest.mark.parametrize("impl", [chunked_ring_all_reduce, batched_chunked_ring, reversed_order_sum,
                                  ring_isend_irecv_wait, ring_blocking_send_recv, ring_from_imports])
def test_passes_bandwidth_optimal_implementations(clusters, impl):
    check_all_reduce(impl, clusters=clusters)  # raises AssertionError if it wrongly rejects


@pytest.mark.parametrize("impl", [chunked_ring_all_reduce, ring_all_reduce, naive_all_reduce, ring_plus_a_broadcast])
def test_bandwidth_optimal_false_passes_any_correct_all_reduce(clusters, impl):
    check_all_reduce(impl, bandwidth_optimal=False, clusters=clusters)


@pytest.mark.parametrize("impl, words", [
    (ring_all_reduce, ["right sum", "not bandwidth-optimal", "on 3 ranks", "2.00 x S", "every rank sent too much",
                       "tensor_split",
                       "bandwidth_optimal=False"]),
    (naive_all_reduce, ["not bandwidth-optimal", "rank 0 sent", "2.00 x S", "at most 64 bytes"]),
    (ring_plus_a_broadcast, ["not bandwidth-optimal", "rank 0 sent"]),
])
def test_rejects_correct_but_wasteful_all_reduces(clusters, impl, words):
    with pytest.raises(AssertionError) as info:
        check_all_reduce(impl, clusters=clusters)
    message = str(info.value)
    for w in words:
        assert w in message, f"the checker's message for {impl.__name__} should mention {w!r}; it was:\n{message}"


# -- the tolerance itself, from both sides: ROUNDING x n x eps(dtype) x sum|inputs| per element -----------------------
def _nudged_ring(tensor, units):
    """The chunked ring, then every float element scaled by 1 + units x n x eps: where all inputs share a sign
    (some element in each case does), the error is units x n x eps x sum|inputs|."""
    chunked_ring_all_reduce(tensor)
    if tensor.dtype.is_floating_point:
        tensor.mul_(1 + units * dist.get_world_size() * torch.finfo(tensor.dtype).eps)


def nudged_just_above_the_tolerance(tensor):
    _nudged_ring(tensor, 3)


def nudged_well_below_the_tolerance(tensor):
    _nudged_ring(tensor, 0.5)


def test_a_sum_just_above_the_tolerance_is_rejected(clusters):
    """3 x n x eps: rejected by ROUNDING = 2 (a tolerance twice as wide accepts it), with the reason; no low dtype
    is blamed."""
    from course_utils.checks.all_reduce import ROUNDING

    assert 2 <= ROUNDING < 3, f"the nudges below are sized for ROUNDING = 2: {ROUNDING}"
    near = "close to the sum but not exact.*more than 2 additions in float32 round"
    with pytest.raises(AssertionError, match=near) as info:
        check_all_reduce(nudged_just_above_the_tolerance, clusters=clusters)
    for low in ("bfloat16", "float16"):
        assert low not in str(info.value), f"a nudge of 3 x n x eps is not {low}'s rounding:\n{info.value}"


def test_a_sum_well_within_the_tolerance_passes(clusters):
    check_all_reduce(nudged_well_below_the_tolerance, clusters=clusters)


def test_near_miss_in_bf16_is_rejected_with_the_reason(clusters):
    with pytest.raises(AssertionError) as info:
        check_all_reduce(ring_in_bf16, clusters=clusters)
    message = str(info.value)
    for w in ("close to the sum but not exact", "bfloat16", "float32", "dtype"):
        assert w in message, f"the message should mention {w!r}; it was:\n{message}"


@pytest.mark.parametrize("impl, words", [
    (ring_dropping_remainder, ["elements are wrong", "not divisible", "tensor_split"]),
    (averaging_ring, ["divided by", "average"]),
    (reduce_without_broadcast, ["only rank 0 holds the right sum"]),
    (using_the_collective, ["dist.all_reduce", "point-to-point"]),
    (gather_then_broadcast, ["dist.broadcast", "dist.reduce", "point-to-point"]),
    (returning_a_copy, ["returned the sum", "in place"]),
    (raising_stub, ["raised NotImplementedError on ranks 0, 1 of 2", "write the chunked ring here"]),
])
def test_catches_each_mistake(clusters, impl, words):
    with pytest.raises(AssertionError) as info:
        check_all_reduce(impl, clusters=clusters)
    message = str(info.value)
    for w in words:
        assert w in message, f"the checker's message for {impl.__name__} should mention {w!r}; it was:\n{message}"


def test_chunk_instead_of_tensor_split_says_why(clusters):
    """tensor.chunk(2) of 1 value gives 1 chunk: the bare IndexError becomes a sentence naming chunk() and its fix."""
    message = _verdict(clusters, ring_with_chunk)
    for w in ("raised IndexError", "on 2 ranks with a float32 tensor of shape (1,)",
              "tensor.chunk(2) of 1 value returns only 1 chunk", "tensor_split(world_size)"):
        assert w in message, f"the message should mention {w!r}; it was:\n{message}"


@pytest.mark.parametrize("impl, words", [
    # either rank may abort first: rank 0 gets 3 float64 values (24 vs 12 bytes), rank 1 gets 4 (32 vs 16)
    (ring_with_float32_buffers, ["with a float64 tensor of shape (7,)", "Received data size doesn't match",
                                 "the buffer is float32", "torch.empty_like(chunk)"]),
    (ring_sending_the_whole_tensor, ["with a float32 tensor of shape (12,)", "received a message of 48 bytes into a "
                                     "24-byte buffer", "48 vs 24", "the whole tensor", "one chunk per step"]),
])
def test_gloo_abort_becomes_one_sentence(make_cluster, capfd, impl, words):
    """gloo aborts a rank whose message is longer than its receive buffer: the verdict says why in plain words,
    instead of "killed by SIGABRT", and the aborted rank's thread dumps do not reach the notebook. (A cluster of
    its own: the ranks that replace an aborted one start without the shared clusters' preloaded imports.)"""
    aborted = {2: make_cluster(world_size=2, timeout=29)}
    message = _verdict(aborted, impl, world_sizes=(2,))
    for w in words:
        assert w in message, f"the message for {impl.__name__} should mention {w!r}; it was:\n{message}"
    assert "SIGABRT" not in message and "\n" not in message, message
    printed = capfd.readouterr()
    assert "Thread 0x" not in printed.err + printed.out and "Fatal Python error" not in printed.err, printed.err[:2000]
    check_all_reduce(chunked_ring_all_reduce, clusters=aborted, world_sizes=(2,))   # the ranks recover for a retry


def _verdict(clusters, impl, **kwargs):
    with pytest.raises(AssertionError) as info:
        check_all_reduce(impl, clusters=clusters, **kwargs)
    return str(info.value)


def test_deadlock_becomes_an_assertion(make_cluster):
    """(On a cluster of its own, as the aborts above: the ranks that replace stuck ones start without the shared
    clusters' preloaded imports, and a functional collective's first import then takes seconds.)"""
    stuck = {2: make_cluster(world_size=2, timeout=29)}
    with pytest.raises(AssertionError) as info:
        check_all_reduce(deadlocking, clusters=stuck, world_sizes=(2,), timeout=3)
    message = str(info.value)
    assert "did not finish within 3 s" in message, message
    for r in (0, 1):   # where each rank was stuck: the call and the learner's own line
        assert f"rank {r}: in recv() at" in message and "dist.recv(buf, (rank - 1) % n)" in message, message
    check_all_reduce(chunked_ring_all_reduce, clusters=stuck, world_sizes=(2,))  # usable after


@pytest.mark.parametrize("impl, words", [
    (functional_collective, ["torch.distributed._functional_collectives.all_reduce", "point-to-point"]),
    (process_group_method, ["ProcessGroup.allreduce", "point-to-point"]),
    (hidden_collective, ["right sum", "only 0 bytes", "2(n-1) x S = 96 bytes", "travelled another way"]),
])
@pytest.mark.parametrize("bandwidth_optimal", [True, False])
def test_rejects_collectives_however_reached(clusters, impl, words, bandwidth_optimal):
    """A collective reached around dist.* is named where Python sees it; one no wrapper sees (torch's operator,
    called directly) still fails, because it hands send/isend less than any point-to-point all-reduce must."""
    with pytest.raises(AssertionError) as info:
        check_all_reduce(impl, clusters=clusters, bandwidth_optimal=bandwidth_optimal)
    message = str(info.value)
    for w in words:
        assert w in message, f"the checker's message for {impl.__name__} should mention {w!r}; it was:\n{message}"


def test_near_miss_one_chunk_too_many_is_rejected(clusters):
    """The byte bound is tight: the chunked ring plus one more chunk per rank fails on the first case (2 ranks,
    12 float32 values: the bound is 48 bytes, the near miss sends 72), and passes without the bound."""
    with pytest.raises(AssertionError) as info:
        check_all_reduce(ring_one_chunk_too_many, clusters=clusters)
    message = str(info.value)
    for w in ("not bandwidth-optimal", "on 2 ranks", "rank 0 sent 72 bytes", "in 3 messages", "at most 48 bytes"):
        assert w in message, f"the message should mention {w!r}; it was:\n{message}"
    check_all_reduce(ring_one_chunk_too_many, clusters=clusters, bandwidth_optimal=False)


@pytest.mark.parametrize("impl, words", [
    (gather_reuses_scatter_index, ["on 2 ranks with a float32 tensor of shape (12,)", "on every rank",
                                   "chunk 0 (elements 0-5) on rank 0 holds chunk 1's elements (only rank 1's input)",
                                   "wrong chunk"]),
    (scatter_adds_into_sent_chunk, [
        "chunk 1 (elements 6-11) on rank 0 holds only rank 0's own input: it was never reduced",
        "chunk 0 (elements 0-5) on rank 0 holds rank 1's input, without rank 0's"]),
])
def test_off_by_one_ring_names_the_chunk_and_whose_inputs_it_holds(clusters, impl, words):
    with pytest.raises(AssertionError) as info:
        check_all_reduce(impl, clusters=clusters)
    message = str(info.value)
    for w in words:
        assert w in message, f"the checker's message for {impl.__name__} should mention {w!r}; it was:\n{message}"
    assert "on ranks 0, 1 on 2 ranks" not in message and "expected" not in message, message


def test_guard_is_removed_after_a_check(clusters):
    with pytest.raises(AssertionError):
        check_all_reduce(using_the_collective, clusters={2: clusters[2]}, world_sizes=(2,))
    wrapped = clusters[2].run("import torch.distributed as dist; dist.all_reduce.__name__")
    assert wrapped == ["all_reduce", "all_reduce"], f"dist.all_reduce is still wrapped on the ranks: {wrapped}"
    with pytest.raises(AssertionError):
        check_all_reduce(process_group_method, clusters={2: clusters[2]}, world_sizes=(2,))
    method = clusters[2].run("import torch.distributed as dist\n"
                             "type(dist.ProcessGroup.__dict__['allreduce']).__name__")
    assert method == ["instancemethod"] * 2, f"ProcessGroup.allreduce is still wrapped on the ranks: {method}"


# -- count_sent_bytes: exact byte counts per algorithm -----------------------------------------
def _bytes_per_rank(numel):
    from course_utils import allreduce

    out = {}
    for name in ("naive_all_reduce", "ring_all_reduce", "chunked_ring_all_reduce"):
        t = torch.ones(numel)
        with count_sent_bytes() as sent:
            getattr(allreduce, name)(t)
        assert torch.equal(t, torch.full((numel,), float(dist.get_world_size()))), name
        out[name] = sent["bytes"]
    return out


@pytest.mark.parametrize("n", [2, 3, 4])
def test_bytes_sent_match_the_formulas(clusters, n):
    numel = 120                      # divisible by 2, 3 and 4: the chunks are equal
    size = numel * 4                 # float32 bytes
    got = clusters[n].run(_bytes_per_rank, numel)
    for r, counts in enumerate(got):
        assert counts["chunked_ring_all_reduce"] == 2 * (n - 1) * size // n, (r, counts)
        assert counts["ring_all_reduce"] == (n - 1) * size, (r, counts)
        assert counts["naive_all_reduce"] == ((n - 1) * size if r == 0 else size), (r, counts)


def test_count_sent_bytes_restores_send(clusters):
    def probe():
        import torch.distributed as d
        before = (d.send, d.isend)
        with count_sent_bytes():
            pass
        return (d.send, d.isend) == before
    assert clusters[2].run(probe) == [True, True], "count_sent_bytes must put dist.send/isend back"


# -- a failing check shows the learner's line and the verdict, not the checker's frames --------
def test_failing_check_in_ipython_shows_the_verdict_not_the_checker(clusters):
    """The notebooks' import form goes through course_utils.checks' wrapper; IPython's own traceback
    (as JupyterLab renders it) shows the learner's line and the verdict, and no line of the checkers."""
    import re

    from IPython.core.interactiveshell import InteractiveShell

    import course_utils.checks as checks

    shell = InteractiveShell.instance(colors="nocolor")
    shown = []
    shell._showtraceback = lambda etype, evalue, stb: shown.append("\n".join(stb))
    shell.user_ns.update(clusters={2: clusters[2]}, using_the_collective=using_the_collective)
    cell = ("from course_utils.checks import check_all_reduce\n"
            "check_all_reduce(using_the_collective, clusters=clusters, world_sizes=(2,))  # the learner's line\n")
    result = shell.run_cell(cell)
    assert isinstance(result.error_in_exec, AssertionError), result.error_in_exec
    assert shell.user_ns["check_all_reduce"] is checks.check_all_reduce, "one wrapped object per checker"
    assert getattr(shell.user_ns["check_all_reduce"], "_verdict_only", False), "the import went around the wrapper"
    text = re.sub(r"\x1b\[[0-9;]*m", "", shown[-1])
    assert "the learner's line" in text, text
    assert "point-to-point" in text and "AssertionError" in text, text
    assert "course_utils/checks" not in text and "course_utils\\checks" not in text, (
        f"the checker's frames should be hidden:\n{text}")
    assert "_diagnose" not in text and "raise AssertionError" not in text, text


def test_wrapper_keeps_other_errors_and_passes_results():
    """Only verdicts (AssertionError) lose their frames; a misuse or a bug keeps its traceback."""
    from course_utils.checks import verdict_only

    def misuse():
        raise TypeError("takes a function")

    with pytest.raises(TypeError) as info:
        verdict_only(misuse)()
    assert info.traceback[-1].name == "misuse"
    assert verdict_only(lambda x: x + 1)(1) == 2

    def verdict():
        raise AssertionError("plain words") from ValueError("inside")

    with pytest.raises(AssertionError) as info:
        verdict_only(verdict)()
    assert info.value.__cause__ is None and info.value.__suppress_context__
    assert all(entry.name != "verdict" for entry in info.traceback), "the checker's frame should be cut"
