"""Tuning logs: measured best GemmKnobs per conv shape and GPU (``tuning_logs/<arch>.jsonl``, JSON lines).

One record a line, appendable::

    {"arch": "sm_90", "device": "NVIDIA H100 80GB HBM3", "sms": 132, "key": "<tuning_key(spec)>",
     "strategy": "implicit_gemm", "knobs": {"BM": 128, ...}, "ms": .., "default_ms": .., "date": .., ...}

``knobs_for(spec, arch, device=None, logs=())`` is what a compiled model gets, from the records of ``arch`` in every
log searched (``logs`` -- files, or folders whose ``*.jsonl`` are read -- first, then ``$QCOMPILE_TUNING_DIR`` or the
packaged logs): the shape's record measured on ``device`` ("device"); else its record of the same arch ("arch": where
several GPUs have one, the GPU with the most records of the arch); else the same layer's record at the nearest batch
size ("nearest", same GPU preference); else the arch's defaults ("default": ``spec.default_knobs``). A knob field a
record leaves out takes its ``GemmKnobs`` default; a line that does not parse, or whose knobs name an unknown field or
a value outside ``GemmKnobs.SPACE``, is skipped with ONE ``TuningLogWarning`` per file naming the file and line.

Default logs, first hit wins: ``$QCOMPILE_TUNING_DIR`` (when set, the only folder consulted), the installed
``qcompile.tuning_logs`` package, the source tree's ``tuning_logs/``.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import re
import threading
import warnings

from .spec import ConvSpec, GemmKnobs

# ConvSpec fields that decide the main loop (and so the best tile), and whether the epilogue adds a residual: the
# residual stage reads a second tensor and holds registers the plain epilogue does not (a ping-pong tile tuned without
# it runs 5-7% slower end to end with it, H100), so a conv with a residual add has its own key (``|res``) and falls back
# to the plain key's record where it has none. The rest of the epilogue (out dtype, zero points, clip range,
# signedness) does not enter the key: every requantised variant of a layer shares it.
KEY_FIELDS = ("layout", "N", "H", "W", "C", "K", "R", "S", "stride", "padding", "dilation", "x_bits", "w_bits",
              "has_residual")
KNOB_FIELDS = tuple(f.name for f in dataclasses.fields(GemmKnobs))
LOG_SUFFIX = ".jsonl"
# the strategy whose knobs records hold
RECORD_STRATEGY = "implicit_gemm"
SOURCES = ("user", "device", "arch", "nearest", "default")
_KEY_RE = re.compile(r"(NHWC|HWNC|NCHW)\|N\d+\|H\d+\|W\d+\|C\d+\|K\d+\|R\d+\|S\d+\|st\d+,\d+\|pad\d+,\d+,\d+,\d+"
                     r"\|dil\d+,\d+\|x\d+\|w\d+(\|res)?")


class TuningLogWarning(UserWarning):
    """A tuning log is missing, or has lines that do not parse or do not fit the current GemmKnobs (skipped): the
    affected layers take another record, or the arch's defaults (``default_knobs``)."""


def tuning_key(spec: ConvSpec) -> str:
    """Stable string of the ConvSpec fields in KEY_FIELDS (stride/padding/dilation normalised)."""
    sh, sw = spec.strides
    pads = ",".join(str(p) for p in spec.pads)
    dh, dw = spec.dilations
    return (f"{spec.layout}|N{spec.N}|H{spec.H}|W{spec.W}|C{spec.C}|K{spec.K}|R{spec.R}|S{spec.S}"
            f"|st{sh},{sw}|pad{pads}|dil{dh},{dw}|x{spec.x_bits}|w{spec.w_bits}" + ("|res" if spec.has_residual else ""))


def _lookup_keys(spec: ConvSpec) -> list[str]:
    """The keys a record for ``spec`` may have, preferred first: its own, and for a conv with a residual add the
    plain conv's (tuned without the residual stage)."""
    own = tuning_key(spec)
    return [own, tuning_key(spec.replace(has_residual=False))] if spec.has_residual else [own]


def knobs_to_dict(kn: GemmKnobs) -> dict:
    return {f: getattr(kn, f) for f in KNOB_FIELDS}


def knobs_from_dict(d: dict) -> GemmKnobs | None:
    """GemmKnobs from a record's knobs (an absent field takes its GemmKnobs default), or None when they do not fit the
    current GemmKnobs (stale): an unknown field, a value outside ``GemmKnobs.SPACE``, or knobs not valid together."""
    if not isinstance(d, dict) or not set(d) <= set(KNOB_FIELDS):
        return None
    try:
        kn = GemmKnobs(**d)
    except TypeError:
        return None
    for f, choices in GemmKnobs.SPACE.items():
        if getattr(kn, f) not in choices:
            return None
    for f in KNOB_FIELDS:  # (bool knobs: 1 == True would pass the SPACE test)
        if type(getattr(kn, f)) is not type(getattr(GemmKnobs(), f)):
            return None
    return kn if kn.valid() else None


@dataclasses.dataclass(frozen=True)
class Record:
    """One parsed log line."""
    arch: str
    device: str
    key: str
    knobs: GemmKnobs
    sms: int | None = None


def parse_record(line: str) -> tuple[Record | None, str]:
    """(the record, "") or (None, why it does not fit)."""
    try:
        d = json.loads(line)
    except ValueError:
        return None, "not JSON"
    if not isinstance(d, dict):
        return None, "not a JSON object"
    for f in ("arch", "device", "key"):
        if not isinstance(d.get(f), str) or not d[f]:
            return None, f"no {f!r}"
    if not _KEY_RE.fullmatch(d["key"]):
        return None, f"key {d['key']!r} does not fit the current key fields"
    if d.get("strategy", RECORD_STRATEGY) != RECORD_STRATEGY:
        return None, f"strategy {d.get('strategy')!r} (records hold {RECORD_STRATEGY} knobs)"
    sms = d.get("sms")
    if sms is not None and (not isinstance(sms, int) or isinstance(sms, bool) or sms < 1):
        return None, f"sms {sms!r} is not a positive integer"
    kn = knobs_from_dict(d.get("knobs"))
    if kn is None:
        return None, "knobs do not fit GemmKnobs (unknown field, value outside GemmKnobs.SPACE, or invalid together)"
    return Record(d["arch"], d["device"], d["key"], kn, sms), ""


# ---------------------------------------------------------------------------------------------
_LOCK = threading.Lock()
_CACHE: dict[str, list] = {}
_WARNED: set[str] = set()


def clear_cache():
    """Forget loaded logs and which files were warned about (tests; after regenerating a log)."""
    with _LOCK:
        _CACHE.clear()
        _WARNED.clear()


def log_dirs() -> list[pathlib.Path]:
    dirs = []
    env = os.environ.get("QCOMPILE_TUNING_DIR")
    if env:
        return [pathlib.Path(env)]  # explicit: nothing else is consulted
    try:
        import importlib.resources as ir

        dirs.append(pathlib.Path(str(ir.files("qcompile.tuning_logs"))))
    except (ModuleNotFoundError, TypeError):
        pass
    src = pathlib.Path(__file__).resolve().parents[1] / "tuning_logs"
    if src not in dirs:
        dirs.append(src)
    return dirs


def log_path(arch: str) -> pathlib.Path:
    """The default log file for ``arch`` (the first existing one; else where it would be expected)."""
    cands = [d / f"{arch}{LOG_SUFFIX}" for d in log_dirs()]
    for p in cands:
        if p.is_file():
            return p
    return cands[0]


def log_files(arch: str, logs=()) -> list[pathlib.Path]:
    """The files searched for ``arch``, in order: each of ``logs`` (a file, or a folder: its ``*.jsonl``, sorted),
    then the default log (``log_path``) where it exists."""
    out = []
    for p in map(pathlib.Path, logs):
        out += sorted(p.glob(f"*{LOG_SUFFIX}")) if p.is_dir() else [p]
    default = log_path(arch)
    if default.is_file():
        out.append(default)
    elif not logs:
        _warn_once(default, f"no tuning log for {arch}")
    seen, uniq = set(), []
    for p in out:
        r = str(p.resolve())
        if r not in seen:
            seen.add(r)
            uniq.append(p)
    return uniq


def _warn_once(path: pathlib.Path, why: str):
    key = str(path)
    with _LOCK:
        if key in _WARNED:
            return
        _WARNED.add(key)
    warnings.warn(f"qcompile.schedules: {why} ({path}); those layers take other records or the default knobs. "
                  f"Regenerate it with scripts/tune_layers.py (see tuning_logs/README.md).", TuningLogWarning,
                  stacklevel=3)


def read_log(path) -> list[Record]:
    """The records of one log file, every arch (cached). Lines that do not fit are skipped, with one warning per file
    naming the file and the first such line."""
    path = pathlib.Path(path)
    key = str(path.resolve())
    with _LOCK:
        if key in _CACHE:
            return _CACHE[key]
    recs, bad = [], []
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        text, bad = "", [(0, f"unreadable ({type(e).__name__})")]
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        rec, why = parse_record(line)
        if rec is None:
            bad.append((i, why))
        else:
            recs.append(rec)
    if bad:
        (line, why), more = bad[0], len(bad) - 1
        where = f"line {line}: {why}" if line else why
        _warn_once(path, f"skipped {len(bad)} stale or unreadable record(s) in tuning log, {where}"
                         + (f" (and {more} more)" if more else ""))
    with _LOCK:
        _CACHE[key] = recs
    return recs


def arch_records(arch: str, logs=()) -> dict[str, dict[str, GemmKnobs]]:
    """``{device: {key: knobs}}`` of ``arch``'s records in every log searched (``log_files``), the devices ranked
    for arch-level matching: most records first, ties in the order the logs name them. For the same device and key
    the first log searched wins."""
    by_dev: dict[str, dict[str, GemmKnobs]] = {}
    for p in log_files(arch, logs):
        for r in read_log(p):
            if r.arch == arch:
                by_dev.setdefault(r.device, {}).setdefault(r.key, r.knobs)
    order = {d: i for i, d in enumerate(by_dev)}
    return {d: by_dev[d] for d in sorted(by_dev, key=lambda d: (-len(by_dev[d]), order[d]))}


def _devices(recs: dict, device: str | None) -> list[str]:
    """Devices in preference order: ``device`` (where it has records), then the arch ranking."""
    return ([device] if device in recs else []) + [d for d in recs if d != device]


def load_log(arch: str, logs=()) -> dict | None:
    """``{"records": {key: knobs}}`` merged over devices in arch-level preference, or None where there is none."""
    recs = arch_records(arch, logs)
    if not recs:
        return None
    merged: dict[str, GemmKnobs] = {}
    for d in recs:
        for k, kn in recs[d].items():
            merged.setdefault(k, kn)
    return {"arch": arch, "devices": list(recs), "records": merged}


def _layer_of(records: dict[str, GemmKnobs], spec: ConvSpec) -> dict[int, GemmKnobs]:
    out = {}
    for own in reversed(_lookup_keys(spec)):  # (the preferred key last: its records win)
        parts = own.split("|")
        for key, kn in records.items():
            p = key.split("|")
            if len(p) != len(parts) or p[:1] + p[2:] != parts[:1] + parts[2:] or not p[1][1:].isdigit():
                continue
            out[int(p[1][1:])] = kn
    return out


def layer_records(spec: ConvSpec, arch: str = "sm_90", device: str | None = None, logs=()) -> dict[int, GemmKnobs]:
    """The valid knobs recorded for ``spec``'s layer (every key field but the batch size), by batch size, the
    preferred device's over the others' (``_devices``); for a conv with a residual add, its own records over the
    plain conv's (``_lookup_keys``)."""
    recs = arch_records(arch, logs)
    out: dict[int, GemmKnobs] = {}
    for d in reversed(_devices(recs, device)):
        out.update(_layer_of(recs[d], spec))
    return out


def _nearest(recs: dict[str, GemmKnobs], spec: ConvSpec) -> GemmKnobs | None:
    layer = _layer_of(recs, spec)
    others = [(abs(math.log(n / spec.N)), -n, n) for n in layer if n != spec.N]
    return layer[min(others)[2]].replace(split_k=0) if others else None


def nearest_knobs(spec: ConvSpec, arch: str = "sm_90", device: str | None = None, logs=()) -> GemmKnobs | None:
    """For a shape without a record of its own: the knobs the most preferred device (``_devices``) that records the
    same layer at another batch size has at the batch size nearest in ratio (ties: the larger), with the K-split left
    to the automatic rule (``split_k=0``: it depends on the grid). None when no log records the layer at another
    batch."""
    recs = arch_records(arch, logs)
    for d in _devices(recs, device):
        kn = _nearest(recs[d], spec)
        if kn is not None:
            return kn
    return None


def _own(spec: ConvSpec, arch: str, device: str | None, logs) -> tuple[GemmKnobs | None, str]:
    recs = arch_records(arch, logs)
    keys = _lookup_keys(spec)
    if device in recs:
        for k in keys:
            if k in recs[device]:
                return recs[device][k], "device"
    for k in keys:
        for d in recs:
            if d != device and k in recs[d]:
                return recs[d][k], "arch"
    return None, ""


def tuned_knobs(spec: ConvSpec, arch: str = "sm_90", device: str | None = None, logs=()) -> GemmKnobs | None:
    """Knobs measured best for ``spec`` on ``arch`` (``device``'s record, else another GPU's of the arch; for a conv
    with a residual add: its own record, else the plain conv's), or None (no record for this shape)."""
    return _own(spec, arch, device, logs)[0]


def knobs_for(spec: ConvSpec, arch: str = "sm_90", device: str | None = None, logs=()) -> tuple[GemmKnobs, str]:
    """The knobs a compiled model's tensor-core kernel gets for ``spec``, and where they come from: the shape's record
    measured on ``device`` ("device"); else its record of the same arch ("arch"); else the same layer's record at the
    nearest batch size ("nearest"), as long as its block tile still makes at least one wave of blocks over the SMs at
    this batch size (a tile chosen for a larger batch can leave most SMs idle: ResNet-50's 512-channel l4 layers at
    batch 32 on their batch-64 128x128 tiles run 1.35-2.2x slower than on the defaults' 64x64, H100); else the arch's
    defaults ("default": ``spec.default_knobs``, warpgroup tiles on sm_90 where the operands take them, sized by the
    grid). ``logs``: tuning log files or folders searched before the default log."""
    from .spec import arch_info, default_knobs, tile_grid

    logs = tuple(logs or ())
    kn, source = _own(spec, arch, device, logs)
    if kn is not None:
        return kn, source
    kn = nearest_knobs(spec, arch, device, logs)
    if kn is not None and tile_grid(spec, kn.BM, kn.BN) >= arch_info(arch).sms:
        return kn, "nearest"
    return default_knobs(spec, arch), "default"
