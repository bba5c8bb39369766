"""Gated MLPs with fp8 weights: op gated_up_fp8 (and down_fp8, the fp8 linear kernel without activation) correct
against the float64 product of the dequantized weights in every dtype, activation and variant, with ragged sizes and
biases; get_mlp(weights="fp8") (FusedMLPFp8) running them through the same plan, checks and bound launches as the
dense MLP, loading a Hugging Face MLP's state_dict quantized."""

import pytest
import torch
from _helpers import DTYPES, assert_matches_reference

import autofuse
from autofuse import launch, ops, variants
from autofuse.activations import GATED_ACTIVATIONS
from autofuse.configs import KernelConfig
from autofuse.ops.gated_up_fp8 import gated_up_fp8
from autofuse.ops.linear_fp8 import FP8, dequantize_fp8, quantize_fp8
from autofuse.reference import gated_reference, mlp_reference

M, D, F_ = 5, 40, 24  # ragged against every tile
TILE = KernelConfig(16, 32, 32, group_m=4, num_warps=4, num_stages=2)
SPLIT = KernelConfig(16, 16, 16, group_m=1, num_warps=4, num_stages=2, variant="split_k", knobs={"split_k": 2})
GEMV = KernelConfig(8, 8, 16, group_m=1, num_warps=4, num_stages=1, variant="gemv", knobs={"split_k": 2})


def _weights(device, n=F_, k=D):
    return quantize_fp8(torch.randn(n, k, device=device) / k**0.5)


def _dense(pair):
    return pair[0].double() * pair[1].double()[:, None]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("activation", GATED_ACTIVATIONS)
@pytest.mark.parametrize("config", [TILE, SPLIT, GEMV], ids=lambda c: c.variant)
def test_fp8_gated_up_matches_the_dequantized_float64_product(device, dtype, activation, config):
    rows = 2 if config.variant == "gemv" else M
    x = torch.randn(rows, D, device=device).to(dtype)
    wg, wu = _weights(device), _weights(device)
    for biases in ((None, None), tuple(torch.randn(F_, device=device).to(dtype) for _ in range(2))):
        out = torch.full((rows, F_), float("nan"), dtype=dtype, device=device)
        gated_up_fp8(x, wg, wu, *biases, activation, config, out=out)
        ref = gated_reference(x, _dense(wg), _dense(wu), *biases, activation)
        operands = {"x": x, "wg": wg[0], "sg": wg[1], "wu": wu[0], "su": wu[1], "bg": biases[0], "bu": biases[1]}
        assert_matches_reference(out, ref, ops.get("gated_up_fp8").library["eager"](operands, activation))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("config", [TILE, SPLIT, GEMV], ids=lambda c: c.variant)
def test_every_e4m3_value_is_read_exactly_by_the_gated_up_projection(device, dtype, config):
    # The up matrix's row n holds byte n at column n % 16 and the gate matrix a one there: with x = ones, H's
    # element n is act(1) times byte n's value. A byte widened wrong (exponent, subnormal, sign) is off by far more
    # than the output's rounding (one unit in the last place of float16/bfloat16, 2**-8 relative at most).
    k = 16
    byte = torch.arange(256, dtype=torch.int32)
    byte[(byte == 0x7F) | (byte == 0xFF)] = 0  # the two NaN bytes, which quantize_fp8 never stores
    bits = torch.zeros(256, k, dtype=torch.uint8)
    bits[torch.arange(256), torch.arange(256) % k] = byte.to(torch.uint8)
    gate = torch.zeros(256, k)
    gate[torch.arange(256), torch.arange(256) % k] = 1.0
    ones = torch.ones(256, device=device)
    w_up = (bits.view(FP8).to(device), ones)
    w_gate = (gate.to(FP8).to(device), ones)
    x = torch.ones(2, k, device=device, dtype=dtype)
    h = gated_up_fp8(x, w_gate, w_up, None, None, "silu", config)
    expected = torch.nn.functional.silu(torch.ones((), dtype=torch.float64)) * w_up[0].double().sum(dim=1)
    assert (expected != 0).sum() == 252 and expected.abs().max() == 448 * expected[0x38]  # 0x38 is 1.0
    torch.testing.assert_close(h.double(), expected.expand(2, 256), rtol=2**-8, atol=0)


@pytest.mark.parametrize("config", [TILE, SPLIT, GEMV], ids=lambda c: c.variant)
def test_bound_fp8_gated_up_is_bit_identical_to_the_jit_path(device, config):
    wg, wu = _weights(device), _weights(device)
    with launch.binding() as recorded:
        gated_up_fp8(torch.randn(2, D, device=device).to(torch.bfloat16), wg, wu, None, None, "silu", config)
    x = torch.randn(2, D, device=device).to(torch.bfloat16)
    h = torch.full((2, F_), float("nan"), dtype=torch.bfloat16, device=device)
    assert recorded[0]({"x": x, "h": h})
    expected = gated_up_fp8(x, wg, wu, None, None, "silu", config)
    tolerance = 2**-7 if variants.get(config.variant).workspace and h.is_cuda else 0  # GPU atomics: any order
    torch.testing.assert_close(h, expected, rtol=tolerance, atol=tolerance)


def _mlp(device, dtype=torch.float32, **options):
    return autofuse.get_mlp(D, F_, activation="silu", bias=True, dtype=dtype, device=device, weights="fp8",
                            **options)


def test_an_fp8_mlp_runs_the_fp8_ops_and_matches_the_dequantized_reference(device):
    mlp = _mlp(device)
    assert set(mlp.state_dict()) == {f"{p}.{n}" for p in ("gate_proj", "up_proj", "down_proj")
                                     for n in ("weight_fp8", "weight_scale", "bias")}
    x = torch.randn(2, M, D, device=device)
    with torch.no_grad():
        out = mlp(x)
        again = mlp(x)  # the bound entry replays
    g, u, d = mlp.gate_proj, mlp.up_proj, mlp.down_proj
    ref = mlp_reference(x.reshape(-1, D), *(_dense((p.weight_fp8, p.weight_scale)) for p in (g, u, d)), g.bias,
                        u.bias, d.bias, activation="silu").reshape(2, M, D)
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-4)
    assert torch.equal(out, again)
    assert set(mlp.config_for(2 * M)) == {"gated_up", "down"}  # no gated_pairs, no one-launch kernel


def test_the_down_projection_reads_h_rows_16_elements_apart(device, monkeypatch):
    # d_ff = 24: H's rows are kept 32 elements apart (Triton vectorises loads along rows whose stride it sees
    # divisible by 16), in the first call, the bound replays and the un-bound path alike.
    from autofuse import dispatch
    strides = []
    run_down = dispatch.run_down
    monkeypatch.setattr(dispatch, "run_down", lambda h, *rest: strides.append(h.stride(0)) or run_down(h, *rest))
    mlp = _mlp(device)
    x = torch.randn(M, D, device=device)
    with torch.no_grad():
        first = mlp(x)
        again = mlp(x)
        other = mlp(torch.cat([x, x]))  # another M: its own entry
    assert strides and set(strides) == {32}
    assert torch.equal(first, again)
    torch.testing.assert_close(other[:M], first, rtol=1e-5, atol=1e-5)  # float32, other tiles: reordered sums


def test_a_hugging_face_mlp_state_loads_quantized_and_its_error_is_the_quantizations(device):
    dense = autofuse.get_mlp(D, F_, activation="silu", bias=True, dtype=torch.float32, device=device,
                             interleaved=False)
    mlp = _mlp(device, keep_original=True)
    mlp.load_state_dict({k: v for k, v in dense.state_dict().items()})  # gate_proj.weight, ...: quantized
    for name in ("gate_proj", "up_proj", "down_proj"):
        mine, theirs = getattr(mlp, name), getattr(dense, name)
        assert torch.equal(mine.weight, theirs.weight)
        assert torch.equal(mine.weight_fp8.view(torch.uint8), quantize_fp8(theirs.weight)[0].view(torch.uint8))
    x = torch.randn(M, D, device=device)
    with torch.no_grad():
        error = ((mlp(x) - dense(x)).norm() / dense(x).norm()).item()
    assert 0 < error < 2**-3  # e4m3's 3 mantissa bits, through two projections
    mlp.half()
    assert mlp.gate_proj.weight_fp8.dtype == FP8 and mlp.gate_proj.bias.dtype == torch.float16
    with torch.no_grad():
        assert mlp(torch.randn(M, D, device=device, dtype=torch.float16)).dtype == torch.float16


def test_an_fp8_mlp_refuses_training_and_options_it_cannot_take_in_one_line(device):
    mlp = _mlp(device)
    with pytest.raises(autofuse.AutofuseError, match="inference only"):
        mlp(torch.randn(M, D, device=device, requires_grad=True))
    with pytest.raises(autofuse.AutofuseError, match="weights must be one of"):
        autofuse.get_mlp(D, F_, device=device, weights="fp4")
    with pytest.raises(autofuse.AutofuseError, match="keep_original applies to fp8 weights only"):
        autofuse.get_mlp(D, F_, device=device, keep_original=True)
    with pytest.raises(autofuse.AutofuseError, match="FusedMLPFp8"):
        autofuse.FusedMLP(D, F_, bias=False, activation="silu", dtype=torch.float32, device=torch.device(device),
                          weights="fp8")
    weights = dequantize_fp8(mlp.down_proj.weight_fp8, mlp.down_proj.weight_scale, torch.float32)
    assert weights.shape == (D, F_)


def test_a_first_use_check_verifies_the_fp8_ops_before_they_run(device, monkeypatch):
    monkeypatch.setenv("AUTOFUSE_CHECK", "1")
    mlp = _mlp(device)
    lin = autofuse.get_linear(D, F_, activation="gelu", dtype=torch.float32, device=device, weights="fp8")
    with torch.no_grad():
        mlp(torch.randn(M, D, device=device))
        lin(torch.randn(M, D, device=device))
    assert mlp.config_sources(M) == {"gated_up": "checked", "down": "checked"}
    assert lin.config_sources(M) == {"linear": "checked"}


def test_tune_weights_fp8_tunes_the_fp8_ops_that_the_modules_then_run(tmp_path, device):
    import json

    from click.testing import CliRunner

    from autofuse.cli import main

    shapes = tmp_path / "s.json"
    shapes.write_text(json.dumps({"dtype": "float32", "tokens": [M],
                                  "mlps": [{"name": "m", "d_model": D, "d_ff": F_, "activation": "silu"}],
                                  "linears": [{"name": "l", "in_features": D, "out_features": F_}]}))
    result = CliRunner().invoke(main, ["tune", "--shapes", str(shapes), "--weights", "fp8", "--trials", "2"])
    assert result.exit_code == 0, result.output
    rows = [line.split()[:2] for line in result.output.splitlines() if line.startswith(("m ", "l "))]
    assert sorted(op for _, op in rows) == ["down_fp8", "gated_up_fp8", "linear_fp8"]
    mlp = autofuse.get_mlp(D, F_, activation="silu", dtype=torch.float32, device=device, weights="fp8")
    lin = autofuse.get_linear(D, F_, dtype=torch.float32, device=device, weights="fp8")
    assert set(mlp.config_sources(M).values()) == {"user-cache"} and lin.config_sources(M) == {"linear": "user-cache"}
    # The dense modules' keys were not tuned, and the formats do not mix.
    assert set(autofuse.get_linear(D, F_, dtype=torch.float32, device=device).config_sources(M).values()) != {
        "user-cache"}
    refused = CliRunner().invoke(main, ["tune", "--shapes", str(shapes), "--ops", "gated_up_fp8"])
    assert refused.exit_code == 2 and "gated_up_fp8 run(s) fp8 weights: add --weights fp8" in refused.output


def test_fuse_with_fp8_weights_quantizes_each_block_and_generate_runs(device):
    import transformers

    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(device).eval()
    ids = torch.randint(0, 128, (1, 7), device=device)
    with torch.no_grad():
        before = model(input_ids=ids).logits.double()
    dense_gate = model.model.layers[0].mlp.gate_proj.weight.detach().clone()
    report = autofuse.fuse(model, verbose=False, weights="fp8", norms=False)
    assert len(report.replaced) == 2 and all(what.endswith("silu fp8") for _, what in report.replaced)
    block = model.model.layers[0].mlp
    assert isinstance(block, autofuse.FusedMLPFp8)
    assert torch.equal(block.gate_proj.weight_fp8.view(torch.uint8), quantize_fp8(dense_gate)[0].view(torch.uint8))
    assert "model.layers.0.mlp.gate_proj.weight_fp8" in model.state_dict()
    assert "model.layers.0.mlp.gate_proj.weight" not in model.state_dict()
    with torch.no_grad():
        after = model(input_ids=ids).logits.double()
    error = ((after - before).norm() / before.norm()).item()
    assert 0 < error < 2**-3  # the MLP weights' e4m3 rounding, through two layers
    out = model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 10)
    with pytest.raises(autofuse.AutofuseError, match="weights must be one of"):
        autofuse.fuse(model, weights="int8")


def test_tune_model_tunes_fp8_blocks_for_their_ops(device, monkeypatch):
    from autofuse.tune import model as tune_model_module

    seen = []
    monkeypatch.setattr(tune_model_module, "tune_shapes", lambda shapes, device, trials: seen.append(shapes) or [1])
    model = torch.nn.Sequential(_mlp(device), autofuse.get_mlp(D, F_, activation="silu", dtype=torch.float32,
                                                                device=device))
    assert autofuse.tune_model(model, tokens=(1,)) == 2
    assert sorted(s.weights for s in seen) == ["dense", "fp8"] and all(s.dtype == torch.float32 for s in seen)


def test_under_torch_compile_fp8_modules_run_the_dequantized_weights_eager_ops(device):
    mlp = _mlp(device)
    lin = autofuse.get_linear(D, F_, activation="gelu", dtype=torch.float32, device=device, weights="w8a8")
    x = torch.randn(M, D, device=device)
    with torch.no_grad():
        compiled = torch.compile(mlp, backend="eager", fullgraph=True)(x)
        expected = ops.get("down_fp8").library["eager"]({
            "x": ops.get("gated_up_fp8").library["eager"]({
                "x": x, "wg": mlp.gate_proj.weight_fp8, "sg": mlp.gate_proj.weight_scale, "wu": mlp.up_proj.weight_fp8,
                "su": mlp.up_proj.weight_scale, "bg": mlp.gate_proj.bias, "bu": mlp.up_proj.bias}, "silu"),
            "w": mlp.down_proj.weight_fp8, "s": mlp.down_proj.weight_scale, "b": mlp.down_proj.bias}, "none")
        torch.testing.assert_close(compiled, expected)
        compiled_lin = torch.compile(lin, backend="eager", fullgraph=True)(x)
        operands = {"x": x, "w": lin.weight_fp8, "s": lin.weight_scale, "b": lin.bias}
        torch.testing.assert_close(compiled_lin, ops.get("linear_w8a8").library["eager"](operands, "gelu"))
    torch._dynamo.reset()


H100 = variants.Device(interpret=False, shared_memory_limit=232448, multiprocessors=132, capability=(9, 0))


@pytest.mark.parametrize("M", [1, 2, 16, 17])
def test_fp8_ops_run_their_own_decode_tiles_and_time_the_second_at_first_use(M):
    from autofuse.configs import Shape, shared_memory_bytes, split_k
    from autofuse.ops.gated_up import GATED_UP
    from autofuse.ops.linear import DOWN
    from autofuse.ops.linear_fp8 import DOWN_FP8

    gated_up = ops.get("gated_up_fp8")
    for n, k in ((14336, 4096), (4096, 14336), (896, 4864)):
        shape = Shape(M, n, k, torch.bfloat16)
        for fp8, dense in ((gated_up, GATED_UP), (DOWN_FP8, DOWN)):
            first, alternatives = fp8.default_config(shape, H100), fp8.alternative_configs(shape, H100)
            if M == 1 or M > 16:  # the GEMV's M (its first config is the heuristic's or beside it), above decode
                assert first == dense.default_config(shape, H100)
            if M > 16:
                assert alternatives == dense.alternative_configs(shape, H100)
                continue
            if M == 1:  # the GEMV's M: its configs load 8 bytes a thread a step with one byte a weight
                gemv = (first, *alternatives) if fp8 is gated_up else alternatives
                whole_k = 1 << (k - 1).bit_length()
                expected = [(1, 1024, 4), (1, 512, 4)] if fp8 is gated_up else [
                    (1, 1024, 4) if n * k >= 1 << 25 else (4, min(8192, whole_k), 8), (2, min(8192, whole_k), 4)]
                assert [(c.block_n, c.block_k, c.num_warps) for c in gemv] == expected
                assert all(c.variant == "gemv" for c in gemv)
                continue
            # Two alternatives for one matrix, three for the gate and up matrices, fewer where one is the same config
            # as another (a resident or balanced split that is the first's).
            most = 3 if fp8 is gated_up else 2
            assert 1 <= len(set(alternatives)) == len(alternatives) <= most and first not in alternatives
            assert fp8.search_starts(shape, H100)[:len(alternatives)] == alternatives  # a tuning run times them too
            for config in (first, *alternatives):
                assert config.block_m == 16 and config.variant in ("tile", "split_k")
                held = shared_memory_bytes(config, fp8.operand_tiles, torch.bfloat16, 1)  # one byte a weight
                assert held <= H100.shared_memory_limit
            for config in (first, alternatives[0]):  # as swept: counted with weights as wide as the activations
                assert shared_memory_bytes(config, fp8.operand_tiles, torch.bfloat16) <= H100.shared_memory_limit
            if fp8 is gated_up:  # the gate and up matrices: many output tiles, split over K only to fill waves
                assert all(c.variant == "tile" for c in (first, *alternatives[:2]))
                assert all(split_k(c) <= 4 for c in alternatives)
                assert first != dense.default_config(shape, H100)
            elif n == 4096:  # one narrow matrix split over K until its programs cover the SMs (first: twice)
                tiles = n // first.block_n
                assert first.knob("split_k") * tiles >= 2 * H100.multiprocessors
                assert alternatives[0].knob("split_k") * (n // alternatives[0].block_n) >= H100.multiprocessors
                # One: the most slices whose programs are all resident at once, 4 a SM of these tiles.
                assert any(c.knob("split_k") * (n // c.block_n) <= 4 * H100.multiprocessors
                           < (c.knob("split_k") + 1) * (n // c.block_n) for c in (first, *alternatives))
    if 2 <= M <= 16:  # 6480 -> 27640's down projection: 102 output tiles, 5 slices fill 528 resident programs
        assert DOWN_FP8.alternative_configs(Shape(M, 6480, 27640, torch.bfloat16), H100)[1].knob("split_k") == 5
        # Its gate and up matrices: 432 tiles of 64, one program an SM; 3 slices fill 10 waves of 132 all but 24
        # slots (98%), where 1 fills 4 waves 82%. 6272 -> 7104's 111 tiles fill every split's waves alike: no split.
        balanced = gated_up.alternative_configs(Shape(M, 27640, 6480, torch.bfloat16), H100)[2]
        assert (balanced.block_n, balanced.num_stages, balanced.knob("split_k")) == (64, 6, 3)
        assert len(gated_up.alternative_configs(Shape(M, 7104, 6272, torch.bfloat16), H100)) == 2
    wide = Shape(M, 14336, 4096, torch.float32)  # float32 activations: stages dropped until the tiles fit
    for config in (gated_up.default_config(wide, H100), *gated_up.alternative_configs(wide, H100)):
        assert shared_memory_bytes(config, gated_up.operand_tiles, torch.float32) <= H100.shared_memory_limit
    interpreter = variants.Device(interpret=True)
    shape = Shape(M, 4096, 14336, torch.bfloat16)
    assert DOWN_FP8.default_config(shape, interpreter) == DOWN.default_config(shape, interpreter)
    assert DOWN_FP8.alternative_configs(shape, interpreter) == ()
    w8a8 = ops.get("down_w8a8")  # fp8 activations too: a different kernel, not swept with these tiles
    assert w8a8.default_config(shape, H100) == DOWN.default_config(shape, H100)
