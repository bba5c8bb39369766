"""RMSNorm in one pass (templates/rms_norm.py.jinja): op `rms_norm`, what `fuse(model)` runs in place of a
Hugging Face model's RMSNorm modules (norm.FusedRMSNorm). Eager PyTorch spends about ten launches on one
(float, pow, mean, add, rsqrt, mul, ...), each paying its host time at decode. A pass over memory with one
whole row per tile: nothing to tune.

The op's "activation" names the weight form, the one thing its source varies in besides dtypes:
- "weight": w * round(x_hat), x_hat rounded to the input's dtype first (Llama, Mistral, Qwen, T5);
- "one_plus_weight": (x_hat * (1 + w)) rounded once, in float32 (Gemma);
with x_hat = x / sqrt(mean(x^2) + eps) in float32.
"""

from __future__ import annotations

import torch

from .. import launch as L
from ..configs import KernelConfig
from ..device import interpreting
from ..opspec import Operand, OpSpec
from ..render import KernelSpec, load_kernel

FORMS = ("weight", "one_plus_weight")
# Widest row the kernel holds in one tile; wider rows run the eager form (norm.FusedRMSNorm).
MAX_N = 16384

OPERANDS = (
    Operand("x", "[M, N]: the rows to normalise", "mn"),
    Operand("w", "[N]: the weight"),
    Operand("y", "[M, N]", "mn"),
)


def _normalized(x: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def eager_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, form: str) -> torch.Tensor:
    """The form as the Hugging Face modules write it, op for op (fuse() checks a module against these)."""
    if form == "one_plus_weight":
        return (_normalized(x, eps) * (1.0 + weight.float())).type_as(x)
    return weight * _normalized(x, eps).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, form: str, out: torch.Tensor | None = None
             ) -> torch.Tensor:
    """RMSNorm of each row of x ([M, N], any strides) with `weight` ([N]) in one launch; written into `out`
    ([M, N]) when given."""
    L.require(x.dim() == 2 and weight.shape == (x.shape[1],) and weight.dtype == x.dtype
              and weight.device == x.device and weight.is_contiguous(),
              lambda: f"rms_norm: x must be [M, N] and the weight [N] alike, got {tuple(x.shape)} {x.dtype} and "
              f"{tuple(weight.shape)} {weight.dtype}")
    M, N = x.shape
    L.require(N <= MAX_N, lambda: f"rms_norm: rows of {N} exceed the kernel's {MAX_N}")
    y = L.output(out, (M, N), x)
    if M and N:
        kernel = load_kernel(KernelSpec(RMS_NORM, form, upcast_operands=interpreting()))
        block_n = 1 << (N - 1).bit_length()  # the next power of two
        # About 4096 elements a program: decode's one row runs in one program; wide rows keep 16 per thread.
        block_m = max(1, min(16, 4096 // block_n))
        warps = max(1, min(16, block_m * block_n // 512))
        L.launch(kernel, (-(-M // block_m),), {"x": x, "w": weight, "y": y}, (M, N),
                 dict(BLOCK_M=block_m, BLOCK_N=block_n, EPS=float(eps), num_warps=warps))
    return y


def _run(ops: dict, activation: str, config: KernelConfig, out: torch.Tensor | None = None) -> torch.Tensor:
    return rms_norm(ops["x"], ops["w"], ops["eps"], activation, out=out)


def _eager(ops: dict, activation: str) -> torch.Tensor:
    return eager_rms_norm(ops["x"], ops["w"], ops["eps"], activation)


def _reference(ops: dict, activation: str, dtype: torch.dtype) -> torch.Tensor:
    x, w = ops["x"].double(), ops["w"].double()
    x_hat = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + ops["eps"])
    return x_hat * (1.0 + w) if activation == "one_plus_weight" else x_hat * w


RMS_NORM = OpSpec(
    name="rms_norm",
    template="rms_norm",
    doc="RMSNorm over whole rows in one pass, Llama or Gemma weight form (fuse(model); nothing to tune)",
    operands=OPERANDS,
    activations=FORMS,
    run=_run,
    sizes=("M", "N"),
    constexprs=("BLOCK_M", "BLOCK_N", "EPS"),
    library={"eager": _eager},
    reference=_reference,
)
