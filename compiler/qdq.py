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
    """A quantized storage type: ``bits`` wide, signed or not, held in ``storage`` (int8/uint8; the lowering's own
    grids of a float value, ``FINE*`` of qcompile.relay_passes.lower_qdq_to_integer, in 16 or 32 bits)."""

    name: str
    bits: int
    signed: bool

    @property
    def storage(self) -> str:
        return ("int" if self.signed else "uint") + ("8" if self.bits <= 8 else "16" if self.bits <= 16 else "32")

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
# Validation of quantization parameters
# ----------------------------------------------------------------------------------------------
FLOAT32_TINY = float(np.finfo(np.float32).tiny)  # the smallest normal float32; below it scales are denormal


def _show(v) -> str:
    return f"{float(v):.9g}"


def check_scale(scale, what: str) -> np.ndarray:
    """``scale`` as float64, or a :class:`QCompileError` naming ``what`` where any element is NaN, infinite, zero,
    negative or below the smallest normal float32 (a denormal: the compiled float32 math would flush or overflow it).
    Such a scale never comes from calibration; compiled, it would give a module whose output ignores its input."""
    s = np.asarray(scale, dtype=np.float64)
    if s.size == 0:
        raise QCompileError(f"{what}: the scale is empty")
    flat = s.reshape(-1)
    where = lambda i: f" (channel {i})" if flat.size > 1 else ""  # noqa: E731
    for test, desc in ((lambda v: np.isnan(v), "NaN"), (lambda v: np.isinf(v), "infinite"),
                       (lambda v: v == 0, "zero"), (lambda v: v < 0, "negative"),
                       (lambda v: v < FLOAT32_TINY, "denormal")):
        bad = np.flatnonzero(test(flat))
        if bad.size:
            i = int(bad[0])
            more = f" and {bad.size - 1} more" if bad.size > 1 else ""
            extra = f", below the smallest normal float32 {FLOAT32_TINY:.3g}" if desc == "denormal" else ""
            raise QCompileError(f"{what}: the scale is {desc} ({_show(flat[i])}{extra}){where(i)}{more}; a "
                                f"quantization scale must be a finite positive number")
    return s


def check_zero_point(zp, lo: int, hi: int, what: str, type_name: str) -> np.ndarray:
    """``zp`` as int64, or a :class:`QCompileError` where an element is not an integer in ``[lo, hi]``."""
    z = np.asarray(zp)
    if z.dtype.kind == "f":
        bad_f = np.flatnonzero(~np.isfinite(z.reshape(-1)) | (z.reshape(-1) != np.round(z.reshape(-1))))
        if bad_f.size:
            raise QCompileError(f"{what}: the zero point {z.reshape(-1)[bad_f[0]]} is not an integer")
    z64 = z.astype(np.float64)
    bad = np.flatnonzero((z64 < lo) | (z64 > hi))
    if bad.size:
        raise QCompileError(f"{what}: the zero point {int(z64.reshape(-1)[bad[0]])} is outside the {type_name} range "
                            f"[{lo}, {hi}]")
    return z64.astype(np.int64)


_STORAGE_RANGE = {"int8": (-128, 127), "uint8": (0, 255), "int32": (-(2**31), 2**31 - 1)}


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

    def discard(self) -> None:
        """Abandon the graph (a frontend failed): close the builder's scopes so that it leaves no state behind."""
        if self._fn is None:
            return
        try:
            self._df.__exit__(None, None, None)
            self._fn.__exit__(QCompileError, None, None)
            self.bb._end_block()
            self.bb.end_scope()
        except Exception:  # noqa: BLE001  (best effort)
            pass
        self._fn = None

    def finish(self, outputs: Sequence[relax.Expr], attrs: Optional[dict] = None) -> tvm.IRModule:
        outs = [self.bb.emit_output(o) for o in outputs]
        self._df.__exit__(None, None, None)
        ret = outs[0] if len(outs) == 1 else relax.Tuple(outs)
        self.bb.emit_func_output(ret, params=self.params)
        self._fn.__exit__(None, None, None)
        self._fn = None
        mod = self.bb.get()
        if attrs:
            mod = mod.with_attr("qcompile", tvm.runtime.convert(attrs))
        return mod

    # -- quantization ---------------------------------------------------------------------------
    @staticmethod
    def _what(kind: str, name) -> str:
        return f"{kind} '{name}'" if name else kind

    def quantize(self, x, scale, zero_point, qt: QType, axis: int = 1, name=None) -> relax.Var:
        """``q = clip(round(x / scale) + zp, qt.qmin, qt.qmax)`` stored as ``qt.storage``."""
        what = self._what("quantize", name)
        check_scale(scale, what)
        zp = check_zero_point(zero_point, qt.qmin, qt.qmax, what, qt.name).astype(qt.storage)
        q = self.emit(relax.op.quantize(x, _f32(scale), relax.const(zp, qt.storage), axis, qt.storage), name)
        if qt.bits < 8:
            q = self.emit(relax.op.clip(q, qt.qmin, qt.qmax), (name or "") + "_clip")
        return q

    def dequantize(self, q, scale, zero_point, axis: int = 1, name=None) -> relax.Var:
        """``x = (q - zp) * scale`` as float32."""
        dt = str(q.ty.dtype)
        what = self._what("dequantize", name)
        check_scale(scale, what)
        lo, hi = _STORAGE_RANGE.get(dt, (-(2**31), 2**31 - 1))
        zp = check_zero_point(zero_point, lo, hi, what, dt).astype(dt)
        return self.emit(relax.op.dequantize(q, _f32(scale), relax.const(zp, dt), axis, "float32"), name)

    def qweight(self, q: np.ndarray, scale, qt: QType, axis: int = 0, name=None) -> relax.Var:
        """Dequantized constant weight: ``dequantize(clip(q))`` (the clip only for < 8 bits)."""
        q = np.asarray(q)
        what = self._what("weight", name)
        if q.dtype.kind == "f" and not np.all(np.isfinite(q)):
            raise QCompileError(f"{what}: the integer weight holds NaN or Inf")
        if q.min(initial=0) < qt.qmin or q.max(initial=0) > qt.qmax:
            raise QCompileError(
                f"{what}: values in [{q.min()}, {q.max()}] exceed the {qt.name} range [{qt.qmin}, {qt.qmax}]"
            )
        check_scale(scale, what)
        scale = np.asarray(scale, dtype="float32")
        if scale.size != 1 and (q.ndim <= axis or scale.size != q.shape[axis]):
            raise QCompileError(f"{what}: {scale.size} per-channel scales for a weight of shape {tuple(q.shape)} "
                                f"(axis {axis})")
        c: relax.Expr = relax.const(q.astype(qt.storage), qt.storage)
        if qt.bits < 8:
            c = self.emit(relax.op.clip(c, qt.qmin, qt.qmax), (name or "w") + "_q")
        return self.dequantize(c, scale, np.zeros(scale.shape, qt.storage), axis=axis if scale.ndim else 0, name=name)

    def qbias(self, b_int32: np.ndarray, scale, name=None) -> relax.Var:
        """An int32 bias through dequantize, as ONNX QDQ writes it (scale = s_x * s_w)."""
        what = self._what("bias", name)
        b = np.asarray(b_int32)
        if b.dtype.kind == "f" and not np.all(np.isfinite(b)):
            raise QCompileError(f"{what}: the integer bias holds NaN or Inf")
        if b.size and (b.min() < -(2**31) or b.max() > 2**31 - 1):
            raise QCompileError(f"{what}: values in [{b.min():.0f}, {b.max():.0f}] exceed the int32 range")
        check_scale(scale, what)
        scale = np.asarray(scale, dtype="float32")
        c = relax.const(b.astype("int32"), "int32")
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
        what = self._what("batch norm", name)
        with np.errstate(all="ignore"):
            var_eps = np.asarray(var, "float64") + eps
            if np.any(~np.isfinite(var_eps)) or np.any(var_eps <= 0):
                raise QCompileError(f"{what}: running variance + epsilon must be finite and positive")
            a = np.asarray(gamma, "float64") / np.sqrt(var_eps)
            b = np.asarray(beta, "float64") - np.asarray(mean, "float64") * a
        if not (np.all(np.isfinite(a)) and np.all(np.isfinite(b))):
            raise QCompileError(f"{what}: a parameter (weight, bias, running mean) is NaN or infinite")
        y = self.emit(relax.op.multiply(x, _f32(a.reshape(1, -1, 1, 1))), name)
        return self.emit(relax.op.add(y, _f32(b.reshape(1, -1, 1, 1))), (name or "bn") + "_shift")
