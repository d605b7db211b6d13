"""Tuning logs (tuning_logs/<arch>.jsonl, JSON lines) and their use by conv2d_int_kernel and qcompile: fast, no GPU."""
from __future__ import annotations

import json
import os
import re
import shutil
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


def _specs():
    """The shapes tune_layers.py tunes (ResNet-18/50 at batch 64/256, ResNet-50 at 1, 8, 16, 32, 128; INT8, INT4 NHWC;
    the RGB stem also as compiled models run it: padded to 4 channels, and in its space-to-depth form)."""
    from qcompile.schedules.spec import space_to_depth

    for N in (1, 8, 16, 32, 64, 128, 256):
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
                yield ConvSpec(N=N, H=H, W=H, C=C, K=K, R=R, S=R, stride=st, padding=pd, x_dtype="uint4", w_bits=4,
                               out_dtype="uint4", lo=-8, hi=7, has_residual=True, res_dtype="uint4")
            if R == 1:  # (the 1x1 expansions carry ResNet-50's residual add: tuned with it, key ...|res)
                yield ConvSpec(N=N, H=H, W=H, C=C, K=K, R=R, S=R, stride=st, padding=pd, x_dtype="uint8",
                               out_dtype="uint8", has_residual=True, res_dtype="uint8")
                yield ConvSpec(N=N, H=H, W=H, C=C, K=K, R=R, S=R, stride=st, padding=pd, x_dtype="uint4", w_bits=4,
                               out_dtype="uint4", lo=-8, hi=7, has_residual=True, res_dtype="uint4")


H100 = "NVIDIA H100 80GB HBM3"


def _raw(path=None):
    """The shipped log's records as written, by key (one device: the H100 they were measured on)."""
    lines = (path or TU.log_path("sm_90")).read_text().splitlines()
    return {r["key"]: r for r in map(json.loads, lines)}


def _write(path, recs):
    """A JSON-lines log of ``recs`` (dicts)."""
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


def _tuned_spec():
    """A tuned spec whose knobs differ from the defaults (a 3x3 layer if there is one)."""
    recs = _raw()
    found = [s for s in _specs() if tuning_key(s) in recs and recs[tuning_key(s)]["variant"] != "default"]
    assert found, "the sm_90 log records no non-default knobs"
    return next((s for s in found if s.R == 3), found[0])


def _no_warnings(fn, *a):
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out = fn(*a)
    assert not [x for x in w if issubclass(x.category, TU.TuningLogWarning)], [str(x.message) for x in w]
    return out


def test_log_loads():
    """The shipped log: one record a line, sorted by key, each naming arch, GPU, SM count, key and strategy, its knobs
    valid GemmKnobs; every record loads without a warning."""
    lines = TU.log_path("sm_90").read_text().splitlines()
    assert TU.log_path("sm_90").name == "sm_90.jsonl" and len(lines) == 412
    recs = [json.loads(ln) for ln in lines]
    assert [r["key"] for r in recs] == sorted({r["key"] for r in recs})  # (sorted, one record per key)
    keys = {tuning_key(s) for s in _specs()}
    for rec in recs:
        assert list(rec)[:6] == ["arch", "device", "sms", "key", "strategy", "knobs"], rec
        assert (rec["arch"], rec["device"], rec["sms"], rec["strategy"]) == ("sm_90", H100, 132, "implicit_gemm")
        assert rec["key"] in keys, rec["key"]
        parsed, why = TU.parse_record(json.dumps(rec))
        assert parsed is not None and parsed.knobs.valid() and not why, (rec, why)
        assert rec["ms"] > 0 and rec["default_ms"] > 0 and rec["ms"] <= rec["default_ms"]
    log = _no_warnings(TU.load_log, "sm_90")
    assert log["devices"] == [H100] and len(log["records"]) == 412


def test_log_is_package_data():
    import tomllib
    import pathlib

    pp = tomllib.loads((pathlib.Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "qcompile.tuning_logs" in pp["packages"]
    assert pp["package-dir"]["qcompile.tuning_logs"] == "tuning_logs"
    assert "*.jsonl" in pp["package-data"]["qcompile.tuning_logs"]
    assert TU.log_path("sm_90").is_file() and not TU.log_path("sm_90").with_suffix(".json").exists()


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
    recs = _raw()
    assert tuning_key(res) not in recs or tuned_knobs(res, "sm_90") != plain_kn
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


@pytest.mark.parametrize("how", ["unknown_knob", "outside_space", "not_json", "old_key", "other_strategy"])
def test_stale_record_is_skipped_with_one_warning(tmp_path, monkeypatch, how):
    """A record whose knobs name a field GemmKnobs does not know, or take a value outside GemmKnobs.SPACE, is stale:
    skipped, with ONE warning naming the file and the line; so is a line that is not JSON, or whose key or strategy
    does not fit. The other records still apply."""
    spec = _tuned_spec()
    recs = _raw()
    lines = [json.dumps(r) for r in recs.values()]
    at = list(recs).index(tuning_key(spec))
    rec = dict(recs[tuning_key(spec)], knobs=dict(recs[tuning_key(spec)]["knobs"]))
    if how == "unknown_knob":  # GemmKnobs lost a field since the record was written
        rec["knobs"]["warp_specialize"] = 2
    elif how == "outside_space":
        rec["knobs"]["BM"] = 96
    if how in ("unknown_knob", "outside_space"):
        lines[at] = json.dumps(rec)
    else:  # (an extra line before the record: the record itself still applies)
        lines.insert(at, {"not_json": '{"arch": "sm_90", "device": "x", "key": ',
                              "old_key": json.dumps(dict(rec, key=rec["key"].replace("|dil1,1", ""))),
                              "other_strategy": json.dumps(dict(rec, strategy="implicit_gemm_t"))}[how])
    (tmp_path / "sm_90.jsonl").write_text("\n".join(lines) + "\n")
    monkeypatch.setenv("QCOMPILE_TUNING_DIR", str(tmp_path))
    kernels = []
    msgs = _count(lambda: [kernels.append(conv2d_int_kernel(spec, "sm_90")) for _ in range(3)])
    assert len(msgs) == 1 and str(tmp_path / "sm_90.jsonl") in msgs[0] and f"line {at + 1}:" in msgs[0], msgs  # (1-based)
    assert "skipped 1 " in msgs[0]
    if how not in ("unknown_knob", "outside_space"):
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
    nearest in ratio (48 -> 64, 12 -> 16, 24 -> 32, 2 -> 1, 96 -> 128, 192 -> 256), its K-split left to the
    automatic rule, while that record's tile still makes a wave of blocks over the SMs; else the arch's defaults. The
    source says which."""
    from qcompile.schedules import arch_info

    recs = _raw()
    seen = set()
    for spec64 in (s for s in _specs() if s.N == 64 and s.R == 3 and tuning_key(s) in recs):
        for n, near in ((48, 64), (12, 16), (24, 32), (2, 1), (96, 128), (192, 256)):
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
    # --packed-int4-weights: every 4-bit w8 record of the log has a valid packed-weight form
    for rec in _raw().values():
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
    # both paths are in the log (mma.sync where it measures faster than wgmma)
    kinds = {r["knobs"]["mma"] for r in _raw().values()}
    assert kinds == {"sync", "wgmma"}


def _tune_layers():
    """scripts/tune_layers.py as a module (it is a script, not part of the package)."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "tune_layers.py"
    spec = importlib.util.spec_from_file_location("tune_layers", path)
    tl = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tl)
    return tl


def test_loader_sweep_candidates():
    """scripts/tune_layers.py's 4-bit loader sweeps (--awarp, --wsp) propose valid, distinct knobs that fit the H100's
    shared memory, for 4-bit layers only, next to the as-compiled kernel of every layer."""
    tl = _tune_layers()
    layers = ["r50_l4_3x3_b64_int4", "r50_l3_3x3_b64_int8"]
    for cases, flag in ((tl.make_cases_awarp([64], layers), "awarp"), (tl.make_cases_wsp([64], layers), "wsp")):
        extra = [c for c in cases if c["variant"] != "default"]
        assert extra and all(c["layer"] == "r50_l4_3x3_b64_int4" for c in extra)
        knobs = [c["knobs"] for c in extra]
        assert len(set(knobs)) == len(knobs) and all(k.valid() and getattr(k, flag) for k in knobs)
        assert all(tl.smem_bytes(k, c["spec"]) <= 220 * 1024 for k, c in zip(knobs, extra))
        assert len([c for c in cases if c["variant"] == "default"]) == 2 * 24  # every ResNet-50 layer, both widths


def test_w8_shared_a_round_candidates():
    """`build --w8 --areg --areg-pipes -1 0`: 4-bit register-A kernels taking 8-bit weights whose A fragments are read
    from the block's packed shared ring (no warp-owned rows, no agl), one per pipe value, with the B ring deep enough
    (stages >= pstages + 1 + pipe); valid, distinct, fitting shared memory, 4-bit layers only."""
    tl = _tune_layers()
    layers = ["r50_l4_3x3_b256_int4", "r50_l4_3x3_b256_int8", "r50_l2_3x3s2_b8_int4"]  # (the last: an agl record)
    cases = tl.make_cases_w8([8, 256], layers, ["wg128x128_bk128_g0"], (3, 4), (0,), shared_a_pipes=(-1, 0))
    extra = [c for c in cases if c["variant"] != "default"]
    assert {c["layer"] for c in extra} == {"r50_l4_3x3_b256_int4", "r50_l2_3x3s2_b8_int4"}
    knobs = [c["knobs"] for c in extra]
    for layer in {c["layer"] for c in extra}:  # (distinct per layer)
        mine = [c["knobs"] for c in extra if c["layer"] == layer]
        assert len(set(mine)) == len(mine)
    assert all(k.valid() and k.w8 and k.areg and not k.awarp and not k.agl for k in knobs)
    assert {k.pipe for k in knobs} == {-1, 0} and all(k.stages == k.pstages + 1 + k.pipe for k in knobs)
    assert all(tl.smem_bytes(k, c["spec"]) <= 220 * 1024 for k, c in zip(knobs, extra))
    assert all(re.search(rf"_sa{c['knobs'].pipe + 1}(_minb\\d)?$", c["variant"]) for c in extra)


def test_defaults_ab_round_candidates():
    """`build --defaults-ab`: next to each layer as compiled, the arch's defaults (wgmma tiles where the operands take
    them) and the mma.sync defaults, each adapted, distinct from the as-compiled knobs and from each other."""
    tl = _tune_layers()
    cases = tl.make_cases_defaults_ab([32])
    extra = [c for c in cases if c["variant"] != "default"]
    assert {c["variant"] for c in extra} == {"arch_defaults", "mma_sync_defaults"}
    for c in extra:
        now = next(d["knobs"] for d in cases if d["layer"] == c["layer"] and d["variant"] == "default")
        assert c["knobs"].valid() and c["knobs"] != now
        wg_ok = c["spec"].C * c["spec"].x_bits // 8 % 16 == 0  # (16-byte channel vectors)
        assert (c["knobs"].mma == "wgmma") == (c["variant"] == "arch_defaults" and wg_ok)
    assert len([c for c in cases if c["variant"] == "default"]) == 2 * 24


def test_neighbors_round_candidates():
    """`build --neighbors`: next to each layer as compiled, its records at the log's other batch sizes (K-split left
    to the automatic rule) and the arch's defaults, each adapted, valid and distinct from the as-compiled knobs."""
    from qcompile.schedules.tuning import tuning_key

    tl = _tune_layers()
    recs = _raw()
    cases = tl.make_cases_neighbors([48])
    extra = [c for c in cases if c["variant"] != "default"]
    assert {c["variant"] for c in extra} >= {"arch_defaults", "rec_b64", "rec_b8"}
    for c in extra:
        now = next(d["knobs"] for d in cases if d["layer"] == c["layer"] and d["variant"] == "default")
        assert c["knobs"].valid() and c["knobs"] != now and c["knobs"].split_k == 0
        if c["variant"].startswith("rec_b"):
            rec = recs[tuning_key(c["spec"].replace(N=int(c["variant"][5:])))]
            assert c["knobs"].BM <= TU.knobs_from_dict(rec["knobs"]).BM  # (adapted: tiles shrink, never grow)
    assert len([c for c in cases if c["variant"] == "default"]) == 2 * 24


def test_stream_k_and_split_round_candidates(tmp_path):
    """--sk proposes stream-K variants (8-bit layers only, valid, distinct, fitting sk blocks per SM); --splits the
    as-compiled knobs with each K-split; the tuner builds what compiled models run: the split-K pair where it splits."""
    tl = _tune_layers()
    layers = ["r50_l4_3x3_b8_int4", "r50_l4_3x3_b8_int8"]
    extra = [c for c in tl.make_cases_sk([8], layers) if c["variant"] != "default"]
    assert extra and all(c["layer"] == "r50_l4_3x3_b8_int8" and c["knobs"].sk and c["knobs"].valid() for c in extra)
    assert len({c["knobs"] for c in extra}) == len(extra)
    assert all(c["knobs"].sk * (tl.smem_bytes(c["knobs"], c["spec"]) + 1024) <= 228 * 1024 for c in extra)
    cases = tl.make_cases_splits([1], ["r50_l4_3x3_b1_int4"])
    now = next(c["knobs"] for c in cases if c["layer"] == "r50_l4_3x3_b1_int4" and c["variant"] == "default")
    extra = [c for c in cases if c["variant"] != "default"]
    assert {c["knobs"].split_k for c in extra} | {now.split_k} >= {1, 2, 4, 8}
    assert all(c["knobs"] == now.replace(split_k=c["knobs"].split_k) for c in extra)
    if shutil.which("nvcc"):  # the tuner's build: the split-K pair, as compiled models run it
        tl.TUNE_DIR = tmp_path
        case = dict(next(c for c in extra if c["knobs"].split_k == 2), func="t0000")
        _, (rec,), _ = tl.build_group((0, [case]))
        assert rec["funcs"] == ["t0000", "t0000_e"] and rec["strategy_used"] == "implicit_gemm+splitk2"
        assert rec["sk"] is None and (tmp_path / "t000.so").is_file()


def test_stem_round_tunes_the_space_to_depth_form():
    """--stem proposes tiles for the stem as compiled models run it (the 4x4 stride-1 conv over 16 channels), and the
    tuner's layer table maps the stem's rows to it while cuDNN gets the layer itself (7x7 stride 2, 4 channels)."""
    tl = _tune_layers()
    cases = tl.make_cases_stem([64])
    assert {c["layer"] for c in cases} == {"r50_stem_b64_int8", "r50_stem_b64_int4"}
    assert all((c["spec"].C, c["spec"].R, c["spec"].strides) == (16, 4, (1, 1)) for c in cases)
    extra = [c for c in cases if c["variant"] != "default"]
    assert len(extra) > 20 and any(c["knobs"].mma == "wgmma" for c in extra) and any(c["knobs"].erq for c in extra)
    assert all(c["knobs"].valid() for c in extra)
    layer = tl.int8_spec(64, 3, 224, 64, 7, 2, 3, s2d=False)
    assert (layer.C, layer.R, layer.strides) == (4, 7, (2, 2))


def test_log_merge_replaces_same_gpu_and_key_and_ranks_by_confirmed_time(tmp_path, monkeypatch):
    """`tune_layers.py log RESULTS --merge`: JSON lines sorted by key; a new record replaces the one of the same GPU
    and key, other records (other shapes, other GPUs) stay; each names the arch, GPU, SM count, key and strategy; with
    --confirm timings (bench_ms) a variant is ranked by those, not by its interleaved median; a variant whose knobs
    tuned_knobs would refuse (outside GemmKnobs.SPACE) is not written; the SM count comes from the results, else
    --sms, else 132 for an H100 name, else the command stops."""
    import argparse

    from qcompile.schedules import GemmKnobs

    TL = _tune_layers()
    monkeypatch.setattr(TL, "ROOT", tmp_path)
    (tmp_path / "tuning_logs").mkdir()
    dst = tmp_path / "tuning_logs" / "sm_90.jsonl"
    key = "NHWC|N256|H7|W7|C512|K512|R3|S3|st1,1|pad1,1,1,1|dil1,1|x4|w4"
    other_key = "NHWC|N1|H7|W7|C512|K512|R3|S3|st1,1|pad1,1,1,1|dil1,1|x4|w4"
    base = dict(arch="sm_90", sms=132, strategy="implicit_gemm", knobs={"BM": 64}, variant="v_old", ms=1.0)
    kept = [dict(base, device="NVIDIA H100 80GB HBM3", key=other_key),  # (another shape)
            dict(base, device="OTHER GPU", key=key),                     # (the same shape on another GPU)
            dict(base, device="H100 TEST", key=key)]                     # (replaced by this run's record)
    _write(dst, kept)
    knobs = {v: TU.knobs_to_dict(GemmKnobs(BM=bm, BN=bn)) for v, bm, bn in
             (("default", 128, 128), ("fast_interleaved", 256, 128), ("fast_alone", 64, 64))}
    ms = {"default": 0.100, "fast_interleaved": 0.080, "fast_alone": 0.090}
    bench_ms = {"default": 0.100, "fast_interleaved": 0.099, "fast_alone": 0.085}
    row = {"layer": "r50_x_b256_int4", "key": key, "variants": [
        dict(variant=v, knobs=knobs[v], is_default=v == "default", ok=True, ms=ms[v], bench_ms=bench_ms[v])
        for v in knobs]}
    res = tmp_path / "tune_results.json"
    res.write_text(json.dumps({"device": "H100 TEST", "date": "2026-11-23", "tune": [row]}))
    TL.cmd_log(argparse.Namespace(results=str(res), merge=True, min_gain=0.02, sms=None))
    lines = dst.read_text().splitlines()
    got = [json.loads(ln) for ln in lines]
    assert len(got) == 3 and [r["key"] for r in got] == sorted(r["key"] for r in got)
    assert kept[0] in got and kept[1] in got and kept[2] not in got
    rec = next(r for r in got if r["device"] == "H100 TEST")
    assert list(rec)[:6] == ["arch", "device", "sms", "key", "strategy", "knobs"]
    assert (rec["arch"], rec["sms"], rec["key"], rec["strategy"]) == ("sm_90", 132, key, "implicit_gemm")
    assert rec["variant"] == "fast_alone" and rec["knobs"] == knobs["fast_alone"]
    assert rec["ms"] == 0.085 and rec["default_ms"] == 0.1 and rec["date"] == "2026-11-23"
    assert TU.parse_record(lines[got.index(rec)])[0].knobs == GemmKnobs(BM=64, BN=64)
    # a gain under --min-gain keeps the default; without --merge the log holds this run's records only; the results'
    # own SM count wins
    res.write_text(json.dumps({"device": "H100 TEST", "sms": 114, "date": "2026-11-23", "tune": [row]}))
    TL.cmd_log(argparse.Namespace(results=str(res), merge=False, min_gain=0.2, sms=None))
    got = [json.loads(ln) for ln in dst.read_text().splitlines()]
    assert len(got) == 1 and got[0]["variant"] == "default" and got[0]["sms"] == 114
    # a winner outside the knob space (here stages=9): refused, naming the layer, the log left as it was
    row["variants"][2]["knobs"] = dict(knobs["fast_alone"], stages=9)
    res.write_text(json.dumps({"device": "H100 TEST", "date": "2026-11-23", "tune": [row]}))
    before = dst.read_text()
    with pytest.raises(SystemExit, match="r50_x_b256_int4: variant fast_alone"):
        TL.cmd_log(argparse.Namespace(results=str(res), merge=True, min_gain=0.02, sms=None))
    assert dst.read_text() == before
    # no SM count for a GPU that is not an H100: --sms is required
    row["variants"][2]["knobs"] = knobs["fast_alone"]
    res.write_text(json.dumps({"device": "NVIDIA L40S", "date": "2026-11-23", "tune": [row]}))
    with pytest.raises(SystemExit, match="--sms"):
        TL.cmd_log(argparse.Namespace(results=str(res), merge=True, min_gain=0.02, sms=None))
    assert dst.read_text() == before
    TL.cmd_log(argparse.Namespace(results=str(res), merge=True, min_gain=0.02, sms=142))
    got = [json.loads(ln) for ln in dst.read_text().splitlines()]
    assert {(r["device"], r["sms"]) for r in got} == {("H100 TEST", 114), ("NVIDIA L40S", 142)}


def test_residual_tuning_cases_and_reference():
    """tune_layers.py build --pp --residual: ResNet-50's 1x1b expansions built with the residual add a compiled model
    fuses into them (their records go to the ``|res`` key), the other layers without it; the GPU side's torch
    reference of the residual stage equals NumPy's ``requant`` on a small problem (CPU)."""
    import numpy as np
    import torch

    from qcompile.schedules import reference as R

    tl = _tune_layers()
    # (two layers the implicit GEMM runs in a model: r50_l4_1x1b with its add; r50_l4_1x1a, 14x14 -- implicit_gemm_t
    # takes no residual, and the 7x7 r50_l4_1x1c at 64 is implicit_gemm_t's)
    cases = tl.make_cases_pp([64], ["r50_l4_1x1b_b64_int8", "r50_l4_1x1a_b64_int8"], residual=True)
    tune = [c for c in cases if c["variant"] != "default"]
    assert {c["layer"] for c in tune} == {"r50_l4_1x1b_b64_int8", "r50_l4_1x1a_b64_int8"}
    assert next(c for c in cases if c["layer"] == "r50_l4_1x1c_b64_int8")["strategy"] == "implicit_gemm_t"
    for c in cases:  # (every layer as compiled, the residual ones with their add, and the variants)
        assert c["spec"].has_residual == c["layer"].startswith(("r50_l1_1x1b", "r50_l2_1x1b", "r50_l3_1x1b",
                                                                 "r50_l4_1x1b"))
        assert tuning_key(c["spec"]).endswith("|res") == c["spec"].has_residual
    assert any(c["knobs"].pp and not c["knobs"].erq for c in tune) and all(c["knobs"].valid() for c in tune)
    # any other sweep with --residual (with_residual): the 1x1b convs' specs, default and variants alike, carry the add;
    # a layer's default row takes the knobs the model compiles its residual conv with (its |res record)
    w8 = tl.with_residual(tl.make_cases_w8([64], ["r50_l2_1x1b_b64_int4", "r50_l2_1x1c_b64_int4"]))
    rows = [c for c in w8 if c["layer"] in ("r50_l2_1x1b_b64_int4", "r50_l2_1x1c_b64_int4")]
    assert {c["layer"] for c in rows if not c["is_default"]} == {"r50_l2_1x1b_b64_int4", "r50_l2_1x1c_b64_int4"}
    for c in rows:
        assert c["spec"].has_residual == (c["layer"] == "r50_l2_1x1b_b64_int4")
    d = next(c for c in rows if c["is_default"] and c["spec"].has_residual)
    assert d["knobs"] == tl._now_knobs(d["spec"])
    for mk in (tl.int8_spec, tl.int4_spec):
        sp = tl.residual_spec(mk(2, 64, 7, 256, 1, 1, 0))
        args, ref, ok_np, nuniq = tl.make_problem(sp, 7, torch.device("cpu"))
        xb, wb, b, M, S, rb, rq2 = (a.numpy() for a in args)
        x = R.from_storage(xb, sp.x_dtype, sp.C)
        w = R.from_storage(wb, "int4" if sp.w_bits == 4 else "int8", sp.C)
        y = R.requant(R.conv_acc_nhwc(x, w, sp), b, M, S, sp, (R.from_storage(rb, sp.res_dtype, sp.K), rq2))
        assert ok_np and nuniq > 8 and np.array_equal(R.to_storage(y, sp.out_dtype), ref.numpy())


def test_kt_tuning_cases():
    """tune_layers.py build --kt: a layer the selector gives to implicit_gemm_t is timed as the implicit GEMM with
    the knobs it would get ("default") against implicit_gemm_t's defaults and its pixel tile x ring depth x groups in
    flight variants (bn 0: auto_bn's tile), only those whose shared tiles fit; 4-bit ones with both activation paths."""
    from qcompile.schedules.igemm_t import KtKnobs

    tl = _tune_layers()
    cases = tl.make_cases_kt([64], ["r50_l4_3x3_b64_int8", "r50_l4_3x3_b64_int4"], bns=(0, 224), stages=(4, 6),
                             gifs=(1, 2))
    dflt = [c for c in cases if c["is_default"]]
    assert [c["layer"] for c in dflt] == ["r50_l4_3x3_b64_int8", "r50_l4_3x3_b64_int4"]
    assert all(c["strategy"] == "implicit_gemm" and c["knobs"] == tl._now_knobs(c["spec"]) for c in dflt)
    kt = [c for c in cases if not c["is_default"]]
    assert all(c["strategy"] == "implicit_gemm_t" for c in kt)
    v8 = {c["variant"] for c in kt if c["layer"].endswith("int8")}
    # (224 pixels x 6 stages: 264 KiB of shared tiles, more than a block has)
    assert v8 == {"kt_default", "kt_n0_s4_g1", "kt_n0_s6_g1", "kt_n0_s6_g2", "kt_n224_s4_g1"}
    v4 = {c["variant"] for c in kt if c["layer"].endswith("int4")}
    assert {"kt_n0_s4_g1_ring", "kt_n0_s6_g2_ring"} <= v4 and all(
        isinstance(c["knobs"], KtKnobs) for c in kt if c["variant"] != "kt_default")


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
    assert len(note) == 1 and note[0].startswith("note: 7 of 10 implicit-GEMM layers") and "7 the sm_90 defaults" in note[0]
