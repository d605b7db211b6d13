"""Runners: where built candidates are measured (the ``Runner`` of qcompile.tune.common). All three produce the
same ``Measured`` records, from the same code (``qcompile.tune.measure``: fresh random inputs, a bit-exact check
against the NumPy reference with poisoned outputs, then the time):

* ``local`` -- the GPU of this machine. Each batch is measured in a child process (measure.py's supervisor), so a
  candidate that crashes the CUDA context or hangs is reported ``run_error`` and the rest are measured.
* ``rpc`` -- TVM's RPC tracker and one ``rpc_server`` per GPU (``--rpc-tracker HOST:PORT --rpc-key KEY``). The
  candidates go to every server of the key at once, one thread per server: N GPUs measure N candidates in
  parallel. Each thread keeps its session (a server process) for as many candidates as fit in the session's time
  limit, ``RPCRunner.SESSION_SPAN`` times ``--measure-timeout`` (a new session starts while at least one timeout
  of it is left for each candidate); the candidates go to the threads by shape (:class:`ShapeQueue`), and a shape's
  inputs stay on the server while its candidates follow one another; a candidate that fails at run time ends its session. The server kills a session at its limit: a
  candidate that hangs holds its server for at most that long, and is recorded run_error. Inputs are made here
  and sent; the kernels' libraries are uploaded. The outputs are poisoned and compared with the reference on the
  server's device (tune/device_check.py: a small library built here per device, uploaded once per session), so
  that a candidate's check moves partial counts over the socket, not its output.
* ``offline`` -- for a GPU host that cannot reach this one: ``export(built, DIR)`` writes a self-contained batch
  (the libraries, manifest.json, measure.py, run.sh, README.txt); on the GPU host, with only NumPy and the TVM
  runtime, ``python measure.py . -o results.json``; ``import_results(results.json)`` reads the measurements back.

The servers of an rpc runner need only the TVM runtime: ``python -m tvm.exec.rpc_server --tracker HOST:PORT --key
KEY --host 127.0.0.1`` (runtime-only TVM, e.g. scripts/make_runtime_bundle.sh's bundle with TVM_USE_RUNTIME_LIB=1,
also needs ``--load-library <tvm>/lib/libtvm_runtime_cuda.so``: it does not load its CUDA backend by itself; and
``--no-fork``: CUDA failed to initialise in the forked session processes on our H100 host).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import threading
import time
from collections import deque

from qcompile.errors import QCompileError

from . import device_check
from . import measure as M
from .common import BUILD_ERROR, OK, RUN_ERROR, Built, Candidate, DeviceInfo, Measured, Runner

RUNNERS = ("local", "rpc", "offline")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("measuring candidates (runners)")
    g.add_argument("--runner", choices=RUNNERS, default=None,
                   help="local: this machine's GPU; rpc: the GPUs of an RPC tracker's servers; offline: export "
                        "batches to measure elsewhere (--export / --import). Default: local, or offline with "
                        "--export / --import")
    g.add_argument("--rpc-tracker", metavar="HOST:PORT", help="the RPC tracker (rpc runner)")
    g.add_argument("--rpc-key", metavar="KEY", help="the servers' key at the tracker (rpc runner)")
    g.add_argument("--rpc-sessions", type=int, default=0, metavar="N",
                   help="candidates measured at once (default: one per server of the key)")
    g.add_argument("--export", metavar="DIR", help="offline runner: write each batch to measure to DIR/batch_NNNN")
    g.add_argument("--import", dest="import_results", metavar="RESULTS", nargs="+",
                   help="offline runner: results files of exported batches (measure.py's -o)")
    g.add_argument("--measure-device", choices=("cuda", "cpu"), default="cuda",
                   help="the device kind the candidates run on (cpu: llvm-built candidates; default: cuda)")
    g.add_argument("--device-id", type=int, default=0, help="which GPU the local runner uses (default: 0)")
    g.add_argument("--problem-cache", metavar="DIR",
                   help="local runner: keep each shape's random inputs and NumPy reference in DIR, with the seed they "
                        "were drawn from, so a resumed run reuses them instead of computing the references again "
                        "(large: hundreds of MB per shape at batch 256; default: a temporary folder per run)")
    g.add_argument("--measure-timeout", type=float, default=120.0, metavar="S",
                   help="seconds one candidate may take on the device (default: 120)")
    g.add_argument("--repeat", type=int, default=7, help="timed repeats per kernel (default: 7)")
    g.add_argument("--min-repeat-ms", type=int, default=20, metavar="MS",
                   help="each timed repeat runs back-to-back launches for at least this long (default: 20)")


def _tracker_addr(s: str) -> tuple[str, int]:
    host, _, port = (s or "").rpartition(":")
    if not host or not port.isdigit():
        raise QCompileError(f"--rpc-tracker {s!r}: expected HOST:PORT (e.g. 127.0.0.1:9190)")
    return host, int(port)


def make_runner(args) -> Runner:
    """The runner the command line asks for (``add_arguments``' options)."""
    g = lambda k, d=None: getattr(args, k, d)
    kind = g("runner") or ("offline" if g("export") or g("import_results") else "local")
    if g("repeat", 7) < 1 or g("min_repeat_ms", 20) < 0 or g("measure_timeout", 120.0) <= 0:
        raise QCompileError("--repeat must be at least 1, --min-repeat-ms at least 0, --measure-timeout above 0")
    common = dict(device=g("measure_device") or "cuda", timeout=g("measure_timeout", 120.0), repeat=g("repeat", 7),
                  min_repeat_ms=g("min_repeat_ms", 20))
    if kind == "local":
        cache = g("problem_cache")
        return LocalRunner(device_id=g("device_id", 0), cache_dir=cache, seed=problem_seed(cache) if cache else None,
                           **common)
    if kind == "rpc":
        if not g("rpc_tracker") or not g("rpc_key"):
            raise QCompileError("--runner rpc needs --rpc-tracker HOST:PORT and --rpc-key KEY")
        if g("rpc_sessions", 0) < 0:
            raise QCompileError("--rpc-sessions must be at least 0")
        host, port = _tracker_addr(g("rpc_tracker"))
        return RPCRunner(host, port, g("rpc_key"), sessions=g("rpc_sessions", 0), **common)
    if not g("export") and not g("import_results"):
        raise QCompileError("--runner offline needs --export DIR (and --import RESULTS once they are measured)")
    return OfflineRunner(g("export"), g("import_results") or (), arch=g("arch"))


def problem_seed(folder: str) -> int:
    """The seed of a problem cache (``--problem-cache``): read from ``folder/seed``, or drawn at random and written
    there (the folder made) by the first run that uses it."""
    path = os.path.join(folder, "seed")
    try:
        try:
            with open(path) as f:
                return int(f.read().strip())
        except FileNotFoundError:
            pass
        os.makedirs(folder, exist_ok=True)
        seed = int.from_bytes(os.urandom(4), "little")
        with open(path, "x") as f:  # (exclusive: of two runs starting on one cache, the second reads the first's)
            f.write(f"{seed}\n")
        return seed
    except FileExistsError:
        return problem_seed(folder)
    except ValueError:
        raise QCompileError(f"--problem-cache {folder}: {path} is not a seed (an integer); remove the folder") from None
    except OSError as e:
        raise QCompileError(f"--problem-cache {folder}: {e.strerror or e}") from None


# ---------------------------------------------------------------------------------------------------------------
# results -> Measured
# ---------------------------------------------------------------------------------------------------------------
def candidate_from(info: dict) -> Candidate:
    """A Candidate from a manifest entry or a results record's ``candidate``."""
    from qcompile.schedules.spec import ConvSpec

    spec = ConvSpec(**{k: tuple(v) if isinstance(v, list) else v for k, v in info["spec"].items()})
    knobs = None
    if info.get("knobs") is not None:
        if info.get("knobs_type") == "KtKnobs":
            from qcompile.schedules.igemm_t import KtKnobs as T
        elif info.get("knobs_type") == "HaloKnobs":
            from qcompile.schedules.stem import HaloKnobs as T
        elif info.get("knobs_type") == "CpuKnobs":
            from qcompile.schedules.cpu_conv import CpuKnobs as T
        elif info.get("knobs_type") == "DwConfig":
            from qcompile.schedules.depthwise import DwConfig as T
        elif info.get("knobs_type") == "GroupedConfig":
            from qcompile.schedules.grouped import GroupedConfig as T
        else:
            from qcompile.schedules.spec import GemmKnobs as T
        knobs = T(**info["knobs"])
    return Candidate(info["key"], spec, info["arch"], info["strategy"], knobs)


def to_measured(cand: Candidate, rec: dict, dev: dict | None) -> Measured:
    dev = dev or {}
    return Measured(cand, rec["status"], rec.get("ms") if rec["status"] == OK else None, rec.get("detail", ""),
                    dev.get("name", ""), dev.get("sms"))


def _unbuilt(b: Built) -> Measured:
    return Measured(b.candidate, BUILD_ERROR, None, b.error or "not built")


def _entries(built: list[Built], absolute: bool) -> list[dict]:
    """The distinct manifest entries of the built candidates (``so`` absolute where asked)."""
    out, seen = [], set()
    for b in built:
        if b.error is None and b.path and b.entry.get("id") not in seen:
            seen.add(b.entry["id"])
            e = dict(b.entry, so=os.path.abspath(b.path) if absolute else os.path.basename(b.path))
            out.append(e)
    return out


def _device_info(d: dict) -> DeviceInfo:
    return DeviceInfo(d["name"], d["arch"], int(d["sms"]), d.get("smem_per_block"))


# ---------------------------------------------------------------------------------------------------------------
# local
# ---------------------------------------------------------------------------------------------------------------
class LocalRunner(Runner):
    """This machine's device; each batch measured by measure.py's supervisor (a worker process per batch, a new
    one after a candidate that kills it). One seed for the runner's life (random unless given): a shape's inputs
    and reference are drawn once, kept in ``cache_dir`` (default: a temporary folder, removed at exit) and reused by
    the following rounds -- and by later runs where ``cache_dir`` and the seed are kept (``--problem-cache``)."""

    def __init__(self, device: str = "cuda", device_id: int = 0, timeout: float = 120.0, repeat: int = 7,
                 min_repeat_ms: int = 20, seed: int | None = None, log=None, cache_dir: str | None = None):
        self.kind, self.device_id, self.timeout = device, device_id, timeout
        self.repeat, self.min_repeat_ms, self.log = repeat, min_repeat_ms, log
        self.seed = int.from_bytes(os.urandom(4), "little") if seed is None else seed
        self.cache_dir = cache_dir
        self._info = None
        self.last_results = None  # the last batch's results document (seed, timing, per-candidate records)
        self.phases: list = []  # (per measured candidate: seconds of the worker per phase, measure.measure_entry)

    def _cache(self) -> str:
        if self.cache_dir is None:
            import atexit

            self.cache_dir = tempfile.mkdtemp(prefix="qtune-problems-")
            atexit.register(shutil.rmtree, self.cache_dir, True)
        return self.cache_dir

    def device(self) -> DeviceInfo:
        if self._info is None:
            import subprocess
            import sys

            r = subprocess.run([sys.executable, M.__file__, "-", "--device-info", "--device", self.kind,
                                "--device-id", str(self.device_id)], capture_output=True, text=True,
                               env=dict(os.environ, TVM_USE_RUNTIME_LIB="1"), timeout=self.timeout)
            if r.returncode != 0:
                msg = (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1]
                raise QCompileError(f"local runner: no {self.kind} device {self.device_id}: {msg}")
            self._info = json.loads(r.stdout.strip().splitlines()[-1])
        return _device_info(self._info)

    def measure(self, built: list[Built]) -> list[Measured]:
        entries = _entries(built, absolute=True)
        recs, dev = {}, None
        if entries:
            with tempfile.TemporaryDirectory(prefix="qtune-batch-") as td:
                man = os.path.join(td, "manifest.json")
                with open(man, "w") as f:
                    json.dump(dict(format=M.FORMAT, candidates=entries), f)
                doc = M.supervise(man, None, self.kind, self.device_id, self.seed, self.repeat, self.min_repeat_ms,
                                  self.timeout, log=self.log, cache_dir=self._cache())
            self.last_results = doc
            recs, dev = {r["id"]: r for r in doc["results"]}, doc["device"]
            self.phases += [r["phases"] for r in doc["results"] if r.get("phases")]
            if dev and self._info is None:
                self._info = dev
        return [to_measured(b.candidate, recs[b.entry["id"]], dev) if b.error is None and b.path else _unbuilt(b)
                for b in built]


def _run_error(entry: dict, seed: int, e: Exception) -> dict:
    msg = " ".join(str(e).split())
    return dict(id=entry["id"], status=RUN_ERROR, ms=None, seed=seed, detail=f"{type(e).__name__}: {msg[-300:]}")


# ---------------------------------------------------------------------------------------------------------------
# rpc
# ---------------------------------------------------------------------------------------------------------------
class ShapeQueue:
    """The rpc runner's candidates, handed to its sessions by shape. A session's shape costs an upload (inputs,
    weights, reference: tens of MB at large batches, slower through RPC than the candidate's measurement), so a session
    keeps taking its shape's candidates; then the first shape no session works on; only when every shape left has a
    session does it join the one with the most candidates left."""

    def __init__(self, entries: list, key):
        self._lock = threading.Lock()
        self._groups: dict = {}  # shape -> its candidates, shapes in order of first appearance
        for e in entries:
            self._groups.setdefault(key(e), deque()).append(e)
        self._sessions: dict = {k: 0 for k in self._groups}  # shape -> sessions working on it

    def take(self, current=None):
        """The next candidate for a session that works on shape ``current`` (None: on none), or None: all taken."""
        with self._lock:
            g = self._groups.get(current)
            if g:
                return g.popleft()
            if current in self._sessions:
                self._sessions[current] -= 1
            left = [k for k, g in self._groups.items() if g]
            if not left:
                return None
            k = next((k for k in left if not self._sessions[k]), None)
            if k is None:
                k = max(left, key=lambda k: len(self._groups[k]))
            self._sessions[k] += 1
            return self._groups[k].popleft()


class RPCRunner(Runner):
    """The servers of ``key`` at the tracker ``host:port``: one thread per server (or ``sessions``), each taking
    candidates through one session at a time from a :class:`ShapeQueue` (module docstring)."""

    SESSION_SPAN = 4  # a session's time limit, in --measure-timeout units (a --no-fork session is a fresh process)

    def __init__(self, host: str, port: int, key: str, sessions: int = 0, device: str = "cuda",
                 timeout: float = 120.0, repeat: int = 7, min_repeat_ms: int = 20, seed: int | None = None,
                 priority: int = 1, log=None):
        self.host, self.port, self.key, self.sessions = host, port, key, sessions
        self.kind, self.timeout, self.repeat, self.min_repeat_ms = device, timeout, repeat, min_repeat_ms
        self.seed = int.from_bytes(os.urandom(4), "little") if seed is None else seed
        self.priority, self.log = priority, log
        self._info = None
        self._check_so = None  # (the device helpers' library, built at the first measure; "" where it failed)
        self.device_check = True  # (False: every output back to the host, as the local and offline runners do)
        self.phases: list = []  # (per measured candidate: seconds of this side per phase, measure.measure_entry)
        self.problems = M.Problems(keep=8)  # (the shapes' inputs and references, made here once per shape and seed)

    def _tracker(self):
        from tvm import rpc

        try:
            return rpc.connect_tracker(self.host, self.port)
        except (OSError, RuntimeError) as e:
            raise QCompileError(f"rpc runner: cannot reach the tracker at {self.host}:{self.port} ({e})") from None

    def servers(self) -> int:
        """Servers of the key registered at the tracker now (busy or free)."""
        summ = self._tracker().summary()
        n = sum(1 for s in summ.get("server_info", []) if s.get("key", "").split(":")[1:2] == [self.key])
        return max(n, summ.get("queue_info", {}).get(self.key, {}).get("free", 0))

    def _session(self, tracker, span: float | None = None):
        return tracker.request(self.key, priority=self.priority, session_timeout=span or self.timeout)

    def prepare(self) -> None:
        """Ask the servers for their device and build the device helpers for it (once; ``measure`` does it)."""
        self.device()
        if self._check_so is None:
            self._check_so = self._build_helpers(self._info) if self.device_check else ""

    def _build_helpers(self, info: dict) -> str:
        """The device helpers' library for the servers' device (cached beside the tuning cache), or "" where it
        cannot be built (then the host compares)."""
        try:
            arch = info["arch"] if self.kind == "cuda" else None
            from qcompile.schedules.build import default_cache_dir

            return device_check.build(self.kind, arch, os.path.join(os.path.dirname(default_cache_dir()), "device_check"))
        except Exception as ex:  # noqa: BLE001
            if self.log:
                self.log(f"rpc runner: cannot build the device-side check ({ex}); comparing on the host")
            return ""

    def _remote_device(self, sess):
        return sess.cuda(0) if self.kind == "cuda" else sess.cpu(0)

    def device(self) -> DeviceInfo:
        if self._info is None:
            if self.servers() == 0:
                raise QCompileError(f"rpc runner: no server of key {self.key!r} at the tracker {self.host}:{self.port}")
            sess = self._session(self._tracker())
            dev = self._remote_device(sess)
            if not dev.exist:
                raise QCompileError(
                    f"rpc runner: the servers of key {self.key!r} have no {self.kind} device (a runtime-only TVM "
                    "server needs --load-library <tvm>/lib/libtvm_runtime_cuda.so --no-fork)")
            self._info = M.device_info(dev, self.kind, local=False)
        return _device_info(self._info)

    def _helpers(self, sess) -> tuple:
        """(module, partial counts) of the device helpers in session ``sess``, uploaded and loaded once per session
        (kept on the session object); (None, 0) where that fails: the candidates are then checked on the host."""
        if getattr(sess, "_qc_helpers", None) is None:
            try:
                name = os.path.basename(self._check_so)
                sess.upload(self._check_so, name)
                sess._qc_helpers = (sess.load_module(name), device_check.parts(self.kind))
            except Exception as ex:  # noqa: BLE001  (the host comparison still works)
                if self.log:
                    self.log(f"rpc runner: device-side check unavailable ({ex}); comparing on the host")
                sess._qc_helpers = (None, 0)
        return sess._qc_helpers

    def _measure_one(self, sess, entry: dict, shared: dict) -> dict:
        """One candidate through the open session ``sess``; its failure (an exception) is a run_error record."""
        seed = M.shape_seed(self.seed, entry)
        try:
            name = entry["id"] + ".so"
            t0 = time.perf_counter()
            sess.upload(entry["so"], name)
            lib = sess.load_module(name)
            load = round(time.perf_counter() - t0, 4)
            rec = M.measure_entry(lib, entry, self._remote_device(sess), seed, self.repeat,
                                  self.min_repeat_ms, poison_seed=M.candidate_seed(self.seed, entry["id"]),
                                  problems=self.problems, shared=shared)
            rec["phases"] = {"load": load, **rec.get("phases", {})}
        except Exception as e:  # noqa: BLE001  (the candidate's failure; the caller drops the session)
            rec = _run_error(entry, seed, e)
        return dict(rec, candidate=M.candidate_info(entry))

    def _worker(self, q: ShapeQueue, prefetch, done) -> None:
        """One thread: candidates from ``q`` through a session kept while at least ``timeout`` seconds of its limit
        (``SESSION_SPAN`` timeouts) remain, a shape's device buffers kept between its candidates; ``done(record)``
        for each."""
        tracker = self._tracker()
        span = self.timeout * self.SESSION_SPAN
        sess, opened, shared, shape, mine = None, 0.0, {}, None, None
        while True:
            e = q.take(mine)
            if e is None:
                return
            mine = M.spec_key(e)
            prefetch(e)
            if sess is not None and time.monotonic() - opened + self.timeout > span:
                sess, shared, shape = None, {}, None
            if sess is None:
                try:
                    sess, opened = self._session(tracker, span), time.monotonic()
                except Exception as ex:  # noqa: BLE001  (no session: this candidate's run_error)
                    done(dict(_run_error(e, M.shape_seed(self.seed, e), ex), candidate=M.candidate_info(e)))
                    continue
            if M.spec_key(e) != shape:  # (a new shape: the last one's buffers freed on the server)
                shared, shape = {}, M.spec_key(e)
            if M.DEVICE_CHECK not in shared and self._check_so:  # (the session's device helpers, loaded once)
                shared[M.DEVICE_CHECK] = self._helpers(sess)
            r = self._measure_one(sess, e, shared)
            if r["status"] == RUN_ERROR:  # (the session may be dead, or its device state spoiled)
                sess, shared, shape = None, {}, None
            elif r["status"] != OK:  # (a kernel that wrote outside its output may have spoiled the shared inputs)
                shared, shape = {}, None
            done(r)

    def measure(self, built: list[Built]) -> list[Measured]:
        entries = _entries(built, absolute=True)
        recs: dict = {}
        if entries:
            self.prepare()
            info = self._info
            n = self.sessions or max(1, self.servers())
            entries = sorted(entries, key=M.spec_key)  # (a shape's candidates in a row: its problem made once)
            q = ShapeQueue(entries, M.spec_key)
            firsts, seen = [], set()
            for e in entries:
                if M.spec_key(e) not in seen:
                    seen.add(M.spec_key(e))
                    firsts.append(e)
            ahead = max(1, self.problems.keep // 2 - n)  # (shapes drawn ahead of the ones being measured)
            self.problems.keep = max(self.problems.keep, 2 * (n + ahead))  # (in use and ahead are never evicted)
            index = {M.spec_key(e): i for i, e in enumerate(firsts)}
            for e in firsts[:n + ahead]:  # (the first shapes' problems drawn in the background)
                self.problems.prefetch(e, M.shape_seed(self.seed, e))
            lock = threading.Lock()

            def prefetch(e):
                i = index[M.spec_key(e)]
                if e is firsts[i] and i + n + ahead < len(firsts):  # (a shape begins: draw one more ahead)
                    nxt = firsts[i + n + ahead]
                    self.problems.prefetch(nxt, M.shape_seed(self.seed, nxt))

            def done(r):
                with lock:
                    recs[r["id"]] = r
                    if r.get("phases"):
                        self.phases.append(r["phases"])
                if self.log:
                    self.log(M._line(r))

            threads = [threading.Thread(target=self._worker, args=(q, prefetch, done), daemon=True) for _ in range(min(n, len(entries)))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        else:
            info = self._info
        return [to_measured(b.candidate, recs[b.entry["id"]], info) if b.error is None and b.path else _unbuilt(b)
                for b in built]


# ---------------------------------------------------------------------------------------------------------------
# offline
# ---------------------------------------------------------------------------------------------------------------
README = """A batch of qcompile tuning candidates to measure on a GPU host.

Needs Python 3 with NumPy and the TVM runtime (no compiler, no qcompile): an installed apache-tvm, or the runtime
bundle of qcompile's scripts/make_runtime_bundle.sh:

    tar xJf tvm_runtime.tar.xz -C /tmp/tvmrt
    pip install --no-index --no-deps --target /tmp/tvmrt apache_tvm_ffi-*-cp3XX-*.whl
    export PYTHONPATH=/tmp/tvmrt TVM_USE_RUNTIME_LIB=1

then, in this folder (or: sh run.sh):

    python measure.py . -o results.json

It checks every candidate bit for bit against a NumPy reference on fresh random inputs, times the exact ones, and
writes results.json; bring that file back and pass it to --import. `python measure.py --help` lists the options
(--device-id for another GPU).
"""


class OfflineBatchPending(Exception):
    """A batch was exported and awaits its measurements (``folder``, ``command``)."""

    def __init__(self, folder: str, command: str):
        super().__init__(f"batch exported to {folder}: measure it on the GPU host with `{command}` (in that folder), "
                         "then pass its results.json to --import")
        self.folder, self.command = folder, command


def export(built: list[Built], folder: str) -> str:
    """Write a self-contained batch of the built candidates to ``folder`` (new, or empty): their libraries,
    manifest.json, measure.py, run.sh, README.txt. Returns the command that measures it there."""
    entries = _entries(built, absolute=False)
    if os.path.exists(folder) and os.listdir(folder):
        raise QCompileError(f"{folder}: exists and is not empty (an export goes to a new folder)")
    os.makedirs(folder, exist_ok=True)
    by_id = {b.entry["id"]: b.path for b in built if b.error is None and b.path}
    for e in entries:
        shutil.copy2(by_id[e["id"]], os.path.join(folder, e["so"]))
    targets = sorted({e.get("target", "cuda") for e in entries}) or ["cuda"]
    with open(os.path.join(folder, "manifest.json"), "w") as f:
        json.dump(dict(format=M.FORMAT, target=targets[0], candidates=entries), f, indent=1)
    shutil.copy2(M.__file__, os.path.join(folder, "measure.py"))
    command = "python measure.py . -o results.json" + (" --device cpu" if targets == ["llvm"] else "")
    with open(os.path.join(folder, "run.sh"), "w") as f:
        f.write('#!/bin/sh\n# measure this batch: needs NumPy and the TVM runtime (README.txt)\ncd "$(dirname "$0")" && '
                + command.replace("python ", "${PYTHON:-python3} ") + ' "$@"\n')
    os.chmod(os.path.join(folder, "run.sh"), 0o755)
    with open(os.path.join(folder, "README.txt"), "w") as f:
        f.write(README)
    return command


def read_results(path: str) -> dict:
    """A measure.py results document (checked)."""
    try:
        with open(path) as f:
            doc = json.load(f)
    except FileNotFoundError:
        raise QCompileError(f"{path}: no such results file") from None
    except ValueError as e:
        raise QCompileError(f"{path}: not a JSON results file ({e})") from None
    if not isinstance(doc, dict) or doc.get("format") != M.FORMAT or not isinstance(doc.get("results"), list):
        raise QCompileError(f"{path}: not the results of qcompile's measure.py (format {M.FORMAT})")
    return doc


def import_results(path: str, built: list[Built] | None = None) -> list[Measured]:
    """The measurements of an exported batch: with ``built``, one per Built in its order (those not in the file:
    run_error "not measured"); without, one per record, the candidates rebuilt from the records."""
    doc = read_results(path)
    dev = doc.get("device")
    if built is None:
        return [to_measured(candidate_from(r["candidate"]), r, dev) for r in doc["results"]]
    recs = {r["id"]: r for r in doc["results"]}
    out = []
    for b in built:
        if b.error is not None or not b.path:
            out.append(_unbuilt(b))
        elif b.entry["id"] in recs:
            out.append(to_measured(b.candidate, recs[b.entry["id"]], dev))
        else:
            out.append(Measured(b.candidate, RUN_ERROR, None, f"not measured (not in {path})"))
    return out


class OfflineRunner(Runner):
    """``measure`` answers from the imported results where they hold every built candidate; otherwise it exports
    the batch to ``export_dir/batch_NNNN`` and raises ``OfflineBatchPending``."""

    def __init__(self, export_dir: str | None, results=(), arch: str | None = None):
        self.export_dir, self.arch = export_dir, arch
        self.docs = [read_results(p) for p in results]
        self.paths = list(results)

    def device(self) -> DeviceInfo:
        for d in self.docs:
            if d.get("device"):
                return _device_info(d["device"])
        if not self.arch:
            raise QCompileError("offline runner: no device known yet (no --import results, no --arch)")
        from qcompile.schedules.spec import arch_info

        return DeviceInfo(f"unknown {self.arch} GPU", self.arch, arch_info(self.arch).sms)

    def imported(self) -> list[Measured]:
        """Every measurement of the imported results files (a batch cut short included: measure.py rewrites its
        results after each candidate); the tuner merges those its log lacks before it proposes the next batch."""
        return [m for path in self.paths for m in import_results(path)]

    def measure(self, built: list[Built]) -> list[Measured]:
        want = {b.entry["id"] for b in built if b.error is None and b.path}
        for doc, path in zip(self.docs, self.paths):
            if want <= {r["id"] for r in doc["results"]}:
                return import_results(path, built)
        if not self.export_dir:
            raise QCompileError("offline runner: these candidates are in no --import results; --export DIR writes "
                                "them for measuring")
        os.makedirs(self.export_dir, exist_ok=True)
        n = 1
        while os.path.exists(os.path.join(self.export_dir, f"batch_{n:04d}")):
            n += 1
        folder = os.path.join(self.export_dir, f"batch_{n:04d}")
        raise OfflineBatchPending(folder, export(built, folder))
