#!/usr/bin/env python3
"""Knob tuning of the tensor-core conv kernels, per ResNet-18/50 conv shape: candidates built on a machine without a
GPU, checked bit-exactly and timed on a GPU host, the fastest exact knobs merged into tuning_logs/sm_90.jsonl.

  1. build (no GPU needed; nvcc):
       python scripts/tune_layers.py build [--dir build/gpu/tune] [--batches 64 256] [--variants 6 4] [--jobs 2]
         -> DIR/*.so, DIR/manifest.json, DIR/build_command.txt: for each distinct ResNet-18/50 conv shape at each
            tuned batch, INT8 (uint8 x int8 -> uint8) and INT4 (uint4 x int4 -> uint4), NHWC implicit GEMM, a small
            candidate set of GemmKnobs (the sm_90 DEFAULT_KNOBS first, as "default"); plus default-knob kernels for
            the untuned bench batch (8). Other build modes propose other candidate sets (--wgmma / --awarp / --wsp /
            --w8 / --erq / --pp / --sk / --splits / --neighbors / --residual ...: see `build --help`);
            --append adds candidates to an existing build. Each kernel is built as compiled models run it
            (conv2d_int_plan): the split-K pair (GEMM + epilogue kernel) where the knobs split, the automatic split
            at small grids (batch 1-8) included.
       scripts/make_runtime_bundle.sh [BUNDLE_DIR]   (once; only for a GPU host without TVM: packs the TVM runtime
                                                      and the tvm-ffi wheel for that host's Python)
  2. on a GPU host with the TVM runtime, numpy and torch (the repository and DIR copied there):
       python3 scripts/tune_layers.py device [--dir build/gpu/tune] [--out OUT_DIR]
         every variant is checked bit-exactly (fresh random inputs per variant, float64 GPU conv + int64 requant
         reference cross-checked against the NumPy reference, output poisoned twice), the passing ones are timed
         (median of 7 samples x 10 launches, one CUDA-graph replay each, interleaved across variants); then the
         ResNet-50 layer bench of bench_layers.py (best kernel per shape vs cuDNN fp16 / torch._int_mm, and the
         default kernel again; with --ab-rounds N also each layer's INT8 and INT4 kernels timed alternately N times,
         the median paired ratio), then ncu on one 3x3 layer. Writes OUT_DIR/tune_results.json,
         OUT_DIR/results.json, OUT_DIR/ncu_*.txt, OUT_DIR/tune_log.txt (OUT_DIR: --out, default DIR). Where TVM does
         not import, the runtime bundle is unpacked from build/runtime_bundle ($QC_RUNTIME_BUNDLE overrides).
  3. back on the build machine:
       python scripts/tune_layers.py log OUT_DIR/tune_results.json --merge   -> tuning_logs/sm_90.jsonl
       python scripts/tune_layers.py table OUT_DIR/results.json              -> the layer table (Markdown)
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import multiprocessing as mp
import os
import pathlib
import re
import shlex
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
TUNE_DIR = ROOT / "build" / "gpu" / "tune"  # (build / device --dir default)
ARCH = "sm_90"
SM_COUNT = 132  # H100 SXM

# Candidate knobs (requested; _adapt_knobs shrinks them for small layers). Ordered by prior: large grids try
# bigger tiles / BK=128 (half the barriers per byte) / 8 warps; small grids (< 2 blocks per SM with the default)
# try smaller tiles first.
CAND = {
    "bk128": dict(BM=128, BN=128, BK=128, WM=2, WN=2, stages=3),
    "256x128": dict(BM=256, BN=128, BK=64, WM=4, WN=2, stages=3),
    "8warp": dict(BM=128, BN=128, BK=64, WM=4, WN=2, stages=4),
    "256x128bk128": dict(BM=256, BN=128, BK=128, WM=4, WN=2, stages=3),
    "128x256": dict(BM=128, BN=256, BK=64, WM=2, WN=4, stages=3),
    "64x128": dict(BM=64, BN=128, BK=128, WM=2, WN=2, stages=4),
    "128x64": dict(BM=128, BN=64, BK=128, WM=2, WN=2, stages=4),
    "64x64": dict(BM=64, BN=64, BK=128, WM=2, WN=2, stages=4),
}
# 8-warp blocks / fewer stages so that 2-3 blocks fit per SM (ncu of the tiles above: 1.5 warps per scheduler,
# occupancy limited by registers and shared memory)
CAND.update({
    "8warp_s3": dict(BM=128, BN=128, BK=64, WM=4, WN=2, stages=3),
    "8warp_bk128_s2": dict(BM=128, BN=128, BK=128, WM=4, WN=2, stages=2),
    "8warp_bk128_s3": dict(BM=128, BN=128, BK=128, WM=4, WN=2, stages=3),
    "64x128_s2": dict(BM=64, BN=128, BK=128, WM=2, WN=2, stages=2),
    "128x64_s2": dict(BM=128, BN=64, BK=128, WM=2, WN=2, stages=2),
})
# C=64 INT4 has a 32-byte reduction per (r, s): BK=64 zero-fills half of every chunk
CAND.update({"bk32": dict(BM=128, BN=128, BK=32, WM=2, WN=2, stages=4),
             "8warp_bk32": dict(BM=128, BN=128, BK=32, WM=4, WN=2, stages=4)})
# warpgroup MMA (wgmma.mma_async, sm_90a). WM x WN warpgroups of 128 threads
WGMMA = {  # (BK = 128: the 128-byte swizzle; stages 3 keeps two 128x128 blocks per SM -- both measured decisive)
    "wg128x128_bk128": dict(BM=128, BN=128, BK=128, WM=2, WN=1, stages=3),
    "wg128x256_bk128": dict(BM=128, BN=256, BK=128, WM=2, WN=1, stages=3),
    "wg256x128_bk128_4wg": dict(BM=256, BN=128, BK=128, WM=4, WN=1, stages=3),
    "wg128x128_bk128_1wg": dict(BM=128, BN=128, BK=128, WM=1, WN=1, stages=3),
    "wg128x128_bk256": dict(BM=128, BN=128, BK=256, WM=2, WN=1, stages=3),
    "wg64x128_bk128": dict(BM=64, BN=128, BK=128, WM=1, WN=1, stages=4),
    "wg128x64_bk128": dict(BM=128, BN=64, BK=128, WM=2, WN=1, stages=4),
    "wg64x64_bk128": dict(BM=64, BN=64, BK=128, WM=1, WN=1, stages=4),
}
WG_SWEEP = list(WGMMA)  # the tiles above: build --wgmma's candidates without --cands
# no MMA group left in flight (pipe=-1): the cp.async loads run stages-1 chunks ahead; stages=2 fits two 128x256 /
# 256x128 blocks per SM
WGMMA.update({
    "wg128x128_bk128_g0": dict(BM=128, BN=128, BK=128, WM=2, WN=1, stages=3, pipe=-1),
    "wg128x256_bk128_s2g0": dict(BM=128, BN=256, BK=128, WM=2, WN=1, stages=2, pipe=-1),
    "wg256x128_bk128_s2g0": dict(BM=256, BN=128, BK=128, WM=2, WN=1, stages=2, pipe=-1),
    "wg256x128_4wg_s2g0": dict(BM=256, BN=128, BK=128, WM=4, WN=1, stages=2, pipe=-1),
    "wg128x128_bk128_s2g0": dict(BM=128, BN=128, BK=128, WM=2, WN=1, stages=2, pipe=-1),
    "wg64x64_bk128_g0": dict(BM=64, BN=64, BK=128, WM=1, WN=1, stages=3, pipe=-1),
    "wg128x128_bk128_1wg_g0": dict(BM=128, BN=128, BK=128, WM=1, WN=1, stages=3, pipe=-1),
    "wg64x128_bk128_g0": dict(BM=64, BN=128, BK=128, WM=1, WN=1, stages=3, pipe=-1),
    "wg128x64_bk128_g0": dict(BM=128, BN=64, BK=128, WM=2, WN=1, stages=3, pipe=-1),
})
WGMMA.update({k + "_ev16": dict(WGMMA[k], ev=16) for k in ("wg128x128_bk128_g0", "wg128x256_bk128_s2g0",
                                                           "wg128x128_bk128_1wg_g0", "wg256x128_bk128_s2g0")})
WGMMA.update({  # narrow-N (K = 64 output channels) tiles
    "wg256x64_s2g0": dict(BM=256, BN=64, BK=128, WM=2, WN=1, stages=2, pipe=-1),
    "wg128x64_1wg_g0": dict(BM=128, BN=64, BK=128, WM=1, WN=1, stages=3, pipe=-1),
    "wg128x64_bk256_s2g0": dict(BM=128, BN=64, BK=256, WM=2, WN=1, stages=2, pipe=-1),
    "wg128x64_s4g0": dict(BM=128, BN=64, BK=128, WM=2, WN=1, stages=4, pipe=-1),
    "wg256x64_4wg_s2g0": dict(BM=256, BN=64, BK=128, WM=4, WN=1, stages=2, pipe=-1),
})
WGMMA.update({  # N tiles of 112 / 96 columns: ResNet-50's 512-channel layers at batch 64 (3136 rows) make 100 tiles of
    # 128x128 -- 32 of the 132 SMs idle -- and 125 of 128x112 (the fifth N tile half empty)
    "wg128x112_bk128_1wg_g0": dict(BM=128, BN=112, BK=128, WM=1, WN=1, stages=3, pipe=-1),
    "wg128x112_bk256_s2g0": dict(BM=128, BN=112, BK=256, WM=2, WN=1, stages=2, pipe=-1),
    "wg64x112_bk128_g0": dict(BM=64, BN=112, BK=128, WM=1, WN=1, stages=3, pipe=-1),
    "wg128x96_bk128_1wg_g0": dict(BM=128, BN=96, BK=128, WM=1, WN=1, stages=3, pipe=-1),
})
WGMMA.update({  # 256 columns per warpgroup (two m64n128 instructions on one A operand): the 4-bit register-A kernels
    # of the compute-bound layers read B from shared memory once per 256 columns instead of per 128
    "wg64x256_bk128_g0": dict(BM=64, BN=256, BK=128, WM=1, WN=1, stages=3, pipe=-1),
})
WGMMA.update({  # 256-byte K-chunks on the small tiles (8-bit: 256 k-values, 4-bit: 512 -- BK halved to 128 packed bytes):
    # the batch-8 1x1 layers with K = 1024 run 4 chunks instead of 8, half the barrier-to-MMA round trips of a grid
    # that is one wave of latency-bound blocks
    "wg128x64_bk256_g0": dict(BM=128, BN=64, BK=256, WM=2, WN=1, stages=3, pipe=-1),
    "wg64x128_bk256_g0": dict(BM=64, BN=128, BK=256, WM=1, WN=1, stages=3, pipe=-1),
    "wg64x64_bk256_g0": dict(BM=64, BN=64, BK=256, WM=1, WN=1, stages=3, pipe=-1),
})
WGMMA.update({  # deeper pipelines (1-2 MMA groups in flight, 4-6 stages) for grids of one block per SM (the batch-64
    # l4 3x3 layers: 100 tiles on 132 SMs, where no second block hides a chunk's wait)
    "wg128x128_bk128_g1s4": dict(BM=128, BN=128, BK=128, WM=2, WN=1, stages=4, pipe=0),
    "wg128x128_bk128_g2s5": dict(BM=128, BN=128, BK=128, WM=2, WN=1, stages=5, pipe=1),
    "wg128x128_bk128_1wg_g1s4": dict(BM=128, BN=128, BK=128, WM=1, WN=1, stages=4, pipe=0),
    "wg128x128_bk128_1wg_g2s5": dict(BM=128, BN=128, BK=128, WM=1, WN=1, stages=5, pipe=1),
    "wg128x128_bk128_1wg_g0s5": dict(BM=128, BN=128, BK=128, WM=1, WN=1, stages=5, pipe=-1),
    "wg128x128_bk64_1wg_g1s6": dict(BM=128, BN=128, BK=64, WM=1, WN=1, stages=6, pipe=0),
    "wg128x128_bk256_1wg_g1s3": dict(BM=128, BN=128, BK=256, WM=1, WN=1, stages=3, pipe=0),
    "wg128x128_bk256_g1s3": dict(BM=128, BN=128, BK=256, WM=2, WN=1, stages=3, pipe=0),
    "wg128x128_bk128_g1s5": dict(BM=128, BN=128, BK=128, WM=2, WN=1, stages=5, pipe=0),
    "wg128x128_bk128_g1s6": dict(BM=128, BN=128, BK=128, WM=2, WN=1, stages=6, pipe=0),
    "wg128x128_bk128_g2s6": dict(BM=128, BN=128, BK=128, WM=2, WN=1, stages=6, pipe=1),
    "wg128x128_bk64_g1s6": dict(BM=128, BN=128, BK=64, WM=2, WN=1, stages=6, pipe=0),
    "wg128x128_bk64_g2s8": dict(BM=128, BN=128, BK=64, WM=2, WN=1, stages=8, pipe=1),
    "wg128x128_bk128_g1s4_ev16": dict(BM=128, BN=128, BK=128, WM=2, WN=1, stages=4, pipe=0, ev=16),
})
WG_SWEEP_G0 = ["wg128x128_bk128_g0", "wg128x256_bk128_s2g0", "wg128x128_bk128_1wg_g0", "wg64x128_bk128_g0",
               "wg128x64_bk128_g0", "wg64x64_bk128_g0", "wg256x128_bk128_s2g0"]
CAND.update({k: dict(v, mma="wgmma") for k, v in WGMMA.items()})
ORDER_LARGE = ["bk128", "256x128", "8warp", "256x128bk128", "128x256", "128x64", "64x128", "64x64"]
ORDER_SMALL = ["bk128", "64x128", "8warp", "128x64", "64x64", "256x128", "128x256", "256x128bk128"]


def _compiled_spec(N, C, H, K, R, st, pd, x_dtype, w_bits, s2d=True, **epi):
    """The conv a compiled model runs for this layer: channels / operand widths as the dispatcher plans them
    (``operand_plan``: the RGB stem padded to 4 channels with 8-bit operands) and, with ``s2d``, the stem as the
    4x4 stride-1 conv over its space-to-depth input that CUDA builds run (``space_to_depth``). ``s2d=False``: the
    layer itself (what cuDNN is given)."""
    from qcompile.schedules import ConvSpec
    from qcompile.schedules.spec import operand_plan, space_to_depth

    c_pad, x_dtype, w_bits = operand_plan(C, x_dtype, w_bits)
    spec = ConvSpec(N=N, H=H, W=H, C=C + c_pad, K=K, R=R, S=R, stride=st, padding=pd, x_dtype=x_dtype, w_bits=w_bits,
                    shift_ge33=True, **epi)  # (the epilogue compiled models get)
    return (space_to_depth(spec) if s2d else None) or spec


def int8_spec(N, C, H, K, R, st, pd, s2d=True):
    return _compiled_spec(N, C, H, K, R, st, pd, "uint8", 8, s2d, out_dtype="uint8", zo=3, lo=0, hi=255)


def int4_spec(N, C, H, K, R, st, pd, s2d=True):
    return _compiled_spec(N, C, H, K, R, st, pd, "uint4", 4, s2d, out_dtype="uint4", zo=1, lo=0, hi=15)


RESIDUAL_LAYERS = ("_1x1b",)  # ResNet-50: the bottleneck's expansion conv carries the block's residual add
# (ResNet-18's basic block adds its residual to its second 3x3 conv, the shape of ResNet-50's stride-1 3x3: tune those
# with `build --residual --residual-layers _3x3`)


def residual_spec(spec):
    """``spec`` with the residual add a compiled ResNet-50 fuses into it (schedules/spec.py, ConvSpec): the int8 /
    int4 stage-1 intermediate, the unsigned residual input and output (after the block's ReLU), the per-tensor
    second stage compiled in (``rq2_uniform``: RQ2_RESNET50) and computed in int32, as the dispatcher plans it for a
    QDQ graph."""
    from qcompile.schedules.layers import RQ2_RESNET50

    if spec.x_bits == 4:
        return spec.replace(has_residual=True, lo=-8, hi=7, zo=0, res_dtype="uint4", zo2=0, lo2=0, hi2=15,
                            res_i32=True, rq2_uniform=RQ2_RESNET50)
    return spec.replace(has_residual=True, lo=-128, hi=127, zo=0, res_dtype="uint8", zo2=0, lo2=0, hi2=255,
                        res_i32=True, rq2_uniform=RQ2_RESNET50)


def smem_bytes(kn, spec=None) -> int:
    pitch = kn.BK * (2 if spec is not None and spec.x_bits == 4 else 1) if kn.mma == "wgmma" else kn.BK + 16
    nwarp = (kn.threads - kn.load_threads if (kn.wsp or kn.pp) else kn.threads) // 32  # (warps with accumulators)
    ring = kn.stages * (kn.BM + kn.BN) * pitch
    # the staging tile: int32 words (igemm's skewed pitch) or, with erq, bytes (BN/WN + 16 per row)
    from qcompile.schedules.igemm import staging_pitch

    wtn = kn.BN // kn.WN
    stage_c = nwarp * 16 * ((wtn + 16) if kn.erq else staging_pitch(wtn) * 4)
    if kn.mma == "wgmma" and spec is not None and spec.x_bits == 4:
        ring += kn.pstages * ((0 if kn.agl else kn.BM) + (0 if kn.w8 else kn.BN)) * kn.BK  # packed ring (w8: A only)
        if kn.areg:  # no unpacked A stages
            ring -= kn.stages * kn.BM * pitch
    agl8 = kn.mma == "wgmma" and kn.agl and spec is not None and spec.x_bits == 8
    if agl8:  # 8-bit agl: no A stages
        ring -= kn.stages * kn.BM * pitch
    if kn.mma == "wgmma":  # one buffer: the staging tile on the ring, or beside it (persist, sk, pp)
        keep = 4 * kn.threads if (kn.agl and (kn.pipe == 0 or agl8)) else 0  # (igemm's KEEP words)
        return (-(-ring // 16) * 16 + stage_c if (kn.persist or kn.sk or kn.pp) else max(ring, stage_c)) + keep
    return ring + stage_c


def _wg_tile(spec, cname):
    """The wgmma tile WGMMA[cname] for ``spec``, adapted (4-bit: BK counts packed bytes, half of them fill the same
    unpacked shared tile)."""
    from qcompile.schedules import DEFAULT_KNOBS
    from qcompile.schedules.igemm import _adapt_knobs

    kw = dict(WGMMA[cname])
    if spec.x_bits == 4:
        kw["BK"] //= 2
    return _adapt_knobs(spec, DEFAULT_KNOBS[ARCH].replace(mma="wgmma", **kw), "NHWC")


def _wg_ok(spec) -> bool:
    """wgmma tiles take 16-byte channel vectors."""
    return spec.C * spec.x_bits // 8 % 16 == 0


def _fits(kn, spec, seen) -> bool:
    """A new, valid variant whose shared tiles fit the H100 (and, with ``minb``, whose accumulators fit the register
    cap: ptxas refuses a wgmma otherwise); added to ``seen``."""
    acc = (kn.BM // kn.WM) * (kn.BN // kn.WN) // (128 if kn.mma == "wgmma" else 32)  # accumulator registers
    nres = kn.persist or kn.sk or int(kn.pp)
    minb = kn.minb or nres  # (persist, sk, pp: its blocks must be co-resident, the kernel caps registers for them)
    if kn in seen or not kn.valid() or smem_bytes(kn, spec) > 220 * 1024 or (
            minb and 65536 // (kn.threads * minb) < acc + 40) or (
            nres and nres * (smem_bytes(kn, spec) + 1024) > 228 * 1024):
        return False
    seen.add(kn)
    return True


def candidates(spec, n: int, names=None):
    """[(name, effective GemmKnobs)]: default first, then up to n-1 distinct adapted candidates (from ``names``
    when given, else by the prior order)."""
    from qcompile.schedules import DEFAULT_KNOBS
    from qcompile.schedules.igemm import _adapt_knobs

    base = DEFAULT_KNOBS[ARCH]

    def eff(kn):
        e = _adapt_knobs(spec, kn, "NHWC")
        if e.vec < 4:  # plain-load path runs 2 stages whatever is asked
            e = e.replace(stages=2)
        assert _adapt_knobs(spec, e, "NHWC") == e, (spec, e)  # the log's knobs rebuild the same kernel
        return e

    d = eff(base)
    Mtot = spec.N * spec.P * spec.Q
    blocks = math.ceil(Mtot / d.BM) * math.ceil(spec.K / d.BN)
    order = names or (ORDER_SMALL if blocks < 2 * SM_COUNT else ORDER_LARGE)
    out, seen = [("default", d)], {d}
    for name in order:
        if len(out) >= n:
            break
        e = eff(base.replace(**CAND[name]))
        if e in seen or not e.valid() or smem_bytes(e) > 220 * 1024:
            continue
        seen.add(e)
        out.append((name, e))
    return out


# ------------------------------------------------------------------------------------------------------------
# build (here)
# ------------------------------------------------------------------------------------------------------------
def r50_layer_specs(batches):
    """(NAME_bN_DT, spec, strategy) for every distinct ResNet-50 conv at each batch, INT8 and INT4, as compiled
    models run it (int8_spec / int4_spec: the C=3 stem padded to 4 channels, 8-bit inputs in both, as its
    space-to-depth conv); strategy is ``select_strategy``'s: "implicit_gemm" (GemmKnobs to tune), "direct_halo" (the
    stem: schedules/stem.py, ``build --halo``) or "fallback"."""
    from qcompile.schedules import select_strategy
    from qcompile.schedules.layers import RESNET50, distinct

    for N in batches:
        for (name, C, H, K, R, st, pd) in distinct(RESNET50):
            for dt, mk in (("int8", int8_spec), ("int4", int4_spec)):
                spec = mk(N, C, H, K, R, st, pd)
                yield f"{name}_b{N}_{dt}", spec, select_strategy(spec, ARCH)


def fallback_case(layer, spec, strategy="fallback"):
    """A layer whose kernel takes no GemmKnobs (the generic fallback; the stem's direct_halo kernel), as compiled."""
    return dict(kind="bench", layer=layer, spec=spec, strategy=strategy, knobs=None,
                variant="fallback" if strategy == "fallback" else "default", is_default=True)


def bench8_cases():
    """Bench-only ResNet-50 layers at batch 8 with the default knobs (batch 8 is not tuned)."""
    from qcompile.schedules import DEFAULT_KNOBS

    return [dict(kind="bench", layer=layer, spec=spec, strategy="implicit_gemm", knobs=DEFAULT_KNOBS[ARCH],
                 variant="default", is_default=True) if st == "implicit_gemm" else fallback_case(layer, spec, st)
            for layer, spec, st in r50_layer_specs([8])]


def make_cases(batches, nvar, names=None, only_r=None, bench8=True, only_c=None):
    from qcompile.schedules import select_strategy
    from qcompile.schedules.layers import ALL_RESNET, RESNET50

    cases = []
    r50 = {l[1:] for l in RESNET50}
    for bi, N in enumerate(batches):
        nv = nvar[min(bi, len(nvar) - 1)]
        layers = ALL_RESNET if bi == 0 else [l for l in ALL_RESNET if l[1:] in r50]  # first batch: R18 too
        for (name, C, H, K, R, st, pd) in layers:
            if (only_r and R != only_r) or (only_c and C != only_c):
                continue
            for dt, mk in (("int8", int8_spec), ("int4", int4_spec)):
                spec = mk(N, C, H, K, R, st, pd)
                layer = f"{name}_b{N}_{dt}"
                strat = select_strategy(spec, ARCH)
                if strat != "implicit_gemm":  # no GemmKnobs (the stem: direct_halo)
                    cases.append(fallback_case(layer, spec, strat))
                    continue
                for vname, kn in candidates(spec, nv, names):
                    cases.append(dict(kind="tune", layer=layer, spec=spec, strategy="implicit_gemm", knobs=kn,
                                      variant=vname, is_default=vname == "default"))
    return cases + (bench8_cases() if bench8 else [])


def make_cases_targeted(targets):
    """Wide candidate sets for named layers (``r50_l1_1x1a_b64_int4`` ...): the knobs they build with now
    ("default"), every CAND tile, and each of those with the one-barrier loop and with 16-element epilogue stores."""
    from qcompile.schedules import DEFAULT_KNOBS
    from qcompile.schedules.igemm import _adapt_knobs
    from qcompile.schedules.layers import RESNET50, distinct

    shapes = {l[0]: l[1:] for l in distinct(RESNET50)}
    cases = []
    for t in targets:
        name, rest = t.rsplit("_b", 1)
        N, dt = int(rest.split("_")[0]), rest.split("_")[1]
        C, H, K, R, st, pd = shapes[name]
        spec = (int8_spec if dt == "int8" else int4_spec)(N, C, H, K, R, st, pd)
        base = _now_knobs(spec)
        vs, seen = [("default", base)], {base}
        for cname in CAND:
            e = _adapt_knobs(spec, DEFAULT_KNOBS[ARCH].replace(**CAND[cname]), "NHWC")
            for vname, kn in ((cname, e), (cname + "_p1", e.replace(pipe=1)), (cname + "_ev16", e.replace(ev=16))):
                if kn in seen or not kn.valid() or smem_bytes(kn) > 220 * 1024:
                    continue
                seen.add(kn)
                vs.append((vname, kn))
        for vname, kn in vs:
            cases.append(dict(kind="tune", layer=t, spec=spec, strategy="implicit_gemm", knobs=kn, variant=vname,
                              is_default=vname == "default"))
    return cases


def make_cases_wgmma(batches, layers=None, dtypes=("int8", "int4"), names=None, pstages=(), areg=False,
                     areg_pipes=(-1,)):
    """Every ResNet-50 layer as compiled now (``make_cases_as_compiled``) plus, for the ``dtypes`` ones at each
    batch (or only ``layers``, NAME_bN_DT), the wgmma candidates of WGMMA as tuning variants. With ``pstages``
    the 4-bit layers get each candidate, and the knobs they compile with now when those are wgmma, once per
    packed-ring depth in ``pstages`` instead (``GemmKnobs.pstages``), with ``areg`` as register-A kernels instead
    (``GemmKnobs.areg``) for each pipe in ``areg_pipes`` (-1: 2 unpacked B stages; 0: 3, two A-fragment sets)."""
    def loaders(kn0):  # the 4-bit loader variants of one tile
        if areg:  # register A: two unpacked B stages with pipe -1, three (two fragment sets) with pipe 0
            return [kn0.replace(pstages=p, areg=True, pipe=pp, stages=3 + pp) for p in pstages if p >= 2
                    for pp in areg_pipes]
        return [kn0.replace(pstages=p, stages=st) for st in (kn0.stages, 3 + kn0.pipe)
                for p in pstages]  # (2 unpacked stages suffice behind a packed ring)

    def suffix(kn):
        return (f"_p{kn.pstages}" if kn.pstages else "") + ("_ar" + ("g1" if kn.pipe == 0 else "") if kn.areg else "")

    cases, extra = make_cases_as_compiled(batches), []
    for c in _tunable(cases, dtypes, layers):
        seen, spec = {c["knobs"]}, c["spec"]
        four = spec.x_bits == 4
        if not _wg_ok(spec):
            continue
        base = [("now", c["knobs"])] if four and pstages and c["knobs"].mma == "wgmma" else []
        base += [(cname, _wg_tile(spec, cname)) for cname in names or WG_SWEEP]
        for cname, kn0 in base:
            for kn in (loaders(kn0) if four and pstages else [kn0]):
                if _fits(kn, spec, seen):
                    extra.append(dict(c, knobs=kn, variant=cname + suffix(kn), is_default=False))
    return cases + extra


def _tunable(cases, dtypes, layers=None):
    """The tensor-core cases of ``dtypes`` (and of ``layers`` when given), marked as tuning rows."""
    for c in cases:
        if c["strategy"] == "implicit_gemm" and c["layer"].endswith(tuple(f"_{d}" for d in dtypes)) and (
                not layers or c["layer"] in layers):
            c["kind"] = "tune"
            yield c


def make_cases_minb(batches, dtypes=("int8", "int4"), minb=(2, 3, 4)):
    """Every ResNet-50 layer as compiled now plus, for the ``dtypes`` ones, its knobs with each
    ``__launch_bounds__`` minimum of blocks per SM in ``minb`` (``GemmKnobs.minb``) as tuning variants."""
    cases, extra = make_cases_as_compiled(batches), []
    for c in _tunable(cases, dtypes):
        seen = {c["knobs"]}
        for m in minb:
            if _fits(c["knobs"].replace(minb=m), None, seen):
                extra.append(dict(c, knobs=c["knobs"].replace(minb=m), variant=f"{c['variant']}_minb{m}",
                                  is_default=False))
    return cases + extra


AWARP_TILES = ["wg128x128_bk128_g0", "wg128x128_bk128_1wg_g0", "wg64x128_bk128_g0", "wg128x64_bk128_g0",
               "wg64x64_bk128_g0", "wg256x128_bk128_s2g0", "wg128x64_1wg_g0"]


def make_cases_awarp(batches, layers=None, tiles=None, minb=(0, 2), pstages=(4,)):
    """Every ResNet-50 layer as compiled now plus, for the 4-bit ones (or only ``layers``, NAME_bN_DT), register-A
    kernels whose warps copy their own A rows (``GemmKnobs.awarp``: pipe -1, two unpacked B stages) on the tile they
    compile with now and on each of ``tiles`` (WGMMA names, BK halved: packed bytes), with each packed-ring depth in
    ``pstages`` and each ``__launch_bounds__`` minimum in ``minb``, as tuning variants."""
    cases, extra = make_cases_as_compiled(batches), []
    for c in _tunable(cases, ("int4",), layers):
        spec, kn_now = c["spec"], c["knobs"]
        if spec.x_bits != 4 or not _wg_ok(spec):
            continue
        base = [("now", kn_now)] if kn_now.mma == "wgmma" else []
        base += [(cname, _wg_tile(spec, cname)) for cname in tiles or AWARP_TILES]
        seen = {kn_now}
        for cname, kn0 in base:
            for p in ((kn0.pstages,) if cname == "now" and kn0.areg else pstages):
                for m in minb:
                    kn = kn0.replace(areg=True, awarp=True, pipe=-1, stages=2, pstages=p, minb=m)
                    if _fits(kn, spec, seen):
                        extra.append(dict(c, knobs=kn, variant=f"{cname}_aw_p{p}" + (f"_minb{m}" if m else ""),
                                          is_default=False))
    return cases + extra


# persistent 8-bit wgmma tiles (GemmKnobs.persist, with erq): (WGMMA name, persist = blocks per SM). Shared memory
# per block = ring + the 8-bit staging tile beside it (128x128: 18 KiB), so two per SM need a <= 96 KiB ring
PERSIST_TILES = [("wg128x128_bk128_s2g0", 2), ("wg128x128_bk64_s4g0", 2), ("wg128x256_bk128_s2g0", 1),
                 ("wg64x128_bk128_g0", 2), ("wg128x64_bk128_g0", 2), ("wg64x128_bk64_s4g0", 3),
                 ("wg128x128_bk64_s3g0", 2)]
# more, smaller blocks per SM (non-persistent): (WGMMA name, minb); each with and without erq
OCC_TILES = [("wg64x128_bk64_s4g0", 4), ("wg64x128_bk128_g0", 3), ("wg128x64_bk128_g0", 3), ("wg128x64_bk64_s4g0", 4)]
WGMMA.update({"wg128x128_bk64_s4g0": dict(BM=128, BN=128, BK=64, WM=2, WN=1, stages=4, pipe=-1),
              "wg128x64_bk64_s4g0": dict(BM=128, BN=64, BK=64, WM=2, WN=1, stages=4, pipe=-1),
              "wg128x128_bk64_s3g0": dict(BM=128, BN=128, BK=64, WM=2, WN=1, stages=3, pipe=-1),
              "wg64x128_bk64_s4g0": dict(BM=64, BN=128, BK=64, WM=1, WN=1, stages=4, pipe=-1)})
CAND.update({k: dict(WGMMA[k], mma="wgmma") for k in ("wg128x128_bk64_s4g0", "wg128x128_bk64_s3g0",
                                                      "wg64x128_bk64_s4g0", "wg128x64_bk64_s4g0")})


def make_cases_erq(batches, layers=None, tiles=None):
    """Every ResNet-50 layer as compiled now plus, for the tensor-core ones (or only ``layers``), its knobs with the
    requantize on the accumulators and 8-bit staging (``GemmKnobs.erq``) and, for the 8-bit ones, persistent wgmma
    kernels (``GemmKnobs.persist``, with erq) on each tile of ``tiles`` (PERSIST_TILES names) and on the tile they
    compile with now, and the smaller-block tiles of OCC_TILES with their ``minb`` (with and without erq), as tuning
    variants."""
    cases, extra = make_cases_as_compiled(batches), []
    for c in _tunable(cases, ("int8", "int4"), layers):
        spec, kn_now = c["spec"], c["knobs"]
        seen = {kn_now}
        vs = [("now_erq", kn_now.replace(erq=True))] + ([("now_noerq", kn_now.replace(erq=False))] if kn_now.erq else [])
        if spec.x_bits == 8 and _wg_ok(spec):
            if kn_now.mma == "wgmma" and kn_now.split_k in (0, 1):
                vs += [(f"now_p{n}", kn_now.replace(erq=True, persist=n)) for n in (1, 2)]
            vs += [(f"{cname}_p{n}", _wg_tile(spec, cname).replace(erq=True, persist=n))
                   for cname, n in PERSIST_TILES if not tiles or cname in tiles]
            vs += [(f"{cname}_m{m}" + ("_erq" if e else ""), _wg_tile(spec, cname).replace(erq=e, minb=m))
                   for cname, m in OCC_TILES if not tiles or cname in tiles for e in (False, True)]
        for vname, kn in vs:
            if _fits(kn, spec, seen):
                extra.append(dict(c, knobs=kn, variant=vname, is_default=False))
    return cases + extra


# ping-pong tiles (GemmKnobs.pp: one block per SM, a producer warpgroup and two consumers, each a whole BM x BN tile)
PP_TILES = {"pp128x128_bk128_s3": dict(BM=128, BN=128, BK=128, stages=3),
            "pp128x128_bk128_s4": dict(BM=128, BN=128, BK=128, stages=4),
            "pp128x128_bk64_s5": dict(BM=128, BN=128, BK=64, stages=5),
            "pp64x128_bk128_s4": dict(BM=64, BN=128, BK=128, stages=4),
            "pp64x128_bk128_s5": dict(BM=64, BN=128, BK=128, stages=5),
            "pp128x64_bk128_s4": dict(BM=128, BN=64, BK=128, stages=4),
            "pp64x256_bk128_s3": dict(BM=64, BN=256, BK=128, stages=3),
            "pp64x64_bk128_s5": dict(BM=64, BN=64, BK=128, stages=5)}


def make_cases_pp(batches, layers=None, tiles=None, pipes=(-1, 0), erq=(False, True), dtypes=("int8",),
                  residual=False, forms4=("", "_u", "_w")):
    """Every ResNet-50 layer as compiled now plus, for its tensor-core layers of ``dtypes`` (or only ``layers``),
    ping-pong kernels (``GemmKnobs.pp``) on PP_TILES (or ``tiles``) with each of ``pipes`` and ``erq`` as tuning
    variants; 4-bit ones as the register-A kernel with expanded weights (w8, a packed A slot per stage: BK halved, the
    same unpacked tile), and (``forms4``) with the producer unpacking. ``residual``: as in
    ``make_cases_as_compiled`` (the variants derive from the residual conv's own knobs)."""
    from qcompile.schedules import DEFAULT_KNOBS
    from qcompile.schedules.igemm import _adapt_knobs

    cases, extra = make_cases_as_compiled(batches, residual), []
    for c in _tunable(cases, dtypes, layers):
        spec, seen = c["spec"], {c["knobs"]}
        if not _wg_ok(spec):
            continue
        for tname, kw in PP_TILES.items():
            if tiles and tname not in tiles:
                continue
            forms = [("", kw, pipes)]
            if spec.x_bits == 4:  # register-A (w8; "_k": its fragments read in agl's k order), the producer
                # unpacking a 3-deep packed ring ("_u"), and the producer unpacking only A, the expanded weights copied
                # into the stages ("_w": w8, the ring stages - 1 - pipe deep)
                forms = [("", dict(kw, BK=kw["BK"] // 2, areg=True, w8=True, pstages=kw["stages"]), pipes),
                         ("_k", dict(kw, BK=kw["BK"] // 2, areg=True, w8=True, pstages=kw["stages"], agl=True), pipes),
                         ("_u", dict(kw, BK=kw["BK"] // 2, pstages=3), pipes),
                         ("_w", dict(kw, BK=kw["BK"] // 2, w8=True), pipes)]
            for suf, kf, pps in [f for f in forms if spec.x_bits == 8 or f[0] in forms4]:
                for pipe in pps:
                    if suf == "_w":
                        kf = dict(kf, pstages=kf["stages"] - 1 - pipe)
                    for e in erq:
                        kn = _adapt_knobs(spec, DEFAULT_KNOBS[ARCH].replace(mma="wgmma", WM=1, WN=1, pipe=pipe, erq=e,
                                                                             pp=True, **kf), "NHWC")
                        if kn.pp and _fits(kn, spec, seen):
                            extra.append(dict(c, knobs=kn, variant=f"{tname}{suf}_g{pipe + 1}" + ("_erq" if e else ""),
                                              is_default=False))
    return cases + extra


def make_cases_stem(batches, names=None):
    """The stem as compiled (its space-to-depth form: a 4x4 stride-1 conv over 16 channels, ``space_to_depth``) at
    each batch, INT8 and INT4, with every CAND tile (or ``names``) and each of those with the requantize on the
    accumulators (``erq``) as tuning variants."""
    from qcompile.schedules import DEFAULT_KNOBS
    from qcompile.schedules.igemm import _adapt_knobs

    cases, extra = _stem_igemm_cases(batches), []
    for c in _tunable(cases, ("int8", "int4")):
        spec, seen = c["spec"], {c["knobs"]}
        for cname in names or CAND:
            e = _adapt_knobs(spec, DEFAULT_KNOBS[ARCH].replace(**CAND[cname]), "NHWC")
            for vname, kn in ((cname, e), (cname + "_erq", e.replace(erq=True))):
                if _fits(kn, spec, seen):
                    extra.append(dict(c, knobs=kn, variant=vname, is_default=False))
    return cases + extra


def _stem_igemm_cases(batches):
    """The stem's space-to-depth conv at each batch, INT8 and INT4, as the implicit GEMM with the knobs it would get
    (``_now_knobs``: its tuning-log record), as tuning rows: what compiled models run where the implicit GEMM is
    forced (``strategy="implicit_gemm"``; sm_90a builds run the direct_halo kernel)."""
    return [dict(kind="tune", layer=layer, spec=spec, strategy="implicit_gemm", knobs=_now_knobs(spec), variant="default",
                 is_default=True) for layer, spec, _ in r50_layer_specs(batches) if layer.startswith("r50_stem_")]


def make_cases_halo(batches, ths=(1, 2, 4, 8), minbs=(2, 3, 4), pipes=(0, 1)):
    """The stem's space-to-depth conv at each batch, INT8 and INT4, as the implicit GEMM (``_stem_igemm_cases``: the
    "default" rows) against the direct kernel from a shared-memory halo tile (``schedules/stem.py``, strategy
    ``direct_halo``): its defaults as compiled models get them ("halo_default") and each rows-per-item ``th``, blocks
    per SM ``minb`` and ``pipe`` as tuning variants."""
    from qcompile.schedules.stem import HaloKnobs, halo_constraints

    cases, extra = _stem_igemm_cases(batches), []
    for c in cases:
        if halo_constraints(c["spec"], ARCH):
            continue
        extra.append(dict(c, strategy="direct_halo", knobs=None, variant="halo_default", is_default=False))
        for pipe in pipes:
            for th in ths:
                for m in minbs:
                    if pipe and m > 2:  # (two accumulator sets: 239 registers; 3 blocks per SM already spill)
                        continue
                    extra.append(dict(c, strategy="direct_halo", knobs=HaloKnobs(th=th, minb=m, pipe=pipe),
                                      variant=f"halo_th{th}_m{m}" + ("_p1" if pipe else ""), is_default=False))
    return cases + extra


def make_cases_kt(batches, layers=None, bns=(64, 96, 192), stages=(4, 5, 6), gifs=(1, 2)):
    """ResNet-50 layers (``layers``, else every one the transposed implicit GEMM takes whose grid it fills better --
    ``igemm_t.fill_gain`` > 1 -- with at least 3/4 of the SMs' blocks, ``kt_preferred``'s rule) as compiled now ("default",
    the implicit GEMM with its record) against ``implicit_gemm_t`` (schedules/igemm_t.py: output channels as the
    MMA's M, pixels as N): its defaults ("kt_default": ``auto_bn``'s pixel tile, the deepest ring that fits) and each
    pixel tile ``bns`` (0: ``auto_bn``'s) x ring depth ``stages`` that fits as tuning variants (4-bit: with the
    activations through registers and through a shared packed ring)."""
    from qcompile.schedules.igemm_t import KtKnobs, auto_bn, fill_gain, kt_constraints, kt_grid, smem_bytes
    from qcompile.schedules.spec import arch_info

    cases, extra = [], []
    for layer, spec, st in r50_layer_specs(batches):
        if (st not in ("implicit_gemm", "implicit_gemm_t") or kt_constraints(spec, ARCH)
                or (layers and layer not in layers)):
            continue
        if not layers and (fill_gain(spec, ARCH) <= 1 or kt_grid(spec, ARCH) < 0.75 * arch_info(ARCH).sms):
            continue
        c = dict(kind="tune", layer=layer, spec=spec, strategy="implicit_gemm", knobs=_now_knobs(spec),
                 variant="default", is_default=True)
        cases.append(c)
        extra.append(dict(c, strategy="implicit_gemm_t", knobs=None, variant="kt_default", is_default=False))
        for bn, stg, gif, ring in itertools.product(bns, stages, gifs, (0, 1) if spec.x_bits == 4 else (0,)):
            smem = smem_bytes(spec, bn or auto_bn(spec, ARCH), stg, bool(ring))
            if stg >= 3 + gif and smem <= arch_info(ARCH).smem_per_block:
                extra.append(dict(c, strategy="implicit_gemm_t", knobs=KtKnobs(bn=bn, stages=stg, ring=ring, gif=gif),
                                  variant=f"kt_n{bn}_s{stg}_g{gif}" + ("_ring" if ring else ""), is_default=False))
    return cases + extra


def make_cases_occ1wg(batches, layers=None, minbs=(0, 3, 4), erqs=(False, True)):
    """Every ResNet-50 layer as compiled now plus, for the 8-bit wgmma-able ones (or only ``layers``), one-warpgroup
    128-row tiles (BN 64 / 128, BK 64 / 128, 2-3 stages) with each ``minb`` of ``minbs`` blocks per SM, with each
    ``erq`` of ``erqs``, as tuning variants (more, smaller blocks per SM for the short-reduction 1x1 layers)."""
    cases, extra = make_cases_as_compiled(batches), []
    for c in _tunable(cases, ("int8",), layers):
        spec, seen = c["spec"], {c["knobs"]}
        if not _wg_ok(spec):
            continue
        for BN in (64, 128):
            for BK in (64, 128):
                for st in (2, 3):
                    base = _wg_tile(spec, "wg128x128_bk128_1wg_g0").replace(BN=BN, BK=BK, stages=st)
                    for m in minbs:
                        for e in erqs:
                            kn = base.replace(minb=m, erq=e)
                            if _fits(kn, spec, seen):
                                extra.append(dict(c, knobs=kn, variant=f"1wg128x{BN}_bk{BK}_s{st}_m{m}"
                                                  + ("_erq" if e else ""), is_default=False))
    return cases + extra


W8_TILES = ["wg128x128_bk128_1wg_g0", "wg128x64_1wg_g0", "wg128x128_bk128_g0", "wg64x128_bk128_g0", "wg128x64_bk128_g0"]
AGL8_TILES = ["wg128x256_bk128_s2g0"]  # (8-bit agl: one m64 row block per warpgroup, so two warpgroups for 128 rows)


def make_cases_w8(batches, layers=None, tiles=None, pstages=(3, 4), minb=(0, 3), persist=(), r18=False, agl=False,
                  dtype="int4", shared_a_pipes=()):
    """Every ResNet-50 layer as compiled now plus, for the 4-bit wgmma-able ones (or only ``layers``), register-A
    kernels that take their weights expanded to 8 bits (``GemmKnobs.w8``: B copied into its stages like an 8-bit
    operand, only A unpacked in the kernel) on the tile they compile with now, on the tile of the same layer's 8-bit
    kernel (BK halved: packed bytes) and on each of ``tiles`` (WGMMA names), with warp-owned A rows (awarp, pipe -1), each
    packed-ring depth in ``pstages`` (B's stages as many) and each ``__launch_bounds__`` minimum in ``minb``; with
    ``persist``, also as persistent kernels of that many blocks per SM (the chunk stream across tile boundaries).
    ``r18``: the same for the ResNet-18 shapes ResNet-50 does not have (make_cases_r18's, as compiled) instead.
    ``agl``: those kernels with their A fragments loaded straight from global memory (``GemmKnobs.agl``; the K-chunk
    halved until the reduction is a whole number of them) instead, persist aside. ``dtype`` "int8" (agl only): the
    8-bit layers' agl kernels (A words straight into registers, weights k-permuted: reference.permute_k8) on the same
    tiles with BK as the tile has it and 64. ``shared_a_pipes`` (4-bit, not agl): instead without warp-owned rows (A
    fragments read from the packed shared ring behind the block barrier) with each of these ``pipe`` values (-1, 0)."""
    from qcompile.schedules.igemm import _adapt_knobs

    cases, extra = make_cases_r18(batches, names=()) if r18 else make_cases_as_compiled(batches), []
    k8 = {c["layer"].rsplit("_", 1)[0]: c["knobs"] for c in cases if c["layer"].endswith("_int8") and c["knobs"]}
    bits = 8 if dtype == "int8" else 4
    for c in _tunable(cases, (dtype,), layers):
        spec, kn_now = c["spec"], c["knobs"]
        if spec.x_bits != bits or not _wg_ok(spec) or (bits == 8 and not agl):
            continue
        base = [("now", kn_now)] if kn_now.mma == "wgmma" else []
        t8 = k8.get(c["layer"].rsplit("_", 1)[0]) if bits == 4 else None
        if t8 is not None and t8.mma == "wgmma":
            base.append(("t8", _adapt_knobs(spec, t8.replace(BK=max(32, t8.BK // 2), persist=0, sk=0), "NHWC")))
        base += [(cname, _wg_tile(spec, cname)) for cname in tiles or (W8_TILES + AGL8_TILES if bits == 8 else W8_TILES)]
        seen = set()
        for cname, kn0 in base:
            if kn0.WN != 1:
                continue
            for p in pstages:
                for m in sorted({*minb, kn0.minb}) if minb else ():  # (none: --persist alone)
                    kn = kn0.replace(areg=True, awarp=True, w8=True, pipe=-1, pstages=p, stages=p, minb=m, wsp=0,
                                     persist=0, sk=0)
                    kns = [(kn, "")]
                    if not agl and bits == 4 and shared_a_pipes:  # (instead of the warp-owned rows)
                        kns = [(kn.replace(awarp=False, agl=False, pipe=g, stages=p + 1 + g), f"_sa{g + 1}")
                               for g in shared_a_pipes]
                    if agl:  # (and with one MMA group in flight: pipe 0, a B stage more)
                        gkb, bk = spec.R * spec.S * spec.C * bits // 8, kn.BK
                        while bk > 32 and gkb % bk:
                            bk //= 2
                        kns = []
                        for b in sorted({bk, 64} if bits == 8 and bk > 64 else {bk}):
                            kn1 = kn.replace(agl=True, BK=b)
                            sfx = f"_bk{b}" if bits == 8 else ""
                            kns += [(kn1, sfx), (kn1.replace(pipe=0, stages=p + 1), sfx + "_g1")]
                    for kn, g in kns:
                        if bits == 8 and ((kn.BN * kn.BK) % (kn.vec * kn.load_threads) or kn.BM // kn.WM > 64):
                            continue  # (agl8: B in whole 16-byte vectors per thread; two m64 rows per warpgroup spill)
                        if _fits(kn, spec, seen):
                            extra.append(dict(c, knobs=kn, variant=f"{cname}_w8{'agl' if agl else ''}_p{p}{g}"
                                              + (f"_minb{m}" if m else ""), is_default=False))
                for n in () if agl else persist:
                    kn = kn0.replace(areg=True, awarp=True, w8=True, pipe=-1, pstages=p, stages=p, minb=0, wsp=0,
                                     persist=n, sk=0)
                    if _fits(kn, spec, seen):
                        extra.append(dict(c, knobs=kn, variant=f"{cname}_w8_p{p}_persist{n}", is_default=False))
    return cases + extra


# stream-K 8-bit wgmma tiles (GemmKnobs.sk): (WGMMA name, sk = blocks per SM of the grid)
SK_TILES = [("wg128x128_bk128_g0", 1), ("wg128x128_bk128_s2g0", 1), ("wg128x128_bk128_s2g0", 2),
            ("wg128x128_bk64_s4g0", 1), ("wg128x128_bk64_s4g0", 2), ("wg128x128_bk128_1wg_g0", 1),
            ("wg64x128_bk128_g0", 2), ("wg128x256_bk128_s2g0", 1),
            ("wg64x64_bk128_g0", 2), ("wg64x64_bk128_g0", 4), ("wg64x128_bk128_g0", 1),  # (small tiles: the fc)
            ("wg128x128_bk128_g1s4", 1), ("wg128x128_bk128_1wg_g1s4", 1), ("wg128x128_bk128_g2s5", 1),
            ("wg128x128_bk64_1wg_g1s6", 1)]  # (deeper pipelines: one block per SM is what stream-K runs)


def make_cases_sk(batches, layers=None, tiles=None):
    """Every ResNet-50 layer as compiled now plus, for the 8-bit wgmma-able ones (or only ``layers``), stream-K kernels
    (``GemmKnobs.sk``) on the knobs they compile with now (one and two blocks per SM, when those are wgmma) and on
    each tile of ``tiles`` (SK_TILES names), as tuning variants."""
    cases, extra = make_cases_as_compiled(batches), []
    for c in _tunable(cases, ("int8",), layers):
        spec, kn_now = c["spec"], c["knobs"]
        if not _wg_ok(spec):
            continue
        seen = {kn_now}
        vs = []
        if kn_now.mma == "wgmma" and not kn_now.persist:
            vs += [(f"now_sk{n}", kn_now.replace(sk=n, split_k=0)) for n in (1, 2)]
        vs += [(f"{cname}_sk{n}", _wg_tile(spec, cname).replace(sk=n))
               for cname, n in SK_TILES if not tiles or cname in tiles]
        for vname, kn in vs:
            if _fits(kn, spec, seen):
                extra.append(dict(c, knobs=kn, variant=vname, is_default=False))
    return cases + extra


def _split_variants(kn_now, splits, seen):
    """[(name, knobs)]: ``kn_now`` with each K-split of ``splits`` (and, for a stream-K record, the plain kernel's
    automatic split too), new and valid ones only (added to ``seen``)."""
    out = []
    for n in tuple(splits) + ((0,) if kn_now.sk else ()):
        kn = kn_now.replace(split_k=n, sk=0)
        if kn not in seen and kn.valid():
            seen.add(kn)
            out.append((f"now_split{n}", kn))
    return out


def make_cases_splits(batches, layers=None, splits=(1, 2, 4, 8)):
    """Every ResNet-50 layer as compiled now plus, for the tensor-core ones (or only ``layers``), their knobs with each
    K-split of ``splits`` (``GemmKnobs.split_k``; 1 = one kernel) as tuning variants: the automatic split (0) is a
    rule of thumb; the log keeps a split measured faster."""
    cases, extra = make_cases_as_compiled(batches), []
    for c in _tunable(cases, ("int8", "int4"), layers):
        extra += [dict(c, knobs=kn, variant=vname, is_default=False)
                  for vname, kn in _split_variants(c["knobs"], splits, {c["knobs"]})]
    return cases + extra


# warp-specialized 4-bit wgmma (GemmKnobs.wsp): (name, tile, [(stages, pstages, pipe, minb)]); BK = 64 packed bytes.
# Registers (ptxas, 384 / 256 threads): 128x128 2 WGs 155, 256x128 168, 128x64 88 (80 with minb 2), 64x128 134,
# 64x64 74, 128x128 1 WG 167
WSP_TILES = [  # (name, tile, [(stages, pstages, pipe, minb)], producer warpgroups)
    ("wsp128x128", dict(BM=128, BN=128, WM=2), [(4, 4, 0, 0), (3, 3, 0, 0), (4, 4, -1, 0)], 1),
    ("wsp256x128", dict(BM=256, BN=128, WM=2), [(3, 2, 0, 0), (2, 3, -1, 0)], 1),
    ("wsp128x64", dict(BM=128, BN=64, WM=2), [(3, 3, 0, 2), (3, 3, -1, 2)], 1),
    ("wsp64x128", dict(BM=64, BN=128, WM=1), [(3, 3, 0, 0), (3, 3, 0, 2)], 1),
    ("wsp64x64", dict(BM=64, BN=64, WM=1), [(4, 4, 0, 0), (3, 3, -1, 0)], 1),
    ("wsp128x128_1wg", dict(BM=128, BN=128, WM=1), [(4, 4, 0, 0)], 1),
    # two producer warpgroups
    ("wsp2_128x128", dict(BM=128, BN=128, WM=2), [(4, 4, 0, 0), (3, 3, 0, 0), (4, 4, -1, 0)], 2),
    ("wsp2_64x128", dict(BM=64, BN=128, WM=1), [(3, 3, 0, 0), (4, 4, 0, 0)], 2),
    ("wsp2_128x64", dict(BM=128, BN=64, WM=2), [(3, 3, 0, 0), (4, 4, 0, 0)], 2),
    # deeper packed rings (one block per SM: more chunks in flight per block)
    ("wspd128x128", dict(BM=128, BN=128, WM=2), [(3, 6, 0, 0), (2, 7, 0, 0)], 1),
    ("wspd2_128x128", dict(BM=128, BN=128, WM=2), [(3, 6, 0, 0), (2, 7, 0, 0)], 2),
    ("wspd256x128", dict(BM=256, BN=128, WM=2), [(2, 5, 0, 0), (2, 5, -1, 0)], 1),
]


def make_cases_wsp(batches, layers=None, names=None):
    """Every ResNet-50 layer as compiled now plus, for the 4-bit ones (or only ``layers``, NAME_bN_DT), the
    warp-specialized kernels of WSP_TILES (``GemmKnobs.wsp``) as tuning variants."""
    from qcompile.schedules import DEFAULT_KNOBS
    from qcompile.schedules.igemm import _adapt_knobs

    cases, extra = make_cases_as_compiled(batches), []
    for c in _tunable(cases, ("int4",), layers):
        spec = c["spec"]
        if spec.x_bits != 4 or not _wg_ok(spec):
            continue
        seen = {c["knobs"]}
        for tname, tile, plans, nprod in WSP_TILES:
            if names and tname not in names:
                continue
            for stg, pst, pipe, minb in plans:
                kn = _adapt_knobs(spec, DEFAULT_KNOBS[ARCH].replace(
                    mma="wgmma", BK=64, WN=1, stages=stg, pstages=pst, pipe=pipe, minb=minb, wsp=nprod, **tile), "NHWC")
                if _fits(kn, spec, seen):
                    extra.append(dict(c, knobs=kn, variant=f"{tname}_s{stg}p{pst}" + ("g1" if pipe == 0 else "")
                                      + (f"_minb{minb}" if minb else ""), is_default=False))
    return cases + extra


def make_cases_r18(batches, names=None, splits=None):
    """The ResNet-18 shapes ResNet-50 does not have (3x3 / 1x1 stride 2 with C != K, fc 512 -> 1000), INT8 and INT4,
    at each batch: the knobs they compile with now ("default") plus the wgmma tiles of ``names`` (WGMMA, default
    WG_SWEEP_G0); 4-bit tiles as register-A kernels (pstages 4), also with warp-owned A rows. With ``splits``: those
    knobs with each K-split instead (as make_cases_splits)."""
    from qcompile.schedules import select_strategy
    from qcompile.schedules.layers import ALL_RESNET, RESNET50, distinct

    r50 = {tuple(l[1:]) for l in distinct(RESNET50)}
    cases = []
    for N in batches:
        for (name, C, H, K, R, st, pd) in distinct(ALL_RESNET):
            if (C, H, K, R, st, pd) in r50:
                continue
            for dt, mk in (("int8", int8_spec), ("int4", int4_spec)):
                spec = mk(N, C, H, K, R, st, pd)
                if select_strategy(spec, ARCH) != "implicit_gemm":
                    continue
                layer = f"{name}_b{N}_{dt}"
                now = _now_knobs(spec)
                vs, seen = [("default", now)], {now}
                vs += _split_variants(now, splits or (), seen)
                for cname in ((WG_SWEEP_G0 if names is None else names) if _wg_ok(spec) and not splits else ()):
                    kn0 = _wg_tile(spec, cname)
                    kns = [(cname, kn0)] if spec.x_bits == 8 else [
                        (cname + "_ar", kn0.replace(pstages=4, areg=True, pipe=-1, stages=2)),
                        (cname + "_aw", kn0.replace(pstages=4, areg=True, awarp=True, pipe=-1, stages=2))]
                    vs += [(vname, kn) for vname, kn in kns if _fits(kn, spec, seen)]
                for vname, kn in vs:
                    cases.append(dict(kind="tune", layer=layer, spec=spec, strategy="implicit_gemm", knobs=kn,
                                      variant=vname, is_default=vname == "default"))
    return cases


def _now_knobs(spec):
    """The knobs a compiled model's kernel for ``spec`` gets (``knobs_for``: the shape's record, the layer's record at
    the nearest batch size, or the arch's defaults), adapted as the kernel builder adapts them."""
    from qcompile.schedules import knobs_for
    from qcompile.schedules.igemm import _adapt_knobs

    return _adapt_knobs(spec, knobs_for(spec, ARCH)[0], "NHWC")


def with_residual(cases, layers=RESIDUAL_LAYERS):
    """``cases`` (any build mode's) with the specs of the layers named ``*layers`` (RESIDUAL_LAYERS) taking the
    residual add a compiled ResNet fuses into them (``residual_spec``: tuning key ``|res``), every variant alike; a
    layer's default row takes the knobs the model compiles that conv with (its ``|res`` record, else the plain one's);
    variants a build mode derived from the plain conv's knobs keep them."""
    from qcompile.schedules import select_strategy

    for c in cases:
        if c["layer"].rsplit("_b", 1)[0].endswith(tuple(layers)) and not c["spec"].has_residual:
            c["spec"] = residual_spec(c["spec"])
            if c["strategy"] != "implicit_gemm" and select_strategy(c["spec"], ARCH) == "implicit_gemm":
                # (a rule that takes no residual -- implicit_gemm_t -- chosen for the plain conv: the model's conv
                # with its add runs the implicit GEMM, as a tuning row with the knobs it gets)
                c.update(kind="tune", strategy="implicit_gemm", knobs=_now_knobs(c["spec"]))
            elif c["is_default"] and c["strategy"] == "implicit_gemm":
                c["knobs"] = _now_knobs(c["spec"])
    return cases


def make_cases_as_compiled(batches, residual=()):
    """One kernel per ResNet-50 shape: the knobs a compiled model gets (``_now_knobs``); no tuning. ``residual``: the
    layer-name endings whose convs fuse the residual add (``with_residual``; True: RESIDUAL_LAYERS)."""
    cases = []
    for layer, spec, st in r50_layer_specs(batches):
        if st != "implicit_gemm":
            cases.append(fallback_case(layer, spec, st))
            continue
        kn = _now_knobs(spec)
        cases.append(dict(kind="tune" if spec.N != 8 else "bench", layer=layer, spec=spec, strategy="implicit_gemm",
                          knobs=kn, variant="default", is_default=True))
    return with_residual(cases, RESIDUAL_LAYERS if residual is True else tuple(residual or ()))


def make_cases_defaults_ab(batches):
    """Every ResNet-50 layer as compiled now plus, for each tensor-core one, what an untuned build gives it, timed side
    by side: the arch's defaults (``default_knobs``: wgmma tiles sized by the grid on sm_90) as "arch_defaults", and the
    mma.sync defaults (``DEFAULT_KNOBS``) as "mma_sync_defaults"."""
    from qcompile.schedules import DEFAULT_KNOBS, default_knobs
    from qcompile.schedules.igemm import _adapt_knobs

    cases, extra = make_cases_as_compiled(batches), []
    for c in _tunable(cases, ("int8", "int4")):
        spec, seen = c["spec"], {c["knobs"]}
        for vname, kn in (("arch_defaults", default_knobs(spec, ARCH)), ("mma_sync_defaults", DEFAULT_KNOBS[ARCH])):
            kn = _adapt_knobs(spec, kn, "NHWC")
            if kn not in seen:
                seen.add(kn)
                extra.append(dict(c, knobs=kn, variant=vname, is_default=False))
    return cases + extra


def make_cases_neighbors(batches):
    """Records for batch sizes the log has none for (``build --neighbors --batches 32``): every ResNet-50 layer as
    compiled now (``knobs_for``: the nearest batch's record or the arch's defaults) plus, as candidates, the same
    layer's record at every other batch size in the log (K-split left to the automatic rule) and the arch's defaults;
    the tuner keeps the fastest exact one."""
    from qcompile.schedules import default_knobs
    from qcompile.schedules.igemm import _adapt_knobs
    from qcompile.schedules.tuning import layer_records

    cases, extra = make_cases_as_compiled(batches), []
    for c in _tunable(cases, ("int8", "int4")):
        spec, seen = c["spec"], {c["knobs"]}
        cands = [("arch_defaults", default_knobs(spec, ARCH))]
        cands += [(f"rec_b{n}", kn.replace(split_k=0)) for n, kn in sorted(layer_records(spec, ARCH).items())
                  if n != spec.N]
        for vname, kn in cands:
            kn = _adapt_knobs(spec, kn, "NHWC")
            if kn not in seen:
                seen.add(kn)
                extra.append(dict(c, knobs=kn, variant=vname, is_default=False))
    return cases + extra


def make_cases_loop_ab(batches, alt):
    """Main-loop A/B (schedules/igemm.py ``pipe`` / ``fdb`` knobs) on the ResNet-50 shapes: per spec the knobs it
    builds with now (tuning log or defaults) with the two-barrier loop ("default": pipe 0, no fragment double
    buffer), with the one-barrier loop ("p1"), and with the one-barrier loop and double-buffered fragments ("p1fdb");
    plus ``alt[batch]`` other tiles with both."""
    from qcompile.schedules import tuned_knobs

    cases = []
    for layer, spec, st in r50_layer_specs(batches):
        if st != "implicit_gemm":
            cases.append(fallback_case(layer, spec, st))
            continue
        N = spec.N
        base = tuned_knobs(spec, ARCH) or candidates(spec, 1)[0][1]
        vs = [("default", base.replace(pipe=0, fdb=False)), ("p1", base.replace(pipe=1, fdb=False)),
              ("p1fdb", base.replace(pipe=1, fdb=True))]
        seen = {v for _, v in vs}
        for vname, kn in candidates(spec, 1 + alt.get(N, 0))[1:]:
            kn = kn.replace(pipe=1, fdb=True)
            if kn not in seen:
                seen.add(kn)
                vs.append((vname + "_p1fdb", kn))
        for vname, kn in vs:
            cases.append(dict(kind="tune", layer=layer, spec=spec, strategy="implicit_gemm", knobs=kn,
                              variant=vname, is_default=vname == "default"))
    return cases + bench8_cases()


def build_group(args):
    """Build one module of kernels: ``args`` = (module index, cases[, output dir (default TUNE_DIR)])."""
    gi, group, *rest = args
    tdir = pathlib.Path(rest[0]) if rest else TUNE_DIR
    import tvm
    from qcompile.schedules import conv2d_int_plan
    from qcompile.schedules.build import cuda_target, ensure_stub_libcuda, nvcc_options
    from qcompile.schedules.igemm import streamk_args, w8_kperm, w8_weights
    from qcompile.schedules.tuning import knobs_to_dict, tuning_key

    ensure_stub_libcuda()
    funcs, names = {}, {}
    for c in group:
        # the kernels a compiled model runs: a split-K pair where the knobs split (auto at small grids), else one
        fs = conv2d_int_plan(c["spec"], ARCH, c["strategy"], c["knobs"])
        names[c["func"]] = [c["func"] + ("_e" if i else "") for i in range(len(fs))]
        for fn, f in zip(names[c["func"]], fs):
            funcs[fn] = f.with_attr("global_symbol", fn)
    so = tdir / f"t{gi:03d}.so"
    t = time.time()
    with nvcc_options(ARCH, "sass"):
        lib = tvm.compile(tvm.IRModule(funcs), target=cuda_target(ARCH))
    lib.export_library(str(so))
    from qcompile.cuda_tools import wgmma_a_hazards_by_kernel

    hz = wgmma_a_hazards_by_kernel(str(so))  # (register-A wgmma)
    recs = []
    for c in group:
        nf = names[c["func"]]
        split = int(funcs[nf[0]].attrs["qcompile.split_k"]) if len(nf) > 1 else 1
        recs.append(dict(kind=c["kind"], name=c["layer"], layer=c["layer"], variant=c["variant"],
                         is_default=c["is_default"], arch=ARCH, mode="sass", funcs=nf,
                         strategy_used=c["strategy"] + (f"+splitk{split}" if split > 1 else ""),
                         knobs=str(c["knobs"]) if c["knobs"] else "",
                         knobs_dict=None if not c["knobs"] else dataclasses.asdict(c["knobs"])
                         if c["strategy"] in ("direct_halo", "implicit_gemm_t") else knobs_to_dict(c["knobs"]),
                         # (HaloKnobs / KtKnobs / GemmKnobs)
                         key=tuning_key(c["spec"]), spec=dataclasses.asdict(c["spec"]), so=so.name, func=c["func"],
                         sk=streamk_args(funcs[nf[0]]), w8=w8_weights(funcs[nf[0]]),
                         w8_kperm=w8_kperm(funcs[nf[0]]),
                         sass_hazards=[h for fn in nf for h in hz.get(fn + "_kernel", [])][:8]))
    return gi, recs, time.time() - t


def cmd_build(a):
    tdir = pathlib.Path(a.dir) if a.dir else TUNE_DIR
    tdir.mkdir(parents=True, exist_ok=True)
    res_layers = tuple(a.residual_layers) if a.residual else ()
    old = []
    if a.append:  # add variants to an existing build (same manifest; the GPU-host run re-checks everything)
        old = json.loads((tdir / "manifest.json").read_text())
    else:
        for f in list(tdir.glob("*.so")) + list(tdir.glob("manifest.json")):
            f.unlink()
    if a.wgmma:
        cases = make_cases_wgmma(a.batches, a.only_layers, a.dtypes, a.cands, a.pstages, a.areg, a.areg_pipes)
    elif a.w8:  # (with --r18: the ResNet-18-only shapes)
        cases = make_cases_w8(a.batches, a.only_layers, a.cands, tuple(a.pstages or (3, 4)),
                              tuple(a.minb or (() if a.persist else (0, 3))), tuple(a.persist), r18=a.r18, agl=a.agl,
                              dtype="int8" if a.dtypes == ["int8"] else "int4",
                              shared_a_pipes=tuple(a.areg_pipes) if a.areg else ())
    elif a.r18:
        cases = make_cases_r18(a.batches, a.cands, tuple(a.splits) if a.splits else None)
    elif a.wsp:
        cases = make_cases_wsp(a.batches, a.only_layers, a.cands)
    elif a.erq:
        cases = make_cases_erq(a.batches, a.only_layers, a.cands)
    elif a.pp:
        cases = make_cases_pp(a.batches, a.only_layers, a.cands, dtypes=tuple(a.dtypes), residual=res_layers,
                              erq=(False,) if a.no_erq else (False, True),
                              forms4=tuple("" if f == "a" else f"_{f}" for f in a.pp_forms4))
    elif a.sk:
        cases = make_cases_sk(a.batches, a.only_layers, a.cands)
    elif a.stem:
        cases = make_cases_stem(a.batches, a.cands)
    elif a.halo:
        cases = make_cases_halo(a.batches)
    elif a.kt:
        cases = make_cases_kt(a.batches, a.only_layers, tuple(a.kt_bns), tuple(a.kt_stages), tuple(a.kt_gifs))
    elif a.occ1wg:
        cases = make_cases_occ1wg(a.batches, a.only_layers, tuple(a.minb or (0, 3, 4)),
                                  (False, True) if not a.no_erq else (False,))
    elif a.splits:
        cases = make_cases_splits(a.batches, a.only_layers, tuple(a.splits))
    elif a.awarp:
        cases = make_cases_awarp(a.batches, a.only_layers, a.cands, tuple(a.minb or (0, 2)), tuple(a.pstages or (4,)))
    elif a.minb:
        cases = make_cases_minb(a.batches, a.dtypes, a.minb)
    elif a.targets:
        cases = make_cases_targeted(a.targets)
    elif a.defaults_ab:
        cases = make_cases_defaults_ab(a.batches)
    elif a.neighbors:
        cases = make_cases_neighbors(a.batches)
    elif a.as_compiled:
        cases = make_cases_as_compiled(a.batches, res_layers)
    elif a.loop_ab:
        cases = make_cases_loop_ab(a.batches, {1: 2, 64: 1})
    else:
        cases = make_cases(a.batches, a.variants, a.cands, a.only_r, bench8=not a.append, only_c=a.only_c)
    cases = with_residual(cases, res_layers)  # (--pp / --as-compiled: done before their variants, no-op here)
    if a.only_layers:
        cases = [c for c in cases if c["layer"] in a.only_layers]
    if a.append:
        have = {(r["layer"], json.dumps(r["knobs_dict"], sort_keys=True)) for r in old}
        from qcompile.schedules.tuning import knobs_to_dict

        cases = [c for c in cases if c["kind"] == "tune"
                 and (c["layer"], json.dumps(knobs_to_dict(c["knobs"]), sort_keys=True)) not in have]
    f0 = 1 + max((int(r["func"][1:]) for r in old), default=-1)
    g0 = 1 + max((int(p.stem[1:]) for p in tdir.glob("t*.so")), default=-1)
    for i, c in enumerate(cases):
        c["func"] = f"t{f0 + i:04d}"
    groups = [cases[i:i + a.group] for i in range(0, len(cases), a.group)]
    ntune = sum(c["kind"] == "tune" for c in cases)
    nspec = len({c["layer"] for c in cases if c["kind"] == "tune"})
    print(f"{len(cases)} kernels ({ntune} tuning variants of {nspec} specs) in {len(groups)} modules", flush=True)
    t0 = time.time()
    manifest = []
    with mp.get_context("spawn").Pool(a.jobs) as pool:
        for gi, recs, dt in pool.imap_unordered(build_group, [(g0 + i, g, str(tdir)) for i, g in enumerate(groups)]):
            manifest += recs
            print(f"  module {gi} ({len(recs)}) {dt:.1f}s  total {time.time() - t0:.0f}s", flush=True)
    manifest = old + manifest
    manifest.sort(key=lambda r: r["func"])
    (tdir / "manifest.json").write_text(json.dumps(manifest, indent=0))
    cmd, bc = "python scripts/tune_layers.py " + shlex.join(sys.argv[1:]), tdir / "build_command.txt"
    if a.append and bc.is_file():  # (the device run's results name every build step)
        cmd = bc.read_text().strip() + " && " + cmd
    bc.write_text(cmd + "\n")
    mb = sum(f.stat().st_size for f in tdir.glob("*.so")) / 2**20
    print(f"built in {time.time() - t0:.0f}s; {mb:.1f} MiB of .so in {tdir}")
    for r in manifest:  # (cuda_tools.wgmma_a_hazards: such a kernel may compute wrong sums on the GPU)
        for h in r.get("sass_hazards", []):
            print(f"SASS HAZARD {r['layer']} {r['variant']}: {h}", flush=True)


# ------------------------------------------------------------------------------------------------------------
# reference on the GPU (torch): random storage bytes in, reference output storage bytes out
# ------------------------------------------------------------------------------------------------------------
def unpack_t(b, bits, signed):
    """Storage tensor (uint8/int8 [.., Cs]) -> logical int64 [.., C]: 4-bit bytes through a table of the 256 bytes'
    two values in qcompile's nibble order (qcompile.int4), on b's device."""
    import numpy as np
    import torch

    from qcompile import int4

    if bits == 8:
        return b.long()
    table = int4.unpack(np.arange(256, dtype=np.uint8), signed=signed).reshape(256, 2).astype(np.int64)
    u = b.view(torch.uint8).long()
    return torch.from_numpy(table).to(b.device)[u].reshape(*u.shape[:-1], u.shape[-1] * 2)


def pack_t(y, dtype):
    """Logical int64 [.., K] -> storage tensor of ``dtype`` (packed for 4-bit)."""
    import torch

    if dtype in ("int4", "uint4"):
        p = ((y[..., 0::2] & 15) | ((y[..., 1::2] & 15) << 4)).to(torch.uint8)
        return p.view(torch.int8) if dtype == "int4" else p
    return y.to({"int8": torch.int8, "uint8": torch.uint8, "int32": torch.int32}[dtype])


def acc_t(spec, x_log, w_log):
    """Exact int64 accumulator [N,P,Q,K] via a float64 conv (|acc| < 2^53)."""
    import torch

    sh, sw = spec.strides
    pt, pl, pb, pr = spec.pads
    x = x_log.permute(0, 3, 1, 2).double()
    w = w_log.permute(0, 3, 1, 2).double()
    x = torch.nn.functional.pad(x, (pl, pr, pt, pb), value=float(spec.pad_value))
    acc = torch.nn.functional.conv2d(x, w, stride=(sh, sw), dilation=spec.dilations)
    return acc.permute(0, 2, 3, 1).round().long()


def requant_t(acc, bias, M, S, spec):
    """The project math (schedules/reference.py::requant) in torch int64, stage 1 (the residual stage: residual_t)."""
    import torch

    t = acc + bias.long()
    t = torch.remainder(t + (1 << 31), 1 << 32) - (1 << 31)  # int32 wrap, as on the device
    v = t * M.long()
    S64 = S.long()
    v = torch.bitwise_right_shift(v + torch.bitwise_left_shift(torch.ones_like(S64), S64 - 1), S64)
    lo, hi = spec.lo, spec.hi
    if spec.out_dtype == "int32":
        lo, hi = max(lo, -(1 << 31)), min(hi, (1 << 31) - 1)
    return torch.clamp(v + spec.zo, lo, hi)


def residual_t(y, r, rq2, spec):
    """The residual stage (schedules/reference.py::requant with ``res``) in torch int64: y stage-1 values, r the
    residual's logical values, rq2 int32[5, K] rows (c1, M1, c2, M2, S2)."""
    import torch

    c1, M1, c2, M2, S2 = (t.long() for t in rq2)
    v = (y + c1) * M1 + (r + c2) * M2 + torch.bitwise_left_shift(torch.ones_like(S2), S2 - 1)
    return torch.clamp(torch.bitwise_right_shift(v, S2) + spec.zo2, spec.lo2, spec.hi2)


def make_problem(spec, seed, dev):
    """Fresh random inputs (storage tensors on dev, never zeros) + the reference output storage."""
    import numpy as np
    import torch

    try:
        from qcompile.schedules import reference as R
    except ImportError:  # GPU host: schedules/reference.py as a plain module (no TVM compiler there)
        import reference as R

    g = torch.Generator(device=dev)
    g.manual_seed(seed)
    xs, ws, os_ = spec.shapes()
    xb = torch.randint(0, 256, xs, dtype=torch.uint8, device=dev, generator=g)
    if spec.storage(spec.x_dtype) == "int8":
        xb = xb.view(torch.int8)
    wb = torch.randint(0, 256, ws, dtype=torch.uint8, device=dev, generator=g).view(torch.int8)
    # per-channel bias / M / S exactly as the NumPy random_problem draws them (they depend on K, R*S*C, dtypes)
    rng = np.random.default_rng(seed)
    _, _, b, M, S, res = R.random_problem(spec.replace(N=1, H=spec.R, W=spec.S, padding=0, stride=1, dilation=1), rng)
    x_log = unpack_t(xb, spec.x_bits, spec.x_signed)[..., :spec.C]
    w_log = unpack_t(wb, spec.w_bits, True)[..., :spec.C]
    acc = acc_t(spec, x_log, w_log)
    bt, Mt, St = (torch.from_numpy(v).to(dev) for v in (b, M, S))
    y = requant_t(acc, bt, Mt, St, spec)
    extra, r_log = [], None
    if spec.has_residual:  # random residual bytes; the second stage's rq2 as random_problem draws it
        rb = torch.randint(0, 256, spec.res_shape(), dtype=torch.uint8, device=dev, generator=g)
        if spec.storage(spec.res_dtype) == "int8":
            rb = rb.view(torch.int8)
        r_log = unpack_t(rb, spec.res_bits, spec.res_signed)[..., :spec.K]
        rq2 = torch.from_numpy(res[1]).to(dev)
        y = residual_t(y, r_log, rq2, spec)
        extra = [rb, rq2]
    ref = pack_t(y, spec.out_dtype)
    # cross-check this torch reference against the trusted NumPy requant + packing on the first image
    y_np = R.requant(acc[:1].cpu().numpy(), b, M, S, spec,
                     None if r_log is None else (r_log[:1].cpu().numpy(), res[1]))
    ok_np = bool(np.array_equal(R.to_storage(y_np, spec.out_dtype), ref[:1].cpu().numpy()))
    nuniq = int(torch.unique(y[:1]).numel())
    return [xb, wb, bt, Mt, St, *extra], ref, ok_np, nuniq


# ------------------------------------------------------------------------------------------------------------
# device (GPU host, TVM runtime only)
# ------------------------------------------------------------------------------------------------------------
def _setup_runtime_and_reexec(argv):
    sys.path.insert(0, str(ROOT / "scripts"))
    from device_env import setup_runtime_and_reexec

    setup_runtime_and_reexec(__file__, argv)


class Tee:
    def __init__(self, path):
        self.f = open(path, "w")

    def __call__(self, *a):
        s = " ".join(str(x) for x in a)
        print(s, flush=True)
        self.f.write(s + "\n")
        self.f.flush()


def cmd_device(a):
    _setup_runtime_and_reexec(sys.argv[1:])
    sys.path.insert(0, str(ROOT / "scripts"))
    import numpy as np
    import torch

    import device_run as DR  # loads the TVM runtime (+ CUDA), reference.py, spec.py

    T0 = time.time()
    tdir = pathlib.Path(a.dir) if a.dir else TUNE_DIR
    out = pathlib.Path(a.out) if a.out else tdir
    out.mkdir(parents=True, exist_ok=True)
    log = Tee(out / "tune_log.txt")
    DR.DEVICE_DIR = tdir
    man = json.loads((tdir / "manifest.json").read_text())
    dev_name = torch.cuda.get_device_name(0)
    bc = tdir / "build_command.txt"  # (cmd_build writes it; results.json names both commands)
    commands = dict(build_command=bc.read_text().strip() if bc.is_file() else None,
                    command="python3 scripts/tune_layers.py " + shlex.join(sys.argv[1:]))
    log("GPU:", dev_name, "| tvm", DR.tvm.__version__, "| torch", torch.__version__, "| cudnn",
        torch.backends.cudnn.version(), "| date", time.strftime("%Y-%m-%d"))
    tdev = torch.device(os.environ.get("QC_TUNE_DEV", "cuda"))  # "cpu": dry run with a mocked device_run
    by_layer: dict[str, list] = {}
    by_shape: dict[tuple, str] = {}  # ResNet-18 and -50 share shapes: the manifest names each shape once

    def shape_key(sp, dt):  # (the INT4 stem row runs an 8-bit kernel: dt from the layer name)
        return (sp.N, sp.C, sp.H, sp.K, sp.R, sp.strides, sp.pads, dt)

    for r in man:
        by_layer.setdefault(r["layer"], []).append(r)
        by_shape[shape_key(DR.to_spec(r["spec"]), r["layer"].rsplit("_", 1)[1])] = r["layer"]
    from layers import RESNET18, RESNET50, distinct  # schedules/layers.py as a plain module (device_run's path)
    from spec import space_to_depth

    shapes = {l[0]: l[1:] for l in RESNET18 + RESNET50}

    def layer_spec(name, N):  # the layer itself as cuDNN gets it (int8_spec / int4_spec pad C to 4)
        C, H, K, R_, st, pd = shapes[name]
        return DR.ConvSpec(N=N, H=H, W=H, C=C + (-C % 4), K=K, R=R_, S=R_, stride=st, padding=pd)

    def layer_for(name, N, dt):  # (the stem runs its space-to-depth form)
        sp = layer_spec(name, N)
        return by_shape.get(shape_key(space_to_depth(sp) or sp, dt))  # (None: not in this build)
    tune_layers = [k for k, rs in by_layer.items() if rs[0]["kind"] == "tune"]
    # batch 64 first (then 256): the time guard drops the tail, never the main batch
    tune_layers.sort(key=lambda k: (0 if "_b64_" in k else 1))
    results = {"device": dev_name, "sms": torch.cuda.get_device_properties(0).multi_processor_count,
               "date": time.strftime("%Y-%m-%d"), "tune": [], "bench": [], "ncu": None}

    def save():
        (out / "tune_results.json").write_text(json.dumps(results, indent=1))

    def timed(funcs, targs, rounds=7, inner=10):
        """Per-launch ms of each variant: ``inner`` launches per sample, variants interleaved, median of ``rounds``;
        with graph timing (device_run.TIMING, the default) the launches of a sample are one CUDA-graph replay, so
        kernels of a few microseconds are not timed by the host's launch rate."""
        for f in funcs:
            for _ in range(3):
                f(*targs)
        torch.cuda.synchronize()
        if DR.TIMING == "graph":
            samples = [DR.capture(lambda f=f: f(*targs), inner).replay for f in funcs]
        else:
            samples = [lambda f=f: [f(*targs) for _ in range(inner)] for f in funcs]
        ts = [[] for _ in funcs]
        for _ in range(rounds):
            for i, run in enumerate(samples):
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                run()
                e.record()
                e.synchronize()
                ts[i].append(s.elapsed_time(e) / inner)
        return [float(np.median(t)) for t in ts]

    nfail = 0
    seed = 20261122
    for li, layer in enumerate(tune_layers):
        if time.time() - T0 > a.tune_budget:
            log(f"tune time budget reached ({a.tune_budget:.0f}s): {len(tune_layers) - li} specs left untuned")
            break
        recs = by_layer[layer]
        spec = DR.to_spec(recs[0]["spec"])
        ost = torch.uint8 if spec.storage(spec.out_dtype) == "uint8" else torch.int8
        row = dict(layer=layer, key=recs[0]["key"], variants=[])
        funcs, last = [], None
        for r in recs:
            seed += 1
            v = dict(variant=r["variant"], func=r["func"], knobs=r["knobs_dict"], is_default=r["is_default"])
            try:
                args, ref, ok_np, nuniq = make_problem(spec, seed, tdev)
                f = DR.get_func(r)
                targs = [DR.to_tvm(t) for t in args]
                ok = ok_np
                nbad = 0
                for trial in range(2):  # poisoned twice: every output byte must be written
                    o = torch.randint(0, 256, ref.shape, dtype=torch.uint8, device=tdev).view(ost)
                    f(*targs, DR.to_tvm(o))
                    torch.cuda.synchronize()
                    bad = int((o != ref).sum())
                    bad += not DR.state_clean(f)  # (stream-K: its tile counters left at zero)
                    nbad += bad
                    ok = ok and bad == 0
                v.update(ok=ok, ref_np_ok=ok_np, distinct_values=nuniq, bad=nbad)
                if ok:
                    funcs.append((v, f))
                    last = targs + [DR.to_tvm(o)]
            except Exception as e:  # noqa: BLE001
                v.update(ok=False, err=f"{type(e).__name__}: {str(e)[-300:]}")
            nfail += not v["ok"]
            row["variants"].append(v)
        if funcs:
            ms = timed([f for _, f in funcs], last)
            for (v, _), t in zip(funcs, ms):
                v["ms"] = t
            if a.confirm:  # the default and the fastest few again, each alone as the layer bench times it
                recs_v = {r["variant"]: r for r in recs}
                top = sorted(funcs, key=lambda vf: (not vf[0]["is_default"], vf[0]["ms"]))
                for v, f in [top[0]] + sorted(top[1:], key=lambda vf: vf[0]["ms"])[:a.confirm]:
                    v["bench_ms"] = DR.run_bench(recs_v[v["variant"]], func=f)
        ok_v = [v for v in row["variants"] if v.get("ok")]
        dflt = next((v for v in row["variants"] if v["is_default"]), None)
        best = min(ok_v, key=_tkey(ok_v)) if ok_v else None
        row["best"] = best["variant"] if best else None
        results["tune"].append(row)
        d_ms = _tkey(ok_v)(dflt) if dflt and dflt.get("ok") else float("nan")
        b_ms = _tkey(ok_v)(best) if best else float("nan")
        flag = "" if len(ok_v) == len(row["variants"]) else f"  FAIL {[v['variant'] for v in row['variants'] if not v.get('ok')]}"
        log(f"TUNE {layer:<26} {len(ok_v)}/{len(row['variants'])} exact  default {d_ms:.4f}ms  best {str(row['best']):<13}"
            f" {b_ms:.4f}ms  x{d_ms / b_ms:.2f}  [{time.time() - T0:.0f}s]{flag}")
        save()
        del funcs, last
        torch.cuda.empty_cache()
    nchk = sum(len(r["variants"]) for r in results["tune"])
    log(f"tune checks: {nchk - nfail}/{nchk} variants bit-exact ({time.time() - T0:.0f}s)")

    # ---------------- ResNet-50 layer bench with the best kernels (bench_layers.py rows) ----------------
    best_rec, dflt_rec = {}, {}
    for row in results["tune"]:
        recs = {r["variant"]: r for r in by_layer[row["layer"]]}
        if row["best"]:
            best_rec[row["layer"]] = recs[row["best"]]
        dflt_rec[row["layer"]] = recs["default"]
    built = sorted({int(m.group(1)) for r in man for m in [re.search(r"_b(\d+)_int[48]$", r.get("layer") or "")] if m})
    for N in built or (8, 64, 256):  # (the batch sizes the build has kernels for)
        for (name, C, H, K, R_, st, pd) in distinct(RESNET50):
            if time.time() - T0 > a.bench_budget:
                log("bench time budget reached")
                break
            key = f"{name}_b{N}"
            row = None
            layers = [layer_for(name, N, dt) for dt in ("int8", "int4")]
            if None in layers:  # a partial build (--only-layers): bench the layers it has
                continue
            for dt, layer in zip(("int8", "int4"), layers):
                rec = best_rec.get(layer) or dflt_rec.get(layer) or by_layer[layer][0]
                if row is None:  # the layer itself (the stem: not its space-to-depth form), as cuDNN gets it
                    spec = layer_spec(name, N)
                    row = dict(layer=key, N=spec.N, C=spec.C, H=spec.H, K=spec.K, R=spec.R, stride=spec.strides[0],
                               gops=2 * spec.macs() / 1e9)
                try:
                    row[f"{dt}_ms"] = DR.run_bench(rec)
                    row[f"{dt}_knobs"] = rec["knobs"]
                    row[f"{dt}_source"] = "tuned" if layer in best_rec and not rec["is_default"] else "default"
                    if layer in best_rec and not rec["is_default"]:
                        row[f"{dt}_default_ms"] = DR.run_bench(dflt_rec[layer])
                    else:
                        row[f"{dt}_default_ms"] = row[f"{dt}_ms"]
                except Exception as e:  # noqa: BLE001
                    row[f"{dt}_ms"] = row[f"{dt}_default_ms"] = float("nan")
                    log("bench error", layer, str(e)[-300:])
            if a.ab_rounds and not any(math.isnan(row[f"{dt}_ms"]) for dt in ("int8", "int4")):
                # paired: the two kernels timed alternately, a ratio per round (drift between the two timings of a
                # 5 us layer is as large as the difference sought); median of the rounds' INT4 / INT8 ratios
                r8, r4 = (best_rec.get(ly) or dflt_rec.get(ly) or by_layer[ly][0] for ly in layers)
                ratios = []
                for _ in range(a.ab_rounds):
                    t8 = DR.run_bench(r8)
                    ratios.append(DR.run_bench(r4) / t8)
                row["int4_over_int8_ab"] = sorted(ratios)[len(ratios) // 2]
                row["int4_over_int8_ab_rounds"] = [round(x, 4) for x in ratios]
            row["cudnn_fp16_ms"], row["int_mm_ms"] = DR.baselines(spec)
            results["bench"].append(row)
            g = row["gops"]
            log(f"BENCH {key:<20} int8 {row['int8_ms']:.4f}ms {g / row['int8_ms']:6.0f}T (dflt {row['int8_default_ms']:.4f})"
                f" int4 {row['int4_ms']:.4f}ms {g / row['int4_ms']:6.0f}T (dflt {row['int4_default_ms']:.4f})"
                f" cudnn16 {row['cudnn_fp16_ms']:.4f}ms")
            torch.cuda.empty_cache()
        (out / "results.json").write_text(json.dumps({"device": dev_name, "date": time.strftime("%Y-%m-%d"),
                                                      "timing": DR.TIMING, **commands, "checks": [],
                                                      "bench": results["bench"]}, indent=1))
        save()
    log(f"bench done ({time.time() - T0:.0f}s)")

    # ---------------- ncu on one 3x3 layer: tuned and default INT8, tuned INT4 ----------------
    if time.time() - T0 < a.ncu_before:
        targets = []
        nm, nb = a.ncu_layer.rsplit("_b", 1)
        for layer in filter(None, (layer_for(nm, int(nb), dt) for dt in ("int8", "int4"))):
            if layer in best_rec:
                targets.append(best_rec[layer])
            if layer.endswith("int8") and layer in dflt_rec and dflt_rec[layer] is not best_rec.get(layer):
                targets.append(dflt_rec[layer])
            targets += [r for r in by_layer.get(layer, []) if r["variant"] in a.ncu_variants and r not in targets]
        results["ncu"] = run_ncu(targets, tdir, out, log, a.ncu_timeout, a.ncu_source)
        save()
    log(f"done in {time.time() - T0:.0f}s")


NCU_METRIC_CANDIDATES = [
    "sm__pipe_tensor_op_imma_cycles_active", "sm__inst_executed_pipe_tensor_op_imma",
    "sm__pipe_tensor_cycles_active", "sm__pipe_shared_cycles_active", "sm__inst_executed_pipe_lsu",
    "sm__pipe_alu_cycles_active", "sm__inst_executed_pipe_uniform",
    "sm__pipe_tensor_op_gmma_cycles_active", "sm__inst_executed_pipe_tensor_op_gmma",
]


def run_ncu(targets, tdir, out, log, timeout, source=False):
    import shutil

    ncu = shutil.which("ncu") or next(iter(sorted(pathlib.Path("/opt/nvidia").glob("nsight-compute/*/ncu"))), None)
    if not ncu or not targets:
        log("ncu: not found / no targets")
        return None
    ncu = str(ncu)
    metrics = []
    try:
        q = subprocess.run([ncu, "--query-metrics", "--chip", "gh100"], capture_output=True, text=True, timeout=60)
        names = {ln.split()[0] for ln in q.stdout.splitlines() if ln.strip()}
        metrics = [m + ".avg.pct_of_peak_sustained_active" for m in NCU_METRIC_CANDIDATES if m in names]
        (out / "ncu_metric_names.txt").write_text("\n".join(sorted(n for n in names if "pipe" in n or "imma" in n)))
    except Exception as e:  # noqa: BLE001
        log("ncu --query-metrics failed:", e)
    funcs = [t["func"] for t in targets]
    rep = out / "ncu_rep"
    cmd = [ncu, "--clock-control", "none", "--target-processes", "all", "-f", "-o", str(rep),
           "--kernel-name", "regex:^(" + "|".join(funcs) + ")_kernel", "--launch-count", str(len(funcs)),
           "--section", "SpeedOfLight", "--section", "ComputeWorkloadAnalysis", "--section", "MemoryWorkloadAnalysis",
           "--section", "Occupancy", "--section", "LaunchStats", "--section", "WarpStateStats",
           "--section", "SchedulerStats"] + (["--section", "SourceCounters"] if source else [])
    if metrics:
        cmd += ["--metrics", ",".join(metrics)]
    cmd += [sys.executable, __file__, "ncu-target", str(tdir), *funcs]
    log("ncu:", " ".join(cmd[-(len(funcs) + 3):]), "| targets:", [(t["layer"], t["variant"]) for t in targets])
    try:
        t0 = time.time()
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        (out / "ncu_stdout.txt").write_text(r.stdout[-200000:] + "\n" + r.stderr[-20000:])
        if r.returncode != 0 and metrics and time.time() - t0 < 30:  # an unknown metric name: retry without
            log(f"ncu rc={r.returncode} with --metrics; retrying with the sections only")
            i = cmd.index("--metrics")
            cmd = cmd[:i] + cmd[i + 2:]
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
            (out / "ncu_stdout2.txt").write_text(r.stdout[-200000:] + "\n" + r.stderr[-20000:])
        det = subprocess.run([ncu, "-i", str(rep) + ".ncu-rep", "--page", "details"], capture_output=True, text=True,
                             timeout=60)
        (out / "ncu_details.txt").write_text(det.stdout)
        raw = subprocess.run([ncu, "-i", str(rep) + ".ncu-rep", "--page", "raw", "--csv"], capture_output=True,
                             text=True, timeout=60)
        (out / "ncu_raw.csv").write_text(raw.stdout)
        if source:  # per SASS instruction: executions and warp stall samples, one kernel after another
            src = subprocess.run([ncu, "-i", str(rep) + ".ncu-rep", "--page", "source", "--csv", "--print-source",
                                  "sass"], capture_output=True, text=True, timeout=120)
            (out / "ncu_source.csv").write_text(src.stdout + src.stderr[-2000:])
        log(f"ncu rc={r.returncode}; details {len(det.stdout)} chars")
        return dict(rc=r.returncode, targets=[(t["layer"], t["variant"], t["func"]) for t in targets])
    except Exception as e:  # noqa: BLE001
        log("ncu failed:", type(e).__name__, str(e)[-300:])
        return dict(error=str(e)[-300:])


def cmd_ncu_target(a):
    """Launch the named kernels once each on fresh random inputs (run under ncu)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import torch

    import device_run as DR

    DR.DEVICE_DIR = pathlib.Path(a.dir)
    man = {r["func"]: r for r in json.loads((DR.DEVICE_DIR / "manifest.json").read_text())}
    for fn in a.funcs:
        rec = man[fn]
        spec = DR.to_spec(rec["spec"])
        args, ref, _, _ = make_problem(spec, 7, torch.device("cuda"))
        ost = torch.uint8 if spec.storage(spec.out_dtype) == "uint8" else torch.int8
        o = torch.randint(0, 256, ref.shape, dtype=torch.uint8, device="cuda").view(ost)
        f = DR.get_func(rec)
        f(*[DR.to_tvm(t) for t in args], DR.to_tvm(o))
        torch.cuda.synchronize()
        print(fn, rec["layer"], rec["variant"], "exact" if bool((o == ref).all()) else "MISMATCH")


# ------------------------------------------------------------------------------------------------------------
# log + table (here)
# ------------------------------------------------------------------------------------------------------------
def _tkey(variants):
    """The time variants are ranked by: with --confirm, their bench-setting time (``bench_ms``: each kernel alone,
    as the layer bench times it), and only the confirmed ones compete; else the interleaved median (``ms``)."""
    if any("bench_ms" in v for v in variants):
        return lambda v: v.get("bench_ms", float("inf"))
    return lambda v: v["ms"]


def _log_sms(res: dict, sms) -> int:
    """The SM count of the GPU the results were measured on: the results file's ``sms``, else ``--sms``, else 132 for
    an H100 SXM / NVL (its name has "H100" and not "PCIe"); else the option is required."""
    n = res.get("sms") or sms
    if n is None and "H100" in res["device"] and "PCIe" not in res["device"]:
        n = 132
    if not isinstance(n, int) or n < 1:
        raise SystemExit(f"the results file names no SM count for {res['device']!r}; pass --sms N (the GPU's "
                         f"multiprocessor count)")
    return n


def read_log_lines(path: pathlib.Path) -> list:
    """The records (dicts) of a JSON-lines log, in order; lines that are not JSON objects are dropped (reported)."""
    out = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            rec = None
        if isinstance(rec, dict) and isinstance(rec.get("key"), str):
            out.append(rec)
        else:
            print(f"{path}:{i}: not a tuning record, dropped")
    return out


def cmd_log(a):
    from qcompile.schedules.tuning import LOG_SUFFIX, RECORD_STRATEGY, knobs_from_dict

    res = json.loads(pathlib.Path(a.results).read_text())
    dev, sms = res["device"], _log_sms(res, getattr(a, "sms", None))
    dst = ROOT / "tuning_logs" / f"{ARCH}{LOG_SUFFIX}"
    others, recs = [], {}  # (other GPUs' and other arches' records; this GPU's by key)
    if a.merge and dst.is_file():  # keep the records of shapes this run did not measure, and other GPUs' records
        for r in read_log_lines(dst):
            if r.get("device") == dev and r.get("arch") == ARCH:
                recs[r["key"]] = r
            else:
                others.append(r)
    run_ms = {}
    for row in res["tune"]:
        vs = row["variants"]
        dflt = next(v for v in vs if v["is_default"])
        ok = [v for v in vs if v.get("ok") and "ms" in v]
        if any(v["variant"].startswith(("halo_", "kt_")) for v in ok):  # (--halo / --kt: no GemmKnobs records)
            print("direct_halo / implicit_gemm_t variants not logged (their kernels take their own defaults):",
                  row["layer"])
            ok = [v for v in ok if not v["variant"].startswith(("halo_", "kt_"))]
        if not dflt.get("ok") or not ok:
            print("skip (default not exact / nothing exact):", row["layer"])
            continue
        if a.merge and len(vs) == 1:  # only the as-compiled kernel timed (bench rows of a partial build): no news
            continue
        tk = _tkey(ok)
        best = min(ok, key=tk)
        # keep the default unless the best is clearly faster (2%: about the run-to-run spread of the median)
        chosen = best if tk(best) < tk(dflt) * (1 - a.min_gain) else dflt
        if row["key"] in run_ms and run_ms[row["key"]] <= tk(chosen):
            continue  # two layers of one key (the stem's INT4 and INT8 rows: both 8-bit as compiled): the faster
        run_ms[row["key"]] = tk(chosen)
        if a.merge and chosen is dflt and recs.get(row["key"], {}).get("knobs") == dflt["knobs"]:
            continue  # the knobs it compiles with held: keep their record (variant, timing of the run that chose it)
        if knobs_from_dict(chosen["knobs"]) is None:  # (a record tuned_knobs would refuse: compiled models ignore it)
            raise SystemExit(f"{row['layer']}: variant {chosen['variant']} has knobs outside GemmKnobs.SPACE or "
                             f"invalid ({chosen['knobs']}); widen the space or drop the variant")
        recs[row["key"]] = dict(arch=ARCH, device=dev, sms=sms, key=row["key"], strategy=RECORD_STRATEGY,
                                knobs=chosen["knobs"], variant=chosen["variant"], ms=round(tk(chosen), 5),
                                default_ms=round(tk(dflt), 5), speedup=round(tk(dflt) / tk(chosen), 3),
                                variants_tried=len(vs), variants_exact=len(ok), layer=row["layer"], date=res["date"])
    lines = sorted(others + list(recs.values()), key=lambda r: (r["key"], str(r.get("device")), str(r.get("arch"))))
    dst.write_text("".join(json.dumps(r) + "\n" for r in lines))
    ntuned = sum(r.get("variant") != "default" for r in recs.values())
    print(f"wrote {dst}: {len(lines)} records, {len(recs)} of {dev} ({ntuned} with non-default knobs)")


def cmd_table(a):
    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_layers

    res = json.loads(pathlib.Path(a.results).read_text())
    rows = res["bench"]
    txt = bench_layers.table(a.results, a.device)  # (its caption: device, date and commands from the results file)
    # tuned-vs-default summary from the same run
    extra = []
    for N in sorted({r["N"] for r in rows}):
        rs = [r for r in rows if r["N"] == N]
        if not rs:
            continue

        def gm(k):
            return math.exp(sum(math.log(r["cudnn_fp16_ms"] / r[k]) for r in rs) / len(rs))

        r3 = [r for r in rs if r["R"] == 3]
        g3d = math.exp(sum(math.log(r["cudnn_fp16_ms"] / r["int8_default_ms"]) for r in r3) / len(r3))
        extra.append(f"* batch {N}, same run with the untuned defaults: geomean vs cuDNN fp16 INT8 {gm('int8_default_ms'):.2f}x, "
                     f"INT4 {gm('int4_default_ms'):.2f}x; 3x3 layers INT8 {g3d:.2f}x")
    r3 = [r for r in rows if r["R"] == 3]
    bd = max(r3, key=lambda r: r["gops"] / r["int8_default_ms"])
    extra.append(f"* best 3x3 layer with the defaults (same run): {bd['layer']} INT8 {bd['gops'] / bd['int8_default_ms']:.0f} TOPS")
    print(txt.rstrip("\n") + "\n" + "\n".join(extra) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build the candidate kernels (no GPU needed)")
    b.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    b.add_argument("--variants", type=int, nargs="+", default=[6, 4], help="per batch (last one repeats)")
    b.add_argument("--jobs", type=int, default=2)
    b.add_argument("--group", type=int, default=12)
    b.add_argument("--dir", default=None, help="output directory (default build/gpu/tune)")
    b.add_argument("--append", action="store_true", help="add variants to the existing build in --dir")
    b.add_argument("--cands", nargs="+", default=None, help=f"candidate names (of {sorted(CAND)})")
    b.add_argument("--only-r", type=int, default=None, help="only shapes with this filter size")
    b.add_argument("--only-c", type=int, default=None, help="only shapes with this many input channels")
    b.add_argument("--loop-ab", action="store_true", help="main-loop A/B on the ResNet-50 shapes (see make_cases_loop_ab)")
    b.add_argument("--targets", nargs="+", default=None, help="wide candidate sets for these layers (NAME_bN_DT)")
    b.add_argument("--wgmma", action="store_true", help="as compiled + wgmma candidates (--cands) for the --dtypes layers")
    b.add_argument("--only-layers", nargs="+", default=None, help="build only these NAME_bN_DT")
    b.add_argument("--dtypes", nargs="+", default=["int8", "int4"], help="with --wgmma: candidates for these; with --w8 --agl, "
                   "'--dtypes int8' alone: the 8-bit layers' agl kernels instead of the 4-bit ones")
    b.add_argument("--pstages", type=int, nargs="+", default=[],
                   help="with --wgmma: 4-bit candidates (and their wgmma knobs now) with these packed-ring depths")
    b.add_argument("--minb", type=int, nargs="+", default=None,
                   help="as compiled + these __launch_bounds__ minimum blocks per SM (GemmKnobs.minb) as variants")
    b.add_argument("--areg-pipes", type=int, nargs="+", default=[-1], help="with --areg: pipe values (-1, 0)")
    b.add_argument("--areg", action="store_true", help="with --pstages: as register-A kernels (GemmKnobs.areg); with "
                   "--w8: register-A kernels without warp-owned A rows (one per --areg-pipes value) instead")
    b.add_argument("--r18", action="store_true",
                   help="the ResNet-18-only shapes (not in ResNet-50): as compiled + wgmma tiles (--cands), INT8 and INT4; "
                        "with --w8: the w8 variants of their 4-bit layers instead")
    b.add_argument("--wsp", action="store_true",
                   help="as compiled + warp-specialized kernels (GemmKnobs.wsp, WSP_TILES) for the 4-bit layers "
                        "(--only-layers)")
    b.add_argument("--erq", action="store_true",
                   help="as compiled + the requantize on the accumulators with 8-bit staging (GemmKnobs.erq) for every "
                        "tensor-core layer, and persistent 8-bit wgmma kernels (GemmKnobs.persist; --cands: "
                        "PERSIST_TILES names)")
    b.add_argument("--pp", action="store_true",
                   help="as compiled + ping-pong wgmma kernels (GemmKnobs.pp) on PP_TILES (--cands: their names), "
                        "pipe -1 / 0 (4-bit: -1), with and without erq, for the tensor-core layers of --dtypes "
                        "(--only-layers)")
    b.add_argument("--sk", action="store_true",
                   help="as compiled + stream-K 8-bit wgmma kernels (GemmKnobs.sk) on the knobs now and on SK_TILES "
                        "(--cands: their names) for every 8-bit tensor-core layer (--only-layers)")
    b.add_argument("--splits", type=int, nargs="+", default=None,
                   help="as compiled + these K-splits (GemmKnobs.split_k; 1 = one kernel) of every tensor-core layer's "
                        "knobs as variants (batch 1-8: where the automatic split applies)")
    b.add_argument("--awarp", action="store_true",
                   help="as compiled + register-A kernels with warp-owned A rows (GemmKnobs.awarp) for the 4-bit layers "
                        "(--only-layers, --cands tiles, --minb, --pstages)")
    b.add_argument("--w8", action="store_true",
                   help="as compiled + register-A kernels taking their 4-bit weights expanded to 8 bits (GemmKnobs.w8) "
                        "on the tile now, the 8-bit kernel's tile and W8_TILES (--cands) for the 4-bit layers "
                        "(--only-layers, --pstages, --minb)")
    b.add_argument("--agl", action="store_true",
                   help="with --w8: those kernels with A loaded straight from global memory into registers "
                        "(GemmKnobs.agl) instead")
    b.add_argument("--persist", type=int, nargs="+", default=[],
                   help="with --w8: persistent kernels (GemmKnobs.persist) of these blocks per SM (only those unless "
                        "--minb is given)")
    b.add_argument("--occ1wg", action="store_true",
                   help="as compiled + one-warpgroup 128-row tiles with minb 0/3/4 (--minb), with and without erq "
                        "(--no-erq: without), for the 8-bit layers (--only-layers)")
    b.add_argument("--no-erq", action="store_true", help="with --occ1wg / --pp: no erq variants")
    b.add_argument("--halo", action="store_true",
                   help="the stem as compiled against the direct kernel from a shared-memory halo tile (schedules/stem.py)"
                        " with each rows-per-item, blocks-per-SM and pipe knob (HaloKnobs)")
    b.add_argument("--kt", action="store_true",
                   help="the implicit GEMM against implicit_gemm_t (output channels as M: schedules/igemm_t.py), "
                        "its defaults and pixel tiles x ring depths as variants (make_cases_kt)")
    b.add_argument("--kt-bns", type=int, nargs="+", default=[64, 96, 192], help="with --kt: pixel tiles")
    b.add_argument("--kt-stages", type=int, nargs="+", default=[4, 5, 6], help="with --kt: ring depths")
    b.add_argument("--kt-gifs", type=int, nargs="+", default=[1, 2], help="with --kt: MMA groups in flight")
    b.add_argument("--stem", action="store_true",
                   help="the stem as compiled (its space-to-depth form) with every CAND tile (--cands), with and "
                        "without erq, INT8 and INT4")
    b.add_argument("--defaults-ab", action="store_true",
                   help="as compiled + each tensor-core layer on the arch's defaults (default_knobs) and on the mma.sync "
                        "defaults (DEFAULT_KNOBS), timed side by side: what an untuned build gets")
    b.add_argument("--neighbors", action="store_true",
                   help="as compiled + each tensor-core layer on its records at the log's other batch sizes and on the "
                        "arch's defaults: records for a batch size the log has none for")
    b.add_argument("--pp-forms4", nargs="+", default=["a", "u", "w"], choices=["a", "k", "u", "w"],
                   help="with --pp: the 4-bit ping-pong forms (a: register-A with w8; k: the same reading its "
                        "fragments in agl's k order; u: the producer unpacks A and B; w: the producer unpacks A, w8 "
                        "weights copied)")
    b.add_argument("--residual", action="store_true",
                   help="the layers that fuse ResNet-50's residual add (RESIDUAL_LAYERS) built and timed with it, "
                        "as compiled models run them (tuning key ...|res), in any build mode")
    b.add_argument("--residual-layers", nargs="+", default=list(RESIDUAL_LAYERS),
                   help="with --residual: the layer-name endings that get it (_3x3: "
                        "ResNet-18's residual convs, the shapes of ResNet-50's stride-1 3x3s)")
    b.add_argument("--as-compiled", action="store_true",
                   help="no tuning: one kernel per ResNet-50 shape with the knobs compiled models get (bench only)")
    d = sub.add_parser("device", help="on the GPU host: check and time the build's kernels, then the layer bench")
    d.add_argument("--dir", default=None, help="the build directory (default build/gpu/tune)")
    d.add_argument("--out", default=None, help="where the results go (default: --dir)")
    d.add_argument("--tune-budget", type=float, default=230, help="s after start: no new spec tuned after this")
    d.add_argument("--bench-budget", type=float, default=360, help="s after start: no new bench row after this")
    d.add_argument("--ncu-before", type=float, default=380, help="s after start: ncu only if reached before this")
    d.add_argument("--ncu-timeout", type=float, default=100)
    d.add_argument("--ncu-source", action="store_true", help="ncu: also the SourceCounters section (stalls by SASS line)")
    d.add_argument("--ncu-layer", default="r50_l3_3x3_b64")
    d.add_argument("--ncu-variants", nargs="+", default=[],
                   help="also profile these tuning variants of the ncu layer (besides its best and default)")
    d.add_argument("--ab-rounds", type=int, default=0,
                   help="bench: also time each layer's INT8 and INT4 kernels alternately this many times (paired ratio)")
    d.add_argument("--confirm", type=int, default=0,
                   help="re-time the default and the N fastest variants of each layer alone, as the layer bench does "
                        "(bench_ms), and rank by that")
    n = sub.add_parser("ncu-target", help="(run under ncu by `device`) launch the named kernels once each")
    n.add_argument("dir")
    n.add_argument("funcs", nargs="+")
    lg = sub.add_parser("log", help="write the fastest exact knobs of tune_results.json to tuning_logs/sm_90.jsonl")
    lg.add_argument("results", help="the device run's tune_results.json")
    lg.add_argument("--min-gain", type=float, default=0.02,
                    help="a record keeps the default knobs unless the best variant is this fraction faster")
    lg.add_argument("--sms", type=int, default=None,
                    help="the GPU's SM count, where the results file has none (default: 132 for an H100 SXM / NVL)")
    lg.add_argument("--merge", action="store_true", help="update the existing log instead of replacing it: a record "
                    "replaces the one of the same GPU and key, the others stay")
    t = sub.add_parser("table", help="print the layer table (Markdown) of the device run's results.json")
    t.add_argument("results", help="the device run's results.json")
    t.add_argument("--device", default=None, help="the GPU named in the table where the results file has none")
    a = ap.parse_args()
    {"build": cmd_build, "device": cmd_device, "ncu-target": cmd_ncu_target, "log": cmd_log, "table": cmd_table}[a.cmd](a)


if __name__ == "__main__":
    main()
