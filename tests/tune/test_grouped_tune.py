"""The tuner on the grouped convs' CUDA-core kernels (``depthwise``, ``grouped``): task extraction, candidates built
by the tuner's builder (TIR and TVM's CUDA codegen; nvcc not run) whose generated CUDA, run thread by thread on the
host (tests/cuda_on_host.py), equals the measuring side's NumPy reference on its own buffers; the search over the
spaces; and the compiler picking a record up (device / arch / nearest batch). No GPU."""
from __future__ import annotations

import dataclasses
import json
import os
import random
import warnings

import numpy as np
import pytest
from fakes import fresh_logs  # noqa: F401  (the fixture)
from fakes import EffectiveKnobsRunner

from qcompile.schedules import tuning as TU
from qcompile.schedules.depthwise import DwConfig
from qcompile.schedules.grouped import GroupedConfig
from qcompile.schedules.space import SPACES
from qcompile.schedules.spec import ConvSpec
from qcompile.tune import measure as M
from qcompile.tune.build import plan_candidate
from qcompile.tune.common import Builder, Built
from qcompile.tune.common import Candidate

_U8 = dict(x_dtype="uint8", out_dtype="uint8", zo=3, lo=0, hi=255)
SHAPES = {
    "dw_3x3": ConvSpec(N=2, H=13, W=11, C=48, K=48, R=3, S=3, padding=1, groups=48, pad_value=9, **_U8),
    "dw_5x5_s2_i8_res": ConvSpec(N=1, H=15, W=15, C=32, K=32, R=5, S=5, stride=2, padding=2, groups=32,
                                 x_dtype="int8", out_dtype="int8", lo=-128, hi=127, has_residual=True,
                                 res_dtype="uint8", lo2=0, hi2=255),
    "dw_c6_bytes": ConvSpec(N=1, H=9, W=9, C=6, K=6, R=3, S=3, padding=1, groups=6, **_U8),
    "gr_cg8": ConvSpec(N=2, H=9, W=9, C=64, K=64, R=3, S=3, padding=1, groups=8, **_U8),
    "gr_cg3_dil_u4out": ConvSpec(N=1, H=11, W=11, C=12, K=24, R=3, S=3, padding=2, dilation=2, groups=4,
                                 x_dtype="uint8", w_bits=4, out_dtype="uint4", lo=0, hi=15),
}

pytestmark = pytest.mark.usefixtures("fresh_logs")  # (no packaged logs, a fresh log cache: fakes.fresh_logs)


def _strategy(spec):
    from qcompile.schedules.grouped import grouped_strategy

    return grouped_strategy(spec, spec.groups)


def _grid(spec, strategy, kn) -> int:
    """Blocks of the kernel, from its documented thread tile (schedules/depthwise.py, grouped.py)."""
    ch, chans = (kn["vec"], spec.C) if strategy == "depthwise" else (kn["kt"], spec.K)
    total = spec.N * spec.P * -(-spec.Q // kn["qt"]) * (chans // ch)
    return -(-total // kn["threads"])


def _run_on_host(cand: Candidate, tmp, seed: int):
    """The candidate built by the tuner's builder (plan_candidate) and its CUDA run on the host with the measuring
    side's buffers (``measure.problem``: its weight format and reference), the output poisoned first."""
    from cuda_on_host import build_on_host
    from test_kernel_identity import cuda_source

    funcs, conv = plan_candidate(cand)
    entry = dict(spec=dataclasses.asdict(cand.spec), w_group=conv["w_group"])
    prob = M.problem(entry, seed, problems=M.Problems())
    run, params = build_on_host(cuda_source(funcs[0], cand.arch), str(tmp))
    out = M.poison(prob["out_shape"], prob["out_dtype"], prob["rng"])
    bufs = dict(zip(("x", "w", "bias", "M", "S", "res", "rq2"), prob["head"] + prob["res"]), out=out)
    names = {"xw": "x", "ww": "w", "Mq": "M", "Sq": "S"}  # (the kernels' word views of x and w, the epilogue vectors)
    args = [np.ascontiguousarray(bufs[names.get(n[:-4], n[:-4])]) for n in params]  # (params: "<name>_ptr", sorted)
    assert sum(a is out for a in args) == 1 and len(args) == len(bufs), params
    run(args, _grid(cand.spec, cand.strategy, conv["effective_knobs"]), conv["effective_knobs"]["threads"])
    return out, prob, conv


def test_candidates_run_bit_exact_on_the_host(tmp_path):
    """Random legal points of both spaces (and each space's default point) on sm_90 and sm_75: the tuner builds them,
    and their generated CUDA, run thread by thread on the host, equals measure's reference byte for byte on its own
    inputs and weight format (which is the compiler's: ``GroupedPlanned.weights``)."""
    from qcompile.schedules.grouped import plan_grouped

    rng = random.Random("grouped-host")
    n = 0
    for name, spec in SHAPES.items():
        strategy = _strategy(spec)
        sp = SPACES[strategy]
        for arch in ("sm_90", "sm_75"):
            kns = [sp.default(spec, arch), sp.sample(rng, spec, arch)]
            for kn in kns:
                assert kn is not None and sp.legal(spec, arch, kn) is None, (name, arch, kn)
                cand = Candidate(TU.tuning_key(spec), spec, arch, strategy, kn)
                d = tmp_path / f"k{n}"
                d.mkdir()
                out, prob, conv = _run_on_host(cand, d, seed=n + 1)
                assert prob["distinct"] > 3
                assert np.array_equal(out.view(np.uint8), np.ascontiguousarray(prob["ref"]).view(np.uint8)), (
                    name, arch, kn)
                assert conv["effective_knobs"] == TU.knobs_to_dict(sp.effective(spec, arch, kn))
                n += 1
        w = np.random.default_rng(0).integers(-8 if spec.w_bits == 4 else -128, 8 if spec.w_bits == 4 else 128,
                                              (spec.K, spec.R, spec.S, spec.C // spec.groups))
        pk = plan_grouped(spec, spec.groups, "sm_90")
        assert np.array_equal(pk.weights(w), M.group_weights(w, strategy)), name
    assert n == 4 * len(SHAPES)


def test_builder_refuses_illegal_points_before_tir(monkeypatch):
    """A point its space refuses (or a strategy that is not the layer's kernel) comes back from the builder as "not
    applicable" with the space's reason, without building TIR."""
    from qcompile.schedules import depthwise, grouped

    class NoTIR:
        def __getattr__(self, name):
            raise AssertionError(f"TIR built (T.{name})")

    monkeypatch.setattr(depthwise, "T", NoTIR())
    monkeypatch.setattr(grouped, "T", NoTIR())
    dw, gr = SHAPES["dw_3x3"], SHAPES["gr_cg8"]
    for spec, strategy, kn in ((dw, "depthwise", DwConfig(vec=2)), (dw, "depthwise", DwConfig(qt=9)),
                               (gr, "grouped", GroupedConfig(threads=48)), (gr, "grouped", GroupedConfig(kt=3))):
        why = SPACES[strategy].legal(spec, "sm_90", kn)
        assert why
        with pytest.raises(ValueError, match="not applicable") as e:
            plan_candidate(Candidate(TU.tuning_key(spec), spec, "sm_90", strategy, kn))
        assert why in str(e.value)
    with pytest.raises(ValueError, match="run on depthwise, not grouped"):
        plan_candidate(Candidate(TU.tuning_key(dw), dw, "sm_90", "grouped", GroupedConfig()))


def _model(tmp_path, batch=2):
    import cnn_fixtures as F

    return F.qdq_grouped_clip_model(str(tmp_path / f"grouped_b{batch}.onnx"), batch=batch)


def _tasks(path, logs=(), gpu=None, batch=2):
    from qcompile.tune.tasks import extract_tasks

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return extract_tasks(path, "sm_90", batches=(batch,), tuning_logs=logs, gpu=gpu, log=lambda *a: None)


def _sources(path, logs=(), gpu=None, batch=2) -> dict:
    """The compile summary's knobs column (``PipelineRecord.knobs``: layer -> where its knobs came from) and the
    planned kernels, from the pipeline up to the dispatch."""
    import tvm

    from qcompile.driver import CompileOptions, import_model
    from qcompile.errors import run_pass
    from qcompile.pipeline import PipelineRecord, qcompile_pipeline

    mod, _ = import_model(path, CompileOptions(target="cuda", arch="sm_90", batch=batch), lambda *a: None)
    rec = PipelineRecord()
    with warnings.catch_warnings(), tvm.transform.PassContext(opt_level=3):
        warnings.simplefilter("ignore")
        run_pass(qcompile_pipeline({"kind": "cuda", "arch": "sm_90"}, "NHWC", pack_int4=False, backend=False,
                                   record=rec, tuning_logs=tuple(logs), gpu=gpu), mod)
    return rec.knobs, dict(rec.planned)


def test_grouped_layers_are_tasks_and_their_records_are_picked_up(tmp_path):
    """The depthwise and the grouped layer of a QDQ model are one task each (keys with ``|gG``, the strategy of the
    kernel the dispatch runs them on, the kernel's automatic tile, "default"). A log with a record for each: the
    compiler builds those layers with the records' tiles, and says where they came from -- this GPU's ("device"),
    another GPU's of the arch ("arch"), and at another batch size the nearest batch's ("nearest")."""
    path = _model(tmp_path)
    tasks = _tasks(path)
    assert [(t.layers, t.strategy, t.source) for t in tasks] == [(["dw"], "depthwise", "default"),
                                                                  (["gconv"], "grouped", "default")]
    assert all(t.key == TU.tuning_key(t.spec) and f"|g{t.spec.groups}" in t.key for t in tasks)
    assert tasks[0].spec.groups == 8 and tasks[1].spec.groups == 4 and tasks[0].est_ms > 0
    tiles = {"depthwise": DwConfig(vec=8, qt=2, threads=64), "grouped": GroupedConfig(kt=4, qt=3, threads=128)}
    log = tmp_path / "grouped.jsonl"
    log.write_text("".join(TU.format_record(TU.make_record("sm_90", "GPU T", 132, t.key, t.strategy,
                                                           tiles[t.strategy], ms=0.01)) + "\n" for t in tasks))
    for gpu, want in (("GPU T", "device"), ("GPU U", "arch")):
        got = _tasks(path, [str(log)], gpu)
        assert [(t.source, t.planned_knobs) for t in got] == [(want, tiles["depthwise"]), (want, tiles["grouped"])]
        knobs, planned = _sources(path, [str(log)], gpu)
        assert knobs["dw"] == knobs["gconv"] == want, knobs
        assert planned["dw"].knobs == tiles["depthwise"] and planned["gconv"].knobs == tiles["grouped"]
        assert planned["dw"].funcs[0].attrs["qcompile.knobs_source"] == want
    far = _tasks(_model(tmp_path, batch=4), [str(log)], "GPU T", batch=4)
    assert [(t.source, t.planned_knobs) for t in far] == [("nearest", tiles["depthwise"]),
                                                          ("nearest", tiles["grouped"])]
    knobs, _ = _sources(path)  # (no log: the automatic tiles)
    assert knobs["dw"] == knobs["gconv"] == "default"


class _HostBuilder(Builder):
    """Plans each candidate as the tuner's builder does (TIR; no nvcc)."""

    def build(self, cands):
        out = []
        for c in cands:
            try:
                _, conv = plan_candidate(c)
                out.append(Built(c, "/host/none.so", dict(effective_knobs=conv["effective_knobs"]), build_s=0.1))
            except ValueError as e:
                out.append(Built(c, None, error=str(e)))
        return out


def _grouped_time(kn: dict) -> float:
    """A synthetic time of the effective grouped / depthwise point: fastest at 3 rows a thread, 8 channels, 128
    threads."""
    ch = kn.get("vec", kn.get("kt"))
    return 0.01 * (1 + abs(kn["qt"] - 3) * 0.1 + abs(ch - 8) * 0.02 + abs(kn["threads"] - 128) / 1024)


def test_qtune_search_tunes_grouped_tasks(tmp_path):
    """The tuner's scheduler on the model's grouped tasks with the real spaces: defaults first, then points of each
    space (legal ones, built by the tuner's planning), records of each strategy in the log; the compiler then takes
    the best record of each layer."""
    from qcompile.tune.scheduler import Tuner

    path = _model(tmp_path)
    tasks = _tasks(path)
    log = tmp_path / "tuned.jsonl"
    runner = EffectiveKnobsRunner(_grouped_time)
    Tuner(tasks, _HostBuilder(), runner, str(log), log=lambda s: None).run(trials=16)
    recs = [json.loads(ln) for ln in log.read_text().splitlines()]
    assert {r["strategy"] for r in recs} == {"depthwise", "grouped"} and len(recs) >= 8
    assert all(r["status"] == "ok" and r["key"] in {t.key for t in tasks} for r in recs)
    best = {}
    for r in recs:
        if r["strategy"] not in best or r["ms"] < best[r["strategy"]]["ms"]:
            best[r["strategy"]] = r
    TU.clear_cache()
    got = _tasks(path, [str(log)], "GPU T")
    for t in got:
        assert t.source == "device"
        want = SPACES[t.strategy].effective(t.spec, "sm_90", TU.knobs_from_dict(best[t.strategy]["knobs"],
                                                                                t.strategy))
        assert t.planned_knobs == want, (t.strategy, t.planned_knobs, best[t.strategy])
    assert os.path.getsize(log) > 0
