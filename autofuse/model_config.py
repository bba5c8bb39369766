"""The MLP shapes of a Hugging Face model, read from its config.json (no transformers needed).

Recognised: Gemma / Gemma2 / Gemma3 (GeGLU), T5 v1.1 / Flan-T5 / mT5 with a gated feed-forward
(`feed_forward_proj: "gated-gelu"`), and Llama-family configs with `hidden_size`,
`intermediate_size` and `hidden_act` (Llama, Mistral, Qwen2/3: SwiGLU). Configs that nest the
text model (`text_config`, as Gemma3 does) are read there.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from .errors import AutofuseError
from .jsonfile import read_json
from .shapes import DEFAULT_TOKENS, ShapeSet, parse_shapes

_DTYPE_NAMES = {"bfloat16": "bfloat16", "float16": "float16", "float32": "float32", "fp16": "float16",
                "bf16": "bfloat16", "fp32": "float32"}


def config_path(path: str | Path) -> Path:
    """`path` itself, or the config.json inside a model folder."""
    path = Path(path)
    return path / "config.json" if path.is_dir() else path


def mlp_entry(config: dict, source: str) -> dict:
    """One shapes-file MLP entry ({name, d_model, d_ff, activation, bias}) for a model config."""
    if not isinstance(config, dict):
        raise AutofuseError(f"{source}: a model config must be a JSON object")
    if isinstance(config.get("text_config"), dict):  # multimodal wrappers (Gemma3) keep the LM here
        config = {**config["text_config"], "model_type": config["text_config"].get("model_type",
                                                                                   config.get("model_type"))}
    model_type = str(config.get("model_type", "model"))
    if "d_ff" in config and "d_model" in config:  # the T5 family
        projection = str(config.get("feed_forward_proj", "relu"))
        if not projection.startswith("gated-"):
            raise AutofuseError(f"{source}: {model_type} uses a non-gated feed-forward ({projection!r}); "
                                "autofuse fuses gated MLPs (T5 v1.1 / Flan-T5 use 'gated-gelu')")
        activation = projection.removeprefix("gated-")
        # transformers' T5Config maps "gated-gelu" to gelu_new, the tanh approximation.
        activation = "gelu_new" if activation == "gelu" else activation
        return dict(name=model_type, d_model=config["d_model"], d_ff=config["d_ff"], activation=activation,
                    bias=False)
    missing = [k for k in ("hidden_size", "intermediate_size") if k not in config]
    if missing:
        raise AutofuseError(f"{source}: no {' or '.join(missing)}; not a config autofuse knows "
                            "(Gemma, T5 v1.1, Llama/Mistral/Qwen families)")
    activation = config.get("hidden_activation") or config.get("hidden_act") or "silu"
    return dict(name=model_type, d_model=config["hidden_size"], d_ff=config["intermediate_size"],
                activation=activation, bias=bool(config.get("mlp_bias", False)))


def shapes_from_model_config(path: str | Path, dtype: torch.dtype | None = None,
                             tokens: tuple[int, ...] | None = None) -> ShapeSet:
    """The shapes to tune for a model: its MLP at `tokens` (default DEFAULT_TOKENS), in `dtype`
    (default: the config's torch_dtype / dtype, else bfloat16)."""
    path = config_path(path)
    config = read_json(path, "model config")
    entry = mlp_entry(config, path.name)
    dtype_name = next((str(v) for v in (config.get("torch_dtype"), config.get("dtype")) if v), "bfloat16")
    data = dict(dtype=_DTYPE_NAMES.get(dtype_name.removeprefix("torch."), "bfloat16"),
                tokens=list(tokens or DEFAULT_TOKENS), mlps=[entry])
    shapes = parse_shapes(data, path.name)  # validates sizes and the activation like any shapes file
    return shapes if dtype is None else dataclasses.replace(shapes, dtype=dtype)
