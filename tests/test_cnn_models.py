"""The example models beyond ResNet (``qmodel resnext_tiny``, ``mobilenet_v2_tiny``, ``vgg_tiny``, ...) and the
ResNets at other, non-square input sizes: torchvision's structure, quantized and exported by qcompile.models (or
onnxruntime's / torchao's quantizers), compiled for llvm.

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


# ------------------------------------------------------------------------------------------------
# VGG (models/vgg.py), quantized by onnxruntime's quantize_static
# ------------------------------------------------------------------------------------------------
def test_vgg_structure_is_torchvisions():
    from qcompile.models.resnet import build_model
    from qcompile.models.vgg import check_input_hw

    v = build_model("vgg16")
    assert sum(p.numel() for p in v.parameters()) == 138_357_544  # torchvision's vgg16
    convs = [m for m in v.features if isinstance(m, torch.nn.Conv2d)]
    assert len(convs) == 13 and all(c.kernel_size == (3, 3) and c.padding == (1, 1) for c in convs)
    assert [i for i, m in enumerate(v.features) if isinstance(m, torch.nn.MaxPool2d)] == [4, 9, 16, 23, 30]
    assert v.classifier[0].in_features == 25088 and v.classifier[6].out_features == 1000  # (torchvision's indices)
    assert check_input_hw(v, 224, 224) is None and check_input_hw(v, 448, 224) is None
    assert "5x5 feature map, not a multiple of the adaptive pool's 7x7" in check_input_hw(v, 160, 160)
    tiny = build_model("vgg_tiny")
    assert [type(m).__name__ for m in tiny.features] == [type(m).__name__ for m in v.features]
    assert tiny.classifier[0].in_features == 32 * 2 * 2
    assert "smaller than the 5 max pools' 32x32" in check_input_hw(tiny, 16, 64)


def _vgg_tiny_onnx(tmp_path, bits: int, hw=(64, 64)):
    from qcompile.models.export_onnx import export_onnx_ort
    from qcompile.models.resnet import build_model

    calib = np.random.default_rng(1).standard_normal((8, 3, *hw)).astype("float32")
    path = str(tmp_path / f"vgg_tiny_{bits}.onnx")
    return path, export_onnx_ort(build_model("vgg_tiny", seed=3), path, (2, 3, *hw), calib, bits=bits, batch=2)


@pytest.mark.parametrize("bits,layout", [(8, "NHWC"), (4, "NCHW")])
def test_vgg_tiny_onnx(tmp_path, bits, layout):
    """vgg_tiny through qmodel's path (export_onnx_ort), INT8 and INT4 (8-bit ends): bit-exact against the NumPy
    reference; within one output step of onnxruntime on the QDQ graph evaluated literally; the first dense layer reads
    the flattened 32x2x2 feature map (the layout's flatten order matters)."""
    from onnx import numpy_helper

    from qcompile.models.export_onnx import run_onnx

    path, model = _vgg_tiny_onnx(tmp_path, bits)
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("Conv") == 13 and ops.count("MaxPool") == 5 and ops.count("Gemm") == 3
    res = compile_model(path, CompileOptions(layout=layout, batch=2), log=_quiet)
    assert [lay.in_shape[-1] for lay in res.layers if lay.op == "dense"] == [128, 64, 64]
    last_dq = [n for n in model.graph.node if n.op_type == "DequantizeLinear"][-1]
    step = float(next(numpy_helper.to_array(t) for t in model.graph.initializer if t.name == last_dq.input[1]))
    ref = Reference(res.integer_mod)
    for seed in range(2):
        x = np.random.default_rng(90 + seed).standard_normal((2, 3, 64, 64)).astype("float32")
        y = _run(res, x)
        assert np.array_equal(y, ref(x)), "compiled module differs from the NumPy integer reference"
        _within_one_step(y, run_onnx(path, x, disable_optimizations=True), step)
        assert len(np.unique(y)) > 5


def test_vgg_tiny_pt2e_non_square(tmp_path):
    """vgg_tiny at 64 high x 192 wide through torchao's XNNPACKQuantizer (PT2E): the 2x6 feature map's 2x2 adaptive
    pool is a fixed 1x3 average pool; bit-exact against the NumPy reference, within one output step of PyTorch's
    output of the converted program. (A window of 3 has no exact ties: a 1x2 window's frequent half-step ties,
    rounded to even by PyTorch and up by qcompile, would move the logits by more than a step.)"""
    import logging
    import warnings

    from qcompile.models.export_pt2 import run_pt2
    from qcompile.models.pt2e_quantizers import export_pt2e
    from qcompile.models.resnet import build_model

    shape = (2, 3, 64, 192)
    logging.getLogger("torchao").setLevel(logging.ERROR)
    calib = torch.randn(8, *shape[1:], generator=torch.Generator().manual_seed(4))
    path = str(tmp_path / "vgg_tiny_xnnpack.pt2")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ep = export_pt2e(build_model("vgg_tiny", seed=3), "xnnpack", path, torch.randn(shape), calib)
    assert any("adaptive_avg_pool2d" in str(n.target) for n in ep.graph_module.graph.nodes)
    res = compile_model(path, CompileOptions(layout="NHWC", batch=2), log=_quiet)
    assert res.meta["input_shape"] == list(shape)
    step = [n for n in ep.graph_module.graph.nodes if "dequantize_per_tensor" in str(n.target)][-1].args[1]
    x = np.random.default_rng(61).standard_normal(shape).astype("float32")
    y = _run(res, x)
    assert np.array_equal(y, Reference(res.integer_mod)(x))
    _within_one_step(y, run_pt2(ep, torch.from_numpy(x)).numpy(), float(step))
    assert len(np.unique(y)) > 5


def test_vgg16_wide_dense(tmp_path):
    """VGG-16's first dense layer (25088 = 512 x 7 x 7 inputs, the flattened feature map after the 7x7 adaptive
    pool) lowers for llvm and is exact: a VGG of one 512-channel conv and one max pool at 14x14, whose classifier reads
    the same 25088 values (hidden width 16: with the full VGG-16's 4096 x 25088 matrix, quantizing and compiling
    take ~45 s on 2 cores). Bit-exact against the NumPy reference, within one output step of onnxruntime (which
    checks the flatten order of the NHWC layout)."""
    from onnx import numpy_helper

    from qcompile.models.export_onnx import export_onnx_ort, run_onnx
    from qcompile.models.resnet import randomize_bn
    from qcompile.models.vgg import VGG

    with torch.random.fork_rng():
        torch.manual_seed(4)
        net = randomize_bn(VGG((512, "M"), num_classes=10, pool=7, hidden=16)).eval()
    assert net.classifier[0].in_features == 25088
    calib = np.random.default_rng(1).standard_normal((4, 3, 14, 14)).astype("float32")
    path = str(tmp_path / "vgg_wide.onnx")
    model = export_onnx_ort(net, path, (1, 3, 14, 14), calib, bits=8, batch=1)
    res = compile_model(path, CompileOptions(layout="NHWC"), log=_quiet)
    dense = [lay for lay in res.layers if lay.op == "dense"]
    assert dense[0].in_shape == (1, 25088) and dense[0].w_bits == 8
    last_dq = [n for n in model.graph.node if n.op_type == "DequantizeLinear"][-1]
    step = float(next(numpy_helper.to_array(t) for t in model.graph.initializer if t.name == last_dq.input[1]))
    x = np.random.default_rng(95).standard_normal((1, 3, 14, 14)).astype("float32")
    y = _run(res, x)
    assert np.array_equal(y, Reference(res.integer_mod)(x))
    _within_one_step(y, run_onnx(path, x, disable_optimizations=True), step)
    assert len(np.unique(y)) > 5


# ------------------------------------------------------------------------------------------------
# Other input sizes: a non-square ResNet (qmodel --input-size HxW)
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt,bits,layout", [("onnx", "mixed", "NHWC"), ("pt2", 4, "HWNC")])
def test_resnet_tiny_non_square(tmp_path, fmt, bits, layout):
    """resnet_tiny at 24 high x 40 wide (H != W all the way to the global pool), quantized by qcompile.models,
    exported as ONNX QDQ / PT2E and compiled for llvm: the compiled module takes (2, 3, 24, 40), equals the NumPy
    integer reference on fresh inputs, and is within one output step of the fake-quant PyTorch model."""
    from qcompile.models.export_onnx import export_onnx
    from qcompile.models.export_pt2 import export_pt2
    from qcompile.models.quantize import quantize_model
    from qcompile.models.resnet import build_model

    shape = (2, 3, 24, 40)
    calib = torch.randn(8, *shape[1:], generator=torch.Generator().manual_seed(1))
    qm = quantize_model(build_model("resnet_tiny", seed=5), calib, bits=bits, arch="resnet_tiny")
    path = str(tmp_path / f"r_tiny_24x40.{fmt}")
    if fmt == "onnx":
        export_onnx(qm, path, shape, batch=2)
    else:
        export_pt2(qm, path, torch.randn(*shape), calib=calib)
    res = compile_model(path, CompileOptions(layout=layout, batch=2), log=_quiet)
    assert res.meta["input_shape"] == list(shape)
    assert [lay.out_shape for lay in res.layers if lay.op == "conv2d"][-1] in ((2, 6, 10, 64), (6, 10, 2, 64))
    ref = Reference(res.integer_mod)
    for seed in range(2):
        x = np.random.default_rng(70 + seed).standard_normal(shape).astype("float32")
        y = _run(res, x)
        assert np.array_equal(y, ref(x))
        with torch.no_grad():
            _within_one_step(y, qm(torch.from_numpy(x)).numpy(), qm.fc.output.scale)
        assert len(np.unique(y)) > 5


def test_densenet_tiny_non_square(tmp_path):
    """densenet_tiny at 40 high x 24 wide (its 2x2 average pool and concats on a non-square map), INT8 through
    qmodel's path: bit-exact against the NumPy reference, within one output step of onnxruntime."""
    from onnx import numpy_helper

    from qcompile.models.export_onnx import export_onnx_ort, run_onnx
    from qcompile.models.resnet import build_model

    shape = (2, 3, 40, 24)
    calib = np.random.default_rng(1).standard_normal((8, *shape[1:])).astype("float32")
    path = str(tmp_path / "densenet_tiny_40x24.onnx")
    model = export_onnx_ort(build_model("densenet_tiny", seed=3), path, shape, calib, batch=2)
    res = compile_model(path, CompileOptions(layout="NHWC", batch=2), log=_quiet)
    assert res.meta["input_shape"] == list(shape)
    last_dq = [n for n in model.graph.node if n.op_type == "DequantizeLinear"][-1]
    step = float(next(numpy_helper.to_array(t) for t in model.graph.initializer if t.name == last_dq.input[1]))
    x = np.random.default_rng(75).standard_normal(shape).astype("float32")
    y = _run(res, x)
    assert np.array_equal(y, Reference(res.integer_mod)(x))
    _within_one_step(y, run_onnx(path, x, disable_optimizations=True), step)
    assert len(np.unique(y)) > 5
