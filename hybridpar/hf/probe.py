"""The parity probe: a family trains only if `to_sequential` equals the model's own forward.

`to_sequential` cuts a decoder by its plans and re-creates what Hugging Face's forward does
around the modules (masks, rotary tables, glue). A family it has never seen could differ in
something no plan says (a scale, a mask rule): the probe finds out before any training.

    1. shrink the config: the first layer of each distinct per-layer pattern (layer types,
       no-rope flags; 2 layers at least), width 64 (4 query heads of 16, 2 key-value heads
       where the model groups them), vocabulary 128, a sliding window of 4 where it has one:
       the same flags, so the same code paths, at a tiny size
    2. build the class from it in float64, every parameter and buffer moved off its
       initial value by a seeded draw (a unit norm weight would hide a missing factor)
    3. run HF's forward and the converted Sequential on the same 2 x 12 ids; compare, layer
       by layer, the embedding's output (HF: the first block's input), each block's output,
       the final norm's and the logits

Exact means every difference <= 1e-10; otherwise `ProbeError` names the first layer that
differs and by how much. `hybridpar run` / `check` probe each ``hf:`` model (``model.verify =
false`` skips it); the cost is a tiny model's build and one forward, reported in the log.
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from hybridpar.hf.glue import GLUE, Glue
from hybridpar.hf.structure import config_value, num_layers, structure_of

__all__ = ["TOLERANCE", "ProbeError", "ProbeResult", "probe", "shrunk_config"]

TOLERANCE = 1e-10
_WIDTH, _HEADS, _HEAD_DIM, _VOCAB, _WINDOW, _TOKENS = 64, 4, 16, 128, 4, 12


class ProbeError(ValueError):
    """A converted model whose output differs from the Hugging Face model's own."""


@dataclass(frozen=True)
class ProbeResult:
    """What the probe compared: the model type, layers, the largest difference, its cost."""

    model_type: str
    layers: int
    max_difference: float
    seconds: float


def shrunk_config(config: Any) -> Any:
    """A copy of `config` at the probe's tiny size, with its per-layer patterns kept."""
    small = copy.deepcopy(config)
    count = num_layers(config)
    per_layer = {k: v for k, v in small.to_dict().items()
                 if isinstance(v, list | tuple) and len(v) == count and count > 1}
    signatures = [tuple(repr(v[i]) for v in per_layer.values()) for i in range(count)]
    keep = sorted({signatures.index(s) for s in signatures})
    if len(keep) < 2:
        keep = list(range(min(count, 2)))
    for key, values in per_layer.items():
        setattr(small, key, type(values)(values[i] for i in keep))
    small.num_hidden_layers = len(keep)
    heads = config_value(config, "num_attention_heads")
    kv = config_value(config, "num_key_value_heads", default=heads)
    sizes = {"hidden_size": _WIDTH, "num_attention_heads": _HEADS,
             "num_key_value_heads": _HEADS // 2 if kv is not None and kv < heads else _HEADS,
             "head_dim": _HEAD_DIM, "intermediate_size": 2 * _WIDTH, "vocab_size": _VOCAB}
    for key, value in sizes.items():
        if config_value(config, key) is not None:
            with contextlib.suppress(AttributeError):   # a derived property (Falcon's head_dim)
                setattr(small, key, value)
    if config_value(config, "sliding_window") is not None:
        small.sliding_window = min(int(config.sliding_window), _WINDOW)
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        ids = getattr(small, key, None)
        if any(i >= _VOCAB for i in (ids if isinstance(ids, list) else [ids]) if i is not None):
            setattr(small, key, None)
    return small


def probe(config: Any, *, glue: Sequence[Glue] = GLUE, tolerance: float = TOLERANCE
          ) -> ProbeResult:
    """Check that `to_sequential` of `config`'s class equals its forward (`ProbeError` if not).

    `config` is a Hugging Face config (or a model: its config); `glue` the registry
    `to_sequential` uses (`hf.glue.GLUE`).
    """
    from hybridpar.hf.sequential import to_sequential

    start = time.perf_counter()
    config = getattr(config, "config", config)
    parts = structure_of(config)
    small = shrunk_config(config)
    if hasattr(small, "_experts_implementation"):   # HF's reference: its per-expert loop (the
        small._experts_implementation = "eager"      # grouped kernels take no float64)
    import transformers

    generator = torch.Generator().manual_seed(0)
    try:
        with torch.device("cpu"):
            model = getattr(transformers, parts.causal_lm)(small).to(torch.float64).eval()
    except Exception as e:          # the class refuses the shrunk config: say which
        raise ProbeError(f"the parity probe could not build {parts.causal_lm} at its tiny size "
                         f"({type(e).__name__}: {e}); set model.verify = false to skip it"
                         ) from e
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if tensor.is_floating_point() and "inv_freq" not in name:
                tensor.add_(torch.randn(tensor.shape, generator=generator,
                                        dtype=tensor.dtype) * 0.1)
    ids = torch.randint(0, small.vocab_size, (2, _TOKENS), generator=generator)
    try:
        theirs = _hf_outputs(model, parts, ids)
        sequential = to_sequential(model, glue=glue)
        ours: list[Tensor] = []
        with torch.no_grad():
            x: Any = ids
            for layer in sequential:
                x = layer(x)
                ours.append(x[0] if isinstance(x, tuple) else x)   # (hidden, what travels)
    except ValueError:
        raise
    except Exception as e:          # a block that needs what the Sequential does not give
        raise ProbeError(f"{parts.causal_lm} converted does not run as its own forward does "
                         f"({type(e).__name__}: {e}): its blocks need inputs hybridpar.hf "
                         "does not make (refused; model.verify = false skips the check)") from e
    count = small.num_hidden_layers
    worst = 0.0
    for index, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        difference = (a - b).abs().max().item() if a.shape == b.shape else float("inf")
        if not difference <= tolerance:
            what = ("the input layer" if index == 0 else f"block {index - 1}" if index <= count
                    else "the final norm" if index == count + 1 else "the head (logits)")
            raise ProbeError(
                f"{parts.causal_lm} converted is not its own forward: layer {index} ({what}) "
                f"differs by {difference:.3g} (> {tolerance:g}) from Hugging Face's, on a "
                f"{count}-layer float64 copy of its config. hybridpar.hf misses something "
                f"this family does (glue outside its modules, a mask rule): it is refused "
                f"rather than trained differently (model.verify = false skips the check)")
        worst = max(worst, difference)
    return ProbeResult(parts.model_type, count, worst, time.perf_counter() - start)


def _hf_outputs(model: nn.Module, parts: Any, ids: Tensor) -> list[Tensor]:
    """HF's forward on `ids`: the first block's input, each block's output, the norm's, the
    logits."""
    trunk = getattr(model, parts.base)
    blocks = list(getattr(trunk, parts.layers))
    seen: list[Tensor] = []

    def block_input(_m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        seen.append(kwargs["hidden_states"] if "hidden_states" in kwargs else args[0])

    def output(_m: nn.Module, _args: Any, out: Any) -> None:
        seen.append(out[0] if isinstance(out, tuple) else out)

    hooks = [blocks[0].register_forward_pre_hook(block_input, with_kwargs=True)]
    hooks += [b.register_forward_hook(output) for b in blocks]
    hooks.append(getattr(trunk, parts.norm).register_forward_hook(output))
    try:
        with torch.no_grad():
            logits = model(input_ids=ids, use_cache=False).logits
    finally:
        for hook in hooks:
            hook.remove()
    return [*seen, logits]

