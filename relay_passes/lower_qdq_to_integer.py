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

The pass emits every integer op directly in ``layout`` (NCHW, NHWC or HWNC; weights OIHW, OHWI, HWOI).
The only layout transforms are on the quantized network input and, where a 4-D tensor is returned or
flattened with spatial extent > 1, at the output. The network input quantize is
``clip(floor(x / s + 0.5) + zp, lo, hi)`` (float32; ties round up); the output dequantize is
``float32(q - zp) * s``. A 4-bit tensor is an int8/uint8 tensor clipped to its 4-bit range (see
:mod:`qcompile.qdq`); ``PackInt4`` packs those later.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np
import tvm
from tvm import relax
from tvm.ir.expr import Constant

from qcompile.errors import QCompileError, UnsupportedOpError, keeps_user_errors
from qcompile.fixed_point import MAX_SHIFT, quantize_multipliers
from qcompile.qdq import QType, QTYPES, check_scale, const_value, qtype_of

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

    def plain(self) -> bool:
        return self.qt is not None and len(self.terms) == 1 and self.lo == -math.inf and self.hi == math.inf


@dataclass
class Weight:
    q: np.ndarray  # int values, (O, I, kh, kw) or (O, I)
    scale: np.ndarray  # per output channel (O,) or scalar
    qt: QType
    transposed: bool = False  # dense weight seen through permute_dims: (I, O)


@dataclass
class FloatConst:
    value: np.ndarray


def _name(var) -> str:
    return var.name if isinstance(var, relax.Var) else ""


class _Lowering:
    def __init__(self, func: relax.Function, layout: str):
        if layout not in LAYOUTS:
            raise QCompileError(f"unknown layout '{layout}' (choose from {', '.join(LAYOUTS)})")
        self.func = func
        self.layout = layout
        self.dl, self.kl, self.caxis, self.hw_axes, self.perm = LAYOUTS[layout]
        self.bb = relax.BlockBuilder()
        self.var2val = relax.analysis.get_var2val(func)
        self.env: dict = {}
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

    def _run(self) -> relax.Function:
        x = relax.Var(self.input.name, self.input.ty)
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
        lin = self.get(src, name)
        if not isinstance(lin, Lin):
            raise UnsupportedOpError("clip", name)
        lo, hi = float(call.args[1].value), float(call.args[2].value)
        return Lin(lin.terms, lin.rank, max(lin.lo, lo), min(lin.hi, hi), None, name)

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
            return Lin([Term(ent[1], np.array(-z, np.int64), np.array(s))], rank, qt=ent[2], name=name)
        raise UnsupportedOpError("dequantize", name, "operand is not a quantized tensor")

    def _weight(self, q, scale, zp, qt, name):
        if np.any(zp != 0):
            raise UnsupportedOpError("dequantize", name, "asymmetric weights (non-zero weight zero point) are not supported")
        return Weight(q.astype(np.int64), scale.astype(np.float64), qt)

    # -- input / output --------------------------------------------------------------------------
    def quantize_input(self, x, s, zp, qt, name):
        """``q = clip(floor(x / s + 0.5) + zp, qmin, qmax)`` on the float NCHW input, then to the layout."""
        f = relax.op.floor(relax.op.add(relax.op.divide(x, relax.const(float(s), "float32")), relax.const(0.5, "float32")))
        if zp:
            f = relax.op.add(f, relax.const(float(zp), "float32"))
        q = self.emit(relax.op.astype(relax.op.clip(f, qt.qmin, qt.qmax), qt.storage), name or "input_q")
        if self.layout != "NCHW" and len(x.ty.shape) == 4:
            q = self.emit(relax.op.permute_dims(q, list(self.perm)), "input_layout")
        return q

    def output(self, e):
        v = self.get(e, "output") if not isinstance(e, relax.Tuple) else None
        if isinstance(e, relax.Tuple):
            return relax.Tuple([self.output(f) for f in e.fields])
        if isinstance(v, tuple) and v[0] in ("q", "done"):
            raise UnsupportedOpError("output", _name(e), "the model returns a quantized tensor; expected a dequantized float output")
        if not isinstance(v, Lin) or len(v.terms) != 1:
            raise UnsupportedOpError("output", _name(e), "the model output is not a single dequantized tensor")
        t = v.terms[0]
        i32 = relax.op.astype(t.expr, "int32")
        if np.any(t.offset != 0):
            i32 = relax.op.add(i32, self._chan_const(t.offset, v.rank, "int32"))
        y = relax.op.multiply(relax.op.astype(i32, "float32"), self._chan_const(t.scale, v.rank, "float32"))
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
        mults, shift = self._multipliers(ms, name)
        wide = "int64"
        # Terms that are all 8-bit tensors (residual adds, pools) fit int32 with a narrower multiplier:
        # sum_i |t_i + c_i| * |M_i| + 2^(S-1) < 2^31 with S <= 30. Integer math in int32 is several times
        # cheaper on GPUs than int64; ~21-bit multipliers are about as precise as float32.
        if all(str(t.expr.ty.dtype) in ("int8", "uint8") for t in lin.terms):
            tmax = sum(255 + int(np.max(np.abs(t.offset))) for t in lin.terms)
            bits = int(np.floor(np.log2((2**31 - 2**29 - 1) / tmax)))
            if bits >= 16:
                m32, s32 = quantize_multipliers(ms, bits=bits)
                if np.all(s32 <= 30):
                    mults, shift, wide = m32, s32, "int32"
        acc = None
        for t, M in zip(lin.terms, mults):
            v = relax.op.astype(t.expr, wide)
            if np.any(t.offset != 0):
                v = relax.op.add(v, self._chan_const(t.offset, lin.rank, wide))
            v = relax.op.multiply(v, self._chan_const(M, lin.rank, wide))
            acc = v if acc is None else relax.op.add(acc, v)
        rnd = np.left_shift(np.int64(1), shift - 1)
        acc = relax.op.add(acc, self._chan_const(rnd, lin.rank, wide))
        acc = relax.op.right_shift(acc, self._chan_const(shift, lin.rank, wide))
        if zp:
            acc = relax.op.add(acc, relax.const(int(zp), wide))
        return self.emit(relax.op.astype(relax.op.clip(acc, lo, hi), qt.storage), name)

    @staticmethod
    def _multipliers(ms: list, name: str):
        """:func:`quantize_multipliers` of the requantize ``name``, or a QCompileError where a multiplier (input scale
        x weight scale / output scale) is not finite, too large for 31 bits, or so small that every channel's
        integer multiplier is 0 (an output that does not depend on the input)."""
        for m in ms:
            m = np.asarray(m, np.float64)
            if not np.all(np.isfinite(m)):
                raise QCompileError(f"quantize '{name}': the requantize multiplier (input scale / output scale) is not "
                                    f"finite; the scales of the layer feeding it are out of range")
        try:
            mults, shift = quantize_multipliers(ms)
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
        return Lin([Term(acc, offset.astype(np.int64), scale)], 4, name=name)

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
        offset = -zp * w.q.sum(axis=1) if zp else np.zeros(w.q.shape[0], np.int64)
        scale = t.scale * np.broadcast_to(w.scale, (w.q.shape[0],))
        return Lin([Term(acc, offset.astype(np.int64), scale)], 2, name=name)

    def _affine(self, lin: Lin, mul=None, add=None, name=""):
        """``lin * mul + add`` for per-channel constants (BN folding, bias)."""
        if lin.lo > -math.inf or lin.hi < math.inf:
            raise UnsupportedOpError("add/multiply", name, "a per-channel affine op after ReLU/clip cannot be folded")
        terms = list(lin.terms)
        if mul is not None:
            if np.any(mul == 0):
                raise UnsupportedOpError("multiply", name, "a zero per-channel scale cannot be folded")
            if not np.all(np.isfinite(mul)):
                raise QCompileError(f"node '{name}': a per-channel factor (batch norm) is NaN or infinite")
            terms = [Term(t.expr, t.offset, t.scale * mul) for t in terms]
        if add is not None:
            t0 = terms[0]
            with np.errstate(all="ignore"):
                steps = np.round(np.asarray(add, np.float64) / t0.scale) + t0.offset
            self._check_offset(steps, name, "bias")
            terms[0] = Term(t0.expr, steps.astype(np.int64), t0.scale)
        return Lin(terms, lin.rank, name=name)

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
            return Lin(terms, 2, src.lo, src.hi, src.qt, name)
        raise UnsupportedOpError("reshape", name, f"reshape {in_shape} -> {shape} is not supported in the integer graph")

    def op_add(self, call, name):
        a, b = self.get(call.args[0], name), self.get(call.args[1], name)
        if isinstance(a, FloatConst) and isinstance(b, Lin):
            a, b = b, a
        if isinstance(a, Lin) and isinstance(b, FloatConst):
            return self._affine(a, add=np.broadcast_to(self._per_channel(b.value, a.rank, name), (self._channels(a),)), name=name)
        if isinstance(a, Lin) and isinstance(b, Lin):
            if a.rank != b.rank:
                raise UnsupportedOpError("add", name, "operands of different rank")
            for v in (a, b):
                if v.lo > -math.inf or v.hi < math.inf:
                    raise UnsupportedOpError("add", name, "an operand clamped by ReLU/clip without a quantize in between")
            return Lin(a.terms + b.terms, a.rank, name=name)
        raise UnsupportedOpError("add", name)

    def _channels(self, lin: Lin) -> int:
        e = lin.terms[0].expr
        return int(e.ty.shape[self.caxis if lin.rank == 4 else 1])

    def op_multiply(self, call, name):
        a, b = self.get(call.args[0], name), self.get(call.args[1], name)
        if isinstance(a, FloatConst):
            a, b = b, a
        if isinstance(a, Lin) and isinstance(b, FloatConst):
            return self._affine(a, mul=self._per_channel(b.value, a.rank, name), name=name)
        raise UnsupportedOpError("multiply", name, "only multiplication by a per-channel constant (batch norm) is supported")

    def op_nn_relu(self, call, name):
        a = self.get(call.args[0], name)
        if not isinstance(a, Lin):
            raise UnsupportedOpError("relu", name)
        return Lin(a.terms, a.rank, max(a.lo, 0.0), a.hi, None, name)

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
        x = self._q_operand(call.args[0], "mean", name)
        axes = sorted(int(ax) for ax in call.attrs.axis)
        if axes != [2, 3] or not call.attrs.keepdims:
            raise UnsupportedOpError("mean", name, "only a global average pool over H and W is supported")
        t = x.terms[0]
        hw = int(call.args[0].ty.shape[2]) * int(call.args[0].ty.shape[3])
        s = self.emit(relax.op.sum(relax.op.astype(t.expr, "int32"), axis=list(self.hw_axes), keepdims=True), name)
        return Lin([Term(s, t.offset * hw, t.scale / hw)], 4, name=name)

    def op_nn_pad(self, call, name):
        raise UnsupportedOpError("pad", name, "explicit padding is supported only inside conv2d")


@tvm.transform.module_pass(opt_level=0, name="LowerQDQToInteger")
class LowerQDQToInteger:
    """Rewrite ``main`` of a QDQ-form module into integer compute in ``layout`` (see module docstring)."""

    def __init__(self, layout: str = "NCHW"):
        self.layout = layout

    @keeps_user_errors
    def transform_module(self, mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
        func = _Lowering(mod["main"], self.layout).run()
        out = tvm.IRModule({"main": func}, attrs=mod.attrs)
        return relax.transform.DeadCodeElimination(["main"])(out)
