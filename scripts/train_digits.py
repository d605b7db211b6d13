#!/usr/bin/env python
"""Train ``resnet_tiny`` on scikit-learn's digits (8x8 gray, 1 channel) and export quantized models.

    python scripts/train_digits.py -o out/digits            # ~30 s on one CPU core

Data: pixels / 16 -> [0, 1], optional nearest upsampling (``--size 16``), stratified
80/20 split (seed), training augmentation = random +-1 pixel shifts.  Writes into ``-o``:

    resnet_tiny_digits.pt                float state_dict (+ "meta": input shape, classes)
    x_test.npy (float32 NCHW), y_test.npy (int64), calib.npy (256 training images)
    digits_int8.onnx, digits_int4.onnx, digits_mixed.onnx     QDQ models (batch 1)
    digits_int8.pt2, digits_int4.pt2 (PT2E), digits_int8.hawq.pth, digits_int4.hawq.pth
    accuracy.json                        the numbers printed at the end

and prints float / fake-quant (PyTorch) / onnxruntime test accuracies.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

from qcompile.models.export_hawq import export_hawq
from qcompile.models.export_onnx import export_onnx, run_onnx
from qcompile.models.quantize import CalibConfig, quantize_model
from qcompile.models.resnet import build_model


def load_digits_split(size: int, seed: int):
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    d = load_digits()
    x = (d.images.astype(np.float32) / 16.0)[:, None]          # N,1,8,8 in [0,1]
    if size != 8:
        x = F.interpolate(torch.from_numpy(x), size=(size, size), mode="nearest").numpy()
    y = d.target.astype(np.int64)
    return train_test_split(x, y, test_size=0.2, random_state=seed, stratify=y)


def shift_augment(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """Random integer shifts in [-1, 1] pixels (zero padded)."""
    n, _, h, w = x.shape
    p = F.pad(x, (1, 1, 1, 1))
    dy, dx = torch.randint(0, 3, (2,), generator=g).tolist()
    return p[:, :, dy:dy + h, dx:dx + w]


def accuracy(logits: torch.Tensor | np.ndarray, y: np.ndarray) -> float:
    pred = np.asarray(logits).argmax(1)
    return float((pred == y).mean() * 100.0)


def train(args) -> tuple[torch.nn.Module, dict]:
    torch.manual_seed(args.seed)
    xtr, xte, ytr, yte = load_digits_split(args.size, args.seed)
    model = build_model("resnet_tiny", num_classes=10, in_ch=1, seed=args.seed)
    # the registry randomizes BN statistics for untrained use; training starts from plain BN
    for m in model.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.reset_parameters()
            m.reset_running_stats()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=5e-4)
    steps = args.epochs * int(np.ceil(len(xtr) / args.batch))
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=steps)
    g = torch.Generator().manual_seed(args.seed)
    xt, yt = torch.from_numpy(xtr), torch.from_numpy(ytr)
    t0 = time.time()
    for ep in range(args.epochs):
        model.train()
        perm = torch.randperm(len(xt), generator=g)
        tot = 0.0
        for i in range(0, len(xt), args.batch):
            idx = perm[i:i + args.batch]
            xb = shift_augment(xt[idx], g)
            loss = F.cross_entropy(model(xb), yt[idx], label_smoothing=0.05)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            tot += float(loss.detach()) * len(idx)
        if (ep + 1) % max(1, args.epochs // 6) == 0 or ep == args.epochs - 1:
            model.eval()
            with torch.no_grad():
                acc = accuracy(model(torch.from_numpy(xte)), yte)
            print(f"  epoch {ep + 1:3d}/{args.epochs}  loss {tot / len(xt):.4f}  test acc {acc:.2f}%  "
                  f"({time.time() - t0:.1f}s)", flush=True)
    model.eval()
    rng = np.random.RandomState(args.seed)
    calib = xtr[rng.choice(len(xtr), size=min(args.calib, len(xtr)), replace=False)]
    return model, dict(x_train=xtr, y_train=ytr, x_test=xte, y_test=yte, calib=calib)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-o", "--out", default="out/digits")
    ap.add_argument("--size", type=int, default=8, choices=(8, 16), help="input resolution (nearest upsampling)")
    ap.add_argument("--epochs", type=int, default=60)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=4e-3)
    ap.add_argument("--calib", type=int, default=256, help="calibration images (from the training split)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--calib-method4", default="mse", choices=("minmax", "percentile", "mse"))
    ap.add_argument("--calib-method8", default="minmax", choices=("minmax", "percentile", "mse"))
    ap.add_argument("--no-pt2", action="store_true", help="skip the (slower) PT2E exports")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    # one thread: the model is tiny, and extra threads only add contention (7x slower measured)
    torch.set_num_threads(args.threads)

    print(f"[train] resnet_tiny on sklearn digits {args.size}x{args.size}, {args.epochs} epochs", flush=True)
    t0 = time.time()
    model, data = train(args)
    print(f"[train] done in {time.time() - t0:.1f}s", flush=True)
    xte, yte = data["x_test"], data["y_test"]
    shape = (1, 1, args.size, args.size)
    torch.save({"state_dict": model.state_dict(), "meta": dict(arch="resnet_tiny", in_ch=1, num_classes=10,
                                                              input_shape=shape, scale="pixels/16")},
               os.path.join(args.out, "resnet_tiny_digits.pt"))
    np.save(os.path.join(args.out, "x_test.npy"), xte)
    np.save(os.path.join(args.out, "y_test.npy"), yte)
    np.save(os.path.join(args.out, "calib.npy"), data["calib"])

    with torch.no_grad():
        res = {"float": accuracy(model(torch.from_numpy(xte)), yte)}
    calib_cfg = CalibConfig(method8=args.calib_method8, method4=args.calib_method4, seed=args.seed)
    for tag, bits in (("int8", 8), ("int4", 4), ("mixed", "mixed")):
        qm = quantize_model(model, data["calib"], bits, calib=calib_cfg, arch="resnet_tiny")
        with torch.no_grad():
            res[f"{tag}_fakequant"] = accuracy(qm(torch.from_numpy(xte)), yte)
        path = os.path.join(args.out, f"digits_{tag}.onnx")
        export_onnx(qm, path, shape, batch=1)
        res[f"{tag}_onnxruntime"] = accuracy(run_onnx(path, xte), yte)
        if tag != "mixed":
            export_hawq(qm, os.path.join(args.out, f"digits_{tag}.hawq.pth"), packed_int4=False, input_size=xte.shape[2])
            if not args.no_pt2:
                from qcompile.models.export_pt2 import export_pt2, run_pt2
                p2 = os.path.join(args.out, f"digits_{tag}.pt2")
                export_pt2(qm, p2, torch.from_numpy(xte[:1]), calib=torch.from_numpy(data["calib"]))
                res[f"{tag}_pt2"] = accuracy(run_pt2(p2, torch.from_numpy(xte)).numpy(), yte)
        print(f"[quant] {tag}: fake-quant {res[f'{tag}_fakequant']:.2f}%  onnxruntime "
              f"{res[f'{tag}_onnxruntime']:.2f}%  -> {path}", flush=True)

    print("\n== digits test accuracy (%d images) ==" % len(yte))
    for k, v in res.items():
        print(f"  {k:20s} {v:6.2f}%")
    d8, d4 = res["float"] - res["int8_fakequant"], res["float"] - res["int4_fakequant"]
    print(f"  int8 drop {d8:+.2f} pts (goal <= 0.5), int4 drop {d4:+.2f} pts (goal <= 3)")
    res.update(n_test=int(len(yte)), seconds=round(time.time() - t0, 1), size=args.size, seed=args.seed)
    with open(os.path.join(args.out, "accuracy.json"), "w") as f:
        json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
