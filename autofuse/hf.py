"""`fuse(model)`: swap the gated MLP blocks of a Hugging Face model, and its RMSNorm modules, for autofuse
modules.

Recognised by structure, not by class name, so Gemma / Gemma2 / Gemma3, Llama, Mistral, Qwen and
other Llama-family MLPs (gate_proj, up_proj, down_proj, act_fn) and T5 v1.1 / Flan-T5's
DenseGatedActDense (wi_0, wi_1, wo, act, dropout) are all found. The replacement keeps the
original nn.Linear submodules under their original names, so parameters are shared, not copied,
and state_dict keys, `.to()`, `.half()` and weight tying behave as before. transformers itself is
never imported here: only the activation modules are recognised by their class names.

An RMSNorm module (one 1-D weight, an `eps` or `variance_epsilon`, no other state) is recognised by what it
computes: run once on random rows and weights, its output must equal one of autofuse's forms
(ops/rms_norm.py: Llama's, Gemma's) bit for bit; a module that computes anything else is left alone.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from torch import nn

from .activations import GATED_ACTIVATIONS
from .device import interpreting
from .errors import AutofuseError, shown
from .layout import contiguous_state
from .modules import FusedMLP, FusedMLPFp8
from .norm import FusedRMSNorm
from .ops.linear_fp8 import check_fp8_device
from .ops.rms_norm import FORMS, eager_rms_norm
from .opspec import WEIGHT_FORMATS

logger = logging.getLogger("autofuse")

# transformers.activations classes (and torch's) by name -> autofuse activation.
_ACTIVATION_CLASSES = {
    "GELUTanh": "gelu_tanh",  # gelu_pytorch_tanh (Gemma)
    "PytorchGELUTanh": "gelu_tanh",
    "NewGELUActivation": "gelu_tanh",  # gelu_new (T5 v1.1, Flan-T5)
    "GELUActivation": "gelu",
    "GELU": None,  # torch.nn.GELU: depends on its `approximate` field, see _activation_of
    "SiLUActivation": "silu",
    "SiLU": "silu",
}
# (gate, up, down, activation attribute) of the two layouts.
_LAYOUTS = (("gate_proj", "up_proj", "down_proj", "act_fn"), ("wi_0", "wi_1", "wo", "act"))
# Names that mark a module as an MLP block worth reporting when it is not replaced.
_MLP_HINTS = ("mlp", "denseactdense", "densereludense", "densegatedactdense", "feedforward", "ffn")


# What fuse() reports, and a forward warns once, where the model sits on a CPU without the interpreter.
CPU_NOTE = ("the model is on the CPU, where autofuse's kernels run only under Triton's interpreter (TRITON_INTERPRET=1 "
            "before anything imports Triton): until it moves to a GPU, the replaced modules run their original "
            "forwards")


@dataclasses.dataclass
class FuseReport:
    """What `fuse` did: the modules it replaced and those that looked like MLP blocks but were left alone."""

    replaced: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (module path, description)
    skipped: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (module path, reason)
    norms: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # RMSNorms replaced: (path, description)
    notes: list[str] = dataclasses.field(default_factory=list)  # what holds for every replaced block

    def __str__(self) -> str:
        lines = [f"autofuse.fuse: replaced {len(self.replaced)} MLP block(s) and {len(self.norms)} RMSNorm(s), "
                 f"skipped {len(self.skipped)}"]
        lines += [f"  replaced {path}: {what}" for path, what in self.replaced + self.norms]
        lines += [f"  skipped  {path}: {why}" for path, why in self.skipped]
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)


def _activation_of(module: nn.Module) -> str | None:
    name = type(module).__name__
    if name == "GELU":
        return "gelu_tanh" if getattr(module, "approximate", "none") == "tanh" else "gelu"
    return _ACTIVATION_CLASSES.get(name)


def _plain_linear(module: object) -> bool:
    # Exactly nn.Linear: quantized or LoRA-wrapped subclasses compute something else.
    return type(module) is nn.Linear


def _recognise(module: nn.Module) -> tuple[tuple[str, str, str], str] | str | None:
    """((gate, up, down names), activation) for a gated MLP autofuse can run; a reason string for one
    it cannot; None for a module that is not an MLP block at all."""
    for gate, up, down, act in _LAYOUTS:
        if not all(hasattr(module, n) for n in (gate, up, down)):
            continue
        linears = [getattr(module, n) for n in (gate, up, down)]
        if not all(_plain_linear(m) for m in linears):
            kinds = ", ".join(sorted({type(m).__name__ for m in linears}))
            return f"projections are {kinds}, not plain nn.Linear"
        activation = _activation_of(getattr(module, act, None))
        if activation not in GATED_ACTIVATIONS:
            return f"activation {type(getattr(module, act, None)).__name__} is not one autofuse fuses " \
                   f"({', '.join(GATED_ACTIVATIONS)})"
        g, u, d = linears
        if not (g.in_features == u.in_features == d.out_features and g.out_features == u.out_features
                == d.in_features):
            return "gate, up and down projection shapes do not form a gated MLP"
        if len({m.weight.dtype for m in linears}) > 1 or len({m.weight.device for m in linears}) > 1:
            return "its projections differ in dtype or device (e.g. T5's wo kept in float32)"
        if len({m.bias is None for m in linears}) > 1:
            return "some projections have a bias and others not"
        return (gate, up, down), activation
    return None


def _rms_norm_name(module: nn.Module) -> bool:
    name = type(module).__name__.lower()
    return "rmsnorm" in name or name == "t5layernorm"


def _recognise_norm(module: nn.Module) -> tuple[str, float] | str | None:
    """(weight form, eps) for an RMSNorm autofuse can run; a reason string for an RMSNorm it cannot; None
    for any other module (a module whose class name does not say RMSNorm but that computes one of the
    forms is taken too)."""
    if "norm" not in type(module).__name__.lower() or isinstance(module, FusedRMSNorm):
        return None
    weight = getattr(module, "weight", None)
    eps = getattr(module, "eps", getattr(module, "variance_epsilon", None))
    state = list(module.parameters()) + list(module.buffers()) + list(module.children())
    if not isinstance(weight, nn.Parameter) or weight.dim() != 1 or len(state) != 1 or type(eps) is not float:
        reason = "not one 1-D weight and a float eps"
    elif weight.dtype not in (torch.float32, torch.float16, torch.bfloat16) or weight.device.type == "meta":
        reason = f"its weight is {weight.dtype} on {weight.device}"
    else:
        form = _norm_form(module, weight, eps)
        if form is not None:
            return form, eps
        reason = f"it computes neither of autofuse's RMSNorm forms ({', '.join(FORMS)})"
    return reason if _rms_norm_name(module) else None  # a reason for modules that say they are RMSNorms only


def _norm_form(module: nn.Module, weight: torch.Tensor, eps: float) -> str | None:
    """The form whose eager arithmetic gives the module's output bit for bit on random rows and weights
    (random weights, so that no form matches by accident: Gemma's zeros and Llama's ones would)."""
    generator = torch.Generator().manual_seed(0)
    n = weight.shape[0]
    x = (4 * torch.randn(3, n, generator=generator)).to(weight.device, weight.dtype)
    w = torch.randn(n, generator=generator).to(weight.device, weight.dtype)
    try:
        with torch.no_grad():
            got = torch.func.functional_call(module, {"weight": w}, (x,))
    except (RuntimeError, TypeError, ValueError):
        return None
    for form in FORMS:
        if isinstance(got, torch.Tensor) and got.dtype == x.dtype and torch.equal(got, eager_rms_norm(x, w, eps, form)):
            return form
    return None


_cpu_warned = False


def _warn_cpu_once() -> None:
    global _cpu_warned
    if not _cpu_warned:
        _cpu_warned = True
        logger.warning("autofuse: %s", CPU_NOTE)


class FusedHFMLP(nn.Module):
    """Stands in for a Hugging Face gated MLP: the same nn.Linear submodules under the same names,
    forward through an autofuse FusedMLP that uses those very parameters. Where the fused kernels
    cannot give the original's result, it runs the original forward instead: inputs whose dtype or
    device differ from the weights', autocast, active dropout (T5 in training), and a CPU without
    TRITON_INTERPRET=1."""

    def __init__(self, original: nn.Module, names: tuple[str, str, str], activation: str,
                 interleaved: bool = True, save_hidden: bool = True) -> None:
        super().__init__()
        gate, up, down = (getattr(original, n) for n in names)
        self._names = names
        for name, linear in zip(names, (gate, up, down)):
            self.add_module(name, linear)  # shared with the original module, registered here for state_dict
        self.dropout = getattr(original, "dropout", None)
        fused = FusedMLP(gate.in_features, gate.out_features, bias=gate.bias is not None, activation=activation,
                         dtype=gate.weight.dtype, device=torch.device("meta"), interleaved=interleaved,
                         save_hidden=save_hidden)
        fused.gate_proj, fused.up_proj, fused.down_proj = gate, up, down  # the meta placeholders are dropped
        fused._lay_out()  # interleaved, and padded where d_ff needs it (layout.py)
        # Not registered as submodules: their parameters are already registered above, once.
        object.__setattr__(self, "_fused", fused)
        object.__setattr__(self, "_original", original)
        self.activation = activation
        self._register_state_dict_hook(contiguous_state)

    def _apply(self, fn, recurse=True):
        module = super()._apply(fn, recurse)
        self._fused._lay_out()  # `.to()` copied the parameters into plain tensors
        return module

    def _needs_original(self, x: torch.Tensor) -> bool:
        weight = self._fused.gate_proj.weight
        if x.dtype != weight.dtype or x.device != weight.device:
            return True
        if x.device.type == "cpu" and not interpreting():
            _warn_cpu_once()
            return True
        if torch.is_autocast_enabled(x.device.type):
            return True
        dropout = self.dropout
        return self.training and isinstance(dropout, nn.Dropout) and dropout.p > 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._needs_original(x):
            return self._original(x)
        return self._fused(x)

    def config_for(self, M: int) -> dict:
        """What the fused block runs for a batch of M rows (FusedMLP.config_for)."""
        return self._fused.config_for(M)

    def config_sources(self, M: int) -> dict[str, str]:
        """Where each of those choices came from (FusedMLP.config_sources)."""
        return self._fused.config_sources(M)

    def plain_config_for(self, M: int) -> dict | None:
        """What an un-graphed call of the fused block runs at M (FusedMLP.plain_config_for)."""
        return self._fused.plain_config_for(M)

    def extra_repr(self) -> str:
        g = self._fused.gate_proj
        return f"d_model={g.in_features}, d_ff={g.out_features}, activation={self.activation}, autofuse"


def fuse(model: nn.Module, *, verbose: bool = True, interleaved: bool = True, save_hidden: bool = True,
         norms: bool = True, weights: str = "dense") -> FuseReport:
    """Replace every gated MLP block of `model` that autofuse can run by a FusedHFMLP, and (with `norms`)
    every RMSNorm module by a FusedRMSNorm over the same weight (in place), and return the report (logged;
    also printed when `verbose`). `interleaved`: as for get_mlp (the gate and up weights re-laid in one
    buffer, the parameter objects kept, so tied or shared ones stay so); `save_hidden`: as for get_mlp
    (training keeps each block's H from forward to backward). `weights="fp8"`: each block becomes a FusedMLPFp8
    holding its weights quantized to fp8 (inference only; the dense weights are dropped, and the state_dict
    holds each projection's weight_fp8 and weight_scale instead of its weight).
    `autofuse.tune_model(model)` then tunes the replaced shapes on the model's GPU, as `autofuse tune
    --model` would."""
    if weights not in WEIGHT_FORMATS:
        raise AutofuseError(f"weights must be one of {', '.join(map(repr, WEIGHT_FORMATS))}, got {shown(weights)}")
    report = FuseReport()
    found = []
    for path, module in model.named_modules():
        if isinstance(module, FusedHFMLP):
            report.skipped.append((path or "<model>", "already fused"))
            continue
        if any(path.startswith(p + ".") for p, _, _ in found):
            continue  # inside a block being replaced
        match = _recognise(module)
        if isinstance(match, tuple):
            found.append((path, module, match))
        elif isinstance(match, str):
            report.skipped.append((path or "<model>", match))
        elif any(h in type(module).__name__.lower() for h in _MLP_HINTS) and not isinstance(module, nn.Linear):
            report.skipped.append((path or "<model>", f"{type(module).__name__} is not a gated MLP autofuse knows"))
    for path, module, (names, activation) in found:
        if not path:
            raise AutofuseError("fuse() replaces the MLP blocks inside a model; call it on the model, not on an "
                                "MLP itself (for a lone MLP use autofuse.get_mlp)")
        if weights != "dense":
            replacement = _fp8_block(module, names, activation, weights)
            g = replacement.gate_proj
        else:
            replacement = FusedHFMLP(module, names, activation, interleaved=interleaved, save_hidden=save_hidden)
            g = replacement._fused.gate_proj
        _replace_at(model, path, module, replacement)
        report.replaced.append((path, f"{type(module).__name__} {g.in_features}->{g.out_features} {activation}"
                                      f"{' bias' if g.bias is not None else ''}"
                                      f"{'' if weights == 'dense' else ' ' + weights}"))
    if norms:
        _fuse_norms(model, report)
    on_cpu = any(p.device.type == "cpu" for p in model.parameters())
    if (report.replaced or report.norms) and on_cpu and not interpreting():
        report.notes.append(CPU_NOTE)
    logger.info("%s", report)
    if verbose:
        print(report)  # asked for: the report on the terminal, whatever the logging setup
    return report


def _fp8_block(original: nn.Module, names: tuple[str, str, str], activation: str, weights: str) -> FusedMLPFp8:
    """A FusedMLPFp8 (`weights`: fp8 or w8a8) holding `original`'s projections quantized (their dense weights are
    not kept)."""
    gate, up, down = (getattr(original, n) for n in names)
    weight = gate.weight
    check_fp8_device(weight.device)
    fused = FusedMLPFp8(gate.in_features, gate.out_features, bias=gate.bias is not None, activation=activation,
                        dtype=weight.dtype, device=weight.device, weights=weights)
    with torch.no_grad():  # each projection's load quantizes its dense weight (FusedLinearFp8)
        for name, linear in zip(("gate_proj", "up_proj", "down_proj"), (gate, up, down)):
            getattr(fused, name).load_state_dict(linear.state_dict())
    return fused


def _replace_at(model: nn.Module, path: str, module: nn.Module, replacement: nn.Module) -> None:
    """Put `replacement` where `module` stands in `model`, in the model's mode (a new module starts in training
    mode)."""
    replacement.train(module.training)
    parent_path, _, child = path.rpartition(".")
    setattr(model.get_submodule(parent_path), child, replacement)


def _fuse_norms(model: nn.Module, report: FuseReport) -> None:
    for path, module in list(model.named_modules()):
        match = _recognise_norm(module) if path else None
        if isinstance(match, str):
            report.skipped.append((path, match))
        if not isinstance(match, tuple):
            continue
        form, eps = match
        _replace_at(model, path, module, FusedRMSNorm(module.weight, eps, form))
        report.norms.append((path, f"{type(module).__name__} {module.weight.shape[0]} {form}"))
