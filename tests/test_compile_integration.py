"""autofuse modules inside PyTorch's compiler stack: torch.compile(fullgraph=True) without graph
breaks and with M varying, torch.export, gradients through the compiled graph; and `autofuse profile`."""

import json

import pytest
import torch
from click.testing import CliRunner

import autofuse
from autofuse.cli import main


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    # Each test compiles the same forward code again (new modules, other dtypes): without a reset the
    # compiled variants pile up past Dynamo's recompile limit (8), which fullgraph=True turns into an error.
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class _Block(torch.nn.Module):
    """LayerNorm -> autofuse MLP (residual) -> autofuse Linear with GELU: PyTorch ops around both ops."""

    def __init__(self, device, dtype):
        super().__init__()
        self.norm = torch.nn.LayerNorm(32, device=device, dtype=dtype)
        self.mlp = autofuse.get_mlp(32, 48, activation="silu", bias=True, dtype=dtype, device=device)
        self.proj = autofuse.get_linear(32, 24, activation="gelu", dtype=dtype, device=device)

    def forward(self, x):
        h = x + self.mlp(self.norm(x))
        return self.proj(h) * 2.0


def _bound(dtype):
    # float32: the same kernels on the same inputs, only PyTorch's surrounding ops may be fused and
    # reordered by Inductor (~1e-6). 16-bit: those ops round differently when fused (a few ulps).
    return 1e-5 if dtype == torch.float32 else 2e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_compile_fullgraph_matches_eager_with_varying_m(dtype, device):
    model = _Block(device, dtype)
    compiled = torch.compile(model, fullgraph=True, dynamic=True)  # fullgraph: a graph break raises
    with torch.no_grad():
        for shape in ((3, 5, 32), (7, 32), (1, 32)):  # M = 15, 7, 1 through one compiled graph
            x = torch.randn(*shape, device=device, dtype=dtype)
            ref, got = model(x).float(), compiled(x).float()
            assert ((got - ref).norm() / ref.norm()).item() <= _bound(dtype), shape


def test_export_holds_the_autofuse_ops_and_runs(device):
    model = _Block(device, torch.float32)
    x = torch.randn(4, 6, 32, device=device)
    batch = torch.export.Dim("batch", min=1, max=4096)  # M = batch * 6 stays symbolic in the program
    program = torch.export.export(model, (x,), dynamic_shapes={"x": {0: batch}})
    code = program.graph_module.code
    assert "torch.ops.autofuse.mlp.default" in code and "torch.ops.autofuse.linear.default" in code
    with torch.no_grad():
        for shape in ((4, 6, 32), (1, 6, 32), (9, 6, 32)):
            x = torch.randn(*shape, device=device)
            torch.testing.assert_close(program.module()(x), model(x), rtol=1e-5, atol=1e-5)


def test_gradients_through_the_compiled_graph_match_eager(device):
    model = _Block(device, torch.float32)
    x = torch.randn(9, 32, device=device, requires_grad=True)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")  # autograd through the ops
    compiled(x).square().sum().backward()
    got = [x.grad.clone()] + [p.grad.clone() for p in model.parameters()]
    x.grad = None
    model.zero_grad()
    model(x).square().sum().backward()
    want = [x.grad] + [p.grad for p in model.parameters()]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


def test_profile_runs_and_writes_traces(tmp_path):
    result = CliRunner().invoke(main, ["profile", "--mlp", "32,48,silu", "--linear", "32,24,gelu", "--tokens", "1,5",
                                       "--providers", "eager,autofuse", "--iters", "2", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    rows = json.loads((tmp_path / "profile.json").read_text())
    assert len(rows) == 2 * 2 * 2 and {r["provider"] for r in rows} == {"eager", "autofuse"}
    trace = json.loads((tmp_path / "mlp-32x48-M5-autofuse.json").read_text())
    names = {e.get("name", "") for e in trace["traceEvents"]}
    # The autofuse range says what ran: op, activation and each kernel's config.
    assert any(n.startswith("autofuse::mlp silu [gated_up ") and "down " in n for n in names), names
    autofuse_row = next(r for r in rows if r["provider"] == "autofuse" and r["case"] == "mlp-32x48" and r["M"] == 5)
    eager_row = next(r for r in rows if r["provider"] == "eager" and r["case"] == "mlp-32x48" and r["M"] == 5)
    assert autofuse_row["traffic_mb"] < eager_row["traffic_mb"]  # G, U and act(G) never reach memory
    assert "Chrome traces" in result.output


@pytest.mark.parametrize("args, message", [(["--mlp", "32"], "--mlp takes"), (["--providers", "nope", "--mlp", "8,8"],
                                                                              "unknown provider")])
def test_profile_rejects_bad_input_in_one_line(args, message, tmp_path):
    result = CliRunner().invoke(main, ["profile", *args, "--out", str(tmp_path)])
    assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output


@pytest.mark.gpu
def test_reduce_overhead_cuda_graphs_match_eager_at_decode_sizes():
    # torch.compile's CUDA-graph mode warms up, captures and replays the autofuse ops at two M; its
    # pool check fails if an op leaves a persistent allocation in the graph's pool (as the split-K
    # workspace once did: it is now allocated per call inside the ops).
    mlp = autofuse.get_mlp(256, 1024, dtype=torch.bfloat16, device="cuda")
    compiled = torch.compile(mlp, mode="reduce-overhead", fullgraph=True)
    with torch.no_grad():
        for M in (1, 1, 1, 16, 16, 16):  # warm-up, capture, replay; then a second M
            x = torch.randn(M, 256, device="cuda", dtype=torch.bfloat16)
            got = compiled(x).float()
            ref = mlp(x).float()
            assert ((got - ref).norm() / ref.norm()).item() <= 1e-2
