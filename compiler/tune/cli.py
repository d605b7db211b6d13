"""The ``qtune`` command: tune a model's tensor-core kernels for a GPU, or its CPU kernels for this machine's CPU, and
write the measurements to a tuning log.

    qtune MODEL [MODEL ...] --target cuda --arch sm_XX [--batch N ...] [--layout NHWC|HWNC] [--bits ...]
          [--trials N | --minutes M] [--runner local|rpc|offline ...] [--jobs J] [--export DIR | --import RESULTS]
          [--tuning-log PATH ...] -o LOG
    qtune MODEL [MODEL ...] --target llvm [--batch N ...] [--trials N | --minutes M] [--jobs J]
          [--tuning-log PATH ...] -o LOG

``--target llvm`` tunes the register tiles of the CPU kernels (strategy ``cpu_direct``) that ``qcompile --target
llvm`` runs on this host: the tasks are the llvm build's NHWC layers, the candidates are built for this host's build
target and measured by the local runner on this CPU; the records name the CPU inner kernel as ``arch``
(``cpu_direct_vnni``, ``cpu_direct_avxvnni``, ``cpu_direct_avx2``: ``--arch`` may name it, nothing else) and the CPU
model (``/proc/cpuinfo``) as ``device``.

The tasks come from the model as ``qcompile`` compiles it (``tasks.extract_tasks``; several models: one task list,
a task several of them have tuned once, ``tasks.merge_models``), the search and the schedule across
tasks from ``scheduler.Tuner``, the builds and the measurements from the builder and runner the options choose
(``qcompile.tune.build.make_builder`` / ``qcompile.tune.runners.make_runner``, each with its ``add_arguments``).
``-o LOG`` is appended to (JSON lines, ``schedules.tuning``); rerunning with the same LOG resumes. Errors in the
model, files or options are one ``qtune: error: ...`` line and exit status 2, as ``qcompile``'s.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from qcompile.errors import OneLineArgumentParser, QCompileError, run_cli
from qcompile.registry import BIT_SCHEMES, CUDA_ARCHS, FORMATS, format_of

PROG = "qtune"
DEBUG_ENV = "QCOMPILE_DEBUG"
TUNE_LAYOUTS = ("NHWC", "HWNC")  # (the layouts with tensor-core convolutions)
TUNE_TARGETS = ("cuda", "llvm")
CPU_KERNELS = ("cpu_direct_avx2", "cpu_direct_vnni", "cpu_direct_avxvnni", "cpu_direct_sdot")  # (--arch on llvm)
CPU_LAYOUTS = ("NHWC",)  # (the layout whose CPU-kernel layers take tuned tiles: llvm's default)


def _factories():
    """``(build module, runners module)``, or None for each one not installed (the parser then lacks its options,
    and running says so)."""
    mods = []
    for name in ("qcompile.tune.build", "qcompile.tune.runners"):
        try:
            mods.append(__import__(name, fromlist=["make_runner"]))
        except ModuleNotFoundError as e:
            if e.name != name:
                raise
            mods.append(None)
    return tuple(mods)


def _parser(factories=None) -> argparse.ArgumentParser:
    ap = OneLineArgumentParser(
        prog=PROG,
        description="Autotune a quantized CNN's tensor-core kernels for a GPU (--target cuda) or its CPU kernels "
                    "for this machine's CPU (--target llvm); the measurements go to a tuning log that qcompile "
                    "--tuning-log reads.",
        epilog=f"Exit status: 0 success, 2 a problem with the model, a file or the options (one 'qtune: error:' "
               f"line), 1 an internal error (set {DEBUG_ENV}=1 for its stack trace). See docs/TUNING.md.",
    )
    ap.add_argument("model", nargs="+",
                    help="model file, as qcompile takes it: .onnx, .pt2, or a HAWQ checkpoint (with --net); several: "
                         "one run for all, a layer they share tuned once, each model's time weighing the same")
    ap.add_argument("-o", "--output", required=True, metavar="LOG",
                    help="tuning log to append to (.jsonl); rerunning with the same LOG resumes")
    ap.add_argument("--target", default="cuda",
                    help="cuda (tensor-core kernels, default) or llvm (the CPU kernels, measured on this machine)")
    ap.add_argument("--arch", choices=list(CUDA_ARCHS) + list(CPU_KERNELS),
                    help="cuda: the GPU architecture (default sm_90); llvm: the CPU kernel this machine runs (the "
                         "default, and the only value taken)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1], metavar="N",
                    help="batch sizes to tune for (default 1); each is its own set of tasks")
    ap.add_argument("--layout", choices=list(TUNE_LAYOUTS), default="NHWC",
                    help="activation layout (default NHWC; llvm: NHWC only)")
    ap.add_argument("--bits", choices=list(BIT_SCHEMES), help="as qcompile --bits")
    ap.add_argument("--calibrate", metavar="DATA.npy", help="as qcompile --calibrate (float models)")
    ap.add_argument("--net", choices=["resnet18", "resnet50", "resnet_tiny"], help="network of a HAWQ checkpoint")
    ap.add_argument("--input-size", type=int, metavar="H", help="image size of a HAWQ checkpoint")
    budget = ap.add_mutually_exclusive_group()
    budget.add_argument("--trials", type=int, metavar="N", help="measure N candidates in all (default 200)")
    budget.add_argument("--minutes", type=float, metavar="M", help="tune for M minutes of wall-clock time")
    ap.add_argument("--per-round", type=int, default=8, metavar="K",
                    help="candidates measured per round of one task (default 8)")
    ap.add_argument("--tasks-per-round", type=int, default=1, metavar="T",
                    help="tasks whose rounds are measured together (default 1; an offline export or several GPUs: "
                         "more, e.g. every task)")
    ap.add_argument("--search", choices=["model", "random"], default="model",
                    help="rank candidates with the XGBoost cost model (default) or take them at random")
    ap.add_argument("--tuning-log", action="append", default=[], metavar="PATH",
                    help="other tuning logs (files or folders) whose records warm-start the cost model (other "
                         "shapes, batch sizes, GPUs) and whose knobs are measured as a starting point; repeatable")
    ap.add_argument("--no-pretrained", dest="pretrained", action="store_false",
                    help="start the cost model empty: not trained first on the packaged measurements of --arch "
                         "(tuning_logs/ARCH.train.jsonl.gz, other shapes measured on other GPUs)")
    ap.add_argument("--no-configs", dest="configs", action="store_false",
                    help="no start points: each task's first round comes from the sampled pool, and the scheduler's "
                         "gradient picks tasks from the first round on")
    ap.add_argument("--seed", type=int, default=0, help="random seed of the search (default 0)")
    ap.add_argument("-q", "--quiet", action="store_true", help="no progress output")
    build_mod, runners_mod = factories if factories is not None else _factories()
    for mod in (build_mod, runners_mod):
        if mod is not None and hasattr(mod, "add_arguments"):
            mod.add_arguments(ap)
    return ap


def _check_args(a) -> None:
    from qcompile.checks import check_input_file, check_output_path, check_tuning_logs

    fmts = {}
    for m in a.model:
        check_input_file(m, "model file")
        try:
            fmts[m] = format_of(m)
        except ValueError:
            known = ", ".join(s for f in FORMATS.values() for s in f.suffixes)
            raise QCompileError(f"cannot tell the format of '{m}' from its suffix (known: {known})") from None
    if len({os.path.realpath(m) for m in a.model}) != len(a.model):
        raise QCompileError(f"a model file is named twice: {' '.join(a.model)}")
    if a.target not in TUNE_TARGETS:
        raise QCompileError(f"--target {a.target}: qtune tunes --target cuda (tensor-core kernels) or llvm (the CPU "
                            f"kernels, on this machine)")
    if a.target == "cuda":
        a.arch = a.arch or "sm_90"
        if a.arch not in CUDA_ARCHS:
            raise QCompileError(f"--arch {a.arch} names a CPU kernel: it goes with --target llvm (GPU archs: "
                                f"{', '.join(CUDA_ARCHS)})")
    else:
        _check_cpu_args(a)
    for flag, v in (("--trials", a.trials), ("--per-round", a.per_round), ("--tasks-per-round", a.tasks_per_round),
                    ("--input-size", a.input_size)):
        if v is not None and v < 1:
            raise QCompileError(f"{flag} must be a positive integer, got {v}")
    if a.minutes is not None and not a.minutes > 0:
        raise QCompileError(f"--minutes must be a positive number, got {a.minutes}")
    bad = [b for b in a.batch if b < 1]
    if bad:
        raise QCompileError(f"--batch must be positive integers, got {bad[0]}")
    if len(set(a.batch)) != len(a.batch):
        raise QCompileError(f"--batch names a batch size twice: {' '.join(map(str, a.batch))}")
    for m, fmt in fmts.items():
        if fmt != "hawq":
            for flag, v in (("--net", a.net), ("--input-size", a.input_size)):
                if v is not None:
                    raise QCompileError(f"{flag} applies to HAWQ checkpoints only; '{m}' is {fmt.upper()}")
    if a.calibrate:
        check_input_file(a.calibrate, "calibration file")
    check_tuning_logs(a.tuning_log, None, a.target)
    check_output_path(a.output, "-o", [("input model", m) for m in a.model] + [("calibration data", a.calibrate)]
                      + [("--tuning-log", p) for p in a.tuning_log], suffixes=(".jsonl",),
                      why="(a JSON-lines tuning log)")


def _check_cpu_args(a) -> None:
    """``--target llvm``: the layout, the runner (this machine's CPU: local only) and ``--arch`` (the CPU kernel this
    host runs, or nothing) -- checked before any work; ``a.arch`` becomes the kernel, the runner measures on the CPU."""
    from qcompile.schedules.cpu_conv import cpu_model_name

    from .tasks import cpu_arch

    if a.layout not in CPU_LAYOUTS:
        raise QCompileError(f"--layout {a.layout}: --target llvm tunes the CPU kernels of NHWC builds (qcompile's "
                            f"llvm default)")
    runner = getattr(a, "runner", None)
    if runner not in (None, "local") or getattr(a, "export", None) or getattr(a, "import_results", None):
        raise QCompileError("--target llvm measures on this machine's CPU: --runner local only (no --export / "
                            "--import / rpc)")
    kernel = cpu_arch()
    if kernel is None:
        raise QCompileError("--target llvm: this machine runs no qcompile CPU kernel (they need an x86-64 CPU with "
                            "AVX2, or QCOMPILE_CPU_KERNELS is off): nothing to tune")
    if a.arch is not None and a.arch != kernel:
        raise QCompileError(f"--arch {a.arch}: with --target llvm, --arch names the CPU kernel, and this machine's CPU "
                            f"({cpu_model_name()}) runs {kernel}; qtune measures on this CPU (omit --arch)")
    a.arch = kernel
    a.measure_device = "cpu"


class _CpuRunner:
    """The local runner on the CPU, as the tuner sees it: its device is the CPU model (``/proc/cpuinfo``) with the
    CPU kernel ``kernel`` as its arch, so the records are keyed by both."""

    def __init__(self, runner, kernel: str):
        self.runner, self.kernel = runner, kernel

    @property
    def phases(self) -> list:
        return getattr(self.runner, "phases", [])

    def device(self):
        from qcompile.schedules.cpu_conv import cpu_model_name

        from .common import DeviceInfo

        d = self.runner.device()
        return DeviceInfo(cpu_model_name(), self.kernel, d.sms, None)

    def measure(self, built):
        name = self.device().name
        out = self.runner.measure(built)
        for m in out:  # (the runner names the CPU as measure.py does; the records take the tuner's name)
            m.device = name
        return out


def qtune_main(argv=None) -> int:
    factories = _factories()
    a = _parser(factories).parse_args(argv)
    log = (lambda *_: None) if a.quiet else (lambda s: print(s, flush=True))
    return run_cli(PROG, lambda: _run(a, log, factories))


def _run(a, log, factories) -> int:
    _check_args(a)
    build_mod, runners_mod = factories
    if build_mod is None or runners_mod is None:
        missing = " and ".join(n for n, m in (("qcompile.tune.build", build_mod), ("qcompile.tune.runners",
                                                                                 runners_mod)) if m is None)
        raise QCompileError(f"this qcompile has no builder / runner for qtune ({missing} not installed)")
    trials = a.trials if a.trials is not None or a.minutes is not None else 200
    model = None
    if a.search == "model":
        from .cost_model import CostModel, _xgboost

        _xgboost()  # (before any work: a clear message where XGBoost is missing)
        model = CostModel(seed=a.seed)
    runner = runners_mod.make_runner(a)  # (the runner's own option errors first: before the model is compiled)
    if a.target == "llvm":
        runner = _CpuRunner(runner, a.arch)
    builder = build_mod.make_builder(a)
    t0 = time.time()
    log("loading the compiler (TVM) ...")
    from qcompile.cli import _import_driver_without_torch

    _import_driver_without_torch()
    from .tasks import extract_tasks, members, merge_models

    log(f"      done in {time.time() - t0:.1f} s")
    log(f"extracting the tuning tasks of {' '.join(a.model)} for {a.arch} ({a.layout}, batch "
        f"{' '.join(map(str, a.batch))}) ...")
    t1 = time.time()
    per_model = [extract_tasks(m, a.arch, a.batch, a.layout, a.bits, a.net, a.input_size, a.calibrate,
                               tuple(a.tuning_log), None, lambda s: None, target=a.target) for m in a.model]
    what = "CPU-kernel" if a.target == "llvm" else "tensor-core"
    for m, got in zip(a.model, per_model):
        if not got:
            raise QCompileError(f"'{m}' has no {what} layer to tune for {a.arch} in {a.layout}")
    tasks = merge_models(per_model, a.model) if len(a.model) > 1 else per_model[0]
    shared = sum(len(t.extra.get("others", ())) > 0 for t in tasks)
    log(f"      done in {time.time() - t1:.1f} s — {len(tasks)} tasks, "
        f"{sum(m.weight for t in tasks for m in members(t))} layers"
        + (f" ({sum(map(len, per_model))} tasks in the {len(a.model)} models; {shared} shared)"
           if len(a.model) > 1 else ""))
    from .scheduler import Tuner, format_summary, format_time

    transfer = tuple(a.tuning_log)
    if model is not None and a.pretrained:
        from qcompile.schedules.tuning import read_log, train_log_path

        train = train_log_path(a.arch)
        n = len(read_log(train)) if train is not None else 0  # (a damaged file: a warning names it, and 0 records)
        if n:
            transfer += (str(train),)
            log(f"cost model: trained first on {n} packaged measurements of {a.arch} ({train.name}; --no-pretrained: "
                f"start empty)")
        elif train is not None:
            log(f"cost model: {train} holds no measurement it can read; the model starts empty")
    pending = tuple(e for e in (getattr(runners_mod, "OfflineBatchPending", None),) if e is not None)
    tuner = Tuner(tasks, builder, runner, a.output, model=model, transfer=transfer, seed=a.seed,
                  batch=a.per_round, log=log, pending=pending, tasks_per_round=a.tasks_per_round,
                  configs=a.configs)
    summary = tuner.run(trials=trials, minutes=a.minutes)
    if any(r["measured"] for r in summary.rows):
        log(format_summary(summary))
    log(f"{summary.trials} candidates measured in {time.time() - t0:.0f} s"
        + (f" ({summary.stop})" if summary.stop else "")
        + (f"; records appended to {a.output}" if summary.trials else ""))
    if summary.spent.get("built"):
        log(format_time(summary.spent, getattr(runner, "phases", ())))
    if summary.deferred:
        log("the measurements of the exported batch happen elsewhere: rerun this command with the same -o LOG "
            "once they are imported, to continue")
    return 0


if __name__ == "__main__":
    sys.exit(qtune_main())
