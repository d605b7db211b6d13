"""GPU tier (``pytest -m gpu``): every kernel strategy the selector can pick on this host's GPU, run on the GPU and
compared bit for bit with the independent NumPy reference (tests/kernel_reference.py).

Each case builds its kernel(s) with ``qcompile.schedules`` (``conv2d_int_plan`` / ``conv2d_int_kernel`` with a forced
strategy and knobs, or the max-pool kernel) for the arch the GPU runs: sm_90 on compute capability 9.0; the sm_89 PTX
(JIT-compiled by the driver) on newer GPUs; else the newest of sm_75/80/86/89 the GPU supports. Cases for
sm_90-only kernels (wgmma, ``implicit_gemm_t``, ``direct_halo``) run on sm_90 alone. The output buffer is poisoned
(filled with a sentinel, then with its complement) before each run, so every byte must be written; split-K and
stream-K workspaces start poisoned, stream-K's tile counters must be zero again after the kernel.

Building and running are separate steps -- ``build_case(case, arch, mode) -> (module, calls)`` (``calls``: plain
JSON data), then ``make_problem``, ``inputs``, ``run`` and ``check`` (``check_on_gpu`` does all four) -- and the
running half needs only NumPy and the TVM runtime, so a module exported on a build machine can be checked on a GPU
host that has no compiler.
Inputs are packed to the kernels' storage format by this file's own packers, written from the documented
convention (4-bit: element 2i in the low nibble; expanded and k-permuted weights: docs/SCHEDULES.md).
"""
from __future__ import annotations

import zlib

import numpy as np
import pytest

import kernel_reference as kr
from conftest import gpu_compute_capability

# ---------------------------------------------------------------------------------------------------------------
# the cases: (name, kind, spec fields, strategy, knobs, plan, sm_90 only)
# ---------------------------------------------------------------------------------------------------------------
U8 = dict(x_dtype="uint8", w_bits=8, out_dtype="uint8", zo=3, lo=0, hi=255)
I8 = dict(x_dtype="int8", w_bits=8, out_dtype="int8", zo=-2, lo=-128, hi=127)
U4 = dict(x_dtype="uint4", w_bits=4, out_dtype="uint4", zo=1, lo=0, hi=15)
I4 = dict(x_dtype="int4", w_bits=4, out_dtype="int8", zo=-1, lo=-128, hi=127)
RES8 = dict(has_residual=True, res_dtype="uint8", zo2=-1, lo2=0, hi2=255)
RES4 = dict(has_residual=True, res_dtype="uint4", zo2=0, lo2=0, hi2=15, rq2_uniform=(2, 1 << 19, -1, 1 << 19, 20))
L = dict(N=2, H=9, W=9, C=64, K=64, R=3, S=3, padding=1)  # a small 3x3 layer
WG = dict(BM=128, BN=128, BK=128, WM=2, WN=1, stages=3, pipe=-1, mma="wgmma")
SYNC = "arch-defaults"  # knobs: DEFAULT_KNOBS[arch], the mma.sync kernel every arch has


def _case(name, spec, strategy=None, knobs=None, plan=False, sm90=False, kind="conv"):
    return dict(name=name, kind=kind, spec=spec, strategy=strategy, knobs=knobs, plan=plan, sm90=sm90)


CASES = [
    # implicit GEMM, mma.sync (the arch defaults): 8/4-bit, residual, stride 2, non-zero pad values, int32 output;
    # "wrap": t = acc + bias overflows int32 on three channels (kernels with shift_ge33, whose stage 1 is int32)
    _case("igemm_sync_u8_res_pad", dict(L, **U8, **RES8, pad_value=17), "implicit_gemm", SYNC),
    _case("igemm_sync_i8_s2_ge33_wrap", dict(L, stride=2, H=11, W=11, K=32, **I8, pad_value=-5, shift_ge33=True),
          "implicit_gemm", SYNC),
    _case("igemm_sync_u8_i32out", dict(L, C=32, x_dtype="uint8", w_bits=8, out_dtype="int32", zo=7, lo=-(1 << 31),
                                       hi=(1 << 31) - 1), "implicit_gemm", SYNC),
    # (packed 4-bit input with a non-zero pad value: the pad byte carries the value in both nibbles)
    _case("igemm_sync_u4_res_pad", dict(L, **U4, **RES4, pad_value=3), "implicit_gemm", SYNC),
    _case("igemm_sync_u4_res", dict(L, **U4, **RES4), "implicit_gemm", SYNC),
    _case("igemm_sync_i4_1x1", dict(L, R=1, S=1, padding=0, C=128, **I4), "implicit_gemm", SYNC),
    # implicit GEMM as the selector and the tuning log give it (sm_90: the wgmma defaults, 4-bit with expanded weights)
    _case("igemm_auto_u8", dict(L, N=4, **U8), None, None),
    _case("igemm_auto_u4_res", dict(L, N=4, **U4, **RES4), None, None),
    # wgmma kernels (sm_90a): 8-bit with residual, erq with 4-bit output, the 4-bit loaders (register A, expanded
    # weights with A from global memory: k-permuted weights), 8-bit agl (k-permuted), ping-pong, persistent
    _case("igemm_wg_u8_res", dict(L, **U8, **RES8), "implicit_gemm", WG, sm90=True),
    _case("igemm_wg_i8_erq_u4out", dict(L, **dict(I8, out_dtype="uint4", zo=1, lo=0, hi=15)), "implicit_gemm",
          dict(WG, BM=64, BN=64, WM=1, erq=True), sm90=True),
    _case("igemm_wg_u4_areg", dict(L, **U4), "implicit_gemm", dict(WG, BK=64, stages=2, pstages=3, areg=True),
          sm90=True),
    _case("igemm_wg_u4_w8_agl_wrap", dict(L, C=128, **U4, shift_ge33=True), "implicit_gemm",
          dict(WG, BK=64, WM=1, BN=64, stages=3, pstages=3, areg=True, w8=True, awarp=True, agl=True), sm90=True),
    _case("igemm_wg_i8_agl8_res", dict(L, **dict(I8, out_dtype="uint8"), **RES8, res_i32=True), "implicit_gemm",
          dict(WG, BK=64, BM=64, WM=1, BN=64, stages=3, pstages=3, areg=True, w8=True, awarp=True, agl=True),
          sm90=True),
    _case("igemm_wg_pingpong_u8", dict(L, N=8, **U8), "implicit_gemm", dict(WG, WM=1, BM=64, pp=True, stages=4),
          sm90=True),
    _case("igemm_wg_persist_u8", dict(L, N=4, **U8), "implicit_gemm", dict(WG, erq=True, persist=1), sm90=True),
    # transposed implicit GEMM (sm_90a; C, K multiples of 128, zero padding, no residual)
    _case("igemm_t_u8", dict(L, C=128, K=128, **U8), "implicit_gemm_t", None, sm90=True),
    _case("igemm_t_i4", dict(L, C=128, K=128, **dict(I4, out_dtype="int4", zo=0, lo=-8, hi=7)), "implicit_gemm_t",
          None, sm90=True),
    # direct HWNC (batch a multiple of 8): 8-bit with a residual and a pad value, 4-bit
    _case("direct_hwnc_u8_res_pad", dict(L, N=8, layout="HWNC", **U8, **RES8, pad_value=9), "direct_hwnc", None),
    _case("direct_hwnc_u4", dict(L, N=8, layout="HWNC", **U4), "direct_hwnc", None),
    # the stem's direct kernel (sm_90a): its space-to-depth conv (16 channels, 4x4, stride 1), pad values
    _case("direct_halo_u8_pad", dict(N=2, H=32, W=32, C=16, K=64, R=4, S=4, padding=(2, 2, 1, 1), **U8,
                                     pad_value=7, shift_ge33=True), "direct_halo", None, sm90=True),
    _case("direct_halo_i8_i4out_pad", dict(N=1, H=24, W=24, C=16, K=64, R=4, S=4, padding=(2, 2, 1, 1),
                                           **dict(I8, out_dtype="int4", zo=0, lo=-8, hi=7), pad_value=-5),
          "direct_halo", None, sm90=True),
    # split-K pairs (partial sums, then the epilogue kernel): mma.sync on every arch, wgmma on sm_90
    _case("splitk_sync_u8_res", dict(L, N=1, H=7, W=7, C=256, **U8, **RES8), "implicit_gemm",
          dict(split_k=4), plan=True),
    _case("splitk_sync_u4", dict(L, N=1, H=7, W=7, C=256, **U4), "implicit_gemm", dict(split_k=2), plan=True),
    _case("splitk_wg_i8", dict(L, N=1, H=7, W=7, C=256, **I8), "implicit_gemm",
          dict(WG, BM=64, WM=1, split_k=4), plan=True, sm90=True),
    # stream-K (8-bit wgmma: partials, tile counters, the owner's epilogue)
    _case("streamk_u8_res", dict(L, N=1, H=7, W=7, C=256, **U8, **RES8), "implicit_gemm", dict(WG, sk=1),
          sm90=True),
    # the generic kernel: odd channel counts, a pad value, residual, HWNC at batch 1
    _case("fallback_u8_c3_res_pad", dict(L, C=3, K=10, stride=2, **U8, **RES8, pad_value=11), "fallback", None),
    _case("fallback_i4_c5", dict(L, C=5, K=6, **dict(I4, out_dtype="uint4", zo=0, lo=0, hi=15)), "fallback", None),
    _case("fallback_hwnc_i8", dict(L, N=1, layout="HWNC", C=16, K=24, **I8, pad_value=-3), "fallback", None),
    # the max pool (3x3, stride 2, pad 1): 8-bit (4 and 16 channels per thread), packed 4-bit
    _case("maxpool_u8", dict(N=2, H=15, W=15, C=64, dtype="uint8"), kind="pool"),
    _case("maxpool_i8_v16", dict(N=128, H=15, W=15, C=64, dtype="int8"), kind="pool"),
    _case("maxpool_packed_u4", dict(N=2, H=14, W=14, C=16, dtype="uint4"), kind="pool"),
    _case("maxpool_packed_i4", dict(N=3, H=9, W=9, C=32, dtype="int4"), kind="pool"),
]


def target_arch(cc: int) -> tuple[str, str]:
    """(arch, nvcc mode) for compute capability ``cc`` (90 for an H100): sm_90 on 9.0; a newer GPU runs the sm_89
    PTX; an older one the newest of sm_75/80/86/89 it supports."""
    if cc == 90:
        return "sm_90", "sass"
    if cc > 90:
        return "sm_89", "ptx"
    fits = [a for a in ("sm_75", "sm_80", "sm_86", "sm_89") if int(a[3:]) <= cc]
    if not fits:
        pytest.skip(f"compute capability {cc} is older than every arch qcompile targets")
    return fits[-1], "sass"


# ---------------------------------------------------------------------------------------------------------------
# storage formats, from the documented convention (docs/SCHEDULES.md)
# ---------------------------------------------------------------------------------------------------------------
STORAGE = {"int8": np.int8, "uint8": np.uint8, "int4": np.int8, "uint4": np.uint8, "int32": np.int32}


def pack_nibbles(vals) -> np.ndarray:
    """4-bit values packed two per byte along the last axis: element 2i in the low nibble, 2i+1 in the high one (an
    odd count gets a zero nibble); uint8 bytes."""
    v = np.asarray(vals, np.int64)
    if v.shape[-1] % 2:
        v = np.concatenate([v, np.zeros(v.shape[:-1] + (1,), np.int64)], -1)
    return ((v[..., 0::2] & 0xF) | ((v[..., 1::2] & 0xF) << 4)).astype(np.uint8)


def unpack_nibbles(buf, signed: bool, n: int) -> np.ndarray:
    """The inverse: bytes [..., B] -> int64 values [..., n] (signed nibbles sign-extended)."""
    b = np.asarray(buf).view(np.uint8).astype(np.int64)
    v = np.stack([b & 0xF, b >> 4], -1).reshape(b.shape[:-1] + (2 * b.shape[-1],))[..., :n]
    return np.where(v >= 8, v - 16, v) if signed else v


def to_storage(vals, dtype: str) -> np.ndarray:
    """Logical values -> the buffer a kernel takes (4-bit packed; int4 as int8 bytes, uint4 as uint8)."""
    if dtype in ("int4", "uint4"):
        return pack_nibbles(vals).view(STORAGE[dtype])
    kr._check_range("value", vals, dtype)
    return np.asarray(vals).astype(STORAGE[dtype])


def from_storage(buf, dtype: str, n: int) -> np.ndarray:
    if dtype in ("int4", "uint4"):
        return unpack_nibbles(buf, dtype == "int4", n)
    return np.asarray(buf).astype(np.int64)


def expand_w4(w, kperm: int = 0) -> np.ndarray:
    """4-bit weights [..., C] -> the int8 buffer of a ``w8`` kernel: per group of 32 channels, its 16 even then its 16
    odd values, x16. ``kperm`` = BK (the ``agl`` loader, w [K, R, S, C]): first, within each K-chunk of 2*BK values of
    the flattened reduction, word 4j + q (8 values a word) takes word q*(BK/16) + j."""
    w = np.asarray(w, np.int64)
    if kperm:
        red, wpt = int(np.prod(w.shape[1:])), kperm // 16  # (words per thread span)
        words = w.reshape(w.shape[0], red // (2 * kperm), 4 * wpt, 8)
        src = [q * wpt + j for j in range(wpt) for q in range(4)]  # out word 4j + q
        w = words[:, :, src].reshape(w.shape)
    C = w.shape[-1]
    g = w.reshape(w.shape[:-1] + (C // 32, 32))
    return (16 * np.concatenate([g[..., 0::2], g[..., 1::2]], -1)).reshape(w.shape).astype(np.int8)


def permute_k8(w, kperm: int) -> np.ndarray:
    """8-bit weights [K, R, S, C] -> the int8 buffer of an 8-bit ``agl`` kernel: within each K-chunk of ``kperm`` bytes
    of the flattened reduction, out word 8ks + 4h + q = word q*(kperm/16) + 2ks + h with its 16-bit halves swapped."""
    w = np.asarray(w, np.int64)
    red, wpt = int(np.prod(w.shape[1:])), kperm // 16
    words = w.reshape(w.shape[0], red // kperm, 4 * wpt, 4)
    src = [q * wpt + 2 * ks + h for ks in range(kperm // 32) for h in range(2) for q in range(4)]
    return words[:, :, src][..., [2, 3, 0, 1]].reshape(w.shape).astype(np.int8)


# ---------------------------------------------------------------------------------------------------------------
# problems
# ---------------------------------------------------------------------------------------------------------------
def _seed(case) -> int:
    return zlib.crc32(case["name"].encode())


def make_problem(case, calls) -> dict:
    """Logical inputs of ``case`` (seeded by its name), chosen so the outputs spread over their range; ``calls``
    (from ``build_funcs``) holds the full spec."""
    rng = np.random.default_rng(_seed(case))
    s = kr.as_spec(calls["spec"])
    if case["kind"] == "pool":
        lo, hi = kr.RANGES[s.dtype]
        return dict(x=rng.integers(lo, hi + 1, (s.N, s.H, s.W, s.C)))
    xl = (s.H, s.W, s.N, s.C) if s.layout == "HWNC" else (s.N, s.H, s.W, s.C)
    wl = (s.R, s.S, s.K, s.C) if s.layout == "HWNC" else (s.K, s.R, s.S, s.C)
    xlo, xhi = kr.RANGES[s.x_dtype]
    wlo, whi = kr.RANGES["int4" if s.w_bits == 4 else "int8"]
    x, w = rng.integers(xlo, xhi + 1, xl), rng.integers(wlo, whi + 1, wl)
    acc = kr.conv_acc(s, x, w).reshape(-1, s.K)
    sd = float(acc.std()) + 1.0
    K = s.K
    lo, hi = max(s.lo, -(1 << 20)), min(s.hi, 1 << 20)
    target = (hi - lo) / 4.0 / sd  # output steps per accumulator step
    S = rng.integers(33, 41, K) if s.shift_ge33 else rng.integers(20, 31, K)
    S = np.maximum(np.minimum(S, np.floor(np.log2((2**31 - 1) / (1.5 * target)))).astype(np.int64),
                   33 if s.shift_ge33 else 1)
    M = np.clip(np.round(target * 2.0 ** S * rng.uniform(0.5, 1.5, K)), 1, 2**31 - 1).astype(np.int64)
    M *= rng.choice([1, -1], K, p=[0.8, 0.2])
    # a bias that centres each channel's stage-1 values in [lo, hi] (give or take a third of the spread)
    centre = ((lo + hi) / 2 - s.zo) * 2.0 ** S / M - acc.mean(0) + rng.uniform(-0.3, 0.3, K) * sd
    bias = np.clip(np.round(centre), kr.I32_MIN, kr.I32_MAX).astype(np.int64)
    if "wrap" in case["name"]:  # t = acc + bias overflows int32 on these channels: the kernels wrap, as defined
        bias[:3] = [kr.I32_MAX - int(acc.max()) // 4, kr.I32_MIN - int(acc.min()) // 4, kr.I32_MAX]
    p = dict(x=x, w=w, bias=bias, M=M, S=S)
    if s.has_residual:
        P, Q = kr.out_size(s)
        ol = (P, Q, s.N, K) if s.layout == "HWNC" else (s.N, P, Q, K)
        rlo, rhi = kr.RANGES[s.res_dtype]
        p["res"] = rng.integers(rlo, rhi + 1, ol)
        if s.rq2_uniform:
            p["rq2"] = np.repeat(np.asarray(s.rq2_uniform, np.int64)[:, None], K, 1)
        else:
            S2 = rng.integers(12, 21, K) if s.res_i32 else rng.integers(16, 31, K)
            span = (s.hi2 - s.lo2) / ((s.hi - s.lo) + (rhi - rlo))
            M1, M2 = (np.clip(np.round(span * rng.uniform(0.6, 1.4, K) * 2.0 ** S2), 1, 2**31 - 1) for _ in "12")
            p["rq2"] = np.stack([rng.integers(-3, 4, K), M1, rng.integers(-3, 4, K), M2, S2]).astype(np.int64)
    return p


def expected(case, calls, problem) -> np.ndarray:
    s = calls["spec"]
    if case["kind"] == "pool":
        return kr.max_pool(problem["x"], s["dtype"])
    return kr.conv_layer(s, problem["x"], problem["w"], problem["bias"], problem["M"], problem["S"],
                         problem.get("res"), problem.get("rq2"))


# ---------------------------------------------------------------------------------------------------------------
# build (needs TVM's compiler and nvcc)
# ---------------------------------------------------------------------------------------------------------------
def build_funcs(case, arch: str):
    """The PrimFuncs of ``case`` for ``arch``, named ``k0``, ``k1``, and ``calls``: how to run them (JSON)."""
    import dataclasses

    if case["kind"] == "pool":
        from qcompile.schedules.pool import max_pool_nhwc_kernel

        s = case["spec"]
        packed = s["dtype"] if s["dtype"] in ("int4", "uint4") else ""
        f = max_pool_nhwc_kernel(s["N"], s["H"], s["W"], s["C"], "uint8" if s["dtype"][0] == "u" else "int8",
                                 packed4=packed)
        return [f.with_attr("global_symbol", "k0")], dict(funcs=[["k0", ["x", "out"]]], spec=s)

    from qcompile.schedules import DEFAULT_KNOBS, ConvSpec, GemmKnobs, conv2d_int_kernel, conv2d_int_plan
    from qcompile.schedules.igemm import streamk_args, w8_kperm, w8_weights
    from qcompile.schedules.igemm_t import KtKnobs
    from qcompile.schedules.stem import HaloKnobs

    spec = ConvSpec(**case["spec"])
    kn = case["knobs"]
    if kn == SYNC:
        kn = DEFAULT_KNOBS[arch]
    elif kn is not None:
        kn = {"direct_halo": HaloKnobs, "implicit_gemm_t": KtKnobs}.get(case["strategy"], GemmKnobs)(**kn)
    fs = (conv2d_int_plan(spec, arch, case["strategy"], kn) if case["plan"]
          else [conv2d_int_kernel(spec, arch, case["strategy"], kn)])
    f = fs[0]
    if case["strategy"]:
        assert str(f.attrs["qcompile.strategy"]) == case["strategy"], "the kernel is not the forced strategy"
    if kn is not None and hasattr(kn, "mma"):  # (knobs a kernel cannot take fall back to mma.sync with a warning)
        assert str(f.attrs["qcompile.knobs"]).count(f"mma='{kn.mma}'") == 1, str(f.attrs["qcompile.knobs"])
    res = ["res", "rq2"] if spec.has_residual else []
    main = ["x", "w", "bias", "M", "S", *res]
    if len(fs) == 2:
        split = int(f.attrs["qcompile.split_k"])
        assert case["plan"] and split > 1, "a split-K pair was asked for"
        funcs = [["k0", ["x", "w", "ws"]], ["k1", ["ws", "bias", "M", "S", *res, "out"]]]
    elif streamk_args(f):
        split = 0
        funcs = [["k0", main + ["skc", "out", "skw"]]]
    else:
        split = 0
        funcs = [["k0", main + ["out"]]]
        assert not case["plan"] or case["knobs"] is None, "no split-K pair where one was asked for"
    for (_, names), g in zip(funcs, fs):
        assert len(g.params) == len(names), (names, [p.name for p in g.params])
    calls = dict(funcs=funcs, spec=dataclasses.asdict(spec), split=split, sk=streamk_args(f),
                 w8=bool(w8_weights(f)), kperm=w8_kperm(f), strategy=str(f.attrs["qcompile.strategy"]),
                 knobs=str(f.attrs["qcompile.knobs"]) if "qcompile.knobs" in f.attrs else "")
    return [g.with_attr("global_symbol", n) for (n, _), g in zip(funcs, fs)], calls


def build_case(case, arch: str, mode: str = "sass"):
    """(runtime module, calls) of ``case`` compiled for ``arch`` (``mode``: nvcc's "sass" or "ptx")."""
    import tvm

    from qcompile.schedules.build import cuda_target, ensure_stub_libcuda, nvcc_options

    ensure_stub_libcuda()
    fs, calls = build_funcs(case, arch)
    with nvcc_options(arch, mode):
        lib = tvm.compile(tvm.IRModule({str(f.attrs["global_symbol"]): f for f in fs}), target=cuda_target(arch))
    return lib, calls


# ---------------------------------------------------------------------------------------------------------------
# run and check (NumPy and the TVM runtime only)
# ---------------------------------------------------------------------------------------------------------------
def inputs(case, calls, problem) -> dict:
    """The kernels' input buffers (storage format) by name; the output and workspaces are made by ``run``."""
    if case["kind"] == "pool":
        return dict(x=to_storage(problem["x"], case["spec"]["dtype"]))
    s = kr.as_spec(calls["spec"])
    w = problem["w"]
    if calls["w8"]:
        w = expand_w4(w, calls["kperm"])
    elif calls["kperm"]:
        w = permute_k8(w, calls["kperm"])
    else:
        w = to_storage(w, "int4" if s.w_bits == 4 else "int8")
    b = dict(x=to_storage(problem["x"], s.x_dtype), w=w,
             **{k: np.asarray(problem[k]).astype(np.int32) for k in ("bias", "M", "S")})
    if s.has_residual:
        b["res"] = to_storage(problem["res"], s.res_dtype)
        b["rq2"] = np.asarray(problem["rq2"]).astype(np.int32)
    return b


def out_shape(case, calls) -> tuple:
    s = kr.as_spec(calls["spec"])
    if case["kind"] == "pool":
        P, Q = (s.H + 2 - 3) // 2 + 1, (s.W + 2 - 3) // 2 + 1
        return (s.N, P, Q, s.C // 2 if s.dtype in ("int4", "uint4") else s.C), STORAGE[s.dtype]
    P, Q = kr.out_size(s)
    ko = s.K // 2 if s.out_dtype in ("int4", "uint4") else s.K
    return ((P, Q, s.N, ko) if s.layout == "HWNC" else (s.N, P, Q, ko)), STORAGE[s.out_dtype]


def run(mod, case, calls, bufs, dev, poison: int) -> np.ndarray:
    """Run ``case``'s kernels from runtime module ``mod`` on ``dev`` with input buffers ``bufs``, the output filled
    with the byte ``poison`` first (workspaces with random words); returns the output buffer."""
    import tvm

    shape, dt = out_shape(case, calls)
    out = np.full(int(np.prod(shape)) * np.dtype(dt).itemsize, poison, np.uint8).view(dt).reshape(shape)
    rng = np.random.default_rng(poison)
    t = {k: tvm.runtime.tensor(np.ascontiguousarray(v), dev) for k, v in bufs.items()}
    t["out"] = tvm.runtime.tensor(out, dev)
    s = kr.as_spec(calls["spec"])
    if calls.get("split"):
        P, Q = kr.out_size(s)
        t["ws"] = tvm.runtime.tensor(rng.integers(-(1 << 30), 1 << 30, (calls["split"], s.N * P * Q, s.K))
                                     .astype(np.int32), dev)
    if calls.get("sk"):
        t["skc"] = tvm.runtime.tensor(np.zeros(calls["sk"][0], np.int32), dev)
        t["skw"] = tvm.runtime.tensor(rng.integers(-(1 << 30), 1 << 30, calls["sk"][1]).astype(np.int32), dev)
    for fname, names in calls["funcs"]:
        mod[fname](*[t[n] for n in names])
    dev.sync()
    if calls.get("sk"):
        assert not t["skc"].numpy().any(), "stream-K left its tile counters non-zero"
    return t["out"].numpy()


def check(case, calls, problem, outs) -> None:
    """Every output buffer in ``outs`` (one per poison) holds exactly the reference's values."""
    want = expected(case, calls, problem)
    assert np.unique(want).size > 3, "a degenerate case: the reference output is (nearly) constant"
    dtype = case["spec"]["dtype"] if case["kind"] == "pool" else calls["spec"]["out_dtype"]
    for o in outs:
        got = from_storage(o, dtype, want.shape[-1])
        assert got.shape == want.shape, (got.shape, want.shape)
        bad = got != want
        assert not bad.any(), (f"{case['name']}: {int(bad.sum())} of {bad.size} outputs differ from the reference "
                               f"(first at {tuple(int(i) for i in np.argwhere(bad)[0])}: "
                               f"{int(got[bad][0])} vs {int(want[bad][0])})")


POISONS = (0xA5, 0x5A)


def check_on_gpu(mod, case, calls, dev) -> None:
    """The whole check of one built case on ``dev``: inputs, two poisoned runs, the comparison."""
    problem = make_problem(case, calls)
    bufs = inputs(case, calls, problem)
    check(case, calls, problem, [run(mod, case, calls, bufs, dev, p) for p in POISONS])


# ---------------------------------------------------------------------------------------------------------------
# the tests
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.nvcc
@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_kernel_bit_exact_on_gpu(case):
    import tvm

    arch, mode = target_arch(gpu_compute_capability())
    if case["sm90"] and arch != "sm_90":
        pytest.skip(f"{case['name']}: an sm_90a kernel; this GPU runs {arch}")
    mod, calls = build_case(case, arch, mode)
    check_on_gpu(mod, case, calls, tvm.cuda(0))


def test_cases_cover_every_strategy():
    """The case list covers every strategy the selector has, split-K and stream-K, the pool, 8- and 4-bit, residual
    and pad values (what the GPU tier claims)."""
    from qcompile.schedules import STRATEGIES

    convs = [c for c in CASES if c["kind"] == "conv"]
    assert {c["strategy"] for c in convs if c["strategy"]} == set(STRATEGIES)
    assert any(c["plan"] for c in convs) and any(isinstance(c["knobs"], dict) and c["knobs"].get("sk") for c in convs)
    assert {c["spec"]["w_bits"] for c in convs} == {4, 8} and any(c["spec"].get("has_residual") for c in convs)
    assert any(c["spec"].get("pad_value") for c in convs) and any(c["kind"] == "pool" for c in CASES)
    assert len({c["name"] for c in CASES}) == len(CASES)


def test_storage_helpers_literal():
    """This file's packers against buffers written out by hand (so the GPU tier does not trust the compiler's)."""
    assert pack_nibbles([[1, -2, 7, -8]]).tolist() == [[0xE1, 0x87]]
    assert pack_nibbles([1, 14, 15]).tolist() == [0xE1, 0x0F]  # (odd count: a zero nibble)
    assert to_storage([1, -2], "int4").dtype == np.int8
    assert unpack_nibbles(np.array([0xE1, 0x87], np.uint8), True, 4).tolist() == [1, -2, 7, -8]
    assert unpack_nibbles(np.array([0xE1, 0x0F], np.uint8), False, 3).tolist() == [1, 14, 15]
    # w8: per 32 channels the 16 even values, then the 16 odd ones, x16 (w[c] = c % 16 - 8)
    w = (np.arange(32) % 16 - 8).reshape(1, 32)
    assert expand_w4(w).tolist() == [[-128, -96, -64, -32, 0, 32, 64, 96, -128, -96, -64, -32, 0, 32, 64, 96,
                                      -112, -80, -48, -16, 16, 48, 80, 112, -112, -80, -48, -16, 16, 48, 80, 112]]
    # agl, BK 32: words of 8 values go 0 2 4 6 1 3 5 7 in a 64-value chunk, then the split above (word i: 8 x (i - 4))
    w = (np.arange(64) // 8 - 4).reshape(1, 1, 1, 64)
    assert expand_w4(w, 32).ravel().tolist() == (
        [-64] * 4 + [-32] * 4 + [0] * 4 + [32] * 4 + [-64] * 4 + [-32] * 4 + [0] * 4 + [32] * 4
        + [-48] * 4 + [-16] * 4 + [16] * 4 + [48] * 4 + [-48] * 4 + [-16] * 4 + [16] * 4 + [48] * 4)
    # k8: one 32-byte chunk (kperm 32: 2 words per thread span), values 0..31
    k8 = permute_k8(np.arange(32).reshape(1, 1, 1, 32), 32).ravel().tolist()
    assert k8 == [2, 3, 0, 1, 10, 11, 8, 9, 18, 19, 16, 17, 26, 27, 24, 25,
                  6, 7, 4, 5, 14, 15, 12, 13, 22, 23, 20, 21, 30, 31, 28, 29]
