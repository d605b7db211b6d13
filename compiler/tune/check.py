"""A GPU bit-exactness check a user runs on their own GPU: a small set of conv kernels of every strategy the arch
has (the implicit GEMM's mma.sync and wgmma forms, the transposed implicit GEMM, direct HWNC, the halo stem,
split-K pairs, stream-K, the generic fallback), 8- and 4-bit, with residual adds and padding values, built on this
machine and run through a runner (``qcompile.tune.runners``: the local GPU by default, an RPC tracker's GPUs, or an
exported batch) -- each compared bit for bit with the NumPy reference on random inputs, then timed::

    python -m qcompile.tune.check                       # this machine's GPU, its arch
    python -m qcompile.tune.check --arch sm_75 --export DIR    # build for a T4 here, measure there (DIR/.../run.sh)
    python -m qcompile.tune.check --arch sm_75 --import DIR/batch_0001/results.json
    python -m qcompile.tune.check --runner rpc --rpc-tracker 127.0.0.1:9190 --rpc-key h100 --arch sm_90

One line per kernel (PASS / FAIL, its strategy as built, the time); exit status 0 when every kernel passes, 1 when
one does not, 2 for a bad option.
"""
from __future__ import annotations

import re
import sys

from qcompile.errors import OneLineArgumentParser, QCompileError, run_cli

from . import build as B
from . import runners as RN
from .common import OK, Candidate

U8 = dict(x_dtype="uint8", w_bits=8, out_dtype="uint8", zo=3, lo=0, hi=255)
I8 = dict(x_dtype="int8", w_bits=8, out_dtype="int8", zo=-2, lo=-128, hi=127)
U4 = dict(x_dtype="uint4", w_bits=4, out_dtype="uint4", zo=1, lo=0, hi=15)
I4 = dict(x_dtype="int4", w_bits=4, out_dtype="int8", zo=-1, lo=-128, hi=127)
RES8 = dict(has_residual=True, res_dtype="uint8", zo2=-1, lo2=0, hi2=255)
RES4 = dict(has_residual=True, res_dtype="uint4", zo2=0, lo2=0, hi2=15, rq2_uniform=(2, 1 << 19, -1, 1 << 19, 20))
L = dict(N=2, H=9, W=9, C=64, K=64, R=3, S=3, padding=1)  # a small 3x3 layer
WG = dict(BM=128, BN=128, BK=128, WM=2, WN=1, stages=3, pipe=-1, mma="wgmma")
SYNC = "arch-defaults"  # the arch's default mma.sync knobs

# (name, spec fields, strategy, knobs, sm_90 only)
CASES = [
    ("igemm_sync_u8_res_pad", dict(L, **U8, **RES8, pad_value=17), "implicit_gemm", SYNC, False),
    ("igemm_sync_i8_s2_ge33", dict(L, stride=2, H=11, W=11, K=32, **I8, pad_value=-5, shift_ge33=True),
     "implicit_gemm", SYNC, False),
    ("igemm_sync_u8_i32out", dict(L, C=32, x_dtype="uint8", w_bits=8, out_dtype="int32", zo=7, lo=-(1 << 31),
                                  hi=(1 << 31) - 1), "implicit_gemm", SYNC, False),
    ("igemm_sync_u4_res_pad", dict(L, **U4, **RES4, pad_value=3), "implicit_gemm", SYNC, False),
    ("igemm_sync_i4_1x1", dict(L, R=1, S=1, padding=0, C=128, **I4), "implicit_gemm", SYNC, False),
    ("igemm_logged_u8", dict(L, N=4, **U8), "implicit_gemm", None, False),
    ("igemm_logged_u4_res", dict(L, N=4, **U4, **RES4), "implicit_gemm", None, False),
    ("igemm_wg_u8_res", dict(L, **U8, **RES8), "implicit_gemm", WG, True),
    ("igemm_wg_i8_erq_u4out", dict(L, **dict(I8, out_dtype="uint4", zo=1, lo=0, hi=15)), "implicit_gemm",
     dict(WG, BM=64, BN=64, WM=1, erq=True), True),
    ("igemm_wg_u4_areg", dict(L, **U4), "implicit_gemm", dict(WG, BK=64, stages=2, pstages=3, areg=True), True),
    ("igemm_wg_u4_w8_agl", dict(L, C=128, **U4, shift_ge33=True), "implicit_gemm",
     dict(WG, BK=64, WM=1, BN=64, stages=3, pstages=3, areg=True, w8=True, awarp=True, agl=True), True),
    ("igemm_wg_i8_agl8_res", dict(L, **dict(I8, out_dtype="uint8"), **RES8, res_i32=True), "implicit_gemm",
     dict(WG, BK=64, BM=64, WM=1, BN=64, stages=3, pstages=3, areg=True, w8=True, awarp=True, agl=True), True),
    ("igemm_wg_pingpong_u8", dict(L, N=8, **U8), "implicit_gemm", dict(WG, WM=1, BM=64, pp=True, stages=4), True),
    ("igemm_wg_persist_u8", dict(L, N=4, **U8), "implicit_gemm", dict(WG, erq=True, persist=1), True),
    ("igemm_t_u8", dict(L, C=128, K=128, **U8), "implicit_gemm_t", None, True),
    ("igemm_t_i4", dict(L, C=128, K=128, **dict(I4, out_dtype="int4", zo=0, lo=-8, hi=7)), "implicit_gemm_t",
     None, True),
    ("direct_hwnc_u8_res_pad", dict(L, N=8, layout="HWNC", **U8, **RES8, pad_value=9), "direct_hwnc", None, False),
    ("direct_hwnc_u4", dict(L, N=8, layout="HWNC", **U4), "direct_hwnc", None, False),
    ("direct_halo_u8_pad", dict(N=2, H=32, W=32, C=16, K=64, R=4, S=4, padding=(2, 2, 1, 1), **U8, pad_value=7,
                                shift_ge33=True), "direct_halo", None, True),
    ("direct_halo_i8_i4out_pad", dict(N=1, H=24, W=24, C=16, K=64, R=4, S=4, padding=(2, 2, 1, 1),
                                      **dict(I8, out_dtype="int4", zo=0, lo=-8, hi=7), pad_value=-5),
     "direct_halo", None, True),
    ("splitk_sync_u8_res", dict(L, N=1, H=7, W=7, C=256, **U8, **RES8), "implicit_gemm", dict(split_k=4), False),
    ("splitk_sync_u4", dict(L, N=1, H=7, W=7, C=256, **U4), "implicit_gemm", dict(split_k=2), False),
    ("splitk_wg_i8", dict(L, N=1, H=7, W=7, C=256, **I8), "implicit_gemm", dict(WG, BM=64, WM=1, split_k=4), True),
    ("streamk_u8_res", dict(L, N=1, H=7, W=7, C=256, **U8, **RES8), "implicit_gemm", dict(WG, sk=1), True),
    ("fallback_u8_c3_res_pad", dict(L, C=3, K=10, stride=2, **U8, **RES8, pad_value=11), "fallback", None, False),
    ("fallback_i4_c5", dict(L, C=5, K=6, **dict(I4, out_dtype="uint4", zo=0, lo=0, hi=15)), "fallback", None,
     False),
    ("fallback_hwnc_i8", dict(L, N=1, layout="HWNC", C=16, K=24, **I8, pad_value=-3), "fallback", None, False),
]


def arch_for(device_arch: str) -> tuple[str, str]:
    """(arch, nvcc mode) qcompile builds for a GPU of ``device_arch`` (sm_XY from its compute capability): sm_90 on
    9.0; the sm_89 PTX (JIT-compiled by the driver) on newer GPUs; else the newest arch it supports."""
    from qcompile.registry import CUDA_ARCHS

    cc = int(device_arch.split("_")[1].rstrip("a"))
    if cc == 90:
        return "sm_90", "sass"
    if cc > 90:
        return "sm_89", "ptx"
    fits = [a for a in CUDA_ARCHS if int(a[3:]) <= cc]
    if not fits:
        raise QCompileError(f"the GPU ({device_arch}) is older than every arch qcompile targets ({CUDA_ARCHS})")
    return fits[-1], "sass"


def candidates(arch: str, target: str = "cuda", only: str | None = None) -> list[Candidate]:
    """The check's candidates for ``arch`` (llvm: the fallback cases), named by their key ``check:<name>``."""
    from qcompile.schedules import DEFAULT_KNOBS, ConvSpec, GemmKnobs
    from qcompile.schedules.igemm_t import KtKnobs
    from qcompile.schedules.stem import HaloKnobs

    out = []
    for name, fields, strategy, kn, sm90 in CASES:
        if (sm90 and arch != "sm_90") or (target == "llvm" and strategy != "fallback"):
            continue
        if only and not re.search(only, name):
            continue
        if kn == SYNC:
            kn = DEFAULT_KNOBS[arch]
        elif kn is not None:
            kn = {"direct_halo": HaloKnobs, "implicit_gemm_t": KtKnobs}.get(strategy, GemmKnobs)(**kn)
        out.append(Candidate(f"check:{name}", ConvSpec(**fields), arch, strategy, kn))
    return out


def main(argv=None) -> int:
    ap = OneLineArgumentParser(prog="python -m qcompile.tune.check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", help="the arch to build for (sm_75 ... sm_90; default: the GPU's, from the runner)")
    ap.add_argument("--target", choices=B.TARGETS, default="cuda",
                    help="cuda (default), or llvm: the fallback cases on the CPU (with --measure-device cpu)")
    ap.add_argument("--only", metavar="REGEX", help="only the cases whose name matches")
    ap.add_argument("--list", action="store_true", help="list the cases for the arch and exit")
    B.add_arguments(ap)
    RN.add_arguments(ap)
    a = ap.parse_args(argv)

    def body() -> int:
        from qcompile.registry import CUDA_ARCHS

        if a.arch and a.arch not in CUDA_ARCHS:
            raise QCompileError(f"--arch {a.arch}: one of {', '.join(CUDA_ARCHS)}")
        runner = RN.make_runner(a)
        mode = a.nvcc_mode
        if a.arch:
            arch = a.arch
        elif a.target == "llvm" or a.list:
            arch = "sm_90"
        else:
            dev = runner.device()
            arch, mode = arch_for(dev.arch)
            print(f"device: {dev.name} ({dev.arch}, {dev.sms} SMs): building for {arch} ({mode})", flush=True)
        cands = candidates(arch, a.target, a.only)
        if a.list:
            for c in cands:
                print(c.key[6:], c.strategy)
            return 0
        if not cands:
            raise QCompileError(f"no check case matches --only {a.only!r} for {arch}")
        a.nvcc_mode = mode
        builder = B.make_builder(a)
        try:
            if isinstance(runner, RN.OfflineRunner) and a.import_results:
                measured = RN.import_results(a.import_results[0])
            else:
                print(f"building {len(cands)} kernels for {arch if a.target == 'cuda' else 'llvm'} "
                      f"({builder.jobs} jobs)", flush=True)
                built = builder.build(cands)
                try:
                    measured = runner.measure(built)
                except RN.OfflineBatchPending as e:
                    bad = [b for b in built if b.error]
                    for b in bad:
                        print(f"FAIL {b.candidate.key.split(':', 1)[-1]:<28} {b.candidate.strategy:<16} "
                              f"build_error: {b.error}")
                    print(f"{len(built) - len(bad)} of {len(built)} kernels built; {e}")
                    return 0 if not bad else 1
        finally:
            builder.close()
        labels = {}
        nfail = 0
        for m in measured:
            name = m.candidate.key.split(":", 1)[-1]
            labels.setdefault(name, m.candidate.strategy)
            ok = m.status == OK
            nfail += not ok
            ms = f"{m.ms * 1e3:9.1f} us" if ok else ""
            print(f"{'PASS' if ok else 'FAIL'} {name:<28} {m.candidate.strategy:<16} {ms} "
                  f"{'' if ok else m.status + ': ' + m.detail}".rstrip(), flush=True)
        dev = next((m.device for m in measured if m.device), "?")
        print(f"{len(measured) - nfail} of {len(measured)} kernels bit-exact on {dev}")
        return 0 if nfail == 0 else 1

    return run_cli("qcompile.tune.check", body)


if __name__ == "__main__":
    sys.exit(main())
