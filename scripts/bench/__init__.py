"""The benchmark suite of BENCH.md: one module per benchmark, run by ``scripts/bench_all.py``.

    module     benchmark                                               peer in the same run
    schedule   GPipe / 1F1B step time of sleep-simulated stages        torch.distributed.pipelining
    comm       P2P bytes, all-reduces per GPT block, no logit gather   the formulas of BENCH.md
    memory     saved-activation bytes per stage, schedule x checkpoint the formulas of BENCH.md
    overhead   HybridPipe at pp = tp = dp = 1                          a plain PyTorch loop
    tp_mlp     a large MLP at tp = 2                                   tp = 1 and DTensor TP
    gpt        the quick-start GPT at pp = 2 x tp = 2, tokens/s        pipelining + DTensor TP
    zero_bubble  ZB-H1 on F / I / W sleeps: simulated bound, 1F1B      pipelining's 1F1B and
                                                                       zero-bubble schedule
    virtual    interleaved and ZBV (v = 2 chunks per rank), ZB-H1,     pipelining's Interleaved1F1B,
               1F1B: simulated bounds, the step-time ladder            InterleavedZeroBubble, ZBV

Each module has ``NAME``, ``TITLE`` and ``run(mode) -> dict`` (mode "full", "quick" or
"smoke"); the dict holds ``rows``, a markdown ``table``, ``notes`` and ``config``.

`PENDING` benchmarks run only when named (``bench_all.py --only NAME``): none today.
"""

__all__ = ["BENCHMARKS", "PENDING"]

BENCHMARKS = ("schedule", "comm", "memory", "overhead", "tp_mlp", "gpt", "zero_bubble",
              "virtual")
PENDING: tuple[str, ...] = ()
