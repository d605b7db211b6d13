"""A NumPy interpreter for qcompile's integer Relax graphs: the bit-exact reference.

It executes ``main`` of a module after :class:`LowerQDQToInteger` (and optionally ``PackInt4``) op
by op with NumPy integer arithmetic (int64 where TVM computes in int64, wrap-free), independently of
TVM's legalization and code generation. Only the ops the integer lowering emits are implemented;
anything else raises.
"""
from __future__ import annotations

import numpy as np
import tvm
from tvm import relax
from tvm.ir.expr import Constant

_PERM_TO_NCHW = {"NCHW": (0, 1, 2, 3), "NHWC": (0, 3, 1, 2), "HWNC": (2, 3, 0, 1)}
_KPERM_TO_OIHW = {"OIHW": (0, 1, 2, 3), "OHWI": (0, 3, 1, 2), "HWOI": (2, 3, 0, 1)}


def _ints(arr) -> list[int]:
    return [int(a) for a in arr]


def _conv2d_nchw(x: np.ndarray, w: np.ndarray, stride, pad, dilation, groups: int = 1) -> np.ndarray:
    """Integer NCHW/OIHW convolution, exact in int64 (im2col + matmul); ``groups`` > 1: output channels
    ``[g*O/G, (g+1)*O/G)`` read input channels ``[g*C/G, (g+1)*C/G)`` (depthwise: G = C)."""
    if groups != 1:
        c, o = x.shape[1], w.shape[0]
        if c % groups or o % groups or w.shape[1] * groups != c:
            raise ValueError(f"reference: conv2d with groups={groups}: {c} input / {o} output channels, weight "
                             f"{tuple(w.shape)}")
        cg, og = c // groups, o // groups
        return np.concatenate([_conv2d_nchw(x[:, g * cg:(g + 1) * cg], w[g * og:(g + 1) * og], stride, pad, dilation)
                               for g in range(groups)], axis=1)
    n, c, h, wd = x.shape
    o, _, kh, kw = w.shape
    x = np.pad(x.astype(np.int64), ((0, 0), (0, 0), (pad[0], pad[2]), (pad[1], pad[3])))
    oh = (x.shape[2] - dilation[0] * (kh - 1) - 1) // stride[0] + 1
    ow = (x.shape[3] - dilation[1] * (kw - 1) - 1) // stride[1] + 1
    cols = np.empty((n, c, kh, kw, oh, ow), np.int64)
    for i in range(kh):
        for j in range(kw):
            hi, wj = i * dilation[0], j * dilation[1]
            cols[:, :, i, j] = x[:, :, hi: hi + stride[0] * oh: stride[0], wj: wj + stride[1] * ow: stride[1]]
    # float64 BLAS is exact here: every product and partial sum is an integer far below 2**53
    # (|x|, |w| <= 255, C*kh*kw <= 2**20), so we check the bound and round back.
    wm, cm = w.reshape(o, -1), cols.reshape(n, c * kh * kw, oh * ow)
    bound = float(np.abs(wm).max(initial=0)) * float(np.abs(cm).max(initial=0)) * wm.shape[1]
    if bound < 2.0**52:
        return np.rint(wm.astype(np.float64) @ cm.astype(np.float64)).astype(np.int64).reshape(n, o, oh, ow)
    return (wm.astype(np.int64) @ cm).reshape(n, o, oh, ow)


def _max_pool_nchw(x, pool, stride, pad, dilation, ceil_mode):
    n, c, h, w = x.shape
    lo = np.iinfo(x.dtype).min if np.issubdtype(x.dtype, np.integer) else -np.inf
    extra_h = extra_w = 0
    if ceil_mode:
        eh = h + pad[0] + pad[2] - dilation[0] * (pool[0] - 1) - 1
        ew = w + pad[1] + pad[3] - dilation[1] * (pool[1] - 1) - 1
        extra_h = (-eh) % stride[0]
        extra_w = (-ew) % stride[1]
    xp = np.pad(x, ((0, 0), (0, 0), (pad[0], pad[2] + extra_h), (pad[1], pad[3] + extra_w)), constant_values=lo)
    oh = (xp.shape[2] - dilation[0] * (pool[0] - 1) - 1) // stride[0] + 1
    ow = (xp.shape[3] - dilation[1] * (pool[1] - 1) - 1) // stride[1] + 1
    out = np.full((n, c, oh, ow), lo, dtype=x.dtype)
    for i in range(pool[0]):
        for j in range(pool[1]):
            hi, wj = i * dilation[0], j * dilation[1]
            out = np.maximum(out, xp[:, :, hi: hi + stride[0] * oh: stride[0], wj: wj + stride[1] * ow: stride[1]])
    return out


class Reference:
    """Run the integer graph ``mod["main"]`` on NumPy inputs."""

    def __init__(self, mod: tvm.IRModule):
        self.func = mod["main"]

    def __call__(self, *inputs: np.ndarray):
        env = {p: np.asarray(x) for p, x in zip(self.func.params, inputs)}
        for block in self.func.body.blocks:
            for b in block.bindings:
                env[b.var] = self.eval(b.value, env)
        return self.eval(self.func.body.body, env)

    def eval(self, e, env):
        if isinstance(e, relax.Var):
            return env[e]
        if isinstance(e, (tvm.tirx.IntImm, tvm.tirx.FloatImm)):  # scalar attribute-like arguments
            return e.value
        if isinstance(e, Constant):
            return e.value.numpy()
        if isinstance(e, relax.Tuple):
            return tuple(self.eval(f, env) for f in e.fields)
        if isinstance(e, relax.ShapeExpr):
            return _ints(e.values)
        if not isinstance(e, relax.Call):
            raise NotImplementedError(f"reference: {type(e).__name__}")
        op = e.op.name
        args = [self.eval(a, env) for a in e.args]
        dtype = str(e.ty.dtype) if hasattr(e.ty, "dtype") and e.ty.dtype is not None else None
        fn = getattr(self, "op_" + op.replace("relax.", "").replace(".", "_"), None)
        if fn is None:
            raise NotImplementedError(f"reference: op {op}")
        out = fn(args, e.attrs, dtype)
        if isinstance(out, np.ndarray):
            assert tuple(out.shape) == tuple(int(s) for s in e.ty.shape), (op, out.shape, e.ty.shape)
        return out

    # ------------------------------------------------------------------------------------------
    @staticmethod
    def _arith(a, b, dtype, fn):
        wide = np.float64 if dtype.startswith("float") else np.int64
        if dtype == "float32":  # float32 ops are IEEE float32, as in TVM
            return fn(np.asarray(a, np.float32), np.asarray(b, np.float32)).astype(np.float32)
        return fn(np.asarray(a).astype(wide), np.asarray(b).astype(wide)).astype(dtype)

    def op_add(self, args, attrs, ty):
        return self._arith(args[0], args[1], ty, np.add)

    def op_subtract(self, args, attrs, ty):
        return self._arith(args[0], args[1], ty, np.subtract)

    def op_multiply(self, args, attrs, ty):
        return self._arith(args[0], args[1], ty, np.multiply)

    def op_divide(self, args, attrs, ty):
        return self._arith(args[0], args[1], ty, np.divide)

    def op_right_shift(self, args, attrs, ty):
        return self._arith(args[0], args[1], ty, np.right_shift)

    def op_left_shift(self, args, attrs, ty):
        return np.left_shift(args[0].astype(np.int64), np.asarray(args[1], np.int64)).astype(ty)

    def op_bitwise_and(self, args, attrs, ty):
        return np.bitwise_and(args[0], np.asarray(args[1]).astype(args[0].dtype)).astype(ty)

    def op_bitwise_or(self, args, attrs, ty):
        return np.bitwise_or(args[0].astype(ty), np.asarray(args[1]).astype(ty))

    def op_floor(self, args, attrs, ty):
        return np.floor(args[0]).astype(ty)

    def op_clip(self, args, attrs, ty):
        x = args[0]
        if x.dtype.kind == "f":
            return np.clip(x, args[1], args[2]).astype(ty)
        return np.clip(x.astype(np.int64), int(args[1]), int(args[2])).astype(ty)

    def op_astype(self, args, attrs, ty):
        x = args[0]
        if x.dtype.kind == "f" and ty.startswith(("int", "uint")):
            return np.trunc(x).astype(ty)
        return x.astype(ty)

    def op_permute_dims(self, args, attrs, ty):
        axes = _ints(attrs.axes) if attrs.axes is not None else None
        return np.ascontiguousarray(np.transpose(args[0], axes))

    def op_reshape(self, args, attrs, ty):
        return args[0].reshape(args[1])

    def op_sum(self, args, attrs, ty):
        return args[0].astype(np.int64 if ty.startswith("int") else np.float64).sum(
            axis=tuple(_ints(attrs.axis)), keepdims=bool(attrs.keepdims)).astype(ty)

    def op_strided_slice(self, args, attrs, ty):
        x, axes, begin, end = args[0], args[1], args[2], args[3]
        strides = args[4] if len(args) > 4 else [1] * len(axes)
        sl = [slice(None)] * x.ndim
        for ax, b, en, st in zip(axes, begin, end, strides):
            sl[ax] = slice(b, en, st)
        return x[tuple(sl)]

    def op_take(self, args, attrs, ty):
        table, idx = args
        idx = np.asarray(idx, np.int64)
        axis = int(attrs.axis) if attrs.axis is not None else 0
        mode = str(getattr(attrs, "mode", "fast") or "fast")
        if mode in ("clip", "wrap"):  # (the graph's own out-of-range rule)
            return np.take(table, idx, axis=axis, mode=mode).astype(ty)
        if idx.size and (idx.min() < 0 or idx.max() >= table.shape[axis]):
            raise IndexError(f"reference: take index out of range [0, {table.shape[axis]})")
        return np.take(table, idx, axis=axis).astype(ty)

    def op_concat(self, args, attrs, ty):
        return np.concatenate(args[0], axis=int(attrs.axis)).astype(ty)

    def op_stack(self, args, attrs, ty):
        return np.stack(args[0], axis=int(attrs.axis))

    def op_nn_pad(self, args, attrs, ty):
        x = args[0]
        pw = _ints(attrs.pad_width)
        return np.pad(x, [(pw[2 * i], pw[2 * i + 1]) for i in range(x.ndim)], constant_values=float(attrs.pad_value)).astype(ty)

    def op_nn_conv2d(self, args, attrs, ty):
        dl, kl = str(attrs.data_layout), str(attrs.kernel_layout)
        x = np.transpose(args[0], _PERM_TO_NCHW[dl])
        w = np.transpose(args[1], _KPERM_TO_OIHW[kl])
        out = _conv2d_nchw(x, w, _ints(attrs.strides), _ints(attrs.padding), _ints(attrs.dilation), int(attrs.groups))
        inv = np.argsort(_PERM_TO_NCHW[dl])
        return np.ascontiguousarray(np.transpose(out, inv)).astype(ty)

    def op_nn_max_pool2d(self, args, attrs, ty):
        dl = str(attrs.layout)
        x = np.transpose(args[0], _PERM_TO_NCHW[dl])
        out = _max_pool_nchw(x, _ints(attrs.pool_size), _ints(attrs.strides), _ints(attrs.padding),
                             _ints(attrs.dilation), bool(attrs.ceil_mode))
        return np.ascontiguousarray(np.transpose(out, np.argsort(_PERM_TO_NCHW[dl]))).astype(ty)

    def op_matmul(self, args, attrs, ty):
        a, b = args
        if ty.startswith("float"):
            return (a.astype(np.float64) @ b.astype(np.float64)).astype(ty)
        if float(np.abs(a).max(initial=0)) * float(np.abs(b).max(initial=0)) * a.shape[-1] < 2.0**52:  # exact
            return np.rint(a.astype(np.float64) @ b.astype(np.float64)).astype(np.int64).astype(ty)
        return (a.astype(np.int64) @ b.astype(np.int64)).astype(ty)
