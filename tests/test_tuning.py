"""Tuning logs (tuning_logs/<arch>.jsonl, JSON lines): their records as qtune writes them, the kernel spaces qtune
draws candidates from, and the records' use by conv2d_int_kernel and qcompile: fast, no GPU."""
from __future__ import annotations

import json
import os
import warnings

import pytest

from qcompile.schedules import (DEFAULT_KNOBS, ConvSpec, conv2d_int_kernel, default_knobs, knobs_for, tuned_knobs,
                                tuning_key)
from qcompile.schedules import tuning as TU
from qcompile.schedules.igemm import _adapt_knobs
from qcompile.schedules.layers import ALL_RESNET


@pytest.fixture(autouse=True)
def _fresh_cache(monkeypatch):
    monkeypatch.delenv("QCOMPILE_TUNING_DIR", raising=False)
    TU.clear_cache()
    yield
    TU.clear_cache()


BATCHES = (1, 8, 64, 256)  # (the batch sizes the shipped log was tuned at)


def _specs():
    """The shapes the shipped log records (ResNet-18/50 at batch 1, 8, 64, 256; INT8, INT4 NHWC; the RGB stem also as
    compiled models run it: padded to 4 channels, and in its space-to-depth form; the convs that carry a residual add
    also with it)."""
    from qcompile.schedules.spec import space_to_depth

    for N in BATCHES:
        for (_, C, H, K, R, st, pd) in ALL_RESNET:
            yield ConvSpec(N=N, H=H, W=H, C=C, K=K, R=R, S=R, stride=st, padding=pd, x_dtype="uint8",
                           out_dtype="uint8", lo=0, hi=255)
            if C % 4:
                c4 = ConvSpec(N=N, H=H, W=H, C=C + (-C % 4), K=K, R=R, S=R, stride=st, padding=pd, x_dtype="uint8",
                              out_dtype="uint8", lo=0, hi=255)
                yield c4
                yield space_to_depth(c4)
            if C % 2 == 0:
                yield ConvSpec(N=N, H=H, W=H, C=C, K=K, R=R, S=R, stride=st, padding=pd, x_dtype="uint4", w_bits=4,
                               out_dtype="uint4", lo=0, hi=15)
            if R == 3 and st == 1 and C == K:  # (ResNet-18's second 3x3 of a block carries its residual add)
                yield ConvSpec(N=N, H=H, W=H, C=C, K=K, R=R, S=R, stride=st, padding=pd, x_dtype="uint8",
                               out_dtype="uint8", has_residual=True, res_dtype="uint8")
                yield ConvSpec(N=N, H=H, W=H, C=C, K=K, R=R, S=R, stride=st, padding=pd, x_dtype="uint4", w_bits=4,
                               out_dtype="uint4", lo=-8, hi=7, has_residual=True, res_dtype="uint4")
            if R == 1:  # (the 1x1 expansions carry ResNet-50's residual add: tuned with it, key ...|res)
                yield ConvSpec(N=N, H=H, W=H, C=C, K=K, R=R, S=R, stride=st, padding=pd, x_dtype="uint8",
                               out_dtype="uint8", has_residual=True, res_dtype="uint8")
                yield ConvSpec(N=N, H=H, W=H, C=C, K=K, R=R, S=R, stride=st, padding=pd, x_dtype="uint4", w_bits=4,
                               out_dtype="uint4", lo=-8, hi=7, has_residual=True, res_dtype="uint4")


H100, H200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"  # (the GPUs the shipped log was measured on)


def _all():
    """The shipped log's records as written, in file order."""
    return [json.loads(ln) for ln in TU.log_path("sm_90").read_text().splitlines()]


def _raw(device=H100):
    """The shipped log's records of one GPU as written, by key (every strategy; the log has one strategy a key). The
    H100's by default: a lookup that names no GPU prefers it (``test_log_loads``)."""
    out = {}
    for r in _all():
        if r["device"] == device:
            assert r["key"] not in out, r["key"]
            out[r["key"]] = r
    return out


def _gemm(recs):
    """The implicit_gemm records of ``recs`` (GemmKnobs: what ``tuned_knobs`` / ``knobs_for`` look up by default)."""
    return {k: r for k, r in recs.items() if r["strategy"] == "implicit_gemm"}


def _write(path, recs):
    """A JSON-lines log of ``recs`` (dicts)."""
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


def _tuned_spec():
    """A tuned spec (an implicit GEMM conv without a residual add) whose knobs differ from the defaults (a 3x3 layer
    if there is one)."""
    recs = _gemm(_raw())
    found = [s for s in _specs() if not s.has_residual and tuning_key(s) in recs
             and recs[tuning_key(s)]["variant"] != "default"
             and TU.knobs_from_dict(recs[tuning_key(s)]["knobs"]) != default_knobs(s, "sm_90")]
    assert found, "the sm_90 log records no non-default knobs"
    return next((s for s in found if s.R == 3), found[0])


def _no_warnings(fn, *a):
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out = fn(*a)
    assert not [x for x in w if issubclass(x.category, TU.TuningLogWarning)], [str(x.message) for x in w]
    return out


def test_log_loads():
    """The shipped log: one record a line, one per key, GPU and strategy family (qtune's fastest OK record of each),
    sorted by (key, GPU, strategy); each names arch, GPU, SM count, key, strategy and status "ok", its knobs legal in
    its strategy's space for its shape (GemmKnobs also valid), its time at most the defaults' (equal for the default
    variant); every key a shape of the ResNets (``_specs``), recorded on both GPUs -- an H100 and an H200, 132 SMs
    each -- in the strategy ``select_strategy`` gives the shape (no record a compiled model never reads); every record
    loads without a warning, a lookup naming no GPU preferring the H100's."""
    from qcompile.schedules import GemmKnobs, select_strategy
    from qcompile.schedules.space import SPACES

    lines = TU.log_path("sm_90").read_text().splitlines()
    assert TU.log_path("sm_90").name == "sm_90.jsonl" and len(lines) == 552
    recs = [json.loads(ln) for ln in lines]
    ids = [(r["key"], r["device"], r["strategy"]) for r in recs]
    assert ids == sorted(ids)
    assert len({(r["key"], r["device"], TU.family(r["strategy"])) for r in recs}) == len(recs)  # (one per family)
    keys = {tuning_key(s) for s in _specs()}
    for rec in recs:
        assert list(rec)[:7] == ["arch", "device", "sms", "key", "strategy", "knobs", "status"], rec
        assert (rec["arch"], rec["sms"], rec["status"]) == ("sm_90", 132, "ok") and rec["device"] in (H100, H200), rec
        assert rec["strategy"] in ("implicit_gemm", "implicit_gemm_t", "direct_halo"), rec
        assert rec["key"] in keys, rec["key"]
        assert select_strategy(TU.spec_from_key(rec["key"]), "sm_90") == rec["strategy"], rec
        parsed, why = TU.parse_record(json.dumps(rec))
        assert parsed is not None and not why, (rec, why)
        assert SPACES[rec["strategy"]].legal(TU.spec_from_key(rec["key"]), "sm_90", parsed.knobs, rec["sms"]) is None
        assert not isinstance(parsed.knobs, GemmKnobs) or parsed.knobs.valid(), rec
        assert rec["ms"] > 0 and rec["default_ms"] > 0 and rec["ms"] <= rec["default_ms"]
        assert rec["variant"] in ("default", "planned", "trial") and (rec["variant"] == "default") == (
            rec["ms"] == rec["default_ms"]), rec
    by_dev = {d: {(r["key"], r["strategy"]) for r in recs if r["device"] == d} for d in (H100, H200)}
    assert by_dev[H100] == by_dev[H200] and len(by_dev[H100]) == 276
    log = _no_warnings(TU.load_log, "sm_90")
    assert log["devices"] == [H100, H200]  # (as many keys each: the GPU the log names first)
    for strategy in ("implicit_gemm", "implicit_gemm_t", "direct_halo"):
        got = TU.load_log("sm_90", strategy=strategy)["records"]
        assert set(got) == {r["key"] for r in recs if r["strategy"] == strategy}, strategy
        assert got == {k: TU.knobs_from_dict(r["knobs"], strategy) for k, r in _raw(H100).items()
                       if r["strategy"] == strategy}


def test_log_is_package_data():
    import tomllib
    import pathlib

    pp = tomllib.loads((pathlib.Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "qcompile.tuning_logs" in pp["packages"]
    assert pp["package-dir"]["qcompile.tuning_logs"] == "tuning_logs"
    assert "*.jsonl" in pp["package-data"]["qcompile.tuning_logs"]
    assert TU.log_path("sm_90").is_file() and not TU.log_path("sm_90").with_suffix(".json").exists()


def test_packaged_training_measurements(tmp_path):
    """tuning_logs/sm_90.train.jsonl.gz (qtune's cost model trains on it first): package data, gzip JSON lines that
    load without a warning, OK timed sm_90 records of the strategies with a space, one per GPU, task, strategy and
    effective knobs; never read by lookups; exactly what scripts/make_train_log.py writes from the committed
    measurement logs. A damaged .gz file is skipped with a warning naming the script that writes it."""
    import gzip
    import pathlib
    import subprocess
    import sys
    import tomllib

    from qcompile.schedules.space import SPACES

    root = pathlib.Path(__file__).resolve().parents[1]
    pp = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "*.train.jsonl.gz" in pp["package-data"]["qcompile.tuning_logs"]
    path = TU.train_log_path("sm_90")
    assert path is not None and path.name == "sm_90.train.jsonl.gz" and TU.train_log_path("sm_75") is None
    assert path not in TU.log_files("sm_90", [path.parent])  # (a folder given to qcompile: its *.jsonl only)
    recs = _no_warnings(TU.read_log, path)
    assert len(recs) > 5000 and len(recs) == len(gzip.decompress(path.read_bytes()).decode().splitlines())
    assert {r.arch for r in recs} == {"sm_90"} and all(r.ok and r.ms > 0 and r.strategy in SPACES for r in recs)
    ids = {(r.device, r.key, r.strategy, SPACES[r.strategy].point_id(TU.spec_from_key(r.key), r.arch, r.knobs))
           for r in recs}
    assert len(ids) == len(recs) and len({r.device for r in recs}) == 2
    out = tmp_path / "again.jsonl.gz"
    subprocess.run([sys.executable, str(root / "scripts" / "make_train_log.py"), "--arch", "sm_90", "-o", str(out)],
                   check=True, capture_output=True)
    assert gzip.decompress(out.read_bytes()) == gzip.decompress(path.read_bytes())
    good = gzip.compress(b"\n".join(gzip.decompress(path.read_bytes()).splitlines()[:50]) + b"\n")
    for i, data in enumerate((b"not gzip", good[:len(good) // 2], good[:12] + bytes(len(good) - 12))):
        bad = tmp_path / f"bad{i}.train.jsonl.gz"  # (not gzip, cut short, damaged after its header)
        bad.write_bytes(data)
        with pytest.warns(TU.TuningLogWarning, match="unreadable.*scripts/make_train_log.py"):
            assert TU.read_log(bad) == []


def test_key_is_stable_and_ignores_the_epilogue_but_the_residual():
    a = ConvSpec(N=64, H=14, W=14, C=256, K=256, R=3, S=3, stride=1, padding=1, x_dtype="uint8", out_dtype="uint8")
    b = a.replace(stride=(1, 1), padding=(1, 1, 1, 1), x_dtype="int8", out_dtype="int32", zo=5, lo=-3)
    assert tuning_key(a) == tuning_key(b) == "NHWC|N64|H14|W14|C256|K256|R3|S3|st1,1|pad1,1,1,1|dil1,1|x8|w8"
    assert tuning_key(a.replace(N=8)) != tuning_key(a) and tuning_key(a.replace(x_dtype="uint4", w_bits=4)) != tuning_key(a)
    r = a.replace(has_residual=True, res_dtype="int8")
    assert tuning_key(r) == tuning_key(r.replace(res_dtype="uint8", zo2=4, res_i32=True)) == tuning_key(a) + "|res"


def test_residual_conv_prefers_its_own_record(tmp_path, monkeypatch):
    """A conv with a residual add gets the record tuned with the residual stage (key ...|res) where the log has one,
    else the plain conv's record (and at another batch size, its own layer's records over the plain ones)."""
    spec = _tuned_spec()
    res = spec.replace(has_residual=True, res_dtype="uint8")
    plain_kn = _no_warnings(tuned_knobs, spec, "sm_90")
    recs = _raw()  # (the H100's records: the log written below has one GPU's)
    # every residual conv the shipped log records gets its own record, the plain conv its own
    pairs = [(s, s.replace(has_residual=False)) for s in _specs() if s.has_residual and tuning_key(s) in _gemm(recs)]
    assert pairs and any(recs[tuning_key(r)]["knobs"] != recs[tuning_key(p)]["knobs"] for r, p in pairs)
    for r, p in pairs:  # (a plain conv without an implicit_gemm record of its own: none)
        assert tuned_knobs(r, "sm_90") == TU.knobs_from_dict(recs[tuning_key(r)]["knobs"])
        plain = _gemm(recs).get(tuning_key(p))
        assert tuned_knobs(p, "sm_90") == (plain and TU.knobs_from_dict(plain["knobs"]))
    recs.pop(tuning_key(res), None)
    for n in (spec.N, spec.N * 2):  # (N * 2: no record of its own in either form -- the nearest batch decides)
        recs.pop(tuning_key(res.replace(N=n * 2)), None)
        recs.pop(tuning_key(spec.replace(N=n * 2)), None)
    _write(tmp_path / "sm_90.jsonl", recs.values())
    monkeypatch.setenv("QCOMPILE_TUNING_DIR", str(tmp_path))
    TU.clear_cache()
    assert _no_warnings(tuned_knobs, res, "sm_90") == plain_kn  # no residual record: the plain conv's
    other = plain_kn.replace(BM=64 if plain_kn.BM != 64 else 128, split_k=0)
    assert other.valid() and other != plain_kn
    recs[tuning_key(res)] = dict(recs[tuning_key(spec)], key=tuning_key(res), knobs=TU.knobs_to_dict(other))
    _write(tmp_path / "sm_90.jsonl", recs.values())
    TU.clear_cache()
    assert tuned_knobs(res, "sm_90") == other and tuned_knobs(spec, "sm_90") == plain_kn
    assert TU.layer_records(res.replace(N=spec.N * 2), "sm_90")[spec.N] == other
    assert TU.layer_records(spec.replace(N=spec.N * 2), "sm_90")[spec.N] == plain_kn
    f = conv2d_int_kernel(res, "sm_90")
    assert str(f.attrs["qcompile.knobs_source"]) == "arch" and str(f.attrs["qcompile.knobs"]) == str(
        _adapt_knobs(res, other, "NHWC"))


def test_tuned_spec_gets_its_knobs():
    spec = _tuned_spec()
    rec = _raw()[tuning_key(spec)]
    kn = _no_warnings(tuned_knobs, spec, "sm_90")
    assert kn == TU.knobs_from_dict(rec["knobs"]) and kn != _adapt_knobs(spec, DEFAULT_KNOBS["sm_90"], "NHWC")
    f = conv2d_int_kernel(spec, "sm_90")
    assert str(f.attrs["qcompile.knobs_source"]) == "arch" and str(f.attrs["qcompile.knobs"]) == str(kn)
    f = conv2d_int_kernel(spec, "sm_90", device=H100)  # (the GPU the records were measured on)
    assert str(f.attrs["qcompile.knobs_source"]) == "device" and str(f.attrs["qcompile.knobs"]) == str(kn)
    k200 = TU.knobs_from_dict(_raw(H200)[tuning_key(spec)]["knobs"])  # (the other GPU: its own record)
    assert _no_warnings(tuned_knobs, spec, "sm_90", H200) == k200
    f = conv2d_int_kernel(spec, "sm_90", device=H200)
    assert str(f.attrs["qcompile.knobs_source"]) == "device" and str(f.attrs["qcompile.knobs"]) == str(k200)
    # an explicit knobs argument still wins
    f = conv2d_int_kernel(spec, "sm_90", knobs=DEFAULT_KNOBS["sm_90"])
    assert str(f.attrs["qcompile.knobs_source"]) == "user"


def test_unknown_spec_falls_back_to_defaults():
    spec = ConvSpec(N=3, H=17, W=17, C=24, K=40, R=3, S=3, padding=1, x_dtype="uint8", out_dtype="uint8", lo=0, hi=255)
    assert _no_warnings(tuned_knobs, spec, "sm_90") is None
    f = conv2d_int_kernel(spec, "sm_90")
    assert str(f.attrs["qcompile.knobs_source"]) == "default"
    assert str(f.attrs["qcompile.knobs"]) == str(_adapt_knobs(spec, DEFAULT_KNOBS["sm_90"], "NHWC"))


def _count(fn):
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        fn()
    return [str(x.message) for x in w if issubclass(x.category, TU.TuningLogWarning)]


def test_missing_log_warns_once_and_falls_back(tmp_path, monkeypatch):
    monkeypatch.setenv("QCOMPILE_TUNING_DIR", str(tmp_path))
    spec = ConvSpec(N=64, H=14, W=14, C=256, K=256, R=3, S=3, padding=1, x_dtype="uint8", out_dtype="uint8")
    kernels = []
    # (the implicit GEMM forced: at batch 64 the selector gives this 14x14 conv to implicit_gemm_t, which has no log)
    msgs = _count(lambda: [tuned_knobs(spec, "sm_90"), kernels.append(conv2d_int_kernel(spec, "sm_90", "implicit_gemm")),
                           kernels.append(conv2d_int_kernel(spec.replace(N=8), "sm_90")), tuned_knobs(spec, "sm_90")])
    assert len(msgs) == 1 and str(tmp_path / "sm_90.jsonl") in msgs[0]
    assert tuned_knobs(spec, "sm_90") is None
    assert all(str(f.attrs["qcompile.knobs_source"]) == "default" for f in kernels)
    assert default_knobs(spec, "sm_90").mma == "wgmma"  # (16-byte channel vectors: the warpgroup-MMA default)
    assert str(kernels[0].attrs["qcompile.knobs"]) == str(_adapt_knobs(spec, default_knobs(spec, "sm_90"), "NHWC"))


@pytest.mark.parametrize("how", ["outside_space", "not_json", "old_key", "unknown_strategy", "unknown_status"])
def test_stale_record_is_skipped_with_one_warning(tmp_path, monkeypatch, how):
    """A record whose knobs take a value outside GemmKnobs.SPACE is stale: skipped, with ONE warning naming the file
    and the line; so is a line that is not JSON, or whose key, strategy or status does not fit. The other records
    still apply."""
    spec = _tuned_spec()
    recs = _raw()  # (one GPU's records: no other GPU's record of the shape stands in for the stale one)
    lines = [json.dumps(r) for r in recs.values()]
    at = list(recs).index(tuning_key(spec))
    rec = dict(recs[tuning_key(spec)], knobs=dict(recs[tuning_key(spec)]["knobs"]))
    if how == "outside_space":
        rec["knobs"]["BM"] = 96
        lines[at] = json.dumps(rec)
    else:  # (an extra line before the record: the record itself still applies)
        lines.insert(at, {"not_json": '{"arch": "sm_90", "device": "x", "key": ',
                              "old_key": json.dumps(dict(rec, key=rec["key"].replace("|dil1,1", ""))),
                              "unknown_strategy": json.dumps(dict(rec, strategy="winograd")),
                              "unknown_status": json.dumps(dict(rec, status="pending"))}[how])
    (tmp_path / "sm_90.jsonl").write_text("\n".join(lines) + "\n")
    monkeypatch.setenv("QCOMPILE_TUNING_DIR", str(tmp_path))
    kernels = []
    msgs = _count(lambda: [kernels.append(conv2d_int_kernel(spec, "sm_90")) for _ in range(3)])
    assert len(msgs) == 1 and str(tmp_path / "sm_90.jsonl") in msgs[0] and f"line {at + 1}:" in msgs[0], msgs  # (1-based)
    assert "skipped 1 " in msgs[0]
    if how != "outside_space":
        assert all(str(f.attrs["qcompile.knobs_source"]) == "arch" for f in kernels)
        assert tuned_knobs(spec, "sm_90") == TU.knobs_from_dict(recs[tuning_key(spec)]["knobs"])
        return
    # (the stale record: the layer's records at other batch sizes still apply where their tile fills the SMs)
    from qcompile.schedules import arch_info

    near = TU.nearest_knobs(spec, "sm_90")
    assert near is not None
    grid = -(-spec.N * spec.P * spec.Q // near.BM) * -(-spec.K // near.BN)
    src = "nearest" if grid >= arch_info("sm_90").sms else "default"
    assert all(str(f.attrs["qcompile.knobs_source"]) == src for f in kernels)
    assert tuned_knobs(spec, "sm_90") is None


def test_untuned_batch_takes_the_nearest_batch_record():
    """A ResNet layer at a batch size the log has no record for gets the same layer's record at the batch size
    nearest in ratio (the log's 1, 8, 64, 256: 2 -> 1, 4 -> 8, 12 -> 8, 16 -> 8, 24 -> 64, 32 -> 64, 48 -> 64,
    192 -> 256, and 128 -> 256: a tie, the larger), of the GPU a lookup naming none prefers, its K-split left to the
    automatic rule, while that record's tile still makes a wave of blocks over the SMs; else the arch's defaults. The
    source says which."""
    from qcompile.schedules import arch_info

    recs = _gemm(_raw())  # (the H100's implicit_gemm records: what an implicit_gemm lookup naming no GPU takes)
    seen = set()
    for spec64 in (s for s in _specs() if s.N == 64 and s.R == 3 and tuning_key(s) in recs):
        for n, near in ((2, 1), (4, 8), (12, 8), (16, 8), (24, 64), (32, 64), (48, 64), (128, 256), (192, 256)):
            spec = spec64.replace(N=n)
            if tuning_key(spec64.replace(N=near)) not in recs:
                continue
            assert tuning_key(spec) not in recs and tuned_knobs(spec, "sm_90") is None
            want = TU.knobs_from_dict(recs[tuning_key(spec64.replace(N=near))]["knobs"]).replace(split_k=0)
            assert _no_warnings(TU.nearest_knobs, spec, "sm_90") == want
            grid = -(-spec.N * spec.P * spec.Q // want.BM) * -(-spec.K // want.BN)
            src = "nearest" if grid >= arch_info("sm_90").sms else "default"
            kn = want if src == "nearest" else default_knobs(spec, "sm_90")
            assert knobs_for(spec, "sm_90") == (kn, src)
            if src not in seen:  # (one kernel of each kind: the attributes say the same)
                f = conv2d_int_kernel(spec, "sm_90")
                assert str(f.attrs["qcompile.knobs_source"]) == src
                assert str(f.attrs["qcompile.knobs"]) == str(_adapt_knobs(spec, kn, "NHWC"))
            seen.add(src)
    assert seen == {"nearest", "default"}
    # a layer the log has at no batch size: the arch's defaults
    odd = spec64.replace(C=spec64.C + 16)
    assert knobs_for(odd, "sm_90") == (default_knobs(odd, "sm_90"), "default")


def test_default_knobs_table():
    """Untuned shapes on sm_90: warpgroup-MMA tiles where the operands take them (NHWC, 16-byte channel vectors, zero
    padding): 128x128 where that grid fills the SMs, 64x64 where it does not; 4-bit as the register-A kernel with
    8-bit weights. Elsewhere (other layouts / padding values / channel counts, archs without wgmma) mma.sync."""
    from qcompile.schedules.spec import WGMMA_DEFAULT_KNOBS, packed_weight_knobs

    big = ConvSpec(N=32, H=28, W=28, C=128, K=256, R=3, S=3, padding=1, x_dtype="uint8", out_dtype="uint8")
    small = big.replace(N=1)
    b4 = big.replace(x_dtype="uint4", w_bits=4)
    assert default_knobs(big, "sm_90") == WGMMA_DEFAULT_KNOBS[(8, True)]
    assert default_knobs(small, "sm_90") == WGMMA_DEFAULT_KNOBS[(8, False)]
    assert default_knobs(b4, "sm_90") == WGMMA_DEFAULT_KNOBS[(4, True)] and default_knobs(b4, "sm_90").w8
    assert default_knobs(b4.replace(N=1), "sm_90") == WGMMA_DEFAULT_KNOBS[(4, False)]
    for other in (big.replace(C=24), big.replace(layout="HWNC"), big.replace(pad_value=3)):
        assert default_knobs(other, "sm_90") == DEFAULT_KNOBS["sm_90"]
    assert default_knobs(big, "sm_86") == DEFAULT_KNOBS["sm_86"]
    for kn in WGMMA_DEFAULT_KNOBS.values():
        assert kn.valid() and packed_weight_knobs(kn).valid() and not packed_weight_knobs(kn).w8
    # --packed-int4-weights: every 4-bit w8 record of the log (GemmKnobs: both GPUs' implicit_gemm records) has a
    # valid packed-weight form
    gemm = [r for r in _all() if r["strategy"] == "implicit_gemm"]
    assert {r["device"] for r in gemm} == {H100, H200} and any(r["knobs"]["w8"] for r in gemm)
    for rec in gemm:
        kn = TU.knobs_from_dict(rec["knobs"])
        if kn.w8:
            assert packed_weight_knobs(kn).valid() and not packed_weight_knobs(kn).w8, kn


def test_tuned_kernel_builds_for_cuda():
    from qcompile.schedules.build import build_cuda, cuda_source

    spec = _tuned_spec()
    f = conv2d_int_kernel(spec, "sm_90")
    assert str(f.attrs["qcompile.knobs_source"]) == "arch"
    src = cuda_source(build_cuda(f, "sm_90", mode="ptx"))
    if tuned_knobs(spec, "sm_90").mma == "wgmma":  # the record's MMA path is the one built
        assert "wgmma.mma_async.sync.aligned.m64n" in src and "mma.sync" not in src
    else:
        assert "mma.sync.aligned.m16n8k32.row.col.s32" in src and "ldmatrix" in src
    # both paths are in the log's implicit_gemm records (mma.sync where it measures faster than wgmma)
    kinds = {r["knobs"]["mma"] for r in _all() if r["strategy"] == "implicit_gemm"}
    assert kinds == {"sync", "wgmma"}


def _fakes():
    """tests/tune/fakes.py (the tuner's fake space, builder and runner) as a module."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parent / "tune" / "fakes.py"
    spec = importlib.util.spec_from_file_location("tune_fakes", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_tuner_appends_to_a_log_and_lookup_takes_each_gpus_fastest(tmp_path, monkeypatch):
    """qtune run on a log that already holds records -- this GPU's slower record of the task, another GPU's record of
    it, this GPU's record of another shape -- leaves every line as it was and appends its own: each names the arch,
    this GPU, the SM count its runner reports, the key and the strategy. The GPU's record already there counts as
    measured (not measured again). Looked up afterwards, each GPU gets its own fastest OK record of the shape, and
    the other shape keeps its record."""
    from qcompile.schedules import GemmKnobs
    from qcompile.tune.scheduler import Tuner
    from qcompile.tune.tasks import set_shares

    F = _fakes()
    monkeypatch.setenv("QCOMPILE_TUNING_DIR", str(tmp_path / "none"))
    task = F.make_task(N=8, H=28, C=128, K=128)
    other = ConvSpec(N=8, H=14, W=14, C=256, K=256, R=3, S=3, padding=1, x_dtype="uint8", out_dtype="uint8")
    dflt = F.fake_space().default(task.spec, "sm_90")
    mine_old, theirs, kept = GemmKnobs(BM=32, BN=256, BK=128), GemmKnobs(BM=64, BN=64, BK=32), GemmKnobs(BM=256, WM=4)
    slow = 10 * F.cost_ms(task.spec, dflt)
    mk = lambda spec, dev, kn, ms: TU.make_record("sm_90", dev, 132, tuning_key(spec), "implicit_gemm", kn, "ok", ms)
    before = "".join(TU.format_record(r) + "\n" for r in (
        mk(task.spec, "Fake GPU", dflt, slow), mk(task.spec, "Fake GPU", mine_old, slow),
        mk(task.spec, "Other GPU", theirs, 1e-6), mk(other, "Fake GPU", kept, 0.5)))
    log = tmp_path / "t.jsonl"
    log.write_text(before)
    set_shares([task], measured=False)
    runner = F.FakeRunner(sms=114)
    Tuner([task], F.FakeBuilder(), runner, log, spaces={"implicit_gemm": F.fake_space()},
          log=lambda s: None).run(trials=20)
    text = log.read_text()
    assert text.startswith(before)
    new = [json.loads(ln) for ln in text[len(before):].splitlines()]
    assert len(new) == 20
    assert {(r["arch"], r["device"], r["sms"], r["key"], r["strategy"]) for r in new} == {
        ("sm_90", "Fake GPU", 114, task.key, "implicit_gemm")}
    assert not {dflt, mine_old} & {c.knobs for c in runner.measured}
    best = min((r for r in new if r["status"] == "ok"), key=lambda r: r["ms"])
    assert best["ms"] < slow
    logs = [str(log)]
    TU.clear_cache()  # (the log as a new process reads it: read_log caches what the tuner read before appending)
    assert _no_warnings(knobs_for, task.spec, "sm_90", "Fake GPU", logs) == (TU.knobs_from_dict(best["knobs"]),
                                                                            "device")
    assert knobs_for(task.spec, "sm_90", "Other GPU", logs) == (theirs, "device")
    assert knobs_for(other, "sm_90", "Fake GPU", logs) == (kept, "device")


def test_implicit_gemm_t_space_covers_its_tuning_points():
    """implicit_gemm_t's space (what qtune draws its candidates from) at a layer the selector gives it -- ResNet-50's
    last 3x3 at batch 64, 8-bit as compiled models run it -- and at its 4-bit form: the pixel tile (0: auto_bn's),
    ring depth and groups in flight are dimensions; the legal points are those whose ring covers the groups in
    flight and whose shared tiles fit the block (224 pixels x 6 stages: 264 KiB, more than sm_90's 227 KiB), the
    others refused with the reason; 4-bit activations take both paths (registers, the shared ring) as distinct
    kernels; a conv with a residual add is not the space's (the implicit GEMM runs it)."""
    import itertools

    from qcompile.schedules import select_strategy
    from qcompile.schedules.igemm_t import KtKnobs
    from qcompile.schedules.space import SPACES

    sp = SPACES["implicit_gemm_t"]
    base = dict(N=64, H=7, W=7, C=512, K=512, R=3, S=3, padding=1, shift_ge33=True)
    s8 = ConvSpec(**base, x_dtype="uint8", out_dtype="uint8", zo=3, lo=0, hi=255)
    s4 = ConvSpec(**base, x_dtype="uint4", w_bits=4, out_dtype="uint4", zo=1, lo=0, hi=15)
    assert select_strategy(s8, "sm_90") == "implicit_gemm_t"
    assert sp.applies(s8, "sm_90") is None and sp.applies(s4, "sm_90") is None
    assert {0, 224} <= set(sp.dims["bn"]) and {4, 6} <= set(sp.dims["stages"]) and set(sp.dims["gif"]) == {1, 2}
    assert {0, 1} <= set(sp.dims["ring"])
    grid = list(itertools.product((0, 224), (4, 6), (1, 2)))
    why = {(bn, st, g): sp.legal(s8, "sm_90", KtKnobs(bn=bn, stages=st, gif=g)) for bn, st, g in grid}
    assert {p for p, w in why.items() if w is None} == {(0, 4, 1), (0, 6, 1), (0, 6, 2), (224, 4, 1)}
    assert "KiB of shared tiles" in why[(224, 6, 1)] and "stages >= 3 +" in why[(0, 4, 2)]
    assert sp.legal(s8, "sm_90", sp.default(s8, "sm_90")) is None
    for st, g in ((4, 1), (6, 2)):
        kns = [KtKnobs(stages=st, gif=g, ring=r) for r in (0, 1)]
        assert all(sp.legal(s4, "sm_90", kn) is None for kn in kns)
        assert sp.effective(s4, "sm_90", kns[0]) != sp.effective(s4, "sm_90", kns[1])
    res = s8.replace(has_residual=True, res_dtype="uint8", lo=-128, hi=127, zo=0, lo2=0, hi2=255)
    assert sp.applies(res, "sm_90") is not None and select_strategy(res, "sm_90") == "implicit_gemm"


# ---------------------------------------------------------------------------------------------
# records keyed by target: device > arch > nearest batch > defaults; --tuning-log / --gpu
def _rec(spec, device, knobs, arch="sm_90", **kw):
    return dict(arch=arch, device=device, sms=132, key=tuning_key(spec), strategy="implicit_gemm",
                knobs=knobs if isinstance(knobs, dict) else TU.knobs_to_dict(knobs), **kw)


def test_lookup_order_device_arch_nearest_default(tmp_path, monkeypatch):
    """Two GPUs' records of one arch in a --tuning-log file: the named GPU's record wins; without a GPU name, or one no
    record has, the record of the GPU with the most records of the arch (ties: the log named first); else the layer's
    record at the nearest batch size, the named GPU's first; else the defaults. Other arches' records are ignored."""
    from qcompile.schedules import GemmKnobs

    monkeypatch.setenv("QCOMPILE_TUNING_DIR", str(tmp_path / "none"))  # (no default log: only the named ones)
    spec = ConvSpec(N=64, H=14, W=14, C=256, K=256, R=3, S=3, padding=1, x_dtype="uint8", out_dtype="uint8")
    other = spec.replace(K=128)
    ka, kb, kx = GemmKnobs(BM=64, BN=64), GemmKnobs(BM=128, BN=64), GemmKnobs(BM=64, BN=128)
    assert len({ka, kb, kx, default_knobs(spec, "sm_90")}) == 4 and ka.valid() and kb.valid() and kx.valid()
    log = _write(tmp_path / "two.jsonl", [
        _rec(spec, "GPU A", ka), _rec(spec.replace(N=8), "GPU A", ka),
        _rec(spec, "GPU B", kb), _rec(other, "GPU B", kb), _rec(other.replace(N=8), "GPU B", kb),
        _rec(spec.replace(N=32), "GPU X", kx, arch="sm_80")])
    logs = [str(log)]
    assert _no_warnings(knobs_for, spec, "sm_90", "GPU A", logs) == (ka, "device")
    assert knobs_for(spec, "sm_90", None, logs) == (kb, "arch")       # (B: 3 records of sm_90, A: 2)
    assert knobs_for(spec, "sm_90", "GPU C", logs) == (kb, "arch")
    assert knobs_for(spec, "sm_90", "GPU B", logs) == (kb, "device")
    with pytest.warns(TU.TuningLogWarning, match="no tuning log for sm_90"):  # (the log not named: not read)
        assert knobs_for(spec, "sm_90") == (default_knobs(spec, "sm_90"), "default")
    # no record of the shape: the layer's record at the nearest batch size (128 -> 64), the named GPU's first
    big = spec.replace(N=128)
    assert knobs_for(big, "sm_90", "GPU A", logs) == (ka.replace(split_k=0), "nearest")
    assert knobs_for(big, "sm_90", None, logs) == (kb.replace(split_k=0), "nearest")
    assert knobs_for(spec.replace(N=32), "sm_90", "GPU X", logs)[1] == "nearest"  # (GPU X is sm_80's: ignored)
    assert knobs_for(spec.replace(N=32), "sm_90", "GPU X", logs)[0] == kb.replace(split_k=0)
    odd = spec.replace(C=128)
    assert knobs_for(odd, "sm_90", "GPU A", logs) == (default_knobs(odd, "sm_90"), "default")
    # equal record counts: the GPU of the log named first; one GPU and key in two logs: the first log's record
    one = _write(tmp_path / "one.jsonl", [_rec(spec, "GPU P", ka)])
    two = _write(tmp_path / "two_b.jsonl", [_rec(spec, "GPU Q", kb), _rec(spec, "GPU P", kx)])
    assert knobs_for(spec, "sm_90", None, [str(one), str(two)]) == (ka, "arch")
    assert knobs_for(spec, "sm_90", "GPU P", [str(two), str(one)]) == (kx, "device")
    # the kernel says where its knobs came from
    f = conv2d_int_kernel(spec, "sm_90", "implicit_gemm", tuning_logs=logs, device="GPU A")
    assert str(f.attrs["qcompile.knobs_source"]) == "device" and str(f.attrs["qcompile.knobs"]) == str(
        _adapt_knobs(spec, ka, "NHWC"))


def test_absent_knob_field_takes_its_default_and_folders_are_searched(tmp_path, monkeypatch):
    """A record written before a knob existed (the field absent) still applies, the field at its GemmKnobs default;
    a --tuning-log folder contributes every .jsonl in it."""
    from qcompile.schedules import GemmKnobs

    monkeypatch.setenv("QCOMPILE_TUNING_DIR", str(tmp_path / "none"))
    spec = ConvSpec(N=64, H=14, W=14, C=256, K=256, R=3, S=3, padding=1, x_dtype="uint8", out_dtype="uint8")
    old = {k: v for k, v in TU.knobs_to_dict(GemmKnobs(BM=64, BN=64, stages=4)).items() if k not in ("pp", "agl")}
    d = tmp_path / "logs"
    d.mkdir()
    _write(d / "a.jsonl", [_rec(spec, "GPU A", old)])
    _write(d / "b.jsonl", [_rec(spec.replace(K=128), "GPU A", old)])
    (d / "notes.txt").write_text("not a log")
    want = GemmKnobs(BM=64, BN=64, stages=4)
    assert _no_warnings(knobs_for, spec, "sm_90", "GPU A", [str(d)]) == (want, "device")
    assert knobs_for(spec.replace(K=128), "sm_90", None, [str(d)]) == (want, "arch")
    assert TU.knobs_from_dict({"BM": 64, "BN": 64, "pp": 1}) is None  # (a bool knob given as an integer: stale)


def test_cli_tuning_log_and_gpu_errors(tmp_path, capsys):
    """A missing --tuning-log path, a folder without a .jsonl log, --tuning-log / --gpu for llvm, an empty --gpu: one
    line naming it, exit status 2, before anything is compiled."""
    from qcompile.cli import qcompile_main

    model = tmp_path / "m.onnx"
    model.write_bytes(b"x")
    (tmp_path / "empty").mkdir()
    out = str(tmp_path / "m.so")
    for extra, frag in (([ "--tuning-log", str(tmp_path / "nope.jsonl")], "does not exist"),
                        (["--tuning-log", str(tmp_path / "empty")], "no .jsonl tuning log"),
                        (["--gpu", " "], "empty GPU name")):
        rc = qcompile_main([str(model), "--target", "cuda", "-o", out] + extra)
        err = capsys.readouterr().err
        assert rc == 2 and frag in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    rc = qcompile_main([str(model), "--gpu", "NVIDIA H100 80GB HBM3", "-o", out])
    err = capsys.readouterr().err
    assert rc == 2 and "--gpu applies to --target cuda only" in err and len(err.strip().splitlines()) == 1, err
    assert not os.path.exists(out)


@pytest.mark.nvcc
def test_summary_knobs_column(tmp_path, monkeypatch):
    """qcompile --tuning-log LOG --gpu NAME on resnet_tiny (cuda sm_90, no GPU needed): the summary's knobs column says
    where each layer's knobs came from -- the named GPU's record (layer1_0_conv1, and layer1_0_conv2, whose residual
    conv takes the plain conv's record), another GPU's record of the arch (layer2_0_conv1), the defaults -- and the
    note counts the layers without a record."""
    import torch

    from qcompile.driver import CompileOptions, compile_model
    from qcompile.models.export_onnx import export_onnx
    from qcompile.models.quantize import quantize_model
    from qcompile.models.resnet import build_model

    monkeypatch.setenv("QCOMPILE_TUNING_DIR", str(tmp_path / "none"))
    qm = quantize_model(build_model("resnet_tiny"), torch.randn(8, 3, 16, 16), bits=4)
    onnx_path = str(tmp_path / "t4.onnx")
    export_onnx(qm, onnx_path, (2, 3, 16, 16), batch=2)
    l1 = ConvSpec(N=2, H=16, W=16, C=16, K=16, R=3, S=3, padding=1, x_dtype="uint4", w_bits=4, out_dtype="uint4")
    l2 = l1.replace(K=32, stride=2)
    log = _write(tmp_path / "tiny.jsonl", [_rec(l1, "GPU A", default_knobs(l1, "sm_90")),
                                           _rec(l2, "GPU B", default_knobs(l2, "sm_90"))])
    lines = []
    res = compile_model(onnx_path, CompileOptions(target="cuda", arch="sm_90", layout="NHWC", tuning_logs=(str(log),),
                                                  gpu="GPU A"), log=lines.append)
    knobs = {l.name: l.knobs for l in res.layers}
    assert knobs["layer1_0_conv1"] == knobs["layer1_0_conv2"] == "device" and knobs["layer2_0_conv1"] == "arch"
    assert {k for n, k in knobs.items() if not n.startswith(("layer1_0", "layer2_0_conv1"))} == {"default"}
    table = next(ln for ln in lines if ln.startswith("layer "))
    assert table.splitlines()[0].split()[-2:] == ["kernel", "knobs"]
    row = next(ln for ln in table.splitlines() if ln.startswith("layer2_0_conv1 "))
    assert row.split()[-2:] == ["implicit_gemm", "arch"]
    note = [ln for ln in lines if "have no tuning record" in ln]
    assert len(note) == 1 and note[0].startswith("note: 7 of 10 tunable layers") and "7 the sm_90 defaults" in note[0]


# ---------------------------------------------------------------------------------------------
# records name their strategy and status; the fastest OK record is the one selected
def test_removed_knob_field_is_ignored(tmp_path, monkeypatch):
    """A record written while the knobs had a field they no longer have (a knob since removed) still applies: the
    field is ignored, with no warning; an absent field takes its default."""
    from qcompile.schedules import GemmKnobs

    monkeypatch.setenv("QCOMPILE_TUNING_DIR", str(tmp_path / "none"))
    spec = ConvSpec(N=64, H=14, W=14, C=256, K=256, R=3, S=3, padding=1, x_dtype="uint8", out_dtype="uint8")
    knobs = dict(TU.knobs_to_dict(GemmKnobs(BM=64, BN=64)), warp_specialize=2)
    del knobs["pp"]
    log = _write(tmp_path / "old.jsonl", [_rec(spec, "GPU A", knobs)])
    assert _no_warnings(knobs_for, spec, "sm_90", "GPU A", [str(log)]) == (GemmKnobs(BM=64, BN=64), "device")


def test_every_record_strategy_parses_with_its_knobs_type():
    """implicit_gemm / direct_hwnc records hold GemmKnobs, implicit_gemm_t KtKnobs, direct_halo HaloKnobs; each round
    trips through make_record / format_record / parse_record; the status values are the tuner's."""
    from qcompile.schedules.igemm_t import KtKnobs
    from qcompile.schedules.stem import HaloKnobs
    from qcompile.schedules import GemmKnobs
    from qcompile.tune.common import STATUSES

    from qcompile.schedules.spec import space_to_depth

    assert TU.RECORD_STATUSES == STATUSES
    spec = ConvSpec(N=8, H=14, W=14, C=256, K=256, R=3, S=3, padding=1, x_dtype="uint8", out_dtype="uint8")
    stem = space_to_depth(ConvSpec(N=8, H=224, W=224, C=4, K=64, R=7, S=7, stride=2, padding=3, x_dtype="uint8",
                                   out_dtype="uint8", lo=0, hi=255))
    for strategy, kn, sp in (("implicit_gemm", GemmKnobs(BM=64), spec), ("direct_hwnc", GemmKnobs(BN=64),
                                                                          spec.replace(layout="HWNC")),
                             ("implicit_gemm_t", KtKnobs(bn=96, stages=4), spec),
                             ("direct_halo", HaloKnobs(th=2, minb=2, pipe=1), stem)):
        assert TU.knobs_type(strategy) is type(kn)
        key = tuning_key(sp)
        for status in TU.RECORD_STATUSES:
            d = TU.make_record("sm_90", "GPU A", 132, key, strategy, kn, status, 0.01 if status == "ok" else None,
                               0.02, variant="v1")
            assert list(d)[:6] == ["arch", "device", "sms", "key", "strategy", "knobs"]
            rec, why = TU.parse_record(TU.format_record(d))
            assert not why and rec == TU.Record("sm_90", "GPU A", key, kn, 132, strategy, status,
                                                0.01 if status == "ok" else None, 0.02)
    assert TU.parse_record(json.dumps(dict(d, knobs={"th": "wide"})))[0] is None  # (a value of another type)
    with pytest.raises(ValueError):
        TU.make_record("sm_90", "GPU A", 132, key, "fallback", kn)


def test_records_take_what_the_space_takes_for_their_shape():
    """A record's knobs are checked by its strategy's space for the record's own shape and arch (the builder's check):
    knobs the builder adapts (here wgmma tiles that ``GemmKnobs.valid`` alone refuses before the shape adapts them,
    measured exact by qtune on the H100) are read; knobs the space refuses for that shape or arch make the record
    stale."""
    from qcompile.schedules import GemmKnobs
    from qcompile.schedules.space import SPACES

    key = "NHWC|N256|H56|W56|C64|K256|R1|S1|st1,1|pad0,0,0,0|dil1,1|x8|w8|res"
    kn = GemmKnobs(BM=256, BN=192, BK=32, WM=2, WN=2, stages=2, vec=16, ev=4, pipe=-1, mma="wgmma")
    assert not kn.valid() and SPACES["implicit_gemm"].legal(TU.spec_from_key(key), "sm_90", kn, 132) is None
    d = TU.make_record("sm_90", "GPU A", 132, key, "implicit_gemm", kn, "ok", 1.05, 0.29)
    rec, why = TU.parse_record(TU.format_record(d))
    assert not why and rec.knobs == kn
    assert TU.parse_record(TU.format_record(dict(d, arch="sm_75")))[0] is None  # (wgmma on sm_75)
    small = key.replace("C64", "C8")
    assert SPACES["implicit_gemm"].legal(TU.spec_from_key(small), "sm_90", kn, 132) is not None
    assert TU.parse_record(TU.format_record(dict(d, key=small)))[0] is None


def test_spec_from_key_round_trips():
    for s in list(_specs())[::37]:
        assert tuning_key(TU.spec_from_key(tuning_key(s))) == tuning_key(s)
    with pytest.raises(ValueError):
        TU.spec_from_key("NHWC|N1")


def test_fastest_ok_record_wins_and_failures_are_never_selected(tmp_path, monkeypatch):
    """Several records of one GPU and shape (a tuner appends one per measured candidate): the fastest OK one is
    selected; mismatch / build_error / run_error records never are, however fast; records of another strategy serve
    only that strategy (implicit_gemm_t's KtKnobs), with its own defaults where it has none."""
    from qcompile.schedules import GemmKnobs
    from qcompile.schedules.igemm_t import KtKnobs

    monkeypatch.setenv("QCOMPILE_TUNING_DIR", str(tmp_path / "none"))
    spec = ConvSpec(N=64, H=14, W=14, C=256, K=256, R=3, S=3, padding=1, x_dtype="uint8", out_dtype="uint8")
    key = tuning_key(spec)
    a, b, c = GemmKnobs(BM=64, BN=64), GemmKnobs(BM=128, BN=64), GemmKnobs(BM=64, BN=128)
    mk = lambda kn, st, ms, strategy="implicit_gemm": TU.make_record("sm_90", "GPU A", 132, key, strategy, kn, st, ms)
    log = _write(tmp_path / "t.jsonl", [mk(a, "ok", 0.030), mk(b, "ok", 0.020), mk(c, "mismatch", 0.001),
                                        mk(c, "run_error", None), mk(KtKnobs(bn=96), "ok", 0.010, "implicit_gemm_t")])
    logs = [str(log)]
    assert _no_warnings(knobs_for, spec, "sm_90", "GPU A", logs) == (b, "device")
    assert knobs_for(spec, "sm_90", None, logs) == (b, "arch")
    assert knobs_for(spec, "sm_90", "GPU A", logs, "implicit_gemm_t") == (KtKnobs(bn=96), "device")
    assert knobs_for(spec.replace(N=32), "sm_90", "GPU A", logs, "implicit_gemm_t") == (KtKnobs(bn=96), "nearest")
    assert knobs_for(spec.replace(C=128), "sm_90", "GPU A", logs, "implicit_gemm_t") == (KtKnobs(), "default")
    assert knobs_for(spec, "sm_90", "GPU A", logs, "direct_halo")[1] == "default"
    # only failures recorded for a shape: as if it had no record
    _write(tmp_path / "t.jsonl", [mk(c, "mismatch", 0.001), mk(a, "build_error", None)])
    TU.clear_cache()
    assert knobs_for(spec, "sm_90", "GPU A", logs) == (default_knobs(spec, "sm_90"), "default")


def test_a_log_appended_to_is_read_again(tmp_path, monkeypatch):
    """The parsed-log cache follows the file: records appended after a lookup (a tuner writing its log in the same
    process) are seen by the next lookup without clearing the cache."""
    import dataclasses

    from qcompile.schedules import ConvSpec, GemmKnobs
    from qcompile.schedules import tuning as TU

    monkeypatch.setenv("QCOMPILE_TUNING_DIR", str(tmp_path / "none"))
    TU.clear_cache()
    spec = ConvSpec(N=8, H=14, W=14, C=256, K=256, R=3, S=3, padding=1, x_dtype="uint8", out_dtype="uint8", lo=0,
                    hi=255)
    log = tmp_path / "t.jsonl"
    log.write_text("")
    kn, src = TU.knobs_for(spec, "sm_90", "GPU A", [str(log)])
    assert src == "default"
    mine = GemmKnobs(BM=64, BN=64, BK=128, WM=1, WN=1, stages=3, pipe=-1, mma="wgmma")
    line = json.dumps({"arch": "sm_90", "device": "GPU A", "sms": 132, "key": TU.tuning_key(spec),
                       "strategy": "implicit_gemm", "knobs": dataclasses.asdict(mine), "ms": 0.01})
    with open(log, "a") as f:
        f.write(line + "\n")
    kn, src = TU.knobs_for(spec, "sm_90", "GPU A", [str(log)])
    assert src == "device" and kn == mine
    TU.clear_cache()
