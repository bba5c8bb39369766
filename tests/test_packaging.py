"""A wheel built from the repository works when installed elsewhere: templates and cache/ travel with it."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def test_wheel_installed_elsewhere_renders_and_runs(tmp_path):
    pytest.importorskip("hatchling", reason="building the wheel offline needs hatchling (in the [test] extra)")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path / "dist"),
         str(REPO)],
        check=True, timeout=300,
    )
    (wheel,) = (tmp_path / "dist").glob("autofuse-*.whl")
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
                   check=True, timeout=300)
    code = (
        "import torch, autofuse\n"
        "from autofuse.resources import templates_dir, shipped_cache_dir\n"
        "from autofuse.reference import mlp_reference_rounded\n"
        "print('FILE', autofuse.__file__)\n"
        "print('TEMPLATES', templates_dir())\n"
        "print('CACHE', shipped_cache_dir())\n"
        "assert 'def autofuse_gated_up_gelu_tanh(' in autofuse.show_kernel('gated_up')\n"
        "m = autofuse.get_mlp(32, 48, dtype=torch.bfloat16, device='cpu')\n"
        "x = torch.randn(5, 32, dtype=torch.bfloat16)\n"
        "with torch.no_grad(): y = m(x)\n"
        "g, u, d = m.gate_proj.weight, m.up_proj.weight, m.down_proj.weight\n"
        "ref = mlp_reference_rounded(x, (g, u, d), 'gelu_tanh', torch.bfloat16)\n"
        "print('ERR', ((y.double() - ref).norm() / ref.norm()).item())\n"
    )
    env = dict(os.environ, PYTHONPATH=str(site), TRITON_INTERPRET="1", AUTOFUSE_CACHE_DIR=str(tmp_path / "c"))
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines())
    assert lines["FILE"].startswith(str(site)), "the installed wheel, not the checkout, must be imported"
    assert lines["TEMPLATES"] == str(site / "autofuse" / "templates")
    assert lines["CACHE"] == str(site / "autofuse" / "cache")
    assert float(lines["ERR"]) < 4 * 2**-8  # a few bf16 roundoffs: see tests/_helpers.py
