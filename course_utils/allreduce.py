"""All-reduce written by hand with point-to-point operations, and a byte counter.

Introduced in 03_all_reduce_by_hand. Every function here runs on a rank (inside ``%%ddp`` or
``Cluster.run``) and all-reduces ``tensor`` with SUM, in place, using only ``dist.send``,
``dist.recv``, ``dist.isend`` and ``dist.irecv``. For a tensor of S bytes on n ranks, each rank sends:

=========================  ==========================  ==============
function                   bytes sent by one rank      messages (steps)
=========================  ==========================  ==============
``naive_all_reduce``       rank 0: (n-1) x S,           2(n-1), one after
                           the others: S                the other at rank 0
``ring_all_reduce``        (n-1) x S                    n-1
``chunked_ring_all_reduce`` 2(n-1)/n x S  (the bound)   2(n-1)
=========================  ==========================  ==============

``chunked_ring_all_reduce`` is the solution of the lesson's exercise: try writing it yourself first.
"""
import ast
import inspect
from contextlib import contextmanager

import torch
import torch.distributed as dist

__all__ = ["naive_all_reduce", "ring_all_reduce", "chunked_ring_all_reduce", "count_sent_bytes",
           "chunked_ring_sent_bytes", "chunked_ring_sent_chunks", "counting_send", "code_of"]


def code_of(fn):
    """The source of ``fn`` without its docstring. Introduced in 03_all_reduce_by_hand, which shows the
    algorithms' code before asking the learner to predict what their docstrings would tell."""
    source = inspect.getsource(fn)
    doc = ast.parse(source).body[0].body[0]
    if not (isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str)):
        return source
    lines = source.splitlines(keepends=True)
    return "".join(lines[:doc.lineno - 1] + lines[doc.end_lineno:])


def naive_all_reduce(tensor):
    """Reduce to rank 0, then broadcast from rank 0, with send/recv. Introduced in 03_all_reduce_by_hand.

    Rank 0 receives n-1 tensors and sends n-1 tensors one after the other: its link carries
    (n-1) x S bytes each way while the other ranks' links sit idle most of the time.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        incoming = torch.empty_like(tensor)
        for src in range(1, world_size):          # reduce: receive every rank's tensor and add it
            dist.recv(incoming, src=src)
            tensor += incoming
        for dst in range(1, world_size):          # broadcast: send the sum back to every rank
            dist.send(tensor, dst=dst)
    else:
        dist.send(tensor, dst=0)
        dist.recv(tensor, src=0)


def ring_all_reduce(tensor):
    """The whole-tensor ring of PyTorch's "Writing Distributed Applications" tutorial.

    Introduced in 03_all_reduce_by_hand. Each of the n-1 steps passes a WHOLE tensor to the right
    neighbour (the tutorial's ``send_buff``/``recv_buff`` swap, written as one buffer swap here),
    so every rank sends (n-1) x S bytes: no rank is a bottleneck, but the total grows with n.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    left, right = (rank - 1) % world_size, (rank + 1) % world_size
    send_buff = tensor.clone()
    recv_buff = torch.empty_like(tensor)
    accum = tensor.clone()
    for _ in range(world_size - 1):
        send_req = dist.isend(send_buff, right)   # don't touch send_buff until send_req.wait()
        dist.recv(recv_buff, left)
        accum += recv_buff
        send_req.wait()
        send_buff, recv_buff = recv_buff, send_buff  # pass on what we just received
    tensor.copy_(accum)


def chunked_ring_all_reduce(tensor):
    """The bandwidth-optimal ring: reduce-scatter, then all-gather. Exercise solution of 03_all_reduce_by_hand.

    The flat tensor is cut into n chunks (``tensor_split``: the first ``len % n`` chunks are one
    element longer, so no remainder is lost). In reduce-scatter step s, rank r sends chunk (r - s)
    to the right and adds chunk (r - s - 1) from the left into its own copy; after n-1 steps rank r
    holds the full sum of chunk (r + 1). All-gather then passes the finished chunks around the ring
    for n-1 more steps. Every rank sends 2(n-1) chunks: 2(n-1)/n x S bytes.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    left, right = (rank - 1) % world_size, (rank + 1) % world_size
    flat = tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1).clone()
    chunks = list(flat.tensor_split(world_size))   # views: writing a chunk writes the tensor
    incoming = torch.empty_like(chunks[0])

    def step(send_idx, recv_idx, add):
        out, into = chunks[send_idx], chunks[recv_idx]
        req = dist.isend(out, right) if out.numel() else None   # empty chunks (len < n) send nothing
        if into.numel():
            buf = incoming[:into.numel()]
            dist.recv(buf, left)
            if add:
                into += buf
            else:
                into.copy_(buf)
        if req is not None:
            req.wait()

    for s in range(world_size - 1):                 # reduce-scatter
        step((rank - s) % world_size, (rank - s - 1) % world_size, add=True)
    for s in range(world_size - 1):                 # all-gather
        step((rank + 1 - s) % world_size, (rank - s) % world_size, add=False)
    if flat.data_ptr() != tensor.data_ptr():       # a non-contiguous tensor was reduced in a copy
        tensor.copy_(flat.view_as(tensor))


def chunked_ring_sent_chunks(numel, world_size, rank):
    """The lengths of the chunks ``rank`` sends in ``chunked_ring_all_reduce``: (reduce-scatter, all-gather).

    Introduced in 03_all_reduce_by_hand: reduce-scatter step s sends chunk (r - s) % n, all-gather step s
    chunk (r + 1 - s) % n, with the chunks ``tensor_split`` cuts.
    """
    n = world_size
    lengths = [len(c) for c in torch.empty(numel).tensor_split(n)]
    scatter = [lengths[(rank - s) % n] for s in range(n - 1)]
    gather = [lengths[(rank + 1 - s) % n] for s in range(n - 1)]
    return scatter, gather


def chunked_ring_sent_bytes(numel, world_size, rank, element_size=4):
    """The bytes ``rank`` sends in ``chunked_ring_all_reduce`` of ``numel`` elements, from the schedule alone.

    Solution of exercise 2 in 03_all_reduce_by_hand: list the chunk rank r sends in every step
    (reduce-scatter step s: chunk (r - s) % n; all-gather step s: chunk (r + 1 - s) % n) and add up
    their lengths, as ``tensor_split`` cuts them.
    """
    scatter, gather = chunked_ring_sent_chunks(numel, world_size, rank)
    return (sum(scatter) + sum(gather)) * element_size


def counting_send(original, sent, depth):
    """``original`` (``dist.send`` or ``dist.isend``) wrapped to add each outer call's tensor to ``sent``.

    ``sent`` is a dict with "bytes" and "messages"; ``depth`` a one-element list shared by the send and
    isend wrappers (dist.send calls dist.isend inside: only the outer call counts). Used by
    ``count_sent_bytes`` and by the checker of 03_all_reduce_by_hand.
    """
    def wrapper(tensor, *args, **kwargs):
        if depth[0] == 0:
            sent["bytes"] += tensor.numel() * tensor.element_size()
            sent["messages"] += 1
        depth[0] += 1
        try:
            return original(tensor, *args, **kwargs)
        finally:
            depth[0] -= 1
    wrapper.__name__ = original.__name__
    return wrapper


@contextmanager
def count_sent_bytes():
    """Count the bytes this rank hands to ``dist.send`` and ``dist.isend`` inside the ``with`` block.

    Introduced in 03_all_reduce_by_hand::

        with count_sent_bytes() as sent:
            chunked_ring_all_reduce(t)
        sent["bytes"], sent["messages"]

    It replaces ``send`` and ``isend`` in ``torch.distributed`` with counting wrappers for the
    duration of the block (``batch_isend_irecv`` goes through them too). Collectives such as
    ``dist.all_reduce`` are not counted: their traffic happens inside the backend.
    """
    from torch.distributed import distributed_c10d as c10d

    sent = {"bytes": 0, "messages": 0}
    saved = {name: getattr(c10d, name) for name in ("send", "isend")}
    depth = [0]  # dist.send calls dist.isend inside: count the outer call only
    wrappers = {name: counting_send(fn, sent, depth) for name, fn in saved.items()}
    try:
        for module in (dist, c10d):   # the same object in both, as batch_isend_irecv expects
            for name, fn in wrappers.items():
                setattr(module, name, fn)
        yield sent
    finally:
        for module in (dist, c10d):
            for name, fn in saved.items():
                setattr(module, name, fn)
