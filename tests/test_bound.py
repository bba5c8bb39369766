"""Bound launches (launch.BoundLaunch) and the modules' bound tables (dispatch.BoundMLP / BoundLinear):
bit-identical to the JIT path for every kernel family and variant, and declining whatever needs
another specialization. Under the interpreter a bound launch replays its bound arguments through
the JIT function; on a GPU it calls the compiled kernel directly (tests/test_gpu.py)."""

import dataclasses

import pytest
import torch
from _helpers import DTYPES

import autofuse
from autofuse import launch, variants
from autofuse.bound import _DESCRIPTORS_KEPT, _keep
from autofuse.configs import KernelConfig
from autofuse.ops.gated_up import gated_up
from autofuse.ops.linear import linear
from autofuse.ops.mlp import mlp_decode

PLAIN = KernelConfig(16, 32, 32, group_m=4, num_warps=4, num_stages=2)
SPLIT = KernelConfig(16, 32, 16, group_m=1, num_warps=4, num_stages=2, variant="split_k", knobs={"split_k": 3})
TMA = KernelConfig(16, 32, 16, group_m=2, num_warps=4, num_stages=3, variant="tma")
GEMV = KernelConfig(8, 16, 32, group_m=1, num_warps=4, num_stages=2, variant="gemv", knobs={"split_k": 2})
M, K, N = 5, 48, 40


def _rand(*shape, dtype, device):
    return torch.randn(*shape, device=device).to(dtype)


def _assert_same(out, expected, atomic: bool):
    """Bit-identical, except where the kernel sums through float32 atomics on a GPU (split-K, the
    one-launch MLP): their order varies from launch to launch, so two JIT launches differ too, by
    at most one rounding of the output dtype (unit roundoff: float32 2**-24, float16 2**-11, bfloat16
    2**-8; the atol covers outputs near zero, whose partial sums cancel)."""
    if not atomic or not out.is_cuda:
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
        return
    u = {torch.float32: 2**-22, torch.float16: 2**-10, torch.bfloat16: 2**-7}[out.dtype]
    torch.testing.assert_close(out, expected, rtol=u, atol=u)


def _bound(run):
    """Run `run` (one launcher call) through the JIT while binding; return its output and the launch."""
    with launch.binding() as recorded:
        out = run()
    assert len(recorded) == 1 and recorded[0] is not None
    return out, recorded[0]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("config", [PLAIN, SPLIT, TMA, GEMV], ids=lambda c: c.short())
@pytest.mark.parametrize("bias, residual", [(False, False), (True, False), (True, True)])
def test_bound_linear_is_bit_identical_to_the_jit_path(device, dtype, config, bias, residual):
    w = _rand(N, K, dtype=dtype, device=device) / K**0.5
    b = _rand(N, dtype=dtype, device=device) if bias else None
    r = (lambda: _rand(M, N, dtype=dtype, device=device)) if residual else (lambda: None)
    _, bound = _bound(lambda: linear(_rand(M, K, dtype=dtype, device=device), w, b, r(), "gelu", config))
    for _ in range(2):  # fresh inputs each time: the bound launch must read the new ones
        x, res = _rand(M, K, dtype=dtype, device=device), r()
        y = torch.full((M, N), float("nan"), dtype=dtype, device=device)
        assert bound({"x": x, "r": res, "y": y})
        _assert_same(y, linear(x, w, b, res, "gelu", config), atomic=variants.get(config.variant).workspace)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("config", [PLAIN, SPLIT, TMA, GEMV], ids=lambda c: c.short())
def test_bound_gated_up_is_bit_identical_to_the_jit_path(device, dtype, config):
    wg, wu = (_rand(N, K, dtype=dtype, device=device) / K**0.5 for _ in range(2))
    bg, bu = (_rand(N, dtype=dtype, device=device) for _ in range(2))
    _, bound = _bound(lambda: gated_up(_rand(M, K, dtype=dtype, device=device), wg, wu, bg, bu, "silu", config))
    x = _rand(M, K, dtype=dtype, device=device)
    h = torch.full((M, N), float("nan"), dtype=dtype, device=device)
    assert bound({"x": x, "h": h})
    _assert_same(h, gated_up(x, wg, wu, bg, bu, "silu", config), atomic=variants.get(config.variant).workspace)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_bound_one_launch_mlp_is_bit_identical_to_the_jit_path(device, dtype):
    config = KernelConfig(16, 16, 32, group_m=1, num_warps=4, num_stages=1)
    F_ = 72
    wg, wu = (_rand(F_, K, dtype=dtype, device=device) / K**0.5 for _ in range(2))
    wd = _rand(K, F_, dtype=dtype, device=device) / F_**0.5
    bg, bu, bd = (_rand(n, dtype=dtype, device=device) for n in (F_, F_, K))
    params = (wg, bg, wu, bu, wd, bd)
    _, bound = _bound(lambda: mlp_decode(_rand(M, K, dtype=dtype, device=device), params, "gelu_tanh", config))
    x = _rand(M, K, dtype=dtype, device=device)
    y = torch.full((M, K), float("nan"), dtype=dtype, device=device)
    assert bound({"x": x, "y": y})  # its workspace was bound and is left zero by every launch
    _assert_same(y, mlp_decode(x, params, "gelu_tanh", config), atomic=True)


def test_a_bound_launch_declines_what_needs_another_specialization(device):
    w = torch.randn(N, K, device=device) / K**0.5
    _, bound = _bound(lambda: linear(torch.randn(M, K, device=device), w, None, None, "none", PLAIN))
    y = torch.empty(M, N, device=device)
    assert not bound({"x": torch.randn(K, M, device=device).t(), "y": y})  # other strides
    assert not bound({"x": torch.randn(M * K + 1, device=device)[1:].view(M, K), "y": y})  # not 16-byte aligned
    assert not bound({"x": torch.randn(M, K, device=device).half(), "y": y.half()})  # other dtype
    assert bound({"x": torch.randn(M, K, device=device), "y": y})
    with launch.binding() as recorded:  # unaligned rows at bind time: not bound at all
        linear(torch.randn(M * K + 1, device=device)[1:].view(M, K), w, None, None, "none", PLAIN)
    assert recorded == [None]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_launch_bound_over_the_halves_of_one_buffer_replays_at_those_strides_only(dtype, device):
    """A per-call tensor bound as a strided view (G and U, the halves of one [M, 2F] buffer) binds with its strides:
    the launch replays bit-identically over the halves of another such buffer, and declines a contiguous tensor of
    the same shape and halves of a wider buffer, whose strides the bound launch does not take."""
    from autofuse.ops.gated_act import gated_activation

    F_ = 72
    gu = torch.randn(M, 2 * F_, dtype=dtype, device=device)
    h, bound = _bound(lambda: gated_activation(gu[:, :F_], gu[:, F_:], "silu"))
    _assert_same(h, gated_activation(gu[:, :F_], gu[:, F_:], "silu"), atomic=False)
    other = torch.randn(M, 2 * F_, dtype=dtype, device=device)
    out = torch.full((M, F_), float("nan"), dtype=dtype, device=device)
    assert bound({"g": other[:, :F_], "u": other[:, F_:], "h": out})
    _assert_same(out, gated_activation(other[:, :F_], other[:, F_:], "silu"), atomic=False)
    g, u = other[:, :F_].contiguous(), other[:, F_:].contiguous()
    assert not bound({"g": g, "u": u, "h": out})  # contiguous: other strides than the bound halves'
    wider = torch.randn(M, 2 * F_ + 16, dtype=dtype, device=device)
    assert not bound({"g": wider[:, :F_], "u": wider[:, F_ + 16:], "h": out})


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_modules_replay_bound_launches_after_the_first_call(device, dtype, monkeypatch):
    replays = []
    real = launch.BoundLaunch.__call__
    monkeypatch.setattr(launch.BoundLaunch, "__call__", lambda self, t: replays.append(1) or real(self, t))
    mlp = autofuse.get_mlp(40, 72, activation="gelu_tanh", bias=True, dtype=dtype, device=device, tuned=False)
    lin = autofuse.get_linear(40, 56, activation="silu", dtype=dtype, device=device, tuned=False)
    x = torch.randn(5, 40, device=device).to(dtype)
    r = torch.randn(5, 56, device=device).to(dtype)
    with torch.no_grad():
        first = (mlp(x), lin(x, residual=r))
        assert replays == []  # the first call binds through the JIT
        second = (mlp(x), lin(x, residual=r))
        assert len(replays) == 3  # gated_up and down, then the Linear
        for a, b in zip(first, second):  # the heuristic splits K at these sizes on a GPU
            _assert_same(a, b, atomic=True)
        # Another M is another table entry: bound on its own first call, then replayed.
        x7 = torch.randn(7, 40, device=device).to(dtype)
        assert mlp(x7).shape == (7, 40) and len(replays) == 3
        _assert_same(mlp(x7), mlp.forward(x7), atomic=True)


def test_modules_bind_again_after_their_parameters_move(device):
    mlp = autofuse.get_mlp(40, 72, activation="silu", dtype=torch.float32, device=device, tuned=False)
    x = torch.randn(3, 40, device=device)
    with torch.no_grad():
        mlp(x)
        mlp(x)
        mlp.down_proj.weight = torch.nn.Parameter(torch.randn(40, 72, device=device) / 9)  # new storage
        expected = torch.nn.functional.linear(torch.nn.functional.silu(mlp.gate_proj(x)) * mlp.up_proj(x),
                                              mlp.down_proj.weight)
        torch.testing.assert_close(mlp(x), expected, rtol=1e-5, atol=1e-5)


def test_a_cache_import_is_seen_without_clearing_the_tables(device):
    from autofuse.choose import lookup as resolve
    from autofuse.key import Problem, current_environment
    from autofuse.store import Store, Winner

    lin = autofuse.get_linear(40, 56, activation="gelu", dtype=torch.float32, device=device)
    assert lin.config_sources(4) == {"linear": "heuristic"}
    imported = KernelConfig(16, 16, 16, group_m=1, num_stages=1)
    # 40 -> 56: rows of both sizes are 16-byte aligned, so it runs unpadded (layout.linear_width).
    key = Problem("linear", 56, 40, 4, torch.float32, "gelu", True).key(4, current_environment(torch.device(device)))
    Store().put_winner(Winner(key, imported, 1.0, 2.0))
    resolve.invalidate()  # what `autofuse cache import` and a tune in this process call
    assert lin.config_sources(4) == {"linear": "user-cache"} and lin.config_for(4) == {"linear": imported}
    with torch.no_grad():
        x = torch.randn(4, 40, device=device)
        expected = torch.nn.functional.gelu(torch.nn.functional.linear(x, lin.weight, lin.bias))
        torch.testing.assert_close(lin(x), expected, rtol=1e-5, atol=1e-5)


def test_an_empty_batch_first_leaves_the_one_row_entry_to_bind(device):
    # M=0 and M=1 share a table entry; the empty batch launches nothing, so it must not be kept as
    # the entry's (empty) bound launches.
    mlp = autofuse.get_mlp(40, 72, activation="silu", dtype=torch.float32, device=device, tuned=False)
    lin = autofuse.get_linear(40, 56, activation="gelu", dtype=torch.float32, device=device, tuned=False)
    x = torch.randn(1, 40, device=device)
    with torch.no_grad():
        assert mlp(x[:0]).shape == (0, 40) and lin(x[:0]).shape == (0, 56)
        for _ in range(2):  # binds, then replays
            expected = torch.nn.functional.linear(torch.nn.functional.silu(mlp.gate_proj(x)) * mlp.up_proj(x),
                                                  mlp.down_proj.weight)
            torch.testing.assert_close(mlp(x), expected, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(lin(x), torch.nn.functional.gelu(torch.nn.functional.linear(x, lin.weight,
                                                                                                   lin.bias)),
                                       rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_on_triton_3_6_a_bound_launch_calls_the_c_launcher_directly():
    """The direct launch (bound._RawLaunch) is built from Triton 3.6's launcher layout, checked field
    by field; were that layout to change in a 3.6 patch release, launches would quietly take the slower
    CompiledKernel.run path. This test says so instead, for both kinds of kernel (with and without TMA)."""
    import triton

    if not triton.__version__.startswith("3.6."):
        pytest.skip("the direct launch is built for Triton 3.6's launcher only")
    w = torch.randn(N, K, device="cuda") / K**0.5
    for config in (PLAIN, TMA):
        _, bound = _bound(lambda: linear(torch.randn(M, K, device="cuda"), w, None, None, "none", config))
        assert bound.raw is not None, config.short()
        x, y = torch.randn(2, M, K, device="cuda"), torch.empty(M, N, device="cuda")
        for rows in x:  # two addresses: a descriptor encoded for each
            assert bound({"x": rows, "y": y})
            torch.testing.assert_close(y, linear(rows, w, None, None, "none", config), rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("config", [PLAIN, TMA], ids=lambda c: c.short())
def test_a_bound_launch_keeps_nothing_of_its_first_calls_input_and_output(config):
    """Only weights stay bound: the first call's x and y (through its TMA descriptors, too) must be freed
    once the caller drops them, or every module would hold a prefill's activations for good."""
    import gc
    import weakref

    w = torch.randn(N, K, device="cuda") / K**0.5
    x, y = torch.randn(M, K, device="cuda"), torch.empty(M, N, device="cuda")
    with launch.binding() as recorded:  # no closure over x and y, which would keep them alive itself
        linear(x, w, None, None, "none", config, out=y)
    bound = recorded[0]
    assert bound is not None
    alive = [weakref.ref(x), weakref.ref(y)]
    del x, y
    gc.collect()
    assert [ref() is None for ref in alive] == [True, True]
    x2, y2 = torch.randn(M, K, device="cuda"), torch.empty(M, N, device="cuda")
    assert bound({"x": x2, "y": y2})  # and the launch still runs at new addresses
    torch.testing.assert_close(y2, linear(x2, w, None, None, "none", config), rtol=0, atol=0)


@pytest.mark.gpu
def test_launches_bound_on_a_side_stream_replay_on_another(monkeypatch):
    """CUDA-graph recipes warm a model up on a side stream: its launches are bound there, and later
    calls on the default stream must still replay them (not decline into the JIT every call), with
    neither H nor a split-K workspace shared between the streams."""
    results = []
    real = launch.BoundLaunch.__call__
    monkeypatch.setattr(launch.BoundLaunch, "__call__", lambda self, t: results.append(real(self, t)) or results[-1])
    mlp = autofuse.get_mlp(40, 72, activation="gelu_tanh", dtype=torch.float16, device="cuda", tuned=False)
    x = torch.randn(5, 40, device="cuda").half()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.no_grad():
        with torch.cuda.stream(side):
            first = mlp(x)  # binds
        torch.cuda.current_stream().wait_stream(side)
        second = mlp(x)  # replays on the default stream
    assert results and all(results)  # a split-K launch takes the default stream's own workspace
    _assert_same(second, first, atomic=True)


@pytest.mark.gpu
def test_a_split_k_launch_bound_on_one_stream_replays_on_another_with_its_own_workspace():
    from autofuse import workspaces

    w = torch.randn(N, K, device="cuda") / K**0.5
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _, bound = _bound(lambda: linear(torch.randn(M, K, device="cuda"), w, None, None, "none", SPLIT))
    torch.cuda.current_stream().wait_stream(side)
    x, y = torch.randn(M, K, device="cuda"), torch.empty(M, N, device="cuda")
    for _ in range(2):
        assert bound({"x": x, "y": y})
        _assert_same(y, linear(x, w, None, None, "none", SPLIT), atomic=True)
    default = workspaces.stream_id(torch.device("cuda"))
    assert list(bound.other_streams) == [default] and bound.stream != default


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_training_forward_replays_its_bound_launches(device, dtype, monkeypatch):
    """A module's training forward binds its two kernel launches (the pointwise H and the down
    projection) on the first step and replays them on the next, as the backward's pointwise pass replays
    its own (launch.pointwise_launch): the same outputs and gradients."""
    replays = []
    real = launch.BoundLaunch.__call__
    monkeypatch.setattr(launch.BoundLaunch, "__call__", lambda self, t: replays.append(real(self, t)) or replays[-1])
    mlp = autofuse.get_mlp(40, 72, activation="gelu_tanh", bias=True, dtype=dtype, device=device, tuned=False)
    x = torch.randn(5, 40, device=device).to(dtype)
    results = []
    for _ in range(2):
        mlp.zero_grad()
        xi = x.clone().requires_grad_()
        y = mlp(xi)
        y.float().square().sum().backward()
        results.append((y.detach(), xi.grad, mlp.down_proj.weight.grad.clone(), mlp.gate_proj.weight.grad.clone()))
    assert replays == [True] * 3  # the second step's three launches replayed: H, the down projection, dG and dU
    for a, b in zip(*results):
        _assert_same(a, b, atomic=True)
    # A new down projection weight: bound again, not replayed with the old address.
    mlp.down_proj.weight = torch.nn.Parameter(mlp.down_proj.weight.detach() * 2)
    from autofuse.training import _training_forward

    params = (mlp.gate_proj.weight, mlp.gate_proj.bias, mlp.up_proj.weight, mlp.up_proj.bias, mlp.down_proj.weight,
              mlp.down_proj.bias)
    with torch.no_grad():  # the same training forward through the JIT, unbound
        step = dataclasses.replace(mlp._training_step(5, params[0]), launches=None)
        _, _, expected = _training_forward(x, params, step, mlp.save_hidden, None, False)
    _assert_same(mlp(x.clone().requires_grad_()).detach(), expected, atomic=True)


def test_a_training_forward_over_one_pre_activation_buffer_replays_its_pass_bound(device, monkeypatch):
    """save_hidden=False keeps [G | U] as one buffer: the forward's pass reads its two halves, strided views, and
    replays bound on the next step like the two-buffer forward's (the JIT ran it on every step before)."""
    replays = []
    real = launch.BoundLaunch.__call__
    monkeypatch.setattr(launch.BoundLaunch, "__call__",
                        lambda self, t: replays.append((sorted(t), real(self, t))) or replays[-1][1])
    mlp = autofuse.get_mlp(48, 72, activation="silu", dtype=torch.float32, device=device, save_hidden=False,
                           tuned=False)
    x = torch.randn(5, 48, device=device)
    for _ in range(2):
        mlp(x.clone().requires_grad_()).sum().backward()
    assert (["g", "h", "u"], True) in replays and all(ok for _, ok in replays)


def test_memos_of_an_older_generation_are_dropped(device):
    """After a tune, an import or a first-use check (resolve.generation() moves) the memos keyed on the
    old generation would never be used again; they are dropped rather than keep H buffers and bound
    weights alive."""
    from autofuse import custom_ops
    from autofuse.choose import lookup as resolve

    mlp = autofuse.get_mlp(40, 72, activation="silu", dtype=torch.float32, device=device, tuned=False)
    x = torch.randn(5, 40, device=device)
    w = (mlp.gate_proj.weight, None, mlp.up_proj.weight, None, mlp.down_proj.weight, None)
    with torch.no_grad():
        mlp(x)
        torch.ops.autofuse.mlp(x, list(w), "silu", False)
        resolve.invalidate()
        mlp(x)
        torch.ops.autofuse.mlp(x, list(w), "silu", False)
    assert len(mlp._bound) == 1 and len(mlp._configs) == 1
    assert len(custom_ops._entries) == 1


def test_a_bound_launch_keeps_weights_but_nothing_of_the_binding_calls_operands():
    """What BoundLaunch.bind keeps of a launch's arguments (bound._without_per_call): the weight, and of the
    per-call x (a TMA descriptor) and y (a pointer) neither tensor, x's descriptor layout over its address."""
    import gc
    import weakref

    from triton.tools.tensor_descriptor import TensorDescriptor

    from autofuse.bound import _without_per_call

    x, y, w = torch.randn(M, K), torch.empty(M, N), torch.randn(N, K)
    address = x.data_ptr()
    args = [TensorDescriptor(x, [M, K], [K, 1], [16, 16]), y, w, 7]
    kept = _without_per_call(args, [(0, "x", True), (1, "y", False)])
    alive = {"x": weakref.ref(x), "y": weakref.ref(y), "w": weakref.ref(w)}
    del args, x, y
    gc.collect()
    assert {name: ref() is not None for name, ref in alive.items()} == {"x": False, "y": False, "w": True}
    assert kept[0].base.data_ptr() == address and list(kept[0].block_shape) == [16, 16]
    assert kept[1] is None and kept[2] is w and kept[3] == 7


def test_the_per_address_descriptor_cache_starts_over_when_full():
    # A decode loop's allocator cycles through a few addresses; an unbounded cache would grow with every
    # new one (bound._keep serves both the generic and the raw launch path).
    cache = {}
    for address in range(_DESCRIPTORS_KEPT):
        assert _keep(cache, (0, address), address) == address
    assert len(cache) == _DESCRIPTORS_KEPT
    _keep(cache, (0, 999), "new")
    assert cache == {(0, 999): "new"}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_pointwise_passes_replay_a_bound_launch_per_size_and_dtype(device, dtype, monkeypatch):
    """The library paths' pointwise passes (here pairs_act, cuBLAS's second half at decode) bind their launch
    on the first call of a size and replay it after, bit-identical to the JIT; a strided operand declines to
    the JIT; another dtype or size binds its own."""
    from autofuse.ops.bias_act import bias_activation
    from autofuse.ops.gated_act import pairs_activation

    monkeypatch.setattr(launch, "_memo", {})
    replays = []
    real = launch.BoundLaunch.__call__
    monkeypatch.setattr(launch.BoundLaunch, "__call__", lambda self, t: replays.append(real(self, t)) or replays[-1])
    gu = _rand(3, 2 * N, dtype=dtype, device=device)
    first = pairs_activation(gu, "silu")
    assert not replays and len(launch._memo) == 1

    def environment_read():
        raise AssertionError("a replayed pointwise pass read the environment")

    with monkeypatch.context() as patched:  # a replay builds its key without reading TRITON_INTERPRET
        patched.setattr(launch, "interpreting", environment_read)
        again = pairs_activation(gu.clone(), "silu")
    assert replays == [True]
    _assert_same(again, first, atomic=False)
    wide = _rand(3, 4 * N, dtype=dtype, device=device)
    wide[:, ::2] = gu
    strided = pairs_activation(wide[:, ::2], "silu")  # not contiguous: the bound launch declines
    assert replays == [True, False]
    _assert_same(strided, first, atomic=False)
    pairs_activation(_rand(4, 2 * N, dtype=dtype, device=device), "silu")  # another M: bound anew
    assert len(launch._memo) == 2
    # A bias is bound by address: a new bias binds again, never replays the old one's values.
    y = _rand(3, N, dtype=dtype, device=device)
    b1, b2 = _rand(N, dtype=dtype, device=device), _rand(N, dtype=dtype, device=device)
    for b in (b1, b2, b2):
        out = bias_activation(y.clone(), b, None, "none")
        _assert_same(out, (y.float() + b.float()).to(dtype), atomic=False)
    assert len(launch._memo) == 4
