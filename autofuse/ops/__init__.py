"""The op registry: every op autofuse can render, launch, tune, cache and run, by name.

An op is one OpSpec (autofuse/opspec.py) in one module of this package, next to its launcher, plus its
template(s) in templates/. Renderer, launchers, tuner, runtime and CLI read the registry; nothing
else keeps a list of ops. `register` adds an op from outside the package (see CONTRIBUTING.md).
"""

from __future__ import annotations

import difflib

import torch

from .. import opspec, variants
from ..activations import canonical_activation
from ..device import fp32_input_precision, interpreting
from ..errors import AutofuseError, shown
from ..opspec import Operand, OpSpec
from ..render import KernelSpec, render
from .bias_act import BIAS_ACT
from .gated_act import GATED_ACT, PAIRS_ACT
from .gated_bwd import GATED_BWD
from .gated_grad import GATED_DGU, GATED_GRAD
from .gated_pairs import GATED_PAIRS
from .gated_up import GATED_UP
from .gated_up_fp8 import GATED_UP_FP8, GATED_UP_W8A8
from .linear import DOWN, LINEAR
from .linear_fp8 import DOWN_FP8, LINEAR_FP8
from .linear_w8a8 import DOWN_W8A8, LINEAR_W8A8
from .mlp import MLP
from .quantize_rows import QUANTIZE_ROWS
from .rms_norm import RMS_NORM
from .scaled_act import SCALED_BIAS_ACT, SCALED_GATED_ACT

__all__ = ["OpSpec", "Operand", "get", "names", "register", "register_library", "show_kernel", "unregister",
           "unregister_library"]

_REGISTRY: dict[str, OpSpec] = {}


def register(spec: OpSpec) -> OpSpec:
    """Make `spec` known under its name; a name is registered once."""
    if spec.name in _REGISTRY and _REGISTRY[spec.name] is not spec:
        raise ValueError(f"an op named {spec.name!r} is already registered")
    if "|" in spec.name or "=" in spec.name or not spec.name:
        raise ValueError(f"op names may not be empty or hold '|' or '=', got {spec.name!r}")
    _REGISTRY[spec.name] = spec
    return spec


def unregister(name: str) -> None:
    _REGISTRY.pop(name, None)


def register_library(op: str, name: str, run) -> None:
    """Add a library candidate to a registered op: `run(operands: dict, activation) -> output` (or an
    opspec.LibraryPath, for a candidate that serves some keys only). It competes wherever the op's own do: the
    first-use check, the un-graphed race, the tuner; every output is checked against float64 first."""
    opspec.register_library(get(op), name, run)


def unregister_library(op: str, name: str) -> None:
    opspec.unregister_library(get(op), name)


def get(name: str) -> OpSpec:
    spec = _REGISTRY.get(name) if isinstance(name, str) else None
    if spec is None:
        close = difflib.get_close_matches(name, list(_REGISTRY), n=1) if isinstance(name, str) else []
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise AutofuseError(f"unknown op {shown(name)}{hint}; choose one of {', '.join(_REGISTRY)}")
    return spec


def names(*, tunable: bool | None = None) -> tuple[str, ...]:
    """Registered op names (only the tunable ones, or only the others, when asked)."""
    return tuple(n for n, s in _REGISTRY.items() if tunable is None or s.tunable == tunable)


def specs() -> tuple[OpSpec, ...]:
    return tuple(_REGISTRY.values())


for _spec in (LINEAR, DOWN, GATED_UP, MLP, GATED_BWD, GATED_ACT, GATED_GRAD, GATED_DGU, GATED_PAIRS,
              PAIRS_ACT, BIAS_ACT, RMS_NORM, QUANTIZE_ROWS, LINEAR_FP8, DOWN_FP8, GATED_UP_FP8, LINEAR_W8A8,
              DOWN_W8A8, GATED_UP_W8A8, SCALED_GATED_ACT, SCALED_BIAS_ACT):
    register(_spec)


def show_kernel(op: str, *, activation: str | None = None, bias: bool = False, residual: bool = False,
                dtype: torch.dtype = torch.bfloat16, even_k: bool = True, interpret: bool | None = None,
                variant: str = "tile") -> str:
    """Rendered Triton source of the kernel autofuse builds for `op` (a registered name: see
    `autofuse show-kernel --help`), so users can read what runs.

    `activation` defaults to the op's first gated one or none; `even_k` picks the unmasked K loop (K
    divisible by BLOCK_K); `interpret` defaults to whether TRITON_INTERPRET=1 is set now, since
    interpreted kernels upcast their operands; `variant`: one of the op's kernel variants (autofuse/variants.py:
    "tile", one output tile per program; "split_k", programs share a tile through a workspace; "tma",
    persistent over TMA descriptors; or one registered from outside).
    """
    spec = get(op)
    kinds = [v.name for v in variants.of(spec)]
    if variant not in kinds:
        raise AutofuseError(f"the {spec.name} kernel has no variant {shown(variant)}; it has {', '.join(kinds)}")
    if bias and not any(o.when == "has_bias" for o in spec.operands):
        raise AutofuseError(f"op {spec.name!r} takes no bias")
    if activation is None:
        activation = "gelu_tanh" if "gelu_tanh" in spec.activations else spec.activations[0]
    try:
        kernel = KernelSpec(
            op=spec,
            activation=canonical_activation(activation, spec.activations),
            has_bias=bool(bias),
            has_residual=bool(residual),
            even_k=bool(even_k),
            input_precision=fp32_input_precision() if dtype == torch.float32 else None,
            upcast_operands=interpreting() if interpret is None else bool(interpret),
            variant=variant,
        )
    except ValueError as e:  # e.g. a residual the op does not take: KernelSpec says which
        raise AutofuseError(str(e)) from None
    return render(kernel)
