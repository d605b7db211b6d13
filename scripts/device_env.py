"""The TVM runtime bundle on the GPU host: unpack .bundle/ and re-run the calling script with it (no TVM there)."""
from __future__ import annotations

import importlib.util
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def check_input(b: int):
    """The end-to-end check input of batch b (scripts/build_e2e.py writes it, bench_e2e.py draws it again where it was
    not carried): standard normal, seed 100 + b, float32 [b, 3, 224, 224]."""
    import numpy as np

    return np.random.default_rng(100 + b).standard_normal((b, 3, 224, 224)).astype("float32")


def setup_runtime_and_reexec(script: str, argv):
    """Unless TVM imports already: unpack the runtime bundle to /tmp/tvmrt, install the tvm-ffi wheel there and
    exec ``script argv`` again with it on PYTHONPATH (TVM_USE_RUNTIME_LIB=1: libtvm_runtime alone)."""
    if importlib.util.find_spec("tvm") is not None or os.environ.get("QC_TUNE_RT"):
        return
    rt = "/tmp/tvmrt"
    os.makedirs(rt, exist_ok=True)
    subprocess.check_call(["tar", "xJf", str(ROOT / ".bundle" / "tvm_runtime.tar.xz"), "-C", rt])
    whl = sorted((ROOT / ".bundle").glob("apache_tvm_ffi-*cp312*.whl"))
    subprocess.check_call([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                           "--target", rt, str(whl[-1])])
    env = dict(os.environ, PYTHONPATH=rt, TVM_USE_RUNTIME_LIB="1", PYTHONUNBUFFERED="1", QC_TUNE_RT="1")
    os.execve(sys.executable, [sys.executable, script, *argv], env)
