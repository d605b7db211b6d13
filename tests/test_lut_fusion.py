"""Lookup-table activations in the producing conv's epilogue (issue #33): ``ConvSpec.lut`` and the dispatch's
``find_luts`` (relay_passes/dispatch_tensor_core.py).

* The chains: on the tiny MobileNetV3 / EfficientNet of ``qmodel`` (hardswish as HardSigmoid x Mul, SiLU as Sigmoid x
  Mul, the squeeze-excite gates) every lookup-table chain after a conv is found, and each chain's table equals the
  chain itself compiled by TVM for llvm and run on all 256 input values.
* The dispatch: the cuda IR of phase 3 has no take left, the kernels of those layers take the table and the summary
  labels them ``+lut``; the llvm build's IR keeps every take.
* The kernels: the depthwise and grouped kernels with a random table, their CUDA source run thread by thread on the
  host (tests/cuda_on_host.py), and split-K's epilogue kernel built for llvm, equal the NumPy reference mapped
  through the table, with poisoned outputs. The tensor-core GEMM kernels (shared memory, barriers, mma / wgmma) do
  not run on the host: their table parameter, its place in the calling convention and the epilogue's table loads are
  checked in the generated CUDA here, their results on the GPU tier.
* GPU tier (``pytest -m gpu``): every GEMM form (mma.sync pipe 0 / 1, wgmma, erq, residual, 4-bit register-A,
  persistent, ping-pong, stream-K, split-K, direct HWNC) and the depthwise / grouped kernels with a table, bit for bit
  against the reference; the tiny models' cuda build equals the llvm build at batch 1 and 8.
"""
from __future__ import annotations

import dataclasses
import zlib

import numpy as np
import pytest

import kernel_reference as kr
import test_gpu_depthwise as DW
import test_gpu_kernels as GK
from conftest import gpu_compute_capability

L, U8, I8, U4, RES8, WG = GK.L, GK.U8, GK.I8, GK.U4, GK.RES8, GK.WG
MODELS = ("mobilenet_v3_tiny", "efficientnet_tiny")
INPUT = (3, 32, 32)


def _quiet(_):
    pass


# ---------------------------------------------------------------------------------------------------------------
# tables and specs
# ---------------------------------------------------------------------------------------------------------------
def lut_min(spec_fields: dict) -> int:
    """The first value of the conv output's storage type: the value indexing a table's first entry."""
    from qcompile.schedules import ConvSpec

    return -128 if ConvSpec.storage(spec_fields["out_dtype"]) == "int8" else 0


def random_table(name: str, dtype: str) -> np.ndarray:
    rng = np.random.default_rng(zlib.crc32(("table" + name).encode()))
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max + 1, 256).astype(dtype)


def lut_spec(spec_fields: dict, table_dtype: str):
    """The conv of ``spec_fields`` writing the entry of a 256-entry ``table_dtype`` table instead of its value."""
    from qcompile.schedules import ConvSpec

    return ConvSpec(**spec_fields).replace(out_dtype=table_dtype, lut=256, lut_min=lut_min(spec_fields))


def through(table: np.ndarray, want: np.ndarray, spec_fields: dict) -> np.ndarray:
    return table[np.asarray(want, np.int64) - lut_min(spec_fields)].astype(np.int64)


def _gemm(name, spec, strategy, knobs, table, plan=False, sm90=False):
    return dict(GK._case(name, spec, strategy, knobs, plan, sm90), table=table)


GEMM_CASES = [
    _gemm("lut_sync_u8_pad", dict(L, **U8, pad_value=5), "implicit_gemm", GK.SYNC, "int8"),
    _gemm("lut_sync_pipe1_i8", dict(L, **I8), "implicit_gemm", dict(BM=64, BN=64, WM=2, WN=2, pipe=1), "uint8"),
    _gemm("lut_sync_u8_res", dict(L, **U8, **RES8), "implicit_gemm", GK.SYNC, "int8"),
    _gemm("lut_wg_u8", dict(L, **U8), "implicit_gemm", WG, "int8", sm90=True),
    _gemm("lut_wg_erq_i8", dict(L, **I8), "implicit_gemm", dict(WG, BM=64, BN=64, WM=1, erq=True), "uint8",
          sm90=True),
    _gemm("lut_wg_erq_u8_res", dict(L, **U8, **RES8), "implicit_gemm", dict(WG, erq=True), "uint8", sm90=True),
    _gemm("lut_wg_u4_areg_w8", dict(L, **U4), "implicit_gemm",
          dict(WG, BK=64, stages=4, pstages=4, areg=True, w8=True), "int8", sm90=True),
    _gemm("lut_wg_persist_u8", dict(L, N=4, **U8), "implicit_gemm", dict(WG, erq=True, persist=1), "int8",
          sm90=True),
    _gemm("lut_wg_pingpong_u8", dict(L, N=8, **U8), "implicit_gemm", dict(WG, WM=1, BM=64, pp=True, stages=4),
          "uint8", sm90=True),
    _gemm("lut_streamk_u8_res", dict(L, N=1, H=7, W=7, C=256, **U8, **RES8), "implicit_gemm", dict(WG, sk=1),
          "int8", sm90=True),
    _gemm("lut_splitk_sync_u8_res", dict(L, N=1, H=7, W=7, C=256, **U8, **RES8), "implicit_gemm", dict(split_k=4),
          "int8", plan=True),
    _gemm("lut_splitk_wg_i8", dict(L, N=1, H=7, W=7, C=256, **I8), "implicit_gemm",
          dict(WG, BM=64, WM=1, split_k=4), "uint8", plan=True, sm90=True),
    _gemm("lut_hwnc_u8_res_pad", dict(L, N=8, layout="HWNC", **U8, **RES8, pad_value=9), "direct_hwnc", None,
          "int8"),
]


def gemm_funcs(case, arch: str):
    """The case's kernels with their table (``conv2d_int_plan`` of its ``lut_spec``) and ``calls`` as
    tests/test_gpu_kernels.py runs them (``spec``: the conv without the table, for the problem and the reference)."""
    from qcompile.schedules.igemm import streamk_args, w8_kperm, w8_weights

    spec = lut_spec(case["spec"], case["table"])
    fs = planned_funcs(spec, case, arch)
    f = fs[0]
    if isinstance(case["knobs"], dict) and "mma" in case["knobs"]:  # (not the mma.sync fallback of knobs it refused)
        assert f"mma='{case['knobs']['mma']}'" in str(f.attrs["qcompile.knobs"]), str(f.attrs["qcompile.knobs"])
    res = ["res", "rq2"] if spec.has_residual else []
    main = ["x", "w", "bias", "M", "S", *res]
    if len(fs) == 2:
        assert case["plan"], "a split-K pair where none was asked for"
        funcs = [["k0", ["x", "w", "ws"]], ["k1", ["ws", "bias", "M", "S", *res, "lut", "out"]]]
        split = int(f.attrs["qcompile.split_k"])
    elif streamk_args(f):
        funcs, split = [["k0", main + ["lut", "skc", "out", "skw"]]], 0
    else:
        assert not case["plan"], "no split-K pair where one was asked for"
        funcs, split = [["k0", main + ["lut", "out"]]], 0
    for (_, names), g in zip(funcs, fs):
        got = [p.name for p in g.params]
        assert len(got) == len(names) and ("lut" not in names or got[names.index("lut")] == "lut"), (names, got)
    calls = dict(funcs=funcs, spec=dataclasses.asdict(_spec(case["spec"])), split=split, sk=streamk_args(f),
                 w8=bool(w8_weights(f)), kperm=w8_kperm(f), strategy=str(f.attrs["qcompile.strategy"]))
    return [g.with_attr("global_symbol", n) for (n, _), g in zip(funcs, fs)], calls


def planned_funcs(spec, case, arch: str) -> list:
    """The kernels of ``spec`` with the case's strategy and knobs: a split-K pair where the case asks for one
    (``conv2d_int_plan``), else the one kernel (``conv2d_int_kernel``), as tests/test_gpu_kernels.py builds them."""
    from qcompile.schedules import DEFAULT_KNOBS, GemmKnobs, conv2d_int_kernel, conv2d_int_plan

    kn = case["knobs"]
    kn = DEFAULT_KNOBS[arch] if kn == GK.SYNC else (GemmKnobs(**kn) if kn is not None else None)
    if case["plan"]:
        return conv2d_int_plan(spec, arch, case["strategy"], kn)
    return [conv2d_int_kernel(spec, arch, case["strategy"], kn)]


def _spec(fields):
    """The ConvSpec of a case's fields (no table)."""
    from qcompile.schedules import ConvSpec

    return ConvSpec(**fields)


# ---------------------------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------------------------
def test_lut_keeps_the_tuning_key_and_checks_its_domain():
    """A layer with a table looks up the record of the same conv without one; the table's domain must hold the
    final clip range, and only the GEMM strategies (and the CUDA-core kernels) take a table."""
    from qcompile.schedules import ConvSpec, plan_conv, tuning_key

    base = ConvSpec(**dict(L, **U8))
    assert tuning_key(lut_spec(dict(L, **U8), "int8")) == tuning_key(base)
    assert tuning_key(lut_spec(dict(L, **U8, **RES8), "int8")) == tuning_key(base.replace(**RES8))
    with pytest.raises(ValueError, match="clip range"):
        base.replace(lut=16, lut_min=0)  # (values 0..255, a table of 16)
    with pytest.raises(ValueError, match="8-bit output"):
        ConvSpec(**dict(L, **dict(U8, out_dtype="int32"), lut=256))
    with pytest.raises(ValueError, match="no output lookup table"):
        plan_conv(lut_spec(dict(L, **U8), "int8"), "sm_90", "fallback")


@pytest.mark.parametrize("case", GEMM_CASES, ids=[c["name"] for c in GEMM_CASES])
def test_gemm_kernels_take_the_table(case):
    """The GEMM kernels (sm_90) take the table before ``out`` (stream-K: before its counters) and the kernel writing
    the output loads it in its epilogue; the same conv without a table has neither."""
    from test_kernel_identity import cuda_source

    fs, calls = gemm_funcs(case, "sm_90")
    last = cuda_source(fs[-1], "sm_90")
    head = next(line for line in last.split("\n") if "__global__" in line)
    assert "lut_ptr" in head and "lut_ptr[" in last, "the output kernel reads no table"
    if len(fs) == 2:
        assert "lut" not in cuda_source(fs[0], "sm_90"), "split-K's partial GEMM has no epilogue"
    plain = planned_funcs(_spec(case["spec"]), case, "sm_90")
    assert [len(f.params) for f in plain] == [len(f.params) - (i == len(fs) - 1) for i, f in enumerate(fs)]
    assert "lut" not in cuda_source(plain[-1], "sm_90")


@pytest.mark.parametrize("case", [c for c in GEMM_CASES if c["plan"]], ids=lambda c: c["name"])
def test_splitk_epilogue_with_table_on_cpu(case):
    """The kernel writing a split-K pair's output (its epilogue kernel, built for llvm) applies the table: random
    int32 partials of the conv's sums in, the reference mapped through the table out (outputs poisoned first)."""
    import tvm

    from qcompile.schedules.splitk import make_splitk_epilogue

    fs, calls = gemm_funcs(case, "sm_90")
    spec = lut_spec(case["spec"], case["table"])
    p = GK.make_problem(case, calls)
    acc = kr.conv_acc(kr.as_spec(calls["spec"]), p["x"], p["w"]).reshape(-1, spec.K)
    rng = np.random.default_rng(3)
    parts = rng.integers(-(1 << 20), 1 << 20, (calls["split"] - 1,) + acc.shape)
    ws = np.concatenate([parts, (acc - parts.sum(0))[None]]).astype(np.int32)
    bufs = GK.inputs(case, calls, p)
    table = random_table(case["name"], case["table"])
    lib = tvm.compile(tvm.IRModule({"main": make_splitk_epilogue(spec, calls["split"], "llvm")}), target="llvm")
    want = through(table, GK.expected(case, calls, p), case["spec"])
    for poison in GK.POISONS:
        out = np.full(want.shape, poison, np.uint8).view(case["table"])
        args = [ws, bufs["bias"], bufs["M"], bufs["S"]] + ([bufs["res"], bufs["rq2"]] if spec.has_residual else [])
        t = [tvm.runtime.tensor(a, tvm.cpu()) for a in args + [table, out]]
        lib["main"](*t)
        assert np.array_equal(t[-1].numpy().astype(np.int64), want)


DW_CASES = [dict(c, table=t) for c, t in (
    (DW.dw("lut_dw_u8_s2", 17, 48, stride=2), "int8"),
    (DW.dw("lut_dw_i8_5x5", 14, 72, R=5, **DW.I8, pad_value=-7), "uint8"),
    (DW.dw("lut_dw_c30_bytes", 13, 30, **DW.I8), "int8"),
    (DW.dw("lut_dw_res8", 14, 48, **DW.RES8), "uint8"),
    (DW.dw("lut_dw_i4_vec1", 9, 10, **dict(DW.I4, out_dtype="int8")), "int8"),
    (DW.gr("lut_gr_cg4", 12, 64, 64, 16), "int8"),
    (DW.gr("lut_gr_cg3_res", 11, 12, 12, 4, **dict(DW.I8, out_dtype="uint8"), **DW.RES8), "uint8"),
)]


def grouped_planned(case, arch: str):
    """(GroupedPlanned of the case with its table, the table)."""
    from qcompile.schedules.grouped import plan_grouped

    table = random_table(case["name"], case["table"])
    spec = lut_spec(case["spec"], case["table"])
    pk = plan_grouped(spec, case["groups"], arch)
    assert pk.spec.lut == 256 and [p.name for p in pk.funcs[0].params][-2:] == ["lut", "out"]
    return pk, table


@pytest.mark.parametrize("case", DW_CASES, ids=[c["name"] for c in DW_CASES])
def test_grouped_kernels_with_table_on_host(case, tmp_path):
    """Depthwise / grouped kernels with a random table: their CUDA source, run thread by thread on the host, writes
    the table's entry of the reference's value (two poisons)."""
    from cuda_on_host import build_on_host
    from test_kernel_identity import cuda_source

    pk, table = grouped_planned(case, "sm_90")
    run, params = build_on_host(cuda_source(pk.funcs[0], "sm_90"), str(tmp_path))
    p = DW.make_problem(case)
    bufs = dict(DW.buffers(case, pk.strategy, pk.spec, p), lut=table)
    grid, block = DW.launch(pk)
    want = through(table, p["want"], case["spec"])
    for poison in GK.POISONS:
        bufs["out"] = DW.out_buffer(pk.spec, poison)
        run([bufs[DW.HOST_NAMES.get(n[:-4], n[:-4])] for n in params], grid, block)
        bad = bufs["out"].astype(np.int64) != want
        assert not bad.any(), f"{case['name']}: {int(bad.sum())} of {bad.size} outputs differ"


# ---------------------------------------------------------------------------------------------------------------
# the pass
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    """name -> ONNX QDQ path, made as ``qmodel NAME [--bits 4]`` makes it (``NAME:4``: the INT4 model)."""
    from qcompile.models.cli import main

    d = tmp_path_factory.mktemp("lut")
    out = {}
    for name in MODELS + ("mobilenet_v3_tiny:4",):
        model, _, bits = name.partition(":")
        out[name] = str(d / f"{model}{bits}.onnx")
        assert main([model, "--bits", bits or "8", "-o", out[name], "-q"]) == 0
    return out


def phase3(path: str, target: str, batch: int = 1):
    """(phase 3's module, the pipeline record) of the model for ``target`` (cuda: sm_90; no backend, no nvcc)."""
    import tvm

    from qcompile.errors import run_pass
    from qcompile.frontends.onnx_qdq import from_onnx
    from qcompile.pipeline import PipelineRecord, qcompile_pipeline

    mod, _ = from_onnx(path, batch, log=_quiet)
    rec = PipelineRecord()
    tgt = {"kind": "cuda", "arch": "sm_90"} if target == "cuda" else "llvm"
    pipeline = qcompile_pipeline(tgt, "NHWC", pack_int4=False, backend=False, record=rec)
    with tvm.transform.PassContext(opt_level=3):
        return run_pass(pipeline, mod), rec


def takes(func) -> int:
    """The take calls of a Relax function."""
    return sum(1 for blk in func.body.blocks for b in blk.bindings
               if getattr(getattr(b.value, "op", None), "name", "") == "relax.take")


def chain_on_cpu(q, calls: list) -> np.ndarray:
    """The chain's own calls ((var, call) in order, from q; the last one's value is the result) as a Relax function of
    a [256] tensor, built for llvm and run on every value of q's type."""
    import tvm
    from tvm import relax

    bb = relax.BlockBuilder()
    x = relax.Var("q", relax.TensorType([256], str(q.ty.dtype)))
    with bb.function("main", [x]):
        env = {q: x}
        for var, call in calls:
            env[var] = bb.emit(relax.Call(call.op, [env.get(a, a) for a in call.args], call.attrs))
        bb.emit_func_output(env[calls[-1][0]])
    lib = tvm.compile(bb.get(), target="llvm")
    vm = relax.VirtualMachine(lib, tvm.cpu())
    info = np.iinfo(str(q.ty.dtype))
    return vm["main"](tvm.runtime.tensor(np.arange(info.min, info.max + 1).astype(str(q.ty.dtype)))).numpy()


@pytest.mark.parametrize("name", MODELS + ("mobilenet_v3_tiny:4",))
def test_chains_found_and_their_tables_exact(tiny_models, name):
    """Every take of the integer graph belongs to a chain after a conv kernel, and each chain's table is what TVM
    computes for the chain on all 256 values."""
    from tvm import relax

    from qcompile.relay_passes.dispatch_tensor_core import find_fusions, find_luts

    _, rec = phase3(tiny_models[name], "cuda")
    func = rec.integer_mod["main"]
    groups, residuals = find_fusions(func, packed_pools=True)
    luts = find_luts(func, groups, residuals)
    assert luts and sum(lut.takes for lut in luts.values()) == takes(func) > 0
    var2val = relax.analysis.get_var2val(func)
    for q, lut in luts.items():
        assert lut.chain[-1].same_as(lut.out)
        got = chain_on_cpu(q, [(v, var2val[v]) for v in lut.chain])
        assert got.dtype == lut.table.dtype and np.array_equal(got, lut.table), q.name
        assert len(np.unique(lut.table)) > 2, q.name  # (an activation, not a constant)


@pytest.mark.parametrize("name", MODELS)
def test_cuda_dispatch_fuses_the_tables(tiny_models, name):
    """Phase 3 on cuda: no take is left; every layer labelled ``+lut`` runs a kernel with a 256-entry ``lut``
    parameter; the llvm build's phase 3 keeps every take of the integer graph."""
    import tvm

    mod, rec = phase3(tiny_models[name], "cuda")
    assert takes(mod["main"]) == 0
    lut_layers = [n for n, k in rec.kernels.items() if k.endswith("+lut")]
    assert len(lut_layers) >= 4, rec.kernels
    kernels = [f for _, f in mod.functions.items() if isinstance(f, tvm.tirx.PrimFunc)
               and any(p.name == "lut" for p in f.params)]
    assert len(kernels) == len(lut_layers)
    assert rec.planned and all(pk.spec.lut == 0 for _, pk in rec.planned)  # (tuning tasks: the convs without tables)
    for f in kernels:
        lut = next(p for p in f.params if p.name == "lut")
        assert [int(d) for d in lut.ty.shape] == [256]
    cpu, cpu_rec = phase3(tiny_models[name], "llvm")
    assert takes(cpu["main"]) == takes(cpu_rec.integer_mod["main"]) > 0
    assert not any(k.endswith("+lut") for k in cpu_rec.kernels.values())


def test_chains_stay_after_kernels_without_a_table(tiny_models, monkeypatch):
    """A layer whose kernel applies no table (every tensor-core layer forced onto the fallback kernel here) keeps its
    chain as glue; the depthwise layers' chains still go into their kernels."""
    import qcompile.schedules as S

    monkeypatch.setattr(S, "select_strategy", lambda spec, arch="sm_90": "fallback")
    mod, rec = phase3(tiny_models["mobilenet_v3_tiny"], "cuda")
    lut = [k for k in rec.kernels.values() if k.endswith("+lut")]
    assert lut and set(lut) == {"depthwise+lut"}, rec.kernels
    assert "fallback" in rec.kernels.values()
    assert 0 < takes(mod["main"]) == takes(rec.integer_mod["main"]) - len(lut)  # (one take per chain here)


# ---------------------------------------------------------------------------------------------------------------
# GPU tier
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.nvcc
@pytest.mark.parametrize("case", GEMM_CASES, ids=[c["name"] for c in GEMM_CASES])
def test_gemm_kernels_with_table_bit_exact_on_gpu(case):
    import tvm

    from qcompile.schedules.build import cuda_target, ensure_stub_libcuda, nvcc_options

    arch, mode = GK.target_arch(gpu_compute_capability())
    if case["sm90"] and arch != "sm_90":
        pytest.skip(f"{case['name']}: an sm_90a kernel; this GPU runs {arch}")
    ensure_stub_libcuda()
    fs, calls = gemm_funcs(case, arch)
    with nvcc_options(arch, mode):
        mod = tvm.compile(tvm.IRModule({str(f.attrs["global_symbol"]): f for f in fs}), target=cuda_target(arch))
    p = GK.make_problem(case, calls)
    table = random_table(case["name"], case["table"])
    bufs = dict(GK.inputs(case, calls, p), lut=table)
    want = through(table, GK.expected(case, calls, p), case["spec"])
    out_calls = dict(calls, spec=dict(calls["spec"], out_dtype=case["table"]))
    for poison in GK.POISONS:
        got = GK.run(mod, case, out_calls, bufs, tvm.cuda(0), poison).astype(np.int64)
        bad = got != want
        assert not bad.any(), f"{case['name']}: {int(bad.sum())} of {bad.size} outputs differ from the reference"


@pytest.mark.gpu
@pytest.mark.nvcc
@pytest.mark.parametrize("case", DW_CASES, ids=[c["name"] for c in DW_CASES])
def test_grouped_kernels_with_table_bit_exact_on_gpu(case):
    import tvm

    arch, mode = GK.target_arch(gpu_compute_capability())
    pk, table = grouped_planned(case, arch)
    mod = DW.build(pk, arch, mode)
    p = DW.make_problem(case)
    bufs = dict(DW.buffers(case, pk.strategy, pk.spec, p), lut=table)
    want = through(table, p["want"], case["spec"])
    dev = tvm.cuda(0)
    for poison in GK.POISONS:
        t = {k: tvm.runtime.tensor(np.ascontiguousarray(v), dev) for k, v in bufs.items()}
        t["out"] = tvm.runtime.tensor(DW.out_buffer(pk.spec, poison), dev)
        mod["k0"](*[t[n] for n in ["x", "w", "bias", "M", "S"] + (["res", "rq2"] if pk.spec.has_residual else [])
                    + ["lut", "out"]])
        dev.sync()
        assert np.array_equal(t["out"].numpy().astype(np.int64), want), case["name"]


@pytest.mark.gpu
@pytest.mark.nvcc
@pytest.mark.parametrize("name,batch", [(n, b) for n in MODELS for b in (1, 8)])
def test_lut_models_gpu_equal_llvm(tiny_models, name, batch, tmp_path):
    """The tiny MobileNetV3 / EfficientNet with their activations in the conv kernels' epilogues: the cuda build
    equals the llvm build bit for bit."""
    from test_gpu import _arch

    from qcompile.driver import CompileOptions, compile_model
    from qcompile.runtime import Module

    path = tiny_models[name]
    cpu_so, gpu_so = str(tmp_path / "cpu.so"), str(tmp_path / "gpu.so")
    compile_model(path, CompileOptions(layout="NHWC", batch=batch), log=_quiet).export(cpu_so)
    res = compile_model(path, CompileOptions(target="cuda", arch=_arch(), layout="NHWC", batch=batch), log=_quiet)
    assert any(lay.kernel.endswith("+lut") for lay in res.layers), [lay.kernel for lay in res.layers]
    res.export(gpu_so)
    cpu, gpu = Module(cpu_so), Module(gpu_so, "cuda")
    for seed in range(2):
        x = np.random.default_rng(300 + seed).standard_normal((batch, *INPUT)).astype("float32")
        want, got = cpu(x), gpu(x)
        assert len(np.unique(want)) > 5
        assert np.array_equal(got, want), f"GPU output differs from the llvm build in {np.sum(got != want)} elements"



def _chain_of(build, also_return_q: bool = False):
    """``_lut_chain`` of a function ``q -> build(bb, q)`` (q: int8 [1, 4, 4, 8]); ``also_return_q``: the function
    returns q as well (a use outside the chain)."""
    from tvm import relax

    from qcompile.relay_passes import dispatch_tensor_core as D

    bb = relax.BlockBuilder()
    q = relax.Var("q", relax.TensorType((1, 4, 4, 8), "int8"))
    with bb.function("main", [q]):
        with bb.dataflow():
            y = build(bb, q)
            gv = bb.emit_output(relax.Tuple([y, q]) if also_return_q else y)
        bb.emit_func_output(gv)
    f = bb.get()["main"]
    return D._lut_chain(f.params[0], list(f.body.blocks[0].bindings), D._var_uses(f))


def test_chain_matcher_takes_and_refuses():
    """The matcher on hand-built chains: ``take(table, q + 128)`` gives the table itself (axis 0 or None); a take in
    "fast" mode, a 2-D table, q used outside the chain, a per-channel (non-scalar) constant: no table."""
    from tvm import relax

    table = np.random.default_rng(0).integers(-128, 128, 256).astype("int8")

    def lookup(axis=0, mode="clip", t=table, pre=None):
        def build(bb, q):
            x = bb.emit(pre(q)) if pre else q
            i = bb.emit(relax.op.subtract(relax.op.astype(x, "int32"), relax.const(-128, "int32")))
            return bb.emit(relax.op.take(relax.const(t), i, axis=axis, mode=mode))
        return build

    for axis in (0, None):
        lut = _chain_of(lookup(axis=axis))
        assert lut is not None and lut.lut_min == -128 and np.array_equal(lut.table, table) and lut.takes == 1
    assert _chain_of(lookup(mode="fast")) is None
    assert _chain_of(lookup(t=table.reshape(16, 16))) is None
    assert _chain_of(lookup(), also_return_q=True) is None
    assert _chain_of(lookup(pre=lambda q: relax.op.add(q, relax.const(np.arange(8, dtype="int8"))))) is None
    shifted = _chain_of(lookup(pre=lambda q: relax.op.add(q, relax.const(3, "int8"))))  # (int8 wrap-around)
    assert shifted is not None and np.array_equal(
        shifted.table, table[(np.arange(-128, 128) + 3).astype(np.int8).astype(np.int64) + 128])
