"""DispatchPools: run 8-bit NHWC max pooling on qcompile's pool kernel (CUDA).

    y = nn.max_pool2d(x, pool, strides, padding, layout="NHWC")   ->   call_tir(max_pool_nhwc, [x])

where x is int8 / uint8 with channels a multiple of 4, no dilation, floor mode. The kernel
(``qcompile.schedules.pool``) computes ``y[n, p, q, c] = max over the window's positions inside x`` with the type's
minimum where none is, exactly what TVM's max_pool2d computes (its padding is that minimum): the same bytes. Other
pools stay Relax ops (legalized, scheduled by qcompile's glue rules and dlight).
"""
from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from qcompile.errors import keeps_user_errors


@mutator
class _PoolDispatcher(PyExprMutator):
    def __init__(self, mod):
        super().__init__(mod)
        self.pool_op = tvm.ir.Op.get("relax.nn.max_pool2d")
        self.kernels: dict = {}  # (shape, dtype, attrs) -> GlobalVar
        self.replaced: list = []

    def visit_call_(self, call):
        from qcompile.schedules.pool import max_pool_nhwc_applies, max_pool_relax_func

        call = super().visit_call_(call)
        if not call.op.same_as(self.pool_op):
            return call
        a, x = call.attrs, call.args[0]
        shape = [int(s) for s in x.ty.shape] if all(isinstance(s, tvm.tirx.IntImm) for s in x.ty.shape) else None
        dtype = str(x.ty.dtype)
        pool, strides, pad = (tuple(int(v) for v in t) for t in (a.pool_size, a.strides, a.padding))
        if shape is None or str(a.layout) != "NHWC" or str(a.out_layout) != "NHWC" or not max_pool_nhwc_applies(
                shape, dtype, pool, strides, pad, tuple(int(d) for d in a.dilation), bool(a.ceil_mode)):
            return call
        key = (tuple(shape), dtype, pool, strides, pad)
        if key not in self.kernels:
            name = f"qpool_max_{len(self.kernels)}"
            self.kernels[key] = self.builder_.add_func(max_pool_relax_func(name, *shape, dtype, pool, strides, pad), name)
        self.replaced.append(key)
        return relax.call_tir(self.kernels[key], [x], call.ty)


@tvm.transform.module_pass(opt_level=0, name="DispatchPools")
class DispatchPools:
    """Replace 8-bit NHWC max pools in ``main`` by qcompile's pool kernel (``replaced``: one entry per pool)."""

    def __init__(self):
        self.replaced: list = []

    @keeps_user_errors
    def transform_module(self, mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
        d = _PoolDispatcher(mod)
        func = d.visit_expr(mod["main"])
        self.replaced = d.replaced
        out = d.builder_.get()
        out["main"] = func
        return out
