"""The contract between the tuner's search (tasks, cost model, scheduler), its builders and its runners.

    search --[Candidate]--> Builder.build --[Built]--> Runner.measure --[Measured]--> search (records, cost model)

A ``Candidate`` is one point of a kernel space (``qcompile.schedules.space``) for one task (a conv shape as the
compiler looks it up: ``tuning_key(spec)``). A ``Built`` candidate is a shared library in a batch folder plus the
manifest entry that says how to call it (``PlannedKernel``'s calling convention, as plain JSON) -- everything the
measuring side needs with only the TVM runtime and NumPy. A ``Measured`` candidate carries the median time of the
kernels of one layer (ms), or why there is none.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, field

from qcompile.schedules.spec import ConvSpec

# Measured.status values
OK = "ok"  # bit-exact and timed
MISMATCH = "mismatch"  # ran, output differs from the NumPy reference: recorded, never chosen
BUILD_ERROR = "build_error"  # refused or failed on the host (legality, TIR, nvcc)
RUN_ERROR = "run_error"  # failed to load or launch on the GPU (or timed out)
STATUSES = (OK, MISMATCH, BUILD_ERROR, RUN_ERROR)


@dataclass(frozen=True)
class Candidate:
    key: str  # the task: schedules.tuning.tuning_key(spec)
    spec: ConvSpec
    arch: str  # sm_XX
    strategy: str  # schedules.STRATEGIES
    knobs: object  # the space's knobs dataclass (GemmKnobs, KtKnobs, HaloKnobs)


@dataclass
class Built:
    candidate: Candidate
    path: str | None  # the .so (None: not built)
    entry: dict = field(default_factory=dict)  # the manifest entry: spec, strategy, knobs, calling convention
    error: str | None = None
    build_s: float = 0.0  # host seconds spent building it


@dataclass
class Measured:
    candidate: Candidate
    status: str  # one of STATUSES
    ms: float | None = None  # median time of the layer's kernels, one launch (ms)
    detail: str = ""  # why not OK (first line of the error, or the mismatch count)
    device: str = ""  # e.g. "NVIDIA H100 80GB HBM3"
    sms: int | None = None


@dataclass(frozen=True)
class DeviceInfo:
    name: str  # "NVIDIA H100 80GB HBM3"
    arch: str  # "sm_90"
    sms: int  # multiprocessors
    smem_per_block: int | None = None  # bytes (opt-in maximum)


class Builder(abc.ABC):
    @abc.abstractmethod
    def build(self, cands: list[Candidate]) -> list[Built]:
        """Build every candidate (in parallel where it can), in order; failures come back as Built.error."""


class Runner(abc.ABC):
    @abc.abstractmethod
    def device(self) -> DeviceInfo:
        """The GPU the measurements are made on (queried from the device itself)."""

    @abc.abstractmethod
    def measure(self, built: list[Built]) -> list[Measured]:
        """Check each built candidate bit for bit against the NumPy reference on fresh random inputs, then time the
        exact ones; one Measured per Built, in order."""
