"""FusedMLP (gated up-projection kernel + linear down projection) against the float64 reference."""

import pytest
import torch
from _helpers import BLOCK_CONFIGS, DTYPES, assert_matches_reference, check_mlp

import autofuse
from autofuse import launch
from autofuse.activations import GATED_ACTIVATIONS, TORCH_ACTIVATIONS
from autofuse.configs import KernelConfig
from autofuse.ops.gated_up import gated_up
from autofuse.reference import gated_reference


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("activation", GATED_ACTIVATIONS)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_every_activation_dtype_bias(dtype, activation, bias, device):
    module = autofuse.get_mlp(40, 72, activation=activation, bias=bias, dtype=dtype, device=device)
    check_mlp(module, torch.randn(37, 40, dtype=dtype, device=device))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("M", [1, 7, 37, 129])
def test_odd_shapes(dtype, M, device):
    # d_model 88 and d_ff 104 are ragged for every block size of 16 and up.
    module = autofuse.get_mlp(88, 104, dtype=dtype, device=device)
    check_mlp(module, torch.randn(M, 88, dtype=dtype, device=device))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_3d_and_non_contiguous_input(dtype, device):
    module = autofuse.get_mlp(24, 40, activation="silu", dtype=dtype, device=device)
    check_mlp(module, torch.randn(2, 9, 24, dtype=dtype, device=device))
    strided = torch.randn(9, 2, 48, dtype=dtype, device=device).transpose(0, 1)[..., 1::2]
    assert not strided.is_contiguous()
    check_mlp(module, strided)


CONFIGS = BLOCK_CONFIGS


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("config", CONFIGS, ids=KernelConfig.short)
@pytest.mark.parametrize("K", [48, 64], ids=["K48", "K64"])
def test_gated_up_block_configs(dtype, config, K, device):
    M, N = 37, 40
    x = torch.randn(M, K, dtype=dtype, device=device)
    wg, wu = (torch.randn(N, K, dtype=dtype, device=device) / K**0.5 for _ in range(2))
    bg, bu = (torch.randn(N, dtype=dtype, device=device) for _ in range(2))
    out = gated_up(x, wg, wu, bg, bu, "gelu", config)
    ref = gated_reference(x, wg, wu, bg, bu, "gelu")
    peer = TORCH_ACTIVATIONS["gelu"](torch.nn.functional.linear(x, wg, bg)) * torch.nn.functional.linear(x, wu, bu)
    assert_matches_reference(out, ref, peer)


def test_gated_up_writes_every_element(monkeypatch, device):
    monkeypatch.setattr(
        launch, "allocate", lambda shape, like: torch.full(shape, float("nan"), dtype=like.dtype, device=like.device)
    )
    x = torch.randn(37, 40, device=device)
    w = torch.randn(72, 40, device=device)
    out = gated_up(x, w, w.flip(0), None, None, "silu", KernelConfig(16, 32, 16, group_m=3))
    assert torch.isfinite(out).all()


class HFStyleMLP(torch.nn.Module):
    """The layout of Gemma's / Llama's MLP in transformers."""

    def __init__(self, d_model, d_ff):
        super().__init__()
        self.gate_proj = torch.nn.Linear(d_model, d_ff, bias=False)
        self.up_proj = torch.nn.Linear(d_model, d_ff, bias=False)
        self.down_proj = torch.nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x):
        return self.down_proj(torch.nn.functional.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


def test_hugging_face_state_dict_loads_unchanged(device):
    hf = HFStyleMLP(32, 48).to(device)
    module = autofuse.get_mlp(32, 48, dtype=torch.float32, device=device)
    assert set(module.state_dict()) == set(hf.state_dict())
    module.load_state_dict(hf.state_dict())
    x = torch.randn(3, 4, 32, device=device)
    with torch.no_grad():
        torch.testing.assert_close(module(x), hf(x), rtol=1e-5, atol=1e-5)


def test_config_for_names_both_kernels(device):
    module = autofuse.get_mlp(40, 72, dtype=torch.bfloat16, device=device)
    configs = module.config_for(1)
    assert set(configs) == {"gated_up", "down"}
    assert all(isinstance(c, KernelConfig) for c in configs.values())



def test_the_one_launch_mlp_starts_its_search_from_measured_configs_at_small_m():
    from autofuse import ops, variants
    from autofuse.configs import Shape
    from autofuse.tune.space import SearchProblem, flat_dimensions, flat_point

    H100 = variants.Device(interpret=False, shared_memory_limit=232448, multiprocessors=132, capability=(9, 0))
    mlp = ops.get("mlp")
    shape = Shape(1, 8192, 2048, torch.bfloat16)
    starts = mlp.search_starts(shape, H100)
    assert [(c.block_m, c.block_n, c.block_k, c.num_warps, c.num_stages) for c in starts] == [
        (16, 64, 256, 4, 3), (16, 64, 256, 8, 3)]
    assert mlp.default_config(shape, H100) not in starts  # beside the heuristic's, not instead of it
    problem = SearchProblem(mlp.operand_tiles, 1, 8192, 2048, torch.bfloat16,
                            variants.applicable(mlp, H100, shape))
    dims = flat_dimensions(mlp.space, problem, interpret=False)
    assert all(flat_point(c, dims) is not None for c in starts)  # points of the space the search covers
    assert mlp.search_starts(Shape(64, 8192, 2048, torch.bfloat16), H100) == ()
    assert mlp.search_starts(shape, variants.Device(interpret=True)) == ()
