"""Markdown table of conv_s8's output (CUTLASS sm_90 int8 conv baseline), beside qcompile's per-layer kernel times.

1. Read conv_s8's JSON (``results``: per shape the fastest exact configuration, or none).
2. Read the roofline JSON (``scripts/roofline.py collect``): the 8-bit entry whose batch matches a shape's N gives
   each layer's ncu kernel time (launch i of ``launches`` is kernel i of ``kernels``).
3. Print one row per shape: CUTLASS config, time, TOPS, exactness, and where the shape's layers have roofline times,
   qcompile's mean kernel time over those layers and the ratio; then per batch the sum over layers.

The two times are not taken the same way: conv_s8 replays one kernel back-to-back (CUDA graph, CUDA events), so its
weights and part of its input stay in L2; the roofline's are ncu's per-kernel durations within one forward pass
(``--cache-control none --clock-control none``: L2 holds what the previous layer left). qcompile's kernels also do
more (per-channel requantize, bias, fused residual add). Read the ratio as indicative.

Usage: python3 scripts/cutlass_baseline/table.py OUT.json [--roofline PATH | --no-roofline]
"""
import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
DEFAULT_ROOFLINE = ROOT / "docs" / "bench" / "roofline_resnet50_h100.json"


def load_json(path: Path, what: str) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        sys.exit(f"error: {path}: cannot read {what}: {e}")


def layer_times(roofline: dict) -> dict:
    """Step 2: {batch: {layer name: ncu kernel time in us}} of the 8-bit entries (a layer's kernels summed)."""
    out: dict = {}
    for entry in roofline.get("entries", []):
        if str(entry.get("bits")) != "8":
            continue
        plan, kernels = entry.get("launches", []), entry.get("kernels", [])
        if len(plan) != len(kernels):
            continue
        times = out.setdefault(int(entry["batch"]), {})
        for launch, kern in zip(plan, kernels):
            if launch.get("layer"):
                times[launch["layer"]] = times.get(launch["layer"], 0.0) + kern["time_ns"] / 1e3
    return out


def fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def shape_row(res: dict, qtimes: dict) -> str:
    """Step 3: one markdown row of a shape."""
    best = res.get("best")
    statuses = sorted({c["status"] for c in res["configs"]})
    mism = [c["config"] for c in res["configs"] if c["status"] == "ok" and not c["exact"]]
    layers = res.get("layers", [])
    q = [qtimes[name] for name in layers if name in qtimes]
    q_mean = sum(q) / len(q) if q and len(q) == len(layers) else None
    c_us = best["time_us"] if best else None
    ratio = q_mean / c_us if (q_mean and c_us) else None
    note = "" if best else "no valid config: " + ", ".join(statuses)
    if mism:
        note += (" " if note else "") + "MISMATCH: " + ", ".join(mism)
    return (f"| {res['name']} | {len(layers)} | {best['config'] if best else '-'} | {fmt(c_us, '.1f')} | "
            f"{fmt(best['tops'] if best else None, '.0f')} | {fmt(q_mean, '.1f')} | {fmt(ratio, '.2f')} | {note} |")


def batch_totals(results: list, qt: dict) -> list:
    """Step 3: per batch, sums over layers; a layer counts once, timed by the first shape listing it that has a
    valid config (the stem's C-padded copy stands in for the C=3 shape CUTLASS cannot run)."""
    lines = []
    for batch in sorted({int(r["N"]) for r in results}):
        cut: dict = {}
        names: list = []
        for res in (r for r in results if int(r["N"]) == batch):
            for name in res.get("layers", []):
                if name not in names:
                    names.append(name)
                if res.get("best") and name not in cut:
                    cut[name] = res["best"]["time_us"]
        missing = [n for n in names if n not in cut]
        c_txt = f"{sum(cut.values()) / 1e3:.3f} ms" + (f" ({len(missing)} layers without a valid config)"
                                                      if missing else "")
        qtimes = qt.get(batch, {})
        q_txt = (f"{sum(qtimes[n] for n in names) / 1e3:.3f} ms" if names and all(n in qtimes for n in names)
                 else "-")
        lines.append(f"batch {batch}: {len(names)} conv layers, CUTLASS sum {c_txt}, qcompile sum {q_txt}")
        if names and all(n in qtimes for n in names):  # (each layer on the faster of the two kernels)
            best = sum(min(qtimes[n], cut.get(n, qtimes[n])) for n in names)
            wins = sum(1 for n in names if cut.get(n, qtimes[n]) < qtimes[n])
            lines.append(f"batch {batch}: each layer on the faster of the two: {best / 1e3:.3f} ms (CUTLASS faster on "
                         f"{wins} of {len(names)} layers)")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_json", type=Path, help="conv_s8's output")
    ap.add_argument("--roofline", type=Path, default=DEFAULT_ROOFLINE)
    ap.add_argument("--no-roofline", action="store_true", help="print CUTLASS's columns only")
    args = ap.parse_args()

    doc = load_json(args.out_json, "conv_s8 output")
    if "results" not in doc:
        sys.exit(f"error: {args.out_json}: no 'results' (not conv_s8 output)")
    qt = {} if args.no_roofline or not args.roofline.exists() else layer_times(load_json(args.roofline, "roofline"))

    print(f"CUTLASS {doc.get('cutlass')} sm_90 int8 conv fprop on {doc.get('device')} "
          f"(median of {doc.get('reps')} x {doc.get('iters')} back-to-back launches; epilogue: {doc.get('epilogue')})")
    if qt:
        print(f"qcompile: ncu kernel time per layer from {args.roofline.name} (mean over the shape's layers)")
    print()
    print("| shape | layers | CUTLASS config | CUTLASS us | TOPS | qcompile us | qcompile / CUTLASS | note |")
    print("|---|---:|---|---:|---:|---:|---:|---|")
    for res in doc["results"]:
        print(shape_row(res, qt.get(int(res["N"]), {})))
    print()
    for line in batch_totals(doc["results"], qt):
        print(line)


if __name__ == "__main__":
    main()
