"""The op registry: an op defined outside autofuse (here, in this test alone: its spec, launcher and
template) is rendered, tuned, cached, resolved and run without touching any autofuse module."""

import ast
import dataclasses
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import autofuse
from autofuse import dispatch, launch, ops
from autofuse.choose import Choice, Source
from autofuse.choose import lookup as resolve
from autofuse.configs import INTERPRETER_SPACE, KernelConfig, Library, SearchSpace
from autofuse.key import Problem, current_environment
from autofuse.opspec import Operand, OpSpec
from autofuse.store import Store
from autofuse.tune.driver import Job, tune_key

# The toy op's kernel: Y = relu(X W^T + b)^2, written against _common's pieces like autofuse's own.
TOY_TEMPLATE = textwrap.dedent('''\
    {% import "_common.py.jinja" as common %}
    # Y = relu(X @ W^T{% if has_bias %} + b{% endif %})^2
    import triton
    import triton.language as tl


    {{ common.output_cast(upcast_operands) }}

    {{ common.signature(kernel_name, signature) }}
    {{ common.grouped_tile_ids(False) }}
        x_ptrs = x_ptr + rows[:, None] * stride_xm + offs_k[None, :] * stride_xk
        w_ptrs = w_ptr + offs_k[:, None] * stride_wk + cols[None, :] * stride_wn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(k_first, k_last):
            x = {{ common.load_k_tile("x_ptrs", "offs_k[None, :]", upcast_operands, even_k) }}
            w = {{ common.load_k_tile("w_ptrs", "offs_k[:, None]", upcast_operands, even_k) }}
            acc = tl.dot(x, w, acc{{ common.dot_options(input_precision) }})
            x_ptrs += BLOCK_K * stride_xk
            w_ptrs += BLOCK_K * stride_wk
    {% if has_bias %}
        acc += tl.load(b_ptr + cols).to(tl.float32)[None, :]
    {% endif %}
        acc = tl.maximum(acc, 0.0)
        acc = acc * acc
        out_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :] * stride_yn, _to_output_dtype(acc, y_ptr),
                 mask=out_mask)
''')


def _relu2_linear(x, w, b, config, out=None):
    """The toy op's launcher: check, allocate, launch (autofuse.launch's shared pieces)."""
    launch.check_operands(x, w, b)
    M, K = x.shape
    N = w.shape[0]
    y = launch.output(out, (M, N), x)
    kernel = launch.kernel_for(TOY, "relu2", K, x.dtype, config, b is not None)
    launch.launch_gemm(kernel, (M, N, K), config, x.device, {"x": x, "w": w, "b": b, "y": y}, accumulators=1)
    return y


def _eager(ops_, activation):
    return F.relu(F.linear(ops_["x"], ops_["w"], ops_.get("b"))).square()


def _reference(ops_, activation, dtype):
    return F.relu(F.linear(ops_["x"].double(), ops_["w"].double(), None if ops_.get("b") is None
                           else ops_["b"].double())).square()


def _make_operands(n, k, M, bias, residual, rand):
    return {"x": rand(M, k), "w": rand(n, k) * k**-0.5, "b": rand(n) if bias else None}


TOY = OpSpec(
    name="relu2_linear",
    template="relu2_linear",
    doc="relu(x W^T + b)^2, defined in a test",
    operands=(Operand("x", "[M, K]", "mk"), Operand("w", "[N, K]", "nk"), Operand("b", "[N]", when="has_bias"),
              Operand("y", "[M, N]", "mn")),
    activations=("relu2",),
    run=lambda ops_, activation, config, out=None: _relu2_linear(ops_["x"], ops_["w"], ops_.get("b"), config, out),
    space=SearchSpace(),
    interpreter_space=INTERPRETER_SPACE,
    library={"eager": _eager},
    reference=_reference,
    make_operands=_make_operands,
    output_width=lambda n, k: n,
)


@pytest.fixture
def toy_op(tmp_path):
    (tmp_path / "relu2_linear.py.jinja").write_text(TOY_TEMPLATE)
    spec = ops.register(dataclasses.replace(TOY, template_dir=tmp_path))
    globals()["TOY"] = spec  # the launcher keys its kernel on the registered spec
    yield spec
    ops.unregister(spec.name)
    resolve.invalidate()


@pytest.mark.skipif(not torch.cuda.is_available() and __import__("os").environ.get("TRITON_INTERPRET") != "1",
                    reason="runs kernels: a GPU or Triton's interpreter")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_a_toy_op_registered_in_a_test_tunes_caches_resolves_and_runs(toy_op, device, dtype):
    device = torch.device(device)
    # Rendered from its own folder, its signature generated from its operands.
    source = autofuse.show_kernel("relu2_linear", bias=True)
    kernel = next(n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name.startswith("autofuse"))
    assert [a.arg for a in kernel.args.args][:8] == ["x_ptr", "w_ptr", "b_ptr", "y_ptr", "M", "N", "K", "stride_xm"]

    # Tuned: every trial checked against the float64 reference, the winner stored in the user cache.
    key = Problem("relu2_linear", 24, 40, 5, dtype, "relu2", True).key(5, current_environment(device))
    result = tune_key(Job(key, 5, "toy"), Store(), device, policy="exhaustive", trials=3)
    assert result.winner.trials == 3 and not result.failures
    if device.type == "cpu":  # the interpreter's timings mean nothing: its best kernel wins
        assert isinstance(result.winner.config, KernelConfig)
    assert Store().get_winner(key) == result.winner

    # Resolved from the cache, and run through the generic dispatcher.
    resolve.invalidate()
    choice = resolve.resolve(Problem("relu2_linear", 24, 40, 5, dtype, "relu2", True, False, device))
    assert (choice.config, choice.source) == (result.winner.config, "user-cache")
    operands = _make_operands(24, 40, 5, True, False, lambda *s: torch.randn(*s, device=device).to(dtype))
    with torch.no_grad():
        out = dispatch.call("relu2_linear", operands, activation="relu2", bias=True)
    ref = _reference(operands, "relu2", dtype)
    # One rounding of the output in the dtype (float32: exact products under the interpreter).
    tolerance = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(out.double(), ref, rtol=tolerance, atol=tolerance)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 4 * tolerance


def test_registry_refuses_a_second_op_of_one_name_and_unknown_names():
    with pytest.raises(ValueError, match="already registered"):
        ops.register(dataclasses.replace(ops.get("linear")))
    with pytest.raises(autofuse.AutofuseError, match="unknown op 'conv'"):
        ops.get("conv")
    assert ops.names(tunable=False) == ("gated_act", "gated_grad", "gated_dgu", "pairs_act", "bias_act", "rms_norm",
                                          "quantize_rows", "scaled_gated_act", "scaled_bias_act")
    with pytest.raises(ValueError, match="first library candidate must be 'eager'"):
        dataclasses.replace(TOY, library={"fast": _eager})


def test_library_choices_run_the_ops_library_path(device):
    lin = autofuse.get_linear(40, 24, activation="gelu", dtype=torch.float32, device=device)
    choice = Choice(Library("eager"), Source.USER_CACHE)
    x = torch.randn(5, 40, device=device)
    with torch.no_grad():
        out = dispatch.run_choice("linear", choice, {"x": x, "w": lin.weight, "b": lin.bias}, "gelu")
    torch.testing.assert_close(out, F.gelu(F.linear(x, lin.weight, lin.bias)))


def _import_graph() -> dict[str, set[str]]:
    """Module -> the autofuse modules it imports, read from every import statement (function-level
    ones too). Importing a submodule first runs its parent packages, so those count as imported (a
    cycle through a package's __init__ breaks an import order), except a module's own ancestors,
    which run before its body starts, and the top-level package, the face that re-exports the rest."""
    root = Path(autofuse.__file__).parent
    graph: dict[str, set[str]] = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                found = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for target in found:
                while target.startswith("autofuse.") and not name.startswith(target + "."):
                    if (root.parent / (target.replace(".", "/") + ".py")).is_file() or \
                            (root.parent / target.replace(".", "/") / "__init__.py").is_file():
                        targets.add(target)
                    target = target.rpartition(".")[0]
        graph[name] = targets - {name}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}

    def visit(node, path):
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path + [node, nxt]
            if nxt not in state:
                found = visit(nxt, path + [node])
                if found:
                    return found
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node, [])
            if found:
                return found
    return None


def test_the_import_graph_has_no_cycle_and_the_runtime_no_arrow_into_tune_or_tools():
    graph = _import_graph()
    assert len(graph) > 30 and graph["autofuse.render"] >= {"autofuse.opspec"}  # the reader sees the imports
    assert _cycle(graph) is None, f"import cycle: {' -> '.join(_cycle(graph))}"
    outside = ("autofuse.tune", "autofuse.cli", "autofuse.tools")
    runtime = [m for m in graph if not m.startswith(outside) and m != "autofuse"]
    into = {m: sorted(t for t in graph[m] if t.startswith(("autofuse.tune", "autofuse.tools"))) for m in runtime}
    assert not {m: t for m, t in into.items() if t}, into
    # The tuner reads the runtime's decisions, never the measuring tools.
    tuner = {m: sorted(t for t in graph[m] if t.startswith("autofuse.tools")) for m in graph if m.startswith(
        "autofuse.tune")}
    assert not {m: t for m, t in tuner.items() if t}, tuner
    # The check sees a cycle where there is one, and a function-level import too.
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert "autofuse.evaluator" in graph["autofuse.choose.check"]  # check._compare's import, inside a function
