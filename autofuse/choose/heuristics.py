"""The built-in heuristic: the config a problem runs where nothing was tuned (and a first-use check then
compares with the library paths). The tuner starts its search from it too."""

from __future__ import annotations

from ..configs import Device, KernelConfig
from ..device import cuda_index, interpreting, multiprocessor_count, shared_memory_limit, tma_usable
from ..key import Problem


def heuristic_for(problem: Problem) -> KernelConfig:
    """The op's default config for the problem's shape, on its device (the interpreter's where it runs)."""
    spec, M, N, K, dtype, device = problem.spec, problem.M, problem.n, problem.k, problem.dtype, problem.device
    if interpreting() or device.type != "cuda":
        return spec.default_config(M, N, K, dtype, Device(interpret=True))
    index = cuda_index(device)
    return spec.default_config(M, N, K, dtype, Device(False, shared_memory_limit(index), multiprocessor_count(index),
                                                      tma_usable(device, K, dtype)))
