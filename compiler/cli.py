"""The ``qcompile`` command: a thin CLI over :func:`qcompile.driver.compile_model`."""
from __future__ import annotations

import argparse
import sys

from .errors import QCompileError
from .registry import BIT_SCHEMES, CUDA_ARCHS, LAYOUTS, TARGETS


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="qcompile",
        description="Compile a quantized CNN (ONNX QDQ, PT2E .pt2, HAWQ checkpoint) into a deployable .so.",
    )
    ap.add_argument("model", help="model file: .onnx, .pt2, or a HAWQ checkpoint (.pth/.pt, with --net)")
    ap.add_argument("-o", "--output", required=True, help="output .so (weights are embedded in it)")
    ap.add_argument("--bits", choices=list(BIT_SCHEMES),
                    help="for a float model: post-training quantization scheme (needs --calibrate); "
                         "for a quantized model: optional, must agree with the model")
    ap.add_argument("--layout", choices=list(LAYOUTS), help="activation layout (default: NCHW on llvm, NHWC on cuda)")
    ap.add_argument("--target", choices=list(TARGETS), default="llvm")
    ap.add_argument("--arch", choices=list(CUDA_ARCHS), help="GPU architecture for --target cuda (default sm_90)")
    ap.add_argument("--batch", type=int, help="fix a dynamic batch dimension (default 1)")
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
                         "costs host time (~0.4 ms per ResNet-50 call on an H100 host: keep the default for latency)")
    ap.add_argument("-q", "--quiet", action="store_true", help="no progress output")
    return ap


def qcompile_main(argv=None) -> int:
    a = _parser().parse_args(argv)
    from .driver import CompileOptions, compile_model

    log = (lambda *_: None) if a.quiet else (lambda s: print(s, flush=True))
    opts = CompileOptions(bits=a.bits, layout=a.layout, target=a.target, arch=a.arch, batch=a.batch,
                          calibrate=a.calibrate, net=a.net, input_size=a.input_size, pack_int4=not a.no_pack_int4, dump_ir=a.dump_ir,
                          weights_beside=a.weights_beside, packed_int4_weights=a.packed_int4_weights)
    try:
        res = compile_model(a.model, opts, log)
        if a.emit_cuda:
            from .driver import emit_cuda

            emit_cuda(res, a.emit_cuda, log)
        res.export(a.output)
    except QCompileError as e:
        print(f"qcompile: error: {e}", file=sys.stderr)
        return 2
    log(f"wrote {a.output}")
    return 0


if __name__ == "__main__":
    sys.exit(qcompile_main())
