"""course_utils.true_size (14_will_it_fit): a real-size model's training memory, measured with fake tensors; and
memory.collective_scratch_bytes, gloo's own buffers.

    .venv/bin/python -m pytest tests/test_true_size.py -p no:randomly
"""
import sys
import warnings

import pytest
import torch.distributed as dist

from course_utils.true_size import (ARTICLE_14GB, BUCKET_BYTES, LINEARITY_TOLERANCE, LLAMA2_7B, MISTRAL_7B,
                                    LlamaShape, LlamaShaped, cpu_adamw_seconds, fake_world, measure_step,
                                    replica_phases, replica_strategies, step_peak)

from conftest import register_by_value  # noqa: E402

register_by_value(sys.modules[__name__])  # the ranks cannot import this test module
warnings.filterwarnings("ignore", message="DTensor random operators")

TINY = LlamaShape("tiny", vocab_size=300, d_model=128, n_layer=2, d_ff=344, n_head=4, n_kv_head=2)


def test_published_shapes_have_their_published_parameter_counts():
    # Llama 2 7B: 6,738,415,616 parameters (the model card's 6.7B); Mistral 7B v0.1: 7,241,732,096
    assert LLAMA2_7B.n_params == 6_738_415_616
    assert MISTRAL_7B.n_params == 7_241_732_096
    assert abs(16 * ARTICLE_14GB.n_params / 1e9 - 14) < 0.1, "the article's model holds 14 GB of fp32 AdamW state"
    import torch
    with torch.device("meta"):
        for shape in (TINY, LlamaShape("gqa", 500, 256, 3, 688, 8, 2)):
            assert sum(p.numel() for p in LlamaShaped(shape).parameters()) == shape.n_params, shape


@pytest.mark.parametrize("setup", [dict(strategy="fsdp2", world_size=2), dict(strategy="fsdp2", world_size=4,
                                   mixed_precision=True), dict(strategy="replica", checkpoint=True)])
def test_fake_tensors_measure_what_real_tensors_do(setup):
    fake = measure_step(TINY, seq_len=32, **setup)
    real = measure_step(TINY, seq_len=32, fake=False, **setup)
    for phase in ("forward", "backward", "step"):
        assert fake[phase] == real[phase], (setup, phase, fake[phase], real[phase])
    assert fake["step"]["total"] > 0 and fake["n_params"] == TINY.n_params


def test_fsdp2_shards_the_state_and_the_replica_keeps_it_whole():
    one = measure_step(TINY, strategy="replica", seq_len=32)
    n = TINY.n_params
    assert one["step"]["parameters"] >= 4 * n and one["step"]["optimizer_state"] >= 8 * n, one["step"]
    for W in (2, 4):
        r = measure_step(TINY, strategy="fsdp2", world_size=W, seq_len=32)
        state = r["step"]["optimizer_state"]
        # the moments, plus the for-loop AdamW's temporaries: three of the largest shard (and the step counters)
        largest = 4 * TINY.d_model * TINY.d_ff / W
        assert 8 * n / W <= state <= 8 * n / W + 3 * largest + 4096, (W, state)
        assert step_peak(r)[0] < step_peak(one)[0], W
    counted = replica_strategies(one, 2)
    assert counted["DDP"] > counted["ZeRO-1"] > counted["ZeRO-2"], counted


def test_mixed_precision_rows_count_the_bf16_weights_once():
    """The mixed rows were counted on an autocast replica whose activations held autocast's bf16 weight copies, on
    top of 2 B/param of bf16 weights: mixed DDP came out above fp32 DDP (21.37 against 20.46 GB at 14 GB)."""
    import torch

    fp32 = replica_strategies(measure_step(TINY, strategy="replica", seq_len=32), 2)
    bf16 = measure_step(TINY, strategy="replica", seq_len=32, modify=lambda m: m.to(torch.bfloat16))
    assert bf16["param_dtype"] == torch.bfloat16 and not bf16["autocast"]
    mixed = replica_strategies(bf16, 2, mixed_precision=True)
    for name in ("DDP", "ZeRO-1"):   # 2 + 2 + 12 + a 2 B bucket against 4 + 4 + 8 + a 4 B bucket
        assert mixed[name] < fp32[name], (name, mixed, fp32)
    autocast = measure_step(TINY, strategy="replica", seq_len=32, mixed_precision=True)
    with pytest.raises(ValueError, match="pure bf16"):
        replica_strategies(autocast, 2, mixed_precision=True)


def test_the_fake_world_refuses_a_process_that_already_has_a_group():
    with fake_world(2):
        with pytest.raises(RuntimeError, match="not a %%ddp cell"):
            with fake_world(2):
                pass
    assert not dist.is_initialized(), "fake_world destroys its group"


def test_an_unknown_strategy_says_which_exist():
    with pytest.raises(ValueError, match="'fsdp2' or 'replica'"):
        measure_step(TINY, strategy="ddp")
    assert not dist.is_initialized()


def gloo_scratch():
    import torch
    import torch.distributed as dist
    from course_utils.memory import collective_scratch_bytes
    size = 64 * 2**20
    full, shard = torch.ones(size // 4), torch.ones(size // 4 // dist.get_world_size())
    return {op: collective_scratch_bytes(fn) / size for op, fn in (
        ("all-gather", lambda: dist.all_gather_single(full, shard)),
        ("reduce-scatter", lambda: dist.reduce_scatter_single(shard, full)),
        ("all-reduce", lambda: dist.all_reduce(full)))}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_gloo_holds_one_copy_for_gather_and_scatter_and_none_for_all_reduce(make_cluster):
    for copies in make_cluster(2, timeout=120).run(gloo_scratch):
        assert round(copies["all-gather"]) == 1 and round(copies["reduce-scatter"]) == 1, copies
        assert round(copies["all-reduce"]) == 0, copies


def _lora_over_bf16_base(model):  # as 16_fine_tuning_small_cards's true-size cell
    import torch

    from course_utils.lora import add_lora

    model.to(torch.bfloat16)
    add_lora(model, targets=("q_proj", "v_proj"), r=4, alpha=8)
    for name, p in model.named_parameters():
        if "lora_" in name:
            p.data = p.data.float()


@pytest.mark.parametrize("setup", [dict(strategy="replica"), dict(strategy="fsdp2", world_size=2,
                                                                    mixed_precision=True)])
def test_a_frozen_base_with_adapters_is_measured_as_real_tensors_are(setup):
    """Lesson 16's true-size table: measure_step with a frozen bf16 base (MemTracker refused frozen parameters
    before skip_frozen) measures the bytes real tensors hold, and only the adapters get gradients and state."""
    fake = measure_step(TINY, seq_len=32, checkpoint=True, modify=_lora_over_bf16_base, **setup)
    real = measure_step(TINY, seq_len=32, checkpoint=True, modify=_lora_over_bf16_base, fake=False, **setup)
    for phase in ("forward", "backward", "step"):
        assert fake[phase] == real[phase], (setup, phase, fake[phase], real[phase])
    adapters = TINY.n_layer * 4 * (2 * TINY.d_model + TINY.n_kv_head * TINY.d_model // TINY.n_head + TINY.d_model)
    assert fake["n_trainable"] == adapters, (fake["n_trainable"], adapters)
    W = setup.get("world_size", 1)
    assert fake["backward"]["gradients"] <= 4 * adapters, "a frozen base must get no gradient"
    assert fake["step"]["optimizer_state"] <= 4 * (2 + 3) * adapters / W + 1024, "AdamW's state: the adapters' only"
    assert fake["step"]["parameters"] >= 2 * (TINY.n_params / W), "the base is kept, in bf16"


@pytest.mark.parametrize("setup", [dict(strategy="replica"), dict(strategy="fsdp2", world_size=2,
                                                                    mixed_precision=True)])
def test_the_step_trackers_keep_torch_s_own_peak(setup, monkeypatch):
    """measure_step's trackers skip torch's per-module peaks and walk an op's outputs their own way: each phase's
    peak, by kind, is still the one torch's MemTracker (FSDPMemTracker) measures, to the byte, over a frozen base
    with adapters and checkpointed blocks."""
    import course_utils.true_size as true_size
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker

    ours = measure_step(TINY, seq_len=32, checkpoint=True, modify=_lora_over_bf16_base, **setup)
    monkeypatch.setattr(true_size, "_step_peak_tracker", MemTracker)
    monkeypatch.setattr(true_size, "_fsdp_step_peak_tracker", FSDPMemTracker)
    torch_s = measure_step(TINY, seq_len=32, checkpoint=True, modify=_lora_over_bf16_base, **setup)
    for phase in ("forward", "backward", "step"):
        assert ours[phase] == torch_s[phase], (setup, phase, ours[phase], torch_s[phase])


@pytest.mark.parametrize("setup", [dict(strategy="fsdp2", world_size=2), dict(strategy="fsdp2", world_size=4,
                                   mixed_precision=True, checkpoint=True), dict(strategy="replica", foreach=True),
                                   dict(strategy="fsdp2", world_size=2, foreach=True, fake=False),
                                   dict(strategy="fsdp2", world_size=2, mixed_precision=True,
                                        modify=_lora_over_bf16_base)],
                         ids=["fsdp2", "fsdp2-bf16-checkpointed", "replica-foreach", "fsdp2-foreach-real",
                              "fsdp2-lora"])
def test_the_warm_up_on_zero_gradients_leaves_what_a_whole_step_leaves(setup):
    """measure_step's warm-up is one optimizer step on zero gradients (no forward, no backward): the measured step
    after it must see exactly the bytes it sees after a whole first training step."""
    quick = measure_step(TINY, seq_len=32, **setup)
    whole = measure_step(TINY, seq_len=32, warmup="full", **setup)
    for phase in ("forward", "backward", "step"):
        assert quick[phase] == whole[phase], (setup, phase, quick[phase], whole[phase])


def test_only_a_step_new_to_dtensor_s_caches_is_overcounted():
    """Lesson 14's explanation of the fake run's one known error: with DTensor's sharding-propagation caches empty,
    the first foreach step's optimizer state is overcounted under FakeTensorMode; with them full, it is not."""
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    shard = 4 * TINY.n_params / 2

    def first_step(fake, empty):
        if empty:
            _clear_sharding_prop_cache()
        r = measure_step(TINY, strategy="fsdp2", world_size=2, seq_len=8, foreach=True, fake=fake, warmup=False)
        return r["step"]["optimizer_state"] / shard

    real = first_step(False, True)
    assert first_step(True, True) > real + 1, "with empty caches, the fake first step counts DTensor's propagation"
    assert abs(first_step(True, False) - real) < 0.05, "with the caches full, the fake first step agrees"


def _kinds(parameters=0, gradients=0, optimizer_state=0, activations=0, temporaries=0):
    return dict(parameters=parameters, gradients=gradients, optimizer_state=optimizer_state, activations=activations,
                temporaries=temporaries, comm_buffers=0,
                total=parameters + gradients + optimizer_state + activations + temporaries)


# A measured replica of 100 trainable parameters, as measure_step reports one: its forward peak holds activations
# and no gradient, its backward peak some gradients and backward's temporaries, its step every gradient and the
# for-loop's temporaries (60 B of optimizer bytes beyond the forward's 800 B of moments).
FP32_REPLICA = dict(n_trainable=100, param_dtype=None, autocast=False, foreach=False,
                    forward=_kinds(400, 0, 800, 300), backward=_kinds(400, 250, 800, 0, 20), step=_kinds(400, 400, 860))
# The same in pure bf16 (the mixed rows' replica): bf16 weights, gradients and moments.
BF16_REPLICA = dict(n_trainable=100, param_dtype=None, autocast=False, foreach=False,
                    forward=_kinds(200, 0, 400, 150), backward=_kinds(200, 100, 400, 50, 10),
                    step=_kinds(200, 200, 430))


def test_replica_rows_are_counted_phase_by_phase_byte_for_byte():
    """Each row, each phase, counted by hand from the replica above (W = 2). A row that loses DDP's bucket (4 B a
    parameter fp32, 2 B mixed, in every phase), adds the whole gradient to the forward's activations (the old count:
    max(activations + temporaries) over phases plus all the state), shards the for-loop's temporaries, or steps the
    mixed master in bf16, fails here."""
    import torch

    fp32 = replica_phases(FP32_REPLICA, 2)
    assert fp32 == {
        # weights 400 + activations/temporaries + gradients + moments 800 (or 400) + step temporaries 60 + bucket 400
        "DDP": {"forward": 400 + 300 + 800 + 400, "backward": 400 + 20 + 250 + 800 + 400,
                "step": 400 + 400 + 800 + 60 + 400},
        "ZeRO-1": {"forward": 400 + 300 + 400 + 400, "backward": 400 + 20 + 250 + 400 + 400,
                   "step": 400 + 400 + 400 + 60 + 400},
        "ZeRO-2": {"forward": 400 + 300 + 400, "backward": 400 + 20 + 125 + 400 + 400,   # one bucket: every gradient
                   "step": 400 + 200 + 400 + 60}}, fp32
    assert replica_strategies(FP32_REPLICA, 2) == {"DDP": 2060, "ZeRO-1": 1660, "ZeRO-2": 420 + 125 + 400 + 400}
    bf16 = dict(BF16_REPLICA, param_dtype=torch.bfloat16)
    mixed = replica_phases(bf16, 2, mixed_precision=True)
    assert mixed == {
        # bf16 weights 200 + gradients + fp32 master and moments 1200 (or 600) + the master's temporaries 2 x 30
        # + the bf16 bucket 200
        "DDP": {"forward": 200 + 150 + 1200 + 200, "backward": 200 + 60 + 100 + 1200 + 200,
                "step": 200 + 200 + 1200 + 60 + 200},
        "ZeRO-1": {"forward": 200 + 150 + 600 + 200, "backward": 200 + 60 + 100 + 600 + 200,
                   "step": 200 + 200 + 600 + 60 + 200},
        "ZeRO-2": {"forward": 200 + 150 + 600, "backward": 200 + 60 + 50 + 600 + 200,
                   "step": 200 + 100 + 600 + 60},
        "offload": {"forward": 350, "backward": 360, "step": 400}}, mixed
    with pytest.raises(ValueError, match="pure bf16"):
        replica_phases(FP32_REPLICA, 2, mixed_precision=True)
    big = dict(FP32_REPLICA, n_trainable=10 ** 8)             # more gradients than one bucket: one bucket at a time
    assert replica_phases(big, 2)["ZeRO-2"]["backward"] == 400 + 20 + 125 + 8 * 10 ** 8 / 2 + BUCKET_BYTES


def test_foreach_temporaries_are_sharded_with_the_state_and_the_setting_is_the_measured_one():
    """With foreach=True the step's temporaries cover the list a rank steps: 1/W of them with ZeRO, all of them with
    DDP. The setting is the replica's own: asking for another one is refused."""
    fe = dict(FP32_REPLICA, foreach=True)
    steps = {name: ph["step"] for name, ph in replica_phases(fe, 2).items()}
    assert steps == {"DDP": 2060, "ZeRO-1": 400 + 400 + 400 + 30 + 400, "ZeRO-2": 400 + 200 + 400 + 30}, steps
    with pytest.raises(ValueError, match="measured with foreach=True"):
        replica_phases(fe, 2, foreach=False)
    unrecorded = {k: v for k, v in FP32_REPLICA.items() if k != "foreach"}     # a replica without the record
    assert replica_phases(unrecorded, 2, foreach=True)["ZeRO-1"]["step"] == 1630
    assert replica_phases(unrecorded, 2)["ZeRO-1"]["step"] == 1660, "unrecorded and unsaid: the for-loop"
    assert measure_step(TINY, strategy="replica", seq_len=8, foreach=True)["foreach"] is True


def test_a_replica_extended_by_blocks_keeps_its_setting_and_the_plan_counts_it_phase_by_phase():
    """will_it_fit measures a deep replica at 2 and 3 blocks and extends it: the extended replica keeps the AdamW
    setting it was measured with (else replica_phases would take foreach=True's temporaries as the for-loop's and
    leave them whole under ZeRO), and the plan's counted rows carry replica_phases' phases, each row's peak the
    largest of them (a row counted as one sum would hide which phase peaks)."""
    import dataclasses

    from course_utils.will_it_fit import _rows, measure_replica

    deep = dataclasses.replace(TINY, n_layer=4)
    replica = measure_replica(deep, seq_len=8, foreach=True)         # the setting the printed commands run
    assert replica["how"] == "measured (blocks 2, 3)", replica["how"]
    assert replica.get("foreach") is True, f"measure_replica(foreach=True) recorded {replica.get('foreach')}"
    counted = replica_phases(replica, 2)
    rows = [row for row in _rows(deep, "full", 2, {"replica": replica}, "fp32") if row.how.startswith("counted")]
    assert rows, "the plan has rows counted on the replica"
    for row in rows:
        assert row.phases == counted[row.strategy], (row.strategy, row.phases, counted[row.strategy])
        assert row.peak == max(counted[row.strategy].values()), row


def test_cpu_adamw_seconds_scales_the_probe_linearly():
    """The scaling, with timings given (no clock in the assert): seconds = t(probe) x n / probe, the same ratio for
    any n; a probe whose time is not proportional to its size (a fixed cost that dwarfs the work) is flagged."""
    calls = []

    def per_element(impl, numel):
        calls.append((impl, numel))
        return {"for-loop": 6e-9, "foreach": 4e-9, "fused": 1e-9}[impl] * numel

    one = cpu_adamw_seconds(877_725_696, probe_params=2 ** 22, measure=per_element)
    assert sorted({numel for _, numel in calls}) == [2 ** 21, 2 ** 22]
    two = cpu_adamw_seconds(2 * 877_725_696, probe_params=2 ** 22, measure=per_element)
    for impl, rate in (("for-loop", 6e-9), ("foreach", 4e-9), ("fused", 1e-9)):
        assert one[impl]["seconds"] == pytest.approx(rate * 877_725_696, rel=1e-12)
        assert two[impl]["seconds"] == pytest.approx(2 * one[impl]["seconds"], rel=1e-12)
        assert one[impl]["linearity"] == pytest.approx(1) and one[impl]["linear"]
    fixed_cost = cpu_adamw_seconds(10 ** 9, probe_params=2 ** 22, measure=lambda impl, numel: 0.05 + 1e-9 * numel)
    assert all(abs(r["linearity"] - 1) > LINEARITY_TOLERANCE and not r["linear"] for r in fixed_cost.values())
    # and the real clock: every implementation runs at a tiny probe and reports its own arithmetic
    real = cpu_adamw_seconds(10 ** 9, probe_params=2 ** 14, repeats=1)
    assert set(real) == {"for-loop", "foreach", "fused"}
    for r in real.values():
        assert r["probe_seconds"] > 0 and r["seconds"] == pytest.approx(r["probe_seconds"] * 10 ** 9 / 2 ** 14)
