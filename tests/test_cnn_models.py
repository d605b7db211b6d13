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


# ------------------------------------------------------------------------------------------------
# MobileNetV2 / V3, EfficientNet, DenseNet (models/mobile.py), quantized by onnxruntime's quantize_static
# ------------------------------------------------------------------------------------------------
def test_mobile_structures_are_torchvisions():
    from qcompile.models.resnet import build_model

    counts = {"mobilenet_v2": 3_504_872, "mobilenet_v3_large": 5_483_032, "efficientnet_b0": 5_288_548,
              "densenet121": 7_978_856}  # torchvision's
    for name, n in counts.items():
        assert sum(p.numel() for p in build_model(name).parameters()) == n, name
    v3 = build_model("mobilenet_v3_large")
    assert isinstance(v3.features[4].block[2].scale_activation, torch.nn.Hardsigmoid)
    assert v3.features[4].block[2].fc1.out_channels == 24 and v3.features[1].block[0][0].groups == 16
    d = build_model("densenet121")
    assert d.features.denseblock4.denselayer16.conv1.in_channels == 992 and d.classifier.in_features == 1024


@pytest.mark.parametrize("name,ops,layout", [
    ("mobilenet_v2_tiny", {"Add", "Conv"}, "NHWC"),  # ReLU6: the quantizer folds it into the ranges
    ("mobilenet_v3_tiny", {"HardSigmoid", "Mul"}, "NCHW"),       # hardswish = x * hardsigmoid(x); SE
    ("efficientnet_tiny", {"Sigmoid", "Mul"}, "HWNC"),           # SiLU = x * sigmoid(x); SE
    ("densenet_tiny", {"Concat", "BatchNormalization", "AveragePool"}, "NHWC"),
])
def test_mobile_tiny_onnx(tmp_path, name, ops, layout):
    """The tiny nets at INT8 through qmodel's path (export_onnx_ort): bit-exact against the NumPy reference; within one
    output step of onnxruntime on the QDQ graph evaluated literally (optimizations off) and the same top-1."""
    from onnx import numpy_helper

    from qcompile.models.export_onnx import export_onnx_ort, run_onnx
    from qcompile.models.resnet import build_model

    calib = np.random.default_rng(1).standard_normal((16, 3, 32, 32)).astype("float32")
    path = str(tmp_path / f"{name}.onnx")
    model = export_onnx_ort(build_model(name, seed=3), path, (2, 3, 32, 32), calib, batch=2)
    assert ops <= {n.op_type for n in model.graph.node}
    res = compile_model(path, CompileOptions(layout=layout, batch=2), log=_quiet)
    last_dq = [n for n in model.graph.node if n.op_type == "DequantizeLinear"][-1]
    step = float(next(numpy_helper.to_array(t) for t in model.graph.initializer if t.name == last_dq.input[1]))
    ref = Reference(res.integer_mod)
    for seed in range(2):  # fresh inputs each time
        x = np.random.default_rng(80 + seed).standard_normal((2, 3, 32, 32)).astype("float32")
        y = _run(res, x)
        assert np.array_equal(y, ref(x)), "compiled module differs from the NumPy integer reference"
        y_ort = run_onnx(path, x, disable_optimizations=True)
        _within_one_step(y, y_ort, step)
        assert np.array_equal(y.argmax(1), y_ort.argmax(1))
        assert len(np.unique(y)) > 5
