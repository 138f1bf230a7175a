"""Checkers for the pieces of MicroFSDP the learner writes in 13_fsdp_by_hand.

Call them INSIDE a ``%%ddp`` cell: every rank runs the same checks, and every rank raises the same
``AssertionError`` (the first failing rank's explanation) or returns quietly.
``check_pad_and_shard`` needs no process group.

``compare_with_one_process`` is also what tests/test_micro_fsdp.py uses to prove the reference: it
trains a wrapper and one process side by side and returns the first difference, in words.

``check_fit_tighter`` is 14_will_it_fit's: a MicroFSDP plan for the headline model, measured on 4 ranks against a
4-unit budget.
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from course_utils.checks.micro_ddp import _agree, _raised, _verdict
from course_utils.fsdp import original_name


# -- piece 1: pad and shard ------------------------------------------------------------------------

def check_pad_and_shard(pad_and_shard):
    """``pad_and_shard(tensors, rank, world_size)`` -> ``(shard, padded_numel)``: the tensors flattened into one
    fp32 vector, zero-padded to a multiple of W, and slice ``rank`` of W equal slices."""
    from course_utils import fsdp as ref

    tensors = [torch.arange(6.0).view(2, 3), torch.arange(10.0, 15.0), torch.tensor([[99.0]])]   # 12 numbers
    problem = None
    for ws in (2, 4, 5, 7):
        for rank in range(ws):
            want, want_padded = ref.pad_and_shard(tensors, rank, ws)
            try:
                got, padded = pad_and_shard(tensors, rank, ws)
            except Exception as exc:  # noqa: BLE001 (the learner's code: any error becomes the verdict)
                problem = _raised("pad_and_shard", exc)
                break
            if not torch.is_tensor(got) or got.dim() != 1:
                problem = "pad_and_shard must return a flat (1-D) tensor as the shard, and the padded length."
            elif padded != want_padded:
                problem = (f"with 12 numbers and W = {ws}, the padded length is {padded}; it must be the smallest "
                           f"multiple of W that holds them all ({want_padded}).")
            elif got.numel() != want.numel():
                problem = (f"with W = {ws}, rank {rank}'s shard has {got.numel()} numbers: every rank must hold the "
                           f"same number, padded length / W = {want.numel()} (pad with zeros at the end).")
            elif got.dtype != torch.float32:
                problem = f"the shard is {got.dtype}: keep the master shard in float32, whatever the compute dtype."
            elif not torch.equal(got, want):
                problem = (f"with W = {ws}, rank {rank}'s shard is {got.tolist()}, expected {want.tolist()}: flatten "
                           "in order, pad with zeros at the END, and take the rank-th contiguous slice.")
            if problem:
                break
        if problem:
            break
    if problem is None:
        single = torch.arange(12.0)                     # one fp32 tensor that needs no padding
        got, _ = pad_and_shard([single], 0, 2)
        single[0] = -1.0
        if got[0].item() == -1.0:
            problem = "the shard shares memory with the model's tensor: return a copy (the shard is its own Parameter)."
    if problem:
        raise AssertionError(problem)
    print("check_pad_and_shard: flat, fp32, zero-padded to a multiple of W, one contiguous slice per rank.")


# -- a model the lesson never shows ------------------------------------------------------------------

class Odd(nn.Module):
    """Sizes that divide by nothing, a frozen bias, the embedding tied to the head (both in the root), and one
    weight shared by two blocks (so it belongs to no single block)."""

    def __init__(self, vocab=11, d=7, hidden=13, n_blocks=3):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(d, hidden), nn.Tanh(), nn.Linear(hidden, d))
                                    for _ in range(n_blocks))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight                     # tied: one Parameter, two users in the root
        self.blocks[-1][0].weight = self.blocks[0][0].weight   # shared by two units
        self.blocks[1][0].bias.requires_grad_(False)            # frozen

    def forward(self, idx):
        h = self.wte(idx)
        for block in self.blocks:
            h = h + block(h)
        return self.head(self.norm(h))


def make_odd(seed=0, **kwargs):
    torch.manual_seed(seed)
    return Odd(**kwargs)


OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.2, momentum=0.9),
    # AdamW divides by sqrt(v): where a gradient is ~0, float rounding moves its sign and the update by up to lr,
    # so a 1e-6 comparison needs a small lr (the update is about lr per element whatever the gradient)
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1),
}


class CollectiveLog(TorchDispatchMode):
    """Every collective that reaches a process group while the block runs, however the code called it.

    ``dist.all_reduce``, ``distributed_c10d``'s functions, a ``ProcessGroup``'s own methods (``group.allreduce``)
    and ``async_op=True`` all reach the process group through one dispatcher op of the ``c10d`` namespace
    (``c10d.allreduce_``, ``c10d._reduce_scatter_base_``, ``c10d.reduce_scatter_``, ...), and
    ``torch.distributed._functional_collectives`` through one of ``_c10d_functional``: a dispatch mode sees them
    all (checked route by route in torch 2.13: tests/test_checker_micro_fsdp.py). A spy on ``dist.*`` would
    miss the last two routes. ``self.calls``: ``(kind, op, input numel)`` in call order, kind one of
    "all-reduce", "reduce-scatter", "all-gather", or the op's own name.
    """

    def __init__(self):
        super().__init__()
        self.calls = []

    @staticmethod
    def kind(op_name):
        name = op_name.split("::")[-1]
        if "reduce_scatter" in name:
            return "reduce-scatter"
        if "allreduce" in name or "all_reduce" in name:
            return "all-reduce"
        if "allgather" in name or "all_gather" in name:
            return "all-gather"
        return name.rstrip("_")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace in ("c10d", "_c10d_functional") and func.__name__.split(".")[0] not in (
                "wait_tensor", "_wrap_tensor_autograd"):
            schema = func._schema
            numel = None
            for i, arg in enumerate(schema.arguments):
                if arg.name in ("input", "input_tensor", "input_tensors", "inputs", "input_list", "tensors"):
                    value = args[i] if i < len(args) else kwargs.get(arg.name)
                    numel = sum(t.numel() for t in _tensors(value))
                    break
            self.calls.append((self.kind(schema.name), schema.name, numel))
        return func(*args, **kwargs)

    def count(self, kind):
        return sum(1 for k, _, _ in self.calls if k == kind)


def _tensors(value):
    if torch.is_tensor(value):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


def _collective_problem(model, log, case):
    """None if backward reduce-scattered each trainable unit's gradient once and all-reduced nothing, else why
    not, in words (``log``: the CollectiveLog of one backward)."""
    units = getattr(model, "units", None)
    if units is None:
        return None
    trainable = [u for u in units if any(f.requires_grad for f in u.flats)]
    all_reduces = [op for k, op, _ in log.calls if k == "all-reduce"]
    if all_reduces:
        route = (" (a functional all-reduce: torch.distributed._functional_collectives reaches the same process "
                 "group)" if any(op.startswith("_c10d_functional") for op in all_reduces) else "")
        return (f"{case}: your wrapper all-reduces the gradients{route}, seen at the process group: "
                f"{len(all_reduces)} all-reduce(s) in one backward. That is numerically right, but every rank then "
                "holds the whole averaged gradient (twice the gradient memory of a shard: full gradient plus its "
                "reduced copy). Reduce-scatter it (dist.reduce_scatter_tensor), so each rank receives only the "
                "average of its own shard.")
    full_sizes = {f.padded for u in trainable for f in u.flats if f.requires_grad}
    shard_sizes = {f.shard.numel() for u in units for f in u.flats}
    gathered = [n for k, _, n in log.calls if k == "all-gather" and n in full_sizes and n not in shard_sizes]
    if gathered:
        return (f"{case}: in backward your wrapper all-gathers every rank's full gradient ({gathered[0]} numbers "
                "from each rank: a unit's whole padded gradient, not a shard) and sums the copies. That is "
                "numerically right, but every rank receives W full gradients (W times the gradient memory) and "
                "sends W - 1 times the bytes of a reduce-scatter. Reduce-scatter the flat gradient instead "
                "(dist.reduce_scatter_tensor): the sum arrives already cut, each rank only its shard's part.")
    scattered = log.count("reduce-scatter")
    if scattered != len(trainable):
        return (f"{case}: one backward ran {scattered} reduce-scatter(s) for {len(trainable)} units with trainable "
                "parameters (seen at the process group; other collectives: "
                f"{', '.join(k for k, _, _ in log.calls if k != 'reduce-scatter') or 'none'}). Each unit's "
                "gradients leave in post_backward by ONE reduce-scatter of the unit's flat gradient "
                "(flat.flat_grad(), divided by W), so that each rank receives only its shard's part.")
    return None


def _full_grads(wrapper):
    """``{name: full fp32 gradient}`` gathered from the shards' ``.grad`` (zeros where None)."""
    out = {}
    for unit in wrapper.units:
        for flat in unit.flats:
            if not flat.requires_grad:
                continue
            g = flat.shard.grad if flat.shard.grad is not None else torch.zeros_like(flat.shard)
            full = torch.empty(flat.padded, dtype=g.dtype, device=g.device)
            dist.all_gather_single(full, g.detach().contiguous(), group=wrapper.group)
            for name, t, shape in zip(flat.names, full.split(flat.numels + [flat.padded - sum(flat.numels)]),
                                      flat.shapes):
                out[name] = t.view(shape)
    return out


def _reference_grads(ref, xs, ys, compute_dtype, world_size):
    """One process, the whole batch: fp32 grads of the mean loss. With a 16-bit compute dtype it casts as
    MicroFSDP does: each rank's micro-batch in compute_dtype, its gradient cast to fp32, divided by W, summed."""
    params = dict(ref.named_parameters())
    if compute_dtype == torch.float32:
        F.cross_entropy(ref(torch.cat(xs)).flatten(0, 1), torch.cat(ys).flatten()).backward()
        return
    grads = {n: torch.zeros_like(p) for n, p in params.items()}
    for x, y in zip(xs, ys):
        low = {n: p.detach().to(compute_dtype).requires_grad_(p.requires_grad) for n, p in params.items()}
        logits = torch.func.functional_call(ref, low, (x,))
        F.cross_entropy(logits.float().flatten(0, 1), y.flatten()).div(len(xs) // world_size).backward()
        for n, t in low.items():
            if t.grad is not None:
                grads[n] += t.grad.float() / world_size
    for n, p in params.items():
        if p.requires_grad:
            p.grad = grads[n]


def _watch_post_backward(model, found):
    """Wrap ``model.post_backward`` (on this instance): right after it returns for a unit other than the root,
    that unit must hold neither its gathered weights nor its views' full-size gradients. The first problem is
    appended to ``found``, in words."""
    original = getattr(model, "post_backward", None)
    root = getattr(model, "root", None)
    if original is None or not hasattr(model, "units"):
        return

    def post_backward(unit, *args, **kwargs):
        result = original(unit, *args, **kwargs)
        if unit is root or getattr(model, "reshard_root", False) or found:
            return result
        held = sum(f.full.untyped_storage().nbytes() for f in unit.flats)
        grads = sum(v.grad.numel() * v.grad.element_size() for f in unit.trainable for v in f.views
                    if v.grad is not None)
        if held and getattr(unit, "holding", False):
            return result  # frozen weights still needed by backward (a LoRA layer): checked when its input's is in
        if held:
            found.append(f"unit {unit.name} still holds its gathered weights ({held} bytes) after its reduce-scatter: "
                         "free them in post_backward (flat.free() for each of unit.flats, the root excepted), or "
                         "every unit stays gathered until backward ends and memory is not 1/W.")
        elif grads:
            found.append(f"unit {unit.name}'s views still hold their full-size gradients ({grads} bytes) after its "
                         "reduce-scatter: set view.grad = None for every view of flat.views once the gradient has "
                         "been reduce-scattered. Otherwise each unit keeps a full gradient, and the next backward adds "
                         "into it (the next step's gradient would be wrong).")
        return result

    model.post_backward = post_backward
    input_done = getattr(model, "_input_done", None)
    if input_done is None:
        return

    def after_input(unit):  # MicroFSDP's deferred free: backward has left a unit with frozen weights
        result = input_done(unit)
        held = sum(f.full.untyped_storage().nbytes() for f in unit.flats)
        if unit.reduced and unit is not root and held and not found:
            found.append(f"unit {unit.name} still holds its gathered weights ({held} bytes) after its reduce-scatter "
                         "and its input's gradient: free them in post_backward (flat.free() for each of unit.flats, "
                         "the root excepted), or every unit stays gathered until backward ends and memory is not 1/W.")
        return result

    model._input_done = after_input


def compare_with_one_process(make, build=make_odd, steps=3, optimizer="sgd", compute_dtype=torch.float32,
                             accum_steps=1, micro_batch_size=3, tol=1e-6, case="", check_memory=True):
    """Train ``make(build())`` on this rank's share and ``build()`` in one process on the whole batch; None if
    the full parameters agree within ``tol`` after every step, else the first problem in words (the same on
    every rank)."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    case = case or (f"{ws} ranks, {optimizer}, {str(compute_dtype).replace('torch.', '')}"
                    + (f", {accum_steps} accumulated micro-batches per step" if accum_steps > 1 else ""))
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    ref = build().to(device)
    try:
        model = make(build().to(device))
    except Exception as exc:  # noqa: BLE001
        return _agree(f"{case}: " + _raised("constructing your wrapper", exc))
    shards = list(model.parameters())
    problem = None
    if any(p.dim() != 1 for p in shards) or sum(p.numel() for p in shards) * ws < sum(
            p.numel() for p in ref.parameters()):
        problem = (f"{case}: the wrapper's parameters must be flat shards (1-D) that together hold the whole model "
                   "once: hand the optimizer the shards, not the module's parameters.")
    n_unique = sum(p.numel() for p in ref.parameters())
    stored = sum(p.numel() for p in shards) * ws - (ws - 1) * len(shards)   # at most W - 1 padding per shard
    if problem is None and stored > n_unique:
        problem = (f"{case}: the shards hold at least {stored} numbers over the ranks, but the model has {n_unique} "
                   "distinct ones: a tied weight is counted twice (each copy would get part of its gradient, and "
                   "the copies drift apart). Collect the parameters by identity, each Parameter once, and point "
                   "every module that uses it at the same view.")
    problem = _agree(problem)
    if problem:
        return problem
    opt, ref_opt = OPTIMIZERS[optimizer](shards), OPTIMIZERS[optimizer](list(ref.parameters()))
    after_reduce = []                                 # what a unit still holds once its post_backward returned
    if check_memory:
        _watch_post_backward(model, after_reduce)
    vocab = ref.wte.num_embeddings
    g = torch.Generator().manual_seed(11)
    root_bytes = sum(f.nbytes for f in model.root.flats) if hasattr(model, "root") else 0
    for step in range(steps):
        xs = [torch.randint(vocab, (micro_batch_size, 5), generator=g).to(device) for _ in range(ws * accum_steps)]
        ys = [torch.randint(vocab, (micro_batch_size, 5), generator=g).to(device) for _ in range(ws * accum_steps)]
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)
        logs = []
        try:
            for k in range(accum_steps):
                i = rank * accum_steps + k
                out = model(xs[i])
                if check_memory and k == 0 and step == 0 and problem is None:
                    held = model.gathered_bytes() - root_bytes
                    if held > 0:
                        problem = (f"{case}: after forward, before backward, {held} bytes of gathered block weights "
                                   "are still held. Free a unit's gathered parameters as soon as its forward has run "
                                   "(only the root may keep its copy): that is what makes memory 1/W.")
                with CollectiveLog() as log:                     # every route to the process group
                    F.cross_entropy(out.float().flatten(0, 1), ys[i].flatten()).div(accum_steps).backward()
                logs.append(log)
        except Exception as exc:  # noqa: BLE001
            problem = f"{case}, step {step}: " + _raised("a forward/backward through your wrapper", exc)
            if "storage" in str(exc):
                problem += (" A freed buffer was read in backward: gather the unit's parameters again (into the same "
                            "storage) when backward reaches it, before its gradients are computed.")
        if problem is None and after_reduce:
            problem = f"{case}, step {step}: {after_reduce[0]}"
        problem = _agree(problem)
        if problem:
            return problem
        for log in logs:
            problem = problem or _collective_problem(model, log, case)
        for p in shards:
            if problem is None and p.requires_grad and p.grad is not None and (
                    p.grad.shape != p.shape or p.grad.dtype != torch.float32):
                problem = (f"{case}: a shard's .grad is {p.grad.dtype} {tuple(p.grad.shape)}, its shard "
                           f"{p.dtype} {tuple(p.shape)}: the gradient must have the shard's shape, in fp32 (cast "
                           "before dividing and reducing).")
        problem = _agree(problem)
        if problem:
            return problem
        last_only = None
        if accum_steps > 1:                               # what a wrapper that overwrites .grad would hold
            import copy

            last_only = copy.deepcopy(ref)
            _reference_grads(last_only, [xs[r * accum_steps + accum_steps - 1] for r in range(ws)],
                             [ys[r * accum_steps + accum_steps - 1] for r in range(ws)], compute_dtype, ws)
            last_only = {n: q.grad / accum_steps for n, q in last_only.named_parameters() if q.grad is not None}
        _reference_grads(ref, [xs[r * accum_steps + k] for r in range(ws) for k in range(accum_steps)],
                         [ys[r * accum_steps + k] for r in range(ws) for k in range(accum_steps)], compute_dtype, ws)
        got = _full_grads(model)
        for name, p in ref.named_parameters():
            if problem or not p.requires_grad:
                continue
            want = p.grad if p.grad is not None else torch.zeros_like(p)
            have = got.get(name)
            if have is None:
                problem = f"{case}: no gradient for {name} in any shard."
                break
            scale = want.abs().max().item() or 1.0
            err = (have - want).abs().max().item()
            if err <= tol * max(1.0, scale) * 10:
                continue
            if torch.allclose(have, want * ws, rtol=1e-3, atol=1e-6):
                problem = (f"{case}, step {step}: {name}.grad is world_size x the average: divide by W before (or "
                           "after) the reduce-scatter, which SUMS.")
            elif last_only is not None and name in last_only and (have - last_only[name]).abs().max().item() <= (
                    tol * max(1.0, scale) * 10):
                problem = (f"{case}, step {step}: {name}.grad holds only the last micro-batch's gradient: each "
                           "backward replaced the shard's .grad instead of adding to it. Assign into .grad only "
                           "when it is None; otherwise add (accumulation keeps the sum in the 1/W shard).")
            elif step > 0:
                problem = (f"{case}, step {step}: the gradients matched one process at step 0 but not at step {step} "
                           f"({name}.grad off by {err:.1e}): the forward used weights from before the optimizer's "
                           "step. Gather from the shard Parameters the optimizer updates, not from a copy taken "
                           "earlier.")
            else:
                problem = (f"{case}, step {step}: {name}.grad differs from one process's by {err:.1e}"
                           + (f" (with {accum_steps} accumulated micro-batches, while one micro-batch per step "
                              "matched: the shard's .grad must be the sum over the micro-batches)" if
                              accum_steps > 1 else "") + ".")
            break
        problem = _agree(problem)
        if problem:
            return problem
        opt.step()
        ref_opt.step()
        full = model.full_state_dict()
        for name, p in ref.named_parameters(remove_duplicate=False):
            name = original_name(ref, name)            # the names of the model as written (no checkpointing wrapper)
            if name not in full:
                problem = f"{case}: full_state_dict() has no {name!r}: return every original name, tied ones too."
                break
            err = (full[name] - p.detach()).abs().max().item()
            if err > tol:
                problem = (f"{case}, after step {step}: {name} differs from one-process training by {err:.1e} "
                           f"(tolerance {tol:g}).")
                break
        problem = _agree(problem)
        if problem:
            return problem
    return None


def check_micro_fsdp(make):
    """``make(module)`` -> your MicroFSDP around ``module``. Trains it against one process on a model the lesson
    does not show (sizes that divide by nothing, a frozen bias, tied weights), with SGD and with AdamW, one
    micro-batch per step and then two accumulated, and names what is wrong."""
    rank = dist.get_rank()
    problem = None
    cases = [dict(optimizer="sgd"), dict(optimizer="adamw"), dict(optimizer="sgd", accum_steps=2)]
    for kwargs in cases:
        problem = compare_with_one_process(make, **kwargs)
        if problem:
            break
    _verdict(problem)
    if rank == 0:
        from course_utils.fsdp import MicroFSDP

        print(f"check_micro_fsdp: the full parameters equal one process's within 1e-6 after every step, on "
              f"{dist.get_world_size()} ranks (SGD, AdamW, 2 accumulated micro-batches; uneven sizes, a frozen bias, "
              "tied weights); freed after forward; one reduce-scatter per unit in every backward, no all-reduce."
              + (" That was the course's solution (course_utils.fsdp.MicroFSDP, USE_SOLUTION = True): set "
                 "USE_SOLUTION = False to check yours." if make is MicroFSDP else ""))


# -- 14_will_it_fit, Going further: fit it tighter ------------------------------------------------------------------

FIT_BUDGET_UNITS = 4          # the exercise's budget per rank at W = 4: half a unit above the 3.5-unit state share


def solution_fit_tighter(model):
    """The course's answer to 14_will_it_fit's "Fit it tighter": compute in bf16 over the fp32 shards (the ZeRO
    paper's mixed precision: the same training), which halves the activations and the gathered weights."""
    from course_utils.fsdp import MicroFSDP

    return MicroFSDP(model, prefetch=False, compute_dtype=torch.bfloat16)


def _headline(vocab_size):
    """Lesson 14's headline GPT (48 blocks of width 64), checkpointed per block, as its 4-rank cell builds it."""
    from course_utils.fsdp import checkpoint_blocks
    from course_utils.gpt import make_gpt

    return checkpoint_blocks(make_gpt(vocab_size, seed=0, n_layer=48, n_embd=64))


def _fit_problem(tighter, vocab_size, budget_units, measured):
    """None if ``tighter(model)`` trains lesson 14's headline model as the same training within ``budget_units``
    per rank; else why not. ``measured`` receives this rank's figures."""
    from course_utils.fsdp import MicroFSDP
    from course_utils.memory import least_peak

    rank, ws = dist.get_rank(), dist.get_world_size()
    model = _headline(vocab_size)
    N = sum(p.numel() for p in model.parameters())
    B = sum(p.numel() for p in model.blocks[0].parameters())
    R = N - sum(p.numel() for p in model.blocks.parameters())     # the root: embeddings, final norm, head
    unit = 16 * N / 14
    try:
        wrapped = tighter(model)
    except NotImplementedError:
        return ("tighter() still raises NotImplementedError: return MicroFSDP(model, prefetch=False, ...) with the "
                "change you measured to fit in 4 units")
    except Exception as exc:  # noqa: BLE001 (the learner's code: any error becomes the verdict)
        return _raised("tighter(model)", exc)
    if not isinstance(wrapped, MicroFSDP):
        return (f"tighter(model) returned {type(wrapped).__name__}, not the MicroFSDP around model: every rank would "
                "hold the whole model (14 units); return MicroFSDP(model, prefetch=False, ...)")
    counts = torch.tensor([float(sum(p.numel() for p in wrapped.parameters() if p.requires_grad))])
    dist.all_reduce(counts)
    if counts.item() < N:
        return (f"the ranks train {int(counts.item()):,} parameters together, fewer than the model's {N:,}: a frozen "
                "or dropped parameter is another training")
    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=1e-3)
    batch = torch.randint(vocab_size, (2 * ws, 32), generator=torch.Generator().manual_seed(0))
    mine = batch[rank * 2:(rank + 1) * 2]                          # 2 micro-batches of 1 per rank, as the cell's

    def step():
        optimizer.zero_grad(set_to_none=True)
        for micro in mine.split(1):
            logits = wrapped(micro)
            (F.cross_entropy(logits.flatten(0, 1).float(), micro.flatten()) / len(mine)).backward()
        optimizer.step()

    before = [p.detach().clone() for p in wrapped.parameters()]
    step()                                                         # the optimizer's state exists from here on
    if all(torch.equal(a, p.detach()) for a, p in zip(before, wrapped.parameters())):
        return "no shard moved in a training step: the optimizer must step wrapped.parameters(), the shards"
    peak = least_peak(step, wrapped, optimizer)                    # the least of 3 steps: a late free only adds
    total = peak["total"] + 4 * B + 4 * B                          # + the all-gather's copy, + a late free
    worst = torch.tensor([total / unit])
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)                   # the rank that needs the most decides
    measured.update(units=worst.item(), compute_dtype=wrapped.compute_dtype)
    if worst.item() <= budget_units:
        return None
    kinds = ", ".join(f"{k.replace('_', ' ')} {v / unit:.2f}" for k, v in peak.items()
                      if k in ("parameters", "gradients", "optimizer_state", "activations", "temporaries"))
    hint = ""
    if wrapped.compute_dtype == torch.float32 and wrapped.reshard_root:
        hint = (f" reshard_root=True frees the root's gathered weights after forward, but the root is "
                f"{4 * R / unit:.2f} units here and "
                "not what sets the peak.")
    return (f"your plan peaks at {worst.item():.2f} units on the fullest rank (the all-gather's copy and a late "
            f"free counted), over the {budget_units}-unit budget by {worst.item() - budget_units:.2f}. At this "
            f"rank's peak: {kinds}.{hint} The state share (parameters, gradients, optimizer state) cannot shrink "
            "at W = 4; what is left to shrink is the activations and the temporaries of each block's compute")


def check_fit_tighter(tighter, budget_units=FIT_BUDGET_UNITS):
    """14_will_it_fit's "Fit it tighter", on the lesson's 4 ranks: ``tighter(model)`` -> the MicroFSDP around
    ``model`` (the checkpointed headline GPT) with the change that fits ``budget_units`` per rank. The checker
    builds the model, trains it as the lesson's 4-rank cell does (fp32 AdamW over the shards, 2 micro-batches of
    1), measures its peak, and says whether it fits as the same training, or by how much it misses and where.
    Returns the verdict in words; raises ``AssertionError`` (every rank the same) when it does not fit."""
    from course_utils.gpt import CharTokenizer, load_corpus

    if not dist.is_initialized() or dist.get_world_size() != 4:
        raise AssertionError("check_fit_tighter runs in the lesson's 4-rank %%ddp cell (%%ddp -n 4): the budget "
                             "is per rank at W = 4")
    vocab_size = CharTokenizer(load_corpus()).vocab_size
    measured = {}
    _verdict(_agree(_fit_problem(tighter, vocab_size, budget_units, measured)))
    units = measured["units"]
    how = ("bf16 compute over the fp32 shards halves the activations and the gathered weights; the 3.5-unit state "
           "share is unchanged" if measured["compute_dtype"] == torch.bfloat16 else "the state share is unchanged")
    return (f"fits: {units:.2f} of {budget_units} units per rank ({1 - units / budget_units:.1%} headroom, the "
            f"all-gather's copy and a late free counted), with fp32 shards and AdamW state: the same training. {how}")
