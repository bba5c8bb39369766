"""Split-K: programs that share an output tile meet in a float32 workspace that must be left zero."""

import pytest
import torch
from _helpers import DTYPES, assert_matches_reference

from autofuse import launch
from autofuse.configs import KernelConfig
from autofuse.reference import eager_gated, eager_linear, gated_reference, linear_reference

SPLIT = KernelConfig(16, 32, 16, group_m=1, num_warps=4, num_stages=2, split_k=4)


def _workspaces_are_zero() -> bool:
    buffers = [*launch._workspaces.values(), *launch._retired]
    return bool(buffers) and all(not s.any() and not c.any() for s, c in buffers)


def _operands(M, N, K, dtype, device, gated=False):
    x = torch.randn(M, K, dtype=dtype, device=device)
    ws = [torch.randn(N, K, dtype=dtype, device=device) / K**0.5 for _ in range(2 if gated else 1)]
    return x, ws


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_linear_repeated_launches_stay_correct(dtype, device):
    # Three launches in a row: if a launch left partial sums or counts behind, the next would be off.
    M, N, K = 20, 48, 80  # 2x2 tiles, 5 K blocks over 4 slices: the last slice is short
    w = torch.randn(N, K, dtype=dtype, device=device) / K**0.5
    b = torch.randn(N, dtype=dtype, device=device)
    for _ in range(3):
        x = torch.randn(M, K, dtype=dtype, device=device)
        out = launch.linear(x, w, b, None, "gelu", SPLIT)
        args = (x, w, b, None, "gelu")
        assert_matches_reference(out, linear_reference(*args), eager_linear(*args))
        assert _workspaces_are_zero()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gated_repeated_launches_stay_correct(dtype, device):
    M, N, K = 17, 40, 64
    wg, wu = (torch.randn(N, K, dtype=dtype, device=device) / K**0.5 for _ in range(2))
    for _ in range(3):
        x = torch.randn(M, K, dtype=dtype, device=device)
        out = launch.gated_up(x, wg, wu, None, None, "silu", SPLIT)
        args = (x, wg, wu, None, None, "silu")
        assert_matches_reference(out, gated_reference(*args), eager_gated(*args))
        assert _workspaces_are_zero()


def test_more_slices_than_k_blocks(device):
    # K=32 is two blocks of 16 over 4 slices: two programs per tile reduce over nothing and must
    # still count their arrival, or the tile would never be written.
    x = torch.randn(5, 32, device=device)
    w = torch.randn(24, 32, device=device)
    out = torch.full((5, 24), float("nan"), device=device)
    launch.linear(x, w, None, None, "none", SPLIT, out=out)
    args = (x, w, None, None, "none")
    assert_matches_reference(out, linear_reference(*args), eager_linear(*args))


def test_workspace_grows_and_keeps_old_buffers(device):
    small = launch.linear(torch.randn(2, 32, device=device), torch.randn(16, 32, device=device), None, None,
                          "none", SPLIT)
    assert small.shape == (2, 16)
    before = {id(s) for s, _ in launch._workspaces.values()}
    x = torch.randn(40, 32, device=device)
    w = torch.randn(200, 32, device=device)  # 40 x 200 partial sums: more than any earlier launch
    out = launch.linear(x, w, None, None, "none", SPLIT)
    assert_matches_reference(out, linear_reference(x, w, None, None, "none"), eager_linear(x, w, None, None, "none"))
    # The replaced buffer is retired, not freed (a captured CUDA graph may still point at it).
    assert before <= {id(s) for s, _ in [*launch._workspaces.values(), *launch._retired]}


def test_reset_workspaces_clears_a_dirty_workspace(device):
    x, (w,) = _operands(8, 32, 64, torch.float32, device)
    launch.linear(x, w, None, None, "none", SPLIT)
    for sums, counters in launch._workspaces.values():
        sums.fill_(1.0)  # what a broken or interrupted launch could leave
        counters.fill_(1)
    launch.reset_workspaces()
    assert _workspaces_are_zero()
    out = launch.linear(x, w, None, None, "none", SPLIT)
    assert_matches_reference(out, linear_reference(x, w, None, None, "none"), eager_linear(x, w, None, None, "none"))
