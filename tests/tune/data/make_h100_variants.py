"""Rebuild ``h100_variants.jsonl`` -- the cost model's committed measurements -- from the repository's history.

The hand-run tuning rounds (NVIDIA H100 80GB HBM3, 2026-11) wrote one results file per round,
``docs/bench/tune_*_h100.json``, with every candidate's knobs and median time per key; the files left the tree in
commit d846c04 ("history left to git") and stay in git. This script reads each file as committed
when it was added and writes every measured candidate as a tuning-log record (``schedules.tuning.make_record``),
knobs given only where they differ from their defaults, plus ``round`` (the file's stem: times are comparable within
one round, where the candidates were interleaved, not across rounds, whose kernels changed). A candidate whose knobs
no longer parse (a value outside today's space, or not valid together) is left out; one that ran but differed from
the reference is written with status "mismatch". The rounds hold about 31,000 candidates (10 MB as records); the
file keeps a sample of whole (round, key) groups of at least ``MIN_GROUP`` candidates, at most ``PER_KEY`` groups
per key (the most shapes for the size), chosen in the order of a hash of (round, key) -- the same sample every
time -- up to ``BUDGET`` records per strategy.

    python tests/tune/data/make_h100_variants.py      # from the repository root (needs its git history)
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
import subprocess
import sys

from qcompile.schedules import tuning as TU

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[2]
OUT = HERE / "h100_variants.jsonl"
H100, SMS = "NVIDIA H100 80GB HBM3", 132
MIN_GROUP, PER_KEY = 5, 2
BUDGET = {"implicit_gemm": 2600, "implicit_gemm_t": 300, "direct_halo": 120}


def _git(*args) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout


def _strategy(key: str, variant: str, knobs) -> str | None:
    if isinstance(knobs, dict) and "BM" in knobs or knobs is None and not variant.startswith(("kt_", "halo_")):
        return "direct_hwnc" if key.startswith("HWNC") else "implicit_gemm"
    if isinstance(knobs, dict) and "bn" in knobs or variant.startswith("kt_"):
        return "implicit_gemm_t"
    if isinstance(knobs, dict) and "th" in knobs or variant.startswith("halo_"):
        return "direct_halo"
    return None


def _sparse(kn) -> dict:
    base = type(kn)()
    return {f.name: getattr(kn, f.name) for f in dataclasses.fields(kn) if getattr(kn, f.name) != getattr(base, f.name)}


def main() -> int:
    files = sorted({ln for ln in _git("log", "--all", "--name-only", "--format=").splitlines()
                    if ln.startswith("docs/bench/tune_") and ln.endswith(".json")})
    groups, seen = {}, set()
    for f in files:
        commit = _git("log", "--all", "--format=%h", "--diff-filter=A", "-1", "--", f).strip()
        data = json.loads(_git("show", f"{commit}:{f}"))
        rnd = pathlib.Path(f).stem
        for row in data.get("tune") or []:
            key = row.get("key")
            if not isinstance(key, str):
                continue
            for v in row.get("variants", []):
                strategy = _strategy(key, v.get("variant", ""), v.get("knobs"))
                if strategy is None or v.get("knobs") is None and not v.get("is_default") and strategy == "implicit_gemm":
                    continue
                kn = TU.knobs_from_dict(v.get("knobs") or {}, strategy)
                ok, ms = bool(v.get("ok")), v.get("ms")
                if kn is None or (ok and not ms):
                    continue
                ident = (rnd, key, strategy, json.dumps(TU.knobs_to_dict(kn), sort_keys=True))
                if ident in seen:
                    continue
                seen.add(ident)
                rec = TU.make_record("sm_90", H100, SMS, key, strategy, kn, "ok" if ok else "mismatch",
                                     ms if ok else None, None, round=rnd)
                rec["knobs"] = _sparse(kn)
                del rec["default_ms"]
                groups.setdefault((strategy, rnd, key), []).append(TU.format_record(rec))
    lines, per_key, used = [], {}, {s: 0 for s in BUDGET}
    for (strategy, rnd, key) in sorted(groups, key=lambda g: hashlib.sha1("|".join(g).encode()).hexdigest()):
        grp = groups[(strategy, rnd, key)]
        if (len(grp) < MIN_GROUP or per_key.get((strategy, key), 0) >= PER_KEY
                or used[strategy] + len(grp) > BUDGET[strategy]):
            continue
        per_key[(strategy, key)] = per_key.get((strategy, key), 0) + 1
        used[strategy] += len(grp)
        lines += grp
    OUT.write_text("".join(ln + "\n" for ln in lines))
    print(f"wrote {OUT} ({len(lines)} of {sum(map(len, groups.values()))} records from {len(files)} rounds: "
          f"{', '.join(f'{n} {s}' for s, n in used.items())})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
