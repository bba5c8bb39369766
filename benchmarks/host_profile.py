"""Where the host time of one un-graphed forward goes (small model, M=1), on the device.

  python benchmarks/host_profile.py --out DIR

Times, per call (median of batches, launches queued, not awaited): eager's MLP, the module with the
two-kernel path, the module with the one-launch kernel, launch.mlp_decode alone, the bare Triton
launch with prepared arguments, and torch.empty; then a cProfile of the one-launch module forward.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

import autofuse
from autofuse import launch
from autofuse.configs import KernelConfig
from autofuse.reference import eager_mlp
from autofuse.resolve import Choice
from autofuse.timing import host_profile_text, host_us_per_call


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    d, f, M = 768, 2048, 1
    mlp = autofuse.get_mlp(d, f, activation="gelu_tanh", dtype=torch.bfloat16, device="cuda", tuned=False)
    x = torch.randn(M, d, device="cuda", dtype=torch.bfloat16)
    w = (mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)
    fused = KernelConfig(16, 32, 256, group_m=1, num_warps=4, num_stages=3)
    rows = {}
    with torch.inference_mode():
        rows["eager MLP"] = host_us_per_call(lambda: eager_mlp(x, *w, activation="gelu_tanh"), calls=2000)
        rows["module, two kernels (heuristic)"] = host_us_per_call(lambda: mlp(x), calls=2000)
        one = autofuse.get_mlp(d, f, activation="gelu_tanh", dtype=torch.bfloat16, device="cuda", tuned=False)
        one.load_state_dict(mlp.state_dict())
        one._config_table(M)  # build the entry, then point it at the one-launch kernel
        for key in list(one._configs):
            one._configs[key] = {"mlp": Choice(fused, "forced")}
        rows["module, one launch"] = host_us_per_call(lambda: one(x), calls=2000)
        rows["launch.mlp_decode"] = host_us_per_call(
            lambda: launch.mlp_decode(x, *w, None, None, None, "gelu_tanh", fused), calls=2000)
        y = torch.empty(M, d, device="cuda", dtype=torch.bfloat16)
        kernel = launch._kernel_for("mlp_decode", "gelu_tanh", d, x.dtype, fused, False)
        ws = launch._workspace(x.device, M * d, 1)
        kargs = [x, *w, y, M, d, f, x.stride(0), x.stride(1), w[0].stride(0), w[0].stride(1), w[1].stride(0),
                 w[1].stride(1), w[2].stride(0), w[2].stride(1), y.stride(0), y.stride(1), *ws]
        grid = (f // 32, 1)
        rows["bare Triton launch"] = host_us_per_call(
            lambda: kernel[grid](*kargs, BLOCK_M=16, BLOCK_F=32, BLOCK_D=256, num_warps=4, num_stages=3), calls=2000)
        rows["torch.empty"] = host_us_per_call(lambda: torch.empty(M, d, device="cuda", dtype=torch.bfloat16),
                                               calls=2000)
        rows["current_stream"] = host_us_per_call(lambda: torch.cuda.current_stream(x.device).cuda_stream, calls=2000)
        for name, us in rows.items():
            print(f"{name:36s} {us:7.1f} us", flush=True)
        profile = host_profile_text(lambda: one(x), calls=2000, top=30)
    print(profile[:6000])
    Path(args.out, "host_profile.json").write_text(json.dumps({"us_per_call": rows, "profile": profile}))


if __name__ == "__main__":
    main()
