"""`hybridpar tokenize` as a library: every input format, both kinds of tokenizer, the shards'
dtype and split, atomic writes, the no-op re-run, and workers that change nothing."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from hybridpar.data import open_tokens, tokenize_corpus
from hybridpar.data.shards import ShardWriter
from hybridpar.data.split import ValSplit
from hybridpar.data.tokenizer import dtype_for, load_tokenizer

ROOT = Path(__file__).resolve().parents[1]
DOCS = ["Hello, world.\nA second line.", "naïve café — ünïcode ✓", "def f(x):\n    return x\n",
        "short", "the end of the corpus"]


def bpe_tokenizer(path: Path, *, specials=("<|endoftext|>",), vocab_size=320) -> Path:
    """A small byte-level BPE trained by `tokenizers` on text here (nothing is downloaded)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(specials),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(DOCS * 20 + [Path(__file__).read_text()], trainer)
    tok.save(str(path))
    return path


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> Path:
    return bpe_tokenizer(tmp_path_factory.mktemp("bpe") / "tokenizer.json")


def split_tokens(folder: Path, split: str = "train") -> np.ndarray:
    shards = open_tokens(folder).splits[split]
    return np.concatenate([np.asarray(s.tokens) for s in shards]) if shards else np.array([])


def documents(folder: Path, split: str = "train") -> list[str]:
    """Each document of a split decoded on its own, through the .idx document ends."""
    tokens = open_tokens(folder)
    out = []
    for shard in tokens.splits[split]:
        start = 0
        for end in shard.ends:
            out.append(tokens.decode(shard.tokens[start:int(end) - 1]))   # without the EOS
            assert shard.tokens[int(end) - 1] == tokens.eos_id
            start = int(end)
    return out


def write_txt(folder: Path, docs=DOCS) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, doc in enumerate(docs):
        paths.append(folder / f"{i:02d}.txt")
        paths[-1].write_text(doc, encoding="utf-8")
    return paths


def write_jsonl(path: Path, docs=DOCS, field="text") -> Path:
    path.write_text("".join(json.dumps({"id": i, field: d}) + "\n" for i, d in enumerate(docs)),
                    encoding="utf-8")
    return path


# inputs ----------------------------------------------------------------------------------------

def test_a_txt_file_is_one_document_and_bytes_round_trip(tmp_path):
    (tmp_path / "a.txt").write_text(DOCS[1], encoding="utf-8")
    done = tokenize_corpus([tmp_path / "a.txt"], tmp_path / "out", val_fraction=0)
    tokens = split_tokens(tmp_path / "out")
    assert tokens.dtype == np.uint16
    assert bytes(tokens.tolist()) == DOCS[1].encode() + b"\0"           # byte ids, EOS 0
    assert done.meta["documents"] == 1 and done.meta["tokens"] == len(tokens)
    assert done.meta["tokenizer"] | {"sha256": ""} == {"name": "bytes", "kind": "bytes",
                                                      "sha256": "", "vocab_size": 256,
                                                      "eos_id": 0, "eos": "\0",
                                                      "bos_ids": [], "bos_rule": "auto"}


def test_a_separator_splits_txt_into_documents_and_drops_empty_ones(tmp_path):
    (tmp_path / "a.txt").write_text("\n\n".join(["one", "", "two\nlines", "three"]) + "\n\n")
    tokenize_corpus([tmp_path / "a.txt"], tmp_path / "out", separator="\n\n", val_fraction=0)
    assert documents(tmp_path / "out") == ["one", "two\nlines", "three"]
    assert open_tokens(tmp_path / "out").meta["empty_documents_dropped"] == 2


def test_jsonl_takes_the_named_field(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", field="content")
    tokenize_corpus([tmp_path / "a.jsonl"], tmp_path / "out", field="content", val_fraction=0)
    assert documents(tmp_path / "out") == DOCS


def test_gzip_and_zstd_read_as_the_plain_files(tmp_path):
    import zstandard

    write_txt(tmp_path / "plain", DOCS[:2])
    write_jsonl(tmp_path / "plain" / "a.jsonl")
    packed = tmp_path / "packed"
    packed.mkdir()
    for f in sorted((tmp_path / "plain").iterdir()):
        data = f.read_bytes()
        if f.suffix == ".txt":
            (packed / (f.name + ".gz")).write_bytes(gzip.compress(data))
        else:
            (packed / (f.name + ".zst")).write_bytes(zstandard.ZstdCompressor().compress(data))
    tokenize_corpus([tmp_path / "plain"], tmp_path / "a", val_fraction=0)
    tokenize_corpus([tmp_path / "packed"], tmp_path / "b", val_fraction=0)
    assert documents(tmp_path / "a") == DOCS[:2] + DOCS   # 00.txt 01.txt a.jsonl
    assert np.array_equal(split_tokens(tmp_path / "a"), split_tokens(tmp_path / "b"))


def test_parquet_takes_the_named_column(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"id": list(range(len(DOCS))), "body": DOCS}), tmp_path / "a.parquet",
                   row_group_size=2)
    tokenize_corpus([tmp_path / "a.parquet"], tmp_path / "out", field="body", val_fraction=0)
    assert documents(tmp_path / "out") == DOCS


def test_folders_and_globs_take_known_files_in_path_order(tmp_path):
    corpus = tmp_path / "corpus"
    write_txt(corpus / "b", DOCS[2:4])
    write_txt(corpus / "a", DOCS[:2])
    (corpus / "notes.md").write_text("not a corpus file")
    (corpus / ".hidden").mkdir()
    (corpus / ".hidden" / "x.txt").write_text("hidden")
    tokenize_corpus([corpus], tmp_path / "dir", val_fraction=0)
    assert documents(tmp_path / "dir") == DOCS[:4]
    # a glob, and a file given twice (once through the glob) counts once
    tokenize_corpus([str(corpus / "*" / "00.txt"), corpus / "a" / "00.txt"], tmp_path / "glob",
                    val_fraction=0)
    assert documents(tmp_path / "glob") == [DOCS[0], DOCS[2]]
    meta = open_tokens(tmp_path / "dir").meta
    assert [Path(f["path"]).name for f in meta["sources"]["files"]] == ["00.txt", "01.txt"] * 2
    # --format txt reads every file, but never a token folder inside the corpus
    done = tokenize_corpus([corpus], corpus / "tokens", format="txt", val_fraction=0)
    assert documents(corpus / "tokens") == [*DOCS[:4], "not a corpus file"]
    again = tokenize_corpus([corpus], corpus / "tokens", format="txt", val_fraction=0)
    assert again.up_to_date and again.meta == done.meta
    tokenize_corpus([str(corpus / "**" / "*")], tmp_path / "all", format="txt", val_fraction=0)
    assert documents(tmp_path / "all") == documents(corpus / "tokens")


# tokenizers ------------------------------------------------------------------------------------

def test_a_bpe_tokenizer_round_trips_documents_joined_by_its_eos(tmp_path, bpe):
    write_txt(tmp_path / "c")
    done = tokenize_corpus([tmp_path / "c"], tmp_path / "out", tokenizer=bpe, val_fraction=0)
    folder = open_tokens(tmp_path / "out")
    assert folder.meta["tokenizer"]["eos"] == "<|endoftext|>"
    assert folder.eos_id == load_tokenizer(bpe).eos_id == 0
    assert folder.decode(split_tokens(tmp_path / "out")) == "".join(
        d + "<|endoftext|>" for d in DOCS)
    assert documents(tmp_path / "out") == DOCS
    assert folder.meta["tokens"] < sum(len(d.encode()) for d in DOCS)   # merges were used
    assert (tmp_path / "out" / "tokenizer.json").is_file()              # the folder decodes
    assert done.meta["tokenizer"]["sha256"] == load_tokenizer(bpe).sha256


def test_a_model_folder_gives_its_eos_and_eos_names_another(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    bpe_tokenizer(model / "tokenizer.json", specials=("<|endoftext|>", "<s>", "</s>"))
    (model / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    spec = load_tokenizer(model)
    assert (spec.eos, spec.eos_id) == ("</s>", 2)
    assert load_tokenizer(model, eos="<s>").eos_id == 1
    assert load_tokenizer(model, eos="0").eos_id == 0
    assert load_tokenizer("bytes", eos="\n").eos_id == 10
    assert load_tokenizer("bytes", eos=7).eos_id == 7


def test_a_model_folder_without_tokenizer_json_loads_through_transformers(tmp_path, bpe):
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer

    folder = tmp_path / "gpt2-style"                     # vocab.json + merges.txt only
    folder.mkdir()
    Tokenizer.from_file(str(bpe)).model.save(str(folder))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "GPT2Tokenizer", "eos_token": "<|endoftext|>"}))
    assert not (folder / "tokenizer.json").exists()
    write_txt(tmp_path / "c")
    tokenize_corpus([tmp_path / "c"], tmp_path / "a", tokenizer=folder, val_fraction=0)
    tokenize_corpus([tmp_path / "c"], tmp_path / "b", tokenizer=bpe, val_fraction=0)
    assert documents(tmp_path / "a") == DOCS
    assert np.array_equal(split_tokens(tmp_path / "a"), split_tokens(tmp_path / "b"))


def test_the_dtype_is_uint16_up_to_65536_ids_then_uint32(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    assert [dtype_for(n) for n in (256, 65536, 65537, 2**32)] == ["uint16", "uint16",
                                                                  "uint32", "uint32"]
    vocab = {f"w{i}": i for i in range(70_000)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "big.json"))
    (tmp_path / "a.txt").write_text("w5 w69999 w65536")
    tokenize_corpus([tmp_path / "a.txt"], tmp_path / "out", tokenizer=tmp_path / "big.json",
                    eos="w1", val_fraction=0)
    shard = open_tokens(tmp_path / "out").splits["train"][0]
    assert shard.tokens.dtype == np.uint32 and shard.path.stat().st_size == 4 * 4
    assert shard.tokens.tolist() == [5, 69999, 65536, 1]


# split and shards ------------------------------------------------------------------------------

def test_the_split_takes_one_random_document_of_every_stratum():
    split = ValSplit(0.25, seed=0)                       # the docstring's table
    assert split.strata(np.arange(13)).tolist() == [0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3]
    assert "".join("v" if v else "t" for v in split.take(13)) == "tttvttttvtvtt"
    for seed in range(20):
        flags = ValSplit(0.3, seed=seed).take(100)
        whole = ValSplit(0.3, seed=seed)
        in_parts = np.concatenate([whole.take(37), whole.take(63)])
        assert np.array_equal(flags, in_parts)           # batching changes nothing
        assert not flags[0] and 29 <= flags.sum() <= 31  # 100 * 0.3, rounded, less at most 1
    assert not np.array_equal(ValSplit(0.5, seed=1).take(40), ValSplit(0.5, seed=2).take(40))
    assert not ValSplit(0.0, seed=1).take(40).any()


def test_documents_go_to_train_or_val_as_the_split_says(tmp_path):
    docs = [f"document number {i}" for i in range(20)]
    write_jsonl(tmp_path / "a.jsonl", docs)
    done = tokenize_corpus([tmp_path / "a.jsonl"], tmp_path / "out", val_fraction=0.25, seed=3)
    flags = ValSplit(0.25, seed=3).take(20)
    assert documents(tmp_path / "out", "val") == [d for d, v in zip(docs, flags) if v]
    assert documents(tmp_path / "out", "train") == [d for d, v in zip(docs, flags) if not v]
    assert done.meta["splits"]["val"]["documents"] == 5
    assert done.meta["split"] == {"rule": "stratified", "val_fraction": 0.25, "seed": 3}


def test_shards_hold_whole_documents_and_close_past_shard_tokens(tmp_path):
    docs = [f"doc {i} " + "x" * (i % 7) for i in range(30)]
    write_jsonl(tmp_path / "a.jsonl", docs)
    tokenize_corpus([tmp_path / "a.jsonl"], tmp_path / "out", val_fraction=0, shard_tokens=40,
                    batch_bytes=50)
    shards = open_tokens(tmp_path / "out").splits["train"]
    assert len(shards) > 3
    assert all(len(s.tokens) >= 40 for s in shards[:-1])
    assert all(int(s.ends[-2]) < 40 for s in shards[:-1])   # closed by its last document
    assert documents(tmp_path / "out") == docs


# atomicity and re-runs -------------------------------------------------------------------------

def test_a_failure_mid_write_leaves_nothing_behind(tmp_path, monkeypatch):
    write_jsonl(tmp_path / "a.jsonl", [f"doc {i}" for i in range(50)])
    real = ShardWriter.write
    calls = []

    def failing(self, ids, lengths, mask=None):
        calls.append(1)
        if len(calls) == 3:
            raise OSError("disk full (simulated)")
        real(self, ids, lengths)

    monkeypatch.setattr(ShardWriter, "write", failing)
    with pytest.raises(OSError, match="simulated"):
        tokenize_corpus([tmp_path / "a.jsonl"], tmp_path / "out", batch_bytes=20,
                        shard_tokens=30)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.jsonl"]


def test_a_killed_run_leaves_nothing_that_looks_complete(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", [f"doc {i}" for i in range(50)])
    script = textwrap.dedent(f"""
        import os, signal
        from hybridpar.data import shards, tokenize_corpus
        close = shards.ShardWriter._close
        def die(self):
            close(self)
            if len(self.shards) == 2:        # two shard files on disk, then SIGKILL
                os.kill(os.getpid(), signal.SIGKILL)
        shards.ShardWriter._close = die
        tokenize_corpus([{str(tmp_path / "a.jsonl")!r}], {str(tmp_path / "out")!r},
                        batch_bytes=20, shard_tokens=30, workers=2)
    """)
    # the workers die with it: an orphan would hold the pipes open (and time this out)
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                          timeout=60)
    assert done.returncode == -9, done.stderr.decode()
    assert not (tmp_path / "out").exists()
    (left,) = [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]
    assert (left / "train-00001.bin").is_file() and not (left / "meta.json").exists()
    with pytest.raises(ValueError, match=r"no meta\.json"):
        open_tokens(left)
    tokenize_corpus([tmp_path / "a.jsonl"], tmp_path / "out", batch_bytes=20, shard_tokens=30)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.jsonl", "out"]   # leftover gone


def test_running_again_on_the_same_inputs_is_a_no_op(tmp_path, bpe):
    write_txt(tmp_path / "c")
    first = tokenize_corpus([tmp_path / "c"], tmp_path / "out", tokenizer=bpe)
    stamps = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "out").iterdir()}
    again = tokenize_corpus([str(tmp_path / "c" / "*.txt")], tmp_path / "out",
                            tokenizer=str(bpe), workers=2)            # same files, same tokens
    assert (first.up_to_date, again.up_to_date) == (False, True)
    assert again.meta == first.meta
    assert stamps == {p.name: p.stat().st_mtime_ns for p in (tmp_path / "out").iterdir()}
    os.utime(tmp_path / "c" / "00.txt", ns=(1, 1))                       # a changed source
    with pytest.raises(ValueError, match=r"changed: sources\); .*--overwrite"):
        tokenize_corpus([tmp_path / "c"], tmp_path / "out", tokenizer=bpe)
    with pytest.raises(ValueError, match=r"changed: sources, val_fraction"):
        tokenize_corpus([tmp_path / "c"], tmp_path / "out", tokenizer=bpe, val_fraction=0.5)
    redone = tokenize_corpus([tmp_path / "c"], tmp_path / "out", tokenizer=bpe, overwrite=True)
    assert not redone.up_to_date and redone.meta["request"] != first.meta["request"]
    assert redone.meta["fingerprint"] == first.meta["fingerprint"]     # the same tokens


def test_two_workers_write_the_same_bytes_as_one(tmp_path, bpe):
    docs = [f"{d} #{i}" for i in range(40) for d in DOCS[i % 5:i % 5 + 1]]
    write_jsonl(tmp_path / "a.jsonl", docs)
    metas = []
    for workers in (1, 2):
        metas.append(tokenize_corpus([tmp_path / "a.jsonl"], tmp_path / f"w{workers}",
                                     tokenizer=bpe, workers=workers, batch_bytes=100,
                                     shard_tokens=200, val_fraction=0.2).meta)
    assert metas[0] == metas[1]
    names = sorted(p.name for p in (tmp_path / "w1").iterdir())
    assert len(names) > 4 and names == sorted(p.name for p in (tmp_path / "w2").iterdir())
    for name in names:
        assert (tmp_path / "w1" / name).read_bytes() == (tmp_path / "w2" / name).read_bytes()
