"""Fakes for the tuner's tests: a fast kernel space over GemmKnobs, a builder and a runner whose time is a synthetic
function of the knobs (no TIR, no nvcc, no GPU)."""
from __future__ import annotations

import math

import pytest

from qcompile.schedules import tuning as TU
from qcompile.schedules.space import SPACES, KernelSpace
from qcompile.schedules.spec import ConvSpec, GemmKnobs
from qcompile.tune.common import BUILD_ERROR, MISMATCH, OK, Builder, Built, DeviceInfo, Measured, Runner
from qcompile.tune.tasks import Task, estimate_ms



@pytest.fixture
def fresh_logs(monkeypatch, tmp_path):
    """No packaged tuning logs and an empty log cache around each test (imported as an autouse fixture)."""
    monkeypatch.setenv("QCOMPILE_TUNING_DIR", str(tmp_path / "no_default_logs"))
    TU.clear_cache()
    yield
    TU.clear_cache()


_REAL_GEMM = SPACES["implicit_gemm"]  # (taken before a test puts the fake space in its place)
DIMS = {"BM": (32, 64, 128, 256), "BN": (32, 64, 128, 256), "BK": (32, 64, 128), "stages": (2, 3, 4, 5)}


def _legal(spec, arch, kn, sms=None):
    if kn.BM * kn.BN > 128 * 256:
        return "tile too large"
    if not kn.valid():
        return "not valid"
    # (a log's records are read back through the real space's check -- parse_record -- so what it refuses, e.g. warp
    # tiles beyond the register file or shared tiles beyond a block's, is refused here too)
    return _REAL_GEMM.legal(spec, arch, kn, sms)


def _effective(spec, arch, kn, sms=None):
    # (small problems shrink the tile rows, as the kernels do: BM beyond the GEMM's rows builds the same kernel)
    m = spec.N * spec.P * spec.Q
    bm = kn.BM
    while bm > 32 and bm // 2 >= m:
        bm //= 2
    return kn.replace(BM=bm)


# start points of the fake space: one illegal (tile too large), two that build the same kernel on tiny shapes
CONFIGS = (GemmKnobs(BM=256, BN=256, BK=64, stages=3), GemmKnobs(BM=64, BN=64, BK=64, stages=4),
           GemmKnobs(BM=32, BN=64, BK=64, stages=4), GemmKnobs(BM=128, BN=64, BK=128, stages=2))


def fake_space(strategy="implicit_gemm", configs=False):
    return KernelSpace(strategy, GemmKnobs, dict(DIMS), lambda spec, arch: None, _legal,
                       lambda spec, arch, sms=None: GemmKnobs(BM=128, BN=128, BK=64, stages=3), _effective,
                       lambda spec, arch, kn, sms=None: [math.log2(kn.BM * kn.BN), kn.BK * kn.stages / 64],
                       derived_names=("log2_tile", "ring_chunks"),
                       configs_fn=(lambda spec, arch: list(CONFIGS)) if configs else None)


def cost_ms(spec: ConvSpec, kn: GemmKnobs) -> float:
    """A synthetic kernel time: the task's roofline times a penalty for tiles far from the shape's best (BM ~ rows,
    BN ~ K), a BK x stages sweet spot."""
    m, k = spec.N * spec.P * spec.Q, spec.K
    best_bm = min(256, max(32, 2 ** round(math.log2(max(32, m ** 0.5 * 4)))))
    best_bn = min(256, max(32, 2 ** round(math.log2(k))))
    pen = (1 + 0.15 * abs(math.log2(kn.BM / best_bm)) + 0.12 * abs(math.log2(kn.BN / best_bn))
           + 0.05 * abs(math.log2(kn.BK / 64)) + 0.04 * abs(kn.stages - 4))
    return estimate_ms(spec, "sm_90") * pen


def is_mismatch(kn: GemmKnobs) -> bool:
    return getattr(kn, "BK", 0) == 32 and getattr(kn, "stages", 0) == 5


def is_build_error(kn: GemmKnobs) -> bool:
    return getattr(kn, "BM", 0) == 256 and getattr(kn, "BN", 0) == 64


class FakeBuilder(Builder):
    def __init__(self):
        self.built = []

    def build(self, cands):
        out = []
        for c in cands:
            self.built.append(c)
            if is_build_error(c.knobs):
                out.append(Built(c, None, error="ptxas: too many resources requested"))
            else:
                out.append(Built(c, f"/fake/{len(self.built)}.so", build_s=0.1))
        return out


class Pending(Exception):
    """The fake runner's offline export."""


class FakeRunner(Runner):
    def __init__(self, name="Fake GPU", arch="sm_90", sms=132, defer_after=None):
        # (defer_after: measure() raises Pending once that many candidates were measured, as an offline export)
        self.info = DeviceInfo(name, arch, sms)
        self.measured = []
        self.batches = []  # the candidates of each measure() call
        self.defer_after = defer_after

    def device(self):
        return self.info

    def measure(self, built):
        if self.defer_after is not None and len(self.measured) >= self.defer_after:
            raise Pending("batch exported to /fake/batch_0001")
        self.batches.append([b.candidate for b in built])
        out = []
        for b in built:
            c = b.candidate
            self.measured.append(c)
            if is_build_error(c.knobs):
                raise AssertionError("a candidate that failed to build was sent to the runner")
            if is_mismatch(c.knobs):
                out.append(Measured(c, MISMATCH, None, "12 of 4096 outputs differ", self.info.name, self.info.sms))
            else:
                out.append(Measured(c, OK, cost_ms(c.spec, c.knobs), "", self.info.name, self.info.sms))
        return out


class EffectiveKnobsRunner(Runner):
    """Every built candidate OK, its time ``time_of(effective knobs)`` (the builder's manifest entry: the kernel the
    point builds), on "GPU T" (sm_90, 132 SMs)."""

    def __init__(self, time_of):
        self.time_of = time_of
        self.measured = []

    def device(self):
        return DeviceInfo("GPU T", "sm_90", 132)

    def measure(self, built):
        self.measured += [b.candidate for b in built]
        return [Measured(b.candidate, OK, self.time_of(b.entry["effective_knobs"]), "", "GPU T", 132) for b in built]


def make_task(N=8, H=14, C=256, K=256, R=3, layers=("l1",), arch="sm_90", batch=None):
    spec = ConvSpec(N=N, H=H, W=H, C=C, K=K, R=R, S=R, padding=R // 2, x_dtype="uint8", out_dtype="uint8", lo=0,
                    hi=255)
    from qcompile.schedules.tuning import tuning_key

    t = Task(tuning_key(spec), spec, "implicit_gemm", arch, list(layers), "default", None, estimate_ms(spec, arch))
    t.extra["model_batch"] = batch or N
    return t


__all__ = ["BUILD_ERROR", "FakeBuilder", "FakeRunner", "Pending", "fake_space", "make_task", "cost_ms"]


def sleepy_build_task(task):
    """A builder task (``LocalBuilder(task_fn=...)``) that hangs for a shape with K 77, takes 2.5 s for K 78 and 1 s
    for K 79, and builds every other one at once (a manifest entry, no library)."""
    import time

    cand, cid = task[0], task[1]
    time.sleep({77: 600, 78: 2.5, 79: 1.0}.get(cand.spec.K, 0))  # (77 hangs; 79 then 78: slow, not hung)
    return dict(id=cid, so=cid + ".so"), None, 0.01
