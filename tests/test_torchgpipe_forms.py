"""torchgpipe's argument forms and checks, as HybridPipe takes them (on every rank)."""

from __future__ import annotations

import torch
from torch import nn

import hybridpar


class Mode(str):
    """A str subclass (torchgpipe accepts one for `checkpoint`)."""


def worker():
    topo = hybridpar.init(pp=2, timeout=30)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    results = {}
    pipe = hybridpar.HybridPipe(model, [2, 1], chunks=2.0, checkpoint=Mode("always"),
                                topology=topo, loss_fn=nn.functional.cross_entropy)
    results["forms"] = [pipe.chunks, type(pipe.chunks).__name__, pipe.checkpoint,
                        type(pipe.checkpoint).__name__,
                        pipe.train_step(torch.randn(4, 4), torch.zeros(4, dtype=torch.long)).item()]
    conv = nn.Linear(4, 4)
    for name, build in {
        "duplicate": lambda: hybridpar.HybridPipe(nn.Sequential(conv, conv), [1, 1],
                                                  topology=topo),
        "fraction": lambda: hybridpar.HybridPipe(nn.Sequential(nn.Linear(2, 2), nn.ReLU()),
                                                 [1, 1], chunks=2.5, topology=topo),
        "bool": lambda: hybridpar.HybridPipe(nn.Sequential(nn.Linear(2, 2), nn.ReLU()),
                                             [1, 1], chunks=True, topology=topo),
    }.items():
        try:
            build()
            results[name] = "no error"
        except ValueError as e:
            results[name] = str(e)
    return results


def test_int_like_chunks_and_str_like_checkpoint_are_accepted_and_duplicates_refused():
    for r in hybridpar.spawn(worker, 2, timeout=60):
        chunks, chunks_type, mode, mode_type, loss = r["forms"]
        assert (chunks, chunks_type, mode, mode_type) == (2, "int", "always", "str")
        assert loss == loss
        assert r["duplicate"].startswith("module with duplicate children is not supported")
        assert "chunks must be a positive integer, got 2.5" in r["fraction"]
        assert "chunks must be a positive integer, got True" in r["bool"]
