"""Run the benchmark suite of BENCH.md and write every table, as JSON and as markdown.

    python scripts/bench_all.py [--quick | --smoke] [--only schedule comm ...]
                                [--skip-tpdense] [--out-dir results] [--trace-dir DIR]

Benchmarks (one module each under scripts/bench/, in this order):

    schedule   GPipe / 1F1B on sleep-simulated stages vs the bound and torch pipelining
    comm       P2P bytes per boundary, all-reduces per GPT block, no logit gather
    memory     saved-activation bytes per stage: GPipe, 1F1B, checkpoint modes
    overhead   HybridPipe at pp = tp = dp = 1 vs a plain PyTorch loop
    tp_mlp     a large MLP at tp = 2 vs tp = 1 and DTensor Colwise / Rowwise
    gpt        the quick-start GPT at pp = 2 x tp = 2 vs torch pipelining + DTensor TP
    zero_bubble  ZB-H1 on F / I / W sleeps vs its simulated bound, 1F1B and torch's zero bubble
    virtual    interleaved / ZBV with 2 chunks per rank, ZB-H1, 1F1B vs their simulated bounds
               and torch's Interleaved1F1B / InterleavedZeroBubble / ZBVZeroBubble (pending:
               runs only with --only virtual until tests/test_bench_smoke.py lists it)
    tpdense    scripts/bench_tpdense.py (sync vs async TPDense), as a subprocess

Writes ``OUT_DIR/<name>.json`` per benchmark, ``OUT_DIR/bench_all.json`` (all of them) and
``OUT_DIR/bench_all.md`` (machine, date, torch, command, every table and its notes: the
docs/benchmarks.md). The default (full) run takes about 8 minutes on 2 cores;
``--quick`` runs smaller sweeps (about 3 minutes); ``--smoke`` the smallest configuration
of each (seconds, for tests; its numbers mean nothing).
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench import BENCHMARKS, PENDING
from bench.common import load, machine, markdown_table, write_json

ALL = (*BENCHMARKS, *PENDING, "tpdense")
DEFAULT = tuple(n for n in ALL if n not in PENDING)   # what runs without --only


def _tpdense(mode: str, out_dir: Path) -> dict[str, Any]:
    """scripts/bench_tpdense.py in a subprocess (its own process groups), then its table."""
    out = out_dir / "bench_tpdense.json"
    args = {"full": ["--tp", "2", "4"], "quick": ["--tp", "2", "--iters", "4"],
            "smoke": ["--tp", "2", "--tokens", "64", "--in-features", "32",
                      "--out-features", "32", "--repeats", "3", "--iters", "1"]}[mode]
    cmd = [sys.executable, str(Path(__file__).with_name("bench_tpdense.py")), *args,
           "--no-cuda", "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    subprocess.run(cmd, check=True, capture_output=mode == "smoke", env=env)
    result = json.loads(out.read_text())
    rows = [[r["tp"], r["mode"], f"{r['sync_ms']:.2f}", f"{r['async_ms']:.2f}",
             f"{r['comp_ms']:.2f}", f"{r['comm_ms']:.2f}", f"{r['speedup']:.2f}",
             f"{r['overlap']:.2f}"] for r in result["rows"]]
    cfg = result["config"]
    return {"name": "tpdense", "title": "TPDense: synchronous vs ring-overlapped (gloo)",
            "config": cfg, "rows": result["rows"],
            "table": markdown_table(["tp", "mode", "sync ms", "async ms", "comp ms", "comm ms",
                                     "sync / async", "overlap"], rows),
            "notes": [f"{cfg['tokens']} tokens, {cfg['in_features']} -> {cfg['out_features']} "
                      f"features, median of {cfg['repeats']} x {cfg['iters']} steps"],
            "load_average_1m": result["machine"]["load_average_1m"]}


def _markdown(results: list[dict[str, Any]], header: dict[str, Any]) -> str:
    m = header["machine"]
    lines = ["## Benchmarks", "",
             f"`{header['command']}` — {header['date']}, {m['processor']}, {m['cpus']} CPUs, "
             f"torch {m['torch']}, Python {m['python']}, gloo; {header['seconds']:.0f} s in all, "
             f"1-minute load average {header['load_before']:.1f} before, "
             f"{header['load_after']:.1f} after (the machine is shared).", ""]
    for r in results:
        lines += [f"### {r['title']}", ""]
        if r.get("columns"):
            lines += [r["columns"] + ".", ""]
        lines += [r["table"], ""]
        loads = r.get("load_average_1m")
        extra = [f"{r.get('seconds', 0):.0f} s"]
        if loads:
            extra.append("load " + " → ".join(f"{x:.1f}" for x in loads))
        lines += [f"- {n}" for n in r.get("notes", [])] + [f"- ({', '.join(extra)})", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="smaller sweeps (~3 min)")
    size.add_argument("--smoke", action="store_true", help="smallest configs, for tests")
    parser.add_argument("--only", nargs="+", choices=ALL, default=None, metavar="NAME",
                        help=f"run these only (of {', '.join(ALL)})")
    parser.add_argument("--skip-tpdense", action="store_true")
    parser.add_argument("--out-dir", default="results")
    parser.add_argument("--trace-dir", default=None,
                        help="schedule: also write one traced step per configuration here")
    args = parser.parse_args(argv)
    mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    names = [n for n in (args.only or DEFAULT) if not (n == "tpdense" and args.skip_tpdense)]
    out_dir = Path(args.out_dir)
    command = "python " + " ".join(shlex.quote(a) for a in
                                   ["scripts/bench_all.py", *(argv or sys.argv[1:])])
    start, load_before = time.perf_counter(), load()
    results = []
    for name in names:
        t0 = time.perf_counter()
        print(f"== {name} ({mode}), load {load():.1f}", flush=True)
        if name == "tpdense":
            result = _tpdense(mode, out_dir)
        else:
            module = importlib.import_module(f"bench.{name}")
            kwargs = {"trace_dir": args.trace_dir} if name == "schedule" else {}
            result = module.run(mode, **kwargs)
        result["seconds"] = time.perf_counter() - t0
        result["mode"] = mode
        print(f"### {result['title']}\n\n{result['table']}\n", flush=True)
        for note in result.get("notes", []):
            print(f"- {note}")
        print(f"({result['seconds']:.0f} s)\n", flush=True)
        write_json(out_dir / f"{name}.json", dict(result))
        results.append(result)
    header = {"command": command, "mode": mode,
              "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "machine": machine(), "seconds": time.perf_counter() - start,
              "load_before": load_before, "load_after": load()}
    if args.only is None or len(names) > 1:
        write_json(out_dir / "bench_all.json", {**header, "results": results})
        (out_dir / "bench_all.md").write_text(_markdown(results, header) + "\n")
        print(f"wrote {out_dir}/bench_all.json and {out_dir}/bench_all.md "
              f"({header['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
