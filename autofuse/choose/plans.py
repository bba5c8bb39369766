"""Module plans as data, and the one `select` that turns a plan into the table of choices a module runs.

A Linear's plan is one op, `linear`. A gated MLP's plan is one of three tables: gated_up + down, gated_pairs
+ down (where the module keeps gate and up interleaved, layout.py), or the one-launch `mlp` (up to the
policy's one_launch_max_m rows, where the up-projection reads d_model unpadded). `select` resolves and
checks each op's choice (lookup, then check) and picks the table by the policy's rules, returning the
others it compared too (the un-graphed race, choose/race.py, runs them against each other).
"""

from __future__ import annotations

import dataclasses
import gc

import torch

from .. import variants
from ..configs import KernelConfig
from ..key import MAX_M_BUCKET, Problem, m_bucket
from . import check, lookup
from .choice import Choice, Source
from .heuristics import alternatives_for, heuristic_for
from .policy import current

Table = dict[str, Choice]


def table_key(M: int, weight: torch.Tensor) -> tuple:
    """What a resolved config table depends on: M itself up to the largest bucket (a user may have tuned
    that exact token count), then its bucket; the weights' dtype and device; and what the process has read
    of tuned configs (lookup.generation(): a tune or `cache import` in this process is seen at the next
    forward)."""
    return (M if M <= MAX_M_BUCKET else m_bucket(M), weight.dtype, weight.device, lookup.generation())


def resolve_checked(problem: Problem, tuned: bool = True) -> Choice:
    """lookup.resolve, with a kernel config that no tuning compared on this GPU and key checked against the
    library paths first (choose/check.py). `tuned=False` (the heuristic, as it is) is never checked."""
    choice = lookup.resolve(problem, tuned)
    return check.checked(problem, choice) if tuned else choice


@dataclasses.dataclass(frozen=True)
class LinearPlan:
    """act(x @ W.T + b) [+ r]: one op, `linear`, or `linear_fp8` where W is stored in fp8 (its table's entry is
    "linear" either way)."""

    in_features: int
    out_features: int
    activation: str
    bias: bool
    residual: bool = False
    op: str = "linear"

    def problem(self, M: int, dtype: torch.dtype, device: torch.device) -> Problem:
        return Problem(self.op, self.out_features, self.in_features, M, dtype, self.activation, self.bias,
                       self.residual, device)


@dataclasses.dataclass(frozen=True)
class MLPPlan:
    """down(act(gate(x)) * up(x)). `pairs`: gate and up interleaved in one buffer, so gated_pairs may stand in
    for gated_up. `d_in`: the padded d_model where the module pads it (layout.py): the up-projection's K and the
    down projection's N; the one-launch kernel, which reads one d_model for both projections, is then left out."""

    d_model: int
    d_ff: int
    activation: str
    bias: bool
    pairs: bool = False
    d_in: int | None = None
    # "fp8" or "w8a8": the weights are fp8 (FusedMLPFp8): the table's gated_up and down entries run ops
    # gated_up_<weights> and down_<weights>, and neither gated_pairs nor the one-launch kernel is planned.
    weights: str = "dense"

    def problem(self, op: str, M: int, dtype: torch.dtype, device: torch.device) -> Problem:
        """The problem of one of the plan's ops (its table entry's name) at M rows."""
        k_in = self.d_model if self.d_in is None else self.d_in
        n, k, activation = {"gated_up": (self.d_ff, k_in, self.activation),
                            "gated_pairs": (self.d_ff, k_in, self.activation),
                            "down": (k_in, self.d_ff, "none"),
                            "mlp": (self.d_ff, self.d_model, self.activation),
                            "gated_bwd": (self.d_ff, self.d_model, self.activation)}[op]
        name = op if self.weights == "dense" else f"{op}_{self.weights}"  # gated_up_fp8, down_w8a8, ...
        return Problem(name, n, k, M, dtype, activation, self.bias, False, device)

    @property
    def one_launch(self) -> bool:
        """Whether the one-launch kernel may run this plan: dense weights, d_model read unpadded."""
        return self.weights == "dense" and self.d_in in (None, self.d_model)

    def one_launch_checked(self, dtype: torch.dtype) -> bool:
        """Whether a first-use check may try the one-launch kernel: its weights (three d_model x d_ff matrices)
        within the policy's one_launch_check_max_mb."""
        megabytes = 3 * self.d_model * self.d_ff * dtype.itemsize / 1e6
        return megabytes <= current().one_launch_check_max_mb


def select(plan: LinearPlan | MLPPlan, M: int, dtype: torch.dtype, device: torch.device,
           tuned: bool) -> tuple[Table, list[Table]]:
    """(the table of choices a module runs at M rows, the other tables that choice was compared with)."""
    before = lookup.generation()  # each decision a check stores moves it (lookup.remember)
    if isinstance(plan, LinearPlan):
        found = {"linear": resolve_checked(plan.problem(M, dtype, device), tuned)}, []
    else:
        found = _select_mlp(plan, M, dtype, device, tuned)
    if lookup.generation() != before:
        # A check's compiles and timings leave Python's young generations full: their next collection fell 50-100
        # un-graphed calls later, a 2.0-3.3 ms pause inside those calls (H200, first_use.py's gc_ms), and runs
        # here instead, inside the first forward. Young generations only: a full collection there cost each first
        # forward about 0.13 s (its time outside the checks 0.21-0.26 s, against 0.07-0.15 with this).
        gc.collect(1)
    return found


def _select_mlp(plan: MLPPlan, M: int, dtype: torch.dtype, device: torch.device,
                tuned: bool) -> tuple[Table, list[Table]]:
    policy = current()
    up_problem = plan.problem("gated_up", M, dtype, device)
    if tuned:
        _precompile(plan, M, dtype, device)
    # The down projection's check first: a Linear's kernels compile sooner than the gated up-projection's (0.3-0.54
    # against 0.6-0.77 s for the split-K configs at M = 16, H100), so it times while compile workers finish those.
    down = resolve_checked(plan.problem("down", M, dtype, device), tuned)
    up = resolve_checked(up_problem, tuned)
    pair, others = {"gated_up": up, "down": down}, []
    if plan.pairs and tuned:
        pairs_problem = plan.problem("gated_pairs", M, dtype, device)
        pairs_choice = lookup.resolve(pairs_problem)
        one_gemm = check.checked(pairs_problem, pairs_choice, libraries_only=_pairs_left_out(pairs_choice, up.kernel))
        with_pairs = {"gated_pairs": one_gemm, "down": down}
        others.append(with_pairs)
        if None not in (one_gemm.time_ms, up.time_ms):
            candidates = (("gated_pairs", one_gemm), ("gated_up", up))
            faster = check.faster_of(*candidates, up_problem)
            if faster == "gated_pairs":
                pair, others = with_pairs, [pair]
    if not tuned or M > policy.one_launch_max_m or not plan.one_launch:
        return pair, others
    one_problem = plan.problem("mlp", M, dtype, device)
    fused = lookup.resolve_tuned(one_problem)
    if fused is None and all(c.source is Source.CHECKED for c in pair.values()) and plan.one_launch_checked(dtype):
        # The pair was decided by first-use checks: the one-launch kernel gets its check too, on a small MLP.
        heuristic = Choice(heuristic_for(one_problem.replace(M=one_problem.bucket)), Source.HEURISTIC)
        fused = check.checked(one_problem, heuristic)
    if fused is None or fused.kernel is None:
        return pair, others
    # The pair must beat the one launch by one_launch_margin: on a near tie of GPU times one launch wins, as an
    # un-graphed call pays each launch's host time (a bound Triton launch, or a whole PyTorch op for a library
    # choice) on top of them.
    # Timed together side by side where a GPU can time now (records timed apart at other moments misjudged tables of
    # a few microseconds: check.tables_side_by_side); else by the records.
    timed = check.tables_side_by_side({"pair": [(plan.problem(op, M, dtype, device), c) for op, c in pair.items()],
                                       "mlp": [(one_problem, fused)]})
    pair_ms = [c.time_ms for c in pair.values()]
    pair_ms, fused_ms = (timed["pair"], timed["mlp"]) if timed else (
        None if None in pair_ms else sum(pair_ms), fused.time_ms)
    if pair_ms is not None and pair_ms * (1 + policy.one_launch_margin) <= fused_ms:
        return pair, [*others, {"mlp": fused}]
    return {"mlp": fused}, [pair, *others]


def _precompile(plan: MLPPlan, M: int, dtype: torch.dtype, device: torch.device) -> None:
    """Compile at once the kernels the plan's first-use checks below will time and the tuned ones it may run
    (check.precompile): the ops' choices, the one-launch kernel's record, or its heuristic where the two ops are
    about to be checked and no one-launch record exists."""
    up_problem = plan.problem("gated_up", M, dtype, device)
    jobs = [(problem, lookup.resolve(problem)) for problem in (up_problem, plan.problem("down", M, dtype, device))]
    if plan.pairs:  # its kernels left out where the up-projection's check will time a GEMV (its GEMV configs at
        # this M): its library paths' passes alone then (None)
        bucketed = up_problem.replace(M=up_problem.bucket)
        gemv = next((c for c in (heuristic_for(bucketed), *alternatives_for(bucketed)) if _gemv(c)), None)
        pairs_problem = plan.problem("gated_pairs", M, dtype, device)
        pairs_choice = lookup.resolve(pairs_problem)
        jobs.append((pairs_problem, None if _pairs_left_out(pairs_choice, gemv) else pairs_choice))
    if M <= current().one_launch_max_m and plan.one_launch:
        problem = plan.problem("mlp", M, dtype, device)
        record = lookup.resolve_tuned(problem)
        if record is not None:  # timed beside the two ops' table (_select_mlp)
            jobs.append((problem, record))
        elif plan.one_launch_checked(dtype) and all(choice.source.unchecked for _, choice in jobs[:2]):
            jobs.append((problem, Choice(heuristic_for(problem.replace(M=problem.bucket)), Source.HEURISTIC)))
    check.precompile(jobs)


def _gemv(kernel: KernelConfig | None) -> bool:
    return kernel is not None and variants.is_gemv(kernel.variant)


def _pairs_left_out(pairs_choice: Choice, up_kernel: KernelConfig | None) -> bool:
    """Whether gated_pairs's kernels are left out of a plan's comparison, its library paths alone checked: the gated
    up-projection runs a GEMV (`up_kernel`) and no tuning or check has a record of gated_pairs at this M
    (`pairs_choice`, lookup.resolve's, is unchecked), which has no GEMV variant. Its library paths cost no kernel
    compile and may beat the GEMV: cuBLAS's one GEMM over the interleaved gate and up rows ran 70.2-71.7 us against the
    GEMV's 76.4 at 3328 -> 20256, M = 1 (H200). At M = 1 its tiles lost to gated_up's GEMV at 4 of 4 tuned keys (by
    4-37%, H100), at 12 of 12 first-use checks of six held-out MLPs (two runs) and at 23 of 24 of twelve others on an
    H100 and an H200 (the one exception, 576 -> 2665, ran 9.2 us on it against the GEMVs' 6.1 in a later run), while
    their compiles (two tile configs, 0.3-0.5 s each) set the first forward's time."""
    return _gemv(up_kernel) and pairs_choice.source.unchecked

