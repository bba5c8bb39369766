"""The command line: the demo job, show-kernel, and one-line errors for user mistakes."""

import json
import os
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner

from autofuse.cli import main


def test_demo_checks_and_times_the_bundled_example():
    result = CliRunner().invoke(main, ["demo"])
    assert result.exit_code == 0, result.output
    assert "all checks passed (bfloat16)" in result.output
    rows = [line for line in result.output.splitlines() if line.startswith("tiny-")]
    assert len(rows) == 9 and all(" ok " in row for row in rows)


def test_demo_with_a_shapes_file(tmp_path):
    shapes = tmp_path / "s.json"
    shapes.write_text(json.dumps({"dtype": "float16", "tokens": [3],
                                  "linears": [{"in_features": 24, "out_features": 40, "activation": "relu"}]}))
    result = CliRunner().invoke(main, ["demo", "--shapes", str(shapes)])
    assert result.exit_code == 0, result.output
    assert "all checks passed (float16)" in result.output


def test_bad_shapes_file_is_one_line_not_a_traceback(tmp_path):
    shapes = tmp_path / "s.json"
    shapes.write_text(json.dumps({"mlps": [{"d_model": 8, "d_ff": -1}]}))
    result = CliRunner().invoke(main, ["demo", "--shapes", str(shapes)])
    assert result.exit_code == 2
    assert "s.json.mlps[0].d_ff: must be a positive integer up to 2147483647, got -1" in result.output
    assert "Traceback" not in result.output


def test_show_kernel_prints_source():
    result = CliRunner().invoke(main, ["show-kernel", "linear", "--activation", "gelu", "--bias", "--residual"])
    assert result.exit_code == 0, result.output
    assert "def autofuse_linear_gelu_bias_res(" in result.output
    bad = CliRunner().invoke(main, ["show-kernel", "gated_up", "--activation", "relu"])
    assert bad.exit_code == 2 and "unknown activation 'relu'" in bad.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter switch matters where there is no GPU")
def test_interpreter_switched_on_after_triton_import_is_explained():
    code = (
        "import os, torch, triton.language, autofuse\n"
        "os.environ['TRITON_INTERPRET'] = '1'\n"
        "try:\n"
        "    autofuse.get_linear(8, 8, device='cpu')(torch.randn(2, 8, dtype=torch.bfloat16))\n"
        "except autofuse.AutofuseError as e:\n"
        "    print('ERROR', e)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert "ERROR TRITON_INTERPRET is on now but was off when Triton was first imported" in out.stdout, out.stderr
