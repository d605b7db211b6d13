"""Tensor-core INT8/INT4 conv2d kernels for qcompile (TIR, TVM 0.27).

Public interface (see docs/SCHEDULES.md):
    conv2d_int_kernel(spec, arch="sm_90", strategy=None, knobs=None, ..., sms=None) -> tvm.tirx.PrimFunc
    conv2d_int_plan(spec, arch="sm_90", strategy=None, knobs=None, ..., sms=None) -> [PrimFunc] (one kernel, or a
                              split-K pair)
    plan_conv(spec, arch="sm_90", strategy=None, knobs=None, ..., sms=None) -> PlannedKernel (the kernels with their
                              calling convention and weight format: schedules/planned.py; what the compiler and tuner
                              use)
    select_strategy(spec, arch) -> "direct_hwnc" | "direct_halo" | "implicit_gemm_t" | "implicit_gemm" | "fallback"
    tuned_knobs(spec, arch, device=None, logs=(), strategy=...) -> knobs | None   (measured best knobs from
                              tuning_logs/<arch>.jsonl and the logs named)
    knobs_for(spec, arch, device=None, logs=(), strategy=...) -> (knobs, source)   (what kernels of every strategy
                              but the fallback get: the GPU's record, the arch's, the layer's record at the nearest
                              batch size, or the strategy's defaults)
    MMA_SHAPES, ConvSpec, GemmKnobs, DEFAULT_KNOBS
    plan_only()  (context manager: within it the builders return placeholder PrimFuncs after their legality checks,
                              so ``plan_conv`` and the dispatcher give every PlannedKernel field but real ``funcs``;
                              the tuner's task extraction: schedules/planned.py)
``sms`` (the device's SM count, where the caller knows it) sizes the automatic K-split, default tiles, pixel tiles
and persistent grids; default the arch table's reference part (``arch_info(arch).sms``).
"""
from __future__ import annotations

import warnings

from .planned import plan_only
from .spec import DEFAULT_KNOBS, MMA_SHAPES, ArchMMA, ConvSpec, GemmKnobs, MMAShape, arch_info, default_knobs
from .tuning import knobs_for, tuned_knobs, tuning_key

STRATEGIES = ("direct_hwnc", "direct_halo", "implicit_gemm_t", "implicit_gemm", "fallback")  # (select_strategy's order)
LUT_STRATEGIES = ("direct_hwnc", "implicit_gemm")  # the strategies whose kernels apply ConvSpec.lut (and split-K's)


# ---- dlight-style rules: each returns a PrimFunc, or None when it does not apply ----------------
def _gemm_planned(spec: ConvSpec, arch: str, knobs, layout: str, allow_split: bool, sms: int | None = None):
    """(GemmPlan, PrimFunc) of the implicit GEMM / direct HWNC kernel, or None where it does not apply. Warpgroup-MMA
    knobs the shape cannot take (an arch without wgmma, channel bytes % 16, a padding value, shared tiles over the
    per-block limit) give the mma.sync kernel with the arch's defaults, which computes the same result (a warning)."""
    from .gemm import NotApplicable, build_kernel, make_plan
    from .gemm.plan import gemm_constraints

    if spec.layout != layout or spec.groups != 1 or gemm_constraints(spec, arch, layout):
        return None  # (grouped convs: ``grouped_gemm.plan_grouped_gemm``)
    try:
        plan = make_plan(spec, arch, knobs, layout, allow_split=allow_split, sms=sms)
    except NotApplicable as e:
        if knobs is None or knobs.mma != "wgmma":
            return None
        warnings.warn(f"qcompile.schedules: wgmma knobs do not apply to {tuning_key(spec)} on {arch} ({e}); "
                      "using the mma.sync kernel with default knobs", stacklevel=4)
        try:
            plan = make_plan(spec, arch, DEFAULT_KNOBS.get(arch, DEFAULT_KNOBS["sm_90"]), layout,
                             allow_split=allow_split, sms=sms)
        except NotApplicable:
            return None
    return plan, build_kernel(plan)


def _gemm_rule(spec: ConvSpec, arch: str, knobs, layout: str, allow_split: bool, sms: int | None = None):
    r = _gemm_planned(spec, arch, knobs, layout, allow_split, sms)
    return r[1] if r else None


def rule_direct_hwnc(spec: ConvSpec, arch: str, knobs=None, allow_split=False, sms=None):
    return _gemm_rule(spec, arch, knobs, "HWNC", allow_split, sms)


def rule_implicit_gemm(spec: ConvSpec, arch: str, knobs=None, allow_split=False, sms=None):
    return _gemm_rule(spec, arch, knobs, "NHWC", allow_split, sms)


def rule_fallback(spec: ConvSpec, arch: str, knobs=None, allow_split=False, sms=None):
    from .fallback import make_fallback

    return make_fallback(spec, "cuda")


def rule_direct_halo(spec: ConvSpec, arch: str, knobs=None, allow_split=False, sms=None):
    """The stem's space-to-depth conv from a shared-memory halo tile (schedules/stem.py); ``knobs`` a HaloKnobs (any
    other knobs -- the implicit GEMM's -- are not this kernel's: its defaults)."""
    from .stem import HaloKnobs, halo_constraints, make_halo_conv

    if halo_constraints(spec, arch):
        return None
    return make_halo_conv(spec, arch, knobs if isinstance(knobs, HaloKnobs) else None, sms)


def rule_implicit_gemm_t(spec: ConvSpec, arch: str, knobs=None, allow_split=False, sms=None):
    """The implicit GEMM with output channels as the MMA's M (schedules/igemm_t.py); ``knobs`` a KtKnobs (any other
    knobs -- the implicit GEMM's -- are not this kernel's: its defaults)."""
    from .igemm_t import KtKnobs, kt_constraints, make_kt_conv

    if kt_constraints(spec, arch):
        return None
    return make_kt_conv(spec, arch, knobs if isinstance(knobs, KtKnobs) else None, sms)


RULES = {"direct_hwnc": rule_direct_hwnc, "implicit_gemm": rule_implicit_gemm, "direct_halo": rule_direct_halo,
         "implicit_gemm_t": rule_implicit_gemm_t, "fallback": rule_fallback}


def select_strategy(spec: ConvSpec, arch: str = "sm_90") -> str:
    """direct HWNC where the shape fits the MMA constraints; on NHWC the direct kernel from a shared-memory halo tile
    where it applies (the RGB stem's space-to-depth conv on sm_90a: ``stem.halo_constraints``), the implicit GEMM
    with output channels as M where its grid fills the GPU better (sm_90a: ``igemm_t.kt_preferred``), else implicit
    GEMM; else fallback. The layout is part of the spec (the caller decides it per layer); this only checks the
    rules."""
    from .igemm import gemm_constraints
    from .igemm_t import kt_preferred
    from .stem import halo_constraints

    if spec.layout == "HWNC" and gemm_constraints(spec, arch, "HWNC") is None:
        return "direct_hwnc"
    if spec.layout == "NHWC" and halo_constraints(spec, arch) is None:
        return "direct_halo"
    if spec.layout == "NHWC" and kt_preferred(spec, arch):
        return "implicit_gemm_t"
    if spec.layout == "NHWC" and gemm_constraints(spec, arch, "NHWC") is None:
        return "implicit_gemm"
    return "fallback"


def _resolve(spec: ConvSpec, arch: str, strategy, knobs, packed_weights: bool, tuning_logs, device,
             sms: int | None = None):
    """(strategy, knobs, source) a conv layer is built with (see ``conv2d_int_kernel``)."""
    if strategy is None:
        strategy = select_strategy(spec, arch)
        if strategy == "implicit_gemm_t" and (isinstance(knobs, GemmKnobs) or packed_weights and spec.w_bits == 4):
            strategy = "implicit_gemm"  # (GemmKnobs are the implicit GEMM's; implicit_gemm_t takes 4-bit weights
            #                              expanded only)
    elif strategy == "implicit_gemm_t" and packed_weights and spec.w_bits == 4:
        raise ValueError("implicit_gemm_t takes 4-bit weights expanded (reference.expand_w4), not packed")
    if strategy not in RULES:
        raise ValueError(f"unknown strategy {strategy!r}; one of {STRATEGIES}")
    source = "user" if knobs is not None else "default"
    if knobs is None and strategy != "fallback":  # (every strategy with knobs has records: tuning.RECORD_STRATEGIES)
        knobs, source = knobs_for(spec, arch, device, tuning_logs, strategy=strategy)
        if source == "default" and isinstance(knobs, GemmKnobs):
            knobs = default_knobs(spec, arch, sms=sms)  # (sized by the device's SMs where given)
        if packed_weights and spec.w_bits == 4 and isinstance(knobs, GemmKnobs):
            from .spec import packed_weight_knobs

            knobs = packed_weight_knobs(knobs)
    return strategy, knobs, source


def _planned(spec: ConvSpec, arch: str, strategy, knobs, allow_split: bool, packed_weights: bool, tuning_logs, device,
             sms: int | None = None):
    """The PlannedKernel of one conv layer: the builders' plans give every field (nothing is read back from the
    PrimFuncs). ValueError where the strategy cannot take the spec."""
    from .planned import PlannedKernel

    strategy, knobs, source = _resolve(spec, arch, strategy, knobs, packed_weights, tuning_logs, device, sms)
    fail = ValueError(f"strategy {strategy} does not apply to {spec} on {arch}")
    if spec.lut and strategy not in LUT_STRATEGIES:
        raise ValueError(f"strategy {strategy} takes no output lookup table (ConvSpec.lut)")
    if strategy in ("implicit_gemm", "direct_hwnc"):
        r = _gemm_planned(spec, arch, knobs, "HWNC" if strategy == "direct_hwnc" else "NHWC", allow_split, sms)
        if r is None:
            raise fail
        p, f = r
        funcs = [f.with_attr("qcompile.knobs_source", source)]
        if p.SPLIT > 1:
            from .splitk import make_splitk_epilogue

            funcs.append(make_splitk_epilogue(spec, p.SPLIT).with_attr("qcompile.split_k", p.SPLIT))
        return PlannedKernel(spec, arch, strategy, p.effective_knobs, source, tuple(funcs), split_k=p.SPLIT,
                             streamk=(p.NTILES, p.SK_WORDS) if p.SK else None, w_expand=bool(p.W8 and p.UNPACK_LD),
                             w_kperm=p.BK if (p.AGL or p.PPK) else 0)
    if strategy == "fallback":
        return PlannedKernel(spec, arch, strategy, None, source,
                             (rule_fallback(spec, arch).with_attr("qcompile.knobs_source", source),))
    if strategy == "direct_halo":
        from .stem import HaloKnobs as KT
        from .stem import resolve_knobs
    else:
        from .igemm_t import KtKnobs as KT
        from .igemm_t import resolve_knobs
    f = RULES[strategy](spec, arch, knobs, sms=sms)
    if f is None:
        raise fail
    kn = resolve_knobs(spec, arch, knobs if isinstance(knobs, KT) else KT(), sms)
    return PlannedKernel(spec, arch, strategy, kn, source, (f.with_attr("qcompile.knobs_source", source),),
                         w_expand=strategy == "implicit_gemm_t" and spec.w_bits == 4)


def conv2d_int_kernel(spec: ConvSpec, arch: str = "sm_90", strategy: str | None = None, knobs=None,
                      allow_split: bool = False, packed_weights: bool = False, tuning_logs=(), device=None,
                      sms: int | None = None):
    """PrimFunc for one quantized conv layer. Params: x, w, bias, M, S, [res], out.
    ``strategy`` forces a rule (ValueError when it cannot take the spec); ``knobs`` a GemmKnobs (with no strategy:
    the implicit GEMM's, where the selector would take implicit_gemm_t), or the HaloKnobs / KtKnobs of those rules. With
    ``knobs=None`` every rule but the fallback uses ``knobs_for(spec, arch, device, tuning_logs, strategy=<its
    strategy>)``: the strategy's measured best knobs for this shape on ``device`` (a GPU name), else on the arch, else
    its record for the same layer at the nearest batch size, else its defaults (the implicit GEMM's:
    ``default_knobs``, sized for ``sms``); ``tuning_logs`` (files or folders) are searched before
    ``tuning_logs/<arch>.jsonl``. The PrimFunc's ``qcompile.knobs_source`` attribute says which ("user" | "device" |
    "arch" | "nearest" | "default"). ``packed_weights`` (4-bit weights kept packed, ``qcompile
    --packed-int4-weights``): ``knobs_for``'s knobs in the form that takes them packed (``packed_weight_knobs``: a
    ``w8`` kernel becomes the register-A kernel that unpacks B itself), the source unchanged. ``sms``: the device's
    SM count (the automatic K-split, default knobs, pixel tiles and persistent grids are sized for it), default the
    arch table's reference part (``arch_info(arch).sms``)."""
    return _planned(spec, arch, strategy, knobs, allow_split, packed_weights, tuning_logs, device, sms).funcs[0]


def conv2d_int_plan(spec: ConvSpec, arch: str = "sm_90", strategy: str | None = None, knobs=None,
                    packed_weights: bool = False, tuning_logs=(), device=None, sms: int | None = None) -> list:
    """The kernels one conv layer runs, in order, as PrimFuncs: ``[conv]`` (params as conv2d_int_kernel), or
    where the output tile grid is too small for the GPU a split-K pair (schedules/splitk.py)
    ``[gemm (x, w, ws int32[split, M, K]), epilogue (ws, bias, M, S, [res, rq2], out)]`` with the same result
    bit for bit. The split comes from the knobs (``split_k``; 0 = automatic). ``packed_weights``, ``tuning_logs``,
    ``device``, ``sms``: as in ``conv2d_int_kernel``."""
    return list(_planned(spec, arch, strategy, knobs, True, packed_weights, tuning_logs, device, sms).funcs)


def plan_conv(spec: ConvSpec, arch: str = "sm_90", strategy: str | None = None, knobs=None,
              packed_weights: bool = False, tuning_logs=(), device=None, sms: int | None = None):
    """The kernels of one conv layer with their calling convention (``planned.PlannedKernel``; ``knobs``: the
    effective knobs the kernels were built with). Arguments as in ``conv2d_int_kernel`` (``strategy`` None:
    ``select_strategy``'s, the implicit GEMM for GemmKnobs where that is implicit_gemm_t); ``sms``: the device's SM count (split-K sizing, automatic tiles, persistent grids),
    default the arch table's reference part (``arch_info(arch).sms``)."""
    return _planned(spec, arch, strategy, knobs, True, packed_weights, tuning_logs, device, sms)


__all__ = ["conv2d_int_kernel", "conv2d_int_plan", "plan_conv", "select_strategy", "MMA_SHAPES", "ConvSpec", "GemmKnobs",
           "MMAShape", "ArchMMA", "DEFAULT_KNOBS", "arch_info", "STRATEGIES", "RULES", "tuned_knobs", "tuning_key",
           "knobs_for", "default_knobs", "plan_only"]
