"""The pipe, `HybridPipe`: an nn.Sequential run as a multi-process pipeline of tensor-sharded
stages, one class in three modules by job:

    module       owns
    hybrid       `HybridPipe`: building this rank's stages (tp plan, balance, ties, buckets,
                 executors) and the views of them
    steps        `train_step`, `eval_step`, `forward`: the schedule run on this rank, traced,
                 watched and guarded
    parameters   the collective jobs on the parameters: consolidated state dicts, clipping,
                 ZeRO-2's owners, the replica check
    build        a model made ready for its stages: the tp plan applied, routes, timeouts
    consolidate  the full state dict gathered from tp shards and stages, and loaded back
    token_mean   `TokenMean`: a loss_fn whose step loss is the mean over every counted token
                 of the global batch (labels ignored by a loss mask or padding)

The assembly: imports the pipeline's rooms, tensor parallelism and the leaves.
"""

from hybridpar.pipe.hybrid import HybridPipe
from hybridpar.pipe.token_mean import TokenMean

__all__ = ["HybridPipe", "TokenMean"]
