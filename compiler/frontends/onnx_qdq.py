"""ONNX QDQ frontend: a model as onnxruntime's ``quantize_static`` (QuantFormat.QDQ) or ``qmodel`` writes it.

Accepted: per-channel or per-tensor weights (int8, or INT4 at opset 21), int8 or uint8 activations
(4-bit INT4/UINT4 activations at opset 21), int32 biases through DequantizeLinear, float biases,
BatchNormalization left unfolded or on its own, and the CNN op set: Conv (grouped, depthwise), Gemm/MatMul, Add, Mul
(of two tensors or by a constant), Concat, Relu, Clip, MaxPool, GlobalAveragePool, AveragePool (k x k),
Flatten, Reshape, Identity, and the element-wise functions Sigmoid, HardSigmoid, HardSwish, Tanh, LeakyRelu, Gelu.
Anything else is an :class:`UnsupportedOpError` naming the node.
"""
from __future__ import annotations

import os
from typing import Optional

import numpy as np
import onnx
import onnx.version_converter
from onnx import numpy_helper

from ..errors import QCompileError, UnsupportedOpError
from ..qdq import QDQBuilder, QTYPES, check_scale

# ONNX element type -> our quantized type (zero-point dtype decides the quantized type).
_ONNX_QTYPES = {
    onnx.TensorProto.INT8: QTYPES["int8"],
    onnx.TensorProto.UINT8: QTYPES["uint8"],
    onnx.TensorProto.INT4: QTYPES["int4"],
    onnx.TensorProto.UINT4: QTYPES["uint4"],
}


# The default-domain opset each feature needs (QuantizeLinear/DequantizeLinear exist from opset 10; their `axis`,
# i.e. per-channel weights, from 13; INT4/UINT4 from 21).
MIN_OPSET, PER_CHANNEL_OPSET = 10, 13


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else type(e).__name__


def _default_opset(model: onnx.ModelProto) -> Optional[int]:
    for o in model.opset_import:
        if o.domain in ("", "ai.onnx"):
            return int(o.version)
    return None


def load_onnx(path: str) -> onnx.ModelProto:
    """Read and check an ONNX file; a missing, truncated, corrupt or invalid file, or one of an opset qcompile does not
    read, is a QCompileError that says which."""
    if not os.path.isfile(path):
        raise QCompileError(f"model file '{path}' does not exist")
    try:
        model = onnx.load(path)
    except Exception as e:  # protobuf DecodeError, ...
        raise QCompileError(f"cannot read ONNX model '{path}': file is corrupt or truncated "
                            f"({_first_line(e)})") from None
    if not model.graph.node:
        raise QCompileError(f"ONNX model '{path}' has an empty graph (is it an ONNX model?)")
    opset = _default_opset(model)
    if opset is None:
        raise QCompileError(f"ONNX model '{path}' imports no default ('ai.onnx') opset")
    has_qdq = any(n.op_type in ("QuantizeLinear", "DequantizeLinear") for n in model.graph.node)
    if has_qdq and opset < MIN_OPSET:
        raise QCompileError(f"ONNX model '{path}': opset {opset} is not supported (QuantizeLinear/DequantizeLinear "
                            f"need opset {MIN_OPSET}+, per-channel weights {PER_CHANNEL_OPSET}+; re-export the model "
                            f"with opset {PER_CHANNEL_OPSET} or newer, or convert it with "
                            f"onnx.version_converter.convert_version)")
    newest = onnx.defs.onnx_opset_version()
    if opset > newest:
        raise QCompileError(f"ONNX model '{path}' uses opset {opset}; the installed onnx {onnx.__version__} knows "
                            f"opsets up to {newest} (upgrade the onnx package or export with an older opset)")
    try:
        onnx.checker.check_model(model)
    except Exception as e:  # checker ValidationError
        raise QCompileError(f"ONNX model '{path}' is not a valid model (opset {opset}): {_first_line(e)}") from None
    return model


def _attrs(node) -> dict:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def _to_array(t: onnx.TensorProto) -> np.ndarray:
    arr = numpy_helper.to_array(t)
    if t.data_type in (onnx.TensorProto.INT4, onnx.TensorProto.UINT4):
        # ml_dtypes int4/uint4 -> plain int8/uint8 values
        arr = arr.astype(np.int8 if t.data_type == onnx.TensorProto.INT4 else np.uint8)
    return arr


class _Importer:
    def __init__(self, model: onnx.ModelProto, batch: Optional[int], log):
        self.model = model
        self.batch = batch
        self.log = log
        self.b = QDQBuilder()
        self.consts: dict[str, np.ndarray] = {}
        self.const_types: dict[str, int] = {}
        self.vals: dict = {}          # ONNX tensor name -> relax expr
        self.qdq_consts: dict = {}    # name -> (q array, QType, scale, zp, axis) for DQ of an initializer
        self.dq_values: dict = {}     # name -> its float value (computed on use) of a DequantizeLinear of an initializer
        self.asymmetric: dict = {}    # name -> node: a DequantizeLinear of an initializer with a non-zero zero point
        self.opset = _default_opset(model) or PER_CHANNEL_OPSET
        for t in model.graph.initializer:
            self.consts[t.name] = _to_array(t)
            self.const_types[t.name] = t.data_type

    # -- helpers --------------------------------------------------------------------------------
    def const(self, name: str, node) -> np.ndarray:
        if name not in self.consts:
            raise QCompileError(f"node '{node.name}' ({node.op_type}): input '{name}' must be a constant initializer")
        return self.consts[name]

    def val(self, name: str, node):
        if name in self.vals:
            return self.vals[name]
        if name in self.asymmetric:
            raise UnsupportedOpError("DequantizeLinear", self.asymmetric[name], "asymmetric weights (non-zero weight "
                                     "zero point) are not supported")
        if name in self.consts:
            raise UnsupportedOpError(node.op_type, node.name, f"constant float input '{name}' is not quantized")
        raise QCompileError(f"node '{node.name}' ({node.op_type}): input '{name}' is not produced by any node")

    def _input_shape(self, vi) -> list[int]:
        dims = []
        for i, d in enumerate(vi.type.tensor_type.shape.dim):
            if d.HasField("dim_value") and d.dim_value > 0 and not (i == 0 and self.batch):
                dims.append(d.dim_value)
            elif i == 0:
                if not self.batch:
                    self.log(f"note: input '{vi.name}' has a dynamic batch dimension; compiling for batch 1 (use --batch N)")
                dims.append(self.batch or 1)
            else:
                raise QCompileError(f"input '{vi.name}' has a dynamic dimension {i} ('{d.dim_param}'); only the batch may be dynamic")
        return dims

    # -- main -----------------------------------------------------------------------------------
    def run(self):
        g = self.model.graph
        inputs = [vi for vi in g.input if vi.name not in self.consts]
        if len(inputs) != 1:
            raise QCompileError(f"expected one graph input (an image batch), found {len(inputs)}: {[i.name for i in inputs]}")
        vi = inputs[0]
        if vi.type.tensor_type.elem_type != onnx.TensorProto.FLOAT:
            raise QCompileError(f"input '{vi.name}' has dtype {onnx.TensorProto.DataType.Name(vi.type.tensor_type.elem_type)}; expected FLOAT")
        self.input_name = vi.name
        self.input_shape = self._input_shape(vi)
        self.vals[vi.name] = self.b.input(vi.name, self.input_shape)
        for node in g.node:
            fn = getattr(self, "op_" + node.op_type, None)
            ok_domain = node.domain in ("", "ai.onnx") or (
                node.domain == "com.microsoft" and node.op_type in ("QuantizeLinear", "DequantizeLinear"))
            if fn is None or not ok_domain:
                raise UnsupportedOpError(node.op_type, node.name)
            fn(node)
        outs = [self.val(o.name, g.node[-1]) for o in g.output]
        return self.b.finish(outs)

    # -- quantization ---------------------------------------------------------------------------
    def _qparams(self, node):
        scale = self.const(node.input[1], node)
        check_scale(scale, f"node '{node.name or node.output[0]}' ({node.op_type}), scale '{node.input[1]}'")
        scale = scale.astype("float32")
        if len(node.input) > 2 and node.input[2]:
            zp = self.const(node.input[2], node)
            qt = _ONNX_QTYPES.get(self.const_types[node.input[2]])
            if qt is None and self.const_types[node.input[2]] == onnx.TensorProto.INT32 and node.op_type == "DequantizeLinear":
                qt = None  # an int32 bias; handled by the caller
            elif qt is None:
                raise QCompileError(
                    f"node '{node.name}' ({node.op_type}): zero point dtype "
                    f"{onnx.TensorProto.DataType.Name(self.const_types[node.input[2]])} is not INT8/UINT8/INT4/UINT4"
                )
        else:
            zp, qt = np.zeros(scale.shape, "uint8"), QTYPES["uint8"]
        a = _attrs(node)
        if a.get("block_size", 0):
            raise UnsupportedOpError(node.op_type, node.name, "blocked quantization (block_size) is not supported")
        if scale.size > 1 and self.opset < PER_CHANNEL_OPSET:
            raise QCompileError(f"node '{node.name or node.output[0]}' ({node.op_type}): per-channel scale "
                                f"'{node.input[1]}' needs opset {PER_CHANNEL_OPSET}+; the model is opset "
                                f"{self.opset}")
        return scale, zp, qt, int(a.get("axis", 1))

    def op_QuantizeLinear(self, node):
        scale, zp, qt, axis = self._qparams(node)
        if node.input[0] in self.consts:  # float weight quantized at import time
            x = self.consts[node.input[0]].astype("float64")
            shp = [1] * x.ndim
            if scale.ndim:
                shp[axis] = -1
            q = np.clip(np.round(x / scale.reshape(shp)) + zp.astype("int64").reshape(shp), qt.qmin, qt.qmax)
            self.consts[node.output[0]] = q.astype(qt.storage)
            self.const_types[node.output[0]] = {8: onnx.TensorProto.INT8, 4: onnx.TensorProto.INT4}[qt.bits] if qt.signed else onnx.TensorProto.UINT8
            return
        self.vals[node.output[0]] = self.b.quantize(self.val(node.input[0], node), scale, zp, qt, axis, node.name or node.output[0])

    def op_DequantizeLinear(self, node):
        scale, zp, _, axis = self._qparams(node)
        src = node.input[0]
        name = node.name or node.output[0]
        if src in self.consts:
            q = self.consts[src]
            dt = self.const_types[src]
            if dt == onnx.TensorProto.INT32:
                if np.any(zp != 0):
                    raise QCompileError(f"node '{name}': int32 bias with a non-zero zero point")
                self.dq_values[node.output[0]] = lambda q=q, scale=scale: (q.astype(np.float64)
                                                                         * scale.astype(np.float64)).astype(np.float32)
                self.vals[node.output[0]] = self.b.qbias(q, scale, name)
                return
            qt = _ONNX_QTYPES.get(dt)
            if qt is None:
                raise QCompileError(f"node '{name}': quantized initializer '{src}' has unsupported dtype {onnx.TensorProto.DataType.Name(dt)}")
            # its float value, for the ops that take a constant parameter (BatchNormalization's, quantized by
            # onnxruntime's quantize_static when the BN follows no conv)
            shp = [1] * q.ndim
            if scale.ndim and q.ndim:
                shp[axis % q.ndim] = -1
            self.dq_values[node.output[0]] = lambda q=q, zp=zp, scale=scale, shp=tuple(shp): (
                (q.astype(np.float64) - zp.astype(np.float64).reshape(shp)) * scale.astype(np.float64).reshape(shp)
            ).astype(np.float32)
            if np.any(zp != 0):
                self.asymmetric[node.output[0]] = name
                return
            self.vals[node.output[0]] = self.b.qweight(q, scale, qt, axis=axis if scale.ndim else 0, name=name)
            return
        self.vals[node.output[0]] = self.b.dequantize(self.val(src, node), scale, zp, axis, name)

    # -- compute ops ----------------------------------------------------------------------------
    def op_Conv(self, node):
        a = _attrs(node)
        x, w = self.val(node.input[0], node), self.val(node.input[1], node)
        kshape = [int(s) for s in w.ty.shape]
        if len(kshape) != 4:
            raise UnsupportedOpError("Conv", node.name, f"only 2-D convolution is supported (weight rank {len(kshape)})")
        if a.get("auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET"):
            raise UnsupportedOpError("Conv", node.name, f"auto_pad={a['auto_pad']} is not supported; use explicit pads")
        pads = list(a.get("pads", [0, 0, 0, 0]))
        pad = [pads[0], pads[1], pads[2], pads[3]]  # ONNX: (top, left, bottom, right)
        bias = None
        if len(node.input) > 2 and node.input[2]:
            bias = self.vals.get(node.input[2])
            if bias is None:
                bias = self.b.const(self.const(node.input[2], node).astype("float32"))
        self.vals[node.output[0]] = self.b.conv2d(
            x, w, bias, a.get("strides", [1, 1]), pad, a.get("dilations", [1, 1]), a.get("group", 1), node.name or node.output[0]
        )

    def op_Gemm(self, node):
        a = _attrs(node)
        if a.get("alpha", 1.0) != 1.0 or a.get("beta", 1.0) != 1.0 or a.get("transA", 0):
            raise UnsupportedOpError("Gemm", node.name, "only alpha=1, beta=1, transA=0 is supported")
        x, w = self.val(node.input[0], node), self.val(node.input[1], node)
        if not a.get("transB", 0):
            w = self.b.emit(__import__("tvm").relax.op.permute_dims(w, [1, 0]), (node.name or "gemm") + "_wT")
        bias = None
        if len(node.input) > 2 and node.input[2]:
            bias = self.vals.get(node.input[2])
            if bias is None:
                bias = self.b.const(self.const(node.input[2], node).astype("float32"))
        self.vals[node.output[0]] = self.b.dense(x, w, bias, node.name or node.output[0])

    def op_MatMul(self, node):
        from tvm import relax

        x, w = self.val(node.input[0], node), self.val(node.input[1], node)
        wT = self.b.emit(relax.op.permute_dims(w, [1, 0]), (node.name or "matmul") + "_wT")
        self.vals[node.output[0]] = self.b.dense(x, wT, None, node.name or node.output[0])

    def op_Add(self, node):
        if node.input[1] in self.consts and node.input[1] not in self.vals:  # bias add after MatMul
            self.vals[node.output[0]] = self.b.add(self.val(node.input[0], node), self.b.const(self.consts[node.input[1]]), node.name)
            return
        self.vals[node.output[0]] = self.b.add(self.val(node.input[0], node), self.val(node.input[1], node), node.name or node.output[0])

    def op_Relu(self, node):
        self.vals[node.output[0]] = self.b.relu(self.val(node.input[0], node), node.name or node.output[0])

    def op_Constant(self, node):
        """A constant: its value joins the initializers (Clip bounds, Reshape shapes, ... read it from there)."""
        a = next(iter(node.attribute), None)
        if a is None or len(node.attribute) != 1:
            raise UnsupportedOpError("Constant", node.name, "expected exactly one value attribute")
        if a.name == "value":
            self.consts[node.output[0]] = _to_array(a.t)
            self.const_types[node.output[0]] = a.t.data_type
            return
        kinds = {"value_float": (np.float32, onnx.TensorProto.FLOAT), "value_floats": (np.float32, onnx.TensorProto.FLOAT),
                 "value_int": (np.int64, onnx.TensorProto.INT64), "value_ints": (np.int64, onnx.TensorProto.INT64)}
        if a.name not in kinds:
            raise UnsupportedOpError("Constant", node.name, f"a constant given as '{a.name}' is not supported")
        dtype, onnx_type = kinds[a.name]
        self.consts[node.output[0]] = np.asarray(onnx.helper.get_attribute_value(a), dtype)
        self.const_types[node.output[0]] = onnx_type

    def _scalar_bound(self, node, i: int, default: float) -> float:
        if len(node.input) <= i or not node.input[i]:
            return default
        v = self.const(node.input[i], node)
        if v.size != 1:
            raise UnsupportedOpError(node.op_type, node.name, f"bound '{node.input[i]}' is not a scalar")
        return float(v.reshape(()))

    def op_Clip(self, node):
        a = _attrs(node)
        lo = self._scalar_bound(node, 1, float(a.get("min", -np.inf)))  # (opset < 11: bounds as attributes)
        hi = self._scalar_bound(node, 2, float(a.get("max", np.inf)))
        if np.isnan(lo) or np.isnan(hi) or lo == np.inf or hi == -np.inf or lo > hi:
            raise QCompileError(f"node '{node.name}' (Clip): bounds [{lo}, {hi}] are not a valid range")
        x = self.val(node.input[0], node)
        if lo == -np.inf and hi == np.inf:
            self.vals[node.output[0]] = x
        elif lo == 0 and hi == np.inf:
            self.vals[node.output[0]] = self.b.relu(x, node.name)
        else:
            self.vals[node.output[0]] = self.b.clip(x, lo, hi, node.name)

    def op_MaxPool(self, node):
        a = _attrs(node)
        if a.get("storage_order", 0) or len(node.output) > 1 and node.output[1]:
            raise UnsupportedOpError("MaxPool", node.name, "indices output / storage_order are not supported")
        k = a["kernel_shape"]
        pads = list(a.get("pads", [0, 0, 0, 0]))
        self.vals[node.output[0]] = self.b.max_pool2d(
            self.val(node.input[0], node), k, a.get("strides", [1, 1]), pads, a.get("dilations", [1, 1]),
            bool(a.get("ceil_mode", 0)), node.name or node.output[0],
        )

    def op_GlobalAveragePool(self, node):
        self.vals[node.output[0]] = self.b.global_avg_pool(self.val(node.input[0], node), node.name or node.output[0])

    def op_AveragePool(self, node):
        from tvm import relax

        a = _attrs(node)
        x = self.val(node.input[0], node)
        if len(x.ty.shape) != 4:
            raise UnsupportedOpError("AveragePool", node.name, f"only 2-D pooling of NCHW tensors is supported (input "
                                     f"rank {len(x.ty.shape)})")
        h, w = int(x.ty.shape[2]), int(x.ty.shape[3])
        if a.get("auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET"):
            raise UnsupportedOpError("AveragePool", node.name, f"auto_pad={a['auto_pad']} is not supported; use explicit "
                                     f"pads")
        k = list(a["kernel_shape"])
        if len(k) != 2:
            raise UnsupportedOpError("AveragePool", node.name, f"only 2-D pooling is supported (kernel {k})")
        pads = list(a.get("pads", [0, 0, 0, 0]))
        if k == [h, w] and not any(pads):
            self.vals[node.output[0]] = self.b.global_avg_pool(x, node.name)
            return
        if any(pads) and not a.get("count_include_pad", 0):
            raise UnsupportedOpError("AveragePool", node.name, "padding with count_include_pad=0 (a divisor that varies "
                                     "at the edges) is not supported")
        self.vals[node.output[0]] = self.b.emit(relax.op.nn.avg_pool2d(
            x, k, list(a.get("strides", [1, 1])), pads, list(a.get("dilations", [1, 1])), bool(a.get("ceil_mode", 0)),
            bool(a.get("count_include_pad", 0))), node.name or node.output[0])

    # -- element-wise functions, products, concatenation -------------------------------------------
    def _unary(self, node, make):
        self.vals[node.output[0]] = self.b.emit(make(self.val(node.input[0], node)), node.name or node.output[0])

    def op_Sigmoid(self, node):
        from tvm import relax

        self._unary(node, relax.op.sigmoid)

    def op_Tanh(self, node):
        from tvm import relax

        self._unary(node, relax.op.tanh)

    def op_LeakyRelu(self, node):
        from tvm import relax

        alpha = float(_attrs(node).get("alpha", 0.01))
        self._unary(node, lambda x: relax.op.nn.leakyrelu(x, alpha))

    def op_Gelu(self, node):
        from tvm import relax

        approx = _attrs(node).get("approximate", b"none")
        approx = approx.decode() if isinstance(approx, bytes) else approx
        if approx not in ("none", "tanh"):
            raise UnsupportedOpError("Gelu", node.name, f"approximate='{approx}' is not supported")
        self._unary(node, relax.op.nn.gelu if approx == "none" else relax.op.nn.gelu_tanh)

    def _hard_sigmoid(self, x, alpha: float, beta: float, name: str):
        """``max(0, min(1, alpha * x + beta))`` in float32 ops (ONNX HardSigmoid)."""
        from tvm import relax

        f32 = lambda v: relax.const(np.float32(v), "float32")  # noqa: E731
        y = self.b.emit(relax.op.add(relax.op.multiply(x, f32(alpha)), f32(beta)), name + "_affine")
        return self.b.emit(relax.op.clip(y, 0.0, 1.0), name)

    def op_HardSigmoid(self, node):
        a = _attrs(node)
        self.vals[node.output[0]] = self._hard_sigmoid(self.val(node.input[0], node), float(a.get("alpha", 0.2)),
                                                       float(a.get("beta", 0.5)), node.name or node.output[0])

    def op_HardSwish(self, node):
        from tvm import relax

        x = self.val(node.input[0], node)
        name = node.name or node.output[0]
        hs = self._hard_sigmoid(x, 1.0 / 6.0, 0.5, name + "_hardsigmoid")
        self.vals[node.output[0]] = self.b.emit(relax.op.multiply(x, hs), name)

    def op_Mul(self, node):
        from tvm import relax

        ins = []
        for i in node.input[:2]:
            if i in self.consts and i not in self.vals:
                ins.append(self.b.const(np.asarray(self.consts[i], np.float32)))
            else:
                ins.append(self.val(i, node))
        self.vals[node.output[0]] = self.b.emit(relax.op.multiply(ins[0], ins[1]), node.name or node.output[0])

    def op_Concat(self, node):
        from tvm import relax

        xs = [self.val(i, node) for i in node.input]
        self.vals[node.output[0]] = self.b.emit(relax.op.concat(xs, axis=int(_attrs(node)["axis"])),
                                                node.name or node.output[0])

    def op_Flatten(self, node):
        if _attrs(node).get("axis", 1) != 1:
            raise UnsupportedOpError("Flatten", node.name, "only axis=1 is supported")
        self.vals[node.output[0]] = self.b.flatten(self.val(node.input[0], node), node.name or node.output[0])

    def op_Reshape(self, node):
        x = self.val(node.input[0], node)
        shape = [int(s) for s in self.const(node.input[1], node)]
        shape = [int(x.ty.shape[i]) if s == 0 else s for i, s in enumerate(shape)]
        if -1 in shape:
            total = int(np.prod([int(s) for s in x.ty.shape]))
            known = int(np.prod([s for s in shape if s != -1]))
            shape[shape.index(-1)] = total // known
        self.vals[node.output[0]] = self.b.reshape(x, shape, node.name or node.output[0])

    def op_Identity(self, node):
        if node.input[0] in self.consts:
            self.consts[node.output[0]] = self.consts[node.input[0]]
            self.const_types[node.output[0]] = self.const_types[node.input[0]]
        else:
            self.vals[node.output[0]] = self.val(node.input[0], node)

    def op_BatchNormalization(self, node):
        a = _attrs(node)
        g, beta, mean, var = (self.dq_values[n]() if n in self.dq_values else self.const(n, node) for n in node.input[1:5])
        self.vals[node.output[0]] = self.b.batch_norm(self.val(node.input[0], node), g, beta, mean, var, a.get("epsilon", 1e-5), node.name)


def from_onnx(path_or_model, batch: Optional[int] = None, log=print):
    """Import an ONNX QDQ model, or a QOperator-format one (rewritten to QDQ by :mod:`.onnx_qop`), into the QDQ-form
    Relax module (see :mod:`qcompile.qdq`).

    Returns ``(mod, info)`` where ``info`` has the input name and shape.
    """
    from .onnx_qop import is_qoperator, qoperator_to_qdq

    model = load_onnx(path_or_model) if isinstance(path_or_model, str) else path_or_model
    fmt = "onnx"
    if is_qoperator(model):  # QLinearConv, QGemm, ...: rewritten to the equivalent QDQ graph first
        model, fmt = qoperator_to_qdq(model, lambda op: hasattr(_Importer, "op_" + op)), "onnx-qop"
    imp = _Importer(model, batch, log)
    try:
        mod = imp.run()
    except BaseException:
        imp.b.discard()
        raise
    return mod, {"input_name": imp.input_name, "input_shape": imp.input_shape, "format": fmt}


def is_float_model(model: onnx.ModelProto) -> bool:
    """A model with no QuantizeLinear/DequantizeLinear at all is a float model."""
    return not any(n.op_type in ("QuantizeLinear", "DequantizeLinear") for n in model.graph.node)


def quantize_float_onnx(model: onnx.ModelProto, bits: Optional[str], calibrate: Optional[str], batch: Optional[int], log=print):
    """Post-training quantization of a float ONNX model with onnxruntime's ``quantize_static`` (QDQ).

    Per-channel symmetric weights, per-tensor activations calibrated (min/max) on ``calibrate``
    (a .npy of float32 NCHW images). ``bits`` "8": int8 weights, uint8 activations; "4": int4
    weights and uint4 activations (opset 21), the first conv and the last Gemm kept at 8 bits.
    """
    import tempfile

    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    if bits is None:
        raise QCompileError("the model is a float model (no QuantizeLinear/DequantizeLinear); "
                            "pass --bits 8|4 and --calibrate data.npy to quantize it")
    if bits == "mixed":
        raise QCompileError("--bits mixed needs a per-layer configuration; quantize the model with "
                            "`qmodel ... --bits mixed` (or HAWQ) and compile the result")
    if not calibrate:
        raise QCompileError(f"the model is a float model: --bits {bits} needs calibration data (--calibrate data.npy, float32 NCHW images)")
    from ..checks import read_image_array

    inits = {t.name for t in model.graph.initializer}
    inputs = [vi for vi in model.graph.input if vi.name not in inits]
    if len(inputs) != 1:
        raise QCompileError(f"expected one graph input (an image batch), found {len(inputs)}: "
                            f"{[i.name for i in inputs]}")
    inp = inputs[0]
    dims = [d.dim_value for d in inp.type.tensor_type.shape.dim]
    if len(dims) != 4:
        raise QCompileError(f"the model input '{inp.name}' has rank {len(dims)}; qcompile compiles image models "
                            f"(N, C, H, W)")
    data = read_image_array(calibrate, "calibration data", channels=dims[1] or None,
                            hw=tuple(dims[2:]) if all(dims[2:]) else None, min_images=dims[0] or 1)
    fixed_b = dims[0] or 0

    class _Reader(CalibrationDataReader):
        def __init__(self):
            n = fixed_b or 1
            self.batches = iter([{inp.name: data[i:i + n]} for i in range(0, len(data) - n + 1, n)])

        def get_next(self):
            return next(self.batches, None)

    log(f"      post-training quantization ({bits}-bit) with onnxruntime quantize_static on {len(data)} images")
    wt, at = (QuantType.QInt8, QuantType.QUInt8) if bits == "8" else (QuantType.QInt4, QuantType.QUInt4)
    extra = {}
    if bits == "4":
        # the input quantize, the first conv's weights and the last layer's weights and output stay 8-bit
        mm = [n for n in model.graph.node if n.op_type in ("Conv", "Gemm", "MatMul")]
        over = {inp.name: [{"quant_type": QuantType.QInt8}]}
        for n in (mm[0], mm[-1]):
            over[n.input[1]] = [{"quant_type": QuantType.QInt8, "axis": 0}]
        over[mm[-1].output[0]] = [{"quant_type": QuantType.QInt8}]
        extra["TensorQuantOverrides"] = over
        if model.opset_import[0].version < 21:
            model = onnx.version_converter.convert_version(model, 21)
    with tempfile.TemporaryDirectory() as d:
        src, dst = os.path.join(d, "float.onnx"), os.path.join(d, "q.onnx")
        onnx.save(model, src)
        import logging

        root = logging.getLogger()
        level, root.level = root.level, logging.ERROR  # onnxruntime's quantizer warns on the root logger
        try:
            quantize_static(src, dst, _Reader(), quant_format=QuantFormat.QDQ, per_channel=True, weight_type=wt,
                            activation_type=at, extra_options=extra)
        except Exception as e:
            raise QCompileError(f"post-training quantization failed in onnxruntime: {type(e).__name__}: {e}") from None
        finally:
            root.level = level
        return onnx.load(dst)
