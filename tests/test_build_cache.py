"""The CUDA build's kernel cache, one CUDA module per kernel, and one PrimFunc per distinct kernel
(schedules/build.py, compiler/pipeline.py: dedup_prim_funcs)."""
import multiprocessing as mp
import os

import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from qcompile.schedules import build as B
from qcompile.schedules.build import KernelCache, build_stats, compile_units, nvcc_options, reset_build_stats

SIG = '{"nvcc": "test"}'


def test_cache_hit_miss(tmp_path):
    c = KernelCache(str(tmp_path))
    k = KernelCache.key("src", SIG)
    assert c.get(k) is None
    c.put(k, b"fatbin bytes")
    assert c.get(k) == b"fatbin bytes"
    assert KernelCache(str(tmp_path)).get(k) == b"fatbin bytes"  # (another process's view: the file alone)
    # the key covers the source and the compiler signature (nvcc version, flags)
    assert len({k, KernelCache.key("src ", SIG), KernelCache.key("src", '{"nvcc": "other"}')}) == 3


@pytest.mark.parametrize("damage", ["truncate", "flip", "garbage", "empty"])
def test_damaged_entry_is_a_miss(tmp_path, damage):
    c = KernelCache(str(tmp_path))
    k = KernelCache.key("src", SIG)
    c.put(k, b"x" * 1000)
    p = c.path(k)
    data = open(p, "rb").read()
    bad = {"truncate": data[:-10], "flip": data[:-1] + bytes([data[-1] ^ 1]), "garbage": b"not an entry",
           "empty": b""}[damage]
    open(p, "wb").write(bad)
    assert c.get(k) is None
    c.put(k, b"x" * 1000)  # (the next build replaces it)
    assert c.get(k) == b"x" * 1000


def _hammer(args):
    root, worker = args
    c = KernelCache(root)
    bad = 0
    for i in range(200):
        k = KernelCache.key(f"unit {i % 7}", SIG)
        payload = (f"unit {i % 7} " * 5000).encode()
        got = c.get(k)
        if got is not None and got != payload:
            bad += 1
        c.put(k, payload)
    return bad


def test_concurrent_writers(tmp_path):
    """Processes writing and reading the same keys at once: a read is the whole entry or nothing."""
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")  # (the workers: file I/O only)
    with ctx.Pool(4) as pool:
        assert pool.map(_hammer, [(str(tmp_path), w) for w in range(4)]) == [0, 0, 0, 0]
    c = KernelCache(str(tmp_path))
    for i in range(7):
        assert c.get(KernelCache.key(f"unit {i}", SIG)) == (f"unit {i} " * 5000).encode()
    leftovers = [f for _, _, fs in os.walk(tmp_path) for f in fs if f.startswith(".tmp-")]
    assert leftovers == []


def test_unwritable_cache_warns_and_builds_on(tmp_path):
    (tmp_path / "file").write_text("")
    c = KernelCache(str(tmp_path / "file" / "kernels"))  # (a folder below a file cannot be made)
    with pytest.warns(UserWarning, match="kernel cache cannot be written"):
        c.put(KernelCache.key("a", SIG), b"1")
    c.put(KernelCache.key("b", SIG), b"2")  # (warned once)
    assert c.get(KernelCache.key("a", SIG)) is None


def test_cache_switches(monkeypatch, tmp_path):
    monkeypatch.setenv("QCOMPILE_CACHE_DIR", str(tmp_path))
    assert B.default_cache_dir() == str(tmp_path / "kernels")
    for off in ("0", "off", "False"):
        monkeypatch.setenv("QCOMPILE_KERNEL_CACHE", off)
        assert not B.kernel_cache_enabled()
        with nvcc_options():
            assert B._cache() is None
    monkeypatch.setenv("QCOMPILE_KERNEL_CACHE", "1")
    with nvcc_options():
        assert B._cache().root == str(tmp_path / "kernels")
    with nvcc_options(cache=False):
        assert B._cache() is None
    with nvcc_options(cache=str(tmp_path / "elsewhere")):
        assert B._cache().root == str(tmp_path / "elsewhere")
    monkeypatch.setenv("QCOMPILE_NVCC_JOBS", "x")
    with pytest.raises(ValueError, match="QCOMPILE_NVCC_JOBS"):
        B.nvcc_jobs()
    with pytest.raises(ValueError, match="nvcc mode"):
        with nvcc_options(mode="cubin"):
            pass


# ------------------------------------------------------------------------------------------------
# with nvcc
# ------------------------------------------------------------------------------------------------
UNIT = r"""
extern "C" __global__ void __launch_bounds__(32) add_one(float* __restrict__ a) {
  a[threadIdx.x] += 1.0f;
}
"""


@pytest.mark.nvcc
def test_compile_units_cache(tmp_path, monkeypatch):
    cache = str(tmp_path / "k")
    reset_build_stats()
    with nvcc_options("sm_90", "sass", cache=cache):
        first = compile_units([UNIT])[0]
        assert (build_stats().compiled, build_stats().cache_hits) == (1, 0)
        assert compile_units([UNIT])[0] == first  # (hit)
        assert (build_stats().compiled, build_stats().cache_hits) == (1, 1)
        entries = [os.path.join(r, f) for r, _, fs in os.walk(cache) for f in fs]
        assert len(entries) == 1
        open(entries[0], "r+b").write(b"garbage")  # a damaged entry: compiled again and replaced
        assert compile_units([UNIT])[0] == first
        assert build_stats().compiled == 2
        assert compile_units([UNIT])[0] == first and build_stats().compiled == 2
        with nvcc_options("sm_90", "ptx", cache=cache):  # (other flags: another entry)
            compile_units([UNIT])
        assert build_stats().compiled == 3
    monkeypatch.setenv("QCOMPILE_KERNEL_CACHE", "0")  # disabled: always nvcc, nothing stored
    before = len([f for _, _, fs in os.walk(cache) for f in fs])
    with nvcc_options("sm_90", "sass", cache=None):
        assert compile_units([UNIT])[0] == first
    assert build_stats().compiled == 4 and len([f for _, _, fs in os.walk(cache) for f in fs]) == before


@pytest.mark.nvcc
def test_nvcc_error_names_the_kernel(tmp_path):
    with nvcc_options("sm_90", "sass", cache=False):
        with pytest.raises(RuntimeError, match="nvcc failed on broken"):
            compile_units(["this is not CUDA"], ["broken"])


@T.prim_func
def _two_kernels(a: T.Buffer((256,), "float32"), b: T.Buffer((256,), "float32")):
    for i in T.thread_binding(2, "blockIdx.x"):
        for j in T.thread_binding(128, "threadIdx.x"):
            b[i * 128 + j] = a[i * 128 + j] * T.float32(2)
    for i in T.thread_binding(2, "blockIdx.x"):
        for j in T.thread_binding(128, "threadIdx.x"):
            a[i * 128 + j] = b[i * 128 + j] + T.float32(1)


@T.prim_func
def _one_kernel(a: T.Buffer((256,), "int32")):
    for i in T.thread_binding(2, "blockIdx.x"):
        for j in T.thread_binding(128, "threadIdx.x"):
            a[i * 128 + j] = a[i * 128 + j] * 3


def _small_module():
    return tvm.IRModule({"twice": _two_kernels.with_attr("global_symbol", "twice"),
                         "thrice": _one_kernel.with_attr("global_symbol", "thrice")})


@pytest.mark.nvcc
def test_split_build_has_every_kernel(tmp_path):
    """One CUDA module per kernel, the first importing the others; the exported .so holds every kernel's SASS for
    the arch and its PTX (mode both), and the SASS of the one-unit build."""
    from qcompile.cuda_tools import find_tool, ptx_entries, sass_by_kernel

    B.ensure_stub_libcuda()
    libs = {}
    for split in (True, False):
        with nvcc_options("sm_86", "both", split=split, cache=str(tmp_path / "cache")):
            lib = tvm.compile(_small_module(), target=B.cuda_target("sm_86"))
        so = str(tmp_path / f"m_{split}.so")
        lib.export_library(so)
        libs[split] = (lib, so)
    mods = B.cuda_modules(libs[True][0])
    assert len(mods) == 3 and len(B.cuda_modules(libs[False][0])) == 1
    src = B.cuda_source(libs[True][0])
    names = {"twice_kernel", "twice_kernel_1", "thrice_kernel"}
    assert all(f" {n}(" in src for n in names)
    if find_tool("cuobjdump"):
        split_sass, one_sass = sass_by_kernel(libs[True][1]), sass_by_kernel(libs[False][1])
        assert set(split_sass) == set(one_sass) == names
        assert split_sass == one_sass
        assert sorted(ptx_entries(libs[True][1])) == sorted(names)
        from qcompile.cuda_tools import cuobjdump

        elf = cuobjdump(libs[True][1], "--list-elf")
        assert elf.count("sm_86.cubin") == 3, elf


@pytest.mark.nvcc
def test_keep_writes_each_unit(tmp_path):
    B.ensure_stub_libcuda()
    with nvcc_options("sm_86", "sass", keep=str(tmp_path / "keep"), cache=False):
        tvm.compile(_small_module(), target=B.cuda_target("sm_86"))
    assert sorted(os.listdir(tmp_path / "keep")) == [f"{k}.{e}" for k in ("thrice_kernel", "twice_kernel",
                                                                          "twice_kernel_1") for e in ("cu", "fatbin")]


@pytest.fixture(scope="module")
def tiny_onnx(tmp_path_factory):
    import torch

    from qcompile.models.export_onnx import export_onnx
    from qcompile.models.quantize import quantize_model
    from qcompile.models.resnet import build_model

    torch.manual_seed(0)
    qm = quantize_model(build_model("resnet_tiny"), torch.randn(8, 3, 16, 16), bits=8)
    p = str(tmp_path_factory.mktemp("tiny") / "t8.onnx")
    export_onnx(qm, p, (2, 3, 16, 16), batch=2)
    return p


@pytest.mark.nvcc
def test_model_build_equals_uncached_single_unit_build(tiny_onnx, tmp_path, monkeypatch):
    """compile_model (one module per kernel, through a cold and then a warm cache) gives the kernels, SASS and PTX of
    the one-unit build without the cache."""
    from qcompile.cuda_tools import find_tool, ptx_entries, sass_by_kernel
    from qcompile.driver import CompileOptions, compile_model, import_model
    from qcompile.pipeline import build, qcompile_pipeline

    monkeypatch.setenv("QCOMPILE_CACHE_DIR", str(tmp_path / "cache"))
    opts = CompileOptions(target="cuda", arch="sm_90", layout="NHWC")
    lines = []
    sos = []
    for i in range(2):
        reset_build_stats()
        res = compile_model(tiny_onnx, CompileOptions(**vars(opts)), log=lines.append)
        sos.append(res.export(str(tmp_path / f"m{i}.so")))
        st = build_stats()
        assert st.cache_hits == (st.units if i else 0) and st.modules == st.units > 1
    assert any("CUDA modules; nvcc:" in ln and "from the kernel cache" in ln for ln in lines), lines
    target = {"kind": "cuda", "arch": "sm_90"}
    mod, _ = import_model(tiny_onnx, CompileOptions(**vars(opts)))
    with nvcc_options("sm_90", "both", split=False, cache=False):
        one = build(mod, target, pipeline=qcompile_pipeline(target, "NHWC"))
    assert len(B.cuda_modules(one)) == 1
    one.export_library(str(tmp_path / "one.so"))
    src_one = B.cuda_source(one)
    names = {n for n in sass_by_kernel(str(tmp_path / "one.so"))} if find_tool("cuobjdump") else set()
    for n in names:
        assert f" {n}(" in src_one
    if find_tool("cuobjdump"):
        ref = sass_by_kernel(str(tmp_path / "one.so"))
        assert ref and sass_by_kernel(sos[0]) == ref == sass_by_kernel(sos[1])
        assert sorted(ptx_entries(sos[0])) == sorted(ref)


# ------------------------------------------------------------------------------------------------
# one PrimFunc per distinct kernel
# ------------------------------------------------------------------------------------------------
@I.ir_module
class _Dups:
    @T.prim_func(private=True)
    def add_a(x: T.Buffer((4,), "int32"), y: T.Buffer((4,), "int32")):
        for i in range(4):
            y[i] = x[i] + 1

    @T.prim_func(private=True)
    def add_b(x: T.Buffer((4,), "int32"), y: T.Buffer((4,), "int32")):
        for i in range(4):
            y[i] = x[i] + 1

    @T.prim_func(private=True)
    def add_c(x: T.Buffer((4,), "int32"), y: T.Buffer((4,), "int32")):
        for i in range(4):
            y[i] = x[i] + 2

    @R.function
    def main(x: R.Tensor((4,), "int32")) -> R.Tensor((4,), "int32"):
        cls = _Dups
        a = R.call_tir(cls.add_a, (x,), out_ty=R.Tensor((4,), "int32"))
        b = R.call_tir(cls.add_b, (a,), out_ty=R.Tensor((4,), "int32"))
        c = R.call_tir(cls.add_c, (b,), out_ty=R.Tensor((4,), "int32"))
        return c


def test_dedup_prim_funcs():
    import numpy as np

    from qcompile.pipeline import dedup_prim_funcs

    out = dedup_prim_funcs()(_Dups)
    assert sorted(gv.name_hint for gv in out.functions) == ["add_a", "add_c", "main"]
    text = out["main"].script()
    assert "add_b" not in text and text.count("R.call_tir(add_a,") == 2
    ex = relax.build(out, target="llvm")
    vm = relax.VirtualMachine(ex, tvm.cpu())
    x = np.arange(4, dtype="int32")
    np.testing.assert_array_equal(vm["main"](tvm.runtime.tensor(x)).numpy(), x + 4)
    assert dedup_prim_funcs()(out).same_as(out)  # (nothing left to merge: the module itself)


def test_fast_tvmscript_macros_same_kernel():
    """A tensor-core kernel constructed with the fast macro lookup equals the one constructed without it."""
    from qcompile.schedules import conv2d_int_kernel
    from qcompile.schedules.build import fast_tvmscript_macros
    from qcompile.schedules.spec import ConvSpec

    spec = ConvSpec(N=2, H=8, W=8, C=64, K=64, R=3, S=3, padding=1, x_dtype="int8")
    ref = conv2d_int_kernel(spec, "sm_90")
    with fast_tvmscript_macros():
        fast = conv2d_int_kernel(spec, "sm_90")
    tvm.ir.assert_structural_equal(ref, fast)
