"""Inputs built to hurt: files that are not files, values that would flood or spoof the terminal,
sizes no device holds. Each ends in one short line (AutofuseError), never a hang or a traceback."""

import json
import os
import threading

import pytest
import torch
from click.testing import CliRunner

import autofuse
from autofuse.choose import lookup as resolve
from autofuse.cli import main
from autofuse.configfile import _checksum, build_document
from autofuse.configs import KernelConfig
from autofuse.errors import AutofuseError
from autofuse.jsonfile import read_json
from autofuse.key import Problem, current_environment
from autofuse.shapes import parse_shapes
from autofuse.store import Winner

GOOD_MLP = {"d_model": 64, "d_ff": 128}


def _winner():
    key = Problem("linear", 56, 40, 4, torch.float32, "gelu", True).key(4, current_environment(torch.device("cpu")))
    return Winner(key, KernelConfig(16, 16, 16, group_m=1, num_stages=1), 1.0, 2.0)


def test_a_fifo_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "pretuned.json"
    os.mkfifo(fifo)
    result = {}
    def read():
        result["error"] = _error_of(lambda: read_json(fifo, only_regular=True))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout=10)
    assert not reader.is_alive(), "reading a FIFO blocked"
    assert "not a regular file" in result["error"]


def test_devices_that_never_end_are_refused():
    for device in ("/dev/zero", "/dev/urandom"):
        assert "not a regular file" in _error_of(lambda: read_json(device, only_regular=True))
        assert "too large" in _error_of(read_json, device)  # named by the user: read no further than the limit


def test_a_fifo_on_autofuse_cache_path_does_not_hang_a_forward(tmp_path, monkeypatch):
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    monkeypatch.setenv("AUTOFUSE_CACHE_PATH", str(fifo))
    resolve.invalidate()
    done = {}

    def forward():
        lin = autofuse.get_linear(16, 8, dtype=torch.float32, device="cpu")
        with torch.no_grad():
            done["y"] = lin(torch.randn(2, 16))

    worker = threading.Thread(target=forward, daemon=True)
    worker.start()
    worker.join(timeout=60)
    assert not worker.is_alive() and done["y"].shape == (2, 8)


def _error_of(fn, *args) -> str:
    with pytest.raises(AutofuseError) as e:
        fn(*args)
    return str(e.value)


@pytest.mark.parametrize("dtype", [["float32"], {}, 1, None])
def test_a_dtype_of_the_wrong_type_is_one_line(dtype):
    message = _error_of(parse_shapes, {"dtype": dtype, "mlps": [GOOD_MLP]})
    assert message.startswith("shapes.dtype: must be one of float32, float16, bfloat16")


def test_a_huge_token_list_is_refused_and_not_echoed():
    message = _error_of(parse_shapes, {"tokens": list(range(1, 1_000_001)), "mlps": [GOOD_MLP]})
    assert "1 to 64 positive integers, got 1000000" in message and len(message) < 200


@pytest.mark.parametrize("field, value", [
    ("activation", "x" * 1_000_000), ("d_ff", "9" * 100_000), ("bias", ["y"] * 100_000), ("name", "n" * 10_000),
])
def test_messages_never_echo_a_whole_huge_value(field, value):
    message = _error_of(parse_shapes, {"mlps": [dict(GOOD_MLP, **{field: value})]})
    assert len(message) < 300 and "mlps[0]" in message


def test_many_unknown_fields_are_named_briefly():
    message = _error_of(parse_shapes, {f"field{i}" * 100: 1 for i in range(1000)})
    assert len(message) < 300 and "and 995 more" in message


def test_a_model_config_given_as_shapes_points_at_model():
    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": 2048, "intermediate_size": 8192,
              "hidden_act": "silu", "model_type": "llama"}
    message = _error_of(parse_shapes, config)
    assert "pass it with --model instead of --shapes" in message and len(message) < 250


def test_a_name_with_a_newline_is_refused():
    message = _error_of(parse_shapes, {"mlps": [dict(GOOD_MLP, name="ok\n[1/1] spoofed line")]})
    assert "printable characters" in message and "\n" not in message


@pytest.mark.parametrize("size", [10**30, 2**31])
def test_sizes_beyond_the_kernels_are_one_line(size):
    assert "up to 2147483647" in _error_of(autofuse.get_mlp, 32, size)


def test_sizes_no_memory_holds_are_one_line():
    message = _error_of(lambda: autofuse.get_mlp(2**20, 2**20, dtype=torch.float32, device="cpu"))
    assert message.startswith("cannot allocate the MLP's") and "GiB of parameters on cpu" in message
    message = _error_of(lambda: autofuse.get_linear(2**21, 2**20, dtype=torch.float32, device="cpu"))
    assert message.startswith("cannot allocate the Linear's")


def _export(tmp_path, edit):
    document = build_document([_winner()])
    edit(document)
    document["sha256"] = _checksum(document["records"])
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(document))
    return path


@pytest.mark.parametrize("version", [True, 1.0, "1"])
def test_a_schema_version_that_only_equals_one_is_refused(tmp_path, version):
    path = _export(tmp_path, lambda d: d.update(schema_version=version))
    result = CliRunner().invoke(main, ["cache", "import", str(path)])
    assert result.exit_code == 2 and "schema version" in result.output


def test_a_gpu_name_with_a_newline_cannot_spoof_lines(tmp_path):
    def edit(document):
        spoof = "NVIDIA H100\nabcdef0123  linear    N=1 spoofed"
        document["gpus"] = [spoof]
        document["records"][0]["key"]["gpu"] = spoof

    result = CliRunner().invoke(main, ["cache", "import", str(_export(tmp_path, edit))])
    assert result.exit_code == 2 and "printable" in result.output
    assert len(result.output.strip().splitlines()) == 1
