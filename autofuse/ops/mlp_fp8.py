"""The one-launch gated MLP with fp8 weights (weight-only), op `mlp_fp8`: the mlp_decode template with `fp8_weights`
(Wg, Wu, Wd stored as float8_e4m3fn with a float32 scale per output channel, as ops/linear_fp8.py quantizes them;
the weight tiles widened to the activations' type for the dots, each product's scales applied after its reduction).
For small fp8 MLPs at decode, where two launches' ramps cost more than the weights' bytes. Keyed apart from the
dense op and checked against the float64 product of the dequantized weights."""

from __future__ import annotations

import dataclasses

import torch

from .. import launch as L
from ..configs import KernelConfig
from ..opspec import Operand
from ..reference import eager_mlp, mlp_reference_rounded
from .linear_fp8 import check_weights, dequantize_fp8, quantize_weight
from .mlp import MLP, launch_one

OPERANDS = (
    Operand("x", "[M, D]", "mk"),
    Operand("wg", "[F, D] float8_e4m3fn, gate projection weight", "nk"),
    Operand("wu", "[F, D] float8_e4m3fn, up projection weight", "nk"),
    Operand("wd", "[D, F] float8_e4m3fn, down projection weight", "nk"),
    Operand("sg", "[F] float32, the scale of each row of wg"),
    Operand("su", "[F] float32, the scale of each row of wu"),
    Operand("sd", "[D] float32, the scale of each row of wd"),
    Operand("bg", "[F]", when="has_bias"),
    Operand("bu", "[F]", when="has_bias"),
    Operand("bd", "[D]", when="has_bias"),
    Operand("y", "[M, D]", "mn"),
)

_WEIGHTS = (("wg", "sg"), ("wu", "su"), ("wd", "sd"))


def mlp_decode_fp8(x: torch.Tensor, params: tuple, activation: str, config: KernelConfig,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """mlp_decode with fp8 weights: params (w_gate, b_gate, w_up, b_up, w_down, b_down), each weight a (W8, scale)
    pair (an Fp8Weight): W8 float8_e4m3fn ([F, D], [F, D], [D, F]), scale float32 per row."""
    (wg, sg), b_gate, (wu, su), b_up, (wd, sd), b_down = (p if p is None or isinstance(p, torch.Tensor) else p[:2]
                                                            for p in params)
    L.check_operands(x, b_gate, b_up, b_down)
    D, F = x.shape[1], wg.shape[0]
    for (w, s), n in (((wg, sg), F), ((wu, su), F)):
        check_weights(MLP_FP8.name, x, w, s, n)
    L.require(wd.dtype == wg.dtype and tuple(wd.shape) == (D, F) and tuple(sd.shape) == (D,),
              lambda: f"{MLP_FP8.name}: down weight {tuple(wd.shape)} and scale {tuple(sd.shape)} do not fit {(D, F)}")
    weights = {"wg": wg, "wu": wu, "wd": wd, "sg": sg.contiguous(), "su": su.contiguous(), "sd": sd.contiguous()}
    return launch_one(MLP_FP8, x, weights, (b_gate, b_up, b_down), activation, config, out)


def _params(ops: dict) -> tuple:
    return ((ops["wg"], ops["sg"]), ops.get("bg"), (ops["wu"], ops["su"]), ops.get("bu"), (ops["wd"], ops["sd"]),
            ops.get("bd"))


def _run(ops: dict, activation: str, config: KernelConfig, out: torch.Tensor | None = None) -> torch.Tensor:
    return mlp_decode_fp8(ops["x"], _params(ops), activation, config, out=out)


def _dequantized(ops: dict, dtype: torch.dtype) -> tuple:
    return tuple(dequantize_fp8(ops[w], ops[s], dtype) for w, s in _WEIGHTS)


def _eager(ops: dict, activation: str) -> torch.Tensor:
    """The weights dequantized to the activations' dtype, then the dense MLP's eager ops."""
    x = ops["x"]
    return eager_mlp(x, *_dequantized(ops, x.dtype), ops.get("bg"), ops.get("bu"), ops.get("bd"), activation)


def _biases(ops: dict) -> tuple:
    return () if ops.get("bg") is None else (ops["bg"], ops["bu"], ops["bd"])


def _reference(ops: dict, activation: str, dtype: torch.dtype) -> torch.Tensor:
    """float64, from the dequantized weights, H rounded to the dtype as the kernel stores it between products."""
    return mlp_reference_rounded(ops["x"], (*_dequantized(ops, torch.float64), *_biases(ops)), activation, dtype)


def _original_reference(ops: dict, activation: str) -> torch.Tensor:
    """float64, from the weights before quantization (make_operands keeps them as "w*_original")."""
    weights = tuple(ops[f"{w}_original"] for w, _ in _WEIGHTS)
    return mlp_reference_rounded(ops["x"], (*weights, *_biases(ops)), activation, torch.float64)


def _make_operands(n: int, k: int, M: int, bias: bool, residual: bool, rand) -> dict:
    originals = {"wg": rand(n, k) * k**-0.5, "wu": rand(n, k) * k**-0.5, "wd": rand(k, n) * n**-0.5}
    ops = {"x": rand(M, k)}
    for w, s in _WEIGHTS:
        ops[w], ops[s] = quantize_weight(originals[w])
        ops[f"{w}_original"] = originals[w]
    if bias:
        ops.update(bg=rand(n), bu=rand(n), bd=rand(k))
    return ops


# The one-launch MLP's op with fp8 weights: the same template, activations, search spaces, heuristic and starts;
# its own operands, launcher, checks, library path and keys' dimensions (FusedMLPFp8 runs the sizes as they are).
MLP_FP8 = dataclasses.replace(
    MLP,
    name="mlp_fp8",
    doc="a whole gated MLP in one launch with Wg, Wu and Wd in fp8 (small M)",
    operands=OPERANDS,
    run=_run,
    weights="fp8",
    library={"eager": _eager},
    reference=_reference,
    original_reference=_original_reference,
    make_operands=_make_operands,
    dims=lambda s: (s.d_ff, s.d_model, s.activation),
    keyed_for=lambda s: True,
)
