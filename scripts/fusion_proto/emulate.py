"""bottleneck.cu's kernels run on the host (emu/: each CUDA thread a std::thread, ldmatrix / mma.sync emulated with
the PTX fragment layouts) and compared with the NumPy reference: the kernels' own index math checked without a GPU.

Steps: 1. build emu/emu_main.cpp with g++ (C++20); 2. write the inputs of batch n (a grid smaller than the tile
count, so the persistent loops and their double buffers turn over; batch 1's 3136 pixels leave the flat kernels a
partial last tile); 3. run; 4. compare the five outputs byte for byte."""
from __future__ import annotations

import pathlib
import shutil
import subprocess
import tempfile
import time

import numpy as np

import backends as B
import reference as R

HERE = pathlib.Path(__file__).resolve().parent
GRIDS = (5, 7, 4, 3, 6)  # fused, fused_7x8, k1, k2, k3 (each fewer CTAs than tiles at batch 1)
# the emulator's output files and the reference tensor each is compared with
OUTPUTS = {"fused_out": "out", "fused_7x8_out": "out", "y1": "y1", "y2": "y2", "unfused_out": "out"}


def build(out_dir: pathlib.Path) -> pathlib.Path:
    cxx = shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        raise SystemExit("emulation: no g++ / clang++ on PATH")
    exe = out_dir / "emu_main"
    cmd = [cxx, "-O2", "-std=c++20", "-pthread", "-Wno-unknown-pragmas", "-o", str(exe), str(HERE / "emu" /
                                                                                                "emu_main.cpp")]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"emulation build failed: {' '.join(cmd)}\n{r.stderr[-3000:]}")
    return exe


def emulate(blk: R.Block, d: dict, rng: np.random.Generator, n: int = 1) -> dict:
    """Mismatch counts of the emulated kernels' outputs (``OUTPUTS``) at batch n."""
    x = R.draw_input(rng, n)
    ref = R.reference(blk, x, threads=2)
    with tempfile.TemporaryDirectory() as tmp:
        t = pathlib.Path(tmp)
        exe = build(t)
        x.tofile(t / "x.bin")
        blk.conv1.w.reshape(R.C_MID, R.C_IN).astype(np.int8).tofile(t / "w1.bin")
        blk.conv2.w.reshape(R.C_MID, 9 * R.C_MID).astype(np.int8).tofile(t / "w2.bin")
        blk.conv3.w.reshape(R.C_IN, R.C_MID).astype(np.int8).tofile(t / "w3.bin")
        B.pack_params(blk, d).tofile(t / "params.bin")
        args = [str(exe), tmp, str(n), str(blk.conv1.zo), str(blk.conv2.zo), str(blk.conv3.zo), str(blk.zo_out)]
        args += [str(v) for v in R.kernel_rq2(blk)]
        grids = [min(g, B.tiles(k, n, d)) for g, k in zip(GRIDS, B.KERNELS)]
        t0 = time.perf_counter()
        subprocess.run(args + [str(g) for g in grids], check=True)
        secs = time.perf_counter() - t0
        got = {name: np.fromfile(t / f"{name}.bin", np.int8).reshape(ref[r].shape) for name, r in OUTPUTS.items()}
    res = dict(batch=n, grids=dict(zip(B.KERNELS, grids)), seconds=round(secs, 1))
    for name, r in OUTPUTS.items():
        res[name] = int(np.count_nonzero(got[name] != ref[r]))
    return res
