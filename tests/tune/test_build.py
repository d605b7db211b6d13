"""qcompile.tune.build: candidates built on the host, one library and one manifest entry each (llvm: the CPU
fallback kernel; cuda, with nvcc: sm_90 and sm_75 kernels in parallel build processes), refusals as one line."""
from __future__ import annotations

import json
import os

import pytest

from qcompile.errors import QCompileError
from qcompile.schedules import ConvSpec, GemmKnobs
from qcompile.schedules.tuning import tuning_key
from qcompile.tune.build import LocalBuilder, add_arguments, make_builder
from qcompile.tune.common import Candidate

SPEC = ConvSpec(N=1, H=7, W=7, C=8, K=8, R=3, S=3, padding=1, x_dtype="uint8", out_dtype="uint8", lo=0, hi=255)


def test_llvm_candidates_build_with_their_manifest(tmp_path):
    b = LocalBuilder(jobs=1, build_dir=str(tmp_path), target="llvm")
    c = Candidate(tuning_key(SPEC), SPEC, "sm_90", "fallback", None)
    other = Candidate("x", SPEC, "sm_90", "implicit_gemm", GemmKnobs())
    out = b.build([c, other, c])
    assert out[0].error is None and out[2].path == out[0].path and os.path.isfile(out[0].path)
    assert out[1].path is None and out[1].error == ("target llvm builds the CPU kernels (cpu_direct) and the fallback "
                                                    "kernel, not implicit_gemm")
    e = out[0].entry
    assert (e["target"], e["strategy"], e["funcs"], e["split_k"], e["streamk"], e["knobs"]) == \
        ("llvm", "fallback", [e["id"] + "_0"], 1, None, None)
    assert e["key"] == tuning_key(SPEC) and e["spec"]["H"] == 7 and e["build_s"] > 0 and out[0].build_s > 0
    man = json.loads((tmp_path / "batch_0001" / "manifest.json").read_text())
    assert man["format"] == "qcompile-tune-batch/1" and man["candidates"] == [json.loads(json.dumps(e))]
    assert b.build([c])[0].path.startswith(str(tmp_path / "batch_0002"))  # (a folder per batch)


def test_builder_options(tmp_path):
    import argparse

    ap = argparse.ArgumentParser()
    add_arguments(ap)
    a = ap.parse_args(["--jobs", "3", "--build-dir", str(tmp_path), "--nvcc-mode", "both"])
    b = make_builder(a)
    assert (b.jobs, b.build_dir, b.target, b.nvcc_mode) == (3, str(tmp_path), "cuda", "both")
    a.jobs = 0
    with pytest.raises(QCompileError, match="--jobs"):
        make_builder(a)
    a.jobs, a.target = 1, "opencl"
    with pytest.raises(QCompileError, match="--target opencl"):
        make_builder(a)
    assert ap.parse_args([]).jobs == (os.cpu_count() or 1)


@pytest.mark.nvcc
def test_cuda_candidates_build_for_sm90_and_sm75_in_parallel(tmp_path):
    """Two build processes: an sm_90 split-K pair (its workspace in the entry), an sm_75 4-bit kernel (native S4
    MMA in its SASS where cuobjdump is installed), and knobs the kernel refuses -- the strategy's reason, no
    kernel."""
    s8 = ConvSpec(N=1, H=7, W=7, C=256, K=64, R=3, S=3, padding=1, x_dtype="uint8", out_dtype="uint8", lo=0, hi=255)
    s4 = ConvSpec(N=2, H=9, W=9, C=64, K=64, R=3, S=3, padding=1, x_dtype="uint4", w_bits=4, out_dtype="uint4",
                  lo=0, hi=15)
    cands = [Candidate(tuning_key(s8), s8, "sm_90", "implicit_gemm", GemmKnobs(split_k=2)),
             Candidate(tuning_key(s4), s4, "sm_75", "implicit_gemm", GemmKnobs(BM=64, BN=64, stages=2)),
             Candidate(tuning_key(s8), s8, "sm_75", "implicit_gemm", GemmKnobs(mma="wgmma", WN=1))]
    b = LocalBuilder(jobs=2, build_dir=str(tmp_path))
    try:
        out = b.build(cands)
    finally:
        b.close()
    e90, e75 = out[0].entry, out[1].entry
    assert out[0].error is None and out[1].error is None, (out[0].error, out[1].error)
    assert e90["label"] == "implicit_gemm+splitk2" and len(e90["funcs"]) == 2
    assert e90["workspace"] == [2, 49, 64] and e90["nvcc_mode"] == "sass" and e90["knobs"]["split_k"] == 2
    assert e75["arch"] == "sm_75" and e75["split_k"] == 1 and e75["knobs_type"] == "GemmKnobs"
    assert out[2].path is None and out[2].error.startswith("not applicable: ") and "\n" not in out[2].error
    from qcompile.cuda_tools import cuobjdump, find_tool

    if find_tool("cuobjdump"):
        sass = cuobjdump(out[1].path, "-sass")
        assert "IMMA.8832.U4.S4" in sass  # (unsigned 4-bit activations, signed 4-bit weights: native S4 MMA)


def test_a_build_that_hangs_is_killed_and_reported(tmp_path):
    """A candidate whose build does not finish in the builder's timeout is reported as a build error naming the
    timeout (its process killed, the batch's other unfinished builds started again); the others are built."""
    import time

    from fakes import sleepy_build_task

    # (77 hangs; on the other process 79 then 78, which is still running -- 2.5 s of its own -- when 77 is found
    # hung: it starts again in the new pool, with a new clock, and finishes)
    specs = [ConvSpec(N=1, H=8, W=8, C=16, K=k, R=1, S=1) for k in (77, 79, 78, 16, 32)]
    cands = [Candidate(f"t{i}", s, "sm_90", "fallback", None) for i, s in enumerate(specs)]
    b = LocalBuilder(jobs=2, build_dir=str(tmp_path), target="llvm", timeout=3, task_fn=sleepy_build_task)
    t0 = time.time()
    built = b.build(cands)
    b.close()
    assert time.time() - t0 < 30
    assert [x.error is None for x in built] == [False, True, True, True, True], [x.error for x in built]
    assert "did not finish in 3 s" in built[0].error
