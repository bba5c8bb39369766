"""Backward through the fused modules: gradients of inputs, weights and biases against float64."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from _helpers import DTYPES, relative_error

import autofuse
from autofuse import launch
from autofuse.activations import GATED_ACTIVATIONS, LINEAR_ACTIVATIONS, TORCH_ACTIVATIONS
from autofuse.configs import KernelConfig, Library
from autofuse.ops import gated_bwd
from autofuse.ops.bias_act import BIAS_ACT
from autofuse.ops.gated_act import gated_activation
from autofuse.ops.gated_bwd import gated_backward, gated_backward_cublas, gated_backward_eager
from autofuse.ops.gated_grad import GATED_DGU, gated_from_dh, gated_gradient_kept

# Norm-relative error allowed for a gradient against float64. A gradient passes through several
# roundings in the dtype (the upstream gradient, dH, dG/dU, the GEMM outputs), each up to one unit
# roundoff: float32 allows for K-long float32 sums; 16-bit types for ~4-6 roundings of 2**-11
# (float16) or 2**-8 (bfloat16). The sharper check is against eager PyTorch's own gradient error.
GRAD_BOUNDS = {torch.float32: 1e-5, torch.float16: 6e-3, torch.bfloat16: 5e-2}
# Below this, a gradient's error against eager's says nothing: a short gradient (a bias of a few dozen
# elements) ends in one rounding to the dtype that neither path controls, up to half a unit roundoff
# (2**-12 float16, 2**-9 bfloat16); two correct orders of the same sums land anywhere below it.
ROUNDING = {torch.float32: 1e-6, torch.float16: 2**-12, torch.bfloat16: 2**-9}


def _check_grads(got: dict, ref: dict, eager: dict, dtype) -> None:
    assert got.keys() == ref.keys() == eager.keys()
    for name in got:
        assert got[name].dtype == dtype and got[name].shape == ref[name].shape, name
        err, eager_err = relative_error(got[name], ref[name]), relative_error(eager[name], ref[name])
        assert err <= GRAD_BOUNDS[dtype], f"{name}: error {err:.3g} > {GRAD_BOUNDS[dtype]:.3g} in {dtype}"
        assert err <= 1.25 * eager_err + ROUNDING[dtype], f"{name}: {err:.3g} vs eager {eager_err:.3g} ({dtype})"


def _grads(module_params: dict, x: torch.Tensor, fn, dy: torch.Tensor) -> dict:
    """Gradients of <fn(x, **params), dy> with respect to x and every parameter."""
    leaves = {"x": x.detach().clone().requires_grad_()}
    leaves.update({k: v.detach().clone().requires_grad_() for k, v in module_params.items() if v is not None})
    out = fn(leaves["x"], **{k: leaves.get(k) for k in module_params})
    out.backward(dy)
    return {k: v.grad for k, v in leaves.items()}


def _mlp_fn(activation):
    def fn(x, gate_w, gate_b, up_w, up_b, down_w, down_b):
        h = TORCH_ACTIVATIONS[activation](F.linear(x, gate_w, gate_b)) * F.linear(x, up_w, up_b)
        return F.linear(h, down_w, down_b)
    return fn


def _mlp_params(module):
    return dict(gate_w=module.gate_proj.weight, gate_b=module.gate_proj.bias, up_w=module.up_proj.weight,
                up_b=module.up_proj.bias, down_w=module.down_proj.weight, down_b=module.down_proj.bias)


def _module_grads(module, x, dy, names, residual=None):
    x = x.detach().clone().requires_grad_()
    module.zero_grad(set_to_none=True)
    out = module(x) if residual is None else module(x, residual=residual)
    out.backward(dy)
    grads = {"x": x.grad}
    grads.update({name: p.grad for name, p in zip(names, _param_tensors(module)) if p is not None})
    return grads


def _check_mlp_module_grads(module, x, dy, activation, dtype) -> None:
    """The module's gradients of x and every parameter against float64's and eager's (_check_grads)."""
    names = ["gate_w", "gate_b", "up_w", "up_b", "down_w", "down_b"]
    params = _mlp_params(module)
    got = _module_grads(module, x, dy, names)
    ref = _grads({k: v.double() for k, v in params.items()}, x.double(), _mlp_fn(activation), dy.double())
    eager = _grads(params, x, _mlp_fn(activation), dy)
    _check_grads(got, ref, eager, dtype)


def _param_tensors(module):
    if isinstance(module, autofuse.FusedMLP):
        return [module.gate_proj.weight, module.gate_proj.bias, module.up_proj.weight, module.up_proj.bias,
                module.down_proj.weight, module.down_proj.bias]
    return [module.weight, module.bias]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("activation", GATED_ACTIVATIONS)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_mlp_gradients(dtype, activation, bias, device):
    module = autofuse.get_mlp(40, 72, activation=activation, bias=bias, dtype=dtype, device=device)
    x = torch.randn(3, 13, 40, dtype=dtype, device=device)  # 3-D input, M = 39 rows
    dy = torch.randn(3, 13, 40, dtype=dtype, device=device)
    params = _mlp_params(module)
    names = ["gate_w", "gate_b", "up_w", "up_b", "down_w", "down_b"]
    got = _module_grads(module, x, dy, names)
    ref = _grads({k: v.double() if v is not None else None for k, v in params.items()}, x.double(),
                 _mlp_fn(activation), dy.double())
    eager = _grads(params, x, _mlp_fn(activation), dy)
    _check_grads(got, ref, eager, dtype)


def _linear_fn(activation):
    def fn(x, w, b, r=None):
        y = TORCH_ACTIVATIONS[activation](F.linear(x, w, b))
        return y if r is None else y + r
    return fn


def _linear_module_grads(module, x, dy, r):
    """(the module's gradients of x, w, b and, where r is given, the residual's; the parameters and r by name)."""
    params = {"w": module.weight, "b": module.bias}
    if r is None:
        return _module_grads(module, x, dy, ["w", "b"]), params
    r_leaf = r.clone().requires_grad_()
    got = _module_grads(module, x, dy, ["w", "b"], residual=r_leaf)
    got["r"] = r_leaf.grad
    return got, {**params, "r": r}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("activation", LINEAR_ACTIVATIONS)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("residual", [False, True], ids=["nores", "res"])
def test_linear_gradients(dtype, activation, bias, residual, device):
    module = autofuse.get_linear(40, 24, bias=bias, activation=activation, dtype=dtype, device=device)
    x = torch.randn(37, 40, dtype=dtype, device=device)
    dy = torch.randn(37, 24, dtype=dtype, device=device)
    r = torch.randn(37, 24, dtype=dtype, device=device) if residual else None
    got, params = _linear_module_grads(module, x, dy, r)
    ref = _grads({k: v.double() if v is not None else None for k, v in params.items()}, x.double(),
                 _linear_fn(activation), dy.double())
    eager = _grads(params, x, _linear_fn(activation), dy)
    _check_grads(got, ref, eager, dtype)


def test_finite_differences_agree_with_the_gradient(device):
    # float32, IEEE dots: a central difference along a random direction matches <grad, direction>.
    torch.manual_seed(0)
    module = autofuse.get_mlp(24, 40, activation="gelu_tanh", bias=True, dtype=torch.float32, device=device)
    x = torch.randn(5, 24, device=device, requires_grad=True)
    w = module.up_proj.weight
    (module(x) ** 2).sum().backward()
    for tensor, grad in ((x, x.grad), (w, w.grad)):
        direction = torch.randn_like(tensor)
        eps = 1e-2
        with torch.no_grad():
            tensor += eps * direction
            plus = (module(x) ** 2).sum().double()
            tensor -= 2 * eps * direction
            minus = (module(x) ** 2).sum().double()
            tensor += eps * direction
        numeric = (plus - minus) / (2 * eps)
        analytic = (grad.double() * direction.double()).sum()
        assert abs(numeric - analytic) <= 2e-3 * abs(analytic) + 1e-3, (numeric.item(), analytic.item())


def test_gradients_accumulate_across_backward_calls(device):
    module = autofuse.get_mlp(16, 32, bias=True, dtype=torch.float32, device=device)
    x = torch.randn(6, 16, device=device)
    module(x).sum().backward()
    once = {name: p.grad.clone() for name, p in module.named_parameters()}
    module(x).sum().backward()  # no zero_grad: .grad must hold the sum of both steps
    for name, p in module.named_parameters():
        torch.testing.assert_close(p.grad, 2 * once[name], rtol=1e-5, atol=1e-6)


def test_double_backward_is_refused_clearly(device):
    module = autofuse.get_linear(16, 8, activation="gelu", dtype=torch.float32, device=device)
    x = torch.randn(4, 16, device=device, requires_grad=True)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(module(x).sum(), x, create_graph=True)


def test_no_grad_forward_saves_nothing(device):
    module = autofuse.get_mlp(16, 32, dtype=torch.float32, device=device)
    with torch.no_grad():
        out = module(torch.randn(4, 16, device=device))
    assert out.grad_fn is None
    out = module(torch.randn(4, 16, device=device))  # parameters require grad: a graph is built
    assert type(out.grad_fn).__name__ != "NoneType"


@pytest.mark.parametrize("d_ff", [48, 72])
def test_a_short_training_run_follows_eager(d_ff, device):
    # A few SGD steps of a small GeGLU MLP regression on synthetic data, autofuse against the same
    # model in eager PyTorch from the same initial weights: the losses match step for step. At d_ff = 72 (not a
    # multiple of 16) the step's passes run over flat rows (launch.flat_rows), replayed bound from the second step.
    torch.manual_seed(0)
    fused = autofuse.get_mlp(16, d_ff, activation="gelu_tanh", bias=True, dtype=torch.float32, device=device)
    eager_params = {k: v.detach().clone().requires_grad_() for k, v in _mlp_params(fused).items()}
    x = torch.randn(32, 16, device=device)
    target = torch.sin(x @ torch.randn(16, 16, device=device))
    opt_fused = torch.optim.SGD(fused.parameters(), lr=1.0)
    opt_eager = torch.optim.SGD(list(eager_params.values()), lr=1.0)
    losses = []
    for _ in range(30):
        loss_f = F.mse_loss(fused(x), target)
        loss_e = F.mse_loss(_mlp_fn("gelu_tanh")(x, **eager_params), target)
        for opt, loss in ((opt_fused, loss_f), (opt_eager, loss_e)):
            opt.zero_grad()
            loss.backward()
            opt.step()
        losses.append((loss_f.item(), loss_e.item()))
    assert losses[-1][0] < 0.5 * losses[0][0]  # it learns (0.56 -> 0.17 when written)
    for f, e in losses:
        assert abs(f - e) <= 1e-4 * e, losses
    (entry,) = fused._training_table.values()
    # both passes bound, replayed after the first step
    assert {"gated_act", "gated_dgu"} <= set(entry.launches.launches)


BACKWARD_CONFIGS = [
    KernelConfig(16, 16, 16, group_m=1, num_warps=1, num_stages=1),
    KernelConfig(32, 64, 32, group_m=4, num_warps=4, num_stages=2),
    KernelConfig(64, 32, 64, group_m=8, num_warps=8, num_stages=3),
    # Persistent over descriptors; the epilogue in one, two and four 64-column pieces.
    KernelConfig(32, 32, 32, group_m=8, num_warps=4, num_stages=2, variant="tma"),
    KernelConfig(16, 128, 32, group_m=8, num_warps=4, num_stages=2, variant="tma"),
    KernelConfig(16, 256, 16, group_m=1, num_warps=4, num_stages=2, variant="tma"),
]


def _saved_pre_activations(M, F_, dtype, device):
    # Of order one, as G and U are; fresh random values, never zeros.
    return torch.randn(M, 2 * F_, dtype=dtype, device=device)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("config", BACKWARD_CONFIGS, ids=KernelConfig.short)
@pytest.mark.parametrize("D", [48, 64], ids=["D48", "D64"])  # ragged and even K loops
def test_gated_backward_kernel_block_configs(dtype, config, D, device):
    # The kernel alone, every config the tuner may pick: dG, dU and H against float64, into fresh
    # buffers and in place over the saved [G | U] (how the MLP's backward runs it). F = 200 reaches
    # into the fourth 64-column piece of a 256-wide tile and ends inside it.
    M, F_ = 37, 200
    dy = torch.randn(M, D, dtype=dtype, device=device)
    wd = torch.randn(D, F_, dtype=dtype, device=device) / F_**0.5
    gu = _saved_pre_activations(M, F_, dtype, device)
    # (dGU, H) as PyTorch computes them, in float64 and in the dtype (aten's gelu_backward)
    ref = gated_backward_eager(dy.double(), gu.double(), wd.double(), "gelu")
    eager = gated_backward_eager(dy, gu, wd, "gelu")
    poisoned = (torch.full((M, 2 * F_), float("nan"), dtype=dtype, device=device),
                torch.full((M, F_), float("nan"), dtype=dtype, device=device))
    fresh = gated_backward(dy, gu, wd, "gelu", config, out=poisoned)
    in_place = gated_backward(dy, gu.clone(), wd, "gelu", config)  # out=None: dGU over gu's copy
    aliased_gu = gu.clone()
    aliased = gated_backward(dy, aliased_gu, wd, "gelu", config, out=(aliased_gu, None))
    assert aliased[0].data_ptr() == aliased_gu.data_ptr()
    for dgu_h in (fresh, in_place, aliased):
        for got, r, e in zip(dgu_h, ref, eager):
            err, eager_err = relative_error(got, r), relative_error(e, r)
            assert err <= GRAD_BOUNDS[dtype] and err <= 1.25 * eager_err + 1e-6, (err, eager_err)


def _pre_activations(M, F_, dtype, device, layout):
    """G and U as the halves of one [M, 2F] buffer (the lean training path, the inference library path) or
    as two buffers, U's rows padded so that its stride differs from G's (the training path that keeps H)."""
    if layout == "halves":
        gu = _saved_pre_activations(M, F_, dtype, device)
        return gu[:, :F_], gu[:, F_:]
    return (torch.randn(M, F_, dtype=dtype, device=device),
            torch.randn(M, F_ + 8, dtype=dtype, device=device)[:, :F_])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("activation", GATED_ACTIVATIONS)
@pytest.mark.parametrize("layout", ["halves", "buffers"])
def test_gated_activation_kernel(dtype, activation, layout, device):
    # The training forward's pointwise H = act(G) * U over ragged edges (M, F not multiples of its tile).
    M, F_ = 37, 72
    g, u = _pre_activations(M, F_, dtype, device, layout)
    out = torch.full((M, F_), float("nan"), dtype=dtype, device=device)
    h = gated_activation(g, u, activation, out=out)
    ref = TORCH_ACTIVATIONS[activation](g.double()) * u.double()
    eager = TORCH_ACTIVATIONS[activation](g) * u
    # One rounding of a float32 result to the dtype: at most eager's error (which rounds twice).
    assert h.data_ptr() == out.data_ptr() and relative_error(h, ref) <= relative_error(eager, ref) + 1e-7


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("activation", GATED_ACTIVATIONS)
@pytest.mark.parametrize("layout", ["halves", "buffers"])
def test_gated_gradient_kept_pass(dtype, activation, layout, device):
    # Op gated_dgu (the backward pass where the forward kept H): dG, dU from dH, G, U over ragged edges,
    # into fresh buffers and, as the training backward runs it, over G and U themselves.
    M, F_ = 37, 72
    g, u = _pre_activations(M, F_, dtype, device, layout)
    dh = torch.randn(M, F_, dtype=dtype, device=device)
    dg_ref, du_ref, _ = gated_from_dh(dh.double(), g.double(), u.double(), activation)
    dg_eager, du_eager, _ = gated_from_dh(dh, g, u, activation)
    fresh = gated_gradient_kept(dh, g, u, activation)
    in_place = gated_gradient_kept(dh, g, u, activation, out=(g, u))
    assert in_place[0].data_ptr() == g.data_ptr() and in_place[1].data_ptr() == u.data_ptr()
    for dg_du in (fresh, in_place):
        for got, eager, ref in zip(dg_du, (dg_eager, du_eager), (dg_ref, du_ref)):
            # One rounding of each float32 result; eager rounds its intermediate products too.
            assert relative_error(got, ref) <= 1.25 * relative_error(eager, ref) + 1e-6


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("activation", GATED_ACTIVATIONS)
def test_passes_over_contiguous_rows_not_a_multiple_of_16_run_as_wider_rows(dtype, activation, device):
    # The training path's G, U, H and dH are contiguous [M, F]: at F = 72 (not a multiple of 16) the passes
    # run over the same elements as rows of 32 (36 * 72 = 81 * 32), and still give the reference's values.
    M, F_ = 36, 72
    g, u, dh = (torch.randn(M, F_, dtype=dtype, device=device) for _ in range(3))
    tensors = {"dh": dh, "g": g, "u": u, "dg": g, "du": u}
    rows, width, flat = launch.flat_rows(GATED_DGU, M, F_, tensors)
    assert (rows, width) == (81, 32) and all(t.shape == (81, 32) and t.data_ptr() == tensors[n].data_ptr()
                                             for n, t in flat.items())
    # Not where an operand is strided (the halves of one [M, 2F] buffer) or a vector (a bias), nor at F = 64.
    assert launch.flat_rows(GATED_DGU, M, F_, {**tensors, "g": torch.empty(M, 2 * F_)[:, :F_]})[:2] == (M, F_)
    assert launch.flat_rows(BIAS_ACT, M, F_, {"y": g, "b": torch.empty(F_)})[:2] == (M, F_)
    assert launch.flat_rows(GATED_DGU, M, 64, {"g": torch.empty(M, 64)})[:2] == (M, 64)
    h = gated_activation(g, u, activation)
    h_ref = TORCH_ACTIVATIONS[activation](g.double()) * u.double()
    assert relative_error(h, h_ref) <= relative_error(TORCH_ACTIVATIONS[activation](g) * u, h_ref) + 1e-7
    dg_ref, du_ref, _ = gated_from_dh(dh.double(), g.double(), u.double(), activation)
    dg_eager, du_eager, _ = gated_from_dh(dh, g, u, activation)
    dg, du = gated_gradient_kept(dh, g.clone(), u.clone(), activation)
    for got, eager, ref in ((dg, dg_eager, dg_ref), (du, du_eager, du_ref)):
        # One rounding of each float32 result; eager rounds its intermediate products too.
        assert relative_error(got, ref) <= 1.25 * relative_error(eager, ref) + 1e-6


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("activation", GATED_ACTIVATIONS)
@pytest.mark.parametrize("in_place", [False, True], ids=["new", "in_place"])
def test_gated_gradient_pass(dtype, activation, in_place, device, monkeypatch):
    # The backward's library path: cuBLAS dH, then this one pointwise pass for dG | dU and H, over ragged
    # edges and, as the training backward runs it, writing dG | dU over the saved [G | U].
    M, F_, D = 37, 72, 40
    gu = _saved_pre_activations(M, F_, dtype, device)
    dy = torch.randn(M, D, dtype=dtype, device=device)
    w_down = torch.randn(D, F_, dtype=dtype, device=device) / D**0.5
    dgu_ref, h_ref = gated_backward_eager(dy.double(), gu.double(), w_down.double(), activation)
    dgu_eager, h_eager = gated_backward_eager(dy, gu, w_down, activation)
    passes = []
    real_pass = gated_bwd.gated_gradient
    monkeypatch.setattr(gated_bwd, "gated_gradient",
                        lambda dh, *a, **k: passes.append((dh.data_ptr(), k["out"])) or real_pass(dh, *a, **k))
    dgu, h = gated_backward_cublas(dy, gu.clone() if not in_place else gu, w_down, activation,
                                   out=(gu, None) if in_place else None)
    if in_place:
        assert dgu.data_ptr() == gu.data_ptr()
    # H is written over dH where no H buffer is given: one [M, F] buffer at the step's peak, not two.
    assert len(passes) == 1 and h.data_ptr() == passes[0][0]
    # One rounding of each float32 result (dH is rounded once more by the GEMM, as in eager).
    for got, eager, ref in ((dgu, dgu_eager, dgu_ref), (h, h_eager, h_ref)):
        assert relative_error(got, ref) <= 1.25 * relative_error(eager, ref) + 1e-6


@pytest.mark.parametrize("library", ["eager", "cublas_gated_grad"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_mlp_gradients_through_each_library_backward(library, dtype, device, monkeypatch):
    # Where tuning or a check chose a library path for the backward, training.MLPFunction runs that one.
    module = autofuse.get_mlp(40, 72, activation="gelu_tanh", bias=True, dtype=dtype, device=device,
                              save_hidden=False)
    real = module._training_step

    def with_library(M, weight, save_hidden):
        return dataclasses.replace(real(M, weight, save_hidden), backward_config=Library(library))
    monkeypatch.setattr(module, "_training_step", with_library)
    ran = []
    monkeypatch.setitem(gated_bwd.LIBRARY_BACKWARDS, library,
                        lambda *a, _run=gated_bwd.LIBRARY_BACKWARDS[library], **k: ran.append(1) or _run(*a, **k))
    x = torch.randn(39, 40, dtype=dtype, device=device)
    dy = torch.randn(39, 40, dtype=dtype, device=device)
    params = _mlp_params(module)
    names = ["gate_w", "gate_b", "up_w", "up_b", "down_w", "down_b"]
    got = _module_grads(module, x, dy, names)
    assert ran == [1]
    ref = _grads({k: v.double() for k, v in params.items()}, x.double(), _mlp_fn("gelu_tanh"), dy.double())
    _check_grads(got, ref, _grads(params, x, _mlp_fn("gelu_tanh"), dy), dtype)


def _mlp_node(out):
    node = out.grad_fn
    while not type(node).__name__.startswith(("MLPFunction", "HiddenDownFunction")):  # under the reshape back
        node = node.next_functions[0][0]
    return node


@pytest.fixture
def nodes_at_any_size():
    """The step's weight gradients in nodes of their own wherever the activations are outweighed, at the tests' small
    sizes too (the policy's GEMM-work floor, host_bound_step_macs, set to 0)."""
    from autofuse.choose.policy import current, use

    with use(dataclasses.replace(current(), host_bound_step_macs=0)):
        yield


def _kept_activations(out) -> list:
    """G, U and H as the MLP's node holds them for the backward: all three on ctx (MLPFunction), or G and U saved
    (the ProjectionFunctions' outputs) and H on ctx (HiddenDownFunction, where the weight gradients are nodes of
    their own)."""
    node = _mlp_node(out)
    if type(node).__name__.startswith("HiddenDownFunction"):
        return [*node.saved_tensors[3:5], *node.kept]  # after the three weights the GEMMs read
    return node.kept


@pytest.mark.parametrize("activation", GATED_ACTIVATIONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_forward_that_saves_h_runs_the_pass_without_h_and_both_backwards_agree(activation, dtype, device,
                                                                                  monkeypatch):
    """save_hidden (the default): the forward keeps H too and the backward runs op gated_dgu once, never
    gated_bwd's choice (which is not even resolved); save_hidden=False keeps no H and runs that choice.
    Both give the reference's gradients, and each other's up to a few roundings."""
    from autofuse import training

    module = autofuse.get_mlp(40, 72, activation=activation, bias=True, dtype=dtype, device=device)
    passes, resolved = [], []
    real_pass = training.gated_gradient_kept
    monkeypatch.setattr(training, "gated_gradient_kept", lambda *a, **k: passes.append(1) or real_pass(*a, **k))
    real_resolve = autofuse.modules.resolve_checked
    monkeypatch.setattr(autofuse.modules, "resolve_checked",
                        lambda problem, *a, **k: resolved.append(problem.op) or real_resolve(problem, *a, **k))
    x = torch.randn(39, 40, dtype=dtype, device=device)
    dy = torch.randn(39, 40, dtype=dtype, device=device)
    names = ["gate_w", "gate_b", "up_w", "up_b", "down_w", "down_b"]
    params = _mlp_params(module)
    assert [tuple(t.shape) for t in _kept_activations(module(x.clone().requires_grad_()))] == [(39, 72)] * 3
    kept = _module_grads(module, x, dy, names)
    assert passes == [1] and "gated_bwd" not in resolved
    module.save_hidden = False
    assert _mlp_node(module(x.clone().requires_grad_())).kept is None
    lean = _module_grads(module, x, dy, names)
    assert passes == [1] and "gated_bwd" in resolved
    ref = _grads({k: v.double() for k, v in params.items()}, x.double(), _mlp_fn(activation), dy.double())
    eager = _grads(params, x, _mlp_fn(activation), dy)
    _check_grads(kept, ref, eager, dtype)
    _check_grads(lean, ref, eager, dtype)
    for name in kept:
        # The same formulas either way; where the lean path's choice is the fused kernel, its dH is not
        # rounded to the dtype before the epilogue, hence a norm-wise bound of a few roundings, not equality.
        bound = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}[dtype]
        assert relative_error(kept[name], lean[name].double()) <= bound, name


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("M", [39, 8])  # one node at 39 rows, weight gradients in nodes of their own at 8
def test_saved_tensor_hooks_see_the_kept_h_and_checkpointing_gives_the_same_gradients(dtype, M, device,
                                                                                       nodes_at_any_size):
    """Under saved-tensor hooks (what non-reentrant activation checkpointing and CPU offloading install), the
    kept G, U and H go through save_for_backward, so the hooks pack them like every other activation; gradients through
    torch.utils.checkpoint equal the plain step's."""
    module = autofuse.get_mlp(40, 72, activation="gelu_tanh", bias=True, dtype=dtype, device=device)
    x = torch.randn(M, 40, dtype=dtype, device=device)
    dy = torch.randn(M, 40, dtype=dtype, device=device)
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(tuple(t.shape)) or t, lambda t: t):
        node = _mlp_node(module(x.clone().requires_grad_()))
    # G, U and H through save_for_backward, none on ctx
    assert node.kept is None and packed.count((M, 72)) == 3 and (M, 144) not in packed
    names = ["gate_w", "gate_b", "up_w", "up_b", "down_w", "down_b"]
    plain = _module_grads(module, x, dy, names)
    xc = x.clone().requires_grad_()
    module.zero_grad(set_to_none=True)
    torch.utils.checkpoint.checkpoint(module, xc, use_reentrant=False).backward(dy)
    checkpointed = {"x": xc.grad, **{n: p.grad for n, p in zip(names, _param_tensors(module))}}
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], rtol=0, atol=0)


def test_weight_gradients_get_nodes_of_their_own_where_they_outweigh_activations_and_the_gemms_hide_the_host():
    """The rule at the sizes a step runs at (bf16 H100 measurements in DecisionPolicy's notes): 3200 -> 6656 and 3592 ->
    8064 at M = 2048 split; 2368 -> 4872 (host-bound there) and 2496 -> 6384 (its activations not outweighed) stay one
    node, as every shape does at M = 8192."""
    from autofuse.training import separate_weight_gradients

    assert separate_weight_gradients(2048, 3200, 6656) and separate_weight_gradients(2048, 3592, 8064)
    assert not separate_weight_gradients(2048, 2368, 4872) and not separate_weight_gradients(2048, 2496, 6384)
    assert not any(separate_weight_gradients(8192, d, f) for d, f in ((3200, 6656), (3592, 8064), (1344, 2688)))
    # Outweighed but too little GEMM work to hide two more nodes' host time: one node.
    assert not separate_weight_gradients(512, 4096, 14336) and not separate_weight_gradients(21, 48, 80)


def test_a_host_bound_step_holds_g_and_u_as_one_buffer_where_the_weights_weigh_no_more_than_the_activations():
    """The rule at the sizes a step runs at: 1344 -> 2688 at M = 2048 (host-bound, d_model <= M) takes one [G | U]
    buffer; 2368 -> 4872 there (d_model above M: the buffer's extra weight-sized hold would pass an eager graph's
    peak) and every step with enough GEMM work to hide the host (M = 16384 here) keep two."""
    from autofuse.training import ONE_BUFFER, RECOMPUTE_H, THREE_NODES, TWO_BUFFERS, stacked_pre_activations, step_form

    assert step_form(2048, 1344, 2688, True) == ONE_BUFFER and step_form(2048, 2368, 4872, True) == TWO_BUFFERS
    assert step_form(2048, 3200, 6656, True) == THREE_NODES and step_form(2048, 1344, 2688, False) == RECOMPUTE_H
    assert stacked_pre_activations(2048, 1344, 2688) and stacked_pre_activations(2048, 1088, 3232)
    assert not stacked_pre_activations(2048, 2368, 4872) and not stacked_pre_activations(1024, 1344, 2688)
    assert not any(stacked_pre_activations(16384, d, f) for d, f in ((1344, 2688), (2368, 4872), (1088, 3232)))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("activation", GATED_ACTIVATIONS)
@pytest.mark.parametrize("d_ff, d_model", [(72, 40), (75, 43)], ids=["aligned", "padded"])
@pytest.mark.parametrize("M", [21, 160])  # fewer rows than d_model: two buffers; more: one
def test_a_kept_h_step_over_one_g_u_buffer_gives_the_reference_gradients(dtype, activation, d_ff, d_model, M, device):
    """A step that keeps H holds [G | U] as one buffer where stacked_pre_activations says so (160 rows against
    d_model 40 or 43, host-bound), else G and U as two; either way the output and every gradient are the float64
    reference's, bias included, at aligned and padded widths."""
    from autofuse.training import row_width

    module = autofuse.get_mlp(d_model, d_ff, activation=activation, bias=True, dtype=dtype, device=device)
    x = torch.randn(M, d_model, dtype=dtype, device=device)
    dy = torch.randn(M, d_model, dtype=dtype, device=device)
    node = _mlp_node(module(x.clone().requires_grad_()))
    width = row_width(d_ff)
    if M == 160:  # [G | U] over the padded width, then H
        assert [tuple(t.shape) for t in node.kept] == [(M, 2 * width), (M, width)]
    else:
        assert [tuple(t.shape) for t in node.kept] == [(M, width)] * 3
    _check_mlp_module_grads(module, x, dy, activation, dtype)


@pytest.mark.parametrize("d_ff, d_model", [(72, 40), (75, 43)], ids=["aligned", "padded"])
@pytest.mark.parametrize("M", [21, 160])
def test_where_weight_gradients_outweigh_activations_each_is_added_and_freed_before_the_next(d_ff, d_model, M, device,
                                                                                            monkeypatch,
                                                                                            nodes_at_any_size):
    """At few rows (training.separate_weight_gradients) each weight's gradient comes from an autograd node of its
    own, so the engine adds it into .grad and frees it before the next weight gradient's GEMM: the step never holds
    two new weight gradients (one node returning all three holds them together at its last GEMM, the step's peak).
    At many rows the activations outweigh them and the step is one node."""
    import weakref

    from autofuse import training

    module = autofuse.get_mlp(d_model, d_ff, activation="silu", bias=True, dtype=torch.float32, device=device)
    separate = training.separate_weight_gradients(M, training.row_width(d_model), training.row_width(d_ff))
    assert separate == (M == 21)
    x = torch.randn(M, d_model, device=device, requires_grad=True)
    dy = torch.randn(M, d_model, device=device)
    module(x).backward(dy)  # .grad exists: the second step's gradients are added into it and freed
    weight_shapes = {tuple(p.shape) for p in (module.gate_proj.weight, module.down_proj.weight)}
    weight_shapes |= {(training.row_width(a), training.row_width(b)) for a, b in weight_shapes}
    formed, alive_at_each = [], []
    real_mm = torch.mm

    def recording_mm(a, b, **kwargs):
        result = real_mm(a, b, **kwargs)
        if tuple(result.shape) in weight_shapes:
            alive_at_each.append(sum(ref() is not None for ref in formed))
            formed.append(weakref.ref(result))
        return result
    out = module(x)
    node = type(_mlp_node(out)).__name__
    assert node.startswith("HiddenDownFunction" if separate else "MLPFunction")
    monkeypatch.setattr(torch, "mm", recording_mm)
    out.backward(dy)
    monkeypatch.undo()
    assert len(alive_at_each) == 3
    if separate:
        assert alive_at_each == [0, 0, 0]
    else:
        assert alive_at_each == [0, 1, 2]  # one node: dWd and dWg still held at dWu's GEMM


def test_a_padded_training_step_holds_one_copy_of_the_weights_at_every_token_count(device, monkeypatch,
                                                                                   nodes_at_any_size):
    """An unaligned d_ff and d_model train over padded copies of the weights (no dense view of padded storage holds a
    weight whose rows and columns are both unaligned), kept step after step: one set per module, whatever the token
    counts (each is a table entry of its own), and dropped when inference lays the parameters out again."""
    from autofuse import training

    module = autofuse.get_mlp(43, 75, activation="silu", dtype=torch.float32, device=device)
    used = []
    real = training.Padding.params

    def recording(self, params, launches, layout=None):
        padded = real(self, params, launches, layout)
        used.append(padded[0].data_ptr())
        return padded
    monkeypatch.setattr(training.Padding, "params", recording)
    for M in (21, 160, 21):  # weight gradients in nodes of their own at 21 rows, one node at 160
        module(torch.randn(M, 43, device=device, requires_grad=True)).sum().backward()
    assert len(module._training_table) == 2 and len(used) == 3 and len(set(used)) == 1
    with torch.no_grad():
        module(torch.randn(5, 43, device=device))
    assert not module._training_weights


@pytest.mark.parametrize("d_ff, d_model", [(72, 40), (75, 43)], ids=["aligned", "padded"])
@pytest.mark.parametrize("M", [8, 160])  # weight gradients in nodes of their own at 8 rows, one node at 160
def test_frozen_weights_give_the_input_gradient_alone(d_ff, d_model, M, device, nodes_at_any_size):
    """Weights that need no gradient (frozen, as under adapters): x's gradient is the float64 reference's and no
    weight gets one, through either form of the step."""
    module = autofuse.get_mlp(d_model, d_ff, activation="silu", bias=True, dtype=torch.float32, device=device)
    module.requires_grad_(False)
    x = torch.randn(M, d_model, device=device)
    dy = torch.randn(M, d_model, device=device)
    xg = x.clone().requires_grad_()
    module(xg).backward(dy)
    params = _mlp_params(module)
    ref = _grads({k: v.double() for k, v in params.items()}, x.double(), _mlp_fn("silu"), dy.double())
    assert relative_error(xg.grad, ref["x"]) <= 1e-5
    assert all(p.grad is None for p in module.parameters())


@pytest.mark.parametrize("nodes", ["one", "separate"])
def test_a_second_backward_through_one_forward_is_refused_clearly(nodes, device, request):
    # The backward overwrites the saved G | U with their gradients: retain_graph cannot reuse them, in either form.
    if nodes == "separate":
        request.getfixturevalue("nodes_at_any_size")
    module = autofuse.get_mlp(16, 32, dtype=torch.float32, device=device)
    out = module(torch.randn(4, 16, device=device, requires_grad=True))
    assert type(_mlp_node(out)).__name__.startswith("HiddenDown" if nodes == "separate" else "MLPFunction")
    out = out.sum()
    out.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backpropagated once"):
        out.backward()


@pytest.mark.parametrize("interleaved", [True, False])
def test_training_stacks_gate_and_up_into_one_buffer_and_both_layouts_give_the_gradients(interleaved, device):
    """A training forward lays the gate and up weights (and biases) out as the halves of one buffer
    (ops.gated_up.stacked: one GEMM for G | U and one for dX), the same parameter objects with the same
    values, each dense; a module that starts with two plain tensors (interleaved=False, no padding, rows of
    whole lines: float32 64 -> 96) keeps them and runs two GEMMs each. Both give the reference's gradients, and
    inference afterwards its output."""
    from autofuse.ops.gated_up import stacked

    dtype = torch.float32
    module = autofuse.get_mlp(64, 96, activation="silu", bias=True, dtype=dtype, device=device,
                              interleaved=interleaved)
    params = _mlp_params(module)
    before = {k: v.detach().clone() for k, v in params.items()}
    objects = [module.gate_proj.weight, module.up_proj.weight]
    x = torch.randn(13, 64, dtype=dtype, device=device)
    dy = torch.randn(13, 64, dtype=dtype, device=device)
    names = ["gate_w", "gate_b", "up_w", "up_b", "down_w", "down_b"]
    got = _module_grads(module, x, dy, names)
    assert [module.gate_proj.weight, module.up_proj.weight] == objects
    for name, value in _mlp_params(module).items():
        assert value.is_contiguous() and torch.equal(value, before[name]), name
    w_gu = stacked(module.gate_proj.weight, module.up_proj.weight)
    assert (w_gu is not None) == interleaved
    if interleaved:
        assert torch.equal(w_gu, torch.cat([before["gate_w"], before["up_w"]]))
        assert stacked(module.gate_proj.bias, module.up_proj.bias) is not None
    ref = _grads({k: v.double() for k, v in before.items()}, x.double(), _mlp_fn("silu"), dy.double())
    _check_grads(got, ref, _grads(before, x, _mlp_fn("silu"), dy), dtype)
    for name, value in module.state_dict().items():  # each entry its own storage (safetensors refuses shared)
        assert value.untyped_storage().nbytes() == value.numel() * value.element_size(), name
    with torch.no_grad():
        y = module(x)
    expected = _mlp_fn("silu")(x, **before)
    assert relative_error(y, expected.double()) <= 1e-5


def test_stacked_refuses_tensors_that_are_not_the_halves_of_one_buffer():
    from autofuse.ops.gated_up import stacked

    buffer = torch.randn(2, 6, 4)
    assert torch.equal(stacked(buffer[0], buffer[1]), buffer.reshape(12, 4))
    assert stacked(buffer[1], buffer[0]) is None  # up before gate
    assert stacked(torch.randn(6, 4), torch.randn(6, 4)) is None  # two allocations
    assert stacked(buffer[0, :, :2], buffer[1, :, :2]) is None  # not dense


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d_ff, d_model", [(75, 40), (100, 43)], ids=["dff75", "dff100-dmodel43"])
@pytest.mark.parametrize("save_hidden", [True, False], ids=["keep-h", "recompute-h"])
@pytest.mark.parametrize("M", [21, 160])  # weight gradients in nodes of their own at 21 rows, one node at 160
def test_training_at_an_unaligned_width_runs_padded_with_the_reference_gradients(dtype, d_ff, d_model, save_hidden,
                                                                                  M, device, nodes_at_any_size):
    """A d_ff (or d_model) that is not a multiple of 8: the step runs in the padded space (every GEMM at aligned
    sizes, what cuBLAS needs for its fast kernels), and the output and gradients are still the reference's."""
    from autofuse.layout import run_width

    module = autofuse.get_mlp(d_model, d_ff, activation="gelu_tanh", bias=True, dtype=dtype, device=device,
                              save_hidden=save_hidden)
    x = torch.randn(M, d_model, dtype=dtype, device=device)
    dy = torch.randn(M, d_model, dtype=dtype, device=device)
    out = module(x.clone().requires_grad_())
    assert out.shape == (M, d_model)
    if save_hidden:
        assert [tuple(t.shape) for t in _kept_activations(out)] == [(M, run_width(d_ff))] * 3  # G, U, H padded
    _check_mlp_module_grads(module, x, dy, "gelu_tanh", dtype)
    for p in module.parameters():  # dense gradients laid out as their parameters, what optimizers step
        assert p.grad.stride() == p.stride() and _dense(p.grad)


def _dense(t: torch.Tensor) -> bool:
    """Whether t's elements fill numel consecutive slots (row- or column-major, no gaps)."""
    if t.dim() == 1:
        return t.stride() == (1,)
    (inner, inner_stride), (_, outer_stride) = sorted(zip(t.shape, t.stride()), key=lambda pair: pair[1])
    return inner_stride == 1 and outer_stride == inner


@pytest.mark.parametrize("save_hidden", [True, False], ids=["keep-h", "recompute-h"])
@pytest.mark.parametrize("M", [21, 160])  # weight gradients in nodes of their own at 21 rows, one node at 160
def test_an_unaligned_d_ff_trains_on_the_parameters_own_padded_storage(save_hidden, M, device, monkeypatch,
                                                                        nodes_at_any_size):
    """d_ff 75 beside an aligned d_model: the training forward lays the gate and up weights out as the first rows of
    the halves of one zero-filled [2, 128, 40] buffer that the step's GEMMs read in place (layout.TrainingLayout),
    every parameter contiguous, and the step copies the down weight alone; the gradients are the reference's, laid
    out as their parameters; state_dict saves plain tensors; inference afterwards lays them out for its kernels and
    computes the same function. A parameter replaced through .data leaves that storage: the step then copies all
    three, with the same gradients."""
    from autofuse import training

    module = autofuse.get_mlp(40, 75, activation="silu", bias=True, dtype=torch.float32, device=device,
                              save_hidden=save_hidden)
    read = []
    real = training.Padding.params

    def recording(self, params, launches, layout=None):
        padded = real(self, params, launches, layout)
        read.append(padded)
        return padded
    monkeypatch.setattr(training.Padding, "params", recording)
    x = torch.randn(M, 40, device=device)
    dy = torch.randn(M, 40, device=device)
    _check_mlp_module_grads(module, x, dy, "silu", torch.float32)
    assert all(p.is_contiguous() for p in module.parameters())
    wg, wu = module.gate_proj.weight, module.up_proj.weight
    gate_up = read[-1][0].untyped_storage()
    assert wu.untyped_storage().data_ptr() == wg.untyped_storage().data_ptr() == gate_up.data_ptr()
    assert tuple(read[-1][0].shape) == (128, 40) and tuple(read[-1][4].shape) == (40, 128)
    copies = module._training_weights["padded"]
    assert len(copies) == 1 and copies[0] is read[-1][4]  # the down weight's copy alone
    for p in module.parameters():
        assert p.grad.stride() == p.stride()
    for name, value in module.state_dict().items():
        assert value.is_contiguous() and value.untyped_storage().nbytes() == value.numel() * 4, name
    params = {k: v.detach().clone() for k, v in _mlp_params(module).items()}
    with torch.no_grad():
        y = module(x)
    assert module._training_layout is None and module._layout is not None
    assert relative_error(y, _mlp_fn("silu")(x.double(), **{k: v.double() for k, v in params.items()})) <= 1e-5
    module.zero_grad()
    _check_mlp_module_grads(module, x, dy, "silu", torch.float32)  # laid out for training again
    assert module._training_layout is not None and len(module._training_weights["padded"]) == 1
    with torch.no_grad():
        module.up_proj.weight.data = module.up_proj.weight.detach().clone()
    module.zero_grad()
    _check_mlp_module_grads(module, x, dy, "silu", torch.float32)
    assert len(module._training_weights["padded"]) == 4  # all copied: the up weight left the layout's storage


@pytest.mark.parametrize("optimizer", ["foreach", "fused"])
def test_optimizers_step_a_module_on_its_training_layout_like_a_plain_one(optimizer, device):
    """AdamW (foreach, and fused, which needs a parameter's, gradient's and state's strides to match) steps a module
    whose parameters are views of the training layout's padded storage exactly as eager PyTorch's MLP of the same
    parameters: three steps, then the parameters compared."""
    torch.manual_seed(0)
    module = autofuse.get_mlp(64, 100, activation="silu", bias=True, dtype=torch.float32, device=device)
    plain = {k: torch.nn.Parameter(v.detach().clone()) for k, v in _mlp_params(module).items()}
    x = torch.randn(33, 64, device=device)
    opts = [torch.optim.AdamW(m, lr=1e-2, **{optimizer: True}) for m in (module.parameters(), plain.values())]
    for _ in range(3):
        for opt, forward in zip(opts, (module, lambda x: _mlp_fn("silu")(x, **plain))):
            forward(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
    assert module._training_layout is not None and all(p.is_contiguous() for p in module.parameters())
    for name, value in _mlp_params(module).items():
        torch.testing.assert_close(value.detach(), plain[name].detach(), rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("activation", GATED_ACTIVATIONS)
@pytest.mark.parametrize("M", [21, 160])  # weight gradients in nodes of their own at 21 rows, one node at 160
def test_activation_rows_are_128_byte_aligned_and_their_padding_columns_reach_nothing(dtype, activation, M, device,
                                                                                       monkeypatch, nodes_at_any_size):
    """G, U, H and dH of a kept-H step whose rows are not a multiple of 32 bytes (d_ff 72 in 16-bit types) are views
    of rows 128 bytes apart, the pointwise passes run over whole rows, and what the padding columns hold reaches
    neither the output nor a gradient: here they start as NaN. In float32 the rows (288 bytes) stay dense."""
    from autofuse import training

    made = []
    real = training.activation_buffer

    def poisoned(M, width, like, padded_rows=True):
        t = real(M, width, like, padded_rows)
        training.whole_rows(t).fill_(float("nan"))
        made.append(t)
        return t
    monkeypatch.setattr(training, "activation_buffer", poisoned)
    module = autofuse.get_mlp(40, 72, activation=activation, bias=True, dtype=dtype, device=device)
    x = torch.randn(M, 40, dtype=dtype, device=device)
    dy = torch.randn(M, 40, dtype=dtype, device=device)
    out = module(x.clone().requires_grad_())
    row = {torch.float32: 72}.get(dtype, 128)
    assert [(tuple(t.shape), t.stride()) for t in _kept_activations(out)] == [((M, 72), (row, 1))] * 3  # G, U, H
    names = ["gate_w", "gate_b", "up_w", "up_b", "down_w", "down_b"]
    params = _mlp_params(module)
    got = _module_grads(module, x, dy, names)
    assert len(made) == 3 + 3 + 1  # G, U, H of each of the two forwards and the backward's dH
    ref = _grads({k: v.double() for k, v in params.items()}, x.double(), _mlp_fn(activation), dy.double())
    eager = _grads(params, x, _mlp_fn(activation), dy)
    _check_grads(got, ref, eager, dtype)


@pytest.mark.parametrize("M", [21, 160])  # two buffers, one
def test_a_host_bound_step_keeps_its_activations_dense(M, device):
    """Below DecisionPolicy.host_bound_step_macs (every size here, under the default policy) the step's G, U and H
    are dense, not views of 128-byte rows (their views and base lookups cost the host more than the rows gain):
    d_ff 72 in bfloat16 (144-byte rows) would be padded to 256-byte rows otherwise. The gradients stay the float64
    reference's."""
    from autofuse import training

    module = autofuse.get_mlp(40, 72, activation="silu", bias=True, dtype=torch.bfloat16, device=device)
    x = torch.randn(M, 40, dtype=torch.bfloat16, device=device)
    run = training.step_run(M, module.gate_proj.weight, module._training_step(M, module.gate_proj.weight, True))
    assert not run.padded_rows
    kept = _kept_activations(module(x.clone().requires_grad_()))
    assert all(t.stride(0) == 72 for t in kept[-1:]) and all(t.stride(0) in (72, 144) for t in kept)
    names = ["gate_w", "gate_b", "up_w", "up_b", "down_w", "down_b"]
    dy = torch.randn(M, 40, dtype=torch.bfloat16, device=device)
    params = _mlp_params(module)
    got = _module_grads(module, x, dy, names)
    ref = _grads({k: v.double() for k, v in params.items()}, x.double(), _mlp_fn("silu"), dy.double())
    _check_grads(got, ref, _grads(params, x, _mlp_fn("silu"), dy), torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_whole_rows_widens_only_what_activation_buffer_made(dtype):
    from autofuse import training

    made = training.activation_buffer(5, 44, torch.empty((), dtype=dtype))
    row = 64  # 44 columns (88 or 176 bytes, not a multiple of 32) rounded up to a multiple of 128 bytes
    assert made.shape == (5, 44) and made.stride() == (row, 1)
    assert training.whole_rows(made).shape == (5, row) and training.whole_rows(made).data_ptr() == made.data_ptr()
    other = torch.randn(5, 80, dtype=dtype)
    assert training.whole_rows(other[:, :40]).shape == (5, 40)  # the [G | U] halves' first half: left as it is
    assert training.whole_rows(other[:, 40:]).shape == (5, 40)
    assert training.whole_rows(torch.randn(5, 64, dtype=dtype)[:, :40].t()).shape == (40, 5)
    assert training.whole_rows(torch.randn(6, 64, dtype=dtype)[1:, :40]).shape == (5, 40)
    dense = torch.randn(5, 40, dtype=dtype)
    assert training.whole_rows(dense) is dense
    assert training.activation_buffer(5, 64, dense).stride() == (64, 1)  # a multiple of 32 bytes: dense
    assert training.activation_buffer(5, 48, dense).stride() == (48, 1)


@pytest.mark.parametrize("save_hidden", [True, False], ids=["keep-h", "recompute-h"])
def test_a_padded_dy_is_freed_before_the_weight_gradients_gemms(save_hidden, device, monkeypatch):
    """At an unaligned d_model the backward pads dY ([M, D]); the copy is freed once dH (and dWd) are computed, so
    that the weight gradients' GEMMs, whose last is the step's peak, do not hold it (the engine keeps its own dY)."""
    import weakref

    from autofuse import training

    module = autofuse.get_mlp(43, 100, activation="silu", bias=True, dtype=torch.float32, device=device,
                              save_hidden=save_hidden)
    x = torch.randn(21, 43, device=device, requires_grad=True)
    out = module(x)
    padded, alive_at_mm = [], []
    rows = training.pad_columns

    def recording_rows(t, width):
        result = rows(t, width)
        padded.append(weakref.ref(result))
        return result
    real_mm = torch.mm

    def recording_mm(a, b, **kwargs):
        alive_at_mm.append(padded[-1]() is not None if padded else None)
        return real_mm(a, b, **kwargs)
    monkeypatch.setattr(training, "pad_columns", recording_rows)
    monkeypatch.setattr(torch, "mm", recording_mm)
    dy = torch.randn(21, 43, device=device)
    out.backward(dy)
    monkeypatch.undo()
    assert len(padded) == 1 and alive_at_mm[0] is True  # the backward padded dY, and its first GEMM reads it
    assert alive_at_mm[-1] is False and alive_at_mm[-2] is False  # gone by the weight gradients' GEMMs
    # The down projection's bias gradient, now summed from the engine's dY before the padded copy is made.
    torch.testing.assert_close(module.down_proj.bias.grad, dy.sum(0), rtol=1e-5, atol=1e-5)


def test_a_guard_formats_its_message_only_when_it_fails():
    # The launchers' guards run on every call: a message is built only for a guard that fails.
    built = []
    launch.require(True, lambda: built.append("formatted") or "never")
    assert built == []
    with pytest.raises(launch.LaunchError, match="out buffer is"):
        launch.output(torch.empty(3, 4), (4, 4), torch.empty(1))


@pytest.mark.parametrize("kind", ["mlp", "linear"])
def test_a_2d_input_adds_no_view_node_and_a_3d_input_keeps_its_shape_and_gradients(kind, device):
    """A 2-D input runs the training Function on itself: a reshape that changes nothing would still add a view node
    that the engine visits every step. A [batch, tokens, features] input is reshaped both ways and its gradients
    are the float64 reference's."""
    if kind == "mlp":
        module = autofuse.get_mlp(48, 72, activation="silu", bias=True, dtype=torch.float32, device=device)
        fn, names, width, out_width = _mlp_fn("silu"), ["gate_w", "gate_b", "up_w", "up_b", "down_w", "down_b"], 48, 48
        params = _mlp_params(module)
    else:
        module = autofuse.get_linear(48, 24, bias=True, activation="gelu_tanh", dtype=torch.float32, device=device)
        fn, names, width, out_width = _linear_fn("gelu_tanh"), ["w", "b"], 48, 24
        params = {"w": module.weight, "b": module.bias}
    x2 = torch.randn(13, width, device=device, requires_grad=True)
    node = type(module(x2).grad_fn).__name__
    assert "View" not in node and "Function" in node, node
    x3 = torch.randn(2, 7, width, device=device)
    dy3 = torch.randn(2, 7, out_width, device=device)
    got = _module_grads(module, x3, dy3, names)
    assert got["x"].shape == x3.shape
    flat = {k: v.reshape(-1, v.shape[-1]) if k == "x" else v for k, v in got.items()}
    ref = _grads({k: v.double() for k, v in params.items()}, x3.reshape(-1, width).double(), fn,
                 dy3.reshape(-1, out_width).double())
    eager = _grads(params, x3.reshape(-1, width), fn, dy3.reshape(-1, out_width))
    _check_grads(flat, ref, eager, torch.float32)


def test_a_training_step_at_an_unchanged_m_reuses_its_decisions_and_stacked_weights(device, monkeypatch):
    """A host-bound step pays for every call its forward makes: at the same M, dtype and generation the module's
    training forward builds no table key and decides no form again (its last StepRun), and the stacked [Wg; Wu]
    view is found once while the weights' addresses stay. A new M is decided anew; a weight stored elsewhere (a new
    buffer) is stacked again, and the step's gradients are the float64 reference's with the new values."""
    from autofuse import training

    module = autofuse.get_mlp(40, 72, activation="silu", dtype=torch.float32, device=device)
    steps, stacks = [], []
    real_step, real_stacked = module._training_step, training.stacked
    monkeypatch.setattr(module, "_training_step", lambda *a, **k: steps.append(a[0]) or real_step(*a, **k))
    monkeypatch.setattr(training, "stacked", lambda *a: stacks.append(1) or real_stacked(*a))
    x = torch.randn(160, 40, device=device)  # 160 rows against d_model 40: one [G | U] buffer
    for _ in range(3):
        module(x.clone().requires_grad_()).sum().backward()
    assert steps == [160] and len(stacks) == 1
    module(x[:150].clone().requires_grad_()).sum().backward()
    assert steps == [160, 150]
    with torch.no_grad():  # gate and up as the halves of a new buffer, other values
        buffer = torch.randn(2, 72, 40, device=device) * 0.1
        module.gate_proj.weight.data, module.up_proj.weight.data = buffer[0], buffer[1]
    names = ["gate_w", "gate_b", "up_w", "up_b", "down_w", "down_b"]
    dy = torch.randn(150, 40, device=device)
    got = _module_grads(module, x[:150], dy, names)
    assert len(stacks) == 3  # at 150 rows, then again for the new buffer
    params = _mlp_params(module)
    ref = _grads({k: None if v is None else v.double() for k, v in params.items()}, x[:150].double(),
                 _mlp_fn("silu"), dy.double())
    _check_grads(got, ref, _grads(params, x[:150], _mlp_fn("silu"), dy), torch.float32)


def test_a_training_step_is_decided_again_after_the_module_changes_dtype(device):
    """The module's last StepRun is keyed on the weights' dtype, and .half() drops the training entries (their
    launches held views of the float32 weights): the step runs a float16 entry, and its output is the float64
    reference's within float16's rounding (inputs and weights rounded to 11 bits)."""
    module = autofuse.get_mlp(40, 72, activation="gelu", dtype=torch.float32, device=device)
    x = torch.randn(32, 40, device=device)
    module(x.clone().requires_grad_()).sum().backward()
    assert module._training_table and module._last_step is not None
    module.half()  # the float32 entries, their launches and the views of the float32 weights they held: dropped
    assert not module._training_table and module._last_step is None and not module._training_weights
    y = module(x.half().requires_grad_())
    assert y.dtype == torch.float16 and module._last_step[2] is torch.float16
    params = {k: None if v is None else v.detach().double() for k, v in _mlp_params(module).items()}
    torch.testing.assert_close(y.detach().double(), _mlp_fn("gelu")(x.half().double(), **params), rtol=2e-2, atol=2e-2)


def test_a_padded_training_step_decides_its_gemms_at_the_sizes_it_runs(monkeypatch, device):
    """An unaligned MLP trains in Padding's space: its down projection and its gated backward are checked and
    looked up at the padded sizes, which are the GEMMs that run (at the unpadded ones cuBLAS's slow kernels made a
    Triton config win that then ran the padded GEMM slower than cuBLAS), and `autofuse tune --train` keys the
    backward at the same sizes."""
    from autofuse.layout import row_width
    from autofuse.ops import get as op_spec
    from autofuse.shapes import MLPShape

    module = autofuse.get_mlp(43, 75, activation="silu", dtype=torch.float32, device=device)
    D, W = row_width(43), row_width(75)
    assert (D, W) != (43, 75)
    resolved = {}
    real_resolve = autofuse.modules.resolve_checked
    monkeypatch.setattr(autofuse.modules, "resolve_checked",
                        lambda problem, *a, **k: resolved.setdefault(problem.op, (problem.n, problem.k))
                        and real_resolve(problem, *a, **k))
    module._training_step(37, module.gate_proj.weight, save_hidden=False)
    assert resolved == {"down": (D, W), "gated_bwd": (W, D)}
    shape = MLPShape("m", 43, 75, "silu", False)
    assert op_spec("gated_bwd").dims(shape, 37)[:2] == (W, D)
    assert op_spec("down").dims(shape, 37)[:2] == (D, W)


@pytest.mark.parametrize("save_hidden", [True, False], ids=["kept_h", "recompute_h"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_padded_step_whose_rows_fill_only_their_padding_gives_the_reference_gradients(dtype, save_hidden, device,
                                                                                       monkeypatch):
    """pad_columns above ROWS_FILL_ALONE (a large step's x and dY) copies into new, uninitialised storage and zeroes
    only the padding columns: the padded x and dY must still be exactly x and dY beside zeros, so the step's
    gradients match the reference's; here forced at every size. Stale storage is made likely first: the allocator
    hands back blocks a filled tensor of the same size just freed."""
    from autofuse import training

    monkeypatch.setattr(training, "ROWS_FILL_ALONE", 1)
    module = autofuse.get_mlp(43, 75, activation="gelu_tanh", bias=True, dtype=dtype, device=device)
    module.save_hidden = save_hidden
    x = torch.randn(37, 43, dtype=dtype, device=device)
    dy = torch.randn(37, 43, dtype=dtype, device=device)
    padding = training.Padding(43, 75)
    torch.full((37, padding.D), float("nan"), dtype=dtype, device=device)  # made and freed
    padded = training.pad_columns(x, padding.D)
    assert torch.equal(padded[:, :43], x) and not padded[:, 43:].any()
    _check_mlp_module_grads(module, x, dy, "gelu_tanh", dtype)


@pytest.mark.parametrize("form", ["two-buffers", "one-buffer", "three-nodes", "recompute-h"])
def test_a_padded_module_takes_two_forwards_before_one_backward(form, device):
    """A padded step's weight copies are the module's, written again by each forward; summing two forwards' losses
    (or using a module twice in one graph) must still backpropagate, to the reference's gradients, and a parameter
    changed in place between a forward and its backward must fail the version check as eager's does."""
    from autofuse import training
    from autofuse.choose.policy import current, use

    M = {"two-buffers": 37, "one-buffer": 80, "three-nodes": 5, "recompute-h": 37}[form]
    policy = dataclasses.replace(current(), host_bound_step_macs=0) if form == "three-nodes" else current()
    with use(policy):
        module = autofuse.get_mlp(43, 75, activation="silu", bias=True, dtype=torch.float32, device=device)
        module.save_hidden = form != "recompute-h"
        run = training.step_run(M, module.gate_proj.weight,
                                module._training_step(M, module.gate_proj.weight, module.save_hidden))
        assert run.padding is not None and run.form == form
        x1, x2, dy1, dy2 = (torch.randn(M, 43, device=device) for _ in range(4))
        names = ["gate_w", "gate_b", "up_w", "up_b", "down_w", "down_b"]
        leaves = [x1.clone().requires_grad_(), x2.clone().requires_grad_()]
        module.zero_grad(set_to_none=True)
        y1, y2 = module(leaves[0]), module(leaves[1])
        ((y1 * dy1).sum() + (y2 * dy2).sum()).backward()
        got = {"x1": leaves[0].grad, "x2": leaves[1].grad}
        got.update({n: p.grad for n, p in zip(names, _param_tensors(module))})
        params = {k: v.detach().double().requires_grad_() for k, v in _mlp_params(module).items()}
        refs = [x1.double().requires_grad_(), x2.double().requires_grad_()]
        fn = _mlp_fn("silu")
        ((fn(refs[0], **params) * dy1.double()).sum() + (fn(refs[1], **params) * dy2.double()).sum()).backward()
        ref = {"x1": refs[0].grad, "x2": refs[1].grad, **{n: params[n].grad for n in names}}
        for name in ref:
            assert relative_error(got[name], ref[name]) <= GRAD_BOUNDS[torch.float32], name
        y = module(x1.clone().requires_grad_())
        with torch.no_grad():
            module.down_proj.weight.mul_(2)  # an optimizer step before the backward
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.sum().backward()


@pytest.fixture
def padded_linear_at_any_size():
    """A Linear's training forward in the padded space at the tests' small sizes too (host_bound_step_macs 0)."""
    from autofuse.choose.policy import current, use

    with use(dataclasses.replace(current(), host_bound_step_macs=0)):
        yield


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("activation", LINEAR_ACTIVATIONS)
@pytest.mark.parametrize("residual", [False, True], ids=["nores", "res"])
def test_an_unaligned_linear_trains_in_the_padded_space(dtype, activation, residual, device, monkeypatch,
                                                        padded_linear_at_any_size):
    """in_features 43 and out_features 75 (rows not 16-byte aligned): the training forward copies the weight and bias
    into padded buffers (64 x 128 here, layout.linear_width), runs the GEMMs there with the config checked at those
    sizes, and gives the reference's gradients for x, the weight, the bias and the residual."""
    from autofuse.layout import linear_width

    N, K = linear_width(75), linear_width(43)
    module = autofuse.get_linear(43, 75, bias=True, activation=activation, dtype=dtype, device=device)
    problems = []
    real_resolve = autofuse.modules.resolve_checked
    monkeypatch.setattr(autofuse.modules, "resolve_checked", lambda problem, *a, **k: problems.append(
        (problem.n, problem.k)) or real_resolve(problem, *a, **k))
    x = torch.randn(37, 43, dtype=dtype, device=device)
    dy = torch.randn(37, 75, dtype=dtype, device=device)
    r = torch.randn(37, 75, dtype=dtype, device=device) if residual else None
    got, params = _linear_module_grads(module, x, dy, r)
    assert problems == [(N, K)]
    copy = module._training_weights["padded"][0]
    assert copy.shape == (N, K) and copy.grad_fn is None and not copy.requires_grad  # data, outside the graph
    ref = _grads({k: v.double() for k, v in params.items()}, x.double(), _linear_fn(activation), dy.double())
    eager = _grads(params, x, _linear_fn(activation), dy)
    _check_grads(got, ref, eager, dtype)


def test_a_padded_linear_takes_two_forwards_before_one_backward_and_checks_its_weight(device,
                                                                                     padded_linear_at_any_size):
    """Its copies are the module's, written again by each forward: two forwards then one backward give the sum of
    their gradients; a weight changed in place before the backward fails the version check, as eager's does; a
    step below the host-bound floor (the default policy at these sizes) runs unpadded and holds no copies."""
    from autofuse.choose.policy import current, use

    module = autofuse.get_linear(43, 75, bias=True, activation="gelu", dtype=torch.float32, device=device)
    x1, x2 = torch.randn(37, 43, device=device), torch.randn(29, 43, device=device)
    dy1, dy2 = torch.randn(37, 75, device=device), torch.randn(29, 75, device=device)
    module.zero_grad(set_to_none=True)
    ((module(x1) * dy1).sum() + (module(x2) * dy2).sum()).backward()
    got = module.weight.grad.clone()
    w = module.weight.detach().double().requires_grad_()
    b = module.bias.detach().double().requires_grad_()
    fn = _linear_fn("gelu")
    ((fn(x1.double(), w, b) * dy1.double()).sum() + (fn(x2.double(), w, b) * dy2.double()).sum()).backward()
    assert relative_error(got, w.grad) <= GRAD_BOUNDS[torch.float32]
    y = module(x1)
    with torch.no_grad():
        module.weight.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
    with use(dataclasses.replace(current(), host_bound_step_macs=1e30)):
        plain = autofuse.get_linear(43, 75, bias=True, activation="gelu", dtype=torch.float32, device=device)
        plain(x1.requires_grad_()).sum().backward()
        assert plain._training_weights == {} and x1.grad is not None


@pytest.mark.parametrize("in_features, out_features", [(48, 75), (43, 80)], ids=["rows", "unaligned-k"])
@pytest.mark.parametrize("padded_step", [True, False], ids=["padded", "host-bound"])
def test_a_linear_with_unaligned_rows_trains_on_its_own_padded_storage(in_features, out_features, padded_step,
                                                                       device):
    """out_features 75 beside an aligned in_features: the training forward lays the weight out as the first rows of a
    zero-filled [N, 48] buffer, still contiguous, that the padded step reads without a copy (in_features 43 leaves
    its rows unaligned: copies, and the parameters stay plain); the gradients are the reference's, laid out as their
    parameters; state_dict saves plain tensors; a host-bound step runs unpadded on the same parameters; AdamW,
    foreach and fused, steps them as plain tensors of the same values and gradients."""
    from autofuse.choose.policy import current, use

    policy = dataclasses.replace(current(), host_bound_step_macs=0 if padded_step else 1e30)
    with use(policy):
        module = autofuse.get_linear(in_features, out_features, bias=True, activation="gelu", dtype=torch.float32,
                                     device=device)
        plain = {k: torch.nn.Parameter(v.detach().clone()) for k, v in (("w", module.weight), ("b", module.bias))}
        x = torch.randn(37, in_features, device=device)
        dy = torch.randn(37, out_features, device=device)
        r = torch.randn(37, out_features, device=device)
        got, params = _linear_module_grads(module, x, dy, r)
        laid_out = in_features == 48
        assert (module._training_layout is not None) == laid_out
        assert bool(module._training_weights) == (padded_step and not laid_out)  # copies only where not laid out
        assert module.weight.is_contiguous()
        for p in (module.weight, module.bias):
            assert p.grad.stride() == p.stride() and _dense(p) and _dense(p.grad)
        ref = _grads({k: v.double() for k, v in params.items()}, x.double(), _linear_fn("gelu"), dy.double())
        _check_grads(got, ref, _grads(params, x, _linear_fn("gelu"), dy), torch.float32)
        for name, value in module.state_dict().items():
            assert value.is_contiguous() and value.untyped_storage().nbytes() == value.numel() * 4, name
        module.zero_grad(set_to_none=True)
        for optimizer in ("foreach", "fused"):
            # Both given the module's gradients (Adam divides each by its running RMS, so near-zero gradients from
            # two GEMMs' summation orders would move updates apart): the same elementwise steps on either layout.
            opts = [torch.optim.AdamW(m, lr=1e-2, **{optimizer: True}) for m in (module.parameters(), plain.values())]
            for _ in range(2):
                module(x).square().mean().backward()
                for p, q in zip((module.weight, module.bias), plain.values()):
                    q.grad = p.grad.detach().clone(memory_format=torch.contiguous_format)  # laid out as q
                for opt in opts:
                    opt.step()
                    opt.zero_grad()
            torch.testing.assert_close(module.weight.detach(), plain["w"].detach())
            torch.testing.assert_close(module.bias.detach(), plain["b"].detach())
        with torch.no_grad():
            y = module(x)
        assert module._training_layout is None
        expected = _linear_fn("gelu")(x.double(), plain["w"].detach().double(), plain["b"].detach().double())
        assert relative_error(y, expected) <= 1e-5
