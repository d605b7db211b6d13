"""Running a compiled ``.so`` with the TVM runtime alone (no compiler): the ``qrun`` command.

Only ``tvm.runtime`` is imported here, so this module works on a host that has the runtime-only TVM
bundle (``scripts/make_runtime_bundle.sh``, ``TVM_USE_RUNTIME_LIB=1``).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

# The function every qcompile .so carries: it returns the module's metadata (input name and shape, layout, bits,
# target, weights) as JSON bytes. The compiler adds it (qcompile.pipeline); Module reads it.
META_FUNC = "qcompile_meta"


class RunError(Exception):
    pass


def load_cuda_runtime(required: bool = False) -> bool:
    """Load TVM's CUDA runtime library (``libtvm_runtime_cuda.so``, beside ``libtvm_runtime.so``) into this process.

    It registers the CUDA module loader and device API. The full TVM loads it when it registers its CUDA backend and
    skips it silently where ``libcuda.so.1`` does not load at that moment; runtime-only TVM
    (``TVM_USE_RUNTIME_LIB=1``) does not load it. Without it a ``.so``'s CUDA kernels do not load, and a CUDA build
    gets a source-only module. Returns whether the library is loaded; ``required``: raise instead of returning False
    (no TVM runtime library, no CUDA runtime beside it, or no CUDA driver on this host)."""
    import ctypes
    import pathlib

    from tvm.base import _LOADED_LIBS  # the handles of the TVM libraries loaded so far

    if "tvm_runtime_cuda" in _LOADED_LIBS:
        return True
    try:
        lib = pathlib.Path(_LOADED_LIBS["tvm_runtime"]._name).resolve().parent / "libtvm_runtime_cuda.so"
        _LOADED_LIBS["tvm_runtime_cuda"] = ctypes.CDLL(str(lib), mode=ctypes.RTLD_LOCAL)
    except (KeyError, OSError):
        if required:
            raise
        return False
    return True


def weights_digest(weights) -> str:
    """sha256 over the weight arrays (dtype, shape, bytes), in order: what a ``--weights-beside`` module records and
    ``Module`` checks its weights file against (equal shapes are not enough: the kernels of one batch size may take
    some weights in a permuted order, e.g. 8-bit ``agl`` records)."""
    import hashlib

    h = hashlib.sha256()
    for w in weights:
        w = np.ascontiguousarray(w)
        h.update(f"{w.dtype.str}{w.shape};".encode())
        h.update(w.tobytes())
    return h.hexdigest()


class Module:
    """A loaded qcompile ``.so``: ``Module(path)(x) -> logits``."""

    def __init__(self, path: str, device: str | None = None, weights: str | None = None):
        import tvm
        from tvm.runtime.vm import VirtualMachine

        if not os.path.isfile(path):
            raise RunError(f"compiled module '{path}' does not exist")
        try:
            lib = tvm.runtime.load_module(path)
        except Exception:
            load_cuda_runtime()  # (a CUDA module: TVM may not have loaded its CUDA runtime)
            try:
                lib = tvm.runtime.load_module(path)
            except Exception as e:
                raise RunError(f"cannot load '{path}': {str(e).strip().splitlines()[-1]}") from None
        cpu = VirtualMachine(lib, tvm.cpu())
        try:
            self.meta = json.loads(bytes(cpu[META_FUNC]().numpy()).decode())
        except Exception:
            raise RunError(f"'{path}' is not a qcompile module (no {META_FUNC})") from None
        device = device or ("cuda" if self.meta.get("target") == "cuda" else "cpu")
        self.dev = tvm.cuda(0) if device == "cuda" else tvm.cpu(0)
        self.vm = VirtualMachine(lib, self.dev) if device != "cpu" else cpu
        self.tvm = tvm
        self.weights = []
        if self.meta.get("weights") == "beside":  # NAME.weights.npz beside NAME.so
            wp = weights or ((path[:-3] if path.endswith(".so") else path) + ".weights.npz")
            if not os.path.isfile(wp):
                raise RunError(f"'{path}' keeps its weights beside it, but '{wp}' does not exist")
            with np.load(wp) as z:
                n = self.meta.get("num_weights", len(z.files))
                try:
                    arrays = [z[f"w{i}"] for i in range(n)]
                except KeyError as e:
                    raise RunError(f"weights file '{wp}' lacks {e}") from None
            if "weights_sha256" in self.meta and weights_digest(arrays) != self.meta["weights_sha256"]:
                raise RunError(f"weights file '{wp}' does not match '{path}': it holds other weights, or those of a "
                               f"build whose kernels take some weights in another order (tuned per batch size: 4-bit "
                               f"w8, 8-bit agl) -- use the weights file written with this module")
            self.weights = [tvm.runtime.tensor(w, self.dev) for w in arrays]

    def check_input(self, x: np.ndarray) -> np.ndarray:
        want = tuple(self.meta["input_shape"])
        if x.dtype != np.float32:
            if np.issubdtype(x.dtype, np.floating):
                x = x.astype(np.float32)
            else:
                raise RunError(f"input '{self.meta['input_name']}' must be float32 NCHW images, got dtype {x.dtype}")
        if tuple(x.shape) != want:
            raise RunError(f"input '{self.meta['input_name']}' has shape {tuple(x.shape)}, the module was compiled for "
                           f"{want} (float32 NCHW; recompile with --batch N for another batch size)")
        return np.ascontiguousarray(x)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        x = self.check_input(np.asarray(x))
        out = self.vm["main"](self.tvm.runtime.tensor(x, self.dev), *self.weights)
        return out.numpy()


def qrun_main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="qrun", description="Run a qcompile .so on one input with the TVM runtime only.")
    ap.add_argument("module", help="compiled .so from qcompile")
    ap.add_argument("--input", required=True, help=".npy file of float32 NCHW images")
    ap.add_argument("--output", help="write the output (float logits) to this .npy file")
    ap.add_argument("--device", choices=["cpu", "cuda"], help="default: the module's target")
    ap.add_argument("--time", type=int, default=0, metavar="N", help="also time N runs and print the median")
    a = ap.parse_args(argv)
    try:
        if not os.path.isfile(a.input):
            raise RunError(f"input file '{a.input}' does not exist")
        try:
            x = np.load(a.input, allow_pickle=False)
        except Exception as e:
            raise RunError(f"cannot read input '{a.input}' as .npy ({type(e).__name__}: {e})") from None
        m = Module(a.module, a.device)
        y = m(x)
        if a.time:
            import time

            ts = []
            for _ in range(a.time):
                t0 = time.perf_counter()
                m(x)
                ts.append(time.perf_counter() - t0)
            print(f"median {1e3 * sorted(ts)[len(ts) // 2]:.3f} ms over {a.time} runs")
    except RunError as e:
        print(f"qrun: error: {e}", file=sys.stderr)
        return 2
    if a.output:
        np.save(a.output, y)
    print(f"output {a.output or ''} shape {tuple(y.shape)} dtype {y.dtype}; top-1 per image: {np.argmax(y.reshape(y.shape[0], -1), axis=1).tolist()}")
    return 0


if __name__ == "__main__":
    sys.exit(qrun_main())
