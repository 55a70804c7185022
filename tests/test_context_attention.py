"""Context parallelism's first parts: the balanced sequence split and the all-gather attention
mode, against attention over the whole sequence on one process (float64: outputs and the
gradients of q, k and v, for causal, sliding-window and packed-document masks)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import hybridpar
from hybridpar.context import (
    context_attention,
    sequence_index,
    split_sequence,
    unsplit_sequence,
    visible,
)

B, H, T, D = 2, 2, 16, 4
MASKS = {"causal": {}, "window": {"window": 5}, "documents": {"documents": True}}


def test_the_split_gives_each_rank_an_early_and_a_late_chunk_and_unsplits():
    x = torch.arange(8).unsqueeze(0)
    assert split_sequence(x, 2, 0).tolist() == [[0, 1, 6, 7]]
    assert split_sequence(x, 2, 1).tolist() == [[2, 3, 4, 5]]
    assert sequence_index(8, 2, 1).tolist() == [2, 3, 4, 5]
    for cp in (1, 2, 4):
        y = torch.randn(3, 16, 5)
        parts = [split_sequence(y, cp, r) for r in range(cp)]
        assert torch.equal(unsplit_sequence(parts), y)
    # causal work per rank: the visible pairs of its queries, the same on every rank
    work = [int(visible(sequence_index(16, 4, r), torch.arange(16)).sum()) for r in range(4)]
    assert len(set(work)) == 1


def test_a_length_that_two_cp_does_not_divide_is_refused():
    with pytest.raises(ValueError, match=r"a sequence of 12 tokens does not split over cp=4: "
                                         r".* 2·cp = 8 equal chunks; use a sequence length "
                                         r"divisible by 8"):
        split_sequence(torch.zeros(1, 12), 4, 0)


def _inputs():
    g = torch.Generator().manual_seed(0)
    q, k, v, grad = (torch.randn(B, H, T, D, generator=g, dtype=torch.float64)
                     for _ in range(4))
    documents = torch.tensor([[0] * 5 + [1] * 7 + [2] * 4, [0] * 9 + [1] * 7])
    return q, k, v, grad, documents


def _whole(name):
    """Attention over the whole sequence on one process: output and gradients."""
    q, k, v, grad, documents = _inputs()
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    index = torch.arange(T)
    docs = documents if name == "documents" else None
    mask = visible(index, index, window=MASKS[name].get("window"), query_documents=docs,
                   key_documents=docs)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask if mask.dim() == 2
                                         else mask.unsqueeze(1))
    out.backward(grad)
    return out.detach(), q.grad, k.grad, v.grad


def _worker(cp):
    import torch.distributed as dist

    hybridpar.init(dp=cp, timeout=60)   # the cp group here: every rank (no cp mesh dim yet)
    rank, group = dist.get_rank(), dist.group.WORLD
    q, k, v, grad, documents = _inputs()
    local = [split_sequence(t, cp, rank, dim=2).requires_grad_() for t in (q, k, v)]
    index = sequence_index(T, cp, rank)
    out = {}
    for name, options in MASKS.items():
        for t in local:
            t.grad = None
        docs = split_sequence(documents, cp, rank) if "documents" in options else None
        y = context_attention(*local, index, group, window=options.get("window"),
                              documents=docs)
        y.backward(split_sequence(grad, cp, rank, dim=2))
        out[name] = (y.detach(), *(t.grad for t in local))
    return out


@pytest.mark.parametrize("cp", [2, 4])
def test_context_attention_equals_attention_over_the_whole_sequence(cp):
    results = hybridpar.spawn(_worker, cp, args=(cp,), timeout=120)
    for name in MASKS:
        whole = _whole(name)
        for i, what in enumerate(("output", "dq", "dk", "dv")):
            got = unsplit_sequence([r[name][i] for r in results], dim=2)
            torch.testing.assert_close(got, whole[i], atol=1e-12, rtol=0,
                                       msg=lambda m, n=name, w=what: f"{n} {w}: {m}")
