"""Tensor-parallel plans: which layers of a model to shard, and how. Styles by name (hybridpar's
and Hugging Face's), "auto" (the model's forward followed on `meta` tensors: the flow of each
activation's sharded dim, column -> row pairs, the modules between them), per-dimension
strategies, and the hooks that tag and pass shards on. Imports the layers of
`tensor_parallel` (and its `feature` room's TPDense), never the pipeline."""
