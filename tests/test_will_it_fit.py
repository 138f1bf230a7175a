"""course_utils.will_it_fit and scripts/will_it_fit.py: the reader's own model on the reader's own cards.

Published parameter counts; fake = real bytes per phase for every measurement the tool's rows are made of (lesson 16's
method, on a tiny shape with every layer type); the extension of a replica from 2 and 3 blocks to the true depth,
to the byte; the verdicts of lessons 14 and 16's known cases; --check on real gloo ranks, passing and catching a
planted wrong strategy; bad inputs.

    .venv/bin/python -m pytest -q -n 0 tests/test_will_it_fit.py
"""
import dataclasses
import json
import re
import warnings

import pytest
import torch

from conftest import ROOT
from course_utils.true_size import GB, GiB, LLAMA2_7B, LlamaShape, LlamaShaped, measure_step, step_peak
from course_utils.will_it_fit import (CARDS, MODELS, USABLE, WillItFitError, _jobs, _pick, _rows, _run_jobs,
                                      check_plan, measure_replica, parse_cards, resolve_model, shape_from_config,
                                      tiny_like, will_it_fit)

warnings.filterwarnings("ignore", message="DTensor random operators")

PUBLISHED = {"llama-2-7b": 6_738_415_616, "llama-3-8b": 8_030_261_248, "mistral-7b": 7_241_732_096,
             "qwen2.5-0.5b": 494_032_768, "qwen2.5-1.5b": 1_543_714_304, "qwen2.5-7b": 7_615_616_512}
# Every layer type the tool builds: grouped-query attention, q/k/v biases, tied embeddings.
TINY = LlamaShape("tiny", vocab_size=300, d_model=64, n_layer=2, d_ff=160, n_head=4, n_kv_head=2, qkv_bias=True,
                  tie_embeddings=True)
QUIET = lambda *a: None  # noqa: E731  (no progress line in the tests' output)


def test_published_shapes_have_their_published_parameter_counts():
    for name, count in PUBLISHED.items():
        shape, hub = resolve_model(name)
        assert shape.n_params == count, (name, shape.n_params, count)
        with torch.device("meta"):
            built = sum(p.numel() for p in LlamaShaped(shape).parameters())   # tied weights counted once
        assert built == count, (name, built, count)
    assert abs(16 * MODELS["article-14gb"][0].n_params / 1e9 - 14) < 0.1
    assert resolve_model("meta-llama/Llama-2-7b-hf")[0] is MODELS["llama-2-7b"][0], "a known hub name: no download"


def test_a_config_json_is_read_and_an_unsupported_one_is_refused(tmp_path):
    qwen = {"architectures": ["Qwen2ForCausalLM"], "hidden_size": 896, "intermediate_size": 4864,
            "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2, "vocab_size": 151936,
            "tie_word_embeddings": True, "model_type": "qwen2"}       # Qwen/Qwen2.5-0.5B's config.json
    (tmp_path / "config.json").write_text(json.dumps(qwen))
    shape, source = resolve_model(str(tmp_path))
    assert shape.n_params == PUBLISHED["qwen2.5-0.5b"] and source == str(tmp_path)
    gpt2 = {"architectures": ["GPT2LMHeadModel"], "n_embd": 768, "model_type": "gpt2"}
    (tmp_path / "gpt2.json").write_text(json.dumps(gpt2))
    # a decoder that the Llama-shaped path does not build goes to transformers' own classes, which need the layer
    # count that the measurement extends from
    with pytest.raises(WillItFitError, match="gpt2.json: config.json has no num_hidden_layers: give a decoder's"):
        resolve_model(str(tmp_path / "gpt2.json"))
    with pytest.raises(WillItFitError, match="attention_bias"):
        shape_from_config({**qwen, "architectures": ["LlamaForCausalLM"], "attention_bias": True})


def test_bad_names_list_the_known_ones(capsys):
    with pytest.raises(WillItFitError, match="unknown card 'GTX 1080'; closest: .*RTX 4080"):
        parse_cards("2xGTX 1080")
    with pytest.raises(WillItFitError, match="unknown model 'llama-9b'.*llama-2-7b.*qwen2.5-7b"):
        resolve_model("llama-9b")
    assert parse_cards("2x16GiB")[:2] == (2, 16.0)
    assert parse_cards("8xA100-80")[:2] == (8, 80.0)
    assert parse_cards("RTX 4090")[:2] == (1, 24.0) and parse_cards("2 x rtx3090")[:2] == (2, 24.0)
    assert all(parse_cards(f"1x{name}")[1] == gib for name, gib in CARDS.items())

    import importlib.util                 # the script's own main, in this process (a fresh one would only import torch)
    spec = importlib.util.spec_from_file_location("will_it_fit_script", ROOT / "scripts" / "will_it_fit.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main(["--model", "llama-2-7b", "--cards", "2xB200"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("will_it_fit: --cards '2xB200': unknown card 'B200'; closest: H200") and \
        err.count("\n") == 1, err


def _all_jobs(shape, W=2, seq_len=8, replicas_only=False):
    """The measurements of every row kind: full and LoRA, mixed and fp32, replica and FSDP2, with and without
    checkpointing (each pair of settings at least once, not every product: the module's time is budgeted)."""
    wanted = {("full", "mixed", "replica"), ("full", "mixed", "replica + ckpt"), ("full", "fp32", "replica"),
              ("full", "mixed", f"FSDP2 W={W}"), ("full", "fp32", f"FSDP2 W={W} + ckpt"),
              ("lora", "mixed", "replica + ckpt"), ("lora", "fp32", "replica"), ("lora", "mixed", f"FSDP2 W={W}")}
    jobs = {}
    for method, precision, name in sorted(wanted):
        job = _jobs(shape, method, W, seq_len, 2, 4, ("q_proj", "v_proj"), precision)[name]
        if not replicas_only or job[0] == "replica":
            jobs[method, precision, name] = job
    return jobs


def test_fake_tensors_measure_what_real_tensors_do_for_every_row():
    """Every measurement a row of the tool is made of (full and LoRA, mixed and fp32, replica and FSDP2, with and
    without checkpointing), fake against real tensors, phase by phase and kind by kind (lesson 16's method).
    The counted rows (ZeRO, mixed-precision replicas, DDP's bucket, QLoRA) are counts on these."""
    for key, (kind, shape, kw) in _all_jobs(TINY).items():
        strategy = "replica" if kind == "replica" else "fsdp2"
        fake = measure_step(shape, strategy=strategy, **kw)
        real = measure_step(shape, strategy=strategy, fake=False, **kw)
        for phase in ("forward", "backward", "step"):
            assert fake[phase] == real[phase], (key, phase, fake[phase], real[phase])


def test_a_replica_measured_at_2_and_3_blocks_is_the_replica_measured_whole():
    deep = dataclasses.replace(TINY, n_layer=4)
    for key, (kind, _, kw) in _all_jobs(deep, replicas_only=True).items():
        extended = measure_replica(deep, **kw)
        whole = measure_step(deep, strategy="replica", **kw)
        assert extended["how"] == "measured (blocks 2, 3)"
        for phase in ("forward", "backward", "step"):
            assert extended[phase] == whole[phase], (key, phase, extended[phase], whole[phase])
        assert extended["n_trainable"] == whole["n_trainable"], key


def test_llama_2_7b_lora_fits_one_24_and_two_16_gib_cards_as_lesson_16_says():
    """Lesson 16's case: Llama-2-7B LoRA r = 16 on q_proj, v_proj, bf16 base, 512 tokens, activation checkpointing
    (as the lesson's table). One measured replica serves both: on one card, and DDP on two (its bucket added)."""
    plan = will_it_fit("llama-2-7b", "1x24GiB", method="lora", checkpoints=(True,), workers=1, say=QUIET)
    (one,) = plan.rows
    assert one.label == "DDP + ckpt" and plan.chosen is one and one.world_size == 1
    assert plan.pick(16) is one and plan.pick(8) is None            # the same rows judged on other cards
    rows = _rows(plan.shape, "lora", 2, plan.results, "mixed")
    (two,) = rows
    # lesson 16's table: LoRA over a bf16 base with DDP, 13.0 GiB per card: yes on 16 and 24 GiB cards
    assert abs(two.peak / GiB - 13.0) < 0.05 and two.fits(16 * GiB) and _pick(rows, 16 * GiB) is two, two.peak / GiB
    plan = dataclasses.replace(plan, cards=2, card_gib=16.0, card_label="2 x 16 GiB", rows=rows, chosen=two)
    cmd, _ = plan.command()
    assert cmd == ("torchrun --standalone --nproc-per-node=2 scripts/finetune.py --model meta-llama/Llama-2-7b-hf "
                   "--method lora --strategy ddp --precision mixed --lora-r 16 --targets q_proj,v_proj --seq-len 512 "
                   "--micro-batch-size 1 --accum-steps 16 --global-batch-size 32 --checkpointing")
    import importlib.util
    spec = importlib.util.spec_from_file_location("finetune", ROOT / "scripts" / "finetune.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    args = script.parse_args(cmd.split()[4:])                               # the script accepts the line as it is
    assert (args.method, args.strategy, args.precision, args.lora_r, args.seq_len, args.micro_batch_size,
            args.accum_steps, args.global_batch_size, args.checkpointing) == \
        ("lora", "ddp", "mixed", 16, 512, 1, 16, 32, True)
    assert "Plan: bf16 base DDP + ckpt on 2 cards" in plan.report()


def test_the_article_s_14_gb_model_fits_no_two_8_gib_cards_as_lesson_14_says():
    """Lesson 14's case with AdamW as scripts/finetune.py runs it on a GPU (foreach=True): FSDP2's backward is the
    lesson's (for-loop) figure; its step holds foreach's list of temporaries (up to 4 B per parameter over W) where the
    for-loop held one parameter's: 8.18 GiB, over the 8 GiB card, where the lesson's for-loop step is 6.78."""
    shape = MODELS["article-14gb"][0]
    results = _run_jobs(_jobs(shape, "full", 2, 1024, 1, 16, (), "mixed", checkpoints=(True,)), 1, QUIET)
    rows = _rows(shape, "full", 2, results, "mixed")
    assert _pick(rows, 8 * GiB) is None, [(r.label, r.peak / GB) for r in rows]
    fsdp = next(r for r in rows if r.label == "FSDP2 + ckpt")
    # lesson 14's table: mixed FSDP2 + ckpt, backward 7.15 GiB (7.68 GB), step 6.78 GiB with the for-loop
    assert abs(fsdp.phases["backward"] / GB - 7.68) < 0.005, fsdp.phases
    rise = fsdp.phases["step"] - 6.78 * GiB                         # foreach's temporaries: at most 4 B / W each
    assert 0.75 * 4 * shape.n_params / 2 < rise <= 4 * shape.n_params / 2, (rise / GiB, fsdp.phases)
    zero2 = next(r for r in rows if r.label == "ZeRO-2 + ckpt")
    assert zero2.peak > USABLE * 8 * GiB, zero2.peak / GiB
    assert [r.strategy for r in rows] == ["DDP", "ZeRO-2", "FSDP2"], "the strategies scripts/finetune.py runs"


def test_a_plan_that_fits_nowhere_says_the_fewest_cards_that_fit():
    four = measure_step(TINY, strategy="fsdp2", world_size=4, mixed_precision=True, checkpoint=True, seq_len=32)
    card = step_peak(four)[0] / USABLE / GiB * 1.001                     # FSDP2 at W = 4 just fits this card
    plan = will_it_fit(TINY, (1, card), method="full", seq_len=32, workers=1, say=QUIET)
    assert plan.chosen is None and plan.smallest is not None
    W = plan.smallest.world_size
    assert 1 < W <= 4 and plan.smallest.fits(card * GiB), plan.smallest
    fewer = []
    if W > 2:   # every row on W - 1 cards: what the search measured already (plan.results) is not measured again
        jobs = {name: job for name, job in _jobs(TINY, "full", W - 1, 32, 1, 16, (), "mixed").items()
                if name not in plan.results}
        fewer = _rows(TINY, "full", W - 1, {**plan.results, **_run_jobs(jobs, 1, QUIET)}, "mixed")
    assert all(not r.fits(card * GiB) for r in fewer if r.same_training), "W - 1 cards must not fit"
    assert f"Smallest card count that fits: {W} cards" in plan.report()


@pytest.fixture(scope="module")
def cluster2(make_cluster):
    return make_cluster(2, timeout=120)


@pytest.mark.parametrize("strategy", ["DDP", "ZeRO-2", "FSDP2"])
def test_check_trains_the_same_model_and_catches_a_gradient_averaged_twice(cluster2, strategy):
    shape = MODELS["qwen2.5-0.5b"][0]                       # biases and tied embeddings in the tiny copy too
    assert tiny_like(shape).qkv_bias and tiny_like(shape).tie_embeddings
    ok, diff, got, ref = check_plan(shape, "full", strategy, checkpoint=True, cluster=cluster2)
    assert ok, (strategy, diff, got, ref)
    ok, diff, got, ref = check_plan(shape, "full", strategy, checkpoint=True, cluster=cluster2, bug="average twice")
    assert not ok and diff > 1e-3, (strategy, diff, got, ref)


PRINTED = ("torchrun --standalone --nproc-per-node=4 scripts/finetune.py --model meta-llama/Llama-2-7b-hf --method {m} "
           "--strategy {s} --precision mixed{lora} --seq-len 512 --micro-batch-size 1 --accum-steps 16 "
           "--global-batch-size 64 --checkpointing")


@pytest.mark.parametrize("method, strategy", [("full", "ddp"), ("full", "zero2"), ("full", "fsdp"), ("lora", "ddp"),
                                              ("lora", "fsdp"), ("qlora", "ddp")])
def test_check_runs_each_printed_command_at_tiny_scale(method, strategy, tmp_path, monkeypatch):
    """--check's run of the printed command: the tiny Llama on 2 CPU ranks, 32 tokens, 2 steps, at most 2
    micro-batches; the plan's method, strategy, precision, LoRA settings, micro-batch and checkpointing kept.
    tests/test_finetune_script.py runs each of these methods and strategies; lesson 16's plan (LoRA, FSDP2,
    checkpointing, 16 micro-batches) runs here as --check runs it."""
    from course_utils.will_it_fit import run_tiny, tiny_command

    lora = " --lora-r 16 --targets q_proj,v_proj" if method != "full" else ""
    printed = PRINTED.format(m=method, s=strategy, lora=lora)
    args = tiny_command(printed)
    if method == "qlora":
        assert args is None, "bitsandbytes needs a GPU: --check says so and runs nothing"
        return
    assert args == ["--standalone", "--nproc-per-node=2", "scripts/finetune.py", "--model", "tiny", "--method", method,
                    "--strategy", strategy, "--precision", "mixed", *lora.split(), "--seq-len", "32",
                    "--micro-batch-size", "1", "--accum-steps", "2", "--global-batch-size", "4", "--steps", "2",
                    "--checkpointing", "--log-every", "1"], args
    with pytest.raises(ValueError, match="not a scripts/finetune.py command"):
        tiny_command("accelerate launch train_text_to_image.py")
    if (method, strategy) == ("lora", "fsdp"):
        monkeypatch.setenv("TMPDIR", str(tmp_path))   # torchrun's torchelastic_* folder goes there
        rc, out = run_tiny(args)
        assert rc == 0 and re.search(r"final_loss=[0-9.]+", out) and out.count("2 ranks on cpu") == 2, out[-3000:]


def test_check_of_a_lora_plan(cluster2):
    ok, diff, _, _ = check_plan(LLAMA2_7B, "lora", "DDP", cluster=cluster2)
    assert ok, diff
    ok, diff, _, _ = check_plan(LLAMA2_7B, "lora", "DDP", cluster=cluster2, bug="average twice")
    assert not ok, diff
