#!/usr/bin/env python3
"""Is a qcompile forward call host-bound? (GPU host, TVM runtime + numpy + torch; with the runtime bundle, set
PYTHONPATH and TVM_USE_RUNTIME_LIB=1 as scripts/bench_e2e.sh does.)

    python3 scripts/e2e_host_probe.py enqueue build/gpu/e2e/resnet50_8/b1.so [WEIGHTS.npz]
    python3 scripts/e2e_host_probe.py queued build/gpu/e2e/resnet50_8/b1.so [WEIGHTS.npz]

``enqueue``: 200 calls without a sync (host time per call) vs until the GPU is idle (total per call), three times, and
TVM's time_evaluator; equal enqueue and total times mean the host is the limit. ``queued``: one call issued behind
~30 ms of queued GPU work: a host time far below 30 ms means the call does not synchronize. Prints one JSON line.
"""
import json
import os
import sys
import time

os.environ.setdefault("TVM_USE_RUNTIME_LIB", "1")
import numpy as np  # noqa: E402
import torch  # noqa: E402
import tvm  # noqa: E402
from qcompile.runtime import Module, load_cuda_runtime  # noqa: E402

load_cuda_runtime(required=True)


def main():
    mode, so = sys.argv[1], sys.argv[2]
    weights = sys.argv[3] if len(sys.argv) > 3 else None
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.half)
    t0 = time.time()
    while time.time() - t0 < 2:  # the GPU leaves its idle clocks
        a @ a
        torch.cuda.synchronize()
    m = Module(so, "cuda", weights=weights)
    b = int(m.meta["input_shape"][0])
    x = tvm.runtime.tensor(np.random.default_rng(7).standard_normal((b, 3, 224, 224)).astype("float32"), m.dev)
    f = m.vm["main"]
    for _ in range(300):
        f(x, *m.weights)
    m.dev.sync()
    torch.cuda.synchronize()
    res = {}
    if mode == "enqueue":
        for _ in range(3):
            t0 = time.perf_counter()
            for _ in range(200):
                f(x, *m.weights)
            t1 = time.perf_counter()
            m.dev.sync()
            t2 = time.perf_counter()
            res.setdefault("enqueue_ms", []).append(round((t1 - t0) / 200 * 1e3, 4))
            res.setdefault("total_ms", []).append(round((t2 - t0) / 200 * 1e3, 4))
        te = m.vm.time_evaluator("main", m.dev, number=200, repeat=7)(x, *m.weights)
        res["time_evaluator_ms"] = round(float(np.median(te.results)) * 1e3, 4)
    else:
        for _ in range(3):
            for _ in range(20):
                a @ a  # ~30 ms of GPU work queued on torch's stream
            t0 = time.perf_counter()
            f(x, *m.weights)
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            m.dev.sync()
            t2 = time.perf_counter()
            res.setdefault("host_ms", []).append(round((t1 - t0) * 1e3, 3))
            res.setdefault("until_idle_ms", []).append(round((t2 - t0) * 1e3, 3))
    print(so, b, mode, json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
