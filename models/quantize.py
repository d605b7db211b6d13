"""Post-training quantization of the torchvision-shaped ResNets in :mod:`.resnet`.

Math (all scales float32, all zero points 0)
--------------------------------------------
* BN folding (before anything else), per output channel c::

      k_c = gamma_c / sqrt(var_c + eps);   w'_c = w_c * k_c;   b'_c = beta_c - mean_c * k_c

* weights, per output channel, symmetric signed, b = w_bits::

      s_w[c] = max|w'_c| / (2^(b-1) - 1)          (s_w[c] = 1 for an all-zero channel)
      q_w    = clamp(round_half_even(w' / s_w), -2^(b-1), 2^(b-1) - 1)

* bias, int32 at the accumulator scale::

      s_b[c] = s_in * s_w[c]   (float32 product);   q_b = clamp(round_half_even(b' / s_b), int32)

* activations, per tensor, zero point 0, b = a_bits::

      unsigned (output of a ReLU):      q in [0, 2^b - 1],            s = m / (2^b - 1)
      signed (everything else):         q in [-2^(b-1), 2^(b-1) - 1], s = m / (2^(b-1) - 1)
      q = clamp(round_half_even(x / s) + zp, qmin, qmax);   x^ = (q - zp) * s

  ``m`` is calibrated on data by running the float network (BN folded) over a
  calibration batch with an observer at every quantization point (the same tensors
  forward hooks on the float model's bn / block / avgpool / fc outputs would see):
  ``minmax`` (max |x|), ``percentile`` (p-th percentile of |x|) or ``mse`` (the clip
  value among 49 in [0.2, 1] * max that minimises the quantization MSE of the
  observed values).  Defaults (:class:`CalibConfig`): minmax for 8-bit tensors, mse
  for 4-bit ones.  Unsigned tensors are where 4-bit accuracy is won: a post-ReLU
  tensor gets 15 positive levels instead of 7.

Quantization points (what onnxruntime's ``quantize_static`` puts Q/DQ on)
-----------------------------------------------------------------------------
``input`` (network input, signed) -> every conv output (after its ReLU when one
follows, unsigned; a block's last conv and its ``downsample.0`` have their own
signed Q/DQ *before* the residual add) -> every block output ``layerI.J``
(add + ReLU, unsigned) -> max-pool output (keeps its input's quantization) ->
``avgpool`` output (unsigned) -> ``fc`` output (signed logits).

Bit configuration
-----------------
A per-point dict ``{name: LayerBits(w_bits, a_bits)}``.  ``a_bits`` is the width of
the tensor the point *produces*; a conv therefore computes at
``(its w_bits) x (a_bits of its input tensor)``.  Names (see :func:`quant_points`):
``input``, every conv / linear module name (``conv1``, ``layer1.0.conv2``,
``layer2.0.downsample.0``, ``fc``), every block (``layer1.0``) and ``avgpool``;
``w_bits`` is ``None`` for the points without weights.  Presets (:func:`bit_config`):

* ``8``: everything 8-bit.
* ``4``: standard "W4A4 except the ends": the network input, the first conv's
  weights and the final fc (its input = the avgpool output, its weights and its
  logits) stay 8-bit; every other conv is W4 and every other activation is 4-bit
  (the stem's output included, so every conv but the stem consumes a 4-bit tensor).
  ``residual_bits=8`` (:func:`bit_config` / :func:`quantize_model`, CLI
  ``--residual-bits 8``) keeps the two tensors that only feed a residual add (a
  block's last conv output and its downsample output) at 8 bits -- HAWQ keeps that
  path in int32; it lowers the logit error (digits: 0.21 -> 0.18 relative) at no
  cost to any conv's int4 input.
* ``"mixed"``: HAWQ-like, deterministic per model: in the middle stages (all but
  the first and last), the 3x3 conv whose input is produced inside the block
  (BasicBlock ``conv2``, Bottleneck ``conv2``) is W4A4 -- its weights are 4-bit and
  the conv feeding it (``conv1``) emits a 4-bit tensor; everything else 8-bit.
* any dict ``{name: (w_bits, a_bits)}`` (or ``{name: bits}``): unspecified points are
  8-bit; unknown names and widths other than 4/8 raise ``ValueError``.
"""
from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Iterator, Mapping, Optional, Union

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .resnet import BasicBlock, Bottleneck, ResNet

__all__ = [
    "VALID_BITS", "LayerBits", "CalibConfig", "ActQuant", "QLayer", "QBlock",
    "QuantizedModel", "quant_points", "bit_config", "fold_bn", "quantize_weight",
    "quantize_model", "fake_quant",
]

VALID_BITS = (4, 8)
INT32_MIN, INT32_MAX = -(2 ** 31), 2 ** 31 - 1


# --------------------------------------------------------------------------- bits
@dataclass(frozen=True)
class LayerBits:
    """Bit widths of one quantization point (``w_bits`` None: no weights)."""
    w_bits: Optional[int]
    a_bits: int


def _check_bits(name: str, what: str, v) -> None:
    if isinstance(v, bool) or v not in VALID_BITS:
        raise ValueError(f"layer {name!r}: unsupported {what} bit width {v!r} "
                         f"(supported: {', '.join(map(str, VALID_BITS))})")


def quant_points(model: ResNet) -> "OrderedDict[str, str]":
    """Ordered ``{point name: kind}``, kind in input/conv/block/avgpool/linear."""
    pts: OrderedDict[str, str] = OrderedDict(input="input", conv1="conv")
    for si, stage in enumerate(model.stages()):
        for bi, blk in enumerate(stage):
            bn = f"layer{si + 1}.{bi}"
            for cname in _block_convs(blk):
                pts[f"{bn}.{cname}"] = "conv"
            if blk.downsample is not None:
                pts[f"{bn}.downsample.0"] = "conv"
            pts[bn] = "block"
    pts["avgpool"] = "avgpool"
    pts["fc"] = "linear"
    return pts


def _block_convs(blk: nn.Module) -> list[str]:
    if isinstance(blk, Bottleneck):
        return ["conv1", "conv2", "conv3"]
    if isinstance(blk, BasicBlock):
        return ["conv1", "conv2"]
    raise TypeError(f"unsupported block type {type(blk).__name__}")


BitsArg = Union[int, str, Mapping[str, Union[int, tuple]]]


def bit_config(model: ResNet, bits: BitsArg = 8, residual_bits: int = 4) -> "OrderedDict[str, LayerBits]":
    """Resolve ``bits`` (8, 4, "8", "4", "mixed", a dict or a path to a JSON dict) to a full per-point config.

    ``residual_bits`` only affects the ``4`` preset (see the module docstring)."""
    pts = quant_points(model)
    if isinstance(bits, str) and bits.endswith(".json"):
        path = bits
        try:
            with open(path) as f:
                bits = json.load(f)
        except (OSError, ValueError) as e:
            raise ValueError(f"bit config '{path}': cannot read it as JSON ({e})") from None
        if not isinstance(bits, Mapping):
            raise ValueError(f"bit config '{path}': expected a JSON object {{layer_name: [w_bits, a_bits]}}, "
                             f"got a {type(bits).__name__}")
    if isinstance(bits, str) and bits.strip().lstrip("-").isdigit():
        bits = int(bits)
    _check_bits("<residual>", "activation", residual_bits)

    def full(wb: int, ab: int) -> OrderedDict:
        return OrderedDict((n, LayerBits(wb if k in ("conv", "linear") else None, ab)) for n, k in pts.items())

    if isinstance(bits, Mapping):
        cfg = full(8, 8)
        for name, v in bits.items():
            if name not in pts:
                raise ValueError(f"unknown layer {name!r} in bit config; valid names: "
                                 f"{', '.join(pts)}")
            if isinstance(v, (tuple, list)) and len(v) != 2:
                raise ValueError(f"layer {name!r} in bit config: expected [w_bits, a_bits] or one width, got {v!r}")
            wb, ab = (v, v) if not isinstance(v, (tuple, list)) else tuple(v)
            if pts[name] in ("conv", "linear"):
                _check_bits(name, "weight", wb)
            elif wb is not None:
                _check_bits(name, "weight", wb)  # validated, then ignored: no weights here
            _check_bits(name, "activation", ab)
            cfg[name] = LayerBits(wb if pts[name] in ("conv", "linear") else None, ab)
        return cfg
    if bits == "mixed":
        cfg = full(8, 8)
        nst = model.num_stages
        for si, stage in enumerate(model.stages()):
            if si == 0 or si == nst - 1:
                continue
            for bi, _ in enumerate(stage):
                bn = f"layer{si + 1}.{bi}"
                cfg[f"{bn}.conv1"] = LayerBits(8, 4)   # feeds the 3x3 conv2 a 4-bit tensor
                cfg[f"{bn}.conv2"] = LayerBits(4, 8)   # W4 (x A4 input)
        return cfg
    if isinstance(bits, int) and not isinstance(bits, bool):
        _check_bits("<all layers>", "uniform", bits)
        if bits == 8:
            return full(8, 8)
        cfg = full(4, 4)
        cfg["input"] = LayerBits(None, 8)
        cfg["conv1"] = LayerBits(8, 4)
        cfg["avgpool"] = LayerBits(None, 8)
        cfg["fc"] = LayerBits(8, 8)
        for name, kind in pts.items():
            if kind == "block":
                last = _block_convs(_get(model, name))[-1]
                cfg[f"{name}.{last}"] = LayerBits(4, residual_bits)
                if f"{name}.downsample.0" in cfg:
                    cfg[f"{name}.downsample.0"] = LayerBits(4, residual_bits)
        return cfg
    raise ValueError(f"unsupported bits {bits!r}: use 8, 4, 'mixed' or a dict "
                     "{layer_name: (w_bits, a_bits)}")


def _get(model: nn.Module, name: str) -> nn.Module:
    m = model
    for p in name.split("."):
        m = getattr(m, p)
    return m


# --------------------------------------------------------------------------- primitives
def fake_quant(x: torch.Tensor, scale: float, zero_point: int, qmin: int, qmax: int) -> torch.Tensor:
    """``x^ = (clamp(round_half_even(x / s) + zp, qmin, qmax) - zp) * s`` (float32)."""
    s = torch.tensor(scale, dtype=torch.float32)
    q = torch.clamp(torch.round(x / s) + zero_point, qmin, qmax)
    return (q - zero_point) * s


@dataclass
class ActQuant:
    """Per-tensor activation quantization of the tensor ``name`` (zero point 0)."""
    name: str
    scale: float
    bits: int
    signed: bool
    zero_point: int = 0

    @property
    def qmin(self) -> int:
        return -(2 ** (self.bits - 1)) if self.signed else 0

    @property
    def qmax(self) -> int:
        return 2 ** (self.bits - 1) - 1 if self.signed else 2 ** self.bits - 1

    @property
    def dtype(self) -> str:
        """``int8``/``uint8``/``int4``/``uint4``: the storage type of the quantized tensor."""
        return f"{'' if self.signed else 'u'}int{self.bits}"

    def fq(self, x: torch.Tensor) -> torch.Tensor:
        return fake_quant(x, self.scale, self.zero_point, self.qmin, self.qmax)

    def quantize(self, x: np.ndarray) -> np.ndarray:
        """Integer values (int32 array) of ``x``: ``clamp(round(x / s) + zp, qmin, qmax)``."""
        s = np.float32(self.scale)
        return np.clip(np.round(np.asarray(x, np.float32) / s) + self.zero_point,
                       self.qmin, self.qmax).astype(np.int32)


@dataclass
class QLayer:
    """One quantized conv (OIHW) or linear (OI) layer, BN folded, optional fused ReLU."""
    name: str
    kind: str                      # "conv" | "linear"
    weight: np.ndarray             # int8 (values in the w_bits range)
    weight_scale: np.ndarray       # float32 [O]
    bias: np.ndarray               # int32 [O], scale = bias_scale
    w_bits: int
    input: ActQuant
    output: ActQuant
    relu: bool = False
    stride: int = 1
    padding: int = 0
    groups: int = 1                # grouped conv (ResNeXt): weight (O, I / groups, kh, kw)
    float_weight: Optional[np.ndarray] = field(default=None, repr=False)  # BN-folded fp32
    float_bias: Optional[np.ndarray] = field(default=None, repr=False)

    @property
    def bias_scale(self) -> np.ndarray:
        """``s_in * s_w[c]`` in float32 (the scale of the int32 bias and of the accumulator)."""
        return (np.float32(self.input.scale) * self.weight_scale).astype(np.float32)

    def dq_weight(self) -> torch.Tensor:
        s = torch.from_numpy(self.weight_scale).reshape(-1, *([1] * (self.weight.ndim - 1)))
        return torch.from_numpy(self.weight.astype(np.float32)) * s

    def dq_bias(self) -> torch.Tensor:
        return torch.from_numpy(self.bias.astype(np.float32)) * torch.from_numpy(self.bias_scale)


@dataclass
class QBlock:
    """A residual block: ``output = fq(relu(convs(x) + (downsample(x) or x)))``."""
    name: str
    convs: list[QLayer]
    downsample: Optional[QLayer]
    input: ActQuant
    output: ActQuant


@dataclass(frozen=True)
class CalibConfig:
    """How activation ranges ``m`` are chosen (see module docstring).

    ``method8`` / ``method4``: "minmax" | "percentile" | "mse" for 8-bit / 4-bit tensors.
    ``max_samples``: values kept per tensor (seeded random subsample) for percentile / mse.
    """
    method8: str = "minmax"
    method4: str = "mse"
    percentile: float = 99.99
    max_samples: int = 1 << 18
    seed: int = 0

    def __post_init__(self):
        for m in (self.method8, self.method4):
            if m not in ("minmax", "percentile", "mse"):
                raise ValueError(f"unknown calibration method {m!r} (minmax, percentile, mse)")


def fold_bn(conv: nn.Conv2d, bn: Optional[nn.BatchNorm2d]) -> tuple[np.ndarray, np.ndarray]:
    """``w' = w * k``, ``b' = beta + (b - mean) * k``, ``k = gamma / sqrt(var + eps)`` (fp64 math, fp32 out)."""
    w = conv.weight.detach().double()
    b = conv.bias.detach().double() if conv.bias is not None else torch.zeros(w.shape[0], dtype=torch.float64)
    if bn is not None:
        k = bn.weight.detach().double() / torch.sqrt(bn.running_var.detach().double() + bn.eps)
        w = w * k.reshape(-1, 1, 1, 1)
        b = bn.bias.detach().double() + (b - bn.running_mean.detach().double()) * k
    return w.float().numpy(), b.float().numpy()


def quantize_weight(w: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-output-channel symmetric: ``s = max|w_c| / (2^(b-1)-1)``, ``q = clamp(round(w/s), -2^(b-1), 2^(b-1)-1)``."""
    qmax = 2 ** (bits - 1) - 1
    wt = torch.from_numpy(np.ascontiguousarray(w, np.float32))
    amax = wt.abs().reshape(wt.shape[0], -1).amax(dim=1)
    s = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))
    q = torch.clamp(torch.round(wt / s.reshape(-1, *([1] * (wt.ndim - 1)))), -qmax - 1, qmax)
    return q.to(torch.int8).numpy(), s.numpy().astype(np.float32)


def quantize_bias(b: np.ndarray, bias_scale: np.ndarray) -> np.ndarray:
    q = np.round(b.astype(np.float32) / bias_scale)  # float32 division, round half even
    return np.clip(q, INT32_MIN, INT32_MAX).astype(np.int32)


# --------------------------------------------------------------------------- calibration
class _Observer:
    """Keeps the exact max of |x| and a seeded subsample of |x| for one tensor."""

    def __init__(self, cfg: CalibConfig, gen: torch.Generator):
        self.cfg, self.gen = cfg, gen
        self.amax = 0.0
        self.samples: list[torch.Tensor] = []
        self.n = 0

    def __call__(self, x: torch.Tensor) -> None:
        a = x.detach().abs().reshape(-1).float()
        self.amax = max(self.amax, float(a.max()) if a.numel() else 0.0)
        k = min(a.numel(), self.cfg.max_samples)
        if k < a.numel():
            a = a[torch.randint(a.numel(), (k,), generator=self.gen)]
        self.samples.append(a)
        self.n += k
        while self.n > 2 * self.cfg.max_samples:  # bound memory over many batches
            allv = torch.cat(self.samples)
            allv = allv[torch.randint(allv.numel(), (self.cfg.max_samples,), generator=self.gen)]
            self.samples, self.n = [allv], allv.numel()

    def range(self, bits: int, signed: bool) -> float:
        method = self.cfg.method8 if bits == 8 else self.cfg.method4
        if method == "minmax" or self.amax == 0.0:
            return self.amax
        v = torch.cat(self.samples)
        if v.numel() > (1 << 24) - 1:
            v = v[: (1 << 24) - 1]
        if method == "percentile":
            return min(self.amax, float(torch.quantile(v, self.cfg.percentile / 100.0)))
        qmax = 2 ** (bits - 1) - 1 if signed else 2 ** bits - 1
        # mse: signed values were folded to |x|; the grid is symmetric so the error is the same.
        # The search runs on <= 2^15 of the kept samples (plus the exact max), 49 clip ratios at once.
        if v.numel() > (1 << 15):
            v = v[torch.randint(v.numel(), (1 << 15,), generator=self.gen)]
        v = torch.cat([v, torch.tensor([self.amax])])
        ms = self.amax * torch.linspace(0.2, 1.0, 49)
        s = (ms / qmax)[:, None]
        err = ((torch.clamp(torch.round(v[None] / s), 0, qmax) * s - v[None]) ** 2).mean(dim=1)
        return float(ms[int(torch.argmin(err))])


def _scale(m: float, bits: int, signed: bool) -> float:
    qmax = 2 ** (bits - 1) - 1 if signed else 2 ** bits - 1
    return float(np.float32(m / qmax)) if m > 0 else 1.0


# --------------------------------------------------------------------------- the model
class QuantizedModel(nn.Module):
    """The quantized network; ``forward`` is the fake-quant PyTorch reference.

    ``forward(x)`` computes, in float32, exactly the QDQ network that
    :mod:`.export_onnx` writes: every quantization point applies
    ``(clamp(round_half_even(x / s) + zp, qmin, qmax) - zp) * s``, convs use the
    dequantized weights ``q_w * s_w`` and biases ``q_b * s_in * s_w``.
    ``forward(x, quantize=False)`` runs the BN-folded float network instead.

    Structure (for exporters): ``input_act``, ``stem`` (QLayer, ReLU fused),
    ``maxpool`` (None or dict kernel/stride/padding, keeps the stem's
    quantization), ``blocks`` (list of :class:`QBlock`), ``avgpool_act``, ``fc``.
    ``layers`` / ``acts`` are flat ordered views.
    """

    def __init__(self, arch: str, bits: "OrderedDict[str, LayerBits]", input_act: ActQuant,
                 stem: QLayer, maxpool: Optional[dict], blocks: list[QBlock],
                 avgpool_act: ActQuant, fc: QLayer, block_type: str):
        super().__init__()
        self.arch, self.bits, self.block_type = arch, bits, block_type
        self.input_act, self.stem, self.maxpool = input_act, stem, maxpool
        self.blocks, self.avgpool_act, self.fc = blocks, avgpool_act, fc
        self._cache: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    # flat views ---------------------------------------------------------------
    @property
    def layers(self) -> "OrderedDict[str, QLayer]":
        out = OrderedDict([(self.stem.name, self.stem)])
        for b in self.blocks:
            for c in b.convs:
                out[c.name] = c
            if b.downsample is not None:
                out[b.downsample.name] = b.downsample
        out[self.fc.name] = self.fc
        return out

    @property
    def acts(self) -> "OrderedDict[str, ActQuant]":
        out = OrderedDict(input=self.input_act)
        for name, l in self.layers.items():
            if l is self.fc:
                continue
            out[name] = l.output
        for b in self.blocks:
            out[b.name] = b.output
        out["avgpool"] = self.avgpool_act
        out["fc"] = self.fc.output
        return out

    @property
    def min_bits(self) -> int:
        return min(min(a.bits for a in self.acts.values()), min(l.w_bits for l in self.layers.values()))

    # forward -------------------------------------------------------------------
    def _params(self, l: QLayer, quantize: bool) -> tuple[torch.Tensor, torch.Tensor]:
        key = f"{l.name}:{int(quantize)}"
        if key not in self._cache:
            if quantize:
                self._cache[key] = (l.dq_weight(), l.dq_bias())
            else:
                self._cache[key] = (torch.from_numpy(l.float_weight), torch.from_numpy(l.float_bias))
        return self._cache[key]

    def _layer(self, l: QLayer, x: torch.Tensor, quantize: bool, obs: Optional[Callable]) -> torch.Tensor:
        w, b = self._params(l, quantize)
        y = F.conv2d(x, w, b, l.stride, l.padding, 1, l.groups) if l.kind == "conv" else F.linear(x, w, b)
        if l.relu:
            y = torch.relu(y)
        return self._act(l.output, y, quantize, obs)

    @staticmethod
    def _act(a: ActQuant, x: torch.Tensor, quantize: bool, obs: Optional[Callable]) -> torch.Tensor:
        if obs is not None:
            obs(a.name, x)
        return a.fq(x) if quantize else x

    def forward(self, x: torch.Tensor, quantize: bool = True,
                observe: Optional[Callable[[str, torch.Tensor], None]] = None) -> torch.Tensor:
        x = self._act(self.input_act, x.float(), quantize, observe)
        x = self._layer(self.stem, x, quantize, observe)
        if self.maxpool is not None:
            x = F.max_pool2d(x, self.maxpool["kernel"], self.maxpool["stride"], self.maxpool["padding"])
        for b in self.blocks:
            identity = x
            out = x
            for c in b.convs:
                out = self._layer(c, out, quantize, observe)
            if b.downsample is not None:
                identity = self._layer(b.downsample, x, quantize, observe)
            x = self._act(b.output, torch.relu(out + identity), quantize, observe)
        x = torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)
        x = self._act(self.avgpool_act, x, quantize, observe)
        return self._layer(self.fc, x, quantize, observe)

    def float_forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward(x, quantize=False)


# --------------------------------------------------------------------------- driver
def _iter_batches(data: torch.Tensor, batch: int) -> Iterator[torch.Tensor]:
    for i in range(0, data.shape[0], batch):
        yield data[i:i + batch]


def quantize_model(model: ResNet, calib_data: Union[torch.Tensor, np.ndarray], bits: BitsArg = 8,
                   calib: CalibConfig = CalibConfig(), arch: str = "resnet",
                   batch_size: int = 64, residual_bits: int = 4) -> QuantizedModel:
    """Fold BN, calibrate activations on ``calib_data`` (NCHW float), quantize weights/biases.

    Deterministic: no randomness besides the seeded subsampling of ``calib.seed``.
    """
    model = model.eval()
    cfg = bit_config(model, bits, residual_bits=residual_bits)
    data = torch.as_tensor(np.asarray(calib_data, dtype=np.float32))

    def act(name: str, signed: bool) -> ActQuant:
        return ActQuant(name, 1.0, cfg[name].a_bits, signed)

    def layer(name: str, conv: nn.Module, bn: Optional[nn.Module], inp: ActQuant, relu: bool) -> QLayer:
        if isinstance(conv, nn.Linear):
            w, b = conv.weight.detach().float().numpy(), conv.bias.detach().float().numpy()
            kind, stride, pad = "linear", 1, 0
        else:
            w, b = fold_bn(conv, bn)
            kind, stride, pad = "conv", conv.stride[0], conv.padding[0]
        return QLayer(name, kind, np.zeros(w.shape, np.int8), np.ones(w.shape[0], np.float32),
                      np.zeros(w.shape[0], np.int32), cfg[name].w_bits, inp,
                      act(name, signed=not relu), relu, stride, pad, getattr(conv, "groups", 1), w, b)

    # build the structure (scales filled in after calibration)
    input_act = act("input", signed=True)
    stem = layer("conv1", model.conv1, model.bn1, input_act, relu=True)
    mp = model.maxpool
    maxpool = None if mp is None else dict(kernel=_i(mp.kernel_size), stride=_i(mp.stride), padding=_i(mp.padding))
    blocks: list[QBlock] = []
    prev = stem.output
    for si, stage in enumerate(model.stages()):
        for bi, blk in enumerate(stage):
            bn = f"layer{si + 1}.{bi}"
            names = _block_convs(blk)
            convs, inp = [], prev
            for k, cname in enumerate(names):
                last = k == len(names) - 1
                l = layer(f"{bn}.{cname}", getattr(blk, cname), getattr(blk, f"bn{k + 1}"), inp, relu=not last)
                convs.append(l)
                inp = l.output
            ds = None
            if blk.downsample is not None:
                ds = layer(f"{bn}.downsample.0", blk.downsample[0], blk.downsample[1], prev, relu=False)
            out = act(bn, signed=False)
            blocks.append(QBlock(bn, convs, ds, prev, out))
            prev = out
    avg = act("avgpool", signed=False)
    fc = layer("fc", model.fc, None, avg, relu=False)
    qm = QuantizedModel(arch, cfg, input_act, stem, maxpool, blocks, avg, fc,
                        "bottleneck" if isinstance(model.layer1[0], Bottleneck) else "basic")

    # calibrate on the BN-folded float network
    gen = torch.Generator().manual_seed(calib.seed)
    observers: dict[str, _Observer] = {}

    def observe(name: str, x: torch.Tensor) -> None:
        observers.setdefault(name, _Observer(calib, gen))(x)

    with torch.no_grad():
        for xb in _iter_batches(data, batch_size):
            qm(xb, quantize=False, observe=observe)
    for name, a in qm.acts.items():
        a.scale = _scale(observers[name].range(a.bits, a.signed), a.bits, a.signed)

    # weights and biases (need the calibrated input scales)
    for l in qm.layers.values():
        l.weight, l.weight_scale = quantize_weight(l.float_weight, l.w_bits)
        l.bias = quantize_bias(l.float_bias, l.bias_scale)
    qm._cache.clear()
    return qm


def _i(v) -> int:
    return int(v[0]) if isinstance(v, (tuple, list)) else int(v)
