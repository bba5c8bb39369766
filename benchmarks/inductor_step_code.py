"""torch.compile's generated code for a gated MLP's training step (forward + backward), to read what
Inductor's pointwise kernels do that autofuse's passes do not. Run with TORCH_LOGS=output_code; the
code goes to stderr.

  TORCH_LOGS=output_code python benchmarks/inductor_step_code.py 2> DIR/inductor_code.txt
"""

from __future__ import annotations

import torch
import train_bench

for name, d, f, activation, M in train_bench.SHAPES[2:3] + train_bench.SHAPES[0:1]:
    torch._dynamo.reset()
    x = torch.randn(M, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    params = [(torch.randn(f, d, device="cuda", dtype=torch.bfloat16) / d**0.5).requires_grad_(),
              (torch.randn(f, d, device="cuda", dtype=torch.bfloat16) / d**0.5).requires_grad_(),
              (torch.randn(d, f, device="cuda", dtype=torch.bfloat16) / f**0.5).requires_grad_()]
    step = torch.compile(lambda x, wg, wu, wd, a=activation: train_bench._eager(x, wg, wu, wd, a))
    step(x, *params).backward(torch.randn(M, d, device="cuda", dtype=torch.bfloat16))
    torch.cuda.synchronize()
    print(name, M, "done", flush=True)
