"""Self-checks of the exercises in 01_data_parallelism and 02_collectives_sandbox, and the course's solutions.

Call the checks from the notebook process (not inside ``%%ddp``)::

    from course_utils.checks import check_ring_shift
    check_ring_shift(ring_shift)          # quiet when right, AssertionError saying what is wrong

The collective exercises of lesson 02 run the learner's function on 4 gloo ranks (the ``%%ddp``
cluster when it has 4 gloo ranks, else one the checker starts and keeps), with the functions of
``torch.distributed`` that it calls recorded; ``check_ring_shift`` also runs it on 3 ranks and records
the peer of every send and receive. The functions use ``dist.get_rank()`` and
``dist.get_world_size()``, since they are defined in the notebook, not on the ranks. ``clusters``
({4: Cluster}, and 3 for the ring shift) lets a test pass its own clusters.

The ``solution_*`` functions are the course's answers: the notebooks use them only while
``USE_SOLUTION = True``. Try your own first.
"""
import torch

__all__ = ["check_activation_predictions", "check_optimizer_state_predictions", "check_all_reduce_in_two_halves",
           "check_ring_shift", "check_gather_to_rank0", "solution_activation_predictions",
           "solution_optimizer_state", "solution_all_reduce_in_two_halves", "solution_ring_shift",
           "solution_gather_to_rank0"]

WORLD_SIZE = 4


# -- 01_data_parallelism ------------------------------------------------------------------------
def _is_number(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool)


GLOBAL_BATCH, ACCUM_STEPS, RANKS = 384, 4, 4   # exercise 1 of 01: 96 samples per rank is printed nowhere in the lesson


def _activation_bytes(micro_batch_size):
    """Activation bytes of one Adam step of the lesson's bigger MLP (64 -> 512 -> 1) on ``micro_batch_size``
    samples, measured here as section 4 measures them."""
    import torch.nn.functional as F

    from course_utils.data import make_regression
    from course_utils.memory import measure_step_memory
    from course_utils.models import make_model

    x, y = make_regression(n=micro_batch_size, d_in=64, seed=0)
    model = make_model(seed=0, d_in=64, d_hidden=512)
    return measure_step_memory(model, torch.optim.Adam(model.parameters()), F.mse_loss, x, y)["activations"]


def check_activation_predictions(predicted_4_ranks, predicted_1_device_accum_4):
    """Exercise 1 of 01_data_parallelism: activation bytes per device for a global batch of 384, on 4 ranks and on
    one device with ``accum_steps = 4``, against the activations measured here for the samples a device holds at
    once. Within 1 %: a value worked out from a printed, rounded size passes. Returns the explanation, to print once
    the check passes (the answer comes after the run). tests/test_checker_activation_predictions.py holds it."""
    __tracebackhide__ = True
    names = {"predicted_4_ranks": predicted_4_ranks, "predicted_1_device_accum_4": predicted_1_device_accum_4}
    for name, value in names.items():
        if value is None:
            raise AssertionError(f"{name} is still None: set it to your answer, in bytes, computed from "
                                 "act_per_sample (the activation bytes of one sample), then run the cell again.")
        if not _is_number(value):
            raise AssertionError(f"{name} should be a number of bytes, got {type(value).__name__}.")
    per_device = GLOBAL_BATCH // RANKS                 # = GLOBAL_BATCH // ACCUM_STEPS: both hold 96 samples at once
    truth = _activation_bytes(per_device)
    per_sample = truth / per_device
    for name, value in names.items():
        if abs(value - truth) <= 0.01 * truth:
            continue
        samples = value / per_sample
        if abs(value * 1024 - truth) <= 0.01 * truth or abs(value * 2**20 - truth) <= 0.01 * truth:
            why = "that looks like KiB (or MiB): the check wants bytes; act_per_sample is in bytes."
        elif abs(samples - GLOBAL_BATCH) < 0.01 * GLOBAL_BATCH:
            why = (f"that is the activations of all {GLOBAL_BATCH} samples of the global batch. "
                   + ("Each of the 4 ranks runs forward and backward on its own micro-batch only."
                      if name == "predicted_4_ranks" else
                      "With accumulation, backward frees a micro-batch's activations before the next forward "
                      "runs, so only one micro-batch is alive at a time."))
        elif any(abs(samples - k) < 0.01 * k for k in (per_device / 4, per_device * 16, 4, 16)):
            why = "check how many samples one device holds at once: the global batch, split how?"
        else:
            why = (f"that is {samples:.3g} samples' worth of activations. Activations are linear in the number of "
                   "samples a device holds at once: how many is that here?")
        raise AssertionError(f"{name} is not right: {why}")
    return (f"Each of the {RANKS} ranks holds its own {per_device} samples of the {GLOBAL_BATCH}; one device with "
            f"accum_steps = {ACCUM_STEPS} holds one micro-batch of {per_device} at a time, since backward frees a "
            "micro-batch's activations before the next forward. The same activations: what shrank them is the "
            "micro-batch size, not the number of devices.")


def check_optimizer_state_predictions(predicted, n_params):
    """Exercise 2 of 01_data_parallelism: optimizer state in bytes of ``SGD`` and ``SGD + momentum`` on the
    lesson's bigger MLP (64 -> 512 -> 1), measured here with ``measure_step_memory``. Returns the explanation, to
    print once the check passes."""
    __tracebackhide__ = True
    import torch.nn.functional as F

    from course_utils.data import make_regression
    from course_utils.memory import measure_step_memory
    from course_utils.models import make_model

    if not isinstance(predicted, dict) or set(predicted) != {"SGD", "SGD + momentum"}:
        raise AssertionError('predicted should be a dict with the keys "SGD" and "SGD + momentum" (bytes).')
    makers = {"SGD": lambda ps: torch.optim.SGD(ps, lr=0.1),
              "SGD + momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)}
    xb, yb = make_regression(n=64, d_in=64, seed=0)
    for name, make_optimizer in makers.items():
        value = predicted[name]
        if value is None:
            raise AssertionError(f'predicted["{name}"] is still None: set it to your prediction in bytes '
                                 "(n_params holds the number of parameters; float32 is 4 bytes), then run the cell.")
        if not _is_number(value):
            raise AssertionError(f'predicted["{name}"] should be a number of bytes, got {type(value).__name__}.')
        net = make_model(seed=0, d_in=64, d_hidden=512)
        got = measure_step_memory(net, make_optimizer(net.parameters()), F.mse_loss, xb, yb)["optimizer_state"]
        if value == got:
            continue
        per_param = value / n_params
        if name == "SGD":
            why = (f"you predicted {per_param:g} bytes per parameter. Plain SGD computes p -= lr * grad from the "
                   "gradient alone: what does it need to remember between steps?")
        elif value > got:
            why = (f"too high ({per_param:g} bytes per parameter). Momentum keeps one running buffer per "
                   "parameter (Adam keeps two: exp_avg and exp_avg_sq). How many bytes is one float32 copy?")
        else:
            why = (f"too low ({per_param:g} bytes per parameter). SGD with momentum must remember the running "
                   "velocity of every parameter between steps.")
        raise AssertionError(f'predicted["{name}"] is not right: {why}')
    return ("Plain SGD computes p -= lr * grad from the gradient alone and keeps nothing between steps; momentum keeps "
            "one float32 velocity buffer per parameter (momentum_buffer), 4 bytes each; Adam keeps two.")


def solution_activation_predictions(act_per_sample):
    """The course's answer to exercise 1 of 01: each rank holds 384 / 4 samples at once; one device with
    accum_steps = 4 holds one micro-batch of 384 / 4 at a time (backward frees it before the next forward)."""
    per_rank = act_per_sample * GLOBAL_BATCH / RANKS
    one_micro_batch = act_per_sample * GLOBAL_BATCH / ACCUM_STEPS
    return per_rank, one_micro_batch


def solution_optimizer_state(n_params):
    """The course's answer to exercise 2 of 01: plain SGD keeps nothing; momentum keeps one float32 buffer
    (``momentum_buffer``) per parameter."""
    return {"SGD": 0, "SGD + momentum": 4 * n_params}


# -- 02_collectives_sandbox: the course's solutions ---------------------------------------------
def solution_all_reduce_in_two_halves(x):
    """SUM all-reduce of ``x`` from reduce_scatter and all_gather (numel divisible by the world size)."""
    import torch.distributed as dist

    world_size, rank = dist.get_world_size(), dist.get_rank()
    chunks = list(x.chunk(world_size))
    mine = torch.zeros_like(chunks[rank])
    dist.reduce_scatter(mine, chunks)               # half 1: rank r owns the sum of chunk r
    pieces = [torch.zeros_like(c) for c in chunks]
    dist.all_gather(pieces, mine)                   # half 2: everyone collects every owner's chunk
    return torch.cat(pieces)


def solution_ring_shift(x):
    """Two steps around the ring: send to the right neighbour, receive from the left one, then pass on what
    arrived. Each rank ends with the tensor of rank (rank - 2) % world_size."""
    import torch.distributed as dist

    world_size, rank = dist.get_world_size(), dist.get_rank()
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    send = x
    for _ in range(2):
        buf = torch.zeros_like(x)
        reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, right), dist.P2POp(dist.irecv, buf, left)])
        for req in reqs:
            req.wait()                              # buf is ours only after this
        send = buf                                  # step 2 passes on what step 1 brought
    return buf


def solution_gather_to_rank0(x):
    """Every rank's ``x`` on rank 0, in rank order; the other ranks pass no list and return None."""
    import torch.distributed as dist

    world_size, rank = dist.get_world_size(), dist.get_rank()
    gather_list = [torch.zeros_like(x) for _ in range(world_size)] if rank == 0 else None   # only dst allocates
    dist.gather(x, gather_list, dst=0)
    return gather_list


# -- 02_collectives_sandbox: running the learner's function on the ranks ------------------------
def _start(rank, n=3, dtype=torch.float32):
    return torch.arange(n, dtype=dtype) + 10 * rank


_PEERS = {"to": [], "from": []}   # on a rank: the peers of each send/isend ("to") and recv/irecv ("from")
_PEER_DEPTH = [0]                   # > 0 inside a recorded call: what it calls underneath is not recorded again


def _peer_of(args, kwargs, names):
    """The global rank that a send/isend (``names`` = ("dst", "group_dst")) or recv/irecv (("src", "group_src"))
    talks to, given its arguments after the tensor; None for a receive from any source."""
    import torch.distributed as dist

    peer = args[0] if args else kwargs.get(names[0])
    if peer is None:
        group_peer = args[3] if len(args) > 3 else kwargs.get(names[1])
        group = args[1] if len(args) > 1 else kwargs.get("group")
        if group_peer is not None:
            peer = group_peer if group is None else dist.get_global_rank(group, group_peer)
    return peer


def _peer_recorder(original, key, names):
    def recorder(tensor, *args, **kwargs):
        import torch.distributed as dist

        if _PEER_DEPTH[0] == 0:
            peer = _peer_of(args, kwargs, names)
            _PEERS[key].append(peer)
            n = dist.get_world_size()
            if peer is not None and not 0 <= peer < n:   # gloo would wait for it forever
                raise ValueError(f"rank {dist.get_rank()} {'sends to' if key == 'to' else 'receives from'} rank "
                                 f"{peer}, and there are {n} ranks, 0 to {n - 1}")
        _PEER_DEPTH[0] += 1
        try:
            return original(tensor, *args, **kwargs)
        finally:
            _PEER_DEPTH[0] -= 1
    recorder.__name__ = getattr(original, "__name__", key)
    return recorder


def _record_peers():
    """Wrap send/isend/recv/irecv (the same wrapper in dist and c10d, as P2POp and batch_isend_irecv expect) to
    record their peers; returns what to put back."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    _PEERS["to"].clear()
    _PEERS["from"].clear()
    _PEER_DEPTH[0] = 0
    saved = []
    for name, key, names in (("send", "to", ("dst", "group_dst")), ("isend", "to", ("dst", "group_dst")),
                             ("recv", "from", ("src", "group_src")), ("irecv", "from", ("src", "group_src"))):
        original = getattr(c10d, name)
        recorder = _peer_recorder(original, key, names)
        for module in (dist, c10d):
            if getattr(module, name, None) is original:
                saved.append((module, name, original))
                setattr(module, name, recorder)
    return saved


def _on_rank(fn, case):
    """On every rank: call ``fn`` on this rank's input, record collectives, peers and what came back."""
    import torch.distributed as dist

    from course_utils.checks import all_reduce as guard

    rank, n = dist.get_rank(), dist.get_world_size()
    if case == "two_halves":
        x = _start(rank, 2 * n)
    elif case == "two_halves_long":
        x = torch.randn(6 * n, generator=torch.Generator().manual_seed(rank), dtype=torch.float64)
    else:
        x = _start(rank)
    given = x.clone()
    guard._install_guard()
    saved = []
    try:
        guard._reset()
        saved = _record_peers()
        guarded = [(owner, name, original) for (owner, name), original in guard._SAVED.items()]
        rebound = guard._rebind_globals(fn, guarded + saved)   # names imported before the guard see it too
        try:
            returned = fn(x)
        finally:
            for names, key, value in rebound:
                names[key] = value
        messages = guard._SENT["messages"]
        called = list(dict.fromkeys(guard._CALLED))
        inputs = list(guard._INPUTS)
        peers = {key: list(v) for key, v in _PEERS.items()}
    finally:
        for module, name, original in reversed(saved):
            setattr(module, name, original)
        guard._remove_guard()
    if isinstance(returned, (list, tuple)):
        returned = [t.clone() if torch.is_tensor(t) else t for t in returned]
    elif torch.is_tensor(returned):
        returned = returned.clone()
    return {"given": given, "x_after": x, "returned": returned, "collectives": called, "messages": messages,
            "inputs": inputs, "to": peers["to"], "from": peers["from"]}


def _run(fn, case, clusters=None, timeout=20, world_size=WORLD_SIZE):
    __tracebackhide__ = True
    from course_utils import DistributedError, DistributedTimeout
    from course_utils.checks.all_reduce import _ranks, cluster, stuck_calls

    if not callable(fn):
        raise TypeError(f"pass the function itself, got {type(fn).__name__}")
    name = getattr(fn, "__name__", "your function")
    where = ("" if world_size == WORLD_SIZE else f" (the check runs it on {WORLD_SIZE} ranks, then on {world_size}: "
             "use dist.get_world_size(), not a number)")
    try:
        return cluster(world_size, clusters).run(_on_rank, fn, case, timeout=timeout)
    except DistributedTimeout as exc:
        raise AssertionError(
            f"{name} did not finish within {timeout} s on {world_size} ranks{where}: {exc.summary.split(' (')[0]}. "
            "Ranks are waiting for each other: a receive that no rank sends to, a wait() on a request "
            "whose partner never came, or a collective that not every rank called." + stuck_calls(exc)) from None
    except DistributedError as exc:
        raised = [exc.rank] + [r for r, s in exc.ranks.items() if "raised" in str(s)]
        raise AssertionError(f"{name} raised {exc.exc_type} on {_ranks(sorted(set(raised)))} of {world_size}"
                             f"{where}: {exc.exc_message}") from None


def _collectives_used(outs):
    return sorted({c for o in outs for c in o["collectives"]})


def check_all_reduce_in_two_halves(fn, *, clusters=None):
    """Exercise 1 of 02: ``fn(x)`` returns the SUM all-reduce of ``x`` built from reduce_scatter and all_gather."""
    __tracebackhide__ = True
    name = getattr(fn, "__name__", "your function")
    scatters = {"reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single"}
    gathers = {"all_gather", "all_gather_into_tensor", "all_gather_single"}
    for case in ("two_halves", "two_halves_long"):
        outs = _run(fn, case, clusters)
        used = _collectives_used(outs)
        other = [c for c in used if c not in scatters | gathers]
        if other:
            shown = ", ".join(c if "." in c else "dist." + c for c in other)
            raise AssertionError(f"{name} called {shown}: the exercise builds the "
                                 "all-reduce from its two halves only, dist.reduce_scatter then dist.all_gather.")
        expected = sum(o["given"] for o in outs)
        n = len(outs)
        numel = expected.numel()
        whole = [r for r, o in enumerate(outs) for c, k in o["inputs"] if c in gathers and k == numel]
        if whole:
            raise AssertionError(f"{name} all-gathered the whole x ({numel} numbers) on rank {whole[0]} and added it "
                                 "up locally: that is an all-reduce without its first half, and it moves "
                                 f"{n} times the data. Gather only the chunk the reduce-scatter left each rank "
                                 f"({numel // n} numbers), then join the chunks.")
        if not set(used) & gathers:
            if not set(used) & scatters:
                raise AssertionError(f"{name} called no collective: each rank sees only its own x. Half 1 is "
                                     "dist.reduce_scatter, half 2 dist.all_gather.")
            missing = "dist.all_gather"
        elif not set(used) & scatters:
            missing = "dist.reduce_scatter"
        else:
            missing = None
        for r, o in enumerate(outs):
            got = o["returned"]
            if got is None:
                raise AssertionError(f"{name} returned None on rank {r}: return the all-reduced tensor "
                                     "(the same length as x).")
            if not torch.is_tensor(got):
                raise AssertionError(f"{name} returned a {type(got).__name__} on rank {r}: return one tensor, "
                                     "the same length as x (torch.cat joins a list of chunks).")
            if got.numel() == expected.numel() // n and torch.allclose(got, expected.chunk(n)[r]):
                raise AssertionError(f"{name} returned only rank {r}'s chunk of the sum: that is the reduce-scatter "
                                     "half. Every rank needs every chunk: all_gather the owners' chunks, then join "
                                     "them in rank order.")
            if got.shape != expected.shape:
                raise AssertionError(f"{name} returned shape {tuple(got.shape)} on rank {r}; x has shape "
                                     f"{tuple(expected.shape)}, and so must the all-reduced result.")
            if not torch.allclose(got, expected):
                if missing == "dist.reduce_scatter":
                    raise AssertionError(f"{name} never called dist.reduce_scatter, and its result is not the sum: "
                                         "half 1 is a reduce_scatter that leaves rank r the sum of chunk r.")
                if torch.allclose(got, expected * n) or torch.allclose(got, expected / n):
                    raise AssertionError(f"{name}'s result is the sum times or divided by {n} on rank {r}: reduce "
                                         "with SUM once, and do not scale.")
                raise AssertionError(f"{name}'s result on rank {r} is not the SUM over ranks: are the gathered "
                                     "chunks joined in rank order (chunk r comes from rank r)?")
        if missing:
            raise AssertionError(f"{name} returns the sum but never called {missing}: the exercise builds the "
                                 "all-reduce from both halves, dist.reduce_scatter (rank r ends with the sum of "
                                 "chunk r) and then dist.all_gather (every rank gets every summed chunk).")


RING_SIZES = (4, 3)  # on 4 ranks two steps either way land on the same rank; on 3 they do not


def check_ring_shift(fn, *, clusters=None):
    """Exercise 2 of 02: ``fn(x)`` returns the tensor of rank (rank - 2) % world_size, moved in two steps between
    ring neighbours (send right, receive from the left, pass on) with isend/irecv or batch_isend_irecv.

    Runs on 4 ranks, then on 3 (where two steps to the left and two to the right end on different ranks), and
    records the peer of every send and receive: each rank must send to (rank + 1) % world_size only and receive
    from (rank - 1) % world_size only. ``clusters`` ({3: Cluster, 4: Cluster}) lets a test pass its own."""
    __tracebackhide__ = True
    for world_size in RING_SIZES:
        _check_ring_shift_on(fn, world_size, clusters)


def _ring_peer_problem(r, n, o):
    """What is wrong with the peers rank ``r`` of ``n`` sent to and received from, or None."""
    right, left = (r + 1) % n, (r - 1) % n
    to, frm = o["to"], o["from"]
    named = [p for p in frm if p is not None]
    far = sorted({p for p in to + named if p not in (left, right)})
    if far:
        return (f"rank {r} sent {len(to)} message(s), to rank(s) {to}, and received from {frm}: rank {far[0]} is "
                f"not one of its ring neighbours ({left} and {right} of {n}), so it jumped. In a ring each rank "
                "talks to its neighbours only: two steps, passing on in step 2 what arrived in step 1.")
    if to and all(p == left for p in to) and all(p == right for p in named) and left != right:
        source = f"received from rank {right}" if named else "received from any source"
        return (f"rank {r} sent to rank {left} and {source}: the ring turns the wrong way (on "
                f"{n} ranks). Send to (rank + 1) % world_size and receive from (rank - 1) % world_size.")
    if any(p != right for p in to) or any(p != left for p in named):
        return (f"rank {r} of {n} sent to rank(s) {to} and received from {frm}: in a ring every step goes the same "
                f"way, each rank sending to (rank + 1) % world_size = {right} and receiving from "
                f"(rank - 1) % world_size = {left}.")
    return None


def _check_ring_shift_on(fn, n, clusters):
    __tracebackhide__ = True
    name = getattr(fn, "__name__", "your function")
    outs = _run(fn, "start", clusters, world_size=n)
    used = _collectives_used(outs)
    if used:
        raise AssertionError(f"{name} called {', '.join('dist.' + c for c in used)}: a ring shift is point-to-point "
                             "only, dist.isend to the right neighbour and dist.irecv from the left one.")
    for r, o in enumerate(outs):
        got = o["returned"]
        if not torch.is_tensor(got):
            raise AssertionError(f"{name} returned {type(got).__name__} on rank {r}: return the received buffer.")
    for r, o in enumerate(outs):
        problem = _ring_peer_problem(r, n, o)
        if problem:
            raise AssertionError(f"{name}: {problem}")
    for r, o in enumerate(outs):
        got = o["returned"]
        if torch.equal(got, _start((r - 2) % n)):
            if o["messages"] < 2:
                raise AssertionError(f"{name}: rank {r} holds the right tensor but sent {o['messages']} message(s): "
                                     "it jumped straight to rank + 2. In a ring each rank talks to its neighbours "
                                     "only: two steps, passing on in step 2 what arrived in step 1.")
            continue
        if torch.equal(got, _start((r - 1) % n)):
            why = (f"rank {r} holds rank {(r - 1) % n}'s tensor: one step only. Step 2 sends on what step 1 "
                   "received (not your own x again), so the tensors move two places.")
        elif torch.equal(got, _start((r + 1) % n)):
            why = (f"rank {r} holds its right neighbour's tensor: the ring turns the wrong way. Send to "
                   "(rank + 1) % world_size and receive from (rank - 1) % world_size.")
        elif torch.equal(got, o["given"]):
            why = f"rank {r} returned its own tensor: return the buffer that the last irecv filled."
        elif got.numel() and torch.all(got == got.flatten()[0]):   # one value everywhere: the buffer's initial fill
            why = (f"rank {r}'s buffer holds nothing that was sent: read it only after req.wait() has returned for "
                   "the irecv, and return that buffer.")
        else:
            why = f"rank {r} returned {got.tolist()}, not rank {(r - 2) % n}'s tensor."
        raise AssertionError(f"{name}: {why}" + (f" (on {n} ranks)" if n != WORLD_SIZE else ""))


def check_gather_to_rank0(fn, *, clusters=None):
    """Exercise 3 of 02: ``fn(x)`` gathers every rank's ``x`` on rank 0 with dist.gather; rank 0 returns the list
    in rank order, the other ranks return None."""
    __tracebackhide__ = True
    name = getattr(fn, "__name__", "your function")
    outs = _run(fn, "start", clusters)
    used = _collectives_used(outs)
    if "gather" not in used:
        what = f"it called {', '.join('dist.' + c for c in used)}" if used else "it never called dist.gather"
        raise AssertionError(f"{name}: {what}. Use dist.gather(x, gather_list, dst=0): only rank 0 receives.")
    expected = [o["given"] for o in outs]
    got = outs[0]["returned"]
    if not isinstance(got, list) or len(got) != len(outs) or not all(torch.is_tensor(t) for t in got):
        raise AssertionError(f"{name} should return rank 0's gather_list, a list of {len(outs)} tensors; "
                             f"rank 0 returned {type(got).__name__}.")
    if not all(torch.equal(a, b) for a, b in zip(got, expected)):
        raise AssertionError(f"{name}: rank 0's list does not hold every rank's x in rank order (slot r is rank r's).")
    others = [r for r, o in enumerate(outs[1:], start=1) if o["returned"] is not None]
    if others:
        raise AssertionError(f"{name} returned something on rank(s) {others}: only dst=0 receives anything; "
                             "the others should return None.")
