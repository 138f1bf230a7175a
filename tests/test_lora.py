"""course_utils.lora (16_fine_tuning_small_cards): LoRA by hand equals peft, merges, saves adapters peft loads, and
lesson 13's peak meter (memory.peak_memory) over a frozen base and the fake-tensor true-size measurement agree with
the formulas. One process.

    .venv/bin/python -m pytest tests/test_lora.py -p no:randomly
"""
import copy
import functools

import pytest
import torch

from course_utils.lora import (LoRALinear, add_lora, causal_lm_loss, copy_into_peft, finetune_batch,
                               lora_parameter_count, load_model, peft_lora_config, save_adapter, tiny_tokenizer,
                               true_size_peak)
from course_utils.memory import peak_memory
from course_utils.true_size import LlamaShape

TARGETS, R, ALPHA = ("q_proj", "v_proj"), 4, 8


@pytest.fixture(scope="module")
def batch():
    _, data = tiny_tokenizer()
    return finetune_batch(data, 0, 0, 4, 4)


def _with_random_b(model, seed=1):
    torch.manual_seed(seed)
    for m in model.modules():
        if isinstance(m, LoRALinear):
            torch.nn.init.normal_(m.lora_B, std=0.02)
    return model


def test_lora_starts_equal_to_the_base_and_counts_as_the_formula(batch):
    x, _ = batch
    base = load_model("tiny")
    hand = add_lora(copy.deepcopy(base), TARGETS, R, ALPHA)
    with torch.no_grad():
        assert torch.equal(hand(input_ids=x).logits, base(input_ids=x).logits)
    trainable = sum(p.numel() for p in hand.parameters() if p.requires_grad)
    cfg = base.config
    kv = cfg.num_key_value_heads * cfg.hidden_size // cfg.num_attention_heads
    by_hand = cfg.num_hidden_layers * R * ((cfg.hidden_size + cfg.hidden_size) + (cfg.hidden_size + kv))
    assert trainable == lora_parameter_count(base, TARGETS, R) == by_hand


def test_hand_lora_equals_peft_in_outputs_and_gradients(batch):
    from peft import get_peft_model

    x, y = batch
    base = load_model("tiny")
    hand = _with_random_b(add_lora(copy.deepcopy(base), TARGETS, R, ALPHA))
    theirs = get_peft_model(copy.deepcopy(base), peft_lora_config(TARGETS, R, ALPHA))
    assert copy_into_peft(hand, theirs) == 2 * base.config.num_hidden_layers
    a, b = causal_lm_loss(hand, x, y), causal_lm_loss(theirs, x, y)
    a.backward()
    b.backward()
    torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    mine = [p.grad for p in hand.parameters() if p.requires_grad]
    them = [p.grad for p in theirs.parameters() if p.requires_grad]
    assert len(mine) == len(them) == 4 * base.config.num_hidden_layers // 2 * 2
    for g, h in zip(mine, them):
        torch.testing.assert_close(g, h, rtol=1e-5, atol=1e-7)


def test_merge_keeps_the_outputs_within_rounding(batch):
    x, _ = batch
    hand = _with_random_b(add_lora(load_model("tiny"), TARGETS, R, ALPHA))
    with torch.no_grad():
        before = hand(input_ids=x).logits
        for m in hand.modules():
            if isinstance(m, LoRALinear):
                m.merge()
        after = hand(input_ids=x).logits
    torch.testing.assert_close(after, before, rtol=0, atol=1e-4)
    base = load_model("tiny")(input_ids=x).logits
    assert not torch.equal(after, base), "the merged weights must differ from the base"


def test_saved_adapters_load_with_peft_and_give_the_same_logits(batch, tmp_path):
    from peft import PeftModel

    x, _ = batch
    base_dir = tmp_path / "base"
    load_model("tiny").save_pretrained(str(base_dir))
    hand = _with_random_b(add_lora(load_model(str(base_dir)), TARGETS, R, ALPHA))
    folder = save_adapter(hand, tmp_path / "adapter", TARGETS, R, ALPHA, base=base_dir)
    assert sorted(p.name for p in folder.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    loaded = PeftModel.from_pretrained(load_model(str(base_dir)), str(folder))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=x).logits, hand(input_ids=x).logits, rtol=0, atol=1e-6)


def test_bad_inputs_get_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="its linear layers are"):
        add_lora(load_model("tiny"), targets=("query",))
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_model(str(tmp_path))
    with pytest.raises(TypeError, match="wraps an nn.Linear"):
        LoRALinear(torch.nn.Conv1d(2, 2, 1))


def test_peak_memory_accepts_frozen_parameters(batch):
    x, y = batch
    model = add_lora(load_model("tiny"), TARGETS, R, ALPHA)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, foreach=False)

    def step():
        causal_lm_loss(model, x, y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    peak = peak_memory(step, model, optimizer)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    assert peak["parameters"] == 4 * total
    assert peak["optimizer_state"] >= 8 * trainable
    assert peak["total"] > peak["parameters"] + peak["optimizer_state"]


# A small grouped-query Llama, as a LlamaShape (as MISTRAL_7B is given) and as LlamaConfig's arguments (as LLAMA_2_7B)
SHAPE = LlamaShape("small", vocab_size=1000, d_model=256, n_layer=2, d_ff=512, n_head=4, n_kv_head=2)
SMALL = dict(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)


@functools.cache
def lora_ddp_true_size():
    """true_size_peak of LoRA r = 16 on q_proj, v_proj over a bf16 base, DDP on one rank, of SHAPE: one measurement,
    read by the two tests below. Read-only."""
    return true_size_peak(SHAPE, lora=True, strategy="ddp", world_size=1, seq_len=64)


def test_true_size_with_fake_tensors_matches_the_formulas():
    full = true_size_peak(SMALL, lora=False, strategy="fsdp", world_size=2, seq_len=64)
    n = full["params"]
    assert n == SHAPE.n_params, (n, SHAPE.n_params)                          # SMALL and SHAPE: one model
    state = full["parameters"] + full["gradients"] + full["optimizer_state"]
    # FSDP2 at W = 2 with foreach=False AdamW: 4 + 4 + 8 bytes per parameter, halved, at the optimizer step's peak
    assert abs(state - 16 * n / 2) < 0.02 * 16 * n / 2, (state, 16 * n / 2)
    lora = lora_ddp_true_size()
    base = lora["params"] - lora["trainable"]
    assert lora["parameters"] == 2 * base + 4 * lora["trainable"], lora     # a bf16 base, fp32 adapters
    assert lora["total"] < full["total"] * 2


def test_true_size_peak_agrees_with_lesson_14s_measure_step():
    """15's cell "At the true size" sizes the 7B rows with measure_step; true_size_peak (exercise 3) measures the same
    step on transformers' LlamaForCausalLM. On a small grouped-query shape, given as a LlamaShape as MISTRAL_7B is,
    the two peaks agree within 3 % (DDP on one rank, FSDP2 at W = 2)."""
    from course_utils.true_size import measure_step, step_peak

    def lora_over_bf16_base(model):
        model.to(torch.bfloat16)
        add_lora(model, targets=("q_proj", "v_proj"), r=16, alpha=32)
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.data = p.data.float()

    lora = dict(modify=lora_over_bf16_base, seq_len=64, checkpoint=True)
    ddp = measure_step(SHAPE, strategy="replica", **lora)
    theirs = lora_ddp_true_size()                        # true_size_peak(SHAPE, lora=True, strategy="ddp", ...)
    ours = step_peak(ddp)[0] + 4 * ddp["n_trainable"]                   # + DDP's bucket, as the lesson adds it
    assert abs(theirs["total"] - ours) < 0.03 * ours, ("DDP", theirs["total"], ours)
    fsdp = measure_step(SHAPE, strategy="fsdp2", world_size=2, mixed_precision=True, **lora)
    theirs = true_size_peak(SHAPE, lora=True, strategy="fsdp", world_size=2, seq_len=64)
    assert abs(theirs["total"] - step_peak(fsdp)[0]) < 0.03 * step_peak(fsdp)[0], ("FSDP2", theirs, step_peak(fsdp))


def test_mistral_7b_is_one_object_and_true_size_peak_takes_it():
    import course_utils.lora as lora
    import course_utils.true_size as true_size
    from course_utils.lora import llama_config

    assert lora.MISTRAL_7B is true_size.MISTRAL_7B, "one MISTRAL_7B for lessons 14 and 16"
    config = llama_config(true_size.MISTRAL_7B)
    assert (config["hidden_size"], config["intermediate_size"], config["num_key_value_heads"]) == (4096, 14336, 8)
    with pytest.raises(TypeError, match="LlamaShape"):
        llama_config([4096])


def test_card_verdicts_size_cards_in_gib():
    """The numbers that once fooled lesson 16: LoRA + DDP at 14.0e9 bytes was judged against 0.85 x 16e9 = 13.6e9 and
    refused a 16 GB card, which has 16 GiB: 0.85 x 16 GiB = 14.6e9 bytes."""
    from course_utils.lora import card_verdicts
    from course_utils.true_size import GiB

    peaks = {("LoRA", "DDP", "any"): (14.0e9, "measured"),
             ("LoRA", "FSDP2", 4): (5.3e9, "measured"), ("LoRA", "FSDP2", 2): (8.7e9, "measured"),
             ("full", "FSDP2", 4): (27.2e9, "counted")}
    v = card_verdicts(peaks, cards=(8, 16, 24), usable=0.85)
    assert v[16]["LoRA", "DDP"] == ("any", 14.0e9), "14.0e9 bytes fit 85% of 16 GiB"
    assert v[8]["LoRA", "DDP"] is None and v[8]["LoRA", "FSDP2"] == (4, 5.3e9), v[8]
    assert v[16]["LoRA", "FSDP2"] == (2, 8.7e9), "the fewest cards that fit"
    assert all(v[c]["full", "FSDP2"] is None for c in (8, 16, 24)), "27.2e9 > 0.85 x 24 GiB"
    edge = card_verdicts({("m", "s", "any"): (0.85 * 16 * GiB, "")}, cards=(16,))
    assert edge[16]["m", "s"] is not None, "a peak equal to the budget fits"
