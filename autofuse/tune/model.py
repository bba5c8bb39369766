"""`autofuse.tune_model(model)`: tune the MLP shapes of a model's fused blocks on its GPU, as
`autofuse tune --model` tunes a config's."""

from __future__ import annotations

from torch import nn

from ..hf import FusedHFMLP
from ..modules import FusedMLP, FusedMLPFp8
from ..shapes import DEFAULT_TOKENS, MLPShape, ShapeSet
from .driver import DEFAULT_TRIALS, tune_shapes


def tune_model(model: nn.Module, *, tokens: tuple[int, ...] | None = None, trials: int = DEFAULT_TRIALS) -> int:
    """Tune every distinct MLP shape among `model`'s fused blocks (after autofuse.fuse, or FusedMLP
    modules) at `tokens` (default: shapes.DEFAULT_TOKENS), `trials` per key, into the user cache; the
    blocks resolve again on their next forward. Returns the number of keys tuned."""
    fused = [m._fused if isinstance(m, FusedHFMLP) else m for m in model.modules()
             if isinstance(m, (FusedHFMLP, FusedMLP, FusedMLPFp8))]
    if not fused:
        return 0
    tuned = 0
    # Dense and fp8 blocks (fuse(model, weights="fp8" or "w8a8")) are tuned for their own ops, each format apart.
    formats = {"dense": [b for b in fused if isinstance(b, FusedMLP)]}
    for block in fused:
        if isinstance(block, FusedMLPFp8):
            formats.setdefault(block.weights, []).append(block)
    for weights, blocks in formats.items():
        if not blocks:
            continue
        mlps = {}
        for block in blocks:
            g = block.gate_proj
            shape = MLPShape(f"{g.in_features}x{g.out_features}", g.in_features, g.out_features, block.activation,
                             g.bias is not None)
            mlps.setdefault((shape.d_model, shape.d_ff, shape.activation, shape.bias), shape)
        like = blocks[0]._reference_weight()
        shapes = ShapeSet(like.dtype, tuple(tokens or DEFAULT_TOKENS), tuple(mlps.values()), (), weights)
        tuned += len(tune_shapes(shapes, like.device, trials=trials))
        for block in blocks:
            block.clear_config_table()
    return tuned
