"""Carry shipped config files across a template change that does not change any kernel's program.

    python tools/migrate_shipped.py OLD_REV cache/*.json [--drop-stale]

Checks OLD_REV out into a temporary worktree and asks its own code for each op's template hash (the
hash its records carry). For every op, renders every kernel variant from OLD_REV's templates (with that
revision's variables) and from today's, and compares the two sources' Python ASTs (comments,
formatting and line numbers do not enter an AST; everything Triton compiles does). Only the programs a GPU
compiles are compared: shipped files hold GPU records, and the interpreter's programs (operands upcast to
float32) never run one. A record's template
hash is rewritten from OLD_REV's hash to today's where all of its op's variants are identical, or where
every variant that changed (or is new) does not apply at the record's key (variants.Variant.applies: the
GEMV variant, say, only at decode's smallest M): there the search covered the same programs. Each file's
checksum is recomputed; the records left behind need a re-tune on the GPU (they are dropped from the file
with --drop-stale, and listed).
"""

from __future__ import annotations

import ast
import itertools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import jinja2

from autofuse import ops
from autofuse import variants as variants_registry
from autofuse.configfile import _checksum, template_hashes
from autofuse.key import TuningKey
from autofuse.render import KernelSpec, entry_template, render, template_hash, template_variables

_OLD_HASHES = ("import json\nfrom autofuse import ops\nfrom autofuse.render import template_hash\n"
               "print(json.dumps({s.name: template_hash(s) for s in ops.specs()}))\n")


def _variants(spec):
    for act, bias, even_k, precision in itertools.product(
            spec.activations, (False, True), (False, True), (None, "ieee", "tf32")):
        for residual, variant in itertools.product((False, True), variants_registry.of(spec)):
            if spec.variants_allowed(residual, variant.name) is None and not (bias and spec.name == "gated_bwd"):
                yield KernelSpec(spec, act, bias, residual, even_k, precision, False, variant.name)


def _old_source(env: jinja2.Environment, k: KernelSpec) -> str:
    template = env.get_template(entry_template(k.op, variants_registry.get(k.variant)))
    # What render() passes today (the signature lines too, for revisions whose templates write it with the macro).
    return template.render(**template_variables(k))


def _old_revision(old_rev: str) -> tuple[Path, dict[str, str]]:
    """(OLD_REV's templates folder, its template hash per op), from a temporary worktree of it."""
    tree = Path(tempfile.mkdtemp()) / "old"
    subprocess.run(["git", "worktree", "add", "--detach", str(tree), old_rev], check=True, capture_output=True)
    env = dict(os.environ, PYTHONPATH=str(tree), TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", _OLD_HASHES], cwd=tree, env=env, capture_output=True, text=True,
                          check=True)
    return tree, json.loads(done.stdout)


def main(old_rev: str, files: list[str], drop_stale: bool = False) -> int:
    tree, old_hashes = _old_revision(old_rev)
    try:
        return _migrate(tree / "templates", old_hashes, old_rev, files, drop_stale)
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(tree)], check=True)


def _applies_at(variant: variants_registry.Variant, record_key: dict) -> bool:
    """Whether `variant` applies at a record's key (on the GPU the key names)."""
    key = TuningKey.from_dict(record_key)
    major, minor = (int(part) for part in key.capability.split("."))
    device = variants_registry.Device(interpret=False, capability=(major, minor))
    return variant.applies(device, variants_registry.Shape(key.m_bucket, key.n, key.k, key.torch_dtype))


def _migrate(old_dir: Path, old_hashes: dict[str, str], old_rev: str, files: list[str], drop_stale: bool) -> int:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(old_dir)), undefined=jinja2.StrictUndefined,
                             trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)
    changed: dict[tuple[str, str], tuple[str, list[variants_registry.Variant]]] = {}
    for spec in ops.specs():
        if spec.name not in old_hashes:
            print(f"{spec.name:<11} new since {old_rev}: no records to carry")
            continue
        # A variant whose template OLD_REV lacks is new since then: no record of OLD_REV's can name it.
        kernels = [k for k in _variants(spec)
                   if (old_dir / entry_template(k.op, variants_registry.get(k.variant))).is_file()]
        added = sorted({v.name for v in variants_registry.of(spec)} - {k.variant for k in kernels})
        differ = sorted({k.variant for k in kernels
                         if ast.dump(ast.parse(_old_source(env, k))) != ast.dump(ast.parse(render(k)))})
        old, new = old_hashes[spec.name], template_hash(spec)
        note = f"; variants new since {old_rev}: {', '.join(added)}" if added else ""
        print(f"{spec.name:<11} variants whose programs changed: {', '.join(differ) or 'none'}{note}; "
              f"hash {old} -> {new}")
        changed[(spec.name, old)] = (new, [variants_registry.get(name) for name in (*differ, *added)])
    for name in files:
        doc = json.loads(Path(name).read_text())
        moved, kept, stale = 0, [], []
        for record in doc["records"]:
            key = record["key"]
            found = changed.get((key["op"], key["template_hash"]))
            if found is not None:
                new, kinds = found
                if any(_applies_at(variant, key) for variant in kinds):
                    stale.append(record)
                    if drop_stale:
                        continue
                else:
                    key["template_hash"] = new
                    moved += 1
            kept.append(record)
        for record in stale:
            key = record["key"]
            print(f"  left for a re-tune: {key['op']} n={key['n']} k={key['k']} M={key['m_bucket']} {key['dtype']}")
        total, doc["records"] = len(doc["records"]), kept
        doc["template_hashes"] = template_hashes((ops.get(r["key"]["op"]).template, r["key"]["template_hash"])
                                                 for r in kept)
        doc["sha256"] = _checksum(kept)
        Path(name).write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
        print(f"{name}: {moved} records carried to today's templates, {len(stale)} left for a re-tune"
              f"{' (dropped)' if drop_stale else ''}, of {total}")
    return 0


if __name__ == "__main__":
    arguments = [a for a in sys.argv[1:] if a != "--drop-stale"]
    sys.exit(main(arguments[0], arguments[1:], drop_stale="--drop-stale" in sys.argv[1:]))
