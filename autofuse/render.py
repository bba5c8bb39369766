"""Render kernel templates and import the result as Triton kernels.

Jinja decides structure (bias, residual, activation, masked K, interpreter upcasts); block sizes,
GROUP_M, warps and stages stay constexprs and launch options. A kernel's parameter list comes from
its op's operands (ops/spec.py), written by the `signature` macro of _common.py.jinja. The rendered
source is written to a file named by its content hash and imported from there: Triton reads a
kernel's source back from its file, and one file per distinct source means each kernel is generated
once per process and compiled once per config by Triton's own cache.
"""

from __future__ import annotations

import atexit
import dataclasses
import hashlib
import os
import shutil
import sys
import tempfile
import types
from functools import cache
from pathlib import Path

import jinja2

from .device import check_interpreter_consistency, interpreting
from .opspec import OpSpec, Parameter, parameters, signature_lines
from .resources import templates_dir, user_cache_dir


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
    split_k: bool = False  # SPLIT_K programs per output tile, meeting in a float32 workspace
    tma: bool = False  # persistent kernel over TMA tensor descriptors (templates/<template>_tma.py.jinja)

    def __post_init__(self) -> None:
        if self.activation not in self.op.activations:
            raise ValueError(f"op {self.op.name!r} has no activation {self.activation!r}; "
                             f"it has {', '.join(self.op.activations)}")
        refused = self.op.variants_allowed(self.has_residual, self.split_k, self.tma)
        if refused:
            raise ValueError(refused)
        if self.input_precision not in (None, "ieee", "tf32"):
            raise ValueError(f"input_precision must be None, 'ieee' or 'tf32', not {self.input_precision!r}")

    @property
    def kernel_name(self) -> str:
        # Says what the kernel is in profiler traces: autofuse_gated_up_gelu_tanh_bias.
        flags = (("bias", self.has_bias), ("res", self.has_residual), ("splitk", self.split_k), ("tma", self.tma))
        return "_".join(["autofuse", self.op.template, self.activation] + [name for name, on in flags if on])

    @property
    def parameters(self) -> tuple[Parameter, ...]:
        flags = {"has_bias": self.has_bias, "has_residual": self.has_residual, "tma": self.tma}
        workspace = self.split_k or self.op.always_workspace
        return parameters(self.op.operands, self.op.sizes, workspace, flags)


@cache
def _environment(template_dir: Path | None) -> jinja2.Environment:
    folders = [str(template_dir)] if template_dir is not None else []
    return jinja2.Environment(
        # An op defined outside autofuse keeps its templates in its own folder and still imports ours.
        loader=jinja2.FileSystemLoader([*folders, str(templates_dir())]),
        undefined=jinja2.StrictUndefined,  # a missing variable fails loudly instead of rendering blank
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )


def render(spec: KernelSpec) -> str:
    """The Python source of the kernel described by `spec`."""
    template = _environment(spec.op.template_dir).get_template(
        f"{spec.op.template}{'_tma' if spec.tma else ''}.py.jinja")
    fields = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec) if f.name not in ("op", "tma")}
    lines = signature_lines(spec.parameters, spec.op.kernel_constexprs(spec.split_k, spec.tma))
    return template.render(kernel_name=spec.kernel_name, signature=lines, **fields)


@cache
def template_hash(op: OpSpec) -> str:
    """Hash of the source files of an op's kernels, so tuned configs can notice a changed template."""
    return hash_template_files(op, templates_dir())


def hash_template_files(op: OpSpec, folder: Path) -> str:
    """The hash of `op`'s template files as found in `op.template_dir`, then `folder`."""
    digest = hashlib.sha256()
    for name in op.template_files:
        for where in (op.template_dir, folder):
            if where is not None and (Path(where) / name).is_file():  # not every family has a TMA variant
                digest.update(name.encode() + (Path(where) / name).read_bytes())
                break
    return digest.hexdigest()[:16]


def generated_dir() -> Path:
    """Folder for rendered kernel files: the user's autofuse folder / kernels."""
    return user_cache_dir() / "kernels"


@dataclasses.dataclass(frozen=True)
class Kernel:
    """A loaded kernel: the Triton JIT function, its positional parameters (what to pass, in order),
    its constexprs in signature order, and the operands that change from call to call (those with
    a row per token: their first axis is M), which a bound launch swaps in per call."""

    fn: object
    parameters: tuple[Parameter, ...]
    constexprs: tuple[str, ...]
    per_call: frozenset[str]


@cache
def load_kernel(spec: KernelSpec) -> Kernel:
    """The kernel for `spec`, rendered and imported once per distinct source. Memoised: rendering
    costs far more than a launch, which must not pay it."""
    return Kernel(load_source(render(spec), spec.kernel_name), spec.parameters,
                  spec.op.kernel_constexprs(spec.split_k, spec.tma), spec.op.per_call)


_loaded: dict[str, object] = {}


def load_source(source: str, name: str):
    """The Triton JIT function `name` defined in `source`, written to a file (Triton reads a kernel's
    source back from its file) and imported once per distinct source. Also for hand-written variants
    (benchmarks/explore_bwd.py).

    What runs is `source` itself, compiled here: never bytecode found beside the file (a __pycache__
    another user planted), and the file lies in a folder only this user can write (_kernel_folder),
    so the text Triton reads back is the text compiled."""
    digest = hashlib.sha256(source.encode()).hexdigest()[:20]
    # Interpreted and compiled kernels differ in kind even for equal source: key on the mode too.
    interpret = interpreting()
    key = f"{name}-{digest}-{int(interpret)}"
    if key not in _loaded:
        check_interpreter_consistency()
        path = _write_once(source, f"{name}_{digest}.py")
        module_name = f"autofuse._generated.{name}_{digest}_{int(interpret)}"
        module = types.ModuleType(module_name)
        module.__file__ = str(path)
        sys.modules[module_name] = module
        exec(compile(source, str(path), "exec"), module.__dict__)  # noqa: S102 - autofuse's own rendered source
        _loaded[key] = getattr(module, name)
    return _loaded[key]


def _private(folder: Path) -> bool:
    """Whether `folder` is this user's and nobody else can write it (or it can be made so)."""
    try:
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        info = folder.stat()
    except OSError:
        return False
    return info.st_uid == os.getuid() and not info.st_mode & 0o022


_process_folder: Path | None = None


def _kernel_folder() -> Path:
    """The user's kernels folder where it is private; else a private folder of this process's own
    (never a shared, predictable one such as /tmp/autofuse-kernels, where another user could plant
    a kernel)."""
    global _process_folder
    folder = generated_dir()
    if _private(folder):
        return folder
    if _process_folder is None or not _private(_process_folder):
        _process_folder = Path(tempfile.mkdtemp(prefix="autofuse-kernels-"))
        # This process's alone: removed when it exits, so that runs do not pile folders up in /tmp.
        atexit.register(shutil.rmtree, _process_folder, ignore_errors=True)
    return _process_folder


def _write_once(source: str, filename: str) -> Path:
    """Write `source` under the kernel folder unless an identical file is there. Written to a
    temporary file and renamed, so a killed process or a concurrent writer never leaves a
    half-written kernel behind."""
    folder = _kernel_folder()
    path = folder / filename
    if path.is_file() and path.read_text() == source:
        return path
    fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(source)
    os.replace(tmp, path)
    return path
