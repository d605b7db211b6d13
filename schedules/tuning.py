"""Tuning logs: measured knobs per conv shape, kernel strategy and GPU (``tuning_logs/<arch>.jsonl``, JSON lines).

One record a line, appendable (``qtune`` appends one line per measured candidate)::

    {"arch": "sm_90", "device": "NVIDIA H100 80GB HBM3", "sms": 132, "key": "<tuning_key(spec)>",
     "strategy": "implicit_gemm", "knobs": {"BM": 128, ...}, "status": "ok", "ms": .., "default_ms": .., ...}

``strategy`` names the kernel whose knobs the record holds (``schedules.STRATEGIES``), and the knobs are parsed with
that strategy's knobs type (``knobs_type``: ``GemmKnobs`` for implicit_gemm and direct_hwnc, ``KtKnobs`` for
implicit_gemm_t, ``HaloKnobs`` for direct_halo, ``CpuKnobs`` for cpu_direct -- the CPU kernels' register tile, whose
records name the CPU inner kernel as ``arch`` and the CPU model as ``device``; ``DwConfig`` for depthwise,
``GroupedConfig`` for grouped and ``GemmKnobs`` for grouped_gemm, whose keys carry the group count, ``|gG``); a
record without one is an
implicit_gemm record. ``status`` (absent:
"ok") is one of ``RECORD_STATUSES``: a candidate that failed (mismatch against the reference, build or run error) is
recorded so that a tuner does not try it again, and is never selected. ``ms`` ranks the OK records of one shape: the
fastest is the one selected.

``knobs_for(spec, arch, device=None, logs=(), strategy="implicit_gemm")`` is what a compiled model gets, from the OK
records of ``arch`` and the strategy (implicit_gemm and direct_hwnc share theirs: both take ``GemmKnobs``, and the key's
layout tells them apart) in every log searched (``logs`` -- files, or folders whose ``*.jsonl`` are read -- first, then
``$QCOMPILE_TUNING_DIR`` or the packaged logs): the shape's fastest record measured on ``device`` ("device"); else its
fastest record of the same arch ("arch": where several GPUs have one, the GPU with the most shapes recorded for the
arch); else the same layer's record at the nearest batch size ("nearest", same GPU preference); else the arch's
defaults ("default": ``spec.default_knobs``). For one GPU and shape, the first log searched that has an OK record
wins. A knob field a record leaves out takes its default (adding a knob stales no record); a field the knobs type no
longer has is ignored (removing a knob stales no record either). A line that does not parse, or whose knobs take a
value outside the space or are not valid together, or whose strategy or status is unknown, is skipped with ONE
``TuningLogWarning`` per file naming the file and line.

Default logs, first hit wins: ``$QCOMPILE_TUNING_DIR`` (when set, the only folder consulted), the installed
``qcompile.tuning_logs`` package, the source tree's ``tuning_logs/``.
"""
from __future__ import annotations

import dataclasses
import gzip
import json
import math
import os
import pathlib
import re
import threading
import warnings
import zlib

from .spec import ConvSpec, GemmKnobs

# ConvSpec fields that decide the main loop (and so the best tile), and whether the epilogue adds a residual: the
# residual stage reads a second tensor and holds registers the plain epilogue does not (a ping-pong tile tuned without
# it runs 5-7% slower end to end with it, H100), so a conv with a residual add has its own key (``|res``) and falls back
# to the plain key's record where it has none. The rest of the epilogue (out dtype, zero points, clip range,
# signedness) does not enter the key: every requantised variant of a layer shares it.
KEY_FIELDS = ("layout", "N", "H", "W", "C", "K", "R", "S", "stride", "padding", "dilation", "x_bits", "w_bits",
              "groups", "has_residual")  # (groups: ``|gG`` where G > 1)
KNOB_FIELDS = tuple(f.name for f in dataclasses.fields(GemmKnobs))
LOG_SUFFIX = ".jsonl"
TRAIN_SUFFIX = ".train.jsonl.gz"  # the cost model's packaged training measurements (``train_log_path``)
# the strategy of a record that names none (logs written before records named their strategy)
RECORD_STRATEGY = "implicit_gemm"
# the kernel strategies records hold knobs for, and the module / class of each one's knobs (``knobs_type``)
RECORD_STRATEGIES = {"implicit_gemm": ("spec", "GemmKnobs"), "direct_hwnc": ("spec", "GemmKnobs"),
                     "implicit_gemm_t": ("igemm_t", "KtKnobs"), "direct_halo": ("stem", "HaloKnobs"),
                     "cpu_direct": ("cpu_conv", "CpuKnobs"),  # (cpu_direct: "arch" is the CPU inner kernel)
                     "depthwise": ("depthwise", "DwConfig"), "grouped": ("grouped", "GroupedConfig"),
                     "grouped_gemm": ("spec", "GemmKnobs")}  # (grouped_gemm: grouped keys, ``|gG``)
# Record "status" values (the same as qcompile.tune.common's Measured.status); only "ok" records are ever selected
RECORD_STATUSES = ("ok", "mismatch", "build_error", "run_error")
SOURCES = ("user", "device", "arch", "nearest", "default")
_KEY_RE = re.compile(r"(NHWC|HWNC|NCHW)\|N(\d+)\|H(\d+)\|W(\d+)\|C(\d+)\|K(\d+)\|R(\d+)\|S(\d+)\|st(\d+),(\d+)"
                     r"\|pad(\d+),(\d+),(\d+),(\d+)\|dil(\d+),(\d+)\|x(\d+)\|w(\d+)(?:\|g(\d+))?(\|res)?")


class TuningLogWarning(UserWarning):
    """A tuning log is missing, or has lines that do not parse or do not fit the current knobs (skipped): the
    affected layers take another record, or the arch's defaults (``default_knobs``)."""


def tuning_key(spec: ConvSpec) -> str:
    """Stable string of the ConvSpec fields in KEY_FIELDS (stride/padding/dilation normalised)."""
    sh, sw = spec.strides
    pads = ",".join(str(p) for p in spec.pads)
    dh, dw = spec.dilations
    return (f"{spec.layout}|N{spec.N}|H{spec.H}|W{spec.W}|C{spec.C}|K{spec.K}|R{spec.R}|S{spec.S}"
            f"|st{sh},{sw}|pad{pads}|dil{dh},{dw}|x{spec.x_bits}|w{spec.w_bits}"
            + (f"|g{spec.groups}" if spec.groups != 1 else "") + ("|res" if spec.has_residual else ""))


def spec_from_key(key: str) -> ConvSpec:
    """A ConvSpec with ``key``'s fields (``tuning_key(spec_from_key(k)) == k``); the epilogue fields the key leaves
    out take the forms the ResNets compile with (unsigned activations, 0..255 / 0..15; the residual of the output's
    type). ValueError for a string that is not a key."""
    m = _KEY_RE.fullmatch(key)
    if not m:
        raise ValueError(f"not a tuning key: {key!r}")
    g = m.groups()
    layout, (N, H, W, C, K, R, S, sh, sw, pt, pl, pb, pr, dh, dw, xb, wb) = g[0], map(int, g[1:18])
    xd = {8: "uint8", 4: "uint4"}.get(xb)
    if xd is None or wb not in (4, 8):
        raise ValueError(f"tuning key {key!r}: {xb}-bit activations / {wb}-bit weights are not kernel operands")
    res = dict(has_residual=True, res_dtype=xd, lo2=0, hi2=(1 << xb) - 1) if g[19] else {}
    groups = int(g[18]) if g[18] else 1
    return ConvSpec(N=N, H=H, W=W, C=C, K=K, R=R, S=S, stride=(sh, sw), padding=(pt, pl, pb, pr), dilation=(dh, dw),
                    layout=layout, x_dtype=xd, w_bits=wb, out_dtype=xd, lo=0, hi=(1 << xb) - 1, groups=groups, **res)


def _lookup_keys(spec: ConvSpec) -> list[str]:
    """The keys a record for ``spec`` may have, preferred first: its own, and for a conv with a residual add the
    plain conv's (tuned without the residual stage)."""
    own = tuning_key(spec)
    return [own, tuning_key(spec.replace(has_residual=False))] if spec.has_residual else [own]


def family(strategy: str) -> str:
    """Strategies whose records serve each other: implicit_gemm and direct_hwnc both take GemmKnobs (their keys'
    layouts differ), the others only themselves."""
    return "gemm" if strategy in ("implicit_gemm", "direct_hwnc") else strategy


def knobs_type(strategy: str) -> type:
    """The knobs dataclass of ``strategy``'s records: its space's (``schedules.space.SPACES``) where it has one, else
    ``RECORD_STRATEGIES``'s. KeyError for a strategy that takes no knobs."""
    from .space import SPACES

    if strategy in SPACES:
        return SPACES[strategy].knobs_type
    mod, name = RECORD_STRATEGIES[strategy]
    import importlib

    return getattr(importlib.import_module(f"{__package__}.{mod}"), name)


def knob_dims(strategy: str) -> dict:
    """The values each knob may take in ``strategy``'s space (``{}``: not declared; types are still checked)."""
    from .space import SPACES

    if strategy in SPACES:
        return dict(SPACES[strategy].dims)
    return dict(getattr(knobs_type(strategy), "SPACE", {}) or {})


def knobs_to_dict(kn) -> dict:
    """Every field of a knobs dataclass (GemmKnobs, KtKnobs, HaloKnobs), as a record stores them."""
    return {f.name: getattr(kn, f.name) for f in dataclasses.fields(kn)}


def knobs_from_dict(d: dict, strategy: str = RECORD_STRATEGY, spec=None, arch: str | None = None,
                    sms: int | None = None):
    """``strategy``'s knobs from a record's knobs, or None when they do not fit (stale): a value of another type, or
    -- with the record's shape (``spec``) and ``arch`` -- knobs its strategy's space does not take for that shape
    (``KernelSpace.legal``: the builder's own check; the sampler's values and the knobs the builder adapts are
    taken); without a shape, a value outside the space's dimensions or knobs not valid together. An absent field
    takes its default; a field the knobs type does not have (a knob since removed) is ignored."""
    if not isinstance(d, dict) or strategy not in RECORD_STRATEGIES:
        return None
    kt = knobs_type(strategy)
    names = {f.name for f in dataclasses.fields(kt)}
    kw = {k: v for k, v in d.items() if k in names}
    try:
        kn, base = kt(**kw), kt()
    except TypeError:
        return None
    for f in kw:  # (bool knobs: 1 == True would pass the choices test)
        if type(getattr(kn, f)) is not type(getattr(base, f)):
            return None
    if spec is not None and arch is not None:
        from .space import SPACES

        try:
            return kn if SPACES[strategy].legal(spec, arch, kn, sms) is None else None
        except Exception:  # noqa: BLE001  (an arch or shape the space does not know: the record is stale)
            return None
    for f, choices in knob_dims(strategy).items():
        if f in names and getattr(kn, f) not in choices:
            return None
    valid = getattr(kn, "valid", None)
    return kn if valid is None or valid() else None


@dataclasses.dataclass(frozen=True)
class Record:
    """One parsed log line."""
    arch: str
    device: str
    key: str
    knobs: object  # the strategy's knobs dataclass
    sms: int | None = None
    strategy: str = RECORD_STRATEGY
    status: str = "ok"
    ms: float | None = None
    default_ms: float | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def round_ms(ms):
    """A time as records store it: 6 significant digits (None stays None)."""
    return None if ms is None else float(f"{float(ms):.6g}")


def make_record(arch: str, device: str, sms: int | None, key: str, strategy: str, knobs, status: str = "ok",
                ms: float | None = None, default_ms: float | None = None, **extra) -> dict:
    """A record as a log stores it (``format_record`` writes it): the identifying fields first, then the
    measurement, then ``extra`` (e.g. ``variant``, ``detail``, ``date``)."""
    if strategy not in RECORD_STRATEGIES:
        raise ValueError(f"no records for strategy {strategy!r} (one of {', '.join(RECORD_STRATEGIES)})")
    if status not in RECORD_STATUSES:
        raise ValueError(f"status {status!r} is not one of {RECORD_STATUSES}")
    rec = dict(arch=arch, device=device, sms=sms, key=key, strategy=strategy, knobs=knobs_to_dict(knobs),
               status=status, ms=round_ms(ms), default_ms=round_ms(default_ms))
    rec.update(extra)
    return rec


def format_record(rec: dict) -> str:
    """One log line (no newline)."""
    return json.dumps(rec, separators=(", ", ": "))


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
    strategy = d.get("strategy", RECORD_STRATEGY)
    if strategy not in RECORD_STRATEGIES:
        return None, f"strategy {strategy!r} (records hold knobs of {', '.join(RECORD_STRATEGIES)})"
    status = d.get("status", "ok")
    if status not in RECORD_STATUSES:
        return None, f"status {status!r} (one of {', '.join(RECORD_STATUSES)})"
    sms = d.get("sms")
    if sms is not None and (not isinstance(sms, int) or isinstance(sms, bool) or sms < 1):
        return None, f"sms {sms!r} is not a positive integer"
    ms = {}
    for f in ("ms", "default_ms"):
        v = d.get(f)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0):
            return None, f"{f} {v!r} is not a positive number"
        ms[f] = None if v is None else float(v)
    kn = knobs_from_dict(d.get("knobs"), strategy, spec_from_key(d["key"]), d["arch"], sms)
    if kn is None:
        return None, (f"knobs do not fit {knobs_type(strategy).__name__} (a value of another type, or knobs the "
                      f"{strategy} space does not take for the record's shape on {d['arch']})")
    return Record(d["arch"], d["device"], d["key"], kn, sms, strategy, status, ms["ms"], ms["default_ms"]), ""


# ---------------------------------------------------------------------------------------------
_LOCK = threading.Lock()
_CACHE: dict[str, tuple] = {}  # path -> ((mtime, size), records)
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


def train_log_path(arch: str) -> pathlib.Path | None:
    """The packaged measurements that train ``qtune``'s cost model first for ``arch`` (``ARCH.train.jsonl.gz`` in
    the first of ``log_dirs`` holding one; ``scripts/make_train_log.py`` writes it); None where there is none. Never
    read for knobs: lookups read ``ARCH.jsonl`` only."""
    for d in log_dirs():
        p = d / f"{arch}{TRAIN_SUFFIX}"
        if p.is_file():
            return p
    return None


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
    if path.name.endswith(TRAIN_SUFFIX):  # (the cost model's training file: no layer reads it)
        then = ("the cost model trains without those measurements. Regenerate it with scripts/make_train_log.py "
                "(see tuning_logs/README.md).")
    else:
        then = "those layers take other records or the default knobs. Regenerate it with qtune (see docs/TUNING.md)."
    warnings.warn(f"qcompile.schedules: {why} ({path}); {then}", TuningLogWarning, stacklevel=3)


def read_log(path) -> list[Record]:
    """The records of one log file, every arch, strategy and status, in file order (cached). Lines that do not fit
    are skipped, with one warning per file naming the file and the first such line."""
    path = pathlib.Path(path)
    try:
        st = path.stat()
        stamp = (st.st_mtime_ns, st.st_size)  # (a log appended to since it was read is read again)
    except OSError:
        stamp = None
    key = str(path.resolve())
    with _LOCK:
        if key in _CACHE and _CACHE[key][0] == stamp:
            return _CACHE[key][1]
    recs, bad = [], []
    try:
        text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
    except (OSError, UnicodeDecodeError, EOFError, zlib.error) as e:  # (a damaged .gz: any of the last three)
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
        _CACHE[key] = (stamp, recs)
    return recs


def _best_of_file(recs: list[Record], arch: str, fam: str) -> dict[str, dict[str, Record]]:
    """``{device: {key: the fastest OK record}}`` of one file's records of ``arch`` and strategy family ``fam``
    (records without ``ms`` rank after timed ones, in file order)."""
    out: dict[str, dict[str, Record]] = {}
    for r in recs:
        if r.arch != arch or not r.ok or family(r.strategy) != fam:
            continue
        have = out.setdefault(r.device, {}).get(r.key)
        if have is None or (r.ms is not None and (have.ms is None or r.ms < have.ms)):
            out[r.device][r.key] = r
    return out


def arch_records(arch: str, logs=(), strategy: str = RECORD_STRATEGY) -> dict[str, dict[str, object]]:
    """``{device: {key: knobs}}`` of ``arch``'s selectable records of ``strategy``'s family in every log searched
    (``log_files``): per GPU and key the fastest OK record of the first log that has one. Devices are ranked for
    arch-level matching: most keys first, ties in the order the logs name them."""
    by_dev: dict[str, dict[str, object]] = {}
    fam = family(strategy)
    for p in log_files(arch, logs):
        for dev, best in _best_of_file(read_log(p), arch, fam).items():
            mine = by_dev.setdefault(dev, {})
            for k, r in best.items():
                mine.setdefault(k, r.knobs)
    order = {d: i for i, d in enumerate(by_dev)}
    return {d: by_dev[d] for d in sorted(by_dev, key=lambda d: (-len(by_dev[d]), order[d]))}


def _devices(recs: dict, device: str | None) -> list[str]:
    """Devices in preference order: ``device`` (where it has records), then the arch ranking."""
    return ([device] if device in recs else []) + [d for d in recs if d != device]


def load_log(arch: str, logs=(), strategy: str = RECORD_STRATEGY) -> dict | None:
    """``{"records": {key: knobs}}`` merged over devices in arch-level preference, or None where there is none."""
    recs = arch_records(arch, logs, strategy)
    if not recs:
        return None
    merged: dict[str, object] = {}
    for d in recs:
        for k, kn in recs[d].items():
            merged.setdefault(k, kn)
    return {"arch": arch, "devices": list(recs), "records": merged}


def _layer_of(records: dict[str, object], spec: ConvSpec) -> dict[int, object]:
    out = {}
    for own in reversed(_lookup_keys(spec)):  # (the preferred key last: its records win)
        parts = own.split("|")
        for key, kn in records.items():
            p = key.split("|")
            if len(p) != len(parts) or p[:1] + p[2:] != parts[:1] + parts[2:] or not p[1][1:].isdigit():
                continue
            out[int(p[1][1:])] = kn
    return out


def layer_records(spec: ConvSpec, arch: str = "sm_90", device: str | None = None, logs=(),
                  strategy: str = RECORD_STRATEGY) -> dict[int, object]:
    """The valid knobs recorded for ``spec``'s layer (every key field but the batch size), by batch size, the
    preferred device's over the others' (``_devices``); for a conv with a residual add, its own records over the
    plain conv's (``_lookup_keys``)."""
    recs = arch_records(arch, logs, strategy)
    out: dict[int, object] = {}
    for d in reversed(_devices(recs, device)):
        out.update(_layer_of(recs[d], spec))
    return out


def _nearest(recs: dict[str, object], spec: ConvSpec):
    layer = _layer_of(recs, spec)
    others = [(abs(math.log(n / spec.N)), -n, n) for n in layer if n != spec.N]
    if not others:
        return None
    kn = layer[min(others)[2]]
    return kn.replace(split_k=0) if isinstance(kn, GemmKnobs) else kn


def nearest_knobs(spec: ConvSpec, arch: str = "sm_90", device: str | None = None, logs=(),
                  strategy: str = RECORD_STRATEGY):
    """For a shape without a record of its own: the knobs the most preferred device (``_devices``) that records the
    same layer at another batch size has at the batch size nearest in ratio (ties: the larger), with a GemmKnobs
    K-split left to the automatic rule (``split_k=0``: it depends on the grid). None when no log records the layer at
    another batch."""
    recs = arch_records(arch, logs, strategy)
    for d in _devices(recs, device):
        kn = _nearest(recs[d], spec)
        if kn is not None:
            return kn
    return None


def _own(spec: ConvSpec, arch: str, device: str | None, logs, strategy: str = RECORD_STRATEGY):
    recs = arch_records(arch, logs, strategy)
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


def tuned_knobs(spec: ConvSpec, arch: str = "sm_90", device: str | None = None, logs=(),
                strategy: str = RECORD_STRATEGY):
    """Knobs measured best for ``spec`` on ``arch`` (``device``'s record, else another GPU's of the arch; for a conv
    with a residual add: its own record, else the plain conv's), or None (no record for this shape)."""
    return _own(spec, arch, device, logs, strategy)[0]


def knobs_for(spec: ConvSpec, arch: str = "sm_90", device: str | None = None, logs=(),
              strategy: str = RECORD_STRATEGY) -> tuple[object, str]:
    """The knobs a compiled model's kernel of ``strategy`` gets for ``spec``, and where they come from: the shape's
    fastest OK record measured on ``device`` ("device"); else its record of the same arch ("arch"); else the same
    layer's record at the nearest batch size ("nearest") -- for GemmKnobs as long as its block tile still makes at
    least one wave of blocks over the SMs at this batch size (a tile chosen for a larger batch can leave most SMs idle:
    ResNet-50's 512-channel l4 layers at batch 32 on their batch-64 128x128 tiles run 1.35-2.2x slower than on the
    defaults' 64x64, H100); else the defaults ("default": for implicit_gemm / direct_hwnc ``spec.default_knobs``,
    warpgroup tiles on sm_90 where the operands take them, sized by the grid; for the other strategies their knobs
    type's own defaults, which the kernel resolves for the shape). ``logs``: tuning log files or folders searched
    before the default log."""
    from .spec import arch_info, default_knobs, tile_grid

    logs = tuple(logs or ())
    kn, source = _own(spec, arch, device, logs, strategy)
    if kn is not None:
        return kn, source
    kn = nearest_knobs(spec, arch, device, logs, strategy)
    if kn is not None and (not isinstance(kn, GemmKnobs) or tile_grid(spec, kn.BM, kn.BN) >= arch_info(arch).sms):
        return kn, "nearest"
    if family(strategy) == "gemm":
        return default_knobs(spec, arch), "default"
    return knobs_type(strategy)(), "default"
