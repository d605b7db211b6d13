"""HAWQ-V3 frontend: an integer checkpoint (five dicts) plus the network it belongs to (``--net``).

The checkpoint holds ``weight_integer``, ``bias_integer``, ``act_scaling_factor``,
``convbn_scaling_factor`` and ``fc_scaling_factor`` keyed by HAWQ's ``q_resnet`` names
(``quant_init_block_convbn``, ``stageS.unitU.quant_convbnK``, ``quant_output`` ...). It does not
record the topology: ``NETS`` describes the torchvision-shaped ResNets that ``--net`` names (block
type, blocks and widths per stage, stem), and the frontend walks that description. Key scheme,
scales and integer math: ``models/HAWQ_FORMAT.md``. Real values are ``x = q * s`` (zero points 0);
ReLU outputs are unsigned.

Packed INT4 weights (``uint8`` ``weight_integer`` of a 4-bit layer) are in HAWQ's order, FIRST
element in the TOP nibble (``qcompile.int4``, ``first="high"``); they are converted here to plain
values (and repacked later by ``PackInt4`` in qcompile's low-nibble-first order).

Where the qcompile extensions ``qc_act_residual`` / ``qc_act_identity`` / ``qc_act_logits`` are
absent (a checkpoint written by HAWQ itself), those tensors stay at their accumulator scale: the
residual add and the logits are computed from the int32 accumulators.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from .. import int4
from ..checks import torch_load_weights_only
from ..errors import QCompileError
from ..qdq import QDQBuilder, check_scale, qtype

HAWQ_KEYS = ("weight_integer", "bias_integer", "act_scaling_factor", "convbn_scaling_factor", "fc_scaling_factor")


@dataclass(frozen=True)
class ResNetArch:
    """A torchvision-shaped ResNet's topology (what a HAWQ checkpoint leaves out).

    Stage ``i`` has ``blocks[i]`` blocks of ``widths[i]`` planes; the first block of every stage but the first has
    stride 2, and a block whose stride is 2 or whose input width differs from its output width has a 1x1 downsample
    convolution (with that stride) on its identity path. A basic block is two 3x3 convolutions (the stride on the
    first); a bottleneck block is 1x1, 3x3 (the stride), 1x1 to ``4 x planes`` channels ("v1.5"). The stem is one
    ``stem_kernel`` x ``stem_kernel`` convolution (``stem_stride``, padding ``stem_kernel // 2``), then a 3x3/s2 max
    pool where ``maxpool``."""
    bottleneck: bool
    blocks: tuple
    widths: tuple
    stem_kernel: int = 7
    stem_stride: int = 2
    maxpool: bool = True
    input_size: int = 224  # H = W where the checkpoint does not record it

    @property
    def expansion(self) -> int:
        return 4 if self.bottleneck else 1


# the example models' networks (models/resnet.py builds the same ones in PyTorch; tests/test_models.py compares them)
NETS = {
    "resnet18": ResNetArch(bottleneck=False, blocks=(2, 2, 2, 2), widths=(64, 128, 256, 512)),
    "resnet50": ResNetArch(bottleneck=True, blocks=(3, 4, 6, 3), widths=(64, 128, 256, 512)),
    "resnet_tiny": ResNetArch(bottleneck=False, blocks=(1, 1, 1), widths=(16, 32, 64), stem_kernel=3, stem_stride=1,
                              maxpool=False, input_size=32),
}


@dataclass(frozen=True)
class _Conv:
    stride: int
    padding: int


def _load(path: str) -> dict:
    ck = torch_load_weights_only(path, "HAWQ checkpoint")
    if not isinstance(ck, dict) or not all(isinstance(ck.get(k), dict) for k in HAWQ_KEYS):
        missing = [k for k in HAWQ_KEYS if not isinstance(ck, dict) or not isinstance(ck.get(k), dict)]
        raise QCompileError(f"'{path}' is not a HAWQ checkpoint: missing {', '.join(missing)}")
    return ck


def expected_weight_shapes(arch: ResNetArch, in_ch: int, classes: int) -> dict:
    """HAWQ layer name -> weight shape (OIHW; the fc: OI) of network ``arch`` (see ``NETS``)."""
    stem = "quant_init_convbn" if arch.bottleneck else "quant_init_block_convbn"
    out = {stem: (arch.widths[0], in_ch, arch.stem_kernel, arch.stem_kernel)}
    inplanes = arch.widths[0]
    for si, (planes, n) in enumerate(zip(arch.widths, arch.blocks), start=1):
        for ui in range(1, n + 1):
            u = f"stage{si}.unit{ui}"
            stride = 2 if si > 1 and ui == 1 else 1
            if arch.bottleneck:
                out[f"{u}.quant_convbn1"] = (planes, inplanes, 1, 1)
                out[f"{u}.quant_convbn2"] = (planes, planes, 3, 3)
                out[f"{u}.quant_convbn3"] = (planes * 4, planes, 1, 1)
            else:
                out[f"{u}.quant_convbn1"] = (planes, inplanes, 3, 3)
                out[f"{u}.quant_convbn2"] = (planes, planes, 3, 3)
            if stride != 1 or inplanes != planes * arch.expansion:
                out[f"{u}.quant_identity_convbn"] = (planes * arch.expansion, inplanes, 1, 1)
            inplanes = planes * arch.expansion
    out["quant_output"] = (classes, inplanes)
    return out


def _fmt(shape) -> str:
    return "x".join(str(int(d)) for d in shape)


class _Hawq:
    def __init__(self, ck: dict, net: str, batch: Optional[int], log, input_size: Optional[int] = None,
                 path: str = ""):
        self.ck, self.log, self.path = ck, log, path
        self.arch = NETS[net]
        self.meta, self.bits, self.signed = (ck.get(k) if isinstance(ck.get(k), dict) else {}
                                             for k in ("meta", "bits", "signed"))
        self.prefix = "module." if any(str(k).startswith("module.") for k in ck["weight_integer"]) else ""
        self.net = net
        self.check_network(net)
        stem = "quant_init_convbn" if self.arch.bottleneck else "quant_init_block_convbn"
        self.stem = stem
        shapes = self.meta.get("weight_shapes", {})
        w0 = self.weight_shape(self.stem, shapes)
        size = input_size or self.meta.get("input_size")
        if size is None:
            size = self.arch.input_size
            log(f"note: the checkpoint does not record the input size; using {size}x{size} (--input-size H)")
        self.shape = [batch or 1, w0[1], int(size), int(size)]
        self.b = QDQBuilder()

    # -- checkpoint access -------------------------------------------------------------------------
    def weight_shape(self, layer, shapes):
        if layer in shapes:
            return list(shapes[layer])
        return list(self._get("weight_integer", layer + ".weight_integer").shape)

    def checkpoint_shapes(self) -> dict:
        """HAWQ layer name -> weight shape, of every layer the checkpoint holds."""
        shapes = self.meta.get("weight_shapes", {}) or {}
        out = {}
        for k in self.ck["weight_integer"]:
            k = str(k)
            if k.endswith(".weight_integer"):
                name = (k[len(self.prefix):] if k.startswith(self.prefix) else k)[:-len(".weight_integer")]
                try:
                    out[name] = tuple(int(d) for d in self.weight_shape(name, shapes))
                except (TypeError, ValueError):
                    raise QCompileError(f"HAWQ checkpoint: layer '{name}' has an unreadable weight shape") from None
        return out

    def _mismatch(self, net: str, have: dict) -> Optional[str]:
        """Why the checkpoint's layers and shapes do not fit ``net`` (None: they do)."""
        arch = NETS[net]
        stem = "quant_init_convbn" if arch.bottleneck else "quant_init_block_convbn"
        if stem not in have:
            return f"it has no stem layer '{stem}' (the first convolution of {net})"
        if len(have[stem]) != 4 or "quant_output" not in have or len(have["quant_output"]) != 2:
            return "its first layer or its 'quant_output' (fc) layer is missing or not 4-D / 2-D"
        want = expected_weight_shapes(arch, have[stem][1], have["quant_output"][0])
        for name, shape in want.items():
            if name not in have:
                return f"it has no layer '{name}', which {net} has"
            if tuple(have[name]) != tuple(shape):
                return f"layer '{name}' has weights of shape {_fmt(have[name])}; {net} expects {_fmt(shape)}"
        extra = [n for n in have if n not in want]
        if extra:
            return f"it has layers that {net} does not: {', '.join(extra[:3])}{' ...' if len(extra) > 3 else ''}"
        return None

    def check_network(self, net: str) -> None:
        """Refuse a checkpoint of another network than ``net`` (the layer and shapes that differ are named)."""
        have = self.checkpoint_shapes()
        why = self._mismatch(net, have)
        if why is None:
            return
        fits = [n for n in NETS if n != net and self._mismatch(n, have) is None]
        hint = f" (it fits --net {fits[0]})" if fits else ""
        where = f" '{self.path}'" if self.path else ""
        raise QCompileError(f"the HAWQ checkpoint{where} does not match --net {net}: {why}{hint}")

    def _get(self, d, key):
        full = self.prefix + key
        if full not in self.ck[d]:
            raise QCompileError(f"HAWQ checkpoint: '{full}' missing from {d}")
        v = self.ck[d][full]
        return v.detach().cpu().numpy() if hasattr(v, "detach") else np.asarray(v)

    def act(self, name, default_signed):
        key = self.prefix + name + ".act_scaling_factor"
        if key not in self.ck["act_scaling_factor"]:
            return None
        raw = np.asarray(self._get("act_scaling_factor", name + ".act_scaling_factor")).reshape(-1)
        s = float(check_scale(raw[:1] if raw.size else raw, f"HAWQ activation '{name}', act_scaling_factor")[0])
        bits = int(self.bits.get(name, 8))
        if bits not in (4, 8):
            raise QCompileError(f"HAWQ activation '{name}': unsupported bit width {bits} (qcompile supports 4 and 8)")
        return s, qtype(bits, bool(self.signed.get(name, default_signed)), f"HAWQ activation '{name}'")

    def layer(self, name, x, s_in, conv: Optional[_Conv] = None):
        """Emit a quantized conv (``conv``: its stride and padding) or, without ``conv``, the fc; returns the float
        output."""
        q = self._get("weight_integer", name + ".weight_integer")
        bits = int(self.bits.get(name, 8))
        wq = qtype(bits, True, f"HAWQ layer '{name}'")
        shape = self.weight_shape(name, self.meta.get("weight_shapes", {}))
        if q.dtype == np.uint8 and bits == 4:  # HAWQ packing: first element in the top nibble
            q = int4.unpack(q, axis=1, first="high", count=shape[1])
        q = np.rint(q.astype(np.float64)).astype(np.int64)  # HAWQ stores integers as float tensors
        sd = "fc_scaling_factor" if conv is None else "convbn_scaling_factor"
        s_w = self._get(sd, f"{name}.{sd}").astype(np.float64).reshape(-1)
        check_scale(s_w, f"HAWQ layer '{name}', {sd}")
        s_w = s_w.astype(np.float32)
        w = self.b.qweight(q, s_w, wq, name=name + "_w")
        bias = None
        bkey = self.prefix + name + ".bias_integer"
        if bkey in self.ck["bias_integer"]:
            braw = np.rint(self._get("bias_integer", name + ".bias_integer").astype(np.float64)).reshape(-1)
            if braw.size not in (1, shape[0]):
                raise QCompileError(f"HAWQ layer '{name}': {braw.size} bias values for {shape[0]} output channels")
            bias = self.b.qbias(braw, np.float32(s_in) * s_w, name + "_b")  # (qbias checks the int32 range)
        if conv is None:
            return self.b.dense(x, w, bias, name)
        return self.b.conv2d(x, w, bias, (conv.stride,) * 2, (conv.padding,) * 4, (1, 1), 1, name)

    def qdq(self, f, act, name):
        s, qt = act
        return self.b.dequantize(self.b.quantize(f, s, 0, qt, name=name), s, 0), s

    # -- network ------------------------------------------------------------------------------------
    def blocks(self):
        """``(unit name, [conv of each main-path layer], downsample conv or None)`` in order."""
        a = self.arch
        inplanes = a.widths[0]
        for si, (planes, n) in enumerate(zip(a.widths, a.blocks), start=1):
            for ui in range(1, n + 1):
                stride = 2 if si > 1 and ui == 1 else 1
                if a.bottleneck:
                    convs = [_Conv(1, 0), _Conv(stride, 1), _Conv(1, 0)]
                else:
                    convs = [_Conv(stride, 1), _Conv(1, 1)]
                down = _Conv(stride, 0) if stride != 1 or inplanes != planes * a.expansion else None
                inplanes = planes * a.expansion
                yield f"stage{si}.unit{ui}", convs, down

    def run(self):
        a, b = self.arch, self.b
        x = b.input("input", self.shape)
        a_in = self.act("quant_input", True)
        if a_in is None:
            raise QCompileError("HAWQ checkpoint: no 'quant_input.act_scaling_factor' (the input scale)")
        h, s = self.qdq(x, a_in, "quant_input")
        h = b.relu(self.layer(self.stem, h, s, _Conv(a.stem_stride, a.stem_kernel // 2)))
        h, s = self.qdq(h, self.act("quant_act_int32", False), "quant_act_int32")
        if a.maxpool:
            h = b.max_pool2d(h, (3, 3), (2, 2), (1, 1, 1, 1), name="maxpool")
            h, s = self.qdq(h, (s, self.act("quant_act_int32", False)[1]), "maxpool_q")
        for u, convs, down in self.blocks():
            ain = self.act(u + ".quant_act", False)
            if ain is not None and not np.isclose(ain[0], s, rtol=1e-6):
                h, s = self.qdq(h, ain, u + ".quant_act")
            x_in, s_x = h, s
            for k, conv in enumerate(convs, start=1):
                f = self.layer(f"{u}.quant_convbn{k}", h, s, conv)
                if k < len(convs):
                    h, s = self.qdq(b.relu(f), self.act(f"{u}.quant_act{k}", False), f"{u}.quant_act{k}")
            res = self.act(u + ".qc_act_residual", True)
            r = self.qdq(f, res, u + ".qc_act_residual")[0] if res else f
            ident = x_in
            if down is not None:
                ident = self.layer(f"{u}.quant_identity_convbn", x_in, s_x, down)
                ida = self.act(u + ".qc_act_identity", True)
                ident = self.qdq(ident, ida, u + ".qc_act_identity")[0] if ida else ident
            out = b.relu(b.add(r, ident, name=u + "_add"))
            h, s = self.qdq(out, self.act(u + ".quant_act_int32", False), u + ".quant_act_int32")
        g = b.global_avg_pool(h, name="avgpool")
        g, s = self.qdq(g, self.act("quant_act_output", False), "quant_act_output")
        y = self.layer("quant_output", b.flatten(g, name="flatten"), s)
        lg = self.act("qc_act_logits", True)
        if lg:
            y = self.qdq(y, lg, "qc_act_logits")[0]
        return b.finish([y])


def from_hawq(path: str, net: Optional[str], batch: Optional[int] = None, log=print, input_size: Optional[int] = None):
    """Import a HAWQ checkpoint for network ``net`` into the QDQ-form Relax module."""
    if net is None:
        raise QCompileError("a HAWQ checkpoint does not record its network: pass --net resnet18|resnet50")
    if net not in NETS:
        raise QCompileError(f"unknown --net '{net}' (choose from {', '.join(NETS)})")
    ck = _load(path)
    h = _Hawq(ck, net, batch, log, input_size, path=path)
    try:
        mod = h.run()
    except BaseException:
        h.b.discard()
        raise
    return mod, {"input_name": "input", "input_shape": h.shape, "format": "hawq"}
