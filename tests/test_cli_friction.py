"""A new user's first hour with the command line: interrupting and resuming,
progress, the interpreter's tables, finding a key, and the smaller rough edges."""

import json

import pytest
from click.testing import CliRunner

from autofuse.cli import main
from autofuse.store import Store
from autofuse.tune import driver

TINY = {"dtype": "float32", "tokens": [3, 37],
        "linears": [{"name": "lin", "in_features": 40, "out_features": 56, "activation": "gelu"}]}


def _shapes(tmp_path, data=TINY):
    path = tmp_path / "s.json"
    path.write_text(json.dumps(data))
    return path


def _table(output):
    return [line.split() for line in output.splitlines() if line.startswith("lin ")]


def test_ctrl_c_says_how_far_the_run_got_and_a_plain_rerun_continues(tmp_path, monkeypatch):
    shapes = _shapes(tmp_path)
    real = driver.tune_key
    calls = []

    def interrupted_on_the_second_key(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(driver, "tune_key", interrupted_on_the_second_key)
    result = CliRunner().invoke(main, ["tune", "--shapes", str(shapes), "--trials", "2", "--policy", "random"])
    assert result.exit_code == 130 and "Aborted!" not in result.output
    assert "interrupted after 1 of 2 keys" in result.output and "Run the same command again" in result.output
    assert len(list(Store().winners())) == 1
    monkeypatch.setattr(driver, "tune_key", real)
    again = CliRunner().invoke(main, ["tune", "--shapes", str(shapes), "--trials", "2", "--policy", "random"])
    assert again.exit_code == 0, again.output
    rows = _table(again.output)
    assert sorted(int(row[-2]) for row in rows) == [0, 2]  # the finished key's two trials were kept, not re-run
    fresh = CliRunner().invoke(main, ["tune", "--shapes", str(shapes), "--trials", "2", "--policy", "random",
                                      "--fresh"])
    assert fresh.exit_code == 0 and all(int(row[-2]) == 0 for row in _table(fresh.output))


def test_shapes_and_model_together_say_only_one(tmp_path):
    result = CliRunner().invoke(main, ["tune", "--shapes", str(_shapes(tmp_path)), "--model", str(tmp_path)])
    assert result.exit_code == 2 and "give only one of --shapes FILE or --model CONFIG" in result.output


@pytest.fixture(autouse=True)
def _fresh_index():
    from autofuse.choose import lookup as resolve

    resolve.invalidate()
    yield
    resolve.invalidate()


def test_progress_gives_the_runs_eta_and_total_time_and_says_when_a_space_ran_out(tmp_path):
    three = dict(TINY, tokens=[3, 5, 37])
    result = CliRunner().invoke(main, ["tune", "--shapes", str(_shapes(tmp_path, three)), "--trials", "6",
                                       "--policy", "random"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert "tuning 3 keys" in result.output and any(", run " in line for line in lines if line.startswith("[2/3]"))
    assert lines[-1].startswith("tuned 3 keys in ")
    assert all(a != b for a, b in zip(lines, lines[1:]))  # piped: no key's last line printed twice
    assert sum("done in" in line for line in lines) == 3
    one = dict(TINY, tokens=[3])
    small = CliRunner().invoke(main, ["tune", "--shapes", str(_shapes(tmp_path, one)), "--trials", "100000",
                                      "--policy", "exhaustive", "--fresh"])
    assert small.exit_code == 0 and "tuning 1 key (float32) with" in small.output and "tuned 1 key in" in small.output
    assert "(search space exhausted)" in small.output


def test_the_interpreters_table_shows_no_speedup_and_its_warnings_stay_out(tmp_path):
    import subprocess
    import sys

    import torch

    if torch.cuda.is_available():
        pytest.skip("the CLI switches to the interpreter only on a machine without a GPU")

    result = CliRunner().invoke(main, ["tune", "--shapes", str(_shapes(tmp_path, dict(TINY, tokens=[3]))),
                                       "--trials", "1"])
    assert result.exit_code == 0
    assert "speedup" not in result.output and "0.00x" not in result.output
    assert result.output.count("not GPU speed") == 1
    # The CLI's switch to the interpreter silences NumPy's overflow warnings from inside it, and only those.
    code = ("import warnings; from autofuse.cli.common import select_device; select_device(); "
            "warnings.warn_explicit('overflow encountered in cast', RuntimeWarning, 'interpreter.py', 469, "
            "module='triton.runtime.interpreter'); "
            "warnings.warn_explicit('elsewhere', RuntimeWarning, 'mine.py', 1, module='mine')")
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "overflow encountered" not in done.stderr and "elsewhere" in done.stderr


def test_cache_ls_lists_shipped_and_path_configs_with_their_source(tmp_path, monkeypatch, caplog):
    import logging

    import torch

    from autofuse.configfile import export_winners
    from autofuse.configs import KernelConfig
    from autofuse.key import Problem, current_environment
    from autofuse.store import Winner

    key = Problem("linear", 56, 40, 4, torch.float32, "gelu", True).key(4, current_environment(torch.device("cpu")))
    other = Store(tmp_path / "elsewhere")
    other.put_winner(Winner(key, KernelConfig(16, 16, 16, group_m=1, num_stages=1), 1.0, 2.0))
    folder = tmp_path / "configs"
    folder.mkdir()
    export_winners(other, folder / "team.json")
    for name in ("package.json", "tsconfig.json", "notes.json"):  # unrelated JSON beside it
        (folder / name).write_text('{"name": "x"}')
    monkeypatch.setenv("AUTOFUSE_CACHE_PATH", str(folder))
    from autofuse.choose import lookup as resolve

    resolve.invalidate()
    with caplog.at_level(logging.WARNING, logger="autofuse"):
        listed = CliRunner().invoke(main, ["cache", "ls"])
    assert listed.exit_code == 0 and "shipped:team.json" in listed.output
    assert "1 more key from shipped files" in listed.output or "more keys from shipped files" in listed.output
    unrelated = [r for r in caplog.records if "not valid config exports" in r.getMessage()]
    assert len(unrelated) == 1 and "3 file(s)" in unrelated[0].getMessage()  # one line for the folder


def test_the_smaller_rough_edges(tmp_path):
    import subprocess
    import sys

    runner = CliRunner()
    Store()  # an empty cache
    empty = runner.invoke(main, ["cache", "export", "-o", str(tmp_path / "e.json")])
    assert empty.exit_code == 2 and "no tuned configs" in empty.output and "no GPU" not in empty.output
    declined = runner.invoke(main, ["cache", "clear"], input="n\n")
    assert declined.exit_code == 0 and "nothing removed" in declined.output and "Aborted" not in declined.output
    demo = runner.invoke(main, ["demo", "--tokens", "2", "--dtype", "float32"])
    assert demo.exit_code == 0 and "all checks passed (float32)" in demo.output
    assert {line.split()[2] for line in demo.output.splitlines() if line.startswith("tiny")} == {"2"}
    _tune_ok = runner.invoke(main, ["tune", "--shapes", str(_shapes(tmp_path, dict(TINY, tokens=[3]))),
                                    "--trials", "1"])
    assert _tune_ok.exit_code == 0
    exported = tmp_path / "x.json"
    assert runner.invoke(main, ["cache", "export", "-o", str(exported)]).exit_code == 0
    twice = runner.invoke(main, ["cache", "import", str(exported)])
    assert twice.exit_code == 0 and "0 new, 1 already there unchanged, 0 replaced" in twice.output
    bench = runner.invoke(main, ["bench", "--tokens", "2", "--providers", "eager", "--out", str(tmp_path)])
    assert bench.exit_code == 0 and "no plot on the CPU" in bench.output
    profile = subprocess.run([sys.executable, "-m", "autofuse.cli", "profile", "--mlp", "64,128", "--tokens", "4",
                              "--providers", "autofuse", "--out", str(tmp_path / "p")],
                             capture_output=True, text=True, timeout=300)
    assert profile.returncode == 0, profile.stderr
    assert "USDT" not in profile.stderr + profile.stdout


def test_readme_explains_before_it_uses_and_points_the_right_way():
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    readme = (root / "README.md").read_text()
    intro = readme[:readme.index("## Use")]
    for term in ("main job", "trials", "M bucket"):  # used in the intro: explained there
        assert term in intro, term
    assert "only where a CPU build of torch 2.13.0 is what pip finds" in intro
    assert ".venv/" in (root / ".gitignore").read_text().splitlines()
    commands = readme[readme.index("## Command line"):readme.index("## Layout")]
    bench = next(line for line in commands.splitlines() if "autofuse bench" in line)
    assert "below" in bench and readme.index("## Speed") > readme.index("## Command line")
    assert "--resume" not in readme  # resuming is the default; --fresh starts over


def test_cache_clear_counts_tuned_and_checked_keys_and_needs_an_answer_or_yes():
    import torch

    from autofuse.configs import Library
    from autofuse.key import Problem, current_environment
    from autofuse.store import CHECKED, Winner

    env = current_environment(torch.device("cpu"))
    for bucket, policy in ((1, "optuna"), (4, CHECKED), (16, CHECKED)):
        key = Problem("linear", 56, 40, bucket, torch.float32, "none").key(bucket, env)
        Store().put_winner(Winner(key, Library("eager"), 1.0, 1.0, policy=policy))
    no_input = CliRunner().invoke(main, ["cache", "clear"], input="")
    assert no_input.exit_code == 2 and "nothing removed; pass --yes to clear without asking" in no_input.output
    assert "Aborted" not in no_input.output and len(list(Store().winners())) == 3
    cleared = CliRunner().invoke(main, ["cache", "clear", "--yes"])
    assert cleared.exit_code == 0 and "removed 1 tuned key and 2 checked keys" in cleared.output


def test_a_rejected_import_creates_nothing(tmp_path):
    from autofuse.resources import user_cache_dir

    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "something else"}')
    result = CliRunner().invoke(main, ["cache", "import", str(bad)])
    assert result.exit_code == 2 and "not an autofuse config export" in result.output
    assert not user_cache_dir().exists()


def test_cache_ls_puts_the_users_keys_first_filters_and_shows_residual():
    import torch

    from autofuse.choose import lookup as resolve
    from autofuse.configs import Library
    from autofuse.key import Problem, current_environment
    from autofuse.store import Winner

    env = current_environment(torch.device("cpu"))
    for residual in (False, True):
        key = Problem("linear", 56, 40, 4, torch.float32, "none", False, residual).key(4, env)
        Store().put_winner(Winner(key, Library("eager"), 1.0, 1.0, policy="optuna"))
    resolve.invalidate()
    listed = CliRunner().invoke(main, ["cache", "ls"]).output.splitlines()
    rows = listed[1:]
    assert rows[0].endswith("user-cache") and rows[1].endswith("user-cache")  # before the shipped rows
    assert any("shipped:" in row for row in rows)
    assert {"res=0", "res=1"} <= {part for row in rows[:2] for part in row.split()}
    mine = CliRunner().invoke(main, ["cache", "ls", "--mine"]).output.splitlines()
    assert mine[1].startswith("showing 2 of them") and len(mine) == 4
    gated = CliRunner().invoke(main, ["cache", "ls", "--op", "gated_up"]).output.splitlines()[2:]
    assert gated and all(" gated_up " in row for row in gated)


def test_readme_says_what_the_code_does():
    from pathlib import Path

    from autofuse.choose import Source
    from autofuse.errors import AutofuseError
    from autofuse.shapes import parse_shapes

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    for source in Source:  # every value config_sources can report
        assert f"`{source.value}" in readme, source
    assert "plain_config_for" in readme
    with pytest.raises(AutofuseError) as e:
        parse_shapes({"mlps": [{"d_model": 8, "d_ff": 8}, {"d_model": 8, "d_ff": "x"}]}, "shapes.json")
    assert f"`{e.value}`" in readme  # the sample error is the real one
