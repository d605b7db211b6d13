"""Max pooling over 8-bit NHWC tensors as a TIR kernel (the stem's 3x3 / stride-2 pool of ResNet).

    y[n, p, q, c] = max over (r, s) with 0 <= p*sh - pt + r < H, 0 <= q*sw - pl + s < W of x[n, p*sh - pt + r, q*sw - pl + s, c]

(the minimum of the type where the window holds no input: TVM's max_pool2d pads with it). Each thread takes 16
channels (4 when C % 16, or when that leaves fewer than 32768 threads) of one output position as 32-bit words, loaded as one vector per window position, and
reduces them with the byte-wise SIMD max (``__vmaxu4`` / ``__vmaxs4``: 4 channels per instruction); window positions
outside the input are skipped. TVM's legalized pool, scheduled by dlight, runs one byte per thread (ResNet-50's at batch
256 on the H100, side by side in ``scripts/check_pools.py``: dlight 225 us, ``glue.ChannelsLastWindowReduction`` 155 us,
this kernel 99.6 us).
"""
from __future__ import annotations

from tvm.script import tirx as T

THREADS = 256


def max_pool_nhwc_applies(shape, dtype: str, pool, strides, padding, dilation=(1, 1), ceil_mode=False) -> bool:
    """Whether ``max_pool_nhwc_kernel`` takes this pool (8-bit, channels a multiple of 4, no dilation, floor mode)."""
    return (dtype in ("int8", "uint8") and len(shape) == 4 and int(shape[3]) % 4 == 0 and tuple(dilation) == (1, 1)
            and not ceil_mode and len(pool) == 2 and len(strides) == 2 and len(padding) == 4)


def max_pool_packed4_applies(shape, dtype: str, pool, strides, padding, dilation=(1, 1), ceil_mode=False) -> bool:
    """Whether ``max_pool_nhwc_kernel(..., packed4=...)`` takes this pool of a 4-bit tensor with ``shape`` (its logical
    NHWC shape): whole 32-bit words of packed channels (C % 8 == 0), and every window holding an input position (each
    pad smaller than the window), so that no output is the padding's value -- which 4 bits cannot hold."""
    return (max_pool_nhwc_applies(shape, dtype, pool, strides, padding, dilation, ceil_mode) and int(shape[3]) % 8 == 0
            and max(padding[0], padding[2]) < pool[0] and max(padding[1], padding[3]) < pool[1])


def max_pool_relax_func(name: str, *args, **kw):
    """``max_pool_nhwc_kernel(*args, **kw)`` as the scheduled PrimFunc a Relax module calls (``name``): how both pool
    dispatchers (8-bit ``DispatchPools``, packed 4-bit ``DispatchTensorCore``) add it."""
    return max_pool_nhwc_kernel(*args, **kw).with_attr("op_pattern", 8).with_attr("global_symbol", name).with_attr(
        "tirx.is_scheduled", True)


def max_pool_nhwc_kernel(N: int, H: int, W: int, C: int, dtype: str, pool=(3, 3), strides=(2, 2),
                         padding=(1, 1, 1, 1), packed4: str = ""):
    """PrimFunc ``(x [N, H, W, C], y [N, P, Q, C])`` (``dtype`` int8 / uint8; padding top, left, bottom, right).

    ``packed4`` "uint4" / "int4": x and y are 4-bit tensors packed two per byte ([N, H, W, C / 2] bytes of ``dtype``,
    low nibble first; ``max_pool_packed4_applies``). Each word's even and odd nibbles are reduced apart, as bytes
    (``w & 0x0F0F0F0F``, ``(w >> 4) & 0x0F0F0F0F``; signed nibbles first XOR 8, which orders them as unsigned), and
    packed again: half the bytes of the 8-bit pool read and written, and no pack kernel after it."""
    R, S = pool
    sh, sw = strides
    pt, pl, pb, pr = padding
    P, Q = (H + pt + pb - R) // sh + 1, (W + pl + pr - S) // sw + 1
    P4, signed = bool(packed4), dtype == "int8"
    CW = C // (8 if P4 else 4)  # 32-bit words per pixel
    # words per thread: 4 (one 16-byte load per window position) where that still leaves >= 32768 threads (batch 8 and
    # up for ResNet's pool), else 1 (batch 1: 4x the threads, 4-byte loads)
    V = 4 if CW % 4 == 0 and N * P * Q * CW // 4 >= 32768 else 1
    CV = CW // V
    total = N * P * Q * CV
    vmax = "__vmaxs4" if signed and not P4 else "__vmaxu4"
    ident = 0x80808080 if signed and not P4 else 0  # the type's minimum in every byte (packed: 0 after the flip)
    flip = T.uint32(0x88888888 if signed and P4 else 0)  # signed nibbles XOR 8: ordered as unsigned
    m4 = T.uint32(0x0F0F0F0F)

    def field(w, h):  # (packed) the even (h = 0) / odd (h = 1) nibbles of word w, one per byte; else the word
        return T.bitwise_and(T.shift_right(w, T.uint32(4 * h)), m4) if P4 else w

    @T.prim_func(s_tir=True)  # (a root block: Relax's reshape-pattern analysis expects one in single-input calls)
    def max_pool(x: T.Buffer((N, H, W, CW * 4), dtype), y: T.Buffer((N, P, Q, CW * 4), dtype)):
        T.func_attr({"tir.noalias": True})
        with T.sblock("root"):
            xw = T.decl_buffer((N * H * W * CW,), "uint32", data=x.data)
            yw = T.decl_buffer((N * P * Q * CW,), "uint32", data=y.data)
            for bx in T.thread_binding((total + THREADS - 1) // THREADS, thread="blockIdx.x"):
                for tx in T.thread_binding(THREADS, thread="threadIdx.x"):
                    acc = T.alloc_buffer((2 * V,), "uint32", scope="local")  # (packed: even nibbles, then odd ones)
                    v_in = T.alloc_buffer((V,), "uint32", scope="local")
                    i = bx * THREADS + tx
                    if i < total:
                        pix = i // CV
                        q = pix % Q
                        p = pix // Q % P
                        n = pix // (P * Q)
                        for v in T.unroll(2 * V if P4 else V):
                            acc[v] = T.uint32(ident)
                        for r in T.unroll(R):
                            for s in T.unroll(S):
                                ih = p * sh - pt + r
                                iw = q * sw - pl + s
                                if 0 <= ih and ih < H and 0 <= iw and iw < W:
                                    for v in T.vectorized(V):
                                        v_in[v] = T.bitwise_xor(xw[((n * H + ih) * W + iw) * CW + i % CV * V + v], flip)
                                    for h in T.unroll(2 if P4 else 1):
                                        for v in T.unroll(V):
                                            acc[h * V + v] = T.call_pure_extern("uint32", vmax, acc[h * V + v],
                                                                                field(v_in[v], h))
                        if P4:
                            for v in T.unroll(V):
                                acc[v] = T.bitwise_xor(T.bitwise_or(acc[v], T.shift_left(acc[V + v], T.uint32(4))), flip)
                        for v in T.vectorized(V):
                            yw[pix * CW + i % CV * V + v] = acc[v]

    return max_pool
