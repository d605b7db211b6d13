#!/usr/bin/env python3
"""End-to-end benchmark: qcompile ResNets against PyTorch fp16, on the GPU host (TVM runtime + numpy + torch).

    python scripts/build_e2e.py --batch 8 64 256 --check-batch 8 --embedded-batch 1 8     # build host
    bash scripts/bench_e2e.sh [DIR] [NET_BITS ...] [--out OUT]      # GPU host: the runtime bundle, then `run`
    python scripts/bench_e2e.py run [DIR] [NET_BITS ...] [--out OUT]  # GPU host, TVM runtime already importable
    python scripts/bench_e2e.py table OUT/bench_e2e.json [--write docs/BENCHMARKS.md README.md]

``run``, for every NET_BITS folder of build_e2e.py's output (DIR, default build/gpu/e2e) and every batch size:
  * check: the GPU output equals the llvm build's output bit for bit (batches with yN.npy); the VM's memory pool is
    first filled by a run on a different random input, so unwritten outputs would show;
  * time: the whole forward pass (one CUDA-graph replay per call), median of repeats, input already on the GPU;
then PyTorch fp16 channels_last with CUDA graphs (cuDNN, ``cudnn.benchmark``) for the same net and batch in the same
process. Prints a table and writes OUT/bench_e2e.json (OUT default: DIR) with the device, date and versions.
``table`` writes the Markdown table of such a file (scripts/e2e_table.py).
"""
import argparse
import datetime
import json
import os
import pathlib
import shlex
import sys
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
DEFAULT_DIR = pathlib.Path(__file__).resolve().parents[1] / "build" / "gpu" / "e2e"


def check_input(b: int):
    """The end-to-end check input of batch b (build_e2e.py writes it as xN.npy; ``run`` draws it again where that
    file is absent): standard normal, seed 100 + b, float32 [b, 3, 224, 224]."""
    return np.random.default_rng(100 + b).standard_normal((b, 3, 224, 224)).astype("float32")


def _gpu_imports():
    """torch, tvm (runtime only: TVM_USE_RUNTIME_LIB=1 unless set) with its CUDA module loader, qcompile's Module."""
    global torch, tvm, Module
    os.environ.setdefault("TVM_USE_RUNTIME_LIB", "1")
    import torch
    import tvm

    from qcompile.runtime import Module, load_cuda_runtime

    load_cuda_runtime(required=True)


def bench_torch(fn, iters=20, warm=5):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(5):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(iters):
            fn()
        e.record()
        torch.cuda.synchronize()
        ts.append(s.elapsed_time(e) / iters)
    return sorted(ts)[len(ts) // 2]


def torch_fp16(net, batch):
    import torchvision

    torch.backends.cudnn.benchmark = True
    model = getattr(torchvision.models, net)().eval().cuda().half().to(memory_format=torch.channels_last)
    x = torch.randn(batch, 3, 224, 224, device="cuda", dtype=torch.half).to(memory_format=torch.channels_last)
    with torch.inference_mode():
        for _ in range(3):
            model(x)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            model(x)
        t = bench_torch(g.replay)
    del g, model
    torch.cuda.empty_cache()
    return t


def bench_ours(m, batch, number):
    x = tvm.runtime.tensor(np.random.default_rng(7).standard_normal((batch, 3, 224, 224)).astype("float32"), m.dev)
    for _ in range(3):  # the first call captures the CUDA graph
        m.vm["main"](x, *m.weights)
    t0 = time.time()
    while time.time() - t0 < 0.5:  # half a second of replays first, queued 20 at a time (a sync after each one
        for _ in range(20):       # leaves the GPU idle between them, and its clocks low at batch 1)
            m.vm["main"](x, *m.weights)
        m.dev.sync()
    f = m.vm.time_evaluator("main", m.dev, number=number, repeat=7)
    r = f(x, *m.weights)
    return float(np.median(r.results)) * 1e3


def profile(so, weights, batch, reps=5):
    """Per-kernel times of one forward pass, from a build without the CUDA graph.

    The VM's instrument hook synchronizes the GPU before and after every call instruction and reads a
    host clock, so each kernel's time includes one launch + sync overhead (~10 us); median of ``reps``.
    """
    from tvm.runtime.vm import VirtualMachine, VMInstrumentReturnKind

    lib = tvm.runtime.load_module(so)
    dev = tvm.cuda(0)
    vm = VirtualMachine(lib, dev)
    with np.load(weights) as z:
        w = [tvm.runtime.tensor(z[f"w{i}"], dev) for i in range(len(z.files))]
    x = tvm.runtime.tensor(np.random.default_rng(3).standard_normal((batch, 3, 224, 224)).astype("float32"), dev)
    for _ in range(3):
        vm["main"](x, *w)
    runs, state = [], {}

    def instrument(func, symbol, before, ret, *args):
        dev.sync()
        if before:
            state["t"] = time.perf_counter()
        else:
            state["calls"].append((str(symbol), time.perf_counter() - state["t"]))
        return VMInstrumentReturnKind.NO_OP

    vm.set_instrument(instrument)
    for _ in range(reps):
        state["calls"] = []
        vm["main"](x, *w)
        runs.append(state["calls"])
    n = min(len(r) for r in runs)
    kernels = []
    for i in range(n):
        name = runs[0][i][0]
        kernels.append((name, 1e6 * float(np.median([r[i][1] for r in runs]))))
    kernels = [(n_, t) for n_, t in kernels if not n_.startswith("vm.builtin")]
    total = sum(t for _, t in kernels)
    conv = sum(t for n_, t in kernels if n_.startswith("qconv_"))
    top = sorted(kernels, key=lambda kv: -kv[1])[:12]
    return {"kernels_us": total, "conv_us": conv, "glue_us": total - conv, "n_kernels": len(kernels),
            "n_conv": sum(n_.startswith("qconv_") for n_, _ in kernels), "top": top, "all": kernels}


def regenerated_input(entry, b):
    """The batch-b check input when xN.npy is not in the build folder (it is large: 38 MB at batch 64): drawn again
    by ``check_input``, refused unless its sha1 is the one build_e2e.py recorded."""
    import hashlib

    x = check_input(b)
    want = entry["batches"][str(b)].get("x_sha1")
    if want is None or hashlib.sha1(x.tobytes()).hexdigest() != want:
        raise RuntimeError(f"x{b}.npy absent and the regenerated input does not match the build's (sha1)")
    return x


def warm_gpu(seconds=2.0):
    """Keep the GPU busy for ``seconds`` (fp16 matmuls) so that it leaves its idle clocks before anything is timed:
    without it the first batch-1 model of a process measures 0.52 ms and the same .so 0.35 ms later on (H100)."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.half)
    t0 = time.time()
    while time.time() - t0 < seconds:
        for _ in range(10):
            a @ a
        torch.cuda.synchronize()
    del a


def cmd_run(a):
    _gpu_imports()
    root = pathlib.Path(a.dir)
    only = set(a.tags)
    out = pathlib.Path(a.out or root)
    out.mkdir(parents=True, exist_ok=True)
    man = json.load(open(root / "manifest.json"))
    meta = {"device": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(),
            "torch": torch.__version__, "cudnn": str(torch.backends.cudnn.version()), "tvm": tvm.__version__,
            "command": shlex.join(["python", "scripts/bench_e2e.py", *sys.argv[1:]])}
    meta["build_commands"] = list(dict.fromkeys(c for t, e in man.items() if not only or t in only
                                                for c in e.get("build_commands", [])))
    print(json.dumps(meta), flush=True)
    warm_gpu()
    results, torch_cache = [], {}
    for tag, entry in man.items():
        if only and tag not in only:
            continue
        net, bits = tag.rsplit("_", 1)
        d = root / tag
        wd = root / entry.get("weights_from", tag)  # (an A/B build of one model may share its weights)
        wfile = wd / "weights.npz"
        wb = {b: next((f for f in (d / f"weights_b{b}.npz", wd / f"weights_b{b}.npz") if f.exists()), wfile)
              for b in (int(k) for k in entry["batches"])}  # (per batch: w8 records; an A/B build's from its twin)
        runs = [(b, f"b{b}.so") for b in sorted(wb) if (d / f"b{b}.so").exists() and wb[b].exists()]
        runs += [(int(p.stem[3:]), p.name) for p in sorted(d.glob("emb*.so"))]  # weights inside the .so
        for b, so in runs:
            row = {"net": net, "bits": bits, "batch": b, "weights": "embedded" if so.startswith("emb") else "beside"}
            try:
                m = Module(str(d / so), "cuda", weights=str(wb[b]) if row["weights"] == "beside" else None)
                xf = d / f"x{b}.npy" if (d / f"x{b}.npy").exists() else root / f"x{b}.npy"  # inputs may be shared
                if (d / f"y{b}.npy").exists():
                    x, y_ref = (np.load(xf) if xf.exists() else regenerated_input(entry, b)), np.load(d / f"y{b}.npy")
                    m(np.random.default_rng(1).standard_normal(x.shape).astype("float32") * 3)  # stale pool
                    y = m(x)
                    row["exact"] = bool(np.array_equal(y, y_ref))
                    row["max_abs_diff"] = float(np.abs(y - y_ref).max())
                row["ms"] = bench_ours(m, b, number=max(2, 200 // b))
                row["img_s"] = b / row["ms"] * 1e3
                del m
            except Exception as e:  # keep going: report it
                row["error"] = f"{type(e).__name__}: {str(e)[-300:]}"
            key = (net, b)
            if key not in torch_cache:
                torch_cache[key] = torch_fp16(net, b)
            row["torch_fp16_ms"] = torch_cache[key]
            row["torch_img_s"] = b / torch_cache[key] * 1e3
            if "ms" in row:
                row["speedup"] = row["torch_fp16_ms"] / row["ms"]
            results.append(row)
            print(json.dumps(row), flush=True)
    profiles = {}
    for tag in man:
        if only and tag not in only:
            continue
        for so in sorted((root / tag).glob("prof*.so")):
            b = int(so.stem[4:])
            try:
                p = profile(str(so), str(root / man[tag].get("weights_from", tag) / "weights.npz"), b)
                profiles[f"{tag}_b{b}"] = p
                print(f"\nprofile {tag} batch {b}: {p['kernels_us'] / 1e3:.3f} ms in {p['n_kernels']} kernels: "
                      f"tensor-core convs {p['conv_us'] / 1e3:.3f} ms ({p['n_conv']}), glue {p['glue_us'] / 1e3:.3f} ms")
                for n, t in p["top"]:
                    print(f"   {t:9.1f} us  {n[:90]}")
            except Exception as e:
                print(f"profile {tag} b{b} failed: {type(e).__name__}: {str(e)[-300:]}")
    json.dump({**meta, "results": results, "profiles": profiles}, open(out / "bench_e2e.json", "w"), indent=1)
    print("wrote", out / "bench_e2e.json")
    print("\n| net | bits | batch | exact vs llvm | qcompile ms | img/s | PyTorch fp16 ms | img/s | speedup |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        ex = {True: "yes", False: "NO"}.get(r.get("exact"), "-")
        if "ms" in r:
            print(f"| {r['net']} | {r['bits']} | {r['batch']} | {ex} | {r['ms']:.3f} | {r['img_s']:.0f} | "
                  f"{r['torch_fp16_ms']:.3f} | {r['torch_img_s']:.0f} | {r['speedup']:.2f}x |")
        else:
            print(f"| {r['net']} | {r['bits']} | {r['batch']} | error: {r['error'][:80]} |")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="check and time every build in DIR against PyTorch fp16 (GPU host)")
    r.add_argument("dir", nargs="?", default=str(DEFAULT_DIR), help="build_e2e.py's output (default: %(default)s)")
    r.add_argument("tags", nargs="*", help="only these NET_BITS folders (default: all in the manifest)")
    r.add_argument("--out", help="where bench_e2e.json goes (default: DIR)")
    import e2e_table

    e2e_table.add_table_command(sub, "e2e", "the Markdown table of results files (scripts/e2e_table.py)", many=True)
    a = ap.parse_args(argv)
    if a.cmd == "run":
        cmd_run(a)
    else:
        e2e_table.write_block(a.name, e2e_table.e2e_table(a.results), a.write)


if __name__ == "__main__":
    main()
