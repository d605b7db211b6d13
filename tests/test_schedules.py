"""Tensor-core conv2d schedules: codegen + numerics that need no GPU (fast, < 1 min)."""
from __future__ import annotations

import dataclasses
import os
import re
import random
import subprocess

import numpy as np
import pytest
import tvm

from qcompile import int4
from qcompile.cuda_tools import find_tool
from qcompile.schedules import (DEFAULT_KNOBS, MMA_SHAPES, ConvSpec, GemmKnobs, conv2d_int_kernel, select_strategy)
from qcompile.schedules import reference as R
from qcompile.schedules.build import build_cuda, cuda_source
from qcompile.schedules.fallback import make_fallback
from qcompile.schedules.igemm import NotApplicable, make_gemm_conv


def test_mma_table():
    assert MMA_SHAPES["sm_75"].s8.ptx == "m8n8k16" and MMA_SHAPES["sm_75"].s4.ptx == "m8n8k32"
    for a in ("sm_80", "sm_86", "sm_89"):
        assert MMA_SHAPES[a].s8.ptx == "m16n8k32" and MMA_SHAPES[a].s4.ptx == "m16n8k64"
        assert MMA_SHAPES[a].s4_native
    assert MMA_SHAPES["sm_90"].s8.ptx == "m16n8k32" and not MMA_SHAPES["sm_90"].s4_native


def test_selector():
    from qcompile.schedules.spec import space_to_depth

    base = dict(H=56, W=56, C=64, K=64, R=3, S=3, padding=1)
    assert select_strategy(ConvSpec(N=8, layout="HWNC", **base)) == "direct_hwnc"
    assert select_strategy(ConvSpec(N=1, layout="NHWC", **base)) == "implicit_gemm"
    # HWNC that direct cannot take (batch 1 / C=3 stem) -> generic fallback
    assert select_strategy(ConvSpec(N=1, layout="HWNC", **base)) == "fallback"
    stem = dict(N=1, H=224, W=224, C=3, K=64, R=7, S=7, stride=2, padding=3)
    assert select_strategy(ConvSpec(**stem)) == "implicit_gemm"
    assert select_strategy(ConvSpec(**stem, layout="HWNC")) == "fallback"
    # the stem as CUDA builds run it (C padded to 4, then its 2x2 space-to-depth conv): the direct halo kernel on
    # sm_90a, the implicit GEMM where there is no wgmma
    s2d = space_to_depth(ConvSpec(**dict(stem, C=4)))
    assert select_strategy(s2d) == "direct_halo" and select_strategy(s2d, "sm_80") == "implicit_gemm"
    assert select_strategy(ConvSpec(N=3, H=9, W=9, C=3, K=8, R=3, S=3, x_dtype="int4", w_bits=4)) == "fallback"
    # forcing
    f = conv2d_int_kernel(ConvSpec(N=1, **base), strategy="fallback")
    assert str(f.attrs["qcompile.strategy"]) == "fallback"
    with pytest.raises(ValueError):
        conv2d_int_kernel(ConvSpec(N=1, layout="HWNC", **base), strategy="direct_hwnc")


SPECS = [
    ConvSpec(N=2, H=9, W=9, C=6, K=10, R=3, S=3, padding=1, stride=2, x_dtype="int8", out_dtype="uint8",
             has_residual=True, res_dtype="uint8", zo=-2, lo2=0, hi2=255, zo2=3, pad_value=5),
    ConvSpec(N=1, H=8, W=8, C=8, K=6, R=1, S=1, x_dtype="uint4", w_bits=4, out_dtype="int4", lo=-8, hi=7,
             layout="HWNC"),
    ConvSpec(N=2, H=7, W=7, C=3, K=4, R=7, S=7, padding=3, stride=2, x_dtype="uint8", out_dtype="uint8",
             lo=0, hi=255, zo=4),
    ConvSpec(N=1, H=6, W=6, C=4, K=8, R=3, S=3, padding=1, x_dtype="int4", w_bits=4, out_dtype="uint4",
             lo=-8, hi=7, has_residual=True, res_dtype="uint4", lo2=0, hi2=15),
    ConvSpec(N=1, H=5, W=5, C=16, K=8, R=3, S=3, padding=1, out_dtype="int32", lo=-(1 << 31), hi=(1 << 31) - 1),
    ConvSpec(N=2, H=6, W=6, C=16, K=24, R=1, S=1, layout="HWNC", x_dtype="uint8", out_dtype="uint8", lo=-128,
             hi=127, has_residual=True, res_dtype="uint8", lo2=0, hi2=255, res_i32=True, shift_ge33=True),
    ConvSpec(N=1, H=6, W=6, C=32, K=16, R=1, S=1, x_dtype="uint8", out_dtype="uint8", lo=-128, hi=127,
             has_residual=True, res_dtype="uint8", lo2=0, hi2=255, res_i32=True, shift_ge33=True,
             rq2_uniform=(3, 600, -2, 500, 10)),
    ConvSpec(N=1, H=7, W=7, C=64, K=16, R=3, S=3, padding=1, x_dtype="int4", w_bits=4, out_dtype="int4", lo=-8, hi=7,
             zo=1, shift_ge33=True),
]


def _run_llvm_and_compare(func, args, spec, rng, problem):
    """Run ``func`` on llvm with ``args`` and a poisoned output; it must equal the NumPy reference of ``problem``."""
    lib = tvm.compile(tvm.IRModule({"main": func}), target="llvm")
    out = rng.integers(0, 100, spec.shapes()[2]).astype(ConvSpec.storage(spec.out_dtype))  # poisoned
    targs = [tvm.runtime.tensor(np.ascontiguousarray(a)) for a in args] + [tvm.runtime.tensor(out)]
    lib["main"](*targs)
    got = R.from_storage(targs[-1].numpy(), spec.out_dtype, spec.K)
    ref = R.conv_reference(spec, *problem)
    assert np.unique(ref).size > 3
    np.testing.assert_array_equal(got, ref)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.layout}-{s.x_dtype}-{s.out_dtype}-C{s.C}-res{int(s.has_residual)}")
def test_compute_llvm_matches_numpy(spec):
    """The unscheduled TIR compute (what every schedule implements) equals the NumPy reference."""
    rng = np.random.default_rng(7)
    x, w, b, M, S, res = R.random_problem(spec, rng)
    func = make_fallback(spec, "llvm")
    args = [R.to_storage(x, spec.x_dtype), R.to_storage(w, "int4" if spec.w_bits == 4 else "int8"), b, M, S]
    args += R.residual_args(spec, res)
    _run_llvm_and_compare(func, args, spec, rng, (x, w, b, M, S, res))


@pytest.mark.parametrize("shape", [
    (2, 224, 224, 4, 7, 7, 3),          # the ResNet stem (C=3 padded to 4)
    (1, 57, 57, 4, 7, 7, 3),            # odd H / W: the extra row / column reads the pad value
    (3, 33, 31, 4, 7, 7, (3, 2, 1, 3)),  # asymmetric padding, odd and even pad in front
    (2, 15, 14, 8, 3, 3, 1),
    (2, 10, 10, 12, 4, 4, 1),
])
def test_space_to_depth_is_the_same_conv(shape):
    """The stride-2 conv as a stride-1 conv over the 2x2 space-to-depth input: the same int64 sums (pad value 17)."""
    from qcompile.schedules.spec import space_to_depth, space_to_depth_input, space_to_depth_weights

    N, H, W, C, R_, S_, pad = shape
    rng = np.random.default_rng(11)
    spec = ConvSpec(N=N, H=H, W=W, C=C, K=8, R=R_, S=S_, stride=2, padding=pad, x_dtype="uint8", pad_value=17)
    s2 = space_to_depth(spec)
    assert s2.strides == (1, 1) and s2.C == 4 * C and (s2.P, s2.Q) == (spec.P, spec.Q)
    x = rng.integers(0, 256, (N, H, W, C))
    w = rng.integers(-128, 128, (8, R_, S_, C))
    ref = R.conv_acc_nhwc(x, w, spec)
    assert np.array_equal(R.conv_acc_nhwc(space_to_depth_input(x, 17), space_to_depth_weights(w, spec), s2), ref)
    if shape[0] == 2 and H == 224:
        assert (s2.H, s2.W, s2.C, s2.R, s2.S, s2.pads) == (112, 112, 16, 4, 4, (2, 2, 1, 1))


def test_space_to_depth_applies_only_where_it_helps():
    from qcompile.schedules.spec import space_to_depth

    stem = ConvSpec(N=1, H=224, W=224, C=4, K=64, R=7, S=7, stride=2, padding=3, x_dtype="uint8")
    assert space_to_depth(stem) is not None
    for other in (stem.replace(C=16),                # 16-byte channel vectors already
                  stem.replace(stride=1),
                  stem.replace(R=1, S=1, padding=0),  # 1x1 stride 2: a strided load, nothing to gain
                  stem.replace(layout="HWNC"),
                  stem.replace(C=8, x_dtype="uint4", w_bits=4),
                  stem.replace(dilation=2)):
        assert space_to_depth(other) is None
    # a tap pattern whose space-to-depth form would need negative padding
    assert space_to_depth(ConvSpec(N=1, H=9, W=9, C=12, K=8, R=5, S=3, stride=2, padding=(0, 1, 2, 0))) is None


def test_pack4_convention():
    """The kernels' 4-bit buffers: two values per byte along the last axis, element 0 in the low nibble."""
    v = np.array([[1, -2, 7, -8]])
    p = R.to_storage(v, "int4")
    assert p.dtype == np.int8 and p.view(np.uint8).tolist() == [[0xE1, 0x87]]
    np.testing.assert_array_equal(R.from_storage(p, "int4"), v)
    u = R.to_storage(np.array([[1, 14, 15]]), "uint4")  # (an odd count: a zero nibble appended)
    assert u.dtype == np.uint8 and u.tolist() == [[0xE1, 0x0F]]
    np.testing.assert_array_equal(R.from_storage(u, "uint4", 3), [[1, 14, 15]])


def test_weight_layouts_literal():
    """The kernels' weight and input layouts against buffers written out by hand, so a bug in the helpers that make
    them (reference.expand_w4 / permute_k8, spec.space_to_depth_weights / _input) cannot hide behind a test that
    uses the helper itself."""
    from qcompile.schedules.spec import space_to_depth_input, space_to_depth_weights

    # w8 (expand_w4): per 32 channels the 16 even values, then the 16 odd ones, x16; w[c] = c % 16 - 8
    w = (np.arange(32) % 16 - 8).reshape(1, 32)
    assert R.expand_w4(w).tolist() == [[-128, -96, -64, -32, 0, 32, 64, 96, -128, -96, -64, -32, 0, 32, 64, 96,
                                        -112, -80, -48, -16, 16, 48, 80, 112, -112, -80, -48, -16, 16, 48, 80, 112]]
    # agl (expand_w4 with kperm = BK = 32): in a chunk of 64 values (8 words of 8), out word 4j + q = word 2q + j, so
    # the words go 0 2 4 6 1 3 5 7, then each 32 is split into evens and odds; word i holds 8 copies of i - 4
    w = (np.arange(64) // 8 - 4).reshape(1, 1, 1, 64)
    assert R.expand_w4(w, kperm=32).ravel().tolist() == (
        [-64] * 4 + [-32] * 4 + [0] * 4 + [32] * 4 + [-64] * 4 + [-32] * 4 + [0] * 4 + [32] * 4
        + [-48] * 4 + [-16] * 4 + [16] * 4 + [48] * 4 + [-48] * 4 + [-16] * 4 + [16] * 4 + [48] * 4)
    # agl8 (permute_k8): in a chunk of BK bytes, out word 8 ks + 4 h + q = word q BK/16 + 2 ks + h, its 16-bit halves
    # swapped; w[c] = c
    assert R.permute_k8(np.arange(32).reshape(1, 1, 1, 32), 32).ravel().tolist() == [
        2, 3, 0, 1, 10, 11, 8, 9, 18, 19, 16, 17, 26, 27, 24, 25, 6, 7, 4, 5, 14, 15, 12, 13, 22, 23, 20, 21, 30, 31,
        28, 29]
    assert R.permute_k8(np.arange(64).reshape(1, 1, 1, 64), 64).ravel().tolist() == [
        2, 3, 0, 1, 18, 19, 16, 17, 34, 35, 32, 33, 50, 51, 48, 49, 6, 7, 4, 5, 22, 23, 20, 21, 38, 39, 36, 37, 54, 55,
        52, 53, 10, 11, 8, 9, 26, 27, 24, 25, 42, 43, 40, 41, 58, 59, 56, 57, 14, 15, 12, 13, 30, 31, 28, 29, 46, 47,
        44, 45, 62, 63, 60, 61]
    # space-to-depth of a 3x3 stride-2 pad-1 conv, 4 channels: w2[k, i, j, (2 dr + ds) C + c] = w[k, 2i + dr - 1,
    # 2j + ds - 1, c] (a zero tap in front: pad 1 is odd); w[0, r, s, c] = 10 (3r + s + 1) + c
    spec = ConvSpec(N=1, H=6, W=6, C=4, K=1, R=3, S=3, stride=2, padding=1, x_dtype="uint8")
    w = (10 * (np.arange(9).reshape(1, 3, 3, 1) + 1) + np.arange(4)).astype(np.int64)
    assert space_to_depth_weights(w, spec).tolist() == [[
        [[0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 10, 11, 12, 13], [0, 0, 0, 0, 0, 0, 0, 0, 20, 21, 22, 23, 30, 31, 32, 33]],
        [[0, 0, 0, 0, 40, 41, 42, 43, 0, 0, 0, 0, 70, 71, 72, 73],
         [50, 51, 52, 53, 60, 61, 62, 63, 80, 81, 82, 83, 90, 91, 92, 93]]]]
    # ... and its input: x2[n, i, j, 2 dr + ds] = x[n, 2i + dr, 2j + ds] (pad value 17 past the odd H, W); x = 1..9
    assert space_to_depth_input(np.arange(1, 10).reshape(1, 3, 3, 1), 17).tolist() == [
        [[[1, 2, 4, 5], [3, 17, 6, 17]], [[7, 8, 17, 17], [9, 17, 17, 17]]]]


def _src(spec, arch, strategy=None, knobs=None):
    f = conv2d_int_kernel(spec, arch, strategy, knobs)
    return cuda_source(build_cuda(f, arch, mode="ptx"))


L3 = dict(N=8, H=14, W=14, C=64, K=128, R=3, S=3, padding=1)


@pytest.mark.nvcc
def test_cuda_direct_halo_stem():
    """The stem's space-to-depth conv from a shared-memory halo tile (schedules/stem.py): one register-A wgmma per
    tap pair and output row (m64 = the 64 output channels, n = the 112 pixels of the row), its B operand a
    no-swizzle descriptor into the halo (LBO 16 bytes: the next tap is the next pixel; SBO 128 bytes); the halo rows
    by 16-byte cp.async; stage 1 of the implicit GEMM's epilogue; the 4-bit row packed by byte permutes."""
    from qcompile.schedules.spec import space_to_depth
    from qcompile.schedules.stem import HaloKnobs, halo_constraints

    stem = ConvSpec(N=256, H=224, W=224, C=4, K=64, R=7, S=7, stride=2, padding=3, x_dtype="uint8", out_dtype="uint4",
                    zo=1, lo=0, hi=15, shift_ge33=True)
    s2d = space_to_depth(stem)
    src = _src(s2d, "sm_90")
    assert src.count("wgmma.mma_async.sync.aligned.m64n112k32.s32.s8.u8") >= 1 and "mma.sync" not in src
    body = src.split("main_kernel(")[-1]
    mma = "wgmma_int_rs_mma_async_sync_aligned_m64n112k32_s32_s8_u8("
    assert body.count(mma) == 8  # 4 kernel rows x 2 tap pairs, in the loop over an item's output rows
    # at batch 8 (a smaller grid) the rows of an item are unrolled, the next row's MMAs issued before an epilogue
    assert _src(s2d.replace(N=8), "sm_90").split("main_kernel(")[-1].count(mma) == 4 * 8
    assert "34359803904ULL" in body  # (descriptor fields: LBO 1 << 16 | SBO 8 << 32 in 16-byte units, no swizzle)
    # one staged store per pixel and channel pair (the MMA rows permuted: a thread's two channels are adjacent), the
    # 4-bit pair packed into one byte: 14 column groups x 2 pixels; the row written out in 16-byte stores
    assert "cp_async_cg" in body and "__mulhi(" in body and "__byte_perm(" not in body
    assert body.count("tvm_builtin_ptx_st_shared_b8_u32(") == 28 and "st_shared_b16" not in body
    src8 = _src(s2d.replace(out_dtype="int8", zo=-3, lo=-128, hi=127, x_dtype="int8", pad_value=-5), "sm_90",
                knobs=HaloKnobs(th=2, pipe=1))
    body8 = src8.split("main_kernel(")[-1]
    assert "m64n112k32.s32.s8.s8" in src8 and body8.count("tvm_builtin_ptx_st_shared_b16_u32(") == 2 * 28
    assert "(uint)4227595259" in body8  # (the padding value -5 in every byte of a word: 0xFBFBFBFB)
    # what it cannot take, said plainly
    assert "16-byte pixels" in halo_constraints(stem, "sm_90")
    assert "wgmma" in halo_constraints(s2d, "sm_86")
    assert "K = 64" in halo_constraints(s2d.replace(K=128), "sm_90")
    with pytest.raises(ValueError, match="direct_halo"):
        conv2d_int_kernel(stem, "sm_90", "direct_halo")
    with pytest.raises(ValueError, match="KiB per block"):  # (64 rows per item: two 120-KiB halo buffers)
        conv2d_int_kernel(s2d, "sm_90", "direct_halo", HaloKnobs(th=64))


@pytest.mark.nvcc
def test_cuda_implicit_gemm_t():
    """The implicit GEMM with output channels as M (schedules/igemm_t.py): 128 channels x BN pixels per block, both
    operands from a 128-byte-swizzled cp.async ring (ss-form wgmma m64nBN), the weights' rows permuted so that a
    thread's two accumulator rows are adjacent channels (one 2-byte staged store per pixel; 4-bit: one packed byte);
    4-bit activations loaded into registers (or through a packed shared ring) and unpacked into the ring. Selected
    where its grid fills the SMs better than 128 x 128 tiles (ResNet-50 layer 4 at batch 64: 4 x 33 blocks of 96
    pixels for 132 SMs), 4-bit only with pixel tiles of 192 or more."""
    from qcompile.schedules.igemm_t import KtKnobs, auto_bn, fill_gain, kt_constraints, kt_grid

    u8 = dict(x_dtype="uint8", out_dtype="uint8", zo=3, lo=0, hi=255, shift_ge33=True)
    u4 = dict(x_dtype="uint4", w_bits=4, out_dtype="uint4", zo=1, lo=0, hi=15, shift_ge33=True)
    l4 = ConvSpec(N=64, H=7, W=7, C=512, K=512, R=3, S=3, padding=1, **u8)
    l3 = ConvSpec(N=64, H=14, W=14, C=256, K=256, R=3, S=3, padding=1, **u4)
    assert (auto_bn(l4, "sm_90"), kt_grid(l4, "sm_90"), fill_gain(l4, "sm_90")) == (96, 132, 128 / 96)
    assert auto_bn(l3, "sm_90") == 192 and kt_grid(l3, "sm_90") == 132
    assert select_strategy(l4) == "implicit_gemm_t" and select_strategy(l3) == "implicit_gemm_t"
    assert select_strategy(l4.replace(**u4)) == "implicit_gemm"  # (4-bit with 96-pixel tiles: slower, measured)
    assert select_strategy(l4.replace(N=256)) == "implicit_gemm"  # (392 tiles of 128 x 128: 2.97 waves already)
    assert select_strategy(l4.replace(N=1)) == "implicit_gemm"  # (4 blocks: the split-K pairs' ground)
    assert select_strategy(l4, "sm_80") == "implicit_gemm"
    body = _src(l4, "sm_90").split("main_kernel(")[-1]
    assert body.count("wgmma_int_ss_mma_async_sync_aligned_m64n96k32_s32_s8_u8(") == 4  # (one chunk's k-steps)
    assert "4611686293305360384ULL" in body  # (descriptor: 128-byte swizzle 1 << 62 | SBO 64 << 32 | LBO 1 << 16)
    assert "cp_async_cg" in body and "__mulhi(" in body and "mma_sync" not in body
    assert body.count("tvm_builtin_ptx_st_shared_b16_u32(") == 96 // 8 * 2  # one store per pixel and channel pair
    b4 = _src(l3, "sm_90").split("main_kernel(")[-1]
    assert b4.count("wgmma_int_ss_mma_async_sync_aligned_m64n192k32_s32_s8_u8(") == 8  # (main loop unrolled by two)
    assert "ld_vec_global_nc_v4_b32" in b4 and "st_vec_shared_v4_b32" in b4  # (packed into registers, unpacked)
    assert b4.count("tvm_builtin_ptx_st_shared_b8_u32(") == 192 // 8 * 2  # (4-bit output: one packed byte per pair)
    f = conv2d_int_kernel(l3, "sm_90")
    assert "qcompile.w8" in f.attrs and str(f.attrs["qcompile.knobs"]) == "KtKnobs(bn=192, stages=4, ring=0, gif=1)"
    b4r = _src(l3, "sm_90", knobs=KtKnobs(bn=96, ring=1, stages=5, gif=2)).split("main_kernel(")[-1]
    assert "ld_vec_global_nc" not in b4r and "ld_vec_shared_v4_b32" in b4r  # (packed ring read back)
    # what it cannot take, said plainly
    assert "multiples of 128" in kt_constraints(l4.replace(C=64), "sm_90")
    assert "no residual" in kt_constraints(l4.replace(has_residual=True), "sm_90")
    assert "zeros" in kt_constraints(l4.replace(pad_value=3), "sm_90")
    assert "one width" in kt_constraints(l4.replace(w_bits=4), "sm_90")
    assert "wgmma" in kt_constraints(l4, "sm_86")
    with pytest.raises(ValueError, match="no wgmma N"):
        conv2d_int_kernel(l4, "sm_90", "implicit_gemm_t", KtKnobs(bn=100))
    with pytest.raises(ValueError, match="stages"):
        conv2d_int_kernel(l4, "sm_90", "implicit_gemm_t", KtKnobs(stages=4, gif=2))
    with pytest.raises(ValueError, match="KiB"):
        conv2d_int_kernel(l4, "sm_90", "implicit_gemm_t", KtKnobs(bn=224, stages=6))
    with pytest.raises(ValueError, match="does not apply"):
        conv2d_int_kernel(l4.replace(C=64), "sm_90", "implicit_gemm_t")
    # 4-bit weights kept packed (qcompile --packed-int4-weights): not this kernel's (it takes them expanded)
    assert str(conv2d_int_kernel(l3, "sm_90", packed_weights=True).attrs["qcompile.strategy"]) == "implicit_gemm"
    with pytest.raises(ValueError, match="expanded"):
        conv2d_int_kernel(l3, "sm_90", "implicit_gemm_t", packed_weights=True)


@pytest.mark.nvcc
def test_cuda_int8_sm90_mma():
    """sm_90's mma.sync kernel (DEFAULT_KNOBS: what shapes wgmma cannot take get), and the warpgroup-MMA kernel an
    untuned NHWC shape with 16-byte channel vectors gets by default (schedules.default_knobs)."""
    spec = ConvSpec(**L3, x_dtype="uint8", out_dtype="uint8", lo=0, hi=255)
    src = _src(spec, "sm_90", knobs=DEFAULT_KNOBS["sm_90"])
    assert "mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32" in src
    assert "ldmatrix.sync.aligned.m8n8.x4" in src and "cp.async.cg.shared.global" in src
    src = _src(spec.replace(N=3), "sm_90")  # (no tuning record at batch 3)
    assert "wgmma.mma_async.sync.aligned.m64n64k32.s32.u8.s8" in src and "mma.sync" not in src


@pytest.mark.nvcc
def test_cuda_int4_sm90_unpacks_to_s8():
    spec = ConvSpec(**L3, x_dtype="int4", w_bits=4, out_dtype="int4", lo=-8, hi=7)
    src = _src(spec, "sm_90", knobs=DEFAULT_KNOBS["sm_90"])
    assert "m16n8k32.row.col.s32.s8.s8.s32" in src and ".s4" not in src
    src = _src(spec.replace(N=3), "sm_90")  # the untuned default: register-A wgmma on the unpacked activations
    assert "wgmma.mma_async.sync.aligned.m64n64k32.s32.s8.s8" in src and ".s4" not in src
    src = _src(ConvSpec(**L3, layout="HWNC", x_dtype="uint4", w_bits=4, out_dtype="int8"), "sm_90")
    assert "m16n8k32.row.col.s32.u8.s8.s32" in src


@pytest.mark.parametrize("arch,ins", [("sm_86", "m16n8k64.row.col.s32.s4.s4.s32"),
                                      ("sm_75", "m8n8k32.row.col.s32.s4.s4.s32")])
@pytest.mark.nvcc
def test_cuda_int4_native(arch, ins):
    src = _src(ConvSpec(**L3, x_dtype="int4", w_bits=4, out_dtype="int8"), arch)
    assert ins in src


@pytest.mark.nvcc
def test_cuda_int8_sm75():
    src = _src(ConvSpec(**L3, x_dtype="int8", out_dtype="int8"), "sm_75")
    assert "m8n8k16.row.col.s32.s8.s8.s32" in src


@pytest.mark.nvcc
def test_sampled_knobs_build():
    rng = random.Random(3)
    kn = GemmKnobs.sample(rng, BM=64, BN=64, WM=2, WN=2)
    src = _src(ConvSpec(**L3, x_dtype="uint8", out_dtype="int8"), "sm_90", knobs=kn)
    assert "mma.sync" in src


WG = GemmKnobs(BM=128, BN=128, BK=128, WM=2, WN=1, stages=3, mma="wgmma")


@pytest.mark.nvcc
def test_cuda_wgmma_sm90():
    """Hopper warpgroup MMA: INT8 tiles by cp.async, INT4 tiles loaded packed and stored unpacked (x16) to shared
    memory; both read by wgmma from 128-byte-swizzled descriptors."""
    src = _src(ConvSpec(**L3, x_dtype="uint8", out_dtype="uint8", lo=0, hi=255), "sm_90", knobs=WG)
    assert "wgmma.mma_async.sync.aligned.m64n128k32.s32.u8.s8" in src and "mma.sync" not in src
    assert "fence.proxy.async" in src and "wgmma.wait_group.sync.aligned" in src and "cp.async.cg.shared.global" in src
    assert "<< (uint64_t)62" in src  # descriptor layout type (the swizzle mode) is set
    src = _src(ConvSpec(**L3, x_dtype="uint4", w_bits=4, out_dtype="uint4", lo=0, hi=15), "sm_90", knobs=WG)
    assert "wgmma.mma_async.sync.aligned.m64n128k32.s32.u8.s8" in src and ".s4" not in src
    assert "st.shared.v4.b32" in src and "cp.async" not in src.split("main_kernel")[-1]


@pytest.mark.nvcc
def test_cuda_wgmma_int4_loaders():
    """4-bit wgmma loaders: the packed ring (cp.async of packed vectors, read back by the thread that copied them)
    and register A (A packed in shared memory, fragments loaded as 32-bit words and unpacked for the register form
    of wgmma; with pipe 0 two fragment sets); invalid combinations are refused."""
    spec = ConvSpec(**L3, x_dtype="uint4", w_bits=4, out_dtype="uint4", lo=0, hi=15)
    wg4 = WG.replace(BK=64, stages=2, pipe=-1, pstages=3)
    src = _src(spec, "sm_90", knobs=wg4)  # (the asm helpers are emitted only when the kernel calls them)
    assert "cp.async.cg.shared.global" in src and "ld.shared.v4.b32" in src and "st.shared.v4.b32" in src
    assert "ld.shared.b32" not in src
    for kn in (wg4.replace(areg=True), wg4.replace(areg=True, pipe=0, stages=3)):
        assert kn.valid()
        src = _src(spec, "sm_90", knobs=kn)
        assert "ld.shared.b32" in src and "wgmma.mma_async.sync.aligned.m64n128k32.s32.u8.s8" in src
        # register A: the asm takes the four A registers as "r" operands before the B descriptor ("l")
        rs = [ln for ln in src.splitlines() if "wgmma.mma_async.sync.aligned" in ln and "asm" in ln]
        assert rs and all('"r"(' in ln for ln in rs)
    assert not wg4.replace(areg=True, pstages=0).valid() and not wg4.replace(areg=True, pipe=1, stages=4).valid()
    assert not GemmKnobs(areg=True, pstages=3).valid()  # mma.sync: no 4-bit loader knobs
    # awarp: each warp copies its own A rows, its next fragments are loaded behind a __syncwarp into a second set
    aw = wg4.replace(areg=True, awarp=True)
    assert aw.valid()
    src, base = _src(spec, "sm_90", knobs=aw), _src(spec, "sm_90", knobs=wg4.replace(areg=True))
    assert "ld.shared.b32" in src and src != base
    body = src.split("main_kernel(")[-1]
    assert body.count("tvm_builtin_cuda_warp_sync()") > base.split("main_kernel(")[-1].count("tvm_builtin_cuda_warp_sync()")
    for bad in (aw.replace(areg=False), aw.replace(pipe=0, stages=3), aw.replace(BN=256, WN=2)):
        assert not bad.valid()


def test_expand_w4_matches_the_kernels_a_unpack():
    """The w8 weight buffer (reference.expand_w4) against a NumPy model of the register-A unpack: for a packed
    16-byte k-step, lane q's fragment words hold (word q << 4) & 0xF0F0F0F0 (its 4 even values x16) at k 4q..4q+3 and
    word q & 0xF0F0F0F0 (the odd ones x16) at 16 + 4q..; the s8 dot product of that A order with the expanded
    weights is 256 x the dot product of the logical values, for signed and unsigned activations."""
    rng = np.random.default_rng(11)
    w = rng.integers(-8, 8, (5, 3, 64))
    we = R.expand_w4(w).astype(np.int64)
    assert we.dtype == np.int64 and np.abs(we).max() <= 128 and (we % 16 == 0).all()
    for signed in (False, True):
        x = rng.integers(-8, 8, 64) if signed else rng.integers(0, 16, 64)
        packed = int4.pack(x).reshape(-1, 16)  # 2 k-steps of 16 packed bytes
        a = []
        for step in packed:
            words = step.view(np.uint32)  # (little endian: byte 4q + i of the step is byte i of word q)
            lo = [((int(wd) << 4) & 0xF0F0F0F0) for wd in words]
            hi = [(int(wd) & 0xF0F0F0F0) for wd in words]
            for part in (lo, hi):
                b = np.array(part, np.uint32).view(np.uint8)
                a.append(b.view(np.int8).astype(np.int64) if signed else b.astype(np.int64))
        a = np.concatenate(a)
        np.testing.assert_array_equal(we @ a, 256 * (w @ x))
    with pytest.raises(ValueError, match="multiple of 32"):
        R.expand_w4(np.zeros((2, 48), np.int64))


@pytest.mark.nvcc
def test_cuda_wgmma_int4_w8():
    """w8: the register-A kernel takes its weights expanded to 8 bits (int8 [K, R, S, C]) and copies B with cp.async
    into its stages (no packed B slots read back); it needs areg and as many B stages as packed A stages (+ MMA groups
    in flight); elsewhere the knob is refused (mma.sync) or ignored (8-bit operands)."""
    from qcompile.schedules.igemm import w8_weights

    spec = ConvSpec(**L3, x_dtype="uint4", w_bits=4, out_dtype="uint4", lo=0, hi=15)
    aw = WG.replace(BK=64, stages=3, pipe=-1, pstages=3, areg=True, awarp=True)
    kn = aw.replace(w8=True)
    assert kn.valid()
    f = conv2d_int_kernel(spec, "sm_90", None, kn)
    assert w8_weights(f) and 'w: T.Buffer((128, 3, 3, 64), "int8")' in f.script()
    f0 = conv2d_int_kernel(spec, "sm_90", None, aw)
    assert not w8_weights(f0) and 'w: T.Buffer((128, 3, 3, 32), "int8")' in f0.script()
    src, base = cuda_source(build_cuda(f, "sm_90", mode="ptx")), cuda_source(build_cuda(f0, "sm_90", mode="ptx"))
    assert "ld.shared.b32" in src and "wgmma.mma_async.sync.aligned.m64n128k32.s32.u8.s8" in src
    # the packed B slots: read back with ld.shared.v4 and stored unpacked with st.shared.v4 -- gone with w8
    assert "ld.shared.v4.b32" in base and "ld.shared.v4.b32" not in src
    for bad in (kn.replace(areg=False, awarp=False), kn.replace(stages=2), kn.replace(pipe=0, awarp=False)):
        assert not bad.valid()
        with pytest.raises(NotApplicable):
            make_gemm_conv(spec, "sm_90", bad, adapt=False)
    assert not GemmKnobs(w8=True).valid()
    spec8 = ConvSpec(**L3, x_dtype="uint8", w_bits=8, out_dtype="uint8", lo=0, hi=255)
    assert not w8_weights(conv2d_int_kernel(spec8, "sm_90", None, kn))


def test_expand_w4_kperm_matches_the_agl_loads():
    """agl: within a K-chunk of BK packed bytes, thread q of a quad loads bytes [q BK/4, (q+1) BK/4) of its row and
    feeds word j of them to k-step j (its fragment slots 4q.. get the word's even values x16, 16 + 4q.. the odd ones);
    with the weights of reference.expand_w4(w, kperm=BK) the s8 sums over that A order are 256 x the logical ones --
    for 1x1 and 3x3 reductions (chunks across taps), BK 32/64/128, signed and unsigned activations."""
    rng = np.random.default_rng(12)
    for (R_, C, bk) in ((1, 64, 32), (3, 64, 32), (3, 128, 64), (1, 256, 128), (3, 256, 128)):
        w = rng.integers(-8, 8, (3, R_, R_, C))
        we = R.expand_w4(w, kperm=bk).reshape(3, -1).astype(np.int64)
        assert we.shape == (3, R_ * R_ * C) and (we % 16 == 0).all()
        for signed in (False, True):
            x = rng.integers(-8, 8, R_ * R_ * C) if signed else rng.integers(0, 16, R_ * R_ * C)
            a = []
            for chunk in int4.pack(x).reshape(-1, bk):
                spans = chunk.reshape(4, bk // 4)  # thread q's bytes
                for j in range(bk // 16):  # k-step j: word j of every thread's span
                    words = [int(spans[q, 4 * j:4 * j + 4].view(np.uint32)[0]) for q in range(4)]
                    for part in ([(wd << 4) & 0xF0F0F0F0 for wd in words], [wd & 0xF0F0F0F0 for wd in words]):
                        b = np.array(part, np.uint32).view(np.uint8)
                        a.append(b.view(np.int8).astype(np.int64) if signed else b.astype(np.int64))
            np.testing.assert_array_equal(we @ np.concatenate(a), 256 * (w.reshape(3, -1) @ x))
        if bk > 32:  # the plain order differs (the permutation is not the identity)
            assert (R.expand_w4(w, kperm=bk) != R.expand_w4(w)).any()
    with pytest.raises(ValueError, match="whole K-chunks"):
        R.expand_w4(np.zeros((2, 3, 3, 64), np.int64), kperm=64)  # 288 packed bytes: not whole 64-byte chunks


def test_permute_k8_matches_the_agl8_loads():
    """agl8: within a K-chunk of BK bytes, thread q of a quad loads bytes [q BK/4, (q+1) BK/4) of its row and feeds its
    words 2 ks and 2 ks + 1, 16-bit halves swapped, to k-step ks as fragment bytes 4q.. and 16 + 4q..; with the weights of
    reference.permute_k8(w, BK) the sums over that A order are the logical ones -- 1x1 and 3x3 reductions (chunks
    across taps), BK 32/64/128, signed and unsigned activations; the permutation is a permutation, not the identity."""
    rng = np.random.default_rng(13)
    for (R_, C, bk) in ((1, 64, 32), (3, 64, 32), (3, 64, 64), (3, 128, 128), (1, 256, 128)):
        w = rng.integers(-128, 128, (3, R_, R_, C)).astype(np.int8)
        wp = R.permute_k8(w, bk)
        assert wp.shape == w.shape and wp.dtype == np.int8
        np.testing.assert_array_equal(np.sort(wp.reshape(3, -1), 1), np.sort(w.reshape(3, -1), 1))
        for signed in (False, True):
            x = rng.integers(-128, 128, R_ * R_ * C) if signed else rng.integers(0, 256, R_ * R_ * C)
            a = []
            for chunk in x.reshape(-1, bk):
                spans = chunk.reshape(4, bk // 4)  # thread q's bytes
                for ks in range(bk // 32):
                    for h in range(2):  # k 16h + 4q + b of the step: byte b of word 2 ks + h of thread q
                        a.append(np.concatenate([spans[q, 4 * (2 * ks + h):4 * (2 * ks + h) + 4][[2, 3, 0, 1]]
                                                 for q in range(4)]))
            np.testing.assert_array_equal(wp.reshape(3, -1).astype(np.int64) @ np.concatenate(a),
                                          w.reshape(3, -1).astype(np.int64) @ x)
        if bk > 32 or C > 32:
            assert (wp != w).any()
    with pytest.raises(ValueError, match="whole K-chunks"):
        R.permute_k8(np.zeros((2, 3, 3, 64), np.int8), 128)  # 576 bytes: not whole 128-byte chunks


@pytest.mark.nvcc
def test_cuda_wgmma_int8_agl():
    """agl on 8-bit operands: the register-A kernel loads its A fragment words from global memory (ld.global.nc, 16 or
    8 bytes per row and K-chunk) into registers, issues the register-A wgmma (no A descriptor) and says which K-chunk
    its weights' k permutation has (w8_kperm; not w8: the weights stay [K, R, S, C]); with pipe 0 one group stays in
    flight; a reduction that is not whole K-chunks falls back (warned), HWNC is refused."""
    from qcompile.schedules.igemm import w8_kperm, w8_weights

    spec = ConvSpec(**L3, x_dtype="uint8", w_bits=8, out_dtype="uint8", lo=0, hi=255)
    kn = WG.replace(BM=64, WM=1, BN=64, BK=64, stages=4, pipe=-1, pstages=4, areg=True, awarp=True, w8=True, agl=True)
    plain = cuda_source(build_cuda(conv2d_int_kernel(spec, "sm_90", None, WG.replace(BM=64, WM=1, BN=64, BK=64)),
                                   "sm_90", mode="ptx"))
    assert "ld.global.nc" not in plain and '"l"(__a_desc)' in plain
    for k, ld in ((kn, "ld.global.nc.v4.b32"), (kn.replace(BK=32), "ld.global.nc.v2.b32"),
                  (kn.replace(pipe=0, stages=5), "ld.global.nc.v4.b32")):
        f = conv2d_int_kernel(spec, "sm_90", None, k)
        assert w8_kperm(f) == k.BK and not w8_weights(f) and 'w: T.Buffer((128, 3, 3, 64), "int8")' in f.script()
        src = cuda_source(build_cuda(f, "sm_90", mode="ptx"))
        assert ld in src and "wgmma.mma_async.sync.aligned.m64n64k32.s32.u8.s8" in src and '"r"(__a3)' in src
        assert ("wgmma.wait_group.sync.aligned 1;" in src) == (k.pipe == 0)
    with pytest.warns(UserWarning, match="agl needs"):  # 3x3 on 64 channels: 576 bytes, not whole 128-byte chunks
        assert w8_kperm(conv2d_int_kernel(spec, "sm_90", None, kn.replace(BK=128))) == 0
    with pytest.raises(NotApplicable, match="agl needs"):
        make_gemm_conv(dataclasses.replace(spec, layout="HWNC"), "sm_90", kn, layout="HWNC", adapt=False)


@pytest.mark.nvcc
def test_cuda_wgmma_narrow_n_tiles():
    """wgmma N tiles of 112 / 96 columns (tile counts of narrow grids): one m64n112 / m64n96 instruction per k-step, 8-
    and 4-bit; the epilogue's lanes must cover a 16-row block in whole passes (ev 16 does not divide 112 columns)."""
    spec8 = ConvSpec(**L3, x_dtype="uint8", w_bits=8, out_dtype="uint8", lo=0, hi=255)
    spec4 = ConvSpec(**L3, x_dtype="uint4", w_bits=4, out_dtype="uint4", lo=0, hi=15)
    for bn in (112, 96):
        kn = WG.replace(BN=bn, WM=1, pipe=-1)
        assert kn.valid() and kn.replace(BN=bn - 16).valid() == (bn == 112)
        assert "wgmma.mma_async.sync.aligned.m64n%dk32.s32.u8.s8" % bn in _src(spec8, "sm_90", knobs=kn)
        k4 = kn.replace(BK=64, pstages=3, areg=True, awarp=True, w8=True)
        assert "wgmma.mma_async.sync.aligned.m64n%dk32.s32.u8.s8" % bn in _src(spec4, "sm_90", knobs=k4)
    assert not WG.replace(BN=112, WM=1, ev=16).valid() and WG.replace(BN=96, WM=1, ev=16).valid()


@pytest.mark.nvcc
def test_cuda_wgmma_int4_agl():
    """agl: the register-A w8 kernel with warp-owned rows loads its A fragment words from global memory (ld.global.nc,
    16 or 8 bytes) into a register ring -- no A ring in shared memory (no ld.shared.b32 fragment reads) -- and says
    which K-chunk its weights' k permutation has (w8_kperm); it takes pipe 0 too (awarp alone does not); shapes whose
    reduction is not whole K-chunks, HWNC, and knobs without w8 + awarp, or with persist, are refused."""
    from qcompile.schedules.igemm import w8_kperm

    spec = ConvSpec(**dict(L3, C=128), x_dtype="uint4", w_bits=4, out_dtype="uint4", lo=0, hi=15)
    kn = WG.replace(BN=64, BK=64, stages=4, pipe=-1, pstages=4, areg=True, awarp=True, w8=True)
    for bk, ld in ((64, "ld.global.nc.v4.b32"), (32, "ld.global.nc.v2.b32")):
        f, f0 = (conv2d_int_kernel(spec, "sm_90", None, k.replace(BK=bk)) for k in (kn.replace(agl=True), kn))
        assert w8_kperm(f) == bk and w8_kperm(f0) == 0 and 'w: T.Buffer((128, 3, 3, 128), "int8")' in f.script()
        src, base = cuda_source(build_cuda(f, "sm_90", mode="ptx")), cuda_source(build_cuda(f0, "sm_90", mode="ptx"))
        assert ld in src and ld not in base and "wgmma.mma_async.sync.aligned.m64n64k32.s32.u8.s8" in src
        assert "ld.shared.b32" in base and "ld.shared.b32" not in src
    with pytest.warns(UserWarning, match="agl needs"):  # 3x3 on 64 channels: 288 packed bytes, not whole 64-byte chunks
        assert w8_kperm(conv2d_int_kernel(dataclasses.replace(spec, C=64), "sm_90", None, kn.replace(agl=True))) == 0
    with pytest.raises(NotApplicable, match="agl needs"):
        make_gemm_conv(dataclasses.replace(spec, layout="HWNC"), "sm_90", kn.replace(agl=True), layout="HWNC",
                       adapt=False)
    for bad in (kn.replace(agl=True, awarp=False), kn.replace(agl=True, w8=False), GemmKnobs(agl=True),
                kn.replace(agl=True, persist=1), kn.replace(pipe=0, stages=5), kn.replace(agl=True, pipe=0)):
        assert not bad.valid()  # (pipe 0 with warp-owned rows: agl only, with a B stage more)
    g1 = kn.replace(agl=True, pipe=0, stages=5)  # one MMA group in flight: three A-fragment sets, unrolled by lcm(3, 3)
    src = cuda_source(build_cuda(conv2d_int_kernel(spec, "sm_90", None, g1), "sm_90", mode="ptx"))
    assert g1.valid() and "wgmma.wait_group.sync.aligned 1;" in src and "ld.global.nc.v4.b32" in src


@pytest.mark.nvcc
def test_cuda_wgmma_warp_specialized():
    """wsp: producer warpgroups (after the consumers) fill the packed ring and unpack into the stages; named barriers
    1 + s (full) and 1 + STG + s (empty) count every thread; the producers skip the epilogue."""
    spec = ConvSpec(**L3, x_dtype="uint4", w_bits=4, out_dtype="uint4", lo=0, hi=15)
    for nprod in (1, 2):
        kn = WG.replace(BK=64, stages=4, pstages=4, pipe=0, wsp=nprod)
        assert kn.valid() and kn.threads == 256 + 128 * nprod and kn.load_threads == 128 * nprod
        src = _src(spec, "sm_90", knobs=kn)
        nth = kn.threads
        assert f"__launch_bounds__({nth})" in src
        assert "bar.sync %0, %1;" in src and "bar.arrive %0, %1;" in src and f"(uint){nth})" in src
        assert "wgmma.mma_async.sync.aligned.m64n128k32.s32.u8.s8" in src and "cp.async.cg.shared.global" in src
        assert f"threadIdx.x) < {nth - 128 * nprod})" in src  # the epilogue: consumers only
    wsp = WG.replace(BK=64, stages=4, pstages=4, pipe=0, wsp=1)
    for bad in (wsp.replace(pstages=0), wsp.replace(pipe=1), wsp.replace(areg=True, pipe=-1), GemmKnobs(wsp=1)):
        assert not bad.valid()
    with pytest.raises(NotApplicable, match="4-bit wgmma loader"):  # an 8-bit conv: no packed tiles to unpack
        make_gemm_conv(ConvSpec(**L3, x_dtype="uint8", out_dtype="uint8", lo=0, hi=255), "sm_90", wsp, adapt=False)


@pytest.mark.nvcc
def test_cuda_epilogue_and_launch_bounds():
    """Requantize with S >= 33 is one multiply-high on the int32 sum; the epilogue syncs per warp; ``minb`` becomes
    __launch_bounds__(threads, minb)."""
    spec = ConvSpec(**L3, x_dtype="uint8", out_dtype="uint8", lo=0, hi=255, shift_ge33=True)
    src = _src(spec, "sm_90", knobs=WG.replace(minb=2))
    assert "__mulhi(" in src and "__syncwarp()" in src and "__launch_bounds__(256, 2)" in src
    assert "__launch_bounds__(256)" in _src(spec, "sm_90", knobs=WG)
    # the staging tile is written (8-byte st.shared) and read back by its own warp: after the main loop's last
    # __syncthreads only __syncwarp (not a __syncthreads per 16-row block, which TVM's sync planner would add)
    for kn in (WG, GemmKnobs()):
        body = _src(spec, "sm_90", knobs=kn).split("main_kernel(")[-1]
        epi = body[body.rindex("__syncthreads()"):]
        assert "tvm_builtin_ptx_st_vec_shared_v2_b32(" in epi and "tvm_builtin_cuda_warp_sync()" in epi
    # a residual add on warpgroup tiles: the block's residual tile is copied into shared memory before the first
    # K-chunk's loads (cp.async, the kernel's first commit group: its latency runs under the main loop), and each lane
    # reads its words of the 16-row block (8-byte ld.shared, one per row it writes) before the staging round trip
    res = ConvSpec(**L3, x_dtype="uint8", out_dtype="uint8", lo=-128, hi=127, shift_ge33=True, has_residual=True,
                   res_dtype="uint8", zo2=-1, lo2=0, hi2=255, res_i32=True, rq2_uniform=(2, 1 << 19, -1, 1 << 19, 20))
    plain_spec = dataclasses.replace(res, has_residual=False, rq2_uniform=(), lo=0, hi=255)
    cpa, lds, rsrc = "cp_async_cg_src_size_async_cg_shared_global_16(", "ld_vec_shared_v2_b32", "(&(rf_ptr["
    for kn, st, n in ((WG, "st_vec_shared_v2_b32(", 8), (WG.replace(erq=True), "st_shared_b16", 16)):
        body = _src(res, "sm_90", knobs=kn).split("main_kernel(")[-1]
        plain = _src(plain_spec, "sm_90", knobs=kn).split("main_kernel(")[-1]
        assert body.count(cpa) - plain.count(cpa) == 4  # 128 rows x 128 bytes / 256 threads / 16 bytes
        assert body.index(rsrc) < body.index("(&(x_ptr[") and body.index(rsrc) < body.index("commit_group")
        epi, pe = body[body.rindex("__syncthreads()"):], plain[plain.rindex("__syncthreads()"):]
        # (erq: besides the 8 residual reads, the 8 read-backs of the staged bytes, unrolled alike)
        assert rsrc not in epi and rsrc not in pe and epi.count(lds) == n and epi.index(lds) < epi.index(st)
    # mma.sync tiles: each lane's residual words of the 16-row block loaded together from global memory (8-byte
    # ld.global.nc, one per row it writes) before the staging round trip, not one dependent load per row after it
    ld = "tvm_builtin_ptx_ld_vec_global_nc_v2_b32_s32("
    body = _src(res, "sm_90", knobs=GemmKnobs()).split("main_kernel(")[-1]
    epi = body[body.rindex("__syncthreads()"):]
    assert rsrc not in body  # (no copy of the tile: the words are read from rfw, the residual's word view)
    assert epi.count(ld) == 16 and epi.index(ld) < epi.index("st_vec_shared_v2_b32(")



@pytest.mark.nvcc
def test_cuda_4bit_output_words_mask_only_signed_values():
    """A 4-bit output word is summed from shifted values; a value the last stage clips to [0, 15] needs no mask (one
    LEA / IMAD per element: the epilogues of the output-heavy layers are ALU-bound). With a residual add the last stage
    is the residual one: its unsigned range decides, not stage 1's signed [-8, 7]; signed outputs keep the mask."""
    kn = WG.replace(BK=64, WM=1, stages=3, pipe=-1, pstages=3, areg=True, awarp=True, w8=True)
    res = ConvSpec(**L3, x_dtype="int4", w_bits=4, out_dtype="uint4", has_residual=True, res_dtype="uint4", zo=0,
                   lo=-8, hi=7, zo2=0, lo2=0, hi2=15, res_i32=True, rq2_uniform=(2, 1 << 19, -1, 1 << 19, 20))
    signed = dataclasses.replace(res, out_dtype="int4", lo2=-8, hi2=7)
    plain = dataclasses.replace(res, has_residual=False, rq2_uniform=(), lo=0, hi=15)
    for spec, masked in ((res, False), (signed, True), (plain, False),
                         (dataclasses.replace(plain, out_dtype="int4", lo=-8, hi=7), True)):
        words = re.findall(r"ofw_ptr\[[^\n]*", _src(spec, "sm_90", knobs=kn))
        assert words and all(("& (uint)15)" in w) == masked for w in words), (spec, words[:1])


@pytest.mark.nvcc
def test_cuda_residual_stage_off_the_alu():
    """The residual epilogues are ALU-bound (ncu: ALU pipe ~70%, tensor 6%), so their stage 2 takes fewer ALU
    instructions: unsigned residual fields come out of their word by a byte permute (after one mask per word half),
    stage 1's clip is one add-min-max relative to its lower bound (the bound folded into stage 2's constant addend,
    compiled in with the rest of the per-tensor constants). Signed fields: shifted to the top and arithmetically
    down."""
    kn = WG.replace(BK=64, WM=1, stages=3, pipe=-1, pstages=3, areg=True, awarp=True, w8=True)
    res = ConvSpec(**L3, x_dtype="int4", w_bits=4, out_dtype="uint4", has_residual=True, res_dtype="uint4", zo=0,
                   lo=-8, hi=7, zo2=0, lo2=0, hi2=15, res_i32=True, shift_ge33=True, rq2_uniform=(0, 1787590, 0, 760277, 20))

    def epi(spec):
        body = _src(spec, "sm_90", knobs=kn).split("main_kernel(")[-1]
        return body[body.rindex("__syncthreads()"):]

    e = epi(res)
    # (each field's byte of its masked word half: 0x0F0F0F0F; nvcc shares the two masks among a word's 8 fields)
    assert e.count("__byte_perm(") == e.count(" & 252645135)), (uint)0, (uint)1747") > 0
    # stage 1: max(min(v + 8, 15), 0), not a clip to [-8, 7]; stage 2: y1' M1 + (r M2 + (-8 M1 + 2^19)), >> 20
    assert "+ 8), 15), 0) * 1787590) + (((int)__byte_perm(" in e and "* 760277)) - 13776432) >> 20)" in e
    signed = epi(dataclasses.replace(res, res_dtype="int4"))
    assert "__byte_perm(" not in signed and "(((int)(((uint)rbw_ptr[0]) << (uint)24)) >> 28)" in signed
    wide = epi(dataclasses.replace(res, res_i32=False))  # (int64 stage 2: the same terms)
    assert "* (int64_t)760277)) - (int64_t)13776432) >> (int64_t)20)" in wide


@pytest.mark.nvcc
def test_cuda_residual_words_of_every_row_block():
    """Where a thread holds 128 accumulators (a 128x128 tile on one warpgroup: two m64 row blocks) the residual words
    of both row blocks are loaded at the epilogue's start, before the first staging store (per block, its loop kept
    the accumulators on the stack); narrower tiles read each block's words (from the tile's copy in shared memory)
    just before its own staging round trip."""
    res = ConvSpec(**L3, x_dtype="uint8", out_dtype="uint8", lo=-128, hi=127, shift_ge33=True, has_residual=True,
                   res_dtype="uint8", zo2=-1, lo2=0, hi2=255, res_i32=True, rq2_uniform=(2, 1 << 19, -1, 1 << 19, 20))
    ld, st, loop = "tvm_builtin_ptx_ld_vec_global_nc_v2_b32_s32(", "st_vec_shared_v2_b32(", "for (int i = 0; i < 2; ++i)"
    epi = _src(res, "sm_90", knobs=WG.replace(WM=1, stages=2, pipe=-1, minb=3)).split("main_kernel(")[-1]
    epi = epi[epi.rindex("__syncthreads()"):]
    assert loop not in epi and epi.count(ld) == 16 and epi[:epi.index(st)].count(ld) == 16  # 2 blocks x 8 rows / lane
    epi = _src(res, "sm_90", knobs=WG.replace(WM=1, BN=64, stages=2, pipe=-1)).split("main_kernel(")[-1]
    epi = epi[epi.rindex("__syncthreads()"):]  # (its tile copied into shared memory: 4 rows per lane and block)
    lds = "ld_vec_shared_v2_b32"
    assert ld not in epi and epi.index(loop) < epi.index(lds) < epi.index(st) and epi.count(lds) == 4


@pytest.mark.nvcc
def test_cuda_wide_epilogue_vectors():
    """16 epilogue elements per lane (``ev`` 16) with int32 outputs: stored as 16-byte vectors (TVM's CUDA codegen
    cannot print a 64-byte int32x16 store)."""
    spec = ConvSpec(**L3, x_dtype="uint8", out_dtype="int32", zo=7, lo=-(1 << 31), hi=(1 << 31) - 1)
    for kn in (WG.replace(ev=16), WG.replace(ev=8), GemmKnobs(ev=16)):
        src = _src(spec, "sm_90", knobs=kn)
        assert "int32x" not in src and "*(int4*)(of_ptr + " in src


@pytest.mark.nvcc
def test_cuda_erq_and_persist():
    """erq: stage 1 of the requantize runs on the accumulators and the 8-bit intermediate is staged (2-byte stores,
    one 8-byte read-back per lane); with an unclamped int32 output (wider than a byte) the int32 staging stays. persist: a grid
    of persist x SMs blocks (the K-chunk stream crosses tile boundaries) under __launch_bounds__(threads, persist);
    mma.sync and the 4-bit loaders do not take it, and blocks that cannot share an SM are refused."""
    spec = ConvSpec(**L3, x_dtype="uint8", out_dtype="uint8", lo=0, hi=255, shift_ge33=True)
    body = _src(spec, "sm_90", knobs=WG.replace(erq=True)).split("main_kernel(")[-1]
    assert "st_shared_b16" in body and "ld_vec_shared_v2_b32" in body and "ld_vec_global_nc_v2_b32" in body
    assert "st_vec_shared_v2_b32" not in body  # (the int32 staging's accumulator stores)
    s32 = ConvSpec(**L3, x_dtype="uint8", out_dtype="int32", lo=-(1 << 31), hi=(1 << 31) - 1)
    assert _src(s32, "sm_90", knobs=WG.replace(erq=True)) == _src(s32, "sm_90", knobs=WG)
    big = ConvSpec(N=64, H=28, W=28, C=64, K=256, R=1, S=1, x_dtype="uint8", out_dtype="uint8", lo=0, hi=255)
    kn = WG.replace(erq=True, persist=2, stages=2, pipe=-1)
    assert kn.valid()
    f = make_gemm_conv(big, "sm_90", kn, adapt=False)
    tiles = (64 * 28 * 28 // 128) * (256 // 128)
    assert f'T.launch_thread("blockIdx.x", {min(tiles, 2 * 132)})' in f.script()
    body = _src(big, "sm_90", knobs=kn).split("main_kernel(")[-1]
    assert "__launch_bounds__(256, 2)" in _src(big, "sm_90", knobs=kn) and "st_shared_b16" in body
    assert f'T.launch_thread("blockIdx.x", {256 // 128})' in make_gemm_conv(big, "sm_90", WG, adapt=False).script()
    with pytest.raises(NotApplicable, match="persist=2"):  # two 116 KiB blocks do not fit one SM
        make_gemm_conv(big, "sm_90", WG.replace(erq=True, persist=2), adapt=False)
    assert not GemmKnobs(persist=1).valid() and not WG.replace(BK=64, stages=2, pstages=3, areg=True, persist=1).valid()
    s4 = ConvSpec(**L3, x_dtype="uint4", w_bits=4, out_dtype="uint4", lo=0, hi=15)
    wg4 = WG.replace(BK=64)  # 4-bit register loader: one block per tile whatever persist says
    assert _src(s4, "sm_90", knobs=wg4.replace(persist=1)) == _src(s4, "sm_90", knobs=wg4)


def ri_decl(script):
    """The shape of the persistent kernel's decoded-rows buffer ``ri`` in a TVMScript kernel (None: not declared)."""
    m = re.search(r"ri = T\.alloc_local\(\(([0-9, ]+)\)", script)
    return tuple(int(v) for v in m.group(1).split(",") if v.strip()) if m else None


@pytest.mark.nvcc
def test_cuda_wgmma_int4_w8_persist():
    """persist on the 4-bit register-A loader with warp-owned rows and expanded weights (awarp + w8): a grid of
    persist x SMs blocks walks the tiles, the packed-A / B chunk stream crossing tile boundaries (im2col rows decoded
    once per tile), under __launch_bounds__(threads, persist); the other 4-bit loaders do not take it."""
    from qcompile.schedules.igemm import w8_weights

    kn = GemmKnobs(BM=128, BN=64, BK=64, WM=1, WN=1, stages=3, pstages=3, pipe=-1, mma="wgmma", areg=True, awarp=True,
                   w8=True, persist=2)
    assert kn.valid()
    for shape, pointwise in ((dict(N=64, H=28, W=28, C=64, K=256, R=1, S=1), True), (dict(L3, N=32, H=28, W=28), False)):
        spec = ConvSpec(**shape, x_dtype="uint4", w_bits=4, out_dtype="uint4", lo=0, hi=15)
        P = spec.P
        tiles = -(-(spec.N * P * P) // 128) * (spec.K // 64)
        f = make_gemm_conv(spec, "sm_90", kn, adapt=False)
        assert w8_weights(f) and tiles > 2 * 132
        assert f'T.launch_thread("blockIdx.x", {2 * 132})' in f.script()
        src = cuda_source(build_cuda(f, "sm_90", mode="ptx"))
        assert "__launch_bounds__(128, 2)" in src and "wgmma.mma_async.sync.aligned.m64n64k32.s32.u8.s8" in src
        plain = make_gemm_conv(spec, "sm_90", kn.replace(persist=0), adapt=False).script()
        assert f'T.launch_thread("blockIdx.x", {spec.K // 64})' in plain
        # not pointwise: the rows' decode kept in registers per tile (3 words per A vector of the thread)
        a_it = 128 * 64 // 16 // 128
        assert ri_decl(f.script()) == ((3 * a_it,) if not pointwise else None)  # (pointwise: no decode)
    for bad in (kn.replace(w8=False), kn.replace(awarp=False), kn.replace(areg=False, awarp=False, w8=False),
                kn.replace(sk=2, persist=0)):
        assert not bad.valid()


@pytest.mark.nvcc
def test_cuda_pingpong():
    """pp: one block per SM (grid min(tiles, SMs)) of 384 threads -- a producer warpgroup streaming the K-chunks with
    cp.async and two consumer warpgroups taking the block's tiles in turn -- synchronised by named barriers (full per
    consumer and stage, empty per stage: 3 x stages + 1 of the 16) and with registers moved to the consumers
    (setmaxnreg 56 / 224); no split-K pair. 8-bit operands; 4-bit as the register-A kernel with expanded weights
    (w8, pipe -1 or 0, a packed A slot per stage: each consumer unpacks its own A fragments) or with the producer
    unpacking a packed ring into the shared stages (pstages >= 2, no areg)."""
    from qcompile.schedules.igemm import split_factor, w8_weights

    spec = ConvSpec(N=64, H=14, W=14, C=256, K=1024, R=1, S=1, x_dtype="uint8", out_dtype="uint8", lo=0, hi=255)
    kn = WG.replace(WM=1, pipe=0, stages=4, pp=True)
    assert kn.valid() and kn.threads == 384 and kn.load_threads == 128 and split_factor(spec, "sm_90", kn) == 1
    tiles = -(-64 * 14 * 14 // 128) * (1024 // 128)
    f = make_gemm_conv(spec, "sm_90", kn, adapt=False)
    assert f'T.launch_thread("blockIdx.x", {min(tiles, 132)})' in f.script() and tiles > 2 * 132
    src = cuda_source(build_cuda(f, "sm_90", mode="ptx"))
    body = src.split("main_kernel(")[-1]
    assert "__launch_bounds__(384, 1)" in src and "wgmma_int_ss_mma_async_sync_aligned_m64n128k32_s32_u8_s8" in body
    assert "setmaxnreg_dec_sync_aligned_u32_56" in body and "setmaxnreg_inc_sync_aligned_u32_224" in body
    assert "bar_sync" in body and "bar_arrive" in body and body.count("__syncthreads()") == 1  # (at the very end)
    # the barrier ids: full (consumer c, stage s) = 1 + 4c + s, empty s = 9 + s
    assert "((uint)9 + ((uint)(g & 3)))" in body
    for bad in (kn.replace(WM=2), kn.replace(stages=6), kn.replace(persist=1), kn.replace(sk=1),
                kn.replace(split_k=2), kn.replace(wsp=1), kn.replace(mma="sync", pipe=0)):
        assert not bad.valid()
    s4 = spec.replace(x_dtype="uint4", w_bits=4, out_dtype="uint4", lo=0, hi=15)
    kn4 = WG.replace(WM=1, BK=64, pipe=-1, stages=4, pstages=4, areg=True, w8=True, pp=True)
    assert kn4.valid()
    f4 = make_gemm_conv(s4, "sm_90", kn4, adapt=False)
    assert w8_weights(f4) and f'T.launch_thread("blockIdx.x", {min(tiles, 132)})' in f4.script()
    body = cuda_source(build_cuda(f4, "sm_90", mode="ptx")).split("main_kernel(")[-1]
    assert "wgmma_int_rs_mma_async_sync_aligned_m64n128k32_s32_u8_s8" in body and "setmaxnreg_inc" in body
    assert "wait_group_sync_aligned_1()" not in body and "ar_ptr[63]" not in body  # (pipe -1: one fragment set)
    for bad in (kn4.replace(pipe=1), kn4.replace(pstages=3), kn4.replace(awarp=True), kn4.replace(pstages=1, w8=False),
                kn4.replace(areg=False, w8=False, pstages=1)):
        assert not bad.valid()
    # ... with a group in flight (pipe 0): chunk kc's fragments unpacked into one of two register sets (32 words each
    # here: 4 k-steps x 2 m64 instructions x 4) while chunk kc - 1's MMAs read the other (that ptxas keeps the sets
    # apart: test_sass_register_a_fragments_not_overwritten_in_flight)
    kn4g = kn4.replace(pipe=0)
    assert kn4g.valid() and kn4g.replace(stages=3, pstages=3).valid() and not kn4g.replace(pstages=3).valid()
    src = _src(s4, "sm_90", knobs=kn4g)
    body = src.split("main_kernel(")[-1]
    assert "wgmma_int_rs_mma_async_sync_aligned_m64n128k32_s32_u8_s8" in body and "ar_ptr[63]" in body
    assert "wait_group_sync_aligned_1()" in body
    # ... reading its fragments in agl's k order (agl): one 16-byte ld.shared per row and chunk instead of a 4-byte one
    # per k-step, the expanded weights k-permuted by the chunk (w8_kperm); NHWC and whole K-chunks only
    from qcompile.schedules.igemm import w8_kperm

    kn4k = kn4g.replace(agl=True)
    assert kn4k.valid() and not kn4k.replace(areg=False, pstages=3).valid()
    f4k = make_gemm_conv(s4, "sm_90", kn4k, adapt=False)
    assert w8_kperm(f4k) == 64 and w8_kperm(make_gemm_conv(s4, "sm_90", kn4g, adapt=False)) == 0
    assert "ld.shared.v4.b32" not in src  # (pipe 0 above, without agl: 4-byte fragment loads)
    src = cuda_source(build_cuda(f4k, "sm_90", mode="ptx"))
    body = src.split("main_kernel(")[-1]
    assert "ld.shared.v4.b32" in src and "wgmma_int_rs_mma_async_sync_aligned_m64n128k32_s32_u8_s8" in body
    with pytest.raises(NotApplicable, match="agl"):  # (HWNC)
        make_gemm_conv(s4.replace(layout="HWNC"), "sm_90", kn4k, adapt=False)
    # 4-bit, the producer unpacking its packed ring into the shared stages: both operands through descriptors
    kn4u = WG.replace(WM=1, BK=64, pipe=0, stages=3, pstages=3, pp=True, erq=True)  # (int32 staging: > 227 KiB)
    assert kn4u.valid()
    body = _src(s4, "sm_90", knobs=kn4u).split("main_kernel(")[-1]
    assert "wgmma_int_ss_mma_async_sync_aligned_m64n128k32_s32_u8_s8" in body and "wgmma_int_rs" not in body
    assert "setmaxnreg_dec_sync_aligned_u32_56" in body and body.count("__syncthreads()") == 1
    # ... with expanded weights (w8): B copied into its stages, only A unpacked; the ring stages - 1 - pipe deep
    kn4w = WG.replace(WM=1, BM=64, BK=64, pipe=0, stages=4, pstages=3, pp=True, w8=True)
    assert kn4w.valid() and not kn4w.replace(pstages=2).valid() and kn4w.replace(pipe=-1, pstages=4).valid()
    f4w = make_gemm_conv(s4, "sm_90", kn4w, adapt=False)
    assert w8_weights(f4w) and int(f4w.params[1].shape[-1]) == 256  # (the weights expanded: C bytes per tap)
    body = cuda_source(build_cuda(f4w, "sm_90", mode="ptx")).split("main_kernel(")[-1]
    assert "wgmma_int_ss_mma_async_sync_aligned_m64n128k32_s32_u8_s8" in body and "wgmma_int_rs" not in body
    assert "setmaxnreg_dec_sync_aligned_u32_56" in body and body.count("__syncthreads()") == 1
    with pytest.raises(NotApplicable, match="pp"):  # the 8-bit kernel's knobs on 4-bit operands
        make_gemm_conv(s4, "sm_90", kn, adapt=False)


@pytest.mark.nvcc
def test_cuda_stream_k():
    """sk: a grid of sk x SMs blocks splits the (tile, K-chunk) iterations evenly; the blocks holding a tile's later
    chunks store int32 partials and count themselves (red.release.gpu), the tile's owner waits for the count
    (ld.acquire.gpu), adds the partials (ld.global.cg), resets the counter and runs the epilogue. Parameters: skc
    (zeros) before out, the workspace after it; no split-K pair; 8-bit wgmma only (4-bit: one block per tile)."""
    spec = ConvSpec(N=8, H=7, W=7, C=512, K=512, R=3, S=3, padding=1, x_dtype="uint8", out_dtype="uint8", lo=0, hi=255)
    kn = WG.replace(pipe=-1, sk=1)
    assert kn.valid() and not GemmKnobs(sk=1).valid() and not kn.replace(persist=1).valid()
    assert not kn.replace(split_k=2).valid()
    from qcompile.schedules import conv2d_int_plan
    from qcompile.schedules.igemm import streamk_args

    fs = conv2d_int_plan(spec, "sm_90", None, kn)
    assert len(fs) == 1  # (the same conv without sk is a split-K pair here)
    assert len(conv2d_int_plan(spec, "sm_90", None, kn.replace(sk=0))) == 2
    tiles, iters = 4 * 4, 4 * 4 * (9 * 512 // 128)
    nacc = 128 * 128 // 256  # accumulator words per thread
    assert streamk_args(fs[0]) == [tiles, 132 * 2 * 256 * nacc] and iters > 132
    assert [p.name for p in fs[0].params] == ["x", "w", "bias", "Mq", "Sq", "skc", "out", "skw"]
    assert 'T.launch_thread("blockIdx.x", 132)' in fs[0].script()
    src = _src(spec, "sm_90", knobs=kn)
    body = src.split("main_kernel(")[-1]
    for ins in ("red.release.gpu.global.add.s32", "ld.acquire.gpu.global.s32", "ld.global.cg.v4.b32",
                "st.global.cg.v4.b32"):
        assert ins in src, ins
    assert "__launch_bounds__(256, 1)" in src and "ri_ptr" in body  # (the A rows decoded once per tile)
    s4 = ConvSpec(**L3, x_dtype="uint4", w_bits=4, out_dtype="uint4", lo=0, hi=15)
    assert streamk_args(conv2d_int_kernel(s4, "sm_90", None, WG.replace(BK=64, sk=1))) is None


@pytest.mark.nvcc
def test_cuda_pointwise_addressing():
    """A 1x1 stride-1 unpadded conv reads A as the input itself (no im2col decode: no division by the P*Q = 196
    pixels per image), with its K loop unrolled by two; a strided 1x1 or a 3x3 still decodes (truncating division)."""
    pw = ConvSpec(N=8, H=14, W=14, C=256, K=256, R=1, S=1, x_dtype="uint8", out_dtype="uint8", lo=0, hi=255)
    for kn in (WG.replace(pipe=-1), GemmKnobs()):
        body = _src(pw, "sm_90", knobs=kn).split("main_kernel(")[-1]
        assert "/ 196)" not in body and "cp.async" in _src(pw, "sm_90", knobs=kn)
    assert "#pragma unroll 2" in _src(pw, "sm_90", knobs=WG.replace(pipe=-1)).split("main_kernel(")[-1]
    for other in (ConvSpec(N=8, H=28, W=28, C=256, K=256, R=1, S=1, stride=2, x_dtype="uint8", out_dtype="uint8",
                           lo=0, hi=255),
                  ConvSpec(N=8, H=14, W=14, C=256, K=256, R=3, S=3, padding=1, x_dtype="uint8", out_dtype="uint8",
                           lo=0, hi=255)):
        body = _src(other, "sm_90", knobs=WG.replace(pipe=-1)).split("main_kernel(")[-1]
        assert "/ 196)" in body and "#pragma unroll 2" not in body


@pytest.mark.nvcc
def test_wgmma_knobs_fall_back():
    """wgmma knobs on an arch without wgmma, or a shape the 16-byte tile loader cannot take: the mma.sync kernel,
    with a warning that says so."""
    assert WG.valid() and WG.threads == 256 and not WG.replace(BM=64).valid()
    with pytest.warns(UserWarning, match="wgmma knobs do not apply"):
        src = _src(ConvSpec(**L3, x_dtype="uint8", out_dtype="uint8", lo=0, hi=255), "sm_86", knobs=WG)
    assert "mma.sync.aligned.m16n8k32" in src and "wgmma" not in src
    with pytest.warns(UserWarning, match="wgmma knobs do not apply"):
        src = _src(ConvSpec(**dict(L3, C=40), x_dtype="uint8", out_dtype="uint8", lo=0, hi=255), "sm_90", knobs=WG)
    assert "mma.sync" in src and "wgmma.mma_async" not in src


@pytest.mark.skipif(find_tool("cuobjdump") is None or find_tool("nvdisasm") is None,
                    reason="cuobjdump/nvdisasm not installed (pip: nvidia-cuda-cuobjdump, nvidia-cuda-nvdisasm)")
@pytest.mark.nvcc
def test_sass(tmp_path):
    tool = find_tool("cuobjdump")
    env = dict(os.environ, PATH=os.path.dirname(find_tool("nvdisasm")) + os.pathsep + os.environ.get("PATH", ""))

    def sass(spec, arch, knobs=None):
        d = tmp_path / arch / spec.x_dtype
        build_cuda(conv2d_int_kernel(spec, arch, knobs=knobs), arch, mode="sass", keep=str(d))
        return subprocess.run([tool, "-sass", str(d / "kernel.fatbin")], capture_output=True, text=True, env=env).stdout

    # sm_90's mma.sync kernel (what shapes wgmma cannot take get; untuned NHWC shapes get wgmma: below)
    s = sass(ConvSpec(**L3, x_dtype="int8"), "sm_90", DEFAULT_KNOBS["sm_90"])
    assert "IMMA.16832.S8.S8" in s
    s = sass(ConvSpec(**L3, x_dtype="int4", w_bits=4), "sm_90", DEFAULT_KNOBS["sm_90"])
    assert "IMMA.16832.S8.S8" in s and "S4" not in s
    s = sass(ConvSpec(**L3, x_dtype="int4", w_bits=4), "sm_86")
    assert "IMMA.16864.S4.S4" in s
    s = sass(ConvSpec(**L3, x_dtype="int4", w_bits=4), "sm_75")
    assert "IMMA.8832.S4.S4" in s
    d = tmp_path / "wgmma"
    build_cuda(conv2d_int_kernel(ConvSpec(**L3, x_dtype="uint8"), "sm_90", knobs=WG), "sm_90", mode="sass", keep=str(d))
    s = subprocess.run([tool, "-sass", str(d / "kernel.fatbin")], capture_output=True, text=True, env=env).stdout
    assert "IGMMA.64x128x32.U8.S8" in s and "arch = sm_90a" in s and "IMMA" not in s
    d = tmp_path / "wgmma_areg"  # register A: IGMMA's A operand is a register, B a descriptor
    kn = WG.replace(BK=64, stages=2, pipe=-1, pstages=3, areg=True)
    build_cuda(conv2d_int_kernel(ConvSpec(**L3, x_dtype="uint4", w_bits=4), "sm_90", knobs=kn), "sm_90", mode="sass",
               keep=str(d))
    s = subprocess.run([tool, "-sass", str(d / "kernel.fatbin")], capture_output=True, text=True, env=env).stdout
    assert re.search(r"IGMMA\.64x128x32\.U8\.S8 R\d+, R\d+, gdesc", s) and "S4" not in s
    # an untuned 4-bit shape's default kernel (schedules.default_knobs): register-A IGMMA on the unpacked operands
    s = sass(ConvSpec(**dict(L3, N=3), x_dtype="int4", w_bits=4), "sm_90")
    assert re.search(r"IGMMA\.64x64x32\.S8\.S8 R\d+, R\d+, gdesc", s) and "S4" not in s and "arch = sm_90a" in s


@pytest.mark.skipif(find_tool("cuobjdump") is None or find_tool("nvdisasm") is None,
                    reason="cuobjdump/nvdisasm not installed (pip: nvidia-cuda-cuobjdump, nvidia-cuda-nvdisasm)")
@pytest.mark.nvcc
def test_sass_register_a_fragments_not_overwritten_in_flight(tmp_path):
    """Register-A wgmma: no instruction writes an IGMMA's A fragment registers before the DEPBAR retiring it
    (cuda_tools.wgmma_a_hazards) -- the agl loaders on 8- and 4-bit operands, pipe -1 and 0, one and two warpgroups;
    among them the 8-bit configuration whose first build (plain register copies as fragments) ptxas compiled with loads
    into in-flight fragments (all 200k outputs wrong on the H100); and the 4-bit register-A ping-pong with a group in
    flight (two fragment sets per consumer), plain and in agl's k order. The checker itself flags a hand-made
    hazard."""
    from qcompile.cuda_tools import wgmma_a_hazards

    tool = find_tool("cuobjdump")
    env = dict(os.environ, PATH=os.path.dirname(find_tool("nvdisasm")) + os.pathsep + os.environ.get("PATH", ""))
    agl = GemmKnobs(BM=128, BN=64, BK=128, WM=2, WN=1, stages=3, pipe=-1, mma="wgmma", pstages=3, areg=True,
                    awarp=True, w8=True, agl=True)
    s8 = ConvSpec(N=8, H=7, W=7, C=2048, K=512, R=1, S=1, x_dtype="uint8", out_dtype="uint8", lo=0, hi=255)
    s4 = ConvSpec(**dict(L3, C=128), x_dtype="uint4", w_bits=4, out_dtype="uint4", lo=0, hi=15)
    pp4 = GemmKnobs(BM=128, BN=128, BK=64, WM=1, WN=1, stages=4, pipe=0, mma="wgmma", pstages=4, areg=True, w8=True,
                    pp=True)
    for i, (spec, kn) in enumerate(((s8, agl), (s8, agl.replace(BK=64, BN=128, pipe=0, stages=4)),
                                    (s4, agl.replace(BK=64, BM=64, WM=1, pstages=4, pipe=0, stages=5)),
                                    (s4, agl.replace(BK=64, BN=128, pstages=4, stages=4)),
                                    (s4, pp4), (s4, pp4.replace(agl=True)))):
        d = tmp_path / f"k{i}"
        build_cuda(conv2d_int_kernel(spec, "sm_90", knobs=kn), "sm_90", mode="sass", keep=str(d))
        s = subprocess.run([tool, "-sass", str(d / "kernel.fatbin")], capture_output=True, text=True, env=env).stdout
        assert re.search(r"IGMMA\.64x\d+x32\.U8\.S8 R\d+, R\d+, gdesc", s), kn
        assert ("USETMAXREG" in s) == kn.pp, kn  # (the ping-pong kernel: registers moved to its consumers)
        assert wgmma_a_hazards(s) == [], (kn, wgmma_a_hazards(s)[:4])
    bad = ("        /*0100*/                   IGMMA.64x64x32.U8.S8 R24, R56, gdesc[UR4], R24, gsb0 ;\n"
           "        /*0110*/              @!P3 LDG.E.128.CONSTANT R60, desc[UR14][R60.64] ;\n"
           "        /*0120*/                   LDG.E.128.CONSTANT R56, desc[UR14][R58.64] ;\n"
           "        /*0130*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;\n"
           "        /*0140*/                   LDG.E.128.CONSTANT R56, desc[UR14][R58.64] ;\n")
    assert [h.split(":")[0] for h in wgmma_a_hazards(bad)] == ["0120"]


@pytest.mark.parametrize("spec", [
    ConvSpec(N=1, H=7, W=7, C=64, K=24, R=3, S=3, padding=1, x_dtype="uint8", out_dtype="uint8", lo=0, hi=255, zo=2),
    ConvSpec(N=2, H=5, W=5, C=32, K=10, R=1, S=1, layout="HWNC", x_dtype="uint4", w_bits=4, out_dtype="uint4",
             lo=-8, hi=7, has_residual=True, res_dtype="uint4", lo2=0, hi2=15, zo2=1),
], ids=["nhwc-int8", "hwnc-int4-residual"])
def test_splitk_epilogue_llvm_matches_numpy(spec):
    """Split-K's second kernel: sum of the int32 partials + the single kernel's epilogue, bit for bit."""
    from qcompile.schedules.splitk import make_splitk_epilogue, workspace_shape

    rng = np.random.default_rng(11)
    split = 4
    x, w, b, M, S, res = R.random_problem(spec, rng)
    acc = R.conv_acc_nhwc(x if spec.layout == "NHWC" else np.transpose(x, (2, 0, 1, 3)),
                          w if spec.layout == "NHWC" else np.transpose(w, (2, 0, 1, 3)), spec)
    if spec.layout == "HWNC":
        acc = np.transpose(acc, (1, 2, 0, 3))
    # random split of the accumulator into `split` int32 partial sums
    flat = acc.reshape(-1, spec.K)
    parts = rng.integers(-(1 << 20), 1 << 20, (split - 1,) + flat.shape)
    ws = np.concatenate([parts, (flat - parts.sum(0))[None]]).astype(np.int32)
    assert ws.shape == workspace_shape(spec, split)
    func = make_splitk_epilogue(spec, split, "llvm")
    args = [ws, b, M, S] + R.residual_args(spec, res)
    _run_llvm_and_compare(func, args, spec, rng, (x, w, b, M, S, res))


@pytest.mark.nvcc
def test_splitk_plan():
    """Small output grids (batch 1, 7x7) are split over K; large ones are not; the partial kernel has no epilogue."""
    from qcompile.schedules import conv2d_int_plan

    l4 = ConvSpec(N=1, H=7, W=7, C=512, K=512, R=3, S=3, padding=1, x_dtype="uint8", out_dtype="uint8", lo=0, hi=255)
    plan = conv2d_int_plan(l4, "sm_90")
    assert len(plan) == 2 and int(plan[0].attrs["qcompile.split_k"]) > 1
    assert [len(f.params) for f in plan] == [3, 5]  # (x, w, ws) and (ws, bias, M, S, out)
    src = cuda_source(build_cuda(plan[0], "sm_90", mode="ptx"))
    ins = "wgmma.mma_async" if "wgmma" in str(plan[0].attrs["qcompile.knobs"]) else "m16n8k32.row.col.s32.u8.s8.s32"
    assert "blockIdx.z" in src and ins in src  # the partial GEMM on the tuning log's MMA path
    src = cuda_source(build_cuda(plan[1], "sm_90", mode="ptx"))
    assert "mma" not in src
    # both MMA paths split the same way
    for kn, ins in ((GemmKnobs(), "m16n8k32.row.col.s32.u8.s8.s32"), (WG.replace(BM=64, WM=1), "wgmma.mma_async")):
        p2 = conv2d_int_plan(l4, "sm_90", knobs=kn)
        assert len(p2) == 2 and int(p2[0].attrs["qcompile.split_k"]) > 1
        src = cuda_source(build_cuda(p2[0], "sm_90", mode="ptx"))
        assert "blockIdx.z" in src and ins in src
    assert len(conv2d_int_plan(l4.replace(N=64), "sm_90")) == 1
    # forced by the knob
    forced = conv2d_int_plan(l4.replace(N=64), "sm_90", knobs=GemmKnobs(split_k=2))
    assert int(forced[0].attrs["qcompile.split_k"]) == 2
    # 16 epilogue elements per lane (ev 16, valid knobs): the int32 partial sums go out as 16-byte vectors (this used
    # to stop in TVM's codegen: "Cannot convert type T.int32x16 to CUDA type")
    p16 = conv2d_int_plan(l4, "sm_90", knobs=WG.replace(BM=64, WM=1, ev=16))
    assert int(p16[0].attrs["qcompile.split_k"]) > 1
    src = cuda_source(build_cuda(p16[0], "sm_90", mode="ptx"))
    assert "int32x" not in src and src.count("*(int4*)(of_ptr + ") == 4  # (16 int32 per lane: four 16-byte stores)


def _legalized(build):
    """The fused, legalized PrimFuncs of a one-op Relax function (what dlight's rules see in the CUDA pipeline)."""
    from tvm import relax

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(build.shape, getattr(build, "dtype", "uint8")))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit_output(build(x))
        bb.emit_func_output(y)
    mod = relax.transform.LegalizeOps()(bb.get())
    mod = relax.transform.FuseTIR()(relax.transform.FuseOps()(relax.transform.AnnotateTIROpPattern()(mod)))
    return [f for f in mod.functions.values() if isinstance(f, tvm.tirx.PrimFunc)]


@pytest.mark.nvcc
def test_glue_pool_rule():
    """ChannelsLastWindowReduction schedules NHWC pools (the stem's max pool, the global average pool's sum) with
    vector loads and stores of 4 channels per thread, and leaves other reductions, and pools with few outputs (batch 1),
    to dlight."""
    from tvm import relax

    from qcompile.schedules.glue import ChannelsLastWindowReduction

    def maxpool(x):
        return relax.op.nn.max_pool2d(x, (3, 3), (2, 2), (1, 1, 1, 1), layout="NHWC")
    maxpool.shape = [64, 14, 14, 64]

    def avgsum(x):
        return relax.op.sum(relax.op.astype(x, "int32"), axis=[1, 2])
    avgsum.shape = [256, 7, 7, 512]

    def avgsum_b1(x):
        return avgsum(x)
    avgsum_b1.shape = [1, 7, 7, 2048]

    def rowsum(x):  # a reduction over the channels: not a window
        return relax.op.sum(relax.op.astype(x, "int32"), axis=[3])
    rowsum.shape = [2, 7, 7, 256]

    tgt = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
    rule = ChannelsLastWindowReduction()
    assert rule.apply(_legalized(rowsum)[0], tgt, False) is None
    assert rule.apply(_legalized(avgsum_b1)[0], tgt, False) is None  # 512 outputs of 4 channels
    for build, load, store in ((maxpool, "*(uint*)(x_ptr", "*(uint*)(pool_max_ptr"), (avgsum, "*(uint*)(x_ptr", "int4")):
        (f,) = _legalized(build)
        sch = rule.apply(f, tgt, False)
        assert sch is not None
        src = cuda_source(build_cuda(sch.mod["main"].with_attr("global_symbol", "glue"), "sm_90", mode="ptx"))
        assert load in src and store in src, src[-3000:]


@pytest.mark.nvcc
def test_glue_gather_row_rule():
    """GatherRowElementwise: the input quantize fused with the NCHW -> NHWC transpose, the channel pad and the stem's
    space-to-depth (output byte (2 dr + ds) 4 + c of a pixel reads x[n, c, 2i + dr, 2j + ds]) gets a thread per
    16-byte output row, computed in registers and stored as one vector (VectorizedElementwise stored it byte by byte,
    its 4-byte loop serial); element-wise functions whose reads walk the innermost axis stay with
    VectorizedElementwise, and the CUDA pipeline tries this rule first."""
    from tvm import relax

    from qcompile.schedules.glue import GatherRowElementwise, VectorizedElementwise

    def quant_s2d(x):
        v = relax.op.astype(relax.op.clip(relax.op.floor(relax.op.add(relax.op.divide(
            x, relax.const(0.0187, "float32")), relax.const(114.0, "float32"))), 0, 255), "uint8")
        v = relax.op.nn.pad(relax.op.permute_dims(v, [0, 2, 3, 1]), [0, 0, 0, 0, 0, 0, 0, 1], pad_value=0.0)
        v = relax.op.permute_dims(relax.op.reshape(v, (2, 4, 2, 4, 2, 4)), [0, 1, 3, 2, 4, 5])
        return relax.op.reshape(v, (2, 4, 4, 16))
    quant_s2d.shape, quant_s2d.dtype = [2, 3, 8, 8], "float32"

    def add1(x):  # channels-last element-wise: contiguous reads
        return relax.op.add(x, relax.const(1, "uint8"))
    add1.shape = [2, 8, 8, 16]

    tgt = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
    rule = GatherRowElementwise()
    assert rule.apply(_legalized(add1)[0], tgt, False) is None
    assert VectorizedElementwise().apply(_legalized(add1)[0], tgt, False) is not None
    (f,) = _legalized(quant_s2d)
    sch = rule.apply(f, tgt, False)
    assert sch is not None
    src = cuda_source(build_cuda(sch.mod["main"].with_attr("global_symbol", "glue"), "sm_90", mode="ptx"))
    body = src.split("glue_kernel(")[-1]
    assert body.count("= *(uint4*)(") == 1 and "for (" not in body and body.count("x_ptr[") == 12  # 3 of 4 channels
    import inspect

    from qcompile import pipeline

    assert "GatherRowElementwise(), VectorizedElementwise()" in inspect.getsource(pipeline.cuda_pipeline)


def _ptxas_stack_bytes(src: str) -> int:
    """ptxas's stack frame (bytes) of the one kernel in ``src`` (CUDA source), sm_90a."""
    import tempfile

    with tempfile.TemporaryDirectory() as td:
        cu = os.path.join(td, "k.cu")
        open(cu, "w").write(src)
        r = subprocess.run(["nvcc", "--cubin", "-O3", "-std=c++17", "-arch=sm_90a", "-Xptxas", "-v", "-o",
                            os.path.join(td, "k.cubin"), cu], capture_output=True, text=True, check=True)
    return int(re.search(r"(\d+) bytes stack frame", r.stderr).group(1))


@pytest.mark.nvcc
def test_cuda_erq_4bit_output_and_rolled_epilogue():
    """erq with 4-bit output (no residual): a lane's two adjacent columns packed into one staged byte (st.shared.b8),
    the read-back a plain copy; 8-bit output keeps the 2-byte staging, a residual the 8-bit intermediate. And an erq
    warpgroup tile of two row blocks with a group in flight (pipe 0) unrolls its epilogue's row-block loop: rolled,
    the accumulators went to the stack (304 bytes on this 128x64 tile) and the sums were wrong on the H100."""
    s4 = ConvSpec(N=32, H=14, W=14, C=256, K=128, R=1, S=1, x_dtype="uint4", w_bits=4, out_dtype="uint4", lo=0, hi=15)
    kn = WG.replace(BK=64, WM=1, BN=64, erq=True, stages=4, pstages=3, areg=True, w8=True, pipe=0)
    assert kn.valid()
    body = _src(s4, "sm_90", knobs=kn).split("main_kernel(")[-1]
    assert "st_shared_b8" in body and "st_shared_b16" not in body
    # (the H100 check that found it: ResNet-50's l1_1x1c at batch 32 with the residual epilogue, 128x64 tile)
    s8 = ConvSpec(N=32, H=56, W=56, C=256, K=64, R=1, S=1, x_dtype="int8", out_dtype="uint8", has_residual=True,
                  res_dtype="uint8", zo=-2, zo2=-1, lo2=0, hi2=255, res_i32=True)
    src8 = _src(s8, "sm_90", knobs=WG.replace(WM=1, pipe=0, erq=True))
    assert "st_shared_b16" in src8.split("main_kernel(")[-1] and "st_shared_b8" not in src8.split("main_kernel(")[-1]
    assert _ptxas_stack_bytes(src8) == 0
    r4 = s4.replace(out_dtype="uint4", lo=-8, hi=7, has_residual=True, res_dtype="uint4", lo2=0, hi2=15)
    assert "st_shared_b8" not in _src(r4, "sm_90", knobs=kn).split("main_kernel(")[-1]


# ---- the kernels' spaces, plans and calling convention (schedules/space.py, schedules/gemm/plan.py) -------------
def test_no_function_over_300_lines():
    """No function of the package (compiler/, schedules/, relay_passes/, models/) is longer than 300 lines."""
    import ast
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1]
    long = []
    for d in ("compiler", "schedules", "relay_passes", "models"):
        for f in sorted((root / d).rglob("*.py")):
            for n in ast.walk(ast.parse(f.read_text())):
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > 300:
                    long.append(f"{f.relative_to(root)}:{n.lineno} {n.name} ({n.end_lineno - n.lineno + 1} lines)")
    assert not long, long


def _record_specs():
    """(strategy, spec as compiled models run it, knobs) of every record of the shipped log (every GPU's)."""
    import pathlib
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).parent))
    from test_kernel_identity import _records, _spec_from_key

    return [(r.strategy, _spec_from_key(r.key), r.knobs) for r in _records()]


def test_space_legal_is_the_builders_check():
    """``legal`` is the plan's decision: every shipped record (of every strategy) is legal in its strategy's space,
    and drawable by its sampler (implicit_gemm: of a family the sampler draws from; the others: every knob a value of
    the space's dimensions); a point the plan refuses is refused by the builder with the same reason, without TIR."""
    from qcompile.schedules.space import SPACES, gemm_families, gemm_family

    recs = _record_specs()
    assert {st for st, _, _ in recs} == {"implicit_gemm", "implicit_gemm_t", "direct_halo"}
    for strategy, spec, kn in recs:
        assert SPACES[strategy].legal(spec, "sm_90", kn) is None, (strategy, spec, kn)
        if strategy == "implicit_gemm":
            assert gemm_family(kn, spec.x_bits) in gemm_families(spec, "sm_90")
        else:
            assert all(getattr(kn, f) in vals for f, vals in SPACES[strategy].dims.items()), (strategy, kn)
    sp = SPACES["implicit_gemm"]
    spec = ConvSpec(N=8, H=14, W=14, C=256, K=256, R=3, S=3, padding=1, x_dtype="uint8")
    bad = GemmKnobs(mma="wgmma", BM=128, BN=128, WM=2, WN=1, BK=256, stages=8, pipe=-1)  # 8 x 64 KiB of stages
    why = sp.legal(spec, "sm_90", bad)
    assert why and "KiB" in why
    with pytest.raises(NotApplicable, match="KiB"):
        make_gemm_conv(spec, "sm_90", bad, allow_split=True)
    assert sp.legal(spec, "sm_80", bad.replace(stages=3)) == "wgmma needs sm_90a, not sm_80"


def test_space_sampler_is_fast_and_covers_the_families():
    """Sampling by family gives >= 100 distinct legal points a second on a ResNet-50 layer (the flat space gives a
    few per 20,000 draws), every point legal, every family of the shape drawn; features and names agree."""
    import time

    from qcompile.schedules.space import SPACES, gemm_families, gemm_family

    sp = SPACES["implicit_gemm"]
    for x in ("uint8", "uint4"):
        spec = ConvSpec(N=64, H=14, W=14, C=256, K=256, R=3, S=3, padding=1, x_dtype=x, w_bits=8 if x == "uint8" else 4)
        rng = np.random.default_rng(1)
        t, pts = time.time(), set()
        for _ in range(400):
            pts.add(sp.sample(rng, spec, "sm_90"))
        rate = len(pts) / (time.time() - t)
        assert None not in pts and rate >= 100, rate
        assert all(sp.legal(spec, "sm_90", k) is None for k in pts)
        assert {gemm_family(k, spec.x_bits) for k in pts} == set(gemm_families(spec, "sm_90"))
        k = next(iter(pts))
        assert len(sp.features(spec, "sm_90", k)) == len(sp.feature_names())
    hw = ConvSpec(N=32, H=14, W=14, C=256, K=256, R=3, S=3, padding=1, layout="HWNC")
    k = SPACES["direct_hwnc"].sample(random.Random(0), hw, "sm_80")
    assert k is not None and k.mma == "sync" and SPACES["implicit_gemm"].legal(hw, "sm_80", k)


def test_space_effective_builds_the_same_kernel():
    """``effective`` knobs plan the same kernel as the knobs they come from (equal plans but for ``kn``), so a tuner
    may de-duplicate by them; ``PlannedKernel.knobs`` are them."""
    from qcompile.schedules import plan_conv
    from qcompile.schedules.gemm import make_plan
    from qcompile.schedules.space import SPACES

    sp = SPACES["implicit_gemm"]
    spec = ConvSpec(N=1, H=7, W=7, C=512, K=512, R=3, S=3, padding=1, x_dtype="uint8")
    rng = np.random.default_rng(2)
    for _ in range(60):
        k = sp.sample(rng, spec, "sm_90")
        e = sp.effective(spec, "sm_90", k)
        a, b = make_plan(spec, "sm_90", k, allow_split=True), make_plan(spec, "sm_90", e, allow_split=True)
        assert a.replace(kn=None) == b.replace(kn=None) and sp.effective(spec, "sm_90", e) == e
    k = GemmKnobs(mma="wgmma", BM=128, BN=128, WM=2, WN=1, BK=128, stages=3, pipe=-1)
    pk = plan_conv(spec, "sm_90", "implicit_gemm", k)
    assert pk.knobs == sp.effective(spec, "sm_90", k) and pk.knobs.BM == 64 and pk.knobs.split_k == pk.split_k > 1


def test_space_sms_override():
    """The device's SM count (``sms``) sizes the automatic split-K and the default tiles where the table's would
    not: a grid that fills 16 SMs takes no split there."""
    from qcompile.schedules import plan_conv
    from qcompile.schedules.space import SPACES

    spec = ConvSpec(N=1, H=7, W=7, C=512, K=512, R=3, S=3, padding=1, x_dtype="uint8")
    k = GemmKnobs(mma="wgmma", BM=64, BN=64, WM=1, WN=1, BK=128, stages=3, pipe=-1)
    assert plan_conv(spec, "sm_90", "implicit_gemm", k).split_k > 1
    assert plan_conv(spec, "sm_90", "implicit_gemm", k, sms=16).split_k == 1
    assert SPACES["implicit_gemm"].effective(spec, "sm_90", k, sms=16).split_k == 1
    big = ConvSpec(N=32, H=14, W=14, C=256, K=256, R=3, S=3, padding=1, x_dtype="uint8")
    assert SPACES["implicit_gemm"].default(big, "sm_90").BM == 64 and SPACES["implicit_gemm"].default(
        big, "sm_90", sms=16).BM == 128


def test_sms_reaches_every_entry_point():
    """``sms`` (the device's SM count) is passed alike by conv2d_int_kernel, conv2d_int_plan and plan_conv: the
    automatic K-split of a small grid (8 tiles of ResNet-50's l4 3x3 conv at batch 1) is 16 for the table's 132 SMs
    and 8 for a 40-SM part; the default tiles of an untuned shape are sized for it too (25 tiles of 128 x 128: 64 x
    64 tiles for 132 SMs, 128 x 128 for 16)."""
    from qcompile.schedules import conv2d_int_plan, plan_conv
    from qcompile.schedules.space import SPACES

    spec = ConvSpec(N=1, H=7, W=7, C=512, K=512, R=3, S=3, padding=1, x_dtype="uint8")
    k = GemmKnobs(BM=64, BN=64, WM=2, WN=2, stages=4)
    for sms, split in ((None, 16), (132, 16), (40, 8)):
        assert conv2d_int_kernel(spec, "sm_90", "implicit_gemm", k, allow_split=True, sms=sms).attrs[
            "qcompile.split_k"] == split
        funcs = conv2d_int_plan(spec, "sm_90", "implicit_gemm", k, sms=sms)
        assert len(funcs) == 2 and funcs[1].attrs["qcompile.split_k"] == split
        assert plan_conv(spec, "sm_90", "implicit_gemm", k, sms=sms).split_k == split
        assert SPACES["implicit_gemm"].effective(spec, "sm_90", k, sms=sms).split_k == split
    odd = ConvSpec(N=4, H=28, W=28, C=128, K=128, R=3, S=3, padding=1, x_dtype="uint8")  # (no record)
    for sms, bm in ((None, 64), (16, 128)):
        pk = plan_conv(odd, "sm_90", "implicit_gemm", sms=sms)
        assert pk.source == "default" and pk.knobs.BM == bm and SPACES["implicit_gemm"].default(odd, "sm_90",
                                                                                                  sms=sms).BM == bm


def test_records_of_every_strategy_reach_compiled_models(tmp_path):
    """implicit_gemm_t and direct_halo records are looked up like the implicit GEMM's (``knobs_for`` with the
    strategy): the kernel is built with the record's knobs, the source says where they came from -- a --tuning-log's
    records and the shipped log's; packed 4-bit weights change GemmKnobs only."""
    import json

    from qcompile.schedules import plan_conv, tuning_key
    from qcompile.schedules.igemm_t import KtKnobs
    from qcompile.schedules.igemm_t import resolve_knobs as kt_resolve
    from qcompile.schedules.spec import space_to_depth
    from qcompile.schedules.stem import HaloKnobs
    from qcompile.schedules.space import SPACES
    from qcompile.schedules.tuning import clear_cache, format_record, log_path, make_record

    dev = "NVIDIA H100 80GB HBM3"
    u8 = dict(x_dtype="uint8", out_dtype="uint8", lo=0, hi=255)
    kt = ConvSpec(N=64, H=7, W=7, C=512, K=512, R=3, S=3, padding=1, **u8)
    stem = space_to_depth(ConvSpec(N=8, H=224, W=224, C=4, K=64, R=7, S=7, stride=2, padding=3, **u8))
    ktk, halok = KtKnobs(bn=128, stages=5, gif=1), HaloKnobs(th=2, minb=2, pipe=0)
    log = tmp_path / "sm_90.jsonl"
    log.write_text("".join(format_record(make_record("sm_90", dev, 132, tuning_key(sp), st, kn, ms=0.05)) + "\n"
                           for sp, st, kn in ((kt, "implicit_gemm_t", ktk), (stem, "direct_halo", halok))))
    clear_cache()
    assert select_strategy(kt, "sm_90") == "implicit_gemm_t" and select_strategy(stem, "sm_90") == "direct_halo"
    for device, source in ((None, "arch"), (dev, "device")):
        pk = plan_conv(kt, "sm_90", tuning_logs=[log], device=device)
        assert (pk.strategy, pk.source, pk.knobs) == ("implicit_gemm_t", source, kt_resolve(kt, "sm_90", ktk))
        pk = plan_conv(stem, "sm_90", "direct_halo", packed_weights=True, tuning_logs=[log], device=device)
        assert (pk.source, pk.knobs) == (source, halok)
    f = conv2d_int_kernel(kt, "sm_90", "implicit_gemm_t", tuning_logs=[str(log)])
    assert f.attrs["qcompile.knobs_source"] == "arch"
    assert plan_conv(kt.replace(N=32), "sm_90", "implicit_gemm_t", tuning_logs=[log]).source == "nearest"
    # the shipped log's own implicit_gemm_t and direct_halo records (each GPU's; batch 64 / 8) reach plan_conv; a
    # layer it has no implicit_gemm_t record of at any batch size (the 4-bit form of kt) gets the defaults
    shipped = {(r["strategy"], r["device"], r["key"]): r["knobs"]
               for r in map(json.loads, log_path("sm_90").read_text().splitlines())}
    for device, source in ((None, "arch"), (dev, "device"), ("NVIDIA H200", "device")):
        want = shipped[("implicit_gemm_t", device or dev, tuning_key(kt))]
        pk = plan_conv(kt, "sm_90", device=device)
        assert (pk.strategy, pk.source, pk.knobs) == ("implicit_gemm_t", source,
                                                     kt_resolve(kt, "sm_90", KtKnobs(**want)))
        want = shipped[("direct_halo", device or dev, tuning_key(stem))]
        pk = plan_conv(stem, "sm_90", "direct_halo", packed_weights=True, device=device)
        assert (pk.source, pk.knobs) == (source, SPACES["direct_halo"].effective(stem, "sm_90", HaloKnobs(**want)))
    u4 = dict(x_dtype="uint4", w_bits=4, out_dtype="uint4", lo=0, hi=15)
    assert plan_conv(kt.replace(**u4), "sm_90", "implicit_gemm_t").source == "default"


def test_kt_and_halo_spaces():
    """implicit_gemm_t (KtKnobs) and direct_halo (HaloKnobs) have spaces whose legality is the builders' own
    (``kt_legal`` / ``halo_legal``), sampled uniformly; effective knobs are the resolved ones."""
    from qcompile.schedules import plan_conv
    from qcompile.schedules.igemm_t import KtKnobs, make_kt_conv
    from qcompile.schedules.space import SPACES
    from qcompile.schedules.spec import space_to_depth
    from qcompile.schedules.stem import HaloKnobs

    kt, halo = SPACES["implicit_gemm_t"], SPACES["direct_halo"]
    spec = ConvSpec(N=64, H=7, W=7, C=512, K=512, R=3, S=3, padding=1, x_dtype="uint8")
    rng = random.Random(3)
    pts = {kt.sample(rng, spec, "sm_90") for _ in range(30)}
    assert None not in pts and len(pts) > 5
    assert kt.legal(spec, "sm_90", KtKnobs(bn=224, stages=8)) and "KiB" in kt.legal(spec, "sm_90", KtKnobs(bn=224,
                                                                                                          stages=8))
    with pytest.raises(ValueError, match="KiB"):
        make_kt_conv(spec, "sm_90", KtKnobs(bn=224, stages=8))
    pk = plan_conv(spec, "sm_90", "implicit_gemm_t", KtKnobs())
    assert pk.knobs == kt.effective(spec, "sm_90", KtKnobs()) and pk.knobs.bn > 0 and not pk.w_expand
    stem = space_to_depth(ConvSpec(N=8, H=224, W=224, C=4, K=64, R=7, S=7, stride=2, padding=3, x_dtype="uint8"))
    pts = {halo.sample(rng, stem, "sm_90") for _ in range(30)}
    assert None not in pts and len(pts) > 5
    assert "KiB" in halo.legal(stem, "sm_90", HaloKnobs(th=64, pipe=1))
    assert len(halo.features(stem, "sm_90", HaloKnobs())) == len(halo.feature_names())
    assert plan_conv(stem, "sm_90", "direct_halo").knobs == halo.effective(stem, "sm_90", HaloKnobs())


def test_planned_kernel_fields_from_the_plan():
    """plan_conv's calling-convention fields come from the kernels' plans: split-K pairs, stream-K (counters,
    workspace words), expanded / k-permuted weights."""
    from qcompile.schedules import plan_conv

    wg = GemmKnobs(mma="wgmma", BM=128, BN=128, WM=2, WN=1, BK=128, stages=3, pipe=-1)
    spec = ConvSpec(N=8, H=7, W=7, C=512, K=512, R=3, S=3, padding=1, x_dtype="uint8")
    pk = plan_conv(spec, "sm_90", "implicit_gemm", wg.replace(sk=1))
    assert pk.streamk[0] == 4 * 4 and pk.split_k == 1 and pk.label == "implicit_gemm+streamk"  # (4 x 4 tiles)
    s4 = spec.replace(x_dtype="uint4", w_bits=4)
    a4 = GemmKnobs(mma="wgmma", BM=64, BN=64, WM=1, WN=1, BK=64, stages=4, pipe=-1, pstages=3, areg=True, awarp=True,
                   w8=True)
    pk4 = plan_conv(s4, "sm_90", "implicit_gemm", a4)
    assert pk4.w_expand and pk4.w_kperm == 0 and pk4.split_k > 1 and len(pk4.funcs) == 2
    assert plan_conv(s4, "sm_90", "implicit_gemm", a4.replace(agl=True)).w_kperm == 64
    assert plan_conv(spec, "sm_90", "implicit_gemm_t").w_expand is False


def test_guarded_dlight_rule_yields_where_it_asserts():
    """DenseNet-121 at batch 1 ends in a per-channel affine + global average pool whose spatial axes are all of extent
    1: dlight's GEMV rule asserts on it. The CUDA pipeline wraps that rule in ``glue.Guarded``, which yields the
    function to the next rule (the reduction rules schedule it)."""
    from tvm import te
    from tvm.s_tir import dlight as dl

    from qcompile.schedules.glue import Guarded

    C = 16
    x = te.placeholder((1, 7, 7, C), "uint8", name="x")
    m = te.placeholder((C,), "int64", name="m")
    y = te.compute((1, 7, 7, C), lambda n, h, w, c: (x[n, h, w, c].astype("int64") - 136) * m[c], name="y")
    r1, r2 = te.reduce_axis((0, 7), "r1"), te.reduce_axis((0, 7), "r2")
    s = te.compute((1, 1, 1, C), lambda n, a, b, c: te.sum(y[n, r1, r2, c].astype("int32"), axis=[r1, r2]), name="s")
    mod = tvm.IRModule({"main": te.create_prim_func([x, m, s])})
    with tvm.target.Target({"kind": "cuda", "arch": "sm_90"}):
        with pytest.raises(AssertionError):
            dl.ApplyDefaultSchedule(dl.gpu.GEMV(), dl.gpu.Reduction())(mod)
        out = dl.ApplyDefaultSchedule(Guarded(dl.gpu.GEMV()), dl.gpu.Reduction(), dl.gpu.GeneralReduction())(mod)
    assert out["main"].attrs["tirx.is_scheduled"]


@pytest.mark.nvcc
def test_gemm_grid_m_over_the_y_limit():
    """More M tiles than gridDim.y allows (65535; VGG-16's 224x224 convs at batch 256: 100352 tiles of 128 rows): the
    M tiles go on blockIdx.x and the N tiles on blockIdx.y; below the limit the usual x = N, y = M."""
    from qcompile.schedules.gemm.plan import GRID_YZ_MAX, make_plan

    big = ConvSpec(N=256, H=224, W=224, C=64, K=64, R=3, S=3, padding=1, layout="NHWC")
    p = make_plan(big, "sm_90")
    assert p.GRID_M > GRID_YZ_MAX and p.M_ON_X and not p.STREAM
    small = ConvSpec(N=8, H=224, W=224, C=64, K=64, R=3, S=3, padding=1, layout="NHWC")
    ps = make_plan(small, "sm_90")
    assert ps.GRID_M <= GRID_YZ_MAX and not ps.M_ON_X
    text = conv2d_int_kernel(big, "sm_90").script()
    extents = dict(re.findall(r'launch_thread\("(blockIdx\.[xyz])", (\d+)\)', text))
    assert extents == {"blockIdx.x": str(p.GRID_M), "blockIdx.y": str(p.GRID_N), "blockIdx.z": "1"}, extents
    _src(big, "sm_90")  # (it builds)
