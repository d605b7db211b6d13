"""The implicit GEMM's main loops, one macro per loop form; ``kernel.body`` picks one by the plan's flags."""
from __future__ import annotations

from types import SimpleNamespace

from tvm.script import tirx as T

from .plan import GemmPlan


def make_stream_loops(p: GemmPlan, h: SimpleNamespace, ld: SimpleNamespace, mm: SimpleNamespace,
                      epi: SimpleNamespace) -> SimpleNamespace:
    """The main loops of plan ``p`` whose K-chunk stream crosses tiles: persistent, stream-K, ping-pong."""
    STG, NTH, NPROD, NT, KS, PSTG, PD, GIF, MI = p.STG, p.NTH, p.NPROD, p.NT, p.KS, p.PSTG, p.PD, p.GIF, p.MI
    EMT, NK, POINTWISE, ERQ, SK, PPU, PPW, PP_NSET = p.EMT, p.NK, p.POINTWISE, p.ERQ, p.SK, p.PPU, p.PPW, p.PP_NSET
    NTILES, TOTIT, GP, PPD, PP_REGS, ACC_T = p.NTILES, p.TOTIT, p.GP, p.PPD, p.PP_REGS, p.ACC_T
    tile_origin = h.tile_origin
    decode_rows, load_chunk, unpack_chunk, load_afrag = ld.decode_rows, ld.load_chunk, ld.unpack_chunk, ld.load_afrag
    mma_chunk, pp_chunk = mm.mma_chunk, mm.pp_chunk
    epilogue, sk_tile_end = epi.epilogue, epi.sk_tile_end

    @T.macro
    def persist_areg_loop(bias, Mq, Sq, rf, rfw, rq2, of, ofw, bxn, bz, tid, xf, wf, rv, ar, pw, As, Cs, Cb, acc, ad,
                          yb, pb, pm, ps, q2, rb, rbw, rpre, ob, sb, ri, ri_, warp, lane, wm, wn):
        """The persistent chunk stream of the register-A loader (``persist`` with awarp + w8)."""
        # the persistent chunk stream of the register-A loader (awarp + w8): chunk g's packed A in ring slot
        # g % PSTG, its B in stage g % STG, PSTG - 1 chunks in flight across tile boundaries (the next tile's
        # first chunks land while a tile's epilogue runs); the fragment set of chunk g is g % 2 (unrolled by
        # two), chunk g+1's fragments loaded while chunk g's MMAs run -- at a tile's end after its epilogue
        tot = (NTILES - bxn + GP - 1) // GP * NK
        for s0 in T.unroll(PD):
            if s0 < tot:
                o0 = T.meta_var(tile_origin(s0, bxn))
                if not POINTWISE and (s0 == 0 or T.truncmod(s0, NK) == 0):
                    decode_rows(ri, tid, o0[0])
                load_chunk(xf, wf, rv, As, As, tid, o0[0], o0[1], s0, ri_)
            T.ptx.cp.async_.commit_group()
        T.ptx.cp.async_.wait_group(PD - 1)
        T.evaluate(T.cuda.warp_sync())
        load_afrag(ar, pw, As, lane, warp, wm, 0, 0)
        for g2 in T.serial((tot + 1) // 2):
            for par in T.unroll(2):
                g = g2 * 2 + par
                if g < tot:
                    T.ptx.fence.proxy.async_.shared__cta()
                    T.tvm_storage_sync("shared")
                    T.ptx.wgmma.fence.sync.aligned()
                    mma_chunk(acc, ad, ar, wm, wn, g, par)
                    T.ptx.wgmma.commit_group.sync.aligned()
                    if g + PSTG - 1 < tot:  # into chunk g-1's slots (read before this barrier / retired)
                        o1 = T.meta_var(tile_origin(g + PSTG - 1, bxn))
                        if not POINTWISE and T.truncmod(g + PSTG - 1, NK) == 0:
                            decode_rows(ri, tid, o1[0])
                        load_chunk(xf, wf, rv, As, As, tid, o1[0], o1[1], g + PSTG - 1, ri_)
                    T.ptx.cp.async_.commit_group()
                    if g + 1 < tot:
                        T.ptx.cp.async_.wait_group(PSTG - 2)
                        if g % NK != NK - 1:  # the warp's A rows of chunk g+1 -> the other set
                            T.evaluate(T.cuda.warp_sync())
                            load_afrag(ar, pw, As, lane, warp, wm, g + 1, ((par + 1) % 2) * (KS * MI * 4))
                    T.ptx.wgmma.wait_group.sync.aligned(0)
                    if g % NK == NK - 1:  # the tile's last chunk: its epilogue, fresh accumulators
                        o2 = T.meta_var(tile_origin(g, bxn))
                        epilogue(bias, Mq, Sq, rf, rfw, rq2, of, ofw, Cs, Cb, acc, pb, pm, ps, q2, rb, rbw, yb,
                                 ob, sb, tid, o2[0], o2[1], bz, rpre)
                        for e in T.unroll(EMT * NT * 4):
                            acc[e] = T.Cast(ACC_T, 0)
                        if g + 1 < tot:  # (after the epilogue: its registers are not held across it)
                            T.evaluate(T.cuda.warp_sync())
                            load_afrag(ar, pw, As, lane, warp, wm, g + 1, ((par + 1) % 2) * (KS * MI * 4))

    @T.macro
    def persist_loop(bias, Mq, Sq, rf, rfw, rq2, of, ofw, skc, skw, bxn, bz, tid, xf, wf, rv, ar, As, Cs, Cb, acc, ad,
                     yb, pb, pm, ps, q2, rb, rbw, rpre, ob, sb, skn, ri, ri_, skt, wm, wn):
        """The persistent (``persist``) and stream-K (``sk``) chunk streams over the block's tiles."""
        # one K-chunk stream over the block's tiles (chunk g: tile g // NK, K-chunk g % NK, ring stage g % STG):
        # the loads run STG-1-GIF chunks ahead across tile boundaries, so the next tile's first chunks land
        # while this tile's epilogue (staging beside the ring) runs. sk: the stream is the global iterations
        # beg .. beg + tot - 1, and a tile's part ends at its last chunk or at the block's last
        beg = T.meta_var(T.truncdiv(bxn * TOTIT, GP) if SK else 0)
        tot = (T.truncdiv((bxn + 1) * TOTIT, GP) - beg) if SK else (NTILES - bxn + GP - 1) // GP * NK
        for s0 in T.unroll(STG - 1 - GIF):
            if s0 < tot:
                o0 = T.meta_var(tile_origin(beg + s0, bxn))
                if not POINTWISE and (s0 == 0 or T.truncmod(beg + s0, NK) == 0):  # (the loads' tile changes)
                    decode_rows(ri, tid, o0[0])
                load_chunk(xf, wf, rv, As, As, tid, o0[0], o0[1], beg + s0, ri_)
            T.ptx.cp.async_.commit_group()
        for g in T.serial(tot):
            T.ptx.cp.async_.wait_group(STG - 2 - GIF)
            T.ptx.fence.proxy.async_.shared__cta()
            T.tvm_storage_sync("shared")
            T.ptx.wgmma.fence.sync.aligned()
            mma_chunk(acc, ad, ar, wm, wn, beg + g, 0)
            T.ptx.wgmma.commit_group.sync.aligned()
            if g + STG - 1 - GIF < tot:
                o1 = T.meta_var(tile_origin(beg + g + STG - 1 - GIF, bxn))
                if not POINTWISE and T.truncmod(beg + g + STG - 1 - GIF, NK) == 0:
                    decode_rows(ri, tid, o1[0])
                load_chunk(xf, wf, rv, As, As, tid, o1[0], o1[1], beg + g + STG - 1 - GIF, ri_)
            T.ptx.cp.async_.commit_group()
            T.ptx.wgmma.wait_group.sync.aligned(GIF)
            if SK:
                if T.truncmod(beg + g, NK) == NK - 1 or g == tot - 1:  # the end of this block's part of a tile
                    T.ptx.wgmma.wait_group.sync.aligned(0)
                    sk_tile_end(bias, Mq, Sq, rf, rfw, rq2, of, ofw, Cs, Cb, acc, pb, pm, ps, q2, rb, rbw, yb,
                                ob, sb, tid, bz, rpre, skc, skw, skn, skt, bxn, beg, beg + g)
                    for e in T.unroll(EMT * NT * 4):
                        acc[e] = T.Cast(ACC_T, 0)
            elif g % NK == NK - 1:  # the tile's last chunk: its epilogue, then fresh accumulators
                T.ptx.wgmma.wait_group.sync.aligned(0)
                o2 = T.meta_var(tile_origin(g, bxn))
                epilogue(bias, Mq, Sq, rf, rfw, rq2, of, ofw, Cs, Cb, acc, pb, pm, ps, q2, rb, rbw, yb, ob, sb, tid,
                         o2[0], o2[1], bz, rpre)
                for e in T.unroll(EMT * NT * 4):
                    acc[e] = T.Cast(ACC_T, 0)

    @T.macro
    def pp_loop(bias, Mq, Sq, rf, rfw, rq2, of, ofw, bxn, bz, tid, xf, wf, rv, ar, pw, As, Cs, Cb, acc, ad, yb, pb,
                pm, ps, q2, rb, rbw, rpre, ob, sb, ri, ri_, warp, lane):
        """Ping-pong (``pp``): the producer warpgroup and the two consumers, each a whole tile."""
        # ping-pong: named barrier 1 + c * STG + s = stage s full for consumer c, 1 + 2 * STG + s = stage s
        # empty (256 threads each: the producer warpgroup and one consumer). Full barriers are per consumer:
        # with one per stage, a consumer waiting for chunk g + STG could complete the barrier the producer
        # arrived at for chunk g, which the other consumer has not reached yet
        tot = (NTILES - bxn + GP - 1) // GP * NK  # the block's chunks
        if tid >= NTH - NPROD:  # producer
            T.ptx.setmaxnreg.dec.sync.aligned.u32(PP_REGS[0])
            if PPU and not PPW:  # 4-bit: packed ring -> unpacked stage g % STG, published
                for s0 in T.unroll(PSTG):
                    if s0 < tot:
                        o0 = T.meta_var(tile_origin(s0, bxn))
                        if not POINTWISE and s0 % NK == 0:
                            decode_rows(ri, tid - (NTH - NPROD), o0[0])
                        load_chunk(xf, wf, rv, As, As, tid - (NTH - NPROD), o0[0], o0[1], s0, ri_)
                    T.ptx.cp.async_.commit_group()
                for g in T.serial(tot):
                    T.ptx.cp.async_.wait_group(PSTG - 1)  # chunk g landed (this thread's vectors)
                    if g >= STG:  # its stage held chunk g - STG: wait until its consumer retired those MMAs
                        T.evaluate(T.ptx.bar.sync(T.uint32(1 + 2 * STG) + T.Cast("uint32", g % STG),
                                                  T.uint32(256)))
                    unpack_chunk(rv, As, tid - (NTH - NPROD), g)
                    if g + PSTG < tot:  # refill the ring slots just read back
                        o1 = T.meta_var(tile_origin(g + PSTG, bxn))
                        if not POINTWISE and T.truncmod(g + PSTG, NK) == 0:
                            decode_rows(ri, tid - (NTH - NPROD), o1[0])
                        load_chunk(xf, wf, rv, As, As, tid - (NTH - NPROD), o1[0], o1[1], g + PSTG, ri_)
                    T.ptx.cp.async_.commit_group()
                    T.ptx.fence.proxy.async_.shared__cta()  # the unpacked stores, visible to wgmma
                    T.evaluate(T.ptx.bar.arrive(
                        T.uint32(1) + T.Cast("uint32", g // NK % 2 * STG + g % STG), T.uint32(256)))
            else:  # chunk g's loads (once chunk g - STG retired), chunk g - PPD published
                for g in T.serial(tot + PPD):
                    if g < tot:
                        if g >= STG:
                            T.evaluate(T.ptx.bar.sync(T.uint32(1 + 2 * STG) + T.Cast("uint32", g % STG),
                                                      T.uint32(256)))
                        o0 = T.meta_var(tile_origin(g, bxn))
                        if not POINTWISE and g % NK == 0:
                            decode_rows(ri, tid - (NTH - NPROD), o0[0])
                        load_chunk(xf, wf, rv, As, As, tid - (NTH - NPROD), o0[0], o0[1], g, ri_)
                    T.ptx.cp.async_.commit_group()
                    if g >= PPD:  # chunk g - PPD landed (this thread's copies), visible to wgmma, published
                        T.ptx.cp.async_.wait_group(PPD)
                        if PPW:  # (4-bit: its A, this thread's packed vectors, unpacked into the stage)
                            unpack_chunk(rv, As, tid - (NTH - NPROD), g - PPD)
                        T.ptx.fence.proxy.async_.shared__cta()
                        T.evaluate(T.ptx.bar.arrive(
                            T.uint32(1) + T.Cast("uint32", (g - PPD) // NK % 2 * STG + (g - PPD) % STG),
                            T.uint32(256)))
        else:  # consumer c = tid // 128: tiles c, c + 2, ... of the block; chunk g = tile * NK + kc
            T.ptx.setmaxnreg.inc.sync.aligned.u32(PP_REGS[1])
            for t2 in T.serial((tot // NK - tid // 128 + 1) // 2):
                tb = (t2 * 2 + tid // 128) * NK  # the tile's first chunk
                # chunk 0 peeled: its scale-d 0 a constant, so ptxas knows the first wgmma reads no
                # accumulators (they are dead from the last tile's epilogue on, nothing to zero); 4-bit with
                # pipe 0: chunk kc's A fragments in register set kc % 2 (unrolled by two), loaded while chunk
                # kc - 1's MMAs (the other set) run
                pp_chunk(acc, ad, ar, pw, As, lane, warp, tid, tb, 0, 0, 0, tot)
                if PP_NSET == 2:
                    for kc2 in T.serial(NK // 2):
                        for par in T.unroll(2):
                            if 1 + kc2 * 2 + par < NK:
                                pp_chunk(acc, ad, ar, pw, As, lane, warp, tid, tb, 1 + kc2 * 2 + par,
                                         (1 + par) % 2, 1, tot)
                else:
                    for kc in T.serial(1, NK):
                        pp_chunk(acc, ad, ar, pw, As, lane, warp, tid, tb, kc, 0, 1, tot)
                T.ptx.wgmma.wait_group.sync.aligned(0)
                for j in T.unroll(GIF):  # the tile's last GIF chunks
                    if NK - GIF + j >= 0:
                        if tb + NK - GIF + j + STG < tot:
                            T.evaluate(T.ptx.bar.arrive(T.uint32(1 + 2 * STG) + T.Cast(
                                "uint32", (tb + NK - GIF + j) % STG), T.uint32(256)))
                o2 = T.meta_var(tile_origin(tb, bxn))
                epilogue(bias, Mq, Sq, rf, rfw, rq2, of, ofw, Cs, Cb, acc, pb, pm, ps, q2, rb, rbw, yb, ob, sb,
                         tid, o2[0], o2[1], bz, rpre)
                # the next tile's sums: started by its first chunk's scale-d 0, not zeroed here (zeroed, nvcc
                # copies one zero register into the accumulators between the first chunk's wgmmas and ptxas
                # serializes those: "C7517 warpgroup.wait is injected"). erq keeps the zeroing: not zeroed,
                # the accumulators stay live through its epilogue, which then spills (128x128: 16 bytes, with
                # the residual 584 instead of 276; the first chunk's constant scale-d 0 does not change that)
                if ERQ:
                    for e in T.unroll(EMT * NT * 4):
                        acc[e] = T.Cast(ACC_T, 0)


    return SimpleNamespace(persist_areg_loop=persist_areg_loop, persist_loop=persist_loop, pp_loop=pp_loop)


def make_tile_loops(p: GemmPlan, h: SimpleNamespace, ld: SimpleNamespace, mm: SimpleNamespace) -> SimpleNamespace:
    """The main loops of plan ``p`` over one tile's K-chunks: wsp, register A, wgmma, mma.sync."""
    STG, NTH, NPROD, KS, UNPACK_LD, PSTG, PRING = p.STG, p.NTH, p.NPROD, p.KS, p.UNPACK_LD, p.PSTG, p.PRING
    AREG, PD, AWARP, W8, AGL, WSP, NSET, KEEP, GIF = p.AREG, p.PD, p.AWARP, p.W8, p.AGL, p.WSP, p.NSET, p.KEEP, p.GIF
    MI, AGD, UNR, use_async, MAIN_UNROLL, STREAM = p.MI, p.AGD, p.UNR, p.use_async, p.MAIN_UNROLL, p.STREAM
    unpack_afrag, load_chunk, store_chunk = ld.unpack_afrag, ld.load_chunk, ld.store_chunk
    unpack_chunk, load_afrag = ld.unpack_chunk, ld.load_afrag
    mma_chunk, compute_chunk = mm.mma_chunk, mm.compute_chunk

    @T.macro
    def wsp_loop(tid, xf, wf, rv, ar, As, acc, ad, wm, wn, m0, n0, ksp):
        """Warp-specialized 4-bit loading (``wsp``): producer warpgroups unpack into the stages."""
        # warp-specialized: named barrier 1 + s = stage s full (the producer arrives after unpacking a chunk
        # into it), 1 + STG + s = stage s empty (the consumers arrive when its MMAs have retired)
        if tid >= NTH - NPROD:  # producer warpgroups: packed ring of PSTG chunks (cp.async, one group per chunk)
            for s0 in T.unroll(PSTG):
                if s0 < ksp[1]:
                    load_chunk(xf, wf, rv, As, As, tid - (NTH - NPROD), m0, n0, ksp[0] + s0)
                T.ptx.cp.async_.commit_group()
            for kc in T.serial(ksp[1]):
                T.ptx.cp.async_.wait_group(PSTG - 1)  # chunk kc landed (this thread's vectors)
                if kc >= STG:  # its stage held chunk kc-STG: wait until every consumer retired those MMAs
                    T.evaluate(T.ptx.bar.sync(T.uint32(1 + STG) + T.Cast("uint32", kc % STG), T.uint32(NTH)))
                unpack_chunk(rv, As, tid - (NTH - NPROD), ksp[0] + kc)
                if kc + PSTG < ksp[1]:  # refill the ring slots just read back
                    load_chunk(xf, wf, rv, As, As, tid - (NTH - NPROD), m0, n0, ksp[0] + kc + PSTG)
                T.ptx.cp.async_.commit_group()
                T.ptx.fence.proxy.async_.shared__cta()  # the unpacked stores, visible to wgmma
                T.evaluate(T.ptx.bar.arrive(T.uint32(1) + T.Cast("uint32", kc % STG), T.uint32(NTH)))
        else:  # consumers: wait full, MMAs, and once chunk kc-GIF retired its stage is empty
            for kc in T.serial(ksp[1]):
                T.evaluate(T.ptx.bar.sync(T.uint32(1) + T.Cast("uint32", kc % STG), T.uint32(NTH)))
                T.ptx.wgmma.fence.sync.aligned()
                mma_chunk(acc, ad, ar, wm, wn, ksp[0] + kc, 0)
                T.ptx.wgmma.commit_group.sync.aligned()
                T.ptx.wgmma.wait_group.sync.aligned(GIF)
                if kc >= GIF and kc - GIF + STG < ksp[1]:  # (only the arrivals the producer waits for)
                    T.evaluate(T.ptx.bar.arrive(T.uint32(1 + STG) + T.Cast("uint32", (kc - GIF) % STG),
                                                T.uint32(NTH)))
            # (closed inside the branch: left open across the join, ptxas serializes every wgmma)
            T.ptx.wgmma.wait_group.sync.aligned(0)

    @T.macro
    def wg_prologue(tid, xf, wf, rv, ar, pw, pk, As, warp, lane, wm, m0, n0, ksp):
        """The wgmma loops' prologue: the first chunks in flight (packed ring / register pipeline / plain)."""
        if PRING:  # packed ring (areg: A ring + B slots): chunks 0 .. PD-1 in flight, chunk 0 (its B) unpacked
            for s0 in T.unroll(PD):
                if s0 < ksp[1]:
                    load_chunk(xf, wf, rv, As, As, tid, m0, n0, ksp[0] + s0, None, pk, s0)
                T.ptx.cp.async_.commit_group()
            if ksp[1] > 0:
                T.ptx.cp.async_.wait_group(PD - 1)
                if not W8:  # (w8: nothing to unpack, B went straight into its stage)
                    unpack_chunk(rv, As, tid, ksp[0])
                if AGL:  # chunk 0's A words (ring slot 0) -> fragment set 0
                    unpack_afrag(ar, pk, 0, 0)
                elif AWARP:  # chunk 0's A rows (copied by this warp) -> fragment set 0
                    T.evaluate(T.cuda.warp_sync())
                    load_afrag(ar, pw, As, lane, warp, wm, ksp[0], 0)
            if not AREG:  # chunk 0's slots refilled at once (each thread consumed the vectors it copied)
                if PSTG < ksp[1]:
                    load_chunk(xf, wf, rv, As, As, tid, m0, n0, ksp[0] + PSTG)
                T.ptx.cp.async_.commit_group()
        elif UNPACK_LD:  # register pipeline: chunk j is loaded in iteration j-2 and stored in iteration j-1
            if ksp[1] > 0:
                load_chunk(xf, wf, rv, As, As, tid, m0, n0, ksp[0])
                store_chunk(rv, As, As, tid, ksp[0])
            if ksp[1] > 1:
                load_chunk(xf, wf, rv, As, As, tid, m0, n0, ksp[0] + 1)
        else:
            for s0 in T.unroll(STG - 1 - GIF):
                if s0 < ksp[1]:
                    load_chunk(xf, wf, rv, As, As, tid, m0, n0, ksp[0] + s0)
                T.ptx.cp.async_.commit_group()

    @T.macro
    def areg_loop(tid, xf, wf, rv, ar, pw, pk, kal, As, acc, ad, warp, lane, wm, wn, m0, n0, ksp):
        """The register-A main loop (areg / awarp / agl), unrolled so fragment sets are constants."""
        if AREG and not STREAM:  # unrolled by two: the A-fragment register set of chunk kc is kc % NSET, a constant
            # (agl: by lcm(NSET, AGD), so that chunk kc's register ring slot kc % AGD is a constant too; with pipe 0
            # three fragment sets: chunk kc+1's is unpacked while chunks kc and kc-1 may still be running)
            for kc2 in T.serial((ksp[1] + UNR - 1) // UNR):
                for par in T.unroll(UNR):
                    kc = kc2 * UNR + par
                    if kc < ksp[1]:
                        T.ptx.fence.proxy.async_.shared__cta()
                        T.tvm_storage_sync("shared")
                        if not AWARP:  # set par % NSET: its last MMAs (chunk kc-NSET) retired by the wait below
                            load_afrag(ar, pw, As, lane, warp, wm, ksp[0] + kc, (par % NSET) * (KS * MI * 4))
                        T.ptx.wgmma.fence.sync.aligned()
                        mma_chunk(acc, ad, ar, wm, wn, ksp[0] + kc, par % NSET)
                        T.ptx.wgmma.commit_group.sync.aligned()
                        # chunk kc+PSTG-1 into the stages of chunk kc-1: its A was read by every thread before
                        # this iteration's barrier, its B slots were unpacked (by their own thread) in iteration kc-2
                        if kc + PSTG - 1 < ksp[1]:  # (agl: A into the ring slot of chunk kc, unpacked already)
                            load_chunk(xf, wf, rv, As, As, tid, m0, n0, ksp[0] + kc + PSTG - 1, None, pk,
                                       (par + PSTG - 1) % max(AGD, 1))
                        T.ptx.cp.async_.commit_group()
                        # chunk kc+1 landed (the next barrier publishes its A); its B into the stage of chunk
                        # kc+1-STG, retired by every warpgroup before this iteration's barrier (STG >= 2 + GIF)
                        if kc + 1 < ksp[1]:
                            T.ptx.cp.async_.wait_group(PSTG - 2)
                            if not W8:
                                unpack_chunk(rv, As, tid, ksp[0] + kc + 1)
                            if AGL:  # chunk kc+1's A words (waits for their loads) -> the other set
                                unpack_afrag(ar, pk, (par + 1) % AGD, ((par + 1) % NSET) * (KS * MI * 4))
                            elif AWARP:  # the warp's A rows of chunk kc+1 landed: its fragments into the other set
                                T.evaluate(T.cuda.warp_sync())
                                load_afrag(ar, pw, As, lane, warp, wm, ksp[0] + kc + 1,
                                           ((par + 1) % 2) * (KS * MI * 4))
                        T.ptx.wgmma.wait_group.sync.aligned(GIF)
                        if KEEP:  # chunk kc-GIF retired: the last read of its fragment set (see KEEP)
                            for e in T.unroll(KS * MI * 4):
                                kal[0] = T.bitwise_xor(kal[0], ar[((par + NSET - GIF) % NSET) * (KS * MI * 4) + e])

    @T.macro
    def wg_loop(tid, xf, wf, rv, ar, As, acc, ad, wm, wn, m0, n0, ksp):
        """The wgmma main loop through shared-memory descriptors (8-bit, packed ring, register pipeline)."""
        for kc in T.serial(0 if (AREG or WSP or STREAM) else ksp[1], unroll=MAIN_UNROLL):
            if not UNPACK_LD:
                T.ptx.cp.async_.wait_group(STG - 2 - GIF)
            T.ptx.fence.proxy.async_.shared__cta()
            T.tvm_storage_sync("shared")
            T.ptx.wgmma.fence.sync.aligned()
            mma_chunk(acc, ad, ar, wm, wn, ksp[0] + kc, 0)
            T.ptx.wgmma.commit_group.sync.aligned()
            if PRING:  # while the MMAs run: unpack chunk kc+1 (stage of chunk kc+1-STG, retired), refill its slots
                if kc + 1 < ksp[1]:
                    T.ptx.cp.async_.wait_group(PSTG - 1)  # one group per chunk: kc+1 landed, kc+2.. in flight
                    unpack_chunk(rv, As, tid, ksp[0] + kc + 1)
                    if kc + 1 + PSTG < ksp[1]:
                        load_chunk(xf, wf, rv, As, As, tid, m0, n0, ksp[0] + kc + 1 + PSTG)
                T.ptx.cp.async_.commit_group()
            elif UNPACK_LD:  # stage of chunk kc+1 held chunk kc+1-STG, retired (STG >= 2 + GIF)
                if kc + 1 < ksp[1]:
                    store_chunk(rv, As, As, tid, ksp[0] + kc + 1)
                if kc + 2 < ksp[1]:
                    load_chunk(xf, wf, rv, As, As, tid, m0, n0, ksp[0] + kc + 2)
            else:
                if kc + STG - 1 - GIF < ksp[1]:
                    load_chunk(xf, wf, rv, As, As, tid, m0, n0, ksp[0] + kc + STG - 1 - GIF)
                T.ptx.cp.async_.commit_group()
            T.ptx.wgmma.wait_group.sync.aligned(GIF)

    @T.macro
    def sync_pipe1_loop(tid, xf, wf, rv, As, Bs, af, bf, al, bl, acc, lane, wm, wn, m0, n0, ksp):
        """mma.sync, pipe 1: an STG-deep ring, one barrier per K-chunk."""
        # ---------------- main loop: STG-deep ring, one barrier per K-chunk ----------------
        # prologue: chunks 0 .. STG-2 in flight
        for s0 in T.unroll(STG - 1):
            if s0 < ksp[1]:
                load_chunk(xf, wf, rv, As, Bs, tid, m0, n0, ksp[0] + s0)
            if use_async:
                T.ptx.cp.async_.commit_group()
        for kc in T.serial(ksp[1]):
            # chunk kc has landed (at most STG-2 newer groups pending) and, after the barrier, every warp
            # is done with chunk kc-1, whose stage the load below refills
            if use_async:
                T.ptx.cp.async_.wait_group(STG - 2)
            T.tvm_storage_sync("shared")
            if kc + STG - 1 < ksp[1]:
                load_chunk(xf, wf, rv, As, Bs, tid, m0, n0, ksp[0] + kc + STG - 1)
            if use_async:
                T.ptx.cp.async_.commit_group()
            compute_chunk(As, Bs, af, bf, al, bl, acc, lane, wm, wn, (ksp[0] + kc) % STG)
        T.tvm_storage_sync("shared")  # the epilogue's staging buffer may share memory with the ring

    @T.macro
    def sync_pipe0_loop(tid, xf, wf, rv, As, Bs, af, bf, al, bl, acc, lane, wm, wn, m0, n0, ksp):
        """mma.sync, pipe 0: loads issued before the wait, two barriers per K-chunk."""
        # ---------------- main loop, pipe 0: loads issued before the wait, two barriers per K-chunk ----------
        for kc in T.serial(ksp[1] + STG - 1):
            if kc < ksp[1]:
                load_chunk(xf, wf, rv, As, Bs, tid, m0, n0, ksp[0] + kc)
            if use_async:
                T.ptx.cp.async_.commit_group()
                T.ptx.cp.async_.wait_group(STG - 1)
            T.tvm_storage_sync("shared")
            if kc >= STG - 1:
                compute_chunk(As, Bs, af, bf, al, bl, acc, lane, wm, wn, (ksp[0] + kc - (STG - 1)) % STG)
            T.tvm_storage_sync("shared")


    return SimpleNamespace(wsp_loop=wsp_loop, wg_prologue=wg_prologue, areg_loop=areg_loop, wg_loop=wg_loop,
                           sync_pipe1_loop=sync_pipe1_loop, sync_pipe0_loop=sync_pipe0_loop)
