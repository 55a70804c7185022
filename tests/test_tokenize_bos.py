"""`hybridpar tokenize --bos` (issue 39, point 3): what each document starts with.

The story: a Llama-style tokenizer adds ``<s>`` at inference (the exported model's
`generate` output starts with it) while training never saw it, as documents were encoded
without special tokens. Now the default follows the tokenizer's own post-processor, ``--bos``
always puts a BOS, ``--bos no`` never, and the output says which. Also: meta.json's
``tokenizer.sha256`` is ``sha256sum OUT/tokenizer.json``.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from test_tokenize import DOCS, bpe_tokenizer, documents, write_jsonl

from hybridpar.cli import main
from hybridpar.data import open_tokens, tokenize_corpus


def llama_style(path: Path) -> Path:
    """A BPE whose post-processor puts ``<s>`` before a text, as Llama's does."""
    from tokenizers import Tokenizer, processors

    bpe_tokenizer(path, specials=("<s>", "</s>"))
    tok = Tokenizer.from_file(str(path))
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    tok.save(str(path))
    return path


def starts(folder: Path) -> list[int]:
    """The first id of every train document (through the .idx ends)."""
    shard = open_tokens(folder).splits["train"][0]
    return [int(shard.tokens[0])] + [int(shard.tokens[int(e)]) for e in shard.ends[:-1]]


def test_the_default_follows_the_tokenizers_post_processor(tmp_path):
    tok = llama_style(tmp_path / "tokenizer.json")
    write_jsonl(tmp_path / "a.jsonl")
    done = tokenize_corpus([tmp_path / "a.jsonl"], tmp_path / "out", tokenizer=tok,
                           val_fraction=0)
    bos = done.meta["tokenizer"]["bos_ids"]
    assert bos == [0] and done.meta["options"]["bos"] == [0]          # <s> is id 0
    assert starts(tmp_path / "out") == [0] * len(DOCS)
    assert [d.removeprefix("<s>") for d in documents(tmp_path / "out")] == DOCS
    plain = tokenize_corpus([tmp_path / "a.jsonl"], tmp_path / "no", tokenizer=tok,
                            val_fraction=0, bos="no")
    assert plain.meta["tokenizer"]["bos_ids"] == [] and "bos" not in plain.meta["options"]
    assert plain.meta["tokens"] == done.meta["tokens"] - len(DOCS)   # one BOS a document
    assert documents(tmp_path / "no") == DOCS


def test_without_a_post_processor_nothing_changes_unless_asked(tmp_path):
    tok = bpe_tokenizer(tmp_path / "tokenizer.json", specials=("<s>", "</s>"))
    write_jsonl(tmp_path / "a.jsonl")
    auto = tokenize_corpus([tmp_path / "a.jsonl"], tmp_path / "auto", tokenizer=tok)
    assert auto.meta["tokenizer"]["bos_ids"] == [] and "bos" not in auto.meta["options"]
    # the same request as a folder written before --bos existed: no re-tokenizing needed
    assert tokenize_corpus([tmp_path / "a.jsonl"], tmp_path / "auto", tokenizer=tok,
                           bos="no").up_to_date
    always = tokenize_corpus([tmp_path / "a.jsonl"], tmp_path / "yes", tokenizer=tok,
                             bos="yes", val_fraction=0)
    assert starts(tmp_path / "yes") == [0] * len(DOCS)                # <s> by its name
    assert always.meta["tokenizer"]["bos_rule"] == "yes"


def test_bos_where_there_is_none_is_an_error(tmp_path):
    write_jsonl(tmp_path / "a.jsonl")
    with pytest.raises(ValueError, match="the bytes tokenizer has no start-of-document token"):
        tokenize_corpus([tmp_path / "a.jsonl"], tmp_path / "out", bos="yes")
    tok = bpe_tokenizer(tmp_path / "tokenizer.json")                 # <|endoftext|> only
    with pytest.raises(ValueError, match=r"names no start-of-document token .* its special "
                       r"tokens: <\|endoftext\|>\); leave out --bos"):
        tokenize_corpus([tmp_path / "a.jsonl"], tmp_path / "out", tokenizer=tok, bos="yes")
    assert not (tmp_path / "out").exists()


def test_the_command_says_what_each_document_starts_with(tmp_path, capsys):
    tok = llama_style(tmp_path / "tokenizer.json")
    write_jsonl(tmp_path / "a.jsonl")
    base = ["tokenize", str(tmp_path / "a.jsonl"), "--tokenizer", str(tok), "--quiet"]
    assert main([*base, "-o", str(tmp_path / "a")]) == 0
    assert "BOS: ids [0] before each document (the tokenizer's post-processor adds it; " \
        "--bos no for none)" in capsys.readouterr().out
    assert main([*base, "-o", str(tmp_path / "b"), "--bos", "no"]) == 0
    assert "BOS: none before each document (--bos no)" in capsys.readouterr().out
    assert main(["tokenize", str(tmp_path / "a.jsonl"), "-o", str(tmp_path / "c"), "--quiet"]
                ) == 0
    assert "BOS: none before each document (the tokenizer's post-processor adds none)" \
        in capsys.readouterr().out


def test_meta_json_tokenizer_sha256_is_sha256sum_of_the_folders_tokenizer_json(tmp_path):
    tok = bpe_tokenizer(tmp_path / "tokenizer.json")
    pretty = json.dumps(json.loads(tok.read_text()), indent=4)       # the same tokenizer,
    (tmp_path / "pretty.json").write_text(pretty)                    # other bytes
    write_jsonl(tmp_path / "a.jsonl")
    for name in ("tokenizer.json", "pretty.json"):
        done = tokenize_corpus([tmp_path / "a.jsonl"], tmp_path / f"out-{name}",
                               tokenizer=tmp_path / name)
        copy = (tmp_path / f"out-{name}" / "tokenizer.json").read_bytes()
        assert done.meta["tokenizer"]["sha256"] == hashlib.sha256(copy).hexdigest()
    # the hash is of the tokenizer as `tokenizers` writes it, not of the file given
    assert hashlib.sha256(pretty.encode()).hexdigest() != done.meta["tokenizer"]["sha256"]
    first = json.loads((tmp_path / "out-tokenizer.json" / "meta.json").read_text())
    assert first["tokenizer"]["sha256"] == done.meta["tokenizer"]["sha256"]
