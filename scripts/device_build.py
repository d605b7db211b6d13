#!/usr/bin/env python3
"""Build (no GPU needed) every kernel that scripts/device_run.py checks bit-exactly and times on a GPU host.

    python scripts/device_build.py [--dir build/gpu/checks] [--quick] [--jobs 2]
Writes DIR/*.so (TVM modules with embedded fatbins), DIR/manifest.json (one record per kernel: its spec, knobs,
module and function names), DIR/build_command.txt and DIR/keep/gNNN/ (each module's CUDA source and fatbin). Then, on a GPU host with the
TVM runtime, numpy and torch (scripts/make_runtime_bundle.sh packs the runtime for that host's Python), with the
repository and DIR copied there:
    bash scripts/device_run.sh [DIR] [--out OUT_DIR] [--no-bench]      (results: OUT_DIR/results.json; OUT_DIR: DIR)"""
from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing as mp
import pathlib
import shlex
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
BUILD_DIR = ROOT / "build" / "gpu" / "checks"  # (--dir default)


def spec_dict(s):
    return dataclasses.asdict(s)


def make_cases(quick=False, bench=True):
    from qcompile.schedules import ConvSpec
    from qcompile.schedules.layers import ALL_RESNET, ODD, RESNET50, RQ2_RESNET50, distinct

    cases = []

    def add(kind, name, spec, strategy, arch="sm_90", mode="sass", plan=False, knobs=None):
        cases.append(dict(kind=kind, name=name, spec=spec, strategy=strategy, arch=arch, mode=mode, plan=plan,
                          knobs_kw=knobs))

    def int8_spec(N, C, H, K, R, st, pd, variant, layout="NHWC"):
        base = dict(N=N, H=H, W=H, C=C, K=K, R=R, S=R, stride=st, padding=pd, layout=layout)
        if variant == 0:
            return ConvSpec(**base, x_dtype="uint8", w_bits=8, out_dtype="uint8", zo=3, lo=0, hi=255, shift_ge33=True)
        if variant == 1:
            return ConvSpec(**base, x_dtype="int8", w_bits=8, out_dtype="uint8", has_residual=True,
                            res_dtype="uint8", zo=-2, lo=-128, hi=127, zo2=-1, lo2=0, hi2=255, res_i32=True)
        return ConvSpec(**base, x_dtype="uint8", w_bits=8, out_dtype="int32", zo=7, lo=-(1 << 31), hi=(1 << 31) - 1)

    def int4_spec(N, C, H, K, R, st, pd, variant, layout="NHWC"):
        base = dict(N=N, H=H, W=H, C=C, K=K, R=R, S=R, stride=st, padding=pd, layout=layout)
        if variant == 0:
            return ConvSpec(**base, x_dtype="uint4", w_bits=4, out_dtype="uint4", zo=1, lo=0, hi=15)
        if variant == 1:
            return ConvSpec(**base, x_dtype="int4", w_bits=4, out_dtype="uint4", has_residual=True,
                            res_dtype="uint4", zo=0, lo=-8, hi=7, zo2=0, lo2=0, hi2=15,
                            rq2_uniform=(2, 1 << 19, -1, 1 << 19, 20))
        return ConvSpec(**base, x_dtype="uint4", w_bits=4, out_dtype="int8", zo=-1, lo=-128, hi=127)

    layers = ALL_RESNET if not quick else ALL_RESNET[:4]
    for li, (name, C, H, K, R, st, pd) in enumerate(layers):
        for N in (1, 8):
            v = li % 3
            add("check", f"{name}_b{N}_int8_nhwc", int8_spec(N, C, H, K, R, st, pd, v), None)
            add("check", f"{name}_b{N}_int4_nhwc", int4_spec(N, C, H, K, R, st, pd, v), None)
            if N == 8:
                add("check", f"{name}_b{N}_int8_hwnc", int8_spec(N, C, H, K, R, st, pd, v, "HWNC"), None)
                add("check", f"{name}_b{N}_int4_hwnc", int4_spec(N, C, H, K, R, st, pd, v, "HWNC"), None)
    for (name, N, C, H, K, R, st, pd) in ODD:
        for v in (0, 1):
            add("check", f"{name}_int8_v{v}", int8_spec(N, C, H, K, R, st, pd, v), None)
            add("check", f"{name}_int4_v{v}", int4_spec(N, C, H, K, R, st, pd, v), None)
        add("check", f"{name}_int8_padzp", int8_spec(N, C, H, K, R, st, pd, 0).replace(pad_value=17), None)
        add("check", f"{name}_int8_fallback", int8_spec(N, C, H, K, R, st, pd, 1), "fallback")
    # 7x7 HWNC with batch 8 (direct cannot take C=3: falls to fallback in HWNC layout)
    add("check", "odd_stem_hwnc_b8_int8", int8_spec(8, 3, 29, 64, 7, 2, 3, 0, "HWNC"), None)
    # portability: PTX of older archs JIT-compiled on the H100 (and SASS dumped for the proof)
    for arch in ("sm_75", "sm_86"):
        for nm, sp in (("int8", int8_spec(8, 64, 28, 128, 3, 1, 1, 1)), ("int4", int4_spec(8, 64, 28, 128, 3, 1, 1, 1))):
            add("check", f"ptx_{arch}_{nm}", sp, "implicit_gemm", arch=arch, mode="ptx")
    # what compiled models run (conv2d_int_plan): split-K pairs where the output grid is small (batch 1 / 8)
    for li, (name, C, H, K, R, st, pd) in enumerate(distinct(RESNET50)):
        for N in (1, 8):
            v = li % 2  # every other layer with the two-stage residual epilogue
            add("check", f"plan_{name}_b{N}_int8", int8_spec(N, C, H, K, R, st, pd, v), None, plan=True)
            add("check", f"plan_{name}_b{N}_int4", int4_spec(N, C, H, K, R, st, pd, v), None, plan=True)
    # what shapes without a record of their own get (knobs_for), as plans: the layer's record at the nearest batch size
    # (ResNet-50 at batch 2; at 16, 32 and 128 the log holds the layers' own records), or the arch's defaults
    # (warpgroup tiles on channel counts no ResNet layer has, small and large grids, stride 1 and 2)
    for li, (name, C, H, K, R, st, pd) in enumerate(distinct(RESNET50)):
        for N in (2, 16, 32, 128):
            v = li % 2
            add("check", f"near_{name}_b{N}_int8", int8_spec(N, C, H, K, R, st, pd, v), None, plan=True)
            add("check", f"near_{name}_b{N}_int4", int4_spec(N, C, H, K, R, st, pd, v), None, plan=True)
    for (C, H, K, R, st, pd) in ((96, 28, 160, 3, 1, 1), (160, 14, 96, 1, 1, 0), (96, 15, 192, 3, 2, 1),
                                 (32, 56, 48, 1, 1, 0)):
        for N in (1, 4, 48):
            for v in (0, 1):
                nm = f"dflt_c{C}k{K}r{R}s{st}_b{N}"
                add("check", f"{nm}_int8_v{v}", int8_spec(N, C, H, K, R, st, pd, v), None, plan=True)
                add("check", f"{nm}_int4_v{v}", int4_spec(N, C, H, K, R, st, pd, v), None, plan=True)
    # the warpgroup-MMA kernels forced on every other shape (both layouts, every epilogue variant, split-K plans at
    # batch 1, the 4-bit register-staged loader) and on the odd shapes (channel bytes % 16: mma.sync fallback)
    wg = dict(BM=128, BN=128, BK=128, WM=2, WN=1, stages=3, pipe=-1, mma="wgmma")
    for li, (name, C, H, K, R, st, pd) in enumerate(layers):
        if li % 2:
            continue
        v = li % 3
        for lay in ("NHWC", "HWNC"):
            add("check", f"wg_{name}_b8_int8_{lay.lower()}", int8_spec(8, C, H, K, R, st, pd, v, lay), None, knobs=wg)
            add("check", f"wg_{name}_b8_int4_{lay.lower()}", int4_spec(8, C, H, K, R, st, pd, v, lay), None,
                knobs=dict(wg, BK=64))
        add("check", f"wg_plan_{name}_b1_int8", int8_spec(1, C, H, K, R, st, pd, v), None, plan=True, knobs=wg)
        add("check", f"wg_plan_{name}_b1_int4", int4_spec(1, C, H, K, R, st, pd, v), None, plan=True,
            knobs=dict(wg, BK=64, BM=64, WM=1, pipe=0))
        if li % 4 == 0:  # 16 epilogue elements per lane: the split-K partial sums as 16-byte vectors
            add("check", f"wg_plan16_{name}_b1_int8", int8_spec(1, C, H, K, R, st, pd, v), None, plan=True,
                knobs=dict(wg, ev=16))
    for (name, N, C, H, K, R, st, pd) in ODD:
        add("check", f"wg_{name}_int8", int8_spec(N, C, H, K, R, st, pd, 1), None, knobs=wg)
    # the residual epilogue of one-warpgroup 128x128 8-bit tiles (128 accumulators per thread: every row block's
    # residual words loaded at the epilogue's start, its row-block loop unrolled): every ResNet-50 shape with the
    # two-stage residual epilogue at batch 8 and 32, both layouts, erq on every fourth, minb 3 as the records have
    w1 = dict(wg, WM=1, stages=2, minb=3)
    for li, (name, C, H, K, R, st, pd) in enumerate(distinct(RESNET50)):
        lay = ("NHWC", "HWNC")[li % 2]
        for N in (8, 32):
            add("check", f"rpa_{name}_b{N}_int8_{lay.lower()}", int8_spec(N, C, H, K, R, st, pd, 1, lay), None,
                knobs=dict(w1, erq=bool(li % 4 == 3)))
    # erq with 4-bit output (no residual): the output packed as it is staged (ERQ4). Every ResNet-50 shape at batch 8
    # and 32, unsigned and signed 4-bit output, both layouts, EV 8 and 16, on the mma.sync kernel, the plain wgmma
    # kernel, the w8 register-A kernel (also as a one-warpgroup 128x128 tile with pipe 0), the agl kernel and the
    # ping-pong kernel with w8
    e4_knobs = [dict(BM=128, BN=128, BK=64, WM=2, WN=2, stages=3, pipe=0, mma="sync"),
                dict(wg, BK=64, WM=2),
                dict(wg, BK=64, WM=2, stages=4, pstages=4, areg=True, w8=True),
                dict(wg, BK=64, WM=1, BN=64, stages=4, pstages=3, areg=True, w8=True, awarp=True, agl=True, pipe=0),
                dict(wg, BK=64, WM=1, BM=64, stages=4, pstages=3, pipe=0, pp=True, w8=True),
                # (a one-warpgroup 128x128 tile with a group in flight: 128 accumulators per thread, the epilogue's
                # row-block loop unrolled -- rolled, they went to the stack under the in-flight wgmma: wrong sums)
                dict(wg, BK=64, WM=1, stages=4, pstages=3, areg=True, w8=True, pipe=0)]
    for li, (name, C, H, K, R, st, pd) in enumerate(distinct(RESNET50)):
        for j, N in enumerate((8, 32)):
            kw = e4_knobs[(li + 2 * j) % len(e4_knobs)]
            sp = int4_spec(N, C, H, K, R, st, pd, 0, "NHWC" if kw.get("agl") else ("NHWC", "HWNC")[(li + j) % 2])
            if j:  # signed 4-bit output
                sp = sp.replace(out_dtype="int4", zo=-1, lo=-8, hi=7)
            add("check", f"erq4_{name}_b{N}_{sp.out_dtype}_{sp.layout.lower()}", sp, None,
                knobs=dict(kw, erq=True, ev=(8, 16)[li % 2]))
    # 8-bit one-warpgroup 128x128 tiles with erq and a group in flight (the epilogue's row-block loop unrolled), every
    # other ResNet-50 shape at batch 32, the three epilogue variants
    for li, (name, C, H, K, R, st, pd) in enumerate(distinct(RESNET50)):
        if li % 2 == 0:
            add("check", f"erq1wg_{name}_b32_int8", int8_spec(32, C, H, K, R, st, pd, li % 3), None,
                knobs=dict(wg, WM=1, pipe=0, stages=3, erq=True))
    # ping-pong kernels (pp: a producer warpgroup, two consumers taking the block's tiles in turn): every ResNet-50
    # shape at batch 8 and 32 (one to ~25 tiles per block), both layouts, the three epilogue variants, 128x128 and
    # 64x128 tiles, pipe -1 / 0, 3-5 stages, erq on every fourth (the stem, 4 channels, gets the mma.sync fallback;
    # every other shape a pp kernel: their shared tiles, staging included, fit 227 KiB)
    for li, (name, C, H, K, R, st, pd) in enumerate(distinct(RESNET50)):
        lay = ("NHWC", "HWNC")[li % 2]
        for j, N in enumerate((8, 32)):
            bm, v, erq = (128 if (li + j) % 2 else 64), (li + j) % 3, li % 4 == 3
            # 3-5 stages; 3-4 for 128x128 with the int32 staging (erq off, or int32 out: it does not apply): 227 KiB
            stg = 3 + (li + j) % (3 if bm == 64 or (erq and v != 2) else 2)
            add("check", f"pp_{name}_b{N}_int8_{lay.lower()}", int8_spec(N, C, H, K, R, st, pd, v, lay),
                None, knobs=dict(wg, WM=1, BM=bm, pp=True, pipe=-1 + (li % 3 == 1), stages=stg, erq=erq))
            # 4-bit: the register-A kernel with expanded weights, a packed A slot per stage, pipe -1
            add("check", f"pp4_{name}_b{N}_int4_{lay.lower()}", int4_spec(N, C, H, K, R, st, pd, (li + j) % 3, lay),
                None, knobs=dict(wg, WM=1, BM=128 if (li + j) % 2 else 64, BK=64 if li % 3 else 32, pp=True,
                                 areg=True, w8=True, stages=3 + (li + j) % 3, pstages=3 + (li + j) % 3,
                                 erq=bool(li % 4 == 1)))
        # ... and with one MMA group in flight (pipe 0: two fragment sets per consumer, chunk kc's unpacked into one
        # while chunk kc - 1's MMAs read the other)
        N, stg = (32, 8)[li % 2], 4 + li % 2
        add("check", f"pp4g1_{name}_b{N}_int4_{lay.lower()}", int4_spec(N, C, H, K, R, st, pd, li % 3, lay), None,
            knobs=dict(wg, WM=1, BM=(128, 64)[li % 3 == 1], BK=(64, 32)[li % 4 == 3], pp=True, areg=True, w8=True,
                       stages=stg, pstages=stg, pipe=0, erq=bool(li % 2 == 0)))
        # ... reading its fragments in agl's k order (one 8/16-byte ld.shared per row and chunk; the weights
        # k-permuted), NHWC and whole K-chunks (others: not applicable, the as-compiled kernel)
        if (C * R * R // 2) % (64, 32)[li % 4 == 0] == 0:
            N, stg = (8, 32)[li % 2], 3 + li % 3
            add("check", f"pp4k_{name}_b{N}_int4", int4_spec(N, C, H, K, R, st, pd, (li + 2) % 3), None,
                knobs=dict(wg, WM=1, BM=(64, 128)[li % 2], BK=(64, 32)[li % 4 == 0], pp=True, areg=True, w8=True,
                           agl=True, stages=stg, pstages=stg, pipe=-1 + (stg >= 4 and li % 3 != 0),
                           erq=bool(li % 3 == 1)))
        # 4-bit with the producer unpacking its packed ring into the shared stages (pstages 3)
        N = (8, 32)[li % 2]
        add("check", f"pp4u_{name}_b{N}_int4_{lay.lower()}", int4_spec(N, C, H, K, R, st, pd, li % 3, lay), None,
            knobs=dict(wg, WM=1, BM=(64, 128)[li % 2], BK=(64, 32)[li % 3 == 2], pp=True, pstages=3,
                       stages=3 + li % 2, pipe=-1 + li % 2, erq=bool(li % 2 == 1 or li % 4 == 0)))
        # ... and with expanded weights (w8): B copied straight into its stage, only A unpacked (the ring holds
        # stages - 1 - pipe chunks, or one more)
        N, stg, pipe = (32, 8)[li % 2], 3 + li % 2, -1 + (li % 3 == 1)
        add("check", f"pp4w_{name}_b{N}_int4_{lay.lower()}", int4_spec(N, C, H, K, R, st, pd, (li + 1) % 3, lay),
            None, knobs=dict(wg, WM=1, BM=(128, 64)[li % 2], BK=(64, 32)[li % 3 == 0], pp=True, w8=True,
                             stages=stg, pipe=pipe, pstages=stg - 1 - pipe + (li % 4 == 2), erq=bool(li % 4 != 1)))
        if li % 3 == 0:  # 128x128 tiles with erq and a group in flight, several tiles per block (setmaxnreg: no spill)
            add("check", f"pp_erq_{name}_b32_int8", int8_spec(32, C, H, K, R, st, pd, 0), None,
                knobs=dict(wg, WM=1, pp=True, pipe=0, stages=4, erq=True))
    # 4-bit wgmma through the packed ring (pstages) and with register A (areg), forced on the other half of the
    # shapes: both layouts, every epilogue variant, split-K plans at batch 1, and the odd shapes (fallback)
    wgp = dict(wg, BK=64, stages=2, pstages=3)
    wga = dict(wgp, areg=True)
    for li, (name, C, H, K, R, st, pd) in enumerate(layers):
        if not li % 2:
            continue
        v = li % 3
        for lay in ("NHWC", "HWNC"):
            add("check", f"wgp_{name}_b8_int4_{lay.lower()}", int4_spec(8, C, H, K, R, st, pd, v, lay), None, knobs=wgp)
            add("check", f"wga_{name}_b8_int4_{lay.lower()}", int4_spec(8, C, H, K, R, st, pd, v, lay), None, knobs=wga)
        add("check", f"wga_plan_{name}_b1_int4", int4_spec(1, C, H, K, R, st, pd, v), None, plan=True,
            knobs=dict(wga, BM=64, WM=1, pstages=2))
        add("check", f"wga1_{name}_b8_int4", int4_spec(8, C, H, K, R, st, pd, v), None,  # two A-fragment sets
            knobs=dict(wga, pipe=0, stages=3))
    for (name, N, C, H, K, R, st, pd) in ODD:
        add("check", f"wga_{name}_int4", int4_spec(N, C, H, K, R, st, pd, 1), None, knobs=wga)
    # warp-owned A rows (awarp) on the even shapes at batch 8 and batch 1 (split-K plans); warp-specialized kernels
    # (wsp: one and two producer warpgroups) on the odd ones, both layouts
    waw = dict(wga, awarp=True)
    wsp = dict(wg, BK=64, stages=4, pstages=4, pipe=0, wsp=1)
    for li, (name, C, H, K, R, st, pd) in enumerate(layers):
        v = li % 3
        if not li % 2:
            add("check", f"waw_{name}_b8_int4", int4_spec(8, C, H, K, R, st, pd, v), None, knobs=waw)
            add("check", f"waw_plan_{name}_b1_int4", int4_spec(1, C, H, K, R, st, pd, v), None, plan=True,
                knobs=dict(waw, BM=64, WM=1, pstages=2))
        else:
            for lay in ("NHWC", "HWNC"):
                add("check", f"wsp_{name}_b8_int4_{lay.lower()}", int4_spec(8, C, H, K, R, st, pd, v, lay), None,
                    knobs=dict(wsp, wsp=1 + li % 4 // 2))
    # 4-bit register-A kernels taking the weights expanded to 8 bits (w8): every shape at batch 8 in both layouts
    # (with and without warp-owned rows, pipe -1 / 0, every epilogue variant), split-K plans at batch 1, a 64-byte
    # packed chunk (BK 32), one-warpgroup tiles with minb, and the odd shapes (mma.sync fallback)
    ww8 = dict(wga, w8=True, stages=3)
    for li, (name, C, H, K, R, st, pd) in enumerate(layers):
        v = li % 3
        lay = ("NHWC", "HWNC")[li % 2]
        add("check", f"w8aw_{name}_b8_int4_{lay.lower()}", int4_spec(8, C, H, K, R, st, pd, v, lay), None,
            knobs=dict(ww8, awarp=True))
        add("check", f"w8_{name}_b8_int4_{lay.lower()}", int4_spec(8, C, H, K, R, st, pd, v, lay), None,
            knobs=dict(ww8, pipe=0, stages=4) if li % 2 else dict(ww8, BK=32, pstages=4, stages=4))
        if not li % 2:
            add("check", f"w8_plan_{name}_b1_int4", int4_spec(1, C, H, K, R, st, pd, v), None, plan=True,
                knobs=dict(ww8, BM=64, WM=1, pstages=2, stages=2, awarp=True))
        else:
            add("check", f"w8_1wg_{name}_b8_int4", int4_spec(8, C, H, K, R, st, pd, v), None,
                knobs=dict(ww8, WM=1, BN=64 if li % 4 == 1 else 128, awarp=True, minb=3, erq=bool(li % 4 == 3)))
    for (name, N, C, H, K, R, st, pd) in ODD:
        add("check", f"w8_{name}_int4", int4_spec(N, C, H, K, R, st, pd, 1), None, knobs=dict(ww8, awarp=True))
    # ... persistent (persist 1 / 2 blocks per SM: the chunk stream crosses tile boundaries): every shape at batch 8 in
    # both layouts (every epilogue variant, BK 32 / 64, one and two warpgroups, erq), batch 32 where batch 8 gives
    # fewer tiles than SMs (several tiles per block for the im2col shapes too), split-K plans at batch 1 (persist off
    # there) and the odd shapes
    wp8 = dict(ww8, awarp=True, WM=1, BN=64)
    for li, (name, C, H, K, R, st, pd) in enumerate(layers):
        v = li % 3
        lay = ("NHWC", "HWNC")[li % 2]
        kp = dict(wp8, persist=1 + li % 2, erq=bool(li % 4 == 3), WM=1 + (li % 3 == 2), BM=128 * (1 + (li % 3 == 2)))
        if li % 4 == 1:
            kp.update(BK=32, pstages=4, stages=4)
        add("check", f"w8p_{name}_b8_int4_{lay.lower()}", int4_spec(8, C, H, K, R, st, pd, v, lay), None, knobs=kp)
        if 8 * H * H // st // st < 132 * 128:
            add("check", f"w8p_{name}_b32_int4", int4_spec(32, C, H, K, R, st, pd, v), None, knobs=kp)
        if li % 3 == 0:
            add("check", f"w8p_plan_{name}_b1_int4", int4_spec(1, C, H, K, R, st, pd, v), None, plan=True, knobs=kp)
    for (name, N, C, H, K, R, st, pd) in ODD:
        add("check", f"w8p_{name}_int4", int4_spec(N, C, H, K, R, st, pd, 1), None, knobs=dict(wp8, persist=2))
    # ... A fragments loaded straight from global memory into registers (agl: w8 + awarp, NHWC, whole K-chunks): every
    # shape at batch 8 with the largest K-chunk (packed bytes) its reduction is a whole number of, register rings 1-4
    # chunks deep, one and two m64 instructions per warpgroup, BN 64 / 128, erq, every epilogue variant, pipe -1 and 0
    # (one MMA group in flight, three fragment sets); split-K plans at batch 1; the odd shapes (where agl cannot apply:
    # the kernel the selector falls back to)
    wgl = dict(ww8, awarp=True, agl=True)
    for li, (name, C, H, K, R, st, pd) in enumerate(layers):
        v = li % 3
        p = 2 + li % 4
        kl = dict(wgl, BK=next((bk for bk in (128, 64, 32) if R * R * C // 2 % bk == 0), 32), pstages=p, stages=p,
                  WM=1 + li % 2, BN=(64, 128)[li // 2 % 2], erq=bool(li % 4 == 3))
        add("check", f"agl_{name}_b8_int4", int4_spec(8, C, H, K, R, st, pd, v), None, knobs=kl)
        add("check", f"aglg1_{name}_b8_int4", int4_spec(8, C, H, K, R, st, pd, (v + 1) % 3), None,  # pipe 0: 3 sets
            knobs=dict(kl, pipe=0, stages=p + 1, pstages=p, WM=2 - li % 2))
        # (the smallest tile, one m64 instruction, 4 / 3-deep rings: where ptxas once shared two sets' registers)
        add("check", f"aglg1s_{name}_b8_int4", int4_spec(8, C, H, K, R, st, pd, (v + 2) % 3), None,
            knobs=dict(kl, pipe=0, stages=5 - li % 2, pstages=4 - li % 2, BM=64, BN=64, WM=1, minb=3 * (li % 2)))
        if li % 3 == 0:
            add("check", f"agl_plan_{name}_b1_int4", int4_spec(1, C, H, K, R, st, pd, v), None, plan=True,
                knobs=dict(kl, BM=64, WM=1))
    for (name, N, C, H, K, R, st, pd) in ODD:
        add("check", f"agl_{name}_int4", int4_spec(N, C, H, K, R, st, pd, 1), None, knobs=dict(wgl, BK=32, pstages=3,
                                                                                              stages=3))
    # N tiles of 112 / 96 columns (one m64n112 / m64n96 wgmma per k-step; the last N tile partly past K on most
    # shapes): every shape at batch 8, 8-bit (one and two warpgroups, erq on some) and 4-bit register-A kernels with
    # expanded weights (w8 + awarp, agl on some); the odd shapes (mma.sync fallback where wgmma cannot take them)
    for li, (name, C, H, K, R, st, pd) in enumerate(layers):
        v = li % 3
        bn = (112, 96)[li % 2]
        add("check", f"wgn_{name}_b8_int8", int8_spec(8, C, H, K, R, st, pd, v), None,
            knobs=dict(wg, BN=bn, WM=1 + li % 3 // 2, BK=128 if li % 3 // 2 == 0 else 256, stages=3 - li % 3 // 2,
                       erq=bool(li % 4 == 3)))
        add("check", f"wgn_{name}_b8_int4", int4_spec(8, C, H, K, R, st, pd, (v + 1) % 3), None,
            knobs=dict(ww8, awarp=True, WM=1, BN=bn, BK=64, pstages=3, stages=3,
                       agl=bool(li % 2 and R * R * C // 2 % 64 == 0)))
    for (name, N, C, H, K, R, st, pd) in ODD:
        add("check", f"wgn_{name}_int8", int8_spec(N, C, H, K, R, st, pd, 1), None, knobs=dict(wg, BN=112, WM=1))
    # ... and on 8-bit operands (agl8: the same loader without the unpack, the weights k-permuted by
    # reference.permute_k8): every shape at batch 8 with the largest K-chunk its reduction is a whole number of, rings
    # 1-4 chunks deep, one m64 instruction per warpgroup (64 rows, or 128 on two warpgroups), BN 64 / 128, erq, every
    # epilogue variant, pipe -1 and 0; split-K plans at batch 1; the odd shapes (the kernel the selector falls back to)
    for li, (name, C, H, K, R, st, pd) in enumerate(layers):
        v = li % 3
        p = 2 + li % 4
        kl = dict(wgl, BK=next((bk for bk in (128, 64, 32) if R * R * C % bk == 0), 32), pstages=p, stages=p,
                  WM=1 + li % 2, BM=64 * (1 + li % 2), BN=(64, 128)[li // 2 % 2], erq=bool(li % 4 == 3))
        add("check", f"agl8_{name}_b8_int8", int8_spec(8, C, H, K, R, st, pd, v), None, knobs=kl)
        add("check", f"agl8g1_{name}_b8_int8", int8_spec(8, C, H, K, R, st, pd, (v + 1) % 3), None,
            knobs=dict(kl, pipe=0, stages=p + 1, WM=2 - li % 2, BM=64 * (2 - li % 2), BK=min(kl["BK"], 64)))
        if li % 3 == 0:
            add("check", f"agl8_plan_{name}_b1_int8", int8_spec(1, C, H, K, R, st, pd, v), None, plan=True,
                knobs=dict(kl, BM=64, WM=1))
    for (name, N, C, H, K, R, st, pd) in ODD:
        add("check", f"agl8_{name}_int8", int8_spec(N, C, H, K, R, st, pd, 1), None, knobs=dict(wgl, BK=32, pstages=3,
                                                                                              stages=3, BM=64, WM=1))
    # the requantize on the accumulators with 8-bit staging (erq: every epilogue variant; the int32-output one keeps
    # the int32 staging) on mma.sync and wgmma kernels, 4-bit register-A kernels, and persistent 8-bit wgmma kernels
    # (persist: one and two blocks per SM, several tiles per block, chunks streamed across tile boundaries), at batch 8
    # in both layouts, split-K plans at batch 1 (persist off there) and the odd shapes (mma.sync fallback)
    for li, (name, C, H, K, R, st, pd) in enumerate(layers):
        v = li % 3
        lay = ("NHWC", "HWNC")[li % 2]
        add("check", f"erq_{name}_b8_int8_{lay.lower()}", int8_spec(8, C, H, K, R, st, pd, v, lay), None,
            knobs=dict(erq=True))
        add("check", f"erqw_{name}_b8_int4_{lay.lower()}", int4_spec(8, C, H, K, R, st, pd, v, lay), None,
            knobs=dict(wga, erq=True))
        add("check", f"per_{name}_b8_int8_{lay.lower()}", int8_spec(8, C, H, K, R, st, pd, v, lay), None,
            knobs=dict(wg, erq=True, persist=1 + li % 2, stages=3 - li % 2))
        if li % 2:
            add("check", f"per_plan_{name}_b1_int8", int8_spec(1, C, H, K, R, st, pd, v), None, plan=True,
                knobs=dict(wg, erq=True, persist=2, stages=2))
            add("check", f"per32_{name}_b8_int8", int8_spec(8, C, H, K, R, st, pd, v), None,  # int32 staging beside
                knobs=dict(wg, persist=1, BK=64, stages=4))
    # stream-K (sk: sk x SMs blocks share the (tile, K-chunk) iterations; partials, counters, the owner's epilogue):
    # every layer at batch 1 (as a plan: stream-K replaces the split-K pair) and 8, every epilogue variant, both
    # layouts, one and two blocks per SM, with and without erq; the kernel must also leave its counters at zero
    for li, (name, C, H, K, R, st, pd) in enumerate(layers):
        v = li % 3
        lay = ("NHWC", "HWNC")[li // 2 % 2]
        add("check", f"sk_plan_{name}_b1_int8", int8_spec(1, C, H, K, R, st, pd, v), None, plan=True,
            knobs=dict(wg, sk=1, erq=bool(li % 2)))
        two = li % 2 and v != 2  # (two 128x128 blocks per SM need the 8-bit staging: erq, and not the int32 output)
        add("check", f"sk_{name}_b8_int8_{lay.lower()}", int8_spec(8, C, H, K, R, st, pd, v, lay), None,
            knobs=dict(wg, sk=2, stages=2, erq=True) if two else dict(wg, sk=1, erq=li % 4 == 3))
    for (name, N, C, H, K, R, st, pd) in ODD:
        add("check", f"sk_{name}_int8", int8_spec(N, C, H, K, R, st, pd, 1), None, knobs=dict(wg, sk=1))
    for (name, N, C, H, K, R, st, pd) in ODD:
        add("check", f"erq_{name}_int8", int8_spec(N, C, H, K, R, st, pd, 1), None, knobs=dict(erq=True))
        add("check", f"per_{name}_int8", int8_spec(N, C, H, K, R, st, pd, 0), None, knobs=dict(wg, erq=True, persist=2,
                                                                                               stages=2))
    # the stem as CUDA builds run it (``space_to_depth``: a 4x4 stride-1 conv over the 2x2 space-to-depth input, 16
    # channels; C=3 padded to 4 as the compiler does): every epilogue variant, a pad value, the 4-bit output of the INT4
    # model, mma.sync and wgmma tiles, as plans; ResNet-50 at batch 1 and 8 and the odd stems (odd H: 57, 33)
    from qcompile.schedules.spec import space_to_depth

    stems = [("r50_stem", 1, 3, 224, 64, 7, 2, 3), ("r50_stem", 8, 3, 224, 64, 7, 2, 3)]
    for (name, N, C, H, K, R, st, pd) in stems + [o for o in ODD if "stem" in o[0]]:
        nm = f"s2d_{name}" + (f"_b{N}" if name == "r50_stem" else "")
        for v in (0, 1, 2):
            sp = space_to_depth(int8_spec(N, C + (-C % 4), H, K, R, st, pd, v))
            add("check", f"{nm}_v{v}", sp, None, plan=True)
            add("check", f"{nm}_wg_v{v}", sp, None, plan=True, knobs=dict(wg, BN=64, erq=v == 0))
        sp = space_to_depth(int8_spec(N, C + (-C % 4), H, K, R, st, pd, 0))
        add("check", f"{nm}_padzp", sp.replace(pad_value=17), None, plan=True)
        add("check", f"{nm}_u4out", sp.replace(out_dtype="uint4", zo=1, lo=0, hi=15), None, plan=True,
            knobs=dict(BM=128, BN=64, BK=64, WM=2, WN=2, stages=4, erq=True))
    # signed residuals (a block's first add takes the downsample's output, not ReLU-clipped: the residual fields
    # sign-extended in the epilogue), with the 4-bit model's own residual constants (RQ2_RESNET50, compiled in) and
    # per-channel 8-bit ones: every ResNet-50 shape at batch 8 (the as-compiled plan) and 32 (the w8 register-A and
    # ping-pong kernels with erq on and off), both layouts
    w8k = [dict(wg, BK=64, WM=1, BN=64, stages=3, pstages=3, areg=True, w8=True, awarp=True, minb=3),
           dict(wg, BK=64, WM=1, BM=128, stages=4, pstages=4, pp=True, areg=True, w8=True)]
    for li, (name, C, H, K, R, st, pd) in enumerate(distinct(RESNET50)):
        lay = ("NHWC", "HWNC")[li % 2]
        s4 = int4_spec(8, C, H, K, R, st, pd, 1, lay).replace(res_dtype="int4", res_i32=True, shift_ge33=True,
                                                               rq2_uniform=RQ2_RESNET50)
        s8 = int8_spec(8, C, H, K, R, st, pd, 1, lay).replace(res_dtype="int8")
        add("check", f"sres_{name}_b8_int4_{lay.lower()}", s4, None, plan=True)
        add("check", f"sres_{name}_b8_int8_{lay.lower()}", s8, None, plan=True)
        add("check", f"sres_{name}_b32_int4_{lay.lower()}", s4.replace(N=32), None,
            knobs=dict(w8k[li % 2], erq=bool(li % 3 == 1)))
        add("check", f"sres_{name}_b32_int8_{lay.lower()}", s8.replace(N=32), None,
            knobs=dict(wg, WM=1, BN=64, stages=3, minb=3, erq=bool(li % 3 == 2)))
    # the stem's direct kernel from a shared-memory halo tile (schedules/stem.py, strategy direct_halo): the ResNet stem
    # (its space-to-depth conv) at batch 1 / 3 / 8 as the selector gives it, and forced on smaller stems (output rows
    # of 32 / 48 / 80 pixels) with rows-per-item that do not divide the rows, both pipe forms, signed inputs with a
    # non-zero padding value, signed 8- and 4-bit outputs and the int64 fixed point (shift_ge33 off)
    from qcompile.schedules.spec import space_to_depth

    def stem_s2d(N, H, **kw):
        return space_to_depth(ConvSpec(N=N, H=H, W=H, C=4, K=64, R=7, S=7, stride=2, padding=3, w_bits=8, **kw))

    u4 = dict(x_dtype="uint8", out_dtype="uint4", zo=1, lo=0, hi=15, shift_ge33=True)
    u8 = dict(x_dtype="uint8", out_dtype="uint8", zo=3, lo=0, hi=255, shift_ge33=True)
    s8 = dict(x_dtype="int8", out_dtype="int8", zo=-3, lo=-128, hi=127, pad_value=-5)
    s4 = dict(x_dtype="int8", out_dtype="int4", zo=0, lo=-8, hi=7, pad_value=7, shift_ge33=True)
    for N in (1, 3, 8):
        add("check", f"halo_stem_b{N}_int4", stem_s2d(N, 224, **u4), None, plan=True)
        add("check", f"halo_stem_b{N}_int8", stem_s2d(N, 224, **u8), None, plan=True)
    for i, (N, H) in enumerate(((3, 96), (2, 64), (1, 160), (5, 96))):
        for j, ep in enumerate((u4, u8, s8, s4)):
            th, pipe, minb = (1, 3, 4, 5, 8)[(i + j) % 5], (i + j) % 2, (3, 2, 4)[(i + 2 * j) % 3]
            add("check", f"halo_h{H}_b{N}_{('u4', 'u8', 's8', 's4')[j]}_th{th}_p{pipe}_m{minb}", stem_s2d(N, H, **ep),
                "direct_halo", knobs=dict(th=th, pipe=pipe, minb=minb))
    # the transposed implicit GEMM (schedules/igemm_t.py, strategy implicit_gemm_t: output channels as M, pixels as
    # N): every ResNet-50 shape it takes at batch 8 (the last pixel tile partial), forced, with pixel tiles of 64-192,
    # ring depths 4-6 and one or two MMA groups in flight (4-bit: the activations through registers or a shared packed
    # ring); 8- and 4-bit, signed / unsigned activations, 8- / 4-bit outputs, both fixed-point forms; the layer-4
    # shapes at batch 64 (132 blocks, the defaults) and odd shapes (stride 2 on odd sizes, batch 1-3)
    from qcompile.schedules.igemm_t import kt_constraints, smem_bytes

    kts = [(64, 4, 1), (96, 5, 2), (128, 6, 1), (192, 5, 2), (112, 5, 1)]  # (pixel tile, ring depth, groups in flight)
    eps = [dict(x_dtype="uint8", w_bits=8, out_dtype="uint8", zo=3, lo=0, hi=255, shift_ge33=True),
           dict(x_dtype="uint4", w_bits=4, out_dtype="uint4", zo=1, lo=0, hi=15, shift_ge33=True),
           dict(x_dtype="int8", w_bits=8, out_dtype="int4", zo=-1, lo=-8, hi=7),
           dict(x_dtype="int4", w_bits=4, out_dtype="int8", zo=-3, lo=-128, hi=127)]
    kti = 0
    for (name, C, H, K, R, st, pd) in distinct(RESNET50):
        for N in (8, 64):
            sp = ConvSpec(N=N, H=H, W=H, C=C, K=K, R=R, S=R, stride=st, padding=pd, **eps[kti % len(eps)])
            if kt_constraints(sp, "sm_90") or (N == 64 and "_l4_" not in name):
                continue
            bn, stg, gif = kts[kti % len(kts)]
            ring = kti % 3 == 1 and sp.x_bits == 4
            while smem_bytes(sp, bn, stg, ring) > 227 * 1024:
                stg -= 1
            gif = min(gif, stg - 3)
            add("check", f"kt_{name}_b{N}_{sp.x_dtype}_w{sp.w_bits}_{sp.out_dtype}", sp, "implicit_gemm_t",
                knobs=dict(bn=bn, stages=stg, ring=int(ring), gif=gif) if N == 8 else None)
            kti += 1
    for i, (N, C, H, K, R, st, pd) in enumerate(((3, 128, 15, 256, 3, 2, 1), (3, 256, 9, 128, 3, 1, 1),
                                                 (2, 128, 13, 128, 1, 2, 0), (1, 384, 11, 256, 3, 1, 1))):
        sp = ConvSpec(N=N, H=H, W=H, C=C, K=K, R=R, S=R, stride=st, padding=pd, **eps[i])
        add("check", f"kt_odd{i}_{sp.x_dtype}_w{sp.w_bits}_{sp.out_dtype}", sp, "implicit_gemm_t",
            knobs=dict(bn=(80, 80, 64, 96)[i], stages=(4, 6, 5, 4)[i], ring=int(i == 3)) if i % 2 else None)
    if bench and not quick:
        for (name, C, H, K, R, st, pd) in distinct(RESNET50):
            for N in (8, 64, 256):
                add("bench", f"{name}_b{N}_int8", int8_spec(N, C, H, K, R, st, pd, 0), None)
                add("bench", f"{name}_b{N}_int4", int4_spec(N, C, H, K, R, st, pd, 0), None)
    return cases


def build_group(args):
    """Build one module of kernels: ``args`` = (module index, cases, output dir)."""
    gi, group, out = args
    out = pathlib.Path(out)
    import tvm
    from qcompile.schedules import conv2d_int_kernel, conv2d_int_plan
    from qcompile.schedules.build import ensure_stub_libcuda, nvcc_options, cuda_target
    from qcompile.cuda_tools import wgmma_a_hazards_by_kernel
    from qcompile.schedules.igemm import streamk_args, w8_kperm, w8_weights

    ensure_stub_libcuda()
    arch, mode = group[0]["arch"], group[0]["mode"]
    funcs = {}
    import warnings

    from qcompile.schedules import GemmKnobs
    from qcompile.schedules.igemm_t import KtKnobs
    from qcompile.schedules.stem import HaloKnobs

    for c in group:
        # (knobs with no forced strategy are GemmKnobs: conv2d_int_kernel then keeps the implicit GEMM where the
        # selector would take implicit_gemm_t)
        strat = c["strategy"]
        kcls = {"direct_halo": HaloKnobs, "implicit_gemm_t": KtKnobs}.get(strat, GemmKnobs)
        kn = kcls(**c["knobs_kw"]) if c.get("knobs_kw") else None
        with warnings.catch_warnings():  # forced wgmma knobs on a shape they cannot take: the mma.sync kernel
            warnings.simplefilter("ignore")
            fs = (conv2d_int_plan(c["spec"], arch, strat, kn) if c.get("plan")
                  else [conv2d_int_kernel(c["spec"], arch, strat, kn)])
        f = fs[0]
        strat = str(f.attrs["qcompile.strategy"])
        c["strategy_used"] = strat + (f"+splitk{int(f.attrs['qcompile.split_k'])}" if len(fs) > 1 else "")
        c["knobs"] = str(f.attrs["qcompile.knobs"]) if f.attrs and "qcompile.knobs" in f.attrs else ""
        c["funcs"] = [c["func"] + ("_e" if i else "") for i in range(len(fs))]
        c["sk"] = streamk_args(f)
        c["w8"] = w8_weights(f)
        c["w8_kperm"] = w8_kperm(f)
        for fn, f in zip(c["funcs"], fs):
            funcs[fn] = f.with_attr("global_symbol", fn)
        if len(fs) > 1:  # the same conv unsplit, to time against the split-K pair
            c["nosplit_func"] = c["func"] + "_ns"
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                nsf = conv2d_int_kernel(c["spec"], arch, strat, kn)
            funcs[c["nosplit_func"]] = nsf.with_attr("global_symbol", c["nosplit_func"])
    so = out / f"g{gi:03d}_{arch}_{mode}.so"
    keep = out / "keep" / f"g{gi:03d}"
    t = time.time()
    with nvcc_options(arch, mode, keep=str(keep)):
        lib = tvm.compile(tvm.IRModule(funcs), target=cuda_target(arch))
    lib.export_library(str(so))
    hz = wgmma_a_hazards_by_kernel(str(so)) if arch == "sm_90" and mode == "sass" else {}  # (register-A wgmma)
    for c in group:
        c["so"] = so.name
        c["sass_hazards"] = [h for fn in c["funcs"] for h in hz.get(fn + "_kernel", [])][:8]
    return gi, [{k: v for k, v in c.items() if k != "spec"} | {"spec": spec_dict(c["spec"])} for c in group], time.time() - t


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=None, help="output directory (default build/gpu/checks)")
    ap.add_argument("--quick", action="store_true", help="a smaller set: the first four ResNet layers where the checks walk every layer, no bench kernels")
    ap.add_argument("--jobs", type=int, default=2, help="parallel build processes")
    ap.add_argument("--group", type=int, default=12, help="kernels per module")
    ap.add_argument("--filter", default=None, help="regex: build only cases whose name matches")
    ap.add_argument("--residual", action="store_true", help="only cases with the residual-add epilogue")
    ap.add_argument("--checks-only", action="store_true", help="no bench kernels (the layer bench of "
                    "scripts/tune_layers.py times the compiled-model kernels instead)")
    a = ap.parse_args()
    out = pathlib.Path(a.dir) if a.dir else BUILD_DIR
    out.mkdir(parents=True, exist_ok=True)
    for f in out.glob("*.so"):
        f.unlink()
    cases = make_cases(a.quick, bench=not a.checks_only)
    if a.filter:
        import re
        cases = [c for c in cases if re.search(a.filter, c["name"])]
    if a.residual:
        cases = [c for c in cases if c["spec"].has_residual]
    for i, c in enumerate(cases):
        c["func"] = f"k{i:04d}"
    groups, cur = [], []
    for c in cases:
        if cur and (len(cur) >= a.group or (cur[0]["arch"], cur[0]["mode"]) != (c["arch"], c["mode"])):
            groups.append(cur)
            cur = []
        cur.append(c)
    if cur:
        groups.append(cur)
    print(f"{len(cases)} kernels in {len(groups)} modules", flush=True)
    t0 = time.time()
    manifest = []
    with mp.get_context("spawn").Pool(a.jobs) as pool:
        for gi, recs, dt in pool.imap_unordered(build_group, [(gi, g, str(out)) for gi, g in enumerate(groups)]):
            manifest += recs
            print(f"  group {gi} ({len(recs)} kernels) {dt:.1f}s  total {time.time() - t0:.0f}s", flush=True)
    manifest.sort(key=lambda r: r["func"])
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    (out / "build_command.txt").write_text("python scripts/device_build.py " + shlex.join(sys.argv[1:]) + "\n")
    for r in manifest:  # (cuda_tools.wgmma_a_hazards: such a kernel may compute wrong sums on the GPU)
        for h in r.get("sass_hazards", []):
            print(f"SASS HAZARD {r['name']}: {h}", flush=True)
    print(f"built in {time.time() - t0:.0f}s; {sum(f.stat().st_size for f in out.glob('*.so')) / 1e6:.1f} MB")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
