"""Resume (qcompile.tune.scheduler): rerunning with the same log measures nothing it holds; a run stopped by an
offline export picks up where it stopped and proposes the same batch. Fakes only: no GPU."""
from __future__ import annotations

import json
import shutil

import pytest
from fakes import fresh_logs  # noqa: F401  (the fixture)
from fakes import FakeBuilder, FakeRunner, Pending, fake_space, make_task

from qcompile.schedules import tuning as TU
from qcompile.tune.scheduler import Tuner
from qcompile.tune.tasks import set_shares

pytestmark = pytest.mark.usefixtures("fresh_logs")  # (no packaged logs, a fresh log cache: fakes.fresh_logs)


def _tasks():
    ts = [make_task(N=8, H=28, C=128, K=128, layers=("a",)), make_task(N=8, H=14, C=256, K=256, layers=("b", "c"))]
    set_shares(ts, measured=False)
    return ts


def _run(log, trials, runner=None, model=None):
    runner = runner or FakeRunner()
    tu = Tuner(_tasks(), FakeBuilder(), runner, log, spaces={"implicit_gemm": fake_space()}, log=lambda s: None,
               model=model, pending=(Pending,))
    return tu, tu.run(trials=trials), runner


def _ids(log):
    sp = fake_space()
    out = []
    for ln in log.read_text().splitlines():
        r = json.loads(ln)
        kn = TU.knobs_from_dict(r["knobs"])
        out.append((r["key"], json.dumps(TU.knobs_to_dict(sp.effective(TU.spec_from_key(r["key"]), "sm_90", kn)),
                                         sort_keys=True)))
    return out


def test_rerun_with_the_same_log_measures_nothing_twice(tmp_path):
    log = tmp_path / "t.jsonl"
    _, s1, _ = _run(log, 30)
    first = _ids(log)
    tu, s2, runner = _run(log, 30)
    ids = _ids(log)
    assert s1.trials == s2.trials == 30 and len(ids) == 60 and len(set(ids)) == 60
    assert not any(json.loads(ln)["variant"] == "default" for ln in log.read_text().splitlines()[30:])  # (resumed)
    assert all(st.default_ms for st in tu.states) and set(ids[:30]) == set(first)
    # the resumed best is the log's best
    for st in tu.states:
        kn, src = TU.knobs_for(st.spec, "sm_90", "Fake GPU", [str(log)])
        assert src == "device" and st.best_ms == min(json.loads(ln)["ms"] or 1e9 for ln in log.read_text().splitlines()
                                                     if json.loads(ln)["key"] == st.task.key)
    # another GPU's records are not this GPU's measurements: measured again on it
    _, s3, runner = _run(log, 4, FakeRunner(name="Other GPU"))
    assert [c.knobs for c in runner.measured[:2]] == [fake_space().default(None, "sm_90")] * 2


def test_offline_export_stops_and_the_rerun_proposes_the_same_batch(tmp_path):
    """A runner that exports (raises its pending exception) stops the run with what it recorded; a rerun with the
    same log proposes exactly the exported batch first (proposals are a function of the log and the seed)."""
    log = tmp_path / "t.jsonl"
    _run(log, 10)  # (baseline and a round, recorded)
    saved = tmp_path / "saved.jsonl"
    shutil.copy(log, saved)
    tu, s, runner = _run(log, 40, FakeRunner(defer_after=0))
    assert s.deferred and "exported" in s.stop and s.trials == 0 and log.read_text() == saved.read_text()
    exported = [c.knobs for c in tu.builder.built]
    tu, s, runner = _run(log, 40)
    assert [c.knobs for c in tu.builder.built[:len(exported)]] == exported and s.trials == 40


def test_resume_with_the_cost_model_is_deterministic(tmp_path):
    """The cost model (XGBoost) trained on the log: two runs from copies of one log propose and measure the same."""
    pytest.importorskip("xgboost")
    from qcompile.tune.cost_model import CostModel

    log = tmp_path / "t.jsonl"
    _run(log, 24, model=CostModel())
    shutil.copy(log, tmp_path / "u.jsonl")
    _, _, ra = _run(log, 16, model=CostModel())
    _, _, rb = _run(tmp_path / "u.jsonl", 16, model=CostModel())
    assert [c.knobs for c in ra.measured] == [c.knobs for c in rb.measured] and len(ra.measured) == 16


class _ImportingRunner(FakeRunner):
    """An offline runner whose imported results hold ``measured`` (a batch cut short: some of a run's candidates)."""

    def __init__(self, measured):
        super().__init__()
        self._imported = list(measured)

    def imported(self):
        return self._imported


def test_imported_results_cut_short_are_merged_not_measured_again(tmp_path):
    """Measurements a runner imported (here: 7 of a run's 20, as a cut batch's results file holds them) are written
    to the log before anything is proposed, counted as trials, and never built or measured again."""
    _, _, first = _run(tmp_path / "a.jsonl", 20)
    src = FakeRunner()
    got = src.measure([__import__("qcompile.tune.common", fromlist=["Built"]).Built(c, "/fake/x.so")
                       for c in first.measured[:7]])
    runner = _ImportingRunner(got)
    log = tmp_path / "b.jsonl"
    tu, s, runner = _run(log, 20, runner)
    lines = [json.loads(ln) for ln in log.read_text().splitlines()]
    assert len(lines) == 20 and s.trials == 20
    imported = {(c.key, json.dumps(TU.knobs_to_dict(c.knobs), sort_keys=True)) for c in first.measured[:7]}
    head = {(r["key"], json.dumps(r["knobs"], sort_keys=True)) for r in lines[:7]}
    assert head == imported  # (merged first, as they were measured)
    again = {(c.key, json.dumps(TU.knobs_to_dict(c.knobs), sort_keys=True)) for c in runner.measured}
    assert not (again & imported) and len(runner.measured) == 13
