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
    f = m.vm.time_evaluator("main", m.dev, number=number, repeat=5)
    r = f(x, *m.weights)
    return float(np.median(r.results)) * 1e3


def main():
    root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else ".e2e")
    only = set(sys.argv[2:])
    man = json.load(open(root / "manifest.json"))
    print("GPU:", torch.cuda.get_device_name(), "torch", torch.__version__, "cudnn", torch.backends.cudnn.version(),
          "tvm", tvm.__version__, flush=True)
    results, torch_cache = [], {}
    for tag, entry in man.items():
        if only and tag not in only:
            continue
        net, bits = tag.rsplit("_", 1)
        d = root / tag
        if not (d / "weights.npz").exists():
            continue
        for b in sorted(int(k) for k in entry["batches"]):
            row = {"net": net, "bits": bits, "batch": b}
            try:
                m = Module(str(d / f"b{b}.so"), "cuda", weights=str(d / "weights.npz"))
                if (d / f"x{b}.npy").exists():
                    x, y_ref = np.load(d / f"x{b}.npy"), np.load(d / f"y{b}.npy")
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
    json.dump(results, open(OUT / "bench_e2e.json", "w"), indent=1)
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
