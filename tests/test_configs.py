"""KernelConfig validation, the feasibility filters and the heuristic."""

import pytest
import torch

from autofuse import ops
from autofuse.configs import (
    Device,
    KernelConfig,
    Library,
    Shape,
    choice_from_json,
    clamp_to_problem,
    fit_shared_memory,
    shared_memory_bytes,
    split_k,
)
from autofuse.configs import tiles as output_tiles  # this module's tiles() is an op's operand tiles
from autofuse.key import m_bucket
from autofuse.variants import GEMV_MAX_M


def heuristic_config(op, M, N, K, dtype, *, interpret, shared_memory_limit, multiprocessors=108, capability=(9, 0)):
    return ops.get(op).default_config(Shape(M, N, K, dtype),
                                      Device(interpret, shared_memory_limit, multiprocessors, capability))


def tiles(op):
    return ops.get(op).operand_tiles


def test_round_trip_through_json_dict():
    config = KernelConfig(64, 128, 32, group_m=4, num_warps=8, num_stages=3)
    assert KernelConfig.from_dict(config.to_dict()) == config


@pytest.mark.parametrize(
    "data, message",
    [
        ([64, 64, 64], "JSON object"),
        ({"block_m": 64, "block_n": 64}, "lacks: block_k"),
        ({"block_m": 64, "block_n": 64, "block_k": 64, "evil": 1}, "unknown kernel config fields: evil"),
        ({"block_m": 48, "block_n": 64, "block_k": 64}, "block_m must be one of"),
        ({"block_m": 8, "block_n": 64, "block_k": 64}, "block_m must be one of"),
        ({"block_m": 64.0, "block_n": 64, "block_k": 64}, "block_m must be one of"),
        ({"block_m": 64, "block_n": 64, "block_k": 64, "num_warps": 3}, "num_warps"),
        ({"block_m": 64, "block_n": 64, "block_k": 64, "num_stages": 0}, "num_stages"),
        ({"block_m": 64, "block_n": 64, "block_k": 64, "group_m": True}, "group_m"),
    ],
)
def test_from_dict_rejects_bad_data(data, message):
    with pytest.raises(ValueError, match=message):
        KernelConfig.from_dict(data)


def test_clamp_to_problem_never_goes_below_16():
    clamped = clamp_to_problem(KernelConfig(128, 128, 128), M=1, N=40, K=3000)
    assert (clamped.block_m, clamped.block_n, clamped.block_k) == (16, 64, 128)


def test_shared_memory_fit():
    big = KernelConfig(128, 256, 128, num_stages=5)
    assert shared_memory_bytes(big, tiles("gated_up"), torch.bfloat16) > 227 * 1024
    fitted = fit_shared_memory(big, tiles("gated_up"), torch.bfloat16, 227 * 1024)
    assert shared_memory_bytes(fitted, tiles("gated_up"), torch.bfloat16) <= 227 * 1024
    assert fitted.num_stages >= 2


@pytest.mark.parametrize("template", ["linear", "gated_up"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("M", [1, 16, 128, 1024, 16384])
@pytest.mark.parametrize("limit", [99 * 1024, 227 * 1024])
def test_heuristic_fits_every_gpu_limit(template, dtype, M, limit):
    config = heuristic_config(template, M, 16384, 2048, dtype, interpret=False, shared_memory_limit=limit)
    assert shared_memory_bytes(config, tiles(template), dtype) <= limit
    assert config.block_m <= max(16, M)


def test_m_buckets():
    assert [m_bucket(m) for m in (1, 2, 3, 16, 17, 1000, 16384, 100000)] == [1, 2, 4, 16, 32, 1024, 16384, 16384]


def _programs(config, M, N):
    return output_tiles(M, N, config) * split_k(config)


@pytest.mark.parametrize("M", [1, 16, 128])
def test_small_m_heuristic_splits_k_within_one_wave_of_the_sms(M):
    # The down projection (N=2048, K=16384) has 32 tiles of 64 columns: split-K fills the 132 SMs as far as one
    # wave allows (a second wave of split programs ran slower than the idle SMs of the first).
    down = heuristic_config("linear", M, 2048, 16384, torch.bfloat16, interpret=False,
                            shared_memory_limit=227 * 1024, multiprocessors=132)
    assert down.variant == "split_k" and 66 < _programs(down, M, 2048) <= 132
    assert -(-16384 // down.block_k) >= 2 * split_k(down)  # every slice keeps two K blocks or more
    # The gated up-projection (N=16384) has tiles enough without splitting; at decode's smallest M its heuristic is
    # the GEMV (OpSpec.gemv_first), a program per few outputs.
    up = heuristic_config("gated_up", M, 16384, 2048, torch.bfloat16, interpret=False,
                          shared_memory_limit=227 * 1024, multiprocessors=132)
    assert up.variant == ("gemv" if M <= GEMV_MAX_M else "tile") and _programs(up, M, 16384) >= 132


def test_large_m_heuristic_never_splits():
    config = heuristic_config("linear", 4096, 2048, 16384, torch.bfloat16, interpret=False,
                              shared_memory_limit=227 * 1024, multiprocessors=132)
    assert config.variant != "split_k"


def test_variants_and_their_knobs_validated():
    with pytest.raises(ValueError, match="split_k"):
        KernelConfig(16, 16, 16, variant="split_k", knobs={"split_k": 0})
    with pytest.raises(ValueError, match="split_k"):
        KernelConfig(16, 16, 16, variant="split_k")  # a variant's knobs are all given
    with pytest.raises(ValueError, match="split_k"):
        KernelConfig.from_dict({"block_m": 16, "block_n": 16, "block_k": 16, "variant": "split_k", "split_k": "4"})
    with pytest.raises(ValueError, match="unknown kernel config fields: split_k"):
        KernelConfig.from_dict({"block_m": 16, "block_n": 16, "block_k": 16, "split_k": 4})  # not the tile's knob
    with pytest.raises(ValueError, match="unknown kernel variant"):
        KernelConfig.from_dict({"block_m": 16, "block_n": 16, "block_k": 16, "variant": "warp_specialized"})
    with pytest.raises(ValueError, match="format before kernel variants"):
        KernelConfig.from_dict({"block_m": 16, "block_n": 16, "block_k": 16, "split_k": 1, "tma": False})
    # No variant named: the tile kernel.
    assert KernelConfig.from_dict({"block_m": 16, "block_n": 16, "block_k": 16}).variant == "tile"


def test_trial_names_tell_every_field_apart():
    from autofuse.store import config_id

    plain = KernelConfig(64, 64, 64)
    variants = [plain, KernelConfig(64, 64, 64, variant="tma"),
                KernelConfig(64, 64, 64, variant="split_k", knobs={"split_k": 2}),
                KernelConfig(64, 64, 64, variant="split_k", knobs={"split_k": 4}),
                KernelConfig(64, 64, 64, num_stages=4)]
    assert len({config_id(c) for c in variants}) == len(variants)


def test_large_m_heuristic_takes_tma_where_the_gpu_has_it():
    for template in ("linear", "gated_up"):
        hopper = heuristic_config(template, 4096, 16384, 4096, torch.bfloat16, interpret=False,
                                  shared_memory_limit=227 * 1024, multiprocessors=132, capability=(9, 0))
        ampere = heuristic_config(template, 4096, 16384, 4096, torch.bfloat16, interpret=False,
                                  shared_memory_limit=163 * 1024, multiprocessors=108, capability=(8, 0))
        assert hopper.variant == "tma" and ampere.variant == "tile"
        assert shared_memory_bytes(hopper, tiles(template), torch.bfloat16) <= 227 * 1024


def test_choices_of_both_kinds_round_trip():
    config = KernelConfig(64, 64, 64, variant="split_k", knobs={"split_k": 2})
    assert choice_from_json(config.to_json()) == config
    assert choice_from_json("library:eager") == Library("eager") and Library("eager").short() == "library:eager"
    for bad in ("eager", "baseline", "library:", "library:x y", "library:" + "a" * 41, 3):
        with pytest.raises(ValueError):
            choice_from_json(bad)


@pytest.mark.parametrize("M", [2, 16, 64, 128])
@pytest.mark.parametrize("op", ["gated_up", "gated_pairs"])
def test_the_gated_up_projections_never_split_k_to_fill_the_sms(op, M):
    # Fewer tiles than SMs (d_ff 2688), but a gated up-projection's split configs ran slower than its unsplit tile
    # at 24 of 25 points measured; a Linear of the same tile count splits.
    kwargs = dict(interpret=False, shared_memory_limit=227 * 1024, multiprocessors=132)
    for K in (576, 2048, 4096):
        config = heuristic_config(op, M, 2688, K, torch.bfloat16, **kwargs)
        assert config.variant == "tile" and _programs(config, M, 2688) < 132
    assert heuristic_config("linear", M, 2688, 4096, torch.bfloat16, **kwargs).variant == "split_k"


def test_the_covering_split_stops_at_the_sms_or_two_k_blocks_a_program():
    # configs._split_to_fill: the fp8 decode tiles' rule, and what decode.py --split-k compares the heuristic with.
    from autofuse.configs import _split_to_fill

    tile = KernelConfig(16, 64, 128)
    split = lambda n, k: split_k(_split_to_fill(tile, Shape(16, n, k, torch.bfloat16), 132))  # noqa: E731
    assert split(576, 2688) == 8  # 9 tiles, 21 K blocks: 16 would leave a program one K block and a bit
    assert split(2048, 16384) == 8  # 32 tiles: 8 x 32 = 256 programs, past one wave
    assert split(12800, 16384) == 1  # 200 tiles: the SMs covered unsplit
