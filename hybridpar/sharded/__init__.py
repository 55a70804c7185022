"""A sharded tensor, as every room sees it: its parallel-dim tags (`attrs`: which dim of an
activation is split over the tp group, the sequence tag, partial gradients) and the autograd
collectives that move it (`mappings`: copy, reduce, scatter, gather, reduce-scatter along a
dim). A leaf: the pipeline, tensor parallelism and the point-to-point layer all import it,
it imports only `hybridpar.process.compat` and `hybridpar.trace` (the collectives' counters)."""
