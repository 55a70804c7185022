"""A shard whose ids exceed the vocabulary (issue 40, point 6): named before step 1.

The story: a folder mixing two tokenizers' shards (meta.json merged by hand) trained until a
window of the foreign shard was drawn, then failed with ``IndexError: index out of range in
self``, naming neither the shard nor the vocabulary. Now every shard's largest id (meta.json's
``max_id``, or a max over its memmap cached in ``max-ids.json``) is checked against meta.json
and the model's vocabulary by the config check and again by every rank as it makes its
batches.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from test_tokenize import DOCS, bpe_tokenizer, write_jsonl

import hybridpar
from hybridpar.data import TokenFolderError, ids, open_tokens, tokenize_corpus
from hybridpar.train import load_config
from hybridpar.train.configs.config import ConfigError
from hybridpar.train.trainer import train

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "configs" / "quickstart.toml"


def _mixed(tmp_path: Path, *, recorded: bool = True) -> Path:
    """A bytes folder (256 ids) with a shard of a 320-id BPE folder merged into its train
    split by hand; `recorded`: the merged records keep their ``max_id``."""
    tmp_path.mkdir(exist_ok=True)
    write_jsonl(tmp_path / "a.jsonl", [d * 30 for d in DOCS] * 4)
    tokenize_corpus([tmp_path / "a.jsonl"], tmp_path / "mixed", val_fraction=0.25)
    bpe = bpe_tokenizer(tmp_path / "tokenizer.json")
    tokenize_corpus([tmp_path / "a.jsonl"], tmp_path / "bpe", tokenizer=bpe, val_fraction=0)
    meta = json.loads((tmp_path / "mixed" / "meta.json").read_text())
    theirs = json.loads((tmp_path / "bpe" / "meta.json").read_text())["splits"]["train"]
    shard = dict(theirs["shards"][0], file="train-00001.bin", index="train-00001.idx")
    for suffix in ("bin", "idx"):
        shutil.copy(tmp_path / "bpe" / f"train-00000.{suffix}",
                    tmp_path / "mixed" / f"train-00001.{suffix}")
    train = meta["splits"]["train"]
    train["shards"].append(shard)
    for key in ("tokens", "documents"):
        train[key] += shard[key]
    for split in meta["splits"].values():
        for record in split["shards"]:
            if not recorded:
                record.pop("max_id")
    (tmp_path / "mixed" / "meta.json").write_text(json.dumps(meta))
    return tmp_path / "mixed"


def config(folder: Path, *overrides: str):
    return load_config(QUICKSTART, [
        "model.vocab_size=256", "model.block_size=16", "model.n_embd=32", "model.n_layer=3",
        "model.n_head=4", "model.dropout=0.0", "data.source=tokens", f"data.path={folder}",
        "parallel.tp=1", "parallel.dp=1", "parallel.chunks=2", "parallel.timeout=60",
        "train.steps=2", "train.batch_size=4", "train.eval_every=0", "train.sample_tokens=0",
        "checkpoint.every=0", *overrides])


def test_tokenize_records_each_shards_largest_id(tmp_path):
    write_jsonl(tmp_path / "a.jsonl")
    done = tokenize_corpus([tmp_path / "a.jsonl"], tmp_path / "out", val_fraction=0.5)
    folder = open_tokens(tmp_path / "out")
    for split, shards in folder.splits.items():
        for shard, record in zip(shards, done.meta["splits"][split]["shards"], strict=True):
            assert record["max_id"] == int(shard.tokens.max())


def test_a_shard_of_another_tokenizer_is_named_by_the_config_check(tmp_path):
    mixed = _mixed(tmp_path)
    with pytest.raises(ConfigError, match=r"train-00001\.bin holds token id 3\d\d, past the "
                       r"256 ids of the folder's tokenizer \(bytes, meta\.json\): it was not "
                       r"written by this folder's tokenizer \(a folder mixing the shards of two "
                       r"tokenizers\?\)"):
        config(mixed)
    assert not (mixed / ids.CACHE).exists()          # meta.json's max_id: nothing read


def test_a_folder_without_max_ids_is_read_once_then_cached(tmp_path, monkeypatch):
    mixed = _mixed(tmp_path, recorded=False)
    reads = []
    real = ids._max_over
    monkeypatch.setattr(ids, "_max_over", lambda p, d: reads.append(p.name) or real(p, d))
    for _ in range(2):
        with pytest.raises(ConfigError, match=r"train-00001\.bin holds token id 3\d\d"):
            config(mixed)
    assert sorted(reads) == ["train-00000.bin", "train-00001.bin", "val-00000.bin"]
    cached = json.loads((mixed / ids.CACHE).read_text())
    assert cached["train-00001.bin"]["max_id"] >= 256
    # a shard replaced (another size or mtime) is read again; the cache never hides it
    shard = mixed / "train-00001.bin"
    shard.write_bytes(bytes(shard.stat().st_size))                  # the same size, id 0
    os.utime(shard, ns=(1, 1))
    assert ids.shard_max_ids(open_tokens(mixed, mmap=False))["train-00001.bin"] < 256
    assert reads[-1] == "train-00001.bin" and len(reads) == 4


def test_a_folder_that_cannot_keep_the_cache_is_checked_without_it(tmp_path):
    mixed = _mixed(tmp_path, recorded=False)
    (mixed / ids.CACHE).mkdir()                   # the cache cannot be written (read-only)
    for _ in range(2):
        with pytest.raises(TokenFolderError, match=r"train-00001\.bin holds token id"):
            ids.check_ids(open_tokens(mixed, mmap=False))


def test_a_model_vocabulary_below_the_ids_is_named(tmp_path):
    write_jsonl(tmp_path / "a.jsonl")
    tokenize_corpus([tmp_path / "a.jsonl"], tmp_path / "out")
    folder = open_tokens(tmp_path / "out", mmap=False)
    ids.check_ids(folder, model_vocab=256)
    with pytest.raises(TokenFolderError, match=r"holds token id \d+, past the vocabulary of "
                       r"model 'gpt' \(vocab_size=100\)"):
        ids.check_ids(folder, model_vocab=100, model="model 'gpt'")


def _run(cfg, run_dir):
    try:
        train(cfg, run_dir, progress=False)
    except ValueError as e:
        return str(e)
    return "trained"


def test_every_rank_refuses_the_folder_before_step_1(tmp_path):
    """The folder checked by the config, mixed before the workers start (or a library user
    who never ran the config check): every rank raises, the middle stage too, which maps no
    shard; no rank reaches step 1 (no metrics, no checkpoint)."""
    write_jsonl(tmp_path / "a.jsonl", [d * 30 for d in DOCS] * 4)
    clean = tmp_path / "clean"
    tokenize_corpus([tmp_path / "a.jsonl"], clean, val_fraction=0.25)
    cfg = config(clean, "parallel.pp=3")
    mixed = _mixed(tmp_path / "m")
    shutil.rmtree(clean)
    shutil.copytree(mixed, clean)
    out = hybridpar.spawn(_run, 3, args=(cfg, str(tmp_path / "run")), timeout=90)
    assert len(out) == 3 and all("train-00001.bin holds token id" in o for o in out), out
    assert all(o.startswith(f"data.path {str(clean)!r}: ") for o in out)
    assert not (tmp_path / "run" / "checkpoints").exists()
