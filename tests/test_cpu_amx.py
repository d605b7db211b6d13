"""The AMX-INT8 conv kernel (``schedules.cpu_conv_amx``, ``cpu_direct_amx``) and its dispatch.

Any x86-64 host: the kernel and whole models built for ``llvm -mcpu=sapphirerapids``, the tile instructions checked in
the assembly (and the other kernels' instructions absent from the kernel); the layer choice (AMX where
``applies_amx`` takes the layer, ``cpu_direct_vnni`` elsewhere, ``QCOMPILE_CPU_AMX=0``); a NumPy emulation of the
tile program (:func:`emulate`: the plan's tile configuration, tile loads with their row strides, ``tdpbusd`` /
``tdpbssd``, tile stores and the epilogue's gather, every address from the same :class:`AmxPlan` index methods the
kernel uses) bit for bit against the NumPy reference. On a host without AMX the built kernel refuses to run with
an error (the permission request fails) instead of an illegal instruction.

Where the CPU runs AMX-INT8 (``amx_int8`` in /proc/cpuinfo; skipped elsewhere): each layer bit for bit against
``schedules.reference.conv_reference`` (ResNet-50 shapes and odd ones, NCHW and NHWC), and whole models against
``qcompile.reference.Reference``.
"""
import re
import subprocess
import sys

import numpy as np
import pytest
import tvm
from tvm import relax

from qcompile.errors import run_pass
from qcompile.pipeline import PipelineRecord, build, lower_to_integer, qcompile_pipeline
from qcompile.reference import Reference
from qcompile.relay_passes import dispatch_cpu as DC
from qcompile.schedules import cpu_conv as CC
from qcompile.schedules import cpu_conv_amx as AMX
from qcompile.schedules import reference as RF
from qcompile.schedules.spec import ConvSpec

from qdq_models import tiny_resnet_qdq
from test_cpu_kernels import ASM, SPECS, U8, _random, run_built

X86_HOST = tvm.target.codegen.llvm_get_system_triple().startswith("x86_64")
HOST_AMX = {"amx_tile", "amx_int8"} <= CC.host_flags()
needs_amx = pytest.mark.skipif(not HOST_AMX, reason="this host's CPU does not run AMX-INT8 (no amx_int8 in "
                                                   "/proc/cpuinfo): the AMX kernel is built and its assembly checked")
SPR = tvm.target.Target({"kind": "llvm", "mcpu": "sapphirerapids"})
SPR_X86 = tvm.target.Target({"kind": "llvm", "mcpu": "sapphirerapids", "mtriple": "x86_64-linux-gnu"})
AMX_ASM = {"tdpbusd": r"^\s*tdpbusd\s+%tmm\d, %tmm\d, %tmm\d", "tdpbssd": r"^\s*tdpbssd\s+%tmm\d, %tmm\d, %tmm\d",
           "tileloadd": r"^\s*tileloadd\s.*%tmm\d", "ldtilecfg": r"^\s*ldtilecfg\s",
           "tilestored": r"^\s*tilestored\s+%tmm\d", "tilerelease": r"^\s*tilerelease\b",
           "syscall": r"^\s*callq\s+syscall"}

# AMX shapes beyond test_cpu_kernels.SPECS: ResNet-50's flat 1x1 layers (a run is the whole image), a row longer than
# two tiles (a shifted last block), K not a multiple of 16, dilation, int8 inputs (tdpbssd) with a pad value, a
# residual, int32 output, batch 2
AMX_SPECS = {
    "r50_1x1_56": ConvSpec(N=1, H=56, W=56, C=64, K=256, R=1, S=1, **U8),
    "r50_1x1_s2": ConvSpec(N=1, H=56, W=56, C=256, K=128, R=1, S=1, stride=2, **U8),
    "row_40_c64": ConvSpec(N=2, H=5, W=40, C=64, K=40, R=3, S=3, padding=1, **U8),
    "c64_k17_dil": ConvSpec(N=1, H=13, W=15, C=64, K=17, R=3, S=3, padding=2, dilation=2, x_dtype="int8",
                            out_dtype="int8", pad_value=-7),
    "c128_res_i8": ConvSpec(N=2, H=9, W=7, C=128, K=48, R=3, S=3, padding=(1, 0, 2, 1), stride=2, x_dtype="int8",
                            out_dtype="uint8", lo=0, hi=255, has_residual=True, res_dtype="int8", zo=-2, zo2=3,
                            lo2=0, hi2=255),
    "flat_i32": ConvSpec(N=2, H=6, W=9, C=64, K=24, R=1, S=1, x_dtype="int8", out_dtype="int32",
                         lo=-(1 << 31), hi=(1 << 31) - 1),
}
ALL = {**{n: s for n, s in SPECS.items() if AMX.applies_amx(s) is None}, **AMX_SPECS}


# ------------------------------------------------------------------------------------------------
# the tile program, emulated in NumPy
# ------------------------------------------------------------------------------------------------
def _tile_shapes(cfg: bytes) -> dict:
    """tile -> (rows, bytes per row), read from a 64-byte configuration as ``ldtilecfg`` does (palette 1)."""
    assert len(cfg) == 64 and cfg[0] == 1 and cfg[1] == 0 and not any(cfg[2:16])
    out = {}
    for t in range(16):
        colsb, rows = int.from_bytes(cfg[16 + 2 * t:18 + 2 * t], "little"), cfg[48 + t]
        assert (colsb == 0) == (rows == 0), t
        if rows:
            assert t < AMX.TILES and rows <= 16 and colsb <= 64, (t, rows, colsb)
            out[t] = (rows, colsb)
    return out


def _a_source(spec: ConvSpec, pl, x) -> np.ndarray:
    """The bytes the A tiles read, as the kernel's step 1 leaves them: x in place (direct), else xp (``pad_value``
    in the halo, 0 past C up to ``cpad``), in the input's storage type."""
    st = ConvSpec.storage(spec.x_dtype)
    if pl.direct:
        return np.ascontiguousarray(x.astype(st))
    pt, pleft, pb, pr = spec.pads
    N, H, W, C = x.shape
    xp = np.zeros((N, H + pt + pb, W + pleft + pr, pl.cpad), np.int64)
    xp[:, :, :, :C] = spec.pad_value
    xp[:, pt:pt + H, pleft:pleft + W, :C] = x
    return xp.astype(st)


class _Tiles:
    """AMX tile registers over NumPy: loads and stores with a row stride, the int8 dot products."""

    def __init__(self, cfg: bytes):
        self.shape, self.regs = _tile_shapes(cfg), {}

    def load(self, t, buf: np.ndarray, index, stride: int):
        rows, colsb = self.shape[t]
        base = int(np.ravel_multi_index(tuple(int(i) for i in index), buf.shape)) * buf.itemsize
        flat = buf.reshape(-1).view(np.uint8)
        assert 0 <= base and base + (rows - 1) * stride + colsb <= flat.size, "tile load past the buffer"
        self.regs[t] = np.stack([flat[base + i * stride: base + i * stride + colsb] for i in range(rows)])

    def zero(self, t):
        rows, colsb = self.shape[t]
        self.regs[t] = np.zeros((rows, colsb // 4), np.int64)

    def dot(self, c, a, b, signed: bool):
        """tdpbusd (a unsigned) / tdpbssd (a signed): C[m, n] += sum_k,i A[m, 4k + i] B[k, 4n + i], int32 wrap."""
        (mc, cc), (ma, ca), (kb, cb) = self.shape[c], self.shape[a], self.shape[b]
        assert mc == ma and cc == cb and ca == 4 * kb, "tile shapes do not chain"
        A = self.regs[a].view(np.int8 if signed else np.uint8).astype(np.int64).reshape(ma, kb, 4)
        B = self.regs[b].view(np.int8).astype(np.int64).reshape(kb, cb // 4, 4)
        acc = self.regs[c] + np.einsum("mki,kni->mn", A, B)
        self.regs[c] = (acc + (1 << 31)) % (1 << 32) - (1 << 31)

    def store(self, t, buf: np.ndarray, index, stride: int):
        rows, colsb = self.shape[t]
        base = int(np.ravel_multi_index(tuple(int(i) for i in index), buf.shape)) * buf.itemsize
        flat = buf.reshape(-1).view(np.uint8)
        assert base + (rows - 1) * stride + colsb <= flat.size, "tile store past the buffer"
        for i in range(rows):
            flat[base + i * stride: base + i * stride + colsb] = self.regs[t][i].astype(np.int32).view(np.uint8)


def emulate(spec: ConvSpec, io: str, x, w, pl=None) -> np.ndarray:
    """The int32 accumulators [N, P, Q, K] the kernel's tile program leaves for the epilogue, every address from
    ``pl`` (default ``make_plan(spec, io)``); each output written at least once, overlapping writes equal."""
    pl = pl or AMX.make_plan(spec, io)
    w8, _ = AMX.prepack_amx(spec, w, np.zeros(spec.K, np.int32))
    src = _a_source(spec, pl, x)
    tiles = _Tiles(pl.config())
    acc = np.full((spec.N, spec.P, spec.Q, spec.K), np.iinfo(np.int64).min, np.int64)
    for task in range(pl.tasks):
        n, run, kblk, grp = pl.task_coords(task)
        kb0 = pl.kblock_start(kblk)
        for bi in range(pl.bpt):
            if grp * pl.bpt + bi >= pl.n_pblk:
                continue
            j0 = pl.block_start(grp * pl.bpt + bi)
            for mi in range(pl.mt):
                for ni in range(pl.nt):
                    tiles.zero(pl.c_tile(mi, ni))
            for r in range(spec.R):
                for s in range(spec.S):
                    for ch in range(pl.chunks):
                        for mi in range(pl.mt):
                            tiles.load(pl.a_tile(mi), src, pl.a_index(n, run, j0 + mi * pl.m, r, s, ch), pl.a_stride)
                        for ni in range(pl.nt):
                            tiles.load(pl.b_tile(ni), w8, pl.b_index(kb0 + ni, r, s, ch), pl.b_stride)
                        for mi in range(pl.mt):
                            for ni in range(pl.nt):
                                tiles.dot(pl.c_tile(mi, ni), pl.a_tile(mi), pl.b_tile(ni), pl.signed)
            cb = np.zeros((pl.mt * pl.m, pl.nt * AMX.LANES), np.int32)
            for mi in range(pl.mt):
                for ni in range(pl.nt):
                    tiles.store(pl.c_tile(mi, ni), cb, (mi * pl.m, ni * AMX.LANES), pl.c_stride)
            for i in range(pl.mt * pl.m):
                p, q = pl.pixel(run, j0 + i)
                for ni in range(pl.nt):
                    for l in range(AMX.LANES):
                        k = (kb0 + ni) * AMX.LANES + l
                        if k < spec.K:
                            old = acc[n, p, q, k]
                            assert old in (np.iinfo(np.int64).min, cb[i, ni * AMX.LANES + l]), (n, p, q, k)
                            acc[n, p, q, k] = cb[i, ni * AMX.LANES + l]
    assert (acc != np.iinfo(np.int64).min).all(), "outputs the tile program never writes"
    return acc


def _wrap32(a):
    return (np.asarray(a, np.int64) + (1 << 31)) % (1 << 32) - (1 << 31)


@pytest.mark.parametrize("io", ["NHWC", "NCHW"])
@pytest.mark.parametrize("name", list(ALL))
def test_emulated_tile_program_exact(name, io):
    """The tile program of every AMX shape, emulated: its accumulators equal the conv's (int32), and the epilogue
    on them (the prepacked bias, unchanged) equals ``conv_reference``. Any host."""
    spec = ALL[name]
    x, w, bias, M, S, res = _random(spec, seed=len(name) + 3)
    acc = emulate(spec, io, x, w)
    assert np.array_equal(acc, _wrap32(RF.conv_acc_nhwc(x, w, spec)))
    _, b = AMX.prepack_amx(spec, w, bias)
    assert np.array_equal(b, bias)
    ref = RF.conv_reference(spec, x, w, bias, M, S, res)
    assert ref.std() > 0 and np.array_equal(RF.requant(acc, b, M, S, spec, res), ref)


def test_emulation_catches_a_wrong_address():
    """The emulation can fail: a plan whose A rows are ``cpad`` bytes apart instead of ``sw * cpad`` (stride 2), or
    whose B tiles start one 4-channel row late, gives other accumulators."""
    import dataclasses

    spec = ALL["r50_3x3_s2"]
    x, w, *_ = _random(spec, seed=1)
    pl = AMX.make_plan(spec, "NHWC")

    class RowStride(AMX.AmxPlan):
        a_stride = property(lambda self: self.cpad)

    class LateB(AMX.AmxPlan):
        def b_index(self, kb, r, s, ch):
            kb, r, s, c4, z = super().b_index(kb, r, s, ch)
            return kb, r, s, min(c4 + 1, self.cpad // 4 - self.kc // 4), z

    want = _wrap32(RF.conv_acc_nhwc(x, w, spec))
    assert np.array_equal(emulate(spec, "NHWC", x, w, pl), want)
    for bad in (RowStride, LateB):
        assert not np.array_equal(emulate(spec, "NHWC", x, w, bad(**dataclasses.asdict(pl))), want), bad


def test_plan_and_config():
    """Tiles within 8 registers, rows within 16 and 64 bytes; the configuration holds each tile's shape (C tiles m x
    64, A m x kc, B kc/4 x 64); ResNet-50's rows and images tile without waste."""
    for name, spec in ALL.items():
        for io in ("NHWC", "NCHW"):
            pl = AMX.make_plan(spec, io)
            shapes = _tile_shapes(pl.config())
            assert len(shapes) == pl.mt * pl.nt + pl.mt + pl.nt <= 8, name
            assert set(shapes) == set(range(len(shapes)))
            assert shapes[pl.c_tile(0, 0)] == (pl.m, 64) and shapes[pl.a_tile(0)] == (pl.m, pl.kc)
            assert shapes[pl.b_tile(0)] == (pl.kc // 4, 64)
            assert pl.kc == AMX.TILE_BYTES and pl.cpad % pl.kc == 0
            assert pl.mt * pl.m <= pl.run and pl.nt <= pl.kb16
            assert pl.direct == (io == "NHWC" and not any(spec.pads) and spec.C % pl.kc == 0)
            assert pl.signed == (spec.x_dtype == "int8")
    resnet = {"r50_3x3_56": (14, 2, False), "r50_3x3": (14, 1, False), "r50_3x3_7": (7, 1, False),
              "r50_reduce": (14, 2, True), "r50_1x1_56": (16, 2, True)}
    for name, (m, mt, flat) in resnet.items():
        pl = AMX.make_plan(ALL[name])
        assert (pl.m, pl.mt, pl.flat) == (m, mt, flat), (name, pl)
        assert pl.n_pblk * pl.mt * pl.m == pl.run, name  # (no pixel computed twice)


def test_applies_and_refusals():
    """THE check: 8-bit storage, at least 16 output channels, C a multiple of 64, 8-bit weights; the builder refuses
    with the same reason."""
    ok = ConvSpec(N=1, H=8, W=8, C=64, K=16, R=3, S=3, padding=1, **U8)
    assert AMX.applies_amx(ok) is None and AMX.chunk_bytes(64) == 64 and AMX.chunk_bytes(192) == 64
    for bad, why in ((ok.replace(C=3), "3 input channels"), (ok.replace(C=68), "68 input channels"),
                     (ok.replace(C=16), "16 input channels"), (ok.replace(w_bits=4), "4-bit weights"),
                     (ok.replace(K=15), "15 output channels"), (ok.replace(x_dtype="uint4"), "uint4"),
                     (ok.replace(groups=2), "groups 2")):
        assert why in AMX.applies_amx(bad), bad
        with pytest.raises(ValueError, match=why):
            AMX.make_cpu_conv_amx(bad)
    with pytest.raises(ValueError, match="layout HWNC"):
        AMX.make_plan(ok, "HWNC")


# ------------------------------------------------------------------------------------------------
# target, dispatch, assembly (any host)
# ------------------------------------------------------------------------------------------------
def test_target_kernel_names_amx():
    """A target with AMX-TILE, AMX-INT8, AVX-512 VNNI and BW runs cpu_direct_amx; without one of them the VNNI kernel;
    a plain llvm target never enables AMX."""
    T_ = lambda **kw: tvm.target.Target({"kind": "llvm", "mtriple": "x86_64-linux-gnu", **kw})
    assert CC.target_kernel(T_(mcpu="sapphirerapids")) == "cpu_direct_amx"
    assert CC.target_kernel(T_(mcpu="graniterapids")) == "cpu_direct_amx"
    assert CC.target_kernel(T_(mcpu="x86-64-v4", mattr=["+avx512vnni", "+amx-tile", "+amx-int8"])) == "cpu_direct_amx"
    assert CC.target_kernel(T_(mcpu="x86-64-v4", mattr=["+avx512vnni", "+amx-tile"])) == "cpu_direct_vnni"
    assert CC.target_kernel(T_(mcpu="icelake-server")) == "cpu_direct_vnni"
    if X86_HOST and CC.host_has_avx2():
        assert CC.target_kernel(CC.cpu_target(tvm.target.Target({"kind": "llvm"}))) != "cpu_direct_amx"


def test_layer_kernel_rule(monkeypatch):
    """In an AMX module: AMX where ``applies_amx`` takes the layer, else the VNNI rule (cpu_direct_vnni, or its
    packed 4-bit variant); ``QCOMPILE_CPU_AMX=0``: cpu_direct_vnni everywhere."""
    big = np.full(64, 2**20)
    spec = ConvSpec(N=1, H=7, W=7, C=64, K=64, R=3, S=3, padding=1, **U8)
    monkeypatch.delenv("QCOMPILE_CPU_AMX", raising=False)
    assert DC.layer_kernel(spec, "cpu_direct_amx", big) == "cpu_direct_amx"
    assert DC.layer_kernel(spec.replace(C=3), "cpu_direct_amx", big) == "cpu_direct_vnni"
    assert DC.layer_kernel(spec.replace(C=3, w_bits=4), "cpu_direct_amx", big) == "cpu_direct_vnni_s4"
    assert DC.layer_kernel(spec, "cpu_direct_vnni", big) == "cpu_direct_vnni"
    monkeypatch.setenv("QCOMPILE_CPU_AMX", "0")
    assert DC.layer_kernel(spec, "cpu_direct_amx", big) == "cpu_direct_vnni"


def _asm(f) -> str:
    return tvm.compile(tvm.IRModule({"k": f.with_attr("global_symbol", "k")}), target=SPR_X86).mod.inspect_source("asm")


@pytest.mark.parametrize("name,dot", [("odd_res", "tdpbssd"), ("r50_3x3", "tdpbusd"), ("r50_1x1_s2", "tdpbusd")])
def test_kernel_assembly(name, dot):
    """The kernel built for sapphirerapids holds the tile configuration, tile loads and stores, its tile product
    (``tdpbusd`` for a uint8 input, ``tdpbssd`` for int8), ``tilerelease`` and the permission request, and none of
    the other kernels' instructions (zmm / ymm ``vpdpbusd``, ``vpmaddwd``, ``sdot``). Any x86-64 host (built, not
    run)."""
    spec = {**SPECS, **AMX_SPECS}[name]
    spec = spec.replace(C=64, K=24) if name == "odd_res" else spec  # (odd_res with channels AMX takes)
    assert AMX.applies_amx(spec) is None
    asm = _asm(AMX.make_cpu_conv_amx(spec))
    other_dot = "tdpbusd" if dot == "tdpbssd" else "tdpbssd"
    for what, pattern in AMX_ASM.items():
        assert bool(re.search(pattern, asm, re.M)) == (what != other_dot), what
    for other, pattern in ASM.items():
        assert not re.search(pattern, asm, re.M), other


def _tiny(c=64, classes=16, seed=13, shape=(1, 3, 20, 20)):
    return tiny_resnet_qdq(seed=seed, shape=shape, c=c, classes=classes)


@pytest.mark.parametrize("layout", ["NHWC", "NCHW"])
def test_model_build_for_sapphirerapids(layout, monkeypatch):
    """``build`` of a small ResNet for ``llvm -mcpu=sapphirerapids``: the stem (3 channels) on cpu_direct_vnni, the
    block's convs and the dense layer on cpu_direct_amx (record.kernels), the residual add fused; the code holds
    ``tdpbusd``, ``ldtilecfg`` and the stem's zmm ``vpdpbusd``. ``QCOMPILE_CPU_AMX=0``: every layer on
    cpu_direct_vnni, no tile instruction. Where the host runs AMX, the module is bit-exact against the integer
    reference."""
    mod, shape = _tiny()
    x = np.random.default_rng(14).standard_normal(shape).astype("float32")
    for env, want in (("1", {"stem": "cpu_direct_vnni", "c1": "cpu_direct_amx", "c2": "cpu_direct_amx",
                             "fc": "cpu_direct_amx"}), ("0", None)):
        monkeypatch.setenv("QCOMPILE_CPU_AMX", env)
        rec = PipelineRecord()
        ex = build(mod, SPR, pipeline=qcompile_pipeline(SPR, layout, record=rec))
        asm = "\n".join(m.inspect_source("asm") for m in [ex.mod, *ex.mod.imports] if m.kind == "llvm")
        assert rec.kernels == (want or {k: "cpu_direct_vnni" for k in rec.kernels}) and len(rec.kernels) == 4
        for what in ("tdpbusd", "ldtilecfg", "tileloadd"):
            assert bool(re.search(AMX_ASM[what], asm, re.M)) == (want is not None), (env, what)
        assert re.search(ASM["cpu_direct_vnni"], asm, re.M)
        if HOST_AMX:
            y = relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy()
            assert np.array_equal(y, Reference(rec.integer_mod)(x)) and y.std() > 0


def test_dispatch_pass_amx_module():
    """``DispatchCPU("cpu_direct_amx")``: AMX layers have no tile and no tuning task; the others are planned on
    cpu_direct_vnni (its records' arch); the residual add is fused into the AMX conv."""
    mod, _ = _tiny()
    mi = lower_to_integer(mod, "NHWC", pack_int4=False)
    p = DC.DispatchCPU("cpu_direct_amx")
    run_pass(p, mi)
    assert dict(p.chosen) == {"q_stem": "cpu_direct_vnni", "q_c1": "cpu_direct_amx", "q_c2": "cpu_direct_amx",
                              "q_fc": "cpu_direct_amx"}
    assert p.fused == [("q_c2", "q_res")] and not p.skipped
    assert [(n, c.kernel) for n, c in p.planned] == [("q_stem", "cpu_direct_vnni")]
    assert {s for _, s in p.sources} == {"default"}


def test_refuses_to_run_without_amx(tmp_path):
    """On an x86-64 host whose CPU has no AMX, the kernel's prologue gets no tile state from Linux and the call
    stops with the kernel's error, before any tile instruction (run in a child process)."""
    if not X86_HOST or HOST_AMX or not CC.host_vnni() == "avx512":
        pytest.skip("needs an x86-64 host with AVX-512 VNNI and without AMX")
    code = """
import numpy as np, tvm
from qcompile.schedules import cpu_conv_amx as A
from qcompile.schedules.spec import ConvSpec
spec = ConvSpec(N=1, H=6, W=6, C=64, K=16, R=1, S=1, x_dtype="uint8", out_dtype="uint8", lo=0, hi=255)
lib = tvm.compile(tvm.IRModule({"k": A.make_cpu_conv_amx(spec).with_attr("global_symbol", "k")}),
                  target=tvm.target.Target({"kind": "llvm", "mcpu": "sapphirerapids"}))
args = [np.ones((1, 6, 6, 64), "uint8"), np.ones((1, 1, 1, 16, 64), "int8")] + [np.ones(16, "int32")] * 3
try:
    lib["k"](*[tvm.runtime.tensor(a) for a in args], tvm.runtime.tensor(np.zeros((1, 6, 6, 16), "uint8")))
    print("RAN")
except Exception as e:
    print("REFUSED", e)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "REFUSED" in r.stdout and "refused the AMX tile state" in r.stdout, r.stdout


# ------------------------------------------------------------------------------------------------
# the command line
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_onnx(tmp_path_factory):
    """A quantized resnet_tiny exported by ``qmodel`` (INT8, 16x16) and a fresh input."""
    d = tmp_path_factory.mktemp("cli_amx")
    path = str(d / "tiny8.onnx")
    r = subprocess.run([sys.executable, "-m", "qcompile.models.cli", "resnet_tiny", "--bits", "8", "--format", "onnx",
                        "--input-size", "16", "-o", path], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return path, np.random.default_rng(22).standard_normal((1, 3, 16, 16)).astype("float32")


def test_cli_sapphirerapids(tiny_onnx, tmp_path, capsys):
    """``qcompile --target "llvm -mcpu=sapphirerapids"``: the summary names cpu_direct_amx for the conv with 64
    channels in, cpu_direct_vnni for the others (fewer input channels, the 10-class dense layer); the .so's code holds
    the tile instructions (``compile_model`` records the same kernels). Where the host runs AMX, the .so is bit-exact
    against the integer reference."""
    from qcompile.cli import qcompile_main
    from qcompile.driver import CompileOptions, compile_model
    from qcompile.runtime import Module

    model, x = tiny_onnx
    so = str(tmp_path / "m.so")
    target = "llvm -mcpu=sapphirerapids"
    assert qcompile_main([model, "--target", target, "-o", so]) == 0
    out = capsys.readouterr().out
    rows = {r[0]: r[8] for r in (ln.split() for ln in out.splitlines()) if r[1:2] in (["conv2d"], ["dense"])}
    assert len(rows) == 10, out
    # (resnet_tiny: the one conv with 64 input channels on AMX, the others -- 3, 16 and 32 channels in -- on VNNI)
    assert rows == {n: "cpu_direct_amx" if n == "layer3_0_conv2" else "cpu_direct_vnni" for n in rows}, out
    res = compile_model(model, CompileOptions(target=target), log=lambda s: None)
    assert {l.name: l.kernel for l in res.layers if l.kernel in ("cpu_direct_amx", "cpu_direct_vnni")} == rows
    asm = "\n".join(m.inspect_source("asm") for m in [res.executable.mod, *res.executable.mod.imports]
                    if m.kind == "llvm")
    assert re.search(AMX_ASM["tdpbusd"], asm, re.M) and re.search(AMX_ASM["ldtilecfg"], asm, re.M)
    if HOST_AMX:
        y = Module(so)(x)
        ref = Reference(res.integer_mod)(x)
        assert np.array_equal(y, ref) and ref.std() > 0


# ------------------------------------------------------------------------------------------------
# on a CPU with AMX: each layer bit for bit
# ------------------------------------------------------------------------------------------------
def _run_amx(spec: ConvSpec, io: str, x, w, bias, M, S, res):
    f = AMX.make_cpu_conv_amx(spec, io)
    assert str(f.attrs["qcompile.strategy"]) == "cpu_direct_amx"
    w8, b = AMX.prepack_amx(spec, w, bias)
    return run_built(f, SPR, spec, io, x, w8, b, M, S, res)


@needs_amx
@pytest.mark.parametrize("io", ["NCHW", "NHWC"])
@pytest.mark.parametrize("name", list(ALL))
def test_kernel_exact_on_amx(name, io):
    spec = ALL[name]
    x, w, bias, M, S, res = _random(spec, seed=len(name))
    ref = RF.conv_reference(spec, x, w, bias, M, S, res)
    y = _run_amx(spec, io, x, w, bias, M, S, res)
    assert y.shape == ref.shape and ref.std() > 0 and len(np.unique(ref)) > 2
    assert np.array_equal(y, ref)


@needs_amx
@pytest.mark.parametrize("bits", [(8, 8)])
def test_dispatch_exact_on_amx(bits):
    """A whole small 8-bit ResNet (batch 2, odd image, 64 channels) on the AMX module, NHWC and NCHW, against the
    integer reference."""
    mod, shape = tiny_resnet_qdq(seed=3, w_bits=bits[0], a_bits=bits[1], shape=(2, 3, 13, 11), c=64, classes=20)
    x = np.random.default_rng(4).standard_normal(shape).astype("float32")
    for layout in ("NHWC", "NCHW"):
        mi = lower_to_integer(mod, layout, pack_int4=False)
        p = DC.DispatchCPU("cpu_direct_amx")
        md = run_pass(p, mi)
        assert {n for n, k in p.chosen if k == "cpu_direct_amx"} == {"q_c1", "q_c2", "q_fc"}
        y = relax.VirtualMachine(build(md, SPR), tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy()
        assert np.array_equal(y, Reference(mi)(x)) and y.std() > 0

