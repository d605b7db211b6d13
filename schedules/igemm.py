"""Tensor-core integer conv2d as a TIR kernel generator (implicit GEMM NHWC and direct HWNC).

Both strategies share one parametrised TIR template (written in TVMScript, all sizes are Python
constants closed over by the script, so every knob specialises the kernel):

  GEMM rows m   = output pixels x batch (NHWC: m = (n, p, q); HWNC direct: m = (p, q, n), so an MMA
                  tile spans 16 batch elements of one output pixel)
  GEMM cols     = output channels k
  GEMM K (bytes)= (r, s, c) with c innermost; the im2col matrix is never materialised: each thread
                  gathers 16-byte channel vectors straight from x into shared memory with cp.async
                  (zero-filled outside the image) or plain loads (pad_value != 0, odd channel counts).

Main loop (``mma="sync"``): ``stages``-deep cp.async ring in dynamic shared memory, ldmatrix.x4 fragments from
padded rows (row pitch BK+16 bytes: conflict-free ldmatrix), mma.sync from the per-arch table.
Main loop (``mma="wgmma"``, sm_90a): the same ring in 128-byte-swizzled K-major atoms, read by
wgmma.mma_async through shared-memory descriptors, one barrier per K-chunk after a
``fence.proxy.async.shared::cta``; 4-bit tiles reach the ring unpacked to 8 bits: loaded packed into registers and
stored unpacked, or through a packed ring (``pstages``), or, with ``w8``, as weights expanded at compile time (see
docs/SCHEDULES.md, "Warpgroup MMA on Hopper" and "4-bit operands on wgmma: the loaders").

INT4: operands stay packed (4-bit) in global and shared memory and in the ldmatrix fragments.
  * native (sm_75/80/86/89): mma .s4/.u4 (m16n8k64, or m8n8k32 on Turing)
  * Hopper (sm_90): each 32-bit fragment word (8 nibbles) becomes two s8 words with one AND and one
    SHL+AND: ``hi = w & 0xF0F0F0F0`` holds the odd elements as 16*v, ``lo = (w << 4) & 0xF0F0F0F0`` the
    even ones. A and B are split the same way, so every k slot still pairs matching elements; the
    int32 accumulator holds 256 * sum (exact, |256 * 15 * 8 * Kred| < 2^31 for Kred < 69905) and the
    epilogue shifts it back (arithmetic >> 8). Unsigned 4-bit activations use .u8.

Epilogue (fused, per warp): accumulators -> padded shared tile (16 x warp-N int32 at a time) ->
each lane takes ``ev`` consecutive channels of a row: + bias, int64 fixed-point requant, zero point,
clip, optionally the second (residual-add) requantize stage of ConvSpec, cast/pack -> one vector
store per lane, rows written contiguously (coalesced), every output element written exactly once.
"""
from __future__ import annotations

import math

from tvm.script import tirx as T

from .spec import ConvSpec, GemmKnobs, arch_info, tile_grid

_MASK_HI = 0xF0F0F0F0


class NotApplicable(Exception):
    pass


def _mma_dtype(dtype_bits: int, signed: bool) -> str:
    return ("int" if signed else "uint") + str(dtype_bits)


def gemm_constraints(spec: ConvSpec, arch: str, layout: str) -> str | None:
    """Return None if the tensor-core template can take this spec, else the reason."""
    if spec.x_bits != spec.w_bits:
        return "activation and weight widths differ"
    if spec.x_bits == 4 and spec.C % 2:
        return "4-bit channels must be even (packed)"
    if spec.out_bits == 4 and spec.K % 2:
        return "4-bit output channels must be even"
    if layout == "HWNC":
        if spec.N % 8:
            return "direct HWNC needs batch % 8 == 0 (MMA M tile over N)"
        cb = spec.C * spec.x_bits // 8
        if cb % 32:
            return "direct HWNC needs channel bytes % 32 == 0 (MMA K tile over C)"
        if spec.K % 8:
            return "direct HWNC needs K % 8 == 0 (MMA N tile)"
    if spec.x_bits == 4 and not arch_info(arch).s4_native:
        kred = spec.R * spec.S * spec.C
        if kred >= 69905:
            return "Kred too large for the x256-scaled int4->s8 accumulation"
    return None


def _pick_vec(cb: int, want: int) -> int:
    v = want
    while v > 1 and cb % v:
        v //= 2
    return v


def _pick_ev(spec: ConvSpec, want: int) -> int:
    ev = want
    while ev > 1 and spec.K % ev:
        ev //= 2
    if spec.out_bits == 4 and ev < 2:
        raise NotApplicable("4-bit output needs even K")
    return ev


def _adapt_knobs(spec: ConvSpec, kn: GemmKnobs, layout: str) -> GemmKnobs:
    """Shrink the block tile for small problems (keeps the grid busy), fix vector widths."""
    Mtot = spec.N * spec.P * spec.Q
    cb = spec.C * spec.x_bits // 8
    vec = _pick_vec(cb, kn.vec)
    if spec.pad_value != 0 and vec > 1:
        pass  # plain-load path keeps vector width, pads with pad_value
    BM, BN, WM, WN = kn.BM, kn.BN, kn.WM, kn.WN
    lo = 64 if kn.mma == "wgmma" else 32  # smallest warp(group) tile side
    while BN > lo and BN // 2 >= spec.K:
        BN = BN // 2 if BN & (BN - 1) == 0 else lo  # (96 / 112: to the smallest tile)
    while BM > lo and BM // 2 >= Mtot:
        BM //= 2
    WM = max(1, min(WM, BM // lo))
    WN = max(1, min(WN, BN // lo))
    BK = kn.BK
    kn = kn.replace(BM=BM, BN=BN, WM=WM, WN=WN, vec=vec, BK=BK)
    # keep every thread busy with whole vectors
    while not kn.whole_vectors(BK):
        BK *= 2
    return kn.replace(BK=BK)


def split_factor(spec: ConvSpec, arch: str, kn: GemmKnobs) -> int:
    """K-split of a conv with (adapted) knobs ``kn``: the knob, or schedules/splitk.py's rule when it is 0."""
    from .splitk import auto_split

    if kn.split_k:
        return kn.split_k
    if (kn.sk or kn.pp) and kn.mma == "wgmma" and spec.x_bits == 8:  # stream-K, ping-pong: the grid fills the GPU
        return 1
    blocks = tile_grid(spec, kn.BM, kn.BN)
    nk = -(-(spec.R * spec.S * spec.C * spec.x_bits // 8) // kn.BK)
    return auto_split(spec, arch, blocks, nk)


def staging_pitch(wtn: int) -> int:
    """int32 words per row of a warp's epilogue staging tile for a warp tile ``wtn`` columns wide (column c at word
    c + 4 * (c // 32): see make_gemm_conv), rounded to 8 mod 32."""
    return -(-(wtn + 4 * (wtn // 32) - 8) // 32) * 32 + 8


def streamk_args(func):
    """[tiles, workspace words] of a stream-K kernel (``GemmKnobs.sk``), else None. Its parameters are the plain
    kernel's with ``skc`` int32[tiles] before ``out`` (zeros on entry; the kernel leaves them zero) and ``skw``
    int32[workspace words] after it (scratch: a second output to Relax)."""
    a = func.attrs
    return [int(v) for v in a["qcompile.streamk"]] if a is not None and "qcompile.streamk" in a else None


def w8_weights(func) -> bool:
    """Whether kernel ``func`` takes its 4-bit weights expanded (``GemmKnobs.w8``: pass
    ``reference.expand_w4(w)``, int8 [..., C], instead of the packed int8 [..., C/2])."""
    a = func.attrs
    return a is not None and "qcompile.w8" in a


def w8_kperm(func) -> int:
    """The K-chunk (bytes of the operand in memory) whose k permutation kernel ``func``'s weights take
    (``GemmKnobs.agl``: pass ``reference.expand_w4(w, kperm)`` for 4-bit weights, ``reference.permute_k8(w, kperm)``
    for 8-bit ones), else 0."""
    a = func.attrs
    return int(a["qcompile.w8_kperm"]) if a is not None and "qcompile.w8_kperm" in a else 0


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


def make_gemm_conv(spec: ConvSpec, arch: str = "sm_90", knobs: GemmKnobs | None = None,
                   layout: str | None = None, adapt: bool = True, allow_split: bool = False):
    """Build the tensor-core PrimFunc. ``layout`` "NHWC" = implicit GEMM, "HWNC" = direct.

    With ``allow_split`` and a split factor > 1 (``split_factor``) it is the first kernel of a split-K pair
    (params x, w, ws int32[split, M, K]; attribute ``qcompile.split_k``), see schedules/splitk.py."""
    from .spec import DEFAULT_KNOBS

    layout = layout or spec.layout
    if layout != spec.layout:
        raise NotApplicable(f"spec layout {spec.layout} != strategy layout {layout}")
    why = gemm_constraints(spec, arch, layout)
    if why:
        raise NotApplicable(why)
    ai = arch_info(arch)
    kn = knobs or DEFAULT_KNOBS.get(arch, DEFAULT_KNOBS["sm_90"])
    if adapt:
        kn = _adapt_knobs(spec, kn, layout)
    if not kn.valid():
        raise NotApplicable(f"invalid knobs {kn}")
    WG = kn.mma == "wgmma"
    if WG:
        if not ai.wgmma:
            raise NotApplicable(f"wgmma needs sm_90a, not {arch}")
        if spec.pad_value != 0 or kn.vec != 16:
            raise NotApplicable("wgmma tiles are filled by 16-byte cp.async (channel bytes % 16 == 0, zero padding)")
    SPLIT = split_factor(spec, arch, kn) if allow_split else 1

    # ---------------- constants ----------------
    N, H, W, C, K, R, S = spec.N, spec.H, spec.W, spec.C, spec.K, spec.R, spec.S
    P, Q = spec.P, spec.Q
    sh, sw = spec.strides
    dh, dw = spec.dilations
    pt, pl, _, _ = spec.pads
    xbits = spec.x_bits
    CB = C * xbits // 8  # channel bytes
    GKB = R * S * CB  # reduction length in bytes
    Mtot = N * P * Q
    BM, BN, BK, WM, WN, STG = kn.BM, kn.BN, kn.BK, kn.WM, kn.WN, kn.stages
    NTH = kn.threads
    LNTH = kn.load_threads  # threads that load (and unpack) the tiles
    NPROD = 128 * (kn.wsp or kn.pp)  # wsp, pp: producer threads (the last warpgroups)
    NWARP = (NTH - NPROD) // 32  # warps with accumulators (wsp: the consumers)
    WTM, WTN = BM // WM, BN // WN
    MT, NT = WTM // 16, WTN // 8
    KS = (2 * BK if WG and spec.x_bits == 4 else BK) // 32  # 32-byte k-steps per chunk (of the MMA operand bytes)
    # shared tiles: mma.sync reads padded rows (pitch BK+16 bytes: conflict-free ldmatrix). wgmma reads swizzled
    # K-major atoms: AW-byte rows (AW = min(BK, 128): the 32/64/128-byte swizzle mode), 16-byte chunk c of row r
    # stored at chunk c ^ ((r * AW >> 7) & (AW / 16 - 1)); a K-chunk of BK > 128 bytes is BK/128 such atom columns, each
    # holding all rows of the tile. Descriptor: 8-row groups SBO = 8*AW bytes apart (LBO unused when swizzled).
    # (The no-swizzle "interleaved" layout runs 2x slower on the H100.)
    # wgmma has no 4-bit operands: 4-bit tiles are loaded packed (16 bytes = 32 values per vector, half the global
    # traffic) into registers and stored unpacked to s8/u8 (x16, the nibble-split of the mma.sync path: even values
    # in one 16-byte chunk, odd values in the next; A and B permuted alike), so a stage row holds UBK = 2*BK bytes
    # in registers one chunk ahead (pstages 0), or through a pstages-deep ring of packed tiles filled by cp.async
    # (each thread later reads back, unpacks and stores the very vectors it copied: its own cp.async.wait_group
    # makes them visible, no barrier; global latency is hidden by the ring instead of held in registers)
    UNPACK_LD = WG and spec.x_bits == 4
    # agl8: agl (below) on 8-bit operands -- the same register-A loader with nothing to unpack (a thread's A words are
    # its fragments, two per k-step and row), the 8-bit weights k-permuted alike (reference.permute_k8); the areg /
    # awarp / w8 / pstages knobs it requires mean what they mean for 4-bit (w8: B is an 8-bit operand anyway)
    AGL8 = WG and spec.x_bits == 8 and bool(kn.agl)
    REGA = UNPACK_LD or AGL8  # the register-A loader family
    PSTG = kn.pstages if REGA else 0
    PRING = PSTG > 0
    # areg: the A tile is copied packed (cp.async) into a PSTG-deep swizzled ring shared by the block, and each
    # thread reads its wgmma A fragment from it (two 32-bit words per m64 instruction and k-step: rows g and g+8,
    # packed bytes 4q..4q+3 of the step) and unpacks it in registers for the register-A form of wgmma; only B is
    # stored unpacked. (A's unpacked stores and wgmma's shared-memory reads of A are gone: less shared traffic.)
    AREG = REGA and kn.areg
    PD = PSTG - 1 if AREG else PSTG  # packed chunks the prologue puts in flight (areg: A's stage frees one later)
    # awarp: each warp copies the packed A rows (16 per m64 instruction) its own fragments read, so their arrival
    # needs only the warp's cp.async.wait_group + __syncwarp, not the block barrier: chunk kc+1's fragments are
    # loaded into the other register set while chunk kc's MMAs run (pipe -1: chunk kc-1's MMAs have retired)
    AWARP = AREG and kn.awarp
    # w8: the weights come expanded to 8 bits (reference.expand_w4: x16, nibble-split order) and go into the B stages
    # by cp.async like 8-bit ones (no packed B slots, no B unpack); B of chunk j lands in stage j % STG when chunk j's
    # A is copied (PSTG - 1 chunks ahead), so the stage must have retired chunk j - STG by then: STG >= PSTG + GIF
    # (GemmKnobs.valid, checked above, requires areg and those stages)
    # (or, pp with the producer unpacking -- no areg -- the same expanded B copied by the producer into the stages,
    # A alone unpacked from its packed ring: PPW below)
    W8 = (AREG or (UNPACK_LD and bool(kn.pp) and not kn.areg)) and bool(kn.w8)
    # agl (w8 + awarp): no A ring at all -- each thread loads the packed words of its own wgmma A fragments from global
    # memory into a register ring AGD = pstages-1 chunks deep, unpacked one chunk ahead of its MMAs. Within a K-chunk
    # thread q = lane % 4 takes packed bytes [q*BK/4, (q+1)*BK/4) of its rows g and g+8 (one 8- or 16-byte load per
    # 16 bytes) and uses their word j at k-step j, where the plain fragment order has bytes 16j+4q..16j+4q+3: the
    # expanded weights take the same permutation (reference.expand_w4(w, kperm=BK)), so the sums are unchanged
    AGL = W8 and AWARP and bool(kn.agl)
    # (agl on the register-A ping-pong, PPK below: the packed A rows still go through the shared ring, but each
    # thread reads them in agl's k order -- its BK/4 bytes of a row in one 8/16-byte ld.shared instead of one 4-byte
    # load per k-step -- and the expanded weights take agl's permutation)
    PPK = UNPACK_LD and W8 and AREG and not AWARP and bool(kn.pp and kn.agl)  # (the rest pp needs: checked at PP)
    if kn.agl and REGA and (not (AGL or PPK) or layout != "NHWC" or GKB % BK):
        raise NotApplicable("agl needs w8 + awarp (or the register-A ping-pong), NHWC and whole K-chunks "
                            "(R*S*C*bits/8 % BK == 0)")
    WSP = bool(UNPACK_LD and kn.wsp)  # warp-specialized (see GemmKnobs.wsp)
    NSET = 2 if (kn.pipe == 0 or AWARP) else 1  # areg: A-fragment register sets (chunk kc+1's loaded during kc's MMAs)
    if AGL and kn.pipe == 0:  # agl with a group in flight: chunk kc+1's set is neither kc's nor kc-1's
        NSET = 3
    # KEEP (agl, pipe 0): ptxas treats a register-A wgmma's fragment registers as free once the instruction issues, and
    # can give the set of chunk kc+1 the physical registers of chunk kc's set while chunk kc is in flight (without
    # KEEP: a few wrong outputs on the 64x64 tile, H100). Each set is therefore read once more after the wait that
    # retires its chunk (XORed into a word per thread stored past the tiles in shared memory), so the three sets stay
    # live, and distinct, across their MMAs
    # (agl8: with pipe -1 too, and with fragments computed from the loaded words, not copied: see unpack_afrag)
    KEEP = AGL and (kn.pipe == 0 or AGL8)
    if kn.areg and REGA and (PSTG < 2 or kn.pipe not in (-1, 0)):
        raise NotApplicable("areg needs pstages >= 2 and pipe -1 or 0")
    if kn.awarp and REGA and (not AREG or kn.pipe not in ((-1, 0) if kn.agl else (-1,)) or kn.WN != 1):
        raise NotApplicable("awarp needs areg, pipe -1 (agl: or 0) and WN == 1")
    if kn.wsp and not UNPACK_LD:
        raise NotApplicable("wsp is a 4-bit wgmma loader")
    if WSP and (AREG or PSTG < 2 or kn.stages < 2 or kn.pipe not in (-1, 0) or 2 * kn.stages > 15):
        raise NotApplicable("wsp needs pstages >= 2, 2 <= stages <= 7, pipe -1 or 0, no areg")
    UBK = 2 * BK if UNPACK_LD else BK
    if AGL8 and (kn.BN * BK) % (kn.vec * LNTH):  # (GemmKnobs.whole_vectors counts agl's B as 4-bit's, 2 BK per row)
        raise NotApplicable(f"agl8: the B tile of {kn.BN} x {BK} bytes is not whole 16-byte vectors per thread")
    BKP = UBK if WG else BK + 16
    AW = min(UBK, 128)
    SBO, LBO = 8 * AW, 16
    LAYOUT_TYPE = {32: 3, 64: 2, 128: 1}.get(AW, 0)  # descriptor bits 62-63
    GIF = 1 + kn.pipe if WG else 0  # wgmma: MMA groups (K-chunks) in flight
    MI = WTM // 64  # wgmma: m64 instructions per warpgroup tile
    AGD = PSTG - 1  # agl: chunks in the register ring
    APV = min(16, BK // 4)  # agl: bytes per load
    NAV = BK // 4 // APV  # agl: loads per row and chunk
    AG_IT = MI * 2 * NAV  # agl: loads per thread and chunk
    AGW = AG_IT * APV // 4  # agl: ring words per chunk
    UNR = math.lcm(NSET, AGD) if AGL else 2  # the register-A main loop's unroll
    INS_N = min(WTN, 128)  # wgmma: N of one instruction
    NI = WTN // INS_N
    EMT = MI if WG else MT  # 16-row accumulator blocks per warp (the epilogue's row loop)
    VEC = kn.vec
    VPR = BK // VEC  # vectors per tile row
    A_IT = BM * BK // VEC // LNTH
    B_IT = BN * (UBK if W8 else BK) // VEC // LNTH
    NK = (GKB + BK - 1) // BK
    CPS = -(-NK // SPLIT)  # K-chunks per split
    PAD = spec.pad_value
    # the byte stored at a padded position: 4-bit inputs are packed, so the pad value fills both nibbles
    PAD_BYTE = (PAD & 0xF) * 0x11 if spec.x_bits == 4 else PAD
    if spec.x_bits == 4 and spec.x_dtype == "int4" and PAD_BYTE > 127:
        PAD_BYTE -= 256
    use_async = VEC >= 4 and PAD == 0 and ai.has_cp_async
    if WG and kn.stages < 3 + kn.pipe:
        raise NotApplicable("the wgmma loop keeps 1 + pipe MMA groups in flight: stages >= 3 + pipe")
    if not use_async:
        STG = max(2, min(STG, 2))
    EV = _pick_ev(spec, kn.ev)
    # epilogue staging: column c of a row at word c + 4*(c // 32) (a lane's EV <= 16 columns never straddle a
    # 32-column group), pitch = 8 mod 32 words. The accumulator stores (8-byte pairs, rows g / g+8) stay
    # conflict-free, and so do the 16-byte loads of the read-back: without the skew lanes l and l+4 of a
    # quarter-warp (columns 8l and 8l+32) hit the same banks, a 2-way conflict on every read-back load
    CSP = staging_pitch(WTN)

    def cs_col(c):
        return c + 4 * (c // 32)

    GRID_M = (Mtot + BM - 1) // BM
    GRID_N = (K + BN - 1) // BN
    HWNC = layout == "HWNC"
    # 1x1, stride 1, no padding: the implicit GEMM's A is the input itself, [N*H*W, C] in NHWC and HWNC alike
    POINTWISE = R == 1 and S == 1 and (sh, sw) == (1, 1) and tuple(spec.pads) == (0, 0, 0, 0) and (P, Q) == (H, W)
    # (with the short pointwise addressing nvcc unrolls a long K loop whole and keeps every chunk's addresses live:
    # 167 instead of 116 registers on r50_l3_1x1c, one block per SM, 24% slower; unrolled by two: 106)
    MAIN_UNROLL = 2 if POINTWISE else None
    # MMA instruction(s) per 16x8x32-byte macro step
    is4 = xbits == 4
    unpack = is4 and not ai.s4_native
    shp = ai.s4 if is4 else ai.s8
    if unpack:
        shp = ai.s8
    a_ty = _mma_dtype(8 if (unpack or not is4) else 4, spec.x_signed)
    b_ty = _mma_dtype(8 if (unpack or not is4) else 4, True)
    SUB_M = 16 // shp.m  # 1 or 2
    SUB_K = 32 // shp.k_bytes  # 1 or 2
    MMA = shp.ptx
    acc_shift = 8 if unpack else 0

    x_st, w_st = ConvSpec.storage(spec.x_dtype), ("int8")
    o_st = ConvSpec.storage(spec.out_dtype)
    xs, ws, os_ = spec.shapes()
    if W8:
        ws = ws[:-1] + (C,)
    OB = spec.out_bits
    HAS_RES = spec.has_residual
    r_st = ConvSpec.storage(spec.res_dtype)
    RB = spec.res_bits
    RSIGNED = spec.res_signed
    zo, lo, hi = spec.zo, spec.lo, spec.hi
    if OB == 32 and not HAS_RES:
        lo, hi = max(lo, -(1 << 31)), min(hi, (1 << 31) - 1)
    olo, ohi = (spec.lo2, spec.hi2) if HAS_RES else (lo, hi)  # the range of the values stored
    X_SIZE = math.prod(xs)
    W_SIZE = math.prod(ws)
    O_SIZE = math.prod(os_)
    SMEM_A = 0 if AREG else STG * BM * BKP
    SMEM_B = STG * BN * BKP
    SMEM_C = NWARP * 16 * CSP  # int32 words of the epilogue's staging tiles
    # wgmma: A and B stages live in one buffer (B at B_OFF); as two buffers TVM's shared-memory planner overlapped
    # them (the descriptors' access_ptr outside the loop is the only use it sees of Bs's lifetime)
    B_OFF = SMEM_A if WG else 0
    AWP = min(BK, 128)  # areg: the packed A ring's swizzle atom (row bytes, up to 128)
    PA_OFF = SMEM_A + SMEM_B  # areg: packed A ring, PSTG stages of BM x BK bytes
    SMEM_PA = PSTG * BM * BK if AREG and not AGL else 0
    # 4-bit wgmma with pstages: the per-thread packed ring, vector (stage, v, tid) at 16 bytes each (B only with areg)
    P_OFF = PA_OFF + SMEM_PA
    PV_IT = (0 if AREG else A_IT) if W8 else (B_IT if AREG else A_IT + B_IT)  # (pp + w8: A only)
    SMEM_P = PSTG * PV_IT * LNTH * 16
    SMEM_ALL = SMEM_A + SMEM_B + SMEM_PA + SMEM_P
    # erq: stage 1 of the requantize runs on the accumulator registers (each lane: rows g / g+8, column pairs
    # 8j + 2q); the staging tile holds its 8-bit result, CPB = WTN + 16 bytes per row (16-byte aligned read-back;
    # the 2-byte stores of rows g = 0..7 land 4 banks apart). Needs stage 1's clamp range to fit a byte.
    # (a hint: where it cannot apply -- split-K partial sums, an intermediate wider than a byte, fewer than 4 output
    # channels per lane -- the int32 staging computes the same bits; the tuner only proposes it where it applies)
    ERQ = (bool(kn.erq) and SPLIT == 1 and EV % 4 == 0
           and ((lo >= -128 and hi <= 127) or (lo >= 0 and hi <= 255)))
    # erq with 4-bit output (no residual): stage 1's two adjacent columns of a lane packed into one byte as they are
    # staged, so the staging tile holds the packed output (half of each row) and the read-back copies it out like the
    # 8-bit one, with no per-element nibble packing in the read-back
    ERQ4 = ERQ and OB == 4 and not HAS_RES and EV % 8 == 0 and K % 8 == 0
    CPB = WTN + 16
    STAGE_BYTES = NWARP * 16 * CPB if ERQ else 4 * SMEM_C
    # persist: GP blocks walk the tiles (tile = block + t * GP, output channels fastest); the staging tile lives
    # beside the ring at C_OFF, since the next tile's loads are in flight while a tile's epilogue runs
    # (split-K pairs and the 4-bit loaders: one block per tile, the same bits)
    # sk (stream-K, a persistent grid too): block b runs the (tile, K-chunk) iterations [b*TOTIT//GP, (b+1)*TOTIT//GP)
    # of the tile-major order (tile = G // NK, output channels fastest); a tile whose chunks span blocks is summed by
    # its owner, the block holding its first chunk (int32 partials through the workspace skw, counted in skc)
    SK = bool(kn.sk) and SPLIT == 1 and WG and not UNPACK_LD
    # pp (ping-pong): a persistent grid of one block per SM; the producer warpgroup (the last) streams the block's
    # K-chunks (chunk g: tile bid + (g // NK) * GP, K-chunk g % NK, stage g % STG) into the ring; consumer warpgroup c
    # runs the block's tiles c, c + 2, ... (chunks of tile i go to consumer i % 2), each a whole tile. 4-bit: the
    # register-A kernel with expanded weights (w8), packed A chunk g in ring slot g % STG beside its B stage
    PP4 = UNPACK_LD and W8 and not AWARP and PSTG == STG and kn.pipe in (-1, 0)
    # (or the producer unpacks A and B from its packed ring into the shared stages, as wsp's producers do: the
    # consumers then read both operands through descriptors, as in the 8-bit kernel)
    PPU = UNPACK_LD and not AREG and PSTG >= 2 and kn.pipe in (-1, 0)
    # (with w8, "PPW": the producer copies the expanded weights straight into the B stages and unpacks only A, in the
    # 8-bit producer's loop -- chunk g's copies issued into stage g % STG and ring slot g % PSTG, chunk g - PPD's A
    # unpacked into its stage once landed, then published -- so the ring holds PPD + 1 chunks: PSTG >= STG - GIF)
    PPW = PPU and W8
    PP = bool(kn.pp) and WG and SPLIT == 1 and (not UNPACK_LD or PP4 or PPU)
    if kn.pp and WG and (not PP or AGL8 or (kn.agl and not PPK) or kn.WM * kn.WN != 1 or STG > 5
                         or (PPW and PSTG < STG - 1 - kn.pipe)):
        raise NotApplicable("pp: one warpgroup tile, stages <= 5, no split-K, no agl; 4-bit with pstages >= 2 (the "
                            "producer unpacks; with w8 pstages >= stages - 1 - pipe) or as the register-A kernel with "
                            "w8, pipe -1 or 0 and pstages == stages (agl: only that one)")
    PP_NSET = 2 if PP and AREG and kn.pipe == 0 else 1  # pp, register A: fragment sets per consumer
    # (4-bit: the register-A loader with warp-owned rows and expanded weights, whose B is copied like an 8-bit operand)
    PERSIST = (bool(kn.persist) or SK) and SPLIT == 1 and WG and (not UNPACK_LD or (W8 and AWARP and not SK))
    NTILES = GRID_M * GRID_N
    TOTIT = NTILES * NK
    GP = (min(TOTIT, kn.sk * ai.sms) if SK else min(NTILES, kn.persist * ai.sms)) if PERSIST else (
        min(NTILES, ai.sms) if PP else 0)
    STREAM = PERSIST or PP  # the block's K-chunks are one stream across its tiles
    PPD = STG - 1 - GIF  # pp: chunks the producer has in flight before it publishes one
    # pp: registers per thread of the producer / the consumers (setmaxnreg; 128 x 56 + 256 x 224 <= 64K): the 168 of
    # __launch_bounds__(384, 1) left a 128x128 consumer with erq spilling
    PP_REGS = (56, 224)
    NACC = EMT * NT * 4  # accumulator registers per thread
    SK_WORDS = GP * 2 * NTH * NACC if SK else 0  # workspace: per block a head and a tail partial tile
    if SK and (TOTIT + 1) * GP >= 1 << 31:
        raise NotApplicable(f"stream-K: {TOTIT} iterations x {GP} blocks overflow int32 index arithmetic")
    C_OFF = -(-SMEM_ALL // 16) * 16 if STREAM else 0
    if WG and max(SMEM_ALL, C_OFF + STAGE_BYTES) > ai.smem_per_block:  # the staging tile: on the ring or beside it
        raise NotApplicable(f"{max(SMEM_ALL, C_OFF + STAGE_BYTES) // 1024} KiB of shared tiles exceed the "
                            f"{ai.smem_per_block // 1024} KiB per block of {arch}")
    NRES = (kn.sk if SK else kn.persist) if PERSIST else 0  # blocks per SM the persistent grid assumes
    if PERSIST and NRES * (C_OFF + STAGE_BYTES + 1024) > ai.smem_per_block + 1024:  # (1 KiB reserved per block)
        raise NotApplicable(f"{'sk' if SK else 'persist'}={NRES}: {NRES} blocks of {(C_OFF + STAGE_BYTES) // 1024} "
                            f"KiB do not fit one SM of {arch}")
    # the epilogue's staging tile aliases the A ring (after the main loop's last barrier) or sits beside it: declared
    # as a view of As, since its stores are opaque st.shared that TVM's shared-memory planner cannot place on their own
    A_ALLOC, B_ALLOC = ((max(SMEM_ALL, C_OFF + STAGE_BYTES), 16) if WG else (max(SMEM_A, STAGE_BYTES), SMEM_B))
    KEEP_OFF = -(-A_ALLOC // 16) * 16  # KEEP: a word per thread past everything else (a ring stage may still be read)
    if KEEP:
        A_ALLOC = KEEP_OFF + 4 * NTH
        if A_ALLOC > ai.smem_per_block:
            raise NotApplicable(f"{A_ALLOC // 1024} KiB of shared tiles exceed the {ai.smem_per_block // 1024} KiB "
                                f"per block of {arch}")
    CS_IT = 16 * WTN // (32 * EV)
    LPR = WTN // EV  # lanes per staged row
    HOIST = 32 % LPR == 0  # then a lane's output channels do not change between the rows it writes
    PV = min(4, EV)  # vector width (int32 elements) of the per-channel parameter loads
    RBV = max(1, EV * spec.res_bits // 8)  # residual bytes per lane and row
    RW = RBV // 4 if RBV % 4 == 0 else 0  # ... as 32-bit words (vector-loadable)
    # the residual words of a lane's CS_IT rows are loaded together before the staging round trip (one DRAM latency
    # per 16-row block instead of one per row: as loads beside their use they leave r50_l1_1x1b with a residual add
    # at 2.7x the time without one) and the read-back loop is unrolled to keep them in registers
    PREF = HAS_RES and RW in (1, 2, 4) and SPLIT == 1
    # the residual words of every row block at the epilogue's start (its row-block loop unrolled) where a thread holds
    # >= 128 accumulators: there the per-block loop (T.serial) indexes the accumulators with the loop variable and
    # nvcc moves them to the stack (128x128 one-warpgroup 8-bit tiles: 560-byte frame, 32-64 spill stores; H100,
    # ResNet-50 INT8 batch 256: layer3/layer4 conv3+residual 143 -> 111 / 110 -> 75 us). Narrower tiles keep the
    # per-block loop: unrolled, their epilogues run 3-20% slower (layer1/2 INT8, every 4-bit residual layer)
    RP_ALL = PREF and EMT > 1 and EMT * NT * 4 >= 128
    RPN = CS_IT * RW * (EMT if RP_ALL else 1)
    # RSM: the block's residual tile copied into shared memory (cp.async, its own group, issued before the first
    # K-chunk's loads) and read from there by the epilogue: its DRAM latency runs under the main loop instead of
    # after it, without holding registers across the loop (one-tile blocks, 16-byte rows of the tile). H100, ResNet-50
    # batch 256: 4-bit layer4 conv3+residual 71 -> 64 us, 8-bit layer1 257 -> 250 us, the others within 1%: the rest
    # of the residual layers' cost over their conv alone is the residual stage's arithmetic, not the load
    RPB = BN * RB // 8  # residual bytes per tile row
    RES_OFF = -(-A_ALLOC // 16) * 16
    RSM = (PREF and not RP_ALL and WG and not STREAM and not SK and not WSP and RPB % 16 == 0
           and (K * RB // 8) % 16 == 0 and RES_OFF + BM * RPB <= ai.smem_per_block
           and (ai.smem_per_block + 1024) // (RES_OFF + BM * RPB + 1024)  # blocks per SM the shared tiles allow:
           >= min((ai.smem_per_block + 1024) // (A_ALLOC + 1024), kn.minb or 2))  # no fewer than minb (2) or before
    RIT = -(-(BM * RPB // 16) // NTH)  # RSM: 16-byte copies per thread
    if RSM:
        A_ALLOC = RES_OFF + BM * RPB
    assert CS_IT * 32 * EV == 16 * WTN, (WTN, EV)
    OUT_VEC = EV * OB // 8 if OB < 32 else EV  # storage elements per lane store
    OSV = min(OUT_VEC, 128 // OB) if OB >= 8 else OUT_VEC  # ... per vector store (16 bytes at most)
    MASK = T.uint32(_MASK_HI)
    ACC_T = "uint32" if WG else "int32"  # wgmma accumulators are .s32 in u32 carrier registers
    # one K-chunk: nothing to pipeline, and without the loop TVM's shared-memory planner may overlap As and Bs
    # (with pipe=1 and NK == 1: wrong results); the pipe-0 loop keeps them in one loop
    PIPE = kn.pipe if (NK > 1 or SPLIT > 1) else 0
    FDB = kn.fdb and KS > 1
    NFB = 2 if FDB else 1

    res_shape = spec.res_shape()
    MINB = kn.minb or NRES or (1 if PP else 0)  # persist: its blocks must be co-resident (register cap)
    MINB_ON = MINB > 0
    R_SIZE = math.prod(res_shape)

    # ---------------- index helpers (build PrimExprs; called from the script) ----------------
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
        return ((n * H + ih) * W + iw) * CB + cb

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
            gidx = T.meta_var(ri[it * 3] + tap if ri is not None else
                              (m * CB + kb if POINTWISE else x_index(dec[0], ih, iw, cb)))
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
        else:
            for e in T.unroll(EV):
                ob[e] = T.Cast(o_st, yb[e])
            store16(of, m * K + k, ob, OUT_VEC, OSV)

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
                        if OB == 8 and not HAS_RES:  # the staged bytes are the output
                            for e in T.vectorized(EV // 4):
                                ofw[(m * K + k) // 4 + e] = sb[e]
                        else:
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

    @T.macro
    def body(x, w, bias, Mq, Sq, rf, rfw, rq2, of, ofw, skc=None, skw=None):
        bxn = T.launch_thread("blockIdx.x", GP if STREAM else GRID_N)  # (persist, pp: the block index)
        bxm = T.launch_thread("blockIdx.y", 1 if STREAM else GRID_M)
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
            elif PERSIST:
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
            elif PP:
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
            elif WSP:
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
            elif PRING:  # packed ring (areg: A ring + B slots): chunks 0 .. PD-1 in flight, chunk 0 (its B) unpacked
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
            T.ptx.wgmma.wait_group.sync.aligned(0)
            if KEEP:  # every MMA of this warpgroup retired: the fragment sets' last reads, into a word of its own
                for e in T.unroll(NSET * KS * MI * 4):  # (past the ring: the other warpgroup's MMAs may still read it)
                    kal[0] = T.bitwise_xor(kal[0], ar[e])
                Cs[KEEP_OFF // 4 + tid] = T.Cast("int32", kal[0])
            if RSM:  # (covered by the main loop's waits; explicit for a loop without one)
                T.ptx.cp.async_.wait_group(0)
            T.tvm_storage_sync("shared")  # the epilogue's staging buffer may share memory with the ring
        elif PIPE == 1:
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
        else:
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
            @T.prim_func
            def conv(x: T.Buffer(xs, x_st), w: T.Buffer(ws, w_st), bias: T.Buffer((K,), "int32"),
                     Mq: T.Buffer((K,), "int32"), Sq: T.Buffer((K,), "int32"), res: T.Buffer(res_shape, r_st),
                     rq2_: T.Buffer((5, K), "int32"), skc: T.Buffer((NTILES,), "int32"), out: T.Buffer(os_, o_st),
                     skw: T.Buffer((SK_WORDS,), "int32")):
                T.func_attr({"tir.noalias": True})
                run_res(x, w, bias, Mq, Sq, res, rq2_, out, skc, skw)
        elif SK:
            @T.prim_func
            def conv(x: T.Buffer(xs, x_st), w: T.Buffer(ws, w_st), bias: T.Buffer((K,), "int32"),
                     Mq: T.Buffer((K,), "int32"), Sq: T.Buffer((K,), "int32"), skc: T.Buffer((NTILES,), "int32"),
                     out: T.Buffer(os_, o_st), skw: T.Buffer((SK_WORDS,), "int32")):
                T.func_attr({"tir.noalias": True})
                run_plain(x, w, bias, Mq, Sq, out, skc, skw)
        elif HAS_RES:
            @T.prim_func
            def conv(x: T.Buffer(xs, x_st), w: T.Buffer(ws, w_st), bias: T.Buffer((K,), "int32"),
                     Mq: T.Buffer((K,), "int32"), Sq: T.Buffer((K,), "int32"), res: T.Buffer(res_shape, r_st),
                     rq2_: T.Buffer((5, K), "int32"), out: T.Buffer(os_, o_st)):
                T.func_attr({"tir.noalias": True})
                run_res(x, w, bias, Mq, Sq, res, rq2_, out, None, None)
        else:
            @T.prim_func
            def conv(x: T.Buffer(xs, x_st), w: T.Buffer(ws, w_st), bias: T.Buffer((K,), "int32"),
                     Mq: T.Buffer((K,), "int32"), Sq: T.Buffer((K,), "int32"), out: T.Buffer(os_, o_st)):
                T.func_attr({"tir.noalias": True})
                run_plain(x, w, bias, Mq, Sq, out, None, None)

    if W8 and UNPACK_LD:
        conv = conv.with_attr("qcompile.w8", 1)
    if AGL or PPK:
        conv = conv.with_attr("qcompile.w8_kperm", BK)
    conv = conv.with_attr("qcompile.knobs", str(kn)).with_attr("qcompile.strategy", "direct_hwnc" if HWNC else "implicit_gemm")
    if SK:  # (tile counters, workspace words): callers pass zeros int32[tiles] before out and get the workspace after it
        conv = conv.with_attr("qcompile.streamk", [NTILES, SK_WORDS])
    return conv.with_attr("qcompile.split_k", SPLIT) if SPLIT > 1 else conv
