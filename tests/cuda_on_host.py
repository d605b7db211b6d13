"""Run a barrier-free CUDA kernel's generated source on the host CPU (g++), for the CPU tier.

TVM's CUDA code generation writes plain C++ for kernels without shared memory or barriers (the depthwise and grouped
kernels: one thread's work depends on nothing another thread does). This compiles the kernel's own source, as nvcc
gets it, with g++ against a small shim -- ``blockIdx`` / ``threadIdx`` as globals, CUDA's vector types, ``min`` /
``max``, and the ``dp4a`` helpers as C++ (PTX ISA 9.7.1.24: four byte products, each byte signed or unsigned as the
type says, added to c) -- and runs every (block, thread) in turn. It checks what code generation and the schedule
produce, not nvcc / ptxas or the GPU (the GPU tier does that).
"""
from __future__ import annotations

import ctypes
import os
import re
import subprocess
import tempfile

import numpy as np

SHIM = r"""
#include <cstdint>
#include <cstring>
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __restrict__
#define uint unsigned int
#define uchar unsigned char
#define ushort unsigned short
struct Dim3 { int x, y, z; };
static Dim3 blockIdx, threadIdx;
template <class T> static inline T max(T a, T b) { return a > b ? a : b; }
template <class T> static inline T min(T a, T b) { return a < b ? a : b; }
#define VEC(name, t, n, al) struct alignas(al) name { t v[n]; };
VEC(char2, signed char, 2, 2) VEC(uchar2, unsigned char, 2, 2) VEC(char4, signed char, 4, 4)
VEC(uchar4, unsigned char, 4, 4) VEC(short2, short, 2, 4) VEC(ushort2, unsigned short, 2, 4)
VEC(int2, int, 2, 8) VEC(uint2, unsigned int, 2, 8) VEC(int3, int, 3, 4) VEC(int4, int, 4, 16)
VEC(uint4, unsigned int, 4, 16) VEC(longlong2, long long, 2, 16)
static inline int32_t dp4a_ref(uint32_t a, uint32_t b, int32_t c, bool as, bool bs) {
  int64_t s = c;
  for (int i = 0; i < 4; ++i) {
    int32_t x = (a >> (8 * i)) & 0xFF, y = (b >> (8 * i)) & 0xFF;
    if (as && x >= 128) x -= 256;
    if (bs && y >= 128) y -= 256;
    s += (int64_t)x * y;
  }
  return (int32_t)(uint32_t)(uint64_t)s;
}
inline void tvm_builtin_ptx_dp4a_s32_s32(int32_t& d, int32_t a, int32_t b, int32_t c) { d = dp4a_ref(a, b, c, 1, 1); }
inline void tvm_builtin_ptx_dp4a_u32_s32(int32_t& d, uint32_t a, int32_t b, int32_t c) { d = dp4a_ref(a, b, c, 0, 1); }
inline void tvm_builtin_ptx_dp4a_s32_u32(int32_t& d, int32_t a, uint32_t b, int32_t c) { d = dp4a_ref(a, b, c, 1, 0); }
inline void tvm_builtin_ptx_dp4a_u32_u32(uint32_t& d, uint32_t a, uint32_t b, uint32_t c) { d = dp4a_ref(a, b, c, 0, 0); }
"""


def kernel_text(source: str) -> tuple[str, str, list]:
    """(the kernel's definition, its name, its parameters as (C type, name)) from a CUDA translation unit of one
    kernel; AssertionError where the kernel uses shared memory or barriers (not runnable thread by thread)."""
    heads = list(re.finditer(r'extern "C" __global__ void __launch_bounds__\(\d+\) (\w+)\(([^)]*)\)\s*\{', source))
    assert len(heads) == 1, f"{len(heads)} kernel definitions (one expected)"
    body = source[heads[0].start():]
    assert "__shared__" not in body and "__syncthreads" not in body, "the kernel uses shared memory or barriers"
    params = []
    for p in heads[0].group(2).split(","):
        t, name = p.replace("__restrict__", "").rsplit(None, 1)
        params.append((t.strip(), name.strip()))
    return body, heads[0].group(1), params


def build_on_host(source: str, work_dir: str | None = None):
    """(run, params): ``run(arrays, grid, block)`` runs the kernel over ``grid`` blocks of ``block`` threads with
    ``arrays`` (NumPy arrays, C-contiguous, in the order of ``params``)."""
    body, name, params = kernel_text(source)
    call = ", ".join(f"({t})a[{i}]" for i, (t, _) in enumerate(params))
    driver = (f'extern "C" void run_on_host(void** a, int grid, int block) {{\n'
              f'  for (int b = 0; b < grid; ++b) for (int t = 0; t < block; ++t) {{\n'
              f'    blockIdx = {{b, 0, 0}}; threadIdx = {{t, 0, 0}}; {name}({call}); }}\n}}\n')
    d = work_dir or tempfile.mkdtemp(prefix="qcompile_cuda_host_")
    src, so = os.path.join(d, "kernel_host.cc"), os.path.join(d, "kernel_host.so")
    with open(src, "w") as f:
        f.write(SHIM + body + "\n" + driver)
    subprocess.run(["g++", "-O1", "-std=c++17", "-fno-strict-aliasing", "-fwrapv", "-shared", "-fPIC", "-w", src,
                    "-o", so], check=True, capture_output=True, text=True)
    lib = ctypes.CDLL(so)
    lib.run_on_host.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_int]

    def run(arrays, grid: int, block: int):
        assert len(arrays) == len(params), (len(arrays), params)
        for a in arrays:
            assert isinstance(a, np.ndarray) and a.flags.c_contiguous
        ptrs = (ctypes.c_void_p * len(arrays))(*[a.ctypes.data for a in arrays])
        lib.run_on_host(ptrs, grid, block)

    return run, [n for _, n in params]
