"""The tuning spaces of the conv kernels: one typed space per strategy, declared beside the kernels.

A ``KernelSpace`` is what a tuner (``qcompile.tune``) needs of a strategy, and what the builder agrees with:

* ``dims``: the knob dimensions and their values (the knobs dataclass's fields);
* ``legal(spec, arch, knobs) -> str | None``: THE legality function -- None where the builder takes the point, else
  why not (the builder raises with the same reason);
* ``effective(spec, arch, knobs)``: the knobs the builder actually uses for the shape (small problems shrink tiles):
  two points with equal effective knobs build the same kernel, so a tuner measures one of them;
* ``default(spec, arch)``: the arch's default point for the shape (what an untuned layer gets);
* ``features(spec, arch, knobs) -> list[float]`` (``FEATURES`` names them): what a cost model sees -- the shape, the
  knobs, and derived sizes (tiles, waves over the SMs, K-chunks, padding waste, shared memory, threads).

``SPACES`` maps strategy names (``schedules.STRATEGIES``) to spaces; ``spaces_for(spec, arch)`` lists those that apply
to a shape (``applies``).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable

from .spec import ConvSpec, GemmKnobs, arch_info, default_knobs, tile_grid


@dataclass(frozen=True)
class KernelSpace:
    strategy: str
    knobs_type: type
    dims: dict  # field -> tuple of values
    applies: Callable  # (spec, arch) -> str | None: why the strategy cannot take the shape at all
    legal_fn: Callable  # (spec, arch, knobs) -> str | None (called after ``applies``)
    default_fn: Callable  # (spec, arch) -> knobs
    effective_fn: Callable = None  # (spec, arch, knobs) -> knobs; None: the knobs themselves
    features_fn: Callable = None  # (spec, arch, knobs) -> list[float] (strategy part; see ``features``)

    def legal(self, spec: ConvSpec, arch: str, knobs) -> str | None:
        if not isinstance(knobs, self.knobs_type):
            return f"{self.strategy} takes {self.knobs_type.__name__}, not {type(knobs).__name__}"
        why = self.applies(spec, arch)
        return why if why else self.legal_fn(spec, arch, knobs)

    def effective(self, spec: ConvSpec, arch: str, knobs):
        return self.effective_fn(spec, arch, knobs) if self.effective_fn else knobs

    def default(self, spec: ConvSpec, arch: str):
        return self.default_fn(spec, arch)

    def sample(self, rng, spec: ConvSpec, arch: str, tries: int = 2000, **fixed):
        """A random legal point (``rng``: random.Random or numpy Generator), or None after ``tries`` draws."""
        for _ in range(tries):
            kw = {k: v[int(rng.integers(len(v)))] if hasattr(rng, "integers") else rng.choice(v)
                  for k, v in self.dims.items()}
            kw.update(fixed)
            kn = self.knobs_type(**kw)
            if self.legal(spec, arch, kn) is None:
                return kn
        return None

    def features(self, spec: ConvSpec, arch: str, knobs) -> list[float]:
        """Shape features, then one value per knob dimension (bools 0/1, strings by index in ``dims``, numbers as
        they are), then the strategy's derived features."""
        out = shape_features(spec, arch)
        for k, vals in self.dims.items():
            v = getattr(knobs, k)
            out.append(float(vals.index(v)) if isinstance(v, str) else float(v))
        return out + (list(self.features_fn(spec, arch, knobs)) if self.features_fn else [])

    def feature_names(self) -> list[str]:
        return list(SHAPE_FEATURES) + list(self.dims) + list(DERIVED.get(self.strategy, ()))

    def to_dict(self, knobs) -> dict:
        return {f.name: getattr(knobs, f.name) for f in dataclasses.fields(knobs)}

    def from_dict(self, d: dict):
        return self.knobs_type(**d)


SHAPE_FEATURES = ("log2_gemm_m", "log2_gemm_n", "log2_gemm_k", "R", "S", "stride", "x_bits", "has_residual",
                  "log2_sms")


def shape_features(spec: ConvSpec, arch: str) -> list[float]:
    m, n, k = spec.gemm_shape()
    return [math.log2(m), math.log2(n), math.log2(k), spec.R, spec.S, spec.strides[0], spec.x_bits,
            float(spec.has_residual), math.log2(arch_info(arch).sms)]


# ---- implicit GEMM (NHWC) and the direct HWNC kernel: GemmKnobs -------------------------------------------
def _gemm_applies(layout):
    def applies(spec, arch):
        from .igemm import gemm_constraints

        if spec.layout != layout:
            return f"takes {layout}, not {spec.layout}"
        return gemm_constraints(spec, arch, layout)
    return applies


def _gemm_legal(layout):
    def legal(spec, arch, kn):
        from .igemm import NotApplicable, make_gemm_conv

        try:
            make_gemm_conv(spec, arch, kn, layout=layout, allow_split=True)
        except NotApplicable as e:
            return str(e)
        return None
    return legal


def _gemm_effective(layout):
    def effective(spec, arch, kn):
        from .igemm import _adapt_knobs

        return _adapt_knobs(spec, kn, layout)
    return effective


def _gemm_derived(spec: ConvSpec, arch: str, kn: GemmKnobs) -> list[float]:
    from .igemm import split_factor

    sms = arch_info(arch).sms
    m, n, k = spec.gemm_shape()
    kb = k * spec.x_bits // 8
    blocks = tile_grid(spec, kn.BM, kn.BN)
    split = split_factor(spec, arch, kn)
    chunks = -(-kb // kn.BK)
    waves = blocks * split / sms
    waste = 1 - (m * n) / (-(-m // kn.BM) * kn.BM * -(-n // kn.BN) * kn.BN)
    smem = kn.stages * (kn.BM + kn.BN) * kn.BK
    return [math.log2(blocks), waves, waves - math.floor(waves), split, chunks / split, waste, smem / 1024,
            kn.threads, kn.BM * kn.BN / kn.threads]


DERIVED = {"implicit_gemm": ("log2_blocks", "waves", "wave_tail", "split", "chunks_per_split", "tile_waste",
                             "smem_kib", "threads", "acc_per_thread")}
DERIVED["direct_hwnc"] = DERIVED["implicit_gemm"]

SPACES: dict[str, KernelSpace] = {
    "implicit_gemm": KernelSpace("implicit_gemm", GemmKnobs, dict(GemmKnobs.SPACE), _gemm_applies("NHWC"),
                                 _gemm_legal("NHWC"), default_knobs, _gemm_effective("NHWC"), _gemm_derived),
    "direct_hwnc": KernelSpace("direct_hwnc", GemmKnobs, dict(GemmKnobs.SPACE), _gemm_applies("HWNC"),
                               _gemm_legal("HWNC"), default_knobs, _gemm_effective("HWNC"), _gemm_derived),
}


def spaces_for(spec: ConvSpec, arch: str) -> list[KernelSpace]:
    """The spaces whose strategy can take ``spec`` on ``arch``."""
    return [s for s in SPACES.values() if s.applies(spec, arch) is None]
