"""Corpus inputs: which files, how to open them (gzip, zstd), and the documents they hold.

    input                     documents
    a.txt                     the whole file is one document, or one per `separator` part
    a.jsonl                   one per line: the line's `field` (a JSON string)
    a.parquet  a.arrow        one per row: the column `field` (arrow: `datasets`' save_to_disk)
    a.txt.gz  a.jsonl.zst     the same, decompressed on the fly (zstd: the `data` extra)
    dir/                      every file of a known suffix under it, sorted by path
    "dir/**/*.jsonl"          every file the glob matches (quote it), sorted by path

Text is UTF-8; a byte sequence that is not is handled by the `errors` policy: ``strict``
stops with the file and line, ``replace`` puts U+FFFD in place of bad bytes, ``skip`` drops
the document (both counted in `Counts`). Empty documents are dropped.
"""

from __future__ import annotations

import contextlib
import glob
import gzip
import hashlib
import io
import json
import os
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from hybridpar.data.tables import TableError, read_batches

__all__ = ["ERRORS", "FORMATS", "CorpusError", "Counts", "Source", "find_sources", "fingerprint",
           "json_lines", "open_stream", "read_documents", "text_decoder"]

FORMATS = ("txt", "jsonl", "parquet", "arrow")
_TABLES = ("parquet", "arrow")      # columnar: read by `tables`
ERRORS = ("strict", "replace", "skip")
_SUFFIXES = {".txt": "txt", ".text": "txt", ".jsonl": "jsonl", ".ndjson": "jsonl",
             ".parquet": "parquet", ".arrow": "arrow"}
_COMPRESSIONS = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd"}
_CHUNK = 1 << 20
_NL = b"\n"


class CorpusError(ValueError):
    """The corpus cannot be read as given; the message names the file (and line) and the fix."""


class Source(NamedTuple):
    """One input file: where, how to read it, and what identifies its contents."""

    path: Path          # absolute
    format: str         # txt | jsonl | parquet
    compression: str    # "" | gzip | zstd
    size: int           # bytes on disk
    mtime_ns: int


@dataclass
class Counts:
    """Documents the `errors` policy changed: U+FFFD put in (replace) or dropped (skip)."""

    replaced: int = 0
    skipped: int = 0
    empty: int = 0      # empty documents dropped (not errors)
    files: dict[str, int] = field(default_factory=dict)   # path -> documents changed there


def _kind(path: Path, fmt: str) -> tuple[str, str] | None:
    """(format, compression) from the suffixes, `fmt` overriding the format; None: unknown."""
    suffixes = [s.lower() for s in path.suffixes]
    compression = _COMPRESSIONS.get(suffixes[-1], "") if suffixes else ""
    if compression:
        suffixes = suffixes[:-1]
    if fmt != "auto":
        return fmt, compression
    found = _SUFFIXES.get(suffixes[-1]) if suffixes else None
    return (found, compression) if found else None


def _source(path: Path, kind: tuple[str, str]) -> Source:
    stat = path.stat()
    if kind[0] in _TABLES and kind[1]:
        raise CorpusError(f"{path}: a compressed {kind[0]} file cannot be read as a stream; "
                          f"decompress it ({kind[0]} compresses its columns itself)")
    return Source(path.resolve(), kind[0], kind[1], stat.st_size, stat.st_mtime_ns)


def _is_token_folder(folder: Path) -> bool:
    try:
        with open(folder / "meta.json", encoding="utf-8") as f:
            return '"hybridpar-tokens"' in f.read(200)
    except (OSError, UnicodeDecodeError):
        return False


def _walk(root: Path) -> Iterator[Path]:
    """The files under `root`, skipping hidden folders and token folders (tokenize's output)."""
    for here, dirs, names in os.walk(root):
        if "meta.json" in names and _is_token_folder(Path(here)):
            dirs[:] = []
            continue
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        yield from (Path(here) / n for n in names)


def find_sources(inputs: Sequence[str | os.PathLike[str]], *, format: str = "auto"
                 ) -> list[Source]:
    """The files of `inputs` (files, directories, globs), each once, in the order given.

    A directory contributes its files of known suffixes (every file when `format` is set),
    sorted by path, hidden ones and token folders skipped; so does a glob. Raises
    `CorpusError` for an input that does not exist, matches nothing readable, or a corpus of
    no bytes at all.
    """
    if format != "auto" and format not in FORMATS:
        raise CorpusError(f"unknown format {format!r}; choose auto or one of {', '.join(FORMATS)}")
    if not inputs:
        raise CorpusError("no inputs: give the corpus files, folders or globs to tokenize")
    known = ".txt, .jsonl, .parquet, .arrow (also .text, .ndjson; text ones also .gz or .zst)"
    out: dict[Path, Source] = {}
    for given in inputs:
        text = os.fspath(given)
        path = Path(text)
        if path.is_file():
            kind = _kind(path, format)
            if kind is None:
                raise CorpusError(f"{text}: cannot tell its format from the name; rename it to "
                                  f"one of {known}, or pass --format txt|jsonl|parquet|arrow")
            candidates = [(path, kind)]
        elif path.is_dir() or glob.has_magic(text):
            if path.is_dir():   # hidden: a name under the folder that starts with "."
                found = [(p, p.relative_to(path).parts) for p in _walk(path)]
            else:               # glob skips hidden names unless the pattern names them
                found = [(Path(n), (Path(n).name,)) for n in glob.glob(text, recursive=True)]
                outputs = {d for d in {p.parent for p, _ in found} if _is_token_folder(d)}
                found = [(p, parts) for p, parts in found if p.parent not in outputs]
            candidates = []
            for p, parts in sorted(found):
                kind = _kind(p, format)
                if kind is not None and p.is_file() and not any(
                        part.startswith(".") for part in parts):
                    candidates.append((p, kind))
            if not found and not path.is_dir():
                raise CorpusError(f"{text}: the glob matches no file (relative paths are from "
                                  f"the working directory {os.getcwd()})")
            if not candidates:
                what = "folder" if path.is_dir() else "glob"
                raise CorpusError(f"{text}: the {what} holds no corpus file (names ending in "
                                  f"{known}); give files, or --format to read every file")
        else:
            raise CorpusError(f"{text}: no such file, folder or glob match (relative paths "
                              f"are from the working directory {os.getcwd()})")
        for p, kind in candidates:
            source = _source(p, kind)
            out.setdefault(source.path, source)
    sources = list(out.values())
    if sum(s.size for s in sources) == 0:
        names = ", ".join(str(s.path) for s in sources[:3]) + (" ..." if len(sources) > 3 else "")
        raise CorpusError(f"the corpus is empty: {len(sources)} file(s) of 0 bytes ({names}); "
                          "give files that hold text")
    return sources


def fingerprint(sources: Sequence[Source]) -> dict[str, Any]:
    """What identifies the inputs without reading them: paths, sizes and mtimes, and a hash.

    As make and rsync do, a file counts as unchanged while its absolute path, size and
    modification time (ns) are; reading every byte again would cost as much as tokenizing.
    """
    files = [{"path": str(s.path), "bytes": s.size, "mtime_ns": s.mtime_ns, "format": s.format,
              "compression": s.compression} for s in sources]
    digest = hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()
    return {"sha256": digest, "files": files, "bytes": sum(s.size for s in sources)}


def _decompressed(source: Source) -> Any:
    """The file's decompressed bytes as a binary stream."""
    if source.compression == "gzip":
        return gzip.open(source.path, "rb")
    if source.compression == "zstd":
        try:
            import zstandard
        except ImportError:
            raise CorpusError(f"{source.path}: reading .zst needs the zstandard package; "
                              "pip install 'hybridpar[data]'") from None
        return zstandard.open(source.path, "rb")
    return open(source.path, "rb")


@contextlib.contextmanager
def open_stream(source: Source) -> Iterator[io.BufferedIOBase]:
    """The file's decompressed bytes as a buffered stream; a gzip or zstd stream found
    damaged while the block reads it raises `CorpusError`."""
    try:
        with _decompressed(source) as raw:
            yield raw if isinstance(raw, io.BufferedIOBase) else io.BufferedReader(raw)
    except (EOFError, zlib.error, gzip.BadGzipFile) as e:
        raise CorpusError(f"{source.path}: the {source.compression} stream is damaged ({e}); "
                          "compress the file again") from None
    except Exception as e:
        if type(e).__name__ != "ZstdError":
            raise
        raise CorpusError(f"{source.path}: the zstd stream is damaged ({e}); compress the "
                          "file again") from None


def text_decoder(source: Source, errors: str, counts: Counts
             ) -> Callable[[bytes, Callable[[int], str]], str | None]:
    """``decode(raw, where)``: the text of `raw` under the policy; None when it is skipped."""
    fix = ("fix the file, or pass --errors replace (U+FFFD for bad bytes) or --errors skip "
           "(drop the document)")
    name = str(source.path)

    def decode(raw: bytes, where: Callable[[int], str]) -> str | None:
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            if errors == "strict":
                raise CorpusError(f"{where(e.start)}: not UTF-8 text (byte 0x{raw[e.start]:02x} "
                                  f"at offset {e.start} of the document); {fix}") from None
            counts.files[name] = counts.files.get(name, 0) + 1
            if errors == "replace":
                counts.replaced += 1
                return raw.decode("utf-8", "replace")
            counts.skipped += 1
            return None

    return decode


def _clean_surrogates(text: str, where: str, errors: str, counts: Counts, name: str
                      ) -> str | None:
    """JSON can spell a lone surrogate (``"\\ud800"``), which is no UTF-8 text either."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        if errors == "strict":
            raise CorpusError(f"{where}: the text holds a lone surrogate escape (\\ud800-"
                              "\\udfff), not UTF-8 text; fix the line, or pass --errors "
                              "replace or --errors skip") from None
    counts.files[name] = counts.files.get(name, 0) + 1
    if errors == "replace":
        counts.replaced += 1
        return text.encode("utf-8", "surrogatepass").decode("utf-8", "replace")
    counts.skipped += 1
    return None


def _split(stream: io.BufferedIOBase, sep: bytes) -> Iterator[tuple[bytes, int]]:
    """The parts of `stream` between `sep`s, each with the line it starts on."""
    buf, line = bytearray(), 1
    while chunk := stream.read(_CHUNK):
        start = max(0, len(buf) - len(sep) + 1)
        buf += chunk
        if buf.find(sep, start) < 0:
            continue
        parts = buf.split(sep)
        buf = parts.pop()
        for part in parts:
            yield bytes(part), line
            line += part.count(b"\n") + sep.count(b"\n")
    yield bytes(buf), line


def _txt(source: Source, stream: io.BufferedIOBase, decode: Any, separator: str | None,
         counts: Counts) -> Iterator[str]:
    name = str(source.path)
    if separator is None:
        parts: Iterator[tuple[bytes, int]] = iter([(stream.read(), 1)])
    else:
        parts = _split(stream, separator.encode("utf-8"))
    for raw, line in parts:
        if not raw:
            counts.empty += 1
            continue

        def where(offset: int, raw: bytes = raw, line: int = line) -> str:
            return f"{name}:{line + raw.count(_NL, 0, offset)}"

        text = decode(raw, where)
        if text is not None:
            yield text


def json_lines(source: Source, stream: io.BufferedIOBase, decode: Any
               ) -> Iterator[tuple[str, Any, str]]:
    """(where, object, line) of each non-blank line of a .jsonl stream; a line that is not
    UTF-8 follows `decode`'s policy, one that is not JSON raises `CorpusError`."""
    name = str(source.path)
    for lineno, raw in enumerate(stream, 1):
        if not raw.strip():
            continue
        where = f"{name}:{lineno}"
        line = decode(raw, lambda _offset, where=where: where)
        if line is None:
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise CorpusError(f"{where}: not a JSON object ({e.msg}, column {e.colno}); each "
                              "line of a .jsonl file is one object") from None
        yield where, obj, line


def _jsonl(source: Source, stream: io.BufferedIOBase, decode: Any, field: str, errors: str,
           counts: Counts) -> Iterator[str]:
    name = str(source.path)
    for where, obj, line in json_lines(source, stream, decode):
        if not isinstance(obj, dict) or field not in obj:
            keys = ", ".join(repr(k) for k in list(obj)[:8]) if isinstance(obj, dict) else ""
            have = f"its fields: {keys}" if keys else f"it is a {type(obj).__name__}"
            raise CorpusError(f"{where}: no field {field!r} ({have}); name the text field "
                              "with --field")
        text = obj[field]
        if not isinstance(text, str):
            raise CorpusError(f"{where}: field {field!r} is a {type(text).__name__}, not text; "
                              "name the text field with --field")
        if "\\u" in line:
            text = _clean_surrogates(text, where, errors, counts, name)
            if text is None:
                continue
        if not text:
            counts.empty += 1
            continue
        yield text


def _table(source: Source, decode: Any, field: str, counts: Counts) -> Iterator[str]:
    """The documents of a parquet or Arrow file: one per row of the column `field`."""
    name = str(source.path)
    row = 0
    try:
        batches = read_batches(source.path, source.format, [field],
                               hint="name the text column with --field")
        for batch in batches:
            for value in batch.column(0).to_pylist():
                row += 1
                if isinstance(value, bytes):
                    value = decode(value, lambda _offset, row=row: f"{name}: row {row}")
                    if value is None:
                        continue
                if not isinstance(value, str):
                    what = "null" if value is None else f"a {type(value).__name__}"
                    raise CorpusError(f"{name}: row {row}: column {field!r} is {what}, not "
                                      "text; drop such rows, or name the text column with "
                                      "--field")
                if not value:
                    counts.empty += 1
                    continue
                yield value
    except TableError as e:
        raise CorpusError(str(e)) from None


def read_documents(source: Source, *, field: str = "text", separator: str | None = None,
                   errors: str = "strict", counts: Counts | None = None) -> Iterator[str]:
    """The documents of one file, in order (see the table at the top of this module)."""
    if errors not in ERRORS:
        raise CorpusError(f"unknown errors policy {errors!r}; choose one of {', '.join(ERRORS)}")
    if separator == "":
        raise CorpusError("the separator is empty; give the text between documents, e.g. "
                          "'\\n\\n', or leave it out for a document per file")
    counts = Counts() if counts is None else counts
    decode = text_decoder(source, errors, counts)
    if source.format in _TABLES:
        yield from _table(source, decode, field, counts)
        return
    with open_stream(source) as stream:
        if source.format == "jsonl":
            yield from _jsonl(source, stream, decode, field, errors, counts)
        else:
            yield from _txt(source, stream, decode, separator, counts)
