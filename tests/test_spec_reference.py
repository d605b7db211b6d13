"""Compiled models against the ONNX specification, layer by layer (tests/spec_reference.py owns the semantics).

For every quantized activation of a model, the graph is cut after it (its DequantizeLinear becomes the output),
compiled for llvm (every layer of the 8-bit models; every third layer and the last of the 4-bit and mixed ones),
run on fresh random input, and the integers it computes (recovered from the dequantized output)
are compared with the specification's: equal on at least 99.9% of the elements, never more than one step apart.
The one-step allowance covers rounding ties only: qcompile rounds half up in fixed point with 31-bit multipliers and
quantizes its float32 input in float32; the specification rounds half to even in exact arithmetic (float64 here).
The models have non-zero zero points (onnxruntime's asymmetric uint8 activations) and 4-bit / mixed layers.
"""
import zlib

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from spec_reference import SpecReference, quantized_outputs

EXACT_FRACTION = 0.999


def _model(kind: str, tmp: str) -> str:
    import torch

    from qcompile.models.export_onnx import export_onnx
    from qcompile.models.quantize import quantize_model
    from qcompile.models.resnet import build_model

    path = f"{tmp}/{kind}.onnx"
    net = build_model("resnet_tiny", num_classes=10, seed=5)
    calib = torch.randn(16, 3, 16, 16, generator=torch.Generator().manual_seed(6))
    if kind == "ort_u8":  # onnxruntime's own quantizer: asymmetric uint8 activations (non-zero zero points)
        from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

        fp = f"{tmp}/float.onnx"
        net.eval()
        torch.onnx.export(net, torch.randn(2, 3, 16, 16), fp, input_names=["x"], output_names=["y"], opset_version=13,
                          dynamo=False)

        class Reader(CalibrationDataReader):
            def __init__(self):
                self.it = iter([{"x": calib[i:i + 2].numpy()} for i in range(0, 16, 2)])

            def get_next(self):
                return next(self.it, None)

        quantize_static(fp, path, Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
                        activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8)
        return path
    bits = {"int8": 8, "int4": 4, "mixed": "mixed"}[kind]
    export_onnx(quantize_model(net, calib, bits=bits), path, (2, 3, 16, 16), batch=2)
    return path


def _cut(path: str, tensor: str, out_path: str) -> tuple[str, float, int]:
    """The model up to ``tensor`` (a QuantizeLinear output), with the DequantizeLinear that reads it as its output."""
    m = onnx.load(path)
    dq = next(n for n in m.graph.node if n.op_type == "DequantizeLinear" and n.input[0] == tensor)
    init = {t.name: numpy_helper.to_array(t) for t in m.graph.initializer}
    scale = float(init[dq.input[1]])
    zp = int(init[dq.input[2]]) if len(dq.input) > 2 and dq.input[2] else 0
    inp = [i.name for i in m.graph.input if i.name not in init][0]
    onnx.utils.extract_model(path, out_path, [inp], [dq.output[0]])
    return out_path, scale, zp


@pytest.mark.parametrize("kind", ["int8", "int4", "mixed", "ort_u8"])
def test_every_layer_matches_the_onnx_spec(kind, tmp_path_factory):
    from qcompile.driver import CompileOptions, compile_model
    from tvm import relax
    import tvm

    tmp = str(tmp_path_factory.mktemp(kind))
    path = _model(kind, tmp)
    model = onnx.load(path)
    if kind == "ort_u8":
        zps = [numpy_helper.to_array(t) for t in model.graph.initializer if t.name.endswith("zero_point")]
        assert any(np.any(z != 0) for z in zps if z.dtype == np.uint8), "expected non-zero activation zero points"
    x = np.random.default_rng(zlib.crc32(kind.encode())).standard_normal((2, 3, 16, 16)).astype("float32")
    ref = SpecReference(model)(x)
    layers = quantized_outputs(model)
    assert len(layers) >= 8
    # every layer of the 8-bit models; every third layer and the last of the 4-bit ones (each cut is one compile)
    picked = layers if kind in ("int8", "ort_u8") else layers[2::3] + layers[-1:]
    checked = 0
    for i, t in enumerate(layers):
        if t not in picked:
            continue
        if not any(n.op_type == "DequantizeLinear" and n.input[0] == t for n in model.graph.node):
            continue
        sub, scale, zp = _cut(path, t, f"{tmp}/cut{i}.onnx")
        if not any(n.op_type in ("Conv", "Gemm", "MatMul") for n in onnx.load(sub).graph.node):
            continue  # the input quantize alone: no layer to compile
        checked += 1
        res = compile_model(sub, CompileOptions(layout="NHWC"), log=lambda s: None)
        vm = relax.VirtualMachine(res.executable, tvm.cpu())
        y = vm["main"](tvm.runtime.tensor(x)).numpy()
        got = np.rint(y.astype(np.float64) / scale).astype(np.int64) + zp
        want = ref[t].q.reshape(got.shape) if ref[t].q.size == got.size else None
        assert want is not None, f"{kind} {t}: output shape {got.shape} vs the spec's {ref[t].q.shape}"
        diff = np.abs(got - want)
        assert diff.max() <= 1, f"{kind} layer {t}: differs from the ONNX spec by {diff.max()} steps"
        exact = np.mean(diff == 0)
        assert exact >= EXACT_FRACTION, f"{kind} layer {t}: only {exact:.4%} of the elements equal the ONNX spec"
        assert len(np.unique(want)) > 2, f"{kind} layer {t}: degenerate test data"
    assert checked >= (8 if picked is layers else 4)
