"""The ``qbench`` command: throughput and latency of a compiled ``.so`` on this host's device, beside PyTorch fp16.

It builds nothing: it loads the module with the runtime (``qcompile.runtime.Module``), puts a random input on the
module's device once (float32 images, or, for a module built with ``--input-dtype int8|uint8``, integers of its input
range in its dtype and layout: the INT8-input path), and times

* throughput: ``--number`` calls queued back to back, then one device synchronization; the median over ``--repeat``
  such runs, as ms per batch and images per second;
* latency: ``--calls`` single calls, each followed by a synchronization, timed on the host: p50 / p90 / p99 / max.
  This is what a serving loop that keeps its data on the GPU sees (the input already there, the host side of the
  call -- argument checks, the VM, the CUDA-graph launch -- included); ``host_p50_ms`` is that host side alone (the
  median time until the call returns, before the synchronization);
* with ``--host-io``: the same for a NumPy input and output (the host-to-device copy of the input -- float32, or a
  quarter of its bytes as int8 -- and the copy of the logits back included);
* with ``--torch NET`` (torchvision's name, e.g. resnet50) where torch with CUDA is installed: the same network in
  PyTorch fp16 (cuDNN, channels_last, ``cudnn.benchmark``, one CUDA-graph replay per call), measured the same way in
  the same process.

Before anything is timed the GPU runs for ``--warm`` seconds (so that it leaves its idle clocks). The output is a
table on stdout and, with ``--json FILE``, the numbers with the device, date and command.
"""
from __future__ import annotations

import argparse
import datetime
import json
import shlex
import sys
import time

from .errors import OneLineArgumentParser, QCompileError, run_cli

PROG = "qbench"


def _parser() -> argparse.ArgumentParser:
    ap = OneLineArgumentParser(prog=PROG, description="Time a compiled .so on this host's device (builds nothing).")
    ap.add_argument("module", help="a .so written by qcompile")
    ap.add_argument("--weights", help="its weights file (a --weights-beside build; default NAME.weights.npz)")
    ap.add_argument("--number", type=_pos, default=0, help="calls per throughput run (default: about 2000 images)")
    ap.add_argument("--repeat", type=_pos, default=7, help="throughput runs; the median is reported (default 7)")
    ap.add_argument("--calls", type=_pos, default=1000, help="single calls timed for the latency percentiles")
    ap.add_argument("--host-io", action="store_true", help="also time calls with a NumPy input and output")
    ap.add_argument("--torch", metavar="NET", help="also time torchvision's NET in PyTorch fp16 (needs torch + CUDA)")
    ap.add_argument("--warm", type=float, default=2.0, help="seconds of GPU work before timing (default 2)")
    ap.add_argument("--json", metavar="FILE", help="write the results as JSON")
    return ap


def _pos(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        v = 0
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got '{s}'")
    return v


def percentiles(ts: list[float]) -> dict:
    """p50 / p90 / p99 / max (nearest rank) of ``ts`` (seconds), in ms."""
    s = sorted(ts)

    def at(q):
        return s[min(len(s) - 1, max(0, int(round(q * len(s))) - 1))] * 1e3

    return {"p50_ms": at(0.50), "p90_ms": at(0.90), "p99_ms": at(0.99), "max_ms": s[-1] * 1e3}


def time_calls(call, sync, number: int, repeat: int, calls: int) -> dict:
    """Throughput (median ms per call over ``repeat`` runs of ``number`` queued calls) and the latency percentiles
    of ``calls`` synchronized single calls."""
    for _ in range(3):  # (the first call captures the module's CUDA graph)
        call()
    sync()
    runs = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(number):
            call()
        sync()
        runs.append((time.perf_counter() - t0) / number)
    single, host = [], []
    for _ in range(calls):
        t0 = time.perf_counter()
        call()
        t1 = time.perf_counter()
        sync()
        single.append(time.perf_counter() - t0)
        host.append(t1 - t0)
    return {"ms": sorted(runs)[len(runs) // 2] * 1e3, **percentiles(single),
            "host_p50_ms": sorted(host)[len(host) // 2] * 1e3}


def time_torch_fp16(model, shape, number: int, repeat: int, calls: int) -> dict:
    """``model`` (a float ``nn.Module``) in PyTorch fp16 on a random input of ``shape``: eval, channels_last, cuDNN in
    benchmark mode, three warm-up calls, then one CUDA graph replay per timed call (``time_calls``)."""
    import torch

    torch.backends.cudnn.benchmark = True
    model = model.eval().cuda().half().to(memory_format=torch.channels_last)
    x = torch.randn(*shape, device="cuda", dtype=torch.half).to(memory_format=torch.channels_last)
    with torch.inference_mode():
        for _ in range(3):
            model(x)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            model(x)
        return time_calls(g.replay, torch.cuda.synchronize, number, repeat, calls)


def _torch_fp16(net: str, shape, number: int, repeat: int, calls: int) -> dict:
    import torchvision

    if not hasattr(torchvision.models, net):
        raise QCompileError(f"--torch {net}: torchvision has no model of that name")
    return time_torch_fp16(getattr(torchvision.models, net)(), shape, number, repeat, calls)


def _warm(seconds: float, call, sync):
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(10):
            call()
        sync()


def _bench(a, argv) -> int:
    import numpy as np

    from .checks import check_output_path
    from .runtime import Module, RunError

    if a.json:
        check_output_path(a.json, "--json", inputs=[("module", a.module)])
    try:
        m = Module(a.module, weights=a.weights)
    except RunError as e:
        raise QCompileError(str(e)) from None
    if a.torch:
        _check_torch(m)
    import tvm_ffi

    shape = tuple(m.meta["input_shape"])
    batch = shape[0]
    x_np = random_input(m, np.random.default_rng(0))
    x = m._tensor(x_np)  # on the module's device, once
    sync_fn = tvm_ffi.get_global_func("runtime.Device_StreamSync")
    dev = m.dev

    def sync():
        sync_fn(dev, 0)

    number = a.number or max(2, 2000 // batch)
    _warm(a.warm, lambda: m._run(x), sync)
    device = _device_name(m)
    res = {"module": a.module, "device": device, "date": datetime.date.today().isoformat(), "batch": batch,
           "input": f"{m.meta.get('input_dtype', 'float32')} {m.meta.get('input_layout', 'NCHW')}",
           "command": shlex.join([PROG, *argv]), "qcompile": time_calls(lambda: m._run(x), sync, number,
                                                                               a.repeat, a.calls)}
    if a.host_io:
        res["qcompile_host_io"] = time_calls(lambda: m(x_np), sync, max(2, number // 4), a.repeat, a.calls)
    if a.torch:
        res["torch_fp16"] = _torch_fp16(a.torch, nchw_shape(m), number, a.repeat, a.calls)
        res["torch_fp16"]["net"] = a.torch
    print(format_table(res))
    if a.json:
        from .checks import atomic_output

        with atomic_output(a.json) as tmp, open(tmp, "w") as f:
            f.write(json.dumps(res, indent=1) + "\n")
    return 0


def random_input(m, rng):
    """A random input of the kind module ``m`` takes: standard-normal float32 images, or uniform integers over an
    integer input's range (``m.input_quant``), in its dtype and layout."""
    shape, iq = tuple(m.meta["input_shape"]), m.input_quant
    if iq is None:
        return rng.standard_normal(shape).astype("float32")
    return rng.integers(iq.qmin, iq.qmax + 1, shape).astype(iq.dtype)


def nchw_shape(m) -> tuple:
    """The NCHW shape of module ``m``'s images (its input shape, transposed back from NHWC)."""
    shape = tuple(m.meta["input_shape"])
    if m.meta.get("input_layout", "NCHW") == "NHWC" and len(shape) == 4:
        return (shape[0], shape[3], shape[1], shape[2])
    return shape


def _check_torch(m):
    if m.device != "cuda":
        raise QCompileError("--torch compares on the GPU; this module runs on the CPU")
    try:
        import torch
        import torchvision  # noqa: F401
    except ImportError:
        raise QCompileError("--torch needs PyTorch and torchvision (pip install torch torchvision)") from None
    if not torch.cuda.is_available():
        raise QCompileError("--torch needs PyTorch with CUDA; this torch has no GPU")


def _device_name(m) -> str:
    if m.device != "cuda":
        import platform

        return platform.processor() or platform.machine()
    try:
        import tvm_ffi

        return str(tvm_ffi.get_global_func("runtime.GetDeviceAttr")(2, 0, 5))  # kDeviceName
    except Exception:  # noqa: BLE001  (a name is a label; the numbers stand without it)
        return "CUDA GPU 0"


def format_table(res: dict) -> str:
    b = res["batch"]
    rows = [("qcompile", res["qcompile"])]
    if "qcompile_host_io" in res:
        rows.append(("qcompile, NumPy in/out", res["qcompile_host_io"]))
    if "torch_fp16" in res:
        rows.append((f"PyTorch fp16 {res['torch_fp16']['net']}", res["torch_fp16"]))
    lines = [f"{res['module']} on {res['device']}, batch {b}, input {res.get('input', 'float32 NCHW')} "
             f"({res['date']})",
             "| | ms per batch | img/s | p50 ms | p90 ms | p99 ms | max ms | host ms |",
             "|---|---|---|---|---|---|---|---|"]
    for name, r in rows:
        lines.append(f"| {name} | {r['ms']:.3f} | {b / r['ms'] * 1e3:,.0f} | {r['p50_ms']:.3f} | {r['p90_ms']:.3f} | "
                     f"{r['p99_ms']:.3f} | {r['max_ms']:.3f} | {_host(r)} |")
    return "\n".join(lines)


def _host(r: dict) -> str:
    return f"{r['host_p50_ms']:.3f}" if "host_p50_ms" in r else "-"


def qbench_main(argv=None) -> int:
    ap = _parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    return run_cli(PROG, lambda: _bench(ap.parse_args(argv), argv))


if __name__ == "__main__":
    sys.exit(qbench_main())
