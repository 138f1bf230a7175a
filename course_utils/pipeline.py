"""Pipeline parallelism by hand: a model cut into stages, one per rank, activations sent forward and their
gradients sent back, micro-batch by micro-batch.

Introduced in 15_beyond_data_parallelism. A *schedule* is the list of actions of one stage, in order:
``("F", i)`` runs micro-batch ``i`` forward (receiving its input from the previous stage, sending its
output to the next), ``("B", i)`` runs it backward (receiving the output's gradient from the next stage,
sending the input's gradient to the previous). ``run_schedule`` executes one on a rank with
``dist.isend`` / ``dist.recv`` to the neighbouring ranks, in order, without tags (NCCL has none): messages
between two stages arrive in the order they were sent. ``simulate`` plays every stage's schedule without
running anything: it finds a deadlock (a cycle of stages each waiting to receive) before a single byte is
sent, and gives the time each action starts with unit-time work, so a schedule's bubble is exact.
"""
import time
import weakref
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch import nn

from course_utils.memory import _byte_span, _storage_key, _union_length

__all__ = ["Embedding", "Head", "gpt_layers", "split_layers", "gpt_stage", "gpipe_schedule", "one_f_one_b_schedule",
           "sequential_schedule", "ActivationPeak", "run_schedule", "simulate", "bubble_fraction", "idle_fraction",
           "Deadlock", "OutOfOrder", "plot_timeline"]


class Embedding(nn.Module):
    """The GPT's first layer: token + position embeddings (course_utils.gpt.GPT.forward's first line)."""

    def __init__(self, model):
        super().__init__()
        self.wte, self.wpe = model.wte, model.wpe

    def forward(self, idx):
        return self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))


class Head(nn.Module):
    """The GPT's last layer: the final layer norm and the linear head, giving logits."""

    def __init__(self, model):
        super().__init__()
        self.ln_f, self.head = model.ln_f, model.head

    def forward(self, x):
        return self.head(self.ln_f(x))


def gpt_layers(model):
    """A course GPT as a list of layers that run one after the other: embedding, each block, head.
    They share ``model``'s parameters (no copy)."""
    return [Embedding(model), *model.blocks, Head(model)]


def split_layers(layers, num_stages):
    """Cut ``layers`` into ``num_stages`` contiguous groups, as even as possible (earlier stages get the
    extra layer)."""
    if not 1 <= num_stages <= len(layers):
        raise ValueError(f"{len(layers)} layers cannot make {num_stages} stages")
    base, extra = divmod(len(layers), num_stages)
    out, start = [], 0
    for s in range(num_stages):
        n = base + (s < extra)
        out.append(layers[start:start + n])
        start += n
    return out


def gpt_stage(model, stage, num_stages):
    """Stage ``stage`` of ``num_stages`` of a course GPT: an ``nn.Sequential`` of its layers, sharing
    ``model``'s parameters. Introduced in 15_beyond_data_parallelism."""
    return nn.Sequential(*split_layers(gpt_layers(model), num_stages)[stage])


# -- schedules ----------------------------------------------------------------------------------------
def gpipe_schedule(stage, num_stages, num_microbatches):
    """GPipe (Huang et al., 2019): every micro-batch forward, then every micro-batch backward.

    The course's solution of 15_beyond_data_parallelism's pipeline exercise."""
    return [("F", i) for i in range(num_microbatches)] + [("B", i) for i in range(num_microbatches)]


def one_f_one_b_schedule(stage, num_stages, num_microbatches):
    """1F1B (PipeDream-Flush, Narayanan et al., 2021): ``num_stages - stage - 1`` forwards to fill the
    pipeline, then one forward and one backward in turn, then the remaining backwards. The same bubble as
    GPipe, but a stage holds the activations of at most ``num_stages - stage`` micro-batches, not all."""
    warmup = min(num_stages - stage - 1, num_microbatches)
    actions = [("F", i) for i in range(warmup)]
    for i in range(num_microbatches - warmup):
        actions += [("F", warmup + i), ("B", i)]
    actions += [("B", i) for i in range(num_microbatches - warmup, num_microbatches)]
    return actions


def sequential_schedule(stage, num_stages, num_microbatches):
    """One micro-batch at a time, forward then backward: correct, but only one stage ever works."""
    return [a for i in range(num_microbatches) for a in (("F", i), ("B", i))]


# -- the simulator --------------------------------------------------------------------------------------
class Deadlock(Exception):
    """A schedule that would hang: ``waiting`` maps each blocked stage to the message it waits for."""

    def __init__(self, waiting, done):
        self.waiting, self.done = waiting, done
        lines = [f"stage {s} waits to receive the {what} of micro-batch {i} from stage {src}"
                 for s, (what, i, src) in sorted(waiting.items())]
        super().__init__("; ".join(lines))


class OutOfOrder(Exception):
    """Two stages that exchange messages in different orders: ``dist.recv`` would get the wrong one."""


def _needs(stage, num_stages, action):
    """(what, micro-batch, source stage) that ``action`` must receive first, or None."""
    kind, i = action
    if kind == "F" and stage > 0:
        return ("activation", i, stage - 1)
    if kind == "B" and stage < num_stages - 1:
        return ("gradient", i, stage + 1)
    return None


def _sends(stage, num_stages, action):
    kind, i = action
    if kind == "F" and stage < num_stages - 1:
        return ("activation", i, stage + 1)
    if kind == "B" and stage > 0:
        return ("gradient", i, stage - 1)
    return None


def simulate(schedules, t_forward=1.0, t_backward=2.0):
    """Play ``schedules`` (one list of actions per stage) with sends that never block and receives that
    wait, as ``run_schedule`` runs them. Each action takes ``t_forward`` or ``t_backward`` and a message
    arrives at once; ``t_forward`` and ``t_backward`` may also be sequences, one time per stage (unequal stages,
    e.g. times measured on the ranks). Returns ``[(stage, action, start, end), ...]``.

    Raises ``Deadlock`` when every unfinished stage waits for a message nobody will send, and
    ``OutOfOrder`` when a stage would receive a message other than the one it expects (two stages
    disagree on the order of micro-batches between them)."""
    p = len(schedules)
    channels = {}                 # (src, dst) -> list of (what, i, time sent)
    pos, clock, events = [0] * p, [0.0] * p, []
    while any(pos[s] < len(schedules[s]) for s in range(p)):
        progressed = False
        for s in range(p):
            while pos[s] < len(schedules[s]):
                action = schedules[s][pos[s]]
                need = _needs(s, p, action)
                start = clock[s]
                if need is not None:
                    what, i, src = need
                    queue = channels.get((src, s), [])
                    if not queue:
                        break
                    got_what, got_i, sent_at = queue[0]
                    if (got_what, got_i) != (what, i):
                        raise OutOfOrder(
                            f"stage {s} expects the {what} of micro-batch {i} from stage {src}, but the next "
                            f"message stage {src} sent it is the {got_what} of micro-batch {got_i}: the two "
                            f"stages run their micro-batches in different orders")
                    queue.pop(0)
                    start = max(start, sent_at)
                t = t_forward if action[0] == "F" else t_backward
                end = start + (t[s] if isinstance(t, (list, tuple)) else t)
                events.append((s, action, start, end))
                clock[s] = end
                out = _sends(s, p, action)
                if out is not None:
                    channels.setdefault((s, out[2]), []).append((out[0], out[1], end))
                pos[s] += 1
                progressed = True
        if not progressed:
            waiting = {s: _needs(s, p, schedules[s][pos[s]]) for s in range(p) if pos[s] < len(schedules[s])}
            raise Deadlock(waiting, events)
    return events


def bubble_fraction(num_stages, num_microbatches):
    """GPipe's idle fraction with equal stages: (p - 1) / (m + p - 1)."""
    return (num_stages - 1) / (num_microbatches + num_stages - 1)


def idle_fraction(events):
    """Idle share of the stages' time, from ``[(stage, action, start, end), ...]`` (simulated or measured):
    1 - busy time / (stages x makespan)."""
    stages = {e[0] for e in events}
    span = max(e[3] for e in events) - min(e[2] for e in events)
    busy = sum(e[3] - e[2] for e in events)
    return 1 - busy / (len(stages) * span)


# -- the peak of what autograd holds ---------------------------------------------------------------------
class ActivationPeak:
    """The peak bytes of the tensors autograd keeps for backward, over a ``with`` block. Introduced in
    15_beyond_data_parallelism::

        with ActivationPeak(exclude=model.parameters()) as meter:
            ...                       # any number of forwards and backwards, in any order
        meter.peak, meter.live        # bytes at the peak, and still held at the end

    Lesson 01's ``ActivationMeter`` adds up what is saved; this one also sees it go. Every tensor an
    operation saves goes through ``torch.autograd.graph.saved_tensors_hooks``; the bytes of its storage that
    it reaches count (once, however many saved tensors reach them: the meter of lesson 01 counts the same
    way) from then until the tensor is freed, which happens when backward releases the graph. So a
    schedule that holds more micro-batches at once peaks higher.
    """

    def __init__(self, exclude=()):
        self._excluded = {_storage_key(t) for t in exclude}
        self._held = {}            # storage key -> {byte span: saved tensors alive that reach it}
        self.live = self.peak = 0
        self._ctx = None

    def _change(self, key, span, delta):
        spans = self._held.setdefault(key, {})
        before = _union_length(spans)
        spans[span] = spans.get(span, 0) + delta
        if spans[span] == 0:
            del spans[span]
        self.live += _union_length(spans) - before
        self.peak = max(self.peak, self.live)
        if not spans:
            del self._held[key]

    def _pack(self, t):
        key = _storage_key(t)
        if key not in self._excluded:
            span = _byte_span(t)
            self._change(key, span, +1)
            weakref.finalize(t, self._change, key, span, -1)
        return t

    def __enter__(self):
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)
        return False




# -- the runtime ----------------------------------------------------------------------------------------
def run_schedule(stage_module, actions, *, stage, num_stages, inputs=None, targets=None, loss_fn=None,
                 act_shape=None, ranks=None, group=None, slot=None, on_forward=None):
    """Run this rank's ``actions`` of a pipeline step. Introduced in 15_beyond_data_parallelism.

    ``inputs`` (first stage) and ``targets`` (last stage): lists, one entry per micro-batch.
    ``act_shape``: the shape of an activation between stages (the same for every micro-batch).
    ``ranks``: the global rank of each stage (default ``range(num_stages)``); ``group`` their group.
    ``slot``: ``(t_forward, t_backward)`` in seconds: each action is padded with a sleep to last at least
    that long, like a device that computes its stage on its own whatever the CPU's other ranks do.
    ``on_forward(i)``: a context manager entered around the forward of micro-batch ``i`` (a meter).

    Each micro-batch's loss is divided by the number of micro-batches, so the gradients are those of the
    mean loss over the whole batch. Returns ``(loss sum or None, events)`` with events
    ``(stage, action, start, end)`` timed by ``time.perf_counter()`` on this rank."""
    ranks = list(range(num_stages)) if ranks is None else ranks
    first, last = stage == 0, stage == num_stages - 1
    m = len({i for kind, i in actions if kind == "F"})   # micro-batches in this step
    param = next(stage_module.parameters())
    held, sends, events, loss_sum = {}, [], [], None
    for action in actions:
        kind, i = action
        sends = [(work, t) for work, t in sends if not work.is_completed()]   # free what has been sent
        if kind == "F":
            if first:
                x = inputs[i]
            else:
                x = torch.empty(act_shape, dtype=param.dtype, device=param.device)
                dist.recv(x, src=ranks[stage - 1], group=group)
                x.requires_grad_()
            start = time.perf_counter()
            with on_forward(i) if on_forward is not None else nullcontext():
                out = stage_module(x)
                if last:
                    out = loss_fn(out, targets[i]) / m
            _pad(start, slot, 0)
            events.append((stage, action, start, time.perf_counter()))
            if last:
                loss_sum = out.detach() if loss_sum is None else loss_sum + out.detach()
            else:
                y = out.detach()
                sends.append((dist.isend(y, dst=ranks[stage + 1], group=group), y))
            held[i] = (x, out)
        elif kind == "B":
            x, out = held.pop(i)
            grad = None
            if not last:
                grad = torch.empty_like(out)
                dist.recv(grad, src=ranks[stage + 1], group=group)
            start = time.perf_counter()
            torch.autograd.backward(out, grad)
            _pad(start, slot, 1)
            events.append((stage, action, start, time.perf_counter()))
            if not first:
                sends.append((dist.isend(x.grad, dst=ranks[stage - 1], group=group), x.grad))
            del x, out, grad   # this micro-batch is done: hold nothing of it until the next action
        else:
            raise ValueError(f"unknown action {action!r}: use ('F', i) or ('B', i)")
    for work, _ in sends:
        work.wait()
    return loss_sum, events


def _pad(start, slot, which):
    if slot is not None:
        left = slot[which] - (time.perf_counter() - start)
        if left > 0:
            time.sleep(left)


# -- the timeline ----------------------------------------------------------------------------------------
def plot_timeline(events, title="", ax=None, unit=1.0):
    """Draw ``[(stage, action, start, end), ...]`` as one row per stage: forwards light, backwards dark,
    each labelled with its micro-batch; white is the bubble. ``unit`` divides the times (e.g. 1e-3 for ms)."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(8, 0.45 * (1 + max(e[0] for e in events))))
    t0 = min(e[2] for e in events)
    for stage, (kind, i), start, end in events:
        a, b = (start - t0) / unit, (end - t0) / unit
        ax.barh(stage, b - a, left=a, color="#9ecae1" if kind == "F" else "#3182bd", edgecolor="white")
        ax.text((a + b) / 2, stage, str(i), ha="center", va="center", fontsize=7,
                color="black" if kind == "F" else "white")
    ax.set_yticks(sorted({e[0] for e in events}))
    ax.set_yticklabels([f"stage {s}" for s in sorted({e[0] for e in events})])
    ax.invert_yaxis()
    ax.set_title(title, fontsize=9)
    return ax


def plot_bubble_study(timelines, measured, ms=(1, 2, 4, 8)):
    """Lesson 15's figure of the measured bubble: GPipe's timelines at p = 4 with m = 1 and m = 8, and every
    measured idle fraction (``measured[p, m]``) beside (p - 1)/(m + p - 1) for p = 2 and 4. ``timelines[p, m]``:
    every stage's ``(stage, action, start, end)`` of one step. Introduced in 15_beyond_data_parallelism."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 2.6), gridspec_kw={"width_ratios": [1, 1, 0.8]})
    plot_timeline(timelines[4, ms[0]], f"GPipe, 4 stages, m = {ms[0]}", ax=axes[0], unit=1e-3)
    plot_timeline(timelines[4, ms[-1]], f"GPipe, 4 stages, m = {ms[-1]}", ax=axes[1], unit=1e-3)
    for ax in axes[:2]:
        ax.set_xlabel("ms from the common start")
    fig.suptitle("light: forward, dark: backward, white: the bubble", fontsize=9)
    for p, colour in ((2, "tab:orange"), (4, "tab:blue")):
        axes[2].plot(ms, [bubble_fraction(p, m) for m in ms], "--", color=colour, label=f"(p-1)/(m+p-1), p={p}")
        axes[2].plot(ms, [measured[p, m] for m in ms], "o", color=colour, label=f"measured, p={p}")
    axes[2].set_xlabel("micro-batches m")
    axes[2].set_ylabel("idle fraction")
    axes[2].legend(fontsize=7)
    fig.tight_layout()
    return fig
