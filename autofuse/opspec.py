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

from .configs import INTERPRETER_SPACE, Device, KernelConfig, SearchSpace, gemm_heuristic

# A GEMM-shaped op with every variant the shared template pieces give (split-K, persistent TMA) and the
# default search spaces: what linear and gated_up declare, and an op added outside may too.
GEMM_VARIANTS = dict(split_k=True, tma=True, space=SearchSpace(), interpreter_space=INTERPRETER_SPACE)

# A pass over memory with one fixed tile shape (BLOCK_M x BLOCK_N over an [M, N] problem), nothing to tune:
# what the gated MLP's pointwise ops declare.
POINTWISE = dict(sizes=("M", "N"), constexprs=("BLOCK_M", "BLOCK_N"))

# KernelSpec flags an operand may depend on ("!" negates): its bias, residual, TMA variant.
OPERAND_CONDITIONS = ("has_bias", "has_residual", "tma", "!tma")


@dataclasses.dataclass(frozen=True)
class Operand:
    """One tensor a kernel takes. Its parameter is `<name>_ptr`, or `<name>_desc` where a TMA variant
    reads it through a tensor descriptor; its strides are `stride_<name><axis>` for each letter of
    `axes` (none for a vector, none for a descriptor)."""

    name: str
    doc: str  # shape and meaning, written beside the parameter in the generated source
    axes: str = ""
    when: str = ""  # one of OPERAND_CONDITIONS, or "" for always present
    tma_block: tuple[str, str] | None = None  # TMA variants: a descriptor whose block is these constexprs

    def __post_init__(self) -> None:
        if self.when and self.when not in OPERAND_CONDITIONS:
            raise ValueError(f"operand {self.name}: condition {self.when!r} is not one of {OPERAND_CONDITIONS}")


@dataclasses.dataclass(frozen=True)
class Parameter:
    """One positional kernel parameter and where its launch value comes from."""

    name: str
    kind: str  # "tensor" | "descriptor" | "size" | "stride" | "workspace"
    operand: str = ""  # the operand a tensor, descriptor or stride is taken from
    index: int = 0  # size: position in the sizes; stride: the dimension; workspace: 0 sums, 1 counters
    block: tuple[str, str] | None = None  # descriptor: the constexprs giving its block shape
    doc: str = ""


def _present(operand: Operand, flags: Mapping[str, bool]) -> bool:
    if not operand.when:
        return True
    if operand.when.startswith("!"):
        return not flags[operand.when[1:]]
    return flags[operand.when]


def parameters(operands: tuple[Operand, ...], sizes: tuple[str, ...], workspace: bool,
               flags: Mapping[str, bool]) -> tuple[Parameter, ...]:
    """The positional parameters of one kernel variant, in order: operands (pointers or descriptors),
    sizes, strides, then the split-K workspace. `flags`: has_bias, has_residual, tma."""
    present = [o for o in operands if _present(o, flags)]
    as_descriptor = {o.name for o in present if flags["tma"] and o.tma_block is not None}
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


# Dimensions of a shapes-file entry an op is keyed by: (n, k, activation) from an MLP or Linear.
Dims = Callable[[object], tuple[int, int, str]]


@dataclasses.dataclass(frozen=True)
class LibraryPath:
    """A library candidate that computes the op for some of its keys only (e.g. one activation):
    `applies(activation, bias, residual)` says for which. Called like a plain candidate."""

    run: Callable  # fn(operands: dict, activation) -> output
    applies: Callable[[str, bool, bool], bool]

    def __call__(self, operands: Mapping, activation: str) -> torch.Tensor:
        return self.run(operands, activation)


@dataclasses.dataclass(frozen=True, eq=False)  # eq=False: hashed by identity, so KernelSpec can hold one
class OpSpec:
    """Everything about one op that is not its kernel source or its launcher's code."""

    name: str  # the op's key, CLI and record name
    template: str  # kernel family: <template>.py.jinja, and <template>_tma.py.jinja for the TMA variant
    doc: str  # one line for help texts
    operands: tuple[Operand, ...]
    activations: tuple[str, ...]
    run: Callable  # run(operands: dict, activation, config, out=None) -> output, through the kernel
    sizes: tuple[str, ...] = ("M", "N", "K")  # the kernel's size parameters; the last is reduced over
    constexprs: tuple[str, ...] = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M")
    tma_constexprs: tuple[str, ...] = ()  # beyond NUM_SMS and FLATTEN, which every persistent kernel takes
    residual: bool = False  # has a residual variant (has_residual)
    split_k: bool = False  # has a split-K variant (programs share a tile through a float32 workspace)
    tma: bool = False  # has a persistent TMA-descriptor variant
    always_workspace: bool = False  # takes the workspace in every variant (the one-launch MLP)
    # Activation tiles [BLOCK_M, BLOCK_K] and weight tiles [BLOCK_K, BLOCK_N] loaded per K step; each
    # weight tile feeds one float32 accumulator (shared memory and register estimates).
    operand_tiles: tuple[int, int] = (1, 1)
    narrow_n: bool = False  # two accumulators, or an epilogue loading more tiles: narrower default N tiles
    space: SearchSpace | None = None  # None: nothing to tune
    interpreter_space: SearchSpace | None = None
    heuristic: Callable[[int, int, int, torch.dtype, Device], KernelConfig] | None = None  # None: gemm_heuristic
    # Library candidates: name -> fn(operands: dict, activation) -> output (or a LibraryPath, for
    # candidates that serve some keys only), what the op runs without a kernel. "eager" (what a
    # PyTorch model runs) comes first and is every op's fallback.
    library: Mapping[str, Callable] = dataclasses.field(default_factory=dict)
    reference: Callable | None = None  # fn(operands, activation, dtype) -> the float64 output
    # The tuner's problem: make_operands(n, k, M, bias, residual, rand) -> dict; its first operand is
    # the activations, drawn fresh for every check; output_width(n, k) the output's columns.
    make_operands: Callable | None = None
    output_width: Callable[[int, int], int] | None = None
    serves: str = ""  # "mlp" or "linear": shapes-file entries that get a key of this op; "" none
    dims: Dims | None = None
    max_m: int | None = None  # keyed and run only up to this M
    training: bool = False  # keyed only when tuning for training (--train)
    template_dir: Path | None = None  # None: autofuse's templates/; else searched first (ops added outside)

    def __post_init__(self) -> None:
        if self.library and next(iter(self.library)) != "eager":
            raise ValueError(f"op {self.name}: its first library candidate must be 'eager'")

    def library_for(self, activation: str, bias: bool, residual: bool) -> dict[str, Callable]:
        """The library candidates that compute this op for a key with these flags (eager always does)."""
        return {name: run for name, run in self.library.items()
                if not isinstance(run, LibraryPath) or run.applies(activation, bias, residual)}

    @functools.cached_property  # read on every pointwise launch
    def per_call(self) -> frozenset[str]:
        """The operands with a row per token (axes starting with m): what a bound launch takes anew per call."""
        return frozenset(o.name for o in self.operands if o.axes.startswith("m"))

    @property
    def tunable(self) -> bool:
        return self.space is not None

    def default_config(self, M: int, N: int, K: int, dtype: torch.dtype, device: Device) -> KernelConfig:
        """The built-in heuristic's config: the op's own, or the GEMM heuristic fed with its numbers."""
        if self.heuristic is not None:
            return self.heuristic(M, N, K, dtype, device)
        return gemm_heuristic(M, N, K, dtype, device, operand_tiles=self.operand_tiles, narrow_n=self.narrow_n,
                              split_k=self.split_k)

    def search_space(self, interpret: bool) -> SearchSpace | None:
        return self.interpreter_space if interpret else self.space

    def kernel_constexprs(self, split_k: bool, tma: bool) -> tuple[str, ...]:
        extra = ("SPLIT_K",) if split_k else ()
        return self.constexprs + extra + (("NUM_SMS", "FLATTEN") + self.tma_constexprs if tma else ())

    def refuse_config(self, config: KernelConfig) -> str | None:
        """Why this op's kernel cannot run `config`, or None: the one rule that loading a record and
        launching apply alike."""
        return self.variants_allowed(False, config.split_k > 1, config.tma)

    def variants_allowed(self, has_residual: bool, split_k: bool, tma: bool) -> str | None:
        """Why this op has no such variant, or None when it has."""
        if has_residual and not self.residual:
            return f"op {self.name!r} takes no residual"
        if split_k and not self.split_k:
            return f"the {self.name} kernel has no split-K variant"
        if tma and not self.tma:
            return f"the {self.name} kernel has no TMA variant"
        if tma and split_k:
            return "the TMA kernels have no split-K variant"
        return None
