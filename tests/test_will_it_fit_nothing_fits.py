"""When nothing fits the reader's cards, will_it_fit names the cheapest change that fits the same cards, in plain
words, in the order a reader would try it: micro-batch 1 with accumulation, LoRA instead of full fine-tuning, QLoRA
instead of LoRA (then more cards, tests/test_will_it_fit.py); each with the scripts/finetune.py command that runs
it. Cards are sized from the rows measured here, so each case sits between the rows it separates.

    .venv/bin/python -m pytest -q -n 0 tests/test_will_it_fit_nothing_fits.py
"""
import pytest

from course_utils.true_size import GiB, LlamaShape
from course_utils.will_it_fit import USABLE, will_it_fit

# wide linears, a small vocabulary: the base's bytes dominate, as in a 7B model
WIDE = LlamaShape("wide", vocab_size=64, d_model=128, n_layer=4, d_ff=512, n_head=4, n_kv_head=2)
QUIET = lambda *a: None  # noqa: E731
KW = dict(seq_len=16, lora_r=4, workers=1, say=QUIET, max_cards=8)


@pytest.fixture(scope="module")
def kw(tmp_path_factory):
    """KW with one measurement cache for the module: a plan on other cards re-reads the steps another plan measured
    (the cache's keys and reads: tests/test_will_it_fit_cache.py)."""
    return dict(KW, cache=str(tmp_path_factory.mktemp("will_it_fit_cache")))


def lowest(plan, method, same=True):
    return min(r.peak for r in plan.rows if r.method == method and (r.same_training or not same))


def test_full_fine_tuning_that_does_not_fit_says_lora_does(kw):
    full = will_it_fit(WIDE, (1, 1024), method="full", **kw)
    lora = will_it_fit(WIDE, (1, 1024), method="lora", **kw)
    card = lowest(lora, "lora") / USABLE / GiB * 1.001                  # LoRA's cheapest row just fits
    assert min(r.peak for r in full.rows) > USABLE * card * GiB, "full fine-tuning must not fit this card"
    plan = will_it_fit(WIDE, (1, card), method="full", **kw)
    assert plan.chosen is None and plan.cheaper is not None and plan.cheaper[1].method == "lora", plan.cheaper
    report = plan.report()
    assert (f"Full fine-tuning does not fit 1 x {card:g} GiB with the 85% margin, with any strategy above; "
            "LoRA (r = 4 on q_proj,v_proj) does, on the same cards: bf16 base DDP") in report, report
    assert "scripts/finetune.py" in report and "--method lora" in report and "--nproc-per-node=1" in report, report


def test_lora_that_does_not_fit_says_qlora_does(kw):
    lora = will_it_fit(WIDE, (2, 1024), method="qlora", **kw)
    q = lowest(lora, "qlora")
    card = q / USABLE / GiB * 1.001                                     # QLoRA just fits
    assert lowest(lora, "lora") > USABLE * card * GiB, "LoRA over a bf16 base must not fit this card"
    plan = will_it_fit(WIDE, (2, card), method="lora", **kw)
    assert plan.chosen is None and plan.cheaper[1].method == "qlora", plan.cheaper
    assert plan.cheaper[1].peak == q
    report = plan.report()
    assert (f"LoRA over a bf16 base does not fit 2 x {card:g} GiB with the 85% margin, with any strategy above; "
            "QLoRA (a 4-bit base) does, on the same cards: 4-bit base DDP") in report, report


def test_a_large_micro_batch_that_does_not_fit_says_micro_batch_1_with_accumulation_does(kw):
    kw = dict(kw, seq_len=64)
    one = will_it_fit(WIDE, (1, 1024), method="lora", micro_batch=1, **kw)
    four = will_it_fit(WIDE, (1, 1024), method="lora", micro_batch=4, **kw)
    card = lowest(one, "lora") / USABLE / GiB * 1.001
    assert lowest(four, "lora") > USABLE * card * GiB, "micro-batch 4 must not fit this card"
    plan = will_it_fit(WIDE, (1, card), method="lora", micro_batch=4, **kw)
    report = plan.report()
    assert plan.chosen is None and "; micro-batch 1 with 32 accumulation steps (the same global batch of 32) does, " \
        "on the same cards: bf16 base DDP" in report, report
    assert "--micro-batch-size 1 --accum-steps 32 --global-batch-size 32" in report, report    # its command


def test_the_reader_s_question_llama_3_8b_lora_on_2_rtx_3060():
    """The reader's question: LoRA of Llama 3 8B on 2 x RTX 3060 (12 GB). Nothing over a bf16 base fits two; QLoRA does
    (its non-4-bit parameters counted in fp32), said in plain words. Checkpointing only, no search for more cards:
    the cheapest rows, in a minute."""
    plan = will_it_fit("llama-3-8b", "2 x RTX 3060", method="lora", checkpoints=(True,), workers=1, say=QUIET,
                       max_cards=2)
    report = plan.report()
    assert plan.chosen is None and plan.cheaper[1].method == "qlora", report
    assert "cards: 2 x RTX 3060 12GB (12 GiB); a row fits when its peak is at most 85% of a card (10.20 GiB); " \
        "'RTX 3060' read as the 12 GB model" in report, report
    assert ("LoRA over a bf16 base does not fit 2 x RTX 3060 12GB (12 GiB) with the 85% margin, with any strategy "
            "above; QLoRA (a 4-bit base) does, on the same cards: 4-bit base DDP + ckpt on 2 cards, ") in report, report
    assert "No card count up to 2 fits (--max-cards)" in report, report


def test_check_runs_the_cheaper_change_whose_command_was_printed(kw, tmp_path, capsys, monkeypatch):
    """scripts/will_it_fit.py --check trains the plan whose command it printed: here LoRA, not the full fine-tuning
    on more cards that the search also found."""
    import importlib.util
    import json

    from conftest import ROOT

    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": WIDE.d_model, "intermediate_size": WIDE.d_ff,
              "num_attention_heads": WIDE.n_head, "num_key_value_heads": WIDE.n_kv_head,
              "num_hidden_layers": WIDE.n_layer, "vocab_size": WIDE.vocab_size, "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(config))
    lora = will_it_fit(WIDE, (1, 1024), method="lora", **kw)
    card = round(lowest(lora, "lora") / USABLE / GiB * 1.01, 6)
    spec = importlib.util.spec_from_file_location("will_it_fit_script", ROOT / "scripts" / "will_it_fit.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    monkeypatch.setenv("TMPDIR", str(tmp_path))   # the torchelastic_* folder of --check's torchrun
    rc = script.main(["--model", str(tmp_path), "--cards", f"1x{card}", "--method", "full", "--seq-len", "16",
                      "--lora-r", "4", "--workers", "1", "--max-cards", "8", "--check"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "; LoRA (r = 4 on q_proj,v_proj) does, on the same cards: bf16 base DDP + ckpt on 1 card" in out, out
    assert "scripts/finetune.py" in out and "--checkpointing" in out, out
    assert "\ncheck: DDP + ckpt on 2 CPU ranks" in out and "-> the same training" in out, out
    assert "--model tiny --method lora --strategy ddp" in out and "\ncheck: the command ran: final loss" in out, out
