"""The implicit GEMM's plan: every size, flag and legality decision of one kernel, derived once."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from ..spec import ArchMMA, ConvSpec, GemmKnobs, MMAShape, arch_info, tile_grid

GRID_YZ_MAX = 65535  # CUDA's limit on gridDim.y and gridDim.z (gridDim.x: 2^31 - 1)


class NotApplicable(Exception):
    """The kernel cannot take this (spec, arch, knobs) point; the message says why."""


def _mma_dtype(dtype_bits: int, signed: bool) -> str:
    return ("int" if signed else "uint") + str(dtype_bits)


def group_constraints(spec: ConvSpec, layout: str) -> str | None:
    """Why the implicit GEMM cannot take the grouped conv ``spec`` (``spec.groups`` > 1) at any knobs, else None:
    NHWC, ``groups`` dividing C and K, 8-bit operands (one byte a value), Kg = K / groups a multiple of 32 (the
    narrowest N tile, which must lie inside one group) and Cg = C / groups a multiple of 4 (4-byte vectors that never
    straddle a group). The tile-level rule (Kg a multiple of the adapted BN; no split-K, register-A loaders or
    persistent / ping-pong / stream-K grids) is ``make_plan``'s (``_group_legal``)."""
    g = spec.groups
    if layout != "NHWC":
        return f"grouped convs take NHWC, not {layout}"
    if spec.C % g or spec.K % g:
        return f"groups {g} must divide C {spec.C} and K {spec.K}"
    if spec.x_bits != 8 or spec.w_bits != 8:
        return "grouped convs on tensor cores take 8-bit operands (one value a byte)"
    if (spec.K // g) % 32:
        return f"K / groups = {spec.K // g} is no multiple of 32 (an N tile must lie inside one group)"
    if (spec.C // g) % 4:
        return f"C / groups = {spec.C // g} is no multiple of 4 (channel vectors inside one group)"
    return None


def red_channels(spec: ConvSpec) -> int:
    """The input channels one output channel reduces over: C, or C / groups for a grouped conv."""
    return spec.C // spec.groups if spec.groups > 1 else spec.C


def gemm_constraints(spec: ConvSpec, arch: str, layout: str) -> str | None:
    """Return None if the tensor-core template can take this spec, else the reason."""
    if spec.groups > 1:
        why = group_constraints(spec, layout)
        if why:
            return why
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


def _group_legal(kn: GemmKnobs, kg: int, split: int, rega: bool, wsp: bool) -> None:
    """A grouped conv's tile rules (``group_constraints`` holds): each N tile inside one group (Kg a multiple of the
    adapted BN), the A loader's group base taken from the tile's first output channel; one K-split, the
    one-block-per-tile grid (no persist / stream-K / ping-pong) and the cp.async loaders (no register-A, wsp)."""
    if kg % kn.BN:
        raise NotApplicable(f"grouped: K / groups = {kg} is no multiple of the N tile {kn.BN}")
    if split > 1 or kn.persist or kn.sk or kn.pp or rega or wsp:
        raise NotApplicable("grouped: one block per tile (no split-K, persist, sk, pp) and the cp.async loaders "
                            "(no agl / areg / wsp)")


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


def adapt_knobs(spec: ConvSpec, kn: GemmKnobs, layout: str) -> GemmKnobs:
    """Shrink the block tile for small problems (keeps the grid busy), fix vector widths."""
    Mtot = spec.N * spec.P * spec.Q
    cb = red_channels(spec) * spec.x_bits // 8
    vec = _pick_vec(cb, kn.vec)
    if spec.pad_value != 0 and vec > 1:
        pass  # plain-load path keeps vector width, pads with pad_value
    BM, BN, WM, WN = kn.BM, kn.BN, kn.WM, kn.WN
    lo = 64 if kn.mma == "wgmma" else 32  # smallest warp(group) tile side
    while BN > lo and BN // 2 >= spec.K:
        BN = BN // 2 if BN & (BN - 1) == 0 else lo  # (96 / 112: to the smallest tile)
    while spec.groups > 1 and BN > lo and BN > spec.K // spec.groups:  # (grouped: an N tile inside one group)
        BN = BN // 2 if BN & (BN - 1) == 0 else lo
    while BM > lo and BM // 2 >= Mtot:
        BM //= 2
    # warps (warpgroups) per side: at most one per smallest tile side, a power of two (BN 96 / 112 over 32-column
    # warps leave 3, and an odd warp count splits no power-of-two tile into whole vectors)
    WM = _pow2_floor(min(WM, BM // lo))
    WN = _pow2_floor(min(WN, BN // lo))
    BK = kn.BK
    kn = kn.replace(BM=BM, BN=BN, WM=WM, WN=WN, vec=vec, BK=BK)
    # keep every thread busy with whole vectors: a chunk of vec x load_threads bytes per row is whole for every
    # power-of-two tile, so the doubling stops there (a point still not whole is left to ``valid`` to refuse)
    limit = kn.vec * kn.load_threads
    while BK < limit and not kn.whole_vectors(BK):
        BK *= 2
    return kn.replace(BK=BK)


def _pow2_floor(v: int) -> int:
    """The largest power of two <= ``v`` (1 for ``v`` < 1)."""
    return 1 << (max(1, v).bit_length() - 1)


def split_factor(spec: ConvSpec, arch: str, kn: GemmKnobs, sms: int | None = None) -> int:
    """K-split of a conv with (adapted) knobs ``kn``: the knob, or schedules/splitk.py's rule when it is 0."""
    from ..splitk import auto_split

    if kn.split_k:
        return kn.split_k
    if (kn.sk or kn.pp) and kn.mma == "wgmma" and spec.x_bits == 8:  # stream-K, ping-pong: the grid fills the GPU
        return 1
    blocks = tile_grid(spec, kn.BM, kn.BN)
    nk = -(-(spec.R * spec.S * red_channels(spec) * spec.x_bits // 8) // kn.BK)
    return auto_split(spec, arch, blocks, nk, sms=sms)


def staging_pitch(wtn: int) -> int:
    """int32 words per row of a warp's epilogue staging tile for a warp tile ``wtn`` columns wide (column c at word
    c + 4 * (c // 32): see make_gemm_conv), rounded to 8 mod 32."""
    return -(-(wtn + 4 * (wtn // 32) - 8) // 32) * 32 + 8


@dataclass(frozen=True)
class GemmPlan:
    """Everything the implicit GEMM / direct HWNC kernel of (spec, arch, knobs, layout, split) is built from: the
    effective knobs (``kn``: tiles shrunk for small problems), every derived size and flag, and the legality
    decision -- ``make_plan`` raises ``NotApplicable(reason)`` for a point the kernel cannot take and builds no TIR.
    The TIR pieces (schedules/gemm/{helpers,loaders,mma,epilogue,kernel}.py) only read it.

    Constraints (checked by ``make_plan``, with ``GemmKnobs.valid`` for the knob combinations):

    * the operands take the tensor-core template (``gemm_constraints``): equal operand widths, even 4-bit channel
      counts, HWNC batch % 8 / channel bytes % 32 / K % 8, Hopper 4-bit reductions under 69905;
    * wgmma: an arch with warpgroup MMA, 16-byte cp.async vectors, zero padding; stages >= 3 + pipe; the shared
      tiles (ring, packed rings, staging tile, residual tile) within the arch's shared memory per block;
    * register-A loaders: areg needs pstages >= 2 and pipe -1 / 0; awarp needs areg, WN 1 and pipe -1 (agl: or 0);
      agl needs w8 + awarp (or the register-A ping-pong), NHWC and whole K-chunks; wsp is 4-bit only, no areg;
    * ping-pong: one warpgroup tile, stages <= 5, no split-K; stream-K: its index arithmetic within int32;
      persistent / stream-K grids: their blocks fit one SM together;
    * the epilogue: 4-bit output needs an even K; an output table (``spec.lut``) an 8-bit output (ConvSpec checks);
    * grouped convs (``spec.groups`` > 1, ``group_constraints``): NHWC, 8-bit operands, Kg a multiple of 32 and of
      BN, Cg of 4; no split-K, persistent / stream-K / ping-pong grids or register-A loaders (``_group_legal``)."""

    spec: ConvSpec
    arch: str
    layout: str
    ai: ArchMMA
    kn: GemmKnobs
    WG: bool
    SPLIT: int
    N: int
    H: int
    W: int
    C: int
    K: int
    R: int
    S: int
    P: int
    Q: int
    sh: int
    sw: int
    dh: int
    dw: int
    pt: int
    pl: int
    _: int
    xbits: int
    XCB: int
    GROUPS: int
    KG: int
    CB: int
    GKB: int
    Mtot: int
    BM: int
    BN: int
    BK: int
    WM: int
    WN: int
    STG: int
    NTH: int
    LNTH: int
    NPROD: int
    NWARP: int
    WTM: int
    WTN: int
    MT: int
    NT: int
    KS: int
    UNPACK_LD: bool
    AGL8: bool
    REGA: bool
    PSTG: int
    PRING: bool
    AREG: bool
    PD: int
    AWARP: bool
    W8: bool
    AGL: bool
    PPK: bool
    WSP: bool
    NSET: int
    KEEP: bool
    UBK: int
    BKP: int
    AW: int
    SBO: int
    LBO: int
    LAYOUT_TYPE: int
    GIF: int
    MI: int
    AGD: int
    APV: int
    NAV: int
    AG_IT: int
    AGW: int
    UNR: int
    INS_N: int
    NI: int
    EMT: int
    VEC: int
    VPR: int
    A_IT: int
    B_IT: int
    NK: int
    CPS: int
    PAD: int
    PAD_BYTE: int
    use_async: bool
    EV: int
    CSP: int
    GRID_M: int
    GRID_N: int
    HWNC: bool
    POINTWISE: bool
    MAIN_UNROLL: None | int
    is4: bool
    unpack: bool
    shp: MMAShape
    a_ty: str
    b_ty: str
    SUB_M: int
    SUB_K: int
    MMA: str
    acc_shift: int
    x_st: str
    w_st: str
    o_st: str
    xs: tuple
    ws: tuple
    os_: tuple
    OB: int
    LUT: int
    HAS_RES: bool
    r_st: str
    RB: int
    RSIGNED: bool
    zo: int
    lo: int
    hi: int
    olo: int
    ohi: int
    X_SIZE: int
    W_SIZE: int
    O_SIZE: int
    SMEM_A: int
    SMEM_B: int
    SMEM_C: int
    B_OFF: int
    AWP: int
    PA_OFF: int
    SMEM_PA: int
    P_OFF: int
    PV_IT: int
    SMEM_P: int
    SMEM_ALL: int
    ERQ: bool
    ERQ4: bool
    CPB: int
    STAGE_BYTES: int
    SK: bool
    PP4: bool
    PPU: bool
    PPW: bool
    PP: bool
    PP_NSET: int
    PERSIST: bool
    NTILES: int
    TOTIT: int
    GP: int
    STREAM: bool
    M_ON_X: bool
    PPD: int
    PP_REGS: tuple
    NACC: int
    SK_WORDS: int
    C_OFF: int
    NRES: int
    A_ALLOC: int
    B_ALLOC: int
    KEEP_OFF: int
    CS_IT: int
    LPR: int
    HOIST: bool
    PV: int
    RBV: int
    RW: int
    PREF: bool
    RP_ALL: bool
    RPN: int
    RPB: int
    RES_OFF: int
    RSM: bool
    RIT: int
    OUT_VEC: int
    OSV: int
    ACC_T: str
    PIPE: int
    FDB: bool
    NFB: int
    res_shape: tuple
    MINB: int
    MINB_ON: bool
    R_SIZE: int

    def replace(self, **kw) -> "GemmPlan":
        return dataclasses.replace(self, **kw)

    @property
    def effective_knobs(self) -> GemmKnobs:
        """The knobs as the kernel uses them: ``kn`` (adapted to the problem) with the K-split resolved and the
        epilogue width / fragment double buffering it really gets. Two points with equal effective knobs build the
        same kernel."""
        ev = self.EV if self.EV in GemmKnobs.SPACE["ev"] else self.kn.ev
        return self.kn.replace(split_k=self.SPLIT, ev=ev, fdb=bool(self.FDB))


def _adapt_knobs(spec: ConvSpec, kn: GemmKnobs, layout: str) -> GemmKnobs:
    """``adapt_knobs`` (the name scripts and tests import)."""
    return adapt_knobs(spec, kn, layout)


_FIELDS = {f.name for f in dataclasses.fields(GemmPlan)}


def _plan_operands(spec: ConvSpec, arch: str, knobs, layout, adapt: bool, allow_split: bool, sms) -> dict:
    """Knob resolution, legality, operand and loader flags, tile sizes (first half of ``make_plan``)."""
    from ..spec import DEFAULT_KNOBS

    layout = layout or spec.layout
    if layout != spec.layout:
        raise NotApplicable(f"spec layout {spec.layout} != strategy layout {layout}")
    why = gemm_constraints(spec, arch, layout)
    if why:
        raise NotApplicable(why)
    ai = arch_info(arch) if not sms else dataclasses.replace(arch_info(arch), sms=sms)  # (sms: the device's)
    kn = knobs or DEFAULT_KNOBS.get(arch, DEFAULT_KNOBS["sm_90"])
    if adapt:
        kn = adapt_knobs(spec, kn, layout)
    why = kn.why_invalid()
    if why:
        raise NotApplicable(f"invalid knobs ({why}): {kn}")
    WG = kn.mma == "wgmma"
    if WG:
        if not ai.wgmma:
            raise NotApplicable(f"wgmma needs sm_90a, not {arch}")
        if spec.pad_value != 0 or kn.vec != 16:
            raise NotApplicable("wgmma tiles are filled by 16-byte cp.async (channel bytes % 16 == 0, zero padding)")
    SPLIT = split_factor(spec, arch, kn, ai.sms) if allow_split else 1


    N, H, W, C, K, R, S = spec.N, spec.H, spec.W, spec.C, spec.K, spec.R, spec.S
    P, Q = spec.P, spec.Q
    sh, sw = spec.strides
    dh, dw = spec.dilations
    pt, pl, _, _ = spec.pads
    xbits = spec.x_bits
    XCB = C * xbits // 8  # channel bytes of an input pixel
    GROUPS = spec.groups
    C = red_channels(spec)  # (grouped: the Cg channels of the tile's group, from channel (n0 // KG) * Cg)
    KG = K // GROUPS  # output channels per group
    CB = C * xbits // 8  # channel bytes of the reduction (per tap)
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
    if GROUPS > 1:
        _group_legal(kn, KG, SPLIT, REGA, WSP)
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
    if (16 * WTN) % (32 * EV):  # the read-back: a warp's 32 lanes take EV columns each of its 16 x WTN staged rows
        raise NotApplicable(f"epilogue: a warp tile {WTN} columns wide is no whole number of rounds of 32 lanes x "
                            f"{EV} columns over its 16 staged rows (ev)")
    # epilogue staging: column c of a row at word c + 4*(c // 32) (a lane's EV <= 16 columns never straddle a
    # 32-column group), pitch = 8 mod 32 words. The accumulator stores (8-byte pairs, rows g / g+8) stay
    # conflict-free, and so do the 16-byte loads of the read-back: without the skew lanes l and l+4 of a
    # quarter-warp (columns 8l and 8l+32) hit the same banks, a 2-way conflict on every read-back load
    CSP = staging_pitch(WTN)

    return {k: v for k, v in locals().items() if k in _FIELDS}


def _plan_grid(v: dict) -> dict:
    """Grid, stream, shared-memory layout and epilogue flags (second half of ``make_plan``)."""
    spec, arch, layout, ai, kn, WG, SPLIT = v["spec"], v["arch"], v["layout"], v["ai"], v["kn"], v["WG"], v["SPLIT"]
    H, W, C, K, R, S, P, Q, sh, sw = v["H"], v["W"], v["C"], v["K"], v["R"], v["S"], v["P"], v["Q"], v["sh"], v["sw"]
    xbits, Mtot, BM, BN, BK, STG, NTH = v["xbits"], v["Mtot"], v["BM"], v["BN"], v["BK"], v["STG"], v["NTH"]
    LNTH, NWARP, WTN, NT, KS, UNPACK_LD = v["LNTH"], v["NWARP"], v["WTN"], v["NT"], v["KS"], v["UNPACK_LD"]
    AGL8, PSTG, AREG, AWARP, W8, AGL, PPK = v["AGL8"], v["PSTG"], v["AREG"], v["AWARP"], v["W8"], v["AGL"], v["PPK"]
    WSP, KEEP, BKP, GIF, EMT, A_IT, B_IT = v["WSP"], v["KEEP"], v["BKP"], v["GIF"], v["EMT"], v["A_IT"], v["B_IT"]
    NK, EV, CSP = v["NK"], v["EV"], v["CSP"]
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
    if W8 or spec.groups > 1:  # (grouped: OHWI [K, R, S, Cg], one byte a value)
        ws = ws[:-1] + (C,)
    OB = spec.out_bits
    # the output lookup table's entries (0: none): the epilogue stores lut[y - lut_min] for the final value y, an 8-bit
    # output (ConvSpec checks), never the staged bytes themselves (erq)
    LUT = spec.lut
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
    # (pp's setmaxnreg moves registers within the block's own allocation: its consumers' 224 need the launch bounds of
    # one block per SM -- minb >= 2 caps a thread at 80: ptxas refused 20 of the 24 such points the H100 / H200 logs
    # hold, the other four hung until the runner's timeout)
    if kn.pp and WG and (not PP or AGL8 or (kn.agl and not PPK) or kn.WM * kn.WN != 1 or STG > 5
                         or (PPW and PSTG < STG - 1 - kn.pipe) or kn.minb > 1):
        raise NotApplicable("pp: one warpgroup tile, stages <= 5, minb <= 1, no split-K, no agl; 4-bit with pstages "
                            ">= 2 (the producer unpacks; with w8 pstages >= stages - 1 - pipe) or as the register-A "
                            "kernel with w8, pipe -1 or 0 and pstages == stages (agl: only that one)")
    PP_NSET = 2 if PP and AREG and kn.pipe == 0 else 1  # pp, register A: fragment sets per consumer
    # (4-bit: the register-A loader with warp-owned rows and expanded weights, whose B is copied like an 8-bit operand)
    PERSIST = (bool(kn.persist) or SK) and SPLIT == 1 and WG and (not UNPACK_LD or (W8 and AWARP and not SK))
    NTILES = GRID_M * GRID_N
    TOTIT = NTILES * NK
    GP = (min(TOTIT, kn.sk * ai.sms) if SK else min(NTILES, kn.persist * ai.sms)) if PERSIST else (
        min(NTILES, ai.sms) if PP else 0)
    STREAM = PERSIST or PP  # the block's K-chunks are one stream across its tiles
    # the M tiles on blockIdx.y unless there are more than its limit (65535; VGG's 224x224 layers at batch 256: 100352
    # tiles of 128 rows): then on blockIdx.x (2^31 - 1) and the N tiles on blockIdx.y
    M_ON_X = not STREAM and GRID_M > GRID_YZ_MAX
    if GRID_N > GRID_YZ_MAX and M_ON_X or SPLIT > GRID_YZ_MAX:
        raise NotApplicable(f"a grid of {GRID_M} x {GRID_N} x {SPLIT} tiles exceeds CUDA's grid limits")
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
    if not WG and A_ALLOC + B_ALLOC > ai.smem_per_block:  # (mma.sync: the A ring or staging tile beside the B ring)
        raise NotApplicable(f"{(A_ALLOC + B_ALLOC) // 1024} KiB of shared tiles exceed the "
                            f"{ai.smem_per_block // 1024} KiB per block of {arch}")
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
    OUT_VEC = EV * OB // 8 if OB < 32 else EV  # storage elements per lane store
    OSV = min(OUT_VEC, 128 // OB) if OB >= 8 else OUT_VEC  # ... per vector store (16 bytes at most)
    ACC_T = "uint32" if WG else "int32"  # wgmma accumulators are .s32 in u32 carrier registers
    # one K-chunk: nothing to pipeline, and without the loop TVM's shared-memory planner may overlap As and Bs
    # (with pipe=1 and NK == 1: wrong results); the pipe-0 loop keeps them in one loop
    PIPE = kn.pipe if (NK > 1 or SPLIT > 1) else 0
    FDB = kn.fdb and KS > 1
    NFB = 2 if FDB else 1

    res_shape = spec.res_shape()
    MINB = kn.minb or NRES or (1 if PP else 0)  # persist: its blocks must be co-resident (register cap)
    MINB_ON = MINB > 0
    # registers: a wgmma instruction's accumulators (INS_N / 2 per thread) and its operands must fit under the cap that
    # the launch bounds (MINB blocks of NTH threads) put on each thread -- ptxas refuses the kernel otherwise ("C7602
    # Insufficient registers": 40 for an m64n96 wgmma needing 74, H100 reliability run); an mma.sync warp tile whose
    # accumulators alone outnumber the 255 registers of a thread spills, and ptxas runs for minutes on it (512 per
    # thread did not build in 60 s, 2048 not in 90 s: H100 reliability runs)
    INS_N, WTM = v["INS_N"], v["WTM"]
    REG_CAP = min(255, 65536 // (NTH * MINB) // 8 * 8) if MINB_ON else 255
    if WG and REG_CAP < INS_N // 2 + 26:
        raise NotApplicable(f"launch bounds of {MINB} blocks x {NTH} threads leave {REG_CAP} registers per thread; "
                            f"an m64n{INS_N} wgmma needs {INS_N // 2 + 26}")
    if not WG and WTM * WTN // 32 > 255:
        raise NotApplicable(f"a {WTM}x{WTN} warp tile is {WTM * WTN // 32} accumulators per thread, more than the 255 "
                            "registers of a thread: it spills, and ptxas takes minutes on it")
    R_SIZE = math.prod(res_shape)

    return {k: x for k, x in locals().items() if k in _FIELDS}


def make_plan(spec: ConvSpec, arch: str = "sm_90", knobs: GemmKnobs | None = None, layout: str | None = None,
              adapt: bool = True, allow_split: bool = False, sms: int | None = None) -> GemmPlan:
    """The plan of the kernel for ``spec`` on ``arch`` with ``knobs`` (None: the arch's ``DEFAULT_KNOBS``), adapted to
    the problem (``adapt_knobs``) unless ``adapt`` is False; ``layout`` "NHWC" = implicit GEMM, "HWNC" = direct;
    ``allow_split``: a K-split over blocks where ``split_factor`` says so (the first kernel of a split-K pair).
    ``sms``: the device's SM count (split-K sizing, persistent grids), default the arch table's reference part.
    Raises ``NotApplicable`` with the reason where the kernel cannot take the point."""
    a = _plan_operands(spec, arch, knobs, layout, adapt, allow_split, sms)
    return GemmPlan(**{**a, **_plan_grid(a)})
