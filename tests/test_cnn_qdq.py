"""CNNs beyond ResNet in ONNX QDQ, as onnxruntime's ``quantize_static`` writes them: depthwise and grouped conv,
ReLU6 (``Clip`` with ``Constant`` bounds), inverted residuals -- compiled for llvm.

* bit-exact: the compiled module equals the NumPy integer reference (``qcompile.reference``) of its integer graph;
* against onnxruntime with graph optimizations off (each DequantizeLinear / float op / QuantizeLinear evaluated as
  written: the QDQ format's defining semantics) within ONE output quantization step, and the same top-1. The step
  is the rounding convention: onnxruntime computes the float ops in float32 (a conv sums its products in float32
  order-dependently) and rounds half to even; qcompile sums exactly in int32 and rounds half up in fixed point with
  31-bit multipliers. The two differ only where a value lands within float32 rounding of a tie, by one step;
* the hand-written model (``cnn_fixtures.qdq_grouped_clip_model``: zero points, stride, dilation, cutting clips)
  layer for layer against the ONNX specification (``tests/spec_reference.py``).
"""
import numpy as np
import onnx
import pytest
import tvm
from onnx import numpy_helper
from tvm import relax

import cnn_fixtures as F
from qcompile.driver import CompileOptions, compile_model
from qcompile.errors import QCompileError
from qcompile.reference import Reference
from spec_reference import SpecReference


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return str(tmp_path_factory.mktemp("cnn_qdq"))


def _quiet(_):
    pass


def _run(res, x):
    return relax.VirtualMachine(res.executable, tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy()


def _output_step(path: str) -> float:
    m = onnx.load(path)
    last_dq = [n for n in m.graph.node if n.op_type == "DequantizeLinear"][-1]
    return float(next(numpy_helper.to_array(t) for t in m.graph.initializer if t.name == last_dq.input[1]))


def _convs(res):
    """(groups, input channels) of every conv2d of the compiled integer graph."""
    out = []
    for blk in res.integer_mod["main"].body.blocks:
        for b in blk.bindings:
            if isinstance(b.value, relax.Call) and b.value.op.name == "relax.nn.conv2d":
                out.append(int(b.value.attrs.groups))
    return out


@pytest.mark.parametrize("name,fmt,layout", [
    ("mobilenet_v2_mini", "qdq", "NHWC"),       # Clip dropped by the quantizer; its Constant bounds left behind
    ("mobilenet_v2_mini", "qdq_keep", "NCHW"),  # every ReLU6 kept: DQ -> Clip(Constant, Constant) -> Q
    ("resnext_mini", "qdq", "HWNC"),
    ("resnext_mini", "qdq_keep", "NCHW"),
])
def test_ort_quantized_cnn(folder, name, fmt, layout):
    path = F.onnx_model(name, fmt, folder)
    model = onnx.load(path)
    ops = {n.op_type for n in model.graph.node}
    assert "Constant" in ops or name != "mobilenet_v2_mini"
    assert ("Clip" in ops or "Relu" in ops) == (fmt == "qdq_keep")
    res = compile_model(path, CompileOptions(layout=layout, batch=2), log=_quiet)
    groups = _convs(res)
    assert (max(groups) == 32) if name == "resnext_mini" else any(g in (16, 48, 96) for g in groups), groups
    step = _output_step(path)
    ref = Reference(res.integer_mod)
    for seed in range(2):  # fresh inputs each time
        x = F.fresh_input(100 + seed)
        y = _run(res, x)
        assert np.array_equal(y, ref(x)), "compiled module differs from the NumPy integer reference"
        y_ort = F.run_ort(path, x)
        err = np.abs(y.astype(np.float64) - y_ort)
        assert err.max() <= step * (1 + 1e-5), f"{err.max() / step:.2f} output steps from onnxruntime"
        assert np.array_equal(y.argmax(1), y_ort.argmax(1)), "top-1 disagrees with onnxruntime"
        assert len(np.unique(y)) > 5, "degenerate output"


@pytest.mark.parametrize("layout", ["NCHW", "NHWC", "HWNC"])
def test_grouped_depthwise_clip_against_spec(folder, layout):
    """Every quantized tensor of the hand-written model (depthwise s2, grouped with dilation, ReLU6 and a clip whose
    bounds cut) against the ONNX specification: the output integers equal it but for rounding ties (at most one
    step, on at most 0.1% of the elements), and the module equals the NumPy integer reference bit for bit."""
    path = F.qdq_grouped_clip_model(f"{folder}/gc_{layout}.onnx")
    res = compile_model(path, CompileOptions(layout=layout, batch=2), log=_quiet)
    assert sorted(_convs(res)) == [4, 8]
    ref = Reference(res.integer_mod)
    spec = SpecReference(onnx.load(path))
    for seed in range(3):
        x = F.fresh_input(200 + seed, (2, 8, 9, 9))
        y = _run(res, x)
        assert np.array_equal(y, ref(x))
        want = spec(x)["out_q"].q
        got = np.rint(y.astype(np.float64) / 0.01).astype(np.int64) + 50
        diff = np.abs(got - want)
        assert diff.max() <= 1 and np.mean(diff == 0) >= 0.999, (diff.max(), np.mean(diff == 0))
        # the clips cut: ReLU6's 0 and the last clip's -0.3 / 1.0 are reached
        assert np.any(got == 20) and np.any(got == 150) and len(np.unique(got)) > 20
        assert np.any(spec(x)["a1_q"].q == 20)


def test_relu6_bound_reaches_the_requantize(folder):
    """A ReLU6 whose upper bound lies inside the output range becomes the requantize's clip: the depthwise conv's
    output tensor of the hand-written model is clipped at 20 + round(6 / 0.04) = 170 (and at 20, the zero)."""
    path = F.qdq_grouped_clip_model(f"{folder}/gc_cut.onnx")
    m = onnx.load(path)
    out = "a1_dq"
    onnx.utils.extract_model(path, f"{folder}/gc_cut1.onnx", ["x"], [out])
    res = compile_model(f"{folder}/gc_cut1.onnx", CompileOptions(batch=2), log=_quiet)
    x = F.fresh_input(300, (2, 8, 9, 9)) * 3
    got = np.rint(_run(res, x).astype(np.float64) / 0.04).astype(np.int64) + 20
    want = SpecReference(m)(x)["a1_q"].q
    assert got.max() == 170 and got.min() == 20 and np.mean(got == 170) > 0.05
    assert np.abs(got - want).max() <= 1


def test_clip_with_a_computed_bound_is_one_clear_error(folder):
    """A Clip bound computed by the graph (not a constant) names the node and the input."""
    path = F.qdq_grouped_clip_model(f"{folder}/gc_bad.onnx")
    m = onnx.load(path)
    clip = next(n for n in m.graph.node if n.name == "clip")
    clip.input[2] = "a1_dq"  # a tensor, not a constant
    onnx.save(m, f"{folder}/gc_bad.onnx")
    with pytest.raises(QCompileError, match=r"node 'clip' \(Clip\): input 'a1_dq' must be a constant"):
        compile_model(f"{folder}/gc_bad.onnx", CompileOptions(batch=2), log=_quiet)


@pytest.mark.nvcc
def test_grouped_and_depthwise_compile_for_cuda(folder):
    """On cuda the depthwise convs run the CUDA-core depthwise kernel (no tensor-core strategy takes groups > 1); the
    1x1 convs keep their tensor-core kernels; nothing is left to TVM's generic kernels."""
    path = F.onnx_model("mobilenet_v2_mini", "qdq", folder)
    res = compile_model(path, CompileOptions(target="cuda", batch=2), log=_quiet)
    kernels = {lay.name: lay.kernel for lay in res.layers}
    dw = [n for n in kernels if any(f"features_{i}_conv_conv_{j}_" in n for i, j in ((1, 0), (2, 1), (3, 1)))]
    assert len(dw) == 3 and all(kernels[n] == "depthwise" for n in dw), kernels
    assert "generic" not in kernels.values(), kernels
    assert sum(k.startswith("implicit_gemm") for k in kernels.values()) >= 6, kernels
