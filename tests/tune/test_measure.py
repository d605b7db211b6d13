"""qcompile.tune.measure: the measuring side of the tuner (NumPy and the TVM runtime only) -- its NumPy reference
and buffer formats against qcompile.schedules.reference, its imports, and the batch supervisor's isolation of
candidates that fail, kill their process or hang (on the CPU, with llvm-built fallback kernels)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from qcompile.schedules import ConvSpec
from qcompile.schedules import reference as R
from qcompile.schedules.planned import PlannedKernel
from qcompile.tune import measure as M

SPECS = [
    ConvSpec(N=2, H=7, W=6, C=8, K=16, R=3, S=3, padding=1, x_dtype="uint8", out_dtype="uint8", zo=3, lo=0, hi=255,
             pad_value=17),
    ConvSpec(N=1, H=9, W=9, C=5, K=7, R=3, S=2, stride=(2, 1), padding=(1, 0, 2, 1), dilation=(1, 2), x_dtype="int4",
             w_bits=4, out_dtype="uint4", lo=0, hi=15, zo=1, has_residual=True, res_dtype="uint4", lo2=0, hi2=15),
    ConvSpec(N=3, H=5, W=5, C=16, K=24, R=1, S=1, layout="HWNC", x_dtype="uint8", out_dtype="uint8", lo=-128, hi=127,
             has_residual=True, res_dtype="uint8", lo2=0, hi2=255, res_i32=True, shift_ge33=True),
    ConvSpec(N=2, H=6, W=6, C=32, K=9, R=3, S=3, padding=1, layout="HWNC", x_dtype="int4", w_bits=4,
             out_dtype="int4", lo=-8, hi=7, has_residual=True, res_dtype="int4", lo2=-8, hi2=7,
             rq2_uniform=(2, 1 << 19, -1, 1 << 19, 20)),
    ConvSpec(N=1, H=5, W=5, C=16, K=8, R=3, S=3, padding=1, out_dtype="int32", zo=7, lo=-(1 << 31), hi=(1 << 31) - 1),
]


def _ids(s):
    return f"{s.layout}-{s.x_dtype}-w{s.w_bits}-{s.out_dtype}-res{int(s.has_residual)}"


@pytest.mark.parametrize("spec", SPECS, ids=_ids)
def test_reference_equals_the_schedules_reference(spec):
    """Same seed, same draws; the same reference output, storage and shapes as qcompile.schedules.reference."""
    d = M.Spec(__import__("dataclasses").asdict(spec))
    assert (d.P, d.Q, d.shapes(), d.res_shape()) == (spec.P, spec.Q, spec.shapes(), spec.res_shape())
    for seed in (1, 2):
        mine = M.random_problem(d, np.random.default_rng(seed))
        theirs = R.random_problem(spec, np.random.default_rng(seed))
        for a, b in zip(mine[:5], theirs[:5]):
            assert np.array_equal(a, b)
        assert (mine[5] is None) == (theirs[5] is None)
        x, w, b, Mq, S, res = theirs
        ref = R.conv_reference(spec, x, w, b, Mq, S, res)
        got = M.conv_reference(d, x, w, b, Mq, S, res)
        assert got.shape == ref.shape and np.array_equal(got, ref) and np.unique(ref).size > 3
        assert np.array_equal(M.to_storage(ref, spec.out_dtype), R.to_storage(ref, spec.out_dtype))
        assert np.array_equal(M.from_storage(R.to_storage(ref, spec.out_dtype), spec.out_dtype, spec.K), ref)
        assert np.array_equal(M.to_storage(x, spec.x_dtype), R.to_storage(x, spec.x_dtype))


@pytest.mark.parametrize("spec", SPECS, ids=_ids)
def test_reference_in_chunks_and_storage_form(spec):
    """The reference computed over chunks of the batch in threads equals the one-piece computation, and its
    storage form equals to_storage of the logical values; a problem saved to disk loads back equal."""
    d = M.Spec(__import__("dataclasses").asdict(spec))
    x, w, b, Mq, S, res = R.random_problem(spec, np.random.default_rng(5))
    one = M.conv_reference(d, x, w, b, Mq, S, res, threads=1)
    for t in (2, 3):
        assert np.array_equal(M.conv_reference(d, x, w, b, Mq, S, res, threads=t), one)
        store = M.reference_storage(d, x, w, b, Mq, S, res, threads=t)
        assert store.shape == spec.shapes()[2] and np.array_equal(store, R.to_storage(one, spec.out_dtype))


def test_problem_cache_round_trip(tmp_path):
    """A shape's problem drawn once is saved and loaded back equal (the local runner's later rounds), and two seeds
    give two problems."""
    e = dict(spec=__import__("dataclasses").asdict(SPECS[1]))
    a = M.Problems(str(tmp_path)).get(e, 7)
    assert len(list(tmp_path.iterdir())) == 1
    draw = M.Problem.draw
    M.Problem.draw = classmethod(lambda cls, *a, **k: (_ for _ in ()).throw(AssertionError("drawn again")))
    try:
        b = M.Problems(str(tmp_path)).get(e, 7)  # (a new process's view: from the disk, not drawn)
    finally:
        M.Problem.draw = draw
    assert set(a.arrays) == set(b.arrays) == {"w", "x", "b", "M", "S", "r", "rq2", "ref"}
    assert all(np.array_equal(a.arrays[k], b.arrays[k]) for k in a.arrays) and a.distinct == b.distinct > 3
    c = M.Problems(str(tmp_path)).get(e, 8)
    assert len(list(tmp_path.iterdir())) == 2 and not np.array_equal(c.arrays["x"], a.arrays["x"])


def test_prefetches_are_drawn_in_parallel(monkeypatch):
    """``Problems(workers=n)``: n prefetched shapes are drawn at the same time (the GPU worker draws ``AHEAD``
    shapes ahead of the one it measures), and a ``get`` of a prefetched shape takes that drawing's result."""
    import threading
    import time

    running, peak, made, lock = [0], [0], [], threading.Lock()

    def slow(self, entry, seed):
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
            made.append(entry["k"])
        time.sleep(0.3)
        with lock:
            running[0] -= 1
        return (entry["k"], seed)

    monkeypatch.setattr(M.Problems, "_make", slow)
    monkeypatch.setattr(M, "spec_key", lambda e: e["k"])
    ps = M.Problems(workers=3)
    assert ps.keep >= 5
    for k in range(3):
        ps.prefetch(dict(k=k), 1)
    assert [ps.get(dict(k=k), 1) for k in range(3)] == [(0, 1), (1, 1), (2, 1)] and peak[0] == 3
    assert sorted(made) == [0, 1, 2]  # (each drawn once: the gets took the prefetches' results)
    peak[0] = 0
    one = M.Problems()
    for k in range(2):
        one.prefetch(dict(k=k), 1)
    assert one.get(dict(k=1), 1) == (1, 1) and peak[0] == 1


def test_draws_ahead_fit_half_the_memory():
    """The worker draws up to ``AHEAD`` next shapes' problems ahead, fewer where their memory would pass its room;
    the estimate covers the padded input, patch and accumulators in 8-byte form."""
    import dataclasses

    small, big = (dict(spec=dataclasses.asdict(SPECS[1].replace(N=n))) for n in (1, 64))
    assert M.problem_bytes(big) > 50 * M.problem_bytes(small) > 0
    sp = M.Spec(big["spec"])
    assert M.problem_bytes(big) >= 8 * sp.N * sp.P * sp.Q * (sp.C + 2 * sp.K)
    nxt = [small, big, small, big, small]
    assert M.ahead(nxt, None) == nxt[:M.AHEAD] and M.AHEAD == 3
    room = 2 * M.problem_bytes(small) + M.problem_bytes(big) // 2
    assert M.ahead(nxt, room) == [small]  # (the big one would pass the room: it and the rest wait their turn)
    assert M.ahead(nxt, 0) == []
    avail = M.available_bytes()
    assert avail is None or avail > 0


def test_problem_cache_that_cannot_be_written_is_skipped(tmp_path, capsys):
    """A cache folder that cannot be made (here: a file in the way) costs a warning, not the candidate: the problem
    drawn in memory is returned, nothing is left behind."""
    e = dict(spec=__import__("dataclasses").asdict(SPECS[1]))
    blocker = tmp_path / "cache"
    blocker.write_text("a file, not a folder")
    p = M.Problems(str(blocker / "sub")).get(e, 7)
    assert p.distinct > 3 and "was not written" in capsys.readouterr().err
    assert sorted(x.name for x in tmp_path.iterdir()) == ["cache"]


@pytest.mark.parametrize("w_bits,w_expand,kperm", [(4, False, 0), (4, True, 0), (4, True, 32), (4, True, 64),
                                                   (8, False, 0), (8, False, 32), (8, False, 64)])
def test_weight_formats_equal_the_planned_kernels(w_bits, w_expand, kperm):
    """The weight buffer measure.py makes equals ``PlannedKernel.weights`` (packed, expanded, k-permuted)."""
    spec = ConvSpec(N=1, H=4, W=4, C=64, K=8, R=1, S=2, x_dtype="int4" if w_bits == 4 else "int8", w_bits=w_bits)
    pk = PlannedKernel(spec, "sm_90", "implicit_gemm", None, "user", (), w_expand=w_expand, w_kperm=kperm)
    lo, hi = (-8, 8) if w_bits == 4 else (-128, 128)
    w = np.random.default_rng(3).integers(lo, hi, (8, 1, 2, 64))
    mine = M.weights(M.Spec(__import__("dataclasses").asdict(spec)), w, w_expand, kperm)
    ref = pk.weights(w)
    assert mine.dtype == ref.dtype and np.array_equal(mine, ref)


def test_standalone_imports_nothing_of_the_compiler(tmp_path):
    """measure.py copied alone into a folder imports with NumPy only (no tvm, no qcompile) and its --help runs
    under runtime-only TVM."""
    shutil.copy(M.__file__, tmp_path / "measure.py")
    code = ("import sys; sys.path.insert(0, '.'); import measure; "
            "print([m for m in sys.modules if m.split('.')[0] in ('tvm', 'qcompile', 'torch')])")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stderr
    code = ("import sys, qcompile.tune.measure; "
            "print([m for m in sys.modules if m.startswith(('tvm.relax', 'tvm.tirx', 'qcompile.schedules', 'tvm'))])")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stderr


@pytest.fixture(scope="session")
def runtime_only_tvm(tmp_path_factory):
    """An environment with TVM's Python package as scripts/make_runtime_bundle.sh packs it (no
    libtvm_compiler.so, no 3rdparty/src/include/web) first on PYTHONPATH, and TVM_USE_RUNTIME_LIB=1."""
    import tvm

    src = os.path.dirname(tvm.__file__)
    root = tmp_path_factory.mktemp("tvmrt")
    skip = {"3rdparty", "src", "include", "web", "__pycache__", "libtvm_compiler.so"}
    shutil.copytree(src, root / "tvm", ignore=lambda d, names: [n for n in names if n in skip])
    assert not (root / "tvm" / "lib" / "libtvm_compiler.so").exists()
    return dict(os.environ, PYTHONPATH=str(root), TVM_USE_RUNTIME_LIB="1")


@pytest.fixture(scope="module")
def cpu_batch(tmp_path_factory):
    """Two llvm-built fallback candidates (8-bit NHWC, 4-bit HWNC with a residual) and their manifest."""
    from qcompile.tune.build import LocalBuilder
    from qcompile.tune.common import Candidate

    d = tmp_path_factory.mktemp("cpu_batch")
    b = LocalBuilder(jobs=1, build_dir=str(d), target="llvm")
    specs = [SPECS[0], SPECS[3]]
    built = b.build([Candidate(f"t{i}", s, "sm_90", "fallback", None) for i, s in enumerate(specs)])
    assert all(x.error is None for x in built)
    return os.path.dirname(built[0].path), built


def _run_measure(batch, env=None, *extra, timeout=120):
    r = subprocess.run([sys.executable, M.__file__, batch, "--device", "cpu", "--min-repeat-ms", "1", "--repeat", "3",
                        *extra], capture_output=True, text=True, env=env, timeout=timeout)
    return r


def test_measures_llvm_batch_under_runtime_only_tvm(cpu_batch, runtime_only_tvm, tmp_path):
    """measure.py on the CPU under runtime-only TVM: both candidates exact and timed; the device, seed and timing
    method recorded; a second run with the same seed draws the same inputs."""
    batch, built = cpu_batch
    out = tmp_path / "r.json"
    r = _run_measure(batch, runtime_only_tvm, "-o", str(out), "--seed", "11")
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads(out.read_text())
    assert doc["device"]["arch"] == "cpu" and doc["timing"] == "time_evaluator" and doc["seed"] == 11
    assert [x["status"] for x in doc["results"]] == ["ok", "ok"]
    assert all(x["ms"] > 0 and x["distinct"] > 3 for x in doc["results"])
    assert [x["id"] for x in doc["results"]] == [b.entry["id"] for b in built]
    assert doc["results"][1]["candidate"]["spec"]["layout"] == "HWNC"
    seeds = [x["seed"] for x in doc["results"]]  # (the inputs' seed: one per shape and batch)
    assert seeds == [M.shape_seed(11, b.entry) for b in built] and seeds[0] != seeds[1]


def _fake_lib(path, body):
    """A shared library whose loading runs ``body`` (C) -- a candidate that kills or hangs its process."""
    c = str(path) + ".c"
    with open(c, "w") as f:
        f.write("#include <stdlib.h>\n#include <unistd.h>\n__attribute__((constructor)) static void f(void) { "
                + body + " }\n")
    subprocess.check_call(["gcc", "-shared", "-fPIC", "-o", str(path), c])


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc (the failing libraries are built with it)")
def test_supervisor_isolates_mismatch_crash_hang_and_bad_library(cpu_batch, tmp_path):
    """A wrong reference (the spec's zero point changed) is a mismatch with a count; a library that aborts its
    process, one that hangs past --timeout and one that is no library are run_error; every other candidate is
    still measured, in manifest order."""
    batch, built = cpu_batch
    man = json.loads(open(os.path.join(batch, "manifest.json")).read())
    good = [dict(e, so=os.path.join(batch, e["so"])) for e in man["candidates"]]
    wrong = dict(good[0], id="wrong", spec=dict(good[0]["spec"], zo=good[0]["spec"]["zo"] + 1))
    _fake_lib(tmp_path / "abort.so", "abort();")
    _fake_lib(tmp_path / "hang.so", "sleep(1000);")
    (tmp_path / "junk.so").write_bytes(b"not a library")
    bad = [dict(good[0], id=n, so=str(tmp_path / f"{n}.so")) for n in ("abort", "hang", "junk")]
    cands = [good[0], wrong, bad[0], good[1], bad[1], bad[2]]
    doc = dict(format=M.FORMAT, candidates=cands)
    (tmp_path / "manifest.json").write_text(json.dumps(doc))
    r = _run_measure(str(tmp_path), None, "--timeout", "4", "-o", str(tmp_path / "res.json"))
    assert r.returncode == 0, r.stdout + r.stderr
    res = {x["id"]: x for x in json.loads((tmp_path / "res.json").read_text())["results"]}
    assert list(res) == [c["id"] for c in cands]
    assert res[good[0]["id"]]["status"] == "ok" and res[good[1]["id"]]["status"] == "ok"
    assert res["wrong"]["status"] == "mismatch" and "outputs differ" in res["wrong"]["detail"]
    assert res["abort"]["status"] == "run_error" and "died" in res["abort"]["detail"]
    assert res["hang"]["status"] == "run_error" and "timed out" in res["hang"]["detail"]
    assert res["junk"]["status"] == "run_error" and res["junk"]["detail"]


def test_results_written_after_every_candidate(cpu_batch, tmp_path):
    """The supervisor rewrites the results file after each candidate (``complete`` false), so a batch cut short can be
    imported; the finished file has every result and no ``complete`` mark. A second batch with the same seed and
    cache folder loads the shapes' problems instead of drawing them."""
    batch, built = cpu_batch
    out, cache = tmp_path / "r.json", tmp_path / "cache"
    seen = []
    log = lambda line: seen.append(json.loads(out.read_text()) if out.exists() else None)
    doc = M.supervise(batch, device="cpu", seed=3, repeat=1, min_repeat_ms=0, log=log, cache_dir=str(cache),
                      partial=str(out))
    assert seen[0] is None and seen[1]["complete"] is False and len(seen[1]["results"]) == 1
    assert seen[1]["device"]["arch"] == "cpu"  # (a batch cut short names its device)
    assert seen[1]["results"][0]["id"] in {b.entry["id"] for b in built}
    assert len(doc["results"]) == 2 and "complete" not in doc and all(r["status"] == "ok" for r in doc["results"])
    assert len(list(cache.iterdir())) == 2  # (two shapes)
    again = M.supervise(batch, device="cpu", seed=3, repeat=1, min_repeat_ms=0, cache_dir=str(cache))
    assert [r["status"] for r in again["results"]] == ["ok", "ok"] and len(list(cache.iterdir())) == 2
    assert [r["distinct"] for r in again["results"]] == [r["distinct"] for r in doc["results"]]


def test_bad_batch_is_one_message(tmp_path):
    r = _run_measure(str(tmp_path))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "no manifest.json" in r.stderr
    (tmp_path / "manifest.json").write_text("{}")
    r = _run_measure(str(tmp_path))
    assert r.returncode == 2 and "not a qcompile tuning batch manifest" in r.stderr
