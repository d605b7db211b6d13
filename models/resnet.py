"""torchvision-shaped ResNets (no torchvision dependency) and the model registry.

Module names and structure follow ``torchvision.models.resnet`` exactly, so a
torchvision ``state_dict`` loads unchanged into :func:`resnet18` / :func:`resnet50`::

    conv1, bn1, relu, maxpool, layer1..layer4, avgpool (AdaptiveAvgPool2d(1)), fc
    BasicBlock:  conv1 bn1 relu conv2 bn2 [downsample = Sequential(conv1x1, bn)]
    Bottleneck:  conv1 bn1 conv2 bn2 conv3 bn3 relu [downsample]   (stride on the 3x3, "v1.5")

``resnet_tiny`` is the same class with a 3x3/stride-1 stem, no max-pool and three
one-block stages (16 -> 32 -> 64 channels); it runs on 8x8 inputs (scikit-learn digits).

ResNeXt is the Bottleneck ResNet with a grouped 3x3 (``groups``, ``width_per_group``, as torchvision's
``ResNet(..., groups=32, width_per_group=4)``): :func:`resnext50_32x4d` loads torchvision's ``state_dict``;
:func:`resnext_tiny` has resnet_tiny's stem and three one-block stages with ``groups=8``.

No pretrained weights exist offline, so :func:`build_model` gives a seeded random
model whose BatchNorm layers carry random, non-trivial running statistics and affine
parameters (:func:`randomize_bn`): BN folding and activation calibration then do real work.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
from torch import nn

__all__ = [
    "BasicBlock", "Bottleneck", "ResNet", "resnet18", "resnet50", "resnet_tiny", "resnext50_32x4d", "resnext_tiny",
    "ModelSpec", "MODELS", "get_spec", "build_model", "randomize_bn",
]


def conv3x3(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)


def conv1x1(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, 1, stride=stride, bias=False)


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, inplanes: int, planes: int, stride: int = 1,
                 downsample: Optional[nn.Module] = None, groups: int = 1, base_width: int = 64):
        super().__init__()
        if groups != 1 or base_width != 64:
            raise ValueError("BasicBlock only supports groups=1 and base_width=64 (as torchvision's)")
        self.conv1 = conv3x3(inplanes, planes, stride)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = conv3x3(planes, planes)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out = out + identity
        return self.relu(out)


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1,
                 downsample: Optional[nn.Module] = None, groups: int = 1, base_width: int = 64):
        super().__init__()
        width = int(planes * (base_width / 64.0)) * groups  # (torchvision's; ResNeXt: a grouped 3x3)
        self.conv1 = conv1x1(inplanes, width)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, groups=groups, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = conv1x1(width, planes * self.expansion)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out = out + identity
        return self.relu(out)


class ResNet(nn.Module):
    """torchvision ResNet, generalised to any number of stages and a configurable stem.

    ``ResNet(block, layers=[2,2,2,2])`` is torchvision's resnet18 layout; the stem
    arguments only exist for :func:`resnet_tiny`. With ``maxpool=False`` the
    attribute ``maxpool`` is ``None`` (absent from the state_dict, which has no
    parameters for it anyway).
    """

    def __init__(self, block: type, layers: Sequence[int], num_classes: int = 1000,
                 in_ch: int = 3, widths: Sequence[int] = (64, 128, 256, 512),
                 stem_kernel: int = 7, stem_stride: int = 2, maxpool: bool = True,
                 groups: int = 1, width_per_group: int = 64):
        super().__init__()
        self.groups, self.base_width = groups, width_per_group
        if len(widths) != len(layers):
            raise ValueError(f"widths {tuple(widths)} and layers {tuple(layers)} differ in length")
        self.block_type = block
        self.inplanes = widths[0]
        self.conv1 = nn.Conv2d(in_ch, self.inplanes, stem_kernel, stride=stem_stride,
                               padding=stem_kernel // 2, bias=False)
        self.bn1 = nn.BatchNorm2d(self.inplanes)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1) if maxpool else None
        self.num_stages = len(layers)
        for i, (w, n) in enumerate(zip(widths, layers)):
            setattr(self, f"layer{i + 1}", self._make_layer(block, w, n, stride=1 if i == 0 else 2))
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(widths[-1] * block.expansion, num_classes)
        for m in self.modules():  # torchvision's init
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)

    def _make_layer(self, block: type, planes: int, blocks: int, stride: int) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes * block.expansion:
            downsample = nn.Sequential(conv1x1(self.inplanes, planes * block.expansion, stride),
                                       nn.BatchNorm2d(planes * block.expansion))
        kw = dict(groups=self.groups, base_width=self.base_width)
        layers = [block(self.inplanes, planes, stride, downsample, **kw)]
        self.inplanes = planes * block.expansion
        layers += [block(self.inplanes, planes, **kw) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def stages(self) -> list[nn.Sequential]:
        return [getattr(self, f"layer{i + 1}") for i in range(self.num_stages)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.bn1(self.conv1(x)))
        if self.maxpool is not None:
            x = self.maxpool(x)
        for stage in self.stages():
            x = stage(x)
        x = self.avgpool(x)
        x = torch.flatten(x, 1)
        return self.fc(x)


def resnet18(num_classes: int = 1000, in_ch: int = 3) -> ResNet:
    return ResNet(BasicBlock, [2, 2, 2, 2], num_classes, in_ch)


def resnet50(num_classes: int = 1000, in_ch: int = 3) -> ResNet:
    return ResNet(Bottleneck, [3, 4, 6, 3], num_classes, in_ch)


def resnet_tiny(num_classes: int = 10, in_ch: int = 3) -> ResNet:
    """3x3/s1 stem (16 ch), BasicBlock stages 16 -> 32 (s2, downsample) -> 64 (s2, downsample).

    No max-pool, so 8x8 inputs end as 2x2 before the global average pool.
    """
    return ResNet(BasicBlock, [1, 1, 1], num_classes, in_ch, widths=(16, 32, 64),
                  stem_kernel=3, stem_stride=1, maxpool=False)


def resnext50_32x4d(num_classes: int = 1000, in_ch: int = 3) -> ResNet:
    """torchvision's ``resnext50_32x4d``: ResNet-50 with 32 groups of 4 channels (x stage) in every 3x3."""
    return ResNet(Bottleneck, [3, 4, 6, 3], num_classes, in_ch, groups=32, width_per_group=4)


def resnext_tiny(num_classes: int = 10, in_ch: int = 3) -> ResNet:
    """resnet_tiny's 3x3/s1 stem (8 ch) and three one-block Bottleneck stages (8 -> 16 -> 32 planes, outputs 32 ->
    64 -> 128) whose 3x3 convs have 8 groups of 4, 8 and 16 channels."""
    return ResNet(Bottleneck, [1, 1, 1], num_classes, in_ch, widths=(8, 16, 32), stem_kernel=3, stem_stride=1,
                  maxpool=False, groups=8, width_per_group=32)


def randomize_bn(model: nn.Module, seed: int = 0) -> nn.Module:
    """Give every BatchNorm random affine parameters and running statistics (deterministic).

    gamma ~ U(0.5, 1.5), beta ~ N(0, 0.1), running_mean ~ N(0, 0.1), running_var ~ U(0.5, 2).
    Kept mild so a deep random network neither explodes nor collapses.
    """
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                c = m.num_features
                m.weight.copy_(torch.rand(c, generator=g) + 0.5)
                m.bias.copy_(torch.randn(c, generator=g) * 0.1)
                m.running_mean.copy_(torch.randn(c, generator=g) * 0.1)
                m.running_var.copy_(torch.rand(c, generator=g) * 1.5 + 0.5)
    return model


@dataclass(frozen=True)
class ModelSpec:
    """Registry entry: ``builder(num_classes=, in_ch=)`` and the default NCHW input shape."""
    name: str
    builder: Callable[..., nn.Module]
    input_shape: tuple[int, int, int, int]
    num_classes: int


MODELS: dict[str, ModelSpec] = {
    "resnet18": ModelSpec("resnet18", resnet18, (1, 3, 224, 224), 1000),
    "resnet50": ModelSpec("resnet50", resnet50, (1, 3, 224, 224), 1000),
    "resnet_tiny": ModelSpec("resnet_tiny", resnet_tiny, (1, 3, 32, 32), 10),
    "resnext50_32x4d": ModelSpec("resnext50_32x4d", resnext50_32x4d, (1, 3, 224, 224), 1000),
    "resnext_tiny": ModelSpec("resnext_tiny", resnext_tiny, (1, 3, 32, 32), 10),
}
# the networks of .mobile: quantized by onnxruntime's quantize_static and exported as ONNX QDQ (export_onnx_ort)
from . import mobile as _mobile  # noqa: E402

ORT_QUANTIZED = ("mobilenet_v2", "mobilenet_v2_tiny", "mobilenet_v3_large", "mobilenet_v3_tiny", "efficientnet_b0",
                 "efficientnet_tiny", "densenet121", "densenet_tiny")
for _name in ORT_QUANTIZED:
    _full = not _name.endswith("_tiny")
    MODELS[_name] = ModelSpec(_name, getattr(_mobile, _name), (1, 3, 224, 224) if _full else (1, 3, 32, 32),
                              1000 if _full else 10)
# VGG (.vgg), quantized the same way; vgg_tiny's 64x64 input ends at 2x2 after its five max pools
from . import vgg as _vgg  # noqa: E402

MODELS["vgg16"] = ModelSpec("vgg16", _vgg.vgg16, (1, 3, 224, 224), 1000)
MODELS["vgg_tiny"] = ModelSpec("vgg_tiny", _vgg.vgg_tiny, (1, 3, 64, 64), 10)
ORT_QUANTIZED += ("vgg16", "vgg_tiny")


def get_spec(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}") from None


def build_model(name: str, num_classes: Optional[int] = None, in_ch: int = 3,
                seed: int = 0) -> nn.Module:
    """Seeded random model in eval mode: ``torch.manual_seed(seed)`` init, then :func:`randomize_bn`."""
    spec = get_spec(name)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = spec.builder(num_classes=num_classes or spec.num_classes, in_ch=in_ch)
    return randomize_bn(model, seed).eval()
