"""The CLIs end to end, and every class of bad input: one clear message, non-zero exit, no stack trace."""
import os
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from qcompile.cli import qcompile_main
from qcompile.runtime import qrun_main


@pytest.fixture(scope="module")
def tiny_q8(tmp_path_factory):
    """A quantized resnet_tiny exported by `qmodel` (the CLI users type)."""
    d = tmp_path_factory.mktemp("cli")
    onnx_path, x_path = str(d / "t8.onnx"), str(d / "x.npy")
    r = subprocess.run([sys.executable, "-m", "qcompile.models.cli", "resnet_tiny", "--bits", "8", "--format", "onnx",
                        "--input-size", "16", "-o", onnx_path, "--save-input", x_path],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return d, onnx_path, x_path


def _expect_error(capsys, fn, argv, *fragments):
    rc = fn(argv)
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "Traceback" not in err
    for f in fragments:
        assert f in err, f"expected {f!r} in: {err}"
    return err


def test_qcompile_then_qrun(tiny_q8, capsys):
    d, model, x = tiny_q8
    so, y = str(d / "t8.so"), str(d / "y.npy")
    assert qcompile_main([model, "--layout", "NHWC", "-o", so]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    # progress from the first line (before TVM loads) to the last (the link is a step of its own, with its time)
    assert lines[0] == "loading the compiler (TVM) ..." and "[1/4] importing" in out and "conv2d" in out
    step4 = next(i for i, ln in enumerate(lines) if ln.startswith("[4/4] writing " + so))
    assert lines[step4 + 1].strip().startswith("done in") and lines[-1].startswith(f"wrote {so}")
    assert qrun_main([so, "--input", x, "--output", y]) == 0
    assert np.load(y).shape == (1, 10)
    # qrun needs only the runtime: TVM in runtime-only mode (libtvm_runtime, no compiler library)
    code = ("import sys, qcompile.runtime as r; rc = r.qrun_main([sys.argv[1], '--input', sys.argv[2]]); "
            "from tvm.base import _LOADED_LIBS; assert list(_LOADED_LIBS) == ['tvm_runtime'], _LOADED_LIBS; "
            "assert 'tvm.relax' not in sys.modules and 'qcompile.driver' not in sys.modules; sys.exit(rc)")
    env = dict(os.environ, TVM_USE_RUNTIME_LIB="1")
    p = subprocess.run([sys.executable, "-c", code, so, x], capture_output=True, text=True, env=env)
    assert p.returncode == 0, p.stderr


def test_dump_ir(tiny_q8, tmp_path):
    """--dump-ir DIR writes the module after each phase of the pipeline (llvm: no tensor-core phase; the CPU kernels'
    dispatch where the host has AVX2)."""
    from qcompile.schedules.cpu_conv import host_has_avx2

    _, model, _ = tiny_q8
    dump = tmp_path / "ir"
    assert qcompile_main([model, "-q", "--layout", "NHWC", "--dump-ir", str(dump), "-o", str(tmp_path / "m.so")]) == 0
    cpu = ["3_dispatched.py"] if host_has_avx2() else []
    assert sorted(os.listdir(dump)) == ["1_qdq.py", "2_integer.py", *cpu, "3_packed.py", "4_deploy.py", "5_lowered.py"]
    ir = {f[:-3]: (dump / f).read_text() for f in os.listdir(dump)}
    if cpu:
        assert "R.call_tir" in ir["3_dispatched"] and "R.call_tir" not in ir["2_integer"]
    assert "R.quantize" in ir["1_qdq"] and "R.quantize" not in ir["2_integer"] and "R.nn.conv2d" in ir["2_integer"]
    assert "qcompile_meta" in ir["4_deploy"] and "qcompile_meta" not in ir["3_packed"]
    assert "T.prim_func" in ir["5_lowered"] and "R.nn.conv2d" not in ir["5_lowered"]


def test_float_model_without_calibration(tmp_path, capsys):
    f = str(tmp_path / "f.onnx")
    import torch
    from qcompile.models.resnet import build_model

    torch.onnx.export(build_model("resnet_tiny"), (torch.randn(1, 3, 16, 16),), f, input_names=["input"], dynamo=False)
    _expect_error(capsys, qcompile_main, [f, "--bits", "8", "-o", str(tmp_path / "m.so")], "float model", "--calibrate")
    _expect_error(capsys, qcompile_main, [f, "-o", str(tmp_path / "m.so")], "float model", "--bits")


def _qdq_model_with(op_type, path):
    """input -> Q -> DQ -> <op_type> -> Q -> DQ -> output."""
    s = helper.make_tensor("s", TensorProto.FLOAT, [], [0.1])
    z = helper.make_tensor("z", TensorProto.INT8, [], [0])
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"], name="q_in"),
             helper.make_node("DequantizeLinear", ["q", "s", "z"], ["d"], name="dq_in"),
             helper.make_node(op_type, ["d"], ["t"], name="my_" + op_type.lower()),
             helper.make_node("QuantizeLinear", ["t", "s", "z"], ["q2"], name="q_out"),
             helper.make_node("DequantizeLinear", ["q2", "s", "z"], ["y"], name="dq_out")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 8, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])], [s, z])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)]), path)


def test_unsupported_op_is_named(tmp_path, capsys):
    p = str(tmp_path / "exp.onnx")
    _qdq_model_with("Exp", p)  # (Sigmoid and the other activations lower to tables; Exp has no lowering)
    _expect_error(capsys, qcompile_main, [p, "-o", str(tmp_path / "m.so")], "Exp", "my_exp")


def test_bad_bit_width(tiny_q8, tmp_path, capsys):
    _, model, _ = tiny_q8
    with pytest.raises(SystemExit) as e:  # argparse: not one of 8|4|mixed
        qcompile_main([model, "--bits", "3", "-o", str(tmp_path / "m.so")])
    assert e.value.code == 2 and "invalid choice: '3'" in capsys.readouterr().err
    # a model whose tensor has a 2-bit range
    from qcompile.errors import QCompileError
    from qcompile.qdq import qtype, qtype_from_range

    with pytest.raises(QCompileError, match="bit width 2"):
        qtype(2, True, "layer conv1")
    with pytest.raises(QCompileError, match=r"range \[-2, 1\]"):
        qtype_from_range("int8", -2, 1, "node q")
    # qmodel rejects it too
    r = subprocess.run([sys.executable, "-m", "qcompile.models.cli", "resnet_tiny", "--bits", "6", "--format", "onnx",
                        "-o", str(tmp_path / "x.onnx")], capture_output=True, text=True)
    assert r.returncode != 0 and "Traceback" not in r.stderr


def test_conflicting_bits(tiny_q8, tmp_path, capsys):
    _, model, _ = tiny_q8
    _expect_error(capsys, qcompile_main, [model, "--bits", "4", "-o", str(tmp_path / "m.so")], "--bits 4 conflicts", "'8'")


def test_corrupt_and_truncated_files(tiny_q8, tmp_path, capsys):
    _, model, _ = tiny_q8
    data = open(model, "rb").read()
    trunc = tmp_path / "trunc.onnx"
    trunc.write_bytes(data[: len(data) // 3])
    _expect_error(capsys, qcompile_main, [str(trunc), "-o", str(tmp_path / "m.so")], "trunc.onnx", "corrupt or truncated")
    junk = tmp_path / "junk.pt2"
    junk.write_bytes(b"not a zip file at all")
    _expect_error(capsys, qcompile_main, [str(junk), "-o", str(tmp_path / "m.so")], "junk.pt2", "corrupt or truncated")
    junk_h = tmp_path / "junk.pth"
    junk_h.write_bytes(b"\x80\x02garbage")
    _expect_error(capsys, qcompile_main, [str(junk_h), "--net", "resnet18", "-o", str(tmp_path / "m.so")], "junk.pth")
    _expect_error(capsys, qcompile_main, [str(tmp_path / "missing.onnx"), "-o", str(tmp_path / "m.so")], "does not exist")
    _expect_error(capsys, qcompile_main, [str(tmp_path / "model.xyz"), "-o", str(tmp_path / "m.so")], "does not exist")


def test_hawq_needs_net(tiny_q8, tmp_path, capsys):
    import torch

    p = str(tmp_path / "h.pth")
    torch.save({k: {} for k in ("weight_integer", "bias_integer", "act_scaling_factor", "convbn_scaling_factor",
                                "fc_scaling_factor")}, p)
    _expect_error(capsys, qcompile_main, [p, "-o", str(tmp_path / "m.so")], "--net")


def test_qrun_wrong_input(tiny_q8, capsys):
    d, model, x = tiny_q8
    so = str(d / "t8_err.so")
    assert qcompile_main([model, "-q", "-o", so]) == 0
    bad_shape, bad_dtype = str(d / "bad_shape.npy"), str(d / "bad_dtype.npy")
    np.save(bad_shape, np.random.randn(1, 3, 20, 20).astype("float32"))
    np.save(bad_dtype, np.random.randint(0, 255, (1, 3, 16, 16)).astype("uint8"))
    _expect_error(capsys, qrun_main, [so, "--input", bad_shape], "shape (1, 3, 20, 20)", "(1, 3, 16, 16)")
    _expect_error(capsys, qrun_main, [so, "--input", bad_dtype], "dtype uint8")
    trunc = str(d / "trunc.npy")
    open(trunc, "wb").write(open(x, "rb").read()[:40])
    _expect_error(capsys, qrun_main, [so, "--input", trunc], "cannot read input")
    _expect_error(capsys, qrun_main, [str(d / "none.so"), "--input", x], "does not exist")


def cpp_build_command(src: str, exe: str) -> list:
    """The README's build command for scripts/run_so.cc (TVM runtime + tvm-ffi from the installed wheels)."""
    import sysconfig

    sp = sysconfig.get_paths()["purelib"]
    return ["g++", "-std=c++17", "-O2", src, "-o", exe, f"-I{sp}/tvm_ffi/include", f"-L{sp}/tvm/lib", f"-L{sp}/tvm_ffi/lib",
            "-ltvm_runtime", "-ltvm_ffi", f"-Wl,-rpath,{sp}/tvm/lib", f"-Wl,-rpath,{sp}/tvm_ffi/lib"]


@pytest.mark.skipif(__import__("shutil").which("g++") is None, reason="no C++ compiler")
def test_cpp_loader_runs_the_so(tiny_q8):
    """scripts/run_so.cc loads the .so with libtvm_runtime alone and agrees with qrun."""
    d, model, x = tiny_q8
    so, exe, xbin = str(d / "cpp.so"), str(d / "run_so"), str(d / "x.bin")
    assert qcompile_main([model, "-q", "-o", so]) == 0
    src = os.path.join(os.path.dirname(__file__), "..", "scripts", "run_so.cc")
    r = subprocess.run(cpp_build_command(src, exe), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    xv = np.load(x)
    xv.astype("float32").tofile(xbin)
    out = subprocess.run([exe, so, xbin, *map(str, xv.shape)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    from qcompile.runtime import Module

    assert out.stdout.strip() == f"output 1 x 10; top-1: {int(Module(so)(xv).argmax())}"


def test_weights_beside_file_must_match(tiny_q8, tmp_path, capsys):
    """--weights-beside: the module records a digest of its weights and refuses a weights file with other contents --
    equal shapes included (the kernels of one batch size may take some weights permuted: 8-bit agl records) -- with a
    message naming both files; the right file runs."""
    d, model, x = tiny_q8
    so = str(tmp_path / "wb.so")
    assert qcompile_main([model, "--layout", "NHWC", "--weights-beside", "-o", so]) == 0
    capsys.readouterr()
    wf = so[:-3] + ".weights.npz"
    assert qrun_main([so, "--input", x]) == 0
    with np.load(wf) as z:
        ws = {k: z[k] for k in z.files}
    k = max(ws, key=lambda k: ws[k].size)  # the largest weight, permuted in place: same shape, same dtype
    ws[k] = ws[k].reshape(-1)[::-1].reshape(ws[k].shape)
    np.savez(wf, **ws)
    _expect_error(capsys, qrun_main, [so, "--input", x], "does not match", wf)


_X86 = __import__("platform").machine() in ("x86_64", "AMD64")
A64 = "llvm -mtriple=aarch64-linux-gnu"
BAD_TARGETS = [  # (--target, output suffix, fragments of the one error line); x86: only on an x86-64 host
    ("tpu", ".so", ["--target 'tpu'", "unknown target kind 'tpu'", "llvm, cuda"], False),
    ("", ".so", ["empty target"], False),
    ("llvm -foo=1", ".so", ["unknown option '-foo' for llvm", "-mtriple, -mcpu, -mattr"], False),
    ("llvm mcpu=znver4", ".so", ["'mcpu=znver4' is not an option of the form -name=value"], False),
    ("llvm -mcpu=a -mcpu=b", ".so", ["-mcpu given twice"], False),
    ("llvm -mattr=avx2", ".so", ["-mattr feature 'avx2' must be +NAME"], False),
    ("cuda -arch=sm_80", ".so", ["unknown option '-arch' for cuda", "the GPU architecture is --arch"], False),
    ("llvm -mtriple=foo-linux-gnu", ".tar", ["unknown architecture 'foo' in -mtriple", "x86_64"], False),
    (A64 + " -mcpu=cortex-a7x", ".tar", ["unknown -mcpu 'cortex-a7x' for aarch64", "did you mean"], False),
    (A64 + " -mcpu=native", ".tar", ["-mcpu=native names this", "a build for aarch64 names its CPU"], False),
    (A64 + " -mattr=+dotprd", ".tar", ["unknown -mattr feature 'dotprd' for aarch64", "dotprod"], False),
    ("llvm -mcpu=skylake-avx51", ".so", ["unknown -mcpu 'skylake-avx51' for x86_64", "skylake-avx512"], True),
    ("llvm -mattr=+avx512vni", ".so", ["unknown -mattr feature 'avx512vni'", "avx512vnni"], True),
    ("llvm -mattr=+strict-align", ".so", ["unknown -mattr feature 'strict-align' for x86_64"], True),  # (Arm's)
    ("llvm -mcpu=znver4", ".tar", ["a .tar (object files to link elsewhere) is the output of a cross build"], True),
]


@pytest.mark.parametrize("target,suffix,fragments,x86", BAD_TARGETS, ids=[t[0] or "empty" for t in BAD_TARGETS])
def test_bad_target_string(tiny_q8, tmp_path, capsys, target, suffix, fragments, x86):
    """A bad --target string: one error line naming the string and why (kind, option, -mcpu, -mattr, triple,
    output), exit status 2, nothing written."""
    if x86 and not _X86:
        pytest.skip("x86 CPU and feature names")
    _, model, _ = tiny_q8
    out = tmp_path / f"m{suffix}"
    err = _expect_error(capsys, qcompile_main, [model, "--target", target, "-o", str(out)], *fragments)
    assert len(err.strip().splitlines()) == 1 and not out.exists(), err


def test_mattr_features_no_cpu_enables(capfd):
    """``-mattr`` takes any feature of LLVM's subtarget for the triple, also one that no named CPU enables
    (``retpoline`` on x86, ``strict-align`` on aarch64), and refuses a name LLVM does not know for the triple, with no
    LLVM warning on stderr."""
    from qcompile.registry import parse_target
    from qcompile.schedules.cpu_conv import resolve_target

    good = [A64 + " -mattr=+strict-align,+dotprod"] + (["llvm -mattr=+avx2,+retpoline"] if _X86 else [])
    for text in good:
        tgt, _ = resolve_target(parse_target(text))
        assert [str(f) for f in tgt.attrs["mattr"]] == text.split("-mattr=")[1].split(","), text
    with pytest.raises(ValueError, match="unknown -mattr feature 'retpolin' for aarch64"):
        resolve_target(parse_target(A64 + " -mattr=+retpolin"))
    assert "not a recognized feature" not in capfd.readouterr().err


def test_cross_so_without_cross_linker(tiny_q8, tmp_path, capsys):
    """A cross build's .so needs a linker for its architecture: without one on the PATH, the error (before TVM loads)
    says how to get one or to write the object files with -o NAME.tar."""
    from qcompile.registry import cross_linker

    if cross_linker("aarch64-linux-gnu") is not None:
        pytest.skip("an aarch64 cross linker is on the PATH")
    _, model, _ = tiny_q8
    err = _expect_error(capsys, qcompile_main, [model, "--target", A64 + " -mattr=+dotprod", "-o",
                                                str(tmp_path / "m.so")],
                        "builds aarch64 code", "no linker for it", "g++-aarch64-linux-gnu", "-o NAME.tar")
    assert "loading the compiler" not in capsys.readouterr().out and len(err.strip().splitlines()) == 1
