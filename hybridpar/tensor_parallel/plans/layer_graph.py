"""A model's layers as a plan sees them: names, sharing, ties, and the elementwise modules."""

from __future__ import annotations

from torch import nn

from hybridpar.tensor_parallel.embedding import carried_forward
from hybridpar.tensor_parallel.layers import RegisterParallelDim
from hybridpar.tensor_parallel.plans.flow_ops import is_conv1d

__all__ = ["DECISIONS_ATTR", "ELEMENTWISE", "Layers", "is_elementwise"]

ELEMENTWISE = (nn.ReLU, nn.LeakyReLU, nn.GELU, nn.SiLU, nn.Mish, nn.Tanh, nn.Sigmoid, nn.ELU,
                nn.SELU, nn.CELU, nn.Softplus, nn.Softsign, nn.Hardtanh, nn.Hardswish,
                nn.Hardsigmoid, nn.Tanhshrink, nn.LogSigmoid, nn.Threshold, nn.Dropout,
                nn.Identity)
DECISIONS_ATTR = "_tp_plan_decisions"


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
        if isinstance(m, nn.Embedding) and carried_forward(m) is not None:
            return carried_forward(m)
        if isinstance(m, nn.Linear) and type(m).forward is not nn.Linear.forward:
            return (f"its class {type(m).__name__} overrides nn.Linear's forward, which a "
                    "ParallelLinear would not do")
        for pname, p in m.named_parameters(recurse=False):
            if isinstance(p, nn.parameter.UninitializedParameter):
                return "it has uninitialized (lazy) parameters; run a forward first"
            tied = [o for o in self.owners[id(p)] if o != f"{name}.{pname}"]
            if tied and not (ignore_ties and pname == "weight"):
                return f"its {pname} is tied to {tied}"
        return None
