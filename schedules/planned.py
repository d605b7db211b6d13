"""One calling convention for a planned conv kernel: what the compiler and the tuner both get from ``plan_conv``.

A ``PlannedKernel`` says everything a caller needs to run a conv layer's kernels, as typed fields taken from the
builders' plans (``schedules.gemm.plan.GemmPlan`` for the implicit GEMM; nothing is parsed back from PrimFunc
attributes):

* ``funcs``: the PrimFuncs in launch order, with their calling convention (``calls``):

  - one kernel (``split_k == 1``, no ``streamk``): ``conv(x, w, bias, M, S, [res, rq2], out)``;
  - split-K pair (``split_k > 1``): ``gemm(x, w, ws)`` with ``ws`` int32 ``workspace_shape(spec, split_k)``, then
    ``epilogue(ws, bias, M, S, [res, rq2], out)`` (schedules/splitk.py);
  - stream-K (``streamk = (counters, words)``): ``conv(x, w, bias, M, S, [res, rq2], cnt, out, ws)`` with ``cnt``
    int32[counters] zeros (the kernel leaves them zero) and ``ws`` an int32[words] scratch output.

* ``weights(w)``: the weight buffer the kernels take, from the layer's logical integer weights (OHWI for NHWC, HWOI
  for HWNC; values, not packed): packed two per byte for 4-bit, or expanded to 8 bits (``w_expand``: the ``w8``
  kernels and implicit_gemm_t's 4-bit form) and k-permuted per K-chunk (``w_kperm`` bytes: ``agl``).
"""
from __future__ import annotations

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
