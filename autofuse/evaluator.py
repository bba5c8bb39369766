"""One key's trial objective (the tuner's, and a first-use check's: choose/check.py): compile
(time-limited), verify on fresh random inputs, then time.

Every outcome is a TrialRecord: a time for a correct config, or a typed failure (compile error,
out of resources, wrong result, timeout). Nothing a candidate does can crash the tuning run. The
operands, the kernel, the library candidates and the float64 reference all come from the key's
OpSpec, so any registered op is tuned the same way.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
from collections.abc import Callable

import torch

from . import compile_workers, workspaces
from .configs import KernelConfig, Library
from .device import cuda_index, interpreting
from .errors import AutofuseError
from .key import TuningKey
from .reference import ERROR_BOUNDS, relative_error
from .store import TrialRecord
from .timing import cpu_median_ms, graph_median_ms, graph_side_by_side_ms

logger = logging.getLogger("autofuse")

# Trials and library candidates are timed replayed from a CUDA graph at every M: the GPU time a step
# pays, which is what the "never slower" sweep compares (benchmarks/never_slower.py). do_bench's L2
# flush between runs and its launch gaps ranked configs by costs a replayed or back-to-back step never
# pays: at decode sizes, and also at M of a few hundred to a thousand, where a flushed do_bench put a
# gated up-projection at well over the whole graph-replayed MLP's time and chose the eager library path
# over a faster one (docs/design.md, "Timing"). How long each candidate is timed is the caller's: the
# DecisionPolicy's trial_budget_ms (tuning) or check_budget_ms (a first-use check).


def bytes_needed(key: TuningKey, M: int) -> int:
    """Memory a key's trials hold at once: the operands, fresh activations, a NaN-poisoned output and
    its float64 reference. Worked out on meta tensors: nothing is allocated."""
    spec, dtype = key.spec, key.torch_dtype
    operands = spec.make_operands(key.n, key.k, M, key.bias, key.residual,
                                  lambda *shape: torch.empty(*shape, device="meta", dtype=dtype))
    held = sum(t.numel() * t.element_size() for t in operands.values() if t is not None)
    fresh = next(iter(operands.values())).numel() * dtype.itemsize
    return held + fresh + M * spec.output_width(key.n, key.k) * (dtype.itemsize + 8)


def _check_memory(key: TuningKey, M: int, device: torch.device) -> None:
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
    else:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    needed = bytes_needed(key, M)
    if needed > free:
        raise AutofuseError(f"{key.op} with n={key.n}, k={key.k} at M={M} needs about {needed / 2**30:.1f} GiB "
                            f"to tune; {free / 2**30:.1f} GiB are free on {device}")


def _status_of(error: BaseException) -> str:
    name = type(error).__name__
    if name == "OutOfResources" or "out of resource" in str(error).lower():
        return "out_of_resources"
    if name in ("CompilationError", "CompileTimeoutError") or "compil" in name.lower():
        return "compile_error"
    return "error"


class Evaluator:
    """Operands, reference and candidates for one key at one M; evaluates configs on them.

    A candidate is correct when its relative error is within reference.ERROR_BOUNDS and every
    element is finite (outputs are poisoned with NaN before the run)."""

    def __init__(self, key: TuningKey, M: int, device: torch.device, seed: int = 0,
                 compile_timeout_s: float = 120.0, budget_ms: float = 100.0) -> None:
        self.key, self.M, self.device = key, M, device
        self.budget_ms = budget_ms  # GPU time each candidate is timed for
        self.spec = key.spec
        self.dtype = key.torch_dtype
        self.compile_timeout_s = compile_timeout_s
        self.interpret = interpreting()
        _check_memory(key, M, device)
        # Drawn where they are used: fresh inputs for every trial must not cost a host round trip.
        self._generator = torch.Generator(device=device).manual_seed(seed)
        self.operands = self.spec.make_operands(key.n, key.k, M, key.bias, key.residual, self._random)
        self._input = next(iter(self.operands))  # the activations, drawn fresh for every check
        self.out_features = self.spec.output_width(key.n, key.k)
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._original_error = ""  # the last check's errors, where the op's weights are quantized (spec)

    def _random(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self._generator, device=self.device).to(self.dtype)

    def _with_input(self, x: torch.Tensor) -> dict:
        return {**self.operands, self._input: x}

    def _launch(self, config: KernelConfig, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.spec.run(self._with_input(x), self.key.activation, config, out=out)

    def library(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """The op's library candidate `name` on these operands."""
        return self.spec.library_candidate(name)(self._with_input(x), self.key.activation)

    def _reference(self, x: torch.Tensor) -> torch.Tensor:
        return self.spec.reference(self._with_input(x), self.key.activation, self.dtype)

    def _time(self, fn: Callable[[], object]) -> float:
        if self.interpret:
            return cpu_median_ms(fn, repeats=1)
        return graph_median_ms(fn, self.budget_ms)

    def runner(self, config: KernelConfig | Library) -> Callable[[], object]:
        """A call of a kernel config or a library candidate on this key's operands (for timing)."""
        x = self.operands[self._input]
        if isinstance(config, Library):
            return lambda: self.library(config.name, x)
        return lambda: self._launch(config, x)

    def side_by_side_ms(self, fns: dict[str, Callable[[], object]]) -> dict[str, float]:
        """Times of several calls replayed in turn (timing.graph_side_by_side_ms), each with this
        evaluator's timing budget."""
        return graph_side_by_side_ms(fns, self.budget_ms)

    def retimed_side_by_side(self, record: TrialRecord | None, library_ms: dict[str, float],
                             names: list[str], rivals: list[TrialRecord] = ()
                             ) -> tuple[TrialRecord | None, dict[str, float]]:
        """(record, library_ms) with the kernel of `record` (None: the library candidates alone), the kernels of
        `rivals` and the library candidates `names` timed again side by side, replayed in turn (side_by_side_ms):
        each was timed on its own before, and one timed during a moment of higher clocks could win over one that
        is faster in place. The record returned is the fastest kernel's, with its time from these rounds."""
        kernels = [] if record is None else [record, *rivals]
        fns = {("kernel" if i == 0 else f"kernel {i + 1}"): self.runner(r.config) for i, r in enumerate(kernels)}
        times = self.side_by_side_ms({**fns, **{f"library:{name}": self.runner(Library(name)) for name in names}})
        retimed = [dataclasses.replace(r, time_ms=times[name]) for r, name in zip(kernels, fns)]
        return (min(retimed, key=lambda r: r.time_ms) if retimed else None,
                {**library_ms, **{name: times[f"library:{name}"] for name in names}})

    def library_ms(self) -> dict[str, float]:
        """Each library candidate that computes this key, checked like a trial and timed like one.
        A wrong one is left out (logged); eager, what the user's model runs anyway, always stays."""
        key = self.key
        times = {}
        with torch.no_grad():
            for name in self.spec.library_for(key.activation, key.bias, key.residual):
                try:
                    wrong = None if name == "eager" else self._verify_library(name)
                except Exception as e:  # noqa: BLE001 - one that cannot run this key is left out, not fatal
                    logger.info("library candidate %s of %s cannot run here (%s: %s)", name, key.op,
                                type(e).__name__, e)
                    continue
                if wrong is not None:
                    logger.warning("library candidate %s of %s left out: %s", name, key.op, wrong)
                    continue
                times[name] = self._time(self.runner(Library(name)))
        return times

    def _verify_library(self, name: str) -> str | None:
        """Why library candidate `name` is wrong here, or None; raises where it cannot run this key at all
        (torch._scaled_mm at sizes that are not multiples of 16)."""
        x = self._random(*self.operands[self._input].shape)
        return self._check(self.library(name, x), x)

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
                if self._original_error:
                    logger.info("%s %s: %s", self.key.op, config.short(), self._original_error)
                return TrialRecord(config, "ok", self._time(self.runner(config)), self._original_error)
        except Exception as e:  # any failure is a typed result, never a crash of the run
            self._clean_up()
            return TrialRecord(config, _status_of(e), None, f"{type(e).__name__}: {e}")

    @staticmethod
    def _clean_up() -> None:
        # A broken candidate that used the shared workspace (split-K, the one-launch MLP) may leave
        # partial sums behind; the next trial must not see them. Zeroing is cheap, so always.
        try:
            workspaces.reset_workspaces()
        except Exception:  # noqa: BLE001 - a dead CUDA context fails the next trial on its own
            pass

    def precompile_library(self) -> None:
        """Run each library candidate but eager once, so that the Triton pass a library path launches (a GEMM +
        one pointwise pass) is compiled before library_ms times it: a check's precompile threads run this beside
        the kernels' compiles. A candidate that cannot run is left to library_ms, which reports it."""
        if self.interpret:
            return
        key = self.key
        x = self._random(*self.operands[self._input].shape)
        with torch.no_grad():
            for name in self.spec.library_for(key.activation, key.bias, key.residual):
                if name == "eager":
                    continue
                try:
                    self.library(name, x)
                except Exception as e:  # noqa: BLE001 - library_ms meets and reports the same failure
                    logger.debug("precompiling library candidate %s failed (%s: %s)", name, type(e).__name__, e)
        torch.cuda.synchronize(self.device)

    def precompile(self, config: KernelConfig, background: bool = False) -> None:
        """Compile `config`'s kernel for this key (Triton's cache keeps it for the trial or check that follows): in
        an idle compile worker where one is ready (compile_workers), then here, which then only loads it. With
        `background`, a worker's compile goes on after this returns, and this key's own compile of `config` at M
        (_compile: a check's trial) waits for it first."""
        if self.interpret:
            return
        with torch.cuda.device(cuda_index(self.device)), torch.no_grad():
            def launch():
                return self._launch(config, self.operands[self._input])
            if background and compile_workers.compile_ahead_in_background(launch, self.compile_timeout_s,
                                                                           (self.key, self.M, config)):
                return
            compile_workers.compile_ahead(launch, self.compile_timeout_s)
        self._compile(config)

    def precompile_all(self, configs: list[KernelConfig], threads: int) -> None:
        """Compile the kernels of `configs` at once on `threads` threads, for the trials that follow (a kernel's
        compile is most of a trial's time, and much of it runs outside Python: LLVM and ptxas). A compile that
        fails or overruns compile_timeout_s is left to its trial, which reports it; the partial sums the
        compiling launches left in the shared workspace are cleared before any trial runs."""
        if self.interpret or len(configs) < 2:
            return
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, threads),
                                                     thread_name_prefix="autofuse-precompile")
        try:
            futures = [pool.submit(self._compile_and_sync, config) for config in configs]
            for future in futures:
                try:
                    future.result(timeout=self.compile_timeout_s)
                except concurrent.futures.TimeoutError:
                    break  # its trial times out on its own; the rest compile in their trials
                except Exception as e:  # noqa: BLE001 - the trial meets and records the same failure
                    logger.debug("precompiling a trial failed (%s: %s)", type(e).__name__, e)
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
        self._clean_up()

    def _compile(self, config: KernelConfig) -> TrialRecord | None:
        """Run the candidate once so Triton compiles it, giving up after compile_timeout_s.

        A compile that overruns keeps going in its abandoned thread (Triton cannot be interrupted);
        the trial is recorded as a timeout and the next one gets a fresh thread."""
        if self.interpret:
            return None  # nothing to compile
        compile_workers.wait_for((self.key, self.M, config), self.compile_timeout_s)  # a worker compiling it
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
        with torch.cuda.device(cuda_index(self.device)), torch.no_grad():
            self._launch(config, self.operands[self._input])
            torch.cuda.synchronize(self.device)

    def _verify(self, config: KernelConfig) -> str | None:
        """None when correct on fresh inputs; otherwise what was wrong."""
        x = self._random(*self.operands[self._input].shape)
        out = torch.full((self.M, self.out_features), float("nan"), dtype=self.dtype, device=self.device)
        self._launch(config, x, out=out)
        return self._check(out, x)

    def _check(self, out: torch.Tensor, x: torch.Tensor) -> str | None:
        self._original_error = ""
        if not torch.isfinite(out).all():
            return f"{(~torch.isfinite(out)).sum().item()} non-finite or unwritten elements"
        error = relative_error(out, self._reference(x))
        if not error <= ERROR_BOUNDS[self.dtype]:
            return f"relative error {error:.3g} > {ERROR_BOUNDS[self.dtype]:.3g}"
        original = self.spec.original_reference
        if original is not None:  # what the quantized weights cost, reported with the trial (not a bound)
            self._original_error = (f"relative error {error:.3g} against the float64 reference, "
                                    f"{relative_error(out, original(self._with_input(x), self.key.activation)):.3g} "
                                    "against the weights before quantization")
        return None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
