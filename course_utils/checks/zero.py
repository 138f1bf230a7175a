"""The checker of 12_zero_fsdp: your ZeRO-1 ``step()`` against DDP with the full optimizer.

Call it INSIDE a ``%%ddp`` cell (2 or more ranks): every rank runs the same training on the process
group that is already there, and every rank raises the same ``AssertionError`` (the first failing
rank's explanation) or returns quietly.
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F

from course_utils.zero import ShardedOptimizer, count_collectives, make_uneven_model, ring_bytes

TOL = 1e-6
LR, WEIGHT_DECAY = 1e-2, 0.1


def _gather(problem):
    """Every rank's problem (or None), so that all ranks stop at the same step and agree on the verdict."""
    problems = [None] * dist.get_world_size()
    dist.all_gather_object(problems, problem)
    return problems


def _first(problems):
    """The verdict: a rank whose OWN slice went wrong explains the cause best, so it goes first."""
    found = [(p.startswith(_OWN) is False, r, p.removeprefix(_OWN)) for r, p in enumerate(problems) if p]
    if not found:
        return None
    _, r, p = min(found)
    return p if p.startswith("(seen on rank") else f"(seen on rank {r}) {p}"


_OWN = "\0own:"   # marks an explanation about the rank's own slice


def _models():
    from course_utils.models import make_model

    adamw = (torch.optim.AdamW, dict(lr=LR, weight_decay=WEIGHT_DECAY))
    sgd = (torch.optim.SGD, dict(lr=LR, momentum=0.9))   # unlike Adam, SGD notices a gradient W times too large
    return [("a 189-parameter model (Linear 7->13, Tanh, Linear 13->5, LayerNorm, Linear 5->1) with AdamW",
             lambda: make_uneven_model(seed=3), 7, adamw),
            ("TinyMLP 16 -> 64 -> 1 (1153 parameters) with SGD + momentum", lambda: make_model(seed=4), 16, sgd)]


def _flat(params, numel):
    out = torch.zeros(numel)
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    out[:flat.numel()] = flat
    return out


def _held_state_bytes(opt):
    """Optimizer state held by ``opt`` and by any optimizer stored on it."""
    from course_utils.zero import partition_state_bytes

    seen = {id(opt.optimizer): opt.optimizer}
    for value in vars(opt).values():
        if isinstance(value, torch.optim.Optimizer):
            seen[id(value)] = value
    return sum(partition_state_bytes(o) for o in seen.values())


def _explain_slices(opt, got, want, before, rank, ws, what, step):
    """None if every slice matches; else what went wrong, in words."""
    ok, stale = [], []
    for k in range(ws):
        lo, hi = opt.bounds(k)
        hi = min(hi, opt.numel)
        lo = min(lo, hi)
        ok.append(torch.allclose(got[lo:hi], want[lo:hi], rtol=0, atol=TOL))
        stale.append(torch.equal(got[lo:hi], before[lo:hi]) and not torch.equal(want[lo:hi], before[lo:hi]))
    if all(ok):
        return None
    where = f"on {what}, after step {step + 1}"
    others = [k for k in range(ws) if k != rank]
    if torch.allclose(got, want + (ws - 1) * before, rtol=0, atol=1e-5):
        return (f"{where}, every slice holds its new value PLUS {ws - 1} old copies: the slices were added up "
                "(an all-reduce). Use an all-gather: each rank contributes its own slice and everyone receives "
                "all of them.")
    if ok[rank] and all(stale[k] for k in others):
        return (f"{where}, your own slice is right, but the other ranks' slices never changed: every rank "
                "only updated its own. All-gather the updated slices into every replica: "
                "dist.all_gather_single(self.flat, self.shard.detach().clone(), group=self.group).")
    if stale[rank]:
        return _OWN + (f"{where}, your own slice of the parameters did not change. Give self.shard.grad this "
                "rank's slice of the gradient and call self.optimizer.step(): that optimizer owns self.shard, "
                "which is self.flat[self.lo:self.hi].")
    if not ok[rank]:
        lo, hi = opt.bounds(rank)
        err = (got[lo:min(hi, opt.numel)] - want[lo:min(hi, opt.numel)]).abs().max().item()
        return _OWN + (f"{where}, your own slice [{lo}, {hi}) differs from DDP + the full optimizer by up to "
                f"{err:.2e}. Step it with the gradient of exactly that slice: flat_grad[self.lo:self.hi], where "
                "flat_grad = self.flatten_grads() (the gradients are already averaged by DDP: do not "
                "reduce them again).")
    bad = [k for k in others if not ok[k]]
    return (f"{where}, your own slice is right but the slices of rank(s) {bad} arrived wrong. Use an "
            "all-gather (each rank contributes its slice, everyone receives all of them); an all-reduce "
            "would add the stale copies of the other slices to the new one.")


def check_zero_step(step, steps=3):
    """``step(self)``, ZeRO-1's step for a ``ShardedOptimizer``, must train exactly like DDP + the full optimizer.

    Introduced in 12_zero_fsdp. Two models (parameter counts not divisible by the world size), several
    steps under DDP from the same weights (AdamW, then SGD with momentum), every parameter compared after
    every step within 1e-6; this rank's optimizer state at most 1/W of the full optimizer's (plus the
    split's remainder and the one-element step counter); no more bytes sent than one all-gather."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, ws = dist.get_rank(), dist.get_world_size()
    if ws < 2:
        raise AssertionError("check_zero_step needs 2 or more ranks: run it in a %%ddp cell")
    Yours = type("YourShardedOptimizer", (ShardedOptimizer,), {"step": step})
    problem = None
    gen = torch.Generator().manual_seed(1234 + rank)
    for what, make, d_in, (optimizer_class, kwargs) in _models():
        reference = DDP(make())
        ref_opt = optimizer_class(reference.parameters(), **kwargs)
        model = DDP(make())
        opt = Yours(model.parameters(), optimizer_class, **kwargs)
        params = list(model.parameters())
        for s in range(steps):
            x, y = torch.randn(8, d_in, generator=gen), torch.randn(8, 1, generator=gen)
            for m, o in ((reference, ref_opt), (model, opt)):
                o.zero_grad()
                F.mse_loss(m(x), y).backward()
            before = _flat(params, opt.flat.numel())
            ref_opt.step()
            try:
                with count_collectives() as calls:
                    opt.step()
            except NotImplementedError as exc:
                problem = (f"your step() is not written yet (NotImplementedError: {exc}). "
                           "Write it, then run the cell again.")
            except Exception as exc:  # noqa: BLE001 (explained to the learner)
                hint = ""
                if "size" in str(exc) or "shape" in str(exc):
                    hint = (" self.shard.grad must have exactly self.shard's size: take the slice "
                            "flat_grad[self.lo:self.hi] of flat_grad = self.flatten_grads().")
                problem = f"on {what}, your step() raised {type(exc).__name__}: {exc}.{hint}"
            if problem is None:
                got, want = _flat(params, opt.flat.numel()), _flat(reference.parameters(), opt.flat.numel())
                problem = _explain_slices(opt, got, want, before, rank, ws, what, s)
            one_all_gather = ring_bytes("all-gather", opt.flat.numel() * opt.flat.element_size(), ws)
            if problem is None and calls.sent() > one_all_gather:
                problem = (f"on {what}, the parameters are right, but your step() sends {calls.sent()} bytes per rank "
                           f"({', '.join(f'{n} {k}' for k, n in calls.kinds().items())}), more than the "
                           f"{one_all_gather} of one all-gather of the flat buffer. The gradients are already "
                           "averaged: one all-gather of the updated slices is all ZeRO-1 needs.")
            problem = _first(_gather(problem))
            if problem:
                break
        if problem is None:
            full = sum(v.numel() * v.element_size() for st in ref_opt.state.values() for v in st.values()
                       if torch.is_tensor(v))
            held = _held_state_bytes(opt)
            if held > full / ws + 8 + 4:
                problem = (f"on {what}, the parameters are right, but this rank holds {held} bytes of optimizer "
                           f"state, and the full optimizer {full}: ZeRO-1 keeps about 1/{ws} of it per rank. Step "
                           "only self.optimizer, whose state covers this rank's slice (self.shard), not an "
                           "optimizer over every parameter.")
            problem = _first(_gather(problem))
        if problem:
            break
    if problem:
        raise AssertionError(problem)
    if rank == 0:
        print(f"check_zero_step: {steps} steps on {len(_models())} models (AdamW, SGD + momentum) match DDP + the "
              f"full optimizer within {TOL:g} on {ws} ranks, with 1/{ws} of the optimizer state per rank and one "
              "all-gather per step.")



def check_fsdp_bytes_prediction(prediction, measured, resharded):
    """Exercise 2 of 12_zero_fsdp: FSDP's bytes per step with ``reshard_after_forward=False``, as a
    multiple of DDP's. ``measured``: that ratio, counted; ``resharded``: the ratio section 4 counted
    with the default resharding. Prints a nudge while ``prediction`` is None."""
    if prediction is None:
        print("Set prediction to your answer (a multiple of DDP's bytes, e.g. Fraction(7, 4)) and run the cell again.")
        return
    got, want = float(prediction), float(measured)
    if abs(got - want) < 1e-6:
        print(f"Right: {measured} x DDP's bytes.")
        return
    if abs(got - float(resharded)) < 1e-3 or abs(got - 1.5) < 1e-6:
        raise AssertionError(
            f"{prediction} is the traffic WITH resharding after forward (section 4: the blocks are gathered again "
            "in backward). With reshard_after_forward=False the gathered weights stay from forward to backward: "
            "which all-gather disappears, and what is left per phase?")
    if got < want:
        raise AssertionError(
            f"{prediction} is too little: FSDP still all-gathers every parameter in forward and reduce-scatters "
            "every gradient in backward, (n-1)/n x S each, and DDP's all-reduce sends 2(n-1)/n x S: add the two "
            "and divide.")
    raise AssertionError(
        f"{prediction} is too much: without resharding, which collectives are left in forward, in backward and in "
        "the step? Add up what each sends ((n-1)/n x S for an all-gather or a reduce-scatter of every parameter) "
        "and divide by DDP's 2(n-1)/n x S.")


# -- 14_will_it_fit's exercise: ZeRO-2's peak at W = 4, counted piece by piece ---------------------------------
UNIT_BYTES_PER_PARAM = 16 / 14      # 14 units = the model's training state, 16 bytes a parameter


def _zero2_peak_bytes_per_param(world_size, *, bucket=True, gloo_copy=True, shard_weights=False, shard_moments=True):
    """ZeRO-2's peak in bytes a parameter, at its one bucket's reduce-scatter (14_will_it_fit's reveal): the fp32
    weights, the moments' share, the bucket, gloo's copy of the bucket, and the output shard."""
    weights = 4 / world_size if shard_weights else 4
    moments = 8 / world_size if shard_moments else 8
    return weights + moments + 4 * bucket + 4 * gloo_copy + 4 / world_size


def solution_zero2_peak_units(world_size=4):
    """The course's answer to 14_will_it_fit's exercise, in units of the headline (14 units = 16 B/param)."""
    return _zero2_peak_bytes_per_param(world_size) / UNIT_BYTES_PER_PARAM


def check_zero2_peak_units(answer, world_size=4):
    """14_will_it_fit's exercise: ``answer``, ZeRO-2's peak per rank at ``world_size`` in the lesson's units.

    Accepts any value within 0.01 units of the count (a figure copied from a print with 2 decimals passes);
    a wrong count gets the piece it is missing or has too much of."""
    if answer is None:
        raise AssertionError("zero2_at_4 is still None: count ZeRO-2's peak at W = 4 in units, piece by piece "
                             "(the reveal after section 1's table did it for W = 2), and assign the number")
    if isinstance(answer, bool) or not isinstance(answer, (int, float)):
        raise AssertionError(f"zero2_at_4 should be a number of units, got {type(answer).__name__} {answer!r}")
    right = solution_zero2_peak_units(world_size)
    if abs(answer - right) <= 0.01:
        return (f"ZeRO-2 at W = {world_size}: 4 (weights) + 8/{world_size} (moments) + 4 (bucket) + 4 (gloo's copy) "
                f"+ 4/{world_size} (output) = {_zero2_peak_bytes_per_param(world_size):g} B/param = {right:.3f} units: "
                "only the moments and the output shrink with W; the bucket and gloo's copy stay whole")
    wrong = {
        "the bucket and gloo's copy": dict(bucket=False, gloo_copy=False),
        # one of the two whole-gradient buffers (the same count either way)
        "gloo's copy of the bucket, or the bucket itself (each a whole gradient)": dict(gloo_copy=False),
    }
    for missing, kwargs in wrong.items():
        if abs(answer - _zero2_peak_bytes_per_param(world_size, **kwargs) / UNIT_BYTES_PER_PARAM) <= 0.01:
            raise AssertionError(f"{answer} units leaves out {missing}: both are alive at the reduce-scatter's wait()")
    if abs(answer - _zero2_peak_bytes_per_param(world_size, shard_weights=True) / UNIT_BYTES_PER_PARAM) <= 0.01:
        raise AssertionError(f"{answer} units shards the weights: ZeRO-2 keeps every rank's fp32 weights whole "
                             "(sharding them is ZeRO-3 / FSDP)")
    if abs(answer - _zero2_peak_bytes_per_param(world_size, shard_moments=False) / UNIT_BYTES_PER_PARAM) <= 0.01:
        raise AssertionError(f"{answer} units keeps the moments whole: ZeRO-1 and ZeRO-2 shard Adam's moments over W")
    if abs(answer - solution_zero2_peak_units(2)) <= 0.01 and world_size != 2:
        raise AssertionError(f"{answer} units is the W = 2 count: redo the shares with W = {world_size}")
    if abs(answer - _zero2_peak_bytes_per_param(world_size)) <= 0.01:
        raise AssertionError(f"{answer} is in bytes per parameter: divide by 16/14, the bytes a parameter of one unit")
    raise AssertionError(f"{answer} units is not ZeRO-2's peak at W = {world_size}: add the weights, the moments' "
                         "share, the bucket, gloo's copy of it and the reduce-scatter's output, each in units "
                         "(16 B/param = 14 units)")
