"""The batches of a run: the embedded corpus, byte windows, dp shards, seeded order, resume."""

from pathlib import Path

import pytest
import torch

from hybridpar.models import example_batch
from hybridpar.train import Config, load_config
from hybridpar.train.configs.config import DataConfig, ModelConfig, TrainConfig
from hybridpar.train.data import (
    TokenBatches,
    byte_tokens,
    decode,
    default_corpus,
    make_batches,
    split_tokens,
)

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
GPT = {"vocab_size": 256, "block_size": 16, "n_layer": 1, "n_head": 2, "n_embd": 8}


def config(source="corpus", *, batch_size=8, **data):
    """A resolved-looking Config (no layout checks: only the data and the batch size matter)."""
    return Config(model=ModelConfig(name="gpt", args=dict(GPT)),
                  data=DataConfig(source=source, **{"seq_len": 16, **data}),
                  train=TrainConfig(batch_size=batch_size))


def take(batches, n):
    return [batches.next_batch() for _ in range(n)]


def assert_same(a, b):
    assert len(a) == len(b)
    for (xa, ya), (xb, yb) in zip(a, b):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


def test_corpus_is_deterministic_capped_bytes_from_the_stdlib():
    corpus = default_corpus()
    assert isinstance(corpus, bytes) and len(corpus) == 2_000_000
    assert corpus.startswith(b"# file: ")
    small = default_corpus.__wrapped__(1000)         # bypass the cache: really rebuilt
    assert small == corpus[:1000] == default_corpus.__wrapped__(1000)
    assert default_corpus() is corpus                 # cached per process


def test_corpus_skips_tests_and_site_packages():
    names = [line for line in default_corpus().split(b"\n") if line.startswith(b"# file: ")]
    assert len(names) > 10
    assert names == sorted(names, key=lambda n: tuple(n[8:].split(b"/")))
    for name in names:
        parts = name[8:].split(b"/")
        assert not {b"test", b"tests", b"site-packages"} & set(parts)
        assert not parts[-1].startswith(b"test_")


def test_byte_tokens_and_decode_round_trip():
    tokens = byte_tokens("héllo\n".encode())
    assert tokens.dtype == torch.int64 and tokens.max() < 256
    assert decode(tokens) == "héllo\n"


def test_decode_of_ids_past_a_byte_is_a_replacement_character():
    # a model of a larger vocabulary trained on bytes (a resume on data.source = "corpus" of
    # a token-folder checkpoint) samples ids >= 256: the end-of-run sample failed with
    # "bytes must be in range(0, 256)" after training and saving
    assert decode(torch.tensor([104, 105, 300, 301, 0xC3, 0xA9])) == "hi\ufffd\ufffdé"


def test_batches_have_the_right_shape_and_y_is_x_shifted_by_one():
    batches = make_batches(config(batch_size=4))
    for x, y in take(batches, 3):
        assert x.shape == y.shape == (4, 16) and x.dtype == y.dtype == torch.int64
        assert torch.equal(x[:, 1:], y[:, :-1])
    corpus = byte_tokens(default_corpus())
    x, y = make_batches(config(batch_size=4)).next_batch()
    start = int(batches.order(0)[0]) * 16
    assert torch.equal(x[0], corpus[start:start + 16])
    assert torch.equal(y[0], corpus[start + 1:start + 17])


def test_order_matches_the_picture():
    # 19 tokens, seq_len 3: windows 0..5; the table of TokenBatches' docstring
    tokens = torch.arange(19)
    rows = []
    replicas = [TokenBatches(tokens, seq_len=3, batch_size=4, seed=0, dp_rank=r, dp=2)
                for r in range(2)]
    for _ in range(3):
        rows.append(" | ".join(" ".join(str(int(x[i, 0]) // 3) for i in range(2))
                               for x, _ in (b.next_batch() for b in replicas)))
    assert rows == ["2 5 | 3 0", "1 4 | 1 5", "2 0 | 3 4"]


@pytest.mark.parametrize("dp", [2, 4])
def test_dp_shards_concatenate_to_the_one_device_batch(dp):
    whole = take(make_batches(config(batch_size=8)), 3)
    shards = [take(make_batches(config(batch_size=8), dp_rank=r, dp=dp), 3) for r in range(dp)]
    for step, (x, y) in enumerate(whole):
        assert all(s[step][0].shape == (8 // dp, 16) for s in shards)
        assert torch.equal(torch.cat([s[step][0] for s in shards]), x)
        assert torch.equal(torch.cat([s[step][1] for s in shards]), y)


def test_order_is_reproducible_and_depends_on_the_seed():
    assert_same(take(make_batches(config(seed=3)), 2), take(make_batches(config(seed=3)), 2))
    a, b = make_batches(config(seed=3)).next_batch(), make_batches(config(seed=4)).next_batch()
    assert not torch.equal(a[0], b[0])


@pytest.mark.parametrize("source", ["corpus", "synthetic"])
def test_resume_from_state_dict_continues_exactly(source):
    whole = take(make_batches(config(source)), 6)
    first = make_batches(config(source))
    head = take(first, 3)
    state = first.state_dict()
    again = make_batches(config(source))
    again.load_state_dict(dict(state))
    assert_same(head + take(again, 3), whole)


def test_resume_crosses_epochs_and_changes_dp():
    tokens = torch.arange(50)                 # 7 windows of 7: batches of 4 cross epochs
    whole = take(TokenBatches(tokens, seq_len=7, batch_size=4, seed=1), 8)
    first = TokenBatches(tokens, seq_len=7, batch_size=4, seed=1)
    take(first, 4)
    assert first.state_dict()["epoch"] >= 2
    resumed = []
    for r in range(2):                        # the position does not depend on dp
        b = TokenBatches(tokens, seq_len=7, batch_size=4, seed=1, dp_rank=r, dp=2)
        b.load_state_dict(first.state_dict())
        resumed.append(take(b, 4))
    tail = [(torch.cat([a[0], b[0]]), torch.cat([a[1], b[1]])) for a, b in zip(*resumed)]
    assert_same(tail, whole[4:])


def test_every_window_is_visited_once_per_epoch():
    b = TokenBatches(torch.arange(61), seq_len=5, batch_size=3, seed=7)   # 12 windows
    starts = torch.cat([x[:, 0] for x, _ in take(b, 4)])
    assert sorted(starts.tolist()) == list(range(0, 60, 5))
    assert b.state_dict() == {"epoch": 1, "index": 0}


def test_val_split_is_the_tail_and_disjoint_from_train():
    tokens = byte_tokens(default_corpus())
    train, val = split_tokens(tokens, val_fraction=0.05)
    assert len(val) == int(len(tokens) * 0.05) and torch.equal(torch.cat([train, val]), tokens)
    cfg = config(val_fraction=0.05, batch_size=4)
    assert torch.equal(make_batches(cfg).tokens, train)
    batches = make_batches(cfg, split="val")
    assert torch.equal(batches.tokens, val)
    x, y = batches.next_batch()
    start = int(batches.order(0)[0]) * 16
    assert torch.equal(x[0], val[start:start + 16]) and torch.equal(y[0], val[start + 1:start + 17])


def test_text_source_reads_the_file(tmp_path):
    path = tmp_path / "tiny.txt"
    path.write_bytes(bytes(range(256)) * 4)
    batches = make_batches(config("text", path=str(path), val_fraction=0.25))
    x, y = batches.next_batch()
    assert x.shape == (8, 16) and torch.equal((x + 1) % 256, y)
    assert batches.windows == (768 - 1) // 16
    val = make_batches(config("text", path=str(path), val_fraction=0.25), split="val")
    assert val.tokens[0] == 0 and len(val.tokens) == 256


def test_synthetic_source_is_example_batch_sharded():
    cfg = config("synthetic", seed=5)
    x, y = example_batch("gpt", 8, seed=5 + 1, **GPT)
    shards = [make_batches(cfg, dp_rank=r, dp=2) for r in range(2)]
    for s in shards:
        s.next_batch()
    parts = [s.next_batch() for s in shards]
    assert torch.equal(torch.cat([p[0] for p in parts]), x)
    assert torch.equal(torch.cat([p[1] for p in parts]), y)
    assert shards[0].state_dict() == {"step": 2}
    val = make_batches(cfg, split="val").next_batch()
    assert not torch.equal(val[0], example_batch("gpt", 8, seed=5, **GPT)[0])


def test_synthetic_seq_len_sets_the_gpt_length():
    x, y = make_batches(config("synthetic", seq_len=8)).next_batch()
    assert x.shape == y.shape == (8, 8)


def test_synthetic_source_serves_every_model():
    cfg = Config(model=ModelConfig(name="mlp"), train=TrainConfig(batch_size=4))
    x, y = make_batches(cfg, dp_rank=1, dp=2).next_batch()
    assert torch.equal(x, example_batch("mlp", 4, seed=0)[0][2:]) and y.shape == (2,)


def test_shipped_quickstart_config_gives_batches():
    cfg = load_config(CONFIGS / "quickstart.toml")
    dp = cfg.parallel.dp or 1
    x, y = make_batches(cfg, dp=dp).next_batch()
    assert x.shape == y.shape == (cfg.train.batch_size // dp, cfg.data.seq_len)


def test_batch_not_divisible_by_dp_is_rejected():
    with pytest.raises(ValueError, match="batch_size=6 is not divisible by dp=4"):
        make_batches(config(batch_size=6), dp=4)
    with pytest.raises(ValueError, match="dp_rank=2 is not a replica of dp=2"):
        make_batches(config(), dp_rank=2, dp=2)


def test_unknown_source_and_split_are_rejected():
    with pytest.raises(ValueError, match=r"unknown data\.source 'web'"):
        make_batches(config("web"))
    with pytest.raises(ValueError, match="split must be 'train' or 'val'"):
        make_batches(config(), split="test")


def test_missing_empty_or_short_text_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        make_batches(config("text", path=str(tmp_path / "nope.txt")))
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="is empty"):
        make_batches(config("text", path=str(empty)))
    short = tmp_path / "short.txt"
    short.write_bytes(b"x" * 16)
    with pytest.raises(ValueError, match=r"has 16 bytes, fewer than data\.seq_len \+ 1 = 17"):
        make_batches(config("text", path=str(short), val_fraction=0.0))
    with pytest.raises(ValueError, match=r"val split .* larger data\.val_fraction"):
        make_batches(config(val_fraction=0.0), split="val")


def test_state_of_another_kind_is_rejected():
    with pytest.raises(ValueError, match="no valid 'epoch'"):
        make_batches(config()).load_state_dict({"step": 3})
    with pytest.raises(ValueError, match="past the 7 windows"):
        TokenBatches(torch.arange(50), seq_len=7, batch_size=1).load_state_dict(
            {"epoch": 0, "index": 7})
