"""Where a training step's GPU sits idle: per provider, the time between kernels on the GPU during
back-to-back steps (torch.profiler's kernel intervals: the step's span less the union of its kernels),
the largest such gaps with the kernels either side, the CUDA runtime calls that can stall a queue
(cudaMalloc / cudaFree / synchronisations, counted per step), and the synchronisations
torch.cuda.set_sync_debug_mode reports. train_profile.py says which kernels a step runs; this says
what its wall time holds besides them.

  python benchmarks/train_gaps.py --out DIR [--point llama-3-8b,16384 ...]
"""

from __future__ import annotations

import sys
import warnings
from collections import Counter
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_profile  # noqa: E402 - the shapes, providers and steps of the step profile

STEPS = 6
# Runtime calls that allocate, free or wait: any of them inside a step can leave the GPU idle.
STALLING = ("cudaMalloc", "cudaFree", "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
            "cudaMemcpy", "cudaHostAlloc", "cudaStreamWaitEvent")


def _gaps(step, steps: int = STEPS) -> dict:
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    events = prof.events()
    kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in events
                     if e.device_type == DeviceType.CUDA)
    busy, idle, gaps = 0.0, 0.0, []
    start, end, name = kernels[0]
    for s, e, n in kernels[1:]:
        if s > end:
            idle += s - end
            gaps.append((round(s - end, 1), name[:60], n[:60]))
            busy += end - start
            start = s
        if e > end:
            end, name = e, n
    busy += end - start
    runtime = Counter(e.name for e in events if e.device_type == DeviceType.CPU and e.name.startswith(STALLING))
    return dict(kernels_us=round(busy / steps, 1), idle_us=round(idle / steps, 1),
                largest_gaps=sorted(gaps, reverse=True)[:6],
                stalling_calls_per_step={k: round(v / steps, 2) for k, v in runtime.items()})


def _syncs(step) -> list[str]:
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    return [str(w.message)[:160] for w in caught if "synchroniz" in str(w.message).lower()]


def main() -> None:
    train_profile.run("train_gaps", lambda step: dict(**_gaps(step), syncs=_syncs(step)))


if __name__ == "__main__":
    main()
