"""Small torchvision-shaped CNNs beyond ResNet, quantized by onnxruntime's own ``quantize_static``, for tests.

* :class:`MobileNetV2Mini`: torchvision's MobileNetV2 structure (Conv-BN-ReLU6 stem, inverted residual blocks with a
  depthwise 3x3 conv, linear bottlenecks and residual adds, a 1x1 head conv, global average pool, Linear) at a few
  blocks and narrow widths;
* :class:`ResNeXtMini`: torchvision's ResNeXt bottleneck (1x1, grouped 3x3 with ``groups=32``, 1x1, residual) in two
  stages.

:func:`onnx_model` exports one to ONNX (opset 13, BN folded by the exporter, ReLU6 as ``Clip`` with constant
bounds) and quantizes it with ``onnxruntime.quantization.quantize_static`` in the QDQ or the QOperator format
(per-channel int8 weights, asymmetric uint8 activations, min/max calibration on a seeded batch). Everything is
seeded: the same versions give the same files.
"""
from __future__ import annotations

import os

import numpy as np

INPUT_SHAPE = (2, 3, 32, 32)


def _torch():
    import torch
    from torch import nn

    return torch, nn


def _conv_bn(nn, cin, cout, k, stride=1, groups=1, act=True):
    layers = [nn.Conv2d(cin, cout, k, stride, (k - 1) // 2, groups=groups, bias=False), nn.BatchNorm2d(cout)]
    if act:
        layers.append(nn.ReLU6(inplace=True))
    return nn.Sequential(*layers)


def build_mobilenet_v2_mini(num_classes: int = 10):
    """Stem 3x3/s2 (16) -> IR(t=1, 8) -> IR(t=6, 16, s2) -> IR(t=6, 16, residual) -> 1x1 (64) -> GAP -> Linear."""
    torch, nn = _torch()

    class InvertedResidual(nn.Module):
        def __init__(self, cin, cout, stride, t):
            super().__init__()
            hidden = cin * t
            layers = [] if t == 1 else [_conv_bn(nn, cin, hidden, 1)]
            layers += [_conv_bn(nn, hidden, hidden, 3, stride, groups=hidden), _conv_bn(nn, hidden, cout, 1, act=False)]
            self.conv = nn.Sequential(*layers)
            self.use_res = stride == 1 and cin == cout

        def forward(self, x):
            return x + self.conv(x) if self.use_res else self.conv(x)

    class MobileNetV2Mini(nn.Module):
        def __init__(self):
            super().__init__()
            self.features = nn.Sequential(_conv_bn(nn, 3, 16, 3, 2), InvertedResidual(16, 8, 1, 1),
                                          InvertedResidual(8, 16, 2, 6), InvertedResidual(16, 16, 1, 6),
                                          _conv_bn(nn, 16, 64, 1))
            self.classifier = nn.Sequential(nn.Dropout(0.2), nn.Linear(64, num_classes))

        def forward(self, x):
            x = self.features(x)
            x = nn.functional.adaptive_avg_pool2d(x, (1, 1))
            return self.classifier(torch.flatten(x, 1))

    return MobileNetV2Mini()


def build_resnext_mini(num_classes: int = 10):
    """Stem 3x3 (32) -> two ResNeXt bottlenecks (grouped 3x3, groups=32, width 64; the second with stride 2 and a
    downsample) -> GAP -> Linear."""
    torch, nn = _torch()

    class Bottleneck(nn.Module):
        def __init__(self, cin, width, cout, stride):
            super().__init__()
            self.conv1, self.bn1 = nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width)
            self.conv2 = nn.Conv2d(width, width, 3, stride, 1, groups=32, bias=False)
            self.bn2 = nn.BatchNorm2d(width)
            self.conv3, self.bn3 = nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout)
            self.relu = nn.ReLU(inplace=True)
            self.downsample = None
            if stride != 1 or cin != cout:
                self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

        def forward(self, x):
            out = self.relu(self.bn1(self.conv1(x)))
            out = self.relu(self.bn2(self.conv2(out)))
            out = self.bn3(self.conv3(out))
            return self.relu(out + (x if self.downsample is None else self.downsample(x)))

    class ResNeXtMini(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1, self.bn1, self.relu = nn.Conv2d(3, 32, 3, 2, 1, bias=False), nn.BatchNorm2d(32), nn.ReLU()
            self.layer1 = Bottleneck(32, 64, 32, 1)
            self.layer2 = Bottleneck(32, 64, 64, 2)
            self.fc = nn.Linear(64, num_classes)

        def forward(self, x):
            x = self.layer2(self.layer1(self.relu(self.bn1(self.conv1(x)))))
            return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))

    return ResNeXtMini()


BUILDERS = {"mobilenet_v2_mini": build_mobilenet_v2_mini, "resnext_mini": build_resnext_mini}


def _randomize(net, seed: int):
    """Seeded weights and non-trivial BN statistics (so that BN folding does real work), eval mode."""
    torch, nn = _torch()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, (nn.Conv2d, nn.Linear)):
                fan_in = m.weight[0].numel()
                m.weight.copy_(torch.randn(m.weight.shape, generator=g) * (2.0 / fan_in) ** 0.5)
                if m.bias is not None:
                    m.bias.copy_(torch.randn(m.bias.shape, generator=g) * 0.1)
            elif isinstance(m, nn.BatchNorm2d):
                c = m.num_features
                m.weight.copy_(torch.rand(c, generator=g) + 0.5)
                m.bias.copy_(torch.randn(c, generator=g) * 0.1)
                m.running_mean.copy_(torch.randn(c, generator=g) * 0.1)
                m.running_var.copy_(torch.rand(c, generator=g) * 1.5 + 0.5)
    return net.eval()


def calibration_batch(seed: int = 1, n: int = 16) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, *INPUT_SHAPE[1:])).astype("float32")


def export_float(name: str, path: str, seed: int = 0) -> str:
    """The float network ``name`` exported to ONNX (opset 13, batch ``INPUT_SHAPE[0]``, input ``x``)."""
    torch, _ = _torch()
    torch.manual_seed(seed)
    net = _randomize(BUILDERS[name](), seed)
    import warnings

    with warnings.catch_warnings():  # (the TorchScript exporter's deprecation notes)
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.onnx.export(net, torch.zeros(INPUT_SHAPE), path, input_names=["x"], output_names=["y"],
                          opset_version=13, dynamo=False)
    return path


FORMATS = ("qdq", "qdq_keep", "qop")


def quantize_ort(float_path: str, path: str, fmt: str = "qdq", calib: np.ndarray | None = None) -> str:
    """``quantize_static`` as a user runs it: per-channel int8 weights, uint8 activations, min/max calibration;
    ``fmt`` "qdq" (QuantFormat.QDQ), "qdq_keep" (QDQ with ``QDQKeepRemovableActivations``: every Relu / Clip stays,
    between a DequantizeLinear and a QuantizeLinear of its own, instead of being dropped into the producer's
    quantization range) or "qop" (QuantFormat.QOperator)."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    calib = calibration_batch() if calib is None else calib
    b = INPUT_SHAPE[0]

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.it = iter([{"x": calib[i:i + b]} for i in range(0, len(calib) - b + 1, b)])

        def get_next(self):
            return next(self.it, None)

    import logging

    root = logging.getLogger()
    level, root.level = root.level, logging.ERROR  # (the quantizer's notes go to the root logger)
    try:
        quantize_static(float_path, path, Reader(),
                        quant_format=QuantFormat.QOperator if fmt == "qop" else QuantFormat.QDQ, per_channel=True,
                        activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                        extra_options={"QDQKeepRemovableActivations": fmt == "qdq_keep"})
    finally:
        root.level = level
    return path


def onnx_model(name: str, fmt: str, folder: str, seed: int = 0) -> str:
    """The path of ``name`` quantized in ``fmt`` (see :func:`quantize_ort`) under ``folder`` (made once per folder)."""
    out = os.path.join(folder, f"{name}_{fmt}_s{seed}.onnx")
    if not os.path.exists(out):
        fp = os.path.join(folder, f"{name}_float_s{seed}.onnx")
        if not os.path.exists(fp):
            export_float(name, fp, seed)
        quantize_ort(fp, out, fmt)
    return out


def fresh_input(seed: int, shape=INPUT_SHAPE) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype("float32")


def run_ort(path: str, x: np.ndarray, optimized: bool = False) -> np.ndarray:
    """onnxruntime (CPU) output; ``optimized=False``: graph optimizations off, every node evaluated as written."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3  # (not the notes on the Constant nodes the quantizer leaves unused)
    if not optimized:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    return sess.run(None, {sess.get_inputs()[0].name: x})[0]


def _graph_builders(inits: list, nodes: list):
    """``(init, qdq)`` for a hand-built QDQ graph: ``init(name, array)`` adds an initializer and returns its name;
    ``qdq(src, name, scale, zp)`` appends a uint8 QuantizeLinear / DequantizeLinear pair after ``src`` and returns the
    dequantized value's name."""
    from onnx import helper, numpy_helper

    def init(name, arr):
        inits.append(numpy_helper.from_array(np.asarray(arr), name))
        return name

    def qdq(src, name, scale, zp):
        init(name + "_s", np.float32(scale))
        init(name + "_z", np.uint8(zp))
        nodes.append(helper.make_node("QuantizeLinear", [src, name + "_s", name + "_z"], [name + "_q"], name=name + "_Q"))
        nodes.append(helper.make_node("DequantizeLinear", [name + "_q", name + "_s", name + "_z"], [name + "_dq"],
                                      name=name + "_DQ"))
        return name + "_dq"

    return init, qdq


def qdq_grouped_clip_model(path: str, seed: int = 0, batch: int = 2) -> str:
    """A hand-written ONNX QDQ model (opset 13) of the layers MobileNet / ResNeXt add, with the cases a quantizer's
    output may not show: non-zero activation zero points, padding, stride and dilation, and Clip bounds that cut::

        x (N, 8, 9, 9) -> Q/DQ (uint8, zp 117)
          -> Conv depthwise 3x3 / s2 / pad 1 (group 8, per-channel int8 weights, int32 bias)
          -> Clip(Constant 0, Constant 6) -> Q/DQ (uint8, zp 20: the range [-0.8, 9.4] is wider than the clip's)
          -> Conv grouped 3x3 / dilation 2 / pad 2 (group 4, 8 -> 16 channels)            -> Q/DQ (uint8, zp 128)
          -> Clip(-0.3, 1.0), bounds as Constant nodes with value_float                    -> Q/DQ (uint8, zp 50)
    """
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    inits, nodes = [], []
    init, qdq = _graph_builders(inits, nodes)

    def conv(src, name, s_in, cout, cin_g, group, gain=1.0, **attrs):
        wq = rng.integers(-127, 128, (cout, cin_g, 3, 3)).astype(np.int8)
        ws = (gain * rng.uniform(0.6, 1.4, cout) / (127 * np.sqrt(cin_g * 9) / 2)).astype(np.float32)
        init(name + "_wq", wq)
        init(name + "_ws", ws)
        init(name + "_wz", np.zeros(cout, np.int8))
        nodes.append(helper.make_node("DequantizeLinear", [name + "_wq", name + "_ws", name + "_wz"], [name + "_w"],
                                      axis=0, name=name + "_wDQ"))
        bs = (np.float32(s_in) * ws).astype(np.float32)
        init(name + "_bq", rng.integers(-3000, 3000, cout).astype(np.int32))
        init(name + "_bs", bs)
        init(name + "_bz", np.zeros(cout, np.int32))
        nodes.append(helper.make_node("DequantizeLinear", [name + "_bq", name + "_bs", name + "_bz"], [name + "_b"],
                                      axis=0, name=name + "_bDQ"))
        nodes.append(helper.make_node("Conv", [src, name + "_w", name + "_b"], [name + "_y"], group=group,
                                      kernel_shape=[3, 3], name=name, **attrs))
        return name + "_y"

    def const(name, **value):
        nodes.append(helper.make_node("Constant", [], [name], name=name + "_node", **value))
        return name

    h = qdq("x", "in", 0.03, 117)
    h = conv(h, "dw", 0.03, 8, 1, 8, gain=4.0, strides=[2, 2], pads=[1, 1, 1, 1])
    lo6 = const("zero", value=numpy_helper.from_array(np.float32(0.0)))
    hi6 = const("six", value=numpy_helper.from_array(np.float32(6.0)))
    nodes.append(helper.make_node("Clip", [h, lo6, hi6], ["dw_relu6"], name="relu6"))
    h = qdq("dw_relu6", "a1", 0.04, 20)
    h = conv(h, "gconv", 0.04, 16, 2, 4, dilations=[2, 2], pads=[2, 2, 2, 2])
    h = qdq(h, "a2", 0.03, 128)
    nodes.append(helper.make_node("Clip", [h, const("lo", value_float=-0.3), const("hi", value_float=1.0)], ["clipped"],
                                  name="clip"))
    h = qdq("clipped", "out", 0.01, 50)
    graph = helper.make_graph(nodes, "grouped_clip", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                                   [batch, 8, 9, 9])],
                              [helper.make_tensor_value_info(h, TensorProto.FLOAT, [batch, 16, 5, 5])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    onnx.checker.check_model(model)
    onnx.save(model, path)
    return path


def float_ops_model(path: str, tail: str = "matmul", seed: int = 0, batch: int = 2) -> str:
    """A float ONNX model (opset 13) for the QOperator ops a CNN's quantizer writes besides QLinearConv / QGemm::

        x (N, 8, 8, 8) -> Conv 3x3 (16) -> Relu -> MaxPool 2x2 -> <tail> -> AveragePool 4x4 (global) -> Reshape (N, 16)
          -> MatMul (16 x 10, no bias)

    ``tail``: "matmul" (nothing more), or one op of quantized tensors: "sigmoid", "leakyrelu", "hardswish" (after a
    1x1 conv; opset 14), "mul" (of two branches), "concat" (of two 8-channel convs instead of the 16-channel one),
    "avgpool_s2" (2x2 / stride 2, before a 2x2 global pool), "avgpool" (2x2 / stride 1 padded bottom and right,
    count_include_pad=0: the divisor varies at the edges).
    ``quantize_ort(path, ..., "qop")`` turns them into QLinearMatMul, QLinearAveragePool, QLinearSigmoid, ...
    """
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    inits, nodes = [], []

    def w(name, shape, fan_in):
        inits.append(numpy_helper.from_array((rng.standard_normal(shape) * (2.0 / fan_in) ** 0.5).astype(np.float32),
                                             name))
        return name

    def node(op, ins, out, **attrs):
        nodes.append(helper.make_node(op, ins, [out], name=out + "_node", **attrs))
        return out

    inits.append(numpy_helper.from_array((rng.standard_normal(16) * 0.1).astype(np.float32), "cb"))
    if tail == "concat":
        a = node("Conv", ["x", w("cw1", (8, 8, 3, 3), 72), "cb1"], "conv_a", pads=[1, 1, 1, 1])
        b = node("Conv", ["x", w("cw2", (8, 8, 3, 3), 72)], "conv_b", pads=[1, 1, 1, 1])
        inits.append(numpy_helper.from_array(np.zeros(8, np.float32), "cb1"))
        h = node("Concat", [a, b], "concat", axis=1)
    else:
        h = node("Conv", ["x", w("cw", (16, 8, 3, 3), 72), "cb"], "conv", pads=[1, 1, 1, 1])
    h = node("Relu", [h], "relu")
    h = node("MaxPool", [h], "maxpool", kernel_shape=[2, 2], strides=[2, 2])
    if tail == "sigmoid":
        h = node("Sigmoid", [h], "sigmoid")
    elif tail == "leakyrelu":
        h = node("LeakyRelu", [node("Conv", [h, w("lw", (16, 16, 1, 1), 16)], "conv2")], "leaky", alpha=0.1)
    elif tail == "mul":
        h = node("Mul", [h, node("Conv", [h, w("mw", (16, 16, 1, 1), 16)], "conv2")], "mul")
    elif tail == "avgpool":
        h = node("AveragePool", [h], "avgpool2", kernel_shape=[2, 2], strides=[1, 1], pads=[0, 0, 1, 1])
    elif tail == "avgpool_s2":
        h = node("AveragePool", [h], "avgpool2", kernel_shape=[2, 2], strides=[2, 2])
    elif tail == "hardswish":
        h = node("HardSwish", [node("Conv", [h, w("hw", (16, 16, 1, 1), 16)], "conv2")], "hardswish")
    gap = 2 if tail == "avgpool_s2" else 4
    h = node("AveragePool", [h], "gap", kernel_shape=[gap, gap])
    inits.append(numpy_helper.from_array(np.array([batch, 16], np.int64), "shape"))
    h = node("Reshape", [h, "shape"], "flat")
    node("MatMul", [h, w("fw", (16, 10), 16)], "y")
    graph = helper.make_graph(nodes, "qop_" + tail, [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                                  [batch, 8, 8, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 10])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14 if tail == "hardswish" else 13)])
    model.ir_version = 7
    onnx.checker.check_model(model)
    onnx.save(model, path)
    return path


# ------------------------------------------------------------------------------------------------
# Hand-written QDQ models of one op each (the ops MobileNetV3 / EfficientNet / DenseNet add)
# ------------------------------------------------------------------------------------------------
ELEMENTWISE = {  # ONNX op -> (attributes, float64 NumPy semantics from the ONNX specification)
    "Sigmoid": ({}, lambda x: 1.0 / (1.0 + np.exp(-x))),
    "HardSigmoid": ({"alpha": 0.2, "beta": 0.5},
                    lambda x: np.clip(np.float64(np.float32(0.2)) * x + 0.5, 0.0, 1.0)),
    "HardSwish": ({}, lambda x: x * np.clip(x / 6.0 + 0.5, 0.0, 1.0)),
    "Tanh": ({}, np.tanh),
    "LeakyRelu": ({"alpha": 0.1}, lambda x: np.where(x >= 0, x, np.float64(np.float32(0.1)) * x)),
    "Gelu": ({}, lambda x: 0.5 * x * (1.0 + np.vectorize(__import__("math").erf)(x / np.sqrt(2.0)))),
    "SiLU": ({}, lambda x: x / (1.0 + np.exp(-x))),  # Sigmoid then Mul(x, .), unquantized in between
}


def _qtypes(bits: int):
    """(signed zero-point dtype, unsigned, ONNX element types, opset) for 8- or 4-bit activations."""
    import ml_dtypes
    from onnx import TensorProto

    if bits == 8:
        return np.int8, np.uint8, (TensorProto.INT8, TensorProto.UINT8), 13
    return ml_dtypes.int4, ml_dtypes.uint4, (TensorProto.INT4, TensorProto.UINT4), 21


def elementwise_model(path: str, op: str, bits: int = 8, signed_in: bool = False, shape=(1, 4, 8, 8)) -> tuple:
    """``x -> Q/DQ (s_in, zp_in) -> op -> Q/DQ (s_out, zp_out)``: every input value of the quantized type is reachable.

    Returns ``(path, (s_in, zp_in, qmin, qmax), (s_out, zp_out, qmin_out, qmax_out))``."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    sdt, udt, _, opset = _qtypes(bits)
    qmax_u = 2 ** bits - 1
    if signed_in:
        qlo, qhi, zp_in, dt_in = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1, 2 ** (bits - 3) - 1, sdt
    else:
        qlo, qhi, zp_in, dt_in = 0, qmax_u, (qmax_u * 3) // 5, udt
    s_in = np.float32(8.0 / (qhi - qlo))  # inputs in about [-5, 3]
    attrs, fn = ELEMENTWISE[op]
    lo_hi = fn(np.array([(qlo - zp_in) * float(s_in), (qhi - zp_in) * float(s_in)]))
    grid = fn(np.linspace((qlo - zp_in) * float(s_in), (qhi - zp_in) * float(s_in), 1001))
    ymin, ymax = min(float(grid.min()), 0.0), max(float(grid.max()), float(lo_hi.max()))
    s_out = np.float32((ymax - ymin) / qmax_u * 1.003)
    zp_out = int(np.clip(round(-ymin / float(s_out)), 0, qmax_u))
    inits = [numpy_helper.from_array(np.float32(s_in), "s_in"), numpy_helper.from_array(np.array(zp_in, dt_in), "z_in"),
             numpy_helper.from_array(np.float32(s_out), "s_out"),
             numpy_helper.from_array(np.array(zp_out, udt), "z_out")]
    # (a depthwise 1x1 conv of weight 1: the compiler takes models with a conv; it requantizes to the same values)
    c = shape[1]
    inits += [numpy_helper.from_array(np.ones((c, 1, 1, 1), np.int8), "w"),
              numpy_helper.from_array(np.ones(c, np.float32), "w_s"), numpy_helper.from_array(np.zeros(c, np.int8), "w_z")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "s_in", "z_in"], ["xq"], name="in_Q"),
             helper.make_node("DequantizeLinear", ["xq", "s_in", "z_in"], ["xdq0"], name="in_DQ"),
             helper.make_node("DequantizeLinear", ["w", "w_s", "w_z"], ["wdq"], name="w_DQ", axis=0),
             helper.make_node("Conv", ["xdq0", "wdq"], ["conv"], name="conv", group=c, kernel_shape=[1, 1]),
             helper.make_node("QuantizeLinear", ["conv", "s_in", "z_in"], ["cq"], name="conv_Q"),
             helper.make_node("DequantizeLinear", ["cq", "s_in", "z_in"], ["xdq"], name="conv_DQ")]
    if op == "SiLU":
        nodes += [helper.make_node("Sigmoid", ["xdq"], ["sig"], name="sigmoid"),
                  helper.make_node("Mul", ["xdq", "sig"], ["y"], name="silu")]
    else:
        nodes.append(helper.make_node(op, ["xdq"], ["y"], name=op.lower(), **attrs))
    nodes += [helper.make_node("QuantizeLinear", ["y", "s_out", "z_out"], ["yq"], name="out_Q"),
              helper.make_node("DequantizeLinear", ["yq", "s_out", "z_out"], ["out"], name="out_DQ")]
    graph = helper.make_graph(nodes, op, [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, list(shape))], inits)
    opset_v = max(opset, 20) if op == "Gelu" else opset
    if op == "HardSwish":
        opset_v = max(opset_v, 14)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset_v)])
    model.ir_version = 10 if opset_v >= 21 else 9 if opset_v >= 20 else 8 if opset_v >= 14 else 7
    onnx.checker.check_model(model)
    onnx.save(model, path)
    return path, (float(s_in), zp_in, qlo, qhi), (float(s_out), zp_out, 0, qmax_u)


def two_branch_model(path: str, kind: str, seed: int = 0, batch: int = 2) -> str:
    """A hand-written QDQ model (opset 13, uint8 activations with non-zero zero points) of one op of two quantized
    tensors, or of a pool / batch norm of one::

        x (N, 8, 8, 8) -> Q/DQ -> Conv 3x3 (8) -> Q/DQ 'a'
          kind "mul":      GlobalAveragePool(a) -> Q/DQ -> Conv 1x1 -> Q/DQ -> Sigmoid -> Q/DQ 'g';  Mul(a, g)  (SE)
          kind "concat":   Conv 3x3 (x, 4) -> Q/DQ 'b' (its own scale and zero point);  Concat(a, b)
          kind "avgpool":  AveragePool(a) 2x2 / stride 2                                    (DenseNet's transition)
          kind "avgpool_pad": AveragePool(a) 3x3 / stride 1 / pads 1, count_include_pad=1
          kind "bn":       Concat(a, b) -> BatchNormalization -> Relu  (pre-activation BN, no Q/DQ in between)
          kind "bn_q":     Concat(a, b) -> Q/DQ -> BatchNormalization -> Relu
        -> Q/DQ 'out'
    """
    import onnx
    from onnx import TensorProto, helper

    rng = np.random.default_rng(seed)
    inits, nodes = [], []
    init, qdq = _graph_builders(inits, nodes)

    def conv(src, name, s_in, cout, cin, k):
        wq = rng.integers(-127, 128, (cout, cin, k, k)).astype(np.int8)
        ws = (rng.uniform(0.6, 1.4, cout) / (127 * np.sqrt(cin * k * k) / 2)).astype(np.float32)
        init(name + "_wq", wq)
        init(name + "_ws", ws)
        init(name + "_wz", np.zeros(cout, np.int8))
        nodes.append(helper.make_node("DequantizeLinear", [name + "_wq", name + "_ws", name + "_wz"], [name + "_w"],
                                      axis=0, name=name + "_wDQ"))
        init(name + "_bq", rng.integers(-3000, 3000, cout).astype(np.int32))
        init(name + "_bs", (np.float32(s_in) * ws).astype(np.float32))
        init(name + "_bz", np.zeros(cout, np.int32))
        nodes.append(helper.make_node("DequantizeLinear", [name + "_bq", name + "_bs", name + "_bz"], [name + "_b"],
                                      axis=0, name=name + "_bDQ"))
        nodes.append(helper.make_node("Conv", [src, name + "_w", name + "_b"], [name + "_y"], kernel_shape=[k, k],
                                      pads=[k // 2] * 4, name=name))
        return name + "_y"

    def node(op, ins, out, **attrs):
        nodes.append(helper.make_node(op, ins, [out], name=out, **attrs))
        return out

    x = qdq("x", "in", 0.03, 117)
    a = qdq(conv(x, "conv_a", 0.03, 8, 8, 3), "a", 0.05, 101)
    out_shape = [batch, 8, 8, 8]
    if kind == "mul":
        p = qdq(node("GlobalAveragePool", [a], "gap"), "p", 0.01, 90)
        h = qdq(conv(p, "fc", 0.01, 8, 8, 1), "h", 0.04, 128)
        g = qdq(node("Sigmoid", [h], "sigmoid"), "g", 1 / 255, 0)
        y = node("Mul", [a, g], "mul")
    elif kind in ("concat", "bn", "bn_q"):
        b = qdq(conv(x, "conv_b", 0.03, 4, 8, 3), "b", 0.02, 140)
        y = node("Concat", [a, b], "concat", axis=1)
        out_shape[1] = 12
        if kind != "concat":
            if kind == "bn_q":
                y = qdq(y, "cat", 0.05, 110)
            c = 12
            bn = [init("bn_" + n, v.astype(np.float32)) for n, v in
                  (("g", rng.uniform(0.5, 1.5, c)), ("b", rng.normal(0, 0.3, c)), ("m", rng.normal(0, 0.3, c)),
                   ("v", rng.uniform(0.5, 2.0, c)))]
            y = node("Relu", [node("BatchNormalization", [y] + bn, "bn", epsilon=1e-5)], "relu")
    elif kind == "avgpool":
        y = node("AveragePool", [a], "avgpool", kernel_shape=[2, 2], strides=[2, 2])
        out_shape[2:] = [4, 4]
    elif kind == "avgpool_pad":
        y = node("AveragePool", [a], "avgpool", kernel_shape=[3, 3], pads=[1, 1, 1, 1], count_include_pad=1)
    else:
        raise ValueError(kind)
    out = qdq(y, "out", {"mul": 0.03, "avgpool": 0.02, "avgpool_pad": 0.015}.get(kind, 0.04), 60 if "bn" in kind else 100)
    graph = helper.make_graph(nodes, kind, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 8, 8, 8])],
                              [helper.make_tensor_value_info(out, TensorProto.FLOAT, out_shape)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 7
    onnx.checker.check_model(model)
    onnx.save(model, path)
    return path


def spec_reference(model):
    """``tests/spec_reference.py``'s evaluation of a QDQ model, with the element-wise functions (float64, the ONNX
    specification's formulas above) and Concat."""
    from spec_reference import SpecReference

    class Spec(SpecReference):
        def _fn(self, node, env, fn):
            return fn(self._float(self._get(env, node.input[0])))

        def op_Sigmoid(self, node, env, a):
            return self._fn(node, env, ELEMENTWISE["Sigmoid"][1])

        def op_Tanh(self, node, env, a):
            return self._fn(node, env, np.tanh)

        def op_HardSwish(self, node, env, a):
            return self._fn(node, env, ELEMENTWISE["HardSwish"][1])

        def op_HardSigmoid(self, node, env, a):
            al, be = np.float64(np.float32(a.get("alpha", 0.2))), np.float64(np.float32(a.get("beta", 0.5)))
            return self._fn(node, env, lambda x: np.clip(al * x + be, 0.0, 1.0))

        def op_LeakyRelu(self, node, env, a):
            al = np.float64(np.float32(a.get("alpha", 0.01)))
            return self._fn(node, env, lambda x: np.where(x >= 0, x, al * x))

        def op_Concat(self, node, env, a):
            return np.concatenate([self._float(self._get(env, i)) for i in node.input], axis=a["axis"])

    return Spec(model)
