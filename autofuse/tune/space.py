"""Typed search spaces and the filter pipeline that runs before anything compiles.

Every template shares the same knobs (its tile sizes, GROUP_M, warps, stages). A sampled point
is clamped to the problem, then dropped if its shared memory exceeds the device's limit or its
accumulators would need more registers than a thread has; what survives is deduplicated.
"""

from __future__ import annotations

import dataclasses
import itertools

import torch

from ..configs import KernelConfig, accumulators, clamp_to_problem, shared_memory_bytes

# Registers: each thread holds its share of the fp32 accumulator tile(s). 255 registers per
# thread at most; leave ~25% for addresses, loads and the epilogue.
_MAX_ACCUMULATOR_REGS_PER_THREAD = 192


@dataclasses.dataclass(frozen=True)
class SearchSpace:
    block_m: tuple[int, ...] = (16, 32, 64, 128, 256)
    block_n: tuple[int, ...] = (16, 32, 64, 128, 256)
    block_k: tuple[int, ...] = (32, 64, 128, 256)
    group_m: tuple[int, ...] = (1, 8, 16)
    num_warps: tuple[int, ...] = (2, 4, 8)
    num_stages: tuple[int, ...] = (2, 3, 4, 5)
    split_k: tuple[int, ...] = (1, 2, 4, 8, 16)
    tma: tuple[bool, ...] = (False, True)

    def dimensions(self) -> dict[str, tuple[int, ...]]:
        return dataclasses.asdict(self)

    def points(self):
        dims = self.dimensions()
        for values in itertools.product(*dims.values()):
            config = config_from(dict(zip(dims, values)))
            if config is not None:
                yield config

    def size(self) -> int:
        n = 1
        for values in self.dimensions().values():
            n *= len(values)
        return n


# Under the interpreter every program costs milliseconds: a tiny space of large tiles.
INTERPRETER_SPACE = SearchSpace(block_m=(16, 32, 64), block_n=(32, 64), block_k=(32, 64), group_m=(1, 8),
                                num_warps=(4,), num_stages=(1, 2), split_k=(1, 2), tma=(False, True))

# The one-launch MLP (op "mlp"): block_m rows, block_n = BLOCK_F columns of H per program, block_k
# = BLOCK_D. It has no GROUP_M, split-K or TMA, and its atomics grow with M: small tiles only.
MLP_SPACE = SearchSpace(block_m=(16, 32, 64), block_n=(16, 32, 64, 128), block_k=(32, 64, 128, 256), group_m=(1,),
                        num_warps=(2, 4, 8), num_stages=(2, 3, 4, 5), split_k=(1,), tma=(False,))
MLP_INTERPRETER_SPACE = SearchSpace(block_m=(16, 32), block_n=(16, 32, 64), block_k=(32, 64), group_m=(1,),
                                    num_warps=(4,), num_stages=(1, 2), split_k=(1,), tma=(False,))
# Largest M the one-launch MLP is tuned for: its float32 atomics (d_ff / BLOCK_F x M x d_model)
# outgrow the weight traffic beyond this (H200: 202 us against eager's 78 at gemma-2b M=128).
MLP_MAX_M = 64


# The gated backward kernel: one GEMM (dY Wd) whose epilogue reads two more tiles; no split-K.
BACKWARD_SPACE = dataclasses.replace(SearchSpace(), split_k=(1,))
BACKWARD_INTERPRETER_SPACE = dataclasses.replace(INTERPRETER_SPACE, split_k=(1,))


def default_space(template: str, interpret: bool) -> SearchSpace:
    if template == "mlp_decode":
        return MLP_INTERPRETER_SPACE if interpret else MLP_SPACE
    if template == "gated_bwd":
        return BACKWARD_INTERPRETER_SPACE if interpret else BACKWARD_SPACE
    return INTERPRETER_SPACE if interpret else SearchSpace()


# Split-K pays where few output tiles leave SMs idle: small M. Above this M its float32 workspace
# traffic (split_k x M x N x 4 bytes each way) outweighs what it gains, so it is not searched.
SPLIT_K_MAX_M = 256


def config_from(params: dict) -> KernelConfig | None:
    """The config of a point in the space, or None for a combination no kernel has (TMA + split-K)."""
    try:
        return KernelConfig(**params)
    except ValueError:
        return None


@dataclasses.dataclass(frozen=True)
class Problem:
    template: str
    M: int
    N: int
    K: int
    dtype: torch.dtype
    tma: bool = False  # whether TMA kernels can run here (device.tma_usable)


def accumulator_registers(config: KernelConfig, template: str) -> int:
    return accumulators(template) * config.block_m * config.block_n // (32 * config.num_warps)


def feasible(config: KernelConfig, problem: Problem, shared_memory_limit: int, interpret: bool) -> KernelConfig | None:
    """The config clamped to the problem, or None when it cannot run on this device."""
    config = clamp_to_problem(config, problem.M, problem.N, problem.K)
    if config.tma and not problem.tma:
        return None
    if config.split_k > 1 and (problem.M > SPLIT_K_MAX_M or config.split_k > -(-problem.K // config.block_k)):
        return None  # large M, or more K slices than K blocks
    if interpret:
        return config
    if shared_memory_bytes(config, problem.template, problem.dtype) > shared_memory_limit:
        return None
    if accumulator_registers(config, problem.template) > _MAX_ACCUMULATOR_REGS_PER_THREAD:
        return None
    return config


def candidates(space: SearchSpace, problem: Problem, shared_memory_limit: int, interpret: bool) -> list[KernelConfig]:
    """Every distinct feasible config of `space` for `problem`, in a fixed order."""
    seen: dict[KernelConfig, None] = {}
    for point in space.points():
        config = feasible(point, problem, shared_memory_limit, interpret)
        if config is not None:
            seen.setdefault(config)
    return list(seen)
