"""Sampling tokens from a model's logits: `generate` (a `gpt`, or any callable giving logits)."""

from __future__ import annotations

from collections.abc import Callable, Collection

import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from hybridpar.models.gpt_layers import Embeddings
from hybridpar.sharded.attrs import get_parallel_dim
from hybridpar.sharded.mappings import all_gather_along
from hybridpar.topology import default_tp_group

__all__ = ["generate"]


def _block_size_of(model: Callable[[Tensor], Tensor]) -> int | None:
    if isinstance(model, nn.Module):
        for sub in model.modules():
            if isinstance(sub, Embeddings):
                return sub.block_size
    return None


@torch.no_grad()
def generate(model: Callable[[Tensor], Tensor], idx: Tensor, max_new_tokens: int, *,
             temperature: float = 1.0, top_k: int | None = None,
             generator: torch.Generator | None = None, block_size: int | None = None,
             group: ProcessGroup | None = None, stop: Collection[int] = ()) -> Tensor:
    """Sample `max_new_tokens` tokens after `idx` (B, T); returns (B, T + max_new_tokens).

    `model` is any callable mapping ids (B, t) to logits (B, t, V): a `gpt`, or a
    `HybridPipe`'s forward (full logits on every rank). Logits tagged as vocab-sharded are
    gathered over `group` first. The context is cropped to its last `block_size` tokens
    (default: the model's `Embeddings.block_size` when it holds one, else no crop).
    `temperature` 0 picks the most likely token; `top_k` keeps the k most likely. Given the
    same `generator` state, the same logits give the same tokens (on every rank). Sampling
    ends early once every row has drawn a token of `stop` (an end-of-turn; the tokens are the
    same on every rank, so every rank ends at the same step). The model's train / eval mode is
    left as it is: call ``model.eval()`` to sample without dropout.
    """
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0: greedy), got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be a positive integer or None, got {top_k}")
    if block_size is None:
        block_size = _block_size_of(model)
    stops = torch.tensor(sorted(stop), dtype=torch.int64)
    ended = torch.zeros(idx.shape[0], dtype=torch.bool)                   # (B,)
    for _ in range(max_new_tokens):
        context = idx if block_size is None else idx[:, -block_size:]   # (B, t)
        logits = model(context)                                 # (B, t, V) or (B, t, V / tp)
        if get_parallel_dim(logits) in (-1, 1):
            logits = all_gather_along(logits, -1, group if group is not None
                                      else default_tp_group())  # (B, t, V)
        logits = logits[:, -1, :].float()                       # (B, V)
        if temperature == 0:
            nxt = logits.argmax(dim=-1, keepdim=True)           # (B, 1)
        else:
            logits = logits / temperature
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]  # (B, 1)
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = logits.softmax(dim=-1)                      # (B, V)
            if generator is not None:
                probs = probs.to(generator.device)              # sample where it draws
            nxt = torch.multinomial(probs, 1, generator=generator).to(idx.device)  # (B, 1)
        idx = torch.cat([idx, nxt.to(idx.dtype)], dim=1)        # (B, t + 1)
        if stop:
            ended = ended | torch.isin(nxt[:, 0].cpu(), stops)  # (B,)
            if bool(ended.all()):
                break
    return idx
