"""autofuse: tuned, fused Triton kernels for the MLP blocks of transformer models.

Adding an op: CONTRIBUTING.md walks through the one module (autofuse/ops/<op>.py) and template an op needs.

The public names load on first use, so that the command line parses (and answers --help) without
importing PyTorch. Where PyTorch is already imported, `import autofuse` loads the runtime at once, which
registers its torch.library ops (`torch.ops.autofuse.*`) as a loaded exported program expects.
"""

import importlib
import sys

from ._version import __version__
from .errors import AutofuseError

# Each public name and the module that defines it. tune_model loads the tuner (and through it optuna)
# only when asked for: the runtime imports nothing from autofuse/tune.
_PUBLIC = {
    "KernelConfig": ".configs", "Library": ".configs",
    "FusedHFMLP": ".hf", "FuseReport": ".hf", "fuse": ".hf",
    "FusedLinear": ".modules", "FusedLinearFp8": ".modules", "FusedMLP": ".modules", "FusedMLPFp8": ".modules",
    "get_linear": ".modules", "get_mlp": ".modules",
    "FusedRMSNorm": ".norm",
    "show_kernel": ".ops",
    "record_traffic": ".traffic",
    "tune_model": ".tune.model",
}

__all__ = ["AutofuseError", "__version__", *sorted(_PUBLIC)]


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'autofuse' has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC[name], __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_PUBLIC))


if "torch" in sys.modules:
    from . import hf, modules, norm  # noqa: F401 - the runtime, and with it the torch.library ops
