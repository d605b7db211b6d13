"""DispatchCPU: run integer conv2d/dense + requantize on qcompile's CPU kernels (x86 AVX-512 VNNI / AVX-VNNI
``vpdpbusd`` and aarch64 ``sdot``, ``schedules/cpu_conv_vnni.py``; x86 AVX2 ``vpmaddwd``, ``schedules/cpu_conv.py``).

Matches the same chains as :mod:`.dispatch_tensor_core` (``find_fusions``: a requantized conv or dense, and a
quantized residual add fused into the conv whose output it alone reads), in NCHW or NHWC, and replaces each by a
``call_tir`` of one inner kernel for the whole module, whose fused epilogue computes the chain exactly: the one the
codegen target enables (``cpu_conv.target_kernel``: ``cpu_direct_vnni``, ``cpu_direct_avxvnni``,
``cpu_direct_avx2`` or ``cpu_direct_sdot``; ``cpu_direct_amx`` for a target with AMX, whose layers that AMX does not
take, ``cpu_conv_amx.applies_amx``, run ``cpu_direct_vnni``). The kernel reads and writes the graph's own layout
(no layout transform in the graph); weights (and, for the dot-product kernels, the bias with the input flip folded
in) are prepacked at compile time. The dense layer runs as a 1x1 conv over a 1x1 image (its (N, C) input reshaped
to (N, 1, 1, C)).

Left to TVM's generic lowering (correct, unscheduled): HWNC, grouped / depthwise convs, packed 4-bit operands, and
any conv whose int32 accumulator could exceed int32 (the kernel adds the bias in int32; the bound is checked per
output channel from the weights and the input's range, the flipped range for a dot-product kernel that flips it).

The register tile of each NHWC layer comes from the tuning records of ``cpu_direct`` (``qtune --target llvm``):
``schedules.tuning.knobs_for(spec, arch=<the inner kernel>, device=<this CPU's model name>, logs, "cpu_direct")``,
the same lookup (key ``tuning_key(spec)``; device, arch, nearest batch) as the tensor-core layers'; where none is
found, and for NCHW layers (the tuner measures NHWC), the kernel's automatic tile (``cpu_conv.auto_tile``).
``sources`` says which per layer, ``planned`` lists the tunable layers (the tuner's tasks).

``cpu_kernels_target`` decides whether the kernels run in an llvm build and the build target they need
(``QCOMPILE_CPU_KERNELS=0`` turns them off: the generic path, for comparison).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import numpy as np
import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from qcompile.errors import keeps_user_errors
from .dispatch_tensor_core import _Group, _Residual, find_fusions

ENV = "QCOMPILE_CPU_KERNELS"


def env_enabled(name: str) -> bool:
    """False where the environment variable ``name`` turns a feature off (0, false, no, off); True if unset."""
    return os.environ.get(name, "1").strip().lower() not in ("0", "false", "no", "off")


def cpu_kernels_enabled() -> bool:
    """False where ``QCOMPILE_CPU_KERNELS`` turns the CPU kernels off (:func:`env_enabled`)."""
    return env_enabled(ENV)


def cpu_kernels_target(target) -> Optional[tvm.target.Target]:
    """The codegen target of an llvm build that runs the CPU kernels, or None where they do not run (not llvm, no
    kernel for that target, or ``QCOMPILE_CPU_KERNELS=0``): a plain ``llvm`` target on an x86-64 host with AVX2
    becomes the host's best kernel target (``schedules.cpu_conv.cpu_target``: x86-64-v4 with AVX-512 VNNI, x86-64-v3
    with AVX-VNNI, or x86-64-v3); a target naming ``mtriple`` / ``mcpu`` / ``mattr`` is taken as given and qualifies
    only if it enables a kernel's instructions (``cpu_conv.target_kernel``: AVX2 on x86, dotprod on aarch64).
    ``qcompile.pipeline.build`` decides its target here once; the pipeline dispatches only for a target that already
    enables a kernel."""
    from qcompile.schedules.cpu_conv import cpu_target, target_kernel

    if not cpu_kernels_enabled() or target.kind.name != "llvm":
        return None
    tgt = cpu_target(target)
    return tgt if target_kernel(tgt) is not None else None


KERNELS = ("cpu_direct_avx2", "cpu_direct_vnni", "cpu_direct_avxvnni", "cpu_direct_sdot")
# per-layer variants of an inner kernel: (variant, its inner kernel); cpu_direct_vnni_s4 (4-bit weights two per byte,
# ``schedules/cpu_conv_vnni_s4.py``) runs the 4-bit layers of a cpu_direct_vnni module whose weights are reused over
# few output pixels (``cpu_conv_vnni_s4.worth``) and that no tuning record gives a tile (``layer_kernel``);
# ``QCOMPILE_CPU_S4=0`` turns it off
# cpu_direct_amx (AMX-INT8 tiles, ``schedules/cpu_conv_amx.py``) is the kernel of a target with AMX
# (``cpu_conv.target_kernel``): it runs every layer it takes (``cpu_conv_amx.applies_amx``; automatic tiles, not a
# tuning space), the others run its inner kernel cpu_direct_vnni (tiles from cpu_direct_vnni's records);
# ``QCOMPILE_CPU_AMX=0`` puts every layer on cpu_direct_vnni
VARIANTS = {"cpu_direct_vnni_s4": "cpu_direct_vnni", "cpu_direct_amx": "cpu_direct_vnni"}
ENV_S4 = "QCOMPILE_CPU_S4"
AMX = "cpu_direct_amx"
ENV_AMX = "QCOMPILE_CPU_AMX"


def s4_enabled() -> bool:
    """False where ``QCOMPILE_CPU_S4`` turns the packed 4-bit weight variant off (:func:`env_enabled`)."""
    return env_enabled(ENV_S4)


def amx_enabled() -> bool:
    """False where ``QCOMPILE_CPU_AMX`` turns the AMX kernel off (:func:`env_enabled`)."""
    return env_enabled(ENV_AMX)


def has_cpu_kernels(mod: tvm.IRModule) -> bool:
    """Whether ``mod`` already holds a CPU kernel (``DispatchCPU`` ran on it): it needs the codegen target that
    ``DispatchCPU`` chose its kernel for (``schedules.cpu_conv.cpu_target`` on the same host gives it)."""
    return any(isinstance(f, tvm.tirx.PrimFunc) and f.attrs is not None
               and str(f.attrs.get("qcompile.strategy", "")) in KERNELS + tuple(VARIANTS)
               for f in mod.functions.values())


def dispatch_kernel() -> Optional[str]:
    """The inner kernel for the module under the current target (``tvm.compile`` runs the pipeline under the codegen
    target), else for this host's build target (``cpu_conv.cpu_target`` of plain llvm); None without AVX2."""
    from qcompile.schedules.cpu_conv import cpu_target, target_kernel

    tgt = tvm.target.Target.current(allow_none=True)
    if tgt is None or tgt.kind.name != "llvm":
        tgt = cpu_target(tvm.target.Target({"kind": "llvm"}))
    return target_kernel(tgt)


@dataclass(frozen=True)
class CpuPlanned:
    """A dispatched NHWC layer as the tuner sees it (``qcompile.tune.tasks``): its ConvSpec, the tuning strategy
    (``cpu_direct``), the inner kernel (the records' arch), the knobs the logs gave and where they came from."""

    spec: object
    kernel: str
    knobs: object
    source: str
    strategy: str = "cpu_direct"


def tuned_tile(spec, kernel: str, tuning_logs=(), device: Optional[str] = None):
    """(CpuKnobs, source) of one layer: the fastest record of ``cpu_direct`` for ``spec`` on ``kernel``
    (``schedules.tuning.knobs_for``: this CPU's (``device``, default this host's model name), else another CPU's of the
    kernel, else the nearest batch size), else the automatic tile (``CpuKnobs()``, "default"). Without
    ``tuning_logs`` and without a default log for the kernel, no log is read (and none is warned about)."""
    from qcompile.schedules.cpu_conv import SPACE_STRATEGY, CpuKnobs, cpu_model_name
    from qcompile.schedules.tuning import knobs_for, log_path

    if not tuning_logs and not log_path(kernel).is_file():
        return CpuKnobs(), "default"
    return knobs_for(spec, kernel, device or cpu_model_name(), tuple(tuning_logs), SPACE_STRATEGY)


def _logical_weights(g: _Group) -> np.ndarray:
    """The group's weights as [K, R, S, C] int64."""
    w = np.asarray(g.w).astype(np.int64)
    if g.dense:  # (I, O)
        return np.ascontiguousarray(w.T)[:, None, None, :]
    kl = str(g.acc_call.attrs.kernel_layout)
    return np.ascontiguousarray(np.transpose(w, {"OHWI": (0, 1, 2, 3), "OIHW": (0, 2, 3, 1)}[kl]))


def _spec(g: _Group, r: Optional[_Residual], var, kernel: str):
    """(ConvSpec in NHWC geometry, io layout, logical weights), or (None, reason), for ``kernel``."""
    from qcompile.schedules.cpu_conv import applies
    from qcompile.schedules.cpu_conv_vnni import ISAS
    from qcompile.schedules.spec import ConvSpec

    xs = [int(s) for s in g.x.ty.shape]
    w = _logical_weights(g)
    K, R, S_, C = w.shape
    if getattr(g, "groups", 1) != 1:
        return None, f"grouped conv ({g.groups} groups)"
    if g.dense:
        io, (N, Cx), H, W = "NHWC", xs, 1, 1
        stride, dil = (1, 1), (1, 1)
    else:
        a = g.acc_call.attrs
        io = str(a.data_layout)
        if io not in ("NCHW", "NHWC"):
            return None, f"layout {io}"
        N, Cx, H, W = (xs[0], xs[1], xs[2], xs[3]) if io == "NCHW" else (xs[0], xs[3], xs[1], xs[2])
        stride, dil = tuple(int(s) for s in a.strides), tuple(int(d) for d in a.dilation)
        if not g.x.same_as(g.acc_call.args[0]) and any(int(p) for p in a.padding):
            return None, "zero-point pad and conv padding together"
    if Cx != C:
        return None, f"input has {Cx} channels, weights {C}"
    x_st = str(g.x.ty.dtype)
    xlo, xhi = {"int8": (-128, 127), "uint8": (0, 255)}.get(x_st, (None, None))
    if xlo is None:
        return None, f"input storage {x_st}"
    # the kernel accumulates in int32 and adds the bias in int32, as the graph's int32 conv does and its int64
    # requantize would not wrap: take only convs where that sum cannot leave int32. The dot-product kernels read a
    # flipped input (x xor 0x80: values up to 255 in magnitude, say) and add bias -+ 128 sum(w): those stay in int32
    amax = max(abs(xlo), abs(xhi), abs(g.pad_value))
    wabs = np.abs(w).reshape(K, -1).sum(axis=1)
    bias = np.abs(g.bias.astype(np.int64))
    bound = wabs * amax + bias
    if kernel in ISAS and (x_st == "int8") == ISAS[kernel].unsigned_x:  # the kernel flips this input
        bound = np.maximum(bound, wabs * 255 + bias + 128 * np.abs(w.reshape(K, -1).sum(axis=1)))
    if bound.max(initial=0) >= 2**31:
        return None, "accumulator may exceed int32"
    res = {}
    out_st = str(var.ty.dtype)
    if r is not None:
        res = dict(has_residual=True, res_dtype=str(r.res.ty.dtype), zo2=r.zo2, lo2=r.lo2, hi2=r.hi2,
                   res_i32=r.i32)
        if (r.rq2 == r.rq2[:, :1]).all():
            res["rq2_uniform"] = tuple(int(v) for v in r.rq2[:, 0])
    spec = ConvSpec(N=N, H=H, W=W, C=C, K=K, R=R, S=S_, stride=stride, padding=g.pad, dilation=dil,
                    layout="NHWC", x_dtype=x_st, w_bits=g.w_bits, out_dtype=out_st, zo=g.zo, lo=g.lo, hi=g.hi,
                    pad_value=g.pad_value, shift_ge33=bool(33 <= np.min(g.S) and np.max(g.S) <= 62), **res)
    why = applies(spec)
    if why is not None:
        return None, why
    return (spec, io, w, bound), None


def layer_kernel(spec, kernel: str, bound: np.ndarray, source: str = "default") -> str:
    """The kernel of one layer whose tile came from ``source`` (``tuned_tile``): ``kernel``, or its variant for 4-bit
    weights packed two per byte (``cpu_direct_vnni_s4``) where no tuning record gives the layer a tile (``source`` is
    "default": a record's tile is measured on ``kernel`` and keeps it), the weights are 4-bit, few output pixels reuse
    them (``S4.worth``: the layer reads its weights from memory rather than computes), its accumulators (16 x the
    sums, ``bound`` per output channel) fit int32 (``S4.fits``) and ``QCOMPILE_CPU_S4`` does not turn it off.
    ``kernel`` ``cpu_direct_amx`` (a target with AMX): that kernel where it takes the layer
    (``cpu_conv_amx.applies_amx``) and ``QCOMPILE_CPU_AMX`` does not turn it off, else the rule above for
    ``cpu_direct_vnni``."""
    from qcompile.schedules import cpu_conv_vnni_s4 as S4

    if kernel == AMX:
        from qcompile.schedules.cpu_conv_amx import applies_amx

        if amx_enabled() and applies_amx(spec) is None:
            return AMX
        kernel = VARIANTS[AMX]
    if (kernel == S4.ISA and source == "default" and s4_enabled() and S4.applies_s4(spec) is None
            and S4.worth(spec) and S4.fits(bound)):
        return S4.STRATEGY
    return kernel


@mutator
class _CPUDispatcher(PyExprMutator):
    def __init__(self, mod, groups, residuals, plans, kernel: str, tuning_logs=(), device=None, amx=False):
        super().__init__(mod)
        self.groups, self.residuals, self.plans, self.kernel = groups, residuals, plans, kernel
        self.amx = amx  # (a module of cpu_direct_amx: ``kernel`` is its inner kernel, cpu_direct_vnni)
        self.tuning_logs, self.device = tuple(tuning_logs or ()), device
        self.kernels: dict = {}  # kernel key -> GlobalVar (identical layers share one PrimFunc)
        self.chosen: list = []   # (conv output, kernel name)
        self.fused: list = []    # (conv output, residual add output)
        self.sources: list = []  # (conv output, where its tile came from: device / arch / nearest / default)
        self.planned: list = []  # (conv output, CpuPlanned) per NHWC layer

    def visit_var_binding_(self, binding):
        r = self.residuals.get(binding.var)
        g = r.group if r is not None else self.groups.get(binding.var)
        if g is None or (r is None and g.fused) or binding.var not in self.plans:
            return super().visit_var_binding_(binding)
        self._emit(binding.var, g, r, *self.plans[binding.var])

    def _choose(self, name: str, spec, io: str, bound):
        """(kernel, tile) of one layer, the tile's source recorded: an NHWC layer's tile from the tuning records of the
        inner kernel (``tuned_tile``; the layer is planned: a tuner's task), an NCHW layer's automatic (the tuner
        measures NHWC); the kernel from :func:`layer_kernel` (the variant takes its own tile); an AMX layer has no
        tile (and no tuning task)."""
        from qcompile.schedules.cpu_conv import CpuKnobs

        if self.amx and layer_kernel(spec, AMX, bound) == AMX:
            self.sources.append((name, "default"))
            return AMX, CpuKnobs()
        if io == "NHWC":
            kn, source = tuned_tile(spec, self.kernel, self.tuning_logs, self.device)
            self.planned.append((name, CpuPlanned(spec, self.kernel, kn, source)))
        else:
            kn, source = CpuKnobs(), "default"
        self.sources.append((name, source))
        kernel = layer_kernel(spec, self.kernel, bound, source)
        return kernel, (kn if kernel == self.kernel else CpuKnobs())

    def _kernel(self, spec, io, w, bias, tile, kernel: str):
        """(PrimFunc, packed weights, bias) of one layer on ``kernel`` (the module's inner kernel or its variant)."""
        from qcompile.schedules import cpu_conv, cpu_conv_amx, cpu_conv_vnni, cpu_conv_vnni_s4

        if kernel == AMX:
            w8, b = cpu_conv_amx.prepack_amx(spec, w, bias)
            return cpu_conv_amx.make_cpu_conv_amx(spec, io), relax.const(w8, "int8"), b
        if kernel == cpu_conv_vnni_s4.STRATEGY:
            w4, b = cpu_conv_vnni_s4.prepack_s4(spec, w, bias)
            return cpu_conv_vnni_s4.make_cpu_conv_vnni_s4(spec, io), relax.const(w4, "int8"), b
        if self.kernel == cpu_conv.STRATEGY:
            return cpu_conv.make_cpu_conv(spec, io, tile), relax.const(cpu_conv.pack_weights(w), "int16"), bias
        t = cpu_conv.effective_tile(spec, self.kernel, tile)
        w8, b = cpu_conv_vnni.prepack(spec, w, bias, self.kernel)
        return (cpu_conv_vnni.make_cpu_conv_vnni(spec, io, cpu_conv_vnni.VnniTile(self.kernel, t.qt, t.kt)),
                relax.const(w8, "int8"), b)

    def _emit(self, var, g: _Group, r: Optional[_Residual], spec, io, w, bound):
        kernel, tile = self._choose(g.out.name, spec, io, bound)
        func, wc, bias = self._kernel(spec, io, w, g.bias, tile, kernel)
        key = (kernel, spec, io, tile)
        if key not in self.kernels:
            name = f"qconv_cpu_{len(self.kernels)}"
            func = func.with_attr("op_pattern", 8).with_attr("global_symbol", name)
            self.kernels[key] = self.builder_.add_func(func, name)
        self.chosen.append((g.out.name, kernel))
        x = self.visit_expr(g.x)
        if g.dense:
            x = self.builder_.emit(relax.op.reshape(x, (spec.N, 1, 1, spec.C)), var.name + "_x4d")
        args = [x, wc, relax.const(bias, "int32"), relax.const(g.M, "int32"), relax.const(g.S, "int32")]
        if r is not None:
            self.fused.append((g.out.name, var.name))
            args += [self.visit_expr(r.res), relax.const(r.rq2, "int32")]
        shape = [spec.N, spec.K, spec.P, spec.Q] if io == "NCHW" else [spec.N, spec.P, spec.Q, spec.K]
        out = self.builder_.emit(relax.call_tir(self.kernels[key], args, relax.TensorType(shape, str(var.ty.dtype))),
                                 var.name + "_cpu")
        if g.dense:
            out = self.builder_.emit(relax.op.reshape(out, [int(s) for s in var.ty.shape]), var.name)
        self.set_var_remap(var, out)


@tvm.transform.module_pass(opt_level=0, name="DispatchCPU")
class DispatchCPU:
    """Replace requantized integer conv2d/dense in ``main`` (NCHW or NHWC) by the CPU kernel (see module docstring):
    ``kernel`` (one of ``KERNELS``, or ``cpu_direct_amx``), by default :func:`dispatch_kernel`; ``tuning_logs`` /
    ``device``: where the layers' tiles are looked up (:func:`tuned_tile`). After the pass: ``chosen`` (conv output,
    kernel) per dispatched layer, ``fused`` (conv output, residual add output) per fused residual, ``skipped`` (conv
    output, reason) per layer left to the generic path, ``sources`` (conv output, where its tile came from),
    ``planned`` (conv output, CpuPlanned) per NHWC layer."""

    def __init__(self, kernel: Optional[str] = None, tuning_logs=(), device: Optional[str] = None):
        if kernel is not None and kernel not in KERNELS + (AMX,):
            raise ValueError(f"DispatchCPU: unknown kernel {kernel!r} (one of {', '.join(KERNELS + (AMX,))})")
        self.kernel = kernel
        self.tuning_logs, self.device = tuple(tuning_logs or ()), device
        self.chosen: list = []
        self.fused: list = []
        self.skipped: list = []
        self.sources: list = []
        self.planned: list = []

    @keeps_user_errors
    def transform_module(self, mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
        kernel = self.kernel or dispatch_kernel()
        if kernel is None:
            raise ValueError("DispatchCPU: no CPU kernel for this target (the kernels need an x86 target with AVX2)")
        amx = kernel == AMX
        kernel = VARIANTS[AMX] if amx else kernel  # (the inner kernel: the accumulator bound, tiles, other layers)
        groups, residuals = find_fusions(mod["main"], layouts=("NCHW", "NHWC"))
        plans, skipped = {}, []
        for var, r in list(residuals.items()):  # a residual the kernel cannot take: its conv runs on its own
            plan, why = _spec(r.group, r, var, kernel)
            if plan is None:
                del residuals[var]
                r.group.fused = False
            else:
                plans[var] = plan
        for var, g in groups.items():
            if g.fused:
                continue
            plan, why = _spec(g, None, var, kernel)
            if plan is None:
                skipped.append((g.out.name, why))
            else:
                plans[var] = plan
        d = _CPUDispatcher(mod, groups, residuals, plans, kernel, self.tuning_logs, self.device, amx)
        func = d.visit_expr(mod["main"])
        self.chosen, self.fused, self.skipped = d.chosen, d.fused, skipped
        self.sources, self.planned = d.sources, d.planned
        out = d.builder_.get()
        out["main"] = func
        return relax.transform.DeadCodeElimination(["main"])(out)
