"""Tensor-core INT8/INT4 conv2d kernels for qcompile (TIR, TVM 0.27).

Public interface (see docs/SCHEDULES.md):
    conv2d_int_kernel(spec, arch="sm_90", strategy=None, knobs=None) -> tvm.tirx.PrimFunc
    conv2d_int_plan(spec, arch="sm_90", strategy=None, knobs=None) -> [PrimFunc] (one kernel, or a split-K pair)
    plan_conv(spec, arch="sm_90", strategy=None, knobs=None, ...) -> PlannedKernel (the kernels with their calling
                              convention and weight format: schedules/planned.py; what the compiler and tuner use)
    select_strategy(spec, arch) -> "direct_hwnc" | "direct_halo" | "implicit_gemm_t" | "implicit_gemm" | "fallback"
    tuned_knobs(spec, arch, device=None, logs=()) -> GemmKnobs | None   (measured best knobs from
                                                    tuning_logs/<arch>.jsonl and the logs named)
    knobs_for(spec, arch, device=None, logs=()) -> (GemmKnobs, source)   (what kernels get: the GPU's record, the
                              arch's, the layer's record at the nearest batch size, or default_knobs(spec, arch))
    MMA_SHAPES, ConvSpec, GemmKnobs, DEFAULT_KNOBS
"""
from __future__ import annotations

import warnings

from .spec import DEFAULT_KNOBS, MMA_SHAPES, ArchMMA, ConvSpec, GemmKnobs, MMAShape, arch_info, default_knobs
from .tuning import knobs_for, tuned_knobs, tuning_key

STRATEGIES = ("direct_hwnc", "direct_halo", "implicit_gemm_t", "implicit_gemm", "fallback")  # (select_strategy's order)


# ---- dlight-style rules: each returns a PrimFunc, or None when it does not apply ----------------
def _gemm_rule(spec: ConvSpec, arch: str, knobs, layout: str, allow_split: bool):
    from .igemm import NotApplicable, gemm_constraints, make_gemm_conv

    if spec.layout != layout or gemm_constraints(spec, arch, layout):
        return None
    try:
        return make_gemm_conv(spec, arch, knobs, layout=layout, allow_split=allow_split)
    except NotApplicable as e:
        if knobs is None or knobs.mma != "wgmma":
            return None
        # 1. warpgroup MMA knobs the shape cannot take (arch without wgmma, channel bytes % 16, padding value,
        #    shared tiles over the per-block limit):
        #    the mma.sync kernel with this arch's defaults computes the same result
        warnings.warn(f"qcompile.schedules: wgmma knobs do not apply to {tuning_key(spec)} on {arch} ({e}); "
                      "using the mma.sync kernel with default knobs", stacklevel=3)
        try:
            return make_gemm_conv(spec, arch, DEFAULT_KNOBS.get(arch, DEFAULT_KNOBS["sm_90"]), layout=layout,
                                  allow_split=allow_split)
        except NotApplicable:
            return None


def rule_direct_hwnc(spec: ConvSpec, arch: str, knobs=None, allow_split=False):
    return _gemm_rule(spec, arch, knobs, "HWNC", allow_split)


def rule_implicit_gemm(spec: ConvSpec, arch: str, knobs=None, allow_split=False):
    return _gemm_rule(spec, arch, knobs, "NHWC", allow_split)


def rule_fallback(spec: ConvSpec, arch: str, knobs=None, allow_split=False):
    from .fallback import make_fallback

    return make_fallback(spec, "cuda")


def rule_direct_halo(spec: ConvSpec, arch: str, knobs=None, allow_split=False):
    """The stem's space-to-depth conv from a shared-memory halo tile (schedules/stem.py); ``knobs`` a HaloKnobs (any
    other knobs -- the implicit GEMM's -- are not this kernel's: its defaults)."""
    from .stem import HaloKnobs, halo_constraints, make_halo_conv

    if halo_constraints(spec, arch):
        return None
    return make_halo_conv(spec, arch, knobs if isinstance(knobs, HaloKnobs) else None)


def rule_implicit_gemm_t(spec: ConvSpec, arch: str, knobs=None, allow_split=False):
    """The implicit GEMM with output channels as the MMA's M (schedules/igemm_t.py); ``knobs`` a KtKnobs (any other
    knobs -- the implicit GEMM's -- are not this kernel's: its defaults)."""
    from .igemm_t import KtKnobs, kt_constraints, make_kt_conv

    if kt_constraints(spec, arch):
        return None
    return make_kt_conv(spec, arch, knobs if isinstance(knobs, KtKnobs) else None)


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


def conv2d_int_kernel(spec: ConvSpec, arch: str = "sm_90", strategy: str | None = None, knobs=None,
                      allow_split: bool = False, packed_weights: bool = False, tuning_logs=(), device=None):
    """PrimFunc for one quantized conv layer. Params: x, w, bias, M, S, [res], out.
    ``strategy`` forces a rule (ValueError when it cannot take the spec); ``knobs`` a GemmKnobs (with no strategy:
    the implicit GEMM's, where the selector would take implicit_gemm_t), or the HaloKnobs / KtKnobs of those rules. With
    ``knobs=None`` the tensor-core rules use ``knobs_for(spec, arch, device, tuning_logs)``: the measured best knobs
    for this shape on ``device`` (a GPU name), else on the arch, else its record for the same layer at the nearest
    batch size, else the arch's defaults (``default_knobs``); ``tuning_logs`` (files or folders) are searched before
    ``tuning_logs/<arch>.jsonl``. The PrimFunc's ``qcompile.knobs_source`` attribute says which ("user" | "device" |
    "arch" | "nearest" | "default"). ``packed_weights`` (4-bit weights kept packed, ``qcompile
    --packed-int4-weights``): ``knobs_for``'s knobs in the form that takes them packed (``packed_weight_knobs``: a
    ``w8`` kernel becomes the register-A kernel that unpacks B itself), the source unchanged."""
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
    if knobs is None and strategy not in ("fallback", "direct_halo", "implicit_gemm_t"):
        knobs, source = knobs_for(spec, arch, device, tuning_logs)
        if packed_weights and spec.w_bits == 4:
            from .spec import packed_weight_knobs

            knobs = packed_weight_knobs(knobs)
    f = RULES[strategy](spec, arch, knobs, allow_split=allow_split)
    if f is None:
        raise ValueError(f"strategy {strategy} does not apply to {spec} on {arch}")
    return f.with_attr("qcompile.knobs_source", source)


def conv2d_int_plan(spec: ConvSpec, arch: str = "sm_90", strategy: str | None = None, knobs=None,
                    packed_weights: bool = False, tuning_logs=(), device=None) -> list:
    """The kernels one conv layer runs, in order, as PrimFuncs: ``[conv]`` (params as conv2d_int_kernel), or
    where the output tile grid is too small for the GPU a split-K pair (schedules/splitk.py)
    ``[gemm (x, w, ws int32[split, M, K]), epilogue (ws, bias, M, S, [res, rq2], out)]`` with the same result
    bit for bit. The split comes from the knobs (``split_k``; 0 = automatic). ``packed_weights``, ``tuning_logs``,
    ``device``: as in ``conv2d_int_kernel``."""
    from .splitk import make_splitk_epilogue

    f = conv2d_int_kernel(spec, arch, strategy, knobs, allow_split=True, packed_weights=packed_weights,
                          tuning_logs=tuning_logs, device=device)
    split = int(f.attrs["qcompile.split_k"]) if f.attrs and "qcompile.split_k" in f.attrs else 1
    if split == 1:
        return [f]
    return [f, make_splitk_epilogue(spec, split).with_attr("qcompile.split_k", split)]


def plan_conv(spec: ConvSpec, arch: str = "sm_90", strategy: str | None = None, knobs=None,
              packed_weights: bool = False, tuning_logs=(), device=None):
    """The kernels of one conv layer with their calling convention (``planned.PlannedKernel``). Arguments as in
    ``conv2d_int_kernel``; ``strategy`` None: ``select_strategy``'s."""
    from .igemm import streamk_args, w8_kperm, w8_weights
    from .planned import PlannedKernel

    strategy = strategy or select_strategy(spec, arch)
    funcs = conv2d_int_plan(spec, arch, strategy, knobs, packed_weights=packed_weights, tuning_logs=tuning_logs,
                            device=device)
    a = funcs[0].attrs
    kn = knobs
    if kn is None and strategy in ("implicit_gemm", "direct_hwnc"):
        kn, _ = knobs_for(spec, arch, device, tuning_logs)
    sk = streamk_args(funcs[0])
    return PlannedKernel(spec=spec, arch=arch, strategy=strategy, knobs=kn, source=str(a["qcompile.knobs_source"]),
                         funcs=tuple(funcs), split_k=int(a["qcompile.split_k"]) if "qcompile.split_k" in a else 1,
                         streamk=tuple(sk) if sk else None, w_expand=w8_weights(funcs[0]), w_kperm=w8_kperm(funcs[0]))


__all__ = ["conv2d_int_kernel", "conv2d_int_plan", "plan_conv", "select_strategy", "MMA_SHAPES", "ConvSpec", "GemmKnobs",
           "MMAShape", "ArchMMA", "DEFAULT_KNOBS", "arch_info", "STRATEGIES", "RULES", "tuned_knobs", "tuning_key",
           "knobs_for", "default_knobs"]
