#!/usr/bin/env python3
"""CPU latency of compiled ResNets against onnxruntime on the same QDQ model, batch 1, same thread count.

    python scripts/bench_cpu.py --threads 2 --json docs/bench/cpu_resnet.json --write docs/BENCHMARKS.md
    python scripts/bench_cpu.py --table docs/bench/cpu_resnet.json --write docs/BENCHMARKS.md       # the table only

For each model and bit width: ``qmodel NET --bits B`` writes the QDQ ONNX model, ``qcompile`` builds it for llvm
twice -- with the CPU kernels (the default) and with ``QCOMPILE_CPU_KERNELS=0`` (TVM's generic conv, for
comparison; ``--no-generic`` skips it, it is slow) -- and each ``.so`` runs through ``qcompile.runtime.Module``;
onnxruntime (CPU provider, ``intra_op_num_threads`` = ``--threads``, one inter-op thread, all graph optimizations)
runs the same ONNX file. The compiled output is checked against the NumPy integer reference of the same graph
before anything is timed. Each side: ``--warmup`` calls, then ``--runs`` timed calls; the median and the minimum are
reported. The sides take turns (``--rounds`` rounds, each side's timed calls once per round), so that a noisy
neighbour on a shared machine hits every side alike; the median is over all calls.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import shlex
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from e2e_table import write_block  # noqa: E402


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return platform.processor() or "unknown CPU"


def make_model(net: str, bits: str, folder: str) -> str:
    path = os.path.join(folder, f"{net}_{bits}.onnx")
    if not os.path.exists(path):
        subprocess.run(["qmodel", net, "--bits", bits, "-o", path], check=True, capture_output=True)
    return path


def compile_so(onnx: str, so: str, generic: bool, threads: int) -> float:
    env = dict(os.environ, TVM_NUM_THREADS=str(threads))
    if generic:
        env["QCOMPILE_CPU_KERNELS"] = "0"
    t0 = time.time()
    subprocess.run(["qcompile", onnx, "-o", so], check=True, capture_output=True, env=env)
    return time.time() - t0


def check_exact(onnx: str, so_module, x: np.ndarray) -> bool:
    """The .so's output equals the NumPy integer reference of the model's integer graph."""
    from qcompile.driver import CompileOptions, import_model
    from qcompile.pipeline import lower_to_integer
    from qcompile.reference import Reference

    mod_qdq, _ = import_model(onnx, CompileOptions(), lambda s: None)
    return bool(np.array_equal(so_module(x), Reference(lower_to_integer(mod_qdq, "NCHW"))(x)))


def bench(sides: dict, x: np.ndarray, warmup: int, runs: int, rounds: int) -> dict:
    times = {k: [] for k in sides}
    for f in sides.values():
        for _ in range(warmup):
            f(x)
    for _ in range(rounds):
        for k, f in sides.items():
            for _ in range(runs):
                t0 = time.perf_counter()
                f(x)
                times[k].append(time.perf_counter() - t0)
    return {k: {"median_ms": float(np.median(t) * 1e3), "min_ms": float(np.min(t) * 1e3), "calls": len(t)}
            for k, t in times.items()}


def table(res: dict) -> str:
    rows = ["| model | qcompile, CPU kernels (ms) | qcompile, generic conv (ms) | onnxruntime (ms) "
            "| vs onnxruntime | vs generic |", "|---|---|---|---|---|---|"]
    for r in res["results"]:
        t = r["timings"]
        q, g = t["qcompile"]["median_ms"], t.get("generic", {}).get("median_ms")
        o = t.get("onnxruntime", {}).get("median_ms")
        gs = f"{g:.0f}" if g is not None else "not run"
        os_ = f"{o:.1f} (min {t['onnxruntime']['min_ms']:.1f})" if o is not None else "cannot run it"
        rows.append(f"| {r['net']} {r['bits']} b1 | {q:.1f} (min {t['qcompile']['min_ms']:.1f}) | {gs} | {os_} "
                    f"| {f'{o / q:.2f}x' if o else '-'} | {f'{g / q:.1f}x' if g else '-'} |")
    rows.append("")
    rows.append(f"Medians (and minima) of single calls, {res['threads']} threads each side, batch 1; "
                f"{res['device']}, {res['date']}; `{res['command']}`; results file `{res.get('json', '')}`.")
    return "\n".join(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nets", default="resnet18,resnet50")
    ap.add_argument("--bits", default="8", help="comma-separated qmodel bit schemes (8, 4, w4a8, ...)")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--no-generic", action="store_true", help="skip the generic-conv build (slow: seconds per call)")
    ap.add_argument("--generic-runs", type=int, default=1, help="timed calls of the generic build per round")
    ap.add_argument("--models", default=None, help="folder for the ONNX models and .so files (default: a temp dir)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--write", nargs="+", metavar="FILE", help="replace the table's block (<!-- table:cpu -->) in "
                    "these files")
    ap.add_argument("--table", metavar="RESULTS", help="only write the table of this results file")
    a = ap.parse_args(argv)
    if a.table:
        write_block("cpu", table(json.loads(pathlib.Path(a.table).read_text())), a.write)
        return 0
    os.environ["TVM_NUM_THREADS"] = str(a.threads)  # (before TVM's thread pool starts)
    import onnxruntime as ort

    from qcompile.runtime import Module

    folder = a.models or tempfile.mkdtemp(prefix="bench_cpu_")
    os.makedirs(folder, exist_ok=True)
    res = {"device": cpu_name(), "date": datetime.date.today().isoformat(),
           "command": "python scripts/bench_cpu.py " + " ".join(shlex.quote(s) for s in (argv or sys.argv[1:])),
           "threads": a.threads, "onnxruntime": ort.__version__, "json": a.json, "results": []}
    rng = np.random.default_rng(0)
    for net in a.nets.split(","):
        for bits in a.bits.split(","):
            onnx = make_model(net, bits, folder)
            so, so_g = os.path.join(folder, f"{net}_{bits}.so"), os.path.join(folder, f"{net}_{bits}_generic.so")
            build_s = compile_so(onnx, so, False, a.threads)
            m = Module(so)
            x = rng.standard_normal(m.meta["input_shape"]).astype("float32")
            exact = check_exact(onnx, m, x)
            so_opts = ort.SessionOptions()
            so_opts.intra_op_num_threads, so_opts.inter_op_num_threads = a.threads, 1
            so_opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
            try:
                sess = ort.InferenceSession(onnx, so_opts, providers=["CPUExecutionProvider"])
            except Exception as e:  # (onnxruntime lacks some 4-bit kernels, e.g. MaxPool on uint4)
                sess = None
                print(f"{net} {bits}: onnxruntime cannot run the model: {str(e).splitlines()[0][:200]}", flush=True)
            sides = {"qcompile": m}
            if sess is not None:
                iname = sess.get_inputs()[0].name
                sides["onnxruntime"] = lambda v: sess.run(None, {iname: v})[0]
            t = bench(sides, x, a.warmup, a.runs, a.rounds)
            row = {"net": net, "bits": bits, "exact_vs_reference": exact, "build_s": round(build_s, 1), "timings": t}
            if not a.no_generic:
                row["build_generic_s"] = round(compile_so(onnx, so_g, True, a.threads), 1)
                mg = Module(so_g)
                row["generic_exact_equal"] = bool(np.array_equal(mg(x), m(x)))
                t.update(bench({"generic": mg}, x, 1, a.generic_runs, a.rounds))
            res["results"].append(row)
            print(json.dumps(row), flush=True)
    print(table(res))
    if a.json:
        pathlib.Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(a.json).write_text(json.dumps(res, indent=1) + "\n")
    if a.write:
        write_block("cpu", table(res), a.write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
