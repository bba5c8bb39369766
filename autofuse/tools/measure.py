"""Measurement helpers of the measuring commands (bench, demo, profile) and the benchmark suites: do_bench
medians (L2 flushed between runs by Triton), host time per call, plain calls timed in turn, CUDA-graph replay
time at a fixed number of calls per graph, the Python profile of a call, and Triton's launch hooks. The
runtime never imports these."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from ..timing import captured, replayed_in_turn, synchronize


def gpu_median_ms(fn: Callable[[], object], warmup_ms: int = 25, rep_ms: int = 100) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def host_us_sample(fn: Callable[[], object], calls: int = 10) -> float:
    """Host time of one call over a batch of `calls`, launches queued but not awaited; synchronised
    after the batch, which bounds the queue."""
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    synchronize()
    return elapsed / calls * 1e6


def host_us_per_call(fn: Callable[[], object], calls: int = 200) -> float:
    """Median host time of one call, launches queued but not awaited: the CPU cost a user pays per
    forward when the GPU keeps up. Batches of 10 calls (host_us_sample) after 10 warm-up calls."""
    for _ in range(10):
        fn()
    synchronize()
    return statistics.median(host_us_sample(fn) for _ in range(calls // 10))


_WAIT_CYCLES_PER_MS: dict[int, float] = {}


def _wait_cycles_per_ms() -> float:
    """Clock cycles of torch.cuda._sleep (a busy-wait kernel) per ms of GPU time on the current device, measured
    once per device."""
    device = torch.cuda.current_device()
    if device not in _WAIT_CYCLES_PER_MS:
        torch.cuda._sleep(1_000_000)  # warm up the kernel
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(10_000_000)
        end.record()
        end.synchronize()
        _WAIT_CYCLES_PER_MS[device] = 10_000_000 / start.elapsed_time(end)
    return _WAIT_CYCLES_PER_MS[device]


def gpu_us_host_ahead(fn: Callable[[], object], calls: int = 4) -> float | None:
    """GPU time of one call, from `calls` calls queued behind a busy-wait kernel long enough for the host to issue
    them all before the GPU reaches the first: the GPU's own time, none of it spent waiting for the host. Beside
    the host's time to issue a call, it tells a host-bound step (host above GPU) from a GPU-bound one. None where
    the host still fell behind (it took longer to issue the calls than the wait lasted)."""
    synchronize()
    wait_ms = 2 * host_us_sample(fn, calls) * calls / 1e3 + 2.0
    before, after_wait, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
    before.record()
    torch.cuda._sleep(int(wait_ms * _wait_cycles_per_ms()))
    after_wait.record()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    issue_ms = (time.perf_counter() - start) * 1e3
    end.record()
    end.synchronize()
    if issue_ms >= before.elapsed_time(after_wait):
        return None
    return after_wait.elapsed_time(end) / calls * 1e3


def launch_hooks() -> dict[str, int]:
    """How many launch hooks Triton's runtime holds (a bound launch declines while any is set, bound.py): where
    a benchmark's plain-call times differ from a user's."""
    from triton import knobs  # here, not at the top: `import autofuse` does not import Triton
    return {name: len(getattr(getattr(knobs.runtime, name, None), "calls", None) or [])
            for name in ("launch_enter_hook", "launch_exit_hook")}


def host_profile_text(fn: Callable[[], object], calls: int = 2000, top: int = 25) -> str:
    """cProfile of `calls` calls of fn, the `top` functions by own time: where the host time of a
    forward goes (used by the host-time benchmarks)."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        fn()
    profiler.disable()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()


def graph_replay_us(fn: Callable[[], object], replays: int = 100, calls_per_graph: int = 10) -> float:
    """Median GPU time of one call replayed from a CUDA graph (launch gaps removed), via CUDA events.

    The graph holds `calls_per_graph` back-to-back calls so the events' ~1 us resolution does not
    dominate a few-microsecond forward."""
    return graph_replay_round_robin({"fn": fn}, replays, calls_per_graph)["fn"]


def graph_replay_round_robin(fns: dict[str, Callable[[], object]], replays: int = 100,
                             calls_per_graph: int = 10) -> dict[str, float]:
    """graph_replay_us of several functions side by side: every graph is captured first, then each is
    replayed once per round, so that a drift of clocks or temperature during the measurement falls on
    all of them alike instead of on whichever was timed last."""
    graphs = {name: (captured(fn, calls_per_graph), calls_per_graph) for name, fn in fns.items()}
    return replayed_in_turn(graphs, replays)


def plain_call_us(fns: dict[str, Callable[[], object]], calls: int = 200, rounds: int = 7,
                  warmup: int = 10, rotate: bool = False) -> dict[str, float]:
    """µs per plain call (un-graphed, host included, what a user's loop pays) of each function: wall time of
    `calls` back-to-back calls / calls, synchronised before and after, median of `rounds` rounds taken in turn
    over the functions so that host drift falls on all of them alike; `rotate`: each round starts one function
    later, so that no function always runs first."""
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    order = list(fns.items())
    for r in range(rounds):
        shift = r % len(order) if rotate else 0
        for name, fn in order[shift:] + order[:shift]:
            synchronize()
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            synchronize()
            samples[name].append((time.perf_counter() - start) / calls * 1e6)
    return {name: statistics.median(v) for name, v in samples.items()}


def round_robin(fns: dict[str, Callable[[], object]], sample: Callable[[Callable[[], object]], float],
                rounds: int) -> dict[str, float]:
    """The median of `rounds` samples of each function (`sample(fn)`, e.g. host_us_sample), the functions
    sampled in turn each round so that host drift falls on all of them alike."""
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            samples[name].append(sample(fn))
    return {name: statistics.median(values) for name, values in samples.items()}
