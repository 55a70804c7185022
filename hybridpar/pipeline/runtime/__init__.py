"""One step on one rank: the executor running the rank's actions, the messages between stages,
micro-batches, skip connections, the loss and output, deferred BatchNorm, virtual stages, the
stops after a failure. Imports `schedules`, `activations`, `failures`, the leaf modules, and
`tensor_parallel`'s parallel-dim tags and output gather."""
