"""A rank's failure, told on every rank: the error types, the watchdog that names a stuck
operation, the listener that stops a stage when a peer failed. Imports `schedules` (actions)
and the leaf modules (`hybridpar.comm.p2p`)."""
