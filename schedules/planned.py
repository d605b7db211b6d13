"""One calling convention for a planned conv kernel: what the compiler and the tuner both get from ``plan_conv``.

A ``PlannedKernel`` says everything a caller needs to run a conv layer's kernels, as typed fields taken from the
builders' plans (``schedules.gemm.plan.GemmPlan`` for the implicit GEMM; nothing is parsed back from PrimFunc
attributes):

* ``funcs``: the PrimFuncs in launch order, with their calling convention (``calls``):

  - one kernel (``split_k == 1``, no ``streamk``): ``conv(x, w, bias, M, S, [res, rq2], [lut], out)``;
  - split-K pair (``split_k > 1``): ``gemm(x, w, ws)`` with ``ws`` int32 ``workspace_shape(spec, split_k)``, then
    ``epilogue(ws, bias, M, S, [res, rq2], [lut], out)`` (schedules/splitk.py);
  - stream-K (``streamk = (counters, words)``): ``conv(x, w, bias, M, S, [res, rq2], [lut], cnt, out, ws)`` with
    ``cnt`` int32[counters] zeros (the kernel leaves them zero) and ``ws`` an int32[words] scratch output.

  ``lut`` (``spec.lut`` > 0): the output lookup table, ``spec.lut`` entries of the output's storage type (ConvSpec).
  The kernels' epilogues read it through ``lut_buffer``; ``with_lut_param`` makes it a parameter.

* ``weights(w)``: the weight buffer the kernels take, from the layer's logical integer weights (OHWI for NHWC, HWOI
  for HWNC; values, not packed): packed two per byte for 4-bit, or expanded to 8 bits (``w_expand``: the ``w8``
  kernels and implicit_gemm_t's 4-bit form) and k-permuted per K-chunk (``w_kperm`` bytes: ``agl``).

Under ``plan_only()`` (the tuner's task extraction, which needs the plans alone) every kernel builder makes its
legality checks and plan as always and returns ``placeholder_kernel()`` instead of the kernel's TIR: the
PlannedKernels keep every field but ``funcs``, which hold those placeholders (empty PrimFuncs, not to be built).
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from dataclasses import dataclass

import numpy as np

from .spec import ConvSpec


@dataclass(frozen=True)
class PlannedKernel:
    spec: ConvSpec
    arch: str
    strategy: str  # one of schedules.STRATEGIES
    knobs: object  # the effective knobs the kernels were built with (GemmKnobs: the plan's ``effective_knobs``;
    #                KtKnobs / HaloKnobs resolved), None for fallback
    source: str  # where the knobs came from: "user" | "device" | "arch" | "nearest" | "default"
    funcs: tuple  # PrimFuncs in launch order
    split_k: int = 1  # > 1: funcs = (gemm, epilogue) over an int32 workspace (see the module docstring)
    streamk: tuple | None = None  # (tile counters, workspace words) of a stream-K kernel
    w_expand: bool = False  # 4-bit weights stored expanded to 8 bits (reference.expand_w4)
    w_kperm: int = 0  # the reduction permuted per K-chunk of this many bytes (reference.expand_w4 / permute_k8)

    @property
    def label(self) -> str:
        """The strategy as the compile summary shows it (``implicit_gemm+splitk4``, ``implicit_gemm+streamk``)."""
        return (self.strategy + (f"+splitk{self.split_k}" if self.split_k > 1 else "")
                + ("+streamk" if self.streamk else ""))

    def weights(self, w: np.ndarray) -> np.ndarray:
        """The int8 weight buffer the kernels take, from logical integer weights (channels last)."""
        from qcompile import int4

        from .reference import expand_w4, permute_k8

        w = np.asarray(w)
        if self.spec.w_bits == 4 and self.w_expand:
            return expand_w4(w, self.w_kperm)
        if self.spec.w_bits == 4:
            return int4.pack(w.astype(np.int8), 3).view(np.int8)
        wq = w.astype(np.int8)
        return permute_k8(wq, self.w_kperm) if self.w_kperm else wq

    def workspace_shape(self) -> tuple | None:
        """The split-K pair's int32 workspace shape (None for one kernel)."""
        if self.split_k <= 1:
            return None
        from .splitk import workspace_shape

        return tuple(workspace_shape(self.spec, self.split_k))

    def replace(self, **kw) -> "PlannedKernel":
        return dataclasses.replace(self, **kw)


_PLAN_ONLY = contextvars.ContextVar("qcompile_schedules_plan_only", default=False)
PLACEHOLDER_ATTR = "qcompile.placeholder"  # a placeholder kernel's attribute: the builder it stands for


@contextlib.contextmanager
def plan_only(on: bool = True):
    """Within the block (this thread / context), the kernel builders return ``placeholder_kernel`` after their
    legality checks instead of building TIR (``on`` False: they build, as outside it)."""
    token = _PLAN_ONLY.set(bool(on))
    try:
        yield
    finally:
        _PLAN_ONLY.reset(token)


def planning_only() -> bool:
    """Whether the kernel builders return placeholders (inside ``plan_only()``)."""
    return _PLAN_ONLY.get()


def placeholder_kernel(builder: str):
    """The empty PrimFunc a kernel builder returns under ``plan_only()`` (``PLACEHOLDER_ATTR``: ``builder``); it
    takes the attributes callers add to kernels, and computes nothing. It has no parameters, so the ``call_tir`` the
    dispatcher emits for it is not well formed: a module planned this way is read for its plans only (the tuner's
    extraction stops at the dispatch; the backend refuses it), never validated or lowered."""
    import tvm

    return tvm.tirx.PrimFunc([], tvm.tirx.Evaluate(0)).with_attr(PLACEHOLDER_ATTR, builder)


def lut_buffer(spec: ConvSpec):
    """The output lookup table's buffer of a kernel for ``spec`` (None without ``spec.lut``). The epilogue pieces
    read it as a free buffer (the kernel's prim_func is parsed without the well-formedness check, which would refuse
    it) and ``with_lut_param`` makes it a parameter of the finished PrimFunc."""
    if not spec.lut:
        return None
    import tvm

    return tvm.tirx.decl_buffer((spec.lut,), ConvSpec.storage(spec.out_dtype), name="lut")


def lut_value(spec: ConvSpec, lut, y):
    """The table entry of final value ``y`` (int32): ``lut[y - lut_min]``; ``y`` lies in the table's domain (the
    epilogue's clip range, which ConvSpec checks)."""
    return lut[y - spec.lut_min] if spec.lut_min else lut[y]


def with_lut_param(func, lut, before: int):
    """``func`` with buffer ``lut`` inserted as a parameter ahead of its ``before``-th one (None: ``func`` as it is),
    checked well-formed as TVMScript's parser checks a prim_func (its callers parse without the check)."""
    import tvm

    if lut is not None:
        params = list(func.params)
        params.insert(before, lut)
        func = tvm.tirx.PrimFunc(params, func.body, func.ret_type, func.attrs)
    tvm.s_tir.analysis.verify_well_formed(tvm.IRModule.from_expr(func))
    tvm.tirx.analysis.verify_tirx_well_formed(func)
    return func
