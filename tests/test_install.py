"""What each install needs (pyproject.toml): the ONNX path compiles and runs without PyTorch, and ``qrun`` runs a
module with only the TVM runtime and NumPy.

The models are built here (this process has torch); the compile and the run happen in a child process whose
``sys.meta_path`` makes ``import torch`` (and torchao, torchvision, scikit-learn, xgboost) raise
ModuleNotFoundError, as on a core install. A second child also blocks onnx and onnxruntime: what
``pip install --no-deps .`` beside apache-tvm, apache-tvm-ffi and numpy leaves.
"""
import json
import os
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_BLOCKER = """
import json
import sys
BLOCKED = {blocked!r}
class _Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked by the test: not in this install)",
                                      name=name)  # as a missing package raises it
        return None
sys.meta_path.insert(0, _Blocker())
for _m in list(sys.modules):
    if _m.split(".")[0] in BLOCKED:
        raise SystemExit(f"{{_m}} was imported before the blocker")
"""
NO_TORCH = ("torch", "torchao", "torchvision", "sklearn", "xgboost")
RUNTIME_ONLY = NO_TORCH + ("onnx", "onnxruntime")


def _child(blocked, body: str, cwd) -> dict:
    """Run ``body`` in a fresh interpreter with ``blocked`` packages unimportable; it prints one JSON line last."""
    code = _BLOCKER.format(blocked=tuple(blocked)) + textwrap.dedent(body) + textwrap.dedent("""
        loaded = sorted({m.split(".")[0] for m in sys.modules} & set(BLOCKED))
        print(json.dumps(dict(result, loaded=loaded)))
    """)
    r = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])})
    assert r.returncode == 0, f"child failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out.pop("loaded") == []
    return out


def test_blocker_blocks(tmp_path):
    """The blocker works: a child that imports torch fails with ImportError (so the tests below can fail)."""
    code = _BLOCKER.format(blocked=NO_TORCH) + "import torch\n"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "blocked by the test" in r.stderr


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A qmodel-style INT8 QDQ model and a float ONNX model of resnet_tiny (1x8x8 input), calibration data, input."""
    torch = pytest.importorskip("torch")
    from qcompile.models.export_onnx import export_onnx
    from qcompile.models.quantize import quantize_model
    from qcompile.models.resnet import build_model

    d = tmp_path_factory.mktemp("install")
    model = build_model("resnet_tiny", num_classes=10, in_ch=1, seed=5)
    calib = torch.randn(16, 1, 8, 8, generator=torch.Generator().manual_seed(6))
    qm = quantize_model(model, calib, bits=8, arch="resnet_tiny")
    export_onnx(qm, str(d / "q.onnx"), (4, 1, 8, 8), batch=4)
    with warnings.catch_warnings():  # the TorchScript exporter's deprecation notes
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.onnx.export(model, (torch.randn(4, 1, 8, 8),), str(d / "f.onnx"), input_names=["input"],
                          output_names=["logits"], opset_version=17, dynamo=False)
    np.save(d / "calib.npy", calib.numpy())
    x = np.random.default_rng(7).standard_normal((4, 1, 8, 8)).astype(np.float32)
    np.save(d / "x.npy", x)
    with torch.no_grad():
        fake_quant = qm(torch.from_numpy(x)).numpy()
    return d, x, fake_quant, qm.acts["fc"].scale


def test_onnx_path_without_torch(models):
    """Without torch: qcompile compiles a QDQ model and a float model (onnxruntime's quantize_static), and
    qcompile.runtime.Module / qrun run them; PT2E, HAWQ and qmodel say in one line that they need PyTorch (exit 2).
    The QDQ model's output is the quantized model's (PyTorch fake-quant,
    computed here) within one output step; the float model's equals the same compile done with torch loaded."""
    d, x, fake_quant, step = models
    out = _child(NO_TORCH, """
        import json
        import numpy as np
        from qcompile.cli import qcompile_main
        from qcompile.runtime import Module, qrun_main
        result = {}
        result["rc_qdq"] = qcompile_main(["q.onnx", "-o", "q.so", "--layout", "NHWC"])
        result["rc_float"] = qcompile_main(["f.onnx", "--bits", "8", "--calibrate", "calib.npy", "--batch", "4",
                                            "-o", "f.so"])
        x = np.load("x.npy")
        np.save("y_q.npy", Module("q.so")(x))
        np.save("y_f.npy", Module("f.so")(x))
        result["rc_qrun"] = qrun_main(["q.so", "--input", "x.npy", "--output", "y_qrun.npy"])
        # what needs PyTorch says so in one line, exit 2
        import contextlib, io, zipfile
        from qcompile.models.cli import main as qmodel_main
        zipfile.ZipFile("m.pt2", "w").writestr("m", "m")
        open("m.pth", "wb").write(b"m")
        for key, call in (("pt2", lambda: qcompile_main(["m.pt2", "-o", "m.so"])),
                          ("hawq", lambda: qcompile_main(["m.pth", "--net", "resnet18", "-o", "m.so"])),
                          ("qmodel", lambda: qmodel_main(["digits", "-o", "d.onnx", "-q"]))):
            err = io.StringIO()
            with contextlib.redirect_stderr(err):
                rc = call()
            lines = err.getvalue().strip().splitlines()
            result[key] = [rc, len(lines), "needs PyTorch" in lines[-1] and "qcompile[torch]" in lines[-1]]
    """, cwd=d)
    assert out == {"rc_qdq": 0, "rc_float": 0, "rc_qrun": 0, "pt2": [2, 1, True], "hawq": [2, 1, True],
                   "qmodel": [2, 1, True]}, out
    y_q, y_f = np.load(d / "y_q.npy"), np.load(d / "y_f.npy")
    assert y_q.shape == (4, 10) and len(np.unique(y_q)) > 5
    err = np.abs(y_q.astype(np.float64) - fake_quant.astype(np.float64)).max()
    assert err <= step * (1 + 1e-5), f"max error {err} > one output step {step}"
    assert np.array_equal(np.load(d / "y_qrun.npy"), y_q)

    from qcompile.driver import CompileOptions, compile_model
    from qcompile.runtime import Module

    res = compile_model(str(d / "f.onnx"), CompileOptions(bits="8", calibrate=str(d / "calib.npy"), batch=4),
                        log=lambda s: None)
    res.export(str(d / "f_ref.so"))
    y_ref = Module(str(d / "f_ref.so"))(x)
    assert len(np.unique(y_ref)) > 5 and np.array_equal(y_f, y_ref)


def test_runtime_alone(models):
    """qrun and qcompile.runtime.Module with neither torch nor onnx nor onnxruntime importable (the runtime-only
    install): a module built here runs there and gives the output it gives here."""
    from qcompile.driver import CompileOptions, compile_model
    from qcompile.runtime import Module

    d, x = models[0], models[1]
    compile_model(str(d / "q.onnx"), CompileOptions(layout="NHWC"), log=lambda s: None).export(str(d / "q_rt.so"))
    want = Module(str(d / "q_rt.so"))(x)
    out = _child(RUNTIME_ONLY, """
        import numpy as np
        from qcompile.runtime import Module, qrun_main
        result = {"rc": qrun_main(["q_rt.so", "--input", "x.npy", "--output", "y_rt.npy"])}
        result["same"] = bool(np.array_equal(Module("q_rt.so")(np.load("x.npy")), np.load("y_rt.npy")))
    """, cwd=d)
    assert out == {"rc": 0, "same": True}
    assert len(np.unique(want)) > 5 and np.array_equal(np.load(d / "y_rt.npy"), want)


def test_every_package_folder_is_installed():
    """Every folder with an ``__init__.py`` under the folders pyproject.toml maps into ``qcompile`` is one of its
    ``packages`` (a non-editable install leaves out any other: qcompile.schedules.gemm once was)."""
    import pathlib

    tomllib = pytest.importorskip("tomllib")  # (Python 3.11+)
    root = pathlib.Path(__file__).resolve().parents[1]
    cfg = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs = cfg["package-dir"]
    want = set()
    for pkg, folder in dirs.items():
        for init in (root / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(root / folder)
            want.add(".".join([pkg, *rel.parts]))
    assert want <= set(cfg["packages"]), sorted(want - set(cfg["packages"]))
