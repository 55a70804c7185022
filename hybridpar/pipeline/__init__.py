"""Pipeline parallelism: partitioning, schedules, checkpointing, skips and the executor."""
