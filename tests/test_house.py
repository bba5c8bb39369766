"""The product speaks of itself only: no development history (work periods, numbered calls or issues) in
the code, the templates, the tests (names included) or the documents a user reads."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
HISTORY = re.compile(r"\bsessions?\b|\bcall\s+\d+|\bissue\s*#?\d+|\bround\s+\d+", re.IGNORECASE)
PLACES = ["autofuse", "templates", "tests", "tools", "README.md", "CONTRIBUTING.md", "benchmarks/RESULTS.md",
          "cache/README.md", "docs"]


def _files():
    for place in PLACES:
        path = ROOT / place
        if path.is_file():
            yield path
        elif path.is_dir():
            yield from (p for p in sorted(path.rglob("*")) if p.is_file() and p.suffix in (".py", ".md", ".jinja")
                        and p.name != "test_house.py")  # the checker names what it looks for


def test_no_development_history_in_the_product():
    found = []
    for path in _files():
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if HISTORY.search(line) or HISTORY.search(path.name):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()[:100]}")
    assert not found, "\n".join(found[:40])


# The samples are joined at run time, so that this file holds none of the words it checks for.
@pytest.mark.parametrize("text", ["".join(parts) for parts in (("see the ninth ses", "sion"), ("H100 call ", "4"),
                                                               ("issue ", "16"), ("(issue ", "#7)"), ("round ", "2"))])
def test_the_check_sees_history(text):
    assert HISTORY.search(text)


def test_no_function_takes_more_than_eight_parameters():
    import ast

    over = []
    for path in sorted((ROOT / "autofuse").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                count = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) + bool(a.vararg) + bool(a.kwarg)
                if count > 8:
                    over.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({count})")
    assert not over, over


def test_benchmarks_are_a_handful_of_suites_whose_help_runs_on_a_cpu():
    import subprocess
    import sys

    code = [p for p in (ROOT / "benchmarks").rglob("*") if p.is_file() and p.suffix in (".py", ".sh")
            and "results" not in p.relative_to(ROOT / "benchmarks").parts]
    assert len(code) <= 12, sorted(p.name for p in code)
    suites = [p for p in code if p.suffix == ".py" and '__name__ == "__main__"' in p.read_text()]
    assert len(suites) >= 6
    # Started together: each imports torch (about 5 s on a CI machine), one after another most of a minute.
    running = [(suite, subprocess.Popen([sys.executable, str(suite), "--help"], stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True)) for suite in suites]
    try:
        for suite, process in running:
            stdout, stderr = process.communicate(timeout=180)
            assert process.returncode == 0 and "usage:" in stdout, (suite.name, stderr[-500:])
    finally:
        for _, process in running:
            process.kill()
