"""The AVX-512 VNNI conv kernel with 4-bit weights packed two per byte (``cpu_direct_vnni_s4``): each stored weight
vector holds two 4-channel groups as nibbles and is unpacked in registers, so a layer reads half the weight bytes of
``cpu_direct_vnni``.

The kernel is :func:`qcompile.schedules.cpu_conv_vnni.make_cpu_conv_vnni` (same steps, tile, input flip and
epilogue) with the weight form :data:`S4_WEIGHTS`:

* packing (:func:`prepack_s4`, compile time): the int8 weights of ``cpu_conv_vnni.prepack`` (``w8[kb, r, s, c4,
  4 lanes]``, values in -8..7), two consecutive channel groups to a byte, the even group in the high nibble::

      w4[kb, r, s, c8, b] = (w8[kb, r, s, 2 c8, b] << 4) | (w8[kb, r, s, 2 c8 + 1, b] & 0xF)   (0 past C)

* unpacking (in registers, per stored vector): the even group is ``v and 0xF0`` (``vpandd``), the odd group
  ``(v << 4) and 0xF0`` (``vpslld`` + ``vpandd``). Each byte then holds ``16 w`` as a signed byte (-128..112):
  ``vpdpbusd`` multiplies it exactly and the accumulators hold ``16 x`` the sums;
* the epilogue shifts the accumulators right by 4 (arithmetic: exact, they are multiples of 16) before
  :func:`qcompile.schedules.fallback.epilogue_value`.

Constraints: those of ``cpu_direct_vnni`` (AVX-512 VNNI and BW; 8-bit activation storage; int8 / uint8 / int32 output),
4-bit weights, and ``16 x`` the accumulator within int32 (:func:`fits`: the dispatcher checks it from the weights and
the input's range).
"""
from __future__ import annotations

import numpy as np
from tvm import tirx
from tvm.script import tirx as T

from .cpu_conv_vnni import ISAS, VnniTile, WeightForm, choose_tile, make_cpu_conv_vnni, prepack
from .spec import ConvSpec

STRATEGY = "cpu_direct_vnni_s4"
ISA = "cpu_direct_vnni"  # the instruction (zmm vpdpbusd) and its tile rules
ACC_SHIFT = 4            # the unpacked weights are 16 w: the accumulators hold 16 x the sums


def _read_s4(w, kb, r, s, cg, h, vop, lanes):
    """Group ``2 cg + h`` of the stored vector ``w[kb, r, s, cg]``: its nibbles moved to the high half of each byte
    (h = 1: ``<< 4`` first) and the low half cleared -- 16 w as signed bytes."""
    v = T.reinterpret(f"int32x{lanes}", w[kb, r, s, cg, T.ramp(0, 1, 4 * lanes)])
    v = tirx.bitwise_and(tirx.shift_left(v, T.broadcast(h * 4, lanes)), T.broadcast(T.int32(-0x0F0F0F10), lanes))
    return v if vop == f"int32x{lanes}" else T.reinterpret(vop, v)  # (0xF0F0F0F0 as int32)


S4_WEIGHTS = WeightForm(groups=2, read=_read_s4, acc_shift=ACC_SHIFT, strategy=STRATEGY)


def applies_s4(spec: ConvSpec) -> str | None:
    """Why the kernel cannot run ``spec`` beyond ``cpu_direct_vnni``'s own rules (None: it can)."""
    return None if spec.w_bits == 4 else f"{spec.w_bits}-bit weights (the kernel packs 4-bit weights)"


# the most output pixels (N P Q) a layer may have for the variant: below, a layer's weights are reused over few
# pixels and their bytes bound its time. ResNet-50 INT4, batch 1, 2-core AMD EPYC with AVX-512 VNNI, sums of per-layer
# minima, packed vs cpu_direct_vnni with 4-bit weights one per byte (docs/bench/cpu_resnet50_int4_s4.json): 7x7
# 1072 vs 1219 us, 14x14 1968 vs 2140 us, 28x28 1380 vs 1444 us; the 56x56 stage (3136 pixels) runs cpu_direct_vnni
# in both builds: the packed kernel is not measured there
REUSE_MAX = 1024


def worth(spec: ConvSpec) -> bool:
    """Whether the variant is the faster kernel for ``spec``: at most ``REUSE_MAX`` output pixels use each weight."""
    return spec.N * spec.P * spec.Q <= REUSE_MAX


def fits(bound: np.ndarray) -> bool:
    """Whether accumulators bounded by ``bound`` (per output channel, the bias included) stay in int32 when
    multiplied by 16."""
    return bool(np.asarray(bound, np.int64).max(initial=0) < 2 ** (31 - ACC_SHIFT))


def prepack_s4(spec: ConvSpec, w: np.ndarray, bias: np.ndarray):
    """Logical 4-bit weights [K, R, S, C] (values -8..7) and bias [K] -> (int8 [ceil(K/16), R, S, ceil(C/8), 64]: two
    channel groups per byte, the even one in the high nibble; the int32 bias of ``cpu_conv_vnni.prepack``, the input
    flip folded in)."""
    w = np.asarray(w)
    if w.size and (w.min() < -8 or w.max() > 7):
        raise ValueError(f"cpu vnni s4 kernel: weights in {w.min()}..{w.max()}, not 4-bit")
    w8, b = prepack(spec, w, bias, ISA)
    kb, r, s, c4, v = w8.shape
    if c4 % 2:  # (an odd group count: a zero group completes the last byte)
        w8 = np.concatenate([w8, np.zeros((kb, r, s, 1, v), np.int8)], axis=3)
    u = w8.view(np.uint8)
    packed = ((u[:, :, :, 0::2] << 4) | (u[:, :, :, 1::2] & 0x0F)).astype(np.uint8)
    return np.ascontiguousarray(packed.view(np.int8)), b


def choose_tile_s4(spec: ConvSpec) -> VnniTile:
    """The tile for ``spec``: ``cpu_conv_vnni.choose_tile`` with two registers per channel vector's weights (the
    packed vector and its unpacked group) and one for the nibble mask -- at most 32 zmm registers; 14 x 2 would
    spill."""
    return choose_tile(spec, ISA, weight_regs=2)


def make_cpu_conv_vnni_s4(spec: ConvSpec, io_layout: str = "NHWC", tile: VnniTile | None = None):
    """The kernel for ``spec`` (x, res and out in ``io_layout``, NHWC or NCHW); weights and bias from
    :func:`prepack_s4`; ``tile``: :func:`choose_tile_s4` by default."""
    why = applies_s4(spec)
    if why is not None:
        raise ValueError(f"cpu vnni s4 kernel: {why}")
    tile = tile or choose_tile_s4(spec)
    if tile.isa != ISA:
        raise ValueError(f"cpu vnni s4 kernel: runs on {ISA}, not {tile.isa}")
    assert ISAS[ISA].unsigned_x  # (the flip and the bias fold are vpdpbusd's)
    return make_cpu_conv_vnni(spec, io_layout, tile, S4_WEIGHTS)
