"""The ops MobileNetV3, EfficientNet and DenseNet add, one hand-written ONNX QDQ model each, compiled for llvm:

* element-wise functions of a quantized tensor (Sigmoid, HardSigmoid, HardSwish, Tanh, LeakyRelu, Gelu, SiLU as
  Sigmoid then Mul) are lookup tables over the 2^bits input values. Fed every value the input type holds, the
  compiled module equals the QDQ float semantics evaluated in float64 from the ONNX specification
  (``saturate(round_half_to_even(f((q - zp) * s) / s_out) + zp_out)``) exactly, at 8 and 4 bits;
* the product of two quantized tensors (squeeze-and-excitation), concat of tensors with different scales, k x k
  average pools and a batch norm that follows no conv: bit-exact against the NumPy integer reference in every layout,
  and within ONE output step of the ONNX specification (``tests/spec_reference.py``) and of onnxruntime with graph
  optimizations off. The step: the product, the pools and the batch norm requantize in fixed point (31-bit
  multipliers, ties rounded half up) where the specification rounds float64 half to even, and onnxruntime computes
  in float32 -- a value within float rounding of a tie can land one step apart. The concat's requantize of each input
  is exact against the specification: an int32 multiply, add and shift checked equal to the specification's table at
  every input value (it fuses into the concat's kernel), else the table itself;
* what stays unsupported is one error naming the node, the op and the reason.
"""
import zlib

import numpy as np
import onnx
import pytest
import tvm
from onnx import numpy_helper
from tvm import relax

import cnn_fixtures as F
from qcompile.driver import CompileOptions, compile_model
from qcompile.errors import UnsupportedOpError
from qcompile.reference import Reference


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return str(tmp_path_factory.mktemp("cnn_ops"))


def _quiet(_):
    pass


def _run(res, x):
    return relax.VirtualMachine(res.executable, tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy()


def _ops(res) -> set:
    return {b.value.op.name for blk in res.integer_mod["main"].body.blocks for b in blk.bindings
            if isinstance(b.value, relax.Call) and isinstance(b.value.op, tvm.ir.Op)}


@pytest.mark.parametrize("op", list(F.ELEMENTWISE))
@pytest.mark.parametrize("bits", [8, 4])
def test_elementwise_function_is_an_exact_table(folder, op, bits):
    signed = op in ("Tanh", "Gelu")
    path, (s_in, zp_in, lo, hi), (s_out, zp_out, olo, ohi) = F.elementwise_model(
        f"{folder}/{op}_{bits}.onnx", op, bits, signed_in=signed)
    layout = "NHWC" if bits == 8 else "NCHW"
    res = compile_model(path, CompileOptions(batch=1, layout=layout), log=_quiet)
    assert "relax.take" in _ops(res)
    rng = np.random.default_rng(zlib.crc32(f"{op}{bits}".encode()))
    q = rng.permutation(np.resize(np.arange(lo, hi + 1), 4 * 8 * 8))  # every input value, in a fresh order
    assert len(np.unique(q)) == hi - lo + 1
    x = ((q - zp_in) * np.float32(s_in)).astype(np.float32).reshape(1, 4, 8, 8)
    y = _run(res, x)
    assert np.array_equal(y, Reference(res.integer_mod)(x))
    fn = F.ELEMENTWISE[op][1]
    want = np.clip(np.rint(fn((q - zp_in) * np.float64(np.float32(s_in))) / np.float64(np.float32(s_out))) + zp_out,
                   olo, ohi)
    got = np.rint(y.reshape(-1).astype(np.float64) / np.float32(s_out)) + zp_out
    assert np.array_equal(got, want), f"{np.sum(got != want)} of {got.size} values differ from the QDQ semantics"
    assert len(np.unique(got)) >= (6 if bits == 4 else 100)
    y_ort = F.run_ort(path, x).reshape(-1)  # float32 arithmetic: one step at most
    assert np.abs(got - (np.rint(y_ort.astype(np.float64) / np.float32(s_out)) + zp_out)).max() <= 1


@pytest.mark.parametrize("kind,op,layout", [
    ("mul", "relax.multiply", "NHWC"), ("mul", "relax.multiply", "HWNC"), ("concat", "relax.concat", "NCHW"),
    ("concat", "relax.concat", "NHWC"), ("avgpool", "relax.strided_slice", "HWNC"),
    ("avgpool_pad", "relax.nn.pad", "NHWC"), ("bn", "relax.concat", "NCHW"), ("bn_q", "relax.right_shift", "NHWC"),
])
def test_two_tensor_ops(folder, kind, op, layout):
    path = F.two_branch_model(f"{folder}/{kind}.onnx", kind)
    model = onnx.load(path)
    res = compile_model(path, CompileOptions(batch=2, layout=layout), log=_quiet)
    assert op in _ops(res)
    if kind == "concat":  # (its parts' requantizes are affine: shifts that fuse into the concat, not tables)
        assert "relax.take" not in _ops(res) and "relax.right_shift" in _ops(res)
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    s_out, zp_out = float(inits["out_s"]), int(inits["out_z"])
    ref, spec = Reference(res.integer_mod), F.spec_reference(model)
    for seed in range(2):  # fresh inputs each time
        x = F.fresh_input(700 + seed, (2, 8, 8, 8))
        y = _run(res, x)
        assert np.array_equal(y, ref(x)), "compiled module differs from the NumPy integer reference"
        got = np.rint(y.astype(np.float64) / np.float32(s_out)) + zp_out
        want = spec(x)["out_q"].q
        diff = np.abs(got - want)
        assert diff.max() <= 1 and np.mean(diff == 0) >= 0.999, (diff.max(), np.mean(diff == 0))
        if kind == "concat":
            assert diff.max() == 0, "the concat's requantizes are exact"
        ort = np.rint(F.run_ort(path, x).astype(np.float64) / np.float32(s_out)) + zp_out
        assert np.abs(got - ort).max() <= 1
        assert len(np.unique(got)) > 40


def test_avgpool_with_a_varying_divisor_is_one_clear_error(folder):
    path = F.two_branch_model(f"{folder}/ap.onnx", "avgpool_pad")
    m = onnx.load(path)
    pool = next(n for n in m.graph.node if n.op_type == "AveragePool")
    next(a for a in pool.attribute if a.name == "count_include_pad").i = 0
    onnx.save(m, f"{folder}/ap_bad.onnx")
    with pytest.raises(UnsupportedOpError, match=r"unsupported op AveragePool \(node 'avgpool'\): padding with "
                                                 r"count_include_pad=0"):
        compile_model(f"{folder}/ap_bad.onnx", CompileOptions(batch=2), log=_quiet)


@pytest.mark.parametrize("op,port", [("Sigmoid", 0), ("Mul", 1)],
                         ids=["function_of_a_conv_output", "product_with_a_conv_output"])
def test_float_operand_goes_through_a_16_bit_grid(folder, op, port):
    """A Sigmoid straight on a conv's float output (no quantize in between, as X86InductorQuantizer leaves hardswish
    and SiLU) and a Mul by a conv's float output: the float value is requantized to a 16-bit grid (a table over it
    for the function: ``fine_lookup``; the grid itself for the product: ``_fine``). Bit-exact against the NumPy
    integer reference; within one output step of the ONNX specification and of onnxruntime (a value within half a
    grid step of an output rounding boundary can land one step away), equal for nearly all values."""
    path = F.two_branch_model(f"{folder}/{op}.onnx", "mul")
    m = onnx.load(path)
    n = next(n for n in m.graph.node if n.op_type == op)
    n.input[port] = "fc_y"
    bad = f"{folder}/{op}_float.onnx"
    onnx.save(m, bad)
    res = compile_model(bad, CompileOptions(batch=2), log=_quiet)
    inits = {t.name: numpy_helper.to_array(t) for t in m.graph.initializer}
    s_out, zp_out = float(inits["out_s"]), int(inits["out_z"])
    ref, spec = Reference(res.integer_mod), F.spec_reference(m)
    for seed in range(2):
        x = F.fresh_input(720 + seed, (2, 8, 8, 8))
        y = _run(res, x)
        assert np.array_equal(y, ref(x)), "compiled module differs from the NumPy integer reference"
        got = np.rint(y.astype(np.float64) / np.float32(s_out)) + zp_out
        diff = np.abs(got - spec(x)["out_q"].q)
        assert diff.max() <= 1 and np.mean(diff == 0) >= 0.99, (diff.max(), np.mean(diff == 0))
        ort = np.rint(F.run_ort(bad, x).astype(np.float64) / np.float32(s_out)) + zp_out
        assert np.abs(got - ort).max() <= 1
        assert len(np.unique(got)) > 20


def test_function_of_a_conv_output_scaled_and_concatenated(folder):
    """A Sigmoid of a conv's float output, multiplied by a constant, as one input of a Concat (a function of a float
    value that is an affine map's and a concatenation's operand): within one output step of the ONNX specification,
    bit-exact against the NumPy reference."""
    from onnx import helper

    path = F.two_branch_model(f"{folder}/cat.onnx", "concat")
    m = onnx.load(path)
    m.graph.initializer.append(numpy_helper.from_array(np.array(1.5, np.float32), "two"))
    cat = next(n for n in m.graph.node if n.op_type == "Concat")
    i = list(m.graph.node).index(cat)
    m.graph.node.insert(i, helper.make_node("Mul", ["sig_b", "two"], ["sig_b2"], name="scale"))
    m.graph.node.insert(i, helper.make_node("Sigmoid", ["conv_b_y"], ["sig_b"], name="sig"))
    cat.input[1] = "sig_b2"
    bad = f"{folder}/cat_float.onnx"
    onnx.save(m, bad)
    res = compile_model(bad, CompileOptions(batch=2, layout="NHWC"), log=_quiet)
    inits = {t.name: numpy_helper.to_array(t) for t in m.graph.initializer}
    s_out, zp_out = float(inits["out_s"]), int(inits["out_z"])
    ref, spec = Reference(res.integer_mod), F.spec_reference(m)
    x = F.fresh_input(740, (2, 8, 8, 8))
    y = _run(res, x)
    assert np.array_equal(y, ref(x))
    got = np.rint(y.astype(np.float64) / np.float32(s_out)) + zp_out
    diff = np.abs(got - spec(x)["out_q"].q)
    assert diff.max() <= 1 and np.mean(diff == 0) >= 0.99, (diff.max(), np.mean(diff == 0))


def test_mean_of_a_2d_tensor_is_one_clear_error():
    """A ReduceMean that is no global pool over H and W (here of a 2-D tensor) stops with the node and the reason."""
    from qcompile.errors import run_pass
    from qcompile.qdq import QTYPES, QDQBuilder
    from qcompile.relay_passes.lower_qdq_to_integer import LowerQDQToInteger

    b = QDQBuilder()
    x = b.input("x", [2, 16])
    q = b.dequantize(b.quantize(x, 0.1, 0, QTYPES["uint8"], name="q"), 0.1, 0, name="dq")
    m = b.emit(relax.op.mean(q, axis=[1], keepdims=True), "avg")
    mod = b.finish([b.dequantize(b.quantize(m, 0.1, 0, QTYPES["uint8"], name="q2"), 0.1, 0, name="dq2")])
    with pytest.raises(UnsupportedOpError, match=r"unsupported op mean \(node 'avg'\): only a global average pool"):
        run_pass(LowerQDQToInteger("NHWC"), mod)


def _fixed_point(x, fit, qmin, qmax):
    """The integer form ``LowerQDQToInteger.affine_requantize`` emits for ``fit``, evaluated in NumPy int64."""
    dtype, M, C, shift, even = fit
    t = x.astype(np.int64) * M + C
    lim = 2**31 if dtype == "int32" else 2**63
    assert np.abs(t).max() + (1 << shift) < lim, "the form overflows its dtype"
    v = (t + (1 << (shift - 1)) - 1 + ((t >> shift) & 1)) >> shift if even else (t + (1 << (shift - 1))) >> shift
    return np.clip(v, qmin, qmax)


def test_concat_requantize_fixed_point_equals_the_table():
    """``exact_affine``: a requantize of a quantized tensor to other parameters (a concat's part), at 8 and 4 bits,
    signed and unsigned, with random float32 scales: the multiply-add-shift form it returns equals the table of the
    QDQ float semantics (round half to even in float64) at every input value; a ratio with exact ties gets the
    half-to-even form; a near-tie that int32 cannot resolve, int64; a function that is not affine, none."""
    from qcompile.relay_passes.lower_qdq_to_integer import _Lowering

    rng = np.random.default_rng(11)
    found = total = 0
    for bits, signed in ((8, False), (8, True), (4, False), (4, True)):
        qmin, qmax = (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if signed else (0, (1 << bits) - 1)
        x = np.arange(qmin, qmax + 1, dtype=np.int64)
        for _ in range(300):
            s_in, s_out = (float(np.float32(np.exp(rng.uniform(-6, 1)))) for _ in range(2))
            z_in, z_out = (0, 0) if signed else (int(rng.integers(qmin, qmax + 1)), int(rng.integers(qmin, qmax + 1)))
            r = (x - z_in) * s_in / s_out + z_out
            q = np.clip(np.rint(r), qmin, qmax).astype(np.int64)
            fit = _Lowering.exact_affine(x, r, q, qmin, qmax)
            total += 1
            if fit is not None:
                found += 1
                assert np.array_equal(_fixed_point(x, fit, qmin, qmax), q), (bits, signed, s_in, s_out, fit)
    assert found >= 0.97 * total, f"{found} of {total} requantizes have a fixed-point form"
    x = np.arange(0, 256, dtype=np.int64)
    r = (x - 60) * 0.5 + 30.0  # exact ties at every odd input: half to even
    q = np.clip(np.rint(r), 0, 255).astype(np.int64)
    fit = _Lowering.exact_affine(x, r, q, 0, 255)
    assert fit is not None and fit[4] and np.array_equal(_fixed_point(x, fit, 0, 255), q)
    r = x * 1.2500000465661298 - 26.2500047031791  # within 5e-6 of ties: beyond int32's precision at this slope
    q = np.clip(np.rint(r), 0, 255).astype(np.int64)
    fit = _Lowering.exact_affine(x, r, q, 0, 255)
    assert fit is not None and fit[0] == "int64" and np.array_equal(_fixed_point(x, fit, 0, 255), q)
    r = np.sqrt(x) * 9.0
    assert _Lowering.exact_affine(x, r, np.rint(r).astype(np.int64), 0, 255) is None
