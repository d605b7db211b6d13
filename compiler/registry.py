"""Registries of what qcompile supports, as plain dicts of frozen dataclasses (they feed the CLI's choices)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BitScheme:
    name: str
    doc: str


BIT_SCHEMES = {
    "8": BitScheme("8", "INT8 weights and activations"),
    "4": BitScheme("4", "INT4 weights and activations; the input quantize, the first conv and the final dense stay INT8"),
    "mixed": BitScheme("mixed", "per-layer 4/8 bits (HAWQ-style); the model says which layer has which"),
}


@dataclass(frozen=True)
class Layout:
    name: str
    kernel: str
    doc: str


LAYOUTS = {
    "NCHW": Layout("NCHW", "OIHW", "PyTorch/ONNX order; reference layout on CPU"),
    "NHWC": Layout("NHWC", "OHWI", "channels last; implicit-GEMM tensor-core convolutions"),
    "HWNC": Layout("HWNC", "HWOI", "batch next to channels; direct tensor-core convolutions over N and C"),
}


@dataclass(frozen=True)
class ModelFormat:
    name: str
    suffixes: tuple
    doc: str


FORMATS = {
    "onnx": ModelFormat("onnx", (".onnx",), "ONNX QDQ (onnxruntime quantize_static, qmodel), or a float ONNX model for PTQ"),
    # (an .onnx file too, told by its ops: frontends/onnx_qop.py rewrites it into the QDQ format)
    "onnx-qop": ModelFormat("onnx-qop", (), "ONNX QOperator (QLinearConv, QGemm, ...: quantize_static with "
                                            "QuantFormat.QOperator, the ONNX model zoo's int8 models)"),
    "pt2": ModelFormat("pt2", (".pt2",), "torch.export program in PT2E form (quantized_decomposed ops)"),
    "hawq": ModelFormat("hawq", (".pth", ".pt", ".ckpt", ".tar"), "HAWQ-V3 integer checkpoint (needs --net)"),
}


@dataclass(frozen=True)
class TargetKind:
    name: str
    default_layout: str
    doc: str


TARGETS = {
    "llvm": TargetKind("llvm", "NHWC", "CPU through LLVM: int8 kernels on x86 (AVX2, AVX-VNNI, AVX-512 VNNI)"),
    "cuda": TargetKind("cuda", "NHWC", "NVIDIA GPU; --arch sm_75|sm_80|sm_86|sm_89|sm_90"),
}

CUDA_ARCHS = ("sm_75", "sm_80", "sm_86", "sm_89", "sm_90")


def format_of(path: str) -> str:
    """The file format by suffix (ValueError: none). ``.onnx`` is "onnx"; the frontend tells its QOperator variant
    ("onnx-qop", no suffix of its own) by the model's ops."""
    low = path.lower()
    for f in FORMATS.values():
        if low.endswith(f.suffixes):
            return f.name
    raise ValueError(path)
