"""MicroFSDP: ZeRO-3 by hand, small enough to read in one sitting.

Introduced in 13_fsdp_by_hand, where the learner builds it piece by piece; this is the reference
solution. benchmarks/fsdp_vs_fully_shard.py races it against torch's FSDP2 ``fully_shard``.

A **unit** is a wrapped submodule: by default each block of ``module.blocks`` (the tiny GPT of
course_utils.gpt), plus the root, which holds everything else (embeddings, final norm, head).

- **Shards.** Each unit keeps its parameters as one flat fp32 tensor, padded with zeros to a
  multiple of W and cut into W equal slices; rank r keeps slice r as an ``nn.Parameter`` (its
  *shard*). ``model.parameters()`` yields only shards, so any ``torch.optim`` optimizer built from
  them steps 1/W of the model, with 1/W of the optimizer state. An element-wise optimizer (SGD,
  Adam, AdamW) computes exactly what it would on the full tensors. A non-element-wise one (LAMB's
  trust ratio, Adafactor's row and column statistics, Muon's orthogonalisation) sees a flat slice
  that cuts across parameters and rows: it would run and compute something else, so its first
  ``step()`` over MicroFSDP's shards is refused (Adafactor, Muon, LBFGS, SparseAdam: ``ValueError``,
  as ``ShardedOptimizer`` refuses them), and an optimizer the course cannot classify gets a warning.
- **Forward.** A forward pre-hook all-gathers the unit's full parameters into one flat buffer (in
  ``compute_dtype``) and the module's original attributes are views of that buffer; a forward
  hook frees the buffer (its storage is resized to 0 bytes) as soon as the unit has run. The
  root keeps its copy until the end of backward, as FSDP2 does by default: its head is the first
  thing backward needs, so freeing it would only buy one more all-gather right away.
- **Backward.** A hook on the unit's output (it fires when backward reaches the unit) gathers
  the buffer again, into the same storage, so the tensors autograd saved are valid again. When
  every trainable parameter of the unit has its gradient (``register_post_accumulate_grad_hook``)
  the gradients are flattened in fp32, divided by W and reduce-scattered, asynchronously; the
  full gradient and the gathered parameters are freed. At most one reduce-scatter is in flight,
  so at most two units' full gradients exist at a time. When backward ends, each shard's
  ``.grad`` holds the averaged fp32 gradient of its slice, with the shard's shape and dtype.
- **Mixed precision.** ``compute_dtype=torch.bfloat16`` (or float16) gathers and computes in
  that dtype (half the all-gather bytes); the shards, hence the optimizer and its state, stay
  fp32, and gradients are cast to fp32 before the division and the reduce-scatter.
- **Prefetch.** While unit i runs forward, unit i+1's all-gather is already in flight (async);
  in backward, the unit before it. ``events = []`` records a timeline (``plot_fsdp_timeline``).
- **Real models.** Frozen parameters go into a second flat group per unit, gathered but never reduced; such
  a unit is freed in backward only once its input's gradient is computed too (a LoRA layer's frozen norm and
  base projections run backward after A's and B's gradients are in). A parameter used by two units (a tied
  weight across units) goes to the root; a tied weight inside one unit (an embedding tied to the head, both
  in the root, as in GPT-2 and in the checker's model; the course's tiny GPT has a separate head) is stored
  once and its two gradients are summed by autograd before the hook sees them. A model without ``.blocks``
  needs ``units=`` (without it everything is one unit, gathered from forward to the end of backward: a
  warning says so). Sizes that do not divide by W are padded. **Gradient accumulation** reduce-scatters
  after every backward and *adds* into the shard's ``.grad``: memory stays at 1/W, at the cost of one
  reduce-scatter per micro-batch (FSDP2's ``set_requires_gradient_sync(False)`` makes the other choice:
  unsharded gradients, full size, kept until the last micro-batch). ``full_state_dict()`` gathers the fp32
  parameters by their original names (a ``Checkpointed`` wrapper's ``.block`` left out), for evaluation and
  checkpoints.
"""
import time
import warnings
import weakref

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.checkpoint import checkpoint

__all__ = ["MicroFSDP", "FlatParam", "Checkpointed", "checkpoint_blocks", "original_name", "plot_fsdp_timeline",
           "pad_and_shard", "race_fully_shard"]


def pad_and_shard(tensors, rank, world_size):
    """Piece 1: the tensors flattened into one fp32 vector, zero-padded to a multiple of W, and slice
    ``rank`` of W equal slices (a copy). Returns ``(shard, padded_numel)``."""
    flat = torch.cat([t.detach().reshape(-1).float() for t in tensors])
    padded = -(-flat.numel() // world_size) * world_size
    flat = torch.nn.functional.pad(flat, (0, padded - flat.numel()))
    n = padded // world_size
    return flat[rank * n:(rank + 1) * n].clone(), padded


# -- optimizers over the shards: element-wise only -----------------------------------------------------
_SHARDS = weakref.WeakValueDictionary()       # id -> every MicroFSDP shard alive
_checked_classes = set()
_watching = []


def _check_optimizer(optimizer, args, kwargs):
    """A global optimizer-step pre-hook: an optimizer stepping MicroFSDP shards must be element-wise."""
    from course_utils.zero import EXACT_OPTIMIZERS, _check_element_wise

    klass = type(optimizer)
    if klass in _checked_classes or klass.__module__.startswith("course_utils"):
        return None
    if issubclass(klass, EXACT_OPTIMIZERS):
        _checked_classes.add(klass)
        return None
    if any(_SHARDS.get(id(p)) is p for g in optimizer.param_groups for p in g["params"]):
        _checked_classes.add(klass)               # warn once per class; a refusal raises every time
        try:
            _check_element_wise(klass, who="MicroFSDP (its shards are flat slices)", stacklevel=4)
        except ValueError:
            _checked_classes.discard(klass)
            raise
    return None


def _watch_optimizers():
    if not _watching:
        _watching.append(register_optimizer_step_pre_hook(_check_optimizer))


def original_name(root, fqn):
    """``fqn`` (a name in ``root``) without the checkpointing wrappers' inner-module parts:
    ``blocks.0.block.attn.weight`` -> ``blocks.0.attn.weight`` when ``blocks.0`` is a ``Checkpointed``."""
    parts = fqn.split(".") if fqn else []
    return ".".join(p for i, p in enumerate(parts) if not _is_wrapper_attr(root, parts[:i], p))


def _is_wrapper_attr(root, path, attr):
    """Whether ``attr`` of the module at ``path`` is a checkpointing wrapper's inner module."""
    parent = root
    for p in path:
        parent = getattr(parent, p)
    return (isinstance(parent, Checkpointed) and attr == "block") or attr == "_checkpoint_wrapped_module"



class FlatParam:
    """One unit's parameters of one kind (trainable or frozen), stored as this rank's flat shard.

    ``entries``: ``[(name, tensor, [(module, attr), ...]), ...]``, every parameter once, with every
    place it is used (a tied weight has two). The full buffer is allocated once and freed by
    resizing its storage to 0 bytes: the views the modules hold, and the tensors autograd saved
    from them, stay the same objects and become valid again when the buffer is gathered again.
    """

    def __init__(self, entries, rank, world_size, compute_dtype, group=None):
        self.names = [name for name, _, _ in entries]
        self.users = [users for _, _, users in entries]
        self.shapes = [t.shape for _, t, _ in entries]
        self.numels = [t.numel() for _, t, _ in entries]
        self.requires_grad = entries[0][1].requires_grad
        self.group, self.world_size, self.compute_dtype = group, world_size, compute_dtype
        device = entries[0][1].device
        full = torch.cat([t.detach().reshape(-1).float() for _, t, _ in entries])
        src = 0 if group is None else dist.get_global_rank(group, 0)
        dist.broadcast(full, src, group=group)      # every rank starts from rank 0's values, as DDP does
        shard, self.padded = pad_and_shard([full], rank, world_size)
        self.shard = nn.Parameter(shard.to(device), requires_grad=self.requires_grad)
        self.full = torch.empty(self.padded, dtype=compute_dtype, device=device)
        self.nbytes = self.full.untyped_storage().nbytes()
        self.views, offset = [], 0
        for shape, numel in zip(self.shapes, self.numels):
            view = self.full[offset:offset + numel].view(shape)
            view.requires_grad_(self.requires_grad)  # a leaf: autograd accumulates the gradient into view.grad
            self.views.append(view)
            offset += numel
        for view, users in zip(self.views, self.users):
            for module, attr in users:
                setattr(module, attr, view)
        self.free()

    @property
    def gathered(self):
        return self.full.untyped_storage().nbytes() > 0

    def alloc(self):
        if not self.gathered:
            self.full.untyped_storage().resize_(self.nbytes)

    def free(self):
        self.full.untyped_storage().resize_(0)

    def start_gather(self):
        """Allocate the buffer and start the all-gather of every rank's shard into it; returns the Work."""
        self.alloc()
        low = self.shard.detach().to(self.compute_dtype)   # a copy in compute_dtype (the shard itself in fp32)
        # into .data: the buffer's version counter stays, so autograd does not see an in-place change of
        # the tensors it saved (they hold the same values again once the gather is done)
        work = dist.all_gather_single(self.full.data, low, group=self.group, async_op=True)
        return work, low

    def flat_grad(self):
        """The views' gradients in one fp32 vector, padded (zeros where a gradient is missing)."""
        parts = [v.grad.reshape(-1).float() if v.grad is not None else torch.zeros(n, device=self.full.device)
                 for v, n in zip(self.views, self.numels)]
        parts.append(torch.zeros(self.padded - sum(self.numels), device=self.full.device))
        return torch.cat(parts)

    def full_tensors(self):
        """``{name: fp32 tensor}`` gathered from the shards (a collective: every rank must call it)."""
        out = torch.empty(self.padded, dtype=self.shard.dtype, device=self.shard.device)
        dist.all_gather_single(out, self.shard.detach(), group=self.group)
        return dict(zip(self.names, (t.view(s).clone() for t, s in zip(out.split(self.numels + [self.padded - sum(
            self.numels)])[:-1], self.shapes))))


class Unit:
    def __init__(self, name, module, flats):
        self.name, self.module, self.flats = name, module, flats
        self.state = "idle"          # "forward" after its pre-forward, "backward" after its pre-backward
        self.pending = None          # (works, inputs) of an all-gather in flight
        self.reduced = False         # its gradients have left in this backward
        self.holding = False         # frozen weights still needed by backward (see MicroFSDP.post_forward)
        self.free_later = False      # post_backward left the free to _input_done

    @property
    def trainable(self):
        return [f for f in self.flats if f.requires_grad]

    @property
    def gathered(self):
        return all(f.gathered for f in self.flats) and self.pending is None


def _owner_unit(fqn, unit_prefixes):
    for i, prefix in enumerate(unit_prefixes):
        if fqn.startswith(prefix + "."):
            return i
    return len(unit_prefixes)   # the root


class MicroFSDP(nn.Module):
    """Shard ``module``'s parameters over the ranks of ``process_group``, ZeRO-3 style (see the module docstring).

    Introduced in 13_fsdp_by_hand::

        model = MicroFSDP(make_gpt(vocab_size, seed=0), compute_dtype=torch.float32)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)   # over the shards only
        loss_fn(model(x), y).backward()     # every shard's .grad: the average over the ranks, fp32
        optimizer.step()                    # the next forward gathers the updated shards
        model.full_state_dict()             # {original name: full fp32 tensor}, on every rank

    ``units``: the submodules to shard one at a time (default: every child of ``module.blocks``).
    ``reshard_root=False`` keeps the root's gathered parameters from forward to the end of backward.
    ``prefetch=True`` starts the next unit's all-gather before the current one runs.
    """

    def __init__(self, module, units=None, compute_dtype=torch.float32, process_group=None,
                 prefetch=True, reshard_root=False):
        super().__init__()
        self.module, self.group, self.compute_dtype = module, process_group, compute_dtype
        self.world_size, self.rank = dist.get_world_size(process_group), dist.get_rank(process_group)
        self.prefetch, self.reshard_root = prefetch, reshard_root
        self.events = None
        if units is None:
            if hasattr(module, "blocks"):
                units = list(module.blocks)
            else:
                warnings.warn(f"MicroFSDP: {type(module).__name__} has no .blocks, so the whole model is one unit "
                              "(the root), gathered from the start of forward to the end of backward: at the peak "
                              "nothing is sharded. Name the submodules to shard one at a time with units=, e.g. "
                              "MicroFSDP(model, units=list(model.layers)).", stacklevel=2)
                units = []
        names = {m: n for n, m in module.named_modules()}
        prefixes = [names[m] for m in units]
        per_unit = self.collect(module, prefixes)
        for entries in per_unit:
            for _, _, users in entries:
                for mod, attr in users:
                    mod._parameters.pop(attr, None)   # the module now holds a view of the gathered buffer instead
        self.units, self.shards = [], nn.ParameterList()
        for i, entries in enumerate(per_unit):
            flats = []
            for trainable in (True, False):
                group_entries = [e for e in entries if e[1].requires_grad == trainable]
                if group_entries:
                    flats.append(FlatParam(group_entries, self.rank, self.world_size, compute_dtype, process_group))
            name = prefixes[i] if i < len(units) else "root"
            unit = Unit(name, units[i] if i < len(units) else module, flats)
            self.units.append(unit)
            for f in flats:
                self.shards.append(f.shard)
                _SHARDS[id(f.shard)] = f.shard
        _watch_optimizers()
        self.root = self.units[-1]
        self._order = list(self.units[:-1])     # forward order of the units (registration order until measured)
        self._seen = []
        self._handles = []
        for unit in self.units[:-1]:
            self._handles.append(unit.module.register_forward_pre_hook(lambda m, a, u=unit: self.pre_forward(u)))
            self._handles.append(unit.module.register_forward_hook(lambda m, a, out, u=unit: self.post_forward(u, out)))
            self._handles.append(unit.module.register_forward_hook(lambda m, a, out, u=unit: self._hold_for(u, a)))
        for unit in self.units:
            for flat in unit.trainable:
                for view in flat.views:
                    view.register_post_accumulate_grad_hook(lambda v, u=unit: self._grad_ready(u))
        self._reset()

    @staticmethod
    def collect(module, prefixes):
        """Per unit (the root last): ``[(name, parameter, [(module, attr), ...]), ...]``, every Parameter ONCE
        (by identity), with every place that uses it. A parameter used by two units goes to the root."""
        found = {}
        for mod_name, mod in module.named_modules(remove_duplicate=False):
            for attr, p in mod._parameters.items():
                if p is None:
                    continue
                fqn = f"{mod_name}.{attr}" if mod_name else attr
                entry = found.setdefault(p, [fqn, [], set()])
                if (mod, attr) not in entry[1]:
                    entry[1].append((mod, attr))
                entry[2].add(_owner_unit(fqn, prefixes))
        per_unit = [[] for _ in range(len(prefixes) + 1)]
        for p, (fqn, users, owners) in found.items():
            owner = owners.pop() if len(owners) == 1 else len(prefixes)
            per_unit[owner].append((fqn, p, users))
        return per_unit

    # -- the duties -----------------------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        self._reset()
        self._record("forward start")
        self.pre_forward(self.root)
        if self.compute_dtype != torch.float32:   # float inputs in compute_dtype, as FSDP2's cast_forward_inputs
            args = [a.to(self.compute_dtype) if torch.is_tensor(a) and a.is_floating_point() else a for a in args]
        out = self.module(*args, **kwargs)
        self._record("forward end")
        if self.reshard_root:
            self.post_forward(self.root, out)
        elif torch.is_grad_enabled():
            self._hook_outputs(self.root, out)
        else:
            self._free(self.root)
        return out

    def pre_forward(self, unit):
        """Before the unit runs: its full parameters gathered (maybe prefetched), the next unit's started."""
        if unit.state == "backward":                 # recomputation (activation checkpointing) in backward
            self.wait_gather(unit)
            return
        unit.state = "forward"
        if unit is not self.root:
            self._seen.append(unit)
        self.wait_gather(unit)
        if self.prefetch and unit is not self.root:
            nxt = self._next(unit, +1)
            if nxt is not None:
                self.start_gather(nxt)
        self._record("compute start", unit.name)

    def post_forward(self, unit, out):
        """After the unit has run: free its gathered parameters, and gather them again when backward arrives."""
        if unit.state == "backward":
            return out
        self._record("compute end", unit.name)
        self._free(unit)
        if torch.is_grad_enabled():
            self._hook_outputs(unit, out)
        return out

    def pre_backward(self, unit):
        """Backward has reached the unit: gather it again (maybe prefetched), start the one before it."""
        if unit.state == "backward":
            return
        unit.state = "backward"
        self._queue_finish()
        self.wait_gather(unit)
        if self.prefetch and unit is not self.root:
            prev = self._next(unit, -1)
            if prev is not None and prev.state != "backward":
                self.start_gather(prev)
        self._record("compute start", unit.name)

    def post_backward(self, unit):
        """Every gradient of the unit is in: reduce-scatter it (fp32, divided by W) and free the full copies."""
        if unit.reduced:
            return
        unit.reduced = True
        self._record("compute end", unit.name)
        self._wait_reduce()                          # one reduce-scatter in flight at a time
        works = []
        for flat in unit.trainable:
            grad = flat.flat_grad()                  # fp32 (cast before dividing and reducing)
            grad /= self.world_size
            out = torch.empty_like(flat.shard)
            self._record("reduce-scatter start", unit.name)
            works.append((dist.reduce_scatter_single(out, grad, group=self.group, async_op=True), flat, out, grad))
            for view in flat.views:
                view.grad = None                     # the full-size gradient is gone
        self._in_flight = (unit, works)
        if unit is not self.root or self.reshard_root:
            if unit.holding:                         # frozen weights still needed: freed by _input_done
                unit.free_later = True
            else:
                self._free(unit)

    def _hold_for(self, unit, args):
        """A unit with frozen parameters (a LoRA layer: its base frozen, A and B trainable) may still need its
        weights after its last trainable gradient is in: backward goes on through the frozen ops before A and B
        (the norm, the base projection) to the unit's input. post_backward then leaves the free to
        ``_input_done``, which a multi-grad hook calls once the gradients of the unit's inputs are computed."""
        if unit.state == "backward" or not torch.is_grad_enabled():
            return
        inputs = [a for a in args if torch.is_tensor(a) and a.requires_grad]
        unit.holding = bool(inputs) and any(not f.requires_grad for f in unit.flats)
        if unit.holding:
            torch.autograd.graph.register_multi_grad_hook(inputs, lambda grads, u=unit: self._input_done(u))

    def _input_done(self, unit):
        """The gradient of a holding unit's input is computed: backward is done with its frozen weights."""
        unit.holding = False
        if unit.free_later:
            unit.free_later = False
            self._free(unit)

    # -- plumbing -------------------------------------------------------------------------------------
    def start_gather(self, unit):
        if unit.gathered or unit.pending is not None:
            return
        self._record("all-gather start", unit.name)
        unit.pending = [f.start_gather() for f in unit.flats]

    def wait_gather(self, unit):
        if unit.pending is None and not unit.gathered:
            self.start_gather(unit)
        if unit.pending is not None:
            for work, _ in unit.pending:
                work.wait()
            unit.pending = None
            self._record("all-gather done", unit.name)

    def _free(self, unit):
        for f in unit.flats:
            f.free()

    def _next(self, unit, step):
        order = self._order
        if unit not in order:
            return None
        i = order.index(unit) + step
        return order[i] if 0 <= i < len(order) else None

    def _hook_outputs(self, unit, out):
        tensors = [t for t in (out if isinstance(out, (tuple, list)) else [out])
                   if torch.is_tensor(t) and t.requires_grad]
        for t in tensors:
            t.register_hook(lambda grad, u=unit: (self.pre_backward(u), grad)[1])

    def _grad_ready(self, unit):
        self._queue_finish()
        unit.ready += 1
        if unit.ready == sum(len(f.views) for f in unit.trainable):
            self.post_backward(unit)

    def _queue_finish(self):
        if not self._queued:
            self._queued = True
            # private API, as in MicroDDP (11): run when backward has computed every gradient
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)

    def _wait_reduce(self):
        if self._in_flight is None:
            return
        unit, works = self._in_flight
        for work, flat, out, _grad in works:
            work.wait()
            if flat.shard.grad is None:
                flat.shard.grad = out
            else:
                flat.shard.grad += out               # gradient accumulation: into the shard, 1/W of the memory
        self._record("reduce-scatter done", unit.name)
        self._in_flight = None

    def _finish(self):
        for unit in reversed(self.units):  # units reached by backward whose gradients did not all arrive
            if unit.trainable and not unit.reduced and (unit.state == "backward" or unit is self.root):
                self.post_backward(unit)
        self._wait_reduce()
        for unit in self.units:
            self._free(unit)
            unit.state = "idle"
        if len(self._seen) == len(self.units) - 1:
            self._order = list(self._seen)           # the measured forward order, for the next prefetch
        self._record("backward end")
        self._queued = False

    def _reset(self):
        self._queued, self._in_flight, self._seen = False, None, []
        for unit in self.units:
            unit.state, unit.reduced, unit.ready, unit.holding, unit.free_later = "idle", False, 0, False, False

    def _record(self, what, unit=None):
        if self.events is not None:
            self.events.append((what, unit, time.perf_counter()))

    # -- for evaluation and checkpoints -----------------------------------------------------------------
    def full_state_dict(self):
        """``{original name: full fp32 parameter}`` for every parameter of the wrapped module, tied names
        included (a collective: every rank calls it and gets the same dict)."""
        out = {}
        for unit in self.units:
            for flat in unit.flats:
                tensors = flat.full_tensors()
                for name, users in zip(flat.names, flat.users):
                    for mod, attr in users:
                        out[self._fqn(mod, attr)] = tensors[name]
        return out

    def _fqn(self, mod, attr):
        """The name ``attr`` of ``mod`` has in the module as it was written, without the wrappers that
        activation checkpointing adds (``Checkpointed.block``, torch's ``_checkpoint_wrapped_module``)."""
        if not hasattr(self, "_module_names"):
            self._module_names = {}
            for n, m in self.module.named_modules(remove_duplicate=False):
                self._module_names.setdefault(m, original_name(self.module, n))
        prefix = self._module_names[mod]
        return f"{prefix}.{attr}" if prefix else attr

    def gathered_bytes(self):
        """Bytes of gathered (full) parameter buffers this rank holds right now."""
        return sum(f.full.untyped_storage().nbytes() for u in self.units for f in u.flats)


# -- against FSDP2 -------------------------------------------------------------------------------------------
def race_fully_shard(n_layer=4, n_embd=128, micro_batch_size=8, steps=20):
    """MicroFSDP and FSDP2's ``fully_shard`` on the same tiny GPT, in this run, on every rank of the default group:
    ``(n_params, {impl: {"bytes": {phase: ring bytes}, "peak": peak_memory(...), "seconds": median step,
    "phase_seconds": {phase: median}, "step_seconds": [{phase: seconds} of each timed step, in order],
    "optimizer_tensors": tensors AdamW steps}}, losses)``, for impl in FSDP2,
    MicroFSDP and "MicroFSDP, no prefetch" (``prefetch=False``).

    Used by 13_fsdp_by_hand and benchmarks/fsdp_vs_fully_shard.py. CPU tensors (FSDP2's mesh on "cpu"): call it
    on gloo ranks. Steps are interleaved so that a noisy machine slows both alike; a step lasts as long as its
    slowest rank's (per phase: its median, and each step's in ``step_seconds``: step i of
    every impl ran in the same round, so their differences step by step show the noise)."""
    import statistics
    import time
    import warnings

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from course_utils.gpt import CharTokenizer, get_batch, load_corpus, make_gpt
    from course_utils.memory import peak_memory
    from course_utils.zero import count_collectives

    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    torch.set_num_threads(1)
    rank, ws = dist.get_rank(), dist.get_world_size()
    text = load_corpus()
    tok = CharTokenizer(text)
    data = tok.encode(text)

    def make(kind):
        model = make_gpt(tok.vocab_size, seed=0, n_layer=n_layer, n_embd=n_embd)
        if kind.startswith("MicroFSDP"):
            model = MicroFSDP(model, prefetch=kind == "MicroFSDP")
        else:
            mesh = init_device_mesh("cpu", (ws,))
            for block in model.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    runs = {kind: make(kind) for kind in ("FSDP2", "MicroFSDP", "MicroFSDP, no prefetch")}
    x, y = get_batch(data, 0, rank, micro_batch_size, ws * micro_batch_size)

    def step(model, opt, phases=None, clock=None):
        opt.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        with count_collectives() as forward:
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        t1 = time.perf_counter()
        with count_collectives() as backward:
            loss.backward()
        t2 = time.perf_counter()
        with count_collectives() as update:
            opt.step()
        if phases is not None:
            phases.update(forward=forward.sent(), backward=backward.sent(), step=update.sent())
        if clock is not None:
            clock.append((t1 - t0, t2 - t1, time.perf_counter() - t2))
        return loss.detach()

    out = {}
    losses = {}
    for kind, (model, opt) in runs.items():
        phases = {}
        losses[kind] = [step(model, opt, phases).item() for _ in range(2)]
        out[kind] = {"bytes": phases, "peak": peak_memory(lambda m=model, o=opt: step(m, o), model, opt)}
    clocks = {kind: [] for kind in runs}
    for _ in range(steps):
        for kind, (model, opt) in runs.items():
            dist.barrier()
            step(model, opt, clock=clocks[kind])
    # per phase, the median over steps, then the slowest rank's; the step is the sum of its phases
    local = torch.tensor([[statistics.median(c[i] for c in clocks[k]) for i in range(3)] for k in runs],
                         dtype=torch.float64)
    dist.all_reduce(local, op=dist.ReduceOp.MAX)
    # every step's phases, the slowest rank's: the spread from step to step is the noise the medians hide
    each = torch.tensor([clocks[k] for k in runs], dtype=torch.float64)
    dist.all_reduce(each, op=dist.ReduceOp.MAX)
    for kind, row, steps_of_kind in zip(runs, local.tolist(), each.tolist()):
        out[kind]["phase_seconds"] = dict(zip(("forward", "backward", "step"), row))
        out[kind]["seconds"] = sum(row)
        out[kind]["step_seconds"] = [dict(zip(("forward", "backward", "step"), s)) for s in steps_of_kind]
        out[kind]["optimizer_tensors"] = sum(len(g["params"]) for g in runs[kind][1].param_groups)
    n_params = sum(p.numel() for p in make_gpt(tok.vocab_size, seed=0, n_layer=n_layer, n_embd=n_embd).parameters())
    return n_params, out, losses


# -- activation checkpointing ------------------------------------------------------------------------------
class Checkpointed(nn.Module):
    """``block`` whose activations are recomputed in backward instead of kept (torch.utils.checkpoint,
    non-reentrant): only its input stays alive between forward and backward."""

    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x):
        return checkpoint(self.block, x, use_reentrant=False)


def checkpoint_blocks(model):
    """Wrap every block of ``model.blocks`` in ``Checkpointed``, in place; returns the model."""
    for i in range(len(model.blocks)):
        model.blocks[i] = Checkpointed(model.blocks[i])
    return model


# -- the timeline -----------------------------------------------------------------------------------------
def plot_fsdp_timeline(events, title="One MicroFSDP step: all-gathers prefetched while units compute"):
    """Draw what ``MicroFSDP.events`` recorded: forward and backward on top, one row per unit with its own compute
    (thin bars), its all-gathers (launch to done) and reduce-scatters, in the style of 07's bucket timeline: a
    gather that is done before the unit's compute starts, while another unit computes, was hidden."""
    import matplotlib.pyplot as plt

    t0 = next(t for what, _, t in events if what == "forward start")
    ms = [(what, u, (t - t0) * 1e3) for what, u, t in events]
    units = []
    for what, u, _ in ms:
        if u is not None and u not in units:
            units.append(u)
    f_end = next(t for what, _, t in ms if what == "forward end")
    b_end = next(t for what, _, t in ms if what == "backward end")
    fig, ax = plt.subplots(figsize=(8, 1.4 + 0.35 * len(units)))
    ax.barh(0, f_end, left=0, color="tab:blue", label="forward")
    ax.barh(0, b_end - f_end, left=f_end, color="tab:cyan", label="backward (and loss)")
    labelled = set()
    for row, u in enumerate(units, start=1):
        starts = [t for what, v, t in ms if what == "compute start" and v == u]
        ends = [t for what, v, t in ms if what == "compute end" and v == u]
        pairs = [(max((s for s in starts if s <= e), default=e), e) for e in ends]   # the root's forward never ends
        for s, e in pairs:
            label = "its forward" if s < f_end else "its backward"
            ax.barh(row, max(e - s, 1e-3), left=s, height=0.3, color="tab:blue" if s < f_end else "tab:cyan",
                    label=f"unit: {label}" if label not in labelled else None)
            labelled.add(label)
        for start_kind, done_kind, color, label in (("all-gather start", "all-gather done", "tab:orange", "all-gather"),
                                                    ("reduce-scatter start", "reduce-scatter done", "tab:green",
                                                     "reduce-scatter")):
            starts = [t for what, v, t in ms if what == start_kind and v == u]
            dones = [t for what, v, t in ms if what == done_kind and v == u]
            for s, d in zip(starts, dones):
                ax.barh(row, max(d - s, 1e-3), left=s, color=color,
                        label=f"{label} (launch to done)" if label not in labelled else None)
                labelled.add(label)
    ax.set_yticks(range(len(units) + 1), ["compute"] + list(units))
    ax.invert_yaxis()
    ax.set_xlabel("time since forward started (ms)")
    ax.set_title(title)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
    fig.tight_layout()
    plt.show()
    plt.close(fig)
