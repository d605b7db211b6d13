"""The ``qcompile`` command: a thin CLI over :func:`qcompile.driver.compile_model`.

The parser and the checks of paths, options and tools import nothing heavy, so ``--help`` and every usage error
answer at once; TVM is loaded after them, with a progress line. Errors in the user's model, files or options are
one ``qcompile: error: ...`` line and exit status 2; anything else is reported as an internal error (exit 1), with
the stack trace only under ``QCOMPILE_DEBUG=1``.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from .errors import OneLineArgumentParser, QCompileError, run_cli
from .registry import BIT_SCHEMES, CUDA_ARCHS, FORMATS, LAYOUTS, TARGETS, cross_output, format_of, parse_target
from .runtime import INPUT_DTYPES, INPUT_LAYOUTS

PROG = "qcompile"
DEBUG_ENV = "QCOMPILE_DEBUG"


def _parser() -> argparse.ArgumentParser:
    ap = OneLineArgumentParser(
        prog=PROG,
        description="Compile a quantized CNN (ONNX QDQ, PT2E .pt2, HAWQ checkpoint) into a deployable .so.",
        epilog=f"Exit status: 0 success, 2 a problem with the model, a file or the options (one 'qcompile: error:' "
               f"line), 1 an internal error (set {DEBUG_ENV}=1 for its stack trace).",
    )
    ap.add_argument("model", help="model file: .onnx, .pt2, or a HAWQ checkpoint (.pth/.pt, with --net)")
    ap.add_argument("-o", "--output", required=True,
                    help="output .so (weights are embedded in it); for a cross build (--target llvm -mtriple=...) "
                         "also NAME.tar: its object files, to link on the target machine")
    ap.add_argument("--bits", choices=list(BIT_SCHEMES),
                    help="for a float model: post-training quantization scheme (needs --calibrate); "
                         "for a quantized model: optional, must agree with the model")
    ap.add_argument("--layout", choices=list(LAYOUTS), help="activation layout (default NHWC: the layout of the CPU and tensor-core kernels)")
    ap.add_argument("--target", default="llvm", metavar="TARGET",
                    help=f"{' or '.join(TARGETS)} (default llvm: this CPU's best int8 kernel); llvm takes LLVM's options "
                         f"as TVM writes them: 'llvm -mcpu=skylake-avx512', 'llvm -mcpu=native' (this CPU by name), "
                         f"'llvm -mtriple=aarch64-linux-gnu -mattr=+dotprod' (a cross build: -o NAME.tar writes its "
                         f"object files, or a cross linker on the PATH links the .so)")
    ap.add_argument("--arch", choices=list(CUDA_ARCHS), help="GPU architecture for --target cuda (default sm_90)")
    ap.add_argument("--batch", type=int, help="fix a dynamic batch dimension (default 1)")
    ap.add_argument("--input-dtype", choices=list(INPUT_DTYPES), default="float32",
                    help="what the module takes: float32 images (default; quantized inside), or int8 / uint8 images "
                         "already quantized with the model's input scale and zero point (the first QuantizeLinear is "
                         "folded away; the .so's metadata records them: Module.input_quant, qrun --quantize)")
    ap.add_argument("--input-layout", choices=list(INPUT_LAYOUTS), default="NCHW",
                    help="layout of the module's input (default NCHW); NHWC spares the transpose to an NHWC build")
    ap.add_argument("--calibrate", metavar="DATA.npy", help="float32 NCHW calibration images for a float model")
    ap.add_argument("--net", choices=["resnet18", "resnet50", "resnet_tiny"], help="network a HAWQ checkpoint belongs to")
    ap.add_argument("--input-size", type=int, metavar="H", help="image size (H = W) of a HAWQ checkpoint that does not record it")
    ap.add_argument("--emit-cuda", metavar="DIR", help="also write each kernel's CUDA source and PTX to DIR (cuda)")
    ap.add_argument("--dump-ir", metavar="DIR", help="write the IR after each phase to DIR")
    ap.add_argument("--no-pack-int4", action="store_true", help="keep 4-bit tensors one per byte")
    ap.add_argument("--packed-int4-weights", action="store_true",
                    help="keep every 4-bit weight packed two per byte (cuda: by default the layers whose tuning record "
                         "says so take theirs expanded to 8 bits, which is faster on sm_90 and doubles their size)")
    ap.add_argument("--weights-beside", action="store_true",
                    help="write the weights to NAME.weights.npz beside NAME.so (one file for every batch size) "
                         "instead of compiling them into the .so; each call then passes them as arguments, which "
                         "costs host time on every call (keep the default for latency)")
    ap.add_argument("--tuning-log", action="append", default=[], metavar="PATH",
                    help="tuning log (.jsonl) or folder of them, searched before the packaged logs (cuda, llvm; "
                         "repeatable, first named first; tuning_logs/README.md)")
    ap.add_argument("--gpu", metavar="NAME",
                    help="the GPU the build is for, as nvidia-smi names it (e.g. 'NVIDIA H100 80GB HBM3'): its own "
                         "tuning records win over other GPUs' of the arch (default: arch-level matching)")
    ap.add_argument("-q", "--quiet", action="store_true", help="no progress output")
    return ap


def _check_args(a) -> None:
    """Everything that can be refused before TVM is loaded: the model file, the option combinations, the output
    paths and the tools. Raises QCompileError."""
    from .checks import (check_input_file, check_output_dir, check_output_path, check_toolchain, check_tuning_logs,
                         weights_path)

    check_input_file(a.model, "model file")
    try:
        fmt = format_of(a.model)
    except ValueError:
        known = ", ".join(s for f in FORMATS.values() for s in f.suffixes)
        raise QCompileError(f"cannot tell the format of '{a.model}' from its suffix (known: {known})") from None
    target = parse_target(a.target)
    if target.kind != "cuda":
        if a.arch:
            raise QCompileError(f"--arch {a.arch} applies to --target cuda only (this build is for {a.target})")
        if a.emit_cuda:
            raise QCompileError(f"--emit-cuda needs --target cuda (this build is for {a.target}, which has no CUDA "
                                f"kernels)")
    if a.batch is not None and a.batch < 1:
        raise QCompileError(f"--batch must be a positive integer, got {a.batch}")
    if a.input_size is not None and a.input_size < 1:
        raise QCompileError(f"--input-size must be a positive integer, got {a.input_size}")
    if fmt != "hawq":
        for flag, v in (("--net", a.net), ("--input-size", a.input_size)):
            if v is not None:
                raise QCompileError(f"{flag} applies to HAWQ checkpoints only; '{a.model}' is {fmt.upper()} "
                                    f"(its file records the network and input size)")
    if a.calibrate:
        if fmt != "onnx":
            raise QCompileError(f"--calibrate applies to float ONNX models only; '{a.model}' is a quantized "
                                f"{fmt.upper()} model")
        check_input_file(a.calibrate, "calibration file")
    check_tuning_logs(a.tuning_log, a.gpu, target.kind)
    inputs = [("input model", a.model), ("calibration data", a.calibrate)]
    link = cross_output(target, a.output)  # (a .tar for a cross build only; a cross build's .so: a cross linker)
    check_output_path(a.output, "-o", inputs, suffixes=(".so", ".tar") if target.cross else (".so",))
    if a.weights_beside:
        check_output_path(weights_path(a.output), "the weights file (--weights-beside)", inputs)
    for flag, d in (("--emit-cuda", a.emit_cuda), ("--dump-ir", a.dump_ir)):
        if d:
            check_output_dir(d, flag)
    if link is None:  # (a .tar is not linked here; a cross build's .so is linked with its cross linker)
        check_toolchain(target.kind)


def _import_driver_without_torch() -> None:
    """Import the compiler without the optional ``import torch`` that tvm_ffi and tvm.relax attempt (1.5-2.5 s; both
    tolerate its absence): the compiler needs torch only for PT2E programs and HAWQ checkpoints, whose frontends
    import it themselves in step 1."""
    if "tvm" in sys.modules or "torch" in sys.modules:
        return
    sys.modules["torch"] = None  # makes `import torch` raise ImportError
    try:
        from . import driver  # noqa: F401
    finally:
        if sys.modules.get("torch", 0) is None:
            del sys.modules["torch"]


def qcompile_main(argv=None) -> int:
    a = _parser().parse_args(argv)
    log = (lambda *_: None) if a.quiet else (lambda s: print(s, flush=True))
    return run_cli(PROG, lambda: _run(a, log))


def _run(a, log) -> int:
    _check_args(a)
    t0 = time.time()
    log("loading the compiler (TVM) ...")
    _import_driver_without_torch()
    from .driver import CompileOptions, compile_model

    log(f"      done in {time.time() - t0:.1f} s")
    opts = CompileOptions(bits=a.bits, layout=a.layout, target=a.target, arch=a.arch, batch=a.batch,
                          calibrate=a.calibrate, net=a.net, input_size=a.input_size, pack_int4=not a.no_pack_int4,
                          dump_ir=a.dump_ir, weights_beside=a.weights_beside,
                          packed_int4_weights=a.packed_int4_weights, tuning_logs=tuple(a.tuning_log), gpu=a.gpu,
                          input_dtype=a.input_dtype, input_layout=a.input_layout)
    res = compile_model(a.model, opts, log)
    if a.emit_cuda:
        from .driver import emit_cuda

        emit_cuda(res, a.emit_cuda, log)
    res.export(a.output)
    written = res.outputs(a.output)
    size = sum(os.path.getsize(p) for p in written)
    log(f"wrote {' and '.join(written)} ({size / 1e6:.1f} MB) in {time.time() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(qcompile_main())
