#!/usr/bin/env python
"""Accuracy on real data, measured through the compiled .so: scikit-learn's digits, one row per network.

    python scripts/digits_accuracy.py run -o build/digits          # a few minutes on 2 cores
    python scripts/digits_accuracy.py run --nets resnext_tiny --bits 8 --epochs 2 --test-images 40   # a quick check
    python scripts/digits_accuracy.py table docs/bench/digits_accuracy.json --write docs/BENCHMARKS.md README.md

``run`` does what the README's main job does, for every network of ``qcompile.models.digits.NETS`` (``resnet_tiny``,
``mobilenet_v2_tiny`` at stride 1, ``resnext_tiny``; ``--nets``) and every bit width that network's quantizer takes:

1. trains the network here (fixed seed, one thread) for its float accuracy in PyTorch;
2. per bit width, ``qmodel digits --net NET --bits B`` (which trains the same network again, bit for bit, quantizes
   it as ``qmodel`` quantizes its family -- qcompile's PTQ, or onnxruntime's ``quantize_static`` for the MobileNets
   -- and writes ONNX QDQ, the 360 test images and their labels);
3. compiles the ONNX file for llvm at the batch of the test images and runs them through the ``.so`` with the TVM
   runtime;
4. runs the same quantized model by its reference: PyTorch's float32 simulation of it (fake-quant) for qcompile's
   quantizer, onnxruntime running the QDQ graph as written (optimizations off) for onnxruntime's.

It prints and writes DIR/digits_accuracy.json with, per network and bit width: top-1 accuracy through the ``.so``,
the reference's top-1 accuracy, and how many images' top-1 class the two disagree on. ``--test-images N`` uses the
first N test images only (a quick check; the table is made from all 360). ``table`` writes the Markdown table
(block ``digits``) from such a file.

Training is deterministic (one thread, fixed seeds), so ``run`` gives the same numbers every time on the same CPU
with the same torch, onnxruntime and scikit-learn.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import shlex
import sys
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
BITS_NAME = {"8": "INT8", "4": "INT4", "mixed": "mixed"}
QUANTIZER = {"qmodel": ("qcompile's PTQ (`qmodel`)", "PyTorch fake-quant"),
             "onnxruntime": ("onnxruntime `quantize_static`", "onnxruntime, QDQ graph as written")}


def _reference(net, onnx_path: str, fq_path: str, x: np.ndarray) -> np.ndarray:
    """The reference logits of the quantized model: qmodel's fake-quant output (saved by qmodel) or onnxruntime's
    evaluation of the QDQ graph, each Q/DQ and float op on its own."""
    if net.quantizer == "qmodel":
        return np.load(fq_path)[: len(x)]
    from qcompile.models.export_onnx import run_onnx

    return run_onnx(onnx_path, x, disable_optimizations=True)


def _measure(a, net, bits: str, data: dict, out: pathlib.Path) -> dict:
    """Steps 2-4 for one network and bit width; returns its row of results."""
    from qcompile.driver import CompileOptions, compile_model
    from qcompile.models.cli import main as qmodel
    from qcompile.models.digits import accuracy
    from qcompile.runtime import Module

    stem = out / f"{net.stem}_{BITS_NAME[bits].lower()}"
    onnx_path, so, x_path, y_path, fq_path = (f"{stem}{e}" for e in (".onnx", ".so", "_x.npy", "_y.npy", "_fq.npy"))
    t0 = time.time()
    argv = ["digits", "--net", net.name, "--bits", bits, "--epochs", str(a.epochs), "--seed", str(a.seed),
            "-o", onnx_path, "--save-input", x_path, "--save-labels", y_path, "-q"]
    rc = qmodel(argv + (["--save-output", fq_path] if net.quantizer == "qmodel" else []))
    if rc:
        sys.exit(f"qmodel {shlex.join(argv)} failed (exit {rc})")
    x, y = np.load(x_path), np.load(y_path)
    # qmodel trained the same network on the same split: the determinism this table rests on
    assert np.array_equal(x, data["x_test"]) and np.array_equal(y, data["y_test"])
    x, y = x[: a.test_images], y[: a.test_images]
    res = compile_model(onnx_path, CompileOptions(layout=a.layout, batch=len(x)), log=lambda s: None)
    res.export(so)
    logits = Module(os.path.abspath(so))(x)
    ref = _reference(net, onnx_path, fq_path, x)
    row = dict(bits=bits, accuracy=accuracy(logits, y), reference=accuracy(ref, y),
               disagree=int((logits.argmax(1) != ref.argmax(1)).sum()))
    print(f"  {BITS_NAME[bits]}: through the .so {row['accuracy']:.2f}%, reference {row['reference']:.2f}%, "
          f"{row['disagree']} of {len(y)} images classified differently by the two ({time.time() - t0:.1f} s)",
          flush=True)
    return row


def _run_net(a, net, out: pathlib.Path) -> dict:
    """Steps 1-4 for one network."""
    import torch

    from qcompile.models.digits import accuracy, train

    t0 = time.time()
    model, data = train(epochs=a.epochs, seed=a.seed, net=net.name)
    with torch.no_grad():
        float_acc = accuracy(model(torch.from_numpy(data["x_test"][: a.test_images])), data["y_test"][: a.test_images])
    print(f"{net.name}: float model (PyTorch float32) {float_acc:.2f}% ({time.time() - t0:.1f} s to train)",
          flush=True)
    rows = [_measure(a, net, bits, data, out) for bits in net.bits if bits in a.bits]
    int8 = next((r for r in rows if r["bits"] == "8"), None)
    if int8 and abs(int8["accuracy"] - float_acc) > 0.5:
        print(f"  note: INT8 is {int8['accuracy'] - float_acc:+.2f} points from float (more than 0.5)", flush=True)
    return dict(net=net.name, about=net.about, quantizer=net.quantizer, float=float_acc, rows=rows,
                n_train=int(len(data["y_train"])), n_calib=int(len(data["calib"])))


def cmd_run(a):
    import onnxruntime
    import sklearn
    import torch

    from qcompile.models.digits import get_net

    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    nets = [_run_net(a, get_net(n), out) for n in a.nets]
    res = {"date": datetime.date.today().isoformat(), "n_test": min(a.test_images, 360), "n_train": nets[0]["n_train"],
           "n_calib": nets[0]["n_calib"], "epochs": a.epochs, "seed": a.seed, "layout": a.layout,
           "versions": {"torch": torch.__version__, "onnxruntime": onnxruntime.__version__,
                        "scikit-learn": sklearn.__version__},
           "command": shlex.join(["python", "scripts/digits_accuracy.py", *a.argv]), "nets": nets}
    path = out / "digits_accuracy.json"
    path.write_text(json.dumps(res, indent=1) + "\n")
    print(f"\nwrote {path}\n\n" + table(path))


def _cell(rows: dict, bits: str, f: float) -> str:
    r = rows.get(bits)
    return "-" if r is None else f"{r['accuracy']:.2f} ({r['accuracy'] - f:+.2f})"


def _summary(res: dict) -> str:
    """One sentence from the results: the images the .so and the references disagree on, INT8's distance to float."""
    differ = sum(r["disagree"] for n in res["nets"] for r in n["rows"])
    cells = sum(len(n["rows"]) for n in res["nets"])
    int8 = [(abs(r["accuracy"] - n["float"]), n["net"]) for n in res["nets"] for r in n["rows"] if r["bits"] == "8"]
    line = (f"The `.so` and its reference disagree on {differ} image{'s' * (differ != 1)} over all {cells} quantized "
            f"models.")
    if int8:
        worst = max(int8)
        line += (f" INT8 is at most {worst[0]:.2f} points from float ({worst[1]})"
                 f"{'' if worst[0] <= 0.5 else ': more than 0.5'}.")
    return line


def table(path) -> str:
    """The Markdown block ``digits`` of a results file: one row per network."""
    res = json.loads(pathlib.Path(path).read_text())
    v = res["versions"]
    bits = [b for b in BITS_NAME if any(r["bits"] == b for n in res["nets"] for r in n["rows"])]
    out = [f"Each network trained by `qmodel digits --net NET` on scikit-learn's digits ({res['n_train']} training "
           f"images, {res['epochs']} epochs, seed {res['seed']}; activation scales from {res['n_calib']} of them), "
           f"quantized as `qmodel` quantizes its family, compiled for llvm ({res['layout']}, batch {res['n_test']}) "
           f"and run on the {res['n_test']} test images: top-1 accuracy (%) through the `.so` and, in brackets, its "
           f"difference to the float model's. *Reference*: the same quantized model run by PyTorch's float32 "
           f"simulation (qcompile's PTQ; the `.so` computes it in integers) or by onnxruntime op by op "
           f"(`quantize_static`'s QDQ graph as written, optimizations off); *differ*: test images on whose top-1 "
           f"class the `.so` and the reference disagree. INT4: 4-bit weights and activations but the input, the "
           f"first conv and the last layer; mixed: the middle stage's conv2 W4A4 (resnet_tiny: the second 3x3; "
           f"resnext_tiny: the grouped 3x3), the rest "
           f"8-bit. {res['date']}, torch {v['torch']}, onnxruntime {v['onnxruntime']}, scikit-learn "
           f"{v['scikit-learn']}. Command: `{res['command']}`.", ""]
    out += [f"* `{n['net']}`: {n['about']}." for n in res["nets"]]
    names = [BITS_NAME[b] for b in bits]
    out += ["", "| net (1x8x8) | quantized by | float | " + " | ".join(names) + f" | reference ({' / '.join(names)}) "
            f"| differ ({' / '.join(names)}) |", "|---|---|---|" + "---|" * len(bits) + "---|---|"]
    for n in res["nets"]:
        rows = {r["bits"]: r for r in n["rows"]}
        ref = " / ".join(f"{rows[b]['reference']:.2f}" if b in rows else "-" for b in bits)
        dif = " / ".join(str(rows[b]["disagree"]) if b in rows else "-" for b in bits)
        out.append(f"| {n['net']} | {QUANTIZER[n['quantizer']][0]} | {n['float']:.2f} | "
                   + " | ".join(_cell(rows, b, n["float"]) for b in bits) + f" | {ref} | {dif} |")
    return "\n".join([*out, "", _summary(res)]) + "\n"


def main(argv=None):
    sys.path.insert(0, str(ROOT / "scripts"))
    import e2e_table

    from qcompile.models.cli import DIGITS_NETS
    from qcompile.models.digits import EPOCHS

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] not in (["run"], ["table"], ["-h"], ["--help"]):
        argv = ["run", *argv]
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="train, quantize, compile, measure")
    r.add_argument("-o", "--out", default="build/digits", help="models and results (default: %(default)s)")
    r.add_argument("--layout", default="NHWC")
    r.add_argument("--epochs", type=int, default=EPOCHS, help="training epochs (default: qmodel's, %(default)s)")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--nets", nargs="+", choices=list(DIGITS_NETS), default=list(DIGITS_NETS),
                   help="networks (default: all)")
    r.add_argument("--bits", nargs="+", choices=list(BITS_NAME), default=list(BITS_NAME),
                   help="bit widths, where a network's quantizer takes them (default: all)")
    r.add_argument("--test-images", type=int, default=360, help="the first N test images only (default: all 360)")
    e2e_table.add_table_command(sub, "digits")
    a = ap.parse_args(argv)
    a.argv = argv
    if a.cmd == "run":
        if a.test_images < 1:
            ap.error(f"--test-images must be at least 1, got {a.test_images}")
        cmd_run(a)
    else:
        e2e_table.write_block(a.name, table(a.results), a.write)


if __name__ == "__main__":
    main()
