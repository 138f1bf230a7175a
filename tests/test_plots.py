"""course_utils.plots: the figures of 01_data_parallelism and 02_collectives_sandbox draw what they say.

    .venv/bin/python -m pytest tests/test_plots.py -p no:randomly
"""
import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from course_utils.plots import (plot_gradient_shards, plot_memory_breakdown, plot_rank_tensors,  # noqa: E402
                                plot_throughput)


def breakdown(act):
    return {"parameters": 1024, "gradients": 1024, "optimizer_state": 2048, "activations": act}


def test_memory_breakdown_stacks_every_kind_in_the_chosen_unit():
    fig = plot_memory_breakdown([breakdown(512), breakdown(4096)], labels=[16, 128], unit="KiB", show=False)
    ax = fig.axes[0]
    tops = {}
    for bar in ax.patches:
        x = round(bar.get_x() + bar.get_width() / 2)
        tops[x] = max(tops.get(x, 0), bar.get_y() + bar.get_height())
    assert tops == pytest.approx({0: 4.5, 1: 8.0}), f"bar totals in KiB: {tops}"
    assert len(ax.patches) == 2 * 4, "one stacked segment per kind per bar"
    assert ax.get_ylabel() == "KiB per rank"
    plt.close(fig)


def test_memory_breakdown_rejects_bad_input():
    with pytest.raises(ValueError, match="one label per bar"):
        plot_memory_breakdown([breakdown(1)], labels=[1, 2], show=False)
    with pytest.raises(ValueError, match="unit"):
        plot_memory_breakdown([breakdown(1)], labels=[1], unit="KB", show=False)


def test_rank_tensors_draws_one_grid_per_stage():
    snaps = [(torch.arange(3.) + 10 * r, [torch.zeros(3), torch.ones(3)], None if r else torch.ones(2))
             for r in range(4)]
    fig = plot_rank_tensors(snaps, labels=("before", "gathered", "extra"), unspecified={"extra": [1]},
                            show=False)
    grids = [ax.images[0].get_array() for ax in fig.axes]
    assert [g.shape for g in grids] == [(4, 3), (4, 6), (4, 2)], "rows = ranks, columns = elements"
    assert grids[0][2, 1] == 21.0, "rank 2, element 1 starts as 21"
    assert grids[2].mask[1:].all() and not grids[2].mask[0].any(), "ranks with None show nothing"
    assert "undefined" in fig.axes[2].get_title()
    plt.close(fig)
    with pytest.raises(ValueError, match="one label per stage"):
        plot_rank_tensors(snaps, labels=("before", "after"), show=False)


def test_gradient_and_throughput_plots_return_figures():
    g = [torch.randn(20) for _ in range(4)]
    fig = plot_gradient_shards(g, torch.stack(g).mean(0), n_show=5, show=False)
    assert len(fig.axes[0].collections) == 4 + 2, "one scatter per shard, plus full batch and mean"
    plt.close(fig)
    fig = plot_throughput([1, 2, 4], [256, 512, 1024], [0.01, 0.01, 0.02], show=False)
    heights = [p.get_height() for p in fig.axes[1].patches]
    assert heights == pytest.approx([25600, 51200, 51200]), f"samples per second: {heights}"
    plt.close(fig)
    assert plot_throughput([1], [1], [1.0], show=True) is None, "show=True returns nothing (no double display)"
