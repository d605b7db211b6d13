"""Measure a batch of built conv candidates on a device: a bit-exact check against a NumPy integer reference, then
the time. Needs only NumPy and the TVM runtime (``tvm.runtime``; the runtime-only package that
scripts/make_runtime_bundle.sh packs does): nothing of qcompile's compiler, no ``tvm.relax`` / ``tvm.tirx`` use, no
torch. It is a module of ``qcompile.tune`` (the local and rpc runners import it) and a standalone script that an
offline batch carries beside its kernels::

    python measure.py BATCH [-o results.json] [--device cuda|cpu] [--device-id 0] [--seed N] [--ids ID ...]
                      [--cache-dir DIR]

BATCH is a batch folder holding ``manifest.json`` (``qcompile.tune.build`` writes it) or a manifest file; each
manifest entry names its shared library (``so``, relative to the manifest's folder), its conv (``spec``: ConvSpec's
fields) and the calling convention of its kernels (``funcs`` in launch order, ``split_k`` with its ``workspace``
shape, ``streamk`` = [tile counters, workspace words], the weight format ``w_expand`` / ``w_kperm``; see
schedules/planned.py; a CPU kernel's ``w_cpu``: :func:`cpu_weights`; a grouped conv's kernel's ``w_group``:
:func:`group_weights`, with ``spec.groups`` in the reference).

For each shape, with a seed recorded in the results: fresh random logical inputs (never all zeros) and per-channel
requantize parameters that keep the outputs varied; the reference output from this file's NumPy copy of the project
math (``conv_reference``: ConvSpec's docstring, schedules/reference.py; computed over chunks of the batch in threads,
the next shape's while the GPU measures this one's candidates). For each candidate: the output buffer filled with
random bytes before each of two runs (two poisons drawn per shape, copied on the device; a third run after the
timing: every output byte must be written, every time); split-K and stream-K workspaces poisoned; stream-K's tile
counters zero before and after; the output compared with the reference byte for byte. A difference anywhere is
``mismatch`` with the count, an exception ``run_error``. The inputs stay on the device for the shape's candidates:
a candidate costs its library's load, three runs, three copies of the output back and its timing. Exact candidates are timed with
TVM's ``time_evaluator`` (a C++ loop of launches between two device events: no Python launch cost): per kernel the
median of ``--repeat`` repeats, each of at least ``--min-repeat-ms`` of back-to-back launches; a layer of two kernels
(split-K) is the sum of the two medians.

The results file is rewritten after every candidate (``"complete": false`` until the batch ends), so a batch cut
short still yields the measurements made. ``--cache-dir`` keeps each shape's inputs and reference on disk for the
next batch measured with the same ``--seed`` (the local runner's rounds).

Isolation: the candidates run in a worker process; one that kills it (a crashed CUDA context, a hang past
``--timeout``) is reported ``run_error`` and a new worker measures the rest.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

FORMAT = "qcompile-tune-batch/1"
TIMING = "time_evaluator"  # how ms is measured (see the module docstring)
OK, MISMATCH, RUN_ERROR = "ok", "mismatch", "run_error"  # (the statuses of qcompile.tune.common)

# ---------------------------------------------------------------------------------------------------------------
# the conv description (ConvSpec's fields and the derived sizes the measurement needs; schedules/spec.py)
# ---------------------------------------------------------------------------------------------------------------
_BITS = {"int8": 8, "uint8": 8, "int4": 4, "uint4": 4, "int32": 32}
_SIGNED = {"int8": True, "uint8": False, "int4": True, "uint4": False, "int32": True}
_STORAGE = {"int8": "int8", "int4": "int8", "uint8": "uint8", "uint4": "uint8", "int32": "int32"}
SPEC_DEFAULTS = dict(stride=1, padding=0, dilation=1, layout="NHWC", x_dtype="int8", w_bits=8, out_dtype="int8",
                     has_residual=False, zo=0, lo=-128, hi=127, pad_value=0, res_dtype="int8", zo2=0, lo2=-128,
                     hi2=127, res_i32=False, shift_ge33=False, rq2_uniform=(), groups=1,
                     lut=0, lut_min=0)
SPEC_REQUIRED = ("N", "H", "W", "C", "K", "R", "S")


class Spec:
    """A ConvSpec as plain data (a manifest entry's ``spec``): the same fields, defaults and derived sizes."""

    def __init__(self, d: dict):
        unknown = set(d) - set(SPEC_DEFAULTS) - set(SPEC_REQUIRED)
        missing = [k for k in SPEC_REQUIRED if k not in d]
        if unknown or missing:
            raise ValueError(f"spec: unknown fields {sorted(unknown)}, missing {missing}")
        for k, v in {**SPEC_DEFAULTS, **d}.items():
            setattr(self, k, tuple(v) if isinstance(v, list) else v)

    @property
    def strides(self):
        s = self.stride
        return (s, s) if isinstance(s, int) else tuple(s)

    @property
    def pads(self):
        p = self.padding
        if isinstance(p, int):
            return (p, p, p, p)
        return (p[0], p[1], p[0], p[1]) if len(p) == 2 else tuple(p)

    @property
    def dilations(self):
        d = self.dilation
        return (d, d) if isinstance(d, int) else tuple(d)

    @property
    def P(self):
        pt, _, pb, _ = self.pads
        return (self.H + pt + pb - self.dilations[0] * (self.R - 1) - 1) // self.strides[0] + 1

    @property
    def Q(self):
        _, pl, _, pr = self.pads
        return (self.W + pl + pr - self.dilations[1] * (self.S - 1) - 1) // self.strides[1] + 1

    @property
    def x_bits(self):
        return _BITS[self.x_dtype]

    @property
    def out_bits(self):
        return _BITS[self.out_dtype]

    @property
    def res_bits(self):
        return _BITS[self.res_dtype]

    def shapes(self):
        """Storage shapes of (x, w, out) in the spec's layout (packed for 4-bit)."""
        cx = (self.C * self.x_bits + 7) // 8
        cw = (self.C // self.groups * self.w_bits + 7) // 8  # (grouped: w [K, R, S, C / groups])
        ko = (self.K + 1) // 2 if self.out_bits == 4 else self.K
        if self.layout == "NHWC":
            return (self.N, self.H, self.W, cx), (self.K, self.R, self.S, cw), (self.N, self.P, self.Q, ko)
        return (self.H, self.W, self.N, cx), (self.R, self.S, self.K, cw), (self.P, self.Q, self.N, ko)

    def res_shape(self):
        kr = (self.K + 1) // 2 if self.res_bits == 4 else self.K
        return (self.N, self.P, self.Q, kr) if self.layout == "NHWC" else (self.P, self.Q, self.N, kr)


# ---------------------------------------------------------------------------------------------------------------
# buffer formats (qcompile.int4's nibble order: element 2i in the low nibble; schedules/reference.py)
# ---------------------------------------------------------------------------------------------------------------
def pack4(values) -> np.ndarray:
    """4-bit values two per byte along the last axis (an odd count gets a zero nibble); uint8."""
    v = np.asarray(values).astype(np.int64)
    if v.shape[-1] % 2:
        v = np.concatenate([v, np.zeros(v.shape[:-1] + (1,), np.int64)], axis=-1)
    return np.ascontiguousarray(((v[..., 0::2] & 0xF) | ((v[..., 1::2] & 0xF) << 4)).astype(np.uint8))


def unpack4(buf, signed: bool, count: int | None = None) -> np.ndarray:
    """The inverse of ``pack4``: int64 values, the first ``count`` along the last axis."""
    p = np.asarray(buf).view(np.uint8).astype(np.int64)
    v = np.stack([p & 0xF, p >> 4], axis=-1).reshape(*p.shape[:-1], 2 * p.shape[-1])
    if count is not None:
        v = v[..., :count]
    return v - ((v & 8) << 1) if signed else v


def to_storage(vals, dtype: str) -> np.ndarray:
    """Logical integer values -> the buffer the kernels take (packed for 4-bit)."""
    if dtype in ("int4", "uint4"):
        p = pack4(vals)
        return p.view(np.int8) if dtype == "int4" else p
    return np.ascontiguousarray(np.asarray(vals).astype(dtype))


def from_storage(buf, dtype: str, n: int | None = None) -> np.ndarray:
    """A kernel buffer -> its logical values (int64)."""
    if dtype in ("int4", "uint4"):
        return unpack4(buf, dtype == "int4", n)
    return np.asarray(buf).astype(np.int64)


def value_range(dtype: str):
    return {"int8": (-128, 127), "uint8": (0, 255), "int4": (-8, 7), "uint4": (0, 15),
            "int32": (-(1 << 31), (1 << 31) - 1)}[dtype]


def expand_w4(w, kperm: int = 0) -> np.ndarray:
    """4-bit weights (logical, channels last) -> the int8 buffer of a ``w8`` kernel: per 32 channels the even ones
    then the odd ones, times 16; with ``kperm`` (agl) the reduction first permuted in words of 8 values within each
    K-chunk of 2*kperm values (schedules/reference.py: expand_w4)."""
    w = np.asarray(w).astype(np.int64)
    C = w.shape[-1]
    if C % 32:
        raise ValueError(f"expand_w4: {C} channels, not a multiple of 32")
    if kperm:
        ks, red = kperm // 16, int(np.prod(w.shape[1:]))
        if kperm % 32 or red % (2 * kperm):
            raise ValueError(f"expand_w4: reduction of {red} values is not whole K-chunks of {kperm} packed bytes")
        w = w.reshape(w.shape[0], red // (2 * kperm), 4, ks, 8).swapaxes(2, 3).reshape(w.shape)
    g = w.reshape(w.shape[:-1] + (C // 32, 16, 2)).swapaxes(-1, -2)
    return np.ascontiguousarray((16 * g).reshape(w.shape).astype(np.int8))


def permute_k8(w, kperm: int) -> np.ndarray:
    """8-bit weights (w [K, R, S, C]) -> an ``agl`` kernel's buffer: the reduction permuted in 4-byte words within
    each K-chunk of ``kperm`` bytes, the 16-bit halves of each word swapped (schedules/reference.py: permute_k8)."""
    w = np.asarray(w)
    red = int(np.prod(w.shape[1:]))
    if kperm % 32 or red % kperm:
        raise ValueError(f"permute_k8: reduction of {red} bytes is not whole K-chunks of {kperm} bytes")
    ks = kperm // 32
    p = w.reshape(w.shape[0], red // kperm, 4, ks, 2, 4).transpose(0, 1, 3, 4, 2, 5)[..., [2, 3, 0, 1]]
    return np.ascontiguousarray(p).reshape(w.shape).astype(np.int8)


def weights(spec: Spec, w_log, w_expand: bool = False, w_kperm: int = 0) -> np.ndarray:
    """The weight buffer a planned kernel takes (``PlannedKernel.weights``): packed for 4-bit, expanded to 8 bits
    (``w_expand``), k-permuted (``w_kperm``). ``w_log`` is [K, R, S, C / groups] (NHWC): a ``grouped_gemm`` kernel's
    buffer is its int8 copy."""
    if spec.w_bits == 4 and w_expand:
        return expand_w4(w_log, w_kperm)
    if spec.w_bits == 4:
        return to_storage(w_log, "int4")
    wq = np.asarray(w_log).astype(np.int8)
    return permute_k8(wq, w_kperm) if w_kperm else np.ascontiguousarray(wq)


def group_weights(w_log, kind: str) -> np.ndarray:
    """The weight buffer of a grouped conv's CUDA-core kernel (``w_group`` of its manifest entry) from the logical
    weights [K, R, S, C / groups]: ``depthwise`` -- [R, S, C] int8 (``depthwise.depthwise_weights``); ``grouped`` --
    [R, S, Cg / 4, K, 4] int8 where Cg % 4 == 0, else [R, S, Cg, K, 4] with each value in its word's low byte
    (``grouped.grouped_weights``)."""
    w = np.asarray(w_log).astype(np.int8)
    if kind == "depthwise":
        return np.ascontiguousarray(np.transpose(w[..., 0], (1, 2, 0)))
    if kind != "grouped":
        raise ValueError(f"w_group {kind!r}: depthwise or grouped")
    K, R, S, Cg = w.shape
    if Cg % 4 == 0:
        return np.ascontiguousarray(w.reshape(K, R, S, Cg // 4, 4).transpose(1, 2, 3, 0, 4))
    out = np.zeros((R, S, Cg, K, 4), np.int8)
    out[..., 0] = w.transpose(1, 2, 3, 0)
    return out


def cpu_weights(w_log, bias, w_cpu: dict) -> tuple:
    """(weights, bias) of a CPU kernel (``w_cpu`` of its manifest entry; schedules/cpu_conv.py, cpu_conv_vnni.py):
    ``pack`` "pairs" -- int16 [ceil(K/lanes), R, S, ceil(C/2), 2 lanes], ``w[lanes kb + j, r, s, 2 c2 + i]`` at
    ``[kb, r, s, c2, 2 j + i]`` (``cpu_conv.pack_weights``) -- or "quads" -- int8 [ceil(K/lanes), R, S, ceil(C/4),
    4 lanes] (``cpu_conv_vnni.prepack``), with ``bias_fold`` x sum(w[k]) added to the bias, wrapping in int32 (the
    kernel's input flip); 0 past K and C."""
    w = np.asarray(w_log, np.int64)
    K, R, S, C = w.shape
    lanes, group = int(w_cpu["lanes"]), 2 if w_cpu["pack"] == "pairs" else 4
    kb, cg = -(-K // lanes), -(-C // group)
    p = np.zeros((kb * lanes, R, S, cg * group), np.int64)
    p[:K, :, :, :C] = w
    p = p.reshape(kb, lanes, R, S, cg, group).transpose(0, 2, 3, 4, 1, 5).reshape(kb, R, S, cg, group * lanes)
    b = np.asarray(bias, np.int64) + int(w_cpu.get("bias_fold", 0)) * w.reshape(K, -1).sum(axis=1)
    b = ((b + (1 << 31)) % (1 << 32) - (1 << 31)).astype(np.int32)
    return np.ascontiguousarray(p.astype(np.int16 if group == 2 else np.int8)), b


# ---------------------------------------------------------------------------------------------------------------
# the NumPy integer reference (ConvSpec's math; schedules/reference.py)
# ---------------------------------------------------------------------------------------------------------------
def conv_acc_nhwc(x, w, spec: Spec) -> np.ndarray:
    """int64 accumulator of the conv over logical values x[N,H,W,C], w[K,R,S,C / groups] -> [N,P,Q,K] (output
    channel k of group k // (K / groups) sums that group's C / groups input channels)."""
    sh, sw = spec.strides
    dh, dw = spec.dilations
    pt, pl, pb, pr = spec.pads
    N, H, W, C = x.shape
    xp = np.full((N, H + pt + pb, W + pl + pr, C), spec.pad_value, np.int64)
    xp[:, pt:pt + H, pl:pl + W, :] = x
    P, Q = spec.P, spec.Q
    wt = np.asarray(w).astype(np.int64)
    # float64 BLAS where every partial sum is an integer below 2^53 (then exact, in any order): |x|, |pad| <= 255 and
    # |w| <= 128 give |acc| <= 255 * 128 * R * S * C; else int64
    G = getattr(spec, "groups", 1)
    Cg, Kg = C // G, spec.K // G
    bound = max(int(np.abs(xp).max(initial=0)), 1) * max(int(np.abs(wt).max(initial=0)), 1) * spec.R * spec.S * Cg
    dt = np.float64 if bound < (1 << 53) else np.int64
    acc = np.zeros((N * P * Q, spec.K), dt)
    wd = wt.astype(dt)
    for r in range(spec.R):
        for s in range(spec.S):
            patch = xp[:, r * dh: r * dh + sh * (P - 1) + 1: sh, s * dw: s * dw + sw * (Q - 1) + 1: sw, :]
            pm = patch.reshape(N * P * Q, C).astype(dt)
            if G == 1:
                acc += pm @ wd[:, r, s, :].T
            elif Cg == 1 and Kg == 1:  # (depthwise: one product per channel)
                acc += pm * wd[:, r, s, 0]
            else:  # per group: [G, NPQ, Cg] @ [G, Cg, Kg]
                prod = np.matmul(pm.reshape(-1, G, Cg).transpose(1, 0, 2), wd[:, r, s, :].reshape(G, Kg, Cg)
                                 .transpose(0, 2, 1))
                acc += prod.transpose(1, 0, 2).reshape(N * P * Q, spec.K)
    return acc.astype(np.int64).reshape(N, P, Q, spec.K)


def requant(acc, bias, M, S, spec: Spec, res=None) -> np.ndarray:
    """Accumulators [.., K] -> output logical values: stage 1 (t = acc + bias wrapped to int32; rounded
    t * M >> S; + zo; clipped) and, with ``res`` = (residual values, rq2 [5, K]), the residual stage."""
    t = np.asarray(acc).astype(np.int64) + np.asarray(bias).astype(np.int64)
    t = ((t + (1 << 31)) % (1 << 32)) - (1 << 31)
    v = t * np.asarray(M).astype(np.int64)
    S64 = np.asarray(S).astype(np.int64)
    v = (v + (np.int64(1) << (S64 - 1))) >> S64
    if spec.out_dtype == "int32" and not spec.has_residual:
        return np.clip(v + spec.zo, max(spec.lo, -(1 << 31)), min(spec.hi, (1 << 31) - 1))
    y = np.clip(v + spec.zo, spec.lo, spec.hi)
    if res is None:
        return y
    r, rq2 = res
    c1, M1, c2, M2, S2 = (np.asarray(a, np.int64) for a in np.asarray(rq2))
    v = (y + c1) * M1 + (np.asarray(r, np.int64) + c2) * M2 + (np.int64(1) << (S2 - 1))
    return np.clip((v >> S2) + spec.zo2, spec.lo2, spec.hi2)


def _reference(spec: Spec, x_log, w_log, bias, M, S, res_log, threads: int | None, storage: bool) -> np.ndarray:
    """The layer's output in the spec's layout -- logical int64 values, or (``storage``) the output buffer's bytes --
    computed over chunks of the batch in ``threads`` threads (NumPy releases the GIL in its large operations; the
    images of a batch are independent)."""
    from concurrent.futures import ThreadPoolExecutor

    hwnc = spec.layout == "HWNC"
    tr = (lambda a: np.transpose(a, (2, 0, 1, 3))) if hwnc else (lambda a: a)
    x_n, w_n = tr(x_log), tr(w_log)
    r_n = None if res_log is None else (tr(res_log[0]), res_log[1])
    N = x_n.shape[0]
    shape = spec.shapes()[2] if storage else ((spec.P, spec.Q, N, spec.K) if hwnc else (N, spec.P, spec.Q, spec.K))
    out = np.empty(shape, _STORAGE[spec.out_dtype] if storage else np.int64)
    threads = max(1, min(threads or os.cpu_count() or 1, 32, N))
    cuts = np.linspace(0, N, min(N, 2 * threads) + 1).astype(int)

    def chunk(lo: int, hi: int) -> None:
        rs = None if r_n is None else (r_n[0][lo:hi], r_n[1])
        y = requant(conv_acc_nhwc(x_n[lo:hi], w_n, spec), bias, M, S, spec, rs)
        if storage:
            y = to_storage(y, spec.out_dtype)
        if hwnc:
            out[:, :, lo:hi, :] = np.transpose(y, (1, 2, 0, 3))
        else:
            out[lo:hi] = y

    if threads == 1:
        for lo, hi in zip(cuts[:-1], cuts[1:]):
            chunk(lo, hi)
    else:
        with ThreadPoolExecutor(threads) as ex:
            list(ex.map(chunk, cuts[:-1], cuts[1:]))
    return out


def conv_reference(spec: Spec, x_log, w_log, bias, M, S, res_log=None, threads: int | None = None) -> np.ndarray:
    """The layer's output (logical values, in the spec's layout) from logical inputs in the spec's layout."""
    return _reference(spec, x_log, w_log, bias, M, S, res_log, threads, storage=False)


def reference_storage(spec: Spec, x_log, w_log, bias, M, S, res_log=None, threads: int | None = None) -> np.ndarray:
    """``conv_reference`` as the output buffer holds it (packed for 4-bit): what a kernel's output is compared with,
    byte for byte."""
    return _reference(spec, x_log, w_log, bias, M, S, res_log, threads, storage=True)


def random_problem(spec: Spec, rng: np.random.Generator):
    """Fresh random logical inputs (x, w, bias, M, S, res) and requantize parameters that keep the outputs varied
    (schedules/reference.py: random_problem)."""
    xs = spec.shapes()[0][:-1] + (spec.C,)
    ws = spec.shapes()[1][:-1] + (spec.C // spec.groups,)
    xlo, xhi = value_range(spec.x_dtype)
    wlo, whi = (-8, 7) if spec.w_bits == 4 else (-128, 127)
    x = rng.integers(xlo, xhi + 1, xs)
    w = rng.integers(wlo, whi + 1, ws)
    K = spec.K
    kred = spec.R * spec.S * spec.C // spec.groups
    acc_std = max(1.0, np.sqrt(kred) * (xhi - xlo) / 3.5 * (whi - wlo) / 3.5)
    bias = rng.integers(-int(acc_std) - 1, int(acc_std) + 1, K).astype(np.int32)
    olo, ohi = value_range(spec.out_dtype)
    target = (min(ohi, 1 << 20) - max(olo, -(1 << 20))) / 4
    S = (rng.integers(33, 41, K) if spec.shift_ge33 else rng.integers(20, 31, K)).astype(np.int32)
    M = np.round(target / acc_std * (2.0 ** S.astype(np.float64)) * rng.uniform(0.5, 1.5, K)).astype(np.int64)
    M = (np.clip(M, 1, (1 << 31) - 1) * rng.choice([1, -1], K, p=[0.8, 0.2])).astype(np.int32)
    res = None
    if spec.has_residual:
        os_ = spec.shapes()[2][:-1] + (spec.K,)
        rlo, rhi = value_range(spec.res_dtype)
        r = rng.integers(rlo, rhi + 1, os_)
        span = (spec.hi2 - spec.lo2) / max(1, (spec.hi - spec.lo) + (rhi - rlo))
        S2 = rng.integers(12, 21, K) if spec.res_i32 else rng.integers(16, 31, K)
        M1 = np.round(span * rng.uniform(0.6, 1.4, K) * 2.0 ** S2)
        M2 = np.round(span * rng.uniform(0.6, 1.4, K) * 2.0 ** S2)
        c1 = rng.integers(-3, 4, K)
        c2 = rng.integers(-3, 4, K)
        rq2 = np.stack([c1, np.clip(M1, 1, 2**31 - 1), c2, np.clip(M2, 1, 2**31 - 1), S2]).astype(np.int32)
        if spec.rq2_uniform:
            rq2 = np.repeat(np.asarray(spec.rq2_uniform, np.int32)[:, None], K, axis=1)
        res = (r, rq2)
    return x, w, bias, M, S, res


# ---------------------------------------------------------------------------------------------------------------
# one candidate: inputs, calling convention, check, time
# ---------------------------------------------------------------------------------------------------------------
def poison(shape, dtype, rng) -> np.ndarray:
    """Random bytes of a buffer's size (an output or a scratch buffer must be written before it is read)."""
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    return np.frombuffer(rng.bytes(n), np.uint8).copy().view(dtype).reshape(shape)


def spec_key(entry: dict) -> str:
    return json.dumps(entry["spec"], sort_keys=True)


class Problem:
    """One shape's measurement problem, drawn from ``seed``: the logical weights, the input buffers as stored (x,
    bias, M, S), the residual buffers, the reference output as the output buffer holds it, and how many distinct
    values it has. Shared by every candidate of the shape."""

    NAMES = ("w", "x", "b", "M", "S", "r", "rq2", "ref")

    def __init__(self, spec: Spec, arrays: dict, distinct: int):
        self.spec, self.arrays, self.distinct = spec, arrays, distinct

    @classmethod
    def draw(cls, spec: Spec, seed: int, threads: int | None = None) -> "Problem":
        x, w, b, M, S, res = random_problem(spec, np.random.default_rng(seed))
        ref = reference_storage(spec, x, w, b, M, S, res, threads)
        arrays = dict(w=np.asarray(w).astype(np.int8), x=to_storage(x, spec.x_dtype),
                      b=np.ascontiguousarray(b, np.int32), M=np.ascontiguousarray(M, np.int32),
                      S=np.ascontiguousarray(S, np.int32), ref=ref)
        if res is not None:
            arrays.update(r=to_storage(res[0], spec.res_dtype), rq2=np.ascontiguousarray(res[1], np.int32))
        return cls(spec, arrays, distinct_values(ref, spec.out_dtype))

    @property
    def stored(self) -> list:
        a = self.arrays
        return [a["x"], a["b"], a["M"], a["S"]]

    @property
    def resargs(self) -> list:
        a = self.arrays
        return [a["r"], a["rq2"]] if "r" in a else []

    def save(self, folder: str) -> bool:
        """Write the arrays (.npy) and the distinct count to a new ``folder`` (atomically: a temporary sibling
        renamed). Best effort: a cache that cannot be written (disk full, permissions) leaves nothing behind and
        returns False -- the problem in memory is as good."""
        import shutil
        import tempfile

        tmp = None
        try:
            parent = os.path.dirname(os.path.abspath(folder))
            os.makedirs(parent, exist_ok=True)
            tmp = tempfile.mkdtemp(dir=parent, prefix=".tmp-")
            for k, v in self.arrays.items():
                np.save(os.path.join(tmp, k + ".npy"), v)
            with open(os.path.join(tmp, "meta.json"), "w") as f:
                json.dump(dict(distinct=self.distinct), f)
        except OSError as e:
            if tmp:
                shutil.rmtree(tmp, ignore_errors=True)
            print(f"measure: warning: the problem cache {folder} was not written ({e})", file=sys.stderr, flush=True)
            return False
        try:
            os.rename(tmp, folder)
        except OSError:  # (another process saved it first)
            shutil.rmtree(tmp, ignore_errors=True)
        return True

    @classmethod
    def load(cls, spec: Spec, folder: str) -> "Problem | None":
        try:
            with open(os.path.join(folder, "meta.json")) as f:
                distinct = json.load(f)["distinct"]
            arrays = {k: np.load(os.path.join(folder, k + ".npy")) for k in cls.NAMES
                      if os.path.exists(os.path.join(folder, k + ".npy"))}
        except (OSError, ValueError, KeyError):
            return None
        return cls(spec, arrays, distinct)


def distinct_values(ref: np.ndarray, dtype: str) -> int:
    """Distinct values of a reference output in storage form (int32 outputs: of its first 2^20 values)."""
    u = np.ascontiguousarray(ref).view(np.uint8).ravel()
    if dtype in ("int4", "uint4"):
        return int(np.count_nonzero(np.bincount(u & 0xF, minlength=16) + np.bincount(u >> 4, minlength=16)))
    if _BITS[dtype] == 8:
        return int(np.count_nonzero(np.bincount(u, minlength=256)))
    return int(np.unique(np.ascontiguousarray(ref).ravel()[: 1 << 20]).size)


PROBLEM_VERSION = 1  # (part of a kept problem's cache key: bump it when the inputs' drawing or the reference changes)


class Problems:
    """The problems of the shapes being measured, by (shape, seed): at most ``keep`` in memory (candidates of one
    shape come in a row), drawn in the background ahead of use (``prefetch``), and kept on disk in ``cache_dir``
    where given (a tuner's rounds measure the same shapes again with the same seed: the reference is computed once
    per shape and run)."""

    def __init__(self, cache_dir: str | None = None, keep: int = 3, threads: int | None = None, workers: int = 1):
        import threading
        from concurrent.futures import ThreadPoolExecutor

        self.cache_dir, self.keep, self.threads = cache_dir, max(keep, workers + 2), threads
        self.lock = threading.Lock()
        self.futures: dict = {}
        self.pool = ThreadPoolExecutor(workers)  # (prefetches drawn in parallel: NumPy releases the GIL)

    def _key(self, entry: dict, seed: int):
        return spec_key(entry), seed

    def _make(self, entry: dict, seed: int) -> Problem:
        import hashlib

        spec = Spec(entry["spec"])
        folder = None
        if self.cache_dir:
            h = hashlib.sha1(f"{PROBLEM_VERSION}|{spec_key(entry)}|{seed}".encode()).hexdigest()[:20]
            folder = os.path.join(self.cache_dir, h)
            got = Problem.load(spec, folder) if os.path.isdir(folder) else None
            if got is not None:
                return got
        prob = Problem.draw(spec, seed, self.threads)
        if folder:
            prob.save(folder)
        return prob

    def _future(self, entry: dict, seed: int, background: bool):
        from concurrent.futures import Future

        key = self._key(entry, seed)
        with self.lock:
            fut = self.futures.pop(key, None)
            new = fut is None and not background
            if fut is None:
                if background:
                    fut = self.pool.submit(self._make, entry, seed)
                else:
                    fut = Future()
                    fut.set_running_or_notify_cancel()
            self.futures[key] = fut  # (most recently used last: evicted last)
            while len(self.futures) > self.keep:
                del self.futures[next(iter(self.futures))]
        if new:
            try:
                fut.set_result(self._make(entry, seed))
            except BaseException as e:  # noqa: BLE001  (handed to every waiter)
                fut.set_exception(e)
        return fut

    def get(self, entry: dict, seed: int) -> Problem:
        return self._future(entry, seed, background=False).result()

    def prefetch(self, entry: dict, seed: int) -> None:
        self._future(entry, seed, background=True)


PROBLEMS = Problems()  # (this process's; the worker replaces it with one that has its --cache-dir)


def problem(entry: dict, seed: int, poison_seed: int | None = None, problems: Problems | None = None) -> dict:
    """The NumPy side of one measurement: the kernels' input buffers in calling order (before the residual),
    the residual buffers, the reference output (as the output buffer holds it), the output's storage shape and dtype.
    Inputs come from ``seed`` (one per shape and batch: ``shape_seed``); the poison from ``poison_seed`` (one per
    candidate)."""
    prob = (problems or PROBLEMS).get(entry, seed)
    spec = prob.spec
    xs, b, M, S = prob.stored
    wfmt = (bool(entry.get("w_expand", False)), int(entry.get("w_kperm", 0)))
    if entry.get("w_cpu"):  # (a CPU kernel: its own packing, and a bias with the input flip folded in)
        wfmt = ("cpu", json.dumps(entry["w_cpu"], sort_keys=True))
        w, b = cpu_weights(prob.arrays["w"], b, entry["w_cpu"])
        head = [xs, w, b, M, S]
    elif entry.get("w_group"):  # (a grouped conv's CUDA-core kernel: its own weight layout)
        wfmt = ("group", entry["w_group"])
        head = [xs, group_weights(prob.arrays["w"], entry["w_group"]), b, M, S]
    else:
        head = [xs, weights(spec, prob.arrays["w"].astype(np.int64), *wfmt), b, M, S]
    return dict(spec=spec, head=head, res=prob.resargs, ref=prob.arrays["ref"], distinct=prob.distinct,
                wfmt=wfmt, out_shape=spec.shapes()[2], out_dtype=_STORAGE[spec.out_dtype],
                rng=np.random.default_rng(seed if poison_seed is None else poison_seed))


DEVICE_CHECK = "_device_check"  # a ``shared`` key: (module, partial counts) of the rpc runner's device helpers


class Layer:
    """A candidate's kernels bound to device buffers in its calling convention (schedules/planned.py).

    ``shared``: a dict in which the device buffers of the shape's candidates are kept -- the inputs, the weights of
    each format, two poison buffers per output / workspace shape (drawn once per shape, copied on the device) -- so a
    candidate uploads nothing but its library (the local and offline runners per shape; the rpc runner per shape and
    session). Without it every buffer is uploaded and the poisons are drawn per candidate. Where ``shared`` holds
    the device helpers (``DEVICE_CHECK``: the rpc runner's, tune/device_check.py), the poisons are written and the
    output compared with a device copy of the reference on the device: a check moves partial counts, not the output
    (where they count a difference, the output comes back for the host's count)."""

    def __init__(self, mod, entry: dict, dev, prob: dict, shared: dict | None = None):
        import tvm

        self.tvm, self.dev, self.entry, self.prob = tvm, dev, entry, prob
        self.names = list(entry["funcs"])
        self.funcs = [mod[n] for n in self.names]
        self.mod = mod
        self.shared = shared
        rng = prob["rng"]
        sh = shared if shared is not None else {}
        self.chk, self.parts = sh.get(DEVICE_CHECK, (None, 0))  # (the helpers' module, its partial counts)
        put = lambda a: tvm.runtime.tensor(np.ascontiguousarray(a), dev)

        def buf(name, make):
            if name not in sh:
                sh[name] = put(make())
            return sh[name]

        x, w, b, M, S = prob["head"]
        wfmt = tuple(prob.get("wfmt", ()))
        bkey = ("b",) + wfmt if wfmt[:1] == ("cpu",) else "b"  # (a CPU kernel's bias carries its input flip)
        self.head = [buf("x", lambda: x), buf(("w",) + wfmt, lambda: w), buf(bkey, lambda: b),
                     buf("M", lambda: M), buf("S", lambda: S)]
        self.res = [buf(f"res{i}", lambda a=a: a) for i, a in enumerate(prob["res"])]
        self._poisons = []  # (buffer, shape, dtype)
        self.out = self._poisoned(prob["out_shape"], prob["out_dtype"], buf, rng)
        self.ws = self.cnt = self.skw = None
        if entry.get("split_k", 1) > 1:
            self.ws = self._poisoned(tuple(entry["workspace"]), "int32", buf, rng)
        if entry.get("streamk"):
            counters, words = entry["streamk"]
            self.cnt = put(np.zeros(counters, np.int32))
            self.skw = self._poisoned((words,), "int32", buf, rng)
        self.turn = 0

    def _device_func(self, op: str, dtype: str, rank: int):
        """The device helper ``qc_<op>_<dtype>_<rank>``, or None (no helpers, or none for that buffer)."""
        if self.chk is None:
            return None
        try:
            return self.chk[f"qc_{op}_{dtype}_{rank}"]
        except (AttributeError, KeyError, RuntimeError):
            return None

    def _device_poison(self, t, shape, dtype) -> bool:
        """Fill ``t`` on the device with a hash of a fresh seed; False where there is no helper for it."""
        fill = self._device_func("fill", dtype, len(shape))
        if fill is None:
            return False
        fill(t, int(self.prob["rng"].integers(0, 1 << 31)))
        return True

    def _poisoned(self, shape, dtype, buf, rng):
        """A new device buffer of ``shape`` filled with random bytes (a copy of the shape's first poison, or
        written by the device helper)."""
        shape = tuple(int(v) for v in shape)
        if self.chk is not None:
            t = self.tvm.runtime.empty(shape, dtype, self.dev)
            if self._device_poison(t, shape, dtype):
                self._poisons.append((t, shape, dtype))
                return t
        if self.shared is None:
            t = self.tvm.runtime.tensor(poison(shape, dtype, rng), self.dev)
        else:
            for i in (0, 1):
                buf(("poison", i, shape, dtype), lambda: poison(shape, dtype, rng))
            t = self.tvm.runtime.empty(shape, dtype, self.dev)
            self.shared[("poison", 0, shape, dtype)].copyto(t)
        self._poisons.append((t, shape, dtype))
        return t

    def args(self) -> list:
        """The argument list of each kernel, in launch order."""
        x, w, *rest = self.head  # rest: bias, M, S
        if self.ws is not None:
            return [[x, w, self.ws], [self.ws, *rest, *self.res, self.out]]
        if self.cnt is not None:
            return [[x, w, *rest, *self.res, self.cnt, self.out, self.skw]]
        return [[x, w, *rest, *self.res, self.out]]

    def run(self):
        for f, a in zip(self.funcs, self.args()):
            f(*a)
        self.dev.sync()

    def repoison(self):
        """Poison the output (and the workspaces) again, with other bytes than last time."""
        self.turn += 1
        for t, shape, dtype in self._poisons:
            if self.chk is not None and self._device_poison(t, shape, dtype):
                continue
            if self.shared is None:
                t.copyfrom(poison(shape, dtype, self.prob["rng"]))
            else:
                self.shared[("poison", self.turn % 2, shape, dtype)].copyto(t)

    def mismatches(self) -> int:
        """Output values that differ from the reference (+1 for stream-K counters not left at zero): the output
        buffer compared byte for byte, and where it differs, value for value (a 4-bit output's padding nibble is
        not a value)."""
        spec, ref = self.prob["spec"], self.prob["ref"]
        if self._device_equal(ref):
            return int(bool(self.cnt is not None and self.cnt.numpy().any()))
        got = self.out.numpy()
        if got.shape == ref.shape and np.array_equal(got.view(np.uint8), ref.view(np.uint8)):
            bad = 0
        elif got.shape == ref.shape:
            bad = int((from_storage(got, spec.out_dtype, spec.K) != from_storage(ref, spec.out_dtype, spec.K)).sum())
        else:
            bad = int(np.prod(ref.shape))
        if self.cnt is not None and self.cnt.numpy().any():
            bad += 1
        return bad

    def _device_equal(self, ref: np.ndarray) -> bool:
        """Whether the device helpers find the output equal to the reference (its device copy uploaded once per
        shape); False where they cannot tell (no helpers, another shape or dtype) or count a difference."""
        out = self.out
        if self.chk is None or tuple(out.shape) != ref.shape or str(out.dtype) != str(ref.dtype):
            return False
        count = self._device_func("count", str(ref.dtype), ref.ndim)
        if count is None:
            return False
        sh = self.shared
        if "ref" not in sh:
            sh["ref"] = self.tvm.runtime.tensor(np.ascontiguousarray(ref), self.dev)
        n = self.parts
        if ("parts", n) not in sh:
            sh[("parts", n)] = self.tvm.runtime.empty((n,), "int32", self.dev)
        count(out, sh["ref"], sh[("parts", n)])
        return not sh[("parts", n)].numpy().any()

    def time_ms(self, repeat: int, min_repeat_ms: float) -> list[float]:
        """Per kernel, the median ms of ``repeat`` timed repeats (time_evaluator)."""
        out = []
        for name, a in zip(self.names, self.args()):
            ev = self.mod.time_evaluator(name, self.dev, number=1, repeat=repeat, min_repeat_ms=int(min_repeat_ms))
            out.append(float(ev(*a).median) * 1e3)
        return out


def measure_entry(mod, entry: dict, dev, seed: int, repeat: int = 7, min_repeat_ms: int = 20,
                  poison_seed: int | None = None, problems: Problems | None = None,
                  shared: dict | None = None) -> dict:
    """Check one loaded candidate bit for bit on ``dev`` (two poisoned runs), time it, check it again; a result
    record: status, ms (None unless ok), kernel_ms, detail, seed, distinct (values in the reference output), and
    ``phases``: seconds of this side spent in the layer's set-up (buffers), the two checked runs, the timing and the
    last check."""
    t = [time.perf_counter()]
    prob = problem(entry, seed, poison_seed, problems)
    size = int(np.prod(prob["spec"].shapes()[2][:-1])) * prob["spec"].K
    rec = dict(id=entry["id"], seed=seed, distinct=prob["distinct"], ms=None, kernel_ms=None, detail="", phases={})

    def phase(name):
        t.append(time.perf_counter())
        rec["phases"][name] = round(t[-1] - t[-2], 4)

    layer = Layer(mod, entry, dev, prob, shared)
    phase("setup")
    bad = 0
    for i in range(2):  # two poisons: every output byte is written, each time
        if i:
            layer.repoison()
        layer.run()
        bad += layer.mismatches()
    phase("check")
    if bad:
        return dict(rec, status=MISMATCH, detail=f"{bad} of {2 * size} outputs differ from the reference "
                                                 f"(seed {seed})")
    layer.repoison()
    kms = layer.time_ms(repeat, min_repeat_ms)
    phase("time")
    bad = layer.mismatches()  # (the last timed launch's output)
    phase("recheck")
    if bad:
        return dict(rec, status=MISMATCH, detail=f"{bad} of {size} outputs differ after the timing runs "
                                                 f"(seed {seed})")
    return dict(rec, status=OK, ms=float(sum(kms)), kernel_ms=kms)


# ---------------------------------------------------------------------------------------------------------------
# devices
# ---------------------------------------------------------------------------------------------------------------
def cuda_runtime_library() -> str:
    """Path of TVM's CUDA runtime library (``libtvm_runtime_cuda.so``, beside ``libtvm_runtime.so``)."""
    from tvm import base

    return os.path.join(os.path.dirname(os.path.realpath(base._LOADED_LIBS["tvm_runtime"]._name)),
                        "libtvm_runtime_cuda.so")


def load_cuda_runtime() -> None:
    """Load TVM's CUDA runtime library into this process: runtime-only TVM (``TVM_USE_RUNTIME_LIB=1``, the runtime
    bundle) does not load its backends, so without this no CUDA device and no CUDA kernels (the full TVM loads it
    where ``libcuda.so.1`` loads). An rpc_server takes the same library with ``--load-library``."""
    import ctypes

    from tvm import base

    if "tvm_runtime_cuda" not in base._LOADED_LIBS:
        base._LOADED_LIBS["tvm_runtime_cuda"] = ctypes.CDLL(cuda_runtime_library(), mode=ctypes.RTLD_GLOBAL)


def get_device(kind: str = "cuda", index: int = 0):
    import tvm

    if kind == "cuda":
        load_cuda_runtime()
    dev = tvm.runtime.cuda(index) if kind == "cuda" else tvm.runtime.cpu(index)
    if not dev.exist:
        raise RuntimeError(f"no {kind} device {index} (the TVM runtime found none)")
    return dev


def _smem_optin(index: int) -> int | None:
    """The opt-in shared memory per block (bytes) from the CUDA driver, or None."""
    import ctypes

    try:
        cu = ctypes.CDLL("libcuda.so.1")
        v, d = ctypes.c_int(0), ctypes.c_int(0)
        if cu.cuInit(0) or cu.cuDeviceGet(ctypes.byref(d), index):
            return None
        return v.value if not cu.cuDeviceGetAttribute(ctypes.byref(v), 97, d) else None  # ..._PER_BLOCK_OPTIN
    except (OSError, AttributeError):
        return None


def device_info(dev, kind: str = "cuda", local: bool = True) -> dict:
    """name, arch (sm_XY from the compute capability), sms, smem_per_block: from the device itself."""
    if kind != "cuda":
        import platform

        return dict(name=f"cpu ({platform.machine()})", arch="cpu", sms=os.cpu_count() or 1, smem_per_block=None)
    cv = str(dev.compute_version)
    smem = _smem_optin(dev.index) if local else None
    return dict(name=str(dev.device_name), arch="sm_" + cv.replace(".", ""), sms=int(dev.multi_processor_count),
                smem_per_block=smem or int(dev.max_shared_memory_per_block))


# ---------------------------------------------------------------------------------------------------------------
# a batch: manifest, worker, supervisor
# ---------------------------------------------------------------------------------------------------------------
def read_manifest(batch: str) -> tuple[dict, str]:
    """(manifest, folder its ``so`` paths are relative to) of a batch folder or manifest file."""
    path = os.path.join(batch, "manifest.json") if os.path.isdir(batch) else batch
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{batch}: no manifest.json (a batch folder of qcompile.tune.build, or its manifest)")
    with open(path) as f:
        man = json.load(f)
    if not isinstance(man, dict) or man.get("format") != FORMAT or not isinstance(man.get("candidates"), list):
        raise ValueError(f"{path}: not a qcompile tuning batch manifest (format {FORMAT})")
    return man, os.path.dirname(os.path.abspath(path))


def candidate_seed(base: int, cid: str) -> int:
    """A candidate's seed (its output poison): the batch seed and the candidate's id."""
    import zlib

    return (base * 1000003 + zlib.crc32(cid.encode())) % (1 << 63)


def shape_seed(base: int, entry: dict) -> int:
    """The inputs' seed of a candidate's shape in this batch: the batch seed and the shape (the results file records
    it: a mismatch is reproducible), shared by the batch's candidates of that shape."""
    return candidate_seed(base, spec_key(entry))


AHEAD = 3  # shapes whose problems a GPU worker draws ahead of the one it measures, in parallel


def problem_bytes(entry: dict) -> int:
    """About the most memory drawing ``entry``'s shape's problem takes at once (the padded input, the patch and the
    accumulator in 8-byte form, the reference)."""
    sp = Spec(entry["spec"])
    pt, pl, pb, pr = sp.pads
    npq = sp.N * sp.P * sp.Q
    return 8 * (sp.N * (sp.H + pt + pb) * (sp.W + pl + pr) * sp.C + npq * sp.C + 2 * npq * sp.K)


def available_bytes() -> int | None:
    """This host's available memory (Linux), or None where it cannot tell."""
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def ahead(entries: list, room: int | None) -> list:
    """The first of ``entries`` (the next shapes, at most ``AHEAD``) whose problems fit ``room`` bytes together
    (None: no limit)."""
    out, used = [], 0
    for e in entries[:AHEAD]:
        used += problem_bytes(e)
        if room is not None and used > room:
            break
        out.append(e)
    return out


def worker(args) -> int:
    """Measure the candidates of ``args.ids`` (all without) in this process, one JSON line per event to
    ``args.progress``: {"start": id} before a candidate, then its result record. The candidates of one shape run in a
    row on device buffers they share; the next ``AHEAD`` shapes' problems are drawn in the background meanwhile, in
    parallel, as far as half the available memory holds them (on a GPU; on the CPU the timed kernels would share the
    cores with them: there each problem is drawn when its turn comes).
    Returns 3 after a run_error (the device context may be lost: the supervisor starts a new worker for the rest)."""
    import tvm

    man, root = read_manifest(args.batch)
    todo = set(args.ids) if args.ids else None
    dev = get_device(args.device, args.device_id)
    problems = Problems(args.cache_dir, workers=AHEAD if args.device == "cuda" else 1)
    entries = [e for e in sorted(man["candidates"], key=spec_key) if todo is None or e["id"] in todo]
    firsts = {}  # shape -> its first entry (prefetching)
    for e in entries:
        firsts.setdefault(spec_key(e), e)
    order = list(firsts)
    shared, shared_key = {}, None
    with open(args.progress, "a") as prog:
        def emit(rec):
            prog.write(json.dumps(rec) + "\n")
            prog.flush()

        for entry in entries:
            key = spec_key(entry)
            emit({"start": entry["id"]})
            seed = shape_seed(args.seed, entry)
            if key != shared_key:  # (a new shape: free the last one's buffers; draw the next ones' problems meanwhile)
                shared, shared_key = {}, key
                i = order.index(key)
                # (on a CPU the kernels being timed and a reference drawn meanwhile share the cores: no prefetch)
                if args.device == "cuda":  # (at most half the available memory in drawings ahead)
                    avail = available_bytes()
                    for nxt in ahead([firsts[k] for k in order[i + 1:]], avail // 2 if avail else None):
                        problems.prefetch(nxt, shape_seed(args.seed, nxt))
            try:
                t0 = time.perf_counter()
                mod = tvm.runtime.load_module(os.path.join(root, entry["so"]))
                load = round(time.perf_counter() - t0, 4)
                rec = measure_entry(mod, entry, dev, seed, args.repeat, args.min_repeat_ms,
                                    poison_seed=candidate_seed(args.seed, entry["id"]), problems=problems,
                                    shared=shared)
                rec["phases"] = {"load": load, **rec.get("phases", {})}
            except Exception as e:  # noqa: BLE001  (reported per candidate; the worker ends)
                msg = " ".join(str(e).split())
                emit(dict(id=entry["id"], status=RUN_ERROR, ms=None, seed=seed,
                          detail=f"{type(e).__name__}: {msg[-300:]}"))
                return 3
            emit(rec)
            if rec["status"] != OK:  # (a kernel that wrote outside its output may have spoiled the shared inputs)
                shared = {}
    return 0


def _read_progress(path: str) -> tuple[dict, str | None]:
    """(results by id, the id started and not finished) of a worker's progress file."""
    done, started = {}, None
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                try:
                    r = json.loads(line)
                except ValueError:
                    continue  # (a line cut by the worker's death)
                if "start" in r:
                    started = r["start"]
                else:
                    done[r["id"]] = r
                    started = None if started == r["id"] else started
    return done, started


def supervise(batch: str, ids=None, device: str = "cuda", device_id: int = 0, seed: int | None = None,
              repeat: int = 7, min_repeat_ms: int = 20, timeout: float = 120.0, log=None,
              cache_dir: str | None = None, partial: str | None = None) -> dict:
    """Measure a batch in worker processes (this file, ``--worker``): a candidate that kills its worker or runs
    past ``timeout`` seconds is ``run_error`` and a new worker measures the rest. Returns the results document.
    ``cache_dir``: where the workers keep each shape's problem (inputs and reference) for later batches with the same
    seed. ``partial``: a results file rewritten after every candidate (the results so far: a batch cut short can be
    imported)."""
    import tempfile

    man, _ = read_manifest(batch)
    order = [e["id"] for e in man["candidates"] if not ids or e["id"] in set(ids)]
    seed = int.from_bytes(os.urandom(4), "little") if seed is None else int(seed)
    info = None
    results: dict = {}
    entries = {e["id"]: e for e in man["candidates"]}

    def document(final: bool) -> dict:
        done = [i for i in order if i in results]
        doc = dict(format=FORMAT, device=info, timing=TIMING, seed=seed, repeat=repeat, min_repeat_ms=min_repeat_ms,
                   date=time.strftime("%Y-%m-%d"),
                   results=[dict(results[i], candidate=candidate_info(entries[i])) for i in done])
        if not final:
            doc["complete"] = False
        return doc

    written = [0]

    def keep(i, r):
        results.setdefault(i, r)
        if partial and len(results) != written[0]:
            written[0] = len(results)
            write_json(partial, document(final=False))
    with tempfile.TemporaryDirectory(prefix="qtune-measure-") as td:
        prog = os.path.join(td, "progress.jsonl")
        info_path = os.path.join(td, "device.json")
        rounds = 0
        while len(results) < len(order):
            rounds += 1
            if rounds > len(order) + 2:
                raise RuntimeError("measurement workers keep failing before they measure anything")
            left = [i for i in order if i not in results]
            open(prog, "w").close()
            cmd = [sys.executable, os.path.abspath(__file__), batch, "--worker", "--progress", prog,
                   "--device", device, "--device-id", str(device_id), "--seed", str(seed), "--repeat", str(repeat),
                   "--min-repeat-ms", str(min_repeat_ms), "--device-json", info_path,
                   *(["--cache-dir", cache_dir] if cache_dir else []), "--ids", *left]
            env = dict(os.environ, TVM_USE_RUNTIME_LIB="1")  # (the runtime alone: no compiler library loaded)
            wlog = open(os.path.join(td, f"worker{rounds}.log"), "w+")
            p = subprocess.Popen(cmd, stdout=wlog, stderr=subprocess.STDOUT, text=True, env=env)
            last, seen, why = time.time(), 0, None
            while p.poll() is None:
                time.sleep(0.05)
                if info is None and os.path.exists(info_path):  # (so that a batch cut short names its device)
                    try:
                        with open(info_path) as f:
                            info = json.load(f)
                    except ValueError:
                        pass  # (being written)
                done, started = _read_progress(prog)
                if len(done) + (started is not None) != seen:
                    seen, last = len(done) + (started is not None), time.time()
                    for i in done:
                        if i not in results and log:
                            log(_line(done[i]))
                        keep(i, done[i])
                elif started is not None and time.time() - last > timeout:
                    p.kill()
                    why = f"timed out after {timeout:.0f} s"
                elif started is None and time.time() - last > max(timeout, 600):  # (its start: importing TVM)
                    p.kill()
            wlog.seek(0)
            tail = wlog.read().strip().splitlines()
            wlog.close()
            done, started = _read_progress(prog)
            if info is None and os.path.exists(info_path):
                with open(info_path) as f:
                    info = json.load(f)
            for i, r in done.items():
                if i not in results and log:
                    log(_line(r))
                keep(i, r)
            if started is not None and started not in results:
                detail = why or (f"the measuring process died (exit {p.returncode})"
                                 + (f": {tail[-1][-300:]}" if tail else ""))
                keep(started, dict(id=started, status=RUN_ERROR, ms=None, detail=detail,
                                   seed=candidate_seed(seed, started)))
                if log:
                    log(_line(results[started]))
            elif p.returncode not in (0, 3) and len(results) < len(order):
                if info is None:  # (no device: every candidate alike)
                    msg = tail[-1][-300:] if tail else f"exit {p.returncode}"
                    raise RuntimeError(f"the measuring process failed before the first candidate: {msg}")
    return document(final=True)


def write_json(path: str, doc: dict) -> None:
    """Write ``doc`` to ``path`` atomically (a temporary file renamed)."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, path)


def candidate_info(entry: dict) -> dict:
    """What a results record carries of its candidate: enough to rebuild it (qcompile.tune.runners)."""
    return {k: entry.get(k) for k in ("key", "arch", "target", "spec", "strategy", "label", "knobs", "knobs_type")}


def _line(r: dict) -> str:
    ms = f"{r['ms']:.4f} ms" if r.get("ms") is not None else ""
    return f"{r['status'].upper():<9} {r['id']:<22} {ms} {r.get('detail', '')}".rstrip()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="measure.py", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("batch", help="a batch folder (with manifest.json) or a manifest file")
    ap.add_argument("-o", "--output", help="results file (JSON; default: BATCH/results.json)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="the device (default: cuda)")
    ap.add_argument("--device-id", type=int, default=0, help="which GPU (default: 0)")
    ap.add_argument("--seed", type=int, help="the batch seed (default: random, recorded in the results)")
    ap.add_argument("--ids", nargs="+", help="measure only these candidates")
    ap.add_argument("--repeat", type=int, default=7, help="timed repeats per kernel (default: 7)")
    ap.add_argument("--min-repeat-ms", type=int, default=20, help="launches per repeat: at least this long")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds one candidate may take (default: 120)")
    ap.add_argument("--cache-dir", help="keep each shape's inputs and reference here, for later batches measured with "
                                        "the same --seed (default: none)")
    ap.add_argument("--device-info", action="store_true", help="print the device's name, arch, SMs (JSON) and exit")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--progress", help=argparse.SUPPRESS)
    ap.add_argument("--device-json", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.repeat < 1 or a.min_repeat_ms < 0 or a.timeout <= 0:
        print("measure.py: error: --repeat must be >= 1, --min-repeat-ms >= 0, --timeout > 0", file=sys.stderr)
        return 2
    try:
        if a.device_info or a.worker:
            dev = get_device(a.device, a.device_id)
            info = device_info(dev, a.device)
            if a.device_info:
                print(json.dumps(info))
                return 0
            with open(a.device_json, "w") as f:
                json.dump(info, f)
            return worker(a)
        read_manifest(a.batch)
    except (FileNotFoundError, ValueError, RuntimeError) as e:
        print(f"measure.py: error: {e}", file=sys.stderr)
        return 2
    out = a.output or os.path.join(a.batch if os.path.isdir(a.batch) else os.path.dirname(a.batch), "results.json")
    t0 = time.time()
    try:
        doc = supervise(a.batch, a.ids, a.device, a.device_id, a.seed, a.repeat, a.min_repeat_ms, a.timeout,
                        log=lambda s: print(s, flush=True), cache_dir=a.cache_dir, partial=out)
    except RuntimeError as e:
        print(f"measure.py: error: {e}", file=sys.stderr)
        return 2
    doc["command"] = "python measure.py " + " ".join(sys.argv[1:] if argv is None else argv)
    write_json(out, doc)
    n = {s: sum(r["status"] == s for r in doc["results"]) for s in (OK, MISMATCH, RUN_ERROR)}
    dev = doc["device"] or {}
    print(f"{dev.get('name', '?')}: {n[OK]} ok, {n[MISMATCH]} mismatch, {n[RUN_ERROR]} run_error of "
          f"{len(doc['results'])} in {time.time() - t0:.0f} s -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
