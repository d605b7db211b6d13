"""torchvision-shaped CNNs beyond ResNet (no torchvision dependency): MobileNetV2, MobileNetV3-Large, EfficientNet-B0,
DenseNet-121, and a tiny variant of each for tests.

Module names and structure follow torchvision's (``features`` / ``classifier``; ``Conv2dNormActivation`` as a
``Sequential`` of conv, BN, activation; ``block`` in the inverted residuals; ``SqueezeExcitation`` with ``fc1`` /
``fc2``; DenseNet's ``denseblockN.denselayerM`` with ``norm1 relu1 conv1 norm2 relu2 conv2`` and ``transitionN``), so
a torchvision ``state_dict`` loads unchanged into the full-size models:

* ``mobilenet_v2``: inverted residuals (1x1 expand, depthwise 3x3, linear 1x1 projection), ReLU6, 3,504,872 parameters;
* ``mobilenet_v3_large``: inverted residuals with hardswish / ReLU, squeeze-and-excitation (hardsigmoid gate, a
  product of two tensors), a hardswish classifier, 5,483,032 parameters;
* ``efficientnet_b0``: MBConv blocks with SiLU (``x * sigmoid(x)``) and SE (sigmoid gate), 5,288,548 parameters;
* ``densenet121``: dense blocks (concat of every earlier layer's output, pre-activation BN -> ReLU -> conv),
  transitions with a 2x2 / stride 2 average pool, 7,978,856 parameters.

Stochastic depth and dropout are identities in eval mode, as the exported inference graphs have them.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn

__all__ = ["MobileNetV2", "MobileNetV3", "EfficientNet", "DenseNet", "mobilenet_v2", "mobilenet_v2_tiny",
           "mobilenet_v3_large", "mobilenet_v3_tiny", "efficientnet_b0", "efficientnet_tiny", "densenet121",
           "densenet_tiny"]


def _make_divisible(v: float, divisor: int = 8) -> int:
    new_v = max(divisor, int(v + divisor / 2) // divisor * divisor)
    return new_v + divisor if new_v < 0.9 * v else new_v


class ConvBNAct(nn.Sequential):
    """torchvision's ``Conv2dNormActivation``: conv (no bias), BN, activation (or none)."""

    def __init__(self, cin, cout, k=3, stride=1, groups=1, act: Optional[type] = nn.ReLU6, eps=1e-5):
        layers = [nn.Conv2d(cin, cout, k, stride, (k - 1) // 2, groups=groups, bias=False),
                  nn.BatchNorm2d(cout, eps=eps)]
        if act is not None:
            layers.append(act(inplace=True))
        super().__init__(*layers)


class SqueezeExcitation(nn.Module):
    """``x * gate(fc2(act(fc1(avgpool(x)))))`` (torchvision.ops.SqueezeExcitation)."""

    def __init__(self, cin, squeeze, act=nn.ReLU, gate=nn.Sigmoid):
        super().__init__()
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc1, self.fc2 = nn.Conv2d(cin, squeeze, 1), nn.Conv2d(squeeze, cin, 1)
        self.activation, self.scale_activation = act(), gate()

    def forward(self, x):
        return x * self.scale_activation(self.fc2(self.activation(self.fc1(self.avgpool(x)))))


# ---------------------------------------------------------------------------------------------- MobileNetV2
class InvertedResidualV2(nn.Module):
    def __init__(self, cin, cout, stride, t):
        super().__init__()
        hidden = int(round(cin * t))
        self.use_res_connect = stride == 1 and cin == cout
        layers = [] if t == 1 else [ConvBNAct(cin, hidden, 1)]
        layers += [ConvBNAct(hidden, hidden, 3, stride, groups=hidden), nn.Conv2d(hidden, cout, 1, bias=False),
                   nn.BatchNorm2d(cout)]
        self.conv = nn.Sequential(*layers)

    def forward(self, x):
        return x + self.conv(x) if self.use_res_connect else self.conv(x)


V2_SETTINGS = [[1, 16, 1, 1], [6, 24, 2, 2], [6, 32, 3, 2], [6, 64, 4, 2], [6, 96, 3, 1], [6, 160, 3, 2],
               [6, 320, 1, 1]]


class MobileNetV2(nn.Module):
    def __init__(self, num_classes=1000, in_ch=3, settings=V2_SETTINGS, stem=32, last=1280, stem_stride=2):
        super().__init__()
        layers: list = [ConvBNAct(in_ch, stem, 3, stem_stride)]
        cin = stem
        for t, c, n, s in settings:
            for i in range(n):
                layers.append(InvertedResidualV2(cin, c, s if i == 0 else 1, t))
                cin = c
        layers.append(ConvBNAct(cin, last, 1))
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(nn.Dropout(0.2), nn.Linear(last, num_classes))

    def forward(self, x):
        x = nn.functional.adaptive_avg_pool2d(self.features(x), (1, 1))
        return self.classifier(torch.flatten(x, 1))


def mobilenet_v2(num_classes: int = 1000, in_ch: int = 3) -> MobileNetV2:
    return MobileNetV2(num_classes, in_ch)


def mobilenet_v2_tiny(num_classes: int = 10, in_ch: int = 3, stem_stride: int = 2) -> MobileNetV2:
    """Stem 16, inverted residuals (t=1, 8), (t=6, 16, s2, twice: a residual), (t=6, 24, s2), head 1x1 (64).
    ``stem_stride=1``: the digits variant (8x8 input ends at 2x2, as resnet_tiny's)."""
    return MobileNetV2(num_classes, in_ch, [[1, 8, 1, 1], [6, 16, 2, 2], [6, 24, 1, 2]], stem=16, last=64,
                       stem_stride=stem_stride)


# ---------------------------------------------------------------------------------------------- MobileNetV3
class InvertedResidualV3(nn.Module):
    def __init__(self, cin, k, exp, cout, se, act, stride):
        super().__init__()
        self.use_res_connect = stride == 1 and cin == cout
        a = nn.Hardswish if act == "HS" else nn.ReLU
        layers: list = []
        if exp != cin:
            layers.append(ConvBNAct(cin, exp, 1, act=a, eps=0.001))
        layers.append(ConvBNAct(exp, exp, k, stride, groups=exp, act=a, eps=0.001))
        if se:
            layers.append(SqueezeExcitation(exp, _make_divisible(exp // 4, 8), nn.ReLU, nn.Hardsigmoid))
        layers.append(ConvBNAct(exp, cout, 1, act=None, eps=0.001))
        self.block = nn.Sequential(*layers)

    def forward(self, x):
        y = self.block(x)
        return x + y if self.use_res_connect else y


V3_LARGE = [(16, 3, 16, 16, False, "RE", 1), (16, 3, 64, 24, False, "RE", 2), (24, 3, 72, 24, False, "RE", 1),
            (24, 5, 72, 40, True, "RE", 2), (40, 5, 120, 40, True, "RE", 1), (40, 5, 120, 40, True, "RE", 1),
            (40, 3, 240, 80, False, "HS", 2), (80, 3, 200, 80, False, "HS", 1), (80, 3, 184, 80, False, "HS", 1),
            (80, 3, 184, 80, False, "HS", 1), (80, 3, 480, 112, True, "HS", 1), (112, 3, 672, 112, True, "HS", 1),
            (112, 5, 672, 160, True, "HS", 2), (160, 5, 960, 160, True, "HS", 1), (160, 5, 960, 160, True, "HS", 1)]


class MobileNetV3(nn.Module):
    def __init__(self, num_classes=1000, in_ch=3, settings=V3_LARGE, last=1280):
        super().__init__()
        layers: list = [ConvBNAct(in_ch, settings[0][0], 3, 2, act=nn.Hardswish, eps=0.001)]
        layers += [InvertedResidualV3(*s) for s in settings]
        c = settings[-1][3]
        layers.append(ConvBNAct(c, 6 * c, 1, act=nn.Hardswish, eps=0.001))
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(nn.Linear(6 * c, last), nn.Hardswish(inplace=True), nn.Dropout(0.2),
                                        nn.Linear(last, num_classes))

    def forward(self, x):
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


def mobilenet_v3_large(num_classes: int = 1000, in_ch: int = 3) -> MobileNetV3:
    return MobileNetV3(num_classes, in_ch)


def mobilenet_v3_tiny(num_classes: int = 10, in_ch: int = 3) -> MobileNetV3:
    """Four bottlenecks of MobileNetV3-Large's kinds: ReLU, ReLU + SE (5x5, s2), hardswish, hardswish + SE
    (residual); head 1x1 (6 x 16) and a hardswish classifier (64)."""
    return MobileNetV3(num_classes, in_ch, [(8, 3, 8, 8, False, "RE", 1), (8, 5, 24, 16, True, "RE", 2),
                                            (16, 3, 48, 16, False, "HS", 1), (16, 3, 48, 16, True, "HS", 1)], last=64)


# ---------------------------------------------------------------------------------------------- EfficientNet
class MBConv(nn.Module):
    def __init__(self, cin, cout, k, stride, ratio):
        super().__init__()
        self.use_res_connect = stride == 1 and cin == cout
        exp = _make_divisible(cin * ratio, 8)
        layers: list = []
        if exp != cin:
            layers.append(ConvBNAct(cin, exp, 1, act=nn.SiLU))
        layers.append(ConvBNAct(exp, exp, k, stride, groups=exp, act=nn.SiLU))
        layers.append(SqueezeExcitation(exp, max(1, cin // 4), nn.SiLU, nn.Sigmoid))
        layers.append(ConvBNAct(exp, cout, 1, act=None))
        self.block = nn.Sequential(*layers)

    def forward(self, x):
        y = self.block(x)
        return x + y if self.use_res_connect else y


B0_STAGES = [(1, 3, 1, 32, 16, 1), (6, 3, 2, 16, 24, 2), (6, 5, 2, 24, 40, 2), (6, 3, 2, 40, 80, 3),
             (6, 5, 1, 80, 112, 3), (6, 5, 2, 112, 192, 4), (6, 3, 1, 192, 320, 1)]


class EfficientNet(nn.Module):
    def __init__(self, num_classes=1000, in_ch=3, stages=B0_STAGES, last=1280):
        super().__init__()
        layers: list = [ConvBNAct(in_ch, stages[0][3], 3, 2, act=nn.SiLU)]
        for ratio, k, stride, cin, cout, n in stages:
            layers.append(nn.Sequential(*[MBConv(cin if i == 0 else cout, cout, k, stride if i == 0 else 1, ratio)
                                          for i in range(n)]))
        layers.append(ConvBNAct(stages[-1][4], last, 1, act=nn.SiLU))
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(nn.Dropout(0.2, inplace=True), nn.Linear(last, num_classes))

    def forward(self, x):
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


def efficientnet_b0(num_classes: int = 1000, in_ch: int = 3) -> EfficientNet:
    return EfficientNet(num_classes, in_ch)


def efficientnet_tiny(num_classes: int = 10, in_ch: int = 3) -> EfficientNet:
    """Stem 16, MBConv stages (1, 3x3, 16 -> 8), (6, 5x5, s2, 8 -> 16, twice: a residual), head 1x1 (64)."""
    return EfficientNet(num_classes, in_ch, [(1, 3, 1, 16, 8, 1), (6, 5, 2, 8, 16, 2)], last=64)


# ---------------------------------------------------------------------------------------------- DenseNet
class _DenseLayer(nn.Module):
    def __init__(self, cin, growth, bn_size):
        super().__init__()
        self.norm1, self.relu1 = nn.BatchNorm2d(cin), nn.ReLU(inplace=True)
        self.conv1 = nn.Conv2d(cin, bn_size * growth, 1, bias=False)
        self.norm2, self.relu2 = nn.BatchNorm2d(bn_size * growth), nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(bn_size * growth, growth, 3, padding=1, bias=False)

    def forward(self, inputs: Sequence[torch.Tensor]):
        x = torch.cat(list(inputs), 1)
        return self.conv2(self.relu2(self.norm2(self.conv1(self.relu1(self.norm1(x))))))


class _DenseBlock(nn.ModuleDict):
    def __init__(self, n, cin, growth, bn_size):
        super().__init__()
        for i in range(n):
            self.add_module(f"denselayer{i + 1}", _DenseLayer(cin + i * growth, growth, bn_size))

    def forward(self, x):
        feats = [x]
        for layer in self.values():
            feats.append(layer(feats))
        return torch.cat(feats, 1)


class _Transition(nn.Sequential):
    def __init__(self, cin, cout):
        super().__init__()
        self.norm, self.relu = nn.BatchNorm2d(cin), nn.ReLU(inplace=True)
        self.conv = nn.Conv2d(cin, cout, 1, bias=False)
        self.pool = nn.AvgPool2d(2, 2)


class DenseNet(nn.Module):
    def __init__(self, num_classes=1000, in_ch=3, growth=32, blocks=(6, 12, 24, 16), init=64, bn_size=4,
                 stem_kernel=7, stem_pool=True):
        super().__init__()
        feats: list = [("conv0", nn.Conv2d(in_ch, init, stem_kernel, 2 if stem_pool else 1, stem_kernel // 2,
                                           bias=False)),
                       ("norm0", nn.BatchNorm2d(init)), ("relu0", nn.ReLU(inplace=True))]
        if stem_pool:
            feats.append(("pool0", nn.MaxPool2d(3, 2, 1)))
        c = init
        for i, n in enumerate(blocks):
            feats.append((f"denseblock{i + 1}", _DenseBlock(n, c, growth, bn_size)))
            c += n * growth
            if i != len(blocks) - 1:
                feats.append((f"transition{i + 1}", _Transition(c, c // 2)))
                c //= 2
        feats.append(("norm5", nn.BatchNorm2d(c)))
        from collections import OrderedDict

        self.features = nn.Sequential(OrderedDict(feats))
        self.classifier = nn.Linear(c, num_classes)

    def forward(self, x):
        x = nn.functional.relu(self.features(x))
        return self.classifier(torch.flatten(nn.functional.adaptive_avg_pool2d(x, (1, 1)), 1))


def densenet121(num_classes: int = 1000, in_ch: int = 3) -> DenseNet:
    return DenseNet(num_classes, in_ch)


def densenet_tiny(num_classes: int = 10, in_ch: int = 3) -> DenseNet:
    """A 3x3 stem (16) without max pool, dense blocks of 2 and 2 layers (growth 8, bottleneck 16) and one transition."""
    return DenseNet(num_classes, in_ch, growth=8, blocks=(2, 2), init=16, bn_size=2, stem_kernel=3, stem_pool=False)
