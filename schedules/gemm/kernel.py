"""The implicit GEMM / direct HWNC kernel assembled from its plan (``plan.make_plan``) and pieces.

``build_kernel(plan)`` -> PrimFunc: the helpers, loaders, MMA issue, epilogue and main loops (one factory per module,
each reading the plan) composed into ``body`` and the prim_func of the plan's calling convention. Every size is a
Python constant of the plan, so every knob specialises the kernel (see docs/SCHEDULES.md).
"""
from __future__ import annotations

from types import SimpleNamespace

from tvm.script import tirx as T

from ..planned import placeholder_kernel, planning_only, with_lut_param
from .epilogue import make_epilogue, make_epilogue_parts
from .helpers import make_helpers
from .loaders import make_loaders
from .mainloop import make_stream_loops, make_tile_loops
from .mma import make_mma
from .plan import GemmPlan


def build_kernel(p: GemmPlan):
    """The PrimFunc of plan ``p`` (no legality checks left: ``make_plan`` made them; ``plan_only``: a placeholder)."""
    if planning_only():
        return placeholder_kernel("gemm")
    h = make_helpers(p)
    ld = make_loaders(p, h)
    mm = make_mma(p, h, ld)
    ep = make_epilogue_parts(p, h)
    epi = make_epilogue(p, h, ep)
    lp = SimpleNamespace(**vars(make_stream_loops(p, h, ld, mm, epi)), **vars(make_tile_loops(p, h, ld, mm)))
    return _conv_func(p, h, ep, epi, lp)


def _conv_func(p: GemmPlan, h: SimpleNamespace, ep: SimpleNamespace, epi: SimpleNamespace, lp: SimpleNamespace):
    """The PrimFunc of plan ``p`` from its pieces: ``body`` (launch, buffers, the main loop the plan's flags pick, the
    epilogue) inside the prim_func of its calling convention (split-K gemm, stream-K, residual, plain)."""
    kn, WG, SPLIT, K, Mtot, BM, BN, BK, NTH = p.kn, p.WG, p.SPLIT, p.K, p.Mtot, p.BM, p.BN, p.BK, p.NTH
    NPROD, MT, NT, KS, UNPACK_LD, AREG, W8, AGL = p.NPROD, p.MT, p.NT, p.KS, p.UNPACK_LD, p.AREG, p.W8, p.AGL
    PPK, WSP, NSET, KEEP, MI, AGD, AGW, EMT, A_IT = p.PPK, p.WSP, p.NSET, p.KEEP, p.MI, p.AGD, p.AGW, p.EMT, p.A_IT
    B_IT, EV, GRID_M, GRID_N, HWNC, POINTWISE, x_st = p.B_IT, p.EV, p.GRID_M, p.GRID_N, p.HWNC, p.POINTWISE, p.x_st
    w_st, o_st, xs, ws, os_, HAS_RES, r_st, X_SIZE = p.w_st, p.o_st, p.xs, p.ws, p.os_, p.HAS_RES, p.r_st, p.X_SIZE
    W_SIZE, O_SIZE, B_OFF, SK, PP, PERSIST, NTILES = p.W_SIZE, p.O_SIZE, p.B_OFF, p.SK, p.PP, p.PERSIST, p.NTILES
    GP, STREAM, SK_WORDS, A_ALLOC, B_ALLOC, KEEP_OFF = p.GP, p.STREAM, p.SK_WORDS, p.A_ALLOC, p.B_ALLOC, p.KEEP_OFF
    RBV, RW, PREF, RPN, RSM, OUT_VEC, ACC_T, PIPE = p.RBV, p.RW, p.PREF, p.RPN, p.RSM, p.OUT_VEC, p.ACC_T, p.PIPE
    NFB, res_shape, MINB, MINB_ON, R_SIZE = p.NFB, p.res_shape, p.MINB, p.MINB_ON, p.R_SIZE
    wtile, smem_desc, k_span = h.wtile, h.smem_desc, h.k_span
    AX_N, AX_M = ("blockIdx.y", "blockIdx.x") if p.M_ON_X else ("blockIdx.x", "blockIdx.y")  # (plan.M_ON_X)
    epilogue = epi.epilogue
    res_to_smem = ep.res_to_smem
    persist_areg_loop, persist_loop, pp_loop = lp.persist_areg_loop, lp.persist_loop, lp.pp_loop
    wsp_loop, wg_prologue, areg_loop, wg_loop = lp.wsp_loop, lp.wg_prologue, lp.areg_loop, lp.wg_loop
    sync_pipe1_loop, sync_pipe0_loop = lp.sync_pipe1_loop, lp.sync_pipe0_loop

    @T.macro
    def body(x, w, bias, Mq, Sq, rf, rfw, rq2, of, ofw, skc=None, skw=None):
        bxn = T.launch_thread(AX_N, GP if STREAM else GRID_N)  # (persist, pp: the block index)
        bxm = T.launch_thread(AX_M, 1 if STREAM else GRID_M)
        bz = T.launch_thread("blockIdx.z", SPLIT)  # K-split index (extent 1 without split-K)
        tid = T.launch_thread("threadIdx.x", NTH)
        if MINB_ON:  # __launch_bounds__(NTH, minb): nvcc caps the registers so that minb blocks fit per SM
            T.attr(0, "tirx.launch_bounds_min_blocks_per_sm", MINB)
        xf = T.decl_buffer((X_SIZE,), x_st, data=x.data)
        wf = T.decl_buffer((W_SIZE,), w_st, data=w.data)
        rv = T.alloc_buffer((4 * (A_IT + B_IT),), "uint32", scope="local")  # 4-bit wgmma: packed vectors in flight
        ar = T.alloc_buffer((NSET * KS * MI * 4 if AREG else 1,), "uint32", scope="local")  # areg: A fragments
        pw = T.alloc_buffer((KS if PPK else 2,), "uint32", scope="local")  # areg: packed A words (PPK: a row's)
        pk = T.alloc_buffer((AGD * AGW if AGL else 1,), "uint32", scope="local")  # agl: the packed A register ring
        kal = T.alloc_buffer((1,), "uint32", scope="local")  # KEEP: the fragment sets' last reads
        # wgmma: one byte ring whatever the operand type (TVM names a lone dynamic buffer after it, and kernels of
        # one module must declare it with the same element type)
        As = T.alloc_buffer((A_ALLOC,), "uint8" if WG else x_st, scope="shared.dyn")
        Bs = T.alloc_buffer((B_ALLOC,), w_st, scope="shared.dyn")
        Cs = T.decl_buffer((A_ALLOC // 4,), "int32", data=As.data, scope="shared.dyn")
        Cb = T.decl_buffer((A_ALLOC,), "uint8", data=As.data, scope="shared.dyn")  # erq: the 8-bit staging tile
        af = T.alloc_buffer((NFB * MT * 4,), "uint32", scope="local")
        bf = T.alloc_buffer((NFB * NT * 2,), "uint32", scope="local")
        al = T.alloc_buffer((MT * 8,), "uint32", scope="local")
        bl = T.alloc_buffer((NT * 4,), "uint32", scope="local")
        acc = T.alloc_buffer((EMT * NT * 4,), ACC_T, scope="local")
        ad = T.alloc_buffer((2,), "uint64", scope="local")  # wgmma descriptors of As, Bs (stage 0, tile origin)
        yb = T.alloc_buffer((EV,), "int32", scope="local")
        pb = T.alloc_buffer((EV,), "int32", scope="local")  # this lane's channels: bias, M, S
        pm = T.alloc_buffer((EV,), "int32", scope="local")
        ps = T.alloc_buffer((EV,), "int32", scope="local")
        q2 = T.alloc_buffer((5 * EV,), "int32", scope="local")  # and rq2 (residual stage)
        rb = T.alloc_buffer((RBV,), r_st, scope="local")  # residual bytes
        rbw = T.alloc_buffer((max(RW, 1),), "int32", scope="local")  # or words
        rpre = T.alloc_buffer((RPN if PREF else 1,), "int32", scope="local")  # (PREF) residual words
        ob = T.alloc_buffer((OUT_VEC,), o_st, scope="local")
        sb = T.alloc_buffer((max(EV // 4, 1),), "uint32", scope="local")  # erq: staged bytes (words)
        skn = T.alloc_buffer((1,), "int32", scope="local")  # sk: the tile's arrival count
        # persist, sk: decoded A rows (pointwise addressing needs no decode; with it, 3-7% slower across two calls)
        ri = T.alloc_buffer((3 * A_IT if STREAM and not POINTWISE else 1,), "int32", scope="local")
        ri_ = T.meta_var(None if POINTWISE else ri)
        skt = T.alloc_buffer((4,), "uint32", scope="local")  # sk: another part's partial sums
        warp = tid // 32
        lane = tid % 32
        wm, wn = wtile(warp)  # warp(group) tile coordinates
        m0 = bxm * BM
        n0 = bxn * BN
        for e in T.unroll(EMT * NT * 4):
            acc[e] = T.Cast(ACC_T, 0)
        if KEEP:
            kal[0] = T.uint32(0)
        ksp = T.meta_var(k_span(bz))  # (first K-chunk, number of K-chunks) of this block
        if RSM:  # the residual tile: the oldest cp.async group, so the main loop's first wait covers it
            res_to_smem(rf, As, m0, n0, tid)
            T.ptx.cp.async_.commit_group()
        if WG:
            # ---------------- main loop, wgmma: STG-deep ring, GIF = 1 + pipe MMA groups in flight ----------------
            # iteration kc: chunk kc landed (cp.async) -> proxy fence (generic-proxy writes made visible to wgmma)
            # -> barrier -> MMAs of chunk kc issued asynchronously -> loads of chunk kc+STG-1-GIF into the stage of
            # chunk kc-1-GIF, whose MMAs every warpgroup retired (wait_group GIF at the end of the last iteration)
            # before this barrier
            ad[0] = smem_desc(As)
            ad[1] = ad[0] + T.uint64(B_OFF // 16)
            if PERSIST and AREG:
                persist_areg_loop(bias, Mq, Sq, rf, rfw, rq2, of, ofw, bxn, bz, tid, xf, wf, rv, ar, pw, As, Cs, Cb,
                                  acc, ad, yb, pb, pm, ps, q2, rb, rbw, rpre, ob, sb, ri, ri_, warp, lane, wm, wn)
            elif PERSIST:
                persist_loop(bias, Mq, Sq, rf, rfw, rq2, of, ofw, skc, skw, bxn, bz, tid, xf, wf, rv, ar, As, Cs, Cb,
                             acc, ad, yb, pb, pm, ps, q2, rb, rbw, rpre, ob, sb, skn, ri, ri_, skt, wm, wn)
            elif PP:
                pp_loop(bias, Mq, Sq, rf, rfw, rq2, of, ofw, bxn, bz, tid, xf, wf, rv, ar, pw, As, Cs, Cb, acc, ad,
                        yb, pb, pm, ps, q2, rb, rbw, rpre, ob, sb, ri, ri_, warp, lane)
            elif WSP:
                wsp_loop(tid, xf, wf, rv, ar, As, acc, ad, wm, wn, m0, n0, ksp)
            else:
                wg_prologue(tid, xf, wf, rv, ar, pw, pk, As, warp, lane, wm, m0, n0, ksp)
            areg_loop(tid, xf, wf, rv, ar, pw, pk, kal, As, acc, ad, warp, lane, wm, wn, m0, n0, ksp)
            wg_loop(tid, xf, wf, rv, ar, As, acc, ad, wm, wn, m0, n0, ksp)
            T.ptx.wgmma.wait_group.sync.aligned(0)
            if KEEP:  # every MMA of this warpgroup retired: the fragment sets' last reads, into a word of its own
                for e in T.unroll(NSET * KS * MI * 4):  # (past the ring: the other warpgroup's MMAs may still read it)
                    kal[0] = T.bitwise_xor(kal[0], ar[e])
                Cs[KEEP_OFF // 4 + tid] = T.Cast("int32", kal[0])
            if RSM:  # (covered by the main loop's waits; explicit for a loop without one)
                T.ptx.cp.async_.wait_group(0)
            T.tvm_storage_sync("shared")  # the epilogue's staging buffer may share memory with the ring
        elif PIPE == 1:
            sync_pipe1_loop(tid, xf, wf, rv, As, Bs, af, bf, al, bl, acc, lane, wm, wn, m0, n0, ksp)
        else:
            sync_pipe0_loop(tid, xf, wf, rv, As, Bs, af, bf, al, bl, acc, lane, wm, wn, m0, n0, ksp)
        # ---------------- fused epilogue, staged through shared memory ----------------
        if not STREAM and ((not WSP) or tid < NTH - NPROD):  # (wsp: the producer warpgroup has no accumulators)
            epilogue(bias, Mq, Sq, rf, rfw, rq2, of, ofw, Cs, Cb, acc, pb, pm, ps, q2, rb, rbw, yb, ob, sb, tid, m0, n0, bz,
                     rpre)

    if SPLIT > 1:
        @T.prim_func
        def conv(x: T.Buffer(xs, x_st), w: T.Buffer(ws, w_st), wsp: T.Buffer((SPLIT, Mtot, K), "int32")):
            T.func_attr({"tir.noalias": True})
            of = T.decl_buffer((SPLIT * Mtot * K,), "int32", data=wsp.data)
            body(x, w, None, None, None, None, None, None, of, None)
    else:
        # (parsed unchecked: with a table its buffer is free in the body until with_lut_param adds it, and checks the
        # result either way)
        @T.macro
        def run_res(x, w, bias, Mq, Sq, res, rq2_, out, skc, skw):  # flat views of the residual-add kernel's buffers
            rf = T.decl_buffer((R_SIZE,), r_st, data=res.data)
            rfw = T.decl_buffer((R_SIZE // 4,), "int32", data=res.data)
            rq2 = T.decl_buffer((5 * K,), "int32", data=rq2_.data)
            of = T.decl_buffer((O_SIZE,), o_st, data=out.data)
            ofw = T.decl_buffer((max(O_SIZE // 4, 1),), "uint32", data=out.data)  # (erq, 8-bit out)
            body(x, w, bias, Mq, Sq, rf, rfw, rq2, of, ofw, skc, skw)

        @T.macro
        def run_plain(x, w, bias, Mq, Sq, out, skc, skw):
            of = T.decl_buffer((O_SIZE,), o_st, data=out.data)
            ofw = T.decl_buffer((max(O_SIZE // 4, 1),), "uint32", data=out.data)  # (erq, 8-bit out)
            body(x, w, bias, Mq, Sq, None, None, None, of, ofw, skc, skw)

        # (sk: + skc int32[tiles] before out, zeros on entry and exit, and the workspace skw after it, a second output)
        if SK and HAS_RES:
            @T.prim_func(check_well_formed=False)
            def conv(x: T.Buffer(xs, x_st), w: T.Buffer(ws, w_st), bias: T.Buffer((K,), "int32"),
                     Mq: T.Buffer((K,), "int32"), Sq: T.Buffer((K,), "int32"), res: T.Buffer(res_shape, r_st),
                     rq2_: T.Buffer((5, K), "int32"), skc: T.Buffer((NTILES,), "int32"), out: T.Buffer(os_, o_st),
                     skw: T.Buffer((SK_WORDS,), "int32")):
                T.func_attr({"tir.noalias": True})
                run_res(x, w, bias, Mq, Sq, res, rq2_, out, skc, skw)
        elif SK:
            @T.prim_func(check_well_formed=False)
            def conv(x: T.Buffer(xs, x_st), w: T.Buffer(ws, w_st), bias: T.Buffer((K,), "int32"),
                     Mq: T.Buffer((K,), "int32"), Sq: T.Buffer((K,), "int32"), skc: T.Buffer((NTILES,), "int32"),
                     out: T.Buffer(os_, o_st), skw: T.Buffer((SK_WORDS,), "int32")):
                T.func_attr({"tir.noalias": True})
                run_plain(x, w, bias, Mq, Sq, out, skc, skw)
        elif HAS_RES:
            @T.prim_func(check_well_formed=False)
            def conv(x: T.Buffer(xs, x_st), w: T.Buffer(ws, w_st), bias: T.Buffer((K,), "int32"),
                     Mq: T.Buffer((K,), "int32"), Sq: T.Buffer((K,), "int32"), res: T.Buffer(res_shape, r_st),
                     rq2_: T.Buffer((5, K), "int32"), out: T.Buffer(os_, o_st)):
                T.func_attr({"tir.noalias": True})
                run_res(x, w, bias, Mq, Sq, res, rq2_, out, None, None)
        else:
            @T.prim_func(check_well_formed=False)
            def conv(x: T.Buffer(xs, x_st), w: T.Buffer(ws, w_st), bias: T.Buffer((K,), "int32"),
                     Mq: T.Buffer((K,), "int32"), Sq: T.Buffer((K,), "int32"), out: T.Buffer(os_, o_st)):
                T.func_attr({"tir.noalias": True})
                run_plain(x, w, bias, Mq, Sq, out, None, None)

        conv = with_lut_param(conv, ep.lut, len(conv.params) - (3 if SK else 1))  # (before cnt, out, ws / out)

    if W8 and UNPACK_LD:
        conv = conv.with_attr("qcompile.w8", 1)
    if AGL or PPK:
        conv = conv.with_attr("qcompile.w8_kperm", BK)
    conv = conv.with_attr("qcompile.knobs", str(kn)).with_attr("qcompile.strategy",
                                                           "direct_hwnc" if HWNC else
                                                           ("grouped_gemm" if p.GROUPS > 1 else "implicit_gemm"))
    if SK:  # (tile counters, workspace words): callers pass zeros int32[tiles] before out and get the workspace after it
        conv = conv.with_attr("qcompile.streamk", [NTILES, SK_WORDS])
    return conv.with_attr("qcompile.split_k", SPLIT) if SPLIT > 1 else conv

