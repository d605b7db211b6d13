"""Schedules for the element-wise glue between tensor-core kernels (dlight-style rules).

The glue of a quantized ResNet (residual-add requantize, input quantize, casts) is injective over NHWC
int8 tensors with per-channel constants broadcast along C. dlight's Fallback maps one element to one
thread: 1-byte accesses and per-element index arithmetic. ``VectorizedElementwise`` gives each thread
``vec`` consecutive elements along the innermost axis, so loads and stores are ``vec`` bytes wide and
the index arithmetic is amortized.
"""
from __future__ import annotations

from tvm import s_tir, tirx
from tvm.s_tir.dlight.analysis import normalize_prim_func
from tvm.s_tir.dlight.base import try_inline
from tvm.s_tir.dlight.gpu.base import GPUScheduleRule
from tvm.target import Target


class VectorizedElementwise(GPUScheduleRule):
    """One injective block (after inlining) whose innermost extent is a multiple of ``vec``; else None."""

    def __init__(self, vec: int = 4, threads: int = 256):
        self.vec, self.threads = vec, threads

    def apply(self, func: tirx.PrimFunc, target: Target, _: bool):
        # 1. only GPU element-wise functions that are not already scheduled
        if not isinstance(func, tirx.PrimFunc) or not self.is_target_available(target):
            return None
        sch = s_tir.Schedule(func)
        infos = normalize_prim_func(sch)
        if infos is None:
            return None
        # 2. inline every producer; exactly one injective block must remain
        infos = try_inline(sch, infos)
        if len(infos) != 1 or not infos[0].is_injective():
            return None
        block = infos[0].block_rv
        loops = sch.get_loops(block)
        if not loops:
            return None
        extents = [sch.get(l).extent for l in loops]
        if not all(isinstance(e, tirx.IntImm) for e in extents):
            return None
        inner, total = int(extents[-1]), 1
        for e in extents:
            total *= int(e)
        # 3. vec elements per thread along the innermost axis, no tail (a predicate blocks vectorizing)
        if inner % self.vec or total % (self.vec * self.threads):
            return None
        fused = sch.fuse(*loops)
        bx, tx, v = sch.split(fused, factors=[None, self.threads, self.vec])
        sch.bind(bx, "blockIdx.x")
        sch.bind(tx, "threadIdx.x")
        sch.vectorize(v)
        return sch
