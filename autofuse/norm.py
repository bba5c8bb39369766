"""FusedRMSNorm: an RMSNorm module whose forward is one launch of op rms_norm (ops/rms_norm.py), bound per row
count (bound.BoundLaunch) so that an un-graphed decode step pays one launch's host time instead of eager's
ten ops. `fuse(model)` puts one in place of each Hugging Face RMSNorm whose form it recognises (hf.py)."""

from __future__ import annotations

import torch
from torch import nn

from . import launch
from .device import interpreting
from .fused_module import needs_grad
from .ops.rms_norm import FORMS, MAX_N, eager_rms_norm, rms_norm

# Row counts whose launch stays bound; a new prompt length past this many starts the table over.
_BOUND_KEPT = 32


class FusedRMSNorm(nn.Module):
    """y = RMSNorm(x) over the last dimension with `weight` (shared, not copied: state_dict keys and the
    parameter object stay the caller's) in the weight form `form` (ops.rms_norm.FORMS).

    The eager form (eager_rms_norm, the original module's own arithmetic) runs where the kernel would
    not give the original's result or cannot run: autograd (it has no backward), autocast, an input of
    another dtype or device, torch.compile's tracing (Inductor fuses the eager form itself), rows wider
    than the kernel's tile, and a CPU without TRITON_INTERPRET=1."""

    def __init__(self, weight: nn.Parameter, eps: float, form: str) -> None:
        super().__init__()
        if form not in FORMS:
            raise ValueError(f"form must be one of {FORMS}, got {form!r}")
        self.weight = weight
        self.eps = float(eps)
        self.form = form
        # M -> (weight address, eps, BoundLaunch or None): the launch bound at that row count. The module's own
        # memo, not launch.memoised_launch: a replay here skips rms_norm's checks (this forward has made them),
        # which doubled the plain call's host time when it went through them.
        self._bound: dict[int, tuple] = {}

    def _runs_eager(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        if not isinstance(x, torch.Tensor) or x.dtype != weight.dtype or x.device != weight.device:
            return True
        if weight.dim() != 1 or x.dim() == 0 or x.shape[-1] != weight.shape[0] or weight.shape[0] > MAX_N:
            return True  # the eager form raises PyTorch's own error for a wrong width
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
        entry = self._bound.get(M)
        if entry is not None and entry[0] == weight.data_ptr() and entry[1] == self.eps:
            bound = entry[2]
            if bound is not None and bound({"x": x, "y": y}):
                return y
            rms_norm(x.reshape(M, N), weight.contiguous(), self.eps, self.form, out=y.view(M, N))
            return y
        with launch.binding() as recorded:
            rms_norm(x.reshape(M, N), weight.contiguous(), self.eps, self.form, out=y.view(M, N))
        if len(self._bound) >= _BOUND_KEPT:
            self._bound.clear()
        bound = launch.only_launch(recorded) if weight.is_contiguous() else None
        self._bound[M] = (weight.data_ptr(), self.eps, bound)
        return y

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, form={self.form}, autofuse"
