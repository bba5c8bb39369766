"""Compile workers (autofuse/compile_workers.py): a worker compiles a kernel into Triton's cache where the parent's
own compile then finds it; the capture hook hands autofuse's kernels over and skips their compile; a captured
launch neither runs nor is memoised; a worker that fails or stalls is dropped, not waited for."""

import inspect
import json
import linecache
import logging
import os
import subprocess
import sys
import time
import types

import pytest
import torch

from autofuse import compile_workers, launch
from autofuse.ops.gated_act import GATED_ACT

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime.jit import serialize_specialization_data  # noqa: E402

SOURCE = '''import triton
import triton.language as tl


@triton.jit
def triple(x, y, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y + offsets, tl.load(x + offsets, mask=offsets < n) * 3, mask=offsets < n)
'''
FILENAME = "<autofuse kernel triple_test>"
TARGET = ("cuda", 90, 32)


def _kernel(block: int):
    """The test kernel as the parent holds it (registered in linecache like render.load_source), with the
    specialization its JIT would serialize for 16-byte aligned fp16 pointers and an aligned n."""
    linecache.cache[FILENAME] = (len(SOURCE), None, SOURCE.splitlines(keepends=True), FILENAME)
    module = types.ModuleType("triple_test")
    module.__file__ = FILENAME
    with triton.knobs.runtime.scope():
        triton.knobs.runtime.interpret = False  # a compiled kernel's JIT function, also where the interpreter runs
        exec(compile(SOURCE, FILENAME, "exec"), module.__dict__)  # noqa: S102 - the test's own kernel
    from triton.backends.nvidia.compiler import CUDABackend

    target = GPUTarget(*TARGET)
    options = CUDABackend(target).parse_options({"num_warps": 4})
    signature = {"x": "*fp16", "y": "*fp16", "n": "i32", "BLOCK": "constexpr"}
    constexprs = {(3,): block}
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(3)}
    extra = (target,) if "target" in inspect.signature(serialize_specialization_data).parameters else ()
    spec = serialize_specialization_data("triple", signature, constexprs, attrs, options, "key", *extra)
    return module.triple, signature, constexprs, attrs, options, spec


@pytest.fixture
def cache_dir(tmp_path):
    with triton.knobs.cache.scope(), triton.knobs.compilation.scope():
        triton.knobs.cache.dir = str(tmp_path / "triton")
        yield triton.knobs.cache.dir


def _ready_worker() -> compile_workers._Worker:
    worker = compile_workers._Worker(TARGET)
    deadline = time.monotonic() + 120
    while not worker.poll_ready():
        assert worker.ready is None, "the worker could not start"
        assert time.monotonic() < deadline, "the worker was not ready within 120 s"
        time.sleep(0.02)
    return worker


def _request(spec: str, cache_dir: str, source: str = SOURCE) -> dict:
    return {"source": source, "filename": FILENAME, "name": "triple", "spec": spec, "cache_dir": cache_dir}


# The parent's side, in a process of its own: a process that has run the interpreter cannot compile (the
# interpreter patches triton.language), and a real parent never runs it. Prints whether each block size's compile
# found its kernel in the cache.
_PARENT = """
import json, sys
sys.path[:0] = json.loads(sys.argv[1])
import triton
import test_compile_workers as t
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

hits = []
triton.knobs.cache.dir = sys.argv[2]
triton.knobs.compilation.listener = lambda **kw: hits.append(kw["cache_hit"])
for block in json.loads(sys.argv[3]):
    fn, signature, constexprs, attrs, options, _ = t._kernel(block)
    triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget(*t.TARGET), options=options.__dict__)
print(json.dumps(hits))
"""


def _parent_compiles(cache_dir: str, blocks: list[int]) -> list[bool]:
    environment = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    paths = [os.path.dirname(__file__), *sys.path]
    done = subprocess.run([sys.executable, "-c", _PARENT, json.dumps(paths), cache_dir, json.dumps(blocks)],
                          capture_output=True, text=True, env=environment, timeout=300, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_worker_compiles_a_kernel_the_parents_own_compile_then_finds_in_the_cache(cache_dir):
    *_, spec = _kernel(256)
    worker = _ready_worker()
    try:
        assert worker.compile(_request(spec, cache_dir), timeout_s=120) is None
    finally:
        worker.stop()
    # 256 was compiled by the worker: found; 512 was never sent: compiled by the parent itself.
    assert _parent_compiles(cache_dir, [256, 512]) == [True, False]


def test_a_worker_reports_a_kernel_it_cannot_compile_and_serves_the_next(cache_dir):
    *_, spec = _kernel(128)
    worker = _ready_worker()
    try:
        error = worker.compile(_request(spec, cache_dir, SOURCE.replace("tl.arange", "tl.no_such_function")),
                               timeout_s=120)
        assert error is not None and "no_such_function" in error
        assert worker.compile(_request(spec, cache_dir), timeout_s=120) is None
    finally:
        worker.stop()


def test_a_worker_that_does_not_answer_in_time_is_stopped(cache_dir):
    *_, spec = _kernel(64)
    worker = _ready_worker()
    error = worker.compile(_request(spec, cache_dir), timeout_s=0.0)
    assert error is not None and "no answer" in error
    assert worker.process.poll() is not None and not worker.ready


def test_what_a_kernels_module_prints_does_not_break_the_replies(cache_dir):
    *_, spec = _kernel(128)
    worker = _ready_worker()
    try:
        noisy = SOURCE.replace("import triton\n", "import triton\nprint('{\"ok\": false}')\n", 1)
        assert worker.compile(_request(spec, cache_dir, noisy), timeout_s=120) is None
        assert worker.compile(_request(spec, cache_dir), timeout_s=120) is None
    finally:
        worker.stop()


def test_a_worker_that_writes_something_else_than_replies_is_stopped():
    worker = object.__new__(compile_workers._Worker)  # a process that is not the worker script
    worker.process = subprocess.Popen([sys.executable, "-c", "import sys; print('warming up'); sys.stdin.read()"],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    worker.ready, worker._pending = None, b""
    deadline = time.monotonic() + 60
    while worker.ready is None and time.monotonic() < deadline:
        worker.poll_ready()
        time.sleep(0.02)
    assert worker.ready is False
    assert worker.process.wait(timeout=10) is not None


def test_a_worker_idle_past_its_time_ends_and_the_workers_start_again(monkeypatch):
    """A worker ends after idle_s seconds without a request (a long-running process keeps no idle compilers); it is
    then no longer ready, and start() starts the pool's workers again."""
    pool = compile_workers._Pool(TARGET, 1, idle_s=0.5)
    worker = pool.workers[0]
    try:
        deadline = time.monotonic() + 120
        while not worker.poll_ready():
            assert worker.ready is None and time.monotonic() < deadline, "the worker could not start"
            time.sleep(0.02)
        assert pool.running()
        worker.process.wait(timeout=60)  # ends by itself, no request having come
        assert not worker.poll_ready() and not pool.running() and pool.take() is None
        monkeypatch.setattr(compile_workers, "_pool", pool)
        monkeypatch.setattr(compile_workers, "worker_count", lambda: 1)
        monkeypatch.setattr(compile_workers, "_install_hook", lambda: True)
        compile_workers.start(TARGET)
        again = compile_workers._pool
        assert again is not pool and again.running()
        compile_workers.start(TARGET)  # running: left as it is
        assert compile_workers._pool is again
        again.stop()
    finally:
        pool.stop()


@pytest.mark.parametrize("executable, python", [("/usr/bin/python3.12", True), ("/opt/venv/bin/python", True),
                                                ("", False), ("/usr/bin/uwsgi", False)])
def test_workers_start_only_where_the_executable_is_python(executable, python):
    assert compile_workers._is_python(executable) is python


def _call_hook(jit_function, spec="{}"):
    """The hook as Triton's JIT calls it (JITFunction._call_hook's keywords)."""
    info = types.SimpleNamespace(jit_function=jit_function)
    return compile_workers._hook(key="k", repr="r", fn=info, compile={"specialization_data": spec},
                                 is_manual_warmup=False, already_compiled=False)


def test_the_hook_takes_autofuse_kernels_while_capturing_and_passes_on_otherwise(monkeypatch):
    fn, *_, spec = _kernel(256)
    seen = []
    monkeypatch.setattr(compile_workers, "_previous_hook", lambda **kw: seen.append(kw["key"]) or "previous")
    assert _call_hook(fn, spec) == "previous" and seen == ["k"]  # not capturing: the hook set before ours

    def elsewhere():
        pass

    with compile_workers._capturing() as requests:
        assert compile_workers.capturing()
        assert _call_hook(fn, spec) is True  # skipped here: the JIT returns no kernel
        assert _call_hook(types.SimpleNamespace(fn=elsewhere)) is None  # not autofuse's: compiled here as before
    assert not compile_workers.capturing()
    assert len(requests) == 1
    assert requests[0]["source"] == SOURCE and requests[0]["name"] == "triple" and requests[0]["spec"] == spec
    assert requests[0]["filename"] == FILENAME and requests[0]["cache_dir"] == triton.knobs.cache.dir


def test_a_background_compile_lands_in_the_cache_by_the_time_its_tag_is_waited_for(cache_dir, monkeypatch):
    fn, *_, spec = _kernel(1024)
    pool = compile_workers._Pool(TARGET, 1)
    monkeypatch.setattr(compile_workers, "_pool", pool)
    try:
        deadline = time.monotonic() + 120
        while not pool.workers[0].poll_ready():
            assert pool.workers[0].ready is None and time.monotonic() < deadline, "the worker did not start"
            time.sleep(0.02)
        asked = []

        def launch():  # what Triton's JIT does at a launch of an uncompiled kernel: asks the hook
            asked.append(_call_hook(fn, spec))
        assert compile_workers.compile_ahead_in_background(launch, 120, ("key", 16, "config"))
        assert asked == [True]  # captured, not compiled here
        compile_workers.wait_for(("key", 16, "config"), 120)
        assert _parent_compiles(cache_dir, [1024]) == [True]
        worker = pool.take()  # no idle worker left: nothing is captured, the caller compiles as before
        assert worker is not None
        assert not compile_workers.compile_ahead_in_background(launch, 120, ("key", 16, "other"))
        assert asked == [True]
        pool.give_back(worker)
        started = time.monotonic()
        compile_workers.wait_for(("key", 16, "never sent"), 120)  # nothing pending: no wait
        assert time.monotonic() - started < 1
    finally:
        pool.stop()


def test_a_launch_captured_for_a_worker_is_not_memoised(device):
    M, F = 4, 48
    g, u = (torch.randn(M, F, device=device, dtype=torch.float16) for _ in range(2))
    h = torch.full_like(g, float("nan"))
    key_count = len(launch._memo)
    with compile_workers._capturing():
        launch.pointwise_launch(GATED_ACT, "silu", g.dtype, M, F, {"g": g, "u": u, "h": h})
    assert len(launch._memo) == key_count
    launch.pointwise_launch(GATED_ACT, "silu", g.dtype, M, F, {"g": g, "u": u, "h": h})
    assert len(launch._memo) == key_count + 1
    expected = torch.nn.functional.silu(g.double()) * u.double()
    torch.testing.assert_close(h.double(), expected, rtol=2e-3, atol=2e-3)  # fp16 output: 2^-10 relative


def test_the_worker_count_comes_from_the_environment(monkeypatch, caplog):
    monkeypatch.setenv("AUTOFUSE_COMPILE_WORKERS", "3")
    assert compile_workers.worker_count() == 3
    monkeypatch.setenv("AUTOFUSE_COMPILE_WORKERS", "1000")
    assert compile_workers.worker_count() == compile_workers.MAX_WORKERS
    monkeypatch.setenv("AUTOFUSE_COMPILE_WORKERS", "0")
    assert compile_workers.worker_count() == 0
    monkeypatch.setenv("AUTOFUSE_COMPILE_WORKERS", "many")
    with caplog.at_level(logging.WARNING, logger="autofuse"):
        assert compile_workers.worker_count() == 0
    assert "AUTOFUSE_COMPILE_WORKERS='many' is not a whole number" in caplog.text
    monkeypatch.delenv("AUTOFUSE_COMPILE_WORKERS")
    expected = min(compile_workers.MAX_WORKERS, (os.cpu_count() or 1) // 2) if os.name == "posix" else 0
    assert compile_workers.worker_count() == expected


def test_a_forked_childs_copy_of_the_pool_leaves_the_parents_workers_running():
    pool = compile_workers._Pool(TARGET, 1)
    try:
        pool.pid = os.getpid() + 1  # as a forked child sees its parent's pool
        pool.stop()
        assert pool.workers[0].process.poll() is None
    finally:
        pool.pid = os.getpid()
        pool.stop()
    assert pool.workers[0].process.poll() is not None


@pytest.mark.gpu
def test_a_first_use_compiles_its_kernels_in_workers_and_its_checks_find_them(monkeypatch, tmp_path):
    import autofuse

    monkeypatch.setenv("AUTOFUSE_CHECK", "1")
    monkeypatch.setenv("AUTOFUSE_COMPILE_WORKERS", "4")
    compile_workers.start_for(torch.device("cuda"))
    pool = compile_workers._pool
    deadline = time.monotonic() + 120
    while not all(worker.poll_ready() for worker in pool.workers):
        assert all(worker.ready is not False for worker in pool.workers), "a compile worker could not start"
        assert time.monotonic() < deadline, "the compile workers were not ready within 120 s"
        time.sleep(0.05)
    ahead = []  # kernels compiled by workers: how many each compile_ahead took, 1 a background compile at least
    real, real_background = compile_workers.compile_ahead, compile_workers.compile_ahead_in_background
    monkeypatch.setattr(compile_workers, "compile_ahead", lambda *a, **k: ahead.append(real(*a, **k)) or ahead[-1])
    monkeypatch.setattr(compile_workers, "compile_ahead_in_background",
                        lambda *a, **k: ahead.append(int(real_background(*a, **k))) or bool(ahead[-1]))
    hits = []
    with triton.knobs.cache.scope(), triton.knobs.compilation.scope():
        triton.knobs.cache.dir = str(tmp_path / "triton")
        triton.knobs.compilation.listener = lambda **kw: hits.append(kw["cache_hit"])
        mlp = autofuse.get_mlp(1064, 2985, activation="silu", dtype=torch.bfloat16, device="cuda")
        x = torch.randn(16, 1064, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            y = mlp(x)
    assert sum(ahead) >= 2, ahead  # the gated up-projection's and the down projection's kernels at least
    assert hits.count(True) >= sum(ahead), (ahead, hits)  # each one a worker compiled, found in Triton's cache
    assert set(mlp.config_sources(16).values()) == {"checked"}
    w_gate, w_up, w_down = (p.double() for p in (mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight))
    expected = (torch.nn.functional.silu(x.double() @ w_gate.T) * (x.double() @ w_up.T)) @ w_down.T
    # bf16 operands and output over K = 1064 and 2985: a relative error of a few 2^-8.
    assert ((y.double() - expected).norm() / expected.norm()).item() < 2e-2


@pytest.mark.gpu
def test_a_module_built_on_a_gpu_starts_the_workers_before_its_first_forward(monkeypatch):
    import autofuse

    started = []
    monkeypatch.setattr(compile_workers, "start", started.append)
    monkeypatch.setenv("AUTOFUSE_CHECK", "1")
    autofuse.get_mlp(256, 520, activation="silu", dtype=torch.bfloat16, device="cuda")
    assert started and started[0][0] == "cuda"  # the module's GPU's Triton target
    linear = autofuse.get_linear(256, 520, dtype=torch.float32, device="cuda")
    started.clear()
    linear.half()
    assert started  # a move (.to(), .half()) starts them too
    started.clear()
    monkeypatch.setenv("AUTOFUSE_CHECK", "0")  # no first-use checks: nothing to compile ahead
    autofuse.get_mlp(256, 520, activation="silu", dtype=torch.bfloat16, device="cuda")
    assert not started


def test_a_kernel_for_another_gpu_architecture_than_the_workers_is_left_to_the_caller():
    """In a process with two kinds of GPU the workers compile for one target: a kernel the JIT compiles for another
    is skipped while capturing but not requested (the caller compiles it, as without workers), since the worker's
    compile would land under another cache key."""
    fn, *_, spec = _kernel(512)

    def hook(device):
        info = types.SimpleNamespace(jit_function=fn)
        return compile_workers._hook(key="k", repr="r", fn=info,
                                     compile={"specialization_data": spec, "device": device},
                                     is_manual_warmup=False, already_compiled=False)

    kept = fn.device_caches
    fn.device_caches = {0: (None, None, GPUTarget("cuda", 80, 32), None, None),
                        1: (None, None, GPUTarget(*TARGET), None, None)}
    try:
        with compile_workers._capturing(TARGET) as requests:
            assert hook(0) is True and requests == []  # an sm_80 kernel: not the workers' sm_90
            assert hook(1) is True and len(requests) == 1  # the workers' own target
            assert hook(2) is True and len(requests) == 2  # a target the JIT does not say: requested as before
        with compile_workers._capturing() as requests:
            assert hook(0) is True and len(requests) == 1  # capturing for any target
    finally:
        fn.device_caches = kept
