"""The Linear with fp8 weights and fp8 activations (W8A8): Y = act((X8 sx) @ (W8 s)^T + b) [+ R], W stored as
float8_e4m3fn with a float32 scale per output channel (ops/linear_fp8.py's quantize_fp8), X quantized to
float8_e4m3fn inside the kernel that consumes it, with a float32 scale per row (token) from its largest magnitude
over K (quantize_rows says how). The dot runs on fp8 tensor cores, twice bf16's rate on Hopper; the scales apply in
the epilogue. The linear template with `fp8_activations`: a first pass over each tile's rows finds their scales,
then the K loop quantizes each X tile as it is loaded.

It computes another function than the weight-only op (the activations are rounded to e4m3 too): keyed apart (op
linear_w8a8), checked against the float64 product of the quantized activations and weights, and reported against
the unquantized ones beside it. Its library paths: eager PyTorch on the same quantized values, and on a CUDA GPU
torch._scaled_mm (fp8 x fp8) with rowwise scales plus one pointwise pass, or with unit scales plus one pass that
applies the scales too (ops/scaled_act.py says why both race).
"""

from __future__ import annotations

import dataclasses

import torch

from ..configs import KernelConfig
from ..device import capturing
from ..layout import padded_whole
from .bias_act import bias_activation
from .linear_fp8 import DOWN_FIELDS, LINEAR_FP8, dequantize_fp8, launch_linear, quantize_fp8
from .quantize_rows import launch_quantize_rows
from .scaled_act import raw_dtype, scaled_bias_activation


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(X8, sx): each row of x as float8_e4m3fn with a float32 scale, the row's largest magnitude mapped to e4m3's
    largest finite value (448), computed in float32 as the kernel computes it; a row of zeros gets scale 1: the
    weights' per-row quantization (quantize_fp8), applied to the activations' rows."""
    return quantize_fp8(x)


def linear_w8a8(x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                residual: torch.Tensor | None, activation: str, config: KernelConfig,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """Y = act(quantize_rows(x) @ (w8 * scale[:, None]).T + bias) + residual, x quantized inside the kernel; x: [M, K]
    (float32, float16 or bfloat16), w8: [N, K] float8_e4m3fn, scale: [N] float32. Written into `out` when given."""
    return launch_linear(LINEAR_W8A8, x, (w8, scale), bias, residual, activation, config, out)


def _run(ops: dict, activation: str, config: KernelConfig, out: torch.Tensor | None = None) -> torch.Tensor:
    return linear_w8a8(ops["x"], ops["w"], ops["s"], ops.get("b"), ops.get("r"), activation, config, out=out)


def dequantized_rows(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x as the W8A8 kernels multiply it (quantize_rows), dequantized to `dtype` (exactly, in float64)."""
    x8, sx = quantize_rows(x)
    return dequantize_fp8(x8, sx, dtype)


def _eager(ops: dict, activation: str) -> torch.Tensor:
    """The same quantized values in PyTorch's ops: x and W dequantized to x's dtype, then the dense Linear's."""
    return LINEAR_FP8.library["eager"]({**ops, "x": dequantized_rows(ops["x"], ops["x"].dtype)}, activation)


def scaled_mm_fits(*sizes: int) -> bool:
    """Whether torch._scaled_mm takes these sizes (a weight's N and K): all multiples of 16, its fp8 GEMMs'
    alignment."""
    return all(size % 16 == 0 for size in sizes)


def scaled_mm(x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x @ (w8 * scale[:, None]).T in x's dtype through torch._scaled_mm (fp8 tensor cores, rowwise scales), x's
    rows quantized first in one launch (op quantize_rows: quantize_rows's values). ValueError where the sizes do not
    fit it (scaled_mm_quantized): the check that meets it leaves the library path out (Evaluator.library_ms)."""
    return scaled_mm_quantized(*launch_quantize_rows(x, scaled_mm_width(w8)), w8, scale, x.dtype)


def scaled_mm_width(w8: torch.Tensor) -> int:
    """The width x's quantized rows take for torch._scaled_mm with `w8` ([N, K]): w8's row stride, which is the row
    width of its padded storage where it is so held (layout.padded_rows), the zeros past K meeting its zero columns,
    and K where its rows are contiguous: the width of what _whole multiplies (read from the stride, not by a storage
    lookup: it runs every call of the library paths)."""
    return w8.stride(0)


def _whole(x8: torch.Tensor, w8: torch.Tensor) -> torch.Tensor:
    """The [N', K'] weight torch._scaled_mm multiplies for w8 ([N, K]): its padded storage where it is so held
    (layout.padded_whole), zero rows and columns included, else w8 itself where N and K are multiples of 16 and its
    rows contiguous; ValueError where neither, or x8's quantized rows are not K' wide."""
    n, k = w8.shape
    whole = w8 if scaled_mm_fits(n, k) and w8.is_contiguous() else padded_whole(w8)
    if whole is None or x8.shape[1] != whole.shape[1]:
        raise ValueError(f"torch._scaled_mm needs sizes that are multiples of 16: W [{n}, {k}] is not held in padded "
                         f"storage, or x's quantized rows ({x8.shape[1]} wide) do not meet it")
    return whole


def scaled_mm_quantized(x8: torch.Tensor, sx: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor,
                        dtype: torch.dtype) -> torch.Tensor:
    """(x8 * sx[:, None]) @ (w8 * scale[:, None]).T in `dtype` ([M, N]) through torch._scaled_mm, x already quantized
    per row ([M, scaled_mm_width(w8)]): one quantization serves a gated MLP's gate and up projections. Where N or K is
    not a multiple of 16 (sizes torch._scaled_mm refuses), the product runs over w8's padded storage (_whole) and
    returns a view of the first N columns."""
    n = w8.shape[0]
    whole = _whole(x8, w8)
    if whole.shape[0] != n:
        scale = torch.nn.functional.pad(scale, (0, whole.shape[0] - n), value=1.0)
    y = torch._scaled_mm(x8, whole.t(), scale_a=sx[:, None], scale_b=scale[None, :], out_dtype=dtype)
    return y if whole.shape[0] == n else y[:, :n]


_UNIT_SCALES: dict[torch.device, torch.Tensor] = {}


def _unit_scale(device: torch.device) -> torch.Tensor:
    """A float32 1 on `device`, unit_scaled_mm's tensorwise scale: kept per device rather than made (a fill launched)
    per call, except one made while a CUDA graph captures, whose value is written only when the graph replays."""
    one = _UNIT_SCALES.get(device)
    if one is None:
        with torch.inference_mode(False):
            one = torch.ones((), dtype=torch.float32, device=device)
        if not capturing(device):
            _UNIT_SCALES[device] = one
    return one


def unit_scaled_mm(x8: torch.Tensor, w8: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x8 @ w8.T unscaled ([M, N], in scaled_act.raw_dtype(dtype)) through torch._scaled_mm with unit (tensorwise)
    scales, x8 quantized per row ([M, scaled_mm_width(w8)]); over w8's padded storage where N or K is not a
    multiple of 16 (_whole). The scales apply in the pass after it (ops/scaled_act.py)."""
    n = w8.shape[0]
    whole = _whole(x8, w8)
    one = _unit_scale(x8.device)
    y = torch._scaled_mm(x8, whole.t(), scale_a=one, scale_b=one, out_dtype=raw_dtype(dtype))
    return y if whole.shape[0] == n else y[:, :n]


def _scaled_mm_unit(ops: dict, activation: str) -> torch.Tensor:
    """unit_scaled_mm of x's quantized rows and the weight, then one pass applying both scales, the bias, the
    activation and the residual (op scaled_bias_act). Off CUDA, where _scaled_mm does not run, the same values
    through eager's ops."""
    x = ops["x"]
    if not x.is_cuda:
        return _eager(ops, activation)
    x8, sx = launch_quantize_rows(x, scaled_mm_width(ops["w"]))
    return scaled_bias_activation(unit_scaled_mm(x8, ops["w"], x.dtype), sx, ops["s"], ops.get("b"), ops.get("r"),
                                  activation, x.dtype)


def _scaled_mm(ops: dict, activation: str) -> torch.Tensor:
    """scaled_mm of x and the weights, then one pointwise pass act(Y + b) [+ R] (op bias_act). Off CUDA, where
    _scaled_mm does not run, the same values through eager's ops."""
    x = ops["x"]
    if not x.is_cuda:
        return _eager(ops, activation)
    return bias_activation(scaled_mm(x, ops["w"], ops["s"]), ops.get("b"), ops.get("r"), activation)


def _reference(ops: dict, activation: str, dtype: torch.dtype) -> torch.Tensor:
    """float64, from the quantized activations and weights: the function the kernel computes."""
    return LINEAR_FP8.reference({**ops, "x": dequantized_rows(ops["x"], torch.float64)}, activation, dtype)


# The fp8-weight Linear's op with the activations quantized too: its template, operands, problems (make_operands,
# original_reference) and keys' dimensions.
LINEAR_W8A8 = dataclasses.replace(
    LINEAR_FP8,
    name="linear_w8a8",
    doc="act(x8 sx (W8 s)^T + b) [+ residual] in one kernel, x quantized to fp8 per row inside it, W in fp8",
    run=_run,
    weights="w8a8",
    library={"eager": _eager, "scaled_mm": _scaled_mm, "scaled_mm_unit": _scaled_mm_unit},
    reference=_reference,
)

DOWN_W8A8 = dataclasses.replace(
    LINEAR_W8A8,
    name="down_w8a8",
    doc="a gated MLP's down projection with H quantized to fp8 per row inside it and W in fp8",
    **DOWN_FIELDS,
)
