"""The RGB stem as a direct convolution from a shared-memory halo tile (sm_90a wgmma), ``direct_halo``.

CUDA builds run the 7x7/2 stem over its 2x2 space-to-depth input (``spec.space_to_depth``): a 4x4 stride-1 conv on 16
channels (16 bytes per pixel) into K = 64 output channels. As an implicit GEMM every output pixel's im2col row
(16 taps x 16 bytes) is copied from L2 on its own: 256 bytes per output for a 16-byte input pixel, and that kernel is
L2-bound (ncu, ResNet-50 at batch 256 on the H100: L2 72% of peak, tensor pipe 19%). Here a block copies the
TH + R - 1 input rows that TH output rows read into shared memory once (the halo tile: every input pixel of it
16 bytes, pad columns and rows set to the padding value), and the MMAs read their operand straight out of it:

    D[k, q] (one output row) = sum over (r, s) of W[k, r, s, :] . X[oh + r - pt, q + s - pl, :]

is, per row, one wgmma per tap pair (s, s + 1) of each kernel row r, with the weights as the M x K operand (64 output
channels, from registers: each thread holds its A fragments of the whole reduction for the kernel's life) and the
output pixels as N = Q (every pixel of the row, e.g. m64n112k32 for ResNet's 112-wide stem). The B operand of tap
pair (s, s + 1) is the halo row starting at pixel s: an 8-pixel core matrix is 128 contiguous bytes of the tile, the
next 8 pixels 128 bytes on (SBO), and tap s + 1's core matrix one pixel (16 bytes) on (LBO) -- no copy per tap.

The epilogue (stage 1 of the implicit GEMM's, ``igemm.requant_stage1``, same bits) runs on the accumulators. A thread
holds two MMA rows (g and g + 8); the weights' rows are permuted so that they are two adjacent output channels, whose
bias / M / S it loads once, and each pixel's pair goes into a [Q, K bytes] staging tile in shared memory as one store
(4-bit outputs: one packed byte). The row leaves as one contiguous stretch of the output in 16-byte stores.
Blocks are persistent (``minb`` per SM): work item i is TH output rows of one image, and the halo of the block's next
item is copied (cp.async) while it computes the current one.
"""
from __future__ import annotations

from dataclasses import dataclass

from tvm.script import tirx as T

from .spec import ConvSpec, arch_info

WGMMA_N_S8 = (8, 16, 24, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224)  # PTX ISA: integer wgmma N
THREADS = 128  # one warpgroup per block


@dataclass(frozen=True)
class HaloKnobs:
    th: int = 0  # output rows per work item (0: 4, or fewer where that leaves fewer items than SMs)
    minb: int = 0  # blocks per SM (persistent grid minb x SMs; __launch_bounds__ caps the registers for them);
    #                0: 2 with pipe 1 (two accumulator sets: 239 registers), else 3
    pipe: int = -1  # 1: two accumulator sets, row i + 1's wgmmas in flight while row i's epilogue runs; -1: 1 where
    #                 items have several rows and the grid at most 16 items per SM (ResNet: batch 8-64), else 0


def resolve_knobs(spec: ConvSpec, arch: str, kn: HaloKnobs, sms: int | None = None) -> HaloKnobs:
    """``kn`` with its automatic fields decided (H100, the halo knobs th x minb x pipe measured against the defaults: at batch 256 the defaults
    within 1-3% of the best variant, at batch 8-64 pipe 1 on two blocks per SM 4-9% faster than pipe 0 on three)."""
    sms = sms or arch_info(arch).sms  # (the device's SM count where given)
    th = kn.th or next((t for t in (4, 2) if spec.N * -(-spec.P // t) >= sms), 1)
    pipe = kn.pipe if kn.pipe >= 0 else int(th > 1 and spec.N * -(-spec.P // th) <= 16 * sms)
    return HaloKnobs(th=th, minb=kn.minb or (2 if pipe else 3), pipe=pipe)


def halo_constraints(spec: ConvSpec, arch: str) -> str | None:
    """Why ``make_halo_conv`` cannot take ``spec`` on ``arch`` (None: it can)."""
    ai = arch_info(arch)
    if not ai.wgmma:
        return f"direct_halo needs wgmma (sm_90a), not {arch}"
    if spec.layout != "NHWC" or spec.x_bits != 8 or spec.w_bits != 8:
        return "direct_halo takes NHWC with 8-bit activations and weights"
    if spec.C * spec.x_bits // 8 != 16:
        return f"direct_halo takes 16-byte pixels (C = {spec.C})"
    if spec.strides != (1, 1) or spec.dilations != (1, 1) or spec.S % 2:
        return "direct_halo takes stride 1, no dilation, an even kernel width (tap pairs)"
    if spec.K != 64:
        return f"direct_halo takes K = 64 output channels (K = {spec.K})"
    if spec.Q not in WGMMA_N_S8:
        return f"direct_halo: output width {spec.Q} is no wgmma N"
    if spec.has_residual or spec.out_bits not in (4, 8):
        return "direct_halo: no residual, 8- or 4-bit output"
    if spec.pads[1] >= spec.S or spec.pads[3] >= spec.S:
        return "direct_halo: pads narrower than the kernel"
    return None


def halo_smem(spec: ConvSpec, kn: HaloKnobs) -> int:
    """Shared-memory bytes of the kernel with resolved knobs ``kn``: two halo buffers and one or two staging tiles."""
    halo = (kn.th + spec.R - 1) * (spec.Q + spec.S - 1) * 16
    return 2 * halo + (2 if kn.pipe == 1 else 1) * spec.Q * (spec.K * spec.out_bits // 8 + 16)


def halo_legal(spec: ConvSpec, arch: str, kn: HaloKnobs, sms: int | None = None) -> str | None:
    """THE legality of ``direct_halo`` at knobs ``kn``: why ``make_halo_conv`` cannot build it (None: it can)."""
    why = halo_constraints(spec, arch)
    if why:
        return why
    k = resolve_knobs(spec, arch, kn, sms)
    if k.th < 1 or k.minb < 1 or k.pipe not in (0, 1):
        return f"direct_halo: th >= 1, minb >= 1, pipe 0 or 1 ({k})"
    smem = halo_smem(spec, k)
    if smem > arch_info(arch).smem_per_block:
        return (f"direct_halo: {smem // 1024} KiB of halo and staging tiles (th = {k.th}) exceed the "
                f"{arch_info(arch).smem_per_block // 1024} KiB per block of {arch}; use fewer rows per item")
    return None


def make_halo_conv(spec: ConvSpec, arch: str = "sm_90", knobs: HaloKnobs | None = None, sms: int | None = None):
    """PrimFunc (x [N, H, W, C], w [K, R, S, C], bias, M, S [K] int32, out [N, P, Q, K or K / 2]); ValueError where
    ``halo_legal`` says no. ``sms``: the device's SM count (the persistent grid; default: the arch table's)."""
    why = halo_legal(spec, arch, knobs or HaloKnobs(), sms)
    if why:
        raise ValueError(why)
    from .planned import placeholder_kernel, planning_only

    if planning_only():
        return placeholder_kernel("direct_halo")
    from .gemm.helpers import requant_stage1

    kn = resolve_knobs(spec, arch, knobs or HaloKnobs(), sms)
    N, H, W, K, R, S = spec.N, spec.H, spec.W, spec.K, spec.R, spec.S
    P, Q = spec.P, spec.Q
    pt, pl, _, _ = spec.pads
    TH = kn.th
    PITCH = Q + S - 1  # halo columns (16-byte pixels): input column iw at iw + pl
    HR = TH + R - 1  # halo rows
    HALO = HR * PITCH * 16  # bytes per halo buffer (two: the next item's lands while this one's runs)
    OB = spec.out_bits
    RB = K * OB // 8  # output bytes per pixel (4-bit: staged packed)
    # staging pitch per pixel (bytes): the four lanes q of a quad write pixels 2q apart into distinct banks
    KP = RB + 16
    PIPE = kn.pipe == 1
    ST_OFF = 2 * HALO
    ST_BYTES = Q * KP  # a staging tile (PIPE: two, rows alternating, so one barrier per row)
    SMEM = ST_OFF + (2 if PIPE else 1) * ST_BYTES
    assert SMEM == halo_smem(spec, kn)
    IPI = -(-P // TH)  # items per image
    ITEMS = N * IPI
    GRID = min(ITEMS, kn.minb * (sms or arch_info(arch).sms))
    KS = R * S // 2  # k32 steps (tap pairs)
    NACC = Q // 2  # accumulator registers per thread (m64 x nQ / 128)
    LD_IT = -(-HR * W // THREADS)  # 16-byte copies per thread and item
    CPX = RB // 16  # 16-byte chunks per pixel
    NCH = Q * CPX  # staged 16-byte chunks per row
    ST_IT = -(-NCH // THREADS)  # ... per thread
    x_st, o_st = ConvSpec.storage(spec.x_dtype), ConvSpec.storage(spec.out_dtype)
    xs, ws, os_ = spec.shapes()
    pad = spec.pad_value & 0xFF
    padw = T.uint32(pad * 0x01010101)
    zo, lo, hi = spec.zo, spec.lo, spec.hi
    omask = 15 if OB == 4 else 255
    b_t = "s8" if spec.x_signed else "u8"
    mma = T.ptx[f"wgmma.mma_async.sync.aligned.m64n{Q}k32.s32.s8.{b_t}"]

    def desc(base, off):
        """No-swizzle K-major descriptor of the halo at byte ``off``: 8-pixel core matrices SBO = 128 bytes apart
        (N), the next tap's LBO = 16 bytes on (K)."""
        return base + T.Cast("uint64", T.shift_right(off, 4))

    @T.macro
    def load_item(xw, Sm, item, buf, tid):
        """The halo rows of ``item`` into buffer ``buf``: input pixels by cp.async, rows outside the input set to the
        padding value (the pad columns were set once)."""
        n = T.truncdiv(item, IPI)  # (truncating: every index here is >= 0; floor division adds sign fix-ups)
        oh0 = T.truncmod(item, IPI) * TH
        for it in T.unroll(LD_IT):
            L = it * THREADS + tid
            if L < HR * W:
                t = T.truncdiv(L, W)
                iw = T.truncmod(L, W)
                ih = oh0 + t - pt
                soff = buf * HALO + (t * PITCH + iw + pl) * 16
                if 0 <= ih and ih < H:
                    T.evaluate(T.ptx.cp.async_.cg.shared.global_(
                        T.address_of(Sm[soff]), T.address_of(xw[((n * H + ih) * W + iw) * 16]), 16, T.uint32(16)))
                else:
                    T.evaluate(T.ptx.st.shared.v4.b32(T.address_of(Sm[soff]), padw, padw, padw, padw))

    @T.macro
    def issue_row(acc, ab, ar, d0, k, i):
        """The wgmmas of output row i of item k's halo (buffer k % 2) into accumulators acc[ab : ab + NACC]: one per tap
        pair, B = the halo row at the tap's first pixel; committed as one group."""
        T.ptx.wgmma.fence.sync.aligned()
        for r in T.unroll(R):
            for p in T.unroll(S // 2):
                T.evaluate(mma(*[acc[ab + e] for e in range(NACC)], *[ar[(r * (S // 2) + p) * 4 + e] for e in range(4)],
                               desc(d0[0], (k % 2) * HALO + ((i + r) * PITCH + 2 * p) * 16),
                               T.ptx.pred(T.int32(0 if r == 0 and p == 0 else 1))))
        T.ptx.wgmma.commit_group.sync.aligned()

    @T.macro
    def epilogue(acc, ab, prm, sb, ow, Sm, n, oh, st, tid):
        """Output row (n, oh) from its accumulators acc[ab : ab + NACC]: stage 1 into staging tile ``st``, one
        barrier, then the row out in 16-byte reads and stores, every read issued before the stores."""
        lane = tid % 32
        c0 = tid // 32 * 16 + lane // 4 * 2  # this thread's channels c0, c0 + 1 (its accumulator rows g, g + 8)
        q = lane % 4
        sbase = ST_OFF + st * ST_BYTES
        # 5. stage 1 on the accumulators: channels c0, c0 + 1 of pixels 8j + 2q + e, one staged store per pair (8-bit:
        #    two bytes; 4-bit: one packed byte, the even channel in the low nibble)
        for j in T.unroll(Q // 8):
            for e in T.unroll(2):
                v = T.meta_var([T.bitwise_and(T.Cast("int32", requant_stage1(
                    T.reinterpret("int32", acc[ab + j * 4 + e2 * 2 + e]) + prm[e2 * 3], prm[e2 * 3 + 1],
                    prm[e2 * 3 + 2], spec.shift_ge33, zo, lo, hi)), omask) for e2 in range(2)])
                px = j * 8 + q * 2 + e
                if OB == 4:
                    T.evaluate(T.ptx.st.shared.b8(T.address_of(Sm[sbase + px * KP + c0 // 2]),
                                                  T.Cast("uint32", T.bitwise_or(v[0], T.shift_left(v[1], 4)))))
                else:
                    T.evaluate(T.ptx.st.shared.b16(T.address_of(Sm[sbase + px * KP + c0]),
                                                   T.Cast("uint32", T.bitwise_or(v[0], T.shift_left(v[1], 8)))))
        T.tvm_storage_sync("shared")
        # 6. the staged row out, 16 bytes per read and store (reads clamped to the tile so that they need no branch)
        obase = (n * P + oh) * Q * RB // 4  # (words)
        for it in T.unroll(ST_IT):
            L = T.min(it * THREADS + tid, NCH - 1)
            T.evaluate(T.ptx.ld.shared.v4.b32(
                sb[it * 4], sb[it * 4 + 1], sb[it * 4 + 2], sb[it * 4 + 3],
                T.address_of(Sm[sbase + T.truncdiv(L, CPX) * KP + T.truncmod(L, CPX) * 16])))
        for it in T.unroll(ST_IT):
            L = it * THREADS + tid
            if (it + 1) * THREADS <= NCH or L < NCH:
                for e in T.vectorized(4):
                    ow[obase + L * 4 + e] = sb[it * 4 + e]

    @T.prim_func
    def conv(x: T.Buffer(xs, x_st), w: T.Buffer(ws, "int8"), bias: T.Buffer((K,), "int32"),
             Mq: T.Buffer((K,), "int32"), Sq: T.Buffer((K,), "int32"), out: T.Buffer(os_, o_st)):
        T.func_attr({"tir.noalias": True})
        bid = T.launch_thread("blockIdx.x", GRID)
        tid = T.launch_thread("threadIdx.x", THREADS)
        T.attr(0, "tirx.launch_bounds_min_blocks_per_sm", kn.minb)
        xw = T.decl_buffer((N * H * W * 16,), x_st, data=x.data)
        w32 = T.decl_buffer((K * R * S * 4,), "uint32", data=w.data)
        ow = T.decl_buffer((N * P * Q * RB // 4,), "uint32", data=out.data)
        Sm = T.alloc_buffer((SMEM,), "uint8", scope="shared.dyn")
        ar = T.alloc_buffer((KS * 4,), "uint32", scope="local")  # this thread's weight fragments, every k-step
        acc = T.alloc_buffer(((2 if PIPE else 1) * NACC,), "uint32", scope="local")  # (PIPE: two sets, rows alternating)
        prm = T.alloc_buffer((6,), "int32", scope="local")  # bias, M, S of channels c0 and c0 + 1
        sb = T.alloc_buffer((4 * ST_IT,), "uint32", scope="local")
        d0 = T.alloc_buffer((1,), "uint64", scope="local")
        warp = tid // 32
        lane = tid % 32
        g = lane // 4
        q = lane % 4
        c0 = warp * 16 + g * 2
        # 1. the weights as wgmma A fragments and the epilogue constants of the thread's two channels, loaded once. The
        #    MMA's rows are a permutation of the output channels: row 16 warp + g + 8 e2 is channel c0 + e2, so that a
        #    thread's two channels are adjacent (its fragments: rows g, g + 8; bytes 4q..4q+3 and 16+4q.. of each k32)
        for ks in T.unroll(KS):
            for h in T.unroll(2):
                for e2 in T.unroll(2):
                    ar[ks * 4 + h * 2 + e2] = w32[(c0 + e2) * (R * S * 4) + ks * 8 + h * 4 + q]
        for e2 in T.unroll(2):
            prm[e2 * 3] = bias[c0 + e2]
            prm[e2 * 3 + 1] = Mq[c0 + e2]
            prm[e2 * 3 + 2] = Sq[c0 + e2]
        d0[0] = T.bitwise_or(T.Cast("uint64", T.shift_right(T.cuda.cvta_generic_to_shared(Sm.access_ptr("r")), 4)),
                             T.uint64((1 << 16) | (8 << 32)))  # LBO 16 bytes, SBO 128 bytes, no swizzle
        # 2. the pad columns of both halo buffers (the same for every item)
        for L in T.serial((2 * HR * (PITCH - W) + THREADS - 1) // THREADS):
            j = L * THREADS + tid
            if j < 2 * HR * (PITCH - W):
                col = T.truncmod(j, PITCH - W)
                row = T.truncdiv(j, PITCH - W)
                T.evaluate(T.ptx.st.shared.v4.b32(
                    T.address_of(Sm[(row * PITCH + T.if_then_else(col < pl, col, col + W)) * 16]),
                    padw, padw, padw, padw))
        # 3. the block's items: the next one's halo copied while this one's rows run
        cnt = T.truncdiv(ITEMS - bid + GRID - 1, GRID)
        load_item(xw, Sm, bid, 0, tid)
        T.ptx.cp.async_.commit_group()
        for k in T.serial(cnt):
            if k + 1 < cnt:
                load_item(xw, Sm, bid + (k + 1) * GRID, (k + 1) % 2, tid)
            T.ptx.cp.async_.commit_group()
            T.ptx.cp.async_.wait_group(1)
            T.ptx.fence.proxy.async_.shared__cta()  # cp.async / st.shared writes, visible to wgmma
            T.tvm_storage_sync("shared")
            item = bid + k * GRID
            n = T.truncdiv(item, IPI)
            oh0 = T.truncmod(item, IPI) * TH
            if PIPE:  # row 0 in flight before the loop
                issue_row(acc, 0, ar, d0, k, 0)
            for i in (T.unroll(TH) if PIPE else T.serial(TH)):
                if oh0 + i < P:
                    if PIPE:  # row i + 1 in flight while row i's epilogue runs (the other accumulator set)
                        if i + 1 < TH and oh0 + i + 1 < P:
                            issue_row(acc, (i + 1) % 2 * NACC, ar, d0, k, i + 1)
                            T.ptx.wgmma.wait_group.sync.aligned(1)
                        else:
                            T.ptx.wgmma.wait_group.sync.aligned(0)
                        epilogue(acc, i % 2 * NACC, prm, sb, ow, Sm, n, oh0 + i, i % 2, tid)
                    else:
                        issue_row(acc, 0, ar, d0, k, i)
                        T.ptx.wgmma.wait_group.sync.aligned(0)
                        epilogue(acc, 0, prm, sb, ow, Sm, n, oh0 + i, 0, tid)
                        T.tvm_storage_sync("shared")

    return conv.with_attr("qcompile.knobs", str(kn)).with_attr("qcompile.strategy", "direct_halo")
