"""The example ResNeXt models (``qmodel resnext_tiny`` / ``resnext50_32x4d``): torchvision's structure, quantized and
exported by qcompile.models, compiled for llvm.

* bit-exact: the compiled module equals the NumPy integer reference of its integer graph;
* within ONE output step of the framework that defines the model: the exporter's fake-quant PyTorch model
  (``QuantizedModel.forward``), onnxruntime on the ONNX QDQ file with graph optimizations off, PyTorch on the PT2E
  program. The step is the rounding convention: those round half to even in float32, qcompile rounds half up in
  fixed point with 31-bit multipliers, which moves a value by one step only where it lands within float32 rounding
  of a tie.
"""
import numpy as np
import pytest
import torch
import tvm
from tvm import relax

from qcompile.driver import CompileOptions, compile_model
from qcompile.reference import Reference


def _run(res, x):
    return relax.VirtualMachine(res.executable, tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy()


def _quiet(_):
    pass


def _within_one_step(y, ref, step):
    err = np.abs(y.astype(np.float64) - np.asarray(ref, np.float64))
    assert err.max() <= step * (1 + 1e-5), f"{err.max() / step:.2f} output steps apart"


def test_resnext_structure_is_torchvisions():
    from qcompile.models.resnet import build_model

    m = build_model("resnext50_32x4d")
    assert sum(p.numel() for p in m.parameters()) == 25_028_904  # torchvision's resnext50_32x4d
    assert m.layer1[0].conv2.groups == 32 and m.layer1[0].conv2.weight.shape == (128, 4, 3, 3)
    assert m.layer4[2].conv2.weight.shape == (1024, 32, 3, 3) and m.layer2[0].conv2.stride == (2, 2)
    tiny = build_model("resnext_tiny")
    assert [blk.conv2.weight.shape[1] for blk in (tiny.layer1[0], tiny.layer2[0], tiny.layer3[0])] == [4, 8, 16]
    with pytest.raises(ValueError, match="BasicBlock only supports groups=1"):
        from qcompile.models.resnet import BasicBlock

        BasicBlock(8, 8, groups=2)


@pytest.fixture(scope="module")
def qtiny():
    from qcompile.models.quantize import quantize_model
    from qcompile.models.resnet import build_model

    calib = torch.randn(16, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    return quantize_model(build_model("resnext_tiny", seed=3), calib, bits=8, arch="resnext_tiny")


def test_resnext_tiny_onnx(qtiny, tmp_path):
    from qcompile.models.export_onnx import export_onnx, run_onnx

    path = str(tmp_path / "rxt.onnx")
    model = export_onnx(qtiny, path, (2, 3, 32, 32), batch=2)
    assert sorted({a.i for n in model.graph.node if n.op_type == "Conv" for a in n.attribute if a.name == "group"}) \
        == [1, 8]
    res = compile_model(path, CompileOptions(layout="NHWC", batch=2), log=_quiet)
    assert sum(lay.w_shape[-1] in (4, 8, 16) and lay.op == "conv2d" for lay in res.layers) >= 3
    step = qtiny.fc.output.scale
    ref = Reference(res.integer_mod)
    for seed in range(2):
        x = np.random.default_rng(40 + seed).standard_normal((2, 3, 32, 32)).astype("float32")
        y = _run(res, x)
        assert np.array_equal(y, ref(x))
        _within_one_step(y, run_onnx(path, x, disable_optimizations=True), step)
        with torch.no_grad():
            _within_one_step(y, qtiny(torch.from_numpy(x)).numpy(), step)
        assert len(np.unique(y)) > 5


def test_resnext_tiny_pt2e(qtiny, tmp_path):
    from qcompile.models.export_pt2 import export_pt2, load_pt2, run_pt2

    path = str(tmp_path / "rxt.pt2")
    export_pt2(qtiny, path, torch.randn(2, 3, 32, 32))
    res = compile_model(path, CompileOptions(layout="HWNC", batch=2), log=_quiet)
    ep = load_pt2(path)
    step = [n for n in ep.graph_module.graph.nodes if "dequantize_per_tensor" in str(n.target)][-1].args[1]
    x = np.random.default_rng(50).standard_normal((2, 3, 32, 32)).astype("float32")
    y = _run(res, x)
    assert np.array_equal(y, Reference(res.integer_mod)(x))
    _within_one_step(y, run_pt2(ep, torch.from_numpy(x)).numpy(), float(step))


def test_grouped_conv_has_no_hawq_form(qtiny, tmp_path):
    from qcompile.models.export_hawq import export_hawq

    with pytest.raises(ValueError, match="layer 'layer1.0.conv2' is a grouped conv \\(groups=8\\)"):
        export_hawq(qtiny, str(tmp_path / "rxt.pth"))


@pytest.mark.slow
def test_resnext50_32x4d_compiles_and_matches_the_reference(tmp_path):
    """The full ResNeXt-50 (32x4d) at 64x64, INT8, through qmodel's path; bit-exact against the reference."""
    from qcompile.models.export_onnx import export_onnx
    from qcompile.models.quantize import quantize_model
    from qcompile.models.resnet import build_model

    calib = torch.randn(4, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    qm = quantize_model(build_model("resnext50_32x4d", num_classes=10), calib, bits=8, arch="resnext50_32x4d")
    path = str(tmp_path / "rx50.onnx")
    export_onnx(qm, path, (1, 3, 64, 64), batch=1)
    res = compile_model(path, CompileOptions(layout="NHWC"), log=_quiet)
    x = np.random.default_rng(60).standard_normal((1, 3, 64, 64)).astype("float32")
    y = _run(res, x)
    assert np.array_equal(y, Reference(res.integer_mod)(x))
    with torch.no_grad():
        _within_one_step(y, qm(torch.from_numpy(x)).numpy(), qm.fc.output.scale)
