"""Depthwise conv2d (groups == C == K) on CUDA cores, NHWC, ``depthwise``.

    acc[n, p, q, c] = sum over (r, s) of x[n, p*sh - pt + r*dh, q*sw - pl + s*dw, c] * w[c, r, s]
                      (``pad_value`` where the position is outside the image)
    out[n, p, q, c] = fallback.epilogue_value(acc): requantize, clip, and the residual stage where the spec has one

The tensor-core kernels have nothing to reduce here (one input channel per output channel), so this runs on the
integer ALUs. Steps of one thread:

1. It owns ``vec`` consecutive channels (``vec`` bytes of a pixel) of ``qt`` consecutive output columns of one
   output row; neighbouring threads own neighbouring channel vectors, so a warp reads whole 128-byte lines.
2. Per kernel row r it loads the input row segment its ``qt`` outputs read once -- ``(qt - 1) * sw + (S - 1) * dw + 1``
   pixels, each as one ``vec``-byte vector (the padding value's bytes where the pixel is outside the image) -- and
   the row's weights as ``vec``-byte vectors (weights are stored [R, S, C], channels last).
3. Each product is one ``dp4a`` of an input word (4 channels) with the weight word masked to one byte: x_j * w_j, in
   the input's signedness (``dp4a.u32.s32`` for uint8 inputs); 32-bit accumulators, one per (column, channel).
4. The epilogue (the one definition all kernels share: ``fallback.epilogue_value``) requantizes each accumulator, adds
   the residual stage, and the thread stores its ``vec`` channels per column as one vector (4-bit outputs packed two
   per byte, low nibble first).

4-bit activations are read and written one value per byte (their int8 / uint8 storage); weights are one per byte.

Constraints:
    * NHWC; groups == C == K (one input channel per group, channel multiplier 1); any R x S, stride, dilation, padding.
    * the input in 8-bit storage (int8 / uint8, 4-bit values one per byte); weights signed, one per byte.
    * ``vec`` divides C and is 16, 8, 4 (word loads) or 1 (byte loads, one channel per dp4a word).
    * a 4-bit output is written packed only with ``vec`` >= 4 (``output_packable``); the caller stores it one value
      per byte otherwise.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from tvm.script import tirx as T

from .fallback import epilogue_value, residual_value
from .planned import lut_buffer, lut_value, with_lut_param
from .spec import ConvSpec, arch_info

MIN_BLOCKS_PER_SM = 2  # automatic config: shrink the per-thread tile until the grid has this many blocks per SM


def dp4a_constraints(name: str, spec: ConvSpec) -> str | None:
    """What both CUDA-core dp4a kernels (``depthwise``, ``grouped``) need of any shape: NHWC, 8-bit storage."""
    if spec.layout != "NHWC":
        return f"{name} takes NHWC, not {spec.layout}"
    if ConvSpec.storage(spec.x_dtype) not in ("int8", "uint8") or spec.x_bits != 8:
        return f"{name} reads 8-bit storage (x_dtype {spec.x_dtype}: pass 4-bit values as their storage type)"
    return None


def dp4a_tile_legal(name: str, spec: ConvSpec, qt: int, threads: int, packable: bool, tile: str) -> str | None:
    """The tile rules both dp4a kernels share: columns per thread, threads per block, packed 4-bit operands
    (``packable``: whether a thread holds whole output bytes; ``tile`` names the knob that decides it)."""
    if not 1 <= qt <= 8:
        return f"{name}: qt {qt} must be 1..8"
    if threads % 32 or not 32 <= threads <= 1024:
        return f"{name}: {threads} threads per block (a multiple of 32, at most 1024)"
    if spec.out_bits == 4 and not packable:
        return f"{name}: a packed 4-bit output needs {tile}"
    if spec.has_residual and spec.res_bits == 4 and spec.K % 2:
        return f"{name}: a packed 4-bit residual needs an even channel count"
    return None


def shrink_tile(threads_of, want: int, ch: int, ch_auto: bool, ch_min: int, qt: int, qt_auto: bool) -> tuple:
    """(channels, columns) per thread, halved -- channels first, down to ``ch_min``, then columns -- while
    ``threads_of(ch, qt)`` stays below ``want``; knobs the caller fixed (not ``*_auto``) are kept."""
    while threads_of(ch, qt) < want:
        if ch_auto and ch > ch_min:
            ch //= 2
        elif qt_auto and qt > 1:
            qt //= 2
        else:
            break
    return ch, qt


@dataclass(frozen=True)
class Dp4aOperands:
    """The operand facts both dp4a kernels derive from a spec and the channels per dp4a word (``cpw``)."""
    x_st: str  # input storage dtype
    o_st: str  # output storage dtype
    signed: bool  # int8 input (dp4a.s32.s32), else uint8 (dp4a.u32.s32)
    wt: str  # input words in dp4a's a-type
    padw: int  # the padding value's word (cpw bytes of it), in wt's range

    @property
    def dp4a(self):
        return T.ptx.dp4a.s32.s32 if self.signed else T.ptx.dp4a.u32.s32


def dp4a_operands(spec: ConvSpec, cpw: int) -> Dp4aOperands:
    x_st = ConvSpec.storage(spec.x_dtype)
    signed = x_st == "int8"
    padb = spec.pad_value & 0xFF
    padw = padb * 0x01010101 if cpw == 4 else padb
    padw = padw - (1 << 32) if signed and padw >= 1 << 31 else padw
    return Dp4aOperands(x_st, ConvSpec.storage(spec.out_dtype), signed, "int32" if signed else "uint32", padw)


def epilogue_fns(spec: ConvSpec, o_st: str):
    """``(y_of, packed, lut)`` of both dp4a kernels: the shared epilogue of one accumulator (``fallback.epilogue_value``
    with the residual stage), a column's output element e -- a value, its entry in the output lookup table
    (``spec.lut``), or two 4-bit values packed low nibble first -- and the table's buffer (None without one; the kernel
    takes it as a parameter before out: ``planned.with_lut_param``)."""
    has_res = spec.has_residual
    lut = lut_buffer(spec)

    def y_of(acc, n, p, q, k, bias, Mq, Sq, res, rq2):
        rv = residual_value(spec, res, (n, p, q), k) if has_res else None
        return epilogue_value(spec, acc, k, bias, Mq, Sq, rv, rq2 if has_res else None)

    def packed(yv, e):
        if spec.out_bits == 4:
            return T.Cast(o_st, T.bitwise_or(T.bitwise_and(yv[2 * e], 15), T.shift_left(T.bitwise_and(yv[2 * e + 1], 15), 4)))
        if lut is not None:
            return lut_value(spec, lut, yv[e])
        return T.Cast(o_st, yv[e])
    return y_of, packed, lut


@dataclass(frozen=True)
class DwConfig:
    vec: int = 0  # channels (bytes) per thread: 16, 8, 4 or 1; 0 = automatic
    qt: int = 0  # output columns per thread: 1 to 8; 0 = automatic
    threads: int = 256  # threads per block


def depthwise_constraints(spec: ConvSpec, groups: int) -> str | None:
    """Why the depthwise kernel cannot take ``spec`` with ``groups`` (None: it can, with some config)."""
    if not (groups == spec.C == spec.K):
        return f"depthwise needs groups == C == K (groups {groups}, C {spec.C}, K {spec.K})"
    return dp4a_constraints("depthwise", spec)


def depthwise_legal(spec: ConvSpec, groups: int, cfg: DwConfig) -> str | None:
    """THE legality of the depthwise kernel at a resolved config (None: ``make_depthwise`` builds it)."""
    why = depthwise_constraints(spec, groups)
    if why:
        return why
    if cfg.vec not in (1, 4, 8, 16) or spec.C % cfg.vec:
        return f"depthwise: vec {cfg.vec} must be 16, 8, 4 or 1 and divide C = {spec.C}"
    return dp4a_tile_legal("depthwise", spec, cfg.qt, cfg.threads, output_packable(spec, cfg), "vec >= 4")


def depthwise_point(spec: ConvSpec, groups: int, cfg: DwConfig, arch: str = "sm_90",
                    sms: int | None = None) -> tuple[DwConfig, str | None]:
    """(the resolved config, why the kernel cannot take it or None) of a point whose fields may be automatic (0):
    ``resolve_config`` then ``depthwise_legal``. ``make_depthwise`` and the tuning space
    (``schedules.space.SPACES["depthwise"]``, with ``groups = spec.groups``) both decide with this one function."""
    if not isinstance(cfg, DwConfig):
        return cfg, f"depthwise takes DwConfig, not {type(cfg).__name__}"
    why = depthwise_constraints(spec, groups)
    if why:
        return cfg, why
    res = resolve_config(spec, cfg, sms, arch)
    return res, depthwise_legal(spec, groups, res)


def output_packable(spec: ConvSpec, cfg: DwConfig) -> bool:
    """Whether each thread holds whole bytes of a packed 4-bit output (an even channel vector)."""
    return cfg.vec >= 4


def _threads(spec: ConvSpec, vec: int, qt: int) -> int:
    return spec.N * spec.P * -(-spec.Q // qt) * (spec.C // vec)


def resolve_config(spec: ConvSpec, cfg: DwConfig = DwConfig(), sms: int | None = None, arch: str = "sm_90") -> DwConfig:
    """``cfg`` with its automatic fields decided: 8-channel vectors where C allows (else 4, else 1) and 4 columns per
    thread, halved (channels first, then columns) while the grid would have fewer than ``MIN_BLOCKS_PER_SM`` blocks
    per SM (batch 1's small layers)."""
    want = MIN_BLOCKS_PER_SM * (sms or arch_info(arch).sms) * cfg.threads
    vec, qt = shrink_tile(lambda v, q: _threads(spec, v, q), want,
                          cfg.vec or next(v for v in (8, 4, 1) if spec.C % v == 0), not cfg.vec, 4,
                          cfg.qt or min(4, spec.Q), not cfg.qt)
    return DwConfig(vec=vec, qt=qt, threads=cfg.threads)


def depthwise_weights(w: np.ndarray) -> np.ndarray:
    """The kernel's weight buffer [R, S, C] int8 from the layer's logical OHWI weights [C, R, S, 1]."""
    w = np.asarray(w)
    assert w.ndim == 4 and w.shape[3] == 1, f"depthwise weights are [C, R, S, 1], not {w.shape}"
    return np.ascontiguousarray(np.transpose(w[..., 0], (1, 2, 0))).astype(np.int8)


def make_depthwise(spec: ConvSpec, groups: int, cfg: DwConfig | None = None, arch: str = "sm_90",
                   sms: int | None = None):
    """PrimFunc ``(x [N, H, W, C], w [R, S, C] int8, bias, M, S [C] int32, [res, rq2 [5, C]], out [N, P, Q, C or
    C / 2])`` of the depthwise conv ``spec`` (C == K == groups); ValueError where ``depthwise_point`` says no."""
    cfg, why = depthwise_point(spec, groups, cfg or DwConfig(), arch, sms)
    if why:
        raise ValueError(why)
    from .planned import placeholder_kernel, planning_only

    if planning_only():
        return placeholder_kernel("depthwise")
    N, H, W, C, R, S = spec.N, spec.H, spec.W, spec.C, spec.R, spec.S
    P, Q = spec.P, spec.Q
    (sh, sw), (dh, dw), (pt, pl, _, _) = spec.strides, spec.dilations, spec.pads
    VC, QT, TH = cfg.vec, cfg.qt, cfg.threads
    CPW = 4 if VC >= 4 else 1  # channels per dp4a word
    VW = VC // CPW  # words per channel vector
    CV = C // VC  # channel vectors per pixel
    QB = -(-Q // QT)
    SEG = (QT - 1) * sw + (S - 1) * dw + 1  # input pixels of one kernel row that a thread's columns read
    total = N * P * QB * CV
    ops = dp4a_operands(spec, CPW)
    x_st, o_st, wt, dp4a, padw = ops.x_st, ops.o_st, ops.wt, ops.dp4a, ops.padw
    OB = spec.out_bits
    OE = VC // 2 if OB == 4 else VC  # output elements (of the storage type) per column and thread
    OCH = min(OE, 16 // np.dtype(o_st).itemsize)  # elements per vector store (at most 16 bytes)
    xs, os_ = (N, H, W, C), (N, P, Q, C // 2 if OB == 4 else C)
    has_res = spec.has_residual
    res_shape = spec.res_shape() if has_res else (1,)
    res_st = ConvSpec.storage(spec.res_dtype) if has_res else "int8"
    y_of, packed, lut = epilogue_fns(spec, o_st)

    def x_word(x, xw, n, ih, iw, cv, v):
        if CPW == 4:
            return xw[((n * H + ih) * W + iw) * (C // 4) + cv * VW + v]
        return T.Cast(wt, T.Cast("uint8", x[n, ih, iw, cv]))

    def w_word(w, ww, r, s, cv, v):
        if CPW == 4:
            return ww[(r * S + s) * (C // 4) + cv * VW + v]
        return T.Cast("uint32", T.Cast("uint8", w[r, s, cv]))

    def w_byte(word, j):  # dp4a's b operand: byte j of a weight word alone (the word itself for one channel a word)
        if CPW == 4:
            word = T.bitwise_and(word, T.shift_left(T.uint32(0xFF), T.Cast("uint32", j * 8)))
        return T.reinterpret("int32", word)

    @T.macro
    def body(x, w, bias, Mq, Sq, res, rq2, out):
        xw = T.decl_buffer((N * H * W * C // 4 if CPW == 4 else 1,), wt, data=x.data)
        ww = T.decl_buffer((R * S * C // 4 if CPW == 4 else 1,), "uint32", data=w.data)
        for bx in T.thread_binding((total + TH - 1) // TH, thread="blockIdx.x"):
            for tx in T.thread_binding(TH, thread="threadIdx.x"):
                acc = T.alloc_buffer((QT * VC,), "int32", scope="local")
                seg = T.alloc_buffer((SEG * VW,), wt, scope="local")
                wl = T.alloc_buffer((VW,), "uint32", scope="local")
                yv = T.alloc_buffer((VC,), "int32", scope="local")
                ob = T.alloc_buffer((OE,), o_st, scope="local")
                i = bx * TH + tx
                if i < total:
                    cv = i % CV
                    qb = i // CV % QB
                    p = i // (CV * QB) % P
                    n = i // (CV * QB * P)
                    for j in T.unroll(QT * VC):
                        acc[j] = 0
                    for r in T.unroll(R):
                        ih = p * sh - pt + r * dh
                        for e in T.unroll(SEG):
                            iw = qb * (QT * sw) - pl + e
                            if 0 <= ih and ih < H and 0 <= iw and iw < W:
                                for v in T.vectorized(VW):
                                    seg[e * VW + v] = x_word(x, xw, n, ih, iw, cv, v)
                            else:
                                for v in T.unroll(VW):
                                    seg[e * VW + v] = T.Cast(wt, padw)
                        for s in T.unroll(S):
                            for v in T.vectorized(VW):
                                wl[v] = w_word(w, ww, r, s, cv, v)
                            for qq in T.unroll(QT):
                                for v in T.unroll(VW):
                                    for j in T.unroll(CPW):
                                        dp4a(acc[qq * VC + v * CPW + j], seg[(qq * sw + s * dw) * VW + v],
                                             w_byte(wl[v], j),
                                             acc[qq * VC + v * CPW + j])
                    for qq in T.unroll(QT):
                        if qb * QT + qq < Q:
                            for j in T.unroll(VC):
                                yv[j] = y_of(acc[qq * VC + j], n, p, qb * QT + qq, cv * VC + j, bias, Mq, Sq, res, rq2)
                            for e in T.unroll(OE):
                                ob[e] = packed(yv, e)
                            for e0 in T.unroll(OE // OCH):
                                for e1 in T.vectorized(OCH):
                                    out[n, p, qb * QT + qq, cv * OE + e0 * OCH + e1] = ob[e0 * OCH + e1]

    if has_res:
        @T.prim_func(check_well_formed=False)  # (checked by with_lut_param)
        def depthwise(x: T.Buffer(xs, x_st), w: T.Buffer((R, S, C), "int8"), bias: T.Buffer((C,), "int32"),
                      Mq: T.Buffer((C,), "int32"), Sq: T.Buffer((C,), "int32"), res: T.Buffer(res_shape, res_st),
                      rq2: T.Buffer((5, C), "int32"), out: T.Buffer(os_, o_st)):
            T.func_attr({"tir.noalias": True})
            body(x, w, bias, Mq, Sq, res, rq2, out)
    else:
        @T.prim_func(check_well_formed=False)  # (checked by with_lut_param)
        def depthwise(x: T.Buffer(xs, x_st), w: T.Buffer((R, S, C), "int8"), bias: T.Buffer((C,), "int32"),
                      Mq: T.Buffer((C,), "int32"), Sq: T.Buffer((C,), "int32"), out: T.Buffer(os_, o_st)):
            T.func_attr({"tir.noalias": True})
            body(x, w, bias, Mq, Sq, None, None, out)

    depthwise = with_lut_param(depthwise, lut, len(depthwise.params) - 1)  # (the table before out)
    return depthwise.with_attr("qcompile.strategy", "depthwise").with_attr("qcompile.knobs", repr(cfg))
