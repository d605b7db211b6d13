#!/usr/bin/env python3
"""Per-layer benchmark of the tensor-core conv kernels: every distinct ResNet-50 conv at batch 8 / 64 / 256, INT8 and
INT4, each as compiled models run it, against cuDNN fp16 (``F.conv2d``, channels_last, ``cudnn.benchmark``) and
``torch._int_mm`` on the GEMM-equivalent shape.

  build host (nvcc, no GPU):
      python scripts/bench_layers.py build [--dir DIR] [--batches 8 64 256] [--arch sm_90] [--jobs J] [--only REGEX]
  GPU host (NumPy, torch and the TVM runtime; where TVM does not import, the runtime bundle of
  scripts/make_runtime_bundle.sh is unpacked from build/runtime_bundle or $QC_RUNTIME_BUNDLE):
      python3 scripts/bench_layers.py device [--dir DIR] [--out OUT] [--batches N ...] [--ab-rounds 9]
  tables:
      python scripts/bench_layers.py table RESULTS.json [--write docs/BENCHMARKS.md]
      python scripts/bench_layers.py table RESULTS.json --paired [--write docs/BENCHMARKS.md]

``build`` plans each layer as the compiler does (``select_strategy``, the knobs ``knobs_for`` gives from the packaged
tuning logs, ``plan_conv``: the automatic K-split included), builds the kernels with qcompile.tune's
``LocalBuilder`` and writes DIR as an offline batch of qcompile.tune (the libraries, ``manifest.json``,
``measure.py``, ``run.sh``) plus ``layers.json``: each table row's layer, its INT8 and INT4 kernels, and the conv
cuDNN is given. A layer runs its conv as the compiler plans it: the RGB stem padded to 4 channels with 8-bit
operands (INT4 too) and as its space-to-depth form (the 4x4 stride-1 conv over 16 channels; cuDNN gets the 7x7
stride-2 layer), the bottleneck's 1x1 expansion (``_1x1b``) with the residual add compiled models fuse into it
(cuDNN: the conv alone; ``--no-residual`` builds it plain).

``device`` runs the batch's own ``measure.py`` (every kernel checked bit for bit against its NumPy reference on
fresh random inputs, then timed with TVM's ``time_evaluator``), times cuDNN and ``torch._int_mm`` for the same
shapes from CUDA-graph replays (no host launch cost) with the same statistic (the median of ``--repeat`` repeats of
at least ``--min-repeat-ms`` each), and writes OUT/results.json (OUT: --out, default DIR; measure.py's own results
beside it). ``--ab-rounds N`` also times each layer's INT8 and INT4 kernels alternately N times (``time_evaluator``;
paired ratios: the ``--paired`` table). measure.py's NumPy reference takes most of the time (about 1.3 T
multiply-adds for all three batch sizes, some 15 minutes on one core); ``--batches`` measures part of the build, and
a later run with the rest adds its rows to the same results file.

``table`` writes the layer table (block ``layers``); ``--paired`` the INT4-against-INT8 summary from the paired
timings (block ``layers_int4_vs_int8``). Both take the date, device, commands and timing method from the results
file.
"""
from __future__ import annotations

import argparse
import json
import math
import pathlib
import re
import shlex
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
BUILD_DIR = ROOT / "build" / "gpu" / "layers"  # (--dir default)
BATCHES = (8, 64, 256)
DTYPES = ("int8", "int4")
RESIDUAL_LAYERS = ("_1x1b",)  # ResNet-50: the bottleneck's expansion conv carries the block's residual add
LAYERS_FORMAT = "qcompile-layer-bench/1"
PEAK_INT8_MMA_SYNC = 1284  # TOPS, H100 SXM: mma.sync s8 m16n8k32 from registers (the dense wgmma peak is 1979)
GRAPH_LAUNCHES = 20  # launches per CUDA graph of the baselines
TIMING = {"b2b": "per launch, from 20 back-to-back launches between two CUDA events (median of 7 rounds)",
          "graph": "per launch, from 20 launches captured in one CUDA graph (no host launch cost), median of 7 replays",
          "time_evaluator": "per launch; INT8 and INT4: TVM's time_evaluator in qcompile's measure.py (the median of "
                            "{repeat} repeats, each at least {min_repeat_ms} ms of back-to-back launches between two "
                            "device events; a split-K pair the sum of its two kernels); cuDNN and int_mm: CUDA graphs "
                            "of 20 launches replayed back to back (no host launch cost), the median of {repeat} "
                            "repeats of at least {min_repeat_ms} ms"}


# ---------------------------------------------------------------------------------------------------------------
# the layers, as compiled models run them (build host: qcompile)
# ---------------------------------------------------------------------------------------------------------------
def compiled_spec(N, C, H, K, R, st, pd, dt, residual=False, s2d=True):
    """The conv a compiled model runs for a ResNet-50 layer at batch N in ``dt`` (int8: uint8 x int8 -> uint8; int4:
    uint4 x int4 -> uint4): channels and operand widths as the dispatcher plans them (``operand_plan``: the RGB stem
    padded to 4 channels with 8-bit operands), the stage-1 epilogue of a QDQ model (``shift_ge33``), with
    ``residual`` the residual stage compiled models fuse into the conv (the int8 / int4 stage-1 intermediate, the
    unsigned residual input and output, the per-tensor second stage ``RQ2_RESNET50`` computed in int32), and with
    ``s2d`` the stem as its space-to-depth form (``space_to_depth``). ``s2d=False``: the layer itself."""
    from qcompile.schedules import ConvSpec
    from qcompile.schedules.layers import RQ2_RESNET50
    from qcompile.schedules.spec import operand_plan, space_to_depth

    u, bits, hi = ("uint8", 8, 255) if dt == "int8" else ("uint4", 4, 15)
    c_pad, x_dtype, w_bits = operand_plan(C, u, bits)
    spec = ConvSpec(N=N, H=H, W=H, C=C + c_pad, K=K, R=R, S=R, stride=st, padding=pd, x_dtype=x_dtype, w_bits=w_bits,
                    out_dtype=u, zo=3 if dt == "int8" else 1, lo=0, hi=hi, shift_ge33=True)
    if residual:
        spec = spec.replace(has_residual=True, lo=-(hi + 1) // 2, hi=hi // 2, zo=0, res_dtype=u, zo2=0, lo2=0, hi2=hi,
                            res_i32=True, rq2_uniform=RQ2_RESNET50)
    return (space_to_depth(spec) if s2d else None) or spec


def layer_rows(batches=BATCHES, arch="sm_90", only=None, residual=RESIDUAL_LAYERS):
    """The table's rows: per batch, every distinct ResNet-50 conv (``only``: the names matching that regex), with
    the conv cuDNN gets and, per dtype, the spec, strategy and knobs compiled models run (``knobs_for``'s knobs and
    their source; the fallback takes none)."""
    from qcompile.schedules import knobs_for, select_strategy, tuning_key
    from qcompile.schedules.layers import RESNET50, distinct

    rows = []
    for N in batches:
        for (name, C, H, K, R, st, pd) in distinct(RESNET50):
            if only and not re.search(only, name):
                continue
            res = name.endswith(tuple(residual))
            layer = compiled_spec(N, C, H, K, R, st, pd, "int8", s2d=False)  # (cuDNN's: C padded as ours)
            row = dict(layer=f"{name}_b{N}", N=N, C=layer.C, H=H, K=K, R=R, stride=st, padding=pd,
                       gops=2 * layer.macs() / 1e9, residual=res, kernels={})
            for dt in DTYPES:
                spec = compiled_spec(N, C, H, K, R, st, pd, dt, res)
                strategy = select_strategy(spec, arch)
                kn, source = (None, "") if strategy == "fallback" else knobs_for(spec, arch, strategy=strategy)
                row["kernels"][dt] = dict(spec=spec, key=tuning_key(spec), strategy=strategy, source=source, knobs=kn)
            rows.append(row)
    return rows


def _commit():
    """The source tree's commit (``-dirty`` with uncommitted changes to tracked files), or None outside git."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("-dirty" if dirty else "")


def cmd_build(a, argv):
    import dataclasses

    from qcompile.tune import runners as RN
    from qcompile.tune.build import LocalBuilder
    from qcompile.tune.common import Candidate

    out = pathlib.Path(a.dir)
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"{out}: exists and is not empty (the build goes to a new folder)")
    rows = layer_rows(a.batches, a.arch, a.only, () if a.no_residual else RESIDUAL_LAYERS)
    if not rows:
        raise SystemExit(f"no ResNet-50 layer matches --only {a.only!r}")
    ks = [k for r in rows for k in r["kernels"].values()]
    cands = [Candidate(k["key"], k["spec"], a.arch, k["strategy"], k["knobs"]) for k in ks]
    t0 = time.time()
    builder = LocalBuilder(jobs=a.jobs, target="cuda", nvcc_mode="sass")
    print(f"{len(rows)} layers, {len(cands)} kernels for {a.arch} ({builder.jobs} build processes)", flush=True)
    try:
        built = builder.build(cands)
        failed = [(k, b) for k, b in zip(ks, built) if b.error]
        for k, b in failed:
            print(f"BUILD ERROR {k['key']} {k['strategy']}: {b.error}", flush=True)
        RN.export(built, str(out))
    finally:
        builder.close()
    for k, b in zip(ks, built):
        e = b.entry
        k.update(spec=dataclasses.asdict(k["spec"]), id=e.get("id"), label=e.get("label"),
                 knobs=e.get("effective_knobs"), build_s=e.get("build_s"), error=b.error)
    doc = dict(format=LAYERS_FORMAT, arch=a.arch, date=time.strftime("%Y-%m-%d"), commit=_commit(),
               build_command=shlex.join(["python", "scripts/bench_layers.py", *argv]), rows=rows)
    (out / "layers.json").write_text(json.dumps(doc, indent=1))
    print(f"built {len(built) - len(failed)} of {len(built)} kernels in {time.time() - t0:.0f} s -> {out} "
          f"(GPU host: python3 scripts/bench_layers.py device --dir {out})")
    return 1 if failed else 0


# ---------------------------------------------------------------------------------------------------------------
# the GPU host: measure.py for our kernels, torch for the baselines
# ---------------------------------------------------------------------------------------------------------------
def graph_time(fn, repeat=7, min_repeat_ms=20, launches=GRAPH_LAUNCHES):
    """Per-launch ms of fn: ``launches`` calls captured in one CUDA graph, the graph replayed back to back for at
    least ``min_repeat_ms`` per repeat between two CUDA events; the median of ``repeat`` repeats."""
    import numpy as np
    import torch

    for _ in range(3):  # (cudnn.benchmark picks its algorithm outside the capture)
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(launches):
            fn()
    g.replay()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    g.replay()
    e.record()
    e.synchronize()
    replays = max(1, math.ceil(min_repeat_ms / max(s.elapsed_time(e), 1e-3)))
    ts = []
    for _ in range(repeat):
        s.record()
        for _ in range(replays):
            g.replay()
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e) / (replays * launches))
    del g
    return float(np.median(ts))


def baselines(row, timer):
    """(cuDNN fp16 ms, torch._int_mm ms) of the row's layer with ``timer``: cuDNN's fp16 channels_last conv of the
    layer (``cudnn.benchmark``), and the int8 GEMM of its GEMM-equivalent shape (sizes padded to multiples of 8, at
    least 32 rows; NaN where cuBLASLt refuses it)."""
    import torch

    N, C, H, K, R = row["N"], row["C"], row["H"], row["K"], row["R"]
    x = torch.randn(N, C, H, H, device="cuda").half().to(memory_format=torch.channels_last)
    w = torch.randn(K, C, R, R, device="cuda").half().to(memory_format=torch.channels_last)
    torch.backends.cudnn.benchmark = True
    t_cudnn = timer(lambda: torch.nn.functional.conv2d(x, w, stride=row["stride"], padding=row["padding"]))
    P = (H + 2 * row["padding"] - R) // row["stride"] + 1
    Mg, Ng, Kg = N * P * P, K, R * R * C
    a = torch.randint(-128, 127, (max(Mg, 32), (Kg + 7) // 8 * 8), dtype=torch.int8, device="cuda")
    b = torch.randint(-128, 127, ((Kg + 7) // 8 * 8, (Ng + 7) // 8 * 8), dtype=torch.int8, device="cuda")
    try:
        t_int = timer(lambda: torch._int_mm(a, b))
    except Exception as e:  # noqa: BLE001  (cuBLASLt refusing the shape: the row says n/a)
        print(f"int_mm {row['layer']}: {' '.join(str(e).split())[:200]}", flush=True)
        t_int = float("nan")
    return t_cudnn, t_int


def _load_measure(path):
    """The batch's measure.py as a module (NumPy and the TVM runtime only)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_layers_measure", path)
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


def paired_ratios(d, rows, entries, rounds, repeat, min_repeat_ms, device_id=0):
    """Per row, ``rounds`` INT4 / INT8 time ratios: the row's two kernels timed alternately in this process with
    measure.py's calling convention and ``time_evaluator`` (their bit-exactness is measure.py's check: the inputs
    here are drawn without the reference)."""
    import tvm

    M = _load_measure(d / "measure.py")
    dev = M.get_device("cuda", device_id)
    # (this private copy only: the timing rounds need no reference)
    M.reference_storage = lambda spec, *args, **kw: M.np.zeros(spec.shapes()[2], M.np.int8)
    out = {}
    for i, r in enumerate(rows):
        pair = []
        for j, dt in enumerate(DTYPES):
            e = entries[r["kernels"][dt]["id"]]
            mod = tvm.runtime.load_module(str(d / e["so"]))
            pair.append(M.Layer(mod, e, dev, M.problem(e, 1000 + 2 * i + j)))
        ratios = []
        for _ in range(rounds):
            t8 = sum(pair[0].time_ms(repeat, min_repeat_ms))
            ratios.append(sum(pair[1].time_ms(repeat, min_repeat_ms)) / t8)
        out[r["layer"]] = ratios
        print(f"PAIRED {r['layer']:<20} INT4 / INT8 {sorted(ratios)[len(ratios) // 2]:.3f}", flush=True)
        del pair
    return out


def assemble(layers_doc, measured, base, paired=None, repeat=7, min_repeat_ms=20):
    """The results document of a device run: ``measured`` is measure.py's results document, ``base`` the baselines
    by layer ((cuDNN ms, int_mm ms)), ``paired`` the INT4 / INT8 ratios by layer (or None)."""
    by_id = {r["id"]: r for r in measured["results"]}
    rows = []
    for r in layers_doc["rows"]:
        if r["layer"] not in base:
            continue
        row = {k: r[k] for k in ("layer", "N", "C", "H", "K", "R", "stride", "padding", "gops", "residual")}
        for dt in DTYPES:
            k = r["kernels"][dt]
            m = by_id.get(k["id"], dict(status="build_error" if k.get("error") else "not measured", ms=None))
            row.update({f"{dt}_ms": m["ms"] if m["status"] == "ok" else float("nan"), f"{dt}_status": m["status"],
                        f"{dt}_strategy": k["strategy"], f"{dt}_label": k.get("label"), f"{dt}_knobs": k.get("knobs"),
                        f"{dt}_source": k["source"], f"{dt}_key": k["key"]})
            if m.get("detail"):
                row[f"{dt}_detail"] = m["detail"]
        row["cudnn_fp16_ms"], row["int_mm_ms"] = base[r["layer"]]
        if paired and r["layer"] in paired:
            ratios = paired[r["layer"]]
            row["int4_over_int8_ab"] = sorted(ratios)[len(ratios) // 2]
            row["int4_over_int8_ab_rounds"] = [round(x, 4) for x in ratios]
        rows.append(row)
    dev = measured.get("device") or {}
    return dict(device=dev.get("name"), sms=dev.get("sms"), date=measured.get("date") or time.strftime("%Y-%m-%d"),
                commit=layers_doc.get("commit"), arch=layers_doc.get("arch"),
                build_command=layers_doc.get("build_command"), command=None, timing=measured.get("timing"),
                baseline_timing="graph", repeat=repeat, min_repeat_ms=min_repeat_ms,
                residual_layers=sorted({r["layer"].rsplit("_b", 1)[0] for r in layers_doc["rows"] if r["residual"]}),
                bench=rows)


def merge(old, new):
    """``new`` with the rows of ``old`` (a results file of the same build) it does not have, in batch order."""
    if not old or (old.get("build_command"), old.get("commit")) != (new["build_command"], new["commit"]):
        return new
    have = {r["layer"] for r in new["bench"]}
    rows = [r for r in old["bench"] if r["layer"] not in have] + new["bench"]
    order = {r["layer"]: i for i, r in enumerate(old["bench"] + new["bench"])}
    rows.sort(key=lambda r: (r["N"], order[r["layer"]]))
    return dict(new, bench=rows)


def cmd_device(a, argv):
    sys.path.insert(0, str(ROOT / "scripts"))
    from device_env import setup_runtime_and_reexec

    setup_runtime_and_reexec(__file__, argv)
    import torch

    d = pathlib.Path(a.dir)
    out = pathlib.Path(a.out or d)
    out.mkdir(parents=True, exist_ok=True)
    layers_doc = json.loads((d / "layers.json").read_text())
    if layers_doc.get("format") != LAYERS_FORMAT:
        raise SystemExit(f"{d}/layers.json: not a layer-bench build (python scripts/bench_layers.py build)")
    rows = [r for r in layers_doc["rows"] if not a.batches or r["N"] in a.batches]
    if not rows:
        raise SystemExit(f"{d}: no layer at batch {a.batches}")
    ids = sorted({r["kernels"][dt]["id"] for r in rows for dt in DTYPES} - {None})
    mres = out / f"measure_results_b{'_'.join(str(n) for n in sorted({r['N'] for r in rows}))}.json"
    cmd = [sys.executable, str(d / "measure.py"), str(d), "-o", str(mres), "--repeat", str(a.repeat),
           "--min-repeat-ms", str(a.min_repeat_ms), "--device-id", str(a.device_id), "--timeout",
           str(a.measure_timeout), "--ids", *ids]
    print("$ " + shlex.join(cmd), flush=True)
    if subprocess.call(cmd) != 0:
        raise SystemExit("measure.py failed")
    measured = json.loads(mres.read_text())
    torch.cuda.set_device(a.device_id)
    base = {}
    for r in rows:
        base[r["layer"]] = baselines(r, lambda fn: graph_time(fn, a.repeat, a.min_repeat_ms))
        torch.cuda.empty_cache()
        print(f"BASE {r['layer']:<20} cudnn16 {base[r['layer']][0]:.4f} ms  int_mm {base[r['layer']][1]:.4f} ms",
              flush=True)
    paired = None
    if a.ab_rounds:
        ok = {x["id"] for x in measured["results"] if x["status"] == "ok"}
        pr = [r for r in rows if all(r["kernels"][dt]["id"] in ok for dt in DTYPES)]
        man = json.loads((d / "manifest.json").read_text())
        paired = paired_ratios(d, pr, {e["id"]: e for e in man["candidates"]}, a.ab_rounds, a.repeat,
                               a.min_repeat_ms, a.device_id)
    doc = assemble(dict(layers_doc, rows=rows), measured, base, paired, a.repeat, a.min_repeat_ms)
    doc["command"] = shlex.join(["python3", "scripts/bench_layers.py", *argv])
    doc["versions"] = dict(torch=torch.__version__, cudnn=torch.backends.cudnn.version())
    path = out / "results.json"
    old = json.loads(path.read_text()) if path.exists() else None
    doc = merge(old, doc)
    path.write_text(json.dumps(doc, indent=1))
    bad = [(r["layer"], dt, r[f"{dt}_status"]) for r in doc["bench"] for dt in DTYPES if r[f"{dt}_status"] != "ok"]
    for layer, dt, st in bad:
        print(f"FAIL {layer} {dt}: {st}", flush=True)
    print(f"{len(doc['bench'])} layers -> {path}" + (f"; {len(bad)} kernels not bit-exact or not run" if bad else ""))
    return 1 if bad else 0


# ---------------------------------------------------------------------------------------------------------------
# tables
# ---------------------------------------------------------------------------------------------------------------
def _gm(xs):
    xs = list(xs)
    return math.exp(sum(map(math.log, xs)) / len(xs))


def _caption(res, device=None, date=None, timing=True):
    device = res.get("device") or device or "?"  # (``device`` / ``date``: for results files without them)
    date = res.get("date") or date or "?"
    out = f"{device}, {date}" + (f", code at `{res['commit']}`" if res.get("commit") else "") + "."
    if timing:
        how = TIMING.get(res.get("timing"), "median of 20 launches, each timed alone (including its host launch)")
        out += f" Times in ms, {how.format(repeat=res.get('repeat', 7), min_repeat_ms=res.get('min_repeat_ms', 20))}"
        out += "; TOPS = 2 x MACs / time."
    if res.get("residual_layers"):
        out += (f" {', '.join(res['residual_layers'])}: with the residual add compiled models fuse into the conv "
                "(cuDNN: the conv alone).")
    if "scripts/bench_layers.py" in (res.get("build_command") or ""):
        out += f" Built with `{res['build_command']}`"
        out += f", measured on the GPU host with `{res['command']}`." if res.get("command") else "."
    elif res.get("build_command"):
        out += (f" Built and measured with the layer-bench commands of `{res['commit']}` (its results file names them)."
                if res.get("commit") else f" Built with `{res['build_command']}`.")
    if res.get("note"):
        out += " " + res["note"]
    return out


def table(path, device=None, date=None):
    """The layer table of a results file (Markdown): every row's INT8 / INT4 / cuDNN fp16 / int_mm times, the
    speed-ups over cuDNN, INT4's over INT8 (paired where the run has paired timings), and per-batch geomeans."""
    res = json.loads(pathlib.Path(path).read_text())
    rows = res["bench"]
    paired = all("int4_over_int8_ab" in r for r in rows)
    out = [_caption(res, device, date), "",
           "| layer | N | C->K | RxS/s | GOP | INT8 ms | INT8 TOPS | INT4 ms | INT4 TOPS | cuDNN fp16 ms | int_mm ms | "
           f"INT8 vs cuDNN | INT4 vs cuDNN | INT4 vs INT8{' (paired)' if paired else ''} |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        i8, i4, cd, im = r["int8_ms"], r["int4_ms"], r["cudnn_fp16_ms"], r["int_mm_ms"]
        name = r["layer"].rsplit("_b", 1)[0]
        r48 = 1 / r["int4_over_int8_ab"] if paired else i8 / i4
        out.append(f"| {name} | {r['N']} | {r['C']}->{r['K']} | {r['R']}x{r['R']}/{r['stride']} | {r['gops']:.2f} | "
                   f"{i8:.4f} | {r['gops'] / i8:.0f} | {i4:.4f} | {r['gops'] / i4:.0f} | {cd:.4f} | "
                   f"{'n/a' if math.isnan(im) else f'{im:.4f}'} | {cd / i8:.2f}x | {cd / i4:.2f}x | {r48:.2f}x |")
    out += ["", "n/a: cuBLASLt refused the shape. int_mm times the GEMM alone (no im2col)."
            + (" INT4 vs INT8 (paired): INT4's speed-up over INT8, the median over alternating rounds."
               if paired else ""), ""]
    out.append("| batch | INT8 vs cuDNN fp16 (geomean) | INT4 vs cuDNN fp16 | 3x3 layers, INT8 | best 3x3 layer |")
    out.append("|---|---|---|---|---|")
    for N in sorted({r["N"] for r in rows}):
        rs = [r for r in rows if r["N"] == N]
        r3 = [r for r in rs if r["R"] == 3]
        head = (f"| {N} | {_gm(r['cudnn_fp16_ms'] / r['int8_ms'] for r in rs):.2f}x | "
                f"{_gm(r['cudnn_fp16_ms'] / r['int4_ms'] for r in rs):.2f}x | ")
        if not r3:  # (a build of some layers only)
            out.append(head + "n/a | n/a |")
            continue
        best = max(r3, key=lambda r: r["gops"] / min(r["int8_ms"], r["int4_ms"]))
        t8, t4 = best["gops"] / best["int8_ms"], best["gops"] / best["int4_ms"]
        out.append(head + f"{_gm(r['cudnn_fp16_ms'] / r['int8_ms'] for r in r3):.2f}x | "
                   f"{best['layer'].rsplit('_b', 1)[0]}: INT8 {t8:.0f} TOPS ({100 * t8 / PEAK_INT8_MMA_SYNC:.0f}% of "
                   f"mma.sync's {PEAK_INT8_MMA_SYNC}), INT4 {t4:.0f} |")
    return "\n".join(out) + "\n"


def paired_table(path, device=None, date=None, threshold=1.02):
    """INT4 against INT8 per batch from the paired timings (``device --ab-rounds N``): the geomean speed-up, and
    every layer where INT4 takes more than ``threshold`` x INT8's time."""
    res = json.loads(pathlib.Path(path).read_text())
    rows = [r for r in res["bench"] if "int4_over_int8_ab" in r]
    if not rows:
        raise SystemExit(f"{path}: no paired INT4 / INT8 timings (bench_layers.py device --ab-rounds N)")
    n = len(rows[0]["int4_over_int8_ab_rounds"])
    out = [_caption(res, device, date, timing=False) + f" Each layer's INT8 and INT4 kernels timed alternately, {n} "
           "rounds; per layer the median of the per-round ratios, as INT4's speed-up over INT8 (below 1: INT4 "
           "slower).", "",
           f"| batch | INT4 speed-up over INT8, geomean | layers where INT4 is slower by more than "
           f"{100 * (threshold - 1):.0f}% |", "|---|---|---|"]
    for N in sorted({r["N"] for r in rows}):
        rs = [r for r in rows if r["N"] == N]
        slow = sorted((r for r in rs if r["int4_over_int8_ab"] > threshold), key=lambda r: -r["int4_over_int8_ab"])
        names = ", ".join(f"{r['layer'].rsplit('_b', 1)[0]} {1 / r['int4_over_int8_ab']:.2f}x" for r in slow)
        out.append(f"| {N} | {_gm(1 / r['int4_over_int8_ab'] for r in rs):.2f}x | {len(slow)} of {len(rs)}"
                   + (f": {names}" if slow else "") + " |")
    return "\n".join(out) + "\n"


def main(argv=None):
    if argv is None:
        argv = sys.argv[1:]
    sys.path.insert(0, str(ROOT / "scripts"))
    import e2e_table

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build every layer's kernels as compiled models run them (build host)")
    b.add_argument("--dir", default=str(BUILD_DIR), help="output folder, new or empty (default: %(default)s)")
    b.add_argument("--batches", type=int, nargs="+", default=list(BATCHES), help="batch sizes (default: 8 64 256)")
    b.add_argument("--arch", default="sm_90", help="the arch to build for (default: sm_90)")
    b.add_argument("--jobs", type=int, default=None, help="parallel build processes (default: every core)")
    b.add_argument("--only", metavar="REGEX", help="only the layers whose name matches (e.g. 'r50_l3_')")
    b.add_argument("--no-residual", action="store_true", help="build the _1x1b convs without their residual add")
    d = sub.add_parser("device", help="check, time and compare them (GPU host)")
    d.add_argument("--dir", default=str(BUILD_DIR), help="the build folder (default: %(default)s)")
    d.add_argument("--out", help="results folder (default: --dir)")
    d.add_argument("--batches", type=int, nargs="+", help="measure only the layers at these batch sizes")
    d.add_argument("--ab-rounds", type=int, default=0, help="also time INT8 and INT4 alternately N times (paired)")
    d.add_argument("--repeat", type=int, default=7, help="timed repeats (default: 7)")
    d.add_argument("--min-repeat-ms", type=int, default=20, help="each repeat at least this long (default: 20)")
    d.add_argument("--device-id", type=int, default=0, help="which GPU (default: 0)")
    d.add_argument("--measure-timeout", type=int, default=600,
                   help="seconds measure.py gives one kernel, its NumPy reference included (default: 600)")
    t = e2e_table.add_table_command(sub, "layers (layers_int4_vs_int8 with --paired)", "the layer table of a results file")
    t.add_argument("--paired", action="store_true", help="the INT4-against-INT8 summary instead")
    t.add_argument("--device", help="device name where the results file has none")
    a = ap.parse_args(argv)
    if a.cmd == "build":
        return cmd_build(a, argv)
    if a.cmd == "device":
        return cmd_device(a, argv)
    if a.paired:
        name = "layers_int4_vs_int8" if a.name.startswith("layers (") else a.name
        e2e_table.write_block(name, paired_table(a.results, a.device), a.write)
    else:
        name = "layers" if a.name.startswith("layers (") else a.name
        e2e_table.write_block(name, table(a.results, a.device), a.write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
