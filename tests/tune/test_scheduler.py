"""The task scheduler (qcompile.tune.scheduler): baseline first, trials where the whole model gains most, failures
recorded and never selected, budgets, the summary. Fake space / builder / runner: no GPU, no TIR."""
from __future__ import annotations

import json

import pytest
from fakes import fresh_logs  # noqa: F401  (the fixture)
from fakes import FakeBuilder, FakeRunner, Pending, cost_ms, fake_space, is_build_error, is_mismatch, make_task

from qcompile.schedules import tuning as TU
from qcompile.tune.scheduler import Tuner, format_summary
from qcompile.tune.tasks import set_shares

pytestmark = pytest.mark.usefixtures("fresh_logs")  # (no packaged logs, a fresh log cache: fakes.fresh_logs)


def _tuner(tasks, log, runner=None, builder=None, **kw):
    spaces = {"implicit_gemm": fake_space()}
    set_shares(tasks, measured=False)
    return Tuner(tasks, builder or FakeBuilder(), runner or FakeRunner(), log, spaces=spaces, log=lambda s: None,
                 **kw)


def _lines(log):
    return [json.loads(ln) for ln in log.read_text().splitlines()]


def test_baseline_first_and_trials_follow_the_model_time(tmp_path):
    """Every task's default knobs are measured first (in one batch); then a task with most of the model's time gets
    most of the rounds, the next one some; a tiny task gets rounds once the others' gains dry up (the optimistic
    term decays with the rounds a task got)."""
    big = make_task(N=64, H=56, C=64, K=64, layers=("l1a", "l1b", "l1c"), batch=64)
    mid = make_task(N=64, H=28, C=128, K=128, layers=("l2",), batch=64)
    tiny = make_task(N=64, H=7, C=512, K=512, R=1, layers=("l4",), batch=64)
    log = tmp_path / "t.jsonl"
    tu = _tuner([big, mid, tiny], log)
    s = tu.run(trials=60)
    recs = _lines(log)
    assert [r["variant"] for r in recs[:3]] == ["default"] * 3 and {r["key"] for r in recs[:3]} == {
        big.key, mid.key, tiny.key}
    assert s.trials == len(recs) == 60
    per = {t.key: sum(r["key"] == t.key for r in recs) for t in (big, mid, tiny)}
    assert per[big.key] > per[mid.key] > per[tiny.key] == 1 and per[mid.key] > 8, per
    tu = _tuner([big, mid, tiny], tmp_path / "long.jsonl")
    tu.run(trials=300)
    per = {st.task.key: st.trials for st in tu.states}
    assert per[big.key] > per[mid.key] and per[tiny.key] > 1, per
    assert abs(sum(t.share for t in (big, mid, tiny)) - 1) < 1e-9 and big.share > mid.share > tiny.share
    assert all(t.default_ms == pytest.approx(cost_ms(t.spec, fake_space().default(t.spec, t.arch)), rel=1e-5)
               for t in (big, mid, tiny))


def test_failures_are_recorded_never_selected(tmp_path):
    """Mismatches and build errors go to the log with their status (a build error never reaches the runner);
    knobs_for and the summary take the fastest OK record, which is the task's best measured time."""
    t = make_task(N=8, H=28, C=128, K=128)
    log = tmp_path / "t.jsonl"
    runner, builder = FakeRunner(), FakeBuilder()
    s = _tuner([t], log, runner, builder, eps=0.5).run(trials=120)
    recs = _lines(log)
    status = {r["status"] for r in recs}
    assert {"ok", "mismatch", "build_error"} <= status, status
    for r in recs:
        kn = TU.knobs_from_dict(r["knobs"])
        assert (r["status"] == "build_error") == is_build_error(kn)
        assert (r["status"] == "mismatch") == (is_mismatch(kn) and not is_build_error(kn))
        assert (r["ms"] is None) == (r["status"] != "ok") and r["device"] == "Fake GPU" and r["sms"] == 132
    assert not any(is_build_error(c.knobs) for c in runner.measured)
    best = min((r for r in recs if r["status"] == "ok"), key=lambda r: r["ms"])
    kn, src = TU.knobs_for(t.spec, "sm_90", "Fake GPU", [str(log)])
    assert src == "device" and kn == TU.knobs_from_dict(best["knobs"])
    row = s.rows[0]
    assert row["best_ms"] == pytest.approx(best["ms"]) and row["failed"] == sum(r["status"] != "ok" for r in recs)
    assert row["gain"] == pytest.approx(row["default_ms"] / row["best_ms"]) and row["gain"] > 1
    assert s.model_gain[8] == pytest.approx(row["gain"])
    table = format_summary(s)
    assert table.splitlines()[0].split()[:3] == ["task", "strategy", "share"] and "estimated whole-model gain" in table


def test_minutes_budget_and_exhaustion(tmp_path):
    """--minutes stops at the deadline (checked between rounds); a task whose space is used up drops out and the run
    ends early, every distinct candidate measured once."""
    now = [0.0]

    def clock():
        now[0] += 7.0  # (seconds per call)
        return now[0]

    t = make_task(N=8, H=28, C=128, K=128)
    s = _tuner([t], tmp_path / "a.jsonl", clock=clock).run(minutes=1.0)
    assert s.stop == "budget spent" and 0 < s.trials < 60
    small = make_task(N=2, H=2, C=64, K=64, R=1)  # (every BM builds one kernel: 48 points less the illegal ones)
    s = _tuner([small], tmp_path / "b.jsonl", pool=64).run(trials=500)
    recs = _lines(tmp_path / "b.jsonl")
    ids = [json.dumps(TU.knobs_to_dict(fake_space().effective(small.spec, "sm_90", TU.knobs_from_dict(r["knobs"]))),
                      sort_keys=True) for r in recs]
    assert s.stop.startswith("every task") and len(ids) == len(set(ids)) == s.trials < 48


def test_records_carry_the_seconds_since_the_run_started(tmp_path):
    """``elapsed_s``: the tuner's clock when a batch's measurements came back, less its clock when it was made; one
    value for the records of one batch, rising from batch to batch; a resumed run counts from its own start."""
    now = [100.0]

    def clock():
        now[0] += 2.0
        return now[0]

    t = make_task(N=8, H=28, C=128, K=128)
    log = tmp_path / "e.jsonl"
    _tuner([t], log, clock=clock, batch=4).run(trials=13)
    recs = _lines(log)
    el = [r["elapsed_s"] for r in recs]
    assert all(isinstance(e, float) and e > 0 for e in el) and el == sorted(el)
    assert el[1:5] == [el[1]] * 4 and el[5] > el[1] > el[0]  # (the default alone, then batches of 4)
    _tuner([t], log, clock=clock, batch=4).run(trials=4)
    more = _lines(log)[len(recs):]
    assert more and max(r["elapsed_s"] for r in more) < el[-1]


def test_arch_mismatch_is_refused(tmp_path):
    from qcompile.errors import QCompileError

    with pytest.raises(QCompileError, match="sm_80"):
        _tuner([make_task()], tmp_path / "t.jsonl", FakeRunner(arch="sm_80")).run(trials=4)
    with pytest.raises(QCompileError, match="budget"):
        _tuner([make_task()], tmp_path / "t.jsonl").run()


def test_several_tasks_per_round_measured_together(tmp_path):
    """``tasks_per_round``: the rounds of the T tasks of largest gradient are one batch for the builder and runner
    (one offline export, or every GPU of an rpc key busy), the last baseline batch included; each task still gets
    ``batch`` candidates of its own."""
    tasks = [make_task(N=64, H=h, C=c, K=c, layers=(f"l{h}",), batch=64) for h, c in ((56, 64), (28, 128), (14, 256))]
    runner = FakeRunner()
    tu = _tuner(tasks, tmp_path / "t.jsonl", runner=runner, batch=4, tasks_per_round=3)
    tu.run(trials=3 + 24)
    recs = _lines(tmp_path / "t.jsonl")
    assert len(recs) == 27 and [r["variant"] for r in recs[:3]] == ["default"] * 3
    assert all(sum(r["key"] == t.key for r in recs[3:]) >= 6 for t in tasks)
    # the baseline and the first round of the three tasks in one batch (a task may have fewer new proposals)
    first = runner.batches[0]
    assert {c.key for c in first[:3]} == {t.key for t in tasks} and 3 + 9 <= len(first) <= 3 + 12
    assert len({c.key for c in runner.batches[1]}) == 3 and all(st.rounds >= 2 for st in tu.states)


def test_every_task_gets_its_start_points_before_the_gradient(tmp_path, monkeypatch):
    """With start points, each task of at least FIRST_SHARE of the model's time gets one round (largest share first)
    before any task gets a second; a tiny task below FIRST_SHARE waits for the gradient; a resumed run does not owe
    those rounds again; ``configs=False`` lets the gradient pick from the first round."""
    from fakes import CONFIGS

    from qcompile.tune import scheduler as S

    big = make_task(N=64, H=56, C=64, K=64, layers=("l1a", "l1b", "l1c"), batch=64)
    mid = make_task(N=64, H=28, C=128, K=128, layers=("l2",), batch=64)
    small = make_task(N=64, H=14, C=128, K=128, layers=("l3",), batch=64)
    tiny = make_task(N=64, H=2, C=64, K=64, R=1, layers=("l4",), batch=64)
    monkeypatch.setattr(S, "FIRST_SHARE", 0.08)
    log = tmp_path / "s.jsonl"
    spaces = {"implicit_gemm": fake_space(configs=True)}
    tasks = [tiny, small, mid, big]
    set_shares(tasks, measured=False)
    tu = Tuner(tasks, FakeBuilder(), FakeRunner(), log, spaces=spaces, log=lambda s: None, batch=4)
    tu.run(trials=4 + 3 * 4)
    assert tiny.share < S.FIRST_SHARE <= min(t.share for t in (small, mid, big))
    rounds = [r["key"] for r in _lines(log)[4:]]
    order = sorted((big, mid, small), key=lambda t: -t.share)
    assert rounds == [t.key for t in order for _ in range(4)]
    cfg = {tu.states[0].knobs_id(k) for k in CONFIGS[1:]}
    assert all(cfg <= set(st.measured) for st in tu.states if st.task is not tiny)
    again = Tuner(tasks, FakeBuilder(), FakeRunner(), log, spaces=spaces, log=lambda s: None, batch=4)
    again.device = again.runner.device()
    again.resume()
    again._shares()
    assert not any(again.first_round(st) for st in again.states)
    short = tmp_path / "short.jsonl"  # (a round shorter than the start points: resuming does not owe it again)
    Tuner(tasks, FakeBuilder(), FakeRunner(), short, spaces=spaces, log=lambda s: None, batch=2).run(trials=4 + 3 * 2)
    resumed = Tuner(tasks, FakeBuilder(), FakeRunner(), short, spaces=spaces, log=lambda s: None, batch=2)
    resumed.device = resumed.runner.device()
    resumed.resume()
    resumed._shares()
    assert not any(resumed.first_round(st) for st in resumed.states if st.task is not tiny)
    plain = Tuner(tasks, FakeBuilder(), FakeRunner(), tmp_path / "p.jsonl", spaces=spaces, log=lambda s: None,
                  batch=4, configs=False)
    plain.run(trials=4 + 3 * 4)
    plain_rounds = _lines(tmp_path / "p.jsonl")[4:]
    assert [r["key"] for r in plain_rounds[:4]] == [big.key] * 4  # (the gradient: the largest task, again and again)
    assert not {json.dumps(r["knobs"], sort_keys=True) for r in plain_rounds} & {
        json.dumps(dict(tu.states[0].space.to_dict(k)), sort_keys=True) for k in CONFIGS}


def test_time_is_split_between_building_and_measuring(tmp_path):
    """The summary's ``spent``: the builder's and the runner's wall seconds, the cost model's training and the
    candidates built, from the tuner's clock; ``format_time`` states them with the runner's per-candidate phases."""
    from qcompile.tune.scheduler import format_time

    now = [0.0]

    class SlowBuilder(FakeBuilder):
        def build(self, cands):
            now[0] += 2.0 * len(cands)
            return super().build(cands)

    class SlowRunner(FakeRunner):
        def measure(self, built):
            now[0] += 0.5 * len(built)
            return super().measure(built)

    t = make_task(N=8, H=28, C=128, K=128)
    s = _tuner([t], tmp_path / "t.jsonl", SlowRunner(), SlowBuilder(), clock=lambda: now[0]).run(trials=20)
    recs = _lines(tmp_path / "t.jsonl")
    ran = sum(r["status"] != "build_error" for r in recs)
    assert s.spent["built"] == len(recs) == 20
    assert s.spent["build"] == pytest.approx(2.0 * 20) and s.spent["measure"] == pytest.approx(0.5 * ran)
    class DeferringRunner(SlowRunner):  # (the offline runner's export: the batch goes elsewhere, its time counts)
        def measure(self, built):
            now[0] += 1.5
            raise Pending("exported")

    d = _tuner([make_task(N=8, H=14, C=256, K=256)], tmp_path / "d.jsonl", DeferringRunner(), SlowBuilder(),
               clock=lambda: now[0], pending=(Pending,)).run(trials=20)
    assert d.deferred and d.spent["measure"] == pytest.approx(1.5) and d.spent["built"] == 1
    line = format_time(s.spent, [dict(setup=1.0, check=0.5), dict(setup=3.0, check=0.5, time=0.25)])
    assert line == ("time: building 40 s (20 candidates, 2.00 s each), measuring "
                    f"{0.5 * ran:.0f} s (2 candidates; per candidate, s: setup 2.000, check 0.500, time 0.125)")

    class SlowModel:  # (the cost model's retraining, once after the baseline and once a round: its own time)
        fits = 0

        def fit(self):
            now[0] += 3.0
            self.fits += 1

        def add_records(self, *a, **k):
            return 0

        def add(self, *a, **k):
            pass

        def trained(self, strategy):
            return False

        def score(self, space, spec, arch, knobs_list, sms=None):
            return [0.0] * len(knobs_list)

    model = SlowModel()
    m = _tuner([make_task(N=8, H=7, C=512, K=512)], tmp_path / "m.jsonl", SlowRunner(), SlowBuilder(),
               clock=lambda: now[0], model=model).run(trials=20)
    assert model.fits >= 3 and m.spent["model"] == pytest.approx(3.0 * model.fits)
    assert m.spent["build"] == pytest.approx(2.0 * 20) and m.spent["built"] == 20
    assert format_time(m.spent).endswith(f", training the cost model {3.0 * model.fits:.0f} s")


def test_several_models_tune_a_shared_task_once(tmp_path):
    """Tasks of two models (merge_models): the shared task's baseline is measured once; the summary gives the
    estimated gain of each model at its batch size, each from its own shares."""
    from qcompile.tune.tasks import merge_models

    a = [make_task(N=8, H=28, C=128, K=128, layers=("a2",)), make_task(N=8, H=14, C=256, K=256, layers=("a3",))]
    b = [make_task(N=8, H=28, C=128, K=128, layers=("b2",)), make_task(N=8, H=7, C=512, K=512, layers=("b4",))]
    tasks = merge_models([a, b], ["A", "B"])
    s = _tuner(tasks, tmp_path / "t.jsonl", eps=0.5).run(trials=120)
    recs = _lines(tmp_path / "t.jsonl")
    base = [r["key"] for r in recs if r["variant"] == "default"]
    assert sorted(base) == sorted({t.key for t in tasks}) and len(base) == 3
    assert set(s.model_gain) == {("A", 8), ("B", 8)}
    ratio = {r["key"]: r["best_ms"] / r["default_ms"] for r in s.rows}
    assert min(ratio.values()) < 1  # (something was gained)
    dflt = {t.key: cost_ms(t.spec, fake_space().default(t.spec, t.arch)) for t in a + b}  # (the fake GPU's times)
    for m, ts in (("A", a), ("B", b)):  # (each model alone: its layers' default times, its own shares)
        total = sum(t.weight * dflt[t.key] for t in ts)
        want = 1 / sum(t.weight * dflt[t.key] / total * ratio[t.key] for t in ts)
        assert s.model_gain[(m, 8)] == pytest.approx(want)
    assert [r["layers"] for r in recs if r["key"] == tasks[0].key][0] == 2  # (the shared task: both models' layers)
    assert "(2 models)" in format_summary(s) and "A batch 8: estimated whole-model gain" in format_summary(s)


def test_first_round_goes_by_the_share_in_the_model_it_weighs_most_in(tmp_path):
    """With several models a task gets its first round where its share of one model is at least FIRST_SHARE, even
    where its mean over the models is below it."""
    from qcompile.tune import scheduler as S

    t = make_task(N=8, H=28, C=128, K=128)
    spaces = {"implicit_gemm": fake_space(configs=True)}
    tu = Tuner([t], FakeBuilder(), FakeRunner(), tmp_path / "t.jsonl", spaces=spaces, log=lambda s: None)
    st = tu.states[0]
    t.share, t.extra["model_share"] = S.FIRST_SHARE / 2, S.FIRST_SHARE * 1.5
    assert tu.first_round(st)
    t.extra["model_share"] = S.FIRST_SHARE / 2
    assert not tu.first_round(st)
