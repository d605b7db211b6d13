"""qcompile.models: torchvision-shaped CNNs (ResNet, ResNeXt, MobileNetV2/V3, EfficientNet, DenseNet, VGG),
post-training quantization, exporters and the digits example.

    from qcompile.models import build_model, quantize_model
    qm = quantize_model(build_model("resnet18"), calib_nchw, bits=4, arch="resnet18")
    from qcompile.models.export_onnx import export_onnx      # ONNX QDQ (opset 13 / 21)
    from qcompile.models.export_pt2 import export_pt2        # torchao PT2E program (.pt2)
    from qcompile.models.export_hawq import export_hawq      # HAWQ-V3 checkpoint dicts
    from qcompile.models.digits import train                 # resnet_tiny trained on scikit-learn's digits

Everything here needs PyTorch (``pip install 'qcompile[torch]'``). The names below are imported on first use, so
importing this package (``qmodel --help``) imports neither torch nor onnx nor torchao.
"""
import importlib

_WHERE = {
    **dict.fromkeys(("ActQuant", "CalibConfig", "LayerBits", "QBlock", "QLayer", "QuantizedModel", "bit_config",
                     "quant_points", "quantize_model"), "quantize"),
    **dict.fromkeys(("MODELS", "ModelSpec", "build_model", "get_spec", "resnet18", "resnet50", "resnet_tiny",
                     "resnext50_32x4d", "resnext_tiny"), "resnet"),
    **dict.fromkeys(("vgg16", "vgg_tiny"), "vgg"),
}
__all__ = sorted(_WHERE)


def __getattr__(name):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        module = importlib.import_module(f".{_WHERE[name]}", __name__)
    except ModuleNotFoundError as e:
        if e.name != "torch":
            raise
        raise ModuleNotFoundError("qcompile.models needs PyTorch: pip install 'qcompile[torch]'",
                                  name="torch") from None
    value = getattr(module, name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_WHERE))
