"""The implicit GEMM's index and arithmetic helpers: functions that build PrimExprs from a ``GemmPlan``."""
from __future__ import annotations

from types import SimpleNamespace

from tvm.script import tirx as T

from .plan import GemmPlan

_MASK_HI = 0xF0F0F0F0


def requant_stage1(t, m_v, s_v, shift_ge33: bool, zo: int, lo: int, hi: int, rel: bool = False):
    """Stage 1 of the epilogue on ``t = acc + bias`` (int32 PrimExprs; ``m_v``, ``s_v`` the channel's M and S):
    out = clip(round(t * M / 2^S) + zo, lo, hi) in int64 fixed point (int32 ops when every S >= 33, ``shift_ge33``);
    ``rel``: out - lo (the residual stage folds lo into its constant)."""
    if shift_ge33:
        # every S >= 33: (t*M + 2^(S-1)) >> S == (hi32(t*M) + 2^(S-33)) >> (S-32), all int32 (mul.hi)
        # (t is int32, wrapping like the reference; written as a 64-bit product TVM distributes the cast over
        # t's sum and nvcc multiplies in 64 bits: ~7 instructions per element instead of one IMAD.HI)
        hi32 = T.call_pure_extern("int32", "__mulhi", t, m_v)
        # shift amount clamped to [1, 30] (a no-op for 33 <= S <= 62): with an unbounded shift TVM's
        # integer-bound analysis narrows the result and drops the clip below
        sh = T.max(T.min(s_v - 32, T.int32(30)), T.int32(1))
        v = T.shift_right(hi32 + T.shift_left(T.int32(1), sh - 1), sh)
        wd = "int32"
    else:
        v = T.Cast("int64", t) * T.Cast("int64", m_v)
        v = T.shift_right(v + T.shift_left(T.int64(1), T.Cast("int64", s_v - 1)), T.Cast("int64", s_v))
        wd = "int64"
    if rel:  # y1 - lo = clip(v + zo - lo, 0, hi - lo): one add-min-max (VIADDMNMX.RELU) instead of two
        return T.max(T.min(v + T.IntImm(wd, zo - lo), T.IntImm(wd, hi - lo)), T.IntImm(wd, 0))
    return T.max(T.min(v + T.IntImm(wd, zo), T.IntImm(wd, hi)), T.IntImm(wd, lo))

def make_helpers(p: GemmPlan) -> SimpleNamespace:
    """The index arithmetic and PrimExpr helpers of the kernel of plan ``p`` (plain Python functions building PrimExprs)."""
    spec, WG, SPLIT, N, H, W, K, R, S, P, Q, CB = p.spec, p.WG, p.SPLIT, p.N, p.H, p.W, p.K, p.R, p.S, p.P, p.Q, p.CB
    BM, BN, BK, WN, NTH, LNTH, UNPACK_LD, PSTG = p.BM, p.BN, p.BK, p.WN, p.NTH, p.LNTH, p.UNPACK_LD, p.PSTG
    BKP, AW, SBO, LBO, LAYOUT_TYPE, INS_N, VEC, VPR = p.BKP, p.AW, p.SBO, p.LBO, p.LAYOUT_TYPE, p.INS_N, p.VEC, p.VPR
    NK, CPS, EV, GRID_N, HWNC, acc_shift, HAS_RES = p.NK, p.CPS, p.EV, p.GRID_N, p.HWNC, p.acc_shift, p.HAS_RES
    RB, RSIGNED, zo, lo, hi, AWP, PA_OFF, P_OFF = p.RB, p.RSIGNED, p.zo, p.lo, p.hi, p.AWP, p.PA_OFF, p.P_OFF
    PV_IT, SK, PP, TOTIT, GP, NACC, CS_IT, RW = p.PV_IT, p.SK, p.PP, p.TOTIT, p.GP, p.NACC, p.CS_IT, p.RW
    RP_ALL, XCB, GROUPS, KG = p.RP_ALL, p.XCB, p.GROUPS, p.KG

    def cs_col(c):
        return c + 4 * (c // 32)

    MASK = T.uint32(_MASK_HI)

    def wtile(warp):
        """(wm, wn): the warp(group) tile of ``warp`` (pp: each consumer a whole tile)."""
        g = 0 if PP else (warp // 4 if WG else warp)
        return (g // WN, g % WN)

    def row_decode(m):  # (truncating division: m >= 0, and TVM's floor division adds sign fix-ups per division)
        dv, md = T.truncdiv, T.truncmod
        if HWNC:
            return (md(m, N), dv(dv(m, N), Q), md(dv(m, N), Q))
        return (dv(m, P * Q), md(dv(m, Q), P), md(m, Q))

    def x_index(n, ih, iw, cb):
        if HWNC:
            return ((ih * W + iw) * N + n) * CB + cb
        return ((n * H + ih) * W + iw) * XCB + cb

    def group_at(gidx, n0):
        """A grouped conv (``GROUPS`` > 1): input byte ``gidx`` of the tile's group, whose first output channel is
        ``n0`` (channel base (n0 // Kg) * Cg); ``gidx`` itself otherwise."""
        if GROUPS == 1:
            return gidx
        return gidx + T.truncdiv(n0, KG) * CB

    def w_index(k, kb, cb=CB):  # (w8: kb counts the expanded bytes, cb = 2 * CB of them per tap)
        if HWNC:
            return ((kb // cb) * K + k) * cb + kb % cb
        return k * (R * S * cb) + kb

    def requant1(a, bias_v, m_v, s_v, rel=False):
        """Stage 1 on accumulator ``a`` (``requant_stage1``; Hopper INT4 accumulators unshifted first)."""
        return requant_stage1(unshift(a) + bias_v, m_v, s_v, spec.shift_ge33, zo, lo, hi, rel)

    def requant2(v, q2, e, res_v, vlo=0):
        """With a residual, stage 2 on stage 1's value y1 = ``v + vlo``: the quantized residual add (see ConvSpec; int32
        when the graph's own residual requantize is int32: no intermediate can overflow then, so int32 gives the same
        bits)."""
        if HAS_RES:
            wd = "int32" if spec.res_i32 else "int64"
            c = lambda x: T.Cast(wd, x)
            if spec.rq2_uniform:  # the same for every channel (per-tensor activation scales): immediates, with the
                # constant terms in one addend -- (lo + c1) M1 + c2 M2 + 2^(S2-1) -- so that the two products are two
                # multiply-adds (equal bits in int32 too: the sum is the same mod 2^32 and, res_i32, fits int32)
                c1, m1, c2, m2, s2 = (int(u) for u in spec.rq2_uniform)
                k0 = (vlo + c1) * m1 + c2 * m2 + (1 << (s2 - 1))
                if wd == "int32":
                    k0 = (k0 + (1 << 31)) % (1 << 32) - (1 << 31)
                v = c(v) * T.IntImm(wd, m1) + (c(res_v) * T.IntImm(wd, m2) + T.IntImm(wd, k0))
                # (the shift stays a shift: as a multiply-high by 2^(32-S2) -- read at run time, or nvcc makes it a
                # shift again -- it moves an ALU instruction to the multiply pipe, and the conv + residual runs 1-5% slower
                # on the H100: IMAD.HI costs more than SHF)
                v = T.shift_right(v, T.IntImm(wd, s2))
            else:
                p = [c(q2[j * EV + e]) for j in range(5)]
                v = (c(v) + (p[0] + c(vlo) if vlo else p[0])) * p[1] + (c(res_v) + p[2]) * p[3]
                v = T.shift_right(v + T.shift_left(c(1), p[4] - c(1)), p[4])
            v = T.max(T.min(v + c(spec.zo2), c(spec.hi2)), c(spec.lo2))
        return T.Cast("int32", v)

    def requant(a, bias_v, m_v, s_v, q2, e, res_v):
        return requant2(requant1(a, bias_v, m_v, s_v, rel=HAS_RES), q2, e, res_v, vlo=lo)

    def rp_at(i, j):  # word j of row block i's prefetched residual words (RP_ALL: every block's held at once)
        return i * (CS_IT * RW) + j if RP_ALL else j

    def unshift(a):  # Hopper INT4 accumulators hold 256 x the sum
        return T.shift_right(a, acc_shift) if acc_shift else a

    def tile_slot(L, rows):
        """(row, 16-byte column, byte offset in a stage of ``rows`` rows) of loader vector L: consecutive lanes
        take consecutive 16-byte columns of a row (coalesced; the swizzle keeps each quarter-warp's stores in
        distinct banks)."""
        row, kv = L // VPR, L % VPR
        if WG:
            return row, kv, tile_off(row, kv * (2 if UNPACK_LD else 1), rows)
        return row, kv, row * BKP + kv * VEC

    def tile_off(row, c, rows, aw=AW):  # swizzled byte offset of 16-byte chunk c of a row (wgmma tiles)
        w = aw // 16
        swz = T.bitwise_and(T.shift_right(row * aw, 7), w - 1)
        return (c // w) * (rows * aw) + row * aw + T.bitwise_xor(c % w, swz) * 16

    def nib_lo(w):  # the even nibbles of packed word w, x16 (in the high half of each byte): s8/u8 MMA operand bytes
        return T.bitwise_and(T.shift_left(w, T.uint32(4)), MASK)

    def nib_hi(w):  # the odd nibbles, x16
        return T.bitwise_and(w, MASK)

    def rot16(w):  # agl8: the word's 16-bit halves swapped (bytes b2 b3 b0 b1)
        return T.bitwise_or(T.shift_left(w, T.uint32(16)), T.shift_right(w, T.uint32(16)))

    def unpack_store(S_, soff_lo, soff_hi, rv, v):
        """Packed vector v (rv[4v:4v+4]: 16 bytes, 32 nibbles) -> two 16-byte s8/u8 chunks: even nibbles x16, odd
        nibbles x16."""
        lo = [nib_lo(rv[v * 4 + e]) for e in range(4)]
        hi = [nib_hi(rv[v * 4 + e]) for e in range(4)]
        return (T.ptx.st.shared.v4.b32(T.address_of(S_[soff_lo]), *lo),
                T.ptx.st.shared.v4.b32(T.address_of(S_[soff_hi]), *hi))

    def kstep_off(ks, rows):  # byte offset of k32 step ks in a swizzled stage of ``rows`` rows
        return (ks * 32 // AW) * (rows * AW) + (ks * 32) % AW

    def wg_mma(acc, base, adesc, bdesc, ar=None, scale_d=1):
        """One wgmma.mma_async m64nINS_Nk32 on accumulator registers acc[base : base + INS_N/2]; A from the shared
        tile of descriptor ``adesc``, or with ``ar`` from registers ar[adesc : adesc + 4]. ``scale_d`` (int32
        expression) 0: the sum starts here (D = A*B, the registers' old values ignored), else D += A*B."""
        a_t = "s8" if spec.x_signed else "u8"
        op = T.ptx[f"wgmma.mma_async.sync.aligned.m64n{INS_N}k32.s32.{a_t}.s8"]
        a = [ar[adesc + r] for r in range(4)] if ar is not None else [adesc]
        return op(*[acc[base + r] for r in range(INS_N // 2)], *a, bdesc, T.ptx.pred(scale_d))

    def smem_desc(buf):
        """wgmma matrix descriptor of a shared tile: start >> 4 | LBO >> 4 << 16 | SBO >> 4 << 32 | layout << 62."""
        addr = T.Cast("uint64", T.shift_right(T.cuda.cvta_generic_to_shared(buf.access_ptr("r")), 4))
        fields = T.uint64(((LBO // 16) << 16) | ((SBO // 16) << 32))
        return T.bitwise_or(T.bitwise_or(addr, fields), T.shift_left(T.uint64(LAYOUT_TYPE), T.uint64(62)))

    def acc_u32(acc, idx):
        return acc[idx] if WG else T.reinterpret("uint32", acc[idx])

    def acc_i32(acc, idx):
        return T.reinterpret("int32", acc[idx]) if WG else acc[idx]

    def ld_staged(sb, addr, n=None):
        """erq: this lane's ``n`` (default EV) staged bytes -> sb (one 4/8/16-byte ld.shared)."""
        n = n or EV
        if n == 16:
            return T.ptx.ld.shared.v4.b32(sb[0], sb[1], sb[2], sb[3], addr)
        if n == 8:
            return T.ptx.ld.shared.v2.b32(sb[0], sb[1], addr)
        return T.ptx.ld.shared.b32(sb[0], addr)

    def staged(sb, e):
        """erq: staged byte e of this lane (stage 1's value, sign-extended when its range is signed)."""
        v = T.Cast("int32", T.bitwise_and(T.shift_right(sb[e // 4], T.uint32(8 * (e % 4))), T.uint32(255)))
        return T.if_then_else(v >= 128, v - 256, v) if lo < 0 else v

    def tile_origin(g, bid):
        """persist: (m0, n0) of the tile that K-chunk ``g`` of block ``bid``'s chunk stream belongs to (sk: ``g`` is
        the global iteration, tile g // NK)."""
        tile = T.truncdiv(g, NK) if SK else bid + (g // NK) * GP
        return ((tile // GRID_N) * BM, (tile % GRID_N) * BN)

    def sk_block_of(G):  # sk: the block whose iterations include global iteration G
        return T.truncdiv((G + 1) * GP - 1, TOTIT)

    def sk_slot(b, t):  # sk: block b's workspace slot for its part of tile t (0: its first tile, 1: its last)
        return b * 2 + T.if_then_else(T.truncdiv(T.truncdiv(b * TOTIT, GP), NK) == t, 0, 1)

    def sk_word(slot, r4, tid):  # sk: word of accumulator quad r4 of thread tid in a slot (warp-coalesced 16 bytes)
        return ((slot * (NACC // 4) + r4) * NTH + tid) * 4

    def k_span(bz):
        if SPLIT == 1:
            return (0, NK)
        return (bz * CPS, T.max(T.min(CPS, NK - bz * CPS), 0))

    def res_base(m, k):  # first residual byte of output element (m, k)
        return (m * K + k) // 2 if RB == 4 else m * K + k

    def res_value(rb, rbw, e):
        """Residual value of this lane's element e from its loaded bytes ``rb`` (or words ``rbw``)."""
        if not HAS_RES:
            return T.int32(0)
        if RW:
            per = 32 // RB  # elements per word
            w, j = rbw[e // per], e % per  # (e: an unrolled loop's variable, folded to constants later)
            if RSIGNED:  # the field shifted to the top, then arithmetically down: one shift on the ALU pipe (the left
                # shift is a multiply) instead of shift, mask, compare and select
                top = T.Cast("int32", T.shift_left(T.Cast("uint32", w), T.Cast("uint32", 32 - RB * (j + 1))))
                return T.shift_right(top, 32 - RB)
            # unsigned: a byte permute (PRMT) of the word -- its 4-bit fields first masked to their bytes, the even
            # and odd ones apart (two masks per word, shared by its elements) -- one ALU instruction per element
            # instead of a shift and a mask
            if RB == 4:
                w = T.bitwise_and(T.shift_right(w, (j % 2) * 4), T.int32(0x0F0F0F0F))
            sel = 0x4440 + (j // 2 if RB == 4 else j)
            return T.Cast("int32", T.call_pure_extern("uint32", "__byte_perm", T.Cast("uint32", w), T.uint32(0),
                                                      T.Cast("uint32", sel)))
        if RB == 4:
            nib = T.bitwise_and(T.shift_right(T.Cast("int32", rb[e // 2]), (e % 2) * 4), 15)
            if RSIGNED:
                return T.if_then_else(nib >= 8, nib - 16, nib)
            return nib
        return T.Cast("int32", rb[e])

    def a_cp(As, xf, soff, gidx, ok):
        if VEC == 16:
            return T.ptx.cp.async_.cg.shared.global_(
                T.address_of(As[soff]), T.address_of(xf[T.if_then_else(ok, gidx, 0)]), 16,
                T.if_then_else(ok, T.uint32(16), T.uint32(0)))
        return T.ptx.cp.async_.ca.shared.global_(
            T.address_of(As[soff]), T.address_of(xf[T.if_then_else(ok, gidx, 0)]), VEC,
            T.if_then_else(ok, T.uint32(VEC), T.uint32(0)))

    def p_slot(kc, v, tid):  # byte offset of packed vector v of this thread for chunk kc (packed ring)
        return P_OFF + (((kc % PSTG) * PV_IT + v) * LNTH + tid) * 16

    def pa_off(kc, row, c):  # areg: byte offset of packed 16-byte chunk c of A row ``row`` of chunk kc
        return PA_OFF + (kc % PSTG) * (BM * BK) + tile_off(row, c, BM, AWP)


    return SimpleNamespace(cs_col=cs_col, wtile=wtile, row_decode=row_decode, x_index=x_index, group_at=group_at,
                           w_index=w_index,
                           requant1=requant1, requant2=requant2, requant=requant, rp_at=rp_at, unshift=unshift,
                           tile_slot=tile_slot, tile_off=tile_off, nib_lo=nib_lo, nib_hi=nib_hi, rot16=rot16,
                           unpack_store=unpack_store, kstep_off=kstep_off, wg_mma=wg_mma, smem_desc=smem_desc,
                           acc_u32=acc_u32, acc_i32=acc_i32, ld_staged=ld_staged, staged=staged, tile_origin=tile_origin,
                           sk_block_of=sk_block_of, sk_slot=sk_slot, sk_word=sk_word, k_span=k_span, res_base=res_base,
                           res_value=res_value, a_cp=a_cp, p_slot=p_slot, pa_off=pa_off)
