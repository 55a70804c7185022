"""Conversation inputs: records of `messages`, or prompt / completion pairs, checked.

    record (a jsonl line, a parquet or Arrow row)       conversation
    {"messages": [{"role": "user", "content": "Hi"},    as it is (roles: system, user,
                  {"role": "assistant", ...}]}          assistant, tool)
    {"prompt": "2+2?", "completion": "4"}               [user: prompt, assistant: completion]

The field names are options (`ChatFields`). A record that is neither, a message without a
role or a text content, an unknown role: `CorpusError` naming the file and line (or row).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

from hybridpar.data.sources import (
    CorpusError,
    Counts,
    Source,
    json_lines,
    open_stream,
    text_decoder,
)
from hybridpar.data.tables import TableError, column_names, read_batches

__all__ = ["ROLES", "ChatFields", "Conversation", "read_conversations"]

ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class ChatFields:
    """Where a record keeps its conversation: a list of messages, or a prompt and a
    completion (`hybridpar tokenize --messages-field / --prompt-field / --completion-field`)."""

    messages: str = "messages"
    prompt: str = "prompt"
    completion: str = "completion"

    def record(self) -> dict[str, str]:
        return asdict(self)


class Conversation(NamedTuple):
    """One conversation and where it was read (``file:line``, or ``file: row N``)."""

    where: str
    messages: list[dict[str, Any]]


_FIX = "name the fields with --messages-field, or --prompt-field and --completion-field"


def _message(value: Any, where: str, k: int) -> dict[str, Any]:
    at = f"{where}: message {k}"
    if not isinstance(value, dict):
        raise CorpusError(f"{at} is a {type(value).__name__}, not an object with a role and a "
                          "content")
    message = {key: v for key, v in value.items() if v is not None}  # parquet fills in nulls
    role = message.get("role")
    if role not in ROLES:
        what = "has no role" if role is None else f"has the role {role!r}"
        raise CorpusError(f"{at} {what}; a message's role is one of {', '.join(ROLES)}")
    if not isinstance(message.get("content"), str):
        got = message.get("content")
        what = "no content" if got is None else f"a content of {type(got).__name__}"
        raise CorpusError(f"{at} ({role}) has {what}; give each message its text as "
                          "\"content\"")
    return message


def conversation(record: Any, where: str, fields: ChatFields) -> list[dict[str, Any]]:
    """The messages of one record (see the module's table)."""
    if not isinstance(record, dict):
        raise CorpusError(f"{where}: a {type(record).__name__}, not an object with "
                          f"{fields.messages!r} or {fields.prompt!r} and {fields.completion!r}")
    messages = record.get(fields.messages)
    if messages is not None:
        if not isinstance(messages, list) or not messages:
            what = "empty" if isinstance(messages, list) else f"a {type(messages).__name__}"
            raise CorpusError(f"{where}: field {fields.messages!r} is {what}, not a list of "
                              "messages")
        return [_message(m, where, k) for k, m in enumerate(messages)]
    prompt, completion = record.get(fields.prompt), record.get(fields.completion)
    if prompt is None or completion is None:
        keys = ", ".join(repr(k) for k in list(record)[:8]) or "none"
        raise CorpusError(f"{where}: no field {fields.messages!r}, nor {fields.prompt!r} and "
                          f"{fields.completion!r} (its fields: {keys}); {_FIX}")
    for name, value in ((fields.prompt, prompt), (fields.completion, completion)):
        if not isinstance(value, str):
            raise CorpusError(f"{where}: field {name!r} is a {type(value).__name__}, not text")
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]


def _table_records(source: Source, fields: ChatFields) -> Iterator[tuple[str, Any]]:
    """(where, record) of each row: the messages column when the file has one, else the pair."""
    names = column_names(source.path, source.format)
    columns = [fields.messages] if fields.messages in names else [fields.prompt,
                                                                 fields.completion]
    row = 0
    for batch in read_batches(source.path, source.format, columns, hint=_FIX):
        for record in batch.to_pylist():
            row += 1
            yield f"{source.path}: row {row}", record


def read_conversations(source: Source, *, fields: ChatFields = ChatFields(),
                       errors: str = "strict", counts: Counts | None = None
                       ) -> Iterator[Conversation]:
    """The conversations of one jsonl, parquet or Arrow file, in order."""
    if source.format == "txt":
        raise CorpusError(f"{source.path}: a text file holds no conversations; give jsonl, "
                          "parquet or Arrow records (docs/data.md#conversations)")
    counts = Counts() if counts is None else counts
    try:
        if source.format == "jsonl":
            decode = text_decoder(source, errors, counts)
            with open_stream(source) as stream:
                for where, obj, _line in json_lines(source, stream, decode):
                    yield Conversation(where, conversation(obj, where, fields))
            return
        for where, record in _table_records(source, fields):
            yield Conversation(where, conversation(record, where, fields))
    except TableError as e:
        raise CorpusError(str(e)) from None
