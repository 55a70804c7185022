"""RUN_DIR/metrics.jsonl: one JSON object per logged step, appended and flushed as it comes."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from hybridpar.files import atomic_write_text

__all__ = ["MetricsLog", "read_metrics"]


def read_metrics(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The records of a metrics file (an unfinished last line, cut by a crash, is dropped)."""
    file = Path(path)
    if not file.is_file():
        return []
    records = []
    for line in file.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


class MetricsLog:
    """Appends records to a JSON-lines file; on resume keeps only those of steps <= `after`.

    A run resumed from the checkpoint of step k logs steps k+1.. again, so the records a
    crashed run wrote after its last checkpoint are dropped first (the file is rewritten
    through a temporary file and `os.replace`, never left half-written).
    """

    def __init__(self, path: str | os.PathLike[str], *, after: int = 0) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = [r for r in read_metrics(self.path) if int(r.get("step", 0)) <= after]
        atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in kept))
        self._file = open(self.path, "a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        """Append one record as a line and flush it."""
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()
