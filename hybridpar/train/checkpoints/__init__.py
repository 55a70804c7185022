"""A run's checkpoints on disk: the DCP checkpoint of a step (`checkpoint`: written crash-safe,
resumed, resharded to any layout) and the tensor shards of a consolidated model (`shards`),
which `train.export` writes as one file or a Hugging Face folder. Imports the P2P layer, the
tp shard state and the pipeline's parameters; nothing of the trainer.
"""
