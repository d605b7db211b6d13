"""An independent NumPy reference of one quantized conv layer (and the max pool) as qcompile's GPU kernels compute it.

Written from the definition in docs/SCHEDULES.md ("Interface and the exact math"), not from the compiler: it shares
no helper or constant with ``qcompile`` (``schedules/reference.py`` included) and needs NumPy alone, so it also runs
on a GPU host that has only the TVM runtime. Values are logical integers (4-bit tensors unpacked); layouts are the
kernels' own (NHWC: x [N, H, W, C], w OHWI [K, R, S, C], out / res [N, P, Q, K]; HWNC: x [H, W, N, C], w HWOI
[R, S, K, C], out / res [P, Q, N, K]).

    acc = sum x * w                                             int32 (asserted to fit)
    t   = acc + bias[k]                                         int32, wrapping (modelled explicitly; the kernels
                                                                wrap on the shift_ge33 path and add in int64
                                                                elsewhere: the cases keep t within int32 there)
    y1  = clip(((int64(t) * M[k] + (1 << (S[k] - 1))) >> S[k]) + zo, lo, hi)
    out = y1, or with a residual (rq2 rows c1, M1, c2, M2, S2):
    out = clip((((y1 + c1) * M1 + (res + c2) * M2 + (1 << (S2 - 1))) >> S2) + zo2, lo2, hi2)

``spec`` is any object (or mapping) with ConvSpec's field names: N H W C K R S stride padding dilation layout
x_dtype w_bits out_dtype has_residual zo lo hi pad_value res_dtype zo2 lo2 hi2 res_i32 shift_ge33 rq2_uniform.
"""
from __future__ import annotations

import types

import numpy as np

I32_MIN, I32_MAX = -(1 << 31), (1 << 31) - 1
I64_MIN, I64_MAX = -(1 << 63), (1 << 63) - 1
RANGES = {"int8": (-128, 127), "uint8": (0, 255), "int4": (-8, 7), "uint4": (0, 15), "int32": (I32_MIN, I32_MAX)}


def as_spec(spec):
    """A mapping of ConvSpec fields as an attribute object (an object passes through)."""
    return types.SimpleNamespace(**spec) if isinstance(spec, dict) else spec


def _pair(v):
    return (int(v), int(v)) if isinstance(v, (int, np.integer)) else tuple(int(a) for a in v)


def pads(spec):
    """(top, left, bottom, right) from an int, a (vertical, horizontal) pair or a 4-tuple."""
    p = spec.padding
    if isinstance(p, (int, np.integer)):
        return (int(p),) * 4
    p = tuple(int(a) for a in p)
    return (p[0], p[1], p[0], p[1]) if len(p) == 2 else p


def out_size(spec):
    """(P, Q) of the conv."""
    pt, pl, pb, pr = pads(spec)
    (sh, sw), (dh, dw) = _pair(spec.stride), _pair(spec.dilation)
    return ((spec.H + pt + pb - dh * (spec.R - 1) - 1) // sh + 1, (spec.W + pl + pr - dw * (spec.S - 1) - 1) // sw + 1)


def _check_range(name, a, dtype):
    lo, hi = RANGES[dtype]
    a = np.asarray(a)
    assert a.size == 0 or (a.min() >= lo and a.max() <= hi), f"{name}: values outside {dtype} [{lo}, {hi}]"


def _fits_i32(name, a):
    a = np.asarray(a)
    assert a.size == 0 or (a.min() >= I32_MIN and a.max() <= I32_MAX), f"{name} does not fit int32"


def wrap_i32(a):
    """Two's-complement int32 wrap of int64 values (what an int32 addition does on the device)."""
    a = np.asarray(a, np.int64)
    return ((a - I32_MIN) & 0xFFFFFFFF) + I32_MIN


def conv_acc(spec, x, w):
    """int64 sums of the conv over logical x / w in the spec's layout -> [N, P, Q, K] (NHWC order). Every position
    outside the image reads ``pad_value``; each sum is asserted to fit int32 (the kernels' accumulator)."""
    spec = as_spec(spec)
    x, w = np.asarray(x, np.int64), np.asarray(w, np.int64)
    if spec.layout == "HWNC":
        x, w = x.transpose(2, 0, 1, 3), w.transpose(2, 0, 1, 3)  # -> NHWC, OHWI
    N, H, W, C = x.shape
    assert (N, H, W, C) == (spec.N, spec.H, spec.W, spec.C), f"x has shape {x.shape}"
    assert w.shape == (spec.K, spec.R, spec.S, C), f"w has shape {w.shape}"
    _check_range("x", x, spec.x_dtype)
    _check_range("w", w, "int4" if spec.w_bits == 4 else "int8")
    pt, pl, pb, pr = pads(spec)
    (sh, sw), (dh, dw) = _pair(spec.stride), _pair(spec.dilation)
    P, Q = out_size(spec)
    xp = np.full((N, H + pt + pb, W + pl + pr, C), int(spec.pad_value), np.int64)
    xp[:, pt:pt + H, pl:pl + W] = x
    acc = np.zeros((N, P, Q, spec.K), np.int64)
    for r in range(spec.R):
        for s in range(spec.S):
            win = xp[:, r * dh:r * dh + sh * (P - 1) + 1:sh, s * dw:s * dw + sw * (Q - 1) + 1:sw]
            acc += np.einsum("npqc,kc->npqk", win, w[:, r, s])
    _fits_i32("the accumulator (sum x*w)", acc)
    return acc


def epilogue(spec, acc, bias, M, S, res=None, rq2=None):
    """Stage 1 (and the residual stage 2) on int64 sums ``acc`` [..., K]; returns the logical output (int64)."""
    spec = as_spec(spec)
    bias, M, S = (np.asarray(a, np.int64) for a in (bias, M, S))
    for name, a in (("bias", bias), ("M", M), ("S", S)):
        _fits_i32(name, a)
    assert S.min() >= 1 and S.max() <= 62, "S must be in [1, 62] (a shift of the int64 product)"
    if spec.shift_ge33:
        assert S.min() >= 33, "shift_ge33 promises every S >= 33"
    t = wrap_i32(np.asarray(acc, np.int64) + bias)  # int32 addition: wraps by definition
    prod = t * M  # |t|, |M| <= 2^31: |prod| <= 2^62, plus the rounding term < 2^62: fits int64
    y1 = np.clip(((prod + (np.int64(1) << (S - 1))) >> S) + spec.zo, spec.lo, spec.hi)
    if spec.out_dtype == "int32" and not spec.has_residual:
        return np.clip(y1, I32_MIN, I32_MAX)
    if not spec.has_residual:
        return y1
    assert res is not None and rq2 is not None, "has_residual: res and rq2 are needed"
    rq2 = np.asarray(rq2, np.int64)
    assert rq2.shape == (5, spec.K), f"rq2 has shape {rq2.shape}, not (5, {spec.K})"
    _fits_i32("rq2", rq2)
    if spec.rq2_uniform:  # the kernel compiles these in and ignores the buffer: it must hold the same
        assert (rq2 == np.asarray(spec.rq2_uniform, np.int64)[:, None]).all(), "rq2 differs from rq2_uniform"
    c1, M1, c2, M2, S2 = rq2
    assert S2.min() >= 1 and S2.max() <= 62, "S2 must be in [1, 62]"
    res = np.asarray(res, np.int64)
    _check_range("res", res, spec.res_dtype)
    a, b = (y1 + c1) * M1, (res + c2) * M2
    v = a + b + (np.int64(1) << (S2 - 1))
    if spec.res_i32:  # the kernels run stage 2 in int32: the spec promises every intermediate fits
        for name, u in (("(y1 + c1) * M1", a), ("(res + c2) * M2", b), ("their sum", a + b), ("the rounded sum", v)):
            _fits_i32(f"res_i32 stage 2: {name}", u)
    return np.clip((v >> S2) + spec.zo2, spec.lo2, spec.hi2)


def conv_layer(spec, x, w, bias, M, S, res=None, rq2=None):
    """The whole layer on logical values in the spec's layout; the output in the spec's layout, in ``out_dtype``'s
    range (asserted)."""
    spec = as_spec(spec)
    acc = conv_acc(spec, x, w)
    r = None
    if res is not None:
        r = np.asarray(res, np.int64)
        r = r.transpose(2, 0, 1, 3) if spec.layout == "HWNC" else r
    y = epilogue(spec, acc, bias, M, S, r, rq2)
    _check_range("out", y, spec.out_dtype)
    return y.transpose(1, 2, 0, 3) if spec.layout == "HWNC" else y


def max_pool(x, dtype, pool=(3, 3), strides=(2, 2), padding=(1, 1, 1, 1)):
    """Max over the window positions inside x [N, H, W, C] (logical values of ``dtype``); the type's minimum where a
    window holds none."""
    x = np.asarray(x, np.int64)
    _check_range("x", x, dtype)
    N, H, W, C = x.shape
    (R, S), (sh, sw), (pt, pl, pb, pr) = pool, strides, padding
    P, Q = (H + pt + pb - R) // sh + 1, (W + pl + pr - S) // sw + 1
    out = np.full((N, P, Q, C), RANGES[dtype][0], np.int64)
    for p in range(P):
        for q in range(Q):
            for r in range(R):
                for s in range(S):
                    i, j = p * sh - pt + r, q * sw - pl + s
                    if 0 <= i < H and 0 <= j < W:
                        out[:, p, q] = np.maximum(out[:, p, q], x[:, i, j])
    return out
