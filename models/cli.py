"""``qmodel``: build (or load), quantize and export an example CNN (ResNet, ResNeXt, MobileNetV2/V3, EfficientNet,
DenseNet, VGG).

    qmodel digits --bits 8 -o digits.onnx --save-input x.npy --save-labels y.npy
    qmodel digits --net mobilenet_v2_tiny --bits 4 --save-input x.npy --save-labels y.npy
    qmodel resnet18 --bits 4 --format onnx -o r18_w4.onnx
    qmodel resnet50 --bits mixed --format pt2 --input-size 64
    qmodel resnet50 --input-size 224x160 -o r50_224x160.onnx       # non-square: H x W (224 high, 160 wide)
    qmodel vgg16 --bits 4 -o vgg16_w4.onnx
    qmodel mobilenet_v2_tiny --format pt2 --quantizer x86 -o mv2_x86.pt2     # torchao's X86InductorQuantizer
    qmodel resnet_tiny --in-ch 1 --input-size 8 --weights out/digits/resnet_tiny_digits.pt \\
           --calibrate out/digits/calib.npy --bits 8 --format hawq -o tiny.hawq.pth

Exit status 0 on success; 2 on a usage error (unknown model / format, bad bit width or number, bad calibration or
weights file, an output path that cannot be written), with one ``qmodel: error:`` line on stderr; 1 on an internal
error (``QCOMPILE_DEBUG=1`` shows its stack trace). Outputs are written all or nothing (temporary files renamed);
``--weights`` is read with ``torch.load(..., weights_only=True)``, so no code in it runs.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from qcompile.errors import QCompileError

from .pt2e_quantizers import DEFAULT_QUANTIZER, QUANTIZER_NAMES, QUANTIZERS, quantizer_bits_error

FORMATS = {"onnx": ".onnx", "pt2": ".pt2", "hawq": ".hawq.pth"}
# the file suffixes qcompile tells each format by (-o must end with one)
FORMAT_SUFFIXES = {"onnx": (".onnx",), "pt2": (".pt2",), "hawq": (".pth", ".pt", ".ckpt", ".tar")}
# the networks of models/resnet.py (MODELS), named here so that --help and the argument checks import no torch
MODEL_NAMES = ("resnet18", "resnet50", "resnet_tiny", "resnext50_32x4d", "resnext_tiny", "mobilenet_v2",
               "mobilenet_v2_tiny", "mobilenet_v3_large", "mobilenet_v3_tiny", "efficientnet_b0", "efficientnet_tiny",
               "densenet121", "densenet_tiny", "vgg16", "vgg_tiny")
# the networks of models/mobile.py and models/vgg.py: quantized by onnxruntime's quantize_static (8 or 4 bits) and
# written as ONNX QDQ
ORT_QUANTIZED = MODEL_NAMES[5:]
# the networks ``digits --net`` trains (models/digits.py, NETS) and the names of their files (-o's default)
DIGITS_NETS = {"resnet_tiny": "digits", "mobilenet_v2_tiny": "digits_mobilenet_v2", "resnext_tiny": "digits_resnext"}
PROG = "qmodel"


class _Fail(QCompileError):
    pass


def _import_heavy() -> None:
    """NumPy, PyTorch and the quantizer: imported once the arguments are checked (``--help`` and every usage error
    answer without them)."""
    global np, torch, CalibConfig, quantize_model, MODELS, build_model, get_spec
    try:
        import numpy as np
        import torch

        from .quantize import CalibConfig, quantize_model
        from .resnet import MODELS, build_model, get_spec
    except ModuleNotFoundError as e:
        if e.name not in ("torch", "torchao", "onnx", "ml_dtypes"):
            raise
        raise _Fail(f"qmodel needs PyTorch and ONNX ({e.name} is not installed): pip install 'qcompile[torch]'") \
            from None
    _quiet_torch_logs()


def _quiet_torch_logs() -> None:
    """torch and torchao log notes about their own internals at WARNING (pytree deprecations, optional kernels)."""
    import logging

    for name in ("torch.utils._pytree", "torchao", "torch._export", "torch.export"):
        logging.getLogger(name).setLevel(logging.ERROR)


def _parser() -> argparse.ArgumentParser:
    from qcompile.errors import OneLineArgumentParser

    ap = OneLineArgumentParser(prog="qmodel", description="Build an example CNN, quantize it (post-training) and "
                                                          "export it (ONNX QDQ, PT2E program or HAWQ checkpoint).",
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("model", help=f"one of: {', '.join(MODEL_NAMES)}, digits (a small net trained on scikit-learn's "
                                  "digits in a few seconds, see --net; the others have random weights)")
    ap.add_argument("--bits", default="8",
                    help="8 | 4 | mixed | path to a JSON dict {layer: [w_bits, a_bits]} (default 8)")
    ap.add_argument("--format", default="onnx", help="onnx | pt2 | hawq (default onnx)")
    ap.add_argument("--quantizer", default=DEFAULT_QUANTIZER, choices=QUANTIZER_NAMES,
                    help="--format pt2: the PT2E quantizer; " + "; ".join(f"{q.name}: {q.help}" for q in
                                                                          QUANTIZERS.values())
                    + f" (default {DEFAULT_QUANTIZER})")
    ap.add_argument("-o", "--output", help="output path (default <model>_<bits><ext>)")
    ap.add_argument("--calibrate", metavar="NPY", help="calibration batch, float32 NCHW .npy")
    ap.add_argument("--calib-samples", type=int, default=8,
                    help="size of the seeded random calibration batch used without --calibrate")
    ap.add_argument("--calib-method8", default="minmax", choices=("minmax", "percentile", "mse"))
    ap.add_argument("--calib-method4", default="mse", choices=("minmax", "percentile", "mse"))
    ap.add_argument("--percentile", type=float, default=99.99)
    ap.add_argument("--residual-bits", type=int, default=4,
                    help="--bits 4 only: width of the tensors feeding residual adds (4 or 8)")
    ap.add_argument("--input-size", metavar="N|HxW",
                    help="input height and width: N (square, N x N) or HxW, height first as in NCHW (224x160: 224 "
                         "high, 160 wide); default: the model's (224 for the full-size models, 32 for the *_tiny "
                         "ones, 64 for vgg_tiny)")
    ap.add_argument("--in-ch", type=int, help="input channels (default 3)")
    ap.add_argument("--num-classes", type=int, help="classifier size (default: the model's)")
    ap.add_argument("--weights", help="float state_dict (.pt) to load instead of random init")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch", type=int, default=1, help="ONNX/PT2 batch size; 0 = dynamic (default 1)")
    ap.add_argument("--packed-int4", action="store_true", help="hawq: pack int4 weights two per byte")
    ap.add_argument("--save-input", metavar="NPY", help="write a sample input (batch --batch or 1)")
    ap.add_argument("--save-output", metavar="NPY", help="write the fake-quant reference output for it")
    ap.add_argument("--save-labels", metavar="NPY", help="digits: write the test labels (int64) of --save-input")
    ap.add_argument("--epochs", type=int, default=20, help="digits: training epochs (default 20)")
    ap.add_argument("--net", help=f"digits: the network trained, one of: {', '.join(DIGITS_NETS)} (default "
                                  f"resnet_tiny; each quantized as qmodel quantizes its family)")
    ap.add_argument("-q", "--quiet", action="store_true")
    return ap


def main(argv=None) -> int:
    from qcompile.errors import run_cli

    args = _parser().parse_args(argv)
    say = (lambda *a: None) if args.quiet else (lambda *a: print("[qmodel]", *a, flush=True))

    def body():
        try:
            return _run(args, say)
        except ImportError as e:
            if "pip install" in str(e):  # (a missing optional package says how to get it: a usage error)
                raise QCompileError(str(e)) from None
            raise

    # (ValueError: the quantizer's --bits JSON checks)
    return run_cli(PROG, body, user_errors=(QCompileError, ValueError, FileNotFoundError))


def _load_weights(path: str) -> dict:
    from qcompile.checks import torch_load_weights_only

    ck = torch_load_weights_only(path, "--weights file")
    if isinstance(ck, dict) and "state_dict" in ck:
        ck = ck["state_dict"]
    if not isinstance(ck, dict) or not all(isinstance(v, torch.Tensor) for v in ck.values()):
        raise _Fail(f"--weights file '{path}': expected a state_dict (a dict of tensors, or a dict with one under "
                    f"'state_dict')")
    return ck


def _check_args(args) -> list:
    """Everything that can be refused before PyTorch is imported: names, numbers, input files and output paths.
    Returns the output paths, -o first."""
    from qcompile.checks import check_input_file, check_output_path

    if args.model not in MODEL_NAMES and args.model != "digits":
        raise _Fail(f"unknown model {args.model!r}; choose from: {', '.join(MODEL_NAMES)}, digits")
    if args.save_labels and args.model != "digits":
        raise _Fail("--save-labels needs the digits model (the others have random weights and no labels)")
    if args.net is not None and args.model != "digits":
        raise _Fail(f"--net chooses the network of the digits model; {args.model} is a network itself")
    if args.net is not None and args.net not in DIGITS_NETS:
        raise _Fail(f"unknown --net {args.net!r}; choose from: {', '.join(DIGITS_NETS)}")
    if args.model == "digits" and args.epochs < 1:
        raise _Fail(f"--epochs must be at least 1, got {args.epochs}")
    args.input_hw = _input_hw(args.input_size)
    if args.model == "digits" and (args.weights or args.in_ch not in (None, 1) or args.input_hw not in (None, (8, 8))
                                   or args.num_classes not in (None, 10)):
        raise _Fail("digits is trained here (1x8x8 input, 10 classes): --weights, --in-ch, --input-size and "
                    "--num-classes do not apply to it")
    if args.format not in FORMATS:
        raise _Fail(f"unknown format {args.format!r}; choose from: {', '.join(FORMATS)}")
    family = _family(args)
    _check_quantizer(args)
    standard = QUANTIZERS[args.quantizer].standard
    if family in ORT_QUANTIZED and not standard and (args.format != "onnx" or args.bits not in ("8", "4")):
        raise _Fail(f"{family} is quantized by onnxruntime's quantize_static: --format onnx with --bits 8 or 4 "
                    f"only (or --format pt2 with a standard --quantizer: "
                    f"{', '.join(n for n, q in QUANTIZERS.items() if q.standard)})")
    if family in ORT_QUANTIZED and not standard and args.save_output:
        raise _Fail(f"--save-output needs the fake-quant model of qcompile's own quantizer; {family} is quantized "
                    f"by onnxruntime (run the .onnx with onnxruntime instead)")
    if not (args.bits in ("8", "4", "mixed") or args.bits.endswith(".json")):
        raise _Fail(f"unsupported --bits {args.bits!r}: use 8, 4, mixed or a .json file "
                    "{layer_name: [w_bits, a_bits]} with widths 4 or 8")
    if args.residual_bits not in (4, 8):
        raise _Fail(f"unsupported --residual-bits {args.residual_bits} (4 or 8)")
    if args.format == "hawq" and args.input_hw is not None and args.input_hw[0] != args.input_hw[1]:
        raise _Fail(f"--format hawq records one input size (H = W); --input-size {args.input_size} is not square: "
                    f"use --format onnx or pt2")
    for flag, v, least in (("--in-ch", args.in_ch, 1),
                           ("--num-classes", args.num_classes, 1), ("--calib-samples", args.calib_samples, 1),
                           ("--batch", args.batch, 0)):
        if v is not None and v < least:
            what = "a positive integer" if least else "0 (a dynamic batch) or a positive integer"
            raise _Fail(f"{flag} must be {what}, got {v}")
    if not 0 < args.percentile <= 100:
        raise _Fail(f"--percentile must be in (0, 100], got {args.percentile}")
    inputs = []
    for flag, path in (("--weights", args.weights), ("--calibrate", args.calibrate),
                       ("--bits", args.bits if args.bits.endswith(".json") else None)):
        if path:
            check_input_file(path, f"{flag} file")
            inputs.append((f"{flag} file", path))
    tag = os.path.splitext(os.path.basename(str(args.bits)))[0]
    name = DIGITS_NETS[args.net or "resnet_tiny"] if args.model == "digits" else args.model
    out = args.output or f"{name}_{tag}{FORMATS[args.format]}"
    outs = [("-o", out, FORMAT_SUFFIXES[args.format], f"(--format {args.format}; qcompile tells formats by suffix)")]
    outs += [(flag, p, (".npy",), "") for flag, p in (("--save-input", args.save_input),
                                                      ("--save-output", args.save_output),
                                                      ("--save-labels", getattr(args, "save_labels", None))) if p]
    for i, (flag, p, suffixes, why) in enumerate(outs):
        others = [(f"{f} output", q) for f, q, _, _ in outs[:i]]
        check_output_path(p, flag, inputs + others, suffixes=suffixes, why=why)
    return [p for _, p, _, _ in outs]


def _input_hw(text):
    """``--input-size``: "N" (N x N) or "HxW" (also "HXW", "H*W") -> (H, W) of positive integers; None -> None."""
    if text is None:
        return None
    import re

    m = re.fullmatch(r"\s*(-?\d+)\s*(?:[xX*]\s*(\d+)\s*)?", str(text))
    if m and m.group(2) is None and int(m.group(1)) < 1:
        raise _Fail(f"--input-size must be a positive integer, got {int(m.group(1))} (or HxW: height x width, "
                    f"e.g. 224x160)")
    hw = (int(m.group(1)), int(m.group(2) or m.group(1))) if m else (0, 0)
    if min(hw) >= 1:
        return hw
    raise _Fail(f"--input-size must be N (a positive integer, N x N) or HxW (height x width, e.g. 224x160), "
                f"got {text!r}")


def _check_quantizer(args) -> None:
    """``--quantizer``: a standard torchao quantizer makes a PT2E program at its own config's bit width."""
    if not QUANTIZERS[args.quantizer].standard:
        return
    if args.format != "pt2":
        raise _Fail(f"--quantizer {args.quantizer} makes a PT2E program: it needs --format pt2")
    err = quantizer_bits_error(args.quantizer, args.bits)
    if err:
        raise _Fail(err)


def _family(args) -> str:
    """The example network ``args`` builds (digits: its ``--net``)."""
    return (args.net or "resnet_tiny") if args.model == "digits" else args.model


def _run(args, say) -> int:
    t0 = time.time()
    args.output = _check_args(args)[0]
    say("loading PyTorch ...")
    _import_heavy()
    say(f"      done in {time.time() - t0:.1f} s")
    if args.model == "digits":
        model, calib, test = _digits(args, say)
        shape = (1, *calib.shape[1:])
    else:
        model, calib, shape = _random_or_loaded(args, say)
        test = None
    _quantize_export(args, say, model, calib, shape, test)
    say(f"done in {time.time() - t0:.1f}s")
    return 0


def _digits(args, say):
    """--net (resnet_tiny) trained on scikit-learn's digits (models/digits.py); its test split is the sample input."""
    from .digits import accuracy, train

    net = _family(args)
    say(f"digits: training {net} on scikit-learn's digits ({args.epochs} epochs, seed {args.seed}, one thread)")
    t = time.time()
    try:
        model, data = train(epochs=args.epochs, seed=args.seed, net=net)
    except ModuleNotFoundError as e:
        if e.name != "sklearn":
            raise
        raise _Fail(str(e)) from None
    with torch.no_grad():
        acc = accuracy(model(torch.from_numpy(data["x_test"])), data["y_test"])
    say(f"digits: trained in {time.time() - t:.1f}s; float model (PyTorch) test accuracy: {acc:.2f}% "
        f"on {len(data['y_test'])} images")
    calib = data["calib"]
    if args.calibrate:
        from qcompile.checks import read_image_array

        calib = read_image_array(args.calibrate, "--calibrate data", channels=1, hw=(8, 8))
        say(f"calibrating on {args.calibrate} ({calib.shape[0]} samples)")
    else:
        say(f"calibrating on {len(calib)} training images")
    return model, calib, (data["x_test"], data["y_test"])


def _random_or_loaded(args, say):
    spec = get_spec(args.model)
    calib = None
    if args.calibrate:
        from qcompile.checks import read_image_array

        calib = read_image_array(args.calibrate, "--calibrate data")
    in_ch = args.in_ch or (calib.shape[1] if calib is not None else spec.input_shape[1])
    h, w = args.input_hw or (tuple(calib.shape[2:]) if calib is not None else spec.input_shape[2:])
    if calib is not None and tuple(calib.shape[1:]) != (in_ch, h, w):
        raise _Fail(f"--calibrate data '{args.calibrate}' has shape {calib.shape}; the model takes "
                    f"(N, {in_ch}, {h}, {w}) (--in-ch, --input-size)")
    shape = (1, in_ch, h, w)
    if args.format == "hawq" and h != w:
        raise _Fail(f"--format hawq records one input size (H = W); --calibrate data '{args.calibrate}' is {h}x{w}: "
                    f"use --format onnx or pt2")

    model = build_model(args.model, num_classes=args.num_classes, in_ch=in_ch, seed=args.seed)
    _check_input_hw(args.model, model, shape)
    if args.weights:
        state = _load_weights(args.weights)
        try:
            model.load_state_dict(state)
        except RuntimeError as e:
            lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
            detail = "; ".join(lines[1:3]) if len(lines) > 1 else lines[0] if lines else ""
            raise _Fail(f"--weights file '{args.weights}' does not fit {args.model}: {detail[:300]}") from None
        say(f"{args.model}: loaded float weights from {args.weights}")
    else:
        say(f"{args.model}: random weights (seed {args.seed}, random BN statistics), "
            f"input {shape}, {args.num_classes or spec.num_classes} classes")
    if calib is None:
        g = torch.Generator().manual_seed(args.seed + 1)
        calib = torch.randn((args.calib_samples, *shape[1:]), generator=g).numpy()
        say(f"no --calibrate: using a seeded random N(0,1) calibration batch of {args.calib_samples} "
            f"(seed {args.seed + 1}); scales will not reflect real data")
    else:
        say(f"calibrating on {args.calibrate} ({calib.shape[0]} samples)")
    return model, calib, shape


def _check_input_hw(name: str, model, shape: tuple) -> None:
    """Refuse an input ``shape`` (1, C, H, W) the network cannot take: VGG's adaptive pool exports only as a fixed
    pool (models/vgg.py); every network needs at least one pixel per side where its pools and convs leave it (a
    forward pass on the meta device tells: shapes only, no arithmetic and no copy of the weights)."""
    from torch.func import functional_call

    from .vgg import VGG, check_input_hw

    h, w = shape[2:]
    err = check_input_hw(model, h, w) if isinstance(model, VGG) else None
    if err is None:
        meta = {k: v.to("meta") for k, v in [*model.named_parameters(), *model.named_buffers()]}
        try:
            with torch.no_grad():
                functional_call(model, meta, (torch.zeros(shape, device="meta"),))
        except RuntimeError as e:
            err = f"input {h}x{w} is too small ({str(e).splitlines()[0][:160]})"
    if err:
        raise _Fail(f"{name} --input-size: {err}")


def _quantize_export(args, say, model, calib, shape, test) -> None:
    """Quantize ``model`` on ``calib`` and export it; ``test``: (images, labels) to save instead of a random input."""
    net = _family(args)
    if QUANTIZERS[args.quantizer].standard:
        _standard_pt2e_export(args, say, model, calib, shape, test)
        return
    if net in ORT_QUANTIZED:
        _ort_quantize_export(args, say, model, calib, shape, test)
        return
    cc = CalibConfig(method8=args.calib_method8, method4=args.calib_method4, percentile=args.percentile,
                     seed=args.seed)
    t = time.time()
    qm = quantize_model(model, calib, args.bits, calib=cc, arch=net, residual_bits=args.residual_bits)
    n4 = sum(1 for l in qm.layers.values() if l.w_bits == 4)
    a4 = sum(1 for a in qm.acts.values() if a.bits == 4)
    say(f"quantized (bits={args.bits}): {len(qm.layers)} layers, {n4} with 4-bit weights, "
        f"{a4}/{len(qm.acts)} 4-bit activation tensors ({time.time() - t:.1f}s)")

    out = args.output  # (checked, with the default filled in, by _check_args)
    batch = args.batch if args.batch > 0 else None
    n_ex = batch or 1
    g = torch.Generator().manual_seed(args.seed + 2)
    example = torch.randn((n_ex, *shape[1:]), generator=g) if test is None else torch.from_numpy(test[0][:n_ex])
    sample = example if test is None else torch.from_numpy(test[0])  # digits: the test images are the sample input
    say(f"exporting {out} ({args.format}) ...")
    try:
        wrote = _write_outputs(args, qm, out, shape, batch, example, calib, sample, test)
    except OSError as e:  # (a full disk, a folder removed meanwhile, ...: nothing is left behind)
        raise _Fail(f"cannot write '{out}': {e.strerror or e}") from None
    for line in wrote:
        say(line)


def _standard_pt2e_export(args, say, model, calib, shape, test) -> None:
    """torchao's standard quantizer ``--quantizer`` on the float ``model`` (models/pt2e_quantizers.py), calibrated on
    ``calib``; ``--save-output`` is PyTorch's output of the converted program for the saved input."""
    from qcompile.checks import atomic_outputs

    from .export_pt2 import quantized_ops, run_pt2
    from .pt2e_quantizers import export_pt2e

    batch = args.batch if args.batch > 0 else None
    g = torch.Generator().manual_seed(args.seed + 2)
    example = torch.randn((batch or 1, *shape[1:]), generator=g) if test is None \
        else torch.from_numpy(test[0][:batch or 1])
    sample = example if test is None else torch.from_numpy(test[0])
    out = args.output
    saves = [p for p in (args.save_input, args.save_labels, args.save_output) if p]
    t = time.time()
    say(f"quantizing with torchao's {QUANTIZERS[args.quantizer].cls} (prepare_pt2e, {calib.shape[0]} calibration "
        f"samples, convert_pt2e) and exporting {out} (pt2) ...")
    try:
        with atomic_outputs(out, *saves) as tmps:
            tmp = dict(zip([out, *saves], tmps))
            ep = export_pt2e(model, args.quantizer, tmp[out], example, torch.from_numpy(calib),
                             dynamic_batch=batch is None)
            say(f"wrote {out} (PT2E, {sum(quantized_ops(ep).values())} quantized_decomposed ops, "
                f"{time.time() - t:.1f}s)")
            if args.save_input:
                np.save(tmp[args.save_input], sample.numpy())
                say(f"wrote sample input {args.save_input} {tuple(sample.shape)}")
            if args.save_labels:
                np.save(tmp[args.save_labels], test[1])
                say(f"wrote the test labels {args.save_labels} {tuple(test[1].shape)}")
            if args.save_output:
                np.save(tmp[args.save_output], run_pt2(ep, sample).numpy())
                say(f"wrote PyTorch's output of the converted program {args.save_output}")
    except OSError as e:
        raise _Fail(f"cannot write '{out}': {e.strerror or e}") from None


def _ort_quantize_export(args, say, model, calib, shape, test) -> None:
    """A network of models/mobile.py: onnxruntime's quantize_static (QDQ) on ``calib``, then ``--save-input`` (and
    ``--save-labels``): ``test`` (images, labels) where given, else a seeded random batch."""
    from qcompile.checks import atomic_outputs

    from .export_onnx import export_onnx_ort

    batch = args.batch if args.batch > 0 else None
    out = args.output
    t = time.time()
    say(f"quantizing with onnxruntime's quantize_static (bits={args.bits}) and exporting {out} (onnx) ...")
    saves = [p for p in (args.save_input, args.save_labels) if p]  # (--save-output: refused by _check_args)
    try:
        with atomic_outputs(out, *saves) as tmps:
            tmp = dict(zip([out, *saves], tmps))
            om = export_onnx_ort(model, tmp[out], shape, calib, bits=int(args.bits), batch=batch)
            say(f"wrote {out} (ONNX QDQ, opset {om.opset_import[0].version}, {len(om.graph.node)} nodes, "
                f"{time.time() - t:.1f}s)")
            if args.save_input and test is not None:
                np.save(tmp[args.save_input], test[0])
                say(f"wrote the test images {args.save_input} {test[0].shape}")
            elif args.save_input:
                g = torch.Generator().manual_seed(args.seed + 2)
                np.save(tmp[args.save_input], torch.randn((batch or 1, *shape[1:]), generator=g).numpy())
                say(f"wrote sample input {args.save_input} {(batch or 1, *shape[1:])}")
            if args.save_labels:
                np.save(tmp[args.save_labels], test[1])
                say(f"wrote the test labels {args.save_labels} {test[1].shape}")
    except OSError as e:
        raise _Fail(f"cannot write '{out}': {e.strerror or e}") from None


def _write_outputs(args, qm, out, shape, batch, example, calib, sample, test) -> list:
    """Export ``qm`` to ``out`` (``example``: the export's example input) and write the ``--save-*`` arrays
    (``sample``: the saved input). Every file is written under a temporary name beside it and renamed once all are
    complete: a failure (or ^C) leaves none of them, half-written or not. Returns a line per file."""
    from qcompile.checks import atomic_outputs

    saves = [p for p in (args.save_input, args.save_labels, args.save_output) if p]
    wrote = []
    t = time.time()
    with atomic_outputs(out, *saves) as tmps:
        tmp = dict(zip([out, *saves], tmps))
        if args.format == "onnx":
            from .export_onnx import export_onnx
            om = export_onnx(qm, tmp[out], shape, batch=batch)
            wrote.append(f"wrote {out} (ONNX QDQ, opset {om.opset_import[0].version}, onnx.checker ok, "
                         f"{time.time() - t:.1f}s)")
        elif args.format == "pt2":
            from .export_pt2 import export_pt2, quantized_ops
            ep = export_pt2(qm, tmp[out], example, calib=torch.from_numpy(calib), dynamic_batch=batch is None)
            wrote.append(f"wrote {out} (PT2E, {sum(quantized_ops(ep).values())} quantized_decomposed ops, "
                         f"{time.time() - t:.1f}s)")
        else:
            from .export_hawq import export_hawq
            export_hawq(qm, tmp[out], packed_int4=args.packed_int4, input_size=shape[2])
            wrote.append(f"wrote {out} (HAWQ-V3 dicts{', packed int4' if args.packed_int4 else ''})")
        if args.save_input:
            np.save(tmp[args.save_input], sample.numpy())
            wrote.append(f"wrote {'the test images' if test is not None else 'sample input'} {args.save_input} "
                         f"{tuple(sample.shape)}")
        if args.save_labels:
            np.save(tmp[args.save_labels], test[1])
            wrote.append(f"wrote the test labels {args.save_labels} {tuple(test[1].shape)}")
        if args.save_output:
            with torch.no_grad():
                np.save(tmp[args.save_output], qm(sample).numpy())
            wrote.append(f"wrote fake-quant reference output {args.save_output}")
    return wrote


if __name__ == "__main__":
    sys.exit(main())
