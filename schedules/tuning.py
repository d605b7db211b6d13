"""Per-architecture tuning logs: measured best GemmKnobs per conv shape (``tuning_logs/<arch>.json``).

``tuned_knobs(spec, arch)`` returns the knobs recorded for ``spec`` on ``arch`` or ``None``. A missing log for the
arch, or a log whose key fields / knob fields no longer match this code (stale), also gives ``None`` and emits ONE
warning per process per log file, naming it. ``knobs_for(spec, arch)`` is what a compiled model gets: that record,
else the same layer's record at the nearest batch size (``nearest_knobs``), else the arch's defaults
(``spec.default_knobs``: warpgroup-MMA tiles on sm_90 where the operands take them).

Log format (written by ``scripts/tune_layers.py log``)::

    {"format": 1, "arch": "sm_90", "key_fields": [...KEY_FIELDS], "knob_fields": [...GemmKnobs fields],
     "records": {"<tuning_key(spec)>": {"knobs": {BM: .., ...}, "ms": .., "default_ms": .., "date": ..,
                                         "device": .., ...}, ...}}

Where logs are looked up, first hit wins: ``$QCOMPILE_TUNING_DIR``, the installed ``qcompile.tuning_logs``
package, the source tree's ``tuning_logs/`` (an editable install whose package map lacks ``qcompile.tuning_logs``).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import threading
import warnings

from .spec import ConvSpec, GemmKnobs

LOG_FORMAT = 1
# ConvSpec fields that decide the main loop (and so the best tile), and whether the epilogue adds a residual: the
# residual stage reads a second tensor and holds registers the plain epilogue does not (a ping-pong tile tuned without
# it runs 5-7% slower end to end with it, H100), so a conv with a residual add has its own key (``|res``) and falls back
# to the plain key's record where it has none. The rest of the epilogue (out dtype, zero points, clip range,
# signedness) does not enter the key: every requantised variant of a layer shares it.
KEY_FIELDS = ("layout", "N", "H", "W", "C", "K", "R", "S", "stride", "padding", "dilation", "x_bits", "w_bits",
              "has_residual")
KNOB_FIELDS = tuple(f.name for f in dataclasses.fields(GemmKnobs))


class TuningLogWarning(UserWarning):
    """A tuning log is missing or stale: the affected layers take the same layer's record at the nearest batch
    size, or the arch's defaults (``default_knobs``)."""


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
    """GemmKnobs from a record, or None when the record does not fit the current GemmKnobs (stale)."""
    if not isinstance(d, dict) or set(d) != set(KNOB_FIELDS):
        return None
    try:
        kn = GemmKnobs(**d)
    except TypeError:
        return None
    for f, choices in GemmKnobs.SPACE.items():
        if getattr(kn, f) not in choices:
            return None
    return kn if kn.valid() else None


# ---------------------------------------------------------------------------------------------
_LOCK = threading.Lock()
_CACHE: dict[str, dict | None] = {}
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
    """The log file for ``arch`` (the first existing one; else where it would be expected)."""
    cands = [d / f"{arch}.json" for d in log_dirs()]
    for p in cands:
        if p.is_file():
            return p
    return cands[0]


def _warn_once(path: pathlib.Path, why: str):
    key = str(path)
    with _LOCK:
        if key in _WARNED:
            return
        _WARNED.add(key)
    warnings.warn(f"qcompile.schedules: {why} ({path}); using the default knobs. Regenerate it with "
                  f"scripts/tune_layers.py (see tuning_logs/README.md).", TuningLogWarning, stacklevel=3)


def load_log(arch: str) -> dict | None:
    """The parsed log for ``arch`` ({"records": ...}) or None (missing / unreadable / stale: warned once)."""
    path = log_path(arch)
    key = str(path)
    with _LOCK:
        if key in _CACHE:
            return _CACHE[key]
    log, why = None, None
    if not path.is_file():
        why = f"no tuning log for {arch}"
    else:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            data, why = None, f"unreadable tuning log ({type(e).__name__})"
        if data is not None:
            if data.get("format") != LOG_FORMAT:
                why = f"stale tuning log (format {data.get('format')!r}, expected {LOG_FORMAT})"
            elif tuple(data.get("key_fields", ())) != KEY_FIELDS:
                why = "stale tuning log (its spec key fields differ from the current ConvSpec key)"
            elif tuple(data.get("knob_fields", ())) != KNOB_FIELDS:
                why = "stale tuning log (its knob fields differ from the current GemmKnobs)"
            elif not isinstance(data.get("records"), dict):
                why = "stale tuning log (no records)"
            else:
                log = data
    if why:
        _warn_once(path, why)
    with _LOCK:
        _CACHE[key] = log
    return log


def layer_records(spec: ConvSpec, arch: str = "sm_90") -> dict[int, GemmKnobs]:
    """The valid knobs the log records for ``spec``'s layer (every key field but the batch size), by batch size; for a
    conv with a residual add, its own records over the plain conv's (``_lookup_keys``)."""
    log = load_log(arch)
    if log is None:
        return {}
    out = {}
    for own in reversed(_lookup_keys(spec)):  # (the preferred key last: its records win)
        parts = own.split("|")
        for key, rec in log["records"].items():
            p = key.split("|")
            if len(p) != len(parts) or p[:1] + p[2:] != parts[:1] + parts[2:] or not p[1][1:].isdigit():
                continue
            kn = knobs_from_dict(rec.get("knobs"))
            if kn is not None:
                out[int(p[1][1:])] = kn
    return out


def nearest_knobs(spec: ConvSpec, arch: str = "sm_90") -> GemmKnobs | None:
    """For a shape without a record of its own: the knobs recorded for the same layer (``layer_records``) at the other
    batch size nearest in ratio (ties: the larger), with the K-split left to the automatic rule (``split_k=0``: it
    depends on the grid). None when the log has no (valid) record of the layer at another batch."""
    recs = layer_records(spec, arch)
    others = [(abs(math.log(n / spec.N)), -n, n) for n in recs if n != spec.N]
    return recs[min(others)[2]].replace(split_k=0) if others else None


def knobs_for(spec: ConvSpec, arch: str = "sm_90") -> tuple[GemmKnobs, str]:
    """The knobs a compiled model's tensor-core kernel gets for ``spec``, and where they come from: the shape's own
    record ("tuned"); else the same layer's record at the nearest batch size ("nearest"), as long as its block tile
    still makes at least one wave of blocks over the SMs at this batch size (a tile chosen for a larger batch can
    leave most SMs idle: ResNet-50's 512-channel l4 layers at batch 32 on their batch-64 128x128 tiles run 1.35-2.2x
    slower than on the defaults' 64x64, H100); else the arch's defaults ("default": ``spec.default_knobs``, warpgroup
    tiles on sm_90 where the operands take them, sized by the grid)."""
    from .spec import arch_info, default_knobs, tile_grid

    kn = tuned_knobs(spec, arch)
    if kn is not None:
        return kn, "tuned"
    kn = nearest_knobs(spec, arch)
    if kn is not None and tile_grid(spec, kn.BM, kn.BN) >= arch_info(arch).sms:
        return kn, "nearest"
    return default_knobs(spec, arch), "default"


def tuned_knobs(spec: ConvSpec, arch: str = "sm_90") -> GemmKnobs | None:
    """Knobs measured best for ``spec`` on ``arch`` (for a conv with a residual add: its own record, else the plain
    conv's), or None (no log / stale / no record for this shape)."""
    log = load_log(arch)
    if log is None:
        return None
    key = next((k for k in _lookup_keys(spec) if k in log["records"]), None)
    if key is None:
        return None
    kn = knobs_from_dict(log["records"][key].get("knobs"))
    if kn is None:
        _warn_once(log_path(arch), f"stale record {key!r} in tuning log (knobs do not fit GemmKnobs)")
    return kn
