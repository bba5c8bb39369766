"""Timing helpers shared by the demo and the benchmarks.

GPU: `do_bench` medians (L2 flushed between runs by Triton), host time per call, and CUDA-graph
replay time, since at small M do_bench's cache flush hides launch overhead. Interpreter: a CPU
wall-clock median, which says nothing about GPU speed and is labelled so.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable

import torch


def gpu_median_ms(fn: Callable[[], object], warmup_ms: int = 25, rep_ms: int = 100) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def _synchronize() -> None:
    if torch.cuda.is_available():  # on a machine without a GPU there is nothing to wait for
        torch.cuda.synchronize()


def host_us_sample(fn: Callable[[], object], calls: int = 10) -> float:
    """Host time of one call over a batch of `calls`, launches queued but not awaited; synchronised
    after the batch, which bounds the queue."""
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    _synchronize()
    return elapsed / calls * 1e6


def host_us_per_call(fn: Callable[[], object], calls: int = 200) -> float:
    """Median host time of one call, launches queued but not awaited: the CPU cost a user pays per
    forward when the GPU keeps up. Batches of 10 calls (host_us_sample) after 10 warm-up calls."""
    for _ in range(10):
        fn()
    _synchronize()
    return statistics.median(host_us_sample(fn) for _ in range(calls // 10))


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
            _synchronize()
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            _synchronize()
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


def captured(fn: Callable[[], object], calls_per_graph: int) -> torch.cuda.CUDAGraph:
    """`calls_per_graph` back-to-back calls of fn captured in a CUDA graph, warmed up.

    The warm-up runs on the caller's stream and the capture on torch.cuda.graph's one capture stream, so
    that measurements leave no cuBLAS workspace behind beyond that stream's one: cuBLAS keeps a workspace
    per (handle, stream) for the life of the process, and a new side stream per measurement (each
    torch.cuda.Stream() is another pool stream) had kept one per pool stream (RESULTS.md, fifth session).
    A fixed side stream for warm-up and capture alike was tried too: two M=48 checks in that run timed
    cuBLAS at twice its cost in place, not isolated, so the capture stays on torch's capture stream."""
    for _ in range(3):  # warm up: compile and allocate outside the capture
        fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls_per_graph):
            fn()
    for _ in range(5):
        graph.replay()
    return graph


def _replay_us(graph: torch.cuda.CUDAGraph, calls_per_graph: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / calls_per_graph


def graph_replay_us(fn: Callable[[], object], replays: int = 100, calls_per_graph: int = 10) -> float:
    """Median GPU time of one call replayed from a CUDA graph (launch gaps removed), via CUDA events.

    The graph holds `calls_per_graph` back-to-back calls so the events' ~1 us resolution does not
    dominate a few-microsecond forward."""
    return graph_replay_round_robin({"fn": fn}, replays, calls_per_graph)["fn"]


def graph_median_ms(fn: Callable[[], object], budget_ms: float = 100.0, min_replay_us: float = 50.0,
                    max_calls_per_graph: int = 10) -> float:
    """Median GPU time of one call replayed from a CUDA graph, at any size: as many back-to-back calls
    per graph as make one replay last at least `min_replay_us` (the events' resolution), as many replays
    as fit in `budget_ms` (at least 5, at most 100). What graph_replay_us measures, sized so that a
    multi-millisecond prefill GEMM is not replayed a thousand times."""
    return graph_side_by_side_ms({"fn": fn}, budget_ms, min_replay_us, max_calls_per_graph)["fn"]


def graph_side_by_side_ms(fns: dict[str, Callable[[], object]], budget_ms: float = 100.0,
                          min_replay_us: float = 50.0, max_calls_per_graph: int = 10) -> dict[str, float]:
    """graph_median_ms of several functions, replayed in turn (one replay of each per round), so that
    a drift of clocks or temperature during the measurement falls on all of them alike: what a choice
    between near-equal candidates must be decided on. `budget_ms` is each function's share."""
    graphs, one_us = {}, {}
    for name, fn in fns.items():
        single = captured(fn, 1)
        one_us[name] = statistics.median(_replay_us(single, 1) for _ in range(3))
        calls = max(1, min(max_calls_per_graph, math.ceil(min_replay_us / max(one_us[name], 1e-3))))
        graphs[name] = (single if calls == 1 else captured(fn, calls), calls)
        del single
    replays = max(5, min(100, int(budget_ms * 1e3 / max(one_us[n] * c for n, (_, c) in graphs.items()))))
    return {name: us / 1e3 for name, us in _replayed_in_turn(graphs, replays).items()}


def graph_replay_round_robin(fns: dict[str, Callable[[], object]], replays: int = 100,
                             calls_per_graph: int = 10) -> dict[str, float]:
    """graph_replay_us of several functions side by side: every graph is captured first, then each is
    replayed once per round, so that a drift of clocks or temperature during the measurement falls on
    all of them alike instead of on whichever was timed last."""
    graphs = {name: (captured(fn, calls_per_graph), calls_per_graph) for name, fn in fns.items()}
    return _replayed_in_turn(graphs, replays)


def _replayed_in_turn(graphs: dict[str, tuple[torch.cuda.CUDAGraph, int]], replays: int) -> dict[str, float]:
    """Median µs of one call per (graph, calls in it), each graph replayed once per round."""
    samples: dict[str, list[float]] = {name: [] for name in graphs}
    for _ in range(replays):
        for name, (graph, calls) in graphs.items():
            samples[name].append(_replay_us(graph, calls))
    return {name: statistics.median(values) for name, values in samples.items()}


def cpu_median_ms(fn: Callable[[], object], repeats: int = 3) -> float:
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)
