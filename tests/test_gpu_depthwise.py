"""The depthwise and grouped conv kernels (schedules/depthwise.py, schedules/grouped.py), bit for bit against an
independent NumPy reference (kernel_reference's epilogue; the grouped sums here, checked against
``kernel_reference.conv_acc`` group by group), over MobileNetV2 / V3, EfficientNet-B0 and ResNeXt-50 layer shapes and
odd ones (channel counts with no 4-byte vector, 2x2 / 5x5 / 7x7 kernels, stride 3, dilation, asymmetric padding, pad
values, 4-bit values one per byte with packed 4-bit outputs, residual stages, int32 outputs, S >= 33).

* GPU tier (``-m gpu``): each case built for this host's GPU and run on it, the output poisoned twice.
* CPU tier (marker ``nvcc``): each case built with nvcc for sm_90 (ptxas accepts it), and the kernel's generated
  CUDA source compiled with g++ and run thread by thread on the host (tests/cuda_on_host.py), the output poisoned
  twice -- the schedule and code generation checked without a GPU.

Inputs are laid out in the kernels' weight formats by this file's own packers (the formats the modules document).
"""
from __future__ import annotations

import zlib

import numpy as np
import pytest

import kernel_reference as kr
from conftest import gpu_compute_capability
from test_gpu_kernels import POISONS, STORAGE, from_storage, pack_nibbles, target_arch

U8 = dict(x_dtype="uint8", out_dtype="uint8", zo=3, lo=0, hi=255)
I8 = dict(x_dtype="int8", out_dtype="int8", zo=-2, lo=-128, hi=127)
U4 = dict(x_dtype="uint8", w_bits=4, out_dtype="uint4", zo=1, lo=0, hi=15)  # (4-bit values one per byte in, packed out)
I4 = dict(x_dtype="int8", w_bits=4, out_dtype="int4", zo=0, lo=-8, hi=7)
RES8 = dict(has_residual=True, res_dtype="uint8", zo2=-1, lo2=0, hi2=255)
RES4 = dict(has_residual=True, res_dtype="uint4", zo2=0, lo2=0, hi2=15, rq2_uniform=(2, 1 << 19, -1, 1 << 19, 20))


def dw(name, H, C, R=3, stride=1, N=1, W=None, cfg=None, **kw):
    kw.setdefault("padding", R // 2)
    spec = dict(N=N, H=H, W=W or H, C=C, K=C, R=R, S=kw.pop("S", R), stride=stride, **{**U8, **kw})
    return dict(name=name, spec=spec, groups=C, cfg=cfg)


def gr(name, H, C, K, groups, R=3, stride=1, N=1, W=None, cfg=None, **kw):
    kw.setdefault("padding", R // 2)
    spec = dict(N=N, H=H, W=W or H, C=C, K=K, R=R, S=kw.pop("S", R), stride=stride, **{**U8, **kw})
    return dict(name=name, spec=spec, groups=groups, cfg=cfg)


CASES = [
    # MobileNetV2 (224): the depthwise 3x3 layers (stride 1 and 2), uint8 activations after ReLU6
    dw("dw_mbv2_112x32", 112, 32),
    dw("dw_mbv2_112x96_s2", 112, 96, stride=2),
    dw("dw_mbv2_56x144", 56, 144, N=2),
    dw("dw_mbv2_28x192_s2", 28, 192, stride=2, N=2),
    dw("dw_mbv2_14x576", 14, 576, N=2),
    dw("dw_mbv2_7x960_b8", 7, 960, N=8),
    # MobileNetV3-Large / EfficientNet-B0: 5x5, odd channel counts of 4-byte vectors, int8 (hardswish) inputs
    dw("dw_mbv3_28x72_5x5_s2", 56, 72, R=5, stride=2, **I8),
    dw("dw_mbv3_14x200", 14, 200, **I8, pad_value=-7),
    dw("dw_mbv3_14x184_5x5", 14, 184, R=5, N=2),
    dw("dw_effb0_112x32_i8", 112, 32, **I8),
    dw("dw_effb0_14x672_5x5", 14, 672, R=5, N=2),
    dw("dw_effb0_7x1152_5x5", 7, 1152, R=5, N=4),
    # configs forced: 16-channel vectors, 8 columns a thread, one column, 4-channel vectors
    dw("dw_vec16_qt8", 20, 64, cfg=dict(vec=16, qt=8)),
    dw("dw_vec4_qt1_s2", 21, 48, stride=2, cfg=dict(vec=4, qt=1)),
    dw("dw_vec8_qt3", 17, 40, cfg=dict(vec=8, qt=3), pad_value=9),
    # odd shapes: no 4-byte channel vector (byte loads), 2x2 / 7x7 kernels, stride 3, dilation, asymmetric padding,
    # non-square images
    dw("dw_c30_bytes", 13, 30, **I8, pad_value=-3),
    dw("dw_c6_2x2", 9, 6, R=2, padding=(0, 1, 1, 0)),
    dw("dw_7x7_s3", 23, 16, R=7, stride=3, W=19),
    dw("dw_dil2_asym", 15, 24, padding=(2, 1, 0, 3), dilation=2, W=11),
    dw("dw_3x1", 12, 8, R=3, S=1, padding=(1, 0, 1, 0)),
    # 4-bit values one per byte, packed 4-bit outputs; residual stages (8-bit, packed 4-bit); int32 out; S >= 33
    dw("dw_u4_packed_out", 14, 64, **U4),
    dw("dw_i4_vec1_bytes_out", 9, 10, **I4),
    dw("dw_res8", 14, 48, **RES8),
    dw("dw_res4_u4", 10, 32, **U4, **RES4),
    dw("dw_i32_out", 9, 16, x_dtype="uint8", out_dtype="int32", zo=5, lo=-(1 << 31), hi=(1 << 31) - 1),
    dw("dw_ge33", 11, 32, **I8, shift_ge33=True),
    # ResNeXt-50 32x4d: 3x3 grouped, 32 groups of 4 / 8 / 16 / 32 channels (stride 2 where a stage starts)
    gr("gr_rx50_56x128", 56, 128, 128, 32),
    gr("gr_rx50_56x256_s2", 56, 256, 256, 32, stride=2),
    gr("gr_rx50_14x512", 14, 512, 512, 32, N=2),
    gr("gr_rx50_7x1024", 7, 1024, 1024, 32, N=2),
    # grouped, odd: channels per group with no 4-byte word (3), a channel multiplier (K = 2C, Cg 1), int8 in, forced
    # configs, residual, packed 4-bit out, 5x5 stride 2 with a pad value
    gr("gr_cg3_kg5", 11, 12, 20, 4, **I8, pad_value=4),
    gr("gr_dw_mult2", 10, 16, 32, 16),
    gr("gr_kt2_qt5", 13, 32, 64, 8, cfg=dict(kt=2, qt=5)),
    gr("gr_kt8_qt1", 9, 64, 64, 4, cfg=dict(kt=8, qt=1)),
    gr("gr_res8", 12, 64, 64, 8, **RES8),
    gr("gr_u4_packed_out", 9, 32, 32, 4, **U4),
    gr("gr_5x5_s2_pad", 17, 48, 24, 6, R=5, stride=2, pad_value=11),
    gr("gr_i32_out_dil", 12, 16, 16, 2, dilation=2, padding=2, x_dtype="int8", out_dtype="int32", zo=0,
       lo=-(1 << 31), hi=(1 << 31) - 1),
]


# ---------------------------------------------------------------------------------------------------------------
# reference and problem
# ---------------------------------------------------------------------------------------------------------------
def grouped_acc(spec, groups: int, x, w) -> np.ndarray:
    """int64 sums of a grouped conv: x [N, H, W, C], w [K, R, S, C / groups] -> [N, P, Q, K] (pad_value outside)."""
    s = kr.as_spec(spec)
    x, w = np.asarray(x, np.int64), np.asarray(w, np.int64)
    N, H, W, C = x.shape
    K, R, S, Cg = w.shape
    assert Cg * groups == C and K % groups == 0, (w.shape, C, groups)
    pt, pl, pb, pr = kr.pads(s)
    (sh, sw), (dh, dw_) = kr._pair(s.stride), kr._pair(s.dilation)
    P, Q = kr.out_size(s)
    xp = np.full((N, H + pt + pb, W + pl + pr, C), int(s.pad_value), np.int64)
    xp[:, pt:pt + H, pl:pl + W] = x
    wg = w.reshape(groups, K // groups, R, S, Cg)
    acc = np.zeros((N, P, Q, groups, K // groups), np.int64)
    for r in range(R):
        for c in range(S):
            win = xp[:, r * dh:r * dh + sh * (P - 1) + 1:sh, c * dw_:c * dw_ + sw * (Q - 1) + 1:sw]
            acc += np.einsum("npqgc,gkc->npqgk", win.reshape(N, P, Q, groups, Cg), wg[:, :, r, c])
    return acc.reshape(N, P, Q, K)


def make_problem(case) -> dict:
    """Logical inputs (seeded by the case's name), the outputs spread over their range, and the expected output."""
    import dataclasses

    from qcompile.schedules import ConvSpec

    rng = np.random.default_rng(zlib.crc32(case["name"].encode()))
    s = kr.as_spec(dataclasses.asdict(ConvSpec(**case["spec"])))  # (every field, defaults filled in)
    groups = case["groups"]
    x4 = s.out_dtype in ("int4", "uint4")  # (a 4-bit layer: its input values are 4-bit too, one per byte)
    xlo, xhi = kr.RANGES[("int4" if s.x_dtype == "int8" else "uint4") if x4 else s.x_dtype]
    wlo, whi = kr.RANGES["int4" if s.w_bits == 4 else "int8"]
    x = rng.integers(xlo, xhi + 1, (s.N, s.H, s.W, s.C))
    w = rng.integers(wlo, whi + 1, (s.K, s.R, s.S, s.C // groups))
    acc = grouped_acc(s, groups, x, w)
    flat = acc.reshape(-1, s.K)
    sd = float(flat.std()) + 1.0
    lo, hi = max(s.lo, -(1 << 20)), min(s.hi, 1 << 20)
    target = (hi - lo) / 4.0 / sd
    S = rng.integers(33, 41, s.K) if s.shift_ge33 else rng.integers(20, 31, s.K)
    S = np.maximum(np.minimum(S, np.floor(np.log2((2**31 - 1) / (1.5 * target)))).astype(np.int64),
                   33 if s.shift_ge33 else 1)
    M = np.clip(np.round(target * 2.0 ** S * rng.uniform(0.5, 1.5, s.K)), 1, 2**31 - 1).astype(np.int64)
    M *= rng.choice([1, -1], s.K, p=[0.8, 0.2])
    centre = ((lo + hi) / 2 - s.zo) * 2.0 ** S / M - flat.mean(0) + rng.uniform(-0.3, 0.3, s.K) * sd
    bias = np.clip(np.round(centre), kr.I32_MIN, kr.I32_MAX).astype(np.int64)
    p = dict(x=x, w=w, bias=bias, M=M, S=S)
    if s.has_residual:
        P, Q = kr.out_size(s)
        rlo, rhi = kr.RANGES[s.res_dtype]
        p["res"] = rng.integers(rlo, rhi + 1, (s.N, P, Q, s.K))
        if s.rq2_uniform:
            p["rq2"] = np.repeat(np.asarray(s.rq2_uniform, np.int64)[:, None], s.K, 1)
        else:
            S2 = rng.integers(16, 31, s.K)
            span = (s.hi2 - s.lo2) / ((s.hi - s.lo) + (rhi - rlo))
            M1, M2 = (np.clip(np.round(span * rng.uniform(0.6, 1.4, s.K) * 2.0 ** S2), 1, 2**31 - 1) for _ in "12")
            p["rq2"] = np.stack([rng.integers(-3, 4, s.K), M1, rng.integers(-3, 4, s.K), M2, S2]).astype(np.int64)
    p["want"] = kr.epilogue(s, acc, bias, M, S, p.get("res"), p.get("rq2"))
    kr._check_range("out", p["want"], s.out_dtype)
    assert np.unique(p["want"]).size > 3, "a degenerate case: the reference output is (nearly) constant"
    return p


# (the kernels' weight formats, from their documentation: depthwise [R, S, C]; grouped [R, S, Cg / 4, K, 4] where
#  Cg % 4 == 0, else [R, S, Cg, K, 4] with the value in byte 0)
def pack_weights(strategy: str, w) -> np.ndarray:
    w = np.asarray(w, np.int64)
    K, R, S, Cg = w.shape
    if strategy == "depthwise":
        return w[..., 0].transpose(1, 2, 0).astype(np.int8).copy()
    if Cg % 4 == 0:
        return w.reshape(K, R, S, Cg // 4, 4).transpose(1, 2, 3, 0, 4).astype(np.int8).copy()
    out = np.zeros((R, S, Cg, K, 4), np.int8)
    out[..., 0] = w.transpose(1, 2, 3, 0)
    return out


def buffers(case, strategy: str, spec, p) -> dict:
    """The kernel's buffers by parameter name (logical values to storage, this file's packers)."""
    s = kr.as_spec(spec)
    b = dict(x=np.asarray(p["x"]).astype(STORAGE[s.x_dtype]), w=pack_weights(strategy, p["w"]),
             bias=p["bias"].astype(np.int32), M=p["M"].astype(np.int32), S=p["S"].astype(np.int32))
    if s.has_residual:
        b["res"] = (pack_nibbles(p["res"]).view(STORAGE[s.res_dtype]) if s.res_bits == 4
                    else p["res"].astype(STORAGE[s.res_dtype]))
        b["rq2"] = p["rq2"].astype(np.int32)
    return b


def out_buffer(spec, poison: int) -> np.ndarray:
    s = kr.as_spec(spec)
    P, Q = kr.out_size(s)
    ko = s.K // 2 if s.out_dtype in ("int4", "uint4") else s.K
    dt = STORAGE[s.out_dtype]
    return np.full(s.N * P * Q * ko * np.dtype(dt).itemsize, poison, np.uint8).view(dt).reshape(s.N, P, Q, ko)


def check_out(case, spec, p, out) -> None:
    s = kr.as_spec(spec)
    got = from_storage(out, s.out_dtype, s.K)
    want = p["want"]
    bad = got != want
    assert not bad.any(), (f"{case['name']}: {int(bad.sum())} of {bad.size} outputs differ from the reference "
                           f"(first at {tuple(int(i) for i in np.argwhere(bad)[0])}: "
                           f"{int(got[bad][0])} vs {int(want[bad][0])})")


# ---------------------------------------------------------------------------------------------------------------
# build
# ---------------------------------------------------------------------------------------------------------------
def plan(case, arch: str):
    """The case's GroupedPlanned (``plan_grouped``: the kernel the compiler dispatches, a 4-bit output its config
    cannot pack one value per byte), with the case's forced config."""
    from qcompile.schedules import ConvSpec
    from qcompile.schedules.depthwise import DwConfig
    from qcompile.schedules.grouped import GroupedConfig, plan_grouped

    spec = ConvSpec(**case["spec"])
    cfg = None
    if case["cfg"]:
        cfg = (DwConfig if case["groups"] == spec.C == spec.K else GroupedConfig)(**case["cfg"])
    return plan_grouped(spec, case["groups"], arch, cfg)


def launch(pk) -> tuple[int, int]:
    """(blocks, threads per block) of the kernel, from the documented thread tiles."""
    s, c = pk.spec, pk.knobs
    P, Q = s.P, s.Q
    if pk.strategy == "depthwise":
        total = s.N * P * -(-Q // c.qt) * (s.C // c.vec)
    else:
        total = s.N * P * -(-Q // c.qt) * (s.K // c.kt)
    return -(-total // c.threads), c.threads


def build(pk, arch: str, mode: str = "sass"):
    import tvm

    from qcompile.schedules.build import cuda_target, ensure_stub_libcuda, nvcc_options

    ensure_stub_libcuda()
    with nvcc_options(arch, mode):
        return tvm.compile(tvm.IRModule({"k0": pk.funcs[0].with_attr("global_symbol", "k0")}), target=cuda_target(arch))


def _names(pk) -> list:
    return ["x", "w", "bias", "M", "S"] + (["res", "rq2"] if pk.spec.has_residual else []) + ["out"]


# ---------------------------------------------------------------------------------------------------------------
# the tests
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.nvcc
@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_grouped_kernel_bit_exact_on_gpu(case):
    import tvm

    arch, mode = target_arch(gpu_compute_capability())
    pk = plan(case, arch)
    mod = build(pk, arch, mode)
    p = make_problem(case)
    bufs = buffers(case, pk.strategy, pk.spec, p)
    dev = tvm.cuda(0)
    for poison in POISONS:
        t = {k: tvm.runtime.tensor(np.ascontiguousarray(v), dev) for k, v in bufs.items()}
        t["out"] = tvm.runtime.tensor(out_buffer(pk.spec, poison), dev)
        mod["k0"](*[t[n] for n in _names(pk)])
        dev.sync()
        check_out(case, pk.spec, p, t["out"].numpy())


HOST_NAMES = {"xw": "x", "ww": "w", "Mq": "M", "Sq": "S"}  # (the kernels' word views of x and w, the epilogue vectors)


@pytest.mark.nvcc
@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_grouped_kernel_source_bit_exact_on_host(case, tmp_path):
    """nvcc builds the kernel for sm_90; its CUDA source, run thread by thread on the host, equals the reference."""
    from cuda_on_host import build_on_host

    from qcompile.schedules.build import cuda_source

    pk = plan(case, "sm_90")
    assert pk.strategy == ("depthwise" if case["groups"] == pk.spec.C == pk.spec.K else "grouped")
    w = np.random.default_rng(0).integers(-128, 128, (pk.spec.K, pk.spec.R, pk.spec.S, pk.spec.C // case["groups"]))
    assert np.array_equal(pk.weights(w), pack_weights(pk.strategy, w)), "the compiler's weight format is not the documented one"
    run, params = build_on_host(cuda_source(build(pk, "sm_90")), str(tmp_path))
    p = make_problem(case)
    bufs = buffers(case, pk.strategy, pk.spec, p)
    grid, block = launch(pk)
    for poison in POISONS:
        bufs["out"] = out_buffer(pk.spec, poison)
        run([bufs[HOST_NAMES.get(n[:-4], n[:-4])] for n in params], grid, block)
        check_out(case, pk.spec, p, bufs["out"])


def test_grouped_reference_matches_kernel_reference():
    """This file's grouped sums equal kernel_reference.conv_acc run on each group's channels alone."""
    rng = np.random.default_rng(7)
    spec = dict(N=2, H=7, W=6, C=12, K=8, R=3, S=2, stride=(2, 1), padding=(1, 0, 1, 1), dilation=1, layout="NHWC",
                x_dtype="uint8", w_bits=8, pad_value=5)
    x, w = rng.integers(0, 256, (2, 7, 6, 12)), rng.integers(-128, 128, (8, 3, 2, 3))
    got = grouped_acc(spec, 4, x, w)
    for g in range(4):
        want = kr.conv_acc(dict(spec, C=3, K=2), x[..., 3 * g:3 * g + 3], w[2 * g:2 * g + 2])
        assert np.array_equal(got[..., 2 * g:2 * g + 2], want)


def test_cases_cover_the_kernels():
    """Both kernels, every word form (4-byte vectors and bytes), residual, packed 4-bit, int32 out, forced configs."""
    dws = [c for c in CASES if c["groups"] == c["spec"]["C"] == c["spec"]["K"]]
    grs = [c for c in CASES if c not in dws]
    assert dws and grs and len({c["name"] for c in CASES}) == len(CASES)
    for part in (dws, grs):
        assert any(c["spec"].get("has_residual") for c in part) and any(c["cfg"] for c in part)
        assert any(c["spec"]["out_dtype"] in ("uint4", "int4") for c in part)
        assert any(c["spec"]["out_dtype"] == "int32" for c in part) and any(c["spec"].get("pad_value") for c in part)
    assert any(c["spec"]["C"] % 4 for c in dws) and any((c["spec"]["C"] // c["groups"]) % 4 for c in grs)


# ---------------------------------------------------------------------------------------------------------------
# the tuning spaces' points (schedules/space.py: SPACES["depthwise"], SPACES["grouped"])
# ---------------------------------------------------------------------------------------------------------------
SPACE_CASES = ["dw_mbv2_56x144", "dw_mbv3_28x72_5x5_s2", "dw_c30_bytes", "dw_u4_packed_out", "dw_res4_u4",
               "gr_rx50_56x128", "gr_rx50_14x512", "gr_cg3_kg5", "gr_res8", "gr_u4_packed_out"]


def space_points(case, arch: str, n: int = 3) -> list:
    """``n`` seeded random legal points of the case's space (its ConvSpec with ``groups``) and the default point."""
    import random

    from qcompile.schedules import ConvSpec
    from qcompile.schedules.grouped import grouped_strategy
    from qcompile.schedules.space import SPACES

    spec = ConvSpec(**case["spec"], groups=case["groups"])
    sp = SPACES[grouped_strategy(spec, spec.groups)]
    rng = random.Random(f"{case['name']}-{arch}")
    pts = [sp.default(spec, arch)] + [sp.sample(rng, spec, arch) for _ in range(n)]
    assert all(kn is not None and sp.legal(spec, arch, kn) is None for kn in pts), pts
    return [(spec, kn) for kn in pts]


@pytest.mark.gpu
@pytest.mark.nvcc
@pytest.mark.parametrize("name", SPACE_CASES)
def test_space_points_bit_exact_on_gpu(name):
    """Random legal points of the tuning space (and its default) of each case, built for this GPU's arch: bit-exact
    with poisoned outputs."""
    import tvm

    from qcompile.schedules.grouped import plan_grouped

    case = next(c for c in CASES if c["name"] == name)
    arch, mode = target_arch(gpu_compute_capability())
    p = make_problem(case)
    dev = tvm.cuda(0)
    for spec, kn in space_points(case, arch):
        pk = plan_grouped(spec, spec.groups, arch, kn)
        mod = build(pk, arch, mode)
        bufs = buffers(case, pk.strategy, pk.spec, p)
        for poison in POISONS:
            t = {k: tvm.runtime.tensor(np.ascontiguousarray(v), dev) for k, v in bufs.items()}
            t["out"] = tvm.runtime.tensor(out_buffer(pk.spec, poison), dev)
            mod["k0"](*[t[n] for n in _names(pk)])
            dev.sync()
            check_out(case, pk.spec, p, t["out"].numpy())


@pytest.mark.nvcc
@pytest.mark.parametrize("name", SPACE_CASES[::3])
def test_space_points_source_bit_exact_on_host(name, tmp_path):
    """The same points for sm_90 (nvcc builds them), their CUDA run thread by thread on the host."""
    from cuda_on_host import build_on_host

    from qcompile.schedules.build import cuda_source
    from qcompile.schedules.grouped import plan_grouped

    case = next(c for c in CASES if c["name"] == name)
    p = make_problem(case)
    for i, (spec, kn) in enumerate(space_points(case, "sm_90", 2)):
        pk = plan_grouped(spec, spec.groups, "sm_90", kn)
        d = tmp_path / f"p{i}"
        d.mkdir()
        run, params = build_on_host(cuda_source(build(pk, "sm_90")), str(d))
        bufs = buffers(case, pk.strategy, pk.spec, p)
        grid, block = launch(pk)
        bufs["out"] = out_buffer(pk.spec, POISONS[0])
        run([bufs[HOST_NAMES.get(n[:-4], n[:-4])] for n in params], grid, block)
        check_out(case, pk.spec, p, bufs["out"])
