"""qcompile.models: torchvision-shaped ResNets, post-training quantization and exporters.

    from qcompile.models import build_model, quantize_model
    qm = quantize_model(build_model("resnet18"), calib_nchw, bits=4, arch="resnet18")
    from qcompile.models.export_onnx import export_onnx      # ONNX QDQ (opset 13 / 21)
    from qcompile.models.export_pt2 import export_pt2        # torchao PT2E program (.pt2)
    from qcompile.models.export_hawq import export_hawq      # HAWQ-V3 checkpoint dicts

The exporters are separate modules so that importing this package does not import
onnx / torchao.
"""
from .quantize import (ActQuant, CalibConfig, LayerBits, QBlock, QLayer, QuantizedModel, bit_config,
                       quant_points, quantize_model)
from .resnet import MODELS, ModelSpec, build_model, get_spec, resnet18, resnet50, resnet_tiny

__all__ = [
    "MODELS", "ModelSpec", "build_model", "get_spec", "resnet18", "resnet50", "resnet_tiny",
    "ActQuant", "CalibConfig", "LayerBits", "QBlock", "QLayer", "QuantizedModel", "bit_config",
    "quant_points", "quantize_model",
]
