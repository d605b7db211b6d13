"""The CPU (x86) conv kernels and their dispatch: bit for bit against the NumPy integer references, per inner kernel.

Inner kernels: ``cpu_direct_avx2`` (``schedules.cpu_conv``, ``vpmaddwd``), ``cpu_direct_vnni`` (zmm ``vpdpbusd``) and
``cpu_direct_avxvnni`` (ymm ``vpdpbusd``, ``schedules.cpu_conv_vnni``). Each is run where the host's CPU runs its
instructions (``/proc/cpuinfo``; the others skip) and assembled on any x86-64 host (the instruction checked in the
assembly).
Kernel level: each kernel built for its target and compared with ``schedules.reference.conv_reference`` on fresh
random inputs (ResNet-50 shapes and odd ones: channel counts not a multiple of 4, output channels not a multiple of
16, stride 2, dilation, padding with a nonzero pad value, the 7x7 stem, residual adds, int8 and uint8 inputs, 4-bit
values, NCHW and NHWC).
Graph level: ``DispatchCPU`` on small QDQ models, built and compared with ``qcompile.reference.Reference``.
"""
import os

import numpy as np
import pytest
import tvm
from tvm import relax

from qcompile.errors import run_pass
from qcompile.pipeline import PipelineRecord, build, lower_to_integer, qcompile_pipeline
from qcompile.reference import Reference
from qcompile.relay_passes.dispatch_cpu import KERNELS, DispatchCPU, cpu_kernels_target, dispatch_kernel
from qcompile.schedules import cpu_conv as CC
from qcompile.schedules import cpu_conv_vnni as CV
from qcompile.schedules import reference as RF
from qcompile.schedules.spec import ConvSpec

from qdq_models import tiny_resnet_qdq

# the host's real features (/proc/cpuinfo): the kernels' tests run only where the built code can run
needs_avx2 = pytest.mark.skipif(not CC.host_has_avx2(), reason="the CPU kernels need an x86-64 host with AVX2")
TARGET = CC.cpu_target(tvm.target.Target({"kind": "llvm"}))  # the host's best kernel target on such a host
HOST_KERNEL = CC.target_kernel(TARGET)
_LLVM = lambda **kw: tvm.target.Target({"kind": "llvm", **kw})
# each inner kernel: its build target, and whether this host runs it
KERNEL_TARGET = {"cpu_direct_avx2": _LLVM(mcpu="x86-64-v3"),
                 "cpu_direct_vnni": _LLVM(mcpu="x86-64-v4", mattr=["+avx512vnni"]),
                 "cpu_direct_avxvnni": _LLVM(mcpu="x86-64-v3", mattr=["+avxvnni"]),
                 "cpu_direct_sdot": _LLVM(mtriple="aarch64-linux-gnu", mattr=["+neon", "+dotprod"])}
X86_HOST = tvm.target.codegen.llvm_get_system_triple().startswith("x86_64")
HOST_RUNS = {"cpu_direct_avx2": CC.host_has_avx2(), "cpu_direct_vnni": CC.host_vnni() == "avx512",
             "cpu_direct_avxvnni": CC.host_vnni() is not None and "avx_vnni" in CC.host_flags(),
             "cpu_direct_sdot": False}  # (an aarch64 build is only cross-compiled and its assembly checked here)


def _kernel_params():
    """pytest params, one per inner kernel, skipped where this host does not run its instructions."""
    return [pytest.param(k, marks=pytest.mark.skipif(not HOST_RUNS[k], reason=f"this host does not run {k}"))
            for k in KERNELS]

U8 = dict(x_dtype="uint8", out_dtype="uint8", lo=0, hi=255)
SPECS = {
    # ResNet-50 layers (batch 1): 3x3 at 56, 14 and 7, 1x1 reduce / expand, 1x1 stride 2 (downsample), the stem on
    # a 112x112 image, the dense layer as a 1x1 conv
    "r50_3x3_56": ConvSpec(N=1, H=56, W=56, C=64, K=64, R=3, S=3, padding=1, **U8),
    "r50_3x3": ConvSpec(N=1, H=14, W=14, C=256, K=256, R=3, S=3, padding=1, **U8),
    "r50_3x3_7": ConvSpec(N=1, H=7, W=7, C=512, K=512, R=3, S=3, padding=1, **U8),
    "r50_3x3_s2": ConvSpec(N=1, H=28, W=28, C=128, K=128, R=3, S=3, stride=2, padding=1, **U8),
    "r50_reduce": ConvSpec(N=1, H=14, W=14, C=1024, K=256, R=1, S=1, **U8),
    "r50_1x1": ConvSpec(N=1, H=7, W=7, C=512, K=2048, R=1, S=1, x_dtype="uint8", out_dtype="int8"),
    "r50_stem": ConvSpec(N=1, H=112, W=112, C=3, K=64, R=7, S=7, stride=2, padding=3, x_dtype="int8",
                         out_dtype="uint8", lo=0, hi=255),
    "down_s2": ConvSpec(N=1, H=14, W=14, C=64, K=128, R=1, S=1, stride=2, **U8),
    "dense": ConvSpec(N=2, H=1, W=1, C=96, K=10, R=1, S=1, x_dtype="uint8", out_dtype="int8"),
    "dense_1000": ConvSpec(N=1, H=1, W=1, C=2048, K=1000, R=1, S=1, x_dtype="uint8", out_dtype="int8"),
    # the 7x7/2 stem on 3 channels, int8 input, odd image
    "stem": ConvSpec(N=1, H=29, W=31, C=3, K=16, R=7, S=7, stride=2, padding=3, x_dtype="int8", out_dtype="uint8",
                     lo=0, hi=255, zo=3),
    # odd everything: C, K, H, W, asymmetric padding with a pad value, stride 2, residual with zero points
    "odd_res": ConvSpec(N=2, H=9, W=11, C=5, K=10, R=3, S=3, padding=(1, 0, 2, 1), stride=2, x_dtype="int8",
                        out_dtype="uint8", has_residual=True, res_dtype="uint8", zo=-2, lo2=0, hi2=255, zo2=3,
                        pad_value=5),
    # a ResNet block's last conv (1x1) with its residual add, per-tensor stage-2 constants compiled in, int32 stage 2
    "res_1x1": ConvSpec(N=1, H=8, W=8, C=24, K=40, R=1, S=1, x_dtype="uint8", out_dtype="uint8", lo2=0, hi2=255,
                        has_residual=True, res_dtype="uint8", res_i32=True, rq2_uniform=(1, 3000, -2, 2500, 14)),
    # 4-bit weights and activations (values one per byte), 4-bit output range; S >= 33 (the high-word epilogue)
    "w4a4": ConvSpec(N=1, H=10, W=10, C=16, K=24, R=3, S=3, padding=1, x_dtype="uint8", w_bits=4, out_dtype="uint8",
                     lo=0, hi=15, shift_ge33=True),
    "w4_dilated": ConvSpec(N=1, H=12, W=12, C=7, K=9, R=3, S=3, padding=2, dilation=2, x_dtype="int8", w_bits=4,
                           out_dtype="int8", lo=-8, hi=7),
    "int32_out": ConvSpec(N=1, H=5, W=5, C=8, K=8, R=3, S=3, x_dtype="int8", out_dtype="int32",
                          lo=-(1 << 31), hi=(1 << 31) - 1),
    # int8 input, 4-bit values (one per byte, signed) with a negative pad value, C = 6, K = 33, 1x2 kernel
    "a4_signed": ConvSpec(N=1, H=6, W=9, C=6, K=33, R=1, S=2, padding=(0, 1, 0, 0), x_dtype="int8", w_bits=4,
                          out_dtype="int8", lo=-8, hi=7, pad_value=-3),
    # int8 input read in place by the VNNI kernels in NHWC (1x1, no padding, C a multiple of 4), stride 2
    "int8_1x1_s2": ConvSpec(N=2, H=9, W=10, C=12, K=24, R=1, S=1, stride=2, x_dtype="int8", out_dtype="int8"),
    # int8 input with a residual and per-channel stage-2 constants, K = 20 (a partial 16-channel block), C = 4
    "int8_res": ConvSpec(N=1, H=7, W=5, C=4, K=20, R=3, S=3, padding=1, x_dtype="int8", out_dtype="int8",
                         has_residual=True, res_dtype="int8", pad_value=-128),
}


def _random(spec: ConvSpec, seed: int):
    x, w, bias, M, S, res = RF.random_problem(spec, np.random.default_rng(seed))
    if spec.w_bits == 4:
        assert w.min() >= -8 and w.max() <= 7
    return x, w, bias, M, S, res


def _make(kernel: str, spec: ConvSpec, io: str, w, bias):
    """(PrimFunc, packed weights, bias as the kernel takes it) of one inner kernel."""
    if kernel == "cpu_direct_avx2":
        return CC.make_cpu_conv(spec, io), CC.pack_weights(w), bias
    tile = CV.choose_tile(spec, kernel)
    w8, b = CV.prepack(spec, w, bias, kernel)
    return CV.make_cpu_conv_vnni(spec, io, tile), w8, b


def _run_kernel(kernel: str, spec: ConvSpec, io: str, x, w, bias, M, S, res):
    f, wp, bias = _make(kernel, spec, io, w, bias)
    assert str(f.attrs["qcompile.strategy"]) == kernel
    return run_built(f, KERNEL_TARGET[kernel], spec, io, x, wp, bias, M, S, res)


def run_built(f, target, spec: ConvSpec, io: str, x, wp, bias, M, S, res):
    """Build kernel ``f`` for ``target``, run it on the logical NHWC operands (laid out as ``io``; ``wp``, ``bias``
    already in the kernel's format) into a poisoned output; the output as NHWC int64."""
    lib = tvm.compile(tvm.IRModule({"k": f.with_attr("global_symbol", "k")}), target=target)
    lay = (lambda a: np.ascontiguousarray(np.transpose(a, (0, 3, 1, 2)))) if io == "NCHW" else (lambda a: a)
    args = [lay(x).astype(ConvSpec.storage(spec.x_dtype)), wp, bias, M, S]
    if res is not None:
        args += [lay(res[0]).astype(ConvSpec.storage(spec.res_dtype)), np.ascontiguousarray(res[1], np.int32)]
    oshape = lay(np.zeros((spec.N, spec.P, spec.Q, spec.K), np.int8)).shape
    poison = np.iinfo(ConvSpec.storage(spec.out_dtype)).max
    out = tvm.runtime.tensor(np.full(oshape, poison, ConvSpec.storage(spec.out_dtype)))
    lib["k"](*[tvm.runtime.tensor(np.ascontiguousarray(a)) for a in args], out)
    y = out.numpy().astype(np.int64)
    return np.ascontiguousarray(np.transpose(y, (0, 2, 3, 1))) if io == "NCHW" else y


@pytest.mark.parametrize("kernel", _kernel_params())
@pytest.mark.parametrize("io", ["NCHW", "NHWC"])
@pytest.mark.parametrize("name", list(SPECS))
def test_kernel_exact(name, io, kernel):
    spec = SPECS[name]
    x, w, bias, M, S, res = _random(spec, seed=len(name))
    ref = RF.conv_reference(spec, x, w, bias, M, S, res)
    y = _run_kernel(kernel, spec, io, x, w, bias, M, S, res)
    assert y.shape == ref.shape
    assert ref.std() > 0 and len(np.unique(ref)) > 2  # the outputs move (not all clipped)
    assert np.array_equal(y, ref)


def test_pack_weights_layout():
    w = np.random.default_rng(0).integers(-128, 128, (11, 2, 3, 5))
    p = CC.pack_weights(w)
    assert p.shape == (2, 2, 3, 3, 16) and p.dtype == np.int16
    for k, r, s, c in [(0, 0, 0, 0), (10, 1, 2, 4), (9, 0, 1, 3), (8, 1, 0, 1)]:
        assert p[k // 8, r, s, c // 2, 2 * (k % 8) + c % 2] == w[k, r, s, c]
    assert not p[1, :, :, :, 6:].any() and not p[:, :, :, 2, 1::2].any()  # K and C padding are zeros


@pytest.mark.parametrize("isa", list(CV.ISAS))
def test_vnni_prepack(isa):
    """int8 weights in 4-channel groups, ``lanes`` output channels per vector, zeros past K and C; the bias carries the
    input flip (int32, wrapping): -128 sum(w) for a signed input on vpdpbusd (u8 x s8), +128 sum(w) for an unsigned
    input on sdot (s8 x s8), unchanged otherwise."""
    rng = np.random.default_rng(1)
    lanes = CV.ISAS[isa].lanes
    w = rng.integers(-128, 128, (19, 2, 3, 5))
    bias = rng.integers(-(1 << 31), 1 << 31, 19).astype(np.int32)
    sumw = w.reshape(19, -1).sum(axis=1)
    for x_dtype in ("int8", "uint8"):
        spec = ConvSpec(N=1, H=4, W=4, C=5, K=19, R=2, S=3, x_dtype=x_dtype)
        p, b = CV.prepack(spec, w, bias, isa)
        kb = -(-19 // lanes)
        assert p.shape == (kb, 2, 3, 2, 4 * lanes) and p.dtype == np.int8
        for k, r, s_, c in [(0, 0, 0, 0), (18, 1, 2, 4), (9, 0, 1, 3), (16, 1, 0, 1)]:
            assert p[k // lanes, r, s_, c // 4, 4 * (k % lanes) + c % 4] == w[k, r, s_, c]
        assert not p[:, :, :, 1, 1::4].any() and not p[-1, ..., 4 * (19 - (kb - 1) * lanes):].any()
        shift = {(True, "int8"): -128, (False, "uint8"): 128}.get((CV.ISAS[isa].unsigned_x, x_dtype), 0)
        assert CV.flips_input(spec, isa) == (shift != 0)
        want = (bias.astype(np.int64) + shift * sumw).astype(np.uint32).view(np.int32)
        assert b.dtype == np.int32 and np.array_equal(b, want)


def test_vnni_tile_choice():
    """ResNet's rows: 14 pixels x 2 channel vectors (7 x 2 for rows of 7), no tile or channel block computed twice;
    every tile within the register bound (accumulators, kt weight vectors, a broadcast)."""
    Z = CV.VnniTile
    for q, k in [(112, 64), (56, 256), (28, 512), (14, 1024)]:
        assert CV.choose_tile(ConvSpec(N=1, H=q, W=q, C=64, K=k, R=1, S=1)) == Z("cpu_direct_vnni", 14, 2)
    assert CV.choose_tile(ConvSpec(N=1, H=7, W=7, C=64, K=2048, R=1, S=1)) == Z("cpu_direct_vnni", 7, 2)
    assert CV.choose_tile(ConvSpec(N=1, H=1, W=1, C=64, K=1000, R=1, S=1)) == Z("cpu_direct_vnni", 1, 8)
    for isa, regs in (("cpu_direct_vnni", 32), ("cpu_direct_avxvnni", 16), ("cpu_direct_sdot", 32)):
        for spec in SPECS.values():
            t = CV.choose_tile(spec, isa)
            assert t.isa == isa and t.qt <= spec.Q and t.qt * t.kt + t.kt + 1 <= regs
    with pytest.raises(ValueError, match="registers"):
        Z("cpu_direct_vnni", 7, 4)
    with pytest.raises(ValueError, match="unknown instruction set"):
        Z("cpu_direct_amx")


def test_kernel_refuses_packed_operands():
    with pytest.raises(ValueError, match="uint4"):
        CC.make_cpu_conv(ConvSpec(N=1, H=4, W=4, C=8, K=8, R=1, S=1, x_dtype="uint4"))
    with pytest.raises(ValueError, match="uint4"):
        CV.make_cpu_conv_vnni(ConvSpec(N=1, H=4, W=4, C=8, K=8, R=1, S=1, x_dtype="uint4"))


# ------------------------------------------------------------------------------------------------
# cpu_direct_vnni_s4: 4-bit weights two per byte, unpacked in registers
# ------------------------------------------------------------------------------------------------
needs_vnni512 = pytest.mark.skipif(not HOST_RUNS["cpu_direct_vnni"], reason="this host does not run AVX-512 VNNI")


def _s4_specs():
    """Every kernel shape with 4-bit weights (the NumPy problem draws them in -8..7)."""
    import dataclasses

    return {n: dataclasses.replace(s, w_bits=4) for n, s in SPECS.items()}


@needs_vnni512
@pytest.mark.parametrize("io", ["NCHW", "NHWC"])
@pytest.mark.parametrize("name", list(SPECS))
def test_s4_kernel_exact(name, io):
    """The packed 4-bit weight variant bit for bit against ``conv_reference`` on every shape (odd C: a zero group
    completes the last byte; int8 inputs: the flip; residuals; int32 output), in NCHW and NHWC."""
    from qcompile.schedules import cpu_conv_vnni_s4 as S4

    spec = _s4_specs()[name]
    x, w, bias, M, S, res = _random(spec, seed=len(name) + 7)
    ref = RF.conv_reference(spec, x, w, bias, M, S, res)
    f = S4.make_cpu_conv_vnni_s4(spec, io)
    assert str(f.attrs["qcompile.strategy"]) == "cpu_direct_vnni_s4"
    w4, b = S4.prepack_s4(spec, w, bias)
    lib = tvm.compile(tvm.IRModule({"k": f.with_attr("global_symbol", "k")}), target=KERNEL_TARGET["cpu_direct_vnni"])
    lay = (lambda a: np.ascontiguousarray(np.transpose(a, (0, 3, 1, 2)))) if io == "NCHW" else (lambda a: a)
    args = [lay(x).astype(ConvSpec.storage(spec.x_dtype)), w4, b, M, S]
    if res is not None:
        args += [lay(res[0]).astype(ConvSpec.storage(spec.res_dtype)), np.ascontiguousarray(res[1], np.int32)]
    oshape = lay(np.zeros((spec.N, spec.P, spec.Q, spec.K), np.int8)).shape
    out = tvm.runtime.tensor(np.full(oshape, np.iinfo(ConvSpec.storage(spec.out_dtype)).max,
                                     ConvSpec.storage(spec.out_dtype)))
    lib["k"](*[tvm.runtime.tensor(np.ascontiguousarray(a)) for a in args], out)
    y = out.numpy().astype(np.int64)
    y = np.ascontiguousarray(np.transpose(y, (0, 2, 3, 1))) if io == "NCHW" else y
    assert ref.std() > 0 and np.array_equal(y, ref)


def test_s4_prepack_and_tile():
    """Two 4-channel groups a byte, the even group in the high nibble, zeros past C (an odd group count gets a zero
    group); the bias as cpu_conv_vnni.prepack folds it; half the bytes of the int8 form; 8-bit values refused; tiles
    within 32 zmm registers with two per weight vector and the mask."""
    from qcompile.schedules import cpu_conv_vnni_s4 as S4

    rng = np.random.default_rng(2)
    for C in (5, 12, 16):
        spec = ConvSpec(N=1, H=4, W=4, C=C, K=19, R=2, S=3, x_dtype="int8", w_bits=4)
        w = rng.integers(-8, 8, (19, 2, 3, C))
        bias = rng.integers(-1000, 1000, 19).astype(np.int32)
        w8, b8 = CV.prepack(spec, w, bias, "cpu_direct_vnni")
        w4, b4 = S4.prepack_s4(spec, w, bias)
        c8 = -(-C // 8)
        assert w4.shape == (2, 2, 3, c8, 64) and w4.dtype == np.int8 and np.array_equal(b4, b8)
        u = w4.view(np.uint8).astype(np.int64)
        hi, lo = (u >> 4) - 16 * (u >> 7), (u & 15) - 16 * ((u >> 3) & 1)  # the nibbles, sign-extended
        for k, r, s_, c in [(0, 0, 0, 0), (18, 1, 2, C - 1), (9, 0, 1, C // 2), (16, 1, 0, 1)]:
            nib = hi if (c // 4) % 2 == 0 else lo
            assert nib[k // 16, r, s_, c // 8, 4 * (k % 16) + c % 4] == w[k, r, s_, c]
        for c in range(C, 8 * c8):  # (zeros past C)
            assert not (hi if (c // 4) % 2 == 0 else lo)[:, :, :, c // 8, c % 4::4].any()
        assert w4.nbytes * 2 == w8.nbytes + (w8.nbytes // w8.shape[3] if w8.shape[3] % 2 else 0)
    with pytest.raises(ValueError, match="not 4-bit"):
        S4.prepack_s4(ConvSpec(N=1, H=4, W=4, C=4, K=4, R=1, S=1, w_bits=4), np.full((4, 1, 1, 4), 9), np.zeros(4))
    with pytest.raises(ValueError, match="8-bit weights"):
        S4.make_cpu_conv_vnni_s4(ConvSpec(N=1, H=4, W=4, C=4, K=4, R=1, S=1))
    for spec in _s4_specs().values():
        t = S4.choose_tile_s4(spec)
        assert t.qt <= spec.Q and t.qt * t.kt + 2 * t.kt + 2 <= 32
    assert S4.fits(np.array([2**27 - 1])) and not S4.fits(np.array([2**27]))


def test_s4_assembly():
    """The variant's build holds zmm ``vpdpbusd`` and the nibble unpack (a 4-bit left shift of the weight vector); it
    reads half the weight bytes (any x86-64 host: compiled, not run)."""
    import re

    from qcompile.schedules import cpu_conv_vnni_s4 as S4

    spec = _s4_specs()["r50_3x3"]
    f = S4.make_cpu_conv_vnni_s4(spec, "NHWC").with_attr("global_symbol", "k")
    tgt = tvm.target.Target({"kind": "llvm", "mcpu": "x86-64-v4", "mattr": ["+avx512vnni"],
                             "mtriple": "x86_64-linux-gnu"})
    asm = tvm.compile(tvm.IRModule({"k": f}), target=tgt).mod.inspect_source("asm")
    assert re.search(ASM["cpu_direct_vnni"], asm, re.M) and re.search(r"^\s*vpslld\s+\$4,.*%zmm", asm, re.M)


@needs_vnni512
def test_s4_dispatch_rule(monkeypatch):
    """In a VNNI module the 4-bit layers with few output pixels (``cpu_conv_vnni_s4.worth``) run the variant, the
    others (and 8-bit layers) cpu_direct_vnni; QCOMPILE_CPU_S4=0 keeps them all on cpu_direct_vnni; exact both ways."""
    from qcompile.schedules import cpu_conv_vnni_s4 as S4

    mod, shape = tiny_resnet_qdq(seed=15, w_bits=4, a_bits=4, shape=(1, 3, 40, 40), c=8)
    x = np.random.default_rng(16).standard_normal(shape).astype("float32")
    mi = lower_to_integer(mod, "NHWC", pack_int4=False)
    monkeypatch.setattr(S4, "REUSE_MAX", 1000)  # (the stem's 40x40 output above it, the rest below)
    specs = {}
    for env, want in (("0", False), ("1", True)):
        monkeypatch.setenv("QCOMPILE_CPU_S4", env)
        p = DispatchCPU("cpu_direct_vnni")
        md = run_pass(p, mi)
        specs = specs or {n: c.spec for n, c in p.planned}  # (every layer's, from the run without the variant)
        for n, k in p.chosen:
            s4 = want and n in specs and specs[n].w_bits == 4 and S4.worth(specs[n])
            assert k == ("cpu_direct_vnni_s4" if s4 else "cpu_direct_vnni"), (n, env)
        assert any(k == "cpu_direct_vnni_s4" for _, k in p.chosen) == want
        assert "cpu_direct_vnni" in dict(p.chosen).values() and len(specs) == len(p.chosen)
        y = relax.VirtualMachine(build(md, KERNEL_TARGET["cpu_direct_vnni"]), tvm.cpu())["main"](
            tvm.runtime.tensor(x)).numpy()
        assert np.array_equal(y, Reference(mi)(x)) and y.std() > 0


def test_s4_keeps_tuned_tiles(monkeypatch, tmp_path):
    """A 4-bit layer that a tuning record of cpu_direct_vnni gives a tile keeps cpu_direct_vnni with that tile (and
    stays planned: a tuner's task); one without a record runs the variant where ``S4.fits`` holds, else
    cpu_direct_vnni with the automatic tile (``layer_kernel`` and the pass agree)."""
    import json

    from qcompile.relay_passes.dispatch_cpu import layer_kernel
    from qcompile.schedules import cpu_conv_vnni_s4 as S4
    from qcompile.schedules.tuning import format_record, make_record, tuning_key

    spec = ConvSpec(N=1, H=7, W=7, C=64, K=64, R=3, S=3, padding=1, w_bits=4, **U8)
    small, big = np.full(64, 2**20), np.full(64, 2**28)  # (16 x 2**28 leaves int32)
    assert S4.worth(spec) and S4.fits(small) and not S4.fits(big)
    assert layer_kernel(spec, "cpu_direct_vnni", small) == "cpu_direct_vnni_s4"
    for source in ("device", "arch", "nearest"):
        assert layer_kernel(spec, "cpu_direct_vnni", small, source) == "cpu_direct_vnni"
    assert layer_kernel(spec, "cpu_direct_vnni", big) == "cpu_direct_vnni"
    assert layer_kernel(spec.replace(w_bits=8), "cpu_direct_vnni", small) == "cpu_direct_vnni"
    assert layer_kernel(spec, "cpu_direct_avxvnni", small) == "cpu_direct_avxvnni"

    monkeypatch.setenv("QCOMPILE_TUNING_DIR", str(tmp_path / "none"))  # (no default log: only the named one)
    monkeypatch.setenv("QCOMPILE_CPU_S4", "1")
    monkeypatch.setattr(S4, "REUSE_MAX", 1000)
    mod, _ = tiny_resnet_qdq(seed=15, w_bits=4, a_bits=4, shape=(1, 3, 40, 40), c=8)
    mi = lower_to_integer(mod, "NHWC", pack_int4=False)
    p = DispatchCPU("cpu_direct_vnni", device="Test CPU")
    run_pass(p, mi)
    s4 = [n for n, k in p.chosen if k == "cpu_direct_vnni_s4"]
    assert s4 and set(dict(p.planned)) == {n for n, _ in p.chosen}  # (the variant's layers are planned too)
    assert all(src == "default" for _, src in p.sources)
    tuned = s4[0]
    tile = CC.CpuKnobs(qt=2, kt=2)
    log = tmp_path / "cpu.jsonl"
    log.write_text(format_record(make_record("cpu_direct_vnni", "Test CPU", None,
                                             tuning_key(dict(p.planned)[tuned].spec), "cpu_direct", tile,
                                             ms=1.0, default_ms=1.5)) + "\n")
    assert json.loads(log.read_text())["knobs"] == {"qt": 2, "kt": 2}
    p2 = DispatchCPU("cpu_direct_vnni", tuning_logs=[str(log)], device="Test CPU")
    run_pass(p2, mi)
    chosen, sources, planned = dict(p2.chosen), dict(p2.sources), dict(p2.planned)
    assert chosen[tuned] == "cpu_direct_vnni" and sources[tuned] == "device" and planned[tuned].knobs == tile
    assert all(chosen[n] == "cpu_direct_vnni_s4" for n in s4[1:] if sources[n] == "default")
    monkeypatch.setattr(S4, "fits", lambda bound: False)  # (no layer's accumulators fit: no variant)
    p3 = DispatchCPU("cpu_direct_vnni", device="Test CPU")
    run_pass(p3, mi)
    assert {k for _, k in p3.chosen} == {"cpu_direct_vnni"} and len(p3.planned) == len(p.planned)


# the inner loop's instruction per kernel (x86 in AT&T syntax): vpdpbusd on zmm, the VEX form on ymm, vpmaddwd on ymm,
# sdot on 128-bit NEON
ASM = {"cpu_direct_vnni": r"^\s*vpdpbusd\s.*%zmm", "cpu_direct_avxvnni": r"^\s*\{vex\}\s*vpdpbusd\s.*%ymm",
       "cpu_direct_avx2": r"^\s*vpmaddwd\s.*%ymm", "cpu_direct_sdot": r"^\s*sdot\s+v\d+\.4s"}


@pytest.mark.parametrize("kernel", KERNELS)
def test_kernel_assembly(kernel):
    """Each kernel's build for its target holds its instruction and not the others' (any host: compiled, not run;
    the x86 kernels for an x86-64 triple, the Arm one for aarch64)."""
    import re

    spec = SPECS["odd_res"]
    x, w, bias, M, S, res = _random(spec, seed=0)
    f = _make(kernel, spec, "NHWC", w, bias)[0].with_attr("global_symbol", "k")
    tgt = KERNEL_TARGET[kernel]
    if "mtriple" not in tgt.attrs:
        tgt = tvm.target.Target({**{k: v for k, v in dict(tgt.export()).items() if k not in ("keys", "features")},
                                 "mtriple": "x86_64-linux-gnu"})
    asm = tvm.compile(tvm.IRModule({"k": f}), target=tgt).mod.inspect_source("asm")
    for other, pattern in ASM.items():
        assert bool(re.search(pattern, asm, re.M)) == (other == kernel), other


def _capture_targets(monkeypatch) -> list:
    """The targets ``tvm.compile`` is called with from now on."""
    seen, compile_ = [], tvm.compile

    def _compile(mod, target=None, **kw):
        seen.append(tvm.target.Target(target) if isinstance(target, str) else target)
        return compile_(mod, target=target, **kw)

    monkeypatch.setattr(tvm, "compile", _compile)
    return seen


def _ops(mod):
    return [b.value.op.name for blk in mod["main"].body.blocks for b in blk.bindings
            if isinstance(b.value, relax.Call) and hasattr(b.value.op, "name")]


@pytest.mark.parametrize("kernel", _kernel_params())
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("bits", [(8, 8), (4, 4), (4, 8)])
def test_dispatch_exact(bits, layout, kernel):
    mod, shape = tiny_resnet_qdq(seed=3, w_bits=bits[0], a_bits=bits[1], shape=(2, 3, 13, 11), c=10)
    x = np.random.default_rng(4).standard_normal(shape).astype("float32")
    mi = lower_to_integer(mod, layout, pack_int4=False)
    p = DispatchCPU(kernel)
    md = run_pass(p, mi)
    # every conv and the dense on the kernel (the 4-bit layers of a VNNI module on its packed-weight variant: few
    # output pixels here), the block's residual add fused into conv c2's epilogue
    assert [n for n, _ in p.chosen] == ["q_stem", "q_c1", "q_c2", "q_fc"] and not p.skipped
    s4 = kernel == "cpu_direct_vnni" and bits[0] == 4
    assert {k for _, k in p.chosen} <= {kernel, "cpu_direct_vnni_s4"}
    assert any(k == "cpu_direct_vnni_s4" for _, k in p.chosen) == s4
    assert p.fused == [("q_c2", "q_res")]
    ops = _ops(md)
    assert "relax.nn.conv2d" not in ops and "relax.matmul" not in ops
    y = relax.VirtualMachine(build(md, KERNEL_TARGET[kernel]), tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy()
    assert np.array_equal(y, Reference(mi)(x)) and y.std() > 0


def test_dispatch_rejects_unknown_kernel():
    with pytest.raises(ValueError, match="unknown kernel 'cpu_direct_sse'"):
        DispatchCPU("cpu_direct_sse")


@needs_avx2
def test_pipeline_dispatches_on_llvm_and_opt_out(monkeypatch):
    """The llvm pipeline puts convs on the CPU kernel (record.kernels) and stays exact; QCOMPILE_CPU_KERNELS=0 and
    cpu_kernels=False keep TVM's generic conv2d."""
    mod, shape = tiny_resnet_qdq(seed=5, shape=(1, 3, 9, 9))
    x = np.random.default_rng(6).standard_normal(shape).astype("float32")
    targets = _capture_targets(monkeypatch)
    rec = PipelineRecord()
    seen = {}
    pipe = qcompile_pipeline("llvm", "NCHW", record=rec, on_phase=lambda n, m: seen.setdefault(n, m))
    y = relax.VirtualMachine(build(mod, "llvm", pipeline=pipe), tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy()
    # build() decided the host's kernel target once; the pipeline, run under it by tvm.compile, dispatched its kernel
    assert [str(t.attrs.get("mcpu", "")) for t in targets] == [str(TARGET.attrs["mcpu"])]
    assert set(rec.kernels.values()) == {HOST_KERNEL} and len(rec.kernels) == 4
    assert "relax.nn.conv2d" not in _ops(seen["3_dispatched"])
    assert np.array_equal(y, Reference(rec.integer_mod)(x))
    for off in (dict(cpu_kernels=False), None):
        if off is None:
            monkeypatch.setenv("QCOMPILE_CPU_KERNELS", "0")
        seen.clear()
        pipe = qcompile_pipeline("llvm", "NCHW", backend=False, on_phase=lambda n, m: seen.setdefault(n, m),
                                 **(off or {}))
        with tvm.transform.PassContext(opt_level=3):
            out = pipe(mod)
        assert "3_dispatched" not in seen and "relax.nn.conv2d" in _ops(out)
        # the kernels off: build() keeps plain llvm
        targets.clear()
        pipe = qcompile_pipeline("llvm", "NCHW", **(off or {}))
        y = relax.VirtualMachine(build(mod, "llvm", pipeline=pipe), tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy()
        assert len(targets) == 1 and "mcpu" not in targets[0].attrs
        assert np.array_equal(y, Reference(rec.integer_mod)(x))
    assert cpu_kernels_target(tvm.target.Target({"kind": "llvm"})) is None


@needs_avx2
def test_dispatch_leaves_hwnc_to_generic_path():
    """HWNC is not the kernel's layout: its convs stay on TVM's generic conv2d (the dense layer, whose layout is
    (N, C) in every layout, runs on the kernel), and the module stays exact."""
    mod, shape = tiny_resnet_qdq(seed=7, shape=(2, 3, 8, 8))
    x = np.random.default_rng(8).standard_normal(shape).astype("float32")
    mi = lower_to_integer(mod, "HWNC", pack_int4=False)
    p = DispatchCPU()
    md = run_pass(p, mi)
    assert p.chosen == [("q_fc", HOST_KERNEL)] and _ops(md).count("relax.nn.conv2d") == 3
    y = relax.VirtualMachine(build(md, "llvm"), tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy()
    assert np.array_equal(y, Reference(mi)(x)) and y.std() > 0


def test_registered_pipeline_on_plain_llvm_is_generic():
    """``tvm.compile(target="llvm", relax_pipeline=qcompile_pipeline("llvm"))``: plain llvm generates no AVX2, so the
    pipeline dispatches nothing (the AVX2 kernel there aborted LLVM) and the module builds on the generic path, exact.
    Any host."""
    mod, shape = tiny_resnet_qdq(seed=9, shape=(1, 3, 9, 9))
    x = np.random.default_rng(10).standard_normal(shape).astype("float32")
    rec = PipelineRecord()
    with tvm.transform.PassContext(opt_level=3):
        ex = tvm.compile(mod, target="llvm", relax_pipeline=qcompile_pipeline("llvm", record=rec))
    y = relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy()
    assert rec.kernels == {}
    assert np.array_equal(y, Reference(rec.integer_mod)(x)) and y.std() > 0


def test_target_decision(monkeypatch, capfd):
    """Only a plain llvm target is upgraded, and only on an x86-64 host with AVX2; a target naming mtriple / mcpu /
    mattr is used as given and runs the kernels only if it enables AVX2 on an x86 triple. An aarch64 cross build gets
    no x86 CPU (LLVM prints no "not valid" errors) and no kernel. Any host."""
    T_ = _LLVM
    assert cpu_kernels_target(T_(mcpu="nehalem")) is None                            # x86 without AVX2
    if X86_HOST:  # (an x86 host triple: the targets below are x86)
        assert str(cpu_kernels_target(T_(mattr=["+avx2"])).attrs["mattr"][0]) == "+avx2"  # as given
        # the kernel each target's features pick, whatever the host
        assert CC.target_kernel(T_(mcpu="nehalem")) is None
        for kernel, tgt in KERNEL_TARGET.items():
            assert CC.target_kernel(tgt) == kernel
        assert CC.target_kernel(T_(mcpu="x86-64-v4")) == "cpu_direct_avx2"   # AVX-512 without VNNI
        assert CC.target_kernel(T_(mcpu="icelake-server")) == "cpu_direct_vnni"
        with tvm.target.Target(KERNEL_TARGET["cpu_direct_avx2"]):
            assert dispatch_kernel() == "cpu_direct_avx2"
    a64 = T_(mtriple="aarch64-linux-gnu")
    assert CC.cpu_target(a64).same_as(a64) and cpu_kernels_target(a64) is None
    assert not CC.target_has_avx2(T_(mtriple="aarch64-linux-gnu", mcpu="cortex-a72"))
    mod, _ = tiny_resnet_qdq(seed=11, shape=(1, 3, 9, 9))
    targets = _capture_targets(monkeypatch)
    rec = PipelineRecord()
    build(mod, a64, pipeline=qcompile_pipeline(a64, record=rec))
    assert rec.kernels == {} and "mcpu" not in targets[0].attrs
    assert "not valid" not in capfd.readouterr().err
    # plain llvm on a host: the best of x86-64-v4 + AVX-512 VNNI, x86-64-v3 + AVX-VNNI, x86-64-v3
    if CC.host_has_avx2():
        for vnni, (mcpu, mattr, kernel) in {"avx512": ("x86-64-v4", "+avx512vnni", "cpu_direct_vnni"),
                                            "avx": ("x86-64-v3", "+avxvnni", "cpu_direct_avxvnni"),
                                            None: ("x86-64-v3", None, "cpu_direct_avx2")}.items():
            monkeypatch.setattr(CC, "host_vnni", lambda v=vnni: v)
            t = CC.cpu_target(T_())
            assert str(t.attrs["mcpu"]) == mcpu and [str(a) for a in t.attrs.get("mattr", [])] == ([mattr] if mattr
                                                                                                  else [])
            assert CC.target_kernel(t) == kernel and dispatch_kernel() == kernel
    # a host without AVX2 (or not x86-64): plain llvm stays plain, the pipeline keeps the generic path
    monkeypatch.setattr(CC, "host_has_avx2", lambda: False)
    assert cpu_kernels_target(T_()) is None and "mcpu" not in CC.cpu_target(T_()).attrs
    targets.clear()
    rec = PipelineRecord()
    build(mod, "llvm", pipeline=qcompile_pipeline("llvm", record=rec))
    assert rec.kernels == {} and "mcpu" not in targets[0].attrs


def test_dispatch_bound_per_kernel():
    """A layer whose int32 sums fit for the AVX2 kernel but not for the VNNI kernels' shifted input (x + 128 up to 255,
    bias - 128 sum(w)) stays on the generic path under VNNI, exact either way; a uint8 input needs no shift."""
    from types import SimpleNamespace as NS

    from qcompile.relay_passes import dispatch_cpu as DC

    C = 60_000  # sum |w| = sum w = 127 C: 255 x that fits int32, (255 + 128) x that does not
    for x_dt, want_vnni in (("int8", "accumulator may exceed int32"), ("uint8", None)):
        x = NS(ty=NS(shape=[1, C], dtype=x_dt))
        one = np.ones(1, np.int32)
        g = NS(x=x, w=np.full((C, 1), 127, np.int8), dense=True, pad_value=0, bias=np.zeros(1, np.int32), pad=0,
               M=one, S=one * 20, zo=0, lo=-128, hi=127, w_bits=8)
        var = NS(ty=NS(dtype="int8"))
        plan, why = DC._spec(g, None, var, "cpu_direct_avx2")
        assert why is None and plan[0].C == C
        plan, why = DC._spec(g, None, var, "cpu_direct_vnni")
        assert why == want_vnni


def test_aarch64_dotprod_cross_build():
    """``--target llvm -mtriple=aarch64-linux-gnu -mattr=+dotprod``: every conv and the dense layer on the sdot kernel
    (record.kernels), the build's code holds ``sdot``; without dotprod the generic path. Any host: cross-compiled,
    the assembly checked (no aarch64 machine or emulator here to run it)."""
    import re

    mod, _ = tiny_resnet_qdq(seed=13, shape=(1, 3, 9, 9))
    for mattr, kernel in ((["+neon", "+dotprod"], "cpu_direct_sdot"), (["+neon"], None)):
        tgt = _LLVM(mtriple="aarch64-linux-gnu", mattr=mattr)
        assert CC.target_kernel(tgt) == kernel and CC.cpu_target(tgt).same_as(tgt)
        rec = PipelineRecord()
        ex = build(mod, tgt, pipeline=qcompile_pipeline(tgt, "NHWC", record=rec))
        asm = "\n".join(m.inspect_source("asm") for m in [ex.mod, *ex.mod.imports] if m.kind == "llvm")
        assert bool(re.search(ASM["cpu_direct_sdot"], asm, re.M)) == (kernel is not None)
        assert set(rec.kernels.values()) == ({kernel} if kernel else set())
        assert len(rec.kernels) == (4 if kernel else 0)


# ------------------------------------------------------------------------------------------------
# --target as a full LLVM target string, from the command line
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_onnx(tmp_path_factory):
    """A quantized resnet_tiny exported by ``qmodel`` (INT8, 16x16) and a fresh input."""
    import subprocess
    import sys

    d = tmp_path_factory.mktemp("cli_target")
    path = str(d / "tiny8.onnx")
    r = subprocess.run([sys.executable, "-m", "qcompile.models.cli", "resnet_tiny", "--bits", "8", "--format", "onnx",
                        "--input-size", "16", "-o", path], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return d, path, np.random.default_rng(21).standard_normal((1, 3, 16, 16)).astype("float32")


def _named_cpus():
    """(--target, inner kernel) per CPU this host runs: a named VNNI CPU, a named AVX2 CPU, and native."""
    if not CC.host_has_avx2():
        return [pytest.param(None, None, marks=pytest.mark.skip(reason="the CPU kernels need x86-64 with AVX2"))]
    cpus = [("llvm -mcpu=haswell", "cpu_direct_avx2"), ("llvm -mcpu=native", None)]
    if CC.host_vnni() == "avx512":
        cpus.insert(0, ("llvm -mcpu=cascadelake", "cpu_direct_vnni"))
    return [pytest.param(t, k, id=t.split("=")[-1]) for t, k in cpus]


@pytest.mark.parametrize("target,kernel", _named_cpus())
def test_cli_named_cpu_exact(tiny_onnx, tmp_path, capsys, target, kernel):
    """``qcompile --target "llvm -mcpu=NAME"``: every layer on the inner kernel the CPU's features select (the
    summary names it per layer), the .so bit-exact against the integer reference of the same model; ``-mcpu=native``
    resolves to a CPU LLVM knows whose vector features this host runs (:func:`native_cpu`)."""
    from qcompile.cli import qcompile_main
    from qcompile.driver import CompileOptions, compile_model
    from qcompile.runtime import Module

    _, model, x = tiny_onnx
    if kernel is None:  # native: LLVM's name of this CPU (or the host's best level), its kernel that target's
        mcpu, mattr, note = CC.native_cpu()
        assert tvm.target.codegen.llvm_is_valid_cpu(mcpu, tvm.target.codegen.llvm_get_system_triple()) and note
        native = tvm.target.Target({"kind": "llvm", "mcpu": mcpu, **({"mattr": list(mattr)} if mattr else {})})
        assert CC.missing_host_features(native) == []
        kernel = CC.target_kernel(native)
        assert kernel in (*KERNELS, "cpu_direct_amx")
    # (an AMX CPU: AMX where the layer allows it -- tests/test_cpu_amx.py -- and the VNNI kernel elsewhere)
    allowed = {kernel, "cpu_direct_vnni"} if kernel == "cpu_direct_amx" else {kernel}
    so = str(tmp_path / "m.so")
    assert qcompile_main([model, "--target", target, "-o", so]) == 0
    out = capsys.readouterr().out
    rows = [ln.split() for ln in out.splitlines() if ln.split()[:1] and ln.split()[1:2] in (["conv2d"], ["dense"])]
    assert len(rows) == 10 and all(r[8] in allowed for r in rows), out  # (the summary's kernel column)
    assert "building for llvm -mcpu=" in out
    res = compile_model(model, CompileOptions(target=target), log=lambda s: None)
    assert res.meta["llvm_target"].startswith("llvm -mcpu=") and {l.kernel for l in res.layers} <= allowed
    y = Module(so)(x)
    ref = Reference(res.integer_mod)(x)
    assert np.array_equal(y, ref) and ref.std() > 0


def _text_words(obj: bytes) -> np.ndarray:
    """The 32-bit words of the executable sections of an ELF64 little-endian relocatable object."""
    import struct

    shoff, = struct.unpack_from("<Q", obj, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", obj, 0x3A)
    words = []
    for i in range(shnum):
        _, _, flags, _, off, size = struct.unpack_from("<IIQQQQ", obj, shoff + i * shentsize)
        if flags & 0x4:  # SHF_EXECINSTR
            words.append(np.frombuffer(obj[off:off + size - size % 4], "<u4"))
    return np.concatenate(words) if words else np.zeros(0, "<u4")


def _has_sdot(obj: bytes) -> bool:
    """Whether the object's code holds an Arm SDOT: the vector form (0Q00 1110 100m mmmm 1001 01nn nnnd dddd) or the
    by-element form (0Q00 1111 10LM mmmm 1110 H0nn nnnd dddd)."""
    w = _text_words(obj)
    return bool(((w & 0xBFE0FC00) == 0x0E809400).any() or ((w & 0xBFC0F400) == 0x0F80E000).any())


def test_cli_aarch64_cross_build(tiny_onnx, tmp_path, capsys, monkeypatch):
    """``qcompile --target "llvm -mtriple=aarch64-linux-gnu -mattr=+dotprod" -o NAME.tar``: every layer on the sdot
    kernel (the summary), the tar's objects are aarch64 ELF and their code holds SDOT; without +dotprod the generic
    path and no SDOT. A .tar is not linked: no host C++ compiler is needed (``$CXX`` names a missing one), and
    ``--weights-beside`` writes NAME.weights.npz beside NAME.tar. Any host (cross-compiled, nothing run)."""
    import tarfile

    from qcompile.checks import weights_path
    from qcompile.cli import qcompile_main

    assert weights_path("d/m.tar") == "d/m.weights.npz" and weights_path("d/m.so") == "d/m.weights.npz"
    monkeypatch.setenv("CXX", "no-such-cxx-for-qcompile")
    _, model, _ = tiny_onnx
    for mattr, kernel in (("+neon,+dotprod", "cpu_direct_sdot"), ("+neon", "llvm")):
        out = str(tmp_path / f"a64{len(mattr)}.tar")
        beside = ["--weights-beside"] if kernel == "llvm" else []
        assert qcompile_main([model, "--target", f"llvm -mtriple=aarch64-linux-gnu -mattr={mattr}", "-o", out]
                             + beside) == 0
        assert os.path.isfile(out[:-4] + ".weights.npz") == bool(beside)
        assert not os.path.exists(out + ".weights.npz")
        log = capsys.readouterr().out
        rows = [ln.split() for ln in log.splitlines() if ln.split()[1:2] in (["conv2d"], ["dense"])]
        assert len(rows) == 10 and {r[8] for r in rows} == {kernel}, log
        with tarfile.open(out) as tf:
            objs = [tf.extractfile(m).read() for m in tf.getmembers() if m.name.endswith(".o")]
        assert objs and all(o[:4] == b"\x7fELF" and int.from_bytes(o[18:20], "little") == 183 for o in objs)  # EM_AARCH64
        assert any(_has_sdot(o) for o in objs) == (kernel == "cpu_direct_sdot")
