"""Triton compiles in worker processes, for the kernels a first use compiles.

A Triton compile holds the GIL through its Python front end and most of its passes, so the threads a module's
first forward compiles its four to eight kernels on (check.precompile) overlap only in part. Worker processes
(_compile_worker.py: Python with Triton imported, no torch, no CUDA context) compile them side by side into
Triton's cache, where the thread that asked then finds the kernel and only loads it.

How a kernel reaches a worker: the thread runs the launch it would compile with a Triton JIT hook
(knobs.runtime.jit_cache_hook) that, in that thread only, takes the JIT's specialization (Triton's own
serialized form, the arguments of JITFunction.preload) and the generated kernel's text (from linecache, where
render.load_source put it; only autofuse's kernels), skips the compile and returns no kernel, so nothing
launches. The worker compiles the same source with the same specialization for the same target, so Triton's
cache key is the one the thread's own compile computes next.

Workers start when a module is built on (or moved onto) a GPU, else at a process's first check (a first use that
finds none ready compiles on its threads as before), and are used where one is idle and ready; a kernel a worker
could not compile is compiled by the thread as before. A check's kernels may compile in the background
(compile_ahead_in_background) while the checks before theirs time: the wait for a worker makes no CUDA call.
AUTOFUSE_COMPILE_WORKERS sets how many (0: none). A worker ends after IDLE_S without a request, so a long-running
process holds no idle compilers; they start again as they did first. The workers compile for one Triton target, the
GPU a module was last built on or moved onto; in a process with GPUs of two architectures a kernel for the other is
compiled by the thread that launches it, as without workers.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import linecache
import logging
import os
import select
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

logger = logging.getLogger("autofuse")

_SCRIPT = Path(__file__).with_name("_compile_worker.py")
# The most workers a process starts: a first forward compiles at most about eight kernels at once.
MAX_WORKERS = 8
# Seconds a worker waits for a request before it ends (about 114 MB each while it runs).
IDLE_S = 600.0


def _is_python(executable: str) -> bool:
    """Whether `executable` (sys.executable) is a Python interpreter that can run the worker script: not empty, as
    in an embedding program, nor that program itself."""
    return os.path.basename(executable).lower().startswith(("python", "pypy"))


def worker_count() -> int:
    """How many workers to start: AUTOFUSE_COMPILE_WORKERS, or half the CPUs up to MAX_WORKERS."""
    value = os.environ.get("AUTOFUSE_COMPILE_WORKERS", "").strip()
    if not value:
        return 0 if os.name != "posix" else min(MAX_WORKERS, (os.cpu_count() or 1) // 2)
    try:
        return max(0, min(int(value), MAX_WORKERS))
    except ValueError:
        logger.warning("autofuse: AUTOFUSE_COMPILE_WORKERS=%r is not a whole number; compiling without workers",
                       value[:40])
        return 0


class _Worker:
    """One worker process and the reply bytes read from it."""

    def __init__(self, target: tuple[str, int, int], idle_s: float = IDLE_S) -> None:
        # Never the interpreter: a worker compiles (TRITON_INTERPRET would make its kernels interpreted functions).
        environment = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
        self.process = subprocess.Popen([sys.executable, str(_SCRIPT), *map(str, target), repr(float(idle_s))],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                        env=environment)
        self.ready: bool | None = None  # None until its first line says
        self._pending = b""

    def poll_ready(self) -> bool:
        """Whether the worker is ready, reading its first line where it has written it (never waits); False once
        it has ended (after IDLE_S without a request, or killed)."""
        if self.ready and self.process.poll() is not None:
            self.ready = False
        if self.ready is None:
            reply = self._line(0.0)
            if reply is not None:
                self.ready = bool(reply.get("ready"))
                if not self.ready:
                    logger.debug("autofuse: a compile worker could not start: %s", reply.get("error"))
                    self.stop()
            elif self.process.poll() is not None:
                self.ready = False
        return bool(self.ready)

    def compile(self, request: dict, timeout_s: float) -> str | None:
        """Have the worker compile one kernel: None when done, else why not (the worker is stopped where it
        did not answer within timeout_s)."""
        try:
            self.process.stdin.write(json.dumps(request).encode() + b"\n")
            self.process.stdin.flush()
        except OSError as e:
            self.stop()
            return f"the worker is gone ({type(e).__name__})"
        reply = self._line(timeout_s)
        if reply is None:
            self.stop()
            return f"no answer within {timeout_s:g} s"
        return None if reply.get("ok") else str(reply.get("error"))

    def _line(self, timeout_s: float) -> dict | None:
        """The worker's next line as JSON, or None where none came within timeout_s (or the worker ended)."""
        deadline = time.monotonic() + timeout_s
        fd = self.process.stdout.fileno()
        while b"\n" not in self._pending:
            remaining = max(0.0, deadline - time.monotonic())
            if not select.select([fd], [], [], remaining)[0]:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                self.ready = False
                return None
            self._pending += chunk
        line, self._pending = self._pending.split(b"\n", 1)
        try:
            reply = json.loads(line)
        except ValueError:
            reply = None
        if not isinstance(reply, dict):  # not the worker's protocol: its replies cannot be trusted from here on
            self.stop()
            return {"ok": False, "ready": False, "error": f"not a reply: {line[:200].decode(errors='replace')}"}
        return reply

    def stop(self) -> None:
        self.ready = False
        with contextlib.suppress(OSError):
            self.process.kill()
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            self.process.wait(timeout=1)


class _Pool:
    def __init__(self, target: tuple[str, int, int], count: int, idle_s: float = IDLE_S) -> None:
        self.pid = os.getpid()
        self.target = target
        self.workers = [_Worker(target, idle_s) for _ in range(count)]
        self.idle = list(self.workers)
        self.lock = threading.Lock()

    def take(self) -> _Worker | None:
        """An idle worker that is ready, or None (never waits for one)."""
        with self.lock:
            for worker in self.idle:
                if worker.poll_ready():
                    self.idle.remove(worker)
                    return worker
        return None

    def running(self) -> bool:
        """Whether any worker has not ended (each ends after IDLE_S without a request)."""
        return any(worker.process.poll() is None for worker in self.workers)

    def give_back(self, worker: _Worker) -> None:
        with self.lock:
            if worker.ready:
                self.idle.append(worker)

    def stop(self) -> None:
        if self.pid != os.getpid():  # a forked child's copy (its atexit too): the workers are its parent's
            return
        for worker in self.workers:
            with contextlib.suppress(OSError):
                worker.process.stdin.close()
            worker.stop()


_pool: _Pool | None = None
_pool_lock = threading.Lock()


def _stop_at_exit() -> None:
    """Stop this process's workers as it exits (a forked child's copy of its parent's pool is left running)."""
    if _pool is not None:
        _pool.stop()


atexit.register(_stop_at_exit)


def start(target: tuple[str, int, int]) -> None:
    """Start this process's workers for `target` ((backend, arch, warp size), Triton's GPUTarget) unless they run;
    never waits for them. A process forked from one with workers starts its own; workers that ended after IDLE_S
    without a request start again."""
    global _pool
    with _pool_lock:
        if _pool is not None and _pool.pid == os.getpid() and _pool.target == target and _pool.running():
            return
        count = worker_count()
        if count == 0 or not _is_python(sys.executable) or not _install_hook():
            return
        if _pool is not None and _pool.pid == os.getpid():
            _pool.stop()
        try:
            _pool = _Pool(target, count)
        except OSError as e:
            logger.debug("autofuse: could not start compile workers (%s: %s)", type(e).__name__, e)
            return


def start_for(device) -> None:
    """start() for the Triton target of a CUDA device (torch.device)."""
    try:
        import torch
        from triton.runtime import driver

        with torch.cuda.device(device):
            target = driver.active.get_current_target()
    except Exception as e:  # noqa: BLE001 - no workers: the threads compile as before
        logger.debug("autofuse: no compile workers (%s: %s)", type(e).__name__, e)
        return
    start((target.backend, target.arch, target.warp_size))


def compile_ahead(launch: Callable[[], object], timeout_s: float) -> int:
    """Have an idle worker compile the kernels `launch()` would compile here (captured, not launched): how many it
    compiled into Triton's cache (0 where no worker is ready and idle; the caller's own compile then does it all)."""
    taken = _captured_by_idle_worker(launch)
    if taken is None:
        return 0
    pool, worker, requests = taken
    try:
        return _compile_on(worker, requests, timeout_s)
    finally:
        pool.give_back(worker)


def compile_ahead_in_background(launch: Callable[[], object], timeout_s: float, tag: object) -> bool:
    """compile_ahead, returning once `launch()` is captured (here, in this thread: it may allocate on the GPU) while
    an idle worker compiles in the background: wait_for(tag) waits for that. False where no worker is ready and idle
    or nothing was captured (the caller then compiles as before). The background thread makes no CUDA call, so it
    may run while the checks' timing graphs capture."""
    taken = _captured_by_idle_worker(launch)
    if taken is None:
        return False
    pool, worker, requests = taken
    if not requests:
        pool.give_back(worker)
        return False
    done = threading.Event()
    with _pending_lock:
        _pending[tag] = done

    def compile_all() -> None:
        try:
            _compile_on(worker, requests, timeout_s)
        finally:
            pool.give_back(worker)
            done.set()
            with _pending_lock:
                if _pending.get(tag) is done:
                    del _pending[tag]

    threading.Thread(target=compile_all, name="autofuse-compile-worker", daemon=True).start()
    return True


def _captured_by_idle_worker(launch: Callable[[], object]) -> tuple[_Pool, _Worker, list[dict]] | None:
    """(pool, an idle ready worker taken from it, the requests `launch()` made while captured), or None where this
    process has no such worker (launch() is then not run). The caller gives the worker back."""
    pool = _pool
    if pool is None or pool.pid != os.getpid():
        return None
    worker = pool.take()
    if worker is None:
        return None
    try:
        with _capturing(pool.target) as requests:
            launch()
    except BaseException:
        pool.give_back(worker)
        raise
    return pool, worker, requests


def _compile_on(worker: _Worker, requests: list[dict], timeout_s: float) -> int:
    """Have `worker` compile the requests in turn, up to the first it could not: how many it compiled."""
    for compiled, request in enumerate(requests):
        error = worker.compile(request, timeout_s)
        if error is not None:
            logger.debug("autofuse: a compile worker did not compile %s: %s", request["name"], error)
            return compiled
    return len(requests)


def wait_for(tag: object, timeout_s: float) -> None:
    """Wait, up to timeout_s, for a background compile of `tag` (compile_ahead_in_background) that is still
    running; at once where none is."""
    with _pending_lock:
        done = _pending.get(tag)
    if done is not None:
        done.wait(timeout_s)


_pending: dict[object, threading.Event] = {}
_pending_lock = threading.Lock()

_capture = threading.local()


def capturing() -> bool:
    """Whether this thread's launches are being captured for a worker (no kernel runs)."""
    return getattr(_capture, "requests", None) is not None


@contextlib.contextmanager
def _capturing(target: tuple[str, int, int] | None = None) -> Iterator[list[dict]]:
    """Capture this thread's launches of autofuse's kernels as requests for a worker compiling for `target` (None:
    any)."""
    requests: list[dict] = []
    _capture.requests, _capture.target = requests, target
    try:
        yield requests
    finally:
        _capture.requests = _capture.target = None


def _target_of(jit, device) -> tuple[str, int, int] | None:
    """The Triton target (backend, arch, warp size) the JIT function compiles for on `device`, from the JIT's own
    per-device cache entry (kernels, _, target, backend, binder); None where this Triton keeps it otherwise."""
    caches = getattr(jit, "device_caches", None)
    try:
        if caches is None or device not in caches:  # `in`, not a lookup: the JIT's defaultdict would make an entry
            return None
        target = caches[device][2]
        return (target.backend, target.arch, target.warp_size)
    except (AttributeError, IndexError, TypeError):
        return None


_hook_installed = False
_previous_hook = None


def _install_hook() -> bool:
    """Chain the capture hook in front of any jit_cache_hook already set; False where this Triton has none."""
    global _hook_installed, _previous_hook
    if _hook_installed:
        return True
    try:
        import triton

        runtime = triton.knobs.runtime
        _previous_hook = runtime.jit_cache_hook
        runtime.jit_cache_hook = _hook
    except (ImportError, AttributeError) as e:
        logger.debug("autofuse: no compile workers with this Triton (%s: %s)", type(e).__name__, e)
        return False
    _hook_installed = True
    return True


def _hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled):  # noqa: A002 - Triton's keywords
    requests = getattr(_capture, "requests", None)
    if requests is None:
        return None if _previous_hook is None else _previous_hook(
            key=key, repr=repr, fn=fn, compile=compile, is_manual_warmup=is_manual_warmup,
            already_compiled=already_compiled)
    import triton

    from .render import SOURCE_PREFIX

    jit = fn.jit_function
    filename = jit.fn.__code__.co_filename
    if not filename.startswith(SOURCE_PREFIX):
        return None  # not a kernel autofuse generated: compiled here, as without workers
    wanted = getattr(_capture, "target", None)
    found = _target_of(jit, compile.get("device"))
    if wanted is not None and found is not None and found != wanted:
        # A GPU of another architecture than the workers compile for (a process with two kinds of GPU): the
        # worker's kernel would sit under another cache key, so nothing is requested and the caller compiles it.
        return True

    requests.append({"source": "".join(linecache.getlines(filename)), "filename": filename,
                     "name": jit.fn.__name__, "spec": compile["specialization_data"],
                     "cache_dir": triton.knobs.cache.dir})
    return True  # skip this compile: the JIT returns no kernel and launches nothing
