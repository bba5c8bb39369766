"""Render kernel templates and import the result as Triton kernels.

Jinja decides structure (bias, residual, activation, masked K, interpreter upcasts); block sizes,
GROUP_M, warps and stages stay constexprs and launch options. A kernel's parameter list comes from
its op's operands (opspec.py), written by the `signature` macro of _common.py.jinja. The rendered
source is compiled from memory once per distinct source (load_source: no kernel file is written), and
Triton's own cache compiles it once per config.
"""

from __future__ import annotations

import dataclasses
import hashlib
import linecache
import sys
import types
from functools import cache
from pathlib import Path

import jinja2
import jinja2.meta

from . import variants
from .device import check_interpreter_consistency, interpreting
from .opspec import FP8_WEIGHTS, OpSpec, Parameter, parameters, signature_lines
from .resources import templates_dir


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    """Everything that changes a kernel's source. Numbers that only change its speed live in KernelConfig."""

    op: OpSpec
    activation: str
    has_bias: bool = False
    has_residual: bool = False
    even_k: bool = False  # K % BLOCK_K == 0: the K loop needs no mask
    input_precision: str | None = None  # for float32 operands: "ieee" or "tf32"; None for 16-bit
    upcast_operands: bool = False  # under the interpreter, bf16 arithmetic is wrong: dot in float32
    variant: str = "tile"  # a registered kernel variant of the op (autofuse/variants.py)
    static_k: int | None = None  # the K a variant compiled for one K (Variant.static_k) holds as a constant
    # Programmatic Dependent Launch (sm_90+): "launch" lets the next kernel in the stream start its programs once
    # every program of this one has started; "wait" (a kernel launched as such a dependent) waits for the kernel
    # before it to finish and its writes to be visible before touching memory. None: neither.
    grid_dependency: str | None = None

    def __post_init__(self) -> None:
        if self.activation not in self.op.activations:
            raise ValueError(f"op {self.op.name!r} has no activation {self.activation!r}; "
                             f"it has {', '.join(self.op.activations)}")
        refused = self.op.variants_allowed(self.has_residual, self.variant)
        if refused:
            raise ValueError(refused)
        if self.static_k is not None and (type(self.static_k) is not int or not 1 <= self.static_k < 2**31):
            raise ValueError(f"static_k must be an int in 1..2**31-1 or None, not {self.static_k!r}")
        if self.grid_dependency not in (None, "launch", "wait"):
            raise ValueError(f"grid_dependency must be None, 'launch' or 'wait', not {self.grid_dependency!r}")
        if self.input_precision not in (None, "ieee", "tf32"):
            raise ValueError(f"input_precision must be None, 'ieee' or 'tf32', not {self.input_precision!r}")

    @property
    def kernel_name(self) -> str:
        # Says what the kernel is in profiler traces: autofuse_gated_up_gelu_tanh_bias_tma, autofuse_linear_fp8w_none,
        # autofuse_linear_w8a8_gelu.
        flags = (("bias", self.has_bias), ("res", self.has_residual), (self.variant, self.variant != "tile"))
        weights = {"dense": [], "fp8": ["fp8w"]}.get(self.op.weights, [self.op.weights])
        return "_".join(["autofuse", self.op.template, *weights, self.activation] + [name for name, on in flags if on])

    @property
    def parameters(self) -> tuple[Parameter, ...]:
        variant = variants.get(self.variant)
        flags = {"has_bias": self.has_bias, "has_residual": self.has_residual}
        return parameters(self.op.operands, self.op.sizes, variant, variant.workspace or self.op.always_workspace,
                          flags)

    @property
    def constexprs(self) -> tuple[str, ...]:
        return self.op.kernel_constexprs(self.variant)


def _folders(op: OpSpec, variant: variants.Variant, folder: Path) -> tuple[Path, ...]:
    """Where a kernel's templates are looked up, in order: the variant's folder, the op's, then `folder`
    (autofuse's templates/): a variant or an op defined outside keeps its templates in its own folder and still
    imports ours."""
    return tuple(Path(f) for f in (variant.template_dir, op.template_dir, folder) if f is not None)


@cache
def _environment(folders: tuple[Path, ...]) -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader([str(f) for f in folders]),
        undefined=jinja2.StrictUndefined,  # a missing variable fails loudly instead of rendering blank
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )


def render(spec: KernelSpec) -> str:
    """The Python source of the kernel described by `spec`."""
    variant = variants.get(spec.variant)
    template = _environment(_folders(spec.op, variant, templates_dir())).get_template(
        entry_template(spec.op, variant))
    return template.render(**template_variables(spec))


def template_variables(spec: KernelSpec) -> dict:
    """What a template is rendered with: the spec's fields, the kernel's name and signature lines, every
    registered variant's name, true for the one rendered (a variant without a file of its own is the op
    template's `{% if <name> %}` blocks), `fp8_weights`, whether the op's weights are fp8, `fp8_activations`,
    whether its kernel quantizes the activations too (OpSpec.weights), and `peel_k`, whether its K loop runs the
    steps wholly inside K unmasked and masks the partial last one only (fp8 weights times bf16 activations with a
    K that BLOCK_K does not divide: `k_loop` in _common.py.jinja says why)."""
    fields = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec) if f.name != "op"}
    flags = {name: name == spec.variant for name in variants.names()}
    fp8_weights, fp8_activations = spec.op.weights in FP8_WEIGHTS, spec.op.weights == "w8a8"
    return dict(kernel_name=spec.kernel_name, signature=signature_lines(spec.parameters, spec.constexprs), **flags,
                fp8_weights=fp8_weights, fp8_activations=fp8_activations,
                peel_k=fp8_weights and not fp8_activations and not spec.even_k, **fields)


def entry_template(op: OpSpec, variant: variants.Variant) -> str:
    """The template `render` starts from for `op`'s kernel in `variant`."""
    return f"{op.template}{variant.template_suffix}.py.jinja"


def template_hash(op: OpSpec) -> str:
    """Hash of the templates an op's kernels render from, so tuned configs notice a changed template (or a
    variant registered for the op, or one taken away)."""
    return _template_hash(op, variants.of(op))


@cache
def _template_hash(op: OpSpec, kinds: tuple[variants.Variant, ...]) -> str:
    # `kinds` keys the memo: registering or removing a variant of the op hashes its closure again.
    return hash_template_files(op, templates_dir())


def _find(folders: tuple[Path, ...], name: str) -> Path | None:
    for where in folders:
        if (where / name).is_file():
            return where / name
    return None


def template_closure(op: OpSpec, folder: Path) -> dict[str, Path]:
    """Every template `op`'s kernels render from: each variant's entry template and, recursively, every template
    they import, include or extend (read from the sources by Jinja's own parser, not kept by hand), each as found
    for its variant (the variant's folder, the op's, then `folder`)."""
    env = jinja2.Environment()
    found: dict[str, Path] = {}
    for variant in variants.of(op):
        folders = _folders(op, variant, folder)
        todo = [entry_template(op, variant)]
        while todo:
            name = todo.pop()
            if name in found:
                continue
            path = _find(folders, name)
            if path is None:
                raise ValueError(f"op {op.name}: template {name} not found")
            found[name] = path
            for referenced in jinja2.meta.find_referenced_templates(env.parse(path.read_text())):
                if referenced is None:  # a name computed at render time: what it loads cannot be known here
                    raise ValueError(f"op {op.name}: {name} loads a template whose name is computed; name it "
                                     "literally")
                todo.append(referenced)
    return dict(sorted(found.items()))


def hash_template_files(op: OpSpec, folder: Path) -> str:
    """The hash of the templates in `op`'s closure (template_closure), `folder` standing for autofuse's templates/."""
    digest = hashlib.sha256()
    for name, path in template_closure(op, folder).items():
        digest.update(name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


@dataclasses.dataclass(frozen=True)
class Kernel:
    """A loaded kernel: the Triton JIT function, its positional parameters (what to pass, in order),
    its constexprs in signature order, and the operands that change from call to call (those with
    a row per token: their first axis is M), which a bound launch swaps in per call."""

    fn: object
    parameters: tuple[Parameter, ...]
    constexprs: tuple[str, ...]
    per_call: frozenset[str]
    dependent: bool = False  # launched as a Programmatic Dependent Launch (KernelSpec.grid_dependency "wait")


@cache
def load_kernel(spec: KernelSpec) -> Kernel:
    """The kernel for `spec`, rendered and imported once per distinct source. Memoised: rendering
    costs far more than a launch, which must not pay it."""
    return Kernel(load_source(render(spec), spec.kernel_name), spec.parameters, spec.constexprs, spec.op.per_call,
                  spec.grid_dependency == "wait")


_loaded: dict[str, object] = {}


def load_source(source: str, name: str):
    """The Triton JIT function `name` defined in `source`, compiled once per distinct source (also for
    hand-written variants in benchmarks).

    The source never touches the disk. Triton reads a kernel's text back through `inspect` (the JIT when
    the decorator runs, the interpreter again at the first launch), which reads `linecache` before any
    file: the text is registered there under a name no file can stand in for (`<...>`: linecache never
    opens such a name), with no modification time, so no cache check drops it. A kernel file on disk
    could be swapped between the compile and that read, by this user or, through a parent folder, by
    another; without one, the text Triton reads is the text compiled here."""
    digest = hashlib.sha256(source.encode()).hexdigest()[:20]
    # Interpreted and compiled kernels differ in kind even for equal source: key on the mode too.
    interpret = interpreting()
    key = f"{name}-{digest}-{int(interpret)}"
    if key not in _loaded:
        check_interpreter_consistency()
        filename = source_name(name, digest)
        register_source(filename, source)
        module_name = f"autofuse._generated.{name}_{digest}_{int(interpret)}"
        module = types.ModuleType(module_name)
        module.__file__ = filename
        sys.modules[module_name] = module
        exec(compile(source, filename, "exec"), module.__dict__)  # noqa: S102 - autofuse's own rendered source
        _loaded[key] = getattr(module, name)
    return _loaded[key]


# What every generated kernel's code is named by (source_name): compile_workers sends only such kernels to a worker.
SOURCE_PREFIX = "<autofuse kernel "


def source_name(name: str, digest: str) -> str:
    """The name a generated kernel's code carries (tracebacks, Triton's locations): not a path."""
    return f"{SOURCE_PREFIX}{name}_{digest}>"


def register_source(filename: str, source: str) -> None:
    """Make `source` what inspect and linecache return for `filename` for the rest of the process."""
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
