#!/usr/bin/env python
"""Build everything scripts/bench_e2e.py runs on the GPU host (no GPU needed on this side).

    python scripts/build_e2e.py --batch 8 64 256 --check-batch 8 --embedded-batch 1 8    # ResNet-18/50, 8/4/mixed

For each network and bit width: quantize (seeded random weights, random calibration data), export ONNX with a dynamic
batch, compile for ``--arch`` with ``--weights-beside`` for every batch size (one weights file serves the batch sizes
whose kernels take the same weight layout; weights_bN.npz holds batch N's where its kernels differ), and write a
fixed input with the reference output for the check batches (``--check-batch``): the output of the llvm build of the
same model (and, as a cross-check, whether the NumPy integer reference agrees with it at batch 1).

Layout of ``--dir`` (default build/gpu/e2e): NET_BITS/bN.so, NET_BITS/weights[_bN].npz, NET_BITS/xN.npy,
NET_BITS/yN.npy, manifest.json (with each build's command line); with ``--embedded-batch B`` also NET_BITS/embB.so,
the weights inside (the compiler's default), timed by bench_e2e.py as a row of its own.
"""
import argparse
import hashlib
import json
import os
import shlex
import shutil
import sys
import tempfile
import time

import numpy as np
import torch

from bench_e2e import DEFAULT_DIR, check_input
from qcompile.driver import CompileOptions, compile_model, weights_path
from qcompile.models.export_onnx import export_onnx
from qcompile.models.quantize import quantize_model
from qcompile.models.resnet import build_model
from qcompile.reference import Reference


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", "-o", default=str(DEFAULT_DIR), help="output folder (default: %(default)s)")
    ap.add_argument("--nets", nargs="+", default=["resnet18", "resnet50"])
    ap.add_argument("--bits", nargs="+", default=["8", "4", "mixed"])
    ap.add_argument("--batch", nargs="+", type=int, default=[1, 8, 64, 256])
    ap.add_argument("--check-batch", nargs="*", type=int, default=None,
                    help="batch sizes (of --batch) that get a fixed input and the llvm build's output (default: 1 8; none: an A/B build)")
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--layout", default="NHWC")
    ap.add_argument("--profile-batch", nargs="*", type=int, default=[],
                    help="also build profN.so without the CUDA graph, for a per-kernel time breakdown")
    ap.add_argument("--only-profile", action="store_true", help="build only the profN.so files (weights exist)")
    ap.add_argument("--embedded-batch", nargs="*", type=int, default=[],
                    help="also build embN.so with the weights inside the .so (the CLI's default): a call then passes "
                         "only the input, where a weights-beside module passes (and the VM checks) ~190 weight arrays")
    ap.add_argument("--only-embedded", action="store_true", help="build only the embN.so files")
    a = ap.parse_args()
    if a.check_batch is None:
        a.check_batch = [1, 8]
    elif set(a.check_batch) - set(a.batch):  # a check batch is built (and checked) only as one of --batch
        ap.error(f"--check-batch {sorted(set(a.check_batch) - set(a.batch))} not among --batch {a.batch}: add it there")
    os.makedirs(a.dir, exist_ok=True)
    cmd = shlex.join(["python", "scripts/build_e2e.py", *sys.argv[1:]])  # (recorded in the manifest)
    man_path = os.path.join(a.dir, "manifest.json")
    manifest = json.load(open(man_path)) if os.path.exists(man_path) else {}
    for net in a.nets:
        for bits in a.bits:
            tag = f"{net}_{bits}"
            d = os.path.join(a.dir, tag)
            os.makedirs(d, exist_ok=True)
            t0 = time.time()
            qm = quantize_model(build_model(net, seed=0), torch.randn(16, 3, 224, 224, generator=torch.Generator().manual_seed(1)),
                                bits=int(bits) if bits in ("4", "8") else bits)
            with tempfile.TemporaryDirectory() as td:
                onnx_path = os.path.join(td, "m.onnx")
                export_onnx(qm, onnx_path, (1, 3, 224, 224), batch=None)
                digest = None
                # batches built by earlier runs stay listed (their bN.so are still in the folder)
                old = manifest.get(tag, {}).get("batches", {})
                entry = {"batches": {b: v for b, v in old.items() if os.path.exists(os.path.join(d, f"b{b}.so"))},
                         "layout": a.layout, "arch": a.arch,
                         "build_commands": list(dict.fromkeys(manifest.get(tag, {}).get("build_commands", []) + [cmd]))}
                for b in a.profile_batch:
                    res = compile_model(onnx_path, CompileOptions(target="cuda", arch=a.arch, layout=a.layout, batch=b,
                                                                  weights_beside=True, cuda_graph=False), log=lambda s: None)
                    so = os.path.join(d, f"prof{b}.so")
                    res.export(so)
                    h = hashlib.sha1(open(weights_path(so), "rb").read()).hexdigest()
                    os.remove(weights_path(so))
                    ref = os.path.join(d, "weights.npz")
                    assert not os.path.exists(ref) or h == hashlib.sha1(open(ref, "rb").read()).hexdigest()
                    print(f"{tag} prof{b}: built", flush=True)
                for b in a.embedded_batch:
                    res = compile_model(onnx_path, CompileOptions(target="cuda", arch=a.arch, layout=a.layout, batch=b),
                                        log=lambda s: None)
                    res.export(os.path.join(d, f"emb{b}.so"))
                    print(f"{tag} emb{b}: built ({os.path.getsize(os.path.join(d, f'emb{b}.so')) / 2**20:.1f} MB)",
                          flush=True)
                if a.only_profile or a.only_embedded:  # (listed, so that bench_e2e.py finds the tag's embN / profN.so)
                    manifest[tag] = dict(manifest.get(tag) or entry, build_commands=entry["build_commands"])
                    json.dump(manifest, open(man_path, "w"), indent=1)
                    continue
                for b in a.batch:
                    tb = time.time()
                    res = compile_model(onnx_path, CompileOptions(target="cuda", arch=a.arch, layout=a.layout, batch=b,
                                                                  weights_beside=True), log=lambda s: None)
                    so = os.path.join(d, f"b{b}.so")
                    res.export(so)
                    w = weights_path(so)
                    h = hashlib.sha1(open(w, "rb").read()).hexdigest()
                    if digest is None:
                        digest = h
                        shutil.move(w, os.path.join(d, "weights.npz"))
                    elif h == digest:
                        os.remove(w)
                    else:  # 4-bit weights expanded for this batch's w8 kernels (GemmKnobs.w8): its own weights file
                        shutil.move(w, os.path.join(d, f"weights_b{b}.npz"))
                    kernels = {}
                    for l in res.layers:
                        kernels[l.kernel] = kernels.get(l.kernel, 0) + 1
                    info = {"so_mb": os.path.getsize(so) / 2**20, "kernels": kernels, "build_s": time.time() - tb}
                    if b in a.check_batch:
                        from qcompile.runtime import Module

                        x = check_input(b)
                        np.save(os.path.join(d, f"x{b}.npy"), x)  # (bench_e2e.py draws it again where it is absent)
                        info["x_sha1"] = hashlib.sha1(x.tobytes()).hexdigest()
                        r2 = compile_model(onnx_path, CompileOptions(layout=a.layout, batch=b), log=lambda s: None)
                        so2 = os.path.join(td, f"llvm_b{b}.so")  # distinct paths: dlopen caches by path
                        r2.export(so2)
                        y = Module(so2)(x)
                        np.save(os.path.join(d, f"y{b}.npy"), y)
                        if b == 1:
                            info["reference_equals_llvm"] = bool(np.array_equal(Reference(r2.integer_mod)(x), y))
                    entry["batches"][str(b)] = info
                    print(f"{tag} b{b}: {info}", flush=True)
            entry["quantize_and_build_s"] = time.time() - t0
            entry["weights_mb"] = os.path.getsize(os.path.join(d, "weights.npz")) / 2**20
            manifest[tag] = entry
            json.dump(manifest, open(man_path, "w"), indent=1)
    print(json.dumps({k: (v.get("weights_mb"), sum(b.get("so_mb", 0) for b in v["batches"].values()))
                      for k, v in manifest.items()}))


if __name__ == "__main__":
    main()
