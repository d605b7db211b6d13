"""ONNX QOperator models (onnxruntime's ``quantize_static`` with ``QuantFormat.QOperator``): QLinearConv, QGemm,
QLinearMatMul, QLinearAdd, QLinearMul, QLinearConcat, QLinearSigmoid, QLinearLeakyRelu, QLinearGlobalAveragePool /
QLinearAveragePool, a float HardSwish between DequantizeLinear and QuantizeLinear, and MaxPool / Reshape / Flatten on
quantized tensors, rewritten to QDQ (``qcompile.frontends.onnx_qop``) and compiled for llvm.

* bit-exact: the compiled module equals the NumPy integer reference of its integer graph, and equals the module
  compiled from the rewritten QDQ model (the rewrite is the whole of the QOperator support);
* the rewrite against the ONNX specification: the rewritten QDQ model, evaluated by ``tests/spec_reference.py``, is
  within one output step of the compiled module (rounding ties: half up in fixed point against half to even);
* against onnxruntime running the QOperator model itself (its QLinearConv / QGemm / QLinearAdd kernels, graph
  optimizations off and on) within THREE output steps and the same top-1. onnxruntime's QLinear kernels requantize
  each layer in float32 (accumulator x float32 multiplier, rounded half to even), and its QLinearAdd /
  QLinearAveragePool work in float32 too: each layer can differ from the exact integer requantize by one step at a
  tie, and a one-step difference in an early layer moves later layers' outputs by up to a step more.
"""
import numpy as np
import onnx
import pytest
import tvm
from onnx import numpy_helper
from tvm import relax

import cnn_fixtures as F
from qcompile.driver import CompileOptions, compile_model
from qcompile.errors import QCompileError, UnsupportedOpError
from qcompile.frontends.onnx_qop import is_qoperator, qoperator_to_qdq
from qcompile.reference import Reference

QOP_STEPS = 3


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return str(tmp_path_factory.mktemp("qop"))


def _quiet(_):
    pass


def _run(res, x):
    return relax.VirtualMachine(res.executable, tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy()


def _qop_model(folder, name):
    if name in F.BUILDERS:
        return F.onnx_model(name, "qop", folder), F.INPUT_SHAPE
    shape = (2, 8, 8, 8)
    fp = F.float_ops_model(f"{folder}/{name}_float.onnx", name)
    calib = np.random.default_rng(1).standard_normal((16, *shape[1:])).astype("float32")
    return F.quantize_ort(fp, f"{folder}/{name}_qop.onnx", "qop", calib), shape


def _output_step(model) -> float:
    last_dq = [n for n in model.graph.node if n.op_type == "DequantizeLinear"][-1]
    return float(next(numpy_helper.to_array(t) for t in model.graph.initializer if t.name == last_dq.input[1]))


@pytest.mark.parametrize("name,ops", [
    ("mobilenet_v2_mini", {"QLinearConv", "QLinearAdd", "QLinearGlobalAveragePool", "QGemm", "Flatten"}),
    ("resnext_mini", {"QLinearConv", "QLinearAdd", "QLinearGlobalAveragePool", "QGemm"}),
    ("matmul", {"QLinearConv", "MaxPool", "QLinearAveragePool", "Reshape", "QLinearMatMul"}),
    ("sigmoid", {"QLinearSigmoid"}),
    ("leakyrelu", {"QLinearLeakyRelu"}),
    ("hardswish", {"DequantizeLinear", "HardSwish", "QuantizeLinear"}),  # no QLinear op: the float op between DQ / Q
    ("mul", {"QLinearMul"}),
    ("concat", {"QLinearConcat"}),
    ("avgpool_s2", {"QLinearAveragePool"}),
])
def test_qoperator_model(folder, name, ops):
    path, shape = _qop_model(folder, name)
    model = onnx.load(path)
    assert ops <= {n.op_type for n in model.graph.node} and is_qoperator(model)
    assert not any(n.op_type in ("Conv", "Gemm", "MatMul", "Add") for n in model.graph.node)
    res = compile_model(path, CompileOptions(batch=shape[0]), log=_quiet)
    assert res.meta["format"] == "onnx-qop"
    qdq = qoperator_to_qdq(model)
    onnx.checker.check_model(qdq)
    assert not is_qoperator(qdq)
    qdq_path = f"{folder}/{name}_rewritten.onnx"
    onnx.save(qdq, qdq_path)
    res_qdq = compile_model(qdq_path, CompileOptions(batch=shape[0]), log=_quiet)
    assert res_qdq.meta["format"] == "onnx"
    step = _output_step(model)
    ref, spec = Reference(res.integer_mod), F.spec_reference(qdq)
    for seed in range(2):  # fresh inputs each time
        x = F.fresh_input(500 + seed, shape)
        y = _run(res, x)
        assert np.array_equal(y, ref(x)), "compiled module differs from the NumPy integer reference"
        assert np.array_equal(y, _run(res_qdq, x)), "QOperator and its QDQ rewrite compile to different results"
        y_spec = spec(x)[qdq.graph.output[0].name]
        assert np.abs(y - y_spec.value()).max() <= step * (1 + 1e-5), "rewritten model: more than one step from spec"
        for optimized in (False, True):
            y_ort = F.run_ort(path, x, optimized=optimized)
            err = np.abs(y.astype(np.float64) - y_ort)
            assert err.max() <= QOP_STEPS * step * (1 + 1e-5), f"{err.max() / step:.2f} steps from onnxruntime"
            assert np.array_equal(y.argmax(1), y_ort.argmax(1)), "top-1 disagrees with onnxruntime"
        assert len(np.unique(y)) > 5, "degenerate output"


def test_unsupported_qoperator_op_is_one_clear_error(folder):
    """A QLinearAveragePool whose padding makes the divisor vary at the edges (count_include_pad=0) names the
    QOperator node and the float op it stands for."""
    path, _ = _qop_model(folder, "avgpool")
    assert "QLinearAveragePool" in {n.op_type for n in onnx.load(path).graph.node}
    with pytest.raises(UnsupportedOpError, match=r"unsupported op AveragePool \(node 'avgpool2_node_quant'\): "
                                                  r"padding with count_include_pad=0"):
        compile_model(path, CompileOptions(), log=_quiet)


def test_unsupported_qoperator_op_on_the_command_line(folder, capsys):
    from qcompile.cli import qcompile_main

    path, _ = _qop_model(folder, "avgpool")
    rc = qcompile_main([path, "-o", f"{folder}/s.so"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == ("qcompile: error: unsupported op AveragePool (node 'avgpool2_node_quant'): "
                                            "padding with count_include_pad=0 (a divisor that varies at the edges) is "
                                            "not supported")


def test_qoperator_weight_needs_a_constant(folder):
    """A QLinearConv whose scale is computed by the graph, not a constant, names the node and the input."""
    path, _ = _qop_model(folder, "matmul")
    m = onnx.load(path)
    conv = next(n for n in m.graph.node if n.op_type == "QLinearConv")
    conv.input[4] = "x"  # the weight scale: now a graph input
    with pytest.raises(QCompileError, match=rf"node '{conv.name}' \(QLinearConv\): input 'x' must be a constant"):
        qoperator_to_qdq(m)
