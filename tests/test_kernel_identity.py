"""The generated CUDA of the kernels compiled models run stays byte-identical (sha256 per kernel).

The set (``cases()``): every kernel ``tuning_logs/sm_90.jsonl`` selects -- each record of each GPU the log holds
(``--gpu`` selects that GPU's records), of every strategy it holds records for (implicit_gemm, implicit_gemm_t,
direct_halo): the record's spec from its key with the epilogue compiled models get, its strategy and knobs, through
``plan_conv`` (split-K epilogues included) -- and beside the records the halo stem (its 4-bit output too),
``implicit_gemm_t`` (8- and 4-bit, the 4-bit ring, two groups in flight), ``direct_hwnc``, the fallback, default knobs
for untuned shapes, and the ``mma.sync`` kernels of sm_75 / sm_80 / sm_86 with 4- and 8-bit operands. The source
comes from TVM's CUDA codegen; nvcc does not run (``captured_cuda``).

* CI (pytest): the deterministic subset ``ci_cases()`` -- every case that is not a tuning record, and one record per
  distinct kernel family of the log (``_family``: per strategy, what distinguishes its code paths).
* The full set: ``python tests/test_kernel_identity.py --full`` (or ``QCOMPILE_IDENTITY_FULL=1 pytest ...``).
* Regenerate the data file (only after a change that is meant to change the generated code, or a new log):
  ``python tests/test_kernel_identity.py --regen``. Cases with the same spec, arch, strategy and knobs (two GPUs'
  equal records) are generated once.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pathlib
import sys
import time


DATA = pathlib.Path(__file__).parent / "data" / "kernel_sources.json"
LOG = pathlib.Path(__file__).resolve().parents[1] / "tuning_logs" / "sm_90.jsonl"


@contextlib.contextmanager
def captured_cuda():
    """TVM's ``tvm_callback_cuda_compile`` replaced by one that records each CUDA source it is given (and returns a
    placeholder binary) for the duration; the registered callback is restored afterwards."""
    import tvm_ffi

    import qcompile.schedules.build  # noqa: F401  (its callback is the one to restore)

    old = tvm_ffi.get_global_func("tvm_callback_cuda_compile")
    sources: list[str] = []

    def capture(code, *_unused):
        sources.append(code)
        return bytearray(b"\0")

    tvm_ffi.register_global_func("tvm_callback_cuda_compile", capture, override=True)
    try:
        yield sources
    finally:
        tvm_ffi.register_global_func("tvm_callback_cuda_compile", old, override=True)


def cuda_source(func, arch: str) -> str:
    """The CUDA source TVM generates for PrimFunc ``func`` on ``arch`` (nvcc not run)."""
    import tvm

    from qcompile.schedules.build import cuda_target, ensure_stub_libcuda

    ensure_stub_libcuda()
    mod = tvm.IRModule({"main": func.with_attr("global_symbol", "main")})
    with captured_cuda() as srcs:
        tvm.compile(mod, target=cuda_target(arch))
    assert len(srcs) == 1, len(srcs)
    return srcs[0]


# ---- the set ----------------------------------------------------------------------------------------------------
def _spec_from_key(key: str):
    """The ConvSpec a compiled model runs for a tuning key: unsigned activations and output with the stage-1
    epilogue of a QDQ ResNet's convs (``shift_ge33``), and with ``|res`` ResNet-50's residual stage."""
    from qcompile.schedules import ConvSpec
    from qcompile.schedules.layers import RQ2_RESNET50

    p = key.split("|")
    num = {f[0]: int(f[1:]) for f in p[1:8]}
    st = tuple(int(v) for v in p[8][2:].split(","))
    pad = tuple(int(v) for v in p[9][3:].split(","))
    dil = tuple(int(v) for v in p[10][3:].split(","))
    xb, wb = int(p[11][1:]), int(p[12][1:])
    u = "uint8" if xb == 8 else "uint4"
    spec = ConvSpec(N=num["N"], H=num["H"], W=num["W"], C=num["C"], K=num["K"], R=num["R"], S=num["S"], stride=st,
                    padding=pad, dilation=dil, layout=p[0], x_dtype=u, w_bits=wb, out_dtype=u, zo=3 if xb == 8 else 1,
                    lo=0, hi=255 if xb == 8 else 15, shift_ge33=True)
    if "res" in p[13:]:
        hi = 255 if xb == 8 else 15
        spec = spec.replace(has_residual=True, lo=-(hi + 1) // 2, hi=hi // 2, zo=0, res_dtype=u, zo2=0, lo2=0, hi2=hi,
                            res_i32=True, rq2_uniform=RQ2_RESNET50)
    return spec


def _records():
    from qcompile.schedules.tuning import parse_record

    out = []
    for line in LOG.read_text().splitlines():
        if line.strip():
            rec, why = parse_record(line)
            assert rec is not None, why
            out.append(rec)
    return out


def _family(strategy: str, kn, spec) -> tuple:
    """What distinguishes the code paths of a record's kernel (the CI subset takes one record per value): for the
    GemmKnobs strategies the MMA path and the main loop's / epilogue's variants, for implicit_gemm_t the 4-bit ring
    and the groups in flight, for direct_halo the pipelined epilogue; the operand width and the kernel size for all."""
    common = (strategy, spec.x_bits, spec.has_residual, spec.R * spec.S == 1)
    if strategy == "implicit_gemm_t":
        return common + (kn.ring, kn.gif)
    if strategy == "direct_halo":
        return common + (kn.pipe,)
    return common + (kn.mma, kn.pipe, kn.areg, kn.awarp, kn.w8, kn.agl, kn.pp, kn.sk, kn.erq, kn.fdb, kn.split_k > 1)


def cases() -> dict:
    """name -> (spec, arch, strategy, knobs): the whole set, in a fixed order."""
    from qcompile.schedules import ConvSpec, GemmKnobs
    from qcompile.schedules.igemm_t import KtKnobs
    from qcompile.schedules.spec import space_to_depth
    from qcompile.schedules.stem import HaloKnobs

    out = {}
    for rec in _records():  # (one record per key, GPU and strategy family: the name tells them apart)
        out[f"rec|{rec.strategy}|{rec.device}|{rec.key}"] = (_spec_from_key(rec.key), rec.arch, rec.strategy, rec.knobs)
    u8 = dict(x_dtype="uint8", out_dtype="uint8", zo=3, lo=0, hi=255, shift_ge33=True)
    u4 = dict(x_dtype="uint4", w_bits=4, out_dtype="uint4", zo=1, lo=0, hi=15, shift_ge33=True)
    stem = ConvSpec(N=8, H=224, W=224, C=4, K=64, R=7, S=7, stride=2, padding=3, **u8)
    for n in (1, 8, 256):
        out[f"halo|N{n}|u8"] = (space_to_depth(stem.replace(N=n)), "sm_90", "direct_halo", None)
    out["halo|N64|u4out"] = (space_to_depth(stem.replace(N=64, out_dtype="uint4", lo=0, hi=15)), "sm_90",
                             "direct_halo", HaloKnobs(th=2, pipe=0))
    l4 = dict(H=7, W=7, C=512, K=512, R=3, S=3, padding=1)
    l4a = dict(H=14, W=14, C=1024, K=512, R=1, S=1)
    for n in (8, 64):
        out[f"kt|N{n}|l4_3x3|u8"] = (ConvSpec(N=n, **l4, **u8), "sm_90", "implicit_gemm_t", None)
        out[f"kt|N{n}|l4_3x3|u4"] = (ConvSpec(N=n, **l4, **u4), "sm_90", "implicit_gemm_t", None)
    out["kt|N32|l4_1x1a|u8|gif2"] = (ConvSpec(N=32, **l4a, **u8), "sm_90", "implicit_gemm_t", KtKnobs(gif=2))
    out["kt|N32|l4_1x1a|u4|ring"] = (ConvSpec(N=32, **l4a, **u4), "sm_90", "implicit_gemm_t", KtKnobs(ring=1))
    hw = dict(N=32, H=14, W=14, C=256, K=256, R=3, S=3, padding=1, layout="HWNC")
    for arch in ("sm_90", "sm_80", "sm_75"):
        out[f"hwnc|{arch}|u8"] = (ConvSpec(**hw, **u8), arch, "direct_hwnc", None)
        out[f"hwnc|{arch}|u4"] = (ConvSpec(**hw, **u4), arch, "direct_hwnc", None)
    out["fallback|w4x8"] = (ConvSpec(N=2, H=9, W=9, C=16, K=24, R=3, S=3, padding=1, x_dtype="uint8", w_bits=4),
                            "sm_90", "fallback", None)
    odd = [dict(N=3, H=17, W=17, C=24, K=40, R=3, S=3, padding=1), dict(N=1, H=13, W=13, C=40, K=72, R=1, S=1),
           dict(N=8, H=11, W=11, C=72, K=24, R=3, S=3, stride=2, padding=1), dict(N=4, H=28, W=28, C=128, K=128,
                                                                                    R=3, S=3, padding=1)]
    for i, o in enumerate(odd):
        for arch in ("sm_90", "sm_86"):
            out[f"default|{arch}|odd{i}|u8"] = (ConvSpec(**o, **u8), arch, "implicit_gemm", None)
    out["default|sm_90|odd3|u4"] = (ConvSpec(**odd[3], **u4), "sm_90", "implicit_gemm", None)
    out["default|sm_90|odd3|u8|pad"] = (ConvSpec(**odd[3], **u8, pad_value=5), "sm_90", "implicit_gemm", None)
    l3 = dict(N=8, H=14, W=14, C=256, K=256, R=3, S=3, padding=1)
    pw = dict(N=8, H=14, W=14, C=256, K=1024, R=1, S=1)
    res8 = dict(has_residual=True, lo=-128, hi=127, zo=0, res_dtype="uint8", lo2=0, hi2=255)
    for arch in ("sm_75", "sm_80"):
        for bits, dt in ((8, u8), (4, u4)):
            base = GemmKnobs(stages=2 if arch == "sm_75" else 3)
            out[f"sync|{arch}|x{bits}|l3"] = (ConvSpec(**l3, **dt), arch, "implicit_gemm", base)
            out[f"sync|{arch}|x{bits}|pw|pipe1|fdb"] = (ConvSpec(**pw, **dt), arch, "implicit_gemm",
                                                        base.replace(pipe=1, fdb=True))
            out[f"sync|{arch}|x{bits}|l3|split4"] = (ConvSpec(**l3, **dt).replace(N=1), arch, "implicit_gemm",
                                                     base.replace(split_k=4))
        out[f"sync|{arch}|x8|pw|res|8warp"] = (ConvSpec(**pw, **{**u8, **res8}), arch, "implicit_gemm",
                                              GemmKnobs(BM=128, BN=128, WM=4, WN=2, stages=3 if arch == "sm_80" else 2))
    out["sync|sm_90|x4|l3|i8out"] = (ConvSpec(**l3, **u4).replace(out_dtype="int8", lo=-128, hi=127, shift_ge33=False),
                                     "sm_90", "implicit_gemm", GemmKnobs(stages=4))
    return out


def ci_cases(all_cases: dict) -> list[str]:
    """Every non-record case, and the first record of each kernel family (``_family``)."""
    seen, out = set(), []
    for name, (spec, _, strategy, kn) in all_cases.items():
        if name.startswith("rec|"):
            fam = _family(strategy, kn, spec)
            if fam in seen:
                continue
            seen.add(fam)
        out.append(name)
    return out


def kernel_hashes(spec, arch, strategy, knobs) -> list[str]:
    """sha256 of the CUDA source of each kernel ``plan_conv`` gives, in launch order (the implicit GEMM / HWNC kernels
    without knobs get ``default_knobs``: the set checks the builders, not the tuning-log lookup)."""
    from qcompile.schedules import default_knobs, plan_conv

    if knobs is None and strategy in ("implicit_gemm", "direct_hwnc"):
        knobs = default_knobs(spec, arch)
    pk = plan_conv(spec, arch, strategy, knobs)
    return [hashlib.sha256(cuda_source(f, arch).encode()).hexdigest() for f in pk.funcs]


def _compute(names, all_cases, log=None) -> dict:
    """name -> ``kernel_hashes`` of each case of ``names``; cases with equal contents generated once."""
    out, done = {}, {}
    for i, name in enumerate(names):
        t = time.time()
        what = repr(all_cases[name])
        if what not in done:
            done[what] = kernel_hashes(*all_cases[name])
        out[name] = done[what]
        if log:
            log(f"[{i + 1}/{len(names)}] {name}: {len(out[name])} kernel(s), {time.time() - t:.2f} s")
    return out


def _check(names) -> list[str]:
    all_cases = cases()
    want = json.loads(DATA.read_text())
    missing = [n for n in names if n not in want]
    assert not missing, f"no stored hash for {missing[:5]} ({len(missing)}): regenerate the data file (--regen)"
    got = _compute(names, all_cases)
    return [n for n in names if got[n] != want[n]]


def test_ci_subset_identical():
    """The CI subset's generated CUDA equals the stored hashes (the full set with QCOMPILE_IDENTITY_FULL=1)."""
    all_cases = cases()
    names = list(all_cases) if os.environ.get("QCOMPILE_IDENTITY_FULL") else ci_cases(all_cases)
    bad = _check(names)
    assert not bad, f"{len(bad)} of {len(names)} kernels changed: {bad[:10]}"


def test_data_covers_the_set():
    """The data file names exactly the cases of the set (a record added to the log needs --regen)."""
    assert set(json.loads(DATA.read_text())) == set(cases())


def test_ci_subset_covers_every_family():
    """Every record of the log is a case (of each GPU and strategy); the CI subset takes a record of every kernel
    family, of every strategy the log holds records for, and not every case."""
    all_cases = cases()
    recs = {n: c for n, c in all_cases.items() if n.startswith("rec|")}
    log = _records()
    assert len(recs) == len(log) and {st for _, _, st, _ in recs.values()} == {r.strategy for r in log}
    fams = {_family(st, kn, spec) for spec, _, st, kn in recs.values()}
    picked = {_family(recs[n][2], recs[n][3], recs[n][0]) for n in ci_cases(all_cases) if n in recs}
    assert picked == fams and {f[0] for f in picked} == {r.strategy for r in log}
    assert len(ci_cases(all_cases)) < len(all_cases)


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--regen", action="store_true", help="recompute every case and write the data file")
    ap.add_argument("--full", action="store_true", help="check the whole set (default: the CI subset)")
    a = ap.parse_args()
    t0 = time.time()
    allc = cases()
    if a.regen:
        hashes = _compute(list(allc), allc, log=print)
        DATA.parent.mkdir(parents=True, exist_ok=True)
        DATA.write_text(json.dumps(hashes, indent=0, sort_keys=True) + "\n")
        print(f"wrote {len(hashes)} cases to {DATA} in {time.time() - t0:.1f} s")
        sys.exit(0)
    sel = list(allc) if a.full else ci_cases(allc)
    changed = _check(sel)
    print(f"{len(sel) - len(changed)} of {len(sel)} cases identical ({time.time() - t0:.1f} s)")
    for n in changed:
        print("changed:", n)
    sys.exit(1 if changed else 0)
