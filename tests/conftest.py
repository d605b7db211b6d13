import functools
import os
import shutil
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # tests/qdq_models.py
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "tune"))  # tests/tune/fakes.py (one conftest module)

# A child process asks the CUDA driver for device 0's compute capability, so that this process never loads
# libcuda (the CUDA build tests load a stand-in libcuda on GPU-less hosts).
_PROBE = r"""
import ctypes
try:
    cu = ctypes.CDLL("libcuda.so.1")
except OSError:
    raise SystemExit(1)
n, major, minor = ctypes.c_int(0), ctypes.c_int(0), ctypes.c_int(0)
if cu.cuInit(0) or cu.cuDeviceGetCount(ctypes.byref(n)) or n.value < 1:
    raise SystemExit(1)
cu.cuDeviceGetAttribute(ctypes.byref(major), 75, 0)  # CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR
cu.cuDeviceGetAttribute(ctypes.byref(minor), 76, 0)  # CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR
print(f"{major.value}{minor.value}")
"""


@functools.lru_cache(maxsize=None)
def gpu_compute_capability() -> int | None:
    """Compute capability of CUDA device 0 as an int (90 for an H100), or None where this host has no CUDA GPU."""
    try:
        r = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return int(r.stdout.strip()) if r.returncode == 0 and r.stdout.strip().isdigit() else None


def have_nvcc() -> bool:
    """Whether nvcc, which every CUDA build runs (``schedules/build.py``), is on PATH."""
    return shutil.which("nvcc") is not None


def pytest_configure(config):
    # (the one place that says what the `nvcc` marker means; `gpu` is registered in pyproject.toml)
    config.addinivalue_line("markers", "nvcc: builds CUDA code with nvcc (skipped where nvcc is not on PATH)")


def pytest_collection_modifyitems(config, items):
    gpu_items = [it for it in items if it.get_closest_marker("gpu")]
    if gpu_items and gpu_compute_capability() is None:
        skip = pytest.mark.skip(reason="needs a CUDA GPU (none found on this host)")
        for it in gpu_items:
            it.add_marker(skip)
    nvcc_items = [it for it in items if it.get_closest_marker("nvcc")]
    if nvcc_items and not have_nvcc():
        skip = pytest.mark.skip(reason="needs nvcc, the CUDA compiler (not on PATH)")
        for it in nvcc_items:
            it.add_marker(skip)
