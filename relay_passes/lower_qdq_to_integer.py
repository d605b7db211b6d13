"""LowerQDQToInteger: rewrite the QDQ form into true integer compute, in the requested layout.

The float graph between dequantize and quantize is interpreted symbolically: every float value is a
linear combination of integer tensors,

    f = clamp(sum_i (t_i + c_i) * s_i, f_lo, f_hi)

with ``t_i`` an integer tensor (a quantized activation or an int32 accumulator), ``c_i`` an int
offset (``-zp``, or the int32 bias) and ``s_i`` a real scale per channel. The rules:

    dequantize(q, s, zp)          -> (q - zp) * s
    conv2d(DQ(x), DQ(w)) + b      -> (conv2d_int32(x, w) + b / (s_x s_w) - zp_x * sum(w)) * (s_x s_w)
    dense(DQ(x), DQ(w)) + b       -> likewise with matmul(..., out_dtype=int32)
    f * a + b  (BN, per channel)  -> scales multiplied by a, b folded into the offset   (BN folding)
    relu(f)                       -> clamp at 0
    f + g      (residual add)     -> the union of both term lists
    max_pool2d(DQ(q))             -> max_pool2d(q): max commutes with the monotone dequantize
    mean_hw(DQ(q))                -> sum_hw(q - zp) * (s / HW)
    reshape(DQ(q))                -> reshape(q)

and ``quantize(f, s_out, zp_out)`` becomes one fixed-point requantize (see :mod:`qcompile.fixed_point`)

    y = clip(((sum_i int64(t_i + c_i) * M_i + 2^(S-1)) >> S) + zp_out, lo, hi),   M_i * 2^-S ~= s_i / s_out

where ReLU (and any float clip) becomes the bound ``lo`` (``hi``). When every term is an 8-bit tensor
(residual adds of quantized tensors, re-scaled pools) the same requantize runs in int32 with narrower
multipliers, chosen so that nothing can overflow. Input zero points are exact: the
input is padded with its zero point explicitly and ``-zp * sum(w)`` goes into the offset.

An element-wise function (sigmoid, hardswish, SiLU, ...) of a quantized tensor is a table over its 2^bits values
(``lookup``; exact in the QDQ float semantics). Of a float value that is no quantized tensor (a conv's output with no
quantize before the function, as X86InductorQuantizer leaves hardswish and SiLU) it is a requantize of that value to
a 16-bit grid over the inputs where the quantized output varies, then a table over the grid (``fine_lookup``); a
product of such values (squeeze-excitation) and a pool of one put each on a grid over its whole range (``_fine``:
2^23 steps, fewer under a pool so that its sums fit int32; a conv's range from its weights; a product of two grids
in int64, requantized with narrower multipliers). Those are within one output step of the float semantics, not
exact.

The pass emits every integer op directly in ``layout`` (NCHW, NHWC or HWNC; weights OIHW, OHWI, HWOI).
The only layout transforms are on the quantized network input and, where a 4-D tensor is returned or
flattened with spatial extent > 1, at the output. The network input quantize is
``clip(floor(x / s + 0.5) + zp, lo, hi)`` (float32; ties round up); the output dequantize is
``float32(q - zp) * s``. A 4-bit tensor is an int8/uint8 tensor clipped to its 4-bit range (see
:mod:`qcompile.qdq`); ``PackInt4`` packs those later.

The network input is float32 NCHW by default; ``input_layout`` NHWC takes it channels last (the quantize runs
element-wise, then one transpose to the pass's layout where the two differ). ``input_dtype`` int8 / uint8 takes it
already quantized: the model's input quantize (one per-tensor QuantizeLinear, the input's only user) is folded away
and the input is its integer tensor (see :class:`InputQuant`). Where the asked dtype and the model's zero-point dtype
differ (8 bits only), the graph shifts the input by 128 (``q_uint8 = q_int8 + 128``, exact: the same rounding with
``zp +- 128``); a 4-bit input range is enforced with a clip.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import tvm
from tvm import relax
from tvm.ir.expr import Constant

from qcompile.errors import QCompileError, UnsupportedOpError, keeps_user_errors
from qcompile.fixed_point import MAX_SHIFT, quantize_multipliers
from qcompile.qdq import QType, QTYPES, check_scale, const_value, qtype_of
from qcompile.runtime import INPUT_DTYPES, INPUT_LAYOUTS, InputQuant

# Integer offsets (``-zp * sum(w)``, biases in accumulator steps) are added to int32 accumulators; the requantize
# multiplies ``t + c`` (|t + c| < 2^31) by a 31-bit multiplier in int64.
OFFSET_LIMIT = 2**31 - 1

LAYOUTS = {
    # data layout, kernel layout, channel axis of 4-D data, spatial axes, permutation from NCHW
    "NCHW": ("NCHW", "OIHW", 1, (2, 3), (0, 1, 2, 3)),
    "NHWC": ("NHWC", "OHWI", 3, (1, 2), (0, 2, 3, 1)),
    "HWNC": ("HWNC", "HWOI", 3, (0, 1), (2, 3, 0, 1)),
}
_KERNEL_PERM = {"OIHW": (0, 1, 2, 3), "OHWI": (0, 2, 3, 1), "HWOI": (2, 3, 0, 1)}


@dataclass
class Term:
    """``(expr + offset) * scale``: an integer tensor, an int offset and a real scale (per channel or scalar)."""

    expr: relax.Expr
    offset: np.ndarray
    scale: np.ndarray


@dataclass
class Lin:
    """A float value as ``clamp(sum(terms), lo, hi)``; ``rank`` 4 (in the pass's layout) or 2 (N, C)."""

    terms: list
    rank: int
    lo: float = -math.inf
    hi: float = math.inf
    qt: Optional[QType] = None  # set for a plain dequantized tensor (one term, storage dtype)
    name: str = ""
    bias: Optional[np.ndarray] = None  # a real offset (per channel or scalar) added before the clamp

    def plain(self) -> bool:
        return (self.qt is not None and len(self.terms) == 1 and self.lo == -math.inf and self.hi == math.inf
                and self.bias is None)


@dataclass
class Func:
    """``fn(q)``: an element-wise function of ONE quantized tensor ``expr`` (per-tensor parameters). ``fn`` maps the
    tensor's integer values (int64) to real values (float64); quantized, it becomes a table lookup over the
    ``2^bits`` values ``qt`` allows (:meth:`_Lowering.lookup`)."""

    expr: relax.Expr
    qt: QType
    fn: Callable
    rank: int
    name: str = ""

    def then(self, g: Callable, name: str) -> "Func":
        f = self.fn
        return Func(self.expr, self.qt, lambda q: g(f(q)), self.rank, name)


@dataclass
class AccFunc:
    """``fn(y)``: an element-wise function of a float value ``base`` that is not a quantized tensor (a conv's output
    before any quantize: X86InductorQuantizer applies hardswish / SiLU there). ``base`` is a ``Lin`` without clamp;
    ``fn`` maps its real values (float64) to real values. Quantized, it becomes a requantize of ``base`` to a 16-bit
    grid over the inputs where the quantized output varies, then a table over that grid
    (:meth:`_Lowering.fine_lookup`)."""

    base: "Lin"
    fn: Callable
    rank: int
    name: str = ""

    def then(self, g: Callable, name: str) -> "AccFunc":
        f = self.fn
        return AccFunc(self.base, lambda y: g(f(y)), self.rank, name)


FINE = QType("uint16", 16, False)  # the grid an AccFunc's input is requantized to before its table
FINE_S = QType("int16", 16, True)  # a float operand of a product or pool, on a grid symmetric about zero: int16
FINE_S_MAX = (1 << 14) - 1  # up to FINE_S_MAX steps each side,
FINE_L = QType("int32", 32, True)  # else int32, up to FINE_L_MAX (a pool: window x steps < 2^30; a product of
FINE_L_MAX = (1 << 22) - 1  # two such grids is int64, requantized with narrower multipliers: _multiplier_bits)
FINE_SETTLE = 1 << 21  # grid points over which fine_lookup finds where the quantized output varies


@dataclass
class Cat:
    """A concatenation along the channels of values (``Lin`` / ``Func``) with their own scales; quantized, each part
    is requantized to the output's parameters and the integer tensors are concatenated."""

    parts: list
    sizes: list  # channels of each part
    rank: int
    name: str = ""


@dataclass
class Weight:
    q: np.ndarray  # int values, (O, I, kh, kw) or (O, I)
    scale: np.ndarray  # per output channel (O,) or scalar
    qt: QType
    transposed: bool = False  # dense weight seen through permute_dims: (I, O)


@dataclass
class FloatConst:
    value: np.ndarray


def _sigmoid(x):
    return 0.5 * (1.0 + np.tanh(0.5 * np.asarray(x, np.float64)))  # (no overflow for large |x|)


def _erf(x):
    return np.vectorize(math.erf, otypes=[np.float64])(np.asarray(x, np.float64))


def _name(var) -> str:
    return var.name if isinstance(var, relax.Var) else ""


def _op_name(e) -> str:
    return str(e.op.name).replace("relax.", "") if isinstance(e, relax.Call) and hasattr(e.op, "name") \
        else type(e).__name__


def _input_error(dtype: str, detail: str) -> QCompileError:
    return QCompileError(f"--input-dtype {dtype}: {detail}; compile with --input-dtype float32 (the default), which "
                         f"takes float images and quantizes them inside the module")


class _Lowering:
    def __init__(self, func: relax.Function, layout: str, input_dtype: str = "float32", input_layout: str = "NCHW"):
        if layout not in LAYOUTS:
            raise QCompileError(f"unknown layout '{layout}' (choose from {', '.join(LAYOUTS)})")
        if input_dtype not in INPUT_DTYPES:
            raise QCompileError(f"unknown input dtype '{input_dtype}' (choose from {', '.join(INPUT_DTYPES)})")
        if input_layout not in INPUT_LAYOUTS:
            raise QCompileError(f"unknown input layout '{input_layout}' (choose from {', '.join(INPUT_LAYOUTS)})")
        self.func = func
        self.layout = layout
        self.input_dtype, self.input_layout = input_dtype, input_layout
        self.input_quant: Optional[InputQuant] = None  # set where the input is an integer tensor
        self.dl, self.kl, self.caxis, self.hw_axes, self.perm = LAYOUTS[layout]
        self.bb = relax.BlockBuilder()
        self.var2val = relax.analysis.get_var2val(func)
        self.env: dict = {}
        self.qts: dict = {}  # integer tensor -> its quantized type (its range), for the lookup tables
        self.int_range: dict = {}  # conv / dense accumulator -> (lo, hi) per output channel: the bounds of its values
        self.input = func.params[0]

    # ------------------------------------------------------------------------------------------
    def emit(self, expr, name=""):
        return self.bb.emit(expr, name_hint=name)

    def _chan_const(self, arr: np.ndarray, rank: int, dtype: str) -> Constant:
        """A per-channel constant shaped to broadcast against a rank-``rank`` tensor in the layout."""
        arr = np.asarray(arr)
        if arr.ndim == 0 or arr.size == 1:
            return relax.const(np.asarray(arr.reshape(()), dtype=dtype), dtype)
        if rank == 4 and self.caxis == 1:
            arr = arr.reshape(-1, 1, 1)
        return relax.const(arr.astype(dtype), dtype)

    def get(self, e, user=""):
        if isinstance(e, Constant):
            return FloatConst(e.value.numpy())
        if e in self.env:
            return self.env[e]
        raise UnsupportedOpError("value", _name(e) or user, "cannot be lowered to integer compute")

    # ------------------------------------------------------------------------------------------
    def run(self) -> relax.Function:
        try:
            return self._run()
        except BaseException:
            # close what the failed `with` scopes left open in the C++ builder (else it warns when destroyed)
            try:
                self.bb._end_block()
                self.bb.end_scope()
            except Exception:  # noqa: BLE001  (best effort; the original error matters)
                pass
            raise

    def _input_var(self) -> relax.Var:
        """The network input parameter: the QDQ form's float32 NCHW input, in ``input_layout`` and ``input_dtype``.

        1. Another layout than NCHW needs a 4-D input.
        2. An integer input needs the input quantize of :meth:`_input_quantize` (checked here, before anything is
           emitted)."""
        ty = self.input.ty
        shape = [int(d) for d in ty.shape]
        if self.input_layout != "NCHW":
            if len(shape) != 4:
                raise QCompileError(f"--input-layout {self.input_layout}: input '{self.input.name}' has shape "
                                    f"{shape}, not 4-D images; compile with --input-layout NCHW")
            shape = [shape[i] for i in LAYOUTS[self.input_layout][4]]
        if self.input_dtype != "float32":
            self._input_quantize()
        return relax.Var(self.input.name, relax.TensorType(shape, self.input_dtype))

    def _input_quantize(self) -> relax.Call:
        """The one per-tensor quantize an integer input replaces: the input's only user, with constant scalar scale
        and zero point, and a zero-point dtype the asked dtype matches (or, for 8 bits, differs from by 128)."""
        dtype, name = self.input_dtype, self.input.name
        bindings = [b for block in self.func.body.blocks for b in block.bindings]
        users = [(b.var, b.value) for b in bindings
                 if any(v.same_as(self.input) for v in relax.analysis.free_vars(b.value))]
        if any(v.same_as(self.input) for v in relax.analysis.free_vars(self.func.body.body)):
            users.append((None, None))
        if len(users) != 1 or not (isinstance(users[0][1], relax.Call) and users[0][1].op.name == "relax.quantize"):
            shown = ", ".join("the output" if v is None else f"'{_name(v)}' ({_op_name(c)})" for v, c in users)
            raise _input_error(dtype, f"input '{name}' must feed exactly one QuantizeLinear, its only user; it feeds "
                                      f"{shown or 'nothing'}")
        qvar, q = users[0]
        scale, zp = const_value(q.args[1]), const_value(q.args[2])
        if scale is None or zp is None or scale.size != 1 or zp.size != 1:
            raise _input_error(dtype, f"the input quantize '{_name(qvar)}' has a per-channel (or non-constant) scale "
                                      f"or zero point; an integer input needs one per-tensor scale and zero point")
        model = str(q.attrs.out_dtype)
        four_bit = any(isinstance(b.value, relax.Call) and b.value.op.name == "relax.clip"
                       and b.value.args[0].same_as(qvar) for b in bindings)
        if model != dtype and four_bit:  # (+-128 is not the shift between a 4-bit tensor's two forms)
            raise _input_error(dtype, f"the input quantize '{_name(qvar)}' quantizes to 4 bits stored as {model}; "
                                      f"give the input as {model} (--input-dtype {model})")
        return q

    def _run(self) -> relax.Function:
        x = self._input_var()
        self.env[self.input] = ("input", x)
        with self.bb.function("main", [x]):
            with self.bb.dataflow():
                for block in self.func.body.blocks:
                    for b in block.bindings:
                        self.visit(b.var, b.value)
                ret = self.output(self.func.body.body)
                gv = self.bb.emit_output(ret)
            self.bb.emit_func_output(gv)
        return self.bb.get()["main"]

    def visit(self, var, val):
        name = _name(var)
        if isinstance(val, relax.Var):
            self.env[var] = self.get(val, name)
            return
        if isinstance(val, Constant):
            self.env[var] = FloatConst(val.value.numpy())
            return
        if not isinstance(val, relax.Call) or not isinstance(val.op, tvm.ir.Op):
            raise UnsupportedOpError(type(val).__name__, name)
        op = val.op.name
        handler = getattr(self, "op_" + op.replace("relax.", "").replace(".", "_"), None)
        if handler is None:
            raise UnsupportedOpError(op, name, "no integer lowering for this op")
        res = handler(val, name)
        if res is not None:
            self.env[var] = res

    # -- quantize / dequantize ------------------------------------------------------------------
    def op_clip(self, call, name):
        src = call.args[0]
        if str(call.ty.dtype) in ("int8", "uint8"):
            # a 4-bit range clip: of a weight constant or of a quantize (see qcompile.qdq)
            inner = self.env.get(src) if isinstance(src, relax.Var) else None
            if isinstance(src, Constant):
                return ("qconst", src.value.numpy(), qtype_of(call, {}, name))
            if isinstance(inner, tuple) and inner[0] == "q":
                return ("q", inner[1], qtype_of(call, {}, name), inner[3])
            raise UnsupportedOpError("clip", name, "integer clip of an unexpected value")
        return self._clamp(self.get(src, name), float(call.args[1].value), float(call.args[2].value), "clip", name)

    def _clamp(self, v, lo: float, hi: float, op: str, name: str):
        """ReLU / clip: the requantize's bounds for a linear value, part of the table for a function."""
        if isinstance(v, Cat):
            return Cat([self._clamp(p, lo, hi, op, name) for p in v.parts], v.sizes, v.rank, name)
        if isinstance(v, (Func, AccFunc)):
            return v.then(lambda x: np.clip(x, lo, hi), name)
        if not isinstance(v, Lin):
            raise UnsupportedOpError(op, name)
        return Lin(v.terms, v.rank, max(v.lo, lo), min(v.hi, hi), None, name, v.bias)

    def op_quantize(self, call, name):
        # recorded lazily: the clip that may follow decides the bit width
        scale = const_value(call.args[1])
        zp = const_value(call.args[2])
        if scale is None or zp is None:
            raise QCompileError(f"quantize '{name}': scale and zero point must be constants")
        if scale.size != 1 or zp.size != 1:
            raise UnsupportedOpError("quantize", name, "per-channel activation quantization is not supported")
        check_scale(scale, f"quantize '{name}'")
        qt = QTYPES[str(call.attrs.out_dtype)]
        return ("q", call.args[0], qt, (float(scale.reshape(())), int(zp.reshape(())), name))

    def materialize_q(self, entry, name):
        """Emit the integer tensor of a pending ``("q", src, qt, (s, zp, name))`` entry."""
        _, src, qt, (s, zp, qname) = entry
        if isinstance(src, relax.Var) and isinstance(self.env.get(src), tuple) and self.env[src][0] == "input":
            return self.quantize_input(self.env[src][1], s, zp, qt, qname)
        lin = self.get(src, qname)
        if isinstance(lin, Func):
            return self.lookup(lin, s, zp, qt, qname)
        if isinstance(lin, AccFunc):
            return self.fine_lookup(lin, s, zp, qt, qname)
        if isinstance(lin, Cat):
            return self.concat(lin, s, zp, qt, qname)
        if not isinstance(lin, Lin):
            raise UnsupportedOpError("quantize", qname, "operand is not a quantized computation")
        return self.requantize(lin, s, zp, qt, qname)

    def op_dequantize(self, call, name):
        src = call.args[0]
        scale, zp = const_value(call.args[1]), const_value(call.args[2])
        if scale is None or zp is None:
            raise QCompileError(f"dequantize '{name}': scale and zero point must be constants")
        check_scale(scale, f"dequantize '{name}'")
        if isinstance(src, Constant):
            q = src.value.numpy()
            if q.dtype == np.int32:  # bias
                return FloatConst(q.astype(np.float64) * scale.astype(np.float64))
            return self._weight(q, scale, zp, QTYPES[str(q.dtype)], name)
        ent = self.env.get(src)
        if isinstance(ent, tuple) and ent[0] == "qconst":
            return self._weight(ent[1], scale, zp, ent[2], name)
        if isinstance(ent, tuple) and ent[0] == "q":
            self.env[src] = ent = ("done", self.materialize_q(ent, name), ent[2])
        if isinstance(ent, tuple) and ent[0] == "done":
            if scale.size != 1 or zp.size != 1:
                raise UnsupportedOpError("dequantize", name, "per-channel activation quantization is not supported")
            rank = len(src.ty.shape)
            s, z = float(scale.reshape(())), int(zp.reshape(()))
            self.qts[ent[1]] = ent[2]
            return Lin([Term(ent[1], np.array(-z, np.int64), np.array(s))], rank, qt=ent[2], name=name)
        raise UnsupportedOpError("dequantize", name, "operand is not a quantized tensor")

    def _weight(self, q, scale, zp, qt, name):
        if np.any(zp != 0):
            raise UnsupportedOpError("dequantize", name, "asymmetric weights (non-zero weight zero point) are not supported")
        return Weight(q.astype(np.int64), scale.astype(np.float64), qt)

    # -- input / output --------------------------------------------------------------------------
    def quantize_input(self, x, s, zp, qt, name):
        """``q = clip(floor(x / s + 0.5) + zp, qmin, qmax)`` on the float input, then to the layout; an integer input
        is ``q`` itself (:meth:`integer_input`)."""
        if self.input_dtype != "float32":
            q = self.integer_input(x, s, zp, qt, name)
        else:
            f = relax.op.floor(relax.op.add(relax.op.divide(x, relax.const(float(s), "float32")),
                                            relax.const(0.5, "float32")))
            if zp:
                f = relax.op.add(f, relax.const(float(zp), "float32"))
            q = self.emit(relax.op.astype(relax.op.clip(f, qt.qmin, qt.qmax), qt.storage), name or "input_q")
        if len(x.ty.shape) == 4 and self.input_layout != self.layout:
            perm = np.argsort(LAYOUTS[self.input_layout][4])[list(self.perm)]  # input layout -> NCHW -> the layout
            q = self.emit(relax.op.permute_dims(q, [int(p) for p in perm]), "input_layout")
        return q

    def integer_input(self, x, s, zp, qt, name):
        """The integer input ``x`` as the model's quantized tensor (``qt``): shifted by 128 where its dtype is the
        other 8-bit one, clipped to a 4-bit range; ``self.input_quant`` records its parameters."""
        dtype = self.input_dtype
        shift = 0 if dtype == qt.storage else (128 if qt.storage == "uint8" else -128)  # model value - input value
        self.input_quant = InputQuant(float(s), int(zp) - shift, dtype, self.input_layout, qt.qmin - shift,
                                      qt.qmax - shift, name)
        q = x
        if shift:
            q = self.emit(relax.op.astype(relax.op.add(relax.op.astype(x, "int32"), relax.const(shift, "int32")),
                                          qt.storage), name or "input_q")
        if qt.bits < 8:
            q = self.emit(relax.op.clip(q, qt.qmin, qt.qmax), (name or "input") + "_clip")
        return q

    def output(self, e):
        v = self.get(e, "output") if not isinstance(e, relax.Tuple) else None
        if isinstance(e, relax.Tuple):
            return relax.Tuple([self.output(f) for f in e.fields])
        if isinstance(v, tuple) and v[0] in ("q", "done"):
            raise UnsupportedOpError("output", _name(e), "the model returns a quantized tensor; expected a dequantized float output")
        if isinstance(v, Func):  # a function of a quantized tensor returned in float: a float32 table
            y = self.emit(relax.op.take(relax.const(self._table_values(v).astype("float32"), "float32"),
                                        self._table_index(v), axis=0, mode="clip"), "output")
            if v.rank == 4 and self.layout != "NCHW":
                y = self.emit(relax.op.permute_dims(y, list(np.argsort(self.perm))), "output_layout")
            return y
        if isinstance(v, AccFunc):
            raise UnsupportedOpError("output", _name(e), "the model returns an element-wise function of a float value "
                                     "(no quantize after it); quantize the output")
        if not isinstance(v, Lin) or len(v.terms) != 1:
            raise UnsupportedOpError("output", _name(e), "the model output is not a single dequantized tensor")
        t = v.terms[0]
        i32 = relax.op.astype(t.expr, "int32")
        if np.any(t.offset != 0):
            i32 = relax.op.add(i32, self._chan_const(t.offset, v.rank, "int32"))
        y = relax.op.multiply(relax.op.astype(i32, "float32"), self._chan_const(t.scale, v.rank, "float32"))
        if v.bias is not None:
            y = relax.op.add(y, self._chan_const(v.bias, v.rank, "float32"))
        if v.lo > -math.inf or v.hi < math.inf:
            y = relax.op.clip(y, v.lo, v.hi)
        y = self.emit(y, "output")
        if v.rank == 4 and self.layout != "NCHW":
            inv = list(np.argsort(self.perm))
            y = self.emit(relax.op.permute_dims(y, inv), "output_layout")
        return y

    # -- requantize ------------------------------------------------------------------------------
    def requantize(self, lin: Lin, s_out: float, zp: int, qt: QType, name: str):
        # a plain tensor quantized again with identical parameters is the same tensor
        if lin.plain() and lin.qt is qt and np.allclose(lin.terms[0].scale, s_out, rtol=1e-6, atol=0) \
                and int(-lin.terms[0].offset) == zp:
            return lin.terms[0].expr
        lo, hi = qt.qmin, qt.qmax
        if lin.lo > -math.inf:
            lo = max(lo, min(hi, int(math.floor(lin.lo / s_out + 0.5)) + zp))
        if lin.hi < math.inf:
            hi = min(hi, max(lo, int(math.floor(lin.hi / s_out + 0.5)) + zp))
        ms = [t.scale / s_out for t in lin.terms]
        # a real bias (batch norm on a quantized tensor) joins the rounding constant with the shift's precision:
        # y = round_half_up(sum_i (t_i + c_i) * m_i + bias / s_out)
        bias = None if lin.bias is None else np.asarray(lin.bias, np.float64) / s_out
        zeros = [] if bias is None else [np.zeros(bias.shape)]  # (gives the shift the bias's shape)
        mults, shift = self._multipliers(ms + zeros, name, self._multiplier_bits(lin))
        mults = mults[:len(ms)]
        wide = "int64"
        # Terms that are all 8-bit tensors (residual adds, pools) fit int32 with a narrower multiplier:
        # sum_i |t_i + c_i| * |M_i| + 2^(S-1) + |B| < 2^31 with S <= 30. Integer math in int32 is several times
        # cheaper on GPUs than int64; ~21-bit multipliers are about as precise as float32.
        if all(str(t.expr.ty.dtype) in ("int8", "uint8") for t in lin.terms):
            tmax = sum(255 + int(np.max(np.abs(t.offset))) for t in lin.terms)
            bits = int(np.floor(np.log2((2**31 - 2**29 - 1) / tmax)))
            if bits >= 16:
                m32, s32 = quantize_multipliers(ms + zeros, bits=bits)
                b32 = 0 if bias is None else float(np.max(np.abs(bias) * np.ldexp(1.0, s32))) + 1
                if np.all(s32 <= 30) and tmax * 2.0**bits + 2.0**29 + b32 < 2.0**31:
                    mults, shift, wide = m32[:len(ms)], s32, "int32"
        rnd = np.left_shift(np.int64(1), shift - 1)
        if bias is not None:
            b = np.round(bias * np.ldexp(1.0, shift))
            if np.max(np.abs(b)) >= 2.0**61:
                raise QCompileError(f"quantize '{name}': the bias {float(np.max(np.abs(bias))):.6g} (in output steps) "
                                    f"does not fit the fixed-point requantize; the output scale is too small for it")
            rnd = rnd + b.astype(np.int64)
        acc = None
        for t, M in zip(lin.terms, mults):
            v = relax.op.astype(t.expr, wide)
            if np.any(t.offset != 0):
                v = relax.op.add(v, self._chan_const(t.offset, lin.rank, wide))
            v = relax.op.multiply(v, self._chan_const(M, lin.rank, wide))
            acc = v if acc is None else relax.op.add(acc, v)
        acc = relax.op.add(acc, self._chan_const(rnd, lin.rank, wide))
        acc = relax.op.right_shift(acc, self._chan_const(shift, lin.rank, wide))
        if zp:
            acc = relax.op.add(acc, relax.const(int(zp), wide))
        return self.emit(relax.op.astype(relax.op.clip(acc, lo, hi), qt.storage), name)

    # -- functions of one quantized tensor: lookup tables ------------------------------------------
    @staticmethod
    def _table_values(f: Func) -> np.ndarray:
        """``f`` at every value the quantized input can hold, ``qt.qmin .. qt.qmax``, in float64."""
        with np.errstate(all="ignore"):
            y = np.asarray(f.fn(np.arange(f.qt.qmin, f.qt.qmax + 1, dtype=np.int64)), np.float64)
        if np.any(np.isnan(y)):
            raise QCompileError(f"node '{f.name}': the element-wise function is NaN for some input value")
        return y

    def _table_index(self, f: Func) -> relax.Expr:
        idx = relax.op.astype(f.expr, "int32")
        if f.qt.qmin:
            idx = relax.op.subtract(idx, relax.const(f.qt.qmin, "int32"))
        return idx

    def lookup(self, f: Func, s_out: float, zp: int, qt: QType, name: str):
        """``quantize(f(dequantize(q)))`` as ``take(table, q - qmin)``: the table holds, for every input value, the QDQ
        float semantics evaluated in float64, ``saturate(round_half_to_even(f(x) / s_out) + zp)``."""
        y = self._table_values(f)
        with np.errstate(all="ignore"):
            q = np.clip(np.rint(y / s_out) + zp, qt.qmin, qt.qmax)
        table = relax.const(q.astype(qt.storage), qt.storage)
        return self.emit(relax.op.take(table, self._table_index(f), axis=0, mode="clip"), name)

    @staticmethod
    def exact_affine(x: np.ndarray, r: np.ndarray, q: np.ndarray, qmin: int, qmax: int) -> Optional[tuple]:
        """A fixed-point form ``(dtype, M, C, shift, even)`` of ``q = clip(round(r), qmin, qmax)`` at every input
        ``x`` (the whole input domain; ``r``: the real values, affine in ``x``, float64), or None: with
        ``t = x * M + C`` in ``dtype`` (int32 where it fits, else int64; never overflowing), ``q = clip(round(t /
        2^shift))`` rounding ties half up, or half to even with ``even``. Checked equal to ``q`` at every input."""
        x = np.asarray(x, np.int64)
        q = np.asarray(q, np.int64)
        r = np.asarray(r, np.float64)
        if x.size < 2 or not np.all(np.isfinite(r)):
            return None
        a = (r[-1] - r[0]) / float(x[-1] - x[0])
        c = r[0] - a * float(x[0])
        if not np.allclose(a * x + c, r, rtol=0, atol=1e-6 * max(1.0, float(np.max(np.abs(r))))):
            return None
        xmax = int(np.max(np.abs(x)))
        for dtype, limit, shifts in (("int32", 2**31, range(30, 7, -1)), ("int64", 2**62, range(52, 30, -1))):
            for shift in shifts:
                M, C = int(round(a * 2.0**shift)), int(round(c * 2.0**shift))
                half = 1 << (shift - 1)
                if xmax * abs(M) + abs(C) + 2 * half >= limit:
                    continue
                t = x * M + C
                for even in (False, True):
                    got = (t + half - 1 + ((t >> shift) & 1)) >> shift if even else (t + half) >> shift
                    if np.array_equal(np.clip(got, qmin, qmax), q):
                        return dtype, M, C, shift, even
        return None

    def affine_requantize(self, f: Func, s_out: float, zp: int, qt: QType, name: str):
        """``lookup(f, ...)`` in integer arithmetic (multiply, add, shift) where that equals the table at every input
        value (:meth:`exact_affine`: the QDQ float semantics kept exactly), else None. A requantize of a quantized
        tensor to other parameters (a concatenation's parts) is affine; its element-wise ops fuse into the consumer
        where a table lookup does not."""
        y = self._table_values(f)
        with np.errstate(all="ignore"):
            q = np.clip(np.rint(y / s_out) + zp, qt.qmin, qt.qmax)
        x = np.arange(f.qt.qmin, f.qt.qmax + 1, dtype=np.int64)
        fit = self.exact_affine(x, y / s_out + zp, q.astype(np.int64), qt.qmin, qt.qmax)
        if fit is None:
            return None
        dtype, M, C, shift, even = fit
        k = lambda v: relax.const(v, dtype)
        t = relax.op.add(relax.op.multiply(relax.op.astype(f.expr, dtype), k(M)), k(C))
        if even:  # (t + 2^(s-1) - 1 + bit s of t) >> s: ties to the even neighbour
            odd = relax.op.bitwise_and(relax.op.right_shift(t, k(shift)), k(1))
            t = relax.op.add(relax.op.add(t, k((1 << (shift - 1)) - 1)), odd)
        else:
            t = relax.op.add(t, k(1 << (shift - 1)))
        v = relax.op.right_shift(t, k(shift))
        return self.emit(relax.op.astype(relax.op.clip(v, qt.qmin, qt.qmax), qt.storage), name)

    def _as_func(self, v, op: str, name: str) -> Func:
        """``v`` as a function of one quantized tensor, or an UnsupportedOpError."""
        if isinstance(v, Func):
            return v
        if isinstance(v, Lin) and len(v.terms) == 1:
            t = v.terms[0]
            qt = self.qts.get(t.expr)
            if qt is not None and np.size(t.scale) == 1 and np.size(t.offset) == 1 \
                    and (v.bias is None or np.size(v.bias) == 1):
                off, sc = int(np.asarray(t.offset).reshape(())), float(np.asarray(t.scale).reshape(()))
                b = 0.0 if v.bias is None else float(np.asarray(v.bias).reshape(()))
                lo, hi = v.lo, v.hi
                return Func(t.expr, qt, lambda q: np.clip((q + off) * sc + b, lo, hi), v.rank, name)
        raise UnsupportedOpError(op, name, "an element-wise function applies only to a quantized tensor "
                                 "(dequantized, with a per-tensor scale) or a function of one")

    def _unary(self, v, g: Callable, op: str, name: str):
        """``g`` (float64 NumPy) applied element-wise: to a concatenation part by part, else as a table."""
        if isinstance(v, Cat):
            return Cat([self._unary(p, g, op, name) for p in v.parts], v.sizes, v.rank, name)
        return self._as_fn(v, op, name).then(g, name)

    def _as_fn(self, v, op: str, name: str):
        """``v`` as a function of one quantized tensor (``Func``) where it is one, else, for a float value that is
        not (a conv's output before any quantize), as an ``AccFunc`` of it; else an UnsupportedOpError."""
        if isinstance(v, AccFunc):
            return v
        f = self._func_of(v)
        if f is not None:
            return f
        if isinstance(v, Lin) and v.terms:
            if v.bias is not None and np.size(v.bias) > 1 and (v.lo > -math.inf or v.hi < math.inf):
                raise UnsupportedOpError(op, name, "an element-wise function of a clamped value with a per-channel "
                                         "bias is not supported")
            lo, hi = v.lo, v.hi
            return AccFunc(Lin(v.terms, v.rank, name=v.name, bias=v.bias), lambda y: np.clip(y, lo, hi), v.rank, name)
        return self._as_func(v, op, name)

    def _acc_view(self, v):
        """``(term, f)`` for a value that is a per-tensor function ``f`` of ``(expr + offset) * scale`` of ONE term of
        an integer tensor (a ``Lin`` of one term with per-tensor bias, or an ``AccFunc`` of one), else None."""
        if isinstance(v, AccFunc):
            base, f = v.base, v.fn
        elif isinstance(v, Lin):
            lo, hi = v.lo, v.hi
            base, f = v, (lambda y: np.clip(y, lo, hi))
        else:
            return None
        if len(base.terms) != 1 or (base.bias is not None and np.size(base.bias) > 1):
            return None
        b = 0.0 if base.bias is None else float(np.asarray(base.bias).reshape(()))
        return base.terms[0], (lambda y: f(y + b))

    def _acc_product(self, a, b, name):
        """``a * b`` for two float values that are functions of the same integer tensor (hardswish as ``x *
        hardsigmoid(x)`` on a conv's float output): an ``AccFunc`` of ``a``'s term, or None. ``b``'s term must be
        ``a``'s up to a per-tensor affine map: the same scale ratio on every channel, offsets that differ by the
        same real amount within one accumulator step (the offset of a constant added to an accumulator is rounded
        to whole steps per channel)."""
        va, vb = self._acc_view(a), self._acc_view(b)
        if va is None or vb is None or va[0].expr is not vb[0].expr:
            return None
        (ta, fa), (tb, fb) = va, vb
        sa, sb = np.asarray(ta.scale, np.float64), np.asarray(tb.scale, np.float64)
        r = sb / sa
        if not np.allclose(r, np.ravel(r)[0], rtol=1e-6, atol=0):
            return None
        c = (np.asarray(tb.offset, np.float64) - np.asarray(ta.offset, np.float64)) * sb
        if np.ptp(np.broadcast_to(c, np.broadcast(c, sb).shape)) > 2 * float(np.max(np.abs(sb))):
            return None
        r0, c0 = float(np.ravel(r)[0]), float(np.mean(c))
        base = Lin([ta], a.rank, name=name)
        return AccFunc(base, lambda y: fa(y) * fb(r0 * y + c0), a.rank, name)

    def fine_lookup(self, af: AccFunc, s_out: float, zp: int, qt: QType, name: str):
        """``quantize(fn(base))`` for a float ``base`` that is not a quantized tensor: ``base`` requantized to the
        16-bit grid ``FINE`` over the interval of inputs where the quantized output varies (found on ``FINE_SETTLE``
        points; outside it the output is the interval's end value), then a table over the grid's 65,536 values
        (``lookup``). A value's grid step is ``1/65534`` of that interval (a small fraction of an output step for a
        saturating function), so the result is the QDQ float semantics' but for an input within half a grid step of
        an output rounding boundary, which can land one output step away."""
        g = af.fn

        def qof(y):
            with np.errstate(all="ignore"):
                return np.clip(np.rint(np.asarray(g(y), np.float64) / s_out) + zp, qt.qmin, qt.qmax)

        span = 256.0 * s_out
        for _ in range(48):  # 1. grow the interval until the output is constant beyond it on both sides
            far = np.geomspace(span, span * 1024, 64)
            lo_q, hi_q = qof(-far), qof(far)
            if np.all(lo_q == lo_q[0]) and np.all(hi_q == hi_q[0]):
                break
            span *= 2
        else:
            raise UnsupportedOpError("quantize", name, "the quantized output of the element-wise function of a float "
                                     "value does not settle to a constant for large inputs")
        y = np.linspace(-span, span, FINE_SETTLE)  # 2. where it varies
        q = qof(y)
        if np.any(np.isnan(q)):
            raise QCompileError(f"node '{name}': the element-wise function is NaN for some input value")
        moves = np.nonzero(q[1:] != q[:-1])[0]
        if moves.size == 0:
            ylo, yhi = -s_out, s_out
        else:
            ylo, yhi = float(y[moves[0]]), float(y[moves[-1] + 1])
        try:  # (no finer than needed: the base's own values, where the accumulator's range is known)
            blo, bhi = self._value_range(af.base)
            if blo < bhi and max(ylo, blo) < min(yhi, bhi):
                ylo, yhi = max(ylo, blo), min(yhi, bhi)
        except UnsupportedOpError:
            pass
        # 3. the grid: index u = round(y / s_fine) + z, its ends a step or more beyond [ylo, yhi] (where the output is
        # its constant end value: an input beyond them, clipped to an end, keeps that value)
        s_fine = (yhi - ylo) / (FINE.qmax - 4)
        z = int(math.ceil(-ylo / s_fine)) + 1
        u = self.requantize(af.base, s_fine, z, FINE, name + "_fine")
        return self.lookup(Func(u, FINE, lambda v: g((v - z) * s_fine), af.rank, name), s_out, zp, qt, name)

    def concat(self, c: Cat, s_out: float, zp: int, qt: QType, name: str):
        """Each part requantized to the output's scale and zero point, then concatenated. A part that is a quantized
        tensor (or a function of one) with other parameters is requantized exactly as the QDQ float semantics round
        it (half to even): by an int32 multiply, add and shift where that equals the table at every input value (it
        fuses into the concatenation's kernel), else by the table; one with the output's parameters is used as it
        is."""
        parts = []
        for i, p in enumerate(c.parts):
            pname = f"{name}_in{i}"
            same = isinstance(p, Lin) and p.plain() and p.qt is qt and np.allclose(p.terms[0].scale, s_out, rtol=1e-6,
                                                                                   atol=0) \
                and int(-p.terms[0].offset) == zp
            f = None if same else self._func_of(p)
            if f is not None:
                part = self.affine_requantize(f, s_out, zp, qt, pname)
                parts.append(part if part is not None else self.lookup(f, s_out, zp, qt, pname))
            elif isinstance(p, Lin):
                parts.append(self.requantize(p, s_out, zp, qt, pname))
            elif isinstance(p, AccFunc):
                parts.append(self.fine_lookup(p, s_out, zp, qt, pname))
            else:
                raise UnsupportedOpError("concat", name, "operand is not a quantized computation")
        axis = self.caxis if c.rank == 4 else 1
        return self.emit(relax.op.concat(parts, axis=axis), name)

    def _multiplier_bits(self, lin: Lin) -> int:
        """31, or fewer where a term is an int64 tensor (a product of two values on fine grids) so that ``sum_i |t_i +
        c_i| * |M_i| + 2^S`` stays below 2^62."""
        if all(str(t.expr.ty.dtype) != "int64" for t in lin.terms):
            return 31
        total = 0.0
        for t in lin.terms:
            r = self.int_range.get(t.expr)
            if r is None:
                return 18  # (no known range: a 2^44 product's bound)
            total += float(np.max(np.maximum(np.abs(r[0] + t.offset), np.abs(r[1] + t.offset))))
        return int(max(8, min(31, 61 - math.ceil(math.log2(max(total, 1.0))))))

    @staticmethod
    def _multipliers(ms: list, name: str, bits: int = 31):
        """:func:`quantize_multipliers` of the requantize ``name`` (``bits`` wide), or a QCompileError where a
        multiplier (input scale x weight scale / output scale) is not finite, too large for 31 bits, or so small that
        every channel's integer multiplier is 0 (an output that does not depend on the input)."""
        for m in ms:
            m = np.asarray(m, np.float64)
            if not np.all(np.isfinite(m)):
                raise QCompileError(f"quantize '{name}': the requantize multiplier (input scale / output scale) is not "
                                    f"finite; the scales of the layer feeding it are out of range")
        try:
            mults, shift = quantize_multipliers(ms, bits=bits)
        except ValueError:
            big = max(float(np.max(np.abs(m))) for m in ms)
            raise QCompileError(f"quantize '{name}': the requantize multiplier {big:.6g} (input scale / output scale) "
                                f"is too large (it must be below 2^30); the output scale is too small for its input") from None
        if all(not np.any(M) for M in mults) and any(np.any(np.asarray(m) != 0) for m in ms):
            big = max(float(np.max(np.abs(m))) for m in ms)
            raise QCompileError(f"quantize '{name}': the requantize multiplier {big:.6g} (input scale / output scale) "
                                f"is below 2^-{MAX_SHIFT + 1} and rounds to 0: the output would not depend on the input; "
                                f"the output scale is too large for its input")
        return mults, shift

    @staticmethod
    def _check_offset(offset: np.ndarray, name: str, what: str):
        """Refuse an integer offset (a bias in accumulator steps) outside int32."""
        off = np.asarray(offset, np.float64)
        if not np.all(np.isfinite(off)) or off.size and np.max(np.abs(off)) > OFFSET_LIMIT:
            worst = float(np.max(np.abs(off))) if np.all(np.isfinite(off)) else float("inf")
            raise QCompileError(f"node '{name}': the {what} is {worst:.6g} accumulator steps (bias / (input scale x "
                                f"weight scale)), beyond the int32 range of the accumulator; the layer's scales are "
                                f"out of proportion to its bias")

    # -- compute ops -----------------------------------------------------------------------------
    def _q_operand(self, e, op, name) -> Lin:
        v = self.get(e, name)
        if not isinstance(v, Lin) or not v.plain():
            raise UnsupportedOpError(op, name, "the data operand must be a dequantized (quantized) tensor; "
                                     "float compute without quantize/dequantize around it cannot be lowered")
        return v

    def op_nn_conv2d(self, call, name):
        a = call.attrs
        x = self._q_operand(call.args[0], "conv2d", name)
        w = self.get(call.args[1], name)
        if not isinstance(w, Weight):
            raise UnsupportedOpError("conv2d", name, "the weight must be a quantized constant")
        groups = int(a.groups)
        t = x.terms[0]
        zp = int(-t.offset)
        pad = [int(p) for p in a.padding]
        data = t.expr
        if zp != 0 and any(pad):  # pad with the zero point so that padded pixels are real zeros
            hw = self.hw_axes
            pw = [0] * 8
            pw[2 * hw[0]], pw[2 * hw[0] + 1], pw[2 * hw[1]], pw[2 * hw[1] + 1] = pad[0], pad[2], pad[1], pad[3]
            data = self.emit(relax.op.nn.pad(data, pw, pad_value=float(zp)), name + "_pad")
            pad = [0, 0, 0, 0]
        wk = np.transpose(w.q, _KERNEL_PERM[self.kl]).astype(w.qt.storage)
        wconst: relax.Expr = relax.const(wk, w.qt.storage)
        if w.qt.bits < 8:
            wconst = self.emit(relax.op.clip(wconst, w.qt.qmin, w.qt.qmax), name + "_w")
        acc = self.emit(
            relax.op.nn.conv2d(data, wconst, strides=[int(s) for s in a.strides], padding=pad,
                               dilation=[int(d) for d in a.dilation], groups=groups, data_layout=self.dl,
                               kernel_layout=self.kl, out_dtype="int32"),
            name,
        )
        # (grouped and depthwise too: output channel o reads only its group's input channels, every one of them
        # zp-padded, so its zero-point correction is -zp times the sum of its own weights)
        offset = -zp * w.q.sum(axis=(1, 2, 3)) if zp else np.zeros(w.q.shape[0], np.int64)
        scale = t.scale * np.broadcast_to(w.scale, (w.q.shape[0],))
        self._record_range(acc, w.q.reshape(w.q.shape[0], -1), x.qt)
        return Lin([Term(acc, offset.astype(np.int64), scale)], 4, name=name)

    def _record_range(self, acc, w: np.ndarray, xqt: QType):
        """The bounds of accumulator ``acc = sum(w * x)`` per output channel (rows of ``w``) over inputs ``x`` in
        ``xqt``'s range (a float value built on it that is no quantized tensor is put on a grid over these:
        :meth:`_fine`)."""
        w = np.asarray(w, np.int64)
        lo = np.where(w > 0, w * xqt.qmin, w * xqt.qmax).sum(axis=1)
        hi = np.where(w > 0, w * xqt.qmax, w * xqt.qmin).sum(axis=1)
        self.int_range[acc] = (lo, hi)

    def _value_range(self, v, op: str = "value", name: str = "") -> tuple:
        """Bounds ``(lo, hi)`` of the real values of ``v`` (a ``Lin``, ``Func`` or ``AccFunc``) over all inputs; an
        UnsupportedOpError naming ``op`` and ``name`` where a term's range is not known."""
        if isinstance(v, Func):
            y = self._table_values(v)
            return float(np.min(y)), float(np.max(y))
        if isinstance(v, AccFunc):
            lo, hi = self._value_range(v.base, op, name)
            with np.errstate(all="ignore"):
                y = np.asarray(v.fn(np.linspace(lo, hi, FINE_SETTLE)), np.float64)
            return float(np.nanmin(y)), float(np.nanmax(y))
        lo = hi = 0.0
        for t in v.terms:
            qt = self.qts.get(t.expr)
            r = self.int_range.get(t.expr, None if qt is None else (np.asarray(qt.qmin), np.asarray(qt.qmax)))
            if r is None:
                raise UnsupportedOpError(op, name or v.name, f"the range of its float operand '{v.name}' (no quantized "
                                         "tensor) is not known; quantize that operand first")
            a = (np.asarray(r[0], np.float64) + t.offset) * t.scale
            b = (np.asarray(r[1], np.float64) + t.offset) * t.scale
            lo, hi = lo + np.minimum(a, b), hi + np.maximum(a, b)
        if v.bias is not None:
            lo, hi = lo + v.bias, hi + v.bias
        lo, hi = float(np.clip(np.min(lo), v.lo, v.hi)), float(np.clip(np.max(hi), v.lo, v.hi))
        return lo, hi

    def _fine(self, v, op: str, name: str, steps: int) -> Lin:
        """A float value that is no quantized tensor (a conv's output before any quantize, a function of it, a batch
        norm of a quantized tensor) as an integer tensor on a grid symmetric about zero over its whole range (a
        conv's from its weights), ``steps`` each side, for a product or a pool: int16 (``FINE_S``) up to
        ``FINE_S_MAX`` steps, else int32 (``FINE_L``). The grid's step is ``1 / (2 steps)`` of the range; a function
        of a float value (``AccFunc``) comes through ``fine_lookup``, whose 16-bit input grid bounds its precision."""
        qt = FINE_S if steps <= FINE_S_MAX else FINE_L
        lo, hi = self._value_range(v, op, name)
        s = max(abs(lo), abs(hi)) / steps or 1.0
        if isinstance(v, Func):
            u = self.lookup(v, s, 0, qt, name + "_fine")
        elif isinstance(v, AccFunc):
            u = self.fine_lookup(v, s, 0, qt, name + "_fine")
        else:
            u = self.requantize(v, s, 0, qt, name + "_fine")
        self.int_range[u] = (np.asarray(-steps), np.asarray(steps))
        return Lin([Term(u, np.zeros((), np.int64), np.asarray(s, np.float64))], v.rank, qt=qt, name=name)

    def _plain_or_fine(self, v, op: str, name: str, steps: int = FINE_L_MAX) -> Lin:
        """A quantized tensor as it is; a float value that is not one on its grid of ``steps`` (:meth:`_fine`)."""
        if isinstance(v, Lin) and v.plain():
            return v
        if isinstance(v, (Lin, Func, AccFunc)):
            return self._fine(v, op, name, steps)
        raise UnsupportedOpError(op, name, "the data operand must be a dequantized (quantized) tensor")

    def op_permute_dims(self, call, name):
        w = self.get(call.args[0], name)
        if isinstance(w, Weight) and w.q.ndim == 2:
            return Weight(w.q, w.scale, w.qt, not w.transposed)
        raise UnsupportedOpError("permute_dims", name, "only the transpose of a dense weight is supported")

    def op_matmul(self, call, name):
        x = self._q_operand(call.args[0], "matmul", name)
        w = self.get(call.args[1], name)
        if not isinstance(w, Weight) or not w.transposed or x.rank != 2:
            raise UnsupportedOpError("matmul", name, "only x(N, I) @ weight(O, I).T with a quantized constant weight is supported")
        t = x.terms[0]
        zp = int(-t.offset)
        wT = relax.const(np.ascontiguousarray(w.q.T).astype(w.qt.storage), w.qt.storage)
        if w.qt.bits < 8:
            wT = self.emit(relax.op.clip(wT, w.qt.qmin, w.qt.qmax), name + "_w")
        acc = self.emit(relax.op.matmul(t.expr, wT, out_dtype="int32"), name)
        self._record_range(acc, w.q, x.qt)
        offset = -zp * w.q.sum(axis=1) if zp else np.zeros(w.q.shape[0], np.int64)
        scale = t.scale * np.broadcast_to(w.scale, (w.q.shape[0],))
        return Lin([Term(acc, offset.astype(np.int64), scale)], 2, name=name)

    def _affine(self, lin, mul=None, add=None, name=""):
        """``lin * mul + add`` for per-channel constants (BN folding, bias). On an accumulator the added constant is
        folded into the integer offset (in accumulator steps, far finer than the output's); on quantized 8-bit
        tensors (batch norm after a concat or a pool) it stays a real bias that the requantize adds with its
        fixed-point precision. A per-tensor affine map of one quantized tensor is a function of it (a table)."""
        if isinstance(lin, (Func, AccFunc, Cat)):
            return self._affine_fn(lin, mul, add, name)
        if lin.lo > -math.inf or lin.hi < math.inf:
            if lin.bias is None and self._fn_ok(lin, mul, add):
                return self._affine_fn(lin, mul, add, name)
            if np.size(mul) <= 1 and np.size(add) <= 1:  # (a per-tensor map of a clamped float value: a function)
                return self._affine_fn(lin, mul, add, name)
            raise UnsupportedOpError("add/multiply", name, "a per-channel affine op after ReLU/clip cannot be folded")
        terms = list(lin.terms)
        bias = lin.bias
        if mul is not None:
            if np.any(mul == 0):
                raise UnsupportedOpError("multiply", name, "a zero per-channel scale cannot be folded")
            if not np.all(np.isfinite(mul)):
                raise QCompileError(f"node '{name}': a per-channel factor (batch norm) is NaN or infinite")
            terms = [Term(t.expr, t.offset, t.scale * mul) for t in terms]
            if bias is not None:
                bias = bias * mul
        if add is not None:
            if all(str(t.expr.ty.dtype) in ("int8", "uint8") for t in terms):
                if not np.all(np.isfinite(add)):
                    raise QCompileError(f"node '{name}': a per-channel constant (batch norm) is NaN or infinite")
                bias = np.asarray(add, np.float64) if bias is None else bias + add
                out = Lin(terms, lin.rank, name=name, bias=bias)
                if len(terms) == 1 and np.size(bias) == 1 and np.size(terms[0].scale) == 1 \
                        and terms[0].expr in self.qts:
                    return self._as_func(out, "add", name)
                return out
            t0 = terms[0]
            with np.errstate(all="ignore"):
                steps = np.round(np.asarray(add, np.float64) / t0.scale) + t0.offset
            self._check_offset(steps, name, "bias")
            terms[0] = Term(t0.expr, steps.astype(np.int64), t0.scale)
        return Lin(terms, lin.rank, name=name, bias=bias)

    def _fn_ok(self, lin, mul, add) -> bool:
        """Whether ``lin * mul + add`` is a per-tensor function of one quantized tensor."""
        return (np.size(mul) <= 1 if mul is not None else True) and (np.size(add) <= 1 if add is not None else True) \
            and len(lin.terms) == 1 and lin.terms[0].expr in self.qts and np.size(lin.terms[0].scale) == 1

    def _affine_fn(self, v, mul, add, name):
        if isinstance(v, Cat):  # part by part, each with its channels' constants
            parts, start = [], 0
            for p, n in zip(v.parts, v.sizes):
                sl = lambda c: None if c is None else (c if np.size(c) == 1 else np.asarray(c)[start:start + n])  # noqa: E731
                parts.append(self._affine(p, sl(mul), sl(add), name))
                start += n
            return Cat(parts, v.sizes, v.rank, name)
        if (mul is not None and np.size(mul) > 1) or (add is not None and np.size(add) > 1):
            raise UnsupportedOpError("add/multiply", name, "a per-channel constant applied to an element-wise "
                                     "function of a quantized tensor (only per-tensor constants are supported)")
        m = 1.0 if mul is None else float(np.asarray(mul).reshape(()))
        a = 0.0 if add is None else float(np.asarray(add).reshape(()))
        return self._as_fn(v, "add/multiply", name).then(lambda x: x * m + a, name)

    @staticmethod
    def _per_channel(c: np.ndarray, rank: int, name: str) -> np.ndarray:
        c = np.asarray(c, np.float64)
        if c.size == 1:
            return c.reshape(())
        if rank == 4 and c.ndim == 4 and c.shape[0] == 1 and c.shape[2:] == (1, 1):
            return c.reshape(-1)
        if rank == 4 and c.ndim == 1:  # bias reshaped (1, C, 1, 1) in the QDQ form arrives as reshape(...)
            return c
        if rank == 2 and c.ndim in (1, 2) and c.shape[0] in (1, c.size):
            return c.reshape(-1)
        raise UnsupportedOpError("add/multiply", name, f"constant of shape {c.shape} is not per-channel")

    def op_reshape(self, call, name):
        src = self.get(call.args[0], name)
        shape = [int(s) for s in call.ty.shape]
        if isinstance(src, FloatConst):  # bias reshaped to (1, C, 1, 1)
            return FloatConst(src.value.reshape(shape))
        if not isinstance(src, Lin):
            raise UnsupportedOpError("reshape", name)
        in_shape = [int(s) for s in call.args[0].ty.shape]
        if src.rank == 4 and len(shape) == 2 and shape[0] == in_shape[0]:
            # flatten (N, C, H, W) -> (N, C*H*W); with H = W = 1 every layout flattens the same way
            terms = []
            for t in src.terms:
                e = t.expr
                if in_shape[2] * in_shape[3] != 1:
                    if np.size(t.scale) != 1 or np.size(t.offset) != 1:
                        raise UnsupportedOpError("reshape", name, "flattening a per-channel value with spatial extent > 1")
                    if self.layout != "NCHW":
                        e = self.emit(relax.op.permute_dims(e, list(np.argsort(self.perm))), name + "_to_nchw")
                terms.append(Term(self.emit(relax.op.reshape(e, shape), name), t.offset, t.scale))
            if src.bias is not None and np.size(src.bias) != 1 and in_shape[2] * in_shape[3] != 1:
                raise UnsupportedOpError("reshape", name, "flattening a per-channel value with spatial extent > 1")
            return Lin(terms, 2, src.lo, src.hi, src.qt, name, src.bias)
        raise UnsupportedOpError("reshape", name, f"reshape {in_shape} -> {shape} is not supported in the integer graph")

    def op_add(self, call, name):
        a, b = self.get(call.args[0], name), self.get(call.args[1], name)
        if isinstance(a, FloatConst) and isinstance(b, (Lin, Func, AccFunc, Cat)):
            a, b = b, a
        if isinstance(a, (Lin, Func, AccFunc, Cat)) and isinstance(b, FloatConst):
            c = self._per_channel(b.value, a.rank, name)
            return self._affine(a, add=c if c.size == 1 else np.broadcast_to(c, (self._channels(a),)), name=name)
        if isinstance(a, Func) or isinstance(b, Func):
            fa, fb = self._as_func(a, "add", name), self._as_func(b, "add", name)
            if fa.expr is not fb.expr:
                raise UnsupportedOpError("add", name, "a sum of functions of two different quantized tensors must be "
                                         "quantized first")
            return Func(fa.expr, fa.qt, lambda q: fa.fn(q) + fb.fn(q), fa.rank, name)
        if isinstance(a, Lin) and isinstance(b, Lin):
            if a.rank != b.rank:
                raise UnsupportedOpError("add", name, "operands of different rank")
            for v in (a, b):
                if v.lo > -math.inf or v.hi < math.inf:
                    raise UnsupportedOpError("add", name, "an operand clamped by ReLU/clip without a quantize in between")
            bias = a.bias if b.bias is None else (b.bias if a.bias is None else a.bias + b.bias)
            return Lin(a.terms + b.terms, a.rank, name=name, bias=bias)
        raise UnsupportedOpError("add", name)

    def op_subtract(self, call, name):
        b = self.get(call.args[1], name)
        if not isinstance(b, FloatConst):
            raise UnsupportedOpError("subtract", name, "only the subtraction of a constant is supported")
        a = self.get(call.args[0], name)
        if not isinstance(a, (Lin, Func, AccFunc, Cat)):
            raise UnsupportedOpError("subtract", name)
        c = -self._per_channel(b.value, a.rank, name)
        return self._affine(a, add=c if c.size == 1 else np.broadcast_to(c, (self._channels(a),)), name=name)

    def op_divide(self, call, name):
        b = self.get(call.args[1], name)
        a = self.get(call.args[0], name)
        if not isinstance(b, FloatConst) or not isinstance(a, (Lin, Func, AccFunc, Cat)):
            raise UnsupportedOpError("divide", name, "only the division by a constant is supported")
        c = self._per_channel(b.value, a.rank, name)
        if np.any(c == 0):
            raise UnsupportedOpError("divide", name, "a division by zero")
        return self._affine(a, mul=1.0 / c, name=name)

    def _channels(self, v) -> int:
        if isinstance(v, Cat):
            return int(sum(v.sizes))
        e = v.expr if isinstance(v, Func) else (v.base if isinstance(v, AccFunc) else v).terms[0].expr
        return int(e.ty.shape[self.caxis if v.rank == 4 else 1])

    def op_multiply(self, call, name):
        a, b = self.get(call.args[0], name), self.get(call.args[1], name)
        if isinstance(a, FloatConst):
            a, b = b, a
        if isinstance(a, (Lin, Func, AccFunc, Cat)) and isinstance(b, FloatConst):
            return self._affine(a, mul=self._per_channel(b.value, a.rank, name), name=name)
        if isinstance(a, (Lin, Func, AccFunc)) and isinstance(b, (Lin, Func, AccFunc)):
            # x * f(x) (SiLU, hardswish left unquantized in between): a function of the one tensor
            fa, fb = self._func_of(a), self._func_of(b)
            if fa is not None and fb is not None and fa.expr is fb.expr:
                return Func(fa.expr, fa.qt, lambda q: fa.fn(q) * fb.fn(q), fa.rank, name)
            if fa is None and fb is None:  # (the same on a float value: a conv's output before any quantize)
                prod = self._acc_product(a, b, name)
                if prod is not None:
                    return prod
            if not all(isinstance(v, Lin) and v.plain() for v in (a, b)):
                # (float operands: squeeze-excitation on a conv's output, as X86InductorQuantizer leaves it: each on
                # a grid of 2^23 steps; the product of two such in int64)
                a = self._plain_or_fine(a, "multiply", name + "_a")
                b = self._plain_or_fine(b, "multiply", name + "_b")
            return self._product(a, b, call, name)
        raise UnsupportedOpError("multiply", name, "only a product of two quantized tensors or a multiplication by a "
                                 "per-channel constant (batch norm) is supported")

    def _func_of(self, v) -> Optional[Func]:
        try:
            return self._as_func(v, "multiply", "")
        except UnsupportedOpError:
            return None

    def _product(self, a, b, call, name):
        """The product of two quantized tensors (squeeze-and-excitation's channel scaling: (N, C, H, W) x (N, C, 1, 1),
        broadcast): ``(q_a - zp_a) * (q_b - zp_b)`` exactly in int32 at scale ``s_a * s_b``; the quantize that follows
        is one fixed-point requantize."""
        for v in (a, b):
            if not isinstance(v, Lin) or not v.plain():
                raise UnsupportedOpError("multiply", name, "a product of two tensors needs both to be quantized "
                                         "tensors (dequantized, per-tensor scales); quantize each operand first")
        if a.rank != b.rank:
            raise UnsupportedOpError("multiply", name, "operands of different rank")
        mags = []
        for v in (a, b):
            t = v.terms[0]
            off = int(np.asarray(t.offset).reshape(()))
            lo, hi = self.int_range.get(t.expr, (v.qt.qmin, v.qt.qmax))  # (a grid's own step count: _fine)
            mags.append(max(abs(int(np.min(lo)) + off), abs(int(np.max(hi)) + off)))
        dt = "int32" if mags[0] * mags[1] < 2**31 else "int64"  # (int64: two operands on 2^23-step grids)
        ints = []
        for v in (a, b):
            t = v.terms[0]
            e = relax.op.astype(t.expr, dt)
            if np.any(t.offset != 0):
                e = relax.op.add(e, relax.const(int(np.asarray(t.offset).reshape(())), dt))
            ints.append(e)
        prod = self.emit(relax.op.multiply(ints[0], ints[1]), name)
        self.int_range[prod] = (np.asarray(-mags[0] * mags[1]), np.asarray(mags[0] * mags[1]))
        scale = np.asarray(a.terms[0].scale * b.terms[0].scale, np.float64)
        return Lin([Term(prod, np.zeros((), np.int64), scale)], a.rank, name=name)

    def op_nn_relu(self, call, name):
        return self._clamp(self.get(call.args[0], name), 0.0, math.inf, "relu", name)

    # element-wise functions (float64 NumPy; a table once quantized)
    def _fn_op(self, call, name, op, g):
        return self._unary(self.get(call.args[0], name), g, op, name)

    def op_sigmoid(self, call, name):
        return self._fn_op(call, name, "sigmoid", _sigmoid)

    def op_tanh(self, call, name):
        return self._fn_op(call, name, "tanh", np.tanh)

    def op_nn_silu(self, call, name):
        return self._fn_op(call, name, "silu", lambda x: x * _sigmoid(x))

    def op_nn_leakyrelu(self, call, name):
        alpha = float(call.attrs.alpha)
        return self._fn_op(call, name, "leakyrelu", lambda x: np.where(x >= 0, x, alpha * x))

    def op_nn_gelu(self, call, name):
        return self._fn_op(call, name, "gelu", lambda x: 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0))))

    def op_nn_gelu_tanh(self, call, name):
        c = math.sqrt(2.0 / math.pi)
        return self._fn_op(call, name, "gelu_tanh", lambda x: 0.5 * x * (1.0 + np.tanh(c * (x + 0.044715 * x**3))))

    def op_concat(self, call, name):
        tup = call.args[0]
        fields = tup.fields if isinstance(tup, relax.Tuple) else None
        if fields is None:
            raise UnsupportedOpError("concat", name, "the operands must be a tuple of tensors")
        rank = len(call.ty.shape)
        axis = int(call.attrs.axis) % rank
        if axis != 1:
            raise UnsupportedOpError("concat", name, f"only a concatenation along the channels is supported (axis "
                                     f"{axis})")
        parts = []
        for f in fields:
            v = self.get(f, name)
            if isinstance(v, Cat):
                raise UnsupportedOpError("concat", name, "a concatenation of a concatenation must be quantized first")
            if not isinstance(v, (Lin, Func, AccFunc)):
                raise UnsupportedOpError("concat", name, "operand is not a quantized computation")
            parts.append(v)
        return Cat(parts, [int(f.ty.shape[1]) for f in fields], rank, name)

    def op_nn_avg_pool2d(self, call, name):
        """A k x k average pool: the window sums of ``q - zp`` exactly in int32 (k*k strided slices of the input, padded
        with its zero point), at scale ``s / (k*k)``; the quantize that follows is one requantize."""
        a = call.attrs
        k = [int(p) for p in a.pool_size]
        x = self._plain_or_fine(self.get(call.args[0], name), "avg_pool2d", name, min(FINE_L_MAX, 2**30 // (k[0] * k[1])))
        st = [int(v) for v in a.strides]
        dil = [int(v) for v in a.dilation]
        pad = [int(p) for p in a.padding]  # top, left, bottom, right
        n_in = [int(v) for v in call.args[0].ty.shape]
        oh, ow = (int(call.ty.shape[2]), int(call.ty.shape[3]))
        floor_shape = [(n_in[2 + i] + pad[i] + pad[i + 2] - dil[i] * (k[i] - 1) - 1) // st[i] + 1 for i in range(2)]
        if floor_shape != [oh, ow]:
            raise UnsupportedOpError("avg_pool2d", name, "ceil_mode windows that run past the padded input are not "
                                     "supported")
        if any(pad) and not bool(a.count_include_pad):
            raise UnsupportedOpError("avg_pool2d", name, "padding with count_include_pad=0 (a divisor that varies at "
                                     "the edges) is not supported")
        t = x.terms[0]
        data = t.expr
        if any(pad):
            hw = self.hw_axes
            pw = [0] * 8
            pw[2 * hw[0]], pw[2 * hw[0] + 1], pw[2 * hw[1]], pw[2 * hw[1] + 1] = pad[0], pad[2], pad[1], pad[3]
            data = self.emit(relax.op.nn.pad(data, pw, pad_value=float(-int(t.offset))), name + "_pad")
        i32 = self.emit(relax.op.astype(data, "int32"), name + "_i32")
        acc = None
        for i in range(k[0]):
            for j in range(k[1]):
                b = [i * dil[0], j * dil[1]]
                e = [b[0] + st[0] * (oh - 1) + 1, b[1] + st[1] * (ow - 1) + 1]
                win = relax.op.strided_slice(i32, list(self.hw_axes), b, e, st)
                acc = win if acc is None else relax.op.add(acc, win)
        acc = self.emit(acc, name)
        kk = k[0] * k[1]
        return Lin([Term(acc, t.offset * kk, t.scale / kk)], 4, name=name)

    def op_nn_max_pool2d(self, call, name):
        x = self._q_operand(call.args[0], "max_pool2d", name)
        a = call.attrs
        t = x.terms[0]
        y = self.emit(
            relax.op.nn.max_pool2d(t.expr, [int(p) for p in a.pool_size], [int(s) for s in a.strides],
                                   [int(p) for p in a.padding], [int(d) for d in a.dilation], bool(a.ceil_mode),
                                   layout=self.dl),
            name,
        )
        return Lin([Term(y, t.offset, t.scale)], 4, qt=x.qt, name=name)

    def op_mean(self, call, name):
        axes = sorted(int(ax) for ax in call.attrs.axis)
        if axes != [2, 3] or not call.attrs.keepdims or len(call.args[0].ty.shape) != 4:
            raise UnsupportedOpError("mean", name, "only a global average pool over H and W is supported")
        hw = int(call.args[0].ty.shape[2]) * int(call.args[0].ty.shape[3])
        x = self._plain_or_fine(self.get(call.args[0], name), "mean", name, min(FINE_L_MAX, 2**30 // hw))
        t = x.terms[0]
        s = self.emit(relax.op.sum(relax.op.astype(t.expr, "int32"), axis=list(self.hw_axes), keepdims=True), name)
        return Lin([Term(s, t.offset * hw, t.scale / hw)], 4, name=name)

    def op_nn_pad(self, call, name):
        raise UnsupportedOpError("pad", name, "explicit padding is supported only inside conv2d")


@tvm.transform.module_pass(opt_level=0, name="LowerQDQToInteger")
class LowerQDQToInteger:
    """Rewrite ``main`` of a QDQ-form module into integer compute in ``layout`` (see module docstring)."""

    def __init__(self, layout: str = "NCHW", input_dtype: str = "float32", input_layout: str = "NCHW"):
        self.layout, self.input_dtype, self.input_layout = layout, input_dtype, input_layout
        self.input_quant: Optional[InputQuant] = None  # after a run with an integer input: its quantization

    @keeps_user_errors
    def transform_module(self, mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
        low = _Lowering(mod["main"], self.layout, self.input_dtype, self.input_layout)
        func = low.run()
        self.input_quant = low.input_quant
        out = tvm.IRModule({"main": func}, attrs=mod.attrs)
        return relax.transform.DeadCodeElimination(["main"])(out)
