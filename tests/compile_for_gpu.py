"""Compile template variants for a GPU target on a machine without a GPU (run by test_compile.py).

Triton lowers to PTX and assembles with its bundled ptxas without touching a device, so every
variant's compiled path is checked in CI, not only its interpreted one. Prints one JSON line per
compile: what was compiled and facts read off its PTX.
"""

import json
import os
import sys

assert os.environ.get("TRITON_INTERPRET", "0") != "1", "run without the interpreter"

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

from autofuse.render import KernelSpec, load_kernel  # noqa: E402

_CONSTEXPRS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "SPLIT_K", "NUM_SMS", "FLATTEN", "BLOCK_F", "BLOCK_D",
               "EPILOGUE_N")
_TRITON_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def _desc_block(name: str, block: tuple[int, int, int]) -> tuple[int, int]:
    # Activations (X, dY): [BLOCK_M, BLOCK_K]; the down weight read as [K, N]: [BLOCK_K, BLOCK_N];
    # nn.Linear-layout weights [N, K]: [BLOCK_N, BLOCK_K].
    if name in ("x_desc", "dy_desc"):
        return block[0], block[2]
    if name in ("g_desc", "u_desc", "dg_desc", "du_desc", "h_desc"):  # the gated backward's epilogue pieces
        return block[0], min(block[1], 64)
    return (block[2], block[1]) if name == "wd_desc" else (block[1], block[2])


def compile_variant(spec: KernelSpec, dtype: str, capability: int, block: tuple[int, int, int], split_k: int,
                    num_warps: int, num_stages: int) -> dict:
    fn = load_kernel(spec)
    signature = {}
    for name in fn.arg_names:
        if name in _CONSTEXPRS:
            signature[name] = "constexpr"
        elif name.endswith("_desc"):  # TMA descriptor: its block shape, as launch.py builds it
            signature[name] = f"tensordesc<{_TRITON_DTYPES[dtype]}[{', '.join(map(str, _desc_block(name, block)))}]>"
        elif name == "ws_ptr":
            signature[name] = "*fp32"
        elif name == "count_ptr":
            signature[name] = "*i32"
        elif name.endswith("_ptr"):
            signature[name] = "*" + _TRITON_DTYPES[dtype]
        else:
            signature[name] = "i32"
    if spec.template == "mlp_decode":
        constexprs = dict(BLOCK_M=block[0], BLOCK_F=block[1], BLOCK_D=block[2])
    elif spec.template == "gated_act":
        constexprs = dict(BLOCK_M=block[0], BLOCK_N=block[1])
    else:
        constexprs = dict(BLOCK_M=block[0], BLOCK_N=block[1], BLOCK_K=block[2], GROUP_M=8)
    if spec.split_k:
        constexprs["SPLIT_K"] = split_k
    if spec.tma:
        constexprs.update(NUM_SMS=132, FLATTEN=True)
    if spec.tma and spec.template == "gated_bwd":
        constexprs["EPILOGUE_N"] = min(block[1], 64)
    source = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    compiled = triton.compile(source, target=GPUTarget("cuda", capability, 32),
                              options=dict(num_warps=num_warps, num_stages=num_stages))
    ptx = compiled.asm["ptx"]
    return dict(kernel=spec.kernel_name, dtype=dtype, capability=capability, block=list(block),
                shared=compiled.metadata.shared, wgmma="wgmma" in ptx, mma="mma.sync" in ptx,
                tma_loads="cp.async.bulk.tensor" in ptx,
                cubin_bytes=len(compiled.asm["cubin"]))


def main(cases: list[dict]) -> None:
    for case in cases:
        spec = KernelSpec(**case.pop("spec"))
        print(json.dumps(compile_variant(spec, **case)), flush=True)


if __name__ == "__main__":
    main(json.loads(sys.stdin.read()))
