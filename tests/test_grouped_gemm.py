"""The tensor-core kernel of grouped convs (schedules/grouped_gemm.py, ``grouped_gemm``): the implicit GEMM with each
N tile inside one group.

* GPU tier (``-m gpu``): ResNeXt-50 / ResNeXt-101 layer shapes, odd ones (Cg 4 / 8 vectors, K = 2C, 5x5 stride 2
  with a pad value and plain loads, dilation, asymmetric padding, int8 in, 4-bit values with packed 4-bit outputs,
  residual stages, int32 outputs), random legal shapes and random legal points of the tuning space, each built for
  this host's GPU and run on fresh random inputs with the output poisoned twice, bit for bit against the NumPy
  grouped reference of tests/test_gpu_depthwise.py (``grouped_acc`` + kernel_reference's epilogue); a small QDQ
  model whose ResNeXt-like grouped conv (with a fused residual add) runs on the kernel equals the integer reference.
* CPU tier: the kernel builds with nvcc for sm_90, sm_80 and sm_75 (marker ``nvcc``); the space's legality agrees
  with the builder on random points x shapes; the strategy choice (``grouped_kernel``: legal shapes, Cg = 4 refused,
  ``QCOMPILE_GROUPED_GEMM``, tuning records naming either kernel) and the CUDA dispatch of a model's grouped conv.
"""
from __future__ import annotations

import json
import random
import zlib

import numpy as np
import pytest

from qcompile.errors import QCompileError

from conftest import gpu_compute_capability
from test_gpu_depthwise import I4, I8, RES4, RES8, U4, U8, check_out, make_problem, out_buffer
from test_gpu_kernels import POISONS, STORAGE, pack_nibbles, target_arch

I32 = dict(x_dtype="int8", out_dtype="int32", zo=0, lo=-(1 << 31), hi=(1 << 31) - 1)


def gg(name, H, C, K, groups, R=3, stride=1, N=1, W=None, knobs=None, wg=None, **kw):
    """A case: ``knobs`` (GemmKnobs fields) forced on every arch, ``wg`` only where the arch has wgmma."""
    kw.setdefault("padding", R // 2)
    spec = dict(N=N, H=H, W=W or H, C=C, K=K, R=R, S=kw.pop("S", R), stride=stride, groups=groups, **{**U8, **kw})
    return dict(name=name, spec=spec, groups=groups, knobs=knobs, wg=wg)


SYNC64 = dict(BM=64, BN=32, BK=32, WM=2, WN=1, stages=3)
CASES = [
    # ResNeXt-50 32x4d layer4 (Cg = Kg = 32): the 7x7 blocks and the stride-2 first block; batch 1 and 4
    gg("rx50_l4_7x1024", 7, 1024, 1024, 32),
    gg("rx50_l4_7x1024_b4", 7, 1024, 1024, 32, N=4),
    gg("rx50_l4_14x1024_s2", 14, 1024, 1024, 32, stride=2, N=2),
    gg("rx50_l4_res8", 7, 1024, 1024, 32, N=2, **RES8),
    # ResNeXt-101 32x8d layer3 (Cg 32) and layer4 (Cg = Kg = 64: wgmma tiles where the arch has them)
    gg("rx101_l3_14x1024", 14, 1024, 1024, 32, N=2),
    gg("rx101_l4_7x2048", 7, 2048, 2048, 32, N=2, wg=dict(mma="wgmma", BM=128, BN=64, BK=64, WM=1, WN=1, stages=3,
                                                         pipe=-1, vec=16)),
    gg("rx101_l4_7x2048_sync", 7, 2048, 2048, 32, N=2, knobs=dict(BM=128, BN=64, BK=64, WM=2, WN=2, stages=4)),
    # odd: Cg 8 and Cg 4 (8- and 4-byte vectors), K = 2C (Kg 64 over Cg 32), 5x5 stride 2 with a pad value (plain
    # loads), dilation with asymmetric padding, int8 in, 4-bit values in with packed 4-bit out and a 4-bit residual,
    # int32 out, forced small tiles (a K-chunk of 32 bytes: taps straddle chunks)
    gg("cg8_kg32", 12, 64, 256, 8, N=2),
    gg("cg4_kg32", 9, 32, 256, 8, N=2, **I8),
    gg("k2c_cg32_kg64", 10, 256, 512, 8, N=2, knobs=SYNC64),
    gg("cg32_5x5_s2_pad", 17, 256, 128, 4, R=5, stride=2, pad_value=11),
    gg("cg16_dil2_asym", 15, 64, 128, 4, padding=(2, 1, 0, 3), dilation=2, W=11, **I8, knobs=SYNC64),
    gg("u4_res4_packed", 9, 256, 256, 8, N=2, **U4, **RES4),
    gg("i4_packed_out", 8, 128, 256, 4, **I4),
    gg("i32_out", 9, 64, 64, 2, **I32),
    gg("ge33_pipe1_fdb", 11, 512, 512, 16, **I8, shift_ge33=True,
       knobs=dict(BM=128, BN=32, BK=64, WM=4, WN=1, stages=3, pipe=1, fdb=True, ev=4)),
]


def random_cases(n: int = 6, seed: int = 7) -> list:
    """Random shapes the kernel takes (Kg a multiple of 32, Cg of 4), with random epilogues."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        groups = int(rng.choice([2, 4, 8, 16, 32]))
        cg, kg = int(rng.choice([4, 8, 16, 32, 64])), int(rng.choice([32, 64]))
        R = int(rng.choice([1, 3, 3, 5]))
        epi = [U8, I8, dict(U8, **RES8), I32][int(rng.integers(4))]
        out.append(gg(f"random_{i}", int(rng.integers(5, 16)), groups * cg, groups * kg, groups, R=R,
                      stride=int(rng.choice([1, 1, 2])), N=int(rng.integers(1, 4)), W=int(rng.integers(5, 16)), **epi))
    return out


ALL = CASES + random_cases()


# ---------------------------------------------------------------------------------------------------------------
# build and run
# ---------------------------------------------------------------------------------------------------------------
def plan(case, arch: str, knobs=None):
    """The case's grouped_gemm PlannedKernel on ``arch`` (its forced knobs, ``wg`` where the arch has wgmma)."""
    from qcompile.schedules import ConvSpec, GemmKnobs
    from qcompile.schedules.grouped_gemm import gemm_spec, plan_grouped_gemm
    from qcompile.schedules.spec import arch_info

    spec = gemm_spec(ConvSpec(**case["spec"]))
    if knobs is None and case["wg"] and arch_info(arch).wgmma:
        knobs = GemmKnobs(**case["wg"])
    elif knobs is None and case["knobs"]:
        knobs = GemmKnobs(**case["knobs"])
    return plan_grouped_gemm(spec, arch, knobs)


def build(pk, arch: str, mode: str = "sass"):
    import tvm

    from qcompile.schedules.build import cuda_target, ensure_stub_libcuda, nvcc_options

    ensure_stub_libcuda()
    with nvcc_options(arch, mode):
        return tvm.compile(tvm.IRModule({"k0": pk.funcs[0].with_attr("global_symbol", "k0")}), target=cuda_target(arch))


def kernel_args(pk, p) -> list:
    """The kernel's inputs in parameter order: x, w (OHWI [K, R, S, Cg] int8), bias, M, S, [res, rq2]."""
    s = pk.spec
    w = np.asarray(p["w"]).astype(np.int8)
    assert np.array_equal(pk.weights(p["w"]), w), "the compiler's weight format is not the documented OHWI int8"
    args = [np.asarray(p["x"]).astype(STORAGE[s.x_dtype]), w, p["bias"].astype(np.int32), p["M"].astype(np.int32),
            p["S"].astype(np.int32)]
    if s.has_residual:
        args.append(pack_nibbles(p["res"]).view(STORAGE[s.res_dtype]) if s.res_bits == 4
                    else p["res"].astype(STORAGE[s.res_dtype]))
        args.append(p["rq2"].astype(np.int32))
    return args


def run_on_gpu(case, pk, mod) -> None:
    import tvm

    dev = tvm.cuda(0)
    p = make_problem(case)
    args = [tvm.runtime.tensor(np.ascontiguousarray(a), dev) for a in kernel_args(pk, p)]
    for poison in POISONS:
        out = tvm.runtime.tensor(out_buffer(pk.spec, poison), dev)
        mod["k0"](*args, out)
        dev.sync()
        check_out(case, pk.spec, p, out.numpy())


# ---------------------------------------------------------------------------------------------------------------
# GPU tier
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.nvcc
@pytest.mark.parametrize("case", ALL, ids=[c["name"] for c in ALL])
def test_grouped_gemm_bit_exact_on_gpu(case):
    arch, mode = target_arch(gpu_compute_capability())
    pk = plan(case, arch)
    run_on_gpu(case, pk, build(pk, arch, mode))


SPACE_CASES = ["rx50_l4_7x1024", "rx101_l4_7x2048", "k2c_cg32_kg64", "cg4_kg32", "rx50_l4_res8"]


@pytest.mark.gpu
@pytest.mark.nvcc
@pytest.mark.parametrize("name", SPACE_CASES)
def test_space_points_bit_exact_on_gpu(name):
    """Random legal points of the grouped_gemm space (mma.sync and, on sm_90, wgmma tiles) run bit-exact."""
    from qcompile.schedules import ConvSpec
    from qcompile.schedules.grouped_gemm import gemm_spec
    from qcompile.schedules.space import SPACES

    arch, mode = target_arch(gpu_compute_capability())
    case = next(c for c in CASES if c["name"] == name)
    spec = gemm_spec(ConvSpec(**case["spec"]))
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    for _ in range(3):
        kn = SPACES["grouped_gemm"].sample(rng, spec, arch)
        assert kn is not None, f"no legal point drawn for {name} on {arch}"
        pk = plan(case, arch, kn)
        run_on_gpu(case, pk, build(pk, arch, mode))


def _resnext_model(seed=5):
    """uint8 input [2, 1024, 7, 7] -> grouped 3x3 (32 groups of 32 channels, ResNeXt-50 layer4) with a residual add
    of the input -> out."""
    from qcompile.qdq import QDQBuilder, qtype

    rng = np.random.default_rng(seed)
    b = QDQBuilder()
    x = b.input("x", (2, 1024, 7, 7))
    u8, s8 = qtype(8, False), qtype(8, True)
    d0 = b.dequantize(b.quantize(x, 0.03, 0, u8, name="q_in"), 0.03, 0)
    w = b.qweight(rng.integers(-127, 128, (1024, 32, 3, 3)), rng.uniform(2e-4, 6e-4, 1024), s8, name="w1")
    h = b.conv2d(d0, w, b.qbias(rng.integers(-999, 999, 1024), 1e-5, "b1"), padding=(1, 1, 1, 1), groups=32,
                 name="gc")
    d1 = b.dequantize(b.quantize(h, 0.05, 3, u8, name="q_gc"), 0.05, 3)
    return b.finish([b.dequantize(b.quantize(b.add(d1, d0), 0.06, 0, u8, name="q_res"), 0.06, 0, name="out")])


@pytest.mark.gpu
@pytest.mark.nvcc
def test_resnext_model_gpu_equals_reference():
    """The model above compiled for this GPU (its grouped conv on grouped_gemm, the residual add fused) equals the
    NumPy integer reference."""
    from test_grouped_dispatch import gpu_equals_reference

    gpu_equals_reference(_resnext_model(), [np.abs(np.random.default_rng(30 + seed).standard_normal((2, 1024, 7, 7)))
                                            .astype("float32") for seed in range(2)])


# ---------------------------------------------------------------------------------------------------------------
# CPU tier
# ---------------------------------------------------------------------------------------------------------------
BUILD_CASES = ["rx50_l4_7x1024", "rx50_l4_res8", "rx101_l4_7x2048", "u4_res4_packed", "cg32_5x5_s2_pad"]


@pytest.mark.nvcc
@pytest.mark.parametrize("arch", ["sm_90", "sm_80", "sm_75"])
@pytest.mark.parametrize("name", BUILD_CASES)
def test_builds_with_nvcc(name, arch):
    """nvcc (ptxas) builds the kernel; its PTX holds the tensor-core MMA (wgmma on sm_90 for the Kg = 64 case)."""
    from qcompile.schedules.build import cuda_source

    case = next(c for c in CASES if c["name"] == name)
    pk = plan(case, arch)
    assert pk.strategy == "grouped_gemm" and pk.funcs[0].attrs["qcompile.strategy"] == "grouped_gemm"
    src = cuda_source(build(pk, arch))
    wg = case["wg"] is not None and arch == "sm_90"
    assert ("wgmma.mma_async" in src) == wg and ("mma.sync" in src) != wg, name


SHAPES = [dict(N=2, H=7, W=7, C=1024, K=1024, groups=32), dict(N=1, H=14, W=14, C=2048, K=2048, groups=32),
          dict(N=2, H=9, W=9, C=256, K=512, groups=8, pad_value=3), dict(N=1, H=8, W=8, C=32, K=256, groups=8),
          dict(N=3, H=28, W=28, C=128, K=128, groups=32), dict(N=2, H=10, W=10, C=64, K=96, groups=2)]


def test_legality_agrees_with_builder():
    """On random points x shapes x archs the space's ``legal`` is None exactly where ``make_grouped_gemm`` builds
    the kernel, and otherwise the builder refuses with the same reason; the ``effective`` knobs build the same kernel."""
    import tvm

    from qcompile.schedules import ConvSpec, GemmKnobs
    from qcompile.schedules.gemm.plan import NotApplicable
    from qcompile.schedules.grouped_gemm import make_grouped_gemm
    from qcompile.schedules.space import SPACES

    sp = SPACES["grouped_gemm"]
    rng = np.random.default_rng(11)
    seen = {True: 0, False: 0}
    for i in range(36):
        shape = SHAPES[i % len(SHAPES)]
        arch = ("sm_90", "sm_80", "sm_75")[i % 3]
        spec = ConvSpec(R=3, S=3, padding=1, x_dtype="uint8", out_dtype="uint8", lo=0, hi=255, **shape)
        kn = sp.draw(rng, spec, arch) if i % 2 else GemmKnobs.sample(random.Random(i))
        why = sp.legal(spec, arch, kn)
        try:
            f = make_grouped_gemm(spec, arch, kn)
            built = None
        except NotApplicable as e:
            f, built = None, str(e)
        assert why == built, (shape, arch, kn, why, built)
        seen[why is None] += 1
        if why is None:  # (the effective knobs build the same kernel)
            eff = make_grouped_gemm(spec, arch, sp.effective(spec, arch, kn))
            tvm.ir.assert_structural_equal(eff.body, f.body, map_free_vars=True)
    assert seen[True] >= 6 and seen[False] >= 6, seen


def _rx(**kw):
    from qcompile.schedules import ConvSpec

    base = dict(N=256, H=7, W=7, C=1024, K=1024, R=3, S=3, padding=1, x_dtype="uint8", out_dtype="uint8", lo=0,
                hi=255, groups=32)
    return ConvSpec(**{**base, **kw})


def test_strategy_choice(monkeypatch, tmp_path):
    """grouped_kernel: grouped_gemm for ResNeXt-50's layer4 conv (Cg = Kg = 32), grouped for its layer1-3 convs
    (Cg 4 / 8 / 16), depthwise for groups == C == K; QCOMPILE_GROUPED_GEMM=0 / 1; in auto mode a layer's own
    records decide (the faster one; a grouped record alone keeps grouped)."""
    from qcompile.schedules import GemmKnobs
    from qcompile.schedules.grouped import GroupedConfig
    from qcompile.schedules.grouped_gemm import grouped_gemm_constraints, grouped_kernel
    from qcompile.schedules.tuning import clear_cache, make_record, format_record, tuning_key

    monkeypatch.delenv("QCOMPILE_GROUPED_GEMM", raising=False)
    logs = tmp_path / "logs"  # (empty logs: no record anywhere)
    logs.mkdir()
    for arch in ("sm_90", "sm_75"):
        (logs / f"{arch}.jsonl").write_text("")
    monkeypatch.setenv("QCOMPILE_TUNING_DIR", str(logs))
    clear_cache()
    l4 = _rx()
    assert grouped_kernel(l4, "sm_90") == "grouped_gemm"
    assert grouped_kernel(l4.replace(N=1), "sm_75") == "grouped_gemm"
    for c in (128, 256, 512):  # layer1-3: Cg = 4, 8, 16
        s = _rx(C=c, K=c, H=56 * 128 // c)
        assert grouped_kernel(s, "sm_90") == "grouped", c
        assert "multiple of 32" in grouped_gemm_constraints(s, "sm_90")
    assert grouped_kernel(_rx(C=64, K=64, groups=64), "sm_90") == "depthwise"
    monkeypatch.setenv("QCOMPILE_GROUPED_GEMM", "0")
    assert grouped_kernel(l4, "sm_90") == "grouped"
    monkeypatch.setenv("QCOMPILE_GROUPED_GEMM", "off")
    assert grouped_kernel(l4, "sm_90") == "grouped"
    monkeypatch.setenv("QCOMPILE_GROUPED_GEMM", "fast")
    with pytest.raises(QCompileError, match="QCOMPILE_GROUPED_GEMM='fast': expected 0, 1 or auto"):
        grouped_kernel(l4, "sm_90")
    monkeypatch.setenv("QCOMPILE_GROUPED_GEMM", "auto")
    log = tmp_path / "log.jsonl"
    cc = make_record("sm_90", "H100", 132, tuning_key(l4), "grouped", GroupedConfig(kt=8, qt=4), ms=0.2)
    log.write_text(format_record(cc) + "\n")
    clear_cache()
    # (only the CUDA-core kernel has a record: no comparison on one GPU, the tensor cores)
    assert grouped_kernel(l4, "sm_90", "H100", [str(log)]) == "grouped_gemm"
    other = make_record("sm_90", "H200", 132, tuning_key(l4), "grouped_gemm",
                        GemmKnobs(BM=128, BN=32, BK=64, WM=4, WN=1, stages=4), ms=0.3)
    log.write_text(format_record(cc) + "\n" + format_record(other) + "\n")
    clear_cache()
    # (records of the two kernels on two different GPUs are not compared)
    assert grouped_kernel(l4, "sm_90", "H100", [str(log)]) == "grouped_gemm"
    tc = make_record("sm_90", "H100", 132, tuning_key(l4), "grouped_gemm",
                     GemmKnobs(BM=128, BN=32, BK=64, WM=4, WN=1, stages=4), ms=0.1)
    log.write_text(format_record(cc) + "\n" + format_record(tc) + "\n")
    clear_cache()
    assert grouped_kernel(l4, "sm_90", "H100", [str(log)]) == "grouped_gemm"
    rec = json.loads(format_record(tc))
    rec["ms"] = 0.3
    log.write_text(format_record(cc) + "\n" + format_record(rec) + "\n")
    clear_cache()
    assert grouped_kernel(l4, "sm_90", "H100", [str(log)]) == "grouped"
    clear_cache()


def test_dispatch_picks_grouped_gemm(monkeypatch):
    """The CUDA dispatch runs the model's ResNeXt layer4 conv on grouped_gemm with the residual add fused (the grouped
    kernel with QCOMPILE_GROUPED_GEMM=0); the kernel takes the OHWI weights; a Cg = 4 layer stays on grouped."""
    from tvm import relax

    from qcompile.errors import run_pass
    from qcompile.pipeline import lower_to_integer
    from qcompile.relay_passes import DispatchTensorCore

    mi = lower_to_integer(_resnext_model(), "NHWC", pack_int4=False)
    monkeypatch.delenv("QCOMPILE_GROUPED_GEMM", raising=False)
    p = DispatchTensorCore("sm_90")
    md = run_pass(p, mi)
    assert [s for _, s in p.chosen] == ["grouped_gemm"], p.chosen
    assert p.fused == [("q_gc", "q_res")]
    (name, pk), = p.planned
    assert pk.strategy == "grouped_gemm" and pk.spec.groups == 32 and pk.knobs.BN == 32
    ops = [b.value.op.name for blk in md["main"].body.blocks for b in blk.bindings
           if isinstance(b.value, relax.Call) and hasattr(b.value.op, "name")]
    assert "relax.nn.conv2d" not in ops
    monkeypatch.setenv("QCOMPILE_GROUPED_GEMM", "0")
    p = DispatchTensorCore("sm_90")
    run_pass(p, mi)
    assert [s for _, s in p.chosen] == ["grouped"], p.chosen
    monkeypatch.delenv("QCOMPILE_GROUPED_GEMM")
    from test_grouped_dispatch import _grouped_model  # (its grouped conv: 4 groups of Cg = 4, Kg = 6)

    p = DispatchTensorCore("sm_90")
    run_pass(p, lower_to_integer(_grouped_model(), "NHWC", pack_int4=False))
    assert sorted(s for _, s in p.chosen) == ["depthwise", "grouped"], p.chosen


@pytest.mark.nvcc
@pytest.mark.parametrize("case", ALL, ids=[c["name"] for c in ALL])
def test_gpu_cases_build_for_sm90(case):
    """Every GPU-tier case plans and builds for sm_90 (ptxas), with a non-degenerate reference problem whose buffers
    fit the kernel's parameters."""
    pk = plan(case, "sm_90")
    build(pk, "sm_90")
    args = kernel_args(pk, make_problem(case))
    params = pk.funcs[0].params
    assert len(params) == len(args) + 1
    for buf, a in zip(params, args):  # (a tirx PrimFunc's parameters are its buffers)
        assert tuple(int(d) for d in buf.shape) == a.shape and str(buf.dtype) == str(a.dtype), (buf, a.shape, a.dtype)


def test_space_legal_is_total():
    """The grouped_gemm space's ``legal`` on uniform draws over its dims, mutated sampler draws and sampled points of
    grouped and dense shapes x archs x SM counts: None or a reason within a second; both occur; where it applies,
    ``effective`` of a legal point is legal and ``features`` has ``feature_names``' length; it never applies to a
    dense conv, a depthwise conv or a Cg = 4 / Kg = 4 ResNeXt-50 layer."""
    import time

    from qcompile.schedules import ConvSpec
    from qcompile.schedules.space import SPACES

    sp = SPACES["grouped_gemm"]
    rng = random.Random("grouped-gemm-total")
    base = dict(R=3, S=3, padding=1, x_dtype="uint8", out_dtype="uint8", lo=0, hi=255)
    specs = [ConvSpec(**{**base, **s}) for s in SHAPES] + [ConvSpec(**{**base, **SHAPES[0], "pad_value": 5})]
    assert sp.applies(_rx(groups=1), "sm_90") and sp.applies(_rx(C=128, K=128, H=56), "sm_90")
    assert sp.applies(_rx(C=1024, K=1024, groups=1024), "sm_90")
    legal = total = 0
    for i in range(1500):
        spec, arch = rng.choice(specs), rng.choice(("sm_90", "sm_80", "sm_75", "sm_86"))
        if i % 3 == 0:
            kn = uniform_knobs(rng, sp)
        elif i % 3 == 1:
            kn = sp.draw(rng, spec, arch).replace(**{(f := rng.choice(list(sp.dims))): rng.choice(sp.dims[f])})
        else:
            kn = sp.sample(rng, spec, arch, tries=200)
            if kn is None:
                continue
        sms = rng.choice((None, 46, 132))
        t = time.perf_counter()
        why = sp.legal(spec, arch, kn, sms)
        assert why is None or (isinstance(why, str) and why), (spec, arch, kn)
        assert time.perf_counter() - t < 1.0
        total += 1
        if why is None:
            legal += 1
            assert sp.legal(spec, arch, sp.effective(spec, arch, kn, sms), sms) is None, (spec, arch, kn)
            assert len(sp.features(spec, arch, kn, sms)) == len(sp.feature_names())
    assert 100 < legal < total, (legal, total)


def uniform_knobs(rng, sp):
    """A uniform draw over the space's dims."""
    return sp.knobs_type(**{k: rng.choice(v) for k, v in sp.dims.items()})
