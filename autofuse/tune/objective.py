"""One key's trial objective: compile (time-limited), verify on fresh random inputs, then time.

Every outcome is a TrialRecord: a time for a correct config, or a typed failure (compile error,
out of resources, wrong result, timeout). Nothing a candidate does can crash the tuning run.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable

import torch

from .. import launch
from ..autograd import gated_backward_eager
from ..configs import KernelConfig
from ..device import cuda_index, interpreting
from ..key import TuningKey
from ..reference import (
    ERROR_BOUNDS,
    eager_gated,
    eager_linear,
    eager_mlp,
    gated_reference,
    linear_reference,
    mlp_reference,
    relative_error,
)
from ..store import TrialRecord
from ..timing import cpu_median_ms, gpu_median_ms, graph_replay_us

# Up to this M, trials and the eager baseline are timed replayed from a CUDA graph (what a decode
# step pays); above it, by do_bench's median with L2 flushed between runs.
GRAPH_TIMED_MAX_M = 128

# A candidate is correct when its relative error is within reference.ERROR_BOUNDS and every
# element is finite (outputs are poisoned with NaN before the run).


def _status_of(error: BaseException) -> str:
    name = type(error).__name__
    if name == "OutOfResources" or "out of resource" in str(error).lower():
        return "out_of_resources"
    if name in ("CompilationError", "CompileTimeoutError") or "compil" in name.lower():
        return "compile_error"
    return "error"


class Evaluator:
    """Operands, reference and launchers for one key at one M; evaluates configs on them."""

    def __init__(self, key: TuningKey, M: int, device: torch.device, seed: int = 0,
                 compile_timeout_s: float = 120.0) -> None:
        self.key, self.M, self.device = key, M, device
        self.dtype = key.torch_dtype
        self.compile_timeout_s = compile_timeout_s
        self.interpret = interpreting()
        # Drawn where they are used: fresh inputs for every trial must not cost a host round trip.
        self._generator = torch.Generator(device=device).manual_seed(seed)
        n, k = key.n, key.k
        scale = k**-0.5  # like nn.Linear's init: outputs of order one
        self.gu = None
        if key.op == "gated_bwd":
            # x stands for dY ([M, d_model]); the other operands are the down weight [d_model, d_ff]
            # and the forward's saved pre-activations [G | U] (biases are already inside them).
            self.weights, self.biases = [self._random(k, n) * n**-0.5], []
            self.gu = self._random(M, 2 * n)
        else:
            self.weights = [self._random(n, k) * scale]
            if key.op in ("gated_up", "mlp"):
                self.weights.append(self._random(n, k) * scale)
            if key.op == "mlp":  # the down projection: [d_model, d_ff]
                self.weights.append(self._random(k, n) * n**-0.5)
            self.biases = [self._random(w.shape[0]) for w in self.weights] if key.bias else [None] * len(self.weights)
        self.residual = self._random(M, n) if key.residual else None
        self.out_features = k if key.op == "mlp" else 3 * n if key.op == "gated_bwd" else n
        self.x = self._random(M, k)
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    def _random(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self._generator, device=self.device).to(self.dtype)

    # the op, three ways
    def _launch(self, config: KernelConfig, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if self.key.op == "gated_bwd":  # one [M, 3 d_ff] result: dG | dU | H
            n = self.key.n
            out = launch._allocate((x.shape[0], 3 * n), x) if out is None else out
            launch.gated_backward(x, self.gu, self.weights[0], self.key.activation, config,
                                  out=(out[:, :2 * n], out[:, 2 * n:]))
            return out
        if self.key.op == "mlp":
            return launch.mlp_decode(x, *self.weights, *self.biases, self.key.activation, config, out=out)
        if self.key.op == "gated_up":
            return launch.gated_up(x, *self.weights, *self.biases, self.key.activation, config, out=out)
        return launch.linear(x, self.weights[0], self.biases[0], self.residual, self.key.activation, config, out=out)

    def baseline(self, x: torch.Tensor) -> torch.Tensor:
        """What eager PyTorch runs for this op: cuBLAS GEMM(s) + pointwise."""
        if self.key.op == "gated_bwd":
            return gated_backward_eager(x, self.gu, self.weights[0], self.key.activation)
        if self.key.op == "mlp":
            return eager_mlp(x, *self.weights, *self.biases, self.key.activation)
        if self.key.op == "gated_up":
            return eager_gated(x, *self.weights, *self.biases, self.key.activation)
        return eager_linear(x, self.weights[0], self.biases[0], self.residual, self.key.activation)

    def _reference(self, x: torch.Tensor) -> torch.Tensor:
        if self.key.op == "gated_bwd":
            dgu, h = gated_backward_eager(x.double(), self.gu.double(), self.weights[0].double(), self.key.activation)
            return torch.cat([dgu, h], dim=1)
        if self.key.op == "mlp":  # H rounded to the dtype, as the kernel and eager store it
            return mlp_reference(x, *self.weights, *self.biases, self.key.activation, hidden_dtype=self.dtype)
        if self.key.op == "gated_up":
            return gated_reference(x, *self.weights, *self.biases, self.key.activation)
        return linear_reference(x, self.weights[0], self.biases[0], self.residual, self.key.activation)

    # timing
    def _time(self, fn: Callable[[], object]) -> float:
        if self.interpret:
            return cpu_median_ms(fn, repeats=1)
        if self.M <= GRAPH_TIMED_MAX_M:
            # Decode sizes run for a few microseconds: do_bench's flush and launch gaps would rank
            # configs by overheads a CUDA-graph-replayed decode step never pays (H200: do_bench put
            # gemma-2b's one-launch MLP ahead of the two-kernel path, graph replay the other way).
            return graph_replay_us(fn) / 1e3
        return gpu_median_ms(fn)

    def baseline_ms(self) -> float:
        with torch.no_grad():
            return self._time(lambda: self.baseline(self.x))

    # one trial
    def evaluate(self, config: KernelConfig) -> TrialRecord:
        try:
            compiled = self._compile(config)
            if compiled is not None:
                return compiled
            with torch.no_grad():
                wrong = self._verify(config)
                if wrong is not None:
                    self._clean_up()
                    return TrialRecord(config, "wrong_result", None, wrong)
                return TrialRecord(config, "ok", self._time(lambda: self._launch(config, self.x)))
        except Exception as e:  # any failure is a typed result, never a crash of the run
            self._clean_up()
            return TrialRecord(config, _status_of(e), None, f"{type(e).__name__}: {e}")

    @staticmethod
    def _clean_up() -> None:
        # A broken candidate that used the shared workspace (split-K, the one-launch MLP) may leave
        # partial sums behind; the next trial must not see them. Zeroing is cheap, so always.
        try:
            launch.reset_workspaces()
        except Exception:  # noqa: BLE001 - a dead CUDA context fails the next trial on its own
            pass

    def _compile(self, config: KernelConfig) -> TrialRecord | None:
        """Run the candidate once so Triton compiles it, giving up after compile_timeout_s.

        A compile that overruns keeps going in its abandoned thread (Triton cannot be interrupted);
        the trial is recorded as a timeout and the next one gets a fresh thread."""
        if self.interpret:
            return None  # nothing to compile
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
        future = self._pool.submit(self._compile_and_sync, config)
        try:
            future.result(timeout=self.compile_timeout_s)
        except concurrent.futures.TimeoutError:
            self._pool.shutdown(wait=False)
            self._pool = None
            return TrialRecord(config, "timeout", None, f"compile took over {self.compile_timeout_s:g} s")
        return None

    def _compile_and_sync(self, config: KernelConfig) -> None:
        torch.cuda.set_device(cuda_index(self.device))  # this worker thread needs the device's context current
        with torch.no_grad():
            self._launch(config, self.x)
        torch.cuda.synchronize(self.device)

    def _verify(self, config: KernelConfig) -> str | None:
        """None when correct on fresh inputs; otherwise what was wrong."""
        x = self._random(self.M, self.key.k)
        out = torch.full((self.M, self.out_features), float("nan"), dtype=self.dtype, device=self.device)
        self._launch(config, x, out=out)
        if not torch.isfinite(out).all():
            return f"{(~torch.isfinite(out)).sum().item()} non-finite or unwritten elements"
        ref = self._reference(x)
        error = relative_error(out, ref)
        if not error <= ERROR_BOUNDS[self.dtype]:
            return f"relative error {error:.3g} > {ERROR_BOUNDS[self.dtype]:.3g}"
        return None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)

