"""4-bit values two per byte: the nibble orders, in NumPy (the one statement of them; NumPy only, no TVM).

qcompile's order -- the ONNX INT4 order and what PTX ``.s4`` / ``.u4`` operands expect -- puts element ``2i`` in the
LOW nibble and ``2i + 1`` in the HIGH nibble of byte ``i`` (``first="low"``)::

    packed[i] = (x[2i] & 0xF) | ((x[2i + 1] & 0xF) << 4)
    x[2i]     = sext4(packed[i] & 0xF),  x[2i + 1] = sext4(packed[i] >> 4)      (sext4 only if signed)
    sext4(v)  = v - ((v & 8) << 1)

HAWQ-V3 checkpoints put the FIRST element in the TOP nibble (``first="high"``). The graph pass that packs tensors
inside a model (``qcompile.relay_passes.pack_int4``) builds the same arithmetic as Relax expressions.
"""
from __future__ import annotations

import numpy as np

__all__ = ["pack", "unpack"]

_FIRST = ("low", "high")


def pack(values, axis: int = -1, first: str = "low", pad_odd: bool = False) -> np.ndarray:
    """Pack integer values in [-8, 15] (int4 or uint4) two per byte along ``axis``; returns uint8.

    ``first``: the nibble that takes the first element of each pair. An odd count along ``axis`` is an error unless
    ``pad_odd``, which appends a zero."""
    if first not in _FIRST:
        raise ValueError(f"first must be 'low' or 'high', not {first!r}")
    v = np.moveaxis(np.asarray(values).astype(np.int64), axis, -1)
    if v.shape[-1] % 2:
        if not pad_odd:
            raise ValueError(f"cannot pack an odd count {v.shape[-1]} (pad_odd=True appends a zero)")
        v = np.concatenate([v, np.zeros(v.shape[:-1] + (1,), np.int64)], axis=-1)
    a, b = v[..., 0::2] & 0xF, v[..., 1::2] & 0xF
    p = (a | (b << 4)) if first == "low" else ((a << 4) | b)
    return np.ascontiguousarray(np.moveaxis(p.astype(np.uint8), -1, axis))


def unpack(packed, axis: int = -1, signed: bool = True, first: str = "low", count: int | None = None) -> np.ndarray:
    """Inverse of :func:`pack`: the bytes of ``packed`` (any 8-bit dtype) along ``axis`` -> int8 (``signed``: nibbles
    sign-extended) or uint8 values, twice as many, or the first ``count`` of them."""
    if first not in _FIRST:
        raise ValueError(f"first must be 'low' or 'high', not {first!r}")
    p = np.moveaxis(np.asarray(packed).astype(np.uint8).astype(np.int64), axis, -1)
    lo, hi = p & 0xF, p >> 4
    v = np.stack([lo, hi] if first == "low" else [hi, lo], axis=-1).reshape(*p.shape[:-1], 2 * p.shape[-1])
    if count is not None:
        v = v[..., :count]
    if signed:
        v = v - ((v & 8) << 1)
    return np.ascontiguousarray(np.moveaxis(v.astype(np.int8 if signed else np.uint8), -1, axis))
