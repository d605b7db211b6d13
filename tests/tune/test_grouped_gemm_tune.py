"""The tuner on the tensor-core kernel of grouped convs (``grouped_gemm``): task extraction (a layer the dispatch
plans on grouped_gemm is a task of that strategy, estimated at the tensor cores' peak), candidates built by the
tuner's builder (TIR; nvcc in the export test) whose manifest entries give the measuring side the kernel's calling
convention and weight buffer (``measure.weights`` of the entry's fields equals ``PlannedKernel.weights``), illegal
points refused with the space's reason before any TIR, the search and the cost-model features over
``SPACES["grouped_gemm"]``, the scheduler tuning the task (a synthetic runner), and an offline export of a qualifying
model whose results records rebuild their candidates. No GPU."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import warnings

import numpy as np
import pytest
from fakes import fresh_logs  # noqa: F401  (the fixture)
from fakes import EffectiveKnobsRunner
from test_grouped_tune import _HostBuilder

from qcompile.schedules import tuning as TU
from qcompile.schedules.grouped_gemm import plan_grouped_gemm
from qcompile.schedules.space import SPACES
from qcompile.schedules.spec import ConvSpec, GemmKnobs
from qcompile.tune import measure as M
from qcompile.tune.build import plan_candidate
from qcompile.tune.common import Candidate

pytestmark = pytest.mark.usefixtures("fresh_logs")  # (no packaged logs, a fresh log cache: fakes.fresh_logs)

_U8 = dict(x_dtype="uint8", out_dtype="uint8", zo=3, lo=0, hi=255)
_RES = dict(has_residual=True, res_dtype="uint8", lo2=0, hi2=255)
SHAPES = {  # (grouped convs grouped_gemm takes: Kg a multiple of 32, Cg of 4, 8-bit operands)
    "cg32_kg32": ConvSpec(N=2, H=6, W=6, C=64, K=64, R=3, S=3, padding=1, groups=2, **_U8),
    "cg8_kg32_res": ConvSpec(N=2, H=7, W=9, C=32, K=128, R=3, S=3, padding=1, groups=4, **_U8, **_RES),
    "cg64_kg64_i8": ConvSpec(N=1, H=7, W=7, C=256, K=256, R=3, S=3, padding=1, groups=4, x_dtype="int8",
                             out_dtype="int8", lo=-128, hi=127),
    "cg16_5x5_s2_pad": ConvSpec(N=1, H=11, W=11, C=64, K=128, R=5, S=5, stride=2, padding=2, groups=4,
                                pad_value=7, **_U8),
}
GG = "grouped_gemm"


def _cand(spec, knobs, arch="sm_90"):
    return Candidate(TU.tuning_key(spec), spec, arch, GG, knobs)


def _entry(cand, conv) -> dict:
    """The manifest entry's fields the measuring side reads (``build.build_one`` writes them from ``conv``)."""
    return dict(spec=dataclasses.asdict(cand.spec), strategy=cand.strategy, funcs=["k_0"], split_k=conv["split_k"],
                workspace=conv.get("workspace"), streamk=conv["streamk"], w_expand=conv["w_expand"],
                w_kperm=conv["w_kperm"], **({"w_group": conv["w_group"]} if conv.get("w_group") else {}))


def _check_convention(func, prob) -> None:
    """The kernel's parameters (a tirx PrimFunc's parameters are its buffers) are measure's buffers of one kernel
    in the order its ``Layer.args`` passes them: x, w, bias, M, S, [res, rq2], out."""
    args = [*prob["head"], *prob["res"], np.empty(prob["out_shape"], prob["out_dtype"])]
    params = list(func.params)
    assert len(params) == len(args), ([p.name for p in params], len(args))
    for buf, a in zip(params, args):
        assert tuple(int(d) for d in buf.shape) == a.shape and str(buf.dtype) == str(a.dtype), (buf, a.shape, a.dtype)


def test_candidates_give_measure_the_kernels_convention_and_weights():
    """The default and random legal points of the space on sm_90 and sm_80: the tuner's builder plans them as the
    compiler does (``plan_grouped_gemm``: the same effective knobs), one kernel whose parameters are measure's
    buffers for the entry, and measure's weight buffer -- from the entry's fields alone -- is
    ``PlannedKernel.weights`` (OHWI int8 [K, R, S, C / groups]) of the shape's logical weights and of fresh random
    weights."""
    sp = SPACES[GG]
    rng, wrng = random.Random("grouped-gemm-tune"), np.random.default_rng(3)
    n = 0
    for name, spec in SHAPES.items():
        for arch in ("sm_90", "sm_80"):
            for kn in (None, sp.sample(rng, spec, arch)):
                assert kn is None or sp.legal(spec, arch, kn) is None, (name, arch, kn)
                cand = _cand(spec, kn, arch)
                funcs, conv = plan_candidate(cand)
                pk = plan_grouped_gemm(spec, arch, kn)
                want = sp.effective(spec, arch, sp.default(spec, arch) if kn is None else kn)
                assert len(funcs) == 1 and conv["label"] == GG and conv["split_k"] == 1 and not conv["streamk"]
                assert conv["effective_knobs"] == TU.knobs_to_dict(pk.knobs) == TU.knobs_to_dict(want), name
                entry = _entry(cand, conv)
                assert "w_group" not in entry  # (the generic weight path: w_expand / w_kperm)
                prob = M.problem(entry, seed=n + 1, problems=M.Problems())
                assert prob["distinct"] > 3
                _check_convention(funcs[0], prob)
                w_log = M.Problems().get(entry, n + 1).arrays["w"]
                assert np.array_equal(prob["head"][1], pk.weights(w_log)), name
                Cg = spec.C // spec.groups
                w = wrng.integers(-128, 128, (spec.K, spec.R, spec.S, Cg))
                got = M.weights(M.Spec(entry["spec"]), w, entry["w_expand"], entry["w_kperm"])
                assert got.dtype == np.int8 and got.shape == (spec.K, spec.R, spec.S, Cg)
                assert np.array_equal(got, pk.weights(w)), name
                n += 1
    assert n == 4 * len(SHAPES)


def test_builder_refuses_illegal_points_before_tir(monkeypatch):
    """A point or shape the space refuses comes back from the builder as "not applicable" with the space's reason,
    and no kernel is built (``gemm.kernel.build_kernel`` not called); a knobs type other than GemmKnobs is refused
    by name."""
    from qcompile.schedules.depthwise import DwConfig
    from qcompile.schedules.gemm import kernel

    def no_tir(*a, **k):
        raise AssertionError("TIR built")

    monkeypatch.setattr(kernel, "build_kernel", no_tir)
    spec = SHAPES["cg32_kg32"]
    wg64 = GemmKnobs(mma="wgmma", BM=128, BN=64, BK=64, WM=1, WN=1, stages=3, pipe=-1, vec=16)
    cases = [
        (spec, wg64, "K / groups = 32 is no multiple of the N tile 64"),  # (an N tile across two groups)
        (spec.replace(K=64, groups=16, C=64), GemmKnobs(), "K / groups = 4 is no multiple of 32"),
        (spec.replace(C=48, K=48, groups=48), GemmKnobs(), "depthwise"),
        (spec.replace(x_dtype="uint4", w_bits=4, out_dtype="uint4", hi=15), GemmKnobs(), "8-bit operands"),
    ]
    for sp_, kn, part in cases:
        why = SPACES[GG].legal(sp_, "sm_90", kn)
        assert why and part in why, why
        with pytest.raises(ValueError, match="not applicable") as e:
            plan_candidate(_cand(sp_, kn))
        assert why in str(e.value)
    with pytest.raises(ValueError, match="grouped_gemm takes GemmKnobs, not DwConfig"):
        plan_candidate(_cand(spec, DwConfig()))


def _model(path, batch=2, seed=0) -> str:
    """A hand-written ONNX QDQ model (opset 13)::

        x (N, 64, 6, 6) -> Q/DQ (uint8) -> Conv 3x3 / pad 1, group 2 (Cg = Kg = 32: grouped_gemm)   -> Q/DQ (uint8)
                        -> Conv 3x3 / pad 1, group 16 (Cg 4, Kg 2: the CUDA-core grouped kernel) -> Q/DQ (uint8)
    """
    import onnx
    from cnn_fixtures import _graph_builders
    from onnx import TensorProto, helper

    rng = np.random.default_rng(seed)
    inits, nodes = [], []
    init, qdq = _graph_builders(inits, nodes)

    def conv(src, name, s_in, cout, cin_g, group):
        ws = (rng.uniform(0.6, 1.4, cout) / (127 * np.sqrt(cin_g * 9) / 2)).astype(np.float32)
        for suffix, arr in (("_wq", rng.integers(-127, 128, (cout, cin_g, 3, 3)).astype(np.int8)), ("_ws", ws),
                            ("_wz", np.zeros(cout, np.int8)),
                            ("_bq", rng.integers(-3000, 3000, cout).astype(np.int32)),
                            ("_bs", (np.float32(s_in) * ws).astype(np.float32)), ("_bz", np.zeros(cout, np.int32))):
            init(name + suffix, arr)
        for t in ("w", "b"):
            nodes.append(helper.make_node("DequantizeLinear", [name + f"_{t}q", name + f"_{t}s", name + f"_{t}z"],
                                          [name + f"_{t}"], axis=0, name=name + f"_{t}DQ"))
        nodes.append(helper.make_node("Conv", [src, name + "_w", name + "_b"], [name + "_y"], group=group,
                                      kernel_shape=[3, 3], pads=[1, 1, 1, 1], name=name))
        return name + "_y"

    h = qdq("x", "in", 0.03, 117)
    h = qdq(conv(h, "gg", 0.03, 64, 32, 2), "a1", 0.04, 20)
    h = qdq(conv(h, "gc", 0.04, 32, 4, 16), "out", 0.03, 128)
    graph = helper.make_graph(nodes, "grouped_gemm", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                                   [batch, 64, 6, 6])],
                              [helper.make_tensor_value_info(h, TensorProto.FLOAT, [batch, 32, 6, 6])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return str(path)


def _tasks(path, batch=2, logs=()):
    from qcompile.tune.tasks import extract_tasks

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return extract_tasks(path, "sm_90", batches=(batch,), tuning_logs=logs, log=lambda *a: None)


def test_grouped_gemm_layer_is_a_task(tmp_path, monkeypatch):
    """The qualifying layer is a ``grouped_gemm`` task (key ``|g2``, the kernel's default tile, "default"), the
    other grouped layer a ``grouped`` one; its estimate is the tensor cores' roofline, its ops the MACs over groups;
    with ``QCOMPILE_GROUPED_GEMM=0`` the layer is a ``grouped`` task. A log record of its knobs is picked up."""
    from qcompile.tune.tasks import DP4A_TOPS, LAUNCH_MS, estimate_ms

    monkeypatch.delenv("QCOMPILE_GROUPED_GEMM", raising=False)
    path = _model(tmp_path / "gg.onnx")
    tasks = _tasks(path)
    assert [(t.layers, t.strategy, t.source) for t in tasks] == [(["gg"], GG, "default"), (["gc"], "grouped", "default")]
    t = tasks[0]
    sp = SPACES[GG]
    assert t.key == TU.tuning_key(t.spec) and t.key.endswith("|g2") and t.spec.groups == 2 and t.spec.w_bits == 8
    assert t.planned_knobs == sp.effective(t.spec, "sm_90", sp.default(t.spec, "sm_90"))
    assert t.est_ms == estimate_ms(t.spec, "sm_90", GG) and t.ops == 2 * t.spec.macs() // 2
    # the roofline: ResNeXt-50 layer4 at batch 256 (memory-bound on tensor cores), and a compute-bound grouped
    # layer at the int8 tensor-core peak (H100: 1979 TOPS) where the CUDA-core kernels get dp4a's
    rx = ConvSpec(N=256, H=7, W=7, C=1024, K=1024, R=3, S=3, padding=1, groups=32, **_U8)
    assert estimate_ms(rx, "sm_90", "grouped") > 4 * estimate_ms(rx, "sm_90", GG)
    big = ConvSpec(N=256, H=14, W=14, C=256, K=256, R=3, S=3, padding=1, groups=2, **_U8)
    ops = 2 * big.macs() // big.groups
    assert estimate_ms(big, "sm_90", GG) == pytest.approx(ops / 1979e9 + LAUNCH_MS)
    assert estimate_ms(big, "sm_90", "grouped") == pytest.approx(ops / (DP4A_TOPS["sm_90"] * 1e9) + LAUNCH_MS)
    monkeypatch.setenv("QCOMPILE_GROUPED_GEMM", "0")
    assert [(u.layers, u.strategy) for u in _tasks(path)] == [(["gg"], "grouped"), (["gc"], "grouped")]
    monkeypatch.delenv("QCOMPILE_GROUPED_GEMM")
    kn = GemmKnobs(BM=64, BN=32, BK=64, WM=2, WN=1, stages=3)
    log = tmp_path / "gg.jsonl"
    log.write_text(TU.format_record(TU.make_record("sm_90", "GPU T", 132, t.key, GG, kn, ms=0.01)) + "\n")
    got = _tasks(path, logs=[str(log)])[0]
    assert (got.strategy, got.source, got.planned_knobs) == (GG, "arch", sp.effective(t.spec, "sm_90", kn))


def test_search_and_features_over_the_space():
    """``propose`` on a grouped_gemm task: the default alone first, then the space's start points and fresh points,
    all legal and distinct kernels; the features' reduction is one group's (R x S x Cg), the K-chunks too."""
    from qcompile.tune.search import TaskState, propose
    from qcompile.tune.tasks import Task

    spec = SHAPES["cg64_kg64_i8"]
    sp = SPACES[GG]
    task = Task(TU.tuning_key(spec), spec, GG, "sm_90", ["g"], "default", None)
    st = TaskState(task, sp)
    first = propose(st, 8, seed=1)
    assert first == [sp.default(spec, "sm_90")]
    st.add(first[0], "ok", 0.02, "default")
    seen = {st.knobs_id(first[0])}
    for r in range(3):
        got = propose(st, 8, seed=1)
        assert got and all(sp.legal(spec, "sm_90", kn) is None for kn in got)
        ids = {st.knobs_id(kn) for kn in got}
        assert len(ids) == len(got) and not ids & seen
        seen |= ids
        for i, kn in enumerate(got):
            st.add(kn, "ok", 0.02 + 0.001 * (i + r))
    names = sp.feature_names()
    f = dict(zip(names, sp.features(spec, "sm_90", GemmKnobs(BM=128, BN=64, BK=64, WM=4, WN=1, stages=4))))
    assert len(names) == len(sp.features(spec, "sm_90", first[0]))
    kred = spec.R * spec.S * spec.C // spec.groups
    assert f["log2_gemm_k"] == math.log2(kred) and f["chunks_per_split"] == math.ceil(kred / 64) and f["split"] == 1
    dense = SPACES["implicit_gemm"].features(spec.replace(groups=1), "sm_90", GemmKnobs())
    assert dense[names.index("log2_gemm_k")] == math.log2(spec.R * spec.S * spec.C)  # (dense: unchanged)


def _tile_time(kn: dict) -> float:
    """A synthetic time of the effective tile (fastest at BM 64, BK 64, 3 stages, mma.sync)."""
    return 0.01 * (1 + abs(math.log2(kn["BM"] / 64)) * 0.2 + abs(math.log2(kn["BK"] / 64)) * 0.1
                   + abs(kn["stages"] - 3) * 0.05 + 0.3 * (kn["mma"] == "wgmma"))


def test_tuner_tunes_the_grouped_gemm_task(tmp_path, monkeypatch):
    """The scheduler on the model's tasks with the real spaces and the cost model (XGBoost, where installed): the
    grouped_gemm task's default first, then points of its space built by the tuner's planning; its records in the
    log; the compiler's task extraction then takes the best one."""
    from qcompile.tune.cost_model import CostModel
    from qcompile.tune.scheduler import Tuner

    monkeypatch.delenv("QCOMPILE_GROUPED_GEMM", raising=False)
    try:
        import xgboost  # noqa: F401
        model = CostModel(min_rows=4)
    except ImportError:
        model = None
    path = _model(tmp_path / "gg.onnx")
    tasks = [t for t in _tasks(path) if t.strategy == GG]
    log = tmp_path / "tuned.jsonl"
    Tuner(tasks, _HostBuilder(), EffectiveKnobsRunner(_tile_time), str(log), model=model, log=lambda s: None).run(trials=24)
    recs = [json.loads(ln) for ln in log.read_text().splitlines()]
    assert len(recs) >= 12 and {r["strategy"] for r in recs} == {GG} and recs[0]["variant"] == "default"
    assert all(r["status"] == "ok" and r["key"] == tasks[0].key for r in recs)
    if model is not None:
        assert model.trained(GG)
    best = min(recs, key=lambda r: r["ms"])
    TU.clear_cache()
    (got,) = [t for t in _tasks(path, logs=[str(log)]) if t.strategy == GG]
    sp = SPACES[GG]
    assert got.source == "arch" and got.planned_knobs == sp.effective(got.spec, "sm_90",
                                                                      TU.knobs_from_dict(best["knobs"], GG))


@pytest.mark.nvcc
def test_offline_export_holds_grouped_gemm_candidates(tmp_path, monkeypatch):
    """``qtune MODEL --arch sm_90 --export DIR --trials 4`` on the model above: the exported batch holds a built
    grouped_gemm candidate (its library, one kernel, GemmKnobs) beside the grouped one, and measure's weight buffer
    for its entry is the compiler's."""
    from qcompile.tune import cli

    monkeypatch.delenv("QCOMPILE_GROUPED_GEMM", raising=False)
    path = _model(tmp_path / "gg.onnx")
    exp = tmp_path / "exp"
    rc = cli.qtune_main([path, "--arch", "sm_90", "--batch", "2", "--export", str(exp), "--trials", "4",
                         "-o", str(tmp_path / "t.jsonl"), "--jobs", "1", "-q"])
    assert rc == 0
    (batch,) = os.listdir(exp)
    folder = exp / batch
    entries = json.loads((folder / "manifest.json").read_text())["candidates"]
    assert sorted(e["strategy"] for e in entries) == ["grouped", GG]
    assert os.path.exists(folder / "measure.py")
    (e,) = [e for e in entries if e["strategy"] == GG]
    assert os.path.getsize(folder / e["so"]) > 0 and len(e["funcs"]) == 1 and e["knobs_type"] == "GemmKnobs"
    assert e["split_k"] == 1 and not e["streamk"] and "w_group" not in e and e["spec"]["groups"] == 2
    spec = ConvSpec(**{k: tuple(v) if isinstance(v, list) else v for k, v in e["spec"].items()})
    pk = plan_grouped_gemm(spec, "sm_90", GemmKnobs(**e["knobs"]))
    assert TU.knobs_to_dict(pk.knobs) == e["effective_knobs"]
    prob = M.problem(e, seed=5, problems=M.Problems())
    assert np.array_equal(prob["head"][1], pk.weights(M.Problems().get(e, 5).arrays["w"]))
    # what a results record carries of each candidate (measure.candidate_info) rebuilds it on import, knobs typed
    from qcompile.tune.runners import candidate_from

    for entry in entries:
        c = candidate_from(M.candidate_info(entry))
        assert (c.strategy, c.spec, c.key) == (entry["strategy"], ConvSpec(**{
            k: tuple(v) if isinstance(v, list) else v for k, v in entry["spec"].items()}), entry["key"])
        assert type(c.knobs).__name__ == entry["knobs_type"] and TU.knobs_to_dict(c.knobs) == entry["knobs"]
