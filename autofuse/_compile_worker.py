"""A compile worker (compile_workers.py starts it as a script, by path): compiles Triton kernels into Triton's
cache for the process that started it, which then finds them there. Imports the standard library and Triton
only (not torch, not autofuse: a worker is ready within a second, 0.6-0.8 s with its warm-up compile on a CPU
host, and holds no CUDA context).

Protocol, one JSON object a line: on stdin requests {"source": the kernel module's text, "filename": the name it
was compiled under, "name": the JIT function's name, "spec": Triton's serialized specialization (the JIT's
jit_cache_hook data), "cache_dir": Triton's cache folder}; on stdout first {"ready": true} (after one warm-up
compile, which pays Triton's one-time set-up), then one reply a request: {"ok": true} or {"ok": false, "error":
"..."}. Ends at the end of stdin, or after argv[4] seconds without a request (the parent starts workers again
when it next needs them).
"""

import os
import sys

# Run by path, Python puts this file's folder (the autofuse package) on sys.path, where its modules would shadow
# others of the same name; the worker needs none of them.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [path for path in sys.path if os.path.abspath(path or os.curdir) != _HERE]

import json  # noqa: E402
import linecache  # noqa: E402
import select  # noqa: E402
import types  # noqa: E402

_WARM_UP = '''
import triton
import triton.language as tl


@triton.jit
def warm_up(x, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x + offsets, tl.load(x + offsets, mask=offsets < n) * 2, mask=offsets < n)
'''

_functions: dict[tuple[str, str, str], object] = {}


def _function(source: str, filename: str, name: str):
    """The JIT function `name` of `source`, executed once under `filename` (registered in linecache, where
    Triton's inspect reads a kernel's text back), as the parent compiled it."""
    key = (filename, name, source)
    if key not in _functions:
        linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
        module = types.ModuleType(f"_autofuse_worker_{len(_functions)}")
        module.__file__ = filename
        sys.modules[module.__name__] = module
        exec(compile(source, filename, "exec"), module.__dict__)  # noqa: S102 - the parent's rendered source
        _functions[key] = getattr(module, name)
    return _functions[key]


def _lists_to_tuples(value):
    return tuple(_lists_to_tuples(v) for v in value) if isinstance(value, list) else value


def compile_one(request: dict, target) -> None:
    """Compile the request's kernel as the parent's JIT would (the arguments of triton.JITFunction.preload)."""
    import triton
    import triton.language as tl
    from triton.compiler import ASTSource

    fn = _function(request["source"], request["filename"], request["name"])
    spec = json.loads(request["spec"])
    constexprs = {tuple(key): tl.dtype(value) if isinstance(value, str) and tl.dtype.is_dtype(value) else
                  tl.constexpr(_lists_to_tuples(value["constexpr"])) if isinstance(value, dict) and "constexpr" in value
                  else _lists_to_tuples(value) for key, value in zip(spec["constant_keys"], spec["constant_vals"])}
    attrs = dict(zip(map(tuple, spec["attrs_keys"]), spec["attrs_vals"]))
    signature = {key: _lists_to_tuples(value) for key, value in spec["signature"].items()}
    options = {key: tuple(value) if isinstance(value, list) else value for key, value in spec["options"].items()}
    triton.knobs.cache.dir = request["cache_dir"]
    triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options)


def _replies():
    """The stream replies go to: the process's stdout as it started; whatever else writes to stdout from here on
    (a print in Triton or in a kernel's module, C code writing to fd 1) goes to stderr instead, so that no stray
    line can be read as a reply."""
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return replies


def _requests(idle_s: float):
    """stdin's lines, until its end or until idle_s seconds pass without one."""
    fd = sys.stdin.fileno()
    pending = b""
    while True:
        while b"\n" not in pending:
            if not select.select([fd], [], [], idle_s)[0]:
                return
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return
            pending += chunk
        line, pending = pending.split(b"\n", 1)
        yield line


def main() -> None:
    replies = _replies()
    backend, arch, warp_size = sys.argv[1], sys.argv[2], int(sys.argv[3])
    idle_s = float(sys.argv[4])
    arch = int(arch) if arch.isdigit() else arch  # 90 for CUDA, a name such as gfx942 for ROCm
    from triton.backends.compiler import GPUTarget

    target = GPUTarget(backend, arch, warp_size)
    warm_up = {"source": _WARM_UP, "filename": "<autofuse compile worker warm-up>", "name": "warm_up"}
    try:
        import triton
        from triton.runtime.jit import serialize_specialization_data  # noqa: F401 - the format compile_one reads

        spec = json.dumps({"signature": {"x": "*fp32", "n": "i32", "BLOCK": "constexpr"}, "constant_keys": [[2]],
                           "constant_vals": [128], "attrs_keys": [], "attrs_vals": [], "options": {}})
        compile_one({**warm_up, "spec": spec, "cache_dir": triton.knobs.cache.dir}, target)
    except Exception as e:  # noqa: BLE001 - reported to the parent, which then compiles on its own
        print(json.dumps({"ready": False, "error": f"{type(e).__name__}: {e}"[:500]}), file=replies, flush=True)
        return
    print(json.dumps({"ready": True}), file=replies, flush=True)
    for line in _requests(idle_s):
        try:
            compile_one(json.loads(line), target)
            reply = {"ok": True}
        except Exception as e:  # noqa: BLE001 - one kernel's failure is the parent's to report, not the worker's end
            reply = {"ok": False, "error": f"{type(e).__name__}: {e}"[:500]}
        print(json.dumps(reply), file=replies, flush=True)


if __name__ == "__main__":
    main()
