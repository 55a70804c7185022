"""``data.pack``: every config that cannot pack documents is one error before any worker
starts, naming the key and what to do; `pack_documents` refuses models it cannot carry."""

from __future__ import annotations

import pytest
import torch
from config_errors import error_of
from torch import nn

from hybridpar.data import tokenize_corpus
from hybridpar.models import gpt
from hybridpar.models.packing import pack_documents
from hybridpar.train import load_config

GPT = """\
[model]
name = "gpt"
n_layer = 2
n_head = 4
n_embd = 16
block_size = 8

[data]
source = "tokens"
path = "{folder}"
pack = "documents"
"""


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("pack_config")
    (root / "corpus.txt").write_text("\n\n".join(["one document", "and another one", "x"]))
    tokenize_corpus([str(root / "corpus.txt")], root / "tokens", tokenizer="bytes",
                    format="txt", separator="\n\n", val_fraction=0.0, workers=1)
    return root / "tokens"


@pytest.fixture
def packed(tmp_path, folder):
    path = tmp_path / "packed.toml"
    path.write_text(GPT.format(folder=folder))
    return path


def test_a_gpt_on_a_token_folder_packs_documents(packed):
    assert load_config(packed).data.pack == "documents"
    assert load_config(packed, ["data.pack=none"]).data.pack == "none"


def test_an_unknown_pack_is_an_error_naming_the_choices(packed):
    message = error_of(packed, "data.pack=docs")
    assert "data.pack must be one of 'none', 'documents', 'pad', got 'docs'" in message
    assert "(from --set data.pack=docs)" in message


@pytest.mark.parametrize("source", ["synthetic", "corpus"])
def test_packing_needs_a_token_folder(packed, source):
    message = error_of(packed, f"data.source={source}")
    assert f"data.pack = 'documents' packs the documents of a token folder, but data.source " \
           f"= '{source}' has no document boundaries: set data.source = 'tokens'" in message
    assert f"(from --set data.source={source})" in message


def test_a_model_whose_layers_take_no_positions_is_an_error(packed, tmp_path):
    path = tmp_path / "mlp.toml"
    path.write_text(packed.read_text().replace('name = "gpt"\nn_layer = 2\nn_head = 4\n'
                                               'n_embd = 16\nblock_size = 8\n', 'name = "mlp"\n'))
    message = error_of(path)
    assert "data.pack = 'documents' needs a model whose layers carry document positions " \
           "(gpt, hf:<a rotary decoder: llama, mistral, qwen2, qwen3, gemma2, phi3, ...>); " \
           "model 'mlp' is not one" in message
    assert "set data.pack = 'none'" in message


def test_gpt2_is_an_error_naming_its_learned_positions(packed, tmp_path):
    pytest.importorskip("transformers")
    path = tmp_path / "gpt2.toml"
    path.write_text(packed.read_text().replace('name = "gpt"', 'name = "hf:gpt2"')
                    .replace("block_size = 8", "").replace("[data]", "[data]\nseq_len = 8"))
    message = error_of(path)
    assert "model 'hf:gpt2' is not one (its learned positions (TokenPositionEmbedding) take " \
           "no document positions): set data.pack = 'none'" in message


def test_a_tp_plan_that_shards_layer_0_is_an_error(packed):
    message = error_of(packed, "parallel.tp=2", 'parallel.tp_plan={"0" = "vocab"}')
    assert "parallel.tp_plan['0'] shards layer 0, which passes the document positions" in message
    assert "leave layer 0 out of the plan or mark it 'replicate'" in message
    load_config(packed, ["parallel.tp=2", 'parallel.tp_plan={"0" = "replicate"}'])


def test_pack_documents_refuses_a_model_without_attention_blocks():
    with pytest.raises(ValueError, match=r"pack_documents takes a gpt or a Hugging Face rotary "
                                         r"model .* got layers Linear, ReLU"):
        pack_documents(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))
    torch.manual_seed(0)
    model = gpt(n_layer=2, n_head=2, n_embd=8, block_size=4)
    assert pack_documents(pack_documents(model)) is model      # twice: the same
    assert [getattr(m, "keep_positions", None) for m in model] == [None, True, False, None,
                                                                   None]
