"""scripts/bench_layers.py, the per-layer benchmark: the layers it builds are the convs compiled models run, its build
is an offline batch of qcompile.tune (nvcc, no GPU), its results render as tables, and the tables in
docs/BENCHMARKS.md are what it writes from the committed results file."""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import re

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "docs", "bench", "layers_resnet50_h100.json")


@pytest.fixture(scope="module")
def BL():
    spec = importlib.util.spec_from_file_location("bench_layers", os.path.join(ROOT, "scripts", "bench_layers.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_layer_tables_reproduce_the_docs(BL):
    """BENCHMARKS' two layer tables are what ``table`` writes from the committed results file; every script they
    name exists."""
    text = open(os.path.join(ROOT, "docs", "BENCHMARKS.md")).read()
    for name, block in (("layers", BL.table(RESULTS)), ("layers_int4_vs_int8", BL.paired_table(RESULTS))):
        assert f"<!-- table:{name} -->\n{block}<!-- /table:{name} -->" in text, f"BENCHMARKS.md: {name} is stale"
        for script in re.findall(r"scripts/\w+\.py", block):
            assert os.path.isfile(os.path.join(ROOT, script)), script
    block = BL.table(RESULTS)
    assert "one CUDA graph" in block and block.count("\n| r50_") == 72


def test_rows_are_the_convs_compiled_models_run(BL):
    """Every distinct ResNet-50 conv per batch; the stem runs its space-to-depth form with 8-bit operands in both
    rows while cuDNN gets the 7x7 stride-2 layer on 4 channels; the 1x1 expansions carry the residual add (key
    ``|res``), no other layer does; each kernel's strategy is the selector's, its knobs source the lookup's."""
    from qcompile.schedules import select_strategy
    from qcompile.schedules.layers import RESNET50, distinct

    rows = BL.layer_rows([8, 64])
    names = [r[0] for r in distinct(RESNET50)]
    assert [r["layer"] for r in rows] == [f"{n}_b{N}" for N in (8, 64) for n in names]
    stem = rows[0]
    assert (stem["C"], stem["R"], stem["stride"], stem["padding"]) == (4, 7, 2, 3)
    for k in stem["kernels"].values():
        assert (k["spec"].C, k["spec"].R, k["spec"].strides, k["spec"].x_bits, k["spec"].w_bits) == (16, 4, (1, 1), 8, 8)
    assert stem["kernels"]["int4"]["spec"].out_dtype == "uint4"
    for r in rows:
        res = r["layer"].split("_b")[0].endswith("_1x1b")
        assert r["residual"] == res
        for dt, k in r["kernels"].items():
            assert k["key"].endswith("|res") == res == k["spec"].has_residual
            assert k["strategy"] == select_strategy(k["spec"], "sm_90")
            assert k["source"] in (("",) if k["strategy"] == "fallback" else ("device", "arch", "nearest", "default"))
            assert k["spec"].x_bits == (4 if dt == "int4" and not r["layer"].startswith("r50_stem") else 8)
    assert {k["strategy"] for r in rows for k in r["kernels"].values()} >= {"direct_halo", "implicit_gemm",
                                                                            "implicit_gemm_t"}
    assert [r["layer"] for r in BL.layer_rows([8], only="_1x1b$")] == [f"r50_l{i}_1x1b_b8" for i in (1, 2, 3, 4)]
    assert not any(r["residual"] for r in BL.layer_rows([8], residual=()))


@pytest.mark.parametrize("dt", ["int8", "int4"])
def test_residual_form_reference_is_the_projects_and_varied(BL, dt):
    """The residual form the bench builds (the per-tensor second stage RQ2_RESNET50 in int32): measure.py's NumPy
    reference -- the check of every kernel the bench times -- equals qcompile.schedules.reference and its outputs
    vary (a check against a constant output would prove nothing)."""
    from qcompile.schedules import reference as R
    from qcompile.tune import measure as M

    spec = BL.compiled_spec(2, 64, 7, 256, 1, 1, 0, dt, residual=True)
    d = M.Spec(dataclasses.asdict(spec))
    x, w, b, Mq, S, res = R.random_problem(spec, np.random.default_rng(7))
    ref = R.conv_reference(spec, x, w, b, Mq, S, res)
    got = M.conv_reference(d, x, w, b, Mq, S, res)
    assert np.array_equal(got, ref) and np.unique(ref).size > 8


def _fake_layers_doc(BL, batches):
    rows = BL.layer_rows(batches)
    for r in rows:
        for dt, k in r["kernels"].items():
            k.update(spec=dataclasses.asdict(k["spec"]), id=f"k_{r['layer']}_{dt}", label=k["strategy"], knobs=None)
    return dict(format=BL.LAYERS_FORMAT, arch="sm_90", date="2026-11-26", commit="abc1234",
                build_command="python scripts/bench_layers.py build --dir D", rows=rows)


def _fake_measured(doc, bad=()):
    res = []
    for r in doc["rows"]:
        for dt, k in r["kernels"].items():
            st = "mismatch" if k["id"] in bad else "ok"
            res.append(dict(id=k["id"], status=st, ms=0.001 * r["gops"] + 0.002 if st == "ok" else None,
                            detail="3 of 9 outputs differ" if st != "ok" else ""))
    return dict(format="qcompile-tune-batch/1", device=dict(name="NVIDIA TEST GPU", arch="sm_90", sms=132),
                timing="time_evaluator", date="2026-11-27", results=res)


def test_device_results_render_and_merge(BL, tmp_path):
    """A device run's results (measure.py's records, the baselines, paired ratios) render as both tables, naming
    the timing method of each side and the build and device commands; runs over part of the batches merge into one
    results file in batch order; a kernel that is not bit-exact keeps its status and no time."""
    doc = _fake_layers_doc(BL, [8, 64])
    part = lambda N: dict(doc, rows=[r for r in doc["rows"] if r["N"] == N])
    base = {r["layer"]: (0.004 * r["gops"] + 0.003, float("nan") if r["C"] == 4 else 0.01) for r in doc["rows"]}
    paired = {r["layer"]: [1.1, 0.9, 1.0] for r in doc["rows"]}
    r64 = BL.assemble(part(64), _fake_measured(part(64)), base, paired)
    r64["command"] = "python3 scripts/bench_layers.py device --dir D --batches 64 --ab-rounds 3"
    bad = {"k_r50_l2_3x3_b8_int4"}
    r8 = BL.assemble(part(8), _fake_measured(part(8), bad), base, paired)
    r8["command"] = "python3 scripts/bench_layers.py device --dir D --batches 8 --ab-rounds 3"
    merged = BL.merge(r64, r8)
    assert [r["layer"] for r in merged["bench"]] == [r["layer"] for r in doc["rows"]]
    assert BL.merge(dict(r64, commit="other"), r8) is r8  # (another build: not merged)
    row = next(r for r in merged["bench"] if r["layer"] == "r50_l2_3x3_b8")
    assert row["int4_status"] == "mismatch" and math.isnan(row["int4_ms"]) and row["int4_detail"]
    assert row["int8_status"] == "ok" and row["int8_ms"] > 0 and row["int4_over_int8_ab"] == 1.0
    path = tmp_path / "results.json"
    path.write_text(json.dumps(merged))
    block = BL.table(str(path))
    caption = block.splitlines()[0]
    assert caption.startswith("NVIDIA TEST GPU, 2026-11-27, code at `abc1234`.")
    assert "TVM's time_evaluator" in caption and "CUDA graphs" in caption and "median of 7 repeats" in caption
    assert "r50_l1_1x1b, r50_l2_1x1b, r50_l3_1x1b, r50_l4_1x1b: with the residual add" in caption
    assert "`python scripts/bench_layers.py build --dir D`" in caption and "--batches 8 --ab-rounds 3`" in caption
    assert block.count("\n| r50_") == 48 and "INT4 vs INT8 (paired)" in block
    stem = next(ln for ln in block.splitlines() if ln.startswith("| r50_stem | 8 |"))
    assert "| 4->64 | 7x7/2 |" in stem and "| n/a |" in stem
    assert "| 8 | 1.00x | 0 of 24 |" in BL.paired_table(str(path))


@pytest.mark.nvcc
def test_build_writes_an_offline_batch_of_the_compiled_kernels(BL, tmp_path):
    """``build`` on two layers at batch 8: an offline batch of qcompile.tune (measure.py, run.sh, one library per
    distinct kernel) and layers.json, each kernel built with the spec, strategy and knobs the compiler plans for it
    (``plan_conv`` with no knobs given); a folder that is not empty is refused."""
    from qcompile.schedules import ConvSpec, plan_conv
    from qcompile.tune import measure as M

    out = tmp_path / "b"
    assert BL.main(["build", "--dir", str(out), "--batches", "8", "--only", "r50_stem|r50_l4_1x1b", "--jobs", "2"]) == 0
    names = set(os.listdir(out))
    assert {"layers.json", "manifest.json", "measure.py", "run.sh", "README.txt"} <= names
    assert open(out / "measure.py").read() == open(M.__file__).read()
    doc = json.loads((out / "layers.json").read_text())
    man = {e["id"]: e for e in json.loads((out / "manifest.json").read_text())["candidates"]}
    assert [r["layer"] for r in doc["rows"]] == ["r50_stem_b8", "r50_l4_1x1b_b8"]
    assert doc["build_command"].startswith("python scripts/bench_layers.py build --dir ")
    ks = [k for r in doc["rows"] for k in r["kernels"].values()]
    assert {k["id"] for k in ks} == set(man) and len(names - {"layers.json", "manifest.json", "measure.py", "run.sh",
                                                             "README.txt"}) == len(man) == 4
    for k in ks:
        e = man[k["id"]]
        assert e["spec"] == k["spec"] and e["strategy"] == k["strategy"] and e["key"] == k["key"]
        spec = ConvSpec(**{f: tuple(v) if isinstance(v, list) else v for f, v in k["spec"].items()})
        pk = plan_conv(spec, "sm_90", k["strategy"])  # (what a compiled model's dispatch plans: no knobs given)
        assert e["effective_knobs"] == k["knobs"] == dataclasses.asdict(pk.knobs)
        assert len(e["funcs"]) == len(pk.funcs) and e["split_k"] == pk.split_k
    assert [k["strategy"] for k in doc["rows"][0]["kernels"].values()] == ["direct_halo"] * 2
    assert all(k["key"].endswith("|res") for k in doc["rows"][1]["kernels"].values())
    with pytest.raises(SystemExit, match="not empty"):
        BL.main(["build", "--dir", str(out), "--batches", "8", "--only", "r50_fc"])
