#!/usr/bin/env python3
"""The grouped 3x3 convs of ResNeXt on their two CUDA kernels: the CUDA-core ``grouped`` (dp4a) against the
tensor-core ``grouped_gemm`` (schedules/grouped_gemm.py) where it takes the layer, per layer and batch size.

  GPU host (qcompile with TVM, nvcc):
      python3 scripts/bench_grouped_gemm.py [--net resnext50_32x4d] [--batches 256 1] [--out DIR] [--no-configs]

Each distinct grouped layer of the net (``LAYERS``: 224x224 input; a stage's first block has stride 2) is built as a
compiled model runs it (uint8 activations after ReLU, int8 weights, the requantize epilogue with S >= 33):
``grouped`` with its automatic tile, ``grouped_gemm`` with its default knobs and (unless ``--no-configs``) every
start point of its tuning space (``SPACES["grouped_gemm"].configs``), the fastest reported. Every kernel of a layer
runs once on the same random inputs and must equal the others bit for bit (and, at batch sizes up to 8, the NumPy
integer reference); then each is timed with TVM's ``time_evaluator`` (median of 7 repeats of at least 20 ms of
back-to-back launches). Writes DIR/grouped_gemm_bench.json (DIR: --out, else $OUT, else the current folder) and
prints the table: time per launch in microseconds, and the speed-up of the best ``grouped_gemm`` kernel over
``grouped`` (the ``layers`` count: how often the net runs the layer).
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

import numpy as np

# (C = K, input H = W, stride, how many layers of the net have this shape); groups 32; 3x3, padding 1
LAYERS = {
    "resnext50_32x4d": [(128, 56, 1, 3), (256, 56, 2, 1), (256, 28, 1, 3), (512, 28, 2, 1), (512, 14, 1, 5),
                        (1024, 14, 2, 1), (1024, 7, 1, 2)],
    "resnext101_32x8d": [(256, 56, 1, 3), (512, 56, 2, 1), (512, 28, 1, 3), (1024, 28, 2, 1), (1024, 14, 1, 22),
                         (2048, 14, 2, 1), (2048, 7, 1, 2)],
}
GROUPS = 32


def layer_spec(C: int, H: int, stride: int, N: int):
    from qcompile.schedules import ConvSpec

    return ConvSpec(N=N, H=H, W=H, C=C, K=C, R=3, S=3, stride=stride, padding=1, x_dtype="uint8", out_dtype="uint8",
                    zo=0, lo=0, hi=255, shift_ge33=True, groups=GROUPS)


def problem(spec, seed: int) -> dict:
    """Random inputs: x uint8, OHWI weights int8 [K, 3, 3, Cg], bias, and M, S (S in 33..40) that spread the outputs."""
    rng = np.random.default_rng(seed)
    cg = spec.C // spec.groups
    x = rng.integers(0, 256, (spec.N, spec.H, spec.W, spec.C), dtype=np.uint8)
    w = rng.integers(-128, 128, (spec.K, spec.R, spec.S, cg), dtype=np.int8)
    sd = 128.0 * 74.0 * np.sqrt(spec.R * spec.S * cg)  # (about the spread of the sums)
    S = rng.integers(33, 41, spec.K).astype(np.int32)
    M = np.clip(np.round(64.0 / sd * 2.0 ** S), 1, 2**31 - 1).astype(np.int32)
    bias = rng.integers(-(1 << 20), 1 << 20, spec.K).astype(np.int32)
    return dict(x=x, w=w, bias=bias, M=M, S=S)


def reference(spec, p) -> np.ndarray:
    """The NumPy integer result: grouped sums, then clip(((acc + bias) * M + 2^(S-1)) >> S + zo, lo, hi)."""
    x, w = p["x"].astype(np.int64), p["w"].astype(np.int64)
    N, P, Q, K, g = spec.N, spec.P, spec.Q, spec.K, spec.groups
    cg, kg = spec.C // g, K // g
    sh = spec.strides[0]
    xp = np.zeros((N, spec.H + 2, spec.W + 2, spec.C), np.int64)
    xp[:, 1:-1, 1:-1] = x
    wg = w.reshape(g, kg, 3, 3, cg)
    acc = np.zeros((N, P, Q, g, kg), np.int64)
    for r in range(3):
        for s in range(3):
            win = xp[:, r:r + sh * (P - 1) + 1:sh, s:s + sh * (Q - 1) + 1:sh].reshape(N, P, Q, g, cg)
            acc += np.einsum("npqgc,gkc->npqgk", win, wg[:, :, r, s])
    t = acc.reshape(N, P, Q, K) + p["bias"].astype(np.int64)
    S = p["S"].astype(np.int64)
    v = (t * p["M"].astype(np.int64) + (np.int64(1) << (S - 1))) >> S
    return np.clip(v + spec.zo, spec.lo, spec.hi).astype(np.uint8)


def kernels(spec, arch: str, configs: bool) -> list:
    """(label, PlannedKernel) of the layer: grouped, grouped_gemm's default and its space's start points."""
    from qcompile.schedules.grouped import plan_grouped
    from qcompile.schedules.grouped_gemm import grouped_gemm_constraints, plan_grouped_gemm
    from qcompile.schedules.space import SPACES

    out = [("grouped", plan_grouped(spec, spec.groups, arch))]
    if grouped_gemm_constraints(spec, arch):
        return out
    out.append(("grouped_gemm", plan_grouped_gemm(spec, arch)))
    if configs:
        seen = {out[-1][1].knobs}
        for kn in SPACES["grouped_gemm"].configs(spec, arch):
            pk = plan_grouped_gemm(spec, arch, kn)
            if pk.knobs not in seen:
                seen.add(pk.knobs)
                out.append((f"grouped_gemm#{len(seen) - 1}", pk))
    return out


def build(pk, arch: str):
    import tvm

    from qcompile.schedules.build import cuda_target, nvcc_options

    with nvcc_options(arch, "sass"):
        return tvm.compile(tvm.IRModule({"k0": pk.funcs[0].with_attr("global_symbol", "k0")}), target=cuda_target(arch))


def run_layer(spec, arch: str, configs: bool, dev) -> dict:
    """Build, check (bit for bit) and time the layer's kernels; their times in microseconds."""
    import tvm

    p = problem(spec, seed=spec.C * 1000 + spec.N + spec.strides[0])
    want = reference(spec, p) if spec.N <= 8 else None
    first, res = None, {}
    for label, pk in kernels(spec, arch, configs):
        mod = build(pk, arch)
        args = [tvm.runtime.tensor(np.ascontiguousarray(a), dev)
                for a in (p["x"], pk.weights(p["w"]), p["bias"], p["M"], p["S"])]
        out_np = np.full((spec.N, spec.P, spec.Q, spec.K), 0xA5, np.uint8)
        out = tvm.runtime.tensor(out_np, dev)
        mod["k0"](*args, out)
        dev.sync()
        got = out.numpy()
        if want is not None and not np.array_equal(got, want):
            raise SystemExit(f"{label} {spec}: {int((got != want).sum())} outputs differ from the NumPy reference")
        if first is not None and not np.array_equal(got, first):
            raise SystemExit(f"{label} {spec}: {int((got != first).sum())} outputs differ from grouped's")
        first = got if first is None else first
        ev = mod.jit().time_evaluator("k0", dev, number=1, repeat=7, min_repeat_ms=20)
        t = ev(*args, out)
        res[label] = dict(us=float(np.median(t.results)) * 1e6, knobs=repr(pk.knobs))
    assert len(np.unique(first)) > 5, "degenerate outputs"
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--net", choices=sorted(LAYERS), default="resnext50_32x4d")
    ap.add_argument("--batches", type=int, nargs="+", default=[256, 1])
    ap.add_argument("--out", default=None, help="folder for grouped_gemm_bench.json (default: $OUT, else .)")
    ap.add_argument("--no-configs", action="store_true", help="grouped_gemm's default knobs only")
    a = ap.parse_args(argv)
    import tvm

    dev = tvm.cuda(0)
    cc = dev.compute_version.replace(".", "")
    arch = "sm_90" if cc == "90" else ("sm_89" if int(cc) > 90 else f"sm_{cc}")
    rows = []
    print(f"{'layer':<22}{'batch':>6}{'x':>4}{'grouped us':>12}{'gemm us':>10}{'best gemm us':>14}{'speed-up':>10}")
    for N in a.batches:
        for C, H, st, count in LAYERS[a.net]:
            spec = layer_spec(C, H, st, N)
            t0 = time.time()
            res = run_layer(spec, arch, not a.no_configs, dev)
            tc = {k: v for k, v in res.items() if k.startswith("grouped_gemm")}
            best = min(tc, key=lambda k: tc[k]["us"]) if tc else None
            row = dict(net=a.net, layer=f"C{C}_H{H}_s{st}", batch=N, count=count, cg=C // GROUPS, kernels=res,
                       best_gemm=best, speedup=(res["grouped"]["us"] / tc[best]["us"]) if best else None,
                       build_run_s=round(time.time() - t0, 1))
            rows.append(row)
            cols = [f"{res[k]['us']:.1f}" if k in res else "-" for k in ("grouped", "grouped_gemm", best)]
            up = f"{row['speedup']:.2f}x" if best else "-"
            print(f"{row['layer']:<22}{N:>6}{count:>4}{cols[0]:>12}{cols[1]:>10}{cols[2]:>14}{up:>10}", flush=True)
    out = pathlib.Path(a.out or os.environ.get("OUT") or ".")
    out.mkdir(parents=True, exist_ok=True)
    doc = dict(device=str(tvm.cuda(0).device_name), arch=arch, date=time.strftime("%Y-%m-%d %H:%M:%S UTC",
                                                                                  time.gmtime()),
               command=" ".join([sys.argv[0]] + (argv if argv is not None else sys.argv[1:])), rows=rows)
    (out / "grouped_gemm_bench.json").write_text(json.dumps(doc, indent=1))
    print(f"wrote {out / 'grouped_gemm_bench.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
