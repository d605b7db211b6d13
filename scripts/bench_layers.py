#!/usr/bin/env python3
"""Per-layer benchmark of the tensor-core conv kernels vs cuDNN fp16 and torch._int_mm.

Three steps (the middle one is the single device call):
  1. here:      python scripts/bench_layers.py build        # = device_build.py (bench + check sets)
                scripts/make_runtime_bundle.sh 3.12
  2. GPU host:  run(command="bash scripts/device_run.sh", carry=[".device", ".bundle"])
                (device_run.py times every ResNet-50 conv shape at batch 8/64/256, INT8 and INT4, and the
                cuDNN fp16 channels_last conv + torch._int_mm on the GEMM-equivalent shape, same run)
  3. here:      python scripts/bench_layers.py table RESULTS.json [--device NAME] >> docs/BENCHMARKS.md
"""
from __future__ import annotations

import json
import math
import pathlib
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]


def table(path, device="NVIDIA H100 80GB HBM3", date=None):
    res = json.loads(pathlib.Path(path).read_text())
    if date is None:  # (the device run records its date; older results files: the file's own date)
        date = res.get("date") or time.strftime("%Y-%m-%d", time.localtime(pathlib.Path(path).stat().st_mtime))
    rows = res["bench"]
    timing = {"b2b": "per launch, from 20 back-to-back launches between two CUDA events (median of 7 rounds)",
              "graph": "per launch, from 20 launches captured in one CUDA graph (no host launch cost), median of 7 "
                       "replays"}.get(res.get("timing"), "median of 20 launches, each timed alone (including its host "
                                                         "launch)")
    out = [f"## Tensor-core INT8/INT4 conv2d kernels, per ResNet-50 layer ({date})", "",
           f"Device: {device} (sm_90). Command: `python scripts/device_build.py && scripts/make_runtime_bundle.sh 3.12`, "
           "then one device call `bash scripts/device_run.sh` (carry `.device`, `.bundle`), then "
           "`python scripts/bench_layers.py table results.json`. Kernels: implicit-GEMM NHWC, uint8 (uint4) activations x "
           "int8 (int4) weights, int32 accumulation, fused requant epilogue to uint8 (uint4), untuned sm_90 defaults "
           "(128x128x64 B tiles, 2x2 warps, 4-stage cp.async). Times (ms): " + timing + "; TOPS = 2*MACs/time. "
           "cuDNN fp16: `F.conv2d` channels_last, cudnn.benchmark; int_mm: `torch._int_mm` on the GEMM-equivalent "
           "(N*P*Q x R*S*C) @ (R*S*C x K) shape (no im2col cost counted; n/a = cuBLASLt refused the shape).", "",
           "| layer | N | C->K | RxS/s | GOP | INT8 ms | INT8 TOPS | INT4 ms | INT4 TOPS | cuDNN fp16 ms | int_mm ms | INT8 / cuDNN speedup | INT4 / INT8 |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        i8, i4, cd, im = r.get("int8_ms"), r.get("int4_ms"), r["cudnn_fp16_ms"], r["int_mm_ms"]
        name = r["layer"].rsplit("_b", 1)[0]
        out.append(f"| {name} | {r['N']} | {r['C']}->{r['K']} | {r['R']}x{r['R']}/{r['stride']} | {r['gops']:.2f} | "
                   f"{i8:.4f} | {r['gops'] / i8:.0f} | {i4:.4f} | {r['gops'] / i4:.0f} | {cd:.4f} | "
                   f"{'n/a' if math.isnan(im) else f'{im:.4f}'} | {cd / i8:.2f}x | {i8 / i4:.2f}x |")
    out.append("")
    # summary vs targets
    for N in sorted({r["N"] for r in rows}):  # (the batch sizes the results have)
        rs = [r for r in rows if r["N"] == N]
        g8 = math.exp(sum(math.log(r["cudnn_fp16_ms"] / r["int8_ms"]) for r in rs) / len(rs))
        g4 = math.exp(sum(math.log(r["cudnn_fp16_ms"] / r["int4_ms"]) for r in rs) / len(rs))
        r3 = [r for r in rs if r["R"] == 3]
        g3 = math.exp(sum(math.log(r["cudnn_fp16_ms"] / r["int8_ms"]) for r in r3) / len(r3))
        slower = sum(r["int4_ms"] > r["int8_ms"] * 1.02 for r in rs)
        out.append(f"* batch {N}: geomean speedup vs cuDNN fp16 INT8 {g8:.2f}x, INT4 {g4:.2f}x; 3x3 layers INT8 {g3:.2f}x; "
                   f"INT4 slower than INT8 (>2%) on {slower}/{len(rs)} layers")
        ab = [r for r in rs if "int4_over_int8_ab" in r]
        if ab:  # (tune_layers.py device --ab-rounds: the two kernels timed alternately, median of per-round ratios)
            worst = max(ab, key=lambda r: r["int4_over_int8_ab"])
            n = len(worst["int4_over_int8_ab_rounds"])
            out.append(f"  paired ({n} alternating rounds): INT4 slower than INT8 (>2%) on "
                       f"{sum(r['int4_over_int8_ab'] > 1.02 for r in ab)}/{len(ab)} layers; the largest INT4 / INT8 time "
                       f"ratio {worst['int4_over_int8_ab']:.3f} ({worst['layer']})")
    best = max(rows, key=lambda r: r["gops"] / min(r["int8_ms"], r["int4_ms"]) if r["R"] == 3 else 0)
    out.append(f"* best 3x3 layer: {best['layer']} INT8 {best['gops'] / best['int8_ms']:.0f} TOPS "
               f"({100 * best['gops'] / best['int8_ms'] / 1284:.0f}% of 1284), INT4 {best['gops'] / best['int4_ms']:.0f} TOPS")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "build":
        sys.exit(subprocess.call([sys.executable, str(ROOT / "scripts" / "device_build.py"), *sys.argv[2:]]))
    if len(sys.argv) > 2 and sys.argv[1] == "table":
        dev = sys.argv[sys.argv.index("--device") + 1] if "--device" in sys.argv else "NVIDIA H100 80GB HBM3"
        print(table(sys.argv[2], dev))
    else:
        print(__doc__)
