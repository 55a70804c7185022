"""Bad input to `hybridpar tokenize` and to `open_tokens`: an error naming the file (and line)
and the fix, raised before any output (no --out folder, no hidden leftover)."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import numpy as np
import pytest
from test_tokenize import DOCS, bpe_tokenizer, write_jsonl, write_txt

from hybridpar.data import CorpusError, TokenFolderError, open_tokens, tokenize_corpus
from hybridpar.data import tokenize as tokenize_module


def fails(tmp_path: Path, inputs, match: str, error=CorpusError, **options) -> None:
    """Tokenizing `inputs` raises `error` matching `match`, and leaves no output at all."""
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(error, match=match):
        tokenize_corpus(inputs, tmp_path / "out", **options)
    assert sorted(p.name for p in tmp_path.iterdir()) == before


# the corpus ------------------------------------------------------------------------------------

def test_a_missing_input_is_named(tmp_path):
    fails(tmp_path, [tmp_path / "nope.txt"], r"nope.txt: no such file, folder or glob match")
    fails(tmp_path, [str(tmp_path / "*.jsonl")], r"\*.jsonl: the glob matches no file")
    fails(tmp_path, [], r"no inputs")


def test_an_empty_corpus_is_an_error(tmp_path):
    (tmp_path / "empty.txt").write_bytes(b"")
    fails(tmp_path, [tmp_path / "empty.txt"], r"the corpus is empty: 1 file\(s\) of 0 bytes")
    (tmp_path / "blank.jsonl").write_text("\n\n")
    (tmp_path / "nothing.txt").write_text("\n\n\n\n")
    fails(tmp_path, [tmp_path / "blank.jsonl", tmp_path / "nothing.txt"],
          r"the corpus has no documents: 2 file\(s\) read, 3 empty", separator="\n\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "notes.md").write_text("text")
    fails(tmp_path, [tmp_path / "sub"], r"sub: the folder holds no corpus file .*--format")
    fails(tmp_path, [tmp_path / "sub" / "notes.md"], r"notes.md: cannot tell its format")


def test_a_jsonl_line_without_the_field_names_file_and_line(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl")
    with open(path, "a") as f:
        f.write('{"body": "x", "id": 9}\n')
    fails(tmp_path, [path], rf"a.jsonl:{len(DOCS) + 1}: no field 'text' \(its fields: 'body', "
          r"'id'\); name the text field with --field")
    path.write_text('{"text": "ok"}\n{"text": 3}\n')
    fails(tmp_path, [path], r"a.jsonl:2: field 'text' is a int, not text")
    path.write_text('{"text": "ok"}\n\n{"text": \n')
    fails(tmp_path, [path], r"a.jsonl:3: not a JSON object")


def test_a_parquet_file_without_the_column_is_named(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["a", None]}), tmp_path / "a.parquet")
    fails(tmp_path, [tmp_path / "a.parquet"], r"a.parquet: no column 'text' \(its columns: "
          r"'body'\); name the text column with --field")
    fails(tmp_path, [tmp_path / "a.parquet"], r"a.parquet: row 2: column 'body' is null",
          field="body")
    (tmp_path / "b.parquet").write_text("not parquet")
    fails(tmp_path, [tmp_path / "b.parquet"], r"b.parquet: not a readable parquet file")


def test_a_damaged_compressed_file_is_named(tmp_path):
    (tmp_path / "a.txt.gz").write_bytes(gzip.compress(b"hello")[:-6])
    fails(tmp_path, [tmp_path / "a.txt.gz"], r"a.txt.gz: the gzip stream is damaged")
    (tmp_path / "a.txt.gz").unlink()
    (tmp_path / "b.jsonl.zst").write_bytes(b"not zstd at all" * 4)
    fails(tmp_path, [tmp_path / "b.jsonl.zst"], r"b.jsonl.zst: the zstd stream is damaged")


def test_undecodable_text_stops_names_the_line_or_is_counted(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"good\n\nline one\nbad \xff here\n\nfine")
    fails(tmp_path, [tmp_path / "a.txt"], r"a.txt:4: not UTF-8 text \(byte 0xff .*--errors "
          r"replace .*--errors skip", separator="\n\n")
    replaced = tokenize_corpus([tmp_path / "a.txt"], tmp_path / "r", separator="\n\n",
                               errors="replace", val_fraction=0)
    skipped = tokenize_corpus([tmp_path / "a.txt"], tmp_path / "s", separator="\n\n",
                              errors="skip", val_fraction=0)
    assert replaced.meta["errors"] | {"files": {}} == {
        "policy": "replace", "replaced_documents": 1, "skipped_documents": 0, "files": {}}
    assert skipped.meta["errors"]["skipped_documents"] == 1
    assert list(skipped.meta["errors"]["files"].values()) == [1]
    text = open_tokens(tmp_path / "r").decode(open_tokens(tmp_path / "r").splits["train"][0]
                                              .tokens)
    assert text == "good\0line one\nbad \ufffd here\0fine\0"
    assert skipped.meta["documents"] == 2


def test_a_jsonl_lone_surrogate_is_undecodable_text(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "ok"}\n{"text": "bad \\ud800 x"}\n')
    fails(tmp_path, [tmp_path / "a.jsonl"], r"a.jsonl:2: the text holds a lone surrogate")
    (tmp_path / "b.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "\xc3("}\n')
    fails(tmp_path, [tmp_path / "b.jsonl"], r"b.jsonl:2: not UTF-8 text")
    done = tokenize_corpus([tmp_path / "a.jsonl", tmp_path / "b.jsonl"], tmp_path / "out",
                           errors="replace", val_fraction=0)
    assert done.meta["errors"]["replaced_documents"] == 2


# options and tokenizers ------------------------------------------------------------------------

def test_bad_options_and_tokenizers_are_named(tmp_path):
    write_txt(tmp_path / "c", DOCS[:1])
    inputs = [tmp_path / "c"]
    fails(tmp_path, inputs, r"tokenizer '.*missing.json': no such file", ValueError,
          tokenizer=tmp_path / "missing.json")
    (tmp_path / "junk.json").write_text("{}")
    fails(tmp_path, inputs, r"junk.json' is not a tokenizers JSON file", ValueError,
          tokenizer=tmp_path / "junk.json")
    bpe = bpe_tokenizer(tmp_path / "plain.json", specials=("<pad>",))
    fails(tmp_path, inputs, r"names no end-of-document token; pass --eos TOKEN \(its special "
          r"tokens: <pad>\)", ValueError, tokenizer=bpe)
    fails(tmp_path, inputs, r"--eos '<eos>' is neither a token .* its special ones: <pad>",
          ValueError, tokenizer=bpe, eos="<eos>")
    fails(tmp_path, inputs, r"--eos 'ab': the bytes tokenizer's end of document is one byte",
          ValueError, eos="ab")
    fails(tmp_path, inputs, r"--eos 300 is not a byte", ValueError, eos="300")
    fails(tmp_path, inputs, r"unknown errors policy 'ignore'", errors="ignore")
    fails(tmp_path, inputs, r"the separator is empty", separator="")
    fails(tmp_path, inputs, r"val_fraction must be in \[0, 1\)", ValueError, val_fraction=1.0)


def _die(batch):
    os._exit(3)


def test_a_worker_that_dies_is_an_error_not_a_hang(tmp_path, monkeypatch):
    write_jsonl(tmp_path / "a.jsonl", [f"document {i}" for i in range(40)])
    monkeypatch.setattr(tokenize_module, "_encode", _die)      # the forked workers see it
    fails(tmp_path, [tmp_path / "a.jsonl"], r"a tokenize worker process died .* nothing was "
          r"written", ChildProcessError, workers=2, batch_bytes=20)


def test_an_out_that_is_not_a_token_folder_is_left_alone(tmp_path):
    write_txt(tmp_path / "c", DOCS[:1])
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "mine.txt").write_text("keep me")
    for overwrite in (False, True):
        with pytest.raises(CorpusError, match=r"out is a folder of other files, not a token"):
            tokenize_corpus([tmp_path / "c"], tmp_path / "out", overwrite=overwrite)
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["mine.txt"]


# open_tokens -----------------------------------------------------------------------------------

@pytest.fixture
def folder(tmp_path) -> Path:
    write_jsonl(tmp_path / "a.jsonl", [f"document {i}" for i in range(20)])
    tokenize_corpus([tmp_path / "a.jsonl"], tmp_path / "out", val_fraction=0.2,
                    shard_tokens=60)
    return tmp_path / "out"


def edit_meta(folder: Path, change) -> None:
    meta = json.loads((folder / "meta.json").read_text())
    change(meta)
    (folder / "meta.json").write_text(json.dumps(meta))


def test_open_tokens_reads_what_tokenize_wrote(folder):
    tokens = open_tokens(folder, verify=True)
    assert tokens.documents("train") + tokens.documents("val") == 20
    assert sum(len(s.tokens) for s in tokens.splits["train"]) == tokens.tokens("train")
    assert len(tokens.splits["train"]) > 1 and tokens.dtype == "uint16"
    assert len(tokens.fingerprint) == 64 and tokens.vocab_size == 256


def test_a_corrupt_meta_json_is_an_error_naming_it(folder):
    with pytest.raises(TokenFolderError, match=r"no such token folder"):
        open_tokens(folder.parent / "nope")
    (folder / "meta.json").write_text('{"format": "hybridpar-tokens", ')
    with pytest.raises(TokenFolderError, match=r"out/meta.json is corrupt: not JSON .*--overwrite"):
        open_tokens(folder)
    (folder / "meta.json").unlink()
    with pytest.raises(TokenFolderError, match=r"has no meta.json: not a finished token folder"):
        open_tokens(folder)


@pytest.mark.parametrize("change, match", [
    (lambda m: m.pop("dtype"), r"corrupt: it has no 'dtype'"),
    (lambda m: m.update(dtype="int8"), r"corrupt: dtype 'int8' is not one of uint16, uint32"),
    (lambda m: m["tokenizer"].update(eos_id="0"), r"corrupt: tokenizer.eos_id is '0'"),
    (lambda m: m["splits"]["val"].update(tokens=1), r"splits.val.tokens = 1 is not the sum"),
    (lambda m: m["splits"]["train"]["shards"][0].update(tokens=0), r"shards\[0\].tokens is 0"),
    (lambda m: m.update(format="other"), r"corrupt: its format is not 'hybridpar-tokens'"),
    (lambda m: m.update(version=99), r"version 99, this hybridpar reads versions 1 and 2"),
])
def test_a_meta_json_with_a_bad_field_is_an_error(folder, change, match):
    edit_meta(folder, change)
    with pytest.raises(TokenFolderError, match=match):
        open_tokens(folder)


def test_a_shard_whose_size_disagrees_with_meta_json_is_an_error(folder):
    shard = folder / "train-00000.bin"
    data = shard.read_bytes()
    shard.write_bytes(data[:-2])
    tokens = len(data) // 2
    with pytest.raises(TokenFolderError, match=rf"train-00000.bin holds {len(data) - 2} bytes, "
                       rf"but meta.json says {tokens} tokens of uint16 \({len(data)} bytes\); "
                       r"the file was truncated or changed"):
        open_tokens(folder)
    shard.write_bytes(data)
    (folder / "val-00000.idx").write_bytes(b"")
    with pytest.raises(TokenFolderError, match=r"val-00000.idx holds 0 bytes"):
        open_tokens(folder)
    (folder / "val-00000.idx").unlink()
    with pytest.raises(TokenFolderError, match=r"val-00000.idx is missing"):
        open_tokens(folder)


def test_verify_finds_changed_tokens_of_the_right_size(folder):
    shard = folder / "train-00000.bin"
    data = np.fromfile(shard, dtype=np.uint16)
    data[3] = 999
    data.tofile(shard)
    open_tokens(folder)                                   # sizes agree: not read
    with pytest.raises(TokenFolderError, match=r"train-00000.bin: its contents do not match"):
        open_tokens(folder, verify=True)
