"""The direct-launch path: when it may reuse a compiled kernel, and that it never changes results."""

import pytest
import torch

from autofuse import launch
from autofuse.configs import KernelConfig


def test_specialization_tells_apart_what_triton_specializes_on():
    base = torch.zeros(64, dtype=torch.float16)
    spec = launch._specialization
    assert spec((base, 32)) == spec((torch.ones(64, dtype=torch.float16), 48))  # same classes
    assert spec((base, 32)) != spec((base, 1))  # == 1
    assert spec((base, 32)) != spec((base, 17))  # not divisible by 16
    assert spec((base, 32)) != spec((base, 2**31))  # 64-bit integer
    assert spec((base, 32)) != spec((base[1:], 32))  # pointer no longer 16-byte aligned
    assert spec((base, 32)) != spec((base.to(torch.bfloat16), 32))  # dtype


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the interpreter path")
def test_no_direct_launch_under_the_interpreter(monkeypatch):
    monkeypatch.setattr(launch, "_compiled", {})
    x = torch.randn(5, 32)
    launch.linear(x, torch.randn(16, 32), None, None, "none", KernelConfig(16, 16, 32, num_stages=1))
    assert launch._compiled == {}


@pytest.mark.gpu
def test_direct_launch_matches_tritons_own(monkeypatch):
    config = KernelConfig(16, 64, 64, group_m=8, num_warps=4, num_stages=3)
    w = torch.randn(272, 200, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(272, dtype=torch.bfloat16, device="cuda")
    wide = torch.randn(4097, 201, dtype=torch.bfloat16, device="cuda")
    inputs = [wide[:1, :200], wide[:16, :200], wide[:17, 1:], wide[:4096, 1:], wide[:3, :200]]
    monkeypatch.setattr(launch, "_compiled", {})
    fast = [launch.linear(x, w, b, None, "gelu_tanh", config) for x in inputs + inputs]
    assert launch._compiled, "the direct path was never used"
    monkeypatch.setenv("AUTOFUSE_FAST_LAUNCH", "0")
    slow = [launch.linear(x, w, b, None, "gelu_tanh", config) for x in inputs + inputs]
    for a, c in zip(fast, slow):
        assert torch.equal(a, c)


@pytest.mark.gpu
def test_direct_launch_matches_tritons_own_for_the_gated_kernel(monkeypatch):
    config = KernelConfig(16, 32, 64, group_m=8, num_warps=4, num_stages=3)
    wg, wu = (torch.randn(160, 96, dtype=torch.float16, device="cuda") for _ in range(2))
    wide = torch.randn(300, 97, dtype=torch.float16, device="cuda")
    inputs = [wide[:1, :96], wide[:7, 1:], wide[:256, :96]]
    monkeypatch.setattr(launch, "_compiled", {})
    fast = [launch.gated_up(x, wg, wu, None, None, "silu", config) for x in inputs * 2]
    assert launch._compiled
    monkeypatch.setenv("AUTOFUSE_FAST_LAUNCH", "0")
    slow = [launch.gated_up(x, wg, wu, None, None, "silu", config) for x in inputs * 2]
    for a, c in zip(fast, slow):
        assert torch.equal(a, c)
