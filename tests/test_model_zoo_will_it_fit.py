"""will_it_fit for any model: a causal LM that is not a Llama (GPT-NeoX) and a diffusers UNet, given as config.json
files, sized and planned end to end at a tiny size (fake tensors, a second or two a step).

    .venv/bin/python -m pytest -n 0 tests/test_model_zoo_will_it_fit.py
"""
import json

import pytest

from course_utils.model_zoo import ModelSpec
from course_utils.will_it_fit import WillItFitError, resolve_model, will_it_fit

NEOX = dict(model_type="gpt_neox", architectures=["GPTNeoXForCausalLM"], vocab_size=512, hidden_size=64,
            intermediate_size=256, num_hidden_layers=4, num_attention_heads=4, max_position_embeddings=128)
UNET = dict(_class_name="UNet2DConditionModel", sample_size=8, in_channels=4, out_channels=4, layers_per_block=1,
            block_out_channels=[32, 64], down_block_types=["CrossAttnDownBlock2D", "DownBlock2D"],
            up_block_types=["UpBlock2D", "CrossAttnUpBlock2D"], cross_attention_dim=32, attention_head_dim=8,
            norm_num_groups=8)


def _config(tmp_path, name, config):
    path = tmp_path / name / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(config))
    return str(path)


def test_a_causal_lm_of_another_family_is_planned(tmp_path):
    path = _config(tmp_path, "neox", NEOX)
    spec, source = resolve_model(path)
    assert isinstance(spec, ModelSpec) and spec.kind == "causal-lm" and source.endswith("neox")
    plan = will_it_fit(path, (2, 1), method="lora", seq_len=16, workers=1, say=None, checkpoints=(True,))
    assert plan.targets == ("dense", "dense_4h_to_h", "dense_h_to_4h", "query_key_value"), plan.targets
    assert {r.strategy for r in plan.rows} == {"DDP", "FSDP2"} and plan.chosen is not None
    report = plan.report()
    assert "scripts/finetune.py" in report and "--targets dense,dense_4h_to_h" in report, report


def test_a_unet_is_planned_with_the_diffusers_command(tmp_path):
    path = _config(tmp_path, "unet", UNET)
    plan = will_it_fit(path, (2, 1), method="full", workers=1, say=None, checkpoints=(True,))
    assert {r.strategy for r in plan.rows} == {"DDP", "ZeRO-2", "FSDP2"}, plan.rows
    report = plan.report()
    assert "images of 64 px" in report, report
    assert "accelerate launch" in report and "train_text_to_image.py" in report, report
    assert plan.targets == ("to_q", "to_k", "to_v", "to_out.0"), "a UNet's LoRA default, for the cheaper change"


def test_a_unet_refuses_a_decoders_targets(tmp_path):
    path = _config(tmp_path, "unet2", UNET)
    with pytest.raises(WillItFitError, match="no layer q_proj in"):
        will_it_fit(path, (2, 1), method="lora", targets=("q_proj",), workers=1, say=None)


def test_named_unets_resolve_without_a_download():
    for name in ("sd-1.5", "SD 2.1", "sdxl"):
        spec, hub = resolve_model(name)
        assert spec.kind == "unet" and hub.count("/") == 1, (name, hub)
