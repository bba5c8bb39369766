"""`autofuse bench`: one runner, many providers, for the forward of each shape at each M.

Each provider only builds a callable for a case; the runner checks every provider against the
float64 reference before timing it, times all providers side by side in this process (GPU:
do_bench median with L2 flushed; at M <= 128, and wherever do_bench's median is under 0.5 ms,
also host time per call and CUDA-graph replay time), and puts each number beside the roofline:
max(FLOPs / measured GEMM rate, bytes / measured copy bandwidth), both ceilings measured in the
same run.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

from ..activations import TORCH_ACTIVATIONS
from ..device import interpreting
from ..modules import get_linear, get_mlp
from ..reference import (
    ERROR_BOUNDS,
    eager_linear,
    eager_mlp,
    linear_reference,
    mlp_reference_rounded,
    relative_error,
)
from ..shapes import LinearShape, MLPShape, ShapeSet
from ..timing import cpu_median_ms
from .measure import gpu_median_ms, graph_replay_us, host_us_per_call

SMALL_M = 128
# Below this do_bench median a forward can be launch-bound (host time above GPU time): then the
# CUDA-graph replay time is measured too and stands for the GPU time.
LAUNCH_BOUND_MS = 0.5


@dataclasses.dataclass
class Case:
    shape: MLPShape | LinearShape
    M: int
    dtype: torch.dtype
    device: str
    x: torch.Tensor
    params: dict[str, torch.Tensor | None]

    @property
    def is_mlp(self) -> bool:
        return isinstance(self.shape, MLPShape)

    def flops(self) -> int:
        s = self.shape
        return 2 * self.M * s.d_model * s.d_ff * 3 if self.is_mlp else 2 * self.M * s.in_features * s.out_features

    def min_bytes(self) -> int:
        """Every weight, the input and the output moved once."""
        size = self.dtype.itemsize
        weights = sum(p.numel() for p in self.params.values() if p is not None)
        out = self.M * (self.shape.d_model if self.is_mlp else self.shape.out_features)
        return size * (weights + self.x.numel() + out)

    def reference(self) -> torch.Tensor:
        p = self.params
        if self.is_mlp:
            weights = (p["gate"], p["up"], p["down"], p["gate_b"], p["up_b"], p["down_b"])
            return mlp_reference_rounded(self.x, weights, self.shape.activation, self.dtype)
        return linear_reference(self.x, p["weight"], p["bias"], None, self.shape.activation)


def make_case(shape, M: int, dtype: torch.dtype, device: str, generator: torch.Generator) -> Case:
    def rand(*size, scale=1.0):
        return (torch.randn(*size, generator=generator, device=device) * scale).to(dtype)

    if isinstance(shape, MLPShape):
        d, f = shape.d_model, shape.d_ff
        params = {"gate": rand(f, d, scale=d**-0.5), "up": rand(f, d, scale=d**-0.5), "down": rand(d, f, scale=f**-0.5),
                  "gate_b": rand(f) if shape.bias else None, "up_b": rand(f) if shape.bias else None,
                  "down_b": rand(d) if shape.bias else None}
        width = d
    else:
        params = {"weight": rand(shape.out_features, shape.in_features, scale=shape.in_features**-0.5),
                  "bias": rand(shape.out_features) if shape.bias else None}
        width = shape.in_features
    return Case(shape, M, dtype, device, rand(M, width), params)


# Providers: name -> build(case) returning a callable, or a string saying why it is unavailable.
def _eager(case: Case):
    p = case.params
    if case.is_mlp:
        return lambda: eager_mlp(case.x, p["gate"], p["up"], p["down"], p["gate_b"], p["up_b"], p["down_b"],
                                 case.shape.activation)
    return lambda: eager_linear(case.x, p["weight"], p["bias"], None, case.shape.activation)


def _eager_merged(case: Case):
    if not case.is_mlp:
        return "MLP only"
    p = case.params
    merged = torch.cat([p["gate"], p["up"]])  # one GEMM for gate and up, as some model ports do
    merged_b = None if p["gate_b"] is None else torch.cat([p["gate_b"], p["up_b"]])
    act = TORCH_ACTIVATIONS[case.shape.activation]

    def run():
        gate, up = F.linear(case.x, merged, merged_b).chunk(2, dim=-1)
        return F.linear(act(gate) * up, p["down"], p["down_b"])
    return run


def _torch_compile(case: Case):
    if interpreting() or case.device != "cuda":
        return "GPU only here (Inductor on the CPU says nothing about GPU speed)"
    return torch.compile(_eager(case))


def _liger(case: Case):
    if not case.is_mlp:
        return "MLP only"
    if interpreting() or case.device != "cuda":
        return "GPU only"
    try:
        if case.shape.activation == "gelu_tanh":
            from liger_kernel.ops.geglu import LigerGELUMulFunction as gated
        elif case.shape.activation == "silu":
            from liger_kernel.ops.swiglu import LigerSiLUMulFunction as gated
        else:
            return f"Liger has no {case.shape.activation} gate"
    except ImportError:
        return "liger-kernel not installed"
    p = case.params
    return lambda: F.linear(gated.apply(F.linear(case.x, p["gate"], p["gate_b"]), F.linear(case.x, p["up"], p["up_b"])),
                            p["down"], p["down_b"])


def _autofuse(tuned: bool):
    def build(case: Case):
        s, p = case.shape, case.params
        if case.is_mlp:
            module = get_mlp(s.d_model, s.d_ff, activation=s.activation, bias=s.bias, dtype=case.dtype,
                             device=case.device, tuned=tuned)
            with torch.no_grad():
                for name in ("gate", "up", "down"):
                    layer = getattr(module, f"{name}_proj")
                    layer.weight.copy_(p[name])
                    if layer.bias is not None:
                        layer.bias.copy_(p[f"{name}_b"])
        else:
            module = get_linear(s.in_features, s.out_features, bias=s.bias, activation=s.activation,
                                dtype=case.dtype, device=case.device, tuned=tuned)
            with torch.no_grad():
                module.weight.copy_(p["weight"])
                if module.bias is not None:
                    module.bias.copy_(p["bias"])
        return lambda: module(case.x)
    return build


PROVIDERS: dict[str, Callable] = {
    "eager": _eager,
    "eager-merged": _eager_merged,
    "torch.compile": _torch_compile,
    "liger": _liger,
    "autofuse-heuristic": _autofuse(tuned=False),
    "autofuse-tuned": _autofuse(tuned=True),
}


def measure_ceilings() -> dict[str, float]:
    """Copy bandwidth (bytes read + written) and bf16 GEMM rate, measured now on this GPU."""
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    copy_ms = gpu_median_ms(lambda: dst.copy_(src))
    a, b = (torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    mm_ms = gpu_median_ms(lambda: a @ b)
    return {"copy_GBps": 2 * n / copy_ms / 1e6, "gemm_TFLOPs": 2 * 8192**3 / mm_ms / 1e9}


def run_bench(shapes: ShapeSet, providers: list[str], device: str, seed: int = 0, rounds: int = 3) -> Iterator[dict]:
    """Yield one row per (shape, M, provider).

    On a GPU the providers of a case are timed in `rounds` interleaved rounds, the order rotated
    each round, and each provider keeps its median over rounds: timed in a fixed order, the last
    provider ran up to 9% slower than identical code timed first (H200, large M: clocks fall
    under sustained GEMM load).
    """
    on_gpu = device == "cuda" and not interpreting()
    ceilings = measure_ceilings() if on_gpu else None
    generator = torch.Generator(device=device).manual_seed(seed)
    for shape in (*shapes.mlps, *shapes.linears):
        for M in shapes.tokens:
            case = make_case(shape, M, shapes.dtype, device, generator)
            ref = case.reference()
            roofline = None
            if ceilings:
                roofline = max(case.flops() / (ceilings["gemm_TFLOPs"] * 1e9),
                               case.min_bytes() / (ceilings["copy_GBps"] * 1e6))
            rows, runnable = [], []
            for name in providers:
                row = {"shape": shape.name, "kind": "mlp" if case.is_mlp else "linear", "M": M,
                       "dtype": str(shapes.dtype).removeprefix("torch."), "provider": name,
                       "roofline_ms": roofline, **(ceilings or {})}
                rows.append(row)
                with torch.no_grad():
                    fn = PROVIDERS[name](case)
                    if isinstance(fn, str):
                        row.update(status="unavailable", detail=fn)
                        continue
                    out = fn()
                    error = relative_error(out, ref)
                row["rel_error"] = error
                if not (math.isfinite(error) and error <= ERROR_BOUNDS[shapes.dtype]):
                    row.update(status="wrong", detail=f"relative error {error:.3g}")
                    continue
                row["status"] = "ok"
                runnable.append((row, fn))
            _time_interleaved(runnable, M, on_gpu, rounds if on_gpu else 1)
            yield from rows


def _time_interleaved(runnable: list, M: int, on_gpu: bool, rounds: int) -> None:
    samples: dict[int, dict[str, list[float]]] = {id(row): {} for row, _ in runnable}
    with torch.no_grad():
        for r in range(rounds):
            shift = r % max(len(runnable), 1)
            for row, fn in runnable[shift:] + runnable[:shift]:
                got = samples[id(row)]
                if not on_gpu:
                    got.setdefault("ms", []).append(cpu_median_ms(fn, repeats=1))
                    continue
                ms = gpu_median_ms(fn)
                got.setdefault("ms", []).append(ms)
                if M <= SMALL_M or ms < LAUNCH_BOUND_MS:
                    got.setdefault("host_us", []).append(host_us_per_call(fn))
                    got.setdefault("graph_us", []).append(graph_replay_us(fn))
    for row, _ in runnable:
        for metric, values in samples[id(row)].items():
            row[metric] = statistics.median(values)


def gpu_ms(row: dict) -> float:
    """The row's GPU time: CUDA-graph replay where measured (M <= 128 or a do_bench median under
    LAUNCH_BOUND_MS, where do_bench's number can be launch-bound), else the do_bench median."""
    return row["graph_us"] / 1e3 if "graph_us" in row else row["ms"]


def plot(rows: list[dict], path: str) -> str | None:
    """GPU time over roofline against M, one panel per shape; returns the path, or None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    providers = list(dict.fromkeys(r["provider"] for r in rows))
    fig, axes = plt.subplots(1, len(shapes), figsize=(4.5 * len(shapes), 3.6), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        for i, provider in enumerate(providers):
            pts = [(r["M"], gpu_ms(r) / r["roofline_ms"]) for r in rows
                   if r["shape"] == shape and r["provider"] == provider and r["status"] == "ok" and r["roofline_ms"]]
            if pts:  # one fixed colour per provider across panels
                ax.plot(*zip(*pts), marker="o", color=f"C{i}", label=provider)
        ax.set_xscale("log", base=2)
        ax.set_title(shape)
        ax.set_xlabel("M (tokens)")
        ax.set_ylabel("GPU time / roofline")
        ax.axhline(1.0, color="gray", lw=0.8)
    axes[0][0].legend(fontsize=7)
    fig.text(0.5, 0.005, "GPU time: CUDA-graph replay at M <= 128 or under 0.5 ms, else do_bench median (L2 flushed)",
             ha="center", fontsize=7)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path, dpi=120)
    return path
