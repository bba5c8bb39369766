"""autofuse: tuned, fused Triton kernels for the MLP blocks of transformer models."""

from .configs import KernelConfig
from .errors import AutofuseError
from .hf import FusedHFMLP, FuseReport, fuse
from .kernels import show_kernel
from .modules import FusedLinear, FusedMLP, get_linear, get_mlp

__version__ = "0.1.0"

__all__ = [
    "AutofuseError",
    "FuseReport",
    "FusedHFMLP",
    "FusedLinear",
    "FusedMLP",
    "KernelConfig",
    "__version__",
    "fuse",
    "get_linear",
    "get_mlp",
    "show_kernel",
]
