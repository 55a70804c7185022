"""Pipeline parallelism, in rooms (each room's ``__init__`` says what it owns and imports):

    room          owns                                                    imports (rooms)
    schedules     schedules as data: who runs which micro-batch when,     -
                  lowered to each rank's actions and messages, simulated,
                  checked against NCCL's rules (pure Python, no torch)
    activations   what a step keeps for backward: micro-batch and layer   -
                  checkpointing, RNG replay, the split backward, the count
    failures      a rank's failure: errors, the watchdog, the listener    schedules
    runtime       one step on one rank: the executor, its messages,       schedules, activations,
                  micro-batches, skips, loss, output, stops               failures
    parameters    a stage's parameters across ranks: partition, dp        runtime
                  buckets and zero shards, ties, partial gradients,
                  clipping, replica checks
    tracing       a traced step written out: Chrome trace, Gantt, table   schedules

`hybridpar.pipe.HybridPipe` assembles them with tensor parallelism, which the pipeline never
imports (what both need is the leaf `hybridpar.sharded`); docs/architecture.md draws the
whole library.
"""
