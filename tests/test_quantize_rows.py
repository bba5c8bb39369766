"""Op quantize_rows (templates/quantize_rows.py.jinja): each row of X to float8_e4m3fn with a float32 scale in one
launch, the values of linear_fp8.quantize_fp8 in every dtype, with zero rows, ragged widths, strided rows and
magnitudes from subnormal to large; what the W8A8 library paths feed torch._scaled_mm."""

import pytest
import torch
from _helpers import DTYPES

from autofuse import launch
from autofuse.ops.linear_fp8 import FP8_MAX, quantize_fp8
from autofuse.ops.quantize_rows import launch_quantize_rows


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("M, N", [(1, 17), (5, 40), (3, 4100)])
def test_rows_quantize_to_quantize_fp8s_values(device, dtype, M, N):
    # Rows spread over ten decades, so values fall on e4m3's subnormals, its normal range and its largest value;
    # a row of zeros takes scale 1. N = 4100 runs past one step of columns.
    x = (torch.randn(M, N, device=device) * torch.logspace(-6, 4, M, device=device)[:, None]).to(dtype)
    x[0, : min(N, 5)] = 0
    if M > 2:
        x[1] = 0
    q, s = launch_quantize_rows(x)
    expected_q, expected_s = quantize_fp8(x)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and q.shape == (M, N) and s.shape == (M,)
    assert torch.equal(s, expected_s)
    # Equal values (a zero may keep or lose its sign: the interpreter's e4m3 cast drops it).
    assert torch.equal(q.float(), expected_q.float())
    assert (q.float().abs().amax(dim=1)[expected_s != 1] == FP8_MAX).all()


def test_strided_rows_and_an_empty_input(device):
    base = torch.randn(6, 48, device=device)
    x = base[::2, 8:40]  # rows 96 elements apart, 32 wide
    q, s = launch_quantize_rows(x)
    expected_q, expected_s = quantize_fp8(x)
    assert torch.equal(s, expected_s) and torch.equal(q.float(), expected_q.float())
    q, s = launch_quantize_rows(torch.empty(0, 16, device=device))
    assert q.shape == (0, 16) and s.shape == (0,)


def test_bad_input_is_refused_in_one_line(device):
    for x in (torch.randn(4, device=device), torch.ones(2, 3, device=device, dtype=torch.int32)):
        with pytest.raises(launch.LaunchError, match="quantize_rows: x must be") as raised:
            launch_quantize_rows(x)
        assert "\n" not in str(raised.value)


def test_rows_written_wider_than_x_hold_zeros_past_it(device):
    x = torch.randn(3, 40, device=device)
    q, s = launch_quantize_rows(x, 48)
    expected_q, expected_s = quantize_fp8(x)
    assert q.shape == (3, 48) and torch.equal(s, expected_s)
    assert torch.equal(q[:, :40].float(), expected_q.float()) and not q[:, 40:].view(torch.uint8).any()
    with pytest.raises(launch.LaunchError, match="below the rows' 40"):
        launch_quantize_rows(x, 32)


def test_the_launch_is_bound_once_per_shape_and_replays_bit_identical_to_the_jit(device, monkeypatch):
    """A W8A8 library path quantizes on every un-graphed call: the launch is bound on the first call of a shape and
    replayed after (with new rows and new outputs each call), its values the JIT's; another width binds its own."""
    monkeypatch.setattr(launch, "_memo", {})
    replays = []
    real = launch.BoundLaunch.__call__
    monkeypatch.setattr(launch.BoundLaunch, "__call__", lambda self, t: replays.append(real(self, t)) or replays[-1])
    first = torch.randn(5, 40, device=device, dtype=torch.bfloat16)
    launch_quantize_rows(first, 48)
    assert not replays and len(launch._memo) == 1
    x = torch.randn(5, 40, device=device, dtype=torch.bfloat16) * 3
    q, s = launch_quantize_rows(x, 48)
    assert replays == [True]
    expected_q, expected_s = quantize_fp8(x)
    assert torch.equal(s, expected_s) and torch.equal(q[:, :40].float(), expected_q.float())
    assert not q[:, 40:].view(torch.uint8).any()
    launch_quantize_rows(x, 64)
    assert len(launch._memo) == 2
