"""Build helpers: compile TIR kernels for CUDA on a GPU-less box.

* ``cuda_target(arch)``: JSON-form TVM target for ``sm_XX``.
* A TVM CUDA compile callback (``tvm_callback_cuda_compile``) that calls nvcc with gencode
  flags we control: real SASS for the arch (``mode="sass"``), PTX only (``mode="ptx"``: the
  driver JITs it on a newer GPU, e.g. compute_86 PTX on an H100), or both.
* ``ensure_stub_libcuda()``: TVM embeds the compiled fatbin in an exported .so only when its
  CUDA runtime library can be loaded at build time, which needs some ``libcuda.so.1``. On a
  machine without a driver we compile a stand-in (every entry point fails) and preload it.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import pathlib
import subprocess
import tempfile

import tvm
import tvm.support.nvcc  # noqa: F401  (registers TVM's own callback first; ours overrides it)
import tvm_ffi

from qcompile.runtime import load_cuda_runtime

_STUB_C = r"""
/* stand-in libcuda.so.1 for GPU-less builds: every entry point fails (CUDA_ERROR_NO_DEVICE). */
typedef int CUresult;
#define F(name) CUresult name() { return 100; }
F(cuInit) F(cuDeviceGetName) F(cuFuncSetAttribute) F(cuLaunchKernelEx) F(cuModuleGetFunction)
F(cuModuleLoadData) F(cuModuleUnload) F(cuTensorMapEncodeTiled) F(cuDriverGetVersion) F(cuDeviceGet)
F(cuDeviceGetCount) F(cuDeviceGetAttribute) F(cuCtxGetCurrent) F(cuGetProcAddress) F(cuLaunchKernel)
F(cuModuleGetGlobal)
CUresult cuGetErrorName(int e, const char** s) { *s = "CUDA_ERROR_NO_DEVICE"; return 0; }
CUresult cuGetErrorString(int e, const char** s) { *s = "stand-in libcuda (build only)"; return 0; }
"""

_STATE = {"mode": "sass", "arch": "sm_90", "keep": None, "extra": []}


def _have_real_libcuda() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
        return True
    except OSError:
        return False


def ensure_stub_libcuda(cache_dir: str | None = None) -> str | None:
    """Make ``libcuda.so.1`` loadable in this process (a failing stand-in when there is no driver).

    Returns the stub path, or None when a real driver library is present. Must run before TVM
    loads ``libtvm_runtime_cuda.so`` (i.e. before the first ``tvm.compile`` for cuda / export)."""
    if _have_real_libcuda():
        load_cuda_runtime(required=True)
        return None
    d = pathlib.Path(cache_dir or os.path.join(tempfile.gettempdir(), "qcompile_cuda_stub"))
    d.mkdir(parents=True, exist_ok=True)
    so = d / "libcuda.so.1"
    if not so.exists():
        for cand in ("/usr/local/cuda/lib64/stubs/libcuda.so", "/usr/local/cuda/targets/x86_64-linux/lib/stubs/libcuda.so"):
            if os.path.exists(cand):
                so.write_bytes(pathlib.Path(cand).read_bytes())
                break
        else:
            (d / "stub.c").write_text(_STUB_C)
            subprocess.check_call(["gcc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(so), str(d / "stub.c")])
    ctypes.CDLL(str(so), mode=ctypes.RTLD_GLOBAL)  # satisfies the later dlopen of libcuda.so.1 by soname
    load_cuda_runtime(required=True)  # (TVM skipped it if libcuda.so.1 did not load when its CUDA backend registered)
    return str(so)


def cuda_target(arch: str = "sm_90") -> tvm.target.Target:
    return tvm.target.Target({"kind": "cuda", "arch": arch})


def _gencode(arch: str, mode: str, accel: bool = False) -> list[str]:
    """nvcc -gencode flags; ``accel``: the arch-specific feature set (``sm_90a``: wgmma), which only the GPU
    family it names runs (its PTX does not JIT to later GPUs)."""
    num = arch.split("_")[1] + ("a" if accel and not arch.endswith("a") else "")
    if mode == "sass":
        return ["-gencode", f"arch=compute_{num},code=sm_{num}"]
    if mode == "ptx":
        return ["-gencode", f"arch=compute_{num},code=compute_{num}"]
    if mode == "both":
        return ["-gencode", f"arch=compute_{num},code=[sm_{num},compute_{num}]"]
    raise ValueError(mode)


@tvm_ffi.register_global_func("tvm_callback_cuda_compile", override=True)
def _compile_cb(code, *_unused):
    arch, mode = _STATE["arch"], _STATE["mode"]
    with tempfile.TemporaryDirectory() as td:
        cu = os.path.join(td, "k.cu")
        out = os.path.join(td, "k.fatbin")
        with open(cu, "w") as f:
            f.write(code)
        gencode = _gencode(arch, mode, accel="wgmma." in code)
        cmd = ["nvcc", "--fatbin", "-O3", "-std=c++17", *gencode, "-o", out, cu, *_STATE["extra"]]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            errs = [ln for ln in r.stderr.splitlines() if " error" in ln or ln.startswith("error")]
            if _STATE["keep"]:  # the failing source, for reading
                pathlib.Path(_STATE["keep"]).mkdir(parents=True, exist_ok=True)
                (pathlib.Path(_STATE["keep"]) / "failed_kernel.cu").write_text(code)
            raise RuntimeError("nvcc failed:\n" + "\n".join(errs[:20]) + "\n...\n" + r.stderr[-2000:] + "\n"
                               + " ".join(cmd))
        if _STATE["keep"]:
            keep = pathlib.Path(_STATE["keep"])
            keep.mkdir(parents=True, exist_ok=True)
            (keep / "kernel.cu").write_text(code)
            (keep / "kernel.fatbin").write_bytes(open(out, "rb").read())
        return bytearray(open(out, "rb").read())


@contextlib.contextmanager
def nvcc_options(arch: str = "sm_90", mode: str = "sass", keep: str | None = None, extra=()):
    old = dict(_STATE)
    _STATE.update(arch=arch, mode=mode, keep=keep, extra=list(extra))
    try:
        yield
    finally:
        _STATE.clear()
        _STATE.update(old)


def build_cuda(func: tvm.tirx.PrimFunc, arch: str = "sm_90", mode: str = "sass", keep: str | None = None,
               name: str = "main"):
    """Compile one PrimFunc for CUDA; returns the runtime module (export with ``.export_library``)."""
    ensure_stub_libcuda()
    func = func.with_attr("global_symbol", name)
    mod = tvm.IRModule({name: func})
    with nvcc_options(arch, mode, keep):
        return tvm.compile(mod, target=cuda_target(arch))


def cuda_source(rt_mod) -> str:
    m = rt_mod.mod if hasattr(rt_mod, "mod") else rt_mod
    for imp in m.imports:
        try:
            return imp.inspect_source()
        except Exception:  # noqa: BLE001
            continue
    return ""
