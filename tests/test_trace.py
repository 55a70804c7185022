"""Instrumentation: the timeline of a traced step (API and CLI), and exact traffic counters.

One spawn per layout, shared by the tests that read it: a tp=1 pipeline traced through the
API (and a zero-bubble one, in the same spawn), a tp=2 GPT whose collectives are counted and
classified by the span that holds them.
"""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from spawn_cases import spawn_cases
from torch import nn

import hybridpar
from hybridpar.models import example_batch, gpt, gpt_loss
from hybridpar.pipeline.tracing.trace_gantt import write_gantt
from hybridpar.trace import COLUMNS, KINDS, OPS, Recorder

B, S, H, M = 8, 3, 16, 4          # batch rows, sequence, hidden, micro-batches
ROWS = B // M                     # rows of one micro-batch
HEADER = 128 * 8                  # the int64 shape header of a message of new shapes


def _mse(out, target):
    return (out - target).pow(2).mean()


def _traced_worker(folder):
    topo = hybridpar.init(pp=2, timeout=60)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(H, H), nn.Tanh()) for _ in range(4)])
    pipe = hybridpar.HybridPipe(model, [2, 2], chunks=M, topology=topo, loss_fn=_mse)
    x = torch.randn(B, S, H, generator=torch.Generator().manual_seed(1))
    hybridpar.reset_comm_stats()
    pipe.train_step(x, x)                      # off: nothing may be recorded
    first = hybridpar.comm_stats()             # shapes are new: the activations carry headers
    untraced = len(pipe.recorder.events)
    try:
        pipe.write_trace(folder)
        refused = ""
    except ValueError as e:
        refused = str(e)
    pipe.trace = True
    hybridpar.reset_comm_stats()
    pipe.train_step(x, x)
    stats = hybridpar.comm_stats()
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        report = pipe.write_trace(folder)
    return {"untraced": untraced, "refused": refused, "stats": stats, "first": first,
            "events": list(pipe.recorder.events), "printed": printed.getvalue(),
            "table": None if report is None else report.table}


def _call(fn, *args):
    return fn(*args)


@pytest.fixture(scope="module")
def pp2_runs(tmp_path_factory):
    """The pp=2 workers of this file in one spawn of 2 ranks, each writing to a folder of its
    own, in turn (the traced pipeline first: its first step's shapes are new to the process):
    {case: (folder, [rank 0's result, rank 1's])}."""
    folders = {"traced": tmp_path_factory.mktemp("trace"),
               "zero bubble": tmp_path_factory.mktemp("zb_trace")}
    results = spawn_cases(_call, 2, {"traced": (_traced_worker, str(folders["traced"])),
                                     "zero bubble": (_zero_bubble_worker,
                                                     str(folders["zero bubble"]))},
                          timeout=180)
    return {name: (folders[name], results[name]) for name in folders}


@pytest.fixture(scope="module")
def traced(pp2_runs):
    return pp2_runs["traced"]


def _slices(trace):
    return [e for e in trace["traceEvents"] if e["ph"] == "X"]


def test_tracing_off_records_nothing_and_there_is_nothing_to_write(traced):
    _, results = traced
    for r in results:
        assert r["untraced"] == 0
        assert "recorded no step" in r["refused"] and "trace=True" in r["refused"]


def test_a_traced_step_has_an_event_for_every_action_of_every_stage(traced):
    folder, _ = traced
    trace = json.loads((folder / "trace.json").read_text())
    names = {rank: Counter(e["name"] for e in _slices(trace) if e["tid"] == rank + 1)
             for rank in (0, 1)}
    every = range(M)
    for rank in (0, 1):   # except_last recomputes all but the last micro-batch
        assert all(names[rank][f"F{i}"] == 1 and names[rank][f"B{i}"] == 1 for i in every)
        assert [i for i in every if names[rank][f"R{i}"]] == list(range(M - 1))
        assert names[rank]["step"] == 1 and names[rank]["wait"] >= 1
    assert all(names[0][f"SEND_F{i}"] == 1 and names[0][f"RECV_B{i}"] == 1 for i in every)
    assert all(names[1][f"RECV_F{i}"] == 1 and names[1][f"SEND_B{i}"] == 1 for i in every)
    assert not any(n.startswith(("RECV_F", "SEND_B")) for n in names[0])
    assert names[1]["broadcast"] == 1                  # the loss, from the last stage
    for e in _slices(trace):
        assert e["args"]["stage"] == e["tid"] - 1      # stage s runs on rank s, track s + 1
        if e["cat"] in ("send", "recv"):
            assert e["args"]["bytes"] == ROWS * S * H * 4
    labels = [e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"]
    assert labels == ["rank 0 | stage 0 | tp 0 | dp 0", "rank 1 | stage 1 | tp 0 | dp 0"]
    assert trace["otherData"]["analytic_bubble"] == pytest.approx(1 / (M + 1))


def test_every_send_has_a_flow_arrow_into_its_receive(traced):
    folder, _ = traced
    trace = json.loads((folder / "trace.json").read_text())
    slices = _slices(trace)
    starts = {e["id"]: e for e in trace["traceEvents"] if e["ph"] == "s"}
    ends = {e["id"]: e for e in trace["traceEvents"] if e["ph"] == "f"}
    assert sorted(starts) == sorted(ends) and len(starts) == 2 * M

    def around(tid, ts, cat):
        return [e for e in slices if e["tid"] == tid and e["cat"] == cat
                and e["ts"] <= ts <= e["ts"] + e["dur"]]

    for flow, start in starts.items():
        (send,) = around(start["tid"], start["ts"], "send")
        end = ends[flow]
        assert end["bp"] == "e" and end["tid"] != start["tid"]
        (recv,) = around(end["tid"], end["ts"], "recv")
        assert recv["name"] == send["name"].replace("SEND", "RECV")
    sends = [e for e in slices if e["cat"] == "send"]
    assert len(sends) == len(starts)


def test_the_bubble_table_is_printed_saved_and_compared_with_the_analytic_bubble(traced):
    folder, results = traced
    table = results[0]["table"]
    assert results[1]["table"] is None and results[1]["printed"] == ""   # rank 0 writes
    assert results[0]["printed"] == table == (folder / "table.txt").read_text()
    lines = table.splitlines()
    header = next(line for line in lines if line.startswith("stage"))
    assert header.split()[-4:] == ["analytic", "%", "kept", "MiB"]
    assert "bubble %" in header and "wait %" in header
    rows = [line.split() for line in lines if line[:1].isdigit()]
    assert [r[0] for r in rows] == ["0", "1"]
    for r in rows:
        busy, bubble, wait, analytic, kept = map(float, r[-5:])
        assert kept > 0                                      # MiB saved for backward
        assert busy + bubble == pytest.approx(100, abs=0.11) and 0 <= wait <= bubble
        assert analytic == pytest.approx(100 / (M + 1), abs=0.05)
        assert r[2:5] == [str(M), str(M), str(M - 1)]       # F, B, R counts
    assert "(p - 1) / (m + p - 1) = 1/5" in table
    png = (folder / "gantt.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


def test_p2p_counters_are_b_s_h_floats_per_boundary_per_microbatch(traced):
    _, results = traced
    payload = ROWS * S * H * 4
    for stats in (r["stats"] for r in results):
        assert stats["p2p_send"] == {"bytes": M * payload, "calls": M}
        assert stats["p2p_recv"] == {"bytes": M * payload, "calls": M}
        assert stats["broadcast"] == {"bytes": 4, "calls": 1}
        assert set(stats) == {"p2p_send", "p2p_recv", "broadcast"}   # no header: shapes known
    for first in (r["first"] for r in results):   # the first step: one header per activation
        assert first["p2p_header"] == {"bytes": M * HEADER, "calls": M}
        assert first["p2p_send"] == first["p2p_recv"] == {"bytes": M * payload, "calls": M}
    for r in results:   # the events carry the same bytes
        sent = sum(e[6] for e in r["events"] if KINDS[e[0]] in ("send", "recv"))
        assert sent == 2 * M * payload


# tp = 2: the collectives of a GPT, counted and placed -----------------------------------------

GPT = {"vocab_size": 32, "block_size": 8, "n_layer": 2, "n_head": 4, "n_embd": H}


def _gpt_worker():
    topo = hybridpar.init(pp=2, tp=2, timeout=60)
    torch.manual_seed(0)
    pipe = hybridpar.HybridPipe(gpt(**GPT, tp=2), [2, 3], chunks=2, topology=topo,
                                loss_fn=gpt_loss, checkpoint="never", trace=True)
    x, y = example_batch("gpt", 4, **GPT)
    pipe.train_step(x, y)                      # warm-up; the counters count the next step
    hybridpar.reset_comm_stats()
    pipe.train_step(x, y)
    return {"stats": hybridpar.comm_stats(), "events": list(pipe.recorder.events),
            "stage": topo.pp_rank}


@pytest.fixture(scope="module")
def gpt_run():
    return hybridpar.spawn(_gpt_worker, 4, timeout=180)


def _placed(events):
    """Per all-reduce: the compute span holding it ("forward", "backward" or None)."""
    rows = [dict(zip(COLUMNS, e)) for e in events]
    spans = [r for r in rows if KINDS[r["kind"]] in ("forward", "backward")]
    placed = []
    for r in rows:
        if KINDS[r["kind"]] == "collective" and OPS[r["op"]] == "all_reduce":
            holder = [KINDS[s["kind"]] for s in spans if s["start"] <= r["start"]
                      and r["end"] <= s["end"]]
            placed.append((holder[0] if holder else None, r["microbatch"]))
    return Counter(placed)


def test_a_gpt_block_all_reduces_twice_forward_and_twice_backward_at_tp2(gpt_run):
    # Row-parallel attn.proj and mlp.proj all-reduce their outputs in forward; q, k, v (one
    # shared input copy, as a fused qkv) and mlp.fc all-reduce their input gradients in
    # backward: 2 + 2 per block, as in BENCH.md. Stage 0 adds the vocab-parallel embedding
    # (forward), stage 1 the column-parallel head (backward) and the vocab-parallel loss's
    # two all-reduces of per-row scalars (forward).
    blocks = {0: 1, 1: 1}
    extra = {0: (1, 0), 1: (2, 1)}
    for r in gpt_run:
        s, n = r["stage"], blocks[r["stage"]]
        placed = _placed(r["events"])
        for i in range(2):
            assert placed["forward", i] == 2 * n + extra[s][0]
            assert placed["backward", i] == 2 * n + extra[s][1]
        assert sum(placed.values()) == r["stats"]["all_reduce"]["calls"]


def test_tp_counters_are_exact_and_the_loss_gathers_no_logits(gpt_run):
    rows, seq, h, m = 2, GPT["block_size"], GPT["n_embd"], 2
    activation = rows * seq * h * 4
    for r in gpt_run:
        stats = r["stats"]
        per_mb = 5                              # see the test above: 1 + 2 + 2 or 2 + 2 + 1
        loss = 0                                # the loss: (row max, widths), (sum, target)
        if r["stage"] == 1:
            loss = ((rows * seq + 2) + rows * seq * 2) * 4
        assert stats["all_reduce"] == {"bytes": m * (per_mb * activation + loss),
                                       "calls": m * (per_mb + 2 * (r["stage"] == 1))}
        assert stats["p2p_send"] == {"bytes": m * activation // 2, "calls": m}   # 1/tp each
        assert stats["p2p_recv"] == {"bytes": m * activation // 2, "calls": m}
        # the only all-gathers re-assemble the scattered P2P halves: none gathers logits
        assert stats["all_gather"] == {"bytes": m * activation, "calls": m}
        assert "reduce_scatter" not in stats


# the rest: the recorder itself, the Gantt chart without matplotlib, the CLI -------------------

def test_a_disabled_recorder_hands_out_one_shared_no_op_span():
    recorder = Recorder()
    assert recorder.span("forward") is recorder.span("send", peer=1)
    with recorder.span("forward") as span:
        span.add_bytes(10)
    assert recorder.events == []
    with recorder.recording(what="test"):
        recorder.stage, recorder.microbatch = 2, 5
        with recorder.span("send", peer=3, channel=0, nbytes=7) as span:
            span.add_bytes(1)
    ((kind, op, stage, mb, peer, channel, nbytes, start, end),) = recorder.events
    assert (KINDS[kind], OPS[op], stage, mb, peer, channel, nbytes) == \
        ("send", "", 2, 5, 3, 0, 8)
    assert 0 < start <= end and not recorder.enabled and recorder.meta == {"what": "test"}


def test_without_matplotlib_the_gantt_chart_is_skipped_with_a_warning(tmp_path, monkeypatch):
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.patches",
                 "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.warns(UserWarning, match="matplotlib is not installed"):
        assert not write_gantt(tmp_path / "gantt.png", [[]], labels=["rank 0"], window=(0, 1),
                               title="t")
    assert not (tmp_path / "gantt.png").exists()


TINY = Path(__file__).parent / "data" / "tiny_gpt.toml"   # shared with test_run_cli


def test_hybridpar_run_trace_writes_one_step_and_logs_comm_per_step(tmp_path):
    from hybridpar.train.check import dry_run

    (tmp_path / "tiny.toml").write_text(TINY.read_text())
    layers = "parallel.checkpoint=layers"            # what it keeps: each layer's input
    with open(tmp_path / "run.out", "w") as out, open(tmp_path / "run.err", "w") as err:
        run = subprocess.Popen([sys.executable, "-m", "hybridpar.cli", "run", "tiny.toml",
                                "--trace-step", "2", "--set", "train.steps=3", "--set",
                                "train.sample_tokens=0", "--set", "checkpoint.every=0", "--set",
                                layers], stdout=out, stderr=err, cwd=tmp_path)
    try:
        # meanwhile (its own child process, beside the run's): the bytes each rank keeps for
        # backward as `hybridpar check` counts them on fake CPU ranks for the same config
        check = dry_run(tmp_path / "tiny.toml", device="cpu", overrides=[layers])
        run.wait(timeout=300)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    stdout, stderr = (tmp_path / "run.out").read_text(), (tmp_path / "run.err").read_text()
    assert run.returncode == 0, stderr
    folder = tmp_path / "runs" / "tiny" / "trace"
    assert sorted(p.name for p in folder.iterdir()) == ["gantt.png", "table.txt", "trace.json"]
    table = (folder / "table.txt").read_text()
    assert table in stdout and "analytic %" in table and "1f1b, m=2" in table
    trace = json.loads((folder / "trace.json").read_text())
    assert {e["name"] for e in _slices(trace)} >= {"F0", "F1", "B0", "B1", "SEND_F1", "RECV_B1"}
    # the bytes each rank kept for backward at most: those `hybridpar check` counted (above),
    # exactly (the same saved tensors, by storage)
    kept = trace["otherData"]["kept_bytes"]
    assert kept == [r.activations for r in check.ranks] and min(kept) > 0
    assert "kept MiB" in table
    records = [json.loads(line) for line in
               (tmp_path / "runs" / "tiny" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    activation = 4 * 16 * 16 * 4               # b * s * h floats cross the one boundary
    for r in records:                          # the last stage reports: receives, sends grads
        assert r["comm"]["p2p_recv"] == {"bytes": activation, "calls": 2}
        assert r["comm"]["p2p_send"] == {"bytes": activation, "calls": 2}


def test_a_trace_step_outside_the_run_fails_before_any_worker(tmp_path, capsys, monkeypatch):
    from hybridpar.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny.toml").write_text(TINY.read_text())
    assert main(["run", "tiny.toml", "--trace-step", "9"]) == 2     # the run has 8 steps
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--trace-step 9 is not a step of this run" in err[0]
    assert not (tmp_path / "runs").exists()


def test_traced_step_leaves_other_steps_alone():
    from hybridpar.pipeline.tracing.trace_report import request_trace, traced_step

    class Pipe:
        trace = False

    pipe = Pipe()
    request = request_trace("unused", step=2)
    with traced_step(pipe, request, step=1, last=3):
        assert pipe.trace is False
    with traced_step(pipe, None, step=3, last=3):
        assert pipe.trace is False                   # nothing requested


# on a GPU spans are CUDA events; the conversion to wall-clock time, with a CPU stand-in ------

class _StandInEvent:
    """What `DeviceClock` uses of torch.cuda.Event: record, elapsed_time (ms), synchronize."""

    def record(self):
        self.at = time.perf_counter()

    def elapsed_time(self, later):
        return (later.at - self.at) * 1e3

    def synchronize(self):
        pass


def test_device_clock_spans_are_placeholders_resolved_to_wall_clock_when_recording_ends():
    from hybridpar.trace import DeviceClock

    recorder = Recorder()
    clock = DeviceClock(event=_StandInEvent)
    before = time.time_ns()
    with recorder.recording(clock=clock):
        with recorder.span("forward"):
            assert recorder.events == [] and clock.marks   # an event, not a time, so far
            time.sleep(0.05)
        time.sleep(0.02)
        with recorder.span("backward"):
            time.sleep(0.03)
    (forward, backward) = [dict(zip(COLUMNS, e)) for e in recorder.events]
    assert recorder.clock is None                        # the host clock again after it
    assert before <= forward["start"] < forward["end"] < backward["start"] < backward["end"]
    assert forward["end"] - forward["start"] == pytest.approx(50e6, rel=0.3)
    assert backward["start"] - forward["end"] == pytest.approx(20e6, rel=0.5)
    assert backward["end"] - backward["start"] == pytest.approx(30e6, rel=0.3)


def test_each_recorder_records_only_inside_its_own_block():
    # the executor owns its recorder; span / collective (called from layers and comm, which
    # know no pipe) go to the recorder whose `recording` block is open, and nowhere else
    from hybridpar import trace

    outer, inner = Recorder(), Recorder()
    with trace.span("forward"):
        pass
    with outer.recording(what="outer"):
        assert trace.active() is outer
        with trace.span("forward"):
            pass
        with inner.recording(what="inner"):
            with trace.collective("all_reduce", 4):
                pass
        assert trace.active() is outer
    assert trace.active() is None
    assert [KINDS[e[0]] for e in outer.events] == ["forward"]
    assert [(KINDS[e[0]], OPS[e[1]], e[6]) for e in inner.events] == \
        [("collective", "all_reduce", 4)]


def _zero_bubble_worker(folder):
    topo = hybridpar.init(pp=2, timeout=60)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(H, H), nn.Tanh()) for _ in range(4)])
    pipe = hybridpar.HybridPipe(model, [2, 2], chunks=M, topology=topo, loss_fn=_mse,
                                schedule="zb-h1", trace=True)
    x = torch.randn(B, S, H, generator=torch.Generator().manual_seed(1))
    pipe.train_step(x, x)
    report = pipe.write_trace(folder, show=False)
    return None if report is None else report.table


def test_a_zero_bubble_trace_counts_w_and_compares_with_its_own_simulation(pp2_runs):
    table = pp2_runs["zero bubble"][1][0]
    lines = table.splitlines()
    assert lines[3].split()[:6] == ["stage", "ranks", "F", "B", "R", "W"]
    # checkpoint="except_last": M - 1 recomputations (in I); one W per micro-batch
    assert lines[4].split()[:6] == ["0", "0", str(M), str(M), str(M - 1), str(M)]
    assert "analytic and bound: zb-h1's simulated step with the mean measured t_f, t_b, t_w" \
        in table
