"""The timings the tuner and the first-use checks decide by: GPU time replayed from CUDA graphs (one function,
or several side by side), and the interpreter's CPU wall-clock median, which says nothing about GPU speed and
is labelled so. What only measurements use (do_bench, host time per call, plain calls in turn, profiles) is in
autofuse/tools/measure.py."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable

import torch


def synchronize() -> None:
    if torch.cuda.is_available():  # on a machine without a GPU there is nothing to wait for
        torch.cuda.synchronize()


def captured(fn: Callable[[], object], calls_per_graph: int) -> torch.cuda.CUDAGraph:
    """`calls_per_graph` back-to-back calls of fn captured in a CUDA graph, warmed up.

    The warm-up runs on the caller's stream and the capture on torch.cuda.graph's one capture stream, so
    that measurements leave no cuBLAS workspace behind beyond that stream's one: cuBLAS keeps a workspace
    per (handle, stream) for the life of the process, and a new side stream per measurement (each
    torch.cuda.Stream() is another pool stream) had kept one per pool stream.
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
    times = {name: us / 1e3 for name, us in replayed_in_turn(graphs, replays).items()}
    del graphs
    release_cublas_workspaces()
    return times


def release_cublas_workspaces() -> None:
    """Free the workspaces cuBLAS keeps per (handle, stream), the capture stream's among them (32 MiB on an H100),
    which a first use's checks would otherwise leave allocated for the life of the process: a module's first
    training step then held 31 MiB more than the peers' before it began (2368 -> 4872, M = 2048). The next cuBLAS
    call on a stream allocates its workspace again; Inductor's CUDA-graph trees clear them the same way."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None and torch.cuda.is_available():
        clear()


def replayed_in_turn(graphs: dict[str, tuple[torch.cuda.CUDAGraph, int]], replays: int) -> dict[str, float]:
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
