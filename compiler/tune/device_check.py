"""Device-side helpers of the rpc runner: poison an output on the device and compare it with the reference there.

Over TVM's RPC every byte of a remote buffer travels through the client's socket: a candidate's three output checks
and its shape's two poisons moved ~50 MB per candidate of ResNet-50 at batch 32, and that traffic does not grow
with the number of servers. With this module (built once per device kind and arch by the compiler side, uploaded to
each session) a check downloads ``PARTS`` int32 partial counts instead of the output, and a poison is written by a
kernel instead of uploaded; the reference is uploaded once per shape and session. ``measure.Layer`` uses it where
its ``shared`` dict holds it (``measure.DEVICE_CHECK``), and falls back to the host comparison where the device counts a
difference (the detailed count, 4-bit padding nibbles excepted, is the host's).

Functions, for every storage dtype of an output or workspace (``DTYPES``) and rank 1-5 (``RANKS``):

* ``qc_fill_<dtype>_<rank>(buf, seed)``: element ``j`` of ``buf`` (row-major) := a 32-bit hash of ``(j, seed)``,
  truncated to the dtype -- every byte varies with the seed;
* ``qc_count_<dtype>_<rank>(a, b, parts)``: ``parts[t]`` := how many elements ``a`` and ``b`` differ in, over the
  elements ``j == t (mod PARTS)`` (equal elements of an integer dtype are equal bytes).

Constraints:
    * integer dtypes only; ``a`` and ``b`` of the same shape (the caller checks);
    * cuda (any arch; no tensor-core instructions) or llvm (the CPU device of the tests).
"""
from __future__ import annotations

import functools
import hashlib
import os

DTYPES = ("int8", "uint8", "int32")
RANKS = (1, 2, 3, 4, 5)
GRID, THREADS = 256, 256  # cuda: the partial counts, one per thread


def parts(kind: str) -> int:
    """Partial counts a ``qc_count_*`` function writes on a device of ``kind``."""
    return GRID * THREADS if kind == "cuda" else 1


def func_name(op: str, dtype: str, rank: int) -> str:
    return f"qc_{op}_{dtype}_{rank}"


def _funcs(dtype: str, rank: int, gpu: bool) -> dict:
    """The fill and count PrimFuncs of one dtype and rank."""
    from tvm.script import tirx as T

    P = GRID * THREADS if gpu else 1
    G, TH = (GRID, THREADS) if gpu else (1, 1)

    def outer(n):
        return T.thread_binding(n, thread="blockIdx.x") if gpu else T.serial(n)

    def inner(n):
        return T.thread_binding(n, thread="threadIdx.x") if gpu else T.serial(n)

    def prod(shape):
        return functools.reduce(lambda x, y: x * y, shape)

    # (expressions, never assigned names: a name assigned in TVMScript is a variable, which a host function that
    # launches a kernel passes to it as a pointer to host memory)
    def flat(i, bx, tx):
        return i * P + bx * TH + tx

    def unravel(j, shape):  # (row-major indices of flat index j)
        idx = []
        for d in reversed(shape[1:]):
            idx.insert(0, j % d)
            j = j // d
        return [j, *idx]

    def hashed(j, seed):
        h = T.Cast("uint32", j) * T.uint32(0x9E3779B1) + T.Cast("uint32", seed)
        h = (h ^ (h >> T.uint32(15))) * T.uint32(0x2C1B3C6D)
        return T.Cast(dtype, h ^ (h >> T.uint32(12)))

    @T.prim_func
    def fill(a: T.handle, seed: T.int32):
        shape = [T.int64() for _ in range(rank)]
        A = T.match_buffer(a, shape, dtype)
        for bx in outer(G):
            for tx in inner(TH):
                for i in range((prod(shape) + P - 1) // P):
                    if flat(i, bx, tx) < prod(shape):
                        A[unravel(flat(i, bx, tx), shape)] = hashed(flat(i, bx, tx), seed)

    @T.prim_func
    def count(a: T.handle, b: T.handle, part: T.Buffer((P,), "int32")):
        shape = [T.int64() for _ in range(rank)]
        A = T.match_buffer(a, shape, dtype)
        B = T.match_buffer(b, shape, dtype)
        for bx in outer(G):
            for tx in inner(TH):
                part[bx * TH + tx] = 0
                for i in range((prod(shape) + P - 1) // P):
                    if flat(i, bx, tx) < prod(shape):
                        part[bx * TH + tx] = part[bx * TH + tx] + T.Select(
                            A[unravel(flat(i, bx, tx), shape)] != B[unravel(flat(i, bx, tx), shape)], 1, 0)

    return {func_name("fill", dtype, rank): fill, func_name("count", dtype, rank): count}


def build(kind: str, arch: str | None, folder: str) -> str:
    """The helpers' shared library for a device of ``kind`` ("cuda" with its ``arch``, or "cpu"), built into
    ``folder`` once (the file name carries the kind, the arch and this module's source hash)."""
    import tvm

    src = open(__file__, "rb").read()
    tag = hashlib.sha256(src + f"{kind}|{arch}|{tvm.__version__}".encode()).hexdigest()[:12]
    path = os.path.join(folder, f"qc_device_check_{kind}_{arch or 'host'}_{tag}.so")
    if os.path.exists(path):
        return path
    gpu = kind == "cuda"
    funcs = {}
    for dt in DTYPES:
        for r in RANKS:
            for name, f in _funcs(dt, r, gpu).items():
                funcs[name] = f.with_attr("global_symbol", name)
    target = tvm.target.Target({"kind": "cuda", "arch": arch}, host="llvm") if gpu else tvm.target.Target("llvm")
    os.makedirs(folder, exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp.so"
    tvm.compile(tvm.IRModule(funcs), target=target).export_library(tmp)
    os.replace(tmp, path)
    return path
