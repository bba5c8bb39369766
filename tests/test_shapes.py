"""The shapes file: parsed when right, refused with the field's path when wrong."""

import json

import pytest
import torch

from autofuse import AutofuseError
from autofuse.shapes import example_shapes_path, load_shapes, parse_shapes


def test_bundled_example_parses():
    shapes = load_shapes(example_shapes_path())
    assert shapes.dtype == torch.bfloat16 and shapes.tokens == (1, 7, 37)
    assert [m.name for m in shapes.mlps] == ["tiny-geglu", "tiny-swiglu"]
    assert shapes.linears[0].activation == "gelu" and shapes.linears[0].bias is True


def test_defaults_and_aliases():
    shapes = parse_shapes({"mlps": [{"d_model": 8, "d_ff": 16, "activation": "gelu_pytorch_tanh"}]})
    assert shapes.mlps[0].activation == "gelu_tanh" and shapes.mlps[0].bias is False
    assert shapes.tokens == (1, 16, 128, 1024, 4096, 16384)


@pytest.mark.parametrize(
    "data, message",
    [
        ([], "must be a JSON object"),
        ({}, "lists no 'mlps' and no 'linears'"),
        ({"mlp": []}, "unknown field"),
        ({"dtype": "fp8", "mlps": [{"d_model": 8, "d_ff": 8}]}, r"shapes\.dtype: must be one of"),
        ({"tokens": [1, 0], "mlps": [{"d_model": 8, "d_ff": 8}]}, r"shapes\.tokens\[1\]: must be a positive integer"),
        ({"tokens": "16", "mlps": [{"d_model": 8, "d_ff": 8}]}, r"shapes\.tokens: must be a list of 1 to 64"),
        ({"mlps": [{"d_model": 8}]}, r"shapes\.mlps\[0\]: missing field 'd_ff'"),
        ({"mlps": [{"d_model": 8, "d_ff": "x"}]},
         r"shapes\.mlps\[0\]\.d_ff: must be a positive integer up to 2147483647, got 'x'"),
        ({"mlps": [{"d_model": 8, "d_ff": 8, "activation": "relu"}]}, r"mlps\[0\]\.activation: unknown activation"),
        ({"linears": [{"in_features": 8, "out_features": 8, "bias": "yes"}]}, r"linears\[0\]\.bias: must be true or"),
        ({"linears": [{"in_features": 8, "out_features": 8, "act": "gelu"}]}, r"linears\[0\]: unknown field\(s\) 'act"),
        ({"linears": {"in_features": 8}}, r"shapes\.linears: must be a list"),
    ],
)
def test_bad_files_name_the_field(data, message):
    with pytest.raises(AutofuseError, match=message):
        parse_shapes(data)


def test_unreadable_and_invalid_json(tmp_path):
    with pytest.raises(AutofuseError, match="cannot read shapes file"):
        load_shapes(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"mlps": [')
    with pytest.raises(AutofuseError, match=r"bad\.json: not valid JSON, truncated or damaged \(line 1"):
        load_shapes(bad)
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"linears": [{"in_features": 4, "out_features": 4}]}))
    assert load_shapes(good).linears[0].in_features == 4
