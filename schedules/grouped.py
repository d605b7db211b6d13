"""Grouped conv2d (1 < groups, NHWC) on CUDA cores, ``grouped``; and ``plan_grouped``, which picks the kernel of a
grouped layer (``depthwise`` where groups == C == K, else this one).

With Cg = C / groups input and Kg = K / groups output channels per group, output channel k of group g = k // Kg:

    acc[n, p, q, k] = sum over (r, s, c < Cg) of x[n, p*sh - pt + r*dh, q*sw - pl + s*dw, g*Cg + c] * w[k, r, s, c]
                      (``pad_value`` where the position is outside the image)
    out[n, p, q, k] = fallback.epilogue_value(acc): requantize, clip, and the residual stage where the spec has one

Steps of one thread:

1. It owns ``kt`` consecutive output channels of one group (``kt`` divides Kg) of ``qt`` consecutive output columns
   of one output row; neighbouring threads own neighbouring channel tiles (coalesced weight loads; threads of one
   group read the same input words).
2. The reduction runs over (r, 4-channel word cw of the group, s): per (r, cw) the input row segment its columns read
   (``(qt - 1) * sw + (S - 1) * dw + 1`` words, the padding value's bytes outside the image) is loaded once; per s the
   ``kt`` weight words of (r, s, cw) are vector loads of up to 16 bytes (weights stored [R, S, Cg / 4, K, 4]).
3. Each (column, channel) pair takes one ``dp4a`` per word: 4 multiply-adds, in the input's signedness
   (``dp4a.u32.s32`` for uint8 inputs). Where Cg % 4 != 0 a word holds one channel (byte loads, weights
   [R, S, Cg, K] one per word).
4. The epilogue (``fallback.epilogue_value``, shared by all kernels) and one vector store of the ``kt`` channels per
   column (4-bit outputs packed two per byte, low nibble first).

4-bit activations are read and written one value per byte (their int8 / uint8 storage); weights are one per byte.

Constraints:
    * NHWC; groups divides C and K; any R x S, stride, dilation, padding.
    * the input in 8-bit storage (int8 / uint8, 4-bit values one per byte); weights signed, one per byte.
    * ``kt`` divides Kg (1, 2, 4 or 8); ``qt`` 1 to 8.
    * a 4-bit output is written packed only with an even ``kt`` (``output_packable``); one value per byte otherwise.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from tvm.script import tirx as T

from .depthwise import dp4a_constraints, dp4a_operands, dp4a_tile_legal, epilogue_fns, shrink_tile
from .planned import PlannedKernel, with_lut_param
from .spec import ConvSpec, arch_info

MIN_BLOCKS_PER_SM = 2  # automatic config: shrink the per-thread tile until the grid has this many blocks per SM


@dataclass(frozen=True)
class GroupedConfig:
    kt: int = 0  # output channels per thread (divides K / groups): 8, 4, 2 or 1; 0 = automatic
    qt: int = 0  # output columns per thread: 1 to 8; 0 = automatic
    threads: int = 256  # threads per block


def grouped_constraints(spec: ConvSpec, groups: int) -> str | None:
    """Why the grouped kernel cannot take ``spec`` with ``groups`` (None: it can, with some config)."""
    if groups < 1 or spec.C % groups or spec.K % groups:
        return f"grouped: groups {groups} must divide C {spec.C} and K {spec.K}"
    return dp4a_constraints("grouped", spec)


def output_packable(spec: ConvSpec, cfg: GroupedConfig) -> bool:
    """Whether each thread holds whole bytes of a packed 4-bit output (an even channel tile)."""
    return cfg.kt % 2 == 0


def grouped_legal(spec: ConvSpec, groups: int, cfg: GroupedConfig) -> str | None:
    """THE legality of the grouped kernel at a resolved config (None: ``make_grouped`` builds it)."""
    why = grouped_constraints(spec, groups)
    if why:
        return why
    if cfg.kt not in (1, 2, 4, 8) or (spec.K // groups) % cfg.kt:
        return f"grouped: kt {cfg.kt} must be 8, 4, 2 or 1 and divide K / groups = {spec.K // groups}"
    return dp4a_tile_legal("grouped", spec, cfg.qt, cfg.threads, output_packable(spec, cfg), "an even kt")


def grouped_point(spec: ConvSpec, groups: int, cfg: GroupedConfig, arch: str = "sm_90",
                  sms: int | None = None) -> tuple[GroupedConfig, str | None]:
    """(the resolved config, why the kernel cannot take it or None) of a point whose fields may be automatic (0):
    ``resolve_config`` then ``grouped_legal``. ``make_grouped`` and the tuning space
    (``schedules.space.SPACES["grouped"]``, with ``groups = spec.groups``) both decide with this one function."""
    if not isinstance(cfg, GroupedConfig):
        return cfg, f"grouped takes GroupedConfig, not {type(cfg).__name__}"
    why = grouped_constraints(spec, groups)
    if why:
        return cfg, why
    res = resolve_config(spec, groups, cfg, sms, arch)
    return res, grouped_legal(spec, groups, res)


def _threads(spec: ConvSpec, kt: int, qt: int) -> int:
    return spec.N * spec.P * -(-spec.Q // qt) * (spec.K // kt)


def resolve_config(spec: ConvSpec, groups: int, cfg: GroupedConfig = GroupedConfig(), sms: int | None = None,
                   arch: str = "sm_90") -> GroupedConfig:
    """``cfg`` with its automatic fields decided: the largest of 8, 4, 2, 1 channels dividing Kg and 4 columns per
    thread, halved (channels first, then columns) while the grid would have fewer than ``MIN_BLOCKS_PER_SM`` blocks
    per SM."""
    want = MIN_BLOCKS_PER_SM * (sms or arch_info(arch).sms) * cfg.threads
    kg = spec.K // groups
    kt, qt = shrink_tile(lambda k, q: _threads(spec, k, q), want,
                         cfg.kt or next(v for v in (8, 4, 2, 1) if kg % v == 0), not cfg.kt, 2,
                         cfg.qt or min(4, spec.Q), not cfg.qt)
    return GroupedConfig(kt=kt, qt=qt, threads=cfg.threads)


def grouped_weights(w: np.ndarray) -> np.ndarray:
    """The kernel's weight buffer from the layer's logical OHWI weights [K, R, S, Cg]: [R, S, Cg / 4, K, 4] int8 where
    Cg % 4 == 0, else [R, S, Cg, K, 4] with each value in the low byte of its word (the other bytes zero)."""
    w = np.asarray(w).astype(np.int8)
    K, R, S, Cg = w.shape
    if Cg % 4 == 0:
        return np.ascontiguousarray(w.reshape(K, R, S, Cg // 4, 4).transpose(1, 2, 3, 0, 4))
    out = np.zeros((R, S, Cg, K, 4), np.int8)
    out[..., 0] = w.transpose(1, 2, 3, 0)
    return out


def make_grouped(spec: ConvSpec, groups: int, cfg: GroupedConfig | None = None, arch: str = "sm_90",
                 sms: int | None = None):
    """PrimFunc ``(x [N, H, W, C], w (grouped_weights) int8, bias, M, S [K] int32, [res, rq2 [5, K]], out [N, P, Q,
    K or K / 2])``; ValueError where ``grouped_point`` says no."""
    cfg, why = grouped_point(spec, groups, cfg or GroupedConfig(), arch, sms)
    if why:
        raise ValueError(why)
    from .planned import placeholder_kernel, planning_only

    if planning_only():
        return placeholder_kernel("grouped")
    N, H, W, C, K, R, S = spec.N, spec.H, spec.W, spec.C, spec.K, spec.R, spec.S
    P, Q = spec.P, spec.Q
    (sh, sw), (dh, dw), (pt, pl, _, _) = spec.strides, spec.dilations, spec.pads
    Cg, Kg = C // groups, K // groups
    KT, QT, TH = cfg.kt, cfg.qt, cfg.threads
    CPW = 4 if Cg % 4 == 0 else 1  # input channels per dp4a word
    CWG = Cg // CPW  # words per group pixel
    KV = min(KT, 4)  # weight words per vector load (16 bytes at most)
    KB = K // KT  # channel tiles per pixel
    QB = -(-Q // QT)
    SEG = (QT - 1) * sw + (S - 1) * dw + 1
    total = N * P * QB * KB
    ops = dp4a_operands(spec, CPW)
    x_st, o_st, wt, dp4a, padw = ops.x_st, ops.o_st, ops.wt, ops.dp4a, ops.padw
    OB = spec.out_bits
    OE = KT // 2 if OB == 4 else KT
    OCH = min(OE, 16 // np.dtype(o_st).itemsize)
    xs, ws, os_ = (N, H, W, C), (R, S, CWG, K, 4), (N, P, Q, K // 2 if OB == 4 else K)
    has_res = spec.has_residual
    res_shape = spec.res_shape() if has_res else (1,)
    res_st = ConvSpec.storage(spec.res_dtype) if has_res else "int8"
    y_of, packed, lut = epilogue_fns(spec, o_st)

    def x_word(x, xw, n, ih, iw, g, cw):
        if CPW == 4:
            return xw[((n * H + ih) * W + iw) * (C // 4) + g * CWG + cw]
        return T.Cast(wt, T.Cast("uint8", x[n, ih, iw, g * Cg + cw]))

    @T.macro
    def body(x, w, bias, Mq, Sq, res, rq2, out):
        xw = T.decl_buffer((N * H * W * C // 4 if CPW == 4 else 1,), wt, data=x.data)
        ww = T.decl_buffer((R * S * CWG * K,), "int32", data=w.data)
        for bx in T.thread_binding((total + TH - 1) // TH, thread="blockIdx.x"):
            for tx in T.thread_binding(TH, thread="threadIdx.x"):
                acc = T.alloc_buffer((QT * KT,), "int32", scope="local")
                seg = T.alloc_buffer((SEG,), wt, scope="local")
                wl = T.alloc_buffer((KT,), "int32", scope="local")
                yv = T.alloc_buffer((KT,), "int32", scope="local")
                ob = T.alloc_buffer((OE,), o_st, scope="local")
                i = bx * TH + tx
                if i < total:
                    kb = i % KB
                    qb = i // KB % QB
                    p = i // (KB * QB) % P
                    n = i // (KB * QB * P)
                    g = kb * KT // Kg
                    for j in T.unroll(QT * KT):
                        acc[j] = 0
                    for r in T.unroll(R):
                        ih = p * sh - pt + r * dh
                        for cw in T.serial(CWG):
                            for e in T.unroll(SEG):
                                iw = qb * (QT * sw) - pl + e
                                if 0 <= ih and ih < H and 0 <= iw and iw < W:
                                    seg[e] = x_word(x, xw, n, ih, iw, g, cw)
                                else:
                                    seg[e] = T.Cast(wt, padw)
                            for s in T.unroll(S):
                                for k0 in T.unroll(KT // KV):
                                    for k1 in T.vectorized(KV):
                                        wl[k0 * KV + k1] = ww[((r * S + s) * CWG + cw) * K + kb * KT + k0 * KV + k1]
                                for qq in T.unroll(QT):
                                    for kk in T.unroll(KT):
                                        dp4a(acc[qq * KT + kk], seg[qq * sw + s * dw], wl[kk], acc[qq * KT + kk])
                    for qq in T.unroll(QT):
                        if qb * QT + qq < Q:
                            for kk in T.unroll(KT):
                                yv[kk] = y_of(acc[qq * KT + kk], n, p, qb * QT + qq, kb * KT + kk, bias, Mq, Sq, res, rq2)
                            for e in T.unroll(OE):
                                ob[e] = packed(yv, e)
                            for e0 in T.unroll(OE // OCH):
                                for e1 in T.vectorized(OCH):
                                    out[n, p, qb * QT + qq, kb * OE + e0 * OCH + e1] = ob[e0 * OCH + e1]

    if has_res:
        @T.prim_func(check_well_formed=False)  # (checked by with_lut_param)
        def grouped(x: T.Buffer(xs, x_st), w: T.Buffer(ws, "int8"), bias: T.Buffer((K,), "int32"),
                    Mq: T.Buffer((K,), "int32"), Sq: T.Buffer((K,), "int32"), res: T.Buffer(res_shape, res_st),
                    rq2: T.Buffer((5, K), "int32"), out: T.Buffer(os_, o_st)):
            T.func_attr({"tir.noalias": True})
            body(x, w, bias, Mq, Sq, res, rq2, out)
    else:
        @T.prim_func(check_well_formed=False)  # (checked by with_lut_param)
        def grouped(x: T.Buffer(xs, x_st), w: T.Buffer(ws, "int8"), bias: T.Buffer((K,), "int32"),
                    Mq: T.Buffer((K,), "int32"), Sq: T.Buffer((K,), "int32"), out: T.Buffer(os_, o_st)):
            T.func_attr({"tir.noalias": True})
            body(x, w, bias, Mq, Sq, None, None, out)

    grouped = with_lut_param(grouped, lut, len(grouped.params) - 1)  # (the table before out)
    return grouped.with_attr("qcompile.strategy", "grouped").with_attr("qcompile.knobs", repr(cfg))


@dataclass(frozen=True)
class GroupedPlanned(PlannedKernel):
    """A grouped / depthwise layer's kernel: ``weights`` gives its own weight layout; ``groups`` its group count."""
    groups: int = 1

    def weights(self, w: np.ndarray) -> np.ndarray:
        from .depthwise import depthwise_weights

        return depthwise_weights(w) if self.strategy == "depthwise" else grouped_weights(w)


def grouped_strategy(spec: ConvSpec, groups: int) -> str:
    """The kernel ``plan_grouped`` runs a grouped layer on: ``depthwise`` where groups == C == K, else ``grouped``."""
    from .depthwise import depthwise_constraints

    return "depthwise" if depthwise_constraints(spec, groups) is None else "grouped"


def plan_grouped(spec: ConvSpec, groups: int, arch: str = "sm_90", cfg=None, sms: int | None = None,
                 source: str = "default") -> GroupedPlanned:
    """The kernel of a grouped conv layer: ``depthwise`` where it applies (groups == C == K), else ``grouped``
    (``cfg``: a DwConfig / GroupedConfig, None for the automatic one; ``source``: where it came from, as the plan
    and the compile summary say). A 4-bit output the resolved config cannot pack becomes one value per byte (the
    plan's ``spec.out_dtype`` says which); ValueError where neither kernel applies."""
    from .depthwise import DwConfig, depthwise_constraints, make_depthwise
    from .depthwise import output_packable as dw_packable
    from .depthwise import resolve_config as dw_resolve

    dw = depthwise_constraints(spec, groups) is None
    kind, resolve, packable, make = (("depthwise", dw_resolve, dw_packable, make_depthwise) if dw else
                                     ("grouped", lambda s, c, m, a: resolve_config(s, groups, c, m, a),
                                      output_packable, make_grouped))
    c = resolve(spec, cfg or (DwConfig() if dw else GroupedConfig()), sms, arch)
    if spec.out_bits == 4 and not packable(spec, c):
        spec = spec.replace(out_dtype=ConvSpec.storage(spec.out_dtype))
    f = make(spec, groups, c, arch, sms)
    return GroupedPlanned(spec, arch, kind, c, source, (f.with_attr("qcompile.knobs_source", source),),
                          groups=groups)


__all__ = ["GroupedConfig", "grouped_constraints", "grouped_legal", "grouped_point", "grouped_strategy", "make_grouped",
           "grouped_weights", "plan_grouped", "GroupedPlanned"]
