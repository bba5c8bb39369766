"""benchmarks/training.py's --only: the points it names, every M of a bare name, and a clear error for a point it
does not know."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
training_suite = pytest.importorskip("training")


def test_only_keeps_the_named_points():
    shapes = training_suite.held_out(36, 6, [2048, 8192])
    assert training_suite.only(shapes, None) == shapes
    picked = training_suite.only(shapes, "drawn-3@8192, drawn-2")
    assert [(s[0], s[4]) for s in picked] == [("drawn-2", 2048), ("drawn-2", 8192), ("drawn-3", 8192)]
    assert picked[-1][1:4] == (3587, 8063, "gelu_tanh")  # the drawn shape itself, as the full run draws it
    with pytest.raises(ValueError, match="drawn-9"):
        training_suite.only(shapes, "drawn-3,drawn-9")
