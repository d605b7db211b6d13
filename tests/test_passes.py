"""Pass tests: structure of the integer IR (Before/Expected), fixed point, INT4 packing, layouts, the pipeline."""
import os

import numpy as np
import pytest
import tvm
from tvm import relax

from qcompile import int4
from qcompile.errors import QCompileError, run_pass
from qcompile.fixed_point import quantize_multipliers, requantize_reference
from qcompile.pipeline import build, lower_to_integer
from qcompile.qdq import QDQBuilder, qtype
from qcompile.reference import Reference
from qcompile.relay_passes import LowerQDQToInteger

from qdq_models import tiny_resnet_qdq


def _run_llvm(mod, x):
    vm = relax.VirtualMachine(build(mod, "llvm"), tvm.cpu())
    return vm["main"](tvm.runtime.tensor(x)).numpy()


# ------------------------------------------------------------------------------------------------
# LowerQDQToInteger: Before (QDQ form) / Expected (integer form)
# ------------------------------------------------------------------------------------------------
def _single_conv(w_q, s_w, bias_q, s_x=0.5, s_y=0.25):
    b = QDQBuilder()
    x = b.input("x", (1, 2, 4, 4))
    q = b.quantize(x, s_x, 0, qtype(8, True), name="qx")
    y = b.conv2d(b.dequantize(q, s_x, 0), b.qweight(w_q, s_w, qtype(8, True), name="w"),
                 b.qbias(bias_q, s_x * s_w, "b"), padding=(1, 1, 1, 1), name="conv")
    y = b.relu(y)
    qy = b.quantize(y, s_y, 0, qtype(8, False), name="qy")
    return b.finish([b.dequantize(qy, s_y, 0, name="out")])


def test_lower_single_conv_structure():
    rng = np.random.default_rng(0)
    w_q = rng.integers(-128, 128, (3, 2, 3, 3))
    s_w = np.array([0.01, 0.02, 0.03])
    bias_q = np.array([5, -7, 11])
    after = run_pass(LowerQDQToInteger("NHWC"), _single_conv(w_q, s_w, bias_q))

    # Expected, written out by hand: quantize input, to NHWC, int32 conv, fixed-point requantize, ReLU as lo=0
    mults, shift = quantize_multipliers([0.5 * s_w.astype(np.float32).astype(np.float64) / 0.25])  # scales are float32 in the model
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 2, 4, 4), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            f = relax.op.floor(relax.op.add(relax.op.divide(x, relax.const(0.5, "float32")), relax.const(0.5, "float32")))
            q = bb.emit(relax.op.astype(relax.op.clip(f, -128, 127), "int8"))
            q = bb.emit(relax.op.permute_dims(q, [0, 2, 3, 1]))
            acc = bb.emit(relax.op.nn.conv2d(q, relax.const(np.transpose(w_q, (0, 2, 3, 1)).astype("int8"), "int8"),
                                             padding=[1, 1, 1, 1], data_layout="NHWC", kernel_layout="OHWI",
                                             out_dtype="int32"))
            v = relax.op.add(relax.op.astype(acc, "int64"), relax.const(bias_q.astype("int64"), "int64"))
            v = relax.op.multiply(v, relax.const(mults[0].astype("int64"), "int64"))
            v = relax.op.add(v, relax.const((np.int64(1) << (shift - 1)).astype("int64"), "int64"))
            v = relax.op.right_shift(v, relax.const(shift.astype("int64"), "int64"))
            y = bb.emit(relax.op.astype(relax.op.clip(v, 0, 255), "uint8"))
            o = relax.op.multiply(relax.op.astype(relax.op.astype(y, "int32"), "float32"), relax.const(0.25, "float32"))
            o = bb.emit(relax.op.permute_dims(bb.emit(o), [0, 3, 1, 2]))  # 4-D output back to NCHW
            o = bb.emit_output(o)
        bb.emit_func_output(o)
    expected = bb.get()
    tvm.ir.assert_structural_equal(after["main"], expected["main"], map_free_vars=True)


def test_lower_weight_layouts_literal():
    """The conv weights of the integer graph per layout, against buffers written out by hand: a 2x2x1x3 OIHW weight
    (w[k, c, 0, s] = 1 + 6k + 3c + s) becomes OHWI [K, R, S, C] for NHWC and HWOI [R, S, K, C] for HWNC."""
    from tvm.ir.expr import Constant

    w_q = np.arange(1, 13).reshape(2, 2, 1, 3)
    want = {"NCHW": [[[[1, 2, 3]], [[4, 5, 6]]], [[[7, 8, 9]], [[10, 11, 12]]]],
            "NHWC": [[[[1, 4], [2, 5], [3, 6]]], [[[7, 10], [8, 11], [9, 12]]]],
            "HWNC": [[[[1, 4], [7, 10]], [[2, 5], [8, 11]], [[3, 6], [9, 12]]]]}
    for layout, expected in want.items():
        mi = lower_to_integer(_single_conv(w_q, np.array([0.01, 0.02]), np.array([5, -7])), layout)
        consts = []
        relax.analysis.post_order_visit(mi["main"], lambda e: consts.append(e.value.numpy()) if isinstance(
            e, Constant) and hasattr(e.value, "numpy") and e.value.numpy().ndim == 4 else None)
        assert len(consts) == 1 and consts[0].dtype == np.int8, layout
        assert consts[0].tolist() == expected, layout


def test_lower_rejects_float_compute_between_qdq():
    b = QDQBuilder()
    x = b.input("x", (1, 2, 4, 4))
    q = b.quantize(x, 0.1, 0, qtype(8, True), name="qx")
    s = b.emit(relax.op.exp(b.dequantize(q, 0.1, 0)), "my_exp")  # (sigmoid & co. lower to tables: test_cnn_ops.py)
    qy = b.quantize(s, 0.1, 0, qtype(8, True))
    mod = b.finish([b.dequantize(qy, 0.1, 0)])
    with pytest.raises(QCompileError, match="exp.*my_exp"):
        lower_to_integer(mod, "NCHW")


# ------------------------------------------------------------------------------------------------
# fixed point
# ------------------------------------------------------------------------------------------------
def test_quantize_multipliers_precision():
    rng = np.random.default_rng(1)
    m = np.concatenate([rng.uniform(1e-6, 1.0, 1000), rng.uniform(-1.0, -1e-6, 10), [1e-19, 0.0]])
    (M,), S = quantize_multipliers([m])
    assert np.all(np.abs(M) < 2**31) and np.all((S >= 1) & (S <= 62))
    approx = M * np.ldexp(1.0, -S)
    big = np.abs(m) > 1e-9
    assert np.all(np.abs(approx[big] - m[big]) <= np.abs(m[big]) * 2.0**-30)
    # the requantize rounds to nearest: compare with float math on random accumulators
    acc = rng.integers(-(2**24), 2**24, 1000)
    (M1,), S1 = quantize_multipliers([np.float64(0.00123)])
    y = requantize_reference([acc], [M1], S1, 0, -(2**40), 2**40)
    assert np.max(np.abs(y - acc * 0.00123)) <= 0.5 + 1e-6


def test_shared_shift_for_residual_terms():
    (Ma, Mb), S = quantize_multipliers([np.array([0.5, 0.25]), np.array(0.001)])
    assert S.shape == (2,) and Ma.shape == Mb.shape == (2,)
    assert np.allclose(Mb * np.ldexp(1.0, -S), 0.001, rtol=1e-6)


# ------------------------------------------------------------------------------------------------
# INT4 packing
# ------------------------------------------------------------------------------------------------
def test_int4_nibble_orders():
    """qcompile.int4: qcompile's order (element 0 in the low nibble) and HAWQ's (element 0 in the high nibble)."""
    p = int4.pack(np.array([1, 2, -1, 7]), 0)
    assert p.dtype == np.uint8 and p.tolist() == [0x21, 0x7F]
    assert int4.pack(np.array([1, 2, -1, 7]), first="high").tolist() == [0x12, 0xF7]
    assert int4.unpack(np.array([0x21, 0x7F], np.uint8)).tolist() == [1, 2, -1, 7]
    assert int4.unpack(np.array([0x21, 0x7F], np.uint8), signed=False).tolist() == [1, 2, 15, 7]
    assert int4.unpack(np.array([0x12, 0xF7], np.uint8), first="high").tolist() == [1, 2, -1, 7]
    # along another axis; an odd count padded with a zero nibble, and cut back with count
    odd = np.array([[1, -2], [3, -4], [7, 0]])  # axis 0: 3 values per column
    assert int4.pack(odd, 0, pad_odd=True).tolist() == [[0x31, 0xCE], [0x07, 0x00]]
    assert int4.pack(odd, 0, first="high", pad_odd=True).tolist() == [[0x13, 0xEC], [0x70, 0x00]]
    assert int4.unpack(np.array([[0x31, 0xCE], [0x07, 0x00]], np.uint8), 0, count=3).tolist() == odd.tolist()
    with pytest.raises(ValueError, match="odd"):
        int4.pack(odd, 0)
    rng = np.random.default_rng(2)
    for signed, lo, hi in [(True, -8, 8), (False, 0, 16)]:
        x = rng.integers(lo, hi, (3, 6, 5))
        for first in ("low", "high"):
            y = int4.unpack(int4.pack(x, 1, first), 1, signed, first)
            assert y.dtype == (np.int8 if signed else np.uint8) and np.array_equal(y, x)


def test_pipeline_registered_and_dumped(tmp_path, monkeypatch):
    """The pass order is one pipeline, registered with TVM as "qcompile"; lower_to_integer runs its integer phases
    for the CPU and writes their IR where QCOMPILE_DUMP_IR says."""
    from qcompile.pipeline import qcompile_pipeline

    assert relax.pipeline.PIPELINE_MAP["qcompile"] is qcompile_pipeline
    names = [p.info.name for p in relax.get_pipeline("qcompile", target="cuda", layout="NHWC").passes]
    order = ["LowerQDQToInteger", "qcompile.tensor_cores", "qcompile.pack_int4", "qcompile.cuda_pipeline"]
    assert [n for n in names if n in order] == order
    mod, _ = tiny_resnet_qdq(w_bits=4, a_bits=4)
    monkeypatch.setenv("QCOMPILE_DUMP_IR", str(tmp_path))
    mi = lower_to_integer(mod, "NHWC")
    assert sorted(os.listdir(tmp_path)) == ["1_qdq.py", "2_integer.py", "3_packed.py"]
    assert (tmp_path / "3_packed.py").read_text() == mi.script(show_meta=False)


def test_pack_int4_inserts_packed_tensors():
    mod, _ = tiny_resnet_qdq(w_bits=4, a_bits=4)
    mi = lower_to_integer(mod, "NHWC", pack_int4=True)
    text = mi.script(show_meta=False)
    # weights: packed uint8 constants unpacked in the graph; activations: *_packed uint8 tensors
    assert "_w_unpack" in text and "_packed" in text
    packed = [b.var for blk in mi["main"].body.blocks for b in blk.bindings if b.var.name.endswith("_packed")]
    assert packed and all(str(v.ty.dtype) == "uint8" for v in packed)
    for v in packed:  # channels halved
        assert int(v.ty.shape[-1]) * 2 == 8


# ------------------------------------------------------------------------------------------------
# layouts and numerics of the integer graph
# ------------------------------------------------------------------------------------------------
def _between_convs_transposes(mod):
    """Number of permute_dims / layout_transform ops after the first conv and before the last conv."""
    ops = [b.value.op.name for blk in mod["main"].body.blocks for b in blk.bindings if isinstance(b.value, relax.Call)]
    convs = [i for i, o in enumerate(ops) if o == "relax.nn.conv2d"]
    return sum(o in ("relax.permute_dims", "relax.layout_transform") for o in ops[convs[0]: convs[-1]])


@pytest.mark.parametrize("bits", [(8, 8), (4, 4), (4, 8)])
def test_tiny_resnet_all_layouts_exact(bits):
    mod, shape = tiny_resnet_qdq(seed=3, w_bits=bits[0], a_bits=bits[1])
    x = np.random.default_rng(4).standard_normal(shape).astype("float32")
    outs = {}
    for layout in ["NCHW", "NHWC", "HWNC"]:
        mi = lower_to_integer(mod, layout)
        if layout != "NCHW":
            assert _between_convs_transposes(mi) == 0
        y = _run_llvm(mi, x)
        assert np.array_equal(y, Reference(mi)(x)), layout
        outs[layout] = y
    assert len(np.unique(outs["NCHW"])) > 3  # a real output, not a saturated constant
    assert np.array_equal(outs["NCHW"], outs["NHWC"]) and np.array_equal(outs["NCHW"], outs["HWNC"])


def test_integer_graph_matches_qdq_float_semantics():
    """The lowered graph computes the QDQ model: compare with the float QDQ graph run by NumPy."""
    mod, shape = tiny_resnet_qdq(seed=5)
    x = np.random.default_rng(6).standard_normal(shape).astype("float32")
    y_int = Reference(lower_to_integer(mod, "NCHW"))(x)
    y_f = _qdq_float(mod, x)
    # one output step (0.01) at most: intermediate roundings differ only at ties / fixed-point precision
    assert np.max(np.abs(y_int - y_f)) <= 0.01 + 1e-6
    assert np.mean(y_int == y_f) > 0.9


def _qdq_float(mod, x):
    """Float evaluation of a QDQ-form module (float64 between quantizes, ONNX rounding: half to even)."""
    import torch

    env = {mod["main"].params[0]: x.astype(np.float64)}
    for blk in mod["main"].body.blocks:
        for b in blk.bindings:
            v = b.value
            if isinstance(v, relax.Var):
                env[b.var] = env[v]
                continue
            a = [env[e] if isinstance(e, relax.Var) else None if isinstance(e, relax.ShapeExpr)
                 else (e.value.numpy() if hasattr(e.value, "numpy") else e.value) for e in v.args]
            op = v.op.name
            if op == "relax.quantize":
                s, z = float(a[1]), int(a[2])
                info = np.iinfo(str(v.attrs.out_dtype))
                r = np.clip(np.round(a[0] / s) + z, info.min, info.max)
            elif op == "relax.dequantize":
                ax = int(v.attrs.axis)
                shp = [1] * a[0].ndim
                s, z = np.asarray(a[1], np.float64), np.asarray(a[2], np.float64)
                if s.size > 1:
                    shp[ax] = -1
                r = (a[0] - z.reshape(shp if z.size > 1 else ())) * s.reshape(shp if s.size > 1 else ())
            elif op == "relax.clip":
                r = np.clip(a[0], a[1], a[2])
            elif op == "relax.nn.conv2d":
                at = v.attrs
                p = [int(i) for i in at.padding]
                r = torch.nn.functional.conv2d(torch.from_numpy(np.pad(a[0], ((0, 0), (0, 0), (p[0], p[2]), (p[1], p[3])))),
                                               torch.from_numpy(a[1]), stride=[int(s) for s in at.strides]).numpy()
            elif op == "relax.nn.max_pool2d":
                at = v.attrs
                p = [int(i) for i in at.padding]
                r = torch.nn.functional.max_pool2d(torch.from_numpy(a[0]), [int(i) for i in at.pool_size],
                                                   [int(i) for i in at.strides], p[0]).numpy()
            elif op == "relax.reshape":
                r = a[0].reshape([int(s) for s in v.ty.shape])
            elif op == "relax.add":
                r = a[0] + a[1]
            elif op == "relax.multiply":
                r = a[0] * a[1]
            elif op == "relax.nn.relu":
                r = np.maximum(a[0], 0)
            elif op == "relax.mean":
                r = a[0].mean(axis=(2, 3), keepdims=True)
            elif op == "relax.matmul":
                r = a[0] @ a[1]
            elif op == "relax.permute_dims":
                r = np.transpose(a[0], [int(i) for i in v.attrs.axes])
            else:
                raise NotImplementedError(op)
            env[b.var] = np.asarray(r, np.float64)
    return env[mod["main"].body.body].astype(np.float32)
