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
import threading
from collections.abc import Callable
from functools import cache

import torch

from . import compile_workers, variants, workspaces
from .bound import BoundLaunch
from .configs import KernelConfig, tiles
from .device import cuda_index, dependent_launches, fp32_input_precision, interpreting, persistent_programs
from .opspec import OpSpec, launch_args
from .render import Kernel, KernelSpec, load_kernel


class LaunchError(RuntimeError):
    """A launcher was handed operands its kernel cannot take: a bug in autofuse, not the user's input."""


def require(condition: bool, message: str | Callable[[], str]) -> None:
    """A guard that stays under `python -O` (unlike assert). A message that formats values is passed as a
    callable, formatted only when the guard fails: the launchers run per call, and an f-string built on every
    call cost 4 us of host time in each output check."""
    if not condition:
        raise LaunchError(message() if callable(message) else message)


def kernel_for(op: OpSpec, activation: str, K: int, dtype: torch.dtype, config: KernelConfig, has_bias: bool,
               has_residual: bool = False, device: torch.device | None = None) -> Kernel:
    precision = fp32_input_precision() if dtype == torch.float32 else None
    variant = variants.get(config.variant)
    static_k = K if variant.static_k else None
    dependency = None
    if variant.dependent_launch and device is not None and dependent_launches(device):
        dependency = _GRID_DEPENDENCY.get(op.template)
    # Only bf16 is wrong under the interpreter, but upcasting every dtype there keeps one code path.
    return load_kernel(KernelSpec(op, activation, has_bias, has_residual, K % config.block_k == 0, precision,
                                  interpreting(), config.variant, static_k, dependency))


# Programmatic Dependent Launch between an MLP's steps where their variant has it (Variant.dependent_launch: the
# GEMV at M = 1): the up projection's kernel lets the next kernel start as its last programs run, and the Linear's
# (the down projection's) is launched as a dependent, waiting inside for the kernel before it, so that its
# programs' launch and ramp overlap the up projection's tail: 6304 -> 7040 ran 92.0 us against max-autotune's
# 94.1 (94.1 against 92.5 without), 576 -> 2665 6.6 against 6.9 (H100, graph-replayed, empty cache). The tile
# kernels at M = 16 ran 0.7-3.7 us slower with it (576 -> 2665, 5681 -> 20024; the peers beside them unchanged), so
# they launch as before. A Linear waits before its first load, so any kernel before it (a library path's, another
# Linear's) is finished and its writes visible, as without the overlap.
_GRID_DEPENDENCY = {"gated_up": "launch", "gated_pairs": "launch", "linear": "wait"}


# The pointwise passes (ops gated_act, gated_grad, bias_act) take only BLOCK_M and BLOCK_N: any config selects their
# one source.
_POINTWISE = KernelConfig(16, 64, 16, group_m=1, num_warps=4, num_stages=1)


# Launches bound once per key (memoised_launch): what a launch depends on beyond its per-call tensors. Past this
# many the memo starts over.
_MEMO_KEPT = 256
_memo: dict[tuple, BoundLaunch | None] = {}


def memoised_launch(key: tuple, tensors: dict, build: Callable[[], tuple]) -> None:
    """Replay the launch bound under `key` where it takes these tensors; else launch what `build()` returns
    ((kernel, grid, sizes, options)) through the JIT and bind it under `key`. For launches that no module's
    table binds (the pointwise passes of library paths and of the backward, op rms_norm), run on every
    un-graphed call, where the JIT's binding and the kernel spec's construction cost more host time than the
    launch. `key` must hold everything the launch depends on but the per-call tensors' addresses: the op and
    its source flags, dtype, sizes, device, constexpr values and the other operands' addresses (fixed_addresses)."""
    bound = _memo.get(key)
    if bound is not None and _recorded.get() is None and bound(tensors):
        return
    kernel, grid_, sizes, options = build()
    # While binding() records, the recorder keeps it; while a compile worker's capture runs, nothing launches.
    fresh = _recorded.get() is None and key not in _memo and not compile_workers.capturing()
    bound = launch(kernel, grid_, tensors, sizes, options, bind=fresh)
    if fresh:
        if len(_memo) >= _MEMO_KEPT:
            _memo.clear()
        _memo[key] = bound


def fixed_addresses(op: OpSpec, tensors: dict) -> tuple[int, ...]:
    """The addresses of the operands a bound launch keeps (those without a row per token), for a memo key."""
    return tuple(t.data_ptr() for name, t in tensors.items() if t is not None and name not in op.per_call)


# Row widths a pass over contiguous [M, N] operands may run at instead of N (pointwise_launch), widest first.
_FLAT_WIDTHS = (512, 256, 128, 64, 32, 16)


@cache
def _rows_only(op: OpSpec) -> bool:
    """Whether every operand of `op` is an [M, N] tensor (no vector, such as a bias): fixed per op, read per pass."""
    return all(operand.axes == "mn" for operand in op.operands)


def flat_rows(op: OpSpec, M: int, N: int, tensors: dict) -> tuple[int, int, dict]:
    """(rows, width, tensors) a pass runs over: where N is not a multiple of 16 and every operand is a contiguous
    [M, N] tensor, the same elements as rows of the widest of _FLAT_WIDTHS that divides M * N, so that Triton
    sees rows and strides that are multiples of 16 and loads 16 bytes at a time (at N = 4872 the unflattened
    gated_dgu pass ran 81 us at M = 2048 against Inductor's flattened 24, H200); else M, N and the tensors."""
    if N % 16 == 0 or not _rows_only(op):
        return M, N, tensors
    if any(t is not None and (tuple(t.shape) != (M, N) or not t.is_contiguous()) for t in tensors.values()):
        return M, N, tensors
    width = next((w for w in _FLAT_WIDTHS if M * N % w == 0), None)
    if width is None:
        return M, N, tensors
    return M * N // width, width, {name: None if t is None else t.view(-1, width) for name, t in tensors.items()}


def pointwise_launch(op: OpSpec, activation: str, dtype: torch.dtype, M: int, N: int, tensors: dict,
                     has_bias: bool = False, has_residual: bool = False) -> None:
    """One pass over an [M, N] problem with one fixed tile shape (nothing to tune), memoised (memoised_launch);
    over wider rows where flat_rows finds them."""
    M, N, tensors = flat_rows(op, M, N, tensors)
    device = next(iter(tensors.values())).device
    # Not whether the interpreter runs (an environment read per pass): that is fixed once Triton is imported
    # (device.check_interpreter_consistency), before any launch is memoised.
    key = (op, activation, dtype, has_bias, has_residual, M, N, device, fixed_addresses(op, tensors))

    def build() -> tuple:
        # K = BLOCK_K: the kernel has no K loop, so its source is the "even K" one.
        kernel = kernel_for(op, activation, _POINTWISE.block_k, dtype, _POINTWISE, has_bias, has_residual)
        # Interpreter: few, large programs; GPU: 2048 elements per program, the fastest of the tile shapes
        # measured for these passes.
        block_m, block_n = (16, 64) if interpreting() else (4, 512)
        return kernel, (-(-M // block_m) * -(-N // block_n),), (M, N), dict(BLOCK_M=block_m, BLOCK_N=block_n,
                                                                             num_warps=4)

    memoised_launch(key, tensors, build)


@cache
def launch_options(config: KernelConfig) -> dict[str, int]:
    """Constexprs (the tiles' and the variant's knobs') and launch options of a config (memoised: built once
    per config, never mutated)."""
    return dict(
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        GROUP_M=config.group_m,
        **variants.get(config.variant).knob_constexprs(dict(config.knobs)),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )


def launch(kernel: Kernel, grid_: tuple, tensors: dict, sizes: tuple[int, ...], options: dict,
           workspace: tuple = (), bind: bool = False) -> BoundLaunch | None:
    """Launch `kernel` with its positional arguments built from its parameter list, through Triton's
    JIT (which compiles on a first call). While `binding()` records, or with `bind`, the launch is also kept
    as a BoundLaunch that later calls replay without the JIT: recorded, and returned (None where it cannot be
    bound, or where neither asked)."""
    args = launch_args(kernel.parameters, tensors, sizes, options, workspace, descriptor)
    compiled = kernel.fn[grid_](*args, **options)
    if compile_workers.capturing():  # captured for a compile worker: not bound (if uncompiled, not launched either)
        return None
    recorded = _recorded.get()
    if recorded is None and not bind:
        return None
    # A workspace allocated for this call only (inside torch.library ops) cannot be bound.
    per_call_workspace = bool(workspace) and workspaces.per_call()
    bound = None if per_call_workspace else BoundLaunch.bind(kernel, grid_, args, options, tensors, compiled,
                                                             workspace=bool(workspace))
    if recorded is not None:
        recorded.append(bound)
    return bound


_recorded: contextvars.ContextVar[list | None] = contextvars.ContextVar("autofuse_bound_launches", default=None)


@contextlib.contextmanager
def binding():
    """Record every launch made inside as a BoundLaunch (None where it cannot be bound), in order."""
    recorded: list = []
    token = _recorded.set(recorded)
    try:
        yield recorded
    finally:
        _recorded.reset(token)


def only_launch(recorded: list) -> BoundLaunch | None:
    """The one launch an op recorded while binding, or None (a library path, or nothing bindable)."""
    return recorded[0] if len(recorded) == 1 else None


def addresses(tensors) -> list[int]:
    """What bound launches hold of a module's parameters: their addresses (a `.to()`, a new
    Parameter or `.data =` moves them, and the launches are bound again)."""
    return [t.data_ptr() for t in tensors if t is not None]


def runnable(config: KernelConfig, *operands: torch.Tensor) -> KernelConfig:
    """`config`, or its one-tile-per-program twin where its variant cannot take these operands (TMA
    descriptors need sm_90+, a contiguous last dimension and 16-byte aligned bases and row strides)."""
    check = variants.get(config.variant).runs_with
    return config if check is None or check(operands) else _tile(config)


@cache
def _tile(config: KernelConfig) -> KernelConfig:
    return config.tile


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


def launch_gemm(kernel: Kernel, sizes: tuple[int, ...], config: KernelConfig, device: torch.device,
                tensors: dict, accumulators: int, **constexprs: int) -> None:
    """Launch a GEMM-shaped kernel over an [M, N] output (sizes: M, N, then the rest) as its config's variant
    says (variants.py: how many programs, which constexprs, whether the split-K workspace). `tensors` may hold
    operands of every variant (each kernel takes those it has), `constexprs` the op's extra ones (each kernel
    takes those it declares), `accumulators` the float32 partial sums per output element a workspace holds."""
    M, N = sizes[0], sizes[1]
    variant = variants.get(config.variant)
    multiprocessors = persistent_programs(device) if variant.per_sm else 0
    if variant.descriptors and device.type == "cuda":
        _ensure_context(device)
    extra = {name: value for name, value in constexprs.items() if name in kernel.constexprs}
    if variant.launch_constexprs is not None:
        extra.update(variant.launch_constexprs(multiprocessors))
    if kernel.dependent:
        extra["launch_pdl"] = True
    # The memoised options as they are where nothing is added (the tile and split-K kernels of most ops).
    options = {**launch_options(config), **extra} if extra else launch_options(config)
    count = tiles(M, N, config)
    workspace = workspaces.workspace(device, M * accumulators * N, count) if variant.workspace else ()
    launch(kernel, (variant.programs(count, config, multiprocessors),), tensors, sizes, options, workspace)


def allocate(shape: tuple[int, int], like: torch.Tensor) -> torch.Tensor:
    """Output buffer; uninitialised, since the kernels write every element (tests poison it)."""
    return torch.empty(shape, dtype=like.dtype, device=like.device)


def output(out: torch.Tensor | None, shape: tuple[int, int], like: torch.Tensor) -> torch.Tensor:
    """`out` checked against what the kernel will write, or a fresh buffer when there is none."""
    if out is None:
        return allocate(shape, like)
    require(tuple(out.shape) == shape and out.dtype == like.dtype and out.device == like.device,
            lambda: f"out buffer is {tuple(out.shape)} {out.dtype} on {out.device}; the kernel writes {shape} "
                    f"{like.dtype} on {like.device}")
    return out


def check_operands(x: torch.Tensor, *tensors: torch.Tensor | None) -> None:
    require(x.dim() == 2, lambda: f"launchers take 2-D activations, got {x.dim()}-D")
    for t in tensors:
        if t is not None:
            require(t.dtype == x.dtype and t.device == x.device,
                    lambda: f"operands must share dtype and device: {t.dtype} on {t.device} beside {x.dtype} on "
                            f"{x.device}")
