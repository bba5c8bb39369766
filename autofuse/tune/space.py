"""The filter pipeline that runs on a search space (configs.SearchSpace, an OpSpec's) before
anything compiles: a sampled point is clamped to the problem, then dropped if its variant does not
apply or does not fit the problem, if its shared memory exceeds the device's limit or its accumulators
would need more registers than a thread has; what survives is deduplicated.
"""

from __future__ import annotations

import dataclasses

import torch

from .. import variants
from ..configs import KernelConfig, SearchSpace, Shape, clamp_to_problem, shared_memory_bytes
from ..variants import OWN_VALUE_FIELDS

# Registers: each thread holds its share of the fp32 accumulator tile(s). 255 registers per
# thread at most; leave ~25% for addresses, loads and the epilogue.
_MAX_ACCUMULATOR_REGS_PER_THREAD = 192

# The dimension of a flat search (Optuna's) that picks the variant; each variant's knobs are the
# dimensions "<variant>.<knob>", read only where that variant is picked.
VARIANT_DIM = "variant"


@dataclasses.dataclass(frozen=True)
class SearchProblem:
    """One key's problem as the search-space filters see it."""

    operand_tiles: tuple[int, int]  # the op's activation and weight tiles per K step (OpSpec)
    M: int
    N: int
    K: int
    dtype: torch.dtype
    # The op's variants that apply to this shape on this device (variants.applicable): what is searched.
    kinds: tuple[variants.Variant, ...] = (variants.TILE,)

    @property
    def shape(self) -> Shape:
        return Shape(self.M, self.N, self.K, self.dtype)


def flat_dimensions(space: SearchSpace, problem: SearchProblem, interpret: bool) -> dict[str, tuple]:
    """The space as independent categorical dimensions: the tile knobs, the variant, every variant's knobs and
    the values a variant sets itself ("<variant>.block_m", "<variant>.num_warps"), read only where that variant
    is picked."""
    dims: dict[str, tuple] = {**space.dimensions(), VARIANT_DIM: tuple(v.name for v in problem.kinds)}
    for variant in problem.kinds:
        for name, values in variant.own_values_searched(interpret).items():
            dims[f"{variant.name}.{name}"] = values
        for name, knob in variant.knobs.items():
            dims[f"{variant.name}.{name}"] = knob.interpreter_values if interpret else knob.values
    return dims


def config_from(params: dict) -> KernelConfig | None:
    """The config of a point of flat_dimensions (its variant's knobs and own values read, the others' ignored),
    or None for a point no kernel has."""
    variant = params[VARIANT_DIM]
    prefix = f"{variant}."
    own = {name[len(prefix):]: value for name, value in params.items() if name.startswith(prefix)}
    tiles = {name: value for name, value in params.items() if name != VARIANT_DIM and "." not in name}
    tiles.update({name: value for name, value in own.items() if name in OWN_VALUE_FIELDS})
    knobs = {name: value for name, value in own.items() if name not in OWN_VALUE_FIELDS}
    try:
        return KernelConfig(**tiles, variant=variant, knobs=knobs)
    except ValueError:
        return None


def flat_point(config: KernelConfig, dims: dict[str, tuple]) -> dict | None:
    """The point of flat_dimensions that config_from maps to `config` (the knobs and tile sizes of variants it
    is not given their first values), or None where `config` is outside the dimensions."""
    params = {name: values[0] for name, values in dims.items()}
    own = {f"{config.variant}.{name}": value for name, value in config.knobs}
    tiles = config.to_dict()
    for name in OWN_VALUE_FIELDS:
        if f"{config.variant}.{name}" in dims:  # a value the variant sets itself
            own[f"{config.variant}.{name}"] = tiles.pop(name)
    params.update({**tiles, **own})
    for name in [name for name in params if name not in dims]:
        del params[name]
    return params if all(params[name] in dims[name] for name in dims) else None


def accumulator_registers(config: KernelConfig, operand_tiles: tuple[int, int]) -> int:
    per_accumulator = variants.get(config.variant).accumulator_elements
    elements = config.block_m * config.block_n if per_accumulator is None else per_accumulator(config)
    return operand_tiles[1] * elements // (32 * config.num_warps)


def feasible(config: KernelConfig, problem: SearchProblem, shared_memory_limit: int,
             interpret: bool) -> KernelConfig | None:
    """The config clamped to the problem, or None when it cannot run on this device. Where one block of rows
    covers M, GROUP_M orders nothing (every program is in the first group: the same tile each, whatever its
    value), so the config takes group_m=1 and its twins of other group_m values are one config, not three to
    sweep."""
    config = clamp_to_problem(config, problem.M, problem.N, problem.K)
    if config.group_m != 1 and config.block_m >= problem.M:
        config = dataclasses.replace(config, group_m=1)
    variant = next((v for v in problem.kinds if v.name == config.variant), None)
    if variant is None:
        return None  # a variant that does not apply here
    if variant.fits is not None and not variant.fits(config, problem.shape):
        return None
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
    for point in space.points(problem.kinds, interpret):
        config = feasible(point, problem, shared_memory_limit, interpret)
        if config is not None:
            seen.setdefault(config)
    return list(seen)
