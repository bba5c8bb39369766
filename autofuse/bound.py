"""Bound launches: one kernel launch replayed with everything bound but the tensors that change per
call, so that an un-graphed call costs little more host time than the launch itself.

A launch through Triton's JIT binds its arguments on every call (specialisation keys, a cache
lookup, the launcher's Python wrapper, a data_ptr() call and a driver query per tensor argument and
a TMA descriptor encoded per descriptor argument). A BoundLaunch keeps what the JIT compiled on the
first call and what does not change: the grid, sizes, constexprs, weight pointers (as integers, which
the launcher takes as they are) and the split-K workspace. Per call it checks the per-call tensors
(contiguous, same dtype, 16-byte aligned: what Triton specialises pointers and strides on; the rows
are bound) and swaps in their addresses.

Two ways to call the compiled kernel:
- `_RawLaunch`, for the launcher layout of Triton 3.6 (the GPU image's), checked field by field when
  bound: the C launch function directly, weight TMA descriptors encoded once, a per-call operand's
  descriptor encoded once per address (a caching allocator hands the same few addresses back).
- otherwise `CompiledKernel.run`, as the JIT calls it, with integer pointers.
While a launch hook (Triton's profiler hooks) is installed, bound launches decline: the JIT passes it
the launch metadata it wants.
"""

from __future__ import annotations

import torch

from . import workspaces
from .device import cuda_index
from .render import Kernel
from .workspaces import raw_stream

# Per-call operands' encoded TMA descriptors kept per BoundLaunch, by address: a decode loop's
# allocator cycles through a few addresses; past this many the dict starts over.
_DESCRIPTORS_KEPT = 16


class _Address:
    """What a TensorDescriptor needs of its base (an address and a dtype), without holding the tensor:
    cached descriptors must not keep a caller's activations alive."""

    __slots__ = ("address", "dtype")

    def __init__(self, address: int, dtype: torch.dtype) -> None:
        self.address, self.dtype = address, dtype

    def data_ptr(self) -> int:
        return self.address


def _tensor_descriptor(address: int, dtype: torch.dtype, bound):
    # Imported here, not at the top: Triton is imported only once the first kernel is built.
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor(_Address(address, dtype), bound.shape, bound.strides, bound.block_shape)


def _without_per_call(args: list, slots: list) -> list:
    """A launch's arguments as a bound launch keeps them: bound tensors (weights, workspace) stay, alive
    while their addresses are bound; of each per-call operand (slots: (position, operand, whether a TMA
    descriptor)) only a descriptor's layout, over an address, and nothing for a pointer. The JIT's
    descriptor holds its tensor: kept, it would hold the binding call's input and output for as long as
    the launch stays bound (at prefill, hundreds of MiB per module and M)."""
    kept = list(args)
    for i, _, is_descriptor in slots:
        d = kept[i]
        kept[i] = _tensor_descriptor(d.base.data_ptr(), d.base.dtype, d) if is_descriptor else None
    return kept


class BoundLaunch:
    """One kernel launch with everything bound but the per-call tensors (Kernel.per_call, by operand
    name). Calling it launches and returns True, or declines (returns False; the caller takes the JIT
    path) where the JIT might choose another compiled variant or the bound strides would not fit: a per-call
    tensor of another dtype or not 16-byte aligned, or not contiguous where the bound one was, or (where the
    bound one was a strided view, e.g. a half of one [M, 2F] buffer) not of its strides; a split-K launch on
    another stream than its workspace's. It launches on the caller's current stream. Rows are bound: callers
    replay only at the M that was bound. Under the interpreter the bound arguments go through fn[grid]."""

    __slots__ = ("fn", "grid", "options", "positional", "args", "slots", "layouts", "device", "stream",
                 "compiled", "keep", "raw", "descriptors", "knobs", "workspace_slots", "other_streams")

    @classmethod
    def bind(cls, kernel: Kernel, grid_: tuple, args: list, options: dict, tensors: dict, compiled,
             workspace: bool = False):
        per_call = {name: tensors[name] for name in kernel.per_call if tensors.get(name) is not None}
        if any(t.data_ptr() % 16 for t in per_call.values()):
            return None  # compiled for unaligned rows: leave such inputs to the JIT
        self = cls()
        self.fn, self.grid, self.options, self.positional = kernel.fn, grid_, options, len(args)
        # Each per-call tensor's dtype and, where it was not contiguous, its strides: the launch's stride
        # arguments are bound with it, so a later tensor must have the same (any contiguous one of the bound
        # shape has them where the bound one was contiguous).
        self.layouts = {name: (t.dtype, None if t.is_contiguous() else t.stride()) for name, t in per_call.items()}
        # The compiled launcher takes every parameter, constexprs included, in signature order.
        full = list(args) + [options[name] for name in kernel.constexprs]
        # (position, operand, whether a TMA descriptor) for each per-call tensor.
        self.slots = [(i, p.operand, p.kind == "descriptor") for i, p in enumerate(kernel.parameters)
                      if p.operand in per_call and p.kind in ("tensor", "descriptor")]
        device = next(iter(per_call.values())).device
        self.device = cuda_index(device) if device.type == "cuda" else None
        self.compiled = compiled if self.device is not None else None
        self.descriptors = {}
        if self.compiled is None:  # the interpreter: tensors stay tensors
            self.args, self.keep, self.raw = full, None, None
            return self
        # A split-K workspace belongs to the stream it was made for (concurrent streams must not share
        # one): on another stream the launch takes that stream's own (_workspace_on).
        self.stream = raw_stream(self.device) if workspace else None
        # (position, which: 0 the float32 sums, 1 the int32 counters, size) of the workspace arguments.
        self.workspace_slots = [(i, p.index, full[i].numel()) for i, p in enumerate(kernel.parameters)
                                if p.kind == "workspace"]
        self.other_streams = {}
        self.knobs = _hook_chains()
        if self.knobs is None:  # a Triton whose launch hooks are not chains: its JIT passes them itself
            return None
        self.keep = _without_per_call(full, self.slots)
        self.args = [_pointer(a) for a in self.keep]  # per-call positions are filled in on every call
        self.raw = _RawLaunch.make(compiled, grid_, self)
        return self

    def __call__(self, tensors: dict) -> bool:
        compiled = self.compiled
        if compiled is None:
            return self._interpret(tensors)
        # A profiler's launch hook wants the JIT's launch metadata: leave such launches to the JIT.
        knobs = self.knobs
        if getattr(knobs.launch_enter_hook, "calls", True) or getattr(knobs.launch_exit_hook, "calls", True):
            return False
        stream = raw_stream(self.device)
        workspace = None
        if self.stream is not None and stream != self.stream:
            workspace = self._workspace_on(stream)
            if workspace is None:
                return False
        if self.raw is not None:
            return self.raw(self, tensors, stream, workspace)
        args = self.args.copy()
        for i, address in workspace or ():
            args[i] = address
        for i, name, is_descriptor in self.slots:
            address = _address_of(tensors[name], self.layouts[name])
            if address is None:
                return False
            args[i] = self._descriptor(i, address) if is_descriptor else address
        grid3 = (*self.grid, 1, 1)
        compiled.run(grid3[0], grid3[1], grid3[2], stream, compiled.function, compiled.packed_metadata, None,
                     None, None, *args)
        return True

    def _workspace_on(self, stream: int) -> list | None:
        """[(position, address)] of this stream's own split-K workspace (workspaces.workspace, as the
        JIT path takes it), kept per stream; None while a CUDA graph captures (the JIT path then
        finds one without allocating in the graph's pool)."""
        found = self.other_streams.get(stream)
        if found is None:
            if torch.cuda.is_current_stream_capturing():
                return None
            device = torch.device("cuda", self.device)
            sizes = {which: size for _, which, size in self.workspace_slots}
            tensors = workspaces.workspace(device, sizes.get(0, 0), sizes.get(1, 0))
            found = self.other_streams[stream] = (
                [(i, tensors[which].data_ptr()) for i, which, _ in self.workspace_slots], tensors)
        return found[0]

    def _descriptor(self, i: int, address: int):
        """The TMA descriptor of the per-call operand at position i, at this address (rows bound)."""
        desc = self.descriptors.get((i, address))
        if desc is None:
            bound = self.keep[i]
            desc = _keep(self.descriptors, (i, address), _tensor_descriptor(address, bound.base.dtype, bound))
        return desc

    def _interpret(self, tensors: dict) -> bool:
        args = self.args.copy()
        for i, name, is_descriptor in self.slots:
            t = tensors[name]
            if _address_of(t, self.layouts[name]) is None:
                return False
            bound = self.args[i]
            shape = bound.shape
            if t.dim() != len(shape):  # rows are bound: a caller may pass [B, S, K] for [M, K]
                t = t.view(shape)
            args[i] = type(bound)(t, shape, bound.strides, bound.block_shape) if is_descriptor else t
        self.fn[self.grid](*args[:self.positional], **self.options)
        return True


def _keep(descriptors: dict, key: tuple, value):
    """`value` stored under `key` in a BoundLaunch's per-address descriptor cache, which starts over
    once it holds _DESCRIPTORS_KEPT entries; returns the value."""
    if len(descriptors) >= _DESCRIPTORS_KEPT:
        descriptors.clear()
    descriptors[key] = value
    return value


def _pointer(arg):
    """What the compiled launcher takes for an argument: a tensor (or _Address) as its address."""
    if isinstance(arg, (torch.Tensor, _Address)):
        return arg.data_ptr()
    return arg


def _address_of(t: torch.Tensor, layout: tuple) -> int | None:
    """A per-call tensor's address, or None where the bound kernel cannot take it (see BoundLaunch); `layout`:
    the bound tensor's (dtype, strides or None where it was contiguous)."""
    address = t.data_ptr()
    dtype, strides = layout
    if address % 16 or t.dtype != dtype or not (t.is_contiguous() if strides is None else t.stride() == strides):
        return None
    return address


def _hook_chains():
    """Triton's runtime knobs where their launch hooks are hook chains (Triton 3.6 and later, read on
    every call: a profiler adds to them); else None."""
    # Imported here, not at the top: Triton is imported only once the first kernel is built.
    from triton import knobs

    runtime = knobs.runtime
    chains = (getattr(runtime, "launch_enter_hook", None), getattr(runtime, "launch_exit_hook", None))
    return runtime if all(isinstance(getattr(c, "calls", None), list) for c in chains) else None


class _RawLaunch:
    """Triton 3.6's C launch function called directly: what CudaLauncher.__call__ and its descriptor
    wrapper do, with bound descriptors encoded once. `make` returns None for any other layout (another
    Triton, scratch memory, an unknown wrapper), and the launch goes through CompiledKernel.run."""

    __slots__ = ("launch", "grid3", "head", "flat", "slots", "metas")

    @classmethod
    def make(cls, compiled, grid_: tuple, bound: BoundLaunch):
        layout = _launcher_layout(compiled.run)
        if layout is None:
            return None
        launch, indices, metas, expand = layout
        run = compiled.run
        self = cls()
        self.launch = launch
        grid3 = (*grid_, 1, 1)[:3]
        self.grid3 = grid3
        self.head = (compiled.function, run.launch_cooperative_grid, run.launch_pdl, None, None,
                     compiled.packed_metadata, None, None, None)
        flat: list = []
        self.slots = {}
        self.metas = {}
        per_call = {i for i, _, _ in bound.slots} | {i for i, _, _ in bound.workspace_slots}
        for i, arg in enumerate(bound.args):
            if i in indices:
                meta = metas[len(self.metas)]
                self.metas[i] = (meta, expand)
                expanded = [_pointer(a) for a in expand(bound.keep[i], meta)]
                start = len(flat)
                flat.extend(expanded)
                if i in per_call:
                    self.slots[i] = (start, len(expanded))
            else:
                if i in per_call:
                    self.slots[i] = (len(flat), 1)
                flat.append(arg)
        self.flat = flat
        return self

    def __call__(self, bound: BoundLaunch, tensors: dict, stream: int, workspace: list | None) -> bool:
        flat = self.flat.copy()
        slots = self.slots
        for i, address in workspace or ():
            flat[slots[i][0]] = address
        for i, name, is_descriptor in bound.slots:
            address = _address_of(tensors[name], bound.layouts[name])
            if address is None:
                return False
            start, length = slots[i]
            if is_descriptor:
                flat[start:start + length] = self._expanded(bound, i, address)
            else:
                flat[start] = address
        grid3 = self.grid3
        self.launch(grid3[0], grid3[1], grid3[2], stream, *self.head, *flat)
        return True

    def _expanded(self, bound: BoundLaunch, i: int, address: int) -> list:
        """The launcher's arguments for the per-call descriptor at position i, encoded once per address."""
        expanded = bound.descriptors.get((i, address))
        if expanded is None:
            meta, expand = self.metas[i]
            desc = _tensor_descriptor(address, bound.keep[i].base.dtype, bound.keep[i])
            expanded = _keep(bound.descriptors, (i, address), [_pointer(a) for a in expand(desc, meta)])
        return expanded


def _launcher_layout(run):
    """(C launch function, descriptor positions, their metadata, make_tensordesc_arg) where `run` is
    Triton 3.6's CudaLauncher without scratch memory; else None."""
    try:
        from triton.backends.nvidia import driver as nvidia
    except ImportError:
        return None
    if (getattr(nvidia, "_BASE_ARGS_FORMAT", None) != "iiiKKppOOOOOO" or type(run) is not getattr(
            nvidia, "CudaLauncher", None) or run.global_scratch_size or run.profile_scratch_size):
        return None
    expand = getattr(nvidia, "make_tensordesc_arg", None)
    if expand is None or expand.__code__.co_argcount != 2:
        return None
    launch = run.launch
    if type(launch).__name__ == "builtin_function_or_method":
        return launch, frozenset(), [], expand
    code = getattr(launch, "__code__", None)
    if code is None or code.co_name != "inner" or launch.__closure__ is None:
        return None
    cells = dict(zip(code.co_freevars, (c.cell_contents for c in launch.__closure__)))
    if set(cells) != {"launcher", "tensordesc_indices", "tensordesc_meta"}:
        return None
    metas = cells["tensordesc_meta"] or [None] * len(cells["tensordesc_indices"])
    return cells["launcher"], frozenset(cells["tensordesc_indices"]), list(metas), expand
