"""Checks of the user's paths, tools and data files that run before the expensive work, and atomic output files.

Light on purpose (os, shutil, tempfile; NumPy only inside the calibration reader): the ``qcompile`` and ``qmodel``
CLIs call these before they import TVM or PyTorch, so that a wrong path or a missing tool is reported in the first
second. Every check raises :class:`~qcompile.errors.QCompileError` with one message naming the path or tool.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from typing import Iterator, Optional, Sequence

from .errors import QCompileError


def _same_file(a: str, b: str) -> bool:
    if os.path.exists(a) and os.path.exists(b):
        try:
            return os.path.samefile(a, b)
        except OSError:
            pass
    return os.path.realpath(a) == os.path.realpath(b)


def _probe_writable(folder: str) -> Optional[str]:
    """Why a new file cannot be created in ``folder`` (None: it can); tries it, since permission bits do not tell
    (root, read-only mounts, ACLs)."""
    try:
        fd, probe = tempfile.mkstemp(prefix=".qcompile-probe-", dir=folder)
    except OSError as e:
        return e.strerror or type(e).__name__
    os.close(fd)
    os.remove(probe)
    return None


def check_output_path(path: str, flag: str = "-o", inputs: Sequence[tuple] = (), suffixes: Sequence[str] = (),
                      why: str = "") -> str:
    """Refuse an output file path that cannot be written, before any work is done.

    ``inputs``: ``(option, path)`` pairs the output must not overwrite (the input model, calibration data, ...);
    ``suffixes``: the file name must end with one of them (``why``: the reason, for the message). Returns ``path``.
    """
    if not path:
        raise QCompileError(f"{flag}: empty output path")
    for opt, src in inputs:
        if src and _same_file(path, src):
            raise QCompileError(f"{flag} '{path}' is the {opt} itself; writing it would destroy it (choose another "
                                f"output path)")
    if os.path.isdir(path):
        raise QCompileError(f"{flag} '{path}' is a folder; give a file name (e.g. {os.path.join(path, 'model')}"
                            f"{suffixes[0] if suffixes else ''})")
    if suffixes and not path.lower().endswith(tuple(suffixes)):
        raise QCompileError(f"{flag} '{path}' must end with {' or '.join(suffixes)}{' ' + why if why else ''}")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        what = "is not a folder" if os.path.exists(parent) else "does not exist"
        raise QCompileError(f"{flag} '{path}': the folder '{parent}' {what}")
    why = _probe_writable(parent)
    if why:
        raise QCompileError(f"{flag} '{path}': cannot write to the folder '{parent}' ({why})")
    if os.path.exists(path) and not os.path.isfile(path):
        raise QCompileError(f"{flag} '{path}' exists and is not a regular file")
    return path


def check_output_dir(path: str, flag: str) -> str:
    """Refuse an output folder (``--emit-cuda``, ``--dump-ir``) that is a file or cannot be created / written."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise QCompileError(f"{flag} '{path}' is a file, not a folder")
    probe = os.path.abspath(path)
    while not os.path.exists(probe):  # the nearest existing ancestor decides whether it can be created
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise QCompileError(f"{flag} '{path}': '{probe}' is a file, not a folder")
    why = _probe_writable(probe)
    if why:
        raise QCompileError(f"{flag} '{path}': cannot write to '{probe}' ({why})")
    return path


def check_input_file(path: str, what: str) -> str:
    """Refuse a missing, non-regular or unreadable input file."""
    if not os.path.exists(path):
        raise QCompileError(f"{what} '{path}' does not exist")
    if os.path.isdir(path):
        raise QCompileError(f"{what} '{path}' is a folder, not a file")
    if not os.access(path, os.R_OK):
        raise QCompileError(f"{what} '{path}' is not readable (permission denied)")
    if os.path.getsize(path) == 0:
        raise QCompileError(f"{what} '{path}' is empty (0 bytes)")
    return path


def check_tuning_logs(paths: Sequence[str], gpu: Optional[str], target: str) -> None:
    """Refuse ``--tuning-log`` paths that are missing, unreadable, or folders without a ``.jsonl`` log,
    ``--tuning-log`` for a target without tunable kernels (cuda, llvm) and ``--gpu`` for one other than cuda."""
    if paths and target not in ("cuda", "llvm"):
        raise QCompileError(f"--tuning-log applies to --target cuda and llvm only (this build is for {target})")
    if gpu is not None and target != "cuda":
        raise QCompileError(f"--gpu applies to --target cuda only (this build is for {target})")
    if gpu is not None and not gpu.strip():
        raise QCompileError("--gpu: empty GPU name (give the name nvidia-smi prints, e.g. 'NVIDIA H100 80GB HBM3')")
    for path in paths:
        if not os.path.exists(path):
            raise QCompileError(f"--tuning-log '{path}' does not exist")
        if os.path.isdir(path):
            if not any(n.endswith(".jsonl") for n in os.listdir(path)):
                raise QCompileError(f"--tuning-log '{path}' is a folder with no .jsonl tuning log in it")
        elif not os.access(path, os.R_OK):
            raise QCompileError(f"--tuning-log '{path}' is not readable (permission denied)")


WEIGHTS_SUFFIX = ".weights.npz"


def weights_path(so_path: str) -> str:
    """The weights file of a ``--weights-beside`` module: ``NAME.weights.npz`` beside ``NAME.so`` (or a cross
    build's ``NAME.tar``)."""
    for suffix in (".so", ".tar"):
        if so_path.endswith(suffix):
            return so_path[:-len(suffix)] + WEIGHTS_SUFFIX
    return so_path + WEIGHTS_SUFFIX


# ------------------------------------------------------------------------------------------------
# Tools
# ------------------------------------------------------------------------------------------------
def c_compiler() -> Optional[str]:
    """The C++ compiler TVM links a module's ``.so`` with: ``$CXX`` / ``$CC`` if set, else the first of g++, gcc,
    clang++, clang, c++, cc on the PATH (the order of ``tvm.support.cc.get_cc``); None if there is none."""
    env = os.environ.get("CXX") or os.environ.get("CC")
    if env:
        return shutil.which(env)
    for cc in ("g++", "gcc", "clang++", "clang", "c++", "cc"):
        found = shutil.which(cc)
        if found:
            return found
    return None


def check_toolchain(target: str) -> dict:
    """The tools a build for ``target`` needs: a C++ compiler always (the ``.so`` is linked with it), nvcc for cuda.
    Returns ``{"cxx": path, "nvcc": path or None}``."""
    cxx = c_compiler()
    if cxx is None:
        env = os.environ.get("CXX") or os.environ.get("CC")
        if env:
            raise QCompileError(f"the C++ compiler named by $CXX/$CC ('{env}') is not found; qcompile links the .so "
                                f"with it (unset the variable or point it at g++)")
        raise QCompileError("no C++ compiler found (g++): qcompile links the .so with it; install g++ "
                            "(Debian/Ubuntu: apt install g++; Fedora: dnf install gcc-c++) or set CXX")
    nvcc = shutil.which("nvcc")
    if target == "cuda" and nvcc is None:
        raise QCompileError("--target cuda needs nvcc (the CUDA toolkit, 12.x or 13.x), which is not on the PATH; "
                            "install the CUDA toolkit and add its bin folder (e.g. /usr/local/cuda/bin) to PATH")
    return {"cxx": cxx, "nvcc": nvcc}


# ------------------------------------------------------------------------------------------------
# Atomic outputs
# ------------------------------------------------------------------------------------------------
def _temp_name(path: str) -> str:
    """A fresh file name beside ``path`` that keeps its suffix (writers pick the format from it)."""
    folder, base = os.path.split(os.path.abspath(path))
    stem, dot, ext = base.partition(".")
    fd, tmp = tempfile.mkstemp(prefix=f".{stem}.", suffix=f".partial{dot}{ext}", dir=folder)
    os.close(fd)
    return tmp


@contextlib.contextmanager
def atomic_outputs(*paths: str) -> Iterator[list]:
    """Write several files all or nothing: yields one temporary path (same folder, same suffix) per destination;
    when the block ends normally they are renamed onto their destinations, on any exception (or interrupt) they
    are removed and the destinations are left as they were."""
    tmps: list = []
    try:
        for p in paths:
            tmps.append(_temp_name(p))
        yield list(tmps)
        umask = _umask()
        for tmp, p in zip(tmps, paths):
            # mkstemp makes 0600: give the file the permissions a plain open() would (keeping a linker's x bits)
            os.chmod(tmp, (os.stat(tmp).st_mode | 0o666) & 0o777 & ~umask)
            os.replace(tmp, p)
    finally:
        for tmp in tmps:
            with contextlib.suppress(OSError):
                os.remove(tmp)


def _umask() -> int:
    """This process's umask, read without changing it (``os.umask`` sets it, which races with other threads)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022


@contextlib.contextmanager
def atomic_output(path: str) -> Iterator[str]:
    """:func:`atomic_outputs` for one file: yields the temporary path to write."""
    with atomic_outputs(path) as (tmp,):
        yield tmp


# ------------------------------------------------------------------------------------------------
# Data files
# ------------------------------------------------------------------------------------------------
def torch_load_weights_only(path: str, what: str):
    """``torch.load(path, weights_only=True)``: tensors, numbers, strings and plain containers only, so a crafted
    file cannot run code while it is read. Other content, or a corrupt file, is a QCompileError naming ``what`` and
    ``path``."""
    import pickle

    import torch

    check_input_file(path, what)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        text = str(e)
        if "weights only load failed" in text.lower() or "weights_only" in text:
            found = [ln.strip() for ln in text.splitlines() if "GLOBAL" in ln or "Unsupported" in ln]
            detail = f" ({found[0][:160]})" if found else ""
            raise QCompileError(f"{what} '{path}' holds Python objects other than tensors and plain containers"
                                f"{detail}; it is not loaded, since unpickling it could run code (save it as a dict "
                                f"of tensors)") from None
        raise QCompileError(f"cannot read {what} '{path}': file is corrupt or truncated (UnpicklingError)") from None
    except Exception as e:
        raise QCompileError(f"cannot read {what} '{path}': file is corrupt or truncated ({type(e).__name__})") from None


def read_image_array(path: str, what: str = "calibration data", channels: Optional[int] = None,
                     hw: Optional[tuple] = None, min_images: int = 1):
    """A float32 NCHW image batch from a ``.npy`` file, refused with one message naming the file where it cannot be
    used: unreadable or pickled, not 4-D, empty, not floating point, holding NaN or Inf, or of the wrong channels /
    height / width (``channels``, ``hw`` where given), or fewer than ``min_images`` images."""
    import numpy as np

    check_input_file(path, what)
    try:
        data = np.load(path, allow_pickle=False)
    except ValueError as e:
        if "allow_pickle" in str(e):
            raise QCompileError(f"{what} '{path}' holds Python objects (a pickle); only a plain numeric .npy array is "
                                f"read (loading a pickle could run code)") from None
        raise QCompileError(f"cannot read {what} '{path}': not a .npy array or the file is truncated "
                            f"({str(e).splitlines()[0][:120]})") from None
    except Exception as e:
        raise QCompileError(f"cannot read {what} '{path}': not a .npy array or the file is truncated "
                            f"({type(e).__name__})") from None
    if not isinstance(data, np.ndarray):  # an .npz archive
        data.close()
        raise QCompileError(f"{what} '{path}' is an .npz archive; expected one .npy array of NCHW images")
    if data.dtype.kind != "f":
        raise QCompileError(f"{what} '{path}' has dtype {data.dtype}; expected float32 NCHW images (convert and "
                            f"scale the pixels as the model's training did)")
    if data.ndim != 4:
        raise QCompileError(f"{what} '{path}' has shape {data.shape}; expected 4-D NCHW images (N, C, H, W)")
    if data.size == 0 or data.shape[0] == 0:
        raise QCompileError(f"{what} '{path}' is empty (shape {data.shape})")
    if channels is not None and data.shape[1] != channels:
        raise QCompileError(f"{what} '{path}' has {data.shape[1]} channels (shape {data.shape}); the model "
                            f"takes {channels}")
    if hw is not None and tuple(data.shape[2:]) != tuple(hw):
        raise QCompileError(f"{what} '{path}' has images of {data.shape[2]}x{data.shape[3]} (shape {data.shape}); "
                            f"the model takes {hw[0]}x{hw[1]}")
    if data.shape[0] < min_images:
        raise QCompileError(f"{what} '{path}' has {data.shape[0]} images; the model's fixed batch needs at least "
                            f"{min_images}")
    finite = np.isfinite(data)
    if not finite.all():
        bad = int((~finite).sum())
        first = tuple(int(i) for i in np.argwhere(~finite)[0])
        raise QCompileError(f"{what} '{path}' holds {bad} NaN/Inf value(s) (the first at index {first}); "
                            f"calibration needs finite pixels")
    return data.astype(np.float32, copy=False)


def torch_export_load(path: str, what: str = "PT2 program"):
    """``torch.export.load(path)`` with no code execution: torch.export.load unpickles weights and sample inputs with
    ``weights_only=False`` (a crafted pickle runs its code), so every ``torch.load`` inside it is made a weights_only
    load (tensors and plain containers; ``TORCH_FORCE_WEIGHTS_ONLY_LOAD``), and an archive with constants it would
    unpickle as arbitrary Python objects is refused before loading. Errors are QCompileErrors naming ``path``."""
    import logging
    import zipfile

    import torch

    check_input_file(path, what)
    if not zipfile.is_zipfile(path):
        raise QCompileError(f"cannot read {what} '{path}': file is corrupt or truncated (not a zip archive)")
    _refuse_pickled_objects(path, what)
    loggers = [logging.getLogger(n) for n in ("torch.export", "torch._export", "torch.export.pt2_archive")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)  # torch logs its own traceback (and fallbacks) before raising
    env = os.environ.get(_FORCE_WEIGHTS_ONLY)
    os.environ[_FORCE_WEIGHTS_ONLY] = "1"
    try:
        return torch.export.load(path)
    except Exception as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if "weights only load failed" in str(e).lower() or "weights_only" in msg:
            raise QCompileError(f"{what} '{path}' holds pickled Python objects other than tensors; it is not loaded "
                                f"(unpickling them could run code)") from None
        raise QCompileError(f"cannot read {what} '{path}': file is corrupt or truncated ({type(e).__name__}: "
                            f"{msg[:200]})") from None
    finally:
        if env is None:
            os.environ.pop(_FORCE_WEIGHTS_ONLY, None)
        else:
            os.environ[_FORCE_WEIGHTS_ONLY] = env
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


_FORCE_WEIGHTS_ONLY = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"


def _refuse_pickled_objects(path: str, what: str) -> None:
    """Refuse a PT2 archive with constants that torch.export.load would unpickle as arbitrary Python objects
    (``opaque_obj_*``, ``custom_obj_*``): a quantized CNN has only tensors."""
    import json
    import zipfile

    try:
        with zipfile.ZipFile(path) as z:
            names = z.namelist()
            configs = [n for n in names if n.endswith(".json") and "constants_config" in n]
            paths = [os.path.basename(n) for n in names if "/data/constants/" in n]
            for c in configs:
                try:
                    cfg = json.loads(z.read(c))
                    paths += [str(v.get("path_name", "")) for v in (cfg.get("config") or {}).values()
                              if isinstance(v, dict)]
                except (ValueError, AttributeError):
                    raise QCompileError(f"cannot read {what} '{path}': file is corrupt or truncated "
                                        f"(unreadable {c})") from None
    except (zipfile.BadZipFile, OSError) as e:
        raise QCompileError(f"cannot read {what} '{path}': file is corrupt or truncated ({e})") from None
    bad = sorted({p for p in paths if p.startswith(("opaque_obj_", "custom_obj_"))})
    if bad:
        raise QCompileError(f"{what} '{path}' holds pickled Python objects ({', '.join(bad[:3])}); it is not "
                            f"loaded (unpickling them could run code; a quantized CNN needs only tensors)")
