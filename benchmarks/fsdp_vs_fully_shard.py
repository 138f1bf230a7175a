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

The ratios MicroFSDP / FSDP2 are printed with them, against the targets of issue 21 (bytes equal,
time within 1.3x, peak within 1.1x): what this machine measured, pass or not.
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from course_utils import Cluster  # noqa: E402


def measure(n_layer, n_embd, micro_batch_size, steps):
    import statistics
    import time
    import warnings

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from course_utils.fsdp import MicroFSDP
    from course_utils.gpt import CharTokenizer, get_batch, load_corpus, make_gpt
    from course_utils.memory import peak_memory
    from course_utils.zero import count_collectives

    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    torch.set_num_threads(1)
    rank, ws = dist.get_rank(), dist.get_world_size()
    text = load_corpus()
    tok = CharTokenizer(text)
    data = tok.encode(text)

    def make(kind):
        model = make_gpt(tok.vocab_size, seed=0, n_layer=n_layer, n_embd=n_embd)
        if kind == "MicroFSDP":
            model = MicroFSDP(model)
        else:
            mesh = init_device_mesh("cpu", (ws,))
            for block in model.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    runs = {kind: make(kind) for kind in ("FSDP2", "MicroFSDP")}
    x, y = get_batch(data, 0, rank, micro_batch_size, ws * micro_batch_size)

    def step(model, opt, phases=None):
        opt.zero_grad(set_to_none=True)
        with count_collectives() as forward:
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        with count_collectives() as backward:
            loss.backward()
        with count_collectives() as update:
            opt.step()
        if phases is not None:
            phases.update(forward=forward.sent(), backward=backward.sent(), step=update.sent())
        return loss.detach()

    out = {}
    losses = {}
    for kind, (model, opt) in runs.items():
        phases = {}
        losses[kind] = [step(model, opt, phases).item() for _ in range(2)]
        out[kind] = {"bytes": phases, "peak": peak_memory(lambda m=model, o=opt: step(m, o), model, opt)}
    times = {kind: [] for kind in runs}
    for _ in range(steps):
        for kind, (model, opt) in runs.items():
            dist.barrier()
            t0 = time.perf_counter()
            step(model, opt)
            times[kind].append(time.perf_counter() - t0)
    local = torch.tensor([statistics.median(times[k]) for k in runs], dtype=torch.float64)
    dist.all_reduce(local, op=dist.ReduceOp.MAX)
    for kind, t in zip(runs, local.tolist()):
        out[kind]["seconds"] = t
    n_params = sum(p.numel() for p in make_gpt(tok.vocab_size, seed=0, n_layer=n_layer, n_embd=n_embd).parameters())
    return n_params, out, losses


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
    header = (f"{'W':>2} {'impl':10} {'forward B':>11} {'backward B':>11} {'step B':>7} {'step ms':>8} "
              f"{'peak/rank (max)':>16}")
    print(header)
    print("-" * len(header))
    verdicts = []
    for ws, n_params, out, peaks, losses in rows:
        for kind in ("FSDP2", "MicroFSDP"):
            b = out[kind]["bytes"]
            peak = max(r[kind]["peak"]["total"] for r in peaks)
            print(f"{ws:>2} {kind:10} {b['forward']:>11} {b['backward']:>11} {b['step']:>7} "
                  f"{out[kind]['seconds'] * 1e3:>8.1f} {fmt_bytes(peak):>16}")
        same_bytes = out["FSDP2"]["bytes"] == out["MicroFSDP"]["bytes"]
        t_ratio = out["MicroFSDP"]["seconds"] / out["FSDP2"]["seconds"]
        m_ratio = (max(r["MicroFSDP"]["peak"]["total"] for r in peaks)
                   / max(r["FSDP2"]["peak"]["total"] for r in peaks))
        loss_gap = max(abs(a - b) for a, b in zip(losses["MicroFSDP"], losses["FSDP2"]))
        verdicts.append(f"W={ws} ({n_params} parameters): bytes per phase {'equal' if same_bytes else 'DIFFER'}; "
                        f"step time MicroFSDP/FSDP2 = {t_ratio:.2f} ({'within' if t_ratio <= 1.3 else 'OVER'} 1.3x); "
                        f"peak memory ratio = {m_ratio:.3f} ({'within' if m_ratio <= 1.1 else 'OVER'} 1.1x); "
                        f"losses of the first 2 steps agree within {loss_gap:.1e}")
    print()
    for v in verdicts:
        print(v)
    ws, _, out, peaks, _ = rows[0]
    print(f"\npeak by kind on rank 0 at W={ws} (MemTracker's kinds at the moment of the peak; MicroFSDP's gathered "
          "weights are not registered Parameters, so MemTracker counts them as activations/temporaries):")
    kinds = ("parameters", "gradients", "optimizer_state", "activations", "temporaries", "total")
    print(f"{'':10}" + "".join(f"{k:>16}" for k in kinds))
    for kind in ("FSDP2", "MicroFSDP"):
        print(f"{kind:10}" + "".join(f"{fmt_bytes(peaks[0][kind]['peak'][k]):>16}" for k in kinds))


if __name__ == "__main__":
    main()
