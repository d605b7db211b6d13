#!/usr/bin/env python3
"""Check the rpc runner's device helpers (qcompile/tune/device_check.py) on a GPU with the TVM runtime alone.

    # where the compiler is (the build host):
    python -c "from qcompile.tune import device_check as d; print(d.build('cuda', 'sm_90', 'build/dc'))"
    # on the GPU host (runtime-only TVM and NumPy suffice):
    python scripts/check_device_helpers.py build/dc/qc_device_check_cuda_sm_90_*.so

For several dtypes and ranks: a fill with one seed twice is equal (count 0); a copy with every 997th element changed
counts exactly those; a fill with another seed changes (almost) every element. Prints one line per case and
``ALL OK`` or ``FAILED`` (exit status 1).
"""
import sys

import numpy as np
import tvm

CASES = (("int8", (32, 56, 56, 256)), ("uint8", (7, 5, 3)), ("int32", (1000003,)), ("int8", (2, 3, 4, 5, 6)))


def main(path: str) -> int:
    m, d = tvm.runtime.load_module(path), tvm.cuda(0)
    part = tvm.runtime.empty((256 * 256,), "int32", d)
    ok = True
    for dt, shape in CASES:
        r = len(shape)
        fill, count = m[f"qc_fill_{dt}_{r}"], m[f"qc_count_{dt}_{r}"]
        a, b = tvm.runtime.empty(shape, dt, d), tvm.runtime.empty(shape, dt, d)
        fill(a, 5)
        x = a.numpy()
        fill(b, 5)
        count(a, b, part)
        c0 = int(part.numpy().sum())
        y = x.copy()
        y.reshape(-1)[::997] += 1
        b.copyfrom(y)
        count(a, b, part)
        c1, want = int(part.numpy().sum()), int((y != x).sum())
        fill(b, 6)
        frac = float((b.numpy() != x).mean())
        good = c0 == 0 and c1 == want and frac > 0.9 and len(np.unique(x)) > 1
        ok &= good
        print(dt, shape, "equal:", c0, "diff:", c1, "want", want, "reseeded differ:", round(frac, 3),
              "OK" if good else "BAD")
    print("ALL OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
