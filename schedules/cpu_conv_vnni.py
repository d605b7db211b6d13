"""The CPU integer conv2d kernel on a 4-byte dot-product instruction, the requantize epilogue fused: x86 AVX-512
VNNI (``vpdpbusd`` on zmm, ``cpu_direct_vnni``), x86 AVX-VNNI (``vpdpbusd`` on ymm, ``cpu_direct_avxvnni``) and Arm
dotprod (``sdot`` on 128-bit NEON, ``cpu_direct_sdot``) -- one builder, the instruction a :class:`DotIsa` of
``ISAS``.

Same calling convention and math as :mod:`.cpu_conv` (``x, w, bias, M, S, [res, rq2], out``; the epilogue is
:func:`qcompile.schedules.fallback.epilogue_value`), with two compile-time transforms of the constants
(:func:`prepack`):

* the weights as int8 in groups of 4 input channels, ``lanes`` output channels per vector::

      w8[kb, r, s, c4, 4 j + i] = w[lanes kb + j, r, s, 4 c4 + i]       (0 past K or C)

* the bias with the input flip folded in: ``vpdpbusd`` multiplies *unsigned* bytes by signed bytes, so a signed
  input is read as ``x + 128`` (``x xor 0x80``), the kernel's accumulator is ``acc + 128 sum(w[k])`` and the bias
  it is given is ``bias - 128 sum(w[k])`` (int32, wrapping), so that ``acc' + bias'`` equals ``acc + bias`` exactly
  in int32 arithmetic. ``sdot`` multiplies signed bytes: there an unsigned input is read as ``x - 128`` (the same
  xor) and the bias carries ``+128 sum(w[k])``. An input already in the instruction's domain is read as is and its
  bias is unchanged.

Steps, both parallel on TVM's thread pool:

1. ``xp``: the input as unsigned bytes, padded once -- ``xp[n, hp, wp, c]`` is channel ``c`` at padded position
   ``(hp, wp)`` (``pad_value`` in the halo, 0 past C up to a multiple of 4), xor 0x80 where the input is flipped.
   Four consecutive channels are one int32. An NHWC input without padding whose C is a multiple of 4 (ResNet's 1x1
   convs) skips this step: the conv reads its 4-byte groups in place (xor 0x80808080 where flipped).
2. the conv: each task (batch, output row, block of ``kt x lanes`` output channels; consecutive tasks share the
   channel block where the weights are larger than the input, else the row) walks the row in tiles of ``qt``
   output pixels; a tile keeps ``qt x kt`` int32 accumulator vectors in registers and, for every tap (r, s) and
   channel group c4, broadcasts the pixel's 4 bytes to all lanes and issues ``vpdpbusd(acc, pixel, w8[kb, r, s,
   c4])`` (``lanes`` output channels, 4 products each; ``sdot`` alike). Each byte product fits 16 bits and the
   instruction adds the four products and the accumulator in int32, wrapping (``vpdpbusd``, not the saturating
   ``vpdpbusds``): the accumulators equal the flipped conv's exactly. The epilogue runs on them, ``lanes`` channels at a time, and stores the output bytes:
   NHWC in place (``kt x lanes`` contiguous channels a pixel), NCHW into a row buffer that is stored channel by
   channel (Q contiguous bytes) once the task's row is done.

A row whose length is not a multiple of ``qt`` ends with a tile shifted left onto the previous one (the overlap is
computed twice and stored with the same values); the same for the channel blocks.

Constraints:
    * the build target enables the instruction: AVX-512 VNNI and BW (zmm), AVX-VNNI (ymm) or, on aarch64, dotprod
      (``schedules.cpu_conv.target_kernel`` names the kernel of a target; ``cpu_target`` picks the best x86 target
      for a plain llvm target on the host);
    * 8-bit activation storage (int8 / uint8; 4-bit values one per byte), 8- or 4-bit signed weights (int8 range),
      int8 / uint8 / int32 output, NCHW or NHWC in place (no packed 4-bit operands);
    * ``acc + bias`` of the graph fits int32 (the dispatcher checks it): the fold above is then exact.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import tvm
from tvm import tirx
from tvm.script import tirx as T

from .cpu_conv import CpuKnobs, applies, io_buffers, output_fns, tile_legal
from .spec import ConvSpec

@dataclass(frozen=True)
class DotIsa:
    """One 4-byte dot-product instruction the kernel is built on: ``kernel`` (its name in the build summary), the
    LLVM intrinsic, ``lanes`` int32 accumulators per vector, ``regs`` vector registers, whether it multiplies
    *unsigned* activation bytes (x86 ``vpdpbusd``: u8 x s8) or signed ones (Arm ``sdot``: s8 x s8), and whether
    LLVM declares its multiplicands as byte vectors (else as int32 vectors)."""

    kernel: str
    intrin: str
    lanes: int
    regs: int
    unsigned_x: bool
    byte_operands: bool


def _llvm_major() -> int:
    return int(tvm.target.codegen.llvm_version_major())


# x86 ``vpdpbusd`` declares byte-vector multiplicands from LLVM 22 on (int32 vectors before); Arm ``sdot`` always has
ISAS = {isa.kernel: isa for isa in (
    DotIsa("cpu_direct_vnni", "llvm.x86.avx512.vpdpbusd.512", 16, 32, True, _llvm_major() >= 22),
    DotIsa("cpu_direct_avxvnni", "llvm.x86.avx512.vpdpbusd.256", 8, 16, True, _llvm_major() >= 22),
    DotIsa("cpu_direct_sdot", "llvm.aarch64.neon.sdot.v4i32.v16i8", 4, 32, False, True),
)}


@dataclass(frozen=True)
class VnniTile:
    """Register tile of the kernel on ``isa`` (a key of ``ISAS``): ``qt`` output pixels x ``kt`` channel vectors of
    accumulators (``qt * kt`` registers, plus ``kt`` weight vectors and a broadcast: at most the ISA's registers)."""

    isa: str = "cpu_direct_vnni"
    qt: int = 14
    kt: int = 2

    def __post_init__(self):
        if self.isa not in ISAS:
            raise ValueError(f"cpu dot-product kernel: unknown instruction set {self.isa!r}")
        why = "tile sizes are at least 1" if self.qt < 1 or self.kt < 1 else tile_legal(
            self.isa, CpuKnobs(self.qt, self.kt))
        if why is not None:
            raise ValueError(f"cpu dot-product kernel: {why}")

    @property
    def lanes(self) -> int:
        return ISAS[self.isa].lanes


DEFAULT_TILE = VnniTile()


def choose_tile(spec: ConvSpec, isa: str = "cpu_direct_vnni", weight_regs: int = 1) -> VnniTile:
    """The tile for ``spec``: among the tiles whose accumulators, ``kt`` weight vectors and a broadcast fit the
    registers, the fastest by a simple count -- tiles in a row times channel blocks (a row's last tile and the last
    channel block overlap the ones before them), each step of a tile costing ``max(qt kt, qt + kt, 12)``: its
    dot-product instructions, or its loads (a broadcast a pixel, a vector a channel block), or the 12 independent
    accumulators the instruction's latency needs; ties go to more accumulators. ResNet: 14 x 2 for rows of 56, 28
    and 14, 7 x 2 for rows of 7. ``weight_regs``: registers a channel vector's weights take (2 where they are
    unpacked from a packed vector, ``cpu_conv_vnni_s4``, which also keeps its mask in one more)."""
    lanes, regs = ISAS[isa].lanes, ISAS[isa].regs
    kb = -(-spec.K // lanes)

    def cost(t):
        qt, kt = t
        return -(-spec.Q // qt) * -(-kb // kt) * max(qt * kt, qt + kt, 12), -qt * kt

    tiles = [(qt, kt) for kt in range(1, min(kb, 8) + 1) for qt in range(1, min(spec.Q, 28) + 1)
             if qt * kt + weight_regs * kt + weight_regs <= regs]
    qt, kt = min(tiles, key=cost)
    return VnniTile(isa, qt, kt)


def flips_input(spec: ConvSpec, isa: str) -> bool:
    """Whether the kernel reads the input xor 0x80: a signed input for an unsigned-activation instruction, and the
    reverse."""
    return (ConvSpec.storage(spec.x_dtype) == "int8") == ISAS[isa].unsigned_x


def prepack(spec: ConvSpec, w: np.ndarray, bias: np.ndarray, isa: str = "cpu_direct_vnni",
            flip: Optional[bool] = None):
    """Logical weights [K, R, S, C] and bias [K] -> (int8 [ceil(K/lanes), R, S, ceil(C/4), 4 lanes], int32 bias with
    the input flip folded in: ``-128 sum(w[k])`` for a signed input read as unsigned, ``+128 sum(w[k])`` for an
    unsigned input read as signed). ``flip``: whether the kernel flips the input (None: :func:`flips_input`; False
    for ``cpu_conv_amx``, whose tile products take either sign)."""
    lanes = ISAS[isa].lanes
    K, R, S, C = w.shape
    kb, c4 = -(-K // lanes), -(-C // 4)
    p = np.zeros((kb * lanes, R, S, c4 * 4), np.int8)
    p[:K, :, :, :C] = w
    p = p.reshape(kb, lanes, R, S, c4, 4).transpose(0, 2, 3, 4, 1, 5)
    b = np.asarray(bias, np.int64)
    if flips_input(spec, isa) if flip is None else flip:
        sign = -1 if ConvSpec.storage(spec.x_dtype) == "int8" else 1
        b = b + sign * 128 * np.asarray(w, np.int64).reshape(K, -1).sum(axis=1)
    b = ((b + (1 << 31)) % (1 << 32) - (1 << 31)).astype(np.int32)  # int32, wrapping
    return np.ascontiguousarray(p).reshape(kb, R, S, c4, 4 * lanes), b


def _fill_xp(spec: ConvSpec, nchw: bool, flip: bool):
    """The value (uint8 PrimExpr: the instruction's activation bytes) of ``xp[n, hp, wp, c]`` from ``x``: step 1 of
    the module docstring."""
    pt, pl = spec.pads[0], spec.pads[1]
    H, W, C = spec.H, spec.W, spec.C
    padv = (int(spec.pad_value) ^ 0x80) & 0xFF if flip else int(spec.pad_value) & 0xFF

    def value(x, n, hp, wp, c):
        h, w_ = hp - pt, wp - pl
        inside = tirx.all(h >= 0, h < H, w_ >= 0, w_ < W, c < C)
        hc, wc = tirx.max(tirx.min(h, H - 1), 0), tirx.max(tirx.min(w_, W - 1), 0)
        cc = tirx.min(c, C - 1)
        v = x[n, cc, hc, wc] if nchw else x[n, hc, wc, cc]
        v = tirx.bitwise_and(v.astype("int32"), tirx.const(0xFF, "int32"))
        v = tirx.bitwise_xor(v, tirx.const(0x80, "int32")) if flip else v
        pad = tirx.if_then_else(c < C, tirx.const(padv, "int32"), tirx.const(0, "int32"))
        return tirx.if_then_else(inside, v, pad).astype("uint8")

    return value


def _read_w8(w, kb, r, s, cg, h, vop, lanes):
    """The int8 weights' operand: the stored vector ``w[kb, r, s, cg]`` (one 4-channel group a vector)."""
    return T.reinterpret(vop, w[kb, r, s, cg, T.ramp(0, 1, 4 * lanes)])


@dataclass(frozen=True)
class WeightForm:
    """How the kernel stores and reads its weights: ``groups`` 4-channel groups per stored vector (1: the int8 form
    of :func:`prepack`; 2: two groups as 4-bit nibbles, ``cpu_conv_vnni_s4``); ``read(w, kb, r, s, cg, h, vop,
    lanes)``: the instruction's weight operand of group ``groups cg + h``; the accumulators hold the sums times
    ``2**acc_shift`` (shifted back, arithmetic, before the epilogue); ``strategy``: the kernel's name (None: the
    ISA's)."""

    groups: int = 1
    read: Callable = _read_w8
    acc_shift: int = 0
    strategy: Optional[str] = None


INT8_WEIGHTS = WeightForm()


def make_cpu_conv_vnni(spec: ConvSpec, io_layout: str = "NHWC", tile: VnniTile | None = None,
                       form: WeightForm = INT8_WEIGHTS) -> tvm.tirx.PrimFunc:
    """The kernel for ``spec`` (its NHWC geometry; x, res and out in ``io_layout``, NHWC or NCHW); its weights and
    bias come from :func:`prepack` with ``tile.isa`` (``form``: another weight form's packing, e.g.
    ``cpu_conv_vnni_s4.prepack_s4``). ``tile``: :func:`choose_tile` (zmm VNNI) by default."""
    tile = tile or choose_tile(spec)
    why = applies(spec)
    if why is not None:
        raise ValueError(f"cpu vnni conv kernel: {why}")
    if io_layout not in ("NHWC", "NCHW"):
        raise ValueError(f"cpu vnni conv kernel: layout {io_layout}")
    isa = ISAS[tile.isa]
    L = isa.lanes
    N, H, W, C, K, R, S_ = spec.N, spec.H, spec.W, spec.C, spec.K, spec.R, spec.S
    P, Q = spec.P, spec.Q
    sh, sw = spec.strides
    dh, dw = spec.dilations
    pt, pl, pb, pr = spec.pads
    G = form.groups
    Hp, Wp, CG = H + pt + pb, W + pl + pr, -(-C // (4 * G))  # (CG stored vectors of G 4-channel groups)
    C4 = CG * G
    KB = -(-K // L)
    qt, kt = min(tile.qt, Q), min(tile.kt, KB)
    n_qt, n_kt = -(-Q // qt), -(-KB // kt)
    nchw = io_layout == "NCHW"
    x_shape, o_shape, res_shape, (x_st, o_st, r_st) = io_buffers(spec, nchw)
    whole_k = K % L == 0
    resid = spec.has_residual
    flip = flips_input(spec, tile.isa)
    xfill = _fill_xp(spec, nchw, flip)
    # task order: where the weights outweigh the input (deep layers), consecutive tasks (a thread's share of the
    # range) take the rows of one channel block, so that each thread reads each weight block once; else the channel
    # blocks of one row, so that the row stays in cache
    kb_outer = K * R * S_ * C > N * H * W * C
    # an NHWC input without padding and with whole channel groups is read in place (no step 1)
    direct = not nchw and not any(spec.pads) and C % (4 * G) == 0
    xp_shape = (1, 1, 1, 4) if direct else (N, Hp, Wp, C4 * 4)

    def pixel(x, xp, n, h, w_, c4):  # the 4 input bytes of channel group c4 at padded position (h, w_), as an int32
        if not direct:
            return T.reinterpret("int32", xp[n, h, w_, T.ramp(c4 * 4, 1, 4)])
        v = T.reinterpret("int32", x[n, h, w_, T.ramp(c4 * 4, 1, 4)])
        return tirx.bitwise_xor(v, tirx.const(-0x7F7F7F80, "int32")) if flip else v  # xor 0x80808080

    intrin = isa.intrin
    vi32 = f"int32x{L}"
    vop = f"int8x{4 * L}" if isa.byte_operands else vi32  # the multiplicands' type in LLVM's declaration

    out_index, epi = output_fns(spec, nchw, form.acc_shift)

    # NCHW: a task's outputs (one row, kt * L channels) are staged in ``ob`` [q, channel] and stored channel by
    # channel (Q contiguous bytes) once the row is done; NHWC: stored in place (kt * L contiguous channels a pixel)
    ob_shape = (Q, kt * L) if nchw else (1, 1)

    def store(out, ob, n, p, q, kk, k0, v):
        if nchw:
            return T.buffer_store(ob, v, [q, kk])
        return T.buffer_store(out, v, [n, p, q, k0 + kk])


    @T.prim_func(private=True)
    def kernel(x: T.Buffer(x_shape, x_st), w8: T.Buffer((KB, R, S_, CG, 4 * L), "int8"),
               bias: T.Buffer((K,), "int32"), M: T.Buffer((K,), "int32"), S: T.Buffer((K,), "int32"),
               res: T.Buffer(res_shape, r_st), rq2: T.Buffer((5, K), "int32"), out: T.Buffer(o_shape, o_st)):
        T.func_attr({"tirx.noalias": True})
        xp = T.alloc_buffer(xp_shape, "uint8", scope="local" if direct else "global")
        if not direct and not nchw:
            for nh in T.parallel(N * Hp):
                for wp, c in T.grid(Wp, C4 * 4):
                    xp[nh // Hp, nh % Hp, wp, c] = xfill(x, nh // Hp, nh % Hp, wp, c)
        if nchw:  # (channel outer: the reads run along a row of x)
            for nh in T.parallel(N * Hp):
                for c, wp in T.grid(C4 * 4, Wp):
                    xp[nh // Hp, nh % Hp, wp, c] = xfill(x, nh // Hp, nh % Hp, wp, c)
        for task in T.parallel(N * P * n_kt):
            # (T.meta_var: the index expressions inlined -- a named scalar or vector would be a local allocation,
            # which the parallel body makes a workspace call per task)
            n = T.meta_var(task // (P * n_kt))
            p = T.meta_var(task % P if kb_outer else task // n_kt % P)
            # the last channel block is clamped back onto the one before it when kt does not divide KB: those
            # tasks compute the overlapping blocks again and write the same bytes (a benign duplicate write)
            kb0 = T.meta_var(T.min((task // P % n_kt if kb_outer else task % n_kt) * kt, KB - kt))
            ob = T.alloc_buffer(ob_shape, o_st, scope="local")
            for qi in range(n_qt):
                # (the same for the row's last tile: shifted back onto the previous one, overlap written twice)
                q0 = T.meta_var(T.min(qi * qt, Q - qt))
                acc = T.alloc_buffer((qt * kt * L,), "int32", scope="local")
                for i in T.unroll(qt * kt):
                    acc[T.ramp(i * L, 1, L)] = T.broadcast(T.int32(0), L)
                for r, s, cg in T.grid(R, S_, CG):
                    # pixel-major: one broadcast in a register at a time, the kt weight vectors loaded once (the
                    # compiler merges the repeated loads) and kept in registers; h: the stored vector's groups
                    for h in T.unroll(G):
                        for i in T.unroll(qt):
                            xv = T.meta_var(T.reinterpret(vop, T.broadcast(
                                pixel(x, xp, n, p * sh + r * dh, (q0 + i) * sw + s * dw, cg * G + h), L)))
                            for j in T.unroll(kt):
                                wv = T.meta_var(form.read(w8, kb0 + j, r, s, cg, h, vop, L))
                                acc[T.ramp((i * kt + j) * L, 1, L)] = T.call_llvm_pure_intrin(
                                    vi32, intrin, acc[T.ramp((i * kt + j) * L, 1, L)], xv, wv)
                for i, j in T.grid(qt, kt):
                    if whole_k:
                        for l in T.vectorized(L):
                            store(out, ob, n, p, q0 + i, j * L + l, kb0 * L, epi(
                                acc[(i * kt + j) * L + l], (kb0 + j) * L + l, bias, M, S, res, rq2,
                                n, p, q0 + i))
                    else:
                        for l in range(L):
                            if (kb0 + j) * L + l < K:
                                store(out, ob, n, p, q0 + i, j * L + l, kb0 * L, epi(
                                    acc[(i * kt + j) * L + l], (kb0 + j) * L + l, bias, M, S, res, rq2,
                                    n, p, q0 + i))
            if nchw:  # the row's channels, Q contiguous outputs each
                for kk in range(kt * L):
                    if kb0 * L + kk < K:
                        for q in range(Q):
                            out[n, kb0 * L + kk, p, q] = ob[q, kk]

    f = kernel
    if not resid:  # drop the residual parameters
        f = tvm.tirx.PrimFunc([f.params[i] for i in (0, 1, 2, 3, 4, 7)], f.body, f.ret_type, f.attrs)
    return f.with_attr("qcompile.strategy", form.strategy or isa.kernel)
