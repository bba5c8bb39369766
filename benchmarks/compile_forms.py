"""autofuse inside torch.compile(mode="reduce-overhead") at decode size, against autofuse alone and
eager PyTorch with and without the same compile mode.

  python benchmarks/compile_forms.py [--out DIR] [--layers 1,8] [--providers REGEX]

A model of L gemma-2b MLPs (2048 -> 16384 -> 2048, gelu_tanh, bf16), x = x + mlp(x) in turn, at
M = 1 and 16; L = 1 is one MLP, L = 8 amortises torch.compile's fixed per-call cost (its CUDA-graph
wrapper: input copy, guards, replay) as a real model does. Per provider and M:
- per_call_us: wall time of 200 back-to-back calls / 200, one synchronisation at the end, so
  whichever of host or GPU is slower sets it;
- host_us: host time per call with launches queued, batches of 10 calls synchronised between.
Providers are sampled round-robin (21 and 101 rounds, medians): this host's speed drifts between
runs by tens of percent, and round-robin sampling keeps that out of the ratios. For reference, a
torch.cuda.graph replay of the autofuse model (what any CUDA-graph mode can at best reach), the
eager model as an nn.Module under reduce-overhead (the cost of compiling a module) and a
profiler table of 50 compiled reduce-overhead calls per case (compile_profile.txt).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import harness
import torch

import autofuse
from autofuse.reference import eager_mlp
from autofuse.tools.measure import host_profile_text, host_us_sample, launch_hooks, plain_call_us, round_robin

D_MODEL, D_FF, ACTIVATION = 2048, 16384, "gelu_tanh"
GRAPH_REPLAY = "autofuse, torch.cuda.graph replay"  # a provider made per M: it captures at that M


class _Stack(torch.nn.Module):
    def __init__(self, mlps):
        super().__init__()
        self.mlps = torch.nn.ModuleList(mlps)

    def forward(self, x):
        for mlp in self.mlps:
            x = x + mlp(x)  # residual: a bare chain of gated MLPs is quadratic at small x and decays to 0
        return x


class _EagerStack(torch.nn.Module):
    """The same model in plain PyTorch as an nn.Module holding the autofuse modules' weights: tells a
    cost of compiling a module (parameters as graph inputs) from a cost of autofuse's op."""

    def __init__(self, mlps):
        super().__init__()
        self.weights = torch.nn.ParameterList(
            [p for m in mlps for p in (m.gate_proj.weight, m.up_proj.weight, m.down_proj.weight)])

    def forward(self, x):
        w = list(self.weights)
        for i in range(0, len(w), 3):
            x = x + eager_mlp(x, *w[i:i + 3], activation=ACTIVATION)
        return x


def _models(layers: int, interleaved: bool = True, d_model: int = D_MODEL, d_ff: int = D_FF):
    """(autofuse model, eager function over the same weights)."""
    mlps = []
    for _ in range(layers):
        mlp = autofuse.get_mlp(d_model, d_ff, activation=ACTIVATION, dtype=torch.bfloat16, device="cuda",
                               interleaved=interleaved)
        with torch.no_grad():
            for p in mlp.parameters():
                p.copy_(torch.randn_like(p) / p.shape[1] ** 0.5)
            # Without a norm between layers the residual stream grows ~quadratically per layer (the
            # gated product is a product of two projections): a small down projection keeps it O(1).
            mlp.down_proj.weight.mul_(0.1)
        mlps.append(mlp)
    weights = [(m.gate_proj.weight, m.up_proj.weight, m.down_proj.weight) for m in mlps]

    def eager(x):
        for w in weights:
            x = x + eager_mlp(x, *w, activation=ACTIVATION)
        return x
    return _Stack(mlps), eager


def _in_function(module):
    def call(x):
        return module(x)
    return call


def _graphed(model, x):
    """model(x) captured once in a torch.cuda.graph with x as its static input; the returned
    function copies its argument in and replays."""
    static_x = x.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # warm up off the capture: configs resolved, kernels compiled, workspaces made
            model(static_x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = model(static_x)

    def replay(x):
        static_x.copy_(x)
        graph.replay()
        return static_y
    return replay


def _profile_calls(fn, path: Path, title: str, calls: int = 50) -> None:
    """Appends torch.profiler's table over `calls` calls to `path`: whether a call is one graph launch,
    where its host time goes."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    with path.open("a") as f:
        f.write(f"{title}, {calls} calls\n{prof.key_averages().table(sort_by='cpu_time_total', row_limit=30)}\n\n")


def main() -> None:
    parser = harness.parser(__doc__)
    parser.add_argument("--layers", default="1,8")
    parser.add_argument("--providers", default="", help="a regular expression: time only the providers whose "
                        "names it matches (a process of their own: compiled graphs of other providers, and their "
                        "CUDA-graph trees, are then not replayed in between)")
    args = parser.parse_args()
    args.out = harness.out_dir(args.out)
    wanted = re.compile(args.providers)
    torch.manual_seed(0)
    rows = []
    for layers in map(int, args.layers.split(",")):
        model, eager = _models(layers)
        compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
        providers = {
            "eager": eager,
            "eager, compile reduce-overhead": torch.compile(eager, mode="reduce-overhead"),
            "eager nn.Module, compile reduce-overhead": torch.compile(_EagerStack(model.mlps), mode="reduce-overhead"),
            "autofuse": model,
            "autofuse, compile reduce-overhead": compiled,
            # The module called from a compiled function, as the eager function is: tells the cost of
            # compiling an nn.Module at its top from a cost of autofuse's op.
            "autofuse in a function, compile reduce-overhead": torch.compile(_in_function(model),
                                                                              mode="reduce-overhead"),
        }
        with torch.no_grad():
            for M in (1, 16):
                x = torch.randn(M, D_MODEL, device="cuda", dtype=torch.bfloat16)
                # Errors of what the MLPs add to the residual stream (x itself would dilute them).
                ref = eager(x).float() - x.float()
                fns = {name: fn for name, fn in providers.items() if wanted.search(name)}
                if wanted.search(GRAPH_REPLAY):
                    fns[GRAPH_REPLAY] = _graphed(model, x)
                errors = {}
                for name, fn in fns.items():
                    for _ in range(5):  # compile, capture, warm up
                        out = fn(x)
                    errors[name] = ((out.float() - x.float() - ref).norm() / ref.norm()).item()
                calls = {name: (lambda fn=fn: fn(x)) for name, fn in fns.items()}
                wall = plain_call_us(calls, rounds=21, warmup=0)
                host = round_robin(calls, host_us_sample, 101)
                for name in fns:
                    row = dict(layers=layers, M=M, provider=name, rel_error=errors[name], per_call_us=wall[name],
                               host_us=host[name])
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                mlp = model.mlps[0]
                print(json.dumps(dict(layers=layers, M=M, choices={op: f"{c.short()} ({mlp.config_sources(M)[op]})"
                                                                    for op, c in mlp.config_for(M).items()},
                                      launch_hooks=launch_hooks())), flush=True)
                # The plain module first: a profiler may leave launch hooks behind, which bound launches decline.
                for name in ("autofuse", "autofuse, compile reduce-overhead",
                             "eager nn.Module, compile reduce-overhead"):
                    if name not in calls:
                        continue
                    title = f"{name}: {layers} layers, M = {M}"
                    if name != "autofuse":
                        _profile_calls(calls[name], Path(args.out, "compile_profile.txt"), title)
                    with Path(args.out, "compile_cprofile.txt").open("a") as f:  # Python's share of the host time
                        f.write(f"{title}\n{host_profile_text(calls[name], calls=500, top=25)}\n")
        del model, eager, compiled, providers, fns, calls
        torch._dynamo.reset()
        torch.cuda.empty_cache()
    harness.write(args.out, "compile_forms.json", dict(rows=rows))


if __name__ == "__main__":
    main()
