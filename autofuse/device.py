"""What autofuse needs to know about where kernels run: interpreter or GPU, and the GPU's limits."""

from __future__ import annotations

import os
from functools import cache

import torch

from .errors import AutofuseError

# Shared memory to assume when the device cannot be asked (the smallest opt-in limit among
# GPUs with tensor cores that Triton supports, consumer Ampere/Ada: 99 KiB).
_DEFAULT_SHARED_MEMORY = 99 * 1024


def interpreting() -> bool:
    """True when Triton runs kernels on the CPU under its interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_device(device: torch.device) -> None:
    """Raise AutofuseError unless autofuse kernels can run on `device` in this process."""
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise AutofuseError(
                "device 'cuda' asked for but no CUDA GPU is visible; on a machine without one, set "
                "TRITON_INTERPRET=1 and pass device='cpu' to run under Triton's interpreter"
            )
    elif device.type == "cpu":
        if not interpreting():
            raise AutofuseError(
                "autofuse kernels run on NVIDIA GPUs; CPU tensors work only under Triton's interpreter "
                "(set TRITON_INTERPRET=1 before building the module)"
            )
    else:
        raise AutofuseError(f"autofuse runs on 'cuda' (or 'cpu' under the interpreter), not on {device.type!r}")


def check_interpreter_consistency() -> None:
    """Raise AutofuseError if TRITON_INTERPRET changed after triton.language was imported.

    Triton decides at import time whether its own library functions (tl.cdiv, ...) are compiled or
    interpreted; kernels generated later under the other mode fail deep inside Triton.
    """
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    imported_interpreted = isinstance(tl.cdiv, InterpretedFunction)
    if imported_interpreted != interpreting():
        now, then = ("on", "off") if interpreting() else ("off", "on")
        raise AutofuseError(
            f"TRITON_INTERPRET is {now} now but was {then} when Triton was first imported; set it before "
            "anything imports triton (e.g. at the top of the program or in the environment)"
        )


def cuda_index(device: torch.device) -> int:
    """The index of a CUDA device; `cuda` without one means the current device, as in PyTorch."""
    return device.index if device.index is not None else torch.cuda.current_device()


@cache
def _device_properties(device_index: int) -> dict:
    try:
        import triton

        return dict(triton.runtime.driver.active.utils.get_device_properties(device_index))
    except Exception:  # no driver (interpreter, CPU): callers use their defaults
        return {}


def shared_memory_limit(device_index: int) -> int:
    """Bytes of shared memory one program may use on this GPU, read from the device."""
    return int(_device_properties(device_index).get("max_shared_mem", _DEFAULT_SHARED_MEMORY))


def multiprocessor_count(device_index: int) -> int:
    """Streaming multiprocessors on this GPU (108 assumed, an A100's, when it cannot be read)."""
    return int(_device_properties(device_index).get("multiprocessor_count", 108))


# Under the interpreter the persistent kernels run with this many programs, so that each walks
# several tiles and the tile loop is exercised.
INTERPRETER_PROGRAMS = 3


@cache
def supports_tma(device: torch.device) -> bool:
    """Whether TMA tensor descriptors work here: Hopper (sm_90) and newer, or the interpreter."""
    if device.type != "cuda":
        return interpreting()
    return torch.cuda.get_device_capability(device) >= (9, 0)


@cache
def dependent_launches(device: torch.device) -> bool:
    """Whether kernels on `device` may overlap through Programmatic Dependent Launch (a kernel's programs start
    while the one before it in the stream drains, and wait for its results inside): Hopper (sm_90) and newer, not
    under the interpreter (whose kernels cannot hold the PTX it takes)."""
    return device.type == "cuda" and not interpreting() and torch.cuda.get_device_capability(device) >= (9, 0)


def persistent_programs(device: torch.device) -> int:
    """Programs of a persistent kernel: one per SM."""
    return multiprocessor_count(cuda_index(device)) if device.type == "cuda" else INTERPRETER_PROGRAMS


def fp32_input_precision() -> str:
    """Follow PyTorch's own switch for float32 matmuls: tf32 only when the user allowed it."""
    return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee"


def capturing(device: torch.device) -> bool:
    """Whether the current stream of `device` is capturing a CUDA graph (nothing may allocate or copy
    outside the graph's pool then)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()
