"""Model builders named in configs as ``model.name = "user_builders:<function>"`` (tests)."""

from __future__ import annotations

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
