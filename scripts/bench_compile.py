#!/usr/bin/env python
"""Compile-time benchmark: qcompile of a quantized ResNet for the llvm target, per phase, on this machine.

    python scripts/bench_compile.py run --net resnet50 --bits 8 --layout NCHW NHWC HWNC [--out DIR]
    python scripts/bench_compile.py table DIR/bench_compile.json [--write docs/BENCHMARKS.md]

``run`` quantizes the net (seeded random weights; not timed), exports ONNX QDQ at batch 1, then times
``compile_model`` per layout by its progress lines (import, integer lowering + packing, TVM build) and the export
of the .so; one JSON file (default DIR: build/bench) with the host, date and command. ``table`` writes its Markdown
table (block ``compile_time``).
"""
import argparse
import datetime
import json
import os
import pathlib
import platform
import shlex
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


def cmd_run(a):
    import torch

    from qcompile.driver import CompileOptions, compile_model
    from qcompile.models.export_onnx import export_onnx
    from qcompile.models.quantize import quantize_model
    from qcompile.models.resnet import build_model

    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    res = {"date": datetime.date.today().isoformat(), "host": f"{os.cpu_count()} cores, {_cpu_name()}",
           "net": a.net, "bits": a.bits, "size": a.size, "batch": 1,
           "command": shlex.join(["python", "scripts/bench_compile.py", *sys.argv[1:]]),
           "load_average": round(os.getloadavg()[0], 2), "layouts": []}  # (other work on the host slows it)
    with tempfile.TemporaryDirectory() as d:
        qm = quantize_model(build_model(a.net), torch.randn(4, 3, a.size, a.size),
                            bits=int(a.bits) if a.bits in ("4", "8") else a.bits)
        path = os.path.join(d, "m.onnx")
        export_onnx(qm, path, (1, 3, a.size, a.size), batch=1)
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
    (out / "bench_compile.json").write_text(json.dumps(res, indent=1) + "\n")
    print("wrote", out / "bench_compile.json")


def _phase(name):
    """A phase's column: its progress line without the file name or target details."""
    for key, col in (("import", "import"), ("lowering", "integer lowering + packing"), ("building", "TVM build"),
                     ("export", "export .so"), ("writing", "export .so")):
        if name.startswith(key):
            return col
    return name


def table(path):
    res = json.loads(pathlib.Path(path).read_text())
    cols = []
    for row in res["layouts"]:
        for name, _ in row["phases"]:
            if _phase(name) not in cols and name != "summary":  # (printing the layer table: ~0 s)
                cols.append(_phase(name))
    bits = {"8": "INT8", "4": "INT4"}.get(res["bits"], res["bits"])
    net = {"resnet18": "ResNet-18", "resnet50": "ResNet-50"}.get(res["net"], res["net"])
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


def main(argv=None):
    sys.path.insert(0, str(ROOT / "scripts"))
    import e2e_table

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="compile and time (this machine)")
    r.add_argument("--net", default="resnet50")
    r.add_argument("--bits", default="8")
    r.add_argument("--size", type=int, default=224)
    r.add_argument("--layout", nargs="+", default=["NCHW", "NHWC"])
    r.add_argument("--out", default=str(ROOT / "build" / "bench"), help="results folder (default: %(default)s)")
    e2e_table.add_table_command(sub, "compile_time")
    a = ap.parse_args(argv)
    if a.cmd == "run":
        cmd_run(a)
    else:
        e2e_table.write_block(a.name, table(a.results), a.write)


if __name__ == "__main__":
    main()
