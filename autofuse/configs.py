"""What a tuned key may choose, validated, and the built-in heuristic used when nothing is tuned.

A choice has one of two kinds:
- KernelConfig: one of autofuse's Triton kernels with the numbers that change its speed but not its
  source (tile sizes, GROUP_M, warps, pipeline stages) and its kernel variant with that variant's knobs
  (autofuse/variants.py); stored as a JSON object.
- Library: a library path the op can run instead (cuBLAS through PyTorch, plus pointwise work),
  named by its candidate name; spelled `library:<name>` in records, the CLI and profiler ranges.
Both are validated on load by `choice_from_json`.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Collection, Mapping
from typing import Any, NamedTuple

import torch

from . import variants as variant_registry
from .errors import shown
from .variants import Device, Shape

__all__ = ["Device", "EAGER", "KernelConfig", "Library", "SearchSpace", "Shape", "choice_from_json",
           "fp8_decode_tiles", "gemm_heuristic", "gemv_configs", "gemv_starts"]

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
    # The kernel variant (autofuse/variants.py: tile, split_k, tma, or one registered from outside) and its
    # knobs, e.g. {"split_k": 4}; given as a mapping, kept as sorted (name, value) pairs.
    variant: str = "tile"
    knobs: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        variant = variant_registry.get(self.variant)
        for name in variant_registry.TILE_DIMENSIONS:
            value, allowed = getattr(self, name), variant.block_sizes(name)
            if type(value) is not int or value not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
        if type(self.group_m) is not int or not 1 <= self.group_m <= 64:
            raise ValueError(f"group_m must be an int in 1..64, got {self.group_m!r}")
        if type(self.num_warps) is not int or self.num_warps not in _WARPS:
            raise ValueError(f"num_warps must be one of {_WARPS}, got {self.num_warps!r}")
        if type(self.num_stages) is not int or not 1 <= self.num_stages <= 8:
            raise ValueError(f"num_stages must be an int in 1..8, got {self.num_stages!r}")
        knobs = dict(self.knobs) if isinstance(self.knobs, (Mapping, tuple)) else None
        if knobs is None or set(knobs) != set(variant.knobs):
            wanted = ", ".join(variant.knobs) or "none"
            raise ValueError(f"variant {self.variant} takes the knobs {wanted}, got {self.knobs!r}")
        for name, value in knobs.items():
            knob = variant.knobs[name]
            if type(value) is not int or not knob.low <= value <= knob.high:
                raise ValueError(f"{name} must be an int in {knob.low}..{knob.high}, got {value!r}")
        object.__setattr__(self, "knobs", tuple(sorted(knobs.items())))

    def knob(self, name: str) -> int:
        """The value of one of the variant's knobs."""
        return dict(self.knobs)[name]

    @property
    def tile(self) -> KernelConfig:
        """The same tiles as the one-tile-per-program variant (what runs where this variant cannot)."""
        return self if self.variant == "tile" else dataclasses.replace(self, variant="tile", knobs=())

    def to_dict(self) -> dict[str, int | str]:
        data: dict[str, int | str] = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                                      if f.name != "knobs"}
        return {**data, **dict(self.knobs)}

    to_json = to_dict

    @classmethod
    def from_dict(cls, data: Any) -> KernelConfig:
        """Build from JSON data (the tile fields, "variant", the variant's knobs); raise ValueError on unknown
        fields, missing tile sizes or bad values."""
        if not isinstance(data, dict):
            raise ValueError(f"a kernel config must be a JSON object, got {type(data).__name__}")
        if "tma" in data:
            raise ValueError("a kernel config in the format before kernel variants (a 'tma' field): tune again")
        fields = {f.name for f in dataclasses.fields(cls)} - {"knobs"}
        variant = variant_registry.get(data.get("variant", "tile"))
        unknown = set(data) - fields - set(variant.knobs)
        if unknown:
            names = ", ".join(sorted(unknown))  # JSON object keys: strings
            raise ValueError(f"unknown kernel config fields: {names if names.isprintable() else shown(names, 80)}")
        missing = {"block_m", "block_n", "block_k"} - set(data)
        if missing:
            raise ValueError(f"kernel config lacks: {', '.join(sorted(missing))}")
        knobs = {name: data[name] for name in variant.knobs if name in data}
        return cls(**{name: value for name, value in data.items() if name in fields}, knobs=knobs)

    def short(self) -> str:
        tiles = f"{self.block_m}x{self.block_n}x{self.block_k}"
        label = variant_registry.get(self.variant).label(dict(self.knobs))
        return f"{tiles} g{self.group_m} w{self.num_warps} s{self.num_stages}{label}"


_LIBRARY_PREFIX = "library:"


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
    """A stored choice: a KernelConfig object or `library:<name>`."""
    if isinstance(data, str):
        if data.startswith(_LIBRARY_PREFIX):
            return Library(data[len(_LIBRARY_PREFIX):])
        raise ValueError(f"a choice is a kernel config object or 'library:<name>', got {shown(data, 60)}")
    return KernelConfig.from_dict(data)


@dataclasses.dataclass(frozen=True)
class SearchSpace:
    """The values each tile knob of a kernel config may take; the tuner searches their product with every
    variant that applies (each with its own knobs' values, variants.Knob), filtered (autofuse/tune/space.py)
    before anything compiles."""

    block_m: tuple[int, ...] = (16, 32, 64, 128, 256)
    block_n: tuple[int, ...] = (16, 32, 64, 128, 256)
    block_k: tuple[int, ...] = (32, 64, 128, 256)
    group_m: tuple[int, ...] = (1, 8, 16)
    num_warps: tuple[int, ...] = (2, 4, 8)
    num_stages: tuple[int, ...] = (2, 3, 4, 5)
    variants: tuple[str, ...] | None = None  # None: every variant of the op that applies; else only these

    def dimensions(self) -> dict[str, tuple]:
        """The tile knobs and their values."""
        return {name: value for name, value in dataclasses.asdict(self).items() if name != "variants"}

    def searched(self, kinds: Collection[variant_registry.Variant]) -> tuple[variant_registry.Variant, ...]:
        """Of the variants that apply, those this space searches."""
        return tuple(v for v in kinds if self.variants is None or v.name in self.variants)

    def variant_dimensions(self, variant: variant_registry.Variant, interpret: bool) -> dict[str, tuple]:
        """The tile knobs as `variant` searches them: the space's, with the tile sizes the variant sets itself."""
        return {**self.dimensions(), **variant.own_values_searched(interpret)}

    def points(self, kinds: Collection[variant_registry.Variant], interpret: bool):
        """Every config, per variant of `kinds`, of the product of its tile knobs (variant_dimensions) and its
        knobs' values."""
        for variant in kinds:
            dims = self.variant_dimensions(variant, interpret)
            knobs = {name: knob.interpreter_values if interpret else knob.values
                     for name, knob in variant.knobs.items()}
            for values in itertools.product(*dims.values()):
                tiles = dict(zip(dims, values))
                for chosen in itertools.product(*knobs.values()):
                    yield KernelConfig(**tiles, variant=variant.name, knobs=dict(zip(knobs, chosen)))

    def size(self, kinds: Collection[variant_registry.Variant] = (variant_registry.TILE,),
             interpret: bool = False) -> int:
        total = 0
        for variant in kinds:
            count = 1
            for values in self.variant_dimensions(variant, interpret).values():
                count *= len(values)
            for knob in variant.knobs.values():
                count *= len(knob.interpreter_values if interpret else knob.values)
            total += count
        return total


# Under the interpreter every program costs milliseconds: a tiny space of large tiles.
INTERPRETER_SPACE = SearchSpace(block_m=(16, 32, 64), block_n=(32, 64), block_k=(32, 64), group_m=(1, 8),
                                num_warps=(4,), num_stages=(1, 2))


def shared_memory_bytes(config: KernelConfig, operand_tiles: tuple[int, int], dtype: torch.dtype,
                        weight_bytes: int | None = None) -> int:
    """Estimate of the shared memory a config's software pipeline needs: `operand_tiles` activation
    tiles [BLOCK_M, BLOCK_K] and weight tiles [BLOCK_K, BLOCK_N] per stage (an OpSpec's), the weights
    `weight_bytes` an element (dtype's by default). Used to drop configs that would fail with OutOfResources."""
    activations, weights = operand_tiles
    weight_bytes = dtype.itemsize if weight_bytes is None else weight_bytes
    per_stage = (activations * config.block_m * dtype.itemsize + weights * config.block_n * weight_bytes)
    per_stage *= config.block_k
    # Triton keeps up to num_stages tiles in flight; count them all (Inductor estimates the same way).
    return config.num_stages * per_stage


def clamp_to_problem(config: KernelConfig, M: int, N: int, K: int) -> KernelConfig:
    """Shrink tiles that are larger than the problem (never below the variant's smallest size: 16, tl.dot's
    minimum, for the tensor-core variants)."""
    variant = variant_registry.get(config.variant)
    return dataclasses.replace(config, **{
        name: min(getattr(config, name), max(variant.block_sizes(name)[0], next_power_of_2(size)))
        for name, size in zip(variant_registry.TILE_DIMENSIONS, (M, N, K))})


def fit_shared_memory(config: KernelConfig, operand_tiles: tuple[int, int], dtype: torch.dtype,
                      limit: int, weight_bytes: int | None = None) -> KernelConfig:
    """Drop pipeline stages, then halve BLOCK_K, until the estimate fits under `limit` bytes."""
    while shared_memory_bytes(config, operand_tiles, dtype, weight_bytes) > limit:
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
class Rule:
    """One row of a heuristic table: for M up to `max_m` (None: any), where `variant` (one without knobs)
    applies (and, with `wide_only`, only for 16-bit operands), the config's numbers. `narrow` replaces
    (block_n, num_stages) for ops whose tiles stay narrow (two accumulators, or an epilogue loading more
    tiles); block_k is (16-bit operands, 32-bit operands): 16-bit ones fit twice the K per byte of shared
    memory."""

    max_m: int | None
    variant: str
    block_m: int
    block_n: int
    block_k: tuple[int, int]
    num_warps: int
    num_stages: int
    narrow: tuple[int, int] | None = None
    wide_only: bool = False
    group_m: int = 8


def from_rules(rules: tuple[Rule, ...], shape: Shape, kinds: Collection[str], narrow_n: bool = False) -> KernelConfig:
    """The config of the first row of `rules` that matches `shape` (M, 16-bit operands) among the variants
    `kinds` that apply, clamped to the problem."""
    wide = shape.dtype.itemsize <= 2
    rule = next(r for r in rules if (r.max_m is None or shape.M <= r.max_m) and r.variant in kinds
                and (wide or not r.wide_only))
    block_n, stages = rule.narrow if narrow_n and rule.narrow else (rule.block_n, rule.num_stages)
    config = KernelConfig(rule.block_m, block_n, rule.block_k[0 if wide else 1], group_m=rule.group_m,
                          num_warps=rule.num_warps, num_stages=stages, variant=rule.variant)
    return clamp_to_problem(config, shape.M, shape.N, shape.K)


# The GEMM family's heuristic on a GPU, first matching row wins. Small M is weight-streaming bound (narrow M,
# long K tiles; split-K added below, within one wave of the SMs); large M is compute bound (128-wide tiles, deep
# pipelines), and on Hopper the persistent TMA kernels beat the best one-tile-per-program configs there (M = 4096).
GEMM_RULES = (
    Rule(16, "tile", 16, 64, (128, 64), num_warps=4, num_stages=4),
    Rule(32, "tile", 32, 64, (128, 64), num_warps=4, num_stages=4),
    Rule(64, "tile", 64, 64, (128, 64), num_warps=4, num_stages=4),
    Rule(256, "tile", 64, 128, (64, 32), num_warps=4, num_stages=4, narrow=(64, 4)),
    Rule(None, "tma", 128, 256, (64, 64), num_warps=8, num_stages=3, narrow=(128, 4), wide_only=True),
    Rule(None, "tile", 128, 128, (64, 32), num_warps=8, num_stages=4, narrow=(128, 3)),
)
# Under the interpreter each program costs milliseconds, so the largest tiles win there.
INTERPRETER_RULES = (Rule(None, "tile", 64, 64, (64, 64), num_warps=4, num_stages=1),)


def gemm_heuristic(shape: Shape, device: Device, kinds: Collection[str], *, operand_tiles: tuple[int, int],
                   narrow_n: bool, split_k_fill: bool = True) -> KernelConfig:
    """A sound default for a GEMM-shaped kernel: the fallback when no tuned config exists, read from the rule
    tables above. `kinds`: the names of the variants that apply to this op, shape and device
    (variants.applicable); with `split_k_fill`, split-K, where it applies, splits K while the programs still fit
    one wave of the SMs (_split_within_wave)."""
    config = from_rules(INTERPRETER_RULES if device.interpret else GEMM_RULES, shape, kinds, narrow_n)
    if device.interpret:
        return config
    if split_k_fill and "split_k" in kinds and config.variant == "tile":
        config = _split_within_wave(config, shape, device.multiprocessors)
    return fit_shared_memory(config, operand_tiles, shape.dtype, device.shared_memory_limit)


def gemv_configs(shape: Shape, device: Device, kinds: Collection[str], operand_tiles: tuple[int, int],
                 fp8_weights: bool = False) -> tuple[KernelConfig, ...]:
    """The GEMV configs a first-use check times on a GPU where the gemv variant applies (decode's smallest M), its
    first-use config first, or (). Swept on an H100 (bf16, M = 1, graph-replayed, the kernel compiled for its K;
    eight MLPs, d_model 896-7237, d_ff 4864-16384, 36-165 GEMV configs per op): the gate and up matrices take
    1 x 1024 on 4 warps (within 1.044x of each shape's fastest GEMV config on the six MLPs of at least 2**25
    elements a matrix, 1.075x on the two smaller); one weight matrix (a Linear, a down projection) takes 1 x 512
    on 8 warps where it holds at least 2**25 elements (within 1.064x), else 4 x 8192 on 8 (1.032x; outputs x K
    per program, K clamped to the problem's). The second of each is where those ran furthest from the fastest on an
    H200 (46 GEMV configs a matrix, six MLPs): one matrix 2 x 8192 on 4 warps (down projections of 6304 -> 7040 and
    4096 -> 5696: 22.3 and 10.6 us against 24.8 and 13.1 for the first), the gate and up 1 x 2048 on 8 (4096 ->
    5696: 22.9 against 26.8).
    With fp8 weights (`fp8_weights`, one byte an element) the same H200 sweep over five MLPs of 267-1217 MB (34
    configs a matrix) found one matrix fastest in 1 x 1024 on 4 warps, 8 weight bytes a thread a step (the down
    projections of 3456 -> 17344, 4224 -> 23104 and 6480 -> 27640: 18.7, 29.8 and 50.2 us, against 25.4, 36.1 and
    64.3 in bf16's 1 x 512 on 8, 2 fp8 bytes a thread a step), and the gate and up matrices in bf16's first, then
    1 x 512 on 4 (4224 -> 23104: 62.4 against 65.3; 1 x 2048 on 8 ran 1.18-1.33x the fastest)."""
    if device.interpret or "gemv" not in kinds:
        return ()
    large = shape.N * shape.K >= 1 << 25
    if operand_tiles[1] == 1:
        sizes = (((1, 1024, 4) if fp8_weights else (1, 512, 8)) if large else (4, 8192, 8), (2, 8192, 4))
    else:
        sizes = ((1, 1024, 4), (1, 512, 4) if fp8_weights else (1, 2048, 8))
    return tuple(dict.fromkeys(_gemv_config(shape, block_n, block_k, warps, 1) for block_n, block_k, warps in sizes))


def _gemv_config(shape: Shape, block_n: int, block_k: int, warps: int, split: int) -> KernelConfig:
    """A GEMV config covering every row of `shape` in one program row, clamped to the problem."""
    config = KernelConfig(next_power_of_2(shape.M), block_n, block_k, group_m=1, num_warps=warps, num_stages=1,
                          variant="gemv", knobs={"split_k": split})
    return clamp_to_problem(config, shape.M, shape.N, shape.K)


# Where a tuning run's GEMV search starts, after the first-use configs (gemv_configs), from the eight MLPs'
# sweeps of its docstring (H100, bf16): the configs of the lowest geometric mean of time over each shape's fastest
# on the MLPs of at least 2**25 elements a matrix (1.01-1.07x), and for one matrix the two best on the smaller
# MLPs; as (outputs, K, warps, split_k) per program, one weight matrix, then the gate and up matrices.
_GEMV_STARTS = {1: ((1, 512, 8, 1), (1, 8192, 16, 1), (1, 8192, 4, 1), (4, 2048, 4, 4), (1, 4096, 4, 1),
                    (8, 1024, 8, 1), (4, 8192, 8, 1)),
                2: ((1, 1024, 4, 1), (1, 1024, 8, 1), (1, 512, 4, 1), (1, 2048, 8, 1), (2, 512, 4, 1),
                    (4, 512, 4, 1))}


def gemv_starts(shape: Shape, device: Device, kinds: Collection[str], operand_tiles: tuple[int, int],
                fp8_weights: bool = False) -> tuple[KernelConfig, ...]:
    """The GEMV configs a tuning run times right after the heuristic's (the first-use ones first), or () where
    the gemv variant does not apply. TPE alone, over a space that holds every variant, left four of six held-out
    MLPs slower at M = 1 after 30 trials than their first-use configs (H100, graph-replayed); starting from these,
    one (a tensor-core config of gated_pairs won its up projection, 1.4% slower)."""
    first = gemv_configs(shape, device, kinds, operand_tiles, fp8_weights)
    if not first:
        return ()
    starts = (_gemv_config(shape, *sizes) for sizes in _GEMV_STARTS[1 if operand_tiles[1] == 1 else 2])
    return tuple(dict.fromkeys([*first, *(c for c in starts if variant_registry.GEMV.fits(c, shape))]))


# Tensor-core tiles of the weight-only fp8 ops at decode sizes above the GEMV's M (2 <= M <= FP8_DECODE_MAX_M), per
# weight-matrix count: the first-use config, then the alternatives a first-use check times beside it; as (block_n,
# block_k, num_warps, num_stages, split): `split` > 0 adds split-K until the programs cover that many times the SMs,
# 0 none, RESIDENT the largest split whose programs are all resident at once (_split_to_resident), BALANCED the
# split up to 4 whose programs fill their waves best (_split_to_balance).
# The first two swept on an H100 (bf16 activations, weights widened by bit moves; 8 MLPs, d_model 896-8192, d_ff
# 4864-28672; M = 2 and 16; 16 tile shapes times split-K 1-16, graph-replayed side by side). Which tile is fastest
# turns on how the programs fill the SMs' waves, so no one config holds everywhere: the faster of each pair was within
# 1.054x of each shape's fastest config by geometric mean (max 1.156) for the gate and up matrices, 1.015x (max
# 1.044) for one matrix, where the dense GEMM rule's config ran 1.199x (max 1.432) and 1.057x (max 1.195).
# The third of each, from a sweep on an H200 (five MLPs of 267-1217 MB, weights in rows of whole 128-byte lines):
# the down projection of 6480 -> 27640 at M = 2 ran 80.3 us at the pair's split of 4 (408 programs), 66.9 at 5
# (510, of 528 resident) and 200-240 with 64 x 256 tiles at every split; 4224 -> 23104's 33.8 at 4 and 30.5 at 8
# (528). The gate and up matrices of 6480 -> 27640 ran 106.8 us in 128-wide tiles against the pair's 121.7,
# 7616 -> 26624's 121.4 against 127.2 (4224 -> 23104: the pair's 57.9 the fastest).
# The fourth, for the gate and up matrices: the first config split K so that its waves are full. That config's
# pipeline (6 stages, 123 KB) leaves one program an SM, and its read rate followed how evenly its programs spread
# over the SMs: 3456 -> 17344 (271 programs, 3 waves of 132 for 2.05 waves of work) 66% of the read ceiling,
# 7616 -> 26624 (416, 4 for 3.15) 79%, 6480 -> 27640 (432, 4 for 3.27) 73%, 4224 -> 23104 (361, 3 for 2.73) 84%.
FP8_DECODE_MAX_M = 16
RESIDENT = -1
BALANCED = -2
# One e4m3 byte a weight in shared memory.
_FP8_WEIGHT_BYTES = 1


class _Fp8Tile(NamedTuple):
    """An entry of _FP8_DECODE_TILES. `weight_bytes`: a weight's bytes in shared memory as its stages were swept, where
    the activations are 16-bit: None, as wide as the activations (the H100 sweep, weights widened by bit moves; every
    pair fits so with bf16 activations, float32 activations drop stages), or one e4m3 byte (the H200 sweep, weights
    held as they are)."""

    block_n: int
    block_k: int
    warps: int
    stages: int
    split: int
    weight_bytes: int | None = None


_FP8_DECODE_TILES = {
    1: (_Fp8Tile(64, 128, 4, 4, 2), _Fp8Tile(64, 256, 4, 3, 1), _Fp8Tile(64, 128, 4, 4, RESIDENT, _FP8_WEIGHT_BYTES)),
    2: (_Fp8Tile(64, 128, 4, 6, 0), _Fp8Tile(64, 256, 4, 2, 0), _Fp8Tile(128, 128, 4, 4, 0, _FP8_WEIGHT_BYTES),
        _Fp8Tile(64, 128, 4, 6, BALANCED, _FP8_WEIGHT_BYTES))}
# The most K slices _split_to_balance gives the gate and up matrices.
_BALANCED_MAX_SPLIT = 4


def fp8_decode_tiles(shape: Shape, device: Device, kinds: Collection[str], operand_tiles: tuple[int, int]
                     ) -> tuple[KernelConfig, ...]:
    """The weight-only fp8 ops' first-use config and its alternatives at decode sizes (_FP8_DECODE_TILES), or ()
    where they do not apply: under the interpreter, above FP8_DECODE_MAX_M, and where the GEMV applies (decode's
    smallest M, where the GEMV configs are the heuristic's or its alternatives: gemv_configs)."""
    if device.interpret or shape.M > FP8_DECODE_MAX_M or "gemv" in kinds:
        return ()
    configs = []
    for tile in _FP8_DECODE_TILES[1 if operand_tiles[1] == 1 else 2]:
        split = tile.split
        config = clamp_to_problem(KernelConfig(16, tile.block_n, tile.block_k, group_m=8, num_warps=tile.warps,
                                               num_stages=tile.stages), shape.M, shape.N, shape.K)
        if split > 0 and "split_k" in kinds:
            config = _split_to_fill(config, shape, split * device.multiprocessors)
        # The stages fitted as the tile was swept (_Fp8Tile.weight_bytes), as wide as the activations otherwise.
        weight_bytes = tile.weight_bytes if shape.dtype.itemsize == 2 else None
        config = fit_shared_memory(config, operand_tiles, shape.dtype, device.shared_memory_limit, weight_bytes)
        if split == RESIDENT and "split_k" in kinds:
            config = _split_to_resident(config, shape, device, operand_tiles)
        elif split == BALANCED and "split_k" in kinds:
            config = _split_to_balance(config, shape, device, operand_tiles)
        configs.append(config)
    return tuple(dict.fromkeys(configs))


def _split_to_resident(config: KernelConfig, shape: Shape, device: Device, operand_tiles: tuple[int, int]
                       ) -> KernelConfig:
    """`config` split K the most ways (up to 16, two K blocks a slice at least) whose programs are all resident on
    the SMs at once: the SMs times how many programs' pipelines (fp8 weight tiles) one SM's shared memory holds. A
    second, partial wave of programs streams at a fraction of the rate (the down projection of 6480 -> 27640 at
    M = 2: 816 programs over 528 resident slots ran 75.2 us, 510 ran 66.9; H200)."""
    k_blocks = -(-shape.K // config.block_k)
    resident = _resident_programs(config, shape, device, operand_tiles)
    return with_split_k(config, max(1, min(16, resident // tiles(shape.M, shape.N, config), k_blocks // 2)))


def _split_to_balance(config: KernelConfig, shape: Shape, device: Device, operand_tiles: tuple[int, int]
                      ) -> KernelConfig:
    """`config` split K 1 to _BALANCED_MAX_SPLIT ways (two K blocks a slice at least), the split whose programs
    fill their waves of resident programs best (programs over the slots of the waves they take), the fewest slices
    among equals: the last wave of a run of programs streams with its empty slots idle."""
    slots = _resident_programs(config, shape, device, operand_tiles)
    output_tiles = tiles(shape.M, shape.N, config)
    k_blocks = -(-shape.K // config.block_k)

    def filled(split: int) -> float:
        programs = output_tiles * split
        return programs / (-(-programs // slots) * slots)

    splits = range(1, max(1, min(_BALANCED_MAX_SPLIT, k_blocks // 2)) + 1)
    return with_split_k(config, max(splits, key=lambda split: (filled(split), -split)))


def _resident_programs(config: KernelConfig, shape: Shape, device: Device, operand_tiles: tuple[int, int]) -> int:
    """How many of `config`'s programs the SMs hold at once: the SMs times how many programs' pipelines (fp8 weight
    tiles, one byte a weight) one SM's shared memory holds."""
    per_program = shared_memory_bytes(config, operand_tiles, shape.dtype, _FP8_WEIGHT_BYTES)
    return device.multiprocessors * max(1, device.shared_memory_limit // per_program)


def tiles(M: int, N: int, config: KernelConfig) -> int:
    """The output tiles of an [M, N] problem under `config`."""
    return -(-M // config.block_m) * -(-N // config.block_n)  # ceil-divisions


def split_k(config: KernelConfig) -> int:
    """How many programs share an output tile, each over a slice of K (1: each over the whole of K)."""
    return dict(config.knobs).get("split_k", 1)


def with_split_k(config: KernelConfig, split: int) -> KernelConfig:
    """`config`'s tiles with K split `split` ways (the split_k variant); `config` itself at 1."""
    return config if split == 1 else dataclasses.replace(config, variant="split_k", knobs={"split_k": split})


def _split_within_wave(config: KernelConfig, shape: Shape, multiprocessors: int) -> KernelConfig:
    """Split K while twice the programs would still fit one wave of the SMs (a narrow output, e.g. a down
    projection at small M, has fewer tiles than SMs), keeping at least two K blocks per program. Swept on an H100
    (the Linear's heuristic tiles at split 1-16, bf16, graph-replayed; N 576-6144, K 2688-16384, M = 16, 64, 128:
    54 points): this rule's split ran within 1.020x of each point's fastest split by geometric mean (worst 1.29x),
    where splitting until the programs cover the SMs ran 1.170x (worst 1.78x; over 1.10x at 25 points): a second
    wave of split programs costs more than the idle SMs of the first."""
    programs = tiles(shape.M, shape.N, config)
    k_blocks = -(-shape.K // config.block_k)
    split = 1
    while programs * split * 2 <= multiprocessors and split < 16 and k_blocks >= 4 * split:
        split *= 2
    return with_split_k(config, split)


def _split_to_fill(config: KernelConfig, shape: Shape, multiprocessors: int) -> KernelConfig:
    """Split K until the programs cover the SMs (a narrow output, e.g. a down projection at small M,
    has fewer tiles than SMs), keeping at least two K blocks per program."""
    programs = tiles(shape.M, shape.N, config)
    k_blocks = -(-shape.K // config.block_k)
    split = 1
    while programs * split < multiprocessors and split < 16 and k_blocks >= 4 * split:
        split *= 2
    return with_split_k(config, split)
