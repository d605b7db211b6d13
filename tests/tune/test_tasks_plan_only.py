"""Plan-only task extraction (``tune.tasks``, ``schedules.plan_only``): the tasks the dispatcher's plans give without
building any kernel's TIR are the tasks of the build that does, field by field, for every strategy; the builders keep
their legality checks, and outside ``plan_only`` they build as always."""
from __future__ import annotations

import dataclasses
import os
import random
import warnings

import pytest
from fakes import fresh_logs  # noqa: F401  (the fixture)

from qcompile.schedules import plan_conv, plan_only, select_strategy
from qcompile.schedules import tuning as TU
from qcompile.schedules.planned import PLACEHOLDER_ATTR
from qcompile.schedules.spec import ConvSpec, GemmKnobs
from qcompile.tune import tasks as TK

pytestmark = pytest.mark.usefixtures("fresh_logs")  # (no packaged logs, a fresh log cache: fakes.fresh_logs)

ARCH = "sm_90"
PACKAGED_LOG = os.path.join(os.path.dirname(__file__), "..", "..", "tuning_logs", "sm_90.jsonl")
PACKAGED_GPU = "NVIDIA H100 80GB HBM3"  # (the GPU of the packaged log's records)
SYNTH_GPU = "GPU T"


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    """``model_file(name, bits)``: a qmodel ONNX export, made once per module."""
    from qcompile.models.cli import main as qmodel_main

    d, made = tmp_path_factory.mktemp("plan_only"), {}

    def make(name: str, bits: str = "8") -> str:
        if (name, bits) not in made:
            path = str(d / f"{name}_{bits}.onnx")
            assert qmodel_main([name, "--bits", bits, "-q", "-o", path]) == 0
            made[name, bits] = path
        return made[name, bits]

    return make


def _fields(task) -> dict:
    return {f.name: getattr(task, f.name) for f in dataclasses.fields(task)}


def _assert_same_tasks(built: list, planned: list) -> None:
    """The same tasks in the same order, every field equal (a differing field named)."""
    assert [t.label for t in planned] == [t.label for t in built]
    for b, p in zip(built, planned):
        fb, fp = _fields(b), _fields(p)
        for name in fb:
            assert fp[name] == fb[name], f"{b.label}: {name} {fp[name]!r} (plan-only) != {fb[name]!r} (built)"


def _synthetic_log(path, tasks: list) -> None:
    """A log with one record per task on ``SYNTH_GPU``: a random legal point of the task's kernel space (seeded by
    its key), so that the dispatch plans every layer from a record's knobs (source "device")."""
    from qcompile.schedules.space import SPACES

    lines = []
    for t in tasks:
        kn = SPACES[t.strategy].sample(random.Random(t.key), t.spec, ARCH)
        if kn is not None:
            lines.append(TU.format_record(TU.make_record(ARCH, SYNTH_GPU, 132, t.key, t.strategy, kn, ms=0.01)))
    path.write_text("".join(line + "\n" for line in lines))


def _extract(model: str, layout: str, logs, gpu, build: bool) -> list:
    TU.clear_cache()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return TK.extract_tasks(model, ARCH, (1, 8), layout, tuning_logs=logs, gpu=gpu, log=lambda *a, **k: None,
                                build=build)


# (model, --bits, layout, logs): NHWC and HWNC, every grouped kernel the tiny models reach, lookup-table epilogues
# (mobilenet_v3_tiny, efficientnet_tiny), the stem's space-to-depth; no log, the packaged log with its GPU named,
# a log of random legal knobs for every task ("synthetic")
CASES = [
    ("resnet_tiny", "8", "NHWC", None),
    ("resnet_tiny", "8", "HWNC", "packaged"),
    ("resnet_tiny", "4", "NHWC", "synthetic"),
    ("resnet_tiny", "mixed", "NHWC", "packaged"),
    ("resnet_tiny", "mixed", "HWNC", "synthetic"),
    ("resnext_tiny", "8", "NHWC", "synthetic"),
    ("mobilenet_v3_tiny", "8", "NHWC", None),
    ("mobilenet_v2_tiny", "8", "HWNC", "packaged"),
    ("densenet_tiny", "8", "NHWC", "packaged"),
    ("efficientnet_tiny", "8", "NHWC", "synthetic"),
]


@pytest.mark.parametrize("name,bits,layout,logs", CASES, ids=["-".join(str(v) for v in c) for c in CASES])
def test_plan_only_tasks_equal_the_built_ones(model_file, tmp_path, monkeypatch, name, bits, layout, logs):
    """Batches 1 and 8: ``extract_tasks`` plan-only (the default) gives the tasks of ``build=True`` field by field,
    and its dispatch built no kernel (every planned layer's funcs are placeholders)."""
    model = model_file(name, bits)
    tuning_logs, gpu = (), None
    if logs == "packaged":
        tuning_logs, gpu = (PACKAGED_LOG,), PACKAGED_GPU
    elif logs == "synthetic":
        log = tmp_path / "synthetic.jsonl"
        _synthetic_log(log, _extract(model, layout, (), None, build=False))
        tuning_logs, gpu = (str(log),), SYNTH_GPU
    built = _extract(model, layout, tuning_logs, gpu, build=True)
    seen: list = []
    real = TK.tasks_from_planned
    monkeypatch.setattr(TK, "tasks_from_planned", lambda planned, arch: seen.extend(planned) or real(planned, arch))
    planned = _extract(model, layout, tuning_logs, gpu, build=False)
    assert built and seen
    _assert_same_tasks(built, planned)
    assert all(PLACEHOLDER_ATTR in f.attrs for _, pk in seen for f in pk.funcs)
    if logs == "synthetic":  # (the records served the layers)
        assert {t.source for t in planned} == {"device"}


def _plans(make) -> tuple:
    """(built, plan-only) of ``make()`` (a planner returning a PlannedKernel)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        built = make()
        with plan_only():
            planned = make()
    return built, planned


def _check_plans(built, planned, nfuncs: int = 1) -> None:
    """Every field but the funcs equal; the built funcs real kernels, the plan-only ones placeholders."""
    assert planned.replace(funcs=()) == built.replace(funcs=())
    assert len(planned.funcs) == len(built.funcs) == nfuncs
    assert all(PLACEHOLDER_ATTR not in (f.attrs or {}) and len(f.params) > 0 for f in built.funcs)
    assert all(PLACEHOLDER_ATTR in f.attrs and len(f.params) == 0 for f in planned.funcs)
    assert [f.attrs["qcompile.knobs_source"] for f in planned.funcs[:1]] == \
        [f.attrs["qcompile.knobs_source"] for f in built.funcs[:1]]


S8 = dict(x_dtype="int8", w_bits=8, out_dtype="int8")
STRATEGY_SPECS = {
    # the ResNet-50 stem after space-to-depth (batch 8): the halo kernel
    "direct_halo": (ConvSpec(N=8, H=112, W=112, C=16, K=64, R=4, S=4, padding=(2, 2, 1, 1), **S8), None, 1),
    # a ResNet-50 1x1 conv of stage 3 at batch 8: output channels as M
    "implicit_gemm_t": (ConvSpec(N=8, H=14, W=14, C=1024, K=512, R=1, S=1, x_dtype="int8", w_bits=8,
                                 out_dtype="uint8", lo=0, hi=255), None, 1),
    "implicit_gemm": (ConvSpec(N=64, H=28, W=28, C=128, K=128, R=3, S=3, padding=1, **S8), None, 1),
    # 4-bit, a residual and a lookup table, weights kept packed
    "implicit_gemm-w4-res-lut": (ConvSpec(N=8, H=14, W=14, C=64, K=64, R=1, S=1, x_dtype="uint4", w_bits=4,
                                          out_dtype="int8", has_residual=True, res_dtype="int8", lut=256,
                                          lut_min=-128), None, 1),
    # a split-K pair (the knobs' split)
    "implicit_gemm-splitk": (ConvSpec(N=1, H=7, W=7, C=512, K=512, R=3, S=3, padding=1, **S8),
                             GemmKnobs(BM=64, BN=64, BK=64, stages=3, split_k=4), 2),
    "direct_hwnc": (ConvSpec(N=32, H=14, W=14, C=64, K=64, R=3, S=3, padding=1, layout="HWNC", **S8), None, 1),
    # HWNC at batch 1: no tensor-core kernel takes it (direct HWNC tiles the batch by 8)
    "fallback": (ConvSpec(N=1, H=8, W=8, C=64, K=64, R=3, S=3, padding=1, layout="HWNC", **S8), None, 1),
}


@pytest.mark.parametrize("case", list(STRATEGY_SPECS))
def test_plan_conv_plan_only_keeps_every_field(case):
    """``plan_conv`` under ``plan_only``: the PlannedKernel of the build (strategy, knobs, source, split, stream-K,
    weight form) with placeholder funcs, per strategy (``nfuncs`` 2: the case must plan a split-K pair)."""
    spec, knobs, nfuncs = STRATEGY_SPECS[case]
    strategy = case.split("-")[0]
    assert select_strategy(spec, ARCH) == strategy or knobs is not None
    built, planned = _plans(lambda: plan_conv(spec, ARCH, strategy, knobs, packed_weights=True))
    assert built.strategy == strategy and (built.split_k > 1 or nfuncs == 1)
    _check_plans(built, planned, 2 if built.split_k > 1 else 1)


def test_grouped_planners_plan_only():
    """``plan_grouped`` (depthwise, grouped) and ``plan_grouped_gemm``: the same plans, placeholder funcs."""
    from qcompile.schedules.grouped import plan_grouped
    from qcompile.schedules.grouped_gemm import gemm_spec, grouped_gemm_constraints, plan_grouped_gemm

    dw = ConvSpec(N=8, H=28, W=28, C=64, K=64, R=3, S=3, padding=1, groups=64, **S8)
    gr = ConvSpec(N=8, H=14, W=14, C=256, K=256, R=3, S=3, padding=1, groups=8, **S8)
    for spec, kind in ((dw, "depthwise"), (gr, "grouped")):
        built, planned = _plans(lambda: plan_grouped(spec, spec.groups, ARCH))
        assert built.strategy == kind
        _check_plans(built, planned)
    g = gemm_spec(gr)
    assert grouped_gemm_constraints(g, ARCH) is None
    built, planned = _plans(lambda: plan_grouped_gemm(g, ARCH))
    _check_plans(built, planned)


def test_plan_only_keeps_the_builders_checks():
    """Knobs a builder refuses are refused under ``plan_only`` too (the same error), and the switch is off outside
    the block."""
    from qcompile.schedules.planned import planning_only
    from qcompile.schedules.stem import HaloKnobs, halo_legal, make_halo_conv

    spec = STRATEGY_SPECS["direct_halo"][0]
    bad = HaloKnobs(th=10_000)
    why = halo_legal(spec, ARCH, bad)
    assert why
    with plan_only():
        assert planning_only()
        with pytest.raises(ValueError, match="."):
            make_halo_conv(spec, ARCH, bad)
    assert not planning_only()


def test_a_build_refuses_placeholder_kernels():
    """A module planned under ``plan_only()`` holds placeholder kernels: the pipeline's backend refuses it (naming
    the kernel) instead of compiling empty functions; a module of real kernels passes the check unchanged."""
    import tvm

    from qcompile.pipeline import _no_placeholders
    from qcompile.schedules.planned import placeholder_kernel

    mod = tvm.IRModule({"qconv_x": placeholder_kernel("gemm")})
    with pytest.raises(RuntimeError, match="qconv_x is a placeholder"):
        _no_placeholders()(mod)
    real = tvm.IRModule({"f": tvm.tirx.PrimFunc([], tvm.tirx.Evaluate(0))})
    assert _no_placeholders()(real).same_as(real) or tvm.ir.structural_equal(_no_placeholders()(real), real)


@pytest.mark.slow
def test_plan_only_tasks_equal_the_built_ones_resnet18(tmp_path):
    """ResNet-18 (at 64 x 64, its full channels) reaches a kernel the tiny models do not: the halo stem
    (``direct_halo``), beside the implicit GEMM's automatic split-K at batch 1. With the packaged log and its GPU
    named, plan-only tasks equal the built ones field by field."""
    from qcompile.models.cli import main as qmodel_main

    model = str(tmp_path / "r18.onnx")
    assert qmodel_main(["resnet18", "--bits", "8", "--input-size", "64", "-q", "-o", model]) == 0

    def extract(build: bool) -> list:
        TU.clear_cache()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return TK.extract_tasks(model, ARCH, (1,), "NHWC", tuning_logs=(PACKAGED_LOG,), gpu=PACKAGED_GPU,
                                    log=lambda *a, **k: None, build=build)

    planned = extract(False)
    _assert_same_tasks(extract(True), planned)
    assert {"direct_halo", "implicit_gemm"} <= {t.strategy for t in planned}
