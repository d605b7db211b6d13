"""Fused vs unfused ResNet-50 layer1 bottleneck block (INT8, NHWC, tensor cores): check every kernel bit for bit
against the NumPy reference, then time them. On the GPU host (CuPy; nvcc or NVRTC; no TVM)::

    python3 scripts/fusion_proto/run.py --batch 256 32 --out $OUT/fusion.json

Here (no GPU)::

    python scripts/fusion_proto/run.py --dry-run

Steps, per batch:
  1. fresh random block input x (seed printed; the block's weights and requantize parameters are drawn once per run,
     stage by stage on a sample image so every stage's outputs spread over int8: reference.draw_block);
  2. the NumPy reference (reference.reference: compiler/tune/measure.py's exact integer conv + requantize);
  3. check: every output and intermediate buffer poisoned (0x5A), the two fused kernels and the three unfused
     kernels run, each output compared byte for byte (fused out, fused_7x8 out; unfused y1, y2, out); the unfused
     3x3 and last 1x1 also on the reference's own inputs (isolating a wrong kernel);
  4. time (CUDA events around a CUDA graph of --inner launches; --reps samples after --warmup; median): fused
     (14 x 8 tiles, 1 CTA / SM), fused_7x8 (7 x 8 tiles, 2 CTAs / SM), the three unfused kernels together and each
     alone;
  5. check again with a second poison (0xA5: a byte left unwritten equals the reference under at most one poison).
The JSON (--out) holds the device, date, command, seed, kernel resources, checks, times, GB/s and TOPS; the exit
status is 1 on any mismatch. ``--dry-run`` (batch 2) runs the same harness with NumPy stand-ins for the kernels
(backends.FakeBackend), checks the reference against a per-pixel evaluation of the block's definition, checks that
a corrupted output is reported, and runs bottleneck.cu's five kernels on the host (emulate.py: g++, about 20 s) at
batch 1 against the reference.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import secrets
import statistics
import sys
import time
import traceback

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import backends as B  # noqa: E402
import emulate as E  # noqa: E402
import reference as R  # noqa: E402

PIXELS = R.IMG * R.IMG
MACS_PER_PIXEL = R.C_IN * R.C_MID + 9 * R.C_MID * R.C_MID + R.C_MID * R.C_IN
BYTES_FUSED = 2 * R.C_IN  # per pixel: x in, out
BYTES_UNFUSED = {"k1_conv1x1": R.C_IN + R.C_MID, "k2_conv3x3": 2 * R.C_MID,
                 "k3_conv1x1_res": R.C_MID + 2 * R.C_IN}  # per pixel: each kernel's reads + writes


def diagnose(got: np.ndarray, want: np.ndarray, poison: int) -> dict:
    """Where an output differs: count, the first 8 (n, h, w, c) with both values, how many of the wrong bytes hold
    the poison (never written), and the differences by channel mod 32 and by position in a 14 x 8 tile."""
    bad = got != want
    first = np.flatnonzero(bad.reshape(-1))[:8]
    pos = [dict(at=[int(v) for v in np.unravel_index(i, got.shape)], got=int(got.reshape(-1)[i]),
                want=int(want.reshape(-1)[i])) for i in first]
    by_c = bad.reshape(-1, got.shape[-1]).sum(axis=0)
    c32 = np.bincount(np.arange(got.shape[-1]) % 32, weights=by_c, minlength=32).astype(int)
    px = bad.any(axis=-1).sum(axis=0)
    tile = np.zeros((14, 8), int)
    for h in range(got.shape[1]):
        tile[h % 14] += px[h].reshape(-1, 8).sum(axis=0) if got.shape[2] % 8 == 0 else 0
    return dict(count=int(bad.sum()), first=pos, poison_bytes=int(np.count_nonzero(got[bad].view(np.uint8) == poison)),
                by_channel_mod32=c32.tolist(), by_tile_pos_14x8=tile.tolist())


class Case:
    """One batch on one backend: device buffers, the reference and the launches."""

    def __init__(self, be, d: dict, blk: R.Block, x: np.ndarray, ref: dict):
        self.be, self.n, self.ref_host = be, x.shape[0], ref
        n, z = self.n, blk
        self.zo = (z.conv1.zo, z.conv2.zo, z.conv3.zo, z.zo_out)
        self.rq = R.kernel_rq2(blk)  # (c1, R1, c2, R2, SR): the kernels' residual-stage arguments
        self.x = be.put(x)
        self.w1 = be.put(blk.conv1.w.reshape(R.C_MID, R.C_IN).astype(np.int8))
        self.w2 = be.put(blk.conv2.w.reshape(R.C_MID, 9 * R.C_MID).astype(np.int8))
        self.w3 = be.put(blk.conv3.w.reshape(R.C_IN, R.C_MID).astype(np.int8))
        self.p = be.put(B.pack_params(blk, d))
        self.ref = {k: be.put(v) for k, v in ref.items()}
        self.out_f = be.empty((n, R.IMG, R.IMG, R.C_IN))
        self.out_f7 = be.empty((n, R.IMG, R.IMG, R.C_IN))
        self.out_u = be.empty((n, R.IMG, R.IMG, R.C_IN))
        self.y1 = be.empty((n, R.IMG, R.IMG, R.C_MID))
        self.y2 = be.empty((n, R.IMG, R.IMG, R.C_MID))

    def fused(self):
        self.be.launch("fused_bottleneck", self.n, (self.x, self.w1, self.w2, self.w3, self.p, self.out_f, self.n,
                                                    *self.zo, *self.rq))

    def fused7(self):
        self.be.launch("fused_bottleneck_7x8", self.n, (self.x, self.w1, self.w2, self.w3, self.p, self.out_f7,
                                                        self.n, *self.zo, *self.rq))

    def k1(self):
        self.be.launch("k1_conv1x1", self.n, (self.x, self.w1, self.p, self.y1, self.n, self.zo[0]))

    def k2(self):
        self.be.launch("k2_conv3x3", self.n, (self.y1, self.w2, self.p, self.y2, self.n, self.zo[0], self.zo[1]))

    def k3(self):
        self.be.launch("k3_conv1x1_res", self.n, (self.y2, self.x, self.w3, self.p, self.out_u, self.n, self.zo[2],
                                                  self.zo[3], *self.rq))

    def unfused(self):
        self.k1()
        self.k2()
        self.k3()

    def _compare(self, out: dict, name: str, buf, ref_name: str, poison: int) -> None:
        c = self.be.mismatches(buf, self.ref[ref_name])
        out[name] = c
        if c:
            out.setdefault("diagnosis", {})[name] = diagnose(self.be.get(buf), self.ref_host[ref_name], poison)

    def check(self, poison: int) -> dict:
        """Steps 3 / 5: poison, run, compare (mismatch counts; a diagnosis of each mismatching buffer)."""
        be, res = self.be, {"poison": f"0x{poison:02X}"}
        for buf in (self.out_f, self.out_f7, self.out_u, self.y1, self.y2):
            be.fill(buf, poison)
        self.fused()
        self.fused7()
        self.unfused()
        be.sync()
        for name, buf, ref in (("fused_out", self.out_f, "out"), ("fused_7x8_out", self.out_f7, "out"),
                               ("unfused_y1", self.y1, "y1"),
                               ("unfused_y2", self.y2, "y2"), ("unfused_out", self.out_u, "out")):
            self._compare(res, name, buf, ref, poison)
        be.copy(self.y1, self.ref["y1"])  # the last two kernels alone, on the reference's inputs
        be.fill(self.y2, poison)
        self.k2()
        be.sync()
        self._compare(res, "k2_alone_y2", self.y2, "y2", poison)
        be.copy(self.y2, self.ref["y2"])
        be.fill(self.out_u, poison)
        self.k3()
        be.sync()
        self._compare(res, "k3_alone_out", self.out_u, "out", poison)
        return res


def summary(ts: list, n: int, nbytes: int) -> dict:
    us = statistics.median(ts)
    return dict(us=round(us, 2), min_us=round(min(ts), 2), max_us=round(max(ts), 2), samples=len(ts),
                gbps=round(nbytes / (us * 1e-6) / 1e9, 1), tops=round(2 * n * PIXELS * MACS_PER_PIXEL / (us * 1e-6)
                                                                      / 1e12, 1))


def run_batch(be, d: dict, blk: R.Block, rng: np.random.Generator, n: int, opt) -> dict:
    """Steps 1-5 for batch n."""
    x = R.draw_input(rng, n)
    t0 = time.perf_counter()
    ref = R.reference(blk, x, threads=opt.threads)
    ref_s = time.perf_counter() - t0
    case = Case(be, d, blk, x, ref)
    print(f"batch {n}: reference {ref_s:.1f} s; spread of out {R.spread(ref['out'])}", flush=True)
    before = case.check(0x5A)
    times = {}
    px = n * PIXELS
    for name, fn, nbytes in (("fused", case.fused, BYTES_FUSED * px),
                             ("fused_7x8", case.fused7, BYTES_FUSED * px),
                             ("unfused", case.unfused, sum(BYTES_UNFUSED.values()) * px),
                             ("k1_conv1x1", case.k1, BYTES_UNFUSED["k1_conv1x1"] * px),
                             ("k2_conv3x3", case.k2, BYTES_UNFUSED["k2_conv3x3"] * px),
                             ("k3_conv1x1_res", case.k3, BYTES_UNFUSED["k3_conv1x1_res"] * px)):
        ts, method = be.time(fn, opt.reps, opt.inner, opt.warmup)
        times[name] = dict(summary(ts, n, nbytes), bytes=nbytes, timing=method)
    after = case.check(0xA5)
    bad = sum(v for c in (before, after) for k, v in c.items() if isinstance(v, int))
    res = dict(batch=n, ok=bad == 0, reference_s=round(ref_s, 1), checks=dict(before_timing=before,
               after_timing=after), times=times, grids={k: be.grid(k, n) for k in B.KERNELS},
               speedup_fused=round(times["unfused"]["us"] / times["fused"]["us"], 3),
               speedup_fused_7x8=round(times["unfused"]["us"] / times["fused_7x8"]["us"], 3),
               spread={k: R.spread(v) for k, v in ref.items()})
    print(f"batch {n}: mismatches before timing {_counts(before)}, after {_counts(after)}")
    for name, t in times.items():
        print(f"  {name:15s} {t['us']:9.1f} us  {t['gbps']:7.1f} GB/s  {t['tops']:6.1f} TOPS  ({t['timing'][:40]})")
    print(f"  speedup over unfused: fused {res['speedup_fused']}x, fused_7x8 {res['speedup_fused_7x8']}x", flush=True)
    return res


def _counts(c: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in c.items() if isinstance(v, int))


def dry_checks(d: dict, blk: R.Block, rng: np.random.Generator, emulate: bool) -> dict:
    """The dry run's own checks: the reference against the per-pixel definition (and a corrupted reference caught
    by it), the parameter packing round trip, the shared memory budget, a corrupted kernel output caught, and
    (``emulate``) bottleneck.cu's kernels themselves run on the host (emulate.py) against the reference."""
    x = R.draw_input(rng, 2)
    ref = R.reference(blk, x, threads=2)
    res = dict(naive_pixel_mismatches=R.check_pixels(blk, x, ref, rng))
    broken = {k: v.copy() for k, v in ref.items()}
    broken["out"][1, 55, 55, 7] = broken["out"][1, 55, 55, 7] ^ 1
    res["naive_catches_corruption"] = R.check_pixels(blk, x, broken, np.random.default_rng(0), extra=0) == 1
    p = B.pack_params(blk, d)
    back = B.unpack_block(d, blk.conv1.w, blk.conv2.w, blk.conv3.w, p, blk.conv1.zo, blk.conv2.zo, blk.conv3.zo,
                          blk.zo_out, R.kernel_rq2(blk))
    res["params_round_trip"] = all(np.array_equal(getattr(getattr(back, c), f), getattr(getattr(blk, c), f))
                                   for c in ("conv1", "conv2", "conv3") for f in ("b", "M", "S")) and \
        np.array_equal(back.rq2, blk.rq2)
    res["smem_bytes"] = {k: d[B.SMEM_NAME[k]] for k in B.KERNELS}
    res["smem_fits"] = max(res["smem_bytes"].values()) <= 232448  # (sm_90's opt-in limit per block)
    # two CTAs per SM: 2 x (dynamic + the 1 KB the driver reserves per block) within sm_90's 228 KB
    res["smem_two_ctas_fit"] = all(2 * (d[B.SMEM_NAME[k]] + 1024) <= 233472 for k in B.TWO_CTAS)
    case = Case(B.FakeBackend(d, corrupt=True), d, blk, x, ref)
    res["harness_catches_corruption"] = case.check(0x5A)["fused_out"] == 1
    if emulate:
        res["emulated_kernels"] = E.emulate(blk, d, rng, 1)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=None, help="batch sizes (default 256 32; dry run 2)")
    ap.add_argument("--out", default=None, help="JSON results path")
    ap.add_argument("--seed", type=int, default=None, help="default: fresh")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--inner", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="reference threads (default: all cores)")
    ap.add_argument("--dry-run", action="store_true", help="no GPU: NumPy stand-ins for the kernels (batch 2)")
    ap.add_argument("--no-emulate", action="store_true", help="dry run: skip the host emulation of the kernels")
    opt = ap.parse_args(argv)
    batches = opt.batch or ([2] if opt.dry_run else [256, 32])
    if any(b < 1 for b in batches):
        ap.error(f"--batch {batches}: positive sizes")
    seed = opt.seed if opt.seed is not None else secrets.randbits(31)
    print(f"seed {seed}", flush=True)
    doc = dict(what="fused vs unfused ResNet-50 layer1 bottleneck (scripts/fusion_proto)", seed=seed,
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               command=" ".join([os.path.basename(sys.executable)] + sys.argv), dry_run=opt.dry_run,
               timing=dict(reps=opt.reps, inner=opt.inner, warmup=opt.warmup, statistic="median us per launch"),
               runs=[], ok=False)
    try:
        ok = _run(opt, batches, seed, doc)
    except BaseException as e:  # (the JSON is what comes back from the GPU host: record the error in it)
        doc["error"] = "".join(traceback.format_exception(e))
        _write(opt.out, doc)
        raise
    doc["ok"] = ok
    _write(opt.out, doc)
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


def _write(path, doc: dict) -> None:
    if path:
        pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(path).write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {path}")


def _run(opt, batches: list, seed: int, doc: dict) -> bool:
    """The checks and timings into ``doc`` (rewritten to --out after each batch); True when everything matches."""
    rng = np.random.default_rng(seed)
    d = B.cu_defines()
    blk = R.draw_block(rng)
    doc["zero_points"] = dict(zo1=blk.conv1.zo, zo2=blk.conv2.zo, zo3=blk.conv3.zo, zo_out=blk.zo_out)
    be = B.FakeBackend(d) if opt.dry_run else B.CupyBackend(d)
    doc["device"] = be.device()
    doc["kernels"] = {k: be.kernel_info(k) for k in B.KERNELS}
    ok = True
    if opt.dry_run:
        dc = doc["dry_checks"] = dry_checks(d, blk, rng, not opt.no_emulate)
        print(f"dry-run checks: {dc}")
        ok = dc["naive_pixel_mismatches"] == 0 and dc["naive_catches_corruption"] and dc["params_round_trip"] and \
            dc["smem_fits"] and dc["smem_two_ctas_fit"] and dc["harness_catches_corruption"] and \
            all(dc["emulated_kernels"][k] == 0 for k in E.OUTPUTS if "emulated_kernels" in dc)
    for n in batches:
        doc["runs"].append(run_batch(be, d, blk, rng, n, opt))
        ok = ok and doc["runs"][-1]["ok"]
        _write(opt.out, doc)
    return ok


if __name__ == "__main__":
    sys.exit(main())
