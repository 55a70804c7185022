"""Two `hybridpar tokenize` into one folder (issue 40, point 3): a folder that appears while
tokenizing is an error without --overwrite (nothing to do if it holds the same tokens), and
with it the replacement is one step and said.

The story: both runs printed "wrote OUT" and exited 0, the later silently replacing the
earlier, because `tokenize_corpus` always renamed with ``replace=True``, so the "appeared
while tokenizing" guard of `staged_folder` never fired.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from test_tokenize import write_jsonl

from hybridpar.data import CorpusError, open_tokens, tokenize_corpus
from hybridpar.data.shards import ShardWriter
from hybridpar.io import staged as staging

ROOT = Path(__file__).resolve().parents[1]
DOCS = [f"document {i} " * 20 for i in range(200)]


def _appear_during_first_write(monkeypatch, out: Path, source: Path) -> None:
    """While the run tokenizes (its first shard write), `source` is copied to `out`."""
    real = ShardWriter.write

    def write(self, ids, lengths, mask=None):
        if not out.exists():
            shutil.copytree(source, out)
        real(self, ids, lengths, mask)

    monkeypatch.setattr(ShardWriter, "write", write)


def test_a_folder_that_appears_while_tokenizing_is_an_error_without_overwrite(
        tmp_path, monkeypatch):
    write_jsonl(tmp_path / "a.jsonl", DOCS)
    other = tokenize_corpus([tmp_path / "a.jsonl"], tmp_path / "other", val_fraction=0.5)
    _appear_during_first_write(monkeypatch, tmp_path / "out", tmp_path / "other")
    with pytest.raises(CorpusError, match=r"out appeared while tokenizing \(another hybridpar "
                       r"tokenize into the same folder\?\) and holds other tokens; it was left "
                       r"as it is .* or --overwrite to replace it"):
        tokenize_corpus([tmp_path / "a.jsonl"], tmp_path / "out", val_fraction=0.1)
    assert open_tokens(tmp_path / "out").meta == other.meta       # left as it was
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.jsonl", "other", "out"]


def test_a_folder_that_appears_with_the_same_tokens_is_kept(tmp_path, monkeypatch):
    write_jsonl(tmp_path / "a.jsonl", DOCS)
    same = tokenize_corpus([tmp_path / "a.jsonl"], tmp_path / "same")
    _appear_during_first_write(monkeypatch, tmp_path / "out", tmp_path / "same")
    done = tokenize_corpus([tmp_path / "a.jsonl"], tmp_path / "out")
    assert done.up_to_date and done.meta == same.meta
    assert "written by another process with the same inputs" in done.notes[0]


def test_overwrite_replaces_a_folder_that_appeared_in_one_step_and_says_so(
        tmp_path, monkeypatch):
    write_jsonl(tmp_path / "a.jsonl", DOCS)
    tokenize_corpus([tmp_path / "a.jsonl"], tmp_path / "other", val_fraction=0.5)
    _appear_during_first_write(monkeypatch, tmp_path / "out", tmp_path / "other")
    swaps = []
    real = staging._exchange
    monkeypatch.setattr(staging, "_exchange", lambda a, b: swaps.append(1) or real(a, b))
    done = tokenize_corpus([tmp_path / "a.jsonl"], tmp_path / "out", val_fraction=0.1,
                           overwrite=True)
    assert not done.up_to_date and done.notes == (
        f"replaced the folder that was at {tmp_path / 'out'} (--overwrite)",)
    assert open_tokens(tmp_path / "out", verify=True).meta == done.meta
    assert swaps == [1]                     # renameat2(RENAME_EXCHANGE): no moment without OUT
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.jsonl", "other", "out"]


def test_overwrite_without_an_atomic_exchange_still_replaces(tmp_path, monkeypatch):
    write_jsonl(tmp_path / "a.jsonl", DOCS)
    tokenize_corpus([tmp_path / "a.jsonl"], tmp_path / "out", val_fraction=0.5)
    monkeypatch.setattr(staging, "_exchange", lambda a, b: False)   # e.g. NFS
    done = tokenize_corpus([tmp_path / "a.jsonl"], tmp_path / "out", val_fraction=0.1,
                           overwrite=True)
    assert done.notes and open_tokens(tmp_path / "out", verify=True).meta == done.meta
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.jsonl", "out"]


_RACER = textwrap.dedent("""
    import json, sys, time
    from pathlib import Path
    from hybridpar.cli import main
    corpus, tmp, me = sys.argv[1:4]
    for case, fraction, extra in json.loads(sys.argv[4]):
        Path(tmp, f"ready-{case}-{me}").touch()
        while not Path(tmp, f"go-{case}").exists():     # both imported: start together
            time.sleep(0.002)
        code = main(["tokenize", corpus, "-o", str(Path(tmp, "out-" + case)), "--quiet",
                     "--val-fraction", str(fraction), *extra])
        print(json.dumps({"case": case, "code": code}), flush=True)
""")


def test_two_real_tokenize_processes_into_one_folder(tmp_path):
    """Two `hybridpar tokenize` processes started together, three times: other tokens
    (one wins, the other exits 2 naming the folder), the same tokens (both 0), and other
    tokens with --overwrite (both 0, OUT complete, one of them)."""
    write_jsonl(tmp_path / "a.jsonl", DOCS * 20)
    cases = {"a": [(0.1, []), (0.5, [])], "b": [(0.1, []), (0.1, [])],
             "c": [(0.1, ["--overwrite"]), (0.5, ["--overwrite"])]}
    procs = []
    for me in (0, 1):
        plan = [(case, runs[me][0], runs[me][1]) for case, runs in cases.items()]
        procs.append(subprocess.Popen(
            [sys.executable, "-c", _RACER, str(tmp_path / "a.jsonl"), str(tmp_path), str(me),
             json.dumps(plan)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True))
    try:
        for case in cases:
            deadline = time.monotonic() + 120
            while not all((tmp_path / f"ready-{case}-{me}").exists() for me in (0, 1)):
                assert time.monotonic() < deadline and all(p.poll() is None for p in procs), \
                    [p.communicate() for p in procs]
                time.sleep(0.01)
            (tmp_path / f"go-{case}").touch()
        outputs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill()
    results: dict[str, list[int]] = {case: [] for case in cases}
    for stdout, _ in outputs:
        for line in stdout.splitlines():
            if line.startswith("{"):
                record = json.loads(line)
                results[record["case"]].append(record["code"])
    said = "".join(o + e for o, e in outputs)
    assert sorted(results["a"]) == [0, 2], said
    assert "appeared while tokenizing" in said or "holds the tokens of other inputs" in said
    assert results["b"] == [0, 0] and results["c"] == [0, 0], said
    open_tokens(tmp_path / "out-b", verify=True)
    assert open_tokens(tmp_path / "out-c", verify=True).meta["options"]["val_fraction"] \
        in (0.1, 0.5)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
