"""Every template variant compiles for real GPUs (Hopper sm_90 and Ampere sm_80), checked on the CPU."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

_HERE = Path(__file__).parent


def _spec(op, activation, bias=False, residual=False, even_k=True, variant="tile", input_precision=None,
          static_k=None, grid_dependency=None):
    return dict(op=op, activation=activation, has_bias=bias, has_residual=residual, even_k=even_k,
                variant=variant, input_precision=input_precision, static_k=static_k, grid_dependency=grid_dependency)


# One case per structural switch of each template (activation, bias, residual, ragged K, split-K,
# float32 operands), at tile shapes the tuner uses for small and large M.
CASES = [
    dict(spec=_spec("linear", "gelu", bias=True, residual=True), dtype="bfloat16", capability=90,
         block=(128, 128, 64), split_k=1, num_warps=8, num_stages=4),
    dict(spec=_spec("linear", "none", even_k=False, variant="split_k"), dtype="bfloat16", capability=90,
         block=(16, 64, 128), split_k=8, num_warps=4, num_stages=4),
    dict(spec=_spec("linear", "relu", bias=True, input_precision="tf32"), dtype="float32", capability=90,
         block=(64, 64, 32), split_k=1, num_warps=4, num_stages=3),
    dict(spec=_spec("gated_up", "gelu_tanh"), dtype="bfloat16", capability=90,
         block=(128, 128, 64), split_k=1, num_warps=8, num_stages=3),
    dict(spec=_spec("gated_up", "silu", bias=True, even_k=False, variant="split_k"), dtype="float16", capability=90,
         block=(16, 64, 128), split_k=4, num_warps=4, num_stages=4),
    dict(spec=_spec("linear", "gelu", bias=True, residual=True, variant="tma"), dtype="bfloat16", capability=90,
         block=(128, 256, 64), split_k=1, num_warps=8, num_stages=4),
    dict(spec=_spec("gated_up", "gelu_tanh", variant="tma"), dtype="bfloat16", capability=90,
         block=(128, 128, 64), split_k=1, num_warps=8, num_stages=3),
    dict(spec=_spec("gated_up", "silu", bias=True, variant="tma", input_precision="tf32"), dtype="float32",
         capability=90, block=(64, 64, 32), split_k=1, num_warps=4, num_stages=3),
    dict(spec=_spec("mlp", "gelu_tanh"), dtype="bfloat16", capability=90,
         block=(16, 64, 128), split_k=1, num_warps=4, num_stages=4),
    dict(spec=_spec("mlp", "silu", bias=True, even_k=False), dtype="float16", capability=80,
         block=(32, 32, 64), split_k=1, num_warps=4, num_stages=3),
    dict(spec=_spec("gated_bwd", "gelu_tanh", even_k=False), dtype="bfloat16", capability=90,
         block=(128, 64, 64), split_k=1, num_warps=8, num_stages=3),
    dict(spec=_spec("gated_bwd", "silu", variant="tma"), dtype="bfloat16", capability=90,
         block=(128, 128, 64), split_k=1, num_warps=8, num_stages=4),
    dict(spec=_spec("gated_bwd", "gelu", variant="tma"), dtype="bfloat16", capability=90,
         block=(128, 256, 64), split_k=1, num_warps=8, num_stages=3),
    dict(spec=_spec("gated_act", "gelu"), dtype="bfloat16", capability=90,
         block=(4, 512, 0), split_k=1, num_warps=4, num_stages=1),
    dict(spec=_spec("gated_up", "gelu", variant="split_k"), dtype="bfloat16", capability=80,
         block=(64, 64, 64), split_k=2, num_warps=4, num_stages=3),
    dict(spec=_spec("gated_grad", "gelu_tanh"), dtype="bfloat16", capability=90,
         block=(4, 512, 0), split_k=1, num_warps=4, num_stages=1),
    dict(spec=_spec("bias_act", "gelu_tanh", bias=True, residual=True), dtype="bfloat16", capability=90,
         block=(4, 512, 0), split_k=1, num_warps=4, num_stages=1),
    dict(spec=_spec("gated_pairs", "gelu_tanh", variant="tma"), dtype="bfloat16", capability=90,
         block=(128, 256, 64), split_k=1, num_warps=8, num_stages=3),
    dict(spec=_spec("gated_pairs", "silu", bias=True, even_k=False, variant="split_k"), dtype="bfloat16", capability=80,
         block=(16, 64, 128), split_k=4, num_warps=4, num_stages=4),
    dict(spec=_spec("linear", "gelu", bias=True, residual=True, even_k=False, variant="gemv"), dtype="bfloat16",
         capability=90, block=(1, 16, 512), split_k=1, num_warps=4, num_stages=3),
    dict(spec=_spec("linear", "none", variant="gemv"), dtype="float16", capability=80,
         block=(8, 8, 128), split_k=4, num_warps=4, num_stages=2),
    dict(spec=_spec("gated_up", "silu", bias=True, variant="gemv"), dtype="bfloat16", capability=90,
         block=(4, 16, 256), split_k=2, num_warps=4, num_stages=3),
    # The GEMV compiled for one K (as the launchers build it): one K step past a ragged K, and a split loop.
    dict(spec=_spec("gated_up", "silu", even_k=False, variant="gemv", static_k=5568), dtype="bfloat16",
         capability=90, block=(1, 1, 8192), split_k=1, num_warps=16, num_stages=1),
    dict(spec=_spec("linear", "none", even_k=False, variant="gemv", static_k=14496), dtype="bfloat16",
         capability=90, block=(1, 4, 2048), split_k=4, num_warps=8, num_stages=1),
    # fp8 weights widened in the K loop, their scales in the epilogue (e4m3 needs sm_89 or newer).
    dict(spec=_spec("linear_fp8", "gelu_tanh", bias=True, residual=True), dtype="bfloat16", capability=90,
         block=(128, 128, 64), split_k=1, num_warps=8, num_stages=4),
    dict(spec=_spec("linear_fp8", "none", even_k=False, variant="split_k"), dtype="float16", capability=90,
         block=(16, 64, 128), split_k=4, num_warps=4, num_stages=3),
    dict(spec=_spec("linear_fp8", "silu", bias=True, variant="gemv"), dtype="bfloat16", capability=90,
         block=(1, 16, 1024), split_k=1, num_warps=4, num_stages=1),
    dict(spec=_spec("gated_up_fp8", "gelu_tanh", bias=True), dtype="bfloat16", capability=90,
         block=(128, 128, 64), split_k=1, num_warps=8, num_stages=3),
    dict(spec=_spec("gated_up_fp8", "silu", variant="gemv"), dtype="bfloat16", capability=90,
         block=(1, 8, 1024), split_k=2, num_warps=4, num_stages=1),
    dict(spec=_spec("down_fp8", "none", even_k=False, variant="split_k"), dtype="bfloat16", capability=90,
         block=(16, 64, 128), split_k=4, num_warps=4, num_stages=4),
    # W8A8: the activations quantized in the kernel, an fp8 x fp8 dot.
    dict(spec=_spec("linear_w8a8", "gelu_tanh", bias=True, residual=True), dtype="bfloat16", capability=90,
         block=(128, 128, 128), split_k=1, num_warps=8, num_stages=3),
    dict(spec=_spec("linear_w8a8", "none", even_k=False, variant="split_k", input_precision="tf32"),
         dtype="float32", capability=90, block=(64, 64, 64), split_k=2, num_warps=4, num_stages=3),
    dict(spec=_spec("gated_up_w8a8", "silu", bias=True), dtype="bfloat16", capability=90,
         block=(128, 128, 128), split_k=1, num_warps=8, num_stages=3),
    # Programmatic Dependent Launch between an MLP's steps: the up projection lets the next kernel start, the
    # Linear waits inside for the kernel before it.
    dict(spec=_spec("gated_up", "silu", even_k=False, variant="gemv", static_k=6304, grid_dependency="launch"),
         dtype="bfloat16", capability=90, block=(1, 1, 1024), split_k=1, num_warps=4, num_stages=1),
    dict(spec=_spec("gated_pairs", "gelu_tanh", grid_dependency="launch"), dtype="bfloat16", capability=90,
         block=(16, 64, 256), split_k=1, num_warps=4, num_stages=5),
    dict(spec=_spec("linear", "none", variant="split_k", grid_dependency="wait"), dtype="bfloat16", capability=90,
         block=(16, 64, 128), split_k=2, num_warps=4, num_stages=4),
    dict(spec=_spec("linear", "none", variant="tma", grid_dependency="wait"), dtype="bfloat16", capability=90,
         block=(128, 128, 64), split_k=1, num_warps=8, num_stages=4),
]


@pytest.fixture(scope="module")
def compiled():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, str(_HERE / "compile_for_gpu.py")], input=json.dumps(CASES),
                            capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line) for line in result.stdout.splitlines()]


def test_every_case_compiles_to_a_cubin(compiled):
    assert len(compiled) == len(CASES)
    for case in compiled:
        assert case["cubin_bytes"] > 0, case


def test_large_tiles_use_hopper_tensor_cores(compiled):
    # 16-bit 128-row tiles on sm_90 must lower to wgmma (the Hopper path), not mma.sync.
    big = [c for c in compiled if c["capability"] == 90 and c["block"][0] == 128 and c["dtype"] != "float32"]
    assert big and all(c["wgmma"] for c in big), big
    ampere = [c for c in compiled if c["capability"] == 80 and not c["kernel"].endswith("_gemv")]
    assert len(ampere) == 3 and all(c["mma"] and not c["wgmma"] for c in ampere), ampere


def test_gemv_kernels_reduce_on_cuda_cores(compiled):
    gemv = [c for c in compiled if c["kernel"].endswith("_gemv")]
    assert len(gemv) == 8 and not any(c["mma"] or c["wgmma"] or c["tma_loads"] for c in gemv), gemv


def test_split_k_kernels_are_named_for_profilers(compiled):
    assert {c["kernel"] for c in compiled if "mlp_" in c["kernel"]} == {
        "autofuse_mlp_decode_gelu_tanh", "autofuse_mlp_decode_silu_bias"}
    assert {c["kernel"] for c in compiled if "split_k" in c["kernel"]} == {
        "autofuse_linear_none_split_k", "autofuse_gated_up_silu_bias_split_k", "autofuse_gated_up_gelu_split_k",
        "autofuse_gated_pairs_silu_bias_split_k", "autofuse_linear_fp8w_none_split_k",  # down_fp8: the same kernel
        "autofuse_linear_w8a8_none_split_k"}


def test_tma_kernels_use_the_tensor_copy_engine(compiled):
    tma = [c for c in compiled if c["kernel"].endswith("_tma")]
    assert len(tma) == 7 and all(c["tma_loads"] for c in tma), tma
    assert not any(c["tma_loads"] for c in compiled if not c["kernel"].endswith("_tma"))


def test_w8a8_kernels_multiply_fp8_on_the_tensor_cores(compiled):
    w8a8 = [c for c in compiled if "_w8a8_" in c["kernel"]]
    assert len(w8a8) == 3 and all(c["fp8_mma"] and c["wgmma"] for c in w8a8), w8a8
    assert not any(c["fp8_mma"] for c in compiled if "_w8a8_" not in c["kernel"])  # weight-only: widened first


def test_dependent_launch_kernels_hold_the_grid_dependency_control_they_were_rendered_with(compiled):
    """griddepcontrol.wait in the Linears launched as dependents, before anything they read; launch_dependents in
    the up projections; neither anywhere else."""
    by_mode = {mode: [c for c, case in zip(compiled, CASES) if case["spec"]["grid_dependency"] == mode]
               for mode in (None, "launch", "wait")}
    assert len(by_mode["launch"]) == 2 and len(by_mode["wait"]) == 2
    assert all(c["grid_launch"] and not c["grid_wait"] for c in by_mode["launch"]), by_mode["launch"]
    assert all(c["grid_wait"] and not c["grid_launch"] for c in by_mode["wait"]), by_mode["wait"]
    assert not any(c["grid_wait"] or c["grid_launch"] for c in by_mode[None])
