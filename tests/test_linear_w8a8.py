"""The Linear with fp8 weights and activations (op linear_w8a8, autofuse/ops/linear_w8a8.py): each row of x quantized
inside the kernel exactly as quantize_rows quantizes it, so the kernel matches the float64 product of the quantized
values in every dtype, activation and variant with ragged N and K, bias and residual; bound launches bit-identical;
tuned and checked like any op, its error against the unquantized values reported beside."""

import pytest
import torch
from _helpers import DTYPES, assert_matches_reference

from autofuse import launch, ops, variants
from autofuse.activations import GATED_ACTIVATIONS, LINEAR_ACTIVATIONS
from autofuse.configs import KernelConfig
from autofuse.key import Problem, current_environment
from autofuse.ops.gated_up_fp8 import GATED_UP_W8A8, gated_up_w8a8
from autofuse.ops.linear_fp8 import FP8, FP8_MAX, dequantize_fp8, quantize_fp8, quantize_weight
from autofuse.ops.linear_w8a8 import (
    DOWN_W8A8,
    LINEAR_W8A8,
    dequantized_rows,
    linear_w8a8,
    quantize_rows,
    scaled_mm,
    scaled_mm_quantized,
)
from autofuse.ops.quantize_rows import launch_quantize_rows
from autofuse.reference import gated_reference, linear_reference
from autofuse.store import Store
from autofuse.tune.driver import Job, tune_key

M, N, K = 5, 24, 72  # ragged against every tile: N over 16 / 32 columns, K over 32
TILE = KernelConfig(16, 32, 32, group_m=4, num_warps=4, num_stages=2)
SPLIT = KernelConfig(16, 16, 32, group_m=1, num_warps=4, num_stages=2, variant="split_k", knobs={"split_k": 2})


def _operands(dtype, device, bias=True, residual=True):
    w8, scale = quantize_fp8(torch.randn(N, K, device=device) / K**0.5)
    x = torch.randn(M, K, device=device) * torch.logspace(-2, 1, M, device=device)[:, None]  # rows of all sizes
    x[2] = 0.0  # a row of zeros: scale 1, all zeros
    return (x.to(dtype), w8, scale, torch.randn(N, device=device).to(dtype) if bias else None,
            torch.randn(M, N, device=device).to(dtype) if residual else None)


def test_rows_are_quantized_to_e4m3_with_their_largest_magnitude_at_448():
    x = torch.randn(M, K) * torch.logspace(-3, 3, M)[:, None]
    x[1] = 0.0
    x8, scale = quantize_rows(x)
    assert x8.dtype == FP8 and scale.dtype == torch.float32 and scale[1] == 1.0
    assert torch.equal(x8.float().abs().amax(dim=1)[torch.arange(M) != 1], torch.full((M - 1,), FP8_MAX))
    back = dequantize_fp8(x8, scale, torch.float64)
    assert ((back - x.double()).abs() <= 2**-4 * x.double().abs() + 2**-9 * scale.double()[:, None]).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("activation", LINEAR_ACTIVATIONS)
@pytest.mark.parametrize("config", [TILE, SPLIT], ids=lambda c: c.variant)
def test_w8a8_linear_matches_the_float64_product_of_the_quantized_values(device, dtype, activation, config):
    for bias, residual in ((False, False), (True, True)):
        x, w8, scale, b, r = _operands(dtype, device, bias, residual)
        out = torch.full((M, N), float("nan"), dtype=dtype, device=device)
        linear_w8a8(x, w8, scale, b, r, activation, config, out=out)
        x8, sx = quantize_rows(x)
        ref = linear_reference(dequantize_fp8(x8, sx, torch.float64), dequantize_fp8(w8, scale, torch.float64), b, r,
                               activation)
        peer = LINEAR_W8A8.library["eager"]({"x": x, "w": w8, "s": scale, "b": b, "r": r}, activation)
        assert_matches_reference(out, ref, peer)


@pytest.mark.parametrize("config", [TILE, SPLIT], ids=lambda c: c.variant)
def test_bound_w8a8_linear_is_bit_identical_to_the_jit_path(device, config):
    x, w8, scale, b, _ = _operands(torch.bfloat16, device, residual=False)
    with launch.binding() as recorded:
        linear_w8a8(x, w8, scale, b, None, "silu", config)
    x = torch.randn(M, K, device=device).to(torch.bfloat16)
    y = torch.full((M, N), float("nan"), dtype=torch.bfloat16, device=device)
    assert recorded[0]({"x": x, "r": None, "y": y})
    tolerance = 2**-7 if variants.get(config.variant).workspace and y.is_cuda else 0  # GPU atomics: any order
    torch.testing.assert_close(y, linear_w8a8(x, w8, scale, b, None, "silu", config), rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("n, k", [(N, K), (32, 64)], ids=["ragged", "aligned"])
def test_its_library_paths_compute_the_same_quantized_product(device, n, k):
    x = torch.randn(M, k, device=device, dtype=torch.bfloat16)
    w8, scale = quantize_fp8(torch.randn(n, k, device=device) / k**0.5)
    b, r = (torch.randn(n, device=device, dtype=torch.bfloat16), torch.randn(M, n, device=device, dtype=torch.bfloat16))
    operands = {"x": x, "w": w8, "s": scale, "b": b, "r": r}
    assert list(LINEAR_W8A8.library_for("gelu", True, True)) == ["eager", "scaled_mm", "scaled_mm_unit"]
    x8, sx = quantize_rows(x)
    ref = linear_reference(dequantize_fp8(x8, sx, torch.float64), dequantize_fp8(w8, scale, torch.float64), b, r,
                           "gelu")
    for name in ("eager", "scaled_mm", "scaled_mm_unit"):
        if name != "eager" and x.is_cuda and k % 16:
            # torch._scaled_mm takes multiples of 16 only: the candidate says so in one line, and a check leaves
            # it out (test_a_library_candidate_that_cannot_run_a_key_is_left_out_of_its_check).
            with pytest.raises(ValueError, match="multiples of 16"):
                LINEAR_W8A8.library[name](operands, "gelu")
            continue
        out = LINEAR_W8A8.library[name](operands, "gelu")
        assert ((out.double() - ref).norm() / ref.norm()).item() < 4 * 2**-8, name


def test_a_library_candidate_that_cannot_run_a_key_is_left_out_of_its_check(device):
    from autofuse.evaluator import Evaluator

    def cannot(operands, activation):
        raise ValueError("not at these sizes")

    ops.register_library("linear_w8a8", "cannot_run", cannot)
    try:
        device = torch.device(device)
        key = Problem("linear_w8a8", N, K, M, torch.bfloat16, "gelu", True).key(M, current_environment(device))
        evaluator = Evaluator(key, M, device, budget_ms=5)
        try:
            times = evaluator.library_ms()
        finally:
            evaluator.close()
    finally:
        ops.unregister_library("linear_w8a8", "cannot_run")
    assert "eager" in times and "cannot_run" not in times
    # K = 72 too: torch._scaled_mm reads the weights' padded storage
    assert "scaled_mm" in times and "scaled_mm_unit" in times


def test_an_fp8_module_races_scaled_mm_at_every_size_over_its_padded_weights(device):
    import autofuse
    from autofuse.layout import padded_whole

    ragged = autofuse.get_linear(K, N, activation="gelu", dtype=torch.bfloat16, weights="w8a8", device=device)
    assert ragged._libraries(False) == {"linear": ("eager", "scaled_mm", "scaled_mm_unit")}
    mlp = autofuse.get_mlp(64, 72, activation="silu", dtype=torch.bfloat16, weights="w8a8", device=device)
    assert all("scaled_mm" in names for names in mlp._libraries(False).values())
    # [24, 72] held in zero-filled [32, 128] storage: what torch._scaled_mm (multiples of 16 only) multiplies.
    w8 = ragged.weight_fp8
    whole = padded_whole(w8)
    assert whole.shape == (32, 128) and torch.equal(whole[:N, :K].view(torch.uint8), w8.view(torch.uint8))
    assert not whole[N:].view(torch.uint8).any() and not whole[:, K:].view(torch.uint8).any()
    moved = ragged.to("cpu")  # a device move keeps the padded storage
    assert padded_whole(moved.weight_fp8) is not None
    unpadded, scale = quantize_fp8(torch.randn(N, K, device=device))
    assert padded_whole(unpadded) is None
    with pytest.raises(ValueError, match="multiples of 16"):
        scaled_mm_quantized(*launch_quantize_rows(torch.randn(M, K, device=device), 80), unpadded, scale,
                            torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_scaled_mm_over_padded_weights_matches_the_quantized_float64_product(device, dtype):
    """Both _scaled_mm paths over weights held in padded storage: rowwise scales in cuBLAS's epilogue, and unit
    scales with the scales, the bias, the activation and the residual applied in one pass (op scaled_bias_act)."""
    x = torch.randn(M, K, device=device, dtype=dtype)
    w8, scale = quantize_weight(torch.randn(N, K, device=device) / K**0.5)
    b, r = torch.randn(N, device=device, dtype=dtype), torch.randn(M, N, device=device, dtype=dtype)
    expected = dequantized_rows(x, torch.float64) @ dequantize_fp8(w8, scale, torch.float64).T
    # One bf16 rounding of a float32 accumulation: within 2**-8 of the largest output.
    if dtype == torch.bfloat16:
        y = scaled_mm(x, w8, scale)
        assert y.shape == (M, N)
        torch.testing.assert_close(y.double(), expected, rtol=0, atol=2**-8 * expected.abs().max().item())
    operands = {"x": x, "w": w8, "s": scale, "b": b, "r": r}
    unit = LINEAR_W8A8.library["scaled_mm_unit"](operands, "gelu")
    ref = linear_reference(dequantized_rows(x, torch.float64), dequantize_fp8(w8, scale, torch.float64), b, r, "gelu")
    assert unit.shape == (M, N) and unit.dtype == dtype
    # The unscaled products rounded once to bfloat16 (float32 for the other dtypes), then the result once more.
    assert ((unit.double() - ref).norm() / ref.norm()).item() < 2 * 2**-8


def test_a_w8a8_key_is_tuned_with_its_error_against_the_unquantized_values_reported(tmp_path, device):
    device = torch.device(device)
    key = Problem("linear_w8a8", N, K, M, torch.float16, "gelu", True).key(M, current_environment(device))
    store = Store(str(tmp_path))
    result = tune_key(Job(key, M, "w8a8"), store, device, policy="random", trials=3)
    assert result.new == 3 and not result.failures
    for trial in store.trials(key):
        against_reference, against_original = (float(w.rstrip(",")) for w in trial.detail.split() if w[0].isdigit())
        assert against_reference < 4 * 2**-11 < against_original < 2**-3  # x and W both rounded to e4m3
    assert ops.get("linear_w8a8").weights == "w8a8" and "fp8_activations" not in LINEAR_W8A8.__dict__


def test_get_linear_w8a8_runs_the_w8a8_op_and_matches_the_quantized_reference(device):
    import autofuse

    module = autofuse.get_linear(K, N, bias=True, activation="gelu", dtype=torch.float16, device=device,
                                 weights="w8a8")
    assert isinstance(module, autofuse.FusedLinearFp8) and "weights=w8a8" in repr(module)
    x = torch.randn(2, M, K, device=device, dtype=torch.float16)
    with torch.no_grad():
        out = module(x)
        again = module(x)  # the bound entry replays
    x8, sx = quantize_rows(x.reshape(-1, K))
    ref = linear_reference(dequantize_fp8(x8, sx, torch.float64),
                           dequantize_fp8(module.weight_fp8, module.weight_scale, torch.float64), module.bias, None,
                           "gelu").reshape(2, M, N)
    torch.testing.assert_close(out.double(), ref, rtol=2 * 2**-11, atol=2e-3)
    assert torch.equal(out, again)
    plan = module._plan(False, M)
    # K = 72 too: torch._scaled_mm multiplies the weights' padded storage
    assert plan.op == "linear_w8a8" and set(module._libraries(False)["linear"]) == {"eager", "scaled_mm",
                                                                                       "scaled_mm_unit"}
    with pytest.raises(autofuse.AutofuseError, match="weights must be one of 'dense', 'fp8', 'w8a8'"):
        autofuse.fuse(torch.nn.Sequential(), weights="int8")


def test_tune_weights_w8a8_tunes_the_linears_w8a8_keys(tmp_path):
    import json

    from click.testing import CliRunner

    from autofuse.cli import main

    shapes = tmp_path / "s.json"
    shapes.write_text(json.dumps({"dtype": "float16", "tokens": [M],
                                  "mlps": [{"name": "m", "d_model": K, "d_ff": N, "activation": "silu"}],
                                  "linears": [{"name": "l", "in_features": K, "out_features": N}]}))
    result = CliRunner().invoke(main, ["tune", "--shapes", str(shapes), "--weights", "w8a8", "--trials", "1"])
    assert result.exit_code == 0, result.output
    rows = [line.split()[:2] for line in result.output.splitlines() if line.startswith(("m ", "l "))]
    assert sorted(rows) == [["l", "linear_w8a8"], ["m", "down_w8a8"], ["m", "gated_up_w8a8"]]



# Gated MLPs with W8A8: op gated_up_w8a8 (x quantized per row, both dots fp8 x fp8), down_w8a8 (H quantized the same).

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("activation", GATED_ACTIVATIONS)
@pytest.mark.parametrize("config", [TILE, SPLIT], ids=lambda c: c.variant)
def test_w8a8_gated_up_matches_the_float64_product_of_the_quantized_values(device, dtype, activation, config):
    x = _operands(dtype, device)[0]
    wg, wu = (quantize_fp8(torch.randn(N, K, device=device) / K**0.5) for _ in range(2))
    for biases in ((None, None), tuple(torch.randn(N, device=device).to(dtype) for _ in range(2))):
        out = torch.full((M, N), float("nan"), dtype=dtype, device=device)
        gated_up_w8a8(x, wg, wu, *biases, activation, config, out=out)
        x8, sx = quantize_rows(x)
        ref = gated_reference(dequantize_fp8(x8, sx, torch.float64), *(dequantize_fp8(*w, torch.float64)
                                                                       for w in (wg, wu)), *biases, activation)
        operands = {"x": x, "wg": wg[0], "sg": wg[1], "wu": wu[0], "su": wu[1], "bg": biases[0], "bu": biases[1]}
        assert_matches_reference(out, ref, GATED_UP_W8A8.library["eager"](operands, activation))
        for name in ("scaled_mm", "scaled_mm_unit"):
            if x.is_cuda:  # K = 72: torch._scaled_mm takes multiples of 16 only, and says so
                with pytest.raises(ValueError, match="multiples of 16"):
                    GATED_UP_W8A8.library[name](operands, activation)
                continue
            scaled = GATED_UP_W8A8.library[name](operands, activation)
            assert ((scaled.double() - ref).norm() / ref.norm()).item() < 4 * 2**-8, name


def test_a_w8a8_mlp_runs_the_w8a8_ops_and_a_fused_model_generates(device):
    import transformers

    import autofuse

    mlp = autofuse.get_mlp(K, N, activation="silu", bias=False, dtype=torch.float32, device=device, weights="w8a8")
    x = torch.randn(M, K, device=device)
    with torch.no_grad():
        out = mlp(x)
    g, u, d = mlp.gate_proj, mlp.up_proj, mlp.down_proj
    h = GATED_UP_W8A8.library["eager"]({"x": x, "wg": g.weight_fp8, "sg": g.weight_scale, "wu": u.weight_fp8,
                                        "su": u.weight_scale}, "silu")
    expected = DOWN_W8A8.library["eager"]({"x": h, "w": d.weight_fp8, "s": d.weight_scale}, "none")
    torch.testing.assert_close(out, expected, rtol=1e-2, atol=1e-3)  # H rounded to e4m3 in both; rare ties apart
    assert set(mlp.config_for(M)) == {"gated_up", "down"} and mlp._plan(False, M).problem(
        "down", M, torch.float32, torch.device(device)).op == "down_w8a8"
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(config).to(device).eval()
    report = autofuse.fuse(model, verbose=False, weights="w8a8", norms=False)
    assert len(report.replaced) == 2 and all(what.endswith("silu w8a8") for _, what in report.replaced)
    ids = torch.randint(0, 128, (1, 5), device=device)
    assert model.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=0).shape == (1, 7)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("path, stacked", [("scaled_mm_unit", False), ("scaled_mm_unit_stacked", True),
                                           ("scaled_mm_unit_stacked", False)])
def test_the_unit_scaled_gated_up_matches_the_float64_product_of_the_quantized_values(device, dtype, bias, path,
                                                                                       stacked):
    """gated_up_w8a8's library paths scaled_mm_unit and scaled_mm_unit_stacked (one GEMM over the weights' joint
    storage where they are so held, else two) at sizes _scaled_mm takes, 100 rows padded to 112 in the storage: G and
    U unscaled, then the scales and the biases applied in one pass with act(G) * U (op scaled_gated_act)."""
    from autofuse.layout import stack_padded

    x = torch.randn(33, 64, device=device, dtype=dtype)
    wg, wu = (quantize_weight(torch.randn(100, 64, device=device) / 8) for _ in range(2))
    if stacked:
        (wg8, wu8) = stack_padded(wg[0], wu[0])
        wg, wu = (wg8, wg[1]), (wu8, wu[1])
    biases = tuple(torch.randn(100, device=device).to(dtype) for _ in range(2)) if bias else (None, None)
    operands = {"x": x, "wg": wg[0], "sg": wg[1], "wu": wu[0], "su": wu[1], "bg": biases[0], "bu": biases[1]}
    out = GATED_UP_W8A8.library[path](operands, "silu")
    x8, sx = quantize_rows(x)
    ref = gated_reference(dequantize_fp8(x8, sx, torch.float64), *(dequantize_fp8(*w, torch.float64) for w in (wg, wu)),
                          *biases, "silu")
    assert out.dtype == dtype and out.shape == (33, 100)
    # The unscaled products rounded once to bfloat16 (float32 for the other dtypes), then H once more.
    assert ((out.double() - ref).norm() / ref.norm()).item() < 2 * 2**-8


def _emulated_scaled_mm(a, b, scale_a, scale_b, out_dtype):
    """torch._scaled_mm's function in float64, for a CPU (where it does not run): (a s_a) @ (b s_b) in out_dtype."""
    return ((a.double() * scale_a.double()) @ (b.double() * scale_b.double())).to(out_dtype)


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_a_w8a8_mlp_holds_its_gate_and_up_weights_stacked_for_one_gemm(device, monkeypatch, bias):
    """FusedMLPFp8 keeps the gate and up projections' fp8 weights as the halves of one padded storage, through
    load_state_dict and moves, its state_dict unchanged; the stacked library path's one GEMM over it gives G and U
    equal to the two GEMMs' (torch._scaled_mm in float64 where there is no GPU)."""
    import autofuse
    from autofuse.layout import stacked_padded
    from autofuse.ops.gated_up_fp8 import unit_products

    mlp = autofuse.get_mlp(72, 100, activation="silu", bias=bias, dtype=torch.float32, device=device, weights="w8a8")
    g, u = mlp.gate_proj, mlp.up_proj
    assert stacked_padded(g.weight_fp8, u.weight_fp8) is not None
    state = mlp.state_dict()
    assert state["up_proj.weight_fp8"].shape == (100, 72) and state["up_proj.weight_fp8"].is_contiguous()
    other = autofuse.get_mlp(72, 100, activation="silu", bias=bias, dtype=torch.float32, device=device,
                             weights="w8a8")
    other.load_state_dict(state)
    other.half().to(device)
    assert stacked_padded(other.gate_proj.weight_fp8, other.up_proj.weight_fp8) is not None
    assert torch.equal(other.up_proj.weight_fp8.float(), u.weight_fp8.float())
    if device == "cpu":
        monkeypatch.setattr(torch, "_scaled_mm", _emulated_scaled_mm)
    operands = {"x": torch.randn(9, 72, device=device), "wg": g.weight_fp8, "sg": g.weight_scale,
                "wu": u.weight_fp8, "su": u.weight_scale, "bg": g.bias, "bu": u.bias}
    one, two = unit_products(operands, stacked=True), unit_products(operands, stacked=False)
    assert one[0].shape == two[0].shape == one[1].shape == (9, 100)
    # One GEMM or two: each output element the same dot product, equal on the CPU (float64, then one rounding); on a
    # GPU cuBLAS may pick another kernel for the wider GEMM, and Hopper's fp8 tensor cores keep partial sums in a
    # reduced precision (about 2^-13 relative), so the order of the 72 products' sums may show there.
    tolerance = 0.0 if device == "cpu" else 2**-10
    for stacked, apart in zip(one[:2], two[:2]):
        torch.testing.assert_close(stacked, apart, rtol=tolerance, atol=tolerance * apart.abs().amax().item())
    assert "scaled_mm_unit_stacked" in GATED_UP_W8A8.library_for("silu", bias, False)
