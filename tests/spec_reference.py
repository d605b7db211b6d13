"""An ONNX QDQ model evaluated from the ONNX operator specification, independently of the compiler.

It shares no code, constant or helper with qcompile: only NumPy and ``onnx`` (to read the file). Semantics:

* ``DequantizeLinear(q, s, zp) = (q - zp) * s`` (per tensor or per ``axis``), kept as the exact integers
  ``q - zp`` and the float64 scale;
* ``Conv`` / ``Gemm`` / ``MatMul`` whose operands are both dequantized tensors accumulate ``(q_x - zp_x)(q_w - zp_w)``
  exactly in int64 (asserted to fit int32, as the compiled kernels accumulate), then scale by ``s_x * s_w`` in
  float64; a dequantized int32 bias adds ``(b - zp_b) * s_b``;
* ``Constant`` is its value; every other op (Relu, Clip, Add, Mul, MaxPool, AveragePool, GlobalAveragePool, BatchNormalization, Flatten,
  Reshape, Identity) in float64;
* ``QuantizeLinear(x, s, zp) = saturate(round_half_to_even(x / s) + zp)`` in float64, saturated to the zero point's
  type (int8, uint8, int4, uint4).

The compiled model rounds half up in fixed point with 31-bit multipliers and quantizes its float32 input in float32,
so it can differ from this by one step where a value lands within about 2^-30 (relative) of a rounding tie.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import numpy_helper

_RANGES = {
    onnx.TensorProto.INT8: (-128, 127), onnx.TensorProto.UINT8: (0, 255),
    onnx.TensorProto.INT4: (-8, 7), onnx.TensorProto.UINT4: (0, 15),
    onnx.TensorProto.INT32: (-(2 ** 31), 2 ** 31 - 1),
}
_I32 = (-(2 ** 31), 2 ** 31 - 1)


@dataclass
class Quantized:
    """A QuantizeLinear output: integers and the parameters that produced them."""
    q: np.ndarray        # int64
    scale: np.ndarray    # float64, scalar or per channel
    zp: np.ndarray       # int64
    axis: int
    elem_type: int


@dataclass
class Dequantized:
    """A DequantizeLinear output, kept exact: value = ints * scale (scale broadcast along ``axis``)."""
    ints: np.ndarray     # int64, q - zp
    scale: np.ndarray    # float64
    axis: int

    def value(self) -> np.ndarray:
        return self.ints.astype(np.float64) * _along(self.scale, self.axis, self.ints.ndim)


def _along(v: np.ndarray, axis: int, ndim: int) -> np.ndarray:
    v = np.asarray(v, np.float64 if v.dtype.kind == "f" else np.int64)
    if v.ndim == 0 or v.size == 1:
        return v.reshape(())
    shape = [1] * ndim
    shape[axis % ndim] = v.size
    return v.reshape(shape)


def _attrs(node) -> dict:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def _fits_int32(a: np.ndarray, what: str):
    lo, hi = int(a.min(initial=0)), int(a.max(initial=0))
    assert _I32[0] <= lo and hi <= _I32[1], f"{what}: int32 accumulator overflows ({lo}..{hi})"


def _conv_int(x: np.ndarray, w: np.ndarray, strides, pads, dilations, group: int) -> np.ndarray:
    """Exact integer NCHW convolution (int64)."""
    n, c, h, wd = x.shape
    o, cg, kh, kw = w.shape
    assert c == cg * group, "Conv: channels do not match the weight"
    xp = np.pad(x, ((0, 0), (0, 0), (pads[0], pads[2]), (pads[1], pads[3])))
    oh = (h + pads[0] + pads[2] - dilations[0] * (kh - 1) - 1) // strides[0] + 1
    ow = (wd + pads[1] + pads[3] - dilations[1] * (kw - 1) - 1) // strides[1] + 1
    out = np.zeros((n, o, oh, ow), np.int64)
    og = o // group
    for g in range(group):
        xs = xp[:, g * cg:(g + 1) * cg]
        ws = w[g * og:(g + 1) * og]
        for i in range(kh):
            for j in range(kw):
                patch = xs[:, :, i * dilations[0]: i * dilations[0] + strides[0] * (oh - 1) + 1: strides[0],
                           j * dilations[1]: j * dilations[1] + strides[1] * (ow - 1) + 1: strides[1]]
                out[:, g * og:(g + 1) * og] += np.einsum("nchw,oc->nohw", patch, ws[:, :, i, j], dtype=np.int64)
    return out


def _pool_windows(x: np.ndarray, kernel, strides, pads, fill):
    n, c, h, w = x.shape
    xp = np.pad(x, ((0, 0), (0, 0), (pads[0], pads[2]), (pads[1], pads[3])), constant_values=fill)
    oh = (h + pads[0] + pads[2] - kernel[0]) // strides[0] + 1
    ow = (w + pads[1] + pads[3] - kernel[1]) // strides[1] + 1
    wins = [xp[:, :, i: i + strides[0] * (oh - 1) + 1: strides[0], j: j + strides[1] * (ow - 1) + 1: strides[1]]
            for i in range(kernel[0]) for j in range(kernel[1])]
    return np.stack(wins)


class SpecReference:
    """``SpecReference(model)(x) -> {tensor name: value}``: every tensor of the graph, QuantizeLinear outputs as
    ``Quantized``, the rest as float64 arrays (``Dequantized`` for DequantizeLinear outputs)."""

    def __init__(self, model: onnx.ModelProto):
        self.model = model
        self.init = {t.name: t for t in model.graph.initializer}

    def _const(self, name):
        t = self.init[name]
        return numpy_helper.to_array(t), t.data_type

    def _get(self, env, name):
        if name in env:
            return env[name]
        return self._const(name)[0]

    @staticmethod
    def _float(v):
        if isinstance(v, Dequantized):
            return v.value()
        if isinstance(v, Quantized):
            raise AssertionError("a quantized tensor used without DequantizeLinear")
        return np.asarray(v, np.float64)

    def __call__(self, x: np.ndarray) -> dict:
        g = self.model.graph
        inputs = [i.name for i in g.input if i.name not in self.init]
        env = {inputs[0]: np.asarray(x, np.float32)}
        for node in g.node:
            fn = getattr(self, "op_" + node.op_type, None)
            assert fn is not None, f"spec reference: no semantics for {node.op_type} ({node.name})"
            outs = fn(node, env, _attrs(node))
            for name, val in zip(node.output, outs if isinstance(outs, tuple) else (outs,)):
                env[name] = val
        return env

    # -- quantization -----------------------------------------------------------------------------
    def op_QuantizeLinear(self, node, env, a):
        x = self._get(env, node.input[0])
        xf = np.asarray(x.value() if isinstance(x, Dequantized) else x, np.float64)
        scale = np.asarray(self._const(node.input[1])[0], np.float64)
        zp, et = self._const(node.input[2]) if len(node.input) > 2 and node.input[2] else (np.zeros((), np.uint8),
                                                                                        onnx.TensorProto.UINT8)
        axis = a.get("axis", 1)
        assert np.all(np.isfinite(scale)) and np.all(scale > 0), f"{node.name}: scale must be finite and positive"
        lo, hi = _RANGES[et]
        q = np.rint(xf / _along(scale, axis, xf.ndim)) + _along(zp.astype(np.int64), axis, xf.ndim)
        return Quantized(np.clip(q, lo, hi).astype(np.int64), scale, zp.astype(np.int64), axis, et)

    def op_DequantizeLinear(self, node, env, a):
        # the node's own scale and zero point (they need not be the producing QuantizeLinear's)
        q = env[node.input[0]].q if node.input[0] in env else self._const(node.input[0])[0]
        scale = np.asarray(self._const(node.input[1])[0], np.float64)
        zp = self._const(node.input[2])[0] if len(node.input) > 2 and node.input[2] else np.zeros((), np.int64)
        axis = a.get("axis", 1)
        q = np.asarray(q, np.int64)
        return Dequantized(q - _along(np.asarray(zp, np.int64), axis, q.ndim), np.asarray(scale, np.float64), axis)

    # -- linear ops with exact integer accumulation -------------------------------------------------
    def _bias(self, env, name, ndim, axis):
        if not name:
            return 0.0
        b = self._get(env, name)
        return self._float(b).reshape([-1 if i == axis else 1 for i in range(ndim)])

    def op_Conv(self, node, env, a):
        x, w = self._get(env, node.input[0]), self._get(env, node.input[1])
        k = w.ints.shape[2:] if isinstance(w, Dequantized) else np.shape(w)[2:]
        strides, dil = a.get("strides", [1, 1]), a.get("dilations", [1, 1])
        pads, group = a.get("pads", [0, 0, 0, 0]), a.get("group", 1)
        assert a.get("auto_pad", b"NOTSET") in (b"NOTSET", "NOTSET"), "auto_pad is not modelled"
        assert len(k) == 2
        if isinstance(x, Dequantized) and isinstance(w, Dequantized):
            acc = _conv_int(x.ints, w.ints, strides, pads, dil, group)
            _fits_int32(acc, f"Conv {node.name}")
            y = acc.astype(np.float64) * (np.asarray(x.scale).reshape(()) * _along(w.scale, 1, 4))
        else:
            raise AssertionError(f"Conv {node.name}: both operands must be dequantized tensors in a QDQ model")
        return y + self._bias(env, node.input[2] if len(node.input) > 2 else "", 4, 1)

    def _matmul(self, node, x, w, trans_b):
        assert isinstance(x, Dequantized) and isinstance(w, Dequantized), f"{node.name}: operands must be dequantized"
        wi = w.ints.T if trans_b else w.ints
        acc = x.ints @ wi
        _fits_int32(acc, f"{node.op_type} {node.name}")
        ws = w.scale if np.ndim(w.scale) == 0 or np.size(w.scale) == 1 else w.scale.reshape(1, -1)
        return acc.astype(np.float64) * (np.asarray(x.scale).reshape(()) * ws)

    def op_Gemm(self, node, env, a):
        assert not a.get("transA", 0) and a.get("alpha", 1.0) == 1.0 and a.get("beta", 1.0) == 1.0
        y = self._matmul(node, self._get(env, node.input[0]), self._get(env, node.input[1]), a.get("transB", 0))
        return y + (self._bias(env, node.input[2], 2, 1) if len(node.input) > 2 else 0.0)

    def op_MatMul(self, node, env, a):
        return self._matmul(node, self._get(env, node.input[0]), self._get(env, node.input[1]), False)

    # -- float ops ------------------------------------------------------------------------------------
    def op_Constant(self, node, env, a):
        (name, v), = a.items()
        return numpy_helper.to_array(v) if name == "value" else np.asarray(v)

    def op_Relu(self, node, env, a):
        return np.maximum(self._float(self._get(env, node.input[0])), 0.0)

    def op_Clip(self, node, env, a):
        x = self._float(self._get(env, node.input[0]))
        lo = float(self._float(self._get(env, node.input[1]))) if len(node.input) > 1 and node.input[1] else -np.inf
        hi = float(self._float(self._get(env, node.input[2]))) if len(node.input) > 2 and node.input[2] else np.inf
        return np.clip(x, lo, hi)

    def op_Add(self, node, env, a):
        return self._float(self._get(env, node.input[0])) + self._float(self._get(env, node.input[1]))

    def op_Mul(self, node, env, a):
        return self._float(self._get(env, node.input[0])) * self._float(self._get(env, node.input[1]))

    def op_Identity(self, node, env, a):
        return self._get(env, node.input[0])

    def op_Flatten(self, node, env, a):
        x = self._float(self._get(env, node.input[0]))
        ax = a.get("axis", 1)
        return x.reshape(int(np.prod(x.shape[:ax])), -1)

    def op_Reshape(self, node, env, a):
        x = self._float(self._get(env, node.input[0]))
        shape = [int(s) for s in self._get(env, node.input[1])]
        shape = [x.shape[i] if s == 0 else s for i, s in enumerate(shape)]
        return x.reshape(shape)

    def op_GlobalAveragePool(self, node, env, a):
        return self._float(self._get(env, node.input[0])).mean(axis=(2, 3), keepdims=True)

    def op_MaxPool(self, node, env, a):
        x = self._float(self._get(env, node.input[0]))
        assert not a.get("ceil_mode", 0) and a.get("dilations", [1, 1]) == [1, 1]
        wins = _pool_windows(x, a["kernel_shape"], a.get("strides", [1, 1]), a.get("pads", [0, 0, 0, 0]), -np.inf)
        return wins.max(axis=0)

    def op_AveragePool(self, node, env, a):
        x = self._float(self._get(env, node.input[0]))
        pads = a.get("pads", [0, 0, 0, 0])
        wins = _pool_windows(x, a["kernel_shape"], a.get("strides", [1, 1]), pads, 0.0)
        if a.get("count_include_pad", 0) or not any(pads):
            return wins.mean(axis=0)
        ones = _pool_windows(np.ones_like(x), a["kernel_shape"], a.get("strides", [1, 1]), pads, 0.0)
        return wins.sum(axis=0) / ones.sum(axis=0)

    def op_BatchNormalization(self, node, env, a):
        x = self._float(self._get(env, node.input[0]))
        g, b, m, v = (np.asarray(self._float(self._get(env, n)), np.float64).reshape(1, -1, 1, 1)
                      for n in node.input[1:5])
        return (x - m) / np.sqrt(v + a.get("epsilon", 1e-5)) * g + b


def quantized_outputs(model: onnx.ModelProto) -> list[str]:
    """Names of the activation QuantizeLinear outputs (one per quantized layer), in graph order."""
    init = {t.name for t in model.graph.initializer}
    return [n.output[0] for n in model.graph.node if n.op_type == "QuantizeLinear" and n.input[0] not in init]
