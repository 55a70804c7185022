"""``data.pack = "documents"``: packed windows train as their documents run one by one.

A bytes token folder of short documents (each ends with EOS = 0) is cut into windows of
T = 8; its windows hold several documents and the tails of documents that began in the
window before. The reference cuts each window at its EOS tokens (not at the .idx offsets
the positions come from) and runs every piece alone through the plain model, positions from
0; the packed model on (ids, positions) must give the same loss and gradients (float64), as
the gpt and as Hugging Face's Llama and Mistral (a sliding window of 2). Then pp x tp x dp
layouts on gloo ranks against the one-device packed model (the Llama at pp 2 x tp 2 under its
own plan by name, "hf", and as the plan object `hybridpar.hf.tp_plan(model)` gives), and a run
of the trainer.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import hybridpar
from hybridpar.data import open_tokens, tokenize_corpus
from hybridpar.data.windows import TokenWindows, check_folder, document_positions
from hybridpar.models import gpt, gpt_loss
from hybridpar.models.packing import pack_documents
from hybridpar.packing import document_mask
from hybridpar.train import load_config

try:   # imported while collecting: the ranks' forkserver then has it imported (conftest)
    import transformers
except ImportError:
    transformers = None

T, EOS, STEPS, BATCH, TIMEOUT = 8, 0, 3, 4, 150
QUICKSTART = Path(__file__).resolve().parents[1] / "configs" / "quickstart.toml"
SMALL = {"vocab_size": 256, "block_size": T, "n_layer": 2, "n_head": 4, "n_embd": 16}
DOCUMENTS = ["ab", "hello", "x", "packed windows", "yz", "q", "documents one by one", "abc",
             "hi there", "z", "attention stays inside", "ok", "pp", "tp"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("pack")
    (root / "corpus.txt").write_text("\n\n".join(DOCUMENTS))
    tokenize_corpus([str(root / "corpus.txt")], root / "tokens", tokenizer="bytes",
                    format="txt", separator="\n\n", val_fraction=0.25, workers=1)
    return root / "tokens"


def packed_batches(folder, steps=STEPS, batch=BATCH):
    windows = TokenWindows(check_folder(folder), seq_len=T, batch_size=batch, seed=1, pack=True)
    return [windows.next_batch() for _ in range(steps)]


def one_by_one(model, x, y):
    """The mean next-token loss of every window's pieces run alone (cut after each EOS)."""
    total = torch.zeros((), dtype=torch.float64)
    for row in range(x.shape[0]):
        cuts = [0, *[i + 1 for i in range(T - 1) if x[row, i] == EOS], T]
        for a, b in itertools.pairwise(cuts):
            logits = model(x[row:row + 1, a:b])                       # (1, b - a, V)
            total = total + F.cross_entropy(logits[0], y[row, a:b], reduction="sum")
    return total / y.numel()


def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters()}


# positions and mask -----------------------------------------------------------------------

def test_positions_restart_at_each_document_and_at_the_window_start():
    ends = np.array([3, 5, 9], dtype=np.uint64)
    assert document_positions(ends, 2, 6).tolist() == [0, 0, 1, 0, 1, 2]
    assert document_positions(ends, 0, 9).tolist() == [0, 1, 2, 0, 1, 0, 1, 2, 3]
    assert document_positions(ends, 6, 3).tolist() == [0, 1, 2]   # a tail: from 0


def test_positions_of_every_window_follow_its_eos_tokens(folder):
    shard = open_tokens(folder).splits["train"][0]
    tokens = np.asarray(shard.tokens).astype(np.int64)
    windows = TokenWindows(check_folder(folder), seq_len=T, batch_size=1, pack=True)
    crossing = 0
    for i in range(windows.windows):
        expected, count = [], 0
        for j in range(T):
            count = 0 if j == 0 or tokens[i * T + j - 1] == EOS else count + 1
            expected.append(count)
        assert windows.positions(i).tolist() == expected
        crossing += i > 0 and tokens[i * T - 1] != EOS
    assert crossing > 0                          # some windows start inside a document


def render(mask):
    return ["".join("x" if v else "." for v in row) for row in mask.tolist()]


def test_the_mask_is_causal_and_block_diagonal():
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2]])
    assert render(document_mask(positions)[0, 0]) == [
        "x.......",
        "xx......",
        "xxx.....",
        "...x....",
        "...xx...",
        ".....x..",
        ".....xx.",
        ".....xxx",
    ]


def test_packed_windows_carry_positions_and_a_rank_reading_nothing_gets_zero_pairs(folder):
    folder_ = check_folder(folder)
    (x, positions), y = TokenWindows(folder_, seq_len=T, batch_size=2, pack=True).next_batch()
    plain_x, plain_y = TokenWindows(folder_, seq_len=T, batch_size=2).next_batch()
    assert torch.equal(x, plain_x) and torch.equal(y, plain_y)
    assert positions.shape == x.shape and positions.dtype == torch.int64
    (zx, zp), zy = TokenWindows(folder_, seq_len=T, batch_size=2, pack=True, inputs=False,
                                targets=False).next_batch()
    assert zx.shape == zp.shape == zy.shape == (2, T) and not zp.any()


# one device: packed against one by one ---------------------------------------------------

def test_packed_gpt_matches_its_documents_run_one_by_one(folder):
    tokens = np.asarray(open_tokens(folder).splits["train"][0].tokens)
    ids = TokenWindows(check_folder(folder), seq_len=T, batch_size=BATCH, seed=1).order(0)
    assert any(tokens[i * T - 1] != EOS for i in ids[:2 * BATCH].tolist() if i > 0), \
        "no row of the batches starts inside a document"
    torch.manual_seed(0)
    model = pack_documents(gpt(**SMALL).double())
    for (x, positions), y in packed_batches(folder, steps=2):
        model.zero_grad()
        packed = gpt_loss(model((x, positions)), y)
        packed.backward()
        got = grads(model)
        model.zero_grad()
        ref = one_by_one(model, x, y)
        ref.backward()
        torch.testing.assert_close(packed, ref, atol=1e-12, rtol=0)
        for name, g in grads(model).items():
            torch.testing.assert_close(got[name], g, atol=1e-12, rtol=0, msg=name)
        # not a vacuous match: attending across documents gives another loss
        assert abs(gpt_loss(model(x), y).item() - packed.item()) > 1e-3


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_changing_one_document_leaves_the_other_documents_logits_alone(dropout):
    """Also with attention dropout (the explicit softmax path), the same masks drawn."""
    torch.manual_seed(0)
    model = pack_documents(gpt(**SMALL, dropout=dropout)).train()
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 0]])
    ids = torch.randint(1, 256, (1, T))
    other = ids.clone()
    other[0, 3:7] = (other[0, 3:7] + 1) % 256                   # the second document only
    outs = []
    for x in (ids, other):
        torch.manual_seed(1)
        outs.append(model((x, positions))[0])                   # (T, V)
    kept = [0, 1, 2, 7]
    torch.testing.assert_close(outs[0][kept], outs[1][kept], atol=1e-6, rtol=0)
    assert (outs[0][3:7] - outs[1][3:7]).abs().max() > 1e-3


def test_without_positions_a_packed_gpt_computes_what_it_did():
    torch.manual_seed(0)
    plain = gpt(**SMALL)
    torch.manual_seed(0)
    packed = pack_documents(gpt(**SMALL))
    ids = torch.randint(0, 256, (2, T))
    assert torch.equal(packed(ids), plain(ids))


def tiny_hf(kind):
    """A tiny float64 Hugging Face causal LM of 256 ids (Mistral: a sliding window of 2)."""
    if transformers is None:
        pytest.skip("hybridpar.hf needs the optional extra hybridpar[hf]")
    tf = transformers
    extra = {"mistral": dict(sliding_window=2), "phi3": dict(sliding_window=2, pad_token_id=0),
             "granite": dict(embedding_multiplier=3.0, logits_scaling=4.0),
             "gemma2": dict(sliding_window=2, head_dim=8, pad_token_id=0, bos_token_id=1,
                            eos_token_id=2)}.get(kind, {})
    config = tf.AutoConfig.for_model(
        kind, vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, **extra)
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(config).double()


# any rotary decoder (`hf.structure`): Phi-3's sliding window, Granite's glue (an InputLayer
# and a LogitsLayer), Gemma 2's scaled-embedding subclass and alternating windows. Gemma 2's
# norms sum their weights' gradients in float32, which depends on how the tokens are split
# (one packed row or documents one by one): its norm weights' gradients agree to 1e-6 of their
# largest entry, the rest to 1e-12.
@pytest.mark.parametrize("kind", ["llama", "mistral", "phi3", "granite", "gemma2"])
def test_packed_hf_model_matches_its_documents_run_one_by_one(folder, kind):
    from hybridpar.hf import to_sequential
    from hybridpar.models.hf import next_token_loss

    model = tiny_hf(kind)
    seq = pack_documents(to_sequential(model))
    (x, positions), y = packed_batches(folder, steps=1)[0]
    packed = next_token_loss(seq((x, positions)), y)
    packed.backward()
    got = grads(seq)
    seq.zero_grad()
    ref = one_by_one(lambda ids: model(ids).logits, x, y)     # Hugging Face's own forward
    ref.backward()
    torch.testing.assert_close(packed, ref, atol=1e-12, rtol=0)
    for name, g in grads(seq).items():
        # a float32 sum's error: float32's epsilon (1.2e-7) times its terms' scale, 10x
        norm = kind == "gemma2" and g.ndim == 1      # its RMSNorms' weights (1-d)
        atol = 1e-6 * float(g.abs().max()) if norm else 1e-12
        torch.testing.assert_close(got[name], g, atol=atol, rtol=0,
                                   msg=lambda m, name=name: f"{name}: {m}")


# pipeline and tensor parallelism ---------------------------------------------------------

def _model(kind, tp):
    if kind == "gpt":
        torch.manual_seed(0)
        return pack_documents(gpt(**SMALL, tp=tp).double()), gpt_loss, None
    from hybridpar.hf import to_sequential, tp_plan
    from hybridpar.models.hf import next_token_loss

    # "llama+tp_plan": the plan object `hybridpar.hf.tp_plan` gives (layer 0 left out: it
    # passes the positions on), instead of the name "hf"
    kind, _, how = kind.partition("+")
    seq = to_sequential(tiny_hf(kind))
    plan = None if tp is None or tp == 1 else tp_plan(seq) if how == "tp_plan" else "hf"
    return pack_documents(seq), next_token_loss, plan


def _sgd(model, loss_fn, batches):
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for x, y in batches:
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, model.state_dict()


def _layout_case(kind, layout, batches):
    pp, tp, dp = layout
    topo = hybridpar.init(pp=pp, tp=tp, dp=dp, timeout=60)
    model, loss_fn, plan = _model(kind, tp if tp > 1 else None)
    balance = [2, len(model) - 2] if pp == 2 else [len(model)]
    pipe = hybridpar.HybridPipe(model, balance, topology=topo, loss_fn=loss_fn, chunks=2,
                                tp_plan=plan, schedule="1f1b")
    opt = torch.optim.SGD(pipe.parameters(), lr=0.5)
    rows = slice(topo.dp_rank * BATCH // dp, (topo.dp_rank + 1) * BATCH // dp)
    losses = []
    for (x, positions), y in batches:
        opt.zero_grad()
        losses.append(pipe.train_step((x[rows], positions[rows]), y[rows]).item())
        opt.step()
    return {"losses": losses, "state": pipe.consolidated_state_dict()}


def _train_case(cfg, run_dir):
    from hybridpar.train.trainer import train

    return train(cfg, run_dir, progress=False)["losses"]


def _cases(layouts, batches, cfg, run_dir):
    out = {f"{kind} {layout}": _layout_case(kind, layout, batches) for kind, layout in layouts}
    out["trainer"] = _train_case(cfg, run_dir)
    return out


def trainer_config(folder, *overrides):
    """`hybridpar run`'s config: the quick start's gpt, small, on the folder, packed."""
    return load_config(QUICKSTART, [
        "model.block_size=8", "model.n_embd=16", "model.n_layer=2", "model.n_head=4",
        "data.source=tokens", f"data.path={folder}", "data.pack=documents", "data.seed=1",
        "parallel.chunks=2", "parallel.timeout=60", "train.steps=3", "train.batch_size=4",
        "train.warmup_steps=1", "train.log_every=1", "train.eval_every=0",
        "train.sample_tokens=4", "checkpoint.every=0", *overrides])


def test_pipeline_tensor_and_data_parallel_packed_runs_match_one_device(folder, tmp_path):
    batches = packed_batches(folder)
    layouts = [("gpt", (2, 2, 1)), ("gpt", (2, 1, 2)), ("gpt", (1, 2, 2))]
    if transformers is not None:
        layouts += [("llama", (2, 2, 1)), ("llama+tp_plan", (2, 2, 1))]
    cfg = trainer_config(folder, "parallel.pp=2", "parallel.tp=2", "parallel.dp=1")
    one = trainer_config(folder, "parallel.pp=1", "parallel.tp=1", "parallel.dp=1")
    ranks = hybridpar.spawn(_cases, 4, args=(layouts, batches, cfg, str(tmp_path / "pp2tp2")),
                            timeout=TIMEOUT)
    for kind, layout in layouts:
        model, loss_fn, _ = _model(kind, None)
        ref_losses, ref_state = _sgd(model, loss_fn, [(tuple(x), y) for x, y in batches])
        for rank in ranks:
            got = rank[f"{kind} {layout}"]
            assert got["losses"] == pytest.approx(ref_losses, rel=1e-6), (kind, layout)
            assert set(got["state"]) == set(ref_state)
            for name, value in ref_state.items():
                torch.testing.assert_close(got["state"][name], value, atol=1e-9, rtol=0,
                                           msg=f"{kind} {layout}: {name}")
    single = hybridpar.spawn(_train_case, 1, args=(one, str(tmp_path / "one")),
                             timeout=TIMEOUT)[0]
    assert len(single) == 3
    for rank in ranks:
        assert rank["trainer"] == pytest.approx(single, rel=1e-5)

