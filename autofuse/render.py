"""Render kernel templates and import the result as Triton kernels.

Jinja decides structure (bias, residual, activation, masked K, interpreter upcasts); block sizes,
GROUP_M, warps and stages stay constexprs and launch options. The rendered source is written to a
file named by its content hash and imported from there: Triton reads a kernel's source back from
its file, and one file per distinct source means each kernel is generated once per process and
compiled once per config by Triton's own cache.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import os
import sys
import tempfile
from functools import cache, lru_cache
from pathlib import Path

import jinja2

from .activations import GATED_ACTIVATIONS, LINEAR_ACTIVATIONS
from .device import check_interpreter_consistency, interpreting
from .resources import templates_dir, user_cache_dir

TEMPLATES = {"linear": LINEAR_ACTIVATIONS, "gated_up": GATED_ACTIVATIONS, "mlp_decode": GATED_ACTIVATIONS,
             "gated_bwd": GATED_ACTIVATIONS, "gated_act": GATED_ACTIVATIONS}
# Files whose text makes up a family's kernels, where it is not <family>.py.jinja (+ _tma) + _common.
_FAMILY_FILES = {"gated_bwd": ("gated_bwd.py.jinja", "gated_bwd_tma.py.jinja", "_grad.py.jinja", "_common.py.jinja")}


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    """Everything that changes a kernel's source. Numbers that only change its speed live in KernelConfig."""

    # "linear", "gated_up", "mlp_decode", "gated_bwd" (the gated MLP's backward GEMM) or "gated_act"
    # (the pointwise act(G) * U of the training forward)
    template: str
    activation: str
    has_bias: bool = False
    has_residual: bool = False  # linear only
    even_k: bool = False  # K % BLOCK_K == 0: the K loop needs no mask
    input_precision: str | None = None  # for float32 operands: "ieee" or "tf32"; None for 16-bit
    upcast_operands: bool = False  # under the interpreter, bf16 arithmetic is wrong: dot in float32
    split_k: bool = False  # SPLIT_K programs per output tile, meeting in a float32 workspace
    tma: bool = False  # persistent kernel over TMA tensor descriptors (templates/<template>_tma.py.jinja)

    def __post_init__(self) -> None:
        if self.template not in TEMPLATES:
            raise ValueError(f"unknown template {self.template!r}; known: {', '.join(TEMPLATES)}")
        if self.activation not in TEMPLATES[self.template]:
            raise ValueError(f"template {self.template!r} has no activation {self.activation!r}")
        if self.has_residual and self.template != "linear":
            raise ValueError("only the linear template takes a residual")
        if self.tma and self.split_k:
            raise ValueError("the TMA kernels have no split-K variant")
        if self.template in ("mlp_decode", "gated_act") and self.tma:
            raise ValueError(f"the {self.template} kernel has no TMA variant")
        if self.template in ("mlp_decode", "gated_bwd", "gated_act") and self.split_k:
            raise ValueError(f"the {self.template} kernel has no split-K variant")
        if self.input_precision not in (None, "ieee", "tf32"):
            raise ValueError(f"input_precision must be None, 'ieee' or 'tf32', not {self.input_precision!r}")

    @property
    def kernel_name(self) -> str:
        # Says what the kernel is in profiler traces: autofuse_gated_up_gelu_tanh_bias.
        parts = ["autofuse", self.template, self.activation]
        if self.has_bias:
            parts.append("bias")
        if self.has_residual:
            parts.append("res")
        if self.split_k:
            parts.append("splitk")
        if self.tma:
            parts.append("tma")
        return "_".join(parts)


@lru_cache(maxsize=1)
def _environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(templates_dir())),
        undefined=jinja2.StrictUndefined,  # a missing variable fails loudly instead of rendering blank
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )


def render(spec: KernelSpec) -> str:
    """The Python source of the kernel described by `spec`."""
    template = _environment().get_template(f"{spec.template}{'_tma' if spec.tma else ''}.py.jinja")
    fields = dataclasses.asdict(spec)
    fields.pop("template")
    fields.pop("tma")
    return template.render(kernel_name=spec.kernel_name, **fields)


@cache
def template_hash(template: str) -> str:
    """Hash of a template family's source files, so tuned configs can notice a changed template."""
    return hash_template_files(templates_dir(), template)


def hash_template_files(folder: Path, template: str) -> str:
    digest = hashlib.sha256()
    for name in _FAMILY_FILES.get(template, (f"{template}.py.jinja", f"{template}_tma.py.jinja", "_common.py.jinja")):
        if (folder / name).is_file():  # not every family has a TMA variant
            digest.update(name.encode() + (folder / name).read_bytes())
    return digest.hexdigest()[:16]


def generated_dir() -> Path:
    """Folder for rendered kernel files: the user's autofuse folder / kernels."""
    return user_cache_dir() / "kernels"


_loaded: dict[str, object] = {}


def load_kernel(spec: KernelSpec):
    """The Triton JIT function for `spec`, rendered and imported once per distinct source."""
    return load_source(render(spec), spec.kernel_name)


def load_source(source: str, name: str):
    """The Triton JIT function `name` defined in `source`, written to a file (Triton reads a kernel's
    source back from its file) and imported once per distinct source. Also for hand-written variants
    (benchmarks/explore_bwd.py)."""
    digest = hashlib.sha256(source.encode()).hexdigest()[:20]
    # Interpreted and compiled kernels differ in kind even for equal source: key on the mode too.
    interpret = interpreting()
    key = f"{name}-{digest}-{int(interpret)}"
    if key not in _loaded:
        check_interpreter_consistency()
        path = _write_once(source, f"{name}_{digest}.py")
        module_name = f"autofuse._generated.{name}_{digest}_{int(interpret)}"
        module_spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[module_name] = module
        module_spec.loader.exec_module(module)
        _loaded[key] = getattr(module, name)
    return _loaded[key]


def _write_once(source: str, filename: str) -> Path:
    """Write `source` under the generated folder unless an identical file is there.

    Written to a temporary file and renamed, so a killed process or a concurrent writer never
    leaves a half-written kernel behind. Falls back to the system temp folder if the cache folder
    cannot be written.
    """
    for folder in (generated_dir(), Path(tempfile.gettempdir()) / "autofuse-kernels"):
        path = folder / filename
        try:
            if path.is_file() and path.read_text() == source:
                return path
            folder.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                f.write(source)
            os.replace(tmp, path)
            return path
        except OSError:
            continue
    raise OSError(f"cannot write generated kernel {filename} to {generated_dir()} or the temp folder")
