"""Files: written crash-safe (`files`: to a temporary name, fsynced, renamed: never a
half-written file) and model weight files read (`weight_files`: safetensors and PyTorch
``.bin`` shards, one tensor at a time, without pickles). A leaf: imports nothing of hybridpar."""
