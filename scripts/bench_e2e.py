#!/usr/bin/env python3
"""End-to-end benchmark on the GPU host (TVM runtime only): qcompile ResNets vs PyTorch fp16.

    bash scripts/bench_e2e.sh .e2e [tags...]          # one device call (see that script)

For every NET_BITS folder of scripts/build_e2e.py's output and every batch size:
  * check: the GPU output equals the llvm build's output bit for bit (batches with xN/yN.npy); the VM's
    memory pool is first filled by a run on a different random input, so unwritten outputs would show;
  * time: the whole forward pass (one CUDA-graph replay per call), median of repeats, inputs on the GPU;
then PyTorch fp16 channels_last with CUDA graphs (as shared/anchors/torch_baselines.py) for the same
net and batch in the same run. Prints a table and writes $OUT/bench_e2e.json.
"""
import ctypes
import json
import os
import pathlib
import sys
import time

os.environ.setdefault("TVM_USE_RUNTIME_LIB", "1")
import numpy as np  # noqa: E402
import torch  # noqa: E402
import tvm  # noqa: E402
from tvm.base import _LOADED_LIBS  # noqa: E402

ctypes.CDLL(str(pathlib.Path(_LOADED_LIBS["tvm_runtime"]._name).resolve().parent / "libtvm_runtime_cuda.so"),
            mode=ctypes.RTLD_LOCAL)
from qcompile.runtime import Module  # noqa: E402

OUT = pathlib.Path(os.environ.get("OUT", "/tmp"))


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


def bench_ours(m: Module, batch, number):
    x = tvm.runtime.tensor(np.random.default_rng(7).standard_normal((batch, 3, 224, 224)).astype("float32"), m.dev)
    for _ in range(3):  # the first call captures the CUDA graph
        m.vm["main"](x, *m.weights)
    t0 = time.time()
    while time.time() - t0 < 0.5:  # half a second of replays first, queued 20 at a time (a sync after each one
        for _ in range(20):       # left the GPU idle between them: its clocks stayed low at batch 1)
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
    """The batch-b check input when its x{b}.npy was not carried (64 MiB per call: x at batch 64 alone is 38 MB):
    device_env.check_input's draw again, refused unless its sha1 is the one recorded at build time."""
    import hashlib

    from device_env import check_input

    x = check_input(b)
    want = entry["batches"][str(b)].get("x_sha1")
    if want is None or hashlib.sha1(x.tobytes()).hexdigest() != want:
        raise RuntimeError(f"x{b}.npy not carried and the regenerated input does not match the build's (sha1)")
    return x


def warm_gpu(seconds=2.0):
    """Keep the GPU busy for ``seconds`` (fp16 matmuls) so that it leaves its idle clocks before anything is timed:
    without it the first batch-1 model of a call measured 0.52 ms and the same .so 0.35 ms later in the call."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.half)
    t0 = time.time()
    while time.time() - t0 < seconds:
        for _ in range(10):
            a @ a
        torch.cuda.synchronize()
    del a


def main():
    root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else ".e2e")
    only = set(sys.argv[2:])
    man = json.load(open(root / "manifest.json"))
    print("GPU:", torch.cuda.get_device_name(), "torch", torch.__version__, "cudnn", torch.backends.cudnn.version(),
          "tvm", tvm.__version__, flush=True)
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
        runs = [(b, f"b{b}.so") for b in sorted(wb) if (d / f"b{b}.so").exists() and wb[b].exists()]  # (what the call carried)
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
    json.dump({"results": results, "profiles": profiles}, open(OUT / "bench_e2e.json", "w"), indent=1)
    print("\n| net | bits | batch | exact vs llvm | qcompile ms | img/s | PyTorch fp16 ms | img/s | speedup |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        ex = {True: "yes", False: "NO"}.get(r.get("exact"), "-")
        if "ms" in r:
            print(f"| {r['net']} | {r['bits']} | {r['batch']} | {ex} | {r['ms']:.3f} | {r['img_s']:.0f} | "
                  f"{r['torch_fp16_ms']:.3f} | {r['torch_img_s']:.0f} | {r['speedup']:.2f}x |")
        else:
            print(f"| {r['net']} | {r['bits']} | {r['batch']} | error: {r['error'][:80]} |")


if __name__ == "__main__":
    main()
