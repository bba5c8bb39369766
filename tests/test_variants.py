"""Kernel variants and library candidates registered from outside: a variant of the existing linear op
(its template part, predicate and knobs), and a library candidate of it, each defined in this file alone,
are tuned, checked against float64, resolved and run, without editing the package."""

import textwrap

import pytest
import torch
import torch.nn.functional as F

import autofuse
from autofuse import dispatch, ops, render, variants
from autofuse.choose import Source, lookup
from autofuse.configs import Device, KernelConfig, Library, SearchSpace, Shape
from autofuse.device import interpreting
from autofuse.evaluator import Evaluator
from autofuse.key import Problem, current_environment
from autofuse.opspec import LibraryPath
from autofuse.reference import linear_reference
from autofuse.store import Store, Winner
from autofuse.tune.driver import Job, tune_key
from autofuse.variants import Knob, Variant

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() and __import__("os").environ.get("TRITON_INTERPRET")
                                != "1", reason="runs kernels: a GPU or Triton's interpreter")

# Y = act(X W^T + b) [+ R] with the output tiles walked column by column, in groups of GROUP_N tile-columns
# (the linear kernel walks them row by row in groups of GROUP_M). `skip_last_k` drops the last K block: a
# wrong kernel, which the tuner's float64 check must keep from winning.
WALK_TEMPLATE = textwrap.dedent('''\
    {% import "_common.py.jinja" as common %}
    # Y = {{ activation }}(X @ W^T{% if has_bias %} + b{% endif %}){% if has_residual %} + R{% endif %}, column walk
    import triton
    import triton.language as tl


    {{ common.activation_function(activation) }}


    {{ common.output_cast(upcast_operands) }}

    {{ common.signature(kernel_name, signature) }}
        tile = tl.program_id(0)
        num_pid_m = tl.cdiv(M, BLOCK_M)
        num_pid_n = tl.cdiv(N, BLOCK_N)
        num_pid_in_group = GROUP_N * num_pid_m
        first_pid_n = (tile // num_pid_in_group) * GROUP_N
        group_size_n = min(num_pid_n - first_pid_n, GROUP_N)
        pid_n = first_pid_n + ((tile % num_pid_in_group) % group_size_n)
        pid_m = (tile % num_pid_in_group) // group_size_n
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = (offs_m % M).to(tl.int64)
        cols = (offs_n % N).to(tl.int64)
        offs_k = tl.arange(0, BLOCK_K)
        x_ptrs = x_ptr + rows[:, None] * stride_xm + offs_k[None, :] * stride_xk
        w_ptrs = w_ptr + offs_k[:, None] * stride_wk + cols[None, :] * stride_wn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BLOCK_K){% if skip_last_k %} - 1{% endif %}):
            x = {{ common.load_k_tile("x_ptrs", "offs_k[None, :]", upcast_operands, even_k) }}
            w = {{ common.load_k_tile("w_ptrs", "offs_k[:, None]", upcast_operands, even_k) }}
            acc = tl.dot(x, w, acc{{ common.dot_options(input_precision) }})
            x_ptrs += BLOCK_K * stride_xk
            w_ptrs += BLOCK_K * stride_wk
    {% if has_bias %}
        acc += tl.load(b_ptr + cols).to(tl.float32)[None, :]
    {% endif %}
        acc = _activation(acc)
    {% if has_residual %}
        acc += tl.load(r_ptr + rows[:, None] * stride_rm + cols[None, :] * stride_rn).to(tl.float32)
    {% endif %}
        out_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :] * stride_yn, _to_output_dtype(acc, y_ptr),
                 mask=out_mask)
''')

# Small problems only: the predicate keeps the variant out of every search and heuristic above M = 64.
WALK_MAX_M = 64

# One rounding of the output in the dtype on top of float32 accumulation (float32 operands: products exact
# under the interpreter; 16-bit ones: half an ulp of the output, bf16's 2**-8, fp16's 2**-11, with margin).
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}

N, K, M = 40, 72, 5  # K = 72: a ragged last K block for BLOCK_K = 32


def _variant(name: str, folder, skip_last_k: bool) -> Variant:
    (folder / f"linear_{name}.py.jinja").write_text(WALK_TEMPLATE.replace(
        "{% if skip_last_k %}", "{% if true %}" if skip_last_k else "{% if false %}"))
    return Variant(name, "output tiles walked column by column", template_suffix=f"_{name}", template_dir=folder,
                   knobs={"group_n": Knob("GROUP_N", values=(1, 2, 4), interpreter_values=(1, 2), low=1, high=64)},
                   ops=("linear",), applies=lambda device, shape: shape.M <= WALK_MAX_M)


@pytest.fixture
def column_walk(tmp_path):
    before = render.template_hash(ops.get("linear"))
    variant = variants.register(_variant("column_walk", tmp_path, skip_last_k=False))
    lookup.invalidate()
    yield variant, before
    variants.unregister(variant.name)
    lookup.invalidate()


@pytest.fixture
def broken_walk(tmp_path):
    variant = variants.register(_variant("broken_walk", tmp_path, skip_last_k=True))
    yield variant
    variants.unregister(variant.name)
    lookup.invalidate()


def _group_n_values(variant: Variant) -> list[int]:
    """The knob's values the tuner searches here."""
    knob = variant.knobs["group_n"]
    return sorted(knob.interpreter_values if interpreting() else knob.values)


def _space(*kinds: str) -> SearchSpace:
    # One tile shape: the trials differ by variant and knob only.
    return SearchSpace(block_m=(16,), block_n=(32,), block_k=(32,), group_m=(1,), num_warps=(4,), num_stages=(1,),
                       variants=kinds)


def _operands(dtype, device):
    return {"x": torch.randn(M, K, device=device).to(dtype),
            "w": (torch.randn(N, K, device=device) * K**-0.5).to(dtype), "b": torch.randn(N, device=device).to(dtype)}


def _assert_close_to_float64(out, operands, dtype):
    ref = linear_reference(operands["x"], operands["w"], operands["b"], None, "gelu")
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(out.double(), ref, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_a_variant_defined_in_a_test_tunes_checks_resolves_and_runs(column_walk, device, dtype):
    variant, hash_before = column_walk
    device = torch.device(device)
    linear = ops.get("linear")
    # Registered: the op has it, its template is part of the op's tuning key, its knob is a constexpr.
    assert variant in variants.of(linear) and variant not in variants.of(ops.get("down"))
    assert render.template_hash(linear) != hash_before
    source = autofuse.show_kernel("linear", variant="column_walk", bias=True, activation="gelu")
    assert "GROUP_N: tl.constexpr" in source and "def autofuse_linear_gelu_bias_column_walk(" in source
    config = KernelConfig(16, 32, 32, variant="column_walk", knobs={"group_n": 2})
    assert KernelConfig.from_dict(config.to_dict()) == config and config.short().endswith("column_walk group_n=2")
    # The predicate: searched at small M only.
    assert variant in variants.applicable(linear, Device(interpret=True), Shape(M, N, K, dtype))
    assert variant not in variants.applicable(linear, Device(interpret=True), Shape(WALK_MAX_M + 1, N, K, dtype))

    # Tuned over its knob: every trial checked against float64 before it may win.
    key = Problem("linear", N, K, M, dtype, "gelu", True).key(M, current_environment(device))
    result = tune_key(Job(key, M, "column walk"), Store(), device, policy="exhaustive", trials=4,
                      space=_space("column_walk"))
    trials = Store().trials(key)
    assert sorted(t.config.knob("group_n") for t in trials) == _group_n_values(variant)
    assert all(t.status == "ok" for t in trials)
    assert not result.failures
    if device.type == "cpu":  # the interpreter's timings mean nothing: its best kernel wins
        assert isinstance(result.winner.config, KernelConfig)
    if isinstance(result.winner.config, KernelConfig):  # on a GPU a library path may be faster
        assert result.winner.config.variant == "column_walk"

    # Resolved from the user cache, and run.
    choice = lookup.resolve(Problem("linear", N, K, M, dtype, "gelu", True, False, device))
    assert (choice.config, choice.source) == (result.winner.config, Source.USER_CACHE)
    operands = _operands(dtype, device)
    with torch.no_grad():
        out = dispatch.call("linear", operands, activation="gelu", bias=True)
        _assert_close_to_float64(out, operands, dtype)
        # The launcher runs it directly too, at every knob value.
        for group_n in (1, 2, 4):
            config = KernelConfig(16, 32, 32, group_m=1, variant="column_walk", knobs={"group_n": group_n})
            _assert_close_to_float64(linear.run(operands, "gelu", config), operands, dtype)


def test_a_wrong_variant_is_tried_and_never_wins(column_walk, broken_walk, device):
    device = torch.device(device)
    key = Problem("linear", N, K, M, torch.float32, "gelu", True).key(M, current_environment(device))
    result = tune_key(Job(key, M, "broken walk"), Store(), device, policy="exhaustive", trials=8,
                      space=_space("broken_walk", "column_walk"))
    status = {(t.config.variant, t.config.knob("group_n")): t.status for t in Store().trials(key)}
    values = _group_n_values(broken_walk)
    assert status == {**{("broken_walk", n): "wrong_result" for n in values},
                      **{("column_walk", n): "ok" for n in values}}
    assert result.failures == {"wrong_result": len(values)}
    # A library path (a GPU), or the right kernel.
    assert getattr(result.winner.config, "variant", "column_walk") == "column_walk"


def test_a_variant_registered_twice_or_under_a_taken_name_is_refused(column_walk, tmp_path):
    variant, _ = column_walk
    with pytest.raises(ValueError, match="already registered"):
        variants.register(_variant("column_walk", tmp_path, skip_last_k=False))
    for name in ("has_bias", "block_m", "class", "a-b"):
        with pytest.raises(ValueError, match="identifier"):
            variants.register(Variant(name, "x"))
    with pytest.raises(ValueError, match="built in"):
        variants.unregister("tma")
    # Unregistered, its configs are refused like any unknown value, and the op's key is what it was.
    variants.unregister(variant.name)
    with pytest.raises(ValueError, match="unknown kernel variant"):
        KernelConfig(16, 32, 32, variant="column_walk", knobs={"group_n": 2})
    variants.register(variant)


@pytest.fixture
def addmm_gelu():
    calls = []

    def run(operands, activation):
        calls.append(activation)
        return F.gelu(torch.addmm(operands["b"], operands["x"], operands["w"].t()))

    def wrong(operands, activation):
        return -run(operands, activation)

    ops.register_library("linear", "addmm_gelu", LibraryPath(run, applies=lambda act, bias, res: act == "gelu" and bias
                                                             and not res))
    ops.register_library("linear", "wrong_gelu", wrong)
    yield calls
    ops.unregister_library("linear", "addmm_gelu")
    ops.unregister_library("linear", "wrong_gelu")
    lookup.invalidate()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_library_candidate_defined_in_a_test_is_checked_resolved_and_run(addmm_gelu, device, dtype):
    device = torch.device(device)
    linear = ops.get("linear")
    assert "addmm_gelu" in linear.library_for("gelu", True, False)
    assert "addmm_gelu" not in linear.library_for("relu", True, False)  # its predicate
    with pytest.raises(ValueError, match="already has"):
        ops.register_library("linear", "eager", addmm_gelu)

    # The tuner checks every library candidate against float64 before timing it: a wrong one is left out.
    key = Problem("linear", N, K, M, dtype, "gelu", True).key(M, current_environment(device))
    evaluator = Evaluator(key, M, device, seed=0)
    try:
        library_ms = evaluator.library_ms()
    finally:
        evaluator.close()
    assert {"eager", "addmm_gelu"} <= set(library_ms) and "wrong_gelu" not in library_ms
    assert addmm_gelu

    # A record naming it (as a tune on a GPU stores where it wins) resolves to it, and the op runs it.
    Store().put_winner(Winner(key, Library("addmm_gelu"), 0.01, 0.02, None, 0, 0.0, "exhaustive"))
    lookup.invalidate()
    choice = lookup.resolve(Problem("linear", N, K, M, dtype, "gelu", True, False, device))
    assert (choice.config, choice.source) == (Library("addmm_gelu"), Source.USER_CACHE)
    operands = _operands(dtype, device)
    calls = len(addmm_gelu)
    with torch.no_grad():
        out = dispatch.call("linear", operands, activation="gelu", bias=True)
    assert len(addmm_gelu) == calls + 1
    _assert_close_to_float64(out, operands, dtype)

    # Unregistered, a record naming it is refused on load.
    ops.unregister_library("linear", "addmm_gelu")
    assert Store().get_winner(key) is None
