"""A to_sequential model built on the meta device, materialized with hybridpar.hf.init_fn."""

import pytest
import torch

pytest.importorskip("transformers", reason="hybridpar.hf needs the optional extra hybridpar[hf]")

from hf_models import tiny, token_batches

from hybridpar.hf import init_fn, to_sequential


def _materialize(seq, fn):
    """What HybridPipe does to a meta stage: to_empty, NaN-fill, then fn on every module."""
    seq.to_empty(device="cpu")
    with torch.no_grad():
        for t in [*seq.parameters(), *seq.buffers()]:
            t.fill_(float("nan"))
    seq.apply(fn)


@pytest.mark.parametrize("kind", ["llama", "qwen3", "gpt2"])
@pytest.mark.parametrize("give", ["model", "config"])
def test_meta_build_then_init_fn_gives_real_buffers_and_loads(kind, give):
    cpu = tiny(kind)
    with torch.device("meta"):
        meta = tiny(kind)
    seq = to_sequential(meta)
    assert all(t.is_meta for t in seq.parameters())
    _materialize(seq, init_fn(meta if give == "model" else meta.config))
    for name, t in [*seq.named_parameters(), *seq.named_buffers()]:
        assert not t.is_meta and torch.isfinite(t).all(), name
    reference = to_sequential(cpu)
    buffers = dict(reference.named_buffers())
    assert set(buffers) == {n for n, _ in seq.named_buffers()}
    for name, t in seq.named_buffers():                   # inv_freq, original_inv_freq
        assert torch.equal(t, buffers[name]), name
    if kind != "gpt2":
        assert torch.equal(seq[1].inv_freq, cpu.model.rotary_emb.inv_freq)
        norm = seq[len(seq) - 2].weight                   # RMSNorm: ones, as HF initializes it
        assert torch.equal(norm, torch.ones_like(norm))
    else:  # to_empty gives every module its own tensor: tie them again before loading
        seq[-1].weight = seq[0].wte.weight
    seq.load_state_dict(reference.state_dict(), strict=True)
    ids = token_batches(1, 2, 7)[0]
    assert torch.equal(seq(ids), cpu(ids).logits)


def test_decoder_block_reset_parameters_recomputes_the_rotary_buffers():
    seq = to_sequential(tiny("llama"))
    expected = seq[2].inv_freq.clone()
    with torch.no_grad():
        seq[2].inv_freq.fill_(float("nan"))
        seq[2].original_inv_freq.zero_()
    seq[2].reset_parameters()
    assert torch.equal(seq[2].inv_freq, expected)
    assert torch.equal(seq[2].original_inv_freq, expected)
