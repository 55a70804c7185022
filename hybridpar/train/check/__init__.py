"""`hybridpar check`: the first training steps of every rank, dry-run on fake GPUs or CPU ranks.

    module      owns
    run         `dry_run` (in a child process by default), the command line
    ranks       every rank's steps under FakeTensorMode, in stage order
    setup       what is set up around the ranks: the balance, the process state, --model
    shapes      the shape pass: each stage's inputs known before its rank runs
    memory      bytes per rank: held state, activations, the live peak, traffic
    fake_gpu    the fake GPU (PrivateUse1) and the CUDA runtime its branches call
    failure     a failure named by rank, layer and code line (`CheckError`)

Imports the training layer (configs, the model build, the trainer's step) and below it.
"""

from hybridpar.train.check.failure import CheckError
from hybridpar.train.check.memory import CheckReport, RankReport
from hybridpar.train.check.run import add_parser, dry_run, main

__all__ = ["CheckError", "CheckReport", "RankReport", "add_parser", "dry_run", "main"]
