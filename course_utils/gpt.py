"""A tiny character-level GPT and the helpers the capstone trains it with.

Introduced in 11_capstone_micro_ddp; scripts/train_micro_ddp.py trains the same model under
torchrun. The corpus ships with the package (``corpus.txt``, written for the course, public
domain): nothing is downloaded. Batches depend only on (seed, step, index in the global batch),
so which rank or node computes a micro-batch changes nothing but the order of the sums.
"""
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

CORPUS = Path(__file__).with_name("corpus.txt")


def load_corpus():
    """The course's text corpus (about 15 KB of plain English)."""
    return CORPUS.read_text(encoding="utf-8")


class CharTokenizer:
    """One token per character that occurs in ``text``."""

    def __init__(self, text):
        self.chars = sorted(set(text))
        self.index = {c: i for i, c in enumerate(self.chars)}
        self.vocab_size = len(self.chars)

    def encode(self, text):
        return torch.tensor([self.index[c] for c in text], dtype=torch.long)

    def decode(self, ids):
        return "".join(self.chars[i] for i in ids.tolist())


@dataclass
class GPTConfig:
    vocab_size: int
    block_size: int = 32
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 48


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        mask = torch.tril(torch.ones(cfg.block_size, cfg.block_size, dtype=torch.bool))
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(C // self.n_head)
        att = att.masked_fill(~self.mask[:T, :T], float("-inf")).softmax(dim=-1)
        return self.proj((att @ v).transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(cfg.n_embd), nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.mlp = nn.Sequential(nn.Linear(cfg.n_embd, 4 * cfg.n_embd), nn.GELU(),
                                 nn.Linear(4 * cfg.n_embd, cfg.n_embd))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Token and position embeddings, ``n_layer`` pre-norm blocks, a linear head: logits (B, T, vocab)."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.Sequential(*[Block(cfg) for _ in range(cfg.n_layer)])
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear):
                nn.init.zeros_(m.bias)

    def forward(self, idx):
        T = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        return self.head(self.ln_f(self.blocks(x)))


def make_gpt(vocab_size, seed=0, **config):
    """A GPT whose weights depend only on ``seed``: every rank builds the same one."""
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=vocab_size, **config))


def get_batch(data, step, index, micro_batch_size, global_batch_size, block_size=32, seed=0):
    """Micro-batch number ``index`` of the global batch of ``step``: inputs and next-character targets.

    The global batch is ``global_batch_size`` windows drawn from a generator seeded by (seed, step);
    micro-batch ``index`` is its slice ``[index * micro_batch_size, (index + 1) * micro_batch_size)``.
    Rank r's micro-step m is ``index = r * accum_steps + m``: sharding by global rank.
    """
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(len(data) - block_size - 1, (global_batch_size,), generator=g)
    starts = starts[index * micro_batch_size:(index + 1) * micro_batch_size]
    x = torch.stack([data[s:s + block_size] for s in starts.tolist()])
    y = torch.stack([data[s + 1:s + 1 + block_size] for s in starts.tolist()])
    return x, y


@torch.no_grad()
def generate(model, tokenizer, prompt, max_new_tokens=200, temperature=0.8, seed=0):
    """Sample ``max_new_tokens`` characters after ``prompt`` with a seeded generator: deterministic."""
    model.eval()
    g = torch.Generator().manual_seed(seed)
    idx = tokenizer.encode(prompt)[None].to(next(model.parameters()).device)  # the model's device
    block = model.cfg.block_size
    for _ in range(max_new_tokens):
        logits = model(idx[:, -block:])[:, -1] / temperature
        # sample on the CPU with the CPU generator: the same draw whatever device the model is on
        nxt = torch.multinomial(logits.softmax(dim=-1).cpu(), 1, generator=g).to(idx.device)
        idx = torch.cat([idx, nxt], dim=1)
    model.train()
    return tokenizer.decode(idx[0].cpu())


def save_checkpoint(path, state):
    """Write ``state`` with torch.save, atomically: to a temporary file, then ``os.replace``.

    A crash mid-write leaves the previous checkpoint intact. Call it on rank 0 only, then barrier.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    torch.save(state, tmp)
    os.replace(tmp, path)  # atomic on POSIX: readers see the old file or the new one, never half
    return path


def load_checkpoint(path):
    """What ``save_checkpoint`` wrote, on the CPU (``map_location``), tensors and plain data only."""
    return torch.load(path, map_location="cpu", weights_only=True)


def plot_losses(losses, title="Tiny GPT: training loss", resumed=None):
    """The loss curve; ``resumed`` = (first step, losses) of a resumed run, drawn on top."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3))
    ax.plot(range(len(losses)), losses, label="uninterrupted run")
    if resumed is not None:
        start, rest = resumed
        ax.plot(range(start, start + len(rest)), rest, ls="--", label="resumed from checkpoint")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/char)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    plt.show()
    plt.close(fig)
