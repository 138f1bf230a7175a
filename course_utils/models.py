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
