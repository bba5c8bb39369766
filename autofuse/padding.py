"""Padded storage for a gated MLP whose d_ff is not a multiple of 8 (issue 16, item 3).

Why: Triton specialises a kernel on pointers and strides divisible by 16 bytes. Rows of d_ff
elements that are not (the down projection's weight [d_model, d_ff], H [M, d_ff]) make every load
element-wise, and a d_ff that no BLOCK_K divides masks every K step; at decode sizes, where reading
the weights is all a kernel does, that cost up to 27x (benchmarks/unaligned_probe.py, RESULTS.md).
cuBLAS slows down on such rows too.

The fix keeps ONE copy of the weights: each parameter becomes a view of storage padded with zeros
along d_ff to run_width(d_ff), a multiple of PAD_TO. The views have the parameters' own shapes, so
state_dict keys and shapes, optimizers and user code see the same tensors; inference then runs the
MLP at the padded width on as_strided views of that storage. That is exact: the padded gate and up
rows and biases are 0, so H's padded columns are act(0) * 0 = 0, and the down projection adds
0 * 0 for each of them. Training and torch.compile run on the parameters as they are.
"""

from __future__ import annotations

import torch
from torch import nn

# Elements: rows of PAD_TO elements are 16-byte aligned in every supported dtype, and PAD_TO is a
# multiple of every BLOCK_K the templates use, so the padded K needs no mask.
PAD_TO = 64


def run_width(d_ff: int) -> int:
    """The d_ff a gated MLP's inference kernels run at: d_ff itself where its rows are 16-byte aligned
    in 16-bit dtypes (a multiple of 8), else d_ff rounded up to PAD_TO (padded storage)."""
    return d_ff if d_ff % 8 == 0 else -(-d_ff // PAD_TO) * PAD_TO


def _relay(param: nn.Parameter, shape: tuple, view) -> None:
    # Made outside inference mode: an inference tensor could not stay a parameter's data.
    with torch.inference_mode(False), torch.no_grad():
        storage = param.new_zeros(shape)
        view(storage).copy_(param)
        param.data = view(storage)


class PaddedLayout:
    """The padded storage of one gated MLP's parameters, made by lay_out(); widen() gives the
    parameters at the padded width while they still are views of it."""

    def __init__(self, d_model: int, d_ff: int, params: tuple) -> None:
        self.d_model, self.d_ff, self.width = d_model, d_ff, run_width(d_ff)
        self.storages = self._storages(params)
        self._memo: tuple | None = None  # (weights' addresses, widened parameters)

    @staticmethod
    def _storages(params: tuple) -> tuple:
        return tuple(None if p is None else p.untyped_storage().data_ptr() for p in params)

    def widen(self, params: tuple, weights: list) -> tuple | None:
        """(wg, bg, wu, bu, wd, bd) at the padded width, or None where a parameter is no longer a view of
        this storage (replaced through `.data =`, load_state_dict(assign=True), ...). `weights`: the
        parameters' addresses (launch.addresses), the memo's key."""
        memo = self._memo
        if memo is not None and memo[0] == weights:
            return memo[1]
        widened = self._widened(params)
        # The widened views keep their storage alive, so the addresses cannot be reused while memoised.
        self._memo = None if widened is None else (weights, widened)
        return widened

    def _widened(self, params: tuple) -> tuple | None:
        wg, bg, wu, bu, wd, bd = params
        d, F, W = self.d_model, self.d_ff, self.width
        if self._storages(params) != self.storages or bd is not None and bd.shape != (d,):
            return None
        expected = ((wg, (F, d), (d, 1)), (wu, (F, d), (d, 1)), (wd, (d, F), (W, 1)), (bg, (F,), (1,)),
                    (bu, (F,), (1,)))
        for p, shape, stride in expected:
            if p is None:
                continue
            if p.shape != shape or p.stride() != stride or p.storage_offset() != 0:
                return None
        size = (W, d)
        return (wg.as_strided(size, (d, 1)), None if bg is None else bg.as_strided((W,), (1,)),
                wu.as_strided(size, (d, 1)), None if bu is None else bu.as_strided((W,), (1,)),
                wd.as_strided((d, W), (W, 1)), bd)


def lay_out(gate: nn.Linear, up: nn.Linear, down: nn.Linear) -> PaddedLayout | None:
    """Re-lays the parameters of a gated MLP whose d_ff needs it into zero-padded storage (see the module
    docstring); None where it does not (d_ff a multiple of 8, parameters on the meta device)."""
    d_ff, d_model = gate.weight.shape
    width = run_width(d_ff)
    if width == d_ff or gate.weight.device.type == "meta":
        return None
    for linear in (gate, up):
        _relay(linear.weight, (width, d_model), lambda s: s[:d_ff])
        if linear.bias is not None:
            _relay(linear.bias, (width,), lambda s: s[:d_ff])
    _relay(down.weight, (d_model, width), lambda s: s[:, :d_ff])
    params = (gate.weight, gate.bias, up.weight, up.bias, down.weight, down.bias)
    return PaddedLayout(d_model, d_ff, params)


def contiguous_state(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    """A state_dict hook of a module holding a padded layout: its entries are saved as plain tensors (the
    down projection's weight is a view with gaps, which safetensors refuses and torch.save would write
    with its padding)."""
    for key, value in state_dict.items():
        if key.startswith(prefix) and isinstance(value, torch.Tensor) and not value.is_contiguous():
            state_dict[key] = value.contiguous()
