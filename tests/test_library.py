"""Library paths as choices: every op's library candidates are correct, the tuner picks
one exactly when it is timed faster than every kernel, and its record, config_for and the module say which."""

import pytest
import torch
from _helpers import DTYPES

import autofuse
from autofuse import ops
from autofuse.activations import GATED_ACTIVATIONS
from autofuse.choose import lookup as resolve
from autofuse.choose.winner import Outcome, choose_winner
from autofuse.configs import KernelConfig, Library
from autofuse.key import Problem, current_environment
from autofuse.reference import ERROR_BOUNDS, relative_error
from autofuse.store import Store, TrialRecord


def _operands(spec, n, k, M, bias, dtype, device):
    return spec.make_operands(n, k, M, bias, False, lambda *s: torch.randn(*s, device=device).to(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("activation", GATED_ACTIVATIONS)
@pytest.mark.parametrize("bias", [False, True])
def test_every_library_candidate_is_correct(device, dtype, activation, bias):
    for name in ("gated_up", "gated_pairs", "mlp", "linear", "down", "gated_bwd"):
        spec = ops.get(name)
        act = activation if activation in spec.activations else spec.activations[0]
        operands = _operands(spec, 72, 40, 5, bias, dtype, device)
        ref = spec.reference(operands, act, dtype)
        for candidate, run in spec.library_for(act, bias, False).items():
            with torch.no_grad():
                out = run(operands, act)
            # One rounding of the output (and of H, for the whole MLP) in the dtype: reference.ERROR_BOUNDS.
            assert out.shape == ref.shape and relative_error(out, ref) <= ERROR_BOUNDS[dtype], (name, candidate)
    assert list(ops.get("gated_up").library) == ["eager", "cublas_gated_act"]
    assert list(ops.get("gated_bwd").library) == ["eager", "cublas_gated_grad"]
    assert list(ops.get("gated_pairs").library) == ["eager", "cublas_pairs"]


@pytest.mark.parametrize("activation", GATED_ACTIVATIONS)
def test_the_cublas_backward_candidate_writes_its_results_in_place_as_it_runs_in_training(device, monkeypatch,
                                                                                          activation):
    """The tuner times op gated_bwd's candidates on one [M, 3F] result; cublas_gated_grad must fill it through
    its outputs, as the training step runs it, not through a concatenation copy that would make it look slower
    than it is there (it lost to the fused kernel in tuning by that copy's time)."""
    spec = ops.get("gated_bwd")
    operands = _operands(spec, 72, 40, 5, False, torch.float32, device)
    ref = spec.reference(operands, activation, torch.float32)

    def no_copy(*args, **kwargs):
        raise AssertionError("a concatenation or copy of the results")

    monkeypatch.setattr(torch, "cat", no_copy)
    monkeypatch.setattr(torch.Tensor, "copy_", no_copy)
    with torch.no_grad():
        out = spec.library["cublas_gated_grad"](operands, activation)
    assert relative_error(out, ref) <= ERROR_BOUNDS[torch.float32]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("activation", GATED_ACTIVATIONS)
def test_the_pairs_pass_reads_interleaved_gate_and_up_columns(dtype, activation, device):
    """Op pairs_act (cublas_pairs's one pointwise pass) over ragged edges: F not a multiple of its tile, G_j in
    column 2j and U_j in 2j + 1, written into a given output."""
    from autofuse.activations import TORCH_ACTIVATIONS
    from autofuse.ops.gated_act import pairs_activation

    M, F = 37, 72
    gu = (torch.randn(M, 2 * F, device=device) * 2).to(dtype)
    out = torch.full((M, F), float("nan"), dtype=dtype, device=device)
    h = pairs_activation(gu, activation, out=out)
    ref = TORCH_ACTIVATIONS[activation](gu.double()[:, 0::2]) * gu.double()[:, 1::2]
    eager = TORCH_ACTIVATIONS[activation](gu[:, 0::2]) * gu[:, 1::2]
    # One rounding of a float32 result to the dtype: at most eager's error (which rounds twice).
    assert h.data_ptr() == out.data_ptr() and relative_error(h, ref) <= relative_error(eager, ref) + 1e-7


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_down_projections_cublaslt_path_serves_keys_without_a_bias_and_is_correct(device, dtype):
    """library:cublaslt of op down: the GEMM through cuBLASLt where no bias takes cuBLASLt's epilogue already (on the
    CPU, torch.mm as it is), against the float64 reference, ragged sizes."""
    spec = ops.get("down")
    assert "cublaslt" in spec.library_for("none", False, False)
    assert "cublaslt" not in spec.library_for("none", True, False)
    assert "cublaslt" not in ops.get("linear").library_for("none", False, False)
    operands = _operands(spec, 72, 41, 5, False, dtype, device)
    with torch.no_grad():
        out = spec.library["cublaslt"](operands, "none")
    assert out.shape == (5, 72) and out.dtype == dtype
    assert relative_error(out, spec.reference(operands, "none", dtype)) <= ERROR_BOUNDS[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("residual", [False, True])
def test_the_cublaslt_epilogue_serves_gelu_tanh_with_a_bias_only_and_is_correct_there(device, dtype, residual):
    spec = ops.get("linear")
    assert "cublaslt_gelu_tanh" in spec.library_for("gelu_tanh", True, residual)
    for activation, bias in (("gelu", True), ("gelu_tanh", False), ("silu", True), ("none", True)):
        assert "cublaslt_gelu_tanh" not in spec.library_for(activation, bias, residual)
    assert "cublaslt_gelu_tanh" not in ops.get("down").library
    operands = spec.make_operands(72, 40, 5, True, residual, lambda *s: torch.randn(*s, device=device).to(dtype))
    with torch.no_grad():
        out = spec.library["cublaslt_gelu_tanh"](operands, "gelu_tanh")
    assert relative_error(out, spec.reference(operands, "gelu_tanh", dtype)) <= ERROR_BOUNDS[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_cublas_then_one_pass_serves_every_linear_with_work_after_the_gemm(device, dtype, residual, bias):
    """library:cublas_bias_act (cuBLAS without an epilogue, then op bias_act in place): correct for every activation
    with and without bias and residual; offered wherever a pass has work (not to a plain GEMM + bias, which eager's
    one addmm already is)."""
    spec = ops.get("linear")
    operands = spec.make_operands(72, 40, 5, bias, residual, lambda *s: torch.randn(*s, device=device).to(dtype))
    for activation in spec.activations:
        offered = "cublas_bias_act" in spec.library_for(activation, bias, residual)
        assert offered == (activation != "none" or residual), activation
        with torch.no_grad():
            out = spec.library["cublas_bias_act"](operands, activation)
        # The GEMM's output rounds once to the dtype before the pass, as eager's does before its activation:
        # within the bound both eager and the kernels meet (reference.ERROR_BOUNDS).
        assert relative_error(out, spec.reference(operands, activation, dtype)) <= ERROR_BOUNDS[dtype], activation


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("activation", ["none", "relu", "gelu", "gelu_tanh", "silu"])
def test_the_bias_pass_writes_over_its_input_with_ragged_edges_and_a_strided_residual(device, dtype, activation):
    """Op bias_act over M, N that are not multiples of its tile, a residual read through a transposed view: Y is
    overwritten (no second buffer) and every element is act(Y + b) + R after one rounding."""
    from autofuse.activations import TORCH_ACTIVATIONS
    from autofuse.launch import LaunchError
    from autofuse.ops.bias_act import bias_activation

    M, N = 37, 72
    y = (torch.randn(M, N, device=device) * 2).to(dtype)
    b = torch.randn(N, device=device).to(dtype)
    r = torch.randn(N, M, device=device).to(dtype).t()
    ref = TORCH_ACTIVATIONS[activation](y.double() + b.double()) + r.double()
    out = bias_activation(y, b, r, activation)
    # One rounding of a float32 result to the dtype, over a reference of order one: 2**-8 for bfloat16 (8 bits of
    # mantissa), 2**-11 for float16, float32's own rounding far below 1e-6.
    bound = {torch.float32: 1e-6, torch.float16: 2**-11, torch.bfloat16: 2**-8}[dtype]
    assert out.data_ptr() == y.data_ptr() and relative_error(out, ref) <= bound
    with pytest.raises(LaunchError, match="bias"):  # an autofuse bug, not a user's input: LaunchError
        bias_activation(y, b[:-1], None, activation)


def test_a_record_naming_a_library_candidate_its_key_cannot_use_is_refused():
    from autofuse.store import Winner

    key = Problem("linear", 72, 40, 4, torch.float32, "gelu", True).key(4, current_environment(torch.device("cpu")))
    record = Winner(key, Library("eager"), 1.0, 1.0).to_record()
    assert Winner.from_record(record).config == Library("eager")
    with pytest.raises(ValueError, match="no library candidate 'cublaslt_gelu_tanh'"):
        Winner.from_record({**record, "config": "library:cublaslt_gelu_tanh"})


def _choose(library_ms: dict, kernel_ms: float):
    """The tuner's winner rule on fake timings, as a GPU run applies it (interpreter timings mean nothing)."""
    key = Problem("gated_up", 72, 40, 4, torch.float32, "silu").key(4, current_environment(torch.device("cpu")))
    config = KernelConfig(16, 32, 32, group_m=1, num_stages=1)
    done = {config: TrialRecord(config, "ok", kernel_ms)}
    return choose_winner(key, Outcome(done, library_ms, config, 0.1), "random", times_mean_speed=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="builds its module on the CPU, under the interpreter")
def test_a_library_candidate_wins_exactly_when_it_is_timed_fastest():
    winner = _choose({"eager": 2.0, "cublas_gated_act": 1.0}, kernel_ms=3.0)
    assert winner.config == Library("cublas_gated_act") and winner.time_ms == 1.0
    assert winner.baseline_ms == 1.0  # the fastest library path is what a kernel must beat
    assert isinstance(_choose({"eager": 2.0, "cublas_gated_act": 1.0}, kernel_ms=0.5).config, KernelConfig)
    assert _choose({"eager": 1.0, "cublas_gated_act": 2.0}, kernel_ms=3.0).config == Library("eager")
    # Stored and resolved: the record names it, config_for says it, the module runs it.
    Store().put_winner(winner)
    assert Store().get_winner(winner.key).to_record()["config"] == "library:cublas_gated_act"
    resolve.invalidate()
    mlp = autofuse.get_mlp(40, 72, activation="silu", dtype=torch.float32, device="cpu")
    assert mlp.config_for(4)["gated_up"] == Library("cublas_gated_act")
    x = torch.randn(4, 40)
    with torch.no_grad():
        out = mlp(x)
    w = (mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)
    expected = torch.nn.functional.linear(torch.nn.functional.silu(x @ w[0].T) * (x @ w[1].T), w[2])
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
