"""scripts/finetune.py fits the cards its docstring names: Llama 2 7B, LoRA, ``--strategy fsdp --precision mixed``, two
24 GB cards.

The script's own ``build`` (with a ``load_base`` that gives Llama 2 7B's shape on ``meta`` instead of reading the hub)
and one ``train_step`` (what its main loop runs), at the docstring's command line, measured with fake
tensors on a fake world of 2 ranks, as ``course_utils.true_size`` measures (build on meta, ``fully_shard`` on the
``fake`` backend's world, ``to_empty`` under ``FakeTensorMode``, FSDPMemTracker over the step). The base on
``meta`` stands for the one the script reads into host memory: only what lands on the device is counted. Every
moment of the build and of the step (forward, backward, AdamW's first step) must stay under 85% of a 24 GiB card,
and the weights a rank holds must never add up to the whole base; the peaks the script's docstring states
are the ones measured here.

Llama 2 7B's 32 decoder layers are identical, so each number measured here (each phase's peak, the most weights
held at once, the base's bytes) grows by the same bytes per layer: the model is measured at 2, 3 and 4 layers of
Llama 2 7B's width and extended from 2 and 3 to 32 (``course_utils.will_it_fit.extend_by_blocks``, as the tool
extends its replicas). The test asserts that 2 and 3 layers extended to 4 give the measurement at 4 to the byte, and
that the base extended to 32 layers has Llama 2 7B's published 6,738,415,616 parameters in bf16. Measured whole at
32 layers, the build, forward and backward peaks and the most weights held were the extension's to the byte (the
docstring's numbers are those; 3 and 4 layers, measured earlier, give the same line: all of 2 to 5 lie on it).
AdamW's first step is not: the first measurement in a process counts 0.5 MiB more in it (DTensor's sharding
propagation of ops it has not seen yet, ``true_size.FOREACH_NOTE``; the size of one layer's A matrices), whatever
its depth, 32 layers included; the later ones lie on the line. So 1 layer is measured first, to warm those caches,
and the step is checked against the card with one layer's adapters (1 MiB) on top of its extension: bounded, not
exact. About 15 s on one core instead of 100 s for the whole model.
"""
import functools
import importlib.util
import re
import shlex

import pytest
import torch

from conftest import ROOT
from course_utils.true_size import LLAMA2_7B
from course_utils.will_it_fit import extend_by_blocks

SCRIPT = ROOT / "scripts" / "finetune.py"
CARD = 24 * 2 ** 30                    # a "24 GB" card: 24 GiB, as nvidia-smi reports it
USABLE = 0.85                          # what no tensor meter sees: CUDA context, NCCL, the allocator's cache
WEIGHTS = ("Sharded Param", "Unsharded Param", "Parameter", "All Gather")   # a tracker's kinds that hold weights
WARM_UP = 1                            # layers of the first measurement: it warms DTensor's caches (docstring)
DEPTHS = (2, 3, 4)                     # layers measured next: extended from the first two, checked at the third


def _script():
    spec = importlib.util.spec_from_file_location("finetune", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def promised_command(doc):
    """(world size, script arguments) of the docstring's Llama 2 7B line."""
    lines = [line for line in doc.replace("\\\n", " ").splitlines() if "Llama-2-7b-hf" in line and "torchrun" in line]
    assert len(lines) == 1, f"the docstring should give one torchrun line for Llama 2 7B, found {len(lines)}"
    words = shlex.split(lines[0])
    world_size = int(next(w.split("=")[1] for w in words if w.startswith("--nproc-per-node=")))
    return world_size, words[words.index("scripts/finetune.py") + 1:]


def llama_2_7b_on_meta(name, seed=0, dtype=torch.float32, n_layer=None):
    """What ``load_model(name, seed=, dtype=)`` returns for meta-llama/Llama-2-7b-hf, on ``meta``: no bytes.
    ``n_layer``: that many of its decoder layers (default: all 32)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from course_utils.lora import LLAMA_2_7B, quiet_transformers

    quiet_transformers()
    assert name == "meta-llama/Llama-2-7b-hf", name
    config = LlamaConfig(**LLAMA_2_7B)
    if n_layer is not None:
        config.num_hidden_layers = n_layer
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        return LlamaForCausalLM(config).to(dtype)


def _watching(tracker_cls):
    """``tracker_cls`` that also keeps, over every op it sees, the most bytes of weights held at one moment."""
    class Watching(tracker_cls):
        most_weights = 0

        def _update_peak_stats(self, peak_state):
            super()._update_peak_stats(peak_state)
            for snap in self._curr_mem_snap.values():
                held = sum(n for kind, n in snap.items() if getattr(kind, "value", kind) in WEIGHTS)
                self.most_weights = max(self.most_weights, held)

    return Watching


def _peak(tracker):
    return sum(snap["Total"] for snap in tracker.get_tracker_snapshot("peak").values())


def _restart_peak(tracker):
    tracker._peak_mem_snap = tracker.get_tracker_snapshot()
    tracker._peak_mem = {dev: snap["Total"] for dev, snap in tracker._peak_mem_snap.items()}


def real_batches(monkeypatch, script):
    """The script's ``finetune_batch`` on real tensors under FakeTensorMode: get_batch reads its window starts
    with tolist()."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    real_batch = script.finetune_batch

    def batch(*a, **kw):
        with unset_fake_temporarily():
            return real_batch(*a, **kw)

    monkeypatch.setattr(script, "finetune_batch", batch)


def measure(finetune, argv, world_size, n_layer=None):
    """Peak bytes per rank of the build and of each phase of the first training step, and the most bytes of weights
    a rank held at any moment, for ``finetune.build(parse_args(argv))`` on a fake world of ``world_size``, with
    ``n_layer`` of Llama 2 7B's decoder layers (default: all). Needs ``real_batches``."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    import course_utils.lora as lora
    from course_utils.memory import skip_frozen
    from course_utils.true_size import fake_world

    args = finetune.parse_args(argv)
    _, data = lora.tiny_tokenizer()
    device = torch.device("cpu")
    peaks, most_weights = {}, 0
    with fake_world(world_size):
        model, optimizer = finetune.build(args, device,
                                               load_base=functools.partial(llama_2_7b_on_meta, n_layer=n_layer))
        base = [p for p in model.parameters() if not p.requires_grad]
        base_bytes = sum(p.numel() * p.element_size() for p in base)           # the whole base (numel: global)
        dtypes = {p.dtype for p in base}
        # train_step averages the loss with .item(): with a ShapeEnv a fake tensor's item() is a symbol, not an error
        with FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv(), static_shapes=True):
            tracker = MemTracker()
            with tracker:
                model.to_empty(device=device)            # what reaches the device: in the script, fully_shard moves it
            peaks["build"] = most_weights = _peak(tracker)      # all the build allocates: weights (and buffers)
            tracker = _watching(FSDPMemTracker)(model, optimizer)
            skip_frozen(tracker, model)

            def end_of_forward(*_):
                peaks["forward"] = _peak(tracker)
                _restart_peak(tracker)

            def start_of_step(*_):
                peaks["backward"] = _peak(tracker)
                _restart_peak(tracker)

            hooks = [model.register_forward_hook(end_of_forward), optimizer.register_step_pre_hook(start_of_step)]
            micro, accum, _ = finetune.batch_sizes(args, world_size)
            with tracker:
                finetune.train_step(model, optimizer, data, 0, args, micro, accum, device)
            peaks["step"] = _peak(tracker)
            for h in hooks:
                h.remove()
            most_weights = max(most_weights, tracker.most_weights)
    return dict(peaks=peaks, most_weights=most_weights, base_bytes=base_bytes, dtypes=dtypes, args=args)


def measure_extended(finetune, argv, world_size):
    """``measure`` at all 32 layers, extended from ``DEPTHS[:2]`` layers after checking the extension to ``DEPTHS[2]``
    (module docstring). The first measurement, at ``WARM_UP`` layers, only warms DTensor's caches."""
    at = {L: measure(finetune, argv, world_size, n_layer=L) for L in (WARM_UP, *DEPTHS)}
    first, second, check = (at[L] for L in DEPTHS)
    numbers = ("peaks", "most_weights", "base_bytes")
    for key in numbers:
        extended = extend_by_blocks(first[key], second[key], DEPTHS[2] - DEPTHS[0])
        assert extended == check[key], (
            f"{key}: {DEPTHS[0]} and {DEPTHS[1]} layers extended to {DEPTHS[2]} give {extended}, measured "
            f"{check[key]}: not the same bytes per layer, so no extension to 32 layers")
    whole = {key: extend_by_blocks(first[key], second[key], LLAMA2_7B.n_layer - DEPTHS[0]) for key in numbers}
    return dict(first, **whole)


def test_the_llama_2_7b_command_line_fits_two_24_gb_cards(monkeypatch):
    finetune = _script()
    world_size, argv = promised_command(finetune.__doc__)
    assert world_size == 2 and argv[argv.index("--precision") + 1] == "mixed" and \
        argv[argv.index("--strategy") + 1] == "fsdp" and argv[argv.index("--accum-steps") + 1] == "1", argv
    real_batches(monkeypatch, finetune)
    try:
        got = measure_extended(finetune, argv, world_size)
    except NotImplementedError as e:
        if "meta tensor" not in str(e):
            raise
        pytest.fail("build() copied the base to the device before fully_shard sharded it: the whole model went to "
                    f"each card ({e})")
    budget = USABLE * CARD
    peaks = got["peaks"]
    table = ", ".join(f"{phase} {n / 2 ** 30:.2f} GiB" for phase, n in peaks.items())
    print(f"Llama 2 7B, {' '.join(argv)}, W = {world_size}: peak per rank {table}; the most weights held at once "
          f"{got['most_weights'] / 2 ** 30:.2f} GiB of the base's {got['base_bytes'] / 2 ** 30:.2f} GiB")
    assert set(peaks) == {"build", "forward", "backward", "step"}, f"a phase was not measured: {peaks}"
    assert got["dtypes"] == {torch.bfloat16}, f"mixed: the frozen base should be bf16, it is {got['dtypes']}"
    assert got["base_bytes"] == 2 * LLAMA2_7B.n_params, (
        f"the base extended to 32 layers holds {got['base_bytes']:,} bytes, not Llama 2 7B's parameters in bf16")
    assert got["most_weights"] < got["base_bytes"], (
        f"a rank held {got['most_weights'] / 2 ** 30:.2f} GiB of weights at once: the whole base "
        f"({got['base_bytes'] / 2 ** 30:.2f} GiB), which FSDP should never gather on one card")
    stated = re.search(r"the peak per rank is ([0-9.]+) GiB after the build and ([0-9.]+) GiB in forward and backward",
                       " ".join(finetune.__doc__.split()))
    assert stated, "the docstring should state the measured peaks (after the build; in forward and backward)"
    measured = (peaks["build"], max(peaks["forward"], peaks["backward"]))
    assert all(abs(float(said) - n / 2 ** 30) < 0.05 for said, n in zip(stated.groups(), measured)), (
        f"the docstring says {stated.group(0)!r}; measured: {table}")
    args = got["args"]
    layer_adapters = len(finetune.targets_of(args)) * 2 * args.lora_r * LLAMA2_7B.d_model * 4   # A, B; fp32
    for phase, n in peaks.items():
        n += layer_adapters if phase == "step" else 0       # the step's extension is bounded, not exact (docstring)
        assert n < budget, (f"{phase}: {n / 2 ** 30:.2f} GiB per rank, over {USABLE:.0%} of a 24 GiB card "
                            f"({budget / 2 ** 30:.2f} GiB): {table}")
