"""The tuning spaces of the conv kernels: one typed space per strategy, declared beside the kernels.

A ``KernelSpace`` is what a tuner (``qcompile.tune``) needs of a strategy, and what the builder agrees with:

* ``dims``: the knob dimensions and their values (the knobs dataclass's fields; what a record's values must be in);
* ``legal(spec, arch, knobs) -> str | None``: THE legality function -- None where the builder takes the point, else
  why not. It is the builder's own check, made without building TIR: the implicit GEMM's plan
  (``gemm.plan.make_plan``, tens of microseconds), ``igemm_t.kt_legal``, ``stem.halo_legal``;
* ``sample(rng, spec, arch)``: a random legal point. The implicit GEMM's flat space is mostly illegal (its loaders,
  grids and tiles constrain each other), so it is sampled by family (``GEMM_FAMILIES``: mma.sync, wgmma 8-bit and its
  ping-pong / stream-K / persistent / register-A forms, the 4-bit loaders), each drawing only its own dimensions with
  values its structure allows, then checked by ``legal``;
* ``effective(spec, arch, knobs)``: the knobs the builder actually uses for the shape (small problems shrink tiles,
  the automatic K-split resolved, vector widths fitted): two points with equal effective knobs build the same kernel,
  so a tuner measures one of them;
* ``default(spec, arch)``: the arch's default point for the shape (what an untuned layer gets);
* ``configs(spec, arch)``: the start points -- a short table of the tiles and pipelines that won most often where
  layers were tuned (``GEMM_CONFIGS``, like Triton's autotune configs or dlight's ``get_configs``), those legal for
  the shape, one per distinct kernel: a tuner's first round for a task;
* ``features(spec, arch, knobs) -> list[float]`` (``feature_names()`` names them, same length): the shape, the knobs,
  and derived sizes (tiles, waves over the SMs, K-chunks, padding waste, shared memory, threads, the family).

The CPU kernels' space (``cpu_direct``: the register tile, ``cpu_conv.CpuKnobs``) takes the CPU inner kernel
(``cpu_direct_vnni``, ``cpu_direct_avxvnni``, ``cpu_direct_avx2``, ``cpu_direct_sdot``) as its ``arch`` and the
CPU's cores as ``sms``.

The grouped convs' CUDA-core kernels have one space each: ``depthwise`` (groups == C == K; ``depthwise.DwConfig``:
channels ``vec`` x columns ``qt`` per thread, threads per block) and ``grouped`` (the other grouped convs;
``grouped.GroupedConfig``: channels ``kt`` x columns ``qt``, threads); the tensor-core kernel of grouped convs whose
per-group channels allow it has ``grouped_gemm`` (``GemmKnobs``; legality ``grouped_gemm.grouped_gemm_plan``). The
shape's ``ConvSpec.groups`` is the group count; the other spaces take groups == 1 only.

``SPACES`` maps strategy names (``schedules.STRATEGIES``, ``cpu_direct``, ``depthwise``, ``grouped``,
``grouped_gemm``) to spaces; ``spaces_for(spec, arch)`` lists those that apply
to a shape (``applies``). ``sms`` (the device's SM count, where a tuner knows it) overrides the arch table's reference
part (``arch_info(arch).sms``) in ``legal``, ``sample``, ``effective``, ``default`` and the features, as it does in the
builders (``plan_conv(..., sms=)``): split-K sizing, automatic tiles and persistent grids depend on it.

``legal`` is total: for any point of ``dims`` and any ConvSpec it returns None or a reason within milliseconds, and
the builders refuse the points it refuses with the same reason before building any TIR (tests/test_space.py).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from typing import Callable

from .spec import ConvSpec, GemmKnobs, arch_info, default_knobs, tile_grid


def _pick(rng, seq):
    """One element of ``seq`` (``rng``: a numpy Generator or a random.Random)."""
    seq = tuple(seq)
    return seq[int(rng.integers(len(seq)))] if hasattr(rng, "integers") else rng.choice(seq)


@dataclass(frozen=True)
class KernelSpace:
    strategy: str
    knobs_type: type
    dims: dict  # field -> tuple of values
    applies: Callable  # (spec, arch) -> str | None: why the strategy cannot take the shape at all
    legal_fn: Callable  # (spec, arch, knobs[, sms]) -> str | None (called after ``applies``; sms passed where given)
    default_fn: Callable  # (spec, arch, sms) -> knobs
    effective_fn: Callable = None  # (spec, arch, knobs, sms) -> knobs; None: the knobs themselves
    features_fn: Callable = None  # (spec, arch, knobs, sms) -> list[float] (strategy part; see ``features``)
    draw_fn: Callable = None  # (rng, spec, arch) -> knobs candidate; None: uniform over ``dims``
    derived_names: tuple = ()  # names of ``features_fn``'s values
    configs_fn: Callable = None  # (spec, arch) -> knobs candidates to start from (``configs`` keeps the legal ones)
    per_group: bool = False  # the shape features' reduction is one group's, R x S x C / groups (``shape_features``)

    def legal(self, spec: ConvSpec, arch: str, knobs, sms: int | None = None) -> str | None:
        if not isinstance(knobs, self.knobs_type):
            return f"{self.strategy} takes {self.knobs_type.__name__}, not {type(knobs).__name__}"
        why = self.applies(spec, arch)
        if why:
            return why
        return self.legal_fn(spec, arch, knobs) if sms is None else self.legal_fn(spec, arch, knobs, sms)

    def effective(self, spec: ConvSpec, arch: str, knobs, sms: int | None = None):
        return self.effective_fn(spec, arch, knobs, sms) if self.effective_fn else knobs

    def default(self, spec: ConvSpec, arch: str, sms: int | None = None):
        return self.default_fn(spec, arch, sms)

    def configs(self, spec: ConvSpec, arch: str, sms: int | None = None) -> list:
        """The start points legal for the shape, in table order, one per distinct kernel (``effective``)."""
        out, seen = [], set()
        for kn in self.configs_fn(spec, arch) if self.configs_fn else ():
            try:
                if self.legal(spec, arch, kn, sms) is not None:
                    continue
                eff = self.effective(spec, arch, kn, sms)
            except Exception:  # noqa: BLE001  (a table entry the legality cannot judge for the shape: skipped)
                continue
            if eff not in seen:
                seen.add(eff)
                out.append(kn)
        return out

    def draw(self, rng, spec: ConvSpec, arch: str):
        """One candidate point, legal or not (``sample`` keeps the legal ones)."""
        if self.draw_fn is not None:
            return self.draw_fn(rng, spec, arch)
        return self.knobs_type(**{k: _pick(rng, v) for k, v in self.dims.items()})

    def sample(self, rng, spec: ConvSpec, arch: str, tries: int = 2000, sms: int | None = None, **fixed):
        """A random legal point (``rng``: random.Random or numpy Generator), or None after ``tries`` draws. ``fixed``
        fields are set on every draw."""
        for _ in range(tries):
            kn = self.draw(rng, spec, arch)
            if fixed:
                kn = dataclasses.replace(kn, **fixed)
            if self.legal(spec, arch, kn, sms) is None:
                return kn
        return None

    def features(self, spec: ConvSpec, arch: str, knobs, sms: int | None = None) -> list[float]:
        """Shape features, then one value per knob dimension (bools 0/1, strings by index in ``dims``, numbers as
        they are), then the strategy's derived features (``feature_names`` names every value)."""
        out = shape_features(spec, arch, sms, self.per_group)
        for k, vals in self.dims.items():
            v = getattr(knobs, k)
            out.append(float(vals.index(v)) if isinstance(v, str) else float(v))
        return out + [float(v) for v in self.features_fn(spec, arch, knobs, sms)] if self.features_fn else out

    def feature_names(self) -> list[str]:
        return list(SHAPE_FEATURES) + list(self.dims) + list(self.derived_names)

    def point_id(self, spec: ConvSpec, arch: str, knobs) -> str:
        """A point's identity for ``spec``: its effective knobs (``effective``) as sorted JSON -- two points the
        builder turns into one kernel have one id."""
        return json.dumps(self.to_dict(self.effective(spec, arch, knobs)), sort_keys=True, default=str)

    def to_dict(self, knobs) -> dict:
        return {f.name: getattr(knobs, f.name) for f in dataclasses.fields(knobs)}

    def from_dict(self, d: dict):
        return self.knobs_type(**d)


SHAPE_FEATURES = ("log2_gemm_m", "log2_gemm_n", "log2_gemm_k", "R", "S", "stride", "x_bits", "has_residual",
                  "log2_sms")


def shape_features(spec: ConvSpec, arch: str, sms: int | None = None, per_group: bool = False) -> list[float]:
    """``SHAPE_FEATURES``: the conv's GEMM (``ConvSpec.gemm_shape``; ``per_group``: the reduction of one group,
    R x S x C / groups, as the implicit GEMM of a grouped conv runs it), the filter, stride, bits, the SMs."""
    m, n, k = spec.gemm_shape()
    if per_group:
        k //= spec.groups
    units = sms or ((os.cpu_count() or 1) if arch in CPU_KERNELS else arch_info(arch).sms)
    return [math.log2(m), math.log2(n), math.log2(k), float(spec.R), float(spec.S), float(spec.strides[0]),
            float(spec.x_bits), float(spec.has_residual), math.log2(units)]


# ---- implicit GEMM (NHWC) and the direct HWNC kernel: GemmKnobs ---------------------------------------------------
def _wgmma_operands(spec: ConvSpec, arch: str) -> bool:
    return (arch_info(arch).wgmma and spec.pad_value == 0 and spec.C * spec.x_bits // 8 % 16 == 0
            and spec.x_bits in (4, 8))


def _draw_common(rng) -> dict:
    return dict(ev=_pick(rng, (4, 8, 8, 16)), minb=_pick(rng, (0, 0, 2, 3, 4)),
                split_k=_pick(rng, (0, 0, 0, 1, 2, 4, 8)), erq=_pick(rng, (False, True)))


def _draw_sync(rng) -> dict:
    return dict(mma="sync", BM=_pick(rng, (32, 64, 128, 256)), BN=_pick(rng, (32, 64, 128, 256)),
                WM=_pick(rng, (1, 2, 4)), WN=_pick(rng, (1, 2, 4)), BK=_pick(rng, (32, 64, 128)),
                stages=_pick(rng, (2, 3, 4, 5)), pipe=_pick(rng, (0, 1)), fdb=_pick(rng, (False, True)),
                vec=_pick(rng, (16, 16, 8, 4)))


def _draw_wg_tile(rng, wn_one: bool = False) -> dict:
    wm, wn = _pick(rng, (1, 2)), 1 if wn_one else _pick(rng, (1, 1, 2))
    return dict(mma="wgmma", vec=16, WM=wm, WN=wn, BM=wm * _pick(rng, (64, 128)),
                BN=wn * _pick(rng, (64, 128, 96, 112)),
                BK=_pick(rng, (32, 64, 128, 256)), pipe=_pick(rng, (-1, 0, 1)))


def _stages_at_least(rng, lo: int, hi: int = 8) -> int:
    return _pick(rng, range(max(2, lo), max(2, lo, hi) + 1))


def _fam_wg8(rng):
    d = _draw_wg_tile(rng)
    return dict(d, stages=_stages_at_least(rng, 3 + d["pipe"], 6))


def _fam_wg8_pp(rng):
    d = dict(_draw_wg_tile(rng), WM=1, WN=1, split_k=_pick(rng, (0, 1)), pp=True, minb=_pick(rng, (0, 1)))
    d.update(BM=_pick(rng, (64, 128)), BN=_pick(rng, (64, 128)))
    return dict(d, stages=_stages_at_least(rng, 3 + d["pipe"], 5))


def _fam_wg8_sk(rng):
    d = dict(_fam_wg8(rng), sk=_pick(rng, (1, 2)), split_k=_pick(rng, (0, 1)))
    return d


def _fam_wg8_persist(rng):
    return dict(_fam_wg8(rng), persist=_pick(rng, (1, 2)), split_k=1)


def _regA(rng, pipes=(-1, 0), wn_one=True, w8=None, extra=1):
    """A register-A point: pstages >= 2, stages deep enough for w8's B (stages >= pstages + 1 + pipe)."""
    d = dict(_draw_wg_tile(rng, wn_one), areg=True, pipe=_pick(rng, pipes))
    d["pstages"] = _pick(rng, (2, 3, 4, 5))
    w8 = _pick(rng, (False, True)) if w8 is None else w8
    lo = max(3 + d["pipe"], d["pstages"] + extra + d["pipe"]) if w8 else 3 + d["pipe"]
    return dict(d, w8=w8, stages=_stages_at_least(rng, lo, lo + 2))


def _fam_wg8_agl(rng):
    return dict(_regA(rng, w8=True), awarp=True, agl=True, BM=64, WM=1)


def _fam_wg4(rng):
    d = _draw_wg_tile(rng)
    return dict(d, pstages=_pick(rng, (0, 0, 2, 3, 4)), stages=_stages_at_least(rng, 3 + d["pipe"], 6))


def _fam_wg4_areg(rng):
    return _regA(rng, wn_one=False)


def _fam_wg4_awarp(rng):
    return dict(_regA(rng, pipes=(-1,)), awarp=True)


def _fam_wg4_agl(rng):
    return dict(_regA(rng, w8=True), awarp=True, agl=True)


def _fam_wg4_pp(rng):
    d = dict(_draw_wg_tile(rng), WM=1, WN=1, BM=_pick(rng, (64, 128)), BN=_pick(rng, (64, 128)), pp=True, areg=True,
             w8=True, pipe=_pick(rng, (-1, 0)), split_k=_pick(rng, (0, 1)), agl=_pick(rng, (False, True)),
             minb=_pick(rng, (0, 1)))
    st = _stages_at_least(rng, 3 + d["pipe"], 5)
    return dict(d, stages=st, pstages=st)


def _fam_wg4_pp_unpack(rng):
    d = dict(_draw_wg_tile(rng), WM=1, WN=1, BM=_pick(rng, (64, 128)), BN=_pick(rng, (64, 128)), pp=True,
             pipe=_pick(rng, (-1, 0)), split_k=_pick(rng, (0, 1)), w8=_pick(rng, (False, True)), minb=_pick(rng, (0, 1)))
    st = _stages_at_least(rng, 3 + d["pipe"], 5)
    return dict(d, stages=st, pstages=_pick(rng, range(max(2, st - 1 - d["pipe"]), 7)))


def _fam_wg4_wsp(rng):
    d = dict(_draw_wg_tile(rng), wsp=_pick(rng, (1, 2)), pipe=_pick(rng, (-1, 0)), pstages=_pick(rng, (2, 3, 4)))
    return dict(d, stages=_stages_at_least(rng, 3 + d["pipe"], 6))


def _fam_wg4_persist(rng):
    return dict(_regA(rng, pipes=(-1,), w8=True), awarp=True, persist=_pick(rng, (1, 2)), split_k=1)


# name -> (operand bits it takes (0: any, with or without wgmma), wgmma, draw). The order is the one features index.
GEMM_FAMILIES = {
    "sync": (0, False, _draw_sync),
    "wg8": (8, True, _fam_wg8),
    "wg8_pp": (8, True, _fam_wg8_pp),
    "wg8_sk": (8, True, _fam_wg8_sk),
    "wg8_persist": (8, True, _fam_wg8_persist),
    "wg8_agl": (8, True, _fam_wg8_agl),
    "wg4": (4, True, _fam_wg4),
    "wg4_areg": (4, True, _fam_wg4_areg),
    "wg4_awarp": (4, True, _fam_wg4_awarp),
    "wg4_agl": (4, True, _fam_wg4_agl),
    "wg4_pp": (4, True, _fam_wg4_pp),
    "wg4_pp_unpack": (4, True, _fam_wg4_pp_unpack),
    "wg4_wsp": (4, True, _fam_wg4_wsp),
    "wg4_persist": (4, True, _fam_wg4_persist),
}


def gemm_family(kn: GemmKnobs, x_bits: int) -> str:
    """The family (``GEMM_FAMILIES``) a GemmKnobs point belongs to for operands of ``x_bits``."""
    if kn.mma != "wgmma":
        return "sync"
    if x_bits == 8:
        if kn.agl:
            return "wg8_agl"
        return "wg8_pp" if kn.pp else "wg8_sk" if kn.sk else "wg8_persist" if kn.persist else "wg8"
    if kn.pp:
        return "wg4_pp" if kn.areg else "wg4_pp_unpack"
    if kn.wsp:
        return "wg4_wsp"
    if kn.persist:
        return "wg4_persist"
    if kn.agl:
        return "wg4_agl"
    if kn.awarp:
        return "wg4_awarp"
    return "wg4_areg" if kn.areg else "wg4"


def gemm_families(spec: ConvSpec, arch: str) -> list[str]:
    """The families whose points can apply to ``spec`` on ``arch``."""
    wg = _wgmma_operands(spec, arch)
    return [f for f, (bits, needs_wg, _) in GEMM_FAMILIES.items()
            if (not needs_wg or wg) and bits in (0, spec.x_bits)]


def _gemm_draw(rng, spec: ConvSpec, arch: str) -> GemmKnobs:
    fam = _pick(rng, gemm_families(spec, arch))
    kw = dict(_draw_common(rng), **GEMM_FAMILIES[fam][2](rng))
    return GemmKnobs(**kw)


# Start points of the GemmKnobs spaces (``KernelSpace.configs``): the forms that won most often among the tuned
# ResNet-18/50 records on the H100 (8-bit and 4-bit wgmma), and mma.sync tiles for the archs without wgmma (and for
# operands wgmma cannot take). Fields not named take GemmKnobs' defaults; entries illegal for a shape are skipped.
_WG = dict(mma="wgmma", pipe=-1, WN=1)
GEMM_CONFIGS = {
    "wgmma8": (
        dict(_WG, BM=128, BN=128, BK=128, WM=1, stages=3),
        dict(_WG, BM=128, BN=128, BK=128, WM=1, stages=2, minb=3),
        dict(_WG, BM=128, BN=128, BK=128, WM=1, stages=4, erq=True, pp=True),
        dict(_WG, BM=128, BN=64, BK=128, WM=1, stages=4, erq=True, pp=True),
        dict(_WG, BM=128, BN=64, BK=64, WM=1, stages=2, minb=3),
        dict(_WG, BM=128, BN=128, BK=128, WM=2, stages=3),
        dict(_WG, BM=64, BN=128, BK=128, WM=1, stages=3),
        dict(_WG, BM=64, BN=64, BK=128, WM=1, stages=3),
    ),
    "wgmma4": (
        dict(_WG, BM=128, BN=128, BK=64, WM=2, stages=3, pstages=3, areg=True, awarp=True, w8=True),
        dict(_WG, BM=128, BN=64, BK=64, WM=1, stages=3, pstages=3, areg=True, awarp=True, w8=True, minb=3),
        dict(_WG, BM=128, BN=64, BK=64, WM=1, stages=3, pstages=3, areg=True, awarp=True, w8=True, minb=4),
        dict(_WG, BM=64, BN=64, BK=64, WM=1, stages=4, pstages=4, areg=True, awarp=True, w8=True, minb=3),
        dict(_WG, BM=128, BN=128, BK=64, WM=2, stages=4, pstages=4, areg=True, w8=True),
        dict(_WG, BM=128, BN=128, BK=128, WM=1, stages=3),
        dict(_WG, BM=64, BN=64, BK=128, WM=1, stages=3),
    ),
    "sync": (
        dict(BM=128, BN=128, BK=64, WM=2, WN=2, stages=3),
        dict(BM=128, BN=64, BK=64, WM=2, WN=2, stages=3),
        dict(BM=64, BN=128, BK=64, WM=2, WN=2, stages=3),
        dict(BM=64, BN=64, BK=64, WM=2, WN=2, stages=4),
        dict(BM=128, BN=128, BK=32, WM=2, WN=2, stages=4, pipe=1),
        dict(BM=256, BN=128, BK=64, WM=4, WN=2, stages=3),
        dict(BM=128, BN=128, BK=64, WM=2, WN=2, stages=2),
    ),
}


def _gemm_configs(spec: ConvSpec, arch: str) -> list:
    group = f"wgmma{spec.x_bits}" if _wgmma_operands(spec, arch) else "sync"
    return [GemmKnobs(**d) for d in GEMM_CONFIGS.get(group, GEMM_CONFIGS["sync"])]


def _gemm_applies(layout):
    def applies(spec, arch):
        from .gemm.plan import gemm_constraints

        if spec.layout != layout:
            return f"takes {layout}, not {spec.layout}"
        if spec.groups != 1:
            return f"takes groups == 1, not {spec.groups} (grouped convs: depthwise / grouped)"
        return gemm_constraints(spec, arch, layout)
    return applies


def gemm_plan(spec: ConvSpec, arch: str, kn: GemmKnobs, layout: str | None = None, sms: int | None = None):
    """The plan of the kernel the implicit GEMM / HWNC builder makes for the point (split-K allowed, as compiled
    models plan it); raises ``gemm.plan.NotApplicable``."""
    from .gemm.plan import make_plan

    return make_plan(spec, arch, kn, layout or spec.layout, adapt=True, allow_split=True, sms=sms)


def _gemm_legal(layout):
    def legal(spec, arch, kn, sms=None):
        from .gemm.plan import NotApplicable

        try:
            gemm_plan(spec, arch, kn, layout, sms)
        except NotApplicable as e:
            return str(e)
        return None
    return legal


def _gemm_effective(layout):
    def effective(spec, arch, kn, sms=None):
        from .gemm.plan import NotApplicable, adapt_knobs

        try:
            return gemm_plan(spec, arch, kn, layout, sms).effective_knobs
        except NotApplicable:
            return adapt_knobs(spec, kn, layout)
    return effective


def _gemm_default(spec: ConvSpec, arch: str, sms: int | None = None) -> GemmKnobs:
    return default_knobs(spec, arch, sms=sms)


def _gemm_derived(spec: ConvSpec, arch: str, kn: GemmKnobs, sms: int | None = None) -> list[float]:
    from .gemm.plan import NotApplicable, split_factor

    sms = sms or arch_info(arch).sms
    try:
        p = gemm_plan(spec, arch, kn, sms=sms)
        kn, split, smem, threads = p.kn, p.SPLIT, max(p.A_ALLOC, p.SMEM_ALL), p.NTH
    except NotApplicable:
        split = split_factor(spec, arch, kn, sms=sms)
        smem, threads = kn.stages * (kn.BM + kn.BN) * kn.BK, kn.threads
    return _gemm_features(spec, kn, sms, spec.gemm_shape()[2], split, smem, threads)


def _grouped_gemm_derived(spec: ConvSpec, arch: str, kn: GemmKnobs, sms: int | None = None) -> list[float]:
    """``GEMM_DERIVED`` of a ``grouped_gemm`` point: its plan (``grouped_gemm.grouped_gemm_plan``: one K-split) over
    one group's reduction, R x S x C / groups."""
    from .gemm.plan import NotApplicable
    from .grouped_gemm import grouped_gemm_plan

    sms = sms or arch_info(arch).sms
    try:
        p = grouped_gemm_plan(spec, arch, kn, sms)
        kn, smem, threads = p.kn, max(p.A_ALLOC, p.SMEM_ALL), p.NTH
    except NotApplicable:
        smem, threads = kn.stages * (kn.BM + kn.BN) * kn.BK, kn.threads
    return _gemm_features(spec, kn, sms, spec.R * spec.S * (spec.C // spec.groups), 1, smem, threads)


def _gemm_features(spec: ConvSpec, kn: GemmKnobs, sms: int, k: int, split: int, smem: int, threads: int) -> list:
    """``GEMM_DERIVED`` of tile ``kn`` over the conv's output (N*P*Q x K) and a reduction of ``k`` values."""
    m, n = spec.N * spec.P * spec.Q, spec.K
    kb = k * spec.x_bits // 8
    blocks = tile_grid(spec, kn.BM, kn.BN)
    chunks = -(-kb // kn.BK)
    waves = blocks * split / sms
    waste = 1 - (m * n) / (-(-m // kn.BM) * kn.BM * -(-n // kn.BN) * kn.BN)
    fam = gemm_family(kn, spec.x_bits)
    return [math.log2(blocks), waves, waves - math.floor(waves), split, chunks / split, waste, smem / 1024,
            threads, kn.BM * kn.BN / threads] + [float(f == fam) for f in GEMM_FAMILIES]


GEMM_DERIVED = ("log2_blocks", "waves", "wave_tail", "split", "chunks_per_split", "tile_waste", "smem_kib", "threads",
                "acc_per_thread") + tuple(f"family_{f}" for f in GEMM_FAMILIES)


# ---- implicit_gemm_t: KtKnobs -------------------------------------------------------------------------------------
def _kt_space() -> KernelSpace:
    from .igemm_t import KtKnobs, kt_constraints, kt_legal, resolve_knobs, smem_bytes
    from .stem import WGMMA_N_S8

    def applies(spec, arch):
        if spec.groups != 1:
            return f"takes groups == 1, not {spec.groups}"
        return kt_constraints(spec, arch)

    def effective(spec, arch, kn, sms=None):
        return resolve_knobs(spec, arch, kn, sms=sms)

    def derived(spec, arch, kn, sms=None):
        k = resolve_knobs(spec, arch, kn, sms=sms)
        s = sms or arch_info(arch).sms
        blocks = spec.K // 128 * -(-spec.N * spec.P * spec.Q // k.bn)
        chunks = spec.R * spec.S * spec.C // 128
        waves = blocks / s
        return [math.log2(blocks), waves, waves - math.floor(waves), chunks,
                smem_bytes(spec, k.bn, k.stages, spec.x_bits == 4 and bool(k.ring)) / 1024, k.bn, k.stages, k.gif]

    dims = {"bn": (0,) + tuple(n for n in WGMMA_N_S8 if n >= 48), "stages": (0, 3, 4, 5, 6, 7, 8), "ring": (-1, 0, 1),
            "gif": (1, 2)}
    return KernelSpace("implicit_gemm_t", KtKnobs, dims, applies, kt_legal, lambda spec, arch, sms=None: KtKnobs(),
                       effective, derived, None,
                       ("log2_blocks", "waves", "wave_tail", "chunks", "smem_kib", "bn_eff", "stages_eff", "gif_eff"))


# ---- direct_halo: HaloKnobs ---------------------------------------------------------------------------------------
def _halo_space() -> KernelSpace:
    from .stem import HaloKnobs, halo_constraints, halo_legal, halo_smem, resolve_knobs

    def applies(spec, arch):
        if spec.groups != 1:
            return f"takes groups == 1, not {spec.groups}"
        return halo_constraints(spec, arch)

    def effective(spec, arch, kn, sms=None):
        return resolve_knobs(spec, arch, kn, sms=sms)

    def derived(spec, arch, kn, sms=None):
        k = resolve_knobs(spec, arch, kn, sms=sms)
        s = sms or arch_info(arch).sms
        items = spec.N * -(-spec.P // k.th)
        return [math.log2(items), items / (k.minb * s), k.th, k.minb, k.pipe, halo_smem(spec, k) / 1024]

    dims = {"th": (0, 1, 2, 4, 8), "minb": (0, 1, 2, 3, 4), "pipe": (-1, 0, 1)}
    return KernelSpace("direct_halo", HaloKnobs, dims, applies, halo_legal, lambda spec, arch, sms=None: HaloKnobs(),
                       effective, derived, None,
                       ("log2_items", "items_per_block", "th_eff", "minb_eff", "pipe_eff", "smem_kib"))


# ---- the CPU kernels (schedules/cpu_conv.py, cpu_conv_vnni.py): CpuKnobs; ``arch`` is the inner kernel ------------
CPU_KERNELS = ("cpu_direct_avx2", "cpu_direct_vnni", "cpu_direct_avxvnni", "cpu_direct_sdot")


def _cpu_space() -> KernelSpace:
    """``cpu_direct``: the register tile (``CpuKnobs``: qt pixels x kt channel vectors, 0 x 0 automatic) of the CPU
    inner kernel named by ``arch`` (``cpu_direct_avx2``, ``cpu_direct_vnni``, ``cpu_direct_avxvnni``,
    ``cpu_direct_sdot``); ``sms`` is the CPU's threads. Legality is the builders' own ``cpu_conv.tile_legal``, the
    default the kernel's automatic tile (``cpu_conv.auto_tile``), ``effective`` the tile the builder uses for the
    shape (clamped to the row and the channel vectors)."""
    from .cpu_conv import (LANES, QT_MAX, KT_MAX, REGS, STRATEGY, CpuKnobs, applies as cpu_applies, auto_tile,
                           effective_tile, tile_legal)

    def applies(spec, arch):
        if arch not in CPU_KERNELS:
            return f"cpu_direct runs on the CPU kernels ({', '.join(CPU_KERNELS)}), not {arch}"
        if spec.layout != "NHWC":
            return f"takes the NHWC geometry, not {spec.layout}"
        if spec.groups != 1:
            return f"takes groups == 1, not {spec.groups}"
        return cpu_applies(spec)

    def legal(spec, arch, kn, sms=None):
        return tile_legal(arch, kn)

    def effective(spec, arch, kn, sms=None):
        return effective_tile(spec, arch, kn)

    def default(spec, arch, sms=None):
        return auto_tile(spec, arch)

    def derived(spec, arch, kn, sms=None):
        from .cpu_conv_vnni import ISAS

        t = effective_tile(spec, arch, kn)
        lanes = LANES if arch == STRATEGY else ISAS[arch].lanes
        kb = -(-spec.K // lanes)
        n_qt, n_kt = -(-spec.Q // t.qt), -(-kb // t.kt)
        tasks = spec.N * spec.P * n_kt
        threads = sms or os.cpu_count() or 1
        steps = n_qt * n_kt * spec.P * spec.N * spec.R * spec.S * -(-spec.C // 4)
        return [t.qt, t.kt, t.qt * t.kt, t.qt * t.kt + t.kt + 1 - REGS[arch], n_qt * t.qt / spec.Q - 1,
                n_kt * t.kt / kb - 1, math.log2(tasks), tasks / threads, math.log2(steps),
                math.log2(steps * max(t.qt * t.kt, t.qt + t.kt)), lanes]

    def configs(spec, arch):
        return [CpuKnobs(qt, kt) for qt, kt in CPU_CONFIGS[REGS[arch]]]

    dims = {"qt": tuple(range(QT_MAX + 1)), "kt": tuple(range(KT_MAX + 1))}
    return KernelSpace("cpu_direct", CpuKnobs, dims, applies, legal, default, effective, derived, None,
                       ("qt_eff", "kt_eff", "accumulators", "spare_regs", "q_waste", "k_waste", "log2_tasks",
                        "tasks_per_thread", "log2_steps", "log2_work", "lanes"), configs)


# Start points of the CPU space (``KernelSpace.configs``), by the kernel's vector registers: a spread of register
# tiles that fill them -- rows of pixels against few channel vectors, square ones, deep channel blocks -- so that a
# task's first round sees each form once (those the shape clamps to the same tile count once).
CPU_CONFIGS = {
    32: ((14, 2), (7, 2), (8, 2), (6, 3), (4, 4), (4, 6), (3, 7), (28, 1), (10, 2)),
    16: ((6, 2), (4, 2), (3, 3), (2, 4), (12, 1), (7, 1), (2, 5), (4, 1)),
}


# ---- the CUDA-core kernels of grouped convs (schedules/depthwise.py, grouped.py): DwConfig, GroupedConfig -------
DP4A_THREADS = (32, 64, 128, 256, 512, 1024)  # threads per block (the kernels take any multiple of 32 up to 1024)
DP4A_RESIDENT = 2048  # threads one SM holds at most (every arch here): the unit of the grid's waves


def _dp4a_derived(spec: ConvSpec, arch: str, sms: int | None, ch: int, qt: int, threads: int, chans: int,
                  words: int) -> list[float]:
    """The derived features both dp4a kernels share: ``ch`` channels of ``chans`` a thread, ``qt`` columns, ``words``
    dp4a words per (column, channel) and kernel tap."""
    s = sms or arch_info(arch).sms
    qb = -(-spec.Q // qt)
    total = spec.N * spec.P * qb * (chans // ch)
    blocks = -(-total // threads)
    waves = total / (s * DP4A_RESIDENT)
    seg = (qt - 1) * spec.strides[1] + (spec.S - 1) * spec.dilations[1] + 1
    return [ch, qt, threads, math.log2(total), math.log2(blocks), waves, waves - math.floor(waves),
            ch * qt, seg / qt, qb * qt / spec.Q - 1, words]


DP4A_DERIVED = ("ch_eff", "qt_eff", "threads", "log2_threads_total", "log2_blocks", "waves", "wave_tail",
                "acc_per_thread", "loads_per_column", "q_waste", "words_per_tap")


def _dp4a_applies(name: str, constraints):
    def applies(spec, arch):
        if arch in CPU_KERNELS or not arch.startswith("sm_"):
            return f"{name} runs on the CUDA archs (sm_XX), not {arch}"
        if spec.groups == 1:
            return f"{name} takes grouped convs (groups > 1), not groups 1"
        return constraints(spec)
    return applies


def _dw_space() -> KernelSpace:
    """``depthwise``: the thread tile (``DwConfig``: vec channels x qt columns, threads per block; 0 automatic) of
    the depthwise kernel (groups == C == K). Legality is the builder's own ``depthwise.depthwise_point``, the default
    the kernel's automatic tile (``DwConfig()``, resolved per arch by its SM count), ``effective`` that tile
    resolved for the shape."""
    from .depthwise import DwConfig, depthwise_constraints, depthwise_point

    def legal(spec, arch, kn, sms=None):
        return depthwise_point(spec, spec.groups, kn, arch, sms)[1]

    def effective(spec, arch, kn, sms=None):
        return depthwise_point(spec, spec.groups, kn, arch, sms)[0]

    def derived(spec, arch, kn, sms=None):
        k = effective(spec, arch, kn, sms)
        return _dp4a_derived(spec, arch, sms, k.vec, k.qt, k.threads, spec.C, -(-k.vec // 4))

    def configs(spec, arch):
        return [DwConfig(**d) for d in DW_CONFIGS]

    dims = {"vec": (0, 1, 4, 8, 16), "qt": tuple(range(9)), "threads": DP4A_THREADS}
    return KernelSpace("depthwise", DwConfig, dims,
                       _dp4a_applies("depthwise", lambda spec: depthwise_constraints(spec, spec.groups)), legal,
                       lambda spec, arch, sms=None: DwConfig(), effective, derived, None, DP4A_DERIVED, configs)


def _grouped_space() -> KernelSpace:
    """``grouped``: the thread tile (``GroupedConfig``: kt channels of a group x qt columns, threads per block; 0
    automatic) of the grouped kernel, for the grouped convs that are not depthwise. Legality is the builder's own
    ``grouped.grouped_point``, the default the automatic tile (``GroupedConfig()``), ``effective`` it resolved."""
    from .depthwise import depthwise_constraints
    from .grouped import GroupedConfig, grouped_constraints, grouped_point

    def constraints(spec):
        if depthwise_constraints(spec, spec.groups) is None:
            return "grouped: groups == C == K runs on the depthwise kernel"
        return grouped_constraints(spec, spec.groups)

    def legal(spec, arch, kn, sms=None):
        return grouped_point(spec, spec.groups, kn, arch, sms)[1]

    def effective(spec, arch, kn, sms=None):
        return grouped_point(spec, spec.groups, kn, arch, sms)[0]

    def derived(spec, arch, kn, sms=None):
        k = effective(spec, arch, kn, sms)
        cg = spec.C // spec.groups
        return _dp4a_derived(spec, arch, sms, k.kt, k.qt, k.threads, spec.K, cg // 4 if cg % 4 == 0 else cg)

    def configs(spec, arch):
        return [GroupedConfig(**d) for d in GROUPED_CONFIGS]

    dims = {"kt": (0, 1, 2, 4, 8), "qt": tuple(range(9)), "threads": DP4A_THREADS}
    return KernelSpace("grouped", GroupedConfig, dims, _dp4a_applies("grouped", constraints), legal,
                       lambda spec, arch, sms=None: GroupedConfig(), effective, derived, None, DP4A_DERIVED, configs)


def _grouped_gemm_space() -> KernelSpace:
    """``grouped_gemm``: the implicit GEMM's knobs (``GemmKnobs``) on a grouped conv whose per-group channels allow
    it (``grouped_gemm.grouped_gemm_constraints``). Legality is the builder's own ``grouped_gemm.grouped_gemm_plan``
    (via ``grouped_gemm_point``), the default ``default_grouped_knobs``, ``effective`` the plan's knobs; the points
    are drawn from the mma.sync and plain wgmma families with N tiles that divide Kg; the features' reduction is one
    group's (R x S x Cg: ``per_group``, ``_grouped_gemm_derived``)."""
    from .grouped_gemm import default_grouped_knobs, grouped_gemm_constraints, grouped_gemm_point

    def legal(spec, arch, kn, sms=None):
        return grouped_gemm_point(spec, arch, kn, sms)[1]

    def effective(spec, arch, kn, sms=None):
        return grouped_gemm_point(spec, arch, kn, sms)[0]

    def draw(rng, spec, arch):
        kg = spec.K // max(spec.groups, 1)
        fam = _pick(rng, ("sync", "wg8") if _wgmma_operands(spec, arch) and kg % 64 == 0 else ("sync",))
        d = dict(_draw_common(rng), **GEMM_FAMILIES[fam][2](rng), split_k=0)
        lo = 64 if fam == "wg8" else 32
        d["BN"] = _pick(rng, [b for b in (32, 64, 128, 256) if b >= lo and kg % b == 0] or [lo])
        d["WN"] = _pick(rng, [w for w in (1, 2) if d["BN"] // w >= lo])
        return GemmKnobs(**d)

    def configs(spec, arch):
        return [GemmKnobs(**d) for d in GROUPED_GEMM_CONFIGS]

    return KernelSpace("grouped_gemm", GemmKnobs, dict(GemmKnobs.SPACE), lambda spec, arch: grouped_gemm_constraints(
        spec, arch), legal, lambda spec, arch, sms=None: default_grouped_knobs(spec, arch, sms), effective,
        _grouped_gemm_derived, draw, GEMM_DERIVED, configs, per_group=True)


# Start points of the grouped_gemm space: mma.sync tiles of 32 / 64 columns (BN halves down to Kg), then the plain
# wgmma tiles (Kg a multiple of 64).
GROUPED_GEMM_CONFIGS = (
    dict(BM=128, BN=64, BK=64, WM=4, WN=1, stages=4),
    dict(BM=128, BN=32, BK=32, WM=4, WN=1, stages=4),
    dict(BM=64, BN=32, BK=64, WM=2, WN=1, stages=3),
    dict(BM=256, BN=32, BK=64, WM=4, WN=1, stages=3),
    dict(BM=128, BN=64, BK=32, WM=2, WN=2, stages=4, pipe=1),
    dict(BM=128, BN=32, BK=64, WM=2, WN=1, stages=3, fdb=True),
    dict(BM=64, BN=32, BK=32, WM=2, WN=1, stages=4, pipe=1),
    dict(BM=128, BN=32, BK=128, WM=4, WN=1, stages=3, erq=True),
    dict(_WG, BM=128, BN=64, BK=64, WM=1, stages=3),
    dict(_WG, BM=64, BN=64, BK=128, WM=1, stages=3),
)


# Start points of the dp4a spaces (``KernelSpace.configs``): the automatic tile first, then a spread of channel
# vectors / tiles against columns per thread and block sizes (fields not named: the automatic / 256 threads).
DW_CONFIGS = (dict(), dict(vec=8, qt=4), dict(vec=16, qt=2), dict(vec=4, qt=4), dict(vec=8, qt=2, threads=128),
              dict(vec=8, qt=8), dict(vec=16, qt=4, threads=128), dict(vec=4, qt=8, threads=512))
GROUPED_CONFIGS = (dict(), dict(kt=8, qt=4), dict(kt=4, qt=4), dict(kt=8, qt=2, threads=128), dict(kt=4, qt=8),
                   dict(kt=2, qt=4), dict(kt=8, qt=8, threads=128), dict(kt=4, qt=2, threads=512))


SPACES: dict[str, KernelSpace] = {
    "implicit_gemm": KernelSpace("implicit_gemm", GemmKnobs, dict(GemmKnobs.SPACE), _gemm_applies("NHWC"),
                                 _gemm_legal("NHWC"), _gemm_default, _gemm_effective("NHWC"), _gemm_derived,
                                 _gemm_draw, GEMM_DERIVED, _gemm_configs),
    "direct_hwnc": KernelSpace("direct_hwnc", GemmKnobs, dict(GemmKnobs.SPACE), _gemm_applies("HWNC"),
                               _gemm_legal("HWNC"), _gemm_default, _gemm_effective("HWNC"), _gemm_derived,
                               _gemm_draw, GEMM_DERIVED, _gemm_configs),
    "implicit_gemm_t": _kt_space(),
    "direct_halo": _halo_space(),
    "cpu_direct": _cpu_space(),
    "depthwise": _dw_space(),
    "grouped": _grouped_space(),
    "grouped_gemm": _grouped_gemm_space(),
}


def spaces_for(spec: ConvSpec, arch: str) -> list[KernelSpace]:
    """The spaces whose strategy can take ``spec`` on ``arch``."""
    return [s for s in SPACES.values() if s.applies(spec, arch) is None]
