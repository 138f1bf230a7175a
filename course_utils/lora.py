"""LoRA by hand on a real architecture (transformers' Llama), and what fine-tuning on small cards needs.

Introduced in 16_fine_tuning_small_cards; scripts/finetune.py uses the same pieces under torchrun.

- **The model.** ``load_model("tiny")`` builds ``transformers``' ``LlamaForCausalLM`` at a tiny size
  (``TINY``, a character vocabulary of the course corpus), randomly initialised from a seed: nothing is
  downloaded. ``pretrain_tiny(path)`` trains it briefly on ``corpus.txt`` and saves it with
  ``save_pretrained``, so the lesson fine-tunes a base that has learnt something. Any other name goes to
  ``LlamaForCausalLM.from_pretrained`` / ``AutoModelForCausalLM.from_pretrained``: a local folder, or a hub
  name on the reader's own machine (Llama 2/3 and Mistral use the same module names, ``q_proj`` ... ``down_proj``).
- **LoRA.** ``LoRALinear`` wraps a frozen ``nn.Linear``: ``y = base(x) + (alpha / r) * x A^T B^T``, A (r x in)
  random, B (out x r) zeros, so the wrapped model starts equal to the base. ``merge()`` folds the product into
  the base weight. ``add_lora(model, targets, r, alpha)`` freezes every parameter and wraps the targets.
  ``copy_into_peft`` puts the same A and B into ``peft``'s ``get_peft_model`` model, ``save_adapter`` writes
  the adapters in the format ``PeftModel.from_pretrained`` loads.
- **True size.** ``true_size_peak`` measures the peak of one training step of a 7B-shaped Llama per rank,
  with fake tensors (no memory is allocated), for full fine-tuning or LoRA, DDP or FSDP2, at any world size.
"""
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from course_utils.memory import skip_frozen, tracker_kinds
from course_utils.true_size import GiB, MISTRAL_7B, LlamaShape

__all__ = ["TINY", "LLAMA_2_7B", "MISTRAL_7B", "TARGETS", "LoRALinear", "add_lora", "lora_parameter_count",
           "tiny_tokenizer", "load_model", "quiet_transformers", "pretrain_tiny", "copy_into_peft",
           "peft_lora_config", "save_adapter", "lora_state_dict", "causal_lm_loss", "finetune_batch",
           "true_size_peak", "llama_config", "card_verdicts", "skip_frozen", "shard_lora", "train_steps"]

# The tiny Llama of the lesson: 2 decoder layers, grouped-query attention (4 query heads, 2 key/value heads) as
# Llama 2 70B, Llama 3 and Mistral use; about 0.1M parameters, vocabulary = the corpus's characters.
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=128, tie_word_embeddings=False, rms_norm_eps=1e-6)
# The published configurations (config.json of meta-llama/Llama-2-7b-hf and mistralai/Mistral-7B-v0.1).
LLAMA_2_7B = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096,
                  tie_word_embeddings=False)
# MISTRAL_7B is course_utils.true_size's LlamaShape (lesson 14's), one object for both lessons: true_size_peak takes
# a LlamaShape as well as a dict of LlamaConfig's arguments (see llama_config).
# The linear layers of a Llama/Mistral decoder layer: attention (q, k, v, o) and MLP (gate, up, down).
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# -- LoRA ---------------------------------------------------------------------------------------------------------
class LoRALinear(nn.Module):
    """``nn.Linear`` with a low-rank update: ``base(x) + (alpha / r) * (x @ A.T) @ B.T``, the base frozen.

    Introduced in 16_fine_tuning_small_cards (the course's solution of its first exercise). ``lora_A``
    (r x in_features) starts random as peft's (Kaiming uniform, a = sqrt(5)), ``lora_B`` (out_features x r)
    starts at zero: at initialisation the output equals the base's exactly. The adapters stay fp32 whatever
    the base's dtype (a bf16 base): the input is cast to their dtype, the update back to the output's.
    ``merge()`` adds ``scaling * B @ A`` into the base weight (shape out x in) and stops adding the update.
    """

    def __init__(self, base, r=4, alpha=8):
        super().__init__()
        if not isinstance(base, nn.Linear):
            raise TypeError(f"LoRALinear wraps an nn.Linear, got {type(base).__name__}")
        self.base, self.r, self.alpha = base, r, alpha
        self.scaling = alpha / r
        for p in base.parameters():
            p.requires_grad_(False)
        self.lora_A = nn.Parameter(torch.empty(r, base.in_features, device=base.weight.device))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, r, device=base.weight.device))
        self.merged = False

    def forward(self, x):
        y = self.base(x)
        if self.merged:
            return y
        update = (x.to(self.lora_A.dtype) @ self.lora_A.t()) @ self.lora_B.t()
        return y + (self.scaling * update).to(y.dtype)

    @torch.no_grad()
    def merge(self):
        delta = self.scaling * (self.lora_B @ self.lora_A)
        self.base.weight += delta.to(self.base.weight.dtype)
        self.merged = True


def add_lora(model, targets=("q_proj", "v_proj"), r=4, alpha=8, lora_cls=LoRALinear, seed=0):
    """Freeze every parameter of ``model``, then wrap each ``nn.Linear`` whose name ends with one of ``targets``
    in ``lora_cls(linear, r=r, alpha=alpha)``. A's random values depend only on ``seed`` (every rank: the same).
    Returns ``model``, changed in place. Introduced in 16_fine_tuning_small_cards."""
    for p in model.parameters():
        p.requires_grad_(False)
    found = [(name, m) for name, m in model.named_modules()
             if isinstance(m, nn.Linear) and name.rsplit(".", 1)[-1] in targets]
    if not found:
        names = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)})
        raise ValueError(f"no nn.Linear of the model is named {list(targets)}: its linear layers are {names}")
    torch.manual_seed(seed)
    for name, linear in found:
        parent_name, attr = name.rsplit(".", 1) if "." in name else ("", name)
        parent = model.get_submodule(parent_name)
        setattr(parent, attr, lora_cls(linear, r=r, alpha=alpha))
    return model


def lora_parameter_count(model, targets=("q_proj", "v_proj"), r=4):
    """The formula: r x (in + out) for every targeted linear layer (A is r x in, B is out x r)."""
    return sum(r * (m.in_features + m.out_features) for name, m in model.named_modules()
               if isinstance(m, nn.Linear) and name.rsplit(".", 1)[-1] in targets)


def lora_state_dict(model):
    """The adapters of a model wrapped by ``add_lora``, under peft's names
    (``base_model.model.<module>.lora_A.weight``): what ``adapter_model.safetensors`` holds. ``model`` may also be a
    full state dict of such a model (scripts/finetune.py gathers one from its FSDP shards)."""
    state = model if isinstance(model, dict) else dict(model.named_parameters())
    return {f"base_model.model.{name}.weight": t.detach().float().contiguous().clone()
            for name, t in state.items() if name.rsplit(".", 1)[-1] in ("lora_A", "lora_B")}


def peft_lora_config(targets=("q_proj", "v_proj"), r=4, alpha=8, base=None):
    """peft's ``LoraConfig`` for the same adapters as ``add_lora(model, targets, r, alpha)``: no dropout, no bias."""
    from peft import LoraConfig

    return LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0, bias="none",
                      task_type="CAUSAL_LM", base_model_name_or_path=None if base is None else str(base))


@torch.no_grad()
def copy_into_peft(hand, peft_model):
    """Copy every A and B of ``hand`` (a model wrapped by ``add_lora``) into ``peft_model``
    (``get_peft_model`` of the same base), so both compute the same function. Returns how many modules."""
    theirs = dict(peft_model.named_modules())
    n = 0
    for name, m in hand.named_modules():
        if isinstance(m, LoRALinear):
            target = theirs[f"base_model.model.{name}"]
            target.lora_A["default"].weight.copy_(m.lora_A)
            target.lora_B["default"].weight.copy_(m.lora_B)
            n += 1
    if n == 0:
        raise ValueError("the first model has no LoRALinear: wrap it with add_lora first")
    return n


def save_adapter(model, directory, targets=("q_proj", "v_proj"), r=4, alpha=8, base=None):
    """Write the adapters of ``model`` (wrapped by ``add_lora``, or its full state dict) as peft does:
    ``adapter_model.safetensors`` and ``adapter_config.json`` in ``directory``;
    ``PeftModel.from_pretrained(base_model, directory)`` loads them. A few KiB: the base is not saved (``base``: its
    path or hub name, recorded in the config)."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(lora_state_dict(model), str(directory / "adapter_model.safetensors"), metadata={"format": "pt"})
    peft_lora_config(targets, r, alpha, base).save_pretrained(str(directory))
    return directory


# -- the model and its data ---------------------------------------------------------------------------------------
def quiet_transformers():
    """transformers and huggingface_hub without progress bars, info logs and their deprecation warnings: what they
    print to stderr differs between versions and runs (a notebook's stored output must not depend on it)."""
    import warnings

    import transformers
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    try:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    except ImportError:  # an older huggingface_hub: nothing to silence
        pass
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"(transformers|peft)\b.*")
    return transformers


# -- (the model and its data, continued) -------------------------------------------------------------------------
def tiny_tokenizer():
    """The course's character tokenizer of ``corpus.txt`` (course_utils.gpt.CharTokenizer) and the encoded corpus."""
    from course_utils.gpt import CharTokenizer, load_corpus

    text = load_corpus()
    tokenizer = CharTokenizer(text)
    return tokenizer, tokenizer.encode(text)


def load_model(name="tiny", seed=0, dtype=torch.float32, **overrides):
    """``"tiny"``: the lesson's Llama, random weights from ``seed`` (``overrides`` change ``TINY``'s sizes).
    Anything else: ``from_pretrained(name)``, a local folder (``save_pretrained``'s output) or, on the reader's
    machine, a hub name such as ``meta-llama/Llama-2-7b-hf`` or ``mistralai/Mistral-7B-v0.1``."""
    quiet_transformers()
    from transformers import LlamaConfig, LlamaForCausalLM

    if name == "tiny":
        tokenizer, _ = tiny_tokenizer()
        torch.manual_seed(seed)
        config = LlamaConfig(vocab_size=tokenizer.vocab_size, **{**TINY, **overrides})
        return LlamaForCausalLM(config).to(dtype)
    path = Path(name)
    if path.is_dir() and not (path / "config.json").exists():
        raise FileNotFoundError(f"{path} has no config.json: pass a folder written by save_pretrained, or a hub name")
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(name), dtype=dtype)


def causal_lm_loss(model, x, y):
    """Mean next-token cross-entropy of ``model`` (any causal LM, wrapped or not) on inputs ``x``, targets ``y``.
    The logits are cast to fp32 first (a bf16 model's loss in fp32, as autocast does)."""
    out = model(input_ids=x)
    logits = out.logits if hasattr(out, "logits") else out
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


def finetune_batch(data, step, index, micro_batch_size, global_batch_size, block_size=64, seed=1):
    """Micro-batch ``index`` of the fine-tuning step ``step``: course_utils.gpt.get_batch with its own seed (other
    windows than the pre-training's). It depends only on (seed, step, index): any world size, the same data."""
    from course_utils.gpt import get_batch

    return get_batch(data, step, index, micro_batch_size, global_batch_size, block_size=block_size, seed=seed)


def pretrain_tiny(path, steps=150, batch_size=16, lr=3e-3, seed=0, progress=None):
    """Train the tiny Llama from scratch on the corpus (``steps`` of AdamW, one process, one thread's worth of
    work: a few seconds) and ``save_pretrained`` it to ``path``. Returns the losses. What a real fine-tuning run
    downloads, made here: a base that has learnt something."""
    _, data = tiny_tokenizer()
    model = load_model("tiny", seed=seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        x, y = finetune_batch(data, step, 0, batch_size, batch_size, seed=seed)
        loss = causal_lm_loss(model, x, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if progress is not None:
            progress(step, loss.item())
    model.save_pretrained(str(path))
    return losses


# -- true size, with fake tensors ---------------------------------------------------------------------------------
def llama_config(config):
    """``LlamaConfig``'s arguments for ``config``: a dict of them (``LLAMA_2_7B``) is returned as it is, a
    ``course_utils.true_size.LlamaShape`` (``MISTRAL_7B``, lesson 14's shapes) is translated (no rotary scaling,
    untied head; ``max_position_embeddings`` left at its default, which changes no byte of a step)."""
    if isinstance(config, LlamaShape):
        return dict(vocab_size=config.vocab_size, hidden_size=config.d_model, intermediate_size=config.d_ff,
                    num_hidden_layers=config.n_layer, num_attention_heads=config.n_head,
                    num_key_value_heads=config.n_kv_head, tie_word_embeddings=False)
    if isinstance(config, dict):
        return dict(config)
    raise TypeError(f"config must be a LlamaShape (course_utils.true_size) or a dict of LlamaConfig's arguments, "
                    f"got {type(config).__name__}")


def card_verdicts(peaks, cards=(8, 16, 24), usable=0.85):
    """Which rows of ``peaks`` fit ``usable`` of each card. A card sold as "N GB" has N GiB (nvidia-smi shows
    N x 1024 MiB), so a row fits when its peak in bytes is at most ``usable * N * GiB``.

    ``peaks``: {(method, strategy, W): (peak bytes, how)}. Returns {card: {(method, strategy): (W, peak) or None}}:
    for each method and strategy the row that fits with the fewest cards (W = "any" first: one card per replica),
    or None when none fits. Introduced in 16_fine_tuning_small_cards (its FAQ is printed from it)."""
    out = {}
    for card in cards:
        verdict = {}
        for (method, strategy, W), (peak, _) in peaks.items():
            verdict.setdefault((method, strategy), None)
            best = verdict[method, strategy]
            if peak <= usable * card * GiB and (best is None or _cards(W) < _cards(best[0])):
                verdict[method, strategy] = (W, peak)
        out[card] = verdict
    return out


def _cards(W):
    return 1 if W == "any" else W


def true_size_peak(config=LLAMA_2_7B, *, lora=True, strategy="fsdp", world_size=2, r=16,
                   targets=("q_proj", "v_proj"), base_dtype=torch.bfloat16, micro_batch_size=1, seq_len=512,
                   checkpointing=True):
    """The peak per rank of one training step (forward, backward, AdamW step) of a ``config``-shaped Llama (a dict of
    ``LlamaConfig``'s arguments, or a ``LlamaShape`` such as ``MISTRAL_7B``: see ``llama_config``), measured with fake
    tensors: nothing is allocated, a 7B model is sized in seconds on a laptop.

    ``lora=False``: full fine-tuning, every parameter trainable, fp32 master weights and fp32 Adam state
    (``base_dtype`` is then the compute dtype of FSDP2's ``MixedPrecisionPolicy``; DDP keeps fp32 weights and
    runs under bf16 autocast). ``lora=True``: the base frozen in ``base_dtype``, ``add_lora`` adapters in fp32.
    ``strategy``: ``"ddp"`` (a full replica per rank; DDP's bucket copy of the trainable gradients is added, as
    MemTracker cannot see it) or ``"fsdp"`` (``fully_shard`` per decoder layer and at the root). Returns
    ``{"total", "parameters", "gradients", "optimizer_state", "activations", "temporaries", "buffers", "params",
    "trainable"}`` in bytes (counts for the last two).

    AdamW runs with ``foreach=False``: under FakeTensorMode the foreach implementation's temporaries are never
    freed, and its step would count several times the real state (the fake run's optimizer-step overcount); with
    real tensors ``foreach=True`` holds one more parameter-sized temporary of the trainable parameters at its peak
    (measured in 14_will_it_fit), which is small for LoRA and shown apart for full fine-tuning (``foreach_extra``).
    Runs in its own world from torch's ``fake`` backend; it must not run inside another process group.
    """
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore
    quiet_transformers()
    from transformers import LlamaConfig, LlamaForCausalLM

    if strategy not in ("ddp", "fsdp"):
        raise ValueError(f"strategy must be 'ddp' or 'fsdp', got {strategy!r}")
    if dist.is_initialized():
        raise RuntimeError("true_size_peak starts its own fake world: call it outside a process group "
                           "(in the notebook's kernel, or %%ddp --rank 0 after dist.destroy_process_group)")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        cfg = LlamaConfig(**llama_config(config))
        cfg._attn_implementation = "sdpa"
        with torch.device("meta"):
            model = LlamaForCausalLM(cfg)
        if lora:
            model.to(base_dtype)
            add_lora(model, targets=targets, r=r, alpha=2 * r)
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.data = p.data.float()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            if lora:
                model.enable_input_require_grads()
        params = sum(p.numel() for p in model.parameters())
        trainable = [p for p in model.parameters() if p.requires_grad]
        n_trainable = sum(p.numel() for p in trainable)
        if strategy == "fsdp":                          # on meta: fully_shard needs no memory either
            mp = MixedPrecisionPolicy(param_dtype=base_dtype, reduce_dtype=torch.float32)
            for layer in model.model.layers:
                fully_shard(layer, mp_policy=mp)
            fully_shard(model, mp_policy=mp)
        with FakeTensorMode(allow_non_fake_inputs=True):
            model.to_empty(device="cpu")
            trainable = [p for p in model.parameters() if p.requires_grad]
            optimizer = torch.optim.AdamW(trainable, lr=1e-4, foreach=False)
            x = torch.randint(cfg.vocab_size, (micro_batch_size, seq_len))
            autocast = strategy == "ddp" and not lora and base_dtype != torch.float32

            def step():
                with torch.autocast("cpu", dtype=base_dtype, enabled=autocast):
                    loss = causal_lm_loss(model, x, x)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)

            step()                                       # the first step allocates the optimizer's state
            if strategy == "fsdp":
                tracker = FSDPMemTracker(model, optimizer)
            else:
                tracker = MemTracker()
                tracker.track_external(model, optimizer)
            skip_frozen(tracker, model)
            with tracker:
                step()
            out = tracker_kinds(tracker.get_tracker_snapshot("peak"), fold={"comm_buffers": "temporaries"})
        bucket = 4 * n_trainable if strategy == "ddp" else 0      # DDP's fp32 bucket copy, allocated in C++
        out["buffers"] += bucket
        out["total"] += bucket
        out.update(params=params, trainable=n_trainable,
                   foreach_extra=4 * n_trainable // (world_size if strategy == "fsdp" else 1))
        return out
    finally:
        dist.destroy_process_group()


# -- the training loop of lesson 16's checkpoint cells (scripts/finetune.py's train_step adds accumulation) -------
def shard_lora(model, mp_policy=None):
    """FSDP2 over a LoRA model: ``fully_shard`` each decoder layer, then the root (embeddings, final norm, head).
    Frozen and trainable parameters are sharded alike; only the trainable ones get gradients to reduce-scatter."""
    from torch.distributed.fsdp import fully_shard

    kwargs = {} if mp_policy is None else {"mp_policy": mp_policy}
    for layer in model.model.layers:
        fully_shard(layer, **kwargs)
    return fully_shard(model, **kwargs)


def train_steps(model, optimizer, data, start, stop, global_batch_size=16, block_size=64, on_step=None):
    """Steps ``start`` .. ``stop - 1`` of data-parallel training: rank r takes its 1/W slice of each step's global
    batch (``finetune_batch``, so the data depend only on the step: any world size sees the same global batch),
    forward, backward, step. Returns the losses averaged over the ranks. ``on_step(step, loss)`` after each step."""
    import torch.distributed as dist

    rank, world_size = dist.get_rank(), dist.get_world_size()
    if global_batch_size % world_size:
        raise ValueError(f"the global batch of {global_batch_size} does not split over {world_size} ranks: "
                         "pick a multiple of the world size")
    per_rank = global_batch_size // world_size
    losses = []
    for step in range(start, stop):
        x, y = finetune_batch(data, step, rank, per_rank, global_batch_size, block_size=block_size)
        loss = causal_lm_loss(model, x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss = loss.detach()
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        losses.append(loss.item())
        if on_step is not None:
            on_step(step, losses[-1])
    return losses
