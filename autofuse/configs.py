"""Typed kernel configs, their validation, and the built-in heuristic used when nothing is tuned.

A KernelConfig holds the numbers that change a kernel's speed but not its source: tile sizes,
GROUP_M, warps and pipeline stages. Configs are stored as plain JSON dicts and validated on load.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

_BLOCK_SIZES = (16, 32, 64, 128, 256)
_WARPS = (1, 2, 4, 8, 16)


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3
    # Programs that share one output tile, each over 1/split_k of K; partial sums meet in a float32
    # workspace (launch.py). Lets small-M problems with few output tiles keep every SM streaming.
    split_k: int = 1
    # Persistent kernel fed by TMA tensor descriptors (Hopper and newer; launch.py falls back to the
    # one-tile-per-program kernel where TMA cannot run). Never combined with split_k.
    tma: bool = False

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            # tl.dot needs every tile dimension >= 16, and tl.arange needs powers of two.
            if type(value) is not int or value not in _BLOCK_SIZES:
                raise ValueError(f"{name} must be one of {_BLOCK_SIZES}, got {value!r}")
        if type(self.group_m) is not int or not 1 <= self.group_m <= 64:
            raise ValueError(f"group_m must be an int in 1..64, got {self.group_m!r}")
        if type(self.num_warps) is not int or self.num_warps not in _WARPS:
            raise ValueError(f"num_warps must be one of {_WARPS}, got {self.num_warps!r}")
        if type(self.num_stages) is not int or not 1 <= self.num_stages <= 8:
            raise ValueError(f"num_stages must be an int in 1..8, got {self.num_stages!r}")
        if type(self.split_k) is not int or not 1 <= self.split_k <= 64:
            raise ValueError(f"split_k must be an int in 1..64, got {self.split_k!r}")
        if type(self.tma) is not bool:
            raise ValueError(f"tma must be true or false, got {self.tma!r}")
        if self.tma and self.split_k > 1:
            raise ValueError("tma and split_k > 1 do not combine")

    def to_dict(self) -> dict[str, int | bool]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> KernelConfig:
        """Build from JSON data; raise ValueError on unknown fields, missing tile sizes or bad values."""
        if not isinstance(data, dict):
            raise ValueError(f"a kernel config must be a JSON object, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown kernel config fields: {', '.join(sorted(unknown))}")
        missing = {"block_m", "block_n", "block_k"} - set(data)
        if missing:
            raise ValueError(f"kernel config lacks: {', '.join(sorted(missing))}")
        return cls(**data)

    def short(self) -> str:
        variant = f" k{self.split_k}" if self.split_k > 1 else " tma" if self.tma else ""
        tiles = f"{self.block_m}x{self.block_n}x{self.block_k}"
        return f"{tiles} g{self.group_m} w{self.num_warps} s{self.num_stages}{variant}"


# Per template: activation tiles ([BLOCK_M, BLOCK_K]) and weight tiles ([BLOCK_K, BLOCK_N]) loaded per
# K step; each weight tile feeds one float32 accumulator. mlp_decode: its first product dominates.
# Templates not listed (linear; gated_bwd: dY and the down weight): one of each.
OPERAND_TILES = {"gated_up": (1, 2), "mlp_decode": (1, 2)}


def accumulators(template: str) -> int:
    """float32 accumulator tiles [BLOCK_M, BLOCK_N] a program of `template` holds."""
    return OPERAND_TILES.get(template, (1, 1))[1]


def shared_memory_bytes(config: KernelConfig, template: str, dtype: torch.dtype) -> int:
    """Estimate of the shared memory a config's software pipeline needs: the template's activation and
    weight tiles (OPERAND_TILES), per stage. Used to drop configs that would fail with OutOfResources."""
    activations, weights = OPERAND_TILES.get(template, (1, 1))
    per_stage = (activations * config.block_m + weights * config.block_n) * config.block_k * dtype.itemsize
    # Triton keeps up to num_stages tiles in flight; count them all (Inductor estimates the same way).
    return config.num_stages * per_stage


def clamp_to_problem(config: KernelConfig, M: int, N: int, K: int) -> KernelConfig:
    """Shrink tiles that are larger than the problem (never below 16, tl.dot's minimum)."""
    return dataclasses.replace(
        config,
        block_m=min(config.block_m, max(16, next_power_of_2(M))),
        block_n=min(config.block_n, max(16, next_power_of_2(N))),
        block_k=min(config.block_k, max(16, next_power_of_2(K))),
    )


def fit_shared_memory(config: KernelConfig, template: str, dtype: torch.dtype, limit: int) -> KernelConfig:
    """Drop pipeline stages, then halve BLOCK_K, until the estimate fits under `limit` bytes."""
    while shared_memory_bytes(config, template, dtype) > limit:
        if config.num_stages > 2:
            config = dataclasses.replace(config, num_stages=config.num_stages - 1)
        elif config.block_k > 16:
            config = dataclasses.replace(config, block_k=config.block_k // 2)
        elif config.block_n > 16:
            config = dataclasses.replace(config, block_n=config.block_n // 2)
        else:
            break
    return config


def heuristic_config(
    template: str, M: int, N: int, K: int, dtype: torch.dtype, *, interpret: bool, shared_memory_limit: int,
    multiprocessors: int = 108, tma: bool = False,
) -> KernelConfig:
    """A sound default for (template, M, N, K, dtype): the fallback when no tuned config exists.

    Under the interpreter each program costs milliseconds, so the largest tiles win there; on a GPU
    the tile grows with M (small M is weight-streaming bound: narrow M, long K tiles; large M is
    compute bound: 128-wide tiles, deep pipelines).
    """
    if template == "mlp_decode":  # N = d_ff, K = d_model; only small M is ever run this way
        config = KernelConfig(16 if M <= 16 else 32 if M <= 32 else 64, 64, 128, group_m=1, num_warps=4,
                              num_stages=1 if interpret else 4)
        config = clamp_to_problem(config, M, N, K)
        return config if interpret else fit_shared_memory(config, template, dtype, shared_memory_limit)
    if interpret:
        config = KernelConfig(64, 64, 64, group_m=8, num_warps=4, num_stages=1)
        return clamp_to_problem(config, M, N, K)
    wide = dtype.itemsize <= 2  # 16-bit operands: twice the K per byte of shared memory
    # gated_up holds two accumulators, gated_bwd loads two more tiles (G, U) in its epilogue: narrower N.
    gated = template in ("gated_up", "gated_bwd")
    if M <= 64:
        # Small M streams the weights: narrow M tiles, long K tiles, deep pipelines.
        block_m = 16 if M <= 16 else 32 if M <= 32 else 64
        config = KernelConfig(block_m, 64, 128 if wide else 64, group_m=8, num_warps=4, num_stages=4)
    elif M <= 256:
        config = KernelConfig(64, 64 if gated else 128, 64 if wide else 32, group_m=8, num_warps=4, num_stages=4)
    elif tma and wide:
        # Hopper, large M: the persistent TMA kernels (H200, bf16, M=4096: 128x256 linear 864 us and
        # 128x128 gated 1020 us against 956 and 1025 us for the best one-tile-per-program configs).
        config = KernelConfig(128, 128 if gated else 256, 64, group_m=8, num_warps=8, num_stages=4 if gated else 3,
                              tma=True)
    else:
        config = KernelConfig(128, 128, 64 if wide else 32, group_m=8, num_warps=8, num_stages=3 if gated else 4)
    config = clamp_to_problem(config, M, N, K)
    if M <= 256 and template != "gated_bwd":  # the backward kernel has no split-K variant
        config = _split_to_fill(config, M, N, K, multiprocessors)
    return fit_shared_memory(config, template, dtype, shared_memory_limit)


def _split_to_fill(config: KernelConfig, M: int, N: int, K: int, multiprocessors: int) -> KernelConfig:
    """Split K until the programs cover the SMs (a narrow output, e.g. a down projection at small M,
    has fewer tiles than SMs), keeping at least two K blocks per program."""
    tiles = -(-M // config.block_m) * -(-N // config.block_n)
    k_blocks = -(-K // config.block_k)
    split_k = 1
    while tiles * split_k < multiprocessors and split_k < 16 and k_blocks >= 4 * split_k:
        split_k *= 2
    return dataclasses.replace(config, split_k=split_k)
