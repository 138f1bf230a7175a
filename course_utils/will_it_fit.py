"""Will it fit on my cards? The reader's own model and cards, one training step measured at true size.

Introduced for 16_fine_tuning_small_cards's FAQ (scripts/will_it_fit.py is its command line). Lessons 14 and 16
measure the article's examples with ``course_utils.true_size``; ``will_it_fit`` does the same for any Llama-family
decoder (Llama 2/3, Mistral, Qwen2/2.5: a named shape, a ``config.json`` or a hub name) on the cards the reader
names, picks a plan and prints the scripts/finetune.py command that runs it::

    plan = will_it_fit("llama-2-7b", "2x24GiB", method="lora")
    print(plan.report())

Every row is a setting of scripts/finetune.py, measured as the script runs it (``_jobs``): ``--strategy ddp``,
``zero2`` (``course_utils.zero.ShardedOptimizer(reduce_scatter=True)``) or ``fsdp``; full fine-tuning in fp32
weights, gradients and AdamW moments, under ``mixed`` with bf16 autocast on a replica and FSDP2's bf16 compute
policy; LoRA over a bf16 (``mixed``) or fp32 base with fp32 adapters; AdamW as the script builds it, which on a GPU
is ``foreach=True`` (``FOREACH``). The printed command keeps the measured micro-batch and reaches the reader's global
batch (``global_batch``, default 32 sequences) with accumulation steps.

How each row is found (the ``how`` column says which):

- **measured**: one AdamW step with fake tensors on a fake world of W ranks (``true_size.measure_step``): FSDP2 rows
  at the true depth, one measurement per world size and checkpoint setting.
- **measured (blocks 2, 3)**: a replica (one whole model per rank, DDP's) measured at 2 and 3 decoder blocks and
  extended to the true depth. Every block is the same, and a replica's peak in each phase, by kind, grows by the
  same bytes per block: tests/test_will_it_fit.py checks the extension against a measurement at the true depth,
  to the byte. (FSDP2's peak moment changes with the depth at small depths, so it is measured whole.)
- **+ bucket**: DDP's copy of the gradients (``gradient_as_bucket_view=False``), which the replica, measured without
  DDP, never allocated (under DDP the meter counts it: tests/test_memory.py), counted at the gradients' dtype, from
  the measured parameter count.
- **counted on a measured replica**: full fine-tuning's DDP and ZeRO-2 rows, phase by phase from
  ``true_size.replica_phases`` on a replica measured in the script's precision (4 + 4 + 8 bytes per parameter;
  DDP's bucket; ZeRO-2's shards).
- **counted: needs a GPU**: QLoRA's 4-bit base (NF4 with double quantisation, 4.127 bits per weight), counted from
  the bf16-base LoRA row as lesson 16 counts it: bitsandbytes has no CPU kernels to measure. The parameters that
  are not 4-bit (embedding, ``lm_head``, norms, biases) count at fp32's 4 B: the printed recipe's
  ``prepare_model_for_kbit_training`` casts them to fp32 (``qlora_base_bytes``).

A row fits when its peak is at most ``USABLE`` (85%) of the card: the rest is for what no tensor meter sees (CUDA
context, the allocator's cache and fragmentation, NCCL's buffers), as lessons 14 and 16 keep it. The cheapest plan
is the first row that fits in this order: no activation checkpointing before checkpointing (a third more compute),
then DDP, ZeRO-2, FSDP2 (more communication each). When nothing fits, the report names the cheapest change
that fits the same cards (micro-batch 1 with accumulation, then LoRA instead of full fine-tuning, then QLoRA instead
of LoRA: "Full fine-tuning does not fit ...; LoRA ... does"), and the fewest cards that fit: 2 ... 8, then whole
nodes of 8, up to ``max_cards``.

Each distinct step is measured once: with ``cache`` (scripts/will_it_fit.py: ``default_cache_dir()``, unless
``--no-cache``) a later run reads it back, and a plan that measured in a minute answers in seconds.
"""
import dataclasses
import functools
import json
import os
import re
import sys
import time
from pathlib import Path

import torch

from course_utils.true_size import (ARTICLE_14GB, GiB, LLAMA2_7B, MISTRAL_7B, TORCH_GPU_FOREACH, LlamaShape,
                                    measure_step, replica_phases)

__all__ = ["MODELS", "CARDS", "USABLE", "SUPPORTED", "resolve_model", "shape_from_config", "parse_cards",
           "will_it_fit", "Plan", "Row", "measure_replica", "extend_by_blocks", "tiny_like", "check_plan",
           "WillItFitError", "check_inputs", "qlora_counts", "qlora_base_bytes", "card_note", "CARD_SIZES",
           "DEFAULT_SIZE", "MAX_CARDS", "GLOBAL_BATCH", "default_cache_dir", "SCRIPT"]

USABLE = 0.85
SUPPORTED = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
NF4_BITS = 4.127               # NF4 + double quantisation (Dettmers et al. 2023), as lesson 16 counts it

# Published shapes (each config.json on the hub) and the hub name scripts/finetune.py loads them from.
LLAMA3_8B = LlamaShape("Llama-3-8B", vocab_size=128256, d_model=4096, n_layer=32, d_ff=14336, n_head=32, n_kv_head=8)
QWEN25_05B = LlamaShape("Qwen2.5-0.5B", vocab_size=151936, d_model=896, n_layer=24, d_ff=4864, n_head=14, n_kv_head=2,
                        qkv_bias=True, tie_embeddings=True)
QWEN25_15B = LlamaShape("Qwen2.5-1.5B", vocab_size=151936, d_model=1536, n_layer=28, d_ff=8960, n_head=12,
                        n_kv_head=2, qkv_bias=True, tie_embeddings=True)
QWEN25_7B = LlamaShape("Qwen2.5-7B", vocab_size=152064, d_model=3584, n_layer=28, d_ff=18944, n_head=28, n_kv_head=4,
                       qkv_bias=True)
MODELS = {
    "llama-2-7b": (LLAMA2_7B, "meta-llama/Llama-2-7b-hf"),
    "llama-3-8b": (LLAMA3_8B, "meta-llama/Meta-Llama-3-8B"),
    "mistral-7b": (MISTRAL_7B, "mistralai/Mistral-7B-v0.1"),
    "qwen2.5-0.5b": (QWEN25_05B, "Qwen/Qwen2.5-0.5B"),
    "qwen2.5-1.5b": (QWEN25_15B, "Qwen/Qwen2.5-1.5B"),
    "qwen2.5-7b": (QWEN25_7B, "Qwen/Qwen2.5-7B"),
    "article-14gb": (ARTICLE_14GB, None),          # the article's model: a shape, no published weights
}
# The strategies scripts/finetune.py runs (--strategy ddp, zero2, fsdp), cheapest first: the only ones a plan names.
STRATEGY_ORDER = ("DDP", "ZeRO-2", "FSDP2")
SCRIPT = "scripts/finetune.py"
SCRIPT_STRATEGY = {"DDP": "ddp", "ZeRO-2": "zero2", "FSDP2": "fsdp"}
GLOBAL_BATCH = 32        # sequences per optimizer step when the reader names none (--global-batch-size)
# AdamW as scripts/finetune.py builds it (no foreach/fused argument) runs foreach=True on a GPU: every step is
# measured with that setting (true_size.TORCH_GPU_FOREACH), its list of temporaries included.
FOREACH = TORCH_GPU_FOREACH
NODE = 8                 # cards in a node: the search for more cards tries 2 ... 8, then whole nodes of 8
MAX_CARDS = 64           # the default upper bound of that search (8 nodes of 8); max_cards (--max-cards) raises it
MAX_CARDS_LIMIT = 1024   # ... up to this
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")   # every decoder linear


class WillItFitError(ValueError):
    """Bad input: the message says what was wrong and what to give instead."""


# -- the model ----------------------------------------------------------------------------------------------------
def _key(name):
    return re.sub(r"[\s_]+", "-", name.strip().lower())


def shape_from_config(config, name="config.json"):
    """A ``LlamaShape`` from a transformers ``config.json`` (a dict) of a Llama, Mistral or Qwen2 decoder."""
    archs = config.get("architectures") or []
    arch = archs[0] if archs else {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                                   "qwen2": "Qwen2ForCausalLM"}.get(config.get("model_type"))
    if arch not in SUPPORTED:
        raise WillItFitError(f"{name}: architecture {arch or config.get('model_type')!r} is not one the meter "
                             f"builds; supported: {', '.join(SUPPORTED)}")
    if config.get("attention_bias") or config.get("mlp_bias"):
        raise WillItFitError(f"{name}: attention_bias/mlp_bias are set; the meter builds the published Llama, "
                             f"Mistral and Qwen2 layers ({', '.join(SUPPORTED)}) without them")
    try:
        d, heads = config["hidden_size"], config["num_attention_heads"]
        head_dim = config.get("head_dim")
        return LlamaShape(Path(str(name)).parent.name or str(name) if str(name).endswith(".json") else str(name),
                          vocab_size=config["vocab_size"], d_model=d, n_layer=config["num_hidden_layers"],
                          d_ff=config["intermediate_size"], n_head=heads,
                          n_kv_head=config.get("num_key_value_heads") or heads,
                          qkv_bias=arch == "Qwen2ForCausalLM",
                          tie_embeddings=bool(config.get("tie_word_embeddings", False)),
                          head_dim=head_dim if head_dim and head_dim != d // heads else None)
    except KeyError as exc:
        raise WillItFitError(f"{name}: config.json has no {exc.args[0]!r}: is it a decoder's config?") from None


def _hub_config(repo_id):
    """config.json of a hub repository (or its unet/config.json), read from the local huggingface cache only:
    nothing here downloads."""
    from course_utils.model_zoo import _cached_config

    path = _cached_config(repo_id)
    if path is None:
        raise WillItFitError(f"{repo_id!r}: its config.json is not in the local huggingface cache, and will_it_fit "
                             f"downloads nothing: run `huggingface-cli download {repo_id} config.json` once, or "
                             "pass the path of a config.json")
    return path


def _read_config(path, name):
    try:
        config = json.loads(Path(path).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        where = f" (line {exc.lineno}, column {exc.colno}: {exc.msg})" if isinstance(exc, json.JSONDecodeError) else ""
        raise WillItFitError(f"{name}: not valid JSON{where}: give a transformers config.json, as the hub "
                             "has it") from None
    if not isinstance(config, dict):
        raise WillItFitError(f"{name}: a JSON {type(config).__name__}, not an object: give a transformers "
                             "config.json, as the hub has it")
    return config


def resolve_model(name):
    """``(LlamaShape, what --model of scripts/finetune.py loads or None)`` for a known name (``MODELS``, or
    the hub name of one: no download), a local ``config.json`` (or a folder holding one), or a hub name (its
    config.json only, fetched by huggingface_hub)."""
    key = _key(name)
    for known, (shape, hub) in MODELS.items():
        if key in (known, known.replace("-", "", 1)) or (hub and key == hub.lower()):
            return shape, hub
    from course_utils import model_zoo

    if key in model_zoo.UNETS or key.replace("sd", "sd-", 1) in model_zoo.UNETS:     # sd-1.5, sd15, sdxl, ...
        return _zoo(name)
    path = Path(name).expanduser()
    if path.is_dir():
        path = path / "config.json" if (path / "config.json").is_file() else path / "unet" / "config.json"
    if path.is_file():
        config = _read_config(path, str(path))
        folder = path.parent.parent if path.parent.name == "unet" else path.parent    # a pipeline's UNet: the pipeline
        return _shape_or_spec(config, str(path)), str(folder)
    if "/" in name and not path.suffix and len(name.split("/")) == 2:
        config_path = _hub_config(name)
        return _shape_or_spec(_read_config(config_path, name), name), name
    raise WillItFitError(f"unknown model {name!r}: give one of {', '.join(list(MODELS) + list(model_zoo.UNETS))}, a "
                         "config.json of a transformers causal LM or a diffusers UNet, or a hub name such as "
                         "Qwen/Qwen2.5-3B (read from the local huggingface cache)")


def _shape_or_spec(config, name):
    """A ``LlamaShape`` for the Llama family (the hand-written decoder: tests/test_model_zoo.py holds that it
    measures within 2% of transformers' own, per phase, and it measures faster), otherwise a
    ``model_zoo.ModelSpec``: any causal LM transformers builds, or a diffusers UNet."""
    try:
        return shape_from_config(config, name)
    except WillItFitError:
        from course_utils.model_zoo import ModelZooError, spec_from_config

        try:
            return spec_from_config(config, name, hub=name if "/" in name and not name.endswith(".json") else None)
        except ModelZooError as exc:
            raise WillItFitError(str(exc)) from None


def _zoo(name):
    from course_utils.model_zoo import ModelZooError, resolve_spec

    try:
        spec = resolve_spec(name)
    except ModelZooError as exc:
        raise WillItFitError(str(exc)) from None
    return spec, spec.hub


# -- the cards ----------------------------------------------------------------------------------------------------
# Every current NVIDIA consumer (GeForce RTX 20 to 50), workstation (RTX A and Ada) and data-centre card, with its
# memory as sold: "12 GB" is 12 GiB (nvidia-smi: 12288MiB). A name sold in more than one size lists its sizes; the
# bare name means DEFAULT_SIZE's one where the vendor launched and sells that one most (printed in the plan's card
# line), and is refused, asking for the size, where it does not (4060 Ti 8 and 16 GB, A100 40 and 80 GB, ...).
# tests/test_will_it_fit_cards.py holds every spelling below.
CARD_SIZES = {
    "RTX 2060": (6, 12), "RTX 2060 Super": (8,), "RTX 2070": (8,), "RTX 2070 Super": (8,), "RTX 2080": (8,),
    "RTX 2080 Super": (8,), "RTX 2080 Ti": (11,), "Titan RTX": (24,),
    "RTX 3050": (8, 6), "RTX 3060": (12, 8), "RTX 3060 Ti": (8,), "RTX 3070": (8,), "RTX 3070 Ti": (8,),
    "RTX 3080": (10, 12), "RTX 3080 Ti": (12,), "RTX 3090": (24,), "RTX 3090 Ti": (24,),
    "RTX 4060": (8,), "RTX 4060 Ti": (8, 16), "RTX 4070": (12,), "RTX 4070 Super": (12,), "RTX 4070 Ti": (12,),
    "RTX 4070 Ti Super": (16,), "RTX 4080": (16,), "RTX 4080 Super": (16,), "RTX 4090": (24,),
    "RTX 5060": (8,), "RTX 5060 Ti": (8, 16), "RTX 5070": (12,), "RTX 5070 Ti": (16,), "RTX 5080": (16,),
    "RTX 5090": (32,),
    "RTX A2000": (6, 12), "RTX A4000": (16,), "RTX A4500": (20,), "RTX A5000": (24,), "RTX A5500": (24,),
    "RTX A6000": (48,), "RTX 2000 Ada": (16,), "RTX 4000 Ada": (20,), "RTX 4500 Ada": (24,), "RTX 5000 Ada": (32,),
    "RTX 6000 Ada": (48,),
    "T4": (16,), "V100": (16, 32), "A10": (24,), "A10G": (24,), "A30": (24,), "A40": (48,), "A100": (40, 80),
    "L4": (24,), "L40": (48,), "L40S": (48,), "H100": (80,), "H200": (141,),
}
# The size a bare name means: the launch model, the one sold most (the other size is a later, rarer variant).
DEFAULT_SIZE = {"RTX 2060": 6, "RTX 3050": 8, "RTX 3060": 12, "RTX 3080": 10}
# One entry per card and size: a name sold in one size as it is, the others with their size ("RTX 3060 12GB").
CARDS = {(name if len(sizes) == 1 else f"{name} {gib}GB"): gib for name, sizes in CARD_SIZES.items()
         for gib in sizes}
MAX_CARD_GIB = 1024          # a card's memory given as a number: more than 0, at most this (no card has more)


def _card_key(name):
    """Lower case, letters and digits only, without the vendor's words and the size's unit: "GeForce RTX 3060 12 GB",
    "rtx3060-12gb" and "3060 12" all read "306012"."""
    key = re.sub(r"[^a-z0-9]", "", name.lower())
    key = re.sub(r"^(nvidia)?(geforce)?(tesla)?(quadro)?(rtx)?", "", key)
    return re.sub(r"(?<=\d)(gib|gb)$", "", key)         # not a bare "g": the A10G is a card


def _card_lookup():
    table = {}
    for name, sizes in CARD_SIZES.items():
        for gib in sizes:
            label = name if len(sizes) == 1 else f"{name} {gib}GB"
            table[_card_key(label)] = (gib, label, "")
            table[_card_key(f"{name}-{gib}")] = (gib, label, "")     # "A100-40", "A100-80": the older spelling
        if name in DEFAULT_SIZE:
            gib = DEFAULT_SIZE[name]
            other = " or ".join(f"{name} {s}GB" for s in sizes if s != gib)
            table[_card_key(name)] = (gib, f"{name} {gib}GB", f"{name!r} read as the {gib} GB model, the one "
                                                              f"sold most: write {other} for the other")
    return table


_CARD_TABLE = _card_lookup()


def card_note(text):
    """What a bare name sold in two sizes was read as ("'RTX 3060' read as the 12 GB model, ..."), or ""."""
    m = re.fullmatch(r"\s*(?:[+-]?\d+\s*[x×*]\s*)?(.*?)\s*", str(text), flags=re.IGNORECASE)
    entry = _CARD_TABLE.get(_card_key(m.group(1))) if m else None
    return entry[2].lstrip("; ") if entry else ""


def parse_cards(text):
    """``(count, GiB per card, label)`` from ``"2x16GiB"``, ``"2x16"``, ``"8xA100-80"``, ``"RTX 4090"``,
    ``"2 x RTX 3060"``, ``"2xrtx3060-12gb"``, ... (``CARD_SIZES``). Introduced in 16_fine_tuning_small_cards."""
    m = re.fullmatch(r"\s*(?:([+-]?\d+)\s*[x×*]\s*)?(.*?)\s*", str(text), flags=re.IGNORECASE)
    if not m or not m.group(2):
        raise WillItFitError(f"--cards {text!r}: give a count and a card, as in 2x16GiB or '2 x RTX 3060'")
    count = int(m.group(1)) if m.group(1) else 1
    rest = m.group(2)
    if count < 1:
        raise WillItFitError(f"--cards {text!r}: the count must be at least 1, as in 2x16GiB")
    key = _card_key(rest)
    if key in _CARD_TABLE:
        gib, label, _ = _CARD_TABLE[key]
        return count, float(gib), f"{count} x {label} ({gib} GiB)"
    size = re.fullmatch(r"([+-]?\d+(?:\.\d+)?)\s*(?:gib|gb|g)?", rest.strip().lower())
    if size:
        gib = float(size.group(1))
        if not 0 < gib <= MAX_CARD_GIB:
            raise WillItFitError(f"--cards {text!r}: a card's memory must be more than 0 and at most "
                                 f"{MAX_CARD_GIB} GiB, as in 2x16GiB")
        return count, gib, f"{count} x {gib:g} GiB"
    sized = {n: s for n, s in CARD_SIZES.items() if len(s) > 1 and _card_key(n) == key}
    if sized:
        name, sizes = next(iter(sized.items()))
        raise WillItFitError(f"--cards {text!r}: the {name} is sold with " + " and ".join(f"{s}" for s in sizes)
                             + f" GiB: write {' or '.join(f'{name} {s}GB' for s in sizes)}")
    import difflib

    names = {_card_key(n): n for n in CARDS}
    close = [names[k] for k in difflib.get_close_matches(key, names, n=4, cutoff=0.5)]
    raise WillItFitError(f"--cards {text!r}: unknown card {rest!r}"
                         + (f"; closest: {', '.join(close)}" if close else "")
                         + "; or give the memory, as in 2x16GiB (every known card: course_utils.will_it_fit.CARDS)")


# -- measuring ----------------------------------------------------------------------------------------------------
def _lora(model, targets, r, base_dtype):
    from course_utils.model_zoo import add_lora_by_suffix

    # the base frozen in base_dtype; adapters and their AdamW state in fp32, as scripts/finetune.py
    add_lora_by_suffix(model, targets, r=r, alpha=2 * r, base_dtype=base_dtype)


KINDS = ("parameters", "gradients", "optimizer_state", "activations", "temporaries", "comm_buffers", "total")
DEPTHS = (2, 3)


def extend_by_blocks(a, b, blocks):
    """``a`` measured at L decoder blocks and ``b`` at L + 1, extended by ``blocks`` more blocks than ``a``:
    ``a + blocks * (b - a)``, key by key through nested dicts of bytes (or counts)."""
    if isinstance(a, dict):
        return {k: extend_by_blocks(a[k], b[k], blocks) for k in a}
    return a + blocks * (b - a)


def measure_replica(shape, **kw):
    """``measure_step(shape, strategy="replica", **kw)``, measured at 2 and 3 blocks and extended to
    ``shape.n_layer`` (each kind of each phase grows by the same bytes per block; see the module docstring)."""
    measure, unet = _measurer(shape), getattr(shape, "kind", None) == "unet"
    if shape.n_layer <= DEPTHS[-1] or unet:      # a UNet's blocks differ: measured whole
        return dict(measure(shape, strategy="replica", **kw), how="measured")
    t0 = time.perf_counter()
    at = shape.with_layers if hasattr(shape, "with_layers") else lambda L: dataclasses.replace(shape, n_layer=L)
    a, b = (measure(at(L), strategy="replica", **kw) for L in DEPTHS)
    extra = shape.n_layer - DEPTHS[0]
    out = {phase: extend_by_blocks({k: a[phase][k] for k in KINDS}, {k: b[phase][k] for k in KINDS}, extra)
           for phase in ("forward", "backward", "step")}
    out.update(n_params=shape.n_params, n_trainable=extend_by_blocks(a["n_trainable"], b["n_trainable"], extra),
               param_dtype=a["param_dtype"], autocast=a["autocast"], foreach=a["foreach"],
               seconds=time.perf_counter() - t0,
               how=f"measured (blocks {DEPTHS[0]}, {DEPTHS[1]})")
    return out


def _measurer(shape):
    """``true_size.measure_step`` for a ``LlamaShape``; ``model_zoo.measure_model_step`` for any other model."""
    if isinstance(shape, LlamaShape):
        return measure_step
    from course_utils.model_zoo import measure_model_step

    return measure_model_step


def _job(kind, shape, kw):
    torch.set_num_threads(1)
    if kind == "replica":
        return measure_replica(shape, **kw)
    return dict(_measurer(shape)(shape, strategy="fsdp2", **kw), how="measured")


# -- the cache: each distinct fake-tensor step measured once --------------------------------------------------------
def default_cache_dir():
    """Where scripts/will_it_fit.py keeps its measurements: ``$XDG_CACHE_HOME/micro-ddp/will_it_fit`` (default
    ``~/.cache/...``)."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "micro-ddp" / "will_it_fit"


# The files whose code decides a measurement's bytes: an entry is keyed by their text, so an edit measures again.
_MEASURING_CODE = ("true_size.py", "memory.py", "lora.py", "will_it_fit.py", "model_zoo.py")


@functools.lru_cache(maxsize=1)
def _code_version():
    import hashlib

    digest = hashlib.sha256(torch.__version__.encode())
    for name in _MEASURING_CODE:
        digest.update((Path(__file__).parent / name).read_bytes())
    return digest.hexdigest()[:16]


def _describe(value):
    """A JSON-able description of a job's argument (``modify``: the function and its arguments)."""
    if isinstance(value, functools.partial):
        return {"fn": value.func.__qualname__, "args": [_describe(a) for a in value.args],
                "keywords": {k: _describe(v) for k, v in sorted(value.keywords.items())}}
    if callable(value):
        return {"fn": value.__qualname__}
    if isinstance(value, (tuple, list)):
        return [_describe(v) for v in value]
    if isinstance(value, torch.dtype):
        return str(value)
    return value


class Cache:
    """One JSON file per distinct fake-tensor step in ``directory``, keyed by what decides its bytes: the model's
    shape (not its name), the kind of step (replica or FSDP2), the world size, the method and precision (``modify``,
    autocast, the mixed-precision policy), checkpointing, sequence, micro-batch, AdamW's setting, and the code and
    torch version that measure it. tests/test_will_it_fit_cache.py holds that a hit returns the measurement."""

    def __init__(self, directory):
        self.dir = Path(directory).expanduser()
        self.hits = self.total = 0
        self.cold_seconds = 0.0

    def key(self, kind, shape, kw):
        import hashlib

        what = {"kind": kind, "shape": {k: v for k, v in dataclasses.asdict(shape).items() if k != "name"},
                "kw": {k: _describe(v) for k, v in sorted(kw.items())}, "code": _code_version()}
        return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:32]

    def get(self, key):
        try:
            result = json.loads((self.dir / f"{key}.json").read_text())
        except (OSError, ValueError):
            return None                 # absent, unreadable or cut short: measured again
        if isinstance(result.get("param_dtype"), str):
            result["param_dtype"] = getattr(torch, result["param_dtype"].removeprefix("torch."))
        return result

    def put(self, key, result):
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            tmp = self.dir / f"{key}.{os.getpid()}.tmp"
            tmp.write_text(json.dumps(result, default=str))
            os.replace(tmp, self.dir / f"{key}.json")
        except OSError:
            pass                        # a read-only cache folder: the plan is still right, only not kept

    def summary(self):
        return {"dir": str(self.dir), "hits": self.hits, "total": self.total, "cold_seconds": self.cold_seconds}


def _run_jobs(jobs, workers, say, cache=None):
    """Run ``{name: (kind, shape, kwargs)}``, in ``workers`` processes when more than one; returns ``{name: result}``.
    ``say(done, total, name)`` reports progress. With a ``Cache``, a step measured before is read, not measured."""
    if cache is None:
        return _measure_jobs(jobs, workers, say)
    keys = {name: cache.key(*job) for name, job in jobs.items()}
    out = {}
    for name, key in keys.items():
        hit = cache.get(key)
        if hit is not None:
            out[name] = hit
    missing = {name: job for name, job in jobs.items() if name not in out}
    fresh = _measure_jobs(missing, workers, say) if missing else {}
    for name, result in fresh.items():
        cache.put(keys[name], result)
    cache.hits += len(out)
    cache.total += len(jobs)
    out.update(fresh)
    cache.cold_seconds += sum(r["seconds"] for r in out.values()) / max(1, min(workers, len(jobs)))
    return {name: out[name] for name in jobs}


def _measure_jobs(jobs, workers, say):
    from course_utils import progress

    out, names = {}, list(jobs)
    if workers <= 1 or len(jobs) <= 1:
        for i, name in enumerate(progress(names, desc="fake-tensor steps")):
            say(i, len(names), name)
            out[name] = _job(*jobs[name])
        say(len(names), len(names), None)
        return out
    import concurrent.futures as cf
    import multiprocessing

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "course_utils.will_it_fit"])  # each worker forked with torch imported
    with cf.ProcessPoolExecutor(workers, mp_context=ctx) as pool:
        futures = {pool.submit(_job, *jobs[name]): name for name in names}
        say(0, len(names), ", ".join(names[:workers]))
        for i, fut in enumerate(progress(cf.as_completed(futures), total=len(names), desc="fake-tensor steps")):
            out[futures[fut]] = fut.result()
            running = [n for f, n in futures.items() if not f.done()][:workers]
            say(i + 1, len(names), ", ".join(running) or None)
    return out


# -- rows and plans -----------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Row:
    method: str            # "full", "lora", "qlora"
    precision: str         # "mixed", "fp32", "bf16 base", "fp32 base", "4-bit base"
    strategy: str          # "DDP", "ZeRO-2", "FSDP2" (STRATEGY_ORDER)
    checkpoint: bool
    world_size: int
    phases: dict           # {"forward": bytes, "backward": ..., "step": ...}, or None when counted as a whole
    peak: float
    how: str
    same_training: bool = True
    micro_batch: int = None  # sequences per card per forward, when not the plan's (the cheaper change: 1)

    def fits(self, card_bytes):
        return self.peak <= USABLE * card_bytes

    def verdict(self, card_bytes):
        if self.fits(card_bytes):
            return "fits" if self.same_training else "fits (a different training)"
        return "no: inside the card, not the margin" if self.peak <= card_bytes else "no: over the card"

    @property
    def label(self):
        return f"{self.strategy}{' + ckpt' if self.checkpoint else ''}"


def _cost(row):
    return (row.checkpoint, STRATEGY_ORDER.index(row.strategy))


def _precisions(method, precision):
    if method == "full":
        return {"mixed": "mixed", "fp32": "fp32"}[precision]
    return {"mixed": "bf16 base", "fp32": "fp32 base"}[precision]


def _jobs(shape, method, W, seq_len, micro_batch, lora_r, targets, precision, checkpoints=(False, True),
          replicas=True):
    """The fake-tensor steps the rows of ``method`` on ``W`` cards are made of, each as scripts/finetune.py runs it:
    full fine-tuning keeps fp32 weights, gradients and AdamW moments, with bf16 autocast under ``mixed`` on a
    replica (DDP, ZeRO-2) and FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``; LoRA a bf16
    base under ``mixed`` (no autocast), fp32 adapters. AdamW with ``FOREACH``, as it runs on a GPU."""
    common = dict(seq_len=seq_len, micro_batch_size=micro_batch, foreach=FOREACH)
    jobs = {}
    for ckpt in checkpoints:
        c = " + ckpt" if ckpt else ""
        if method == "full":
            if replicas:
                jobs[f"replica{c}"] = ("replica", shape, dict(common, checkpoint=ckpt,
                                                              mixed_precision=precision == "mixed"))
            if W > 1:
                jobs[f"FSDP2 W={W}{c}"] = ("fsdp2", shape, dict(common, world_size=W, checkpoint=ckpt,
                                                               mixed_precision=precision == "mixed"))
        else:
            base = torch.bfloat16 if precision == "mixed" else torch.float32
            modify = functools.partial(_lora, targets=tuple(targets), r=lora_r, base_dtype=base)
            if replicas:
                jobs[f"replica{c}"] = ("replica", shape, dict(common, checkpoint=ckpt, modify=modify))
            if W > 1:
                jobs[f"FSDP2 W={W}{c}"] = ("fsdp2", shape, dict(common, world_size=W, checkpoint=ckpt,
                                                               modify=modify, mixed_precision=precision == "mixed"))
    return jobs


def _phases(r, extra=0):
    return {p: r[p]["total"] + extra for p in ("forward", "backward", "step")}


def qlora_counts(shape):
    """``(4-bit, other)``: the base's parameters bitsandbytes stores in 4 bits (the weight of every decoder linear,
    ``q_proj`` ... ``down_proj``) and the rest (the embedding, ``lm_head``, which transformers keeps unquantised, the
    RMSNorm weights, Qwen2's q/k/v biases). Any other model (``model_zoo.ModelSpec``): ``model_zoo.qlora_counts``,
    every linear but the head."""
    if not isinstance(shape, LlamaShape):
        from course_utils import model_zoo

        return model_zoo.qlora_counts(shape)
    linears = shape.n_params - (1 if shape.tie_embeddings else 2) * shape.vocab_size * shape.d_model \
        - (2 * shape.n_layer + 1) * shape.d_model
    if shape.qkv_bias:
        linears -= shape.n_layer * (shape.n_head + 2 * shape.n_kv_head) * shape.dims_per_head
    return linears, shape.n_params - linears


def qlora_base_bytes(shape):
    """The frozen base's bytes as the printed QLoRA recipe keeps them: 4-bit linears (NF4 with double quantisation,
    ``NF4_BITS`` per weight) and every other parameter in fp32, 4 B, since peft's ``prepare_model_for_kbit_training``
    casts every parameter that is not 4-bit to fp32 (peft/utils/other.py). tests/test_will_it_fit_qlora.py pins it
    for Llama-3-8B."""
    four_bit, other = qlora_counts(shape)
    return four_bit * NF4_BITS / 8 + 4 * other


def _rows(shape, method, W, results, precision):
    rows = []
    for ckpt in (False, True):
        c = " + ckpt" if ckpt else ""
        rep = results.get(f"replica{c}")
        fsdp = results.get(f"FSDP2 W={W}{c}")
        if method == "full":
            if rep is not None:
                prec = "mixed" if precision == "mixed" else "fp32"
                # fp32 weights, gradients and moments (4 + 4 + 8 B) in both precisions: "mixed" is autocast's bf16
                # compute over them, measured in the replica's activations and temporaries
                # phase by phase (replica_phases), the row's peak the largest phase: never maxima of phases summed
                counted = replica_phases(rep, W, mixed_precision=False, foreach=FOREACH)
                bucket = 4 * rep["n_trainable"] if W == 1 else 0     # one card: nothing to all-reduce, no bucket
                for name in (("DDP", "ZeRO-2") if W > 1 else ("DDP",)):
                    ph = {p: b - bucket for p, b in counted[name].items()}
                    rows.append(Row("full", prec, name, ckpt, W, ph, max(ph.values()), "counted on a measured replica"))
            if fsdp is not None:
                ph = _phases(fsdp)
                rows.append(Row("full", "mixed" if precision == "mixed" else "fp32", "FSDP2", ckpt, W, ph,
                                max(ph.values()), "measured"))
        else:
            prec = _precisions("lora", precision)
            if rep is not None:
                bucket = 4 * rep["n_trainable"] if W > 1 else 0        # fp32 adapters' gradients
                ph = _phases(rep, bucket)
                rows.append(Row("lora", prec, "DDP", ckpt, W, ph, max(ph.values()),
                                rep["how"] + (" + bucket" if bucket else "")))
                if method == "qlora":     # the measured base's bytes replaced by the 4-bit recipe's
                    shift = qlora_base_bytes(shape) - shape.n_params * (2 if precision == "mixed" else 4)
                    ph4 = {p: b + shift for p, b in ph.items()}
                    rows.append(Row("qlora", "4-bit base", "DDP", ckpt, W, ph4, max(ph4.values()),
                                    "counted: needs a GPU"))
            if fsdp is not None:
                ph = _phases(fsdp)
                rows.append(Row("lora", prec, "FSDP2", ckpt, W, ph, max(ph.values()), "measured"))
    return rows


@dataclasses.dataclass
class Plan:
    model: str
    shape: LlamaShape
    source: str
    method: str
    cards: int
    card_gib: float
    card_label: str
    seq_len: int
    micro_batch: int
    lora_r: int
    targets: tuple
    precision: str
    rows: list
    chosen: Row = None
    smallest: Row = None     # when nothing fits on ``cards``: the plan on the fewest cards that fits
    seconds: float = 0.0
    results: dict = None     # the measurements the rows were made from, by job name
    max_cards: int = MAX_CARDS   # the bound of the search for more cards
    card_note: str = ""      # what a bare card name sold in two sizes was read as (``card_note``)
    cheaper: tuple = None    # when nothing fits: (the cheapest change that fits these cards, in words; its row)
    global_batch: int = GLOBAL_BATCH   # sequences per optimizer step, the reader's wish: micro-batch x accum x W
    cache: dict = None       # {"dir", "hits", "total", "cold_seconds"} when the measurements went through a cache

    @property
    def card_bytes(self):
        return self.card_gib * GiB

    def pick(self, card_gib):
        """The row these measurements choose on as many cards of ``card_gib`` GiB each (``chosen`` there), or None:
        the peaks do not depend on the card, so one plan answers for every card size."""
        return _pick(self.rows, card_gib * GiB)

    def batches(self, row):
        """``(micro-batch, accumulation steps, global batch)`` of ``row``: the micro-batch it was measured at, and as
        many accumulation steps as reach the reader's global batch on its cards (rounded up to a whole step)."""
        micro = row.micro_batch or self.micro_batch
        accum = -(-self.global_batch // (micro * row.world_size))
        return micro, accum, micro * accum * row.world_size

    def command(self, row=None):
        """The command line that runs ``row`` (default: the chosen plan) as it was measured, and a note on it."""
        row = row or self.chosen or self.smallest
        if row is None:
            return None, "nothing fits: no command"
        W = row.world_size
        micro, accum, glob = self.batches(row)
        if getattr(self.shape, "kind", None) == "unet":
            return self._unet_command(row, micro, accum, glob)
        model = self.source or "PATH/TO/YOUR/CHECKPOINT"
        words = ["torchrun", "--standalone", f"--nproc-per-node={W}", SCRIPT, "--model", model,
                 "--method", row.method, "--strategy", SCRIPT_STRATEGY[row.strategy],
                 "--precision", self.precision]
        if row.method != "full":
            words += ["--lora-r", str(self.lora_r), "--targets", ",".join(self.targets)]
        words += ["--seq-len", str(self.seq_len), "--micro-batch-size", str(micro), "--accum-steps", str(accum),
                  "--global-batch-size", str(glob)]
        if row.checkpoint:
            words.append("--checkpointing")
        note = (f"{micro} sequence{'s' if micro > 1 else ''} per card per forward, {accum} accumulation "
                f"step{'s' if accum > 1 else ''}: a global batch of {glob} sequences"
                + (f" (your {self.global_batch}, rounded up to a multiple of micro-batch x cards)"
                   if glob != self.global_batch else "")
                + "; AdamW as the script builds it (foreach on a GPU), as measured")
        if row.method == "qlora":
            note += "; QLoRA needs a GPU (bitsandbytes' 4-bit kernels)"
        if not self.source:
            note += "; the article's model has no published weights: point --model at a checkpoint of that shape"
        return " ".join(words), note

    def _unet_command(self, row, micro, accum, glob):
        """A UNet's plan as diffusers' example script runs it (the course ships no UNet trainer but lesson 18's)."""
        from course_utils.diffusion import diffusers_command
        from course_utils.model_zoo import UNET_LORA_TARGETS, native_resolution

        if row.method == "qlora":
            return None, ("no diffusers script loads a 4-bit UNet (and bitsandbytes needs a GPU): LoRA over a bf16 "
                          "base is the nearest script")
        cmd = diffusers_command(self.source, row.strategy, row.checkpoint, row.world_size, micro,
                                resolution=native_resolution(self.shape),
                                sdxl=self.shape.config.get("addition_embed_type") == "text_time",
                                lora=row.method == "lora", lora_rank=self.lora_r, accum_steps=accum)
        note = (f"diffusers' examples/text_to_image script under accelerate (lesson 18), {micro} image"
                f"{'s' if micro > 1 else ''} per card per forward, {accum} accumulation step{'s' if accum > 1 else ''}:"
                f" a global batch of {glob}; its LoRA adapts {','.join(UNET_LORA_TARGETS)}")
        if row.method == "full":
            note = note.rsplit(";", 1)[0]
        return cmd, note

    def what_fails(self):
        """The method in words, for "... does not fit"."""
        return {"full": "Full fine-tuning", "lora": f"LoRA over {'a bf16' if self.precision == 'mixed' else 'an fp32'} "
                                                    "base", "qlora": "QLoRA"}[self.method]

    def report(self):
        s, gib = self.shape, GiB
        card = self.card_bytes
        what = {"full": "full fine-tuning, AdamW", "lora": f"LoRA r = {self.lora_r} on {','.join(self.targets)}",
                "qlora": f"QLoRA (4-bit base), LoRA r = {self.lora_r} on {','.join(self.targets)}"}[self.method]
        unit = f"{self.seq_len} tokens"
        if getattr(s, "kind", None) == "unet":
            from course_utils.model_zoo import native_resolution

            unit = f"images of {native_resolution(s)} px"
        lines = [f"{s.name}: {s.n_params:,} parameters; {what}; micro-batch {self.micro_batch} x {unit} per card, "
                 f"a global batch of {self.global_batch} (accumulation makes up the rest); "
                 f"AdamW foreach, as on a GPU",
                 f"cards: {self.card_label}; a row fits when its peak is at most {USABLE:.0%} of a card "
                 f"({USABLE * self.card_gib:.2f} GiB)" + (f"; {self.card_note}" if self.card_note else ""),
                 "",
                 f"{'precision':11}{'strategy':15}{'W':>3}{'forward':>9}{'backward':>9}{'step':>9}{'peak':>8}"
                 f"{'headroom':>10}  {'verdict':38}how (GiB per card)"]
        for row in self.rows:
            if row.phases is None:
                ph = "".join(f"{'counted':>9}" for _ in range(3))
            else:
                ph = "".join(f"{row.phases[p] / gib:9.2f}" for p in ("forward", "backward", "step"))
            lines.append(f"{row.precision:11}{row.label:15}{row.world_size:3}{ph}{row.peak / gib:8.2f}"
                         f"{(USABLE * card - row.peak) / gib:+10.2f}  {row.verdict(card):38}{row.how}")
        lines.append("")
        if self.chosen is not None:
            r = self.chosen
            lines.append(f"Plan: {r.precision} {r.label} on {r.world_size} card{'s' if r.world_size > 1 else ''}: "
                         f"{r.peak / gib:.2f} GiB per card, {(USABLE * card - r.peak) / gib:.2f} GiB under "
                         f"{USABLE:.0%} of the card ({r.how}).")
        else:
            fails = (f"{self.what_fails()} does not fit {self.card_label} with the {USABLE:.0%} margin, with any "
                     "strategy above")
            if self.cheaper is not None:
                fails += f"; {self.cheaper[0]}"
            lines.append(fails + ".")
            if self.smallest is not None:
                r = self.smallest
                lines.append(f"Smallest card count that fits: {r.world_size} cards of {self.card_gib:g} GiB, with "
                             f"{r.precision} {r.label}: {r.peak / gib:.2f} GiB per card ({r.how}).")
            elif self.method == "qlora":
                lines.append("More cards do not help: QLoRA is counted with one whole model per card (DDP); lower "
                             "--seq-len or --micro-batch, or use larger cards.")
            else:
                lines.append(f"No card count up to {self.max_cards} fits (--max-cards): lower --seq-len or "
                             "--micro-batch, or use larger cards.")
        cmd, note = self.command(self.cheaper[1] if self.chosen is None and self.cheaper else None)
        if cmd:
            lines += ["Run it with:", "    " + cmd, f"  ({note})"]
        lines.append(self.timing())
        return "\n".join(lines)

    def timing(self):
        """One line: how long this took, and with a cache how long a cold run (nothing cached) takes."""
        line = f"Measured in {self.seconds:.1f} s"
        c = self.cache
        if not c:
            return line + "."
        if c["hits"] == 0:
            return line + f" (a cold run: every step measured; cached in {c['dir']} for the next run)."
        return line + (f" ({c['hits']} of {c['total']} steps from the cache in {c['dir']}; a cold run measures them "
                       f"in about {c['cold_seconds']:.0f} s on this machine; --no-cache measures again).")


def _pick(rows, card_bytes):
    fitting = [r for r in rows if r.same_training and r.fits(card_bytes)]
    if not fitting:
        return None
    qlora = [r for r in fitting if r.method == "qlora"]
    plain = [r for r in fitting if r.method != "qlora"]
    return min(plain or qlora, key=_cost)


def _stderr_line(done, total, name):
    text = f"measuring: {done}/{total} fake-tensor steps done" + (f" ({name} running)" if name else "")
    if sys.stderr.isatty():           # one line, rewritten in place
        print("\r" + text.ljust(72), end="\n" if name is None else "", file=sys.stderr, flush=True)
    else:
        print(text, file=sys.stderr, flush=True)


def will_it_fit(model, cards, method="lora", seq_len=512, micro_batch=1, lora_r=16, targets=None,
                precision="mixed", workers=None, say=_stderr_line, max_cards=MAX_CARDS, checkpoints=(False, True),
                global_batch=GLOBAL_BATCH, cache=None):
    """Measure ``model`` (see ``resolve_model``) on ``cards`` (see ``parse_cards``) and pick a plan; returns a
    ``Plan`` (``plan.report()``: the table, the plan and its command). ``method``: ``"full"``, ``"lora"`` or
    ``"qlora"``; ``precision``: ``"mixed"`` (bf16 compute: over fp32 weights and moments for full fine-tuning, over a
    bf16 base for LoRA) or ``"fp32"``; ``checkpoints``: which activation-checkpointing settings to try.
    ``workers``: processes that measure at once (default: 2 when the machine has
    them and the model is deep; the rows share every measurement they can). ``say(done, total, running)``: a
    progress line (default: on stderr; None: only the progress bar, as in a lesson). When nothing fits, FSDP2 (and
    the counted ZeRO rows) are tried on more cards, to find the fewest that fit: 2 ... 8, then whole nodes of 8, up
    to ``max_cards``. ``global_batch``: the sequences of one optimizer step, which the printed command reaches with
    accumulation. ``cache``: a folder (``default_cache_dir()``, as scripts/will_it_fit.py uses) where each distinct
    step is kept once measured (``Cache``), or None: measure every step. Every input is checked before anything is
    measured (``check_inputs``). ``model`` may also be any causal LM transformers builds or a diffusers UNet
    (``model_zoo``: ``sd-1.5``, ``sd-2.1``, ``sdxl``, a config.json), measured at its native resolution for a UNet;
    ``targets`` None: the model's default (``q_proj``, ``v_proj``; a UNet's attention projections)."""
    t0 = time.perf_counter()
    say = say or (lambda done, total, running: None)
    check_inputs(method=method, precision=precision, seq_len=seq_len, micro_batch=micro_batch, lora_r=lora_r,
                 targets=None, workers=workers, max_cards=max_cards, global_batch=global_batch)
    shape, source = (model, None) if isinstance(model, LlamaShape) or hasattr(model, "kind") else resolve_model(model)
    targets = _targets(shape, targets)
    count, gib, label = parse_cards(cards) if isinstance(cards, str) else _card_pair(cards)
    if count > max_cards:
        raise WillItFitError(f"--cards: {count} cards is more than the search's bound of {max_cards}: give at most "
                             f"{max_cards} cards, or raise --max-cards (up to {MAX_CARDS_LIMIT})")
    if workers is None:
        workers = 2 if (os.cpu_count() or 1) >= 2 and shape.n_layer > 8 else 1
    kw = dict(seq_len=seq_len, micro_batch=micro_batch, lora_r=lora_r, targets=targets, precision=precision)
    jobs = _jobs(shape, method, count, checkpoints=tuple(checkpoints), **kw)
    jobs = dict(sorted(jobs.items(), key=lambda kv: kv[1][0] == "replica"))   # the long FSDP2 steps first
    cache = None if cache is None else Cache(cache)
    results = _run_jobs(jobs, workers, say, cache)
    rows = _rows(shape, method, count, results, precision)
    plan = Plan(getattr(model, "name", model), shape, source, method, count, gib, label, seq_len, micro_batch,
                lora_r, targets, precision, rows, global_batch=global_batch)
    plan.results, plan.max_cards = results, max_cards
    plan.card_note = card_note(cards) if isinstance(cards, str) else ""
    plan.chosen = _pick(rows, plan.card_bytes)
    if plan.chosen is None:
        plan.cheaper = _cheaper(plan, kw, workers, say, cache)
        plan.smallest = _smallest(plan, results, kw, workers, say, max_cards, cache)
    plan.seconds = time.perf_counter() - t0
    plan.cache = cache.summary() if cache is not None else None
    return plan


def _cheaper(plan, kw, workers, say, cache=None):
    """When nothing fits ``plan``'s cards: the cheapest change that fits the same cards, in the order a reader would
    try (``plan.rows`` already hold checkpointing and the sharded strategies): micro-batch 1 with accumulation, LoRA
    instead of full fine-tuning, QLoRA instead of LoRA. ``(sentence, row)`` (the row whose command the report
    prints) or ``None``; more cards is ``_smallest``'s answer."""
    shape, card, W = plan.shape, plan.card_bytes, plan.cards
    on = "on the same cards"

    def best(method, results, precision=plan.precision):
        rows = [r for r in _rows(shape, "qlora" if method == "qlora" else method, W, results, precision)
                if r.method == method]
        return _pick(rows, card)

    if plan.micro_batch > 1:
        one = dict(kw, micro_batch=1)
        res = _run_jobs(_jobs(shape, plan.method, W, **one), workers, say, cache)
        row = _pick(_rows(shape, plan.method, W, res, plan.precision), card)
        if row is not None:
            row = dataclasses.replace(row, micro_batch=1)
            _, accum, glob = plan.batches(row)
            return (f"micro-batch 1 with {accum} accumulation steps (the same global batch of {glob}) does, {on}: "
                    f"{_row_words(row)}", row)
    lora_res = plan.results
    if plan.method == "full":
        lora_res = _run_jobs(_jobs(shape, "lora", W, **kw), workers, say, cache)
        row = best("lora", lora_res)
        if row is not None:
            return f"LoRA (r = {plan.lora_r} on {','.join(plan.targets)}) does, {on}: {_row_words(row)}", row
    if plan.method in ("full", "lora"):
        row = best("qlora", lora_res)
        if row is not None:
            return f"QLoRA (a 4-bit base) does, {on}: {_row_words(row)}", row
    return None


def _row_words(row):
    return (f"{row.precision} {row.label} on {row.world_size} card{'s' if row.world_size > 1 else ''}, "
            f"{row.peak / GiB:.2f} GiB per card ({row.how})")


def _positive_int(flag, value, what, example=""):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise WillItFitError(f"{flag} {value!r}: give {what}, a whole number of at least 1"
                             + (f" (as in {flag} {example})" if example else ""))


def _targets(shape, targets):
    """LoRA's targets for ``shape``: those given, checked against the model's linear layers, or its default."""
    if isinstance(shape, LlamaShape):
        targets = ("q_proj", "v_proj") if targets is None else tuple(targets)
        check_inputs(targets=targets)
        return targets
    from course_utils.model_zoo import default_targets, lora_target_names

    if targets is None:
        return default_targets(shape)
    targets = tuple(targets)
    check_inputs(targets=targets, allowed=tuple(sorted(lora_target_names(shape))), what=shape.name)
    return targets


def check_inputs(method="lora", precision="mixed", seq_len=512, micro_batch=1, lora_r=16,
                 targets=("q_proj", "v_proj"), workers=None, max_cards=MAX_CARDS, global_batch=GLOBAL_BATCH,
                 allowed=LORA_TARGETS, what="a Llama-family decoder"):
    """Refuse a bad input before anything is measured, in one line saying what to give (``WillItFitError``);
    tests/test_will_it_fit_inputs.py runs each through scripts/will_it_fit.py. ``targets`` None: checked once the
    model is known (``allowed``: its linear layers' names; ``what``: the model, in the message)."""
    if method not in ("full", "lora", "qlora"):
        raise WillItFitError(f"--method {method!r}: use full, lora or qlora")
    if precision not in ("mixed", "fp32"):
        raise WillItFitError(f"--precision {precision!r}: use mixed or fp32")
    _positive_int("--seq-len", seq_len, "the tokens per sequence", 512)
    _positive_int("--micro-batch", micro_batch, "the sequences per card per forward", 1)
    _positive_int("--global-batch-size", global_batch, "the sequences per optimizer step", GLOBAL_BATCH)
    if workers is not None:
        _positive_int("--workers", workers, "the processes measuring at once", 2)
    _positive_int("--max-cards", max_cards, f"the most cards to search, at most {MAX_CARDS_LIMIT}", MAX_CARDS)
    if max_cards > MAX_CARDS_LIMIT:
        raise WillItFitError(f"--max-cards {max_cards}: give at most {MAX_CARDS_LIMIT} (the default: {MAX_CARDS})")
    if True:      # full fine-tuning too: when it does not fit, LoRA with these is the change tried (_cheaper)
        _positive_int("--lora-r", lora_r, "LoRA's rank", 16)
        unknown = [t for t in targets or () if t not in allowed]
        if targets is not None and (unknown or not targets):
            raise WillItFitError(f"--targets {','.join(targets)!r}: "
                                 + (f"no layer {', '.join(unknown)} in {what}" if unknown
                                    else "no layer named") + f"; give some of {','.join(allowed)}")


def _card_pair(cards):
    try:
        count, gib = cards
    except (TypeError, ValueError):
        raise WillItFitError(f"cards {cards!r}: give a string such as '2 x RTX 3060' or (count, GiB)") from None
    _positive_int("--cards", count, "the number of cards")
    if not 0 < gib <= MAX_CARD_GIB:
        raise WillItFitError(f"cards {cards!r}: a card's memory must be more than 0 and at most {MAX_CARD_GIB} GiB")
    return count, float(gib), f"{count} x {gib:g} GiB"


def _card_counts(cards, max_cards):
    """The card counts the search tries above ``cards``: one node's 2 ... 8, then whole nodes of 8."""
    return [W for W in range(2, max_cards + 1) if W > cards and (W <= NODE or W % NODE == 0)]


def _smallest(plan, results, kw, workers, say, max_cards, cache=None):
    """The plan on the fewest cards (more than ``plan.cards``, among ``_card_counts``: 2 ... 8, then whole nodes of 8,
    up to ``max_cards``) that fits: ZeRO rows counted on the replicas already measured, FSDP2 with checkpointing
    measured per card count (doubling, then halving the gap)."""
    card, method, shape = plan.card_bytes, plan.method, plan.shape
    counts = _card_counts(plan.cards, max_cards)
    reps = {k: v for k, v in results.items() if k.startswith("replica")}
    best = None
    if method == "full" and reps:
        for W in counts:
            fit = [r for r in _rows(shape, method, W, reps, plan.precision)
                   if r.same_training and r.strategy != "DDP" and r.fits(card)]
            if fit:
                best = min(fit, key=_cost)
                break

    def fsdp_at(W):
        res = _run_jobs(_jobs(shape, method, W, checkpoints=(True,), replicas=False, **kw), 1, say, cache)
        plan.results.update(res)
        rows = [r for r in _rows(shape, method, W, res, plan.precision) if r.strategy == "FSDP2"]
        return rows[0]

    if method == "qlora":
        return None
    if best is not None:
        counts = [W for W in counts if W < best.world_size]
    if not counts:
        return best
    lo, hi, hi_row, target = -1, None, None, 2 * plan.cards    # counts[lo] does not fit (-1: plan.cards)
    while hi is None and lo < len(counts) - 1:                  # doubling the card count, then ...
        i = next((j for j, W in enumerate(counts) if W >= target and j > lo), len(counts) - 1)
        row = fsdp_at(counts[i])
        if row.fits(card):
            hi, hi_row = i, row
        else:
            lo, target = i, 2 * counts[i]
    if hi is None:
        return best
    while hi - lo > 1:                                          # ... halving the gap
        mid = (lo + hi) // 2
        row = fsdp_at(counts[mid])
        if row.fits(card):
            hi, hi_row = mid, row
        else:
            lo = mid
    return hi_row


# -- --check: the plan at tiny scale, on real ranks ---------------------------------------------------------------
def tiny_like(shape):
    """A 2-block model with ``shape``'s layer types: its grouped-query ratio, q/k/v biases, tied embeddings."""
    group = max(shape.n_head // shape.n_kv_head, 1)
    n_kv = 2 if group <= 2 else 1
    n_head = n_kv * min(group, 4)
    return LlamaShape(f"{shape.name}, tiny", vocab_size=64, d_model=8 * n_head, n_layer=2, d_ff=24 * n_head // 2,
                      n_head=n_head, n_kv_head=n_kv, qkv_bias=shape.qkv_bias, tie_embeddings=shape.tie_embeddings)


CHECK_STEPS, CHECK_BATCH, CHECK_SEQ, CHECK_LR = 4, 4, 16, 0.5


def _check_model(shape, method, lora_r, targets, checkpoint):
    from torch.utils.checkpoint import checkpoint as ckpt

    from course_utils.lora import add_lora
    from course_utils.true_size import LlamaShaped

    torch.manual_seed(0)
    model = LlamaShaped(shape)
    if method != "full":
        add_lora(model, targets=targets, r=lora_r, alpha=2 * lora_r, seed=0)
        with torch.no_grad():                 # B starts at zero; make the adapters' update count from step 0
            for name, p in model.named_parameters():
                if name.endswith("lora_B"):
                    p.normal_(0, 0.05)
    if checkpoint:
        for block in model.blocks:
            block.forward = (lambda f: lambda x: ckpt(f, x, use_reentrant=False))(block.forward)
    return model


def _check_batches(shape, step):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(shape.vocab_size, (CHECK_BATCH, CHECK_SEQ + 1), generator=g)


def _loss(model, batch):
    import torch.nn.functional as F

    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())


def _reference_losses(shape, method, lora_r, targets, checkpoint):
    model = _check_model(shape, method, lora_r, targets, checkpoint)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=CHECK_LR)
    losses = []
    for step in range(CHECK_STEPS):
        loss = _loss(model, _check_batches(shape, step))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _rank_losses(shape, method, strategy, lora_r, targets, checkpoint, bug=None):
    """On every rank of a gloo world: ``strategy`` over the tiny model, the rank's slice of each global batch."""
    import torch.distributed as dist

    from course_utils.zero import ShardedOptimizer

    torch.set_num_threads(1)
    rank, W = dist.get_rank(), dist.get_world_size()
    model = _check_model(shape, method, lora_r, targets, checkpoint)
    params = [p for p in model.parameters() if p.requires_grad]
    if strategy in ("DDP", "ZeRO-1"):
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model)
        if strategy == "DDP":
            optimizer = torch.optim.SGD(params, lr=CHECK_LR)
        else:
            optimizer = ShardedOptimizer(params, torch.optim.SGD, lr=CHECK_LR)
    elif strategy == "ZeRO-2":
        optimizer = ShardedOptimizer(params, torch.optim.SGD, lr=CHECK_LR, reduce_scatter=True)
    elif strategy == "FSDP2":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=CHECK_LR)
    else:
        raise ValueError(f"strategy {strategy!r}: one of {', '.join(STRATEGY_ORDER)}")
    per_rank = CHECK_BATCH // W
    losses = []
    for step in range(CHECK_STEPS):
        batch = _check_batches(shape, step)[rank * per_rank:(rank + 1) * per_rank]
        loss = _loss(model, batch)
        # the planted wrong strategy: the loss divided by W before backward, on top of the strategy's own average
        (loss / W if bug == "average twice" else loss).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss = loss.detach()
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        losses.append(loss.item())
    return losses


TINY_RUN = {"--model": "tiny", "--seq-len": "32", "--steps": "2"}   # what --check's run of the command changes


def tiny_command(command, world_size=2):
    """``command`` (a plan's finetune.py line) at tiny scale on this machine: ``world_size`` CPU ranks, the lesson's
    tiny Llama, 32 tokens, 2 steps, at most 2 micro-batches accumulated; its method, strategy, precision, LoRA
    settings, micro-batch and checkpointing as printed (the global batch follows: micro-batch x accumulation x
    ranks). Returns the argument list for ``python -m torch.distributed.run``; None for a QLoRA line (bitsandbytes
    needs a GPU). tests/test_will_it_fit.py runs one."""
    import shlex

    words = shlex.split(command)
    if words[:1] != ["torchrun"] or SCRIPT not in words:
        raise ValueError(f"not a {SCRIPT} command: {command!r}")
    rest, opts, flags = words[words.index(SCRIPT) + 1:], {}, []
    while rest:
        if rest[0] == "--checkpointing":   # the one option without a value
            flags.append(rest.pop(0))
        else:
            opts[rest[0]], rest = rest[1], rest[2:]
    if opts.get("--method") == "qlora":
        return None
    opts.update(TINY_RUN)
    opts["--accum-steps"] = str(min(int(opts["--accum-steps"]), 2))   # the same code path as 16, in seconds
    opts["--global-batch-size"] = str(int(opts["--micro-batch-size"]) * int(opts["--accum-steps"]) * world_size)
    return (["--standalone", f"--nproc-per-node={world_size}", SCRIPT]
            + [w for kv in opts.items() for w in kv] + flags + ["--log-every", "1"])


def run_tiny(args, timeout=600):
    """Run tiny_command's ``args`` under torchrun from the repository's root, gloo on loopback; returns (returncode,
    output)."""
    import subprocess

    from course_utils.engine.ranks import _loopback_interface

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "GLOO_SOCKET_IFNAME": _loopback_interface(sys.platform, os.environ)}
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", *args], cwd=root, env=env, timeout=timeout,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return done.returncode, done.stdout


def check_plan(shape, method, strategy, checkpoint=False, lora_r=4, targets=("q_proj", "v_proj"), world_size=2,
               bug=None, tolerance=1e-5, cluster=None):
    """Train a tiny model with ``shape``'s layer types for a few steps with ``strategy`` on ``world_size`` CPU ranks
    (gloo, the course's ``Cluster``) and on one process, same data, same initialisation; return
    ``(ok, max loss difference, distributed losses, single-process losses)``. In fp32, with SGD: AdamW divides each
    gradient by its own running scale, so it would train almost alike on gradients averaged twice (``bug``)."""
    from course_utils.engine.launcher import Cluster

    tiny = tiny_like(shape)
    m = "full" if method == "full" else "lora"
    lora_r = min(lora_r, 4)
    ref = _reference_losses(tiny, m, lora_r, tuple(targets), checkpoint)
    own = cluster is None
    cluster = cluster or Cluster(world_size=world_size, backend="gloo", timeout=120)
    try:
        got = cluster.run(_rank_losses, tiny, m, strategy, lora_r, tuple(targets), checkpoint, bug)[0]
    finally:
        if own:
            cluster.shutdown()
    diff = max(abs(a - b) for a, b in zip(got, ref))
    return diff <= tolerance, diff, got, ref
