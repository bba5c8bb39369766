"""First-use checks: no unchecked kernel config off the tuned grid.

A kernel config that no tuning compared on this GPU and key (a nearest key's, or the heuristic's) is
compared once, at its first eager use, against the op's library candidates on operands of the key's
shape (evaluator.Evaluator: checked against the float64 reference, then timed like a tuning trial,
only shorter). The faster is kept and stored in the user cache as a *checked* record (policy
"checked"; `autofuse tune` replaces it with a tuned one, and a check never replaces a tuned record), so
later processes reuse the decision.

While a CUDA graph captures, torch.compile traces, or a torch.library op runs (`no_checks`: timing would
allocate in a graph's pool or run during tracing), an op without a decision runs its eager library path
(Source.PENDING); the modules do not keep such a table (their next eager call checks), the torch.library
ops keep it until a check is remembered (lookup.remember moves the generation their entries are keyed on).

Opt out with AUTOFUSE_CHECK=0: nearest and heuristic configs then run unchecked.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Iterator

import torch

from .. import compile_workers, variants
from ..configs import Library
from ..device import capturing, interpreting
from ..errors import AutofuseError
from ..key import Problem
from ..store import CHECKED, Store, Winner
from . import lookup
from .choice import Choice, Source
from .heuristics import alternatives_for, heuristic_for
from .policy import current

logger = logging.getLogger("autofuse")

# How long a forward waits for the user cache to take a checked decision: a write takes milliseconds, but
# another process may hold the cache's write lock (a long import, a stuck writer), for which SQLite would
# make the forward wait a minute or more. Long enough for a write on a loaded machine.
STORE_WAIT_S = 10.0

_no_checks = threading.local()


@contextlib.contextmanager
def no_checks() -> Iterator[None]:
    """Inside the block (the torch.library ops run here) no check runs: an unchecked choice waits, PENDING."""
    depth = getattr(_no_checks, "depth", 0)
    _no_checks.depth = depth + 1
    try:
        yield
    finally:
        _no_checks.depth = depth


def enabled() -> bool:
    """Whether first-use checks run (read at a check, never per call)."""
    return os.environ.get("AUTOFUSE_CHECK", "1").strip().lower() not in ("0", "false", "no", "off")


def checked(problem: Problem, choice: Choice, libraries_only: bool = False) -> Choice:
    """`choice`, where tuning or a check chose it for this key, or checks are off; otherwise (a nearest
    key's choice, the heuristic's) the fastest of its kernels (the nearest key's and this bucket's heuristic
    config, or the heuristic's alone where the nearest key chose a library path; none or fewer where nearby tuned
    records narrow them: _kernels_to_check; none with `libraries_only`) and the op's library candidates, checked
    and stored now (or the eager library path, PENDING, where no check can run now)."""
    if not choice.source.unchecked or not enabled():
        return choice
    if _cannot_time(problem.device):
        return Choice(Library("eager"), Source.PENDING)
    key = problem.key()
    heuristic = heuristic_for(problem.replace(M=problem.bucket))
    kernels = [] if libraries_only else _kernels_to_check(problem, choice, heuristic)
    try:
        winner = _compare(key, problem.M, kernels, problem.device, heuristic)
    except Exception as e:  # noqa: BLE001 - e.g. no memory for the operands: a forward must not fail on a check
        logger.warning("autofuse: could not check %s's %s config (%s: %s); running its eager library path",
                       problem.op, choice.source.value, type(e).__name__, e)
        return Choice(Library("eager"), Source.CHECK_FAILED)
    logger.info("autofuse: checked %s (n=%d, k=%d, M bucket %d): %s %s (library %s)", problem.op, problem.n,
                problem.k, key.m_bucket, winner.config.short(), _ms(winner.time_ms), _ms(winner.baseline_ms))
    winner = _stored(winner)
    lookup.remember(winner)
    return Choice.of(winner, Source.CHECKED if winner.policy == CHECKED else Source.USER_CACHE)


def precompile(jobs: list[tuple[Problem, Choice | None]]) -> None:
    """Compile at once, on threads, the kernels that checks of these choices are about to time, and the Triton
    passes of their library paths (a module's plan checks its ops one after another, and compiling is most of a
    check's time: uncontended on an H100, 0.14-0.28 s a GEMV, 0.3-0.8 s a tile or split-K kernel, 0.15 s a
    pointwise pass; seven to nine of them took 2.2-3.0 s one after another and 0.6-1.0 s on threads). Each check
    then finds its kernels compiled; one that fails here fails again in its check, which reports it. A tuned
    choice's kernel (nothing to check) is compiled beside them: a shipped gemma-2b MLP's first forward at M = 1
    compiled its kernels one after another in 4.3-4.6 s with an empty Triton cache (H100), most of it Triton's
    launcher builds and ptxas, processes that run side by side on threads. A check's kernel that a compile worker
    takes (compile_workers) may still be compiling when this returns: the checks start timing meanwhile, and each
    check's own compile of a kernel waits for its worker (Evaluator._compile). Nothing to compile under the
    interpreter."""
    work = []
    for problem, choice in jobs:
        if not enabled() or not _times_on_gpu(problem.device) or _cannot_time(problem.device):
            continue
        if choice is not None and not choice.source.unchecked:
            if choice.kernel is not None:  # run by the module, not by a check: compiled before this returns
                work.append((problem, choice.kernel, False))
            continue
        if choice is not None:  # None: a check of the library paths alone (checked(..., libraries_only=True))
            heuristic = heuristic_for(problem.replace(M=problem.bucket))
            work.extend((problem, kernel, True) for kernel in _kernels_to_check(problem, choice, heuristic))
        if set(problem.spec.library_for(problem.activation, problem.bias, problem.residual)) - {"eager"}:
            work.append((problem, None, False))  # the library paths' pointwise passes: 0.15 s each to compile
    if len(work) < 2:  # one kernel compiles as fast in its own check
        return
    compile_workers.start_for(work[0][0].device)  # ready for the next first use, where not for this one
    threads = [threading.Thread(target=_compile_one, args=job, name="autofuse-precompile") for job in work]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def _compile_one(problem: Problem, kernel, background: bool = False) -> None:
    """Compile `kernel` for the problem's check, or (None) its library paths' pointwise passes. With `background`,
    a compile worker may go on compiling after this returns (Evaluator.precompile; the check waits for it)."""
    from ..evaluator import Evaluator

    try:
        evaluator = Evaluator(problem.key(), problem.M, problem.device, budget_ms=current().check_budget_ms)
        try:
            if kernel is None:
                evaluator.precompile_library()
            else:
                evaluator.precompile(kernel, background)
        finally:
            evaluator.close()
    except Exception as e:  # noqa: BLE001 - the check itself meets and reports whatever failed here
        logger.debug("autofuse: precompiling %s's kernel failed (%s: %s)", problem.op, type(e).__name__, e)


def _stored(winner: Winner) -> Winner:
    """The record the key holds once `winner` is offered to the user cache (a record tuned meanwhile
    stays, store.outranked_by, and is what runs), or `winner` itself where the cache cannot take it:
    read-only, damaged, or locked past STORE_WAIT_S (the write then goes on in the background and lands
    when the lock is free, unless the process ends first). The decision holds for this process either way."""
    outcome: dict = {}

    def write() -> None:
        try:
            outcome["record"] = Store(timeout=STORE_WAIT_S).put_winner(winner)
        except AutofuseError as e:
            outcome["error"] = e

    writer = threading.Thread(target=write, name="autofuse-store-check", daemon=True)
    writer.start()
    writer.join(STORE_WAIT_S)
    if writer.is_alive():
        logger.warning("autofuse: the cache is locked by another process; a checked decision holds for this "
                       "process and is stored once the lock is free")
    elif "error" in outcome:
        logger.warning("autofuse: could not store a checked decision: %s", outcome["error"])
    return outcome.get("record", winner)


def _cannot_time(device: torch.device) -> bool:
    return getattr(_no_checks, "depth", 0) > 0 or torch.compiler.is_compiling() or capturing(device)


def _kernels_to_check(problem: Problem, choice: Choice, heuristic) -> list:
    """The kernel configs a check times against the library paths: the choice's; where that is a nearest key's,
    this M bucket's heuristic config beside it; and the op's alternatives to its heuristic at this M (the GEMV
    config at M = 1, the fp8 ops' second decode tile at M = 2-16). A nearest key may be the same shape at another
    M: a down projection of d_model 5681 ran the split-K config checked at M = 16 at M = 256, 14% of the read
    ceiling, where eager's cuBLAS (unaligned rows) was slower still and let it pass its check. Where the choice is
    a library path (which one is fastest depends on the shape: the check compares them), this bucket's heuristic
    config stands for the kernels. The tuned records nearest this problem narrow the list (prior): none where most
    of them chose a library path, the GEMV configs alone where most chose the GEMV. `heuristic`: this bucket's
    heuristic config."""
    narrowed = prior(problem)
    if narrowed == LIBRARY:
        return []
    if choice.kernel is None:
        choice = Choice(heuristic, Source.HEURISTIC)
    kernels = [choice.kernel]
    if choice.source is Source.NEAREST:
        kernels.append(heuristic)
    kernels.extend(alternatives_for(problem.replace(M=problem.bucket)))
    kernels = list(dict.fromkeys(kernels))
    if narrowed is not None and variants.is_gemv(narrowed):
        kernels = [kernel for kernel in kernels if kernel.variant == narrowed] or kernels
    return kernels


# The M buckets up to which the prior narrows a check: a first use there must cost under a second, most of it
# compiling the checked kernels (uncontended on an H100: 0.14-0.28 s a GEMV, 0.3-0.8 s a tile or split-K kernel).
PRIOR_MAX_M = 256
# How many tuned records of neighbouring shapes vote, nearest first; a strict majority of them decides.
PRIOR_NEIGHBOURS = 3
LIBRARY = "library"


def prior(problem: Problem) -> str | None:
    """What most of the PRIOR_NEIGHBOURS tuned records nearest this problem at its M bucket (up to PRIOR_MAX_M)
    chose: LIBRARY (a library path), a kernel variant's name, or None (no majority, no records, or a larger M).
    Tuning's records, not first-use checks' (decided among a few kernels timed briefly, they are not carried to
    neighbours). Measured on an H100 with the shipped records: the down projection at M = 128 chose cuBLAS at 3 of
    4 tuned keys and at 6 of 6 first-use checks of held-out MLPs, which compiled a split-K kernel each (0.5-0.8 s)
    for nothing; at M = 1 the GEMV won the up and down projections at 4 of 4 tuned keys and 12 of 12 checks, beside
    tile configs the checks compiled (0.3-0.5 s each)."""
    if problem.bucket > PRIOR_MAX_M:
        return None
    records = lookup.tuned_neighbours(problem, PRIOR_NEIGHBOURS)
    votes = Counter(LIBRARY if isinstance(w.config, Library) else w.config.variant for w in records)
    if not votes:
        return None
    kind, count = votes.most_common(1)[0]
    return kind if 2 * count > len(records) else None


def _compare(key, M: int, kernels: list, device: torch.device, heuristic=None) -> Winner:
    """The check's winner: the fastest of `kernels` that passes (the first where none does) against the library
    paths, by the winner rule. `heuristic`: the heuristic's config, recorded with its time where it was timed."""
    # Imported here, not at the top: the evaluator is loaded only where a check runs.
    from ..evaluator import Evaluator
    from .winner import Outcome, choose_winner, fastest_trial, near_fastest

    start = time.perf_counter()
    evaluator = Evaluator(key, M, device, budget_ms=current().check_budget_ms)
    try:
        with torch.no_grad():
            library_ms = evaluator.library_ms()
            done = {kernel: evaluator.evaluate(kernel) for kernel in kernels}
            # None where no kernel was checked (prior): the library paths alone.
            record = fastest_trial(done) or (done[kernels[0]] if kernels else None)
            if _times_on_gpu(device):
                rivals = near_fastest(done, len(done))[1:]  # the correct kernels near `record`, itself first
                retimed, library_ms = _side_by_side_if_near(evaluator, record, library_ms, rivals)
                if record is not None:
                    done[retimed.config] = record = retimed
    finally:
        evaluator.close()
    for kernel, failed in done.items():
        if failed.status != "ok":
            logger.warning("autofuse: %s's config %s failed its check (%s: %s)", key.op, kernel.short(),
                           failed.status, failed.detail)
    policy = current()
    # The fastest kernel, retimed beside the library paths where near them, stands for the kernels checked.
    outcome = Outcome(done, library_ms, heuristic or kernels[0], time.perf_counter() - start,
                      confirmed=record if record is not None and record.status == "ok" else None)
    return choose_winner(key, outcome, CHECKED, times_mean_speed=not interpreting(),
                         kernel_margin=policy.check_margin)


def _times_on_gpu(device: torch.device) -> bool:
    """Whether times taken now are a GPU's (not the interpreter's, which say nothing about speed)."""
    return device.type == "cuda" and not interpreting()


def _side_by_side_if_near(evaluator, record, library_ms: dict[str, float], rivals=()):
    """(record, library_ms) with every candidate near the fastest (the kernel, where one was checked and passed, the
    kernels `rivals` within a near tie of it, and the library paths) timed again side by side, where two or more of them
    are a near tie; the record returned is the fastest kernel's so timed. Library paths among themselves too: each
    was timed on its own, and one timed during a moment of higher clocks could otherwise win over a path that is
    faster in place (an H200's M=1 Linear chose cuBLASLt's epilogue, 5% slower there than torch.compile's cuBLAS +
    one pass, while the kernel was far behind). Kernels among themselves too: the fp8 decode tiles' pair, timed one
    after the other, left 6480 -> 27640's MLP 6% slower at M = 8 than at M = 4 and 16, whose checks kept the other
    tile (H100)."""
    near_tie = current().near
    kernel_ms = [record.time_ms] if record is not None and record.status == "ok" else []
    fastest = min([*kernel_ms, *library_ms.values()])
    near = [name for name, ms in library_ms.items() if near_tie(ms, fastest)]
    kernel_near = bool(kernel_ms) and near_tie(record.time_ms, fastest)
    rivals = list(rivals) if kernel_near else []
    if len(near) + kernel_near + len(rivals) < 2:
        return record, library_ms
    retimed, library_ms = evaluator.retimed_side_by_side(record if kernel_near else None, library_ms, near, rivals)
    return (retimed if kernel_near else record), library_ms


def faster_of(first: tuple[str, Choice], second: tuple[str, Choice], problem: Problem) -> str:
    """Which of two ops' choices computing the same result on keys of the problem's n and k (gated_up and
    gated_pairs) is faster: by their recorded times, timed again side by side where those are a near tie and
    a GPU can time now. Needs both times (tuned or checked choices)."""
    (op_a, a), (op_b, b) = first, second
    by_record = op_a if a.time_ms <= b.time_ms else op_b
    device = problem.device
    if not current().near(a.time_ms, b.time_ms) or not _times_on_gpu(device) or _cannot_time(device):
        return by_record
    from ..evaluator import Evaluator

    evaluators = [Evaluator(problem.replace(op=op, residual=False).key(), problem.M, device,
                            budget_ms=current().check_budget_ms) for op in (op_a, op_b)]
    try:
        with torch.no_grad():
            times = evaluators[0].side_by_side_ms({op_a: evaluators[0].runner(a.config),
                                                   op_b: evaluators[1].runner(b.config)})
    except Exception as e:  # noqa: BLE001 - e.g. no memory for the operands: the records decide
        logger.warning("autofuse: could not time %s and %s side by side (%s: %s)", op_a, op_b, type(e).__name__, e)
        return by_record
    finally:
        for evaluator in evaluators:
            evaluator.close()
    logger.info("autofuse: %s %s against %s %s side by side (n=%d, k=%d, M=%d)", op_a, _ms(times[op_a]), op_b,
                _ms(times[op_b]), problem.n, problem.k, problem.M)
    return op_a if times[op_a] <= times[op_b] else op_b


def tables_side_by_side(tables: dict[str, list[tuple[Problem, Choice]]]) -> dict[str, float] | None:
    """GPU ms of each named table (its ops' choices called one after another, as a module's forward calls them, so
    that a dependent launch overlaps the next kernel's start with the one before it as in the module) timed side by
    side, replayed in turn; None where no GPU can time now or a table cannot run here. Records timed at other moments
    are a poor measure between tables of a few microseconds: 576 -> 2665's two GEMVs ran 6.1 us together at M = 1
    (3.5 and 2.6 alone) in one process, and the one-launch kernel chosen over them by the checks' records of
    another ran 11.1 (H100)."""
    problems = [problem for table in tables.values() for problem, _ in table]
    if not problems or any(not _times_on_gpu(p.device) or _cannot_time(p.device) for p in problems):
        return None
    from ..evaluator import Evaluator

    evaluators = []
    try:
        fns = {}
        for name, table in tables.items():
            runners = []
            for problem, choice in table:
                evaluators.append(Evaluator(problem.replace(residual=False).key(), problem.M, problem.device,
                                            budget_ms=current().check_budget_ms))
                runners.append(evaluators[-1].runner(choice.config))
            fns[name] = lambda runners=tuple(runners): [run() for run in runners]
        with torch.no_grad():
            return evaluators[0].side_by_side_ms(fns)
    except Exception as e:  # noqa: BLE001 - e.g. no memory for the operands: the records decide
        logger.warning("autofuse: could not time %s side by side (%s: %s)", " and ".join(tables), type(e).__name__, e)
        return None
    finally:
        for evaluator in evaluators:
            evaluator.close()


def _ms(value: float) -> str:
    return f"{value * 1e3:.1f} us" if value < 1 else f"{value:.3f} ms"
