"""The Linear op: Y = act(X @ W^T + b) [+ R] in one kernel (templates/linear*.py.jinja), and `down`,
the gated MLP's down projection: the same kernel without activation, keyed apart so that a shapes
file's MLP and Linear entries never share a key."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from .. import launch as L
from ..activations import LINEAR_ACTIVATIONS
from ..configs import KernelConfig
from ..layout import input_width, line_rows, linear_sizes, linear_width, row_width, run_width
from ..opspec import GEMM_VARIANTS, LibraryPath, Operand, OpSpec
from ..reference import eager_linear, linear_reference
from .bias_act import bias_activation

OPERANDS = (
    Operand("x", "[M, K]", "mk", tma_block=("BLOCK_M", "BLOCK_K")),
    Operand("w", "[N, K], nn.Linear layout", "nk", tma_block=("BLOCK_N", "BLOCK_K")),
    Operand("b", "[N]", when="has_bias"),
    Operand("r", "[M, N], added after the activation", "mn", when="has_residual"),
    Operand("y", "[M, N]", "mn"),
)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None,
           activation: str, config: KernelConfig, out: torch.Tensor | None = None) -> torch.Tensor:
    """Y = act(x @ weight.T + bias) + residual, x: [M, K], weight: [N, K], residual: [M, N].
    Written into `out` ([M, N], x's dtype) when given."""
    L.check_operands(x, weight, bias, residual)
    M, K = x.shape
    N = weight.shape[0]
    L.require(weight.shape[1] == K and (residual is None or tuple(residual.shape) == (M, N)),
              lambda: f"linear: x {tuple(x.shape)}, weight {tuple(weight.shape)} and residual do not fit")
    y = L.output(out, (M, N), x)
    if M == 0:
        return y
    config = L.runnable(config, x, weight)
    kernel = L.kernel_for(LINEAR, activation, K, x.dtype, config, bias is not None, residual is not None,
                           device=x.device)
    tensors = {"x": x, "w": weight, "b": None if bias is None else bias.contiguous(), "r": residual, "y": y}
    L.launch_gemm(kernel, (M, N, K), config, x.device, tensors, accumulators=1)
    return y


def _run(ops: dict, activation: str, config: KernelConfig, out: torch.Tensor | None = None) -> torch.Tensor:
    return linear(ops["x"], ops["w"], ops.get("b"), ops.get("r"), activation, config, out=out)


def _eager(ops: dict, activation: str) -> torch.Tensor:
    return eager_linear(ops["x"], ops["w"], ops.get("b"), ops.get("r"), activation)


def _on_cublas(x: torch.Tensor) -> bool:
    """Whether x's GEMMs run through NVIDIA's cuBLAS / cuBLASLt (a CUDA tensor, not on ROCm)."""
    return x.is_cuda and torch.version.hip is None


def _cublaslt_gelu_tanh(ops: dict, activation: str) -> torch.Tensor:
    """cuBLASLt's GEMM with its bias + GELU epilogue (torch._addmm_activation): one kernel, no separate
    pointwise pass. On CUDA its GELU is the tanh approximation (float32 on an H200:
    benchmarks/addmm_gelu_probe.py and tests/test_gpu.py), so it serves gelu_tanh keys with a bias only.
    Elsewhere (the CPU, ROCm) PyTorch's fallback may compute another GELU: the same function is
    computed unfused there."""
    x, w, b = ops["x"], ops["w"], ops["b"]
    if _on_cublas(x):
        y = torch._addmm_activation(b, x, w.t(), use_gelu=True)
    else:
        y = F.gelu(torch.addmm(b, x, w.t()), approximate="tanh")
    r = ops.get("r")
    return y if r is None else y.add_(r)


def _cublas_bias_act(ops: dict, activation: str) -> torch.Tensor:
    """cuBLAS's GEMM without an epilogue, then ONE pointwise pass act(Y + b) [+ R] in place (op bias_act): what
    torch.compile generates for a Linear followed by pointwise work. Eager runs the bias in cuBLAS's epilogue and
    the activation and the residual as passes of their own; cuBLASLt's GELU epilogue serves gelu_tanh only."""
    return bias_activation(torch.mm(ops["x"], ops["w"].t()), ops.get("b"), ops.get("r"), activation)


def _cublaslt(ops: dict, activation: str) -> torch.Tensor:
    """cuBLASLt's GEMM for a down projection without a bias: torch.mm with PyTorch's preferred BLAS backend set to
    cuBLASLt for this call and put back after it (a bias already takes cuBLASLt's epilogue in eager's addmm). Where
    its heuristics pick other kernels than cuBLAS's they can be faster at decode sizes: a down GEMM at M = 32-256 ran
    1.026x faster by geomean (0.956-1.278; e.g. 6080 -> 15319 at M = 64, 48.4 us against 56.3, H200). The setting is
    the process's: a GEMM another thread runs meanwhile may run through cuBLASLt too (the same product up to
    rounding). Elsewhere (the CPU, ROCm) torch.mm as it is."""
    x, w = ops["x"], ops["w"]
    if not _on_cublas(x):
        return torch.mm(x, w.t())
    before = torch._C._get_blas_preferred_backend()
    torch._C._set_blas_preferred_backend(torch._C._BlasBackend.Cublaslt)
    try:
        return torch.mm(x, w.t())
    finally:
        torch._C._set_blas_preferred_backend(before)


def _reference(ops: dict, activation: str, dtype: torch.dtype) -> torch.Tensor:
    return linear_reference(ops["x"], ops["w"], ops.get("b"), ops.get("r"), activation)


def _make_operands(n: int, k: int, M: int, bias: bool, residual: bool, rand) -> dict:
    # nn.Linear-like scale: outputs of order one. The weight's rows as FusedLinear and FusedMLP keep them: whole
    # lines apart, and where k elements are not 16-byte aligned, the first k columns of aligned rows
    # (layout.LinearLayout, linear_sizes).
    return {"x": rand(M, k), "w": line_rows(rand(n, k) * k**-0.5, linear_width(k)), "b": rand(n) if bias else None,
            "r": rand(M, n) if residual else None}


LINEAR = OpSpec(
    name="linear",
    template="linear",
    doc="act(x W^T + b) [+ residual] in one kernel",
    operands=OPERANDS,
    activations=LINEAR_ACTIVATIONS,
    run=_run,
    residual=True,
    **GEMM_VARIANTS,
    library={"eager": _eager,
             "cublaslt_gelu_tanh": LibraryPath(
                 _cublaslt_gelu_tanh, applies=lambda activation, bias, residual: activation == "gelu_tanh" and bias),
             # With neither an activation nor a residual, eager's one addmm is already the whole op.
             "cublas_bias_act": LibraryPath(
                 _cublas_bias_act, applies=lambda activation, bias, residual: activation != "none" or residual)},
    reference=_reference,
    make_operands=_make_operands,
    output_width=lambda n, k: n,
    serves="linear",
    dims=lambda s, M: (*linear_sizes(s.out_features, s.in_features, M), s.activation),  # FusedLinear's
)

DOWN = dataclasses.replace(
    LINEAR,
    name="down",
    doc="a gated MLP's down projection: the linear kernel without activation",
    activations=("none",),
    residual=False,
    library={"eager": _eager,
             "cublaslt": LibraryPath(_cublaslt, applies=lambda activation, bias, residual: not bias)},
    serves="mlp",
    dims=lambda s, M: (input_width(s.d_model), run_width(s.d_ff), "none"),  # what FusedMLP runs (layout.py)
    training_dims=lambda s, M: (row_width(s.d_model), row_width(s.d_ff), "none"),  # its training step's (Padding)
)
