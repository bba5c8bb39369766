"""Every threshold that decides between candidates, in one object: change a field here (or run under
`use(...)`) and every decision that depends on it follows, at run time and in the tuner alike.

Each default is a measured finding (docs/design.md states them with their numbers):
- A first-use check times each candidate once and briefly, so a kernel must beat the fastest library path
  by `check_margin` of its time to be chosen: on a near tie the library path, which the user's PyTorch
  runs anyway, is the safe choice; so is eager among library paths (another must beat it by the same margin).
  Sized from how far a check's times and the same paths timed side by side later differed (up to 3%).
- Candidates timed one after the other differ by drift as well as by speed: where the best two are within
  `near_tie` of each other they are timed again side by side, replayed in turn, and that decides (a kernel
  timed after its library paths lost to one by 2% alone and won by 8% side by side).
- A choice is made by GPU time, which a graph replays; an un-graphed call's host time is raced (below). Below
  `host_bound_ms` of GPU time an un-graphed call's host time is of the order of its GPU time: a bound kernel
  launch costs a few microseconds of host time where each library op costs a PyTorch op's. A training step is
  not raced, so it runs a library choice's runner-up kernel where that is within `check_margin` of the library
  path's time (unraced). Keeping the kernel there in the check itself would choose it for graphs too: a Linear
  627 -> 8288 at M = 2 so chosen replayed in 11.4 us against torch.compile's 10.6 (H200). A table that runs a
  library path may be bound by its host time up to `library_host_bound_ms`: a cuBLAS GEMM through its nvjet
  kernels costs 35-58 us of host time, and 6304 -> 7040's paired GEMM + split-K down projection took 116 us a call
  un-graphed for 100 us of GPU time at M = 2, against eager's 120 (H100); such a table's un-graphed calls race.
- The MLP's one-launch kernel runs up to `one_launch_max_m` rows (beyond, its tiles' tensor-core work
  outgrows the weight traffic it saves), and the two-op pair must beat it by `one_launch_margin`: on a near
  tie one launch wins, since an un-graphed call pays each launch's host time on top.
  A first-use check of it (where no tuned record exists) runs only for MLPs of at most `one_launch_check_max_mb`
  of weights: at first use, with its heuristic config, it lost to the checked pair on every larger MLP measured
  (14 held-out shapes of 18-963 MB at M = 1 and 16, H100 and H200) and won on a 10 MB one; its kernel is the
  largest a first use compiles. Tuning still searches it at every size.
- An un-graphed call's race calls each candidate `race_calls` times back to back (so that host and GPU time overlap
  as in a decode loop), `race_rounds` times in turn; another table replaces the GPU-time winner only where its plain
  call is `race_margin` faster (host times wander more than GPU times). Each candidate's window beside the fastest
  known has checkpoints, after its first call and after `race_checkpoint_calls` calls: one slower there than the fastest
  known's windows at the same checkpoint by more than `race_first_keep` (the first call of a candidate's first window)
  or `race_keep` (per call) ends its window and is dropped: the race must not make the caller's calls much slower than
  the fastest table known (choose/race.py). After the first windows and each round one slower than the fastest by more
  than `race_round_keep` is dropped: to win it would have to gain that and `race_margin` more over the rounds left,
  and while kept each of its windows is a slow span of the caller's calls (3840 -> 12688 at M = 128 ran 119-135 us a
  call over the nine windows of 50 during its race, 1.25x eager's at worst, and 106-115 after it, H200). The race
  starts from the table of known GPU time whose estimated plain call (its host time per call, timed after binding,
  with `race_host_slack` on it, or its GPU time where that is larger) is lowest: host times read at the first call
  run up to 1.45x slower over the next few hundred calls, so of a host-bound table and one bound by a GPU time near
  it, the latter starts (3840 -> 12688 at M = 128: library tables estimated at 96-102 us a call ran 134-146 in
  their first windows, a kernel table of 111 us of GPU time 104; eager 107, H200). A table whose host time alone
  exceeds the lowest estimate (without the slack) by more than `race_host_keep`, or the lowest estimate of a table
  bound by its GPU time (its host time under it by `race_host_slack`: its plain call is that GPU time) by more than
  `race_host_keep_bound`, is dropped without a window (3840 -> 12688 at M = 128, H200: beside a kernel table of
  58-61 us of host for 108-111 of GPU time, library tables of 137-169 us of host ran their probes at 212-296 us a
  call). A start bound by its GPU time runs two windows before the others' (choose/race.py: its first reads slow). The
  first call after a switch of tables runs slow for every table,
  more for some (250-306 us for library tables of 110-114 a call beside 122-182 for a kernel table of 106-118, H200):
  bounded at 1.5x it dropped tables as fast as the fastest, so `race_first_keep` is 2.0 (3x), for a table's first
  window only, and the first call is kept out of the second checkpoint and of a window's sample.
  A window is timed from a synchronisation before its first call to one after its last, so whatever the caller does
  between two of its calls counts in it: a gap between calls over `race_gap_outlier` times (the last window's
  median gap + its median time inside a call) is foreign work, and the window starts again from the call after it;
  a window whose time less its median gap a call is over `race_gap_outlier` times its table's estimate holds a stall
  of the process (17-60 ms in the first window after graph replays, H200) and runs again; up to `race_voids` times a
  race in all.
  Counted as they were, such windows (a benchmark's 50 eager calls between two of the race's) read 377-403 us a call
  for tables of 105-126, three of the fastest table's five round windows among them, and the race of 3840 -> 12688
  at M = 128 settled on a table of 125 us a call over one whose other windows ran 105 (H200). Gaps of the same
  size at every call (a model's other layers) void nothing.
- Tuning retimes its fastest trial beside the library paths before choosing, so a tuned kernel needs only to
  be faster than the fastest library path by `tune_margin`.
- Timing budgets (ms of GPU time per candidate): `trial_budget_ms` for a tuning trial, `check_budget_ms` for
  a first-use check.
- A training step of a gated MLP is host-bound below `host_bound_step_macs` multiply-adds a GEMM (M d_model d_ff):
  only at or above it does a step whose weight gradients outweigh its activations return each from an autograd
  node of its own (training.separate_weight_gradients), which holds less than eager's and Liger's steps but costs the
  host two more autograd Functions a step (2368 -> 4872 at M = 2048, 2.4e10, ran 1.169 ms split against 0.860 as one
  node, while 2496 -> 6384, 3.3e10, 3200 -> 6655 and 3587 -> 8063 ran alike either way; H100, one process), and only
  below it does a step that keeps H hold G | U as one buffer (training.stacked_pre_activations), three cuBLAS calls
  fewer a step. A FusedLinear's training forward at unaligned sizes runs in the padded space only at or above it
  (M N K: training.linear_padded), where its copies' calls are small beside the GEMMs.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator


@dataclasses.dataclass(frozen=True)
class DecisionPolicy:
    check_margin: float = 0.03
    tune_margin: float = 0.0
    near_tie: float = 0.10
    host_bound_ms: float = 0.1
    library_host_bound_ms: float = 0.25
    one_launch_max_m: int = 64
    one_launch_margin: float = 0.03
    one_launch_check_max_mb: float = 16.0
    race_calls: int = 20
    race_rounds: int = 5
    race_margin: float = 0.05
    race_checkpoint_calls: int = 4
    race_keep: float = 0.25
    race_round_keep: float = 0.10
    race_host_keep: float = 1.0
    race_host_keep_bound: float = 0.25
    race_host_slack: float = 0.5
    race_first_keep: float = 2.0
    race_gap_outlier: float = 4.0
    race_voids: int = 16
    trial_budget_ms: float = 100.0
    check_budget_ms: float = 20.0
    host_bound_step_macs: float = 3.2e10

    def is_host_bound(self, gpu_ms: float) -> bool:
        """Whether this GPU time (a library path's, or a whole table's) leaves an un-graphed call's host time of
        the order of it."""
        return gpu_ms < self.host_bound_ms

    def near(self, a: float, b: float) -> bool:
        """Whether two times are a near tie, to be timed again side by side."""
        return abs(a - b) <= self.near_tie * min(a, b)

    def unraced(self, choice):
        """What a call that is never raced (a training step) runs for `choice` (a choose.Choice): the choice, or its
        runner-up kernel in its place (Choice.kernel_instead) where the choice is a library path under host_bound_ms
        and the kernel's time is within check_margin of it (one bound launch in place of the library path's PyTorch
        ops)."""
        instead = choice.kernel_instead()
        if (instead is not None and None not in (choice.time_ms, instead.time_ms) and self.is_host_bound(choice.time_ms)
                and instead.time_ms <= choice.time_ms * (1 + self.check_margin)):
            return instead
        return choice


_current = DecisionPolicy()


def current() -> DecisionPolicy:
    """The policy every decision reads (read at each decision, never copied)."""
    return _current


@contextlib.contextmanager
def use(policy: DecisionPolicy) -> Iterator[DecisionPolicy]:
    """Decide under `policy` inside the block (decisions already kept by modules and caches stay as made)."""
    global _current
    before, _current = _current, policy
    try:
        yield policy
    finally:
        _current = before
