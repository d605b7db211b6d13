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


def max_pool_nhwc_kernel(N: int, H: int, W: int, C: int, dtype: str, pool=(3, 3), strides=(2, 2),
                         padding=(1, 1, 1, 1)):
    """PrimFunc ``(x [N, H, W, C], y [N, P, Q, C])`` (``dtype`` int8 / uint8; padding top, left, bottom, right)."""
    R, S = pool
    sh, sw = strides
    pt, pl, pb, pr = padding
    P, Q = (H + pt + pb - R) // sh + 1, (W + pl + pr - S) // sw + 1
    CW = C // 4  # 32-bit words per pixel
    # words per thread: 4 (one 16-byte load per window position) where that still leaves >= 32768 threads (batch 8 and
    # up for ResNet's pool), else 1 (batch 1: 4x the threads, 4-byte loads)
    V = 4 if CW % 4 == 0 and N * P * Q * CW // 4 >= 32768 else 1
    CV = CW // V
    total = N * P * Q * CV
    vmax = "__vmaxs4" if dtype == "int8" else "__vmaxu4"
    ident = 0x80808080 if dtype == "int8" else 0  # the type's minimum in every byte

    @T.prim_func(s_tir=True)  # (a root block: Relax's reshape-pattern analysis expects one in single-input calls)
    def max_pool(x: T.Buffer((N, H, W, C), dtype), y: T.Buffer((N, P, Q, C), dtype)):
        T.func_attr({"tir.noalias": True})
        with T.sblock("root"):
            xw = T.decl_buffer((N * H * W * CW,), "uint32", data=x.data)
            yw = T.decl_buffer((N * P * Q * CW,), "uint32", data=y.data)
            for bx in T.thread_binding((total + THREADS - 1) // THREADS, thread="blockIdx.x"):
                for tx in T.thread_binding(THREADS, thread="threadIdx.x"):
                    acc = T.alloc_buffer((V,), "uint32", scope="local")
                    v_in = T.alloc_buffer((V,), "uint32", scope="local")
                    i = bx * THREADS + tx
                    if i < total:
                        pix = i // CV
                        q = pix % Q
                        p = pix // Q % P
                        n = pix // (P * Q)
                        for v in T.vectorized(V):
                            acc[v] = T.uint32(ident)
                        for r in T.unroll(R):
                            for s in T.unroll(S):
                                ih = p * sh - pt + r
                                iw = q * sw - pl + s
                                if 0 <= ih and ih < H and 0 <= iw and iw < W:
                                    for v in T.vectorized(V):
                                        v_in[v] = xw[((n * H + ih) * W + iw) * CW + i % CV * V + v]
                                    for v in T.unroll(V):
                                        acc[v] = T.call_pure_extern("uint32", vmax, acc[v], v_in[v])
                        for v in T.vectorized(V):
                            yw[pix * CW + i % CV * V + v] = acc[v]

    return max_pool
