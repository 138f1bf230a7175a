"""Tensor parallelism by hand, Megatron-style: every layer's matrices split over the ranks of a group.

Introduced in 15_beyond_data_parallelism. The two conjugate operators of Megatron-LM (Shoeybi et al.,
2019, section 3) are ``torch.autograd.Function``s:

- ``CopyToTensorParallel`` (Megatron's *f*): identity in forward, all-reduce of the gradient in backward.
  It stands where a replicated activation enters the split layers: every rank's part of the layer
  contributes to the input's gradient, so the parts are summed.
- ``ReduceFromTensorParallel`` (Megatron's *g*): all-reduce in forward, identity in backward. It stands
  where the split layers' partial sums leave: the output is the sum of every rank's part.

``ColumnParallelLinear`` keeps a slice of the output features (rows of the weight) and starts with *f*;
``RowParallelLinear`` keeps the matching slice of the input features (columns) and ends with *g*. An MLP
is column-parallel then row-parallel: one all-reduce forward, one backward, whatever W is. Attention is
split by heads: each rank keeps the q, k and v rows of its heads (column-parallel) and the matching
columns of the output projection (row-parallel).

Every split parameter carries ``tp_dim`` and ``tp_index`` (the rows or columns of the full tensor it
holds), so ``gather_full`` can rebuild full tensors to compare with one process.
"""
import copy
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

__all__ = ["CopyToTensorParallel", "ReduceFromTensorParallel", "copy_to_tp", "reduce_from_tp",
           "ColumnParallelLinear", "RowParallelLinear", "RowParallelLinearFunction", "row_parallel_backward",
           "TensorParallelMLP", "TensorParallelAttention", "tensor_parallel_gpt", "gather_full", "local_numel",
           "shard_index"]


class CopyToTensorParallel(torch.autograd.Function):
    """Megatron's *f*: forward is the identity, backward all-reduces (sums) the gradient over ``group``."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()      # the all-reduce works in place: never on autograd's buffer
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class ReduceFromTensorParallel(torch.autograd.Function):
    """Megatron's *g*: forward all-reduces (sums) the partial outputs over ``group``, backward is the identity."""

    @staticmethod
    def forward(ctx, x, group):
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def copy_to_tp(x, group=None):
    """*f* applied to ``x``. Introduced in 15_beyond_data_parallelism."""
    return CopyToTensorParallel.apply(x, group)


def reduce_from_tp(x, group=None):
    """*g* applied to ``x``. Introduced in 15_beyond_data_parallelism."""
    return ReduceFromTensorParallel.apply(x, group)


def shard_index(size, group=None, parts=1):
    """The indices of ``size`` that this rank of ``group`` keeps: its contiguous 1/W of each of ``parts``
    equal parts (``parts=3`` for a fused q, k, v weight). ``size / parts`` must be divisible by W."""
    world = dist.get_world_size(group)
    if size % parts or (size // parts) % world:
        raise ValueError(f"{size} features in {parts} part(s) do not split evenly over {world} ranks")
    return _index(size, world, dist.get_rank(group), parts)


def _index(size, world, rank, parts):
    part = size // parts
    n = part // world
    return torch.cat([torch.arange(p * part + rank * n, p * part + (rank + 1) * n) for p in range(parts)])


def _shard(param, dim, index, parts=1):
    shard = nn.Parameter(param.detach().index_select(dim, index.to(param.device)).clone())
    shard.tp_dim, shard.tp_index, shard.tp_parts = dim, index, parts
    return shard


class ColumnParallelLinear(nn.Module):
    """This rank's rows of ``linear``'s weight and bias (a 1/W slice of its output features; of each of
    ``parts`` equal parts, for a fused weight), after *f*.

    Input: the full, replicated activation. Output: this rank's slice of the output features."""

    def __init__(self, linear, group=None, parts=1):
        super().__init__()
        self.group = group
        index = shard_index(linear.out_features, group, parts)
        self.weight = _shard(linear.weight, 0, index, parts)
        self.bias = None if linear.bias is None else _shard(linear.bias, 0, index, parts)

    def forward(self, x):
        return F.linear(copy_to_tp(x, self.group), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """This rank's columns of ``linear``'s weight (a 1/W slice of its input features), then *g*, then the bias.

    Input: this rank's slice of the input features. Output: the full, replicated activation. The bias is
    replicated and added once, after the sum (added before it, it would count W times)."""

    def __init__(self, linear, group=None):
        super().__init__()
        self.group = group
        self.weight = _shard(linear.weight, 1, shard_index(linear.in_features, group))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone())

    def forward(self, x):
        y = reduce_from_tp(F.linear(x, self.weight), self.group)
        return y if self.bias is None else y + self.bias


class RowParallelLinearFunction(torch.autograd.Function):
    """The row-parallel linear as one autograd Function: ``all_reduce(x_shard @ weight_shard.T) + bias``.

    15_beyond_data_parallelism's first exercise writes its ``backward``; ``row_parallel_backward`` is the
    course's solution. ``with_backward(fn)`` returns a copy of this Function whose backward is ``fn``."""

    @staticmethod
    def forward(ctx, x_shard, weight_shard, bias, group):
        ctx.save_for_backward(x_shard, weight_shard)
        ctx.group = group
        y = x_shard @ weight_shard.T
        dist.all_reduce(y, group=group)
        return y + bias

    @staticmethod
    def backward(ctx, grad_output):
        return row_parallel_backward(ctx, grad_output)

    @classmethod
    def with_backward(cls, backward):
        return type(f"RowParallelLinear_{getattr(backward, '__name__', 'backward')}", (cls,),
                    {"backward": staticmethod(backward)})


def row_parallel_backward(ctx, grad_output):
    """The course's solution: the gradients of a row-parallel linear, with no communication at all.

    ``grad_output`` is the same on every rank (the output was replicated); each rank's input slice and
    weight slice get their own part of the gradient, and the bias the full (replicated) one."""
    x_shard, weight_shard = ctx.saved_tensors
    grad_x = grad_output @ weight_shard                                       # (..., in / W)
    grad_w = grad_output.reshape(-1, grad_output.shape[-1]).T @ x_shard.reshape(-1, x_shard.shape[-1])
    grad_b = grad_output.reshape(-1, grad_output.shape[-1]).sum(0)
    return grad_x, grad_w, grad_b, None


class TensorParallelMLP(nn.Sequential):
    """A ``Linear, activation, Linear`` MLP, column-parallel then row-parallel: one all-reduce forward
    (in *g*) and one backward (in *f*). Submodule names stay ``0``, ``1``, ``2``, as in the unsplit MLP."""

    def __init__(self, mlp, group=None):
        fc, act, proj = mlp
        super().__init__(ColumnParallelLinear(fc, group), copy.deepcopy(act), RowParallelLinear(proj, group))


class TensorParallelAttention(nn.Module):
    """The tiny GPT's causal self-attention (course_utils.gpt) split by heads over ``group``.

    Each rank keeps n_head / W heads: their rows of q, k and v in ``qkv`` (column-parallel) and their
    columns of ``proj`` (row-parallel). The heads never talk to each other, so attention itself needs
    no communication: one all-reduce forward (after ``proj``) and one backward (before ``qkv``)."""

    def __init__(self, attn, group=None):
        super().__init__()
        world = dist.get_world_size(group)
        if attn.n_head % world:
            raise ValueError(f"{attn.n_head} heads do not split over {world} ranks")
        C = attn.qkv.in_features
        self.n_head, self.head_dim = attn.n_head // world, C // attn.n_head
        self.qkv = ColumnParallelLinear(attn.qkv, group, parts=3)
        self.proj = RowParallelLinear(attn.proj, group)
        self.register_buffer("mask", attn.mask.clone(), persistent=False)

    def forward(self, x):
        B, T, _ = x.shape
        local = self.n_head * self.head_dim
        q, k, v = self.qkv(x).split(local, dim=2)
        q, k, v = (t.view(B, T, self.n_head, self.head_dim).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)
        att = att.masked_fill(~self.mask[:T, :T], float("-inf")).softmax(dim=-1)
        return self.proj((att @ v).transpose(1, 2).reshape(B, T, local))


def tensor_parallel_gpt(model, group=None):
    """Split every block of a course GPT (course_utils.gpt) over ``group``, in place: attention by heads,
    the MLP column- then row-parallel. Embeddings, layer norms and the head stay replicated. Returns it."""
    for block in model.blocks:
        block.attn = TensorParallelAttention(block.attn, group)
        block.mlp = TensorParallelMLP(block.mlp, group)
    return model


def local_numel(model):
    """Numbers this rank holds: ``(in split parameters, in replicated parameters)``."""
    split = sum(p.numel() for p in model.parameters() if hasattr(p, "tp_index"))
    return split, sum(p.numel() for p in model.parameters() if not hasattr(p, "tp_index"))


def gather_full(model, group=None, grad=False):
    """``{name: full tensor}`` of ``model``'s parameters (``grad=True``: their gradients), on every rank of
    ``group``: split parameters are all-gathered and put back in place with their ``tp_index``.
    Replicated ones are returned as they are. A collective: every rank of ``group`` must call it."""
    world = dist.get_world_size(group)
    out = {}
    for name, p in model.named_parameters():
        t = (p.grad if grad else p).detach()
        if not hasattr(p, "tp_index"):
            out[name] = t.clone()
            continue
        parts = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(parts, t.contiguous(), group=group)
        size = len(p.tp_index) * world
        index = torch.cat([_index(size, world, r, p.tp_parts) for r in range(world)])
        shape = list(t.shape)
        shape[p.tp_dim] = size
        full = torch.empty(shape, dtype=t.dtype, device=t.device)
        full.index_copy_(p.tp_dim, index.to(t.device), torch.cat(parts, dim=p.tp_dim))
        out[name] = full
    return out
