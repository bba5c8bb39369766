"""Several machines tuning one run through a real PostgreSQL server (`tune --storage postgresql+psycopg://...`),
under the interpreter: coordinator and worker processes with cache folders of their own stand in for machines.
The server is started here on a free port in a temporary folder (initdb, pg_ctl; .ci/run installs PostgreSQL)
and stopped at the end; where its binaries or the psycopg driver are missing the test skips, saying which."""

import glob
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest
from _helpers import write_json

from autofuse.store import Store
from autofuse.tune import worklist

SHAPES = {"dtype": "float32", "tokens": [5, 37],
          "mlps": [{"name": "m", "d_model": 32, "d_ff": 40, "activation": "silu"}],
          "linears": [{"name": "l", "in_features": 24, "out_features": 40}]}
KEYS = 10  # per M: gated_up, gated_pairs, down, mlp (M <= 64), linear; M = 5 and 37


def _binaries() -> str | None:
    found = shutil.which("initdb")
    if found:
        return os.path.dirname(found)
    versions = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    return os.path.dirname(versions[-1]) if versions else None


@pytest.fixture(scope="module")
def server():
    """A PostgreSQL server for this module's tests: (run a command as its owner, its port)."""
    pytest.importorskip("psycopg", reason="the psycopg driver is not installed (pip install 'psycopg[binary]')")
    bin_dir = _binaries()
    if bin_dir is None:
        pytest.skip("PostgreSQL is not installed (no initdb on PATH or in /usr/lib/postgresql): .ci/run installs it")
    prefix: list[str] = []
    base = tempfile.mkdtemp(prefix="autofuse-pg-")
    if os.geteuid() == 0:  # initdb refuses root: the server runs as the postgres user
        try:
            owner = pwd.getpwnam("postgres")
        except KeyError:
            pytest.skip("running as root and no 'postgres' user to run the PostgreSQL server as")
        os.chown(base, owner.pw_uid, owner.pw_gid)
        prefix = ["runuser", "-u", "postgres", "--"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    data = os.path.join(base, "data")
    subprocess.run([*prefix, f"{bin_dir}/initdb", "-D", data, "-U", "autofuse", "--auth=trust", "-E", "UTF8"],
                   check=True, capture_output=True, timeout=120)
    subprocess.run([*prefix, f"{bin_dir}/pg_ctl", "-D", data, "-w", "-l", os.path.join(base, "log"), "-o",
                    f"-p {port} -k {base} -c listen_addresses=127.0.0.1", "start"],
                   check=True, capture_output=True, timeout=120)
    try:
        yield port
    finally:
        subprocess.run([*prefix, f"{bin_dir}/pg_ctl", "-D", data, "-m", "immediate", "stop"], capture_output=True,
                       timeout=60)
        shutil.rmtree(base, ignore_errors=True)


def _database(port: int, name: str) -> str:
    """A fresh database on the server, as the URL `--storage` takes."""
    import psycopg

    with psycopg.connect(f"host=127.0.0.1 port={port} user=autofuse dbname=postgres", autocommit=True) as c:
        c.execute(f'DROP DATABASE IF EXISTS "{name}"')
        c.execute(f'CREATE DATABASE "{name}"')
    return f"postgresql+psycopg://autofuse@127.0.0.1:{port}/{name}"


def _claims(url):
    out = {}
    for study in worklist.open_storage(url).get_all_studies():
        _, _, index, generation = study.study_name.split("/")
        out.setdefault(int(index), []).append((int(generation), dict(study.user_attrs)))
    return out


def _env(cache):
    return dict(os.environ, AUTOFUSE_CACHE_DIR=str(cache), TRITON_INTERPRET="1")


def test_two_machines_tune_one_run_through_postgresql(server, tmp_path):
    url = _database(server, "two_machines")
    shapes = write_json(tmp_path / "s.json", SHAPES)
    cmd = [sys.executable, "-m", "autofuse.cli", "tune", "--shapes", str(shapes), "--trials", "2", "--devices",
           "cpu", "--storage", url]
    procs = [subprocess.Popen(cmd, env=_env(tmp_path / f"machine{i}"), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in (0, 1)]
    for p in procs:
        _, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
    claims = _claims(url)
    assert sorted(claims) == list(range(KEYS)) and all(len(c) == 1 and c[0][1]["done"] for c in claims.values())
    for i in (0, 1):  # every winner in each machine's cache
        assert len(list(Store(tmp_path / f"machine{i}").winners())) == KEYS


def test_a_killed_machine_is_taken_over_and_its_rerun_resumes(server, tmp_path):
    url = _database(server, "killed_worker")
    one_key = {"dtype": "float32", "tokens": [37], "linears": [{"in_features": 24, "out_features": 40}]}
    shapes = write_json(tmp_path / "s.json", one_key)
    args = ["--trials", "40", "--stale-after", "2"]

    def worker(cache, name):
        return subprocess.Popen([sys.executable, "-m", "autofuse.cli", "tune", "--shapes", str(shapes), "--storage",
                                 url, "--worker", name, *args], env=_env(cache), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)

    a = worker(tmp_path / "machineA", "A")
    deadline, claims = time.time() + 300, {}
    while time.time() < deadline:  # kill A in the middle of its key, after a few trials
        claims = _claims(url)
        if claims and claims[0][0][1].get("trials_done", 0) >= 3:
            break
        time.sleep(0.1)
    a.send_signal(signal.SIGKILL)
    a.wait()
    assert claims and not claims[0][0][1]["done"]
    b = worker(tmp_path / "machineB", "B")
    out, _ = b.communicate(timeout=600)
    assert b.returncode == 0, out[-3000:]  # an honest exit status: B finished the key
    (gen0, a_attrs), (gen1, b_attrs) = sorted(_claims(url)[0], key=lambda c: c[0])
    assert (gen0, a_attrs["worker"], a_attrs["done"]) == (0, "A", False)
    assert (gen1, b_attrs["worker"], b_attrs["done"]) == (1, "B", True)
    (winner,) = Store(tmp_path / "machineB").winners()
    assert winner.trials == 40
    # The killed machine's run started again finds the key done: it tunes nothing again and takes B's winner.
    again = subprocess.run([sys.executable, "-m", "autofuse.cli", "tune", "--shapes", str(shapes), "--storage", url,
                            "--devices", "cpu", *args], env=_env(tmp_path / "machineA"), capture_output=True,
                           text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert len(_claims(url)[0]) == 2  # no third claim: the key was tuned once
    assert [w.config for w in Store(tmp_path / "machineA").winners()] == [winner.config]
