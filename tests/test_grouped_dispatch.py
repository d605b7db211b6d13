"""The tensor-core dispatch of grouped and depthwise convs (relay_passes/dispatch_tensor_core.py): the tiny example
nets of ``qmodel`` compiled for CUDA put every depthwise conv on the ``depthwise`` kernel and every other grouped conv
on the ``grouped`` kernel (none left to TVM's generic lowering), and build for sm_90 and sm_75 (nvcc: ptxas accepts
the kernels, their SASS holds IDP.4A), at INT8 and INT4; on a GPU host the compiled models equal the llvm build bit
for bit (GPU tier).
"""
from __future__ import annotations

import numpy as np
import pytest

from conftest import gpu_compute_capability

MODELS = {"mobilenet_v2_tiny": "depthwise", "mobilenet_v3_tiny": "depthwise", "efficientnet_tiny": "depthwise",
          "resnext_tiny": "grouped"}
SHAPE = (2, 3, 32, 32)


def _quiet(_):
    pass


@pytest.fixture(scope="module")
def onnx_models(tmp_path_factory):
    """name -> {bits: ONNX QDQ path}, made as ``qmodel NAME --bits B`` makes them."""
    from qcompile.models.cli import main

    d = tmp_path_factory.mktemp("grouped")
    out = {}
    for name in MODELS:
        out[name] = {}
        for bits in ("8", "4"):
            if bits == "4" and name not in ("mobilenet_v2_tiny", "resnext_tiny"):
                continue
            path = str(d / f"{name}_{bits}.onnx")
            assert main([name, "--bits", bits, "-o", path, "-q"]) == 0
            out[name][bits] = path
    return out


def _grouped_layers(path) -> dict:
    """ONNX Conv nodes with group > 1 -> their group (the layers the dispatch must take)."""
    import onnx

    out = {n.name: g for n in onnx.load(path).graph.node if n.op_type == "Conv"
           for g in [next((a.i for a in n.attribute if a.name == "group"), 1)] if g > 1}
    assert out, "the model has no grouped conv"
    return out


@pytest.mark.nvcc
@pytest.mark.parametrize("name,bits,arch", [(n, "8", "sm_90") for n in MODELS]
                         + [(n, b, a) for n in ("mobilenet_v2_tiny", "resnext_tiny") for b, a in (("4", "sm_90"),
                                                                                               ("8", "sm_75"))])
def test_grouped_convs_dispatched_and_built(onnx_models, name, bits, arch, tmp_path):
    from qcompile.cuda_tools import cuobjdump, find_tool, sass_by_kernel
    from qcompile.driver import CompileOptions, compile_model

    path = onnx_models[name][bits]
    groups = _grouped_layers(path)
    res = compile_model(path, CompileOptions(target="cuda", arch=arch, layout="NHWC", batch=2), log=_quiet)
    kernels = {lay.name: lay.kernel for lay in res.layers}
    assert "generic" not in kernels.values(), kernels
    grouped = [lay for lay in res.layers if lay.op == "conv2d" and lay.w_shape[-1] != lay.in_shape[-1]]
    assert len(grouped) == len(groups), (groups, [lay.name for lay in grouped])
    for lay in grouped:  # (a depthwise conv's weights are [C, R, S, 1])
        want = "depthwise" if lay.w_shape[-1] == 1 and lay.w_shape[0] == lay.in_shape[-1] else "grouped"
        assert lay.kernel.removesuffix("+lut") == want, (lay.name, lay.kernel)  # (+lut: a table in its epilogue)
    assert MODELS[name] in {lay.kernel.removesuffix("+lut") for lay in grouped}
    so = str(tmp_path / "m.so")
    res.export(so)
    if find_tool("cuobjdump"):
        elf = cuobjdump(so, "--list-elf")
        assert f"{arch}.cubin" in elf or (arch == "sm_90" and "sm_90a.cubin" in elf), elf
        sass = sass_by_kernel(so)
        assert any("IDP.4A" in v for v in sass.values()), "no kernel's SASS holds the grouped kernels' dp4a"


def test_depthwise_and_grouped_selection():
    """plan_grouped: depthwise where groups == C == K, grouped otherwise (channel multipliers, Cg > 1); a 4-bit
    output the config cannot pack falls back to one value per byte; HWNC is refused."""
    from qcompile.schedules import ConvSpec
    from qcompile.schedules.depthwise import DwConfig, depthwise_constraints
    from qcompile.schedules.grouped import grouped_constraints, plan_grouped

    base = dict(N=1, H=8, W=8, R=3, S=3, padding=1, x_dtype="uint8", out_dtype="uint8", lo=0, hi=255)
    assert plan_grouped(ConvSpec(C=32, K=32, **base), 32).strategy == "depthwise"
    assert plan_grouped(ConvSpec(C=16, K=32, **base), 16).strategy == "grouped"
    assert plan_grouped(ConvSpec(C=128, K=128, **base), 32).strategy == "grouped"
    p = plan_grouped(ConvSpec(C=10, K=10, **dict(base, out_dtype="uint4", hi=15)), 10)
    assert p.strategy == "depthwise" and p.knobs.vec == 1 and p.spec.out_dtype == "uint8"
    p = plan_grouped(ConvSpec(C=32, K=32, **dict(base, out_dtype="uint4", hi=15)), 32, cfg=DwConfig(vec=4, qt=2))
    assert p.spec.out_dtype == "uint4" and p.funcs[0].attrs["qcompile.strategy"] == "depthwise"
    assert "HWNC" in depthwise_constraints(ConvSpec(C=8, K=8, layout="HWNC", **base), 8)
    assert "divide" in grouped_constraints(ConvSpec(C=12, K=8, **base), 8)


@pytest.mark.gpu
@pytest.mark.nvcc
@pytest.mark.parametrize("name,bits", [(n, b) for n in MODELS for b in ("8", "4")
                                       if b == "8" or n in ("mobilenet_v2_tiny", "resnext_tiny")])
def test_grouped_models_gpu_equal_llvm(onnx_models, name, bits, tmp_path):
    from test_gpu import _arch

    from qcompile.driver import CompileOptions, compile_model
    from qcompile.runtime import Module

    assert gpu_compute_capability() is not None
    path = onnx_models[name][bits]
    cpu_so, gpu_so = str(tmp_path / "cpu.so"), str(tmp_path / "gpu.so")
    compile_model(path, CompileOptions(layout="NHWC", batch=2), log=_quiet).export(cpu_so)
    compile_model(path, CompileOptions(target="cuda", arch=_arch(), layout="NHWC", batch=2), log=_quiet).export(gpu_so)
    cpu, gpu = Module(cpu_so), Module(gpu_so, "cuda")
    for seed in range(2):
        x = np.random.default_rng(100 + seed).standard_normal(SHAPE).astype("float32")
        want, got = cpu(x), gpu(x)
        assert len(np.unique(want)) > 5
        assert np.array_equal(got, want), f"GPU output differs from the llvm build in {np.sum(got != want)} elements"


def _grouped_model(seed=4, zp=9):
    """uint8 input (zero point ``zp``: the padding reads it) -> depthwise 3x3 (16 channels) with a residual add of the
    input -> grouped 3x3 (4 groups, 16 -> 24 channels, stride 2) -> out."""
    from qcompile.qdq import QDQBuilder, qtype

    rng = np.random.default_rng(seed)
    b = QDQBuilder()
    x = b.input("x", (2, 16, 9, 9))
    u8, s8 = qtype(8, False), qtype(8, True)
    d0 = b.dequantize(b.quantize(x, 0.03, zp, u8, name="q_in"), 0.03, zp)
    w1 = b.qweight(rng.integers(-127, 128, (16, 1, 3, 3)), rng.uniform(1e-3, 3e-3, 16), s8, name="w1")
    h = b.conv2d(d0, w1, b.qbias(rng.integers(-999, 999, 16), 6e-5, "b1"), padding=(1, 1, 1, 1), groups=16, name="dw")
    d1 = b.dequantize(b.quantize(h, 0.05, 3, u8, name="q_dw"), 0.05, 3)
    d2 = b.dequantize(b.quantize(b.add(d1, d0), 0.06, 0, u8, name="q_res"), 0.06, 0)
    w2 = b.qweight(rng.integers(-127, 128, (24, 4, 3, 3)), rng.uniform(1e-3, 3e-3, 24), s8, name="w2")
    g = b.conv2d(d2, w2, b.qbias(rng.integers(-999, 999, 24), 1e-4, "b2"), (2, 2), (1, 1, 1, 1), groups=4, name="gr")
    return b.finish([b.dequantize(b.quantize(g, 0.04, 128, u8, name="q_gr"), 0.04, 128, name="out")])


def test_grouped_dispatch_structure():
    """The CUDA dispatch puts the depthwise conv (with the residual add fused in) and the grouped conv on their
    kernels; the te-compute check on a CPU leaves both to the graph, which stays bit-exact."""
    import tvm
    from tvm import relax

    from qcompile.errors import run_pass
    from qcompile.pipeline import build, lower_to_integer
    from qcompile.reference import Reference
    from qcompile.relay_passes import DispatchTensorCore

    mi = lower_to_integer(_grouped_model(), "NHWC", pack_int4=False)
    p = DispatchTensorCore("sm_90")
    md = run_pass(p, mi)
    assert sorted(s for _, s in p.chosen) == ["depthwise", "grouped"], p.chosen
    assert p.fused == [("q_dw", "q_res")]
    ops = [b.value.op.name for blk in md["main"].body.blocks for b in blk.bindings
           if isinstance(b.value, relax.Call) and hasattr(b.value.op, "name")]
    assert "relax.nn.conv2d" not in ops
    p = DispatchTensorCore(target_kind="llvm")
    md = run_pass(p, mi)
    assert p.chosen == []
    x = np.random.default_rng(3).standard_normal((2, 16, 9, 9)).astype("float32")
    y = relax.VirtualMachine(build(md, "llvm"), tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy()
    assert np.array_equal(y, Reference(mi)(x)) and len(np.unique(y)) > 5


def gpu_equals_reference(mod, inputs) -> None:
    """Compile QDQ module ``mod`` for this GPU (NHWC) and check each input of ``inputs`` (float32 arrays) against
    the NumPy integer reference, bit for bit, on varied outputs."""
    import tvm
    from test_gpu import _arch
    from tvm import relax

    from qcompile.pipeline import build, lower_to_integer, qcompile_pipeline
    from qcompile.reference import Reference
    from qcompile.schedules.build import nvcc_options

    target = {"kind": "cuda", "arch": _arch()}
    with nvcc_options(target["arch"], "both"):
        ex = build(mod, target, pipeline=qcompile_pipeline(target, "NHWC"))
    vm = relax.VirtualMachine(ex, tvm.cuda(0))
    ref = Reference(lower_to_integer(mod, "NHWC", pack_int4=False))
    for x in inputs:
        y = vm["main"](tvm.runtime.tensor(x, tvm.cuda(0))).numpy()
        assert np.array_equal(y, ref(x)) and len(np.unique(y)) > 5


@pytest.mark.gpu
@pytest.mark.nvcc
def test_grouped_model_gpu_equals_reference():
    """The small model above compiled for this GPU (residual fused into the depthwise kernel, a pad value, stride 2)
    equals the NumPy integer reference."""
    gpu_equals_reference(_grouped_model(), [np.random.default_rng(20 + seed).standard_normal((2, 16, 9, 9))
                                            .astype("float32") for seed in range(2)])


def test_grouped_record_refused_by_its_space_takes_the_default_and_build_errors_surface(monkeypatch):
    """A grouped layer's record whose knobs the kernel's space refuses for the layer gives way to the default knobs
    (source "default"); an error while planning knobs the space takes is raised, not turned into the default."""
    from qcompile.errors import run_pass
    from qcompile.pipeline import lower_to_integer
    from qcompile.relay_passes import DispatchTensorCore
    from qcompile.schedules import grouped as G
    from qcompile.schedules import tuning as TU
    from qcompile.schedules.grouped import GroupedConfig

    mi = lower_to_integer(_grouped_model(), "NHWC", pack_int4=False)
    real = TU.knobs_for

    def record(kn):
        return lambda spec, arch, device, logs, strategy: ((kn, "device") if strategy == "grouped"
                                                            else real(spec, arch, device, logs, strategy))

    def grouped_plan(p):
        [pk] = [pk for _, pk in p.planned if pk.strategy == "grouped"]
        return pk

    monkeypatch.setattr(TU, "knobs_for", record(GroupedConfig(kt=3)))  # (kt must be 8, 4, 2 or 1)
    p = DispatchTensorCore("sm_90")
    run_pass(p, mi)
    assert grouped_plan(p).source == "default"
    monkeypatch.setattr(TU, "knobs_for", record(GroupedConfig(kt=1, qt=1)))
    p = DispatchTensorCore("sm_90")
    run_pass(p, mi)
    assert grouped_plan(p).source == "device" and grouped_plan(p).knobs.kt == 1
    make = G.make_grouped

    def broken(spec, groups, cfg=None, *a, **k):
        if cfg is not None and cfg.kt == 1:
            raise ValueError("planning broke")
        return make(spec, groups, cfg, *a, **k)

    monkeypatch.setattr(G, "make_grouped", broken)
    with pytest.raises(Exception, match="planning broke"):
        run_pass(DispatchTensorCore("sm_90"), mi)
