"""Step time of MicroDDP against torch DDP, on gloo CPU ranks (11_capstone_micro_ddp).

    .venv/bin/python benchmarks/micro_ddp_vs_ddp.py                # 2 ranks
    .venv/bin/python benchmarks/micro_ddp_vs_ddp.py --world-size 4 --steps 30

Both wrappers train the same model on the same batch; steps are interleaved (DDP, MicroDDP,
DDP, ...) so that a noisy machine slows both alike. A step is forward + backward (with the
all-reduces) + SGD step; the median over steps, the slowest rank's. MicroDDP rebuilds its buckets
in grad-ready order after its first backward, as torch DDP does, within the warm-up steps.
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from course_utils import Cluster  # noqa: E402


def measure(kind, bucket_cap_mb, steps):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from course_utils.gpt import CharTokenizer, get_batch, load_corpus, make_gpt
    from course_utils.micro_ddp import MicroDDP, time_steps

    torch.manual_seed(0)
    if kind == "mlp":
        def make():
            torch.manual_seed(0)
            layers = []
            for _ in range(6):
                layers += [nn.Linear(512, 512), nn.ReLU()]
            return nn.Sequential(*layers, nn.Linear(512, 1))
        batch = (torch.randn(64, 512), torch.randn(64, 1))
        loss_fn = F.mse_loss
    else:
        text = load_corpus()
        tok = CharTokenizer(text)
        data = tok.encode(text)

        def make():
            return make_gpt(tok.vocab_size, seed=0)
        batch = get_batch(data, 0, dist.get_rank(), 16, 16 * dist.get_world_size())

        def loss_fn(logits, y):
            return F.cross_entropy(logits.flatten(0, 1), y.flatten())
    models = [DDP(make(), bucket_cap_mb=bucket_cap_mb), MicroDDP(make(), bucket_cap_mb=bucket_cap_mb)]
    opts = [torch.optim.SGD(m.parameters(), lr=1e-3, momentum=0.9) for m in models]
    n_params = sum(p.numel() for p in models[0].parameters())
    ddp_s, micro_s = time_steps(models, opts, batch, loss_fn, steps=steps)
    return n_params, len(models[1].buckets), ddp_s, micro_s


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args()
    rows = []
    with Cluster(world_size=args.world_size, timeout=600) as cluster:
        for kind, cap in [("mlp", 25), ("mlp", 1), ("gpt", 25)]:
            n, buckets, ddp_s, micro_s = cluster.run(measure, kind, cap, args.steps)[0]
            rows.append((kind, n, cap, buckets, ddp_s * 1e3, micro_s * 1e3, micro_s / ddp_s))
    print(f"world_size={args.world_size}, gloo on CPU, median of {args.steps} interleaved steps")
    print(f"{'model':6} {'params':>9} {'cap MiB':>8} {'buckets':>8} {'DDP ms':>8} {'Micro ms':>9} {'ratio':>6}")
    for kind, n, cap, buckets, d, m, r in rows:
        print(f"{kind:6} {n:9d} {cap:8g} {buckets:8d} {d:8.2f} {m:9.2f} {r:6.2f}")
    worst = max(r[-1] for r in rows)
    print(f"worst ratio MicroDDP / torch DDP: {worst:.2f}")


if __name__ == "__main__":
    main()
