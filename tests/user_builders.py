"""Model builders named in configs as ``model.name = "user_builders:<function>"`` (tests)."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


class Tokens(nn.Module):
    def __init__(self, vocab: int, width: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)

    def forward(self, ids):
        return self.embed(ids)


def next_token(logits, target):
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def tiny_lm(*, vocab_size: int = 256, width: int = 16, blocks: int = 2):
    """A user's token model: (nn.Sequential, loss)."""
    layers = [Tokens(vocab_size, width)]
    for _ in range(blocks):
        layers.append(nn.Sequential(nn.Linear(width, width), nn.Tanh()))
    layers.append(nn.Linear(width, vocab_size))
    return nn.Sequential(*layers), next_token


def bare(*, width: int = 4):
    """A builder that forgets the loss."""
    return nn.Sequential(nn.Linear(width, width))


# built on meta (model.init = "keyed"): tests/test_user_builder_meta.py ---------------------

class Channels(nn.Module):
    """A (B, C, T) layer applied to (B, T, C) activations: Conv1d, BatchNorm1d."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x):
        return self.layer(x.transpose(1, 2)).transpose(1, 2)


class SelfAttention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)

    def forward(self, x):
        return self.attn(x, x, x, need_weights=False)[0]


class Gain(nn.Module):
    """A tensor of its own, drawn by nn.init.trunc_normal_ (a no-op on meta tensors)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.empty(width))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.trunc_normal_(self.gain, mean=1.0, std=0.02)

    def forward(self, x):
        return x * self.gain


def stack(*, vocab_size: int = 256, width: int = 8):
    """Embedding, Linear, LayerNorm, Conv1d, BatchNorm1d, MultiheadAttention, a trunc-normal
    gain and the head: every tensor set by its module's reset."""
    layers = [nn.Embedding(vocab_size, width, padding_idx=0),
              nn.Sequential(nn.Linear(width, width), nn.Tanh()), nn.LayerNorm(width),
              Channels(nn.Conv1d(width, width, 3, padding=1)), Channels(nn.BatchNorm1d(width)),
              SelfAttention(width, 2), Gain(width), nn.Linear(width, vocab_size)]
    return nn.Sequential(*layers), next_token


def tied(*, vocab_size: int = 256, width: int = 8):
    """Embedding and head sharing one weight (the embedding's draw, its first holder)."""
    model, loss = tiny_lm(vocab_size=vocab_size, width=width)
    model[-1].weight = model[0].embed.weight
    return model, loss


def reads_a_value(*, width: int = 8):
    """(a) reads a tensor's value while building: fails on meta."""
    scale = torch.ones(1).item()
    return nn.Sequential(nn.Linear(width, int(scale * width))), next_token


class Scale(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x):
        return x * self.weight


def no_reset(*, width: int = 8):
    """(b) Scale owns a weight but has no reset_parameters()."""
    return nn.Sequential(nn.Embedding(256, width), Scale(width), nn.Linear(width, 256)), \
        next_token


class Positions(nn.Module):
    """Its reset draws the table but not `index`, which __init__ computes."""

    def __init__(self, length: int, width: int) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.empty(length, width))
        self.register_buffer("index", torch.arange(length, dtype=torch.float32))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.table, std=0.02)

    def forward(self, x):
        return x + self.table[: x.shape[1]] * self.index[: x.shape[1], None]


def unreset_buffer(*, width: int = 8):
    """(c) a buffer no reset writes."""
    return nn.Sequential(nn.Embedding(256, width), Positions(16, width),
                         nn.Linear(width, 256)), next_token


def zeroed_bias(*, width: int = 8):
    """(d) a write after construction: the head's bias zeroed."""
    model, loss = tiny_lm(width=width)
    nn.init.zeros_(model[-1].bias)
    return model, loss


def _small_normal(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        nn.init.trunc_normal_(module.weight, std=0.02)


def custom_init(*, width: int = 8):
    """(d) model.apply(init) after construction, by trunc_normal_ (a no-op on meta)."""
    model, loss = tiny_lm(width=width)
    model.apply(_small_normal)
    return model, loss


def from_data(*, width: int = 8):
    """(e) a weight made from data, not on meta."""
    model, loss = tiny_lm(width=width)
    model[-1].weight = nn.Parameter(torch.from_numpy(np.ones((256, width), dtype=np.float32)))
    return model, loss
