"""The training step: forward + backward of a gated MLP, time, peak memory and gradients against the peers;
and a short training run against eager.

  python benchmarks/training.py [--out DIR] [--held-out 6 --tokens 2048,8192] [--rounds 3] [--no-training-run]

Shapes: the public ones (gemma-7b's GeGLU and Llama-3-8B's SwiGLU at M = 4096 and 16384), or with --held-out N
N gated MLPs drawn by a seeded generator (--seed), d_model 1024-4096 and d_ff 2-3x d_model, every other one with
d_ff (and every fourth with d_model) not a multiple of 8, at --tokens.

Providers: eager (F.linear + gate, autograd), torch.compile of the same function, Liger
(LigerGELUMulFunction between cuBLAS GEMMs), autofuse (get_mlp, tuned configs, its autograd), and
gemm-only: the nine GEMM-units of work a gated MLP's forward+backward needs (cuBLAS), with the
fewest buffers any implementation must hold (the [M, 2F] pre-activations, reused for their
gradient, and dH) and no pointwise work at all: a floor no implementation at cuBLAS's rate goes under.
Time: do_bench median of --steps back-to-back forward+backward steps, per step (gradients accumulate; L2 flushed
before each sample), and of the forward alone, the providers timed in turn for --rounds rounds (default 3; the
median round reported); host_us: the host's time to issue one step, which a host-bound step's time is made of;
gpu_us: the GPU's time for one step with the host ahead of it (a step is host-bound where host_us exceeds it). Peak
memory: torch.cuda.max_memory_allocated during one forward+backward, absolute (parameters, their
.grad, the input and dY included, the same for every provider) and above what was allocated before
it; autofuse is measured last, so its first-use checks' leftovers would count against it alone.
Gradients are compared with a float32 computation, beside eager's error.
"""

from __future__ import annotations

import json
import random
import statistics
import time

import harness
import torch
import torch.nn.functional as F
import triton.testing

import autofuse
from autofuse.tools.measure import gpu_us_host_ahead

# The public shapes: gemma-7b's GeGLU and a SwiGLU model (Llama-3-8B) at M = 4096 and 16384.
SHAPES = [("gemma-7b", 3072, 24576, "gelu_tanh", 4096), ("gemma-7b", 3072, 24576, "gelu_tanh", 16384),
          ("llama-3-8b", 4096, 14336, "silu", 4096), ("llama-3-8b", 4096, 14336, "silu", 16384)]
HOST_SAMPLES = 5  # runs of back-to-back steps whose median is host_us (_times)
GPU_SAMPLES = 3  # runs of steps queued behind a wait whose median is gpu_us (_times)
ACT = {"gelu_tanh": lambda t: F.gelu(t, approximate="tanh"), "silu": F.silu}


def _eager(x, wg, wu, wd, activation="gelu_tanh"):
    return F.linear(ACT[activation](F.linear(x, wg)) * F.linear(x, wu), wd)


def _liger(x, wg, wu, wd, activation="gelu_tanh"):
    from liger_kernel.ops.geglu import LigerGELUMulFunction
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction

    gate = LigerGELUMulFunction if activation == "gelu_tanh" else LigerSiLUMulFunction
    return F.linear(gate.apply(F.linear(x, wg), F.linear(x, wu)), wd)


class _GemmOnly(torch.autograd.Function):
    """The GEMMs of a gated MLP, nothing else: G | U = x [Wg; Wu]^T, Y = G Wd^T (G standing for H);
    backward dH = dY Wd, dWd = dY^T G, dX = dGU [Wg; Wu], dW = dGU^T x with the saved G | U standing
    for dGU. Its gradients are not the MLP's: it is a time and memory floor, never checked."""

    @staticmethod
    def forward(ctx, x, wg, wu, wd):
        f = wg.shape[0]
        gu = torch.empty(x.shape[0], 2 * f, dtype=x.dtype, device=x.device)
        torch.mm(x, wg.t(), out=gu[:, :f])
        torch.mm(x, wu.t(), out=gu[:, f:])
        ctx.save_for_backward(x, gu, wg, wu, wd)
        return gu[:, :f] @ wd.t()

    @staticmethod
    def backward(ctx, dy):
        x, gu, wg, wu, wd = ctx.saved_tensors
        f = wg.shape[0]
        dh = dy @ wd
        dwd = dy.t() @ gu[:, :f]
        del dh  # in a real MLP dH becomes dG | dU; here gu stands for them
        dx = gu[:, :f] @ wg
        dx.addmm_(gu[:, f:], wu)
        dw = gu.t() @ x
        return dx, dw[:f], dw[f:], dwd


def _gemm_only(x, wg, wu, wd, activation=None):
    return _GemmOnly.apply(x, wg, wu, wd)


def autofuse_provider(module, save_hidden: bool):
    """The module's forward with its save_hidden set per call (False: H recomputed in the backward, one
    [M, F] activation less held), called like the other providers."""
    def run(x, wg, wu, wd):
        # Set only where it changes: nn.Module.__setattr__ (1.8 us on a desktop CPU, 25 us a step under cProfile on
        # an H200's host) is host time that no other provider pays, and a host-bound step's time is its host's.
        if module.save_hidden is not save_hidden:
            module.save_hidden = save_hidden
        return module(x)
    return run


def _peak(fn, params, x, dy):
    def step():
        fn(x, *params).backward(dy)

    step()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    return dict(peak_gib=peak / 2**30, peak_above_start_gib=(peak - before) / 2**30)


def _times(fns: dict, params, x, dy, rounds: int = 3, steps: int = 4) -> dict:
    """Per provider, the median over `rounds` of do_bench medians of `steps` back-to-back forward+backward steps
    (per step) and of the forward alone, the providers taken in turn each round (a drift of clocks during the
    minutes this takes falls on all of them alike, not on whichever runs last), the order rotated by one each
    round: what a provider inherits from the one before it then falls on each provider alike over len(fns)
    rounds. Back-to-back steps, because inside a model the host queues a step's kernels while earlier ones run:
    a single isolated step would charge each provider its Python's latency before the first kernel, which a
    real training step hides. Also, per provider, the host's time to issue one step (`host_us`: the median of
    HOST_SAMPLES runs of `steps` steps queued back to back after a synchronize, the clock read before the GPU is
    waited for, after the timed samples; a single run read up to 2.4x the step's time, 771 us a step against 316 on
    an H200), and the GPU's time for one step (`gpu_us`: steps queued behind a wait long enough that the host
    issues them all before the GPU reaches the first, measure.gpu_us_host_ahead; None where the host still fell
    behind): where host_us reaches gpu_us the step is host-bound, and its time is the host's."""
    samples = {name: ([], [], [], []) for name in fns}
    names = list(fns)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            fn = fns[name]

            def train_steps(fn=fn):
                for _ in range(steps):
                    fn(x, *params).backward(dy)

            samples[name][0].append(triton.testing.do_bench(train_steps, warmup=50, rep=300,
                                                            return_mode="median") / steps)
            samples[name][1].append(triton.testing.do_bench(lambda fn=fn: fn(x, *params), warmup=25, rep=150,
                                                            return_mode="median"))
            host = []
            for _ in range(HOST_SAMPLES):
                torch.cuda.synchronize()
                start = time.perf_counter()
                train_steps()
                host.append((time.perf_counter() - start) / steps * 1e6)
            torch.cuda.synchronize()
            samples[name][2].append(statistics.median(host))
            gpu = _median_of_some([gpu_us_host_ahead(train_steps, calls=2) for _ in range(GPU_SAMPLES)])
            samples[name][3].append(None if gpu is None else gpu / steps)
            for p in params:
                p.grad = None
            x.grad = None
    return {name: dict(ms=statistics.median(step), forward_ms=statistics.median(forward), step_ms_rounds=step,
                       host_us=statistics.median(host), gpu_us=_median_of_some(gpu))
            for name, (step, forward, host, gpu) in samples.items()}


def _median_of_some(values: list) -> float | None:
    """The median of the values that are not None; None where none is."""
    kept = [v for v in values if v is not None]
    return statistics.median(kept) if kept else None


def _grads(fn, params, x, dy):
    leaves = [p.detach().clone().requires_grad_() for p in params]
    xl = x.detach().clone().requires_grad_()
    fn(xl, *leaves).backward(dy)
    return [xl.grad] + [p.grad for p in leaves]


def held_out(seed: int, count: int, tokens: list[int]) -> list[tuple]:
    """`count` gated MLPs nobody tuned, at each of `tokens`: (name, d_model, d_ff, activation, M)."""
    rng = random.Random(seed)
    shapes = []
    for i in range(count):
        d = rng.randrange(1024, 4097, 64) + (rng.choice((1, 3, 5, 7)) if i % 4 == 3 else 0)
        f = int(d * rng.uniform(2.0, 3.0)) // 8 * 8 + (rng.choice((1, 3, 5, 7)) if i % 2 == 1 else 0)
        activation = ("gelu_tanh", "silu")[i % 2 == 0]
        shapes += [(f"drawn-{i}", d, f, activation, M) for M in tokens]
    return shapes


def only(shapes: list[tuple], points: str | None) -> list[tuple]:
    """The shapes (name, d_model, d_ff, activation, M) that `points` names: comma-separated names (every M of that
    shape) or name@M; None keeps them all. ValueError naming a point that matches none."""
    if points is None:
        return shapes
    wanted = [p.strip() for p in points.split(",") if p.strip()]
    unmatched = [p for p in wanted if not any(p in (s[0], f"{s[0]}@{s[4]}") for s in shapes)]
    if unmatched:
        raise ValueError(f"--only: no point {unmatched[0]!r} among {', '.join(sorted({s[0] for s in shapes}))}")
    return [s for s in shapes if s[0] in wanted or f"{s[0]}@{s[4]}" in wanted]


def main() -> None:
    parser = harness.parser(__doc__)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of timing, the providers in turn in each")
    parser.add_argument("--no-training-run", action="store_true", help="skip the 300-step loss comparison")
    parser.add_argument("--steps", type=int, default=4, help="back-to-back steps per timed sample")
    parser.add_argument("--held-out", type=int, default=0, metavar="N", help="N drawn shapes instead of the public")
    parser.add_argument("--seed", type=int, default=36)
    parser.add_argument("--tokens", default="2048,8192", help="the M of the drawn shapes")
    parser.add_argument("--only", default=None, metavar="POINTS",
                        help="comma-separated points to run, each a shape's name (drawn-3) or name@M (drawn-3@8192)")
    args = parser.parse_args()
    out = harness.out_dir(args.out)
    shapes = held_out(args.seed, args.held_out, [int(t) for t in args.tokens.split(",")]) if args.held_out else SHAPES
    try:
        shapes = only(shapes, args.only)
    except ValueError as e:
        parser.error(str(e))
    rows = []
    torch.manual_seed(0)
    for name, d, f, activation, M in shapes:
        # A fresh torch.compile per shape: Dynamo's recompile limit counts over the whole process, and past it
        # the compiled provider silently runs eager.
        torch._dynamo.reset()
        module = autofuse.get_mlp(d, f, activation=activation, dtype=torch.bfloat16, device="cuda")
        with torch.no_grad():
            for p in module.parameters():
                p.copy_(torch.randn_like(p) / p.shape[1] ** 0.5)
        params = [module.gate_proj.weight, module.up_proj.weight, module.down_proj.weight]
        x = torch.randn(M, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(M, d, device="cuda", dtype=torch.bfloat16)

        def eager(x, wg, wu, wd, activation=activation):
            return _eager(x, wg, wu, wd, activation)

        def liger(x, wg, wu, wd, activation=activation):
            return _liger(x, wg, wu, wd, activation)

        compiled = torch.compile(eager)
        providers = {"gemm-only": _gemm_only, "eager": eager, "torch.compile": compiled, "liger": liger,
                     "autofuse": autofuse_provider(module, True),
                     "autofuse save_hidden=False": autofuse_provider(module, False)}
        ref = _grads(eager, [p.float() for p in params], x.float(), dy.float())
        eager_grads = _grads(eager, params, x, dy)
        shape_rows, timed = [], {}
        for provider, fn in providers.items():
            row = dict(shape=name, d=d, f=f, activation=activation, M=M, provider=provider)
            try:
                if provider == "gemm-only":
                    got = None  # a floor, not an MLP: nothing to check
                elif provider.startswith("autofuse"):
                    got = [x.detach().clone().requires_grad_()]
                    module.zero_grad(set_to_none=True)
                    fn(got[0], *params).backward(dy)
                    got = [got[0].grad] + [p.grad for p in params]
                else:
                    got = _grads(fn, params, x, dy)
                if got is not None:
                    row["grad_error_vs_fp32"] = [((g.float() - r).norm() / r.norm()).item()
                                                 for g, r in zip(got, ref)]
                    row["eager_error_vs_fp32"] = [((g.float() - r).norm() / r.norm()).item()
                                                  for g, r in zip(eager_grads, ref)]
                del got  # the checked gradients must not count in the next provider's memory
                for p in params:
                    p.grad = None
                x.grad = None
                row.update(_peak(fn, params, x, dy))
                timed[provider] = fn
                if provider.startswith("autofuse"):
                    step = module._training_step(M, module.gate_proj.weight, module.save_hidden)
                    row["configs"] = {op: c.short() if c is not None else "eager"
                                      for op, c in (("down", step.down_config), ("gated_bwd", step.backward_config))}
                row["status"] = "ok"
            except Exception as e:  # noqa: BLE001 - a provider that cannot run is reported, not fatal
                row.update(status=f"{type(e).__name__}: {e}"[:300])
            shape_rows.append(row)
            for p in params:
                p.grad = None
            x.grad = None
        times = _times(timed, params, x, dy, rounds=args.rounds, steps=args.steps)
        for row in shape_rows:
            row.update(times.get(row["provider"], {}))
            rows.append(row)
            print(json.dumps(row), flush=True)
    if not args.no_training_run:
        rows.append(training_run())
        print(json.dumps(rows[-1]), flush=True)
    harness.write(out, "training.json" if not args.held_out else "training_held_out.json", {"rows": rows})


def training_run(steps: int = 300) -> dict:
    """A small GeGLU-MLP regression model, trained from the same initial weights by autofuse and by
    eager PyTorch (Adam, bf16 parameters): the two loss curves side by side."""
    torch.manual_seed(1)
    d, f, batch = 512, 2048, 256
    fused = autofuse.get_mlp(d, f, activation="gelu_tanh", dtype=torch.bfloat16, device="cuda")
    eager = [p.detach().clone().requires_grad_() for p in
             (fused.gate_proj.weight, fused.up_proj.weight, fused.down_proj.weight)]
    teacher = torch.randn(d, d, device="cuda") / d**0.5
    opt_f = torch.optim.Adam(fused.parameters(), lr=1e-3)
    opt_e = torch.optim.Adam(eager, lr=1e-3)
    losses = []
    for step in range(steps):
        x = torch.randn(batch, d, device="cuda", generator=None).bfloat16()
        target = torch.tanh(x.float() @ teacher).bfloat16()
        lf = F.mse_loss(fused(x).float(), target.float())
        le = F.mse_loss(_eager(x, *eager).float(), target.float())
        for opt, loss in ((opt_f, lf), (opt_e, le)):
            opt.zero_grad()
            loss.backward()
            opt.step()
        losses.append((lf.item(), le.item()))
    rel = [abs(a - b) / b for a, b in losses]
    return dict(provider="training-run", steps=steps, first=losses[0], last=losses[-1],
                max_rel_diff=max(rel), mean_rel_diff_last_100=sum(rel[-100:]) / 100, losses=losses[::10])


if __name__ == "__main__":
    main()
