"""``qmodel``: build (or load), quantize and export a ResNet.

    qmodel resnet18 --bits 4 --format onnx -o r18_w4.onnx
    qmodel resnet50 --bits mixed --format pt2 --input-size 64
    qmodel resnet_tiny --in-ch 1 --input-size 8 --weights out/digits/resnet_tiny_digits.pt \\
           --calibrate out/digits/calib.npy --bits 8 --format hawq -o tiny.hawq.pth

Exit status 0 on success, 2 on a usage error (unknown model / format, bad bit width,
bad calibration file), with the reason on stderr.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch

from .quantize import CalibConfig, quantize_model
from .resnet import MODELS, build_model, get_spec

FORMATS = {"onnx": ".onnx", "pt2": ".pt2", "hawq": ".hawq.pth"}


class _Fail(Exception):
    pass


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="qmodel", description="Quantize a ResNet (PTQ) and export it.",
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("model", help=f"one of: {', '.join(MODELS)}")
    ap.add_argument("--bits", default="8",
                    help="8 | 4 | mixed | path to a JSON dict {layer: [w_bits, a_bits]} (default 8)")
    ap.add_argument("--format", default="onnx", help="onnx | pt2 | hawq (default onnx)")
    ap.add_argument("-o", "--output", help="output path (default <model>_<bits><ext>)")
    ap.add_argument("--calibrate", metavar="NPY", help="calibration batch, float32 NCHW .npy")
    ap.add_argument("--calib-samples", type=int, default=8,
                    help="size of the seeded random calibration batch used without --calibrate")
    ap.add_argument("--calib-method8", default="minmax", choices=("minmax", "percentile", "mse"))
    ap.add_argument("--calib-method4", default="mse", choices=("minmax", "percentile", "mse"))
    ap.add_argument("--percentile", type=float, default=99.99)
    ap.add_argument("--residual-bits", type=int, default=4,
                    help="--bits 4 only: width of the tensors feeding residual adds (4 or 8)")
    ap.add_argument("--input-size", type=int, help="H = W (default: the model's, 224 for resnet18/50)")
    ap.add_argument("--in-ch", type=int, help="input channels (default 3)")
    ap.add_argument("--num-classes", type=int, help="classifier size (default: the model's)")
    ap.add_argument("--weights", help="float state_dict (.pt) to load instead of random init")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch", type=int, default=1, help="ONNX/PT2 batch size; 0 = dynamic (default 1)")
    ap.add_argument("--packed-int4", action="store_true", help="hawq: pack int4 weights two per byte")
    ap.add_argument("--save-input", metavar="NPY", help="write a sample input (batch --batch or 1)")
    ap.add_argument("--save-output", metavar="NPY", help="write the fake-quant reference output for it")
    ap.add_argument("-q", "--quiet", action="store_true")
    return ap


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    say = (lambda *a: None) if args.quiet else (lambda *a: print("[qmodel]", *a, flush=True))
    try:
        return _run(args, say)
    except (_Fail, ValueError, FileNotFoundError) as e:
        print(f"qmodel: error: {e}", file=sys.stderr)
        return 2


def _load_weights(path: str) -> dict:
    ck = torch.load(path, map_location="cpu", weights_only=False)
    if isinstance(ck, dict) and "state_dict" in ck:
        ck = ck["state_dict"]
    if not isinstance(ck, dict):
        raise _Fail(f"{path}: expected a state_dict")
    return ck


def _run(args, say) -> int:
    t0 = time.time()
    if args.model not in MODELS:
        raise _Fail(f"unknown model {args.model!r}; choose from: {', '.join(MODELS)}")
    if args.format not in FORMATS:
        raise _Fail(f"unknown format {args.format!r}; choose from: {', '.join(FORMATS)}")
    if not (args.bits in ("8", "4", "mixed") or args.bits.endswith(".json")):
        raise _Fail(f"unsupported --bits {args.bits!r}: use 8, 4, mixed or a .json file "
                    "{layer_name: [w_bits, a_bits]} with widths 4 or 8")
    if args.residual_bits not in (4, 8):
        raise _Fail(f"unsupported --residual-bits {args.residual_bits} (4 or 8)")
    spec = get_spec(args.model)
    calib = None
    if args.calibrate:
        calib = np.load(args.calibrate).astype(np.float32)
        if calib.ndim != 4:
            raise _Fail(f"{args.calibrate}: expected an NCHW array, got shape {calib.shape}")
    in_ch = args.in_ch or (calib.shape[1] if calib is not None else spec.input_shape[1])
    size = args.input_size or (calib.shape[2] if calib is not None else spec.input_shape[2])
    if calib is not None and tuple(calib.shape[1:]) != (in_ch, size, size):
        raise _Fail(f"{args.calibrate}: shape {calib.shape} does not match input (N, {in_ch}, {size}, {size})")
    shape = (1, in_ch, size, size)

    model = build_model(args.model, num_classes=args.num_classes, in_ch=in_ch, seed=args.seed)
    if args.weights:
        state = _load_weights(args.weights)
        try:
            model.load_state_dict(state)
        except RuntimeError as e:
            raise _Fail(f"{args.weights}: does not fit {args.model}: {str(e).splitlines()[0]}")
        say(f"{args.model}: loaded float weights from {args.weights}")
    else:
        say(f"{args.model}: random weights (seed {args.seed}, random BN statistics), "
            f"input {shape}, {model.fc.out_features} classes")
    if calib is None:
        g = torch.Generator().manual_seed(args.seed + 1)
        calib = torch.randn((args.calib_samples, *shape[1:]), generator=g).numpy()
        say(f"no --calibrate: using a seeded random N(0,1) calibration batch of {args.calib_samples} "
            f"(seed {args.seed + 1}); scales will not reflect real data")
    else:
        say(f"calibrating on {args.calibrate} ({calib.shape[0]} samples)")

    cc = CalibConfig(method8=args.calib_method8, method4=args.calib_method4, percentile=args.percentile,
                     seed=args.seed)
    t = time.time()
    qm = quantize_model(model, calib, args.bits, calib=cc, arch=args.model, residual_bits=args.residual_bits)
    n4 = sum(1 for l in qm.layers.values() if l.w_bits == 4)
    a4 = sum(1 for a in qm.acts.values() if a.bits == 4)
    say(f"quantized (bits={args.bits}): {len(qm.layers)} layers, {n4} with 4-bit weights, "
        f"{a4}/{len(qm.acts)} 4-bit activation tensors ({time.time() - t:.1f}s)")

    tag = os.path.splitext(os.path.basename(str(args.bits)))[0]
    out = args.output or f"{args.model}_{tag}{FORMATS[args.format]}"
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    batch = args.batch if args.batch > 0 else None
    n_ex = batch or 1
    g = torch.Generator().manual_seed(args.seed + 2)
    example = torch.randn((n_ex, *shape[1:]), generator=g)
    t = time.time()
    if args.format == "onnx":
        from .export_onnx import export_onnx
        om = export_onnx(qm, out, shape, batch=batch)
        say(f"wrote {out} (ONNX QDQ, opset {om.opset_import[0].version}, onnx.checker ok, {time.time() - t:.1f}s)")
    elif args.format == "pt2":
        from .export_pt2 import export_pt2, quantized_ops
        ep = export_pt2(qm, out, example, calib=torch.from_numpy(calib), dynamic_batch=batch is None)
        say(f"wrote {out} (PT2E, {sum(quantized_ops(ep).values())} quantized_decomposed ops, {time.time() - t:.1f}s)")
    else:
        from .export_hawq import export_hawq
        export_hawq(qm, out, packed_int4=args.packed_int4, input_size=shape[2])
        say(f"wrote {out} (HAWQ-V3 dicts{', packed int4' if args.packed_int4 else ''})")
    if args.save_input:
        np.save(args.save_input, example.numpy())
        say(f"wrote sample input {args.save_input} {tuple(example.shape)}")
    if args.save_output:
        with torch.no_grad():
            np.save(args.save_output, qm(example).numpy())
        say(f"wrote fake-quant reference output {args.save_output}")
    say(f"done in {time.time() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
