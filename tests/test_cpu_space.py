"""The CPU kernels' tuning space (``schedules.space.SPACES["cpu_direct"]``): its legality is the builders' own check
(``cpu_conv.tile_legal``), total over the space; the default is the kernels' automatic tile; every legal point of a
seeded sample builds for the CPU and is bit-exact against the NumPy reference on this host (the tuner's builder and
local runner, ``--measure-device cpu``); illegal points are refused, with the space's reason, before any TIR."""
from __future__ import annotations

import itertools
import json
import random

import pytest

from qcompile.schedules import cpu_conv, cpu_conv_vnni
from qcompile.schedules.cpu_conv import CpuKnobs
from qcompile.schedules.space import CPU_CONFIGS, CPU_KERNELS, SPACES
from qcompile.schedules.spec import ConvSpec
from qcompile.schedules.tuning import tuning_key

SP = SPACES["cpu_direct"]
_U8 = dict(x_dtype="uint8", out_dtype="uint8", lo=0, hi=255)
SHAPES = {  # (small: built and run on the CPU in the agreement test)
    "3x3_pad_odd_u8": ConvSpec(N=1, H=9, W=11, C=20, K=24, R=3, S=3, padding=1, **_U8),
    "1x1_i8_w4_res": ConvSpec(N=2, H=6, W=7, C=16, K=40, R=1, S=1, x_dtype="int8", w_bits=4, out_dtype="int8",
                              has_residual=True, res_dtype="int8"),
    "s2_dil_i32": ConvSpec(N=1, H=12, W=12, C=8, K=12, R=3, S=3, stride=2, dilation=2, padding=2, x_dtype="int8",
                           out_dtype="int32", lo=-(1 << 31), hi=(1 << 31) - 1),
    "r18_l1": ConvSpec(N=1, H=56, W=56, C=64, K=64, R=3, S=3, padding=1, **_U8),
    "r50_l4_1x1": ConvSpec(N=8, H=7, W=7, C=512, K=2048, R=1, S=1, **_U8),
}
X86 = ("cpu_direct_avx2", "cpu_direct_vnni", "cpu_direct_avxvnni")


def _host_kernels() -> list:
    """The x86 kernels this host runs (AVX2; the VNNI forms where /proc/cpuinfo has them)."""
    if not cpu_conv.host_has_avx2():
        return []
    vnni = cpu_conv.host_vnni()
    return ["cpu_direct_avx2"] + (["cpu_direct_avxvnni"] if cpu_conv.host_flags() >= {"avx_vnni"} else []) + (
        ["cpu_direct_vnni"] if vnni == "avx512" else [])


def test_registers_agree_with_the_instruction_sets():
    assert set(cpu_conv.REGS) == set(CPU_KERNELS)
    for k, isa in cpu_conv_vnni.ISAS.items():
        assert cpu_conv.REGS[k] == isa.regs, k


def test_legal_is_total_and_effective_is_legal():
    """Every point of the dims, every kernel, every shape: None or a reason; where legal, the effective tile is legal
    and within the shape, and the features have one value per name. Both answers occur for every kernel."""
    grid = [CpuKnobs(**dict(zip(SP.dims, v))) for v in itertools.product(*SP.dims.values())]
    for kernel in CPU_KERNELS:
        legal = 0
        for name, spec in SHAPES.items():
            assert SP.applies(spec, kernel) is None
            for kn in grid:
                why = SP.legal(spec, kernel, kn)
                assert why is None or (isinstance(why, str) and why)
                if why is None:
                    legal += 1
                    eff = SP.effective(spec, kernel, kn)
                    assert SP.legal(spec, kernel, eff) is None and 1 <= eff.qt <= spec.Q, (kernel, name, kn, eff)
                    assert len(SP.features(spec, kernel, kn, sms=2)) == len(SP.feature_names())
        assert 0 < legal < len(grid) * len(SHAPES), (kernel, legal)
    assert SP.legal(SHAPES["r18_l1"], "sm_90", CpuKnobs()) is not None  # (a GPU arch: not a CPU kernel)
    assert "16 vector registers" in SP.legal(SHAPES["r18_l1"], "cpu_direct_avx2", CpuKnobs(8, 2))
    assert SP.legal(SHAPES["r18_l1"], "cpu_direct_vnni", CpuKnobs(8, 2)) is None


def test_default_is_the_automatic_tile():
    """``default`` is what an untuned layer builds with: QT x KT (AVX2), ``choose_tile`` (dot-product kernels); the
    automatic knobs (0 x 0) have the same effective tile."""
    for kernel, (name, spec) in itertools.product(CPU_KERNELS, SHAPES.items()):
        d = SP.default(spec, kernel)
        assert SP.legal(spec, kernel, d) is None
        want = (cpu_conv.QT, cpu_conv.KT) if kernel == "cpu_direct_avx2" else (
            cpu_conv_vnni.choose_tile(spec, kernel).qt, cpu_conv_vnni.choose_tile(spec, kernel).kt)
        assert (d.qt, d.kt) == want, (kernel, name)
        assert SP.effective(spec, kernel, CpuKnobs()) == SP.effective(spec, kernel, d)


def test_start_points_are_legal_and_distinct():
    """Every tile of ``CPU_CONFIGS`` fits its kernels' registers; ``configs`` keeps one per distinct kernel."""
    for kernel in CPU_KERNELS:
        for name, spec in SHAPES.items():
            got = SP.configs(spec, kernel)
            assert got and all(SP.legal(spec, kernel, kn) is None for kn in got), (kernel, name)
            assert len({SP.effective(spec, kernel, kn) for kn in got}) == len(got)
        wide = ConvSpec(N=1, H=56, W=56, C=64, K=256, R=3, S=3, padding=1, **_U8)  # (nothing clamped)
        assert len(SP.configs(wide, kernel)) == len(CPU_CONFIGS[cpu_conv.REGS[kernel]])


def test_illegal_points_are_refused_before_building():
    """The builders refuse what the space refuses, with its reason, before any TIR (the tuner's builder too)."""
    from qcompile.tune.build import plan_candidate
    from qcompile.tune.common import Candidate

    rng = random.Random("cpu-refused")
    found = 0
    while found < 12:
        kernel, spec = rng.choice(X86), rng.choice(list(SHAPES.values()))
        kn = CpuKnobs(rng.choice(SP.dims["qt"]), rng.choice(SP.dims["kt"]))
        why = SP.legal(spec, kernel, kn)
        if why is None:
            continue
        found += 1
        with pytest.raises(ValueError) as e:
            if kernel == "cpu_direct_avx2":
                cpu_conv.make_cpu_conv(spec, "NHWC", kn)
            else:
                cpu_conv_vnni.make_cpu_conv_vnni(spec, "NHWC", cpu_conv_vnni.VnniTile(kernel, kn.qt, kn.kt))
        assert why in str(e.value) or ("at least 1" in str(e.value) and 0 in (kn.qt, kn.kt)), (kernel, kn, e.value)
        with pytest.raises(ValueError) as e:
            plan_candidate(Candidate(tuning_key(spec), spec, kernel, "cpu_direct", kn), "llvm")
        assert str(e.value) == f"not applicable: {why}"


def test_legal_points_build_and_are_bit_exact_on_this_cpu(tmp_path):
    """A seeded sample of legal points (the sampler's) of every kernel this host runs, on three small shapes (padding,
    odd C and K, a residual add with 4-bit weights, stride and dilation with an int32 output): each builds for the
    CPU (the tuner's builder, target llvm) and the local runner finds it bit-exact against the NumPy reference. A
    candidate whose bias fold is wrong is a mismatch (the check can fail)."""
    kernels = _host_kernels()
    if not kernels:
        pytest.skip("no x86-64 AVX2 CPU here: the CPU kernels do not run")
    from qcompile.tune.build import LocalBuilder
    from qcompile.tune.common import Candidate
    from qcompile.tune.runners import LocalRunner

    rng = random.Random("cpu-builds")
    cands = []
    for kernel in kernels:
        for name in ("3x3_pad_odd_u8", "1x1_i8_w4_res", "s2_dil_i32"):
            spec = SHAPES[name]
            for kn in [SP.default(spec, kernel)] + [SP.sample(rng, spec, kernel) for _ in range(2)]:
                assert kn is not None and SP.legal(spec, kernel, kn) is None
                cands.append(Candidate(tuning_key(spec), spec, kernel, "cpu_direct", kn))
    builder = LocalBuilder(jobs=1, target="llvm", build_dir=str(tmp_path / "b"))
    built = builder.build(cands)
    assert [b.error for b in built] == [None] * len(cands)
    for b in built:
        assert b.entry["effective_knobs"] == cpu_conv.effective_tile(b.candidate.spec, b.candidate.arch,
                                                                       b.candidate.knobs).__dict__
    runner = LocalRunner(device="cpu", repeat=1, min_repeat_ms=0)
    got = runner.measure(built)
    bad = [(m.candidate.arch, m.candidate.spec.K, m.candidate.knobs, m.status, m.detail) for m in got
           if m.status != "ok" or not m.ms > 0]
    assert not bad, bad
    # the same kernel with the bias fold left out of its weights' description: the reference catches it
    flip = next(b for b in built if b.entry["w_cpu"].get("bias_fold"))
    flip.entry = json.loads(json.dumps(flip.entry))
    flip.entry["w_cpu"]["bias_fold"] = 0
    assert runner.measure([flip])[0].status == "mismatch"


@pytest.mark.parametrize("kernel", CPU_KERNELS)
def test_measure_packs_the_weights_as_the_compiler_does(kernel):
    """``qcompile.tune.measure.cpu_weights`` (NumPy only, the runner's side) equals the dispatcher's packing and bias
    fold (``cpu_conv.pack_weights``, ``cpu_conv_vnni.prepack``), for signed and unsigned inputs, odd K and C."""
    import numpy as np

    from qcompile.tune.build import _plan_cpu
    from qcompile.tune.common import Candidate
    from qcompile.tune.measure import cpu_weights

    rng = np.random.default_rng(1)
    for spec in (SHAPES["3x3_pad_odd_u8"], SHAPES["1x1_i8_w4_res"]):
        w = rng.integers(-8 if spec.w_bits == 4 else -128, 8 if spec.w_bits == 4 else 128,
                         (spec.K, spec.R, spec.S, spec.C))
        bias = rng.integers(-(1 << 31), 1 << 31, spec.K)
        if kernel == "cpu_direct_avx2":
            want_w, want_b = cpu_conv.pack_weights(w), bias.astype(np.int32)
        else:
            want_w, want_b = cpu_conv_vnni.prepack(spec, w, bias, kernel)
        if kernel == "cpu_direct_sdot":  # (no aarch64 build here: its entry's packing, as _plan_cpu writes it)
            flip = cpu_conv_vnni.flips_input(spec, kernel)
            w_cpu = dict(pack="quads", lanes=4, bias_fold=(128 if spec.x_dtype == "uint8" else -128) if flip else 0)
        else:
            w_cpu = _plan_cpu(Candidate(tuning_key(spec), spec, kernel, "cpu_direct", CpuKnobs()))[1]["w_cpu"]
        got_w, got_b = cpu_weights(w, bias, w_cpu)
        assert got_w.dtype == want_w.dtype and np.array_equal(got_w, want_w), kernel
        assert np.array_equal(got_b, want_b), kernel
