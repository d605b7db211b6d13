"""Reliability of the tuning spaces on a GPU: random conv shapes, each built with a random legal point of the space of
the strategy qcompile selects for it, run bit-exact on the GPU -- or refused at build time with a reason, and then
built with the generic kernel (the compiler's fallback for that layer) and run.

    python scripts/tune_reliability.py run --count 1000 --arch sm_90 [--seed 0] [--start I] [--jobs J] [-o results.json]
    python scripts/tune_reliability.py run ... --export DIR      # build only: measure DIR on a GPU host with
                                                                 # `python measure.py DIR -o DIR/results.json`
    python scripts/tune_reliability.py report results.json [--import DIR/results.json]
    python scripts/tune_reliability.py compact RUN.json [RUN.json ...] [--base OLD.json] -o docs/bench/X.json

The shapes (``random_specs``): batch 1-256 (log-uniform), H and W 1-64 (square or not), C and K 1-512 (odd ones
included; most a multiple of 16), kernels 1-7 (square or not), stride 1-3, padding 0 to the kernel's size, dilation
1-3, NHWC or HWNC (most HWNC batches a multiple of 8), 8-bit, 4-bit or mixed (8-bit activations, 4-bit weights: a
tenth), signed or unsigned, int32 outputs, a residual add on a third of them; tensors capped at 16 M elements and the reference at 8 G multiply-adds (the NumPy check runs on the host).
Every candidate goes through ``qcompile.tune``'s builder (``LocalBuilder``) and measuring code (``measure.supervise``:
fresh random inputs, poisoned outputs, the NumPy reference bit for bit), as ``qtune`` does.

Counts reported: shapes; by strategy; built with a legal point; refused with a reason (no legal point in the space,
or the builder's refusal) and their fallbacks; exact / mismatch / run_error of each kind. Exit status 0 when every
candidate that ran was exact, 1 otherwise.
"""
from __future__ import annotations

import argparse
import collections
import json
import math
import os
import random
import re
import sys
import time


def random_specs(count: int, seed: int, max_elems: int = 16 << 20, max_macs: float = 8e9) -> list:
    """``count`` random ConvSpecs (module docstring), reproducible from ``seed``."""
    from qcompile.schedules.spec import ConvSpec

    rng = random.Random(seed)
    out = []
    while len(out) < count:
        layout = "HWNC" if rng.random() < 0.3 else "NHWC"
        N = int(round(2 ** rng.uniform(0, 8)))
        if layout == "HWNC" and rng.random() < 0.8:
            N = max(8, N // 8 * 8)  # (most HWNC batches a multiple of 8, as the direct kernel takes them)
        H = rng.randint(1, 64)
        W = H if rng.random() < 0.7 else rng.randint(1, 64)
        C, K = (rng.choice([16 * rng.randint(1, 32)] * 3 + [2 ** rng.randint(0, 9), rng.randint(1, 512)])
                for _ in range(2))
        R = rng.randint(1, 7)
        S = R if rng.random() < 0.8 else rng.randint(1, 7)
        stride = rng.choice([1, 1, 1, 2, 2, 3])
        dil = 1 if rng.random() < 0.8 else rng.randint(2, 3)
        pads = tuple(rng.randint(0, k) for k in (R, S, R, S)) if rng.random() < 0.3 else \
            ((R - 1) * dil // 2, (S - 1) * dil // 2) * 2
        P = (H + pads[0] + pads[2] - dil * (R - 1) - 1) // stride + 1
        Q = (W + pads[1] + pads[3] - dil * (S - 1) - 1) // stride + 1
        if P < 1 or Q < 1:
            continue
        if N * H * W * C > max_elems or N * P * Q * K > max_elems or N * P * Q * K * C * R * S > max_macs:
            continue
        kind = rng.choice(["8"] * 9 + ["4"] * 9 + ["mixed"] * 2)
        signed = rng.random() < 0.5
        xb = 4 if kind == "4" else 8
        x_dtype = ("int" if signed else "uint") + str(xb)
        out_dtype = rng.choice([("int" if rng.random() < 0.5 else "uint") + str(xb)] * 5 + ["int32"])
        lo, hi = _range(out_dtype)
        zo = rng.randint(lo, hi) // 4 if out_dtype != "int32" else rng.randint(-100, 100)
        if rng.random() < 0.4 and out_dtype != "int32":
            lo = max(lo, zo)  # (a fused ReLU)
        spec = dict(N=N, H=H, W=W, C=C, K=K, R=R, S=S, stride=stride, padding=pads, dilation=dil,
                    layout=layout, x_dtype=x_dtype, w_bits=8 if kind == "8" else 4,
                    out_dtype=out_dtype, zo=zo, lo=lo, hi=hi, pad_value=rng.randint(*_range(x_dtype)))
        if rng.random() < 1 / 3 and out_dtype != "int32":
            res = ("int" if rng.random() < 0.5 else "uint") + str(xb)
            lo2, hi2 = _range(res)
            spec.update(has_residual=True, res_dtype=res, lo=_range(out_dtype)[0], hi=_range(out_dtype)[1],
                        zo2=rng.randint(lo2, hi2) // 4, lo2=lo2, hi2=hi2)
        out.append(ConvSpec(**spec))
    return out


def _range(dtype: str) -> tuple:
    return {"int8": (-128, 127), "uint8": (0, 255), "int4": (-8, 7), "uint4": (0, 15),
            "int32": (-(1 << 31), (1 << 31) - 1)}[dtype]


def plan_candidates(specs: list, arch: str, seed: int, sms: int | None = None) -> tuple:
    """(candidates, notes): per shape, the strategy ``select_strategy`` gives and a random legal point of its space
    (``KernelSpace.sample``); a shape whose strategy has no space or no legal point in 2,000 draws gets the fallback
    with the reason noted."""
    from qcompile.schedules import select_strategy
    from qcompile.schedules.space import SPACES
    from qcompile.schedules.tuning import tuning_key
    from qcompile.tune.common import Candidate

    rng = random.Random(seed + 1)
    cands, notes = [], []
    for i, spec in enumerate(specs):
        strategy = select_strategy(spec, arch)
        space = SPACES.get(strategy)
        key = tuning_key(spec)
        if space is None:
            cands.append(Candidate(key, spec, arch, "fallback", None))
            notes.append(dict(shape=i, strategy=strategy, point=None, why=None))
            continue
        kn = space.sample(rng, spec, arch, sms=sms)
        if kn is None:
            cands.append(Candidate(key, spec, arch, "fallback", None))
            notes.append(dict(shape=i, strategy=strategy, point=None, why="no legal point in 2000 draws"))
        else:
            cands.append(Candidate(key, spec, arch, strategy, kn))
            notes.append(dict(shape=i, strategy=strategy, point=space.to_dict(kn), why=None))
    return cands, notes


def build_all(cands: list, jobs: int, build_dir: str | None, log, timeout: float = 120.0) -> list:
    """Build every candidate; a refused one (``Built.error``) is built again as the fallback of its shape. Returns
    [(candidate Built, fallback Built or None)]."""
    from qcompile.tune.build import LocalBuilder
    from qcompile.tune.common import Candidate

    builder = LocalBuilder(jobs=jobs, build_dir=build_dir, target="cuda", timeout=timeout)
    t0 = time.time()
    built = builder.build(cands)
    log(f"built {len(built)} candidates in {time.time() - t0:.0f} s ({sum(b.error is not None for b in built)} "
        f"refused)")
    redo = [i for i, b in enumerate(built) if b.error is not None and cands[i].strategy != "fallback"]
    fb = {}
    if redo:
        t0 = time.time()
        again = builder.build([Candidate(cands[i].key, cands[i].spec, cands[i].arch, "fallback", None) for i in redo])
        fb = dict(zip(redo, again))
        log(f"built {len(redo)} fallbacks in {time.time() - t0:.0f} s")
    return [(b, fb.get(i)) for i, b in enumerate(built)]


def cmd_run(a) -> int:
    from qcompile.schedules.spec import arch_info

    log = lambda s: print(s, flush=True)
    t0 = time.time()
    specs = random_specs(a.count, a.seed)
    cands, notes = plan_candidates(specs, a.arch, a.seed, arch_info(a.arch).sms)
    cands, notes = cands[a.start:], notes[a.start:]
    log(f"{len(specs)} shapes, points drawn in {time.time() - t0:.1f} s; strategies: "
        + ", ".join(f"{k} {v}" for k, v in collections.Counter(c.strategy for c in cands).most_common()))
    pairs = build_all(cands, a.jobs, a.build_dir, log, a.build_timeout)
    ready = [b for pair in pairs for b in pair if b is not None and b.error is None and b.path]
    doc = dict(command="python scripts/tune_reliability.py " + " ".join(sys.argv[1:]), date=time.strftime("%Y-%m-%d"),
               arch=a.arch, count=a.count, start=a.start, seed=a.seed, host_build_s=round(time.time() - t0, 1),
               shapes=[])
    for (b, f), note in zip(pairs, notes):
        row = dict(note, spec=b.entry.get("spec") or _spec_dict(b.candidate.spec), id=b.entry.get("id"),
                   built=b.error is None, refused=b.error, build_s=round(b.build_s, 2))
        if f is not None:
            row.update(fallback_id=f.entry.get("id"), fallback_built=f.error is None, fallback_error=f.error)
        doc["shapes"].append(row)
    if a.export:
        from qcompile.tune.runners import export

        command = export(ready, a.export)
        out = a.output or os.path.join(a.export, "shapes.json")
        _write_json(out, doc)
        log(f"exported {len(ready)} kernels to {a.export}: measure them there with `{command}`, then "
            f"`python scripts/tune_reliability.py report {out} --import {a.export}/results.json`")
        return 0
    from qcompile.tune import measure as M
    from qcompile.tune.runners import _entries

    out = a.output or "reliability.json"
    _write_json(out, doc)  # (the shapes first; the measurements follow, rewritten after every candidate)
    partial = os.path.splitext(out)[0] + ".measure.json"
    t1 = time.time()
    with __import__("tempfile").TemporaryDirectory(prefix="qtune-rel-") as td:
        man = os.path.join(td, "manifest.json")
        with open(man, "w") as f:
            json.dump(dict(format=M.FORMAT, candidates=_entries(ready, absolute=True)), f)
        res = M.supervise(man, device="cuda", device_id=a.device_id, seed=a.seed, repeat=3, min_repeat_ms=1,
                          timeout=a.timeout, log=log if a.verbose else None, partial=partial)
    doc["measure"] = dict(device=res["device"], seed=res["seed"], results=res["results"],
                          seconds=round(time.time() - t1, 1))
    _write_json(out, doc)
    return report(doc, log)


def _spec_dict(spec) -> dict:
    import dataclasses

    return dataclasses.asdict(spec)


def _write_json(path: str, doc: dict) -> None:
    from qcompile.tune.measure import write_json

    write_json(path, doc)


def report(doc: dict, log=print) -> int:
    """The counts of a results document (module docstring); 0 when every candidate that ran was exact."""
    res = {r["id"]: r for r in (doc.get("measure") or {}).get("results", [])}
    c = collections.Counter()
    by_strategy = collections.Counter()
    bad = []
    for row in doc["shapes"]:
        by_strategy[row["strategy"]] += 1
        c["shapes"] += 1
        if row["point"] is None:
            c["no tunable point (fallback)" if row["why"] is None else "no legal point (fallback)"] += 1
        elif row["built"]:
            c["built with a legal point"] += 1
        else:
            c["refused by the builder (fallback)"] += 1
        first = "point" if row["point"] is not None else "fallback"
        for kind, rid in ((first, row.get("id") if row["built"] else None), ("fallback", row.get("fallback_id"))):
            if rid is None:
                continue
            r = res.get(rid)
            st = r["status"] if r else "not measured"
            c[f"{kind}: {st}"] += 1
            if r is not None and st != "ok":
                bad.append((row["shape"], kind, st, r.get("detail", "")))
        if row.get("fallback_id") is None and not row["built"]:
            c["fallback: not built"] += 1
            bad.append((row["shape"], "fallback", "build_error", row.get("fallback_error") or row.get("refused")))
    dev = ((doc.get("measure") or {}).get("device") or {}).get("name", "not measured")
    log(f"{len(doc['shapes'])} random conv shapes for {doc['arch']} (seed {doc['seed']}, shapes {doc.get('start', 0)} to "
        f"{doc.get('start', 0) + len(doc['shapes']) - 1}), measured on: {dev}")
    log("strategies: " + ", ".join(f"{k} {v}" for k, v in by_strategy.most_common()))
    for k in sorted(c):
        log(f"  {k:<40} {c[k]}")
    refusals = collections.Counter((r.get("refused") or "").split(":")[0][:80] for r in doc["shapes"]
                                   if r["point"] is not None and not r["built"])
    for why, n in refusals.most_common(8):
        log(f"  refused x{n}: {why}")
    for shape, kind, st, detail in bad[:20]:
        log(f"  NOT EXACT shape {shape} ({kind}): {st} {detail[:160]}")
    return 0 if not bad else 1


def cmd_report(a) -> int:
    with open(a.results) as f:
        doc = json.load(f)
    if a.import_results:
        with open(a.import_results) as f:
            m = json.load(f)
        doc["measure"] = dict(device=m.get("device"), seed=m.get("seed"), results=m["results"])
    return report(doc)


FIELDS = ("shape, key (tuning_key), strategy, point (knobs or null: fallback), refused (build error), status (of the "
          "point's kernel, or the fallback's where no point), fallback_status (after a refusal); null status: built, "
          "not measured")


def compact(runs: list, base: dict | None = None) -> dict:
    """One small document of one or more ``run`` results (each shape a row of ``FIELDS``; the device and date of
    the measurements, the runs' commands), over the rows of ``base`` (an earlier compact document) where a run does
    not cover a shape."""
    from qcompile.schedules.spec import ConvSpec
    from qcompile.schedules.tuning import tuning_key

    rows = {r["shape"]: r for r in (base or {}).get("shapes", [])}
    covered = {r["shape"] for doc in runs for r in doc["shapes"]}

    def stands(command: str) -> bool:  # (a base command whose shapes the runs do not all cover again)
        m = re.search(r"\(shapes (\d+)-(\d+)", command)
        return m is None or not set(range(int(m[1]), int(m[2]) + 1)) <= covered

    commands = [c for c in (base or {}).get("commands", []) if stands(c)]
    timings = [t for t in (base or {}).get("timings", []) if stands(t["command"])]
    device = (base or {}).get("device")
    for doc in runs:
        res = {r["id"]: r for r in (doc.get("measure") or {}).get("results", [])}
        status = lambda rid: (res.get(rid) or {}).get("status") if rid else None  # noqa: E731
        spec = lambda d: ConvSpec(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})  # noqa: E731
        for r in doc["shapes"]:
            key = tuning_key(spec(r["spec"]))
            if r["shape"] in rows and rows[r["shape"]]["key"] != key:
                raise SystemExit(f"shape {r['shape']}: {key} here, {rows[r['shape']]['key']} in the base document "
                                 "(runs of another --seed or --count?)")
            rows[r["shape"]] = dict(shape=r["shape"], key=key, strategy=r["strategy"],
                                    point=r["point"], refused=r["refused"],
                                    status=status(r.get("id") if r.get("built") else None) if r["point"] is not None
                                    else status(r.get("id") or r.get("fallback_id")),
                                    fallback_status=status(r.get("fallback_id")) if r["point"] is not None else None)
        shapes = [r["shape"] for r in doc["shapes"]]
        commands.append(f"{doc['command']}  (shapes {min(shapes)}-{max(shapes)})")
        timings.append(dict(command=commands[-1], host_build_s=doc.get("host_build_s"),
                            measure_s=(doc.get("measure") or {}).get("seconds")))
        device = ((doc.get("measure") or {}).get("device") or {}).get("name") or device
    return dict(device=device, date=max([d["date"] for d in runs] + ([base["date"]] if base else [])),
                commands=commands, timings=timings, fields=FIELDS, shapes=[rows[k] for k in sorted(rows)])


def cmd_compact(a) -> int:
    runs = []
    for f in a.runs:
        with open(f) as fh:
            runs.append(json.load(fh))
    base = None
    if a.base:
        with open(a.base) as fh:
            base = json.load(fh)
    doc = compact(runs, base)
    with open(a.output, "w") as fh:
        fh.write("{" + ",\n".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in doc.items() if k != "shapes")
                 + ',\n"shapes": [\n' + ",\n".join(json.dumps(r) for r in doc["shapes"]) + "\n]}\n")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="draw, build and (with a GPU here) measure")
    r.add_argument("--count", type=int, default=1000)
    r.add_argument("--arch", default="sm_90")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--start", type=int, default=0, help="run the shapes from this index on (default 0)")
    r.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    r.add_argument("--build-timeout", type=float, default=120.0, help="seconds one build may take (default 120)")
    r.add_argument("--build-dir", help="keep the built kernels here (default: a temporary folder)")
    r.add_argument("--export", metavar="DIR", help="build only: write a measure.py batch to DIR")
    r.add_argument("--device-id", type=int, default=0)
    r.add_argument("--timeout", type=float, default=60.0, help="seconds one candidate may run (default 60)")
    r.add_argument("-o", "--output", help="results JSON (default reliability.json; with --export DIR/shapes.json)")
    r.add_argument("-v", "--verbose", action="store_true", help="one line per measured candidate")
    p = sub.add_parser("report", help="the counts of a results file")
    p.add_argument("results")
    p.add_argument("--import", dest="import_results", help="measure.py's results of an exported batch")
    c = sub.add_parser("compact", help="one small document of run results (the docs' file)")
    c.add_argument("runs", nargs="+")
    c.add_argument("--base", help="an earlier compact document: its rows stand where the runs do not cover a shape")
    c.add_argument("-o", "--output", required=True)
    a = ap.parse_args(argv)
    if a.cmd == "compact":
        return cmd_compact(a)
    if a.cmd == "run" and (a.count < 1 or a.jobs < 1 or not 0 <= a.start < a.count or not math.isfinite(a.timeout)
                           or a.timeout <= 0 or not a.build_timeout > 0):
        ap.error("--count and --jobs must be positive, 0 <= --start < --count, the timeouts above 0")
    return cmd_run(a) if a.cmd == "run" else cmd_report(a)


if __name__ == "__main__":
    sys.exit(main())
