"""Per-task search (qcompile.tune.search): baseline first, dedupe by effective knobs and by what was measured,
failures never proposed again, deterministic proposals. Fake space, no GPU."""
from __future__ import annotations

from fakes import CONFIGS, fake_space, make_task

from qcompile.schedules.spec import GemmKnobs
from qcompile.tune.search import TaskState, baseline, propose


def _state(**kw):
    st = TaskState(make_task(**kw), fake_space())
    st.default_id = st.knobs_id(st.space.default(st.spec, st.arch))
    return st


def test_baseline_first_then_the_planned_knobs():
    st = _state()
    assert propose(st, 8) == [GemmKnobs(BM=128, BN=128, BK=64, stages=3)]  # (the baseline goes alone)
    st.task.planned_knobs = GemmKnobs(BM=64, BN=128, BK=64, stages=4)
    assert baseline(st) == [GemmKnobs(BM=128, BN=128, BK=64, stages=3), GemmKnobs(BM=64, BN=128, BK=64, stages=4)]
    for kn in baseline(st):
        st.add(kn, "ok", 1.0)
    assert baseline(st) == [] and st.default_ms == 1.0
    nxt = propose(st, 8)
    assert len(nxt) == 8 and not {st.knobs_id(k) for k in nxt} & set(st.measured)


def test_dedupe_by_effective_knobs_until_exhausted():
    """A tiny problem (8 GEMM rows): every BM builds the 32-row kernel, so the space has |BN| x |BK| x |stages| = 48
    distinct candidates (less the illegal ones); rounds of proposals never repeat one, measured or failed, and end
    empty with the state exhausted."""
    st = _state(N=2, H=2, C=64, K=64, R=1)
    seen = []
    for _ in range(40):
        cands = propose(st, 8, seed=3, pool=64)
        if not cands:
            break
        for i, kn in enumerate(cands):
            kid = st.knobs_id(kn)
            assert kid not in st.measured and kid not in seen
            seen.append(kid)
            st.add(kn, "mismatch" if i % 3 == 0 else "ok", None if i % 3 == 0 else 1.0 + i)
    assert st.exhausted and propose(st, 8, seed=3) == []
    assert len(seen) == len(st.measured) <= 48 and len({k for k in seen}) == len(seen)
    assert st.best.status == "ok" and st.best_ms == 1.0 + min(i for i in range(8) if i % 3)


def test_proposals_are_a_function_of_the_measurements_and_seed():
    a, b = _state(), _state()
    for st in (a, b):
        for kn in baseline(st):
            st.add(kn, "ok", 1.0)
    assert propose(a, 8, seed=1) == propose(b, 8, seed=1)
    assert propose(a, 8, seed=1) != propose(_with_baseline(_state()), 8, seed=2)


def _with_baseline(st):
    for kn in baseline(st):
        st.add(kn, "ok", 1.0)
    return st


def test_start_points_follow_the_baseline_legal_and_distinct():
    """After the baseline, a round takes the space's start points first (the illegal one skipped; on a tiny shape two
    that build one kernel count once), fills the rest from the pool, and never proposes them again; without
    ``configs`` the round comes from the pool alone."""
    st = TaskState(make_task(), fake_space(configs=True))
    _with_baseline(st)
    cands = propose(st, 8, seed=1)
    assert cands[:3] == list(CONFIGS[1:]) and len(cands) == 8
    for kn in cands:
        st.add(kn, "ok", 2.0)
    assert not set(map(st.knobs_id, CONFIGS[1:])) & {st.knobs_id(k) for k in propose(st, 8, seed=1)}
    tiny = TaskState(make_task(N=2, H=2, C=64, K=64, R=1), fake_space(configs=True))
    assert tiny.space.configs(tiny.spec, tiny.arch) == [CONFIGS[1], CONFIGS[3]]  # (BM 64 and 32: one kernel)
    plain = _with_baseline(TaskState(make_task(), fake_space(configs=True)))
    assert propose(plain, 8, seed=1, configs=False) == propose(_with_baseline(_state()), 8, seed=1)


def test_start_points_survive_an_empty_pool():
    """A task whose pool has nothing new still gets its start points (not dropped as exhausted)."""
    import dataclasses

    one = dataclasses.replace(fake_space(configs=True), dims={"BM": (128,), "BN": (128,), "BK": (64,), "stages": (3,)})
    st = _with_baseline(TaskState(make_task(), one))  # (every sample is the measured default: the pool is empty)
    got = propose(st, 8, seed=1)
    assert got == list(CONFIGS[1:]) and not st.exhausted
    for kn in got:
        st.add(kn, "ok", 2.0)
    assert propose(st, 8, seed=1) == [] and st.exhausted
