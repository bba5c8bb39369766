"""A stored record is never replaced by a lesser kind or a slower one without saying so: a first-use
check that ends after `autofuse tune` stored a winner, tuning again with fewer trials, an older import."""

import json
import logging
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from autofuse.choose import Choice, Source
from autofuse.choose import check as checked
from autofuse.choose import lookup as resolve
from autofuse.cli import main
from autofuse.configfile import build_document
from autofuse.configs import KernelConfig, Library
from autofuse.key import Problem, current_environment
from autofuse.shapes import load_shapes
from autofuse.store import CHECKED, Store, Winner, read_winners
from autofuse.tune.driver import Job, jobs_for_shapes, tune_key

KEY_ENV = current_environment(torch.device("cpu"))
KEY = Problem("linear", 56, 40, 4, torch.float32, "gelu", True).key(4, KEY_ENV)
TUNED = Winner(KEY, KernelConfig(16, 16, 16, group_m=1, num_stages=1), 1.0, 2.0, trials=20, policy="optuna")


def _ranked(stored: Winner, new: Winner, replace: bool = False) -> Winner:
    store = Store()
    store.put_winner(stored)
    held = store.put_winner(new, replace=replace)
    assert Store().get_winner(KEY) == held  # what put_winner returns is what the cache holds
    return held


def test_a_check_never_replaces_a_tuned_record(caplog):
    check = Winner(KEY, Library("eager"), 0.5, 0.5, policy=CHECKED)
    with caplog.at_level(logging.WARNING, logger="autofuse"):
        assert _ranked(TUNED, check) == TUNED
    assert "a first-use check never replaces a tuned record" in caplog.text


def test_a_slower_tuned_record_is_kept_out_unless_replace():
    slower = Winner(KEY, KernelConfig(32, 16, 16, group_m=1, num_stages=1), 1.5, 2.0, trials=2, policy="optuna")
    assert _ranked(TUNED, slower) == TUNED
    Store().clear()
    assert _ranked(TUNED, slower, replace=True) == slower


@pytest.mark.parametrize("new_policy", ["optuna", CHECKED])
def test_what_replaces_a_checked_record(new_policy):
    check = Winner(KEY, Library("eager"), 0.5, 0.5, policy=CHECKED)
    new = Winner(KEY, TUNED.config, 0.9, 2.0, policy=new_policy)  # slower, but a check decides only briefly
    assert _ranked(check, new) == new


def test_a_check_that_ends_after_tune_stored_its_winner_keeps_the_tuned_record(monkeypatch):
    """The race: the check starts (nothing stored yet), `autofuse tune` stores its winner, the check ends."""
    monkeypatch.setenv("AUTOFUSE_CHECK", "1")
    resolve.invalidate()
    check_result = Winner(KEY, Library("eager"), 0.5, 0.5, policy=CHECKED)

    def compare_while_tune_stores(key, M, kernels, device, heuristic=None):
        Store().put_winner(TUNED)  # the tune process, meanwhile
        return check_result

    monkeypatch.setattr(checked, "_compare", compare_while_tune_stores)
    choice = checked.checked(Problem("linear", 56, 40, 3, torch.float32, "gelu", True),
                             Choice(TUNED.config, Source.HEURISTIC))
    assert Store().get_winner(KEY) == TUNED
    assert choice.config == TUNED.config and choice.source == "user-cache"  # the tuned record is what runs


def test_tuning_again_with_fewer_trials_keeps_a_faster_imported_record(tmp_path):
    faster = Winner(KEY, Library("eager"), 1e-9, 1e-9, trials=40, policy="optuna")  # nothing on a CPU beats it
    path = tmp_path / "export.json"
    path.write_text(json.dumps(build_document([faster])))
    assert CliRunner().invoke(main, ["cache", "import", str(path)]).exit_code == 0
    result = tune_key(Job(KEY, 3, "lin"), Store(), torch.device("cpu"), policy="random", trials=1)
    assert result.winner == faster and result.not_stored is not None
    assert Store().get_winner(KEY) == faster


def test_tune_says_which_keys_kept_their_record(tmp_path):
    shapes = tmp_path / "s.json"
    shapes.write_text(json.dumps({"dtype": "float32", "tokens": [3],
                                  "linears": [{"in_features": 40, "out_features": 56, "activation": "gelu"}]}))
    (job,) = jobs_for_shapes(load_shapes(shapes), torch.device("cpu"))
    faster = Winner(job.key, Library("eager"), 1e-9, 1e-9, trials=40, policy="optuna")
    Store().put_winner(faster)
    out = CliRunner().invoke(main, ["tune", "--shapes", str(shapes), "--trials", "1", "--policy", "random"])
    assert out.exit_code == 0 and "1 key kept the record already stored" in out.output, out.output
    assert Store().get_winner(job.key) == faster
    again = CliRunner().invoke(main, ["tune", "--shapes", str(shapes), "--trials", "1", "--policy", "random",
                                      "--replace"])
    assert again.exit_code == 0 and "kept the record" not in again.output
    assert Store().get_winner(job.key) != faster


def test_an_older_slower_import_keeps_the_stored_record_and_says_so(tmp_path):
    Store().put_winner(TUNED)
    slower = Winner(KEY, KernelConfig(32, 16, 16, group_m=1, num_stages=1), 3.0, 2.0, trials=4, policy="optuna")
    path = tmp_path / "old.json"
    path.write_text(json.dumps(build_document([slower])))
    out = CliRunner().invoke(main, ["cache", "import", str(path)])
    assert out.exit_code == 0 and "0 replaced, 1 kept the stored record" in out.output
    assert Store().get_winner(KEY) == TUNED
    forced = CliRunner().invoke(main, ["cache", "import", str(path), "--replace"])
    assert forced.exit_code == 0 and "1 replaced, 0 kept" in forced.output
    assert Store().get_winner(KEY) == slower


def test_a_held_write_lock_stalls_a_first_use_check_for_seconds_not_minutes(monkeypatch, caplog):
    import sqlite3
    import time

    from autofuse.resources import user_cache_dir

    Store().put_winner(TUNED)  # the cache exists; a second process now holds its write lock
    monkeypatch.setattr(checked, "STORE_WAIT_S", 1.0)
    monkeypatch.setenv("AUTOFUSE_CHECK", "1")
    resolve.invalidate()
    lock = sqlite3.connect(user_cache_dir() / "configs" / "cache.db", isolation_level=None)
    lock.execute("BEGIN IMMEDIATE")
    try:
        other = Problem("linear", 56, 40, 16, torch.float32, "gelu", True).key(16, KEY_ENV)
        monkeypatch.setattr(checked, "_compare",
                            lambda key, M, kernels, device, heuristic=None: Winner(other, Library("eager"), 0.5, 0.5,
                                                                                   policy=CHECKED))
        start = time.perf_counter()
        with caplog.at_level(logging.WARNING, logger="autofuse"):
            choice = checked.checked(Problem("linear", 56, 40, 16, torch.float32, "gelu", True),
                                     Choice(TUNED.config, Source.HEURISTIC))
        waited = time.perf_counter() - start
    finally:
        lock.execute("ROLLBACK")
        lock.close()
    assert waited < checked.STORE_WAIT_S + 1.5 and choice.config == Library("eager")
    assert "locked by another process" in caplog.text


def _make_read_only(folder: Path) -> list[Path]:
    """Make the cache at `folder` read-only for this process: by its modes for a user, by the immutable
    attribute for root (whom modes do not stop). Returns what to undo with chattr -i."""
    import os
    import subprocess

    paths = [folder, *folder.rglob("*")]
    if os.getuid() != 0:
        for path in paths:
            path.chmod(0o555 if path.is_dir() else 0o444)
        return []
    done = subprocess.run(["chattr", "+i", *map(str, paths)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"root cannot be kept from writing here (chattr: {done.stderr.strip()[:80]})")
    return paths


def test_a_read_only_cache_is_read_not_called_damaged_and_clear_keeps_it(caplog):
    import subprocess

    from autofuse.resources import user_cache_dir

    store = Store()
    store.put_winner(TUNED)
    store.close()  # no connection of this process keeps the files mapped: another process wrote them
    undo = _make_read_only(user_cache_dir())
    try:
        resolve.invalidate()
        with caplog.at_level(logging.WARNING, logger="autofuse"):
            choice = resolve.resolve(Problem("linear", 56, 40, 3, torch.float32, "gelu", True))
        assert choice.source == "user-cache" and choice.config == TUNED.config
        assert "damaged" not in caplog.text and "cannot be read" not in caplog.text
        clear = CliRunner().invoke(main, ["cache", "clear", "--yes"])
        assert clear.exit_code == 2 and "read-only for this user" in clear.output, clear.output
        assert [w.key for w in read_winners()] == [KEY]  # nothing deleted
    finally:
        if undo:
            subprocess.run(["chattr", "-i", *map(str, undo)], check=True)
        for path in [user_cache_dir(), *user_cache_dir().rglob("*")]:
            path.chmod(0o755 if path.is_dir() else 0o644)


def test_an_export_of_dense_and_fp8_records_of_one_template_reads_back():
    # linear_fp8 renders the dense Linear's template with other variants, so the two ops' records carry two hashes
    # of one template: the header lists both, and the file its writer wrote reads back whole.
    from autofuse.configfile import parse_document

    fp8_key = Problem("linear_fp8", 56, 40, 4, torch.float32, "gelu", True).key(4, KEY_ENV)
    assert fp8_key.template == KEY.template and fp8_key.template_hash != KEY.template_hash
    fp8 = Winner(fp8_key, KernelConfig(16, 16, 16, group_m=1, num_stages=1), 1.0, 2.0, trials=20, policy="optuna")
    document = json.loads(json.dumps(build_document([TUNED, fp8])))
    assert document["template_hashes"][KEY.template] == sorted([KEY.template_hash, fp8_key.template_hash])
    assert {w.key for w in parse_document(document, "export.json")} == {KEY, fp8_key}
    document["template_hashes"][KEY.template] = KEY.template_hash  # a header missing the fp8 op's hash
    with pytest.raises(Exception, match="record .: template hash .* is not among the header's"):
        parse_document(document, "export.json")
