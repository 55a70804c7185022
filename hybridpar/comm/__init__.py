"""The point-to-point layer between stages, and what ranks agree on:

    module      owns
    p2p         send / receive of a stage's messages, matched by order alone (tag 0, as
                NCCL matches them), their headers of new shapes, the byte counters
    p2p_spec    what a message holds (tensors, dtypes, shapes, tags) and its wire header
    p2p_abort   aborting a receive a failed peer will never answer
    broadcast   a value or an object from one rank to the others
    agreement   a decision all ranks take together (an error raised on every rank)
    stop_request  a stop asked for by a signal, agreed by every rank at a step boundary

Imports `hybridpar.sharded` (tags carried with a message), `pipeline.schedules` (the NCCL
replay's op records) and the leaf modules."""
