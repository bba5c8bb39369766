"""autofuse: tuned, fused Triton kernels for the MLP blocks of transformer models.

Adding an op: CONTRIBUTING.md walks through the one module (autofuse/ops/<op>.py) and template an op needs.
"""

from ._version import __version__
from .configs import KernelConfig, Library
from .errors import AutofuseError
from .hf import FusedHFMLP, FuseReport, fuse
from .modules import FusedLinear, FusedMLP, get_linear, get_mlp
from .norm import FusedRMSNorm
from .ops import show_kernel

__all__ = [
    "AutofuseError",
    "FuseReport",
    "FusedHFMLP",
    "FusedLinear",
    "FusedMLP",
    "FusedRMSNorm",
    "KernelConfig",
    "Library",
    "__version__",
    "fuse",
    "get_linear",
    "get_mlp",
    "show_kernel",
    "tune_model",
]


def __getattr__(name: str):
    # autofuse.tune_model loads the tuner (and through it optuna) only when asked for: the runtime
    # imports nothing from autofuse/tune.
    if name == "tune_model":
        from .tune.model import tune_model

        return tune_model
    raise AttributeError(f"module 'autofuse' has no attribute {name!r}")
