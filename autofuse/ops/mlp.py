"""The one-launch gated MLP for small M (decode), op `mlp` (templates/mlp_decode.py.jinja):
Y = (act(X Wg^T + bg) * (X Wu^T + bu)) Wd^T + bd, each program computing a BLOCK_F-wide slice of H
and multiplying it into the down projection at once, so H never reaches memory. Keyed with
n = d_ff, k = d_model; config block_m rows, block_n = BLOCK_F columns of H, block_k = BLOCK_D."""

from __future__ import annotations

import dataclasses

import torch

from .. import launch as L
from .. import workspaces
from ..activations import GATED_ACTIVATIONS
from ..configs import Device, KernelConfig, Rule, SearchSpace, Shape, clamp_to_problem, fit_shared_memory, from_rules
from ..layout import input_width, line_rows, run_width
from ..opspec import Operand, OpSpec
from ..reference import eager_mlp, mlp_reference_rounded

OPERANDS = (
    Operand("x", "[M, D]", "mk"),
    Operand("wg", "[F, D], gate projection weight", "nk"),
    Operand("wu", "[F, D], up projection weight", "nk"),
    Operand("wd", "[D, F], down projection weight", "nk"),
    Operand("bg", "[F]", when="has_bias"),
    Operand("bu", "[F]", when="has_bias"),
    Operand("bd", "[D]", when="has_bias"),
    Operand("y", "[M, D]", "mn"),
)

# Largest M the one-launch MLP is keyed and run for: its float32 atomics (d_ff / BLOCK_F x M x
# d_model) outgrow the weight traffic beyond it.
MAX_M = 64


def mlp_decode(x: torch.Tensor, params: tuple, activation: str, config: KernelConfig,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """Y = (act(x @ w_gate.T + b_gate) * (x @ w_up.T + b_up)) @ w_down.T + b_down in one launch, x: [M, D];
    params: (w_gate, b_gate, w_up, b_up, w_down, b_down) as a module holds them, w_gate/w_up: [F, D],
    w_down: [D, F], the biases None or all three given."""
    w_gate, b_gate, w_up, b_up, w_down, b_down = params
    L.check_operands(x, w_gate, w_up, w_down, b_gate, b_up, b_down)
    M, D = x.shape
    F = w_gate.shape[0]
    L.require(tuple(w_gate.shape) == tuple(w_up.shape) == (F, D) and tuple(w_down.shape) == (D, F),
              "mlp_decode: weights must be [F, D], [F, D] and [D, F]")
    L.require((b_gate is None) == (b_up is None) == (b_down is None), "mlp_decode: the three biases come together")
    L.require(not MLP.refuse_config(config), lambda: f"mlp_decode: {MLP.refuse_config(config)}")
    y = L.output(out, (M, D), x)
    if M == 0:
        return y
    kernel = L.kernel_for(MLP, activation, D, x.dtype, config, b_gate is not None)
    tensors = {"x": x, "wg": w_gate, "wu": w_up, "wd": w_down, "y": y}
    if b_gate is not None:
        tensors.update(bg=b_gate.contiguous(), bu=b_up.contiguous(), bd=b_down.contiguous())
    row_blocks = -(-M // config.block_m)
    options = dict(BLOCK_M=config.block_m, BLOCK_F=config.block_n, BLOCK_D=config.block_k,
                   num_warps=config.num_warps, num_stages=config.num_stages)
    L.launch(kernel, (-(-F // config.block_n), row_blocks), tensors, (M, D, F), options,
             workspaces.workspace(x.device, M * D, row_blocks))
    return y


# The one-launch MLP's heuristic: BLOCK_M grows with M, BLOCK_F (block_n) 64, BLOCK_D (block_k) 128; one
# pipeline stage under the interpreter, where stages only cost time.
MLP_RULES = tuple(Rule(max_m, "tile", block_m, 64, (128, 128), num_warps=4, num_stages=4, group_m=1)
                  for max_m, block_m in ((16, 16), (32, 32), (None, 64)))
INTERPRETER_MLP_RULES = tuple(dataclasses.replace(rule, num_stages=1) for rule in MLP_RULES)


def heuristic(shape: Shape, device: Device, kinds: frozenset[str]) -> KernelConfig:
    if device.interpret:
        return from_rules(INTERPRETER_MLP_RULES, shape, kinds)
    return fit_shared_memory(from_rules(MLP_RULES, shape, kinds), MLP.operand_tiles, shape.dtype,
                             device.shared_memory_limit)


# Where a tuning run's search starts after the heuristic's config at M <= 16: the two fastest configs of three
# exhaustive sweeps of a Llama-3.2-1B-shaped MLP (2048 -> 8192) at M = 1, two on an H100 and one on an H200, each
# within 1.008x of every sweep's best, where the heuristic's 16 x 64 x 128 on 4 warps, 4 stages ran 1.018-1.075x
# (benchmarks/search_quality.py); TPE alone left the tuned record at 0.924-0.967 of the sweep's best.
_STARTS_M16 = tuple(KernelConfig(16, 64, 256, group_m=1, num_warps=warps, num_stages=3) for warps in (4, 8))


def starts(shape: Shape, device: Device, kinds: frozenset[str]) -> tuple[KernelConfig, ...]:
    if device.interpret or shape.M > 16 or "tile" not in kinds:
        return ()
    fitted = (fit_shared_memory(clamp_to_problem(c, shape.M, shape.N, shape.K), MLP.operand_tiles, shape.dtype,
                                device.shared_memory_limit) for c in _STARTS_M16)
    return tuple(dict.fromkeys(fitted))


def _run(ops: dict, activation: str, config: KernelConfig, out: torch.Tensor | None = None) -> torch.Tensor:
    params = (ops["wg"], ops.get("bg"), ops["wu"], ops.get("bu"), ops["wd"], ops.get("bd"))
    return mlp_decode(ops["x"], params, activation, config, out=out)


def _weights(ops: dict) -> tuple:
    return ops["x"], ops["wg"], ops["wu"], ops["wd"], ops.get("bg"), ops.get("bu"), ops.get("bd")


def _eager(ops: dict, activation: str) -> torch.Tensor:
    return eager_mlp(*_weights(ops), activation)


def _reference(ops: dict, activation: str, dtype: torch.dtype) -> torch.Tensor:
    # H rounded to the dtype, as the kernel and eager PyTorch store it.
    x, *weights = _weights(ops)
    return mlp_reference_rounded(x, tuple(weights), activation, dtype)


def _make_operands(n: int, k: int, M: int, bias: bool, residual: bool, rand) -> dict:
    # The weights' rows whole lines apart, as FusedMLP holds them (layout.mlp_strides).
    ops = {"x": rand(M, k), "wg": line_rows(rand(n, k) * k**-0.5), "wu": line_rows(rand(n, k) * k**-0.5),
           "wd": line_rows(rand(k, n) * n**-0.5)}
    if bias:
        ops.update(bg=rand(n), bu=rand(n), bd=rand(k))
    return ops


MLP = OpSpec(
    name="mlp",
    template="mlp_decode",
    doc="a whole gated MLP in one launch (small M: H never reaches memory)",
    operands=OPERANDS,
    activations=GATED_ACTIVATIONS,
    run=_run,
    sizes=("M", "D", "F"),
    constexprs=("BLOCK_M", "BLOCK_F", "BLOCK_D"),
    always_workspace=True,
    operand_tiles=(1, 2),  # its first product dominates
    # No GROUP_M, split-K or TMA, and its atomics grow with M: small tiles only.
    space=SearchSpace(block_m=(16, 32, 64), block_n=(16, 32, 64, 128), block_k=(32, 64, 128, 256), group_m=(1,),
                      num_warps=(2, 4, 8), num_stages=(2, 3, 4, 5)),
    interpreter_space=SearchSpace(block_m=(16, 32), block_n=(16, 32, 64), block_k=(32, 64), group_m=(1,),
                                  num_warps=(4,), num_stages=(1, 2)),
    heuristic=heuristic,
    starts=starts,
    library={"eager": _eager},
    reference=_reference,
    make_operands=_make_operands,
    output_width=lambda n, k: k,
    serves="mlp",
    dims=lambda s, M: (run_width(s.d_ff), s.d_model, s.activation),  # what FusedMLP runs (layout.py)
    # It reads one unpadded d_model for both projections: a module that pads d_model never plans it.
    keyed_for=lambda s: input_width(s.d_model) == s.d_model,
    max_m=MAX_M,
)
