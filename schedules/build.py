"""Build helpers: compile TIR kernels for CUDA on a GPU-less box.

* ``cuda_target(arch)``: JSON-form TVM target for ``sm_XX``.
* The CUDA code generation of a build (TVM's ``target.build.cuda``, wrapped here): a device module with several
  kernels becomes one CUDA module per kernel, each its own translation unit (TVM's code generation of that kernel
  alone: the shared preamble with only the helpers it uses), compiled by nvcc in parallel and looked up in an
  on-disk kernel cache first. The runtime finds every kernel by name through the modules' imports; the SASS of a
  kernel is the same as in a single translation unit of the whole module (ptxas compiles each entry on its own).
  One combined image is not an option: a fatbin holds one image per arch, and relocatable device code linked by
  nvlink gives different SASS.
* A TVM CUDA compile callback (``tvm_callback_cuda_compile``) that calls nvcc with gencode flags we control: real
  SASS for the arch (``mode="sass"``), PTX only (``mode="ptx"``: the driver JITs it on a newer GPU, e.g. compute_86
  PTX on an H100), or both.
* The kernel cache (:class:`KernelCache`): nvcc's output keyed by the sha256 of the translation unit, the nvcc
  version and the flags, under ``$QCOMPILE_CACHE_DIR/kernels`` (default ``~/.cache/qcompile/kernels``); entries are
  written atomically and checked on read, so concurrent builds share it safely. ``QCOMPILE_KERNEL_CACHE=0`` (or
  ``nvcc_options(cache=False)``) turns it off; ``QCOMPILE_NVCC_JOBS`` caps the parallel nvcc processes (default: the
  cores this process may use).
* ``ensure_stub_libcuda()``: TVM embeds the compiled fatbin in an exported .so only when its CUDA runtime library
  can be loaded at build time, which needs some ``libcuda.so.1``. On a machine without a driver we compile a
  stand-in (every entry point fails) and preload it.
"""
from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import hashlib
import json
import os
import pathlib
import resource
import shutil
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import tvm
import tvm.support.nvcc  # noqa: F401  (registers TVM's own callback first; ours overrides it)
import tvm_ffi

from qcompile.runtime import load_cuda_runtime

_STUB_C = r"""
/* stand-in libcuda.so.1 for GPU-less builds: every entry point fails (CUDA_ERROR_NO_DEVICE). */
typedef int CUresult;
#define F(name) CUresult name() { return 100; }
F(cuInit) F(cuDeviceGetName) F(cuFuncSetAttribute) F(cuLaunchKernelEx) F(cuModuleGetFunction)
F(cuModuleLoadData) F(cuModuleUnload) F(cuTensorMapEncodeTiled) F(cuDriverGetVersion) F(cuDeviceGet)
F(cuDeviceGetCount) F(cuDeviceGetAttribute) F(cuCtxGetCurrent) F(cuGetProcAddress) F(cuLaunchKernel)
F(cuModuleGetGlobal)
CUresult cuGetErrorName(int e, const char** s) { *s = "CUDA_ERROR_NO_DEVICE"; return 0; }
CUresult cuGetErrorString(int e, const char** s) { *s = "stand-in libcuda (build only)"; return 0; }
"""

# nvcc settings of the builds in progress (``nvcc_options``): arch, output mode, a folder that keeps each
# translation unit and its fatbin, extra nvcc flags, one CUDA module per kernel or not, the kernel cache (None: as
# QCOMPILE_KERNEL_CACHE says), parallel nvcc processes (None: as QCOMPILE_NVCC_JOBS says, else every usable core)
# (``accel``: the units of the build in progress take the arch-specific target, e.g. sm_90a)
_STATE = {"mode": "sass", "arch": "sm_90", "keep": None, "extra": [], "split": True, "cache": None, "jobs": None,
          "accel": False}
_NVCC_FLAGS = ("--fatbin", "-O3", "-std=c++17")
_PLACEHOLDER = b"\0"  # what the compile callback returns while only the translation units are being collected


def _have_real_libcuda() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
        return True
    except OSError:
        return False


def ensure_stub_libcuda(cache_dir: str | None = None) -> str | None:
    """Make ``libcuda.so.1`` loadable in this process (a failing stand-in when there is no driver).

    Returns the stub path, or None when a real driver library is present. Must run before TVM
    loads ``libtvm_runtime_cuda.so`` (i.e. before the first ``tvm.compile`` for cuda / export)."""
    if _have_real_libcuda():
        load_cuda_runtime(required=True)
        return None
    d = pathlib.Path(cache_dir or os.path.join(tempfile.gettempdir(), "qcompile_cuda_stub"))
    d.mkdir(parents=True, exist_ok=True)
    so = d / "libcuda.so.1"
    if not so.exists():
        for cand in ("/usr/local/cuda/lib64/stubs/libcuda.so", "/usr/local/cuda/targets/x86_64-linux/lib/stubs/libcuda.so"):
            if os.path.exists(cand):
                so.write_bytes(pathlib.Path(cand).read_bytes())
                break
        else:
            (d / "stub.c").write_text(_STUB_C)
            subprocess.check_call(["gcc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(so), str(d / "stub.c")])
    ctypes.CDLL(str(so), mode=ctypes.RTLD_GLOBAL)  # satisfies the later dlopen of libcuda.so.1 by soname
    load_cuda_runtime(required=True)  # (TVM skipped it if libcuda.so.1 did not load when its CUDA backend registered)
    return str(so)


def cuda_target(arch: str = "sm_90") -> tvm.target.Target:
    return tvm.target.Target({"kind": "cuda", "arch": arch})


def _gencode(arch: str, mode: str, accel: bool = False) -> list[str]:
    """nvcc -gencode flags; ``accel``: the arch-specific feature set (``sm_90a``: wgmma), which only the GPU
    family it names runs (its PTX does not JIT to later GPUs)."""
    num = arch.split("_")[1] + ("a" if accel and not arch.endswith("a") else "")
    if mode == "sass":
        return ["-gencode", f"arch=compute_{num},code=sm_{num}"]
    if mode == "ptx":
        return ["-gencode", f"arch=compute_{num},code=compute_{num}"]
    if mode == "both":
        return ["-gencode", f"arch=compute_{num},code=[sm_{num},compute_{num}]"]
    raise ValueError(mode)


# ------------------------------------------------------------------------------------------------
# The kernel cache
# ------------------------------------------------------------------------------------------------
_ENTRY_MAGIC = b"QCKC1\n"  # an entry: magic, sha256 of the payload (hex) and a newline, the payload (nvcc's fatbin)


def default_cache_dir() -> str:
    """``$QCOMPILE_CACHE_DIR/kernels``, else ``$XDG_CACHE_HOME/qcompile/kernels``, else ``~/.cache/qcompile/kernels``."""
    root = os.environ.get("QCOMPILE_CACHE_DIR")
    if not root:
        root = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
                            "qcompile")
    return os.path.join(root, "kernels")


def kernel_cache_enabled() -> bool:
    """False where ``QCOMPILE_KERNEL_CACHE`` is 0, off, false or no."""
    return os.environ.get("QCOMPILE_KERNEL_CACHE", "1").strip().lower() not in ("0", "off", "false", "no")


class KernelCache:
    """nvcc outputs on disk, one file per key (``<root>/<key[:2]>/<key>.fatbin``).

    A write goes to a temporary file in the entry's folder and is renamed onto the entry, so a reader sees a whole
    entry or none, and concurrent writers of one key (which write the same bytes) leave a whole entry. A read checks
    the entry's checksum: a damaged entry counts as a miss and the next ``put`` replaces it. A folder that cannot be
    written makes ``put`` a no-op with one warning."""

    def __init__(self, root: str | None = None):
        self.root = os.path.abspath(root or default_cache_dir())
        self.unwritable: str | None = None  # why the folder cannot be written (then nothing is stored)

    @staticmethod
    def key(source: str, signature: str) -> str:
        """sha256 of the compiler signature (nvcc version and flags) and the translation unit."""
        h = hashlib.sha256(signature.encode())
        h.update(b"\0")
        h.update(source.encode())
        return h.hexdigest()

    def path(self, key: str) -> str:
        return os.path.join(self.root, key[:2], key + ".fatbin")

    def get(self, key: str) -> bytes | None:
        """The payload stored under ``key``; None when absent or damaged."""
        try:
            with open(self.path(key), "rb") as f:
                data = f.read()
        except OSError:
            return None
        head = len(_ENTRY_MAGIC) + 65
        if not data.startswith(_ENTRY_MAGIC) or len(data) <= head:
            return None
        payload = data[head:]
        if hashlib.sha256(payload).hexdigest().encode() + b"\n" != data[len(_ENTRY_MAGIC):head]:
            return None
        return payload

    def put(self, key: str, payload: bytes) -> None:
        if self.unwritable:
            return
        folder = os.path.dirname(self.path(key))
        tmp = None
        try:
            os.makedirs(folder, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".fatbin", dir=folder)
            with os.fdopen(fd, "wb") as f:
                f.write(_ENTRY_MAGIC + hashlib.sha256(payload).hexdigest().encode() + b"\n" + bytes(payload))
            os.replace(tmp, self.path(key))
            tmp = None
        except OSError as e:
            self.unwritable = f"{folder}: {e.strerror or e}"
            import warnings

            warnings.warn(f"qcompile: the kernel cache cannot be written ({self.unwritable}); building without it "
                          f"(set QCOMPILE_CACHE_DIR to a writable folder, or QCOMPILE_KERNEL_CACHE=0)", stacklevel=2)
        finally:
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.remove(tmp)


@dataclasses.dataclass
class BuildStats:
    """What the CUDA builds of this process did (``build_stats()``; ``reset_build_stats()`` starts over)."""
    modules: int = 0        # CUDA modules generated (one per kernel where a build splits)
    units: int = 0          # translation units compiled or found in the cache
    cache_hits: int = 0
    compiled: int = 0       # translation units nvcc compiled
    nvcc_wall_s: float = 0.0   # wall time of the nvcc phases (parallel processes overlap)
    nvcc_cpu_s: float = 0.0    # CPU time of the nvcc processes (user + system)
    codegen_s: float = 0.0     # CUDA code generation and module creation, nvcc excluded

    def as_dict(self) -> dict:
        return {k: round(v, 3) if isinstance(v, float) else v for k, v in dataclasses.asdict(self).items()}


_STATS = BuildStats()


def build_stats() -> BuildStats:
    return _STATS


def reset_build_stats() -> None:
    global _STATS
    _STATS = BuildStats()


# ------------------------------------------------------------------------------------------------
# nvcc
# ------------------------------------------------------------------------------------------------
_NVCC_VERSION: dict = {}


def nvcc_signature(flags: list) -> str:
    """What, besides the source, decides nvcc's output: its path and ``--version`` text, and the flags."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise RuntimeError("nvcc is not on the PATH: CUDA builds compile their kernels with it (install the CUDA "
                           "toolkit and add its bin folder, e.g. /usr/local/cuda/bin, to PATH)")
    real = os.path.realpath(nvcc)
    if real not in _NVCC_VERSION:
        r = subprocess.run([nvcc, "--version"], capture_output=True, text=True)
        _NVCC_VERSION[real] = r.stdout.strip()
    return json.dumps({"nvcc": real, "version": _NVCC_VERSION[real], "flags": list(flags)})


def _flags(code: str) -> list:
    """nvcc's flags for one translation unit (``-o`` and the file excepted)."""
    gencode = _gencode(_STATE["arch"], _STATE["mode"], accel=_STATE["accel"] or "wgmma." in code)
    return [*_NVCC_FLAGS, *gencode, *_STATE["extra"]]


def _run_nvcc(code: str, flags: list, name: str) -> bytes:
    """Compile one translation unit; returns its fatbin."""
    with tempfile.TemporaryDirectory(prefix="qcompile-nvcc-") as td:
        cu, out = os.path.join(td, "k.cu"), os.path.join(td, "k.fatbin")
        with open(cu, "w") as f:
            f.write(code)
        cmd = ["nvcc", *flags[:1], "-o", out, cu, *flags[1:]]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            errs = [ln for ln in r.stderr.splitlines() if " error" in ln or ln.startswith("error")]
            if _STATE["keep"]:  # the failing source, for reading
                pathlib.Path(_STATE["keep"]).mkdir(parents=True, exist_ok=True)
                (pathlib.Path(_STATE["keep"]) / "failed_kernel.cu").write_text(code)
            raise RuntimeError(f"nvcc failed on {name}:\n" + "\n".join(errs[:20]) + "\n...\n" + r.stderr[-2000:]
                               + "\n" + " ".join(cmd))
        with open(out, "rb") as f:
            return f.read()


def _children_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def _cache() -> KernelCache | None:
    want = _STATE["cache"]
    if want is None:
        want = kernel_cache_enabled()
    if want is False:
        return None
    if isinstance(want, KernelCache):
        return want
    root = want if isinstance(want, str) else default_cache_dir()
    cached = _CACHES.get(root)
    if cached is None:
        cached = _CACHES[root] = KernelCache(root)
    return cached


_CACHES: dict = {}


def nvcc_jobs() -> int:
    n = _STATE["jobs"] or os.environ.get("QCOMPILE_NVCC_JOBS")
    if n:
        try:
            return max(1, int(n))
        except ValueError:
            raise ValueError(f"QCOMPILE_NVCC_JOBS must be a positive integer, got {n!r}") from None
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return os.cpu_count() or 1


def compile_units(units: list, names: list | None = None) -> list:
    """nvcc over several translation units, in parallel, each looked up in the kernel cache first; returns their
    fatbins in order. ``names`` (one per unit) go into error messages."""
    names = names or [f"unit {i}" for i in range(len(units))]
    cache = _cache()
    out: list = [None] * len(units)
    todo = []
    seen: dict = {}
    for i, code in enumerate(units):
        flags = _flags(code)
        key = KernelCache.key(code, nvcc_signature(flags))
        if key in seen:  # (the same unit twice: compiled once)
            todo.append((i, None, None, seen[key]))
            continue
        data = cache.get(key) if cache else None
        _STATS.units += 1
        if data is not None:
            _STATS.cache_hits += 1
            out[i] = data
        else:
            seen[key] = i
            todo.append((i, flags, key, None))
    work = sorted((t for t in todo if t[3] is None), key=lambda t: -len(units[t[0]]))  # (longest first)
    if work:
        t0, c0 = time.perf_counter(), _children_cpu()

        def one(t):
            i, flags, key, _ = t
            data = _run_nvcc(units[i], flags, names[i])
            if cache:
                cache.put(key, data)
            return i, data

        jobs = min(nvcc_jobs(), len(work))
        if jobs == 1:
            results = [one(t) for t in work]
        else:
            with ThreadPoolExecutor(jobs) as ex:
                results = list(ex.map(one, work))
        for i, data in results:
            out[i] = data
        _STATS.compiled += len(work)
        _STATS.nvcc_wall_s += time.perf_counter() - t0
        _STATS.nvcc_cpu_s += _children_cpu() - c0  # (the nvcc processes are this process's only children meanwhile)
    for i, _, _, src in todo:
        if src is not None:
            out[i] = out[src]
    return out


# ------------------------------------------------------------------------------------------------
# TVM's hooks: the compile callback and the CUDA module builder
# ------------------------------------------------------------------------------------------------
_COLLECT: dict = {"units": None, "ready": {}}  # translation units being collected; compiled ones by source


@tvm_ffi.register_global_func("tvm_callback_cuda_compile", override=True)
def _compile_cb(code, *_unused):
    units = _COLLECT["units"]
    if units is not None:  # (first pass of a split build: the source is all that is wanted)
        units.append(code)
        return bytearray(_PLACEHOLDER)
    data = _COLLECT["ready"].get(code)
    if data is None:
        data = compile_units([code])[0]
    if _STATE["keep"]:
        _keep(code, data)
    return bytearray(data)


def _keep(code: str, data: bytes) -> None:
    """Write a compiled unit to the ``keep`` folder: ``kernel.cu`` / ``kernel.fatbin`` for a build of one unit,
    ``<kernel name>.cu`` / ``.fatbin`` per unit where a build splits."""
    keep = pathlib.Path(_STATE["keep"])
    keep.mkdir(parents=True, exist_ok=True)
    stem = _COLLECT.get("stem") or "kernel"
    (keep / f"{stem}.cu").write_text(code)
    (keep / f"{stem}.fatbin").write_bytes(bytes(data))


def _is_kernel(func) -> bool:
    conv = func.attrs.get("calling_conv") if func.attrs is not None else None
    return conv is not None and int(conv) == int(tvm.ir.CallingConv.DEVICE_KERNEL_LAUNCH)


def _tvm_build_cuda():
    """TVM's own ``target.build.cuda`` (kept under another name when ours replaces it)."""
    orig = tvm_ffi.get_global_func("qcompile.tvm_target_build_cuda", allow_missing=True)
    if orig is None:
        orig = tvm_ffi.get_global_func("target.build.cuda")
        tvm_ffi.register_global_func("qcompile.tvm_target_build_cuda", orig)
    return orig


_TVM_BUILD_CUDA = _tvm_build_cuda()


@tvm_ffi.register_global_func("target.build.cuda", override=True)
def _build_cuda_module(mod, target):
    """``target.build.cuda``: one CUDA module per kernel of ``mod`` (the first imports the others), compiled in
    parallel through the kernel cache. A module of one kernel, a module with device functions besides its kernels
    (they would have to share a unit) or ``nvcc_options(split=False)``: TVM's one module."""
    t0 = time.perf_counter()
    nvcc0 = _STATS.nvcc_wall_s
    funcs = sorted(mod.functions.items(), key=lambda kv: kv[0].name_hint)
    try:
        if len(funcs) <= 1 or not _STATE["split"] or not all(_is_kernel(f) for _, f in funcs):
            _STATS.modules += 1
            _COLLECT["stem"] = None
            return _TVM_BUILD_CUDA(mod, target)
        # (the wgmma kernels need the arch-specific target, sm_90a: every unit of a build takes it when one does,
        # as a single unit of the whole module would)
        groups = [tvm.IRModule({gv: f}, attrs=mod.attrs) for gv, f in funcs]
        units: list = []
        _COLLECT["units"] = units
        try:
            for g in groups:
                _TVM_BUILD_CUDA(g, target)
        finally:
            _COLLECT["units"] = None
        names = [gv.name_hint for gv, _ in funcs]
        accel = _STATE["accel"]
        _STATE["accel"] = any("wgmma." in u for u in units)
        try:
            _COLLECT["ready"] = dict(zip(units, compile_units(units, names)))
            mods = []
            for (gv, _), g in zip(funcs, groups):
                _COLLECT["stem"] = gv.name_hint
                mods.append(_TVM_BUILD_CUDA(g, target))
        finally:
            _STATE["accel"] = accel
            _COLLECT["ready"], _COLLECT["stem"] = {}, None
        for m in mods[1:]:
            mods[0].import_module(m)
        _STATS.modules += len(mods)
        return mods[0]
    finally:
        _STATS.codegen_s += time.perf_counter() - t0 - (_STATS.nvcc_wall_s - nvcc0)


@contextlib.contextmanager
def nvcc_options(arch: str = "sm_90", mode: str = "sass", keep: str | None = None, extra=(), split: bool = True,
                 cache=None, jobs: int | None = None):
    """nvcc settings for the CUDA builds inside the block: ``arch`` (sm_XX), ``mode`` (sass / ptx / both), ``keep``
    (a folder that receives each translation unit and its fatbin), ``extra`` nvcc flags, ``split`` (one CUDA module
    per kernel, compiled in parallel; False: one module, one nvcc), ``cache`` (None: as ``QCOMPILE_KERNEL_CACHE``
    says; False: off; True: the default folder; a folder or a :class:`KernelCache`), ``jobs`` (parallel nvcc
    processes; None: ``QCOMPILE_NVCC_JOBS`` or every usable core)."""
    if mode not in ("sass", "ptx", "both"):
        raise ValueError(f"nvcc mode {mode!r}: one of sass, ptx, both")
    old = dict(_STATE)
    _STATE.update(arch=arch, mode=mode, keep=keep, extra=list(extra), split=split, cache=cache, jobs=jobs)
    try:
        yield
    finally:
        _STATE.clear()
        _STATE.update(old)


@contextlib.contextmanager
def fast_tvmscript_macros():
    """Inside the block, a TVMScript macro call (``T.macro``, which the kernel builders use throughout) finds its
    parser by walking the caller frames' globals, as TVM does, without ``inspect.getouterframes``, which also reads
    every frame's source lines: that read is about half of a tensor-core kernel's construction time. The parser
    found is the same; the PrimFuncs are the same."""
    import sys

    from tvm.script.parser.core.parser import ScriptMacro

    name = getattr(ScriptMacro, "parser_object_name", None)
    orig = ScriptMacro.__dict__.get("_find_parser_def")
    if name is None or orig is None:  # (a TVM without this lookup: nothing to replace)
        yield
        return

    def _find_parser_def(self):
        f = sys._getframe(0)
        while f is not None:
            parser = f.f_globals.get(name)
            if parser is not None:
                return parser
            f = f.f_back
        raise RuntimeError(f"{name} not available")

    ScriptMacro._find_parser_def = _find_parser_def
    try:
        yield
    finally:
        ScriptMacro._find_parser_def = orig


def build_cuda(func: tvm.tirx.PrimFunc, arch: str = "sm_90", mode: str = "sass", keep: str | None = None,
               name: str = "main"):
    """Compile one PrimFunc for CUDA; returns the runtime module (export with ``.export_library``)."""
    ensure_stub_libcuda()
    func = func.with_attr("global_symbol", name)
    mod = tvm.IRModule({name: func})
    with nvcc_options(arch, mode, keep):
        return tvm.compile(mod, target=cuda_target(arch))


def cuda_modules(rt_mod) -> list:
    """Every CUDA module under a built module (an executable or a runtime module), in import order."""
    m = rt_mod.mod if hasattr(rt_mod, "mod") else rt_mod
    out, todo = [], [m]
    while todo:
        cur = todo.pop(0)
        if cur.kind == "cuda":
            out.append(cur)
        todo.extend(cur.imports)
    return out


def cuda_source(rt_mod) -> str:
    """The CUDA source of a build: each CUDA module's translation unit, in import order."""
    parts = []
    for m in cuda_modules(rt_mod):
        try:
            parts.append(m.inspect_source())
        except Exception:  # noqa: BLE001
            continue
    return "\n".join(parts)
