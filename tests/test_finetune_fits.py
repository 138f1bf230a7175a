"""scripts/finetune_lora.py fits the cards its docstring names: Llama 2 7B, ``--strategy fsdp --bf16``, two 24 GB cards.

The script's own ``build`` (with a ``load_base`` that gives Llama 2 7B's shape on ``meta`` instead of reading the hub)
and one step of ``train_steps`` (what its main loop runs), at the docstring's command line, measured with fake
tensors on a fake world of 2 ranks, as ``course_utils.true_size`` measures (build on meta, ``fully_shard`` on the
``fake`` backend's world, ``to_empty`` under ``FakeTensorMode``, FSDPMemTracker over the step). The base on
``meta`` stands for the one the script reads into host memory: only what lands on the device is counted. Every
moment of the build and of the step (forward, backward, AdamW's first step) must stay under 85% of a 24 GiB card,
and the weights a rank holds must never add up to the whole base; the peaks the script's docstring states
are the ones measured here. About 20 s on one core.
"""
import importlib.util
import re
import shlex

import pytest
import torch

from conftest import ROOT

SCRIPT = ROOT / "scripts" / "finetune_lora.py"
CARD = 24 * 2 ** 30                    # a "24 GB" card: 24 GiB, as nvidia-smi reports it
USABLE = 0.85                          # what no tensor meter sees: CUDA context, NCCL, the allocator's cache
WEIGHTS = ("Sharded Param", "Unsharded Param", "Parameter", "All Gather")   # a tracker's kinds that hold weights


def _script():
    spec = importlib.util.spec_from_file_location("finetune_lora", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def promised_command(doc):
    """(world size, script arguments) of the docstring's Llama 2 7B line."""
    lines = [line for line in doc.replace("\\\n", " ").splitlines() if "Llama-2-7b-hf" in line and "torchrun" in line]
    assert len(lines) == 1, f"the docstring should give one torchrun line for Llama 2 7B, found {len(lines)}"
    words = shlex.split(lines[0])
    world_size = int(next(w.split("=")[1] for w in words if w.startswith("--nproc-per-node=")))
    return world_size, words[words.index("scripts/finetune_lora.py") + 1:]


def llama_2_7b_on_meta(name, seed=0, dtype=torch.float32):
    """What ``load_model(name, seed=, dtype=)`` returns for meta-llama/Llama-2-7b-hf, on ``meta``: no bytes."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from course_utils.lora import LLAMA_2_7B, quiet_transformers

    quiet_transformers()
    assert name == "meta-llama/Llama-2-7b-hf", name
    config = LlamaConfig(**LLAMA_2_7B)
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


def measure(finetune_lora, argv, world_size, monkeypatch):
    """Peak bytes per rank of the build and of each phase of the first training step, and the most bytes of weights
    a rank held at any moment, for ``finetune_lora.build(parse_args(argv))`` on a fake world of ``world_size``."""
    from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    import course_utils.lora as lora
    from course_utils.memory import skip_frozen
    from course_utils.true_size import fake_world

    args = finetune_lora.parse_args(argv)
    _, data = lora.tiny_tokenizer()
    real_batch = lora.finetune_batch

    def batch(*a, **kw):               # get_batch reads its window starts with tolist(): real tensors, not fakes
        with unset_fake_temporarily():
            return real_batch(*a, **kw)

    monkeypatch.setattr(lora, "finetune_batch", batch)
    device = torch.device("cpu")
    peaks, most_weights = {}, 0
    with fake_world(world_size):
        model, optimizer = finetune_lora.build(args, device, load_base=llama_2_7b_on_meta)
        base = [p for p in model.parameters() if not p.requires_grad]
        base_bytes = sum(p.numel() * p.element_size() for p in base)           # the whole base (numel: global)
        dtypes = {p.dtype for p in base}
        # train_steps averages the loss with .item(): with a ShapeEnv a fake tensor's item() is a symbol, not an error
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
            with tracker:
                lora.train_steps(model, optimizer, data, 0, 1, args.global_batch_size, args.block_size)
            peaks["step"] = _peak(tracker)
            for h in hooks:
                h.remove()
            most_weights = max(most_weights, tracker.most_weights)
    return dict(peaks=peaks, most_weights=most_weights, base_bytes=base_bytes, dtypes=dtypes, args=args)


def test_the_llama_2_7b_command_line_fits_two_24_gb_cards(monkeypatch):
    finetune_lora = _script()
    world_size, argv = promised_command(finetune_lora.__doc__)
    assert world_size == 2 and "--bf16" in argv and argv[argv.index("--strategy") + 1] == "fsdp", argv
    try:
        got = measure(finetune_lora, argv, world_size, monkeypatch)
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
    assert got["dtypes"] == {torch.bfloat16}, f"--bf16: the frozen base should be bf16, it is {got['dtypes']}"
    assert got["most_weights"] < got["base_bytes"], (
        f"a rank held {got['most_weights'] / 2 ** 30:.2f} GiB of weights at once: the whole base "
        f"({got['base_bytes'] / 2 ** 30:.2f} GiB), which FSDP should never gather on one card")
    stated = re.search(r"the peak per rank is ([0-9.]+) GiB after the build and ([0-9.]+) GiB in forward and backward",
                       " ".join(finetune_lora.__doc__.split()))
    assert stated, "the docstring should state the measured peaks (after the build; in forward and backward)"
    measured = (peaks["build"], max(peaks["forward"], peaks["backward"]))
    assert all(abs(float(said) - n / 2 ** 30) < 0.05 for said, n in zip(stated.groups(), measured)), (
        f"the docstring says {stated.group(0)!r}; measured: {table}")
    for phase, n in peaks.items():
        assert n < budget, (f"{phase}: {n / 2 ** 30:.2f} GiB per rank, over {USABLE:.0%} of a 24 GiB card "
                            f"({budget / 2 ** 30:.2f} GiB): {table}")
