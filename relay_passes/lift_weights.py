"""LiftWeights: turn the large constants of ``main`` into parameters, so the weights can sit beside the .so.

    main(x)  with constants c_0 .. c_n   ->   main(x, w_0, ..., w_n)

Constants of at least ``min_bytes`` bytes become parameters ``w_i`` (in first-use order); their values are
returned in ``LiftWeights.values`` for the caller to save. The compiled code is then independent of the
weight values: one weights file serves every batch size of a model. (A stream-K kernel's tile counters -- its
last input, zeros the kernel leaves zero -- are state whose size depends on the batch: they stay in the .so.)
"""
from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from qcompile.errors import keeps_user_errors


@mutator
class _Lifter(PyExprMutator):
    def __init__(self, mod, min_bytes):
        super().__init__(mod)
        self.min_bytes = min_bytes
        self.params: list = []
        self.values: list = []
        self.seen: dict = {}
        self.mod = mod
        self.call_tir = tvm.ir.Op.get("relax.call_tir")

    def visit_call_(self, call):
        if call.op.same_as(self.call_tir):
            f = self.mod[call.args[0]] if call.args[0] in self.mod.functions else None
            if f is not None and f.attrs is not None and "qcompile.streamk" in f.attrs:
                ins = list(call.args[1].fields)
                args = relax.Tuple([self.visit_expr(a) for a in ins[:-1]] + [ins[-1]])
                return relax.Call(call.op, [call.args[0], args], call.attrs, call.ty_args)
        return super().visit_call_(call)

    def visit_generic_const_(self, op):
        arr = op.value.numpy() if hasattr(op.value, "numpy") else None
        if arr is None or arr.nbytes < self.min_bytes:
            return op
        for c, v in self.seen.items():  # the same constant object used twice -> one parameter
            if c.same_as(op):
                return v
        v = relax.Var(f"w{len(self.params)}", relax.TensorType(list(arr.shape), str(arr.dtype)))
        self.params.append(v)
        self.values.append(arr)
        self.seen[op] = v
        return v


@tvm.transform.module_pass(opt_level=0, name="LiftWeights")
class LiftWeights:
    def __init__(self, min_bytes: int = 1024):
        self.min_bytes = min_bytes
        self.values: list = []

    @keeps_user_errors
    def transform_module(self, mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
        func = mod["main"]
        lifter = _Lifter(mod, self.min_bytes)
        body = lifter.visit_expr(func.body)
        new = relax.Function(list(func.params) + lifter.params, body, func.ret_ty if hasattr(func, "ret_ty") else None,
                             func.is_pure, func.attrs)
        self.values = lifter.values
        out = tvm.IRModule(dict(mod.functions), attrs=mod.attrs)
        out["main"] = new
        return out
