"""GPU-host helpers of the scripts: the TVM runtime where TVM does not import (the bundle that
scripts/make_runtime_bundle.sh packs), and the end-to-end check input."""
from __future__ import annotations

import importlib.util
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
BUNDLE_DIR = ROOT / "build" / "runtime_bundle"  # make_runtime_bundle.sh's default output; $QC_RUNTIME_BUNDLE overrides


def check_input(b: int):
    """The end-to-end check input of batch b (scripts/build_e2e.py writes it; drawn again where its file is absent):
    standard normal, seed 100 + b, float32 [b, 3, 224, 224]."""
    import numpy as np

    return np.random.default_rng(100 + b).standard_normal((b, 3, 224, 224)).astype("float32")


def setup_runtime_and_reexec(script: str, argv, bundle=None):
    """Unless TVM imports already: unpack the runtime bundle (``bundle``, else $QC_RUNTIME_BUNDLE, else
    build/runtime_bundle) to /tmp/tvmrt, install its tvm-ffi wheel for this Python there and exec ``script argv``
    again with it on PYTHONPATH (TVM_USE_RUNTIME_LIB=1: libtvm_runtime alone)."""
    if importlib.util.find_spec("tvm") is not None or os.environ.get("QC_TUNE_RT"):
        return
    src = pathlib.Path(bundle or os.environ.get("QC_RUNTIME_BUNDLE") or BUNDLE_DIR)
    tag = f"cp{sys.version_info[0]}{sys.version_info[1]}"
    whl = sorted(src.glob(f"apache_tvm_ffi-*-{tag}-*.whl"))
    if not (src / "tvm_runtime.tar.xz").is_file() or not whl:
        raise SystemExit(f"TVM does not import and {src} holds no runtime bundle for {tag}: install TVM, or pack one "
                         f"with scripts/make_runtime_bundle.sh {src} {sys.version_info[0]}.{sys.version_info[1]}")
    rt = "/tmp/tvmrt"
    os.makedirs(rt, exist_ok=True)
    subprocess.check_call(["tar", "xJf", str(src / "tvm_runtime.tar.xz"), "-C", rt])
    subprocess.check_call([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                           "--target", rt, str(whl[-1])])
    env = dict(os.environ, PYTHONPATH=rt, TVM_USE_RUNTIME_LIB="1", PYTHONUNBUFFERED="1", QC_TUNE_RT="1")
    os.execve(sys.executable, [sys.executable, script, *argv], env)
