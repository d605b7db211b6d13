#!/usr/bin/env python3
"""CPU latency of compiled ResNets against onnxruntime on the same QDQ model, same batch, same thread count.

    python scripts/bench_cpu.py --threads 2 --bits 8,4 --batch 1,16 --layout NCHW,NHWC \
        --json docs/bench/cpu_resnet.json --write docs/BENCHMARKS.md README.md
    python scripts/bench_cpu.py --table docs/bench/cpu_resnet.json --write docs/BENCHMARKS.md README.md  # tables only

For each model, bit width, batch and layout: ``qmodel NET --bits B`` writes the QDQ ONNX model (batch 1; another
batch is the same file with its input and output batch dimension set), ``qcompile --layout L`` builds it for llvm
twice -- with the CPU kernels (the default; the inner kernel is the host's best, ``schedules.cpu_conv.target_kernel``)
and with ``QCOMPILE_CPU_KERNELS=0`` (TVM's generic conv, for comparison, batch 1 only; ``--no-generic`` skips it, it
is slow) -- and each ``.so`` runs through ``qcompile.runtime.Module``; onnxruntime (CPU provider, ``intra_op_num_threads`` =
``--threads``, one inter-op thread, all graph optimizations) runs the same ONNX file. The compiled output is checked
against the NumPy integer reference of the same graph before anything is timed. Each side: ``--warmup`` calls, then
``--runs`` timed calls; the median and the minimum are reported. The sides take turns (``--rounds`` rounds, each
side's timed calls once per round), so that a noisy neighbour on a shared machine hits every side alike; the median is
over all calls. ``tables``: ``cpu`` (docs/BENCHMARKS.md, every row) and ``cpu_readme`` (README.md: ResNet-50, INT8
and INT4, batch 1), each between its ``<!-- table:NAME -->`` markers in the files given to ``--write``.
``--s4-baseline`` builds each model with 4-bit weights a second time with ``QCOMPILE_CPU_S4=0`` (its 4-bit weights
one per byte on ``cpu_direct_vnni``, no packed-weight variant), checks its output equals the default build's and
times the two in turns: the ``cpu_s4`` table. ``--per-layer N`` times each conv / dense kernel call of the
qcompile builds over N forward passes (the VM's instrument hook): per-layer minima and medians, summed per output
size.
"""
from __future__ import annotations

import argparse
import datetime
import itertools
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


def make_model(net: str, bits: str, batch: int, folder: str) -> str:
    """The QDQ ONNX file of ``net`` (``qmodel``), its input's and output's batch dimension set to ``batch``."""
    path = os.path.join(folder, f"{net}_{bits}.onnx")
    if not os.path.exists(path):
        subprocess.run(["qmodel", net, "--bits", bits, "-o", path], check=True, capture_output=True)
    if batch == 1:
        return path
    import onnx

    out = os.path.join(folder, f"{net}_{bits}_b{batch}.onnx")
    if not os.path.exists(out):
        m = onnx.load(path)
        for v in list(m.graph.input) + list(m.graph.output):
            v.type.tensor_type.shape.dim[0].dim_value = batch
        del m.graph.value_info[:]
        onnx.save(m, out)
    return out


def compile_so(onnx: str, so: str, generic: bool, threads: int, layout: str, extra_env: dict | None = None) -> float:
    env = dict(os.environ, TVM_NUM_THREADS=str(threads), **(extra_env or {}))
    if generic:
        env["QCOMPILE_CPU_KERNELS"] = "0"
    t0 = time.time()
    cmd = ["qcompile", onnx, "-o", so, "--layout", layout]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if p.returncode:
        raise SystemExit(f"bench_cpu: {' '.join(cmd)} failed (exit {p.returncode}):\n{p.stderr[-2000:]}")
    return time.time() - t0


def host_kernel() -> str:
    """The inner kernel a plain llvm build on this host runs (``cpu_direct_vnni``, ``cpu_direct_avxvnni``,
    ``cpu_direct_avx2``), or ``generic`` where none does."""
    import tvm

    from qcompile.schedules.cpu_conv import cpu_target, target_kernel

    return target_kernel(cpu_target(tvm.target.Target({"kind": "llvm"}))) or "generic"


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


def per_layer(sides: dict, x: np.ndarray, calls: int) -> dict:
    """Per conv / dense kernel call of each ``qcompile.runtime.Module`` side (the VM's instrument hook, the sides in
    turns, ``calls`` forward passes each): ``{side: [[output shape, min us, median us], ...]}`` in call order."""
    times = {k: [] for k in sides}
    for _ in range(calls):
        for k, m in sides.items():
            seen, t0 = [], [0.0]

            def hook(func, name, before, ret, *args, seen=seen, t0=t0):
                if before:
                    t0[0] = time.perf_counter()
                elif str(name).startswith("qconv"):
                    seen.append((tuple(int(d) for d in args[-1].shape), time.perf_counter() - t0[0]))
                return 0
            m._exec["set_instrument"](hook)
            m(x)
            m._exec["set_instrument"](None)
            times[k].append(seen)
    out = {}
    for k, runs in times.items():
        shapes = [s for s, _ in runs[0]]
        t = np.array([[v for _, v in r] for r in runs]) * 1e6
        out[k] = [[list(sh), float(t[:, i].min()), float(np.median(t[:, i]))] for i, sh in enumerate(shapes)]
    return out


def per_layer_table(res: dict) -> str:
    """The ``--per-layer`` rows: per output size (the ResNet stages), the sum of the layers' minima and medians."""
    lines = []
    for r in res["results"]:
        pl = r.get("per_layer")
        if not pl:
            continue
        sides = list(pl)
        lines += [f"{r['net']} INT{r['bits']} batch {r.get('batch', 1)} {r.get('layout', '')}: sum of per-layer "
                  f"minima / medians (us), {r['per_layer_calls']} calls each",
                  "| output (H x W) | layers | " + " | ".join(sides) + " |", "|---|---|" + "---|" * len(sides)]
        groups: dict = {}
        for i, (shape, _, _) in enumerate(pl[sides[0]]):
            hw = f"{shape[1]}x{shape[2]}" if r.get("layout") == "NHWC" and len(shape) == 4 else \
                (f"{shape[2]}x{shape[3]}" if len(shape) == 4 else "dense")
            groups.setdefault(hw, []).append(i)
        for hw, idx in list(groups.items()) + [("all", list(range(len(pl[sides[0]]))))]:
            cells = " | ".join(f"{sum(pl[k][i][1] for i in idx):.0f} / {sum(pl[k][i][2] for i in idx):.0f}"
                               for k in sides)
            lines.append(f"| {hw} | {len(idx)} | {cells} |")
        lines.append("")
    return "\n".join(lines)


def table(res: dict, rows_of=lambda r: True) -> str:
    """The results as a Markdown table (the rows ``rows_of`` keeps) and a line saying how they were measured."""
    rows = ["| model | batch | layout | qcompile, CPU kernels (ms) | qcompile, generic conv (ms) | onnxruntime (ms) "
            "| PyTorch fp32 (ms) | vs onnxruntime | vs generic | `.so` (MiB) |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for r in filter(rows_of, res["results"]):
        t = r["timings"]
        q, g = t["qcompile"]["median_ms"], t.get("generic", {}).get("median_ms")
        o = t.get("onnxruntime", {}).get("median_ms")
        gs = f"{g:.0f}" if g is not None else "not run"
        os_ = f"{o:.1f} (min {t['onnxruntime']['min_ms']:.1f})" if o is not None else "cannot run it"
        size = f"{r['so_mib']:.1f}" if "so_mib" in r else "-"
        pt = t.get("pytorch_fp32")
        pts = f"{pt['median_ms']:.1f}" if pt else "-"
        rows.append(f"| {r['net']} INT{r['bits']} | {r.get('batch', 1)} | {r.get('layout', 'NCHW')} "
                    f"| {q:.1f} (min {t['qcompile']['min_ms']:.1f}) "
                    f"| {gs} | {os_} | {pts} | {f'{o / q:.2f}x' if o else '-'} | {f'{g / q:.1f}x' if g else '-'} "
                    f"| {size} |")
    rows.append("")
    rows.append(f"Medians (and minima) of single calls in ms per batch, {res['threads']} threads each side; inner "
                f"kernel `{res.get('kernel', 'cpu_direct_avx2')}`; "
                f"{res['device']}, {res['date']}; onnxruntime {res['onnxruntime']}; `{res['command']}`; results file "
                f"`{res.get('json', '')}`.")
    return "\n".join(rows)


def s4_table(res: dict) -> str:
    """The rows timed with ``--s4-baseline``: the default build (4-bit weights two per byte where the packed-weight
    variant runs) against the same model with its 4-bit weights one per byte, in turns."""
    rows = ["| model | batch | layout | 4-bit weights packed, default (ms) | one per byte, `QCOMPILE_CPU_S4=0` (ms) "
            "| packed vs one per byte | `.so` (MiB): packed / one per byte |",
            "|---|---|---|---|---|---|---|"]
    for r in res["results"]:
        t = r["timings"]
        if "w4_one_per_byte" not in t:
            continue
        q, u = t["qcompile"], t["w4_one_per_byte"]
        rows.append(f"| {r['net']} INT{r['bits']} | {r.get('batch', 1)} | {r.get('layout', 'NCHW')} "
                    f"| {q['median_ms']:.2f} (min {q['min_ms']:.2f}) | {u['median_ms']:.2f} (min {u['min_ms']:.2f}) "
                    f"| {u['median_ms'] / q['median_ms']:.2f}x | {r['so_mib']:.1f} / {r['w4_one_per_byte_so_mib']:.1f} |")
    rows.append("")
    rows.append(f"Medians (and minima) of single calls in ms per batch, {res['threads']} threads, the two builds in "
                f"turns; {res['device']}, {res['date']}; `{res['command']}`; results file `{res.get('json', '')}`.")
    per = per_layer_table(res)
    return "\n".join(rows) + ("\n\n" + per.rstrip() if per else "")


def write_tables(res: dict, files) -> None:
    """``cpu`` (every row) and ``cpu_readme`` (ResNet-50 at batch 1) into those of ``files`` that have the block.
    Refuses results whose outputs were not exact (against the NumPy reference, or batch-1 builds image by image)."""
    bad = [f"{r['net']} {r['bits']} b{r.get('batch', 1)} {r.get('layout', '')}" for r in res["results"]
           if r.get("exact_vs_reference") is False or r.get("exact_vs_batch1") is False
           or r.get("w4_one_per_byte_exact_equal") is False]
    if bad:
        raise SystemExit(f"bench_cpu: not writing the tables: outputs not exact for {', '.join(bad)}")
    for name, keep in (("cpu", lambda r: True),
                       ("cpu_readme", lambda r: r["net"] == "resnet50" and r.get("batch", 1) == 1)):
        has = [f for f in files if f"<!-- table:{name} -->" in pathlib.Path(f).read_text()]
        if has:
            write_block(name, table(res, keep), has)
    has = [f for f in files if "<!-- table:cpu_s4 -->" in pathlib.Path(f).read_text()]
    if has and any("w4_one_per_byte" in r["timings"] for r in res["results"]):
        write_block("cpu_s4", s4_table(res), has)


def onnxruntime_side(onnx: str, threads: int, label: str):
    """onnxruntime's CPU provider on ``onnx`` as a function of the input, or None where it cannot load the model."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads, opts.inter_op_num_threads = threads, 1
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    try:
        sess = ort.InferenceSession(onnx, opts, providers=["CPUExecutionProvider"])
    except Exception as e:  # (onnxruntime lacks some 4-bit kernels, e.g. MaxPool on uint4)
        print(f"{label}: onnxruntime cannot run the model: {str(e).splitlines()[0][:200]}", flush=True)
        return None
    iname = sess.get_inputs()[0].name
    return lambda v: sess.run(None, {iname: v})[0]


def torch_side(net: str, threads: int):
    """The float network in PyTorch fp32 on the CPU (models/'s torchvision-shaped net, eval, inference mode, the same
    threads), as a function of the input."""
    import torch

    from qcompile.models.resnet import build_model

    torch.set_num_threads(threads)
    model = build_model(net).eval()

    def run(v):
        with torch.inference_mode():
            return model(torch.from_numpy(v))
    return run


def bench_row(a, net: str, bits: str, batch: int, layout: str, folder: str, rng) -> dict:
    """Build, check and time one (model, bits, batch): see the module docstring. Batch 1 is checked against the
    NumPy integer reference; a larger batch, image by image, against the batch-1 build (already checked)."""
    from qcompile.runtime import Module

    onnx = make_model(net, bits, batch, folder)
    stem = os.path.join(folder, f"{net}_{bits}_b{batch}_{layout}")
    so, so_g = stem + ".so", stem + "_generic.so"
    build_s = compile_so(onnx, so, False, a.threads, layout)
    m = Module(so)
    x = rng.standard_normal(m.meta["input_shape"]).astype("float32")
    row = {"net": net, "bits": bits, "batch": batch, "layout": layout}
    so1 = os.path.join(folder, f"{net}_{bits}_b1_{layout}.so")
    if batch > 1 and so1 in a.checked:  # (a batch-1 build of this run, checked against the reference)
        m1, y = Module(so1), m(x)
        row["exact_vs_batch1"] = all(np.array_equal(y[i:i + 1], m1(x[i:i + 1])) for i in range(batch))
    else:
        row["exact_vs_reference"] = check_exact(onnx, m, x)
        if batch == 1 and row["exact_vs_reference"]:
            a.checked.add(so)
    sides = {"qcompile": m}
    ort_run = onnxruntime_side(onnx, a.threads, f"{net} {bits} b{batch}")
    if ort_run is not None:
        sides["onnxruntime"] = ort_run
    if not a.no_torch and layout == a.layout.split(",")[0]:  # (PyTorch's time does not depend on our layout)
        sides["pytorch_fp32"] = torch_side(net, a.threads)
    if a.s4_baseline and bits != "8":  # (the same model with its 4-bit weights one per byte: no packed variant)
        so_u = stem + "_w4bytes.so"
        compile_so(onnx, so_u, False, a.threads, layout, {"QCOMPILE_CPU_S4": "0"})
        mu = Module(so_u)
        row["w4_one_per_byte_exact_equal"] = bool(np.array_equal(mu(x), m(x)))
        row["w4_one_per_byte_so_mib"] = round(os.path.getsize(so_u) / 2**20, 1)
        sides["w4_one_per_byte"] = mu
    t = bench(sides, x, a.warmup, a.runs, a.rounds)
    row.update(build_s=round(build_s, 1), so_mib=round(os.path.getsize(so) / 2**20, 1), timings=t)
    if a.per_layer:
        mods = {k: f for k, f in sides.items() if isinstance(f, Module)}
        row.update(per_layer=per_layer(mods, x, a.per_layer), per_layer_calls=a.per_layer)
    if not a.no_generic and batch == 1:  # (the generic build takes seconds per image)
        row["build_generic_s"] = round(compile_so(onnx, so_g, True, a.threads, layout), 1)
        mg = Module(so_g)
        row["generic_exact_equal"] = bool(np.array_equal(mg(x), m(x)))
        t.update(bench({"generic": mg}, x, 1, a.generic_runs, a.rounds))
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nets", default="resnet18,resnet50")
    ap.add_argument("--bits", default="8", help="comma-separated qmodel bit schemes (8, 4, w4a8, ...)")
    ap.add_argument("--batch", default="1", help="comma-separated batch sizes")
    ap.add_argument("--layout", default="NCHW", help="comma-separated qcompile --layout values (NCHW, NHWC)")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--no-generic", action="store_true", help="skip the generic-conv build (slow: seconds per call)")
    ap.add_argument("--no-torch", action="store_true", help="skip the PyTorch fp32 baseline")
    ap.add_argument("--generic-runs", type=int, default=1, help="timed calls of the generic build per round")
    ap.add_argument("--per-layer", type=int, default=0, metavar="N",
                    help="also time each conv / dense kernel of the qcompile builds over N forward passes (the VM's "
                         "instrument hook, the builds in turns): per-layer minima and medians, summed per output "
                         "size")
    ap.add_argument("--s4-baseline", action="store_true",
                    help="models with 4-bit weights: also build them with QCOMPILE_CPU_S4=0 (4-bit weights one per "
                         "byte, cpu_direct_vnni everywhere) and time that build beside the default one, in turns "
                         "(the s4 table)")
    ap.add_argument("--models", default=None, help="folder for the ONNX models and .so files (default: a temp dir)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--write", nargs="+", metavar="FILE", help="replace the tables' blocks (<!-- table:cpu -->, "
                    "<!-- table:cpu_readme -->) in those of these files that have them")
    ap.add_argument("--table", metavar="RESULTS", help="only write the table of this results file")
    a = ap.parse_args(argv)
    a.checked = set()  # (batch-1 builds of this run found exact: larger batches are checked against them)
    if a.table:
        write_tables(json.loads(pathlib.Path(a.table).read_text()), a.write or [])
        return 0
    os.environ["TVM_NUM_THREADS"] = str(a.threads)  # (before TVM's thread pool starts)
    import onnxruntime as ort

    folder = a.models or tempfile.mkdtemp(prefix="bench_cpu_")
    os.makedirs(folder, exist_ok=True)
    res = {"device": cpu_name(), "date": datetime.date.today().isoformat(),
           "command": "python scripts/bench_cpu.py " + " ".join(shlex.quote(s) for s in (argv or sys.argv[1:])),
           "threads": a.threads, "onnxruntime": ort.__version__, "json": a.json, "kernel": host_kernel(),
           "results": []}
    rng = np.random.default_rng(0)
    for net, bits, batch, layout in itertools.product(a.nets.split(","), a.bits.split(","),
                                                      [int(b) for b in a.batch.split(",")], a.layout.split(",")):
        row = bench_row(a, net, bits, batch, layout, folder, rng)
        res["results"].append(row)
        print(json.dumps(row), flush=True)
    print(table(res))
    if a.s4_baseline:
        print(s4_table(res))
    if a.per_layer:
        print(per_layer_table(res))
    if a.json:
        pathlib.Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(a.json).write_text(json.dumps(res, indent=1) + "\n")
    if a.write:
        write_tables(res, a.write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
