"""XGBoost-ranked search against random sampling, replayed over measured pools of candidates (docs/TUNING.md, b).

Two steps:

1. ``pool`` (on a GPU host with the compiler): ``--per-task`` random legal points (the default knobs first) of the
   ``--tasks`` largest implicit-GEMM tasks of a model (by the roofline estimate of their share; or the tasks of
   ``--keys FILE`` among the models' tasks at the ``--batch`` sizes), built in parallel and
   measured on this host's GPU by qtune's local runner (every candidate checked bit for bit against the NumPy
   reference, then timed); written as tuning-log records.

       python scripts/tune_ablation.py pool r50_int8.onnx --arch sm_90 --batch 256 --tasks 6 --part 0/2 \\
           --device-id 0 --per-task 100 --jobs 32 -o pool0.jsonl

2. ``replay`` (anywhere): for every task of the pool files and every seed, the candidates are "measured" from the
   pool in rounds of ``--per-round``, the default first, two ways:

   * ``model``: qtune's ranking without start points (``qtune --no-configs``; ``search.propose``'s rule) -- an
     XGBoost ``CostModel`` trained on what has been measured so far ranks the rest of the pool, the best
     ``per_round - ceil(eps * per_round)`` are taken and the rest of the round at random; ``--pretrained FILE``: the
     model is first trained on qtune's packaged measurements (``tuning_logs/sm_90.train.jsonl.gz``, what ``qtune``
     trains on by default) less every record of the task's conv geometry (at any batch size, bit width or
     epilogue); ``--warm``: on the other tasks' pools, less those of the task's conv geometry and the points the
     task's own pool holds (what a run has measured of its other tasks); given both, the pools count twice (the
     packaged file holds them);
   * ``random``: the pool in random order.

   Reported per task (a task: one key measured on one GPU): trials (the default included) until the best time so
   far is within ``--level`` of the pool's best throughput (``ms <= best / level``), counted in whole rounds as
   qtune builds and measures them and (``candidates``) candidate by candidate; median and mean over the seeds, and
   how often the model needs at most half the random trials. Tasks replay in parallel processes (``--jobs``).

       python scripts/tune_ablation.py replay pool0.jsonl pool1.jsonl --seeds 200 -o ablation.json

The replay ranks the whole measured pool where qtune ranks a pool of fresh samples and neighbours of its best
(``search.propose``): the model's choice is among the same candidates as random's, so the comparison isolates the
ranking. Each task's pool is drawn from its own random stream (seed, task key), as qtune's proposals are.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import shlex
import sys
import time
import zlib


# ---- 1. pool --------------------------------------------------------------------------------------------------------
def pool(a) -> int:
    import numpy as np

    from qcompile.cli import _import_driver_without_torch

    _import_driver_without_torch()
    from qcompile.schedules.space import SPACES
    from qcompile.schedules.tuning import format_record, make_record
    from qcompile.tune.build import LocalBuilder
    from qcompile.tune.common import OK, Candidate
    from qcompile.tune.runners import LocalRunner
    from qcompile.tune.tasks import extract_tasks, set_shares

    t0 = time.time()
    found: dict = {}
    for model in a.models:
        got = extract_tasks(model, a.arch, tuple(a.batch), "NHWC", None, None, None, None, (), None, lambda s: None)
        set_shares(got, measured=False)
        for t in got:
            found.setdefault(t.key, t)
    if a.keys:  # (the tasks named, in the file's order)
        want = [ln.split()[0] for ln in open(a.keys) if ln.strip() and not ln.startswith("#")]
        missing = [k for k in want if k not in found]
        if missing:
            raise SystemExit(f"{a.keys}: no task of the models at batch {a.batch} has key {missing[0]}")
        tasks = [found[k] for k in want]
    else:
        tasks = sorted((t for t in found.values() if t.strategy == "implicit_gemm"), key=lambda t: -t.share)[:a.tasks]
    k, n = (int(x) for x in a.part.split("/"))
    mine = tasks[k::n]
    print(f"{len(tasks)} tasks, this part {len(mine)}: " + ", ".join(f"{t.key} ({100 * t.share:.1f}%)" for t in mine)
          + f" [{time.time() - t0:.0f} s]", flush=True)
    cands = []
    for t in mine:
        sp = SPACES[t.strategy]
        rng = np.random.default_rng((a.seed, zlib.crc32(t.key.encode())))  # (each task its own draws, as qtune's)
        seen, pts = set(), []
        for i in range(20 * a.per_task):
            kn = sp.default(t.spec, a.arch) if i == 0 else sp.sample(rng, t.spec, a.arch)
            if kn is None:
                continue
            k_id = kid(sp, t.spec, a.arch, kn)
            if k_id not in seen:
                seen.add(k_id)
                pts.append(kn)
            if len(pts) >= a.per_task:
                break
        cands += [Candidate(t.key, t.spec, a.arch, t.strategy, kn) for kn in pts]
    t1 = time.time()
    built = LocalBuilder(jobs=a.jobs, build_dir=a.build_dir, timeout=a.build_timeout).build(cands)
    print(f"built {sum(1 for b in built if b.error is None and b.path)} of {len(cands)} candidates in "
          f"{time.time() - t1:.0f} s", flush=True)
    if a.build_only:  # (the kernels are in the kernel cache now: a later run of the same pool builds faster)
        return 0
    runner = LocalRunner("cuda", a.device_id, seed=a.seed, log=None if a.quiet else (lambda s: print("  " + s, flush=True)))
    dev = runner.device()
    status: dict = {}
    open(a.output, "w").close()
    for t in mine:  # (one task at a time, its records appended when it is measured: a run cut short keeps them)
        mb = [b for b in built if b.candidate.key == t.key]
        ok = [b for b in mb if b.error is None and b.path]
        t2 = time.time()
        got = runner.measure(ok)
        of = {id(b): m for b, m in zip(ok, got)}  # (the runner answers in order)
        dflt = got[0].ms if got and got[0].status == OK and ok and ok[0] is mb[0] else None
        lines = []
        for j, b in enumerate(mb):
            m = of.get(id(b))
            st, ms = (m.status, m.ms) if m is not None else ("build_error", None)
            status[st] = status.get(st, 0) + 1
            c = b.candidate
            rec = make_record(c.arch, dev.name, dev.sms, c.key, c.strategy, c.knobs, st, ms if st == OK else None,
                              dflt, variant="default" if j == 0 else "pool", date=datetime.date.today().isoformat(), layers=t.weight,
                              est_share=round(t.share, 4), build_s=round(b.build_s, 2))
            if st != OK:
                rec["detail"] = ((m.detail if m is not None else b.error) or "")[:300]
            lines.append(format_record(rec) + "\n")
        with open(a.output, "a") as f:
            f.writelines(lines)
        print(f"{t.key}: {len(got)} measured on {dev.name} in {time.time() - t2:.0f} s", flush=True)
    print(f"wrote {a.output}: {status} [{time.time() - t0:.0f} s in all]", flush=True)
    return 0


# ---- 2. replay ------------------------------------------------------------------------------------------------------
def kid(space, spec, arch: str, knobs) -> str:
    """A point's identity: its effective knobs (``TaskState.knobs_id``: two points of one kernel are one)."""
    return space.point_id(spec, arch, knobs)


def _same_point(space, spec, r, own: set) -> bool:
    """Whether record ``r`` (another task's) is one of the points in ``own`` (this task's ids) for this task's shape;
    a point this shape does not take is not."""
    try:
        return r.strategy == space.strategy and kid(space, spec, r.arch, r.knobs) in own
    except Exception:  # noqa: BLE001  (knobs the shape's space cannot normalise: not one of its points)
        return False


def _conv(key: str) -> str:
    """A task key's conv geometry: the key without its batch size, bit widths and residual flag (the same conv at any
    batch size, precision or epilogue)."""
    return "|".join(f for f in key.split("|") if not re.fullmatch(r"N\d+|[xw]\d+|res", f))


def trials_to_level(order_fn, ms: list, target: float) -> int:
    """Candidates measured (in the order ``order_fn`` yields indices) until one has ``ms <= target``."""
    for i, idx in enumerate(order_fn(), 1):
        if ms[idx] <= target:
            return i
    return len(ms) + 1  # (not reached: cannot happen when the pool's best is in it)


def whole_rounds(trials: int, per_round: int) -> int:
    """``trials`` counted as qtune spends them: the default alone, then whole rounds of ``per_round`` (a round is
    built and measured together, so a hit at its second candidate costs the round)."""
    return 1 + per_round * math.ceil((trials - 1) / per_round)


def replay_task(space, spec, arch: str, knobs: list, ms: list, sms, seed: int, per_round: int, eps: float,
                level: float, warm=None):
    """(model trials, random trials) for one task's pool (index 0: the default) and one seed. ``warm``: records of
    other tasks, (space, spec, knobs, ms, group) tuples, trained on first."""
    import numpy as np

    from qcompile.tune.cost_model import CostModel

    target = min(ms) / level
    n = len(ms)
    rng = np.random.default_rng(seed)

    def random_order():
        yield 0
        yield from (1 + int(i) for i in rng.permutation(n - 1))

    def model_order():
        model = CostModel(seed=seed)
        for sp, sc, kn, t, g in warm or ():
            model.add(sp, sc, arch, kn, t, g, sms)
        model.add(space, spec, arch, knobs[0], ms[0], "task", sms)
        yield 0
        rest = list(range(1, n))
        r = np.random.default_rng((seed, 1))
        while rest:
            model.fit()
            order = [rest[int(i)] for i in r.permutation(len(rest))]  # (ties and an untrained model: random order)
            scores = model.score(space, spec, arch, [knobs[i] for i in order], sms)
            ranked = [order[i] for i in np.argsort(-np.asarray(scores), kind="stable")]
            n_eps = min(len(ranked), math.ceil(eps * per_round)) if eps > 0 else 0
            take = ranked[:max(0, per_round - n_eps)]
            others = ranked[max(0, per_round - n_eps):]
            take += [others[int(i)] for i in r.permutation(len(others))[:per_round - len(take)]]
            for i in take:
                rest.remove(i)
                model.add(space, spec, arch, knobs[i], ms[i], "task", sms)
                yield i

    return trials_to_level(model_order, ms, target), trials_to_level(random_order, ms, target)


def _replay_one(job):
    """One task's replay over every seed (a process of ``--jobs``): the trials, candidate by candidate, of the
    model's order and of random order per seed."""
    from qcompile.cli import _import_driver_without_torch

    _import_driver_without_torch()
    from qcompile.schedules.space import SPACES
    from qcompile.schedules.tuning import spec_from_key

    key, strategy, arch, sms, knobs, ms, warm, seeds, per_round, eps, level = job
    warm = [(SPACES[st], spec_from_key(k), kn, t, g) for st, k, kn, t, g in warm] if warm is not None else None
    return [replay_task(SPACES[strategy], spec_from_key(key), arch, knobs, ms, sms, s, per_round, eps, level, warm)
            for s in range(seeds)]


def _stats(pairs) -> dict:
    import numpy as np

    m, rnd = np.array([x for x, _ in pairs]), np.array([y for _, y in pairs])
    return dict(model_median=float(np.median(m)), model_mean=round(float(m.mean()), 2),
                random_median=float(np.median(rnd)), random_mean=round(float(rnd.mean()), 2),
                ratio_of_means=round(float(m.mean() / rnd.mean()), 3),
                model_at_most_half=round(float(np.mean(m <= rnd / 2)), 3))


def replay(a) -> int:
    from concurrent.futures import ProcessPoolExecutor

    from qcompile.cli import _import_driver_without_torch

    _import_driver_without_torch()
    from qcompile.schedules.space import SPACES
    from qcompile.schedules.tuning import read_log, spec_from_key

    recs = []
    for p in a.pools:
        recs += read_log(p)
    tasks: dict = {}
    for r in recs:  # (a task: one key measured on one GPU)
        tasks.setdefault((r.device, r.key), []).append(r)
    out = dict(date=datetime.date.today().isoformat(), command="python scripts/tune_ablation.py replay "
               + " ".join(map(shlex.quote, sys.argv[2:] if a.argv is None else a.argv)),
               level=a.level, per_round=a.per_round, eps=a.eps, seeds=a.seeds, warm=a.warm,
               pretrained=a.pretrained, tasks=[])
    ok_of = {t: [r for r in rs if r.ok and r.ms] for t, rs in tasks.items()}
    train = read_log(a.pretrained) if a.pretrained else []
    jobs, rows = [], []
    for (device, key), rs in tasks.items():
        ok = ok_of[(device, key)]
        space = SPACES.get(rs[0].strategy)
        spec = spec_from_key(key)
        if (space is None or len(ok) < 2 or ok[0].knobs != rs[0].knobs
                or kid(space, spec, rs[0].arch, rs[0].knobs) != kid(space, spec, rs[0].arch,
                                                                     space.default(spec, rs[0].arch))):
            print(f"{device} {key}: skipped ({len(ok)} OK records, or its first record is not the default, OK)",
                  flush=True)
            continue
        warm = None
        if a.warm:  # (the other pools, less those of this conv's geometry and the points this task's pool holds)
            own = {kid(space, spec, r.arch, r.knobs) for r in rs}  # (another pool's point as this shape builds it)
            warm = [(r.strategy, t[1], r.knobs, r.ms, t) for t, o in ok_of.items() if _conv(t[1]) != _conv(key)
                    for r in o if r.strategy in SPACES and not _same_point(space, spec, r, own)]
        if a.pretrained:  # (the packaged training measurements, less every record of this conv's geometry)
            warm = (warm or []) + [(r.strategy, r.key, r.knobs, r.ms, ("train", r.device, r.key)) for r in train
                                   if r.ok and r.ms and r.strategy in SPACES and _conv(r.key) != _conv(key)]
        ms = [r.ms for r in ok]
        jobs.append((key, rs[0].strategy, ok[0].arch, ok[0].sms, [r.knobs for r in ok], ms, warm, a.seeds,
                     a.per_round, a.eps, a.level))
        target = min(ms) / a.level
        rows.append(dict(key=key, device=device, pool=len(rs), ok=len(ok), not_ok=len(rs) - len(ok),
                         default_ms=ms[0], best_ms=min(ms), within_level=int(sum(t <= target for t in ms))))
    with ProcessPoolExecutor(max(1, a.jobs)) as ex:
        results = list(ex.map(_replay_one, jobs))
    for row, res in zip(rows, results):
        row.update(_stats([(whole_rounds(x, a.per_round), whole_rounds(y, a.per_round)) for x, y in res]))
        row["candidates"] = _stats(res)
        out["tasks"].append(row)
        print(f"{row['device']} {row['key']}: pool {row['pool']} ({row['ok']} OK, {row['within_level']} within "
              f"{a.level:.0%} of the best {row['best_ms']} ms, default {row['default_ms']} ms); trials to reach it "
              f"(whole rounds), median / mean over {a.seeds} seeds: model {row['model_median']:g} / "
              f"{row['model_mean']}, random {row['random_median']:g} / {row['random_mean']}; model <= half of "
              f"random in {100 * row['model_at_most_half']:.0f}% of seeds", flush=True)
    # (a task whose default already reaches the level says nothing about the search: left out of the sums)
    searched = [r for r in out["tasks"] if r["default_ms"] > r["best_ms"] / a.level]
    if searched:
        out["searched_tasks"] = len(searched)
        for name, get in (("rounds", lambda r: r), ("candidates", lambda r: r["candidates"])):
            mm = sum(get(r)["model_mean"] for r in searched)
            rm = sum(get(r)["random_mean"] for r in searched)
            out[name] = dict(sum_model_mean=round(mm, 2), sum_random_mean=round(rm, 2), ratio=round(mm / rm, 3))
            print(f"{len(searched)} tasks whose default is below the level: mean trials to reach it ({name}), "
                  f"summed: model {mm:.1f}, random {rm:.1f} (ratio {mm / rm:.2f})")
    if a.output:
        with open(a.output, "w") as f:
            json.dump(out, f, indent=1)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pool", help="build and measure random pools of a model's largest tasks (GPU host)")
    p.add_argument("models", nargs="+", metavar="model")
    p.add_argument("--arch", default="sm_90")
    p.add_argument("--batch", type=int, nargs="+", default=[256])
    p.add_argument("--tasks", type=int, default=6, help="the largest implicit-GEMM tasks (roofline share)")
    p.add_argument("--keys", help="a file of task keys, one a line ('#' comments): these tasks, in this order, "
                   "instead of the largest")
    p.add_argument("--build-only", action="store_true", help="build the candidates (filling the kernel cache), "
                   "measure nothing")
    p.add_argument("--part", default="0/1", help="K/N: this process takes tasks K, K+N, ... (one GPU each)")
    p.add_argument("--per-task", type=int, default=100, help="candidates per task, the default first")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device-id", type=int, default=0, help="the GPU that measures (CUDA device index)")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    p.add_argument("--build-dir", default=None)
    p.add_argument("--build-timeout", type=float, default=120.0)
    p.add_argument("-q", "--quiet", action="store_true")
    p.add_argument("-o", "--output", required=True)
    r = sub.add_parser("replay", help="model-ranked against random order over measured pools")
    r.add_argument("pools", nargs="+")
    r.add_argument("--seeds", type=int, default=100)
    r.add_argument("--per-round", type=int, default=8, help="candidates per round (qtune's --per-round)")
    r.add_argument("--eps", type=float, default=0.1, help="share of a round taken at random (qtune's)")
    r.add_argument("--level", type=float, default=0.95, help="the fraction of the pool's best throughput to reach")
    r.add_argument("--warm", action="store_true", help="train the model on the other tasks' pools first (less "
                   "those of the task's conv geometry and the points of the task's own pool)")
    r.add_argument("--pretrained", metavar="TRAIN.jsonl.gz", help="train the model first on these measurements (qtune's "
                   "packaged ones: tuning_logs/sm_90.train.jsonl.gz), less every record of the task's conv "
                   "geometry (any batch size, bit width or residual add)")
    r.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="processes (tasks replayed in parallel)")
    r.add_argument("-o", "--output")
    a = ap.parse_args(argv)
    a.argv = argv
    return pool(a) if a.cmd == "pool" else replay(a)


if __name__ == "__main__":
    raise SystemExit(main())
