"""Building tuning candidates on the host: ``LocalBuilder`` (the ``Builder`` of qcompile.tune.common).

Each candidate becomes one shared library holding every kernel of its planned layer (``schedules.plan_conv``: one
kernel, a split-K pair or a stream-K kernel) and a manifest entry that says how to call it, as plain JSON::

    BUILD_DIR/batch_NNNN/<id>.so          the TVM module (CUDA: the fatbin embedded; nvcc SASS for the arch, + PTX
                                          with --nvcc-mode both; llvm: a CPU kernel -- ``cpu_direct``, the inner
                                          kernel the candidate's arch names, for its x86 level -- or the fallback)
    BUILD_DIR/batch_NNNN/manifest.json    {"format": "qcompile-tune-batch/1", "candidates": [entry, ...]}

An entry: ``id``, ``so``, ``target``, ``arch``, ``key`` (the task), ``spec`` (ConvSpec's fields), ``strategy``,
``label``, ``knobs`` (a dict, or null), ``knobs_type`` and ``effective_knobs`` (what the kernels were built with:
small shapes shrink tiles), the calling convention -- ``funcs`` (launch order),
``split_k`` and ``workspace`` (the int32 workspace shape of a split-K pair), ``streamk`` ([tile counters, workspace
words]), ``w_expand`` and ``w_kperm`` (the weight format: schedules/planned.py), for a CPU kernel ``w_cpu`` (its
weight packing and bias fold: ``qcompile.tune.measure.cpu_weights``), for a depthwise / grouped kernel ``w_group``
(its strategy, which names its weight format: ``qcompile.tune.measure.group_weights``) -- and ``build_s``, the host seconds spent on
it (planning, TIR lowering, nvcc, export). ``qcompile.tune.measure`` needs nothing else. A ``grouped_gemm`` candidate
(the tensor-core kernel of grouped convs) is one kernel ``conv(x, w, bias, M, S, [res, rq2], [lut], out)`` whose
weights are the logical OHWI int8 weights [K, R, S, C / groups]: no ``w_group``, ``w_expand`` false, ``w_kperm`` 0,
which ``measure.weights`` turns into that buffer given the spec's ``groups``.

Candidates build in parallel host processes (``--jobs``, default: every core), each one whole; identical candidates
in a batch build once. A candidate the kernels refuse (its knobs illegal for the shape: the reason from the
strategy's space), one whose wgmma knobs the builder would replace by the mma.sync defaults, an nvcc failure, a SASS
hazard of a register-A wgmma kernel (``cuda_tools.wgmma_a_hazards``, where cuobjdump is installed) or a crashed
build process comes back as ``Built.error`` (one line), never as a different kernel.
"""
from __future__ import annotations

import argparse
import atexit
import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from qcompile.errors import QCompileError

from .common import Built, Builder, Candidate

FORMAT = "qcompile-tune-batch/1"  # (measure.FORMAT)
TARGETS = ("cuda", "llvm")
NVCC_MODES = ("sass", "ptx", "both")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("building candidates")
    g.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                   help="parallel build processes (default: %(default)s, the cores of this machine)")
    g.add_argument("--build-dir", help="where the candidates' libraries go (default: a temporary folder, removed "
                                       "at exit)")
    g.add_argument("--build-timeout", type=float, default=300.0, metavar="S",
                   help="seconds one candidate may build before its process is killed (default: 300)")
    g.add_argument("--nvcc-mode", choices=NVCC_MODES, default="sass",
                   help="nvcc output: SASS for the arch, PTX (JIT-compiled by the driver on newer GPUs) or both "
                        "(default: sass)")


def make_builder(args) -> "LocalBuilder":
    """The builder the command line asks for (``add_arguments``' options; ``args.target``, default cuda)."""
    jobs = getattr(args, "jobs", None)
    jobs = os.cpu_count() or 1 if jobs is None else jobs
    if jobs < 1:
        raise QCompileError(f"--jobs {jobs}: must be at least 1")
    target = getattr(args, "target", None) or "cuda"
    if target not in TARGETS:
        raise QCompileError(f"--target {target}: tuning candidates build for {' or '.join(TARGETS)}")
    timeout = getattr(args, "build_timeout", None)
    timeout = 300.0 if timeout is None else timeout
    if not timeout > 0:
        raise QCompileError(f"--build-timeout {timeout}: must be above 0")
    return LocalBuilder(jobs=jobs, build_dir=getattr(args, "build_dir", None), target=target,
                        nvcc_mode=getattr(args, "nvcc_mode", None) or "sass", timeout=timeout)


# ---------------------------------------------------------------------------------------------------------------
# one candidate (runs in a build process)
# ---------------------------------------------------------------------------------------------------------------
def knobs_dict(knobs) -> dict | None:
    return None if knobs is None else {f.name: getattr(knobs, f.name) for f in dataclasses.fields(knobs)}


_LATER_SPEC_FIELDS = ("lut", "lut_min")  # ConvSpec fields left out of an id at their default: ids stay as they were


def candidate_id(cand: Candidate, target: str, mode: str) -> str:
    """A content key: the same candidate built the same way gets the same id."""
    spec = {k: v for k, v in dataclasses.asdict(cand.spec).items() if not (k in _LATER_SPEC_FIELDS and v == 0)}
    blob = json.dumps([target, mode, cand.arch, cand.strategy, spec, knobs_dict(cand.knobs),
                       type(cand.knobs).__name__], sort_keys=True, default=str)
    return "k" + hashlib.sha1(blob.encode()).hexdigest()[:12]


def _one_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    errs = [ln for ln in lines if "error" in ln.lower()]  # (nvcc: the first error line, not the banner)
    msg = (errs or lines or [""])[0]
    return f"{type(e).__name__}: {msg[:300]}" if msg else type(e).__name__


def _why_refused(cand: Candidate) -> str | None:
    """The strategy's own reason for refusing the candidate (its space's legality), where it has one."""
    try:
        from qcompile.schedules.space import SPACES

        sp = SPACES.get(cand.strategy)
        return sp.legal(cand.spec, cand.arch, cand.knobs) if sp is not None and cand.knobs is not None else None
    except Exception:  # noqa: BLE001  (the message falls back to the builder's own)
        return None


_KNOB_TYPES = {"direct_halo": "HaloKnobs", "implicit_gemm_t": "KtKnobs", "implicit_gemm": "GemmKnobs",
               "direct_hwnc": "GemmKnobs", "depthwise": "DwConfig", "grouped": "GroupedConfig",
               "grouped_gemm": "GemmKnobs"}
GROUPED_STRATEGIES = ("depthwise", "grouped")  # the grouped convs' CUDA-core kernels (their own weight formats)


def _plan_grouped(cand: Candidate):
    """(funcs, calling-convention fields) of a ``depthwise`` / ``grouped`` candidate (``cand.spec.groups`` groups):
    refused (the space's reason, the builder's own ``depthwise_point`` / ``grouped_point``) before any TIR, else
    ``plan_grouped`` with the candidate's tile (None: the space's default); ``w_group`` names the weight format
    (``measure.group_weights``)."""
    from qcompile.schedules.grouped import grouped_strategy, plan_grouped
    from qcompile.schedules.space import SPACES

    if grouped_strategy(cand.spec, cand.spec.groups) != cand.strategy:
        raise ValueError(f"not applicable: groups {cand.spec.groups}, C {cand.spec.C}, K {cand.spec.K} run on "
                         f"{grouped_strategy(cand.spec, cand.spec.groups)}, not {cand.strategy}")
    sp = SPACES[cand.strategy]
    kn = sp.default(cand.spec, cand.arch) if cand.knobs is None else cand.knobs
    why = sp.legal(cand.spec, cand.arch, kn)
    if why is not None:
        raise ValueError(f"not applicable: {why}")
    pk = plan_grouped(cand.spec, cand.spec.groups, cand.arch, kn)
    return list(pk.funcs), dict(split_k=1, streamk=None, w_expand=False, w_kperm=0, label=pk.label,
                                effective_knobs=knobs_dict(pk.knobs), w_group=cand.strategy)


def _plan_grouped_gemm(cand: Candidate):
    """(funcs, calling-convention fields) of a ``grouped_gemm`` candidate: ``grouped_gemm.plan_grouped_gemm`` with
    the candidate's knobs (None: ``default_grouped_knobs``). Its plan (``grouped_gemm_plan``, the space's legality)
    runs before any TIR: a point it refuses is "not applicable" with the space's reason. The weights are
    ``PlannedKernel.weights``' OHWI int8 [K, R, S, C / groups] (``w_expand`` / ``w_kperm`` as the plan says:
    ``measure.weights``)."""
    from qcompile.schedules.gemm.plan import NotApplicable
    from qcompile.schedules.grouped_gemm import plan_grouped_gemm

    try:
        pk = plan_grouped_gemm(cand.spec, cand.arch, cand.knobs)
    except NotApplicable as e:
        raise ValueError(f"not applicable: {e}") from None
    return list(pk.funcs), dict(split_k=1, streamk=None, w_expand=bool(pk.w_expand), w_kperm=int(pk.w_kperm),
                                label=pk.label, effective_knobs=knobs_dict(pk.knobs), workspace=None)


# the x86 build target of each x86 CPU inner kernel (the lowest level that enables its instruction)
CPU_KERNEL_TARGETS = {
    "cpu_direct_avx2": {"kind": "llvm", "mcpu": "x86-64-v3"},
    "cpu_direct_avxvnni": {"kind": "llvm", "mcpu": "x86-64-v3", "mattr": ["+avxvnni"]},
    "cpu_direct_vnni": {"kind": "llvm", "mcpu": "x86-64-v4", "mattr": ["+avx512vnni"]},
}


def cpu_kernel_target(kernel: str):
    """The llvm target a ``cpu_direct`` candidate of ``kernel`` builds for: this host's build target where it runs
    that kernel (``dispatch_cpu.cpu_kernels_target``, what ``qcompile --target llvm`` uses), else the kernel's x86
    level (``CPU_KERNEL_TARGETS``: built, for a host that runs it). ValueError for a kernel with neither."""
    import tvm

    from qcompile.relay_passes.dispatch_cpu import cpu_kernels_target
    from qcompile.schedules.cpu_conv import target_kernel

    host = cpu_kernels_target(tvm.target.Target({"kind": "llvm"}))
    if host is not None and target_kernel(host) == kernel:
        return host
    if kernel in CPU_KERNEL_TARGETS and tvm.target.codegen.llvm_get_system_triple().startswith("x86_64"):
        return tvm.target.Target(CPU_KERNEL_TARGETS[kernel])
    raise ValueError(f"not applicable: no build target for the CPU kernel {kernel} on this host")


def _plan_cpu(cand: Candidate):
    """(funcs, calling-convention fields) of a ``cpu_direct`` candidate: the inner kernel ``cand.arch`` with the
    candidate's tile, refused (the space's reason) before any TIR where the space refuses it."""
    from qcompile.schedules import cpu_conv, cpu_conv_vnni
    from qcompile.schedules.space import SPACES

    why = SPACES["cpu_direct"].legal(cand.spec, cand.arch, cand.knobs)
    if why is not None:
        raise ValueError(f"not applicable: {why}")
    tile = cpu_conv.effective_tile(cand.spec, cand.arch, cand.knobs)
    if cand.arch == cpu_conv.STRATEGY:
        func, w_cpu = cpu_conv.make_cpu_conv(cand.spec, "NHWC", tile), dict(pack="pairs", lanes=cpu_conv.LANES)
    else:
        isa = cpu_conv_vnni.ISAS[cand.arch]
        func = cpu_conv_vnni.make_cpu_conv_vnni(cand.spec, "NHWC", cpu_conv_vnni.VnniTile(cand.arch, tile.qt, tile.kt))
        flip = cpu_conv_vnni.flips_input(cand.spec, cand.arch)
        signed = cpu_conv.ConvSpec.storage(cand.spec.x_dtype) == "int8"
        w_cpu = dict(pack="quads", lanes=isa.lanes, bias_fold=(-128 if signed else 128) if flip else 0)
    return [func], dict(split_k=1, streamk=None, w_expand=False, w_kperm=0, label=cand.arch, w_cpu=w_cpu,
                        effective_knobs=knobs_dict(tile))


def plan_candidate(cand: Candidate, target: str = "cuda"):
    """(funcs, calling-convention fields) of a candidate: ``plan_conv`` for cuda (refusing a silent substitute); for
    llvm, a CPU kernel (``cpu_direct``) or the fallback kernel."""
    import warnings

    if target == "llvm":
        if cand.strategy == "cpu_direct":
            return _plan_cpu(cand)
        if cand.strategy != "fallback":
            raise ValueError(f"target llvm builds the CPU kernels (cpu_direct) and the fallback kernel, not "
                             f"{cand.strategy}")
        from qcompile.schedules.fallback import make_fallback

        return [make_fallback(cand.spec, "llvm")], dict(split_k=1, streamk=None, w_expand=False, w_kperm=0,
                                                        label="fallback")
    want = _KNOB_TYPES.get(cand.strategy)
    if cand.knobs is not None and want and type(cand.knobs).__name__ != want:
        raise ValueError(f"{cand.strategy} takes {want}, not {type(cand.knobs).__name__}")
    if cand.strategy in GROUPED_STRATEGIES:
        return _plan_grouped(cand)
    if cand.strategy == "grouped_gemm":
        return _plan_grouped_gemm(cand)
    from qcompile.schedules import plan_conv

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            pk = plan_conv(cand.spec, cand.arch, cand.strategy, cand.knobs)
        except Exception as e:
            why = _why_refused(cand)
            raise ValueError(f"not applicable: {why}" if why else _one_line(e)) from None
    for w in caught:  # (the wgmma knobs replaced by the mma.sync defaults: not this candidate's kernel)
        msg = str(w.message)
        if msg.startswith("qcompile.schedules:") and "do not apply" in msg:
            raise ValueError(f"not applicable: {msg[len('qcompile.schedules: '):]}")
    return list(pk.funcs), dict(split_k=pk.split_k, streamk=list(pk.streamk) if pk.streamk else None,
                                w_expand=bool(pk.w_expand), w_kperm=int(pk.w_kperm), label=pk.label,
                                effective_knobs=knobs_dict(pk.knobs),
                                workspace=list(pk.workspace_shape()) if pk.split_k > 1 else None)


def build_one(cand: Candidate, cid: str, out_dir: str, target: str = "cuda", mode: str = "sass") -> tuple:
    """Build one candidate to ``out_dir/<cid>.so``: (manifest entry or None, error line or None, build seconds)."""
    t0 = time.time()
    try:
        import tvm

        from qcompile.schedules.tuning import tuning_key

        funcs, conv = plan_candidate(cand, target)
        names = [f"{cid}_{i}" for i in range(len(funcs))]
        mod = tvm.IRModule({n: f.with_attr("global_symbol", n) for n, f in zip(names, funcs)})
        so = os.path.join(out_dir, cid + ".so")
        if target == "cuda":
            from qcompile.schedules.build import cuda_target, ensure_stub_libcuda, nvcc_options

            ensure_stub_libcuda()
            with nvcc_options(cand.arch, mode):
                lib = tvm.compile(mod, target=cuda_target(cand.arch))
        elif cand.strategy == "cpu_direct":
            lib = tvm.compile(mod, target=cpu_kernel_target(cand.arch))
        else:
            lib = tvm.compile(mod, target="llvm")
        lib.export_library(so)
        hazards = []
        if target == "cuda" and mode != "ptx" and getattr(cand.knobs, "areg", False):
            from qcompile.cuda_tools import wgmma_a_hazards_by_kernel

            hazards = [h for hs in wgmma_a_hazards_by_kernel(so).values() for h in hs]
            if hazards:
                os.unlink(so)
                raise RuntimeError(f"SASS hazard (a wgmma A fragment overwritten in flight): {hazards[0]}")
        entry = dict(id=cid, so=cid + ".so", target=target, arch=cand.arch, nvcc_mode=mode if target == "cuda" else None,
                     key=cand.key or tuning_key(cand.spec), spec=dataclasses.asdict(cand.spec),
                     strategy=cand.strategy, label=conv.pop("label"), knobs=knobs_dict(cand.knobs),
                     knobs_type=None if cand.knobs is None else type(cand.knobs).__name__,
                     effective_knobs=conv.get("effective_knobs"), funcs=names,
                     split_k=conv["split_k"], workspace=conv.get("workspace"), streamk=conv["streamk"],
                     w_expand=conv["w_expand"], w_kperm=conv["w_kperm"], build_s=round(time.time() - t0, 3))
        if conv.get("w_cpu"):
            entry["w_cpu"] = conv["w_cpu"]
        if conv.get("w_group"):
            entry["w_group"] = conv["w_group"]
        return entry, None, time.time() - t0
    except Exception as e:  # noqa: BLE001  (a refused or failed candidate is a result, not a crash)
        return None, _one_line(e) if not isinstance(e, ValueError) else str(e).splitlines()[0][:300], time.time() - t0


def _init_build_process(target: str):
    try:
        os.setpgrp()  # (its own process group: a hung build is killed with the nvcc / ptxas it started)
    except OSError:
        pass
    if target == "cuda":  # (before TVM's CUDA backend registers: the fatbin is embedded only with a libcuda)
        from qcompile.schedules.build import ensure_stub_libcuda

        ensure_stub_libcuda()


def _build_task(args):
    return build_one(*args)


def _run_task(fn, task):
    """Run a build task in a pool process, first marking its start (``out_dir/.started/<id>``: the builder's clock
    for the task's timeout)."""
    marks = os.path.join(task[2], ".started")
    os.makedirs(marks, exist_ok=True)
    with open(os.path.join(marks, task[1]), "w"):
        pass
    return fn(task)


def _started(task) -> float | None:
    """When a task's build started (its mark's time), or None."""
    try:
        return os.stat(os.path.join(task[2], ".started", task[1])).st_mtime
    except OSError:
        return None


# ---------------------------------------------------------------------------------------------------------------
# the builder
# ---------------------------------------------------------------------------------------------------------------
class LocalBuilder(Builder):
    """Builds candidates in ``jobs`` host processes (spawned once, reused across batches; ``jobs == 1``: in this
    process). Each ``build`` call writes one batch folder under ``build_dir``."""

    def __init__(self, jobs: int | None = None, build_dir: str | None = None, target: str = "cuda",
                 nvcc_mode: str = "sass", log=None, timeout: float = 300.0, task_fn=None):
        if target not in TARGETS:
            raise ValueError(f"target {target!r}: one of {TARGETS}")
        if nvcc_mode not in NVCC_MODES:
            raise ValueError(f"nvcc_mode {nvcc_mode!r}: one of {NVCC_MODES}")
        self.jobs = max(1, jobs or os.cpu_count() or 1)
        self.target, self.nvcc_mode, self.log = target, nvcc_mode, log
        self.timeout = timeout  # seconds one candidate may build (its process is killed after; jobs == 1: no limit)
        self.task_fn = task_fn or _build_task  # (a module-level function of one task tuple: tests replace it)
        self._own_dir = build_dir is None
        self.build_dir = build_dir or tempfile.mkdtemp(prefix="qtune-build-")
        os.makedirs(self.build_dir, exist_ok=True)
        self._pool = None
        self._batches = 0
        atexit.register(self.close)

    def _executor(self):
        if self._pool is None:
            import multiprocessing as mp

            self._pool = ProcessPoolExecutor(self.jobs, mp_context=mp.get_context("spawn"),
                                             initializer=_init_build_process, initargs=(self.target,))
        return self._pool

    def new_batch_dir(self) -> str:
        while True:
            self._batches += 1
            d = os.path.join(self.build_dir, f"batch_{self._batches:04d}")
            if not os.path.exists(d):
                os.makedirs(d)
                return d

    def build(self, cands: list[Candidate]) -> list[Built]:
        out_dir = self.new_batch_dir()
        ids = [candidate_id(c, self.target, self.nvcc_mode) for c in cands]
        first = {}
        for i, cid in enumerate(ids):
            first.setdefault(cid, i)
        tasks = [(cands[i], cid, out_dir, self.target, self.nvcc_mode) for cid, i in first.items()]
        results: dict = {}
        if self.jobs == 1:
            for t in tasks:
                results[t[1]] = self.task_fn(t)
                self._report(t[0], t[1], results[t[1]])
        else:
            self._build_parallel(tasks, results)
        entries = [results[cid][0] for cid in first if results[cid][0] is not None]
        with open(os.path.join(out_dir, "manifest.json"), "w") as f:
            json.dump(dict(format=FORMAT, target=self.target, candidates=entries), f, indent=1)
        built = []
        for c, cid in zip(cands, ids):
            entry, err, dt = results[cid]
            path = os.path.join(out_dir, entry["so"]) if entry else None
            built.append(Built(c, path, entry or {}, err, dt))
        return built

    def _build_parallel(self, tasks: list, results: dict) -> None:
        """All tasks at once in the pool. A build running longer than ``timeout`` seconds (from its start) is a build
        error: the pool's processes are killed and the other unfinished builds start again in a new pool. Where a
        build process dies, the unfinished tasks run again one at a time, so that the one that kills it is the one
        reported."""
        from concurrent.futures import FIRST_COMPLETED, wait
        from concurrent.futures import TimeoutError as FutureTimeout

        retry, todo = [], list(tasks)
        while todo:
            try:
                pool = self._executor()
                futs = {pool.submit(_run_task, self.task_fn, t): t for t in todo}
            except BrokenProcessPool:
                retry += todo
                break
            todo, pending = [], set(futs)
            while pending:
                done, pending = wait(pending, timeout=min(5.0, self.timeout), return_when=FIRST_COMPLETED)
                for fut in done:
                    t = futs[fut]
                    try:
                        results[t[1]] = fut.result()
                        self._report(t[0], t[1], results[t[1]])
                    except BrokenProcessPool:
                        retry.append(t)
                now = time.time()
                hung = [f for f in pending if (_started(futs[f]) or now) < now - self.timeout]
                if hung:  # (kill them; the others start again)
                    for f in hung:
                        t = futs[f]
                        results[t[1]] = (None, f"the build did not finish in {self.timeout:.0f} s (its process was "
                                               "killed)", self.timeout)
                        self._report(t[0], t[1], results[t[1]])
                    todo = [futs[f] for f in pending if f not in hung]
                    self._kill_pool()
                    for t in todo:  # (their clocks start again when they do)
                        try:
                            os.unlink(os.path.join(t[2], ".started", t[1]))
                        except OSError:
                            pass
                    break
        if retry:
            self._reset_pool()
        for t in retry:
            fut = self._executor().submit(_run_task, self.task_fn, t)
            try:
                results[t[1]] = fut.result(timeout=self.timeout)
            except BrokenProcessPool:
                results[t[1]] = (None, "the build process died (a crash in TVM or nvcc)", 0.0)
                self._reset_pool()
            except FutureTimeout:
                results[t[1]] = (None, f"the build did not finish in {self.timeout:.0f} s (its process was "
                                       "killed)", self.timeout)
                self._kill_pool()
            self._report(t[0], t[1], results[t[1]])

    def _kill_pool(self):
        """Kill the pool's processes (a build that hangs in C++ or nvcc does not answer a cancel)."""
        if self._pool is not None:
            import signal

            for p in list(getattr(self._pool, "_processes", {}).values()):
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except (OSError, AttributeError):
                    try:
                        p.kill()
                    except (OSError, AttributeError):
                        pass
            self._reset_pool()

    def _report(self, cand, cid, res):
        if self.log:
            entry, err, dt = res
            self.log(f"built {cid} {cand.strategy} {dt:.1f} s" + (f": {err}" if err else ""))

    def _reset_pool(self):
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def close(self):
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        if self._own_dir and os.path.isdir(self.build_dir):
            shutil.rmtree(self.build_dir, ignore_errors=True)
