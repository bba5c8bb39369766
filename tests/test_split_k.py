"""Split-K: programs that share an output tile meet in a float32 workspace that must be left zero."""

import pytest
import torch
from _helpers import DTYPES, assert_matches_reference

from autofuse import workspaces
from autofuse.choose import Choice, Source
from autofuse.configs import KernelConfig
from autofuse.ops.gated_up import gated_up
from autofuse.ops.linear import linear
from autofuse.ops.mlp import mlp_decode
from autofuse.reference import eager_gated, eager_linear, gated_reference, linear_reference

SPLIT = KernelConfig(16, 32, 16, group_m=1, num_warps=4, num_stages=2, variant="split_k", knobs={"split_k": 4})


def _workspaces_are_zero() -> bool:
    buffers = [*workspaces._workspaces.values(), *workspaces._retired]
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
        out = linear(x, w, b, None, "gelu", SPLIT)
        args = (x, w, b, None, "gelu")
        assert_matches_reference(out, linear_reference(*args), eager_linear(*args))
        assert _workspaces_are_zero()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gated_repeated_launches_stay_correct(dtype, device):
    M, N, K = 17, 40, 64
    wg, wu = (torch.randn(N, K, dtype=dtype, device=device) / K**0.5 for _ in range(2))
    for _ in range(3):
        x = torch.randn(M, K, dtype=dtype, device=device)
        out = gated_up(x, wg, wu, None, None, "silu", SPLIT)
        args = (x, wg, wu, None, None, "silu")
        assert_matches_reference(out, gated_reference(*args), eager_gated(*args))
        assert _workspaces_are_zero()


def test_more_slices_than_k_blocks(device):
    # K=32 is two blocks of 16 over 4 slices: two programs per tile reduce over nothing and must
    # still count their arrival, or the tile would never be written.
    x = torch.randn(5, 32, device=device)
    w = torch.randn(24, 32, device=device)
    out = torch.full((5, 24), float("nan"), device=device)
    linear(x, w, None, None, "none", SPLIT, out=out)
    args = (x, w, None, None, "none")
    assert_matches_reference(out, linear_reference(*args), eager_linear(*args))


def test_workspace_grows_and_keeps_old_buffers(device):
    small = linear(torch.randn(2, 32, device=device), torch.randn(16, 32, device=device), None, None,
                          "none", SPLIT)
    assert small.shape == (2, 16)
    before = {id(s) for s, _ in workspaces._workspaces.values()}
    x = torch.randn(40, 32, device=device)
    w = torch.randn(200, 32, device=device)  # 40 x 200 partial sums: more than any earlier launch
    out = linear(x, w, None, None, "none", SPLIT)
    assert_matches_reference(out, linear_reference(x, w, None, None, "none"), eager_linear(x, w, None, None, "none"))
    # The replaced buffer is retired, not freed (a captured CUDA graph may still point at it).
    assert before <= {id(s) for s, _ in [*workspaces._workspaces.values(), *workspaces._retired]}


def test_reset_workspaces_clears_a_dirty_workspace(device):
    x, (w,) = _operands(8, 32, 64, torch.float32, device)
    linear(x, w, None, None, "none", SPLIT)
    for sums, counters in workspaces._workspaces.values():
        sums.fill_(1.0)  # what a broken or interrupted launch could leave
        counters.fill_(1)
    workspaces.reset_workspaces()
    assert _workspaces_are_zero()
    out = linear(x, w, None, None, "none", SPLIT)
    assert_matches_reference(out, linear_reference(x, w, None, None, "none"), eager_linear(x, w, None, None, "none"))


DECODE_CONFIGS = [
    KernelConfig(16, 32, 16, num_warps=4, num_stages=2),
    KernelConfig(16, 16, 32, num_warps=2, num_stages=1),  # D=48 is ragged for BLOCK_D=32
    KernelConfig(32, 64, 16, num_warps=4, num_stages=3),
]


def _mlp_reference(x, wg, wu, wd, bg, bu, bd, activation):
    from autofuse.reference import linear_reference

    h = gated_reference(x, wg, wu, bg, bu, activation)
    return linear_reference(h, wd, bd, None, "none")


def _mlp_eager(x, wg, wu, wd, bg, bu, bd, activation):
    return eager_linear(eager_gated(x, wg, wu, bg, bu, activation), wd, bd, None, "none")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("config", DECODE_CONFIGS, ids=KernelConfig.short)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("M", [1, 5])
def test_decode_mlp_matches_reference_every_launch(dtype, config, bias, M, device):
    # D=48 (ragged for BLOCK_D 32), F=72 (ragged for every BLOCK_F): several programs add into each
    # output row. Two launches: the second must not see the first's sums.
    D, F = 48, 72
    wg, wu = (torch.randn(F, D, dtype=dtype, device=device) / D**0.5 for _ in range(2))
    wd = torch.randn(D, F, dtype=dtype, device=device) / F**0.5
    biases = [torch.randn(n, dtype=dtype, device=device) for n in (F, F, D)] if bias else [None] * 3
    for _ in range(2):
        x = torch.randn(M, D, dtype=dtype, device=device)
        out = torch.full((M, D), float("nan"), dtype=dtype, device=device)
        bg, bu, bd = biases
        mlp_decode(x, (wg, bg, wu, bu, wd, bd), "gelu_tanh", config, out=out)
        args = (x, wg, wu, wd, *biases, "gelu_tanh")
        assert_matches_reference(out, _mlp_reference(*args), _mlp_eager(*args))
        assert _workspaces_are_zero()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_per_call_workspaces_leave_the_persistent_ones_alone(dtype, device, monkeypatch):
    # Inside the torch.library ops a workspace is allocated per call (CUDA-graph trees allow no
    # persistent allocation in their pool): results stay right and no persistent buffer appears.
    monkeypatch.setattr(workspaces, "_workspaces", {})  # none to reuse: any persistent use would add one
    monkeypatch.setattr(workspaces, "_retired", [])
    x, (wg, wu) = _operands(9, 40, 64, dtype, device, gated=True)
    wd = torch.randn(64, 40, dtype=dtype, device=device) / 40**0.5
    with workspaces.workspaces_per_call():
        for _ in range(2):
            h = gated_up(x, wg, wu, None, None, "silu", SPLIT)
            y = linear(h, wd, None, None, "none", SPLIT)
            y1 = mlp_decode(x[:1], (wg, None, wu, None, wd, None), "silu", DECODE_CONFIGS[0])
    assert workspaces._workspaces == {} and workspaces._retired == []
    args = (x, wg, wu, None, None, "silu")
    assert_matches_reference(h, gated_reference(*args), eager_gated(*args))
    assert_matches_reference(y, linear_reference(h, wd, None, None, "none"), eager_linear(h, wd, None, None, "none"))
    decode_args = (x[:1], wg, wu, wd, None, None, None, "silu")
    assert_matches_reference(y1, _mlp_reference(*decode_args), _mlp_eager(*decode_args))
    assert not workspaces._per_call.get()  # switched off again on leaving


def test_the_library_ops_run_with_per_call_workspaces(monkeypatch, device):
    import autofuse
    from autofuse import custom_ops

    seen = []

    def spy(run):
        def wrapped(*args):
            seen.append(workspaces._per_call.get())
            return run(*args)
        return wrapped

    for entry in (custom_ops.BoundMLP, custom_ops.BoundLinear):
        monkeypatch.setattr(entry, "__call__", spy(entry.__call__))
    mlp = autofuse.get_mlp(32, 48, dtype=torch.float32, device=device)
    lin = autofuse.get_linear(32, 24, dtype=torch.float32, device=device)
    x = torch.randn(3, 32, device=device)
    w = (mlp.gate_proj.weight, None, mlp.up_proj.weight, None, mlp.down_proj.weight, None)
    torch.ops.autofuse.mlp(x, list(w), "gelu_tanh", True)
    torch.ops.autofuse.linear(x, lin.weight, lin.bias, None, "none", True)
    assert seen == [True, True] and not workspaces._per_call.get()


def test_the_library_ops_bind_no_per_call_workspace_and_replay_the_rest(device):
    """Inside the torch.library ops a split-K launch's workspace lives for one call: such a launch is
    not bound (every call takes the JIT path); launches without one are bound and replayed."""
    from autofuse import custom_ops

    workspaces.release_workspaces()
    x, (w,) = _operands(8, 32, 64, torch.float32, device)
    unsplit = KernelConfig(16, 32, 32, group_m=1, num_stages=2)
    split, plain = (custom_ops.BoundLinear({"linear": Choice(config, Source.USER_CACHE)}, "none", 8, inside_ops=True)
                    for config in (SPLIT, unsplit))
    expected = linear_reference(x, w, None, None, "none")
    with workspaces.workspaces_per_call():
        for entry in (split, plain, split, plain):
            out = entry(x, w, None, None, [w.data_ptr()], 8, (8, 32))
            assert_matches_reference(out, expected, eager_linear(x, w, None, None, "none"))
    assert split.launch is None and plain.launch is not None
    assert workspaces._workspaces == {}  # nothing persistent was allocated inside the ops


def test_released_workspaces_are_allocated_afresh_and_results_stay_right(device):
    x, (w,) = _operands(8, 32, 64, torch.float32, device)
    linear(x, w, None, None, "none", SPLIT)
    assert workspaces._workspaces
    workspaces.release_workspaces()
    assert workspaces._workspaces == {} and workspaces._retired == []
    out = linear(x, w, None, None, "none", SPLIT)
    assert workspaces._workspaces and _workspaces_are_zero()
    assert_matches_reference(out, linear_reference(x, w, None, None, "none"), eager_linear(x, w, None, None, "none"))
