"""`show_kernel`: the source autofuse generates for an op, so users can read what runs."""

from __future__ import annotations

import torch

from .activations import canonical_activation
from .device import fp32_input_precision, interpreting
from .errors import AutofuseError
from .render import TEMPLATES, KernelSpec, render


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
    if op not in TEMPLATES:
        raise AutofuseError(f"unknown op {op!r}; choose one of {', '.join(TEMPLATES)}")
    if activation is None:
        activation = "none" if op == "linear" else "gelu_tanh"
    try:
        spec = KernelSpec(
            template=op,
            activation=canonical_activation(activation, TEMPLATES[op]),
            has_bias=bool(bias),
            has_residual=bool(residual),
            even_k=bool(even_k),
            input_precision=fp32_input_precision() if dtype == torch.float32 else None,
            upcast_operands=interpreting() if interpret is None else bool(interpret),
            split_k=bool(split_k),
        )
    except ValueError as e:  # a variant this kernel does not have (split-K, residual): KernelSpec says which
        raise AutofuseError(str(e)) from None
    return render(spec)
