"""What a step keeps for backward: micro-batch checkpointing and its RNG replay, checkpointing
per layer and of the attention core, the split backward (I now, W later) and the byte count of
what is kept. Imports nothing of hybridpar outside this room (and the leaf `hybridpar.recompute`
hands it in: models never import the pipeline)."""
