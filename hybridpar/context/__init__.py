"""Context parallelism: a sequence split over the cp ranks (load-balanced for causal masks),
and attention of each rank's queries over the whole sequence."""

from hybridpar.context.attention import context_attention, visible
from hybridpar.context.split import sequence_index, split_sequence, unsplit_sequence

__all__ = ["context_attention", "sequence_index", "split_sequence", "unsplit_sequence",
           "visible"]
