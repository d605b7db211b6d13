"""GPU tier (``pytest -m gpu``): compiled models run on this host's CUDA GPU, bit for bit equal to the llvm build.

Skipped where the host has no CUDA GPU (tests/conftest.py); needs nvcc for the build. The arch is the newest one
qcompile targets that the device runs natively (sm_90a kernels only on compute capability 9.0; a newer GPU runs the
sm_89 build's PTX).
"""

import numpy as np
import pytest

from conftest import gpu_compute_capability

pytestmark = [pytest.mark.gpu, pytest.mark.nvcc]


def _arch() -> str:
    from qcompile.registry import CUDA_ARCHS

    cc = gpu_compute_capability()
    if cc == 90:
        return "sm_90"
    fits = [a for a in CUDA_ARCHS if a != "sm_90" and int(a[3:]) <= cc]
    if not fits:
        pytest.skip(f"compute capability {cc} is older than every arch qcompile targets ({', '.join(CUDA_ARCHS)})")
    return fits[-1]


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    import torch

    from qcompile.models.export_onnx import export_onnx
    from qcompile.models.quantize import quantize_model
    from qcompile.models.resnet import build_model

    d = tmp_path_factory.mktemp("gpu")
    paths = {}
    for bits in ("8", "4"):
        qm = quantize_model(build_model("resnet_tiny", seed=3), torch.randn(8, 3, 16, 16), bits=int(bits))
        paths[bits] = str(d / f"tiny_{bits}.onnx")
        export_onnx(qm, paths[bits], (4, 3, 16, 16), batch=4)
    return paths


@pytest.mark.parametrize("bits,layout", [("8", "NHWC"), ("4", "NHWC"), ("8", "HWNC"), ("4", "HWNC")])
def test_gpu_equals_llvm(tiny_models, tmp_path, bits, layout):
    from qcompile.driver import CompileOptions, compile_model
    from qcompile.runtime import Module

    x = np.random.default_rng(int(bits) * 7 + len(layout)).standard_normal((4, 3, 16, 16)).astype("float32")
    cpu_so, gpu_so = str(tmp_path / "cpu.so"), str(tmp_path / "gpu.so")
    compile_model(tiny_models[bits], CompileOptions(layout=layout), log=lambda s: None).export(cpu_so)
    opts = CompileOptions(target="cuda", arch=_arch(), layout=layout)
    compile_model(tiny_models[bits], opts, log=lambda s: None).export(gpu_so)
    want = Module(cpu_so)(x)
    got = Module(gpu_so, "cuda")(x)
    assert len(np.unique(want)) > 5
    assert np.array_equal(got, want), f"GPU output differs from the llvm build in {np.sum(got != want)} elements"
