"""The demo job: build each shape's fused module, check it against PyTorch, time it against eager."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import torch

from ..device import interpreting
from ..modules import get_linear, get_mlp
from ..reference import eager_linear, eager_mlp, linear_reference, mlp_reference_rounded, relative_error
from ..shapes import MLPShape, ShapeSet
from ..timing import cpu_median_ms
from .measure import gpu_median_ms

# Relative-error bounds (||out - ref|| / ||ref||) for the demo's pass/fail verdict: a few unit
# roundoffs of the dtype (fp32 4x looser on a GPU, where PyTorch may allow tf32).
ERROR_BOUNDS = {torch.float32: 1e-4, torch.float16: 4 * 2**-11, torch.bfloat16: 4 * 2**-8}


@dataclasses.dataclass
class DemoRow:
    name: str
    op: str
    M: int
    config: str
    rel_error: float
    ok: bool
    autofuse_ms: float
    eager_ms: float


def run_demo(shapes: ShapeSet, device: str) -> Iterator[DemoRow]:
    dtype = shapes.dtype
    timer = cpu_median_ms if interpreting() else gpu_median_ms
    for shape in (*shapes.mlps, *shapes.linears):
        if isinstance(shape, MLPShape):
            module = get_mlp(shape.d_model, shape.d_ff, activation=shape.activation, bias=shape.bias,
                             dtype=dtype, device=device)
            g, u, d = module.gate_proj, module.up_proj, module.down_proj
            weights = (g.weight, u.weight, d.weight, g.bias, u.bias, d.bias)
            width, op = shape.d_model, "mlp"

            def eager(x, weights=weights, act=shape.activation):
                return eager_mlp(x, *weights, activation=act)

            def reference(x, weights=weights, act=shape.activation):
                return mlp_reference_rounded(x, weights, act, dtype)
        else:
            module = get_linear(shape.in_features, shape.out_features, bias=shape.bias,
                                activation=shape.activation, dtype=dtype, device=device)
            args = (module.weight, module.bias, None, shape.activation)
            width, op = shape.in_features, "linear"

            def eager(x, args=args):
                return eager_linear(x, *args)

            def reference(x, args=args):
                return linear_reference(x, *args)

        for M in shapes.tokens:
            x = torch.randn(M, width, dtype=dtype, device=device)
            with torch.no_grad():
                out = module(x)
                ref = reference(x)
                error = relative_error(out, ref)
                ok = bool(torch.isfinite(out).all()) and error <= ERROR_BOUNDS[dtype]
                yield DemoRow(
                    name=shape.name, op=op, M=M,
                    config=" / ".join(c.short() for c in module.config_for(M).values()),
                    rel_error=error, ok=ok,
                    autofuse_ms=timer(lambda: module(x)),
                    eager_ms=timer(lambda: eager(x)),
                )
