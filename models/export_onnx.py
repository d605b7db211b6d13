"""Export a :class:`~.quantize.QuantizedModel` as an ONNX QDQ model, laid out as
onnxruntime's ``quantize_static(quant_format=QuantFormat.QDQ, per_channel=True)`` does.

Graph (``x^`` = DequantizeLinear(QuantizeLinear(x))):

    input (float NCHW) -> Q -> DQ
    Conv(DQ(x), DQ(W, per-channel axis 0), DQ(B int32, scale = s_in * s_w, zp 0, axis 0))
        [-> Relu] -> Q -> DQ              (the stem, and every conv followed by a ReLU)
    block:   conv ... last conv -> Q -> DQ;   downsample.0 -> Q -> DQ
             Add(DQ(last conv), DQ(identity)) -> Relu -> Q -> DQ
    DQ -> MaxPool -> Q -> DQ                 (same scale / zero point as its input)
    DQ -> GlobalAveragePool -> Q -> DQ -> Flatten -> Q -> DQ (Flatten shares the avgpool scale)
    Gemm(DQ(x), DQ(W [O, I], axis 0), DQ(B int32, axis 0), transB=1) -> Q -> DQ -> logits (float)

Conventions
-----------
* Scales are float32 scalars (activations) or float32 ``[O]`` vectors (weights, biases);
  every zero point is 0.  Activation zero points are ``uint8`` for unsigned tensors
  (ReLU outputs: conv+ReLU, add+ReLU, max-pool, avgpool) and ``int8`` for signed
  ones (input, the pre-add conv outputs, logits); 4-bit tensors use ``uint4`` / ``int4``.
* Weights: ``int8`` initializers; 4-bit weights are real ``TensorProto.INT4``
  initializers (packed two per byte, first element in the low nibble, as onnx does)
  with ``INT4`` zero points.  Biases: ``int32``, DQ zero point ``int32`` 0.
* Opset 13 (IR 7) when every tensor is 8-bit; opset 21 (IR 10) as soon as any weight
  or activation is 4-bit (INT4/UINT4 need opset 21).
* Names: input ``input``, output ``logits``; initializers ``<layer>.weight_quantized``,
  ``<layer>.weight_scale``, ``<layer>.bias_quantized``, ``<act>_scale``, ``<act>_zero_point``
  where ``<layer>``/``<act>`` are the torchvision module / quantization-point names.
* ``metadata_props`` carries ``qcompile.arch`` and ``qcompile.bits`` (JSON per-point bits).

onnxruntime and 4-bit (checked with onnxruntime 1.32, CPU EP)
---------------------------------------------------------------
ORT loads and runs these opset-21 models, including ``QuantizeLinear`` /
``DequantizeLinear`` with ``int4``/``uint4`` activations and per-axis ``INT4`` weight
initializers.  It has no 4-bit integer conv kernels, so it leaves the Q/DQ pairs
in place and runs Conv/Gemm in float on dequantized values -- numerically this is
the fake-quant forward itself.  One ORT bug: at optimization level EXTENDED/ALL
its QDQ rules turn ``DQ -> MaxPool -> Q`` on a ``uint4`` tensor into a MaxPool on
``uint4``, which is not a valid MaxPool type, so session creation fails with
``INVALID_GRAPH`` (resnet18/50 under ``--bits 4``); ``ORT_ENABLE_BASIC`` runs them
(:func:`run_onnx` picks it for any model with 4-bit initializers).  8-bit models are fused into ``QLinearConv`` /
integer kernels; they (and plain float summation order) can flip a rounding by
one step at any quantization point.  On a 3-block net that is at most one logit
step; through deep nets a flip can compound (resnet50 int8 at 48x48 on random
weights: up to 4 logit steps, mixed: 9, on a logit relative error of ~3%).
"""
from __future__ import annotations

import json
from typing import Optional

import ml_dtypes
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from .quantize import ActQuant, QLayer, QuantizedModel

__all__ = ["to_onnx", "export_onnx", "run_onnx", "has_4bit", "ONNX_NP_DTYPES"]

ONNX_NP_DTYPES = {"int8": np.int8, "uint8": np.uint8, "int4": ml_dtypes.int4, "uint4": ml_dtypes.uint4}


class _Graph:
    def __init__(self):
        self.nodes: list[onnx.NodeProto] = []
        self.inits: dict[str, onnx.TensorProto] = {}

    def init(self, name: str, arr: np.ndarray) -> str:
        if name not in self.inits:
            self.inits[name] = numpy_helper.from_array(arr, name)
        return name

    def node(self, op: str, inputs: list[str], output: str, name: Optional[str] = None, **attrs) -> str:
        self.nodes.append(helper.make_node(op, inputs, [output], name=name or output, **attrs))
        return output

    def qdq(self, x: str, a: ActQuant, tag: Optional[str] = None) -> str:
        """``x -> QuantizeLinear -> DequantizeLinear``; returns the DQ output name."""
        s = self.init(f"{a.name}_scale", np.array(a.scale, np.float32))
        z = self.init(f"{a.name}_zero_point", np.array(a.zero_point, ONNX_NP_DTYPES[a.dtype]))
        t = tag or a.name
        q = self.node("QuantizeLinear", [x, s, z], f"{t}_quantized")
        return self.node("DequantizeLinear", [q, s, z], f"{t}_dequantized")

    def weights(self, l: QLayer) -> tuple[str, str]:
        """DQ(weight) (per-channel axis 0) and DQ(int32 bias, scale s_in*s_w)."""
        wdt = np.int8 if l.w_bits == 8 else ml_dtypes.int4
        O = l.weight.shape[0]
        w = self.init(f"{l.name}.weight_quantized", l.weight.astype(wdt))
        ws = self.init(f"{l.name}.weight_scale", l.weight_scale.astype(np.float32))
        wz = self.init(f"{l.name}.weight_zero_point", np.zeros(O, wdt))
        wdq = self.node("DequantizeLinear", [w, ws, wz], f"{l.name}.weight_dequantized", axis=0)
        b = self.init(f"{l.name}.bias_quantized", l.bias.astype(np.int32))
        bs = self.init(f"{l.name}.bias_scale", l.bias_scale)
        bz = self.init(f"{l.name}.bias_zero_point", np.zeros(O, np.int32))
        bdq = self.node("DequantizeLinear", [b, bs, bz], f"{l.name}.bias_dequantized", axis=0)
        return wdq, bdq

    def layer(self, l: QLayer, x: str) -> str:
        """Conv/Gemm [+ Relu] + Q/DQ of ``l.output``; ``x`` is an already dequantized input."""
        wdq, bdq = self.weights(l)
        if l.kind == "conv":
            k = list(l.weight.shape[2:])
            y = self.node("Conv", [x, wdq, bdq], f"{l.name}.conv_out", name=l.name,
                          kernel_shape=k, strides=[l.stride] * 2, pads=[l.padding] * 4,
                          dilations=[1, 1], group=l.groups)
        else:
            y = self.node("Gemm", [x, wdq, bdq], f"{l.name}.gemm_out", name=l.name,
                          alpha=1.0, beta=1.0, transB=1)
        if l.relu:
            y = self.node("Relu", [y], f"{l.name}.relu_out", name=f"{l.name}.relu")
        return self.qdq(y, l.output)


def to_onnx(qm: QuantizedModel, input_shape: tuple[int, ...], batch: Optional[int] = 1,
            opset: Optional[int] = None) -> onnx.ModelProto:
    """Build the QDQ ``ModelProto``. ``input_shape`` is NCHW (N is replaced by ``batch``;
    ``batch=None`` gives a symbolic ``N``). ``opset`` defaults to 13 / 21 (any 4-bit)."""
    four = qm.min_bits == 4
    if opset is None:
        opset = 21 if four else 13
    if four and opset < 21:
        raise ValueError(f"4-bit tensors need opset >= 21, got {opset}")
    g = _Graph()
    x = g.qdq("input", qm.input_act)
    x = g.layer(qm.stem, x)
    if qm.maxpool is not None:
        mp = qm.maxpool
        y = g.node("MaxPool", [x], "maxpool_out", name="maxpool", kernel_shape=[mp["kernel"]] * 2,
                   strides=[mp["stride"]] * 2, pads=[mp["padding"]] * 4)
        x = g.qdq(y, qm.stem.output, tag="maxpool")
    for b in qm.blocks:
        inp, out = x, x
        for c in b.convs:
            out = g.layer(c, out)
        identity = g.layer(b.downsample, inp) if b.downsample is not None else inp
        y = g.node("Add", [out, identity], f"{b.name}.add_out", name=f"{b.name}.add")
        y = g.node("Relu", [y], f"{b.name}.relu_out", name=f"{b.name}.relu")
        x = g.qdq(y, b.output)
    y = g.node("GlobalAveragePool", [x], "avgpool_out", name="avgpool")
    x = g.qdq(y, qm.avgpool_act)
    y = g.node("Flatten", [x], "flatten_out", name="flatten", axis=1)
    x = g.qdq(y, qm.avgpool_act, tag="flatten")
    x = g.layer(qm.fc, x)
    g.node("Identity", [x], "logits", name="output")

    n = batch if batch is not None else "N"
    graph = helper.make_graph(
        g.nodes, f"{qm.arch}_qdq",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, [n, *input_shape[1:]])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [n, qm.fc.weight.shape[0]])],
        initializer=list(g.inits.values()))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)],
                              producer_name="qcompile.models", producer_version="0.1")
    model.ir_version = 10 if opset >= 21 else 7
    helper.set_model_props(model, {"qcompile.arch": qm.arch,
                                   "qcompile.bits": json.dumps({k: [v.w_bits, v.a_bits] for k, v in qm.bits.items()})})
    onnx.checker.check_model(model, full_check=True)
    return model


def export_onnx(qm: QuantizedModel, path: str, input_shape: tuple[int, ...], batch: Optional[int] = 1,
                opset: Optional[int] = None) -> onnx.ModelProto:
    """:func:`to_onnx` then ``onnx.save`` to ``path`` (written under a temporary name beside it and renamed, so a
    failure leaves no partial file); returns the model."""
    from qcompile.checks import atomic_output

    model = to_onnx(qm, input_shape, batch, opset)
    with atomic_output(path) as tmp:
        onnx.save(model, tmp)
    return model


def has_4bit(model: onnx.ModelProto) -> bool:
    return any(t.data_type in (TensorProto.INT4, TensorProto.UINT4) for t in model.graph.initializer)


def ort_int8_kernels_exact() -> bool:
    """Whether onnxruntime's fused int8 CPU kernels (the QLinearConv / QGemm its graph optimizer makes of a QDQ
    Conv / Gemm) compute exact integer sums on this machine. On x86 without VNNI (AVX2 / AVX-512 with no
    ``avx512_vnni`` / ``avx_vnni`` flag) its u8 x s8 kernels add products pairwise in saturating int16
    (``vpmaddubsw``), the overflow onnxruntime's ``reduce_range`` option exists for: the outputs then differ from the
    QDQ graph's own semantics by several quantization steps. Elsewhere (VNNI, ARM) they are exact."""
    import platform

    if platform.machine().lower() not in ("x86_64", "amd64", "i386", "i686"):
        return True
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((ln.split(":", 1)[1].split() for ln in f if ln.startswith("flags")), [])
    except OSError:
        return False
    return "avx512_vnni" in flags or "avx_vnni" in flags


def run_onnx(path_or_model, x: np.ndarray, disable_optimizations: bool = False) -> np.ndarray:
    """Run with onnxruntime (CPU EP); a model with a static batch is fed ``x`` in slices of that batch.

    Models with 4-bit tensors run at ``ORT_ENABLE_BASIC``: at the extended level ORT's QDQ
    rules drop the DQ/Q around MaxPool without checking the type and fail with
    ``INVALID_GRAPH ... tensor(uint4) ... MaxPool`` (onnxruntime 1.32). ``disable_optimizations``: the graph
    as written, each DequantizeLinear / float op / QuantizeLinear on its own -- the QDQ format's defining semantics,
    whatever this CPU's int8 kernels do (see :func:`ort_int8_kernels_exact`).
    """
    import onnxruntime as ort
    model = path_or_model if isinstance(path_or_model, onnx.ModelProto) else onnx.load(path_or_model)
    so = ort.SessionOptions()
    so.log_severity_level = 3
    if disable_optimizations:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    elif has_4bit(model):
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    inp = sess.get_inputs()[0]
    x = np.asarray(x, np.float32)
    if isinstance(inp.shape[0], int) and inp.shape[0] != x.shape[0]:
        b = inp.shape[0]
        return np.concatenate([sess.run(None, {inp.name: x[i:i + b]})[0] for i in range(0, x.shape[0], b)])
    return sess.run(None, {inp.name: x})[0]


def export_onnx_ort(model, path: str, input_shape: tuple[int, ...], calib: np.ndarray, bits: int = 8,
                    batch: Optional[int] = 1) -> onnx.ModelProto:
    """A float network (any of :mod:`.mobile`'s) quantized by onnxruntime's own ``quantize_static`` as a user runs
    it, written as ONNX QDQ: the float model exported by ``torch.onnx`` (opset 13, eval mode: dropout gone, every BN
    that follows a conv folded into it; DenseNet's pre-activation BNs stay), then per-channel symmetric int8 weights
    and asymmetric uint8 activations calibrated (min/max) on ``calib`` (float32 NCHW). ``bits`` 4: the compiler's
    ``--bits 4`` scheme (4-bit weights and activations but the input, the first conv and the last layer; opset 21).
    Written under a temporary name and renamed; returns the model."""
    import os
    import tempfile
    import warnings

    import torch

    from qcompile.checks import atomic_output
    from qcompile.frontends.onnx_qdq import quantize_float_onnx

    with tempfile.TemporaryDirectory() as d:
        fp = os.path.join(d, "float.onnx")
        n = batch or 1
        with warnings.catch_warnings():  # (the TorchScript exporter's deprecation notes)
            warnings.simplefilter("ignore")
            torch.onnx.export(model.eval(), torch.zeros((n, *input_shape[1:])), fp, input_names=["input"],
                              output_names=["logits"], opset_version=13, dynamo=False,
                              dynamic_axes=None if batch else {"input": {0: "N"}, "logits": {0: "N"}})
        cp = os.path.join(d, "calib.npy")
        calib = np.asarray(calib, np.float32)
        if batch:  # (a fixed batch calibrates in whole batches)
            calib = calib[: max(batch, len(calib) // batch * batch)]
        np.save(cp, calib)
        qmodel = quantize_float_onnx(onnx.load(fp), str(bits), cp, batch, log=lambda *_: None)
    with atomic_output(path) as tmp:
        onnx.save(qmodel, tmp)
    return qmodel
