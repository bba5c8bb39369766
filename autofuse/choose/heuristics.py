"""The built-in heuristic: the config a problem runs where nothing was tuned (and a first-use check then
compares with the library paths). The tuner starts its search from it too."""

from __future__ import annotations

from functools import cache

import torch

from .. import variants
from ..configs import Device, KernelConfig, Shape, clamp_to_problem
from ..device import cuda_index, interpreting, multiprocessor_count, shared_memory_limit
from ..key import Problem


def device_info(device: torch.device) -> Device:
    """What the heuristics and the variants' predicates know of `device` (the interpreter's where it runs)."""
    if interpreting() or device.type != "cuda":
        return Device(interpret=True)
    return _gpu(cuda_index(device))


@cache
def _gpu(index: int) -> Device:
    return Device(False, shared_memory_limit(index), multiprocessor_count(index),
                  tuple(torch.cuda.get_device_capability(index)))


def _shape(problem: Problem) -> Shape:
    return Shape(problem.M, problem.n, problem.k, problem.dtype)


def heuristic_for(problem: Problem) -> KernelConfig:
    """The op's default config for the problem's shape, on its device."""
    return problem.spec.default_config(_shape(problem), device_info(problem.device))


def search_starts_for(problem: Problem) -> tuple[KernelConfig, ...]:
    """Configs a tuning run times right after the heuristic's (OpSpec.search_starts)."""
    return problem.spec.search_starts(_shape(problem), device_info(problem.device))


def alternatives_for(problem: Problem) -> tuple[KernelConfig, ...]:
    """Configs a first-use check times beside the heuristic's for the problem (OpSpec.alternative_configs)."""
    return problem.spec.alternative_configs(_shape(problem), device_info(problem.device))


def fitted(config: KernelConfig, problem: Problem) -> KernelConfig | None:
    """A config recorded for another key (a nearest neighbour's) clamped to `problem`'s sizes, or None where its
    variant does not apply at this M or the config does not fit the shape. A GEMV config of M = 1 offered at M = 2
    would run one program row per token and stream the weights once per row: the fp8 6480 -> 27640 MLP took 420
    us so at M = 2, against 294 at M = 4 on tiles (H100)."""
    shape = _shape(problem)
    variant = variants.get(config.variant)
    if not variant.applies(device_info(problem.device), shape):
        return None
    config = clamp_to_problem(config, problem.M, problem.n, problem.k)
    return config if variant.fits is None or variant.fits(config, shape) else None
