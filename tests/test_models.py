"""Fast tests of qcompile.models: ResNets, PTQ, ONNX / PT2 / HAWQ exporters, qmodel CLI."""
from __future__ import annotations

import importlib.util
import json
import os

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto

from qcompile.models import build_model, quantize_model
from qcompile.models.quantize import (CalibConfig, bit_config, fold_bn, quant_points, quantize_weight)
from qcompile.models.resnet import MODELS

TINY_SHAPE = (1, 3, 16, 16)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _data(n, shape, seed):
    return torch.randn((n, *shape[1:]), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny models: extra threads only add contention on a shared 2-core box."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tiny():
    return build_model("resnet_tiny", seed=3)


@pytest.fixture(scope="module")
def calib():
    return _data(32, TINY_SHAPE, 1)


@pytest.fixture(scope="module")
def xtest():
    return _data(16, TINY_SHAPE, 2)


@pytest.fixture(scope="module")
def qtiny(tiny, calib):
    return {b: quantize_model(tiny, calib, b, arch="resnet_tiny") for b in (8, 4, "mixed")}


@pytest.fixture(scope="module")
def r18_4bit():
    """resnet18 (has the max-pool) at 32x32, 4-bit."""
    m = build_model("resnet18", num_classes=10, seed=0)
    return quantize_model(m, _data(4, (1, 3, 32, 32), 5), 4, arch="resnet18")


def _steps(a, b, scale):
    return np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)) / scale


# --------------------------------------------------------------------------- resnet
def test_torchvision_structure():
    m18 = build_model("resnet18")
    assert sum(p.numel() for p in m18.parameters()) == 11_689_512      # torchvision's count
    keys = set(m18.state_dict())
    for k in ("conv1.weight", "bn1.running_var", "layer1.0.conv2.weight", "layer2.0.downsample.0.weight",
              "layer2.0.downsample.1.weight", "layer4.1.bn2.bias", "fc.weight"):
        assert k in keys
    m50 = build_model("resnet50")
    assert sum(p.numel() for p in m50.parameters()) == 25_557_032
    assert "layer1.0.conv3.weight" in m50.state_dict() and "layer1.0.downsample.0.weight" in m50.state_dict()
    assert m50.layer2[0].conv2.stride == (2, 2)          # v1.5: stride on the 3x3
    from qcompile.models import cli as model_cli
    from qcompile.models.resnet import ORT_QUANTIZED

    assert set(MODELS) == {"resnet18", "resnet50", "resnet_tiny", "resnext50_32x4d", "resnext_tiny"} | set(ORT_QUANTIZED)
    assert set(model_cli.MODEL_NAMES) == set(MODELS) and tuple(model_cli.ORT_QUANTIZED) == tuple(ORT_QUANTIZED)
    assert {"mobilenet_v2", "mobilenet_v3_large", "efficientnet_b0", "densenet121"} <= set(ORT_QUANTIZED)
    with torch.no_grad():
        assert m18(torch.randn(1, 3, 64, 64)).shape == (1, 1000)


def test_tiny_runs_on_8x8_and_bn_is_random():
    m = build_model("resnet_tiny", in_ch=1)
    with torch.no_grad():
        assert m(torch.randn(2, 1, 8, 8)).shape == (2, 10)
    assert m.maxpool is None
    assert m.bn1.running_var.std() > 0.05 and m.bn1.running_mean.abs().max() > 0
    a, b = build_model("resnet_tiny", seed=7), build_model("resnet_tiny", seed=7)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


# --------------------------------------------------------------------------- quantize
def test_bn_folding_matches_float(tiny, qtiny, xtest):
    w, b = fold_bn(tiny.conv1, tiny.bn1)
    k = tiny.bn1.weight / torch.sqrt(tiny.bn1.running_var + tiny.bn1.eps)
    assert np.allclose(w, (tiny.conv1.weight * k[:, None, None, None]).detach().numpy(), atol=1e-6)
    with torch.no_grad():
        f, ff = tiny(xtest), qtiny[8].float_forward(xtest)
    assert torch.allclose(f, ff, atol=1e-4)


def test_weight_quantization_math():
    w = np.random.RandomState(0).randn(4, 3, 3, 3).astype(np.float32)
    w[2] = 0.0                                               # zero channel guard
    for bits in (8, 4):
        q, s = quantize_weight(w, bits)
        qmax = 2 ** (bits - 1) - 1
        assert q.dtype == np.int8 and q.min() >= -qmax - 1 and q.max() <= qmax
        assert s[2] == 1.0 and (q[2] == 0).all()
        for c in (0, 1, 3):
            assert np.isclose(s[c], np.abs(w[c]).max() / qmax)
            assert np.abs(q[c]).max() == qmax
        assert np.abs(q * s[:, None, None, None] - w).max() <= s.max() / 2 + 1e-6


def test_act_signedness_and_bias(qtiny):
    qm = qtiny[8]
    acts = qm.acts
    assert acts["input"].signed and acts["fc"].signed
    assert not acts["conv1"].signed and not acts["layer1.0.conv1"].signed and not acts["avgpool"].signed
    assert acts["layer1.0.conv2"].signed and acts["layer2.0.downsample.0"].signed   # pre-add
    assert not acts["layer2.0"].signed                                              # add + ReLU
    assert all(a.zero_point == 0 for a in acts.values())
    for l in qm.layers.values():
        assert l.bias.dtype == np.int32
        assert np.allclose(l.bias_scale, np.float32(l.input.scale) * l.weight_scale)
        assert np.abs(l.bias * l.bias_scale - l.float_bias).max() <= l.bias_scale.max() / 2 + 1e-7
    # the input of each conv is the tensor its producer emits
    assert qm.layers["layer2.0.conv1"].input is qm.acts["layer1.0"]
    assert qm.layers["layer1.0.conv2"].input is qm.acts["layer1.0.conv1"]


def test_bit_presets(tiny):
    c4 = bit_config(tiny, 4)
    assert c4["input"].a_bits == 8 and c4["conv1"].w_bits == 8 and c4["fc"] == (c4["fc"].__class__(8, 8))
    assert c4["avgpool"].a_bits == 8
    assert all(v.w_bits == 4 for k, v in c4.items() if v.w_bits is not None and k not in ("conv1", "fc"))
    assert all(v.a_bits == 4 for k, v in c4.items() if k not in ("input", "avgpool", "fc"))
    assert bit_config(tiny, 4, residual_bits=8)["layer2.0.downsample.0"].a_bits == 8
    assert all(v.a_bits == 8 and v.w_bits in (None, 8) for v in bit_config(tiny, 8).values())
    mixed = bit_config(tiny, "mixed")
    assert mixed == bit_config(tiny, "mixed")
    assert mixed["layer2.0.conv2"].w_bits == 4 and mixed["layer2.0.conv1"].a_bits == 4
    assert mixed["layer1.0.conv2"].w_bits == 8 and mixed["layer3.0.conv2"].w_bits == 8
    user = bit_config(tiny, {"layer1.0.conv1": (4, 8), "layer3.0": 4})
    assert user["layer1.0.conv1"].w_bits == 4 and user["layer3.0"].a_bits == 4 and user["conv1"].w_bits == 8
    assert list(quant_points(tiny))[:3] == ["input", "conv1", "layer1.0.conv1"]


@pytest.mark.parametrize("bits,needle", [
    (3, "3"), (16, "16"), ({"layer1.0.conv1": (5, 8)}, "layer1.0.conv1"), ({"fc": (8, 2)}, "'fc'"),
    ({"conv1": (8, 6)}, "6"), ({"nope": 8}, "nope"), ("int7", "int7"),
])
def test_bad_bits_raise(tiny, bits, needle):
    with pytest.raises(ValueError, match=needle):
        bit_config(tiny, bits)


def test_deterministic_and_close(tiny, calib, xtest, qtiny):
    again = quantize_model(tiny, calib, 4, arch="resnet_tiny")
    for n, l in qtiny[4].layers.items():
        assert np.array_equal(l.weight, again.layers[n].weight) and np.array_equal(l.bias, again.layers[n].bias)
    assert [a.scale for a in again.acts.values()] == [a.scale for a in qtiny[4].acts.values()]
    with torch.no_grad():
        f = tiny(xtest)
        e8 = float((qtiny[8](xtest) - f).norm() / f.norm())
        e4 = float((qtiny[4](xtest) - f).norm() / f.norm())
    assert e8 < 0.05 and e8 < e4 < 0.6


def test_calibration_methods(tiny, calib):
    s = {}
    for m in ("minmax", "percentile", "mse"):
        qm = quantize_model(tiny, calib, 4, calib=CalibConfig(method4=m), arch="resnet_tiny")
        s[m] = qm.acts["layer1.0.conv1"].scale
    assert s["percentile"] <= s["minmax"] and s["mse"] <= s["minmax"]
    with pytest.raises(ValueError):
        CalibConfig(method8="kl")


def test_fake_quant_values_on_grid(qtiny, xtest):
    qm = qtiny[4]
    seen = {}
    qm(xtest, observe=lambda n, x: seen.__setitem__(n, x))  # observes the pre-quantization tensors
    for name, a in qm.acts.items():
        q = a.quantize(seen[name].numpy())
        assert q.min() >= a.qmin and q.max() <= a.qmax
    out = qm(xtest).detach().numpy() / qm.fc.output.scale
    assert np.allclose(out, np.round(out), atol=1e-3)


# --------------------------------------------------------------------------- onnx
def _ort_ok():
    return importlib.util.find_spec("onnxruntime") is not None


def _init(model, name):
    return next(t for t in model.graph.initializer if t.name == name)


@pytest.mark.parametrize("bits", [8, "mixed"])
def test_onnx_8bit_runs_in_ort_and_matches(qtiny, xtest, bits, tmp_path):
    from qcompile.models.export_onnx import export_onnx, ort_int8_kernels_exact, run_onnx
    qm = qtiny[bits]
    path = str(tmp_path / "m.onnx")
    model = export_onnx(qm, path, TINY_SHAPE, batch=None)
    onnx.checker.check_model(onnx.load(path), full_check=True)
    assert model.opset_import[0].version == (13 if bits == 8 else 21)
    ops = {n.op_type for n in model.graph.node}
    assert {"QuantizeLinear", "DequantizeLinear", "Conv", "Relu", "Add", "GlobalAveragePool", "Flatten",
            "Gemm"} <= ops
    assert _init(model, "conv1_zero_point").data_type == TensorProto.UINT8 or bits != 8
    assert _init(model, "input_zero_point").data_type == TensorProto.INT8
    assert _init(model, "layer1.0.conv2_zero_point").data_type == TensorProto.INT8
    assert _init(model, "layer1.0_zero_point").data_type == TensorProto.UINT8
    assert _init(model, "layer1.0.conv1.bias_quantized").data_type == TensorProto.INT32
    w = _init(model, "layer2.0.conv2.weight_quantized")
    assert w.data_type == (TensorProto.INT8 if bits == 8 else TensorProto.INT4)
    gemm = next(n for n in model.graph.node if n.op_type == "Gemm")
    assert any(a.name == "transB" and a.i == 1 for a in gemm.attribute)
    if not _ort_ok():
        pytest.skip("onnxruntime missing")
    with torch.no_grad():
        ref = qm(xtest).numpy()
    # the QDQ graph as written (DequantizeLinear -> float op -> QuantizeLinear), then, where ORT's fused int8 kernels
    # are exact on this CPU (VNNI, ARM: not x86 AVX2, whose u8s8 kernels saturate), ORT's optimized session too
    out = run_onnx(path, xtest.numpy(), disable_optimizations=True)
    assert _steps(out, ref, qm.fc.output.scale).max() <= 1.0 + 1e-3
    if ort_int8_kernels_exact():
        out = run_onnx(path, xtest.numpy())
        assert _steps(out, ref, qm.fc.output.scale).max() <= 1.0 + 1e-3


@pytest.mark.parametrize("which", ["tiny", "resnet18"])
def test_onnx_4bit(qtiny, r18_4bit, xtest, which, tmp_path):
    from qcompile.models.export_onnx import has_4bit, run_onnx, to_onnx
    qm, shape = (qtiny[4], TINY_SHAPE) if which == "tiny" else (r18_4bit, (1, 3, 32, 32))
    model = to_onnx(qm, shape, batch=1)
    assert model.opset_import[0].version == 21 and has_4bit(model)
    for name, l in qm.layers.items():
        t = _init(model, f"{name}.weight_quantized")
        assert t.data_type == (TensorProto.INT4 if l.w_bits == 4 else TensorProto.INT8), name
        if l.w_bits == 4:
            assert len(t.raw_data) == (l.weight.size + 1) // 2          # packed two per byte
            assert np.array_equal(onnx.numpy_helper.to_array(t).astype(np.int8), l.weight)
    for name, a in qm.acts.items():
        zp = _init(model, f"{name}_zero_point").data_type
        want = {"int8": TensorProto.INT8, "uint8": TensorProto.UINT8, "int4": TensorProto.INT4,
                "uint4": TensorProto.UINT4}[a.dtype]
        assert zp == want, name
    assert qm.acts["layer1.0.conv1"].dtype == "uint4" and qm.acts["layer1.0.conv2"].dtype == "int4"
    if which == "resnet18":
        assert any(n.op_type == "MaxPool" for n in model.graph.node)
    if not _ort_ok():
        pytest.skip("onnxruntime missing")
    x = xtest.numpy()[:4] if which == "tiny" else _data(4, shape, 9).numpy()
    out = run_onnx(model, x)            # ORT runs int4 Q/DQ (float Conv in between)
    with torch.no_grad():
        ref = qm(torch.from_numpy(x)).numpy()
    assert _steps(out, ref, qm.fc.output.scale).max() <= 1.0 + 1e-3


# --------------------------------------------------------------------------- pt2
@pytest.mark.parametrize("bits", [8, 4])
def test_pt2_roundtrip(qtiny, calib, xtest, bits, tmp_path):
    from qcompile.models.export_pt2 import export_pt2, load_pt2, quantized_ops, run_pt2
    qm = qtiny[bits]
    path = str(tmp_path / "m.pt2")
    export_pt2(qm, path, xtest[:1], calib=calib)
    ep = load_pt2(path)
    ops = quantized_ops(ep)
    assert ops.get("quantize_per_tensor.default", 0) >= len(qm.acts) - 1
    assert ops.get("dequantize_per_tensor.default", 0) >= len(qm.acts) - 1
    assert ops.get("dequantize_per_channel.default", 0) == 2 * len(qm.layers)   # weights + biases
    ranges = {(n.args[3], n.args[4]) for n in ep.graph.nodes
              if n.op == "call_function" and "quantize_per_tensor" in str(n.target)}
    if bits == 4:
        assert (0, 15) in ranges and (-8, 7) in ranges
    else:
        assert ranges <= {(0, 255), (-128, 127)}
    out = run_pt2(ep, xtest).numpy()
    with torch.no_grad():
        ref = qm(xtest).numpy()
    assert _steps(out, ref, qm.fc.output.scale).max() <= 1.0 + 1e-3


def test_pt2_observe_mode(qtiny, calib, xtest, tmp_path):
    """torchao's own observers (its scales differ a little from ours)."""
    from qcompile.models.export_pt2 import export_pt2, quantized_ops, run_pt2
    qm = qtiny[8]
    ep = export_pt2(qm, str(tmp_path / "o.pt2"), xtest[:1], calib=calib, observers="observe",
                    dynamic_batch=True)
    assert quantized_ops(ep).get("dequantize_per_channel.default", 0) == 2 * len(qm.layers)
    out = run_pt2(ep, xtest)
    with torch.no_grad():
        ref = qm(xtest)
    assert float((out - ref).norm() / ref.norm()) < 0.1
    with pytest.raises(ValueError):
        export_pt2(qm, str(tmp_path / "x.pt2"), xtest[:1], observers="magic")


# --------------------------------------------------------------------------- hawq
def _hawq_integer_forward(ck, qm, x):
    """Integer-math reference straight from the checkpoint, following HAWQ_FORMAT.md."""
    A = {k[len("module."):-len(".act_scaling_factor")]: float(v) for k, v in ck["act_scaling_factor"].items()}
    sign, bits = ck["signed"], ck["bits"]

    def rq(real, act):        # requantize a real-valued tensor onto act's integer grid
        b = bits[act]
        lo, hi = (-(2 ** (b - 1)), 2 ** (b - 1) - 1) if sign[act] else (0, 2 ** b - 1)
        return torch.clamp(torch.round(real / A[act]), lo, hi)

    def layer(h, q_in, s_in, relu, out_act, stride=1, pad=0):
        w = ck["weight_integer"][f"module.{h}.weight_integer"].double()
        b = ck["bias_integer"][f"module.{h}.bias_integer"].double()
        key = "fc_scaling_factor" if h == "quant_output" else "convbn_scaling_factor"
        s_w = ck[key][f"module.{h}.{key}"].double()
        if w.ndim == 4:
            acc = torch.nn.functional.conv2d(q_in, w, b, stride, pad)
            real = acc * (s_in * s_w)[None, :, None, None]
        else:
            acc = q_in @ w.T + b
            real = acc * (s_in * s_w)[None, :]
        if relu:
            real = torch.relu(real)
        return rq(real, out_act)

    meta = ck["meta"]
    st, pd = meta["layer_strides"], meta["layer_padding"]
    init = "quant_init_convbn" if meta["block_type"] == "bottleneck" else "quant_init_block_convbn"
    q = rq(x.double(), "quant_input")
    q = layer(init, q, A["quant_input"], True, "quant_act_int32", st[init], pd[init])
    s_prev = A["quant_act_int32"]
    for b in qm.blocks:
        stage, j = b.name.split(".")
        u = f"stage{stage[5:]}.unit{int(j) + 1}"
        assert A[f"{u}.quant_act"] == s_prev
        out, s_o = q, s_prev
        n = len(b.convs)
        for k in range(1, n + 1):
            act = f"{u}.quant_act{k}" if k < n else f"{u}.qc_act_residual"
            h = f"{u}.quant_convbn{k}"
            out = layer(h, out, s_o, k < n, act, st[h], pd[h])
            s_o = A[act]
        if b.downsample is not None:
            h = f"{u}.quant_identity_convbn"
            ident = layer(h, q, s_prev, False, f"{u}.qc_act_identity", st[h], pd[h]) * A[f"{u}.qc_act_identity"]
        else:
            ident = q * s_prev
        q = rq(torch.relu(out * s_o + ident), f"{u}.quant_act_int32")
        s_prev = A[f"{u}.quant_act_int32"]
    q = rq(q.mean(dim=(2, 3)) * s_prev, "quant_act_output")
    q = layer("quant_output", q, A["quant_act_output"], False, "qc_act_logits")
    return q * A["qc_act_logits"]


@pytest.mark.parametrize("bits", [8, 4, "mixed"])
def test_hawq_checkpoint(qtiny, xtest, bits, tmp_path):
    from qcompile.models.export_hawq import HAWQ_KEYS, export_hawq, load_hawq
    qm = qtiny[bits]
    path = str(tmp_path / "m.pth")
    export_hawq(qm, path)
    ck = torch.load(path, weights_only=True)
    assert all(k in ck for k in HAWQ_KEYS) and "bits" in ck
    assert "module.quant_init_block_convbn.weight_integer" in ck["weight_integer"]
    assert "module.stage2.unit1.quant_identity_convbn.convbn_scaling_factor" in ck["convbn_scaling_factor"]
    assert "module.quant_output.fc_scaling_factor" in ck["fc_scaling_factor"]
    assert "module.stage1.unit1.quant_act1.act_scaling_factor" in ck["act_scaling_factor"]
    assert ck["bits"]["quant_input"] == 8 and ck["bits"]["stage2.unit1.quant_convbn2"] == qm.bits[
        "layer2.0.conv2"].w_bits
    ref = qm(xtest).detach().numpy()
    out = _hawq_integer_forward(ck, qm, xtest).numpy()
    assert _steps(out, ref, qm.fc.output.scale).max() <= 1.0 + 1e-3
    assert load_hawq(path)["meta"]["packed_int4"] is False


def test_hawq_packed_int4_top_nibble_first(qtiny, tmp_path):
    from qcompile import int4
    from qcompile.models.export_hawq import export_hawq, load_hawq
    qm = qtiny[4]
    path = str(tmp_path / "p.pth")
    ck = export_hawq(qm, path, packed_int4=True)
    l = qm.layers["layer1.0.conv1"]
    p = ck["weight_integer"]["module.stage1.unit1.quant_convbn1.weight_integer"].numpy()
    assert p.dtype == np.uint8 and p.shape == (l.weight.shape[0], l.weight.shape[1] // 2, 3, 3)
    q = l.weight.astype(np.int16)
    assert np.array_equal(p >> 4, q[:, 0::2] & 0xF)      # first element -> top nibble
    assert np.array_equal(p & 0xF, q[:, 1::2] & 0xF)
    assert ck["weight_integer"]["module.quant_init_block_convbn.weight_integer"].dtype == torch.int8  # 8-bit
    back = load_hawq(path)
    assert np.array_equal(back["weight_integer"]["module.stage1.unit1.quant_convbn1.weight_integer"].numpy(),
                          l.weight)
    odd = np.array([[1, -2, 7]], np.int8)  # (an odd channel count: zero-padded)
    packed = int4.pack(odd, 1, first="high", pad_odd=True)
    assert packed.tolist() == [[0x1E, 0x70]] and int4.unpack(packed, 1, first="high", count=3).tolist() == odd.tolist()


def test_hawq_frontend_nets_match_models():
    """The HAWQ frontend's topology table (frontends/hawq.py NETS) describes the networks models/resnet.py builds:
    the same convolutions (stride, padding) in the same order, the same downsample paths, stem and max pool."""
    from qcompile.frontends.hawq import NETS, _Hawq

    for net, arch in NETS.items():
        m = build_model(net)
        walk = _Hawq.__new__(_Hawq)
        walk.arch = arch
        units = list(walk.blocks())
        blocks = [blk for stage in m.stages() for blk in stage]
        assert len(units) == len(blocks), net
        for (u, convs, down), blk in zip(units, blocks):
            mods = [getattr(blk, c) for c in ("conv1", "conv2", "conv3") if hasattr(blk, c)]
            assert [(c.stride, c.padding) for c in convs] == [(m_.stride[0], m_.padding[0]) for m_ in mods], (net, u)
            assert (down is None) == (blk.downsample is None), (net, u)
            if down is not None:
                assert (down.stride, down.padding) == (blk.downsample[0].stride[0], blk.downsample[0].padding[0])
        assert (arch.stem_kernel, arch.stem_stride) == (m.conv1.kernel_size[0], m.conv1.stride[0]), net
        assert m.conv1.padding[0] == arch.stem_kernel // 2 and arch.maxpool == (m.maxpool is not None), net
        assert arch.input_size == MODELS[net].input_shape[-1], net


# --------------------------------------------------------------------------- cli
def test_cli(tmp_path, capsys):
    from qcompile.models.cli import main
    out, xin, yout = tmp_path / "t.onnx", tmp_path / "x.npy", tmp_path / "y.npy"
    rc = main(["resnet_tiny", "--bits", "4", "--format", "onnx", "-o", str(out), "--input-size", "16",
               "--save-input", str(xin), "--save-output", str(yout)])
    assert rc == 0 and out.exists() and xin.exists()
    assert "seeded random N(0,1) calibration batch" in capsys.readouterr().out
    calib = tmp_path / "c.npy"
    np.save(calib, _data(4, TINY_SHAPE, 4).numpy())
    cfg = tmp_path / "bits.json"
    cfg.write_text(json.dumps({"layer2.0.conv2": [4, 8]}))
    assert main(["resnet_tiny", "--bits", str(cfg), "--format", "hawq", "--calibrate", str(calib),
                 "-o", str(tmp_path / "t.pth"), "-q"]) == 0
    assert torch.load(tmp_path / "t.pth", weights_only=True)["bits"]["stage2.unit1.quant_convbn2"] == 4
    for bad in (["resnet19"], ["resnet_tiny", "--bits", "3"], ["resnet_tiny", "--format", "tflite"],
                ["resnet_tiny", "--bits", "4", "--residual-bits", "2"]):
        assert main(bad + ["-q", "-o", str(tmp_path / "bad.onnx")]) == 2
    err = capsys.readouterr().err
    assert "resnet19" in err and "'3'" in err and "tflite" in err


def test_cli_input_size(tmp_path, capsys):
    """--input-size N or HxW (height first): the exported input, the saved sample and the calibration check follow
    it; a spelling that is neither, a non-square HAWQ checkpoint and a size the network cannot take are refused with
    one line each."""
    from qcompile.models.cli import _input_hw, main

    assert _input_hw("12") == (12, 12) and _input_hw("24x40") == (24, 40) and _input_hw(" 24X40 ") == (24, 40)
    out, xin = tmp_path / "ns.onnx", tmp_path / "x.npy"
    assert main(["resnet_tiny", "--input-size", "12x20", "-o", str(out), "--save-input", str(xin), "-q"]) == 0
    dims = [d.dim_value for d in onnx.load(str(out)).graph.input[0].type.tensor_type.shape.dim]
    assert dims == [1, 3, 12, 20] and np.load(xin).shape == (1, 3, 12, 20)
    calib = tmp_path / "c.npy"
    np.save(calib, _data(4, (1, 3, 12, 20), 4).numpy())
    assert main(["vgg_tiny", "--input-size", "64x128", "-o", str(tmp_path / "v.onnx"), "-q"]) == 0
    bad = [["resnet_tiny", "--input-size", s] for s in ("0x5", "12x", "axb", "1x2x3", "-4")]
    bad += [["resnet_tiny", "--input-size", "12x20", "--format", "hawq"],
            ["resnet_tiny", "--calibrate", str(calib), "--format", "hawq"],
            ["resnet_tiny", "--calibrate", str(calib), "--input-size", "20x12"],
            ["vgg_tiny", "--input-size", "64x96"], ["densenet_tiny", "--input-size", "1"]]
    for argv in bad:
        assert main(argv + ["-q", "-o", str(tmp_path / ("bad.pth" if "hawq" in argv else "bad.onnx"))]) == 2, argv
    err = capsys.readouterr().err
    assert err.count("--input-size must be N (a positive integer, N x N) or HxW") == 4
    assert "--input-size must be a positive integer, got -4" in err
    assert err.count("--format hawq records one input size (H = W)") == 2
    assert "has shape (4, 3, 12, 20); the model takes (N, 3, 20, 12)" in err
    assert "vgg_tiny --input-size: input 64x96 gives a 2x3 feature map, not a multiple of" in err
    assert "densenet_tiny --input-size: input 1x1 is too small" in err
    assert not (tmp_path / "bad.onnx").exists() and not (tmp_path / "bad.pth").exists()


def test_input_hw_check_on_meta_device(monkeypatch):
    """``qmodel``'s input-size check (``_check_input_hw``) runs the network on the meta device: every conv sees meta
    tensors (no arithmetic), the model's own weights stay where they are, and a size the network cannot take is still
    refused (densenet_tiny at 1x1) while its default size and vgg16's 224x224 pass."""
    from qcompile.models.cli import _check_input_hw, _Fail

    seen = []
    conv2d = torch.nn.functional.conv2d
    monkeypatch.setattr(torch.nn.functional, "conv2d", lambda x, *a, **k: (seen.append(x.device.type),
                                                                            conv2d(x, *a, **k))[1])
    for net in ("densenet_tiny", "vgg16"):
        model = build_model(net)
        _check_input_hw(net, model, MODELS[net].input_shape)
        assert {p.device.type for p in model.parameters()} == {"cpu"}
    assert seen and set(seen) == {"meta"}
    with pytest.raises(_Fail, match="densenet_tiny --input-size: input 1x1 is too small"):
        _check_input_hw("densenet_tiny", build_model("densenet_tiny"), (1, 3, 1, 1))


@pytest.mark.parametrize("net, files, key", [
    ("resnet_tiny", ("digits_int8.onnx", "digits_int4.onnx", "digits_mixed.onnx", "digits_int8.hawq.pth"),
     "int4_fakequant"),
    ("mobilenet_v2_tiny", ("digits_mobilenet_v2_int8.onnx", "digits_mobilenet_v2_int4.onnx"), "int4_onnx"),
    ("resnext_tiny", ("digits_resnext_int8.onnx", "digits_resnext_int4.onnx", "digits_resnext_mixed.onnx"),
     "mixed_fakequant")])
def test_train_digits_smoke(tmp_path, net, files, key):
    pytest.importorskip("sklearn")
    spec = importlib.util.spec_from_file_location("train_digits", os.path.join(ROOT, "scripts", "train_digits.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["-o", str(tmp_path), "--epochs", "1", "--no-pt2", "--calib", "32", "--net", net]) == 0
    for f in ("x_test.npy", "y_test.npy", "calib.npy", f"{net}_digits.pt", "accuracy.json", *files):
        assert (tmp_path / f).exists(), f
    acc = json.loads((tmp_path / "accuracy.json").read_text())
    assert np.load(tmp_path / "x_test.npy").shape[1:] == (1, 8, 8) and 0 <= acc[key] <= 100 and acc["net"] == net


# --------------------------------------------------------------------------- digits
@pytest.mark.parametrize("net", ["resnet_tiny", "mobilenet_v2_tiny", "resnext_tiny"])
def test_digits_training_deterministic(net):
    """Two trainings of a net from the same seed give the same weights bit for bit, another seed others, and the
    split is 1437 / 360 images."""
    pytest.importorskip("sklearn")
    from qcompile.models.digits import train

    (m1, d1), (m2, d2) = train(epochs=1, net=net), train(epochs=1, net=net)
    s1, s2 = m1.state_dict(), m2.state_dict()
    assert s1.keys() == s2.keys() and all(torch.equal(s1[k], s2[k]) for k in s1)
    assert d1["x_train"].shape == (1437, 1, 8, 8) and d1["x_test"].shape == (360, 1, 8, 8)
    assert np.array_equal(d1["calib"], d2["calib"]) and d1["calib"].shape == (256, 1, 8, 8)
    m3, _ = train(epochs=1, seed=1, net=net)
    last = [k for k in s1 if k.endswith("weight")][-1]  # the classifier's
    assert not torch.equal(m3.state_dict()[last], s1[last])


def test_digits_nets_registry():
    """qmodel's torch-free list of digits nets (--help, -o's default) is the registry's; the MobileNetV2 digits
    variant is mobilenet_v2_tiny at stem stride 1 (8x8 ends at 2x2, as resnet_tiny's), the rest the example nets."""
    from qcompile.models.cli import DIGITS_NETS, ORT_QUANTIZED
    from qcompile.models.digits import NETS

    assert DIGITS_NETS == {n.name: n.stem for n in NETS.values()}
    for n in NETS.values():
        assert (n.quantizer == "onnxruntime") == (n.name in ORT_QUANTIZED)
        assert n.bits == (("8", "4") if n.quantizer == "onnxruntime" else ("8", "4", "mixed"))
        model = n.build(num_classes=10, in_ch=1).eval()
        feats = []
        last = [m for m in model.modules() if isinstance(m, torch.nn.Conv2d)][-1]
        last.register_forward_hook(lambda m, i, o: feats.append(o.shape))
        with torch.no_grad():
            assert model(torch.zeros(2, 1, 8, 8)).shape == (2, 10)
        assert feats[0][2:] == (2, 2), n.name


def test_qmodel_digits_end_to_end(tmp_path, capsys):
    """qmodel digits -> qcompile (batch 360) -> the .so's top-1 accuracy on the saved test images and labels, as the
    README's main job runs it (3 epochs here): the .so classifies the images as PyTorch's simulation of the same
    quantized model does, far above chance."""
    pytest.importorskip("sklearn")
    from qcompile.cli import qcompile_main
    from qcompile.models.cli import main
    from qcompile.runtime import Module

    onnx_path, x, y, fq, so = (str(tmp_path / f) for f in ("d.onnx", "x.npy", "y.npy", "fq.npy", "d.so"))
    assert main(["digits", "--bits", "8", "--epochs", "3", "-o", onnx_path, "--save-input", x,
                 "--save-labels", y, "--save-output", fq]) == 0
    said = capsys.readouterr().out
    assert "float model (PyTorch) test accuracy:" in said and "360 images" in said
    images, labels = np.load(x), np.load(y)
    assert images.shape == (360, 1, 8, 8) and images.dtype == np.float32 and 0 <= images.min() <= images.max() <= 1
    assert labels.shape == (360,) and labels.dtype == np.int64 and set(labels.tolist()) == set(range(10))
    assert qcompile_main([onnx_path, "-o", so, "--batch", "360"]) == 0
    logits = Module(so)(images)
    top1 = logits.argmax(1)
    assert (top1 != np.load(fq).argmax(1)).sum() <= 3
    assert (top1 == labels).mean() > 0.5, "3 epochs reach ~75% (chance is 10%)"


def test_qmodel_digits_usage_errors(tmp_path, capsys):
    from qcompile.models.cli import _parser, main
    from qcompile.models.digits import EPOCHS

    assert _parser().get_default("epochs") == EPOCHS  # (the CLI names the default without importing torch)

    for bad in (["resnet_tiny", "--save-labels", "y.npy"], ["digits", "--in-ch", "3"], ["digits", "--epochs", "0"],
                ["digits", "--input-size", "16"], ["resnext_tiny", "--net", "resnext_tiny"],
                ["digits", "--net", "vgg"], ["digits", "--net", "mobilenet_v2_tiny", "--bits", "mixed"],
                ["digits", "--net", "mobilenet_v2_tiny", "--save-output", str(tmp_path / "fq.npy")]):
        assert main(bad + ["-q", "-o", str(tmp_path / "bad.onnx")]) == 2
    err = capsys.readouterr().err
    assert "--save-labels needs the digits model" in err and "--epochs must be at least 1" in err
    assert "--net chooses the network of the digits model" in err and "unknown --net 'vgg'" in err
    assert "mobilenet_v2_tiny is quantized by onnxruntime's quantize_static" in err
    assert "--save-output needs the fake-quant model" in err
    assert not (tmp_path / "bad.onnx").exists()


def _digits_accuracy_script():
    spec = importlib.util.spec_from_file_location("digits_accuracy", os.path.join(ROOT, "scripts", "digits_accuracy.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_digits_new_nets_end_to_end(tmp_path, capsys):
    """scripts/digits_accuracy.py's run for the MobileNetV2-style net (onnxruntime's quantize_static) and the
    ResNeXt-style net (qcompile's PTQ, grouped 3x3), INT8 and INT4, on a slice: 2 epochs of training, compiled for
    llvm at batch 40 and run on the first 40 test images. The .so classifies them as its reference does (PyTorch's
    fake-quant, onnxruntime's QDQ graph as written), far above chance; the table has a row per net."""
    pytest.importorskip("sklearn")
    pytest.importorskip("onnxruntime")
    mod = _digits_accuracy_script()
    mod.main(["run", "-o", str(tmp_path), "--nets", "mobilenet_v2_tiny", "resnext_tiny", "--epochs", "2",
              "--bits", "8", "4", "--test-images", "40"])
    res = json.loads((tmp_path / "digits_accuracy.json").read_text())
    assert res["n_test"] == 40 and [n["net"] for n in res["nets"]] == ["mobilenet_v2_tiny", "resnext_tiny"]
    for n in res["nets"]:
        assert [r["bits"] for r in n["rows"]] == ["8", "4"] and n["float"] > 25, n
        for r in n["rows"]:
            assert r["disagree"] <= 1 and r["accuracy"] > 25, (n["net"], r)
        assert (tmp_path / f"{'digits_mobilenet_v2' if n['net'] == 'mobilenet_v2_tiny' else 'digits_resnext'}"
                           f"_int4.so").exists()
    block = mod.table(tmp_path / "digits_accuracy.json")
    assert "| mobilenet_v2_tiny | onnxruntime `quantize_static` |" in block and "| resnext_tiny | qcompile's" in block
    assert "-o {}".format(tmp_path) in capsys.readouterr().out


def test_digits_table_reproduces_the_docs():
    """README's and BENCHMARKS' digits tables are what scripts/digits_accuracy.py writes from its results file."""
    block = _digits_accuracy_script().table(os.path.join(ROOT, "docs", "bench", "digits_accuracy.json"))
    for doc in ("README.md", os.path.join("docs", "BENCHMARKS.md")):
        text = open(os.path.join(ROOT, doc)).read()
        assert f"<!-- table:digits -->\n{block}<!-- /table:digits -->" in text, f"{doc}: digits table is stale"
