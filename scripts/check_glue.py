#!/usr/bin/env python3
"""Check (and time) the input quantize of a CUDA build -- float NCHW -> uint8, NHWC, the RGB channels padded to 4 and
the stem's 2x2 space-to-depth, one fused kernel -- under qcompile's glue rules (``glue.GatherRowElementwise``: a thread
per 16-byte output row) against the same function with ``glue.VectorizedElementwise`` in that rule's place (the
baseline: 4 bytes per thread, stored one by one, since the reads are gathers and the loop does not vectorize).

    python scripts/check_glue.py build [--dir DIR]              # build host: DIR/{rule,baseline}_bN.so
    python3 scripts/check_glue.py device [--dir DIR] [--out OUT]  # GPU host (TVM runtime + numpy + torch)
    python scripts/check_glue.py table OUT/check_glue.json [--write docs/BENCHMARKS.md]

DIR defaults to build/gpu/glue, OUT to DIR. On the GPU host: fresh random images, each build's output compared byte
for byte with NumPy (the same float32 division, floor and clip), then both timed alternately (``time_evaluator``,
median of 5 x 50 calls; a VM call around one kernel, so a few microseconds of host time are included), three rounds;
JSON to OUT/check_glue.json. ``table`` writes its Markdown table (block ``glue``).
"""
from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import shlex
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
DIR = ROOT / "build" / "gpu" / "glue"
BATCHES = (8, 256)
SCALE, ZP = 0.0187, 114.0  # (an ImageNet-like input scale and zero point)


def quantize_s2d(N):
    """The Relax function a CUDA build fuses in front of the stem (relay_passes/dispatch_tensor_core.py)."""
    from tvm import relax

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([N, 3, 224, 224], "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            v = relax.op.floor(relax.op.add(relax.op.divide(x, relax.const(SCALE, "float32")),
                                            relax.const(ZP, "float32")))
            v = relax.op.astype(relax.op.clip(v, 0, 255), "uint8")
            v = relax.op.nn.pad(relax.op.permute_dims(v, [0, 2, 3, 1]), [0, 0, 0, 0, 0, 0, 0, 1], pad_value=0.0)
            v = relax.op.permute_dims(relax.op.reshape(v, (N, 112, 2, 112, 2, 4)), [0, 1, 3, 2, 4, 5])
            y = bb.emit_output(relax.op.reshape(v, (N, 112, 112, 16)))
        bb.emit_func_output(y)
    return bb.get()


def cmd_build(a):
    import tvm
    from tvm.relax.backend.cuda import pipeline as cp
    from tvm.s_tir import dlight as dl

    from qcompile.pipeline import cuda_pipeline
    from qcompile.schedules.build import cuda_target, ensure_stub_libcuda
    from qcompile.schedules.glue import ChannelsLastWindowReduction, VectorizedElementwise

    ensure_stub_libcuda()
    tgt = cuda_target("sm_90")

    @tvm.transform.module_pass(opt_level=0, name="baseline")
    def baseline(mod, _ctx):  # the pipeline's rules with VectorizedElementwise in GatherRowElementwise's place
        with tgt:
            legalize = cp.legalize_passes(tgt)
            legalize[-1] = dl.ApplyDefaultSchedule(VectorizedElementwise(), ChannelsLastWindowReduction(),
                                                   dl.gpu.Fallback())
            return tvm.transform.Sequential(cp.library_dispatch_passes(tgt) + legalize + cp.dataflow_lower_passes(tgt)
                                            + cp.finalize_passes(tgt))(mod)

    d = pathlib.Path(a.dir)
    d.mkdir(parents=True, exist_ok=True)
    for N in BATCHES:
        for name, pipe in (("rule", cuda_pipeline(tgt)), ("baseline", baseline)):
            with tvm.transform.PassContext(opt_level=3):
                tvm.compile(quantize_s2d(N), target=tgt, relax_pipeline=pipe).export_library(str(d / f"{name}_b{N}.so"))
    cmd = shlex.join(["python", "scripts/check_glue.py", *sys.argv[1:]])
    (d / "build.json").write_text(json.dumps({"command": cmd}))  # (the device side records it with its results)
    print("built", sorted(p.name for p in d.glob("*.so")))


def _gpu_runtime():
    """(qcompile's measure.py as a module, CUDA device 0): the TVM runtime with its CUDA backend loaded (runtime-only
    TVM loads none), from compiler/tune/measure.py loaded by path (it needs NumPy and the TVM runtime only)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("qcompile_measure", ROOT / "compiler" / "tune" / "measure.py")
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m, m.get_device("cuda", 0)


def cmd_device(a):
    sys.path.insert(0, str(ROOT / "scripts"))
    from device_env import setup_runtime_and_reexec

    setup_runtime_and_reexec(__file__, sys.argv[1:])
    import numpy as np
    import torch
    import tvm
    from tvm.runtime.vm import VirtualMachine

    _, dev = _gpu_runtime()
    d = pathlib.Path(a.dir)
    built = json.loads((d / "build.json").read_text()) if (d / "build.json").exists() else {}
    res = dict(device=torch.cuda.get_device_name(0), date=datetime.date.today().isoformat(),
               build_command=built.get("command"),
               command=shlex.join(["python3", "scripts/check_glue.py", *sys.argv[1:]]), rows=[])
    for N in BATCHES:
        x = (np.random.default_rng(N).standard_normal((N, 3, 224, 224)) * 2).astype("float32")
        q = np.clip(np.floor(x / np.float32(SCALE) + np.float32(ZP)), 0, 255).astype(np.uint8)
        q = np.concatenate([q.transpose(0, 2, 3, 1), np.zeros((N, 224, 224, 1), np.uint8)], axis=-1)
        ref = q.reshape(N, 112, 2, 112, 2, 4).transpose(0, 1, 3, 2, 4, 5).reshape(N, 112, 112, 16)
        xt = tvm.runtime.tensor(x, dev)
        vms = {k: VirtualMachine(tvm.runtime.load_module(str(d / f"{k}_b{N}.so")), dev) for k in ("rule", "baseline")}
        row = {"batch": N}
        for k, vm in vms.items():
            row[f"{k}_exact"] = bool(np.array_equal(vm["main"](xt).numpy(), ref))
        for _ in range(3):
            for k, vm in vms.items():
                row.setdefault(f"{k}_ms", []).append(round(vm.time_evaluator("main", dev, number=50, repeat=5)(xt).median
                                                           * 1e3, 4))
        print(json.dumps(row), flush=True)
        res["rows"].append(row)
    out = pathlib.Path(a.out or d)
    out.mkdir(parents=True, exist_ok=True)
    (out / "check_glue.json").write_text(json.dumps(res, indent=1) + "\n")
    print("wrote", out / "check_glue.json")


def table(path):
    res = json.loads(pathlib.Path(path).read_text())
    code = f", code at `{res['commit']}`" if res.get("commit") else ""
    out = [f"{res['device']}, {res['date']}{code}. Built with `{res['build_command']}`, measured on the GPU host with "
           f"`{res['command']}`. ms per VM call (one kernel), median of 5 x 50 calls, three alternating rounds.", "",
           "| batch | qcompile's rule (GatherRowElementwise) ms | VectorizedElementwise ms | speed-up | both exact |",
           "|---|---|---|---|---|"]
    for r in res["rows"]:
        ms_r, ms_b = sorted(r["rule_ms"])[1], sorted(r["baseline_ms"])[1]
        ok = "yes" if r["rule_exact"] and r["baseline_exact"] else "**no**"
        out.append(f"| {r['batch']} | {' / '.join(f'{t:.4f}' for t in r['rule_ms'])} | "
                   f"{' / '.join(f'{t:.4f}' for t in r['baseline_ms'])} | {ms_b / ms_r:.2f}x | {ok} |")
    return "\n".join(out) + "\n"


def main(argv=None):
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "scripts"))
    import e2e_table

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    e2e_table.add_gpu_host_commands(sub, DIR, "build both forms")
    e2e_table.add_table_command(sub, "glue")
    a = ap.parse_args(argv)
    if a.cmd == "table":
        e2e_table.write_block(a.name, table(a.results), a.write)
    else:
        {"build": cmd_build, "device": cmd_device}[a.cmd](a)


if __name__ == "__main__":
    main()
