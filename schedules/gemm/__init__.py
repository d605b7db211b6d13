"""The implicit GEMM (NHWC) and direct HWNC tensor-core kernel, split by concern.

* ``plan.py``: ``GemmPlan`` -- every size, flag and the legality decision of one (spec, arch, knobs, layout, split)
  point, derived once by ``make_plan`` (``NotApplicable`` for illegal points; no TIR is built);
* ``helpers.py``: index arithmetic and PrimExpr helpers (``requant_stage1``, swizzles, descriptors);
* ``loaders.py``: K-chunks into the shared ring or registers, the 4-bit unpack, register-A fragments;
* ``mma.py``: the MMA issue (wgmma per chunk, ping-pong consumer step, mma.sync);
* ``epilogue.py``: the fused epilogue;
* ``mainloop.py``: one macro per main-loop form;
* ``kernel.py``: ``build_kernel(plan)`` -> PrimFunc.
"""
from .kernel import build_kernel
from .plan import GemmPlan, NotApplicable, make_plan

__all__ = ["GemmPlan", "NotApplicable", "build_kernel", "make_plan"]
