#!/usr/bin/env python3
"""Per-layer benchmark of the tensor-core conv kernels: every ResNet-50 conv at batch 8 / 64 / 256, INT8 and INT4,
against cuDNN fp16 (``F.conv2d``, channels_last, ``cudnn.benchmark``) and ``torch._int_mm`` on the GEMM-equivalent
shape, all timed in one process on the GPU host.

  build host:  python scripts/tune_layers.py build --as-compiled --batches 8 64 256     (every layer as compiled
               models run it: select_strategy and the tuning log's knobs)
               [python scripts/bench_layers.py build   = scripts/device_build.py: the bench with the arch defaults]
  GPU host:    python3 scripts/tune_layers.py device --ncu-before 0 --tune-budget 60 --bench-budget 200 --ab-rounds 9
               (--ab-rounds N: each layer's INT8 and INT4 kernels also timed alternately N times, paired ratios)
  tables:      python scripts/bench_layers.py table RESULTS.json [--write docs/BENCHMARKS.md]
               python scripts/bench_layers.py table RESULTS.json --paired [--write docs/BENCHMARKS.md]

``table`` writes the layer table (block ``layers``); ``--paired`` the INT4-against-INT8 summary from the paired
timings (block ``layers_int4_vs_int8``). Both take the date, device and commands from the results file.
"""
from __future__ import annotations

import argparse
import json
import math
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
PEAK_INT8_MMA_SYNC = 1284  # TOPS, H100 SXM: mma.sync s8 m16n8k32 from registers (the dense wgmma peak is 1979)
TIMING = {"b2b": "per launch, from 20 back-to-back launches between two CUDA events (median of 7 rounds)",
          "graph": "per launch, from 20 launches captured in one CUDA graph (no host launch cost), median of 7 replays"}


def _gm(xs):
    xs = list(xs)
    return math.exp(sum(map(math.log, xs)) / len(xs))


def _caption(res, device=None, date=None, timing=True):
    device = res.get("device") or device or "?"  # (``device`` / ``date``: for results files without them)
    date = res.get("date") or date or "?"
    out = f"{device}, {date}" + (f", code at `{res['commit']}`" if res.get("commit") else "") + "."
    if timing:
        how = TIMING.get(res.get("timing"), "median of 20 launches, each timed alone (including its host launch)")
        out += f" Times in ms, {how}; TOPS = 2 x MACs / time."
    if res.get("build_command"):
        out += f" Built with `{res['build_command']}`"
        out += f", measured on the GPU host with `{res['command']}`." if res.get("command") else "."
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
        best = max(r3, key=lambda r: r["gops"] / min(r["int8_ms"], r["int4_ms"]))
        t8, t4 = best["gops"] / best["int8_ms"], best["gops"] / best["int4_ms"]
        out.append(f"| {N} | {_gm(r['cudnn_fp16_ms'] / r['int8_ms'] for r in rs):.2f}x | "
                   f"{_gm(r['cudnn_fp16_ms'] / r['int4_ms'] for r in rs):.2f}x | "
                   f"{_gm(r['cudnn_fp16_ms'] / r['int8_ms'] for r in r3):.2f}x | "
                   f"{best['layer'].rsplit('_b', 1)[0]}: INT8 {t8:.0f} TOPS ({100 * t8 / PEAK_INT8_MMA_SYNC:.0f}% of "
                   f"mma.sync's {PEAK_INT8_MMA_SYNC}), INT4 {t4:.0f} |")
    return "\n".join(out) + "\n"


def paired_table(path, device=None, date=None, threshold=1.02):
    """INT4 against INT8 per batch from the paired timings (``--ab-rounds``): the geomean speed-up, and every layer
    where INT4 takes more than ``threshold`` x INT8's time."""
    res = json.loads(pathlib.Path(path).read_text())
    rows = [r for r in res["bench"] if "int4_over_int8_ab" in r]
    if not rows:
        raise SystemExit(f"{path}: no paired INT4 / INT8 timings (tune_layers.py device --ab-rounds N)")
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
    if argv[:1] == ["build"]:
        sys.exit(subprocess.call([sys.executable, str(ROOT / "scripts" / "device_build.py"), *argv[1:]]))
    sys.path.insert(0, str(ROOT / "scripts"))
    import e2e_table

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("build", help="scripts/device_build.py (its options follow)")
    t = e2e_table.add_table_command(sub, "layers (layers_int4_vs_int8 with --paired)", "the layer table of a results file")
    t.add_argument("--paired", action="store_true", help="the INT4-against-INT8 summary instead")
    t.add_argument("--device", help="device name where the results file has none")
    a = ap.parse_args(argv)
    if a.paired:
        name = "layers_int4_vs_int8" if a.name.startswith("layers (") else a.name
        e2e_table.write_block(name, paired_table(a.results, a.device), a.write)
    else:
        name = "layers" if a.name.startswith("layers (") else a.name
        e2e_table.write_block(name, table(a.results, a.device), a.write)


if __name__ == "__main__":
    main()
