"""Corpus to token folder: documents read in order, encoded by worker processes, written whole.

    main process                          workers (--workers, forked)
    read documents, file by file  ----->  encode a batch: ids + EOS after each document
    (UTF-8 policy, jsonl / parquet)  ids  (tokenizers' encode_batch_fast, one thread each)
    split train / val, write shards <----
    meta.json last, rename into place

Batches go out in order and come back in order, at most 2 per worker in flight (memory
stays bounded): any number of workers writes the same bytes. Before reading anything, the
request (the inputs' fingerprint, the tokenizer's hash, every option that changes the
tokens) is compared with an existing OUT/meta.json: the same request is a no-op.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import multiprocessing
import os
import sys
import time
from collections.abc import Generator, Iterable, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from hybridpar.data.chat import ChatEncoder, ChatSpec, load_chat
from hybridpar.data.conversations import ChatFields, Conversation, read_conversations
from hybridpar.data.shards import (
    FORMAT,
    MASKED_VERSION,
    SPLITS,
    VERSION,
    ShardWriter,
    TokenFolderError,
    open_tokens,
    write_meta,
)
from hybridpar.data.sources import (
    ERRORS,
    CorpusError,
    Counts,
    Source,
    find_sources,
    fingerprint,
    read_documents,
)
from hybridpar.data.split import ValSplit
from hybridpar.data.tokenizer import Encoder, TokenizerSpec, load_tokenizer
from hybridpar.io.staged import FolderAppeared, staged_folder
from hybridpar.process.lifetime import die_with_parent

__all__ = ["DEFAULT_SHARD_TOKENS", "Tokenized", "default_workers", "tokenize_corpus"]

DEFAULT_SHARD_TOKENS = 100_000_000
_BATCH_BYTES = 1 << 18          # text per batch sent to a worker
_BATCH_DOCS = 4096


class Tokenized(NamedTuple):
    """What `tokenize_corpus` did: the folder, its meta.json, whether it was up to date, and
    notes for the user (a folder replaced, another process's identical folder kept)."""

    folder: Path
    meta: dict[str, Any]
    up_to_date: bool
    seconds: float
    notes: tuple[str, ...] = ()


def default_workers() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:   # not Linux
        return os.cpu_count() or 1


Document = str | Conversation
# what an encoder gives for a batch: ids, lengths, the loss mask (None: text) and the
# documents it dropped (conversations with no counted token)
Encoded = tuple[np.ndarray, np.ndarray, np.ndarray | None, int]


def _size(doc: Document) -> int:
    return len(doc) if isinstance(doc, str) else sum(len(m["content"]) for m in doc.messages)


def _batches(documents: Iterable[Document], *, batch_bytes: int) -> Iterator[list[Document]]:
    """Documents grouped into lists of about `batch_bytes` characters."""
    batch: list[Document] = []
    size = 0
    for doc in documents:
        batch.append(doc)
        size += _size(doc)
        if size >= batch_bytes or len(batch) >= _BATCH_DOCS:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


class _Encoders:
    """Text (`Encoder`) or conversations (`ChatEncoder`) to `Encoded`."""

    def __init__(self, spec: TokenizerSpec, chat: ChatSpec | None) -> None:
        self.text = Encoder(spec) if chat is None else None
        self.chat = ChatEncoder(spec, chat) if chat is not None else None

    def __call__(self, batch: list[Any]) -> Encoded:
        if self.chat is not None:
            return self.chat.encode(batch)
        assert self.text is not None
        return (*self.text.encode(batch), None, 0)


_ENCODER: _Encoders | None = None


def _init_worker(spec: TokenizerSpec, chat: ChatSpec | None, parent: int) -> None:
    global _ENCODER
    die_with_parent(parent)      # a killed tokenize leaves no idle workers behind
    os.environ["TOKENIZERS_PARALLELISM"] = "false"   # one thread a worker
    _ENCODER = _Encoders(spec, chat)


def _encode(batch: list[Any]) -> Encoded:
    assert _ENCODER is not None
    return _ENCODER(batch)


def _encoded(batches: Iterator[list[Any]], spec: TokenizerSpec, chat: ChatSpec | None,
             workers: int) -> Generator[Encoded, None, None]:
    """Each batch encoded, in order: here, or on `workers` processes."""
    if workers <= 1:
        encoder = _Encoders(spec, chat)
        for batch in batches:
            yield encoder(batch)
        return
    methods = multiprocessing.get_all_start_methods()
    context = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
    # a worker that dies (killed, out of memory) fails its batch with BrokenProcessPool,
    # where multiprocessing.Pool would wait for it forever
    pool = ProcessPoolExecutor(workers, mp_context=context, initializer=_init_worker,
                               initargs=(spec, chat, os.getpid()))
    try:
        pending: collections.deque[Future[Encoded]] = collections.deque()
        for batch in batches:
            pending.append(pool.submit(_encode, batch))
            if len(pending) >= 2 * workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    except BrokenProcessPool:
        raise ChildProcessError(f"a tokenize worker process died (killed, or out of memory?); "
                                f"nothing was written: run again, with fewer than {workers} "
                                "--workers if memory is short") from None
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _request(sources: Sequence[Source], spec: TokenizerSpec, options: dict[str, Any],
             chat: dict[str, Any] | None) -> dict[str, Any]:
    """Everything that decides the tokens: the version, the sources' and tokenizer's hashes,
    the EOS, the chat template and mask rule, and the options."""
    bos = {"bos": list(spec.bos)} if spec.bos else {}   # absent: the requests made before it
    talk = {"chat": chat} if chat is not None else {}
    return {"version": VERSION if chat is None else MASKED_VERSION,
            "sources": fingerprint(sources)["sha256"], "tokenizer": spec.sha256,
            "eos_id": spec.eos_id, **bos, **talk, **options}


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


def _up_to_date(out: Path, request: dict[str, Any], overwrite: bool) -> dict[str, Any] | None:
    """OUT's meta when it holds this request's tokens; None when OUT is to be written."""
    if not out.exists():
        return None
    if not out.is_dir():
        raise CorpusError(f"{out} is a file; give a folder for the tokens")
    if not any(out.iterdir()):
        return None
    if not (out / "meta.json").is_file() and not any(out.glob("*.bin")):
        raise CorpusError(f"{out} is a folder of other files, not a token folder; give a new "
                          "or empty folder for the tokens")
    try:
        folder = open_tokens(out)
    except TokenFolderError as e:
        if overwrite:
            return None
        raise CorpusError(f"{out} exists and is not a complete token folder ({e}); give a new "
                          "folder, or --overwrite to replace it") from None
    if folder.meta["request"] == _digest(request):
        return folder.meta
    if overwrite:
        return None
    before = folder.meta.get("options", {})
    changed = [k for k in request if not isinstance(before, dict) or before.get(k) != request[k]]
    raise CorpusError(f"{out} holds the tokens of other inputs or options (changed: "
                      f"{', '.join(changed) or 'unknown'}); give a new folder, or --overwrite "
                      "to replace it")


def tokenize_corpus(inputs: Sequence[str | os.PathLike[str]], out: str | os.PathLike[str], *,
                    tokenizer: str | os.PathLike[str] = "bytes", eos: str | int | None = None,
                    bos: str = "auto",
                    format: str = "auto", field: str = "text", separator: str | None = None,
                    errors: str = "strict", val_fraction: float = 0.05, seed: int = 0,
                    workers: int | None = None, shard_tokens: int = DEFAULT_SHARD_TOKENS,
                    overwrite: bool = False, progress: bool = False,
                    conversations: ChatFields | None = None,
                    chat_template: str | os.PathLike[str] | None = None,
                    loss_mask: str = "assistant", no_assistant: str = "skip",
                    batch_bytes: int = _BATCH_BYTES) -> Tokenized:
    """Tokenize the documents of `inputs` into the token folder `out` (see `shards`).

    `tokenizer`, `eos` and `bos`: `load_tokenizer`; `format`, `field`, `separator`,
    `errors`: how the files are read (`sources`); `val_fraction`, `seed`: the split
    (`ValSplit`). A no-op when `out` already holds the same request; `overwrite` replaces an
    `out` of another one. With `conversations` (the records' field names), the inputs are
    conversations, rendered with the chat template and stored with a loss mask
    (`chat.load_chat`: `chat_template`, `loss_mask`, `no_assistant`); the template decides
    the BOS.
    Errors in the inputs raise `CorpusError` naming the file and line; `out` is then untouched.
    """
    start = time.perf_counter()
    if errors not in ERRORS:
        raise CorpusError(f"unknown errors policy {errors!r}; choose one of {', '.join(ERRORS)}")
    if workers is not None and workers < 1:
        raise ValueError(f"workers must be at least 1, got {workers}")
    if shard_tokens < 1:
        raise ValueError(f"shard_tokens must be positive, got {shard_tokens}")
    if separator == "":
        raise CorpusError("the separator is empty; give the text between documents, e.g. "
                          "'\\n\\n', or leave it out for a document per file")
    if conversations is not None and bos != "auto":
        raise CorpusError("--bos with conversations: the chat template decides what a "
                          "conversation starts with; leave out --bos")
    split = ValSplit(val_fraction, seed=seed)
    sources = find_sources(inputs, format=format)
    spec = load_tokenizer(tokenizer, eos=eos, bos=bos if conversations is None else "no")
    chat = None if conversations is None else load_chat(
        tokenizer, template=chat_template, mask=loss_mask, no_assistant=no_assistant)
    options = {"format": format, "field": field, "separator": separator, "errors": errors,
               "val_fraction": float(val_fraction), "seed": seed, "shard_tokens": shard_tokens}
    talk = None if chat is None or conversations is None else {
        **chat.record(), "fields": conversations.record()}
    request, prints = _request(sources, spec, options, talk), fingerprint(sources)
    target = Path(out)
    done = _up_to_date(target, request, overwrite)
    if done is not None:
        return Tokenized(target, done, True, time.perf_counter() - start)
    if workers is None:   # a small corpus is not worth starting processes for
        workers = default_workers() if prints["bytes"] > 8 * batch_bytes else 1

    notes: list[str] = []
    counts = Counts()
    documents: Iterator[Document]
    if conversations is None:
        documents = (doc for source in sources for doc in read_documents(
            source, field=field, separator=separator, errors=errors, counts=counts))
    else:
        documents = (c for source in sources for c in read_conversations(
            source, fields=conversations, errors=errors, counts=counts))
    batches = _encoded(_batches(documents, batch_bytes=batch_bytes), spec, chat, workers)
    # another process may fill OUT meanwhile (two tokenize runs into one folder): without
    # --overwrite that is an error (or nothing to do, if it holds these very tokens); with
    # it, OUT is replaced in one step and the output says so
    replaced = f"replaced the folder that was at {target} (--overwrite)"
    try:
        with staged_folder(target, replace=overwrite, replaced=lambda: notes.append(replaced)
                           ) as tmp, contextlib.closing(batches):
            records, dropped = _write(tmp, batches, spec=spec, split=split,
                                      shard_tokens=shard_tokens, masks=chat is not None,
                                      progress=progress, start=start)
            if sum(r["documents"] for r in records.values()) == 0 and dropped:
                raise CorpusError(f"no conversation has an assistant token to learn from "
                                  f"({dropped} read, --loss-mask {loss_mask}); give "
                                  "conversations with assistant turns, or --loss-mask all")
            if sum(r["documents"] for r in records.values()) == 0:
                raise CorpusError(f"the corpus has no documents: {len(sources)} file(s) read, "
                                  f"{counts.empty} empty, {counts.skipped} skipped as not "
                                  "UTF-8" + (f" (--field {field!r})" if format != "txt" else "")
                                  + "; give files that hold text")
            if spec.kind == "tokenizers":
                (tmp / "tokenizer.json").write_text(spec.json, encoding="utf-8")
            meta = _meta(spec, records, request, prints, counts)
            if talk is not None and chat is not None:
                meta["chat"] = {**talk, "template_from": chat.source,
                                "dropped_without_assistant": dropped, "counted":
                                sum(r["counted"] for r in records.values())}
            write_meta(tmp, meta)
    except FolderAppeared:
        theirs = _appeared(target, request)
        note = (f"{target} appeared while tokenizing, written by another process with the "
                "same inputs, tokenizer and options: kept it (the same tokens)")
        return Tokenized(target, theirs, True, time.perf_counter() - start, (note,))
    return Tokenized(target, meta, False, time.perf_counter() - start, tuple(notes))


def _appeared(out: Path, request: dict[str, Any]) -> dict[str, Any]:
    """The meta of an `out` that another process wrote meanwhile, when it holds `request`'s
    tokens; else the error (this run's tokens are discarded, `out` is left alone)."""
    try:
        meta = open_tokens(out, mmap=False).meta
    except TokenFolderError:
        meta = None
    if meta is not None and meta["request"] == _digest(request):
        return meta
    raise CorpusError(f"{out} appeared while tokenizing (another hybridpar tokenize into the "
                      "same folder?) and holds other tokens"
                      + ("" if meta is not None else " or other files")
                      + "; it was left as it is and this run's tokens were discarded: give "
                      "another folder, or --overwrite to replace it") from None


def _write(folder: Path, batches: Iterator[Encoded], *, spec: TokenizerSpec, split: ValSplit,
           shard_tokens: int, masks: bool, progress: bool, start: float
           ) -> tuple[dict[str, dict[str, Any]], int]:
    """Each encoded batch into the shards of its documents' splits; (the splits' records,
    the documents the encoders dropped)."""
    writers = {s: ShardWriter(folder, s, dtype=spec.dtype, shard_tokens=shard_tokens,
                              masks=masks) for s in SPLITS}
    bar: Any = None
    total = dropped = 0
    try:
        for ids, lengths, loss, lost in batches:
            n = len(lengths)
            dropped += lost
            val = split.take(n)                                               # (n,) bool
            if not val.any():
                writers["train"].write(ids, lengths, loss)
            else:
                where = np.repeat(val, lengths)                               # (tokens,)
                for name, rows, docs in (("train", ~where, ~val), ("val", where, val)):
                    writers[name].write(ids[rows], lengths[docs],
                                        None if loss is None else loss[rows])
            total += len(ids)
            if progress and bar is None:   # after the workers' fork: tqdm starts a thread
                from tqdm import tqdm

                bar = tqdm(desc="tokenize", unit=" docs", file=sys.stderr, dynamic_ncols=True)
            if bar is not None:
                bar.update(n)
                rate = total / max(time.perf_counter() - start, 1e-9)
                bar.set_postfix_str(f"{total:,} tokens, {rate:,.0f} tokens/s", refresh=False)
        records = {s: w.close() for s, w in writers.items()}
        for record in records.values() if masks else ():
            record["counted"] = sum(x["counted"] for x in record["shards"])
        return records, dropped
    except BaseException:
        for w in writers.values():
            w.abort()
        raise
    finally:
        if bar is not None:
            bar.close()


def _meta(spec: TokenizerSpec, records: dict[str, dict[str, Any]], request: dict[str, Any],
          prints: dict[str, Any], counts: Counts) -> dict[str, Any]:
    """meta.json of a finished folder (docs/data.md lists the fields)."""
    what = {"tokenizer": spec.sha256, "eos_id": spec.eos_id, "dtype": spec.dtype,
            "shards": {s: [(x["sha256"], x["tokens"], x["documents"])
                           + ((x["mask_sha256"],) if "mask_sha256" in x else ())
                           for x in r["shards"]] for s, r in records.items()}}
    return {
        "format": FORMAT, "version": request["version"],
        "tokenizer": spec.record(), "dtype": spec.dtype,
        "documents": sum(r["documents"] for r in records.values()),
        "tokens": sum(r["tokens"] for r in records.values()),
        "splits": records,
        "split": {"rule": "stratified", "val_fraction": request["val_fraction"],
                  "seed": request["seed"]},
        "errors": {"policy": request["errors"], "replaced_documents": counts.replaced,
                   "skipped_documents": counts.skipped, "files": counts.files},
        "empty_documents_dropped": counts.empty,
        "sources": {**prints, "read": {k: request[k] for k in ("format", "field", "separator")}},
        "shard_tokens": request["shard_tokens"],
        "options": request,
        "request": _digest(request),
        "fingerprint": _digest(what),
    }
