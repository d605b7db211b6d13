#!/usr/bin/env python
"""Accuracy on real data, measured through the compiled .so: scikit-learn's digits.

    python scripts/digits_accuracy.py run -o build/digits          # about a minute on 2 cores
    python scripts/digits_accuracy.py table docs/bench/digits_accuracy.json --write docs/BENCHMARKS.md README.md

``run`` does what the README's main job does, once per bit width: ``qmodel digits --bits B`` (trains resnet_tiny on
the digits from a fixed seed, quantizes it, writes ONNX QDQ, the 360 test images and their labels), compiles the
ONNX file for llvm at batch 360 and runs the test images through the ``.so`` with the TVM runtime. It prints and
writes DIR/digits_accuracy.json with, per model: top-1 accuracy through the ``.so``; the same quantized model's
accuracy in PyTorch (fake-quant: float32 simulation of the quantization); how many images' top-1 class the ``.so``
and PyTorch's simulation disagree on. ``table`` writes the Markdown table (block ``digits``) from such a file.

Training is deterministic (one thread, fixed seeds), so ``run`` gives the same numbers every time on the same CPU
with the same torch and scikit-learn.
"""
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
BITS = {"8": "int8 through the .so", "4": "int4 through the .so (input, first conv and last layer 8-bit)",
        "mixed": "mixed through the .so (the middle stage's second 3x3 conv W4A4, the rest 8-bit)"}


def cmd_run(a):
    import torch

    from qcompile.driver import CompileOptions, compile_model
    from qcompile.models.cli import main as qmodel
    from qcompile.models.digits import accuracy, train
    from qcompile.runtime import Module

    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    model, data = train(epochs=a.epochs, seed=a.seed)
    with torch.no_grad():
        float_acc = accuracy(model(torch.from_numpy(data["x_test"])), data["y_test"])
    print(f"float model (PyTorch float32): {float_acc:.2f}% ({time.time() - t0:.1f} s to train)", flush=True)
    rows = [dict(model="float, PyTorch float32 (no .so)", bits=None, accuracy=float_acc, fakequant=None, disagree=None)]
    for bits, name in BITS.items():
        tag = name.split(" ")[0]
        onnx_path, x_path, y_path, fq_path = (str(out / f) for f in (f"digits_{tag}.onnx", "x.npy", "y.npy",
                                                                       f"fakequant_{tag}.npy"))
        t0 = time.time()
        rc = qmodel(["digits", "--bits", bits, "--epochs", str(a.epochs), "--seed", str(a.seed), "-o", onnx_path,
                     "--save-input", x_path, "--save-labels", y_path, "--save-output", fq_path, "-q"])
        if rc:
            sys.exit(f"qmodel digits --bits {bits} failed (exit {rc})")
        x, y, fq = np.load(x_path), np.load(y_path), np.load(fq_path)
        # qmodel trained the same model on the same split: the determinism this table rests on
        assert np.array_equal(x, data["x_test"]) and np.array_equal(y, data["y_test"])
        res = compile_model(onnx_path, CompileOptions(layout=a.layout, batch=len(x)), log=lambda s: None)
        so = str(out / f"digits_{tag}.so")
        res.export(so)
        logits = Module(os.path.abspath(so))(x)
        rows.append(dict(model=name, bits=bits, accuracy=accuracy(logits, y), fakequant=accuracy(fq, y),
                         disagree=int((logits.argmax(1) != fq.argmax(1)).sum())))
        r = rows[-1]
        print(f"{tag}: through the .so {r['accuracy']:.2f}%, PyTorch fake-quant {r['fakequant']:.2f}%, "
              f"{r['disagree']} of {len(y)} images classified differently by the two ({time.time() - t0:.1f} s)",
              flush=True)
    import sklearn

    res = {"date": datetime.date.today().isoformat(), "n_test": int(len(data["y_test"])),
           "n_train": int(len(data["y_train"])), "n_calib": int(len(data["calib"])), "epochs": a.epochs,
           "seed": a.seed, "layout": a.layout, "versions": {"torch": torch.__version__, "scikit-learn":
                                                            sklearn.__version__},
           "command": shlex.join(["python", "scripts/digits_accuracy.py", *sys.argv[1:]]), "rows": rows}
    path = out / "digits_accuracy.json"
    path.write_text(json.dumps(res, indent=1) + "\n")
    print(f"\nwrote {path}\n\n" + table(path))


def table(path):
    res = json.loads(pathlib.Path(path).read_text())
    v = res["versions"]
    out = [f"resnet_tiny (1x8x8 input) trained by `qmodel digits` on scikit-learn's digits ({res['n_train']} "
           f"training images, {res['epochs']} epochs, seed {res['seed']}; activation scales from {res['n_calib']} of "
           f"them), compiled for llvm ({res['layout']}, batch {res['n_test']}) and run on the {res['n_test']} test "
           f"images. *PyTorch fake-quant*: the same quantized model simulated in float32 by PyTorch (the `.so` "
           f"computes it in integers); *differ*: test images on whose top-1 class the two disagree. {res['date']}, "
           f"torch {v['torch']}, scikit-learn {v['scikit-learn']}. Command: `{res['command']}`.", "",
           "| model | top-1 accuracy (%) | vs float | PyTorch fake-quant (%) | differ |",
           "|---|---|---|---|---|"]
    f = res["rows"][0]["accuracy"]
    for r in res["rows"]:
        if r["bits"] is None:
            out.append(f"| {r['model']} | {f:.2f} | | | |")
        else:
            out.append(f"| {r['model']} | {r['accuracy']:.2f} | {r['accuracy'] - f:+.2f} | {r['fakequant']:.2f} "
                       f"| {r['disagree']} |")
    return "\n".join(out) + "\n"


def main(argv=None):
    sys.path.insert(0, str(ROOT / "scripts"))
    import e2e_table

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
    e2e_table.add_table_command(sub, "digits")
    a = ap.parse_args(argv)
    if a.cmd == "run":
        cmd_run(a)
    else:
        e2e_table.write_block(a.name, table(a.results), a.write)


if __name__ == "__main__":
    main()
