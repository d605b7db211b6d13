#!/usr/bin/env python3
"""CNNs beyond ResNet on the GPU: every model compiled for CUDA equals its llvm build, and its speed against PyTorch.

    python scripts/bench_cnn.py run [--models M ...] [--out DIR] [--jobs N]     # GPU host (qcompile, torch, nvcc)
    python scripts/bench_cnn.py table DIR/bench_cnn.json [MORE.json ...] [--write docs/BENCHMARKS.md]

``run``, for each model (default: mobilenet_v2, mobilenet_v3_large, efficientnet_b0, densenet121, resnext50_32x4d,
vgg16; the ResNets may be named too):

1. ``qmodel NAME --bits 8 --batch 0`` writes its INT8 ONNX QDQ model (seeded random weights, onnxruntime's
   quantizer; dynamic batch);
2. ``qcompile`` builds it for cuda (sm_90) at batch 1, 8 and 256 and for llvm at batch 1 and 8 -- every build of
   every model in a pool of ``--jobs`` processes (each with its share of the cores for nvcc), started at once; the
   kernel labels of each build's summary are kept (``depthwise``, ``grouped``, ``implicit_gemm``, ...);
3. as soon as a model's builds are done (in model order, on the GPU one at a time): the GPU and llvm builds run on
   the same fresh random input (seed drawn per run, recorded) at batch 1 and 8, and must agree bit for bit;
4. the batch-256 build's throughput and the batch-1 build's latency, timed as ``qbench`` times them
   (``qcompile.bench.time_calls``: the input on the GPU, calls queued back to back, then single synchronized
   calls), then the same float network (the ``nn.Module`` of ``qcompile.models``) in PyTorch fp16 -- cuDNN,
   ``cudnn.benchmark``, channels_last, one CUDA-graph replay per call -- timed the same way in the same process.

The results file (DIR/bench_cnn.json: device, date, command, versions, one row per model) is written after every
model, so a run cut short keeps what it measured. ``table`` writes the ``cnn_gpu`` block of docs/BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import datetime
import json
import os
import pathlib
import re
import secrets
import shlex
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from e2e_table import _version, add_table_command, write_block  # noqa: E402

MODELS = ("mobilenet_v2", "mobilenet_v3_large", "efficientnet_b0", "densenet121", "resnext50_32x4d", "vgg16")
NAMES = {"mobilenet_v2": "MobileNetV2", "mobilenet_v3_large": "MobileNetV3-Large", "efficientnet_b0": "EfficientNet-B0",
         "densenet121": "DenseNet-121", "resnext50_32x4d": "ResNeXt-50 32x4d", "resnet18": "ResNet-18",
         "resnet50": "ResNet-50", "vgg16": "VGG-16"}
SIZE = 224
CHECK_BATCHES = (1, 8)
THROUGHPUT_BATCH = 256
BUILDS = [("cuda", 1), ("cuda", 8), ("cuda", THROUGHPUT_BATCH), ("llvm", 1), ("llvm", 8)]
DEFAULT_OUT = pathlib.Path(__file__).resolve().parents[1] / "build" / "bench_cnn"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---------------- builds (subprocesses: qmodel, qcompile) ----------------

def _sh(cmd, env=None) -> str:
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode:
        raise RuntimeError(f"{shlex.join(cmd)} failed ({r.returncode}): {(r.stderr or r.stdout).strip()[-2000:]}")
    return r.stdout + r.stderr


def make_onnx(model: str, work: pathlib.Path) -> str:
    path = str(work / f"{model}_int8.onnx")
    _sh(["qmodel", model, "--bits", "8", "--batch", "0", "--input-size", str(SIZE), "-o", path, "-q"])
    return path


def kernel_counts(summary: str) -> dict:
    """{kernel label: layers} from a qcompile summary table (the ``kernel`` column)."""
    lines = summary.splitlines()
    head = next((i for i, ln in enumerate(lines) if ln.startswith("layer ") and " kernel" in ln), None)
    if head is None:
        return {}
    col = lines[head].index("kernel")
    out: dict = {}
    for ln in lines[head + 2:]:
        if not re.match(r"^\S+\s+(conv2d|dense)\s", ln):
            break
        k = ln[col:].split()[0] if len(ln) > col and ln[col:].strip() else "?"
        out[k] = out.get(k, 0) + 1
    return out


def build(onnx_f, model: str, target: str, batch: int, work: pathlib.Path, nvcc_jobs: int) -> dict:
    onnx = onnx_f.result()
    so = str(work / f"{model}_{target}_b{batch}.so")
    cmd = ["qcompile", onnx, "--target", target, "--batch", str(batch), "-o", so]
    if target == "cuda":
        cmd += ["--arch", "sm_90"]
    env = dict(os.environ, QCOMPILE_NVCC_JOBS=str(nvcc_jobs))
    t0 = time.perf_counter()
    out = _sh(cmd, env)
    return {"so": so, "command": shlex.join(["qcompile", *cmd[1:]]), "seconds": round(time.perf_counter() - t0, 1),
            "kernels": kernel_counts(out)}


# ---------------- the GPU side ----------------

def _imports():
    global torch, Module, time_calls, warm_gpu
    import bench_e2e
    import torch

    from qcompile.bench import time_calls
    from qcompile.runtime import Module

    bench_e2e.torch = torch  # (bench_e2e's GPU warm-up reads its module-level torch)
    warm_gpu = bench_e2e.warm_gpu


def check_equal(builds: dict, batch: int, seed: int) -> dict:
    """GPU build == llvm build, bit for bit, on one fresh random input of ``batch`` images."""
    x = np.random.default_rng(seed).standard_normal((batch, 3, SIZE, SIZE)).astype("float32")
    want = Module(builds[("llvm", batch)]["so"])(x)
    got = Module(builds[("cuda", batch)]["so"], "cuda")(x)
    diff = int(np.sum(got != want)) if got.shape == want.shape else -1
    return {"batch": batch, "seed": seed, "equal": diff == 0, "differing": diff, "distinct_outputs":
            int(len(np.unique(want)))}


def _sync_fn(m):
    import tvm_ffi

    f = tvm_ffi.get_global_func("runtime.Device_StreamSync")
    return lambda: f(m.dev, 0)


def time_ours(so: str, batch: int, number: int, repeat: int, calls: int) -> dict:
    m = Module(so, "cuda")
    x = m._tensor(np.random.default_rng(7).standard_normal((batch, 3, SIZE, SIZE)).astype("float32"))
    return time_calls(lambda: m._run(x), _sync_fn(m), number, repeat, calls)


def time_torch(model: str, batch: int, number: int, repeat: int, calls: int) -> dict:
    """The float network of ``qcompile.models`` in PyTorch fp16 (``qcompile.bench.time_torch_fp16``: cuDNN,
    channels_last, one CUDA graph replay per call)."""
    from qcompile.bench import time_torch_fp16
    from qcompile.models.resnet import build_model

    r = time_torch_fp16(build_model(model, seed=0), (batch, 3, SIZE, SIZE), number, repeat, calls)
    torch.cuda.empty_cache()
    return r


def measure(row: dict, builds: dict, a) -> dict:
    """Fill ``row`` (the model's, with its builds) in place: the checks, then the timings (a failure part way keeps
    what was measured before it)."""
    model = row["model"]
    row["checks"] = [check_equal(builds, b, secrets.randbits(32)) for b in CHECK_BATCHES]
    log(f"{model}: GPU == llvm " + ", ".join(f"b{c['batch']} {'yes' if c['equal'] else 'NO (%d)' % c['differing']}"
                                             for c in row["checks"]))
    big = dict(number=a.number, repeat=a.repeat, calls=a.calls // 10 or 1)
    one = dict(number=a.number * 20, repeat=a.repeat, calls=a.calls)
    row["qcompile_b256"] = time_ours(builds[("cuda", THROUGHPUT_BATCH)]["so"], THROUGHPUT_BATCH, **big)
    row["qcompile_b1"] = time_ours(builds[("cuda", 1)]["so"], 1, **one)
    row["torch_fp16_b256"] = time_torch(model, THROUGHPUT_BATCH, **big)
    row["torch_fp16_b1"] = time_torch(model, 1, **one)
    ips = lambda r, b: b * 1e3 / r["ms"]  # noqa: E731
    log(f"{model}: b256 {ips(row['qcompile_b256'], THROUGHPUT_BATCH):,.0f} img/s (PyTorch fp16 "
        f"{ips(row['torch_fp16_b256'], THROUGHPUT_BATCH):,.0f}); b1 p50 {row['qcompile_b1']['p50_ms']:.3f} ms "
        f"(PyTorch fp16 {row['torch_fp16_b1']['p50_ms']:.3f} ms)")
    return row


def write_json(path: pathlib.Path, doc: dict) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    tmp.replace(path)


def cmd_run(a) -> int:
    _imports()
    import tvm

    out = pathlib.Path(a.out)
    work = pathlib.Path(a.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    res_path = out / "bench_cnn.json"
    cores = len(os.sched_getaffinity(0))
    jobs = a.jobs or max(2, min(8, cores // 2))
    doc = {"device": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(),
           "command": shlex.join(["python", "scripts/bench_cnn.py", *sys.argv[1:]]), "torch": torch.__version__,
           "cudnn": str(torch.backends.cudnn.version()), "tvm": tvm.__version__, "host_cores": cores,
           "build_jobs": jobs, "input": f"float32 [batch, 3, {SIZE}, {SIZE}]", "bits": "8", "arch": "sm_90",
           "results": []}
    log(f"{doc['device']}; {len(a.models)} models, {len(BUILDS)} builds each, {jobs} build processes "
        f"({max(1, cores // jobs)} nvcc jobs each)")
    t0 = time.perf_counter()
    pool = cf.ThreadPoolExecutor(jobs)  # (threads waiting on subprocesses; qmodel jobs queue before every build)
    onnx = {m: pool.submit(make_onnx, m, work) for m in a.models}
    futs = {m: {(t, b): pool.submit(build, onnx[m], m, t, b, work, max(1, cores // jobs)) for t, b in BUILDS}
            for m in a.models}
    for m, fs in futs.items():
        for (t, b), f in fs.items():
            f.add_done_callback(lambda f, m=m, t=t, b=b: log(
                f"built {m} {t} b{b}" + (f" in {f.result()['seconds']:.0f} s" if not f.exception() else " FAILED")))
    warm_gpu()
    for m in a.models:
        try:
            builds = {k: f.result() for k, f in futs[m].items()}
        except Exception as e:  # noqa: BLE001 (a model that does not build is reported, the others still run)
            log(f"{m}: build failed: {e}")
            doc["results"].append({"model": m, "error": str(e)[-2000:]})
            write_json(res_path, doc)
            continue
        took = ", ".join(f"{t} b{b} {v['seconds']:.0f} s" for (t, b), v in builds.items())
        log(f"{m}: built ({took}); cuda kernels {next(v['kernels'] for (t, _), v in builds.items() if t == 'cuda')}")
        row = {"model": m, "builds": {f"{t}_b{b}": v for (t, b), v in builds.items()}}
        try:
            measure(row, builds, a)
        except Exception as e:  # noqa: BLE001  (the row keeps the checks made before the failure)
            log(f"{m}: failed: {e}")
            row["error"] = str(e)[-2000:]
        doc["results"].append(row)
        doc["elapsed_s"] = round(time.perf_counter() - t0, 1)
        write_json(res_path, doc)
        log(f"wrote {res_path} ({doc['elapsed_s']:.0f} s so far)")
    pool.shutdown()
    bad = [r["model"] for r in doc["results"] if "error" in r or not all(c["equal"] for c in r.get("checks", []))]
    log("every model: GPU == llvm bit for bit" if not bad else f"FAILED: {', '.join(bad)}")
    return 1 if bad else 0


# ---------------- the table ----------------

def table(doc: dict, paths: list, commands: list) -> str:
    rows = ["| model | measured | GPU == llvm (b1, b8) | kernels of the grouped convs | qcompile INT8 b256 img/s | "
            "PyTorch fp16 b256 img/s | speed-up | qcompile INT8 b1 p50 ms | PyTorch fp16 b1 p50 ms | speed-up |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for r in doc["results"]:
        name = f"{NAMES.get(r['model'], r['model'])} | {r.get('date', doc['date'])}"
        eq = ", ".join("yes" if c["equal"] else f"no ({c['differing']})" for c in r.get("checks", [])) or "-"
        if "error" in r:
            lines = r["error"].splitlines()
            why = next((ln for ln in lines if "error" in ln.lower() or "failed" in ln), lines[-1]).split(": ", 1)[-1]
            why = re.sub(r"'[^']*/([^/']+)'", r"\1", " ".join(why.split()))  # (file names without their folder)
            rows.append(f"| {name} | {eq} | failed: {why[:120]} |  |  |  |  |  |  |")
            continue
        ks = next((v.get("kernels", {}) for k, v in r["builds"].items() if k.startswith("cuda")), {})
        base: dict = {}  # (kernel labels without the "+lut" of an epilogue with a table)
        for k, v in ks.items():
            base[k.replace("+lut", "")] = base.get(k.replace("+lut", ""), 0) + v
        special = ", ".join(f"{k} {v}" for k, v in sorted(base.items()) if k in ("depthwise", "grouped", "grouped_gemm", "generic",
                                                                                  "fallback")) or "-"
        q, t = THROUGHPUT_BATCH * 1e3 / r["qcompile_b256"]["ms"], THROUGHPUT_BATCH * 1e3 / r["torch_fp16_b256"]["ms"]
        l1, t1 = r["qcompile_b1"]["p50_ms"], r["torch_fp16_b1"]["p50_ms"]
        rows.append(f"| {name} | {eq} | {special} | {q:,.0f} | {t:,.0f} | {q / t:.2f}x | {l1:.3f} | {t1:.3f} | "
                    f"{t1 / l1:.2f}x |")
    soft = f"PyTorch {doc.get('torch')}, cuDNN {_version('cudnn', doc.get('cudnn'))}, TVM {doc.get('tvm')}"
    cap = (f"{doc['device']} ({soft}); INT8 ONNX QDQ from `qmodel NAME --bits 8` (seeded random "
           f"weights, {doc['input']}), `qcompile --target cuda --arch sm_90`; PyTorch fp16: the same float network "
           f"(cuDNN, channels_last, CUDA graph) in the same process. Throughput: calls queued back to back; latency: "
           f"single synchronized calls, input on the GPU. Results: "
           + ", ".join(f"`{pathlib.PurePath(p).as_posix()}`" for p in paths) + "; "
           + ("commands: " if len(commands) > 1 else "command: ") + " and ".join(f"`{c}`" for c in commands) + ".")
    return cap + "\n\n" + "\n".join(rows)


def cmd_table(a) -> int:
    """One table from one or more results files (runs split by ``--models``: rows in file order, a model of a later
    file replacing its row of an earlier one; each row with its file's date; the caption and device from the first
    file, every file and command named)."""
    docs = [json.loads(pathlib.Path(p).read_text()) for p in a.results]
    rows: dict = {}  # (a model measured again in a later file: the later run's row, in the first one's place)
    for d in docs:
        for r in d["results"]:
            rows[r["model"]] = dict(r, date=d["date"])
    doc = dict(docs[0], results=list(rows.values()))
    write_block(a.name, table(doc, a.results, list(dict.fromkeys(d["command"] for d in docs))), a.write)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="build, check and time the models (GPU host)")
    r.add_argument("--models", nargs="+", default=list(MODELS), choices=sorted(NAMES), metavar="MODEL",
                   help=f"models (default: {' '.join(MODELS)}; also resnet18, resnet50)")
    r.add_argument("--out", default=str(DEFAULT_OUT), help="results folder (default: %(default)s)")
    r.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "qcompile_bench_cnn"),
                   help="folder of the ONNX models and .so files, kept out of OUT (default: %(default)s)")
    r.add_argument("--jobs", type=int, default=0, help="build processes at once (default: half the cores, 2 to 8)")
    r.add_argument("--number", type=int, default=8, help="calls per batch-256 throughput run (batch 1: 20x)")
    r.add_argument("--repeat", type=int, default=5, help="throughput runs (the median is kept)")
    r.add_argument("--calls", type=int, default=300, help="single calls timed at batch 1 (batch 256: a tenth)")
    add_table_command(sub, "cnn_gpu", "the Markdown table of results files", many=True)
    a = ap.parse_args(argv)
    return cmd_run(a) if a.cmd == "run" else cmd_table(a)


if __name__ == "__main__":
    sys.exit(main())
