"""Corpora and conversations as token folders: `hybridpar tokenize` writes them (text, or
conversations rendered with a chat template and a loss mask), `open_tokens` reads them."""

from hybridpar.data.shards import TokenFolder, TokenFolderError, open_tokens
from hybridpar.data.sources import CorpusError
from hybridpar.data.tokenize import Tokenized, tokenize_corpus
from hybridpar.data.tokenizer import TokenizerSpec, load_tokenizer

__all__ = ["CorpusError", "TokenFolder", "TokenFolderError", "Tokenized", "TokenizerSpec",
           "load_tokenizer", "open_tokens", "tokenize_corpus"]
