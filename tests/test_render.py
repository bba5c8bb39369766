"""Templates render strictly, generated kernels are visible, and each distinct source is generated once."""

import ast
import os

import jinja2
import pytest
import torch

import autofuse
from autofuse import ops, render, variants
from autofuse.activations import GATED_ACTIVATIONS, LINEAR_ACTIVATIONS
from autofuse.render import KernelSpec

LINEAR, GATED_UP = ops.get("linear"), ops.get("gated_up")


def _all_specs():
    for act in LINEAR_ACTIVATIONS:
        for bias in (False, True):
            for res in (False, True):
                for even_k in (False, True):
                    for upcast in (False, True):
                        yield KernelSpec(LINEAR, act, bias, res, even_k, None, upcast)
    for act in GATED_ACTIVATIONS:
        for bias in (False, True):
            for prec in (None, "ieee", "tf32"):
                yield KernelSpec(GATED_UP, act, bias, False, False, prec, False)


def _spec_id(s):
    return f"{s.kernel_name}-{s.even_k}-{s.upcast_operands}-{s.input_precision}"


@pytest.mark.parametrize("spec", list(_all_specs()), ids=_spec_id)
def test_every_spec_renders_valid_python(spec):
    source = render.render(spec)
    tree = ast.parse(source)
    names = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
    assert spec.kernel_name in names
    assert ("mask=offs_k" in source) != spec.even_k  # masked K loop exactly when K is ragged
    assert ("b_ptr" in source or "bg_ptr" in source) == spec.has_bias
    assert ("r_ptr" in source) == spec.has_residual
    assert ('input_precision="' in source) == (spec.input_precision is not None)


def test_missing_variable_fails_loudly():
    template = render._environment((render.templates_dir(),)).get_template("linear.py.jinja")
    with pytest.raises(jinja2.UndefinedError):
        template.render(activation="none")


def test_spec_rejects_nonsense():
    with pytest.raises(ValueError, match="no activation"):
        KernelSpec(GATED_UP, "none")
    with pytest.raises(ValueError, match="residual"):
        KernelSpec(GATED_UP, "silu", has_residual=True)
    with pytest.raises(ValueError, match="no split_k variant"):
        KernelSpec(ops.get("mlp"), "silu", variant="split_k")
    with pytest.raises(ValueError, match="unknown kernel variant"):
        KernelSpec(ops.get("linear"), "none", variant="stream_k")
    with pytest.raises(autofuse.AutofuseError, match="unknown op"):
        ops.get("conv")


def test_show_kernel_returns_the_source_that_runs():
    source = autofuse.show_kernel("gated_up", activation="silu", bias=True)
    assert "def autofuse_gated_up_silu_bias(" in source
    assert "acc_gate" in source and "acc_up" in source
    assert source == render.render(KernelSpec(GATED_UP, "silu", has_bias=True, even_k=True,
                                              upcast_operands=os.environ.get("TRITON_INTERPRET") == "1"))


def test_show_kernel_bad_input():
    with pytest.raises(autofuse.AutofuseError, match="unknown op"):
        autofuse.show_kernel("conv2d")
    with pytest.raises(autofuse.AutofuseError, match="residual"):
        autofuse.show_kernel("gated_up", residual=True)


def test_generated_once_per_source(monkeypatch):
    monkeypatch.setattr(render, "_loaded", {})  # other tests in this process may have loaded this variant
    render.load_kernel.cache_clear()
    spec = KernelSpec(LINEAR, "relu", has_bias=True)
    first = render.load_kernel(spec)
    render.load_kernel.cache_clear()
    assert render.load_kernel(spec).fn is first.fn  # rendered again, the same source: not compiled again


def _variants(spec):
    import itertools

    for act, bias, residual, even_k, variant in itertools.product(
            spec.activations, (False, True), (False, True), (False, True), variants.of(spec)):
        if spec.variants_allowed(residual, variant.name) is None:
            yield KernelSpec(spec, act, bias, residual, even_k, None, False, variant.name)


def _templates_rendered(spec) -> set[str]:
    """The names of every template Jinja loads while rendering all of `spec`'s variants."""
    loaded = set()
    environment = render._environment(render._folders(spec, variants.TILE, render.templates_dir()))
    real = environment.loader.get_source

    def recording(env, name):
        loaded.add(name)
        return real(env, name)

    environment.loader.get_source = recording
    environment.cache.clear()  # loaded before: would not pass through the loader again
    try:
        for variant in _variants(spec):
            render.render(variant)
    finally:
        del environment.loader.get_source
        environment.cache.clear()
    return loaded


@pytest.mark.parametrize("name", ops.names())
def test_the_template_hash_covers_every_template_a_kernel_renders(name, tmp_path):
    """Derived, not kept by hand: an edit to any template the op's kernels load changes the tuning key."""
    spec = ops.get(name)
    rendered = _templates_rendered(spec)
    assert set(render.template_closure(spec, render.templates_dir())) == rendered
    before = render.template_hash(spec)
    for template in sorted(rendered):
        copy = tmp_path / template.replace(".", "_")
        copy.mkdir()
        for f in render.templates_dir().iterdir():
            (copy / f.name).write_text(f.read_text())
        (copy / template).write_text((copy / template).read_text() + "\n{# edited #}\n")
        assert render.hash_template_files(spec, copy) != before, template


def test_template_hash_changes_with_the_template_and_only_its_ops(tmp_path):
    before = render.template_hash(LINEAR)
    assert before == render.template_hash(ops.get("down")) and before != render.template_hash(GATED_UP)
    copy = tmp_path / "templates"
    copy.mkdir()
    for f in render.templates_dir().iterdir():
        (copy / f.name).write_text(f.read_text())
    (copy / "linear.py.jinja").write_text((copy / "linear.py.jinja").read_text() + "\n# changed\n")
    assert render.hash_template_files(LINEAR, copy) != before
    assert render.hash_template_files(GATED_UP, copy) == render.template_hash(GATED_UP)


def test_interpreted_kernel_matches_torch_for_float32():
    # The smallest end-to-end path: render -> import -> launch.
    device = "cuda" if torch.cuda.is_available() else "cpu"
    lin = autofuse.get_linear(16, 16, bias=False, dtype=torch.float32, device=device)
    x = torch.randn(3, 16, device=device)
    with torch.no_grad():
        torch.testing.assert_close(lin(x), x @ lin.weight.T, rtol=1e-5, atol=1e-5)


def test_a_variant_compiled_for_one_k_holds_that_k_in_its_source():
    from autofuse import launch
    from autofuse.configs import KernelConfig

    gemv = KernelConfig(1, 4, 512, group_m=1, num_warps=4, num_stages=1, variant="gemv", knobs={"split_k": 1})
    for op in (LINEAR, GATED_UP, ops.get("down")):
        activation = "silu" if op is GATED_UP else "none"
        built = launch.kernel_for(op, activation, 5568, torch.bfloat16, gemv, False)
        source = render.render(KernelSpec(op, activation, variant="gemv", static_k=5568))
        body = ast.parse(source).body
        kernel = next(node for node in body if isinstance(node, ast.FunctionDef) and node.name.startswith("autofuse_"))
        first = kernel.body[0]  # K the constant, before any statement reads it
        assert isinstance(first, ast.Assign) and first.targets[0].id == "K" and first.value.value == 5568
        assert built.fn is render.load_kernel(KernelSpec(op, activation, variant="gemv", static_k=5568,
                                                         upcast_operands=os.environ.get("TRITON_INTERPRET") == "1")).fn
        other = launch.kernel_for(op, activation, 4096, torch.bfloat16, gemv, False)
        assert other.fn is not built.fn  # another K, another kernel
    # The tensor-core variants take K at run time: one kernel for every K.
    tile = KernelConfig(16, 64, 64)
    assert launch.kernel_for(LINEAR, "none", 5568, torch.bfloat16, tile, False).fn is launch.kernel_for(
        LINEAR, "none", 4992, torch.bfloat16, tile, False).fn
    assert "K = " not in render.render(KernelSpec(LINEAR, "none"))


@pytest.mark.parametrize("bad", [0, -3, 2**31, 5568.0, "5568", True, "1; import os"])
def test_only_a_positive_int_k_reaches_the_source(bad):
    with pytest.raises(ValueError, match="static_k"):
        KernelSpec(LINEAR, "none", variant="gemv", static_k=bad)


def test_dependent_launches_are_rendered_only_where_the_device_takes_them(monkeypatch):
    """An MLP's up projection lets the next kernel start early and the Linear (the down projection) waits inside
    for the kernel before it (Programmatic Dependent Launch), on devices that have it (sm_90+, never under the
    interpreter); there the Linear is launched with launch_pdl. Elsewhere neither is in the source."""
    from autofuse import launch
    from autofuse.configs import KernelConfig

    config = KernelConfig(1, 8, 32, group_m=1, num_stages=1, variant="gemv", knobs={"split_k": 1})
    cpu = torch.device("cpu")
    tile = KernelConfig(16, 32, 32)
    plain = launch.kernel_for(LINEAR, "none", 64, torch.float32, config, False, device=cpu)
    assert not plain.dependent  # the interpreter: no dependent launches
    monkeypatch.setattr(launch, "dependent_launches", lambda device: True)
    waiting = launch.kernel_for(LINEAR, "none", 64, torch.float32, config, False, device=cpu)
    launching = launch.kernel_for(GATED_UP, "silu", 64, torch.float32, config, False, device=cpu)
    assert waiting.dependent and not launching.dependent
    assert not launch.kernel_for(LINEAR, "none", 64, torch.float32, tile, False, device=cpu).dependent  # GEMV only
    one_launch = launch.kernel_for(ops.get("mlp"), "silu", 64, torch.float32, tile, False)  # no device: none
    assert not one_launch.dependent
    sources = {mode: render.render(KernelSpec(op, act, even_k=True, grid_dependency=mode))
               for mode, op, act in ((None, LINEAR, "none"), ("wait", LINEAR, "none"), ("launch", GATED_UP, "silu"))}
    assert "gdc_" not in sources[None]
    body = sources["wait"].split("def autofuse_linear_none(", 1)[1].split("):\n", 1)[1].splitlines()
    assert [line for line in body if not line.lstrip().startswith("#")][0].strip() == "tl.extra.cuda.gdc_wait()"
    assert "gdc_launch_dependents()" in sources["launch"] and "gdc_wait" not in sources["launch"]
    with pytest.raises(ValueError, match="grid_dependency"):
        KernelSpec(LINEAR, "none", grid_dependency="early")

    seen = {}
    monkeypatch.setattr(launch, "launch",
                        lambda kernel, grid, tensors, sizes, options, workspace=(): seen.update(options))
    launch.launch_gemm(waiting, (1, 32, 64), config, cpu, {}, accumulators=1)
    assert seen["launch_pdl"] is True
    seen.clear()
    launch.launch_gemm(launching, (1, 32, 64), config, cpu, {}, accumulators=1)
    assert "launch_pdl" not in seen
