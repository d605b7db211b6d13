"""The implicit GEMM with output channels as the MMA's M (sm_90a wgmma), ``implicit_gemm_t``.

The implicit GEMM (schedules/igemm.py) puts output pixels on wgmma's M, which comes in 64-row blocks, and output
channels on N. Where the channels are few and the pixels are not a multiple of the tile, its grid fills the GPU
badly: ResNet-50's layer-4 convs at batch 64 (3136 pixels x 512 channels) make 100 tiles of 128 x 128 for the
H100's 132 SMs, a third of them idle for the whole kernel. Transposed,

    D[k, m] = sum over (r, s, c) of W[k, r, s, c] . X[pixel m at tap (r, s), c]        (D = out^T)

the channels are M (128 per block: two warpgroups of 64) and the pixels N, which any multiple of 8 up to 224 can
be: 96-pixel tiles make 4 x 33 = 132 blocks, one per SM. Each block:

1. copies the weights' 128 rows and the pixels' im2col rows of a 128-byte K-chunk into a ``stages``-deep ring of
   128-byte-swizzled K-major tiles (cp.async, zero-filled at the padding; per-thread offsets and a valid-tap mask
   per pixel computed once, so a chunk's copies cost a few instructions). 4-bit activations are loaded packed into
   registers two chunks before they are unpacked (``ring``: into a shared packed ring), and unpacked into the ring
   one chunk ahead of their MMAs: even values x16, then odd ones -- the order ``reference.expand_w4`` gives the
   expanded 4-bit weights, which come x16 too, so the sums are 256 x the dot product;
2. issues per chunk four ``wgmma m64n{BN}k32`` per warpgroup, both operands from the ring, ``gif`` groups in
   flight;
3. runs stage 1 of the implicit GEMM's epilogue (``igemm.requant_stage1``) on the accumulators -- a thread's two MMA
   rows are two adjacent channels (the weights' rows permuted as they are copied), so one staged store per pixel and
   pair -- into a [pixel, channel] tile in shared memory, and writes each pixel's 128 (4-bit: 64) bytes out whole.

No residual (ResNet's 1x1 expansions, which carry the block's add, keep the implicit GEMM); zero padding (cp.async
zero-fill); C and K multiples of 128.
"""
from __future__ import annotations

from dataclasses import dataclass

import tvm
from tvm.script import tirx as T

from .spec import ConvSpec, arch_info
from .stem import WGMMA_N_S8

BMC = 128  # output channels per block (two warpgroups x m64)
BKU = 128  # operand bytes per K-chunk (128-byte swizzle rows)
THREADS = 256
BN_AUTO = tuple(range(64, 225, 16))  # pixel tiles auto_bn considers (integer wgmma N from 48 up: multiples of 16)
MASK = 0xF0F0F0F0


@dataclass(frozen=True)
class KtKnobs:
    bn: int = 0  # pixels per block (a wgmma N); 0: ``auto_bn``
    stages: int = 0  # ring depth (>= 3 + gif; loads run stages - 1 - gif chunks ahead); 0: 3 + gif
    ring: int = -1  # 4-bit activations: 1 copied packed into a shared ring and read back, 0 loaded into registers
    #                 (two register sets; ptxas gives those loads one scoreboard, so the unpack waits for the
    #                 newest of them: one chunk ahead in effect); -1: 0
    gif: int = 1  # MMA groups (K-chunks) in flight: 1 or 2


def auto_bn(spec: ConvSpec, arch: str, sms: int | None = None) -> int:
    """The pixel tile whose grid finishes first on ``arch``'s SMs: fewest waves x tile width (ties: the wider
    tile), counting a block's time as proportional to its pixels."""
    sms = sms or arch_info(arch).sms
    mt = spec.N * spec.P * spec.Q
    kt = spec.K // BMC
    return min(BN_AUTO, key=lambda bn: (-(-(kt * -(-mt // bn)) // sms) * bn, -bn))


def fill_gain(spec: ConvSpec, arch: str) -> float:
    """Model of the gain over the implicit GEMM's 128 x 128 tiles: (waves x 128) / (waves x bn)."""
    sms = arch_info(arch).sms
    mt = spec.N * spec.P * spec.Q
    bn = auto_bn(spec, arch)
    w128 = -(-(-(-mt // 128) * -(-spec.K // 128)) // sms)
    wt = -(-(spec.K // BMC * -(-mt // bn)) // sms)
    return (w128 * 128) / (wt * bn)


def kt_grid(spec: ConvSpec, arch: str) -> int:
    """Blocks of the kernel with ``auto_bn``'s pixel tile."""
    return spec.K // BMC * -(-spec.N * spec.P * spec.Q // auto_bn(spec, arch))


def kt_preferred(spec: ConvSpec, arch: str) -> bool:
    """Whether ``select_strategy`` takes this kernel over the implicit GEMM: a grid that fills the SMs better than
    128 x 128 tiles do (``fill_gain`` > 1) and has at least 3/4 as many blocks as SMs (smaller grids are the split-K
    pairs' ground); with 4-bit activations only pixel tiles of 192 or more. (H100, every ResNet-50 conv this takes at
    batch 8 / 32 / 64 / 128, against the implicit GEMM as compiled: 8-bit 0.98-1.56x the implicit GEMM as compiled, 1.22x
    geomean over 32 convs; 4-bit with 192+ pixels 1.00-1.24x, with fewer 0.82-1.11x -- the per-chunk unpack through
    shared memory is latency on every chunk's path, hidden behind 192 columns of MMAs but not behind 64-112.)"""
    return (kt_constraints(spec, arch) is None and fill_gain(spec, arch) > 1
            and kt_grid(spec, arch) >= 0.75 * arch_info(arch).sms and (spec.x_bits == 8 or auto_bn(spec, arch) >= 192))


def kt_constraints(spec: ConvSpec, arch: str) -> str | None:
    """Why ``make_kt_conv`` cannot take ``spec`` on ``arch`` (None: it can)."""
    if not arch_info(arch).wgmma:
        return f"implicit_gemm_t needs wgmma (sm_90a), not {arch}"
    if spec.layout != "NHWC":
        return "implicit_gemm_t takes NHWC"
    if spec.x_bits not in (4, 8) or spec.w_bits != spec.x_bits:
        return "implicit_gemm_t takes 8-bit or 4-bit activations and weights (one width: the 4-bit k order)"
    if spec.C % 128 or spec.K % BMC:
        return f"implicit_gemm_t takes C and K multiples of 128 (C = {spec.C}, K = {spec.K})"
    if spec.pad_value != 0:
        return "implicit_gemm_t pads with zeros (cp.async zero-fill), not the input zero point"
    if spec.has_residual or spec.out_bits not in (4, 8):
        return "implicit_gemm_t: no residual, 8- or 4-bit output"
    if spec.R * spec.S > 32:
        return f"implicit_gemm_t: {spec.R}x{spec.S} taps (a 32-bit mask per pixel: at most 32)"
    return None


def resolve_knobs(spec: ConvSpec, arch: str, kn: KtKnobs, sms: int | None = None) -> KtKnobs:
    bn = kn.bn or auto_bn(spec, arch, sms)
    stages = kn.stages
    if not stages:
        stages = 3 + kn.gif  # (measured: the shallowest ring the loop takes; 4-7% over 5-6 on the 3x3 layers at
        #                      batch 64, geomean 0.98 for 5 stages over the 1x1 convs at 8-128)
    return KtKnobs(bn=bn, stages=stages, ring=max(kn.ring, 0), gif=kn.gif)


def smem_bytes(spec: ConvSpec, bn: int, stages: int, ring: bool = False) -> int:
    stg = stages * (BMC + bn) * BKU
    return stg + ((stages - 1) * bn * BKU // 2 if spec.x_bits == 4 and ring else 0)


def kt_legal(spec: ConvSpec, arch: str, kn: KtKnobs, sms: int | None = None) -> str | None:
    """THE legality of ``implicit_gemm_t`` at knobs ``kn``: why ``make_kt_conv`` cannot build it (None: it can)."""
    why = kt_constraints(spec, arch)
    if why:
        return why
    k = resolve_knobs(spec, arch, kn, sms)
    if k.bn not in WGMMA_N_S8:
        return f"implicit_gemm_t: {k.bn} pixels is no wgmma N"
    if k.gif not in (1, 2) or k.stages < 3 + k.gif:
        return ("implicit_gemm_t: 1 or 2 MMA groups in flight, stages >= 3 + those (loads run stages - 1 - gif chunks "
                "ahead)")
    smem = smem_bytes(spec, k.bn, k.stages, spec.x_bits == 4 and bool(k.ring))
    if smem > arch_info(arch).smem_per_block:
        return (f"implicit_gemm_t: {smem // 1024} KiB of shared tiles (bn {k.bn}, {k.stages} stages) exceed the "
                f"{arch_info(arch).smem_per_block // 1024} KiB per block of {arch}")
    return None


def make_kt_conv(spec: ConvSpec, arch: str = "sm_90", knobs: KtKnobs | None = None, sms: int | None = None):
    """PrimFunc (x [N, H, W, C(/2)], w [K, R, S, C] int8 (4-bit weights: ``reference.expand_w4(w)``), bias, M, S [K]
    int32, out [N, P, Q, K or K / 2]); ValueError where ``kt_legal`` says no. ``sms``: the device's SM count (``auto_bn``;
    default: the arch table's)."""
    why = kt_legal(spec, arch, knobs or KtKnobs(), sms)
    if why:
        raise ValueError(why)
    from .planned import placeholder_kernel, planning_only

    if planning_only():
        return placeholder_kernel("implicit_gemm_t")
    from .gemm.helpers import requant_stage1

    kn = resolve_knobs(spec, arch, knobs or KtKnobs(), sms)
    BN, STG = kn.bn, kn.stages
    X4 = spec.x_bits == 4
    RG = X4 and not kn.ring  # 4-bit activations through registers
    SMEM = smem_bytes(spec, BN, STG, X4 and bool(kn.ring))
    N, H, W, C, K, R, S = spec.N, spec.H, spec.W, spec.C, spec.K, spec.R, spec.S
    P, Q = spec.P, spec.Q
    sh, sw = spec.strides
    dh, dw = spec.dilations
    pt, pl, _, _ = spec.pads
    CXB = C * spec.x_bits // 8  # activation bytes per pixel
    BKX = BKU // 2 if X4 else BKU  # activation bytes per pixel and chunk
    CPT = C // BKU  # chunks per tap
    NK = R * S * CPT
    RSC = R * S * C  # weight bytes per output channel (4-bit: expanded)
    MT = N * P * Q
    KT = K // BMC
    MTILES = -(-MT // BN)
    GRID = KT * MTILES
    GIF = kn.gif  # MMA groups (chunks) in flight
    L = STG - 1 - GIF  # chunks the loads run ahead (their stage is that of chunk kc - 1 - GIF: retired)
    SA, SB = BMC * BKU, BN * BKU
    STAGE = SA + SB
    P_OFF = STG * STAGE  # X4: the packed ring
    PR = L + 1  # X4: its slots (B runs one chunk ahead of A: chunk kc + 1's is unpacked while chunk kc's MMAs run)
    PSLOT = BN * BKX
    A_IT = SA // 16 // THREADS
    VPR = BKX // 16  # 16-byte vectors per pixel row and chunk
    B_IT = -(-BN * VPR // THREADS)
    NACC = BN // 2
    O_AW, O_AS = 0, A_IT  # per-thread offsets: weight elements, A stage bytes (per A vector)
    O_BO, O_BM, O_BS, O_BU = 2 * A_IT, 2 * A_IT + B_IT, 2 * A_IT + 2 * B_IT, 2 * A_IT + 3 * B_IT  # per B vector
    NOFS = 2 * A_IT + 4 * B_IT
    OB = spec.out_bits
    RB = BMC * OB // 8  # output bytes per pixel of a block
    KP = RB + 16  # staging pitch (bytes)
    CPX = RB // 16
    ST_IT = -(-BN * CPX // THREADS)
    RBK = K * OB // 8  # output bytes per pixel
    SHIFT = 8 if X4 else 0  # 4-bit: both operands come x16
    x_st, o_st = ConvSpec.storage(spec.x_dtype), ConvSpec.storage(spec.out_dtype)
    xs, ws, os_ = spec.shapes()
    ws = ws[:-1] + (C,)  # (4-bit weights come expanded)
    zo, lo, hi = spec.zo, spec.lo, spec.hi
    omask = 15 if OB == 4 else 255
    b_t = "s8" if spec.x_signed else "u8"
    mma = T.ptx[f"wgmma.mma_async.sync.aligned.m64n{BN}k32.s32.s8.{b_t}"]

    def swz(row, c):  # byte offset of 16-byte chunk c of row ``row`` in a 128-byte-swizzled K-major tile
        return row * BKU + T.bitwise_xor(c, T.bitwise_and(row, 7)) * 16

    def wrow(row):  # the weight row (block-local channel) of A-tile row ``row``: MMA rows g, g + 8 -> channels 2g, 2g+1
        rr = T.truncmod(row, 64)
        return row - rr + T.truncdiv(rr, 16) * 16 + T.truncmod(rr, 8) * 2 + T.truncdiv(T.truncmod(rr, 16), 8)

    def scale_d(kc, ks):  # wgmma scale-d: 0 starts the sums (the first k-step), else D += A*B
        return T.Cast("int32", T.Or(kc > 0, ks > 0))

    def nib_lo(w):
        return T.bitwise_and(T.shift_left(w, T.uint32(4)), T.uint32(MASK))

    def nib_hi(w):
        return T.bitwise_and(w, T.uint32(MASK))

    def tap_mask(valid, ih0, iw0):
        """Bit t set where tap t = r * S + s of the pixel whose first tap reads (ih0, iw0) lies in the input."""
        e = T.uint32(0)
        for t in range(R * S):
            ih, iw = ih0 + t // S * dh, iw0 + t % S * dw
            e = T.bitwise_or(e, T.if_then_else(tvm.tirx.all(valid, 0 <= ih, ih < H, 0 <= iw, iw < W),
                                               T.uint32(1 << t), T.uint32(0)))
        return e

    @T.macro
    def load_a(wv, Sm, ofs, kc):
        """K-chunk kc of the weights' 128 rows (A) into stage kc % STG, by cp.async (ofs: the thread's offsets)."""
        for i in T.unroll(A_IT):
            T.evaluate(T.ptx.cp.async_.cg.shared.global_(
                T.address_of(Sm[T.truncmod(kc, STG) * STAGE + ofs[O_AS + i]]),
                T.address_of(wv[ofs[O_AW + i] + kc * BKU]), 16, T.uint32(16)))

    @T.macro
    def load_b(xw, Sm, ofs, kc, tid):
        """K-chunk kc of the pixels' im2col rows (B) into stage kc % STG (X4: packed, into ring slot kc % PR), by
        cp.async; zeros where a tap falls in the padding or past the last pixel (the thread's tap masks)."""
        tap = T.truncdiv(kc, CPT)
        toff = (T.truncdiv(tap, S) * (dh * W) + T.truncmod(tap, S) * dw) * CXB + T.truncmod(kc, CPT) * BKX
        for i in T.unroll(B_IT):
            ok = T.meta_var(T.bitwise_and(T.shift_right(T.Cast("uint32", ofs[O_BM + i]), T.Cast("uint32", tap)),
                                          T.uint32(1)) != T.uint32(0))
            dst = T.meta_var(P_OFF + T.truncmod(kc, PR) * PSLOT if X4 else T.truncmod(kc, STG) * STAGE)
            if (i + 1) * THREADS <= BN * VPR or tid < BN * VPR - i * THREADS:
                T.evaluate(T.ptx.cp.async_.cg.shared.global_(
                    T.address_of(Sm[dst + ofs[O_BS + i]]),
                    T.address_of(xw[T.if_then_else(ok, ofs[O_BO + i] + toff, 0)]), 16,
                    T.if_then_else(ok, T.uint32(16), T.uint32(0))))

    @T.macro
    def load_b_regs(xw, uv, ofs, kc, st, tid):
        """RG: K-chunk kc of the pixels' packed im2col rows into register set ``st`` of uv (zeros where a tap falls in
        the padding or past the last pixel)."""
        tap = T.truncdiv(kc, CPT)
        toff = (T.truncdiv(tap, S) * (dh * W) + T.truncmod(tap, S) * dw) * CXB + T.truncmod(kc, CPT) * BKX
        for i in T.unroll(B_IT):
            b = T.meta_var(st * 4 * B_IT + 4 * i)
            for e in T.unroll(4):
                uv[b + e] = T.uint32(0)
            if (i + 1) * THREADS <= BN * VPR or tid < BN * VPR - i * THREADS:
                if T.bitwise_and(T.shift_right(T.Cast("uint32", ofs[O_BM + i]), T.Cast("uint32", tap)),
                                 T.uint32(1)) != T.uint32(0):
                    T.evaluate(T.ptx.ld.global_.nc.v4.b32(uv[b], uv[b + 1], uv[b + 2], uv[b + 3],
                                                          T.address_of(xw[ofs[O_BO + i] + toff])))

    @T.macro
    def read_packed(Sm, uv, ofs, kc, tid):
        """X4: this thread's packed vectors of chunk kc (its own cp.async copies: its wait_group made them visible)
        into registers uv -- issued before the block barrier, so that their latency (the shared-memory pipe is busy
        with the MMAs' operand reads) passes while the barrier and the MMAs are issued."""
        for i in T.unroll(B_IT):
            if (i + 1) * THREADS <= BN * VPR or tid < BN * VPR - i * THREADS:
                T.evaluate(T.ptx.ld.shared.v4.b32(uv[4 * i], uv[4 * i + 1], uv[4 * i + 2], uv[4 * i + 3], T.address_of(
                    Sm[P_OFF + T.truncmod(kc, PR) * PSLOT + ofs[O_BS + i]])))

    @T.macro
    def unpack_chunk(Sm, uv, ofs, kc, st, tid):
        """X4: the packed vectors in register set ``st`` of uv -> the B tile of stage kc % STG, 16 packed bytes -> the
        even values x16, then the odd ones x16 (the next 16-byte column: its swizzled offset differs in bit 4 alone)."""
        for i in T.unroll(B_IT):
            b = T.meta_var(st * 4 * B_IT + 4 * i)
            if (i + 1) * THREADS <= BN * VPR or tid < BN * VPR - i * THREADS:
                dlo = T.meta_var(T.truncmod(kc, STG) * STAGE + ofs[O_BU + i])
                T.evaluate(T.ptx.st.shared.v4.b32(T.address_of(Sm[dlo]), *[nib_lo(uv[b + e]) for e in range(4)]))
                T.evaluate(T.ptx.st.shared.v4.b32(T.address_of(Sm[T.bitwise_xor(dlo, 16)]),
                                                  *[nib_hi(uv[b + e]) for e in range(4)]))

    @T.macro
    def chunk_step(xw, wv, Sm, uv, ofs, acc, d0, kc, st, wg, tid):
        T.ptx.cp.async_.wait_group(L - 1)
        T.ptx.fence.proxy.async_.shared__cta()
        if X4 and not RG:  # (after the fence, which would wait for the reads)
            if kc + 1 < NK:
                read_packed(Sm, uv, ofs, kc + 1, tid)
        T.tvm_storage_sync("shared")
        T.ptx.wgmma.fence.sync.aligned()
        for ks in T.unroll(BKU // 32):
            T.evaluate(mma(*[acc[e] for e in range(NACC)],
                           d0[0] + T.Cast("uint64", T.shift_right(kc % STG * STAGE + wg * 64 * BKU + ks * 32, 4)),
                           d0[0] + T.Cast("uint64", T.shift_right(kc % STG * STAGE + SA + ks * 32, 4)),
                           T.ptx.pred(scale_d(kc, ks))))
        T.ptx.wgmma.commit_group.sync.aligned()
        if kc + L < NK:
            load_a(wv, Sm, ofs, kc + L)
        if X4 and not RG:
            if kc + L + 1 < NK:
                load_b(xw, Sm, ofs, kc + L + 1, tid)
        elif not X4:
            if kc + L < NK:
                load_b(xw, Sm, ofs, kc + L, tid)
        T.ptx.cp.async_.commit_group()
        if X4:  # chunk kc + 1's activations unpacked and fenced while chunk kc's MMAs run (off the barrier's path)
            if kc + 1 < NK:
                unpack_chunk(Sm, uv, ofs, kc + 1, st if RG else 0, tid)
            if RG:
                if kc + 3 < NK:
                    load_b_regs(xw, uv, ofs, kc + 3, st, tid)
            T.ptx.fence.proxy.async_.shared__cta()
        T.ptx.wgmma.wait_group.sync.aligned(GIF)

    @T.prim_func
    def conv(x: T.Buffer(xs, x_st), w: T.Buffer(ws, "int8"), bias: T.Buffer((K,), "int32"),
             Mq: T.Buffer((K,), "int32"), Sq: T.Buffer((K,), "int32"), out: T.Buffer(os_, o_st)):
        T.func_attr({"tir.noalias": True})
        bid = T.launch_thread("blockIdx.x", GRID)
        tid = T.launch_thread("threadIdx.x", THREADS)
        T.attr(0, "tirx.launch_bounds_min_blocks_per_sm", 1)
        xw = T.decl_buffer((N * H * W * CXB,), x_st, data=x.data)
        wv = T.decl_buffer((K * RSC,), "int8", data=w.data)
        ow = T.decl_buffer((MT * RBK // 4,), "uint32", data=out.data)
        Sm = T.alloc_buffer((SMEM,), "uint8", scope="shared.dyn")
        acc = T.alloc_buffer((NACC,), "uint32", scope="local")
        ofs = T.alloc_buffer((NOFS,), "int32", scope="local")  # the thread's copy offsets (O_* below), set once
        prm = T.alloc_buffer((6,), "int32", scope="local")  # bias, M, S of channels c0 and c0 + 1
        uv = T.alloc_buffer(((2 if RG else 1) * 4 * B_IT,), "uint32", scope="local")  # X4: packed vectors (RG: 2 sets)
        sb = T.alloc_buffer((4 * ST_IT,), "uint32", scope="local")
        d0 = T.alloc_buffer((1,), "uint64", scope="local")
        m0 = bid // KT * BN
        n0c = bid % KT * BMC
        wg = tid // 128
        warp = tid // 32 % 4
        lane = tid % 32
        g = lane // 4
        q = lane % 4
        c0 = wg * 64 + warp * 16 + g * 2  # this thread's channels c0, c0 + 1 (block-local): its MMA rows g, g + 8
        # 1. the thread's copy offsets (weights: element and stage offsets; pixels: the element offset of tap (0, 0),
        #    the stage / ring offset, the valid-tap mask), its channels' epilogue constants, the ring's descriptor
        for i in T.unroll(A_IT):
            ofs[O_AW + i] = (n0c + wrow(i * (THREADS // 8) + tid // 8)) * RSC + tid % 8 * 16
            ofs[O_AS + i] = swz(i * (THREADS // 8) + tid // 8, tid % 8)
        for i in T.unroll(B_IT):
            row = i * (THREADS // VPR) + tid // VPR
            m = m0 + row
            mc = T.min(m, MT - 1)
            pq = T.truncmod(mc, P * Q)
            ih0 = T.truncdiv(pq, Q) * sh - pt
            iw0 = T.truncmod(pq, Q) * sw - pl
            ofs[O_BO + i] = ((T.truncdiv(mc, P * Q) * H + ih0) * W + iw0) * CXB + tid % VPR * 16
            ofs[O_BM + i] = T.Cast("int32", tap_mask(m < MT, ih0, iw0))
            ofs[O_BS + i] = (row * BKX + tid % VPR * 16) if X4 else (SA + swz(row, tid % VPR))
            if X4:
                ofs[O_BU + i] = SA + swz(row, 2 * (tid % VPR))
        for e2 in T.unroll(2):
            prm[e2 * 3] = bias[n0c + c0 + e2]
            prm[e2 * 3 + 1] = Mq[n0c + c0 + e2]
            prm[e2 * 3 + 2] = Sq[n0c + c0 + e2]
        d0[0] = T.bitwise_or(T.Cast("uint64", T.shift_right(T.cuda.cvta_generic_to_shared(Sm.access_ptr("r")), 4)),
                             T.uint64((1 << 16) | (64 << 32) | (1 << 62)))  # 128-byte swizzle, SBO 1024 bytes
        # 2. the first L chunks in flight, one cp.async group each (ring: the activations one chunk further ahead,
        #    the first group with chunks 0 and 1 of them; RG: chunks 0 and 1 of them in registers, then chunk 2);
        #    X4: chunk 0's activations unpacked
        for kc in T.unroll(L):
            if kc < NK:
                load_a(wv, Sm, ofs, kc)
            if RG:
                if kc < 2 and kc < NK:
                    load_b_regs(xw, uv, ofs, kc, kc, tid)
            elif X4:
                if kc == 0:
                    load_b(xw, Sm, ofs, 0, tid)
                if kc + 1 < NK:
                    load_b(xw, Sm, ofs, kc + 1, tid)
            elif kc < NK:
                load_b(xw, Sm, ofs, kc, tid)
            T.ptx.cp.async_.commit_group()
        if RG:
            unpack_chunk(Sm, uv, ofs, 0, 0, tid)
            if 2 < NK:
                load_b_regs(xw, uv, ofs, 2, 0, tid)
        elif X4:
            T.ptx.cp.async_.wait_group(L - 1)
            read_packed(Sm, uv, ofs, 0, tid)
            unpack_chunk(Sm, uv, ofs, 0, 0, tid)
        # 3. per chunk: its tiles visible to every thread, its MMAs issued (X4: then chunk kc + 1's activations
        #    unpacked), the copies of chunk kc + L (ring: the activations of kc + L + 1; RG: kc + 3's into the
        #    register set just unpacked), one MMA group in flight
        for k2 in T.serial((NK + 1) // 2 if RG else NK):
            for u in T.unroll(2 if RG else 1):
                kc = T.meta_var(k2 * 2 + u if RG else k2)
                if not RG or kc < NK:
                    chunk_step(xw, wv, Sm, uv, ofs, acc, d0, kc, (u + 1) % 2, wg, tid)
        T.ptx.wgmma.wait_group.sync.aligned(0)
        T.ptx.cp.async_.wait_group(0)
        T.tvm_storage_sync("shared")
        # 4. stage 1 on the accumulators: channels c0, c0 + 1 of pixels 8j + 2q + e, one staged store per pair (8-bit:
        #    two bytes; 4-bit: one packed byte, the even channel in the low nibble)
        for j in T.unroll(BN // 8):
            for e in T.unroll(2):
                v = T.meta_var([T.bitwise_and(T.Cast("int32", requant_stage1(
                    T.shift_right(T.reinterpret("int32", acc[j * 4 + e2 * 2 + e]), SHIFT) + prm[e2 * 3],
                    prm[e2 * 3 + 1], prm[e2 * 3 + 2], spec.shift_ge33, zo, lo, hi)), omask) for e2 in range(2)])
                px = j * 8 + q * 2 + e
                if OB == 4:
                    T.evaluate(T.ptx.st.shared.b8(T.address_of(Sm[px * KP + c0 // 2]),
                                                  T.Cast("uint32", T.bitwise_or(v[0], T.shift_left(v[1], 4)))))
                else:
                    T.evaluate(T.ptx.st.shared.b16(T.address_of(Sm[px * KP + c0]),
                                                   T.Cast("uint32", T.bitwise_or(v[0], T.shift_left(v[1], 8)))))
        T.tvm_storage_sync("shared")
        # 5. each pixel's RB bytes out in 16-byte stores (reads clamped to the tile: no branch)
        for it in T.unroll(ST_IT):
            Lx = T.min(it * THREADS + tid, BN * CPX - 1)
            T.evaluate(T.ptx.ld.shared.v4.b32(
                sb[it * 4], sb[it * 4 + 1], sb[it * 4 + 2], sb[it * 4 + 3],
                T.address_of(Sm[T.truncdiv(Lx, CPX) * KP + T.truncmod(Lx, CPX) * 16])))
        for it in T.unroll(ST_IT):
            Lx = it * THREADS + tid
            px = T.truncdiv(Lx, CPX)
            if ((it + 1) * THREADS <= BN * CPX or Lx < BN * CPX) and m0 + px < MT:
                for e in T.vectorized(4):
                    ow[((m0 + px) * RBK + n0c * OB // 8 + T.truncmod(Lx, CPX) * 16) // 4 + e] = sb[it * 4 + e]

    conv = conv.with_attr("qcompile.knobs", str(kn)).with_attr("qcompile.strategy", "implicit_gemm_t")
    return conv.with_attr("qcompile.w8", 1) if spec.w_bits == 4 else conv
