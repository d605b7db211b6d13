"""The implicit GEMM's loaders: K-chunks into the shared ring or registers, unpacked 4-bit tiles, register-A
fragments."""
from __future__ import annotations

from types import SimpleNamespace

from tvm.script import tirx as T

from .plan import GemmPlan


def make_loaders(p: GemmPlan, h: SimpleNamespace) -> SimpleNamespace:
    """The loaders of plan ``p``: global -> shared (cp.async, plain loads), the 4-bit unpack, A fragments."""
    H, W, K, S, sh, sw, dh, dw, pt, pl, CB, GKB = p.H, p.W, p.K, p.S, p.sh, p.sw, p.dh, p.dw, p.pt, p.pl, p.CB, p.GKB
    Mtot, BM, BN, BK, STG, LNTH, WTM, KS = p.Mtot, p.BM, p.BN, p.BK, p.STG, p.LNTH, p.WTM, p.KS
    UNPACK_LD, AGL8, PRING, AREG, AWARP, W8, AGL = p.UNPACK_LD, p.AGL8, p.PRING, p.AREG, p.AWARP, p.W8, p.AGL
    PPK, UBK, BKP, MI, APV, NAV, AG_IT, AGW, VEC = p.PPK, p.UBK, p.BKP, p.MI, p.APV, p.NAV, p.AG_IT, p.AGW, p.VEC
    VPR, A_IT, B_IT, NK, PAD_BYTE, use_async = p.VPR, p.A_IT, p.B_IT, p.NK, p.PAD_BYTE, p.use_async
    POINTWISE, x_st, B_OFF, PV_IT, STREAM = p.POINTWISE, p.x_st, p.B_OFF, p.PV_IT, p.STREAM
    row_decode, x_index, w_index, tile_slot, tile_off = h.row_decode, h.x_index, h.w_index, h.tile_slot, h.tile_off
    nib_lo, nib_hi, rot16, unpack_store, a_cp, p_slot = h.nib_lo, h.nib_hi, h.rot16, h.unpack_store, h.a_cp, h.p_slot
    pa_off, group_at, XCB = h.pa_off, h.group_at, p.XCB

    @T.macro
    def load_packed(rv, v, src, gidx, ok):
        """4-bit wgmma tiles: 16 packed bytes at src[gidx] into rv[4v:4v+4] (zeros where ``ok`` is false)."""
        for e in T.unroll(4):
            rv[v * 4 + e] = T.uint32(0)
        if ok:
            T.evaluate(T.ptx.ld.global_.v4.b32(rv[v * 4], rv[v * 4 + 1], rv[v * 4 + 2], rv[v * 4 + 3],
                                               T.address_of(src[gidx])))

    def agl_slot(it, tid):
        """agl: (row, byte column, -) of load ``it`` of thread tid: instruction i = it // (2 NAV), row g + 8 h2 of the
        warp's 16, bytes [q BK/4 + v APV, +APV) of the chunk (q = lane % 4, v = it % NAV)."""
        i, h2, v = it // (2 * NAV), it // NAV % 2, it % NAV
        return ((tid // 128) * WTM + i * 64 + (tid // 32 % 4) * 16 + tid % 32 // 4 + 8 * h2,
                tid % 4 * (BK // 4) + v * APV, 0)

    @T.macro
    def load_words(dst, base, src, gidx, ok):
        """agl: APV packed bytes at src[gidx] into dst[base:base + APV/4] (zeros where ``ok`` is false)."""
        for e in T.unroll(APV // 4):
            dst[base + e] = T.uint32(0)
        if ok:
            if APV == 16:
                T.evaluate(T.ptx.ld.global_.nc.v4.b32(dst[base], dst[base + 1], dst[base + 2], dst[base + 3],
                                                      T.address_of(src[gidx])))
            else:
                T.evaluate(T.ptx.ld.global_.nc.v2.b32(dst[base], dst[base + 1], T.address_of(src[gidx])))

    @T.macro
    def unpack_afrag(ar, pk, aslot, base):
        """agl: the packed words of ring slot ``aslot`` -> fragment set at ``base`` (load_afrag's order and unpack;
        word ks of a row's span is k-step ks). agl8: words 2 ks and 2 ks + 1 of a row's span are its k 4q.. and
        16 + 4q.. of k-step ks, their 16-bit halves swapped (rot16): an instruction writing the fragment register
        itself -- as plain copies of the loaded words ptxas gives wgmma copies and lets later loads overwrite them while
        it runs (see KEEP); the weights take the same swap (reference.permute_k8)."""
        for ks in T.unroll(KS):
            for i in T.unroll(MI):
                for h2 in T.unroll(2):
                    if AGL8:
                        ar[base + (ks * MI + i) * 4 + h2] = rot16(pk[aslot * AGW + (i * 2 + h2) * 2 * KS + 2 * ks])
                        ar[base + (ks * MI + i) * 4 + 2 + h2] = rot16(
                            pk[aslot * AGW + (i * 2 + h2) * 2 * KS + 2 * ks + 1])
                    else:
                        ar[base + (ks * MI + i) * 4 + h2] = nib_lo(pk[aslot * AGW + (i * 2 + h2) * KS + ks])
                        ar[base + (ks * MI + i) * 4 + 2 + h2] = nib_hi(pk[aslot * AGW + (i * 2 + h2) * KS + ks])

    def awarp_slot(it, tid):
        """awarp: (row, 16-byte column, -) of A vector ``it`` of thread tid: the warp's rows wm*WTM + 64i + 16*(warp % 4)
        + 0..15 (i < MI), VPR consecutive lanes per row (coalesced)."""
        L = it * 32 + tid % 32
        lr = L // VPR
        return ((tid // 128) * WTM + (lr // 16) * 64 + (tid // 32 % 4) * 16 + lr % 16, L % VPR, 0)

    @T.macro
    def decode_rows(ri, tid, m0):
        """persist / sk, not pointwise: this thread's A rows of the tile at row m0, decoded once per tile (in the plain
        loop nvcc hoists the decode out of the K loop; here the tile changes inside it): ri[3 it ..] = (the row's input
        offset at tap (0, 0), its top and left input coordinates); a row past Mtot gets a top coordinate that fails
        every bounds check."""
        for it in T.unroll(A_IT):
            slot = T.meta_var(awarp_slot(it, tid) if AWARP else tile_slot(it * LNTH + tid, BM))
            m = m0 + slot[0]
            dec = T.meta_var(row_decode(m))
            ri[it * 3] = x_index(dec[0], dec[1] * sh - pt, dec[2] * sw - pl, 0)
            ri[it * 3 + 1] = T.if_then_else(m < Mtot, dec[1] * sh - pt, -(1 << 28))
            ri[it * 3 + 2] = dec[2] * sw - pl

    @T.macro
    def load_chunk(xf, wf, rv, As, Bs, tid, m0, n0, kc, ri=None, pk=None, aslot=0):
        """Issue the loads of K-chunk ``kc`` into ring stage ``kc % STG`` (cp.async or plain loads); with ``ri``
        (persist, sk, not pointwise) the A rows come decoded from decode_rows; agl: A into slot ``aslot`` of ``pk``."""
        for it in T.unroll(AG_IT if AGL else A_IT):
            L = it * LNTH + tid
            slot = T.meta_var(agl_slot(it, tid) if AGL else (awarp_slot(it, tid) if AWARP else tile_slot(L, BM)))
            row = slot[0]
            kb = (kc % NK if STREAM else kc) * BK + (slot[1] if AGL else slot[1] * VEC)
            m = m0 + row
            rs = T.truncdiv(kb, CB)  # (kb >= 0)
            cb = T.truncmod(kb, CB)
            dec = T.meta_var(row_decode(m))
            ih = (ri[it * 3 + 1] if ri is not None else dec[1] * sh - pt) + T.truncdiv(rs, S) * dh
            iw = (ri[it * 3 + 2] if ri is not None else dec[2] * sw - pl) + T.truncmod(rs, S) * dw
            inb = kb < GKB if ri is not None else (m < Mtot and kb < GKB)  # (ri: rows past Mtot fail on ih)
            # (pointwise: row m of the GEMM is pixel m of the input in either layout, always in bounds -- no im2col
            # decode, whose divisions are ~150 of a 128x128 tile's ~1100 instructions per warp on ResNet's 1x1s)
            ok = T.meta_var(inb if POINTWISE else (inb and ih >= 0 and ih < H and iw >= 0 and iw < W))
            soff = (kc % STG) * (BM * BKP) + slot[2]
            tap = T.meta_var(x_index(0, T.truncdiv(rs, S) * dh, T.truncmod(rs, S) * dw, cb))  # (x_index is linear)
            gidx = T.meta_var(group_at(ri[it * 3] + tap if ri is not None else
                                       (m * XCB + kb if POINTWISE else x_index(dec[0], ih, iw, cb)), n0))
            if AGL and pk is not None:  # packed, into this thread's register ring (pk None: a loop agl never runs)
                load_words(pk, aslot * AGW + it * (APV // 4), xf, gidx, ok)
            elif AREG:  # packed, into the block's A ring
                T.evaluate(a_cp(As, xf, pa_off(kc, row, slot[1]), gidx, ok))
            elif UNPACK_LD and PRING:  # packed, into this thread's slot of the packed ring
                T.evaluate(a_cp(As, xf, p_slot(kc, it, tid), gidx, ok))
            elif UNPACK_LD:  # into registers (the whole chunk in flight together); store_chunk unpacks them later
                load_packed(rv, it, xf, gidx, ok)
            elif use_async:
                T.evaluate(a_cp(As, xf, soff, gidx, ok))
            else:
                if ok:
                    for v in T.unroll(VEC):
                        As[soff + v] = xf[gidx + v]
                else:
                    for v in T.unroll(VEC):
                        As[soff + v] = T.if_then_else(inb, T.Cast(x_st, PAD_BYTE), T.Cast(x_st, 0))
        for it in T.unroll(B_IT):
            L = it * LNTH + tid
            slot = T.meta_var(tile_slot(L, BN))
            row = slot[0]
            kb = (kc % NK if STREAM else kc) * BK + slot[1] * VEC
            k = n0 + row
            ok = k < K and kb < GKB
            soff = B_OFF + (kc % STG) * (BN * BKP) + slot[2]
            gidx = T.meta_var(w_index(k, kb))
            if W8:  # 16 expanded bytes straight into the swizzled stage: row L // (UBK/16), chunk L % (UBK/16)
                r8 = L // (UBK // 16)
                c8 = L % (UBK // 16)
                T.evaluate(a_cp(Bs, wf, B_OFF + (kc % STG) * (BN * BKP) + tile_off(r8, c8, BN),
                                w_index(n0 + r8, (kc % NK if STREAM else kc) * UBK + c8 * 16, UBK // BK * CB),
                                n0 + r8 < K and (kc % NK if STREAM else kc) * UBK + c8 * 16 < UBK // BK * GKB))
            elif UNPACK_LD and PRING:
                T.evaluate(a_cp(Bs, wf, p_slot(kc, it if AREG else A_IT + it, tid), gidx, ok))
            elif UNPACK_LD:
                load_packed(rv, A_IT + it, wf, gidx, ok)
            elif use_async:
                T.evaluate(a_cp(Bs, wf, soff, gidx, ok))
            else:
                if ok:
                    for v in T.unroll(VEC):
                        Bs[soff + v] = wf[gidx + v]
                else:
                    for v in T.unroll(VEC):
                        Bs[soff + v] = T.int8(0)

    @T.macro
    def store_tile(rv, S_, tid, base, rows, its, v0):
        """Packed vectors rv[4*v0 ...] of one tile (``its`` per thread) -> unpacked, swizzled, at ``base``."""
        for it in T.unroll(its):
            slot = T.meta_var(tile_slot(it * LNTH + tid, rows))
            st2 = T.meta_var(unpack_store(S_, base + slot[2], base + tile_off(slot[0], slot[1] * 2 + 1, rows), rv,
                                          v0 + it))
            T.evaluate(st2[0])
            T.evaluate(st2[1])

    @T.macro
    def store_chunk(rv, As, Bs, tid, kc):
        """4-bit wgmma tiles: the packed vectors load_chunk left in ``rv`` -> unpacked, swizzled, stage kc % STG."""
        store_tile(rv, As, tid, (kc % STG) * (BM * BKP), BM, A_IT, 0)
        store_tile(rv, Bs, tid, B_OFF + (kc % STG) * (BN * BKP), BN, B_IT, A_IT)

    @T.macro
    def unpack_chunk(rv, As, tid, kc):
        """Packed ring: this thread's vectors of chunk kc (landed: cp.async.wait_group) -> registers -> unpacked."""
        for v in T.unroll(PV_IT):
            T.evaluate(T.ptx.ld.shared.v4.b32(rv[v * 4], rv[v * 4 + 1], rv[v * 4 + 2], rv[v * 4 + 3],
                                              T.address_of(As[p_slot(kc, v, tid)])))
        if AREG:
            if not W8:
                store_tile(rv, As, tid, B_OFF + (kc % STG) * (BN * BKP), BN, B_IT, 0)
        elif W8:  # (PPW: B went straight into its stage)
            store_tile(rv, As, tid, (kc % STG) * (BM * BKP), BM, A_IT, 0)
        else:
            store_chunk(rv, As, As, tid, kc)

    @T.macro
    def load_afrag(ar, pw, As, lane, warp, wm, kc, base):
        """areg: this thread's wgmma A fragments of chunk kc, unpacked: per k-step ks and m64 instruction i,
        ar[base + (ks*MI + i)*4 + 0..3] = (row g, k 4q..), (row g+8, k 4q..), (row g, k 16+4q..), (row g+8, k 16+4q..)
        (g = lane/4, q = lane%4): the even values of packed word q of the step in the first two, the odd values in
        the last two -- the k order the nibble split gives the B tile."""
        if PPK:  # agl's k order: thread q's bytes [q*BK/4, (q+1)*BK/4) of the row, word ks for k-step ks
            for i in T.unroll(MI):
                for h2 in T.unroll(2):
                    for j in T.unroll(NAV):
                        b0 = T.meta_var((lane % 4) * (BK // 4) + j * APV)  # (byte of the row, within 16-byte chunk)
                        ad_ = T.meta_var(T.address_of(As[pa_off(kc, wm * WTM + i * 64 + (warp % 4) * 16 + lane // 4
                                                                + 8 * h2, b0 // 16) + b0 % 16]))
                        if APV == 16:
                            T.evaluate(T.ptx.ld.shared.v4.b32(pw[j * 4], pw[j * 4 + 1], pw[j * 4 + 2], pw[j * 4 + 3],
                                                              ad_))
                        elif APV == 8:
                            T.evaluate(T.ptx.ld.shared.v2.b32(pw[j * 2], pw[j * 2 + 1], ad_))
                        else:
                            T.evaluate(T.ptx.ld.shared.b32(pw[j], ad_))
                    for ks in T.unroll(KS):
                        ar[base + (ks * MI + i) * 4 + h2] = nib_lo(pw[ks])
                        ar[base + (ks * MI + i) * 4 + 2 + h2] = nib_hi(pw[ks])
        else:
            for ks in T.unroll(KS):
                for i in T.unroll(MI):
                    for h2 in T.unroll(2):
                        T.evaluate(T.ptx.ld.shared.b32(
                            pw[h2], T.address_of(As[pa_off(kc, wm * WTM + i * 64 + (warp % 4) * 16 + lane // 4
                                                           + 8 * h2, ks) + (lane % 4) * 4])))
                    for h2 in T.unroll(2):
                        ar[base + (ks * MI + i) * 4 + h2] = nib_lo(pw[h2])
                        ar[base + (ks * MI + i) * 4 + 2 + h2] = nib_hi(pw[h2])


    return SimpleNamespace(load_packed=load_packed, agl_slot=agl_slot, load_words=load_words, unpack_afrag=unpack_afrag,
                           awarp_slot=awarp_slot, decode_rows=decode_rows, load_chunk=load_chunk, store_tile=store_tile,
                           store_chunk=store_chunk, unpack_chunk=unpack_chunk, load_afrag=load_afrag)
