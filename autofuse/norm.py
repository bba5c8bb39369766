"""FusedRMSNorm: an RMSNorm module whose forward is one launch of op rms_norm (ops/rms_norm.py), replayed bound
per row count and weight (launch.memoised_launch) so that an un-graphed decode step pays one launch's host time
instead of eager's ten ops. `fuse(model)` puts one in place of each Hugging Face RMSNorm whose form it recognises
(hf.py)."""

from __future__ import annotations

import torch
from torch import nn

from .device import interpreting
from .fused_module import needs_grad
from .ops.rms_norm import FORMS, MAX_N, eager_rms_norm, rms_norm


class FusedRMSNorm(nn.Module):
    """y = RMSNorm(x) over the last dimension with `weight` (shared, not copied: state_dict keys and the
    parameter object stay the caller's) in the weight form `form` (ops.rms_norm.FORMS).

    The eager form (eager_rms_norm, the original module's own arithmetic) runs where the kernel would
    not give the original's result or cannot run: autograd (it has no backward), autocast, an input of
    another dtype or device, torch.compile's tracing (Inductor fuses the eager form itself), rows wider
    than the kernel's tile, a weight that is not contiguous, and a CPU without TRITON_INTERPRET=1."""

    def __init__(self, weight: nn.Parameter, eps: float, form: str) -> None:
        super().__init__()
        if form not in FORMS:
            raise ValueError(f"form must be one of {FORMS}, got {form!r}")
        self.weight = weight
        self.eps = float(eps)
        self.form = form

    def _runs_eager(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        if not isinstance(x, torch.Tensor) or x.dtype != weight.dtype or x.device != weight.device:
            return True
        if weight.dim() != 1 or x.dim() == 0 or x.shape[-1] != weight.shape[0] or weight.shape[0] > MAX_N:
            return True  # the eager form raises PyTorch's own error for a wrong width
        if not weight.is_contiguous():
            return True  # a copy per call would bind a launch per call (launch.memoised_launch)
        if x.device.type == "cpu" and not interpreting():
            return True
        return (torch.compiler.is_compiling() or needs_grad(x, weight) or torch.is_autocast_enabled(x.device.type))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if self._runs_eager(x, weight):
            return eager_rms_norm(x, weight, self.eps, self.form)
        N = weight.shape[0]
        M = x.numel() // N
        y = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # contiguous, whatever x's strides
        rms_norm(x.reshape(M, N), weight, self.eps, self.form, out=y.view(M, N))
        return y

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, form={self.form}, autofuse"
