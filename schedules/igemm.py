"""Tensor-core integer conv2d as a TIR kernel generator (implicit GEMM NHWC and direct HWNC).

Both strategies share one parametrised TIR template (written in TVMScript, all sizes are Python
constants closed over by the script, so every knob specialises the kernel):

  GEMM rows m   = output pixels x batch (NHWC: m = (n, p, q); HWNC direct: m = (p, q, n), so an MMA
                  tile spans 16 batch elements of one output pixel)
  GEMM cols     = output channels k
  GEMM K (bytes)= (r, s, c) with c innermost; the im2col matrix is never materialised: each thread
                  gathers 16-byte channel vectors straight from x into shared memory with cp.async
                  (zero-filled outside the image) or plain loads (pad_value != 0, odd channel counts).

Main loop (``mma="sync"``): ``stages``-deep cp.async ring in dynamic shared memory, ldmatrix.x4 fragments from
padded rows (row pitch BK+16 bytes: conflict-free ldmatrix), mma.sync from the per-arch table.
Main loop (``mma="wgmma"``, sm_90a): the same ring in 128-byte-swizzled K-major atoms, read by
wgmma.mma_async through shared-memory descriptors, one barrier per K-chunk after a
``fence.proxy.async.shared::cta``; 4-bit tiles reach the ring unpacked to 8 bits: loaded packed into registers and
stored unpacked, or through a packed ring (``pstages``), or, with ``w8``, as weights expanded at compile time (see
docs/SCHEDULES.md, "Warpgroup MMA on Hopper" and "4-bit operands on wgmma: the loaders").

INT4: operands stay packed (4-bit) in global and shared memory and in the ldmatrix fragments.
  * native (sm_75/80/86/89): mma .s4/.u4 (m16n8k64, or m8n8k32 on Turing)
  * Hopper (sm_90): each 32-bit fragment word (8 nibbles) becomes two s8 words with one AND and one
    SHL+AND: ``hi = w & 0xF0F0F0F0`` holds the odd elements as 16*v, ``lo = (w << 4) & 0xF0F0F0F0`` the
    even ones. A and B are split the same way, so every k slot still pairs matching elements; the
    int32 accumulator holds 256 * sum (exact, |256 * 15 * 8 * Kred| < 2^31 for Kred < 69905) and the
    epilogue shifts it back (arithmetic >> 8). Unsigned 4-bit activations use .u8.

Epilogue (fused, per warp): accumulators -> padded shared tile (16 x warp-N int32 at a time) ->
each lane takes ``ev`` consecutive channels of a row: + bias, int64 fixed-point requant, zero point,
clip, optionally the second (residual-add) requantize stage of ConvSpec, cast/pack -> one vector
store per lane, rows written contiguously (coalesced), every output element written exactly once.
"""
from __future__ import annotations

from .gemm.helpers import requant_stage1
from .gemm.kernel import build_kernel
from .gemm.plan import (GemmPlan, NotApplicable, _adapt_knobs, _pick_ev, _pick_vec, gemm_constraints, make_plan,
                        split_factor, staging_pitch)
from .spec import ConvSpec, GemmKnobs

__all__ = ["GemmPlan", "NotApplicable", "_adapt_knobs", "_pick_ev", "_pick_vec", "gemm_constraints", "make_plan",
           "split_factor", "staging_pitch", "requant_stage1", "make_gemm_conv", "streamk_args", "w8_weights", "w8_kperm"]


def make_gemm_conv(spec: ConvSpec, arch: str = "sm_90", knobs: GemmKnobs | None = None,
                   layout: str | None = None, adapt: bool = True, allow_split: bool = False, sms: int | None = None):
    """Build the tensor-core PrimFunc. ``layout`` "NHWC" = implicit GEMM, "HWNC" = direct.

    With ``allow_split`` and a split factor > 1 (``split_factor``) it is the first kernel of a split-K pair
    (params x, w, ws int32[split, M, K]; attribute ``qcompile.split_k``), see schedules/splitk.py. ``sms``: the
    device's SM count (default: the arch table's). Raises ``NotApplicable`` where the plan (``gemm.plan.make_plan``)
    does, before any TIR is built."""
    return build_kernel(make_plan(spec, arch, knobs, layout, adapt, allow_split, sms))



def streamk_args(func):
    """[tiles, workspace words] of a stream-K kernel (``GemmKnobs.sk``), else None. Its parameters are the plain
    kernel's with ``skc`` int32[tiles] before ``out`` (zeros on entry; the kernel leaves them zero) and ``skw``
    int32[workspace words] after it (scratch: a second output to Relax)."""
    a = func.attrs
    return [int(v) for v in a["qcompile.streamk"]] if a is not None and "qcompile.streamk" in a else None


def w8_weights(func) -> bool:
    """Whether kernel ``func`` takes its 4-bit weights expanded (``GemmKnobs.w8``: pass
    ``reference.expand_w4(w)``, int8 [..., C], instead of the packed int8 [..., C/2])."""
    a = func.attrs
    return a is not None and "qcompile.w8" in a


def w8_kperm(func) -> int:
    """The K-chunk (bytes of the operand in memory) whose k permutation kernel ``func``'s weights take
    (``GemmKnobs.agl``: pass ``reference.expand_w4(w, kperm)`` for 4-bit weights, ``reference.permute_k8(w, kperm)``
    for 8-bit ones), else 0."""
    a = func.attrs
    return int(a["qcompile.w8_kperm"]) if a is not None and "qcompile.w8_kperm" in a else 0
