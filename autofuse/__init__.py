"""autofuse: tuned, fused Triton kernels for the MLP blocks of transformer models."""

from .configs import KernelConfig
from .errors import AutofuseError
from .kernels import show_kernel
from .modules import FusedLinear, FusedMLP, get_linear, get_mlp

__version__ = "0.1.0"

__all__ = [
    "AutofuseError",
    "FusedLinear",
    "FusedMLP",
    "KernelConfig",
    "__version__",
    "get_linear",
    "get_mlp",
    "show_kernel",
]
