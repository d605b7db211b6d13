"""Per-task search: what a task has measured, and which candidates to measure next.

A ``TaskState`` holds one task's measurements on the tuning GPU, keyed by the candidate's *effective* knobs
(``KernelSpace.effective``: two points the builder turns into the same kernel are one candidate), so nothing is
measured twice -- in this run or in the log it resumes from. Failed candidates (mismatch, build or run error) stay
in it, so they are never proposed again, and never become the best.

``propose(state, n, model, seed, ...)`` returns up to ``n`` new candidates:

1. the baseline first: the space's default knobs for the shape (what an untuned layer gets), then the knobs the logs
   gave when the tasks were extracted where they differ (the shipped records: the tuner starts from them);
2. the space's start points (``KernelSpace.configs``: a short table of the forms that won most often elsewhere, those
   legal for the shape) not measured yet -- ranked by the cost model where it has data -- unless ``configs`` is off;
3. to fill the round, a pool of fresh legal points -- ``pool`` draws from ``KernelSpace.sample`` and, once something is measured,
   neighbours of the best measured candidates (one knob changed to the value a fresh sample of the same MMA path
   has, kept where legal) -- without the candidates measured already;
4. the pool ranked by the cost model (``CostModel.score``; before the model has data, the pool's random order), the
   best ``n - n_eps`` taken, and ``n_eps = ceil(eps * n)`` more drawn at random from the rest (exploration: the
   model only knows what it has seen).

The random numbers come from ``numpy.random.default_rng((seed, task key hash, measurements so far))``: the proposals
are a function of the log and the seed, so a rerun with the same log proposes the same batch (what the offline
runner's export / import relies on).
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from .common import OK


@dataclass
class Entry:
    knobs: object
    status: str
    ms: Optional[float] = None
    variant: str = ""


@dataclass
class TaskState:
    task: object  # tasks.Task
    space: object  # schedules.space.KernelSpace, or None (no space declared for the strategy: not tunable)
    measured: dict = field(default_factory=dict)  # knobs id -> Entry
    default_id: Optional[str] = None
    rounds: int = 0  # search rounds spent on this task in this run (the baseline not counted)
    gains: list = field(default_factory=list)  # relative improvement of the best time, per round
    trials: int = 0  # candidates measured in this run
    exhausted: bool = False  # the last proposal found nothing new
    sms: Optional[int] = None  # the tuning GPU's SM count (a cost-model feature)

    @property
    def spec(self):
        return self.task.spec

    @property
    def arch(self):
        return self.task.arch

    def knobs_id(self, knobs) -> str:
        return self.space.point_id(self.spec, self.arch, knobs)

    def add(self, knobs, status: str, ms: Optional[float], variant: str = "") -> str:
        kid = self.knobs_id(knobs)
        have = self.measured.get(kid)
        # (one candidate measured twice -- a resumed log holding both -- keeps its best OK time)
        if have is None or (status == OK and (have.status != OK or (ms or math.inf) < (have.ms or math.inf))):
            self.measured[kid] = Entry(knobs, status, ms, variant or (have.variant if have else ""))
        if variant == "default":
            self.default_id = kid
        return kid

    def ok(self) -> list:
        return [e for e in self.measured.values() if e.status == OK and e.ms]

    @property
    def default_ms(self) -> Optional[float]:
        e = self.measured.get(self.default_id) if self.default_id else None
        return e.ms if e is not None and e.status == OK else None

    @property
    def best(self) -> Optional[Entry]:
        ok = self.ok()
        return min(ok, key=lambda e: e.ms) if ok else None

    @property
    def best_ms(self) -> Optional[float]:
        b = self.best
        return b.ms if b else None

    @property
    def tunable(self) -> bool:
        return self.space is not None


def _rng(seed: int, state: TaskState) -> np.random.Generator:
    h = int(hashlib.sha1(f"{state.task.key}|{state.task.strategy}".encode()).hexdigest()[:8], 16)
    return np.random.default_rng((seed, h, len(state.measured)))


def legal(space, spec, arch, knobs) -> bool:
    """The space's legality (``KernelSpace.legal``); a point it raises on counts as illegal."""
    try:
        return space.legal(spec, arch, knobs) is None
    except Exception:  # noqa: BLE001  (a legality function that fails on a point: the point is not built)
        return False


def _kind(knobs) -> tuple:
    """What a neighbour keeps: the MMA path of GemmKnobs (values of one path are not another's: BN 112 is a wgmma
    tile)."""
    return (getattr(knobs, "mma", None),)


def neighbours(space, spec, arch, knobs, rng: np.random.Generator, n: int) -> list:
    """Up to ``n`` legal points that differ from ``knobs`` in one knob: a random knob takes the value it has in a
    fresh random legal point of the same MMA path (``KernelSpace.sample`` draws values the kernels' structure allows,
    so a neighbour moves within it)."""
    out = []
    dims = [k for k, v in space.dims.items() if len(v) > 1]
    for _ in range(4 * n):
        if len(out) >= n or not dims:
            break
        other = space.sample(rng, spec, arch, tries=200)
        if other is None or _kind(other) != _kind(knobs):
            continue
        k = dims[int(rng.integers(len(dims)))]
        v = getattr(other, k)
        if v == getattr(knobs, k):
            continue
        try:
            cand = dataclasses.replace(knobs, **{k: v})
        except (TypeError, ValueError):
            continue
        if legal(space, spec, arch, cand):
            out.append(cand)
    return out


def baseline(state: TaskState) -> list:
    """The task's baseline not measured yet: the space's default knobs for the shape, then the knobs the logs gave
    when the tasks were extracted (where they differ and are legal)."""
    if not state.tunable:
        return []
    spec, arch, space = state.spec, state.arch, state.space
    out, ids = [], set(state.measured)
    cands = [space.default(spec, arch)]
    planned = state.task.planned_knobs
    if planned is not None and isinstance(planned, space.knobs_type) and legal(space, spec, arch, planned):
        cands.append(planned)
    for kn in cands:
        kid = state.knobs_id(kn)
        if kid not in ids:
            ids.add(kid)
            out.append(kn)
    return out


def searched(state: TaskState) -> bool:
    """Whether anything beyond the baseline (the default and the planned knobs) is measured for the task, in this run
    or the log it resumes."""
    base = {state.default_id}
    planned = state.task.planned_knobs
    if state.tunable and planned is not None and isinstance(planned, state.space.knobs_type):
        base.add(state.knobs_id(planned))
    return any(kid not in base for kid in state.measured)


def starts(state: TaskState, model=None) -> list:
    """The task's start points (``KernelSpace.configs``) not measured yet, the cost model's favourites first where
    it has data for the strategy (else the table's order)."""
    if not state.tunable:
        return []
    cands = [kn for kn in state.space.configs(state.spec, state.arch, state.sms)
             if state.knobs_id(kn) not in state.measured]
    if model is not None and len(cands) > 1 and model.trained(state.space.strategy):
        scores = model.score(state.space, state.spec, state.arch, cands, state.sms)
        cands = [cands[i] for i in np.argsort(-np.asarray(scores), kind="stable")]
    return cands


def propose(state: TaskState, n: int, model=None, seed: int = 0, eps: float = 0.1, pool: int = 48,
            top: int = 4, pending=frozenset(), configs: bool = True) -> list:
    """Up to ``n`` new candidates (knobs) for ``state``'s task, the baseline first (see the module docstring);
    ``[]`` when nothing new turns up (the state is then marked exhausted). ``pending``: knobs ids (``knobs_id``) on
    their way to the runner in the same batch (not proposed again). ``configs``: take the space's start points
    before the pool."""
    if not state.tunable or n <= 0:
        return []
    spec, arch, space = state.spec, state.arch, state.space
    out, ids = [], set(state.measured) | set(pending)

    def take(kn) -> bool:
        if kn is None or len(out) >= n:
            return False
        kid = state.knobs_id(kn)
        if kid in ids:
            return False
        ids.add(kid)
        out.append(kn)
        return True

    for kn in baseline(state):
        take(kn)
    if out:  # (the baseline goes alone: the defaults' time is what the search is measured against)
        return out
    if configs:
        for kn in starts(state, model):
            take(kn)
    if len(out) >= n:
        return out
    rng = _rng(seed, state)
    cands, cids = [], set()
    best = sorted(state.ok(), key=lambda e: e.ms)[:top]
    for e in best:
        for kn in neighbours(space, spec, arch, e.knobs, rng, max(2, pool // (2 * max(1, len(best))))):
            kid = state.knobs_id(kn)
            if kid not in ids and kid not in cids:
                cids.add(kid)
                cands.append(kn)
    for _ in range(pool):
        kn = space.sample(rng, spec, arch)
        if kn is None:
            continue
        kid = state.knobs_id(kn)
        if kid not in ids and kid not in cids:
            cids.add(kid)
            cands.append(kn)
    if not cands:  # (nothing new in the pool: the start points taken above, if any, are the round)
        state.exhausted = not out
        return out
    state.exhausted = False
    order = list(rng.permutation(len(cands)))
    cands = [cands[i] for i in order]
    n_eps = min(len(cands), math.ceil(eps * n)) if eps > 0 else 0
    scores = model.score(space, spec, arch, cands, state.sms) if model is not None else np.zeros(len(cands))
    ranked = [cands[i] for i in np.argsort(-np.asarray(scores), kind="stable")]
    for kn in ranked[:max(0, n - n_eps)]:
        take(kn)
    rest = ranked[max(0, n - n_eps):]
    for i in rng.permutation(len(rest)):
        if len(out) >= n:
            break
        take(rest[int(i)])
    return out
