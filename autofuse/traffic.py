"""The traffic a deployment runs: how often each fused module shape runs at each M, and the time it takes.

Recording is opt-in: `with autofuse.record_traffic("traces/"):` around the work, or AUTOFUSE_TRAFFIC=traces/ in
the environment (written when the process exits). Every eager forward of a FusedMLP / FusedLinear counts one
call of its shape at its M (a dict increment: no synchronisation); a module's second call at an M and every
`sample_every`-th after it are timed (never its first, which resolves and binds its configs): CUDA events
recorded around the forward, read when the trace is written (on the CPU, wall time). An un-graphed forward's
events span what the GPU spends on it, its wait for the host's launches included, so a host-bound decode step
records its host time. Forwards inside torch.compile or torch.export are not recorded; a CUDA graph capture
counts its calls once and its replays not at all (they never reach Python).

A trace is plain JSON, written atomically (a file beside it, renamed over it); several processes (ranks,
replicas) write their own files into one folder (traffic-<host>-<pid>-<n>.json), and `load` merges every trace
of a folder by summing counts. A shape's tuning keys (gated_up, gated_pairs, down, mlp, linear at an M) all
derive from the shape and M recorded here, so the trace is kept per shape; `autofuse tune --traffic` turns it
into keys (autofuse/tune/traffic.py).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import itertools
import json
import math
import os
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from .device import capturing
from .errors import AutofuseError, shown
from .opspec import WEIGHT_FORMATS

FORMAT = "autofuse-traffic"
VERSION = 1
KINDS = ("mlp", "linear")
_DTYPES = ("float32", "float16", "bfloat16")
# What every entry of a trace holds; "weights" (a format other than dense) may stand beside them.
_ENTRY_FIELDS = {"kind", "dims", "activation", "bias", "dtype", "train", "tokens"}
# Pending CUDA event pairs kept before the finished ones are read (query(): no synchronisation).
_PENDING_KEPT = 64
# One call in SAMPLE_EVERY is timed: a timed call costs 25-60 us of host time more than a counted one (two CUDA
# events recorded and read back; H100 host), so one in 256 keeps the recorder's cost near 0.5 us per call,
# while a module's second call at each M is always timed.
SAMPLE_EVERY = 256


@dataclasses.dataclass(frozen=True)
class Shape:
    """A fused module's shape as a trace keys it: an MLP (dims d_model, d_ff) or a Linear (in, out features)."""

    kind: str
    dims: tuple[int, int]
    activation: str
    bias: bool
    dtype: str
    train: bool  # recorded in a forward that builds a graph for a backward
    weights: str = "dense"  # the module's weight format (opspec.WEIGHT_FORMATS): fp8 and w8a8 modules run other ops

    def label(self) -> str:
        a, b = self.dims
        what = f"mlp {a}->{b}" if self.kind == "mlp" else f"linear {a}->{b}"
        weights = "" if self.weights == "dense" else f" {self.weights}"
        return (f"{what} {self.activation}{' bias' if self.bias else ''} {self.dtype}{weights}"
                f"{' train' if self.train else ''}")


@dataclasses.dataclass
class Count:
    """Calls at one M, and the calls of them that were timed with their total time."""

    calls: int = 0
    sampled: int = 0
    sampled_ms: float = 0.0

    def add(self, other: Count) -> None:
        self.calls += other.calls
        self.sampled += other.sampled
        self.sampled_ms += other.sampled_ms


@dataclasses.dataclass
class Traffic:
    """Counts by shape and M, merged from one or more traces; `sources` the files read, `gpus` their devices."""

    counts: dict[Shape, dict[int, Count]] = dataclasses.field(default_factory=dict)
    gpus: set[str] = dataclasses.field(default_factory=set)
    sources: list[str] = dataclasses.field(default_factory=list)

    def count(self, shape: Shape, M: int) -> Count:
        by_m = self.counts.get(shape)
        if by_m is None:
            by_m = self.counts[shape] = {}
        count = by_m.get(M)
        if count is None:
            count = by_m[M] = Count()
        return count

    def merge(self, other: Traffic) -> None:
        for shape, by_m in other.counts.items():
            for M, count in by_m.items():
                self.count(shape, M).add(count)
        self.gpus |= other.gpus
        self.sources += other.sources

    def per_call_ms(self, shape: Shape, M: int) -> float | None:
        """The mean timed ms of a call at M, or where no call at M was timed, the nearest timed M's scaled by the
        rows (an upper estimate below it, a lower one above it); None where no call of the shape was timed."""
        by_m = self.counts.get(shape, {})
        own = by_m.get(M)
        if own is not None and own.sampled:
            return own.sampled_ms / own.sampled
        timed = [(m, c) for m, c in by_m.items() if c.sampled]
        if not timed:
            return None
        m, c = min(timed, key=lambda mc: (abs(math.log2(mc[0] / M)), mc[0]))
        # Decode rows cost little beside the weights: a call at M costs at least the nearest timed one's at
        # fewer rows, and at most that scaled by the rows.
        per_call = c.sampled_ms / c.sampled
        return per_call if m >= M else per_call * min(M / m, max(1.0, M / 256))

    def time_ms(self, shape: Shape, M: int) -> float | None:
        per_call = self.per_call_ms(shape, M)
        return None if per_call is None else per_call * self.counts[shape][M].calls

    def to_json(self, gpu: str) -> dict:
        entries = []
        for shape, by_m in sorted(self.counts.items(), key=lambda kv: dataclasses.astuple(kv[0])):
            tokens = [[M, c.calls, c.sampled, round(c.sampled_ms, 6)] for M, c in sorted(by_m.items())]
            entry = dict(kind=shape.kind, dims=list(shape.dims), activation=shape.activation, bias=shape.bias,
                         dtype=shape.dtype, train=shape.train, tokens=tokens)
            if shape.weights != "dense":  # dense shapes' entries stay as they were written before formats
                entry["weights"] = shape.weights
            entries.append(entry)
        return dict(format=FORMAT, version=VERSION, gpu=gpu,
                    time="GPU ms (CUDA events)" if gpu != "cpu" else "CPU wall ms", entries=entries)


def _int(value, what: str, low: int = 0) -> int:
    if type(value) is not int or value < low or value > 2**53:
        raise ValueError(f"{what} must be an integer >= {low}, got {shown(value, 30)}")
    return value


def parse(document, source: str) -> Traffic:
    """A decoded trace, validated: AutofuseError with a one-line reason for anything off."""
    try:
        if not isinstance(document, dict) or document.get("format") != FORMAT:
            raise ValueError(f"not an autofuse traffic trace (its \"format\" is not {FORMAT!r})")
        if document.get("version") != VERSION:
            raise ValueError(f"trace version {shown(document.get('version'), 20)}; this autofuse reads {VERSION}")
        gpu = document.get("gpu")
        if not isinstance(gpu, str) or not gpu.isprintable() or len(gpu) > 100:
            raise ValueError("\"gpu\" must be a device name")
        entries = document.get("entries")
        if not isinstance(entries, list):
            raise ValueError("\"entries\" must be a list")
        traffic = Traffic(gpus={gpu}, sources=[source])
        for i, e in enumerate(entries):
            where = f"entries[{i}]"
            if not isinstance(e, dict) or set(e) - {"weights"} != _ENTRY_FIELDS:
                raise ValueError(f"{where} must hold kind, dims, activation, bias, dtype, train and tokens (and "
                                 "weights)")
            weights = e.get("weights", "dense")
            if weights not in WEIGHT_FORMATS:
                raise ValueError(f"{where}.weights must be one of {', '.join(WEIGHT_FORMATS)}")
            if e["kind"] not in KINDS:
                raise ValueError(f"{where}.kind must be one of {', '.join(KINDS)}, got {shown(e['kind'], 20)}")
            dims = e["dims"]
            if not isinstance(dims, list) or len(dims) != 2:
                raise ValueError(f"{where}.dims must be two sizes")
            dims = tuple(_int(d, f"{where}.dims", 1) for d in dims)
            if not isinstance(e["activation"], str) or not e["activation"].isidentifier():
                raise ValueError(f"{where}.activation must be an activation's name")
            if type(e["bias"]) is not bool or type(e["train"]) is not bool:
                raise ValueError(f"{where}.bias and .train must be true or false")
            if e["dtype"] not in _DTYPES:
                raise ValueError(f"{where}.dtype must be one of {', '.join(_DTYPES)}")
            shape = Shape(e["kind"], dims, e["activation"], e["bias"], e["dtype"], e["train"], weights)
            if not isinstance(e["tokens"], list):
                raise ValueError(f"{where}.tokens must be a list of [M, calls, sampled, sampled_ms]")
            for j, row in enumerate(e["tokens"]):
                if not isinstance(row, list) or len(row) != 4:
                    raise ValueError(f"{where}.tokens[{j}] must be [M, calls, sampled, sampled_ms]")
                M, calls, sampled = (_int(v, f"{where}.tokens[{j}]", low) for v, low in zip(row[:3], (1, 0, 0)))
                ms = row[3]
                if type(ms) not in (int, float) or not math.isfinite(ms) or ms < 0 or sampled > calls:
                    raise ValueError(f"{where}.tokens[{j}]: sampled calls and their ms must be within the calls")
                traffic.count(shape, M).add(Count(calls, sampled, float(ms)))
        return traffic
    except ValueError as e:
        raise AutofuseError(f"{source}: {e}") from None


def load(path: str | Path) -> Traffic:
    """The traffic of one trace file, or of every trace (*.json) in a folder, merged."""
    path = Path(path)
    files = sorted(path.glob("*.json")) if path.is_dir() else [path]
    if path.is_dir() and not files:
        raise AutofuseError(f"{path}: no traffic traces (*.json) in this folder")
    merged = Traffic()
    for file in files:
        try:
            text = file.read_text()
        except OSError as e:
            raise AutofuseError(f"cannot read the traffic trace {file}: {e.strerror or e}") from None
        try:
            document = json.loads(text)
        except json.JSONDecodeError as e:
            raise AutofuseError(f"{file}: not JSON ({e.msg}, line {e.lineno})") from None
        merged.merge(parse(document, str(file)))
    return merged


def _gpu_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


class Recorder:
    """Counts the calls of fused modules by shape and M, timing a sample of them; writes a trace on demand."""

    def __init__(self, destination: str | Path, sample_every: int = SAMPLE_EVERY) -> None:
        if type(sample_every) is not int or sample_every < 1:
            raise AutofuseError(f"sample_every must be a positive integer, got {shown(sample_every, 20)}")
        self.destination = Path(destination)
        self.sample_every = sample_every
        self.traffic = Traffic()
        # Per call only a dict count keyed by (module, M), one dict for inference and one for training: the
        # module object, not its id (a module freed while recording cannot pass its counts to a new one at the
        # same address), and no dtype, which is the module's (its input must match it) and which a dtype change
        # (.to(), .half()) settles by moving the module's counts aside first (retire).
        self._calls: tuple[dict, dict] = ({}, {})  # [train] -> {(module, M): calls}
        self._shapes: dict[tuple, Shape] = {}  # (module, train) -> its Shape
        self._retired: dict[tuple[Shape, int], int] = {}  # calls of modules whose dtype changed since
        self._pending: list[tuple[Count, object, object]] = []  # (count, start event, end event)
        self._free: list[tuple[object, object]] = []  # event pairs read and free again
        self._gpu = "cpu"
        self._lock = threading.Lock()
        self._written: Path | None = None

    def due(self, module, M: int, train: bool) -> bool:
        """Count one call of a fused module at M (per module, so that a module's first call at an M, which
        resolves and binds its configs, is never timed); whether this call is to be timed: the module's second
        call at that M, then every sample_every-th. Called by the modules' forwards once they know M."""
        calls = self._calls[train]
        key = (module, M)
        n = calls.get(key, 0) + 1
        calls[key] = n
        if n > 2:
            return not n % self.sample_every
        if M < 1:  # an empty batch launches nothing
            del calls[key]
            return False
        if n == 1:
            self._shapes[(module, train)] = _shape_of(module, train)
            return False
        return True

    def calls(self, module, M: int, train: bool = False) -> int:
        """The calls of `module` at M counted since its dtype last changed."""
        return self._calls[train].get((module, M), 0)

    def retire(self, module) -> None:
        """Before `module`'s parameters change dtype (nn.Module._apply): its counts so far are kept under the shape
        they were made with, and its next call starts new ones under the new shape."""
        with self._lock:
            for train, calls in enumerate(self._calls):
                shape = self._shapes.pop((module, bool(train)), None)
                for key in [key for key in calls if key[0] is module]:
                    n = calls.pop(key)
                    if shape is not None:
                        self._retired[(shape, key[1])] = self._retired.get((shape, key[1]), 0) + n

    def timed(self, module, M: int, train: bool, device: torch.device, run):
        """run(), timed as one sample of the module's shape at M."""
        return self._timed(self._shapes[(module, train)], M, device, run)

    def _timed(self, shape: Shape, M: int, device: torch.device, run):
        count = self.traffic.count(shape, M)
        if device.type == "cuda":
            if capturing(device):  # a capture records, it does not run: nothing to time
                return run()
            if self._gpu == "cpu":
                self._gpu = _gpu_name(device)
            with self._lock:
                start, end = self._free.pop() if self._free else (torch.cuda.Event(enable_timing=True),
                                                                   torch.cuda.Event(enable_timing=True))
            start.record()
            out = run()
            end.record()
            with self._lock:
                self._pending.append((count, start, end))
                if len(self._pending) > _PENDING_KEPT:
                    self._read_events(wait=False)
            return out
        began = time.perf_counter()
        out = run()
        count.sampled += 1
        count.sampled_ms += (time.perf_counter() - began) * 1e3
        return out

    def _read_events(self, wait: bool) -> None:
        """Fold the timed samples that have ended into their counts (all of them, waiting, where `wait`). Without
        waiting, the reading stops at the first sample still running: samples end in the order they were queued
        (one stream), and querying each one left would cost every timed call tens of µs."""
        pending = self._pending
        done = 0
        for count, start, end in pending:
            if wait:
                end.synchronize()
            elif not end.query():
                break
            done += 1
            count.sampled += 1
            count.sampled_ms += start.elapsed_time(end)
            self._free.append((start, end))  # events are reused: creating a pair costs more than a forward
        del pending[:done]

    def snapshot(self) -> Traffic:
        """The traffic so far (timed samples still running on the GPU are waited for)."""
        with self._lock:
            self._read_events(wait=True)
            calls = dict(self._retired)
            for train, counted in enumerate(self._calls):
                for (module, M), n in counted.items():
                    where = (self._shapes[(module, bool(train))], M)
                    calls[where] = calls.get(where, 0) + n
            for (shape, M), n in calls.items():
                self.traffic.count(shape, M).calls = n
            return self.traffic

    def write(self) -> Path:
        """Write the trace now (atomically) and return its path: the destination file, or a file of this process
        in the destination folder."""
        traffic = self.snapshot()
        path = self._written or self._path()
        document = traffic.to_json(self._gpu)
        folder = path.parent
        if not folder.is_dir():
            raise AutofuseError(f"cannot write the traffic trace {path}: the folder {folder} does not exist")
        fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(document, f, indent=1)
            f.write("\n")
        os.replace(tmp, path)
        self._written = path
        return path

    def _path(self) -> Path:
        if self.destination.suffix == ".json" and not self.destination.is_dir():
            return self.destination
        self.destination.mkdir(parents=True, exist_ok=True)
        stem = f"traffic-{socket.gethostname()}-{os.getpid()}"
        for n in itertools.count():
            path = self.destination / f"{stem}-{n}.json"
            if not path.exists():
                return path
        raise AssertionError("unreachable")


# The recorder that modules report to, or None (the default: one global read per forward).
recorder: Recorder | None = None


def _shape_of(module, train: bool) -> Shape:
    """A fused module's Shape (FusedMLP: d_model, d_ff; FusedLinear: in, out features), in its weights' dtype."""
    if hasattr(module, "d_ff"):
        kind, dims, bias = "mlp", (module.d_model, module.d_ff), module.gate_proj.bias is not None
    else:
        kind, dims, bias = "linear", (module.in_features, module.out_features), module.bias is not None
    dtype = module._reference_weight().dtype
    weights = getattr(module, "weights", "dense")  # FusedLinearFp8 / FusedMLPFp8 say theirs
    return Shape(kind, dims, module.activation, bias, str(dtype).removeprefix("torch."), train, weights)


@contextlib.contextmanager
def record_traffic(destination: str | Path, sample_every: int = SAMPLE_EVERY) -> Iterator[Recorder]:
    """Record the fused modules' traffic inside the block and write it to `destination` (a .json file, or a folder
    that gets a file of this process) when the block ends; `recorder.write()` writes it sooner."""
    global recorder
    if recorder is not None:
        raise AutofuseError("traffic is already being recorded in this process")
    made = Recorder(destination, sample_every)
    recorder = made
    try:
        yield made
    finally:
        recorder = None
        made.write()


def _from_environment() -> None:
    """AUTOFUSE_TRAFFIC=<file or folder>: record this whole process, written at its exit."""
    global recorder
    where = os.environ.get("AUTOFUSE_TRAFFIC", "").strip()
    if not where or recorder is not None:
        return
    made = Recorder(where)
    recorder = made
    atexit.register(made.write)


_from_environment()
