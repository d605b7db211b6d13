"""The compilation pipeline: every pass from the QDQ form to the module TVM's code generators take, in order.

It is registered with TVM as the Relax pipeline ``"qcompile"`` (``relax.get_pipeline("qcompile", ...)``, as mlc-llm
registers its own) and runs inside ``tvm.compile``, which then generates the VM code and the kernels::

    phase                              passes                                                IR dump (--dump-ir DIR)
    1  frontend (before the pipeline)  ONNX QDQ / PT2E / HAWQ -> QDQ-form Relax              1_qdq.py (its input)
    2  integer lowering                LowerQDQToInteger(layout): int8/int4 conv/dense with  2_integer.py
                                       int32 accumulation, fixed-point requantize, BN/bias/
                                       ReLU/residual folded, layout applied
    3  kernels and 4-bit packing       cuda with NHWC or HWNC: DispatchTensorCore(arch),     3_dispatched.py
                                       DispatchPools (each conv/dense on a tensor-core kernel)
                                       PackInt4: 4-bit weights (and, without tensor-core     3_packed.py
                                       kernels, activations) two per byte
    4  deployment form                 LiftWeights (--weights-beside); AttachMetadata: the   4_deploy.py
                                       ``qcompile_meta`` function
    5  backend                         TVM's Relax lowering for the target (legalize, fuse,  5_lowered.py
                                       schedule; cuda: qcompile's glue schedules before
                                       dlight's rules, one CUDA graph, one PrimFunc per
                                       distinct kernel); then TVM's code generation (cuda:
                                       one module per kernel, nvcc in parallel through the
                                       kernel cache, schedules/build.py)

``dump_dir`` (``--dump-ir DIR``, or the environment variable ``QCOMPILE_DUMP_IR``) writes the module after each
phase (``show_meta=False``: constants are not printed). ``record`` (a :class:`PipelineRecord`) receives what the
driver reports: the integer module, the kernel of each layer, the lifted weights.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np
import tvm
import tvm_ffi
from tvm import relax

from qcompile.errors import run_pass
from qcompile.relay_passes import DispatchPools, DispatchTensorCore, LowerQDQToInteger, PackInt4
from qcompile.relay_passes.dispatch_cpu import cpu_kernels_enabled, cpu_kernels_target, has_cpu_kernels
from qcompile.relay_passes.lift_weights import LiftWeights
from qcompile.runtime import META_FUNC, weights_digest


@dataclass
class PipelineRecord:
    """What a pipeline run leaves for its caller."""
    integer_mod: Optional[tvm.IRModule] = None  # after phase 2 (what qcompile.reference.Reference interprets)
    kernels: dict = field(default_factory=dict)  # conv/dense binding name -> tensor-core strategy (or "fallback")
    knob_sources: list = field(default_factory=list)  # per implicit-GEMM layer: device / arch / nearest / default
    knobs: dict = field(default_factory=dict)  # conv/dense binding name -> its knobs source (implicit-GEMM layers)
    weights: list = field(default_factory=list)  # values of main's lifted weight parameters (weights_beside)
    planned: list = field(default_factory=list)  # (conv/dense binding name, PlannedKernel) per tensor-core layer
    input_quant: Optional[dict] = None  # an integer input's quantization (InputQuant.to_meta()); None: a float input


def _target(target) -> tvm.target.Target:
    if isinstance(target, tvm.target.Target):
        return target
    return tvm.target.Target({"kind": target} if isinstance(target, str) else target)


def _no_placeholders() -> tvm.transform.Pass:
    """Refuse a module holding a placeholder kernel (``schedules.plan_only()``: the tuner's task extraction, which
    never builds) before the backend would compile an empty function in its place."""

    @tvm.transform.module_pass(opt_level=0, name="qcompile.no_placeholders")
    def _pass(mod, _ctx):
        from qcompile.schedules.planned import PLACEHOLDER_ATTR

        for gv, f in mod.functions.items():
            if isinstance(f, tvm.tirx.PrimFunc) and f.attrs is not None and PLACEHOLDER_ATTR in f.attrs:
                raise RuntimeError(f"kernel {gv.name_hint} is a placeholder of schedules.plan_only(): a module planned "
                                   "for task extraction cannot be built")
        return mod

    return _pass


def _phase_end(name: str, dump_dir: Optional[str], on_phase: Optional[Callable]) -> tvm.transform.Pass:
    """After a phase: write the module to ``dump_dir/name.py`` and call ``on_phase(name, mod)``."""

    @tvm.transform.module_pass(opt_level=0, name=f"qcompile.after_{name}")
    def _after(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        if dump_dir:
            os.makedirs(dump_dir, exist_ok=True)
            with open(os.path.join(dump_dir, f"{name}.py"), "w") as f:
                f.write(mod.script(show_meta=False))
        if on_phase is not None:
            on_phase(name, mod)
        return mod

    return _after


def _record_integer(record: PipelineRecord, lower) -> tvm.transform.Pass:
    """After ``lower`` (a ``LowerQDQToInteger``): the integer module and the input's quantization into ``record``."""

    @tvm.transform.module_pass(opt_level=0, name="qcompile.record_integer")
    def _rec(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        record.integer_mod = mod
        record.input_quant = lower.input_quant.to_meta() if lower.input_quant is not None else None
        return mod

    return _rec


def _tensor_cores(arch: str, expand_w4: bool, record: PipelineRecord, tuning_logs=(), gpu=None) -> tvm.transform.Pass:
    """Phase 3: each requantized conv/dense on a tensor-core kernel (``DispatchTensorCore``), 8-bit NHWC max pools on
    qcompile's pool kernel (``DispatchPools``); ``record.kernels`` names each layer's kernel by its conv/dense binding
    (the dispatcher reports requantize outputs)."""
    from qcompile.relay_passes.dispatch_tensor_core import find_groups

    @tvm.transform.module_pass(opt_level=0, name="qcompile.tensor_cores")
    def _dispatch(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        p = DispatchTensorCore(arch, expand_w4=expand_w4, tuning_logs=tuning_logs, device=gpu)
        out = DispatchPools()(p(mod))
        func = mod["main"]
        chosen, sources = dict(p.chosen), dict(p.sources)
        for acc_out, g in find_groups(func).items():
            name = [b.var.name for blk in func.body.blocks for b in blk.bindings if b.value.same_as(g.acc_call)]
            if name and acc_out.name in chosen:
                record.kernels[name[0]] = chosen[acc_out.name]
            if name and acc_out.name in sources:
                record.knobs[name[0]] = sources[acc_out.name]
        record.knob_sources = [s for _, s in p.sources]
        by_out = dict(p.planned)
        for acc_out, g in find_groups(func).items():
            name = [b.var.name for blk in func.body.blocks for b in blk.bindings if b.value.same_as(g.acc_call)]
            if name and acc_out.name in by_out:
                record.planned.append((name[0], by_out[acc_out.name]))
        return out

    return _dispatch


def _cpu_kernels(record: PipelineRecord, target: tvm.target.Target, after: tvm.transform.Pass,
                 tuning_logs=()) -> tvm.transform.Pass:
    """Phase 3 on llvm: each requantized conv/dense on qcompile's CPU kernel (``DispatchCPU``), then ``after``;
    ``record.kernels`` names each layer's kernel by its conv/dense binding. Only for a target that already enables
    a kernel's instructions (``cpu_conv.target_kernel``: AVX2 / VNNI on x86, dotprod on aarch64), whose kernel it
    runs (its tiles from ``tuning_logs`` and the packaged logs, ``record.knobs`` / ``record.planned`` as on CUDA): the target ``tvm.compile`` runs the pipeline under (the one that generates the code), else -- the pipeline
    run on its own -- ``target``. Otherwise the module is left to the generic path."""
    from qcompile.relay_passes.dispatch_cpu import DispatchCPU
    from qcompile.relay_passes.dispatch_tensor_core import find_groups
    from qcompile.schedules.cpu_conv import target_kernel

    @tvm.transform.module_pass(opt_level=0, name="qcompile.cpu_kernels")
    def _dispatch(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        kernel = target_kernel(tvm.target.Target.current(allow_none=True) or target)
        if kernel is None:
            return mod
        p = DispatchCPU(kernel, tuning_logs)
        out = p(mod)
        func, chosen, sources, planned = mod["main"], dict(p.chosen), dict(p.sources), dict(p.planned)
        for acc_out, g in find_groups(func, layouts=("NCHW", "NHWC")).items():
            name = [b.var.name for blk in func.body.blocks for b in blk.bindings if b.value.same_as(g.acc_call)]
            if name and acc_out.name in chosen:
                record.kernels[name[0]] = chosen[acc_out.name]
            if name and acc_out.name in sources:
                record.knobs[name[0]] = sources[acc_out.name]
            if name and acc_out.name in planned:
                record.planned.append((name[0], planned[acc_out.name]))
        return after(out)

    return _dispatch


def _runs_cpu_kernels(pipeline: Optional[tvm.transform.Pass]) -> bool:
    """Whether ``pipeline`` (a :func:`qcompile_pipeline`) has the CPU-kernel phase."""
    return isinstance(pipeline, tvm.transform.Sequential) and any(
        p.info.name == "qcompile.cpu_kernels" for p in pipeline.passes)


def _pack_int4(record: PipelineRecord) -> tvm.transform.Pass:
    """Phase 3, packing: weights only where tensor-core kernels run (the dispatcher already packs what they read, and
    glue reads bytes); otherwise weights and activations."""

    @tvm.transform.module_pass(opt_level=0, name="qcompile.pack_int4")
    def _pack(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return PackInt4(activations=not record.kernels)(mod)

    return _pack


def _lift_weights(record: PipelineRecord) -> tvm.transform.Pass:
    @tvm.transform.module_pass(opt_level=0, name="qcompile.lift_weights")
    def _lift(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        lift = LiftWeights()
        out = lift(mod)
        record.weights = lift.values
        return out

    return _lift


def _attach_metadata(meta: dict, record: PipelineRecord) -> tvm.transform.Pass:
    """Add the ``qcompile_meta`` function (``qcompile.runtime.META_FUNC``): it returns ``meta`` as JSON bytes, with
    ``output_shape`` (of ``main`` at this point), ``input_quant`` (an integer input's scale, zero point, dtype,
    layout and range; None for a float input) and, for weights beside the .so, ``num_weights`` and
    ``weights_sha256`` filled in (``meta`` is updated in place)."""

    @tvm.transform.module_pass(opt_level=0, name="qcompile.attach_metadata")
    def _attach(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        out_ty = mod["main"].ret_ty if hasattr(mod["main"], "ret_ty") else None
        meta["output_shape"] = ([int(s) for s in out_ty.shape] if out_ty is not None and hasattr(out_ty, "shape")
                                else None)
        meta["input_quant"] = record.input_quant
        meta["num_weights"] = len(record.weights)
        if meta.get("weights") == "beside":
            meta["weights_sha256"] = weights_digest(record.weights)
        bb = relax.BlockBuilder(mod)
        with bb.function(META_FUNC, []):
            bb.emit_func_output(relax.const(np.frombuffer(json.dumps(meta).encode(), np.uint8).copy(), "uint8"))
        return bb.get()

    return _attach


def dedup_prim_funcs() -> tvm.transform.Pass:
    """One PrimFunc for every set of PrimFuncs equal but for their names (layers with the same shape, knobs and
    requantize constants get the same kernel from the dispatcher under different names): the calls of the others
    go to the first by name, and the others leave the module, so TIR lowering, code generation and nvcc see each
    kernel once."""

    @relax.expr_functor.mutator
    class _Rename(relax.PyExprMutator):
        def __init__(self, mod, to):
            super().__init__(mod)
            self.to = to

        def visit_global_var_(self, op):
            return self.to.get(op, op)

    @tvm.transform.module_pass(opt_level=0, name="qcompile.dedup_prim_funcs")
    def _dedup(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        buckets: dict = {}
        to: dict = {}
        for gv, f in sorted(mod.functions.items(), key=lambda kv: kv[0].name_hint):
            if not isinstance(f, tvm.tirx.PrimFunc):
                continue
            body = f.without_attr("global_symbol") if "global_symbol" in (f.attrs or {}) else f
            same = buckets.setdefault(tvm_ffi.structural_hash(body, map_free_vars=True), [])
            first = next((g for g, b in same if tvm_ffi.structural_equal(b, body, map_free_vars=True)), None)
            if first is None:
                same.append((gv, body))
            else:
                to[gv] = first
        if not to:
            return mod
        funcs = {}
        for gv, f in mod.functions.items():
            if gv in to:
                continue
            if isinstance(f, relax.Function):
                f = _Rename(mod, to).visit_expr(f)
            funcs[gv] = f
        out = tvm.IRModule(funcs, global_infos=dict(mod.global_infos))
        return out.with_attrs(mod.attrs) if mod.attrs is not None else out

    return _dedup


def cuda_pipeline(target) -> tvm.transform.Pass:
    """Phase 5 on CUDA: TVM's CUDA Relax lowering with qcompile's glue schedules tried before dlight's generic
    rules, then one PrimFunc per distinct kernel (:func:`dedup_prim_funcs`)."""
    from tvm.relax.backend.cuda import pipeline as cp
    from tvm.s_tir import dlight as dl

    from qcompile.schedules.glue import (ChannelsLastWindowReduction, GatherRowElementwise, Guarded,
                                         VectorizedElementwise)

    @tvm.transform.module_pass(opt_level=0, name="qcompile.cuda_pipeline")
    def _pipeline(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        with target:
            legalize = cp.legalize_passes(target)
            # the last legalize pass is dlight's ApplyDefaultSchedule: put our glue rules first (element-wise, pools)
            legalize[-1] = dl.ApplyDefaultSchedule(GatherRowElementwise(), VectorizedElementwise(),
                                                   ChannelsLastWindowReduction(),
                                                   dl.gpu.Matmul(), Guarded(dl.gpu.GEMV()), dl.gpu.Reduction(),
                                                   dl.gpu.GeneralReduction(), dl.gpu.Fallback())
            seq = tvm.transform.Sequential(cp.library_dispatch_passes(target) + legalize
                                           + cp.dataflow_lower_passes(target) + cp.finalize_passes(target)
                                           + [dedup_prim_funcs()])
            return seq(mod)

    return _pipeline


@relax.register_pipeline("qcompile")
def qcompile_pipeline(target="llvm", layout: str = "NCHW", *, pack_int4: bool = True, expand_w4: bool = True,
                      weights_beside: bool = False, meta: Optional[dict] = None, integer: bool = True,
                      backend: bool = True, dump_dir: Optional[str] = None, record: Optional[PipelineRecord] = None,
                      on_phase: Optional[Callable] = None, tuning_logs=(), gpu: Optional[str] = None,
                      cpu_kernels: bool = True, input_dtype: str = "float32",
                      input_layout: str = "NCHW") -> tvm.transform.Pass:
    """The whole pass order (see the module docstring) as one pass over a QDQ-form module.

    ``target``: a kind ("llvm", "cuda"), a JSON-dict target or a ``tvm.target.Target`` (cuda: its ``arch`` picks the
    kernels). ``expand_w4``: 4-bit weights of the layers whose tuning record says so expanded to 8 bits (tensor-core
    kernels). ``meta``: the metadata the ``.so`` carries (phase 4; None: no metadata function). ``integer=False``:
    the module is already in integer form, run the backend only; ``backend=False``: stop before it (the result is
    integer Relax). ``on_phase(name, mod)`` is called after each phase, with its dump's name. ``tuning_logs`` (files
    or folders searched before the packaged logs) and ``gpu`` (the GPU name records are matched against) choose the
    tensor-core kernels' knobs. ``cpu_kernels``: on llvm, convs and dense layers on qcompile's CPU kernel where the
    target enables one (``cpu_conv.target_kernel``: AVX2 / VNNI on x86, dotprod on aarch64; the target
    ``tvm.compile`` runs the pipeline under, else ``target``; :func:`build` picks the host's best x86 level for a
    plain ``llvm`` target on an AVX2 host);
    ``QCOMPILE_CPU_KERNELS=0`` or False: TVM's generic lowering. ``input_dtype`` (float32, int8, uint8) and
    ``input_layout`` (NCHW, NHWC): what ``main`` takes; int8 / uint8 fold the model's input quantize away (the input
    is its integer tensor; ``record.input_quant`` and the metadata's ``input_quant`` give its scale and zero point)."""
    tgt = _target(target)
    dump_dir = dump_dir or os.environ.get("QCOMPILE_DUMP_IR")
    record = record if record is not None else PipelineRecord()
    after = lambda name: _phase_end(name, dump_dir, on_phase)
    passes = []
    if integer:
        lower = LowerQDQToInteger(layout, input_dtype, input_layout)
        passes += [after("1_qdq"), lower, _record_integer(record, lower), after("2_integer")]
        if tgt.kind.name == "cuda" and layout != "NCHW":
            passes += [_tensor_cores(str(tgt.attrs["arch"]), expand_w4, record, tuple(tuning_logs or ()), gpu),
                       after("3_dispatched")]
        elif tgt.kind.name == "llvm" and cpu_kernels and cpu_kernels_enabled():
            passes += [_cpu_kernels(record, tgt, after("3_dispatched"), tuple(tuning_logs or ()))]
        if pack_int4:
            passes += [_pack_int4(record), after("3_packed")]
        deploy = [_lift_weights(record)] if weights_beside else []
        deploy += [_attach_metadata(meta, record)] if meta else []
        if deploy:
            passes += deploy + [after("4_deploy")]
    if backend:
        backend_pass = cuda_pipeline(tgt) if tgt.kind.name == "cuda" else relax.get_pipeline("default_build")
        passes += [_no_placeholders(), backend_pass, after("5_lowered")]
    return tvm.transform.Sequential(passes, name="qcompile")


def lower_to_integer(mod_qdq: tvm.IRModule, layout: str = "NCHW", pack_int4: bool = True,
                     dump_dir: Optional[str] = None) -> tvm.IRModule:
    """The pipeline's integer phases for the CPU -- lowering and, with ``pack_int4``, 4-bit packing: QDQ form ->
    integer Relax (what tests and ``qcompile.reference.Reference`` take)."""
    with tvm.transform.PassContext(opt_level=3):
        return run_pass(qcompile_pipeline("llvm", layout, pack_int4=pack_int4, backend=False, dump_dir=dump_dir,
                                          cpu_kernels=False),
                        mod_qdq)


def build(mod: tvm.IRModule, target="llvm", cuda_graph: bool = True, pipeline: Optional[tvm.transform.Pass] = None):
    """``tvm.compile`` with the qcompile pipeline for ``target`` (a kind or a JSON-dict target); returns a VM
    executable. ``pipeline``: a configured :func:`qcompile_pipeline`; by default the backend phase alone, for a module
    already in integer form.

    On llvm the codegen target is decided here, once, and ``tvm.compile`` runs the pipeline under it: where the
    pipeline runs the CPU kernels (or ``mod`` already holds them), a plain ``llvm`` target on an x86-64 host with AVX2
    becomes the host's best kernel target (x86-64-v4 + AVX-512 VNNI, x86-64-v3 + AVX-VNNI or x86-64-v3:
    ``dispatch_cpu.cpu_kernels_target``); otherwise, and for a target naming ``mtriple`` /
    ``mcpu`` / ``mattr``, the target is used as given.

    On CUDA the whole forward pass is captured once and replayed as a CUDA graph
    (``relax.backend.use_cuda_graph``), so batch-1 latency is not dominated by kernel launches."""
    tgt = _target(target)
    if tgt.kind.name == "llvm":  # the codegen target, decided once: the pipeline runs under it (tvm.compile)
        from qcompile.schedules.cpu_conv import cpu_target

        if has_cpu_kernels(mod):  # already dispatched: the kernels need their target whatever the switch says
            tgt = cpu_target(tgt)
        elif _runs_cpu_kernels(pipeline):  # the host's best on an AVX2 host (plain llvm), else as given
            tgt = cpu_kernels_target(tgt) or tgt
    pipeline = pipeline or qcompile_pipeline(tgt, integer=False)
    config = {"relax.backend.use_cuda_graph": cuda_graph} if tgt.kind.name == "cuda" else {}
    with tvm.transform.PassContext(opt_level=3, config=config):
        return run_pass(lambda m: tvm.compile(m, target=tgt, relax_pipeline=pipeline), mod)
