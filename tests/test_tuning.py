"""Tuning logs (tuning_logs/<arch>.json) and their use by conv2d_int_kernel: fast, no GPU."""
from __future__ import annotations

import json
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


def _tuned_spec():
    """A tuned spec whose knobs differ from the defaults (a 3x3 layer if there is one)."""
    recs = TU.load_log("sm_90")["records"]
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
    log = _no_warnings(TU.load_log, "sm_90")
    assert log is not None and log["arch"] == "sm_90" and len(log["records"]) >= 40
    assert tuple(log["key_fields"]) == TU.KEY_FIELDS and tuple(log["knob_fields"]) == TU.KNOB_FIELDS
    keys = {tuning_key(s) for s in _specs()}
    for key, rec in log["records"].items():
        assert key in keys, key
        kn = TU.knobs_from_dict(rec["knobs"])
        assert kn is not None and kn.valid(), (key, rec)
        assert rec["ms"] > 0 and rec["default_ms"] > 0 and rec["ms"] <= rec["default_ms"] and rec["device"]


def test_log_is_package_data():
    import tomllib
    import pathlib

    pp = tomllib.loads((pathlib.Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "qcompile.tuning_logs" in pp["packages"]
    assert pp["package-dir"]["qcompile.tuning_logs"] == "tuning_logs"
    assert "*.json" in pp["package-data"]["qcompile.tuning_logs"]
    assert TU.log_path("sm_90").is_file()


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
    assert tuning_key(res) not in TU.load_log("sm_90")["records"] or tuned_knobs(res, "sm_90") != plain_kn
    log = json.loads(TU.log_path("sm_90").read_text())
    log["records"].pop(tuning_key(res), None)
    for n in (spec.N, spec.N * 2):  # (N * 2: no record of its own in either form -- the nearest batch decides)
        log["records"].pop(tuning_key(res.replace(N=n * 2)), None)
        log["records"].pop(tuning_key(spec.replace(N=n * 2)), None)
    (tmp_path / "sm_90.json").write_text(json.dumps(log))
    monkeypatch.setenv("QCOMPILE_TUNING_DIR", str(tmp_path))
    TU.clear_cache()
    assert _no_warnings(tuned_knobs, res, "sm_90") == plain_kn  # no residual record: the plain conv's
    other = plain_kn.replace(BM=64 if plain_kn.BM != 64 else 128, split_k=0)
    assert other.valid() and other != plain_kn
    log["records"][tuning_key(res)] = dict(log["records"][tuning_key(spec)], knobs=TU.knobs_to_dict(other))
    (tmp_path / "sm_90.json").write_text(json.dumps(log))
    TU.clear_cache()
    assert tuned_knobs(res, "sm_90") == other and tuned_knobs(spec, "sm_90") == plain_kn
    assert TU.layer_records(res.replace(N=spec.N * 2), "sm_90")[spec.N] == other
    assert TU.layer_records(spec.replace(N=spec.N * 2), "sm_90")[spec.N] == plain_kn
    f = conv2d_int_kernel(res, "sm_90")
    assert str(f.attrs["qcompile.knobs_source"]) == "tuned" and str(f.attrs["qcompile.knobs"]) == str(
        _adapt_knobs(res, other, "NHWC"))


def test_tuned_spec_gets_its_knobs():
    spec = _tuned_spec()
    rec = TU.load_log("sm_90")["records"][tuning_key(spec)]
    kn = _no_warnings(tuned_knobs, spec, "sm_90")
    assert kn == TU.knobs_from_dict(rec["knobs"]) and kn != _adapt_knobs(spec, DEFAULT_KNOBS["sm_90"], "NHWC")
    f = conv2d_int_kernel(spec, "sm_90")
    assert str(f.attrs["qcompile.knobs_source"]) == "tuned" and str(f.attrs["qcompile.knobs"]) == str(kn)
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
    assert len(msgs) == 1 and str(tmp_path / "sm_90.json") in msgs[0]
    assert tuned_knobs(spec, "sm_90") is None
    assert all(str(f.attrs["qcompile.knobs_source"]) == "default" for f in kernels)
    assert default_knobs(spec, "sm_90").mma == "wgmma"  # (16-byte channel vectors: the warpgroup-MMA default)
    assert str(kernels[0].attrs["qcompile.knobs"]) == str(_adapt_knobs(spec, default_knobs(spec, "sm_90"), "NHWC"))


@pytest.mark.parametrize("how", ["knob_fields", "key_fields", "record_knobs", "format"])
def test_stale_log_warns_once_and_falls_back(tmp_path, monkeypatch, how):
    spec = _tuned_spec()
    log = json.loads(TU.log_path("sm_90").read_text())
    if how == "knob_fields":  # GemmKnobs gained / lost a field since the log was written
        log["knob_fields"] = log["knob_fields"][:-1]
    elif how == "key_fields":
        log["key_fields"] = [f for f in log["key_fields"] if f != "dilation"]
    elif how == "format":
        log["format"] = 0
    else:  # one record's knobs carry a field GemmKnobs does not know
        log["records"][tuning_key(spec)]["knobs"]["warp_specialize"] = 2
    (tmp_path / "sm_90.json").write_text(json.dumps(log))
    monkeypatch.setenv("QCOMPILE_TUNING_DIR", str(tmp_path))
    kernels = []
    msgs = _count(lambda: [kernels.append(conv2d_int_kernel(spec, "sm_90")) for _ in range(3)])
    assert len(msgs) == 1 and "stale" in msgs[0] and str(tmp_path / "sm_90.json") in msgs[0], msgs
    # (one stale record: the layer's records at other batch sizes still apply where their tile fills the SMs; a stale
    # log: none does)
    src = "default"
    if how == "record_knobs":
        from qcompile.schedules import arch_info

        near = TU.nearest_knobs(spec, "sm_90")
        assert near is not None
        if -(-spec.N * spec.P * spec.Q // near.BM) * -(-spec.K // near.BN) >= arch_info("sm_90").sms:
            src = "nearest"
    assert all(str(f.attrs["qcompile.knobs_source"]) == src for f in kernels)
    assert tuned_knobs(spec, "sm_90") is None


def test_untuned_batch_takes_the_nearest_batch_record():
    """A ResNet layer at a batch size the log has no record for gets the same layer's record at the batch size
    nearest in ratio (48 -> 64, 12 -> 16, 24 -> 32, 2 -> 1, 96 -> 128, 192 -> 256), its K-split left to the
    automatic rule, while that record's tile still makes a wave of blocks over the SMs; else the arch's defaults. The
    source says which."""
    from qcompile.schedules import arch_info

    recs = TU.load_log("sm_90")["records"]
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
    for rec in TU.load_log("sm_90")["records"].values():
        kn = TU.knobs_from_dict(rec["knobs"])
        if kn.w8:
            assert packed_weight_knobs(kn).valid() and not packed_weight_knobs(kn).w8, kn


def test_tuned_kernel_builds_for_cuda():
    from qcompile.schedules.build import build_cuda, cuda_source

    spec = _tuned_spec()
    f = conv2d_int_kernel(spec, "sm_90")
    assert str(f.attrs["qcompile.knobs_source"]) == "tuned"
    src = cuda_source(build_cuda(f, "sm_90", mode="ptx"))
    if tuned_knobs(spec, "sm_90").mma == "wgmma":  # the record's MMA path is the one built
        assert "wgmma.mma_async.sync.aligned.m64n" in src and "mma.sync" not in src
    else:
        assert "mma.sync.aligned.m16n8k32.row.col.s32" in src and "ldmatrix" in src
    # both paths are in the log (mma.sync where it measures faster than wgmma)
    kinds = {r["knobs"]["mma"] for r in TU.load_log("sm_90")["records"].values()}
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
    recs = TU.load_log("sm_90")["records"]
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


def test_log_merge_keeps_generated_by_and_ranks_by_confirmed_time(tmp_path, monkeypatch):
    """`tune_layers.py log RESULTS --merge --note ...`: records of shapes the run did not measure stay, the log's
    generated_by is kept with the note appended, and with --confirm timings (bench_ms) a variant is ranked by those,
    not by its interleaved median; a variant whose knobs tuned_knobs would refuse (outside GemmKnobs.SPACE) is not
    written."""
    import argparse

    from qcompile.schedules import GemmKnobs

    TL = _tune_layers()
    monkeypatch.setattr(TL, "ROOT", tmp_path)
    (tmp_path / "tuning_logs").mkdir()
    dst = tmp_path / "tuning_logs" / "sm_90.json"
    kept = {"knobs": {"BM": 64}, "variant": "v_old", "ms": 1.0}
    dst.write_text(json.dumps({"generated_by": "earlier runs", "records": {"OTHER": kept}}))
    knobs = {v: TU.knobs_to_dict(GemmKnobs(BM=bm, BN=bn)) for v, bm, bn in
             (("default", 128, 128), ("fast_interleaved", 256, 128), ("fast_alone", 64, 64))}
    ms = {"default": 0.100, "fast_interleaved": 0.080, "fast_alone": 0.090}
    bench_ms = {"default": 0.100, "fast_interleaved": 0.099, "fast_alone": 0.085}
    row = {"layer": "r50_x_b256_int4", "key": "KEY", "variants": [
        dict(variant=v, knobs=knobs[v], is_default=v == "default", ok=True, ms=ms[v], bench_ms=bench_ms[v])
        for v in knobs]}
    res = tmp_path / "tune_results.json"
    res.write_text(json.dumps({"device": "H100", "date": "2026-11-23", "tune": [row]}))
    TL.cmd_log(argparse.Namespace(results=str(res), merge=True, note="build --w8", min_gain=0.02))
    log = json.loads(dst.read_text())
    assert log["generated_by"] == "earlier runs; build --w8"
    assert log["records"]["OTHER"] == kept
    rec = log["records"]["KEY"]
    assert rec["variant"] == "fast_alone" and rec["knobs"] == knobs["fast_alone"]
    assert rec["ms"] == 0.085 and rec["default_ms"] == 0.1
    # a gain under --min-gain keeps the default
    TL.cmd_log(argparse.Namespace(results=str(res), merge=False, note="", min_gain=0.2))
    log = json.loads(dst.read_text())
    assert log["records"]["KEY"]["variant"] == "default" and "OTHER" not in log["records"]
    assert log["generated_by"].startswith("python scripts/tune_layers.py build")
    # a winner outside the knob space (here stages=9): refused, naming the layer, the log left as it was
    row["variants"][2]["knobs"] = dict(knobs["fast_alone"], stages=9)
    res.write_text(json.dumps({"device": "H100", "date": "2026-11-23", "tune": [row]}))
    before = dst.read_text()
    with pytest.raises(SystemExit, match="r50_x_b256_int4: variant fast_alone"):
        TL.cmd_log(argparse.Namespace(results=str(res), merge=True, note="", min_gain=0.02))
    assert dst.read_text() == before


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
