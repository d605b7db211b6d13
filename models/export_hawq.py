"""Export a :class:`~.quantize.QuantizedModel` as a HAWQ-V3 style checkpoint (``torch.save`` of a dict).

HAWQ-V3 (``quant_train.py`` of Zhen-Dong/HAWQ) saves ``quantized_checkpoint.pth.tar`` as five
dicts filtered from the ``state_dict`` of its ``q_resnet`` models (hence the ``module.``
DataParallel prefix); this module writes the same five dicts, with the same key scheme,
plus ``bits``, ``signed`` and ``meta``.  The full key scheme, the integer math and the
int4 packing are documented in ``models/HAWQ_FORMAT.md``.

Summary of names (torchvision -> HAWQ, ``S = I``, ``U = J + 1``)::

    conv1                  -> quant_init_block_convbn   (BasicBlock nets; Bottleneck: quant_init_convbn)
    layerI.J.convK         -> stageS.unitU.quant_convbnK
    layerI.J.downsample.0  -> stageS.unitU.quant_identity_convbn
    fc                     -> quant_output
    input                  -> quant_input.act_scaling_factor
    conv1 output (+maxpool)-> quant_act_int32.act_scaling_factor
    block input            -> stageS.unitU.quant_act.act_scaling_factor
    layerI.J.convK output  -> stageS.unitU.quant_actK.act_scaling_factor     (K < last conv)
    block output (add+ReLU)-> stageS.unitU.quant_act_int32.act_scaling_factor
    avgpool output         -> quant_act_output.act_scaling_factor
  qcompile extensions (no HAWQ counterpart; HAWQ keeps these tensors in int32):
    last conv output       -> stageS.unitU.qc_act_residual.act_scaling_factor
    downsample output      -> stageS.unitU.qc_act_identity.act_scaling_factor
    fc output (logits)     -> qc_act_logits.act_scaling_factor

``packed_int4=True``: the ``weight_integer`` of every 4-bit layer is stored packed,
two values per byte along axis 1 (input channels; HAWQ's TVM side packs the ``I`` axis),
FIRST element in the TOP nibble: ``byte = (q[2k] & 0xF) << 4 | (q[2k+1] & 0xF)``
(an odd channel count is zero-padded): ``qcompile.int4.pack(q, 1, first="high", pad_odd=True)``;
:func:`load_hawq` unpacks them.
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch

from qcompile import int4

from .quantize import ActQuant, QLayer, QuantizedModel

__all__ = ["hawq_names", "to_hawq", "export_hawq", "load_hawq", "HAWQ_KEYS"]

HAWQ_KEYS = ("weight_integer", "bias_integer", "act_scaling_factor", "convbn_scaling_factor", "fc_scaling_factor")
PREFIX = "module."


def hawq_names(qm: QuantizedModel) -> tuple["OrderedDict[str, str]", "OrderedDict[str, str]"]:
    """``(layers, acts)``: our layer name -> HAWQ module name, and HAWQ act module -> our tensor name."""
    init = "quant_init_convbn" if qm.block_type == "bottleneck" else "quant_init_block_convbn"
    layers = OrderedDict([(qm.stem.name, init)])
    acts = OrderedDict([("quant_input", "input"), ("quant_act_int32", qm.stem.name)])
    for b in qm.blocks:
        stage, j = b.name.split(".")
        unit = f"stage{stage[len('layer'):]}.unit{int(j) + 1}"
        acts[f"{unit}.quant_act"] = b.input.name
        for k, c in enumerate(b.convs, start=1):
            layers[c.name] = f"{unit}.quant_convbn{k}"
            if k < len(b.convs):
                acts[f"{unit}.quant_act{k}"] = c.name
            else:
                acts[f"{unit}.qc_act_residual"] = c.name
        if b.downsample is not None:
            layers[b.downsample.name] = f"{unit}.quant_identity_convbn"
            acts[f"{unit}.qc_act_identity"] = b.downsample.name
        acts[f"{unit}.quant_act_int32"] = b.name
    acts["quant_act_output"] = "avgpool"
    acts["qc_act_logits"] = "fc"
    layers[qm.fc.name] = "quant_output"
    return layers, acts


def to_hawq(qm: QuantizedModel, packed_int4: bool = False, input_size: int | None = None) -> dict:
    """The checkpoint dict (see module docstring and ``HAWQ_FORMAT.md``); ``input_size`` (H = W) goes to ``meta``."""
    grouped = [n for n, l in qm.layers.items() if l.groups != 1]
    if grouped:
        raise ValueError(f"{qm.arch}: the HAWQ format describes ResNets with plain convs; layer '{grouped[0]}' is a "
                         f"grouped conv (groups={qm.layers[grouped[0]].groups}): export it as onnx or pt2")
    lnames, anames = hawq_names(qm)
    all_acts = qm.acts
    ck: dict = {k: OrderedDict() for k in HAWQ_KEYS}
    bits: OrderedDict = OrderedDict()
    signed: OrderedDict = OrderedDict()
    shapes: OrderedDict = OrderedDict()
    for hname, tname in anames.items():
        a: ActQuant = all_acts[tname]
        ck["act_scaling_factor"][f"{PREFIX}{hname}.act_scaling_factor"] = torch.tensor([a.scale], dtype=torch.float32)
        bits[hname] = a.bits
        signed[hname] = a.signed
    for name, hname in lnames.items():
        l: QLayer = qm.layers[name]
        w = l.weight
        shapes[hname] = list(w.shape)
        if packed_int4 and l.w_bits == 4:
            if w.min(initial=0) < -8 or w.max(initial=0) > 7:
                raise ValueError(f"{name}: 4-bit weights outside the int4 range [-8, 7]")
            w_t = torch.from_numpy(int4.pack(w, axis=1, first="high", pad_odd=True))
        else:
            w_t = torch.from_numpy(w.astype(np.int8))
        ck["weight_integer"][f"{PREFIX}{hname}.weight_integer"] = w_t
        ck["bias_integer"][f"{PREFIX}{hname}.bias_integer"] = torch.from_numpy(l.bias.astype(np.int32))
        sf = "fc_scaling_factor" if l.kind == "linear" else "convbn_scaling_factor"
        ck[sf][f"{PREFIX}{hname}.{sf}"] = torch.from_numpy(l.weight_scale.astype(np.float32))
        bits[hname] = l.w_bits
    ck["bits"] = bits
    ck["signed"] = signed
    ck["meta"] = dict(
        format="qcompile-hawq-v1", arch=qm.arch, block_type=qm.block_type,
        packed_int4=bool(packed_int4), weight_layout="OIHW (fc: OI)", packed_axis=1,
        packed_order="first element in the top nibble", weight_shapes=shapes,
        zero_point=0, maxpool=qm.maxpool, input_size=input_size,
        layer_strides={lnames[n]: l.stride for n, l in qm.layers.items()},
        layer_padding={lnames[n]: l.padding for n, l in qm.layers.items()},
        layer_names={v: k for k, v in lnames.items()},
        act_names=dict(anames),
    )
    return ck


def export_hawq(qm: QuantizedModel, path: str, packed_int4: bool = False, input_size: int | None = None) -> dict:
    """:func:`to_hawq` + ``torch.save`` (under a temporary name beside ``path``, then renamed: a failure leaves no
    partial file). The checkpoint holds tensors, numbers, strings and plain containers only, so it loads with
    ``torch.load(..., weights_only=True)``."""
    from qcompile.checks import atomic_output

    ck = to_hawq(qm, packed_int4, input_size)
    with atomic_output(path) as tmp:
        torch.save(ck, tmp)
    return ck


def load_hawq(path: str, unpack: bool = True) -> dict:
    """``torch.load(..., weights_only=True)`` a checkpoint (no code in the file runs); with ``unpack`` packed int4
    weights come back as int8 OIHW."""
    ck = torch.load(path, map_location="cpu", weights_only=True)
    if unpack and ck.get("meta", {}).get("packed_int4"):
        for key, t in ck["weight_integer"].items():
            h = key[len(PREFIX):-len(".weight_integer")]
            if ck["bits"][h] == 4:
                n = ck["meta"]["weight_shapes"][h][1]
                ck["weight_integer"][key] = torch.from_numpy(int4.unpack(t.numpy(), axis=1, first="high", count=n))
        ck["meta"] = dict(ck["meta"], packed_int4=False)
    return ck
