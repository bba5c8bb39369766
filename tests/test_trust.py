"""Nothing from disk is trusted: cache rows that are not plain JSON, files named outside
the cache, kernel files swapped or planted on disk, records that validate but cannot run, and
JSON files that are not valid for reasons other than syntax."""

import json
import logging
import os
import pickle
import sqlite3
import zlib
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import autofuse
from autofuse.choose import lookup as resolve
from autofuse.cli import main
from autofuse.configs import KernelConfig
from autofuse.key import Problem, current_environment
from autofuse.resources import user_cache_dir
from autofuse.store import Store, Winner


class _Payload:
    """Unpickling this runs code: it writes a marker file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _insert(db, **row):
    columns = dict(store_time=0.0, expire_time=None, access_time=0.0, access_count=0, tag=None, size=0,
                   filename=None, value=None) | row
    with sqlite3.connect(db) as conn:
        conn.execute(f"INSERT INTO Cache ({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))})",
                     tuple(columns.values()))


def _a_winner():
    key = Problem("linear", 56, 40, 4, torch.float32, "gelu", True).key(4, current_environment(torch.device("cpu")))
    return Winner(key, KernelConfig(16, 16, 16, group_m=1, num_stages=1), 1.0, 2.0)


def test_pickle_rows_are_refused_and_never_unpickled(tmp_path, caplog):
    store = Store()
    store.put_winner(_a_winner())
    db = user_cache_dir() / "configs" / "cache.db"
    marker_value, marker_key = tmp_path / "ran-value", tmp_path / "ran-key"
    json_key = sqlite3.Binary(zlib.compress(json.dumps("evil").encode()))  # a key as JSONDisk writes one
    _insert(db, key=json_key, raw=1, mode=4, value=pickle.dumps(_Payload(marker_value)))  # MODE_PICKLE
    _insert(db, key=pickle.dumps(_Payload(marker_key)), raw=0, mode=1, value=b"x")  # a pickled key
    resolve.invalidate()
    with caplog.at_level(logging.WARNING, logger="autofuse"):
        winners = list(Store().winners())
        lin = autofuse.get_linear(40, 56, activation="gelu", dtype=torch.float32, device="cpu")
        with torch.no_grad():
            lin(torch.randn(4, 40))
        listed = CliRunner().invoke(main, ["cache", "ls"])
    assert not marker_value.exists() and not marker_key.exists()
    assert [w.key for w in winners] == [_a_winner().key]  # the real record still loads
    assert listed.exit_code == 0 and "1 tuned key and 0 checked keys" in listed.output
    assert any("not plain JSON" in r.getMessage() for r in caplog.records)


def test_clearing_deletes_only_inside_the_cache_folder(tmp_path):
    Store().put_winner(_a_winner())
    outside = tmp_path / "precious.txt"
    outside.write_text("keep me")
    db = user_cache_dir() / "configs" / "cache.db"
    relative = os.path.relpath(outside, user_cache_dir() / "configs")
    json_key = sqlite3.Binary(zlib.compress(json.dumps("outside").encode()))
    _insert(db, key=json_key, raw=1, mode=2, filename=relative)  # MODE_BINARY, a file elsewhere
    assert CliRunner().invoke(main, ["cache", "clear", "--yes"]).exit_code == 0
    assert outside.read_text() == "keep me"
    assert list(Store().winners()) == []


def _fresh_kernel_loads(monkeypatch):
    from autofuse import render

    monkeypatch.setattr(render, "_loaded", {})
    render.load_kernel.cache_clear()
    return render


def _silu_linear_runs_right():
    x, w = torch.randn(5, 16), torch.randn(8, 16)
    with torch.no_grad():
        lin = autofuse.get_linear(16, 8, bias=False, activation="silu", dtype=torch.float32, device="cpu",
                                  tuned=False)
        lin.weight.copy_(w)
        torch.testing.assert_close(lin(x), torch.nn.functional.silu(x @ w.T), rtol=1e-5, atol=1e-5)


def test_no_kernel_file_is_written_and_triton_reads_the_compiled_text(tmp_path, monkeypatch):
    import inspect

    render = _fresh_kernel_loads(monkeypatch)
    monkeypatch.chdir(tmp_path)
    spec = render.KernelSpec(autofuse.ops.get("linear"), "relu", has_bias=True)
    kernel = render.load_kernel(spec)
    name = kernel.fn.fn.__code__.co_filename
    assert not Path(name).exists() and not list(tmp_path.rglob("*.py")) and not user_cache_dir().exists()
    assert "".join(inspect.getsourcelines(kernel.fn.fn)[0]) in render.render(spec)  # what Triton reads


def test_a_kernel_source_swapped_on_disk_never_runs(tmp_path, monkeypatch):
    """Triton's interpreter reads a kernel's text again at its first launch. A file put where the kernel's
    code says it came from, between the compile and that launch (a swap by this user, or by whoever can
    rename a parent folder), must not be what runs."""
    import linecache

    render = _fresh_kernel_loads(monkeypatch)
    monkeypatch.chdir(tmp_path)  # a relative name would be looked up here
    marker = tmp_path / "swapped-code-ran"
    load_source = render.load_source

    def load_then_swap(source, name):
        fn = load_source(source, name)
        lines = source.splitlines(keepends=True)
        body = lines.index("):\n") + 1  # the kernel's first statement, after its parameter list
        lines[body] = lines[body].rstrip("\n") + f"; open({str(marker)!r}, 'w').close()\n"  # same line count
        path = Path(fn.fn.__code__.co_filename)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(lines))
        linecache.checkcache()  # what a traceback printed meanwhile would do
        return fn

    monkeypatch.setattr(render, "load_source", load_then_swap)
    _silu_linear_runs_right()
    assert not marker.exists()


def test_planted_bytecode_in_the_kernels_folder_never_runs(tmp_path, monkeypatch):
    import hashlib
    import importlib.util
    from importlib._bootstrap_external import _code_to_timestamp_pyc

    render = _fresh_kernel_loads(monkeypatch)
    spec = render.KernelSpec(autofuse.ops.get("linear"), "silu")
    source = render.render(spec)
    folder = user_cache_dir() / "kernels"  # where kernel files were once written
    folder.mkdir(parents=True, mode=0o777)
    path = folder / f"{spec.kernel_name}_{hashlib.sha256(source.encode()).hexdigest()[:20]}.py"
    path.write_text(source)
    marker = tmp_path / "planted-code-ran"
    evil = compile(f"open({str(marker)!r}, 'w').close()\n" + source, str(path), "exec")
    stat = path.stat()
    pyc = Path(importlib.util.cache_from_source(str(path)))
    pyc.parent.mkdir(exist_ok=True)
    pyc.write_bytes(_code_to_timestamp_pyc(evil, stat.st_mtime, stat.st_size))  # valid for that source
    _silu_linear_runs_right()
    assert not marker.exists()


def _export_with(tmp_path, change):
    """A valid export of one record, edited by `change(record)`, its checksum made right again: the
    file passes every check a tamperer can satisfy."""
    from autofuse.configfile import _checksum, build_document

    document = build_document([_a_winner()])
    change(document["records"][0])
    document["sha256"] = _checksum(document["records"])
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(document))
    return path


def _to_mlp_with(**fields):
    def change(record):
        record["key"].update(op="mlp", activation="silu", bias=False, residual=False,
                             template_hash=record["key"]["template_hash"])
        record["config"].update(fields)
    return change


@pytest.mark.parametrize("change, message", [
    (_to_mlp_with(variant="tma"), "no tma variant"),
    (_to_mlp_with(variant="split_k", split_k=4), "no split_k variant"),
    (lambda r: r["key"].update(n=10**400), "n must be an integer in"),
    (lambda r: r["key"].update(k=2**40), "k must be an integer in"),
])
def test_records_that_cannot_run_are_refused_on_import_and_skipped_at_run_time(tmp_path, monkeypatch, caplog,
                                                                               change, message):
    from autofuse import ops
    from autofuse.render import template_hash

    def change_and_rehash(record):
        change(record)
        if record["key"]["op"] == "mlp":  # its template's real hash: only the config is wrong
            record["key"]["template_hash"] = template_hash(ops.get("mlp"))
    path = _export_with(tmp_path, change_and_rehash)
    result = CliRunner().invoke(main, ["cache", "import", str(path)])
    assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output
    assert list(Store().winners()) == []  # nothing written
    monkeypatch.setenv("AUTOFUSE_CACHE_PATH", str(path))
    resolve.invalidate()
    with caplog.at_level(logging.WARNING, logger="autofuse"):
        mlp = autofuse.get_mlp(40, 56, activation="silu", dtype=torch.float32, device="cpu")
        lin = autofuse.get_linear(40, 56, activation="gelu", dtype=torch.float32, device="cpu")
        with torch.no_grad():
            x = torch.randn(4, 40)
            assert mlp(x).shape == (4, 40) and lin(x).shape == (4, 56)
    assert any("ignoring pretuned file" in r.getMessage() and message in r.getMessage() for r in caplog.records)


_BAD_JSON = {
    "binary": b"\x89PNG\r\n\x1a\n\x00\x00\xff\xfe garbage",
    "deep": b"[" * 100_000 + b"]" * 100_000,
    "long-int": b'{"records": ' + b"9" * 5000 + b"}",
}


@pytest.mark.parametrize("kind", list(_BAD_JSON))
def test_json_files_bad_beyond_syntax_are_one_line_errors_or_one_warning(tmp_path, monkeypatch, caplog, kind):
    path = tmp_path / f"{kind}.json"
    path.write_bytes(_BAD_JSON[kind])
    for args in (["cache", "import", str(path)], ["tune", "--shapes", str(path)]):
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 2, result.output
        assert "Traceback" not in result.output and path.name in result.output
        assert len([line for line in result.output.splitlines() if line.startswith("Error")]) == 1
    assert list(Store().winners()) == []
    monkeypatch.setenv("AUTOFUSE_CACHE_PATH", str(path))
    resolve.invalidate()
    with caplog.at_level(logging.WARNING, logger="autofuse"):
        lin = autofuse.get_linear(40, 56, dtype=torch.float32, device="cpu")
        with torch.no_grad():
            assert lin(torch.randn(3, 40)).shape == (3, 56)
    assert len([r for r in caplog.records if path.name in r.getMessage()]) == 1


def test_oversized_files_and_fields_are_refused(tmp_path, monkeypatch):
    from autofuse import jsonfile

    big = _export_with(tmp_path, lambda r: r.update(policy="x" * 100))  # a 100-character policy
    result = CliRunner().invoke(main, ["cache", "import", str(big)])
    assert result.exit_code == 2 and "policy must be a string of at most 40" in result.output
    long_gpu = _export_with(tmp_path, lambda r: r["key"].update(gpu="G" * 5000))
    assert CliRunner().invoke(main, ["cache", "import", str(long_gpu)]).exit_code == 2
    monkeypatch.setattr(jsonfile, "MAX_FILE_BYTES", 100)  # a file over the limit is not even decoded
    ok = _export_with(tmp_path, lambda r: None)
    result = CliRunner().invoke(main, ["cache", "import", str(ok)])
    assert result.exit_code == 2 and "too large" in result.output
    assert list(Store().winners()) == []


def test_an_empty_batch_runs_with_and_without_grad():
    mlp = autofuse.get_mlp(40, 72, dtype=torch.float32, device="cpu")  # parameters require grad
    lin = autofuse.get_linear(40, 56, activation="gelu", dtype=torch.float32, device="cpu")
    for module, width in ((mlp, 40), (lin, 56)):
        x = torch.randn(0, 40, requires_grad=True)
        y = module(x)
        assert y.shape == (0, width)
        y.sum().backward()
        assert x.grad.shape == (0, 40)
        with torch.no_grad():
            assert module(torch.randn(2, 0, 40)).shape == (2, 0, width)


@pytest.mark.parametrize("entry, tokens, message", [
    ({"d_model": 10**12, "d_ff": 64}, [1], "must be a positive integer up to"),
    ({"d_model": 4096, "d_ff": 16384}, [10**9], "GiB to tune"),
])
def test_huge_sizes_in_a_shapes_file_are_refused_before_anything_is_allocated(tmp_path, entry, tokens, message):
    path = tmp_path / "huge.json"
    path.write_text(json.dumps({"tokens": tokens, "mlps": [{"name": "huge", **entry}]}))
    result = CliRunner().invoke(main, ["tune", "--shapes", str(path), "--trials", "1"])
    assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output


def test_an_export_is_readable_as_the_umask_allows(tmp_path):
    Store().put_winner(_a_winner())
    old = os.umask(0o022)
    try:
        out = tmp_path / "ship" / "configs.json"
        out.parent.mkdir()
        assert CliRunner().invoke(main, ["cache", "export", "-o", str(out)]).exit_code == 0
    finally:
        os.umask(old)
    assert out.stat().st_mode & 0o777 == 0o644  # what `touch` would make: a runtime user can read it


def test_dtypes_may_be_named_and_fused_hf_blocks_say_what_they_run():
    mlp = autofuse.get_mlp(40, 72, dtype="bfloat16", device="cpu")
    lin = autofuse.get_linear(40, 56, dtype="torch.float16", device="cpu")
    assert mlp.gate_proj.weight.dtype == torch.bfloat16 and lin.weight.dtype == torch.float16
    with pytest.raises(autofuse.AutofuseError, match="autofuse supports torch.dtype float32, float16, bfloat16"):
        autofuse.get_mlp(40, 72, dtype="int8", device="cpu")
    transformers = pytest.importorskip("transformers")
    config = transformers.GemmaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, vocab_size=64,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                      hidden_activation="gelu_pytorch_tanh")
    model = transformers.GemmaForCausalLM(config).eval()
    autofuse.fuse(model, verbose=False)
    block = model.model.layers[0].mlp
    assert set(block.config_for(4)) == set(block.config_sources(4)) == {"gated_up", "down"}


def _damage(kind: str) -> None:
    """Damage the user cache (holding one winner) the way an attacker or a killed run would."""
    configs = user_cache_dir() / "configs"
    db = configs / "cache.db"
    if kind == "truncated":
        data = db.read_bytes()
        db.write_bytes(data[:6000])  # the header promises pages that are gone
    elif kind == "garbage-pages":
        data = bytearray(db.read_bytes())
        data[100:4096 * 2] = os.urandom(4096 * 2 - 100)
        db.write_bytes(bytes(data))
    elif kind == "not-a-database":
        db.write_bytes(os.urandom(20000))
    elif kind == "configs-is-a-file":
        import shutil

        shutil.rmtree(configs)
        configs.write_text("not a folder")
    elif kind == "corrupt-value":
        with sqlite3.connect(db) as conn:
            conn.execute("UPDATE Cache SET value = ?", (b"\x78\x9c not zlib",))
    elif kind == "empty":
        db.write_bytes(b"")


@pytest.mark.parametrize("kind", ["truncated", "garbage-pages", "not-a-database", "configs-is-a-file",
                                  "corrupt-value", "empty"])
def test_a_damaged_cache_never_crashes_a_forward_and_clear_repairs_it(kind, caplog):
    store = Store()
    store.put_winner(_a_winner())
    store.close()  # damage comes from outside this process (a killed run, a full disk, a tamperer)
    _damage(kind)
    resolve.invalidate()
    with caplog.at_level(logging.WARNING, logger="autofuse"):
        lin = autofuse.get_linear(40, 56, activation="gelu", dtype=torch.float32, device="cpu")
        with torch.no_grad():
            assert lin(torch.randn(4, 40)).shape == (4, 56)
        listed = CliRunner().invoke(main, ["cache", "ls"])
    warned = [r.getMessage() for r in caplog.records if r.name == "autofuse"]
    if kind == "empty":
        assert any("is empty (0 bytes)" in m for m in warned)
    else:
        assert listed.exit_code in (0, 2) and "Traceback" not in listed.output
        assert warned or listed.exit_code == 2 or "0 tuned keys" in listed.output
    if kind in ("truncated", "garbage-pages", "not-a-database", "configs-is-a-file"):
        shapes = user_cache_dir().parent / "s.json"
        shapes.write_text(json.dumps({"tokens": [3], "linears": [{"in_features": 40, "out_features": 56}]}))
        tuned = CliRunner().invoke(main, ["tune", "--shapes", str(shapes), "--trials", "1"])
        assert tuned.exit_code == 2 and "cache clear" in tuned.output and "Traceback" not in tuned.output
    cleared = CliRunner().invoke(main, ["cache", "clear", "--yes"])
    assert cleared.exit_code == 0, cleared.output
    Store().put_winner(_a_winner())  # works again
    assert [w.key for w in Store().winners()] == [_a_winner().key]


def test_a_bad_cache_folder_is_named_in_one_line_and_never_created_by_reading(tmp_path, monkeypatch, caplog):
    a_file = tmp_path / "not-a-folder"
    a_file.write_text("x")
    monkeypatch.setenv("AUTOFUSE_CACHE_DIR", str(a_file))
    for args in (["cache", "ls"], ["cache", "export", "-o", str(tmp_path / "e.json")], ["cache", "clear", "--yes"]):
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 2 and "is a file, not a folder" in result.output, (args, result.output)
    unwritable = "/proc/autofuse-cache"  # no one may create folders there
    monkeypatch.setenv("AUTOFUSE_CACHE_DIR", unwritable)
    result = CliRunner().invoke(main, ["tune", "--shapes", str(_tiny_shapes(tmp_path)), "--trials", "1"])
    assert result.exit_code == 2 and "cannot create the autofuse cache folder" in result.output
    monkeypatch.setenv("AUTOFUSE_CACHE_DIR", str(a_file))
    resolve.invalidate()
    with caplog.at_level(logging.WARNING, logger="autofuse"):
        with torch.no_grad():
            assert autofuse.get_linear(40, 56, dtype=torch.float32, device="cpu")(torch.randn(2, 40)).shape == (2, 56)
    assert any("is a file, not a folder" in r.getMessage() for r in caplog.records)  # said, not silently ignored

    missing = tmp_path / "never-made"
    monkeypatch.setenv("AUTOFUSE_CACHE_DIR", str(missing))
    listed = CliRunner().invoke(main, ["cache", "ls"])
    assert listed.exit_code == 0 and "0 tuned keys" in listed.output and not missing.exists()
    Store().put_winner(_a_winner())
    result = CliRunner().invoke(main, ["cache", "export", "-o", str(tmp_path / "no" / "such" / "dir.json")])
    assert result.exit_code == 2 and "does not exist" in result.output and not (tmp_path / "no").exists()


def _tiny_shapes(tmp_path):
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps({"tokens": [3], "linears": [{"in_features": 40, "out_features": 56}]}))
    return path
