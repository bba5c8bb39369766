"""tools/migrate_shipped.py: a shipped record is carried to today's template hash where its op's programs are
unchanged, or where the only variants whose programs changed do not apply at its key; the others are listed (and
dropped with --drop-stale)."""

import json
import shutil
import sys
from pathlib import Path

from autofuse import ops
from autofuse.render import template_hash
from autofuse.resources import templates_dir

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import migrate_shipped  # noqa: E402 - a tool, not a package module

OLD = "0123456789abcdef"


def _record(op: str, m_bucket: int) -> dict:
    n, k = (2048, 8192) if op == "down" else (8192, 2048)
    activation = "none" if op == "down" else "silu"
    return {"key": {"op": op, "n": n, "k": k, "m_bucket": m_bucket, "dtype": "bfloat16", "activation": activation,
                    "bias": False, "residual": False, "gpu": "NVIDIA H100 80GB HBM3", "capability": "9.0",
                    "triton": "3.6.0", "cuda": "13.0", "template_hash": OLD},
            "config": {"block_m": 16, "block_n": 64, "block_k": 128, "group_m": 1, "num_warps": 4, "num_stages": 3,
                       "variant": "tile"}, "time_ms": 0.05, "trials": 30}


def test_only_records_where_a_changed_variant_applies_are_left_for_a_re_tune(tmp_path, capsys):
    # The old templates: today's, with the GEMV's one-row loop written another way (a different program).
    old = tmp_path / "templates"
    shutil.copytree(templates_dir(), old)
    gemv = old / "linear_gemv.py.jinja"
    text = gemv.read_text()
    assert "acc += x * w\n" in text
    gemv.write_text(text.replace("acc += x * w\n", "acc = acc + x * w\n", 1))
    records = [_record("down", 1), _record("down", 16), _record("gated_pairs", 1)]
    path = tmp_path / "shipped.json"
    path.write_text(json.dumps({"records": records}))
    old_hashes = {spec.name: OLD for spec in ops.specs()}

    assert migrate_shipped._migrate(old, old_hashes, "OLD", [str(path)], drop_stale=True) == 0

    kept = {(r["key"]["op"], r["key"]["m_bucket"]): r["key"]["template_hash"]
            for r in json.loads(path.read_text())["records"]}
    # The down projection's GEMV changed: it applies at M = 1 (left, dropped), not at M = 16 (carried); gated_pairs
    # has no GEMV, its programs are unchanged (carried).
    assert kept == {("down", 16): template_hash(ops.get("down")),
                    ("gated_pairs", 1): template_hash(ops.get("gated_pairs"))}
    printed = capsys.readouterr().out
    assert "down        variants whose programs changed: gemv" in printed
    assert "left for a re-tune: down n=2048 k=8192 M=1 bfloat16" in printed
    assert "2 records carried to today's templates, 1 left for a re-tune (dropped), of 3" in printed
