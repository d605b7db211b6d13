"""Measurements per minute through TVM's RPC tracker with 1, 2, ... GPUs of one host (docs/TUNING.md, "Several GPUs").

One batch of tuning candidates is built once (random legal points of a model's tasks, as qtune's search draws them),
then measured by qtune's rpc runner (``qcompile.tune.runners.RPCRunner``: every candidate checked bit for bit against
the NumPy reference, then timed) against a tracker on loopback with 1 server, then 2 servers, ... -- one
``rpc_server`` per GPU (``CUDA_VISIBLE_DEVICES``), each started fresh for its run. The same candidates, the same
seeds: the runs differ only in the number of GPUs measuring at once (and, with ``--check both``, in where the
outputs are poisoned and compared: on the servers' devices, the runner's default, or back on this host).

    python scripts/rpc_throughput.py r50_int8.onnx --arch sm_90 --batch 64 --per-task 3 --servers 1 2 -o rpc.json

Needs qcompile with the compiler (the build), TVM's RPC tracker (tornado), and one GPU per server.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import socket
import subprocess
import sys
import threading
import time


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_port(port: int, proc, timeout: float = 60.0) -> None:
    t = time.time()
    while time.time() - t < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"the process on port {port} exited ({proc.returncode})")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise TimeoutError(f"nothing listens on {port}")


def build_batch(model: str, arch: str, batch: int, per_task: int, seed: int, jobs: int, folder: str) -> list:
    """``per_task`` random legal points of every tunable task of ``model`` (the defaults first), built in
    ``folder``."""
    import numpy as np

    from qcompile.cli import _import_driver_without_torch

    _import_driver_without_torch()
    from qcompile.schedules.space import SPACES
    from qcompile.tune.build import LocalBuilder
    from qcompile.tune.common import Candidate
    from qcompile.tune.tasks import extract_tasks

    tasks = extract_tasks(model, arch, (batch,), "NHWC", None, None, None, None, (), None, lambda s: None)
    rng = np.random.default_rng(seed)
    cands = []
    for t in tasks:
        sp = SPACES.get(t.strategy)
        if sp is None:
            continue
        pts = [sp.default(t.spec, arch)]
        for _ in range(8 * per_task):
            if len(pts) >= per_task:
                break
            kn = sp.sample(rng, t.spec, arch)
            if kn is not None and kn not in pts:
                pts.append(kn)
        cands += [Candidate(t.key, t.spec, arch, t.strategy, kn) for kn in pts]
    built = LocalBuilder(jobs=jobs, build_dir=folder).build(cands)
    return [b for b in built if b.error is None and b.path]


def measure_with(built: list, servers: int, key: str, server_args: list, seed: int, repeat: int,
                 min_repeat_ms: int, problems, device_check: bool = True) -> dict:
    """Start a tracker and ``servers`` rpc_servers (GPU i for server i), measure every candidate, stop them.
    ``problems``: the shapes' inputs and references, made before (``draw_problems``): the runs time the GPUs'
    work, not the NumPy references (which a tuning run makes once per shape, not per candidate)."""
    from qcompile.tune.runners import RPCRunner

    tp = _free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "tvm.exec.rpc_tracker", "--host", "127.0.0.1", "--port", str(tp),
                               "--port-end", str(tp + 1)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    try:
        _wait_port(tp, procs[0])
        for i in range(servers):
            p = _free_port()
            env = dict(os.environ, CUDA_VISIBLE_DEVICES=str(i))
            procs.append(subprocess.Popen([sys.executable, "-m", "tvm.exec.rpc_server", "--tracker", f"127.0.0.1:{tp}",
                                           "--key", key, "--host", "127.0.0.1", "--port", str(p), "--port-end",
                                           str(p + 1)] + server_args, env=env, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL))
        stamps = []  # (when each candidate's record came back, and on which server's thread)

        def log(line):
            stamps.append((time.time(), threading.get_ident()))
            print(f"  [{servers} server(s)] {line}", flush=True)

        runner = RPCRunner("127.0.0.1", tp, key, seed=seed, repeat=repeat, min_repeat_ms=min_repeat_ms, log=log)
        runner.problems = problems
        runner.device_check = device_check
        t = time.time()
        while runner.servers() < servers and time.time() - t < 120:
            time.sleep(0.3)
        if runner.servers() < servers:
            raise RuntimeError(f"only {runner.servers()} of {servers} servers registered at the tracker")
        runner.prepare()  # (the device and the device helpers' build: once per tuning run, not timed)
        dev = runner.device()
        t0 = time.time()
        got = runner.measure(built)
        secs = time.time() - t0
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
    status: dict = {}
    for m in got:
        status[m.status] = status.get(m.status, 0) + 1
    # steady state: the records after every server's first (a server's first session is a fresh process: seconds)
    firsts: dict = {}
    for t, th in stamps:
        firsts.setdefault(th, t)
    t0 = max(firsts.values(), default=0.0)
    after = [t for t, _ in stamps if t > t0]
    steady = 60 * len(after) / (after[-1] - t0) if after else None
    phases: dict = {}  # (mean seconds per candidate of each phase on this side: load = upload + load_module)
    for ph in runner.phases:
        for k, v in ph.items():
            phases.setdefault(k, []).append(v)
    return dict(servers=servers, device=dev.name, device_check=device_check, candidates=len(got),
                phase_mean_s={k: round(sum(v) / len(v), 4) for k, v in phases.items()}, seconds=round(secs, 2),
                per_minute=round(60 * len(got) / secs, 1),
                per_minute_steady=round(steady, 1) if steady else None, status=status,
                ms={m.candidate.key + "|" + json.dumps(m.candidate.knobs.__dict__ if m.candidate.knobs else None,
                                                      sort_keys=True): m.ms for m in got if m.ms is not None})


def draw_problems(built: list, seed: int):
    """Every shape's problem (inputs, NumPy reference) for the rpc runner's seed, made once before the timed runs."""
    from qcompile.tune import measure as M

    entries = [b.entry for b in built]
    problems = M.Problems(keep=len({M.spec_key(e) for e in entries}) + 1)
    for e in entries:
        problems.get(e, M.shape_seed(seed, e))
    return problems


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--per-task", type=int, default=3, help="candidates per task (the default knobs first)")
    ap.add_argument("--servers", type=int, nargs="+", default=[1, 2], help="GPUs (servers) per run")
    ap.add_argument("--key", default="gpu")
    ap.add_argument("--server-args", default="--no-fork", help="extra rpc_server arguments (default: --no-fork)")
    ap.add_argument("--check", choices=("device", "host", "both"), default="device",
                    help="where the outputs are poisoned and compared: on the servers' devices (the rpc runner's "
                         "default), on this host (every output sent back), or both, one after the other")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--min-repeat-ms", type=int, default=20)
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--build-dir", default="/tmp/rpc_throughput_batch")
    ap.add_argument("-o", "--output", required=True)
    a = ap.parse_args(argv)
    from qcompile.tune.measure import write_json

    t = time.time()
    built = build_batch(a.model, a.arch, a.batch, a.per_task, a.seed, a.jobs, a.build_dir)
    print(f"built {len(built)} candidates in {time.time() - t:.0f} s", flush=True)
    t = time.time()
    problems = draw_problems(built, a.seed)
    print(f"drew the shapes' inputs and references in {time.time() - t:.0f} s", flush=True)
    out = dict(date=datetime.date.today().isoformat(), command="python scripts/rpc_throughput.py "
               + " ".join(map(shlex.quote, argv if argv is not None else sys.argv[1:])), model=os.path.basename(a.model),
               arch=a.arch, batch=a.batch, candidates=len(built), runs=[])
    for check in (("host", "device") if a.check == "both" else (a.check,)):
        for n in a.servers:
            r = measure_with(built, n, a.key, shlex.split(a.server_args), a.seed, a.repeat, a.min_repeat_ms, problems,
                             device_check=check == "device")
            print(f"{n} server(s), {check} check: {r['candidates']} candidates in {r['seconds']} s = "
                  f"{r['per_minute']}/min (after each server's first: {r['per_minute_steady']}/min) {r['status']}; "
                  f"mean s per candidate and phase: {r['phase_mean_s']}", flush=True)
            out["runs"].append(r)
            write_json(a.output, out)
    for r in out["runs"]:  # (against the first run of the same check)
        b = next(x for x in out["runs"] if x["device_check"] == r["device_check"])
        r["speedup"] = round(r["per_minute"] / b["per_minute"], 2)
        r["speedup_steady"] = (round(r["per_minute_steady"] / b["per_minute_steady"], 2)
                               if b["per_minute_steady"] and r["per_minute_steady"] else None)
    same = [r["ms"] for r in out["runs"]]
    out["same_status"] = len({json.dumps(r["status"], sort_keys=True) for r in out["runs"]}) == 1
    out["same_candidates_ok"] = len({frozenset(m) for m in same}) == 1
    for r in out["runs"]:
        r.pop("ms")
    write_json(a.output, out)
    print(json.dumps([[r["servers"], r["device_check"], r["speedup"], r["speedup_steady"]] for r in out["runs"]]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
