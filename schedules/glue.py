"""Schedules for the element-wise glue between tensor-core kernels (dlight-style rules).

The glue of a quantized ResNet (residual-add requantize, input quantize, casts) is injective over NHWC
int8 tensors with per-channel constants broadcast along C. dlight's Fallback maps one element to one
thread: 1-byte accesses and per-element index arithmetic. ``VectorizedElementwise`` gives each thread
``vec`` consecutive elements along the innermost axis, so loads and stores are ``vec`` bytes wide and
the index arithmetic is amortized.

The input quantize of a CUDA build also changes the layout (NCHW float -> NHWC bytes, the channels padded to 4, and
the stem's 2x2 space-to-depth): each output byte gathers one input element, so no vector loads apply, and
``VectorizedElementwise`` left its 4-byte loop serial, storing byte by byte. ``GatherRowElementwise`` gives each
thread one whole innermost output row (16 bytes there), computed in registers and stored as one vector.

The pools between them (the stem's 3x3 max pool, the global average pool's sum) reduce over spatial windows of
NHWC tensors. dlight's reduction rules map them onto threads without vector accesses (ResNet-50's at batch 256 on the
H100, ``scripts/check_pools.py``: the max pool 225 us, the sum 60 us; under this rule 155 us and 6.4 us). ``ChannelsLastWindowReduction`` gives each thread ``vec`` consecutive
channels of one output position, accumulates them in registers over the window and stores them as one vector.
"""
from __future__ import annotations

import tvm
from tvm import s_tir, tirx
from tvm.s_tir.dlight.analysis import normalize_prim_func
from tvm.s_tir.dlight.base import try_inline
from tvm.s_tir.dlight.gpu.base import GPUScheduleRule
from tvm.target import Target


def _single_block(rule: GPUScheduleRule, func, target: Target, kind: str):
    """(schedule, block info) when ``func`` is a GPU PrimFunc that, once every producer is inlined, is one block whose
    info says ``kind`` (``is_injective``, ``is_reduction``); else None."""
    if not isinstance(func, tirx.PrimFunc) or not rule.is_target_available(target):
        return None
    sch = s_tir.Schedule(func)
    infos = normalize_prim_func(sch)
    if infos is None:
        return None
    infos = try_inline(sch, infos)
    if len(infos) != 1 or not getattr(infos[0], kind)():
        return None
    return sch, infos[0]


def _injective_loops(rule: GPUScheduleRule, func, target: Target):
    """(schedule, block, its loops, their extents as ints) when ``func`` is one injective block after inlining (see
    ``_single_block``) with static loop extents; else None."""
    one = _single_block(rule, func, target, "is_injective")
    if one is None:
        return None
    sch, info = one
    loops = sch.get_loops(info.block_rv)
    extents = [sch.get(l).extent for l in loops]
    if not loops or not all(isinstance(e, tirx.IntImm) for e in extents):
        return None
    return sch, info.block_rv, loops, [int(e) for e in extents]


def _bind(sch, fused, threads: int):
    """Split loop ``fused`` over blocks of ``threads`` threads and bind both; the thread loop."""
    bx, tx = sch.split(fused, factors=[None, threads])
    sch.bind(bx, "blockIdx.x")
    sch.bind(tx, "threadIdx.x")
    return bx, tx


def _local_result(sch, block, tx):
    """``block``'s result computed into registers (a local cache written back under thread loop ``tx``)."""
    wb = sch.cache_write(block, 0, "local")
    sch.reverse_compute_at(wb, tx, preserve_unit_loops=True)
    return wb


class VectorizedElementwise(GPUScheduleRule):
    """One injective block (after inlining) whose innermost extent is a multiple of ``vec``; else None."""

    def __init__(self, vec: int = 4, threads: int = 256):
        self.vec, self.threads = vec, threads

    def apply(self, func: tirx.PrimFunc, target: Target, _: bool):
        # 1. only GPU element-wise functions that are not already scheduled
        # 2. inline every producer; exactly one injective block must remain, with static loop extents
        one = _injective_loops(self, func, target)
        if one is None:
            return None
        sch, block, loops, extents = one
        inner, total = extents[-1], 1
        for e in extents:
            total *= e
        # 3. vec elements per thread along the innermost axis, no tail (a predicate blocks vectorizing)
        if inner % self.vec or total % (self.vec * self.threads):
            return None
        fused = sch.fuse(*loops)
        bx, tx, v = sch.split(fused, factors=[None, self.threads, self.vec])
        sch.bind(bx, "blockIdx.x")
        sch.bind(tx, "threadIdx.x")
        sch.vectorize(v)
        return sch


class GatherRowElementwise(GPUScheduleRule):
    """One injective block (after inlining) whose innermost axis spans 4, 8 or 16 bytes of output that no read walks
    contiguously (a gather: the input quantize fused with the layout change to NHWC and the stem's space-to-depth,
    where output byte (dr*2 + ds)*4 + c of a pixel reads x[n, c, 2i + dr, 2j + ds]); else None.

    ``VectorizedElementwise`` would give each thread 4 consecutive output bytes and store them one by one (it cannot
    vectorize the gathered reads, so the loop stays serial); here each thread computes one whole innermost row in
    registers and stores it as one vector (ResNet's input quantize at batch 256 on the H100: 0.080 against 0.110 ms,
    ``scripts/check_glue.py``)."""

    def __init__(self, threads: int = 256):
        self.threads = threads

    def apply(self, func: tirx.PrimFunc, target: Target, _: bool):
        # 1. only GPU element-wise functions that are not already scheduled; one injective block after inlining
        one = _injective_loops(self, func, target)
        if one is None:
            return None
        sch, block, loops, extents = one
        stmt = sch.get(block)
        if len(loops) < 2 or len(stmt.writes) != 1:
            return None
        nbytes = extents[-1] * tvm.DataType(str(stmt.writes[0].source.dtype)).bits // 8
        # 2. a short innermost row (4 / 8 / 16 bytes) that the write walks contiguously and no read does
        c = stmt.iter_vars[-1].var
        w = stmt.writes[0]
        if nbytes not in (4, 8, 16) or not w.region or not w.region[-1].min.same_as(c):
            return None
        if any(r.region and r.region[-1].min.same_as(c) for r in stmt.reads):
            return None
        # 3. a thread per row: its values unrolled into registers, stored as one vector
        _, tx = _bind(sch, sch.fuse(*loops[:-1]), self.threads)
        wb = _local_result(sch, block, tx)
        sch.unroll(sch.get_loops(block)[-1])
        sch.vectorize(sch.get_loops(wb)[-1])
        return sch


class ChannelsLastWindowReduction(GPUScheduleRule):
    """One reduction block (after inlining its producers: padding, casts) whose innermost data-parallel axis is the
    innermost axis of every buffer it reads and writes (channels last) and whose reduction axes are all outer (a
    window over H, W): pools on NHWC. Else None."""

    def __init__(self, threads: int = 256, vec_bytes: int = 16, max_lanes: int = 4, min_threads: int = 32768):
        # (max_lanes: TVM 0.27's CUDA codegen cannot print an 8- or 16-lane 8-bit constant, e.g. the pad value;
        # min_threads: one thread per output vector walks the whole window, so with few outputs -- the average pool at
        # batch 1-8 -- dlight's cross-thread reduction is faster)
        self.threads, self.vec_bytes, self.max_lanes, self.min_threads = threads, vec_bytes, max_lanes, min_threads

    def apply(self, func: tirx.PrimFunc, target: Target, _: bool):
        # 1. only GPU functions that are not already scheduled; one reduction block after inlining
        one = _single_block(self, func, target, "is_reduction")
        if one is None:
            return None
        sch, info = one
        kinds = "".join(i.kind for i in info.iters)
        if not kinds or kinds.rstrip("R") != kinds.replace("R", "") or not kinds.startswith("S"):
            return None  # spatial axes first, then the reduction axes
        block = info.block_rv
        stmt = sch.get(block)
        c = stmt.iter_vars[kinds.count("S") - 1].var  # the innermost data-parallel axis
        # 2. channels last everywhere: every read and the write are indexed by c in their last dimension
        regions = list(stmt.reads) + list(stmt.writes)
        if len(stmt.writes) != 1 or any(not r.region or not r.region[-1].min.same_as(c) for r in regions):
            return None
        loops = sch.get_loops(block)
        extents = [sch.get(l).extent for l in loops]
        if not all(isinstance(e, tirx.IntImm) for e in extents):
            return None
        ns = kinds.count("S")
        # 3. vec channels per thread: loads and the store at most vec_bytes wide, no tail
        nbytes = max(tvm.DataType(str(r.source.dtype)).bits for r in regions) // 8
        vec = min(self.max_lanes, max(1, self.vec_bytes // max(nbytes, 1)))
        while vec > 1 and int(extents[ns - 1]) % vec:
            vec //= 2
        outputs = 1
        for e in extents[:ns]:
            outputs *= int(e)
        if outputs // vec < self.min_threads:
            return None
        spatial, reduce_ = loops[:ns], loops[ns:]
        co, cv = sch.split(spatial[-1], factors=[None, vec])
        bx, tx = _bind(sch, sch.fuse(*spatial[:-1], co), self.threads)
        sch.reorder(bx, tx, *reduce_, cv)
        # 4. accumulate in registers; init, update and the store vectorized over the channels
        wb = _local_result(sch, block, tx)
        #    (the block keeps its init: an update block without one cannot be vectorized)
        sch.vectorize(sch.get_loops(block)[-1])
        sch.vectorize(sch.get_loops(wb)[-1])
        return sch


class Guarded(GPUScheduleRule):
    """One of dlight's own rules, returning None (the next rule's turn) where its analysis asserts on a function it
    does not take: dlight's ``GEMV`` asserts on a reduction whose spatial axes are all of extent 1 -- DenseNet's final
    per-channel affine + global average pool at batch 1 -- where its ``Reduction`` / ``GeneralReduction`` apply."""

    def __init__(self, rule: GPUScheduleRule):
        self.rule = rule

    def is_target_available(self, target: Target) -> bool:
        return self.rule.is_target_available(target)

    def apply(self, func: tirx.PrimFunc, target: Target, tunable: bool):
        try:
            return self.rule.apply(func, target, tunable)
        except AssertionError:
            return None
