"""The CPU suite's checks at real model sizes, compiled on a GPU. Skipped without one (gpu marker)."""

import pytest
import torch
from _helpers import DTYPES, TOLERANCES, assert_matches_reference

import autofuse
from autofuse.reference import eager_linear, eager_mlp, linear_reference, mlp_reference

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
        ref = mlp_reference(x, *weights, activation=activation, hidden_dtype=dtype)
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
