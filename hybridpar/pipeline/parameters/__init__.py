"""A stage's parameters across ranks: building a stage from the model, partitioning, the dp
gradient buckets and zero shards, tied and partial gradients, clipping, consolidated state
dicts, the replica check. Imports `runtime`, `tensor_parallel` (plans, shard state) and `hf`
(a Hugging Face model's own tp plan)."""
