"""The NumPy side of the fused-bottleneck prototype: the block's random parameters, its exact integer reference (the
functions of compiler/tune/measure.py: ``conv_acc_nhwc``, ``requant``, ``reference_storage``) and an independent
per-pixel check of that reference (Python integers).

The block (ResNet-50 layer1, non-downsample; NHWC int8):
    y1 = rq(conv1x1(x, w1 [64, 1, 1, 256]), b1, M1, S1; zo1, lo = zo1)         (ReLU)
    y2 = rq(conv3x3(y1, w2 [64, 3, 3, 64], pad 1 with zo1), b2, M2, S2; zo2, lo = zo2)   (ReLU)
    y3 = rq(conv1x1(y2, w3 [256, 1, 1, 64]), b3, M3, S3; zo3, lo = -128)        (no ReLU)
    out = clip(((y3 + c1) R1 + (x + c2) R2 + 2^(SR - 1)) >> SR) + zo_out, zo_out, 127)   (ReLU after the add)
with rq(acc, b, M, S; zo, lo) = clip(((int32 wrap(acc + b)) M + 2^(S - 1)) >> S) + zo, lo, 127) in int64.

The parameters are drawn in the regime for which qcompile compiles ResNet-50's tensor-core kernels (and for which
the prototype's 32-bit epilogues are exact; ``kernel_rq2`` checks it): per-channel multipliers of 31 bits with their
shift S = 31 - exponent (compiler/fixed_point.py), so every S >= 33 (ConvSpec ``shift_ge33``); one residual
requantize (c1, R1, c2, R2, SR) for all channels (``rq2_uniform``: per-tensor activation scales) whose intermediates
fit int32 (``res_i32``).
"""
from __future__ import annotations

import importlib.util
import pathlib
from dataclasses import dataclass

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[2]
IMG, C_IN, C_MID = 56, 256, 64


def _load_measure():
    """compiler/tune/measure.py by path (it needs only NumPy; no qcompile install, no TVM)."""
    path = ROOT / "compiler" / "tune" / "measure.py"
    spec = importlib.util.spec_from_file_location("qc_measure", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


measure = _load_measure()


@dataclass
class Conv:
    """One conv of the block: logical weights [K, R, S, C] and its stage-1 requantize parameters."""
    w: np.ndarray
    b: np.ndarray  # int32 [K]
    M: np.ndarray  # int32 [K], > 0
    S: np.ndarray  # int32 [K], 20..31
    zo: int
    lo: int


@dataclass
class Block:
    conv1: Conv
    conv2: Conv
    conv3: Conv
    rq2: np.ndarray  # int32 [5, 256]: c1, R1, c2, R2, SR
    zo_out: int

    def spec(self, which: int, n: int):
        """measure.Spec of conv ``which`` (1, 2, 3) at batch n (qcompile's ConvSpec fields)."""
        c = (self.conv1, self.conv2, self.conv3)[which - 1]
        K, R, S, C = c.w.shape
        d = dict(N=n, H=IMG, W=IMG, C=C, K=K, R=R, S=S, padding=R // 2, zo=c.zo, lo=c.lo, hi=127)
        if which == 2:
            d["pad_value"] = self.conv1.zo  # conv2 pads with its input's zero point
        if which == 3:
            d.update(has_residual=True, zo2=self.zo_out, lo2=self.zo_out, hi2=127)
        return measure.Spec(d)


# ---------------------------------------------------------------------------------------------------------------
# parameters
# ---------------------------------------------------------------------------------------------------------------
def _draw_conv(rng, acc: np.ndarray, w: np.ndarray, zo: int, lo: int, sigma: float) -> Conv:
    """Stage-1 parameters that spread this conv's outputs: per channel, the bias centres the accumulator (measured
    on a sample, ``acc`` [.., K]) and the real multiplier m scales its spread to ``sigma`` output steps
    (measure.random_problem's rule, with the measured spread in place of the formula); m becomes M (31 bits) and S
    as compiler/fixed_point.py's ``quantize_multipliers`` makes them (S = 31 - exponent of m)."""
    a = acc.reshape(-1, acc.shape[-1]).astype(np.float64)
    mean, std = a.mean(axis=0), np.maximum(a.std(axis=0), 1.0)
    K = acc.shape[-1]
    b = (-np.round(mean) + rng.integers(-1, 2, K) * np.round(0.25 * std)).astype(np.int32)
    m = sigma / std * rng.uniform(0.5, 1.5, K)
    S = np.minimum(31 - np.frexp(m)[1], 62).astype(np.int32)
    M = np.clip(np.round(m * 2.0 ** S.astype(np.float64)), 1, (1 << 31) - 1).astype(np.int32)
    return Conv(w=w, b=b, M=M, S=S, zo=int(zo), lo=int(lo))


def _stage(conv: Conv, spec, x) -> np.ndarray:
    """Stage-1 output (int64) of one conv (no residual) at batch x.shape[0]."""
    return measure.requant(measure.conv_acc_nhwc(x, conv.w, spec), conv.b, conv.M, conv.S, spec)


def draw_block(rng: np.random.Generator) -> Block:
    """Random weights and requantize parameters, stage by stage on one random sample image (so every stage's
    outputs spread over their int8 range, about half of the ReLU stages' at their zero point)."""
    sample = rng.integers(-128, 128, (1, IMG, IMG, C_IN))
    w1 = rng.integers(-128, 128, (C_MID, 1, 1, C_IN))
    w2 = rng.integers(-128, 128, (C_MID, 3, 3, C_MID))
    w3 = rng.integers(-128, 128, (C_IN, 1, 1, C_MID))
    zo1, zo2 = (int(v) for v in rng.integers(-100, -19, 2))
    zo3, zo_out = int(rng.integers(-20, 21)), int(rng.integers(-80, -19))
    blk = Block(conv1=None, conv2=None, conv3=None, rq2=None, zo_out=zo_out)
    s1 = measure.Spec(dict(N=1, H=IMG, W=IMG, C=C_IN, K=C_MID, R=1, S=1))
    blk.conv1 = _draw_conv(rng, measure.conv_acc_nhwc(sample, w1, s1), w1, zo1, zo1, (127 - zo1) / 2.5)
    y1 = _stage(blk.conv1, blk.spec(1, 1), sample)
    s2 = measure.Spec(dict(N=1, H=IMG, W=IMG, C=C_MID, K=C_MID, R=3, S=3, padding=1, pad_value=zo1))
    blk.conv2 = _draw_conv(rng, measure.conv_acc_nhwc(y1, w2, s2), w2, zo2, zo2, (127 - zo2) / 2.5)
    y2 = _stage(blk.conv2, blk.spec(2, 1), y1)
    s3 = measure.Spec(dict(N=1, H=IMG, W=IMG, C=C_MID, K=C_IN, R=1, S=1))
    blk.conv3 = _draw_conv(rng, measure.conv_acc_nhwc(y2, w3, s3), w3, zo3, -128, 50.0)
    span = (127 - zo_out) / 300.0  # (y3 + x) spreads about 90 steps: its positive half reaches 127, a few clip
    SR = int(rng.integers(12, 21))  # (measure.random_problem's range for res_i32)
    R1, R2 = (int(np.round(span * rng.uniform(0.6, 1.4) * 2.0 ** SR)) for _ in range(2))
    one = [int(rng.integers(-3, 4)), R1, int(rng.integers(-3, 4)), R2, SR]
    blk.rq2 = np.repeat(np.array(one, np.int32)[:, None], C_IN, axis=1)
    kernel_rq2(blk)
    return blk


def kernel_rq2(blk: Block) -> tuple:
    """(c1, R1, c2, R2, SR): the residual stage's parameters as the kernels take them (arguments), after checking
    the conditions under which their 32-bit epilogues equal the int64 reference: every S in 33..62 (stage 1 from the
    product's high word), rq2 the same for every channel, every intermediate of the residual stage within int32
    (over all int8 y3 and residual values). A ValueError names the first condition that fails."""
    for i, c in enumerate((blk.conv1, blk.conv2, blk.conv3), 1):
        if c.S.min() < 33 or c.S.max() > 62:
            raise ValueError(f"conv{i}: shifts S in [{c.S.min()}, {c.S.max()}]; the kernels need 33 <= S <= 62")
    rq2 = np.asarray(blk.rq2, np.int64)
    if not (rq2 == rq2[:, :1]).all():
        raise ValueError("rq2: the kernels take one (c1, R1, c2, R2, SR) for all channels; it differs by channel")
    c1, r1, c2, r2, sr = (int(v) for v in rq2[:, 0])
    if not 1 <= sr <= 31:
        raise ValueError(f"rq2: SR {sr} outside 1..31")
    ends = [(y + c1) * r1 + (r + c2) * r2 + (1 << (sr - 1)) for y in (-128, 127) for r in (-128, 127)]
    if max(abs(v) for v in ends) >= 1 << 31 or max(abs(r1), abs(r2)) >= 1 << 31:
        raise ValueError(f"rq2 {c1, r1, c2, r2, sr}: the residual stage leaves int32 (the kernels compute it in int32)")
    return c1, r1, c2, r2, sr


def draw_input(rng: np.random.Generator, n: int) -> np.ndarray:
    """Block input x [n, 56, 56, 256] int8, uniform over the int8 range."""
    return rng.integers(-128, 128, (n, IMG, IMG, C_IN), dtype=np.int8)


# ---------------------------------------------------------------------------------------------------------------
# the reference
# ---------------------------------------------------------------------------------------------------------------
def reference(blk: Block, x: np.ndarray, threads: int | None = None) -> dict:
    """{'y1', 'y2', 'out'}: the block's intermediates and output as int8 NHWC (measure.reference_storage: chunks of
    the batch over threads)."""
    n = x.shape[0]
    c1, c2, c3 = blk.conv1, blk.conv2, blk.conv3
    y1 = measure.reference_storage(blk.spec(1, n), x, c1.w, c1.b, c1.M, c1.S, threads=threads)
    y2 = measure.reference_storage(blk.spec(2, n), y1, c2.w, c2.b, c2.M, c2.S, threads=threads)
    out = measure.reference_storage(blk.spec(3, n), y2, c3.w, c3.b, c3.M, c3.S, res_log=(x, blk.rq2),
                                    threads=threads)
    return dict(y1=y1, y2=y2, out=out)


def _rq_py(acc: int, b: int, M: int, S: int, zo: int, lo: int) -> int:
    t = ((acc + b + (1 << 31)) % (1 << 32)) - (1 << 31)
    return min(127, max(lo, ((t * M + (1 << (S - 1))) >> S) + zo))


def naive_pixel(blk: Block, x: np.ndarray, n: int, h: int, w: int) -> dict:
    """The block at one output pixel from its definition: Python-integer requantize, exact int64 dot products,
    conv2's 3x3 window of conv1 outputs with zo1 outside the image. Returns {'y1', 'y2', 'out'} at that pixel."""
    c1, c2, c3 = blk.conv1, blk.conv2, blk.conv3
    win = np.empty((3, 3, C_MID), np.int64)
    for dh in range(3):
        for dw in range(3):
            hh, ww = h + dh - 1, w + dw - 1
            if not (0 <= hh < IMG and 0 <= ww < IMG):
                win[dh, dw] = c1.zo
                continue
            xv = x[n, hh, ww].astype(np.int64)
            win[dh, dw] = [_rq_py(int(np.dot(xv, c1.w[k, 0, 0].astype(np.int64))), int(c1.b[k]), int(c1.M[k]),
                                  int(c1.S[k]), c1.zo, c1.lo) for k in range(C_MID)]
    y2 = np.array([_rq_py(int(np.sum(win * c2.w[k].astype(np.int64))), int(c2.b[k]), int(c2.M[k]), int(c2.S[k]),
                          c2.zo, c2.lo) for k in range(C_MID)], np.int64)
    out = []
    for k in range(C_IN):
        y3 = _rq_py(int(np.dot(y2, c3.w[k, 0, 0].astype(np.int64))), int(c3.b[k]), int(c3.M[k]), int(c3.S[k]),
                    c3.zo, c3.lo)
        cc1, r1, cc2, r2, sr = (int(v) for v in blk.rq2[:, k])
        v = (y3 + cc1) * r1 + (int(x[n, h, w, k]) + cc2) * r2 + (1 << (sr - 1))
        out.append(min(127, max(blk.zo_out, (v >> sr) + blk.zo_out)))
    return dict(y1=win[1, 1], y2=y2, out=np.array(out, np.int64))


def check_pixels(blk: Block, x: np.ndarray, ref: dict, rng: np.random.Generator, extra: int = 6) -> int:
    """Compare ``ref`` with ``naive_pixel`` at the image corners and edges, pixels on the kernels' tile seams and
    ``extra`` random pixels of every image; returns the number of differing values (0 expected)."""
    fixed = [(0, 0), (0, 55), (55, 0), (55, 55), (0, 27), (27, 0), (55, 30), (30, 55), (13, 7), (14, 8), (27, 15),
             (28, 16), (41, 47), (42, 48)]
    bad = 0
    for n in range(x.shape[0]):
        pts = fixed + [tuple(int(v) for v in rng.integers(0, IMG, 2)) for _ in range(extra)]
        for h, w in pts:
            nv = naive_pixel(blk, x, n, h, w)
            for name in ("y1", "y2", "out"):
                bad += int(np.count_nonzero(nv[name] != ref[name][n, h, w].astype(np.int64)))
    return bad


def spread(a: np.ndarray) -> dict:
    """How varied an int8 tensor is: distinct values, its range, the share at its minimum and at 127."""
    h = np.bincount(np.asarray(a, np.int8).reshape(-1).view(np.uint8), minlength=256)
    h = np.concatenate([h[128:], h[:128]])  # index i: value i - 128
    nz = np.flatnonzero(h)
    total = max(1, int(h.sum()))
    return dict(distinct=int(nz.size), min=int(nz[0]) - 128, max=int(nz[-1]) - 128,
                at_min=round(float(h[nz[0]]) / total, 3), at_127=round(float(h[255]) / total, 3))
