"""The CPU suite's checks at real model sizes, compiled on a GPU. Skipped without one (gpu marker)."""

import pytest
import torch
from _helpers import DTYPES, TOLERANCES, assert_matches_reference

import autofuse
from autofuse.ops.linear import linear
from autofuse.ops.mlp import mlp_decode
from autofuse.reference import eager_linear, eager_mlp, linear_reference, mlp_reference_rounded

pytestmark = pytest.mark.gpu


def _floor(K):
    # float32 error of a K-long blocked sum: ~sqrt(K) * 2**-24 relative (8e-6 at K=16384); cuBLAS may
    # split K differently and land lower, so the ratio to its error means nothing below this.
    return K**0.5 * 2**-24


def _tolerances(dtype, K):
    if dtype != torch.float32:
        return TOLERANCES[dtype]
    # float32 sums of K=16384 products: blocked and cuBLAS summation orders differ by ~sqrt(K)*2**-24
    # relative to the sum's magnitude, and outputs near zero magnify that elementwise.
    return dict(rtol=1e-4, atol=1e-4) if K > 1024 else TOLERANCES[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("M", [1, 16, 4096])
@pytest.mark.parametrize("activation", ["gelu_tanh", "silu"])
def test_mlp_real_size(dtype, M, activation):
    module = autofuse.get_mlp(2048, 16384, activation=activation, dtype=dtype, device="cuda")
    x = torch.randn(M, 2048, dtype=dtype, device="cuda")
    g, u, d = module.gate_proj, module.up_proj, module.down_proj
    weights = (g.weight, u.weight, d.weight, g.bias, u.bias, d.bias)
    with torch.no_grad():
        out = module(x)
        ref = mlp_reference_rounded(x, weights, activation, dtype)
        assert_matches_reference(out, ref, eager_mlp(x, *weights, activation=activation), _tolerances(dtype, 16384),
                                 floor=_floor(16384))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("M", [1, 16, 4096])
def test_linear_real_size(dtype, M):
    module = autofuse.get_linear(4096, 16384, bias=True, activation="gelu", dtype=dtype, device="cuda")
    x = torch.randn(M, 4096, dtype=dtype, device="cuda")
    r = torch.randn(M, 16384, dtype=dtype, device="cuda")
    args = (x, module.weight, module.bias, r, "gelu")
    with torch.no_grad():
        out = module(x, residual=r)
        assert_matches_reference(out, linear_reference(*args), eager_linear(*args), _tolerances(dtype, 4096),
                                 floor=_floor(4096))


def test_forward_is_capturable_in_a_cuda_graph():
    module = autofuse.get_mlp(768, 2048, dtype=torch.bfloat16, device="cuda")
    x = torch.randn(16, 768, dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():
        expected = module(x)  # compiles outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = module(x)
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.testing.assert_close(out, module(x))
        assert not torch.equal(out, expected)


def _graph_matches_eager(run, x):
    """Capture run(x) in a CUDA graph, replay on new data, compare with an eager call."""
    with torch.no_grad():
        run(x)  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = run(x)
        for _ in range(3):  # several replays: the workspaces must come back to zero each time
            x.copy_(torch.randn_like(x))
            graph.replay()
            torch.testing.assert_close(out, run(x), rtol=2e-2, atol=2e-2)


def test_split_k_and_one_launch_mlp_are_capturable_in_a_cuda_graph():
    from autofuse.configs import KernelConfig

    w = torch.randn(2048, 16384, dtype=torch.bfloat16, device="cuda") / 128
    split = KernelConfig(16, 64, 128, num_warps=4, num_stages=4, variant="split_k", knobs={"split_k": 8})
    _graph_matches_eager(lambda x: linear(x, w, None, None, "none", split),
                         torch.randn(4, 16384, dtype=torch.bfloat16, device="cuda"))
    wg, wu = (torch.randn(2048, 768, dtype=torch.bfloat16, device="cuda") / 28 for _ in range(2))
    wd = torch.randn(768, 2048, dtype=torch.bfloat16, device="cuda") / 45
    fused = KernelConfig(16, 32, 256, group_m=1, num_warps=4, num_stages=3)
    _graph_matches_eager(lambda x: mlp_decode(x, (wg, None, wu, None, wd, None), "gelu_tanh", fused),
                         torch.randn(1, 768, dtype=torch.bfloat16, device="cuda"))


def test_gemv_steps_launched_as_dependents_match_plain_launches_in_and_out_of_a_cuda_graph():
    """At M = 1 on sm_90+ the up projection's GEMV lets the down projection's start early and the down projection
    waits inside (Programmatic Dependent Launch): the same results as the reference, graph-replayed or not, with a
    d_model the down projection runs padded."""
    from autofuse.choose.choice import Choice, Source
    from autofuse.configs import KernelConfig
    from autofuse.dispatch import run_mlp
    from autofuse.launch import addresses

    module = autofuse.get_mlp(1000, 2816, activation="silu", dtype=torch.bfloat16, device="cuda")
    gemv_up = KernelConfig(1, 1, 1024, group_m=1, num_warps=4, num_stages=1, variant="gemv", knobs={"split_k": 1})
    gemv_down = KernelConfig(1, 1, 512, group_m=1, num_warps=8, num_stages=1, variant="gemv", knobs={"split_k": 1})
    table = {"gated_up": Choice(gemv_up, Source.HEURISTIC), "down": Choice(gemv_down, Source.HEURISTIC)}
    params = module._layout.widen(module._params(), addresses(module._params()))
    x = torch.randn(1, 1000, dtype=torch.bfloat16, device="cuda")

    def run(x):
        padded = torch.nn.functional.pad(x, (0, module.d_in_run - 1000))
        return run_mlp(padded, params, "silu", table)[:, :1000]

    with torch.no_grad():
        ref = mlp_reference_rounded(x, (module.gate_proj.weight, module.up_proj.weight, module.down_proj.weight,
                                        None, None, None), "silu", x.dtype)
        assert_matches_reference(run(x), ref, eager_mlp(x, *module.parameters(), activation="silu"))
    _graph_matches_eager(run, x)


def test_a_linear_of_odd_sizes_runs_padded_in_and_out_of_a_cuda_graph():
    module = autofuse.get_linear(1001, 2731, bias=True, activation="gelu_tanh", dtype=torch.bfloat16, device="cuda")
    assert module.weight.stride() == (1024, 1)
    for M in (1, 16, 300):
        x = torch.randn(M, 1001, dtype=torch.bfloat16, device="cuda")
        r = torch.randn(M, 2731, dtype=torch.bfloat16, device="cuda")
        with torch.no_grad():
            args = (x, module.weight, module.bias, r, "gelu_tanh")
            assert_matches_reference(module(x, r), linear_reference(*args), eager_linear(*args))
        _graph_matches_eager(lambda x: module(x, r), x)


def test_tma_kernels_run_from_a_thread_that_never_touched_cuda():
    # Triton creates TMA descriptors through the driver, which needs a current context in the
    # launching thread; the tuner compiles in a worker thread, and so may a user's server.
    import threading

    from autofuse.configs import KernelConfig

    x = torch.randn(1024, 2048, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(4096, 2048, dtype=torch.bfloat16, device="cuda") / 45
    config = KernelConfig(128, 256, 64, num_warps=8, num_stages=3, variant="tma")
    result = {}

    def work():
        try:
            result["y"] = linear(x, w, None, None, "gelu", config)
            torch.cuda.synchronize()
        except Exception as e:  # reported below, in the test's thread
            result["error"] = e

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert "error" not in result, result.get("error")
    args = (x, w, None, None, "gelu")
    assert_matches_reference(result["y"], linear_reference(*args), eager_linear(*args))


def test_the_cublaslt_epilogue_computes_the_tanh_gelu():
    """library:cublaslt_gelu_tanh stands in for gelu_tanh only because cuBLASLt's GELU epilogue is the
    tanh approximation: in float32, where the two GELUs differ by far more than the rounding (about
    1e-4 relative here against about 1e-6), it must match tanh and not erf."""
    from autofuse import ops

    torch.manual_seed(0)
    x = torch.randn(77, 1000, device="cuda") * 2
    w = torch.randn(3000, 1000, device="cuda") / 1000**0.5
    b = torch.randn(3000, device="cuda")
    out = ops.get("linear").library["cublaslt_gelu_tanh"]({"x": x, "w": w, "b": b}, "gelu_tanh").double()
    z = torch.addmm(b.double(), x.double(), w.double().t())

    def error(approximate):
        ref = torch.nn.functional.gelu(z, approximate=approximate)
        return ((out - ref).norm() / ref.norm()).item()

    assert error("tanh") < 2e-5 < 5e-5 < error("none")


def test_the_down_projections_cublaslt_path_puts_the_preferred_blas_backend_back():
    """library:cublaslt switches PyTorch's preferred BLAS backend for its one GEMM: after it, and after a GEMM that
    raised inside it, the backend the caller had is in place again, and its product matches cuBLAS's."""
    from autofuse import ops

    run = ops.get("down").library["cublaslt"]
    before = torch._C._get_blas_preferred_backend()
    x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1024, 4096, device="cuda", dtype=torch.bfloat16) / 64
    out = run({"x": x, "w": w}, "none")
    assert torch._C._get_blas_preferred_backend() == before
    torch.testing.assert_close(out, torch.mm(x, w.t()), rtol=2e-2, atol=2e-2)  # bf16 rounding of another kernel
    with pytest.raises(RuntimeError):
        run({"x": x, "w": w[:, :100]}, "none")
    assert torch._C._get_blas_preferred_backend() == before


@pytest.mark.parametrize("n", [2048, 8192])
def test_graph_timing_scales_with_the_work(n):
    """timing.graph_median_ms, which ranks every tuning trial and first-use check: two back-to-back
    GEMMs must time about twice one, at a size where one replay holds a few calls (n=2048, tens of
    microseconds) and at one where it holds a single call (n=8192, milliseconds). Tiny kernels are
    left out: there a graph hides part of each launch, and twice the work rightly costs less than
    twice the time. Timed side by side (graph_side_by_side_ms, which graph_median_ms runs with one function), so
    that a clock drift between the two measurements does not move the ratio: timed one after the other after
    sixty GPU tests, the ratio once fell outside the bounds (H100) and passed alone three times in three."""
    from autofuse.timing import graph_median_ms, graph_side_by_side_ms

    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    assert graph_median_ms(lambda: a @ a) > 0
    times = graph_side_by_side_ms({"once": lambda: a @ a, "twice": lambda: (a @ a, a @ a)})
    assert 0 < times["once"] and 1.7 < times["twice"] / times["once"] < 2.3, times


@pytest.mark.parametrize("optimizer", ["fused", "foreach"])
def test_optimizers_step_an_interleaved_module_like_a_plain_one(optimizer):
    """Interleaved gate and up weights (the default layout) are strided views of one buffer, which CUDA's
    fused AdamW refuses (a parameter's strides must match its dense gradient's and state's): a training
    forward makes them plain first (FusedMLP._lay_out_plain), and the optimizers then step the module
    exactly as a plain one; the next inference forward interleaves them again."""
    torch.manual_seed(0)
    modules = [autofuse.get_mlp(64, 96, activation="silu", dtype=torch.float32, device="cuda", interleaved=i)
               for i in (True, False)]
    modules[1].load_state_dict(modules[0].state_dict())
    x = torch.randn(33, 64, device="cuda")
    for module in modules:
        opt = torch.optim.AdamW(module.parameters(), lr=1e-2, **{optimizer: True})
        for _ in range(3):
            module(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
    assert all(p.is_contiguous() for p in modules[0].parameters()) and not modules[0].runs_pairs
    for (name, a), b in zip(modules[0].state_dict().items(), modules[1].state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)
    with torch.no_grad():
        out = modules[0](x)
    assert modules[0].runs_pairs
    with torch.no_grad():
        torch.testing.assert_close(out, modules[1](x), rtol=1e-4, atol=1e-5)


def test_timing_leaves_no_cublas_workspace_per_measurement():
    """cuBLAS keeps a workspace per (handle, stream) for the life of the process: every measurement warms
    up on the caller's stream and captures on torch.cuda.graph's one capture stream (timing.captured), so a
    second, third ... measurement of a GEMM allocates nothing that outlives it (a new stream per measurement
    had kept 32 MiB each)."""
    from autofuse.timing import graph_median_ms, graph_side_by_side_ms

    a = torch.randn(512, 512, device="cuda", dtype=torch.bfloat16)
    graph_median_ms(lambda: a @ a)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    for _ in range(4):
        graph_median_ms(lambda: a @ a)
        graph_side_by_side_ms({"mm": lambda: a @ a, "addmm": lambda: torch.addmm(a, a, a)})
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before


def test_a_measurement_leaves_no_cublas_workspace_behind():
    """The workspaces cuBLAS kept for a measurement's streams (the caller's, and the capture stream's, 32 MiB on an
    H100) are freed when it ends: a first use's checks leave nothing allocated for the rest of the process."""
    from autofuse.timing import graph_median_ms, release_cublas_workspaces

    a = torch.randn(512, 512, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    release_cublas_workspaces()  # what earlier tests' cuBLAS calls left
    before = torch.cuda.memory_allocated()
    graph_median_ms(lambda: a @ a)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before


def test_gpu_time_with_the_host_ahead_excludes_the_host_and_says_when_it_cannot():
    """A call whose host time is far above its GPU time (a 2 ms host sleep beside a ~0.1 ms GEMM) reads as its GPU
    time alone, and twice the GEMMs read about twice that; a host that cannot stay ahead of the wait reads None."""
    import time

    from autofuse.tools.measure import gpu_median_ms, gpu_us_host_ahead

    a = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    gemm_us = gpu_median_ms(lambda: a @ a) * 1e3

    def slow_host(gemms: int):
        time.sleep(0.002)
        for _ in range(gemms):
            a @ a

    once, twice = gpu_us_host_ahead(lambda: slow_host(1), calls=4), gpu_us_host_ahead(lambda: slow_host(2), calls=4)
    assert once is not None and 0.5 * gemm_us < once < 2 * gemm_us < 2000, (once, gemm_us)
    assert 1.6 < twice / once < 2.4, (once, twice)
    calls = []

    def slower_each_time():  # the sizing run is fast, the measured one is not: the host falls behind the wait
        calls.append(1)
        time.sleep(0.001 if len(calls) <= 4 else 0.05)
        a @ a
    assert gpu_us_host_ahead(slower_each_time, calls=4) is None


def test_side_by_side_timing_ranks_by_the_work():
    from autofuse.timing import graph_side_by_side_ms

    a = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    times = graph_side_by_side_ms({"once": lambda: a @ a, "twice": lambda: (a @ a, a @ a)})
    assert 1.7 < times["twice"] / times["once"] < 2.3, times


def test_a_near_tie_between_gated_up_and_gated_pairs_is_timed_side_by_side(caplog):
    import logging

    from autofuse.choose import Choice
    from autofuse.choose.check import faster_of
    from autofuse.configs import Library
    from autofuse.key import Problem

    caplog.set_level(logging.INFO, logger="autofuse")
    up, pairs = Choice(Library("eager"), "checked", 1.0), Choice(Library("eager"), "checked", 1.05)
    problem = Problem("gated_up", 4096, 1024, 1024, torch.bfloat16, "silu", device=torch.device("cuda"))
    winner = faster_of(("gated_pairs", pairs), ("gated_up", up), problem)
    assert winner in ("gated_pairs", "gated_up") and "side by side" in caplog.text


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("d_ff", [1536, 1538], ids=["aligned", "padded"])
@pytest.mark.parametrize("form", ["one-buffer", "two-buffers", "three-nodes", "recompute-h"])
def test_every_form_of_a_training_step_gives_the_reference_gradients(form, d_ff, dtype):
    """Each form training.step_form can give a gated MLP's step (one [G | U] buffer at 1024 rows against d_model
    576; two buffers at 512 rows; three autograd nodes at 256 rows with the policy's GEMM-work floor at 0; H
    recomputed with save_hidden=False), compiled on a GPU: the output's gradients are the float64 reference's as
    closely as eager PyTorch's, at an aligned d_ff and at one that runs padded."""
    import dataclasses

    from test_backward import _check_grads, _grads, _mlp_fn, _mlp_params, _module_grads

    from autofuse import training
    from autofuse.choose.policy import current, use

    M = {"one-buffer": 1024, "two-buffers": 512, "three-nodes": 256, "recompute-h": 1024}[form]
    policy = dataclasses.replace(current(), host_bound_step_macs=0) if form == "three-nodes" else current()
    torch.manual_seed(0)
    with use(policy):
        module = autofuse.get_mlp(576, d_ff, activation="gelu_tanh", bias=True, dtype=dtype, device="cuda",
                                  save_hidden=form != "recompute-h")
        assert training.step_form(M, 576, training.row_width(d_ff), form != "recompute-h") == form
        x = torch.randn(M, 576, dtype=dtype, device="cuda")
        dy = torch.randn(M, 576, dtype=dtype, device="cuda")
        names = ["gate_w", "gate_b", "up_w", "up_b", "down_w", "down_b"]
        params = _mlp_params(module)
        got = _module_grads(module, x, dy, names)
    ref = _grads({k: v.double() for k, v in params.items()}, x.double(), _mlp_fn("gelu_tanh"), dy.double())
    _check_grads(got, ref, _grads(params, x, _mlp_fn("gelu_tanh"), dy), dtype)
