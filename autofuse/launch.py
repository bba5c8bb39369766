"""What every op's launcher shares: pick the kernel variant, allocate or check the output, split-K
workspaces, TMA descriptors, grids and the launch itself. The launchers are in autofuse/ops/<op>.py.

Callers (the modules) have already validated user input; the checks here guard the kernels' own
assumptions, so a bug elsewhere fails with a message rather than reading out of bounds. Triton
itself is imported only when the first kernel is built (render.load_kernel), so that a program may
still switch the interpreter on after `import autofuse`.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import threading
from functools import cache

import torch

from .configs import KernelConfig, next_power_of_2
from .device import cuda_index, fp32_input_precision, interpreting, persistent_programs, supports_tma
from .opspec import OpSpec, launch_args
from .render import Kernel, KernelSpec, load_kernel


class LaunchError(RuntimeError):
    """A launcher was handed operands its kernel cannot take: a bug in autofuse, not the user's input."""


def require(condition: bool, message: str) -> None:
    """A guard that stays under `python -O` (unlike assert)."""
    if not condition:
        raise LaunchError(message)


def kernel_for(op: OpSpec, activation: str, K: int, dtype: torch.dtype, config: KernelConfig, has_bias: bool,
               has_residual: bool = False) -> Kernel:
    precision = fp32_input_precision() if dtype == torch.float32 else None
    # Only bf16 is wrong under the interpreter, but upcasting every dtype there keeps one code path.
    return load_kernel(KernelSpec(op, activation, has_bias, has_residual, K % config.block_k == 0, precision,
                                  interpreting(), config.split_k > 1, config.tma))


def tiles(M: int, N: int, config: KernelConfig) -> int:
    return -(-M // config.block_m) * -(-N // config.block_n)  # ceil-divisions


def grid(M: int, N: int, config: KernelConfig) -> tuple[int]:
    return (tiles(M, N, config) * config.split_k,)


@cache
def launch_options(config: KernelConfig) -> dict[str, int]:
    """Constexprs and launch options of a config (memoised: built once per config, never mutated)."""
    return dict(
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        GROUP_M=config.group_m,
        **({"SPLIT_K": config.split_k} if config.split_k > 1 else {}),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )


def launch(kernel: Kernel, grid_: tuple, tensors: dict, sizes: tuple[int, ...], options: dict,
           workspace: tuple = ()) -> None:
    """Launch `kernel` with its positional arguments built from its parameter list."""
    args = launch_args(kernel.parameters, tensors, sizes, options, workspace, descriptor)
    kernel.fn[grid_](*args, **options)


# Split-K workspaces: float32 partial sums and int32 arrival counters, per (device, stream). The
# kernels leave both all zero when they finish, so one zeroing at allocation serves every later
# launch in stream order; a stream of its own keeps concurrent streams from sharing one. Sizes grow
# in powers of two, so a (device, stream) retires at most ~40 outgrown buffers in a process; they
# are kept, because a captured CUDA graph keeps the pointers it was captured with, until
# release_workspaces() says no such graph is left.
_workspaces: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
_retired: list[tuple[torch.Tensor, torch.Tensor]] = []


def _stream_id(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    if _raw_stream is not None:  # what Triton's launcher calls: far cheaper than building a Stream object
        return _raw_stream(cuda_index(device))
    return torch.cuda.current_stream(device).cuda_stream


# What Triton's own launcher calls for the current stream; absent from CPU-only builds of torch.
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


# Set while a torch.library op runs (custom_ops.py, i.e. under torch.compile / torch.export): its
# workspace is then allocated per call and freed when the op returns. CUDA-graph trees (torch.compile's
# reduce-overhead) route every allocation of their warm-up and capture runs into the graph's private
# pool and then check that the pool holds only tensors they track: a persistent workspace born there
# fails that check. One zeroed buffer per call costs a memset, which the graph replays with the rest.
_per_call = contextvars.ContextVar("autofuse_workspace_per_call", default=False)


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
    key = (device, _stream_id(device))
    found = _workspaces.get(key)
    if _too_small(found, sums, counters) and _capturing(device):
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


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


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


def split_k_workspace(M: int, N: int, accumulators: int, config: KernelConfig, device: torch.device) -> tuple:
    return () if config.split_k == 1 else workspace(device, M * accumulators * N, tiles(M, N, config))


def tma_config(config: KernelConfig, *operands: torch.Tensor) -> KernelConfig:
    """`config`, or its one-tile-per-program twin where TMA cannot read these operands: descriptors
    need sm_90+, a contiguous last dimension and 16-byte aligned bases and row strides."""
    if not config.tma:
        return config
    for t in operands:
        if t.stride(1) != 1 or t.data_ptr() % 16 or (t.stride(0) * t.element_size()) % 16:
            return _without_tma(config)
    return config if supports_tma(operands[0].device) else _without_tma(config)


@cache
def _without_tma(config: KernelConfig) -> KernelConfig:
    return dataclasses.replace(config, tma=False)


def descriptor(t: torch.Tensor, block_rows: int, block_cols: int):
    # Imported here, not at the top: Triton is imported only once the first kernel is built.
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor(t, list(t.shape), [t.stride(0), 1], [block_rows, block_cols])


_thread_contexts = threading.local()


def _ensure_context(device: torch.device) -> None:
    """Make the device's primary CUDA context current on this thread, once per thread and device.

    Triton builds TMA descriptors with the driver API, which needs a current context; a thread that
    got its tensors from PyTorch may have none ("Failed to create tensor map descriptor: invalid
    device context", seen in the tuner's compile thread). set_device to the device already current
    binds its context without changing anything the caller sees; for another device the caller's
    device is put back."""
    index = cuda_index(device)
    done = getattr(_thread_contexts, "devices", None)
    if done is None:
        done = _thread_contexts.devices = set()
    if index in done:
        return
    current = torch.cuda.current_device()
    torch.cuda.set_device(index)
    if current != index:
        torch.cuda.set_device(current)
    done.add(index)


def persistent_launch(kernel: Kernel, M: int, N: int, config: KernelConfig, device: torch.device, tensors: dict,
                      sizes: tuple[int, ...], **constexprs: int) -> None:
    if device.type == "cuda":
        _ensure_context(device)
    programs = persistent_programs(device)
    # FLATTEN: one software pipeline across the tile and K loops, so the next tile's loads are
    # already in flight during this tile's epilogue.
    options = {**launch_options(config), "NUM_SMS": programs, "FLATTEN": True, **constexprs}
    launch(kernel, (min(programs, tiles(M, N, config)),), tensors, sizes, options)


def launch_gemm(kernel: Kernel, M: int, N: int, K: int, config: KernelConfig, device: torch.device, tensors: dict,
                accumulators: int) -> None:
    """Launch a GEMM-shaped kernel over an [M, N] output: persistent over TMA descriptors where the
    config says so, else one tile per program, with split-K's workspace for `accumulators` float32
    partial sums per output element."""
    if config.tma:
        persistent_launch(kernel, M, N, config, device, tensors, (M, N, K))
    else:
        launch(kernel, grid(M, N, config), tensors, (M, N, K), launch_options(config),
               split_k_workspace(M, N, accumulators, config, device))


def allocate(shape: tuple[int, int], like: torch.Tensor) -> torch.Tensor:
    """Output buffer; uninitialised, since the kernels write every element (tests poison it)."""
    return torch.empty(shape, dtype=like.dtype, device=like.device)


def output(out: torch.Tensor | None, shape: tuple[int, int], like: torch.Tensor) -> torch.Tensor:
    """`out` checked against what the kernel will write, or a fresh buffer when there is none."""
    if out is None:
        return allocate(shape, like)
    require(tuple(out.shape) == shape and out.dtype == like.dtype and out.device == like.device,
            f"out buffer is {tuple(out.shape)} {out.dtype} on {out.device}; the kernel writes {shape} {like.dtype} "
            f"on {like.device}")
    return out


def check_operands(x: torch.Tensor, *tensors: torch.Tensor | None) -> None:
    require(x.dim() == 2, f"launchers take 2-D activations, got {x.dim()}-D")
    for t in tensors:
        if t is not None:
            require(t.dtype == x.dtype and t.device == x.device,
                    f"operands must share dtype and device: {t.dtype} on {t.device} beside {x.dtype} on {x.device}")
