"""HybridPipe(to_sequential(hf_model)) trains as the single-device Hugging Face model does.

float64 and 3 AdamW steps: the final parameters, under HF names, to 1e-9; the loss of every
step to float32 precision (train_step returns the loss in float32)."""

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers", reason="hybridpar.hf needs the optional extra hybridpar[hf]")

from hf_models import tiny, token_batches

import hybridpar
from hybridpar.hf import hf_state_dict, init_fn, load_hf_checkpoint, to_sequential
from hybridpar.nn import CausalLMLoss

STEPS, BATCH, SEQ, TOL, SEED = 3, 4, 8, 1e-9, 11


def _next_token_loss(logits, targets):
    """Targets already shifted by the caller: (B, T) next tokens."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _batches(ignore):
    """(input ids, targets or labels) per step; labels with uneven ignored tokens if asked."""
    out = []
    for tokens in token_batches(STEPS, BATCH, SEQ + 1):
        if ignore:                           # labels aligned with the ids; the loss shifts
            labels = tokens[:, :-1].clone()
            labels[0, 2:] = -100             # micro-batch 0 scores fewer tokens than 1
            out.append((tokens[:, :-1], labels))
        else:                                # next-token targets, shifted here
            out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


def residual_dropout(model, p):
    """`model` (tiny) with dropout `p` everywhere but inside the attention core (GPT-2: the
    embedding's and the residual branches'; Llama-style models have none there)."""
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Dropout) and not name.endswith("attn_dropout"):
            m.p = p
    return model


def _reference(kind, ignore, dropout=0.0, chunks=1):
    """The HF model on one device: losses and final state dict. `chunks` > 1 (labels only):
    the batch in that many micro-batches, their gradients accumulated (each part's loss the
    sum over its scored tokens / the batch's)."""
    model = residual_dropout(tiny(kind), dropout)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    torch.manual_seed(SEED)                   # the dropout masks' stream, as `_train`'s
    for ids, y in _batches(ignore):
        opt.zero_grad()
        if chunks > 1:
            scored = (y[:, 1:] != -100).sum()
            loss = 0.0
            for part, labels in zip(ids.chunk(chunks), y.chunk(chunks), strict=True):
                logits = model(part).logits
                partial = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(),
                                          ignore_index=-100, reduction="sum") / scored
                partial.backward()
                loss += partial.item()
            opt.step()
            losses.append(loss)
            continue
        logits = model(ids).logits                                   # (B, T, V)
        if ignore:   # HF's loss in float64: the mean over the batch's scored tokens
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), y[:, 1:].flatten(),
                                   ignore_index=-100)
        else:
            loss = _next_token_loss(logits, y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, model.state_dict()


def _train(kind, ignore, topo, balance, options, dropout=0.0):
    """HybridPipe training of `kind`; the replica check after every step (`check_replicas`)."""
    model = residual_dropout(tiny(kind), dropout)
    loss_fn = CausalLMLoss() if ignore else _next_token_loss
    pipe = hybridpar.HybridPipe(to_sequential(model), balance, topology=topo, loss_fn=loss_fn,
                                **options)
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    losses = []
    torch.manual_seed(SEED)                   # the dropout masks' stream, as `_reference`'s
    for ids, y in _batches(ignore):
        opt.zero_grad()
        if ignore:
            with loss_fn.token_mean_over(y):                 # exact token mean of the batch
                losses.append(pipe.train_step(ids, y).item())
        else:
            losses.append(pipe.train_step(ids, y).item())
        pipe.check_replicas()
        opt.step()
    return {"losses": losses, "state": hf_state_dict(pipe.consolidated_state_dict(),
                                                     model.config),
            "decisions": pipe.tp_plan_decisions, "partial": pipe.partial_grads}


def _from_checkpoint(topo, directory, ids):
    """A meta-built pipe materialized by init_fn, loaded from an HF checkpoint: its loss."""
    with torch.device("meta"):
        model = tiny("llama")
    pipe = hybridpar.HybridPipe(to_sequential(model), [2, 3], topology=topo, chunks=2,
                                loss_fn=CausalLMLoss(), init_fn=init_fn(model))
    pipe.load_consolidated_state_dict(load_hf_checkpoint(directory))
    return pipe.eval_step(ids, ids).item()


def _llama_worker(directory, ids):
    topo = hybridpar.init(pp=2, timeout=60)
    return {
        "plain": _train("llama", False, topo, [2, 3], {"chunks": 2}),
        "causal_lm_loss": _train("llama", True, topo, [3, 2],
                                 {"chunks": 2, "schedule": "1f1b", "checkpoint": "always"}),
        "from_checkpoint": _from_checkpoint(topo, directory, ids),
    }


def _gpt2_worker(pp, balance):
    topo = hybridpar.init(pp=pp, timeout=60)
    return _train("gpt2", True, topo, balance, {"chunks": 2})


def _assert_same(got, ref):
    ref_losses, ref_state = ref
    assert got["losses"] == pytest.approx(ref_losses, rel=1e-7)
    assert set(got["state"]) == set(ref_state)
    for k, v in ref_state.items():
        torch.testing.assert_close(got["state"][k], v, atol=TOL, rtol=0, msg=k)


def test_llama_two_stages_trains_as_the_hf_model(tmp_path):
    model = tiny("llama", seed=5)
    model.save_pretrained(tmp_path, max_shard_size="20KB")          # sharded safetensors
    ids = token_batches(1, BATCH, SEQ, seed=7)[0]
    hf_loss = F.cross_entropy(model(ids).logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    results = hybridpar.spawn(_llama_worker, 2, args=(str(tmp_path), ids), timeout=120)
    plain, causal = _reference("llama", False), _reference("llama", True)
    for r in results:
        _assert_same(r["plain"], plain)
        _assert_same(r["causal_lm_loss"], causal)
        assert r["from_checkpoint"] == pytest.approx(hf_loss.item(), rel=1e-7)


@pytest.mark.parametrize("pp,balance", [(1, [5]), (2, [2, 3])])
def test_gpt2_tied_head_trains_as_the_hf_model(pp, balance):
    # pp=2: the embedding (stage 0) and its tied head (stage 1) on different stages
    got = hybridpar.spawn(_gpt2_worker, pp, args=(pp, balance), timeout=120)
    ref = _reference("gpt2", True)
    for r in got:
        _assert_same(r, ref)
        assert torch.equal(r["state"]["lm_head.weight"], r["state"]["transformer.wte.weight"])
