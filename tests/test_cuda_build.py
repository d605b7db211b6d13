"""The CUDA build path on a machine without a GPU: compiled GPU code embedded, CUDA graph, --emit-cuda."""
import os

import pytest

from qcompile.driver import CompileOptions, compile_model, emit_cuda

pytestmark = pytest.mark.nvcc


@pytest.fixture(scope="module")
def tiny_onnx(tmp_path_factory):
    import torch

    from qcompile.models.export_onnx import export_onnx
    from qcompile.models.quantize import quantize_model
    from qcompile.models.resnet import build_model

    qm = quantize_model(build_model("resnet_tiny"), torch.randn(8, 3, 16, 16), bits=4)
    p = str(tmp_path_factory.mktemp("cuda") / "t4.onnx")
    export_onnx(qm, p, (2, 3, 16, 16), batch=2)
    return p


@pytest.mark.parametrize("arch", ["sm_90", "sm_75"])
def test_cuda_build_embeds_gpu_code(tiny_onnx, tmp_path, arch):
    lines = []
    res = compile_model(tiny_onnx, CompileOptions(target="cuda", arch=arch, layout="NHWC"), log=lines.append)
    # (no tuning record covers the tiny model's shapes: compile says so, and what the layers took instead)
    note = [ln for ln in lines if "have no tuning record" in ln]
    assert len(note) == 1 and f"the {arch} defaults" in note[0], lines
    so = str(tmp_path / f"m_{arch}.so")
    res.export(so)
    data = open(so, "rb").read()
    assert b"__global__" not in data, "the .so holds CUDA source; loading it would need a compiler"
    # the whole forward pass is replayed as one CUDA graph
    assert "vm.builtin.cuda_graph.run_or_capture" in res.executable.as_text()
    from qcompile.cuda_tools import cuobjdump, find_tool

    if find_tool("cuobjdump"):
        elf = cuobjdump(so, "--list-elf")  # (warpgroup-MMA kernels -- sm_90's untuned default -- build as sm_90a)
        assert f"{arch}.cubin" in elf or (arch == "sm_90" and "sm_90a.cubin" in elf), elf
    kernels = emit_cuda(res, str(tmp_path / "emit"), log=lambda s: None)
    assert kernels
    for k, stem in kernels:
        ptx = open(tmp_path / "emit" / f"{stem}.ptx").read()
        assert f".entry {k}" in ptx and f".target sm_{arch[3:]}" in ptx
        assert os.path.getsize(tmp_path / "emit" / f"{stem}.cu") > 0
