"""The interface function behind the ``qcompile`` command: model file in, deployable ``.so`` out."""
from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np
import tvm
from tvm import relax

from .checks import (WEIGHTS_SUFFIX, atomic_outputs, check_input_file, check_output_path, check_toolchain,
                     check_tuning_logs, weights_path)
from .errors import QCompileError
from .registry import BIT_SCHEMES, CUDA_ARCHS, FORMATS, LAYOUTS, TARGETS, cross_output, format_of, parse_target

__all__ = ["CompileOptions", "CompileResult", "LayerInfo", "WEIGHTS_SUFFIX", "compile_model", "emit_cuda",
           "format_summary", "import_model", "model_bits", "weights_path"]


@dataclass
class CompileOptions:
    bits: Optional[str] = None          # "8" | "4" | "mixed"; None: as the model says
    layout: Optional[str] = None        # NCHW | NHWC | HWNC; None: the target's default
    target: str = "llvm"                # llvm | cuda; llvm with LLVM options: "llvm -mcpu=NAME", "llvm -mtriple=..."
    arch: Optional[str] = None          # sm_XX for cuda
    batch: Optional[int] = None
    calibrate: Optional[str] = None     # .npy of float NCHW images, for float models
    net: Optional[str] = None           # network of a HAWQ checkpoint
    input_size: Optional[int] = None    # H = W for a HAWQ checkpoint that does not record it
    pack_int4: bool = True
    dump_ir: Optional[str] = None
    weights_beside: bool = False        # weights in NAME.weights.npz beside NAME.so instead of inside it
    cuda_graph: bool = True             # replay the forward pass as one CUDA graph (off: per-kernel profiling)
    packed_int4_weights: bool = False   # 4-bit weights always packed (not expanded for the tuned w8 kernels)
    tuning_logs: tuple = ()             # tuning log files / folders searched before the packaged logs (cuda)
    gpu: Optional[str] = None           # GPU name matched against the records' device (None: arch-level matching)
    kernel_cache: Optional[bool] = None  # cuda: nvcc's outputs from/to the kernel cache (None: QCOMPILE_KERNEL_CACHE)
    input_dtype: str = "float32"        # float32 | int8 | uint8 (already quantized: the input quantize folded away)
    input_layout: str = "NCHW"          # NCHW | NHWC: the layout main takes its input in


@dataclass
class LayerInfo:
    name: str
    op: str
    in_shape: tuple
    w_shape: tuple
    out_shape: tuple
    w_bits: int
    a_bits: int
    layout: str
    kernel: str = ""
    knobs: str = ""   # where an implicit-GEMM kernel's knobs come from: device / arch / nearest / default


class _Progress:
    def __init__(self, log, total):
        self.log, self.total, self.i = log, total, 0

    def step(self, what):
        self.i += 1
        self.t0 = time.time()
        self.log(f"[{self.i}/{self.total}] {what} ...")

    def done(self, extra=""):
        self.log(f"      done in {time.time() - self.t0:.1f} s{(' — ' + extra) if extra else ''}")


@dataclass
class CompileResult:
    executable: object
    integer_mod: tvm.IRModule
    meta: dict
    layers: list = field(default_factory=list)
    weights: list = field(default_factory=list)  # values of main's weight parameters (weights_beside)
    planned: list = field(default_factory=list)  # (conv/dense binding name, PlannedKernel) per tensor-core layer
    progress: Optional[_Progress] = None  # compile_model's progress lines: export() is their last step
    target: object = None  # the --target string parsed (registry.TargetString): how export() links the module

    def outputs(self, path: str) -> list:
        """The files :meth:`export` writes for ``path``: the ``.so``, and its weights file with ``weights_beside``."""
        return [path] + ([weights_path(path)] if self.meta.get("weights") == "beside" else [])

    def export(self, path: str):
        """Write the module to ``path`` (a ``.so``, linked with the C++ compiler or a cross build's cross linker; a
        cross build's ``.tar``, its object files) and, with ``weights_beside``, its ``NAME.weights.npz``. Each file
        is written under a temporary name in its folder and renamed when all are complete, so a failure leaves nothing
        half-written (and an existing module untouched)."""
        outs = self.outputs(path)
        for p in outs:
            check_output_path(p, "output")
        link = cross_output(self.target, path) if self.target is not None else None
        cxx = link  # (a cross build's .so: its cross linker; a .tar: not linked, no compiler)
        if link is None:  # (a .so for this machine: the host's C++ compiler)
            cxx = check_toolchain("llvm")["cxx"]
        elif link == "tar":
            cxx = None
        prog, self.progress = self.progress, None
        if prog is not None:  # (one step, the last of compile_model's)
            how = "object files, not linked" if link == "tar" else f"linking with {os.path.basename(cxx)}"
            prog.step(f"writing {path} (code generation and {how})")
        try:
            with atomic_outputs(*outs) as tmps:
                try:
                    if link not in (None, "tar"):  # a cross build's .so, linked with the cross linker
                        from tvm.support.cc import cross_compiler

                        self.executable.export_library(tmps[0], fcompile=cross_compiler(link))
                    else:  # (.so: the host's C++ compiler; .tar: the object files)
                        self.executable.export_library(tmps[0])
                except RuntimeError as e:
                    text = str(e)
                    if "Compilation error" not in text:
                        raise
                    detail = [ln.strip() for ln in text.splitlines() if ln.strip() and "Compilation error" not in ln]
                    raise QCompileError(f"linking '{path}' with {cxx} failed: "
                                        f"{detail[0][:300] if detail else 'no message'}") from None
                if len(tmps) > 1:
                    with open(tmps[1], "wb") as f:
                        np.savez(f, **{f"w{i}": w for i, w in enumerate(self.weights)})
        except OSError as e:  # (a full disk, a folder removed meanwhile, ...: nothing is left behind)
            raise QCompileError(f"cannot write '{path}': {e.strerror or e}") from None
        if prog is not None:
            prog.done(f"{sum(os.path.getsize(p) for p in outs) / 1e6:.1f} MB")
        return path


# ------------------------------------------------------------------------------------------------
def import_model(path: str, opts: CompileOptions, log=print):
    """Phase 1: any supported model file -> (QDQ-form module, info)."""
    check_input_file(path, "model file")
    try:
        fmt = format_of(path)
    except ValueError:
        known = ", ".join(s for f in FORMATS.values() for s in f.suffixes)
        raise QCompileError(f"cannot tell the format of '{path}' from its suffix (known: {known})") from None
    if fmt == "onnx":
        from .frontends.onnx_qdq import from_onnx, is_float_model, load_onnx, quantize_float_onnx

        model = load_onnx(path)
        if is_float_model(model):
            model = quantize_float_onnx(model, opts.bits, opts.calibrate, opts.batch, log)
        elif opts.calibrate:
            log("note: the model is already quantized; --calibrate is ignored")
        return from_onnx(model, opts.batch, log)
    try:
        if fmt == "pt2":
            from .frontends.pt2e import from_pt2

            return from_pt2(path, opts.batch, log)
        from .frontends.hawq import from_hawq

        return from_hawq(path, opts.net, opts.batch, log, opts.input_size)
    except ModuleNotFoundError as e:
        if e.name not in ("torch", "torchao"):
            raise
        kind = "PT2E programs" if fmt == "pt2" else "HAWQ checkpoints"
        raise QCompileError(f"reading {kind} needs PyTorch ({e.name} is not installed): pip install "
                            f"'qcompile[torch]'") from None


def model_bits(mod_qdq: tvm.IRModule) -> str:
    """Classify a QDQ module's weight bit widths as "8", "4" or "mixed" (see BIT_SCHEMES)."""
    from .qdq import qtype_of

    func = mod_qdq["main"]
    var2val = relax.analysis.get_var2val(func)
    wbits = []
    for block in func.body.blocks:
        for b in block.bindings:
            v = b.value
            if isinstance(v, relax.Call) and v.op.name in ("relax.nn.conv2d", "relax.matmul"):
                w = v.args[1]
                w = var2val.get(w, w)
                while isinstance(w, relax.Call) and w.op.name == "relax.permute_dims":
                    w = var2val.get(w.args[0], w.args[0])
                if isinstance(w, relax.Call) and w.op.name == "relax.dequantize":
                    wbits.append(qtype_of(w.args[0], var2val).bits)
    if not wbits:
        raise QCompileError("the model has no quantized convolution or dense layer")
    if all(b == 8 for b in wbits):
        return "8"
    inner = wbits[1:-1]
    if inner and all(b == 4 for b in inner):
        return "4"
    return "mixed"


def _layers(mod_int: tvm.IRModule, layout: str) -> list:
    func = mod_int["main"]
    var2val = relax.analysis.get_var2val(func)

    def bits_of(e):
        v = var2val.get(e, e)
        while isinstance(v, relax.Call) and v.op.name in ("relax.nn.max_pool2d", "relax.reshape", "relax.nn.pad"):
            v = var2val.get(v.args[0], v.args[0])
        if isinstance(v, relax.Call) and v.op.name == "relax.astype":
            v = var2val.get(v.args[0], v.args[0])
        if isinstance(v, relax.Call) and v.op.name == "relax.clip":
            lo, hi = int(v.args[1].value), int(v.args[2].value)
            return 4 if (hi - lo) < 16 and (lo >= -8) else 8
        return 8

    out = []
    for block in func.body.blocks:
        for b in block.bindings:
            v = b.value
            if isinstance(v, relax.Call) and v.op.name in ("relax.nn.conv2d", "relax.matmul"):
                shp = lambda e: tuple(int(s) for s in e.ty.shape)
                out.append(LayerInfo(b.var.name, "conv2d" if "conv" in v.op.name else "dense", shp(v.args[0]),
                                     shp(v.args[1]), shp(b.var), bits_of(v.args[1]), bits_of(v.args[0]),
                                     layout if "conv" in v.op.name else "NC"))
    return out


def format_summary(layers: list) -> str:
    rows = [("layer", "op", "input", "weight", "output", "w", "a", "layout", "kernel", "knobs")]
    for l in layers:
        rows.append((l.name, l.op, "x".join(map(str, l.in_shape)), "x".join(map(str, l.w_shape)),
                     "x".join(map(str, l.out_shape)), str(l.w_bits), str(l.a_bits), l.layout, l.kernel or "llvm",
                     l.knobs))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def compile_model(path: str, opts: Optional[CompileOptions] = None, log: Callable = print) -> CompileResult:
    """Import the model (a frontend), then compile it with the qcompile pipeline (``qcompile.pipeline``: lowering,
    kernels, packing, backend) inside ``tvm.compile``. ``log`` receives progress lines."""
    from .pipeline import PipelineRecord, build, qcompile_pipeline

    opts = opts or CompileOptions()
    tspec = parse_target(opts.target)  # (QCompileError: an unknown kind or option)
    kind = tspec.kind
    if opts.bits is not None and opts.bits not in BIT_SCHEMES:
        raise QCompileError(f"unsupported bit width '{opts.bits}' (choose from {', '.join(BIT_SCHEMES)})")
    layout = opts.layout or TARGETS[kind].default_layout
    if layout not in LAYOUTS:
        raise QCompileError(f"unknown layout '{layout}' (choose from {', '.join(LAYOUTS)})")
    if kind == "cuda":
        opts.arch = opts.arch or "sm_90"
        if opts.arch not in CUDA_ARCHS:
            raise QCompileError(f"unknown CUDA arch '{opts.arch}' (choose from {', '.join(CUDA_ARCHS)})")
    elif opts.arch:
        raise QCompileError(f"--arch {opts.arch} applies to --target cuda only (this build is for {opts.target})")
    opts.tuning_logs = tuple(opts.tuning_logs or ())
    check_tuning_logs(opts.tuning_logs, opts.gpu, kind)
    if opts.batch is not None and opts.batch < 1:
        raise QCompileError(f"--batch must be a positive integer, got {opts.batch}")
    _check_input_options(opts)
    if opts.input_size is not None and opts.input_size < 1:
        raise QCompileError(f"--input-size must be a positive integer, got {opts.input_size}")
    if kind == "cuda":
        check_toolchain("cuda")  # (nvcc compiles the kernels during the build)
    llvm_target, target_shown = _llvm_target(tspec, log) if kind == "llvm" else (None, kind)

    prog = _Progress(log, 4)
    prog.step(f"importing {path}")
    mod_qdq, info = import_model(path, opts, log)
    found = model_bits(mod_qdq)
    if opts.bits is not None and opts.bits != found and info.get("format") != "float":
        raise QCompileError(f"--bits {opts.bits} conflicts with the model, which is quantized as '{found}' "
                            f"(omit --bits for an already-quantized model)")
    prog.done(f"{info['format']}, input {info['input_name']} {'x'.join(map(str, info['input_shape']))}, bits {found}")

    meta = {  # (output_shape and the weights' fields: filled in by the pipeline's metadata phase)
        "qcompile": __import__("qcompile").__version__,
        "input_name": info["input_name"],
        "input_shape": _input_shape(info["input_shape"], opts.input_layout),  # (what main takes)
        "input_dtype": opts.input_dtype,
        "input_layout": opts.input_layout,
        "input_quant": None,  # (an integer input's scale, zero point, ...: filled in by the pipeline)
        "output_shape": None,
        "layout": layout,
        "bits": found,
        "target": kind,
        "arch": opts.arch,
        "source": os.path.basename(path),
        "format": info["format"],
        "weights": "beside" if opts.weights_beside else "embedded",
        "num_weights": 0,
        "llvm_target": target_shown if kind == "llvm" else None,  # (the CPU build target, as TVM users write it)
    }
    record = PipelineRecord()
    layers: list = []

    def on_phase(name, mod):  # progress lines and notes between the pipeline's phases
        if name == "2_integer":
            layers.extend(_layers(mod, layout))
            if record.input_quant is not None:
                iq = record.input_quant
                log(f"      input {info['input_name']}: {iq['dtype']} {iq['layout']}, already quantized (the model's "
                    f"quantize '{iq['node']}' folded away): scale {iq['scale']!r}, zero point {iq['zero_point']}, "
                    f"range [{iq['qmin']}, {iq['qmax']}]")
            if kind == "cuda" and layout == "NCHW":
                log("note: NCHW has no tensor-core convolution; use --layout NHWC or HWNC (convs stay on generic "
                    "kernels)")
        elif name == "3_dispatched":
            _log_kernel_notes(record, opts.arch, log)
        elif name == "4_deploy":  # (the last phase before TVM's backend)
            for l in layers:  # (llvm: qcompile's CPU kernel where dispatched, else TVM's generic lowering, "llvm")
                l.kernel = record.kernels.get(l.name, "generic" if kind == "cuda" else "llvm")
                l.knobs = record.knobs.get(l.name, "")
            prog.done(f"{len(layers)} conv/dense layers")
            prog.step(f"building for {target_shown}{(' ' + opts.arch) if opts.arch else ''}")

    target = ({"kind": "llvm"} if llvm_target is None else llvm_target) if kind == "llvm" else {
        "kind": "cuda", "arch": opts.arch}
    pipeline = qcompile_pipeline(target, layout, pack_int4=opts.pack_int4, expand_w4=not opts.packed_int4_weights,
                                 weights_beside=opts.weights_beside, meta=meta, dump_dir=opts.dump_ir, record=record,
                                 on_phase=on_phase, tuning_logs=opts.tuning_logs, gpu=opts.gpu,
                                 input_dtype=opts.input_dtype, input_layout=opts.input_layout)
    prog.step(f"lowering to integer compute ({layout})")
    nvcc_note = ""
    if kind == "cuda":
        from qcompile.schedules.build import (build_stats, ensure_stub_libcuda, fast_tvmscript_macros, nvcc_jobs,
                                              nvcc_options)

        ensure_stub_libcuda()  # so that TVM embeds compiled GPU code (fatbin), not CUDA source, on a GPU-less host
        before = dataclasses.replace(build_stats())
        # (SASS for the arch + its PTX, which newer GPUs JIT; one CUDA module per kernel, nvcc in parallel)
        with nvcc_options(opts.arch, mode="both", cache=opts.kernel_cache), fast_tvmscript_macros():
            ex = build(mod_qdq, target, cuda_graph=opts.cuda_graph, pipeline=pipeline)
        nvcc_note = _nvcc_note(before, build_stats(), nvcc_jobs())
    else:
        ex = build(mod_qdq, target, pipeline=pipeline)
    prog.done(nvcc_note)
    log(format_summary(layers))
    return CompileResult(ex, record.integer_mod, meta, layers, record.weights, record.planned, progress=prog,
                         target=tspec)


def _llvm_target(t, log) -> tuple:
    """(build target, or None for plain llvm: ``pipeline.build`` picks the host's best kernel target; the target
    the build uses, as TVM users write it) of an llvm ``--target`` string, checked against LLVM
    (``schedules.cpu_conv.resolve_target``); logs what ``-mcpu=native`` became and the vector features a named x86
    CPU enables that this host lacks (its module is for such CPUs)."""
    from qcompile.relay_passes.dispatch_cpu import cpu_kernels_target
    from qcompile.schedules.cpu_conv import missing_host_features, resolve_target, target_text

    try:
        tgt, note = resolve_target(t)
    except ValueError as e:
        raise QCompileError(f"--target '{t.text}': {e}") from None
    plain = tvm.target.Target({"kind": "llvm"})
    shown = target_text(tgt if tgt is not None else cpu_kernels_target(plain) or plain)
    if note:
        log(f"      {note}")
    missing = missing_host_features(tgt) if tgt is not None and not t.cross else []
    if missing:
        log(f"note: {shown} enables {', '.join(missing)}, which this CPU does not run: the module is for CPUs that "
            f"do (here it may stop on an illegal instruction)")
    return tgt, shown


def _check_input_options(opts: CompileOptions) -> None:
    from qcompile.runtime import INPUT_DTYPES, INPUT_LAYOUTS

    if opts.input_dtype not in INPUT_DTYPES:
        raise QCompileError(f"unknown input dtype '{opts.input_dtype}' (choose from {', '.join(INPUT_DTYPES)})")
    if opts.input_layout not in INPUT_LAYOUTS:
        raise QCompileError(f"unknown input layout '{opts.input_layout}' (choose from {', '.join(INPUT_LAYOUTS)})")


def _input_shape(shape, layout: str) -> list:
    """The model's NCHW input shape in ``layout`` (the lowering refuses NHWC for an input that is not 4-D)."""
    shape = [int(d) for d in shape]
    return [shape[i] for i in (0, 2, 3, 1)] if layout == "NHWC" and len(shape) == 4 else shape


def _nvcc_note(before, after, jobs: int) -> str:
    """The nvcc part of a cuda build's progress line, from the build statistics before and after it."""
    units, hits = after.units - before.units, after.cache_hits - before.cache_hits
    compiled, wall = after.compiled - before.compiled, after.nvcc_wall_s - before.nvcc_wall_s
    note = f"{after.modules - before.modules} CUDA modules; nvcc: "
    note += f"{hits} of {units} kernels from the kernel cache" if hits else f"{units} kernels"
    if compiled:
        note += f", {compiled} compiled in {wall:.1f} s ({min(jobs, compiled)} in parallel)"
    return note


def _log_kernel_notes(record, arch: str, log):
    """The notes after the tensor-core dispatch: tunable layers (the kernels tuning records serve) without a
    record for their shape, layers on the generic kernel."""
    src = record.knob_sources
    own = src.count("device") + src.count("arch")
    if src and own < len(src):  # (compiled models take a record's knobs wherever a log has the shape)
        log(f"note: {len(src) - own} of {len(src)} tunable layers have no tuning record for their "
            f"shape on {arch} ({src.count('nearest')} take the layer's record at the nearest batch size, "
            f"{src.count('default')} the {arch} defaults); qtune measures records for your GPU (docs/TUNING.md)")
    fb = [n for n, s in record.kernels.items() if s == "fallback"]
    if fb:
        log(f"note: {len(fb)} layer(s) do not fit the tensor-core tiles and use the generic kernel: {', '.join(fb)}")


def emit_cuda(res: CompileResult, out_dir: str, log=print) -> list:
    """Write each CUDA kernel's source (``NAME.cu``: its translation unit) and PTX (``NAME.ptx``) of a cuda build to
    ``out_dir``.

    Returns ``(kernel name, file stem)`` pairs; a name over 120 characters is shortened with a hash.
    """
    import hashlib
    import re
    import subprocess
    import tempfile
    from concurrent.futures import ThreadPoolExecutor

    from qcompile.schedules.build import cuda_modules, nvcc_jobs

    if res.meta.get("target") != "cuda":
        raise QCompileError("--emit-cuda needs --target cuda")
    sources = [m.inspect_source("") for m in cuda_modules(res.executable)]
    if not sources:
        raise QCompileError("the build has no CUDA module")
    os.makedirs(out_dir, exist_ok=True)
    # (wgmma anywhere: every unit was built for the arch-specific features, sm_90a)
    arch = res.meta["arch"].replace("sm_", "") + ("a" if any("wgmma." in s for s in sources) else "")
    name_rx = re.compile(r"__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s+)?(\w+)\s*\(")

    def ptx_of(src: str) -> str:
        with tempfile.TemporaryDirectory() as d:
            cu, ptx = os.path.join(d, "k.cu"), os.path.join(d, "k.ptx")
            open(cu, "w").write(src)
            r = subprocess.run(["nvcc", "-ptx", f"-arch=compute_{arch}", "-o", ptx, cu], capture_output=True,
                               text=True)
            if r.returncode:
                raise QCompileError(f"nvcc -ptx failed: {r.stderr[-500:]}")
            return open(ptx).read()

    with ThreadPoolExecutor(max(1, min(nvcc_jobs(), len(sources)))) as ex:
        ptxs = list(ex.map(ptx_of, sources))
    written = []
    for src, ptx_text in zip(sources, ptxs):
        parts = re.split(r'(?=extern "C" __global__)', src)
        preamble, chunks = parts[0], parts[1:]
        defs = [c for c in chunks if "{" in c.split(";", 1)[0]]  # (the others are forward declarations)
        head, *entries = re.split(r"(?=\n\t// \.globl\t)", ptx_text)
        ptx_by_name = {re.search(r"\.globl\t(\S+)", e).group(1): e for e in entries}
        for k in defs:
            name = name_rx.search(k).group(1)
            fname = name if len(name) <= 120 else f"{name[:100]}_{hashlib.sha1(name.encode()).hexdigest()[:10]}"
            open(os.path.join(out_dir, fname + ".cu"), "w").write(src if len(defs) == 1 else preamble + k)
            open(os.path.join(out_dir, fname + ".ptx"), "w").write(head + ptx_by_name.get(name, ""))
            written.append((name, fname))
    log(f"wrote {len(written)} kernels (.cu and .ptx) to {out_dir}")
    return written
