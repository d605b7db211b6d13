#!/usr/bin/env python
"""Train a digits model (``qcompile.models.digits``, what ``qmodel digits --net NET`` trains) and export it quantized.

    python scripts/train_digits.py -o out/digits            # a few seconds of training, then the exports
    python scripts/train_digits.py -o out/digits_mnv2 --net mobilenet_v2_tiny

Writes into ``-o`` (STEM: ``digits`` for resnet_tiny, ``digits_mobilenet_v2``, ``digits_resnext``):

    NET_digits.pt                        float state_dict (+ "meta": net, input shape, classes); resnet_tiny's:
                                         qmodel resnet_tiny --in-ch 1 --input-size 8 --weights reads it
    x_test.npy (float32 NCHW), y_test.npy (int64), calib.npy (the 256 training images the scales come from)
    STEM_int8.onnx, STEM_int4.onnx, STEM_mixed.onnx   ONNX QDQ (batch 1; qcompile --batch N re-batches); mixed only
                                         from qcompile's quantizer (resnet_tiny, resnext_tiny)
    qcompile's quantizer only: STEM_int8.pt2, STEM_int4.pt2 (PT2E; not with --no-pt2), and where no conv is grouped
                                         (resnet_tiny) STEM_int8.hawq.pth, STEM_int4.hawq.pth
    accuracy.json                        the accuracies printed at the end

Each net is quantized as ``qmodel`` quantizes its family: qcompile's PTQ (``quantize_model``), or onnxruntime's
``quantize_static`` for the MobileNet (``export_onnx_ort``).

It prints test accuracies (360 images, top-1) and what each one measures. Every number is computed by PyTorch or
onnxruntime on this machine; the compiled ``.so``'s own accuracy is ``scripts/digits_accuracy.py``'s.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

import numpy as np
import torch

from qcompile.models.digits import EPOCHS, NETS, accuracy, get_net, train
from qcompile.models.export_hawq import export_hawq
from qcompile.models.export_onnx import export_onnx, run_onnx
from qcompile.models.quantize import CalibConfig, quantize_model

LEGEND = {
    "float": "the float model, PyTorch float32",
    "fakequant": "the quantized model simulated in float by PyTorch (qmodel's quantizer: BN folded, per-channel "
                 "weights, per-tensor activation scales from calib.npy); the compiled .so computes this in integers",
    "onnx": "the exported ONNX QDQ file run by onnxruntime op by op, each QuantizeLinear / DequantizeLinear / float "
            "op on its own (optimizations off: the QDQ format's own meaning, not onnxruntime's fused int8 kernels, "
            "which on x86 without VNNI saturate int16 pair sums in vpmaddubsw and are several steps off)",
    "pt2": "the exported PT2E program run by PyTorch",
}
TAGS = {"8": "int8", "4": "int4", "mixed": "mixed"}


def _export_qmodel(net, model, data: dict, args, res: dict) -> None:
    """qcompile's quantizer: fake-quant accuracy, ONNX QDQ, and HAWQ / PT2E where the net has them."""
    xte, yte = data["x_test"], data["y_test"]
    shape = (1, *xte.shape[1:])
    cc = CalibConfig(seed=args.seed)  # qmodel's defaults
    for bits in net.bits:
        tag = TAGS[bits]
        qm = quantize_model(model, data["calib"], bits, calib=cc, arch=net.name)
        with torch.no_grad():
            res[f"{tag}_fakequant"] = accuracy(qm(torch.from_numpy(xte)), yte)
        path = os.path.join(args.out, f"{net.stem}_{tag}.onnx")
        export_onnx(qm, path, shape, batch=1)
        res[f"{tag}_onnx"] = accuracy(run_onnx(path, xte, disable_optimizations=True), yte)
        line = f"[quant] {tag}: fake-quant {res[f'{tag}_fakequant']:.2f}%, ONNX file {res[f'{tag}_onnx']:.2f}%"
        if tag != "mixed":
            if all(ly.groups == 1 for ly in qm.layers.values()):  # (HAWQ describes plain-conv ResNets)
                export_hawq(qm, os.path.join(args.out, f"{net.stem}_{tag}.hawq.pth"), packed_int4=False,
                            input_size=xte.shape[2])
            if not args.no_pt2:
                logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)  # a deprecation note torchao triggers
                from qcompile.models.export_pt2 import export_pt2, run_pt2
                p2 = os.path.join(args.out, f"{net.stem}_{tag}.pt2")
                export_pt2(qm, p2, torch.from_numpy(xte[:1]), calib=torch.from_numpy(data["calib"]))
                res[f"{tag}_pt2"] = accuracy(run_pt2(p2, torch.from_numpy(xte)).numpy(), yte)
                line += f", PT2E program {res[f'{tag}_pt2']:.2f}%"
        print(line, flush=True)


def _export_onnxruntime(net, model, data: dict, args, res: dict) -> None:
    """onnxruntime's quantize_static (as qmodel runs it): ONNX QDQ, run by onnxruntime op by op."""
    from qcompile.models.export_onnx import export_onnx_ort

    xte, yte = data["x_test"], data["y_test"]
    for bits in net.bits:
        tag = TAGS[bits]
        path = os.path.join(args.out, f"{net.stem}_{tag}.onnx")
        export_onnx_ort(model, path, (1, *xte.shape[1:]), data["calib"], bits=int(bits), batch=1)
        res[f"{tag}_onnx"] = accuracy(run_onnx(path, xte, disable_optimizations=True), yte)
        print(f"[quant] {tag} (onnxruntime quantize_static): ONNX file {res[f'{tag}_onnx']:.2f}%", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-o", "--out", default="out/digits")
    ap.add_argument("--epochs", type=int, default=EPOCHS, help="training epochs (default %(default)s, as qmodel)")
    ap.add_argument("--calib", type=int, default=256, help="calibration images (from the training split)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--net", default="resnet_tiny", choices=list(NETS), help="the network (default %(default)s)")
    ap.add_argument("--no-pt2", action="store_true", help="skip the (slower) PT2E exports")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    net = get_net(args.net)

    print(f"[train] {net.name} on scikit-learn's digits, {args.epochs} epochs, seed {args.seed}", flush=True)
    t0 = time.time()
    model, data = train(epochs=args.epochs, seed=args.seed, calib_images=args.calib,
                        log=lambda s: print("  " + s, flush=True), net=net.name)
    print(f"[train] done in {time.time() - t0:.1f}s", flush=True)
    xte, yte = data["x_test"], data["y_test"]
    torch.save({"state_dict": model.state_dict(), "meta": dict(arch=net.name, about=net.about, in_ch=1,
                                                              num_classes=10, input_shape=(1, *xte.shape[1:]),
                                                              scale="pixels/16")},
               os.path.join(args.out, f"{net.name}_digits.pt"))
    np.save(os.path.join(args.out, "x_test.npy"), xte)
    np.save(os.path.join(args.out, "y_test.npy"), yte)
    np.save(os.path.join(args.out, "calib.npy"), data["calib"])

    with torch.no_grad():
        res = {"float": accuracy(model(torch.from_numpy(xte)), yte)}
    (_export_qmodel if net.quantizer == "qmodel" else _export_onnxruntime)(net, model, data, args, res)

    print(f"\n== digits: top-1 test accuracy on {len(yte)} images ==")
    for k, v in res.items():
        print(f"  {k:16s} {v:6.2f}%")
    print("where")
    for key, text in LEGEND.items():
        print(f"  {key if key == 'float' else '*_' + key:16s} {text}")
    res.update(net=net.name, n_test=int(len(yte)), epochs=args.epochs, seed=args.seed, calib=int(len(data["calib"])))
    with open(os.path.join(args.out, "accuracy.json"), "w") as f:
        json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
