"""Host cost per call: what one un-graphed call costs the CPU.

  python benchmarks/host_cost.py [--out DIR] [--calls 2000] [--rounds 7]

Per call: wall time of N back-to-back calls / N (CUDA-synchronised before and after), median of
rounds taken round-robin over the rows of a group so that host drift hits them alike. On the tiny
shape the GPU never waits, so this is host time; on gemma-2b at M=1 it is the plain call's time
(whichever of host and GPU is slower), shown beside the CUDA-graph-replayed GPU time. A host-bound
training step (1344 -> 2688, M = 2048: 270-291 us of GPU time on an H100) per step, forward + backward
with gradients accumulating: eager's, autofuse's, and a bare autograd.Function issuing the same seven
kernels (the floor of any Python Function's host), in the same rounds.
"""

from __future__ import annotations

import tempfile

import harness
import torch
import torch.nn.functional as F
from triton.tools.tensor_descriptor import TensorDescriptor

import autofuse
from autofuse import launch, traffic
from autofuse.choose.lookup import resolve_tuned
from autofuse.configs import KernelConfig
from autofuse.key import Problem
from autofuse.ops.linear import LINEAR
from autofuse.opspec import launch_args
from autofuse.reference import eager_mlp
from autofuse.tools.measure import graph_replay_us, plain_call_us


def _mlp_pair(d: int, f: int):
    mlp = autofuse.get_mlp(d, f, activation="gelu_tanh", dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    w = (mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)
    return mlp, (lambda x: eager_mlp(x, *w, activation="gelu_tanh"))


def tiny_rows(calls: int, rounds: int) -> dict:
    d, f = 64, 128
    mlp, eager = _mlp_pair(d, f)
    lin = autofuse.get_linear(d, f, bias=True, activation="gelu", dtype=torch.bfloat16, device="cuda")
    a = torch.randn(16, d, device="cuda", dtype=torch.bfloat16)
    x = {M: torch.randn(M, d, device="cuda", dtype=torch.bfloat16) for M in (1, 16)}
    # One Triton launch of the linear kernel with prepared arguments: through the JIT, and bound.
    config = KernelConfig(16, 64, 64, group_m=8, num_warps=4, num_stages=3)
    kernel = launch.kernel_for(LINEAR, "none", d, torch.bfloat16, config, False)
    y = torch.empty(1, f, device="cuda", dtype=torch.bfloat16)
    tensors = {"x": x[1], "w": lin.weight, "y": y}
    options = launch.launch_options(config)
    args = launch_args(kernel.parameters, tensors, (1, f, d), options)
    grid = (launch.tiles(1, f, config),)
    with launch.binding() as recorded:
        launch.launch(kernel, grid, tensors, (1, f, d), options)
    bound = recorded[0]
    fns = {
        "torch.add": lambda: torch.add(a, a),
        "F.linear (cuBLAS), M=1": lambda: F.linear(x[1], lin.weight, lin.bias),
        "Triton kernel through kernel[grid](...) (the JIT)": lambda: kernel.fn[grid](*args, **options),
        "the same compiled kernel, bound (BoundLaunch)": lambda: bound(tensors),
        "host TensorDescriptor": lambda: TensorDescriptor(x[16], [16, d], [d, 1], [16, 64]),
    }
    for M in (1, 16):
        fns[f"eager gated MLP (five ops), M={M}"] = lambda M=M: eager(x[M])
        fns[f"autofuse MLP {d}x{f}, M={M}"] = lambda M=M: mlp(x[M])
        fns[f"autofuse Linear {d}->{f} + bias + gelu, M={M}"] = lambda M=M: lin(x[M])
        fns[f"F.gelu(F.linear), M={M}"] = lambda M=M: F.gelu(F.linear(x[M], lin.weight, lin.bias))
    x3 = torch.randn(1, 1, d, device="cuda", dtype=torch.bfloat16)  # [batch, seq, d] as a model passes it
    fns["eager gated MLP (five ops), [1, 1, d] input"] = lambda: eager(x3)
    fns["autofuse MLP, [1, 1, d] input"] = lambda: mlp(x3)
    with torch.inference_mode():
        rows = plain_call_us(fns, calls, rounds, warmup=20)
        rows.update(_recording_rows(mlp, lin, x[1], calls, rounds))
        for M in (1, 16):
            rows[f"autofuse MLP choices, M={M}"] = _choices(mlp, M, d, f)
            rows[f"autofuse Linear choices, M={M}"] = {op: f"{c.config.short()} ({c.source}, {_us(c.time_ms)})"
                                                        for op, c in lin._config_table(M).items()}
            rows[f"autofuse MLP plain-call choices, M={M}"] = _short(mlp.plain_config_for(M))
            rows[f"autofuse Linear plain-call choices, M={M}"] = _short(lin.plain_config_for(M))
    return rows


def _recording_rows(mlp, lin, x: torch.Tensor, calls: int, rounds: int) -> dict:
    """The traffic recorder's host cost on the bound path: the MLP's and the Linear's M = 1 calls with recording
    off and on, in the same rounds (each call sets the recorder, or clears it, first: all pay that alike). On:
    with its default sampling (a module's second call at an M, then one in 64, timed with CUDA events), counting
    only (no call timed after the second), and timing every call (what one timed sample costs)."""
    rows = {}
    with tempfile.TemporaryDirectory() as folder:
        recorders = {"not recorded": None, "traffic recorded": traffic.Recorder(folder),
                     "counted only": traffic.Recorder(folder, sample_every=2**40),
                     "every call timed": traffic.Recorder(folder, sample_every=1)}

        def call(module, recorder):
            traffic.recorder = recorder
            return module(x)

        fns = {f"{name}, {how}": (lambda m=m, r=r: call(m, r))
               for name, m in (("autofuse MLP, M=1", mlp), ("autofuse Linear, M=1", lin))
               for how, r in recorders.items()}
        try:
            times = plain_call_us(fns, calls, rounds, warmup=20)
        finally:
            traffic.recorder = None
    rows.update(times)
    for name in ("autofuse MLP, M=1", "autofuse Linear, M=1"):
        off = times[f"{name}, not recorded"]
        rows[f"traffic recorder's cost per call: {name}"] = times[f"{name}, traffic recorded"] - off
        rows[f"  of which counting: {name}"] = times[f"{name}, counted only"] - off
        rows[f"  one timed sample: {name}"] = times[f"{name}, every call timed"] - off
    return rows


def _short(configs: dict | None) -> dict | None:
    """What an un-graphed call runs (FusedModule.plain_config_for), configs in short form."""
    return None if configs is None else {op: c.short() for op, c in configs.items()}


def _choices(mlp, M: int, d: int, f: int) -> dict:
    """What the module runs at M, each choice with its source and time (µs), and the one-launch MLP's own
    record where one was checked or tuned (what the two-op pair was compared with)."""
    shown = {op: f"{c.config.short()} ({c.origin}, {_us(c.time_ms)})" for op, c in mlp._config_table(M).items()}
    weight = mlp.gate_proj.weight
    one_launch = resolve_tuned(Problem("mlp", f, d, M, weight.dtype, mlp.activation, mlp.gate_proj.bias is not None,
                                       False, weight.device))
    if one_launch is not None and "mlp" not in shown:
        shown["mlp (not chosen)"] = f"{one_launch.config.short()} ({one_launch.origin}, {_us(one_launch.time_ms)})"
    return shown


def _us(ms) -> str:
    return "no time" if ms is None else f"{ms * 1e3:.1f} us"


def gemma_rows(calls: int, rounds: int) -> dict:
    mlp, eager = _mlp_pair(2048, 16384)
    x = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        rows = {f"gemma-2b M=1 plain call: {k}": v for k, v in plain_call_us({"eager": lambda: eager(x),
                                                                          "autofuse": lambda: mlp(x)},
                                                                         calls, rounds, warmup=20).items()}
        rows["gemma-2b M=1 graph replay: eager"] = graph_replay_us(lambda: eager(x))
        rows["gemma-2b M=1 graph replay: autofuse"] = graph_replay_us(lambda: mlp(x))
        rows["gemma-2b M=1 choices"] = {k: f"{v.short()} ({mlp.config_sources(1)[k]})" for k, v in
                                        mlp.config_for(1).items()}
        rows["gemma-2b M=1 plain-call choices"] = _short(mlp.plain_config_for(1))
    return rows


class _BareStep(torch.autograd.Function):
    """The seven kernels of a one-buffer SwiGLU training step, nothing else: G | U by one GEMM over the stacked
    weights, H = silu(G) * U (torch ops), the down projection; dWd, dH, one pass, dX and [dWg; dWu]. The backward's
    pass is one multiply standing in for the fused dG, dU pass (one launch, as autofuse's is), so the output and dWd
    are the step's and dX, dWg and dWu are not: a measure of host work, not a training step to use."""

    @staticmethod
    def forward(ctx, x, w_gate, w_up, w_down):
        f = w_gate.shape[0]
        w = w_gate.as_strided((2 * f, w_gate.shape[1]), w_gate.stride())
        gu = torch.mm(x, w.t())
        h = torch.mul(F.silu(gu[:, :f]), gu[:, f:])
        ctx.save_for_backward(x, w, w_down)
        ctx.kept = [gu, h]
        return torch.mm(h, w_down.t())

    @staticmethod
    def backward(ctx, dy):
        x, w, w_down = ctx.saved_tensors
        gu, h = ctx.kept
        f = w.shape[0] // 2
        dw_down = torch.mm(dy.t(), h)
        dh = torch.mm(dy, w_down)
        torch.mul(dh, gu[:, f:], out=gu[:, :f])
        dw = torch.mm(gu.t(), x)
        return torch.mm(gu, w), dw[:f], dw[f:], dw_down


def training_rows(steps: int, rounds: int) -> dict:
    d, f, M = 1344, 2688, 2048
    mlp = autofuse.get_mlp(d, f, activation="silu", dtype=torch.bfloat16, device="cuda")
    x = torch.randn(M, d, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    dy = torch.randn(M, d, dtype=torch.bfloat16, device="cuda")
    stacked = torch.randn(2, f, d, dtype=torch.bfloat16, device="cuda") * d ** -0.5
    w_gate, w_up = torch.nn.Parameter(stacked[0]), torch.nn.Parameter(stacked[1])
    w_gate.data, w_up.data = stacked[0], stacked[1]  # the halves of one buffer, as the module keeps them
    w_down = torch.nn.Parameter(torch.randn(d, f, dtype=torch.bfloat16, device="cuda") * f ** -0.5)
    fns = {"training step 1344 -> 2688, M=2048: eager":
           lambda: F.linear(F.silu(F.linear(x, w_gate)) * F.linear(x, w_up), w_down).backward(dy),
           "training step 1344 -> 2688, M=2048: autofuse": lambda: mlp(x).backward(dy),
           "training step 1344 -> 2688, M=2048: bare autograd.Function": lambda: _BareStep.apply(
               x, w_gate, w_up, w_down).backward(dy)}
    return plain_call_us(fns, steps, rounds, warmup=10, rotate=True)


def main() -> None:
    parser = harness.parser(__doc__)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    meta = dict(cpu=_cpu_name())
    rows = {**tiny_rows(args.calls, args.rounds), **gemma_rows(args.calls // 4, args.rounds),
            **training_rows(max(args.calls // 20, 10), args.rounds)}
    for name, value in rows.items():
        print(f"{name:56s} {value:8.1f} us" if isinstance(value, float) else f"{name:56s} {value}", flush=True)
    harness.write(harness.out_dir(args.out), "host_cost.json", dict(meta=meta, rows=rows))


def _cpu_name() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown"


if __name__ == "__main__":
    main()
