"""Tuning tasks: the distinct tensor-core kernels of a model, exactly as ``qcompile`` will look their records up.

``extract_tasks(model, arch, batches, layout, ...)`` imports the model as ``qcompile`` does (``driver.import_model``:
ONNX QDQ, float ONNX with ``--bits``/``--calibrate``, PT2E, HAWQ) once per batch size, and runs the compilation
pipeline (``pipeline.qcompile_pipeline``) as far as the kernel dispatch -- integer lowering and
``DispatchTensorCore``, no packing, no backend, no nvcc. The dispatcher leaves, per tensor-core layer and per grouped
conv (``spec.groups`` > 1: the tensor-core ``grouped_gemm`` where a group's channels allow it, else the CUDA-core
``depthwise`` / ``grouped``), the kernel it planned (``PipelineRecord.planned``: the ConvSpec after the stem's
space-to-depth rewrite -- a ``grouped_gemm`` layer's as that kernel takes it, ``grouped_gemm.gemm_spec`` --, the
strategy ``select_strategy`` or ``grouped_gemm.grouped_kernel`` took, the knobs the logs gave). Layers with the same
``tuning_key(spec)`` and strategy are one task: one record serves them all, and the task's weight is how many layers
use it. The dispatch runs under ``schedules.plan_only()``: the kernel builders make every legality check and plan
as ``qcompile`` does and return placeholder PrimFuncs instead of building the kernels' TIR, which no task needs
(``build=True``: the kernels built, the same tasks). With ``target="llvm"`` the
pipeline runs as far as the CPU kernels' dispatch (``DispatchCPU``) for this host's build target instead: each NHWC
layer on a CPU kernel is a ``cpu_direct`` task whose ``arch`` is the inner kernel (:func:`cpu_arch`); the CPU kernels
are built (a model has few distinct ones).

Each task carries a time estimate before anything is measured: a roofline of the arch's nominal peaks
(``ARCH_PEAKS``: integer tensor-core throughput, DRAM bandwidth of the reference part) plus a launch cost,
``est_ms = max(ops / peak, bytes / bandwidth) + LAUNCH_MS`` (a grouped conv's ops are its own, the MACs over
``groups``; its peak is the tensor cores' on ``grouped_gemm``, dp4a's on the CUDA-core kernels); ``share`` is the
task's part of the model's tensor-core time, weight x time over the sum. Once the default knobs are measured,
``set_shares`` replaces the estimate with the measured default time (the scheduler does this after its baseline
round).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

from qcompile.schedules.spec import ConvSpec

# Nominal dense peaks per arch, of the part named (what a roofline needs; only the ratios between tasks matter):
# (int8 tensor-core TOPS, 4-bit TOPS as the kernels run it, DRAM GB/s). sm_90 unpacks 4-bit to 8-bit for the MMA.
ARCH_PEAKS = {
    "sm_75": (130.0, 260.0, 320.0),    # T4
    "sm_80": (624.0, 1248.0, 2039.0),  # A100 SXM 80GB
    "sm_86": (250.0, 500.0, 600.0),    # A10
    "sm_89": (242.0, 485.0, 300.0),    # L4
    "sm_90": (1979.0, 1979.0, 3350.0),  # H100 SXM
}
LAUNCH_MS = 0.003  # a kernel's fixed cost (launch, fill and drain), CUDA graph replay
# The CPU inner kernels (``cpu_direct``; the arch is the kernel): nominal int8 GOPS of one core at 3 GHz (the
# instruction's multiply-adds per cycle, two ports) and the host's memory bandwidth (GB/s, shared by the cores)
CPU_PEAKS = {"cpu_direct_vnni": (768.0, 20.0), "cpu_direct_avxvnni": (384.0, 20.0), "cpu_direct_avx2": (192.0, 20.0),
             "cpu_direct_sdot": (192.0, 20.0)}
CPU_CALL_MS = 0.005  # a CPU kernel call's fixed cost (the thread pool's fork and join)
# The grouped convs' CUDA-core kernels (``depthwise``, ``grouped``: dp4a on the integer ALUs): nominal int8 TOPS of
# the reference part (SMs x 64 dp4a a clock x 8 ops x boost clock)
DP4A_TOPS = {"sm_75": 32.6, "sm_80": 78.0, "sm_86": 62.0, "sm_89": 60.0, "sm_90": 115.0}


@dataclass
class Task:
    key: str  # schedules.tuning.tuning_key(spec)
    spec: ConvSpec
    strategy: str  # what select_strategy took (the records qcompile looks up are this strategy's)
    arch: str
    layers: list  # conv/dense binding names that run this kernel
    source: str = ""  # where the planned knobs came from (device / arch / nearest / default)
    planned_knobs: object = None  # the knobs the logs gave when the tasks were extracted (None: the kernel's own)
    est_ms: float = 0.0  # roofline estimate of one layer
    default_ms: Optional[float] = None  # measured time of the default knobs (the scheduler fills it in)
    share: float = 0.0  # of the model's tensor-core time (weight x time / sum)
    extra: dict = field(default_factory=dict)

    @property
    def weight(self) -> int:
        return len(self.layers)

    @property
    def batch(self) -> int:
        return self.spec.N

    @property
    def gemm(self) -> tuple:
        """(M, N, K) of the conv as a GEMM."""
        return tuple(self.spec.gemm_shape())

    @property
    def ops(self) -> int:
        """Integer ops of one layer (a grouped conv: ``ConvSpec.macs`` over ``groups``)."""
        return 2 * self.spec.macs() // self.spec.groups

    @property
    def label(self) -> str:
        more = f" +{self.weight - 1}" if self.weight > 1 else ""
        return f"{self.layers[0]}{more} b{self.spec.N}"


# the grouped convs' kernels on tensor cores (8-bit operands: the int8 peak), the others on CUDA cores (dp4a)
TENSOR_CORE_GROUPED = ("grouped_gemm",)


def estimate_ms(spec: ConvSpec, arch: str, strategy: Optional[str] = None) -> float:
    """Roofline time of one conv on ``arch`` (``ARCH_PEAKS``; another sm_9x takes sm_90's; a CPU kernel:
    ``CPU_PEAKS`` times this host's cores). A grouped conv (``spec.groups`` > 1) does ``macs / groups``
    multiply-adds, at the int8 tensor-core peak on ``strategy`` ``grouped_gemm`` (``TENSOR_CORE_GROUPED``), else
    at dp4a's (``DP4A_TOPS``)."""
    x = spec.N * spec.H * spec.W * spec.C * spec.x_bits / 8
    w = spec.K * spec.R * spec.S * spec.C // spec.groups * spec.w_bits / 8
    out = spec.N * spec.P * spec.Q * spec.K * spec.out_bits / 8
    res = out if spec.has_residual else 0
    if arch in CPU_PEAKS:
        import os

        gops, bw = CPU_PEAKS[arch]
        peak = gops * (os.cpu_count() or 1)
        return max(2 * spec.macs() / (peak * 1e6), (x + w + out + res) / (bw * 1e6)) + CPU_CALL_MS
    ref = "sm_90" if arch.startswith("sm_9") else arch if arch in ARCH_PEAKS else "sm_80"
    i8, i4, bw = ARCH_PEAKS[ref]
    peak = i4 if spec.x_bits == 4 and spec.w_bits == 4 else i8
    if spec.groups != 1:  # (C / groups channels per output: grouped_gemm on tensor cores, else dp4a on CUDA cores)
        peak = i8 if strategy in TENSOR_CORE_GROUPED else DP4A_TOPS[ref]
    return max(2 * spec.macs() // spec.groups / (peak * 1e9), (x + w + out + res) / (bw * 1e6)) + LAUNCH_MS


def merge_models(per_model: list, names: list) -> list:
    """One task list for several models (``per_model[i]``: the tasks of model ``names[i]``, :func:`extract_tasks`):
    a task of the same key and strategy in several models is one task, measured once -- the first model's, with the
    others' in ``extra["others"]`` (each task carries its model's name in ``extra["model"]``)."""
    out, seen = [], {}
    for name, tasks in zip(names, per_model):
        for t in tasks:
            t.extra["model"] = name
            first = seen.get((t.key, t.strategy))
            if first is None:
                seen[(t.key, t.strategy)] = t
                out.append(t)
            else:
                first.extra.setdefault("others", []).append(t)
    return out


def members(t: Task) -> list:
    """The task as each model that runs it has it: ``t`` and its ``merge_models`` others."""
    return [t, *t.extra.get("others", ())]


def set_shares(tasks: list, measured: bool = True) -> None:
    """Each task's share of the model's tensor-core time: weight x (measured default time where known and
    ``measured``, else the estimate), over the sum; shares of one batch size sum to 1. Tasks of several models
    (``merge_models``): each model's own share in ``extra["model_share"]``, and ``share`` the mean over the models of
    that batch size (a task one model lacks counts 0 there), so each model's time weighs the same."""
    by_batch: dict = {}
    for t in tasks:
        for m in members(t):
            if m is not t:
                m.default_ms = t.default_ms  # (the same record: one key, one GPU)
            by_batch.setdefault((m.extra.get("model"), m.extra.get("model_batch", m.spec.N)), []).append(m)
    for group in by_batch.values():
        def cost(t):
            ms = t.default_ms if measured and t.default_ms else None
            if ms is None and measured and any(u.default_ms for u in group):
                # (some measured, this one not: scale its estimate by the measured / estimated ratio of the others)
                known = [u for u in group if u.default_ms]
                ms = t.est_ms * sum(u.default_ms * u.weight for u in known) / sum(u.est_ms * u.weight for u in known)
            return t.weight * (ms if ms is not None else t.est_ms)
        total = sum(cost(t) for t in group) or 1.0
        for t in group:
            t.share = t.extra["model_share"] = cost(t) / total
    models: dict = {}  # batch -> the models that have tasks at it
    for model, batch in by_batch:
        models.setdefault(batch, set()).add(model)
    for t in tasks:
        t.share = sum(m.extra["model_share"] for m in members(t)) / len(models[t.extra.get("model_batch", t.spec.N)])


def tasks_from_planned(planned: list, arch: str) -> list:
    """Tasks from a ``PipelineRecord.planned`` list of (layer name, PlannedKernel or, on llvm,
    ``dispatch_cpu.CpuPlanned``), in first-use order; layers on the generic kernel (``fallback``: no knobs) are no
    task. ``arch``: the sm_XX, or the CPU inner kernel."""
    from qcompile.schedules.tuning import tuning_key

    from qcompile.schedules.tuning import RECORD_STRATEGIES

    out: dict = {}
    for name, pk in planned:
        if pk.strategy not in RECORD_STRATEGIES:  # (the generic kernel: no knobs, nothing to tune)
            continue
        k = (tuning_key(pk.spec), pk.strategy)
        if k not in out:
            out[k] = Task(k[0], pk.spec, pk.strategy, arch, [], pk.source, pk.knobs,
                          estimate_ms(pk.spec, arch, pk.strategy))
        out[k].layers.append(name)
    tasks = list(out.values())
    set_shares(tasks, measured=False)
    return tasks


def tasks_from_module(mod_qdq, arch: str, layout: str = "NHWC", tuning_logs=(), gpu: Optional[str] = None,
                      target: str = "cuda", build: bool = False) -> list:
    """The tasks of a QDQ-form module (phase 1's output): the pipeline up to the tensor-core dispatch (``target``
    cuda), or up to the CPU kernels' dispatch (llvm: ``arch`` is the CPU inner kernel the host's build target runs,
    :func:`cpu_arch`). The pipeline stops after the dispatch (no packing, no backend), which runs under
    ``schedules.plan_only()`` unless ``build``: the plans alone, the kernels' TIR placeholders."""
    import tvm

    from qcompile.errors import run_pass
    from qcompile.pipeline import PipelineRecord, qcompile_pipeline
    from qcompile.schedules import plan_only

    record = PipelineRecord()
    tgt = {"kind": "cuda", "arch": arch} if target == "cuda" else cpu_build_target()
    pipeline = qcompile_pipeline(tgt, layout, pack_int4=False, backend=False,
                                 record=record, tuning_logs=tuple(tuning_logs or ()), gpu=gpu)
    with tvm.transform.PassContext(opt_level=3), plan_only(not build and target == "cuda"):
        run_pass(pipeline, mod_qdq)
    return tasks_from_planned(record.planned, arch)


def cpu_build_target():
    """The codegen target of ``qcompile --target llvm`` on this host where the CPU kernels run (what
    ``pipeline.build`` picks: ``dispatch_cpu.cpu_kernels_target``), else None."""
    import tvm

    from qcompile.relay_passes.dispatch_cpu import cpu_kernels_target

    return cpu_kernels_target(tvm.target.Target({"kind": "llvm"}))


def cpu_arch() -> Optional[str]:
    """The CPU inner kernel ``qcompile --target llvm`` runs on this host (``cpu_direct_vnni``, ``cpu_direct_avxvnni``,
    ``cpu_direct_avx2``; the arch of its tasks and records), or None (no CPU kernel here, or
    ``QCOMPILE_CPU_KERNELS=0``)."""
    from qcompile.schedules.cpu_conv import target_kernel

    tgt = cpu_build_target()
    return None if tgt is None else target_kernel(tgt)


def extract_tasks(model: str, arch: str, batches=(1,), layout: str = "NHWC", bits: Optional[str] = None,
                  net: Optional[str] = None, input_size: Optional[int] = None, calibrate: Optional[str] = None,
                  tuning_logs=(), gpu: Optional[str] = None, log: Callable = print, target: str = "cuda",
                  build: bool = False) -> list:
    """The distinct tuning tasks of ``model`` (a file qcompile takes) for each batch size, in order: batch by batch,
    first-use order within one. A task seen at two batch sizes is two tasks (the batch is part of the key).
    ``target`` llvm: the CPU kernels' layers (``arch``: :func:`cpu_arch`). ``build``: build the kernels' TIR as
    ``qcompile`` does (:func:`tasks_from_module`; the same tasks, slower)."""
    from qcompile.driver import CompileOptions, import_model, model_bits
    from qcompile.errors import QCompileError

    tasks: list = []
    for batch in batches:
        opts = CompileOptions(bits=bits, layout=layout, target=target, arch=arch if target == "cuda" else None,
                              batch=batch, calibrate=calibrate, net=net, input_size=input_size)
        mod_qdq, info = import_model(model, opts, log)
        found = model_bits(mod_qdq)
        if bits is not None and bits != found and info.get("format") != "float":
            raise QCompileError(f"--bits {bits} conflicts with '{model}', which is quantized as '{found}' "
                                f"(omit --bits for an already-quantized model)")
        got = tasks_from_module(mod_qdq, arch, layout, tuning_logs, gpu, target, build)
        for t in got:
            t.extra["model_batch"] = batch
        tasks += got
    return tasks
