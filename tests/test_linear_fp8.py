"""The Linear with fp8 weights (op linear_fp8, autofuse/ops/linear_fp8.py): weights quantized per output channel,
the kernel correct against the float64 product of the dequantized weights in every dtype, activation and variant,
with ragged N and K, bias and residual; its bound launch bit-identical to its JIT launch; tuned like any op."""

import pytest
import torch
from _helpers import DTYPES, assert_matches_reference

import autofuse
from autofuse import launch, ops, variants
from autofuse.activations import LINEAR_ACTIVATIONS
from autofuse.configs import KernelConfig, Library
from autofuse.key import Problem, current_environment
from autofuse.layout import aligned_rows
from autofuse.ops.linear_fp8 import FP8, FP8_MAX, LINEAR_FP8, dequantize_fp8, linear_fp8, quantize_fp8
from autofuse.reference import linear_reference
from autofuse.render import KernelSpec, render
from autofuse.store import Store
from autofuse.tune.driver import Job, tune_key

M, N, K = 5, 24, 40  # ragged against every tile: N over 16 / 32 columns, K over 16 / 32
TILE = KernelConfig(16, 32, 32, group_m=4, num_warps=4, num_stages=2)
SPLIT = KernelConfig(16, 16, 16, group_m=1, num_warps=4, num_stages=2, variant="split_k", knobs={"split_k": 2})
GEMV = KernelConfig(8, 8, 16, group_m=1, num_warps=4, num_stages=1, variant="gemv", knobs={"split_k": 2})


def _operands(dtype, device, bias=True, residual=True, rows=M):
    w8, scale = quantize_fp8(torch.randn(N, K, device=device) / K**0.5)
    return (torch.randn(rows, K, device=device).to(dtype), w8, scale,
            torch.randn(N, device=device).to(dtype) if bias else None,
            torch.randn(rows, N, device=device).to(dtype) if residual else None)


def test_quantize_keeps_each_row_within_e4m3s_rounding():
    w = torch.randn(N, K) * torch.logspace(-3, 2, N)[:, None]  # rows of very different sizes
    w[3] = 0.0
    w8, scale = quantize_fp8(w)
    assert w8.dtype == FP8 and scale.dtype == torch.float32 and tuple(scale.shape) == (N,)
    assert scale[3] == 1.0 and not w8[3].float().any()  # a row of zeros stays zeros
    assert torch.equal(w8.float().abs().amax(dim=1)[torch.arange(N) != 3], torch.full((N - 1,), FP8_MAX))
    back = dequantize_fp8(w8, scale, torch.float64)
    # Round to nearest with 3 mantissa bits: within 2**-4 of each element, or e4m3's smallest step near zero.
    assert ((back - w.double()).abs() <= 2**-4 * w.double().abs() + 2**-9 * scale.double()[:, None]).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("activation", LINEAR_ACTIVATIONS)
@pytest.mark.parametrize("config", [TILE, SPLIT, GEMV], ids=lambda c: c.variant)
def test_fp8_linear_matches_the_dequantized_float64_product(device, dtype, activation, config):
    rows = 2 if config.variant == "gemv" else M
    for bias, residual in ((False, False), (True, True)):
        x, w8, scale, b, r = _operands(dtype, device, bias, residual, rows)
        out = torch.full((rows, N), float("nan"), dtype=dtype, device=device)
        linear_fp8(x, w8, scale, b, r, activation, config, out=out)
        ref = linear_reference(x, w8.double() * scale.double()[:, None], b, r, activation)
        peer = ops.get("linear_fp8").library["eager"]({"x": x, "w": w8, "s": scale, "b": b, "r": r}, activation)
        assert_matches_reference(out, ref, peer)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("config", [TILE, SPLIT, GEMV], ids=lambda c: c.variant)
def test_every_e4m3_value_is_read_exactly(device, dtype, config):
    # Row n holds byte n at column n % 16 and zeros elsewhere: x = ones reads each byte back alone, so the output
    # is its value exactly in every dtype (e4m3 fits float16's and bfloat16's grids: subnormals, zeros and signs
    # included), whichever way the kernel widens the weights to x's type. The two NaN bytes, which quantize_fp8
    # never stores, are left out.
    k = 16
    byte = torch.arange(256, dtype=torch.int32)
    byte[(byte == 0x7F) | (byte == 0xFF)] = 0
    bits = torch.zeros(256, k, dtype=torch.uint8)
    bits[torch.arange(256), torch.arange(256) % k] = byte.to(torch.uint8)
    w8 = bits.view(FP8).to(device)
    x = torch.ones(2, k, device=device, dtype=dtype)
    y = linear_fp8(x, w8, torch.ones(256, device=device), None, None, "none", config)
    expected = w8.float().sum(dim=1).to(dtype)
    assert expected[0x08] == 2**-6 and expected[0x01] == 2**-9 and expected[0xFE] == -448  # normal, subnormal, largest
    torch.testing.assert_close(y, expected.expand(2, 256), rtol=0, atol=0)


@pytest.mark.parametrize("config", [TILE, SPLIT, GEMV], ids=lambda c: c.variant)
def test_bound_fp8_linear_is_bit_identical_to_the_jit_path(device, config):
    dtype = torch.bfloat16
    x, w8, scale, b, _ = _operands(dtype, device, residual=False, rows=2)
    with launch.binding() as recorded:
        linear_fp8(x, w8, scale, b, None, "gelu_tanh", config)
    bound = recorded[0]
    for _ in range(2):  # fresh inputs: the bound launch reads the new ones
        x = torch.randn(2, K, device=device).to(dtype)
        y = torch.full((2, N), float("nan"), dtype=dtype, device=device)
        assert bound({"x": x, "r": None, "y": y})
        expected = linear_fp8(x, w8, scale, b, None, "gelu_tanh", config)
        if variants.get(config.variant).workspace and y.is_cuda:  # float32 atomics sum in any order on a GPU
            torch.testing.assert_close(y, expected, rtol=2**-7, atol=2**-7)
        else:
            torch.testing.assert_close(y, expected, rtol=0, atol=0)


def test_the_kernel_widens_fp8_weights_and_scales_in_the_epilogue():
    source = render(KernelSpec(LINEAR_FP8, "gelu", True, False, True, None, False, "tile"))
    assert "def autofuse_linear_fp8w_gelu_bias(" in source and "s_ptr" in source
    assert "w = _widen_e4m3(w, x)" in source and "acc *= tl.load(s_ptr + cols)[None, :]" in source
    assert "mul.rn.bf16x2" in source  # to bfloat16 by bit moves, not a conversion per weight
    assert source.index("acc *= tl.load(s_ptr") < source.index("acc += tl.load(b_ptr")  # scaled before the bias
    dense = render(KernelSpec(ops.get("linear"), "gelu", True, False, True, None, False, "tile"))
    assert "s_ptr" not in dense and "_widen_e4m3" not in dense
    assert [v.name for v in variants.of(LINEAR_FP8)] == ["tile", "split_k", "gemv"]  # no TMA descriptors of fp8


def test_wrong_weights_are_refused_in_one_line(device):
    x, w8, scale, b, _ = _operands(torch.float16, device, residual=False)
    for w, s, what in ((w8.to(torch.float16), scale, "float8_e4m3fn"), (w8, scale.half(), "float32 scales"),
                       (w8[:, :-1], scale, "do not fit"), (w8, scale[:-1], "do not fit")):
        with pytest.raises(launch.LaunchError, match=what) as raised:
            linear_fp8(x, w, s, b, None, "none", TILE)
        assert "\n" not in str(raised.value)


def test_an_fp8_key_is_tuned_checked_against_float64_and_never_run_by_the_dense_paths(device, tmp_path):
    device = torch.device(device)
    key = Problem("linear_fp8", N, K, M, torch.float16, "gelu", True).key(M, current_environment(device))
    assert key.op == "linear_fp8"  # the weight format is the op's: never the dense Linear's records
    store = Store(str(tmp_path))
    result = tune_key(Job(key, M, "fp8"), store, device, policy="random", trials=3)
    assert result.new == 3 and not result.failures  # the heuristic's config and two picks, all correct
    # Each trial reports its error against the float64 reference (bounded) and against the weights before
    # quantization (the quantization's share: e4m3 keeps 3 mantissa bits).
    for trial in store.trials(key):
        numbers = [float(word.rstrip(",")) for word in trial.detail.split() if word[0].isdigit()]
        assert "against the weights before quantization" in trial.detail and len(numbers) == 2
        against_reference, against_original = numbers
        assert against_reference < against_original < 2**-4
    assert isinstance(result.winner.config, KernelConfig)  # the interpreter: the best kernel wins
    assert set(LINEAR_FP8.library_for("gelu", True, False)) == {"eager"}
    assert Library("eager") != result.winner.config


# The module: get_linear(weights="fp8").

def _module(device, dtype=torch.float16, **options):
    return autofuse.get_linear(K, N, bias=True, activation="gelu", dtype=dtype, device=device, weights="fp8",
                               **options)


def test_an_fp8_linear_runs_its_fp8_weights_and_matches_the_dequantized_reference(device):
    module = _module(device)
    assert not hasattr(module, "weight") and "weight_fp8" in dict(module.named_buffers())
    assert set(module.state_dict()) == {"weight_fp8", "weight_scale", "bias"}
    x = torch.randn(3, M, K, device=device, dtype=torch.float16)  # any leading shape
    r = torch.randn(3, M, N, device=device, dtype=torch.float16)
    with torch.no_grad():
        out = module(x, residual=r)
    assert out.shape == (3, M, N) and out.dtype == torch.float16
    dense = module.weight_fp8.double() * module.weight_scale.double()[:, None]
    ref = linear_reference(x.reshape(-1, K), dense, module.bias, r.reshape(-1, N), "gelu").reshape(3, M, N)
    torch.testing.assert_close(out.double(), ref, rtol=2 * 2**-11, atol=2e-3)
    assert set(module.config_for(3 * M)) == {"linear"}


def test_its_error_against_the_original_weights_is_the_quantizations(device):
    dense = autofuse.get_linear(K, N, bias=True, activation="gelu", dtype=torch.float32, device=device)
    module = _module(device, dtype=torch.float32, keep_original=True)
    module.load_state_dict(dense.state_dict())  # an nn.Linear-style state: quantized as it loads
    assert torch.equal(module.weight, dense.weight)
    x = torch.randn(M, K, device=device)
    with torch.no_grad():
        error = (module(x) - dense(x)).norm() / dense(x).norm()
    assert 0 < error < 2**-4  # e4m3 keeps 3 mantissa bits


def test_a_dense_state_dict_loads_quantized_and_dtype_changes_leave_the_fp8_weights(device):
    dense = torch.nn.Linear(K, N).to(device)
    module = _module(device, dtype=torch.float32)
    module.load_state_dict(dense.state_dict())
    w8, scale = quantize_fp8(dense.weight)
    assert torch.equal(module.weight_fp8.view(torch.uint8), w8.view(torch.uint8))
    assert torch.equal(module.weight_scale, scale) and torch.equal(module.bias, dense.bias)
    module.half()
    assert module.weight_fp8.dtype == FP8 and module.weight_scale.dtype == torch.float32
    assert module.bias.dtype == torch.float16
    with torch.no_grad():
        assert module(torch.randn(2, K, device=device, dtype=torch.float16)).dtype == torch.float16
    restored = _module(device)
    restored.load_state_dict(module.state_dict())  # an fp8 state loads as it is
    assert torch.equal(restored.weight_fp8.view(torch.uint8), module.weight_fp8.view(torch.uint8))


def test_an_fp8_linear_refuses_training_and_bad_options_in_one_line(device):
    module = _module(device)
    x = torch.randn(2, K, device=device, dtype=torch.float16, requires_grad=True)
    with pytest.raises(autofuse.AutofuseError, match="inference only"):
        module(x)
    with pytest.raises(autofuse.AutofuseError, match="weights must be one of"):
        autofuse.get_linear(K, N, device=device, weights="int4")
    with pytest.raises(autofuse.AutofuseError, match=r"unknown option\(s\) 'wieghts'; it takes tuned, weights"):
        autofuse.get_linear(K, N, device=device, wieghts="fp8")
    with pytest.raises(autofuse.AutofuseError, match="keep_original applies to fp8 weights only"):
        autofuse.get_linear(K, N, device=device, keep_original=True)
    with pytest.raises(autofuse.AutofuseError, match="keep_original=True"):
        module.requantize()
    kept = _module(device, keep_original=True)
    with torch.no_grad():
        kept.weight.mul_(2)
    kept.requantize()
    assert torch.allclose(kept.weight_scale, quantize_fp8(kept.weight)[1])


def test_fp8_rows_start_whole_128_byte_lines_apart_and_save_without_their_padding(device):
    module = _module(device)  # K = 40 fp8 bytes a row: 8-byte aligned
    w8 = module.weight_fp8
    assert tuple(w8.shape) == (N, K) and w8.stride() == (128, 1) and w8.data_ptr() % 16 == 0
    state = module.state_dict()
    assert state["weight_fp8"].is_contiguous() and state["weight_fp8"].untyped_storage().nbytes() == N * K
    restored = _module(device)
    restored.load_state_dict(state)
    assert restored.weight_fp8.stride() == (128, 1)
    assert torch.equal(restored.weight_fp8.view(torch.uint8), w8.view(torch.uint8))
    moved = module.to("cpu").to(device)
    assert moved.weight_fp8.stride() == (128, 1)
    x = torch.randn(M, K, device=device, dtype=torch.float16)
    with torch.no_grad():
        out = restored(x)
    ref = linear_reference(x, w8.double() * module.weight_scale.double()[:, None], module.bias, None, "gelu")
    torch.testing.assert_close(out.double(), ref, rtol=2 * 2**-11, atol=2e-3)  # fp16 output: 2 ulps, small values
    aligned = torch.randn(N, 32, device=device).to(FP8)
    assert aligned_rows(aligned) is aligned  # rows of a multiple of 16 bytes stay as they are


def test_split_k_slices_past_a_ragged_k_add_nothing(device):
    # K = 72 in blocks of 16 is 4 whole steps and a partial one; 4 slices of 2 blocks leave the last slice empty
    # (it starts past K). Only the slice that holds the partial step may run it.
    k = 72
    w8, scale = quantize_fp8(torch.randn(N, k, device=device) / k**0.5)
    x = torch.randn(2, k, device=device)
    config = KernelConfig(16, 16, 16, group_m=1, num_warps=4, num_stages=2, variant="split_k", knobs={"split_k": 4})
    out = linear_fp8(x, w8, scale, None, None, "none", config)
    ref = linear_reference(x, w8.double() * scale.double()[:, None], None, None, "none")
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)  # float32: reordered sums only
