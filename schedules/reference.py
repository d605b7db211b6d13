"""NumPy integer reference for the project-wide quantized conv2d math, and the kernels' buffer formats."""
from __future__ import annotations

import numpy as np

from qcompile import int4

from .spec import ConvSpec


def to_storage(vals: np.ndarray, dtype: str) -> np.ndarray:
    """Logical integer values -> the buffer content the kernels take (packed for 4-bit)."""
    if dtype in ("int4", "uint4"):
        p = int4.pack(vals, pad_odd=True)
        return p.view(np.int8) if dtype == "int4" else p
    return np.asarray(vals).astype(dtype)


def expand_w4(w: np.ndarray, kperm: int = 0) -> np.ndarray:
    """4-bit weights (logical values, channels last, C % 32 == 0) -> the int8 buffer a ``GemmKnobs.w8`` kernel takes:

        out[..., 32g + j]      = 16 * w[..., 32g + 2j]        (j < 16: the even channels of group g)
        out[..., 32g + 16 + j] = 16 * w[..., 32g + 2j + 1]    (then the odd ones)

    the order and scale in which the kernels' nibble split delivers the 4-bit A values (x16, evens then odds per 16
    packed bytes), so the accumulators hold 256 x the sum as with both operands unpacked in the kernel.

    ``kperm`` = BK (a ``GemmKnobs.agl`` kernel, w [K, R, S, C]): first the reduction (r, s, c), flattened, is permuted
    in words of 8 values within each K-chunk of 2*BK values -- word 4j + q of a chunk takes word q*(BK/16) + j (the
    A word thread q of a quad loads for k-step j) -- then expanded as above."""
    w = np.asarray(w).astype(np.int64)
    C = w.shape[-1]
    if C % 32:
        raise ValueError(f"expand_w4: {C} channels, not a multiple of 32")
    if kperm:
        ks, red = kperm // 16, int(np.prod(w.shape[1:]))
        if kperm % 32 or red % (2 * kperm):
            raise ValueError(f"expand_w4: reduction of {red} values is not whole K-chunks of {kperm} packed bytes")
        w = w.reshape(w.shape[0], red // (2 * kperm), 4, ks, 8).swapaxes(2, 3).reshape(w.shape)
    g = w.reshape(w.shape[:-1] + (C // 32, 16, 2)).swapaxes(-1, -2)
    return (16 * g).reshape(w.shape).astype(np.int8)


def permute_k8(w: np.ndarray, kperm: int) -> np.ndarray:
    """8-bit weights (logical values, w [K, R, S, C]) -> the int8 buffer a ``GemmKnobs.agl`` kernel on 8-bit operands
    takes: the reduction (r, s, c), flattened, permuted in 4-byte words within each K-chunk of ``kperm`` bytes, and
    the 16-bit halves of each word swapped --

        out[chunk, 8 ks + 4 h + q] = rot16(w[chunk, q (kperm / 16) + 2 ks + h])     (words; h = 0, 1; q = 0..3)

    thread q of a quad loads bytes [q kperm/4, (q+1) kperm/4) of its A rows and uses their words 2 ks and 2 ks + 1,
    halves swapped, as its fragment words of k-step ks (k 4q.. and 16 + 4q.. of the step's 32), so B must hold, at
    those k, the weights of the activations the words carry."""
    w = np.asarray(w)
    red = int(np.prod(w.shape[1:]))
    if kperm % 32 or red % kperm:
        raise ValueError(f"permute_k8: reduction of {red} bytes is not whole K-chunks of {kperm} bytes")
    ks = kperm // 32
    p = w.reshape(w.shape[0], red // kperm, 4, ks, 2, 4).transpose(0, 1, 3, 4, 2, 5)[..., [2, 3, 0, 1]]
    return np.ascontiguousarray(p).reshape(w.shape).astype(np.int8)


def from_storage(buf: np.ndarray, dtype: str, n: int | None = None) -> np.ndarray:
    """A kernel buffer -> its logical values (int64); 4-bit buffers unpacked, the first ``n`` values kept."""
    if dtype in ("int4", "uint4"):
        return int4.unpack(buf, signed=dtype == "int4", count=n).astype(np.int64)
    return np.asarray(buf).astype(np.int64)


def value_range(dtype: str):
    return {"int8": (-128, 127), "uint8": (0, 255), "int4": (-8, 7), "uint4": (0, 15),
            "int32": (-(1 << 31), (1 << 31) - 1)}[dtype]


def conv_acc_nhwc(x: np.ndarray, w: np.ndarray, spec: ConvSpec) -> np.ndarray:
    """int64 accumulator of conv over logical values x[N,H,W,C], w[K,R,S,C] -> [N,P,Q,K]."""
    sh, sw = spec.strides
    dh, dw = spec.dilations
    pt, pl, pb, pr = spec.pads
    N, H, W, C = x.shape
    xp = np.full((N, H + pt + pb, W + pl + pr, C), spec.pad_value, np.int64)
    xp[:, pt:pt + H, pl:pl + W, :] = x
    P, Q = spec.P, spec.Q
    acc = np.zeros((N, P, Q, spec.K), np.int64)
    wt = w.astype(np.int64)
    for r in range(spec.R):
        for s in range(spec.S):
            patch = xp[:, r * dh: r * dh + sh * (P - 1) + 1: sh, s * dw: s * dw + sw * (Q - 1) + 1: sw, :]
            acc += np.tensordot(patch, wt[:, r, s, :], axes=([3], [1]))
    return acc


def requant(acc, bias, M, S, spec: ConvSpec, res=None):
    """acc int [.., K] (int32-range) -> output logical values per the project math (see ConvSpec).
    ``res``: None, or (residual logical values, rq2 int32[5, K]) for the two-stage residual epilogue."""
    t = (acc.astype(np.int64) + bias.astype(np.int64))
    t = ((t + (1 << 31)) % (1 << 32)) - (1 << 31)  # int32 wrap, as the shift_ge33 path adds (the int64 path agrees
    #                                                wherever t fits int32)
    v = t * M.astype(np.int64)
    S64 = S.astype(np.int64)
    if spec.shift_ge33:
        assert S64.min() >= 33, "shift_ge33 needs every S >= 33"
    v = (v + (np.int64(1) << (S64 - 1))) >> S64
    if spec.out_dtype == "int32" and not spec.has_residual:
        return np.clip(v + spec.zo, max(spec.lo, -(1 << 31)), min(spec.hi, (1 << 31) - 1))
    y = np.clip(v + spec.zo, spec.lo, spec.hi)
    if res is None:
        return y
    r, rq2 = res
    if spec.rq2_uniform:  # the kernels use the compiled-in values: the buffer must hold the same
        assert (np.asarray(rq2) == np.asarray(spec.rq2_uniform)[:, None]).all(), "rq2 differs from rq2_uniform"
    c1, M1, c2, M2, S2 = (np.asarray(a, np.int64) for a in np.asarray(rq2))
    a, b = (y + c1) * M1, (np.asarray(r, np.int64) + c2) * M2
    v = a + b + (np.int64(1) << (S2 - 1))
    if spec.res_i32:  # the kernels compute this stage in int32: every intermediate must fit
        for t in (a, b, a + b, v):
            assert np.abs(t).max() < 2**31, "res_i32 residual stage overflows int32"
    v = v >> S2
    return np.clip(v + spec.zo2, spec.lo2, spec.hi2)


def residual_args(spec: ConvSpec, res) -> list:
    """Kernel arguments (storage) for ``res`` = (residual values, rq2), or [] without a residual."""
    if res is None:
        return []
    r, rq2 = res
    return [to_storage(r, spec.res_dtype), np.ascontiguousarray(rq2, dtype=np.int32)]


def conv_reference(spec: ConvSpec, x_log, w_log, bias, M, S, res_log=None):
    """Reference on LOGICAL values in the spec's layout. Returns logical output values in layout."""
    if spec.layout == "HWNC":
        x_n = np.transpose(x_log, (2, 0, 1, 3))
        w_n = np.transpose(w_log, (2, 0, 1, 3))
        r_n = None if res_log is None else (np.transpose(res_log[0], (2, 0, 1, 3)), res_log[1])
    else:
        x_n, w_n, r_n = x_log, w_log, res_log
    acc = conv_acc_nhwc(x_n, w_n, spec)
    y = requant(acc, bias, M, S, spec, r_n)
    if spec.layout == "HWNC":
        y = np.transpose(y, (1, 2, 0, 3))
    return y


def random_problem(spec: ConvSpec, rng: np.random.Generator):
    """Fresh random logical inputs (never zeros) + per-channel requant params that keep outputs varied."""
    xs = spec.shapes()[0][:-1] + (spec.C,)
    ws = spec.shapes()[1][:-1] + (spec.C,)
    xlo, xhi = value_range(spec.x_dtype)
    wlo, whi = (-8, 7) if spec.w_bits == 4 else (-128, 127)
    x = rng.integers(xlo, xhi + 1, xs)
    w = rng.integers(wlo, whi + 1, ws)
    K = spec.K
    kred = spec.R * spec.S * spec.C
    # scale so that outputs cover the output range: acc std ~ sqrt(kred)*sx*sw
    sx = (xhi - xlo) / 3.5
    sw_ = (whi - wlo) / 3.5
    acc_std = max(1.0, np.sqrt(kred) * sx * sw_)
    bias = rng.integers(-int(acc_std) - 1, int(acc_std) + 1, K).astype(np.int32)
    olo, ohi = value_range(spec.out_dtype)
    target = (min(ohi, 1 << 20) - max(olo, -(1 << 20))) / 4
    S = (rng.integers(33, 41, K) if spec.shift_ge33 else rng.integers(20, 31, K)).astype(np.int32)
    M = np.round(target / acc_std * (2.0 ** S.astype(np.float64)) * rng.uniform(0.5, 1.5, K)).astype(np.int64)
    M = np.clip(M, 1, (1 << 31) - 1) * rng.choice([1, -1], K, p=[0.8, 0.2])
    M = M.astype(np.int32)
    res = None
    if spec.has_residual:
        # stage 2 mixes y1 and res with similar weights so that both move the output
        os_ = spec.shapes()[2][:-1] + (spec.K,)
        rlo, rhi = value_range(spec.res_dtype)
        r = rng.integers(rlo, rhi + 1, os_)
        olo, ohi = spec.lo2, spec.hi2
        span = (ohi - olo) / max(1, (spec.hi - spec.lo) + (rhi - rlo))
        S2 = rng.integers(12, 21, K) if spec.res_i32 else rng.integers(16, 31, K)
        M1 = np.round(span * rng.uniform(0.6, 1.4, K) * 2.0 ** S2)
        M2 = np.round(span * rng.uniform(0.6, 1.4, K) * 2.0 ** S2)
        c1 = rng.integers(-3, 4, K)
        c2 = rng.integers(-3, 4, K)
        rq2 = np.stack([c1, np.clip(M1, 1, 2**31 - 1), c2, np.clip(M2, 1, 2**31 - 1), S2]).astype(np.int32)
        if spec.rq2_uniform:
            rq2 = np.repeat(np.asarray(spec.rq2_uniform, np.int32)[:, None], K, axis=1)
        res = (r, rq2)
    return x, w, bias, M, S, res
