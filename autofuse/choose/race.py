"""The un-graphed race: the table whose plain call is fastest, raced once per process.

Tuning and first-use checks choose by GPU time, replayed from a CUDA graph: what a graphed step pays.
An un-graphed call also pays host time, and at decode sizes that is of the order of the GPU time: a
bound kernel launch costs a few microseconds of it, a library path one PyTorch op's per op. So a library
path chosen by GPU time can make an un-graphed call slower than eager's.

Where a module's table may be bound by its host time (host_bound: under the policy's host_bound_ms of GPU time, or
library_host_bound_ms where it runs a library path) and other tables compute the same
(the tables the choice compared, each with its library choices replaced by their runner-up kernels
(store.Winner.runner_up), and each with one op's choice replaced by another of its library paths), its
un-graphed calls time every one of them as they come (windows of consecutive calls, each entry's in turn, so
that no call waits for a race), and later un-graphed calls keep the fastest. A call made while a CUDA graph
captures runs the GPU-time winner. The decision is the host's as much as the GPU's, so it is kept for the
process only, once per (module kind, shape, M, tables).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Iterable, Mapping

import torch

from ..configs import Library
from ..device import interpreting
from .choice import Choice, Source
from .policy import current

logger = logging.getLogger("autofuse")

# How many calls make a window and how many windows each candidate gets, and the margin another table needs:
# DecisionPolicy's race_calls, race_rounds and race_margin (choose/policy.py).
# Decisions kept per process; past this many the memo starts over.
_KEPT = 512

_decided: dict[tuple, int] = {}
# The kinds of timed windows: a window of race_calls calls (its time a sample of the entry's plain call), and a window
# ended at a checkpoint, its entry dropped there.
WINDOW, ENDED = "window", "ended at a checkpoint"
# Host-timed calls of each entry in a race's first call, after its binding call: the fastest of them is its host
# time per call (one call alone may meet a collection or a page fault).
ESTIMATE_CALLS = 2
# Windows of a start bound by its GPU time (_bound_by_gpu) before any other entry's: the first window after the first
# call reads slow at its checkpoints (Raced), and an entry's first window's readings bound another's only while it has
# no other.
START_WINDOWS_BOUND_BY_GPU = 2
# Windows of the fastest known after each other entry's first window (60 calls): that window's slow calls (its first
# after a switch of tables, and those before its checkpoint where it ends there) then fall at most once in any 50
# calls. With one, windows of 50 calls holding two such probes ran 1.25-1.33x eager's (3840 -> 12688 at M = 128,
# H200: probes of library tables at 166-254 us a call beside the fastest's 103-113).
FASTEST_AFTER_FIRST_WINDOWS = 3


def host_bound(table: dict[str, Choice]) -> bool:
    """Whether a table's un-graphed call may be bound by its host time: its known GPU time is under the policy's
    host_bound_ms, or under library_host_bound_ms where it runs a library path (its PyTorch ops' host time, which
    the GPU times do not show); False where a time is unknown (the heuristic's, a nearest key's)."""
    gpu_ms = known_gpu_ms(table)
    if gpu_ms is None:
        return False
    policy = current()
    if _runs_library(table):
        return gpu_ms < policy.library_host_bound_ms
    return policy.is_host_bound(gpu_ms)


def known_gpu_ms(table: dict[str, Choice]) -> float | None:
    """A table's GPU time, the sum of its choices' timed ms; None where one of them was never timed."""
    times = [c.time_ms for c in table.values()]
    return None if None in times else sum(times)


def candidates(winner: dict[str, Choice], others: list[dict[str, Choice]],
               libraries: Mapping[str, Iterable[str]] | None = None) -> list[dict[str, Choice]]:
    """The tables other than `winner` worth racing for its un-graphed calls: `others`, every table with
    its library choices replaced by their runner-up kernels, and `winner` and `others` with one op's
    choice replaced by another of that op's library paths (`libraries`: op -> the names of the library
    candidates that compute it for this module; a library path's plain call costs its PyTorch ops' host
    time, which GPU times do not show, and one path's may be far above another's at the same GPU time);
    without repeats and without choices made before a check could run (the caller has seen that
    `winner` is host_bound)."""
    seen = {_signature(winner)}
    found = []
    tables = (*others, *(_with_kernels(t) for t in (winner, *others)),
              *(t for base in (winner, *others) for t in _with_libraries(base, libraries or {})))
    for table in tables:
        if table is None or any(c.source in (Source.PENDING, Source.CHECK_FAILED) for c in table.values()):
            continue
        signature = _signature(table)
        if signature not in seen:
            seen.add(signature)
            found.append(table)
    return found


def _with_libraries(table: dict[str, Choice], libraries: Mapping[str, Iterable[str]]) -> list[dict[str, Choice]]:
    """`table` with one op's choice replaced by each other library path of that op, one op at a time."""
    found = []
    for op, choice in table.items():
        for name in libraries.get(op, ()):
            if choice.config != Library(name):
                found.append({**table, op: Choice(Library(name), choice.source, detail=choice.detail)})
    return found


def _with_kernels(table: dict[str, Choice]) -> dict[str, Choice] | None:
    """`table` with each library choice that has a runner-up kernel running it; None where none has."""
    replaced = {op: c.kernel_instead() for op, c in table.items()}
    if not any(replaced.values()):
        return None
    return {op: replaced[op] or c for op, c in table.items()}


def _signature(table: dict[str, Choice]) -> tuple:
    return tuple((op, c.config) for op, c in table.items())


def racing(device: torch.device) -> bool:
    """Whether plain calls can be raced on `device` now (times on the interpreter say nothing of speed)."""
    return device.type == "cuda" and not interpreting()


def memo_key(kind: str, shape: tuple, M: int, dtype: torch.dtype, device: torch.device,
             tables: list[dict[str, Choice]]) -> tuple:
    """What a race's decision depends on: the module kind and shape, M, dtype, device and the tables raced."""
    return (kind, shape, M, dtype, device, tuple(_signature(t) for t in tables))


def _capturing() -> bool:
    return torch.cuda.is_current_stream_capturing()


def race_length(tables: int) -> int:
    """The most un-graphed calls a race of `tables` tables takes from its first call to the decision (fewer where
    tables are dropped): the first call; two windows of the fastest known; per other table a window of it and
    FASTEST_AFTER_FIRST_WINDOWS of the fastest known; race_rounds rounds of a window of the fastest and one of each
    other table; and race_voids windows started again for foreign work in them."""
    policy = current()
    return planned_length(tables, START_WINDOWS_BOUND_BY_GPU) + policy.race_voids * policy.race_calls


def planned_length(tables: int, start_windows: int = 1) -> int:
    """The un-graphed calls a race of `tables` tables plans, none dropped and no window run again, where its start
    runs `start_windows` windows before the others' (two where the start is bound by its GPU time: Raced)."""
    policy = current()
    window = policy.race_calls
    return (1 + start_windows * window + (tables - 1) * (1 + FASTEST_AFTER_FIRST_WINDOWS) * window
            + policy.race_rounds * (tables - 1) * 2 * window)


class _Window:
    """A window being timed: its entry, how many calls it makes and has made, when it started (host clock, after a
    synchronisation) with a mark on the stream there, the marks recorded after its checkpoint calls, whether it is
    its entry's first (where its first call is bounded), and the fastest entry known when it was planned (whose
    checkpoints bound it; no window's samples change while it runs)."""

    __slots__ = ("entry", "calls", "done", "start", "start_mark", "marks", "read", "first", "fastest", "checkpoints")

    def __init__(self, entry: int, calls: int, first: bool, fastest: int) -> None:
        self.entry, self.calls, self.done, self.first, self.fastest = entry, calls, 0, first, fastest
        self.checkpoints = (1, current().race_checkpoint_calls)  # the calls after which a mark is recorded
        self.marks: dict[int, object] = {}  # checkpoint call -> its mark
        self.read: dict[int, float] = {}  # checkpoint call -> µs per call up to it, once read
        self.start_mark = None
        self.start = 0.0

    def begin(self, device: torch.device | None) -> None:
        """Start (or start again) from a synchronisation: nothing of the caller's queued work is in its time."""
        _synchronize(device)
        self.done, self.marks, self.read = 0, {}, {}
        self.start = _now()
        self.start_mark = _mark(device) if self.calls > 1 else None  # a window of one call has no checkpoint


class Raced:
    """A module's table entry at one M that has other tables to race. Calls made while a CUDA graph captures (or a
    profiler records) run the GPU-time winner's entry, `graphed`. Other calls race the entries on the caller's own
    calls, so that no call waits for a race, and so that the race costs those calls little over the fastest entry
    known; each window starts from a synchronisation, and its sample is its time a call after its first call, on
    marks on the module's stream.
    - The first call runs every entry once, each binding its launches then (a module's first call at an M
      resolves and checks its configs anyway; a binding call among the windows had cost them up to 1.8x), then
      each entry ESTIMATE_CALLS more times, timing its host time per call (no synchronisation), and returns the
      GPU-time winner's result. An entry's estimate is the larger of that host time and its table's known GPU
      time; an entry whose host time alone exceeds the lowest estimate of an entry of known GPU time by more
      than race_host_keep, or that of one bound by its GPU time by more than race_host_keep_bound, is dropped there
      (its plain call cannot be faster: _host_limit; a bound table's host took 19-20 us per call where the slowest
      took 76-176, and the GPU-time winner's 35, on an H100 host). Where a table runs
      bound kernels only, its host time is under its known GPU time by race_margin and that GPU time is within
      check_margin of the GPU-time winner's, its plain call is bound by that GPU time, which no other table's
      undercuts by more: the race settles on it there (_bound_by_gpu_time).
    - Then the entry of known GPU time of the lowest rank (its estimate, or its host time with race_host_slack on it
      where that is larger: _ranked) starts, running a window (two where it is bound by its GPU time: the first
      window after the first call reads slow, 242 and 261 us a call at its second checkpoint for a kernel table whose
      later windows read 112-149 there and ran 104-111 a call, 3840 -> 12688 at M = 128, H200, and held to that
      reading, tables of 155-176 us a call passed their checkpoints and ran whole windows), and each other entry in
      turn (lowest rank first) runs a window followed by FASTEST_AFTER_FIRST_WINDOWS of the fastest entry known (the
      lowest median window): a span of calls never holds two slower entries' windows back to back.
    - Checkpoints bound what a slower entry's window costs: a mark on the stream after a window's first call and after
      its race_checkpoint_calls-th gives, once the GPU has reached it, the time of the first call (from the window's
      start) and the time per call of the calls after it up to the second mark. A window of an entry other than the
      fastest known ends at a checkpoint slower than the fastest known's windows' at the same checkpoint (their median,
      less its first window's where it has others) by more than race_first_keep (the first call, in the entry's first
      window only) or race_keep (per call, at race_checkpoint_calls), and the entry is dropped. The first call after a
      switch of tables runs slow for every table, and more for some (122-182 us for a kernel table of 106-118 us a call
      in its windows, 250-306 for library tables of 110-114, 3840 -> 12688 at M = 128, H200), so it is kept out of the
      second checkpoint, and its own bound is wide: in the rounds, and at 1.5x, it dropped tables as fast as the fastest
      (a Linear's eager path and kernel at M = 2, the plain call left 0.85x eager's). The marks are read without
      waiting, the caller's calls going on meanwhile, except a mark the GPU has not reached by twice its calls (the
      entry's launches queue ahead of its GPU time): waiting for it then leaves the calls after it queued, so the GPU
      does not idle; a table of 380 us a call beside the fastest's 105 (H200) costs two calls. Synchronised comparisons
      drain the queue (about one call's GPU time each) and misrank: probes of 4 calls beside a window of 20 had read a
      table of 88 us a plain call at 190 and one of 133-147 at 184 (H200).
    - Rounds: the entries left run race_rounds rounds, in each a window of every entry but the fastest (by its
      median window so far), in a rotated order, each after a window of the fastest. Before each round an entry
      whose median window is slower than the fastest's by more than race_round_keep is dropped.
    - A window in which the caller does other work between two calls (a gap over race_gap_outlier times the last
      window's median gap plus its median time inside a call; the window's time would hold that work) starts
      again from that call, and a window slower than race_gap_outlier times its entry's estimate (a known GPU time's)
      runs again: up to race_voids times a race in all.
    Then the fastest entry (median window) runs every later call: the GPU-time winner, unless another is race_margin
    faster. The decision is kept for the process (`_decided`), and a race still running settles on another module's
    decision of its key at its next window's start."""

    __slots__ = ("graphed", "entries", "tables", "M", "key", "device", "plain", "plain_table", "calls",
                 "decided_after", "_plan", "_samples", "_checkpoints", "_stall_us", "_alive", "_rounds", "_window",
                 "_start", "_gaps", "_inside", "_returned", "_gap_limit", "voided", "windows")

    def __init__(self, graphed, entries: list, tables: list[dict[str, Choice]], M: int, key: tuple,
                 device: torch.device | None = None) -> None:
        self.graphed = graphed
        self.entries = [graphed, *entries]  # dropped once raced: each may hold an H buffer
        self.tables = tables  # the table of each entry, `graphed`'s first
        self.M, self.key = M, key
        # the module's GPU: its stream takes the marks and its work is waited for (the current device's need not be
        # the module's, as with a model spread over GPUs); None: the current device
        self.device = device
        self.plain = None  # the entry un-graphed calls run, once raced
        self.plain_table: dict[str, Choice] | None = None  # its table
        self.calls = 0  # un-graphed calls that went through the race
        self.decided_after: int | None = None  # of them, the call that settled on `plain`
        self._plan: list[tuple[int | None, int, bool]] | None = None  # windows to run: (entry, calls, its first)
        self._samples: list[list[float]] = []  # µs per call of each entry's windows
        # µs per call at each checkpoint of each entry's whole windows: {checkpoint call: [µs, ...]} an entry
        self._checkpoints: list[dict[int, list[float]]] = []
        # µs a call over which an entry's window holds a stall of the process, not the entry's pace: race_gap_outlier x
        # its estimate where its GPU time is known (infinite where not: its estimate is its host time alone)
        self._stall_us: list[float] = []
        self._alive: list[bool] = []  # entries not dropped
        self._rounds = 0  # rounds of windows planned so far
        self._window: _Window | None = None
        self._start = 0  # the entry of the lowest rank (_ranked): the fastest known before any window
        self._gaps: list[float] = []  # seconds between the window's calls: from one's return to the next one's start
        self._inside: list[float] = []  # seconds inside each of the window's calls
        self._returned = 0.0  # when the window's last call returned
        # A gap over this (seconds) holds foreign work: race_gap_outlier x (median gap + median time inside a
        # call) of the last window that had two gaps or more; none before it.
        self._gap_limit = float("inf")
        self.voided = 0  # windows started again for foreign work in them
        # Where the "autofuse" logger is at DEBUG when the race is made: every window it times, a dict each (the
        # call that ended it, the table, its calls, µs a call, its kind, its checkpoints), and each restart
        # (benchmarks/first_use.py --race-log keeps them); also logged at DEBUG.
        self.windows: list[dict] | None = [] if logger.isEnabledFor(logging.DEBUG) else None

    @property
    def table(self) -> dict[str, Choice]:
        """The GPU-time winner's table (what config_for reports and pending() inspects)."""
        return self.graphed.table

    def __call__(self, *args):
        plain = self.plain
        if plain is self.graphed or _capturing() or torch.autograd.profiler._is_profiler_enabled:
            return self.graphed(*args)
        if plain is not None:
            return plain(*args)
        self.calls += 1
        if self._window is None:
            # Between windows (the first call included): another module's race of the same key may have decided.
            # Not inside a window: hashing the key (every table's configs) cost 3.1 us a call on a CPU for 7 tables.
            decided = _decided.get(self.key)
            if decided is not None:
                return self._settle(decided)(*args)
        try:
            return self._race(args)
        except Exception as e:  # noqa: BLE001 - e.g. no memory for another table's buffers: a forward must not fail on a race
            logger.warning("autofuse: could not race un-graphed calls at M=%d (%s: %s); running the GPU-time winner",
                           self.M, type(e).__name__, e)
            self._window = None
            _remember(self.key, 0)
            return self._settle(0)(*args)

    def _race(self, args: tuple):
        """Run this call through the entry the race has reached, timing its window."""
        if self._plan is None:
            return self._first(args)
        window = self._window
        if window is None:
            planned = self._next_window()
            if planned is None:
                return self._settle(self._decide())(*args)
            window = self._window = _Window(*planned, fastest=self._fastest_known())
            called = self._begin(window)
        else:
            called = _now()
            gap = called - self._returned
            if gap > self._gap_limit and self.voided < current().race_voids:
                # The caller did other work since the last call, which this window's time would hold: the window
                # starts again from this call.
                self.voided += 1
                self._record(call=self.calls, restarted_after_gap_us=gap * 1e6)
                called = self._begin(window)
            else:
                self._gaps.append(gap)
                if self._ended_at_checkpoint(window):
                    self._window = None
                    return self._race(args)  # this call starts the next window
        out = self.entries[window.entry](*args)
        window.done += 1
        if window.done in window.checkpoints and window.done < window.calls:
            window.marks[window.done] = _mark(self.device)
        self._returned = _now()
        self._inside.append(self._returned - called)
        if window.done < window.calls:
            return out
        end = _mark(self.device) if 1 in window.marks else None
        _synchronize(self.device)
        self._window = None
        elapsed = _now() - window.start
        wall_us = elapsed / window.calls * 1e6
        # The window's sample: µs a call after its first (the first call after a switch of tables runs slow, more for
        # some tables than others; a decided table runs without switches), on the stream's marks
        us = wall_us if end is None else _per_call_us(window, end, window.calls)
        # less the caller's steady work between calls (a model's other layers; its median gap a call), not a stall
        # between two calls: that is in the module's forward around the race (after graph replays, 17-60 ms)
        steady_gaps = statistics.median(self._gaps) * len(self._gaps) if self._gaps else 0.0
        inside_us = (elapsed - steady_gaps) / window.calls * 1e6
        if inside_us > self._stall_us[window.entry] and self.voided < current().race_voids:
            # A stall of the process inside the window (a collection, a first call's lazy work after graph replays:
            # 17-60 ms in one window of calls of 40-70 us, H200): the window runs again.
            self.voided += 1
            self._record(call=self.calls, table=_describe(self.tables[window.entry]),
                         restarted_after_stall_us=inside_us)
            self._plan.insert(0, (window.entry, window.calls, window.first))
            return out
        self._samples[window.entry].append(us)
        checkpoints = {c: window.read[c] if c in window.read else _per_call_us(window, mark, c)
                       for c, mark in window.marks.items()}
        for c, value in checkpoints.items():
            self._checkpoints[window.entry].setdefault(c, []).append(value)
        if self.windows is not None:
            self._record(call=self.calls, table=_describe(self.tables[window.entry]), calls=window.calls, us=us,
                         wall_us=wall_us, kind=WINDOW, checkpoints_us=checkpoints, dropped=False)
        if len(self._gaps) > 1:
            self._gap_limit = current().race_gap_outlier * (statistics.median(self._gaps) +
                                                            statistics.median(self._inside))
        return out

    def _begin(self, window: _Window) -> float:
        """Start (or start again) `window` from a synchronisation, its gaps and times inside calls afresh; returns
        when it started."""
        window.begin(self.device)
        self._gaps, self._inside = [], []
        return window.start

    def _ended_at_checkpoint(self, window: _Window) -> bool:
        """Before the window's next call: read each checkpoint the GPU has reached (waiting for one it has not
        reached by twice its calls); where one is slower than the fastest known's by more than its bound, the entry
        is dropped and the window ends (True)."""
        fastest = window.fastest
        if window.entry == fastest or not window.marks:
            return False  # the fastest's checkpoints are read at its window's end
        pending = [(c, mark) for c, mark in sorted(window.marks.items()) if c not in window.read]
        if not pending:
            return False
        policy = current()
        for c, mark in pending:
            if c != policy.race_checkpoint_calls and not window.first:
                continue  # the first call's bound is for an entry's first window (read at the window's end here)
            if not _reached(mark):
                if window.done < 2 * c:
                    continue
                _wait(mark)
            us = window.read[c] = _per_call_us(window, mark, c)
            reference = self._checkpoints[fastest].get(c)
            if not reference:
                continue
            reference = reference[1:] or reference  # its first window's where it has no other (Raced says why)
            keep = policy.race_keep if c == policy.race_checkpoint_calls else policy.race_first_keep
            if us > statistics.median(reference) * (1 + keep):
                self._alive[window.entry] = False
                self._record(call=self.calls, table=_describe(self.tables[window.entry]), calls=window.done, us=us,
                             kind=ENDED, checkpoints_us={c: us}, dropped=True)
                return True
        return False

    def _record(self, **window) -> None:
        if self.windows is not None:
            self.windows.append(window)
            logger.debug("autofuse: race at M=%d: %s", self.M, window)

    def _first(self, args: tuple):
        """The race's first call: every entry binds its launches (the others first) and has its plain call
        estimated (_estimates); the GPU-time winner's result is returned; then the windows are planned, the entries
        whose host time alone rules them out dropped."""
        count = len(self.entries)
        for entry in self.entries[1:]:
            entry(*args)
        out = self.entries[0](*args)
        policy = current()
        window = policy.race_calls
        self._samples, self._alive = [[] for _ in range(count)], [True] * count
        self._checkpoints = [{} for _ in range(count)]
        host, estimate = self._estimates(args)
        self._stall_us = [policy.race_gap_outlier * us if known_gpu_ms(table) is not None else float("inf")
                          for us, table in zip(estimate, self.tables)]
        if self.windows is not None:
            self._record(call=1, tables=[_describe(t) for t in self.tables], host_us=host, estimate_us=estimate)
        bound = self._bound_by_gpu_time(host)
        if bound is not None:
            _remember(self.key, bound)
            self._settle(bound)
            return out
        # Only a table whose GPU time is known has an estimate near its plain call: one whose GPU time is unknown
        # (a library path swapped in by candidates(), never timed) has its host time alone, which its queued
        # launches can leave far under its plain call. So it neither starts the race nor rules others out by
        # host time; its checkpoints decide.
        known = [i for i, table in enumerate(self.tables) if known_gpu_ms(table) is not None]
        # The start and the order of the others: by the estimate with race_host_slack on the host time, so that of a
        # host-bound table and one bound by a GPU time near it, the one bound by its GPU time runs first (_ranked).
        ranked = _ranked(host, estimate)
        self._start = min(known, key=ranked.__getitem__, default=0)
        if known:
            limit = _host_limit(host, estimate, known)
            for i, us in enumerate(host):
                if us > limit:
                    self._alive[i] = False
        order = sorted((i for i in range(count) if i != self._start and self._alive[i]), key=ranked.__getitem__)
        if self.windows is not None:
            self._record(call=1, start=self._start,
                         dropped_by_host_time=[i for i in range(count) if not self._alive[i]])
        # None: the fastest entry known when the window starts.
        self._plan = [(self._start, window, False)]
        if order and _bound_by_gpu(host[self._start], estimate[self._start]):
            self._plan *= START_WINDOWS_BOUND_BY_GPU
        for other in order:
            self._plan += [(other, window, True), *[(None, window, False)] * FASTEST_AFTER_FIRST_WINDOWS]
        return out

    def _bound_by_gpu_time(self, host: list[float]) -> int | None:
        """The entry whose plain call is bound by its known GPU time, where that is within check_margin of the
        GPU-time winner's (no other table's plain call, never under its GPU time, undercuts it by more): a table of
        bound kernels only whose host time is under its GPU time by race_margin; the lowest GPU time of them; None
        where none is. The race settles on it before any window: a race's probes had put 2 of 40 windows of 3840 ->
        12688 at M = 16 over 1.25x eager's for no gain (H100), and where a library path won by GPU time, racing it
        beside a kernel table of 110 us put 3 windows of 50 calls at 1.25-1.38x eager's (3840 -> 12688 at M = 128,
        its library tables 139-169 us a call in windows right after the first use, H200). Not a table that runs a
        library path: a PyTorch op's host time wanders (cuBLAS's nvjet GEMMs 35-58 us a call), and a library table
        settled so on two calls' host time under its 100 us of GPU time then ran 124-145 us a plain call for 1,500
        calls beside eager's 105-118 and a kernel table's 105 (3840 -> 12688 at M = 128, H200)."""
        policy = current()
        winner_ms = known_gpu_ms(self.tables[0])
        if winner_ms is None:
            return None
        bound = [(gpu_ms, i) for i, table in enumerate(self.tables)
                 if not _runs_library(table) and (gpu_ms := known_gpu_ms(table)) is not None
                 and host[i] < gpu_ms * 1e3 * (1 - policy.race_margin)
                 and gpu_ms <= winner_ms * (1 + policy.check_margin)]
        return min(bound)[1] if bound else None

    def _estimates(self, args: tuple) -> tuple[list[float], list[float]]:
        """(host, estimate), µs per plain call of each entry: its host time, the fastest of ESTIMATE_CALLS calls
        timed without synchronising (the launches queue; the GPU's time is not in it), and the larger of that and
        its table's known GPU time (host time alone where a choice's time is unknown)."""
        host, estimate = [], []
        for entry, table in zip(self.entries, self.tables):
            fastest = float("inf")
            for _ in range(ESTIMATE_CALLS):
                start = _now()
                entry(*args)
                fastest = min(fastest, (_now() - start) * 1e6)
            gpu_ms = known_gpu_ms(table)
            host.append(fastest)
            estimate.append(fastest if gpu_ms is None else max(fastest, gpu_ms * 1e3))
        return host, estimate

    def _next_window(self) -> tuple[int, int, bool] | None:
        """The next window to run (entry, calls, whether it is the entry's first), planning the next round where the
        plan is done; None once the rounds are over or one entry is left."""
        while True:
            if sum(self._alive) < 2:
                return None
            while self._plan:
                index, calls, first = self._plan.pop(0)
                if index is None:
                    index = self._fastest_known()
                elif not self._alive[index]:
                    continue
                return index, calls, first
            if self._rounds == current().race_rounds:
                return None
            self._drop_slow_windows()
            alive = [i for i, up in enumerate(self._alive) if up]
            if len(alive) < 2:
                return None
            # Each other entry's window follows one of the fastest entry's (by its windows so far), so that no
            # span of calls holds two slower entries' windows back to back.
            fastest = min(alive, key=lambda i: _median(self._samples[i]))
            others = [i for i in alive if i != fastest]
            shift = self._rounds % len(others)
            window = current().race_calls
            self._plan = [w for i in others[shift:] + others[:shift] for w in ((fastest, window, False),
                                                                                (i, window, False))]
            self._rounds += 1

    def _fastest_known(self) -> int:
        """The entry left whose median window is fastest (the start before any window ran)."""
        timed = [(_median(samples), i) for i, samples in enumerate(self._samples) if samples and self._alive[i]]
        return min(timed)[1] if timed else self._start

    def _drop_slow_windows(self) -> None:
        """Before a round: entries whose median window is slower than the fastest's by more than race_round_keep go."""
        times = self._times()
        alive = [i for i, up in enumerate(self._alive) if up]
        fastest = min(times[i] for i in alive)
        for i in alive:
            if times[i] > fastest * (1 + current().race_round_keep):
                self._alive[i] = False

    def _times(self) -> list[float]:
        """µs per plain call of each entry: the median of its windows (infinite where it ran none)."""
        return [_median(samples) for samples in self._samples]

    def _decide(self) -> int:
        times = self._times()
        alive = [i for i, up in enumerate(self._alive) if up]
        # the entries left that ran a window; the one left where the others were dropped before it ran any
        best = min([i for i in alive if times[i] < float("inf")] or alive or [0], key=times.__getitem__)
        if self._alive[0] and times[best] > times[0] * (1 - current().race_margin):
            best = 0
        _remember(self.key, best)
        logger.info("autofuse: un-graphed calls at M=%d run %s (%.1f us per plain call; %s)", self.M,
                    _describe(self.tables[best]), times[best],
                    ", ".join(f"{_describe(t)} {us:.1f} us" for t, us in zip(self.tables, times)))
        return best

    def _settle(self, best: int):
        """Run entry `best` from now on; the others are dropped."""
        self.plain, self.plain_table = self.entries[best], self.tables[best]
        if self.decided_after is None:
            self.decided_after = self.calls
        self.entries, self.tables, self._samples, self._checkpoints = [], [], [], []
        return self.plain

    def race_calls(self) -> int:
        """The most un-graphed calls the race takes from its first to the decision (race_length)."""
        return race_length(len(self.entries))


def _runs_library(table: dict[str, Choice]) -> bool:
    return any(choice.kernel is None for choice in table.values())


def _median(samples: list[float]) -> float:
    """µs per plain call of an entry's windows: their median, infinite where it ran none."""
    return statistics.median(samples) if samples else float("inf")


def _remember(key: tuple, best: int) -> None:
    if len(_decided) >= _KEPT:
        _decided.clear()
    _decided[key] = best


def _now() -> float:
    return time.perf_counter()


def _mark(device: torch.device | None):
    """A mark on `device`'s current stream (the current device's where None): a CUDA event recorded there (its
    elapsed_time, query and synchronize)."""
    event = torch.cuda.Event(enable_timing=True)
    event.record(torch.cuda.current_stream(device))
    return event


def _reached(mark) -> bool:
    return mark.query()


def _wait(mark) -> None:
    mark.synchronize()


def _per_call_us(window: _Window, mark, calls: int) -> float:
    """µs per call up to `mark` (reached), after `calls` calls: from the window's start for its first call; after
    it, from the first call's end (the first call after a switch of tables runs slow, more for some tables than
    for others)."""
    after_first = window.marks.get(1)
    if calls == 1 or after_first is None:
        return window.start_mark.elapsed_time(mark) * 1e3 / calls
    return after_first.elapsed_time(mark) * 1e3 / (calls - 1)


def _synchronize(device: torch.device | None) -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize(device)


def _ranked(host: list[float], estimate: list[float]) -> list[float]:
    """Each entry's rank for the race's start and order (lowest first): its host time per call with the policy's
    race_host_slack on it, or its estimate where that is larger. Host times read at a module's first call run up to
    1.45x slower over the next few hundred calls (3840 -> 12688 at M = 128, H200: library tables estimated at 96-102
    us a call ran 134-146 in their first windows, while a kernel table estimated by its 111 us of GPU time ran 104),
    so a table bound by its GPU time starts before a host-bound one whose estimate is near it."""
    slack = 1 + current().race_host_slack
    return [max(us * slack, guess) for us, guess in zip(host, estimate)]


def _bound_by_gpu(host_us: float, estimate_us: float) -> bool:
    """Whether an entry's estimate is its known GPU time with its host time under it by race_host_slack: its plain
    call is that GPU time, its launches queued ahead of it."""
    return estimate_us >= host_us * (1 + current().race_host_slack)


def _host_limit(host: list[float], estimate: list[float], known: list[int]) -> float:
    """The host time a call over which an entry is dropped without a window: race_host_keep over the lowest
    estimate of an entry of known GPU time, or race_host_keep_bound over the lowest of one bound by its GPU time
    (_bound_by_gpu) where that is lower. A plain call costs at least its entry's host time and the caller's work
    around it, which every entry pays alike, and one bound by its GPU time costs that GPU time, so an entry whose host
    time alone is over such an estimate cannot be faster; host times read at the first call run slower afterwards,
    not faster (3840 -> 12688 at M = 128, H200: library tables of 113-169 us of host time a call beside a kernel
    table of 58-61 us of host for 108-111 of GPU time ran their probes at 212-296 us a call, and the windows of 50
    calls holding them 1.3-1.5x eager's)."""
    policy = current()
    limit = min(estimate[i] for i in known) * (1 + policy.race_host_keep)
    bound = [estimate[i] for i in known if _bound_by_gpu(host[i], estimate[i])]
    return min(limit, min(bound) * (1 + policy.race_host_keep_bound)) if bound else limit


def _describe(table: dict[str, Choice]) -> str:
    return "; ".join(f"{op} {c.config.short()}" for op, c in table.items())
