"""Export a :class:`~.quantize.QuantizedModel` as a PT2E quantized ``torch.export`` program (``.pt2``).

Flow (the stock torchao PT2E flow, not the fallback)::

    folded = FoldedResNet(qm)                       # float ResNet, BN already folded, torchvision names
    gm = torch.export.export(folded, (x,)).module()
    gm = prepare_pt2e(gm, QcompileQuantizer(qm))    # annotate conv/linear/add/relu/maxpool/avgpool
    gm(calib)                                       # calibration
    gm = convert_pt2e(gm)                           # -> quantized_decomposed Q/DQ ops
    torch.export.save(torch.export.export(gm, (x,)), "x.pt2")

The saved graph holds ``quantized_decomposed.quantize_per_tensor`` /
``dequantize_per_tensor`` on activations and ``dequantize_per_channel`` (axis 0)
on int8 weight constants and int32 bias constants; the float ops between them are
``aten.conv2d``, ``aten.relu``, ``aten.add``, ``aten.max_pool2d``,
``aten.adaptive_avg_pool2d``, ``aten.linear``.

Dtypes: every quantized tensor is stored as ``torch.int8`` (signed) or
``torch.uint8`` (unsigned); 4-bit tensors use the same dtypes with the 4-bit
``quant_min``/``quant_max`` ([-8, 7] / [0, 15]).  Weights [-2^(b-1), 2^(b-1)-1]
per-channel symmetric, biases int32 with scale ``s_in * s_w`` (a
``DerivedQuantizationSpec``), zero points 0.

``observers``:
  * ``"fixed"`` (default): the observers return the parameters already calibrated
    by :func:`~.quantize.quantize_model` (``FixedQParamsQuantizationSpec`` for
    activations, a fixed per-channel observer for weights), so the ``.pt2``,
    ONNX and HAWQ exports are the same network and the program reproduces
    ``qm.forward`` (up to float summation order).
  * ``"observe"``: torchao's own ``MinMaxObserver`` / ``PerChannelMinMaxObserver``
    calibrated on ``calib`` at the configured bits (symmetric scale
    ``max|x| / ((qmax - qmin) / 2)`` for signed tensors and weights,
    ``max / qmax`` with zero point 0 for unsigned ones) -- torchao's own flavour,
    which differs slightly from ``qm``.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .quantize import ActQuant, QLayer, QuantizedModel

__all__ = ["FoldedResNet", "QcompileQuantizer", "export_pt2", "load_pt2", "run_pt2", "quantized_ops"]


def _import_torchao():
    """Import torchao's PT2E pieces (registers ``torch.ops.quantized_decomposed``), muting its
    warnings about optional CUDA extensions it cannot load on this machine."""
    log = logging.getLogger("torchao")
    old = log.level
    log.setLevel(logging.ERROR)
    logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)  # a deprecation note torchao's import triggers
    try:
        import torchao.quantization.pt2e  # noqa: F401  (registers quantized_decomposed ops)
        from torchao.quantization.pt2e import observer as obs
        from torchao.quantization.pt2e import quantizer as qz
        from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e
    finally:
        log.setLevel(old)
    return obs, qz, prepare_pt2e, convert_pt2e


class _Block(nn.Module):
    def __init__(self, convs: list[QLayer], downsample: Optional[QLayer]):
        super().__init__()
        self.names = [c.name.rsplit(".", 1)[1] for c in convs]
        self.relus = [c.relu for c in convs]
        for c, n in zip(convs, self.names):
            setattr(self, n, _conv(c))
        self.downsample = nn.Sequential(_conv(downsample)) if downsample is not None else None

    def forward(self, x):
        out = x
        for n, r in zip(self.names, self.relus):
            out = getattr(self, n)(out)
            if r:
                out = F.relu(out)
        identity = self.downsample(x) if self.downsample is not None else x
        return F.relu(out + identity)


def _conv(l: QLayer) -> nn.Module:
    w = torch.from_numpy(l.float_weight.copy())
    if l.kind == "linear":
        m = nn.Linear(w.shape[1], w.shape[0])
    else:
        m = nn.Conv2d(w.shape[1] * l.groups, w.shape[0], w.shape[2:], stride=l.stride, padding=l.padding,
                      groups=l.groups)
    with torch.no_grad():
        m.weight.copy_(w)
        m.bias.copy_(torch.from_numpy(l.float_bias.copy()))
    return m


class FoldedResNet(nn.Module):
    """The float network of ``qm`` with BN folded (``qm.float_forward``), torchvision module names."""

    def __init__(self, qm: QuantizedModel):
        super().__init__()
        self.conv1 = _conv(qm.stem)
        self.mp = qm.maxpool
        stages: dict[str, list] = {}
        for b in qm.blocks:
            stages.setdefault(b.name.split(".")[0], []).append(_Block(b.convs, b.downsample))
        self.stage_names = list(stages)
        for n, blks in stages.items():
            setattr(self, n, nn.Sequential(*blks))
        self.fc = _conv(qm.fc)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        if self.mp is not None:
            x = F.max_pool2d(x, self.mp["kernel"], self.mp["stride"], self.mp["padding"])
        for n in self.stage_names:
            x = getattr(self, n)(x)
        x = F.adaptive_avg_pool2d(x, 1)
        return self.fc(torch.flatten(x, 1))


def _module_path(node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    return path.replace("L['self'].", "").replace("[", ".").replace("]", "").replace("'", "")


def _build_quantizer(qm: QuantizedModel, observers: str):
    obs, qz, _, _ = _import_torchao()
    aten = torch.ops.aten
    CONV = {aten.conv2d.default, aten.linear.default}
    RELU = {aten.relu.default, aten.relu_.default}
    ADD = {aten.add.Tensor, aten.add_.Tensor}
    MAXPOOL = {aten.max_pool2d.default, aten.max_pool2d_with_indices.default}
    AVGPOOL = {aten.adaptive_avg_pool2d.default, aten.mean.dim}
    VIEW = {aten.flatten.using_ints, aten.view.default, aten.reshape.default, aten.squeeze.dims}

    class _FixedPerChannelObserver(obs.PerChannelMinMaxObserver):
        def __init__(self, fixed_scale=(), **kw):
            super().__init__(**kw)
            self.register_buffer("fixed_scale", torch.tensor(fixed_scale, dtype=torch.float32))

        def calculate_qparams(self):
            return self.fixed_scale, torch.zeros(self.fixed_scale.shape, dtype=torch.int64)

    act_specs: dict[str, object] = {}

    def act_spec(a: ActQuant):
        if a.name not in act_specs:
            dt = torch.int8 if a.signed else torch.uint8
            if observers == "fixed":
                act_specs[a.name] = qz.FixedQParamsQuantizationSpec(
                    dtype=dt, scale=float(a.scale), zero_point=0, quant_min=a.qmin, quant_max=a.qmax,
                    qscheme=torch.per_tensor_affine)
            else:
                qs = torch.per_tensor_symmetric if a.signed else torch.per_tensor_affine
                act_specs[a.name] = qz.QuantizationSpec(
                    dtype=dt, quant_min=a.qmin, quant_max=a.qmax, qscheme=qs,
                    observer_or_fake_quant_ctr=obs.MinMaxObserver.with_args(eps=2 ** -24))
        return act_specs[a.name]

    def weight_spec(l: QLayer):
        lo, hi = -(2 ** (l.w_bits - 1)), 2 ** (l.w_bits - 1) - 1
        if observers == "fixed":
            ctr = _FixedPerChannelObserver.with_args(fixed_scale=tuple(float(s) for s in l.weight_scale))
        else:
            ctr = obs.PerChannelMinMaxObserver.with_args(eps=2 ** -24)
        return qz.QuantizationSpec(dtype=torch.int8, quant_min=lo, quant_max=hi,
                                   qscheme=torch.per_channel_symmetric, ch_axis=0,
                                   observer_or_fake_quant_ctr=ctr)

    def derive_bias(obs_list):
        s_in, _ = obs_list[0].calculate_qparams()
        s_w, _ = obs_list[1].calculate_qparams()
        s = (s_in.float().reshape(-1)[0] * s_w.float()).to(torch.float32)
        return s, torch.zeros(s.shape, dtype=torch.int64)

    layers = qm.layers
    blocks = {b.name: b for b in qm.blocks}

    class QcompileQuantizer(qz.Quantizer):
        """Annotates the exported ``FoldedResNet`` graph with ``qm``'s quantization points."""

        def annotate(self, gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
            out_spec: dict = {}  # node -> producer annotated output (for sharing)

            def ann(node, inputs=None, output=None):
                node.meta["quantization_annotation"] = qz.QuantizationAnnotation(
                    input_qspec_map=inputs or {}, output_qspec=output, _annotated=True)
                if output is not None:
                    out_spec[node] = output

            def in_spec(src, a: ActQuant):
                """Share the producer's observer; look through view/flatten; else ``a``'s spec."""
                p = src
                while p not in out_spec and p.op == "call_function" and p.target in VIEW:
                    p = p.args[0]
                return qz.SharedQuantizationSpec(p) if p in out_spec else act_spec(a)

            for n in gm.graph.nodes:
                if n.op != "call_function":
                    continue
                path = _module_path(n)
                if n.target in CONV:
                    l = layers[path]
                    x, w, b = n.args[0], n.args[1], n.args[2]
                    inputs = {x: in_spec(x, l.input), w: weight_spec(l)}
                    inputs[b] = qz.DerivedQuantizationSpec(
                        derived_from=[(x, n), (w, n)], derive_qparams_fn=derive_bias, dtype=torch.int32,
                        quant_min=-(2 ** 31), quant_max=2 ** 31 - 1, qscheme=torch.per_channel_symmetric,
                        ch_axis=0)
                    users = list(n.users)
                    if l.relu:
                        assert len(users) == 1 and users[0].target in RELU, f"{path}: expected a ReLU"
                        ann(n, inputs)
                        ann(users[0], output=act_spec(l.output))
                    else:
                        ann(n, inputs, act_spec(l.output))
                elif n.target in ADD:
                    blk = blocks[path]
                    users = list(n.users)
                    assert len(users) == 1 and users[0].target in RELU, f"{path}: expected add+ReLU"
                    ann(n, {a: in_spec(a, blk.input) for a in n.args[:2]})
                    ann(users[0], output=act_spec(blk.output))
                elif n.target in MAXPOOL:
                    x = n.args[0]
                    ann(n, {x: in_spec(x, qm.stem.output)}, qz.SharedQuantizationSpec((x, n)))
                elif n.target in AVGPOOL:
                    x = n.args[0]
                    ann(n, {x: in_spec(x, qm.blocks[-1].output)}, act_spec(qm.avgpool_act))
            return gm

        def validate(self, gm: torch.fx.GraphModule) -> None:
            pass

    return QcompileQuantizer()


def QcompileQuantizer(qm: QuantizedModel, observers: str = "fixed"):
    """A torchao ``Quantizer`` for the ``FoldedResNet`` of ``qm`` (see module docstring)."""
    if observers not in ("fixed", "observe"):
        raise ValueError(f"observers must be 'fixed' or 'observe', got {observers!r}")
    return _build_quantizer(qm, observers)


def export_pt2(qm: QuantizedModel, path: str, example_input: torch.Tensor,
               calib: Optional[torch.Tensor] = None, observers: str = "fixed",
               dynamic_batch: bool = False) -> "torch.export.ExportedProgram":
    """PT2E-quantize ``qm``'s float network and ``torch.export.save`` it to ``path``."""
    _, _, prepare_pt2e, convert_pt2e = _import_torchao()
    folded = FoldedResNet(qm).eval()
    ex = (example_input.float(),)
    dyn_n = ({0: torch.export.Dim("N", min=1, max=4096)},)
    dyn = dyn_n if dynamic_batch else None
    # capture with a dynamic batch so that calibration can use any batch size
    ex2 = (torch.cat([ex[0]] * 2),) if ex[0].shape[0] == 1 else ex
    gm = torch.export.export(folded, ex2, dynamic_shapes=dyn_n).module()
    gm = prepare_pt2e(gm, QcompileQuantizer(qm, observers))
    with torch.no_grad():
        data = calib if calib is not None else example_input
        for i in range(0, data.shape[0], 64):
            gm(data[i:i + 64].float())
    gm = convert_pt2e(gm)
    _drop_unused_params(gm)
    ep = torch.export.export(gm, ex2 if dynamic_batch else ex, dynamic_shapes=dyn)
    from qcompile.checks import atomic_output

    with atomic_output(path) as tmp:  # (renamed when complete: a failure leaves no partial file)
        torch.export.save(ep, tmp)
    return ep


def _drop_unused_params(gm: torch.fx.GraphModule) -> None:
    """convert_pt2e leaves the float weights attached although only the folded int8 copies
    are used; drop them so the .pt2 does not carry the float model too."""
    used = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    for name, _ in list(gm.named_parameters()):
        if name not in used:
            mod_name, _, attr = name.rpartition(".")
            mod = gm.get_submodule(mod_name) if mod_name else gm
            delattr(mod, attr)


def load_pt2(path: str) -> "torch.export.ExportedProgram":
    """``torch.export.load`` after registering the ``quantized_decomposed`` ops, with no code execution: pickled
    weights load as ``weights_only`` and pickled Python objects are refused (``qcompile.checks.torch_export_load``)."""
    from qcompile.checks import torch_export_load

    _import_torchao()
    return torch_export_load(path)


def run_pt2(path_or_ep, x: torch.Tensor) -> torch.Tensor:
    """Run a saved program (the PyTorch reference); loops over ``x`` if the batch is static."""
    ep = load_pt2(path_or_ep) if isinstance(path_or_ep, str) else path_or_ep
    mod = ep.module()
    ph = [n for n in ep.graph.nodes if n.op == "placeholder" and n.name not in ep.graph_signature.inputs_to_parameters
          and n.name not in ep.graph_signature.inputs_to_buffers
          and n.name not in ep.graph_signature.inputs_to_lifted_tensor_constants]
    b = ph[-1].meta["val"].shape[0] if ph else x.shape[0]
    with torch.no_grad():
        if isinstance(b, int) and b != x.shape[0]:
            return torch.cat([mod(x[i:i + b].float()) for i in range(0, x.shape[0], b)])
        return mod(x.float())


def quantized_ops(ep) -> dict[str, int]:
    """Counts of ``quantized_decomposed.*`` ops in the program's graph."""
    out: dict[str, int] = {}
    for n in ep.graph.nodes:
        if n.op == "call_function" and "quantized_decomposed" in str(n.target):
            k = str(n.target).split("quantized_decomposed.")[-1]
            out[k] = out.get(k, 0) + 1
    return out
