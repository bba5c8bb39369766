"""Which kernel config to use for a problem: the runtime's single entry point for configs.

M varies at run time, so configs are chosen per M bucket (rule "pow2": the next power of two,
capped at 16384) and remembered by the module, never looked up on every forward.
"""

from __future__ import annotations

import torch

from .configs import KernelConfig, heuristic_config, next_power_of_2
from .device import interpreting, multiprocessor_count, shared_memory_limit

M_BUCKET_RULE = "pow2"
MAX_M_BUCKET = 16384


def m_bucket(M: int) -> int:
    return min(next_power_of_2(max(M, 1)), MAX_M_BUCKET)


def resolve_config(template: str, M: int, N: int, K: int, dtype: torch.dtype, device: torch.device) -> KernelConfig:
    """The config for `template` at M's bucket. Today: the built-in heuristic."""
    if interpreting() or device.type != "cuda":
        return heuristic_config(template, m_bucket(M), N, K, dtype, interpret=True, shared_memory_limit=0)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return heuristic_config(
        template, m_bucket(M), N, K, dtype, interpret=False,
        shared_memory_limit=shared_memory_limit(index), multiprocessors=multiprocessor_count(index),
    )
