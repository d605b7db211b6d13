"""Registries of what qcompile supports, as plain dicts of frozen dataclasses (they feed the CLI's choices)."""
from __future__ import annotations

import platform
import re
import shutil
from dataclasses import dataclass


@dataclass(frozen=True)
class BitScheme:
    name: str
    doc: str


BIT_SCHEMES = {
    "8": BitScheme("8", "INT8 weights and activations"),
    "4": BitScheme("4", "INT4 weights and activations; the input quantize, the first conv and the final dense stay INT8"),
    "mixed": BitScheme("mixed", "per-layer 4/8 bits (HAWQ-style); the model says which layer has which"),
}


@dataclass(frozen=True)
class Layout:
    name: str
    kernel: str
    doc: str


LAYOUTS = {
    "NCHW": Layout("NCHW", "OIHW", "PyTorch/ONNX order; reference layout on CPU"),
    "NHWC": Layout("NHWC", "OHWI", "channels last; implicit-GEMM tensor-core convolutions"),
    "HWNC": Layout("HWNC", "HWOI", "batch next to channels; direct tensor-core convolutions over N and C"),
}


@dataclass(frozen=True)
class ModelFormat:
    name: str
    suffixes: tuple
    doc: str


FORMATS = {
    "onnx": ModelFormat("onnx", (".onnx",), "ONNX QDQ (onnxruntime quantize_static, qmodel), or a float ONNX model for PTQ"),
    # (an .onnx file too, told by its ops: frontends/onnx_qop.py rewrites it into the QDQ format)
    "onnx-qop": ModelFormat("onnx-qop", (), "ONNX QOperator (QLinearConv, QGemm, ...: quantize_static with "
                                            "QuantFormat.QOperator, the ONNX model zoo's int8 models)"),
    "pt2": ModelFormat("pt2", (".pt2",), "torch.export program in PT2E form (quantized_decomposed ops)"),
    "hawq": ModelFormat("hawq", (".pth", ".pt", ".ckpt", ".tar"), "HAWQ-V3 integer checkpoint (needs --net)"),
}


@dataclass(frozen=True)
class TargetKind:
    name: str
    default_layout: str
    doc: str
    options: tuple = ()  # the ``-name=value`` options its --target string takes


TARGETS = {
    "llvm": TargetKind("llvm", "NHWC", "CPU through LLVM: int8 kernels on x86 (AVX2, AVX-VNNI, AVX-512 VNNI) and "
                                       "aarch64 (dotprod)", ("mtriple", "mcpu", "mattr")),
    "cuda": TargetKind("cuda", "NHWC", "NVIDIA GPU; --arch sm_75|sm_80|sm_86|sm_89|sm_90"),
}

# triple architectures under another name (LLVM's spelling first)
_ARCH_ALIASES = {"amd64": "x86_64", "x86-64": "x86_64", "arm64": "aarch64", "i486": "i386", "i586": "i386",
                 "i686": "i386"}


def triple_arch(triple: str) -> str:
    """The architecture of an LLVM triple (its first component), as LLVM names it (amd64 -> x86_64, arm64 ->
    aarch64)."""
    arch = triple.split("-", 1)[0].lower()
    arch = re.sub(r"^(arm|thumb)v\w+$", r"\1", arch)  # (armv7a -> arm, thumbv7em -> thumb)
    return _ARCH_ALIASES.get(arch, arch)


def host_arch() -> str:
    """This machine's architecture, as LLVM triples name it."""
    return triple_arch(platform.machine() or "unknown")


@dataclass(frozen=True)
class TargetString:
    """A ``--target`` string (``llvm -mcpu=skylake-avx512``, ``llvm -mtriple=aarch64-linux-gnu -mattr=+dotprod``,
    ``cuda``) split into its kind and options by :func:`parse_target`; LLVM checks the names in
    ``schedules.cpu_conv.resolve_target``."""

    text: str
    kind: str
    mtriple: str = ""
    mcpu: str = ""
    mattr: tuple = ()

    @property
    def plain(self) -> bool:
        """No option: the kind alone (llvm: the host's best kernel target, ``schedules.cpu_conv.cpu_target``)."""
        return not (self.mtriple or self.mcpu or self.mattr)

    @property
    def cross(self) -> bool:
        """An llvm target whose triple names another architecture than this machine's: its code runs elsewhere, its
        module is linked with a cross linker (:func:`cross_linker`) or written as object files (``-o NAME.tar``)."""
        return bool(self.mtriple) and triple_arch(self.mtriple) != host_arch()

    def to_dict(self) -> dict:
        """The JSON-dict form ``tvm.target.Target`` takes."""
        d = {"kind": self.kind}
        d.update({k: v for k, v in (("mtriple", self.mtriple), ("mcpu", self.mcpu)) if v})
        if self.mattr:
            d["mattr"] = list(self.mattr)
        return d


def parse_target(text: str) -> TargetString:
    """Split a ``--target`` string: a kind of ``TARGETS``, then the kind's ``-name=value`` options (llvm: ``-mtriple``,
    ``-mcpu``, ``-mattr=+f1,-f2``), each at most once. QCompileError naming the string and the reason otherwise."""
    from .errors import QCompileError

    def bad(why: str):
        return QCompileError(f"--target '{text}': {why}")

    tokens = str(text).split()
    if not tokens:
        raise bad(f"empty target (one of {', '.join(TARGETS)}, llvm with LLVM options: 'llvm -mcpu=NAME')")
    kind = TARGETS.get(tokens[0])
    if kind is None:
        raise bad(f"unknown target kind '{tokens[0]}' (one of {', '.join(TARGETS)})")
    opts: dict = {}
    for tok in tokens[1:]:
        name, eq, value = tok.lstrip("-").partition("=")
        if not tok.startswith("-") or not eq:
            raise bad(f"'{tok}' is not an option of the form -name=value")
        if name not in kind.options:
            takes = (f"it takes {', '.join('-' + o for o in kind.options)}" if kind.options else
                     "it takes no options" + ("; the GPU architecture is --arch" if kind.name == "cuda" else ""))
            raise bad(f"unknown option '-{name}' for {kind.name} ({takes})")
        if name in opts:
            raise bad(f"-{name} given twice")
        if not value:
            raise bad(f"-{name} has no value")
        opts[name] = value
    mattr = tuple(f for f in opts.pop("mattr", "").split(",") if f)
    for f in mattr:
        if f[0] not in "+-" or len(f) < 2:
            raise bad(f"-mattr feature '{f}' must be +NAME (enable) or -NAME (disable)")
    triple = opts.get("mtriple", "")
    if triple and not re.fullmatch(r"[A-Za-z0-9_.]+(-[A-Za-z0-9_.]+)*", triple):
        raise bad(f"-mtriple '{triple}' is not an LLVM triple (ARCH-VENDOR-OS, e.g. aarch64-linux-gnu)")
    return TargetString(str(text), kind.name, triple, opts.get("mcpu", ""), mattr)


def cross_linker(triple: str):
    """The C++ (else C) compiler that links a module for ``triple`` on this machine: ``TRIPLE-g++`` /
    ``TRIPLE-gcc``, or the Debian name ``ARCH-linux-gnu-g++`` / ``-gcc``, the first on the PATH; None if there is
    none."""
    arch = triple_arch(triple)
    for name in (f"{triple}-g++", f"{triple}-gcc", f"{arch}-linux-gnu-g++", f"{arch}-linux-gnu-gcc"):
        found = shutil.which(name)
        if found:
            return found
    return None


CUDA_ARCHS = ("sm_75", "sm_80", "sm_86", "sm_89", "sm_90")


def cross_output(target: TargetString, path: str):
    """How the module of an llvm build for ``target`` is written to ``path``: None for this machine's architecture
    (the ``.so`` linked with the host's C++ compiler), ``"tar"`` for ``-o NAME.tar`` (a cross build's object files,
    linked on the target machine: ``g++ -shared -o NAME.so *.o``), else the cross linker's path. QCompileError for a
    cross build's ``.so`` without a cross linker on the PATH, and for a ``.tar`` of a build for this machine."""
    from .errors import QCompileError

    tar = path.lower().endswith(".tar")
    if target.kind != "llvm" or not target.cross:
        if tar:
            raise QCompileError(f"-o '{path}': a .tar (object files to link elsewhere) is the output of a cross "
                                f"build (--target llvm -mtriple=...); this build is for this machine: -o NAME.so")
        return None
    if tar:
        return "tar"
    linker = cross_linker(target.mtriple)
    if linker is None:
        arch = triple_arch(target.mtriple)
        raise QCompileError(f"--target '{target.text}' builds {arch} code, and this {host_arch()} machine has no "
                            f"linker for it ({arch}-linux-gnu-g++ is not on the PATH): install a cross compiler "
                            f"(Debian/Ubuntu: apt install g++-{arch}-linux-gnu) or write the object files with "
                            f"-o NAME.tar and link them on the target machine (g++ -shared -o NAME.so *.o)")
    return linker


def format_of(path: str) -> str:
    """The file format by suffix (ValueError: none). ``.onnx`` is "onnx"; the frontend tells its QOperator variant
    ("onnx-qop", no suffix of its own) by the model's ops."""
    low = path.lower()
    for f in FORMATS.values():
        if low.endswith(f.suffixes):
            return f.name
    raise ValueError(path)
