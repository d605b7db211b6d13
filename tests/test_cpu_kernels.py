"""The CPU (x86 AVX2) conv kernel and its dispatch: bit for bit against the NumPy integer references.

Kernel level: ``schedules.cpu_conv.make_cpu_conv`` built for the CPU build target and compared with
``schedules.reference.conv_reference`` on fresh random inputs (ResNet shapes and odd ones: odd channel counts,
stride 2, padding with a nonzero pad value, the 7x7 stem, residual adds, 4-bit weights, NCHW and NHWC).
Graph level: ``DispatchCPU`` on small QDQ models, built and compared with ``qcompile.reference.Reference``.
"""
import numpy as np
import pytest
import tvm
from tvm import relax

from qcompile.errors import run_pass
from qcompile.pipeline import PipelineRecord, build, lower_to_integer, qcompile_pipeline
from qcompile.reference import Reference
from qcompile.relay_passes.dispatch_cpu import DispatchCPU, cpu_kernels_target
from qcompile.schedules import cpu_conv as CC
from qcompile.schedules import reference as RF
from qcompile.schedules.spec import ConvSpec

from qdq_models import tiny_resnet_qdq

# the host's real features (/proc/cpuinfo): the kernels' tests run only where the built code can run
needs_avx2 = pytest.mark.skipif(not CC.host_has_avx2(), reason="the CPU kernels need an x86-64 host with AVX2")
TARGET = CC.cpu_target(tvm.target.Target({"kind": "llvm"}))  # x86-64-v3 on such a host

U8 = dict(x_dtype="uint8", out_dtype="uint8", lo=0, hi=255)
SPECS = {
    # ResNet layers (batch 1): 3x3, 1x1 expand, 1x1 stride 2 (downsample), the dense layer as a 1x1 conv
    "r50_3x3": ConvSpec(N=1, H=14, W=14, C=256, K=256, R=3, S=3, padding=1, **U8),
    "r50_1x1": ConvSpec(N=1, H=7, W=7, C=512, K=2048, R=1, S=1, x_dtype="uint8", out_dtype="int8"),
    "down_s2": ConvSpec(N=1, H=14, W=14, C=64, K=128, R=1, S=1, stride=2, **U8),
    "dense": ConvSpec(N=2, H=1, W=1, C=96, K=10, R=1, S=1, x_dtype="uint8", out_dtype="int8"),
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
}


def _random(spec: ConvSpec, seed: int):
    x, w, bias, M, S, res = RF.random_problem(spec, np.random.default_rng(seed))
    if spec.w_bits == 4:
        assert w.min() >= -8 and w.max() <= 7
    return x, w, bias, M, S, res


def _run_kernel(spec: ConvSpec, io: str, x, w, bias, M, S, res):
    f = CC.make_cpu_conv(spec, io).with_attr("global_symbol", "k")
    lib = tvm.compile(tvm.IRModule({"k": f}), target=TARGET)
    lay = (lambda a: np.ascontiguousarray(np.transpose(a, (0, 3, 1, 2)))) if io == "NCHW" else (lambda a: a)
    args = [lay(x).astype(ConvSpec.storage(spec.x_dtype)), CC.pack_weights(w), bias, M, S]
    if res is not None:
        args += [lay(res[0]).astype(ConvSpec.storage(spec.res_dtype)), np.ascontiguousarray(res[1], np.int32)]
    oshape = lay(np.zeros((spec.N, spec.P, spec.Q, spec.K), np.int8)).shape
    poison = np.iinfo(ConvSpec.storage(spec.out_dtype)).max
    out = tvm.runtime.tensor(np.full(oshape, poison, ConvSpec.storage(spec.out_dtype)))
    lib["k"](*[tvm.runtime.tensor(np.ascontiguousarray(a)) for a in args], out)
    y = out.numpy().astype(np.int64)
    return np.ascontiguousarray(np.transpose(y, (0, 2, 3, 1))) if io == "NCHW" else y


@needs_avx2
@pytest.mark.parametrize("io", ["NCHW", "NHWC"])
@pytest.mark.parametrize("name", list(SPECS))
def test_kernel_exact(name, io):
    spec = SPECS[name]
    x, w, bias, M, S, res = _random(spec, seed=len(name))
    ref = RF.conv_reference(spec, x, w, bias, M, S, res)
    y = _run_kernel(spec, io, x, w, bias, M, S, res)
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


def test_kernel_refuses_packed_operands():
    with pytest.raises(ValueError, match="uint4"):
        CC.make_cpu_conv(ConvSpec(N=1, H=4, W=4, C=8, K=8, R=1, S=1, x_dtype="uint4"))


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


@needs_avx2
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("bits", [(8, 8), (4, 4), (4, 8)])
def test_dispatch_exact(bits, layout):
    mod, shape = tiny_resnet_qdq(seed=3, w_bits=bits[0], a_bits=bits[1], shape=(2, 3, 13, 11), c=10)
    x = np.random.default_rng(4).standard_normal(shape).astype("float32")
    mi = lower_to_integer(mod, layout, pack_int4=False)
    p = DispatchCPU()
    md = run_pass(p, mi)
    # every conv and the dense on the kernel, the block's residual add fused into conv c2's epilogue
    assert [n for n, _ in p.chosen] == ["q_stem", "q_c1", "q_c2", "q_fc"] and not p.skipped
    assert p.fused == [("q_c2", "q_res")]
    ops = _ops(md)
    assert "relax.nn.conv2d" not in ops and "relax.matmul" not in ops
    y = relax.VirtualMachine(build(md, "llvm"), tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy()
    assert np.array_equal(y, Reference(mi)(x)) and y.std() > 0


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
    # build() decided x86-64-v3 once; the pipeline, run under it by tvm.compile, dispatched
    assert [str(t.attrs.get("mcpu", "")) for t in targets] == ["x86-64-v3"]
    assert set(rec.kernels.values()) == {"cpu_direct_avx2"} and len(rec.kernels) == 4
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
    assert p.chosen == [("q_fc", "cpu_direct_avx2")] and _ops(md).count("relax.nn.conv2d") == 3
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
    T_ = lambda **kw: tvm.target.Target({"kind": "llvm", **kw})
    assert cpu_kernels_target(T_(mcpu="nehalem")) is None                            # x86 without AVX2
    if CC.host_has_avx2():  # (an x86 host triple: the target below is x86)
        assert str(cpu_kernels_target(T_(mattr=["+avx2"])).attrs["mattr"][0]) == "+avx2"  # as given
    a64 = T_(mtriple="aarch64-linux-gnu")
    assert CC.cpu_target(a64).same_as(a64) and cpu_kernels_target(a64) is None
    assert not CC.target_has_avx2(T_(mtriple="aarch64-linux-gnu", mcpu="cortex-a72"))
    mod, _ = tiny_resnet_qdq(seed=11, shape=(1, 3, 9, 9))
    targets = _capture_targets(monkeypatch)
    rec = PipelineRecord()
    build(mod, a64, pipeline=qcompile_pipeline(a64, record=rec))
    assert rec.kernels == {} and "mcpu" not in targets[0].attrs
    assert "not valid" not in capfd.readouterr().err
    # a host without AVX2 (or not x86-64): plain llvm stays plain, the pipeline keeps the generic path
    monkeypatch.setattr(CC, "host_has_avx2", lambda: False)
    assert cpu_kernels_target(T_()) is None and "mcpu" not in CC.cpu_target(T_()).attrs
    targets.clear()
    rec = PipelineRecord()
    build(mod, "llvm", pipeline=qcompile_pipeline("llvm", record=rec))
    assert rec.kernels == {} and "mcpu" not in targets[0].attrs
