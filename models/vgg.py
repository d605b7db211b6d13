"""torchvision-shaped VGG-16 (no torchvision dependency) and a tiny variant for tests.

Module names and structure follow ``torchvision.models.vgg16`` (configuration "D", no batch norm), so a torchvision
``state_dict`` loads unchanged into :func:`vgg16`::

    features:   13 x (Conv2d 3x3 / pad 1, with bias -> ReLU), a MaxPool2d 2x2 / stride 2 after convs 2, 4, 7, 10, 13
    avgpool:    AdaptiveAvgPool2d((7, 7))
    classifier: Linear(512 * 7 * 7 = 25088, 4096), ReLU, Dropout, Linear(4096, 4096), ReLU, Dropout,
                Linear(4096, classes)                                              (138,357,544 parameters)

The dropouts are identities in eval mode: the exported inference graphs have none. ``vgg_tiny`` has the same
13 convs (8 -> 16 -> 32 channels), 5 max pools, a 2x2 adaptive pool and a 3-layer classifier (128 -> 64 -> 64 ->
classes); its 64x64 input ends at 2x2 after the five pools, so its first dense layer, like VGG-16's, reads a
flattened feature map (C x H x W) rather than a global average.

The adaptive pool exports (ONNX, and qcompile's PT2E frontend) only where it is a fixed pool: the feature map
(input // 32 per side) must be a multiple of the pool's output size (:func:`check_input_hw`); VGG-16 takes 224
(7x7 -> 7x7), 448, 224x448, ...
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

__all__ = ["VGG", "VGG16_CFG", "vgg16", "vgg_tiny", "check_input_hw"]

VGG16_CFG = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M")
TINY_CFG = (8, 8, "M", 16, 16, "M", 32, 32, 32, "M", 32, 32, 32, "M", 32, 32, 32, "M")


def _features(cfg: Sequence, in_ch: int) -> nn.Sequential:
    layers: list = []
    c = in_ch
    for v in cfg:
        if v == "M":
            layers.append(nn.MaxPool2d(kernel_size=2, stride=2))
        else:
            layers += [nn.Conv2d(c, v, kernel_size=3, padding=1), nn.ReLU(inplace=True)]
            c = v
    return nn.Sequential(*layers)


class VGG(nn.Module):
    """torchvision's ``VGG``: ``features``, ``avgpool`` (adaptive, ``pool`` x ``pool``) and a three-layer
    ``classifier`` of width ``hidden``.

    Random weights: Kaiming-normal convs (torchvision's), Kaiming-normal linears (fan in) instead of torchvision's
    N(0, 0.01), and N(0, 0.05) biases instead of zeros: a random model's logits then depend on its input (with
    N(0, 0.01) the biases decide them) and bias quantization does real work."""

    def __init__(self, cfg: Sequence = VGG16_CFG, num_classes: int = 1000, in_ch: int = 3, pool: int = 7,
                 hidden: int = 4096):
        super().__init__()
        self.features = _features(cfg, in_ch)
        self.pool = pool
        self.avgpool = nn.AdaptiveAvgPool2d((pool, pool))
        c = [v for v in cfg if v != "M"][-1]
        self.classifier = nn.Sequential(nn.Linear(c * pool * pool, hidden), nn.ReLU(inplace=True), nn.Dropout(),
                                        nn.Linear(hidden, hidden), nn.ReLU(inplace=True), nn.Dropout(),
                                        nn.Linear(hidden, num_classes))
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.Linear):
                nn.init.kaiming_normal_(m.weight, mode="fan_in", nonlinearity="relu")
            if isinstance(m, (nn.Conv2d, nn.Linear)):
                nn.init.normal_(m.bias, 0, 0.05)

    @property
    def num_pools(self) -> int:
        return sum(isinstance(m, nn.MaxPool2d) for m in self.features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.avgpool(self.features(x))
        return self.classifier(torch.flatten(x, 1))


def vgg16(num_classes: int = 1000, in_ch: int = 3) -> VGG:
    return VGG(VGG16_CFG, num_classes, in_ch)


def vgg_tiny(num_classes: int = 10, in_ch: int = 3) -> VGG:
    """VGG-16's layout at 8 -> 16 -> 32 channels, a 2x2 adaptive pool and a 128 -> 64 -> 64 -> classes classifier
    (64x64 input)."""
    return VGG(TINY_CFG, num_classes, in_ch, pool=2, hidden=64)


def check_input_hw(model: VGG, h: int, w: int) -> str | None:
    """Why ``model`` cannot be exported at input ``h`` x ``w`` (None where it can): the max pools must leave at least
    one pixel per side, and the adaptive pool must be a fixed one (``torch.onnx`` exports no other)."""
    k = 2 ** model.num_pools
    fh, fw = h // k, w // k
    if fh < 1 or fw < 1:
        return f"input {h}x{w} is smaller than the {model.num_pools} max pools' {k}x{k}"
    p = model.pool
    if fh % p or fw % p:
        return (f"input {h}x{w} gives a {fh}x{fw} feature map, not a multiple of the adaptive pool's {p}x{p} output "
                f"(ONNX has no adaptive pool: H // {k} and W // {k} must be multiples of {p})")
    return None
