"""Where the prototype's kernels run: ``CupyBackend`` (the GPU: bottleneck.cu built with nvcc into a cubin, NVRTC
where nvcc is absent; launches, CUDA-graph timing) and ``FakeBackend`` (``run.py --dry-run``: the same calls on host
arrays, each kernel replaced by the NumPy reference computed from exactly the arguments the kernel gets, so the
harness -- argument order, parameter packing, poisoning, checks, JSON -- runs here without a GPU)."""
from __future__ import annotations

import pathlib
import re
import shutil
import subprocess
import tempfile
import time

import numpy as np

import reference as R

CU = pathlib.Path(__file__).resolve().parent / "bottleneck.cu"
NTHREADS = 256
KERNELS = ("fused_bottleneck", "fused_bottleneck_7x8", "k1_conv1x1", "k2_conv3x3", "k3_conv1x1_res")
SMEM_NAME = {"fused_bottleneck": "SMEM_FUSED", "fused_bottleneck_7x8": "SMEM_F7", "k1_conv1x1": "SMEM_K1",
             "k2_conv3x3": "SMEM_K2", "k3_conv1x1_res": "SMEM_K3"}
TWO_CTAS = ("fused_bottleneck_7x8", "k1_conv1x1", "k2_conv3x3", "k3_conv1x1_res")  # __launch_bounds__(256, 2)


def cu_defines(path: pathlib.Path = CU) -> dict:
    """The integer ``#define``s of bottleneck.cu, evaluated in order (tile sizes, parameter offsets, shared memory)."""
    env: dict = {}
    for line in path.read_text().splitlines():
        m = re.match(r"#define\s+(\w+)\s+(.+)", line)
        if not m:
            continue
        expr = m.group(2).split("//")[0].strip().replace("/", "//")
        try:
            env[m.group(1)] = int(eval(expr, {"__builtins__": {}}, dict(env)))  # noqa: S307 (our own file)
        except (NameError, SyntaxError, TypeError):
            pass
    return env


def pack_params(blk: R.Block, d: dict) -> np.ndarray:
    """The kernels' int32 parameter array (offsets P_* of bottleneck.cu): bias and M per channel as words, the
    shifts sh = S - 32 as bytes from word P_SH (conv i's at byte P_SHi)."""
    R.kernel_rq2(blk)  # (S in 33..62: sh fits a byte)
    p = np.zeros(d["P_WORDS"], np.int32)
    sh = p[d["P_SH"]:].view(np.uint8)
    for i, c in ((1, blk.conv1), (2, blk.conv2), (3, blk.conv3)):
        for name, a in (("B", c.b), ("M", c.M)):
            p[d[f"P_{name}{i}"]:d[f"P_{name}{i}"] + a.size] = a
        sh[d[f"P_SH{i}"]:d[f"P_SH{i}"] + c.S.size] = c.S - 32
    return p


def unpack_block(d: dict, w1, w2, w3, params, zo1: int, zo2: int, zo3: int, zo_out: int, rq=(0, 1, 0, 1, 1)
                 ) -> R.Block:
    """The inverse of ``pack_params`` plus the kernels' weight buffers and residual-stage arguments ``rq`` (c1, R1,
    c2, R2, SR): what a kernel sees, as a Block."""
    p = np.asarray(params)
    sh = p[d["P_SH"]:].view(np.uint8)

    def conv(i, w, zo, lo):
        K = w.shape[0]
        g = (lambda n: p[d[f"P_{n}{i}"]:d[f"P_{n}{i}"] + K].copy())
        S = sh[d[f"P_SH{i}"]:d[f"P_SH{i}"] + K].astype(np.int32) + 32
        return R.Conv(w=w, b=g("B"), M=g("M"), S=S, zo=zo, lo=lo)

    rq2 = np.repeat(np.asarray(rq, np.int32)[:, None], R.C_IN, axis=1)
    return R.Block(conv1=conv(1, np.asarray(w1).reshape(R.C_MID, 1, 1, R.C_IN), zo1, zo1),
                   conv2=conv(2, np.asarray(w2).reshape(R.C_MID, 3, 3, R.C_MID), zo2, zo2),
                   conv3=conv(3, np.asarray(w3).reshape(R.C_IN, 1, 1, R.C_MID), zo3, -128), rq2=rq2, zo_out=zo_out)


def tiles(name: str, n: int, d: dict) -> int:
    """How many tiles kernel ``name`` loops over at batch n."""
    if name in ("fused_bottleneck", "k2_conv3x3"):
        return n * d["TILES_PER_IMG"]
    if name == "fused_bottleneck_7x8":
        return n * d["TILES7_PER_IMG"]
    return -(-n * d["IMG"] * d["IMG"] // d["FLAT_PX"])


# ---------------------------------------------------------------------------------------------------------------
# the GPU
# ---------------------------------------------------------------------------------------------------------------
class CupyBackend:
    """bottleneck.cu's kernels on the current CUDA device (CuPy)."""

    def __init__(self, d: dict):
        import cupy as cp

        self.cp, self.d = cp, d
        dev = cp.cuda.Device()
        self.props = cp.cuda.runtime.getDeviceProperties(dev.id)
        cc = int(dev.compute_capability)
        if cc < 80:
            raise SystemExit(f"device compute capability {cc}: the kernels need sm_80+ (mma.sync s8, cp.async)")
        self.module, self.build = self._build(cc)
        self.k = {name: self.module.get_function(name) for name in KERNELS}
        self.smem = self._smem_sizes()
        self.grid_per_sm = {}
        for name in KERNELS:
            self._set_smem(self.k[name], self.smem[name])
            self.grid_per_sm[name] = self._blocks_per_sm(name)

    def _set_smem(self, kern, nbytes: int) -> None:
        """Opt in to ``nbytes`` of dynamic shared memory (over 48 KB needs it)."""
        try:
            kern.max_dynamic_shared_size_bytes = nbytes
        except AttributeError:  # (older CuPy: the driver call)
            drv = self.cp.cuda.driver
            drv.funcSetAttribute(kern.kernel.ptr, drv.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, nbytes)

    def _build(self, cc: int):
        """nvcc -cubin where nvcc is on PATH (its -Xptxas -v log kept), else NVRTC (CuPy picks the arch)."""
        cp = self.cp
        nvcc = shutil.which("nvcc")
        if nvcc:
            out = pathlib.Path(tempfile.mkdtemp()) / "bottleneck.cubin"
            cmd = [nvcc, f"-arch=sm_{cc}", "-std=c++17", "-cubin", "-Xptxas", "-v", "-o", str(out), str(CU)]
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode == 0:
                return cp.RawModule(path=str(out)), dict(compiler=" ".join(cmd), ptxas=r.stderr.strip())
            print(f"nvcc failed ({r.returncode}), using NVRTC:\n{r.stderr[-2000:]}")
        return cp.RawModule(code=CU.read_text(), options=("-std=c++17",)), dict(compiler="nvrtc -std=c++17")

    def _smem_sizes(self) -> dict:
        """Each kernel's dynamic shared memory as the device code computes it (checked against run.py's parse)."""
        cp = self.cp
        out = cp.zeros(len(KERNELS), cp.int32)
        self.module.get_function("smem_sizes")((1,), (1,), (out,))
        got = dict(zip(KERNELS, (int(v) for v in out.get())))
        want = {name: self.d[SMEM_NAME[name]] for name in KERNELS}
        if got != want:
            raise SystemExit(f"shared memory sizes: device {got}, parsed from bottleneck.cu {want}")
        return got

    def _blocks_per_sm(self, name: str) -> int:
        """Resident CTAs per SM from registers, shared memory and threads (the persistent grid's multiple)."""
        a, p = self.k[name].attributes, self.props
        per_warp = -(-a["num_regs"] * 32 // 256) * 256
        by_regs = p.get("regsPerMultiprocessor", 65536) // (NTHREADS // 32 * per_warp)
        need = self.smem[name] + a["shared_size_bytes"] + p.get("reservedSharedMemPerBlock", 1024)
        by_smem = p.get("sharedMemPerMultiprocessor", 233472) // need
        by_threads = p.get("maxThreadsPerMultiProcessor", 2048) // NTHREADS
        return max(1, min(by_regs, by_smem, by_threads))

    def device(self) -> dict:
        p = self.props
        name = p["name"].decode() if isinstance(p["name"], bytes) else str(p["name"])
        return dict(name=name, sms=int(p["multiProcessorCount"]), cupy=self.cp.__version__, **self.build)

    def kernel_info(self, name: str) -> dict:
        a = self.k[name].attributes
        return dict(regs=a["num_regs"], local_bytes=a["local_size_bytes"], static_smem=a["shared_size_bytes"],
                    dynamic_smem=self.smem[name], blocks_per_sm=self.grid_per_sm[name])

    def grid(self, name: str, n: int) -> int:
        return min(tiles(name, n, self.d), int(self.props["multiProcessorCount"]) * self.grid_per_sm[name])

    def put(self, a):
        return self.cp.asarray(np.ascontiguousarray(a))

    def get(self, a) -> np.ndarray:
        return self.cp.asnumpy(a)

    def empty(self, shape, dtype=np.int8):
        return self.cp.empty(shape, dtype)

    def fill(self, a, byte: int) -> None:
        a.view(self.cp.uint8).fill(byte)

    def copy(self, dst, src) -> None:
        dst[...] = src

    def launch(self, name: str, n: int, args: tuple) -> None:
        args = tuple(np.int32(a) if isinstance(a, int) else a for a in args)
        self.k[name]((self.grid(name, n),), (NTHREADS,), args, shared_mem=self.smem[name])

    def sync(self) -> None:
        self.cp.cuda.Device().synchronize()

    def mismatches(self, a, b) -> int:
        return int(self.cp.count_nonzero(a != b))

    def time(self, fn, reps: int, inner: int, warmup: int) -> tuple:
        """Per-call microseconds of ``fn`` (one or more launches): ``reps`` samples, each ``inner`` calls between
        two CUDA events -- replayed as one CUDA graph where stream capture works, else launched from Python."""
        cp = self.cp
        stream, graph, method = cp.cuda.Stream(non_blocking=True), None, "cuda_graph"
        try:
            with stream:
                stream.begin_capture()
                for _ in range(inner):
                    fn()
                graph = stream.end_capture()
        except Exception as e:  # (capture unsupported: time the launches themselves)
            stream, method = cp.cuda.Stream(non_blocking=True), f"python_launches ({type(e).__name__}: {e})"

        def once():
            if graph is not None:
                graph.launch(stream)
            else:
                for _ in range(inner):
                    fn()

        start, end, out = cp.cuda.Event(), cp.cuda.Event(), []
        with stream:
            for _ in range(warmup):
                once()
            stream.synchronize()
            for _ in range(reps):
                start.record(stream)
                once()
                end.record(stream)
                end.synchronize()
                out.append(cp.cuda.get_elapsed_time(start, end) * 1e3 / inner)
        return out, method


# ---------------------------------------------------------------------------------------------------------------
# the dry run's stand-in
# ---------------------------------------------------------------------------------------------------------------
class FakeBackend(CupyBackend):
    """Host arrays; a launch computes what the kernel must write from its own arguments (NumPy reference).
    ``corrupt``: the fused kernel's output gets one wrong byte (the harness must report it)."""

    def __init__(self, d: dict, corrupt: bool = False):
        self.d, self.corrupt = d, corrupt
        self.smem = {name: d[SMEM_NAME[name]] for name in KERNELS}

    def device(self) -> dict:
        return dict(name="fake (dry run: NumPy stand-ins for the kernels)", sms=132)

    def kernel_info(self, name: str) -> dict:
        return dict(dynamic_smem=self.smem[name])

    def grid(self, name: str, n: int) -> int:
        return min(tiles(name, n, self.d), 132)

    def put(self, a):
        return np.ascontiguousarray(a).copy()

    def get(self, a) -> np.ndarray:
        return np.asarray(a).copy()

    def empty(self, shape, dtype=np.int8):
        return np.empty(shape, dtype)

    def fill(self, a, byte: int) -> None:
        a.view(np.uint8).fill(byte)

    def sync(self) -> None:
        pass

    def mismatches(self, a, b) -> int:
        return int(np.count_nonzero(a != b))

    def launch(self, name: str, n: int, args: tuple) -> None:
        d = self.d
        if name in ("fused_bottleneck", "fused_bottleneck_7x8"):
            x, w1, w2, w3, p, out, nn, zo1, zo2, zo3, zo_out, *rq = args
            blk = unpack_block(d, w1, w2, w3, p, zo1, zo2, zo3, zo_out, rq)
            out[...] = R.reference(blk, x[:nn], threads=2)["out"]
            if self.corrupt and name == "fused_bottleneck":
                out.reshape(-1)[12345] ^= 1
        elif name == "k1_conv1x1":
            x, w1, p, y1, nn, zo1 = args
            blk = unpack_block(d, w1, np.zeros((64, 576), np.int8), np.zeros((256, 64), np.int8), p, zo1, 0, 0, 0)
            c = blk.conv1
            y1[...] = R.measure.reference_storage(blk.spec(1, nn), x[:nn], c.w, c.b, c.M, c.S, threads=2)
        elif name == "k2_conv3x3":
            y1, w2, p, y2, nn, zo1, zo2 = args
            blk = unpack_block(d, np.zeros((64, 256), np.int8), w2, np.zeros((256, 64), np.int8), p, zo1, zo2, 0, 0)
            c = blk.conv2
            y2[...] = R.measure.reference_storage(blk.spec(2, nn), y1[:nn], c.w, c.b, c.M, c.S, threads=2)
        elif name == "k3_conv1x1_res":
            y2, x, w3, p, out, nn, zo3, zo_out, *rq = args
            blk = unpack_block(d, np.zeros((64, 256), np.int8), np.zeros((64, 576), np.int8), w3, p, 0, 0, zo3,
                               zo_out, rq)
            c = blk.conv3
            out[...] = R.measure.reference_storage(blk.spec(3, nn), y2[:nn], c.w, c.b, c.M, c.S,
                                                   res_log=(x[:nn], blk.rq2), threads=2)
        else:
            raise KeyError(name)

    def time(self, fn, reps: int, inner: int, warmup: int) -> tuple:
        out = []
        for _ in range(min(reps, 2)):
            t = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t) * 1e6)
        return out, "fake (host wall clock of the NumPy stand-ins; not a GPU time)"
