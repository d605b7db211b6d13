#!/usr/bin/env python
"""Accuracy on real data, measured through the compiled .so: scikit-learn digits.

    python scripts/digits_accuracy.py -o out/digits        # trains (~30 s) unless out/digits has the models

Trains resnet_tiny on digits (scripts/train_digits.py), quantizes it to int8 / int4 / mixed (ONNX QDQ),
compiles each with qcompile for llvm, runs the 360 test images through the .so with the TVM runtime and
prints float vs compiled accuracy as a Markdown table.
"""
import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

from qcompile.driver import CompileOptions, compile_model
from qcompile.runtime import Module


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-o", "--out", default="out/digits")
    ap.add_argument("--layout", default="NHWC")
    a = ap.parse_args()
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
    print(f"\nscikit-learn digits, {len(x)} test images, resnet_tiny (8x8 input)\n")
    print("| model | accuracy (%) | vs float |")
    print("|---|---|---|")
    f = rows[0][2]
    for name, _, v in rows:
        print(f"| {name} | {v:.2f} | {v - f:+.2f} |")


if __name__ == "__main__":
    main()
