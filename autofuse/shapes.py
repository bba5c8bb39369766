"""The shapes file: which MLPs and Linears to build, tune or benchmark, at which token counts.

    {
      "dtype": "bfloat16",                      # optional: float32 | float16 | bfloat16
      "tokens": [1, 16, 128],                   # optional: the M values (rows) to use
      "mlps":    [{"name": "gemma-2b", "d_model": 2048, "d_ff": 16384,
                   "activation": "gelu_tanh", "bias": false}],
      "linears": [{"name": "proj", "in_features": 4096, "out_features": 16384,
                   "activation": "gelu", "bias": true}]
    }

Every problem is reported with the path of the offending field, e.g. `mlps[1].d_ff: ...`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from .activations import GATED_ACTIVATIONS, LINEAR_ACTIVATIONS, canonical_activation
from .errors import AutofuseError, printable_name, shown
from .jsonfile import read_json

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DEFAULT_TOKENS = (1, 16, 128, 1024, 4096, 16384)
MAX_SIZE = 2**31 - 1  # the kernels' sizes are 32-bit
# More token counts than any deployment's buckets: each one is a tuning key per op and shape.
MAX_TOKENS = 64


@dataclasses.dataclass(frozen=True)
class MLPShape:
    name: str
    d_model: int
    d_ff: int
    activation: str = "gelu_tanh"
    bias: bool = False


@dataclasses.dataclass(frozen=True)
class LinearShape:
    name: str
    in_features: int
    out_features: int
    activation: str = "none"
    bias: bool = True


@dataclasses.dataclass(frozen=True)
class ShapeSet:
    dtype: torch.dtype
    tokens: tuple[int, ...]
    mlps: tuple[MLPShape, ...]
    linears: tuple[LinearShape, ...]
    weights: str = "dense"  # the weight format tuned for (opspec.WEIGHT_FORMATS: `autofuse tune --weights`)


def _fail(path: str, problem: str):
    raise AutofuseError(f"{path}: {problem}")


def _positive_int(value, path: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_SIZE:
        _fail(path, f"must be a positive integer up to {MAX_SIZE}, got {shown(value)}")
    return value


def _fields(entry, path: str, required: tuple[str, ...], optional: dict) -> dict:
    if not isinstance(entry, dict):
        _fail(path, f"must be an object, got {shown(entry)}")
    unknown = set(entry) - set(required) - set(optional) - {"name"}
    if unknown:
        _fail(path, f"unknown field(s) {_names(unknown)}")
    for key in required:
        if key not in entry:
            _fail(path, f"missing field '{key}'")
    return {**optional, **entry}


def _names(fields) -> str:
    """Unknown field names as a message shows them: each cut short, at most five."""
    names = sorted(shown(name, 24) for name in fields)
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def _activation(value, path: str, allowed) -> str:
    try:
        return canonical_activation(value, allowed)
    except AutofuseError as e:
        _fail(path, str(e))


def _bias(value, path: str) -> bool:
    if not isinstance(value, bool):
        _fail(path, f"must be true or false, got {shown(value)}")
    return value


def parse_shapes(data, source: str = "shapes") -> ShapeSet:
    """Validate decoded JSON `data` into a ShapeSet; `source` prefixes field paths in errors."""
    if not isinstance(data, dict):
        _fail(source, "must be a JSON object with 'mlps' and/or 'linears'")
    unknown = set(data) - {"dtype", "tokens", "mlps", "linears"}
    if unknown:
        model_config = "hidden_size" in data or "intermediate_size" in data or "architectures" in data
        _fail(source, f"unknown field(s) {_names(unknown)}" + (
            "; this looks like a Hugging Face config.json: pass it with --model instead of --shapes"
            if model_config else ""))
    dtype_name = data.get("dtype", "bfloat16")
    if not isinstance(dtype_name, str) or dtype_name not in DTYPES:
        _fail(f"{source}.dtype", f"must be one of {', '.join(DTYPES)}, got {shown(dtype_name)}")
    tokens = data.get("tokens", list(DEFAULT_TOKENS))
    if not isinstance(tokens, list) or not 1 <= len(tokens) <= MAX_TOKENS:
        _fail(f"{source}.tokens", f"must be a list of 1 to {MAX_TOKENS} positive integers"
              + (f", got {len(tokens)}" if isinstance(tokens, list) and tokens else ""))
    tokens = tuple(sorted({_positive_int(t, f"{source}.tokens[{i}]") for i, t in enumerate(tokens)}))

    mlps, linears = [], []
    for kind, out in (("mlps", mlps), ("linears", linears)):
        entries = data.get(kind, [])
        if not isinstance(entries, list):
            _fail(f"{source}.{kind}", "must be a list")
        for i, entry in enumerate(entries):
            path = f"{source}.{kind}[{i}]"
            if kind == "mlps":
                e = _fields(entry, path, ("d_model", "d_ff"), {"activation": "gelu_tanh", "bias": False})
                out.append(MLPShape(
                    name=printable_name(e.get("name", f"mlp{i}"), f"{path}.name"),
                    d_model=_positive_int(e["d_model"], f"{path}.d_model"),
                    d_ff=_positive_int(e["d_ff"], f"{path}.d_ff"),
                    activation=_activation(e["activation"], f"{path}.activation", GATED_ACTIVATIONS),
                    bias=_bias(e["bias"], f"{path}.bias"),
                ))
            else:
                e = _fields(entry, path, ("in_features", "out_features"), {"activation": "none", "bias": True})
                out.append(LinearShape(
                    name=printable_name(e.get("name", f"linear{i}"), f"{path}.name"),
                    in_features=_positive_int(e["in_features"], f"{path}.in_features"),
                    out_features=_positive_int(e["out_features"], f"{path}.out_features"),
                    activation=_activation(e["activation"], f"{path}.activation", LINEAR_ACTIVATIONS),
                    bias=_bias(e["bias"], f"{path}.bias"),
                ))
    if not mlps and not linears:
        _fail(source, "lists no 'mlps' and no 'linears'")
    return ShapeSet(DTYPES[dtype_name], tokens, tuple(mlps), tuple(linears))


def load_shapes(path: str | Path) -> ShapeSet:
    return parse_shapes(read_json(path, "shapes file"), Path(path).name)


def example_shapes_path() -> Path:
    return Path(__file__).parent / "examples" / "tiny.json"


def public_shapes_path() -> Path:
    """The model shapes autofuse is tuned and benchmarked on (t5, gemma-2b/7b, a Llama MLP, a Linear)."""
    return Path(__file__).parent / "examples" / "public.json"
