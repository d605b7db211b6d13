"""The QDQ form: the one Relax graph every frontend produces.

Frontends (ONNX QDQ, PT2E, HAWQ) translate a quantized model into a float NCHW Relax graph whose
quantized tensors are explicit, exactly as the ONNX QDQ format writes them:

    q = quantize(x)   = clip(round(x / scale) + zp, qmin, qmax)      (float  -> storage int)
    x = dequantize(q) = (q - zp) * scale                             (storage int -> float)

Conventions (what ``relay_passes.lower_qdq_to_integer`` relies on):

* storage dtypes are ``int8`` / ``uint8`` (Relax's own quantize/dequantize reject 4-bit types);
  a tensor of fewer bits is an int8/uint8 tensor *clipped to its range right where it is defined*:
  ``clip(quantize(x), -8, 7)`` is an int4 activation, ``clip(const, -8, 7)`` an int4 weight.
  The bit width and signedness of a quantized tensor are read off that clip (see :func:`qtype_of`).
* weights are constants with per-output-channel (axis 0) or per-tensor scales and zero point 0;
* biases are either float constants or ``dequantize(int32 const, s_x * s_w, 0)`` (ONNX style);
* conv2d is NCHW/OIHW, dense is ``matmul(x, permute_dims(w))`` with ``w`` of shape (out, in).

This module holds the quantized-type table, the builder frontends use, and helpers to read the form back.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import tvm
from tvm import relax
from tvm.ir.expr import Constant

from .errors import QCompileError


# ----------------------------------------------------------------------------------------------
# Quantized types
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class QType:
    """A quantized storage type: ``bits`` wide, signed or not, held in ``storage`` (int8/uint8)."""

    name: str
    bits: int
    signed: bool

    @property
    def storage(self) -> str:
        return "int8" if self.signed else "uint8"

    @property
    def qmin(self) -> int:
        return -(1 << (self.bits - 1)) if self.signed else 0

    @property
    def qmax(self) -> int:
        return (1 << (self.bits - 1)) - 1 if self.signed else (1 << self.bits) - 1


QTYPES = {
    "int8": QType("int8", 8, True),
    "uint8": QType("uint8", 8, False),
    "int4": QType("int4", 4, True),
    "uint4": QType("uint4", 4, False),
}
SUPPORTED_BITS = (4, 8)


def qtype(bits: int, signed: bool, what: str = "tensor") -> QType:
    """The QType for ``bits``/``signed``; any width but 4 or 8 is a :class:`QCompileError`."""
    if bits not in SUPPORTED_BITS:
        raise QCompileError(f"{what}: unsupported bit width {bits} (qcompile supports 4 and 8 bits)")
    return QTYPES[("" if signed else "u") + f"int{bits}"]


def qtype_from_range(dtype: str, lo: int, hi: int, what: str = "tensor") -> QType:
    """Recover the QType of a storage tensor clipped to ``[lo, hi]``."""
    for qt in QTYPES.values():
        if qt.storage == dtype and qt.qmin == lo and qt.qmax == hi:
            return qt
    raise QCompileError(
        f"{what}: range [{lo}, {hi}] of {dtype} is not a supported quantized type "
        f"(int8 [-128,127], uint8 [0,255], int4 [-8,7], uint4 [0,15])"
    )


# ----------------------------------------------------------------------------------------------
# Reading the form back
# ----------------------------------------------------------------------------------------------
def const_value(expr: relax.Expr) -> Optional[np.ndarray]:
    """The NumPy value of a Relax constant, else None."""
    if isinstance(expr, Constant):
        return expr.value.numpy()
    return None


def _int_arg(e) -> int:
    return int(e.value) if hasattr(e, "value") else int(e)


def qtype_of(q: relax.Expr, var2val, what: str = "tensor") -> QType:
    """The quantized type of storage expression ``q`` (a var or a constant) under the QDQ conventions."""
    val = var2val.get(q, q) if isinstance(q, relax.Var) else q
    dtype = str(q.ty.dtype)
    if isinstance(val, relax.Call) and val.op.name == "relax.clip":
        return qtype_from_range(dtype, _int_arg(val.args[1]), _int_arg(val.args[2]), what)
    if dtype not in ("int8", "uint8"):
        raise QCompileError(f"{what}: quantized storage dtype {dtype} is not int8/uint8")
    return QTYPES[dtype]


# ----------------------------------------------------------------------------------------------
# Builder
# ----------------------------------------------------------------------------------------------
def _f32(a) -> Constant:
    return relax.const(np.asarray(a, dtype="float32"), "float32")


class QDQBuilder:
    """Builds a float NCHW Relax graph with explicit quantize/dequantize, for frontends.

    Every method emits one or a few bindings and returns the new var; ``name`` becomes the var's
    name hint, which is how later error messages name the model's node.
    """

    def __init__(self):
        self.bb = relax.BlockBuilder()
        self.params: list[relax.Var] = []
        self._fn = self.bb.function("main")
        self._fn.__enter__()
        self._df = self.bb.dataflow()
        self._df.__enter__()

    @staticmethod
    def _name(name: Optional[str]) -> str:
        if not name:
            return ""
        keep = "".join(c if (c.isalnum() or c == "_") else "_" for c in name)
        return ("v_" + keep) if keep[:1].isdigit() else keep

    def emit(self, expr: relax.Expr, name: Optional[str] = None) -> relax.Var:
        return self.bb.emit(expr, name_hint=self._name(name))

    # -- graph inputs / outputs -----------------------------------------------------------------
    def input(self, name: str, shape: Sequence[int], dtype: str = "float32") -> relax.Var:
        v = relax.Var(self._name(name) or "x", relax.TensorType(list(shape), dtype))
        self.params.append(v)
        return v

    def finish(self, outputs: Sequence[relax.Expr], attrs: Optional[dict] = None) -> tvm.IRModule:
        outs = [self.bb.emit_output(o) for o in outputs]
        self._df.__exit__(None, None, None)
        ret = outs[0] if len(outs) == 1 else relax.Tuple(outs)
        self.bb.emit_func_output(ret, params=self.params)
        self._fn.__exit__(None, None, None)
        mod = self.bb.get()
        if attrs:
            mod = mod.with_attr("qcompile", tvm.runtime.convert(attrs))
        return mod

    # -- quantization ---------------------------------------------------------------------------
    def quantize(self, x, scale, zero_point, qt: QType, axis: int = 1, name=None) -> relax.Var:
        """``q = clip(round(x / scale) + zp, qt.qmin, qt.qmax)`` stored as ``qt.storage``."""
        zp = np.asarray(zero_point, dtype=qt.storage)
        q = self.emit(relax.op.quantize(x, _f32(scale), relax.const(zp, qt.storage), axis, qt.storage), name)
        if qt.bits < 8:
            q = self.emit(relax.op.clip(q, qt.qmin, qt.qmax), (name or "") + "_clip")
        return q

    def dequantize(self, q, scale, zero_point, axis: int = 1, name=None) -> relax.Var:
        """``x = (q - zp) * scale`` as float32."""
        dt = str(q.ty.dtype)
        zp = np.asarray(zero_point, dtype=dt)
        return self.emit(relax.op.dequantize(q, _f32(scale), relax.const(zp, dt), axis, "float32"), name)

    def qweight(self, q: np.ndarray, scale, qt: QType, axis: int = 0, name=None) -> relax.Var:
        """Dequantized constant weight: ``dequantize(clip(q))`` (the clip only for < 8 bits)."""
        q = np.asarray(q)
        if q.min(initial=0) < qt.qmin or q.max(initial=0) > qt.qmax:
            raise QCompileError(
                f"weight {name or ''}: values in [{q.min()}, {q.max()}] exceed the {qt.name} range"
            )
        c: relax.Expr = relax.const(q.astype(qt.storage), qt.storage)
        if qt.bits < 8:
            c = self.emit(relax.op.clip(c, qt.qmin, qt.qmax), (name or "w") + "_q")
        scale = np.asarray(scale, dtype="float32")
        return self.dequantize(c, scale, np.zeros(scale.shape, qt.storage), axis=axis if scale.ndim else 0, name=name)

    def qbias(self, b_int32: np.ndarray, scale, name=None) -> relax.Var:
        """An int32 bias through dequantize, as ONNX QDQ writes it (scale = s_x * s_w)."""
        scale = np.asarray(scale, dtype="float32")
        c = relax.const(np.asarray(b_int32, dtype="int32"), "int32")
        return self.emit(
            relax.op.dequantize(c, _f32(scale), relax.const(np.zeros(scale.shape, "int32"), "int32"), 0, "float32"),
            name,
        )

    def const(self, value: np.ndarray) -> Constant:
        return _f32(value)

    # -- float ops between DQ and Q ---------------------------------------------------------------
    def conv2d(self, x, w, bias=None, strides=(1, 1), padding=(0, 0, 0, 0), dilation=(1, 1), groups=1, name=None):
        y = self.emit(
            relax.op.nn.conv2d(x, w, strides=list(strides), padding=list(padding), dilation=list(dilation),
                               groups=groups, out_dtype="float32"),
            name,
        )
        if bias is not None:
            y = self.emit(relax.op.add(y, relax.op.reshape(bias, (1, -1, 1, 1))), (name or "conv") + "_bias")
        return y

    def dense(self, x, w, bias=None, name=None):
        """``y = x @ w.T + bias`` with ``w`` of shape (out, in)."""
        y = self.emit(relax.op.matmul(x, relax.op.permute_dims(w, [1, 0]), out_dtype="float32"), name)
        if bias is not None:
            y = self.emit(relax.op.add(y, bias), (name or "dense") + "_bias")
        return y

    def relu(self, x, name=None):
        return self.emit(relax.op.nn.relu(x), name)

    def clip(self, x, lo: float, hi: float, name=None):
        return self.emit(relax.op.clip(x, lo, hi), name)

    def add(self, a, b, name=None):
        return self.emit(relax.op.add(a, b), name)

    def max_pool2d(self, x, pool, strides, padding=(0, 0, 0, 0), dilation=(1, 1), ceil_mode=False, name=None):
        return self.emit(
            relax.op.nn.max_pool2d(x, list(pool), list(strides), list(padding), list(dilation), ceil_mode), name
        )

    def global_avg_pool(self, x, name=None):
        return self.emit(relax.op.mean(x, axis=[2, 3], keepdims=True), name)

    def flatten(self, x, name=None):
        n = int(x.ty.shape[0])
        return self.emit(relax.op.reshape(x, (n, -1)), name)

    def reshape(self, x, shape, name=None):
        return self.emit(relax.op.reshape(x, tuple(int(s) for s in shape)), name)

    def batch_norm(self, x, gamma, beta, mean, var, eps: float = 1e-5, name=None):
        """Inference batch norm as ``x * a + b`` with per-channel ``a = gamma / sqrt(var + eps)``."""
        a = np.asarray(gamma, "float64") / np.sqrt(np.asarray(var, "float64") + eps)
        b = np.asarray(beta, "float64") - np.asarray(mean, "float64") * a
        y = self.emit(relax.op.multiply(x, _f32(a.reshape(1, -1, 1, 1))), name)
        return self.emit(relax.op.add(y, _f32(b.reshape(1, -1, 1, 1))), (name or "bn") + "_shift")
