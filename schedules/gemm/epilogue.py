"""The implicit GEMM's fused epilogue: accumulators -> warp staging tile -> requantize (two stages) -> vector stores."""
from __future__ import annotations

from types import SimpleNamespace

from tvm.script import tirx as T

from ..planned import lut_buffer, lut_value
from .plan import GemmPlan


def make_epilogue_parts(p: GemmPlan, h: SimpleNamespace) -> SimpleNamespace:
    """The epilogue's pieces for plan ``p``: parameters, residual loads, output packing and stores."""
    spec, WG, K, Mtot, BM, NTH, WTM, WTN, EV = p.spec, p.WG, p.K, p.Mtot, p.BM, p.NTH, p.WTM, p.WTN, p.EV
    o_st, OB, HAS_RES, RB, olo, ohi, CS_IT, LPR = p.o_st, p.OB, p.HAS_RES, p.RB, p.olo, p.ohi, p.CS_IT, p.LPR
    PV, RBV, RW, PREF, RPB, RES_OFF, RSM, RIT = p.PV, p.RBV, p.RW, p.PREF, p.RPB, p.RES_OFF, p.RSM, p.RIT
    OUT_VEC, OSV, LUT = p.OUT_VEC, p.OSV, p.LUT
    wtile, rp_at, res_base = h.wtile, h.rp_at, h.res_base
    lut = lut_buffer(spec)  # the output lookup table (LUT; the kernel's parameter: kernel.py)

    @T.macro
    def load_params(bias, Mq, Sq, pb, pm, ps, k):
        for h in T.unroll(EV // PV):
            for e in T.vectorized(PV):
                pb[h * PV + e] = bias[k + h * PV + e]
            for e in T.vectorized(PV):
                pm[h * PV + e] = Mq[k + h * PV + e]
            for e in T.vectorized(PV):
                ps[h * PV + e] = Sq[k + h * PV + e]

    @T.macro
    def res_to_smem(rf, As, m0, n0, tid):
        """RSM: the tile's residual rows (BM x RPB bytes) -> As[RES_OFF ..] as 16-byte cp.async (rows past the
        output, columns past K: zero-filled from a safe address)."""
        for it in T.unroll(RIT):
            v = it * NTH + tid
            r = v // (RPB // 16)
            c = v % (RPB // 16)
            ok = T.meta_var(T.And(m0 + r < Mtot, n0 * RB // 8 + c * 16 < K * RB // 8))
            if v < BM * RPB // 16:
                T.evaluate(T.ptx.cp.async_.cg.shared.global_(
                    T.address_of(As[RES_OFF + r * RPB + c * 16]),
                    T.address_of(rf[T.if_then_else(ok, res_base(m0 + r, n0) + c * 16, 0)]), 16,
                    T.if_then_else(ok, T.uint32(16), T.uint32(0))))

    @T.macro
    def res_prefetch(rfw, rpre, m0, n0, i, tid, Cb):
        """PREF: this lane's residual words of every row it writes in 16-row block i -> rpre (8/16-byte loads;
        RP_ALL: at rpre[i * CS_IT * RW + ..], every block's words held at once)."""
        lane = tid % 32
        warp = tid // 32
        wm, wn = wtile(warp)
        for it in T.unroll(CS_IT):
            m = m0 + wm * WTM + (i * 64 + (warp % 4) * 16 if WG else i * 16) + (it * 32 + lane) // LPR
            k = n0 + wn * WTN + ((it * 32 + lane) % LPR) * EV
            if RSM:  # from the block's copy of its residual tile
                sa = T.meta_var(T.address_of(Cb[RES_OFF + (m - m0) * RPB + (k - n0) * RB // 8]))
                if RW == 4:
                    T.evaluate(T.ptx.ld.shared.v4.b32(rpre[it * 4], rpre[it * 4 + 1], rpre[it * 4 + 2],
                                                      rpre[it * 4 + 3], sa))
                elif RW == 2:
                    T.evaluate(T.ptx.ld.shared.v2.b32(rpre[it * 2], rpre[it * 2 + 1], sa))
                else:
                    T.evaluate(T.ptx.ld.shared.b32(rpre[it], sa))
            elif m < Mtot and k < K:
                if RW == 4:
                    T.evaluate(T.ptx.ld.global_.nc.v4.b32(rpre[rp_at(i, it * 4)], rpre[rp_at(i, it * 4 + 1)],
                                                          rpre[rp_at(i, it * 4 + 2)], rpre[rp_at(i, it * 4 + 3)],
                                                          T.address_of(rfw[res_base(m, k) // 4])))
                elif RW == 2:
                    T.evaluate(T.ptx.ld.global_.nc.v2.b32(rpre[rp_at(i, it * 2)], rpre[rp_at(i, it * 2 + 1)],
                                                          T.address_of(rfw[res_base(m, k) // 4])))
                else:
                    T.evaluate(T.ptx.ld.global_.nc.b32(rpre[rp_at(i, it)], T.address_of(rfw[res_base(m, k) // 4])))

    @T.macro
    def load_residual(rq2, rfw, rf, q2, rb, rbw, rpre, m, k, it, i):
        """The residual stage's inputs for output (m, k..k+EV): per-channel rq2 (unless compiled in) and the residual
        bytes or words (PREF: from the block's prefetched words)."""
        if HAS_RES and not spec.rq2_uniform:
            for j in T.unroll(5):
                for h in T.unroll(EV // PV):
                    for e in T.vectorized(PV):
                        q2[j * EV + h * PV + e] = rq2[j * K + k + h * PV + e]
        if HAS_RES:
            if PREF:
                for e in T.unroll(RW):
                    rbw[e] = rpre[rp_at(i, it * RW + e)]
            elif RW > 0:  # whole 32-bit words: one vector load
                for e in T.vectorized(RW):
                    rbw[e] = rfw[res_base(m, k) // 4 + e]
            else:
                for e in T.unroll(RBV):
                    rb[e] = rf[res_base(m, k) + e]

    def nib_word(yb, e0):
        """4-bit output: the 32-bit word of yb[e0 .. e0+7] (element e in bits 4e..4e+3, the byte order of the packed
        storage), summed from shifted values: an in-range unsigned value needs no mask (one LEA / IMAD per element).
        (The output range is the last stage's: with a residual, [lo2, hi2] -- stage 1's [lo, hi] is signed there.)"""
        w = None
        for e in range(8):
            v = T.Cast("uint32", yb[e0 + e])
            if not (olo >= 0 and ohi <= 15):
                v = T.bitwise_and(v, T.uint32(15))
            v = T.shift_left(v, T.uint32(4 * e)) if e else v
            w = v if w is None else w + v
        return w

    @T.macro
    def store16(dst, base, src, n, per):
        """dst[base .. base+n) = src[0 .. n) as vector stores of ``per`` elements (16 bytes at most: CUDA has no
        int32x8 / int32x16 type)."""
        for v in T.unroll(n // per):
            for e in T.vectorized(per):
                dst[base + v * per + e] = src[v * per + e]

    @T.macro
    def store_out(of, ofw, ob, yb, m, k):
        """Output (m, k..k+EV) from yb: packed to 4-bit (whole 32-bit words when EV % 8 == 0), or cast, and stored
        as one vector."""
        if OB == 4 and EV % 8 == 0:
            for wv in T.vectorized(EV // 8):
                ofw[(m * K + k) // 8 + wv] = nib_word(yb, wv * 8)
        elif OB == 4:
            for e in T.unroll(OUT_VEC):
                ob[e] = T.Cast(o_st, T.bitwise_or(T.bitwise_and(yb[2 * e], 15),
                                                  T.shift_left(T.bitwise_and(yb[2 * e + 1], 15), 4)))
            for e in T.vectorized(OUT_VEC):
                of[(m * K + k) // 2 + e] = ob[e]
        elif LUT > 0:  # each final value's table entry: a byte load from a table of LUT bytes (L1-resident)
            for e in T.unroll(EV):
                ob[e] = lut_value(spec, lut, yb[e])
            store16(of, m * K + k, ob, OUT_VEC, OSV)
        else:
            for e in T.unroll(EV):
                ob[e] = T.Cast(o_st, yb[e])
            store16(of, m * K + k, ob, OUT_VEC, OSV)


    return SimpleNamespace(load_params=load_params, res_to_smem=res_to_smem, res_prefetch=res_prefetch,
                           load_residual=load_residual, nib_word=nib_word, store16=store16, store_out=store_out,
                           lut=lut)


def make_epilogue(p: GemmPlan, h: SimpleNamespace, ep: SimpleNamespace) -> SimpleNamespace:
    """The fused epilogue of one output tile for plan ``p``, and stream-K's tile end."""
    WG, SPLIT, K, Mtot, WTM, WTN, NT, GIF, EMT = p.WG, p.SPLIT, p.K, p.Mtot, p.WTM, p.WTN, p.NT, p.GIF, p.EMT
    NK, EV, CSP, OB, HAS_RES, ERQ, ERQ4, CPB, PP = p.NK, p.EV, p.CSP, p.OB, p.HAS_RES, p.ERQ, p.ERQ4, p.CPB, p.PP
    LUT = p.LUT
    NACC, C_OFF, CS_IT, LPR, HOIST, PV, PREF = p.NACC, p.C_OFF, p.CS_IT, p.LPR, p.HOIST, p.PV, p.PREF
    RP_ALL = p.RP_ALL
    cs_col, wtile, requant1, requant2, requant = h.cs_col, h.wtile, h.requant1, h.requant2, h.requant
    unshift, acc_u32, acc_i32, ld_staged, staged = h.unshift, h.acc_u32, h.acc_i32, h.ld_staged, h.staged
    tile_origin, sk_block_of, sk_slot, sk_word = h.tile_origin, h.sk_block_of, h.sk_slot, h.sk_word
    res_value = h.res_value
    load_params, res_prefetch, load_residual, store16 = ep.load_params, ep.res_prefetch, ep.load_residual, ep.store16
    store_out = ep.store_out

    @T.macro
    def epilogue(bias, Mq, Sq, rf, rfw, rq2, of, ofw, Cs, Cb, acc, pb, pm, ps, q2, rb, rbw, yb, ob, sb, tid, m0, n0, bz,
                 rpre):
        """The fused epilogue of one output tile, staged through the warp's own shared-memory tile."""
        warp = tid // 32
        lane = tid % 32
        wm, wn = wtile(warp)
        # the warp's staging tile: 8-bit values at byte cbase (erq), else int32 words at word cbase
        cbase = (C_OFF + warp * (16 * CPB)) if ERQ else (C_OFF // 4 + warp * (16 * CSP))
        if HOIST and SPLIT == 1 and not ERQ:  # a lane's channels are the same for every row it writes: load them once
            k0 = n0 + wn * WTN + (lane % LPR) * EV
            if k0 < K:
                load_params(bias, Mq, Sq, pb, pm, ps, k0)
        if RP_ALL:
            for i in T.unroll(EMT):
                res_prefetch(rfw, rpre, m0, n0, i, tid, Cb)
        for i in (T.unroll(EMT) if (RP_ALL or PP or (ERQ and EMT > 1 and GIF > 0)) else T.serial(EMT)):
            # (pp, and erq on a warpgroup tile of several row blocks with a wgmma group in flight: see RP_ALL; with erq
            # the rolled loop put the accumulators on the stack -- 304 / 560-byte frames on 128x64 / 128x128
            # one-warpgroup tiles -- and with a group in flight that gives wrong sums: the ping-pong kernel, the 4-bit
            # w8 register-A kernel and the 8-bit kernel with pipe 0. With pipe -1 every group has retired: exact)
            if PREF and not RP_ALL:
                res_prefetch(rfw, rpre, m0, n0, i, tid, Cb)
            if ERQ:  # stage 1 on the accumulators (column pair k, k+1 of rows g and g+8: one 2-byte store each)
                for j in T.unroll(NT):
                    kp = n0 + wn * WTN + j * 8 + (lane % 4) * 2
                    if kp < K:  # (8-byte loads through the PTX helpers: TVM emits vector loads as gathers)
                        T.evaluate(T.ptx.ld.global_.nc.v2.b32(pb[0], pb[1], T.address_of(bias[kp])))
                        T.evaluate(T.ptx.ld.global_.nc.v2.b32(pm[0], pm[1], T.address_of(Mq[kp])))
                        T.evaluate(T.ptx.ld.global_.nc.v2.b32(ps[0], ps[1], T.address_of(Sq[kp])))
                    for e2 in T.unroll(2):
                        v0 = T.meta_var(T.Cast("int32", requant1(acc_i32(acc, (i * NT + j) * 4 + 2 * e2), pb[0], pm[0],
                                                                 ps[0])))
                        v1 = T.meta_var(T.Cast("int32", requant1(acc_i32(acc, (i * NT + j) * 4 + 2 * e2 + 1), pb[1],
                                                                 pm[1], ps[1])))
                        if ERQ4:  # (packed: columns k, k+1 in the low / high nibble of byte k / 2 of the row)
                            T.evaluate(T.ptx.st.shared.b8(
                                T.address_of(Cb[cbase + (lane // 4 + 8 * e2) * CPB + j * 4 + lane % 4]),
                                T.Cast("uint32", T.bitwise_or(T.bitwise_and(v0, 15),
                                                              T.shift_left(T.bitwise_and(v1, 15), 4)))))
                        else:
                            T.evaluate(T.ptx.st.shared.b16(
                                T.address_of(Cb[cbase + (lane // 4 + 8 * e2) * CPB + j * 8 + (lane % 4) * 2]),
                                T.Cast("uint32", T.bitwise_or(T.bitwise_and(v0, 255),
                                                              T.shift_left(T.bitwise_and(v1, 255), 8)))))
            else:
                # (written through st.shared, which TVM's sync planner does not track: as buffer stores it adds a
                # __syncthreads per row block. The read-back stays a buffer load: through ld.shared.v4 ptxas uses
                # 150 instead of 122 registers with pipe 0)
                for j in T.unroll(NT):
                    for e2 in T.unroll(2):  # rows g and g+8: two adjacent columns each, one 8-byte store
                        T.evaluate(T.ptx.st.shared.v2.b32(
                            T.address_of(Cs[cbase + (lane // 4 + 8 * e2) * CSP + cs_col(j * 8) + (lane % 4) * 2]),
                            acc_u32(acc, (i * NT + j) * 4 + 2 * e2), acc_u32(acc, (i * NT + j) * 4 + 2 * e2 + 1)))
            T.evaluate(T.cuda.warp_sync())  # (the staging tile is the warp's own)
            for it in (T.unroll(CS_IT) if PREF else T.serial(CS_IT)):  # the warp's 16 rows, EV outputs per lane
                L = it * 32 + lane
                row = L // LPR
                cc = (L % LPR) * EV
                m = m0 + wm * WTM + (i * 64 + (warp % 4) * 16 if WG else i * 16) + row
                k = n0 + wn * WTN + cc
                if ERQ4:  # the staged packed bytes are the output: EV / 2 of them per lane
                    if m < Mtot and k < K:
                        T.evaluate(ld_staged(sb, T.address_of(Cb[cbase + row * CPB + cc // 2]), EV // 2))
                        for e in T.vectorized(EV // 8):
                            ofw[(m * K + k) // 8 + e] = sb[e]
                elif ERQ:  # the staged 8-bit values: residual stage / 4-bit pack / plain copy out
                    if m < Mtot and k < K:
                        T.evaluate(ld_staged(sb, T.address_of(Cb[cbase + row * CPB + cc])))
                        if OB == 8 and not HAS_RES and not LUT:  # the staged bytes are the output
                            for e in T.vectorized(EV // 4):
                                ofw[(m * K + k) // 4 + e] = sb[e]
                        else:  # (LUT: the staged values' table entries, through store_out)
                            load_residual(rq2, rfw, rf, q2, rb, rbw, rpre, m, k, it, i)
                            for e in T.unroll(EV):
                                yb[e] = requant2(staged(sb, e), q2, e, res_value(rb, rbw, e))
                            store_out(of, ofw, ob, yb, m, k)
                elif SPLIT > 1:  # split-K partial sums: int32, no epilogue (schedules/splitk.py)
                    if m < Mtot and k < K:
                        for e in T.unroll(EV):
                            yb[e] = unshift(Cs[cbase + row * CSP + cs_col(cc) + e])
                        store16(of, (bz * Mtot + m) * K + k, yb, EV, PV)  # (int32: PV = min(4, EV) per store)
                else:
                    if m < Mtot and k < K:
                        if not HOIST:
                            load_params(bias, Mq, Sq, pb, pm, ps, k)
                        load_residual(rq2, rfw, rf, q2, rb, rbw, rpre, m, k, it, i)
                        for e in T.unroll(EV):
                            yb[e] = requant(Cs[cbase + row * CSP + cs_col(cc) + e], pb[e], pm[e], ps[e], q2, e,
                                            res_value(rb, rbw, e))
                        store_out(of, ofw, ob, yb, m, k)
            T.evaluate(T.cuda.warp_sync())  # (tvm_storage_sync("warp") emits __syncthreads)

    @T.macro
    def sk_tile_end(bias, Mq, Sq, rf, rfw, rq2, of, ofw, Cs, Cb, acc, pb, pm, ps, q2, rb, rbw, yb, ob, sb, tid, bz, rpre,
                    skc, skw, skn, skt, bxn, beg, G):
        """sk: the end of this block's part of tile t = G // NK (G: its last iteration here). The tile's owner is the
        block holding its first chunk, c0: a block that holds it whole runs the epilogue; the others (c0+1 .. c1, each
        holding a later run of its chunks, which they reach first in their own streams) store their accumulators to
        their workspace slot and count themselves in skc[t] (barrier, then one red.release.gpu); the owner, which
        reaches its part last in its stream, waits until the count is c1 - c0 (ld.acquire.gpu by one thread, then a
        barrier), adds their partials (ld.global.cg), resets the count for the next launch and runs the epilogue.
        The grid is at most one wave (sk x SMs blocks), and every wait is on a later block's first part."""
        t = T.truncdiv(G, NK)
        o2 = T.meta_var(tile_origin(G, bxn))
        c0 = sk_block_of(t * NK)
        if bxn != c0:  # a later part: to the workspace, and counted
            for r4 in T.unroll(NACC // 4):
                T.evaluate(T.ptx.st.global_.cg.v4.b32(T.address_of(skw[sk_word(sk_slot(bxn, t), r4, tid)]), acc[r4 * 4],
                                                      acc[r4 * 4 + 1], acc[r4 * 4 + 2], acc[r4 * 4 + 3]))
            T.tvm_storage_sync("shared")
            if tid == 0:
                T.evaluate(T.ptx.red.release.gpu.global_.add.s32(T.address_of(skc[t]), T.int32(1)))
        else:
            if beg > t * NK or T.truncmod(G, NK) != NK - 1:  # the owner of a shared tile: wait for the other parts
                if tid == 0:
                    skn[0] = 0
                    while skn[0] < sk_block_of(t * NK + NK - 1) - c0:
                        T.evaluate(T.ptx.ld.acquire.gpu.global_.s32(skn[0], T.address_of(skc[t])))
                    skc[t] = 0
                T.tvm_storage_sync("shared")
                for c in T.serial(sk_block_of(t * NK + NK - 1) - c0):
                    for r4 in T.unroll(NACC // 4):
                        T.evaluate(T.ptx.ld.global_.cg.v4.b32(skt[0], skt[1], skt[2], skt[3], T.address_of(
                            skw[sk_word(sk_slot(c0 + 1 + c, t), r4, tid)])))
                        for e in T.unroll(4):
                            acc[r4 * 4 + e] = acc[r4 * 4 + e] + skt[e]
            epilogue(bias, Mq, Sq, rf, rfw, rq2, of, ofw, Cs, Cb, acc, pb, pm, ps, q2, rb, rbw, yb, ob, sb, tid,
                     o2[0], o2[1], bz, rpre)


    return SimpleNamespace(epilogue=epilogue, sk_tile_end=sk_tile_end)
