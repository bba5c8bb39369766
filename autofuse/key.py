"""The one key type shared by tuner, cache and runtime.

A key names one kernel problem on one software/hardware stack: the op, its template and that
template's source hash, N and K, the M bucket, dtype, bias/activation/residual, the GPU (name and
compute capability), and the Triton and CUDA versions. Anything that could make a tuned config
wrong or slow elsewhere is in it, so a changed template or Triton never reuses stale configs.
"""

from __future__ import annotations

import dataclasses
from functools import cache
from typing import Any

import torch

from . import ops
from .configs import next_power_of_2
from .device import cuda_index, interpreting
from .errors import shown
from .render import template_hash

# How a token count M maps to a tuned bucket: M itself where a key was tuned for it, else the next
# power of two up to MAX_M_BUCKET. Stored in every export under this name.
M_BUCKET_RULE = "pow2+tokens"
MAX_M_BUCKET = 16384
# Largest n, k or M bucket a key may hold: a kernel's sizes are 32-bit (no real layer is near it).
MAX_DIM = 2**31 - 1
# Longest text field a key holds (a GPU's name, versions, a hash): what a file may not bloat.
MAX_TEXT = 200


def m_bucket(M: int) -> int:
    return min(next_power_of_2(max(M, 1)), MAX_M_BUCKET)


DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


@dataclasses.dataclass(frozen=True)
class Environment:
    """Where a config was (or will be) tuned."""

    gpu: str  # torch.cuda.get_device_name(), or "interpreter"
    capability: str  # "9.0", or "cpu"
    triton: str
    cuda: str  # torch.version.cuda, or "none"


@cache
def _environment(device_index: int | None, interpret: bool) -> Environment:
    import triton  # here, not at the top: Triton is imported only once a kernel is keyed or built

    cuda = torch.version.cuda or "none"
    if interpret or device_index is None:
        return Environment("interpreter", "cpu", triton.__version__, cuda)
    major, minor = torch.cuda.get_device_capability(device_index)
    return Environment(torch.cuda.get_device_name(device_index), f"{major}.{minor}", triton.__version__, cuda)


def current_environment(device: torch.device) -> Environment:
    if interpreting() or device.type != "cuda":
        return _environment(None, True)
    return _environment(cuda_index(device), False)


@dataclasses.dataclass(frozen=True)
class TuningKey:
    op: str  # a registered op's name (autofuse/ops)
    template_hash: str
    n: int
    k: int
    m_bucket: int
    dtype: str  # "float32" | "float16" | "bfloat16"
    activation: str
    bias: bool
    residual: bool
    gpu: str
    capability: str
    triton: str
    cuda: str

    def __post_init__(self) -> None:
        if not isinstance(self.op, str) or self.op not in ops.names(tunable=True):
            raise ValueError(f"op must be one of {', '.join(ops.names(tunable=True))}, got {shown(self.op)}")
        spec = ops.get(self.op)
        if self.activation not in spec.activations:
            raise ValueError(f"activation {shown(self.activation)} is not valid for op {self.op!r}")
        if self.dtype not in DTYPE_NAMES.values():
            raise ValueError(f"dtype must be one of {', '.join(DTYPE_NAMES.values())}, got {shown(self.dtype)}")
        for name, most in (("n", MAX_DIM), ("k", MAX_DIM), ("m_bucket", MAX_DIM)):
            value = getattr(self, name)
            if type(value) is not int or not 1 <= value <= most:
                raise ValueError(f"{name} must be an integer in 1..{most}, got {shown(value)}")
        for name in ("bias", "residual"):
            if type(getattr(self, name)) is not bool:
                raise ValueError(f"{name} must be true or false")
        if self.residual and not spec.residual:
            raise ValueError(f"op {self.op!r} takes no residual")
        for name in ("template_hash", "gpu", "capability", "triton", "cuda"):
            value = getattr(self, name)
            # Printed as it is (cache ls, kernel headers): printable, so a file cannot make lines of its own.
            if (not isinstance(value, str) or not value or "|" in value or len(value) > MAX_TEXT
                    or not value.isprintable()):
                raise ValueError(f"{name} must be a non-empty string of at most {MAX_TEXT} printable characters "
                                 f"without '|', got {shown(value)}")

    @property
    def spec(self) -> ops.OpSpec:
        return ops.get(self.op)

    @property
    def template(self) -> str:
        return self.spec.template

    @property
    def torch_dtype(self) -> torch.dtype:
        return {v: k for k, v in DTYPE_NAMES.items()}[self.dtype]

    def problem(self) -> tuple:
        """Everything but the M bucket and the shape: keys equal here may share configs as neighbours."""
        return (self.op, self.template_hash, self.dtype, self.activation, self.bias, self.residual,
                self.gpu, self.capability, self.triton, self.cuda)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> TuningKey:
        if not isinstance(data, dict):
            raise ValueError(f"a key must be a JSON object, got {type(data).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        if set(data) != names:
            missing, extra = names - set(data), set(data) - names
            raise ValueError(f"key fields wrong: missing {sorted(missing)}, unknown {shown(sorted(extra), 80)}")
        return cls(**data)

    def id(self) -> str:
        """Canonical, human-readable text form; what the cache stores and `autofuse cache show` takes."""
        return "|".join(f"{f.name}={_text(getattr(self, f.name))}" for f in dataclasses.fields(self))

    @classmethod
    def parse(cls, text: str) -> TuningKey:
        fields = {f.name: f.type for f in dataclasses.fields(cls)}
        data: dict[str, Any] = {}
        for part in text.split("|"):
            name, sep, value = part.partition("=")
            if not sep or name not in fields:
                raise ValueError(f"not a key: {text!r} (bad part {part!r})")
            if name in ("n", "k", "m_bucket"):
                data[name] = int(value) if value.isdigit() else value
            elif name in ("bias", "residual"):
                data[name] = {"1": True, "0": False}.get(value, value)
            else:
                data[name] = value
        return cls.from_dict(data)


def _text(value: Any) -> str:
    return str(int(value)) if isinstance(value, bool) else str(value)


@dataclasses.dataclass(frozen=True)
class Problem:
    """One op on one shape at M rows, in one dtype, on one device: what a decision is made for and a key is
    built from. n and k are the op's (for the gated ops n is d_ff), M the rows of the call."""

    op: str
    n: int
    k: int
    M: int
    dtype: torch.dtype
    activation: str
    bias: bool = False
    residual: bool = False
    device: torch.device = torch.device("cpu")

    def __post_init__(self) -> None:
        object.__setattr__(self, "M", max(self.M, 1))  # an empty batch launches nothing: keyed as one row

    @property
    def bucket(self) -> int:
        return m_bucket(self.M)

    @property
    def spec(self) -> ops.OpSpec:
        return ops.get(self.op)

    def key(self, bucket: int | None = None, environment: Environment | None = None) -> TuningKey:
        """The tuning key at `bucket` (default: M's bucket) in `environment` (default: the device's)."""
        env = environment if environment is not None else current_environment(self.device)
        return TuningKey(
            op=self.op, template_hash=template_hash(ops.get(self.op)), n=self.n, k=self.k,
            m_bucket=self.bucket if bucket is None else bucket, dtype=DTYPE_NAMES[self.dtype],
            activation=self.activation, bias=self.bias, residual=self.residual,
            gpu=env.gpu, capability=env.capability, triton=env.triton, cuda=env.cuda,
        )

    def replace(self, **changes) -> Problem:
        return dataclasses.replace(self, **changes)
