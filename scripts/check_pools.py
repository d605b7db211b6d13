#!/usr/bin/env python3
"""Check (and time) qcompile's 8-bit NHWC max-pool kernel (schedules/pool.py) on the GPU host, and its packed 4-bit
form (``packed4``: the INT4 models' stem pool on the nibbles two per byte).

    python scripts/check_pools.py build                      # here: .device/pools/pools.so + cases.json
    run(command="python3 scripts/check_pools.py device", carry=[".device/pools", ".bundle"])

On the GPU host (TVM runtime only): every case on fresh random bytes over the type's whole range, the output poisoned
before each of two runs, compared byte for byte with a float64 max over the window's positions inside the input
(torch; exact for 8-bit values). At batch 256 the ResNet stem's pool is timed (CUDA graph) side by side with the
baselines it replaces -- TVM's legalized max_pool2d under dlight's default rules, and under
``glue.ChannelsLastWindowReduction`` -- and so is the global average pool's sum (uint8 -> int32 over 7x7 of 2048
channels) under dlight and under the rule; every baseline is checked too.
"""
from __future__ import annotations

import json
import os
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
DIR = ROOT / ".device" / "pools"
# (name, N, H, W, C, dtype, pool, strides, padding t, l, b, r)
CASES = [
    ("r50_stem_pool_b1", 1, 112, 112, 64, "uint8", (3, 3), (2, 2), (1, 1, 1, 1)),
    ("r50_stem_pool_b8", 8, 112, 112, 64, "uint8", (3, 3), (2, 2), (1, 1, 1, 1)),
    ("r50_stem_pool_b256", 256, 112, 112, 64, "uint8", (3, 3), (2, 2), (1, 1, 1, 1)),
    ("int8_odd", 3, 15, 13, 64, "int8", (3, 3), (2, 2), (1, 1, 1, 1)),
    ("c4_words", 2, 9, 9, 4, "uint8", (3, 3), (2, 2), (1, 1, 1, 1)),
    ("c24_asym", 3, 10, 11, 24, "int8", (2, 3), (1, 2), (0, 1, 1, 2)),
    ("c16_big_pad", 1, 5, 6, 16, "uint8", (3, 3), (1, 1), (2, 2, 2, 2)),
    # 4-bit tensors packed two per byte (``packed4``; the INT4 models' stem pool): shapes as logical NHWC
    ("u4_stem_pool_b8", 8, 112, 112, 64, "uint8", (3, 3), (2, 2), (1, 1, 1, 1), "uint4"),
    ("u4_stem_pool_b256", 256, 112, 112, 64, "uint8", (3, 3), (2, 2), (1, 1, 1, 1), "uint4"),
    ("s4_odd", 3, 15, 13, 64, "int8", (3, 3), (2, 2), (1, 1, 1, 1), "int4"),
    ("u4_c8_words", 2, 9, 9, 8, "uint8", (3, 3), (2, 2), (1, 1, 1, 1), "uint4"),
    ("s4_c24_asym", 3, 10, 11, 24, "int8", (2, 3), (1, 2), (0, 1, 1, 2), "int4"),
]


# baselines at batch 256, timed side by side: (name, op, input shape)
BASELINES = [("maxpool_dlight", "max", [256, 112, 112, 64]), ("maxpool_rule", "max", [256, 112, 112, 64]),
             ("avgsum_dlight", "sum", [256, 7, 7, 2048]), ("avgsum_rule", "sum", [256, 7, 7, 2048])]


def _baseline(name, op, shape):
    """TVM's legalized pool (uint8 NHWC) scheduled by dlight's default GPU rules, or by our window-reduction rule."""
    import tvm
    from tvm import relax
    from tvm.s_tir import dlight as dl

    from qcompile.schedules.build import cuda_target
    from qcompile.schedules.glue import ChannelsLastWindowReduction

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(shape, "uint8"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit_output(relax.op.nn.max_pool2d(x, (3, 3), (2, 2), (1, 1, 1, 1), layout="NHWC") if op == "max"
                               else relax.op.sum(relax.op.astype(x, "int32"), axis=[1, 2]))
        bb.emit_func_output(y)
    mod = relax.transform.LegalizeOps()(bb.get())
    mod = relax.transform.FuseTIR()(relax.transform.FuseOps()(relax.transform.AnnotateTIROpPattern()(mod)))
    (f,) = [f for f in mod.functions.values() if isinstance(f, tvm.tirx.PrimFunc)]
    rules = [dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(), dl.gpu.GeneralReduction(), dl.gpu.Fallback()]
    if name.endswith("_rule"):
        rules = [ChannelsLastWindowReduction(min_threads=0)]
    with cuda_target("sm_90"):
        f = dl.ApplyDefaultSchedule(*rules)(tvm.IRModule({"main": f}))["main"]
    return f.with_attr("global_symbol", name)


def cmd_build():
    import tvm

    from qcompile.schedules.build import cuda_target, ensure_stub_libcuda, nvcc_options
    from qcompile.schedules.pool import max_pool_nhwc_kernel

    ensure_stub_libcuda()  # (so that the module embeds compiled code, not CUDA source: there is no nvrtc there)
    DIR.mkdir(parents=True, exist_ok=True)
    funcs = {c[0]: max_pool_nhwc_kernel(*c[1:9], packed4=c[9] if len(c) > 9 else "").with_attr("global_symbol", c[0])
             for c in CASES}
    funcs.update({b[0]: _baseline(*b) for b in BASELINES})
    with nvcc_options("sm_90", "sass"):
        tvm.compile(tvm.IRModule(funcs), target=cuda_target("sm_90")).export_library(str(DIR / "pools.so"))
    (DIR / "cases.json").write_text(json.dumps({"cases": CASES, "baselines": BASELINES}))
    print(f"{len(funcs)} kernels -> {DIR / 'pools.so'}")


def reference(x, pool, strides, padding):
    """float64 max over the window positions inside x (NHWC in, NHWC out)."""
    import torch

    pt, pl, pb, pr = padding
    xp = torch.nn.functional.pad(x.permute(0, 3, 1, 2).double(), (pl, pr, pt, pb), value=float("-inf"))
    y = torch.nn.functional.max_pool2d(xp, pool, strides)
    return y.permute(0, 2, 3, 1)


def cmd_device():
    sys.path.insert(0, str(ROOT / "scripts"))
    from device_env import setup_runtime_and_reexec

    setup_runtime_and_reexec(__file__, sys.argv[1:])
    import device_run as DR  # the TVM runtime + CUDA, the CUDA-graph timer
    import numpy as np
    import torch

    mod = DR.tvm.runtime.load_module(str(DIR / "pools.so"))
    out = pathlib.Path(os.environ.get("OUT", "/tmp"))
    spec = json.loads((DIR / "cases.json").read_text())
    results, ok_all = [], True
    sys.path.insert(0, str(ROOT / "schedules"))
    from reference import pack4  # (schedules/reference.py: the project's nibble order)

    for name, N, H, W, C, dt, pool, strides, pad, *packed4 in spec["cases"]:
        rng = np.random.default_rng(len(results) + 1)
        p4 = packed4[0] if packed4 else ""
        lo, hi = {"int4": (-8, 8), "uint4": (0, 16)}.get(p4, (-128, 128) if dt == "int8" else (0, 256))
        xv = rng.integers(lo, hi, (N, H, W, C))
        ref = reference(torch.from_numpy(xv).cuda(), pool, strides, pad).cpu().numpy().astype(np.int64)
        x = pack4(xv).view(dt) if p4 else xv.astype(dt)
        if p4:  # the packed bytes, compared as bytes
            ref = pack4(ref).view(dt)
        xt = DR.tvm.runtime.tensor(x, DR.DEV)
        ok = True
        for poison in (0x5A, 0xA5):
            y = DR.tvm.runtime.tensor(np.full(ref.shape, poison, np.uint8).view(dt), DR.DEV)
            mod[name](xt, y)
            ok &= bool(np.array_equal(y.numpy().astype(np.int64), ref.astype(np.int64)))
        row = dict(name=name, ok=ok, shape=[N, H, W, C], dtype=dt, pool=pool, strides=strides, padding=pad, packed4=p4)
        if name.endswith("_b256"):
            row["ms"] = DR.bench_timer(lambda: mod[name](xt, y))
            xh = torch.randn(N, C, H, W, device="cuda").half().to(memory_format=torch.channels_last)
            row["torch_fp16_ms"] = DR.bench_timer(lambda: torch.nn.functional.max_pool2d(xh, pool, strides, 1))
        ok_all &= ok
        results.append(row)
        print(("PASS " if ok else "FAIL ") + json.dumps(row), flush=True)
    for name, op, shape in spec["baselines"]:  # (timed after the kernel in the same process)
        x = np.random.default_rng(len(results) + 1).integers(0, 256, shape).astype("uint8")
        xg = torch.from_numpy(x.astype(np.int64)).cuda()
        ref = (reference(xg, (3, 3), (2, 2), (1, 1, 1, 1)) if op == "max" else xg.sum(dim=(1, 2))).cpu().numpy()
        xt = DR.tvm.runtime.tensor(x, DR.DEV)
        y = DR.tvm.runtime.tensor(np.full(ref.shape, 0x5A, "uint8" if op == "max" else "int32"), DR.DEV)
        mod[name](xt, y)
        ok = bool(np.array_equal(y.numpy().astype(np.int64), ref.astype(np.int64)))
        row = dict(name=name, ok=ok, shape=shape, op=op, ms=DR.bench_timer(lambda: mod[name](xt, y)))
        ok_all &= ok
        results.append(row)
        print(("PASS " if ok else "FAIL ") + json.dumps(row), flush=True)
    (out / "check_pools.json").write_text(json.dumps({"device": torch.cuda.get_device_name(), "results": results},
                                                     indent=1))
    print(f"{sum(r['ok'] for r in results)}/{len(results)} pool kernels exact")
    sys.exit(0 if ok_all else 1)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    {"build": cmd_build, "device": cmd_device}[sys.argv[1]]()
