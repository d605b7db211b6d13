"""ONNX QOperator format -> ONNX QDQ: each quantized operator becomes DequantizeLinear -> float op -> QuantizeLinear.

The QOperator format (onnxruntime's ``quantize_static(..., quant_format=QuantFormat.QOperator)``, the ONNX model zoo's
int8 models) keeps quantized tensors between ``QLinear*`` operators, each of which takes its inputs' and its output's
scale and zero point. Every such operator is defined as the float operator on the dequantized inputs, quantized to
its output's parameters; :func:`qoperator_to_qdq` writes exactly that, so the QDQ frontend
(:mod:`qcompile.frontends.onnx_qdq`) and everything after it take the model unchanged::

    QLinearConv(x, sx, zx, w, sw, zw, sy, zy, B)        Conv(DQ(x), DQ(w, axis 0), DQ(B, sx * sw, 0, axis 0))
    QLinearMatMul(a, sa, za, b, sb, zb, sy, zy)         MatMul(DQ(a), DQ(b)); a constant b becomes the Gemm weight
                                                        Gemm(DQ(a), DQ(b^T, axis 0), transB=1)
    QGemm(a, sa, za, b, sb, zb, C, sy, zy)              Gemm(DQ(a), DQ(b), DQ(C, sa * sb)); no sy: a float output
    QLinearAdd / QLinearMul(a, sa, za, b, sb, zb, sy, zy)   Add / Mul(DQ(a), DQ(b))
    QLinearConcat(sy, zy, (x_i, s_i, z_i)...)           Concat(DQ(x_i)...)
    QLinearGlobalAveragePool / QLinearAveragePool       GlobalAveragePool / AveragePool(DQ(x))
    QLinearSigmoid / QLinearLeakyRelu                   Sigmoid / LeakyRelu(DQ(x))

each followed by ``QuantizeLinear(., sy, zy)`` into the operator's own output name. Operators that move quantized
values without computing (Flatten, Reshape, MaxPool, Transpose, Squeeze, Unsqueeze, Identity) are the float operator
between a DequantizeLinear and a QuantizeLinear with the same parameters -- exact, since they commute with the
monotone quantization. The float operators keep the QOperator node's name, so an error in a later phase names the
node of the user's model. An int32 bias is dequantized with the float32 product ``sx * sw``: the lowering divides it
by the same product again and recovers the integer exactly (for |bias| < 2^23).
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..errors import QCompileError, UnsupportedOpError

# QOperator ops: (number of quantized data inputs, float op) -- inputs are (x, scale, zp) triples, then (sy, zy).
_UNARY = {"QLinearGlobalAveragePool": "GlobalAveragePool", "QLinearAveragePool": "AveragePool",
          "QLinearSigmoid": "Sigmoid", "QLinearLeakyRelu": "LeakyRelu"}
_BINARY = {"QLinearAdd": "Add", "QLinearMul": "Mul"}
QOPERATOR_OPS = frozenset({"QLinearConv", "QLinearMatMul", "QGemm", "QLinearConcat", *_UNARY, *_BINARY})
# ops that move quantized values unchanged (applied to a quantized tensor, the result keeps its parameters)
_MOVERS = frozenset({"Flatten", "Reshape", "MaxPool", "Transpose", "Squeeze", "Unsqueeze", "Identity"})
# attributes of the QOperator ops that the float op does not take
_DROP_ATTRS = {"channels_last"}


def is_qoperator(model: onnx.ModelProto) -> bool:
    """Whether the model holds QOperator-format operators (QLinearConv, QGemm, ...)."""
    return any(n.op_type in QOPERATOR_OPS for n in model.graph.node)


class _Rewriter:
    def __init__(self, model: onnx.ModelProto, supported):
        self.model = model
        self.supported = supported
        self.inits = {t.name: t for t in model.graph.initializer}
        self.consts: dict[str, np.ndarray] = {}  # Constant node outputs
        self.qparams: dict[str, tuple] = {}  # quantized tensor -> (scale name, zero-point name or "")
        self.dq_of: dict[str, str] = {}  # quantized tensor -> its dequantized tensor
        self.nodes: list = []
        self.new_inits: list = []
        self.names: set = {o for n in model.graph.node for o in n.output} | set(self.inits) | {
            i.name for i in model.graph.input}

    # -- helpers ----------------------------------------------------------------------------------
    def fresh(self, base: str) -> str:
        name, i = base, 1
        while name in self.names:
            name, i = f"{base}_{i}", i + 1
        self.names.add(name)
        return name

    def array(self, name: str, node) -> np.ndarray:
        if name in self.inits:
            return numpy_helper.to_array(self.inits[name])
        if name in self.consts:
            return self.consts[name]
        raise QCompileError(f"node '{node.name}' ({node.op_type}): input '{name}' must be a constant initializer")

    def add_init(self, base: str, arr: np.ndarray) -> str:
        name = self.fresh(base)
        t = numpy_helper.from_array(arr, name)
        self.new_inits.append(t)
        self.inits[name] = t
        return name

    def dq(self, x: str, scale: str, zp: str, node, axis: Optional[int] = None) -> str:
        """The dequantized ``x`` (one DequantizeLinear per activation tensor; weights per use)."""
        key = x if axis is None else None
        if key is not None and key in self.dq_of:
            return self.dq_of[key]
        out = self.fresh(f"{x}_dequantized")
        attrs = {} if axis is None else {"axis": axis}
        self.nodes.append(helper.make_node("DequantizeLinear", [x, scale] + ([zp] if zp else []), [out],
                                           name=self.fresh(f"{node.name or x}_DQ_{x}"), **attrs))
        if key is not None:
            self.dq_of[key] = out
        return out

    def q(self, y_float: str, out: str, scale: str, zp: str, node):
        self.nodes.append(helper.make_node("QuantizeLinear", [y_float, scale] + ([zp] if zp else []), [out],
                                           name=self.fresh(f"{node.name or out}_Q")))
        self.qparams[out] = (scale, zp)

    def float_op(self, node, op_type: str, inputs: list, attrs: dict) -> str:
        if not self.supported(op_type):
            raise UnsupportedOpError(node.op_type, node.name, f"{op_type} of quantized tensors has no integer lowering")
        y = self.fresh(f"{node.output[0]}_float")
        self.nodes.append(helper.make_node(op_type, inputs, [y], name=node.name or y, **attrs))
        return y

    @staticmethod
    def attrs(node) -> dict:
        return {a.name: helper.get_attribute_value(a) for a in node.attribute if a.name not in _DROP_ATTRS}

    def weight_axis(self, scale: str, node, axis: int) -> Optional[int]:
        return axis if self.array(scale, node).size > 1 else None

    def bias(self, node, b: str, s_x: str, s_w: str) -> str:
        """DequantizeLinear of an int32 bias with scale ``s_x * s_w`` (float32, per output channel where s_w is)."""
        scale = (self.array(s_x, node).astype(np.float32).reshape(())
                 * self.array(s_w, node).astype(np.float32)).astype(np.float32)
        if self.array(b, node).dtype != np.int32:
            raise UnsupportedOpError(node.op_type, node.name, f"bias '{b}' is not int32")
        s = self.add_init(f"{b}_scale", scale)
        z = self.add_init(f"{b}_zero_point", np.zeros(scale.shape, np.int32))
        out = self.fresh(f"{b}_dequantized")
        self.nodes.append(helper.make_node("DequantizeLinear", [b, s, z], [out], name=self.fresh(f"{node.name}_DQ_bias"),
                                           **({"axis": 0} if scale.size > 1 else {})))
        return out

    # -- ops --------------------------------------------------------------------------------------
    def run(self) -> onnx.ModelProto:
        for node in self.model.graph.node:
            if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
                a = node.attribute[0] if len(node.attribute) == 1 else None
                if a is not None and a.name == "value":
                    self.consts[node.output[0]] = numpy_helper.to_array(a.t)
                self.nodes.append(node)
                continue
            fn = getattr(self, "op_" + node.op_type, None)
            if node.op_type in QOPERATOR_OPS and node.domain in ("", "ai.onnx", "com.microsoft"):
                fn(node)
            elif node.op_type == "QuantizeLinear":
                self.nodes.append(node)
                self.qparams[node.output[0]] = (node.input[1], node.input[2] if len(node.input) > 2 else "")
            elif node.op_type in _MOVERS and node.input and node.input[0] in self.qparams:
                self.mover(node)
            else:
                self.nodes.append(node)
        g = self.model.graph
        graph = helper.make_graph(self.nodes, g.name, g.input, g.output, list(g.initializer) + self.new_inits,
                                  value_info=[])
        opsets = [o for o in self.model.opset_import if o.domain not in ("", "ai.onnx", "com.microsoft")]
        version = max(13, next((o.version for o in self.model.opset_import if o.domain in ("", "ai.onnx")), 13))
        out = helper.make_model(graph, opset_imports=[helper.make_opsetid("", version)] + opsets,
                                producer_name="qcompile.onnx_qop")
        out.ir_version = self.model.ir_version
        return out

    def mover(self, node):
        s, z = self.qparams[node.input[0]]
        x = self.dq(node.input[0], s, z, node)
        y = self.float_op(node, node.op_type, [x] + list(node.input[1:]), self.attrs(node))
        self.q(y, node.output[0], s, z, node)
        for extra in node.output[1:]:
            if extra:
                raise UnsupportedOpError(node.op_type, node.name, "a second output on a quantized tensor")

    def op_QLinearConv(self, node):
        i = list(node.input) + [""] * (9 - len(node.input))
        x = self.dq(i[0], i[1], i[2], node)
        w = self.dq(i[3], i[4], i[5], node, axis=self.weight_axis(i[4], node, 0) or 0)
        ins = [x, w] + ([self.bias(node, i[8], i[1], i[4])] if i[8] else [])
        self.q(self.float_op(node, "Conv", ins, self.attrs(node)), node.output[0], i[6], i[7], node)

    def _gemm(self, node, a, sa, za, b, sb, zb, c, sy, zy, trans_b: int):
        if b in self.inits or b in self.consts:  # a constant weight: (N, K) with per-row (output channel) scales
            bq, bs = self.array(b, node), self.array(sb, node)
            if not trans_b:
                bq = np.ascontiguousarray(bq.T)
                b = self.add_init(f"{b}_transposed", bq)
            w = self.dq(b, sb, zb, node, axis=0 if bs.size > 1 else None)
            ins = [self.dq(a, sa, za, node), w] + ([self.bias(node, c, sa, sb)] if c else [])
            y = self.float_op(node, "Gemm", ins, {"transB": 1})
        else:
            if c:
                raise UnsupportedOpError(node.op_type, node.name, "a bias with a non-constant B")
            bb = self.dq(b, sb, zb, node)
            if trans_b:
                bb = self.float_op(node, "Transpose", [bb], {"perm": [1, 0]})
            y = self.float_op(node, "MatMul", [self.dq(a, sa, za, node), bb], {})
        if sy:
            self.q(y, node.output[0], sy, zy, node)
        else:  # a float output
            self.nodes.append(helper.make_node("Identity", [y], [node.output[0]], name=self.fresh(f"{node.name}_out")))

    def op_QLinearMatMul(self, node):
        i = list(node.input)
        if b_rank := self._rank(i[3], node):
            if b_rank != 2:
                raise UnsupportedOpError(node.op_type, node.name, f"a constant B of rank {b_rank} (only 2-D weights)")
        self._gemm(node, i[0], i[1], i[2], i[3], i[4], i[5], "", i[6], i[7], trans_b=0)

    def _rank(self, name, node) -> int:
        return self.array(name, node).ndim if (name in self.inits or name in self.consts) else 0

    def op_QGemm(self, node):
        a = self.attrs(node)
        if a.get("alpha", 1.0) != 1.0 or a.get("beta", 1.0) != 1.0 or a.get("transA", 0):
            raise UnsupportedOpError("QGemm", node.name, "only alpha=1, beta=1, transA=0 is supported")
        i = list(node.input) + [""] * (9 - len(node.input))
        self._gemm(node, i[0], i[1], i[2], i[3], i[4], i[5], i[6], i[7], i[8], trans_b=int(a.get("transB", 0)))

    def op_QLinearConcat(self, node):
        sy, zy, rest = node.input[0], node.input[1], list(node.input[2:])
        if len(rest) % 3:
            raise QCompileError(f"node '{node.name}' (QLinearConcat): inputs must be (x, scale, zero point) triples")
        xs = [self.dq(rest[k], rest[k + 1], rest[k + 2], node) for k in range(0, len(rest), 3)]
        self.q(self.float_op(node, "Concat", xs, self.attrs(node)), node.output[0], sy, zy, node)

    def _unary(self, node):
        a = self.attrs(node)
        if dict((x.name, helper.get_attribute_value(x)) for x in node.attribute).get("channels_last", 0):
            raise UnsupportedOpError(node.op_type, node.name, "channels_last=1 is not supported")
        i = list(node.input) + [""] * (5 - len(node.input))
        y = self.float_op(node, _UNARY[node.op_type], [self.dq(i[0], i[1], i[2], node)], a)
        self.q(y, node.output[0], i[3], i[4], node)

    op_QLinearGlobalAveragePool = op_QLinearAveragePool = op_QLinearSigmoid = op_QLinearLeakyRelu = _unary

    def _binary(self, node):
        i = list(node.input) + [""] * (8 - len(node.input))
        y = self.float_op(node, _BINARY[node.op_type], [self.dq(i[0], i[1], i[2], node),
                                                        self.dq(i[3], i[4], i[5], node)], self.attrs(node))
        self.q(y, node.output[0], i[6], i[7], node)

    op_QLinearAdd = op_QLinearMul = _binary


def qoperator_to_qdq(model: onnx.ModelProto, supported=None) -> onnx.ModelProto:
    """The QDQ-format equivalent of a QOperator-format model (see the module docstring); a model with no QOperator
    op comes back unchanged. ``supported(op_type)``: whether the QDQ frontend takes the float op; a QOperator op whose
    float op it does not take is an :class:`UnsupportedOpError` naming the QOperator node and op (None: every op)."""
    if not is_qoperator(model):
        return model
    return _Rewriter(model, supported or (lambda op: True)).run()
