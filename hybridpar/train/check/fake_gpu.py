"""The fake GPU of a dry run: PrivateUse1 as ``fakegpu``, its bf16 autocast, FakeFunctions,
and `FakeCuda`, the CUDA runtime its branches call.

On a CPU-only build of torch, FakeTensorMode makes `cuda` tensors, but autograd on them cannot
run: the build registers no CUDA device guard (`torch._C._ensureCUDADeviceGuardSet` patches
CUDA builds without a GPU only), and with one put in place by hand autograd's stream logic
still asks for the accelerator, which is CUDA only when torch's CUDA hooks (libtorch_cuda)
say so (``Cannot access accelerator device when none is available``; with a PrivateUse1
accelerator registered instead, ``opt_ready_stream && opt_parent_stream INTERNAL ASSERT`` in
the engine). So the fake GPU is torch's PrivateUse1 device registered as ``fakegpu``: a
device guard and hooks, no kernels, every op computed by FakeTensorMode. hybridpar's
CUDA-only branches read `hybridpar.device.is_cuda`, which counts ``fakegpu`` as CUDA while a
dry run runs (`device.standing_in`), so they run as on a GPU; their CUDA calls go to
`FakeCuda`. The registration lasts for the process (`torch.accelerator` then reports the
device), which is why `hybridpar.train.check.dry_run` runs in a child process by default.
bf16 autocast on it casts as CUDA's autocast does where memory is concerned (matmuls,
convolutions and attention in bf16; softmax, norms, losses, reductions in fp32; weight casts
cached for the step). `FakeFunctions` fills the gaps of FakeTensorMode listed in its
docstring.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

from hybridpar.device import Cuda

__all__ = ["STANDIN", "FakeCuda", "FakeFunctions", "clear_cast_cache", "fake_gpu"]

STANDIN = "fakegpu"   # the PrivateUse1 name of the fake GPU


def fake_gpu() -> str:
    """Register the fake GPU (PrivateUse1 as ``fakegpu``, with bf16 autocast) once; its
    device type."""
    name = torch._C._get_privateuse1_backend_name()
    if name == STANDIN:
        return STANDIN
    if name != "privateuseone":
        raise RuntimeError(f"this process already uses PrivateUse1 as {name!r}; run the dry "
                           "run in its own process (dry_run(..., isolate=True))")
    from torch.utils.backend_registration import (
        _DummyBackendModule,
        _setup_privateuseone_for_python_backend,
    )

    class Module(_DummyBackendModule):
        def get_amp_supported_dtype(self) -> list[torch.dtype]:
            return [torch.float16, torch.bfloat16]

    _setup_privateuseone_for_python_backend(rename=STANDIN, backend_module=Module())
    _register_autocast()
    return STANDIN


# CUDA autocast's op lists (autocast_mode.cpp), the part that shapes memory
_LOWER = ("mm", "bmm", "addmm", "baddbmm", "addbmm", "matmul", "linear", "mv", "addmv",
          "einsum", "conv1d", "conv2d", "conv3d", "convolution", "conv_transpose1d",
          "conv_transpose2d", "conv_transpose3d", "prelu", "scaled_dot_product_attention")
_FP32 = ("softmax", "log_softmax", "layer_norm", "native_layer_norm", "group_norm", "nll_loss",
         "nll_loss_nd", "nll_loss2d", "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss",
         "binary_cross_entropy_with_logits", "kl_div", "exp", "expm1", "log", "log1p", "log2",
         "log10", "reciprocal", "rsqrt", "pow", "softplus", "logsumexp", "cumsum", "cumprod",
         "prod", "sum", "norm", "linalg_vector_norm", "cosine_similarity", "cdist", "renorm")
_LIBRARY: list[Any] = []
_CAST_CACHE: dict[int, tuple[Tensor, Tensor]] = {}


def _register_autocast() -> None:
    """Autocast kernels for the fake GPU: CUDA's casts of the ops above, others fall through."""
    everything, lib = torch.library.Library("_", "IMPL"), torch.library.Library("aten", "IMPL")
    _LIBRARY.extend((everything, lib))   # registrations live as long as the library objects
    everything.fallback(torch.library.fallthrough_kernel, dispatch_key="AutocastPrivateUse1")
    for names, lower in ((_LOWER, True), (_FP32, False)):
        for name in names:
            packet = getattr(torch.ops.aten, name, None)
            for overload in packet.overloads() if packet is not None else ():
                if "out" in overload:
                    continue
                op = getattr(packet, overload)
                qualified = name if overload == "default" else f"{name}.{overload}"
                lib.impl(qualified, _autocast_kernel(op, lower), "AutocastPrivateUse1")


def _autocast_kernel(op: Any, lower: bool) -> Callable[..., Any]:
    key = torch._C.DispatchKey.AutocastPrivateUse1   # type: ignore[attr-defined]
    keys = torch._C.DispatchKeySet(key)

    def cast(a: Any) -> Any:
        if not isinstance(a, Tensor) or not a.is_floating_point() or a.device.type != STANDIN:
            return a
        target = torch.get_autocast_dtype(STANDIN) if lower else torch.float32
        if a.dtype in (target, torch.float64) or (not lower and a.dtype == torch.float32):
            return a
        cacheable = lower and a.is_leaf and a.requires_grad and \
            torch.is_autocast_cache_enabled()
        if cacheable and id(a) in _CAST_CACHE and _CAST_CACHE[id(a)][0] is a:
            return _CAST_CACHE[id(a)][1]
        out = a.to(target)
        if cacheable:
            _CAST_CACHE[id(a)] = (a, out)
        return out

    def kernel(*args: Any, **kwargs: Any) -> Any:
        with torch._C._ExcludeDispatchKeyGuard(keys):
            args = tuple(cast(a) if not isinstance(a, (list, tuple)) else
                         type(a)(cast(b) for b in a) for a in args)
            return op(*args, **{k: cast(v) for k, v in kwargs.items()})

    return kernel


def clear_cast_cache() -> None:
    """Forget the weight casts of the step that ended (autocast clears its cache so)."""
    _CAST_CACHE.clear()


class FakeFunctions(torch.overrides.TorchFunctionMode):
    """What FakeTensorMode needs on top, at the torch-function level:

        call                            does
        ops on real tensors only        run for real (RNG states are real CPU tensors)
        torch.tensor(..., fake GPU)     made on the CPU, then moved (no fake-GPU kernels)
        Tensor.detach                   its result leaves FakeTensorMode's memo (a weak
                                        reference there stops Module.to swapping params)
        Tensor.data_ptr of a fake       a zero byte (comm's abort check reads one on CPU)
        copy.deepcopy of a fake         a copy in the same FakeTensorMode (torch's would
                                        copy the mode too: a double free, see below)
        scaled_dot_product_attention    CUDA's fused kernels (`_attention`), not the math one
        an op moving a small constant   run without the constant (FakeTensorMode computes
        to the fake GPU                 constants for real; the fake GPU has no kernels)
    """

    _ZERO = torch.zeros(8, dtype=torch.uint8)

    def __init__(self, mode: Any) -> None:
        super().__init__()
        self.memo = mode.fake_tensor_converter.meta_converter.tensor_memo

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is Tensor.data_ptr and isinstance(args[0], FakeTensor):
            return self._ZERO.data_ptr()
        if func is Tensor.__deepcopy__ and isinstance(args[0], FakeTensor):
            # the copy shares the mode: torch deep-copies a FakeTensor's __dict__, its
            # FakeTensorMode included, and with it the StorageWeakRef keys of the constants
            # the mode computed (`constant_storage_mapping`): each copy holds the same raw
            # weak reference (an int), both free it, and the storage's memory is freed while
            # in use ("free(): invalid next size" later, anywhere). Hugging Face models meet
            # it in `hf.sequential`, which deep-copies the rotary embedding for each block.
            args[1].setdefault(id(args[0].fake_mode), args[0].fake_mode)
            return func(*args, **kwargs)
        if func is F.scaled_dot_product_attention and isinstance(args[0], FakeTensor) and \
                args[0].device.type == STANDIN:
            return _attention(*args, **kwargs)
        if func in (torch.tensor, torch.as_tensor) and _on_standin(kwargs.get("device")):
            device = kwargs.pop("device")
            return func(*args, **kwargs, device="cpu").to(device)
        real = False
        for a in (*args, *kwargs.values()):
            for b in a if isinstance(a, (list, tuple)) else (a,):
                if isinstance(b, FakeTensor) or _on_standin(b):
                    break
                real = real or isinstance(b, Tensor)
            else:
                continue
            break
        else:
            if real:   # only real tensors, nothing for the fake GPU: run it for real
                with unset_fake_temporarily():
                    return func(*args, **kwargs)
        try:
            out = func(*args, **kwargs)
        except NotImplementedError as e:   # FakeTensorMode ran it on a constant's real data
            constants = [a for a in (*args, *kwargs.values())
                         if isinstance(a, FakeTensor) and a.constant is not None]
            if f"'{STANDIN}' backend" not in str(e) or not constants:
                raise
            saved = [a.constant for a in constants]
            for a in constants:
                a.constant = None
            try:
                out = func(*args, **kwargs)
            finally:
                for a, constant in zip(constants, saved):
                    a.constant = constant
        if func is Tensor.detach:
            for key in [k for k, v in self.memo.items() if v is out]:
                del self.memo[key]
        return out


class FakeCuda(Cuda):
    """`hybridpar.device.cuda()` in a dry run: the CUDA calls of hybridpar's GPU branches
    without CUDA, and how often each branch was taken (`hits`).

        call                    does
        available, initialized  True: there is a GPU, it has started
        RNG state get / set     a 16-byte state per device (a CUDA Philox state's size),
                                kept on the CPU; manual_seed writes the seed into it
        pin                     the tensor as it is (no page-locked memory without CUDA)
        event                   an event that has completed when recorded
    """

    def __init__(self) -> None:
        self.hits: Counter[str] = Counter()
        self.states: dict[int, Tensor] = {}

    def reached(self, branch: str) -> None:
        self.hits[branch] += 1

    def available(self) -> bool:
        return True

    def initialized(self) -> bool:
        return True

    def current_device(self) -> int:
        return 0

    def _index(self, device: int | str) -> int:
        return device if isinstance(device, int) else torch.device(device).index or 0

    def get_rng_state(self, device: int | str = "cuda") -> Tensor:
        with unset_fake_temporarily():   # a real CPU tensor, as torch.cuda's
            index = self._index(device)
            if index not in self.states:
                self.states[index] = torch.zeros(16, dtype=torch.uint8)
            return self.states[index].clone()

    def set_rng_state(self, state: Tensor, device: int | str = "cuda") -> None:
        if state.dtype != torch.uint8 or state.shape != (16,):
            raise TypeError(f"a CUDA RNG state is a (16,) uint8 tensor, got {state.dtype} "
                            f"{tuple(state.shape)}")
        with unset_fake_temporarily():
            self.states[self._index(device)] = state.clone()

    def manual_seed(self, seed: int) -> None:
        with unset_fake_temporarily():
            self.states[0] = torch.tensor([seed, 0], dtype=torch.int64).view(torch.uint8)

    def get_rng_state_all(self) -> list[Tensor]:
        return [self.get_rng_state(0)]

    def set_rng_state_all(self, states: Sequence[Tensor]) -> None:
        for index, state in enumerate(states):
            self.set_rng_state(state, index)

    def pin(self, t: Tensor) -> Tensor:
        if t.device.type != "cpu":
            raise RuntimeError(f"cannot pin a tensor on {t.device}: only CPU tensors can be")
        return t

    def event(self, *, timing: bool = False) -> Any:
        return _DoneEvent()


class _DoneEvent:
    """A CUDA event of a dry run: complete as soon as recorded, 0 ms from any other."""

    def record(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def elapsed_time(self, end: Any) -> float:
        return 0.0


def _attention(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None = None,
               dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
               enable_gqa: bool = False) -> Tensor:
    """`F.scaled_dot_product_attention` as CUDA runs it: the flash kernel (fp16 / bf16, no
    mask) or the memory-efficient one, which save O(T) per head, not the math kernel's
    (B, h, T, T) probabilities, which a device without fused kernels would fall back to."""
    if torch.is_autocast_enabled(STANDIN):   # attention is on autocast's lower-precision list
        low = torch.get_autocast_dtype(STANDIN)
        q, k, v = (t.to(low) if t.dtype == torch.float32 else t for t in (q, k, v))
    grads = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    if enable_gqa or q.dim() != 4 or q.shape[1] != k.shape[1] or \
            q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal,
                                              scale=scale, enable_gqa=enable_gqa)
    if attn_mask is None and q.dtype != torch.float32 and q.shape[-1] <= 256:
        return torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, dropout_p, is_causal, False, scale=scale)[0]
    if attn_mask is not None and attn_mask.dtype == torch.bool:   # as CUDA: a float bias
        attn_mask = torch.zeros(attn_mask.shape, dtype=q.dtype, device=q.device) \
            .masked_fill(~attn_mask, float("-inf"))
    return torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, attn_mask, grads, dropout_p, is_causal, scale=scale)[0]


def _on_standin(device: Any) -> bool:
    if isinstance(device, str):
        return device.split(":")[0] == STANDIN
    return isinstance(device, torch.device) and device.type == STANDIN
