"""Each row of X quantized to float8_e4m3fn with a float32 scale (templates/quantize_rows.py.jinja): op
`quantize_rows`, what the W8A8 ops' library paths run before torch._scaled_mm, in one launch where PyTorch's
ops take six (float, abs, amax, where, divide and clamp, cast), each a pass over the rows in float32. The
values are linear_fp8.quantize_fp8's (under the interpreter a zero may lose its sign): the scale is the row's largest
magnitude over 448 (e4m3's largest finite value), computed in float32, the quotient rounded to nearest even. A pass
over memory: nothing to tune."""

from __future__ import annotations

import torch

from .. import launch as L
from ..configs import KernelConfig
from ..device import interpreting
from ..opspec import Operand, OpSpec
from ..render import KernelSpec, load_kernel
from .linear_fp8 import FP8, quantize_fp8

OPERANDS = (
    Operand("x", "[M, N]: the rows to quantize", "mn"),
    Operand("q", "[M, W] float8_e4m3fn: the quantized rows, zeros past N", "mn"),
    Operand("s", "[M] float32: each row's scale", "m"),
)


def launch_quantize_rows(x: torch.Tensor, width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(X8, s) of x ([M, N], any strides, float32, float16 or bfloat16) in one launch: X8 [M, width] float8_e4m3fn
    (width >= N, N by default; zeros past N, what a weight's zero padding multiplies), s [M] float32, X8[:, :N] *
    s[:, None] approximating x (linear_fp8.quantize_fp8's values)."""
    L.require(x.dim() == 2 and x.dtype in (torch.float32, torch.float16, torch.bfloat16),
              lambda: f"quantize_rows: x must be [M, N] in float32, float16 or bfloat16, got {tuple(x.shape)} "
                      f"{x.dtype}")
    M, N = x.shape
    width = N if width is None else width
    L.require(isinstance(width, int) and width >= N, lambda: f"quantize_rows: width {width!r} is below the rows' {N}")
    q = torch.empty((M, width), dtype=FP8, device=x.device)
    s = torch.empty((M,), dtype=torch.float32, device=x.device)
    if M and width:
        # Memoised (bound once per shape): a W8A8 library path quantizes twice per un-graphed call, where the JIT's
        # binding cost more host time than the launch.
        key = (QUANTIZE_ROWS, x.dtype, M, N, width, x.stride(), x.device)

        def build() -> tuple:
            kernel = load_kernel(KernelSpec(QUANTIZE_ROWS, "none", upcast_operands=interpreting()))
            block_n = min(2048, 1 << (width - 1).bit_length())
            block_m = max(1, min(16, 4096 // block_n))  # about 4096 elements a step
            return kernel, (-(-M // block_m),), (M, N, width), dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=4)

        L.memoised_launch(key, {"x": x, "q": q, "s": s}, build)
    return q, s


def _run(ops: dict, activation: str, config: KernelConfig, out: torch.Tensor | None = None) -> torch.Tensor:
    q, s = launch_quantize_rows(ops["x"])
    return q.float() * s[:, None]


def _eager(ops: dict, activation: str) -> torch.Tensor:
    q, s = quantize_fp8(ops["x"])
    return q.float() * s[:, None]


def _reference(ops: dict, activation: str, dtype: torch.dtype) -> torch.Tensor:
    q, s = quantize_fp8(ops["x"])
    return q.double() * s.double()[:, None]


QUANTIZE_ROWS = OpSpec(
    name="quantize_rows",
    template="quantize_rows",
    doc="each row to fp8 (e4m3) with a float32 scale, for the W8A8 library paths (nothing to tune)",
    operands=OPERANDS,
    activations=("none",),
    run=_run,
    sizes=("M", "N", "W"),
    constexprs=("BLOCK_M", "BLOCK_N"),
    library={"eager": _eager},
    reference=_reference,
)
