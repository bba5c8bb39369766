"""A gated MLP's parameter layouts (autofuse/layout.py): a d_ff that is not a multiple of 8 kept in
zero-padded storage and run at the padded width, and gate and up interleaved in one buffer (the default), where
op gated_pairs runs if checked faster. Correct in every dtype, invisible to state_dict, kept through
`.to()`, given up (not wrong) when a parameter is replaced."""

import importlib

import pytest
import torch
from _helpers import DTYPES, assert_matches_reference, check_mlp

import autofuse
from autofuse import evaluator, ops
from autofuse.choose import check as checked
from autofuse.choose import lookup as resolve
from autofuse.choose.plans import MLPPlan
from autofuse.layout import PAD_TO, input_width, mlp_strides, row_width, run_width
from autofuse.reference import eager_linear, eager_mlp, linear_reference
from autofuse.shapes import LinearShape, MLPShape
from autofuse.store import TrialRecord


def _is_padded(module) -> bool:
    wd = module.down_proj.weight
    return wd.stride() == (run_width(module.d_ff), 1) and not wd.is_contiguous()


def test_run_width():
    assert run_width(80) == 80 and run_width(16384) == 16384  # multiples of 16: unchanged
    # A multiple of 8 (16-byte aligned rows) but not of 16: Triton's stride specialisation sees no alignment.
    assert run_width(72) == 128 and run_width(20024) == 20032
    # Training pads only rows that are not 16-byte aligned; inference pads d_model (the up projection's K) as d_ff.
    assert row_width(72) == 72 and row_width(75) == 128
    assert input_width(72) == 128 and input_width(6536) == 6592 and input_width(4096) == 4096
    assert run_width(75) == 128 and run_width(10485) == 10496 and run_width(68) == 128
    assert all(run_width(f) % PAD_TO == 0 for f in (1, 7, 63, 65, 4097))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("M", [1, 37])
def test_odd_d_ff_runs_padded_and_correct(dtype, bias, M, device):
    module = autofuse.get_mlp(40, 75, activation="silu", bias=bias, dtype=dtype, device=device)
    assert _is_padded(module) and module.d_ff_run == 128
    assert [tuple(p.shape) for p in module.parameters()] == (
        [(75, 40), (75,), (75, 40), (75,), (40, 75), (40,)] if bias else [(75, 40), (75, 40), (40, 75)])
    check_mlp(module, torch.randn(M, 40, dtype=dtype, device=device))
    # The padding stays zero: the padded width's extra gate/up rows and down columns.
    wd = module.down_proj.weight
    assert wd.as_strided((40, 128), (128, 1))[:, 75:].abs().max() == 0


def test_aligned_d_ff_keeps_plain_parameters_when_not_interleaved(device):
    # Rows of 64 and 128 float16 elements: whole 128-byte lines.
    module = autofuse.get_mlp(64, 128, dtype=torch.float16, device=device, interleaved=False)
    assert module.d_ff_run == 128 and all(p.is_contiguous() for p in module.parameters()) and not module.runs_pairs
    assert "interleaved=False" in repr(module)


@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "plain"])
def test_weight_rows_start_whole_lines_apart_at_the_sizes_they_run(interleaved, device):
    """d_model 48 and d_ff 80 are multiples of 16 (nothing padded, no copy of x), but rows of 96 and 160 bytes: the
    weights are held with rows 128 and 256 bytes apart (layout.LINE_BYTES), the parameters views of that storage."""
    module = autofuse.get_mlp(48, 80, activation="silu", dtype=torch.float16, device=device, interleaved=interleaved)
    assert module.d_ff_run == 80 and module.d_in_run == 48 and module.runs_pairs == interleaved
    step = 2 if interleaved else 1
    assert module.gate_proj.weight.stride() == module.up_proj.weight.stride() == (step * 64, 1)
    assert module.down_proj.weight.stride() == (128, 1)
    assert [tuple(p.shape) for p in module.parameters()] == [(80, 48), (80, 48), (48, 80)]
    check_mlp(module, torch.randn(5, 48, dtype=torch.float16, device=device))
    assert all(t.is_contiguous() for t in module.state_dict().values())


def test_gate_and_up_are_interleaved_by_default(device):
    module = autofuse.get_mlp(64, 128, dtype=torch.float16, device=device)
    assert _is_interleaved(module) and module.runs_pairs and module.d_ff_run == 128
    assert module.down_proj.weight.is_contiguous()  # aligned d_ff in whole lines: the down projection stays as it was


def test_state_dict_is_plain_and_round_trips(device):
    module = autofuse.get_mlp(24, 37, bias=True, dtype=torch.float32, device=device)
    state = module.state_dict()
    assert list(state) == ["gate_proj.weight", "gate_proj.bias", "up_proj.weight", "up_proj.bias",
                           "down_proj.weight", "down_proj.bias"]
    assert all(t.is_contiguous() for t in state.values())  # what safetensors needs
    torch.testing.assert_close(state["down_proj.weight"], module.down_proj.weight, rtol=0, atol=0)
    other = autofuse.get_mlp(24, 37, bias=True, dtype=torch.float32, device=device)
    other.load_state_dict(state)
    assert _is_padded(other)  # load_state_dict copies into the padded views
    x = torch.randn(5, 24, device=device)
    with torch.no_grad():
        torch.testing.assert_close(other(x), module(x), rtol=0, atol=0)


def test_padding_kept_through_to(device):
    module = autofuse.get_mlp(32, 45, activation="gelu_tanh", dtype=torch.float32, device=device)
    module = module.to(torch.bfloat16)
    assert module.down_proj.weight.dtype == torch.bfloat16 and _is_padded(module)
    check_mlp(module, torch.randn(9, 32, dtype=torch.bfloat16, device=device))


def test_replaced_or_edited_parameters_are_seen(device):
    module = autofuse.get_mlp(32, 45, dtype=torch.float32, device=device)
    x = torch.randn(6, 32, device=device)
    with torch.no_grad():
        module.down_proj.weight.mul_(2)  # an in-place edit of the view: still padded
        assert _is_padded(module)
        check_mlp(module, x)
        # A replaced parameter is a plain tensor: the module runs at d_ff on it, not on the old storage.
        module.down_proj.weight.data = torch.randn(32, 45, device=device) / 45**0.5
        check_mlp(module, x)
        assert module.d_ff_run == 45


def test_training_on_padded_parameters(device):
    module = autofuse.get_mlp(32, 45, activation="silu", dtype=torch.float32, device=device)
    x = torch.randn(7, 32, device=device, requires_grad=True)
    module(x).square().sum().backward()
    grads = [p.grad.clone() for p in module.parameters()] + [x.grad.clone()]
    x_ref = x.detach().clone().requires_grad_()
    params = [p.detach().clone().requires_grad_() for p in module.parameters()]
    eager_mlp(x_ref, *params, activation="silu").square().sum().backward()
    for got, want in zip(grads, [p.grad for p in params] + [x_ref.grad]):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_tuning_keys_use_the_width_that_runs():
    shape = MLPShape("odd", 512, 1001, "silu")
    assert ops.get("gated_up").dims(shape, 1)[0] == 1024
    assert ops.get("down").dims(shape, 1)[1] == 1024
    assert ops.get("mlp").dims(shape, 1)[0] == 1024
    odd = LinearShape("odd", 37, 45, "gelu_tanh")  # FusedLinear runs padded; FusedLinearFp8 as it is
    assert ops.get("linear").dims(odd, 17)[:2] == (64, 64) and ops.get("linear_fp8").dims(odd, 17)[:2] == (45, 37)
    assert ops.get("linear").dims(odd, 16)[:2] == (64, 37)  # x read as it is up to layout.UNPADDED_K_MAX_M rows


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "plain"])
@pytest.mark.parametrize("d_ff", [48, 45])
@pytest.mark.parametrize("d_model", [37, 40])
def test_odd_d_model_runs_on_padded_rows_and_correct(dtype, interleaved, d_ff, d_model, device):
    """A d_model that is not a multiple of 16 (37: rows not 16-byte aligned; 40: aligned, but not what Triton
    specialises a stride on): the gate and up weights get zero columns up to input_width(d_model) and x's rows are
    padded to match per call; the down projection's weight and bias get zero rows and it writes input_width(d_model)
    columns, of which the output is the first d_model."""
    module = autofuse.get_mlp(d_model, d_ff, activation="gelu_tanh", bias=True, dtype=dtype, device=device,
                              interleaved=interleaved)
    assert module.d_in_run == 64 and module.d_ff_run == run_width(d_ff)
    wg = module.gate_proj.weight
    assert wg.shape == (d_ff, d_model) and wg.stride() == ((2 if interleaved else 1) * 64, 1)
    x = torch.randn(3, 7, d_model, dtype=dtype, device=device)
    check_mlp(module, x)
    check_mlp(module, x[0, :1])
    rows = wg.as_strided((d_ff, 64), wg.stride())
    assert rows[:, d_model:].abs().max() == 0  # the padded columns stay zero
    wd, bd = module.down_proj.weight, module.down_proj.bias
    assert wd.shape == (d_model, d_ff) and bd.shape == (d_model,)
    assert wd.as_strided((64, run_width(d_ff)), wd.stride()).abs()[d_model:].max() == 0  # zero rows below d_model
    assert bd.as_strided((64,), (1,))[d_model:].abs().max() == 0
    with torch.no_grad():
        y = module(x)
    assert y.shape == (3, 7, d_model) and y.stride()[-2:] == (64, 1)  # a view of the [M, 64] output, no copy
    with torch.no_grad():
        module.up_proj.weight.mul_(-1)  # an edit of the view is seen
    check_mlp(module, x)
    state = module.state_dict()
    assert all(t.is_contiguous() for t in state.values()) and state["up_proj.weight"].shape == (d_ff, d_model)
    module = module.to(torch.float32)
    assert module.d_in_run == 64
    check_mlp(module, x.float())


def test_training_and_tuning_keys_with_an_odd_d_model(device):
    module = autofuse.get_mlp(37, 48, activation="silu", dtype=torch.float32, device=device)
    x = torch.randn(5, 37, device=device, requires_grad=True)
    module(x).square().sum().backward()
    x_ref = x.detach().clone().requires_grad_()
    params = [p.detach().clone().requires_grad_() for p in module.parameters()]
    eager_mlp(x_ref, *params, activation="silu").square().sum().backward()
    for got, want in zip([p.grad for p in module.parameters()] + [x.grad], [p.grad for p in params] + [x_ref.grad]):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    shape = MLPShape("odd", 1001, 512, "silu")
    assert ops.get("gated_up").dims(shape, 1)[1] == ops.get("gated_pairs").dims(shape, 1)[1] == 1024
    assert ops.get("down").dims(shape, 1)[0] == 1024  # its N: the down projection writes the padded d_model
    # Training runs d_model as it is (MLPPlan without d_in); inference's plan writes the padded d_model.
    assert MLPPlan(37, 48, "silu", False).problem("down", 5, torch.float32, torch.device(device)).n == 37
    assert MLPPlan(37, 48, "silu", False, d_in=64).problem("down", 5, torch.float32, torch.device(device)).n == 64


def _is_interleaved(module) -> bool:
    wg, wu = module.gate_proj.weight, module.up_proj.weight
    rows = mlp_strides(module.d_model, module.d_ff, wg.element_size())[0]  # whole 128-byte lines
    return (wg.stride() == wu.stride() == (2 * rows, 1) and wu.storage_offset() == rows
            and wg.untyped_storage().data_ptr() == wu.untyped_storage().data_ptr())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("d_ff", [72, 75])
def test_interleaved_layout_is_one_buffer_and_correct(dtype, bias, d_ff, device):
    module = autofuse.get_mlp(48, d_ff, activation="gelu", bias=bias, dtype=dtype, device=device, interleaved=True)
    assert _is_interleaved(module) and module.runs_pairs and module.d_ff_run == run_width(d_ff)
    if bias:
        bg, bu = module.gate_proj.bias, module.up_proj.bias
        assert bg.stride() == (2,) and bu.storage_offset() == 1
    check_mlp(module, torch.randn(13, 48, dtype=dtype, device=device))
    state = module.state_dict()
    assert all(t.is_contiguous() for t in state.values()) and state["gate_proj.weight"].shape == (d_ff, 48)


def test_interleaved_layout_survives_to_and_sees_edits(device):
    module = autofuse.get_mlp(32, 45, dtype=torch.float32, device=device, interleaved=True).to(torch.float16)
    assert _is_interleaved(module) and module.gate_proj.weight.dtype == torch.float16
    x = torch.randn(6, 32, dtype=torch.float16, device=device)
    with torch.no_grad():
        module.up_proj.weight.mul_(-1)  # an in-place edit of one view
        check_mlp(module, x)
        module.gate_proj.weight.data = torch.randn(45, 32, dtype=torch.float16, device=device) / 32**0.5
        check_mlp(module, x)  # a replaced parameter: the module runs on the parameters as they are
        assert not module.runs_pairs


def test_training_on_interleaved_parameters(device):
    module = autofuse.get_mlp(32, 48, activation="gelu_tanh", bias=True, dtype=torch.float32, device=device,
                              interleaved=True)
    x = torch.randn(7, 32, device=device, requires_grad=True)
    module(x).square().sum().backward()
    params = [p.detach().clone().requires_grad_() for p in module.parameters()]
    x_ref = x.detach().clone().requires_grad_()
    wg, bg, wu, bu, wd, bd = params
    eager_mlp(x_ref, wg, wu, wd, bg, bu, bd, activation="gelu_tanh").square().sum().backward()
    for p, ref in zip(list(module.parameters()) + [x], params + [x_ref]):
        torch.testing.assert_close(p.grad, ref.grad, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("pairs_faster", [True, False])
def test_gated_pairs_runs_where_checked_faster(pairs_faster, device, monkeypatch):
    # First-use checks on a fake timer (times as a GPU would report them; the interpreter's mean
    # nothing): gated_pairs at 1 or 3 ms, gated_up at 2, every library path at 5.
    monkeypatch.setenv("AUTOFUSE_CHECK", "1")
    resolve.invalidate()
    monkeypatch.setattr(checked, "interpreting", lambda: False)
    monkeypatch.setattr(evaluator.Evaluator, "library_ms", lambda self: {
        name: 5.0 for name in self.spec.library_for(self.key.activation, self.key.bias, self.key.residual)})
    real_evaluate = evaluator.Evaluator.evaluate
    times = {"gated_pairs": 1.0 if pairs_faster else 3.0, "gated_up": 2.0, "down": 2.0, "mlp": 100.0}

    def evaluate(self, config):
        record = real_evaluate(self, config)  # compiled, verified and timed for real
        return TrialRecord(config, record.status, times[self.key.op] if record.status == "ok" else None,
                           record.detail)
    monkeypatch.setattr(evaluator.Evaluator, "evaluate", evaluate)
    module = autofuse.get_mlp(40, 72, activation="silu", bias=True, dtype=torch.float32, device=device,
                              interleaved=True)
    ran = []
    pairs_module = importlib.import_module("autofuse.ops.gated_pairs")  # what op gated_pairs' run calls
    real_pairs = pairs_module.gated_pairs
    monkeypatch.setattr(pairs_module, "gated_pairs", lambda *a, **k: ran.append(1) or real_pairs(*a, **k))
    x = torch.randn(5, 40, device=device)
    # The checks run op gated_pairs too: resolve the table first, then count what the forwards run.
    assert set(module.config_for(5)) == ({"gated_pairs", "down"} if pairs_faster else {"gated_up", "down"})
    ran.clear()
    check_mlp(module, x)
    assert bool(ran) == pairs_faster
    check_mlp(module, x)  # the bound replay of the same table


@pytest.mark.parametrize("d_ff", [48, 45])
def test_a_training_forward_makes_the_parameters_plain_and_inference_lays_them_out_again(d_ff, device):
    # Optimizers expect dense parameters (CUDA's fused AdamW refuses views with gaps): a forward that
    # builds a graph gives the same parameter objects contiguous storage (plain, or at an odd d_ff the gate and up
    # weights as the first rows of the training layout's padded buffer), the next inference forward the
    # interleaved (and, for an odd d_ff, padded) layout back. Values never change on the way.
    module = autofuse.get_mlp(32, d_ff, activation="silu", bias=True, dtype=torch.float32, device=device)
    objects, values = list(module.parameters()), [p.detach().clone() for p in module.parameters()]
    assert _is_interleaved(module)
    x = torch.randn(9, 32, device=device)
    module(x).sum().backward()
    assert all(p.is_contiguous() for p in module.parameters()) and not module.runs_pairs
    assert list(module.parameters()) == objects and all(torch.equal(p, v) for p, v in zip(objects, values))
    assert all(p.grad is not None and p.grad.stride() == p.stride() for p in objects)
    with torch.no_grad():
        check_mlp(module, x)
    assert _is_interleaved(module) and module.runs_pairs and module.d_ff_run == run_width(d_ff)
    assert list(module.parameters()) == objects and all(torch.equal(p, v) for p, v in zip(objects, values))


def test_padded_rows_hold_a_weight_in_whole_16_by_16_blocks_of_zero_filled_storage():
    from autofuse.layout import padded_rows, padded_whole

    w = torch.randn(24, 72)  # float32: rows of 288 bytes, held 384 (three 128-byte lines) apart
    view = padded_rows(w)
    assert torch.equal(view, w) and view.stride() == (96, 1)
    whole = padded_whole(view)
    assert whole.shape == (32, 96) and not whole[24:].any() and not whole[:, 72:].any()
    assert padded_rows(torch.randn(24, 72, dtype=torch.bfloat16)).stride() == (128, 1)  # 144 bytes: two lines
    assert padded_rows(view) is view  # already held so
    aligned = torch.randn(32, 64)
    assert padded_rows(aligned) is aligned and padded_whole(aligned).shape == (32, 64)
    assert padded_whole(w) is None and padded_whole(view[1:]) is None  # rows off the storage's start


def test_two_padded_weights_stack_as_the_halves_of_one_storage():
    """stack_padded copies two weights into one zero-filled storage whose halves are padded_rows storages, each a
    padded_whole of its own; stacked_padded finds the joint [2 rows, width] storage, and nothing else."""
    from autofuse.layout import padded_rows, padded_whole, stack_padded, stacked_padded

    a, b = torch.randn(24, 72), torch.randn(24, 72)
    sa, sb = stack_padded(a, b)
    assert torch.equal(sa, a) and torch.equal(sb, b) and sb.storage_offset() == 32 * 96
    assert padded_whole(sb).shape == (32, 96) and padded_rows(sb) is sb
    joint = stacked_padded(sa, sb)
    assert joint.shape == (64, 96) and torch.equal(joint[:24, :72], a) and torch.equal(joint[32:56, :72], b)
    assert not joint[24:32].any() and not joint[56:].any() and not joint[:, 72:].any()
    assert stacked_padded(sb, sa) is None  # b's half before a's
    assert stacked_padded(padded_rows(a), padded_rows(b)) is None  # two storages
    assert stacked_padded(sa, stack_padded(a, b)[1]) is None
    assert padded_whole(sb[1:]) is None  # rows off a block's start


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("residual", [False, True], ids=["nores", "res"])
def test_a_linear_of_odd_sizes_runs_on_padded_storage_and_correct(dtype, bias, residual, device):
    """in_features 37 and out_features 45 (rows not 16-byte aligned): the weight and bias are views of zero-filled
    storage of 64 x 64 and 64, inference pads x's rows (and a residual's) with zeros and returns the first 45
    columns of the padded output, a view."""
    module = autofuse.get_linear(37, 45, bias=bias, activation="gelu_tanh", dtype=dtype, device=device)
    w = module.weight
    assert w.shape == (45, 37) and w.stride() == (64, 1)
    storage = w.as_strided((64, 64), (64, 1))
    assert storage[45:].abs().max() == 0 and storage[:, 37:].abs().max() == 0
    if bias:
        assert module.bias.as_strided((64,), (1,))[45:].abs().max() == 0
    x = torch.randn(3, 7, 37, dtype=dtype, device=device)
    r = torch.randn(3, 7, 45, dtype=dtype, device=device) if residual else None

    def check(x, r=None):
        with torch.no_grad():
            out = module(x, residual=r)
            args = (x, module.weight, module.bias, r, module.activation)
            assert_matches_reference(out, linear_reference(*args), eager_linear(*args))
        return out

    out = check(x, r)
    assert out.shape == (3, 7, 45) and out.stride()[-2:] == (64, 1)  # a view of the [M, 64] output
    check(x[0, :1], None if r is None else r[0, :1])  # M = 1: the GEMV
    with torch.no_grad():
        module.weight.mul_(-1)  # an edit of the view is seen
    check(x, r)
    state = module.state_dict()
    assert all(t.is_contiguous() for t in state.values()) and state["weight"].shape == (45, 37)
    module = module.to(torch.float32)
    assert module.weight.stride() == (64, 1)
    check(x.float(), None if r is None else r.float())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_padded_linear_reads_x_as_it_is_up_to_16_rows(dtype, device, monkeypatch):
    """in_features 37 (rows not 16-byte aligned) at M <= layout.UNPADDED_K_MAX_M: x is not copied into padded rows;
    the kernel or library path reads it as it is over the weight's first 37 columns of its padded storage, keyed at
    K = 37 and checked there; above, x's rows are padded and the key holds K = 64."""
    from autofuse.layout import UNPADDED_K_MAX_M, LinearLayout

    module = autofuse.get_linear(37, 45, bias=True, activation="gelu_tanh", dtype=dtype, device=device)
    padded = []
    pad_rows = LinearLayout.pad_rows
    monkeypatch.setattr(LinearLayout, "pad_rows", lambda self, t, width: padded.append(t.shape) or pad_rows(self, t,
                                                                                                            width))
    assert module._sizes_run(UNPADDED_K_MAX_M) == (37, 64) and module._sizes_run(UNPADDED_K_MAX_M + 1) == (64, 64)
    for M in (1, 2, UNPADDED_K_MAX_M, UNPADDED_K_MAX_M + 1):
        x = torch.randn(M, 37, dtype=dtype, device=device)
        with torch.no_grad():
            out = module(x)
            again = module(x)  # the bound launch (or the library call) after the first
        args = (x, module.weight, module.bias, None, module.activation)
        assert_matches_reference(out, linear_reference(*args), eager_linear(*args))
        assert torch.equal(out, again) and out.shape == (M, 45)
        assert padded == ([] if M <= UNPADDED_K_MAX_M else [(M, 37)] * 2), M
        padded.clear()


def test_a_linear_of_odd_sizes_trains_on_plain_parameters_and_sees_replaced_ones(device):
    module = autofuse.get_linear(37, 45, bias=True, activation="silu", dtype=torch.float32, device=device)
    x = torch.randn(5, 37, device=device, requires_grad=True)
    module(x).square().sum().backward()
    assert module.weight.is_contiguous() and module.weight.untyped_storage().nbytes() == 45 * 37 * 4
    x_ref = x.detach().clone().requires_grad_()
    w_ref, b_ref = (p.detach().clone().requires_grad_() for p in (module.weight, module.bias))
    torch.nn.functional.silu(torch.nn.functional.linear(x_ref, w_ref, b_ref)).square().sum().backward()
    for got, want in ((module.weight.grad, w_ref.grad), (module.bias.grad, b_ref.grad), (x.grad, x_ref.grad)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    with torch.no_grad():
        y = module(x)  # inference lays the parameters out again
    assert module.weight.stride() == (64, 1)
    expected = torch.nn.functional.silu(torch.nn.functional.linear(x, module.weight, module.bias))
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        module.weight.data = torch.randn(45, 37, device=device)  # replaced: runs as it is
        torch.testing.assert_close(module(x), torch.nn.functional.silu(
            torch.nn.functional.linear(x, module.weight, module.bias)), rtol=1e-5, atol=1e-5)


def test_a_linear_of_aligned_rows_runs_unpadded_and_pads_only_an_unaligned_size(device):
    """in_features 40 and out_features 88 are multiples of 8, not of 16: their rows are 16-byte aligned, and padding
    them would copy x every call for little (layout.linear_width), so the key holds the sizes as they are, the
    weight's rows held whole 128-byte lines apart (64 float32 elements); 40 -> 45 pads out_features alone, so x is
    never copied."""
    aligned = autofuse.get_linear(40, 88, bias=True, activation="gelu_tanh", dtype=torch.float32, device=device)
    assert (aligned._layout.k_run, aligned._layout.n_run) == (40, 88) and aligned.weight.stride() == (64, 1)
    assert ops.get("linear").dims(LinearShape("aligned", 40, 88, "gelu_tanh"), 1)[:2] == (88, 40)
    lined = autofuse.get_linear(64, 88, bias=True, activation="gelu_tanh", dtype=torch.float32, device=device)
    assert lined._layout is None and lined.weight.is_contiguous()  # rows of 256 bytes: plain
    one_side = autofuse.get_linear(40, 45, bias=True, activation="gelu_tanh", dtype=torch.float32, device=device)
    assert (one_side._layout.k_run, one_side._layout.n_run) == (40, 64) and one_side.weight.stride() == (64, 1)
    x = torch.randn(6, 40, device=device)
    for module in (aligned, one_side):
        with torch.no_grad():
            out = module(x)
        args = (x, module.weight, module.bias, None, module.activation)
        assert_matches_reference(out, linear_reference(*args), eager_linear(*args))


def test_pad_rows_appends_zero_columns_in_new_storage_at_every_m(device):
    from autofuse.layout import ZERO_BLOCK_MAX_M

    module = autofuse.get_linear(37, 45, bias=True, activation="gelu_tanh", dtype=torch.float32, device=device)
    layout = module._layout
    for M in (1, 7, ZERO_BLOCK_MAX_M, ZERO_BLOCK_MAX_M + 1):
        x = torch.randn(M, 37, device=device)
        for _ in range(2):  # the second call at an M reuses its zero block
            padded = layout.pad_rows(x, 64)
            assert padded.shape == (M, 64) and padded.is_contiguous()
            assert torch.equal(padded[:, :37], x) and padded[:, 37:].abs().max() == 0
            assert padded.data_ptr() != x.data_ptr()
    blocks = {key[0] for key in layout._zero_blocks}
    assert blocks == {1, 7, ZERO_BLOCK_MAX_M}  # none kept above ZERO_BLOCK_MAX_M rows
