"""The step-time model of 10_tradeoffs: formulas, fits, calibration on real ranks, the widget.

    .venv/bin/python -m pytest tests/test_costmodel.py -p no:randomly
"""
import base64
import math

import pytest

from course_utils import Cluster, costmodel
from course_utils.costmodel import Calibration, allreduce_time, predict

CAL = Calibration(alpha=20e-6, beta=1e-9, flop_rate=1e10, overhead=1e-4, update_per_param=1e-9,
                  codec_per_param=5e-10, world_size=2)


@pytest.fixture(scope="module")
def cluster():
    with Cluster(world_size=2, timeout=120) as c:
        yield c


def test_ring_allreduce_time_matches_the_formula():
    assert allreduce_time(1e6, 1, 1e-5, 1e-9) == 0.0, "one rank sends nothing"
    expected = 2 * 3 * 1e-5 + 2 * 3 / 4 * 1e6 * 1e-9
    assert math.isclose(allreduce_time(1e6, 4, 1e-5, 1e-9), expected), "2(W-1) alpha + 2(W-1)/W S beta"
    bandwidth_terms = [allreduce_time(1e6, w, 0.0, 1e-9) for w in (2, 4, 16, 1024)]
    assert bandwidth_terms == sorted(bandwidth_terms) and bandwidth_terms[-1] < 2e6 * 1e-9, \
        "the ring's bytes per rank grow towards 2S and never reach it"


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_fit_alpha_beta_recovers_the_model(world_size):
    sizes = [2**k for k in range(10, 24, 2)]
    times = [allreduce_time(s, world_size, 3e-5, 2e-9) for s in sizes]
    alpha, beta = costmodel.fit_alpha_beta(sizes, times, world_size)
    assert math.isclose(alpha, 3e-5, rel_tol=1e-6) and math.isclose(beta, 2e-9, rel_tol=1e-6), (alpha, beta)
    with pytest.raises(ValueError, match="one rank"):
        costmodel.fit_alpha_beta(sizes, times, 1)


def test_fit_compute_recovers_overhead_and_flop_rate():
    params, mbs = 500_000, [1, 4, 16, 64]
    times = [2e-4 + 6 * params * mb / 3e10 for mb in mbs]
    overhead, flop_rate = costmodel.fit_compute(params, mbs, times)
    assert math.isclose(overhead, 2e-4, rel_tol=1e-6) and math.isclose(flop_rate, 3e10, rel_tol=1e-6)


def test_predict_splits_the_step():
    one = predict(CAL, world_size=1, params=1e6, micro_batch=8, accum_steps=2)
    assert one.comm == one.exposed == one.codec == 0 and one.efficiency == 1, "one rank: no communication"
    assert math.isclose(one.compute, 2 * (1e-4 + 6 * 1e6 * 8 / 1e10)), "K x (overhead + 6 P mb / F)"
    four = predict(CAL, world_size=4, params=1e6, micro_batch=8, accum_steps=2)
    assert math.isclose(four.comm, allreduce_time(4e6, 4, CAL.alpha, CAL.beta)), "fp32: 4 bytes per parameter"
    assert math.isclose(four.total, four.compute + four.exposed + four.update)
    assert four.efficiency < 1 and four.samples == 4 * 2 * 8
    squeezed = predict(CAL, world_size=4, params=1e6, micro_batch=8, accum_steps=2, compression=2)
    assert squeezed.comm < four.comm and squeezed.codec == pytest.approx(1e6 * CAL.codec_per_param)
    hidden = predict(CAL, world_size=4, params=1e6, micro_batch=8, accum_steps=2, overlap=True)
    assert hidden.comm == four.comm and hidden.exposed < four.exposed, "overlap hides part of the all-reduce"
    more_k = predict(CAL, world_size=4, params=1e6, micro_batch=8, accum_steps=16)
    assert more_k.comm_share < four.comm_share, "accumulation amortises the one all-reduce per step"
    with pytest.raises(ValueError):
        predict(CAL, world_size=0, params=1e6, micro_batch=8)


def test_memory_per_rank_ddp_is_flat_and_fsdp_shards():
    ddp = [costmodel.memory_per_rank(7e9, w, "ddp") for w in (1, 2, 8)]
    assert ddp[0] == ddp[1] == ddp[2] == pytest.approx(7e9 * 16 / 1e9), "DDP: a full replica everywhere"
    fsdp = [costmodel.memory_per_rank(7e9, w, "fsdp") for w in (1, 2, 8)]
    assert fsdp[1] == pytest.approx(fsdp[0] / 2) and fsdp[2] == pytest.approx(fsdp[0] / 8)
    z1 = costmodel.memory_per_rank(7e9, 4, "zero1")
    assert fsdp[0] > z1 > costmodel.memory_per_rank(7e9, 4, "zero2") > costmodel.memory_per_rank(7e9, 4, "fsdp")
    lora = costmodel.memory_per_rank(7e9, 4, "ddp", weight_bytes=2, trainable_params=4e7)
    assert lora < 16, "a frozen bf16 base has no gradients and no optimizer state"
    with pytest.raises(ValueError, match="unknown strategy"):
        costmodel.memory_per_rank(1e6, 2, "zero4")


def test_calibrate_on_real_ranks(cluster):
    run = costmodel.calibrate(cluster, d_in=32, d_hidden=64, sizes=[1 << 10, 1 << 16, 1 << 22],
                              micro_batches=(1, 16, 64), use_saved=False)
    cal = run.cal
    for name in ("alpha", "beta", "flop_rate", "update_per_param", "codec_per_param"):
        value = getattr(cal, name)
        assert math.isfinite(value) and value > 0, f"{name} = {value!r}: every figure must be measured > 0"
    assert cal.overhead >= 0 and cal.world_size == 2 and run.params == 32 * 64 + 64 + 64 + 1
    assert run.allreduce_times[-1] > run.allreduce_times[0], "4 MiB cannot all-reduce faster than 1 KiB"
    assert len(run.compute_times) == 3 and all(t > 0 for t in run.compute_times)
    assert "us per ring hop" in costmodel.describe(cal) and "GB/s" in costmodel.describe(cal)


def test_measure_allreduce_without_bench(cluster):
    per_rank = cluster.run(costmodel.measure_allreduce, [1 << 10, 1 << 22], 3)
    assert len(per_rank) == 2 and all(len(ts) == 2 and min(ts) > 0 for ts in per_rank), per_rank
    assert max(r[1] for r in per_rank) > min(r[0] for r in per_rank), "4 MiB slower than 1 KiB"


def test_widget_redraws_and_hides_measured_values():
    cal = Calibration(alpha=123.456e-6, beta=1 / 0.987654e9, flop_rate=1.5e10, world_size=2)
    panel = costmodel.cost_model_widget(cal, world_size=2, params=5e5, micro_batch=16)
    descriptions = [s.description for s in panel.sliders.values()]
    assert descriptions == list(costmodel.SLIDERS), descriptions
    text = repr(panel)
    assert text == "CostModelPanel(sliders: " + ", ".join(costmodel.SLIDERS) + ")"
    assert "123" not in text and "987" not in text, "measured defaults must stay out of the text form"
    bundle = panel._repr_mimebundle_()
    assert bundle["text/plain"] == text, "nbval compares this text: it must not depend on measurements"
    assert panel.sliders["bandwidth_gbs"].value == pytest.approx(0.987654, rel=1e-6)
    before = panel.output.outputs[0]["data"]["image/png"]
    assert base64.b64decode(before).startswith(b"\x89PNG"), "the figure is a PNG image output"
    panel.sliders["world_size"].value = 64
    after = panel.output.outputs[0]["data"]["image/png"]
    assert after != before, "moving a slider must redraw the figure"
    assert len(panel.output.outputs) == 1
    assert costmodel.static_figure(panel).data == panel.png


def test_plots_build():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = costmodel.plot_model(CAL, world_size=4, params=1e6, micro_batch=8, accum_steps=2, compression=2)
    assert len(fig.axes) == 3
    fig2 = costmodel.plot_ranks([0.01, 0.06], [0.07, 0.07])
    assert len(fig2.axes) == 1
    plt.close("all")
