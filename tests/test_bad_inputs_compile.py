"""Every class of bad input on the compile side (qcompile, qmodel): exit status 2, exactly one ``<prog>: error:`` line
that names the file, node or option, no stack trace, and nothing left in the output folder. Most cases are refused
before anything is compiled; the few that need a build use a one-conv model.

Also: no code in a model or data file runs (crafted pickles in a HAWQ checkpoint, a --weights file, a .pt2 archive
and a .npy file), outputs are written all or nothing, internal errors are one line (exit 1), warnings are one line,
and ``--help`` imports neither TVM nor PyTorch."""
from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import warnings
import zipfile

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from qcompile.cli import qcompile_main
from qcompile.errors import QCompileError


# ------------------------------------------------------------------------------------------------ helpers
def qdq_conv_model(path, *, in_scale=0.05, w_scale=0.01, out_scale=0.1, bias_scale=None, opset=13, cin=3, cout=4,
                   size=8, batch=1):
    """input -> Q -> DQ -> Conv(DQ(int8 w, per channel), DQ(int32 bias)) -> Relu -> Q -> DQ -> output, every scale
    and the opset settable."""
    rng = np.random.default_rng(0)
    w_scale = np.broadcast_to(np.asarray(w_scale, np.float32), (cout,)).copy()
    bias_scale = np.asarray(in_scale, np.float32) * w_scale if bias_scale is None else \
        np.broadcast_to(np.asarray(bias_scale, np.float32), (cout,)).copy()
    inits = [
        numpy_helper.from_array(np.asarray(in_scale, np.float32), "in_scale"),
        numpy_helper.from_array(np.asarray(0, np.int8), "in_zp"),
        numpy_helper.from_array(rng.integers(-127, 128, (cout, cin, 3, 3)).astype(np.int8), "w_q"),
        numpy_helper.from_array(w_scale, "w_scale"),
        numpy_helper.from_array(np.zeros(cout, np.int8), "w_zp"),
        numpy_helper.from_array(rng.integers(-500, 500, cout).astype(np.int32), "b_q"),
        numpy_helper.from_array(bias_scale, "b_scale"),
        numpy_helper.from_array(np.zeros(cout, np.int32), "b_zp"),
        numpy_helper.from_array(np.asarray(out_scale, np.float32), "out_scale"),
        numpy_helper.from_array(np.asarray(0, np.uint8), "out_zp"),
    ]
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "in_scale", "in_zp"], ["xq"], name="q_in"),
        helper.make_node("DequantizeLinear", ["xq", "in_scale", "in_zp"], ["xd"], name="dq_in"),
        helper.make_node("DequantizeLinear", ["w_q", "w_scale", "w_zp"], ["wd"], name="dq_w", axis=0),
        helper.make_node("DequantizeLinear", ["b_q", "b_scale", "b_zp"], ["bd"], name="dq_b", axis=0),
        helper.make_node("Conv", ["xd", "wd", "bd"], ["c"], name="conv", kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["r"], name="relu"),
        helper.make_node("QuantizeLinear", ["r", "out_scale", "out_zp"], ["rq"], name="q_out"),
        helper.make_node("DequantizeLinear", ["rq", "out_scale", "out_zp"], ["y"], name="dq_out"),
    ]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, cin, size, size])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, cout, size, size])], inits)
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)]), str(path))
    return str(path)


def float_conv_model(path, batch=1, cin=3, size=8):
    """A float model (no Q/DQ): Conv -> Relu -> GlobalAveragePool -> Flatten -> Gemm."""
    rng = np.random.default_rng(1)
    inits = [numpy_helper.from_array(rng.standard_normal((4, cin, 3, 3)).astype(np.float32), "w"),
             numpy_helper.from_array(rng.standard_normal(4).astype(np.float32), "b"),
             numpy_helper.from_array(rng.standard_normal((3, 4)).astype(np.float32), "fw"),
             numpy_helper.from_array(rng.standard_normal(3).astype(np.float32), "fb")]
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv", kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"], name="relu"),
             helper.make_node("GlobalAveragePool", ["r"], ["p"], name="gap"),
             helper.make_node("Flatten", ["p"], ["f"], name="flat", axis=1),
             helper.make_node("Gemm", ["f", "fw", "fb"], ["y"], name="fc", transB=1)]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, cin, size, size])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 3])], inits)
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)]), str(path))
    return str(path)


def _listing(d):
    return sorted(os.listdir(d))


def expect_error(capsys, fn, argv, *fragments, out_dir=None, prog="qcompile", before_loading=False):
    """``fn(argv)`` exits 2 with exactly one ``<prog>: error:`` line on stderr containing every fragment, no stack
    trace, and leaves ``out_dir`` as it was; ``before_loading``: refused before any progress line (TVM not loaded,
    nothing built)."""
    before = _listing(out_dir) if out_dir else None
    rc = fn(argv)
    cap = capsys.readouterr()
    err = cap.err
    assert rc == 2, (rc, err, cap.out)
    assert "Traceback" not in err and "Traceback" not in cap.out, err
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith(f"{prog}: warning:")]
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), err
    for f in fragments:
        assert f in lines[0], f"expected {f!r} in: {lines[0]}"
    if out_dir:
        assert _listing(out_dir) == before, f"left behind: {set(_listing(out_dir)) - set(before)}"
    if before_loading:
        assert cap.out == "", cap.out
    return lines[0]


@pytest.fixture(scope="module")
def conv_model(tmp_path_factory):
    return qdq_conv_model(tmp_path_factory.mktemp("models") / "conv.onnx")


@pytest.fixture
def out(tmp_path):
    """An empty output folder."""
    d = tmp_path / "out"
    d.mkdir()
    return d


# ------------------------------------------------------------------------------------------------ paths, options
def test_output_path_checks(conv_model, out, capsys, tmp_path):
    so = str(out / "m.so")
    expect_error(capsys, qcompile_main, [conv_model, "-o", str(out)], "is a folder", out_dir=out, before_loading=True)
    expect_error(capsys, qcompile_main, [conv_model, "-o", str(out / "no" / "m.so")], "no", "does not exist",
                 out_dir=out)
    expect_error(capsys, qcompile_main, [conv_model, "-o", conv_model], "is the input model itself")
    expect_error(capsys, qcompile_main, [conv_model, "-o", str(out / "m.onnx")], "must end with .so", out_dir=out)
    (out / "m.weights.npz").mkdir()  # the weights file beside m.so is a folder
    expect_error(capsys, qcompile_main, [conv_model, "--weights-beside", "-o", so], "m.weights.npz", "is a folder",
                 out_dir=out)
    from qcompile.checks import _probe_writable

    target = tmp_path / "ro"
    target.mkdir()
    target.chmod(0o500)
    if _probe_writable(str(target)) is None:  # root writes anywhere but a read-only mount
        target = "/sys"
        if _probe_writable(target) is None:
            pytest.skip("no unwritable folder on this host")
    expect_error(capsys, qcompile_main, [conv_model, "-o", os.path.join(str(target), "m.so")], "cannot write",
                 str(target))


def test_output_folder_options(conv_model, out, capsys):
    f = out / "afile"
    f.write_text("x")
    expect_error(capsys, qcompile_main, [conv_model, "--dump-ir", str(f), "-o", str(out / "m.so")], "--dump-ir",
                 "is a file", out_dir=out)


@pytest.mark.parametrize("argv, fragments", [
    (["--arch", "sm_80"], ["--arch sm_80", "--target cuda only"]),
    (["--emit-cuda", "DIR"], ["--emit-cuda needs --target cuda"]),
    (["--batch", "0"], ["--batch must be a positive integer, got 0"]),
    (["--batch", "-2"], ["--batch must be a positive integer, got -2"]),
    (["--net", "resnet18"], ["--net applies to HAWQ checkpoints only", "conv.onnx"]),
    (["--input-size", "16"], ["--input-size applies to HAWQ checkpoints only"]),
])
def test_option_combinations(conv_model, out, capsys, argv, fragments):
    """Refused before TVM is loaded: no "building for llvm sm_90", no build before --emit-cuda is refused."""
    argv = [a.replace("DIR", str(out / "cu")) for a in argv]
    expect_error(capsys, qcompile_main, [conv_model, *argv, "-o", str(out / "m.so")], *fragments, out_dir=out,
                 before_loading=True)


def test_calibrate_only_for_float_onnx(out, capsys, tmp_path):
    h = tmp_path / "m.pth"
    h.write_bytes(b"x")
    c = tmp_path / "c.npy"
    np.save(c, np.zeros((1, 3, 8, 8), np.float32))
    expect_error(capsys, qcompile_main, [str(h), "--net", "resnet_tiny", "--calibrate", str(c), "-o", str(out / "m.so")],
                 "--calibrate applies to float ONNX models only", "m.pth", out_dir=out)
    expect_error(capsys, qcompile_main, [str(h), "--net", "resnet_tiny", "--input-size", "0", "-o",
                                         str(out / "m.so")], "--input-size must be a positive integer", out_dir=out)


def test_model_file_checks(out, capsys, tmp_path):
    expect_error(capsys, qcompile_main, [str(tmp_path / "none.onnx"), "-o", str(out / "m.so")], "none.onnx",
                 "does not exist", out_dir=out)
    expect_error(capsys, qcompile_main, [str(out), "-o", str(out / "m.so")], "is a folder", out_dir=out)
    empty = tmp_path / "empty.onnx"
    empty.write_bytes(b"")
    expect_error(capsys, qcompile_main, [str(empty), "-o", str(out / "m.so")], "empty.onnx", "is empty", out_dir=out)
    odd = tmp_path / "model.13"
    odd.write_bytes(b"x")
    expect_error(capsys, qcompile_main, [str(odd), "-o", str(out / "m.so")], "model.13", "cannot tell the format",
                 out_dir=out)


def _path_with(tmp_path, name, tools):
    """A PATH folder holding only ``tools`` (name -> path of the real one)."""
    d = tmp_path / name
    d.mkdir()
    for t, real in tools.items():
        os.symlink(real, d / t)
    return str(d)


def test_toolchain_checks(conv_model, out, capsys, tmp_path, monkeypatch):
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("g++ is not installed")
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("PATH", _path_with(tmp_path, "none", {}))
    expect_error(capsys, qcompile_main, [conv_model, "-o", str(out / "m.so")], "no C++ compiler found (g++)",
                 "install g++", out_dir=out, before_loading=True)
    monkeypatch.setenv("CXX", "no-such-compiler")
    expect_error(capsys, qcompile_main, [conv_model, "-o", str(out / "m.so")], "no-such-compiler", out_dir=out)
    monkeypatch.delenv("CXX")
    monkeypatch.setenv("PATH", _path_with(tmp_path, "gxx", {"g++": gxx}))
    expect_error(capsys, qcompile_main, [conv_model, "--target", "cuda", "-o", str(out / "m.so")],
                 "--target cuda needs nvcc", "CUDA toolkit", out_dir=out, before_loading=True)


# ------------------------------------------------------------------------------------------------ ONNX models
def test_onnx_opsets(out, capsys, tmp_path):
    p9 = qdq_conv_model(tmp_path / "o9.onnx", opset=9)
    expect_error(capsys, qcompile_main, [p9, "-o", str(out / "m.so")], "o9.onnx", "opset 9 is not supported",
                 "10+", "13+", out_dir=out)
    p12 = qdq_conv_model(tmp_path / "o12.onnx", opset=12)  # per-channel weights need 13
    expect_error(capsys, qcompile_main, [p12, "-o", str(out / "m.so")], "opset", out_dir=out)
    p99 = qdq_conv_model(tmp_path / "o99.onnx", opset=99)
    expect_error(capsys, qcompile_main, [p99, "-o", str(out / "m.so")], "o99.onnx", "opset 99", out_dir=out)
    corrupt = tmp_path / "c.onnx"
    corrupt.write_bytes(open(p9, "rb").read()[:-40])
    expect_error(capsys, qcompile_main, [str(corrupt), "-o", str(out / "m.so")], "c.onnx", "corrupt or truncated",
                 out_dir=out)


@pytest.mark.parametrize("scales, fragments", [
    (dict(out_scale=0.0), ["node 'q_out' (QuantizeLinear)", "scale 'out_scale'", "is zero"]),
    (dict(out_scale=float("nan")), ["node 'q_out'", "is NaN"]),
    (dict(in_scale=float("inf")), ["node 'q_in'", "scale 'in_scale'", "is infinite"]),
    (dict(w_scale=-0.01), ["node 'dq_w' (DequantizeLinear)", "scale 'w_scale'", "is negative", "channel 0"]),
    (dict(out_scale=1e-40), ["node 'q_out'", "is denormal"]),
    (dict(b_scale=0.0), ["node 'dq_b'", "scale 'b_scale'", "is zero"]),
    # the float bias is 1e31 accumulator steps of s_in x s_w: beyond int32 (an int64 overflow, unchecked)
    (dict(w_scale=1e-30, bias_scale=5e-4), ["node 'conv", "bias", "int32"]),
    (dict(out_scale=1e-13), ["quantize 'q_out'", "too large"]),      # requantize multiplier >= 2^30
    (dict(out_scale=1e30), ["quantize 'q_out'", "rounds to 0"]),     # the output would ignore the input
])
def test_bad_scales(out, capsys, tmp_path, scales, fragments):
    """NaN / Inf / zero / negative / denormal scales, an int32 bias overflow and requantize multipliers out of range:
    refused with the node and the scale tensor named, never a module whose output ignores its input."""
    if "b_scale" in scales:
        scales = dict(bias_scale=scales.pop("b_scale"), **scales)
    m = qdq_conv_model(tmp_path / "bad.onnx", **scales)
    expect_error(capsys, qcompile_main, [m, "-o", str(out / "m.so")], *fragments, out_dir=out)


def test_zero_point_out_of_range():
    """Every frontend builds through QDQBuilder, which refuses a zero point outside its type's range."""
    from qcompile.qdq import QDQBuilder, QTYPES

    b = QDQBuilder()
    x = b.input("x", [1, 3, 4, 4])
    with pytest.raises(QCompileError, match=r"quantize 'q_in': the zero point 300 is outside the uint8 range \[0, 255\]"):
        b.quantize(x, 0.1, 300, QTYPES["uint8"], name="q_in")
    with pytest.raises(QCompileError, match=r"the zero point 9 is outside the int4 range \[-8, 7\]"):
        b.quantize(x, 0.1, 9, QTYPES["int4"], name="q4")
    with pytest.raises(QCompileError, match="weight 'w': 3 per-channel scales for a weight of shape"):
        b.qweight(np.zeros((4, 3, 1, 1), np.int8), np.ones(3), QTYPES["int8"], name="w")
    with pytest.raises(QCompileError, match=r"bias 'b': values in \[.*\] exceed the int32 range"):
        b.qbias(np.array([3e9]), 0.1, name="b")
    b.discard()


# ------------------------------------------------------------------------------------------------ calibration data
def _calib_cases(tmp_path):
    rng = np.random.default_rng(2)
    good = rng.random((4, 3, 8, 8)).astype(np.float32)
    nan = good.copy()
    nan[1, 2, 3, 4] = np.nan
    inf = good.copy()
    inf[0, 0, 0, 0] = np.inf
    cases = {
        "empty.npy": (np.zeros((0, 3, 8, 8), np.float32), ["empty.npy", "is empty"]),
        "nan.npy": (nan, ["nan.npy", "NaN/Inf", "(1, 2, 3, 4)"]),
        "inf.npy": (inf, ["inf.npy", "NaN/Inf"]),
        "rank3.npy": (good[0], ["rank3.npy", "expected 4-D NCHW"]),
        "channels.npy": (rng.random((4, 1, 8, 8)).astype(np.float32), ["channels.npy", "1 channels", "takes 3"]),
        "hw.npy": (rng.random((4, 3, 9, 9)).astype(np.float32), ["hw.npy", "9x9", "8x8"]),
        "ints.npy": (np.ones((4, 3, 8, 8), np.uint8), ["ints.npy", "dtype uint8"]),
    }
    paths = {}
    for name, (arr, frag) in cases.items():
        np.save(tmp_path / name, arr)
        paths[name] = (str(tmp_path / name), frag)
    np.savez(tmp_path / "arch.npz", a=good)
    paths["arch.npz"] = (str(tmp_path / "arch.npz"), ["arch.npz", ".npz archive"])
    obj = np.empty(2, dtype=object)
    obj[:] = [good, good]
    np.save(tmp_path / "obj.npy", obj, allow_pickle=True)
    paths["obj.npy"] = (str(tmp_path / "obj.npy"), ["obj.npy", "Python objects"])
    return paths


def test_bad_calibration_data(out, capsys, tmp_path):
    model = float_conv_model(tmp_path / "f.onnx")
    for name, (path, frags) in _calib_cases(tmp_path).items():
        expect_error(capsys, qcompile_main, [model, "--bits", "8", "--calibrate", path, "-o", str(out / "m.so")],
                     "calibration data", *frags, out_dir=out)
    fixed4 = float_conv_model(tmp_path / "f4.onnx", batch=4)
    few = tmp_path / "few.npy"
    np.save(few, np.random.default_rng(3).random((2, 3, 8, 8)).astype(np.float32))
    expect_error(capsys, qcompile_main, [fixed4, "--bits", "8", "--calibrate", str(few), "-o", str(out / "m.so")],
                 "few.npy", "has 2 images", "at least 4", out_dir=out)


def test_npy_pickle_payload_runs_no_code(out, capsys, tmp_path):
    """A .npy whose object array unpickles into os.system: refused, the command never runs."""
    marker = tmp_path / "PWNED"
    payload = tmp_path / "evil.npy"
    np.save(payload, np.array([_Payload(str(marker))], dtype=object), allow_pickle=True)
    model = float_conv_model(tmp_path / "f.onnx")
    expect_error(capsys, qcompile_main, [model, "--bits", "8", "--calibrate", str(payload), "-o", str(out / "m.so")],
                 "evil.npy", "Python objects", out_dir=out)
    assert not marker.exists()
    np.load(payload, allow_pickle=True)  # the payload is live: unpickled, it does run
    assert marker.exists()


# ------------------------------------------------------------------------------------------------ pickles
class _Payload:
    """Unpickling this runs ``touch <marker>`` (what a crafted checkpoint could do with any command)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _proves_live(path, marker):
    """The payload in ``path`` does run when unpickled without weights_only (so the tests below can fail)."""
    import torch

    torch.load(path, weights_only=False)
    assert os.path.exists(marker), "the crafted payload did not run under an unsafe load"
    os.remove(marker)


def test_hawq_pickle_payload_runs_no_code(out, capsys, tmp_path):
    import torch

    marker, ck = str(tmp_path / "PWNED"), str(tmp_path / "evil.pth")
    torch.save({"weight_integer": {"x": _Payload(marker)}, "bias_integer": {}}, ck)
    _proves_live(ck, marker)
    expect_error(capsys, qcompile_main, [ck, "--net", "resnet_tiny", "-o", str(out / "m.so")], "evil.pth",
                 "could run code", out_dir=out)
    assert not os.path.exists(marker)


def test_qmodel_weights_pickle_payload_runs_no_code(out, capsys, tmp_path):
    import torch

    from qcompile.models.cli import main as qmodel_main

    marker, w = str(tmp_path / "PWNED"), str(tmp_path / "evil.pt")
    torch.save({"state_dict": _Payload(marker)}, w)
    _proves_live(w, marker)
    expect_error(capsys, qmodel_main, ["resnet_tiny", "--weights", w, "-q", "-o", str(out / "m.onnx")], "evil.pt",
                 "could run code", out_dir=out, prog="qmodel")
    assert not os.path.exists(marker)


@pytest.fixture(scope="module")
def tiny_pt2(tmp_path_factory):
    from qcompile.models.cli import main as qmodel_main

    d = tmp_path_factory.mktemp("pt2")
    assert qmodel_main(["resnet_tiny", "--format", "pt2", "--input-size", "8", "-q", "-o", str(d / "t.pt2")]) == 0
    return str(d / "t.pt2")


def test_pt2_pickle_payload_runs_no_code(tiny_pt2, out, capsys, tmp_path):
    """torch.export.load unpickles pickled weights with weights_only=False: a .pt2 whose weight is a payload runs it
    under a plain torch.export.load, and is refused by qcompile with nothing run."""
    import torch

    marker, evil = str(tmp_path / "PWNED"), str(tmp_path / "evil.pt2")
    buf = io.BytesIO()
    torch.save(_Payload(marker), buf)
    with zipfile.ZipFile(tiny_pt2) as zin, zipfile.ZipFile(evil, "w", zipfile.ZIP_STORED) as zout:
        cfg_name = next(n for n in zin.namelist() if n.endswith("weights_config.json"))
        cfg = json.loads(zin.read(cfg_name))
        fqn, meta = next(iter(cfg["config"].items()))
        meta["use_pickle"] = True
        for info in zin.infolist():
            data = zin.read(info.filename)
            if info.filename == cfg_name:
                data = json.dumps(cfg).encode()
            elif info.filename.endswith("/data/weights/" + meta["path_name"]):
                data = buf.getvalue()
            zout.writestr(info, data)
    try:
        torch.export.load(evil)
    except Exception:  # noqa: BLE001  (whether the load then fails does not matter: the payload ran)
        pass
    assert os.path.exists(marker), "the crafted .pt2 did not run its payload under a plain torch.export.load"
    os.remove(marker)
    expect_error(capsys, qcompile_main, [evil, "-o", str(out / "m.so")], "evil.pt2", "could run code", out_dir=out)
    assert not os.path.exists(marker)


# ------------------------------------------------------------------------------------------------ HAWQ
@pytest.fixture(scope="module")
def tiny_hawq(tmp_path_factory):
    from qcompile.models.cli import main as qmodel_main

    d = tmp_path_factory.mktemp("hawq")
    assert qmodel_main(["resnet_tiny", "--format", "hawq", "--input-size", "8", "-q", "-o", str(d / "t.pth")]) == 0
    return str(d / "t.pth")


def test_hawq_wrong_net(tiny_hawq, out, capsys):
    expect_error(capsys, qcompile_main, [tiny_hawq, "--net", "resnet18", "-o", str(out / "m.so")], "t.pth",
                 "does not match --net resnet18", "quant_init_block_convbn", "16x3x3x3", "64x3x7x7",
                 "it fits --net resnet_tiny", out_dir=out)
    expect_error(capsys, qcompile_main, [tiny_hawq, "--net", "resnet50", "-o", str(out / "m.so")],
                 "does not match --net resnet50", "quant_init_convbn", out_dir=out)


def test_hawq_bad_values(tiny_hawq, out, capsys, tmp_path):
    import torch

    ck = torch.load(tiny_hawq, weights_only=True)
    k = next(k for k in ck["act_scaling_factor"] if "quant_input" in k)
    bad = dict(ck, act_scaling_factor=dict(ck["act_scaling_factor"], **{k: torch.tensor([0.0])}))
    p = str(tmp_path / "zero.pth")
    torch.save(bad, p)
    expect_error(capsys, qcompile_main, [p, "--net", "resnet_tiny", "-o", str(out / "m.so")],
                 "HAWQ activation 'quant_input'", "is zero", out_dir=out)
    kb = next(iter(ck["bias_integer"]))
    big = dict(ck, bias_integer=dict(ck["bias_integer"], **{kb: ck["bias_integer"][kb].double() + 4e9}))
    p = str(tmp_path / "bias.pth")
    torch.save(big, p)
    expect_error(capsys, qcompile_main, [p, "--net", "resnet_tiny", "-o", str(out / "m.so")], "exceed the int32 range",
                 out_dir=out)


# ------------------------------------------------------------------------------------------------ qmodel
@pytest.mark.parametrize("argv, fragments", [
    (["--input-size", "0"], ["--input-size must be a positive integer, got 0"]),
    (["--input-size", "-4"], ["--input-size must be a positive integer, got -4"]),
    (["--batch", "-1"], ["--batch must be 0 (a dynamic batch) or a positive integer, got -1"]),
    (["--in-ch", "0"], ["--in-ch must be a positive integer"]),
    (["--calib-samples", "0"], ["--calib-samples must be a positive integer"]),
    (["--format", "pt2"], ["must end with .pt2", "--format pt2"]),
    (["--save-input", "OUT/x.txt"], ["--save-input", "must end with .npy"]),
    (["--save-input", "OUT/m.onnx"], ["--save-input", "is the -o output itself"]),
    (["--weights", "OUT/none.pt"], ["--weights file", "none.pt", "does not exist"]),
])
def test_qmodel_argument_checks(out, capsys, argv, fragments):
    from qcompile.models.cli import main as qmodel_main

    argv = [a.replace("OUT", str(out)) for a in argv]
    expect_error(capsys, qmodel_main, ["resnet_tiny", *argv, "-q", "-o", str(out / "m.onnx")], *fragments,
                 out_dir=out, prog="qmodel")


def test_qmodel_names_and_paths(out, capsys, tmp_path):
    from qcompile.models.cli import MODEL_NAMES, main as qmodel_main
    from qcompile.models.resnet import MODELS

    assert set(MODELS) <= set(MODEL_NAMES)  # (the CLI names the networks without importing torch)
    expect_error(capsys, qmodel_main, ["resnet19", "-q", "-o", str(out / "m.onnx")], "unknown model 'resnet19'",
                 out_dir=out, prog="qmodel")
    expect_error(capsys, qmodel_main, ["resnet_tiny", "-q", "-o", str(out)], "is a folder", out_dir=out, prog="qmodel")
    expect_error(capsys, qmodel_main, ["resnet_tiny", "-q", "-o", str(out / "x" / "m.onnx")], "does not exist",
                 out_dir=out, prog="qmodel")
    bad = tmp_path / "bits.json"
    bad.write_text("{not json")
    expect_error(capsys, qmodel_main, ["resnet_tiny", "--bits", str(bad), "-q", "-o", str(out / "m.onnx")],
                 "bits.json", "JSON", out_dir=out, prog="qmodel")


def test_qmodel_bad_calibration_and_weights(out, capsys, tmp_path):
    import torch

    from qcompile.models.cli import main as qmodel_main
    from qcompile.models.resnet import build_model

    paths = _calib_cases(tmp_path)
    for name in ("empty.npy", "nan.npy", "rank3.npy", "obj.npy"):
        path, frags = paths[name]
        expect_error(capsys, qmodel_main, ["resnet_tiny", "--calibrate", path, "-q", "-o", str(out / "m.onnx")],
                     *frags, out_dir=out, prog="qmodel")
    w = str(tmp_path / "r18.pt")
    torch.save(build_model("resnet_tiny", num_classes=7).state_dict(), w)
    expect_error(capsys, qmodel_main, ["resnet_tiny", "--weights", w, "-q", "-o", str(out / "m.onnx")], "r18.pt",
                 "does not fit resnet_tiny", "fc.weight", out_dir=out, prog="qmodel")


# ------------------------------------------------------------------------------------------------ atomic outputs
def _fake_linker(tmp_path):
    """A C++ "compiler" that writes half an output file and fails, as a linker out of disk space would."""
    f = tmp_path / "fake-g++"
    f.write_text('#!/bin/sh\nprev=""\nfor a in "$@"; do [ "$prev" = "-o" ] && echo half > "$a"; prev="$a"; done\n'
                 'echo "ld: final link failed: No space left on device" >&2\nexit 1\n')
    f.chmod(0o755)
    return str(f)


def test_link_failure_leaves_nothing(conv_model, out, capsys, tmp_path, monkeypatch):
    """The .so is linked to a temporary file and renamed: a failed link leaves neither a half-written .so nor a
    temporary file, and says what failed."""
    (out / "m.so").write_bytes(b"an older module")
    monkeypatch.setenv("CXX", _fake_linker(tmp_path))
    expect_error(capsys, qcompile_main, [conv_model, "--weights-beside", "-q", "-o", str(out / "m.so")],
                 "linking", "m.so", "fake-g++", "No space left on device", out_dir=out)
    assert (out / "m.so").read_bytes() == b"an older module"


def test_export_failure_leaves_nothing(conv_model, out, monkeypatch):
    """A failure while writing the second file (the weights) removes the first one too."""
    from qcompile.driver import CompileOptions, compile_model

    res = compile_model(conv_model, CompileOptions(weights_beside=True), log=lambda s: None)

    def full_disk(f, **kw):
        f.write(b"PK half a file")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(np, "savez", full_disk)
    with pytest.raises(QCompileError, match="cannot write .*m.so.*No space left on device"):
        res.export(str(out / "m.so"))
    assert _listing(out) == []
    monkeypatch.undo()
    res.export(str(out / "m.so"))
    assert _listing(out) == ["m.so", "m.weights.npz"]


def test_qmodel_failure_leaves_nothing(out, capsys, monkeypatch):
    """qmodel writes the model and the --save-* arrays all or nothing."""
    from qcompile.models.cli import main as qmodel_main

    real_save, calls = np.save, []

    def save(path, arr, *a, **kw):
        calls.append(path)
        if len(calls) == 2:
            with open(path, "wb") as f:
                f.write(b"\x93NUMPY half")
            raise OSError(28, "No space left on device")
        return real_save(path, arr, *a, **kw)

    monkeypatch.setattr(np, "save", save)
    expect_error(capsys, qmodel_main, ["resnet_tiny", "--input-size", "8", "-q", "-o", str(out / "m.onnx"),
                                       "--save-input", str(out / "x.npy"), "--save-output", str(out / "y.npy")],
                 "cannot write", "No space left on device", out_dir=out, prog="qmodel")
    assert len(calls) == 2 and _listing(out) == []


# ------------------------------------------------------------------------------------------------ CLI behaviour
def test_internal_error_is_one_line(conv_model, out, capsys, monkeypatch):
    import qcompile.driver

    def boom(*a, **kw):
        raise RuntimeError("boom\nsecond line")

    monkeypatch.setattr(qcompile.driver, "compile_model", boom)
    assert qcompile_main([conv_model, "-q", "-o", str(out / "m.so")]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.startswith("qcompile: internal error: RuntimeError: boom\n"), err
    assert "please report" in err and "QCOMPILE_DEBUG=1" in err and "second line" not in err
    monkeypatch.setenv("QCOMPILE_DEBUG", "1")
    assert qcompile_main([conv_model, "-q", "-o", str(out / "m.so")]) == 1
    assert "Traceback" in capsys.readouterr().err
    assert _listing(out) == []


def test_warnings_are_one_line(conv_model, out, capsys, monkeypatch):
    import qcompile.driver

    def warn_then_fail(*a, **kw):
        warnings.warn("the scale looks odd\nsecond line of detail", UserWarning)
        raise QCompileError("stop here")

    monkeypatch.setattr(qcompile.driver, "compile_model", warn_then_fail)
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        assert qcompile_main([conv_model, "-q", "-o", str(out / "m.so")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == ["qcompile: warning: the scale looks odd", "qcompile: error: stop here"], err


def test_help_imports_nothing_heavy(tmp_path):
    """``qcompile --help`` and ``qmodel --help`` (and every check before the build) import neither TVM nor PyTorch nor
    ONNX: they answer at once."""
    code = ("import sys, contextlib, io\n"
            "from qcompile.cli import qcompile_main\nfrom qcompile.models.cli import main\n"
            "for f in (qcompile_main, main):\n"
            "    with contextlib.redirect_stdout(io.StringIO()):\n"
            "        try: f(['--help'])\n"
            "        except SystemExit: pass\n"
            "rc = qcompile_main([sys.argv[1], '-o', '/nonexistent/m.so'])\n"
            "heavy = sorted(m for m in ('tvm', 'torch', 'onnx', 'onnxruntime', 'numpy') if m in sys.modules)\n"
            "print(rc, heavy)")
    model = tmp_path / "m.onnx"
    model.write_bytes(b"not read before the output path is refused")
    r = subprocess.run([sys.executable, "-c", code, str(model)], capture_output=True, text=True)
    assert r.stdout.strip() == "2 []", (r.stdout, r.stderr)


def _exit_code(main, argv):
    """``main(argv)``'s return value, or the status of the SystemExit argparse raises for a usage error."""
    try:
        return main(argv)
    except SystemExit as e:
        return e.code


@pytest.mark.parametrize("argv,fragment", [([], "required"), (["m.onnx"], "-o/--output"),
                                           (["m.onnx", "-o", "m.so", "--batch", "abc"], "--batch"),
                                           (["m.onnx", "-o", "m.so", "--layout", "NCWH"], "--layout")])
def test_usage_errors_are_one_line(capsys, argv, fragment):
    """argparse's usage errors (a missing argument, a bad value) are one line too, not the usage block."""
    expect_error(capsys, lambda a: _exit_code(qcompile_main, a), argv, fragment, before_loading=True)


def test_qmodel_usage_errors_are_one_line(capsys):
    from qcompile.models.cli import main as qmodel_main

    expect_error(capsys, lambda a: _exit_code(qmodel_main, a), ["digits", "--seed", "x"], "--seed", prog="qmodel",
                 before_loading=True)
