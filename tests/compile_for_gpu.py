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

from autofuse import ops  # noqa: E402
from autofuse.render import KernelSpec, load_kernel  # noqa: E402

_TRITON_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
# The operands of an op with fp8 weights that are not in the activations' dtype: the weights and their scales.
_FP8_WEIGHTS = {"w": "*fp8e4nv", "wg": "*fp8e4nv", "wu": "*fp8e4nv", "s": "*fp32", "sg": "*fp32", "su": "*fp32"}


def _constexprs(spec: KernelSpec, block: tuple[int, int, int], split_k: int) -> dict:
    """The constexpr values a launcher passes for these tiles (the one-launch MLP names them BLOCK_F, BLOCK_D)."""
    values = dict(BLOCK_M=block[0], BLOCK_N=block[1], BLOCK_K=block[2], GROUP_M=8, BLOCK_F=block[1],
                  BLOCK_D=block[2], SPLIT_K=split_k, NUM_SMS=132, FLATTEN=True, EPILOGUE_N=min(block[1], 64),
                  BLOCK_H=block[1] // 2)
    return {name: values[name] for name in spec.constexprs}


def compile_variant(spec: KernelSpec, dtype: str, capability: int, block: tuple[int, int, int], split_k: int,
                    num_warps: int, num_stages: int) -> dict:
    kernel = load_kernel(spec)
    constexprs = _constexprs(spec, block, split_k)
    signature = {name: "constexpr" for name in constexprs}
    for p in kernel.parameters:  # the launchers' own parameter list: what they pass, in order
        if p.kind == "descriptor":
            rows, cols = (constexprs[b] for b in p.block)
            signature[p.name] = f"tensordesc<{_TRITON_DTYPES[dtype]}[{rows}, {cols}]>"
        elif p.name == "ws_ptr":
            signature[p.name] = "*fp32"
        elif p.name == "count_ptr":
            signature[p.name] = "*i32"
        elif p.kind == "tensor" and spec.op.weights != "dense" and p.operand in _FP8_WEIGHTS:
            signature[p.name] = _FP8_WEIGHTS[p.operand]  # fp8 weights and their float32 scales
        elif p.kind == "tensor":
            signature[p.name] = "*" + _TRITON_DTYPES[dtype]
        else:
            signature[p.name] = "i32"
    source = triton.compiler.ASTSource(fn=kernel.fn, signature=signature, constexprs=constexprs)
    compiled = triton.compile(source, target=GPUTarget("cuda", capability, 32),
                              options=dict(num_warps=num_warps, num_stages=num_stages))
    ptx = compiled.asm["ptx"]
    return dict(kernel=spec.kernel_name, dtype=dtype, capability=capability, block=list(block),
                shared=compiled.metadata.shared, wgmma="wgmma" in ptx, mma="mma.sync" in ptx,
                fp8_mma=".e4m3.e4m3" in ptx,
                tma_loads="cp.async.bulk.tensor" in ptx, grid_wait="griddepcontrol.wait" in ptx,
                grid_launch="griddepcontrol.launch_dependents" in ptx,
                cubin_bytes=len(compiled.asm["cubin"]))


def main(cases: list[dict]) -> None:
    for case in cases:
        fields = case.pop("spec")
        spec = KernelSpec(op=ops.get(fields.pop("op")), **fields)
        print(json.dumps(compile_variant(spec, **case)), flush=True)


if __name__ == "__main__":
    main(json.loads(sys.stdin.read()))
