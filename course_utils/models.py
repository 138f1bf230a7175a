"""Small models shared by the lessons, so every lesson trains the same thing.

Introduced in 01_data_parallelism.
"""
import torch
from torch import nn


class TinyMLP(nn.Module):
    """A two-layer MLP: small enough for CPU, big enough to have several DDP buckets."""

    def __init__(self, d_in=16, d_hidden=64, d_out=1):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d_in, d_hidden), nn.ReLU(), nn.Linear(d_hidden, d_out))

    def forward(self, x):
        return self.net(x)


def make_model(seed=0, **kwargs):
    """A TinyMLP with weights that depend only on ``seed`` (every rank builds the same one)."""
    torch.manual_seed(seed)
    return TinyMLP(**kwargs)


class Reordered(nn.Module):
    """An MLP registered in another order than its forward uses it: ``head`` first (used last),
    ``embed`` last (used first). Reverse registration order then puts ``embed`` in the first
    bucket, whose gradient backward produces LAST. Introduced in 11_capstone_micro_ddp (07_buckets_and_overlap
    builds the same model in a cell); ``check_micro_ddp`` trains a small one."""

    def __init__(self, d_in=32, d_hidden=256, n_blocks=4, d_out=1):
        super().__init__()
        self.head = nn.Linear(d_hidden, d_out)                         # registered first, used last
        self.blocks = nn.ModuleList(nn.Linear(d_hidden, d_hidden) for _ in range(n_blocks))
        self.embed = nn.Linear(d_in, d_hidden)                         # registered last, used first

    def forward(self, x):
        h = torch.relu(self.embed(x))
        for block in self.blocks:
            h = torch.relu(block(h))
        return self.head(h)
