"""Grouped conv2d (NHWC, 1 < groups) on tensor cores, ``grouped_gemm``: the implicit GEMM (schedules/gemm/) with each
N tile inside one group; and ``grouped_kernel``, which decides between it and the CUDA-core ``grouped`` kernel.

With Cg = C / groups input and Kg = K / groups output channels per group, output channel k of group g = k // Kg
reduces over (r, s, c < Cg) of input channels g*Cg + c only (``grouped.py`` gives the formula). The implicit GEMM
runs it as the dense kernel of a Cg-channel conv with three differences (``GemmPlan.GROUPS`` > 1):

1. the reduction is R x S x Cg (``gemm.plan.red_channels``): K-chunks, vectors and the zero-filled tail of a
   Cg-channel conv;
2. the A loader reads input pixels of C channels (``GemmPlan.XCB`` bytes) from channel (n0 // Kg) * Cg on, n0 the
   tile's first output channel (``helpers.group_at``): every N tile lies inside one group (Kg a multiple of BN);
3. the weights are the layer's logical OHWI weights [K, R, S, Cg], int8 (the B loader's rows of a Cg-channel conv).

The epilogue (requantize, residual stage, output table, packed 4-bit outputs) and the main loops are the dense
kernel's, unchanged.

Constraints:
    * NHWC; groups divides C and K; not depthwise (groups == C == K runs on ``depthwise``).
    * 8-bit operands: activations int8 / uint8 (4-bit values one per byte); weights one value per byte
      (``gemm_spec``: 4-bit weight values are given to it as int8).
    * Kg a multiple of 32 and of the N tile BN after adaptation (``adapt_knobs`` halves BN down to Kg).
    * Cg a multiple of 4 (4-, 8- or 16-byte channel vectors inside one group); wgmma (sm_90a): Cg % 16 == 0, zero
      padding, Kg a multiple of 64.
    * mma.sync, or the plain wgmma loop: no split-K, persistent / stream-K / ping-pong grids or register-A loaders
      (``gemm.plan._group_legal``).

``grouped_gemm_plan`` is THE legality (``make_plan`` with the group rules), used by ``make_grouped_gemm`` and the
tuning space (``schedules.space.SPACES["grouped_gemm"]``) alike.
"""
from __future__ import annotations

import os

from .spec import DEFAULT_KNOBS, ConvSpec, GemmKnobs, default_knobs

STRATEGY = "grouped_gemm"
ENV = "QCOMPILE_GROUPED_GEMM"  # "0": the CUDA-core ``grouped`` kernel; "1": ``grouped_gemm`` where legal; "auto"
#                                (unset): ``grouped_gemm`` where legal unless the layer's own records favour ``grouped``
ENV_VALUES = ("0", "1", "auto")


def gemm_spec(spec: ConvSpec) -> ConvSpec:
    """``spec`` as the tensor-core kernel takes it: 4-bit weight values one per byte (``w_bits`` 8) beside 8-bit
    activation storage (a grouped layer's 4-bit activations are read one value per byte)."""
    return spec.replace(w_bits=8) if spec.w_bits == 4 and spec.x_bits == 8 else spec


def grouped_gemm_constraints(spec: ConvSpec, arch: str) -> str | None:
    """Why ``grouped_gemm`` cannot take ``spec`` on ``arch`` at any knobs (None: some knobs may)."""
    from .gemm.plan import gemm_constraints

    if not arch.startswith("sm_"):
        return f"grouped_gemm runs on the CUDA archs (sm_XX), not {arch}"
    if spec.groups <= 1:
        return f"grouped_gemm takes grouped convs (groups > 1), not groups {spec.groups}"
    if spec.groups == spec.C == spec.K:
        return "grouped_gemm: groups == C == K runs on the depthwise kernel"
    return gemm_constraints(spec, arch, "NHWC")


def grouped_gemm_plan(spec: ConvSpec, arch: str = "sm_90", knobs: GemmKnobs | None = None, sms: int | None = None):
    """THE legality and plan of the kernel: the implicit GEMM's ``make_plan`` (adapted knobs, no split-K) of the
    grouped ``spec`` with ``knobs`` (None: ``default_grouped_knobs``); raises ``gemm.plan.NotApplicable``."""
    from .gemm.plan import NotApplicable, make_plan

    why = grouped_gemm_constraints(spec, arch)
    if why:
        raise NotApplicable(why)
    kn = knobs if knobs is not None else default_grouped_knobs(spec, arch, sms)
    if not isinstance(kn, GemmKnobs):
        raise NotApplicable(f"grouped_gemm takes GemmKnobs, not {type(kn).__name__}")
    return make_plan(spec, arch, kn, "NHWC", adapt=True, allow_split=False, sms=sms)


def grouped_gemm_point(spec: ConvSpec, arch: str, knobs: GemmKnobs, sms: int | None = None):
    """(the effective knobs, None) where ``grouped_gemm_plan`` takes the point, else (``knobs``, why not)."""
    from .gemm.plan import NotApplicable

    try:
        return grouped_gemm_plan(spec, arch, knobs, sms).effective_knobs, None
    except NotApplicable as e:
        return knobs, str(e)


# Untuned grouped layers: the first of these the layer takes (after ``spec.default_knobs``'s wgmma tile where Kg
# allows it): 128 x 64 tiles of four 32 x 64 warp tiles (BN halves down to Kg), then smaller rows.
GROUPED_DEFAULT_KNOBS = (GemmKnobs(BM=128, BN=64, BK=64, WM=4, WN=1, stages=4),
                         GemmKnobs(BM=64, BN=32, BK=64, WM=2, WN=1, stages=3))


def default_grouped_knobs(spec: ConvSpec, arch: str, sms: int | None = None) -> GemmKnobs:
    """The knobs of an untuned grouped layer: the arch's wgmma default tile (``spec.default_knobs``) where the layer
    takes it, else the first of ``GROUPED_DEFAULT_KNOBS`` and the arch's mma.sync default it takes (the first of
    the list where none does: ``grouped_gemm_plan`` then says why)."""
    from .gemm.plan import NotApplicable, make_plan

    wg = default_knobs(spec, arch, sms)
    cands = ([wg] if wg.mma == "wgmma" else []) + [*GROUPED_DEFAULT_KNOBS, DEFAULT_KNOBS.get(arch, DEFAULT_KNOBS["sm_90"])]
    for kn in cands:
        try:
            make_plan(spec, arch, kn, "NHWC", adapt=True, allow_split=False, sms=sms)
            return kn
        except NotApplicable:
            continue
    return GROUPED_DEFAULT_KNOBS[0]


def make_grouped_gemm(spec: ConvSpec, arch: str = "sm_90", knobs: GemmKnobs | None = None, sms: int | None = None):
    """PrimFunc ``(x [N, H, W, C], w [K, R, S, Cg] int8, bias, M, S [K] int32, [res, rq2 [5, K]], [lut], out)``;
    ``gemm.plan.NotApplicable`` where ``grouped_gemm_plan`` says no."""
    from .gemm.kernel import build_kernel

    return build_kernel(grouped_gemm_plan(spec, arch, knobs, sms))


def plan_grouped_gemm(spec: ConvSpec, arch: str = "sm_90", knobs: GemmKnobs | None = None, sms: int | None = None,
                      source: str = "default"):
    """The PlannedKernel of the grouped layer ``spec`` on ``grouped_gemm`` (``knobs`` None: the default tile;
    ``source``: where the knobs came from). Its ``weights(w)`` are the OHWI int8 weights [K, R, S, Cg]."""
    from .planned import PlannedKernel
    from .gemm.kernel import build_kernel

    p = grouped_gemm_plan(spec, arch, knobs, sms)
    f = build_kernel(p).with_attr("qcompile.knobs_source", source)
    return PlannedKernel(spec, arch, STRATEGY, p.effective_knobs, source, (f,))


_ENV_SPELLINGS = {"0": "0", "off": "0", "false": "0", "no": "0", "1": "1", "on": "1", "true": "1", "yes": "1",
                  "auto": "auto"}


def env_mode() -> str:
    """``QCOMPILE_GROUPED_GEMM`` as "0", "1" or "auto" (unset: "auto"; also off/false/no, on/true/yes); a
    QCompileError naming the variable for another value."""
    from qcompile.errors import QCompileError

    v = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if v not in _ENV_SPELLINGS:
        raise QCompileError(f"{ENV}={v!r}: expected 0, 1 or auto (or off / on)")
    return _ENV_SPELLINGS[v]


def _record_ms(spec: ConvSpec, arch: str, logs, strategy: str) -> dict:
    """Per GPU, the best time (ms) of ``strategy``'s own OK records of the layer (``tuning._lookup_keys``) on
    ``arch``; ``inf`` for a record without a time."""
    from .tuning import _lookup_keys, log_files, read_log

    keys = set(_lookup_keys(spec))
    best: dict[str, float] = {}
    for path in log_files(arch, tuple(logs or ())):
        for r in read_log(path):
            if r.arch == arch and r.ok and r.strategy == strategy and r.key in keys:
                ms = r.ms if r.ms is not None else float("inf")
                best[r.device] = min(best.get(r.device, ms), ms)
    return best


def grouped_kernel(spec: ConvSpec, arch: str, device: str | None = None, logs=()) -> str:
    """The kernel a grouped layer (``spec.groups`` > 1) runs on: ``depthwise`` where groups == C == K; else
    ``grouped_gemm`` where it takes the layer (``gemm_spec(spec)``) and ``QCOMPILE_GROUPED_GEMM`` is not "0" -- in
    "auto" mode unless the layer's records of both kernels on one GPU (this device, else another GPU of the arch
    with both) time ``grouped`` faster; else ``grouped``."""
    from .grouped import grouped_strategy

    base = grouped_strategy(spec, spec.groups)
    mode = env_mode()
    if base != "grouped" or mode == "0" or grouped_gemm_constraints(gemm_spec(spec), arch):
        return base
    if mode == "1":
        return STRATEGY
    cc = _record_ms(spec, arch, logs, "grouped")
    tc = _record_ms(gemm_spec(spec), arch, logs, STRATEGY)
    both = [d for d in cc if d in tc]
    gpu = device if device in both else (both[0] if both else None)
    if gpu is not None and cc[gpu] < tc[gpu]:
        return base
    return STRATEGY


__all__ = ["STRATEGY", "ENV", "gemm_spec", "grouped_gemm_constraints", "grouped_gemm_plan", "grouped_gemm_point",
           "default_grouped_knobs", "make_grouped_gemm", "plan_grouped_gemm", "grouped_kernel", "env_mode"]
