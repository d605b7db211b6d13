"""The CPU (x86, AVX2) integer conv2d kernel: direct convolution on ``vpmaddwd``, the requantize epilogue fused.

One PrimFunc per conv (and per dense layer, as a 1x1 conv over a 1x1 image) with the calling convention of the
tensor-core kernels, ``x, w, bias, M, S, [res, rq2], out``, and the math of :class:`~qcompile.schedules.spec.ConvSpec`
(the epilogue is :func:`qcompile.schedules.fallback.epilogue_value`, the one definition every kernel shares).
Activations are 8-bit storage (4-bit values one per byte) in ``io_layout`` NCHW or NHWC; the weights are
prepacked at compile time (:func:`pack_weights`) as int16 pairs::

    w16[kb, r, s, c2, j, i] = w[8 kb + j, r, s, 2 c2 + i]       (0 past K or C)

Two stages, both parallel over the 2-D output rows (TVM's thread pool):

1. ``xp``: the input widened and padded once -- ``xp[n, h, w, c2]`` is the int32 whose two int16 halves are
   channels ``2 c2`` and ``2 c2 + 1`` at padded position ``(h, w)`` (``pad_value`` in the halo, 0 past C).
2. the conv: each task (batch, output row, block of KT x 8 output channels) walks the row in tiles of QT output
   pixels; a tile keeps QT x KT int32x8 accumulators in registers and, for every tap (r, s) and channel pair c2,
   broadcasts the pixel's channel pair to 16 int16 lanes and adds ``vpmaddwd(pair, w16[kb, r, s, c2])`` (8 output
   channels, two products each) to each accumulator. int16 x int16 products of 8-bit values and their pairwise
   sums never saturate (|2 * 255 * 128| < 2^31), and the sums wrap in int32 as the graph's int32 accumulator
   does: the accumulators equal the conv's exactly. The epilogue (bias, per-channel fixed-point multiply / shift,
   zero point, clip, the residual add's second stage) runs on the accumulators, 8 channels at a time, and stores
   the output bytes.

A row whose length is not a multiple of QT ends with a tile shifted left onto the previous one (the overlap is
computed twice and stored with the same values); the same for the channel blocks. The instruction needs AVX2: the
build target carries it (``schedules.cpu_conv.cpu_target``).

This module also decides the CPU kernels' targets for every inner kernel: :func:`cpu_target` (the build target of a
plain llvm target on this host: the best of AVX-512 VNNI, AVX-VNNI, AVX2) and :func:`target_kernel` (the inner
kernel a target's features enable); the dot-product kernels (VNNI, Arm sdot) are in :mod:`.cpu_conv_vnni`, the AMX
tile kernel in :mod:`.cpu_conv_amx`, and run where the target has them instead of this one.
"""
from __future__ import annotations

import functools
import os
import platform
import sys
from dataclasses import dataclass

import numpy as np
import tvm
from tvm import tirx
from tvm.script import tirx as T

from .fallback import epilogue_value
from .spec import ConvSpec

LANES = 8            # int32 lanes of a ymm register: output channels per vpmaddwd
QT = 6               # output pixels per register tile (6 x 2 accumulators + 2 weight vectors + 1 broadcast <= 16)
KT = 2               # channel blocks (of 8) per register tile
PMADDWD = "llvm.x86.avx2.pmadd.wd"
STRATEGY = "cpu_direct_avx2"
SPACE_STRATEGY = "cpu_direct"  # the tuning strategy of every inner kernel (its records' "strategy"; the arch is the kernel)
REGS = {"cpu_direct_avx2": 16, "cpu_direct_vnni": 32, "cpu_direct_avxvnni": 16, "cpu_direct_sdot": 32}
QT_MAX, KT_MAX = 28, 8  # the largest tile (pixels x channel vectors) the kernels take


@dataclass(frozen=True)
class CpuKnobs:
    """The register tile of a CPU inner kernel, as tuning records hold it: ``qt`` output pixels x ``kt`` channel
    vectors of accumulators (0: the kernel's automatic choice for the shape, :func:`auto_tile`)."""

    qt: int = 0
    kt: int = 0


def tile_legal(kernel: str, knobs: "CpuKnobs") -> str | None:
    """Why ``kernel`` (a key of ``REGS``) refuses the tile (None: it takes it): THE check, made by the builders
    (:func:`make_cpu_conv`, ``cpu_conv_vnni.make_cpu_conv_vnni``) and the tuning space (``schedules.space``): sizes
    in 0..QT_MAX / 0..KT_MAX (0: automatic) and ``qt kt`` accumulators, ``kt`` weight vectors and a broadcast in the
    kernel's vector registers."""
    if kernel not in REGS:
        return f"unknown CPU kernel {kernel!r} (one of {', '.join(REGS)})"
    if type(knobs.qt) is not int or type(knobs.kt) is not int:
        return "qt and kt are integers"
    if not (0 <= knobs.qt <= QT_MAX and 0 <= knobs.kt <= KT_MAX):
        return f"tile {knobs.qt} x {knobs.kt} outside 0..{QT_MAX} x 0..{KT_MAX}"
    if (knobs.qt == 0) != (knobs.kt == 0):
        return "qt and kt are both automatic (0) or both given"
    if knobs.qt and knobs.qt * knobs.kt + knobs.kt + 1 > REGS[kernel]:
        return f"tile {knobs.qt} x {knobs.kt} needs more than the {REGS[kernel]} vector registers of {kernel}"
    return None


def auto_tile(spec: ConvSpec, kernel: str) -> "CpuKnobs":
    """The automatic tile of ``kernel`` for ``spec`` (what an untuned layer gets): QT x KT for the AVX2 kernel,
    ``cpu_conv_vnni.choose_tile`` for the dot-product kernels."""
    if kernel == STRATEGY:
        return CpuKnobs(QT, KT)
    from .cpu_conv_vnni import choose_tile

    t = choose_tile(spec, kernel)
    return CpuKnobs(t.qt, t.kt)


def effective_tile(spec: ConvSpec, kernel: str, knobs: "CpuKnobs") -> "CpuKnobs":
    """The tile the kernel is built with for ``spec``: automatic resolved, clamped to the row (Q) and the channel
    vectors (K / lanes), as the builders do -- two knobs with the same effective tile build the same kernel."""
    from .cpu_conv_vnni import ISAS

    if not knobs.qt:
        knobs = auto_tile(spec, kernel)
    lanes = LANES if kernel == STRATEGY else ISAS[kernel].lanes
    return CpuKnobs(min(knobs.qt, spec.Q), min(knobs.kt, -(-spec.K // lanes)))


_X86 = ("x86_64", "i686", "i386", "i586")


def _is_x86(triple: str) -> bool:
    return triple.split("-", 1)[0] in _X86


def _is_plain_llvm(target: tvm.target.Target) -> bool:
    """An llvm target that names no CPU, features or foreign triple: code for this host. (TVM fills in ``mtriple``
    with the system triple itself, so a triple equal to it counts as none given.)"""
    if target.kind.name != "llvm" or "mcpu" in target.attrs or "mattr" in target.attrs:
        return False
    triple = str(target.attrs.get("mtriple", ""))
    return triple in ("", tvm.target.codegen.llvm_get_system_triple())


@functools.lru_cache(maxsize=None)
def host_flags() -> frozenset:
    """The CPU flags of this host's ``/proc/cpuinfo`` (what the kernel enables, not what the CPU model could do);
    empty where there is no /proc or the host is not x86-64."""
    if not tvm.target.codegen.llvm_get_system_triple().startswith("x86_64"):
        return frozenset()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_model_name() -> str:
    """This host's CPU model as tuning records name it: the first ``model name`` of ``/proc/cpuinfo`` (x86), else
    ``cpu (<machine>)`` (``qtune --target llvm`` names the CPU of its records so)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.split(":", 1)[0].strip() == "model name" and line.split(":", 1)[1].strip():
                    return " ".join(line.split(":", 1)[1].split())
    except OSError:
        pass
    return f"cpu ({platform.machine()})"


def _host_llvm_has(feature: str) -> bool:
    host = tvm.target.Target({"kind": "llvm", "mcpu": str(tvm.target.codegen.llvm_get_system_cpu())})
    return bool(tvm.target.codegen.target_has_features(feature, host))


@functools.lru_cache(maxsize=None)
def host_has_avx2() -> bool:
    """Whether this host is x86-64 and its CPU runs AVX2: the ``avx2`` flag of ``/proc/cpuinfo``, else (no /proc)
    what LLVM reports for the host CPU."""
    if not tvm.target.codegen.llvm_get_system_triple().startswith("x86_64"):
        return False
    flags = host_flags()
    return "avx2" in flags if flags else _host_llvm_has("avx2")


# /proc/cpuinfo flags -> LLVM features of the VNNI kernels' targets
_VNNI512_FLAGS = ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx512_vnni")
_AVXVNNI_FLAGS = ("avx_vnni",)


@functools.lru_cache(maxsize=None)
def host_vnni() -> str | None:
    """The VNNI form this host runs: ``"avx512"`` (AVX-512 F/BW/CD/DQ/VL and AVX-512 VNNI: zmm ``vpdpbusd``),
    ``"avx"`` (AVX-VNNI, ymm, e.g. Alder Lake), or None; from ``/proc/cpuinfo`` (else what LLVM reports for the host
    CPU). Only on a host with AVX2 (:func:`host_has_avx2`)."""
    if not host_has_avx2():
        return None
    flags = host_flags()
    has = (lambda fl: all(f in flags for f in fl)) if flags else (
        lambda fl: all(_host_llvm_has(f.replace("_", "")) for f in fl))
    if has(_VNNI512_FLAGS):
        return "avx512"
    return "avx" if has(_AVXVNNI_FLAGS) else None


def cpu_target(target: tvm.target.Target) -> tvm.target.Target:
    """The build target of an llvm build with the CPU kernels: a plain ``llvm`` target (no ``mtriple`` other than the
    host's, no ``mcpu``, no ``mattr``) on an x86-64 host becomes the best level the host runs (:func:`host_vnni`,
    :func:`host_has_avx2`): x86-64-v4 with AVX-512 VNNI (Intel since Ice Lake / Cascade Lake, AMD since Zen 4),
    x86-64-v3 with AVX-VNNI, or x86-64-v3 (AVX2, FMA, BMI2: x86 CPUs since 2013-2015); any other target, and a plain
    one on a host without AVX2, is used as given."""
    if not _is_plain_llvm(target) or not host_has_avx2():
        return target
    cfg = {k: v for k, v in dict(target.export()).items() if k not in ("keys", "tag", "features")}
    vnni = host_vnni()
    cfg["mcpu"] = "x86-64-v4" if vnni == "avx512" else "x86-64-v3"
    if vnni is not None:
        cfg["mattr"] = ["+avx512vnni" if vnni == "avx512" else "+avxvnni"]
    return tvm.target.Target(cfg)


def missing_host_features(target: tvm.target.Target) -> list:
    """The vector features (AVX*, FMA, AMX) an x86 ``target`` enables that this host's ``/proc/cpuinfo`` lacks (its
    code may stop on an illegal instruction here); empty on a host without /proc flags or for another architecture."""
    flags = {f.replace("_", "").replace("-", "") for f in host_flags()}
    triple = str(target.attrs.get("mtriple", "")) or str(tvm.target.codegen.llvm_get_system_triple())
    if not flags or not _is_x86(triple):
        return []
    feats = tvm.target.codegen.llvm_get_cpu_features(target)
    return sorted(f for f in feats if f.startswith(("avx", "fma", "amx")) and f.replace("-", "") not in flags)


def _close(name: str, known) -> str:
    import difflib

    near = difflib.get_close_matches(name, sorted(known), n=3, cutoff=0.6)
    return f"; did you mean {' or '.join(near)}?" if near else ""


def native_cpu() -> tuple:
    """What ``-mcpu=native`` builds for on this host: (mcpu, mattr, note). LLVM's name of the host CPU
    (``llvm_get_system_cpu``) where LLVM knows it and the host runs every vector feature LLVM gives it
    (:func:`missing_host_features`: a hypervisor may hide some); else the host's best kernel level
    (:func:`cpu_target` of plain llvm: x86-64-v4 + AVX-512 VNNI, x86-64-v3 + AVX-VNNI, x86-64-v3)."""
    codegen = tvm.target.codegen
    triple = str(codegen.llvm_get_system_triple())
    name = str(codegen.llvm_get_system_cpu())
    if name and name != "generic" and codegen.llvm_is_valid_cpu(name, triple):
        missing = missing_host_features(tvm.target.Target({"kind": "llvm", "mcpu": name}))
        if not missing:
            return name, (), f"-mcpu=native: this CPU, {name} to LLVM"
        why = f"LLVM's {name} enables {', '.join(missing)}, which this host does not run"
    else:
        why = f"LLVM does not name this CPU ({name or 'no name'})"
    best = cpu_target(tvm.target.Target({"kind": "llvm"}))
    if "mcpu" not in best.attrs:
        return "generic", (), f"-mcpu=native: {why}; the generic CPU of {triple}"
    mattr = tuple(str(a) for a in best.attrs.get("mattr", ()))
    return str(best.attrs["mcpu"]), mattr, f"-mcpu=native: {why}; the host's best kernel level, {best.attrs['mcpu']}"


def target_text(target: tvm.target.Target) -> str:
    """An llvm target as TVM users write it: ``llvm -mtriple=... -mcpu=... -mattr=+a,+b`` (no ``-mtriple`` for this
    host's own triple, which TVM fills in)."""
    parts = [target.kind.name]
    triple = str(target.attrs.get("mtriple", ""))
    if triple and triple != str(tvm.target.codegen.llvm_get_system_triple()):
        parts.append(f"-mtriple={triple}")
    if "mcpu" in target.attrs:
        parts.append(f"-mcpu={target.attrs['mcpu']}")
    if target.attrs.get("mattr"):
        parts.append("-mattr=" + ",".join(str(a) for a in target.attrs["mattr"]))
    return " ".join(parts)


def resolve_target(t) -> tuple:
    """The build target of a ``--target`` string (``qcompile.registry.TargetString``, kind llvm) checked against LLVM:
    (``tvm.target.Target``, or None for plain ``llvm`` -- ``qcompile.pipeline.build`` picks the host's best kernel
    target --, a note for the log). ValueError with the reason for an architecture LLVM does not build for, an
    ``-mcpu`` it does not know for the triple (``native`` on a cross triple included) or an ``-mattr`` feature its
    subtarget for the triple does not have.

    1. the triple: its architecture among LLVM's targets (an unknown one would crash LLVM);
    2. ``-mcpu=native``: :func:`native_cpu`; any other name: ``llvm_is_valid_cpu`` for the triple;
    3. ``-mattr``: each feature known to one of the triple's CPUs (``llvm_get_cpu_features``), else to LLVM's
       subtarget for the triple (:func:`_llvm_knows_feature`)."""
    from qcompile.registry import host_arch, triple_arch

    if t.plain:
        return None, ""
    codegen = tvm.target.codegen
    triple = t.mtriple or str(codegen.llvm_get_system_triple())
    arch = triple_arch(triple)
    if arch not in {triple_arch(a) for a in codegen.llvm_get_targets()}:
        raise ValueError(f"unknown architecture '{triple.split('-', 1)[0]}' in -mtriple (LLVM here builds for "
                         f"{', '.join(sorted(set(codegen.llvm_get_targets())))})")
    cfg = t.to_dict()
    note = ""
    base = tvm.target.Target({"kind": "llvm", "mtriple": triple})
    cpus = [str(c) for c in codegen.llvm_get_cpu_archlist(base)]
    if t.mcpu == "native":
        if t.cross:
            raise ValueError(f"-mcpu=native names this {host_arch()} machine's CPU; a build for {arch} names its "
                             f"CPU (e.g. -mcpu={cpus[0] if cpus else 'NAME'})")
        cfg["mcpu"], mattr, note = native_cpu()
        cfg["mattr"] = list(mattr) + list(t.mattr)
        cfg = {k: v for k, v in cfg.items() if v}
    elif t.mcpu and not codegen.llvm_is_valid_cpu(t.mcpu, triple):
        raise ValueError(f"unknown -mcpu '{t.mcpu}' for {arch} (LLVM {codegen.llvm_version_major()} knows "
                         f"{len(cpus)} {arch} CPUs{_close(t.mcpu, cpus) or ', e.g. ' + ', '.join(cpus[:4])})")
    if t.mattr:
        known = set()
        for cpu in cpus:
            known |= set(codegen.llvm_get_cpu_features(tvm.target.Target({**base.export(), "mcpu": cpu})))
        for f in t.mattr:
            if f[1:] not in known and not _llvm_knows_feature(triple, f[1:]):
                raise ValueError(f"unknown -mattr feature '{f[1:]}' for {arch}{_close(f[1:], known)}")
    return tvm.target.Target(cfg), note


def _llvm_knows_feature(triple: str, name: str) -> bool:
    """Whether LLVM's subtarget for ``triple`` has the feature ``name`` (also one that no named CPU enables, e.g.
    ``retpoline`` on x86): enabled alone (``-mattr=+NAME``) and read back from ``llvm_get_cpu_features``, which lists
    the enabled entries of the subtarget's full feature table. LLVM ignores an unknown name with a warning on stderr,
    which this check keeps off the terminal (the caller reports the name)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)  # (an aarch64 Target asks LLVM for its features when it is made)
            tgt = tvm.target.Target({"kind": "llvm", "mtriple": triple, "mattr": [f"+{name}"]})
            return name in tvm.target.codegen.llvm_get_cpu_features(tgt)
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def target_has_avx2(target: tvm.target.Target) -> bool:
    """Whether LLVM generates AVX2 for ``target``: an llvm target whose triple is x86 (checked first, so that no x86
    question reaches LLVM for another architecture) and whose ``mcpu`` / ``mattr`` enable AVX2. A plain ``llvm``
    target builds for the generic CPU of its triple: no AVX2."""
    if target.kind.name != "llvm":
        return False
    triple = str(target.attrs.get("mtriple", "")) or str(tvm.target.codegen.llvm_get_system_triple())
    if not _is_x86(triple) or ("mcpu" not in target.attrs and "mattr" not in target.attrs):
        return False
    return bool(tvm.target.codegen.target_has_features("avx2", target))


def _is_aarch64(triple: str) -> bool:
    return triple.split("-", 1)[0] in ("aarch64", "arm64")


def target_kernel(target: tvm.target.Target) -> str | None:
    """The inner kernel the CPU kernels use for ``target`` (its ``mtriple`` / ``mcpu`` / ``mattr``, as LLVM sees
    them), or None (the generic path): on x86 with AVX2, ``cpu_direct_amx`` (AMX-INT8 tiles, ``cpu_conv_amx``; its
    layers that AMX does not take run ``cpu_direct_vnni``) where AMX-TILE, AMX-INT8, AVX-512 VNNI and BW are enabled
    (e.g. ``-mcpu=sapphirerapids``; :func:`cpu_target` never enables AMX for a plain llvm target),
    ``cpu_direct_vnni`` (zmm ``vpdpbusd``) where AVX-512 VNNI and BW are, ``cpu_direct_avxvnni`` (ymm ``vpdpbusd``)
    where AVX-VNNI is, else ``cpu_direct_avx2`` (``vpmaddwd``); on aarch64 with dotprod, ``cpu_direct_sdot``. On
    this repository's AVX-512 VNNI host the zmm kernel measures faster than the ymm one (docs/BENCHMARKS.md)."""
    if target.kind.name != "llvm":
        return None
    triple = str(target.attrs.get("mtriple", "")) or str(tvm.target.codegen.llvm_get_system_triple())
    has = lambda f: bool(tvm.target.codegen.target_has_features(f, target))
    if _is_aarch64(triple):  # (no x86 question reaches LLVM for another architecture)
        return "cpu_direct_sdot" if has("dotprod") else None
    if not target_has_avx2(target):
        return None
    if has("avx512vnni") and has("avx512bw"):
        return "cpu_direct_amx" if has("amx-tile") and has("amx-int8") else "cpu_direct_vnni"
    if has("avxvnni"):
        return "cpu_direct_avxvnni"
    return STRATEGY


def applies(spec: ConvSpec) -> str | None:
    """Why the kernel cannot run ``spec`` (None: it can)."""
    if spec.x_dtype not in ("int8", "uint8"):
        return f"activation storage {spec.x_dtype} (the kernel reads bytes)"
    if spec.w_bits not in (4, 8):
        return f"{spec.w_bits}-bit weights"
    if spec.out_dtype not in ("int8", "uint8", "int32"):
        return f"output {spec.out_dtype}"
    if spec.has_residual and spec.res_dtype not in ("int8", "uint8"):
        return f"residual {spec.res_dtype}"
    return None


def pack_weights(w: np.ndarray) -> np.ndarray:
    """Logical weights [K, R, S, C] -> the kernel's int16 [ceil(K/8), R, S, ceil(C/2), 16] (8 channels x 2)."""
    K, R, S, C = w.shape
    kb, c2 = -(-K // LANES), -(-C // 2)
    p = np.zeros((kb * LANES, R, S, c2 * 2), np.int16)
    p[:K, :, :, :C] = w
    p = p.reshape(kb, LANES, R, S, c2, 2).transpose(0, 2, 3, 4, 1, 5)
    return np.ascontiguousarray(p).reshape(kb, R, S, c2, 2 * LANES)


def io_buffers(spec: ConvSpec, nchw: bool) -> tuple:
    """The shapes of the CPU kernels' input, output and residual buffers (a 1-element residual where the spec has
    none) and the storage dtypes of input, output and residual: ``(x_shape, o_shape, res_shape, (x, o, res))``."""
    x_shape = (spec.N, spec.C, spec.H, spec.W) if nchw else (spec.N, spec.H, spec.W, spec.C)
    o_shape = (spec.N, spec.K, spec.P, spec.Q) if nchw else (spec.N, spec.P, spec.Q, spec.K)
    res_shape = o_shape if spec.has_residual else (1,)
    st = ConvSpec.storage
    return x_shape, o_shape, res_shape, (st(spec.x_dtype), st(spec.out_dtype), st(spec.res_dtype))


def output_fns(spec: ConvSpec, nchw: bool, acc_shift: int = 0) -> tuple:
    """The CPU kernels' output indexing and epilogue: ``out_index(n, p, q, k)`` (NCHW or NHWC) and ``epi(acc, k,
    bias, M, S, res, rq2, n, p, q)``, the requantize of ``fallback.epilogue_value`` (the residual read at the output's
    index) on the accumulator shifted right by ``acc_shift``, cast to the output's storage."""
    o_st, resid = ConvSpec.storage(spec.out_dtype), spec.has_residual

    def out_index(n, p, q, k):
        return (n, k, p, q) if nchw else (n, p, q, k)

    def epi(acc_v, k, bias, M, S, res, rq2, n, p, q):
        rv = res[out_index(n, p, q, k)].astype("int32") if resid else None
        if acc_shift:
            acc_v = tirx.shift_right(acc_v, tirx.const(acc_shift, "int32"))
        return epilogue_value(spec, acc_v, k, bias, M, S, rv, rq2 if resid else None).astype(o_st)

    return out_index, epi


def make_cpu_conv(spec: ConvSpec, io_layout: str = "NHWC", tile: CpuKnobs | None = None) -> tvm.tirx.PrimFunc:
    """The kernel for ``spec`` (its NHWC geometry; x, res and out in ``io_layout``, NHWC or NCHW); ``tile``: the
    register tile (default and 0 x 0: QT x KT; :func:`tile_legal` refuses the others before any TIR)."""
    tile = tile or CpuKnobs()
    why = tile_legal(STRATEGY, tile) or applies(spec)
    if why is not None:
        raise ValueError(f"cpu conv kernel: {why}")
    tile = tile if tile.qt else CpuKnobs(QT, KT)
    if io_layout not in ("NHWC", "NCHW"):
        raise ValueError(f"cpu conv kernel: layout {io_layout}")
    N, H, W, C, K, R, S_ = spec.N, spec.H, spec.W, spec.C, spec.K, spec.R, spec.S
    P, Q = spec.P, spec.Q
    sh, sw = spec.strides
    dh, dw = spec.dilations
    pt, pl, pb, pr = spec.pads
    Hp, Wp, C2 = H + pt + pb, W + pl + pr, -(-C // 2)
    KB = -(-K // LANES)
    qt, kt = min(tile.qt, Q), min(tile.kt, KB)
    n_qt, n_kt = -(-Q // qt), -(-KB // kt)
    nchw = io_layout == "NCHW"
    x_shape, o_shape, res_shape, (x_st, o_st, r_st) = io_buffers(spec, nchw)
    padv = int(spec.pad_value)
    whole_k = K % LANES == 0
    resid = spec.has_residual

    def xval(x, n, hp, wp, c):  # the padded input (int32) at padded position (hp, wp), channel c
        h, w_ = hp - pt, wp - pl
        inside = tirx.all(h >= 0, h < H, w_ >= 0, w_ < W)
        hc, wc = tirx.max(tirx.min(h, H - 1), 0), tirx.max(tirx.min(w_, W - 1), 0)
        v = x[n, c, hc, wc] if nchw else x[n, hc, wc, c]
        return tirx.if_then_else(inside, v.astype("int32"), tirx.const(padv, "int32"))

    def pair(x, n, hp, wp, c2):
        lo = xval(x, n, hp, wp, 2 * c2)
        if C % 2:
            hi = tirx.if_then_else(2 * c2 + 1 < C, xval(x, n, hp, wp, tirx.min(2 * c2 + 1, C - 1)), tirx.const(0, "int32"))
        else:
            hi = xval(x, n, hp, wp, 2 * c2 + 1)
        return tirx.bitwise_or(tirx.bitwise_and(lo, tirx.const(0xFFFF, "int32")),
                               tirx.shift_left(hi, tirx.const(16, "int32")))

    out_index, epi = output_fns(spec, nchw)

    @T.prim_func(private=True)
    def kernel(x: T.Buffer(x_shape, x_st), w16: T.Buffer((KB, R, S_, C2, 2 * LANES), "int16"),
               bias: T.Buffer((K,), "int32"), M: T.Buffer((K,), "int32"), S: T.Buffer((K,), "int32"),
               res: T.Buffer(res_shape, r_st), rq2: T.Buffer((5, K), "int32"), out: T.Buffer(o_shape, o_st)):
        T.func_attr({"tirx.noalias": True})
        xp = T.alloc_buffer((N, Hp, Wp, C2), "int32")
        for nh in T.parallel(N * Hp):
            for wp in range(Wp):
                for c2 in range(C2):
                    xp[nh // Hp, nh % Hp, wp, c2] = pair(x, nh // Hp, nh % Hp, wp, c2)
        for task in T.parallel(N * P * n_kt):
            n = T.meta_var(task // (P * n_kt))  # (meta_var: inlined, no per-task local allocation)
            p = T.meta_var(task // n_kt % P)
            # the last channel block is clamped back onto the one before it when kt does not divide KB: those
            # tasks compute the overlapping blocks again and write the same bytes (a benign duplicate write)
            kb0 = T.meta_var(T.min(task % n_kt * kt, KB - kt))
            for qi in range(n_qt):
                # (the same for the row's last tile: shifted back onto the previous one, overlap written twice)
                q0 = T.meta_var(T.min(qi * qt, Q - qt))
                acc = T.alloc_buffer((qt * kt * LANES,), "int32", scope="local")
                for i in T.unroll(qt * kt):
                    acc[T.ramp(i * LANES, 1, LANES)] = T.broadcast(T.int32(0), LANES)
                for r, s, c2 in T.grid(R, S_, C2):
                    for j in T.unroll(kt):
                        wv = T.meta_var(w16[kb0 + j, r, s, c2, T.ramp(0, 1, 2 * LANES)])
                        for i in T.unroll(qt):
                            xv = T.meta_var(T.reinterpret("int16x16", T.broadcast(
                                xp[n, p * sh + r * dh, (q0 + i) * sw + s * dw, c2], LANES)))
                            acc[T.ramp((i * kt + j) * LANES, 1, LANES)] = (
                                acc[T.ramp((i * kt + j) * LANES, 1, LANES)]
                                + T.call_llvm_pure_intrin("int32x8", PMADDWD, xv, wv))
                for i, j in T.grid(qt, kt):
                    if whole_k:
                        for l in T.vectorized(LANES):
                            out[out_index(n, p, q0 + i, (kb0 + j) * LANES + l)] = epi(
                                acc[(i * kt + j) * LANES + l], (kb0 + j) * LANES + l, bias, M, S, res, rq2,
                                n, p, q0 + i)
                    else:
                        for l in range(LANES):
                            if (kb0 + j) * LANES + l < K:
                                out[out_index(n, p, q0 + i, (kb0 + j) * LANES + l)] = epi(
                                    acc[(i * kt + j) * LANES + l], (kb0 + j) * LANES + l, bias, M, S, res, rq2,
                                    n, p, q0 + i)

    f = kernel
    if not resid:  # drop the residual parameters
        f = tvm.tirx.PrimFunc([f.params[i] for i in (0, 1, 2, 3, 4, 7)], f.body, f.ret_type, f.attrs)
    return f.with_attr("qcompile.strategy", STRATEGY)
