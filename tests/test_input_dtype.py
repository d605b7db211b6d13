"""qcompile --input-dtype int8|uint8 --input-layout NCHW|NHWC: a module that takes its input already quantized.

The module built with an integer input must give, bit for bit, the output of the float-input module on the float
images whose quantization (``Module.quantize_input``: the module's own rounding, in float32) is that integer input:
int8 and uint8 models, with and without the 128 shift between the two dtypes, NCHW and NHWC inputs into NCHW and
NHWC builds. Models the option cannot serve (a per-channel input quantize, an input that feeds more than one
QuantizeLinear, a 4-bit input in the other dtype, NHWC for a 2-D input) get one message naming the node; inputs of the
wrong dtype or shape get one ``RunError`` / ``qrun: error:`` line.
"""
import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest

from cnn_fixtures import qdq_grouped_clip_model
from qcompile.driver import CompileOptions, compile_model
from qcompile.errors import QCompileError, run_pass
from qcompile.runtime import Module, RunError, qrun_main

QUIET = dict(log=lambda s: None)


# ------------------------------------------------------------------------------------------------------------------
# models
# ------------------------------------------------------------------------------------------------------------------

def identity_model(path: str, zp_dtype: str, scale: float, zp: int, shape=(2, 4, 6, 6), per_channel: bool = False,
                   second_quantize: bool = False) -> str:
    """An ONNX QDQ model (opset 13) whose output is its own quantization of the input, dequantized::

        x -> QuantizeLinear 'in_Q' (scale, zp of zp_dtype) -> DequantizeLinear -> Conv 1x1 depthwise, weight 1
          -> QuantizeLinear (the same scale and zero point) -> DequantizeLinear -> y = (q - zp) * scale

    so ``y`` shows which integer ``q`` the module computed for each input value. ``per_channel``: 'in_Q' has one
    scale per channel (axis 1). ``second_quantize``: ``x`` also feeds a QuantizeLinear 'side_Q', whose dequantized
    value is added to the conv's output."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    c = shape[1]
    zdt = np.dtype(zp_dtype)
    s_in = np.full(c, scale, np.float32) * np.linspace(1, 2, c, dtype=np.float32) if per_channel else np.float32(scale)
    z_in = np.full(c, zp, zdt) if per_channel else np.array(zp, zdt)
    inits = [numpy_helper.from_array(np.asarray(s_in), "s_in"), numpy_helper.from_array(z_in, "z_in"),
             numpy_helper.from_array(np.float32(scale), "s"), numpy_helper.from_array(np.array(zp, zdt), "z"),
             numpy_helper.from_array(np.ones((c, 1, 1, 1), np.int8), "w"),
             numpy_helper.from_array(np.ones(c, np.float32), "w_s"),
             numpy_helper.from_array(np.zeros(c, np.int8), "w_z")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "s_in", "z_in"], ["xq"], name="in_Q", axis=1),
             helper.make_node("DequantizeLinear", ["xq", "s_in", "z_in"], ["xdq"], name="in_DQ", axis=1),
             helper.make_node("DequantizeLinear", ["w", "w_s", "w_z"], ["wdq"], name="w_DQ", axis=0),
             helper.make_node("Conv", ["xdq", "wdq"], ["conv"], name="conv", group=c, kernel_shape=[1, 1])]
    y = "conv"
    if second_quantize:
        nodes += [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["sq"], name="side_Q"),
                  helper.make_node("DequantizeLinear", ["sq", "s", "z"], ["sdq"], name="side_DQ"),
                  helper.make_node("Add", ["conv", "sdq"], ["sum"], name="add")]
        y = "sum"
    nodes += [helper.make_node("QuantizeLinear", [y, "s", "z"], ["yq"], name="out_Q"),
              helper.make_node("DequantizeLinear", ["yq", "s", "z"], ["out"], name="out_DQ")]
    graph = helper.make_graph(nodes, "identity", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, list(shape))], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 7
    onnx.checker.check_model(model)
    onnx.save(model, path)
    return path


# identity models: (zero-point dtype, scale, zero point). A power-of-two scale makes x / scale exact, so values
# exactly halfway between two integers occur; 0.05 makes the float32 division round.
IDENTITY = {"identity_i8": ("int8", 0.0625, 31), "identity_u8": ("uint8", 0.05, 100)}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The ONNX models: resnet_tiny from qmodel (int8 input, zero point 0), the grouped/clip model (uint8 input,
    zero point 117, padded convs), the identity models (:data:`IDENTITY`)."""
    d = tmp_path_factory.mktemp("input_dtype")
    tiny = str(d / "tiny.onnx")
    r = subprocess.run([sys.executable, "-m", "qcompile.models.cli", "resnet_tiny", "--bits", "8", "--input-size", "16",
                        "--batch", "2", "-q", "-o", tiny], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return {"dir": d, "tiny": tiny, "grouped": qdq_grouped_clip_model(str(d / "grouped.onnx")),
            **{name: identity_model(str(d / f"{name}.onnx"), *IDENTITY[name]) for name in IDENTITY}}


_BUILT: dict = {}


def build(models, name: str, layout="NCHW", input_dtype="float32", input_layout="NCHW") -> Module:
    """``models[name]`` compiled for llvm with these options, exported and loaded (once per option set)."""
    key = (name, layout, input_dtype, input_layout)
    if key not in _BUILT:
        res = compile_model(models[name], CompileOptions(layout=layout, input_dtype=input_dtype,
                                                         input_layout=input_layout), **QUIET)
        so = str(models["dir"] / f"{'_'.join(key)}.so")
        res.export(so)
        _BUILT[key] = (Module(so), res)
    return _BUILT[key][0]


def fresh_images(shape, seed: int, spread: float) -> np.ndarray:
    """Random float32 NCHW images, wide enough that some values saturate the input quantization."""
    return (np.random.default_rng(seed).standard_normal(shape) * spread).astype(np.float32)


def nchw(m: Module) -> tuple:
    s = m.meta["input_shape"]
    return tuple(s) if m.meta["input_layout"] == "NCHW" else (s[0], s[3], s[1], s[2])


# ------------------------------------------------------------------------------------------------------------------
# bit-exact against the float-input module
# ------------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout,input_layout", [("NCHW", "NCHW"), ("NCHW", "NHWC"), ("NHWC", "NHWC"),
                                                 ("NHWC", "NCHW")])
def test_int8_input_resnet_tiny_bit_exact(models, layout, input_layout):
    """resnet_tiny (int8 input quantize, zp 0): the int8-input module on the quantized images equals the float-input
    module (same build layout) on the images, for fresh random images; metadata and the transpose it spares."""
    f = build(models, "tiny", layout)
    m = build(models, "tiny", layout, "int8", input_layout)
    iq = m.input_quant
    scale, zp, dtype, lay = iq
    assert (zp, dtype, lay, iq.qmin, iq.qmax) == (0, "int8", input_layout, -128, 127) and scale > 0
    assert iq.node == "input_quantized" and f.input_quant is None
    assert m.meta["input_dtype"] == "int8" and m.meta["input_layout"] == input_layout
    assert nchw(m) == tuple(f.meta["input_shape"]) == (2, 3, 16, 16)
    for seed in (1, 2):
        x = fresh_images(f.meta["input_shape"], seed, spread=100 * scale)
        q = m.quantize_input(x)
        assert q.dtype == np.int8 and q.shape == tuple(m.meta["input_shape"])
        assert np.any(q == 127) and np.any(q == -128) and len(np.unique(q)) > 200  # (saturates, and varied)
        y_f, y_i = f(x), m(q)
        assert np.array_equal(y_f, y_i), np.abs(y_f - y_i).max()
    # the input's transpose: only where the input layout is not the build's
    integer_ir = _BUILT[("tiny", layout, "int8", input_layout)][1].integer_mod.script()
    assert ("permute_dims" in integer_ir) == (layout != input_layout)


def test_float32_nhwc_input(models):
    """--input-layout NHWC with float32 images: the float NCHW module's output on the same images, transposed."""
    f = build(models, "tiny", "NHWC")
    m = build(models, "tiny", "NHWC", "float32", "NHWC")
    assert m.input_quant is None and m.meta["input_shape"] == [2, 16, 16, 3]
    x = fresh_images(f.meta["input_shape"], 10, spread=2.0)
    assert np.array_equal(f(x), m(np.ascontiguousarray(x.transpose(0, 2, 3, 1))))
    with pytest.raises(RunError, match=r"has shape \(2, 3, 16, 16\), the module was compiled for \(2, 16, 16, 3\) "
                                       r"\(float32 NHWC images;"):
        m(x)


@pytest.mark.parametrize("input_dtype,zp", [("uint8", 117), ("int8", 117 - 128)])
@pytest.mark.parametrize("input_layout", ["NCHW", "NHWC"])
def test_uint8_model_bit_exact(models, input_dtype, zp, input_layout):
    """The grouped/clip model (uint8 input quantize, zp 117, zero-point-padded convs): uint8 input as the model has it,
    and int8 input shifted by 128 in the module (zero point 117 - 128), both bit-exact."""
    f = build(models, "grouped")
    m = build(models, "grouped", "NCHW", input_dtype, input_layout)
    iq = m.input_quant
    assert (iq.zero_point, iq.dtype, iq.qmin, iq.qmax) == ((zp, "uint8", 0, 255) if input_dtype == "uint8"
                                                           else (zp, "int8", -128, 127))
    x = fresh_images(f.meta["input_shape"], 3, spread=140 * iq.scale)
    q = m.quantize_input(x)
    lo, hi = np.iinfo(q.dtype).min, np.iinfo(q.dtype).max
    assert q.dtype == np.dtype(input_dtype) and np.any(q == lo) and np.any(q == hi)
    assert np.array_equal(f(x), m(q))
    if input_dtype == "int8":  # the shift is exact: the uint8 module's input, less 128
        u = build(models, "grouped", "NCHW", "uint8", input_layout).quantize_input(x)
        assert np.array_equal(q.astype(np.int16), u.astype(np.int16) - 128)


@pytest.mark.parametrize("name,input_dtype", [("identity_i8", "int8"), ("identity_i8", "uint8"),
                                               ("identity_u8", "uint8"), ("identity_u8", "int8")])
def test_quantize_input_is_the_modules_own_rounding(models, name, input_dtype):
    """The identity models return their own quantization of the input: Module.quantize_input gives those integers
    for values halfway between two steps and their float32 neighbours (the module computes floor(x / scale + 0.5) in
    float32, so halfway values round up, not to even as ONNX's QuantizeLinear does), and the integer-input module
    (the model's dtype, or the other one shifted by 128) returns the same output."""
    zp_dtype, s, zp = IDENTITY[name]
    f = build(models, name)
    m = build(models, name, "NCHW", input_dtype, "NHWC")
    shift = 0 if input_dtype == zp_dtype else (128 if zp_dtype == "uint8" else -128)  # model value - input value
    assert (m.input_quant.zero_point, m.input_quant.scale) == (zp - shift, float(np.float32(s)))
    lo, hi = np.iinfo(zp_dtype).min, np.iinfo(zp_dtype).max
    shape = f.meta["input_shape"]
    n = int(np.prod(shape))
    k = np.random.default_rng(4).integers(lo - zp - 20, hi - zp + 20, n)
    halves = ((k + 0.5) * np.float32(s)).astype(np.float32)
    near = np.stack([halves, np.nextafter(halves, np.float32(-np.inf)), np.nextafter(halves, np.float32(np.inf))])
    x = near[np.random.default_rng(5).integers(0, 3, n), np.arange(n)].reshape(shape)
    y = f(x)
    q_module = np.rint(y.astype(np.float64) / np.float32(s)).astype(np.int64) + zp  # what the module computed
    assert q_module.min() == lo and q_module.max() == hi
    q_host = m.quantize_input(x)
    assert q_host.dtype == np.dtype(input_dtype) and q_host.shape == (shape[0], shape[2], shape[3], shape[1])
    assert np.array_equal(q_host.transpose(0, 3, 1, 2).astype(np.int64) + shift, q_module)
    if s == 0.0625:  # (exact halves: where the round-half-to-even integer is odd, the module's is one more)
        even = np.clip(np.rint(x.astype(np.float64) / s) + zp, lo, hi)
        assert np.count_nonzero(even != q_module) > n // 10
    assert np.array_equal(m(q_host), y)


def test_4bit_input_quantize_lowering():
    """A QDQ model whose input quantize is 4-bit (int8 storage, clipped to [-8, 7]): --input-dtype int8 keeps the
    range (the integer graph clips, InputQuant says [-8, 7]) and matches the float input on the NumPy reference;
    uint8 is refused (no 128 shift between 4-bit forms)."""
    from qcompile.qdq import QDQBuilder, qtype
    from qcompile.reference import Reference
    from qcompile.relay_passes import LowerQDQToInteger

    rng = np.random.default_rng(6)
    b = QDQBuilder()
    x = b.input("x", (1, 4, 5, 5))
    q = b.quantize(x, 0.25, 1, qtype(4, True), name="q4_in")
    h = b.conv2d(b.dequantize(q, 0.25, 1), b.qweight(rng.integers(-127, 128, (6, 4, 3, 3)), np.full(6, 0.01),
                                                     qtype(8, True), name="w"), None, (1, 1), (1, 1, 1, 1),
                 name="conv")
    out = b.dequantize(b.quantize(h, 0.05, 0, qtype(8, True), name="q_out"), 0.05, 0, name="out")
    mod = b.finish([out])
    lf, li = LowerQDQToInteger("NCHW"), LowerQDQToInteger("NCHW", "int8", "NHWC")
    mf, mi = run_pass(lf, mod), run_pass(li, mod)
    assert lf.input_quant is None
    iq = li.input_quant
    assert (iq.scale, iq.zero_point, iq.dtype, iq.layout, iq.qmin, iq.qmax, iq.node) == (0.25, 1, "int8", "NHWC", -8,
                                                                                          7, "q4_in")
    xs = fresh_images((1, 4, 5, 5), 7, spread=3.0)
    qs = iq.quantize(xs)
    assert qs.shape == (1, 5, 5, 4) and qs.min() == -8 and qs.max() == 7
    assert np.array_equal(Reference(mf)(xs), Reference(mi)(qs))
    with pytest.raises(QCompileError, match=r"--input-dtype uint8: the input quantize 'q4_in' quantizes to 4 bits "
                                            r"stored as int8; give the input as int8"):
        run_pass(LowerQDQToInteger("NCHW", "uint8"), mod)


# ------------------------------------------------------------------------------------------------------------------
# models the option cannot serve: one message naming the node
# ------------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case,message", [
    ("per_channel", "--input-dtype int8: the input quantize 'in_Q' has a per-channel (or non-constant) scale or zero "
                    "point"),
    ("second_quantize", "--input-dtype int8: input 'x' must feed exactly one QuantizeLinear, its only user; it feeds "
                        "'in_Q' (quantize), 'side_Q' (quantize)"),
])
def test_unservable_input_refused(models, tmp_path, capsys, case, message):
    """qcompile --input-dtype int8 on a model whose input is quantized per channel, or feeds two QuantizeLinear
    nodes: exit status 2, one line naming the node(s)."""
    from qcompile.cli import qcompile_main

    path = identity_model(str(tmp_path / f"{case}.onnx"), "int8", 0.05, 0, **{case: True})
    assert qcompile_main([path, "-q", "--input-dtype", "int8", "-o", str(tmp_path / "m.so")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("qcompile: error: " + message) and "\n" not in err, err
    assert "--input-dtype float32" in err
    assert not (tmp_path / "m.so").exists()


def test_nhwc_needs_4d_images():
    from qcompile.qdq import QDQBuilder, qtype
    from qcompile.relay_passes import LowerQDQToInteger

    b = QDQBuilder()
    x = b.input("x", (2, 8))
    d = b.dequantize(b.quantize(x, 0.1, 0, qtype(8, True), name="q_in"), 0.1, 0)
    y = b.dense(d, b.qweight(np.ones((3, 8), np.int64), np.full(3, 0.01), qtype(8, True), name="fc_w"), name="fc")
    mod = b.finish([b.dequantize(b.quantize(y, 0.02, 0, qtype(8, True), name="q_fc"), 0.02, 0)])
    with pytest.raises(QCompileError, match=r"--input-layout NHWC: input 'x' has shape \[2, 8\], not 4-D images"):
        run_pass(LowerQDQToInteger("NCHW", "int8", "NHWC"), mod)
    lo = LowerQDQToInteger("NCHW", "int8", "NCHW")  # (a 2-D integer input in its own layout is fine)
    run_pass(lo, mod)
    assert lo.input_quant.zero_point == 0 and lo.input_quant.scale == pytest.approx(0.1)


# ------------------------------------------------------------------------------------------------------------------
# the runtime: Module, qrun, qbench
# ------------------------------------------------------------------------------------------------------------------

def test_module_refuses_wrong_inputs(models):
    m = build(models, "tiny", "NCHW", "int8", "NHWC")
    f = build(models, "tiny")
    x = fresh_images(f.meta["input_shape"], 8, spread=2.0)
    q = m.quantize_input(x)
    with pytest.raises(RunError, match=r"input 'input' must be int8 NHWC images quantized with scale [0-9.e-]+ and zero "
                                       r"point 0, got dtype float32 -- quantize float images first: "
                                       r"Module.quantize_input\(x\), or qrun --quantize"):
        m(x.transpose(0, 2, 3, 1))
    with pytest.raises(RunError, match=r"must be int8 NHWC images .* got dtype uint8$"):
        m(q.view(np.uint8))
    with pytest.raises(RunError, match=r"has shape \(2, 3, 16, 16\), the module was compiled for \(2, 16, 16, 3\) "
                                       r"\(int8 NHWC images"):
        m(np.ascontiguousarray(q.transpose(0, 3, 1, 2)))
    with pytest.raises(RunError, match=r"quantizing the input: expected float images, got dtype int8"):
        m.quantize_input(q)
    with pytest.raises(RunError, match="non-finite"):
        m.quantize_input(np.where(x > 3, np.nan, x))
    with pytest.raises(RunError, match="takes float32 images .* nothing to quantize"):
        f.quantize_input(x)
    with pytest.raises(RunError, match=r"must be float32 NCHW images, got dtype int8"):
        f(q)
    # a 4-bit input range (InputQuant's qmin/qmax narrower than the dtype): values outside it are refused
    narrow = dataclasses.replace(m.input_quant, qmin=-8, qmax=7)
    m4 = object.__new__(Module)
    m4.__dict__.update(m.__dict__, input_quant=narrow)
    with pytest.raises(RunError, match=r"holds values outside \[-8, 7\]"):
        m4.check_input(q)
    assert m4.check_input(np.clip(q, -8, 7)).dtype == np.int8


def test_dlpack_int8_input(models):
    """A torch int8 tensor (CPU, as the llvm module runs) goes in through DLPack: the same logits; a float tensor or
    one of the wrong shape is refused."""
    torch = pytest.importorskip("torch")
    f = build(models, "tiny")
    m = build(models, "tiny", "NCHW", "int8", "NHWC")
    x = fresh_images(f.meta["input_shape"], 11, spread=2.0)
    y = m(torch.from_numpy(m.quantize_input(x)))
    assert isinstance(y, torch.Tensor) and np.array_equal(y.numpy(), f(x))
    with pytest.raises(RunError, match=r"must be int8 NHWC images quantized with scale .* got dtype float32"):
        m(torch.from_numpy(np.ascontiguousarray(x.transpose(0, 2, 3, 1))))
    with pytest.raises(RunError, match=r"has shape \(2, 3, 16, 16\), the module was compiled for \(2, 16, 16, 3\)"):
        m(torch.zeros((2, 3, 16, 16), dtype=torch.int8))


def test_qrun_quantize(models, tmp_path, capsys):
    """qrun --quantize: float32 NCHW images quantized with the module's scale and zero point; the output file equals
    the float-input module's. Without --quantize the float images are refused; --quantize on a float module too."""
    f = build(models, "tiny")
    m = build(models, "tiny", "NCHW", "int8", "NHWC")
    xp, yp = tmp_path / "x.npy", tmp_path / "y.npy"
    x = fresh_images(f.meta["input_shape"], 9, spread=2.0)
    np.save(xp, x)
    assert qrun_main([m.path, "--input", str(xp), "--quantize", "--output", str(yp)]) == 0
    out = capsys.readouterr().out
    assert "input int8 NHWC: scale" in out and "quantized from the float32 NCHW images" in out
    assert np.array_equal(np.load(yp), f(x))
    np.save(tmp_path / "q.npy", m.quantize_input(x))  # an already-quantized .npy runs as it is
    assert qrun_main([m.path, "--input", str(tmp_path / "q.npy"), "--output", str(tmp_path / "y2.npy")]) == 0
    assert np.array_equal(np.load(tmp_path / "y2.npy"), f(x))
    capsys.readouterr()
    for argv, frag in [([m.path, "--input", str(xp)], "got dtype float32 -- quantize float images first"),
                       ([f.path, "--input", str(xp), "--quantize"], "--quantize applies to a module built with "
                                                                    "--input-dtype int8 or uint8"),
                       ([m.path, "--input", str(tmp_path / "q.npy"), "--quantize"], "--quantize: input"),
                       ]:
        assert qrun_main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("qrun: error: ") and frag in err and "\n" not in err, err
    np.save(tmp_path / "x1.npy", x[:1])
    assert qrun_main([m.path, "--input", str(tmp_path / "x1.npy"), "--quantize"]) == 2
    assert "has shape (1, 3, 16, 16), the module was compiled for float32 NCHW images of shape (2, 3, 16, 16)" in \
        capsys.readouterr().err


def test_qbench_times_the_int8_input(models, tmp_path, capsys):
    from qcompile.bench import qbench_main

    m = build(models, "tiny", "NCHW", "int8", "NHWC")
    out = tmp_path / "b.json"
    assert qbench_main([m.path, "--calls", "10", "--repeat", "2", "--number", "2", "--warm", "0", "--host-io",
                        "--json", str(out)]) == 0
    assert "batch 2, input int8 NHWC" in capsys.readouterr().out
    r = json.loads(out.read_text())
    assert r["input"] == "int8 NHWC" and r["qcompile"]["ms"] > 0 and r["qcompile_host_io"]["ms"] > 0


# ------------------------------------------------------------------------------------------------------------------
# cuda: the option builds; on a GPU, the INT8-input build equals the float-input and llvm builds
# ------------------------------------------------------------------------------------------------------------------

@pytest.mark.nvcc
def test_cuda_build_with_int8_nhwc_input(models, tmp_path):
    res = compile_model(models["tiny"], CompileOptions(target="cuda", arch="sm_90", layout="NHWC", input_dtype="int8",
                                                       input_layout="NHWC"), **QUIET)
    assert res.meta["input_dtype"] == "int8" and res.meta["input_shape"] == [2, 16, 16, 3]
    assert res.meta["input_quant"]["layout"] == "NHWC" and res.meta["input_quant"]["dtype"] == "int8"
    assert "permute_dims" not in res.integer_mod.script()  # (NHWC in, NHWC build: no transpose)
    so = str(tmp_path / "tiny_cuda_int8.so")
    res.export(so)
    from qcompile.runtime import check_module_file

    meta = check_module_file(so)
    assert meta["input_quant"] == res.meta["input_quant"]


@pytest.mark.gpu
@pytest.mark.nvcc
def test_int8_input_on_the_gpu(models, tmp_path):
    """On a CUDA GPU (sm_90 build; ``pytest -m gpu``): the INT8 NHWC-input build on the quantized images equals the
    float-input CUDA build and the llvm build on the float images, and a torch CUDA tensor through DLPack gives the
    same, as a torch CUDA tensor."""
    torch = pytest.importorskip("torch")
    so = {}
    for name, kw in (("f", {}), ("i", dict(input_dtype="int8", input_layout="NHWC"))):
        res = compile_model(models["tiny"], CompileOptions(target="cuda", arch="sm_90", layout="NHWC", **kw), **QUIET)
        so[name] = str(tmp_path / f"{name}.so")
        res.export(so[name])
    f, i, cpu = Module(so["f"], "cuda"), Module(so["i"], "cuda"), build(models, "tiny")
    x = fresh_images(f.meta["input_shape"], 13, spread=2.0)
    q = i.quantize_input(x)
    y = i(torch.from_numpy(q).cuda())
    assert isinstance(y, torch.Tensor) and y.is_cuda
    assert np.array_equal(f(x), cpu(x)) and np.array_equal(i(q), cpu(x)) and np.array_equal(y.cpu().numpy(), cpu(x))
