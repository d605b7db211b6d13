#!/usr/bin/env python3
"""Where the time goes: each kernel of a compiled CNN's forward pass against the H100 roofline.

Per kernel: time, integer ops, DRAM bytes, achieved TOPS and GB/s and the fraction of the bound that applies; summed
per stage and for the network.

    GPU host (qcompile with the TVM compiler, nvcc, ncu; run from the repository root):
        python3 scripts/roofline.py collect --model resnet50 --bits 8 4 --batch 256 --out OUT
    anywhere:
        python scripts/roofline.py table OUT/roofline.json [--write docs/BENCHMARKS.md]

``collect``, for each bit width (one JSON for all of them, OUT/roofline.json, and the log OUT/roofline_log.txt):

1. the model: ``--model`` a model file (one bit width, the file's) or a ``qmodel`` network name, exported by
   ``qmodel NAME --bits B`` (seeded random weights) into ``--build-dir``;
2. the build: ``compile_model`` for cuda ``--arch`` at ``--batch`` with the ``--tuning-log`` records, as ``qcompile``
   builds it; from the build's IR (``--dump-ir`` phases 3 and 5) the launch plan: every kernel one forward pass
   launches, in order, each tensor-core kernel with the layer it computes (:func:`launch_plan`; layers of equal shape
   share one kernel after ``dedup_prim_funcs``, so the plan, not the kernel name, tells them apart);
3. the profile: the ``.so`` run under Nsight Compute (``ncu --graph-profiling node``: the CUDA graph's kernels one by
   one; ``--cache-control none --clock-control none``: L2 left as the previous kernel leaves it, the GPU's own
   clocks) by a small driver (``_run``) that loads it with ``qcompile.runtime.Module``, puts a fresh random input on
   the GPU, runs the forward pass ``--warmup`` times and profiles one more (``cuProfilerStart``/``Stop`` around it,
   ``--profile-from-start off``; where that fails, every launch of one warm-up pass and one more, keeping the last
   pass's): ``gpu__time_duration.sum``, ``dram__bytes_read.sum``, ``dram__bytes_write.sum`` per kernel, with its
   grid and block;
4. the plain time of the forward pass without ncu (the same driver, ``qcompile.bench.time_calls``: calls queued
   back to back, median of 7 runs): ncu runs each kernel alone, serialised and replayed, so the kernels' sum is
   not the forward pass's time (no gaps between launches, the profiler's own cache and clock state); both are shown.

``--reuse`` takes each ``.so`` and its launch plan (``NAME_bN.build.json`` beside it) from an earlier ``collect`` in
``--build-dir`` instead of building again. A collect cut short keeps the models it finished in roofline.json.

``table`` (one or more results files) joins the measured kernels with the launch plan (kernel i of the profile is launch i of the plan; a name
that differs is an error), counts each conv's integer ops (2 x N x P x Q x K x C x R x S from the layer's shapes as
the model has them; a dense layer likewise; glue 0), and writes one stage table and one per-kernel table per bit
width between ``<!-- table:roofline -->`` markers (``--write``). The bound: ``--peak-tops`` (1979, the H100 SXM's
dense s8 wgmma rate; INT4 layers run on the same s8 tensor cores after unpacking) and ``--peak-gbs`` (3350, HBM3).
"""
from __future__ import annotations

import argparse
import csv
import datetime
import io
import json
import math
import os
import pathlib
import re
import shlex
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import e2e_table  # noqa: E402  (the table block writer every benchmark script uses)
from bench_layers import _commit  # noqa: E402  (the source tree's commit, -dirty with uncommitted changes)
from qcompile.tune.measure import write_json  # noqa: E402  (atomic: a temporary file renamed)

BUILD_DIR = ROOT / "build" / "roofline"
FORMAT = "qcompile-roofline/1"
PEAK_TOPS = 1979.0  # H100 SXM, dense s8 wgmma (INT4 layers: unpacked to s8, the same tensor cores)
PEAK_GBS = 3350.0   # H100 SXM, HBM3
METRICS = ("gpu__time_duration.sum", "dram__bytes_read.sum", "dram__bytes_write.sum")
STEM, HEAD = "stem", "head"


# ---------------- the launch plan (build side) ----------------

@dataclass
class Launch:
    """One kernel launch of the forward pass, as the build plans it."""
    kernel: str                # the CUDA kernel's name (its PrimFunc's name + ``_kernel``)
    layer: str | None = None   # the conv/dense layer it computes (None: glue)
    call: str | None = None    # the PrimFunc the dispatcher emitted for that layer (before deduplication)


def _functions(script: str) -> dict:
    """``{name: (kind, body)}`` of the module-level functions of a TVMScript dump (kind ``prim`` or ``relax``)."""
    out, name, kind, body = {}, None, None, []
    deco = None
    for line in script.splitlines():
        if line.startswith("    @"):
            deco = "prim" if line.startswith("    @T.prim_func") else "relax" if line.startswith("    @R.function") \
                else deco
            continue
        m = re.match(r"    def (\w+)\(", line)
        if m:
            if name is not None:
                out[name] = (kind, "\n".join(body))
            name, kind, body, deco = m.group(1), deco, [line], None
        elif name is not None:
            body.append(line)
    if name is not None:
        out[name] = (kind, "\n".join(body))
    return out


def _calls(funcs: dict, name: str, seen=()) -> list:
    """The PrimFuncs Relax function ``name`` calls, in order, through the Relax functions it calls (the CUDA graph's
    capture function)."""
    out = []
    for callee in re.findall(r"\bcls\.(\w+)", funcs[name][1]):
        kind = funcs.get(callee, (None,))[0]
        if kind == "prim":
            out.append(callee)
        elif kind == "relax" and callee not in seen and callee != name:
            out += _calls(funcs, callee, seen + (name,))
    return out


def _strip_call(call: str) -> tuple:
    """(the dispatcher's conv output name, the kernel's suffix) of a ``qconv_`` PrimFunc name."""
    base = call[len("qconv_"):]
    suffix = ""
    for s in ("_splitk_epilogue", "_resadd"):
        if base.endswith(s):
            base, suffix = base[: -len(s)], s + suffix
    return base, suffix


def launch_plan(dispatched: str, lowered: str, out_to_layer: dict, layers: list) -> list:
    """Every kernel the forward pass launches, in order, from two ``--dump-ir`` phases: ``3_dispatched`` (each conv's
    kernel under its own name, in call order) and ``5_lowered`` (the kernels the ``.so`` holds, equal ones merged by
    ``dedup_prim_funcs``, in launch order). The i-th tensor-core launch of the second is the i-th call of the first;
    a merged name must stand for a layer of the same shapes and kernel kind (checked; a split-K epilogue: the same
    output shape). ``out_to_layer``: the
    dispatcher's conv output name -> the layer (``layer_names``); ``layers``: the summary's ``LayerInfo`` dicts."""
    pre = [c for c in _calls(_functions(dispatched), "main") if c.startswith("qconv_")]
    post = _calls(_functions(lowered), "main")
    by_name = {lay["name"]: lay for lay in layers}

    def layer_of(call):
        out, _ = _strip_call(call)
        if out not in out_to_layer:
            raise ValueError(f"kernel {call}: no conv/dense layer has the output '{out}'")
        return out_to_layer[out]

    def signature(call):
        """What a merged kernel and the layer it runs for share: the shapes and bit widths; a split-K epilogue reads
        only the int32 partial sums, so layers of one output shape share it whatever their input."""
        lay, suffix = by_name[layer_of(call)], _strip_call(call)[1]
        if suffix.endswith("_splitk_epilogue"):
            return lay["op"], tuple(lay["out_shape"]), suffix
        return (lay["op"], tuple(lay["in_shape"]), tuple(lay["w_shape"]), tuple(lay["out_shape"]), lay["w_bits"],
                lay["a_bits"], suffix)

    n_post = sum(c.startswith("qconv_") for c in post)
    if n_post != len(pre):
        raise ValueError(f"the lowered module launches {n_post} tensor-core kernels, the dispatcher emitted {len(pre)}")
    plan, it = [], iter(pre)
    for c in post:
        if not c.startswith("qconv_"):
            plan.append(Launch(c + "_kernel"))
            continue
        p = next(it)
        if c != p and signature(c) != signature(p):
            raise ValueError(f"launch {len(plan)}: kernel {c} stands for {p} but their layers differ "
                             f"({signature(c)} vs {signature(p)})")
        plan.append(Launch(c + "_kernel", layer_of(p), p))
    missing = {lay["name"] for lay in layers} - {lp.layer for lp in plan}
    if missing:
        raise ValueError(f"layers without a kernel launch: {', '.join(sorted(missing))}")
    return plan


def layer_names(integer_mod) -> dict:
    """The dispatcher's conv output name (what its kernels are named after) -> the conv/dense layer (the summary's
    name: the conv2d / matmul binding), from the same grouping the dispatcher runs (``find_groups``)."""
    from qcompile.relay_passes.dispatch_tensor_core import find_groups

    func = integer_mod["main"]
    bindings = [b for blk in func.body.blocks for b in blk.bindings]
    out = {}
    for acc_out, g in find_groups(func).items():
        out.update({acc_out.name: b.var.name for b in bindings if b.value.same_as(g.acc_call)})
    return out


def cuda_kernel_names(res) -> list:
    """The names of the ``__global__`` kernels of a cuda build's CUDA source."""
    from qcompile.schedules.build import cuda_modules

    rx = re.compile(r"__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s+)?(\w+)\s*\(")
    return sorted({n for m in cuda_modules(res.executable) for n in rx.findall(m.inspect_source(""))})


def build(model: str, batch: int, arch: str, so: str, tuning_logs=(), gpu=None, log=print):
    """Compile ``model`` for cuda (``qcompile``'s defaults: NHWC, weights inside the ``.so``) to ``so``; returns the
    build's record (layers with their integer ops, the launch plan) and the ``CompileResult``."""
    import tempfile

    from qcompile.driver import CompileOptions, compile_model

    t0 = time.time()
    with tempfile.TemporaryDirectory() as dump:
        opts = CompileOptions(target="cuda", arch=arch, batch=batch, tuning_logs=tuple(tuning_logs), gpu=gpu,
                              dump_ir=dump)
        res = compile_model(model, opts, log=log)
        layers = [asdict(lay) for lay in res.layers]
        plan = launch_plan(pathlib.Path(dump, "3_dispatched.py").read_text(),
                           pathlib.Path(dump, "5_lowered.py").read_text(), layer_names(res.integer_mod), layers)
    res.export(so)
    for lay in layers:
        lay["ops"] = layer_ops(lay)
    cmd = ["qcompile", _rel(model), "--target", "cuda", "--arch", arch, "--batch", str(batch), "-o", _rel(so)]
    for t in tuning_logs:
        cmd += ["--tuning-log", t]
    cmd += ["--gpu", gpu] if gpu else []
    return {"so": so, "build_s": round(time.time() - t0, 1), "build_command": shlex.join(cmd), "meta": res.meta,
            "layers": layers, "launches": [asdict(lp) for lp in plan]}, res


def _rel(path: str) -> str:
    """``path`` relative to the repository where it lies inside it (as the commands in the docs name files)."""
    p = pathlib.Path(path).resolve()
    return str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else path


def layer_ops(lay: dict) -> int:
    """Integer ops (2 per multiply-add) of a conv or dense layer from its shapes as the model has them: 2 x N x P x Q
    x K x C x R x S (conv; channels last in every layout, so K is the output's last dimension and the weight holds
    K x C x R x S values), 2 x N x C x K (dense)."""
    out = [int(s) for s in lay["out_shape"]]
    return 2 * math.prod(out) * (math.prod(int(s) for s in lay["w_shape"]) // out[-1])


# ---------------- Nsight Compute (GPU host) ----------------

def ncu_command(ncu: str, report: str, so: str, warmup: int, every_launch: bool = False) -> list:
    """The ncu command line that profiles one forward pass of ``so`` (after ``warmup`` passes) into ``report``: the
    one between the driver's cuProfilerStart and Stop, or with ``every_launch`` all of them (the last pass's kernels
    are the last ones)."""
    return [ncu, "--graph-profiling", "node", "--cache-control", "none", "--clock-control", "none",
            *(() if every_launch else ("--profile-from-start", "off")), "--metrics", ",".join(METRICS),
            "--export", report, "--force-overwrite",
            sys.executable, str(pathlib.Path(__file__).resolve()), "_run", so, "--warmup", str(warmup), "--profile",
            *(("--no-range",) if every_launch else ())]


_SCALE = {"ns": 1.0, "nsecond": 1.0, "us": 1e3, "usecond": 1e3, "ms": 1e6, "msecond": 1e6, "s": 1e9, "second": 1e9,
          "byte": 1.0, "b": 1.0, "kbyte": 1e3, "kb": 1e3, "mbyte": 1e6, "mb": 1e6, "gbyte": 1e9, "gb": 1e9,
          "tbyte": 1e12, "tb": 1e12, "": 1.0}


def _value(s: str, unit: str) -> float:
    u = unit.strip().lower()
    if u not in _SCALE:
        raise ValueError(f"ncu CSV: unknown unit '{unit}'")
    return float(s.replace(",", "")) * _SCALE[u]


def parse_ncu_csv(text: str) -> list:
    """Kernel rows (in profile order) of an ncu CSV export: ``--page raw`` (one column per metric, a units row) or
    the details page (one row per metric, with its unit). Lines before the header (the application's output, ncu's
    ``==PROF==`` lines) are skipped; numbers may carry thousands separators."""
    lines = text.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.startswith('"ID",')), None)
    if start is None:
        raise ValueError("ncu CSV: no header line (\"ID\",...): did ncu profile any kernel?")
    rows = list(csv.reader(io.StringIO("\n".join(ln for ln in lines[start:] if ln.startswith('"')))))
    head, body = rows[0], rows[1:]
    col = {h: i for i, h in enumerate(head)}
    name_col = next((c for c in ("Kernel Name", "Function Name", "Demangled Name") if c in col), None)
    if name_col is None:
        raise ValueError(f"ncu CSV: no kernel name column in {head}")
    kernels: dict = {}

    def row_of(r):
        kid = int(r[col["ID"]])
        return kernels.setdefault(kid, {"id": kid, "name": r[col[name_col]].split("(")[0].strip(),
                                        "grid": _dims(r[col["Grid Size"]]) if "Grid Size" in col else "",
                                        "block": _dims(r[col["Block Size"]]) if "Block Size" in col else ""})

    if "Metric Name" in col:  # the details page: one row per (kernel, metric)
        for r in body:
            if r[col["Metric Name"]] in METRICS:
                row_of(r)[r[col["Metric Name"]]] = _value(r[col["Metric Value"]], r[col.get("Metric Unit", -1)]
                                                          if "Metric Unit" in col else "")
    else:  # --page raw: a units row, then one row per kernel
        units = body[0] if body and not body[0][col["ID"]] else [""] * len(head)
        for r in body:
            if not r[col["ID"]]:
                continue
            k = row_of(r)
            for m in METRICS:
                if m in col:
                    k[m] = _value(r[col[m]], units[col[m]])
    out = []
    for k in sorted(kernels.values(), key=lambda k: k["id"]):
        missing = [m for m in METRICS if m not in k]
        if missing:
            raise ValueError(f"ncu CSV: kernel {k['id']} ({k['name']}) lacks {', '.join(missing)}")
        out.append({"id": k["id"], "name": k["name"], "grid": k["grid"], "block": k["block"],
                    "time_ns": k["gpu__time_duration.sum"], "dram_read": k["dram__bytes_read.sum"],
                    "dram_write": k["dram__bytes_write.sum"]})
    return out


def _dims(s: str) -> str:
    """ncu's ``(128, 1, 1)`` as ``128x1x1``."""
    return "x".join(re.findall(r"\d+", s))


# ---------------- the driver ncu runs (GPU host) ----------------

def _cuda_profiler(start: bool):
    """cuProfilerStart / cuProfilerStop on the calling thread's context: the CUDA runtime's primary context, which the
    module's calls make current (made current here where it is not)."""
    import ctypes

    cu = ctypes.CDLL("libcuda.so.1")
    ctx = ctypes.c_void_p()
    if cu.cuCtxGetCurrent(ctypes.byref(ctx)) == 0 and not ctx.value:
        if cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) or cu.cuCtxSetCurrent(ctx):
            raise RuntimeError("no CUDA context for cuProfilerStart: device 0's primary context cannot be made current")
    rc = (cu.cuProfilerStart if start else cu.cuProfilerStop)()
    if rc:
        raise RuntimeError(f"{'cuProfilerStart' if start else 'cuProfilerStop'} failed with CUDA error {rc}")


def cmd_run(a) -> None:
    """Load the module, put a fresh random input on the GPU, run ``--warmup`` forward passes; then ``--profile``:
    one more between cuProfilerStart/Stop; or ``--time``: the plain time of a forward pass (JSON on the last line)."""
    import numpy as np
    import tvm_ffi

    from qcompile.bench import _device_name, _warm, time_calls
    from qcompile.runtime import Module

    m = Module(a.so)
    seed = int.from_bytes(os.urandom(4), "little")
    x = m._tensor(np.random.default_rng(seed).standard_normal(tuple(m.meta["input_shape"])).astype("float32"))
    sync_fn = tvm_ffi.get_global_func("runtime.Device_StreamSync")

    def sync():
        sync_fn(m.dev, 0)

    for _ in range(a.warmup):  # (the first call captures the CUDA graph)
        m._run(x)
    sync()
    if a.profile:
        if not a.no_range:
            _cuda_profiler(True)
        m._run(x)
        sync()
        if not a.no_range:
            _cuda_profiler(False)
        print(json.dumps({"profiled": 1, "seed": seed}))
        return
    _warm(2.0, lambda: m._run(x), sync)
    batch = int(m.meta["input_shape"][0])
    t = time_calls(lambda: m._run(x), sync, max(2, 2000 // batch), 7, 20)
    print(json.dumps({"forward_ms": t["ms"], "device": _device_name(m), "seed": seed}))


def _last_json(text: str) -> dict:
    return json.loads([ln for ln in text.splitlines() if ln.startswith("{")][-1])


def _sh(cmd, log, echo=False, **kw) -> str:
    """Run ``cmd`` (numbers in the C locale: ncu's CSV); its stdout. ``echo``: its output into the log too."""
    log("$ " + shlex.join(cmd))
    r = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, LC_NUMERIC="C"), **kw)
    if echo:
        for ln in (r.stdout + r.stderr).splitlines()[-40:]:
            log("  " + ln)
    if r.returncode:
        raise CommandFailed(f"command failed ({r.returncode}): {shlex.join(cmd)}\n{r.stdout[-3000:]}\n"
                            f"{r.stderr[-3000:]}")
    return r.stdout


class CommandFailed(RuntimeError):
    pass


def profile(a, so: str, report: str, n: int, log) -> list:
    """The ``n`` kernels of one forward pass of ``so`` under ncu (``ncu_command``), read back from its report. Where
    the cuProfilerStart/Stop range fails or holds another number of kernels, every launch is profiled instead
    (one warm-up pass) and the last ``n`` are kept."""
    for every in (False, True):
        try:
            _sh(ncu_command(a.ncu, report, so, 1 if every else a.warmup, every), log, echo=True, cwd=ROOT)
            rows = parse_ncu_csv(_sh([a.ncu, "--import", report + ".ncu-rep", "--csv", "--page", "raw",
                                      "--print-units", "base", "--print-kernel-base", "function"], log))
        except (CommandFailed, ValueError) as e:
            if every:
                raise
            log(f"profiling the cuProfilerStart/Stop range failed ({str(e).splitlines()[0][:300]}); every launch "
                f"instead")
            continue
        if len(rows) == n or (every and len(rows) > n):
            return rows[-n:]
        if every:
            raise CommandFailed(f"ncu profiled {len(rows)} kernels over two forward passes of {n} kernels")
        log(f"the cuProfilerStart/Stop range holds {len(rows)} kernels, a forward pass {n}; every launch instead")


def collect_one(a, model: str, tag: str, net: str, log) -> dict:
    """Build, profile and time one model (steps 2-4 of ``collect``)."""
    bdir = pathlib.Path(a.build_dir)
    so = str(bdir / f"{tag}_b{a.batch}.so")
    record = bdir / f"{tag}_b{a.batch}.build.json"  # (the build's record beside its .so, for --reuse)
    if a.reuse and record.is_file() and os.path.isfile(so):
        info = json.loads(record.read_text())
        log(f"{tag}: reusing {so} ({len(info['launches'])} kernel launches per forward pass)")
    else:
        info, _ = build(model, a.batch, a.arch, so, a.tuning_log, a.gpu, log=log)
        write_json(str(record), info)
        log(f"{tag}: built in {info['build_s']} s, {len(info['launches'])} kernel launches per forward pass")
    t0 = time.time()
    kernels = profile(a, so, str(bdir / f"{tag}_b{a.batch}"), len(info["launches"]), log)
    log(f"{tag}: {len(kernels)} kernels profiled in {time.time() - t0:.0f} s")
    timed = _last_json(_sh([sys.executable, str(pathlib.Path(__file__).resolve()), "_run", so, "--warmup", "3",
                            "--time"], log, cwd=ROOT))
    log(f"{tag}: forward pass {timed['forward_ms']:.3f} ms without ncu; kernels under ncu "
        f"{sum(k['time_ns'] for k in kernels) / 1e6:.3f} ms")
    info.update(tag=tag, net=net, model=model, bits=info["meta"]["bits"], batch=a.batch, forward_ms=timed["forward_ms"],
                device=timed["device"], kernels=kernels)
    return info


def cmd_collect(a, argv) -> None:
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    pathlib.Path(a.build_dir).mkdir(parents=True, exist_ok=True)
    logf = open(out / "roofline_log.txt", "a")

    def log(s):
        print(s, flush=True)
        logf.write(s + "\n")
        logf.flush()

    ncu_version = _sh([a.ncu, "--version"], log).strip().splitlines()[-1].replace("Version ", "")  # (ncu first)
    models = []
    if pathlib.Path(a.model).is_file():
        models.append((a.model, pathlib.Path(a.model).stem, pathlib.Path(a.model).stem))
    else:
        for b in a.bits:
            path = str(pathlib.Path(a.build_dir) / f"{a.model}_{b}.onnx")
            if not (a.reuse and os.path.isfile(path)):
                _sh(["qmodel", a.model, "--bits", b, "-o", path, "-q"], log)
            models.append((path, f"{a.model}_{b}", a.model))
    doc = {"format": FORMAT, "date": datetime.date.today().isoformat(), "ncu": ncu_version,
           "command": shlex.join(["python3", "scripts/roofline.py", *argv]), "commit": _commit(), "entries": []}
    for path, tag, net in models:
        doc["entries"].append(collect_one(a, path, tag, net, log))
        doc["device"] = doc["entries"][-1]["device"]
        write_json(str(out / "roofline.json"), doc)  # (after each model: a cut run keeps it)
    log(f"wrote {out / 'roofline.json'}")
    log(tables([(doc, str(out / "roofline.json"))], a.peak_tops, a.peak_gbs))


# ---------------- the tables ----------------

@dataclass
class Row:
    """One profiled kernel, joined with its launch."""
    index: int
    kernel: str
    layer: str | None
    stage: str
    grid: str
    time_ns: float
    ops: int
    dram_bytes: float

    def bound_ns(self, peak_tops: float, peak_gbs: float) -> float:
        """The time at the bound that applies: the larger of ops / peak and bytes / bandwidth."""
        return max(self.ops / (peak_tops * 1e3), self.dram_bytes / peak_gbs)


@dataclass
class Sum:
    """Kernels summed (a stage, the network)."""
    name: str
    n: int = 0
    time_ns: float = 0.0
    ops: int = 0
    dram_bytes: float = 0.0
    bound_ns: float = 0.0

    def add(self, r: Row, peak_tops: float, peak_gbs: float):
        self.n += 1
        self.time_ns += r.time_ns
        self.ops += r.ops
        self.dram_bytes += r.dram_bytes
        self.bound_ns += r.bound_ns(peak_tops, peak_gbs)


def layer_stages(layers: list) -> dict:
    """layer -> stage: ``layerN`` for ResNet's ``layerN_...`` layers, ``stem`` for those before the first of them,
    ``head`` for those after."""
    rx = re.compile(r"^layer(\d+)[_.]")
    idx = [i for i, lay in enumerate(layers) if rx.match(lay["name"])]
    out = {}
    for i, lay in enumerate(layers):
        m = rx.match(lay["name"])
        out[lay["name"]] = f"layer{m.group(1)}" if m else (STEM if not idx or i < idx[0] else HEAD)
    return out


def join(entry: dict) -> list:
    """The entry's profiled kernels joined with its launch plan, as :class:`Row` s: the i-th kernel is the i-th
    launch (names checked); a glue kernel belongs to the stage of the conv before it (the stem before the first
    conv, the head after the last ``layerN`` conv)."""
    plan, kernels = entry["launches"], entry["kernels"]
    if len(plan) != len(kernels):
        raise ValueError(f"{entry.get('tag')}: ncu profiled {len(kernels)} kernels, the build launches {len(plan)} "
                         f"per forward pass")
    stages = layer_stages(entry["layers"])
    ops = {lay["name"]: layer_ops(lay) for lay in entry["layers"]}
    seen_conv = [i for i, lp in enumerate(plan) if lp["layer"] and stages[lp["layer"]].startswith("layer")]
    last_body = seen_conv[-1] if seen_conv else -1
    rows, stage, counted = [], STEM, set()
    for i, (lp, k) in enumerate(zip(plan, kernels)):
        if k["name"] != lp["kernel"]:
            raise ValueError(f"{entry.get('tag')}: kernel {i} is {k['name']}, the build's launch {i} is {lp['kernel']}")
        lay = lp["layer"]
        if lay:
            stage = stages[lay]
        elif i > last_body >= 0:
            stage = HEAD
        n_ops = ops[lay] if lay and lay not in counted else 0  # (a split-K pair: the ops go to its GEMM kernel)
        counted.add(lay)
        rows.append(Row(i, k["name"], lay, stage, k["grid"], k["time_ns"], n_ops, k["dram_read"] + k["dram_write"]))
    return rows


def sums(rows: list, peak_tops: float, peak_gbs: float) -> list:
    """Per stage (in launch order of their first kernel), then the network."""
    by: dict = {}
    net = Sum("network")
    for r in rows:
        by.setdefault(r.stage, Sum(r.stage)).add(r, peak_tops, peak_gbs)
        net.add(r, peak_tops, peak_gbs)
    return [*by.values(), net]


def _bound(ops, nbytes, t_ns, peak_tops, peak_gbs) -> str:
    fc, fm = ops / t_ns / 1e3 / peak_tops, nbytes / t_ns / peak_gbs
    return f"{100 * max(fc, fm):.0f}% ({'compute' if fc >= fm else 'memory'})"


def _short(kernel: str) -> str:
    k = re.sub(r"_kernel$", "", kernel)
    return k if len(k) <= 48 else k[:45] + "..."


def entry_tables(e: dict, peak_tops: float, peak_gbs: float) -> str:
    rows = join(e)
    total = sum(r.time_ns for r in rows)
    name = e2e_table.NET_NAME.get(e.get("net"), e.get("net") or "model")
    bits = {"8": "INT8", "4": "INT4"}.get(str(e["bits"]), str(e["bits"]))
    out = [f"**{name} {bits}, batch {e['batch']}**: forward pass {e['forward_ms']:.3f} ms "
           f"({e['batch'] / e['forward_ms'] * 1e3:,.0f} img/s; CUDA graph, no profiler); its {len(rows)} kernels "
           f"{total / 1e6:.3f} ms under ncu.", "",
           "| stage | kernels | ms | share | GOP | DRAM MB | TOPS | GB/s | at the bound | % of bound |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for s in sums(rows, peak_tops, peak_gbs):
        b = "**" if s.name == "network" else ""
        out.append(f"| {b}{s.name}{b} | {s.n} | {s.time_ns / 1e6:.3f} | {100 * s.time_ns / total:.1f}% | "
                   f"{s.ops / 1e9:,.1f} | {s.dram_bytes / 1e6:,.1f} | {s.ops / s.time_ns / 1e3:,.0f} | "
                   f"{s.dram_bytes / s.time_ns:,.0f} | {s.bound_ns / 1e6:.3f} ms | "
                   f"{100 * s.bound_ns / s.time_ns:.0f}% |")
    out += ["", f"<details><summary>{bits}: every kernel</summary>", "",
            "| # | kernel | layer | stage | grid | us | GOP | DRAM MB | TOPS | GB/s | % of bound |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r.index} | `{_short(r.kernel)}` | {r.layer or 'glue'} | {r.stage} | {r.grid} | "
                   f"{r.time_ns / 1e3:,.1f} | {r.ops / 1e9:,.2f} | {r.dram_bytes / 1e6:,.1f} | "
                   f"{r.ops / r.time_ns / 1e3:,.0f} | {r.dram_bytes / r.time_ns:,.0f} | "
                   f"{_bound(r.ops, r.dram_bytes, r.time_ns, peak_tops, peak_gbs)} |")
    out += ["", "</details>", ""]
    return "\n".join(out)


def caption(doc: dict, path: str | None) -> str:
    """A results file's line: device, date, code, ncu, the file, the collect and build commands."""
    if doc.get("format") != FORMAT:
        raise ValueError(f"{path or 'results'}: not a roofline results file (format {doc.get('format')!r}, "
                         f"expected {FORMAT!r})")
    code = f", code at `{doc['commit']}`" if doc.get("commit") else ""
    res = f" Results: `{pathlib.PurePath(path).as_posix()}`." if path else ""
    builds = " and ".join(f"`{e['build_command']}`" for e in doc["entries"])
    return (f"{doc.get('device', '?')}, {doc['date']}{code}, Nsight Compute {doc['ncu']}.{res} Collected with "
            f"`{doc['command']}` (builds: {builds}).")


def tables(docs: list, peak_tops: float = PEAK_TOPS, peak_gbs: float = PEAK_GBS) -> str:
    """The Markdown block of ``(results, path)`` pairs: what the columns mean, then per results file its caption and
    per entry its stage table and (folded) its per-kernel table."""
    out = [f"Per kernel: `ncu --graph-profiling node --cache-control none --clock-control none` over one forward pass "
           f"({', '.join(METRICS)}). ncu runs each kernel alone (launches serialised, each replayed for its "
           f"metrics), so the kernels' sum leaves out the gaps between launches; the forward pass's own time (CUDA "
           f"graph, no profiler) stands beside it. Integer ops: 2 x MACs of each "
           f"conv and dense layer as the model has it (glue kernels 0; the stem's padded space-to-depth kernel "
           f"executes more). *At the bound*: each kernel's time at the bound that applies, the larger of ops / "
           f"{peak_tops:g} TOPS (dense s8 tensor cores, also INT4's) and DRAM bytes / {peak_gbs / 1e3:g} TB/s (HBM3), "
           f"summed; *% of bound*: that time over the measured one.", ""]
    for doc, path in docs:
        out += [caption(doc, path), ""]
        out += [entry_tables(e, peak_tops, peak_gbs) for e in doc["entries"]]
    return "\n".join(out).rstrip("\n") + "\n"


# ---------------- CLI ----------------

def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("collect", help="build, profile with ncu and time each bit width (GPU host)")
    c.add_argument("--model", required=True, help="a model file, or a qmodel network name (e.g. resnet50)")
    c.add_argument("--bits", nargs="+", default=["8", "4"], choices=["8", "4", "mixed"],
                   help="bit widths of a qmodel network (default: 8 4; a model file has its own)")
    c.add_argument("--batch", type=int, default=256)
    c.add_argument("--arch", default="sm_90")
    c.add_argument("--tuning-log", action="append", default=[], help="tuning log (repeatable), as qcompile takes it")
    c.add_argument("--gpu", help="the GPU the build is for, as qcompile --gpu takes it")
    c.add_argument("--warmup", type=int, default=3, help="forward passes before the profiled one (default 3)")
    c.add_argument("--ncu", default="ncu", help="the Nsight Compute CLI (default: ncu on PATH)")
    c.add_argument("--build-dir", default=str(BUILD_DIR), help="models, .so files, ncu reports (default: %(default)s)")
    c.add_argument("--reuse", action="store_true",
                   help="take each model, .so and launch plan from an earlier collect in --build-dir instead of making them")
    c.add_argument("--out", required=True, help="folder for roofline.json and roofline_log.txt")
    r = sub.add_parser("_run", help="(the driver ncu runs) load a .so, run it, profile or time one forward pass")
    r.add_argument("so")
    r.add_argument("--warmup", type=int, default=3)
    g = r.add_mutually_exclusive_group(required=True)
    g.add_argument("--profile", action="store_true")
    g.add_argument("--time", action="store_true")
    r.add_argument("--no-range", action="store_true", help="--profile without cuProfilerStart/Stop")
    t = e2e_table.add_table_command(sub, "roofline", "the Markdown tables of roofline.json files", many=True)
    for p in (c, t):
        p.add_argument("--peak-tops", type=float, default=PEAK_TOPS, help="compute bound, TOPS (default %(default)s)")
        p.add_argument("--peak-gbs", type=float, default=PEAK_GBS, help="memory bound, GB/s (default %(default)s)")
    a = ap.parse_args(argv)
    if a.cmd == "collect":
        if a.batch < 1 or a.warmup < 1:
            ap.error("--batch and --warmup must be positive")
        try:
            cmd_collect(a, argv)
        except CommandFailed as e:
            sys.exit(f"roofline.py collect: {e}")
    elif a.cmd == "_run":
        cmd_run(a)
    else:
        docs = [(json.loads(pathlib.Path(p).read_text()), p) for p in a.results]
        e2e_table.write_block(a.name, tables(docs, a.peak_tops, a.peak_gbs), a.write)


if __name__ == "__main__":
    main()
