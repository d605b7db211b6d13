"""``digits``: small CNNs trained on scikit-learn's digits -- the example models whose answers can be checked.

The data ship with scikit-learn (no download): 1797 grayscale 8x8 images of the handwritten digits 0-9. Pixels are
scaled to [0, 1] (value / 16) and split 80/20, stratified by class with a fixed seed: 1437 training and 360 test
images. The networks (:data:`NETS`, ``qmodel digits --net NAME``) take one input channel and end at 2x2 before the
global average pool and a 10-class classifier:

* ``resnet_tiny`` (the default): a 3x3 stem, one BasicBlock per stage at 16, 32 and 64 channels;
* ``mobilenet_v2_tiny`` with its stem at stride 1 (the 8x8 input's adaptation, as resnet_tiny's stem): inverted
  residuals with ReLU6 and depthwise 3x3 convs; ``qmodel`` quantizes it with onnxruntime's ``quantize_static``;
* ``resnext_tiny``: one Bottleneck per stage whose 3x3 convs have 8 groups.

Training (AdamW, one-cycle learning rate, label smoothing, random +-1 pixel shifts) runs from a fixed seed on one CPU
thread with PyTorch's deterministic algorithms: the same versions of torch and scikit-learn give the same weights, bit
for bit, on the same kind of CPU.

    from qcompile.models.digits import train
    model, data = train()          # a few seconds; data: x_train, y_train, x_test, y_test, calib (NumPy)
    model, data = train(net="resnext_tiny")

``qmodel digits`` uses this, as do ``scripts/train_digits.py`` and ``scripts/digits_accuracy.py``.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch
import torch.nn.functional as F

from .mobile import mobilenet_v2_tiny
from .resnet import resnext_tiny, resnet_tiny

EPOCHS = 20          # ~99% float test accuracy; a few seconds on one core
CALIB_IMAGES = 256   # calibration batch, drawn from the training split
INPUT_SHAPE = (1, 1, 8, 8)
NUM_CLASSES = 10


@dataclass(frozen=True)
class DigitsNet:
    """A network ``qmodel digits --net NAME`` trains on the digits (1x8x8 input, 10 classes).

    ``name`` is the example model whose shape it has (``qmodel NAME``); ``build(num_classes, in_ch)`` makes it for
    the 8x8 input; ``quantizer`` is how ``qmodel`` quantizes that family: ``"qmodel"`` (qcompile's PTQ,
    ``quantize_model`` + ``export_onnx``) or ``"onnxruntime"`` (``quantize_static``, ``export_onnx_ort``), with the
    ``bits`` it takes; ``stem``: the name its files start with; ``about``: one line on its shape here."""
    name: str
    build: Callable[..., torch.nn.Module]
    quantizer: str
    bits: tuple[str, ...]
    stem: str
    about: str


NETS: dict[str, DigitsNet] = {n.name: n for n in (
    DigitsNet("resnet_tiny", resnet_tiny, "qmodel", ("8", "4", "mixed"), "digits",
              "a 3x3 stem (16), one BasicBlock per stage at 16, 32, 64 channels; 8x8 -> 2x2"),
    DigitsNet("mobilenet_v2_tiny", lambda num_classes, in_ch: mobilenet_v2_tiny(num_classes, in_ch, stem_stride=1),
              "onnxruntime", ("8", "4"), "digits_mobilenet_v2",
              "its 3x3 stem (16) at stride 1 (`qmodel mobilenet_v2_tiny`'s is at 2), inverted residuals (ReLU6, "
              "depthwise 3x3) at 8, 16 (twice, a residual) and 24 channels, a 1x1 head (64); 8x8 -> 2x2"),
    DigitsNet("resnext_tiny", resnext_tiny, "qmodel", ("8", "4", "mixed"), "digits_resnext",
              "a 3x3 stem (8), one Bottleneck per stage (outputs 32, 64, 128) whose 3x3 convs have 8 groups; "
              "8x8 -> 2x2"),
)}


def get_net(name: str) -> DigitsNet:
    try:
        return NETS[name]
    except KeyError:
        raise ValueError(f"unknown digits net {name!r}; known: {', '.join(NETS)}") from None


def load_split(seed: int = 0) -> dict:
    """scikit-learn's digits as float32 NCHW in [0, 1] and int64 labels, split 80/20 (stratified, ``seed``)."""
    try:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split
    except ModuleNotFoundError:
        raise ModuleNotFoundError("the digits model needs scikit-learn (its data ship with it): "
                                  "pip install 'qcompile[torch]'", name="sklearn") from None
    d = load_digits()
    x = (d.images.astype(np.float32) / 16.0)[:, None]          # N, 1, 8, 8
    y = d.target.astype(np.int64)
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=0.2, random_state=seed, stratify=y)
    return dict(x_train=np.ascontiguousarray(xtr), y_train=ytr, x_test=np.ascontiguousarray(xte), y_test=yte)


def accuracy(logits, labels: np.ndarray) -> float:
    """Top-1 accuracy in percent."""
    return float((np.asarray(logits).argmax(1) == np.asarray(labels)).mean() * 100.0)


def _shift(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """The batch shifted by a random whole pixel in [-1, 1] along each axis (zero padded)."""
    h, w = x.shape[2:]
    dy, dx = torch.randint(0, 3, (2,), generator=g).tolist()
    return F.pad(x, (1, 1, 1, 1))[:, :, dy:dy + h, dx:dx + w]


@contextlib.contextmanager
def _deterministic(threads: int):
    """One CPU thread (the model is tiny: more threads only add contention) and deterministic algorithms,
    restored afterwards."""
    n, det = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.set_num_threads(n)
        torch.use_deterministic_algorithms(det)


def _build(net: DigitsNet, seed: int) -> torch.nn.Module:
    """``net`` with 1 input channel and 10 classes, its weights initialized from ``seed`` (global RNG untouched)."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return net.build(num_classes=NUM_CLASSES, in_ch=1)


def train(epochs: int = EPOCHS, seed: int = 0, batch: int = 64, lr: float = 4e-3, calib_images: int = CALIB_IMAGES,
          threads: int = 1, log: Optional[Callable[[str], None]] = None,
          net: str = "resnet_tiny") -> tuple[torch.nn.Module, dict]:
    """Train ``net`` (a key of :data:`NETS`; 1 channel, 10 classes) on the digits; return the model (eval mode) and
    the data.

    ``data`` holds ``x_train``, ``y_train``, ``x_test``, ``y_test`` and ``calib`` (``calib_images`` training
    images, drawn with ``seed``), all NumPy. ``log(line)`` gets a progress line every few epochs.
    """
    if epochs < 1:
        raise ValueError(f"epochs must be at least 1, got {epochs}")
    data = load_split(seed)
    xt, yt = torch.from_numpy(data["x_train"]), torch.from_numpy(data["y_train"])
    xte = torch.from_numpy(data["x_test"])
    with _deterministic(threads), torch.random.fork_rng():
        torch.manual_seed(seed)
        model = _build(get_net(net), seed)
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=5e-4)
        steps_per_epoch = -(-len(xt) // batch)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=epochs * steps_per_epoch)
        g = torch.Generator().manual_seed(seed)
        t0 = time.time()
        for ep in range(epochs):
            model.train()
            perm = torch.randperm(len(xt), generator=g)
            total = 0.0
            for i in range(0, len(xt), batch):
                idx = perm[i:i + batch]
                loss = F.cross_entropy(model(_shift(xt[idx], g)), yt[idx], label_smoothing=0.05)
                opt.zero_grad()
                loss.backward()
                opt.step()
                sched.step()
                total += float(loss.detach()) * len(idx)
            if log and ((ep + 1) % max(1, epochs // 4) == 0 or ep == epochs - 1):
                model.eval()
                with torch.no_grad():
                    acc = accuracy(model(xte), data["y_test"])
                log(f"epoch {ep + 1}/{epochs}: training loss {total / len(xt):.4f}, "
                    f"float test accuracy {acc:.2f}% ({time.time() - t0:.1f}s)")
        model.eval()
    rng = np.random.RandomState(seed)
    pick = rng.choice(len(data["x_train"]), size=min(calib_images, len(data["x_train"])), replace=False)
    data["calib"] = data["x_train"][np.sort(pick)]
    return model, data
