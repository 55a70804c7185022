"""What a point-to-point message looks like: its spec, the header that carries it, the book.

What a message looks like (`MessageSpec`: per tensor dtype, shape, parallel-dim tag,
requires_grad, and whether it travels as a 1/tp slice) is agreed once per *signature* of a
step (train or not, the shapes and dtypes of its micro-batches) and kept in a `SpecBook`:

    step            forward-direction message (FWD, SKIP)     backward-direction (BWD, SKIPG)
    new signature   a 1 KiB int64 header, then the payloads   payloads alone: the spec is
                    (the receiver learns the spec)            the forward message's, floating
    known           payloads alone (the sender checks that    tensors only, no grad
                    its tensors still fit the spec)

A spec's dtypes are those of `DTYPES`; between GPUs, those NCCL carries (`NCCL_DTYPES`: not
int16), checked by `check_nccl_dtypes` when a GPU stage sends a message of new shapes.
`hybridpar.comm.p2p` sends and receives the messages these specs describe.
"""

from __future__ import annotations

import zlib
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from hybridpar.sharded.attrs import get_parallel_dim

__all__ = [
    "ABSENT",
    "DTYPES",
    "HEADER_LEN",
    "NCCL_DTYPES",
    "MessageSpec",
    "NCCLDtypeError",
    "SpecBook",
    "TensorSpec",
    "check_nccl_dtypes",
    "decode",
    "header",
    "signature_hash",
    "spec_of",
]

HEADER_LEN = 128
_MAX_NDIM = 8
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
           torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool]
_NO_TAG = 9
# What NCCL carries, as torch's NCCL backend maps dtypes to NCCL's: the `ncclDataType` map of
# torch/csrc/distributed/c10d/ProcessGroupNCCL (collectives) and `to_nccl_data_type` of
# torch/csrc/cuda/nccl.cpp (send / recv) both list int8, uint8, int32, int64, float16,
# float32, float64, bfloat16, bool (sent as uint8) and the float8 types (as uint8). Of
# `DTYPES`, int16 is missing (NCCL has no 16-bit integer): a send of one fails on the GPU with
# "Unconvertible NCCL type" (complex and uint16 / 32 / 64 are not in `DTYPES` at all).
NCCL_DTYPES = frozenset({torch.float32, torch.float64, torch.float16, torch.bfloat16,
                         torch.int64, torch.int32, torch.int8, torch.uint8, torch.bool})
_NCCL_CAST = {torch.int16: torch.int32}   # what to cast a dtype NCCL lacks to


class TensorSpec(NamedTuple):
    """One tensor of a message: what the receiver allocates and how it travels."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    tag: int | None          # parallel-dim tag (None: replicated)
    requires_grad: bool      # the receiver makes it a leaf that requires grad
    scattered: bool          # travels as this tp rank's 1/tp slice of the flattened tensor
    absent: bool = False     # None (a skip stashed as None): nothing travels, None arrives


class MessageSpec(NamedTuple):
    """A message: its tensors, and whether it is one bare Tensor rather than a tuple."""

    tensors: tuple[TensorSpec, ...]
    single: bool

    def grads(self) -> MessageSpec:
        """The message that carries this one's gradients back: its floating tensors."""
        return MessageSpec(tuple(t._replace(requires_grad=False) for t in self.tensors
                                 if t.dtype.is_floating_point), False)


ABSENT = TensorSpec(torch.uint8, (), None, False, False, True)   # a None in a message


def _scatters(t: Tensor, tp: int) -> bool:
    """Whether `t` travels as 1/tp slices: replicated, floating and at least tp elements."""
    return tp > 1 and get_parallel_dim(t) is None and t.is_floating_point() and t.numel() >= tp


def spec_of(tensors: Sequence[Tensor | None], tp: int, *, grads: bool, single: bool
            ) -> MessageSpec:
    """The spec of a message of `tensors` (`grads`: floating ones will require grad; None:
    an absent tensor, as torchgpipe allows for skips)."""
    specs = []
    for t in tensors:
        if t is None:
            specs.append(ABSENT)
            continue
        if t.dtype not in DTYPES:
            raise TypeError(f"cannot send a tensor of dtype {t.dtype} between stages; stage "
                            f"outputs must have one of {', '.join(str(d) for d in DTYPES)} "
                            "(for complex tensors: torch.view_as_real)")
        if t.dim() > _MAX_NDIM:
            raise ValueError(f"cannot send a {t.dim()}-d tensor between stages "
                             f"(at most {_MAX_NDIM} dims)")
        specs.append(TensorSpec(t.dtype, tuple(t.shape), get_parallel_dim(t),
                                grads and t.is_floating_point(), _scatters(t, tp)))
    return MessageSpec(tuple(specs), single)


class NCCLDtypeError(TypeError):
    """A message between stages carries a dtype that NCCL cannot (`NCCL_DTYPES`)."""


def check_nccl_dtypes(spec: MessageSpec, names: Sequence[str], what: str) -> None:
    """Raise `NCCLDtypeError` if a tensor of `spec` has a dtype NCCL cannot carry; `names`
    says what each tensor is (``"output 1 of layer 2 (Embedding)"``), `what` the message."""
    for t, name in zip(spec.tensors, names):
        if t.absent or t.dtype in NCCL_DTYPES:
            continue
        cast = _NCCL_CAST.get(t.dtype, torch.int64)
        carried = ", ".join(str(d).removeprefix("torch.") for d in DTYPES if d in NCCL_DTYPES)
        raise NCCLDtypeError(
            f"{what}: {name} is {t.dtype}, which NCCL cannot carry between GPUs (torch's NCCL "
            f"backend has no {str(t.dtype).removeprefix('torch.')}; it carries {carried}); "
            f"return it as another dtype from that layer, e.g. .to({cast}), and cast it back "
            "in the next stage if it must be")


def _encode(spec: MessageSpec, signature: int) -> list[int]:
    """Header slots: [signature, count, single, (dtype, tag, grad, how, ndim, *shape)...], how
    = 0 whole, 1 scattered, 2 absent."""
    values = [signature, len(spec.tensors), int(spec.single)]
    for t in spec.tensors:
        how = 2 if t.absent else int(t.scattered)
        values += [DTYPES.index(t.dtype), _NO_TAG if t.tag is None else t.tag,
                   int(t.requires_grad), how, len(t.shape), *t.shape]
    return values


def header(spec: MessageSpec, signature: int, device: torch.device) -> Tensor:
    """The 1 KiB int64 header that describes `spec` (sent on a new signature only)."""
    values = _encode(spec, signature)
    if len(values) > HEADER_LEN:
        raise ValueError(f"a stage boundary of {len(spec.tensors)} tensors does not fit the "
                         f"{HEADER_LEN}-slot header; pass fewer tensors between stages")
    return torch.tensor(values + [0] * (HEADER_LEN - len(values)), dtype=torch.int64,
                        device=device)


def decode(header: Tensor) -> tuple[MessageSpec, int]:
    """The spec a header describes, and the signature of the sender's step."""
    values = header.tolist()   # a host read: headers travel only on a new signature
    signature, count, single = values[:3]
    specs, pos = [], 3
    for _ in range(count):
        dtype, tag, grad, how, ndim = values[pos:pos + 5]
        shape = tuple(values[pos + 5:pos + 5 + ndim])
        pos += 5 + ndim
        specs.append(TensorSpec(DTYPES[dtype], shape, None if tag == _NO_TAG else tag,
                                bool(grad), how == 1, how == 2))
    return MessageSpec(tuple(specs), bool(single)), signature


def signature_hash(signature: Hashable) -> int:
    """A hash of a step signature that is the same in every process (no PYTHONHASHSEED)."""
    return zlib.crc32(repr(signature).encode())


class SpecBook:
    """The agreed specs of each step signature seen lately: {(channel, peer, mb): spec}.

    Both ends of every channel see the same signatures in the same order and commit a step's
    specs only when it completes, so their books agree. The `capacity` most recently used
    signatures are kept (a run whose shapes change every step negotiates every step).
    """

    def __init__(self, capacity: int = 32) -> None:
        self.capacity = capacity
        self._book: OrderedDict[Hashable, dict[tuple[int, int, int], MessageSpec]] = \
            OrderedDict()

    def get(self, signature: Hashable) -> dict[tuple[int, int, int], MessageSpec] | None:
        specs = self._book.get(signature)
        if specs is not None:
            self._book.move_to_end(signature)
        return specs

    def commit(self, signature: Hashable, specs: dict[tuple[int, int, int], MessageSpec]
               ) -> None:
        self._book[signature] = specs
        self._book.move_to_end(signature)
        while len(self._book) > self.capacity:
            self._book.popitem(last=False)

    def clear(self) -> None:
        self._book.clear()
