"""Benchmark `hybridpar tokenize` against plain `tokenizers` `encode_batch` on the same files.

    python scripts/bench_tokenize.py [--mbytes 8] [--files 8] [--vocab 4096]
        [--workers 1 2] [--repeats 5] [--out results/bench_tokenize.json] [--smoke]

The corpus is the embedded one (`hybridpar.train.default_corpus`: the standard library's
sources, nothing downloaded), `mbytes` MB of it cut into one document per source file and
written as `files` .jsonl files; the tokenizer is a byte-level BPE of `vocab` ids trained by
`tokenizers` on its first MB. Each measurement runs in a fresh process (imports not timed):

    side               what is timed                                  parallelism
    hybridpar          tokenize_corpus(files, OUT, workers=w): read,  w processes, one
                       encode, split, write shards + meta.json        encoding thread each
    encode_batch       the peer: Tokenizer.from_file; per file:       tokenizers' own threads:
                       json.loads every line, tok.encode_batch(texts  RAYON_NUM_THREADS=w
                       , add_special_tokens=False), each one's ids
    encode_batch_fast  the same with encode_batch_fast (no offsets,   the same
                       what hybridpar calls): the floor of its cost

Every side counts a document's ids plus one (hybridpar's EOS), so the counts must agree. The
(side, workers) pairs take turns within each repeat (the order rotating), after one untimed
warm-up each, so a busy spell of the shared machine hits all alike; reported: the median
tokens/s over `repeats` and half their range, hybridpar / each peer and hybridpar's speed-up
over its own run at the first worker count (medians of the per-repeat ratios). A second table
gives tokens per CPU second (the process, its threads and its worker processes): the work
each side does, which a loaded machine changes far less than the wall time. Prints the tables
and writes the numbers as JSON with the machine and its load.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

SIDES = ("hybridpar", "encode_batch", "encode_batch_fast")


def make_corpus(folder: Path, *, mbytes: float, files: int, vocab: int) -> tuple[list[Path],
                                                                                 Path]:
    """(the .jsonl files, the tokenizer.json) of the benchmark, written under `folder`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from hybridpar.train import default_corpus

    text = default_corpus(max_bytes=int(mbytes * 1e6)).decode("utf-8", errors="replace")
    docs = ["# file: " + d for d in text.split("# file: ") if d]
    paths = []
    per = -(-len(docs) // files)
    for i in range(files):
        paths.append(folder / f"part-{i:02d}.jsonl")
        paths[-1].write_text("".join(json.dumps({"text": d}) + "\n"
                                     for d in docs[i * per:(i + 1) * per]), encoding="utf-8")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    head, size = [], 0
    for d in docs:
        head.append(d)
        size += len(d)
        if size > 1_000_000:
            break
    tok.train_from_iterator(head, trainer)
    tok.save(str(folder / "tokenizer.json"))
    return paths, folder / "tokenizer.json"


def _cpu() -> float:
    """CPU seconds of this process (all its threads) and of its reaped children."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(
        resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def _hybridpar(files: list[str], tokenizer: str, workers: int, scratch: str) -> dict[str, Any]:
    from hybridpar.data import tokenize_corpus

    out = Path(scratch) / f"out-{os.getpid()}"
    t0, c0 = time.perf_counter(), _cpu()
    done = tokenize_corpus(files, out, tokenizer=tokenizer, workers=workers, val_fraction=0.05)
    seconds, cpu = time.perf_counter() - t0, _cpu() - c0
    return {"seconds": seconds, "cpu_seconds": cpu, "tokens": done.meta["tokens"],
            "documents": done.meta["documents"]}


def _peer(files: list[str], tokenizer: str, method: str) -> dict[str, Any]:
    from tokenizers import Tokenizer

    t0, c0 = time.perf_counter(), _cpu()
    tok = Tokenizer.from_file(tokenizer)
    encode = getattr(tok, method)
    tokens = documents = 0
    for file in files:
        with open(file, encoding="utf-8") as f:
            texts = [json.loads(line)["text"] for line in f if line.strip()]
        ids = [e.ids for e in encode(texts, add_special_tokens=False)]
        tokens += sum(len(i) + 1 for i in ids)           # + 1: hybridpar's EOS
        documents += len(ids)
    return {"seconds": time.perf_counter() - t0, "cpu_seconds": _cpu() - c0, "tokens": tokens,
            "documents": documents}


def measure(side: str, files: list[Path], tokenizer: Path, workers: int, scratch: Path
            ) -> dict[str, Any]:
    """One timed run of `side` in a fresh process with `workers`-way parallelism."""
    env = {**os.environ, "RAYON_NUM_THREADS": str(workers), "OMP_NUM_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "true" if workers > 1 else "false"}
    job = json.dumps({"side": side, "files": [str(f) for f in files],
                      "tokenizer": str(tokenizer), "workers": workers, "scratch": str(scratch)})
    done = subprocess.run([sys.executable, __file__, "--one", job], env=env, check=True,
                          capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_one(job: dict[str, Any]) -> None:
    if job["side"] == "hybridpar":
        result = _hybridpar(job["files"], job["tokenizer"], job["workers"], job["scratch"])
    else:
        result = _peer(job["files"], job["tokenizer"], job["side"])
    print(json.dumps(result))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mbytes", type=float, default=8.0, help="MB of corpus text (default 8)")
    p.add_argument("--files", type=int, default=8, help=".jsonl files (default 8)")
    p.add_argument("--vocab", type=int, default=4096, help="BPE vocabulary (default 4096)")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1, help="untimed runs of each side first")
    p.add_argument("--out", default="results/bench_tokenize.json")
    p.add_argument("--smoke", action="store_true",
                   help="the smallest run (0.2 MB, 1 repeat): checks the script, not speed")
    p.add_argument("--one", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:   # a measurement: the peers' processes import no torch
        run_one(json.loads(args.one))
        return 0
    from bench.common import fmt, load, markdown_table, spread, write_json

    if args.smoke:
        args.mbytes, args.files, args.vocab, args.repeats, args.warmup = 0.2, 2, 300, 1, 0
    load_before, started = load(), time.perf_counter()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench_tokenize_") as tmp:
        scratch = Path(tmp)
        files, tokenizer = make_corpus(scratch, mbytes=args.mbytes, files=args.files,
                                       vocab=args.vocab)
        combos = [(w, side) for w in args.workers for side in SIDES]
        for _ in range(args.warmup):
            for w, side in combos:
                measure(side, files, tokenizer, w, scratch)
        runs: dict[tuple[int, str], list[dict[str, Any]]] = {c: [] for c in combos}
        for r in range(args.repeats):
            shift = r % len(combos)
            for w, side in combos[shift:] + combos[:shift]:
                runs[w, side].append(measure(side, files, tokenizer, w, scratch))
        counts = {(x["tokens"], x["documents"]) for xs in runs.values() for x in xs}
        if len(counts) != 1:
            raise SystemExit(f"the sides counted different tokens / documents: {counts}")
        (tokens, documents), = counts
        rates = {c: [tokens / x["seconds"] for x in xs] for c, xs in runs.items()}
        first = args.workers[0]
        for w in args.workers:
            row: dict[str, Any] = {"workers": w, "tokens": tokens, "documents": documents}
            for side in SIDES:
                row[f"{side}_tokens_per_s"] = spread(rates[w, side])
                row[f"{side}_tokens_per_cpu_s"] = spread(
                    [tokens / x["cpu_seconds"] for x in runs[w, side]])
            for peer in SIDES[1:]:
                ratios = [a / b for a, b in zip(rates[w, "hybridpar"], rates[w, peer])]
                row[f"ratio_{peer}"], row[f"ratios_{peer}"] = statistics.median(ratios), ratios
            scaling = [a / b for a, b in zip(rates[w, "hybridpar"], rates[first, "hybridpar"])]
            row["speedup_over_first"] = statistics.median(scaling)
            rows.append(row)
    table = markdown_table(
        ["workers", "tokens", "hybridpar tokenize (M tokens/s)", "encode_batch (M tokens/s)",
         "encode_batch_fast (M tokens/s)", "hybridpar / encode_batch",
         "hybridpar / encode_batch_fast", f"hybridpar vs {args.workers[0]} worker(s)"],
        [[r["workers"], f"{r['tokens']:,}", fmt(r["hybridpar_tokens_per_s"], 1e-6, 3),
          fmt(r["encode_batch_tokens_per_s"], 1e-6, 3),
          fmt(r["encode_batch_fast_tokens_per_s"], 1e-6, 3), f"{r['ratio_encode_batch']:.2f}",
          f"{r['ratio_encode_batch_fast']:.2f}", f"{r['speedup_over_first']:.2f}x"]
         for r in rows])
    cpu_table = markdown_table(
        ["workers", *(f"{side} (M tokens per CPU s)" for side in SIDES)],
        [[r["workers"], *(fmt(r[f"{side}_tokens_per_cpu_s"], 1e-6, 3) for side in SIDES)]
         for r in rows])
    print(table + "\n\n" + cpu_table)
    result = {"name": "tokenize", "rows": rows, "table": table, "cpu_table": cpu_table,
              "config": {"mbytes": args.mbytes, "files": args.files, "vocab": args.vocab,
                         "workers": args.workers, "repeats": args.repeats,
                         "warmup": args.warmup, "smoke": args.smoke},
              "load_before": load_before, "load_after": load(),
              "seconds": time.perf_counter() - started}
    out = write_json(args.out, result)
    m = result["machine"]
    print(f"\n{m['processor']}, {m['cpus']} CPUs; load {load_before} before, "
          f"{result['load_after']} after; wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
