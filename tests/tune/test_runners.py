"""qcompile.tune.runners and the check command, on the CPU with llvm-built fallback candidates: the local runner,
the offline export -> measure.py (runtime-only TVM) -> import round trip, the rpc runner against a real TVM RPC
tracker and rpc_servers on loopback (runtime-only TVM), and the user-facing errors."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from qcompile.errors import QCompileError
from qcompile.schedules import ConvSpec
from qcompile.tune import runners as RN
from qcompile.tune.build import LocalBuilder
from qcompile.tune.common import BUILD_ERROR, OK, Candidate
from test_measure import runtime_only_tvm  # noqa: F401  (the fixture)

SPECS = [
    ConvSpec(N=2, H=6, W=6, C=16, K=24, R=1, S=1, layout="HWNC", x_dtype="uint8", out_dtype="uint8", lo=-128,
             hi=127, has_residual=True, res_dtype="uint8", lo2=0, hi2=255, res_i32=True, shift_ge33=True),
    ConvSpec(N=1, H=7, W=7, C=8, K=8, R=3, S=3, padding=1, x_dtype="int4", w_bits=4, out_dtype="int4", lo=-8, hi=7),
]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Two llvm-built fallback candidates and one the llvm target refuses (not the fallback)."""
    b = LocalBuilder(jobs=1, build_dir=str(tmp_path_factory.mktemp("built")), target="llvm")
    cands = [Candidate(f"t{i}", s, "sm_90", "fallback", None) for i, s in enumerate(SPECS)]
    cands.append(Candidate("t2", SPECS[1], "sm_90", "implicit_gemm", None))
    out = b.build(cands)
    assert [x.error is None for x in out] == [True, True, False]
    return out


def _check(measured, built):
    assert [m.candidate for m in measured] == [b.candidate for b in built]
    assert [m.status for m in measured] == [OK, OK, BUILD_ERROR]
    assert all(m.ms > 0 and m.device.startswith("cpu") for m in measured[:2])
    assert "not implicit_gemm" in measured[2].detail


def test_local_runner_on_the_cpu(built):
    r = RN.LocalRunner(device="cpu", min_repeat_ms=1, repeat=3)
    assert r.device().arch == "cpu"
    _check(r.measure(built), built)
    assert [sorted(p) for p in r.phases] == [["check", "load", "recheck", "setup", "time"]] * 2  # (the two that ran)
    assert all(v >= 0 for p in r.phases for v in p.values())


def test_offline_export_measure_import_round_trip(built, runtime_only_tvm, tmp_path):  # noqa: F811
    """export -> the exported folder's own run.sh / measure.py under runtime-only TVM -> import: the same records
    (with the Built list, or rebuilt from the results alone)."""
    runner = RN.OfflineRunner(str(tmp_path / "exp"), arch="sm_90")
    with pytest.raises(RN.OfflineBatchPending) as e:
        runner.measure(built)
    folder = e.value.folder
    assert sorted(os.listdir(folder)) == sorted(["manifest.json", "measure.py", "run.sh", "README.txt"]
                                                + [os.path.basename(b.path) for b in built[:2]])
    assert e.value.command == "python measure.py . -o results.json --device cpu"
    r = subprocess.run(["sh", os.path.join(folder, "run.sh"), "--min-repeat-ms", "1", "--repeat", "3"],
                       env=dict(runtime_only_tvm, PYTHON=sys.executable), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    results = os.path.join(folder, "results.json")
    _check(RN.import_results(results, built), built)
    alone = RN.import_results(results)
    assert [(m.candidate, m.status) for m in alone] == [(b.candidate, OK) for b in built[:2]]
    again = RN.OfflineRunner(None, [results])
    assert again.device().arch == "cpu"
    _check(again.measure(built), built)
    with pytest.raises(QCompileError, match="not empty"):
        RN.export(built, folder)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_port(port, proc, secs=120):
    t = time.time()
    while time.time() - t < secs:
        assert proc.poll() is None, "the tracker exited"
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(f"nothing listens on {port}")


def test_rpc_runner_on_loopback(built, runtime_only_tvm, tmp_path):  # noqa: F811
    """A TVM RPC tracker and two rpc_servers of runtime-only TVM on 127.0.0.1: the runner finds both servers,
    asks the device from a server, measures every candidate and gets the local records; one thread keeps one
    session across its candidates."""
    pytest.importorskip("tornado", reason="TVM's RPC tracker needs tornado")
    tp = _free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "tvm.exec.rpc_tracker", "--host", "127.0.0.1", "--port", str(tp),
                               "--port-end", str(tp + 1)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    try:
        _wait_port(tp, procs[0])
        srv_env = runtime_only_tvm  # (the servers: TVM's runtime alone, as on a GPU host with the runtime bundle)
        for _ in range(2):
            p = _free_port()
            procs.append(subprocess.Popen([sys.executable, "-m", "tvm.exec.rpc_server", "--tracker", f"127.0.0.1:{tp}",
                                           "--key", "cpu-test", "--host", "127.0.0.1", "--port", str(p),
                                           "--port-end", str(p + 1)], env=srv_env, cwd=tmp_path,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        runner = RN.make_runner(type("A", (), dict(runner="rpc", rpc_tracker=f"127.0.0.1:{tp}", rpc_key="cpu-test",
                                                  measure_device="cpu", repeat=3, min_repeat_ms=1))())
        t = time.time()
        while runner.servers() < 2 and time.time() - t < 120:
            time.sleep(0.3)
        assert runner.servers() == 2
        assert runner.device().arch == "cpu"
        _check(runner.measure(built), built)
        assert runner._check_so  # (the device helpers, built for the servers' device and used)
        assert len(runner.phases) == 2 and all(set(p) == {"load", "setup", "check", "time", "recheck"}
                                               and min(p.values()) >= 0 for p in runner.phases)
        one = RN.RPCRunner("127.0.0.1", tp, "cpu-test", sessions=1, device="cpu", repeat=3, min_repeat_ms=1)
        one.device()
        opened = []
        session = one._session
        one._session = lambda *a, **k: opened.append(1) or session(*a, **k)
        _check(one.measure(built), built)
        assert len(opened) == 1  # (one thread: one session, kept across its candidates)
        with pytest.raises(QCompileError, match="no server of key"):
            RN.RPCRunner("127.0.0.1", tp, "no-such-key", device="cpu").device()
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=30)


def test_runner_options_are_checked():
    A = lambda **kw: type("A", (), kw)()
    for args, msg in ((A(runner="rpc"), "needs --rpc-tracker"),
                      (A(runner="rpc", rpc_tracker="nohost", rpc_key="k"), "HOST:PORT"),
                      (A(runner="offline"), "needs --export"),
                      (A(runner="local", repeat=0), "--repeat")):
        with pytest.raises(QCompileError, match=msg):
            RN.make_runner(args)
    assert isinstance(RN.make_runner(A(export="x")), RN.OfflineRunner)
    with pytest.raises(QCompileError, match="no such results file"):
        RN.make_runner(A(import_results=["/nonexistent/results.json"]))
    with pytest.raises(QCompileError, match="no device known"):
        RN.OfflineRunner("x").device()


def test_check_command_on_the_cpu(tmp_path):
    """`python -m qcompile.tune.check --target llvm --measure-device cpu`: the fallback cases built and bit-exact;
    a bad option is one line and exit status 2."""
    r = subprocess.run([sys.executable, "-m", "qcompile.tune.check", "--target", "llvm", "--measure-device", "cpu",
                        "--jobs", "1", "--min-repeat-ms", "1", "--repeat", "3", "--build-dir", str(tmp_path)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith(("PASS", "FAIL"))]
    assert len(lines) == 3 and all(ln.startswith("PASS") for ln in lines)
    assert "3 of 3 kernels bit-exact on cpu" in r.stdout
    for bad in (["--arch", "sm_99"], ["--runner", "rpc", "--rpc-tracker", "x", "--rpc-key", "k"]):
        r = subprocess.run([sys.executable, "-m", "qcompile.tune.check", *bad], capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and "error:" in r.stderr, r.stderr


def test_check_lists_every_strategy_for_sm90_and_sm75():
    from qcompile.tune import check

    s90 = {c.strategy for c in check.candidates("sm_90")}
    assert s90 == {"implicit_gemm", "implicit_gemm_t", "direct_hwnc", "direct_halo", "fallback"}
    assert {c.strategy for c in check.candidates("sm_75")} == {"implicit_gemm", "direct_hwnc", "fallback"}
    assert check.arch_for("sm_90") == ("sm_90", "sass") and check.arch_for("sm_86") == ("sm_86", "sass")
    assert check.arch_for("sm_100") == ("sm_89", "ptx") and check.arch_for("sm_87") == ("sm_86", "sass")


def test_problem_cache_keeps_its_seed_and_problems_across_runners(built, tmp_path):
    """``--problem-cache DIR``: the first local runner draws a seed and writes it to DIR; a later one (a resumed run)
    reads the same seed, finds every shape's problem in DIR (nothing drawn again) and measures the same way."""
    cache = tmp_path / "problems"
    args = type("A", (), dict(runner="local", problem_cache=str(cache), measure_device="cpu", repeat=2,
                              min_repeat_ms=1))()
    first = RN.make_runner(args)
    assert first.cache_dir == str(cache) and (cache / "seed").read_text().strip() == str(first.seed)
    _check(first.measure(built), built)
    drawn = sorted(p.name for p in cache.iterdir() if p.is_dir())
    assert len(drawn) == len({repr(b.candidate.spec) for b in built if b.error is None}) >= 1
    again = RN.make_runner(args)
    assert again.seed == first.seed
    stamps = {p: p.stat().st_mtime_ns for p in cache.rglob("*") if p.is_file()}
    _check(again.measure(built), built)
    assert {p: p.stat().st_mtime_ns for p in cache.rglob("*") if p.is_file()} == stamps
    (cache / "seed").write_text("x")
    with pytest.raises(QCompileError, match="not a seed"):
        RN.make_runner(args)
    afile = tmp_path / "a_file"
    afile.write_text("")
    with pytest.raises(QCompileError, match="--problem-cache"):
        RN.problem_seed(str(afile))


def test_rpc_worker_keeps_sessions_and_their_buffers(monkeypatch):
    """RPCRunner._worker with a fake tracker and sessions: one session serves candidates while a whole timeout of its
    limit (SESSION_SPAN timeouts) is left, then a new one starts; a run_error ends the session; a shape's buffers
    (``shared``) are kept across its candidates, dropped at a new shape and after a mismatch."""
    from qcompile.tune.common import MISMATCH, RUN_ERROR

    clock = [0.0]
    monkeypatch.setattr(RN.time, "monotonic", lambda: clock[0])
    r = RN.RPCRunner("127.0.0.1", 1, "k", timeout=10.0, seed=0)
    monkeypatch.setattr(r, "_tracker", lambda: object())
    sessions = []
    monkeypatch.setattr(r, "_session", lambda tracker, span: sessions.append(span) or len(sessions))
    # (shape, status, seconds the candidate takes)
    plan = [("a", OK, 1), ("a", OK, 1), ("a", MISMATCH, 1), ("a", OK, 1), ("b", RUN_ERROR, 1), ("b", OK, 1),
            ("b", OK, 30), ("b", OK, 1)]
    seen = []

    def measure_one(sess, e, shared):
        shared.setdefault("n", 0)
        shared["n"] += 1
        seen.append((e["id"], sess, shared["n"]))
        clock[0] += e["secs"]
        return dict(id=e["id"], status=e["status"])

    monkeypatch.setattr(r, "_measure_one", measure_one)
    monkeypatch.setattr(RN.M, "spec_key", lambda e: e["shape"])
    monkeypatch.setattr(RN.M, "shape_seed", lambda seed, e: 0)
    q = RN.ShapeQueue([dict(id=f"c{i}", shape=shape, status=status, secs=secs)
                       for i, (shape, status, secs) in enumerate(plan)], lambda e: e["shape"])
    done = []
    r._worker(q, lambda e: None, done.append)
    assert [d["id"] for d in done] == [f"c{i}" for i in range(len(plan))]
    assert sessions == [40.0] * 3
    # c0-c3 in session 1 (buffers kept, dropped after the mismatch c2); c4's run_error ends it; c5, c6 in session 2;
    # c7 starts session 3: session 2 opened at 5 s, and after c6 (36 s) 9 s of its 40 are left, less than a timeout
    assert seen == [("c0", 1, 1), ("c1", 1, 2), ("c2", 1, 3), ("c3", 1, 1), ("c4", 1, 1), ("c5", 2, 1), ("c6", 2, 2),
                    ("c7", 3, 1)]


def test_shape_queue_keeps_a_session_on_its_shape():
    """ShapeQueue: a session takes its shape's candidates in order; a session without one takes the first shape no
    session works on; when every shape left has a session, it joins the one with the most left; each candidate is
    handed out once, and None ends a session."""
    entries = [dict(id=f"{k}{i}", shape=k) for k, n in (("a", 3), ("b", 2), ("c", 4)) for i in range(n)]
    q = RN.ShapeQueue(entries, lambda e: e["shape"])
    s1 = q.take()["id"]
    s2 = q.take()["id"]
    assert (s1, s2) == ("a0", "b0")  # (two sessions: two shapes, not one shape's two candidates)
    assert q.take("a")["id"] == "a1" and q.take("b")["id"] == "b1"
    assert q.take("b")["id"] == "c0"  # (b is done: the first shape no session works on)
    assert q.take("a")["id"] == "a2"
    assert q.take("a")["id"] == "c1"  # (a is done, every shape left has a session: join the one with most left)
    got = [q.take("c"), q.take("c"), q.take("c")]
    assert [e["id"] for e in got[:2]] == ["c2", "c3"] and got[2] is None
    assert q.take(None) is None


def test_shape_queue_with_many_sessions_hands_out_each_candidate_once():
    import random
    import threading

    entries = [dict(id=f"{k}{i}", shape=k) for k in "abcdefgh" for i in range(random.Random(k).randint(1, 9))]
    q = RN.ShapeQueue(entries, lambda e: e["shape"])
    got, lock = [], threading.Lock()

    def session():
        mine = None
        while (e := q.take(mine)) is not None:
            mine = e["shape"]
            with lock:
                got.append(e["id"])

    threads = [threading.Thread(target=session) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(got) == sorted(e["id"] for e in entries)


def test_device_check_poisons_and_compares_on_the_device(built, tmp_path):
    """The rpc runner's device helpers (tune/device_check.py, here built for the CPU device): a candidate measured
    with them is OK and its reference is kept on the device; a changed output byte is found by the device count and
    counted on the host; the poisons written on the device change from run to run."""
    import numpy as np
    import tvm

    from qcompile.tune import device_check
    from qcompile.tune import measure as M

    helpers = (tvm.runtime.load_module(device_check.build("cpu", None, str(tmp_path))), device_check.parts("cpu"))
    for e in RN._entries(built[:2], absolute=True):
        lib = tvm.runtime.load_module(e["so"])
        shared = {M.DEVICE_CHECK: helpers}
        rec = M.measure_entry(lib, e, tvm.cpu(), 1, repeat=1, min_repeat_ms=0, shared=shared)
        assert rec["status"] == OK and "ref" in shared, rec
        layer = M.Layer(lib, e, tvm.cpu(), M.problem(e, 1), shared)
        layer.run()
        assert layer.mismatches() == 0
        got = layer.out.numpy()
        got.reshape(-1).view(np.uint8)[0] ^= 1
        layer.out.copyfrom(got)
        assert layer.mismatches() == 1
        before = layer.out.numpy().copy()
        layer.repoison()
        assert (layer.out.numpy() != before).mean() > 0.9


@pytest.mark.nvcc
def test_device_check_kernels_take_sizes_by_value():
    """The device helpers' CUDA kernels take their buffers and the element count by value: no pointer to a host
    variable (a TVMScript name assigned in the host part of a PrimFunc reaches a kernel as one, and the kernel
    crashes the server reading it)."""
    import re

    import tvm

    from qcompile.tune import device_check

    funcs = {n: f.with_attr("global_symbol", n) for n, f in device_check._funcs("int8", 4, True).items()}
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90"}, host="llvm")
    srcs, todo = [], list(tvm.compile(tvm.IRModule(funcs), target=target).mod.imports)
    while todo:  # (every CUDA module: one per kernel, nested, where qcompile's nvcc build is registered)
        m = todo.pop()
        srcs.append(m.inspect_source() if m.kind == "cuda" else "")
        todo += list(m.imports)
    src = "\n".join(srcs)
    for name in ("qc_fill_int8_4_kernel", "qc_count_int8_4_kernel"):
        sig = re.search(name + r"\(([^)]*)\)", src, re.S)
        assert sig, (name, src)
        assert "int64_t*" not in sig.group(1) and "int64_t" in sig.group(1), sig.group(1)
