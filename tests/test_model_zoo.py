"""course_utils.model_zoo: the published configurations build the published models, and measuring the real modelling
code (transformers' decoders, diffusers' UNet) agrees with the course's hand-written LlamaShaped and with real
tensors.

    .venv/bin/python -m pytest -n 0 tests/test_model_zoo.py

The cross-checks measure at 2 decoder layers: every layer is the same, and will_it_fit extends a replica measured at 2
and 3 layers to the true depth (tests/test_will_it_fit.py holds the extension), so two paths that agree per layer
agree at the true depth.
"""
import dataclasses
import json

import pytest
import torch

from course_utils.model_zoo import (CAUSAL_LMS, UNETS, ModelSpec, ModelZooError, causal_lm_spec, count_params,
                                    default_targets, lora_target_names, measure_model_step, qlora_counts,
                                    resolve_spec, spec_from_config, unet_spec)
from course_utils.true_size import LLAMA2_7B, MISTRAL_7B, measure_step
from course_utils.will_it_fit import QWEN25_05B

PHASES = ("forward", "backward", "step")


@pytest.mark.parametrize("name, shape", [("llama-2-7b", LLAMA2_7B), ("mistral-7b", MISTRAL_7B),
                                         ("qwen2.5-0.5b", QWEN25_05B)])
def test_transformers_agrees_with_llama_shape_per_phase(name, shape):
    spec = causal_lm_spec(name).with_layers(2)
    hand = dataclasses.replace(shape, n_layer=2)
    real = measure_model_step(spec, strategy="replica")
    ours = measure_step(hand, strategy="replica")
    assert real["n_params"] == hand.n_params, (name, real["n_params"], hand.n_params)
    for phase in PHASES:
        a, b = real[phase]["total"], ours[phase]["total"]
        assert abs(a / b - 1) <= 0.02, f"{name} {phase}: transformers {a:,} B, LlamaShaped {b:,} B: over 2% apart"


def test_transformers_agrees_with_llama_shape_under_fsdp2():
    spec, hand = causal_lm_spec("mistral-7b").with_layers(2), dataclasses.replace(MISTRAL_7B, n_layer=2)
    real = measure_model_step(spec, world_size=2, strategy="fsdp2", mixed_precision=True)
    ours = measure_step(hand, world_size=2, strategy="fsdp2", mixed_precision=True)
    for phase in PHASES:
        a, b = real[phase]["total"], ours[phase]["total"]
        assert abs(a / b - 1) <= 0.02, f"FSDP2 {phase}: transformers {a:,} B, LlamaShaped {b:,} B: over 2% apart"


@pytest.mark.parametrize("name, published", [("sd-1.5", 859_520_964), ("sd-2.1", 865_910_724),
                                             ("sdxl", 2_567_463_684)])
def test_the_shipped_unet_configs_build_the_published_unets(name, published):
    assert count_params(unet_spec(name)) == published, f"{name}: not the published UNet's parameter count"


TINY_UNET = dict(sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=[32, 64],
                 down_block_types=["CrossAttnDownBlock2D", "DownBlock2D"],
                 up_block_types=["UpBlock2D", "CrossAttnUpBlock2D"], cross_attention_dim=32, attention_head_dim=8,
                 norm_num_groups=8)


def test_a_unet_step_with_fake_tensors_measures_what_real_tensors_hold():
    # Real CPU kernels hold a few KiB that fake tensors do not see (2 KiB in backward at this size, measured): the
    # same bytes within 1% per phase, and never less than 99% of the real peak.
    spec = ModelSpec("tiny", "unet", TINY_UNET)
    kw = dict(strategy="replica", resolution=64, micro_batch_size=2)
    fake, real = measure_model_step(spec, **kw), measure_model_step(spec, fake=False, **kw)
    for phase in PHASES:
        a, b = fake[phase]["total"], real[phase]["total"]
        assert abs(a / b - 1) <= 0.01, f"{phase}: fake tensors measure {a:,} B, real tensors hold {b:,} B"


def test_any_causal_lm_transformers_builds(tmp_path):
    config = dict(model_type="gpt_neox", architectures=["GPTNeoXForCausalLM"], vocab_size=512, hidden_size=64,
                  intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=128)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    spec = resolve_spec(str(path))
    assert spec.kind == "causal-lm" and spec.n_layer == 2
    r = measure_model_step(spec, strategy="replica", seq_len=32)
    assert r["step"]["optimizer_state"] >= 8 * r["n_trainable"], "AdamW's two fp32 moments of every parameter"
    assert "query_key_value" in lora_target_names(spec) and default_targets(spec)


def test_lora_targets_and_qlora_counts_of_a_unet():
    spec = ModelSpec("tiny", "unet", TINY_UNET)
    assert default_targets(spec) == ("to_q", "to_k", "to_v", "to_out.0")
    assert {"to_q", "to_out.0"} <= lora_target_names(spec)
    four, other = qlora_counts(spec)
    assert four + other == count_params(spec) and four > 0 and other > 0, "convolutions stay unquantised"


def test_qlora_counts_of_a_decoder_keep_the_head():
    spec = causal_lm_spec("qwen2.5-0.5b").with_layers(2)
    four, other = qlora_counts(spec)
    assert other >= CAUSAL_LMS["qwen2.5-0.5b"]["vocab_size"] * 896, "the (tied) embedding is not 4-bit"


@pytest.mark.parametrize("name, words", [
    ("no-such-model", "unknown model"),
    ("someone/not-cached-anywhere", "not in the local huggingface cache"),
])
def test_a_name_it_cannot_resolve_says_what_to_give(name, words, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ModelZooError, match=words):
        resolve_spec(name)


def test_a_config_of_no_causal_lm_is_refused():
    with pytest.raises(ModelZooError, match="no causal-LM head"):
        spec_from_config(dict(model_type="clip_vision_model", num_hidden_layers=2), "vision.json")
    assert set(UNETS) == {"sd-1.5", "sd-2.1", "sdxl"}
    assert torch.get_default_dtype() == torch.float32
