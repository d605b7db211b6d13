"""scripts/roofline.py: ncu's CSV read back, kernels joined with the build's launch plan (deduplicated kernels told
apart by launch order), integer ops / bytes / bound arithmetic, stage sums, and -- on a real cuda build of a tiny
model -- every kernel of its CUDA source mapped to a layer or to glue."""
from __future__ import annotations

import importlib.util
import json
import os
import re
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def RL():
    spec = importlib.util.spec_from_file_location("roofline", os.path.join(ROOT, "scripts", "roofline.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules["roofline"] = mod  # (its dataclasses look their module up)
    spec.loader.exec_module(mod)
    return mod


# ---------------- ncu's CSV ----------------

RAW = '''{{"profiled": 1}}
==PROF== Connected to process 4242 (/usr/bin/python3.12)
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","dram__bytes_read.sum","dram__bytes_write.sum","gpu__time_duration.sum"
"","","","","","","","","","","","{u_b}","byte","{u_t}"
"0","4242","python3.12","127.0.0.1","qconv_conv1_quantized_kernel","1","7","(384, 1, 1)","(132, 1, 1)","0","9.0","{r0}","1,000","{t0}"
"1","4242","python3.12","127.0.0.1","qpool_max_0_kernel","1","7","(256, 1, 1)","(3136, 1, 1)","0","9.0","{r1}","2,500,000","{t1}"
==PROF== Disconnected from process 4242
'''


@pytest.mark.parametrize("units", [("byte", "nsecond", "12,345,678", "40", "53,120", "104,700"),
                                   ("Mbyte", "usecond", "12.345678", "0.00004", "53.12", "104.7")])
def test_ncu_raw_page(RL, units):
    """``--page raw``: a units row (base units, or ncu's scaled ones), thousands separators, the application's and
    ncu's own lines around the CSV."""
    u_b, u_t, r0, r1, t0, t1 = units
    rows = RL.parse_ncu_csv(RAW.format(u_b=u_b, u_t=u_t, r0=r0, r1=r1, t0=t0, t1=t1))
    assert [r["name"] for r in rows] == ["qconv_conv1_quantized_kernel", "qpool_max_0_kernel"]
    assert rows[0]["grid"] == "132x1x1" and rows[0]["block"] == "384x1x1"
    assert rows[0]["dram_read"] == pytest.approx(12_345_678) and rows[0]["dram_write"] == 1000
    assert rows[1]["dram_read"] == pytest.approx(40) and rows[1]["dram_write"] == 2_500_000
    assert rows[0]["time_ns"] == pytest.approx(53_120) and rows[1]["time_ns"] == pytest.approx(104_700)


def test_ncu_details_page(RL):
    """The details page (one row per kernel and metric, each with its unit), kernels in ID order."""
    head = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size",'
            '"Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"')
    rows = [head]
    for kid, name, (t, rd, wr) in ((1, "b_kernel", ("2.5", "3", "1")), (0, "a_kernel(int*)", ("1.5", "2", "0.5"))):
        for metric, unit, v in (("gpu__time_duration.sum", "usecond", t), ("dram__bytes_read.sum", "Mbyte", rd),
                                ("dram__bytes_write.sum", "Mbyte", wr), ("launch__registers_per_thread", "", "96")):
            rows.append(f'"{kid}","1","p","h","{name}","1","7","(128, 1, 1)","(8, 4, 1)","0","9.0",'
                        f'"Command line profiler metrics","{metric}","{unit}","{v}"')
    got = RL.parse_ncu_csv("\n".join(rows))
    assert [(r["name"], r["time_ns"], r["dram_read"], r["dram_write"], r["grid"]) for r in got] == [
        ("a_kernel", 1500.0, 2e6, 0.5e6, "8x4x1"), ("b_kernel", 2500.0, 3e6, 1e6, "8x4x1")]


def test_ncu_csv_errors(RL):
    with pytest.raises(ValueError, match="no header"):
        RL.parse_ncu_csv("==PROF== No kernels were profiled.\n")
    bad = RAW.format(u_b="byte", u_t="furlong", r0="1", r1="1", t0="1", t1="1")
    with pytest.raises(ValueError, match="unknown unit 'furlong'"):
        RL.parse_ncu_csv(bad)
    lacking = "\n".join(ln.replace(',"gpu__time_duration.sum"', "") if ln.startswith('"ID"') else ln
                        for ln in RAW.format(u_b="byte", u_t="nsecond", r0="1", r1="1", t0="1", t1="1").splitlines())
    with pytest.raises(ValueError, match="lacks gpu__time_duration.sum"):
        RL.parse_ncu_csv(lacking)


def test_ncu_command(RL):
    cmd = RL.ncu_command("ncu", "/tmp/rep", "m.so", 3)
    s = " ".join(cmd)
    for flag in ("--graph-profiling node", "--cache-control none", "--clock-control none",
                 "--profile-from-start off", "--metrics gpu__time_duration.sum,dram__bytes_read.sum,"
                 "dram__bytes_write.sum", "--export /tmp/rep --force-overwrite"):
        assert flag in s, flag
    assert s.endswith("_run m.so --warmup 3 --profile")
    every = " ".join(RL.ncu_command("ncu", "/tmp/rep", "m.so", 1, every_launch=True))
    assert "--profile-from-start" not in every and every.endswith("_run m.so --warmup 1 --profile --no-range")


# ---------------- the launch plan from the build's IR ----------------

def _layer(name, in_shape, w_shape, out_shape, op="conv2d", bits=8):
    return {"name": name, "op": op, "in_shape": list(in_shape), "w_shape": list(w_shape),
            "out_shape": list(out_shape), "w_bits": bits, "a_bits": bits}


LAYERS = [
    _layer("conv1", (2, 8, 8, 3), (16, 3, 3, 3), (2, 8, 8, 16)),
    _layer("layer1_0_conv1", (2, 8, 8, 16), (16, 3, 3, 16), (2, 8, 8, 16)),
    _layer("layer1_1_conv1", (2, 8, 8, 16), (16, 3, 3, 16), (2, 8, 8, 16)),   # same shape: merged kernel
    _layer("layer2_0_conv1", (2, 8, 8, 16), (32, 3, 3, 16), (2, 4, 4, 32)),   # a split-K pair
    _layer("fc", (2, 32), (32, 10), (2, 10), op="dense"),
]
OUT_TO_LAYER = {f"{lay['name']}_q": lay["name"] for lay in LAYERS}


def _script(funcs: dict) -> str:
    """A TVMScript-shaped module: ``{name: (kind, [callees])}``."""
    lines = ["@I.ir_module", "class Module:"]
    for name, (kind, callees) in funcs.items():
        lines.append("    @T.prim_func" if kind == "prim" else "    @R.function")
        lines.append(f"    def {name}(x: R.Tensor((2,), dtype=\"int8\")):")
        lines += [f"        lv{i} = R.call_tir(cls.{c}, (x,), out_sinfo=R.Tensor((2,), dtype=\"int8\"))"
                  for i, c in enumerate(callees)]
        lines.append("        return x")
    return "\n".join(lines) + "\n"


PRE = ["qconv_conv1_q", "qconv_layer1_0_conv1_q", "qconv_layer1_1_conv1_q", "qconv_layer2_0_conv1_q",
       "qconv_layer2_0_conv1_q_splitk_epilogue", "qconv_fc_q"]


def _dumps(post_conv=None):
    """(3_dispatched, 5_lowered) texts: the lowered module launches the input quantize and the output dequantize in
    main, the rest in the CUDA graph's capture function; layer1_1's kernel merged into layer1_0's."""
    dispatched = _script({**{c: ("prim", []) for c in PRE}, "main": ("relax", PRE)})
    post_conv = post_conv or ["qconv_conv1_q", "qconv_layer1_0_conv1_q", "qconv_layer1_0_conv1_q",
                              "qconv_layer2_0_conv1_q", "qconv_layer2_0_conv1_q_splitk_epilogue", "qconv_fc_q"]
    graph = [post_conv[0], "qpool_max_0", *post_conv[1:5], "fused_sum", post_conv[5]]
    prims = sorted(set(graph) | {"fused_quantize", "fused_dequantize"})
    lowered = _script({**{p: ("prim", []) for p in prims}, "cuda_graph_alloc": ("relax", []),
                       "main_cuda_graph_capture": ("relax", graph),
                       "main": ("relax", ["fused_quantize", "cuda_graph_alloc", "main_cuda_graph_capture",
                                          "fused_dequantize"])})
    return dispatched, lowered


def test_launch_plan_tells_merged_kernels_apart(RL):
    plan = RL.launch_plan(*_dumps(), OUT_TO_LAYER, LAYERS)
    got = [(lp.kernel, lp.layer) for lp in plan]
    assert got == [("fused_quantize_kernel", None), ("qconv_conv1_q_kernel", "conv1"), ("qpool_max_0_kernel", None),
                   ("qconv_layer1_0_conv1_q_kernel", "layer1_0_conv1"),
                   ("qconv_layer1_0_conv1_q_kernel", "layer1_1_conv1"),
                   ("qconv_layer2_0_conv1_q_kernel", "layer2_0_conv1"),
                   ("qconv_layer2_0_conv1_q_splitk_epilogue_kernel", "layer2_0_conv1"),
                   ("fused_sum_kernel", None), ("qconv_fc_q_kernel", "fc"), ("fused_dequantize_kernel", None)]


def test_launch_plan_merged_split_k_epilogue(RL):
    """A split-K epilogue reads only the int32 partial sums: layers of one output shape share it even where their
    inputs differ (the GEMM kernels stay their own)."""
    layers = [_layer("layer3_0_conv2", (1, 28, 28, 8), (8, 3, 3, 8), (1, 14, 14, 8)),
              _layer("layer3_1_conv2", (1, 14, 14, 8), (8, 3, 3, 8), (1, 14, 14, 8))]
    pre = ["qconv_layer3_0_conv2_q", "qconv_layer3_0_conv2_q_splitk_epilogue", "qconv_layer3_1_conv2_q",
           "qconv_layer3_1_conv2_q_splitk_epilogue"]
    post = pre[:3] + ["qconv_layer3_0_conv2_q_splitk_epilogue"]
    dispatched = _script({**{c: ("prim", []) for c in pre}, "main": ("relax", pre)})
    lowered = _script({**{c: ("prim", []) for c in set(post)}, "main": ("relax", post)})
    plan = RL.launch_plan(dispatched, lowered, {f"{lay['name']}_q": lay["name"] for lay in layers}, layers)
    assert [lp.layer for lp in plan] == ["layer3_0_conv2"] * 2 + ["layer3_1_conv2"] * 2
    # a GEMM kernel is not shared across input shapes
    lowered = _script({**{c: ("prim", []) for c in set(post)}, "main": ("relax", [pre[0], pre[1], pre[0], pre[1]])})
    with pytest.raises(ValueError, match="launch 2: kernel qconv_layer3_0_conv2_q stands for qconv_layer3_1_conv2_q"):
        RL.launch_plan(dispatched, lowered, {f"{lay['name']}_q": lay["name"] for lay in layers}, layers)


def test_launch_plan_errors(RL):
    # a merged name standing for a layer of another shape
    wrong = ["qconv_conv1_q", "qconv_layer1_0_conv1_q", "qconv_layer2_0_conv1_q", "qconv_layer2_0_conv1_q",
             "qconv_layer2_0_conv1_q_splitk_epilogue", "qconv_fc_q"]
    with pytest.raises(ValueError, match="stands for qconv_layer1_1_conv1_q but their layers differ"):
        RL.launch_plan(*_dumps(wrong), OUT_TO_LAYER, LAYERS)
    d, lo = _dumps()
    with pytest.raises(ValueError, match="launches 6 tensor-core kernels, the dispatcher emitted 5"):
        RL.launch_plan(d.replace("cls.qconv_fc_q,", "cls.other,"), lo, OUT_TO_LAYER, LAYERS)
    with pytest.raises(ValueError, match="no conv/dense layer has the output 'fc_q'"):
        RL.launch_plan(d, lo, {k: v for k, v in OUT_TO_LAYER.items() if k != "fc_q"}, LAYERS)
    with pytest.raises(ValueError, match="layers without a kernel launch: extra"):
        RL.launch_plan(d, lo, OUT_TO_LAYER, LAYERS + [_layer("extra", (1, 1, 1, 1), (1, 1, 1, 1), (1, 1, 1, 1))])


# ---------------- the tables ----------------

def _doc(RL, kernels_ns=None):
    """A collected file for the launch plan above, with made-up kernel times and bytes (round numbers)."""
    from dataclasses import asdict

    plan = RL.launch_plan(*_dumps(), OUT_TO_LAYER, LAYERS)
    times = kernels_ns or [1000.0 * (i + 1) for i in range(len(plan))]
    kernels = [{"id": i, "name": lp.kernel, "grid": f"{i + 1}x1x1", "block": "128x1x1", "time_ns": t,
                "dram_read": 3e6 * (i + 1), "dram_write": 1e6} for i, (lp, t) in enumerate(zip(plan, times))]
    entry = {"tag": "tiny_8", "net": "resnet50", "bits": "8", "batch": 2, "forward_ms": 0.05,
             "build_command": "qcompile tiny.onnx --target cuda", "layers": LAYERS,
             "launches": [asdict(lp) for lp in plan], "kernels": kernels}
    return {"format": RL.FORMAT, "date": "2026-11-26", "ncu": "2025.3.1.0", "device": "NVIDIA H100 80GB HBM3",
            "command": "python3 scripts/roofline.py collect --model resnet50", "commit": "abc1234",
            "entries": [entry]}


def test_layer_ops(RL):
    # conv: 2 x N x P x Q x K x C x R x S; dense: 2 x N x C x K
    assert RL.layer_ops(LAYERS[3]) == 2 * 2 * 4 * 4 * 32 * 16 * 3 * 3
    assert RL.layer_ops(LAYERS[4]) == 2 * 2 * 32 * 10
    r50_stem = _layer("conv1", (256, 224, 224, 3), (64, 7, 7, 3), (256, 112, 112, 64))
    assert RL.layer_ops(r50_stem) == 2 * 256 * 112 * 112 * 64 * 3 * 7 * 7


def test_join_stages_and_ops(RL):
    rows = RL.join(_doc(RL)["entries"][0])
    assert [(r.layer, r.stage) for r in rows] == [
        (None, "stem"), ("conv1", "stem"), (None, "stem"), ("layer1_0_conv1", "layer1"), ("layer1_1_conv1", "layer1"),
        ("layer2_0_conv1", "layer2"), ("layer2_0_conv1", "layer2"), (None, "head"), ("fc", "head"), (None, "head")]
    ops = {lay["name"]: RL.layer_ops(lay) for lay in LAYERS}
    assert [r.ops for r in rows] == [0, ops["conv1"], 0, ops["layer1_0_conv1"], ops["layer1_1_conv1"],
                                     ops["layer2_0_conv1"], 0, 0, ops["fc"], 0]  # (split-K: the GEMM has them)
    assert rows[4].dram_bytes == 3e6 * 5 + 1e6 and rows[4].time_ns == 5000.0


def test_sums_and_bound(RL):
    rows = RL.join(_doc(RL)["entries"][0])
    peak_tops, peak_gbs = 1000.0, 2000.0
    s = {x.name: x for x in RL.sums(rows, peak_tops, peak_gbs)}
    assert list(s) == ["stem", "layer1", "layer2", "head", "network"]
    assert s["network"].n == 10 and s["network"].time_ns == sum(1000.0 * i for i in range(1, 11))
    assert s["network"].ops == sum(RL.layer_ops(lay) for lay in LAYERS)
    assert s["layer2"].n == 2 and s["layer2"].time_ns == 6000 + 7000 and s["layer2"].dram_bytes == 18e6 + 21e6 + 2e6
    # each kernel at its own bound: max(ops / peak, bytes / bandwidth), summed
    want = sum(max(r.ops / (peak_tops * 1e3), r.dram_bytes / peak_gbs) for r in rows)
    assert s["network"].bound_ns == pytest.approx(want)
    # (these tiny kernels are memory-bound: bytes / bandwidth of the first, 4e6 B / 2000 GB/s = 2000 ns)
    assert rows[0].bound_ns(peak_tops, peak_gbs) == pytest.approx(2000.0)


def test_table_text(RL):
    doc = _doc(RL)
    text = RL.tables([(doc, "docs/bench/roofline_x.json")], 1000.0, 2500.0)
    assert "\nNVIDIA H100 80GB HBM3, 2026-11-26, code at `abc1234`, Nsight Compute 2025.3.1.0." in text
    assert "`docs/bench/roofline_x.json`" in text and "`qcompile tiny.onnx --target cuda`" in text
    assert "**ResNet-50 INT8, batch 2**: forward pass 0.050 ms (40,000 img/s" in text
    assert "its 10 kernels 0.055 ms under ncu" in text
    # the network row: 55 us, bytes 3e6 x 55 + 10e6 -> 175 MB, 3182 GB/s; at the bound 70 us (bytes / 2500 GB/s)
    net = next(ln for ln in text.splitlines() if ln.startswith("| **network**"))
    assert net.startswith("| **network** | 10 | 0.055 | 100.0% | ") and "| 175.0 | " in net and "| 3,182 |" in net
    assert net.endswith("| 0.070 ms | 127% |")
    # every kernel a row, the merged kernel under each of its layers
    kern = [ln for ln in text.splitlines() if re.match(r"\| \d+ \| `", ln)]
    assert len(kern) == 10
    assert kern[4].startswith("| 4 | `qconv_layer1_0_conv1_q` | layer1_1_conv1 | layer1 | 5x1x1 | 5.0 |")
    assert kern[0].endswith("| 160% (memory) |")  # 4 MB in 1 us = 4000 GB/s against 2500
    with pytest.raises(ValueError, match="x.json: not a roofline results file"):
        RL.tables([({**doc, "format": "other"}, "x.json")])


def test_join_checks_the_profile_against_the_plan(RL):
    e = _doc(RL)["entries"][0]
    e["kernels"][3]["name"] = "qconv_layer2_0_conv1_q_kernel"
    with pytest.raises(ValueError, match="kernel 3 is qconv_layer2_0_conv1_q_kernel, the build's launch 3 is "
                                         "qconv_layer1_0_conv1_q_kernel"):
        RL.join(e)
    e = _doc(RL)["entries"][0]
    e["kernels"].pop()
    with pytest.raises(ValueError, match="ncu profiled 9 kernels, the build launches 10"):
        RL.join(e)


def test_benchmarks_has_the_section(RL):
    """docs/BENCHMARKS.md holds the section with one pair of markers; where a results file is committed the block
    is what ``table`` writes from it."""
    text = open(os.path.join(ROOT, "docs", "BENCHMARKS.md")).read()
    assert "## Where the time goes: ResNet-50 against the roofline" in text
    assert text.count("<!-- table:roofline -->") == 1 and text.count("<!-- /table:roofline -->") == 1
    block = text.split("<!-- table:roofline -->\n")[1].split("<!-- /table:roofline -->")[0]
    paths = re.findall(r"Results: `(docs/bench/roofline[\w.-]*\.json)`", block)
    if paths:
        docs = [(json.load(open(os.path.join(ROOT, p))), p) for p in paths]
        assert block == RL.tables(docs), "BENCHMARKS.md: the roofline table is stale"


# ---------------- a real cuda build ----------------

@pytest.mark.nvcc
@pytest.mark.parametrize("bits", [8, 4])
def test_tiny_cuda_build_maps_every_kernel(RL, tmp_path, bits):
    """A tiny ResNet built for sm_90 as ``collect`` builds it: every kernel of its CUDA source is launched, every
    tensor-core launch computes a layer, every layer has its launch, and a profile of the plan joins with it."""
    import torch

    from qcompile.models.export_onnx import export_onnx
    from qcompile.models.quantize import quantize_model
    from qcompile.models.resnet import build_model

    qm = quantize_model(build_model("resnet_tiny"), torch.randn(8, 3, 16, 16), bits=bits)
    onnx = str(tmp_path / "t.onnx")
    export_onnx(qm, onnx, (2, 3, 16, 16), batch=2)
    info, res = RL.build(onnx, 2, "sm_90", str(tmp_path / "t.so"), log=lambda s: None)
    assert os.path.getsize(tmp_path / "t.so") > 0
    launched = [lp["kernel"] for lp in info["launches"]]
    source = RL.cuda_kernel_names(res)
    assert source and set(source) == set(launched), (source, launched)
    names = [lay["name"] for lay in info["layers"]]
    for lp in info["launches"]:
        assert (lp["layer"] in names) == lp["kernel"].startswith("qconv_"), lp
    assert {lp["layer"] for lp in info["launches"]} - {None} == set(names)
    assert all(lay["ops"] == RL.layer_ops(lay) > 0 for lay in info["layers"])
    entry = {**info, "tag": "t", "net": "resnet_tiny", "bits": str(bits), "batch": 2, "forward_ms": 0.1,
             "kernels": [{"id": i, "name": k, "grid": "1x1x1", "block": "1x1x1", "time_ns": 1000.0,
                          "dram_read": 1e5, "dram_write": 1e5} for i, k in enumerate(launched)]}
    rows = RL.join(entry)
    assert rows[0].stage == "stem" and rows[-1].stage == "head"
    assert {r.stage for r in rows} == {"stem", "layer1", "layer2", "layer3", "head"}
    assert sum(r.ops for r in rows) == sum(lay["ops"] for lay in info["layers"])


def test_table_command_writes_the_block(RL, tmp_path):
    """``table FILE --write MD`` replaces what lies between the markers and nothing else."""
    res = tmp_path / "roofline.json"
    res.write_text(json.dumps(_doc(RL)))
    md = tmp_path / "B.md"
    md.write_text("# B\n\nintro\n\n<!-- table:roofline -->\nold\n<!-- /table:roofline -->\n\ntail\n")
    RL.main(["table", str(res), "--write", str(md)])
    text = md.read_text()
    block = RL.tables([(json.loads(res.read_text()), str(res))])
    assert text == f"# B\n\nintro\n\n<!-- table:roofline -->\n{block}<!-- /table:roofline -->\n\ntail\n"


@pytest.mark.parametrize("range_works", [True, False])
def test_collect_plumbing(RL, tmp_path, monkeypatch, range_works):
    """``collect`` with the build, ncu and the GPU driver stood in for: one JSON for every model (device, ncu
    version, command, each entry's build record, plain time and profiled kernels); where the cuProfilerStart/Stop
    range yields nothing, every launch of two passes is profiled and the last pass kept; ``--reuse`` takes the build
    record instead of building."""
    from dataclasses import asdict

    plan = [asdict(lp) for lp in RL.launch_plan(*_dumps(), OUT_TO_LAYER, LAYERS)]
    builds, ran = [], []

    def fake_build(model, batch, arch, so, tuning_logs=(), gpu=None, log=print):
        builds.append((model, batch, arch, tuple(tuning_logs)))
        open(so, "wb").write(b"\x7fELF")
        return {"so": so, "build_s": 1.0, "build_command": f"qcompile {model}", "meta": {"bits": "8"},
                "layers": LAYERS, "launches": plan}, None

    def fake_sh(cmd, log, echo=False, **kw):
        ran.append(cmd)
        if cmd[:2] == ["ncu", "--version"]:
            return "NVIDIA (R) Nsight Compute Command Line Profiler\nVersion 2025.3.1.0 (build 1)\n"
        if "--import" in cmd:
            every = any("--no-range" in c for c in ran)
            if not range_works and not every:
                return "==PROF== No kernels were profiled.\n"
            head = RAW.splitlines()[2]
            rows = [head, '"","","","","","","","","","","","byte","byte","nsecond"']
            passes = [0, 1] if every else [1]
            rows += [f'"{p * len(plan) + i}","1","p","h","{lp["kernel"]}","1","7","(1, 1, 1)","(2, 1, 1)","0",'
                     f'"9.0","1,000","0","{1000 * (i + 1) + 7 * p}"' for p in passes for i, lp in enumerate(plan)]
            return "\n".join(rows) + "\n"
        if "--time" in cmd:
            return '{"forward_ms": 0.04, "device": "NVIDIA H100 80GB HBM3", "seed": 5}\n'
        return ""

    monkeypatch.setattr(RL, "build", fake_build)
    monkeypatch.setattr(RL, "_sh", fake_sh)
    model = tmp_path / "m8.onnx"
    model.write_bytes(b"onnx")
    argv = ["collect", "--model", str(model), "--batch", "2", "--tuning-log", "t.jsonl", "--build-dir",
            str(tmp_path / "b"), "--out", str(tmp_path / "out")]
    RL.main(argv)
    doc = json.loads((tmp_path / "out" / "roofline.json").read_text())
    assert doc["device"] == "NVIDIA H100 80GB HBM3" and doc["ncu"] == "2025.3.1.0 (build 1)"
    assert doc["command"] == "python3 scripts/roofline.py " + " ".join(argv)
    (e,) = doc["entries"]
    assert builds == [(str(model), 2, "sm_90", ("t.jsonl",))] and e["forward_ms"] == 0.04 and e["bits"] == "8"
    assert [k["name"] for k in e["kernels"]] == [lp["kernel"] for lp in plan]
    assert [k["time_ns"] for k in e["kernels"]] == [1000.0 * (i + 1) + 7 for i in range(len(plan))]  # (the last pass)
    prof = [c for c in ran if "--graph-profiling" in c]
    assert prof[0][-5:] == ["_run", str(tmp_path / "b" / "m8_b2.so"), "--warmup", "3", "--profile"]
    assert len(prof) == (1 if range_works else 2)
    assert "| **network** | 10 |" in (tmp_path / "out" / "roofline_log.txt").read_text()
    RL.main(argv + ["--reuse"])
    assert len(builds) == 1
