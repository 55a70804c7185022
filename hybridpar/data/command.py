"""`hybridpar tokenize`: its options, the tokenizer a run config names, what it prints."""

from __future__ import annotations

import argparse
import codecs
import tomllib
from pathlib import Path
from typing import Any

__all__ = ["add_parser", "config_tokenizer", "run"]


def add_parser(commands: Any) -> None:
    """Add the `tokenize` command to the `hybridpar` subparsers."""
    from hybridpar.data.chat import MASKS, NO_ASSISTANT
    from hybridpar.data.sources import ERRORS, FORMATS
    from hybridpar.data.tokenize import DEFAULT_SHARD_TOKENS
    from hybridpar.data.tokenizer import BOS_RULES

    p = commands.add_parser(
        "tokenize", help="tokenize a corpus into a folder of token shards",
        description="Tokenize text files, jsonl, parquet (also .gz / .zst, folders and globs) "
        "into a folder of uint16 / uint32 token shards and meta.json, an EOS after each "
        "document (a BOS before it as --bos says), split into train and val by documents. "
        "Written whole or not at all; "
        "running it again on the same inputs and options does nothing. Formats: "
        "docs/data.md.")
    p.add_argument("inputs", nargs="+", metavar="INPUT",
                   help="files, folders (their .txt .jsonl .parquet files, any of them .gz / "
                   ".zst) or quoted globs such as 'data/**/*.jsonl'")
    p.add_argument("-o", "--out", required=True, help="the token folder to write")
    p.add_argument("--tokenizer", default=None,
                   help="'bytes' (ids 0-255, the default), a tokenizer.json, or a Hugging "
                   "Face model folder; default: --config's model.pretrained, else bytes")
    p.add_argument("--config", default=None, metavar="CONFIG",
                   help="a run config: its model.pretrained is the tokenizer, and its "
                   "vocabulary must hold the tokenizer's ids")
    p.add_argument("--eos", default=None, metavar="TOKEN",
                   help="the end-of-document token: its id (digits) or its text (escapes "
                   "such as \\n work); default: the tokenizer's own EOS, byte 0 for bytes")
    p.add_argument("--bos", nargs="?", const="yes", default="auto", choices=BOS_RULES,
                   help="the start-of-document token before each document: auto (the "
                   "default) as the tokenizer's post-processor adds it (Llama's <s>; none for "
                   "GPT-2 or bytes), --bos: always (that, else the tokenizer's BOS token by "
                   "name), --bos no: never; the output says which")
    p.add_argument("--format", choices=("auto", *FORMATS), default="auto",
                   help="how to read the inputs (default auto: from each name's suffix)")
    p.add_argument("--field", default="text",
                   help="the text field of a jsonl line, the text column of parquet "
                   "(default text)")
    p.add_argument("--separator", default=None, metavar="SEP",
                   help="split .txt files into documents at SEP (escapes: '\\n\\n'); "
                   "default: a document per file")
    p.add_argument("--errors", choices=ERRORS, default="strict",
                   help="text that is not UTF-8: stop naming the file and line (strict, "
                   "the default), U+FFFD for bad bytes (replace), drop the document (skip); "
                   "meta.json counts them")
    p.add_argument("--val-fraction", type=float, default=0.05, metavar="F",
                   help="the share of documents held out for validation (default 0.05)")
    p.add_argument("--seed", type=int, default=0,
                   help="draws the validation documents (default 0)")
    p.add_argument("--workers", type=int, default=None, metavar="N",
                   help="encoding processes (default: the cores, 1 for a small corpus)")
    p.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS, metavar="N",
                   help=f"start a new shard file past N tokens (default {DEFAULT_SHARD_TOKENS:,})")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an --out folder that holds other tokens")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    chat = p.add_argument_group(
        "conversations", "records of messages (or prompt / completion pairs) rendered with "
        "the model's chat template, stored with a loss mask (docs/data.md#conversations)")
    chat.add_argument("--chat", action="store_true",
                      help="the inputs are conversations (jsonl, parquet, Arrow)")
    chat.add_argument("--chat-template", default=None, metavar="FILE",
                      help="a Jinja chat template; default: the tokenizer folder's own")
    chat.add_argument("--loss-mask", choices=MASKS, default="assistant",
                      help="the tokens the loss counts: every assistant turn (the default), "
                      "the last one, or all tokens")
    chat.add_argument("--no-assistant", choices=NO_ASSISTANT, default="skip",
                      help="a conversation with no counted token: skip it, counted (the "
                      "default), or stop with an error")
    chat.add_argument("--messages-field", default="messages", metavar="NAME",
                      help="the field of a record's list of {role, content} (default messages)")
    chat.add_argument("--prompt-field", default="prompt", metavar="NAME",
                      help="without a messages field: the user's text (default prompt)")
    chat.add_argument("--completion-field", default="completion", metavar="NAME",
                      help="and the assistant's (default completion)")


def _unescape(text: str | None) -> str | None:
    """Backslash escapes of the command line (``\\n``, ``\\t``, ``\\x00``) as characters."""
    if text is None or "\\" not in text:
        return text
    return codecs.decode(text.encode("latin-1", "backslashreplace"), "unicode_escape")


def config_tokenizer(config: str) -> tuple[str | None, int | None]:
    """(model.pretrained, the model's vocabulary size) of a run config; None where unset."""
    path = Path(config)
    if not path.is_file():
        raise ValueError(f"--config {config}: no such config file")
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{config}: invalid TOML: {e}") from None
    model = raw.get("model", {})
    pretrained = model.get("pretrained") if isinstance(model, dict) else None
    vocab = model.get("vocab_size") if isinstance(model, dict) else None
    if isinstance(pretrained, str) and vocab is None:
        hf = Path(pretrained) / "config.json"
        if hf.is_file():
            import json

            vocab = json.loads(hf.read_text(encoding="utf-8")).get("vocab_size")
    return (pretrained if isinstance(pretrained, str) else None,
            vocab if isinstance(vocab, int) else None)


def run(args: argparse.Namespace) -> int:
    """Tokenize as `args` say; print what was written, or that it was up to date."""
    from hybridpar.data.conversations import ChatFields
    from hybridpar.data.match import pretrained_mismatch
    from hybridpar.data.tokenize import tokenize_corpus
    from hybridpar.data.tokenizer import bos_note, load_tokenizer

    tokenizer, vocab, pretrained = args.tokenizer, None, None
    if args.config is not None:
        pretrained, vocab = config_tokenizer(args.config)
        if tokenizer is None:
            if pretrained is None:
                raise ValueError(f"--config {args.config} has no model.pretrained to take the "
                                 "tokenizer from; give --tokenizer")
            tokenizer = pretrained
    tokenizer = tokenizer or "bytes"
    eos = _unescape(args.eos)
    if vocab is not None or pretrained is not None:
        spec = load_tokenizer(tokenizer, eos=eos, bos=args.bos if not args.chat else "no")
        if vocab is not None and spec.vocab_size > vocab:
            raise ValueError(f"tokenizer {tokenizer!r} has {spec.vocab_size} ids, but the "
                             f"model of {args.config} has a vocabulary of {vocab}; use the "
                             "model's own tokenizer, or a model with a larger vocab_size")
        why = pretrained_mismatch(spec, pretrained) if pretrained is not None else None
        if why is not None:
            raise ValueError(f"--config {args.config}: {why}; leave out --tokenizer to use the "
                             "model's own")
    done = tokenize_corpus(args.inputs, args.out, tokenizer=tokenizer, eos=eos, bos=args.bos,
                           format=args.format, field=args.field,
                           separator=_unescape(args.separator), errors=args.errors,
                           val_fraction=args.val_fraction, seed=args.seed,
                           workers=args.workers, shard_tokens=args.shard_tokens,
                           overwrite=args.overwrite, progress=not args.quiet,
                           conversations=ChatFields(args.messages_field, args.prompt_field,
                                                    args.completion_field) if args.chat else None,
                           chat_template=args.chat_template, loss_mask=args.loss_mask,
                           no_assistant=args.no_assistant)
    meta = done.meta
    for note in done.notes:   # a folder replaced, or one another process wrote meanwhile
        print(note)
    if done.up_to_date:
        print(f"{done.folder} is up to date (the same inputs, tokenizer and options: "
              f"{meta['documents']:,} documents, {meta['tokens']:,} tokens); nothing to do")
        return 0
    train, val = meta["splits"]["train"], meta["splits"]["val"]
    print(f"wrote {done.folder}: {meta['documents']:,} documents, {meta['tokens']:,} "
          f"{meta['dtype']} tokens (train {train['tokens']:,} in {len(train['shards'])} "
          f"shard(s), val {val['tokens']:,} in {len(val['shards'])}), EOS id "
          f"{meta['tokenizer']['eos_id']}, {meta['tokens'] / max(done.seconds, 1e-9):,.0f} "
          "tokens/s")
    chat = meta.get("chat")
    if chat is None:
        print(bos_note(meta["tokenizer"]))
    else:
        print(f"conversations: the loss counts {chat['counted']:,} of the {meta['tokens']:,} "
              f"tokens (--loss-mask {chat['mask']}; template: {chat['template_from']})"
              + (f"; {chat['dropped_without_assistant']:,} conversation(s) without an "
                 "assistant token skipped" if chat["dropped_without_assistant"] else ""))
    errors = meta["errors"]
    if errors["replaced_documents"] or errors["skipped_documents"]:
        print(f"not UTF-8: {errors['replaced_documents']} document(s) with U+FFFD, "
              f"{errors['skipped_documents']} skipped (--errors {errors['policy']})")
    if args.val_fraction > 0 and val["documents"] == 0:
        print(f"note: no validation documents ({meta['documents']} in all, --val-fraction "
              f"{args.val_fraction}); give more documents or a larger fraction")
    return 0
