"""Compile-time benchmark: qcompile of a quantized ResNet for the llvm target, per phase.

    python scripts/bench_compile.py --net resnet50 --bits 8 --layout NCHW NHWC

Prints one line per layout with the time of import, integer lowering (+packing) and TVM build.
"""
import argparse
import os
import platform
import tempfile
import time

import numpy as np
import torch

from qcompile.driver import CompileOptions, compile_model
from qcompile.models.export_onnx import export_onnx
from qcompile.models.quantize import quantize_model
from qcompile.models.resnet import build_model


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--net", default="resnet50")
    ap.add_argument("--bits", default="8")
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--layout", nargs="+", default=["NCHW", "NHWC"])
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        qm = quantize_model(build_model(a.net), torch.randn(4, 3, a.size, a.size),
                            bits=int(a.bits) if a.bits in "48" else a.bits)
        path = os.path.join(d, "m.onnx")
        export_onnx(qm, path, (1, 3, a.size, a.size), batch=1)
        print(f"{a.net} int{a.bits} {a.size}x{a.size}, {os.cpu_count()} cores, {platform.processor() or platform.machine()}")
        for layout in a.layout:
            stamps = []
            log = lambda s: stamps.append((time.perf_counter(), s))
            t0 = time.perf_counter()
            res = compile_model(path, CompileOptions(layout=layout), log=log)
            so = os.path.join(d, f"m_{layout}.so")
            log("[5/5] exporting the .so ...")
            res.export(so)
            t1 = time.perf_counter()
            phases = [s for s in stamps if s[1].startswith("[")]
            parts = []
            for (ta, sa), (tb, _) in zip(phases, phases[1:] + [(t1, "")]):
                parts.append(f"{sa.split(' ', 1)[1].split(' ...')[0].split(' /')[0].split(' (')[0]}: {tb - ta:.1f} s")
            print(f"{layout}: total {t1 - t0:.1f} s ({'; '.join(parts)}), .so {os.path.getsize(so) / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
