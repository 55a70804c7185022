"""Files: written crash-safe (`files`: to a temporary name, fsynced, renamed: never a
half-written file) and model weight files read (`weight_files`: safetensors and PyTorch
``.bin`` shards, one tensor at a time, without pickles) and checked (`weight_checks`: no
integer or bool into float weights, no NaN or inf), a folder written whole or not at all
(`staged`), and a run directory held by one run at a time (`run_lock`). A leaf: imports
nothing of hybridpar."""
