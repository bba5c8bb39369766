"""Split-K workspaces: the float32 partial sums and int32 arrival counters that programs sharing an
output tile meet in (split-K, the one-launch MLP)."""

from __future__ import annotations

import contextlib
import contextvars

import torch

from .configs import next_power_of_2
from .device import capturing, cuda_index

# Split-K workspaces: float32 partial sums and int32 arrival counters, per (device, stream). The
# kernels leave both all zero when they finish, so one zeroing at allocation serves every later
# launch in stream order; a stream of its own keeps concurrent streams from sharing one. Sizes grow
# in powers of two, so a (device, stream) retires at most ~40 outgrown buffers in a process; they
# are kept, because a captured CUDA graph keeps the pointers it was captured with, until
# release_workspaces() says no such graph is left.
_workspaces: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
_retired: list[tuple[torch.Tensor, torch.Tensor]] = []


def stream_id(device: torch.device) -> int:
    """The device's current stream as the driver's handle (0 off CUDA)."""
    if device.type != "cuda":
        return 0
    if raw_stream is not None:  # what Triton's launcher calls: far cheaper than building a Stream object
        return raw_stream(cuda_index(device))
    return torch.cuda.current_stream(device).cuda_stream


# What Triton's own launcher calls for the current stream; absent from CPU-only builds of torch.
raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


# Set while a torch.library op runs (custom_ops.py, i.e. under torch.compile / torch.export): its
# workspace is then allocated per call and freed when the op returns. CUDA-graph trees (torch.compile's
# reduce-overhead) route every allocation of their warm-up and capture runs into the graph's private
# pool and then check that the pool holds only tensors they track: a persistent workspace born there
# fails that check. One zeroed buffer per call costs a memset, which the graph replays with the rest.
_per_call = contextvars.ContextVar("autofuse_workspace_per_call", default=False)


def per_call() -> bool:
    """Whether workspaces are allocated per call right now (inside the torch.library ops)."""
    return _per_call.get()


@contextlib.contextmanager
def workspaces_per_call():
    token = _per_call.set(True)
    try:
        yield
    finally:
        _per_call.reset(token)


def workspace(device: torch.device, sums: int, counters: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Zeroed float32 sums and int32 counters of at least these sizes, for one launch on the current stream."""
    if _per_call.get():
        buffer = torch.zeros(sums + counters, dtype=torch.float32, device=device)
        return buffer[:sums], buffer[sums:].view(torch.int32)  # one allocation, one memset
    key = (device, stream_id(device))
    found = _workspaces.get(key)
    if _too_small(found, sums, counters) and capturing(device):
        # A torch.cuda.graph capture of an eager module runs on a stream of its own, after a warm-up
        # that allocated on another: reuse that workspace rather than allocate one in the graph's
        # private memory pool. (torch.compile's CUDA graphs go through the ops: per-call workspaces.)
        found = next((ws for (d, _), ws in _workspaces.items() if d == device and not _too_small(ws, sums, counters)),
                     found)
    if _too_small(found, sums, counters):
        if found is not None:
            _retired.append(found)
            sums, counters = max(sums, found[0].numel()), max(counters, found[1].numel())
        found = _workspaces[key] = (
            torch.zeros(next_power_of_2(sums), dtype=torch.float32, device=device),
            torch.zeros(next_power_of_2(counters), dtype=torch.int32, device=device),
        )
    return found


def _too_small(found, sums: int, counters: int) -> bool:
    return found is None or found[0].numel() < sums or found[1].numel() < counters


def reset_workspaces() -> None:
    """Zero every split-K workspace again: needed only after a kernel was interrupted or broken
    (the tuner calls it after a candidate fails), since a finished launch leaves them zero."""
    for sums, counters in [*_workspaces.values(), *_retired]:
        sums.zero_()
        counters.zero_()


def release_workspaces() -> None:
    """Free every split-K workspace (the next launch allocates anew). Only when no CUDA graph that
    captured an autofuse launch will be replayed again: it holds their addresses."""
    _workspaces.clear()
    _retired.clear()
