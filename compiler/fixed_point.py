"""Fixed-point requantization constants.

A real multiplier ``m`` becomes an integer multiplier and a right shift, ``m ~= M * 2**-S``, with
``|M| < 2**31`` and ``1 <= S <= 62``; the requantize that uses them is

    y = clip(((sum_i int64(t_i) * M_i) + (1 << (S - 1))) >> S) + zp_out, lo, hi)

(arithmetic shift, so the rounding is half toward +infinity). Several terms (a residual add) share
one shift per channel: the largest multiplier keeps 31 bits of precision.
"""
from __future__ import annotations

import numpy as np

MAX_SHIFT = 62


def quantize_multipliers(ms: list[np.ndarray], bits: int = 31) -> tuple[list[np.ndarray], np.ndarray]:
    """Integer multipliers ``M_i`` (int64 arrays) and one shared shift ``S`` for real multipliers ``ms``.

    All arrays broadcast to one shape (per channel or scalar). The largest ``|M_i|`` has ``bits`` bits.
    """
    ms = [np.asarray(m, dtype=np.float64) for m in ms]
    shape = np.broadcast_shapes(*[m.shape for m in ms])
    ms = [np.broadcast_to(m, shape) for m in ms]
    big = np.max(np.abs(np.stack(ms)), axis=0)
    with np.errstate(divide="ignore"):
        _, exp = np.frexp(big)  # big = mant * 2**exp, mant in [0.5, 1)
    shift = np.where(big > 0, bits - exp, MAX_SHIFT).astype(np.int64)
    if np.any(shift < 1):
        raise ValueError(f"requantize multiplier {big.max():g} is too large (>= 2**30)")
    shift = np.minimum(shift, MAX_SHIFT)
    mults = []
    for m in ms:
        M = np.round(m * np.ldexp(1.0, shift)).astype(np.int64)
        # rounding can reach 2**bits exactly; one less keeps it in range
        M = np.clip(M, -(2**bits) + 1, 2**bits - 1)
        mults.append(M)
    return mults, shift


def requantize_reference(ts: list[np.ndarray], Ms: list[np.ndarray], S: np.ndarray, zp: int, lo: int, hi: int):
    """NumPy statement of the requantize math (int64), for documentation and tests."""
    acc = sum(np.asarray(t, np.int64) * M for t, M in zip(ts, Ms))
    v = (acc + (np.int64(1) << (S - 1))) >> S
    return np.clip(v + zp, lo, hi)
