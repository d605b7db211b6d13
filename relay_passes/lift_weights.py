"""LiftWeights: turn the large constants of ``main`` into parameters, so the weights can sit beside the .so.

    main(x)  with constants c_0 .. c_n   ->   main(x, w_0, ..., w_n)

Constants of at least ``min_bytes`` bytes become parameters ``w_i`` (in first-use order); their values are
returned in ``LiftWeights.values`` for the caller to save. The compiled code is then independent of the
weight values: one weights file serves every batch size of a model. (A stream-K kernel's tile counters -- its
last input, zeros the kernel leaves zero -- are state whose size depends on the batch: they stay in the .so. Such
kernels are named by ``state_funcs`` -- ``DispatchTensorCore.state_funcs`` -- or, where that is not given, carry the
marker attribute ``STATE_INPUT_ATTR``, which the dispatcher sets.)
"""
from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from qcompile.errors import keeps_user_errors

STATE_INPUT_ATTR = "qcompile.state_input"  # PrimFunc marker: the kernel's last input is state, not a weight


@mutator
class _Lifter(PyExprMutator):
    def __init__(self, mod, min_bytes, state_funcs=None):
        super().__init__(mod)
        self.min_bytes = min_bytes
        self.state_funcs = state_funcs
        self.params: list = []
        self.values: list = []
        self.seen: dict = {}
        self.mod = mod
        self.call_tir = tvm.ir.Op.get("relax.call_tir")

    def visit_call_(self, call):
        if call.op.same_as(self.call_tir):
            if self._keeps_state(call.args[0]):
                ins = list(call.args[1].fields)
                args = relax.Tuple([self.visit_expr(a) for a in ins[:-1]] + [ins[-1]])
                return relax.Call(call.op, [call.args[0], args], call.attrs, call.ty_args)
        return super().visit_call_(call)

    def _keeps_state(self, gv) -> bool:
        """Whether the kernel ``gv`` calls takes state as its last input (that constant stays)."""
        if self.state_funcs is not None:
            return gv.name_hint in self.state_funcs
        f = self.mod[gv] if gv in self.mod.functions else None
        return f is not None and f.attrs is not None and STATE_INPUT_ATTR in f.attrs

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
    """``min_bytes``: the smallest constant lifted; ``state_funcs``: names of the kernels whose last input is state
    (None: those marked with ``STATE_INPUT_ATTR``)."""

    def __init__(self, min_bytes: int = 1024, state_funcs=None):
        self.min_bytes = min_bytes
        self.state_funcs = None if state_funcs is None else set(state_funcs)
        self.values: list = []

    @keeps_user_errors
    def transform_module(self, mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
        func = mod["main"]
        lifter = _Lifter(mod, self.min_bytes, self.state_funcs)
        body = lifter.visit_expr(func.body)
        new = relax.Function(list(func.params) + lifter.params, body, func.ret_ty if hasattr(func, "ret_ty") else None,
                             func.is_pure, func.attrs)
        self.values = lifter.values
        out = tvm.IRModule(dict(mod.functions), attrs=mod.attrs)
        out["main"] = new
        return out
