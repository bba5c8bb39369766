"""The GEMV variant (templates/*_gemv.py.jinja): decode's CUDA-core reduction for M = 1, with tile sizes of
its own (block_m 1..8, narrow N tiles, long K tiles), correct against float64 in every dtype and activation with
ragged N and K, bias and residual, with or without its split over K; searched and clamped as its own tiles."""

import pytest
import torch
from _helpers import DTYPES, assert_matches_reference

from autofuse import variants, workspaces
from autofuse.activations import GATED_ACTIVATIONS, LINEAR_ACTIVATIONS
from autofuse.configs import INTERPRETER_SPACE, KernelConfig, Shape, clamp_to_problem
from autofuse.ops.gated_up import GATED_UP, gated_up
from autofuse.ops.linear import DOWN, LINEAR, linear
from autofuse.reference import eager_gated, eager_linear, gated_reference, linear_reference
from autofuse.tune.space import SearchProblem, candidates, config_from, flat_dimensions, flat_point

N, K = 24, 40  # ragged against every tile: N over 8 / 16 columns, K over 16 / 32


def _gemv(block_m: int, split: int, block_n: int = 16, block_k: int = 16) -> KernelConfig:
    return KernelConfig(block_m, block_n, block_k, group_m=1, num_warps=4, num_stages=1, variant="gemv",
                        knobs={"split_k": split})


def _workspaces_are_zero() -> bool:
    return all(not s.any() and not c.any() for s, c in [*workspaces._workspaces.values(), *workspaces._retired])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("activation", LINEAR_ACTIVATIONS)
@pytest.mark.parametrize("M, split", [(1, 1), (1, 2), (3, 2), (8, 1)])
def test_linear_gemv_matches_float64(device, dtype, activation, M, split):
    x = torch.randn(M, K, device=device).to(dtype)
    w = (torch.randn(N, K, device=device) / K**0.5).to(dtype)
    b = torch.randn(N, device=device).to(dtype)
    r = torch.randn(M, N, device=device).to(dtype)
    for bias, residual in ((None, None), (b, r)):
        out = torch.full((M, N), float("nan"), dtype=dtype, device=device)
        linear(x, w, bias, residual, activation, _gemv(max(M, 1) if M in (1, 8) else 4, split), out=out)
        args = (x, w, bias, residual, activation)
        assert_matches_reference(out, linear_reference(*args), eager_linear(*args))
    assert _workspaces_are_zero()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("activation", GATED_ACTIVATIONS)
@pytest.mark.parametrize("M, split", [(1, 2), (5, 1)])
def test_gated_up_gemv_matches_float64(device, dtype, activation, M, split):
    x = torch.randn(M, K, device=device).to(dtype)
    wg, wu = ((torch.randn(N, K, device=device) / K**0.5).to(dtype) for _ in range(2))
    bg, bu = (torch.randn(N, device=device).to(dtype) for _ in range(2))
    for biases in ((None, None), (bg, bu)):
        out = torch.full((M, N), float("nan"), dtype=dtype, device=device)
        # block_m = 1: the one-row form (two-dimensional products); 8: the rows' form
        gated_up(x, wg, wu, *biases, activation, _gemv(1 if M == 1 else 8, split, block_n=8, block_k=32), out=out)
        args = (x, wg, wu, *biases, activation)
        assert_matches_reference(out, gated_reference(*args), eager_gated(*args))
    assert _workspaces_are_zero()


def test_more_k_slices_than_k_blocks_still_write_every_output(device):
    # K = 40 is three blocks of 16 over 4 slices: one program per tile reduces over nothing and must still
    # count its arrival.
    x, w = torch.randn(2, K, device=device), torch.randn(N, K, device=device)
    out = torch.full((2, N), float("nan"), device=device)
    linear(x, w, None, None, "none", _gemv(2, 4), out=out)
    assert_matches_reference(out, linear_reference(x, w, None, None, "none"), eager_linear(x, w, None, None, "none"))


def test_its_own_tile_sizes_are_allowed_for_it_only():
    assert _gemv(1, 1, block_n=4, block_k=1024).block_m == 1
    with pytest.raises(ValueError, match="block_m must be one of"):
        KernelConfig(4, 16, 16)  # the tensor-core variants: tl.dot needs 16
    with pytest.raises(ValueError, match="block_n must be one of"):
        _gemv(1, 1, block_n=12)
    assert KernelConfig.from_dict(_gemv(2, 4).to_dict()) == _gemv(2, 4)


def test_clamped_to_the_problem_down_to_its_own_smallest_sizes():
    assert clamp_to_problem(_gemv(8, 1, block_n=16, block_k=512), 1, 6, 40) == _gemv(1, 1, block_n=8, block_k=64)
    assert clamp_to_problem(KernelConfig(64, 64, 64), 1, 6, 40).block_m == 16  # tl.dot's minimum stays


@pytest.mark.parametrize("op", [LINEAR, DOWN, GATED_UP], ids=lambda op: op.name)
def test_it_applies_at_decodes_smallest_m_and_is_searched_with_its_own_sizes(op):
    device = variants.Device(interpret=True)
    small, large = (Shape(M, N, K, torch.bfloat16) for M in (variants.GEMV_MAX_M, variants.GEMV_MAX_M + 1))
    assert variants.GEMV in variants.applicable(op, device, small)
    assert variants.GEMV not in variants.applicable(op, device, large)
    problem = SearchProblem(op.operand_tiles, 3, N, K, torch.bfloat16, variants.applicable(op, device, small))
    found = candidates(INTERPRETER_SPACE, problem, 0, interpret=True)
    gemv = [c for c in found if c.variant == "gemv"]
    # block_m covers the 3 rows (4 or 8, clamped to 4), never fewer rows than M.
    assert gemv and {c.block_m for c in gemv} == {4} and {c.block_n for c in gemv} == {8, 16}
    assert all(c.block_m >= 16 for c in found if c.variant != "gemv")
    dims = flat_dimensions(INTERPRETER_SPACE, problem, interpret=True)
    assert dims["gemv.block_m"] == (1, 2, 4, 8) and dims["gemv.split_k"] == (1, 2)
    for config in gemv:  # the flat search reaches every one of them
        assert config_from(flat_point(config, dims)) == config


H100 = variants.Device(interpret=False, shared_memory_limit=232448, multiprocessors=132, capability=(9, 0))


@pytest.mark.parametrize("M", [1, 2, 3])
def test_a_first_use_check_times_the_gemv_configs_beside_the_heuristic_where_they_apply(M):
    small, large = Shape(M, 896, 4864, torch.bfloat16), Shape(M, 8192, 8192, torch.bfloat16)
    # (outputs, K, warps) per program, the first-use config then its alternative: one weight matrix of 2**25
    # elements or more takes one output and a short K step first, a smaller one four outputs over all of its K
    # (8192, past 4864); either then two outputs over 8192 of K on 4 warps. Gate and up: 1 x 1024 on 4, 1 x 2048 on 8.
    expected = {(LINEAR, small): ((4, 8192, 8), (2, 8192, 4)), (LINEAR, large): ((1, 512, 8), (2, 8192, 4)),
                (DOWN, small): ((4, 8192, 8), (2, 8192, 4)), (GATED_UP, small): ((1, 1024, 4), (1, 2048, 8)),
                (GATED_UP, large): ((1, 1024, 4), (1, 2048, 8))}
    for (op, shape), sizes in expected.items():
        # The gated up projection runs its first GEMV config as its heuristic (gated_pairs times the tensor-core
        # tile beside it) and times the second beside it; the others time both beside theirs.
        found = op.alternative_configs(shape, H100)
        if op is GATED_UP:
            found = (op.default_config(shape, H100), *found)
        if M > variants.GEMV_MAX_M:
            assert op.alternative_configs(shape, H100) == () and op.default_config(shape, H100).variant != "gemv"
            continue
        assert len(found) == 2
        for config, (block_n, block_k, warps) in zip(found, sizes, strict=True):
            assert config.variant == "gemv" and config.block_m == M and config.knob("split_k") == 1
            # K clamped to the problem's (4864 takes 8192)
            assert (config.block_n, config.block_k, config.num_warps, config.num_stages) == (
                block_n, min(block_k, 1 << (shape.K - 1).bit_length()), warps, 1)
        if op is not GATED_UP:
            assert op.default_config(shape, H100).variant != "gemv"  # beside the heuristic, not instead
    assert LINEAR.alternative_configs(small, variants.Device(interpret=True)) == ()


def test_the_check_times_the_alternatives_and_a_nearest_keys_kernel_once_each(monkeypatch):
    from autofuse.choose import Choice, Source, check
    from autofuse.key import Problem

    problem = Problem("down", 896, 4864, 1, torch.bfloat16, "none")
    gemv = _gemv(1, 1, block_n=8, block_k=64)
    monkeypatch.setattr(check, "alternatives_for", lambda p: (gemv,))
    heuristic = check.heuristic_for(problem)
    assert check._kernels_to_check(problem, Choice(heuristic, Source.HEURISTIC), heuristic) == [heuristic, gemv]
    nearest = KernelConfig(16, 32, 64)
    assert check._kernels_to_check(problem, Choice(nearest, Source.NEAREST), heuristic) == [nearest, heuristic, gemv]


def test_on_a_gpu_it_searches_warps_and_stages_of_its_own():
    device = variants.Device(interpret=False, shared_memory_limit=232448, multiprocessors=132, capability=(9, 0))
    problem = SearchProblem(DOWN.operand_tiles, 1, 4096, 5696, torch.bfloat16,
                            variants.applicable(DOWN, device, Shape(1, 4096, 5696, torch.bfloat16)))
    dims = flat_dimensions(DOWN.space, problem, interpret=False)
    assert dims["gemv.num_warps"] == (4, 8, 16) and dims["gemv.num_stages"] == (1,)
    assert dims["num_warps"] != dims["gemv.num_warps"]  # the tensor-core variants keep the space's
    found = [c for c in candidates(DOWN.space, problem, device.shared_memory_limit, False) if c.variant == "gemv"]
    assert {c.num_warps for c in found} == {4, 8, 16} and {c.num_stages for c in found} == {1}
    for config in found[:50]:
        assert config_from(flat_point(config, dims)) == config


@pytest.mark.parametrize("values, message", [({"num_warps": (32,)}, "num_warps values"),
                                             ({"num_stages": (0,)}, "num_stages values"),
                                             ({"block_k": (48,)}, "block_k values"),
                                             ({"group_m": (1,)}, "not one of")])
def test_a_variant_with_own_values_out_of_range_is_refused(values, message):
    variant = variants.Variant("odd_values", "a test variant", own_values=values)
    with pytest.raises(ValueError, match=message):
        variants.register(variant)
    assert "odd_values" not in [v.name for v in variants.of(DOWN)]


def test_a_tuning_run_times_the_heuristic_then_the_gemv_starts_before_its_search(monkeypatch):
    from autofuse.key import Problem, current_environment
    from autofuse.store import Store
    from autofuse.tune import driver
    from autofuse.tune.driver import Job, tune_key

    starts = (_gemv(1, 1, block_n=8, block_k=32), _gemv(1, 2, block_n=16, block_k=16))
    monkeypatch.setattr(driver, "search_starts_for", lambda problem: starts)
    monkeypatch.setattr(driver, "alternatives_for", lambda problem: ())
    key = Problem("down", N, K, 1, torch.float32, "none").key(1, current_environment(torch.device("cpu")))
    store = Store()
    tune_key(Job(key, 1, "t"), store, torch.device("cpu"), policy="random", trials=3)
    # Three trials: the heuristic's config and the two starts, none left for the search.
    heuristic = driver.heuristic_for(Problem("down", N, K, 1, torch.float32, "none"))
    assert {t.config for t in store.trials(key)} == {heuristic, *starts}
    assert all(t.status == "ok" for t in store.trials(key))


def test_a_tuning_run_times_the_stored_kernel_and_first_uses_alternatives_before_the_searchs_starts(monkeypatch):
    """A key's stored kernel (here a first-use check's record) and the configs a first-use check times beside the
    heuristic's are among a run's first trials, ahead of the op's search starts: tuning never ends slower than what
    first use chose, even with its trials spent on those starts."""
    from autofuse.key import Problem, current_environment
    from autofuse.store import Store, Winner
    from autofuse.tune import driver
    from autofuse.tune.driver import Job, tune_key

    problem = Problem("down", N, K, 1, torch.float32, "none")
    key = problem.key(1, current_environment(torch.device("cpu")))
    checked = _gemv(1, 2, block_n=8, block_k=16)
    alternative = _gemv(1, 1, block_n=16, block_k=32)
    starts = (_gemv(1, 1, block_n=8, block_k=32), _gemv(1, 2, block_n=16, block_k=16))
    monkeypatch.setattr(driver, "search_starts_for", lambda problem: starts)
    monkeypatch.setattr(driver, "alternatives_for", lambda problem: (alternative,))
    store = Store()
    store.put_winner(Winner(key, checked, 1.0, 1.0, trials=1, policy="checked"))
    tune_key(Job(key, 1, "t"), store, torch.device("cpu"), policy="random", trials=3)
    heuristic = driver.heuristic_for(problem)
    assert len({heuristic, checked, alternative}) == 3
    assert {t.config for t in store.trials(key)} == {heuristic, checked, alternative}  # the starts had no trial left


def test_the_gemv_starts_begin_with_the_first_use_config_and_fit_the_shape():
    for op, shape in ((DOWN, Shape(1, 4096, 5696, torch.bfloat16)), (GATED_UP, Shape(1, 20032, 5696, torch.bfloat16)),
                      (LINEAR, Shape(1, 96, 300, torch.bfloat16))):
        starts = op.search_starts(shape, H100)
        first = op.default_config(shape, H100) if op is GATED_UP else op.alternative_configs(shape, H100)[0]
        assert starts[0] == first and len(set(starts)) == len(starts) >= 4
        for config in starts:
            assert config.variant == "gemv" and config.block_m == shape.M
            assert config.block_k <= max(512, 1 << (shape.K - 1).bit_length())  # clamped to K
            assert variants.GEMV.fits(config, shape)
    assert DOWN.search_starts(Shape(2, 4096, 5696, torch.bfloat16), H100) == ()
    assert DOWN.search_starts(Shape(1, 4096, 5696, torch.bfloat16), variants.Device(interpret=True)) == ()


def test_a_nearest_keys_gemv_config_gives_way_where_the_gemv_does_not_apply(device):
    # A GEMV config tuned at M = 1 is the nearest key of the same shape at M = 2, where the variant does not apply:
    # the heuristic's tile stands there (run as one program row per token, the GEMV config would stream the
    # weights once per row).
    from autofuse.choose import Source, lookup
    from autofuse.key import Problem, current_environment
    from autofuse.store import Store, Winner

    device = torch.device(device)
    at_one = Problem("down", N, K, 1, torch.float32, "none", device=device)
    Store().put_winner(Winner(at_one.key(1, current_environment(device)), _gemv(1, 1), 1.0, 1.0, trials=4,
                              policy="optuna"))
    lookup.invalidate()
    assert lookup.resolve(at_one).config == _gemv(1, 1)
    for M in (variants.GEMV_MAX_M + 1, 16):
        choice = lookup.resolve(at_one.replace(M=M))
        assert choice.source == Source.HEURISTIC and choice.config.variant != "gemv"
