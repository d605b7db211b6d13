"""PackInt4: store 4-bit tensors two per byte.

Nibble order (``qcompile.int4``): along the channel axis (axis 1 of NCHW and of (N, C) tensors, the last
axis of NHWC/HWNC; axis I of weights), element ``2i`` goes to the LOW nibble and ``2i + 1`` to the HIGH nibble of
byte ``i``:

    packed[i] = (x[2i] & 0xF) | ((x[2i + 1] & 0xF) << 4)                       (uint8)
    x[2i]     = sext4(packed[i] & 0xF),  x[2i + 1] = sext4(packed[i] >> 4)     (sext4 only if signed)
    sext4(v)  = v - ((v & 8) << 1)

Weights are packed at compile time with ``qcompile.int4``; this module builds the same arithmetic as Relax
expressions (:func:`pack_int4`, :func:`unpack_int4`) for tensors packed while the model runs.

What is packed: weight constants proven 4-bit (``clip(w, -8, 7)``), packed at compile time; and
activations produced by a requantize whose clip range fits 4 bits, packed where they are produced.
Each consumer reads the packed tensor through an unpack. A channel count that is odd stays unpacked.
"""
from __future__ import annotations

import tvm
from tvm import relax
from tvm.ir.expr import Constant
from tvm.relax.expr_functor import PyExprMutator, mutator

from qcompile import int4
from qcompile.errors import keeps_user_errors


# ------------------------------------------------------------------------------------------------
# Relax ops
# ------------------------------------------------------------------------------------------------
def _shape(e):
    return [int(s) for s in e.ty.shape]


def pack_int4(x: relax.Expr, axis: int, storage: str = "uint8") -> relax.Expr:
    """Relax expression packing ``x`` (int8/uint8, values fit 4 bits) along ``axis``.

    The bytes are returned as ``storage``: uint8, or int8 (the same bits) for kernels that take signed
    4-bit operands in int8 buffers."""
    shp = _shape(x)
    split = shp[:axis] + [shp[axis] // 2, 2] + shp[axis + 1:]
    out = shp[:axis] + [shp[axis] // 2] + shp[axis + 1:]
    xs = relax.op.astype(relax.op.reshape(x, split), "int32")
    lo = relax.op.reshape(relax.op.strided_slice(xs, [axis + 1], [0], [1]), out)
    hi = relax.op.reshape(relax.op.strided_slice(xs, [axis + 1], [1], [2]), out)
    fifteen = relax.const(15, "int32")
    v = relax.op.bitwise_or(relax.op.bitwise_and(lo, fifteen),
                            relax.op.left_shift(relax.op.bitwise_and(hi, fifteen), relax.const(4, "int32")))
    if storage == "int8":  # reinterpret 128..255 as -128..-1 without relying on an out-of-range cast
        v = relax.op.subtract(v, relax.op.left_shift(relax.op.bitwise_and(v, relax.const(128, "int32")), relax.const(1, "int32")))
    return relax.op.astype(v, storage)


def unpack_int4(p: relax.Expr, axis: int, signed: bool) -> relax.Expr:
    """Relax expression unpacking ``p`` (uint8 or int8 bytes) along ``axis`` to int8 (signed) or uint8."""
    shp = _shape(p)
    v = relax.op.bitwise_and(relax.op.astype(p, "int32"), relax.const(255, "int32"))  # int8 storage too
    lo = relax.op.bitwise_and(v, relax.const(15, "int32"))
    hi = relax.op.right_shift(v, relax.const(4, "int32"))
    if signed:
        lo = relax.op.subtract(lo, relax.op.left_shift(relax.op.bitwise_and(lo, relax.const(8, "int32")), relax.const(1, "int32")))
        hi = relax.op.subtract(hi, relax.op.left_shift(relax.op.bitwise_and(hi, relax.const(8, "int32")), relax.const(1, "int32")))
    st = relax.op.stack([lo, hi], axis=axis + 1)
    full = shp[:axis] + [shp[axis] * 2] + shp[axis + 1:]
    return relax.op.astype(relax.op.reshape(st, full), "int8" if signed else "uint8")


_KERNEL_IN_AXIS = {"OIHW": 1, "OHWI": 3, "HWOI": 3}


def _four_bit_range(lo: int, hi: int, dtype: str):
    """``signed`` if [lo, hi] fits int4 (int8 storage) or uint4 (uint8 storage), else None."""
    if dtype == "int8" and -8 <= lo and hi <= 7:
        return True
    if dtype == "uint8" and 0 <= lo and hi <= 15:
        return False
    return None


@mutator
class _Packer(PyExprMutator):
    def __init__(self, mod):
        super().__init__(mod)
        self.packed = []  # (name, kind) for the summary

    def _channel_axis(self, var) -> int:
        shp = _shape(var)
        if len(shp) == 2:
            return 1
        # 4-D activations: the lowering emits NCHW with channels on axis 1, NHWC/HWNC on the last axis
        return self.layout_axis

    def visit_var_binding_(self, binding):
        value = self.visit_expr(binding.value)
        var = binding.var
        # 1. a 4-bit weight constant: clip(const, lo, hi) feeding conv2d/matmul
        if isinstance(value, relax.Call) and value.op.name == "relax.clip" and isinstance(value.args[0], Constant):
            signed = _four_bit_range(int(value.args[1].value), int(value.args[2].value), str(var.ty.dtype))
            w = value.args[0].value.numpy()
            axis = self.weight_axes.get(var.name, None)
            if signed is not None and axis is not None and w.shape[axis] % 2 == 0:
                pc = relax.const(int4.pack(w, axis), "uint8")
                new = self.builder_.emit(unpack_int4(pc, axis, signed), var.name + "_unpack")
                self.packed.append((var.name, "weight"))
                self.set_var_remap(var, new)
                return
        new_var = self.builder_.emit(value, var.name)
        # 2. a 4-bit activation: astype(clip(acc, lo, hi), int8|uint8) of a requantize
        src = self.lookup_binding(value.args[0]) if isinstance(value, relax.Call) and value.op.name == "relax.astype" \
            and isinstance(value.args[0], relax.Var) else None
        if self.activations and isinstance(src, relax.Call) and src.op.name == "relax.clip" and len(_shape(var)) in (2, 4):
            signed = _four_bit_range(int(src.args[1].value), int(src.args[2].value), str(var.ty.dtype))
            axis = self._channel_axis(var)
            if signed is not None and _shape(var)[axis] % 2 == 0:
                p = self.builder_.emit(pack_int4(new_var, axis), var.name + "_packed")
                u = self.builder_.emit(unpack_int4(p, axis, signed), var.name + "_unpack")
                self.packed.append((var.name, "activation"))
                self.set_var_remap(var, u)
                return
        self.set_var_remap(var, new_var)


@tvm.transform.module_pass(opt_level=0, name="PackInt4")
class PackInt4:
    """Pack 4-bit weights and activations of ``main`` two per byte (see module docstring).

    ``activations=False`` packs weights only: for GPU builds whose convolutions run on the tensor-core
    kernels, which get their packed operands from ``DispatchTensorCore``.
    """

    def __init__(self, activations: bool = True):
        self.activations = activations

    @keeps_user_errors
    def transform_module(self, mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
        func = mod["main"]
        weight_axes, layout_axis = {}, 1
        for block in func.body.blocks:
            for b in block.bindings:
                v = b.value
                if isinstance(v, relax.Call) and v.op.name in ("relax.nn.conv2d", "relax.matmul"):
                    w = v.args[1]
                    if isinstance(w, relax.Var):
                        weight_axes[w.name] = _KERNEL_IN_AXIS[str(v.attrs.kernel_layout)] if v.op.name == "relax.nn.conv2d" else 0
                    if v.op.name == "relax.nn.conv2d":
                        layout_axis = str(v.attrs.data_layout).index("C")
        packer = _Packer(mod)
        packer.weight_axes, packer.layout_axis, packer.activations = weight_axes, layout_axis, self.activations
        new_func = packer.visit_expr(func)
        out = packer.builder_.get()  # keeps the other functions (tensor-core kernels)
        out["main"] = new_func
        return relax.transform.DeadCodeElimination(["main"])(out)
