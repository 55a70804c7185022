"""What `apply_tp_plan` and `shard` share: a model's layers, elementwise modules, re-tag hooks,
and the conversion of an Embedding."""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn
from torch.distributed import ProcessGroup

from hybridpar.tensor_parallel.attrs import get_parallel_dim, register_parallel_dim
from hybridpar.tensor_parallel.flow import is_conv1d
from hybridpar.tensor_parallel.layers import ParallelEmbedding, ParallelLinear, RegisterParallelDim
from hybridpar.tensor_parallel.mappings import gather_from_group
from hybridpar.tensor_parallel.state import shard_of

__all__ = ["DECISIONS_ATTR", "ELEMENTWISE", "ExpectShardedOutput", "GatherOutput", "KeepTag",
           "Layers", "RefuseLabels", "TagShardedInput", "is_elementwise",
           "to_parallel_embedding"]

ELEMENTWISE = (nn.ReLU, nn.LeakyReLU, nn.GELU, nn.SiLU, nn.Mish, nn.Tanh, nn.Sigmoid, nn.ELU,
                nn.SELU, nn.CELU, nn.Softplus, nn.Softsign, nn.Hardtanh, nn.Hardswish,
                nn.Hardsigmoid, nn.Tanhshrink, nn.LogSigmoid, nn.Threshold, nn.Dropout,
                nn.Identity)
DECISIONS_ATTR = "_tp_plan_decisions"


# hooks (module-level classes, so deepcopy and pickle keep them) ---------------------------------

class TagShardedInput:
    """Forward pre-hook of a row-parallel layer: an untagged input of width in / tp is a shard."""

    def __call__(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        x = args[0] if args else None
        if isinstance(x, Tensor) and x.dim() > 0 and get_parallel_dim(x) is None and \
                isinstance(module, ParallelLinear) and module.tp_size > 1 and \
                x.shape[-1] == module.in_features // module.tp_size:
            register_parallel_dim(x, -1)


class KeepTag:
    """Forward hook: an output as wide as a sharded input is sharded the same way."""

    def __call__(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        x = args[0] if args else None
        if isinstance(x, Tensor) and isinstance(output, Tensor) and output.dim() > 0 and \
                x.dim() > 0 and get_parallel_dim(x) in (-1, 1) and \
                get_parallel_dim(output) is None and output.shape[-1] == x.shape[-1]:
            register_parallel_dim(output, get_parallel_dim(x))


class GatherOutput:
    """Forward hook of a column layer whose output must be full (HF's colwise_gather_output)."""

    def __call__(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        assert isinstance(module, ParallelLinear)
        full = gather_from_group(output, module.group, dim=-1)
        register_parallel_dim(full, None)
        return full


class RefuseLabels:
    """Forward pre-hook (with kwargs) of a model with class-sharded logits: no labels= loss."""

    def __init__(self, layer: str) -> None:
        self.layer = layer

    def __call__(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
                 ) -> None:
        if kwargs.get("labels") is not None:
            raise ValueError(
                f"tp_plan made '{self.layer}' column-parallel: the logits hold only this "
                f"rank's classes, so a loss the model computes from labels= would be wrong; "
                f"call the model without labels and give its logits (shifted as the model "
                f"would) to hybridpar's ParallelCrossEntropyLoss, or mark '{self.layer}' "
                f"'replicate' in a dict plan")


class ExpectShardedOutput:
    """Forward hook guarding "auto"'s class-sharded logits: the output must still be tagged."""

    def __init__(self, layer: str) -> None:
        self.layer = layer

    def __call__(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if not isinstance(output, Tensor) and isinstance(getattr(output, "logits", None),
                                                         Tensor):
            output = output.logits  # a Hugging Face ModelOutput
        if isinstance(output, Tensor) and get_parallel_dim(output) not in (-1, 1):
            raise RuntimeError(
                f"tp_plan 'auto' made the final Linear '{self.layer}' column-parallel "
                f"(class-sharded logits, tagged -1), but {type(module).__name__} returned an "
                f"untagged tensor: an op after '{self.layer}' dropped the tag and got only this "
                f"rank's classes. Give a dict plan with '{self.layer}': 'replicate', or end "
                f"the model with the Linear and use ParallelCrossEntropyLoss")


def is_elementwise(module: nn.Module) -> bool:
    """A known elementwise module, or a parameter-free one named like HF's activations."""
    if isinstance(module, RegisterParallelDim):
        return module.dim in (-1, 1)
    if isinstance(module, ELEMENTWISE):
        return True
    return type(module).__name__.endswith("Activation") and \
        next(module.parameters(), None) is None and next(module.children(), None) is None


# the model's layers ---------------------------------------------------------------------------

class Layers:
    """Names, parents and sharing of every module inside `root` (registration order)."""

    def __init__(self, root: nn.Module) -> None:
        self.names: list[str] = []
        self.by_name: dict[str, nn.Module] = {}
        names_of: dict[int, list[str]] = {}
        for name, m in root.named_modules(remove_duplicate=False):
            if name:
                self.names.append(name)
                self.by_name[name] = m
                names_of.setdefault(id(m), []).append(name)
        self.names_of = names_of
        owners: dict[int, list[str]] = {}
        for name in self.names:
            for pname, p in self.by_name[name].named_parameters(recurse=False):
                owners.setdefault(id(p), []).append(f"{name}.{pname}")
        self.owners = owners
        mha = [n for n in self.names if isinstance(self.by_name[n], nn.MultiheadAttention)]
        self.in_mha = {n for n in self.names if any(n.startswith(f"{a}.") for a in mha)}

    def describe(self, name: str) -> str:
        m = self.by_name[name]
        if isinstance(m, nn.Linear):
            return f"Linear {m.in_features}->{m.out_features}"
        if is_conv1d(m):
            return f"Conv1D {m.nx}->{m.nf}"
        if isinstance(m, nn.Embedding):
            return f"Embedding {m.num_embeddings}x{m.embedding_dim}"
        return type(m).__name__

    def tied(self, name: str) -> list[str]:
        """The other names of `name`'s weight (a tie), in order; [] if it has none."""
        w = getattr(self.by_name[name], "weight", None)
        if not isinstance(w, nn.Parameter) or id(w) not in self.owners:
            return []
        return [o for o in self.owners[id(w)] if o != f"{name}.weight"]

    def unshardable(self, name: str, *, ignore_ties: bool = False) -> str | None:
        """Why the layer `name` cannot be replaced by a sharded one (None: it can)."""
        m = self.by_name[name]
        if name in self.in_mha:
            return ("it is inside an nn.MultiheadAttention (which reads its weights directly, "
                    "not through the layer)")
        if len(self.names_of[id(m)]) > 1:
            return f"the same module is registered under {self.names_of[id(m)]}"
        for pname, p in m.named_parameters(recurse=False):
            if isinstance(p, nn.parameter.UninitializedParameter):
                return "it has uninitialized (lazy) parameters; run a forward first"
            tied = [o for o in self.owners[id(p)] if o != f"{name}.{pname}"]
            if tied and not (ignore_ties and pname == "weight"):
                return f"its {pname} is tied to {tied}"
        return None


def to_parallel_embedding(old: nn.Embedding, group: ProcessGroup, *,
                          dim: int = 0) -> ParallelEmbedding:
    """A `ParallelEmbedding` (dim 0: vocab, -1: features) holding this rank's slice of `old`."""
    w = old.weight
    new = ParallelEmbedding(old.num_embeddings, old.embedding_dim, old.padding_idx,
                            old.max_norm, old.norm_type, old.scale_grad_by_freq, old.sparse,
                            dim=dim, group=group, device="meta", dtype=w.dtype)
    if not w.is_meta:  # no random number is drawn: the slice of the old values
        new.to_empty(device=w.device)
        new.weight.data.copy_(shard_of(w.detach(), new.weight, group))
    new.weight.requires_grad_(w.requires_grad)
    new.train(old.training)
    return new
