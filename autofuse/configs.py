"""What a tuned key may choose, validated, and the built-in heuristic used when nothing is tuned.

A choice has one of two kinds:
- KernelConfig: one of autofuse's Triton kernels with the numbers that change its speed but not its
  source (tile sizes, GROUP_M, warps, pipeline stages, split-K, TMA); stored as a JSON object.
- Library: a library path the op can run instead (cuBLAS through PyTorch, plus pointwise work),
  named by its candidate name; spelled `library:<name>` in records, the CLI and profiler ranges.
Both are validated on load; `choice_from_json` reads either (and "baseline", the spelling of the
eager library path in records written before choice kinds existed).
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

    to_json = to_dict

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




_LIBRARY_PREFIX = "library:"
_LEGACY_EAGER = "baseline"  # records written before choice kinds: the eager library path won


@dataclasses.dataclass(frozen=True)
class Library:
    """A library path as a choice: the op runs the named library candidate of its OpSpec."""

    name: str

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.replace("_", "").isalnum() or len(self.name) > 40:
            raise ValueError(f"a library candidate is named in letters, digits and '_', got {self.name!r}")

    def short(self) -> str:
        return f"{_LIBRARY_PREFIX}{self.name}"

    def to_json(self) -> str:
        return self.short()

    def __str__(self) -> str:
        return self.short()


EAGER = Library("eager")  # every op's first library candidate: what a PyTorch model runs


def choice_from_json(data: Any) -> KernelConfig | Library:
    """A stored choice: a KernelConfig object, `library:<name>`, or the legacy "baseline" (eager)."""
    if isinstance(data, str):
        if data == _LEGACY_EAGER:
            return EAGER
        if data.startswith(_LIBRARY_PREFIX):
            return Library(data[len(_LIBRARY_PREFIX):])
        raise ValueError(f"a choice is a kernel config object or 'library:<name>', got {data[:60]!r}")
    return KernelConfig.from_dict(data)


@dataclasses.dataclass(frozen=True)
class SearchSpace:
    """The values each knob of a kernel config may take; the tuner searches their product, filtered
    (autofuse/tune/space.py) before anything compiles."""

    block_m: tuple[int, ...] = (16, 32, 64, 128, 256)
    block_n: tuple[int, ...] = (16, 32, 64, 128, 256)
    block_k: tuple[int, ...] = (32, 64, 128, 256)
    group_m: tuple[int, ...] = (1, 8, 16)
    num_warps: tuple[int, ...] = (2, 4, 8)
    num_stages: tuple[int, ...] = (2, 3, 4, 5)
    split_k: tuple[int, ...] = (1, 2, 4, 8, 16)
    tma: tuple[bool, ...] = (False, True)

    def dimensions(self) -> dict[str, tuple]:
        return dataclasses.asdict(self)

    def size(self) -> int:
        n = 1
        for values in self.dimensions().values():
            n *= len(values)
        return n


# Under the interpreter every program costs milliseconds: a tiny space of large tiles.
INTERPRETER_SPACE = SearchSpace(block_m=(16, 32, 64), block_n=(32, 64), block_k=(32, 64), group_m=(1, 8),
                                num_warps=(4,), num_stages=(1, 2), split_k=(1, 2), tma=(False, True))


def shared_memory_bytes(config: KernelConfig, operand_tiles: tuple[int, int], dtype: torch.dtype) -> int:
    """Estimate of the shared memory a config's software pipeline needs: `operand_tiles` activation
    tiles [BLOCK_M, BLOCK_K] and weight tiles [BLOCK_K, BLOCK_N] per stage (an OpSpec's). Used to
    drop configs that would fail with OutOfResources."""
    activations, weights = operand_tiles
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


def fit_shared_memory(config: KernelConfig, operand_tiles: tuple[int, int], dtype: torch.dtype,
                      limit: int) -> KernelConfig:
    """Drop pipeline stages, then halve BLOCK_K, until the estimate fits under `limit` bytes."""
    while shared_memory_bytes(config, operand_tiles, dtype) > limit:
        if config.num_stages > 2:
            config = dataclasses.replace(config, num_stages=config.num_stages - 1)
        elif config.block_k > 16:
            config = dataclasses.replace(config, block_k=config.block_k // 2)
        elif config.block_n > 16:
            config = dataclasses.replace(config, block_n=config.block_n // 2)
        else:
            break
    return config


@dataclasses.dataclass(frozen=True)
class Device:
    """What a heuristic needs to know of where it runs."""

    interpret: bool
    shared_memory_limit: int = 0
    multiprocessors: int = 108
    tma: bool = False  # TMA kernels can serve this problem here (device.tma_usable)


def gemm_heuristic(M: int, N: int, K: int, dtype: torch.dtype, device: Device, *, operand_tiles: tuple[int, int],
                   narrow_n: bool, split_k: bool) -> KernelConfig:
    """A sound default for a GEMM-shaped kernel: the fallback when no tuned config exists.

    Under the interpreter each program costs milliseconds, so the largest tiles win there; on a GPU
    the tile grows with M (small M is weight-streaming bound: narrow M, long K tiles; large M is
    compute bound: 128-wide tiles, deep pipelines). `narrow_n`: the kernel holds two accumulators or
    an epilogue that loads two more tiles, so its N tiles stay narrower. `split_k`: the kernel has a
    split-K variant, used at small M to fill the SMs.
    """
    if device.interpret:
        return clamp_to_problem(KernelConfig(64, 64, 64, group_m=8, num_warps=4, num_stages=1), M, N, K)
    wide = dtype.itemsize <= 2  # 16-bit operands: twice the K per byte of shared memory
    if M <= 64:
        block_m = 16 if M <= 16 else 32 if M <= 32 else 64
        config = KernelConfig(block_m, 64, 128 if wide else 64, group_m=8, num_warps=4, num_stages=4)
    elif M <= 256:
        config = KernelConfig(64, 64 if narrow_n else 128, 64 if wide else 32, group_m=8, num_warps=4, num_stages=4)
    elif device.tma and wide:
        # Hopper, large M: the persistent TMA kernels, faster than the best one-tile-per-program configs
        # at M = 4096.
        config = KernelConfig(128, 128 if narrow_n else 256, 64, group_m=8, num_warps=8,
                              num_stages=4 if narrow_n else 3, tma=True)
    else:
        config = KernelConfig(128, 128, 64 if wide else 32, group_m=8, num_warps=8, num_stages=3 if narrow_n else 4)
    config = clamp_to_problem(config, M, N, K)
    if M <= 256 and split_k:
        config = _split_to_fill(config, M, N, K, device.multiprocessors)
    return fit_shared_memory(config, operand_tiles, dtype, device.shared_memory_limit)


def _split_to_fill(config: KernelConfig, M: int, N: int, K: int, multiprocessors: int) -> KernelConfig:
    """Split K until the programs cover the SMs (a narrow output, e.g. a down projection at small M,
    has fewer tiles than SMs), keeping at least two K blocks per program."""
    tiles = -(-M // config.block_m) * -(-N // config.block_n)
    k_blocks = -(-K // config.block_k)
    split = 1
    while tiles * split < multiprocessors and split < 16 and k_blocks >= 4 * split:
        split *= 2
    return dataclasses.replace(config, split_k=split)
