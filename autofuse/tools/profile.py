"""`autofuse profile`: torch.profiler over eager PyTorch, torch.compile and autofuse for one MLP or
Linear at chosen M, side by side: kernels launched per forward, GPU time, host time, the top
kernels, and the memory traffic the kernels imply; one Chrome trace per run (Perfetto, TensorBoard).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import tempfile
from pathlib import Path

import torch

from ..dispatch import up_op_of
from ..modules import get_linear, get_mlp
from ..reference import eager_linear, eager_mlp
from ..shapes import LinearShape, MLPShape
from .measure import host_us_per_call

PROVIDERS = ("eager", "torch.compile", "autofuse")


@dataclasses.dataclass
class ProfileRow:
    case: str
    M: int
    provider: str
    kernels_per_forward: float | None  # GPU kernels (None on a CPU: nothing runs on a device)
    gpu_us: float | None  # sum of kernel durations per forward
    host_us: float  # wall time of one forward on the host, launches queued (medians)
    traffic_mb: float  # bytes the provider's kernels must move, by their structure (see _traffic)
    top_kernels: list[tuple[str, float]]  # (name, us per forward), longest first
    ranges: list[str]  # autofuse's profiler ranges: op, activation and each kernel's config
    trace: str


def _traffic(shape, provider: str, M: int, itemsize: int, choices: dict | None) -> float:
    """Megabytes read + written by the kernels each provider launches for one forward (weights read
    once, every intermediate written and read back once). Eager: GEMMs for G and U, act(G), the
    product, the down GEMM; torch.compile: the same GEMMs with one fused pointwise kernel; autofuse:
    G, U and act never reach memory (gated_up writes H), or with the one-launch kernel not even H;
    an op autofuse's tuning gave to PyTorch counts as eager's."""
    if isinstance(shape, LinearShape):
        n, k = shape.out_features, shape.in_features
        weights, x, y = n * k, M * k, M * n
        fused = provider == "autofuse" and choices and choices["linear"].kernel is not None
        extra = 0 if fused or shape.activation == "none" else 2 * M * n  # a pointwise kernel: Z in, Y out
        return (weights + x + y + extra) * itemsize / 1e6
    d, f = shape.d_model, shape.d_ff
    weights = 3 * d * f
    gemms = 2 * M * d + 2 * M * f + M * f + M * d  # X read by 2 GEMMs, G and U written, H read, Y written
    eager_hidden = 2 * M * f + 3 * M * f  # act: read G, write A; product: read A and U, write H
    if provider == "eager":
        hidden = eager_hidden
    elif provider == "torch.compile":
        hidden = 3 * M * f  # one pointwise kernel: read G and U, write H
    elif "mlp" in (choices or {}):
        gemms, hidden = M * d + M * d, 0  # one launch: X in, Y out
    elif choices[up_op_of(choices)].kernel is None:  # tuning gave the gated part to a library path: eager's traffic
        hidden = eager_hidden
    else:
        gemms, hidden = M * d + M * f + M * f + M * d, 0  # gated_up: X in, H out; down: H in, Y out
    return (weights + gemms + hidden) * itemsize / 1e6


@contextlib.contextmanager
def _without_usdt_lines():
    """torch's profiler (kineto, in C++) writes a "USDT:" line to stderr at every start and stop, and
    no switch silences it: pass stderr's other lines through, drop those."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            for line in captured.read().decode(errors="replace").splitlines(keepends=True):
                if not line.startswith("USDT:"):
                    sys.stderr.write(line)


def profile_case(shape, M: int, dtype: torch.dtype, device: torch.device, out_dir: Path,
                 providers=PROVIDERS, iters: int = 20) -> list[ProfileRow]:
    torch.manual_seed(0)
    if isinstance(shape, MLPShape):
        module = get_mlp(shape.d_model, shape.d_ff, activation=shape.activation, bias=shape.bias,
                                  dtype=dtype, device=device)
        p = [module.gate_proj.weight, module.up_proj.weight, module.down_proj.weight]
        b = [module.gate_proj.bias, module.up_proj.bias, module.down_proj.bias]

        def eager(x):
            return eager_mlp(x, *p, *b, activation=shape.activation)
        k = shape.d_model
    else:
        module = get_linear(shape.in_features, shape.out_features, activation=shape.activation,
                                     bias=shape.bias, dtype=dtype, device=device)

        def eager(x):
            return eager_linear(x, module.weight, module.bias, None, shape.activation)
        k = shape.in_features
    with torch.no_grad():
        for param in module.parameters():  # weights of nn.Linear scale: outputs of order one
            param.copy_(torch.randn_like(param) / param.shape[-1] ** 0.5)
    x = torch.randn(M, k, device=device, dtype=dtype)
    fns = {"eager": eager, "torch.compile": torch.compile(eager), "autofuse": module}
    on_gpu = device.type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if on_gpu else [])
    rows = []
    for provider in providers:
        fn = fns[provider]
        with torch.no_grad():
            for _ in range(3):  # compile, resolve, warm caches
                fn(x)
            if on_gpu:
                torch.cuda.synchronize(device)
            host = host_us_per_call(lambda fn=fn: fn(x), calls=30)
            with _without_usdt_lines(), torch.profiler.profile(activities=activities) as prof:
                for _ in range(iters):
                    fn(x)
                if on_gpu:
                    torch.cuda.synchronize(device)
        trace = out_dir / f"{shape.name}-M{M}-{provider.replace('.', '_')}.json"
        prof.export_chrome_trace(str(trace))
        # GPU-side events, less the user annotations that mirror record_function ranges on the GPU
        # timeline (autofuse's own "autofuse::..." range among them): kernels, memcpys, memsets.
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                   and not getattr(e, "is_user_annotation", False) and not e.name.startswith("autofuse::")]
        per_kernel: dict[str, float] = {}
        for e in kernels:
            per_kernel[e.name] = per_kernel.get(e.name, 0.0) + e.device_time_total / iters
        top = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:5]
        ranges = sorted({e.name for e in prof.events() if e.name.startswith("autofuse::")})
        choices = module._config_table(M) if provider == "autofuse" else None
        rows.append(ProfileRow(shape.name, M, provider, len(kernels) / iters if on_gpu else None,
                               sum(per_kernel.values()) if on_gpu else None, host,
                               _traffic(shape, provider, M, dtype.itemsize, choices), top, ranges, str(trace)))
    return rows


def format_rows(rows: list[ProfileRow]) -> str:
    lines = [f"{'case':<24} {'M':>6} {'provider':<14} {'kernels':>7} {'GPU us':>9} {'host us':>8} {'traffic MB':>10}"
             "  top kernels (us per forward)"]
    for r in rows:
        kernels = "-" if r.kernels_per_forward is None else f"{r.kernels_per_forward:.0f}"
        gpu = "-" if r.gpu_us is None else f"{r.gpu_us:.1f}"
        top = ", ".join(f"{name[:48]} {us:.1f}" for name, us in r.top_kernels[:3]) or "-"
        lines.append(f"{r.case:<24} {r.M:>6} {r.provider:<14} {kernels:>7} {gpu:>9} {r.host_us:>8.1f} "
                     f"{r.traffic_mb:>10.2f}  {top}")
        lines += [f"{'':<24} {'':>6} {'':<14} ran: {name}" for name in r.ranges]
    return "\n".join(lines)
