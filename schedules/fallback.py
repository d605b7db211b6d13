"""Generic fallback: the conv + epilogue as a TE compute, scheduled as a plain TIR loop nest.

Also the unscheduled reference compute: built for llvm it checks the integer math on the CPU."""
from __future__ import annotations

import tvm
from tvm import te, tirx

from .spec import ConvSpec


def _nib(byte_i32, idx, signed):
    v = tirx.bitwise_and(tirx.shift_right(byte_i32, (idx % 2) * 4), 15)
    return tirx.if_then_else(v >= 8, v - 16, v) if signed else v


def conv_compute(spec: ConvSpec):
    """TE tensors (x, w, bias, M, S, [res], out) implementing the project math in spec's layout."""
    xs, ws, os_ = spec.shapes()
    x_st, o_st = ConvSpec.storage(spec.x_dtype), ConvSpec.storage(spec.out_dtype)
    x = te.placeholder(xs, x_st, name="x")
    w = te.placeholder(ws, "int8", name="w")
    K = spec.K
    bias = te.placeholder((K,), "int32", name="bias")
    Mq = te.placeholder((K,), "int32", name="M")
    Sq = te.placeholder((K,), "int32", name="S")
    res = te.placeholder(os_, ConvSpec.storage(spec.res_dtype), name="res") if spec.has_residual else None
    sh, sw = spec.strides
    dh, dw = spec.dilations
    pt, pl, _, _ = spec.pads
    H, W = spec.H, spec.W
    hwnc = spec.layout == "HWNC"

    def xval(n, h, w_, c):
        if spec.x_bits == 4:
            idx = (h, w_, n, c // 2) if hwnc else (n, h, w_, c // 2)
            return _nib(x[idx].astype("int32"), c, spec.x_signed)
        idx = (h, w_, n, c) if hwnc else (n, h, w_, c)
        return x[idx].astype("int32")

    def wval(k, r, s, c):
        if spec.w_bits == 4:
            idx = (r, s, k, c // 2) if hwnc else (k, r, s, c // 2)
            return _nib(w[idx].astype("int32"), c, True)
        idx = (r, s, k, c) if hwnc else (k, r, s, c)
        return w[idx].astype("int32")

    rc = te.reduce_axis((0, spec.C), "rc")
    rr = te.reduce_axis((0, spec.R), "rr")
    rs = te.reduce_axis((0, spec.S), "rs")

    def acc_f(n, p, q, k):
        ih = p * sh - pt + rr * dh
        iw = q * sw - pl + rs * dw
        inside = tirx.all(ih >= 0, ih < H, iw >= 0, iw < W)
        xv = tirx.if_then_else(inside, xval(n, tirx.max(tirx.min(ih, H - 1), 0), tirx.max(tirx.min(iw, W - 1), 0), rc),
                               tirx.const(spec.pad_value, "int32"))
        return te.sum(xv * wval(k, rr, rs, rc), axis=[rr, rs, rc])

    N, P, Q = spec.N, spec.P, spec.Q
    if hwnc:
        acc = te.compute((P, Q, N, K), lambda p, q, n, k: acc_f(n, p, q, k), name="acc")
    else:
        acc = te.compute((N, P, Q, K), acc_f, name="acc")
    lo, hi = spec.lo, spec.hi
    if spec.out_bits == 32:
        lo, hi = max(lo, -(1 << 31)), min(hi, (1 << 31) - 1)

    def rq(i0, i1, i2, k):
        t = acc[i0, i1, i2, k] + bias[k]
        v = t.astype("int64") * Mq[k].astype("int64")
        if res is not None:
            if spec.out_bits == 4:
                rv = _nib(res[i0, i1, i2, k // 2].astype("int32"), k, spec.out_signed)
            else:
                rv = res[i0, i1, i2, k].astype("int32")
            v = v + (rv - spec.zr).astype("int64") * tirx.const(spec.Mr, "int64")
        s64 = Sq[k].astype("int64")
        v = tirx.shift_right(v + tirx.shift_left(tirx.const(1, "int64"), s64 - 1), s64)
        v = v + tirx.const(spec.zo, "int64")
        return tirx.max(tirx.min(v, tirx.const(hi, "int64")), tirx.const(lo, "int64")).astype("int32")

    oshape = acc.shape
    y = te.compute(oshape, rq, name="y")
    if spec.out_bits == 4:
        out = te.compute(os_, lambda a, b, c, kk: tirx.bitwise_or(
            tirx.bitwise_and(y[a, b, c, 2 * kk], 15),
            tirx.shift_left(tirx.bitwise_and(y[a, b, c, 2 * kk + 1], 15), 4)).astype(o_st), name="out")
    else:
        out = te.compute(os_, lambda a, b, c, kk: y[a, b, c, kk].astype(o_st), name="out")
    args = [x, w, bias, Mq, Sq] + ([res] if res is not None else []) + [out]
    return args


def make_fallback(spec: ConvSpec, target_kind: str = "cuda", threads: int = 128):
    """Correct for every spec: one thread per output byte, conv reduction inlined into the epilogue."""
    args = conv_compute(spec)
    func = te.create_prim_func(args)
    if target_kind != "cuda":
        return func.with_attr("qcompile.strategy", "fallback")
    from tvm import s_tir

    sch = s_tir.Schedule(func)
    # keep acc and y as per-output computations: inline y into out, acc computed at out
    y = sch.get_sblock("y")
    out = sch.get_sblock("out")
    acc = sch.get_sblock("acc")
    sch.compute_inline(y)
    loops = sch.get_loops(out)
    fused = sch.fuse(*loops)
    bx, tx = sch.split(fused, [None, threads])
    sch.bind(bx, "blockIdx.x")
    sch.bind(tx, "threadIdx.x")
    sch.compute_at(acc, tx)
    sch.set_scope(acc, 0, "local")
    return sch.mod["main"].with_attr("qcompile.strategy", "fallback")
