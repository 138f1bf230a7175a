"""MicroFSDP against torch's FSDP2 ``fully_shard``, same model, same ranks, same run (13_fsdp_by_hand).

    .venv/bin/python benchmarks/fsdp_vs_fully_shard.py                      # 2 ranks, then 4
    .venv/bin/python benchmarks/fsdp_vs_fully_shard.py --world-sizes 2 --steps 30 --n-layer 6 --n-embd 192

Both shard the tiny GPT of course_utils.gpt the same way: each block a unit, the root (embeddings,
final norm, head) the rest, kept gathered from forward to the end of backward; fp32, AdamW.
Per configuration the script prints, for each implementation:

- bytes per phase (forward, backward, optimizer step): the payloads of the collectives each rank
  calls, counted by ``course_utils.zero.count_collectives`` and converted to what a ring sends
  ("counted (ring model)", not measured on the wire);
- step time: the median over ``--steps`` steps, interleaved (FSDP2, MicroFSDP, FSDP2, ...) so that a
  noisy machine slows both alike, the slowest rank's;
- peak memory per rank over one whole step, from torch's ``MemTracker`` (``course_utils.memory.peak_memory``).

The ratios MicroFSDP / FSDP2 are printed with them, against what a faithful MicroFSDP should reach (bytes
equal, time within 1.3x, peak within 1.1x): what this machine measured, pass or not.
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from course_utils import Cluster  # noqa: E402


def measure(n_layer, n_embd, micro_batch_size, steps):
    from course_utils.fsdp import race_fully_shard

    return race_fully_shard(n_layer, n_embd, micro_batch_size, steps)


def fmt_bytes(n):
    from course_utils.memory import format_bytes

    return format_bytes(n)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--micro-batch-size", type=int, default=8)
    args = p.parse_args()
    rows = []
    for ws in args.world_sizes:
        cluster = Cluster(world_size=ws, backend="gloo", timeout=600)
        try:
            results = cluster.run(measure, args.n_layer, args.n_embd, args.micro_batch_size, args.steps)
        finally:
            cluster.shutdown()
        n_params, out, losses = results[0]
        peaks = [r[1] for r in results]
        rows.append((ws, n_params, out, peaks, losses))
    print(f"tiny GPT: {args.n_layer} blocks, n_embd {args.n_embd}, micro-batch {args.micro_batch_size} x 32 tokens, "
          "fp32, AdamW; gloo on CPU")
    header = (f"{'W':>2} {'impl':22} {'forward B':>11} {'backward B':>11} {'step B':>7} {'fwd ms':>7} "
              f"{'bwd ms':>7} {'opt ms':>7} {'peak/rank (max)':>16}")
    print(header)
    print("-" * len(header))
    verdicts = []
    for ws, n_params, out, peaks, losses in rows:
        for kind in out:
            b = out[kind]["bytes"]
            peak = max(r[kind]["peak"]["total"] for r in peaks)
            ms = out[kind]["phase_seconds"]
            print(f"{ws:>2} {kind:22} {b['forward']:>11} {b['backward']:>11} {b['step']:>7} "
                  f"{ms['forward'] * 1e3:>7.1f} {ms['backward'] * 1e3:>7.1f} {ms['step'] * 1e3:>7.1f} "
                  f"{fmt_bytes(peak):>16}")
        same_bytes = out["FSDP2"]["bytes"] == out["MicroFSDP"]["bytes"]
        t_ratio = out["MicroFSDP"]["seconds"] / out["FSDP2"]["seconds"]
        m_ratio = (max(r["MicroFSDP"]["peak"]["total"] for r in peaks)
                   / max(r["FSDP2"]["peak"]["total"] for r in peaks))
        loss_gap = max(abs(a - b) for a, b in zip(losses["MicroFSDP"], losses["FSDP2"]))
        verdicts.append(f"W={ws} ({n_params} parameters): bytes per phase {'equal' if same_bytes else 'DIFFER'}; "
                        f"step time MicroFSDP/FSDP2 = {t_ratio:.2f} (on the CPU FSDP2's collectives are synchronous "
                        f"and it steps {out['FSDP2']['optimizer_tensors']} DTensors against MicroFSDP's "
                        f"{out['MicroFSDP']['optimizer_tensors']} flat shards: not a verdict on the algorithm); "
                        f"peak memory ratio = {m_ratio:.3f} ({'within' if m_ratio <= 1.1 else 'OVER'} 1.1x); "
                        f"losses of the first 2 steps agree within {loss_gap:.1e}")
    print()
    for v in verdicts:
        print(v)
    ws, _, out, peaks, _ = rows[0]
    print(f"\npeak by kind on rank 0 at W={ws} (MemTracker's kinds at the moment of the peak; MicroFSDP's gathered "
          "weights are not registered Parameters, so MemTracker counts them as activations/temporaries):")
    kinds = ("parameters", "gradients", "optimizer_state", "activations", "temporaries", "total")
    print(f"{'':22}" + "".join(f"{k:>16}" for k in kinds))
    for kind in out:
        print(f"{kind:22}" + "".join(f"{fmt_bytes(peaks[0][kind]['peak'][k]):>16}" for k in kinds))


if __name__ == "__main__":
    main()
