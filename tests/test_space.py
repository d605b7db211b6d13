"""The tuning spaces' legality (``schedules.space.KernelSpace.legal``) is total and is the builders' own decision.

* Total: for points drawn uniformly from each space's flat ``dims`` (most of them illegal, many in corners no sampler
  reaches), the sampler's points with one to three dimensions redrawn (near-legal points, which reach the plan's late
  checks), and the sampler's own points, over conv shapes of every kind (ResNet layers, odd and few channels, 4-bit,
  residual adds, HWNC, batch 1 to 256, strides, dilation, a padding value) and sm_75 / sm_80 / sm_86 / sm_89 / sm_90,
  ``legal`` returns None or a reason, quickly: it never hangs and never raises. ``effective`` and ``features`` take
  the same points, and a legal point's effective knobs are legal.
* Agrees with the builders: a seeded sample of legal points builds (TIR and TVM's CUDA codegen, nvcc not run; two of
  them through nvcc under the ``nvcc`` marker) for sm_90 and sm_75; an illegal point is refused by its kernel
  builder with the reason ``legal`` gives, before any TIR is built.
"""
from __future__ import annotations

import contextlib
import random
import signal
import threading
import time
import warnings

import pytest

from qcompile.schedules import GemmKnobs, plan_conv
from qcompile.schedules.space import SPACES, gemm_family
from qcompile.schedules.spec import ConvSpec, space_to_depth
from qcompile.schedules.tuning import spec_from_key

ARCHS = ("sm_75", "sm_80", "sm_86", "sm_89", "sm_90")
CALL_S = 1.0  # the longest one legality (effective, features) call may take; tens of microseconds is typical
HANG_S = 5.0  # a call still running after this is stopped and reported as a hang

_U8 = dict(x_dtype="uint8", out_dtype="uint8", lo=0, hi=255)
_U4 = dict(x_dtype="uint4", w_bits=4, out_dtype="uint4", lo=0, hi=15)
_RES8 = dict(has_residual=True, res_dtype="uint8", lo=-128, hi=127, lo2=0, hi2=255)
_L4 = "NHWC|N8|H7|W7|C512|K512|R3|S3|st1,1|pad1,1,1,1|dil1,1|x8|w8|res"  # the layer of the two tuner reports

SHAPES = {
    "r50_l4_3x3_res_n8": spec_from_key(_L4),
    "r50_l4_3x3_res_n256": spec_from_key(_L4.replace("N8", "N256")),
    "r50_l4_3x3_u4_n64": ConvSpec(N=64, H=7, W=7, C=512, K=512, R=3, S=3, padding=1, **_U4),
    "r50_l3_3x3_u4_n32": ConvSpec(N=32, H=14, W=14, C=256, K=256, R=3, S=3, padding=1, **_U4),
    "r50_l1_1x1_n1": ConvSpec(N=1, H=56, W=56, C=64, K=64, R=1, S=1, **_U8),
    "r50_l3_1x1_res_u4_n256": spec_from_key("NHWC|N256|H14|W14|C256|K1024|R1|S1|st1,1|pad0,0,0,0|dil1,1|x4|w4|res"),
    "r50_l2_1x1_s2_n16": ConvSpec(N=16, H=56, W=56, C=256, K=512, R=1, S=1, stride=2, **{**_U8, **_RES8}),
    "odd_c24_k40_n3": ConvSpec(N=3, H=17, W=17, C=24, K=40, R=3, S=3, padding=1, **_U8),
    "odd_c6_k10_u4": ConvSpec(N=3, H=17, W=17, C=6, K=10, R=3, S=3, padding=1, **_U4),
    "odd_c72_k24_s2": ConvSpec(N=8, H=11, W=11, C=72, K=24, R=3, S=3, stride=2, padding=1, **_U8),
    "dilated_c32_k48": ConvSpec(N=4, H=20, W=20, C=32, K=48, R=3, S=3, dilation=2, padding=2, **_U8),
    "pad_value_5": ConvSpec(N=4, H=28, W=28, C=128, K=128, R=3, S=3, padding=1, pad_value=5, **_U8),
    "i8_to_i32_k7": ConvSpec(N=2, H=9, W=9, C=40, K=7, R=3, S=3, padding=1, x_dtype="int8", out_dtype="int32",
                             lo=-(1 << 31), hi=(1 << 31) - 1),
    "stem_c3_7x7_s2": ConvSpec(N=1, H=224, W=224, C=3, K=64, R=7, S=7, stride=2, padding=3, **_U8),
    "stem_s2d_n8": space_to_depth(ConvSpec(N=8, H=224, W=224, C=4, K=64, R=7, S=7, stride=2, padding=3, **_U8)),
    "stem_s2d_n256_u4out": space_to_depth(ConvSpec(N=256, H=224, W=224, C=4, K=64, R=7, S=7, stride=2, padding=3,
                                                   **dict(_U8, out_dtype="uint4", hi=15))),
    "hwnc_u8_n32": ConvSpec(N=32, H=14, W=14, C=256, K=256, R=3, S=3, padding=1, layout="HWNC", **_U8),
    "hwnc_u4_n16_res": ConvSpec(N=16, H=14, W=14, C=128, K=64, R=3, S=3, padding=1, layout="HWNC", **_U4,
                                has_residual=True, res_dtype="uint4", lo2=0, hi2=15),
    "w4_x8_mixed": ConvSpec(N=2, H=9, W=9, C=16, K=24, R=3, S=3, padding=1, x_dtype="uint8", w_bits=4),
}


class _Hang(Exception):
    pass


@contextlib.contextmanager
def _deadline(seconds: float, what):
    """Raise ``_Hang`` in the main thread once ``seconds`` have passed (elsewhere: no deadline, the time check stays)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def fire(*_):
        raise _Hang(f"still running after {seconds} s: {what()}")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _uniform(rng, sp):
    return sp.knobs_type(**{k: rng.choice(v) for k, v in sp.dims.items()})


def _mutant(rng, sp, spec, arch):
    """A sampler draw (the defaults where the strategy does not apply) with one to three dimensions redrawn."""
    kn = sp.draw(rng, spec, arch) if sp.applies(spec, arch) is None else sp.knobs_type()
    for _ in range(rng.randrange(1, 4)):
        f = rng.choice(list(sp.dims))
        kn = kn.replace(**{f: rng.choice(sp.dims[f])}) if hasattr(kn, "replace") else type(kn)(
            **{**sp.to_dict(kn), f: rng.choice(sp.dims[f])})
    return kn


def _points(rng, sp, n_uniform: int, n_mutant: int, n_sampled: int):
    """(spec name, arch, knobs) points of ``sp``: uniform over the flat dims, mutants, the sampler's."""
    names = list(SHAPES)
    for _ in range(n_uniform):
        yield rng.choice(names), rng.choice(ARCHS), _uniform(rng, sp)
    for _ in range(n_mutant):
        name, arch = rng.choice(names), rng.choice(ARCHS)
        yield name, arch, _mutant(rng, sp, SHAPES[name], arch)
    applicable = [(n, a) for n in names for a in ARCHS if sp.applies(SHAPES[n], a) is None]
    for _ in range(n_sampled):
        name, arch = rng.choice(applicable)
        kn = sp.sample(rng, SHAPES[name], arch, tries=200)
        if kn is not None:
            yield name, arch, kn


def _check_total(sp, name, arch, kn, sms=None):
    """legal (and, where the strategy applies, effective and features) on one point: the result, checked."""
    spec = SHAPES[name]
    t = time.perf_counter()
    with _deadline(HANG_S, lambda: (sp.strategy, name, arch, kn, sms)):
        why = sp.legal(spec, arch, kn, sms)
        applies = sp.applies(spec, arch) is None
        if applies:
            eff = sp.effective(spec, arch, kn, sms)
            feats = sp.features(spec, arch, kn, sms)
    dt = time.perf_counter() - t
    assert why is None or (isinstance(why, str) and why), (sp.strategy, name, arch, kn, why)
    assert dt < CALL_S, f"{dt:.2f} s for {(sp.strategy, name, arch, kn)}"
    if applies:
        assert len(feats) == len(sp.feature_names()) and all(isinstance(v, float) for v in feats)
        if why is None:
            assert isinstance(eff, sp.knobs_type) and sp.legal(spec, arch, eff, sms) is None, (name, arch, kn, eff)
    return why


# (the CPU kernels' space: tests/test_cpu_space.py; the grouped convs' spaces: GROUPED_SHAPES, at the end)
GPU_SPACES = [s for s in SPACES if s not in ("cpu_direct", "depthwise", "grouped", "grouped_gemm")]  # (grouped_gemm:
#                                                                             tests/test_grouped_gemm.py, grouped shapes)


@pytest.mark.parametrize("strategy", GPU_SPACES)
def test_legal_is_total(strategy):
    """Every point of the space's dims (GemmKnobs: a seeded uniform draw; KtKnobs, HaloKnobs: all of them) on every
    shape and arch gets None or a reason, each within CALL_S; both answers occur, on points of every source."""
    sp = SPACES[strategy]
    rng = random.Random(f"total-{strategy}")
    if sp.knobs_type is GemmKnobs:
        pts = list(_points(rng, sp, 20000, 8000, 150))
    else:  # small spaces: every point, on every shape and arch
        import itertools

        grid = [sp.knobs_type(**dict(zip(sp.dims, v))) for v in itertools.product(*sp.dims.values())]
        pts = [(n, a, kn) for kn in grid for n in SHAPES for a in ARCHS]
    legal = sum(_check_total(sp, *p) is None for p in pts)
    assert 0 < legal < len(pts), (legal, len(pts))
    if sp.knobs_type is GemmKnobs:  # (the sampled points are legal, so the uniform and mutant ones must be too)
        assert legal > 150 + 100, legal


def test_legal_total_with_device_sms():
    """The device's SM count (``sms``) enters legality (persistent grids, split-K, automatic pixel tiles): still total
    for SM counts the arch table does not list."""
    for strategy in GPU_SPACES:
        sp = SPACES[strategy]
        rng = random.Random(f"sms-{strategy}")
        for name, arch, kn in _points(rng, sp, 300, 300, 30):
            _check_total(sp, name, arch, kn, sms=rng.choice((1, 7, 16, 46, 114, 170)))


def test_tuner_reports_fixed():
    """The two points the tuner hit on sm_90 (ResNet-50's l4 3x3 conv with its residual add): adapt_knobs looped for
    ever on a 112-column tile over four 32-column warps (three after shrinking: an odd thread count no power-of-two
    tile splits into whole vectors), and the epilogue asserted on a 112-column warp tile with 16-column lanes. Both
    are refused, with reasons the builder gives too."""
    from qcompile.schedules.gemm.plan import NotApplicable, adapt_knobs
    from qcompile.schedules.igemm import make_gemm_conv

    sp = SPACES["implicit_gemm"]
    hang = GemmKnobs(BM=64, BN=112, BK=128, WM=4, WN=4, stages=3, vec=16, ev=4, pipe=0, fdb=True, mma="sync", minb=4)
    asserted = GemmKnobs(BM=64, BN=112, BK=64, WM=2, WN=1, stages=3, vec=8, ev=16, pipe=1, split_k=8, mma="sync")
    for name in ("r50_l4_3x3_res_n8", "r50_l4_3x3_res_n256"):
        spec = SHAPES[name]
        with _deadline(HANG_S, lambda: ("adapt_knobs", name, hang)):
            a = adapt_knobs(spec, hang, "NHWC")
        assert (a.WM, a.WN) == (2, 2) and a.BK == hang.BK  # (powers of two; the tile is then refused by ``valid``)
        for kn, want in ((hang, "invalid knobs"), (asserted, "epilogue")):
            why = _check_total(sp, name, "sm_90", kn)
            assert why and want in why, why
            with pytest.raises(NotApplicable) as e:
                make_gemm_conv(spec, "sm_90", kn, allow_split=True)
            assert str(e.value) == why
    # the same tile with lanes of 8 columns (112 = 7 x 16: 16 rows x 112 columns are 7 rounds of 32 lanes x 8) builds
    assert sp.legal(SHAPES["r50_l4_3x3_res_n8"], "sm_90", asserted.replace(ev=8)) is None


# ---- agreement with the builders ----------------------------------------------------------------------------------
def _legal_points():
    """12 seeded legal points (strategy, spec name, arch, knobs): sm_90 and sm_75, every strategy, the sampler's
    points, its mutants and uniform draws."""
    plan = [("implicit_gemm", "r50_l4_3x3_res_n8", "sm_90", "sample"),
            ("implicit_gemm", "r50_l4_3x3_u4_n64", "sm_90", "sample"),
            ("implicit_gemm", "r50_l3_1x1_res_u4_n256", "sm_90", "sample"),
            ("implicit_gemm", "odd_c24_k40_n3", "sm_90", "mutant"),
            ("implicit_gemm", "dilated_c32_k48", "sm_75", "sample"),
            ("implicit_gemm", "r50_l2_1x1_s2_n16", "sm_75", "mutant"),
            ("implicit_gemm", "odd_c6_k10_u4", "sm_75", "sample"),
            ("direct_hwnc", "hwnc_u4_n16_res", "sm_90", "sample"),
            ("direct_hwnc", "hwnc_u8_n32", "sm_75", "mutant"),
            ("implicit_gemm_t", "r50_l4_3x3_u4_n64", "sm_90", "uniform"),
            ("implicit_gemm_t", "r50_l3_3x3_u4_n32", "sm_90", "sample"),
            ("direct_halo", "stem_s2d_n256_u4out", "sm_90", "uniform")]
    rng = random.Random("builds")
    out = []
    for strategy, name, arch, how in plan:
        sp, spec = SPACES[strategy], SHAPES[name]
        with _deadline(4 * HANG_S, lambda: (strategy, name, arch, how)):
            if how == "sample":
                kn = sp.sample(rng, spec, arch)
            else:  # (the flat GemmKnobs space has a legal point in thousands: mutants of the sampler's instead)
                draw = (lambda: _uniform(rng, sp)) if how == "uniform" else (lambda: _mutant(rng, sp, spec, arch))
                kn = next((k for k in (draw() for _ in range(20000)) if sp.legal(spec, arch, k) is None), None)
        assert kn is not None, (strategy, name, arch, how)
        out.append((strategy, name, arch, kn))
    return out


def _build(strategy, spec, arch, kn):
    """plan_conv's kernels for the point (no substitute kernel: the wgmma fallback's warning is an error)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return plan_conv(spec, arch, strategy, kn)


def test_legal_points_build():
    """Every point of a seeded sample of legal ones builds for its arch (TIR and TVM's CUDA codegen; nvcc not run),
    with the effective knobs ``effective`` predicts."""
    from test_kernel_identity import cuda_source

    for strategy, name, arch, kn in _legal_points():
        spec = SHAPES[name]
        pk = _build(strategy, spec, arch, kn)
        assert pk.strategy == strategy and pk.knobs == SPACES[strategy].effective(spec, arch, kn)
        for f in pk.funcs:
            src = cuda_source(f, arch)
            assert "__global__" in src, (strategy, name, arch, kn)


def _illegal_points(n: int):
    """``n`` seeded illegal points (strategy, spec name, arch, knobs, reason) of strategies that take the shape."""
    rng = random.Random("refused")
    out, seen = [], {}
    while len(out) < n:
        strategy = rng.choice(list(SPACES))
        sp = SPACES[strategy]
        name, arch = rng.choice(list(SHAPES)), rng.choice(ARCHS)
        if sp.applies(SHAPES[name], arch) is not None:
            continue
        kn = _uniform(rng, sp) if rng.random() < 0.5 else _mutant(rng, sp, SHAPES[name], arch)
        with _deadline(HANG_S, lambda: (strategy, name, arch, kn)):
            why = sp.legal(SHAPES[name], arch, kn)
        if why is not None:
            out.append((strategy, name, arch, kn, why))
            seen[strategy] = seen.get(strategy, 0) + 1
    assert len(seen) >= 3, seen
    return out


class _NoTIR:
    """Stands in for a builder's TVMScript module / kernel builder: touching it means TIR was about to be built."""

    def __getattr__(self, name):
        raise AssertionError(f"TIR built for a point legal() refuses (T.{name})")

    def __call__(self, *a, **k):
        raise AssertionError("TIR built for a point legal() refuses")


def test_illegal_points_refused_before_building(monkeypatch):
    """An illegal point is refused by its kernel builder (``make_gemm_conv``: NotApplicable; ``make_kt_conv`` /
    ``make_halo_conv``: ValueError) with exactly ``legal``'s reason, before any TIR is built; plan_conv gives no
    kernel of the point either (an error, or -- wgmma knobs on the implicit GEMM -- the mma.sync defaults with a
    warning naming the reason)."""
    from qcompile.schedules import igemm, igemm_t, stem
    from qcompile.schedules.gemm.plan import NotApplicable

    monkeypatch.setattr(igemm, "build_kernel", _NoTIR())
    monkeypatch.setattr(igemm_t, "T", _NoTIR())
    monkeypatch.setattr(stem, "T", _NoTIR())
    pts = _illegal_points(400)
    for strategy, name, arch, kn, why in pts:
        spec = SHAPES[name]
        if strategy in ("implicit_gemm", "direct_hwnc"):
            with pytest.raises(NotApplicable) as e:
                igemm.make_gemm_conv(spec, arch, kn, allow_split=True)
        else:
            build = igemm_t.make_kt_conv if strategy == "implicit_gemm_t" else stem.make_halo_conv
            with pytest.raises(ValueError) as e:
                build(spec, arch, kn)
        assert str(e.value) == why, (strategy, name, arch, kn)
    for strategy, name, arch, kn, why in pts[:15]:  # (plan_conv builds the substitute: a few)
        spec = SHAPES[name]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                pk = plan_conv(spec, arch, strategy, kn)
            except (ValueError, AssertionError):
                continue
        assert pk.knobs != kn and any(why in str(w.message) for w in caught), (strategy, name, arch, kn)


def test_device_sms_decides_legality_and_build():
    """``sms`` reaches legality and the builder alike: on ResNet-50's l4 3x3 conv at batch 64 the automatic pixel tile
    of implicit_gemm_t is 96 for the H100 SXM's 132 SMs and 112 for the PCIe part's 114, where 8 stages of it exceed
    the shared memory: legal for one, refused (same reason) by the builder for the other."""
    from qcompile.schedules.igemm_t import KtKnobs, make_kt_conv

    sp = SPACES["implicit_gemm_t"]
    spec = ConvSpec(N=64, H=7, W=7, C=512, K=512, R=3, S=3, padding=1, **_U8)
    kn = KtKnobs(stages=8)
    assert sp.legal(spec, "sm_90", kn) is None and sp.legal(spec, "sm_90", kn, sms=132) is None
    why = sp.legal(spec, "sm_90", kn, sms=114)
    assert why and "KiB" in why
    assert sp.effective(spec, "sm_90", kn, sms=114).bn == 112 and sp.effective(spec, "sm_90", kn).bn == 96
    with pytest.raises(ValueError) as e:
        make_kt_conv(spec, "sm_90", kn, sms=114)
    assert str(e.value) == why
    with pytest.raises(ValueError):
        plan_conv(spec, "sm_90", "implicit_gemm_t", kn, sms=114)
    assert plan_conv(spec, "sm_90", "implicit_gemm_t", kn).knobs.bn == 96
    assert sp.sample(random.Random(0), spec, "sm_90", sms=114, stages=8, bn=0) is None  # (sample honours sms)
    assert sp.sample(random.Random(0), spec, "sm_90", sms=132, stages=8, bn=0) is not None


@pytest.mark.nvcc
def test_legal_points_compile_with_nvcc():
    """Three of the legal points (implicit GEMM wgmma for sm_90 and mma.sync for sm_75, implicit_gemm_t) through nvcc
    and ptxas."""
    from qcompile.schedules.build import build_cuda, cuda_source

    pts = _legal_points()
    pick = [next(p for p in pts if p[0] == "implicit_gemm" and p[2] == "sm_90" and p[3].mma == "wgmma"),
            next(p for p in pts if p[0] == "implicit_gemm" and p[2] == "sm_75"),
            next(p for p in pts if p[0] == "implicit_gemm_t")]
    for strategy, name, arch, kn in pick:
        for f in _build(strategy, SHAPES[name], arch, kn).funcs:
            assert "__global__" in cuda_source(build_cuda(f, arch, mode="sass"))


def test_sampled_families_cover_the_shapes():
    """The points the totality test draws reach the plan's late checks: each gemm family the shapes take has legal
    points among them (the fuzz is not only early refusals)."""
    from qcompile.schedules.space import gemm_families

    sp = SPACES["implicit_gemm"]
    rng = random.Random("families")
    fams = set()
    for name, arch, kn in _points(rng, sp, 0, 3000, 0):
        if _check_total(sp, name, arch, kn) is None:
            fams.add(gemm_family(kn, SHAPES[name].x_bits))
    want = set(gemm_families(SHAPES["r50_l4_3x3_u4_n64"], "sm_90")) | set(gemm_families(SHAPES["r50_l4_3x3_res_n8"],
                                                                                         "sm_90"))
    assert len(fams & want) >= len(want) - 2, (sorted(want - fams))


def test_ping_pong_takes_k_chunks_of_64_bytes_or_more():
    """The 8-bit ping-pong kernel with 32-byte K-chunks hung on the H100 (qtune, ResNet-50 layer1 downsample at batch
    256, BM=BN=64 BK=32 pipe 1: run_error after 120 s; the same kernel with BK 64 ran exact; 4-bit ping-pong kernels
    with 32 packed bytes per chunk ran exact in earlier measurements): the space refuses it. (That point also had
    minb=2, which hangs pp on its own: ``test_ping_pong_points_need_one_block_per_sm``.)"""
    from qcompile.schedules import ConvSpec, GemmKnobs
    from qcompile.schedules.space import SPACES

    spec = ConvSpec(N=256, H=56, W=56, C=256, K=512, R=1, S=1, stride=2, x_dtype="uint8", out_dtype="uint8", lo=0,
                    hi=255)
    kn = GemmKnobs(BM=64, BN=64, BK=32, WM=1, WN=1, stages=4, vec=16, ev=4, pipe=1, split_k=1, mma="wgmma", minb=2,
                   erq=True, pp=True)
    assert SPACES["implicit_gemm"].legal(spec, "sm_90", kn) is not None
    assert "minb <= 1" in SPACES["implicit_gemm"].legal(spec, "sm_90", kn.replace(BK=64))
    assert SPACES["implicit_gemm"].legal(spec, "sm_90", kn.replace(BK=32, minb=0)) is not None
    assert SPACES["implicit_gemm"].legal(spec, "sm_90", kn.replace(BK=64, minb=0)) is None


def test_points_that_broke_the_h100_reliability_run_are_refused():
    """Two legal points of the 1,000-shape reliability run on the H100 that did not build: an m64n96 wgmma kernel
    under launch bounds that leave it 40 registers per thread (ptxas C7602: it needs 74), and a one-warp 256x256
    mma.sync tile (2048 accumulators per thread: no build within 90 s). The space refuses both, with the reason."""
    sp = SPACES["implicit_gemm"]
    s620 = ConvSpec(N=18, H=46, W=46, C=288, K=384, R=1, S=1, x_dtype="int4", w_bits=4, out_dtype="int32", zo=-49,
                    lo=-(1 << 31), hi=(1 << 31) - 1)
    k620 = GemmKnobs(BM=128, BN=96, BK=32, WM=2, WN=1, stages=4, vec=16, ev=16, pipe=0, split_k=8, mma="wgmma",
                     pstages=3, minb=4, wsp=1)
    assert "40 registers per thread" in sp.legal(s620, "sm_90", k620, 132)
    assert sp.legal(s620, "sm_90", k620.replace(minb=0), 132) is None
    s520 = ConvSpec(N=7, H=40, W=40, C=14, K=352, R=7, S=7, padding=3, x_dtype="uint4", w_bits=4, out_dtype="uint4",
                    lo=0, hi=15, pad_value=10, has_residual=True, res_dtype="int4", zo2=-2, lo2=-8, hi2=7)
    k520 = GemmKnobs(BM=256, BN=256, BK=32, WM=1, WN=1, stages=2, vec=4, ev=8, pipe=0, fdb=True, split_k=1)
    assert "2048 accumulators per thread" in sp.legal(s520, "sm_90", k520, 132)
    # (and from the second run: a 64x256 warp tile, 512 accumulators per thread, did not build in 60 s)
    s270 = ConvSpec(N=17, H=30, W=30, C=93, K=384, R=2, S=2, stride=2, padding=(0, 2, 2, 1), x_dtype="uint8",
                    out_dtype="int8", zo=-9, lo=-128, hi=127, pad_value=37, has_residual=True, res_dtype="int8", zo2=9,
                    lo2=-128, hi2=127)
    k270 = GemmKnobs(BM=128, BN=256, BK=64, WM=2, WN=1, stages=3, vec=16, ev=8, pipe=1, split_k=0, mma="sync", minb=2,
                     erq=True)
    assert "512 accumulators per thread" in sp.legal(s270, "sm_90", k270, 132)
    assert sp.legal(s270, "sm_90", k270.replace(WN=4), 132) is None


def test_ping_pong_points_need_one_block_per_sm():
    """The pool of the XGBoost / random ablation on an H200 (ResNet-50 at batch 64) held a legal pp point that hung
    until the runner's 120 s timeout: ping-pong with minb=2. pp's setmaxnreg gives its consumers 224 registers out of
    the block's own allocation, which launch bounds of two blocks per SM cap at 85 a thread (the 24 such points of
    the H100 / H200 logs: ptxas refused 20, 4 hung). The space refuses pp with minb >= 2, takes it with minb 0 or 1."""
    sp = SPACES["implicit_gemm"]
    s = ConvSpec(N=64, H=56, W=56, C=256, K=64, R=1, S=1, x_dtype="int8", out_dtype="int8", lo=-128, hi=127)
    kn = GemmKnobs(BM=128, BN=128, BK=64, WM=1, WN=1, stages=2, vec=16, ev=4, pipe=-1, split_k=0, mma="wgmma",
                   minb=2, pp=True)
    assert "minb <= 1" in sp.legal(s, "sm_90", kn, 132)
    for m in (3, 4):
        assert "minb <= 1" in sp.legal(s, "sm_90", kn.replace(minb=m), 132)
    for m in (0, 1):
        assert sp.legal(s, "sm_90", kn.replace(minb=m), 132) is None
    # (4-bit: the register-A ping-pong kernel with expanded weights, and the one whose producer unpacks)
    s4 = ConvSpec(N=64, H=56, W=56, C=256, K=64, R=1, S=1, x_dtype="int4", w_bits=4, out_dtype="int8", lo=-128,
                  hi=127)
    for k4 in (GemmKnobs(BM=128, BN=64, BK=64, WM=1, WN=1, stages=3, pstages=3, vec=16, ev=8, pipe=-1, split_k=0,
                         mma="wgmma", pp=True, areg=True, w8=True),
               GemmKnobs(BM=128, BN=64, BK=64, WM=1, WN=1, stages=3, pstages=3, vec=16, ev=8, pipe=-1, split_k=0,
                         mma="wgmma", pp=True)):
        assert sp.legal(s4, "sm_90", k4, 132) is None
        for m in (2, 3):
            assert "minb <= 1" in sp.legal(s4, "sm_90", k4.replace(minb=m), 132)
    import numpy as np

    rng = np.random.default_rng(0)
    drawn = [sp.sample(rng, s, "sm_90") for _ in range(400)]
    assert not [k for k in drawn if k is not None and k.pp and k.minb > 1]


def test_mma_sync_tiles_fit_the_shared_memory_of_a_block():
    """A point of the 2-H100 rpc run (ResNet-50 at batch 32) built and failed at launch ("Failed to set the allowed
    dynamic shared memory size to 276480"): an mma.sync 256x128x128 tile with 5 stages. The space refuses it for the
    227 KiB of an sm_90 block and takes a 3-stage ring of it (with warp tiles under the register file); the defaults
    of the mma.sync archs (sm_75: 64 KiB per block) fit."""
    sp = SPACES["implicit_gemm"]
    s = ConvSpec(N=32, H=56, W=56, C=256, K=512, R=1, S=1, stride=2, x_dtype="int8", out_dtype="int8", lo=-128, hi=127)
    k = GemmKnobs(BM=256, BN=128, BK=128, WM=4, WN=1, stages=5, vec=8, ev=8, pipe=0, split_k=8, mma="sync", minb=2)
    assert "KiB of shared tiles exceed the 227 KiB per block of sm_90" in sp.legal(s, "sm_90", k, 132)
    assert sp.legal(s, "sm_90", k.replace(stages=3, WN=2), 132) is None
    for arch in ("sm_75", "sm_80", "sm_86", "sm_89"):
        assert sp.legal(s, arch, sp.default(s, arch)) is None, arch


def test_invalid_knobs_say_which_rule():
    """``GemmKnobs.why_invalid`` names the rule a point breaks (the builder's refusal carries it); valid() is its
    absence."""
    ok = GemmKnobs(BM=128, BN=128, BK=64, WM=2, WN=1, stages=4, vec=16, mma="wgmma")
    assert ok.valid() and ok.why_invalid() is None
    for kn, want in ((GemmKnobs(areg=True, pstages=3), "mma.sync takes none of the wgmma loader knobs"),
                     (ok.replace(BN=160), "wgmma: a warpgroup tile 160 wide"),
                     (ok.replace(stages=2, pipe=0), "stages >= 3 + pipe"),
                     (ok.replace(BK=48), "BK 48 is no multiple of 32")):
        assert not kn.valid() and want in kn.why_invalid(), kn.why_invalid()
    spec = SHAPES["r50_l4_3x3_res_n8"]
    assert "stages >= 3 + pipe" in SPACES["implicit_gemm"].legal(spec, "sm_90", ok.replace(stages=2, pipe=0))


def test_start_points_are_points_of_the_space_and_build():
    """Every entry of the start-point table is a point of the GemmKnobs dimensions; ``configs`` gives each shape of
    the table on each arch at least three legal start points of distinct kernels, and those build (TIR and TVM's
    CUDA codegen) with the knobs ``effective`` predicts."""
    from test_kernel_identity import cuda_source

    from qcompile.schedules.space import GEMM_CONFIGS

    sp = SPACES["implicit_gemm"]
    for group in GEMM_CONFIGS.values():
        for d in group:
            kn = GemmKnobs(**d)
            assert all(getattr(kn, k) in v for k, v in sp.dims.items()), (d, [k for k, v in sp.dims.items()
                                                                              if getattr(kn, k) not in v])
    built = 0
    for name, spec in SHAPES.items():
        for arch in ARCHS:
            if sp.applies(spec, arch) is not None:
                continue
            cfgs = sp.configs(spec, arch)
            effs = [sp.effective(spec, arch, kn) for kn in cfgs]
            assert len(cfgs) >= 3 and len(set(effs)) == len(effs), (name, arch, cfgs)
            if built < 6:  # (a few builds: the legality agreeing with the builder is test_legal_points_build's)
                kn = cfgs[built % len(cfgs)]
                pk = _build("implicit_gemm", spec, arch, kn)
                assert pk.knobs == sp.effective(spec, arch, kn)
                assert all("__global__" in cuda_source(f, arch) for f in pk.funcs)
                built += 1


# ---- the grouped convs' CUDA-core kernels: depthwise (DwConfig) and grouped (GroupedConfig) -----------------------
_GU8 = dict(x_dtype="uint8", out_dtype="uint8", zo=3, lo=0, hi=255)
GROUPED_SHAPES = {
    "dw_mbv2_112x32": ConvSpec(N=1, H=112, W=112, C=32, K=32, R=3, S=3, padding=1, groups=32, **_GU8),
    "dw_mbv2_14x576_b8": ConvSpec(N=8, H=14, W=14, C=576, K=576, R=3, S=3, padding=1, groups=576, **_GU8),
    "dw_5x5_s2_i8": ConvSpec(N=2, H=28, W=28, C=72, K=72, R=5, S=5, stride=2, padding=2, groups=72, x_dtype="int8",
                             out_dtype="int8", lo=-128, hi=127, pad_value=-7),
    "dw_c30_bytes": ConvSpec(N=1, H=13, W=13, C=30, K=30, R=3, S=3, padding=1, groups=30, **_GU8),
    "dw_u4_out_res": ConvSpec(N=2, H=10, W=10, C=32, K=32, R=3, S=3, padding=1, groups=32, x_dtype="uint8", w_bits=4,
                              out_dtype="uint4", lo=0, hi=15, has_residual=True, res_dtype="uint4", lo2=0, hi2=15),
    "gr_rx50_56x128": ConvSpec(N=1, H=56, W=56, C=128, K=128, R=3, S=3, padding=1, groups=32, **_GU8),
    "gr_rx50_7x1024_b16": ConvSpec(N=16, H=7, W=7, C=1024, K=1024, R=3, S=3, padding=1, groups=32, **_GU8),
    "gr_cg3_kg5_dil": ConvSpec(N=2, H=11, W=11, C=12, K=20, R=3, S=3, padding=2, dilation=2, groups=4, **_GU8),
    "gr_mult2_u4out": ConvSpec(N=1, H=9, W=9, C=16, K=32, R=3, S=3, padding=1, groups=16, x_dtype="int8",
                               out_dtype="int4", lo=-8, hi=7),
}
GROUPED_SPACES = ("depthwise", "grouped")


def _grouped_grid(sp):
    import itertools

    return [sp.knobs_type(**dict(zip(sp.dims, v))) for v in itertools.product(*sp.dims.values())]


@pytest.mark.parametrize("strategy", GROUPED_SPACES)
def test_grouped_spaces_legal_is_total(strategy, monkeypatch):
    """Every point of the depthwise / grouped space on every grouped shape and arch (and a few device SM counts) gets
    None or a reason quickly; both answers occur; legal points' effective tiles are legal; the space applies exactly
    where the dispatch puts the layer on its kernel (``grouped_strategy``), and no other space applies there."""
    from qcompile.schedules.grouped import grouped_strategy
    from qcompile.schedules.space import spaces_for

    import sys

    plain = dict(SHAPES)
    monkeypatch.setattr(sys.modules[__name__], "SHAPES", {**plain, **GROUPED_SHAPES})  # (_check_total's shapes)
    sp = SPACES[strategy]
    legal = total = 0
    rng = random.Random(f"grouped-{strategy}")
    for name, spec in GROUPED_SHAPES.items():
        mine = grouped_strategy(spec, spec.groups) == strategy
        for arch in ARCHS:
            assert (sp.applies(spec, arch) is None) == mine, (strategy, name, arch)
            tc = ["grouped_gemm"] if SPACES["grouped_gemm"].applies(spec, arch) is None else []  # (wide groups)
            assert [s.strategy for s in spaces_for(spec, arch)] == [grouped_strategy(spec, spec.groups)] + tc
            if not mine:
                continue
            for kn in _grouped_grid(sp):
                total += 1
                legal += _check_total(sp, name, arch, kn, sms=rng.choice((None, 46, 132))) is None
    assert 0 < legal < total, (legal, total)
    for name, spec in plain.items():  # (groups 1: never these spaces)
        assert sp.applies(spec, "sm_90") is not None


def _grouped_points(n: int, legal: bool, seed: str):
    """``n`` seeded (strategy, shape name, arch, knobs) points on sm_90 / sm_75, legal (the sampler's) or illegal
    (uniform draws the space refuses)."""
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        name = rng.choice(list(GROUPED_SHAPES))
        spec, arch = GROUPED_SHAPES[name], rng.choice(("sm_90", "sm_75"))
        sp = next(SPACES[s] for s in GROUPED_SPACES if SPACES[s].applies(spec, arch) is None)
        kn = sp.sample(rng, spec, arch) if legal else _uniform(rng, sp)
        if kn is not None and (sp.legal(spec, arch, kn) is None) == legal:
            out.append((sp.strategy, name, arch, kn))
    return out


def test_grouped_legal_points_build_for_sm90_and_sm75():
    """Random legal points of both spaces build for sm_90 and sm_75 (TIR and TVM's CUDA codegen; nvcc not run), each
    the kernel of its strategy with the effective tile the space predicts."""
    from test_kernel_identity import cuda_source

    from qcompile.schedules.grouped import plan_grouped

    pts = _grouped_points(12, True, "grouped-builds")
    assert {(s, a) for s, _, a, _ in pts} >= {("depthwise", "sm_90"), ("grouped", "sm_75")}, pts
    for strategy, name, arch, kn in pts:
        spec = GROUPED_SHAPES[name]
        pk = plan_grouped(spec, spec.groups, arch, kn)
        assert pk.strategy == strategy and pk.knobs == SPACES[strategy].effective(spec, arch, kn)
        assert "__global__" in cuda_source(pk.funcs[0], arch), (strategy, name, arch, kn)


def test_grouped_illegal_points_refused_before_building(monkeypatch):
    """An illegal point is refused by its builder (``make_depthwise`` / ``make_grouped``: ValueError) with exactly the
    space's reason, before any TIR is built."""
    from qcompile.schedules import depthwise, grouped

    monkeypatch.setattr(depthwise, "T", _NoTIR())
    monkeypatch.setattr(grouped, "T", _NoTIR())
    pts = _grouped_points(60, False, "grouped-refused")
    assert {s for s, *_ in pts} == set(GROUPED_SPACES)
    for strategy, name, arch, kn in pts:
        spec = GROUPED_SHAPES[name]
        why = SPACES[strategy].legal(spec, arch, kn)
        build = depthwise.make_depthwise if strategy == "depthwise" else grouped.make_grouped
        with pytest.raises(ValueError) as e:
            build(spec, spec.groups, kn, arch)
        assert str(e.value) == why, (strategy, name, arch, kn)


def test_grouped_default_point_is_todays_kernel():
    """The space's default point is the kernel's automatic tile: ``plan_grouped`` without a config and with the
    default point generate the same CUDA, for sm_90 and sm_75; ``effective`` gives the tile it resolves to, per arch
    (the SM count)."""
    from test_kernel_identity import cuda_source

    from qcompile.schedules.grouped import plan_grouped

    for name in ("dw_mbv2_112x32", "dw_c30_bytes", "gr_rx50_56x128", "gr_mult2_u4out"):
        spec = GROUPED_SHAPES[name]
        for arch in ("sm_90", "sm_75"):
            sp = next(SPACES[s] for s in GROUPED_SPACES if SPACES[s].applies(spec, arch) is None)
            auto, dflt = plan_grouped(spec, spec.groups, arch), plan_grouped(spec, spec.groups, arch,
                                                                             sp.default(spec, arch))
            assert auto.knobs == dflt.knobs == sp.effective(spec, arch, sp.default(spec, arch))
            assert cuda_source(auto.funcs[0], arch) == cuda_source(dflt.funcs[0], arch), (name, arch)
    # the automatic tile depends on the arch's SM count: MobileNetV2's 112x112x32 layer at batch 1
    spec = GROUPED_SHAPES["dw_mbv2_112x32"]
    sp = SPACES["depthwise"]
    assert sp.effective(spec, "sm_90", sp.default(spec, "sm_90")) != sp.effective(spec, "sm_75",
                                                                                   sp.default(spec, "sm_75"))


def test_grouped_records_round_trip():
    """A depthwise / grouped record's key carries the group count (``|gG``) and parses back to the same shape; its
    knobs are checked with the space's legality for that shape (a tile that does not divide the channels is stale)."""
    from qcompile.schedules import tuning as TU
    from qcompile.schedules.depthwise import DwConfig
    from qcompile.schedules.grouped import GroupedConfig

    for name, spec in GROUPED_SHAPES.items():
        key = TU.tuning_key(spec)
        assert f"|g{spec.groups}" in key and TU.tuning_key(spec_from_key(key)) == key, name
    dw, gr = TU.tuning_key(GROUPED_SHAPES["dw_mbv2_112x32"]), TU.tuning_key(GROUPED_SHAPES["gr_rx50_56x128"])
    ok = TU.format_record(TU.make_record("sm_90", "GPU", 132, dw, "depthwise", DwConfig(vec=16, qt=2), ms=0.01))
    rec, why = TU.parse_record(ok)
    assert rec is not None and rec.knobs == DwConfig(vec=16, qt=2) and rec.strategy == "depthwise", why
    stale = TU.format_record(TU.make_record("sm_90", "GPU", 132, gr, "grouped", GroupedConfig(kt=8), ms=0.01))
    assert TU.parse_record(stale)[0] is None  # (kt 8 does not divide the 4 channels of a group)
    assert TU.parse_record(stale.replace('"kt": 8', '"kt": 4'))[0].knobs == GroupedConfig(kt=4)
