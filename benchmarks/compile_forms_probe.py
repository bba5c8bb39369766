"""Probe: where does an autofuse MLP compiled as an nn.Module at the top of torch.compile(mode="reduce-overhead")
lose host time that the same module called from a compiled function does not? (Issue 15.)

  python benchmarks/compile_forms_probe.py --out DIR

One gemma-2b MLP (benchmarks/compile_bench.py's model, 1 layer) at M=1, compiled in several forms, each in a
process of its own beside the eager function compiled in the same mode, timed round-robin (per_call_us: 200
back-to-back calls; host_us: batches of 10, queued), with, per form, the
profiler's average CPU time per call of the events that a compiled call is made of (guard evaluation is
"TorchDynamo Cache Lookup").
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

from autofuse.timing import plain_call_us, round_robin
from autofuse.tools.measure import host_us_sample

sys.path.insert(0, str(Path(__file__).parent))
from compile_bench import ACTIVATION, D_MODEL, _EagerStack, _in_function, _models, _Stack  # noqa: E402

EVENTS = ("TorchDynamo Cache Lookup", "AOTDispatcher Runtime Wrapper Prologue", "Pregraph bytecode",
          "aten::_foreach_copy_", "cudaGraphLaunch", "cudaLaunchKernel")


def _event_us(fn, calls: int = 50) -> dict[str, float]:
    """Average CPU µs per call of each of EVENTS and of the compiled region(s), and the GPU µs of copy kernels,
    under torch.profiler."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    found: dict[str, float] = {}
    for event in prof.key_averages():
        if event.self_device_time_total and any(w in event.key.lower() for w in ("copy", "memcpy", "multi_tensor")):
            # GPU time of copies per call: inputs copied into a CUDA graph's static buffers.
            found["GPU copies"] = found.get("GPU copies", 0.0) + event.self_device_time_total / calls
        name = "Torch-Compiled Region" if event.key.startswith("Torch-Compiled Region") else event.key
        if name in EVENTS or name == "Torch-Compiled Region":
            found[name] = found.get(name, 0.0) + event.cpu_time_total / calls
    return found


class _EagerMLP(torch.nn.Module):
    """A Hugging Face gated MLP (gate_proj, up_proj, down_proj as nn.Linear, act(gate) * up) over an autofuse MLP's
    parameter objects: what a user's eager model is, in the same module structure as autofuse's."""

    def __init__(self, mlp):
        super().__init__()
        for name in ("gate_proj", "up_proj", "down_proj"):
            linear = torch.nn.Linear(1, 1, bias=False, device="meta")
            linear.weight = getattr(mlp, name).weight
            setattr(self, name, linear)

    def forward(self, x):
        return self.down_proj(F.gelu(self.gate_proj(x), approximate=ACTIVATION.removeprefix("gelu_")) * self.up_proj(x))


BOTH = "autofuse stack and the eager module stack, each called from a function"
FORMS = ("eager nn.Module", "autofuse stack (nn.Module at the top)", "autofuse stack called from a function",
         "autofuse FusedMLP at the top (no residual)", "autofuse FusedMLP called from a function (no residual)",
         "autofuse stack, its forward method compiled", "autofuse stack (nn.Module at the top), plain weights",
         "autofuse stack (nn.Module at the top), nn.Modules not inlined", BOTH)


def _forms(stack, plain_stack=None) -> dict:
    mlp = stack.mlps[0]
    return {
        "eager nn.Module": lambda: torch.compile(_EagerStack(stack.mlps), mode="reduce-overhead"),
        "autofuse stack (nn.Module at the top)": lambda: torch.compile(stack, mode="reduce-overhead"),
        "autofuse stack called from a function": lambda: torch.compile(_in_function(stack), mode="reduce-overhead"),
        "autofuse FusedMLP at the top (no residual)": lambda: torch.compile(mlp, mode="reduce-overhead"),
        "autofuse FusedMLP called from a function (no residual)": lambda: torch.compile(_in_function(mlp),
                                                                                        mode="reduce-overhead"),
        "autofuse stack, its forward method compiled": lambda: torch.compile(stack.forward, mode="reduce-overhead"),
        # Gate and up as two plain tensors, not views of one interleaved buffer (get_mlp(interleaved=False)).
        "autofuse stack (nn.Module at the top), plain weights": lambda: torch.compile(plain_stack,
                                                                                      mode="reduce-overhead"),
        # Dynamo's older treatment of nn.Modules: parameters as constants of the graph, not inputs.
        "autofuse stack (nn.Module at the top), nn.Modules not inlined": lambda: torch.compile(
            stack, mode="reduce-overhead"),
        # Three functions in one process: the eager function, autofuse's stack and the same stack of eager modules.
        BOTH: lambda: {"autofuse stack called from a function": torch.compile(_in_function(stack),
                                                                              mode="reduce-overhead"),
                       "eager module stack called from a function": torch.compile(
                           _in_function(_Stack([_EagerMLP(m) for m in stack.mlps])), mode="reduce-overhead")},
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--only", default="", help="a regular expression: run only the forms it matches")
    parser.add_argument("--form", default=None, help="one form, timed beside the eager function in the same mode; "
                        "without it, each form in a process of its own (compiled forms of one module share its "
                        "code objects' Dynamo caches and one CUDA-graph tree, and disturb each other)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="processes per form; every second one compiles the form before the eager function")
    parser.add_argument("--form-first", action="store_true", help="with --form: compile the form first")
    args = parser.parse_args()
    if args.form is None:
        for form in (f for f in FORMS if re.search(args.only, f)):
            for repeat in range(args.repeats):
                # Which of the two is compiled and captured first alternates: neither gets the first place always.
                subprocess.run([sys.executable, __file__, "--out", args.out, "--rounds", str(args.rounds), "--form",
                                form, *(["--form-first"] if repeat % 2 else [])], check=False)
        return
    torch.manual_seed(0)
    stack, eager = _models(1)
    plain_stack = _models(1, interleaved=False)[0] if "plain weights" in args.form else None
    if "not inlined" in args.form:
        torch._dynamo.config.inline_inbuilt_nn_modules = False
    made = _forms(stack, plain_stack)[args.form]()
    fns = {"eager function": torch.compile(eager, mode="reduce-overhead"),
           **(made if isinstance(made, dict) else {args.form: made})}
    if args.form_first:
        fns = dict(reversed(fns.items()))
    x = torch.randn(1, D_MODEL, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        for fn in fns.values():
            for _ in range(5):  # compile, capture, warm up
                fn(x)
        calls = {name: (lambda fn=fn: fn(x)) for name, fn in fns.items()}
        wall = plain_call_us(calls, rounds=args.rounds, warmup=0)
        host = round_robin(calls, host_us_sample, 5 * args.rounds)
        rows = {name: dict(per_call_us=wall[name], host_us=host[name], events_us=_event_us(calls[name]))
                for name in fns}
    print(json.dumps({"form": args.form, "form_first": args.form_first, "gpu": torch.cuda.get_device_name(),
                      "torch": torch.__version__, "triton": triton.__version__, "rows": rows}), flush=True)
    with Path(args.out, "compile_forms.jsonl").open("a") as f:
        f.write(json.dumps({"form": args.form, "form_first": args.form_first, "rows": rows}) + "\n")


if __name__ == "__main__":
    main()
