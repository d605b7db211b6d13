"""Generic fallback: the conv + epilogue as a TE compute, scheduled as a plain TIR loop nest.

Also the unscheduled reference compute: built for llvm it checks the integer math on the CPU."""
from __future__ import annotations

from tvm import te, tirx

from .spec import ConvSpec


def _nib(byte_i32, idx, signed):
    v = tirx.bitwise_and(tirx.shift_right(byte_i32, (idx % 2) * 4), 15)
    return tirx.if_then_else(v >= 8, v - 16, v) if signed else v


def epilogue_value(spec: ConvSpec, acc, k, bias, Mq, Sq, rv=None, rq2=None):
    """The output value (int32 PrimExpr) of int32 accumulator ``acc`` in channel ``k`` (ConvSpec's math):
    requantize, clip and, with ``rv`` (the residual's value), the second residual-add stage."""
    i64 = lambda v: tirx.const(v, "int64")
    lo, hi = spec.lo, spec.hi
    if spec.out_bits == 32 and not spec.has_residual:
        lo, hi = max(lo, -(1 << 31)), min(hi, (1 << 31) - 1)
    t = acc + bias[k]
    if spec.shift_ge33:  # exact int32 form for S >= 33 (see ConvSpec)
        hi32 = tirx.shift_right(t.astype("int64") * Mq[k].astype("int64"), i64(32)).astype("int32")
        i32 = lambda x: tirx.const(x, "int32")
        # shift amounts clamped to their valid range [1, 30] (a no-op for 33 <= S <= 62): with unbounded
        # shifts TVM's integer-bound analysis narrows the result and drops the clip below
        sh = tirx.max(tirx.min(Sq[k] - 32, i32(30)), i32(1))
        v = tirx.shift_right(hi32 + tirx.shift_left(i32(1), sh - 1), sh) + i32(spec.zo)
        v = tirx.max(tirx.min(v, i32(hi)), i32(lo))
        if rv is None:
            return v
        y1 = v.astype("int64")
    else:
        v = t.astype("int64") * Mq[k].astype("int64")
        s64 = Sq[k].astype("int64")
        v = tirx.shift_right(v + tirx.shift_left(i64(1), s64 - 1), s64) + i64(spec.zo)
        if rv is None:
            return tirx.max(tirx.min(v, i64(hi)), i64(lo)).astype("int32")
        y1 = tirx.max(tirx.min(v, i64(hi)), i64(lo))
    wd = "int32" if spec.res_i32 else "int64"  # int32: the graph's residual requantize cannot overflow it
    c = lambda x: tirx.const(x, wd) if isinstance(x, int) else x.astype(wd)
    p = [tirx.const(int(u), wd) for u in spec.rq2_uniform] if spec.rq2_uniform else [rq2[j, k].astype(wd) for j in range(5)]
    v = (c(y1) + p[0]) * p[1] + (c(rv) + p[2]) * p[3]
    v = tirx.shift_right(v + tirx.shift_left(c(1), p[4] - c(1)), p[4]) + c(spec.zo2)
    return tirx.max(tirx.min(v, c(spec.hi2)), c(spec.lo2)).astype("int32")


def residual_value(spec: ConvSpec, res, idx, k):
    """int32 value of the residual input at (idx..., channel k), or None without one."""
    if res is None:
        return None
    if spec.res_bits == 4:
        return _nib(res[(*idx, k // 2)].astype("int32"), k, spec.res_signed)
    return res[(*idx, k)].astype("int32")


def output_compute(spec: ConvSpec, y, os_):
    """The output tensor from int32 values y: cast, or two 4-bit values packed per byte (low nibble first)."""
    o_st = ConvSpec.storage(spec.out_dtype)
    if spec.out_bits == 4:
        return te.compute(os_, lambda a, b, c, kk: tirx.bitwise_or(
            tirx.bitwise_and(y[a, b, c, 2 * kk], 15),
            tirx.shift_left(tirx.bitwise_and(y[a, b, c, 2 * kk + 1], 15), 4)).astype(o_st), name="out")
    return te.compute(os_, lambda a, b, c, kk: y[a, b, c, kk].astype(o_st), name="out")


def conv_compute(spec: ConvSpec):
    """TE tensors (x, w, bias, M, S, [res], out) implementing the project math in spec's layout."""
    xs, ws, os_ = spec.shapes()
    x_st = ConvSpec.storage(spec.x_dtype)
    x = te.placeholder(xs, x_st, name="x")
    w = te.placeholder(ws, "int8", name="w")
    K = spec.K
    bias = te.placeholder((K,), "int32", name="bias")
    Mq = te.placeholder((K,), "int32", name="M")
    Sq = te.placeholder((K,), "int32", name="S")
    res = te.placeholder(spec.res_shape(), ConvSpec.storage(spec.res_dtype), name="res") if spec.has_residual else None
    rq2 = te.placeholder((5, K), "int32", name="rq2") if spec.has_residual else None
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

    def rq(i0, i1, i2, k):
        rv = residual_value(spec, res, (i0, i1, i2), k)
        return epilogue_value(spec, acc[i0, i1, i2, k], k, bias, Mq, Sq, rv, rq2)

    y = te.compute(acc.shape, rq, name="y")
    out = output_compute(spec, y, os_)
    args = [x, w, bias, Mq, Sq] + ([res, rq2] if res is not None else []) + [out]
    return args


def make_fallback(spec: ConvSpec, target_kind: str = "cuda", threads: int = 128):
    """Correct for every spec: one thread per output byte, conv reduction inlined into the epilogue (``plan_only``:
    a placeholder)."""
    from .planned import placeholder_kernel, planning_only

    if planning_only():
        return placeholder_kernel("fallback")
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
