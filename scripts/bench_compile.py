#!/usr/bin/env python
"""Compile-time benchmark: qcompile of a quantized ResNet on this machine, per phase, wall and CPU time.

    python scripts/bench_compile.py run --net resnet50 --bits 8 --layout NCHW NHWC HWNC [--out DIR]
    python scripts/bench_compile.py run --target cuda --arch sm_90 --batch 64 --layout NHWC \\
        [--cache cold warm off] [--repeat N] [--candidates N] [--out DIR]
    python scripts/bench_compile.py table DIR/bench_compile.json [--write docs/BENCHMARKS.md] [--name NAME]

``run`` quantizes the net (seeded random weights; not timed) and exports ONNX QDQ at the batch size.

* llvm: times ``compile_model`` per layout by its progress lines (import, integer lowering + packing, TVM build) and
  the export of the .so.
* cuda: each compile runs in a fresh Python process (``qcompile``'s own work: importing TVM, the model, lowering,
  kernels, nvcc, the .so), once per kernel-cache state: ``cold`` (an empty cache folder), ``warm`` (the folder the
  cold run filled), ``off`` (``QCOMPILE_KERNEL_CACHE=0``); ``--repeat`` runs each state that many times. Each run
  reports wall and CPU time (user + system, nvcc's processes included) of the whole process and of each phase, and
  the nvcc statistics (kernels, cache hits, nvcc wall and CPU). ``--candidates N`` then builds N of the model's
  conv kernels one at a time as the tuner builds a candidate (plan, TVM build with nvcc SASS, export), with a cold
  and then a warm cache, and reports each one's time split.

One JSON file (default DIR: build/bench) with the host, its load average, the date and the command; ``table`` writes
its Markdown table (block ``compile_time``; pass ``--name`` for another block).
"""
import argparse
import datetime
import json
import os
import pathlib
import pickle
import platform
import resource
import shlex
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _cpu_name():
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cpu_s() -> float:
    """CPU seconds (user + system) of this process and its waited-for children."""
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


def _export_model(a, d):
    import torch

    from qcompile.models.export_onnx import export_onnx
    from qcompile.models.quantize import quantize_model
    from qcompile.models.resnet import build_model

    torch.manual_seed(0)
    qm = quantize_model(build_model(a.net), torch.randn(4, 3, a.size, a.size),
                        bits=int(a.bits) if a.bits in ("4", "8") else a.bits)
    path = os.path.join(d, "m.onnx")
    export_onnx(qm, path, (a.batch, 3, a.size, a.size), batch=a.batch)
    return path


def cmd_run(a):
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    res = {"date": datetime.date.today().isoformat(), "host": f"{os.cpu_count()} cores, {_cpu_name()}",
           "net": a.net, "bits": a.bits, "size": a.size, "batch": a.batch, "target": a.target,
           "command": shlex.join(["python", "scripts/bench_compile.py", *sys.argv[1:]]),
           "load_average": round(os.getloadavg()[0], 2)}  # (other work on the host slows it)
    with tempfile.TemporaryDirectory() as d:
        path = _export_model(a, d)
        if a.target == "cuda":
            _run_cuda(a, path, d, res)
        else:
            _run_llvm(a, path, d, res)
    res["load_average_end"] = round(os.getloadavg()[0], 2)
    (out / "bench_compile.json").write_text(json.dumps(res, indent=1) + "\n")
    print("wrote", out / "bench_compile.json")


def _run_llvm(a, path, d, res):
    from qcompile.driver import CompileOptions, compile_model

    res["layouts"] = []
    for layout in a.layout:
        stamps = []

        def log(s):
            stamps.append((time.perf_counter(), s))

        t0 = time.perf_counter()
        r = compile_model(path, CompileOptions(layout=layout), log=log)
        so = os.path.join(d, f"m_{layout}.so")
        r.export(so)  # (logs its own "[4/4] writing ..." step)
        t1 = time.perf_counter()
        marks = [(t, s.split("] ", 1)[1].split(" ...")[0]) for t, s in stamps if s.startswith("[")]
        phases = [(name, round(tb - ta, 2)) for (ta, name), (tb, _) in zip(marks, marks[1:] + [(t1, "")])]
        row = {"layout": layout, "total_s": round(t1 - t0, 2), "phases": phases,
               "so_mib": round(os.path.getsize(so) / 2**20, 1)}
        res["layouts"].append(row)
        print(json.dumps(row), flush=True)


# ------------------------------------------------------------------------------------------------
# cuda: one compile per fresh process
# ------------------------------------------------------------------------------------------------
def _child(argv, env_extra) -> dict:
    """Run this script's ``_compile`` / ``_candidates`` step in a fresh process; its JSON result, with the process's
    wall and CPU time as the parent measures them (nvcc's processes included)."""
    env = dict(os.environ, **env_extra)
    c0, t0 = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    r = subprocess.run([sys.executable, __file__, *argv], capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    c1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    if r.returncode:
        sys.exit(f"bench_compile: {' '.join(argv[:1])} failed (exit {r.returncode}):\n{r.stderr[-3000:]}")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    out.update(process_wall_s=round(wall, 2),
               process_cpu_s=round(c1.ru_utime - c0.ru_utime + c1.ru_stime - c0.ru_stime, 2))
    return out


def _run_cuda(a, path, d, res):
    res.update(arch=a.arch, layout=a.layout[0], runs=[])
    cache = os.path.join(d, "cache")
    states = [s for s in a.cache for _ in range(a.repeat)]
    planned = os.path.join(d, "planned.pkl")
    for i, state in enumerate(states):
        env = {"QCOMPILE_CACHE_DIR": cache, "QCOMPILE_KERNEL_CACHE": "0" if state == "off" else "1"}
        if state == "cold":
            import shutil

            shutil.rmtree(cache, ignore_errors=True)
        row = _child(["_compile", path, "--arch", a.arch, "--layout", a.layout[0], "--so", os.path.join(d, "m.so"),
                      "--planned", planned], env)
        row["cache"] = state
        res["runs"].append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "phases"}), flush=True)
    if a.candidates:
        env = {"QCOMPILE_CACHE_DIR": os.path.join(d, "cache_candidates"), "QCOMPILE_KERNEL_CACHE": "1"}
        res["candidates"] = _child(["_candidates", planned, "--arch", a.arch, "-n", str(a.candidates),
                                    "--dir", d], env)
        print(json.dumps(res["candidates"]), flush=True)


def cmd_compile(a):
    """One cuda compile in this (fresh) process; prints one JSON line."""
    t0, c0 = time.perf_counter(), _cpu_s()
    marks = [(t0, c0, "import TVM and qcompile")]
    from qcompile.driver import CompileOptions, compile_model
    from qcompile.schedules.build import build_stats

    def log(s):
        if s.startswith("["):
            marks.append((time.perf_counter(), _cpu_s(), s.split("] ", 1)[1].split(" ...")[0]))

    r = compile_model(a.model, CompileOptions(target="cuda", arch=a.arch, layout=a.layout), log=log)
    r.export(a.so)
    t1, c1 = time.perf_counter(), _cpu_s()
    phases = [(_phase(name), round(tb - ta, 2), round(cb - ca, 2))
              for (ta, ca, name), (tb, cb, _) in zip(marks, marks[1:] + [(t1, c1, "")])]
    if a.planned:
        with open(a.planned, "wb") as f:
            pickle.dump([(n, pk.spec, pk.strategy, pk.knobs) for n, pk in r.planned], f)
    print(json.dumps({"wall_s": round(t1 - t0, 2), "cpu_s": round(c1 - c0, 2), "phases": phases,
                      "nvcc": build_stats().as_dict(), "so_mib": round(os.path.getsize(a.so) / 2**20, 1)}))


def cmd_candidates(a):
    """Build ``-n`` of the model's distinct conv kernels one by one as the tuner builds a candidate, cold then warm
    kernel cache; prints one JSON line."""
    import tvm

    from qcompile.schedules import plan_conv
    from qcompile.schedules.build import (build_stats, cuda_target, ensure_stub_libcuda, fast_tvmscript_macros,
                                          nvcc_options, reset_build_stats)

    ensure_stub_libcuda()
    seen, layers = set(), []
    for name, spec, strategy, knobs in pickle.load(open(a.planned, "rb")):
        key = repr((spec, strategy, knobs))
        if key not in seen:
            seen.add(key)
            layers.append((name, spec, strategy, knobs))
    step = max(1, len(layers) // a.n)
    picked = layers[::step][:a.n]
    rows = []
    for state in ("cold", "warm"):
        for name, spec, strategy, knobs in picked:
            reset_build_stats()
            t0, c0 = time.perf_counter(), _cpu_s()
            with fast_tvmscript_macros():
                pk = plan_conv(spec, a.arch, strategy, knobs)
            t1 = time.perf_counter()
            mod = tvm.IRModule({f"cand_{i}": f.with_attr("global_symbol", f"cand_{i}") for i, f in enumerate(pk.funcs)})
            with nvcc_options(a.arch, "sass"):
                lib = tvm.compile(mod, target=cuda_target(a.arch))
            t2 = time.perf_counter()
            lib.export_library(os.path.join(a.dir, "cand.so"))
            t3, c3 = time.perf_counter(), _cpu_s()
            st = build_stats()
            rows.append({"cache": state, "layer": name, "label": pk.label, "kernels": len(pk.funcs),
                         "plan_s": round(t1 - t0, 2), "build_s": round(t2 - t1 - st.nvcc_wall_s, 2),
                         "nvcc_s": round(st.nvcc_wall_s, 2), "nvcc_cpu_s": round(st.nvcc_cpu_s, 2),
                         "cache_hits": st.cache_hits, "export_s": round(t3 - t2, 2), "total_s": round(t3 - t0, 2),
                         "cpu_s": round(c3 - c0, 2)})
    print(json.dumps({"rows": rows}))


def _phase(name):
    """A phase's column: its progress line without the file name or target details."""
    for key, col in (("import T", "import TVM"), ("import", "import"), ("lowering", "integer lowering + packing"),
                     ("building", "TVM build"), ("export", "export .so"), ("writing", "export .so")):
        if name.startswith(key):
            return col
    return name


# ------------------------------------------------------------------------------------------------
# tables
# ------------------------------------------------------------------------------------------------
def table(path):
    res = json.loads(pathlib.Path(path).read_text())
    return _table_cuda(res) if res.get("target") == "cuda" else _table_llvm(res)


def _names(res):
    bits = {"8": "INT8", "4": "INT4"}.get(res["bits"], res["bits"])
    net = {"resnet18": "ResNet-18", "resnet50": "ResNet-50"}.get(res["net"], res["net"])
    return net, bits


def _table_llvm(res):
    cols = []
    for row in res["layouts"]:
        for name, _ in row["phases"]:
            if _phase(name) not in cols and name != "summary":  # (printing the layer table: ~0 s)
                cols.append(_phase(name))
    net, bits = _names(res)
    out = [f"{res['host']}, {res['date']}: {net} {bits}, {res['size']}x{res['size']}, batch "
           f"{res['batch']}, llvm target (quantization not timed; host load average {res.get('load_average', '?')} at "
           f"the start). Command: `{res['command']}`.", "",
           "| layout | total | " + " | ".join(cols) + " | .so size |", "|---|---|" + "---|" * len(cols) + "---|"]
    for row in res["layouts"]:
        t = {}
        for name, s in row["phases"]:
            t[_phase(name)] = t.get(_phase(name), 0.0) + s
        out.append(f"| {row['layout']} | {row['total_s']:.1f} s | "
                   + " | ".join(f"{t[c]:.1f} s" if c in t else "" for c in cols) + f" | {row['so_mib']:.1f} MiB |")
    return "\n".join(out) + "\n"


def _table_cuda(res):
    net, bits = _names(res)
    cols = []
    for row in res["runs"]:
        for name, *_ in row["phases"]:
            if name not in cols:
                cols.append(name)
    out = [f"{res['host']}, {res['date']}: {net} {bits}, {res['size']}x{res['size']}, batch {res['batch']}, cuda "
           f"{res['arch']}, {res['layout']} (one fresh process per build; quantization not timed; host load average "
           f"{res.get('load_average', '?')} at the start, {res.get('load_average_end', '?')} at the end). Each cell: "
           f"wall / CPU (user + system, nvcc included). Command: `{res['command']}`.", "",
           "| kernel cache | total | " + " | ".join(cols) + " | nvcc: kernels, cache hits, wall / CPU |",
           "|---|---|" + "---|" * len(cols) + "---|"]
    for row in res["runs"]:
        t = {name: (w, c) for name, w, c in row["phases"]}
        nv = row["nvcc"]
        out.append(f"| {row['cache']} | {row['process_wall_s']:.1f} / {row['process_cpu_s']:.1f} s | "
                   + " | ".join(f"{t[c][0]:.1f} / {t[c][1]:.1f} s" if c in t else "" for c in cols)
                   + f" | {nv['units']}, {nv['cache_hits']}, {nv['nvcc_wall_s']:.1f} / {nv['nvcc_cpu_s']:.1f} s |")
    cand = res.get("candidates")
    if cand:
        out += ["", "One conv layer's kernels built as the tuner builds a candidate (plan, TVM build with nvcc SASS, "
                "export), in one process, an empty kernel cache and then the same again:", "",
                "| layer | kernel | cache | total | plan | TVM build | nvcc wall / CPU | export |",
                "|---|---|---|---|---|---|---|---|"]
        for r in cand["rows"]:
            out.append(f"| {r['layer']} | {r['label']} | {r['cache']} | {r['total_s']:.2f} s | {r['plan_s']:.2f} s | "
                       f"{r['build_s']:.2f} s | {r['nvcc_s']:.2f} / {r['nvcc_cpu_s']:.2f} s | {r['export_s']:.2f} s |")
    return "\n".join(out) + "\n"


def main(argv=None):
    sys.path.insert(0, str(ROOT / "scripts"))
    import e2e_table

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="compile and time (this machine)")
    r.add_argument("--net", default="resnet50")
    r.add_argument("--bits", default="8")
    r.add_argument("--size", type=int, default=224)
    r.add_argument("--batch", type=int, default=1)
    r.add_argument("--target", choices=("llvm", "cuda"), default="llvm")
    r.add_argument("--arch", default="sm_90", help="cuda: the arch (default: %(default)s)")
    r.add_argument("--layout", nargs="+", default=None,
                   help="layouts (default: NCHW NHWC on llvm, NHWC on cuda; cuda takes the first)")
    r.add_argument("--cache", nargs="+", choices=("cold", "warm", "off"), default=["cold", "warm"],
                   help="cuda: kernel-cache states, in order (default: cold warm)")
    r.add_argument("--repeat", type=int, default=1, help="cuda: runs per cache state (default: %(default)s)")
    r.add_argument("--candidates", type=int, default=0,
                   help="cuda: time this many of the model's conv kernels built as tuner candidates (default: none)")
    r.add_argument("--out", default=str(ROOT / "build" / "bench"), help="results folder (default: %(default)s)")
    c = sub.add_parser("_compile")  # (internal: one cuda compile in a fresh process)
    c.add_argument("model")
    c.add_argument("--arch", required=True)
    c.add_argument("--layout", required=True)
    c.add_argument("--so", required=True)
    c.add_argument("--planned")
    k = sub.add_parser("_candidates")  # (internal: candidate builds in a fresh process)
    k.add_argument("planned")
    k.add_argument("--arch", required=True)
    k.add_argument("-n", type=int, required=True)
    k.add_argument("--dir", required=True)
    e2e_table.add_table_command(sub, "compile_time")
    a = ap.parse_args(argv)
    if a.cmd == "run":
        a.layout = a.layout or (["NHWC"] if a.target == "cuda" else ["NCHW", "NHWC"])
        cmd_run(a)
    elif a.cmd == "_compile":
        cmd_compile(a)
    elif a.cmd == "_candidates":
        cmd_candidates(a)
    else:
        e2e_table.write_block(a.name, table(a.results), a.write)


if __name__ == "__main__":
    main()
