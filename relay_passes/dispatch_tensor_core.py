"""DispatchTensorCore: run integer conv2d/dense + requantize on qcompile's tensor-core kernels.

Matches the chain :class:`LowerQDQToInteger` emits for a single-term requantize,

    acc = conv2d(x, w, out_dtype=int32)            (or matmul(x, w.T) for the dense layer)
    y   = astype(clip((((int64(acc) + bias) * M + 2^(S-1)) >> S) + zo, lo, hi), storage)

and replaces it by the ``call_tir`` kernels of ``qcompile.schedules.conv2d_int_plan`` (the strategy
``select_strategy`` picks: implicit GEMM in NHWC, its transposed form ``implicit_gemm_t`` or the stem's direct
halo kernel on sm_90a, direct in HWNC, a generic kernel where none applies; a split-K pair where the output
tiles cannot fill the GPU), whose fused epilogue computes exactly that. The dense layer runs as a 1x1 convolution on the same GEMM path.

A quantized residual add whose one operand is such a conv output used nowhere else,

    out = astype(clip((((int(y1) + c1) * M1 + (int(r) + c2) * M2 + 2^(S2-1)) >> S2) + zo2, lo2, hi2))

is fused into that conv's kernel as a second epilogue stage (y1 never reaches memory; ``r`` is read
in the epilogue). 4-bit activations produced by a kernel stay packed (two per byte, low nibble first)
when every consumer is a kernel (data or residual operand); other consumers read bytes.

On CUDA a lookup-table activation after a kernel's final value q (``find_luts``: a chain of element-wise integer ops
of q alone holding a ``take`` of a constant table -- hardswish as HardSigmoid x Mul, SiLU, a squeeze-excite gate --
whose one result used elsewhere is an 8-bit tensor) is evaluated at compile time on all 256 values of q's type; the
kernel takes that table (``ConvSpec.lut``) and writes ``table[q - qmin]``, and the chain leaves the graph. Kernels
of strategies without a table (``schedules.LUT_STRATEGIES``; the CUDA-core kernels take one) leave the chain as glue.

Grouped convs (NHWC, groups > 1) run on their own kernels (``schedules.grouped_gemm.grouped_kernel``): ``depthwise``
where groups == C == K; the tensor-core ``grouped_gemm`` (the implicit GEMM with each N tile inside one group) where
the per-group channels allow it (``QCOMPILE_GROUPED_GEMM=0``: never); else the CUDA-core ``grouped``. They read 4-bit
inputs one value per byte (so a producer whose consumers include one writes bytes) and write packed 4-bit outputs
where the kernel holds whole bytes.

On CUDA a stride-2 conv with a short 8-bit channel vector (the RGB stem, padded to 4 channels) runs as the stride-1
conv over its 2x2 space-to-depth input (``schedules.spec.space_to_depth``): the input is rearranged in the graph,

    x2 = reshape(permute_dims(reshape(x, [N, H/2, 2, W/2, 2, C]), [0, 1, 3, 2, 4, 5]), [N, H/2, W/2, 4C])

(an odd H / W padded with the input zero point first), the weights at compile time; the sums are the same.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import tvm
from tvm import relax
from tvm.ir.expr import Constant
from tvm.relax.expr_functor import PyExprMutator, mutator

from qcompile.errors import keeps_user_errors
from .lift_weights import STATE_INPUT_ATTR
from .pack_int4 import pack_int4, unpack_int4


def _call(e, var2val, op):
    v = var2val.get(e, e) if isinstance(e, relax.Var) else e
    return v if isinstance(v, relax.Call) and v.op.name == "relax." + op else None


def _const(e) -> Optional[np.ndarray]:
    return e.value.numpy() if isinstance(e, Constant) and hasattr(e.value, "numpy") else None


def _range_dtype(lo: int, hi: int, storage: str) -> str:
    if storage == "int8" and lo >= -8 and hi <= 7:
        return "int4"
    if storage == "uint8" and lo >= 0 and hi <= 15:
        return "uint4"
    return storage


@dataclass
class _Group:
    out: relax.Var          # the astype binding: the requantized tensor
    acc_call: relax.Call    # conv2d or matmul
    x: relax.Expr           # data operand of the conv (after an explicit zero-point pad is peeled off)
    w: np.ndarray           # weight values, OHWI/HWOI (conv) or (I, O) (dense)
    w_bits: int
    pad: tuple
    pad_value: int
    bias: np.ndarray
    M: np.ndarray
    S: np.ndarray
    zo: int
    lo: int
    hi: int
    out_dtype: str
    dense: bool
    fused: bool = False     # consumed only by a residual add that is fused into this kernel
    groups: int = 1         # conv groups (> 1: NHWC grouped / depthwise convs, on CUDA-core kernels)


@dataclass
class _Residual:
    out: relax.Var          # the add's requantized output
    group: _Group           # the conv fused with it
    res: relax.Var          # the other operand
    rq2: np.ndarray         # int32 [5, K]: c1, M1, c2, M2, S2
    zo2: int
    lo2: int
    hi2: int
    out_dtype: str
    i32: bool = False       # the graph computes this requantize in int32 (no intermediate overflows it)


def _term(e, var2val):
    """``(astype(t) [+ c]) * M`` -> (t, c, M), else None."""
    mul = _call(e, var2val, "multiply")
    if mul is None or _const(mul.args[1]) is None:
        return None
    M, e, c = _const(mul.args[1]), mul.args[0], 0
    off = _call(e, var2val, "add")
    if off is not None and _const(off.args[1]) is not None:
        c, e = _const(off.args[1]), off.args[0]
    cast = _call(e, var2val, "astype")
    if cast is None or not isinstance(cast.args[0], relax.Var):
        return None
    return cast.args[0], c, M


def _requant_tail(v, var2val):
    """astype(clip([((x + 2^(S-1)) >> S) + zo], lo, hi)) -> (x, S, zo, lo, hi) for an 8-bit (or 4-bit) result,
    else None (a 16- or 32-bit grid of a float value stays glue after an int32 kernel output)."""
    if str(v.attrs.dtype) not in ("int8", "uint8"):
        return None
    clip = _call(v.args[0], var2val, "clip")
    if clip is None:
        return None
    lo, hi = int(clip.args[1].value), int(clip.args[2].value)
    e, zo = clip.args[0], 0
    a = _call(e, var2val, "add")
    if a is not None and _const(a.args[1]) is not None and _const(a.args[1]).ndim == 0:
        zo, e = int(_const(a.args[1])), a.args[0]
    sh = _call(e, var2val, "right_shift")
    rnd = _call(sh.args[0], var2val, "add") if sh is not None else None
    if rnd is None or _const(sh.args[1]) is None or _const(rnd.args[1]) is None:
        return None
    S, R = _const(sh.args[1]).astype(np.int64), _const(rnd.args[1]).astype(np.int64)
    S_, R_ = np.broadcast_arrays(S, R)
    if np.any(S_ < 1) or not np.array_equal(R_, np.left_shift(np.int64(1), S_ - 1)):
        return None
    return rnd.args[0], S, zo, lo, hi


def _x_dtype(x, var2val) -> str:
    """Quantized type of a data operand, read off the clip range of its requantize."""
    v = var2val.get(x, x) if isinstance(x, relax.Var) else x
    while isinstance(v, relax.Call) and v.op.name in ("relax.reshape", "relax.nn.max_pool2d", "relax.permute_dims"):
        v = var2val.get(v.args[0], v.args[0])
    storage = str(x.ty.dtype)
    if isinstance(v, relax.Call) and v.op.name == "relax.astype":
        c = _call(v.args[0], var2val, "clip")
        if c is not None:
            return _range_dtype(int(c.args[1].value), int(c.args[2].value), storage)
    return storage


def _use_counts(func: relax.Function) -> dict:
    """How many call arguments in ``func`` name each var."""
    uses: dict = {}
    for block in func.body.blocks:
        for b in block.bindings:
            for a in getattr(b.value, "args", []):
                if isinstance(a, relax.Var):
                    uses[a] = uses.get(a, 0) + 1
    return uses


def _requant_bindings(func: relax.Function, var2val):
    """(binding, _requant_tail) for the astype bindings of ``func`` that end a requantize."""
    for block in func.body.blocks:
        for b in block.bindings:
            if isinstance(b.value, relax.Call) and b.value.op.name == "relax.astype":
                tail = _requant_tail(b.value, var2val)
                if tail is not None:
                    yield b, tail


def find_groups(func: relax.Function, layouts=("NHWC", "HWNC")) -> dict:
    """Map each requantized conv/dense output var to its :class:`_Group` (output types as dispatched)."""
    return find_fusions(func, layouts=layouts)[0]


def _find_groups(func: relax.Function, layouts=("NHWC", "HWNC")) -> dict:
    var2val = relax.analysis.get_var2val(func)
    uses = _use_counts(func)
    groups = {}
    for b, (e, S, zo, lo, hi) in _requant_bindings(func, var2val):
        mul = _call(e, var2val, "multiply")
        if mul is None or _const(mul.args[1]) is None:
            continue
        M, e = _const(mul.args[1]), mul.args[0]
        bias = None
        off = _call(e, var2val, "add")
        if off is not None and _const(off.args[1]) is not None:
            bias, e = _const(off.args[1]), off.args[0]
        cast = _call(e, var2val, "astype")
        if cast is None or not isinstance(cast.args[0], relax.Var):
            continue
        acc_var = cast.args[0]
        acc = var2val.get(acc_var)
        if not isinstance(acc, relax.Call) or acc.op.name not in ("relax.nn.conv2d", "relax.matmul") \
                or uses.get(acc_var, 0) != 1 or str(acc_var.ty.dtype) != "int32":
            continue
        wexpr = acc.args[1]
        wclip = _call(wexpr, var2val, "clip")
        w = _const(wclip.args[0]) if wclip is not None else _const(wexpr)
        if w is None:
            continue
        dense = acc.op.name == "relax.matmul"
        ngroups = 1 if dense else int(acc.attrs.groups)
        if not dense and (str(acc.attrs.data_layout) not in layouts
                          or (ngroups != 1 and (str(acc.attrs.data_layout), str(acc.attrs.kernel_layout))
                              != ("NHWC", "OHWI"))):
            continue
        x, pad, pad_value = acc.args[0], (0, 0, 0, 0), 0
        if not dense:
            pad = tuple(int(p) for p in acc.attrs.padding)
            padded = _call(x, var2val, "nn.pad")
            if padded is not None:
                pw = [int(p) for p in padded.attrs.pad_width]
                hw = {"NHWC": (1, 2), "HWNC": (0, 1), "NCHW": (2, 3)}[str(acc.attrs.data_layout)]
                pad = (pw[2 * hw[0]], pw[2 * hw[1]], pw[2 * hw[0] + 1], pw[2 * hw[1] + 1])
                pad_value, x = int(float(padded.attrs.pad_value)), padded.args[0]
        K = w.shape[1] if dense else (w.shape[0] if str(acc.attrs.kernel_layout) in ("OHWI", "OIHW") else w.shape[2])
        chan = lambda c: np.broadcast_to(np.asarray(c).reshape(-1) if np.size(c) > 1 else np.asarray(c).reshape(()), (K,))
        bias = chan(bias if bias is not None else 0)
        if np.abs(bias).max(initial=0) >= 2**31:
            continue
        w_bits = 4 if wclip is not None and int(wclip.args[1].value) >= -8 and int(wclip.args[2].value) <= 7 else 8
        groups[b.var] = _Group(b.var, acc, x, w, w_bits, pad, pad_value, bias.astype(np.int32),
                               chan(M).astype(np.int32), chan(S).astype(np.int32), zo, lo, hi,
                               _range_dtype(lo, hi, str(b.var.ty.dtype)), dense, groups=ngroups)
    return groups


def _packed_pool(call) -> Optional[tuple]:
    """(logical shape, storage dtype, pool, strides, padding) when ``call`` is an NHWC max pool that qcompile's pool
    kernel can run on a packed 4-bit input (``schedules.pool.max_pool_packed4_applies``), else None."""
    from qcompile.schedules.pool import max_pool_packed4_applies

    if not (isinstance(call, relax.Call) and isinstance(call.op, tvm.ir.Op) and call.op.name == "relax.nn.max_pool2d"):
        return None
    a, x = call.attrs, call.args[0]
    if str(a.layout) != "NHWC" or str(a.out_layout) != "NHWC" or \
            not all(isinstance(d, tvm.tirx.IntImm) for d in x.ty.shape):
        return None
    shape, dtype = tuple(int(d) for d in x.ty.shape), str(x.ty.dtype)
    pool, strides, pad = (tuple(int(v) for v in t) for t in (a.pool_size, a.strides, a.padding))
    if not max_pool_packed4_applies(shape, dtype, pool, strides, pad, tuple(int(d) for d in a.dilation),
                                    bool(a.ceil_mode)):
        return None
    return shape, dtype, pool, strides, pad


def find_fusions(func: relax.Function, packed_pools: bool = False, layouts=("NHWC", "HWNC")):
    """(groups, residuals): :func:`find_groups` plus the residual adds fused into a conv kernel, with
    each kernel's output type decided (4-bit outputs packed only when kernels consume all of them; with
    ``packed_pools`` a max pool that runs on the packed tensor counts as such a consumer). ``layouts``: the conv
    data layouts matched (the CPU kernels add NCHW, whose channels are axis 1)."""
    groups = _find_groups(func, layouts)
    var2val = relax.analysis.get_var2val(func)
    uses = _use_counts(func)
    residuals = {}
    for b, (e, S2, zo2, lo2, hi2) in _requant_bindings(func, var2val):
        if b.var in groups:
            continue
        plus = _call(e, var2val, "add")
        if plus is None:
            continue
        terms = [_term(plus.args[0], var2val), _term(plus.args[1], var2val)]
        if None in terms:
            continue
        for i in (0, 1):
            g = groups.get(terms[i][0])
            if g is None or g.dense or g.fused or uses.get(g.out, 0) != 1:
                continue
            other = terms[1 - i]
            if str(other[0].ty.dtype) not in ("int8", "uint8") or \
                    [int(d) for d in other[0].ty.shape] != [int(d) for d in g.out.ty.shape]:
                continue
            K = int(g.out.ty.shape[1 if not g.dense and str(g.acc_call.attrs.data_layout) == "NCHW" else -1])
            chan = lambda c: np.broadcast_to(np.asarray(c).reshape(-1) if np.size(c) > 1 else np.asarray(c).reshape(()), (K,)).astype(np.int64)
            rows = [chan(terms[i][1]), chan(terms[i][2]), chan(other[1]), chan(other[2]), chan(S2)]
            if any(np.abs(r).max(initial=0) >= 2**31 for r in rows):
                continue
            g.fused = True
            residuals[b.var] = _Residual(b.var, g, other[0], np.stack(rows).astype(np.int32), zo2, lo2, hi2,
                                         _range_dtype(lo2, hi2, str(b.var.ty.dtype)),
                                         str(b.value.args[0].ty.dtype) == "int32")
            break
    # A 4-bit output stays packed only when every consumer is a kernel's data or residual operand; for glue
    # consumers (pools, un-fused adds) the kernel writes the same values one per byte (no pack/unpack).
    kernel_uses: dict = {}
    for g in groups.values():
        if not g.dense and g.groups == 1:  # (grouped / depthwise kernels read 4-bit inputs one value per byte)
            kernel_uses[g.x] = kernel_uses.get(g.x, 0) + 1
    for r in residuals.values():
        kernel_uses[r.res] = kernel_uses.get(r.res, 0) + 1
    if packed_pools:  # (the stem's pool: it reads the packed stem output and writes its own output packed)
        for x, v in var2val.items():
            if _packed_pool(v) is not None and isinstance(v.args[0], relax.Var):
                kernel_uses[v.args[0]] = kernel_uses.get(v.args[0], 0) + 1
    for var, g in list(groups.items()) + list(residuals.items()):
        if g.out_dtype in ("int4", "uint4") and uses.get(var, 0) != kernel_uses.get(var, -1):
            g.out_dtype = str(var.ty.dtype)
    return groups, residuals


# element-wise integer ops a lookup-table chain may hold (each a function of the conv's output alone)
_LUT_OPS = ("relax.astype", "relax.add", "relax.subtract", "relax.multiply", "relax.right_shift", "relax.left_shift",
            "relax.clip", "relax.take", "relax.minimum", "relax.maximum")
_NP_BINARY = {"relax.add": np.add, "relax.subtract": np.subtract, "relax.multiply": np.multiply,
              "relax.right_shift": np.right_shift, "relax.left_shift": np.left_shift, "relax.minimum": np.minimum,
              "relax.maximum": np.maximum}


@dataclass
class _Lut:
    """A lookup-table chain after a conv kernel's final value ``q``: element-wise integer ops of ``q`` alone (scalar
    constants; at least one ``take`` of a constant table) whose only value used outside the chain is its result
    ``out``, an 8-bit tensor of ``q``'s shape. The kernel writes ``out`` = ``table[q - lut_min]`` and the chain leaves
    the graph."""
    out: relax.Var          # the chain's result
    chain: tuple            # the chain's binding vars (``out`` included), in order
    table: np.ndarray       # ``out`` for every value of ``q``'s storage type, ``lut_min`` first (256 entries)
    lut_min: int
    takes: int              # table lookups (take) the chain holds


def _int_dtype(dtype: str) -> bool:
    return dtype.startswith("int") or dtype.startswith("uint")


def _lut_operand(a, op: str, i: int) -> bool:
    """Whether a non-variable argument ``a`` (position ``i`` of ``op``) keeps the chain a function of one tensor: a
    scalar integer constant (a shift amount within its type), a clip bound, a take's 1-D constant table."""
    if op == "relax.clip":
        return i > 0 and isinstance(a, tvm.tirx.IntImm)
    c = _const(a)
    if c is None or not _int_dtype(str(c.dtype)):
        return False
    if op == "relax.take":
        return i == 0 and c.ndim == 1
    if c.size != 1:
        return False
    return op not in ("relax.right_shift", "relax.left_shift") or 0 <= int(c.reshape(())) < 8 * c.itemsize


def _lut_step(call, var, env: dict) -> Optional[np.ndarray]:
    """NumPy value of binding ``var = call`` (a ``_LUT_OPS`` call) from the values in ``env``, with relax's integer
    semantics (wrapping casts and arithmetic, arithmetic right shift, ``clip`` = max(min(x, hi), lo), ``take`` in its
    index mode); None where it has none here (a clip bound outside the type, a take mode other than clip / wrap)."""
    dt = np.dtype(str(var.ty.dtype))
    op = call.op.name
    val = lambda a: env[a] if isinstance(a, relax.Var) else _const(a).reshape(())
    with np.errstate(over="ignore"):
        if op == "relax.astype":
            return val(call.args[0]).astype(dt)
        if op == "relax.clip":
            lo, hi = int(call.args[1].value), int(call.args[2].value)
            x = val(call.args[0])
            if not (np.iinfo(x.dtype).min <= lo <= hi <= np.iinfo(x.dtype).max):
                return None
            return np.maximum(np.minimum(x, hi), lo).astype(dt)
        if op == "relax.take":
            table, idx = _const(call.args[0]), val(call.args[1]).astype(np.int64)
            mode, n = str(call.attrs.mode), table.shape[0]
            axis = call.attrs.axis  # (None: the flattened table, the same for a 1-D one)
            if (table is None or table.ndim != 1 or (axis is not None and int(axis) != 0)
                    or mode not in ("clip", "wrap") or table.dtype != dt):
                return None
            return table[np.clip(idx, 0, n - 1) if mode == "clip" else np.mod(idx, n)]
        return _NP_BINARY[op](val(call.args[0]).astype(dt), val(call.args[1]).astype(dt)).astype(dt)


def _var_uses(func: relax.Function) -> dict:
    """var -> the binding vars whose values name it (None: the function's result names it)."""
    users: dict = {}
    for block in func.body.blocks:
        for b in block.bindings:
            for v in relax.analysis.free_vars(b.value):
                users.setdefault(v, []).append(b.var)
    for v in relax.analysis.free_vars(func.body.body):
        users.setdefault(v, []).append(None)
    return users


def _lut_chain(q: relax.Var, later: list, users: dict) -> Optional[_Lut]:
    """The lookup-table chain of kernel output ``q`` (a :class:`_Lut`), or None. ``later``: the bindings after q's.
    1. Gather, in binding order, every element-wise integer call (``_LUT_OPS``) of q's shape whose variable arguments
       are all q or gathered values and whose other arguments are scalar constants / clip bounds / a take's table.
    2. The result: the latest gathered 8-bit value whose needed calls (back to q) are used only by each other -- q
       and every intermediate value has no use outside them; the result's own uses stay in the graph.
    3. The table (``_lut_table``): those calls evaluated in NumPy on every value of q's storage type, where they hold
       a take."""
    shape = [int(d) for d in q.ty.shape]
    members, order = {q}, []
    for b in later:
        c = b.value
        if not isinstance(c, relax.Call):
            continue
        vs = [a for a in c.args if isinstance(a, relax.Var)]
        if not vs or not all(a in members for a in vs):
            continue
        if not (isinstance(c.op, tvm.ir.Op) and c.op.name in _LUT_OPS) or (  # (shift amounts: constants only)
                c.op.name.endswith("_shift") and isinstance(c.args[1], relax.Var)) \
                or not isinstance(b.var.ty, relax.TensorType) or not _int_dtype(str(b.var.ty.dtype)) \
                or [int(d) if isinstance(d, tvm.tirx.IntImm) else -1 for d in b.var.ty.shape] != shape:
            continue
        if all(_lut_operand(a, c.op.name, i) for i, a in enumerate(c.args) if not isinstance(a, relax.Var)):
            members.add(b.var)
            order.append(b)
    by_var = {b.var: b for b in order}
    for b in reversed(order):  # (the latest result first: the longest chain)
        if str(b.var.ty.dtype) not in ("int8", "uint8"):
            continue
        need, todo = {b.var}, [b.var]  # the calls b's value needs, and q
        while todo:
            for a in by_var[todo.pop()].value.args:
                if isinstance(a, relax.Var) and a not in need:
                    need.add(a)
                    if not a.same_as(q):
                        todo.append(a)
        if all(u in need for m in need if not m.same_as(b.var) for u in users.get(m, [])):
            return _lut_table(q, [c for c in order if c.var in need])
    return None


def _lut_table(q: relax.Var, chain: list) -> Optional[_Lut]:
    """The :class:`_Lut` of ``chain`` (bindings; the last one's value is the result): its calls evaluated on every
    value of q's 8-bit storage type, where it holds a take."""
    takes = sum(b.value.op.name == "relax.take" for b in chain)
    qdt = np.dtype(str(q.ty.dtype))
    if not takes or qdt.itemsize != 1:
        return None
    info = np.iinfo(qdt)
    env = {q: np.arange(info.min, info.max + 1).astype(qdt)}
    for b in chain:
        env[b.var] = _lut_step(b.value, b.var, env)
        if env[b.var] is None:
            return None
    return _Lut(chain[-1].var, tuple(b.var for b in chain), env[chain[-1].var], int(info.min), takes)


def find_luts(func: relax.Function, groups: dict, residuals: dict) -> dict:
    """Kernel output var (a conv's requantized output, or its fused residual add's) -> its :class:`_Lut`, where an
    element-wise lookup-table chain is that output's only consumer (``_lut_chain``)."""
    outs = {r.out for r in residuals.values()} | {g.out for g in groups.values() if not g.fused}
    users = _var_uses(func)
    luts = {}
    for block in func.body.blocks:
        bindings = list(block.bindings)
        for i, b in enumerate(bindings):
            if b.var in outs and str(b.var.ty.dtype) in ("int8", "uint8"):
                lut = _lut_chain(b.var, bindings[i + 1:], users)
                if lut is not None:
                    luts[b.var] = lut
    return luts


@mutator
class _Dispatcher(PyExprMutator):
    def __init__(self, mod, groups, residuals, arch, log, target_kind="cuda", s2d=None, expand_w4=True,
                 tuning_logs=(), device=None, luts=None):
        super().__init__(mod)
        self.luts = dict(luts or {})  # kernel output var -> _Lut: the chains its kernel's epilogue applies
        self.lut_skip = {v for lut in self.luts.values() for v in lut.chain}  # their bindings: not emitted
        self.tuning_logs, self.device = tuple(tuning_logs), device
        self.mod_, self.groups, self.arch, self.log, self.kind = mod, groups, arch, log, target_kind
        self.s2d = target_kind == "cuda" if s2d is None else s2d
        self.expand_w4 = expand_w4
        self.residuals = residuals
        self.var2val = relax.analysis.get_var2val(mod["main"])
        self.packed: dict = {}   # original var -> new var holding its packed 4-bit form
        self.chosen: list = []   # (conv output, strategy)
        self.sources: list = []  # (conv output, knobs source: device / arch / nearest / default; implicit GEMMs, grouped)
        self.planned: list = []  # (conv output, schedules.planned.PlannedKernel): what each tensor-core layer runs
        self.state_funcs: set = set()  # kernels whose last input is state (stream-K tile counters): LiftWeights
        self.fused: list = []    # (conv output, residual add output) fused into one kernel
        self.pools4: dict = {}   # packed 4-bit max pools: key -> GlobalVar
        self.pooled4: list = []  # one key per pool run on packed bytes

    def _data(self, x, dtype: str, layout_axis: int):
        """The kernel's data operand: packed for 4-bit types."""
        new = self.visit_expr(x)
        if dtype not in ("int4", "uint4"):
            return new
        if x in self.packed:
            return self.packed[x]
        p = self.builder_.emit(pack_int4(new, layout_axis, storage="int8" if dtype == "int4" else "uint8"),
                               (x.name if isinstance(x, relax.Var) else "x") + "_packed")
        if isinstance(x, relax.Var):
            self.packed[x] = p
        return p

    def _pool4(self, var, call) -> bool:
        """A max pool of a kernel's packed 4-bit output: qcompile's pool kernel on the packed bytes, its output packed
        too (what the next convs read; other consumers get it unpacked)."""
        from qcompile.schedules.pool import max_pool_relax_func

        pp = _packed_pool(call) if self.kind == "cuda" else None
        x = call.args[0] if pp is not None else None
        if x is None or x not in self.packed:
            return False
        shape, dtype, pool, strides, pad = pp
        signed = dtype == "int8"
        key = (shape, dtype, pool, strides, pad)
        if key not in self.pools4:
            name = f"qpool_max4_{len(self.pools4)}"
            self.pools4[key] = self.builder_.add_func(max_pool_relax_func(
                name, *shape, dtype, pool, strides, pad, packed4="int4" if signed else "uint4"), name)
        oshape = [int(d) for d in var.ty.shape]
        out = self.builder_.emit(relax.call_tir(self.pools4[key], [self.packed[x]],
                                                relax.TensorType(oshape[:3] + [oshape[3] // 2], dtype)),
                                 var.name + "_packed")
        self.packed[var] = out
        self.set_var_remap(var, self.builder_.emit(unpack_int4(out, 3, signed), var.name + "_unpack"))
        self.pooled4.append(key)
        return True

    def visit_var_binding_(self, binding):
        if binding.var in self.lut_skip:  # (a lookup-table chain: its kernel wrote the result, remapped there)
            return
        if self._pool4(binding.var, binding.value):
            return
        r = self.residuals.get(binding.var)
        g = r.group if r is not None else self.groups.get(binding.var)
        if g is None or (r is None and g.fused):
            # not a kernel (a fused conv's own chain stays as it is here; nothing uses it once its
            # residual add is replaced, and DeadCodeElimination drops it)
            return super().visit_var_binding_(binding)
        if g.groups != 1:  # (CUDA kernels only; the te-compute check on a CPU leaves grouped convs as they are)
            return self._emit_grouped(binding.var, g, r) if self.kind == "cuda" else super().visit_var_binding_(binding)
        self._emit_kernel(binding.var, g, r)

    def _lut_spec(self, var, spec, applies: bool):
        """(spec, lut): ``spec`` with the lookup table of ``var``'s chain (``ConvSpec.lut``: the table's 256 entries of
        the chain result's type, indexed by the final value minus its type's minimum) where the layer's kernel applies
        one (``applies``), else ``spec`` and None -- the chain then stays in the graph. The table changes no tuning
        key: the layer looks up the record of the same conv without it (the table costs each output a byte load from
        a 256-byte table, beside the conv's own work)."""
        lut = self.luts.get(var)
        if lut is None:
            return spec, None
        if not applies:
            del self.luts[var]
            self.lut_skip.difference_update(lut.chain)
            return spec, None
        return spec.replace(out_dtype=str(lut.out.ty.dtype), lut=len(lut.table), lut_min=lut.lut_min), lut

    def _lut_planned(self, name: str, pk, lut, out_dtype: str):
        """Record layer ``name``'s PlannedKernel; with a table, the spec of the same conv without it (what its tuning
        task measures and its record serves)."""
        if lut is not None:
            pk = pk.replace(spec=pk.spec.replace(lut=0, lut_min=0, out_dtype=out_dtype))
        self.planned.append((name, pk))

    def _emit_grouped(self, var, g: _Group, r: Optional[_Residual]):
        """A grouped / depthwise conv (NHWC) on the kernel ``_grouped_knobs`` plans (``depthwise``, ``grouped_gemm``
        on tensor cores or the CUDA-core ``grouped``), with the knobs of its tuning record where a log has one; 4-bit activations are read one
        value per byte, the output written packed where the kernel holds whole bytes."""
        from qcompile.schedules import ConvSpec

        N, H, W, C = (int(s) for s in g.x.ty.shape)
        K, R, S_ = g.w.shape[0], g.w.shape[1], g.w.shape[2]
        a = g.acc_call.attrs
        res = {}
        if r is not None:
            res = dict(has_residual=True, res_dtype=_x_dtype(r.res, self.var2val), zo2=r.zo2, lo2=r.lo2, hi2=r.hi2,
                       res_i32=r.i32)
            if res["res_dtype"] in ("int4", "uint4") and K % 2:
                res["res_dtype"] = str(r.res.ty.dtype)
            if (r.rq2 == r.rq2[:, :1]).all():
                res["rq2_uniform"] = tuple(int(v) for v in r.rq2[:, 0])
        out_dtype = (r or g).out_dtype
        spec = ConvSpec(N=N, H=H, W=W, C=C, K=K, R=R, S=S_, stride=tuple(int(v) for v in a.strides), padding=g.pad,
                        dilation=tuple(int(v) for v in a.dilation), layout="NHWC", x_dtype=str(g.x.ty.dtype),
                        w_bits=g.w_bits, out_dtype=out_dtype, zo=g.zo, lo=g.lo, hi=g.hi, pad_value=g.pad_value,
                        shift_ge33=bool(33 <= np.min(g.S) and np.max(g.S) <= 62), groups=g.groups, **res)
        spec, lut = self._lut_spec(var, spec, True)  # (both CUDA-core kernels apply a table)
        pk = self._grouped_knobs(spec)
        self._lut_planned(g.out.name, pk, lut, out_dtype)
        self.sources.append((g.out.name, pk.source))
        out_dtype = pk.spec.out_dtype  # (a 4-bit output the kernel cannot pack: one value per byte; a table's type)
        fname = f"qconv_{g.out.name}" + ("_resadd" if r is not None else "")
        func = pk.funcs[0].with_attr("op_pattern", 8).with_attr("tirx.is_scheduled", True)
        gv = self.builder_.add_func(func.with_attr("global_symbol", fname), fname)
        self.chosen.append((g.out.name, pk.label + ("+lut" if lut is not None else "")))
        epi = [relax.const(g.bias, "int32"), relax.const(g.M, "int32"), relax.const(g.S, "int32")]
        if r is not None:
            self.fused.append((g.out.name, var.name))
            epi += [self._data(r.res, res["res_dtype"], 3), relax.const(r.rq2, "int32")]
        if lut is not None:
            epi.append(relax.const(lut.table, out_dtype))
        _, _, out_shape = pk.spec.shapes()
        out = self.builder_.emit(relax.call_tir(gv, [self.visit_expr(g.x), relax.const(pk.weights(g.w), "int8"), *epi],
                                                relax.TensorType(list(out_shape), ConvSpec.storage(out_dtype))),
                                 var.name + "_cc")
        if out_dtype in ("int4", "uint4"):
            self.packed[var] = out
            out = self.builder_.emit(unpack_int4(out, 3, out_dtype == "int4"), var.name + "_unpack")
        self.set_var_remap(var if lut is None else lut.out, out)

    def _grouped_knobs(self, spec):
        """The planned kernel of a grouped layer (``spec.groups`` > 1) on its strategy (``schedules.grouped_gemm.
        grouped_kernel``: ``depthwise``, the tensor-core ``grouped_gemm`` where it takes the layer, else
        ``grouped``), with its knobs from the tuning logs (``schedules.tuning.knobs_for``: this device's record, the
        arch's, the nearest batch's, else the kernel's default, "default"); a record's knobs that the kernel's space
        refuses for the layer (``KernelSpace.legal``, the builder's check: e.g. for its own epilogue) give way to the
        default, and an error while planning legal knobs is raised; a layer ``grouped_gemm`` cannot plan at all runs
        on ``grouped``."""
        from qcompile.schedules.grouped import plan_grouped
        from qcompile.schedules.grouped_gemm import grouped_kernel
        from qcompile.schedules.space import SPACES
        from qcompile.schedules.tuning import knobs_for

        from qcompile.schedules.gemm.plan import NotApplicable

        strategy = grouped_kernel(spec, self.arch, self.device, self.tuning_logs)
        if strategy == "grouped_gemm":
            try:
                return self._grouped_gemm(spec)
            except NotApplicable:  # (no tile of the kernel plans for this layer on this arch: the CUDA-core kernel)
                strategy = "grouped"
        kn, source = knobs_for(spec, self.arch, self.device, self.tuning_logs, strategy)
        if source != "default" and SPACES[strategy].legal(spec, self.arch, kn) is None:
            return plan_grouped(spec, spec.groups, self.arch, kn, source=source)
        return plan_grouped(spec, spec.groups, self.arch)  # (no record, or knobs the kernel's space refuses here)

    def _grouped_gemm(self, spec):
        """The ``grouped_gemm`` PlannedKernel of a grouped layer (``gemm_spec``: 4-bit weight values one per byte)
        with its record's knobs, else (no record, or knobs it refuses) the default tile."""
        from qcompile.schedules.gemm.plan import NotApplicable
        from qcompile.schedules.grouped_gemm import STRATEGY, gemm_spec, plan_grouped_gemm
        from qcompile.schedules.tuning import knobs_for

        spec = gemm_spec(spec)
        kn, source = knobs_for(spec, self.arch, self.device, self.tuning_logs, STRATEGY)
        if source != "default":
            try:
                return plan_grouped_gemm(spec, self.arch, kn, source=source)
            except NotApplicable:
                pass
        return plan_grouped_gemm(spec, self.arch)

    def _emit_kernel(self, var, g: _Group, r: Optional[_Residual]):
        from qcompile.schedules import ConvSpec, plan_conv, select_strategy
        from qcompile.schedules.spec import operand_plan, space_to_depth, space_to_depth_weights

        x_dtype = _x_dtype(g.x, self.var2val)
        xs = [int(s) for s in g.x.ty.shape]
        if g.dense:
            layout, (N, C), H, W = "NHWC", xs, 1, 1
            K, R, S_ = g.w.shape[1], 1, 1
            w = np.ascontiguousarray(g.w.T).reshape(K, 1, 1, C)
            stride, dil = (1, 1), (1, 1)
        else:
            a = g.acc_call.attrs
            layout = str(a.data_layout)
            N, H, W, C = (xs[0], xs[1], xs[2], xs[3]) if layout == "NHWC" else (xs[2], xs[0], xs[1], xs[3])
            w = g.w
            K, R, S_ = (w.shape[0], w.shape[1], w.shape[2]) if layout == "NHWC" else (w.shape[2], w.shape[0], w.shape[1])
            stride, dil = tuple(int(s) for s in a.strides), tuple(int(d) for d in a.dilation)
        c_pad, x_dtype, w_bits = operand_plan(C, x_dtype, g.w_bits, g.dense)  # (the RGB stem: C padded to 4)
        out_dtype = (r or g).out_dtype
        if out_dtype in ("int4", "uint4") and K % 2:
            out_dtype = str(var.ty.dtype)
        res = {}
        if r is not None:
            res_dtype = _x_dtype(r.res, self.var2val)
            if res_dtype in ("int4", "uint4") and K % 2:
                res_dtype = str(r.res.ty.dtype)
            res = dict(has_residual=True, res_dtype=res_dtype, zo2=r.zo2, lo2=r.lo2, hi2=r.hi2, res_i32=r.i32)
            if (r.rq2 == r.rq2[:, :1]).all():  # per-tensor activation scales: compile the constants in
                res["rq2_uniform"] = tuple(int(v) for v in r.rq2[:, 0])
        if c_pad:
            w = np.concatenate([w, np.zeros(w.shape[:-1] + (c_pad,), w.dtype)], axis=-1)
            C += c_pad
        spec = ConvSpec(N=N, H=H, W=W, C=C, K=K, R=R, S=S_, stride=stride, padding=g.pad, dilation=dil,
                        layout=layout, x_dtype=x_dtype, w_bits=w_bits, out_dtype=out_dtype, zo=g.zo, lo=g.lo,
                        hi=g.hi, pad_value=g.pad_value, shift_ge33=bool(33 <= np.min(g.S) and np.max(g.S) <= 62), **res)
        s2d = space_to_depth(spec) if self.s2d else None  # (the stem: 7x7/2 on 4 channels -> 4x4/1 on 16)
        if s2d is not None:
            w, spec0, spec = space_to_depth_weights(w, spec), spec, s2d
        lut = None
        if self.kind == "cuda":
            from qcompile.schedules import LUT_STRATEGIES

            strategy = select_strategy(spec, self.arch)
            base_dtype = spec.out_dtype
            spec, lut = self._lut_spec(var, spec, strategy in LUT_STRATEGIES)
            out_dtype = spec.out_dtype
            # (4-bit weights kept packed: a w8 kernel runs as the register-A kernel that unpacks B itself)
            pk = plan_conv(spec, self.arch, strategy, packed_weights=not self.expand_w4,
                           tuning_logs=self.tuning_logs, device=self.device)
            self._lut_planned(g.out.name, pk, lut, base_dtype)
            funcs = list(pk.funcs)
            if strategy == "implicit_gemm":  # (the strategy whose knobs tuning records hold)
                self.sources.append((g.out.name, pk.source))
        else:  # the kernels' own TE compute (same epilogue and packing) for checking this pass on a CPU
            from qcompile.schedules.fallback import make_fallback
            from qcompile.schedules.planned import PlannedKernel

            strategy, funcs = "te-compute", [make_fallback(spec, self.kind)]
            pk = PlannedKernel(spec, self.arch, strategy, None, "default", tuple(funcs))
        gvs = []
        for i, func in enumerate(funcs):
            func = func.with_attr("op_pattern", 8)  # opaque: nothing is fused into it
            if self.kind == "cuda":
                func = func.with_attr("tirx.is_scheduled", True)  # dlight leaves it alone
            fname = f"qconv_{g.out.name}" + ("_resadd" if r is not None else "") + ("_splitk_epilogue" if i else "")
            if pk.streamk is not None and i == 0:  # (its last input, the tile counters, is state: LiftWeights)
                func = func.with_attr(STATE_INPUT_ATTR, True)
                self.state_funcs.add(fname)
            gvs.append(self.builder_.add_func(func.with_attr("global_symbol", fname), fname))
        self.chosen.append((g.out.name, pk.strategy + ("+s2d" if s2d is not None else "") + pk.label[len(pk.strategy):]
                            + ("+lut" if lut is not None else "")))
        if r is not None:
            self.fused.append((g.out.name, var.name))
        x = self._data(g.x, x_dtype, 1 if g.dense else 3)  # (dense: [N, C])
        if c_pad:
            x = self.builder_.emit(relax.op.nn.pad(x, [0, 0, 0, 0, 0, 0, 0, c_pad], pad_value=0.0),
                                   var.name + "_cpad")
        if s2d is not None:  # x2[n, i, j, (dr*2 + ds)*C + c] = x[n, 2i + dr, 2j + ds, c] (an odd H / W padded)
            if spec0.H % 2 or spec0.W % 2:
                x = self.builder_.emit(relax.op.nn.pad(x, [0, 0, 0, spec0.H % 2, 0, spec0.W % 2, 0, 0],
                                                       pad_value=float(g.pad_value)), var.name + "_s2dpad")
            x = relax.op.reshape(x, (N, s2d.H, 2, s2d.W, 2, spec0.C))
            x = relax.op.reshape(relax.op.permute_dims(x, [0, 1, 3, 2, 4, 5]), (N, s2d.H, s2d.W, s2d.C))
            x = self.builder_.emit(x, var.name + "_s2d")
        if g.dense:
            x = self.builder_.emit(relax.op.reshape(x, (N, 1, 1, int(x.ty.shape[-1]))), var.name + "_x4d")
        wq = pk.weights(w)  # (packed 4-bit, or expanded to 8 bits / k-permuted as the kernel takes them)
        epi = [relax.const(g.bias, "int32"), relax.const(g.M, "int32"), relax.const(g.S, "int32")]
        if r is not None:
            epi += [self._data(r.res, res["res_dtype"], 3), relax.const(r.rq2, "int32")]
        if lut is not None:  # (the table after [res, rq2]: planned.py's calling convention)
            epi.append(relax.const(lut.table, out_dtype))
        _, _, out_shape = spec.shapes()
        out_ty = relax.TensorType(list(out_shape), ConvSpec.storage(out_dtype))
        sk = pk.streamk
        if sk is not None:  # stream-K: tile counters (zeros, left zero by the kernel) and a scratch workspace output
            call = relax.call_tir(gvs[0], [x, relax.const(wq, "int8"), *epi, relax.const(np.zeros(sk[0], np.int32))],
                                  [out_ty, relax.TensorType([sk[1]], "int32")])
            out = self.builder_.emit(relax.TupleGetItem(self.builder_.emit(call, var.name + "_sk"), 0), var.name + "_tc")
        elif len(gvs) == 1:
            out = self.builder_.emit(relax.call_tir(gvs[0], [x, relax.const(wq, "int8"), *epi], out_ty), var.name + "_tc")
        else:  # split-K: int32 partial sums, then the epilogue kernel
            from qcompile.schedules.splitk import workspace_shape

            wsh = workspace_shape(spec, pk.split_k)
            part = self.builder_.emit(relax.call_tir(gvs[0], [x, relax.const(wq, "int8")],
                                                     relax.TensorType(list(wsh), "int32")), var.name + "_partial")
            out = self.builder_.emit(relax.call_tir(gvs[1], [part, *epi], out_ty), var.name + "_tc")
        if out_dtype in ("int4", "uint4"):
            self.packed[var] = out
            out = self.builder_.emit(unpack_int4(out, 3, out_dtype == "int4"), var.name + "_unpack")
        res_var = var if lut is None else lut.out  # (with a table the kernel writes the chain's result)
        if g.dense:
            out = self.builder_.emit(relax.op.reshape(out, [int(s) for s in res_var.ty.shape]), res_var.name)
        self.set_var_remap(res_var, out)


@tvm.transform.module_pass(opt_level=0, name="DispatchTensorCore")
class DispatchTensorCore:
    """Replace requantized integer conv2d/dense in ``main`` by tensor-core kernels for ``arch``.
    ``space_to_depth``: run the stem in its space-to-depth form (None: on CUDA, not with the CPU kernels).
    ``expand_w4``: 4-bit weights go to the kernels whose tuning record says ``w8`` expanded to 8 bits
    (``reference.expand_w4``); False keeps every 4-bit weight packed (those kernels unpack B themselves).
    ``tuning_logs`` (files or folders searched before the packaged log) and ``device`` (the GPU name records are
    matched against; None: arch-level matching) choose the knobs (``schedules.tuning.knobs_for``)."""

    def __init__(self, arch: str = "sm_90", log=None, target_kind: str = "cuda", space_to_depth=None,
                 expand_w4: bool = True, tuning_logs=(), device=None):
        self.arch, self.log, self.kind, self.s2d = arch, log, target_kind, space_to_depth
        self.expand_w4 = expand_w4
        self.tuning_logs, self.device = tuple(tuning_logs or ()), device
        self.chosen: list = []
        self.sources: list = []
        self.planned: list = []  # (conv output, PlannedKernel) per tensor-core layer
        self.state_funcs: set = set()  # names of kernels whose last input is state (``LiftWeights(state_funcs=)``)
        self.fused: list = []
        self.pooled4: list = []  # max pools run on packed 4-bit bytes (on CUDA: the INT4 models' stem pool)

    @keeps_user_errors
    def transform_module(self, mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
        groups, residuals = find_fusions(mod["main"], packed_pools=self.kind == "cuda")
        # (the CUDA kernels apply lookup tables; the CPU check of this pass, te-compute, leaves the chains as they are)
        luts = find_luts(mod["main"], groups, residuals) if self.kind == "cuda" else {}
        d = _Dispatcher(mod, groups, residuals, self.arch, self.log, self.kind, self.s2d, self.expand_w4,
                        self.tuning_logs, self.device, luts)
        func = d.visit_expr(mod["main"])
        self.chosen, self.fused, self.sources, self.pooled4 = d.chosen, d.fused, d.sources, d.pooled4
        self.planned, self.state_funcs = d.planned, d.state_funcs
        out = d.builder_.get()
        out["main"] = func
        out = relax.transform.DeadCodeElimination(["main"])(out)
        return out
