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
    for op in ("rms_norm", "quantize_rows", "gated_bwd"):  # no bias operand: refused, not silently left out
        bad = CliRunner().invoke(main, ["show-kernel", op, "--bias"])
        assert bad.exit_code == 2 and f"op '{op}' takes no bias" in bad.output and len(bad.output.splitlines()) == 1


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


def test_help_imports_no_torch_and_python_dash_m_autofuse_runs():
    code = ("import sys\nfrom autofuse.cli import main\n"
            "try:\n    main(['--help'], prog_name='autofuse')\nexcept SystemExit:\n    pass\n"
            "print('TORCH', 'torch' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "TORCH False" in done.stdout, done.stderr
    assert "show-kernel" in done.stdout and "tune" in done.stdout
    as_module = subprocess.run([sys.executable, "-m", "autofuse", "--version"], capture_output=True, text=True,
                               timeout=120)
    assert as_module.returncode == 0 and as_module.stdout.startswith("autofuse, version")


def test_the_help_list_says_what_each_command_says_of_itself():
    import click

    from autofuse.cli.common import COMMANDS

    ctx = click.Context(main)
    for name, (_, help_text) in COMMANDS.items():
        assert main.get_command(ctx, name).get_short_help_str(limit=300) == help_text, name
    assert main.get_command(ctx, "nonsense") is None


def test_an_unknown_op_is_one_line_with_the_closest_name():
    result = CliRunner().invoke(main, ["show-kernel", "gated_upp"])
    assert result.exit_code == 2
    (line,) = [line for line in result.output.splitlines() if line.startswith("Error")]
    assert "unknown op 'gated_upp' (did you mean gated_up?)" in line and line.count("gated_up,") == 1


@pytest.mark.parametrize("args", [["linear", "--tma"], ["linear", "--tma", "--residual", "--bias"], ["linear"],
                                  ["gated_up", "--tma"], ["gated_bwd", "--tma"]])
def test_generated_headers_keep_one_comment_per_line(args):
    import re

    result = CliRunner().invoke(main, ["show-kernel", *args])
    assert result.exit_code == 0, result.output
    assert not [line for line in result.output.splitlines() if re.search(r"[^\s#]# [A-Z]", line)]


def test_tune_shows_the_dtype_and_says_why_the_interpreter_stores_kernels(tmp_path):
    shapes = tmp_path / "s.json"
    shapes.write_text(json.dumps({"dtype": "float16", "tokens": [3],
                                  "linears": [{"in_features": 24, "out_features": 40}]}))
    result = CliRunner().invoke(main, ["tune", "--shapes", str(shapes), "--trials", "1"])
    assert result.exit_code == 0, result.output
    assert "tuning 1 key (float16)" in result.output
    assert "the fastest correct kernel is stored, not the library path" in result.output
    header = next(line for line in result.output.splitlines() if line.startswith("key "))
    assert header.split()[:5] == ["key", "dtype", "M", "winner", "ms"] and "library" in header
    row = next(line for line in result.output.splitlines() if line.startswith("linear0"))
    assert row.split()[2] == "float16"


def test_tune_model_on_the_interpreter_stops_at_m_128(tmp_path, monkeypatch):
    from autofuse.tune import driver

    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "llama", "hidden_size": 24, "intermediate_size": 40,
                                  "hidden_act": "silu"}))
    tuned = []
    monkeypatch.setattr(driver, "tune_key", lambda job, *a, **k: tuned.append(job.M) or (_ for _ in ()).throw(
        KeyboardInterrupt))
    result = CliRunner().invoke(main, ["tune", "--model", str(config), "--trials", "1"])
    assert "interpreter: tuning the model at M = 1, 16, 128" in result.output
    assert tuned and max(tuned) <= 128


def test_the_run_eta_weighs_the_keys_to_come():
    from autofuse.tune.progress import RunProgress

    run = RunProgress([1.0, 1.0, 8.0])
    run.total = 3
    run.finished(2.0, keys_after=2)  # the first key took 2 s for weight 1
    assert run.run_eta(1.0, keys_after=1) == pytest.approx(1.0 + 8 * 2.0)
    assert run.run_eta(1.0, keys_after=0) == 1.0
    assert RunProgress().run_eta(5.0, keys_after=1) is None  # nothing finished yet: unknown
