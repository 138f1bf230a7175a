"""QLoRA counted as the printed recipe runs: peft's prepare_model_for_kbit_training casts every parameter that is not
4-bit (embedding, lm_head, norms, biases) to fp32, so will_it_fit counts them at 4 B; Llama-3-8B QLoRA on one 8 GiB
card does not fit (about 8.2 GiB with the cast; 6.25 GiB when they were counted at bf16's 2 B).

    .venv/bin/python -m pytest -q -n 0 tests/test_will_it_fit_qlora.py
"""
import torch

from course_utils.true_size import GiB, LlamaShape, LlamaShaped
from course_utils.will_it_fit import MODELS, NF4_BITS, qlora_base_bytes, qlora_counts, will_it_fit

LLAMA3_8B = MODELS["llama-3-8b"][0]
TINY = LlamaShape("tiny", vocab_size=300, d_model=64, n_layer=2, d_ff=160, n_head=4, n_kv_head=2, qkv_bias=True,
                  tie_embeddings=True)


def test_the_4_bit_parameters_are_the_decoder_linears_weights():
    for shape in (LLAMA3_8B, TINY, MODELS["qwen2.5-0.5b"][0]):
        with torch.device("meta"):
            model = LlamaShaped(shape)
        linears = sum(m.weight.numel() for m in model.modules()
                      if isinstance(m, torch.nn.Linear) and m.weight.shape[0] != shape.vocab_size)
        assert qlora_counts(shape) == (linears, shape.n_params - linears), (shape.name, qlora_counts(shape), linears)


def test_llama_3_8b_counted_bytes_of_the_parameters_that_stay_unquantised():
    four_bit, other = qlora_counts(LLAMA3_8B)
    # embedding and lm_head (128256 x 4096 each, untied) and 65 RMSNorm weights of 4096
    assert other == 2 * 128256 * 4096 + (2 * 32 + 1) * 4096 == 1_050_939_392
    assert four_bit == 8_030_261_248 - other
    assert qlora_base_bytes(LLAMA3_8B) == four_bit * NF4_BITS / 8 + 4 * other   # fp32, as peft's cast leaves them
    assert abs(2 * other / GiB - 1.96) < 0.005, "the cast adds 1.96 GiB over bf16's 2 B"


def test_llama_3_8b_qlora_does_not_fit_one_8_gib_card():
    plan = will_it_fit("llama-3-8b", "1 x 8 GiB", method="qlora", checkpoints=(True,), workers=1, say=None)
    rows = {r.method: r for r in plan.rows}
    q, lora = rows["qlora"], rows["lora"]
    shift = qlora_base_bytes(LLAMA3_8B) - 2 * LLAMA3_8B.n_params              # the bf16 base replaced
    assert abs(q.peak - lora.peak - shift) < 1, (q.peak, lora.peak, shift)       # to the byte (float sums)
    assert abs(q.peak / GiB - 8.21) < 0.05 and q.verdict(8 * GiB) == "no: over the card", q.peak / GiB
    assert plan.chosen is None and "QLoRA does not fit 1 x 8 GiB" in plan.report()
    assert q.fits(12 * GiB), "one 12 GiB card holds it"
