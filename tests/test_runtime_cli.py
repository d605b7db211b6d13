"""qrun and qcompile.runtime.Module: every bad input gets one `qrun: error:` line and exit status 2 (no trace, nothing
written), a module file is checked before it is loaded, --output is written atomically, --labels prints the top-1
accuracy, and a run imports the TVM runtime alone."""
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from qcompile import runtime as rt
from qcompile.runtime import Module, RunError, qrun_main


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """resnet_tiny (8-bit, 16x16, batch 4) exported by `qmodel` and compiled for llvm with its weights beside the .so;
    its logits on the sample batch, from Module."""
    from qcompile.cli import qcompile_main

    d = tmp_path_factory.mktemp("qrun")
    onnx_path, x = str(d / "tiny16.onnx"), str(d / "x.npy")
    r = subprocess.run([sys.executable, "-m", "qcompile.models.cli", "resnet_tiny", "--bits", "8", "--input-size", "16",
                        "--batch", "4", "-q", "-o", onnx_path, "--save-input", x], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    so = str(d / "tiny.so")
    assert qcompile_main([onnx_path, "-q", "--weights-beside", "-o", so]) == 0
    return {"dir": d, "so": so, "weights": so[:-3] + ".weights.npz", "x": x, "logits": Module(so)(np.load(x))}


def _one_error(rc, err, *fragments):
    """Exit status 2, exactly one stderr line starting `qrun: error:`, no trace, and the fragments in it."""
    assert rc == 2, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("qrun: error: "), err
    for f in fragments:
        assert f in err, f"expected {f!r} in: {err}"
    return err


def _qrun(capsys, *argv, frags=()):
    rc = qrun_main([str(a) for a in argv])
    return _one_error(rc, capsys.readouterr().err, *frags)


def _qrun_process(*argv, env=None):
    return subprocess.run([sys.executable, "-m", "qcompile.runtime", *map(str, argv)], capture_output=True, text=True,
                          env=env)


def _patched(src: str, dst, *pairs) -> str:
    """A copy of ``src`` with equal-length byte replacements (the ELF layout stays intact)."""
    data = open(src, "rb").read()
    for old, new in pairs:
        assert len(old) == len(new) and old in data
        data = data.replace(old, new)
    open(dst, "wb").write(data)
    return str(dst)


# ------------------------------------------------------------------------------------------------------------------
# the module file, checked before it is loaded
# ------------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("keep", ["half", 100, 63])
def test_truncated_module_gets_a_message_not_a_signal(tiny, tmp_path, keep):
    """A .so cut short (to half: the mapped segments lie past the end, which killed qrun with SIGBUS; to 100 bytes;
    shorter than an ELF header) -> exit 2 and a message, in a real qrun process."""
    data = open(tiny["so"], "rb").read()
    cut = tmp_path / "cut.so"
    cut.write_bytes(data[:len(data) // 2 if keep == "half" else keep])
    p = _qrun_process(cut, "--input", tiny["x"])
    assert p.returncode == 2, (p.returncode, p.stderr)  # not -7 (SIGBUS) or -11
    _one_error(p.returncode, p.stderr, "is truncated", str(cut))
    with pytest.raises(RunError, match="truncated"):
        Module(str(cut))


def _libc_path():
    """The C library this process runs (an ELF shared object of this host), or None."""
    if not os.path.exists("/proc/self/maps"):
        return None
    for line in open("/proc/self/maps"):
        path = line.split()[-1]
        if re.fullmatch(r"libc(-[0-9.]+)?\.so(\.[0-9]+)*", os.path.basename(path)):
            return path
    return None


def test_foreign_files(tiny, tmp_path, capsys):
    """Files that are not qcompile modules: each named for what it is, before anything is loaded."""
    text, png, empty = tmp_path / "notes.so", tmp_path / "logo.png", tmp_path / "empty.so"
    text.write_text("hello\n")
    png.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(100))
    empty.write_bytes(b"")
    x = tiny["x"]
    _qrun(capsys, text, "--input", x, frags=(f"'{text}' is not a qcompile module", "a text file"))
    _qrun(capsys, png, "--input", x, frags=(f"'{png}' is not a qcompile module", "a PNG image"))
    _qrun(capsys, empty, "--input", x, frags=("is not a qcompile module", "empty"))
    _qrun(capsys, tmp_path / "none.so", "--input", x, frags=("does not exist",))
    _qrun(capsys, tmp_path, "--input", x, frags=("is a directory",))
    for prog in filter(None, ["/bin/ls", _libc_path()]):  # ELF shared objects for this host, of other programs
        if os.path.exists(prog):
            _qrun(capsys, prog, "--input", x, frags=(f"'{prog}' is not a qcompile module", "no TVM module data"))
    # an ELF for another machine: e_machine (bytes 18-19) set to aarch64, or to x86_64 on an aarch64 host
    data = bytearray(open(tiny["so"], "rb").read())
    other = 62 if int.from_bytes(data[18:20], "little") == 183 else 183
    data[18:20] = other.to_bytes(2, "little")
    arm = tmp_path / "arm.so"
    arm.write_bytes(bytes(data))
    _qrun(capsys, arm, "--input", x, frags=("is not a qcompile module for this host", "aarch64" if other == 183
                                           else "x86_64"))
    # an object file (e_type 1) and a program (e_type 2)
    for e_type, what in ((1, "an object file"), (2, "a program")):
        data[18:20] = open(tiny["so"], "rb").read()[18:20]
        data[16:18] = e_type.to_bytes(2, "little")
        f = tmp_path / f"type{e_type}.so"
        f.write_bytes(bytes(data))
        _qrun(capsys, f, "--input", x, frags=(what,))
    # a TVM module without qcompile's metadata
    notq = _patched(tiny["so"], tmp_path / "notq.so", (b'{"qcompile": ', b'{"qcompiled":'))
    _qrun(capsys, notq, "--input", x, frags=("not a qcompile module", "qcompile_meta"))


def test_module_under_another_name_loads(tiny, tmp_path):
    """A module named without `.so` loads (TVM would pick its loader by the suffix: "Loader for `.13` ...")."""
    import shutil

    other = tmp_path / "tiny.so.13"
    shutil.copy(tiny["so"], other)
    m = Module(str(other), weights=tiny["weights"])
    assert np.array_equal(m(np.load(tiny["x"])), tiny["logits"])


def test_check_module_file_reads_the_metadata(tiny):
    meta = rt.check_module_file(tiny["so"])
    assert meta["target"] == "llvm" and meta["input_shape"] == [4, 3, 16, 16] and meta["weights"] == "beside"
    assert meta == Module(tiny["so"]).meta  # the file's copy is what the module's qcompile_meta returns


# ------------------------------------------------------------------------------------------------------------------
# devices
# ------------------------------------------------------------------------------------------------------------------

def test_device_cuda_on_this_host(tiny):
    """--device cuda for an llvm module, in a real process with the real driver probe: no GPU -> the GPU message;
    a GPU -> the module is a CPU module."""
    from conftest import gpu_compute_capability

    p = _qrun_process(tiny["so"], "--input", tiny["x"], "--device", "cuda")
    if gpu_compute_capability() is None:
        _one_error(p.returncode, p.stderr, "needs a CUDA GPU; this host has none")
    else:
        _one_error(p.returncode, p.stderr, "compiled for the CPU")


def test_cuda_module_without_gpu(tiny, tmp_path, capsys, monkeypatch):
    """A CUDA module (the metadata says target cuda, arch sm_90) on a host whose driver reports no GPU, an older
    GPU, or a newer one (sm_90a code runs on 9.0 only); and --device cpu for it. Refused before the file is loaded (this file holds llvm code)."""
    cuda = _patched(tiny["so"], tmp_path / "gpu.so", (b'"target": "llvm", "arch": null, "source": "tin',
                                                     b'"target": "cuda", "arch": "sm_90", "source": "'))
    os.symlink(tiny["weights"], tmp_path / "gpu.weights.npz")
    monkeypatch.setattr(rt, "cuda_gpus", lambda: [])
    _qrun(capsys, cuda, "--input", tiny["x"], frags=("this module needs a CUDA GPU; this host has none",))
    _qrun(capsys, cuda, "--input", tiny["x"], "--device", "cpu", frags=("needs a CUDA GPU",))
    _qrun(capsys, tiny["so"], "--input", tiny["x"], "--device", "cuda", frags=("needs a CUDA GPU; this host has none",))
    monkeypatch.setattr(rt, "cuda_gpus", lambda: [80])
    _qrun(capsys, cuda, "--input", tiny["x"], frags=("compiled for sm_90", "sm_80", "--arch sm_80"))
    monkeypatch.setattr(rt, "cuda_gpus", lambda: [120])  # sm_90a code runs on compute capability 9.0 only
    _qrun(capsys, cuda, "--input", tiny["x"], frags=("compiled for sm_90", "sm_120", "--arch sm_89"))
    monkeypatch.setattr(rt, "cuda_gpus", lambda: [90])
    _qrun(capsys, cuda, "--input", tiny["x"], "--device", "cpu", frags=("cannot run with --device cpu",))
    _qrun(capsys, tiny["so"], "--input", tiny["x"], "--device", "cuda", frags=("compiled for the CPU",))
    with pytest.raises(RunError, match="device must be"):
        Module(tiny["so"], "gpu")


# ------------------------------------------------------------------------------------------------------------------
# weights beside the module
# ------------------------------------------------------------------------------------------------------------------

def test_weights_file_errors(tiny, tmp_path, capsys):
    import shutil

    so = tmp_path / "m.so"
    shutil.copy(tiny["so"], so)
    wf = tmp_path / "m.weights.npz"
    x = tiny["x"]
    _qrun(capsys, so, "--input", x, frags=("keeps its weights beside it", str(wf), "does not exist"))
    good = open(tiny["weights"], "rb").read()
    with np.load(tiny["weights"]) as z:
        arrays = {k: z[k] for k in z.files}
    cases = [(b"", "the file is empty"), (good[:len(good) // 2], "truncated or corrupt"),
             (b"not a zip\n" * 10, "not a valid .npz archive")]
    for data, frag in cases:
        wf.write_bytes(data)
        _qrun(capsys, so, "--input", x, frags=(str(wf), frag))
    np.savez(wf, **{k: v for k, v in arrays.items() if k != "w1"})
    _qrun(capsys, so, "--input", x, frags=("lacks 1 of the", "w1"))
    np.savez(wf)
    _qrun(capsys, so, "--input", x, frags=("lacks",))
    with open(wf, "wb") as f:
        np.save(f, arrays["w0"])
    _qrun(capsys, so, "--input", x, frags=("single .npy array",))
    np.savez(wf, **{**arrays, "w0": np.array([1, "a"], dtype=object)})
    _qrun(capsys, so, "--input", x, frags=("pickled Python objects",))
    wf.write_bytes(good)
    assert qrun_main([str(so), "--input", x]) == 0
    with pytest.raises(RunError, match="takes no weights file"):  # an embedded module given a weights file
        Module(_patched(tiny["so"], tmp_path / "emb.so", (b'"weights": "beside"', b'"weights": "inside"')),
               weights=str(wf))


# ------------------------------------------------------------------------------------------------------------------
# images and options
# ------------------------------------------------------------------------------------------------------------------

def test_input_errors(tiny, tmp_path, capsys):
    so, x = tiny["so"], np.load(tiny["x"])
    f = tmp_path / "in.npy"

    def bad(frags, write):
        write()
        _qrun(capsys, so, "--input", f, frags=frags)

    _qrun(capsys, so, "--input", tmp_path / "none.npy", frags=("input file", "does not exist"))
    _qrun(capsys, so, "--input", tmp_path, frags=("is a directory",))
    bad(("not a .npy file",), lambda: f.write_text("1 2 3\n"))
    bad(("the file is empty",), lambda: f.write_bytes(b""))
    bad(("a .npz archive",), lambda: np.savez(open(f, "wb"), x=x))
    bad(("Python objects",), lambda: np.save(f, np.array([{"a": 1}], dtype=object), allow_pickle=True))
    bad(("truncated or corrupt",), lambda: (np.save(f, x), f.write_bytes(f.read_bytes()[:300])))
    bad(("dtype uint8",), lambda: np.save(f, x.astype(np.uint8)))
    bad(("shape (4, 3, 20, 20)", "(4, 3, 16, 16)"), lambda: np.save(f, np.zeros((4, 3, 20, 20), np.float32)))
    nan = x.copy()
    nan[1, 2, 3, 4] = np.nan
    nan[0, 0, 0, 0] = np.inf
    bad(("2 non-finite values", "1 NaN, 1 Inf", "--allow-nonfinite"), lambda: np.save(f, nan))
    big = x.astype(np.float64)
    big[3, 2, 1, 0] = 1e300  # float64 beyond float32's range: Inf once cast
    bad(("1 non-finite values", "0 NaN, 1 Inf"), lambda: np.save(f, big))
    np.save(f, nan)
    assert qrun_main([str(so), "--input", str(f), "--allow-nonfinite"]) == 0  # told to: it runs
    m = Module(so)
    with pytest.raises(RunError, match="non-finite"):
        m(nan)
    assert m(nan, allow_nonfinite=True).shape == (4, 10)


@pytest.mark.parametrize("n", ["-3", "0", "two"])
def test_time_needs_a_positive_count(tiny, capsys, n):
    _qrun(capsys, tiny["so"], "--input", tiny["x"], "--time", n, frags=("--time",))


def test_time_runs(tiny, capsys):
    assert qrun_main([tiny["so"], "--input", tiny["x"], "--time", "3"]) == 0
    assert re.search(r"median [0-9.]+ ms over 3 runs", capsys.readouterr().out)


def test_usage_errors_are_one_line(tiny, capsys):
    _qrun(capsys, tiny["so"], frags=("--input",))
    _qrun(capsys, tiny["so"], "--input", tiny["x"], "--device", "gpu", frags=("--device",))
    _qrun(capsys, tiny["so"], "--input", tiny["x"], "--bogus", frags=("--bogus",))


# ------------------------------------------------------------------------------------------------------------------
# --output
# ------------------------------------------------------------------------------------------------------------------

def test_output_path_refused_before_inference(tiny, tmp_path, capsys, monkeypatch):
    """A bad --output is refused before the module is loaded, and leaves nothing behind."""
    class NoModule:
        def __init__(self, *a, **k):
            raise AssertionError("the module was loaded before --output was checked")

    monkeypatch.setattr(rt, "Module", NoModule)
    so, x = tiny["so"], tiny["x"]
    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    before = sorted(os.listdir(tmp_path))
    _qrun(capsys, so, "--input", x, "--output", tmp_path, frags=("is a directory",))
    _qrun(capsys, so, "--input", x, "--output", tmp_path / "no" / "y.npy", frags=("does not exist",))
    _qrun(capsys, so, "--input", x, "--output", a_file / "y.npy", frags=("is not a folder",))
    _qrun(capsys, so, "--input", x, "--output", x, frags=("is the input file",))
    if os.path.isdir("/proc"):  # no file can be created there, root included
        _qrun(capsys, so, "--input", x, "--output", "/proc/y.npy", frags=("cannot write --output",))
    if os.geteuid() != 0:  # (root writes anywhere)
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o555)
        _qrun(capsys, so, "--input", x, "--output", ro / "y.npy", frags=("cannot write --output", "Permission"))
        ro.chmod(0o755)
        ro.rmdir()
    assert sorted(os.listdir(tmp_path)) == before


def test_output_equal_to_module_refused(tiny, tmp_path, capsys):
    import shutil

    so = tmp_path / "m.npy"  # a module file named .npy, given as --output too
    shutil.copy(tiny["so"], so)
    _qrun(capsys, so, "--input", tiny["x"], "--output", so, frags=("is the compiled module",))
    assert so.read_bytes() == open(tiny["so"], "rb").read()


def test_output_written_atomically(tiny, tmp_path, capsys, monkeypatch):
    """The output goes to a temporary file beside it, renamed when complete: a write that fails midway leaves the
    old file as it was and no temporary file; a run refused after the --output check leaves nothing either."""
    y = tmp_path / "y.npy"
    assert qrun_main([tiny["so"], "--input", tiny["x"], "--output", str(y)]) == 0
    assert np.array_equal(np.load(y), tiny["logits"])
    assert sorted(os.listdir(tmp_path)) == ["y.npy"]
    umask = os.umask(0)
    os.umask(umask)
    assert y.stat().st_mode & 0o777 == 0o666 & ~umask
    old = y.read_bytes()

    def failing_write(f, arr, **_):
        f.write(b"\x93NUMPY partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(np.lib.format, "write_array", failing_write)
    capsys.readouterr()
    _qrun(capsys, tiny["so"], "--input", tiny["x"], "--output", y, frags=("cannot write --output", "No space left"))
    assert y.read_bytes() == old and sorted(os.listdir(tmp_path)) == ["y.npy"]
    _qrun(capsys, tiny["so"], "--input", tiny["x"], "--output", tmp_path / "z.npy", frags=("No space left",))
    assert sorted(os.listdir(tmp_path)) == ["y.npy"]
    monkeypatch.undo()
    nan = tmp_path / "nan.npy"
    np.save(nan, np.full((4, 3, 16, 16), np.nan, np.float32))
    _qrun(capsys, tiny["so"], "--input", nan, "--output", tmp_path / "w.npy", frags=("non-finite",))
    assert sorted(os.listdir(tmp_path)) == ["nan.npy", "y.npy"]
    link = tmp_path / "link.npy"  # a symbolic link: its target gets the output, the link stays
    link.symlink_to(y)
    assert qrun_main([tiny["so"], "--input", tiny["x"], "--output", str(link)]) == 0
    assert link.is_symlink() and np.array_equal(np.load(y), tiny["logits"])


# ------------------------------------------------------------------------------------------------------------------
# --labels
# ------------------------------------------------------------------------------------------------------------------

def test_labels_accuracy(tiny, tmp_path, capsys):
    """--labels: the top-1 accuracy over the batch, against the module's known outputs (three labels right, one
    wrong -> 75.00%)."""
    top1 = tiny["logits"].argmax(axis=1)
    labels = top1.copy()
    labels[2] = (labels[2] + 1) % 10
    lf = tmp_path / "y.npy"
    np.save(lf, labels.astype(np.int64))
    assert qrun_main([tiny["so"], "--input", tiny["x"], "--labels", str(lf)]) == 0
    out = capsys.readouterr().out
    assert f"top-1 per image: {top1.tolist()}" in out
    assert "top-1 accuracy: 75.00% (3/4 images)" in out
    np.save(lf, top1.astype(np.uint8))
    assert qrun_main([tiny["so"], "--input", tiny["x"], "--labels", str(lf)]) == 0
    assert "top-1 accuracy: 100.00% (4/4 images)" in capsys.readouterr().out


def test_labels_errors(tiny, tmp_path, capsys):
    so, x = tiny["so"], tiny["x"]
    lf = tmp_path / "labels.npy"
    _qrun(capsys, so, "--input", x, "--labels", tmp_path / "none.npy", frags=("labels file", "does not exist"))
    for arr, frag in [(np.zeros(4, np.float32), "integer class indices"), (np.zeros((4, 1), np.int64), "1-D array"),
                      (np.zeros(3, np.int64), "hold 3 labels, the input has 4 images"),
                      (np.array([0, 1, 10, 2]), "class 10; the model has 10 classes"),
                      (np.array([0, -1, 1, 2]), "class -1")]:
        np.save(lf, arr)
        _qrun(capsys, so, "--input", x, "--labels", lf, frags=(str(lf), frag))
    lf.write_text("0 1 2 3")
    _qrun(capsys, so, "--input", x, "--labels", lf, frags=("cannot read labels", "not a .npy file"))


# ------------------------------------------------------------------------------------------------------------------
# start-up: the TVM runtime only
# ------------------------------------------------------------------------------------------------------------------

_PROBE = """
import json, sys
from qcompile.runtime import qrun_main
rc = qrun_main(sys.argv[1:])
libs = sorted({l.split()[-1].rsplit("/", 1)[-1] for l in open("/proc/self/maps") if "libtvm" in l})
print(json.dumps({"rc": rc, "modules": sorted(sys.modules), "libs": libs}))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads /proc/self/maps")
def test_qrun_imports_the_runtime_only(tiny):
    """A run imports neither TVM's Python package (compiler parts included) nor torch or onnx, and loads
    libtvm_runtime alone (no libtvm_compiler); --help imports neither numpy nor tvm_ffi."""
    p = subprocess.run([sys.executable, "-c", _PROBE, tiny["so"], "--input", tiny["x"]], capture_output=True,
                       text=True)
    assert p.returncode == 0, p.stderr
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["rc"] == 0
    heavy = [m for m in got["modules"] if m.split(".")[0] in ("tvm", "torch", "onnx", "onnxruntime")]
    assert heavy == [], heavy
    assert "libtvm_runtime.so" in got["libs"] and "libtvm_compiler.so" not in got["libs"], got["libs"]
    h = subprocess.run([sys.executable, "-c", "import sys\nfrom qcompile.runtime import qrun_main\ntry:\n"
                        "    qrun_main(['--help'])\nexcept SystemExit:\n    pass\n"
                        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('numpy', 'tvm_ffi', 'tvm')))"],
                       capture_output=True, text=True)
    assert h.returncode == 0 and h.stdout.strip().splitlines()[-1] == "[]", h.stdout + h.stderr
    assert "--labels" in h.stdout and "--allow-nonfinite" in h.stdout


def test_dlpack_tensors_in_and_out(tiny):
    """A torch tensor goes in through DLPack and a torch tensor of the same device comes out, equal to the NumPy path;
    bad tensors get the same one-line RunErrors."""
    torch = pytest.importorskip("torch")
    m, x = Module(tiny["so"]), np.load(tiny["x"])
    y = m(torch.from_numpy(x))
    assert isinstance(y, torch.Tensor) and y.device.type == "cpu"
    np.testing.assert_array_equal(y.numpy(), tiny["logits"])  # (the same kernels on the same bytes: bit for bit)
    with pytest.raises(RunError, match="dtype float64"):
        m(torch.from_numpy(x.astype(np.float64)))
    with pytest.raises(RunError, match=r"shape \(2, 3, 16, 16\)"):
        m(torch.from_numpy(x[:2]))
    with pytest.raises(RunError, match="contiguous"):
        m(torch.from_numpy(x).transpose(2, 3))
    nan = torch.from_numpy(x.copy())
    nan[0, 0, 0, 0] = float("nan")
    with pytest.raises(RunError, match="non-finite"):
        m(nan)
    assert m(nan, allow_nonfinite=True).shape == (4, 10)
    from tvm_ffi import from_dlpack  # another DLPack producer: a tvm_ffi tensor comes back

    out = m(from_dlpack(torch.from_numpy(x)))
    np.testing.assert_array_equal(torch.from_dlpack(out).numpy(), tiny["logits"])
