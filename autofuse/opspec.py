"""What an op is, as data: one OpSpec per op (defined in autofuse/ops/<op>.py), read by the renderer, the
launchers, the tuner, the runtime and the CLI.

A kernel's parameters are generated from the op's operands by name (`parameters`): the template
writes its signature with one macro (`common.signature`) from that list, and the launcher builds
its positional arguments from the same list (`launch_args`), so the two can never drift apart.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from . import variants
from .configs import (
    INTERPRETER_SPACE,
    Device,
    KernelConfig,
    SearchSpace,
    Shape,
    fp8_decode_tiles,
    gemm_heuristic,
    gemv_configs,
    gemv_starts,
)

# A GEMM-shaped op with every variant the shared template pieces give (split-K, persistent TMA) and the
# default search spaces: what linear and gated_up declare, and an op added outside may too.
GEMM_VARIANTS = dict(variants=("tile", "split_k", "tma"), space=SearchSpace(), interpreter_space=INTERPRETER_SPACE)

# A pass over memory with one fixed tile shape (BLOCK_M x BLOCK_N over an [M, N] problem), nothing to tune:
# what the gated MLP's pointwise ops declare.
POINTWISE = dict(sizes=("M", "N"), constexprs=("BLOCK_M", "BLOCK_N"))

# How an op's weights may be stored and multiplied (OpSpec.weights).
WEIGHT_FORMATS = ("dense", "fp8", "w8a8")
FP8_WEIGHTS = ("fp8", "w8a8")  # the formats whose weights are float8_e4m3fn with a scale per output channel

# KernelSpec flags an operand may depend on ("!" negates): its bias, its residual, or a variant's name (the
# operand is present in that variant's kernel only).
OPERAND_FLAGS = ("has_bias", "has_residual")


@dataclasses.dataclass(frozen=True)
class Operand:
    """One tensor a kernel takes. Its parameter is `<name>_ptr`, or `<name>_desc` where a TMA variant
    reads it through a tensor descriptor; its strides are `stride_<name><axis>` for each letter of
    `axes` (none for a vector, none for a descriptor)."""

    name: str
    doc: str  # shape and meaning, written beside the parameter in the generated source
    axes: str = ""
    when: str = ""  # a flag of OPERAND_FLAGS or a variant's name, "!" negating it; "" for always present
    tma_block: tuple[str, str] | None = None  # variants with descriptors: a descriptor of blocks of these constexprs

    def __post_init__(self) -> None:
        if self.when and not self.when.removeprefix("!").isidentifier():
            raise ValueError(f"operand {self.name}: condition {self.when!r} is not a flag or a variant's name")


@dataclasses.dataclass(frozen=True)
class Parameter:
    """One positional kernel parameter and where its launch value comes from."""

    name: str
    kind: str  # "tensor" | "descriptor" | "size" | "stride" | "workspace"
    operand: str = ""  # the operand a tensor, descriptor or stride is taken from
    index: int = 0  # size: position in the sizes; stride: the dimension; workspace: 0 sums, 1 counters
    block: tuple[str, str] | None = None  # descriptor: the constexprs giving its block shape
    doc: str = ""


def _present(operand: Operand, flags: Mapping[str, bool], variant: str) -> bool:
    if not operand.when:
        return True
    name = operand.when.removeprefix("!")
    value = flags[name] if name in OPERAND_FLAGS else name == variant
    return value != operand.when.startswith("!")


def parameters(operands: tuple[Operand, ...], sizes: tuple[str, ...], variant: variants.Variant, workspace: bool,
               flags: Mapping[str, bool]) -> tuple[Parameter, ...]:
    """The positional parameters of one kernel variant, in order: operands (pointers, or descriptors where
    the variant reads through them), sizes, strides, then the split-K workspace. `flags`: has_bias,
    has_residual."""
    present = [o for o in operands if _present(o, flags, variant.name)]
    as_descriptor = {o.name for o in present if variant.descriptors and o.tma_block is not None}
    params = []
    for o in present:
        if o.name in as_descriptor:
            doc = f"descriptor of {o.doc}, blocks [{o.tma_block[0]}, {o.tma_block[1]}]"
            params.append(Parameter(f"{o.name}_desc", "descriptor", o.name, block=o.tma_block, doc=doc))
        else:
            params.append(Parameter(f"{o.name}_ptr", "tensor", o.name, doc=o.doc))
    params += [Parameter(size, "size", index=i) for i, size in enumerate(sizes)]
    for o in present:
        if o.name not in as_descriptor:
            params += [Parameter(f"stride_{o.name}{axis}", "stride", o.name, index=i) for i, axis in enumerate(o.axes)]
    if workspace:
        params.append(Parameter("ws_ptr", "workspace", index=0, doc="float32 partial sums, all zero between launches"))
        params.append(Parameter("count_ptr", "workspace", index=1, doc="int32 arrival counters, all zero between "
                                                                        "launches"))
    return tuple(params)


def signature_lines(params: tuple[Parameter, ...], constexprs: tuple[str, ...]) -> list[tuple[str, str]]:
    """(text, comment) lines of a kernel's parameter list, for the template's `signature` macro: one
    line per operand and workspace buffer, the sizes on one line, each operand's strides on one."""
    lines: list[tuple[list[str], str, tuple | None]] = []
    for p in params:
        group = (p.kind, p.operand) if p.kind in ("size", "stride") else None
        if group is not None and lines and lines[-1][2] == group:
            lines[-1][0].append(p.name)  # sizes and one operand's strides stand next to each other
        else:
            lines.append(([p.name], p.doc, group))
    text = [(", ".join(names) + ",", doc) for names, doc, _ in lines]
    if constexprs:
        text.append((", ".join(f"{c}: tl.constexpr" for c in constexprs) + ",", ""))
    return text


def launch_args(params: tuple[Parameter, ...], tensors: Mapping[str, torch.Tensor], sizes: tuple[int, ...],
                constexprs: Mapping[str, int], workspace: tuple = (), descriptor: Callable | None = None) -> list:
    """The positional launch arguments for `params`: tensors by operand name, sizes in order, strides
    read from the tensors, descriptors built by `descriptor(tensor, rows, cols)`."""
    args = []
    for p in params:
        kind = p.kind
        if kind == "tensor":
            args.append(tensors[p.operand])
        elif kind == "stride":
            args.append(tensors[p.operand].stride(p.index))
        elif kind == "size":
            args.append(sizes[p.index])
        elif kind == "descriptor":
            args.append(descriptor(tensors[p.operand], constexprs[p.block[0]], constexprs[p.block[1]]))
        else:
            args.append(workspace[p.index])
    return args


# Dimensions of a shapes-file entry an op is keyed by at M rows: (n, k, activation) from an MLP or Linear.
Dims = Callable[[object, int], tuple[int, int, str]]


@dataclasses.dataclass(frozen=True)
class LibraryPath:
    """A library candidate that computes the op for some of its keys only (e.g. one activation):
    `applies(activation, bias, residual)` says for which. Called like a plain candidate."""

    run: Callable  # fn(operands: dict, activation) -> output
    applies: Callable[[str, bool, bool], bool]

    def __call__(self, operands: Mapping, activation: str) -> torch.Tensor:
        return self.run(operands, activation)


# Library candidates registered from outside, per op name (register_library): they compete wherever the op's
# own do (first-use checks, races, the tuner), and a record naming one is valid while it is registered.
_REGISTERED_LIBRARY: dict[str, dict[str, Callable]] = {}


def register_library(op: OpSpec, name: str, run: Callable) -> None:
    """Add `run` (fn(operands: dict, activation) -> output, or a LibraryPath) as `op`'s library candidate `name`."""
    if not isinstance(name, str) or not name.isidentifier() or len(name) > 40:
        raise ValueError(f"a library candidate is named by an identifier of at most 40 characters, got {name!r}")
    if name in op.candidates:
        raise ValueError(f"op {op.name} already has a library candidate {name!r}")
    _REGISTERED_LIBRARY.setdefault(op.name, {})[name] = run


def unregister_library(op: OpSpec, name: str) -> None:
    _REGISTERED_LIBRARY.get(op.name, {}).pop(name, None)


@dataclasses.dataclass(frozen=True, eq=False)  # eq=False: hashed by identity, so KernelSpec can hold one
class OpSpec:
    """Everything about one op that is not its kernel source or its launcher's code."""

    name: str  # the op's key, CLI and record name
    template: str  # kernel family: <template>.py.jinja, and <template><suffix>.py.jinja for variants with a suffix
    doc: str  # one line for help texts
    operands: tuple[Operand, ...]
    activations: tuple[str, ...]
    run: Callable  # run(operands: dict, activation, config, out=None) -> output, through the kernel
    sizes: tuple[str, ...] = ("M", "N", "K")  # the kernel's size parameters; the last is reduced over
    constexprs: tuple[str, ...] = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M")
    # The kernel variants its templates implement (autofuse/variants.py), and constexprs one of them takes
    # beyond the op's, the variant's and its knobs' (e.g. {"tma": ("BLOCK_H",)}).
    variants: tuple[str, ...] = ("tile",)
    variant_constexprs: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    residual: bool = False  # has a residual variant (has_residual)
    always_workspace: bool = False  # takes the workspace in every variant (the one-launch MLP)
    # Activation tiles [BLOCK_M, BLOCK_K] and weight tiles [BLOCK_K, BLOCK_N] loaded per K step; each
    # weight tile feeds one float32 accumulator (shared memory and register estimates).
    operand_tiles: tuple[int, int] = (1, 1)
    narrow_n: bool = False  # two accumulators, or an epilogue loading more tiles: narrower default N tiles
    # Whether the GEMM heuristic splits K where its tiles leave SMs idle (configs.gemm_heuristic). Not for the gated
    # up-projections: their fastest split config ran 0.99-3.4x the unsplit tile's time, slower at 24 of 25 points
    # (gated_up and gated_pairs, N 2688-5376, K 576-4096, M 16-256, H100; docs/design.md).
    split_k_fill: bool = True
    # At decode's smallest M the first GEMV config (configs.gemv_configs) is the heuristic's, not an alternative a
    # first-use check times beside it: gated_up, whose tensor-core tile gated_pairs times beside it in the MLP's
    # plan (one kernel less to compile at first use).
    gemv_first: bool = False
    space: SearchSpace | None = None  # None: nothing to tune
    interpreter_space: SearchSpace | None = None
    # heuristic(shape, device, kinds) -> config, kinds the names of the variants that apply; None: gemm_heuristic
    heuristic: Callable[[Shape, Device, frozenset[str]], KernelConfig] | None = None
    # starts(shape, device, kinds) -> the measured configs a tuning run times right after the heuristic's, for an
    # op with a heuristic of its own (the others start from the GEMV's, configs.gemv_starts)
    starts: Callable[[Shape, Device, frozenset[str]], tuple[KernelConfig, ...]] | None = None
    # Library candidates: name -> fn(operands: dict, activation) -> output (or a LibraryPath, for
    # candidates that serve some keys only), what the op runs without a kernel. "eager" (what a
    # PyTorch model runs) comes first and is every op's fallback.
    library: Mapping[str, Callable] = dataclasses.field(default_factory=dict)
    reference: Callable | None = None  # fn(operands, activation, dtype) -> the float64 output
    # Ops whose weights are quantized (fp8): fn(operands, activation) -> the float64 output of the weights before
    # quantization (make_operands keeps them beside the quantized ones); each correct trial reports its error
    # against it, the quantization's share of what a user sees. None: nothing is quantized.
    original_reference: Callable | None = None
    # The tuner's problem: make_operands(n, k, M, bias, residual, rand) -> dict; its first operand is
    # the activations, drawn fresh for every check; output_width(n, k) the output's columns.
    make_operands: Callable | None = None
    output_width: Callable[[int, int], int] | None = None
    serves: str = ""  # "mlp" or "linear": shapes-file entries that get a key of this op; "" none
    # keyed_for(entry) -> whether a module of that shapes-file entry runs this op (None: every entry it serves)
    keyed_for: Callable | None = None
    dims: Dims | None = None
    # The sizes a module's training step runs the op at (training.Padding's) where they may differ from dims' (the
    # down projection: inference pads a width that is a multiple of 8 to one of 64, training leaves it); tuning for
    # training keys the op there too (keyed_dims). None: dims' only.
    training_dims: Dims | None = None
    max_m: int | None = None  # keyed and run only up to this M
    training: bool = False  # keyed only when tuning for training (--train)
    template_dir: Path | None = None  # None: autofuse's templates/; else searched first (ops added outside)
    # How the weights are stored and multiplied (WEIGHT_FORMATS): "dense" in the activations' dtype; "fp8":
    # float8_e4m3fn with a float32 scale per output channel (operand `s`), widened to the activations' dtype as
    # they are loaded and scaled in the epilogue; "w8a8": the same weights, and the activations quantized to fp8
    # inside the kernel with a scale per row (token) from its largest magnitude over K, for an fp8 x fp8 dot.
    # Templates read them as the flags `fp8_weights` (fp8, w8a8) and `fp8_activations` (w8a8).
    weights: str = "dense"

    def __post_init__(self) -> None:
        if self.library and next(iter(self.library)) != "eager":
            raise ValueError(f"op {self.name}: its first library candidate must be 'eager'")
        if self.weights not in WEIGHT_FORMATS:
            raise ValueError(f"op {self.name}: weights must be one of {', '.join(WEIGHT_FORMATS)}, "
                             f"got {self.weights!r}")
        if "tile" not in self.variants:
            raise ValueError(f"op {self.name}: every op has the tile variant")

    @property
    def candidates(self) -> dict[str, Callable]:
        """Every library candidate of the op: its own, then those registered for it from outside
        (register_library)."""
        return {**self.library, **_REGISTERED_LIBRARY.get(self.name, {})}

    def library_candidate(self, name: str) -> Callable:
        """The library candidate `name` (KeyError where the op has none of that name). Run per call of a library
        choice: looked up in place, without building `candidates`."""
        run = self.library.get(name)
        return run if run is not None else _REGISTERED_LIBRARY.get(self.name, {})[name]

    def keyed_dims(self, entry, M: int, train: bool) -> list[tuple[int, int, str]]:
        """The (n, k, activation) this op is keyed at for a shapes-file entry (or traffic shape) at M: dims', and with
        `train` training_dims' too where they differ."""
        found = [self.dims(entry, M)]
        if train and self.training_dims is not None:
            trained = self.training_dims(entry, M)
            if trained != found[0]:
                found.append(trained)
        return found

    def runs_for(self, entry) -> bool:
        """Whether a module of this shapes-file entry (or traffic shape) runs this op (keyed_for; None: every one)."""
        return self.keyed_for is None or self.keyed_for(entry)

    def library_for(self, activation: str, bias: bool, residual: bool) -> dict[str, Callable]:
        """The library candidates that compute this op for a key with these flags (eager always does)."""
        return {name: run for name, run in self.candidates.items()
                if not isinstance(run, LibraryPath) or run.applies(activation, bias, residual)}

    @functools.cached_property  # read on every pointwise launch
    def per_call(self) -> frozenset[str]:
        """The operands with a row per token (axes starting with m): what a bound launch takes anew per call."""
        return frozenset(o.name for o in self.operands if o.axes.startswith("m"))

    @property
    def tunable(self) -> bool:
        return self.space is not None

    def default_config(self, shape: Shape, device: Device) -> KernelConfig:
        """The built-in heuristic's config: the op's own, or the GEMM heuristic fed with its numbers."""
        kinds = self._kinds(shape, device)
        if self.heuristic is not None:
            return self.heuristic(shape, device, kinds)
        gemv = self._gemv_configs(shape, device, kinds) if self.gemv_first else ()
        if gemv:
            return gemv[0]
        fp8 = self._fp8_decode_tiles(shape, device, kinds)
        if fp8:
            return fp8[0]
        return gemm_heuristic(shape, device, kinds, operand_tiles=self.operand_tiles, narrow_n=self.narrow_n,
                              split_k_fill=self.split_k_fill)

    def alternative_configs(self, shape: Shape, device: Device) -> tuple[KernelConfig, ...]:
        """Configs a first-use check times beside the heuristic's, where one rule cannot tell which is faster, for
        the GEMM-shaped ops without a heuristic of their own: the GEMV configs at decode's smallest M (but the first
        where it is the heuristic's), and the weight-only fp8 ops' other tiles at decode sizes
        (configs.fp8_decode_tiles)."""
        if self.heuristic is not None:
            return ()
        kinds = self._kinds(shape, device)
        gemv = self._gemv_configs(shape, device, kinds)
        return (*self._fp8_decode_tiles(shape, device, kinds)[1:], *(gemv[1:] if self.gemv_first else gemv))

    def search_starts(self, shape: Shape, device: Device) -> tuple[KernelConfig, ...]:
        """Configs a tuning run times right after the heuristic's: the op's own measured starting points (`starts`),
        or the first-use alternatives of the weight-only fp8 ops and, where the GEMV applies, its own, its
        first-use configs first (configs.gemv_starts)."""
        kinds = self._kinds(shape, device)
        if self.heuristic is not None:
            return () if self.starts is None else self.starts(shape, device, kinds)
        return (*self._fp8_decode_tiles(shape, device, kinds)[1:],
                *gemv_starts(shape, device, kinds, self.operand_tiles, self.weights == "fp8"))

    def _gemv_configs(self, shape: Shape, device: Device, kinds: frozenset[str]) -> tuple[KernelConfig, ...]:
        """configs.gemv_configs for this op's weight format."""
        return gemv_configs(shape, device, kinds, self.operand_tiles, self.weights == "fp8")

    def _fp8_decode_tiles(self, shape: Shape, device: Device, kinds: frozenset[str]) -> tuple[KernelConfig, ...]:
        """configs.fp8_decode_tiles for an op with weight-only fp8 weights, () for the others."""
        return fp8_decode_tiles(shape, device, kinds, self.operand_tiles) if self.weights == "fp8" else ()

    def _kinds(self, shape: Shape, device: Device) -> frozenset[str]:
        """The names of this op's variants that apply to `shape` on `device` (variants.applicable)."""
        return frozenset(v.name for v in variants.applicable(self, device, shape))

    def search_space(self, interpret: bool) -> SearchSpace | None:
        return self.interpreter_space if interpret else self.space

    def kernel_constexprs(self, variant: str) -> tuple[str, ...]:
        """The constexprs of this op's kernel in `variant`, in signature order."""
        own = tuple(self.variant_constexprs.get(variant, ()))
        return self.constexprs + variants.get(variant).kernel_constexprs() + own

    def refuse_config(self, config: KernelConfig) -> str | None:
        """Why this op's kernel cannot run `config`, or None: the one rule that loading a record and
        launching apply alike."""
        return self.variants_allowed(False, config.variant)

    def variants_allowed(self, has_residual: bool, variant: str) -> str | None:
        """Why this op has no such kernel, or None when it has."""
        if has_residual and not self.residual:
            return f"op {self.name!r} takes no residual"
        if not any(v.name == variant for v in variants.of(self)):
            variants.get(variant)  # a name no variant has: ValueError lists the registered ones
            return f"the {self.name} kernel has no {variant} variant"
        return None
