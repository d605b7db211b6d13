#!/usr/bin/env python
"""Accuracy on real data, measured through the compiled .so: scikit-learn digits.

    python scripts/digits_accuracy.py [run] [-o out/digits]     # trains (~30 s) unless out/digits has the models
    python scripts/digits_accuracy.py table out/digits/digits_accuracy.json [--write docs/BENCHMARKS.md]

``run`` trains resnet_tiny on digits (scripts/train_digits.py), quantizes it to int8 / int4 / mixed (ONNX QDQ),
compiles each with qcompile for llvm, runs the 360 test images through the .so with the TVM runtime, prints float
vs compiled accuracy as a Markdown table and writes it to DIR/digits_accuracy.json. ``table`` writes that table
(block ``digits``) from the JSON.
"""
import argparse
import datetime
import json
import os
import pathlib
import shlex
import subprocess
import sys
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTES = {"int4": "input, first conv and last layer 8-bit", "mixed": "middle 3x3 convs W4A4"}


def cmd_run(a):
    from qcompile.driver import CompileOptions, compile_model
    from qcompile.runtime import Module

    if not os.path.exists(os.path.join(a.out, "accuracy.json")):
        here = os.path.dirname(os.path.abspath(__file__))
        subprocess.run([sys.executable, os.path.join(here, "train_digits.py"), "-o", a.out, "--no-pt2"], check=True)
    acc = json.load(open(os.path.join(a.out, "accuracy.json")))
    x, y = np.load(os.path.join(a.out, "x_test.npy")), np.load(os.path.join(a.out, "y_test.npy"))
    rows = [("float (PyTorch)", None, acc.get("float", acc.get("float_acc")))]
    for tag in ("int8", "int4", "mixed"):
        path = os.path.join(a.out, f"digits_{tag}.onnx")
        t0 = time.time()
        res = compile_model(path, CompileOptions(layout=a.layout), log=lambda s: None)
        so = os.path.join(a.out, f"digits_{tag}.so")
        res.export(so)
        m = Module(so)
        pred = np.array([m(x[i: i + 1]).argmax() for i in range(len(x))])
        rows.append((f"{tag} (compiled .so, llvm {a.layout})", res.meta["bits"], 100.0 * float((pred == y).mean())))
        print(f"{tag}: compiled in {time.time() - t0:.1f} s, accuracy {rows[-1][2]:.2f}%", flush=True)
    res = {"date": datetime.date.today().isoformat(), "n_test": int(len(x)), "layout": a.layout,
           "command": shlex.join(["python", "scripts/digits_accuracy.py", *sys.argv[1:]]),
           "rows": [{"model": name, "bits": bits, "accuracy": acc} for name, bits, acc in rows]}
    pathlib.Path(a.out, "digits_accuracy.json").write_text(json.dumps(res, indent=1) + "\n")
    print("\n" + table(os.path.join(a.out, "digits_accuracy.json")))


def table(path):
    res = json.loads(pathlib.Path(path).read_text())
    out = [f"scikit-learn digits, {res['n_test']} test images, resnet_tiny (8x8 input), {res['date']}. Command: "
           f"`{res['command']}`.", "", "| model | accuracy (%) | vs float |", "|---|---|---|"]
    f = res["rows"][0]["accuracy"]
    for r in res["rows"]:
        name = r["model"]
        tag = name.split(" ")[0]
        if tag in NOTES:
            name = name.replace(")", f"; {NOTES[tag]})", 1)
        out.append(f"| {name} | {r['accuracy']:.2f} | {r['accuracy'] - f:+.2f} |")
    return "\n".join(out) + "\n"


def main(argv=None):
    sys.path.insert(0, str(ROOT / "scripts"))
    import e2e_table

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] not in (["run"], ["table"], ["-h"], ["--help"]):
        argv = ["run", *argv]
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="train (if needed), compile, measure")
    r.add_argument("-o", "--out", default="out/digits", help="models and results (default: %(default)s)")
    r.add_argument("--layout", default="NHWC")
    t = sub.add_parser("table", help="the Markdown table of a results file")
    t.add_argument("results")
    e2e_table.add_write_args(t, "digits")
    a = ap.parse_args(argv)
    if a.cmd == "run":
        cmd_run(a)
    else:
        e2e_table.write_block(a.name, table(a.results), a.write)


if __name__ == "__main__":
    main()
