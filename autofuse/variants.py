"""Kernel variants as registered objects: the ways one op's kernel can be built and launched.

A variant is
- a template part: its own file `<op template><template_suffix>.py.jinja` (found in the variant's
  template_dir, then the op's, then autofuse's templates/), or, with no suffix, the blocks of the op's
  template under `{% if <variant name> %}` (every registered variant's name is a template variable, true
  for the variant being rendered);
- its knobs: the numbers it adds to a config beside the tile sizes (each a constexpr, with the values the
  tuner searches on a GPU and under the interpreter, and the range a stored config may hold);
- `applies(device, shape)`: where the tuner searches it and the heuristic may pick it; `fits(config,
  shape)`: which of its configs suit a shape; `runs_with(operands)`: whether a launch can take these
  tensors (else the launcher runs the config's `tile` twin);
- how it is launched: how many programs, with which constexprs, with or without the split-K workspace
  (launch.launch_gemm launches every variant from these).

Registered here: `tile` (one output tile per program), `split_k` (programs share an output tile through
a float32 workspace), `tma` (persistent, over TMA tensor descriptors) and `gemv` (decode's CUDA-core
reduction for M = 1, with tile sizes of its own). An op names the variants its
templates implement (OpSpec.variants); a variant registered from outside names the ops it adds itself to
(`ops`). KernelConfig stores a variant by name with its knobs.
"""

from __future__ import annotations

import dataclasses
import functools
import keyword
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from .device import supports_tma


@dataclasses.dataclass(frozen=True)
class Device:
    """What a heuristic or a variant's predicate needs to know of where a kernel runs."""

    interpret: bool
    shared_memory_limit: int = 0
    multiprocessors: int = 108
    capability: tuple[int, int] = (0, 0)  # CUDA compute capability; (0, 0) under the interpreter


@dataclasses.dataclass(frozen=True)
class Shape:
    """The problem a kernel computes: an [M, N] output reduced over K, in `dtype`."""

    M: int
    N: int
    K: int
    dtype: torch.dtype


@dataclasses.dataclass(frozen=True)
class Knob:
    """A number a variant adds to a config: the constexpr it sets, the values searched, the values a stored
    config may hold (low..high)."""

    constexpr: str
    values: tuple[int, ...]
    interpreter_values: tuple[int, ...]
    low: int
    high: int

    def __post_init__(self) -> None:
        if not self.constexpr.isidentifier() or not self.constexpr.isupper():
            raise ValueError(f"a knob's constexpr is an upper-case identifier, got {self.constexpr!r}")
        for value in (*self.values, *self.interpreter_values):
            if not self.low <= value <= self.high:
                raise ValueError(f"knob {self.constexpr}: {value} is outside {self.low}..{self.high}")


def _everywhere(device: Device, shape: Shape) -> bool:
    return True


def _one_per_tile(tiles: int, config, multiprocessors: int) -> int:
    return tiles


@dataclasses.dataclass(frozen=True, eq=False)  # eq=False: compared and hashed by identity
class Variant:
    """One way to build and launch an op's kernel (see the module's docstring)."""

    name: str
    doc: str  # one line, for help texts
    template_suffix: str = ""  # "" : a part of the op's own template, under {% if <name> %}
    template_dir: Path | None = None  # searched first for the variant's template
    knobs: Mapping[str, Knob] = dataclasses.field(default_factory=dict)
    constexprs: tuple[str, ...] = ()  # constexprs the kernel takes beyond the op's and the knobs'
    descriptors: bool = False  # operands with a tma_block are passed as TMA tensor descriptors
    workspace: bool = False  # takes the split-K workspace (partial sums and arrival counters)
    # How it launches (launch.launch_gemm): programs(tiles, config, multiprocessors) -> the grid's size, and
    # the values of `constexprs` given the device's multiprocessor count (a persistent kernel's NUM_SMS).
    programs: Callable[[int, Any, int], int] = _one_per_tile
    launch_constexprs: Callable[[int], Mapping[str, int]] | None = None
    per_sm: bool = False  # its programs or constexprs read the multiprocessor count
    ops: tuple[str, ...] = ()  # ops that have this variant beside those whose OpSpec.variants names it
    # The values a config field of OWN_VALUE_FIELDS (the tile sizes block_m, block_n, block_k; num_warps,
    # num_stages) takes in this variant where they are not the op's search space's: searched instead of the
    # space's (on a GPU, under the interpreter); tile sizes named here are allowed in a stored config beside the
    # sizes every variant allows.
    own_values: Mapping[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    interpreter_own_values: Mapping[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    # Float32 elements of one accumulator per program (what the register estimate counts); None: one per output
    # element of its tile, block_m x block_n.
    accumulator_elements: Callable[[Any], int] | None = None
    applies: Callable[[Device, Shape], bool] = _everywhere
    fits: Callable[[Any, Shape], bool] | None = None  # (config, shape): None, every config of it fits
    runs_with: Callable[[Sequence[torch.Tensor]], bool] | None = None  # None: any operands
    # Compiled for one K: the kernel's source holds K as a constant (render.KernelSpec.static_k), so its K loop
    # has a known trip count and its masks are known at compile time; one compile per K.
    static_k: bool = False
    # Its kernels overlap through Programmatic Dependent Launch on sm_90+ (launch.kernel_for): an up projection's
    # lets the next kernel start as its last programs run, a Linear's is launched as a dependent and waits inside.
    dependent_launch: bool = False

    def knob_constexprs(self, knobs: Mapping[str, int]) -> dict[str, int]:
        return {self.knobs[name].constexpr: value for name, value in knobs.items()}

    def kernel_constexprs(self) -> tuple[str, ...]:
        return tuple(knob.constexpr for knob in self.knobs.values()) + self.constexprs

    def block_sizes(self, dimension: str) -> tuple[int, ...]:
        """The values `dimension` (block_m, block_n or block_k) may hold in a config of this variant, ascending."""
        return _block_sizes(self, dimension)

    def own_values_searched(self, interpret: bool) -> Mapping[str, tuple[int, ...]]:
        """The values of OWN_VALUE_FIELDS this variant searches instead of the space's, on a GPU or under the
        interpreter."""
        return self.interpreter_own_values if interpret else self.own_values

    def label(self, knobs: Mapping[str, int]) -> str:
        """How a config of this variant ends in short form: '' (tile), ' tma', ' split_k=4'."""
        if self.name == "tile":
            return ""
        own = f"={knobs[self.name]}" if self.name in knobs else ""
        return f" {self.name}{own}" + "".join(f" {k}={v}" for k, v in knobs.items() if k != self.name)


# The tile sizes every variant allows: tl.dot needs every tile dimension >= 16, and tl.arange powers of two.
BLOCK_SIZES = (16, 32, 64, 128, 256)
TILE_DIMENSIONS = ("block_m", "block_n", "block_k")
# The config fields a variant may search with values of its own (Variant.own_values).
OWN_VALUE_FIELDS = (*TILE_DIMENSIONS, "num_warps", "num_stages")

@functools.cache  # read by every KernelConfig built and clamped
def _block_sizes(variant: Variant, dimension: str) -> tuple[int, ...]:
    own = set(variant.own_values.get(dimension, ())) | set(variant.interpreter_own_values.get(dimension, ()))
    return tuple(sorted(own | set(BLOCK_SIZES)))


# The names a template already receives, and a config's fields: no variant or knob may take one.
_TAKEN = frozenset({"op", "activation", "has_bias", "has_residual", "even_k", "input_precision", "upcast_operands",
                    "variant", "kernel_name", "signature", "block_m", "block_n", "block_k", "group_m", "num_warps",
                    "num_stages", "knobs", "static_k", "grid_dependency", "fp8_weights", "fp8_activations", "peel_k"})

_REGISTRY: dict[str, Variant] = {}
_BUILT_IN: set[str] = set()


def register(variant: Variant) -> Variant:
    """Make `variant` known by its name (once); ops named in variant.ops have it from now on."""
    name = variant.name
    if not name.isidentifier() or keyword.iskeyword(name) or name in _TAKEN or name.startswith("_"):
        raise ValueError(f"a variant's name is an identifier a template can test and no field's name, got {name!r}")
    if name in _REGISTRY and _REGISTRY[name] is not variant:
        raise ValueError(f"a variant named {name!r} is already registered")
    for knob in variant.knobs:
        if not knob.isidentifier() or knob in _TAKEN:
            raise ValueError(f"variant {name}: knob name {knob!r} is not an identifier free to use")
    for field, values in (*variant.own_values.items(), *variant.interpreter_own_values.items()):
        if field not in OWN_VALUE_FIELDS:
            raise ValueError(f"variant {name}: own_values names {field!r}, not one of {', '.join(OWN_VALUE_FIELDS)}")
        if field == "num_stages":
            wrong = any(type(v) is not int or not 1 <= v <= 8 for v in values)
        else:  # tile sizes and warps: powers of two (tl.arange's sizes; warps up to 16)
            top = 16 if field == "num_warps" else 16384
            wrong = any(type(v) is not int or v < 1 or v & (v - 1) or v > top for v in values)
        if not values or wrong:
            raise ValueError(f"variant {name}: {field} values {values!r} are out of range")
    if variant.template_suffix and not variant.template_suffix.replace("_", "").isalnum():
        raise ValueError(f"variant {name}: template_suffix is letters, digits and '_', got {variant.template_suffix!r}")
    _REGISTRY[name] = variant
    return variant


def unregister(name: str) -> None:
    """Forget a variant registered from outside (the built-in ones stay)."""
    if name in _BUILT_IN:
        raise ValueError(f"variant {name!r} is built in")
    _REGISTRY.pop(name, None)


def is_gemv(name: Any) -> bool:
    """Whether the registered variant `name` is a GEMV: a CUDA-core reduction compiled for its K (static_k)."""
    return get(name).static_k


def get(name: Any) -> Variant:
    """The registered variant `name`; ValueError names the ones there are."""
    variant = _REGISTRY.get(name) if isinstance(name, str) else None
    if variant is None:
        shown_name = repr(name)[:40]
        raise ValueError(f"unknown kernel variant {shown_name}; registered: {', '.join(_REGISTRY)}")
    return variant


def names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def of(op) -> tuple[Variant, ...]:
    """The variants `op` (an OpSpec) has: those its `variants` names, then those naming it in their `ops`."""
    return tuple(v for name, v in _REGISTRY.items() if name in op.variants or op.name in v.ops)


def applicable(op, device: Device, shape: Shape) -> tuple[Variant, ...]:
    """The variants of `op` that apply to `shape` on `device`: what the tuner searches and the heuristic may pick."""
    return tuple(v for v in of(op) if v.applies(device, shape))


# Split-K pays where few output tiles leave SMs idle: small M. Above this M its float32 workspace traffic
# (split_k x M x N x 4 bytes each way) outweighs what it gains, so it is neither searched nor picked.
SPLIT_K_MAX_M = 256


def _split_k_fits(config, shape: Shape) -> bool:
    return config.knob("split_k") <= -(-shape.K // config.block_k)  # no more K slices than K blocks


def tma_device(device: Device) -> bool:
    """Whether TMA tensor descriptors work on `device`: Hopper (sm_90) and newer, or the interpreter."""
    return device.interpret or device.capability >= (9, 0)


def _tma_applies(device: Device, shape: Shape) -> bool:
    # Descriptor rows (K elements of the activations and of the weights) must be 16-byte multiples.
    return tma_device(device) and (shape.K * shape.dtype.itemsize) % 16 == 0


def _tma_operands(operands: Sequence[torch.Tensor]) -> bool:
    """What descriptors need of every operand: a contiguous last dimension and 16-byte aligned base and rows."""
    for t in operands:
        if t.stride(1) != 1 or t.data_ptr() % 16 or (t.stride(0) * t.element_size()) % 16:
            return False
    return supports_tma(operands[0].device)


TILE = Variant("tile", "one output tile per program")
SPLIT_K = Variant(
    "split_k", "programs share an output tile, each over a slice of K, through a float32 workspace",
    # SPLIT_K programs per output tile; `accumulators` float32 partial sums per output element meet in the
    # workspace, and the last program to arrive at a tile writes it.
    programs=lambda tiles, config, multiprocessors: tiles * config.knob("split_k"),
    knobs={"split_k": Knob("SPLIT_K", values=(2, 4, 8, 16), interpreter_values=(2,), low=2, high=64)},
    workspace=True,
    applies=lambda device, shape: shape.M <= SPLIT_K_MAX_M,
    fits=_split_k_fits,
)
TMA = Variant(
    "tma", "persistent: one program per SM walks the tiles, operands read through TMA descriptors",
    template_suffix="_tma",
    # One program per SM walks the tiles. FLATTEN: one software pipeline across the tile and K loops, so the
    # next tile's loads are already in flight during this tile's epilogue.
    constexprs=("NUM_SMS", "FLATTEN"),
    programs=lambda tiles, config, multiprocessors: min(multiprocessors, tiles),
    launch_constexprs=lambda multiprocessors: {"NUM_SMS": multiprocessors, "FLATTEN": True},
    per_sm=True,
    descriptors=True,
    applies=_tma_applies,
    runs_with=_tma_operands,
)
# The GEMV variant serves decode's smallest M, where a tensor-core tile of 16 rows computes mostly padding and a
# CUDA-core reduction streams the weights without a trip through shared memory. On an H100 (bf16) it ran down
# projections at M = 1 up to 20% faster than the best tensor-core config and cuBLAS; at M = 2 every GEMV config
# timed ran slower than the tensor-core tile (6480 -> 27640, H100: gated up projection 368 against 270 us in bf16
# and 266 against 208 with fp8 weights, fp8 down projection 118 against 104), at M = 4 every op 1.6-2.0x slower
# (M products per weight element in registers outweigh the weight stream): searched at M = 1 only.
GEMV_MAX_M = 1


def _gemv_fits(config, shape: Shape) -> bool:
    # One program covers every row (more row blocks would stream the weights once per block), and no more K
    # slices than K blocks.
    return config.block_m >= shape.M and config.knob("split_k") <= -(-shape.K // config.block_k)


GEMV = Variant(
    "gemv", "decode's CUDA-core reduction: BLOCK_M rows (M = 1) into BLOCK_N outputs per program, float32 products "
            "summed over K after the loop, optionally split over K through the workspace",
    template_suffix="_gemv",
    knobs={"split_k": Knob("SPLIT_K", values=(1, 2, 4, 8), interpreter_values=(1, 2), low=1, high=64)},
    programs=lambda tiles, config, multiprocessors: tiles * config.knob("split_k"),
    workspace=True,
    # Streaming the weights wants many bytes in flight per program: the fastest configs at M = 1 on an H100
    # (bf16, K compiled in) read 1-4 rows of 512-8192 elements a step on 4-16 warps, one stage (a loop with no
    # tl.dot is not pipelined: 2-4 stages ran within 0.3% of one, 6304 -> 7040 at M = 1). Stored configs may still
    # hold the tile sizes of every variant.
    own_values={"block_m": (1, 2, 4, 8), "block_n": (1, 2, 4, 8, 16),
                "block_k": (256, 512, 1024, 2048, 4096, 8192, 16384), "num_warps": (4, 8, 16), "num_stages": (1,)},
    interpreter_own_values={"block_m": (1, 2, 4, 8), "block_n": (8, 16), "block_k": (16, 32)},
    # The products of a K step accumulate unreduced: block_m x block_n x block_k float32 per accumulator.
    accumulator_elements=lambda config: config.block_m * config.block_n * config.block_k,
    applies=lambda device, shape: shape.M <= GEMV_MAX_M,
    fits=_gemv_fits,
    ops=("linear", "down", "gated_up", "linear_fp8", "down_fp8", "gated_up_fp8"),
    # A loop of runtime trip count ran the same reduction 4-7% slower at its fastest configs, and 1.5x
    # at one K step of 8192 on 16 warps (gated up projections 5568 -> 14496 and 6304 -> 7040 at M = 1, H100).
    static_k=True,
    dependent_launch=True,  # the tile variants' kernels ran slower so (launch.py says what each measured)
)
for _variant in (TILE, SPLIT_K, TMA, GEMV):
    register(_variant)
    _BUILT_IN.add(_variant.name)
