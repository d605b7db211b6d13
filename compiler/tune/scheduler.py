"""The task scheduler: spends a trial budget across a model's tasks where the whole model gains most.

``Tuner(tasks, builder, runner, log_path, ...).run(trials=N | minutes=M)``:

A runner whose measurements happen elsewhere (the offline runner's export) raises one of ``pending`` from ``measure``:
the run stops there, with what it recorded; rerunning with the same log (the results imported) proposes the same
batch again -- proposals are a function of the log and the seed -- and goes on.

1. **Resume.** The log (``-o LOG``) is read: this GPU's records of each task (same arch, device name, key and
   strategy family) become the task's measurements -- never measured again --, and every OK record of the log and of
   the ``transfer`` logs (other shapes, batch sizes, GPUs) trains the cost model first.
2. **Baseline.** Each task's default knobs (``KernelSpace.default``, what an untuned layer gets), and the knobs the
   packaged logs gave it where they differ, are measured first -- every task's in one batch, so the builder and the
   runner's GPUs work in parallel. The measured default times replace the roofline estimates in the tasks' shares.
3. **First rounds.** Every task of at least ``FIRST_SHARE`` of its model's time that has nothing measured beyond its
   baseline (in this run or the log it resumes) gets one round before the gradient decides, the largest first: its start points (``KernelSpace.configs``, the forms that won most often elsewhere)
   and, to fill the round, the cost model's picks (``search.propose``). ``configs=False`` (qtune ``--no-configs``)
   leaves both out: the gradient alone picks, from the first round on, and proposals come from the pool only.
4. **Rounds.** Each round picks ONE task (``tasks_per_round`` tasks: the largest gradients, measured together -- for
   an offline export or several GPUs) and measures ``batch`` of its candidates (``search.propose``: cost-model
   ranked, plus an epsilon share of random ones), appends every measurement to the log, and retrains the model.
   The task picked is the one with the largest expected gain for the whole model (the idea of Ansor's task scheduler
   and MetaSchedule's gradient-based one, simplified)::

       g_i = share_i * best_i / default_i * max(recent_i, OPTIMISM / (1 + rounds_i))

   ``share_i * best_i / default_i`` is the task's part of the model's tensor-core time now (its share, measured at the
   defaults, times how much of that is left); ``recent_i`` the mean relative improvement of its best time over its
   last ``WINDOW`` rounds (backward-looking: a task still improving is likely to improve again); ``OPTIMISM / (1 +
   rounds_i)`` the forward-looking term for tasks with few rounds, which decays as a task gets rounds without gain
   (every task gets tried, a large one first). A task whose proposals find nothing new drops out.

The budget is a number of measured candidates (``trials``, the baseline included) or wall-clock minutes; the run
also stops when every task has dropped out. Progress is one line per round (task, trials, best, default, gain);
``summary()`` gives the final table and the estimated whole-model gain ``1 / sum(share * best / default)`` per batch.
"""
from __future__ import annotations

import datetime
import math
import pathlib
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from qcompile.errors import QCompileError

from .common import BUILD_ERROR, OK, Candidate, Measured
from .search import TaskState, baseline, propose, searched, starts
from .tasks import members, set_shares

WINDOW = 2
OPTIMISM = 0.2
FIRST_SHARE = 0.01  # tasks below this share of their model's time get no first round of their own


@dataclass
class Summary:
    rows: list = field(default_factory=list)  # per task: dict(label, key, strategy, batch, share, default_ms, best_ms, ...)
    model_gain: dict = field(default_factory=dict)  # batch (several models: (model, batch)) -> estimated gain
    trials: int = 0
    deferred: bool = False
    stop: str = ""
    spent: dict = field(default_factory=dict)  # wall seconds: build, measure, model (and built: candidates built)


class Tuner:
    def __init__(self, tasks: list, builder, runner, log_path, *, model=None, transfer=(), seed: int = 0,
                 batch: int = 8, eps: float = 0.1, pool: int = 48, log: Callable = print, spaces=None,
                 clock: Callable = time.monotonic, pending=(), tasks_per_round: int = 1, configs: bool = True):
        from qcompile.schedules.space import SPACES

        self.spaces = SPACES if spaces is None else spaces
        self.builder, self.runner, self.model = builder, runner, model
        self.log_path = pathlib.Path(log_path)
        self.transfer = tuple(transfer)
        self.seed, self.batch, self.eps, self.pool = seed, max(1, batch), eps, pool
        self.tasks_per_round = max(1, tasks_per_round)
        self.configs = configs
        self.log, self.clock = log, clock
        self.pending = tuple(pending)  # exceptions by which a runner says its batch is measured elsewhere, later
        self.states = [TaskState(t, self.spaces.get(t.strategy)) for t in tasks]
        for st in self.states:
            if st.tunable:
                st.default_id = st.knobs_id(st.space.default(st.spec, st.arch))
        self.device = None
        self.trials = 0
        self._t0 = clock()  # (each record's ``elapsed_s``: seconds since this run started when it was measured)
        # (wall seconds in the builder / the runner / training the cost model; candidates built)
        self.spent = dict(build=0.0, measure=0.0, model=0.0, built=0)

    def _fit(self) -> None:
        """Retrain the cost model (its wall time counted in ``spent["model"]``)."""
        t = self.clock()
        self.model.fit()
        self.spent["model"] = self.spent.get("model", 0.0) + self.clock() - t

    # ---- the log ------------------------------------------------------------------------------------------------
    def _read(self, path) -> list:
        from qcompile.schedules.tuning import clear_cache, read_log

        clear_cache()  # (the log grows while tuning: read it as it is now)
        return read_log(path)

    def resume(self) -> int:
        """Load this GPU's records of the tasks from the log; train the model on every OK record of the log and the
        transfer logs. Returns how many of the tasks' measurements were found."""
        from qcompile.schedules.tuning import family, spec_from_key

        own = self._read(self.log_path) if self.log_path.exists() else []
        found = 0
        by_key = {}
        for st in self.states:
            by_key.setdefault((st.task.key, family(st.task.strategy)), []).append(st)
        for r in own:
            if r.arch != self.arch or r.device != self.device.name:
                continue
            for st in by_key.get((r.key, family(r.strategy)), []):
                if st.tunable and isinstance(r.knobs, st.space.knobs_type):
                    st.add(r.knobs, r.status, r.ms)
                    found += 1
        if self.model is not None:
            recs = list(own)
            for p in self.transfer:
                recs += self._read(p)
            self.model.add_records(recs, self.spaces, spec_from_key)
            self._fit()
        return found

    def _append(self, lines: list) -> None:
        if not lines:
            return
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "a") as f:
            f.write("".join(ln + "\n" for ln in lines))
            f.flush()

    # ---- building and measuring ------------------------------------------------------------------------------
    @property
    def arch(self) -> str:
        return self.states[0].arch if self.states else ""

    def _measure(self, batch: list) -> list:
        """``batch``: (state, knobs) pairs. Builds them (all at once), measures the built ones, records every result
        (log line, task state, cost model). Returns the Measured list in order."""
        cands = [Candidate(st.task.key, st.spec, st.arch, st.task.strategy, kn) for st, kn in batch]
        t0 = self.clock()
        built = self.builder.build(cands)
        t1 = self.clock()
        self.spent["build"] += t1 - t0
        self.spent["built"] += len(cands)
        if len(built) != len(cands):
            raise RuntimeError(f"the builder returned {len(built)} results for {len(cands)} candidates")
        ready = [b for b in built if b.path and not b.error]
        try:
            got = iter(self.runner.measure(ready) if ready else [])
        finally:
            self.spent["measure"] += self.clock() - t1
        results = []
        for (st, kn), b in zip(batch, built):
            if b.path and not b.error:
                m = next(got)
            else:
                m = Measured(b.candidate, BUILD_ERROR, None, (b.error or "not built").splitlines()[0][:300])
            results.append(m)
        self._record(batch, results)
        return results

    def merge(self, measured: list) -> int:
        """Record measurements made elsewhere (an offline runner's imported results, whole or cut short) that the
        log does not hold yet: each one of this run's arch and GPU whose task and knobs are this run's and not yet
        measured. Returns how many."""
        from qcompile.schedules.tuning import family

        by_key = {}
        for st in self.states:
            if st.tunable:
                by_key.setdefault((st.task.key, family(st.task.strategy)), []).append(st)
        batch, results, seen = [], [], set()
        for m in measured:
            c = m.candidate
            if c.arch != self.arch or (m.device and m.device != self.device.name):
                continue  # (another GPU's measurements: not this run's records)
            for st in by_key.get((c.key, family(c.strategy)), []):
                kid = st.knobs_id(c.knobs) if isinstance(c.knobs, st.space.knobs_type) else None
                if kid is not None and kid not in st.measured and (id(st), kid) not in seen:
                    seen.add((id(st), kid))
                    batch.append((st, c.knobs))
                    results.append(m)
        self._record(batch, results)
        return len(batch)

    def _record(self, batch: list, results: list) -> None:
        """Append the measurements of ``batch`` ((state, knobs) pairs) to the log, the task states and the model."""
        from qcompile.schedules.tuning import make_record, round_ms

        date = datetime.date.today().isoformat()
        elapsed = round(self.clock() - self._t0, 1)  # (one value for the batch: its measurements came back together)
        lines = []
        for (st, kn), m in zip(batch, results):
            kid = st.knobs_id(kn)
            variant = "default" if kid == st.default_id else ("planned" if kn == st.task.planned_knobs else "trial")
            ms = round_ms(m.ms) if m.status == OK and m.ms and m.ms > 0 else None  # (as the log keeps it)
            status = m.status if (m.status != OK or ms) else "run_error"
            st.add(kn, status, ms, variant)
            st.trials += 1
            self.trials += 1
            extra = dict(variant=variant, date=date, layers=sum(u.weight for u in members(st.task)),
                         elapsed_s=elapsed)
            if m.detail and status != OK:
                extra["detail"] = m.detail[:300]
            lines.append(_format(make_record(st.arch, self.device.name, self.device.sms, st.task.key,
                                             st.task.strategy, kn, status, ms, st.default_ms, **extra)))
            if self.model is not None and ms:
                self.model.add(st.space, st.spec, st.arch, kn, ms, (self.device.name, st.task.key), self.device.sms)
        self._append(lines)

    # ---- scheduling -------------------------------------------------------------------------------------------
    def gradient(self, st: TaskState) -> float:
        """The expected gain for the whole model of one more round on ``st`` (module docstring)."""
        if not st.tunable or st.exhausted:
            return 0.0
        if not st.best_ms:  # (nothing OK yet, not even the defaults: two rounds to find a kernel that works)
            return st.task.share * OPTIMISM / (1 + st.rounds) if st.rounds < 2 else 0.0
        now = st.task.share * (st.best_ms / st.default_ms if st.default_ms else 1.0)
        recent = sum(st.gains[-WINDOW:]) / WINDOW if st.gains else 0.0
        return now * max(recent, OPTIMISM / (1 + st.rounds))

    def pick(self) -> Optional[TaskState]:
        """The task the next round goes to (``_propose_round``'s first), or None."""
        ranked = [st for st in self.states if self.gradient(st) > 0]
        return max(ranked, key=self._priority) if ranked else None

    def first_round(self, st: TaskState) -> bool:
        """Whether ``st`` is owed its first round (module docstring, step 3)."""
        share = max(m.extra.get("model_share", m.share) for m in members(st.task))  # (of the model it weighs most in)
        return (self.configs and st.rounds == 0 and share >= FIRST_SHARE and st.tunable
                and not st.exhausted and not searched(st) and bool(starts(st)))

    def _priority(self, st: TaskState) -> tuple:
        return (True, st.task.share) if self.first_round(st) else (False, self.gradient(st))

    def _propose_round(self, left: int, carry=()):
        """The next round: the ``tasks_per_round`` tasks owed a first round (largest share first), else those of
        largest gradient (one task, by default), each with up to ``batch`` proposals, measured together. None when
        no task has a gradient left; [] when the picked ones turned out exhausted (they drop out: pick again)."""
        ranked = sorted((st for st in self.states if self.gradient(st) > 0), key=self._priority, reverse=True)
        if not ranked:
            return None
        picked = []
        for st in ranked[:self.tasks_per_round]:
            n = min(self.batch, left - sum(len(c) for _, c in picked))
            if n <= 0:
                break
            pending = frozenset(st.knobs_id(kn) for s2, kn in carry if s2 is st)
            cands = propose(st, n, self.model, self.seed, self.eps, self.pool, pending=pending, configs=self.configs)
            if cands:
                picked.append((st, cands))
        return picked

    def _budget_left(self, trials, deadline) -> int:
        left = math.inf if trials is None else trials - self.trials
        if deadline is not None and self.clock() >= deadline:
            return 0
        return int(min(left, 1 << 30))

    def run(self, trials: Optional[int] = None, minutes: Optional[float] = None) -> Summary:
        if trials is None and minutes is None:
            raise QCompileError("give a budget: --trials N or --minutes M")
        deadline = None if minutes is None else self.clock() + 60.0 * minutes
        self.device = self.runner.device()
        for st in self.states:
            st.sms = self.device.sms
        if self.device.arch and self.arch and self.device.arch != self.arch:
            raise QCompileError(f"the runner's GPU ({self.device.name}) is {self.device.arch}; the tasks are for "
                                f"{self.arch} (--arch)")
        found = self.resume()
        imported = getattr(self.runner, "imported", None)
        if imported is not None:
            merged = self.merge(imported())
            if merged:
                self.log(f"{merged} measurements merged from the imported results")
                if self.model is not None:
                    self._fit()
        untunable = sorted({st.task.strategy for st in self.states if not st.tunable})
        units = "cores" if self.device.arch.startswith("cpu") else "SMs"
        self.log(f"tuning {sum(st.tunable for st in self.states)} tasks on {self.device.name} ({self.device.arch}, "
                 f"{self.device.sms} {units}); {found} measurements resumed from {self.log_path}"
                 + (f"; no search space yet for {', '.join(untunable)} (not tuned)" if untunable else ""))
        summary = Summary()
        try:
            # baseline: every task's default (and planned) knobs, in batches across tasks
            todo = [(st, kn) for st in self.states for kn in baseline(st)]
            cap = self.batch * max(4, self.tasks_per_round)
            carry = []  # with several tasks per round: the last baseline batch goes out with the first round
            while todo and self._budget_left(trials, deadline) > 0:
                n = min(len(todo), self._budget_left(trials, deadline), cap)
                if n == len(todo) and self.tasks_per_round > 1 and n < self._budget_left(trials, deadline):
                    carry, todo = todo, []
                    break
                self._measure(todo[:n])
                todo = todo[n:]
            self._shares()
            if self.model is not None:
                self._fit()
            for st in self.states:
                if st.default_ms:
                    self._progress(st, "baseline")
            while self._budget_left(trials, deadline) > 0:
                picked = self._propose_round(self._budget_left(trials, deadline) - len(carry), carry)
                if picked is None and not carry:
                    summary.stop = "every task's proposals are exhausted"
                    break
                if not picked and not carry:
                    continue  # (exhausted now: pick others)
                picked = picked or []
                before = {id(st): st.best_ms for st, _ in picked}
                self._measure(carry + [(st, kn) for st, cands in picked for kn in cands])
                if carry:
                    carry = []
                    self._shares()
                for st, _ in picked:
                    b = before[id(st)]
                    st.rounds += 1
                    st.gains.append(max(0.0, (b - st.best_ms) / b) if b and st.best_ms else 0.0)
                if self.model is not None:
                    self._fit()
                for st, _ in picked:
                    self._progress(st)
            else:
                summary.stop = "budget spent"
        except self.pending as e:
            summary.deferred, summary.stop = True, str(e) or "measurements deferred (offline export)"
        self._shares()
        summary.trials = self.trials
        summary.spent = dict(self.spent)
        summary.rows, summary.model_gain = self.table()
        return summary

    def _shares(self) -> None:
        for st in self.states:
            st.task.default_ms = st.default_ms
        set_shares([st.task for st in self.states], measured=True)

    def _progress(self, st: TaskState, what: str = "") -> None:
        best, dflt = st.best_ms, st.default_ms
        gain = f"{dflt / best:.2f}x" if best and dflt else "-"
        self.log(f"[{self.trials:>4} trials] {st.task.label:<28} {what or f'round {st.rounds}':<9} "
                 f"{len(st.measured):>3} measured, best {_ms(best)}, default {_ms(dflt)}, gain {gain}")

    def table(self) -> tuple:
        """(rows, gains): a row per task; the estimated whole-model gain per batch size (several models, per
        (model, batch size))."""
        rows, gains = [], {}
        by_batch: dict = {}
        several = len({m.extra.get("model") for st in self.states for m in members(st.task)}) > 1
        for st in self.states:
            t = st.task
            b = t.extra.get("model_batch", t.spec.N)
            best, dflt = st.best_ms, st.default_ms
            best_entry = st.best
            n = len(members(t))
            rows.append(dict(label=t.label + (f" ({n} models)" if n > 1 else ""), key=t.key, strategy=t.strategy,
                             batch=b, share=t.share, default_ms=dflt,
                             best_ms=best, gain=(dflt / best) if best and dflt else None,
                             measured=len(st.measured), failed=sum(e.status != OK for e in st.measured.values()),
                             best_knobs=best_entry.knobs if best_entry else None, tunable=st.tunable))
            ratio = best / dflt if best and dflt else 1.0
            for m in members(t):  # (each model's copy, with its share of that model)
                mb = m.extra.get("model_batch", m.spec.N)
                by_batch.setdefault((m.extra.get("model"), mb) if several else mb, []).append(
                    (m.extra.get("model_share", m.share), ratio))
        for b, parts in by_batch.items():
            total = sum(s * r for s, r in parts)
            gains[b] = 1.0 / total if total > 0 else 1.0
        return rows, gains


def _ms(v) -> str:
    return f"{v:.4f} ms" if v else "   -    "


def _format(rec: dict) -> str:
    from qcompile.schedules.tuning import format_record

    return format_record(rec)


def format_summary(summary: Summary) -> str:
    """The final table: task, strategy, share of the model's tensor-core time, default -> best, gain; then the
    estimated whole-model gain per batch size (several models: per model and batch size)."""
    head = ("task", "strategy", "share", "default ms", "best ms", "gain", "measured")
    rows = [head]
    for r in sorted(summary.rows, key=lambda r: (r["batch"], -r["share"])):
        rows.append((r["label"], r["strategy"], f"{100 * r['share']:.1f}%",
                     f"{r['default_ms']:.4f}" if r["default_ms"] else "-",
                     f"{r['best_ms']:.4f}" if r["best_ms"] else "-",
                     f"{r['gain']:.2f}x" if r["gain"] else ("not tuned" if not r["tunable"] else "-"),
                     f"{r['measured']}" + (f" ({r['failed']} failed)" if r["failed"] else "")))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    for b, g in sorted(summary.model_gain.items()):
        what = f"{b[0]} batch {b[1]}" if isinstance(b, tuple) else f"batch {b}"
        lines.append(f"{what}: estimated whole-model gain {g:.2f}x (the tuned kernels: "
                     f"sum of share x best / default = {1 / g:.3f})")
    return "\n".join(lines)


def format_time(spent: dict, phases=()) -> str:
    """Where a run's time went: wall seconds in the builder, in the runner and training the cost model
    (``Summary.spent``) and, where the runner reports them (``phases``: one dict per measured candidate,
    ``measure.measure_entry``'s), the mean seconds per candidate of each phase (``setup`` includes waiting for the
    shape's inputs and reference)."""
    n = spent.get("built", 0)
    line = (f"time: building {spent.get('build', 0.0):.0f} s ({n} candidates"
            + (f", {spent['build'] / n:.2f} s each" if n else "") + f"), measuring {spent.get('measure', 0.0):.0f} s")
    if spent.get("model", 0.0) >= 0.5:
        line += f", training the cost model {spent['model']:.0f} s"
    phases = list(phases)
    if phases:
        names = list(dict.fromkeys(k for p in phases for k in p))
        per = ", ".join(f"{k} {sum(p.get(k, 0.0) for p in phases) / len(phases):.3f}" for k in names)
        line += f" ({len(phases)} candidates; per candidate, s: {per})"
    return line


__all__ = ["Tuner", "Summary", "format_summary", "format_time", "WINDOW", "OPTIMISM"]
