"""The tuner's cost model: XGBoost trees that rank a task's candidates by predicted speed.

Inputs are a kernel space's features (``KernelSpace.features(spec, arch, knobs)``: the shape, the knobs, derived
sizes such as waves over the SMs and shared memory). The target is relative log throughput within a group -- the
candidates of one task measured on one GPU (one tuning round, for the committed data): ``y = mean(log ms) - log ms``
over the group, so +0.1 means about 10% faster than the group's typical candidate. Centring per group is what lets
measurements of other shapes, batch sizes and GPUs (records in other logs: transfer) train the model for a new task:
their absolute times differ by orders of magnitude, their relative order of knobs is what carries over. With
``objective="rank"`` XGBoost's pairwise ranking (``rank:pairwise``, one query per group) is trained on the same
groups instead; ``"reg"`` (squared error on ``y``) ranks as well on the committed H100 data and is the default.

One model per kernel space (its features differ), retrained from scratch on every ``fit`` (hundreds to a few
thousand rows: under a second on one thread). Deterministic: fixed seed, one thread, histogram trees.

``xgboost`` is imported when a model is first trained; without it, ``CostModel.fit`` raises ``QCompileError`` naming
the extra that installs it (``pip install 'qcompile[tune]'``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from qcompile.errors import QCompileError

INSTALL_HINT = "pip install 'qcompile[tune]'"


def _xgboost():
    try:
        import xgboost
    except ImportError as e:  # (ModuleNotFoundError, or a broken install)
        raise QCompileError(f"the tuner's cost model needs XGBoost ({e}): {INSTALL_HINT}") from None
    return xgboost


@dataclass
class _Data:
    X: list = field(default_factory=list)
    logms: list = field(default_factory=list)
    group: list = field(default_factory=list)  # group id per row


@dataclass
class CostModel:
    """Rank candidates of a kernel space by predicted speed (higher score: faster).

    ``add(space, spec, arch, knobs, ms, group, sms)`` adds one OK measurement (``group``: any hashable naming the
    task and GPU; ``sms``: the GPU's SM count, a feature); ``fit()`` retrains the boosters of the spaces that got data
    since the last fit; ``score(space, spec, arch, knobs_list, sms)`` returns one score per candidate (all zeros for a
    space with no model yet: the caller's order then decides -- random, for the search)."""

    seed: int = 0
    objective: str = "reg"  # "reg" | "rank"
    rounds: int = 120
    max_depth: int = 6
    eta: float = 0.15
    nthread: int = 1  # (OpenMP threads spin: 2 threads on a busy 2-core host train 20-50x slower than 1)
    min_rows: int = 8  # a space trains once it has this many rows in groups of two or more
    _data: dict = field(default_factory=dict)  # strategy -> _Data
    _models: dict = field(default_factory=dict)  # strategy -> Booster
    _dirty: set = field(default_factory=set)
    _groups: dict = field(default_factory=dict)

    def add(self, space, spec, arch: str, knobs, ms: float, group, sms: int | None = None) -> None:
        if not (ms and ms > 0 and math.isfinite(ms)):
            return
        d = self._data.setdefault(space.strategy, _Data())
        d.X.append(space.features(spec, arch, knobs, sms=sms))
        d.logms.append(math.log(ms))
        d.group.append(self._groups.setdefault(group, len(self._groups)))
        self._dirty.add(space.strategy)

    def rows(self, strategy: str) -> int:
        d = self._data.get(strategy)
        return len(d.X) if d else 0

    def trained(self, strategy: str) -> bool:
        return strategy in self._models

    def _targets(self, d: _Data):
        g = np.asarray(d.group)
        y = np.asarray(d.logms, dtype=np.float64)
        out = np.zeros_like(y)
        keep = np.zeros(len(y), bool)
        for gid in np.unique(g):
            m = g == gid
            if m.sum() >= 2:  # (a lone measurement says nothing about the order of knobs)
                out[m] = y[m].mean() - y[m]
                keep[m] = True
        return out, keep, g

    def fit(self) -> None:
        for strategy in sorted(self._dirty):
            d = self._data[strategy]
            y, keep, g = self._targets(d)
            if keep.sum() < self.min_rows:
                continue
            xgb = _xgboost()
            X = np.asarray(d.X, dtype=np.float32)[keep]
            y, g = y[keep], g[keep]
            params = {"max_depth": self.max_depth, "eta": self.eta, "subsample": 1.0, "colsample_bytree": 1.0,
                      "min_child_weight": 1.0, "seed": self.seed, "nthread": self.nthread, "tree_method": "hist",
                      "verbosity": 0}
            if self.objective == "rank":
                order = np.argsort(g, kind="stable")
                X, y, g = X[order], y[order], g[order]
                rel = np.zeros(len(y), np.float32)  # relevance: the candidate's rank in its group, 0 the slowest
                for gid in np.unique(g):
                    m = np.flatnonzero(g == gid)
                    rel[m[np.argsort(y[m], kind="stable")]] = np.arange(len(m))
                dm = xgb.DMatrix(X, label=rel, qid=g, nthread=self.nthread)
                params.update(objective="rank:pairwise", ndcg_exp_gain=False)
            else:
                dm = xgb.DMatrix(X, label=y, nthread=self.nthread)
                params.update(objective="reg:squarederror")
            self._models[strategy] = xgb.train(params, dm, num_boost_round=self.rounds)
        self._dirty.clear()

    def score(self, space, spec, arch: str, knobs_list: list, sms: int | None = None) -> np.ndarray:
        if not knobs_list:
            return np.zeros(0)
        model = self._models.get(space.strategy)
        if model is None:
            return np.zeros(len(knobs_list))
        xgb = _xgboost()
        X = np.asarray([space.features(spec, arch, k, sms=sms) for k in knobs_list], dtype=np.float32)
        return model.predict(xgb.DMatrix(X, nthread=self.nthread))

    def add_records(self, records, spaces: dict, spec_of, group_of=None) -> int:
        """Train on tuning-log records (``schedules.tuning.Record``): the OK ones with a time, of the strategies in
        ``spaces``, grouped by ``group_of(record)`` (default: its device and key). ``spec_of(key)`` gives the ConvSpec
        (``schedules.tuning.spec_from_key``). Returns how many rows were added."""
        n = 0
        for r in records:
            sp = spaces.get(r.strategy)
            if sp is None or not r.ok or r.ms is None:
                continue
            try:
                spec = spec_of(r.key)
            except ValueError:
                continue
            self.add(sp, spec, r.arch, r.knobs, r.ms, group_of(r) if group_of else (r.device, r.key), r.sms)
            n += 1
        return n


# ---- ranking quality ---------------------------------------------------------------------------------------------
def spearman(a, b) -> float:
    """Spearman rank correlation of two equal-length sequences (ties: average ranks); 0 for fewer than 3 or a
    constant side."""
    a, b = np.asarray(a, float), np.asarray(b, float)
    if len(a) < 3:
        return 0.0

    def ranks(v):
        order = np.argsort(v, kind="stable")
        r = np.empty(len(v))
        r[order] = np.arange(len(v))
        for x in np.unique(v):  # (average the ranks of ties)
            m = v == x
            if m.sum() > 1:
                r[m] = r[m].mean()
        return r

    ra, rb = ranks(a), ranks(b)
    if ra.std() == 0 or rb.std() == 0:
        return 0.0
    return float(np.corrcoef(ra, rb)[0, 1])


def top_k_recall(scores, ms, k: int) -> float:
    """1 when the fastest candidate (least ``ms``) is among the ``k`` highest ``scores``, else 0."""
    scores, ms = np.asarray(scores, float), np.asarray(ms, float)
    top = np.argsort(-scores, kind="stable")[:k]
    return float(int(np.argmin(ms)) in set(top.tolist()))
