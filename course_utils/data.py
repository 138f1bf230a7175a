"""Synthetic data sets generated on the spot: nothing is downloaded.

Introduced in 01_data_parallelism.
"""
import torch


def make_regression(n=256, d_in=16, seed=0, dtype=torch.float32, device=None):
    """``(x, y)`` with ``y = x @ w + noise`` for a fixed random ``w``: the same on every rank.

    The numbers are drawn on the CPU (so they are the same whatever the device) and then moved to ``device``
    (a rank's ``device``: its GPU under NCCL), if given."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d_in, generator=g, dtype=dtype)
    w = torch.randn(d_in, 1, generator=g, dtype=dtype)
    y = x @ w + 0.1 * torch.randn(n, 1, generator=g, dtype=dtype)
    if device is not None:
        x, y = x.to(device), y.to(device)
    return x, y
