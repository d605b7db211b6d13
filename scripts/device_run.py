#!/usr/bin/env python3
"""On a GPU host with the TVM runtime, numpy and torch: checks every kernel of a scripts/device_build.py build
(DIR/manifest.json) bit-exactly against the integer reference, then times the bench set against cuDNN fp16 and
torch._int_mm; writes OUT_DIR/results.json.

    python3 scripts/device_run.py [DIR] [--out OUT_DIR] [--no-bench]    (DIR: build/gpu/checks; OUT_DIR: DIR)

scripts/device_run.sh runs it with the runtime bundle where TVM does not import. tune_layers.py, check_pools.py and
check_glue.py import it for the runtime, the kernel loader (``get_func``: from ``DEVICE_DIR``) and the timers."""
from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import sys
import time

os.environ.setdefault("TVM_USE_RUNTIME_LIB", "1")
import numpy as np  # noqa: E402
import torch  # noqa: E402
import tvm  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
if importlib.util.find_spec("qcompile") is None:  # not installed: the source tree's compiler/ is the package
    _qc = importlib.util.spec_from_file_location("qcompile", ROOT / "compiler" / "__init__.py",
                                                 submodule_search_locations=[str(ROOT / "compiler")])
    sys.modules["qcompile"] = importlib.util.module_from_spec(_qc)
    _qc.loader.exec_module(sys.modules["qcompile"])
from qcompile.runtime import load_cuda_runtime  # noqa: E402

load_cuda_runtime(required=True)
sys.path.insert(0, str(ROOT / "schedules"))
import reference as R  # noqa: E402  (schedules/ as plain modules: the qcompile.schedules package needs TVM's compiler)
from spec import ConvSpec  # noqa: E402

DEV = tvm.cuda(0)
TDEV = torch.device("cuda")
DEVICE_DIR = ROOT / "build" / "gpu" / "checks"  # the build whose .so files get_func loads


def to_spec(d):
    d = dict(d)
    for k in ("stride", "padding", "dilation"):
        if isinstance(d[k], list):
            d[k] = tuple(d[k])
    return ConvSpec(**d)


def nchw_acc_torch(spec, x_log, w_log):
    """Exact int accumulator via float64 conv on the GPU (|acc| < 2^53). Logical NHWC in/out."""
    sh, sw = spec.strides
    pt, pl, pb, pr = spec.pads
    x = torch.from_numpy(np.ascontiguousarray(x_log)).to(TDEV).permute(0, 3, 1, 2).double()
    w = torch.from_numpy(np.ascontiguousarray(w_log)).to(TDEV).permute(0, 3, 1, 2).double()
    x = torch.nn.functional.pad(x, (pl, pr, pt, pb), value=float(spec.pad_value))
    acc = torch.nn.functional.conv2d(x, w, stride=(sh, sw), dilation=spec.dilations)
    return acc.permute(0, 2, 3, 1).round().long().cpu().numpy()


def reference(spec, x, w, b, M, S, res):
    if spec.layout == "HWNC":
        xn, wn = np.transpose(x, (2, 0, 1, 3)), np.transpose(w, (2, 0, 1, 3))
        rn = None if res is None else (np.transpose(res[0], (2, 0, 1, 3)), res[1])
    else:
        xn, wn, rn = x, w, res
    acc = nchw_acc_torch(spec, xn, wn)
    y = R.requant(acc, b, M, S, spec, rn)
    return np.transpose(y, (1, 2, 0, 3)) if spec.layout == "HWNC" else y


_mods = {}


def get_func(rec):
    """The kernel of ``rec``, called with the packed 4-bit weights every record takes; a ``w8`` kernel (the weights
    expanded at compile time, ``GemmKnobs.w8``) gets them expanded, once per weight tensor (the first call, outside any
    CUDA-graph capture: every timer here warms up first)."""
    return w8_wrap(rec, _get_func(rec))


def w8_wrap(rec, f):
    """``f`` (a kernel of ``rec``) taking the packed 4-bit (or plain 8-bit) weights: expanded for a ``w8`` record
    (k-permuted for agl), k-permuted for an 8-bit agl one."""
    if not rec.get("w8") and not rec.get("w8_kperm"):
        return f
    held = {}

    def run_w8(x, w, *rest):
        if id(w) not in held:
            held.clear()
            if rec.get("w8"):
                wl = R.from_storage(np.asarray(w.numpy()), "int4")
                wk = R.expand_w4(wl, rec.get("w8_kperm", 0))
            else:
                wk = R.permute_k8(np.asarray(w.numpy()), rec["w8_kperm"])
            held[id(w)] = (w, tvm.runtime.tensor(wk, DEV))
        f(x, held[id(w)][1], *rest)
    if hasattr(f, "sk_counters"):
        run_w8.sk_counters = f.sk_counters
    return run_w8


def _get_func(rec):
    """The kernel of ``rec``; for a split-K plan (two kernels) a callable running both, ws in between."""
    so = rec["so"]
    if so not in _mods:
        _mods[so] = tvm.runtime.load_module(str(DEVICE_DIR / so))
    names = rec.get("funcs") or [rec["func"]]
    if rec.get("sk"):  # stream-K: tile counters (zeros, left zero by the kernel) before out, the workspace after it
        f = _mods[so][names[0]]
        ntiles, words = rec["sk"]
        cnt = tvm.runtime.tensor(np.zeros(ntiles, np.int32), DEV)
        skw = tvm.runtime.tensor(np.random.default_rng(6).integers(-(1 << 30), 1 << 30, words, dtype=np.int64)
                                 .astype(np.int32), DEV)  # poisoned once: every partial is written before it is read

        def run_sk(*a):
            f(*a[:-1], cnt, a[-1], skw)
        run_sk.sk_counters = cnt
        return run_sk
    if len(names) == 1:
        return _mods[so][names[0]]
    part, epi = _mods[so][names[0]], _mods[so][names[1]]
    spec = to_spec(rec["spec"])
    split = int(rec["strategy_used"].rsplit("splitk", 1)[1])
    # workspace poisoned once per plan: every partial must be written by the GEMM kernel
    ws = tvm.runtime.tensor(np.random.default_rng(5).integers(-(1 << 30), 1 << 30, (split, spec.N * spec.P * spec.Q, spec.K),
                                                              dtype=np.int64).astype(np.int32), DEV)

    def run(x, w, *rest):
        part(x, w, ws)
        epi(ws, *rest)
    return run


def state_clean(f) -> bool:
    """A kernel from get_func left its persistent state as it found it (stream-K: tile counters all zero)."""
    return not (hasattr(f, "sk_counters") and f.sk_counters.numpy().any())


def run_check(rec, seed):
    spec = to_spec(rec["spec"])
    rng = np.random.default_rng(seed)
    x, w, b, M, S, res = R.random_problem(spec, rng)
    wdt = "int4" if spec.w_bits == 4 else "int8"
    args = [R.to_storage(x, spec.x_dtype), R.to_storage(w, wdt), b, M, S]
    args += R.residual_args(spec, res)
    oshape = spec.shapes()[2]
    ost = ConvSpec.storage(spec.out_dtype)
    f = get_func(rec)
    ref = reference(spec, x, w, b, M, S, res)
    ok = True
    for trial in range(2):  # two poisons: output must be fully overwritten both times
        poison = rng.integers(0, 256, int(np.prod(oshape)) * np.dtype(ost).itemsize, dtype=np.uint8).view(ost).reshape(oshape)
        targs = [tvm.runtime.tensor(np.ascontiguousarray(a), DEV) for a in args] + [tvm.runtime.tensor(poison, DEV)]
        f(*targs)
        DEV.sync()
        got = R.from_storage(targs[-1].numpy(), spec.out_dtype, spec.K)
        ok = ok and got.shape == ref.shape and bool((got == ref).all())
        ok = ok and state_clean(f)
    nuniq = int(np.unique(ref).size)
    return ok, nuniq, (None if ok else int((got != ref).sum()))


def cuda_time(fn, reps=20, warm=3, launches=1):
    """Median over ``reps`` rounds of (CUDA-event time of ``launches`` back-to-back calls) / launches, in ms."""
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(launches):
            fn()
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e) / launches)
    return float(np.median(ts))


# Layer-bench timing (both our kernels and the torch baselines): "b2b" = N back-to-back launches between two
# events, per launch (kernel time as long as the host keeps ahead of the GPU: not so for kernels of a few
# microseconds, whose Python launch costs as much), "graph" = the same N launches captured in one CUDA graph and
# replayed (no host launch cost at all: kernel to kernel, for ours through tvm_ffi.use_torch_stream), "launch" = one
# launch between two events, median of 20 (includes each call's host launch latency)
TIMING = os.environ.get("QC_BENCH_TIMING", "graph")


def b2b_time(fn):
    return cuda_time(fn, reps=7, launches=20)


def capture(fn, launches):
    """A CUDA graph of ``launches`` calls of fn (TVM kernels on torch's capture stream through tvm_ffi)."""
    import tvm_ffi

    g = torch.cuda.CUDAGraph()
    with tvm_ffi.use_torch_stream(torch.cuda.graph(g)):
        for _ in range(launches):
            fn()
    return g


def graph_time(fn, launches=20, reps=7, check=None):
    """Per-launch ms of ``launches`` calls of fn captured in one CUDA graph, median of ``reps`` replays. ``check``
    (optional): a pair (reset, ran): reset() before the first replay, ran() after it returns False when the captured
    launches did not run (then an error)."""
    for _ in range(3):  # (cudnn.benchmark picks its algorithm outside the capture)
        fn()
    torch.cuda.synchronize()
    g = capture(fn, launches)
    if check is not None:
        check[0]()
    torch.cuda.synchronize()
    g.replay()
    torch.cuda.synchronize()
    if check is not None and not check[1]():
        raise RuntimeError("graph replay did not run the captured kernels")
    ts = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        g.replay()
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e) / launches)
    del g
    return float(np.median(ts))


def bench_timer(fn, check=None):
    return graph_time(fn, check=check) if TIMING == "graph" else b2b_time(fn)


def tvm_time(f, targs, reps=20):
    """Median host wall time (ms) of one synchronized call, over ``reps`` calls."""
    for _ in range(3):
        f(*targs)
    DEV.sync()
    ts = []
    for _ in range(reps):
        DEV.sync()
        t = time.perf_counter()
        f(*targs)
        DEV.sync()
        ts.append((time.perf_counter() - t) * 1e3)
    return float(np.median(ts))


def rand_storage_gpu(shape, dtype):
    if dtype == "int32":
        t = torch.randint(-(1 << 20), 1 << 20, shape, dtype=torch.int32, device=TDEV)
    else:
        t = torch.randint(0, 256, shape, dtype=torch.uint8, device=TDEV)
        if dtype == "int8":
            t = t.view(torch.int8)
    return t


def to_tvm(t):
    try:
        return tvm.runtime.from_dlpack(t)
    except Exception:  # noqa: BLE001
        import tvm_ffi
        return tvm_ffi.from_dlpack(t)


def run_bench(rec, func=None):
    spec = to_spec(rec["spec"])
    xs, ws, os_ = spec.shapes()
    f = get_func(rec) if func is None else func
    K = spec.K
    xt = rand_storage_gpu(xs, ConvSpec.storage(spec.x_dtype))
    wt = rand_storage_gpu(ws, "int8")
    b = torch.randint(-1000, 1000, (K,), dtype=torch.int32, device=TDEV)
    M = torch.randint(1 << 20, 1 << 22, (K,), dtype=torch.int32, device=TDEV)
    S = torch.full((K,), 24, dtype=torch.int32, device=TDEV)
    o = rand_storage_gpu(os_, ConvSpec.storage(spec.out_dtype))
    extra = []
    if spec.has_residual:
        extra = [rand_storage_gpu(spec.res_shape(), ConvSpec.storage(spec.res_dtype)),
                 torch.tensor(np.stack([np.zeros(K), np.full(K, 1 << 20), np.zeros(K), np.full(K, 1 << 20),
                                        np.full(K, 21)]).astype(np.int32), device=TDEV)]
    targs = [to_tvm(t) for t in (xt, wt, b, M, S, *extra, o)]
    if TIMING in ("b2b", "graph"):
        # graph: the first replay must write the output the warm-up calls wrote, over its bitwise complement (a
        # zeroed output was not enough: the batch-1 4-bit fc legitimately clamps every output to 0)
        ref = {}

        def reset():
            ref["o"] = o.clone()
            o.bitwise_not_()

        return bench_timer(lambda: f(*targs), check=(reset, lambda: torch.equal(o, ref["o"])))
    ms = tvm_time(f, targs)
    # event timing of the same launches (TVM launches on the legacy default stream, same as torch's)
    ms_ev = cuda_time(lambda: f(*targs))
    return min(ms, ms_ev)


def cudnn_time(spec, timer):
    """``timer`` of cuDNN's fp16 channels_last conv of ``spec``'s shape (cudnn.benchmark); its tensors are freed on
    return."""
    N, C, H, K, R_ = spec.N, spec.C, spec.H, spec.K, spec.R
    x = torch.randn(N, C, H, spec.W, device=TDEV).half().to(memory_format=torch.channels_last)
    w = torch.randn(K, C, R_, spec.S, device=TDEV).half().to(memory_format=torch.channels_last)
    pt = spec.pads[0]
    torch.backends.cudnn.benchmark = True
    return timer(lambda: torch.nn.functional.conv2d(x, w, stride=spec.strides, padding=pt))


def baselines(spec):
    timer = bench_timer if TIMING in ("b2b", "graph") else cuda_time
    t_cudnn = cudnn_time(spec, timer)
    Mg, Ng, Kg = spec.gemm_shape()
    Kp = (Kg + 7) // 8 * 8
    Np = (Ng + 7) // 8 * 8
    a = torch.randint(-128, 127, (max(Mg, 32), Kp), dtype=torch.int8, device=TDEV)
    bm = torch.randint(-128, 127, (Kp, Np), dtype=torch.int8, device=TDEV)
    try:
        t_int = timer(lambda: torch._int_mm(a, bm))
    except Exception as e:  # noqa: BLE001
        print("int_mm failed", e)
        t_int = float("nan")
    return t_cudnn, t_int


def main():
    import argparse
    import shlex

    global DEVICE_DIR
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir", nargs="?", default=None, help="the scripts/device_build.py build (default build/gpu/checks)")
    ap.add_argument("--out", default=None, help="where results.json goes (default: DIR)")
    ap.add_argument("--no-bench", action="store_true", help="the checks only")
    a = ap.parse_args()
    DEVICE_DIR = pathlib.Path(a.dir) if a.dir else DEVICE_DIR
    out = pathlib.Path(a.out) if a.out else DEVICE_DIR
    out.mkdir(parents=True, exist_ok=True)
    man = json.loads((DEVICE_DIR / "manifest.json").read_text())
    print("GPU:", torch.cuda.get_device_name(0), "| tvm", tvm.__version__, "| torch", torch.__version__,
          "| cudnn", torch.backends.cudnn.version(), flush=True)
    bc = DEVICE_DIR / "build_command.txt"  # (device_build.py writes it; results.json names both commands)
    results = {"device": torch.cuda.get_device_name(0), "date": time.strftime("%Y-%m-%d"), "timing": TIMING,
               "build_command": bc.read_text().strip() if bc.is_file() else None,
               "command": "python3 scripts/device_run.py " + shlex.join(sys.argv[1:]), "checks": [], "bench": []}
    t0 = time.time()
    nfail = 0
    for i, rec in enumerate(r for r in man if r["kind"] == "check"):
        try:
            ok, nuniq, nbad = run_check(rec, 1000 + i)
        except Exception as e:  # noqa: BLE001
            ok, nuniq, nbad = False, 0, f"ERR {type(e).__name__}: {str(e)[-300:]}"
        nfail += not ok
        results["checks"].append(dict(name=rec["name"], strategy=rec["strategy_used"], arch=rec["arch"],
                                      mode=rec["mode"], ok=ok, distinct_values=nuniq, bad=nbad))
        print(f"CHECK {'PASS' if ok else 'FAIL'} {rec['name']:<34} {rec['strategy_used']:<14} {rec['arch']}/{rec['mode']}"
              f" uniq={nuniq} {'' if ok else nbad}", flush=True)
        if ok and rec.get("nosplit_func"):  # split-K pair vs the same conv in one kernel
            try:
                t_split = run_bench(rec)
                t_one = run_bench(rec, w8_wrap(rec, _mods[rec["so"]][rec["nosplit_func"]]))
                results["checks"][-1].update(split_ms=t_split, nosplit_ms=t_one)
                print(f"  SPLIT {rec['name']:<34} split-K {t_split * 1e3:7.1f} us   one kernel {t_one * 1e3:7.1f} us", flush=True)
            except Exception as e:  # noqa: BLE001
                print("  split timing error", str(e)[-200:])
    print(f"checks: {len(results['checks']) - nfail}/{len(results['checks'])} pass  ({time.time() - t0:.0f}s)", flush=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    if a.no_bench:
        return
    bench = [r for r in man if r["kind"] == "bench"]
    by_layer = {}
    for rec in bench:
        key = rec["name"].rsplit("_", 1)[0]
        by_layer.setdefault(key, {})[rec["name"].rsplit("_", 1)[1]] = rec
    for key, recs in by_layer.items():
        if time.time() - t0 > float(os.environ.get("BENCH_BUDGET_S", "400")):
            print("bench time budget reached, stopping")
            break
        spec = to_spec(next(iter(recs.values()))["spec"])
        row = dict(layer=key, N=spec.N, C=spec.C, H=spec.H, K=spec.K, R=spec.R, stride=spec.strides[0],
                   gops=2 * spec.macs() / 1e9)
        for dt, rec in recs.items():
            try:
                row[f"{dt}_ms"] = run_bench(rec)
                row[f"{dt}_knobs"] = rec.get("knobs", "")
            except Exception as e:  # noqa: BLE001
                row[f"{dt}_ms"] = float("nan")
                print("bench error", key, dt, str(e)[-300:])
        row["cudnn_fp16_ms"], row["int_mm_ms"] = baselines(spec)
        results["bench"].append(row)
        g = row["gops"]
        print(f"BENCH {key:<22} int8 {row.get('int8_ms', float('nan')):.4f}ms {g / row.get('int8_ms', float('nan')):7.1f}TOPS "
              f"int4 {row.get('int4_ms', float('nan')):.4f}ms {g / row.get('int4_ms', float('nan')):7.1f}TOPS "
              f"cudnn16 {row['cudnn_fp16_ms']:.4f}ms int_mm {row['int_mm_ms']:.4f}ms", flush=True)
        (out / "results.json").write_text(json.dumps(results, indent=1))
        torch.cuda.empty_cache()
    print(f"done in {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
