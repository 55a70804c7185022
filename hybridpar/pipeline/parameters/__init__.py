"""A stage's parameters across ranks: partitioning and materializing a (meta-built) model,
the dp gradient buckets and zero shards, tied and partial gradients, clipping by the global
norm, the replica check. Imports `runtime`, `hybridpar.sharded` (tags) and the leaf modules;
applying a tp plan and consolidating state are the pipe's (`hybridpar.pipe.build`,
`hybridpar.pipe.consolidate`)."""
