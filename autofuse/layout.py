"""How a gated MLP keeps its parameters: padded storage for a d_ff that is not a multiple of 16, and
optionally the gate and up weights interleaved in one buffer.

Padding. Triton specialises a kernel on pointers divisible by 16 bytes and on integer arguments (strides)
divisible by 16: a row stride that is not gives the compiler no alignment for the rows, and every load
along them is element-wise. Rows of d_ff elements that are not (the down projection's weight [d_model,
d_ff], H [M, d_ff]) cost that even where they are 16-byte aligned (d_ff = 20024, a multiple of 8: its down
projection streamed at 38-62% of the read ceiling at M <= 16, padded to 20032 at 85-93%; H200,
benchmarks/decode.py), and rows that are not 16-byte aligned cost up to 27x at decode sizes (docs/design.md);
a d_ff that no BLOCK_K divides masks every K step, and cuBLAS slows down on such rows too. The parameters
then become views of storage padded with zeros along d_ff to run_width(d_ff), and inference runs the MLP at
that width on as_strided views of it. That is exact: the padded gate and up rows and biases are 0, so H's
padded columns are act(0) * 0 = 0, and the down projection adds 0 * 0 for each of them. A d_model that is
not a multiple of 16 (the up-projection's K: rows of x and of the gate and up weights) pads the same way: the
gate and up weights get zero columns up to input_width(d_model), and inference pads x's rows with zeros to
match (one small copy per call), so every GEMM of the up-projection reads aligned rows; x's padded columns
meet zero weights. The down projection runs at that width too (its N): its weight and bias get zero rows up
to input_width(d_model), it writes [M, input_width(d_model)], and the module returns the first d_model columns
(a view whose rows lie input_width(d_model) apart; the padded columns are 0 + 0). An N that is not a multiple of
16 cost the down projection most of its speed: 7679 -> 7237 at M = 256 ran 99.1 us in the best of 84 Triton
configs against 58.3 at N = 7248 (cuBLAS 325.8 against 51.2), 20024 -> 5681 175.1 against 131.7 (cuBLAS 670.2
against 106.9), at M = 64 54.0 against 43.9; writing only the output's rows padded gained nothing (H100).

Lines. Storage the layout makes holds each weight row a whole number of 128-byte lines apart (LINE_BYTES,
mlp_strides), also where the sizes that run need no padding: rows that start part-way into a line cost the
weight-streaming decode kernels up to 16% of their read rate (docs/design.md). Only the row stride grows; the
sizes that run, and so the tuning keys, stay as above.

Interleaving (the default; get_mlp(interleaved=False) / fuse(..., interleaved=False) opt out). The gate
and up weights live in ONE buffer of 2W rows (d_model wide, held mlp_strides apart), row 2j the gate's row j
and row 2j + 1 the up's, each parameter a strided view of it (row stride twice the buffer's), so that op
gated_pairs runs the gated up-projection as one GEMM over the buffer (ops/gated_pairs.py) while every other path
reads the two views.

Either way the weights are kept ONCE: the views have the parameters' own shapes, so state_dict keys
and shapes, optimizers and user code see the same tensors; a state_dict saves plain contiguous
copies (contiguous_state). `.to()` / `.half()` lay them out again (FusedMLP._apply); a parameter
replaced through `.data =` or load_state_dict(assign=True) is seen (widen gives None) and runs as it
is. Training and torch.compile run on the parameters as they are.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .device import capturing

# Elements: rows of PAD_TO elements are 16-byte aligned in every supported dtype, PAD_TO is a multiple of
# 16 (what Triton specialises a stride on) and of every BLOCK_K the templates use, so the padded K needs no
# mask.
PAD_TO = 64
# pad_rows keeps a zero block per M up to this many rows (decode, where a call's host time shows).
ZERO_BLOCK_MAX_M = 256
# A width that Triton's divisibility specialisation sees as aligned: rows of it need no padding.
ALIGNED = 16


# Rows that are 16-byte aligned in 16-bit dtypes: a width that is a multiple of this needs no padding for them.
ROW_ALIGNED = 8
# Bytes a row of storage the layout owns starts apart from the next, at least: a whole number of 128-byte lines.
# Rows 16 bytes past a line cost the weight-only fp8 tiles 8-16% of their read rate at decode sizes: gated_up_fp8
# over 4224 -> 23104 at M = 2 ran 59.2 us with rows 4224 bytes apart, 68.5 at 4240 and 64.5 at 4256 (32 past a
# line); 6480 -> 27640 132.5 us at 6480 (80 past) and 116.8 at 6528 (H200, the best of five tile configs each).
LINE_BYTES = 128


def _padded(d: int, multiple: int) -> int:
    return d if d % multiple == 0 else -(-d // PAD_TO) * PAD_TO


def run_width(d_ff: int) -> int:
    """The d_ff a gated MLP's inference kernels run at: d_ff itself where it is a multiple of ALIGNED, else
    d_ff rounded up to PAD_TO (padded storage)."""
    return _padded(d_ff, ALIGNED)


def row_width(d: int) -> int:
    """d, padded only where rows of d 16-bit elements are not 16-byte aligned: the d_model and d_ff a training
    step runs at (training.Padding: its padded space copies the weights every step, and padded to multiples of 16
    as well, d_model 2368 -> d_ff 4872 stepped in 1.012 ms at M = 2048 against 0.850 unpadded, 2.998 against 3.111
    at M = 8192; H200, benchmarks/training.py)."""
    return _padded(d, ROW_ALIGNED)


def aligned_width(d: int) -> int:
    """d rounded up to a multiple of ALIGNED: a row stride, in elements, that Triton's divisibility
    specialisation sees as aligned."""
    return -(-d // ALIGNED) * ALIGNED


def line_width(k: int, element_size: int) -> int:
    """k rounded up so that rows of k elements of `element_size` bytes start a whole number of LINE_BYTES apart:
    the row stride, in elements, of the storage padded_rows and stack_padded make."""
    per_line = LINE_BYTES // element_size
    return -(-k // per_line) * per_line


def line_rows(t: torch.Tensor, run: int | None = None) -> torch.Tensor:
    """`t` ([N, K]) as a view of zero-filled storage whose rows start line_width(run) elements apart (a copy; run:
    the width the layout's storage holds, K by default), or `t` itself where its rows already are contiguous and so
    apart: how the layouts below hold a weight, and how tuning makes the weights it times."""
    n, k = t.shape
    width = line_width(k if run is None else run, t.element_size())
    if width == k and t.is_contiguous():
        return t
    return _copy_into_zeros(t, n, width)


def aligned_rows(t: torch.Tensor) -> torch.Tensor:
    """`t` ([N, K]) as a view of zero-filled storage whose rows start aligned_width(K) elements apart; `t` itself
    where K already is a multiple of ALIGNED and its rows are contiguous. The padding is never read: loads along K
    stop at K."""
    n, k = t.shape
    if k % ALIGNED == 0 and t.is_contiguous():
        return t
    return _copy_into_zeros(t, n, aligned_width(k))


def padded_rows(t: torch.Tensor) -> torch.Tensor:
    """`t` ([N, K]) as a view of zero-filled storage of aligned_width(N) rows, line_width(K) elements apart (whole
    128-byte lines, and whole 16 x 16 blocks: padded_whole), or `t` itself where it is such a view already: how fp8
    weights are held. Kernels read the [N, K] view; torch._scaled_mm, which takes sizes that are multiples of 16
    only, reads the whole storage, its zeros included."""
    if padded_whole(t) is not None:
        return t
    n, k = t.shape
    return _copy_into_zeros(t, aligned_width(n), line_width(k, t.element_size()))


def _copy_into_zeros(t: torch.Tensor, rows: int, width: int) -> torch.Tensor:
    """A copy of `t` ([N, K]) as the [N, K] view of new zero-filled [rows, width] storage (rows >= N, width >= K)."""
    n, k = t.shape
    view = t.new_zeros((rows, width))[:n, :k]
    view.copy_(t)
    return view


def padded_whole(t: torch.Tensor) -> torch.Tensor | None:
    """The [aligned_width(N), line_width(K)] storage behind a padded_rows view `t` ([N, K]), or None where `t` is
    not one (its rows not line_width(K) apart from the start of the storage or of a whole such block of it, as
    stack_padded stacks two, or the storage too short). Its padding is zero as padded_rows or stack_padded made it:
    nothing writes there."""
    n, k = t.shape
    rows, width = aligned_width(n), line_width(k, t.element_size())
    offset = t.storage_offset()
    if (t.stride() != (width, 1) or offset % (rows * width)
            or t.untyped_storage().nbytes() < (offset + rows * width) * t.element_size()):
        return None
    return t.as_strided((rows, width), (width, 1))


def stack_padded(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """a and b ([N, K] alike) copied into the two halves of one zero-filled storage, each half a padded_rows one
    ([aligned_width(N), line_width(K)]): (a', b'), views that stacked_padded finds stacked."""
    n, k = a.shape
    rows = aligned_width(n)
    joint = a.new_zeros((2 * rows, line_width(k, a.element_size())))
    stacked = joint[:n, :k], joint[rows:rows + n, :k]
    stacked[0].copy_(a)
    stacked[1].copy_(b)
    return stacked


def stacked_padded(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor | None:
    """The [2 aligned_width(N), line_width(K)] storage whose halves hold padded_rows views a and b ([N, K] alike),
    b's right after a's (stack_padded), or None where they are not so held."""
    whole_a, whole_b = padded_whole(a), padded_whole(b)
    if (whole_a is None or whole_b is None or a.shape != b.shape or a.dtype != b.dtype
            or a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
            or whole_b.storage_offset() != whole_a.storage_offset() + whole_a.numel()):
        return None
    rows, width = whole_a.shape
    return a.as_strided((2 * rows, width), (width, 1))


def input_width(d_model: int) -> int:
    """The d_model inference runs the up projection at (its K: x's rows, the gate and up rows): d_model where it
    is a multiple of ALIGNED, else padded to PAD_TO. A K that is a multiple of 8 but not of 16 masks every K step
    element by element: the gated up projection's GEMV at M = 1 over d_model 6536 (d_ff 13984) ran 143.9 us, 85%
    of the read ceiling, against 128.5 us (96%) at 6544 (H100). A padded d_model costs a copy of x per call and
    takes the one-launch MLP out of the plan."""
    return _padded(d_model, ALIGNED)


def linear_width(d: int) -> int:
    """An in_features or out_features a Linear (FusedLinear) runs at: d where rows of d 16-bit elements are
    16-byte aligned, else padded to PAD_TO (as row_width). Unaligned rows cost cuBLAS and Triton most of their
    speed, and padding them is worth its copy of x per call: 5416 -> 5365 ran 209.9 us at M = 2048 padded
    against eager's 1360.5, 2987 -> 11392 226.1 against 1522.7. A multiple of 8 is not padded to one of 16 as
    the MLP's d_model is: a Linear's x is as large as its weight where M nears out_features, and the copy lost
    more than alignment gained, 6600 -> 872 ran 84.8 us padded to 6656 -> 896 at M = 2048 against eager's 51.4
    (11.2 against 9.4 at M = 16; H100, graph-replayed, benchmarks/never_slower.py)."""
    return row_width(d)


# Up to this many rows a Linear whose in_features is padded (LinearLayout) runs at its own in_features: x is read as
# it is, its last K step masked, over the weight's rows in the padded storage, where copying x into padded rows
# took 11.1 of a call's 30.9 us of host time at M = 1 (torch.cat; 2987 -> 11392, H100) and made the plain call
# slower than eager's (55.0 against 41.8 us).
UNPADDED_K_MAX_M = 16


def linear_sizes(out_features: int, in_features: int, M: int) -> tuple[int, int]:
    """(N, K) a FusedLinear runs at for M rows: linear_width of each, but in_features itself up to UNPADDED_K_MAX_M
    rows."""
    k = in_features if M <= UNPADDED_K_MAX_M else linear_width(in_features)
    return linear_width(out_features), k


class _PaddedLayout:
    """Parameters laid out as views of padded storage: widen() gives them at the sizes that run while they still are
    views of it (each as _views() says), or None; `active` says whether they were at the last widen (or, before any,
    since they were laid out)."""

    def __init__(self, params: tuple) -> None:
        self.storages = self._storages(params)
        self._memo: tuple | None = None  # (weights' addresses, widened parameters or None)
        self._zero_blocks: dict[tuple, torch.Tensor] = {}  # pad_rows's, by (M, columns, dtype, device)

    def pad_rows(self, x2d: torch.Tensor, width: int) -> torch.Tensor:
        """x2d ([M, K]) with zero columns up to `width`, in new storage. Up to ZERO_BLOCK_MAX_M rows, torch.cat with
        a zero block kept per (M, dtype, device): one op, where F.pad's constant_pad_nd runs a fill, a narrow and a
        copy, 15.5 against 27.8 us per call at M = 1 (H100 host); above that, and while a CUDA graph captures (no
        block is made in a graph's pool), F.pad."""
        M = x2d.shape[0]
        if M > ZERO_BLOCK_MAX_M or capturing(x2d.device):
            return F.pad(x2d, (0, width - x2d.shape[1]))
        key = (M, width - x2d.shape[1], x2d.dtype, x2d.device)
        zeros = self._zero_blocks.get(key)
        if zeros is None:
            zeros = self._zero_blocks[key] = x2d.new_zeros(key[:2])
        return torch.cat((x2d, zeros), 1)

    @property
    def active(self) -> bool:
        return self._memo is None or self._memo[1] is not None

    @staticmethod
    def _storages(params: tuple) -> tuple:
        return tuple(None if p is None else p.untyped_storage().data_ptr() for p in params)

    def _views(self) -> dict:
        """(shape, stride, storage offset) of each parameter and the shape of its widened view, by position."""
        raise NotImplementedError

    def widen(self, params: tuple, weights: list) -> tuple | None:
        """The parameters at the sizes that run, or None where one is no longer a view of this storage.
        `weights`: the parameters' addresses (launch.addresses), the memo's key."""
        memo = self._memo
        if memo is not None and memo[0] == weights:
            return memo[1]
        widened = self._widened(params)
        # The widened views keep their storage alive, so the addresses cannot be reused while memoised; a
        # failed check is kept too, so that replaced parameters cost no storage lookups per forward.
        self._memo = (weights, widened)
        return widened

    def _widened(self, params: tuple) -> tuple | None:
        if self._storages(params) != self.storages:
            return None
        wide = list(params)
        for i, (shape, stride, offset, wide_shape) in self._views().items():
            p = params[i]
            if p is None:
                continue
            if p.shape != shape or p.stride() != stride or p.storage_offset() != offset:
                return None
            wide[i] = p.as_strided(wide_shape, stride, offset)
        return tuple(wide)


class MLPLayout(_PaddedLayout):
    """The storage lay_out() made for one gated MLP's parameters. widen() gives (wg, bg, wu, bu, wd, bd) at the
    width that runs (interleaved: still views of the one buffer, ops.gated_pairs.pairs_of gives it back)."""

    def __init__(self, d_model: int, d_ff: int, interleaved: bool, params: tuple) -> None:
        self.d_model, self.d_ff, self.width, self.interleaved = d_model, d_ff, run_width(d_ff), interleaved
        self.d_in = input_width(d_model)  # the up-projection's K and the down projection's N, padded
        self.strides = mlp_strides(d_model, d_ff, params[0].element_size())
        super().__init__(params)

    def _views(self) -> dict:
        """By position in (wg, bg, wu, bu, wd, bd): what lay_out made."""
        d, D, F, W = self.d_model, self.d_in, self.d_ff, self.width
        up_rows, down_rows = self.strides
        step = 2 if self.interleaved else 1
        return {
            0: ((F, d), (step * up_rows, 1), 0, (W, D)),
            1: ((F,), (step,), 0, (W,)),
            2: ((F, d), (step * up_rows, 1), up_rows if self.interleaved else 0, (W, D)),
            3: ((F,), (step,), 1 if self.interleaved else 0, (W,)),
            4: ((d, F), (down_rows, 1), 0, (D, W)),
            5: ((d,), (1,), 0, (D,)),
        }


def mlp_strides(d_model: int, d_ff: int, element_size: int) -> tuple[int, int]:
    """(the gate and up weights' row stride, the down weight's), in elements, in the storage lay_out makes: the
    widths that run (input_width, run_width) rounded up to whole lines (line_width)."""
    return (line_width(input_width(d_model), element_size), line_width(run_width(d_ff), element_size))


class LinearLayout(_PaddedLayout):
    """The storage lay_out_linear() made for a Linear's weight ([N, K]) and bias ([N]) where rows of N or K
    elements are not 16-byte aligned: zero-filled [linear_width(N), linear_width(K)] and [linear_width(N)], the
    parameters views of their first N rows and K columns. Inference runs the Linear at the padded sizes, exactly
    as the MLP's down projection at a padded d_model (the module docstring): x's rows padded with zeros to K's
    width, a residual's to N's, the padded output columns 0 + 0 and the output the first N columns. widen() gives
    (weight, bias) at those sizes."""

    def __init__(self, n: int, k: int, params: tuple) -> None:
        self.n, self.k, self.n_run, self.k_run = n, k, linear_width(n), linear_width(k)
        self.row_stride = line_width(self.k_run, params[0].element_size())
        self._narrow: tuple | None = None  # (widened weight, its first k columns): narrow_k
        super().__init__(params)

    def operands(self, x: torch.Tensor, wide_weight: torch.Tensor, M: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, weight) a call of M rows runs on, at linear_sizes' K: up to UNPADDED_K_MAX_M rows x as it is over the
        widened weight's first k columns (narrow_k), above them x's rows padded to k_run (pad_rows)."""
        if self.k_run == self.k:
            return x, wide_weight
        if M <= UNPADDED_K_MAX_M:
            return x, self.narrow_k(wide_weight)
        return self.pad_rows(x.reshape(M, self.k), self.k_run), wide_weight

    def narrow_k(self, wide_weight: torch.Tensor) -> torch.Tensor:
        """The widened weight ([n_run, k_run]) at K = k: its first k columns, the rows still the padded storage's
        (kept per widened weight: a view costs host time per call)."""
        memo = self._narrow
        if memo is None or memo[0] is not wide_weight:
            memo = self._narrow = (wide_weight, wide_weight[:, :self.k])
        return memo[1]

    def _views(self) -> dict:
        """By position in (weight, bias): what lay_out_linear made."""
        return {0: ((self.n, self.k), (self.row_stride, 1), 0, (self.n_run, self.k_run)),
                1: ((self.n,), (1,), 0, (self.n_run,))}


def lay_out_linear(weight: nn.Parameter, bias: nn.Parameter | None) -> LinearLayout | None:
    """Re-lays a Linear's parameters into the storage LinearLayout describes; None where rows of both sizes are
    aligned already (linear_width) and the weight's rows whole lines apart (line_width), or on the meta device."""
    n, k = weight.shape
    n_run, k_run = linear_width(n), linear_width(k)
    row_stride = line_width(k_run, weight.element_size())
    if ((n_run, k_run) == (n, k) and row_stride == k and weight.is_contiguous()) or weight.device.type == "meta":
        return None
    with torch.inference_mode(False):
        _relay(weight, weight.new_zeros((n_run, row_stride)), lambda s: s[:n, :k])
        if bias is not None:
            _relay(bias, bias.new_zeros((n_run,)), lambda s: s[:n])
    return LinearLayout(n, k, (weight, bias))


def _relay(param: nn.Parameter, storage: torch.Tensor, view) -> None:
    with torch.no_grad():
        view(storage).copy_(param)
        param.data = view(storage)


def lay_out(gate: nn.Linear, up: nn.Linear, down: nn.Linear, interleaved: bool = False) -> MLPLayout | None:
    """Re-lays a gated MLP's parameters into the storage described in the module docstring; None where
    nothing needs it (d_ff and d_model multiples of ALIGNED, the weights' rows whole lines apart already and not
    interleaved) or can have it (the meta device)."""
    d_ff, d_model = gate.weight.shape
    width, d_in = run_width(d_ff), input_width(d_model)
    up_rows, down_rows = mlp_strides(d_model, d_ff, gate.weight.element_size())
    lined = (up_rows == d_model and down_rows == d_ff
             and all(p.weight.is_contiguous() for p in (gate, up, down)))
    if (width == d_ff and d_in == d_model and lined and not interleaved) or gate.weight.device.type == "meta":
        return None
    # Made outside inference mode: an inference tensor could not stay a parameter's data.
    with torch.inference_mode(False):
        if interleaved:
            pairs = gate.weight.new_zeros((2 * width, up_rows))
            _relay(gate.weight, pairs, lambda s: s[0:2 * d_ff:2, :d_model])
            _relay(up.weight, pairs, lambda s: s[1:2 * d_ff:2, :d_model])
            if gate.bias is not None:
                bias_pairs = gate.bias.new_zeros((2 * width,))
                _relay(gate.bias, bias_pairs, lambda s: s[0:2 * d_ff:2])
                _relay(up.bias, bias_pairs, lambda s: s[1:2 * d_ff:2])
        else:
            for linear in (gate, up):
                _relay(linear.weight, linear.weight.new_zeros((width, up_rows)), lambda s: s[:d_ff, :d_model])
                if linear.bias is not None:
                    _relay(linear.bias, linear.bias.new_zeros((width,)), lambda s: s[:d_ff])
        if width != d_ff or d_in != d_model or down_rows != d_ff or not down.weight.is_contiguous():
            _relay(down.weight, down.weight.new_zeros((d_in, down_rows)), lambda s: s[:d_model, :d_ff])
        if down.bias is not None and d_in != d_model:
            _relay(down.bias, down.bias.new_zeros((d_in,)), lambda s: s[:d_model])
    params = (gate.weight, gate.bias, up.weight, up.bias, down.weight, down.bias)
    return MLPLayout(d_model, d_ff, interleaved, params)


class TrainingLayout(_PaddedLayout):
    """The storage a training forward lays a module's parameters out in where its step runs in a padded space
    (training.Padding, training.LinearRun): a weight whose rows are aligned and whose row count is not becomes the
    first rows of a zero-filled buffer of padded rows, a contiguous tensor as before, and widen() gives the padded
    weights the step's GEMMs read as views of that storage (no copy a step, no second copy held); the other
    parameters stay plain and widen() gives them as they are. Contiguous, never a transposed view: fused AdamW steps
    a parameter whose gradient's or state's strides differ from its own wrongly and silently (a state saved from a
    contiguous weight, loaded into a transposed one, moved a step by 0.01; torch 2.13, CPU), so the parameters keep
    the strides any checkpoint's optimizer state has. lay_out_training (a gated MLP's gate and up weights) and
    lay_out_linear_training (a Linear's weight where only out_features is unaligned) make it."""

    def __init__(self, params: tuple, wide_shapes: tuple) -> None:
        """params: all of the module's, in its order; wide_shapes: each one's padded shape, None for one that stays
        plain."""
        self._layout = {i: (tuple(p.shape), p.stride(), p.storage_offset(), wide)
                        for i, (p, wide) in enumerate(zip(params, wide_shapes)) if p is not None and wide is not None}
        super().__init__(params)

    def _views(self) -> dict:
        return self._layout


def lay_out_training(gate: nn.Linear, up: nn.Linear, down: nn.Linear) -> TrainingLayout | None:
    """Re-lays a gated MLP's parameters into the storage TrainingLayout describes, their values kept: the gate and up
    weights the first d_ff rows of the halves of one zero-filled [2, W, d_model] buffer (their biases of one [2, W]),
    the down projection's left as they are, contiguous by then (its [d_model, d_ff] rows are unaligned: the step
    copies it; FusedMLP._lay_out_plain makes it contiguous before, so that the layout records its storage); None
    where it does not apply: d_ff's rows aligned already (no padding), d_model's not (the gate and up rows would be
    unaligned too), or the meta device."""
    d_ff, d_model = gate.weight.shape
    width = row_width(d_ff)
    if width == d_ff or row_width(d_model) != d_model or gate.weight.device.type == "meta":
        return None
    with torch.inference_mode(False):
        gate_up = gate.weight.new_zeros((2, width, d_model))
        _relay(gate.weight, gate_up, lambda s: s[0, :d_ff])
        _relay(up.weight, gate_up, lambda s: s[1, :d_ff])
        biases = [p for p in (gate.bias, up.bias) if p is not None]
        if biases:
            storage = biases[0].new_zeros((2, width))
            for half, p in enumerate((gate.bias, up.bias)):
                if p is not None:
                    _relay(p, storage, lambda s, half=half: s[half, :d_ff])
    params = (gate.weight, gate.bias, up.weight, up.bias, down.weight, down.bias)
    return TrainingLayout(params, ((width, d_model), (width,), (width, d_model), (width,), None, None))


def lay_out_linear_training(weight: nn.Parameter, bias: nn.Parameter | None) -> TrainingLayout | None:
    """Re-lays a Linear's parameters ([n, k] and [n]) into the storage TrainingLayout describes where only n is
    unaligned (N = linear_width(n), the size its padded training step runs at), values kept: the weight the first n
    rows of a zero-filled [N, k] buffer, the bias of an [N] one. None elsewhere (an unaligned k leaves the weight's
    rows unaligned: the step copies it), or on the meta device."""
    n, k = weight.shape
    N = linear_width(n)
    if N == n or linear_width(k) != k or weight.device.type == "meta":
        return None
    with torch.inference_mode(False):
        _relay(weight, weight.new_zeros((N, k)), lambda s: s[:n])
        if bias is not None:
            _relay(bias, bias.new_zeros((N,)), lambda s: s[:n])
    return TrainingLayout((weight, bias), ((N, k), (N,)))


def contiguous_state(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    """A state_dict hook of a module holding such a layout: its entries are saved as plain tensors of their
    own (views with gaps, or the halves of the training layout's one gate-and-up buffer: safetensors refuses
    tensors that share storage, and torch.save would write the padding or the whole buffer)."""
    for key, value in state_dict.items():
        if key.startswith(prefix) and isinstance(value, torch.Tensor) and (
                not value.is_contiguous()
                or value.untyped_storage().nbytes() != value.numel() * value.element_size()):
            state_dict[key] = value.clone(memory_format=torch.contiguous_format)
