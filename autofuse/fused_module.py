"""What the fused modules share (modules.py): the checks of a user's arguments, and the per-M config table
with its bound entries (dispatch.BoundMLP / BoundLinear) and the last one kept for the next forward."""

from __future__ import annotations

import itertools

import torch
from torch import nn

from . import compile_workers, traffic
from .choose import Choice, LinearPlan, MLPPlan, generation, pending, select, table_key
from .choose import race as plain
from .choose.check import enabled as checks_enabled
from .configs import KernelConfig, Library
from .device import capturing, check_device, interpreting
from .errors import AutofuseError, shown
from .shapes import DTYPES, MAX_SIZE

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# torch.Tensor as _rows_of reads it: one object for a compiled forward's guards, not torch and its attribute.
_TENSOR = torch.Tensor


def check_dtype(dtype: object) -> torch.dtype:
    """A supported torch.dtype, also given by name ("bfloat16" or "torch.bfloat16")."""
    if isinstance(dtype, str):
        dtype = DTYPES.get(dtype.removeprefix("torch."), dtype)
    if dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES)
        raise AutofuseError(f"unsupported dtype {dtype!r}; autofuse supports torch.dtype {names} (or their names "
                            "as strings)")
    return dtype


def check_size(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_SIZE:
        raise AutofuseError(f"{name} must be a positive integer up to {MAX_SIZE}, got {shown(value)}")
    return value


def allocated(build, what: str, elements: int, dtype: torch.dtype, device: torch.device):
    """`build()`, a module whose parameters hold `elements` values; AutofuseError where the device has
    no memory for them (a size the user mistyped, say), not PyTorch's allocator traceback."""
    try:
        return build()
    except RuntimeError as e:  # torch.OutOfMemoryError is one; the CPU allocator raises a plain one
        if not isinstance(e, torch.OutOfMemoryError) and "alloc" not in str(e).lower():
            raise
        gib = elements * torch.empty((), dtype=dtype).element_size() / 2**30
        raise AutofuseError(f"cannot allocate {what}'s {gib:,.1f} GiB of parameters on {device}") from None


def parse_device(device: object) -> torch.device:
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise AutofuseError(f"invalid device {device!r}: {e}") from None
    check_device(device)
    return device


def needs_grad(*tensors: torch.Tensor | None) -> bool:
    if not torch.is_grad_enabled():
        return False
    for t in tensors:  # a loop, not any() over a generator: called on every forward
        if t is not None and t.requires_grad:
            return True
    return False


def as_rows(t: torch.Tensor, width: int) -> torch.Tensor:
    """t as [rows, width]: t itself where it is two-dimensional already. A reshape that changes nothing still
    makes a view, and under autograd a ViewBackward node, whose engine visit costs host time every step."""
    return t if t.dim() == 2 else t.reshape(-1, width)


def as_shape(t: torch.Tensor, shape: tuple) -> torch.Tensor:
    """t ([rows, width]) in the caller's shape: t itself where that is two-dimensional (see as_rows)."""
    return t if len(shape) == 2 else t.reshape(shape)


class FusedModule(nn.Module):
    """Input checks and the per-M-bucket config table shared by the fused modules."""

    in_features: int

    def __init__(self, tuned: bool = True) -> None:
        super().__init__()
        self.tuned = tuned  # False: ignore tuned caches, always use the built-in heuristic
        self._configs: dict[tuple, dict[str, Choice]] = {}
        self._compared: dict[tuple, list] = {}  # table key -> the other tables its choice compared (race.py)
        self._bound: dict[tuple, object] = {}  # table key -> dispatch.BoundMLP / BoundLinear
        self._last: tuple | None = None  # (M, residual, weight addresses, generation, entry): _entry
        self._generation = generation()  # what the memos above were resolved under: _drop_stale
        self._plain_for_training = False  # a training forward made the parameters plain (_lay_out_plain)

    def _reference_weight(self) -> torch.Tensor:
        raise NotImplementedError

    def _apply(self, fn, recurse=True):
        recorder = traffic.recorder
        if recorder is not None:  # the traffic so far was recorded under the parameters' dtype until now
            recorder.retire(self)
        module = super()._apply(fn, recurse)
        self._lay_out()  # `.to()` / `.half()` copy the parameters into plain tensors
        self._start_compile_workers()
        return module

    def _start_compile_workers(self) -> None:
        """Start the compile workers (compile_workers.py) where this module's first forwards will check configs on
        a GPU, so that they are ready by then (a model's weights take seconds to load); a module calls it once built
        and after each move."""
        # Any tensor of the module: a subclass's reference weight may not be set yet while its base class builds.
        device = next((t.device for t in itertools.chain(self.parameters(), self.buffers())), None)
        if device is not None and device.type == "cuda" and self.tuned and checks_enabled() and not interpreting():
            compile_workers.start_for(device)

    def _lay_out(self) -> None:
        """Keeps the parameters in the storage inference runs on (layout.py), where the module has one: made when
        it is built, after nn.Module._apply, and after a training forward made them plain. Nothing by default."""

    def _laid_out_again(self, device: torch.device) -> bool:
        """At an inference forward after a training forward made the parameters plain: lays them out again (not
        while a CUDA graph captures) and says so, the caller then reading its parameters anew."""
        if not self._plain_for_training or capturing(device):
            return False
        self._plain_for_training = False
        self._lay_out()
        return True

    def _rows_of(self, x: object, what: str, weight: torch.Tensor) -> int:
        """How many rows x holds, after the checks that protect users. Runs on every forward: only
        what depends on x. Whether autofuse can run on the weights' dtype and device is checked when
        a config table entry is built (_config_table)."""
        if not isinstance(x, _TENSOR):
            raise AutofuseError(f"{type(self).__name__} expects a torch.Tensor, got {type(x).__name__}")
        shape = x.shape
        if not shape or shape[-1] != self.in_features:
            raise AutofuseError(
                f"expected input of shape (..., {self.in_features}) ({what}), got {tuple(shape)}"
            )
        if x.dtype != weight.dtype:
            raise AutofuseError(
                f"input dtype {x.dtype} does not match the module's {weight.dtype}; cast with .to({weight.dtype})"
            )
        if x.device != weight.device:
            raise AutofuseError(f"input is on {x.device} but the module's weights are on {weight.device}")
        return x.numel() // self.in_features

    def _entry(self, M: int, weights: list, weight: torch.Tensor, residual: bool = False):
        """The bound table entry (dispatch.BoundMLP / BoundLinear) for M rows: the last one again while
        M, the weights' addresses and what was read of tuned configs stay the same (no key built)."""
        last = self._last
        current = generation()
        if last is not None and last[0] == M and last[1] == residual and last[2] == weights and last[3] == current:
            return last[4]
        self._check_parameters()
        entry = self._bound_table(M, weight, residual)
        if not pending(entry.table):
            self._last = (M, residual, weights, generation(), entry)
        return entry

    def _check_parameters(self) -> None:
        """Checks of the parameters that need not run while they stay where they are."""

    def _drop_stale(self) -> None:
        """Forget the memos resolved before generation() last moved (a tune, an import or a first-use
        check since): keyed on the old generation they would never be used again, yet their bound
        entries keep H buffers and weights alive."""
        current = generation()
        if current != self._generation:
            self.clear_config_table()
            self._generation = current

    def _config_table(self, M: int, residual: bool = False) -> dict[str, Choice]:
        """Choices for M, resolved once per (M, bucket, dtype, device): no disk access per forward.
        M itself is part of the table key because a user may have tuned that exact token count."""
        weight = self._reference_weight()
        M = max(M, 1)  # an empty batch launches nothing; any config will do
        self._drop_stale()
        key = self._key(M, weight, residual)
        table = self._configs.get(key)
        if table is None:
            check_dtype(weight.dtype)
            check_device(weight.device)
            table, compared = select(self._plan(residual, M), M, weight.dtype, weight.device, self.tuned)
            if not pending(table):  # a choice made while no check could run is made again next time
                # Kept under the generation its own checks moved to (each stored decision moves it): the next
                # forward must not resolve again (a near tie between two ops would be timed again).
                self._seen_generation()
                key = self._key(M, weight, residual)
                self._configs[key], self._compared[key] = table, compared
        return table

    def _seen_generation(self) -> None:
        """What was read of tuned configs is up to date in this module's memos (its own checks moved it)."""
        self._generation = generation()

    _table_key = staticmethod(table_key)

    def _key(self, M: int, weight: torch.Tensor, residual: bool) -> tuple:
        """The key of the config table, the tables it compared and the bound entry for M rows (M >= 1)."""
        return (*self._table_key(M, weight), residual)

    def _bound_table(self, M: int, weight: torch.Tensor, residual: bool = False):
        """The table entry for M as a callable that binds its launches on the first call (dispatch)."""
        self._drop_stale()
        M = max(M, 1)
        key = self._key(M, weight, residual)
        bound = self._bound.get(key)
        if bound is None:
            table = self._config_table(M, residual)
            key = self._key(M, weight, residual)  # under the generation the table's checks moved it to
            bound = self._bind(table, M)
            if not pending(table):
                if self.tuned and plain.racing(weight.device) and plain.host_bound(table):
                    bound = self._raced(bound, table, self._compared[key], M, weight, residual)
                self._bound[key] = bound
        return bound

    def _raced(self, bound, table: dict[str, Choice], compared: list, M: int, weight: torch.Tensor, residual: bool):
        """`bound`, or a plain.Raced entry where other tables compute the same for un-graphed calls."""
        others = plain.candidates(table, compared, self._libraries(residual))
        if not others:
            return bound
        tables = [table, *others]
        key = plain.memo_key(type(self).__name__, self._plan(residual, M), M, weight.dtype, weight.device, tables)
        return plain.Raced(bound, [self._bind(t, M) for t in others], tables, M, key, device=weight.device)

    def _bind(self, table: dict[str, Choice], M: int):
        raise NotImplementedError

    def _libraries(self, residual: bool) -> dict[str, tuple[str, ...]]:
        """op -> the names of the library paths that compute it for this module (plain.candidates)."""
        raise NotImplementedError

    def plain_config_for(self, M: int, residual: bool = False) -> dict[str, KernelConfig | Library] | None:
        """What each op runs for M rows in an un-graphed call, once the first such call raced the tables
        for M (choose/race.py); config_for's where no race was needed; None before the first call at M."""
        entry = self._bound.get(self._key(check_size("M", M), self._reference_weight(), residual))
        if entry is None:
            return None
        table = entry.plain_table if isinstance(entry, plain.Raced) else entry.table
        return None if table is None else {op: c.config for op, c in table.items()}

    def _plan(self, residual: bool, M: int) -> LinearPlan | MLPPlan:
        """What this module computes for M rows, as choose.plans.select takes it (also what a race's decision is kept
        for)."""
        raise NotImplementedError

    def config_for(self, M: int, residual: bool = False) -> dict[str, KernelConfig | Library]:
        """What each of this module's ops runs for a batch of M rows: a KernelConfig, or a Library
        path (e.g. Library("eager"), printed library:eager) where tuning found it faster."""
        table = self._config_table(check_size("M", M), residual)
        return {op: c.config for op, c in table.items()}

    def config_sources(self, M: int, residual: bool = False) -> dict[str, str]:
        """Where each config for M came from: user-cache, checked, shipped:<file>, nearest:<key>, heuristic (or,
        before a first-use check could run, the library stand-ins of choose.Source)."""
        return {op: c.origin for op, c in self._config_table(check_size("M", M), residual).items()}

    def clear_config_table(self) -> None:
        """Resolve again on the next forward (a tune or `cache import` in this process is seen anyway)."""
        self._configs.clear()
        self._compared.clear()
        self._bound.clear()
        self._last = None
