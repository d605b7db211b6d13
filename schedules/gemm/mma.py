"""The implicit GEMM's MMA issue: wgmma per K-chunk, the ping-pong consumer step, mma.sync fragments and steps."""
from __future__ import annotations

from types import SimpleNamespace

from tvm.script import tirx as T

from .plan import GemmPlan


def make_mma(p: GemmPlan, h: SimpleNamespace, ld: SimpleNamespace) -> SimpleNamespace:
    """The MMA issue of plan ``p``: wgmma chunks (descriptors or register A), ping-pong consumers, mma.sync steps."""
    BM, BN, STG, WTM, WTN, MT, NT, KS, AREG, BKP = p.BM, p.BN, p.STG, p.WTM, p.WTN, p.MT, p.NT, p.KS, p.AREG, p.BKP
    SBO, GIF, MI, INS_N, NI, unpack, a_ty, b_ty = p.SBO, p.GIF, p.MI, p.INS_N, p.NI, p.unpack, p.a_ty, p.b_ty
    SUB_M, SUB_K, MMA, FDB = p.SUB_M, p.SUB_K, p.MMA, p.FDB
    nib_lo, nib_hi, kstep_off, wg_mma = h.nib_lo, h.nib_hi, h.kstep_off, h.wg_mma
    load_afrag = ld.load_afrag

    @T.macro
    def mma_chunk(acc, ad, ar, wm, wn, kc, aset, acc_on=1):
        """The wgmma instructions of chunk kc: A through descriptor ad[0], or with areg from fragment set ``aset``.
        ``acc_on`` 0 (int32 expression): the tile's first chunk, whose first k-step starts the sums (scale-d 0)."""
        for ks in T.unroll(KS):
            for i in T.unroll(MI):
                for h in T.unroll(NI):
                    bdesc = T.meta_var(ad[1] + T.Cast("uint64", (kc % STG * (BN * BKP) + (wn * WTN + h * INS_N) // 8
                                                                 * SBO + kstep_off(ks, BN)) // 16))
                    sd = T.meta_var(acc_on if ks == 0 else 1)
                    if AREG:
                        T.evaluate(wg_mma(acc, (i * NT + h * (INS_N // 8)) * 4, aset * (KS * MI * 4) + (ks * MI + i) * 4,
                                          bdesc, ar, sd))
                    else:
                        T.evaluate(wg_mma(acc, (i * NT + h * (INS_N // 8)) * 4,
                                          ad[0] + T.Cast("uint64", (kc % STG * (BM * BKP) + (wm * WTM + i * 64) // 8 * SBO
                                                                    + kstep_off(ks, BM)) // 16), bdesc, None, sd))

    @T.macro
    def pp_chunk(acc, ad, ar, pw, As, lane, warp, tid, tb, kc, aset, acc_on, tot):
        """pp consumer: chunk kc of the tile whose first chunk is tb -- wait until published, (4-bit) its A fragments
        into register set ``aset``, its MMAs (``acc_on`` 0: the tile's first), and once chunk kc - GIF retired, its
        stage marked empty (only the arrivals the producer waits for)."""
        T.evaluate(T.ptx.bar.sync(T.uint32(1) + T.Cast("uint32", tid // 128 * STG + (tb + kc) % STG), T.uint32(256)))
        if AREG:
            load_afrag(ar, pw, As, lane, warp, 0, tb + kc, aset * (KS * MI * 4))
        T.ptx.wgmma.fence.sync.aligned()
        mma_chunk(acc, ad, ar, 0, 0, tb + kc, aset, acc_on)
        T.ptx.wgmma.commit_group.sync.aligned()
        T.ptx.wgmma.wait_group.sync.aligned(GIF)
        if kc >= GIF:
            if tb + kc - GIF + STG < tot:
                T.evaluate(T.ptx.bar.arrive(T.uint32(1 + 2 * STG) + T.Cast("uint32", (tb + kc - GIF) % STG),
                                            T.uint32(256)))

    @T.macro
    def load_frags(As, Bs, af, bf, lane, wm, wn, stage, ks, buf):
        """ldmatrix.x4 the warp's A and B fragments of k-step ``ks`` into fragment buffer ``buf``."""
        for i in T.unroll(MT):
            T.ptx_legacy.ldmatrix(
                False, 4, ".b16", af.data, buf * (MT * 4) + i * 4, As.access_ptr("r"),
                stage * (BM * BKP) + (wm * WTM + i * 16 + lane % 16) * BKP + ks * 32
                + (lane // 16) * 16, dtype="int8")
        for j in T.unroll(NT // 2):
            T.ptx_legacy.ldmatrix(
                False, 4, ".b16", bf.data, buf * (NT * 2) + j * 4, Bs.access_ptr("r"),
                stage * (BN * BKP) + (wn * WTN + j * 16 + (lane // 16) * 8 + lane % 8) * BKP
                + ks * 32 + ((lane // 8) % 2) * 16, dtype="int8")

    @T.macro
    def mma_step(af, bf, al, bl, acc, buf):
        """The warp tile's MMAs on fragment buffer ``buf`` (INT4 on Hopper: unpacked to s8 first)."""
        if unpack:
            for e in T.unroll(MT * 4):
                al[e] = nib_lo(af[buf * (MT * 4) + e])
                al[MT * 4 + e] = nib_hi(af[buf * (MT * 4) + e])
            for e in T.unroll(NT * 2):
                bl[e] = nib_lo(bf[buf * (NT * 2) + e])
                bl[NT * 2 + e] = nib_hi(bf[buf * (NT * 2) + e])
            for h in T.unroll(2):
                for i in T.unroll(MT):
                    for j in T.unroll(NT):
                        T.ptx_legacy.mma(MMA, "row", "col", a_ty, b_ty, "int32",
                                         al.data, h * (MT * 4) + i * 4, bl.data,
                                         h * (NT * 2) + j * 2, acc.data, (i * NT + j) * 4,
                                         False, dtype="int32")
        else:
            for i in T.unroll(MT):
                for j in T.unroll(NT):
                    for sm in T.unroll(SUB_M):
                        for sk in T.unroll(SUB_K):
                            T.ptx_legacy.mma(MMA, "row", "col", a_ty, b_ty, "int32",
                                             af.data, buf * (MT * 4) + i * 4 + sm + 2 * sk, bf.data,
                                             buf * (NT * 2) + j * 2 + sk,
                                             acc.data, (i * NT + j) * 4 + 2 * sm, False,
                                             dtype="int32")

    @T.macro
    def compute_chunk(As, Bs, af, bf, al, bl, acc, lane, wm, wn, stage):
        if FDB:  # fragments of k-step ks+1 are loaded while the MMAs of ks run
            load_frags(As, Bs, af, bf, lane, wm, wn, stage, 0, 0)
            for ks in T.unroll(KS):
                if ks + 1 < KS:
                    load_frags(As, Bs, af, bf, lane, wm, wn, stage, ks + 1, (ks + 1) % 2)
                mma_step(af, bf, al, bl, acc, ks % 2)
        else:
            for ks in T.unroll(KS):
                load_frags(As, Bs, af, bf, lane, wm, wn, stage, ks, 0)
                mma_step(af, bf, al, bl, acc, 0)


    return SimpleNamespace(mma_chunk=mma_chunk, pp_chunk=pp_chunk, load_frags=load_frags, mma_step=mma_step,
                           compute_chunk=compute_chunk)
