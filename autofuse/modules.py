"""nn.Modules users get from get_linear / get_mlp.

Parameters are named and shaped like nn.Linear's (`weight` [out, in], `bias` [out]) and like a
Hugging Face gated MLP's (`gate_proj`, `up_proj`, `down_proj`), so existing state_dicts load
unchanged. Configs are resolved once per M bucket and kept on the module.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from . import custom_ops, ops, traffic  # noqa: F401 - custom_ops registers torch.ops.autofuse.*
from .activations import GATED_ACTIVATIONS, LINEAR_ACTIVATIONS, canonical_activation
from .choose import LinearPlan, MLPPlan, current, generation, pending, resolve_checked
from .device import capturing, check_device
from .dispatch import BoundLinear, BoundMLP
from .errors import AutofuseError, shown
from .fused_module import FusedModule, allocated, as_rows, as_shape, check_dtype, check_size, needs_grad, parse_device
from .launch import addresses
from .layout import (
    LinearLayout,
    MLPLayout,
    TrainingLayout,
    contiguous_state,
    lay_out,
    lay_out_linear,
    lay_out_linear_training,
    lay_out_training,
    linear_sizes,
    padded_rows,
    row_width,
    stack_padded,
    stacked_padded,
)
from .ops.gated_up import stacked
from .ops.linear_fp8 import Fp8Weight, check_fp8_device, quantize_fp8, quantize_weight
from .opspec import FP8_WEIGHTS, WEIGHT_FORMATS
from .training import (
    LinearFunction,
    StepRun,
    TrainingLaunches,
    TrainingStep,
    linear_padded,
    linear_run,
    mlp_training,
    step_run,
)

# Dynamo guards each object a compiled forward reaches through a global, link by link, on every compiled
# call: `torch.compiler.is_compiling` is three guarded objects, `torch.ops.autofuse.mlp` five. Bound here, each
# is one.
_compiling = torch.compiler.is_compiling
_LINEAR_OP = torch.ops.autofuse.linear.default
_MLP_OP = torch.ops.autofuse.mlp.default


class FusedLinear(FusedModule):
    """y = act(x @ weight.T + bias) [+ residual] in one kernel. An in_features or out_features that is not a multiple
    of 8 (rows not 16-byte aligned) keeps the parameters as views of zero-padded storage and runs inference at the
    padded sizes (layout.LinearLayout, layout.linear_width); a training forward runs at those sizes too where its
    GEMM is not host-bound (training.linear_padded, LinearRun): on the weight's own padded storage where only
    out_features is unaligned (layout.TrainingLayout), else on padded copies."""

    _pads = True  # lays its parameters out in padded storage where a size needs it (not FusedLinearFp8)

    def __init__(self, in_features: int, out_features: int, *, bias: bool, activation: str,
                 dtype: torch.dtype, device: torch.device, tuned: bool = True) -> None:
        super().__init__(tuned)
        self.in_features = in_features
        self.out_features = out_features
        self.activation = activation
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device)) if bias else None
        self.reset_parameters()
        self._layout: LinearLayout | None = None
        # Training at an unaligned out_features alone: the weight as the first rows of the padded storage the step's
        # GEMM reads (layout.TrainingLayout), made by _lay_out_plain.
        self._training_layout: TrainingLayout | None = None
        self._training_weights: dict[str, tuple] = {}  # a padded training forward's copies (training.linear_run)
        self._training_configs: dict[tuple, object] = {}  # its configs at the padded sizes, by (M, residual, ...)
        self._lay_out()
        if self._pads:
            self._register_state_dict_hook(contiguous_state)
        self._start_compile_workers()

    def _apply(self, fn, recurse=True):
        # `.to()`, `.half()`: the padded training copies and configs name the old dtype or device.
        self._training_weights.clear()
        self._training_configs.clear()
        return super()._apply(fn, recurse)

    def _linear_params(self) -> tuple:
        parameters = self._parameters
        return parameters["weight"], parameters.get("bias")

    def _lay_out(self) -> None:
        """Keeps the parameters in padded storage (layout.lay_out_linear) where a size needs it: made here, and again
        after `.to()` / `.half()` (nn.Module._apply) and after a training forward made them plain."""
        if not self._pads:
            return
        params = self._linear_params()
        if self._layout is not None and self._layout.widen(params, addresses(params)) is not None:
            return
        self._training_layout = None
        self._layout = lay_out_linear(*params)

    def _sizes_run(self, M: int) -> tuple[int, int]:
        """(in_features, out_features) inference runs at for M rows: the padded sizes while the parameters are views
        of padded storage (in_features itself up to layout.UNPADDED_K_MAX_M rows: layout.linear_sizes)."""
        layout = self._layout
        if layout is not None and layout.active:
            n, k = linear_sizes(layout.n, layout.k, M)
            return k, n
        return self.in_features, self.out_features

    def _table_key(self, M: int, weight: torch.Tensor) -> tuple:
        return (*super()._table_key(M, weight), *self._sizes_run(M))

    def _lay_out_plain(self) -> None:
        """Before a training forward: the parameters as plain dense tensors again, as optimizers expect them (see
        FusedMLP._lay_out_plain); the padded layout is made again at the next inference forward. Where only
        out_features is unaligned, the first rows of the padded storage its padded step reads instead
        (layout.lay_out_linear_training)."""
        self._training_layout = lay_out_linear_training(*self._linear_params())
        if self._training_layout is not None:
            self._layout = None
            self._plain_for_training = True
            return
        with torch.no_grad(), torch.inference_mode(False):
            for p in self._linear_params():
                if p is not None and p.untyped_storage().nbytes() != p.numel() * p.element_size():
                    p.data = p.data.clone(memory_format=torch.contiguous_format)  # a view with gaps: a dense copy
        self._layout = None
        self._plain_for_training = True

    def reset_parameters(self) -> None:
        # nn.Linear's initialisation, so a fresh module behaves like the layer it replaces.
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features)
            nn.init.uniform_(self.bias, -bound, bound)

    def _reference_weight(self) -> torch.Tensor:
        return self.weight

    def _plan(self, residual, M):
        return LinearPlan(*self._sizes_run(M), self.activation, self.bias is not None, residual)

    def _bind(self, table, M):
        return BoundLinear(table, self.activation, M)

    def _libraries(self, residual):
        return {"linear": tuple(ops.get("linear").library_for(self.activation, self.bias is not None, residual))}

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        parameters = self._parameters  # not self.weight: an nn.Module attribute lookup costs host time
        weight, bias, activation = parameters["weight"], parameters.get("bias"), self.activation
        M = self._rows_of(x, "in_features", weight)
        shape = x.shape
        out_shape = (shape[0], self.out_features) if len(shape) == 2 else (*shape[:-1], self.out_features)
        if residual is not None:
            self._check_residual(residual, x, out_shape)
        if _compiling():  # one opaque op for torch.compile / torch.export (custom_ops.py)
            r2d = None if residual is None else residual.reshape(-1, self.out_features)
            return _LINEAR_OP(x.reshape(-1, self.in_features), weight, bias, r2d, activation,
                              self.tuned).reshape(out_shape)
        if needs_grad(x, weight, bias, residual):
            if self._layout is not None and not capturing(weight.device):
                self._lay_out_plain()
                weight, bias = self._linear_params()
            r2d = None if residual is None else as_rows(residual, self.out_features)
            padded = linear_padded(M, self.out_features, self.in_features) if self._pads else None
            if padded is None:
                config, run = self._config_table(M, r2d is not None)["linear"].kernel, None
            else:  # unaligned rows, a GEMM that is not host-bound: the padded space (training.LinearRun)
                config = self._padded_training_config(M, padded, r2d is not None, weight)
                run = linear_run(weight, bias, padded, self._training_weights, self._training_layout)
            recorder = traffic.recorder
            x2d = as_rows(x, self.in_features)
            if recorder is not None and recorder.due(self, M, True):
                return recorder.timed(self, M, True, x.device, lambda: as_shape(LinearFunction.apply(
                    x2d, weight, bias, r2d, activation, config, run), out_shape))
            return as_shape(LinearFunction.apply(x2d, weight, bias, r2d, activation, config, run), out_shape)
        if self._laid_out_again(weight.device):
            weight, bias = self._linear_params()
        weights = [weight.data_ptr()] if bias is None else [weight.data_ptr(), bias.data_ptr()]  # launch.addresses
        layout = self._layout
        if layout is not None:
            wide = layout.widen((weight, bias), weights)
            if wide is not None:  # x's (and a residual's) rows padded with zeros to the weight's (layout.py)
                x, weight = layout.operands(x, wide[0], M)
                bias = wide[1]
                if residual is not None and layout.n_run != layout.n:
                    residual = layout.pad_rows(residual.reshape(M, layout.n), layout.n_run)
        entry = self._entry(M, weights, weight, residual is not None)
        recorder = traffic.recorder  # counts un-graphed calls while traffic is recorded (traffic.py)
        if recorder is not None and recorder.due(self, M, False):
            return recorder.timed(self, M, False, x.device,
                                  lambda: entry(x, weight, bias, residual, weights, M, out_shape))
        return entry(x, weight, bias, residual, weights, M, out_shape)

    def _padded_training_config(self, M: int, padded: tuple[int, int], residual: bool, weight: torch.Tensor):
        """The linear kernel's config (None: cuBLAS) for a padded training forward: checked and looked up at the
        padded sizes it runs (a choice at the unpadded ones times other GEMMs: FusedMLP._training_step says how that
        went), kept per (M, residual, dtype, device) while what was read of tuned configs stays."""
        key = (M, residual, weight.dtype, weight.device, generation())
        config = self._training_configs.get(key, self)
        if config is not self:
            return config
        check_dtype(weight.dtype)
        check_device(weight.device)
        N, K = padded
        plan = LinearPlan(K, N, self.activation, self.bias is not None, residual)
        choice = resolve_checked(plan.problem(max(M, 1), weight.dtype, weight.device), self.tuned)
        kernel = current().unraced(choice).kernel  # a training step is never raced
        if not pending({"linear": choice}):
            self._seen_generation()
            self._training_configs[(M, residual, weight.dtype, weight.device, generation())] = kernel
        return kernel

    def _check_residual(self, residual: object, x: torch.Tensor, out_shape: tuple) -> None:
        if not isinstance(residual, torch.Tensor) or tuple(residual.shape) != out_shape:
            got = tuple(residual.shape) if isinstance(residual, torch.Tensor) else type(residual).__name__
            raise AutofuseError(f"residual must have the output's shape {out_shape}, got {got}")
        if residual.dtype != x.dtype or residual.device != x.device:
            raise AutofuseError(
                f"residual must match the input's dtype and device ({x.dtype}, {x.device}), "
                f"got ({residual.dtype}, {residual.device})"
            )

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, activation={self.activation}")


class FusedLinearFp8(FusedLinear):
    """y = act(x @ (W8 s)^T + bias) [+ residual] in one kernel, with W8 the weights in float8_e4m3fn and s a float32
    scale per output channel (op linear_fp8; with weights="w8a8", op linear_w8a8, which quantizes x per row too):
    half the weight bytes of bf16. Inference only: its parameters do
    not train, and a forward that would build a graph raises. State: `weight_fp8`, `weight_scale`, `bias`, and
    `weight` (the original, not used by the forward) where built with keep_original=True; a state_dict holding a
    dense `weight` (an nn.Linear's, say) and no `weight_fp8` is quantized as it loads."""

    _pads = False  # fp8 weights are held in padded storage of their own (layout.padded_rows)

    def __init__(self, in_features: int, out_features: int, *, bias: bool, activation: str,
                 dtype: torch.dtype, device: torch.device, **options: bool) -> None:
        """options: tuned (True), keep_original (False), weights ("fp8" or "w8a8"): get_linear says what each does."""
        super().__init__(in_features, out_features, bias=bias, activation=activation, dtype=dtype, device=device,
                         tuned=bool(options.get("tuned", True)))
        self.keep_original = bool(options.get("keep_original", False))
        # "fp8": weight-only (op linear_fp8); "w8a8": the activations quantized too (op linear_w8a8).
        self.weights = options.get("weights", "fp8")
        if self.weights not in FP8_WEIGHTS:
            raise AutofuseError(f"FusedLinearFp8 takes weights {' or '.join(map(repr, FP8_WEIGHTS))}, "
                                f"got {shown(self.weights)}")
        self._op = f"linear_{self.weights}"  # linear_fp8 or linear_w8a8, as the MLP's gated_up_<weights>
        w8, scale = quantize_weight(self.weight)  # rows whole 128-byte lines apart, 16 x 16 blocks (layout.padded_rows)
        self.register_buffer("weight_fp8", w8)
        self.register_buffer("weight_scale", scale)
        # The activations' dtype and device: what the tables are keyed by and inputs are checked against.
        self.register_buffer("_activations", torch.empty(0, dtype=dtype, device=device), persistent=False)
        if not self.keep_original:
            del self.weight
        else:
            self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)
        self._register_load_state_dict_pre_hook(_quantize_dense_state, with_module=True)
        self._register_state_dict_hook(contiguous_state)  # weight_fp8 saved without its rows' padding

    def requantize(self) -> None:
        """weight_fp8 and weight_scale from `weight` again (kept with keep_original=True), after it was changed."""
        if not self.keep_original:
            raise AutofuseError("requantize() needs the original weights: build the module with keep_original=True")
        with torch.no_grad():
            w8, scale = quantize_fp8(self.weight)
            self.weight_fp8.copy_(w8)
            self.weight_scale.copy_(scale)

    def _reference_weight(self) -> torch.Tensor:
        return self._buffers["_activations"]

    def _apply(self, fn, recurse=True):
        # Devices move; dtypes do not: .half() or .to(dtype) changes the activations' dtype (and bias, and the kept
        # original), never the fp8 weights or their float32 scales.
        w8, scale = self._buffers["weight_fp8"], self._buffers["weight_scale"]
        module = super()._apply(fn, recurse)
        device = self._buffers["_activations"].device
        # A copy to another device comes back contiguous: its rows are padded again.
        self._buffers["weight_fp8"], self._buffers["weight_scale"] = padded_rows(w8.to(device)), scale.to(device)
        return module

    def _plan(self, residual, M):
        return LinearPlan(self.in_features, self.out_features, self.activation, self.bias is not None, residual,
                          op=self._op)

    def _bind(self, table, M):
        return BoundLinear(table, self.activation, M, op=self._op)

    def _libraries(self, residual):
        # Every library path of the op runs at any size: torch._scaled_mm reads the weights' padded storage.
        return {"linear": tuple(ops.get(self._op).library_for(self.activation, self.bias is not None, residual))}

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        buffers = self._buffers
        w8, scale, like = buffers["weight_fp8"], buffers["weight_scale"], buffers["_activations"]
        bias = self._parameters.get("bias")
        M = self._rows_of(x, "in_features", like)
        shape = x.shape
        out_shape = (shape[0], self.out_features) if len(shape) == 2 else (*shape[:-1], self.out_features)
        if residual is not None:
            self._check_residual(residual, x, out_shape)
        if needs_grad(x, bias, residual):
            raise AutofuseError("a Linear with fp8 weights runs inference only: call it under torch.no_grad() or "
                                "torch.inference_mode(), or build it with weights='dense' to train it")
        r2d = None if residual is None else residual.reshape(-1, self.out_features)
        if _compiling():  # traced by torch.compile as the op's eager ops on the dequantized values
            operands = {"x": x.reshape(-1, self.in_features), "w": w8, "s": scale, "b": bias, "r": r2d}
            return ops.get(self._op).library["eager"](operands, self.activation).reshape(out_shape)
        weights = [w8.data_ptr(), scale.data_ptr()] if bias is None else [w8.data_ptr(), scale.data_ptr(),
                                                                          bias.data_ptr()]
        entry = self._entry(M, weights, like, residual is not None)
        weight = Fp8Weight(w8, scale, self._op)
        recorder = traffic.recorder  # counts un-graphed calls while traffic is recorded (traffic.py)
        if recorder is not None and recorder.due(self, M, False):
            return recorder.timed(self, M, False, x.device,
                                  lambda: entry(x, weight, bias, residual, weights, M, out_shape))
        return entry(x, weight, bias, residual, weights, M, out_shape)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", weights={self.weights}" + (", keep_original=True" if self.keep_original
                                                                      else "")


def _quantize_dense_state(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                          error_msgs) -> None:
    """load_state_dict of a dense Linear's state (`weight`, no `weight_fp8`) into a FusedLinearFp8: quantized as
    it loads; the dense `weight` is kept only where the module keeps its original."""
    dense = state_dict.get(prefix + "weight")
    if dense is None or prefix + "weight_fp8" in state_dict:
        return
    if not isinstance(dense, torch.Tensor) or tuple(dense.shape) != (module.out_features, module.in_features):
        return  # load_state_dict reports the mismatch
    w8, scale = quantize_fp8(dense)
    state_dict[prefix + "weight_fp8"], state_dict[prefix + "weight_scale"] = w8, scale
    if not module.keep_original:
        del state_dict[prefix + "weight"]


class FusedMLP(FusedModule):
    """down_proj(act(gate_proj(x)) * up_proj(x)): the gated up-projection in one kernel, then the
    down projection through the linear kernel; at small M, where tuning found it faster, the whole
    MLP in one launch (config_for then names the single op "mlp")."""

    def __init__(self, d_model: int, d_ff: int, *, bias: bool, activation: str, dtype: torch.dtype,
                 device: torch.device, **options: bool) -> None:
        """options: tuned, interleaved, save_hidden (MLP_OPTIONS: get_mlp says what each does)."""
        options = mlp_options(options, "FusedMLP")
        if options["weights"] != "dense":
            raise AutofuseError("FusedMLP keeps dense weights: get_mlp(..., weights='fp8') builds a FusedMLPFp8")
        tuned, interleaved, save_hidden = options["tuned"], options["interleaved"], options["save_hidden"]
        super().__init__(tuned)
        self.in_features = d_model
        self.d_model = d_model
        self.d_ff = d_ff
        self.interleaved = interleaved
        # Training: keep H from the forward for the backward (faster; one more [M, d_ff] activation held
        # per module until its backward), or recompute it there (training.py). A plain attribute: may be
        # changed between steps.
        self.save_hidden = save_hidden
        self.activation = activation
        # Plain nn.Linear modules hold the parameters under Hugging Face's names; their forward
        # is never called.
        factory = dict(bias=bias, dtype=dtype, device=device)
        self._training_table: dict[tuple, TrainingStep] = {}  # table key -> what its training forward runs
        self._last_step: tuple | None = None  # (M, save_hidden, dtype, layout, generation, device, step)
        self._training_weights: dict[str, tuple] = {}  # padded weight copies, one set for every M (TrainingLaunches)
        self.gate_proj = nn.Linear(d_model, d_ff, **factory)
        self.up_proj = nn.Linear(d_model, d_ff, **factory)
        self.down_proj = nn.Linear(d_ff, d_model, **factory)
        # A d_ff whose rows are not 16-byte aligned, or interleaved gate and up weights: the parameters
        # are views of storage laid out for the kernels (layout.py).
        self._layout: MLPLayout | None = None
        # Training at an unaligned d_ff (and aligned d_model): the gate and up weights as the first rows of the padded
        # storage the step's GEMMs read (layout.TrainingLayout), made by _lay_out_plain.
        self._training_layout: TrainingLayout | None = None
        self._lay_out()
        self._register_state_dict_hook(contiguous_state)
        self._start_compile_workers()

    def _apply(self, fn, recurse=True):
        # `.to()`, `.half()`: the training entries' keys name the old dtype or device, and their launches hold views
        # of the old parameters (the stacked [Wg; Wu]) and padded copies of them, which would stay alive.
        self._training_table.clear()
        self._training_weights.clear()
        self._last_step = None
        return super()._apply(fn, recurse)

    def _lay_out(self) -> None:
        """Keeps the parameters in the storage layout.lay_out makes (padded where d_ff needs it,
        interleaved where asked): made here, and again after `.to()` / `.half()` (nn.Module._apply),
        which copy them into plain tensors."""
        try:
            params = self._params()
        except AutofuseError:
            return  # the forward says what is wrong
        if self._layout is not None and self._layout.widen(params, addresses(params)) is not None:
            return
        self._training_layout = None
        self._layout = lay_out(self.gate_proj, self.up_proj, self.down_proj, self.interleaved)

    @property
    def d_ff_run(self) -> int:
        """The d_ff inference runs at: the padded width while the parameters are views of padded storage."""
        layout = self._layout
        return layout.width if layout is not None and layout.active else self.d_ff

    @property
    def d_in_run(self) -> int:
        """The d_model the up-projection reads and the down projection writes at: the padded width while the
        weights are views of storage padded along d_model (x's rows are then padded to it per call, and the
        output is the first d_model columns of the down projection's)."""
        layout = self._layout
        return layout.d_in if layout is not None and layout.active else self.d_model

    @property
    def runs_pairs(self) -> bool:
        """Whether inference may run op gated_pairs: the parameters are views of one interleaved buffer."""
        layout = self._layout
        return layout is not None and layout.active and layout.interleaved

    def _reference_weight(self) -> torch.Tensor:
        return self.gate_proj.weight

    def _table_key(self, M: int, weight: torch.Tensor) -> tuple:
        return (*super()._table_key(M, weight), self.d_ff_run, self.d_in_run, self.runs_pairs)

    def _plan(self, residual, M):
        return MLPPlan(self.d_model, self.d_ff_run, self.activation, self.gate_proj.bias is not None,
                       pairs=self.runs_pairs, d_in=self.d_in_run)

    def _bind(self, table, M):
        return BoundMLP(table, self.activation, M)

    def _libraries(self, residual):
        # The one-launch "mlp" op has no library path of its own to stand in for it: the pair's are raced.
        bias = self.gate_proj.bias is not None
        gated = {op: tuple(ops.get(op).library_for(self.activation, bias, False)) for op in ("gated_up", "gated_pairs")}
        return {**gated, "down": tuple(ops.get("down").library_for("none", bias, False))}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        params = self._params()
        wg = params[0]
        M = self._rows_of(x, "d_model", wg)
        out_shape = (*x.shape[:-1], self.d_model)
        activation = self.activation
        if _compiling():  # one opaque op for torch.compile / torch.export (custom_ops.py)
            self._check_parameters()
            return _MLP_OP(x.reshape(-1, self.d_model), list(params), activation, self.tuned).reshape(out_shape)
        if needs_grad(x, *params):
            self._check_parameters(params)
            if self._layout is not None and not capturing(wg.device):
                params = self._lay_out_plain()
                wg = params[0]
            run = self._training_run(M, wg, bool(self.save_hidden))
            x2d = as_rows(x, self.d_model)
            training_layout = self._training_layout
            recorder = traffic.recorder
            if recorder is not None and recorder.due(self, M, True):
                return recorder.timed(self, M, True, x.device,
                                      lambda: as_shape(mlp_training(x2d, params, run, training_layout), out_shape))
            return as_shape(mlp_training(x2d, params, run, training_layout), out_shape)
        if self._laid_out_again(wg.device):
            params = self._params()
            wg = params[0]
            self._training_weights.clear()  # training's padded copies: made again at the next training forward
        weights = addresses(params)
        layout = self._layout
        if layout is not None:
            wide = layout.widen(params, weights)
            if wide is not None:
                params = wide
                if layout.d_in != self.d_model:  # rows of x padded with zeros to the weights' (layout.py)
                    x = layout.pad_rows(x.reshape(M, self.d_model), layout.d_in)
        entry = self._entry(M, weights, wg)
        recorder = traffic.recorder  # counts un-graphed calls while traffic is recorded (traffic.py)
        if recorder is not None and recorder.due(self, M, False):
            return recorder.timed(self, M, False, x.device, lambda: entry(x, params, weights, M, out_shape))
        return entry(x, params, weights, M, out_shape)

    def _lay_out_plain(self) -> tuple:
        """Before a training forward: the parameters as plain dense tensors again, as optimizers expect
        them (CUDA's fused AdamW requires a parameter's strides to match its gradient's and its state's,
        which are dense; a view with gaps has no dense twin). The gate and up weights (and biases) become
        the two halves of one [2 d_ff, ...] buffer, each half dense, so that the training step's up
        projection and input gradient run as one GEMM each (ops.gated_up.stacked). The same parameter
        objects keep their values; the inference layout is made again at the next inference forward. Where the
        step runs padded at an unaligned d_ff (training.Padding) and d_model is aligned, the gate and up weights
        become the first rows of the padded storage its GEMMs read instead (layout.lay_out_training), the down
        weight plain."""
        wg, bg, wu, bu, wd, bd = self._params()
        with torch.no_grad(), torch.inference_mode(False):
            for p in (wd, bd):
                if p is not None and not p.is_contiguous():
                    p.data = p.data.contiguous()
        self._training_layout = lay_out_training(self.gate_proj, self.up_proj, self.down_proj)
        if self._training_layout is None:
            with torch.no_grad(), torch.inference_mode(False):
                for gate, up in ((wg, wu), (bg, bu)):
                    if gate is not None and up is not None and gate is not up and stacked(gate, up) is None:
                        buffer = torch.cat([gate.data.reshape(1, *gate.shape), up.data.reshape(1, *up.shape)])
                        gate.data, up.data = buffer[0], buffer[1]
        self._layout = None
        self._plain_for_training = True
        return self._params()

    def _params(self) -> tuple:
        """(wg, bg, wu, bu, wd, bd), read from the submodules' parameter dicts: an nn.Module attribute
        lookup costs host time on every forward."""
        modules = self._modules
        try:
            gate, up, down = (modules["gate_proj"]._parameters, modules["up_proj"]._parameters,
                              modules["down_proj"]._parameters)
            return gate["weight"], gate.get("bias"), up["weight"], up.get("bias"), down["weight"], down.get("bias")
        except (KeyError, AttributeError, TypeError):
            raise AutofuseError("FusedMLP's gate_proj, up_proj and down_proj must stay nn.Linear-like modules "
                                "holding a `weight` parameter") from None

    def _check_parameters(self, params: tuple | None = None) -> None:
        wg, _, wu, _, wd, _ = self._params() if params is None else params
        for w in (wu, wd):
            if w.dtype != wg.dtype or w.device != wg.device:
                raise AutofuseError("gate_proj, up_proj and down_proj must share one dtype and device")

    def _training_step(self, M: int, weight: torch.Tensor, save_hidden: bool = False) -> TrainingStep:
        """What a forward that builds a graph runs (training.mlp_training): the down projection's config and the
        gated backward's (tuned with `autofuse tune --train`: a KernelConfig, or the Library path that tuning or a
        check chose; None where the forward saves H, whose backward is cuBLAS and one pass), and the entry's bound
        launches (training.TrainingLaunches, None while a choice waits for its check). Resolved once per table
        key, like the forward's, and kept whole: the step is the same object call after call."""
        self._drop_stale()
        key = (*self._table_key(M, weight), save_hidden)
        step = self._training_table.get(key)
        if step is not None:
            return step
        # The sizes the step runs at (training.Padding's): a check or a tuned record of the unpadded sizes times
        # other GEMMs (3587 -> 8063 at M = 8192: cuBLAS's align-1 kernels there made a Triton down projection win,
        # which then ran 865 us at the padded sizes where cuBLAS runs about 640; H100).
        plan = MLPPlan(row_width(self.d_model), row_width(self.d_ff), self.activation, self.gate_proj.bias is not None)
        down = resolve_checked(plan.problem("down", M, weight.dtype, weight.device), self.tuned)
        backward = None if save_hidden else resolve_checked(plan.problem("gated_bwd", M, weight.dtype,
                                                                         weight.device), self.tuned)
        # The down projection's kernel (None: its library path); the backward's kernel or library path. A training
        # step is never raced: a host-bound library choice runs its runner-up kernel where that is as fast.
        unraced = current().unraced
        configs = (self.activation, unraced(down).kernel, None if backward is None else unraced(backward).config)
        if pending({"down": down, **({} if backward is None else {"gated_bwd": backward})}):
            return TrainingStep(*configs, None, save_hidden)
        self._seen_generation()  # kept under the generation its checks moved to, as _config_table keeps
        key = (*self._table_key(M, weight), save_hidden)
        launches = TrainingLaunches(max(M, 1), self._training_weights)
        step = self._training_table[key] = TrainingStep(*configs, launches, save_hidden)
        return step

    def _training_run(self, M: int, weight: torch.Tensor, save_hidden: bool) -> StepRun:
        """The training forward's step at M (_training_step) with its form and padding (training.step_run). The
        last one comes back without a key built while M, save_hidden, the weight's dtype and device, the layout
        and what was read of tuned configs stay, and its step is no stand-in waiting for a check: a host-bound
        step pays for every call made here."""
        last = self._last_step
        if (last is not None and last[0] == M and last[1] == save_hidden and last[2] is weight.dtype
                and last[3] is self._layout and last[4] == generation() and last[5] == weight.device):
            return last[6]
        step = self._training_step(M, weight, save_hidden)
        run = step_run(M, weight, step)
        if step.launches is not None:
            self._last_step = (M, save_hidden, weight.dtype, self._layout, generation(), weight.device, run)
        return run

    def clear_config_table(self) -> None:
        super().clear_config_table()
        self._training_table.clear()
        self._last_step = None

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, d_ff={self.d_ff}, activation={self.activation}"
                + ("" if self.interleaved else ", interleaved=False"))


class FusedMLPFp8(FusedModule):
    """down_proj(act(gate_proj(x)) * up_proj(x)) with fp8 weights: each projection a FusedLinearFp8 holding its
    weights in float8_e4m3fn with a float32 scale per output channel (its state: `weight_fp8`, `weight_scale`,
    `bias`), run as the gated up-projection (op gated_up_fp8, or gated_up_w8a8 with weights="w8a8", which quantizes
    x too) and the down projection (down_fp8, or down_w8a8, which quantizes H), each checked, tuned and raced as any
    op. Inference only. A Hugging Face MLP's state_dict (gate_proj.weight, ...) quantizes as
    it loads. The interleaved gate/up layout does not apply; each projection's fp8 rows start whole 128-byte lines apart
    (layout.padded_rows), whatever d_model and d_ff are."""

    def __init__(self, d_model: int, d_ff: int, *, bias: bool, activation: str, dtype: torch.dtype,
                 device: torch.device, **options: bool) -> None:
        """options: tuned (True), keep_original (False), weights ("fp8" or "w8a8"): get_mlp says what each does."""
        tuned = bool(options.get("tuned", True))
        super().__init__(tuned)
        self.in_features = self.d_model = d_model
        self.d_ff = d_ff
        self.activation = activation
        self.keep_original = bool(options.get("keep_original", False))
        # "fp8": weight-only (ops gated_up_fp8, down_fp8); "w8a8": x and H quantized too (gated_up_w8a8, down_w8a8).
        self.weights = options.get("weights", "fp8")
        if self.weights not in FP8_WEIGHTS:
            raise AutofuseError(f"FusedMLPFp8 takes weights {' or '.join(map(repr, FP8_WEIGHTS))}, "
                                f"got {shown(self.weights)}")
        factory = dict(bias=bias, activation="none", dtype=dtype, device=device, tuned=tuned,
                       keep_original=self.keep_original, weights=self.weights)
        self.gate_proj = FusedLinearFp8(d_model, d_ff, **factory)
        self.up_proj = FusedLinearFp8(d_model, d_ff, **factory)
        self.down_proj = FusedLinearFp8(d_ff, d_model, **factory)
        # The activations' dtype and device: what the tables are keyed by and inputs are checked against.
        self.register_buffer("_activations", torch.empty(0, dtype=dtype, device=device), persistent=False)
        self._stack_gate_up()

    def _stack_gate_up(self) -> None:
        """The gate and up projections' fp8 weights as the halves of one padded storage (layout.stack_padded), where
        they are not so held yet: one torch._scaled_mm then multiplies both (gated_up_w8a8's library path
        scaled_mm_unit_stacked). load_state_dict and requantize() write into them in place."""
        gate, up = self.gate_proj._buffers, self.up_proj._buffers
        if stacked_padded(gate["weight_fp8"], up["weight_fp8"]) is None:
            gate["weight_fp8"], up["weight_fp8"] = stack_padded(gate["weight_fp8"], up["weight_fp8"])

    def _apply(self, fn, recurse=True):
        # A move to another device pads each projection's weights apart (FusedLinearFp8._apply): stacked again.
        module = super()._apply(fn, recurse)
        self._stack_gate_up()
        return module

    def _params(self) -> tuple:
        """(wg, bg, wu, bu, wd, bd), each weight an Fp8Weight, read from the projections' buffer and parameter
        dicts."""
        found = []
        up, down = f"gated_up_{self.weights}", f"down_{self.weights}"
        for name, op in (("gate_proj", up), ("up_proj", up), ("down_proj", down)):
            module = self._modules[name]
            buffers = module._buffers
            found += [Fp8Weight(buffers["weight_fp8"], buffers["weight_scale"], op), module._parameters.get("bias")]
        return tuple(found)

    def requantize(self) -> None:
        """Each projection's fp8 weights from its kept original again (keep_original=True)."""
        for module in (self.gate_proj, self.up_proj, self.down_proj):
            module.requantize()

    def _reference_weight(self) -> torch.Tensor:
        return self._buffers["_activations"]

    def _plan(self, residual, M):
        return MLPPlan(self.d_model, self.d_ff, self.activation, self.gate_proj.bias is not None, weights=self.weights)

    def _bind(self, table, M):
        return BoundMLP(table, self.activation, M)

    def _libraries(self, residual):
        bias = self.gate_proj.bias is not None
        # Every library path of the ops runs at any size: torch._scaled_mm reads the weights' padded storage.
        return {"gated_up": tuple(ops.get(f"gated_up_{self.weights}").library_for(self.activation, bias, False)),
                "down": tuple(ops.get(f"down_{self.weights}").library_for("none", bias, False))}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        params = self._params()
        like = self._buffers["_activations"]
        M = self._rows_of(x, "d_model", like)
        out_shape = (*x.shape[:-1], self.d_model)
        if needs_grad(x, params[1], params[3], params[5]):
            raise AutofuseError("an MLP with fp8 weights runs inference only: call it under torch.no_grad() or "
                                "torch.inference_mode(), or build it with weights='dense' to train it")
        if _compiling():  # traced by torch.compile as its ops' eager paths on the dequantized values
            wg, bg, wu, bu, wd, bd = params
            x2d = x.reshape(-1, self.d_model)
            h = ops.get(wg.op).library["eager"]({"x": x2d, "wg": wg.w8, "sg": wg.scale, "wu": wu.w8, "su": wu.scale,
                                                  "bg": bg, "bu": bu}, self.activation)
            y = ops.get(wd.op).library["eager"]({"x": h, "w": wd.w8, "s": wd.scale, "b": bd}, "none")
            return y.reshape(out_shape)
        weights = [t.data_ptr() for w in params[::2] for t in (w.w8, w.scale)] + [
            0 if b is None else b.data_ptr() for b in params[1::2]]
        entry = self._entry(M, weights, like)
        recorder = traffic.recorder  # counts un-graphed calls while traffic is recorded (traffic.py)
        if recorder is not None and recorder.due(self, M, False):
            return recorder.timed(self, M, False, x.device, lambda: entry(x, params, weights, M, out_shape))
        return entry(x, params, weights, M, out_shape)

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, d_ff={self.d_ff}, activation={self.activation}, weights={self.weights}"
                + (", keep_original=True" if self.keep_original else ""))


# get_linear's options, with their defaults.
LINEAR_OPTIONS = {"tuned": True, "weights": "dense", "keep_original": False}


def get_linear(in_features: int, out_features: int, *, bias: bool = True, activation: str = "none",
               dtype: torch.dtype = torch.bfloat16, device: object = "cuda", **options) -> FusedLinear:
    """A fused `act(x @ W.T + b) [+ residual]` module; call it as `module(x, residual=None)`.

    options (keywords):
    - tuned=True: False ignores tuned configs and uses the built-in heuristic.
    - weights="dense": "fp8" keeps W in float8_e4m3fn with a float32 scale per output channel (FusedLinearFp8:
      inference only, half the weight bytes of bf16); "w8a8" the same, and the kernel quantizes x per row to fp8
      too, for fp8 tensor cores (op linear_w8a8).
    - keep_original=False (fp8, w8a8): True keeps the dense weights beside them (as `weight`, in the state_dict
      too), for requantize() and for comparing with the original."""
    unknown = sorted(set(options) - set(LINEAR_OPTIONS))
    if unknown:
        raise AutofuseError(f"get_linear() got unknown option(s) {', '.join(map(shown, unknown))}; it takes "
                            f"{', '.join(LINEAR_OPTIONS)}")
    options = {**LINEAR_OPTIONS, **options}
    weights, tuned, keep_original = options["weights"], bool(options["tuned"]), bool(options["keep_original"])
    in_features, out_features = check_size("in_features", in_features), check_size("out_features", out_features)
    activation, dtype = canonical_activation(activation, LINEAR_ACTIVATIONS), check_dtype(dtype)
    device = parse_device(device)
    if weights not in WEIGHT_FORMATS:
        raise AutofuseError(f"weights must be one of {', '.join(map(repr, WEIGHT_FORMATS))}, got {shown(weights)}")
    if weights == "dense":
        if keep_original:
            raise AutofuseError("keep_original applies to fp8 weights only")
        return allocated(lambda: FusedLinear(in_features, out_features, bias=bool(bias), activation=activation,
                                             dtype=dtype, device=device, tuned=tuned),
                         "the Linear", (in_features + 1) * out_features, dtype, device)
    check_fp8_device(device)
    return allocated(lambda: FusedLinearFp8(in_features, out_features, bias=bool(bias), activation=activation,
                                            dtype=dtype, device=device, tuned=tuned, keep_original=keep_original,
                                            weights=weights),
                     "the Linear", (in_features + 1) * out_features, dtype, device)


# get_mlp's and FusedMLP's options, with their defaults.
MLP_OPTIONS = {"tuned": True, "interleaved": True, "save_hidden": True, "weights": "dense", "keep_original": False}


def mlp_options(options: dict, where: str) -> dict:
    """`options` over MLP_OPTIONS' defaults (each a bool but `weights`, a name of WEIGHT_FORMATS); AutofuseError
    naming an unknown one."""
    unknown = sorted(set(options) - set(MLP_OPTIONS))
    if unknown:
        raise AutofuseError(f"{where}() got unknown option(s) {', '.join(map(shown, unknown))}; it takes "
                            f"{', '.join(MLP_OPTIONS)}")
    made = {name: bool(options.get(name, default)) for name, default in MLP_OPTIONS.items() if name != "weights"}
    weights = options.get("weights", "dense")
    if weights not in WEIGHT_FORMATS:
        raise AutofuseError(f"weights must be one of {', '.join(map(repr, WEIGHT_FORMATS))}, got {shown(weights)}")
    if made["keep_original"] and weights == "dense":
        raise AutofuseError("keep_original applies to fp8 weights only")
    return {**made, "weights": weights}


def get_mlp(d_model: int, d_ff: int, *, activation: str = "gelu_tanh", bias: bool = False,
            dtype: torch.dtype = torch.bfloat16, device: object = "cuda", **options: bool) -> FusedMLP:
    """A fused gated MLP (GeGLU with gelu/gelu_tanh, SwiGLU with silu) with Hugging Face parameter names.

    options (keywords):
    - tuned=True: False ignores tuned configs and uses the built-in heuristic.
    - interleaved=True: keeps the gate and up weights interleaved in one buffer (each parameter a strided
      view of it), so that the gated up-projection may run as one GEMM (op gated_pairs) where that was
      checked or tuned faster; False keeps them as two plain tensors (and never runs gated_pairs).
    - save_hidden=True (training only): the forward keeps H = act(gate) * up for the backward, as
      torch.compile does (faster); False recomputes it in the backward and holds one [tokens, d_ff]
      activation less per module (the attribute of that name may be changed later).
    - weights="dense": "fp8" keeps the three weights in float8_e4m3fn with a float32 scale per output channel
      (FusedMLPFp8: inference only, half the weight bytes of bf16; interleaved and save_hidden do not apply);
      "w8a8" the same, and the kernels quantize x and H per row to fp8 too, for fp8 tensor cores.
    - keep_original=False (fp8 only): True keeps the dense weights beside them (each projection's `weight`)."""
    options = mlp_options(options, "get_mlp")
    d_model, d_ff = check_size("d_model", d_model), check_size("d_ff", d_ff)
    activation, dtype = canonical_activation(activation, GATED_ACTIVATIONS), check_dtype(dtype)
    device = parse_device(device)
    if options["weights"] in FP8_WEIGHTS:
        check_fp8_device(device)
        return allocated(lambda: FusedMLPFp8(d_model, d_ff, bias=bool(bias), activation=activation, dtype=dtype,
                                             device=device, tuned=options["tuned"],
                                             keep_original=options["keep_original"], weights=options["weights"]),
                         "the MLP", 3 * (d_model + 1) * d_ff, dtype, device)
    return allocated(lambda: FusedMLP(d_model, d_ff, bias=bool(bias), activation=activation, dtype=dtype,
                                      device=device, **options),
                     "the MLP", 3 * (d_model + 1) * d_ff, dtype, device)
