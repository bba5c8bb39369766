"""`show_kernel`: the source autofuse generates for an op, so users can read what runs."""

from __future__ import annotations

import torch

from .activations import GATED_ACTIVATIONS, LINEAR_ACTIVATIONS, canonical_activation
from .device import fp32_input_precision, interpreting
from .errors import AutofuseError
from .render import KernelSpec, render

OPS = {"linear": LINEAR_ACTIVATIONS, "gated_up": GATED_ACTIVATIONS, "mlp_decode": GATED_ACTIVATIONS,
       "gated_bwd": GATED_ACTIVATIONS, "gated_act": GATED_ACTIVATIONS}


def show_kernel(op: str, *, activation: str | None = None, bias: bool = False, residual: bool = False,
                dtype: torch.dtype = torch.bfloat16, even_k: bool = True, interpret: bool | None = None,
                split_k: bool = False) -> str:
    """Rendered Triton source of the kernel autofuse builds for `op` ("linear", "gated_up",
    "mlp_decode": the whole gated MLP in one launch for small M, "gated_bwd": the gated MLP's
    backward GEMM, or "gated_act": the training forward's pointwise act(G) * U).

    `even_k` picks the unmasked K loop (K divisible by BLOCK_K); `interpret` defaults to whether
    TRITON_INTERPRET=1 is set now, since interpreted kernels upcast their operands; `split_k`
    the variant whose programs split K and meet in a float32 workspace.
    """
    if op not in OPS:
        raise AutofuseError(f"unknown op {op!r}; choose one of {', '.join(OPS)}")
    if activation is None:
        activation = "none" if op == "linear" else "gelu_tanh"
    if split_k and op in ("mlp_decode", "gated_bwd", "gated_act"):
        raise AutofuseError(f"the {op} kernel has no split-K variant")
    if residual and op != "linear":
        raise AutofuseError("only the linear op takes a residual")
    spec = KernelSpec(
        template=op,
        activation=canonical_activation(activation, OPS[op]),
        has_bias=bool(bias),
        has_residual=bool(residual),
        even_k=bool(even_k),
        input_precision=fp32_input_precision() if dtype == torch.float32 else None,
        upcast_operands=interpreting() if interpret is None else bool(interpret),
        split_k=bool(split_k),
    )
    return render(spec)
