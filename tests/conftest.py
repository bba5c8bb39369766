"""Test setup: the interpreter switch, seeds, a private cache folder, first-use checks off, and the gpu
marker.

Without a CUDA GPU the kernels run under Triton's interpreter, which must be switched on before
any kernel is generated; with one, the same tests run compiled on the GPU.
"""

import os
import zlib

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest


def pytest_xdist_auto_num_workers(config):
    # `-n auto` (README's test command): one worker per CPU core on a CPU, where the interpreter makes each test
    # CPU-bound; one alone where a GPU is visible, so that timed tests never share the card with another worker.
    return 1 if torch.cuda.is_available() else None


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    # Generated kernels and caches go to a per-test folder, never the user's.
    monkeypatch.setenv("AUTOFUSE_CACHE_DIR", str(tmp_path / "autofuse-cache"))


@pytest.fixture(autouse=True)
def _no_first_use_checks(monkeypatch):
    # First-use checks (autofuse/choose/check.py) verify and time each unchecked config once; under the
    # interpreter that would multiply the suite's time. tests/test_checked.py turns them on.
    monkeypatch.setenv("AUTOFUSE_CHECK", "0")


@pytest.fixture(autouse=True)
def _seed(request):
    # A fresh, reproducible draw per test: the seed depends on the test's id only (crc32, not hash(),
    # which Python salts per process, so that a failure comes back on the next run).
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture
def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"
