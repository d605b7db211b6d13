#!/usr/bin/env python3
"""Check (and time) qcompile's 8-bit NHWC max-pool kernel (schedules/pool.py) on the GPU host, and its packed 4-bit
form (``packed4``: the INT4 models' stem pool on the nibbles two per byte).

    python scripts/check_pools.py build [--dir DIR]              # build host: DIR/pools.so + cases.json
    python3 scripts/check_pools.py device [--dir DIR] [--out OUT]  # GPU host (TVM runtime + numpy + torch)
    python scripts/check_pools.py table OUT/check_pools.json [--write docs/BENCHMARKS.md]

DIR defaults to build/gpu/pools, OUT to DIR. On the GPU host: every case on fresh random bytes over the type's whole
range, the output poisoned before each of two runs, compared byte for byte with a float64 max over the window's
positions inside the input (torch; exact for 8-bit values). At batch 256 the ResNet stem's pool is timed (CUDA graph)
side by side with two baselines -- TVM's legalized max_pool2d under dlight's default rules, and under
``glue.ChannelsLastWindowReduction`` -- and so is the global average pool's sum (uint8 -> int32 over 7x7 of 2048
channels) under dlight and under the rule; every baseline is checked too. JSON to OUT/check_pools.json; ``table``
writes its Markdown table (block ``pools``).
"""
from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import shlex
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
DIR = ROOT / "build" / "gpu" / "pools"
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


def cmd_build(a):
    import tvm

    from qcompile.schedules.build import cuda_target, ensure_stub_libcuda, nvcc_options
    from qcompile.schedules.pool import max_pool_nhwc_kernel

    ensure_stub_libcuda()  # (so that the module embeds compiled code, not CUDA source: the GPU host has no nvrtc)
    d = pathlib.Path(a.dir)
    d.mkdir(parents=True, exist_ok=True)
    funcs = {c[0]: max_pool_nhwc_kernel(*c[1:9], packed4=c[9] if len(c) > 9 else "").with_attr("global_symbol", c[0])
             for c in CASES}
    funcs.update({b[0]: _baseline(*b) for b in BASELINES})
    with nvcc_options("sm_90", "sass"):
        tvm.compile(tvm.IRModule(funcs), target=cuda_target("sm_90")).export_library(str(d / "pools.so"))
    cmd = shlex.join(["python", "scripts/check_pools.py", *sys.argv[1:]])  # (the device side records it)
    (d / "cases.json").write_text(json.dumps({"cases": CASES, "baselines": BASELINES, "command": cmd}))
    print(f"{len(funcs)} kernels -> {d / 'pools.so'}")


def reference(x, pool, strides, padding):
    """float64 max over the window positions inside x (NHWC in, NHWC out)."""
    import torch

    pt, pl, pb, pr = padding
    xp = torch.nn.functional.pad(x.permute(0, 3, 1, 2).double(), (pl, pr, pt, pb), value=float("-inf"))
    y = torch.nn.functional.max_pool2d(xp, pool, strides)
    return y.permute(0, 2, 3, 1)


def _gpu_runtime():
    """(qcompile's measure.py as a module, CUDA device 0): the TVM runtime with its CUDA backend loaded (runtime-only
    TVM loads none), from compiler/tune/measure.py loaded by path (it needs NumPy and the TVM runtime only)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("qcompile_measure", ROOT / "compiler" / "tune" / "measure.py")
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m, m.get_device("cuda", 0)


def capture(fn, launches):
    """A CUDA graph of ``launches`` calls of fn (TVM kernels on torch's capture stream through tvm_ffi)."""
    import torch
    import tvm_ffi

    g = torch.cuda.CUDAGraph()
    with tvm_ffi.use_torch_stream(torch.cuda.graph(g)):
        for _ in range(launches):
            fn()
    return g


def graph_time(fn, launches=20, reps=7):
    """Per-launch ms of ``launches`` calls of fn captured in one CUDA graph, median of ``reps`` replays."""
    import numpy as np
    import torch

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    g = capture(fn, launches)
    g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        g.replay()
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e) / launches)
    del g
    return float(np.median(ts))


def cmd_device(a):
    sys.path.insert(0, str(ROOT / "scripts"))
    from device_env import setup_runtime_and_reexec

    setup_runtime_and_reexec(__file__, sys.argv[1:])
    import numpy as np
    import torch
    import tvm

    M, dev = _gpu_runtime()
    pack4 = M.pack4  # (qcompile's nibble order: element 2i in the low nibble)
    d = pathlib.Path(a.dir)
    mod = tvm.runtime.load_module(str(d / "pools.so"))
    out = pathlib.Path(a.out or d)
    out.mkdir(parents=True, exist_ok=True)
    spec = json.loads((d / "cases.json").read_text())
    results, ok_all = [], True

    for name, N, H, W, C, dt, pool, strides, pad, *packed4 in spec["cases"]:
        rng = np.random.default_rng(len(results) + 1)
        p4 = packed4[0] if packed4 else ""
        lo, hi = {"int4": (-8, 8), "uint4": (0, 16)}.get(p4, (-128, 128) if dt == "int8" else (0, 256))
        xv = rng.integers(lo, hi, (N, H, W, C))
        ref = reference(torch.from_numpy(xv).cuda(), pool, strides, pad).cpu().numpy().astype(np.int64)
        x = pack4(xv).view(dt) if p4 else xv.astype(dt)
        if p4:  # the packed bytes, compared as bytes
            ref = pack4(ref).view(dt)
        xt = tvm.runtime.tensor(x, dev)
        ok = True
        for poison in (0x5A, 0xA5):
            y = tvm.runtime.tensor(np.full(ref.shape, poison, np.uint8).view(dt), dev)
            mod[name](xt, y)
            ok &= bool(np.array_equal(y.numpy().astype(np.int64), ref.astype(np.int64)))
        row = dict(name=name, ok=ok, shape=[N, H, W, C], dtype=dt, pool=pool, strides=strides, padding=pad, packed4=p4)
        if name.endswith("_b256"):
            row["ms"] = graph_time(lambda: mod[name](xt, y))
            xh = torch.randn(N, C, H, W, device="cuda").half().to(memory_format=torch.channels_last)
            row["torch_fp16_ms"] = graph_time(lambda: torch.nn.functional.max_pool2d(xh, pool, strides, 1))
        ok_all &= ok
        results.append(row)
        print(("PASS " if ok else "FAIL ") + json.dumps(row), flush=True)
    for name, op, shape in spec["baselines"]:  # (timed after the kernel in the same process)
        x = np.random.default_rng(len(results) + 1).integers(0, 256, shape).astype("uint8")
        xg = torch.from_numpy(x.astype(np.int64)).cuda()
        ref = (reference(xg, (3, 3), (2, 2), (1, 1, 1, 1)) if op == "max" else xg.sum(dim=(1, 2))).cpu().numpy()
        xt = tvm.runtime.tensor(x, dev)
        y = tvm.runtime.tensor(np.full(ref.shape, 0x5A, "uint8" if op == "max" else "int32"), dev)
        mod[name](xt, y)
        ok = bool(np.array_equal(y.numpy().astype(np.int64), ref.astype(np.int64)))
        row = dict(name=name, ok=ok, shape=shape, op=op, ms=graph_time(lambda: mod[name](xt, y)))
        ok_all &= ok
        results.append(row)
        print(("PASS " if ok else "FAIL ") + json.dumps(row), flush=True)
    meta = {"device": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(),
            "build_command": spec.get("command"),
            "command": shlex.join(["python3", "scripts/check_pools.py", *sys.argv[1:]])}
    (out / "check_pools.json").write_text(json.dumps({**meta, "results": results}, indent=1) + "\n")
    print(f"{sum(r['ok'] for r in results)}/{len(results)} pool kernels exact")
    sys.exit(0 if ok_all else 1)


POOL_ROWS = [  # (what, qcompile row, baseline rows)
    ("ResNet stem max pool 3x3/2, uint8 [256,112,112,64]", "r50_stem_pool_b256", ["maxpool_dlight", "maxpool_rule"]),
    ("the same on packed 4-bit values (INT4 models)", "u4_stem_pool_b256", []),
    ("global average pool's sum, uint8 -> int32 over 7x7 of [256,7,7,2048]", "avgsum_rule", ["avgsum_dlight"]),
]
BASELINE_NAMES = {"maxpool_dlight": "TVM max_pool2d, dlight's default GPU rules",
                  "maxpool_rule": "TVM max_pool2d under glue.ChannelsLastWindowReduction",
                  "avgsum_dlight": "TVM sum, dlight's default GPU rules"}


def table(path):
    res = json.loads(pathlib.Path(path).read_text())
    rs = {r["name"]: r for r in res["results"]}
    ok = sum(r["ok"] for r in res["results"])
    code = f", code at `{res['commit']}`" if res.get("commit") else ""
    out = [f"{res['device']}, {res['date']}{code}. Built with `{res['build_command']}`, measured on the GPU host with "
           f"`{res['command']}`. ms per kernel (CUDA graph); {ok} of {len(rs)} kernels (the cases and the baselines) "
           "equal to the reference byte for byte.", "",
           "| kernel (batch 256) | qcompile ms | PyTorch fp16 max_pool2d ms (channels_last) "
           "| baselines in the same run, ms |",
           "|---|---|---|---|"]
    for what, ours, bases in POOL_ROWS:
        r = rs[ours]
        torch_ms = f"{r['torch_fp16_ms']:.4f}" if "torch_fp16_ms" in r else "--"
        b = "; ".join(f"{BASELINE_NAMES[n]} {rs[n]['ms']:.4f}" for n in bases) or "--"
        out.append(f"| {what} | {r['ms']:.4f} | {torch_ms} | {b} |")
    return "\n".join(out) + "\n"


def main(argv=None):
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "scripts"))
    import e2e_table

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    e2e_table.add_gpu_host_commands(sub, DIR, "build the cases and baselines")
    e2e_table.add_table_command(sub, "pools")
    a = ap.parse_args(argv)
    if a.cmd == "table":
        e2e_table.write_block(a.name, table(a.results), a.write)
    else:
        {"build": cmd_build, "device": cmd_device}[a.cmd](a)


if __name__ == "__main__":
    main()
