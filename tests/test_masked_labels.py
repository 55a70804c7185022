"""Training on a loss mask: every layout's loss and weights equal one device's token mean.

A folder of conversations (`hybridpar tokenize --chat`, ChatML, only the assistant's turns
counted) is cut into windows whose targets are -100 where the mask is 0; micro-batches and
replicas then count different numbers of tokens, so a mean of per-micro-batch means is not
the batch's token mean. The reference is a plain transformers model in float64 trained by
AdamW on the same windows with ``loss = CE(sum over counted targets) / counted targets``
(Hugging Face Trainer's ``average_tokens_across_devices=True``); `HybridPipe` with
`TokenMean` must give the same losses and every parameter to 1e-9 at pp2 x tp2, tp2 x dp2
with sequence parallelism, pp2 x dp2, and packed (``pack="documents"``: the reference runs
each document piece alone). Then `hybridpar run` on the folder trains at pp2 x dp2 as on one
rank.
"""

from __future__ import annotations

import functools
import itertools
import random

import pytest
import torch
import torch.nn.functional as F
from spawn_cases import selected_ids, spawn_cases
from test_tokenize import bpe_tokenizer
from test_tokenize_chat import SPECIALS, model_folder, write_jsonl

import hybridpar
from hybridpar.data import open_tokens
from hybridpar.data.conversations import ChatFields
from hybridpar.data.tokenize import tokenize_corpus
from hybridpar.data.windows import IGNORE_INDEX, PaddedExamples, TokenWindows, check_folder

transformers = pytest.importorskip("transformers")

# SEED draws batches whose halves count different tokens, one of them none
T, BATCH, STEPS, CHUNKS, VOCAB, LR, SEED, TIMEOUT = 16, 4, 3, 2, 384, 0.01, 5, 300
PAD_T = 256     # data.pack = "pad": the conversations hold 35-285 tokens, a few are cut
WORDS = ("pipeline stage tensor shard micro batch gradient token mask loss replica layer "
         "the a of to and is it what why how yes no maybe").split()


def talks(n: int = 48, seed: int = 0) -> list[dict]:
    """Conversations of 1-3 exchanges of 1-12 words each, some with a system message."""
    rng = random.Random(seed)

    def text() -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 12)))

    out = []
    for _ in range(n):
        messages = [{"role": "system", "content": text()}] if rng.random() < 0.3 else []
        for _ in range(rng.randint(1, 3)):
            messages += [{"role": "user", "content": text()},
                         {"role": "assistant", "content": text()}]
        out.append({"messages": messages})
    return out


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("masked")
    tokenizer = model_folder(bpe_tokenizer(root / "tokenizer.json", specials=SPECIALS), root,
                             "chatml")
    tokenize_corpus([write_jsonl(root / "c.jsonl", talks())], root / "tokens",
                    tokenizer=tokenizer, conversations=ChatFields(), val_fraction=0.2,
                    workers=1)
    return root / "tokens"


def windows(folder, *, pack=False, split="train"):
    w = TokenWindows(check_folder(folder), split, seq_len=T, batch_size=BATCH, seed=SEED,
                     pack=pack)
    return [w.next_batch() for _ in range(STEPS)]


def padded(folder, *, multiple=1):
    """The pad batches, each with its rows' real lengths (a twin draws the same documents)."""
    make = functools.partial(PaddedExamples, check_folder(folder), seq_len=PAD_T,
                             batch_size=BATCH, seed=SEED, multiple=multiple)
    rows, twin = make(), make()
    out = []
    for _ in range(STEPS):
        lengths = torch.from_numpy(twin.pairs[twin._take(BATCH).numpy()])
        out.append((*rows.next_batch(), lengths))
    return out


def hf_model(kind: str):
    decoder = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    config = (transformers.Qwen3Config(**decoder, head_dim=8) if kind == "qwen3"
              else transformers.LlamaConfig(**decoder))
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).to(torch.float64)


def pieces(x, positions):
    """(row, start, end) of each document piece of packed windows: a new one at position 0."""
    for row in range(x.shape[0]):
        starts = [int(i) for i in (positions[row] == 0).nonzero()] + [x.shape[1]]
        yield from ((row, a, b) for a, b in itertools.pairwise(starts))


def token_sum(model, x, y, lengths=None):
    """The summed cross-entropy of the counted targets (packed: each piece run alone; padded:
    with transformers' attention mask over each row's real tokens)."""
    if lengths is not None:
        mask = (torch.arange(x.shape[1]) < lengths[:, None]).long()       # (B, L)
        logits = model(input_ids=x, attention_mask=mask).logits
        return F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1),
                               ignore_index=IGNORE_INDEX, reduction="sum")
    if isinstance(x, tuple):
        ids, positions = x
        return sum(F.cross_entropy(model(input_ids=ids[r:r + 1, a:b]).logits[0], y[r, a:b],
                                   ignore_index=IGNORE_INDEX, reduction="sum")
                   for r, a, b in pieces(ids, positions))
    logits = model(input_ids=x).logits
    return F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1), ignore_index=IGNORE_INDEX,
                           reduction="sum")


def reference(kind, batches):
    """The plain model's losses (token means) and weights after AdamW steps."""
    model = hf_model(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for x, y, *lengths in batches:
        opt.zero_grad()
        loss = token_sum(model, x, y, *lengths) / (y != IGNORE_INDEX).sum()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


# (kind, (pp, tp, dp), sequence parallel, data.pack): Llama and Qwen3 at pp2 x tp2, tp2 x dp2
# with sequence parallelism (which refuses packed documents) and pp2 x dp2, windows, packed
# or padded (tests/tiers.py holds half of them for the campaign)
LAYOUTS = [(kind, layout, sp, pack) for kind in ("llama", "qwen3")
           for layout, sp in (((2, 2, 1), False), ((1, 2, 2), True), ((2, 1, 2), False))
           for pack in ("none", "documents", "pad") if not (sp and pack == "documents")]
IDS = [f"{k}-pp{p}tp{t}dp{d}" + ("-sp" if sp else "") + ("" if pk == "none" else f"-{pk}")
       for k, (p, t, d), sp, pk in LAYOUTS]


def batches_of(folder, pack, sp):
    """The batches of a layout: windows, packed windows, or padded rows (a multiple of tp = 2
    under sequence parallelism)."""
    if pack == "pad":
        return padded(folder, multiple=2 if sp else 1)
    return windows(folder, pack=pack == "documents")


def _case(kind, layout, sp, pack, batches):
    from hybridpar.hf import hf_state_dict, to_sequential
    from hybridpar.models.hf import next_token_loss
    from hybridpar.models.packing import pack_documents

    pp, tp, dp = layout
    topo = hybridpar.init(pp=pp, tp=tp, dp=dp, timeout=60)
    model = hf_model(kind)
    seq = to_sequential(model)
    loss_fn = hybridpar.TokenMean(functools.partial(next_token_loss, reduction="sum"))
    pipe = hybridpar.HybridPipe(pack_documents(seq) if pack == "documents" else seq,
                                [2, 3] if pp == 2 else [5], topology=topo, loss_fn=loss_fn,
                                chunks=CHUNKS, schedule="1f1b",
                                tp_plan="auto" if tp > 1 else None, sequence_parallel=sp)
    opt = torch.optim.AdamW(pipe.parameters(), lr=LR)
    rows = slice(topo.dp_rank * BATCH // dp, (topo.dp_rank + 1) * BATCH // dp)
    group = topo.dp_group if dp > 1 and topo.pp_rank == pp - 1 else None
    losses = []
    for x, y, *_ in batches:
        x = tuple(t[rows] for t in x) if isinstance(x, tuple) else x[rows]
        opt.zero_grad()
        with loss_fn.over(y[rows], group=group):
            losses.append(pipe.train_step(x, y[rows]).item())
        opt.step()
    return {"losses": losses, "state": hf_state_dict(pipe.consolidated_state_dict(),
                                                     model.config)}


@pytest.fixture(scope="module")
def runs(folder, request):
    """The selected layouts, on one set of 4 ranks."""
    wanted = selected_ids(request, "test_every_layout_trains_as_the_token_mean_on_one_device")
    cases = {name: (kind, layout, sp, pack, batches_of(folder, pack, sp))
             for name, (kind, layout, sp, pack) in zip(IDS, LAYOUTS) if name in wanted}
    return spawn_cases(_case, 4, cases, timeout=TIMEOUT)


def test_micro_batches_and_replicas_count_different_tokens(folder):
    """Else a mean of means would equal the token mean and the parity could not fail; one
    half counts none (its loss is 0, not NaN)."""
    halves = []
    for x, y in windows(folder):
        counted = (y != IGNORE_INDEX).sum(dim=1)                     # (BATCH,)
        assert 0 < int(counted.sum()) < y.numel()
        halves.append(counted.view(2, -1).sum(dim=1).tolist())     # micro-batch / replica
        assert halves[-1][0] != halves[-1][1]
    assert any(second == 0 for _, second in halves)             # a half that counts none


def test_padded_rows_hold_one_document_each_padded_to_the_batchs_longest(folder):
    rows = PaddedExamples(check_folder(folder), seq_len=PAD_T, batch_size=BATCH, seed=SEED)
    twin = PaddedExamples(check_folder(folder), seq_len=PAD_T, batch_size=BATCH, seed=SEED)
    lengths = [int(n) for n in twin.pairs[twin._take(BATCH).numpy()]]
    x, y = rows.next_batch()
    assert x.shape == y.shape == (BATCH, max(lengths)) and min(lengths) < max(lengths)
    assert (y != IGNORE_INDEX).any()                           # the assistant's tokens
    for r, n in enumerate(lengths):
        assert (y[r, n:] == IGNORE_INDEX).all() and (x[r, n:] == rows.folder.eos_id).all()
    # the replicas' halves, the same length; a multiple of 4 (sequence parallelism)
    halves = [PaddedExamples(check_folder(folder), seq_len=PAD_T, batch_size=BATCH, seed=SEED,
                             dp_rank=r, dp=2, multiple=4).next_batch() for r in (0, 1)]
    width = -(-max(lengths) // 4) * 4
    for r, (hx, hy) in enumerate(halves):
        assert hx.shape == (2, width)
        assert torch.equal(hy[:, :max(lengths)], y[2 * r:2 * r + 2])
    # a rank that reads nothing gets zeros of the batch's shape
    blind = PaddedExamples(check_folder(folder), seq_len=PAD_T, batch_size=BATCH, seed=SEED,
                           inputs=False, targets=False).next_batch()
    assert blind[0].shape == x.shape and not blind[0].any()


def test_the_zoo_gpt_never_attends_to_the_padding(folder):
    """A padded row's real tokens get the logits of the row's document run alone: the gpt
    (as the HF decoders, whose parity is below) needs no attention mask for right padding."""
    from hybridpar.models import gpt

    torch.manual_seed(0)
    model = gpt(vocab_size=VOCAB, block_size=PAD_T, n_layer=2, n_head=4, n_embd=16).double()
    for x, y, lengths in padded(folder)[:2]:
        logits = model(x)                                                  # (B, L, V)
        assert int(lengths.min()) < x.shape[1]
        for r, n in enumerate(lengths.tolist()):
            alone = model(x[r:r + 1, :n])[0]                                # (n, V)
            torch.testing.assert_close(logits[r, :n], alone, rtol=0, atol=1e-12)


def test_overlong_documents_are_cut_or_dropped_and_counted(folder):
    cut = PaddedExamples(check_folder(folder), seq_len=PAD_T, batch_size=BATCH)
    drop = PaddedExamples(check_folder(folder), seq_len=PAD_T, batch_size=BATCH, overlong="drop")
    documents = open_tokens(folder).documents("train")
    assert cut.truncated == drop.dropped > 0 and cut.dropped == drop.truncated == 0
    assert cut.windows == documents and drop.windows == documents - drop.dropped
    assert int(cut.pairs.max()) == PAD_T and int(drop.pairs.max()) <= PAD_T
    with pytest.raises(ValueError, match=r"has no document of 2 tokens or more and at most "
                                         r"seq_len \+ 1 = 3"):
        PaddedExamples(check_folder(folder), seq_len=2, batch_size=BATCH, overlong="drop")


def test_padded_rows_resume_where_they_stopped(folder):
    a = PaddedExamples(check_folder(folder), seq_len=PAD_T, batch_size=BATCH, seed=SEED)
    for _ in range(5):
        a.next_batch()
    b = PaddedExamples(check_folder(folder), seq_len=PAD_T, batch_size=BATCH, seed=SEED)
    b.load_state_dict(a.state_dict())
    for got, want in zip(b.next_batch(), a.next_batch()):
        assert torch.equal(got, want)
    with pytest.raises(ValueError, match=r"past the \d+ documents of"):
        b.load_state_dict({"epoch": 0, "index": 10**6})


@pytest.mark.parametrize("name", IDS)
def test_every_layout_trains_as_the_token_mean_on_one_device(runs, folder, name):
    kind, _, sp, pack = LAYOUTS[IDS.index(name)]
    ref_losses, ref_state = reference(kind, batches_of(folder, pack, sp))
    for got in runs[name]:
        assert got["losses"] == pytest.approx(ref_losses, rel=1e-7)   # shared as float32
        assert set(got["state"]) == set(ref_state)
        worst = max(float((got["state"][k] - v).abs().max()) for k, v in ref_state.items())
        assert worst <= 1e-9, f"{name}: max |diff| {worst:.1e}"


def test_a_mean_of_micro_batch_means_differs_from_the_token_mean(folder):
    """What `TokenMean` corrects: the plain loss_fn's step loss is a mean of micro-batch means
    (and a micro-batch that counts nothing has a NaN mean); inside `over` the micro-batches,
    weighted by their rows as the pipe weights them, add up to the token mean."""
    from hybridpar.hf import to_sequential
    from hybridpar.models.hf import next_token_loss

    model = to_sequential(hf_model("llama"))
    loss_fn = hybridpar.TokenMean(functools.partial(next_token_loss, reduction="sum"))
    batches = windows(folder)
    for k, (x, y) in enumerate(batches):
        token_mean = (next_token_loss(model(x), y, reduction="sum")
                      / (y != IGNORE_INDEX).sum()).item()
        halves = [next_token_loss(model(x[i:i + 2]), y[i:i + 2]).item() for i in (0, 2)]
        with loss_fn.over(y):
            summed = sum(loss_fn(model(x[i:i + 2]), y[i:i + 2]).item() / 2 for i in (0, 2))
        assert summed == pytest.approx(token_mean, rel=1e-12)
        if k == 0:      # 12 + 0 and 11 + 0 counted tokens
            assert abs(sum(halves) / 2 - token_mean) > 1e-6
        if k == 1:      # 13 and 0
            assert halves[1] != halves[1]                      # NaN: a mean of nothing
            assert loss_fn(model(x[2:]), y[2:]).item() == 0.0   # a sum of nothing
    assert loss_fn(model(x[:2]), y[:2]).item() == pytest.approx(halves[0], rel=1e-12)


def _train(cfg, run_dir):
    from hybridpar.train.trainer import train

    return train(cfg, run_dir, progress=False)


def trainer_config(folder, *overrides):
    from pathlib import Path

    from hybridpar.train import load_config

    root = Path(__file__).resolve().parents[1]
    return load_config(root / "configs" / "llama_tiny.toml", [
        f"model.vocab_size={VOCAB}", "model.hidden_size=32", "model.intermediate_size=48",
        "model.num_hidden_layers=2", "data.source=tokens", f"data.path={folder}",
        f"data.seq_len={T}", f"data.seed={SEED}", "parallel.chunks=2", "parallel.timeout=60",
        "parallel.balance=[2, 3]", "train.steps=3", "train.batch_size=4",
        "train.warmup_steps=1", "train.log_every=1", "train.eval_every=3",
        "train.eval_batches=1", "train.sample_tokens=0", "checkpoint.every=0", *overrides])


@pytest.mark.parametrize("pack", ["none", "pad"])
def test_hybridpar_run_on_a_masked_folder_trains_at_pp2_dp2_as_on_one_rank(folder, tmp_path,
                                                                           pack):
    data = [f"data.pack={pack}", f"data.seq_len={PAD_T if pack == 'pad' else T}"]
    four = trainer_config(folder, "parallel.pp=2", "parallel.tp=1", "parallel.dp=2", *data)
    one = trainer_config(folder, "parallel.pp=1", "parallel.tp=1", "parallel.dp=1",
                         "parallel.balance=[5]", "train.sample_tokens=6", *data)
    got = hybridpar.spawn(_train, 4, args=(four, str(tmp_path / "four")), timeout=TIMEOUT)
    want = hybridpar.spawn(_train, 1, args=(one, str(tmp_path / "one")), timeout=TIMEOUT)[0]
    assert len(want["losses"]) == STEPS and list(want["eval"]) == [STEPS]
    for rank in got:
        assert rank["losses"] == pytest.approx(want["losses"], rel=1e-5)
        assert rank["eval"] == pytest.approx(want["eval"], rel=1e-5)
    # the sample: the first held-out conversation's prompt, as the template renders it
    first = open_tokens(folder).splits["val"][0]
    prompt = int(first.mask[:int(first.ends[0])].nonzero()[0][0])
    text = open_tokens(folder).decode(first.tokens[:prompt])
    assert text.startswith("<|im_start|>") and text.endswith("<|im_start|>assistant\n")
    assert want["sample"].startswith(text) and len(want["sample"]) > len(text)


def test_a_loss_without_a_sum_reduction_is_refused_with_the_fix():
    from hybridpar.models import gpt_loss
    from hybridpar.train.build import token_mean_loss

    assert isinstance(token_mean_loss(gpt_loss), hybridpar.TokenMean)
    with pytest.raises(ValueError, match=r"holds conversations with a loss mask, and the "
                                         r"model's loss 'mean_only' takes no reduction"):
        token_mean_loss(mean_only)


def mean_only(output, target):
    return F.cross_entropy(output, target)
