"""The filter pipeline that runs on a search space (configs.SearchSpace, an OpSpec's) before
anything compiles: a sampled point is clamped to the problem, then dropped if its shared memory
exceeds the device's limit or its accumulators would need more registers than a thread has; what
survives is deduplicated.
"""

from __future__ import annotations

import dataclasses
import itertools

import torch

from ..configs import KernelConfig, SearchSpace, clamp_to_problem, shared_memory_bytes

# Registers: each thread holds its share of the fp32 accumulator tile(s). 255 registers per
# thread at most; leave ~25% for addresses, loads and the epilogue.
_MAX_ACCUMULATOR_REGS_PER_THREAD = 192

# Split-K pays where few output tiles leave SMs idle: small M. Above this M its float32 workspace
# traffic (split_k x M x N x 4 bytes each way) outweighs what it gains, so it is not searched.
SPLIT_K_MAX_M = 256


def config_from(params: dict) -> KernelConfig | None:
    """The config of a point in the space, or None for a combination no kernel has (TMA + split-K)."""
    try:
        return KernelConfig(**params)
    except ValueError:
        return None


def points(space: SearchSpace):
    """Every config of the space's product, in a fixed order."""
    dims = space.dimensions()
    for values in itertools.product(*dims.values()):
        config = config_from(dict(zip(dims, values)))
        if config is not None:
            yield config


@dataclasses.dataclass(frozen=True)
class SearchProblem:
    """One key's problem as the search-space filters see it."""

    operand_tiles: tuple[int, int]  # the op's activation and weight tiles per K step (OpSpec)
    M: int
    N: int
    K: int
    dtype: torch.dtype
    tma: bool = False  # whether TMA kernels can run here (device.tma_usable)


def accumulator_registers(config: KernelConfig, operand_tiles: tuple[int, int]) -> int:
    return operand_tiles[1] * config.block_m * config.block_n // (32 * config.num_warps)


def feasible(config: KernelConfig, problem: SearchProblem, shared_memory_limit: int,
             interpret: bool) -> KernelConfig | None:
    """The config clamped to the problem, or None when it cannot run on this device."""
    config = clamp_to_problem(config, problem.M, problem.N, problem.K)
    if config.tma and not problem.tma:
        return None
    if config.split_k > 1 and (problem.M > SPLIT_K_MAX_M or config.split_k > -(-problem.K // config.block_k)):
        return None  # large M, or more K slices than K blocks
    if interpret:
        return config
    if shared_memory_bytes(config, problem.operand_tiles, problem.dtype) > shared_memory_limit:
        return None
    if accumulator_registers(config, problem.operand_tiles) > _MAX_ACCUMULATOR_REGS_PER_THREAD:
        return None
    return config


def candidates(space: SearchSpace, problem: SearchProblem, shared_memory_limit: int,
               interpret: bool) -> list[KernelConfig]:
    """Every distinct feasible config of `space` for `problem`, in a fixed order."""
    seen: dict[KernelConfig, None] = {}
    for point in points(space):
        config = feasible(point, problem, shared_memory_limit, interpret)
        if config is not None:
            seen.setdefault(config)
    return list(seen)
