"""Columnar inputs read a batch of rows at a time: parquet files and Arrow files.

    file            written by                                     read with
    a.parquet       pandas, pyarrow, `datasets`' to_parquet         pyarrow.parquet.ParquetFile
    a.arrow         `datasets`' save_to_disk (data-00000-of-N)      pyarrow.ipc: stream or file

Both need the `pyarrow` package (the `data` extra); the errors name the file and the fix.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

__all__ = ["TableError", "column_names", "read_batches"]

_BATCH_ROWS = 4096


class TableError(ValueError):
    """A columnar file cannot be read as given; the message names the file and the fix."""


def _pyarrow(path: Path, what: str) -> Any:
    try:
        import pyarrow as pa
    except ImportError:
        raise TableError(f"{path}: reading {what} needs the pyarrow package; pip install "
                         "'hybridpar[data]'") from None
    return pa


def _arrow_reader(path: Path) -> Any:
    """An Arrow IPC reader of `path`: the stream format (`datasets`) or the file format."""
    pa = _pyarrow(path, ".arrow")
    try:
        return pa.ipc.open_stream(pa.memory_map(str(path)))
    except (pa.ArrowException, OSError):
        pass
    try:
        return pa.ipc.open_file(pa.memory_map(str(path)))
    except (pa.ArrowException, OSError) as e:
        raise TableError(f"{path}: not a readable Arrow file ({e})") from None


def _check_columns(path: Path, names: Sequence[str], wanted: Sequence[str], hint: str) -> None:
    missing = [c for c in wanted if c not in names]
    if missing:
        raise TableError(f"{path}: no column {missing[0]!r} (its columns: "
                         f"{', '.join(map(repr, list(names)[:8]))}); {hint}")


def _parquet(path: Path) -> Any:
    pa = _pyarrow(path, ".parquet")
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(str(path))
    except (pa.ArrowException, OSError) as e:
        raise TableError(f"{path}: not a readable parquet file ({e})") from None


def column_names(path: Path, format: str) -> list[str]:
    """The columns of a parquet (`format` "parquet") or Arrow ("arrow") file."""
    schema = _parquet(path).schema_arrow if format == "parquet" else _arrow_reader(path).schema
    return list(schema.names)


def read_batches(path: Path, format: str, columns: Sequence[str], *, hint: str
                 ) -> Iterator[Any]:
    """The rows of `columns` of a parquet or Arrow file, as pyarrow RecordBatches in order.

    A column the file lacks raises `TableError` naming the file, its columns and `hint` (how
    to name another column).
    """
    if format == "parquet":
        file = _parquet(path)
        _check_columns(path, file.schema_arrow.names, columns, hint)
        yield from file.iter_batches(columns=list(columns), batch_size=_BATCH_ROWS)
        return
    reader = _arrow_reader(path)
    _check_columns(path, reader.schema.names, columns, hint)
    if hasattr(reader, "num_record_batches"):          # the file format
        parts = (reader.get_batch(i) for i in range(reader.num_record_batches))
    else:
        parts = iter(reader)
    for batch in parts:
        yield batch.select(list(columns))
