#!/usr/bin/env python3
"""GPU tensors in and out of a compiled module, on a GPU host (TVM runtime + numpy; torch and/or CuPy with CUDA).

    python scripts/check_dlpack.py MODULE.so [--weights W.npz] [--input X.npy --expect Y.npy]

For a torch CUDA tensor and a CuPy array (where installed): the module's output through DLPack is a tensor of the same
library on the same GPU, bit for bit equal to the NumPy path's output (and to Y.npy where given: the llvm build's
output); the input tensor is left unchanged; then 200 calls on the same GPU input, timed, without a host round trip.
Prints one line per check and exits 1 if any fails.
"""
import argparse
import sys
import time

import numpy as np


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("module")
    ap.add_argument("--weights")
    ap.add_argument("--input")
    ap.add_argument("--expect")
    a = ap.parse_args(argv)
    from qcompile.runtime import Module

    m = Module(a.module, "cuda", weights=a.weights)
    shape = tuple(m.meta["input_shape"])
    x = np.load(a.input) if a.input else np.random.default_rng(5).standard_normal(shape).astype("float32")
    want = m(x)
    fails = 0
    if a.expect:
        ok = np.array_equal(want, np.load(a.expect))
        fails += not ok
        print(f"numpy path == {a.expect}: {ok}")
    for lib in ("torch", "cupy"):
        try:
            mod = __import__(lib)
        except ImportError:
            print(f"{lib}: not installed, skipped")
            continue
        xt = mod.asarray(x, device="cuda") if lib == "torch" else mod.asarray(x)
        keep = xt.clone() if lib == "torch" else xt.copy()
        y = m(xt)
        on_gpu = (y.device.type == "cuda") if lib == "torch" else isinstance(y, mod.ndarray)
        yh = y.cpu().numpy() if lib == "torch" else mod.asnumpy(y)
        same = bool(np.array_equal(yh, want))
        untouched = bool((xt == keep).all())
        for _ in range(3):
            m(xt)
        (mod.cuda.synchronize() if lib == "torch" else mod.cuda.Device().synchronize())
        t0 = time.perf_counter()
        for _ in range(200):
            y = m(xt, allow_nonfinite=True)
        (mod.cuda.synchronize() if lib == "torch" else mod.cuda.Device().synchronize())
        ms = (time.perf_counter() - t0) / 200 * 1e3
        ok = on_gpu and same and untouched and type(y).__module__.split(".")[0] == lib
        fails += not ok
        print(f"{lib}: output a {type(y).__module__}.{type(y).__name__} on the GPU: {on_gpu}; equal to the NumPy path: "
              f"{same}; input unchanged: {untouched}; {ms:.3f} ms per call (200 calls, GPU in and out)")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
