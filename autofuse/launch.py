"""Host launchers: check what the kernel assumes, allocate the output, pick the kernel, launch.

Callers (the modules) have already validated user input; the checks here guard the kernels'
own assumptions, so a bug elsewhere fails with a message rather than reading out of bounds.
Triton itself is imported only when the first kernel is built (render.load_kernel), so that a
program may still switch the interpreter on after `import autofuse`.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from functools import cache

import torch

from .configs import KernelConfig
from .device import cuda_index, fp32_input_precision, interpreting, persistent_programs, supports_tma
from .render import KernelSpec, load_kernel


@cache
def _kernel(template: str, activation: str, has_bias: bool, has_residual: bool, even_k: bool,
            input_precision: str | None, interpret: bool, split_k: bool, tma: bool):
    """The JIT function for one source variant. Memoised: rendering costs ~100 us, a launch must not pay it."""
    return load_kernel(KernelSpec(
        template=template,
        activation=activation,
        has_bias=has_bias,
        has_residual=has_residual,
        even_k=even_k,
        input_precision=input_precision,
        # Only bf16 is wrong under the interpreter, but upcasting every dtype there keeps one code path.
        upcast_operands=interpret,
        split_k=split_k,
        tma=tma,
    ))


def _kernel_for(template: str, activation: str, K: int, dtype: torch.dtype, config: KernelConfig,
                has_bias: bool, has_residual: bool = False):
    precision = fp32_input_precision() if dtype == torch.float32 else None
    return _kernel(template, activation, has_bias, has_residual, K % config.block_k == 0, precision, interpreting(),
                   config.split_k > 1, config.tma)


def _tiles(M: int, N: int, config: KernelConfig) -> int:
    return -(-M // config.block_m) * -(-N // config.block_n)  # ceil-divisions


def _grid(M: int, N: int, config: KernelConfig) -> tuple[int]:
    return (_tiles(M, N, config) * config.split_k,)


# Split-K workspaces: float32 partial sums and int32 arrival counters, per (device, stream). The
# kernels leave both all zero when they finish, so one zeroing at allocation serves every later
# launch in stream order; a stream of its own keeps concurrent streams from sharing one. Buffers
# are grown but never freed: a captured CUDA graph keeps the pointers it was captured with.
_workspaces: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
_retired: list[tuple[torch.Tensor, torch.Tensor]] = []


def _stream_id(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    if _raw_stream is not None:  # ~0.3 us, where torch.cuda.current_stream builds a Stream object (~5 us)
        return _raw_stream(cuda_index(device))
    return torch.cuda.current_stream(device).cuda_stream


# What Triton's own launcher calls for the current stream; absent from CPU-only builds of torch.
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


# Set while a torch.library op runs (ops.py, i.e. under torch.compile / torch.export): its workspace
# is then allocated per call and freed when the op returns. CUDA-graph trees (torch.compile's
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


def _workspace(device: torch.device, sums: int, counters: int) -> tuple[torch.Tensor, torch.Tensor]:
    if _per_call.get():
        buffer = torch.zeros(sums + counters, dtype=torch.float32, device=device)
        return buffer[:sums], buffer[sums:].view(torch.int32)  # one allocation, one memset
    key = (device, _stream_id(device))
    found = _workspaces.get(key)
    if (found is None or found[0].numel() < sums or found[1].numel() < counters) and _capturing(device):
        # A torch.cuda.graph capture of an eager module runs on a stream of its own, after a warm-up
        # that allocated on another: reuse that workspace rather than allocate one in the graph's
        # private memory pool. (torch.compile's CUDA graphs go through the ops: per-call workspaces.)
        found = next((ws for (d, _), ws in _workspaces.items()
                      if d == device and ws[0].numel() >= sums and ws[1].numel() >= counters), found)
    if found is None or found[0].numel() < sums or found[1].numel() < counters:
        if found is not None:
            _retired.append(found)
            sums, counters = max(sums, found[0].numel()), max(counters, found[1].numel())
        found = _workspaces[key] = (
            torch.zeros(sums, dtype=torch.float32, device=device),
            torch.zeros(counters, dtype=torch.int32, device=device),
        )
    return found


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def reset_workspaces() -> None:
    """Zero every split-K workspace again: needed only after a kernel was interrupted or broken
    (the tuner calls it after a candidate fails), since a finished launch leaves them zero."""
    for sums, counters in [*_workspaces.values(), *_retired]:
        sums.zero_()
        counters.zero_()


def _split_k_args(M: int, N: int, accumulators: int, config: KernelConfig, device: torch.device) -> list:
    if config.split_k == 1:
        return []
    return list(_workspace(device, M * accumulators * N, _tiles(M, N, config)))


@cache
def _launch_options(config: KernelConfig) -> dict[str, int]:
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


def _tma_config(config: KernelConfig, *operands: torch.Tensor) -> KernelConfig:
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


def _descriptor(t: torch.Tensor, block_rows: int, block_cols: int):
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor(t, list(t.shape), [t.stride(0), 1], [block_rows, block_cols])


def _persistent_launch(kernel, M: int, N: int, config: KernelConfig, device: torch.device, args: list,
                       **constexprs: int) -> None:
    if device.type == "cuda":
        # Triton builds the TMA descriptors with the driver API, which needs this thread to have a
        # current CUDA context; a thread that got its tensors from PyTorch's cache may have none
        # ("Failed to create tensor map descriptor: invalid device context", seen in the tuner's
        # compile thread). set_device makes the device's primary context current.
        torch.cuda.set_device(cuda_index(device))
    programs = persistent_programs(device)
    grid = (min(programs, _tiles(M, N, config)),)
    # FLATTEN: one software pipeline across the tile and K loops, so the next tile's loads are
    # already in flight during this tile's epilogue.
    kernel[grid](*args, NUM_SMS=programs, FLATTEN=True, **constexprs, **_launch_options(config))


def _allocate(shape: tuple[int, int], like: torch.Tensor) -> torch.Tensor:
    """Output buffer; uninitialised, since the kernels write every element (tests poison it)."""
    return torch.empty(shape, dtype=like.dtype, device=like.device)


def _output(out: torch.Tensor | None, shape: tuple[int, int], like: torch.Tensor) -> torch.Tensor:
    """`out` checked against what the kernel will write, or a fresh buffer when there is none."""
    if out is None:
        return _allocate(shape, like)
    assert out.shape == shape and out.dtype == like.dtype and out.device == like.device, "bad out buffer"
    return out


def _strides(*tensors: torch.Tensor) -> list[int]:
    """Row and column strides of 2-D tensors, in the order the kernels take them."""
    return [s for t in tensors for s in t.stride()]


def _check_operands(x: torch.Tensor, *tensors: torch.Tensor | None) -> None:
    assert x.dim() == 2, "launchers take 2-D activations"
    for t in tensors:
        if t is not None:
            assert t.dtype == x.dtype and t.device == x.device, "operands must share dtype and device"


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    activation: str,
    config: KernelConfig,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Y = act(x @ weight.T + bias) + residual, x: [M, K], weight: [N, K], residual: [M, N].
    Written into `out` ([M, N], x's dtype) when given."""
    _check_operands(x, weight, bias, residual)
    M, K = x.shape
    N = weight.shape[0]
    assert weight.shape[1] == K and (residual is None or residual.shape == (M, N))
    if bias is not None:
        bias = bias.contiguous()
    y = _output(out, (M, N), x)
    if M == 0:
        return y
    config = _tma_config(config, x, weight)
    kernel = _kernel_for("linear", activation, K, x.dtype, config, bias is not None, residual is not None)
    if config.tma:
        args = [_descriptor(x, config.block_m, config.block_k), _descriptor(weight, config.block_n, config.block_k)]
        args += [t for t in (bias, residual) if t is not None] + [y, M, N, K]
        args += _strides(*([residual] if residual is not None else []), y)
        _persistent_launch(kernel, M, N, config, x.device, args)
        return y
    args = [x, weight] + [t for t in (bias, residual) if t is not None] + [y, M, N, K]
    args += _strides(x, weight, *([residual] if residual is not None else []), y)
    args += _split_k_args(M, N, 1, config, x.device)
    kernel[_grid(M, N, config)](*args, **_launch_options(config))
    return y


def gated_up(
    x: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    b_gate: torch.Tensor | None,
    b_up: torch.Tensor | None,
    activation: str,
    config: KernelConfig,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """H = act(x @ w_gate.T + b_gate) * (x @ w_up.T + b_up), x: [M, K], w_*: [N, K].
    Written into `out` ([M, N], x's dtype) when given."""
    _check_operands(x, w_gate, w_up, b_gate, b_up)
    M, K = x.shape
    N = w_gate.shape[0]
    assert w_gate.shape == w_up.shape == (N, K)
    assert (b_gate is None) == (b_up is None), "gate and up biases come together"
    h = _output(out, (M, N), x)
    if M == 0:
        return h
    config = _tma_config(config, x, w_gate, w_up)
    kernel = _kernel_for("gated_up", activation, K, x.dtype, config, b_gate is not None)
    biases = [b_gate.contiguous(), b_up.contiguous()] if b_gate is not None else []
    if config.tma:
        args = [_descriptor(x, config.block_m, config.block_k)]
        args += [_descriptor(w, config.block_n, config.block_k) for w in (w_gate, w_up)]
        _persistent_launch(kernel, M, N, config, x.device, args + biases + [h, M, N, K] + _strides(h))
        return h
    args = [x, w_gate, w_up] + biases + [h, M, N, K] + _strides(x, w_gate, w_up, h)
    args += _split_k_args(M, N, 2, config, x.device)
    kernel[_grid(M, N, config)](*args, **_launch_options(config))
    return h


def mlp_decode(
    x: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    b_gate: torch.Tensor | None,
    b_up: torch.Tensor | None,
    b_down: torch.Tensor | None,
    activation: str,
    config: KernelConfig,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Y = (act(x @ w_gate.T + b_gate) * (x @ w_up.T + b_up)) @ w_down.T + b_down in one launch,
    x: [M, D], w_gate/w_up: [F, D], w_down: [D, F]. config: block_m rows, block_n columns of H
    (BLOCK_F) per program, block_k the step over D in both products (BLOCK_D)."""
    _check_operands(x, w_gate, w_up, w_down, b_gate, b_up, b_down)
    M, D = x.shape
    F = w_gate.shape[0]
    assert w_gate.shape == w_up.shape == (F, D) and w_down.shape == (D, F)
    assert (b_gate is None) == (b_up is None) == (b_down is None), "the three biases come together"
    assert config.split_k == 1 and not config.tma, "the decode MLP kernel has no split-K or TMA variant"
    y = _output(out, (M, D), x)
    if M == 0:
        return y
    kernel = _kernel_for("mlp_decode", activation, D, x.dtype, config, b_gate is not None)
    args = [x, w_gate, w_up, w_down]
    if b_gate is not None:
        args += [b_gate.contiguous(), b_up.contiguous(), b_down.contiguous()]
    args += [y, M, D, F] + _strides(x, w_gate, w_up, w_down, y)
    row_blocks = -(-M // config.block_m)
    args += list(_workspace(x.device, M * D, row_blocks))
    kernel[(-(-F // config.block_n), row_blocks)](
        *args, BLOCK_M=config.block_m, BLOCK_F=config.block_n, BLOCK_D=config.block_k,
        num_warps=config.num_warps, num_stages=config.num_stages)
    return y


def gated_activation(gu: torch.Tensor, activation: str, out: torch.Tensor | None = None) -> torch.Tensor:
    """H = act(G) * U from gu = [G | U] ([M, 2F]); written into `out` ([M, F]) when given. A pointwise
    pass over memory, so one fixed tile shape serves every size (nothing to tune)."""
    assert gu.dim() == 2 and gu.shape[1] % 2 == 0, "gu is [M, 2F]"
    M, F = gu.shape[0], gu.shape[1] // 2
    h = _output(out, (M, F), gu)
    if M == 0 or F == 0:
        return h
    kernel = _kernel("gated_act", activation, has_bias=False, has_residual=False, even_k=True, input_precision=None,
                     interpret=interpreting(), split_k=False, tma=False)
    block_m, block_n = (16, 64) if interpreting() else (4, 512)  # H100/H200: 2048 elements per program
    kernel[(-(-M // block_m), -(-F // block_n))](gu, h, M, F, *_strides(gu, h), BLOCK_M=block_m, BLOCK_N=block_n,
                                                 num_warps=4)
    return h


def gated_backward(
    dy: torch.Tensor,
    gu: torch.Tensor,
    w_down: torch.Tensor,
    activation: str,
    config: KernelConfig,
    out: tuple[torch.Tensor, torch.Tensor | None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """For Y = (act(G) * U) @ w_down.T [+ b], the forward's gu = [G | U] ([M, 2F]) and dY ([M, D]):
    returns dGU = [dG | dU] ([M, 2F], the gradients of the gate and up pre-activations) and H ([M, F]),
    written into `out` = (dGU, H) when given; dGU may be gu itself (the kernel then overwrites the
    saved pre-activations with their gradients). w_down: [D, F]."""
    _check_operands(dy, gu, w_down)
    M, D = dy.shape
    F = w_down.shape[1]
    assert gu.shape == (M, 2 * F) and w_down.shape == (D, F)
    assert config.split_k == 1, "the gated backward kernel has no split-K variant"
    dgu_out, h_out = out if out is not None else (None, None)
    dgu, h = _output(dgu_out, (M, 2 * F), dy), _output(h_out, (M, F), dy)
    if M == 0:
        return dgu, h
    halves = [gu[:, :F], gu[:, F:], dgu[:, :F], dgu[:, F:]]  # G, U, dG, dU: [M, F] views
    config = _tma_config(config, dy, w_down, *halves, h)
    kernel = _kernel_for("gated_bwd", activation, D, dy.dtype, config, False)
    if config.tma:
        # The epilogue's pieces: 64 columns (H200: two 64-wide halves of a 128-wide tile beat the whole).
        epilogue_n = min(config.block_n, 64)
        args = [_descriptor(dy, config.block_m, config.block_k), _descriptor(w_down, config.block_k, config.block_n)]
        args += [_descriptor(t, config.block_m, epilogue_n) for t in (*halves, h)]
        _persistent_launch(kernel, M, F, config, dy.device, args + [M, F, D], EPILOGUE_N=epilogue_n)
        return dgu, h
    args = [dy, w_down, gu, dgu, h, M, F, D] + _strides(dy, w_down, gu, dgu, h)
    kernel[_grid(M, F, config)](*args, **_launch_options(config))
    return dgu, h
