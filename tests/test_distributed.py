"""Tuning with several workers through one Optuna storage (tune/worklist.py, tune/coordinator.py),
under the interpreter: worker processes stand in for GPUs and for machines."""

import multiprocessing
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from _helpers import write_json
from click.testing import CliRunner

from autofuse.cli import main
from autofuse.errors import AutofuseError
from autofuse.shapes import load_shapes
from autofuse.store import Store
from autofuse.tune import worklist
from autofuse.tune.coordinator import parse_devices

SHAPES = {"dtype": "float32", "tokens": [5, 37],
          "mlps": [{"name": "m", "d_model": 32, "d_ff": 40, "activation": "silu"}],
          "linears": [{"name": "l", "in_features": 24, "out_features": 40}]}
KEYS = 10  # per M: gated_up, gated_pairs, down, mlp (M <= 64), linear; M = 5 and 37


def _claims(storage):
    """{job index: [(generation, attrs)]} of every run in the storage."""
    out = {}
    for study in worklist.open_storage(str(storage)).get_all_studies():
        _, _, index, generation = study.study_name.split("/")
        out.setdefault(int(index), []).append((int(generation), dict(study.user_attrs)))
    return out


def test_two_workers_share_one_journal_and_tune_every_key_once(tmp_path):
    shapes = write_json(tmp_path / "s.json", SHAPES)
    result = CliRunner().invoke(main, ["tune", "--shapes", str(shapes), "--trials", "2", "--devices", "cpu,cpu"])
    assert result.exit_code == 0, result.output
    claims = _claims(tmp_path / "autofuse-cache" / "tune-journal.log")
    assert sorted(claims) == list(range(KEYS))
    assert all(len(c) == 1 and c[0][0] == 0 and c[0][1]["done"] for c in claims.values())  # once each
    assert {c[0][1]["worker"] for c in claims.values()} == {"cpu0", "cpu1"}  # both did work
    winners = list(Store().winners())
    assert len(winners) == KEYS and len({w.key for w in winners}) == KEYS
    assert f"tuning {KEYS} keys on 2 workers" in result.output
    assert f"[{KEYS}/{KEYS} keys done, run ETA 0s]" in result.output


def _worker(shapes, storage, cache, name, *extra):
    env = dict(os.environ, AUTOFUSE_CACHE_DIR=str(cache), TRITON_INTERPRET="1")
    return subprocess.Popen([sys.executable, "-m", "autofuse.cli", "tune", "--shapes", str(shapes), "--storage",
                             str(storage), "--worker", name, *extra], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def test_a_killed_workers_key_is_finished_by_the_other(tmp_path):
    one_key = {"dtype": "float32", "tokens": [37], "linears": [{"in_features": 24, "out_features": 40}]}
    shapes, storage, cache = write_json(tmp_path / "s.json", one_key), tmp_path / "journal.log", tmp_path / "cache"
    args = ["--trials", "40", "--stale-after", "2"]
    a = _worker(shapes, storage, cache, "A", *args)
    deadline = time.time() + 120
    while time.time() < deadline:  # kill A in the middle of its key, after a few trials
        claims = _claims(storage) if storage.exists() else {}
        if claims and claims[0][0][1].get("trials_done", 0) >= 3:
            break
        time.sleep(0.05)
    a.send_signal(signal.SIGKILL)
    a.wait()
    done_by_a = claims[0][0][1]["trials_done"]
    assert not claims[0][0][1]["done"]
    b = _worker(shapes, storage, cache, "B", *args)
    out, _ = b.communicate(timeout=300)
    assert b.returncode == 0, out
    (gen0, a_attrs), (gen1, b_attrs) = sorted(_claims(storage)[0], key=lambda c: c[0])
    assert (gen0, a_attrs["worker"], a_attrs["done"]) == (0, "A", False)
    assert (gen1, b_attrs["worker"], b_attrs["done"]) == (1, "B", True)
    winner = next(iter(Store(cache).winners()))
    # B resumed from the trials A had stored: at most the one A was running is lost.
    assert winner.trials == 40 and len(Store(cache).trials(winner.key)) == 40
    assert done_by_a >= 3


def test_two_machines_join_one_run_through_the_storage(tmp_path):
    # Two coordinators with their own caches (two machines) and one storage: each key is tuned
    # once, and both caches end with every winner.
    shapes, storage = write_json(tmp_path / "s.json", SHAPES), tmp_path / "shared.log"
    env = [dict(os.environ, AUTOFUSE_CACHE_DIR=str(tmp_path / f"machine{i}"), TRITON_INTERPRET="1") for i in (0, 1)]
    cmd = [sys.executable, "-m", "autofuse.cli", "tune", "--shapes", str(shapes), "--trials", "2", "--devices",
           "cpu", "--storage", str(storage)]
    procs = [subprocess.Popen(cmd, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for e in env]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
    claims = _claims(storage)
    assert sorted(claims) == list(range(KEYS)) and all(len(c) == 1 for c in claims.values())
    for i in (0, 1):
        assert len(list(Store(tmp_path / f"machine{i}").winners())) == KEYS


def _claim_once(args):
    storage, worker = args
    work_list = worklist.WorkList(worklist.open_storage(storage), "race", [])
    return work_list.try_claim(0, 0, worker) is not None


def test_a_key_is_claimed_by_exactly_one_of_many_racing_processes(tmp_path):
    storage = str(tmp_path / "race.log")
    with multiprocessing.get_context("spawn").Pool(6) as pool:
        got = pool.map(_claim_once, [(storage, f"w{i}") for i in range(12)])
    assert sum(got) == 1


def test_sqlite_storage_works_too(tmp_path):
    shapes = write_json(tmp_path / "s.json",
                        {"dtype": "float32", "tokens": [5], "linears": [{"in_features": 24, "out_features": 40}]})
    url = f"sqlite:///{tmp_path / 'runs.db'}"
    result = CliRunner().invoke(main, ["tune", "--shapes", str(shapes), "--trials", "1", "--devices", "cpu",
                                       "--storage", url])
    assert result.exit_code == 0, result.output
    assert len(list(Store().winners())) == 1


@pytest.mark.parametrize("text, message", [("0,0", "lists a GPU twice"), ("a,b", "GPU indices"), ("", "GPU indices")])
def test_bad_device_lists_are_refused(text, message):
    with pytest.raises(AutofuseError, match=message):
        parse_devices(text)


def test_cli_refuses_a_repeated_gpu_in_one_line(tmp_path):
    shapes = write_json(tmp_path / "s.json", SHAPES)
    result = CliRunner().invoke(main, ["tune", "--shapes", str(shapes), "--devices", "1,1"])
    assert result.exit_code == 2 and "lists a GPU twice" in result.output and "Traceback" not in result.output


def test_cpu_devices_may_repeat():
    assert parse_devices("cpu,cpu") == ["cpu", "cpu"]


def test_a_poisoned_shared_storage_is_skipped_and_the_run_still_tunes_every_key(tmp_path, caplog):
    import logging

    from autofuse.tune.driver import jobs_for_shapes

    shapes_path = write_json(tmp_path / "s.json", SHAPES)
    storage = str(tmp_path / "shared.log")
    jobs = jobs_for_shapes(load_shapes(shapes_path), torch.device("cpu"))
    settings = dict(train=False, ops=None, trials=1, time_budget_s=None, policy="optuna", seed=0, weights="dense")
    run = worklist.run_name(jobs, settings)  # what the CLI's workers will compute
    opened = worklist.open_storage(storage)
    from optuna.study import StudyDirection

    def study(name, **attrs):
        study_id = opened.create_new_study([StudyDirection.MINIMIZE], name)
        for key, value in attrs.items():
            opened.set_study_user_attr(study_id, key, value)

    study(f"autofuse/{run}/abc/0", done=True)  # a key index that is no number
    study(f"autofuse/{run}/99999/0", done=True)  # an index past the run's keys
    study(f"autofuse/{run}/00000/0", done=True, winner={"bad": 1}, heartbeat="soon")  # a broken winner and beat
    with caplog.at_level(logging.WARNING, logger="autofuse"):
        result = CliRunner().invoke(main, ["tune", "--shapes", str(shapes_path), "--trials", "1", "--devices", "cpu",
                                           "--storage", storage])
    assert result.exit_code == 0, result.output
    assert len(list(Store().winners())) == len(jobs)  # key 0 was tuned again, not taken from the broken claim
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert "not one of this run's keys" in warned and "winner is not valid" in warned and "not a time" in warned


def test_a_run_whose_worker_failed_exits_non_zero(tmp_path, monkeypatch):
    from autofuse.tune import coordinator

    wrapper = tmp_path / "python"
    wrapper.write_text(f"#!/bin/sh\ncase \"$*\" in *'--worker cpu1'*) exit 3;; esac\nexec {sys.executable} \"$@\"\n")
    wrapper.chmod(0o755)
    monkeypatch.setattr(coordinator.sys, "executable", str(wrapper))
    shapes = write_json(tmp_path / "s.json", SHAPES)
    result = CliRunner().invoke(main, ["tune", "--shapes", str(shapes), "--trials", "1", "--devices", "cpu,cpu",
                                       "--storage", str(tmp_path / "j.log")])
    assert result.exit_code == 2 and "cpu1 (exit 3) failed" in result.output and "Traceback" not in result.output
    assert len(list(Store().winners())) > 0  # the other worker's keys are kept


@pytest.mark.parametrize("content, url", [("garbage line\n", "{path}"), ("not a database\n", "sqlite:///{path}")])
def test_a_storage_that_cannot_be_read_is_one_line(tmp_path, content, url):
    path = tmp_path / "storage"
    path.write_text(content)
    shapes = write_json(tmp_path / "s.json", SHAPES)
    result = CliRunner().invoke(main, ["tune", "--shapes", str(shapes), "--trials", "1", "--devices", "cpu",
                                       "--storage", url.format(path=path)])
    assert result.exit_code == 2 and "the shared tuning storage cannot be used" in result.output
    assert "Traceback" not in result.output


def _poisoned(tmp_path, **attrs):
    """A run of SHAPES whose key 0 holds a claim with `attrs`, as another party wrote it."""
    from optuna.study import StudyDirection

    from autofuse.tune.driver import jobs_for_shapes

    jobs = jobs_for_shapes(load_shapes(write_json(tmp_path / "s.json", SHAPES)), torch.device("cpu"))
    opened = worklist.open_storage(str(tmp_path / "shared.log"))
    study_id = opened.create_new_study([StudyDirection.MINIMIZE], "autofuse/run/00000/0")
    for key, value in attrs.items():
        opened.set_study_user_attr(study_id, key, value)
    return worklist.WorkList(opened, "run", jobs), jobs


def test_another_keys_valid_winner_is_not_taken_for_this_key(tmp_path):
    from autofuse.configs import Library
    from autofuse.store import Winner
    from autofuse.tune.driver import jobs_for_shapes

    jobs = jobs_for_shapes(load_shapes(write_json(tmp_path / "s.json", SHAPES)), torch.device("cpu"))
    foreign = Winner(jobs[1].key, Library("eager"), 1.0, 1.0)
    work_list, _ = _poisoned(tmp_path, done=True, heartbeat=time.time(), winner=foreign.to_record())
    claim = work_list.claims()[0]
    assert not claim.attrs["done"] and work_list.winners() == []


@pytest.mark.parametrize("heartbeat", [1e300, float("nan"), float("inf")])
def test_a_forged_heartbeat_cannot_hold_a_key(tmp_path, heartbeat):
    work_list, _ = _poisoned(tmp_path, done=False, heartbeat=heartbeat, worker="evil\n[1/1] spoof")
    claim = work_list.claims()[0]
    assert claim.attrs["heartbeat"] == 0 and claim.attrs["worker"] == "?"  # stale: another worker takes it over


def test_a_claim_whose_first_heartbeat_is_not_written_yet_is_not_taken_over_at_once(tmp_path, monkeypatch):
    """A worker creates its claim and then writes its first heartbeat: another worker reading the claim in between
    must not take it over (the key would be tuned twice), yet a claim left without a heartbeat (its worker died
    in between) is taken over once this worker has seen it so for stale_after_s."""
    from optuna.study import StudyDirection

    from autofuse.tune.driver import jobs_for_shapes

    jobs = jobs_for_shapes(load_shapes(write_json(tmp_path / "s.json", SHAPES)), torch.device("cpu"))[:1]
    opened = worklist.open_storage(str(tmp_path / "shared.log"))
    opened.create_new_study([StudyDirection.MINIMIZE], "autofuse/run/00000/0")  # claimed, no heartbeat yet
    work_list = worklist.WorkList(opened, "run", jobs)
    now = [time.time()]
    monkeypatch.setattr(worklist, "time", type("Clock", (), {"time": staticmethod(lambda: now[0])}))
    unbeaten: dict = {}
    assert worklist._pick(work_list, work_list.claims(), "w2", 120.0, unbeaten) is None
    now[0] += 100.0
    assert worklist._pick(work_list, work_list.claims(), "w2", 120.0, unbeaten) is None
    now[0] += 30.0
    index, _, takeover = worklist._pick(work_list, work_list.claims(), "w2", 120.0, unbeaten)
    assert index == 0 and takeover
    assert work_list.claims()[0].generation == 1 and work_list.claims()[0].attrs["worker"] == "w2"


def test_a_finished_key_writes_its_winner_before_it_says_done(tmp_path, monkeypatch):
    """A claim's attributes are written one at a time: `done` comes last, so that a worker reading the claim in
    between never finds a done key without its winner (which it would take as broken and tune again)."""
    from types import SimpleNamespace

    from autofuse.configs import Library
    from autofuse.store import Winner
    from autofuse.tune.driver import TuneOptions, jobs_for_shapes

    jobs = jobs_for_shapes(load_shapes(write_json(tmp_path / "s.json", SHAPES)), torch.device("cpu"))[:1]
    work_list = worklist.WorkList(worklist.open_storage(str(tmp_path / "shared.log")), "run", jobs)
    writes = []
    real = work_list.set
    monkeypatch.setattr(work_list, "set", lambda study, **attrs: writes.append(list(attrs)) or real(study, **attrs))
    winner = Winner(jobs[0].key, Library("eager"), 1.0, 1.0, trials=2)
    monkeypatch.setattr(worklist, "tune_key", lambda *a, **k: SimpleNamespace(not_stored=None, winner=winner))
    assert worklist.work(work_list, Store(), torch.device("cpu"), "w", TuneOptions()) == [0]
    assert writes[-1][-1] == "done" and "winner" in writes[-1]
    assert work_list.winners() == [winner]
