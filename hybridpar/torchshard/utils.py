"""torchshard's ``utils``: divisibility helpers and the vocabulary ranges of a split."""

from __future__ import annotations

__all__ = ["VocabUtility", "check_divisibility", "divide"]


def check_divisibility(numerator: int, denominator: int) -> None:
    """Raise `ValueError` unless `denominator` divides `numerator`."""
    if numerator % denominator:
        raise ValueError(f"{numerator} is not divisible by {denominator}")


def divide(numerator: int, denominator: int) -> int:
    """`numerator / denominator`, which must divide exactly."""
    check_divisibility(numerator, denominator)
    return numerator // denominator


class VocabUtility:
    """The [first, last) vocabulary indices of a rank's equal slice."""

    @staticmethod
    def vocab_range_from_per_partition_vocab_size(per_partition_vocab_size: int, rank: int,
                                                  world_size: int) -> tuple[int, int]:
        first = rank * per_partition_vocab_size
        return first, first + per_partition_vocab_size

    @staticmethod
    def vocab_range_from_global_vocab_size(global_vocab_size: int, rank: int,
                                           world_size: int) -> tuple[int, int]:
        per = divide(global_vocab_size, world_size)
        return VocabUtility.vocab_range_from_per_partition_vocab_size(per, rank, world_size)
