"""Any ``transformers`` causal LM and ``diffusers``' Stable Diffusion UNets, built on ``meta``, measured at true size.

Introduced in 18_diffusion_on_two_rtx_3060s (and used by ``course_utils.will_it_fit`` for ``--model``). Lessons 14 and
16 measure decoders that the course writes by hand (``true_size.LlamaShaped``); a ``ModelSpec`` measures the real
modelling code instead: ``AutoModelForCausalLM.from_config`` for any architecture ``transformers`` builds (Llama,
Mistral, Qwen2, Gemma, Phi, GPT-NeoX, ...), ``UNet2DConditionModel.from_config`` for a UNet. The configurations are
the published ``config.json`` files, shipped below as dicts: nothing is downloaded.

``measure_model_step(spec, ...)`` is ``true_size.measure_step`` for a ``ModelSpec``: the same fake world, the same
trackers, the same phases (forward, backward, AdamW step), the same kinds. What a spec adds is what differs by model:
its inputs (tokens; or noisy latents, timesteps and text embeddings at a resolution), its loss (next-token cross
entropy; the noise-prediction MSE that ``diffusers``' training scripts compute in fp32), the units FSDP2 shards
(decoder layers; a UNet's down, mid and up blocks) and the library's own activation checkpointing
(``gradient_checkpointing_enable`` / ``enable_gradient_checkpointing``, what the training scripts switch on).
"""
import contextlib
import copy
import dataclasses
import json
import re
import time
import warnings
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["ModelSpec", "UNETS", "TEXT_ENCODERS", "VAE", "CAUSAL_LMS", "UNET_LORA_TARGETS", "unet_spec",
           "causal_lm_spec", "spec_from_config", "resolve_spec", "measure_model_step", "add_lora_by_suffix",
           "count_params", "ModelZooError", "default_targets", "lora_target_names", "qlora_counts",
           "native_resolution"]


class ModelZooError(ValueError):
    """Bad input: the message says what was wrong and what to give instead."""


# -- the published configurations ---------------------------------------------------------------------------------
# The UNets' config.json (unet/config.json of runwayml/stable-diffusion-v1-5, stabilityai/stable-diffusion-2-1 and
# stabilityai/stable-diffusion-xl-base-1.0), without the keys that only record the library's version.
_SD_COMMON = dict(act_fn="silu", center_input_sample=False, downsample_padding=1, flip_sin_to_cos=True, freq_shift=0,
                  in_channels=4, out_channels=4, layers_per_block=2, mid_block_scale_factor=1, norm_eps=1e-5,
                  norm_num_groups=32, block_out_channels=[320, 640, 1280, 1280],
                  down_block_types=["CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D",
                                    "DownBlock2D"],
                  up_block_types=["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"])
UNETS = {
    "sd-1.5": dict(_SD_COMMON, attention_head_dim=8, cross_attention_dim=768, sample_size=64),
    "sd-2.1": dict(_SD_COMMON, attention_head_dim=[5, 10, 20, 20], cross_attention_dim=1024, sample_size=96,
                   use_linear_projection=True, upcast_attention=True),
    "sdxl": dict(act_fn="silu", center_input_sample=False, downsample_padding=1, flip_sin_to_cos=True, freq_shift=0,
                 in_channels=4, out_channels=4, layers_per_block=2, mid_block_scale_factor=1, norm_eps=1e-5,
                 norm_num_groups=32, block_out_channels=[320, 640, 1280], attention_head_dim=[5, 10, 20],
                 cross_attention_dim=2048, sample_size=128, use_linear_projection=True,
                 transformer_layers_per_block=[1, 2, 10], addition_embed_type="text_time",
                 addition_embed_type_num_heads=64, addition_time_embed_dim=256,
                 projection_class_embeddings_input_dim=2816,
                 down_block_types=["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
                 up_block_types=["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"]),
}
# The hub repository each UNet comes from (what the printed diffusers command loads).
UNET_HUB = {"sd-1.5": "stable-diffusion-v1-5/stable-diffusion-v1-5", "sd-2.1": "stabilityai/stable-diffusion-2-1",
            "sdxl": "stabilityai/stable-diffusion-xl-base-1.0"}
# The frozen text encoders (text_encoder/config.json, text_encoder_2/config.json): CLIP ViT-L/14's text tower for
# SD 1.5, OpenCLIP ViT-H/14's for SD 2.1, and both CLIP ViT-L and OpenCLIP ViT-bigG for SDXL.
_CLIP_L = dict(vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
               max_position_embeddings=77, hidden_act="quick_gelu", projection_dim=768)
_OPENCLIP_H = dict(vocab_size=49408, hidden_size=1024, intermediate_size=4096, num_hidden_layers=23,
                   num_attention_heads=16, max_position_embeddings=77, hidden_act="gelu", projection_dim=512)
_OPENCLIP_BIGG = dict(vocab_size=49408, hidden_size=1280, intermediate_size=5120, num_hidden_layers=32,
                      num_attention_heads=20, max_position_embeddings=77, hidden_act="gelu", projection_dim=1280)
TEXT_ENCODERS = {"sd-1.5": [("CLIPTextModel", _CLIP_L)], "sd-2.1": [("CLIPTextModel", _OPENCLIP_H)],
                 "sdxl": [("CLIPTextModel", _CLIP_L), ("CLIPTextModelWithProjection", _OPENCLIP_BIGG)]}
# The VAE (vae/config.json), the same architecture in all three: 8x down, 4 latent channels.
VAE = dict(act_fn="silu", block_out_channels=[128, 256, 512, 512], in_channels=3, out_channels=3, latent_channels=4,
           layers_per_block=2, norm_num_groups=32,
           down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4)
# The modules diffusers' LoRA scripts (train_text_to_image_lora.py, ..._sdxl.py) adapt: every attention projection.
UNET_LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0")

# Causal LMs (config.json on the hub), as transformers' from_config reads them. Mistral 7B v0.1 and Qwen2.5 are the
# decoders lesson 14 and will_it_fit's LlamaShape path size too (tests/test_model_zoo.py cross-checks the two paths).
CAUSAL_LMS = {
    "llama-2-7b": dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=32000, hidden_size=4096,
                       intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                       max_position_embeddings=4096, tie_word_embeddings=False, rms_norm_eps=1e-5),
    "mistral-7b": dict(model_type="mistral", architectures=["MistralForCausalLM"], vocab_size=32000,
                       hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, max_position_embeddings=32768, sliding_window=4096,
                       tie_word_embeddings=False, rms_norm_eps=1e-5),
    "qwen2.5-0.5b": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], vocab_size=151936, hidden_size=896,
                         intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         max_position_embeddings=32768, tie_word_embeddings=True, rms_norm_eps=1e-6),
    "qwen2.5-1.5b": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], vocab_size=151936,
                         hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, max_position_embeddings=32768, tie_word_embeddings=True,
                         rms_norm_eps=1e-6),
    "qwen2.5-7b": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], vocab_size=152064, hidden_size=3584,
                       intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                       max_position_embeddings=32768, tie_word_embeddings=False, rms_norm_eps=1e-6),
}


def _quiet():
    """transformers and diffusers without their advisory warnings and progress bars (the lessons print tables)."""
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")            # nothing here may reach the network
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")


# -- a model and its inputs ---------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, eq=False)
class ModelSpec:
    """What to build and how to feed it: ``kind`` ``"causal-lm"`` (a transformers config dict) or ``"unet"`` (a
    diffusers ``UNet2DConditionModel`` config dict). ``n_layer``: decoder layers (a causal LM) or FSDP units (a
    UNet's down, mid and up blocks). ``hub``: where the weights live (for the printed command), or None."""
    name: str
    kind: str
    config: dict
    hub: str = None

    @property
    def n_layer(self):
        if self.kind == "causal-lm":
            return self.config["num_hidden_layers"]
        return 2 * len(self.config["block_out_channels"]) + 1

    @property
    def n_params(self):
        return count_params(self)

    def with_layers(self, n_layer):
        """The same decoder with ``n_layer`` layers (will_it_fit extends a replica measured at 2 and 3)."""
        if self.kind != "causal-lm":
            raise ModelZooError(f"{self.name}: a UNet's blocks differ from each other; measure it whole")
        return dataclasses.replace(self, config=dict(self.config, num_hidden_layers=n_layer))

    def build(self):
        """The module, on the current default device (``with torch.device("meta")``: no memory)."""
        _quiet()
        if self.kind == "unet":
            from diffusers import UNet2DConditionModel

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return UNet2DConditionModel.from_config(copy.deepcopy(self.config))
        from transformers import AutoConfig, AutoModelForCausalLM

        cfg = dict(self.config)
        cfg.pop("architectures", None)
        config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
        config._attn_implementation = "sdpa"
        return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")

    def units(self, model):
        """The modules FSDP2 shards one by one (then the root): decoder layers, or a UNet's down/mid/up blocks."""
        if self.kind == "unet":
            return list(model.down_blocks) + [model.mid_block] + list(model.up_blocks)
        n = self.config["num_hidden_layers"]
        lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) == n]
        if not lists:
            raise ModelZooError(f"{self.name}: no list of {n} layers found in {type(model).__name__}")
        return list(lists[0])

    def checkpointing(self, model):
        """The library's own activation checkpointing, as the training scripts switch it on (non-reentrant)."""
        if self.kind == "unet":
            model.enable_gradient_checkpointing()
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            if not any(p.requires_grad for p in model.get_input_embeddings().parameters()):
                model.enable_input_require_grads()        # a frozen base (LoRA): checkpointed layers still backprop

    def inputs(self, micro_batch_size, seq_len=512, resolution=512, generator=None):
        """A batch on the current device and fake mode: token ids ``(B, seq_len)``; or a UNet's noisy latents
        ``(B, 4, resolution / 8, resolution / 8)``, timesteps, text embeddings ``(B, 77, cross_attention_dim)``, the
        noise to predict, and SDXL's pooled text embedding and size ids."""
        B = micro_batch_size
        if self.kind == "causal-lm":
            return dict(input_ids=torch.randint(self.config["vocab_size"], (B, seq_len), generator=generator))
        if resolution % 8:
            raise ModelZooError(f"resolution {resolution}: the VAE downsamples by 8; give a multiple of 8, as 512")
        side = resolution // 8
        c = self.config
        out = dict(sample=torch.randn(B, c.get("in_channels", 4), side, side, generator=generator),
                   timestep=torch.randint(1000, (B,), generator=generator),
                   encoder_hidden_states=torch.randn(B, 77, c["cross_attention_dim"], generator=generator),
                   noise=torch.randn(B, c.get("out_channels", 4), side, side, generator=generator))
        if c.get("addition_embed_type") == "text_time":
            pooled = c["projection_class_embeddings_input_dim"] - 6 * c["addition_time_embed_dim"]
            out["added_cond_kwargs"] = dict(text_embeds=torch.randn(B, pooled, generator=generator),
                                            time_ids=torch.randn(B, 6, generator=generator))
        return out

    def loss(self, model, batch):
        """Next-token cross entropy on fp32 logits (as ``true_size`` computes it); for a UNet the noise-prediction
        MSE in fp32, as ``diffusers``' train_text_to_image.py computes it."""
        if self.kind == "causal-lm":
            idx = batch["input_ids"]
            logits = model(input_ids=idx).logits
            return F.cross_entropy(logits.flatten(0, 1).float(), idx.flatten())
        dtype = model.conv_in.weight.dtype        # a bf16 base (LoRA): the scripts cast the inputs to it
        kw = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in batch.items()
              if k not in ("noise", "added_cond_kwargs")}
        if "added_cond_kwargs" in batch:
            kw["added_cond_kwargs"] = {k: v.to(dtype) for k, v in batch["added_cond_kwargs"].items()}
        pred = model(**kw).sample
        return F.mse_loss(pred.float(), batch["noise"].float())


_COUNTS = {}


def count_params(spec):
    """The parameters of ``spec``'s module, counted on ``meta`` (kept per configuration: building SDXL takes a
    second). A tied embedding counts once."""
    key = (spec.kind, json.dumps(spec.config, sort_keys=True))
    if key not in _COUNTS:
        with torch.device("meta"):
            model = spec.build()
        _COUNTS[key] = sum(p.numel() for p in model.parameters())
    return _COUNTS[key]


def unet_spec(name):
    """``ModelSpec`` of a named UNet (``UNETS``: sd-1.5, sd-2.1, sdxl)."""
    return ModelSpec(name, "unet", UNETS[name], UNET_HUB.get(name))


def causal_lm_spec(name, hub=None):
    """``ModelSpec`` of a named causal LM (``CAUSAL_LMS``)."""
    return ModelSpec(name, "causal-lm", CAUSAL_LMS[name], hub)


def spec_from_config(config, name="config.json", hub=None):
    """A ``ModelSpec`` from a config.json (a dict): a diffusers ``UNet2DConditionModel`` (``_class_name``) or any
    causal LM transformers builds (``model_type``)."""
    if config.get("_class_name") == "UNet2DConditionModel" or "down_block_types" in config:
        if config.get("_class_name", "UNet2DConditionModel") != "UNet2DConditionModel":
            raise ModelZooError(f"{name}: a {config['_class_name']}; the meter builds UNet2DConditionModel")
        keep = {k: v for k, v in config.items() if not k.startswith("_")}
        return ModelSpec(name, "unet", keep, hub)
    model_type = config.get("model_type")
    if not model_type:
        raise ModelZooError(f"{name}: no model_type and no _class_name: give a transformers config.json of a causal LM "
                            "or a diffusers UNet2DConditionModel's config.json")
    _quiet()
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = {k: v for k, v in config.items() if k not in ("model_type", "architectures", "_name_or_path")}
    try:
        built = AutoConfig.for_model(model_type, **cfg)
    except ValueError:
        raise ModelZooError(f"{name}: model_type {model_type!r} is unknown to transformers "
                            f"{__import__('transformers').__version__}") from None
    if type(built) not in AutoModelForCausalLM._model_mapping:
        raise ModelZooError(f"{name}: {type(built).__name__} has no causal-LM head in transformers "
                            "(AutoModelForCausalLM); give a decoder's config.json or a UNet's")
    if "num_hidden_layers" not in config:
        raise ModelZooError(f"{name}: config.json has no num_hidden_layers: give a decoder's config.json")
    return ModelSpec(name, "causal-lm", dict(config), hub)


def _key(name):
    return re.sub(r"[\s_]+", "-", name.strip().lower())


def _cached_config(repo_id):
    """config.json of a hub repository from the local huggingface cache only (never the network)."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    for filename in ("config.json", "unet/config.json"):
        path = try_to_load_from_cache(repo_id, filename)
        if isinstance(path, str):
            return Path(path)
    return None


def resolve_spec(name):
    """A ``ModelSpec`` for a named UNet (``UNETS``), a named causal LM (``CAUSAL_LMS``), a local config.json (or a
    folder holding one, or a pipeline folder holding unet/config.json), or a hub name read offline from the local
    huggingface cache. Anything else: ``ModelZooError`` saying what to give."""
    key = _key(name)
    aliases = {"sd15": "sd-1.5", "sd-15": "sd-1.5", "sd1.5": "sd-1.5", "sd21": "sd-2.1", "sd2.1": "sd-2.1",
               "sd-xl": "sdxl"}
    key = aliases.get(key, key)
    if key in UNETS:
        return unet_spec(key)
    for hub_key, repo in UNET_HUB.items():
        if key == repo.lower():
            return unet_spec(hub_key)
    if key in CAUSAL_LMS:
        return causal_lm_spec(key)
    path = Path(name).expanduser()
    if path.is_dir():
        path = path / "config.json" if (path / "config.json").is_file() else path / "unet" / "config.json"
    if path.is_file():
        return spec_from_config(_read_json(path), str(path))
    if "/" in name and len(name.split("/")) == 2 and not path.suffix:
        cached = _cached_config(name)
        if cached is None:
            raise ModelZooError(f"{name!r}: its config.json is not in the local huggingface cache, and nothing here "
                                "downloads: run `huggingface-cli download " + name + " config.json` once, or pass "
                                "the path of a config.json")
        return spec_from_config(_read_json(cached), name, hub=name)
    raise ModelZooError(f"unknown model {name!r}: give one of {', '.join(list(UNETS) + list(CAUSAL_LMS))}, a "
                        "config.json (a transformers causal LM or a diffusers UNet), or a hub name in the local cache")


def _read_json(path):
    try:
        config = json.loads(Path(path).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ModelZooError(f"{path}: not valid JSON: give a config.json as the hub has it") from None
    if not isinstance(config, dict):
        raise ModelZooError(f"{path}: a JSON {type(config).__name__}, not an object: give a config.json")
    return config


# -- LoRA on named projections ------------------------------------------------------------------------------------
def add_lora_by_suffix(model, targets, r=16, alpha=None, base_dtype=None):
    """Freeze ``model`` (cast to ``base_dtype`` if given) and wrap every ``nn.Linear`` whose qualified name ends with
    one of ``targets`` (``"to_out.0"`` as peft's ``target_modules`` reads it) in ``lora.LoRALinear``, adapters in
    fp32. Returns the number of wrapped layers."""
    from course_utils.lora import LoRALinear

    if base_dtype is not None:
        model.to(base_dtype)
    for p in model.parameters():
        p.requires_grad_(False)
    found = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)
             and any(name == t or name.endswith("." + t) for t in targets)]
    if not found:
        raise ModelZooError(f"no nn.Linear of {type(model).__name__} ends with {list(targets)}")
    for name, linear in found:
        parent_name, attr = name.rsplit(".", 1) if "." in name else ("", name)
        lora = LoRALinear(linear, r=r, alpha=alpha or 2 * r)
        lora.lora_A.data = lora.lora_A.data.float()
        lora.lora_B.data = lora.lora_B.data.float()
        model.get_submodule(parent_name)._modules[attr] = lora
    return len(found)


# -- one training step, measured ----------------------------------------------------------------------------------
def measure_model_step(spec, world_size=1, strategy="fsdp2", mixed_precision=False, micro_batch_size=1, seq_len=512,
                       resolution=None, checkpoint=False, foreach=False, modify=None, warmup=True,
                       autocast_dtype=torch.bfloat16, fake=True):
    """``true_size.measure_step`` for a ``ModelSpec``: rank 0's peak in each phase of one AdamW step, by kind.

    ``strategy``: ``"fsdp2"`` (``fully_shard`` on each of ``spec.units`` and the root, ``FSDPMemTracker``) or
    ``"replica"`` (one whole model, ``MemTracker``). ``mixed_precision``: FSDP2's ``MixedPrecisionPolicy(param_dtype=
    autocast_dtype, reduce_dtype=fp32)``, or for a replica autocast to ``autocast_dtype`` over fp32 weights (what
    ``accelerate``'s ``--mixed_precision`` runs in ``diffusers``' scripts). ``checkpoint``: the library's own
    activation checkpointing. ``modify(model)``: on the meta model before sharding (a bf16 base, LoRA ...).
    ``warmup`` and ``foreach``: as ``measure_step`` (AdamW's state made by a step on zero gradients before the
    tracker starts; the for-loop AdamW). ``fake=False``: real tensors, for the check at small size. ``resolution``:
    a UNet's images in pixels (default its native one, ``native_resolution``); ``seq_len``: a causal LM's tokens.
    Returns the same dict as ``measure_step``."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from course_utils.true_size import fake_world, step_result, tracked_step

    t0 = time.perf_counter()
    with fake_world(world_size):
        with torch.device("meta"):
            model = spec.build()
        model.train()
        if modify is not None:
            modify(model)
        if checkpoint:
            spec.checkpointing(model)
        n_params = sum(p.numel() for p in model.parameters())
        n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        if strategy == "fsdp2":
            kw = {}
            if mixed_precision:
                kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=autocast_dtype, reduce_dtype=torch.float32)
            for unit in spec.units(model):
                fully_shard(unit, **kw)
            fully_shard(model, **kw)
        elif strategy != "replica":
            raise ValueError(f"strategy={strategy!r}: use 'fsdp2' or 'replica'")
        with FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext():
            model.to_empty(device="cpu")
            _retie(model, spec, strategy)
            if not fake:
                with torch.no_grad(), warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    for p in model.parameters():
                        p.normal_(0, 0.02)
            trainable = [p for p in model.parameters() if p.requires_grad]
            optimizer = torch.optim.AdamW(trainable, lr=1e-4, foreach=foreach)
            batch = spec.inputs(micro_batch_size, seq_len=seq_len,
                                resolution=resolution or (native_resolution(spec) if spec.kind == "unet" else None))
            autocast = (torch.autocast("cpu", dtype=autocast_dtype) if mixed_precision and strategy == "replica"
                        else contextlib.nullcontext())

            def forward():
                with autocast:
                    return spec.loss(model, batch)

            if warmup == "full":
                loss = forward()
                loss.backward()
                del loss
            elif warmup:
                for p in trainable:
                    p.grad = torch.zeros_like(p)
            if warmup:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            phases = tracked_step(model, optimizer, forward, strategy)
    return step_result(phases, model, n_params, n_trainable, t0, mixed_precision, strategy, foreach)


def _retie(model, spec, strategy):
    """``to_empty`` gives a tied head its own tensor on a replica: tie it again (fully_shard keeps one)."""
    if spec.kind == "causal-lm" and strategy == "replica" and getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()


# -- what will_it_fit asks of a spec ------------------------------------------------------------------------------
def default_targets(spec):
    """LoRA's default targets: a UNet's attention projections (``UNET_LORA_TARGETS``, as diffusers' LoRA scripts);
    a causal LM's query and value projections when it has layers of those names (Llama's), else every linear."""
    if spec.kind == "unet":
        return UNET_LORA_TARGETS
    names = lora_target_names(spec)
    return tuple(t for t in ("q_proj", "v_proj") if t in names) or tuple(sorted(names))


def lora_target_names(spec):
    """The names a LoRA target may take in ``spec``'s module: each ``nn.Linear``'s last name, and for a layer in a
    ``ModuleList`` (``to_out.0``) its last two."""
    with torch.device("meta"):
        model = spec.build()
    names = set()
    head = _output_linear(model)
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear) and m is not head:
            parts = name.split(".")
            names.add(".".join(parts[-2:]) if parts[-1].isdigit() else parts[-1])
    return names


def _output_linear(model):
    get = getattr(model, "get_output_embeddings", None)
    return get() if get is not None else None


def qlora_counts(spec):
    """``(4-bit, other)``: the parameters bitsandbytes' ``load_in_4bit`` stores in 4 bits (the weight of every
    ``nn.Linear`` but a causal LM's output head, which transformers keeps unquantised) and the rest (embeddings,
    norms, biases, a UNet's convolutions)."""
    with torch.device("meta"):
        model = spec.build()
    head = _output_linear(model)
    four = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear) and m is not head)
    total = sum(p.numel() for p in model.parameters())
    return four, total - four


def native_resolution(spec):
    """A UNet's training resolution in pixels: its latent ``sample_size`` times the VAE's 8."""
    return 8 * spec.config.get("sample_size", 64)
