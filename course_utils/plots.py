"""Pictures shared by the lessons: memory breakdowns, ranks' tensors, gradients, throughput.

Introduced in 01_data_parallelism. Every function draws with matplotlib. With ``show=True`` (the
default) it calls ``plt.show()``, closes the figure (notebooks do not pile up open figures) and
returns None; with ``show=False`` it returns the figure, for you to save or change.
"""
import math

import matplotlib.pyplot as plt
import numpy as np

__all__ = ["plot_memory_breakdown", "plot_rank_tensors", "plot_gradient_shards", "plot_throughput",
           "MEMORY_COLORS"]

MEMORY_COLORS = {
    "parameters": "#4C72B0",
    "gradients": "#DD8452",
    "optimizer_state": "#55A868",
    "activations": "#C44E52",
}


def _finish(fig, show):
    if show:  # show and close; return nothing, so a notebook cell does not display it twice
        plt.show()
        plt.close(fig)
        return None
    return fig


def _unit_for(max_bytes):
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if max_bytes >= scale:
            return unit, scale
    return "B", 1


def plot_memory_breakdown(breakdowns, labels, title="Memory per rank", xlabel="", ax=None,
                          kinds=None, unit=None, show=True):
    """Stacked bars: one bar per breakdown, one colour per kind of memory.

    Introduced in 01_data_parallelism. ``breakdowns`` is a list of dicts like the ones
    ``course_utils.memory.measure_step_memory`` returns (bytes by kind), ``labels`` the tick
    label of each bar. ``kinds`` picks and orders the stacked kinds (default: parameters,
    gradients, optimizer_state, activations). ``unit`` is "B", "KiB", "MiB" or "GiB"; by default
    it follows the tallest bar (pass the same unit to panels that share an axis). Pass ``ax`` to
    draw into an existing axes (then nothing is shown, and the axes is returned).
    """
    from course_utils.memory import MEMORY_KINDS

    kinds = list(kinds or MEMORY_KINDS)
    if len(breakdowns) != len(labels):
        raise ValueError(f"{len(breakdowns)} breakdowns but {len(labels)} labels: give one label per bar")
    totals = [sum(b[k] for k in kinds) for b in breakdowns]
    scales = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
    if unit is not None and unit not in scales:
        raise ValueError(f"unit={unit!r}: use one of {', '.join(scales)}")
    unit, scale = (unit, scales[unit]) if unit else _unit_for(max(totals) if totals else 0)
    own = ax is None
    if own:
        fig, ax = plt.subplots(figsize=(5.5, 3.6))
    else:
        fig = ax.figure
    xs = np.arange(len(breakdowns))
    bottom = np.zeros(len(breakdowns))
    for k in kinds:
        heights = np.array([b[k] for b in breakdowns], dtype=float) / scale
        ax.bar(xs, heights, bottom=bottom, color=MEMORY_COLORS.get(k), label=k.replace("_", " "), width=0.6)
        bottom += heights
    for x, total in zip(xs, bottom):
        ax.text(x, total, f"{total:.0f}" if total >= 10 else f"{total:.1f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(xs, [str(lb) for lb in labels])
    ax.set_xlabel(xlabel)
    ax.set_ylabel(f"{unit} per rank")
    ax.set_ylim(0, max(bottom.max() if len(bottom) else 1, 1e-9) * 1.15)
    ax.set_title(title)
    ax.legend(fontsize=8, loc="upper left")
    if own:
        fig.tight_layout()
        return _finish(fig, show)
    return ax


def _as_row(value):
    """A 1-D float array from a tensor, a number, or a list of those (concatenated).

    Also returns the column where each piece starts (for the separators of a gathered list)."""
    if value is None:
        return np.zeros(0), []
    pieces = list(value) if isinstance(value, (list, tuple)) else [value]
    arrays, starts, col = [], [], 0
    for p in pieces:
        a = np.asarray(p.detach().cpu().float().numpy() if hasattr(p, "detach") else p, dtype=float).reshape(-1)
        arrays.append(a)
        starts.append(col)
        col += a.size
    if not isinstance(value, (list, tuple)):
        starts = []
    return (np.concatenate(arrays) if arrays else np.zeros(0)), starts[1:]


def plot_rank_tensors(snapshots, labels=("before", "after"), title=None, unspecified=None, fmt="{:g}",
                      show=True):
    """Every rank's tensor at each stage, as grids: rows = ranks, columns = elements.

    Introduced in 02_collectives_sandbox. ``snapshots`` is rank-ordered (what ``%ddp pull``
    returns): ``snapshots[r]`` is a tuple with one entry per stage, e.g. ``(before, after)``.
    An entry is a tensor, a number, a list of tensors (drawn side by side, split by white
    lines: what ``all_gather`` fills) or ``None`` (nothing to show on that rank).
    ``labels`` names the stages. ``unspecified`` maps a stage label to the ranks whose values
    at that stage the API does not define (drawn hatched and grey: do not read them), e.g.
    ``{"after": [1, 2, 3]}`` for ``reduce`` to rank 0. Values are written in each cell with
    ``fmt``; the colour scale is shared across stages, so equal numbers get equal colours.
    """
    world_size = len(snapshots)
    n_stages = len(labels)
    for r, snap in enumerate(snapshots):
        if len(snap) != n_stages:
            raise ValueError(f"rank {r} has {len(snap)} stages but labels names {n_stages}: "
                             f"give one label per stage, e.g. labels=('before', 'after')")
    unspecified = {k: set(v) for k, v in (unspecified or {}).items()}
    rows = [[_as_row(snap[s]) for snap in snapshots] for s in range(n_stages)]
    widths = [max(1, max(r[0].size for r in stage)) for stage in rows]
    finite = [v for stage in rows for (a, _) in stage for v in a if math.isfinite(v)]
    vmin, vmax = (min(finite), max(finite)) if finite else (0.0, 1.0)
    if vmin == vmax:
        vmin, vmax = vmin - 1, vmax + 1
    fig_w = min(16, 1.2 + sum(0.55 * w + 0.6 for w in widths))
    fig, axes = plt.subplots(1, n_stages, figsize=(fig_w, 0.9 + 0.45 * world_size),
                             gridspec_kw={"width_ratios": widths}, squeeze=False)
    cmap = plt.get_cmap("viridis")
    for s, (ax, stage) in enumerate(zip(axes[0], rows)):
        grid = np.full((world_size, widths[s]), np.nan)
        for r, (a, _) in enumerate(stage):
            grid[r, :a.size] = a
        ax.imshow(grid, cmap=cmap, vmin=vmin, vmax=vmax, aspect="auto")
        for r, (a, seps) in enumerate(stage):
            grey = r in unspecified.get(labels[s], ())
            for c, v in enumerate(a):
                norm = (v - vmin) / (vmax - vmin) if math.isfinite(v) else 0
                color = "black" if norm > 0.6 else "white"
                ax.text(c, r, fmt.format(v), ha="center", va="center", fontsize=8,
                        color="0.35" if grey else color)
            if grey:
                ax.add_patch(plt.Rectangle((-0.5, r - 0.5), widths[s], 1, facecolor="0.85",
                                           edgecolor="0.5", hatch="//", alpha=0.85))
            for sep in seps:
                ax.axvline(sep - 0.5, ymin=1 - (r + 1) / world_size, ymax=1 - r / world_size,
                           color="white", linewidth=3)
        ax.set_yticks(range(world_size), [f"rank {r}" for r in range(world_size)] if s == 0 else [])
        ax.set_xticks(range(widths[s]))
        ax.tick_params(length=0, labelsize=7)
        ax.set_title(labels[s] + (" (hatched: undefined)" if unspecified.get(labels[s]) else ""), fontsize=10)
        ax.set_xlabel("element", fontsize=8)
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    return _finish(fig, show)


def plot_gradient_shards(shard_grads, full_grad, mean_grad=None, n_show=12, title=None, show=True):
    """The first ``n_show`` gradient entries: each shard's, their mean, and the full batch's.

    Introduced in 01_data_parallelism. ``shard_grads`` is a list of flat gradients (one per
    shard of the batch), ``full_grad`` the flat gradient of the whole batch; ``mean_grad``
    defaults to the mean of the shards. Each shard's gradient scatters around the full one;
    their mean lands on it.
    """
    import torch

    shards = torch.stack([g.detach().flatten()[:n_show] for g in shard_grads]).numpy()
    full = full_grad.detach().flatten()[:n_show].numpy()
    mean = (shards.mean(axis=0) if mean_grad is None else mean_grad.detach().flatten()[:n_show].numpy())
    fig, ax = plt.subplots(figsize=(7, 3.2))
    xs = np.arange(len(full))
    for i, g in enumerate(shards):
        ax.scatter(xs + (i - (len(shards) - 1) / 2) * 0.08, g, s=14, alpha=0.7, label=f"shard {i}")
    ax.scatter(xs, full, marker="_", s=400, color="black", linewidths=2, label="full batch", zorder=3)
    ax.scatter(xs, mean, marker="x", s=40, color="red", label="mean of shards", zorder=4)
    ax.axhline(0, color="0.8", linewidth=0.8, zorder=0)
    ax.set_xticks(xs)
    ax.set_xlabel("gradient entry (first parameters)")
    ax.set_ylabel("gradient value")
    ax.set_title(title or "Each shard's gradient is noisy; their mean is the full-batch gradient")
    ax.legend(fontsize=7, ncol=3, loc="best")
    fig.tight_layout()
    return _finish(fig, show)


def plot_throughput(world_sizes, samples_per_step, step_seconds, title=None, show=True, comm_seconds=None):
    """Two panels: samples per optimizer step, and measured samples per second, by world size.

    Introduced in 01_data_parallelism. ``step_seconds`` are measured wall times of one step
    (the slowest rank's, since every rank waits for the all-reduce). With ``comm_seconds`` (the
    part of each step spent in communication) a third panel splits each step into compute and
    communication.
    """
    world_sizes = list(world_sizes)
    per_s = [n / t for n, t in zip(samples_per_step, step_seconds)]
    panels = 2 if comm_seconds is None else 3
    fig, axes = plt.subplots(1, panels, figsize=(4 * panels, 3))
    a1, a2 = axes[0], axes[1]
    labels = [str(w) for w in world_sizes]
    a1.bar(labels, samples_per_step, color="#4C72B0")
    a1.set_xlabel("world size")
    a1.set_ylabel("samples per step")
    a1.set_title("effective batch (exact)")
    a2.bar(labels, per_s, color="#55A868")
    a2.set_xlabel("world size")
    a2.set_ylabel("samples per second")
    a2.set_title("throughput (measured here)")
    if comm_seconds is not None:
        a3 = axes[2]
        comm_ms = [1e3 * c for c in comm_seconds]
        compute_ms = [1e3 * (t - c) for t, c in zip(step_seconds, comm_seconds)]
        a3.bar(labels, compute_ms, color="#8172B2", label="compute (forward + backward)")
        a3.bar(labels, comm_ms, bottom=compute_ms, color="#C44E52", label="all-reduce + step")
        a3.set_xlabel("world size")
        a3.set_ylabel("ms per step")
        a3.set_title("one step, split (measured here)")
        a3.legend(fontsize=7)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return _finish(fig, show)
