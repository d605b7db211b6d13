"""Running a compiled ``.so`` with the TVM runtime alone (no compiler): the ``qrun`` command and ``Module``.

This module loads ``libtvm_runtime`` through ``tvm_ffi`` and imports neither TVM's Python package (``Module.vm``
aside) nor its compiler library, torch or onnx (``scripts/make_runtime_bundle.sh`` packs what it needs for a host
without the compiler). Where the caller has imported ``tvm`` already, the libraries it loaded are reused.

A ``.so`` is native code: loading one runs code in it, as loading any shared library does, so load only modules you
built or trust. Before loading a file, ``Module`` checks that it is an ELF shared library for this host, that every
header and section the file describes lies inside it, and that it carries a qcompile module (TVM's module data with
the ``qcompile_meta`` metadata): a truncated or foreign file gets a message instead of a crash. These checks catch
accidents, not a crafted file.
"""
from __future__ import annotations

import argparse
import json
import os
import struct
import sys
from dataclasses import asdict, dataclass

# The function every qcompile .so carries: it returns the module's metadata (input name, shape, dtype, layout and
# quantization, layout, bits, target, weights) as JSON bytes. The compiler adds it (qcompile.pipeline); Module reads it.
META_FUNC = "qcompile_meta"

# What a module's input can be (qcompile --input-dtype / --input-layout): float32 images, quantized inside the module,
# or images already quantized with the model's input scale and zero point (InputQuant); NCHW or channels last.
INPUT_DTYPES = ("float32", "int8", "uint8")
INPUT_LAYOUTS = ("NCHW", "NHWC")

# The exported symbol under which TVM stores a module's serialized data (the Relax VM executable, its constants --
# the metadata JSON among them -- and any CUDA kernels).
_LIBRARY_BIN = b"__tvm_ffi__library_bin"
_META_PREFIX = b'{"qcompile": '  # how the metadata JSON starts (pipeline: json.dumps of a dict whose first key it is)

# ELF e_machine values: what the message names, and this host's.
_ELF_MACHINES = {3: "32-bit x86", 8: "MIPS", 20: "32-bit PowerPC", 21: "64-bit PowerPC", 22: "IBM Z (s390x)",
                 40: "32-bit ARM", 62: "x86_64", 183: "aarch64 (ARM)", 243: "RISC-V"}
_HOST_MACHINES = {"x86_64": 62, "amd64": 62, "aarch64": 183, "arm64": 183, "ppc64le": 21, "ppc64": 21,
                  "s390x": 22, "riscv64": 243}


class RunError(Exception):
    """A bad input to ``qrun`` or ``Module`` (module file, weights, images, labels, device, output path): the message
    names the file and says what is wrong; ``qrun`` prints it and exits with status 2."""


# ------------------------------------------------------------------------------------------------------------------
# the TVM runtime libraries
# ------------------------------------------------------------------------------------------------------------------

_LIBS: dict = {}  # the TVM libraries this module loaded itself (TVM's Python package not imported)


def _tvm_libs() -> dict:
    """The loaded TVM runtime libraries by name, ``tvm_runtime`` among them: TVM's own table where its Python package
    is imported, else ``libtvm_runtime`` loaded here through ``tvm_ffi`` from the installed ``tvm`` package's library
    folder (TVM's own search: ``tvm/libinfo.py``, run without importing the package)."""
    base = sys.modules.get("tvm.base")
    if base is not None and "tvm_runtime" in getattr(base, "_LOADED_LIBS", {}):
        return base._LOADED_LIBS
    if "tvm_runtime" not in _LIBS:
        import importlib.util

        import tvm_ffi

        spec = importlib.util.find_spec("tvm")
        if spec is None or not spec.submodule_search_locations:
            raise RunError("the TVM runtime is not installed (pip install the pinned tvm wheel; see README)")
        libinfo_py = os.path.join(list(spec.submodule_search_locations)[0], "libinfo.py")
        try:
            li_spec = importlib.util.spec_from_file_location("_qcompile_tvm_libinfo", libinfo_py)
            libinfo = importlib.util.module_from_spec(li_spec)
            li_spec.loader.exec_module(libinfo)
            _LIBS["tvm_runtime"] = tvm_ffi.libinfo.load_lib_ctypes(
                "tvm", "tvm_runtime", "RTLD_GLOBAL", extra_lib_paths=libinfo.package_lib_paths())
        except (OSError, RuntimeError, AttributeError) as e:
            raise RunError(f"cannot load the TVM runtime library (libtvm_runtime.so): {e}") from None
    return _LIBS


def load_cuda_runtime(required: bool = False) -> bool:
    """Load TVM's CUDA runtime library (``libtvm_runtime_cuda.so``, beside ``libtvm_runtime.so``) into this process.

    It registers the CUDA module loader and device API. The full TVM loads it when it registers its CUDA backend and
    skips it silently where ``libcuda.so.1`` does not load at that moment; runtime-only TVM
    (``TVM_USE_RUNTIME_LIB=1``) and ``Module`` without ``tvm`` imported do not load it. Without it a ``.so``'s CUDA
    kernels do not load, and a CUDA build gets a source-only module. Returns whether the library is loaded;
    ``required``: raise instead of returning False (no TVM runtime library, no CUDA runtime beside it, or no CUDA
    driver on this host)."""
    import ctypes
    import pathlib

    try:
        libs = _tvm_libs()
    except RunError:
        if required:
            raise
        return False
    if "tvm_runtime_cuda" in libs:
        return True
    try:
        lib = pathlib.Path(libs["tvm_runtime"]._name).resolve().parent / "libtvm_runtime_cuda.so"
        libs["tvm_runtime_cuda"] = ctypes.CDLL(str(lib), mode=ctypes.RTLD_LOCAL)
    except (KeyError, OSError):
        if required:
            raise
        return False
    return True


def cuda_gpus() -> list[int]:
    """Compute capabilities (90 for an H100) of the CUDA GPUs this host's driver reports; [] where there is no driver
    or no GPU. Asks ``libcuda.so.1`` directly (cuInit, cuDeviceGetCount), so it never fails."""
    import ctypes

    try:
        cu = ctypes.CDLL("libcuda.so.1")
        n = ctypes.c_int(0)
        if cu.cuInit(0) != 0 or cu.cuDeviceGetCount(ctypes.byref(n)) != 0:
            return []
        ccs = []
        for i in range(n.value):
            dev, major, minor = ctypes.c_int(0), ctypes.c_int(0), ctypes.c_int(0)
            if (cu.cuDeviceGet(ctypes.byref(dev), i) != 0
                    or cu.cuDeviceGetAttribute(ctypes.byref(major), 75, dev) != 0  # ..._COMPUTE_CAPABILITY_MAJOR
                    or cu.cuDeviceGetAttribute(ctypes.byref(minor), 76, dev) != 0):  # ..._COMPUTE_CAPABILITY_MINOR
                ccs.append(0)
            else:
                ccs.append(10 * major.value + minor.value)
        return ccs
    except (OSError, AttributeError):
        return []


def weights_digest(weights) -> str:
    """sha256 over the weight arrays (dtype, shape, bytes), in order: what a ``--weights-beside`` module records and
    ``Module`` checks its weights file against (equal shapes are not enough: the kernels of one batch size may take
    some weights in a permuted order, e.g. 8-bit ``agl`` records)."""
    import hashlib

    import numpy as np

    h = hashlib.sha256()
    for w in weights:
        w = np.ascontiguousarray(w)
        h.update(f"{w.dtype.str}{w.shape};".encode())
        h.update(w.tobytes())
    return h.hexdigest()


@dataclass(frozen=True)
class InputQuant:
    """How the images a module compiled with ``--input-dtype int8|uint8`` takes are quantized: its model's input
    QuantizeLinear, which the module does not run::

        q = clip(floor(x / scale + 0.5) + zero_point, qmin, qmax)       x: float32 images, q: dtype, in layout

    in float32 arithmetic, exactly as the module built with ``--input-dtype float32`` quantizes its input (ties round
    up, where ONNX's QuantizeLinear rounds them to even: x / scale exactly halfway between two integers). ``zero_point``,
    ``qmin`` and ``qmax`` are in ``dtype``: where it is not the model's zero-point dtype, they are the model's shifted
    by 128 (exact for 8 bits). ``node``: the folded quantize. :meth:`quantize` does it for NumPy images."""

    scale: float
    zero_point: int
    dtype: str
    layout: str
    qmin: int
    qmax: int
    node: str = ""

    def to_meta(self) -> dict:
        return asdict(self)

    @classmethod
    def from_meta(cls, d: dict) -> "InputQuant":
        return cls(float(d["scale"]), int(d["zero_point"]), str(d["dtype"]), str(d["layout"]), int(d["qmin"]),
                   int(d["qmax"]), str(d.get("node", "")))

    def __iter__(self):  # scale, zero_point, dtype, layout = m.input_quant
        return iter((self.scale, self.zero_point, self.dtype, self.layout))

    def quantize(self, x, layout: str = "NCHW"):
        """Float images ``x`` (NumPy, any float dtype, taken as float32; 4-D in ``layout`` when the module's input
        is) -> the integer array the module takes (``dtype``, in ``self.layout``). ``RunError`` for a non-float
        array or NaN/Inf values."""
        import numpy as np

        x = np.asarray(x)
        if not np.issubdtype(x.dtype, np.floating):
            raise RunError(f"quantizing the input: expected float images, got dtype {x.dtype}")
        if layout not in INPUT_LAYOUTS:
            raise RunError(f"quantizing the input: layout must be one of {', '.join(INPUT_LAYOUTS)}, not {layout!r}")
        with np.errstate(over="ignore", invalid="ignore"):
            x = x.astype(np.float32)
            bad = int(x.size - np.isfinite(x).sum())
            if bad:
                raise RunError(f"quantizing the input: it holds {bad} non-finite values (NaN or Inf); fix the images")
            f = np.floor(x / np.float32(self.scale) + np.float32(0.5)) + np.float32(self.zero_point)
            q = np.clip(f, self.qmin, self.qmax).astype(self.dtype)
        if x.ndim == 4 and layout != self.layout:
            q = q.transpose((0, 2, 3, 1) if self.layout == "NHWC" else (0, 3, 1, 2))
        return np.ascontiguousarray(q)


# ------------------------------------------------------------------------------------------------------------------
# checking a module file before it is loaded
# ------------------------------------------------------------------------------------------------------------------

def _describe(data: bytes) -> str:
    """What a non-ELF file looks like, for the message."""
    kinds = [(b"\x89PNG", "a PNG image"), (b"\xff\xd8\xff", "a JPEG image"), (b"PK\x03\x04", "a zip archive (.npz?)"),
             (b"\x93NUMPY", "a NumPy .npy array"), (b"\x08", "an ONNX model?"), (b"#!", "a script"),
             (b"!<arch>", "a static library (.a)"), (b"\xcf\xfa\xed\xfe", "a macOS Mach-O library"),
             (b"MZ", "a Windows executable or DLL")]
    for magic, what in kinds:
        if data.startswith(magic):
            return what
    head = data[:512]
    if head and all(32 <= b < 127 or b in b"\t\r\n" for b in head):
        return "a text file"
    return "binary data of an unknown kind"


def check_module_file(path: str) -> dict:
    """Check, without loading it, that ``path`` is a qcompile module this host can load, and return the metadata the
    file records (``qcompile_meta``'s JSON). Raises ``RunError``: no such file, empty, not an ELF shared library,
    built for another machine, truncated (a header or section past the end of the file: loading it would crash the
    process with SIGBUS), or no qcompile module inside."""
    if not os.path.exists(path):
        raise RunError(f"compiled module '{path}' does not exist")
    if os.path.isdir(path):
        raise RunError(f"compiled module '{path}' is a directory, not a .so file")
    foreign = f"'{path}' is not a qcompile module"
    try:
        with open(path, "rb") as f:
            data = f.read(512)
            if not data:
                raise RunError(f"{foreign}: the file is empty")
            if not data.startswith(b"\x7fELF"):  # (a large file of another kind is not read through)
                raise RunError(f"{foreign}: it is {_describe(data)} (a compiled .so is an ELF shared library)")
            data += f.read()
    except OSError as e:
        raise RunError(f"cannot read compiled module '{path}': {e.strerror}") from None
    size = len(data)
    if size < 64:
        raise RunError(f"'{path}' is truncated: {size} bytes, shorter than an ELF header (copy or rebuild it)")
    ei_class, ei_data = data[4], data[5]
    if ei_class not in (1, 2) or ei_data not in (1, 2):
        raise RunError(f"{foreign}: its ELF header is corrupt (class {ei_class}, byte order {ei_data})")
    import platform

    bits, order = (32 if ei_class == 1 else 64), ("little" if ei_data == 1 else "big")
    e_machine = struct.unpack_from("<H" if order == "little" else ">H", data, 18)[0]
    host = platform.machine()
    host_bits = struct.calcsize("P") * 8
    host_em = _HOST_MACHINES.get(host.lower())
    if (host_em is not None and e_machine != host_em) or bits != host_bits or order != sys.byteorder:
        what = _ELF_MACHINES.get(e_machine, f"ELF machine type {e_machine}")
        raise RunError(f"{foreign} for this host: it holds {bits}-bit {what} code, this host runs {host_bits}-bit "
                       f"{host} (compile the model on a host like this one)")
    end = "<" if order == "little" else ">"
    (_, e_type, _, _, _, e_phoff, e_shoff, _, _, e_phentsize, e_phnum, e_shentsize, e_shnum,
     _) = struct.unpack_from(end + "16sHHIQQQIHHHHHH", data, 0)
    kind = {1: "an object file (.o)", 2: "a program (executable)", 4: "a core dump"}.get(e_type)
    if kind:
        raise RunError(f"{foreign}: it is {kind}, not a shared library")
    if e_type != 3:
        raise RunError(f"{foreign}: its ELF header is corrupt (file type {e_type})")

    def truncated(need: int) -> RunError:
        return RunError(f"'{path}' is truncated or corrupt: its ELF headers describe {need} bytes, the file has {size} "
                        f"(an interrupted copy or build?) -- copy or rebuild it")

    if (e_phnum and e_phentsize != 56) or (e_shnum and e_shentsize != 64):
        raise RunError(f"'{path}' is corrupt: its ELF header gives header entries of {e_phentsize} and {e_shentsize} "
                       f"bytes (64-bit ELF has 56 and 64)")
    if e_phoff + 56 * e_phnum > size:
        raise truncated(e_phoff + 56 * e_phnum)
    shnum = e_shnum
    if e_shoff and shnum == 0:  # extended numbering: the count is in section 0's sh_size
        if e_shoff + 64 > size:
            raise truncated(e_shoff + 64)
        shnum = struct.unpack_from(end + "IIQQQQIIQQ", data, e_shoff)[5]
    if e_shoff + 64 * shnum > size:
        raise truncated(e_shoff + 64 * shnum)
    need = 0
    for i in range(e_phnum):  # the segments the dynamic loader maps: reading past the file's end is the SIGBUS
        p_type, _, p_offset, _, _, p_filesz, _, _ = struct.unpack_from(end + "IIQQQQQQ", data, e_phoff + 56 * i)
        if p_type != 0:
            need = max(need, p_offset + p_filesz)
    sections = [struct.unpack_from(end + "IIQQQQIIQQ", data, e_shoff + 64 * i) for i in range(shnum)]
    for _, sh_type, _, _, sh_offset, sh_size, *_ in sections:
        if sh_type not in (0, 8):  # SHT_NULL, SHT_NOBITS (.bss) occupy no bytes of the file
            need = max(need, sh_offset + sh_size)
    if need > size:
        raise truncated(need)

    blob = None
    for _, sh_type, _, _, sh_offset, sh_size, sh_link, _, _, sh_entsize in sections:
        if sh_type != 11 or sh_link >= shnum:  # SHT_DYNSYM, and its string table
            continue
        strtab = sections[sh_link]
        s_off, s_size = strtab[4], strtab[5]
        for j in range(sh_size // 24):
            st_name, _, _, st_shndx, st_value, st_size = struct.unpack_from(end + "IBBHQQ", data, sh_offset + 24 * j)
            name_end = data.find(b"\0", s_off + st_name, s_off + s_size)
            if name_end < 0 or data[s_off + st_name:name_end] != _LIBRARY_BIN or not 0 < st_shndx < shnum:
                continue
            sec = sections[st_shndx]
            off = sec[4] + (st_value - sec[3])  # sh_offset + (st_value - sh_addr)
            if sec[1] != 8 and sec[3] <= st_value and off + st_size <= min(size, sec[4] + sec[5]):
                blob = data[off:off + st_size]
    if blob is None:
        raise RunError(f"{foreign}: it is a shared library or program of another kind (it holds no TVM module "
                       f"data, so no compiled model)")
    if b"relax.VMExecutable" not in blob:
        raise RunError(f"{foreign}: it is a TVM library without a Relax VM executable (a qcompile module has one)")
    at = blob.find(_META_PREFIX)
    if at < 0:
        raise RunError(f"{foreign}: it is a TVM module that qcompile did not build (it has no {META_FUNC} metadata)")
    try:
        meta, _ = json.JSONDecoder().raw_decode(blob[at:at + (1 << 20)].decode("latin-1"))
    except ValueError:
        meta = None
    if not isinstance(meta, dict) or not isinstance(meta.get("input_shape"), list):
        raise RunError(f"'{path}' is corrupt: its {META_FUNC} metadata does not parse")
    return meta


# ------------------------------------------------------------------------------------------------------------------
# .npy / .npz inputs
# ------------------------------------------------------------------------------------------------------------------

def read_npy(path: str, what: str = "input"):
    """One array from a ``.npy`` file, never unpickling; ``RunError`` naming ``what`` and the file otherwise."""
    import numpy as np

    if not os.path.exists(path):
        raise RunError(f"{what} file '{path}' does not exist")
    if os.path.isdir(path):
        raise RunError(f"{what} file '{path}' is a directory, not a .npy file")
    try:
        with open(path, "rb") as f:
            head = f.read(6)
            if not head:
                raise RunError(f"cannot read {what} '{path}': the file is empty")
            if head.startswith(b"PK\x03\x04"):
                raise RunError(f"cannot read {what} '{path}': it is a .npz archive; give a .npy file of one array "
                               f"(numpy.save)")
            if head != b"\x93NUMPY":
                raise RunError(f"cannot read {what} '{path}': not a .npy file (it lacks the NumPy header; write it "
                               f"with numpy.save)")
            f.seek(0)
            return np.lib.format.read_array(f, allow_pickle=False)
    except RunError:
        raise
    except ValueError as e:
        if "pickle" in str(e).lower() or "object" in str(e).lower():
            raise RunError(f"cannot read {what} '{path}': it holds Python objects (a pickled object array), which "
                           f"are never loaded; save a numeric array") from None
        raise RunError(f"cannot read {what} '{path}': the .npy file is truncated or corrupt ({e})") from None
    except (OSError, EOFError) as e:
        raise RunError(f"cannot read {what} '{path}': the .npy file is truncated or corrupt "
                       f"({getattr(e, 'strerror', None) or e})") from None


def _read_weights(wp: str, n: int | None, path: str) -> list:
    """The arrays ``w0 .. w{n-1}`` of a ``--weights-beside`` file, never unpickling."""
    import zipfile

    import numpy as np

    if not os.path.isfile(wp):
        raise RunError(f"'{path}' keeps its weights beside it, but '{wp}' does not exist" if not os.path.isdir(wp)
                       else f"weights file '{wp}' is a directory")
    bad = f"weights file '{wp}' is unreadable"
    with open(wp, "rb") as f:
        head = f.read(6)
    if not head:
        raise RunError(f"{bad}: the file is empty")
    if head == b"\x93NUMPY":
        raise RunError(f"{bad}: it is a single .npy array, not the .npz archive qcompile writes beside '{path}'")
    if not head.startswith(b"PK"):
        raise RunError(f"{bad}: not a valid .npz archive (a .npz is a zip file; this one is {_describe(head)})")
    try:
        z = np.load(wp, allow_pickle=False)
    except (zipfile.BadZipFile, EOFError, OSError, ValueError) as e:
        raise RunError(f"{bad}: not a valid .npz archive: truncated or corrupt ({e})") from None
    with z:
        n = len(z.files) if n is None else n
        missing = [f"w{i}" for i in range(n) if f"w{i}" not in z.files]
        if missing:
            raise RunError(f"weights file '{wp}' lacks {len(missing)} of the {n} arrays '{path}' takes (first: "
                           f"{missing[0]}) -- use the weights file written with this module")
        arrays = []
        for i in range(n):
            try:
                arrays.append(z[f"w{i}"])
            except (zipfile.BadZipFile, EOFError, OSError, ValueError, KeyError) as e:
                why = ("it holds pickled Python objects, which are never loaded" if "pickle" in str(e).lower()
                       else f"array w{i} is truncated or corrupt ({e})")
                raise RunError(f"{bad}: {why}") from None
    return arrays


# ------------------------------------------------------------------------------------------------------------------
# the module
# ------------------------------------------------------------------------------------------------------------------

def _load_error(path: str, e: Exception) -> RunError:
    """A loader failure in plain words."""
    lines = str(e).strip().splitlines()
    msg = lines[-1].strip() if lines else type(e).__name__
    low = msg.lower()
    if "not registered" in low or "loader" in low:
        if "cuda" in low:
            return RunError(f"cannot load '{path}': it holds CUDA kernels, and this TVM install has no CUDA runtime "
                            f"(libtvm_runtime_cuda.so) or this host no CUDA driver")
        return RunError(f"cannot load '{path}': it needs a part of the TVM runtime that this install lacks (built with "
                        f"another TVM version?) -- rebuild it with the installed qcompile")
    if "undefined symbol" in low:
        return RunError(f"cannot load '{path}': it needs a function this TVM runtime lacks ({msg.split(':')[-1].strip()};"
                        f" built with another TVM version?) -- rebuild it with the installed qcompile")
    return RunError(f"cannot load '{path}': {msg}")


class Module:
    """A loaded qcompile ``.so``: ``Module(path)(x) -> logits``.

    A ``.so`` is native code: loading it runs code in it, as loading any shared library does; load only modules you
    built or trust. The file is checked before it is loaded (``check_module_file``). Every bad input -- the module
    file, its weights file, the device, the images -- raises ``RunError`` with the message ``qrun`` prints.

    ``device``: "cpu" or "cuda" (default: the module's target; a module runs only on the kind of device it was
    compiled for). ``weights``: the weights file of a ``--weights-beside`` module (default: ``NAME.weights.npz`` beside
    ``NAME.so``). ``meta``: the module's metadata (input name, shape, dtype and layout, layout, bits, target, ...).
    ``input_quant``: for a module compiled with ``--input-dtype int8|uint8``, the input's quantization
    (:class:`InputQuant`: scale, zero point, dtype, layout; :meth:`quantize_input` applies it); None for float32
    images."""

    def __init__(self, path: str, device: str | None = None, weights: str | None = None):
        import ctypes

        self.path = path
        meta = check_module_file(path)
        target = meta.get("target")
        if device not in (None, "cpu", "cuda"):
            raise RunError(f"device must be 'cpu' or 'cuda', not {device!r}")
        device = device or ("cuda" if target == "cuda" else "cpu")
        if device == "cuda" or target == "cuda":
            from qcompile.registry import CUDA_ARCHS  # (what qcompile --arch builds; a light module)

            gpus = cuda_gpus()
            if not gpus:
                raise RunError(f"'{path}': this module needs a CUDA GPU; this host has none (it was compiled with "
                               f"--target cuda)" if target == "cuda" else
                               f"--device cuda needs a CUDA GPU; this host has none ('{path}' is a CPU module: run it "
                               f"without --device)")
            arch, cc = meta.get("arch"), gpus[0]
            if target == "cuda" and arch == "sm_90" and cc > 90:
                raise RunError(f"'{path}' was compiled for sm_90: its warpgroup-MMA kernels are sm_90a code, which runs on "
                               f"compute capability 9.0 GPUs only (H100, H200); this host's GPU is sm_{cc} -- recompile "
                               f"with --arch sm_89 (its PTX runs on newer GPUs)")
            if target == "cuda" and arch in CUDA_ARCHS and 0 < cc < int(arch[3:]):  # (older GPUs lack its instructions)
                fits = [a for a in CUDA_ARCHS if int(a[3:]) <= cc]
                raise RunError(f"'{path}' was compiled for {arch}; this host's GPU is sm_{cc}, older -- "
                               + (f"recompile with --arch {fits[-1]}" if fits else "qcompile does not build for it"))
        if device == "cuda" and target != "cuda":
            raise RunError(f"'{path}' was compiled for the CPU (--target {target}); it cannot run with --device cuda "
                           f"(recompile with --target cuda)")
        if device == "cpu" and target == "cuda":
            raise RunError(f"'{path}' was compiled for CUDA GPUs (--target cuda); it cannot run with --device cpu")
        self.device = device
        arrays = []
        if meta.get("weights") == "beside":  # NAME.weights.npz beside NAME.so
            from qcompile.checks import weights_path

            wp = weights or weights_path(path)
            arrays = _read_weights(wp, meta.get("num_weights"), path)
            if "weights_sha256" in meta and weights_digest(arrays) != meta["weights_sha256"]:
                raise RunError(f"weights file '{wp}' does not match '{path}': it holds other weights, or those of a "
                               f"build whose kernels take some weights in another order (tuned per batch size: 4-bit "
                               f"w8, 8-bit agl) -- use the weights file written with this module")
        elif weights is not None:
            raise RunError(f"'{path}' holds its weights inside; it takes no weights file ('{weights}')")

        _tvm_libs()
        import tvm_ffi

        if device == "cuda" and not load_cuda_runtime():
            raise RunError(f"cannot load '{path}': this TVM install has no CUDA runtime (libtvm_runtime_cuda.so beside "
                           f"libtvm_runtime.so) -- install the pinned tvm wheel")
        try:
            full = os.path.realpath(path)  # (dlopen searches the library path for a bare file name)
            if full.endswith(".so"):
                self._lib = tvm_ffi.load_module(full)
            else:  # TVM picks the loader by the file's suffix; the file is an ELF shared library (checked above)
                self._lib = tvm_ffi.get_global_func("ffi.Module.load_from_file.so")(full, "so")
        except Exception as e:  # the loader's errors come as several classes
            raise _load_error(path, e) from None
        try:
            self._exec = self._lib["vm_load_executable"]()
            cpu = [tvm_ffi.device("cpu", 0).dlpack_device_type(), 0, 2]  # (device type, index, pooled allocator)
            gpu = [tvm_ffi.device("cuda", 0).dlpack_device_type(), 0, 2] if device == "cuda" else []
            self._exec["vm_initialization"](*gpu, *cpu)
            self._main = self._exec["main"]
            meta_t = self._exec[META_FUNC]()
        except Exception as e:  # a module without the VM's entry points, or a device that does not start
            raise RunError(f"cannot start '{path}' on {device}: "
                           f"{(str(e).strip().splitlines() or [type(e).__name__])[-1]}") from None
        self._alloc = tvm_ffi.get_global_func("runtime.TVMTensorAllocWithScope")
        self._copy_from = tvm_ffi.get_global_func("runtime.TVMTensorCopyFromBytes")
        self._copy_to = tvm_ffi.get_global_func("runtime.TVMTensorCopyToBytes")
        self._c_void_p = ctypes.c_void_p
        self.meta = json.loads(bytes(self._numpy(meta_t)).decode())
        self.weights = [self._tensor(w) for w in arrays]
        self._vm = None
        iq = self.meta.get("input_quant")
        self.input_quant = InputQuant.from_meta(iq) if isinstance(iq, dict) else None

    @property
    def dev(self):
        """The device the module runs on (a ``tvm.runtime.Device`` where ``tvm`` is imported)."""
        import tvm_ffi

        return tvm_ffi.device(self.device, 0)

    @property
    def vm(self):
        """TVM's ``VirtualMachine`` over this module, for benchmarks (``time_evaluator``): imports TVM's Python
        package."""
        if self._vm is None:
            import tvm
            from tvm.runtime.vm import VirtualMachine

            lib = self._lib if isinstance(self._lib, tvm.runtime.Module) else tvm.runtime.load_module(self.path)
            self._vm = VirtualMachine(lib, self.dev)
        return self._vm

    def _tensor(self, a):
        """A TVM tensor on this module's device holding a copy of NumPy array ``a``."""
        import numpy as np
        import tvm_ffi

        a = np.ascontiguousarray(a)
        t = self._alloc(tvm_ffi.Shape(list(a.shape)), tvm_ffi.dtype(str(a.dtype)), self.dev, None)
        self._copy_from(t, self._c_void_p(a.ctypes.data), a.nbytes)
        return t

    def _numpy(self, t):
        """A NumPy copy of TVM tensor ``t`` (on any device)."""
        import numpy as np

        a = np.empty(tuple(t.shape), dtype=np.dtype(str(t.dtype)))
        self._copy_to(t, self._c_void_p(a.ctypes.data), a.nbytes)
        return a

    def _takes(self) -> str:
        """What the input must be, for messages: "float32 NCHW images", "int8 NHWC images quantized with scale ..."."""
        iq = self.input_quant
        what = f"{self.meta.get('input_dtype', 'float32')} {self.meta.get('input_layout', 'NCHW')} images"
        return what if iq is None else f"{what} quantized with scale {iq.scale!r} and zero point {iq.zero_point}"

    def quantize_input(self, x, layout: str = "NCHW"):
        """Float images ``x`` (NumPy, in ``layout``) quantized for a module compiled with ``--input-dtype
        int8|uint8``, exactly as the float-input module quantizes them (:meth:`InputQuant.quantize`); the output of
        ``m(m.quantize_input(x))`` equals that of the float-input module on ``x``, bit for bit."""
        if self.input_quant is None:
            raise RunError(f"'{self.path}' takes float32 images (it quantizes them itself); there is nothing to "
                           f"quantize on the host (compile with --input-dtype int8 or uint8 for that)")
        return self.input_quant.quantize(x, layout)

    def check_input(self, x, allow_nonfinite: bool = False):
        """``x`` as the contiguous array the module takes (float32, or the int8 / uint8 of ``input_quant``);
        ``RunError`` for another shape or dtype, (float input, unless ``allow_nonfinite``) NaN/Inf values, or (a
        4-bit integer input) values outside its range."""
        import numpy as np

        name = self.meta["input_name"]
        want = tuple(self.meta["input_shape"])
        if self.input_quant is not None:
            return self._check_int_input(np.asarray(x), name, want)
        if x.dtype != np.float32:
            if np.issubdtype(x.dtype, np.floating):
                with np.errstate(over="ignore"):  # float64 beyond float32's range becomes Inf: refused below
                    x = x.astype(np.float32)
            else:
                raise RunError(f"input '{name}' must be {self._takes()}, got dtype {x.dtype}")
        if tuple(x.shape) != want:
            raise RunError(f"input '{name}' has shape {tuple(x.shape)}, the module was compiled for "
                           f"{want} ({self._takes()}; recompile with --batch N for another batch size)")
        if not allow_nonfinite:
            finite = np.isfinite(x)
            if not finite.all():
                nan = int(np.isnan(x).sum())
                raise RunError(f"input '{name}' holds {x.size - int(finite.sum())} non-finite values ({nan} NaN, "
                               f"{x.size - int(finite.sum()) - nan} Inf): quantizing them gives arbitrary integers, so "
                               f"the output would look plausible and mean nothing; fix the images, or pass "
                               f"--allow-nonfinite (allow_nonfinite=True) to run anyway")
        return np.ascontiguousarray(x)

    def _check_int_input(self, x, name: str, want: tuple):
        """``check_input`` for an integer input: its dtype exactly (no silent conversion), shape, and range."""
        import numpy as np

        iq = self.input_quant
        if x.dtype != np.dtype(iq.dtype):
            hint = (" -- quantize float images first: Module.quantize_input(x), or qrun --quantize"
                    if np.issubdtype(x.dtype, np.floating) else "")
            raise RunError(f"input '{name}' must be {self._takes()}, got dtype {x.dtype}{hint}")
        if tuple(x.shape) != want:
            raise RunError(f"input '{name}' has shape {tuple(x.shape)}, the module was compiled for {want} "
                           f"({self._takes()}; recompile with --batch N for another batch size)")
        info = np.iinfo(x.dtype)
        if (iq.qmin, iq.qmax) != (info.min, info.max) and x.size and (x.min() < iq.qmin or x.max() > iq.qmax):
            raise RunError(f"input '{name}' holds values outside [{iq.qmin}, {iq.qmax}], the range of the model's "
                           f"input quantize (min {int(x.min())}, max {int(x.max())})")
        return np.ascontiguousarray(x)

    def __call__(self, x, allow_nonfinite: bool = False):
        """The module's output (float logits) for images ``x`` (float32 NCHW, the compiled batch size; a module built
        with ``--input-dtype`` / ``--input-layout`` takes that dtype and layout, see ``input_quant``); NaN/Inf pixels
        are refused unless ``allow_nonfinite``.

        ``x`` a NumPy array (or anything ``np.asarray`` takes): a NumPy array out. ``x`` a tensor of another array
        library that speaks DLPack (a torch or CuPy CUDA tensor), on the module's device: the module reads it in
        place and returns a tensor of the same library on the same device -- no copy through the host::

            m = Module("resnet50_int8.so")                 # --target cuda
            x = torch.randn(m.meta["input_shape"], device="cuda")
            logits = m(x)                                  # a torch CUDA tensor

        The kernels run on the GPU's default stream (PyTorch's and CuPy's unless you set another: synchronize it
        first). The finiteness check of a torch or CuPy tensor runs on its device with that library's own ops; for
        other DLPack producers it copies the input to the host (pass ``allow_nonfinite=True`` to skip it)."""
        import numpy as np

        if not isinstance(x, np.ndarray) and hasattr(x, "__dlpack__") and hasattr(x, "__dlpack_device__"):
            return self._call_dlpack(x, allow_nonfinite)
        x = self.check_input(np.asarray(x), allow_nonfinite)
        return self._numpy(self._run(self._tensor(x)))

    def _run(self, t):
        try:
            return self._main(t, *self.weights)
        except Exception as e:  # a device failure (e.g. a CUDA error) comes from the runtime
            raise RunError(f"running '{self.path}' on {self.device} failed: "
                           f"{(str(e).strip().splitlines() or [type(e).__name__])[-1]}") from None

    def _call_dlpack(self, x, allow_nonfinite: bool):
        """``__call__`` for a DLPack tensor: checked, run in place, the output handed back through DLPack."""
        import importlib

        import numpy as np
        import tvm_ffi

        name, want = self.meta["input_name"], tuple(self.meta["input_shape"])
        lib = type(x).__module__.split(".")[0]
        dev_type, dev_id = x.__dlpack_device__()
        mine = tvm_ffi.device(self.device, 0).dlpack_device_type()
        if int(dev_type) != int(mine) or int(dev_id) != 0:
            where = {1: "the CPU", 2: f"CUDA GPU {dev_id}"}.get(int(dev_type), f"DLPack device {dev_type}:{dev_id}")
            raise RunError(f"input '{name}' ({lib} tensor) is on {where}; this module runs on "
                           f"{'CUDA GPU 0' if self.device == 'cuda' else 'the CPU'} -- move the tensor there first")
        try:
            t = tvm_ffi.from_dlpack(x, require_contiguous=True)
        except (ValueError, TypeError, RuntimeError) as e:
            raise RunError(f"input '{name}' ({lib} tensor) cannot be read in place: "
                           f"{(str(e).strip().splitlines() or [type(e).__name__])[-1]} (pass a contiguous tensor)") \
                from None
        if str(t.dtype) != self.meta.get("input_dtype", "float32"):
            raise RunError(f"input '{name}' must be {self._takes()}, got dtype {t.dtype}")
        if tuple(t.shape) != want:
            raise RunError(f"input '{name}' has shape {tuple(t.shape)}, the module was compiled for {want} "
                           f"({self._takes()}; recompile with --batch N for another batch size)")
        if not allow_nonfinite and self.input_quant is None:
            if lib in ("torch", "cupy"):
                ok = bool(importlib.import_module(lib).isfinite(x).all())
            else:
                ok = bool(np.isfinite(self._numpy(t)).all())
            if not ok:
                raise RunError(f"input '{name}' holds non-finite values (NaN or Inf): quantizing them gives arbitrary "
                               f"integers, so the output would look plausible and mean nothing; fix the images, or "
                               f"pass allow_nonfinite=True to run anyway")
        out = self._run(t)
        if lib in ("torch", "cupy"):
            try:
                return importlib.import_module(lib).from_dlpack(out)
            except (ImportError, AttributeError):
                pass
        return out  # a tvm_ffi Tensor (itself a DLPack producer)


# ------------------------------------------------------------------------------------------------------------------
# qrun
# ------------------------------------------------------------------------------------------------------------------

class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit status 2 (qrun_main prints it), instead of usage + message
        raise RunError(message)


def _positive_int(s: str) -> int:
    try:
        n = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expects a whole number of runs, got '{s}'") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expects at least 1 run, got {n} (leave --time out for no timing)")
    return n


def _check_output(path: str, keep: dict):
    """Check ``--output`` before any work: (path as given with ``.npy``, the file it names).
    ``keep``: {path: what} of files the output must not replace."""
    from qcompile.checks import _probe_writable

    if os.path.isdir(path):
        raise RunError(f"--output '{path}' is a directory; give a file name (e.g. {os.path.join(path, 'y.npy')})")
    final = path if path.endswith(".npy") else path + ".npy"  # the name numpy.save gives it
    if os.path.isdir(final):
        raise RunError(f"--output '{final}' is a directory; give a file name (e.g. {os.path.join(final, 'y.npy')})")
    real = os.path.realpath(final)  # (a symbolic link: its target is replaced, as numpy.save would write it)
    parent = os.path.dirname(real)
    if not os.path.exists(parent):
        raise RunError(f"cannot write --output '{final}': folder '{parent}' does not exist")
    if not os.path.isdir(parent):
        raise RunError(f"cannot write --output '{final}': '{parent}' is not a folder")
    if os.path.exists(final):
        for k, what in keep.items():
            if os.path.exists(k) and os.path.samefile(final, k):
                raise RunError(f"--output '{final}' is the {what}; writing it would destroy it -- choose another name")
        if not os.access(final, os.W_OK):
            raise RunError(f"cannot write --output '{final}': the file is read-only")
    why = _probe_writable(parent)
    if why:
        raise RunError(f"cannot write --output '{final}': cannot create a file in '{parent}' ({why})")
    return final, real


def _write_output(y, final: str, real: str) -> None:
    """Write ``y`` to a temporary file beside ``real`` (``final`` resolved) and rename it: a failure (or an
    interrupt) removes the temporary file and leaves the destination as it was."""
    import tempfile

    import numpy as np

    from qcompile.checks import _umask

    try:
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(real), prefix=f".{os.path.basename(final)}.", suffix=".tmp")
    except OSError as e:
        raise RunError(f"cannot write --output '{final}': {e.strerror or e}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            np.lib.format.write_array(f, np.asanyarray(y), allow_pickle=False)
        os.chmod(tmp, 0o666 & ~_umask())  # the mode numpy.save's open() would give (mkstemp makes it 0600)
        os.replace(tmp, real)
    except BaseException as e:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(e, OSError):
            raise RunError(f"cannot write --output '{final}': {e.strerror or e}") from None
        raise


def _read_labels(path: str, batch: int, num_classes: int | None):
    import numpy as np

    y = read_npy(path, "labels")
    if not np.issubdtype(y.dtype, np.integer):
        raise RunError(f"labels '{path}' must be integer class indices, got dtype {y.dtype}")
    if y.ndim != 1:
        raise RunError(f"labels '{path}' must be a 1-D array (one class index per image), got shape {tuple(y.shape)}")
    if len(y) != batch:
        raise RunError(f"labels '{path}' hold {len(y)} labels, the input has {batch} images")
    if num_classes and len(y) and (y.min() < 0 or y.max() >= num_classes):
        bad = int(y.min()) if y.min() < 0 else int(y.max())
        raise RunError(f"labels '{path}' hold class {bad}; the model has {num_classes} classes (0..{num_classes - 1})")
    return y


def _import_tvm_ffi_without_torch() -> None:
    """Import tvm_ffi without the torch import it attempts first (~1 s; qrun never uses torch)."""
    if "tvm_ffi" in sys.modules or "torch" in sys.modules:
        return
    sys.modules["torch"] = None  # makes `import torch` raise ImportError, which tvm_ffi tolerates
    try:
        import tvm_ffi  # noqa: F401
    finally:
        if "torch" in sys.modules and sys.modules["torch"] is None:
            del sys.modules["torch"]


def qrun_main(argv=None) -> int:
    ap = _Parser(prog="qrun", description="Run a qcompile .so on a batch of images with the TVM runtime only. Every "
                 "bad input gets one 'qrun: error:' line and exit status 2.")
    ap.add_argument("module", help="compiled .so from qcompile (native code: run only modules you built or trust)")
    ap.add_argument("--input", required=True, help=".npy file of images (the compiled batch size): float32 NCHW, or "
                    "what a module built with --input-dtype / --input-layout takes (int8 / uint8, NHWC)")
    ap.add_argument("--quantize", action="store_true", help="for a module built with --input-dtype int8|uint8: "
                    "--input holds float32 NCHW images; quantize them with the module's input scale and zero point "
                    "(as the float-input module does) before the run")
    ap.add_argument("--output", help="write the output (float logits) to this .npy file (written to a temporary file "
                    "beside it, then renamed)")
    ap.add_argument("--labels", metavar="NPY", help=".npy file of integer class indices, one per image: also print "
                    "the top-1 accuracy over the batch")
    ap.add_argument("--device", choices=["cpu", "cuda"], help="default: the module's target")
    ap.add_argument("--time", type=_positive_int, metavar="N", help="also time N further runs (N >= 1) and print "
                    "the median (each run as a call from Python: the input check and the copies to and from the device "
                    "included)")
    ap.add_argument("--allow-nonfinite", action="store_true", help="run on images holding NaN/Inf (refused by "
                    "default: they quantize to arbitrary integers, so the output looks plausible and means nothing)")
    from qcompile.errors import run_cli  # (a light module: argparse, os, sys)

    return run_cli("qrun", lambda: _qrun(ap, argv), user_errors=(RunError,))


def _qrun(ap, argv) -> int:
    out = None
    a = ap.parse_args(argv)  # (a usage error raises RunError: one line)
    import numpy as np  # (after --help, which imports neither numpy nor tvm_ffi)

    if a.output:  # checked before any work; written (through a temporary file beside it) once the result exists
        out = _check_output(a.output, {a.input: "input file", a.module: "compiled module",
                                      **({a.labels: "labels file"} if a.labels else {})})
    x = read_npy(a.input, "input")
    _import_tvm_ffi_without_torch()
    m = Module(a.module, a.device)
    if a.quantize:
        if m.input_quant is None:
            raise RunError(f"--quantize applies to a module built with --input-dtype int8 or uint8; '{a.module}' "
                           f"takes float32 images and quantizes them itself (leave --quantize out)")
        if not np.issubdtype(x.dtype, np.floating):
            raise RunError(f"--quantize: input '{a.input}' holds {x.dtype} values; it takes float32 NCHW images")
        want = list(m.meta["input_shape"])
        if m.input_quant.layout == "NHWC" and len(want) == 4:
            want = [want[0], want[3], want[1], want[2]]
        if list(x.shape) != want:
            raise RunError(f"--quantize: input '{a.input}' has shape {tuple(x.shape)}, the module was compiled for "
                           f"float32 NCHW images of shape {tuple(want)} (recompile with --batch N for another batch "
                           f"size)")
        x = m.quantize_input(x, "NCHW")
    x = m.check_input(x, a.allow_nonfinite)
    if m.input_quant is not None:
        iq = m.input_quant
        print(f"input {iq.dtype} {iq.layout}: scale {iq.scale!r}, zero point {iq.zero_point}, range [{iq.qmin}, "
              f"{iq.qmax}]{' (quantized from the float32 NCHW images of --input)' if a.quantize else ''}", flush=True)
    labels = None
    if a.labels:
        shape = m.meta.get("output_shape") or []
        labels = _read_labels(a.labels, x.shape[0], shape[-1] if len(shape) == 2 else None)
    y = m(x, allow_nonfinite=a.allow_nonfinite)
    if a.time:
        import time

        ts = []
        for _ in range(a.time):
            t0 = time.perf_counter()
            m(x, allow_nonfinite=a.allow_nonfinite)
            ts.append(time.perf_counter() - t0)
        print(f"median {1e3 * sorted(ts)[len(ts) // 2]:.3f} ms over {a.time} runs")
    if out:
        _write_output(y, *out)
    top1 = np.argmax(y.reshape(y.shape[0], -1), axis=1)
    dest = f"{out[0]} " if a.output else ""
    shown = top1[:16].tolist()
    more = f" ... ({len(top1)} images)" if len(top1) > len(shown) else ""
    print(f"output {dest}shape {tuple(y.shape)} dtype {y.dtype}; top-1 per image: {shown}{more}")
    if labels is not None:
        right = int((top1 == labels).sum())
        print(f"top-1 accuracy: {100.0 * right / len(labels):.2f}% ({right}/{len(labels)} images)")
    return 0


if __name__ == "__main__":
    sys.exit(qrun_main())
