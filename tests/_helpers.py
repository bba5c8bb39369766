"""Comparison helpers shared by the kernel tests, a JSON file writer for the CLI tests, and a fake stream mark for
the un-graphed race's tests."""

import json
from pathlib import Path

import torch

from autofuse.configs import KernelConfig
from autofuse.reference import eager_mlp, mlp_reference_rounded

DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# Elementwise tolerances (rtol, atol) against a float64 reference computed from the same rounded
# inputs. The kernels accumulate in float32 and round once when they store, so the error is about
# one unit roundoff u of the output dtype (2**-24, 2**-11, 2**-8); we allow 2u relative, because an
# MLP's hidden H may round to the other side of a boundary than the reference's H, plus an absolute
# floor for outputs near zero, sized like that relative term at the outputs' typical size (~1).
TOLERANCES = {
    # On a GPU float32 dots are IEEE here (PyTorch's default disallows tf32); K <= ~200 in CPU tests.
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.float16: dict(rtol=2 * 2**-11, atol=2e-3),
    torch.bfloat16: dict(rtol=2 * 2**-8, atol=1.6e-2),
}


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; NaN anywhere gives inf so it can never pass."""
    out = out.double()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).norm() / ref.norm()).item()


def assert_matches_reference(out: torch.Tensor, ref: torch.Tensor, peer: torch.Tensor, tolerances=None,
                             floor: float = 1e-6) -> None:
    """Check `out` elementwise against the float64 `ref`, and check that its overall error is no
    worse than PyTorch's own in the same dtype (`peer`) by more than 25%.

    The second check is the sharp one for 16-bit types: a kernel that truncates instead of
    rounding stays inside the elementwise band but has about twice PyTorch's error.
    """
    assert out.shape == ref.shape, f"shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
    assert out.dtype == peer.dtype, f"dtype {out.dtype} != {peer.dtype}"
    torch.testing.assert_close(out.double(), ref, **(tolerances or TOLERANCES[out.dtype]))
    err, peer_err = relative_error(out, ref), relative_error(peer, ref)
    # The floor covers float32, where both errors are ~1e-7 at small K and their ratio is noise.
    assert err <= 1.25 * peer_err + floor, f"error {err:.3g} vs PyTorch's {peer_err:.3g} in {out.dtype}"


def mlp_weights(m) -> tuple:
    """(wg, wu, wd, bg, bu, bd) of a FusedMLP, in the reference functions' order."""
    g, u, d = m.gate_proj, m.up_proj, m.down_proj
    return (g.weight, u.weight, d.weight, g.bias, u.bias, d.bias)


def check_mlp(module, x: torch.Tensor) -> None:
    """A FusedMLP's forward on x against the float64 reference and eager PyTorch's error."""
    with torch.no_grad():
        out = module(x)
        ref = mlp_reference_rounded(x, mlp_weights(module), module.activation, x.dtype)
        assert_matches_reference(out, ref, eager_mlp(x, *mlp_weights(module), activation=module.activation))


# Configs every kernel test runs with explicitly: tiny and large tiles, every GROUP_M style, ragged
# and even K loops (with K=48 and K=64), so any config the tuner may pick is proven correct.
BLOCK_CONFIGS = [
    KernelConfig(16, 16, 16, group_m=1, num_warps=1, num_stages=1),
    KernelConfig(32, 16, 32, group_m=2, num_warps=2, num_stages=2),
    KernelConfig(16, 32, 64, group_m=4, num_warps=4, num_stages=3),
    KernelConfig(64, 64, 16, group_m=8, num_warps=8, num_stages=4),
    # Split-K: 3 slices over K=48 blocks of 16 (one slice per block); 2 slices over ragged K (one
    # program's slice may be shorter or, for small K, empty).
    KernelConfig(16, 32, 16, group_m=1, num_warps=4, num_stages=2, variant="split_k", knobs={"split_k": 3}),
    KernelConfig(32, 16, 32, group_m=4, num_warps=2, num_stages=2, variant="split_k", knobs={"split_k": 2}),
    # Persistent TMA kernels: under the interpreter 3 programs walk every tile, so each runs several;
    # ragged K and the M/N edges rely on the descriptors' zero fill.
    KernelConfig(16, 32, 16, group_m=2, num_warps=4, num_stages=3, variant="tma"),
    KernelConfig(32, 16, 32, group_m=8, num_warps=8, num_stages=4, variant="tma"),
]


def write_json(path: Path, data) -> Path:
    """`data` as JSON at `path` (a shapes file, a model config); returns the path."""
    path.write_text(json.dumps(data))
    return path


class FakeMark:
    """A mark on a fake stream (what choose/race.py's _mark gives: query, synchronize, elapsed_time in ms): the GPU
    reaches it at `at` on the fake clock `clock` (clock[0]: the host's now; `ms`: milliseconds a unit of the clock)."""

    def __init__(self, at, clock, ms):
        self.at, self.clock, self.ms = at, clock, ms

    def query(self):
        return self.clock[0] >= self.at

    def synchronize(self):
        self.clock[0] = max(self.clock[0], self.at)

    def elapsed_time(self, other):
        return (other.at - self.at) * self.ms
