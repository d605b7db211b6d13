"""Task extraction (qcompile.tune.tasks): the distinct kernels of a model, keyed exactly as qcompile looks records
up, weighted by layers, with a roofline time share. Runs the pipeline up to the dispatch (no nvcc, no GPU)."""
from __future__ import annotations

import pytest
from fakes import fresh_logs  # noqa: F401  (the fixture)

from qcompile.schedules import tuning as TU
from qcompile.schedules.spec import ConvSpec
from qcompile.tune.tasks import estimate_ms, set_shares, tasks_from_module

pytestmark = pytest.mark.usefixtures("fresh_logs")  # (no packaged logs, a fresh log cache: fakes.fresh_logs)


def test_tasks_of_a_small_model_are_the_keys_qcompile_looks_up(tmp_path):
    """tiny_resnet_qdq (stem, a basic block with its residual add, fc) for sm_90 NHWC: one task per conv/dense, the
    residual conv keyed ``|res``, shares summing to 1; a log holding a record for each task's key, read back by the
    same extraction with that GPU named, serves every layer from the GPU's own records ("device")."""
    import warnings

    from qdq_models import tiny_resnet_qdq

    mod, _ = tiny_resnet_qdq(seed=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TU.TuningLogWarning)
        tasks = tasks_from_module(mod, "sm_90", "NHWC")
    assert [t.layers for t in tasks] == [["stem"], ["c1"], ["c2"], ["fc"]]
    assert [t.key.endswith("|res") for t in tasks] == [False, False, True, False]
    assert all(t.key == TU.tuning_key(t.spec) and t.strategy in TU.RECORD_STRATEGIES for t in tasks)
    assert abs(sum(t.share for t in tasks) - 1) < 1e-9 and all(t.source == "default" for t in tasks)
    assert tasks[3].gemm == (2, 5, 8) and tasks[3].ops == 2 * 2 * 5 * 8
    log = tmp_path / "t.jsonl"
    log.write_text("".join(TU.format_record(TU.make_record("sm_90", "GPU T", 132, t.key, t.strategy, t.planned_knobs,
                                                           ms=0.01)) + "\n" for t in tasks))
    again = tasks_from_module(tiny_resnet_qdq(seed=2)[0], "sm_90", "NHWC", [str(log)], "GPU T")
    assert [t.source for t in again] == ["device"] * 4


def test_shares_use_measured_defaults_once_known():
    a = ConvSpec(N=64, H=56, W=56, C=64, K=64, R=3, S=3, padding=1)
    b = a.replace(H=7, W=7, C=512, K=512)
    from qcompile.tune.tasks import Task

    ta = Task("a", a, "implicit_gemm", "sm_90", ["x", "y"], est_ms=estimate_ms(a, "sm_90"))
    tb = Task("b", b, "implicit_gemm", "sm_90", ["z"], est_ms=estimate_ms(b, "sm_90"))
    set_shares([ta, tb], measured=False)
    assert ta.share > tb.share and abs(ta.share + tb.share - 1) < 1e-12
    ta.default_ms, tb.default_ms = 0.01, 0.06  # (measured: b is the slow one after all)
    set_shares([ta, tb])
    assert ta.share == pytest.approx(0.02 / 0.08) and tb.share == pytest.approx(0.06 / 0.08)
    # roofline: more work, more time; 4-bit no slower than 8-bit; every arch has its peaks
    assert estimate_ms(a.replace(N=128), "sm_90") > estimate_ms(a, "sm_90")
    for arch in ("sm_75", "sm_80", "sm_86", "sm_89", "sm_90"):
        assert estimate_ms(a.replace(x_dtype="uint4", w_bits=4), arch) <= estimate_ms(a, arch)


def test_several_models_share_a_task_and_weigh_the_same():
    """merge_models: a task of the same key and strategy in two models is one task (the first model's, the other's
    in ``others``); set_shares gives each model's own share (``model_share``, as that model alone would get) and as
    ``share`` the mean over the models of the batch size, so the shares of a batch size still sum to 1."""
    import copy

    from fakes import make_task

    from qcompile.tune.tasks import members, merge_models

    a = [make_task(N=8, H=28, C=128, K=128, layers=("a2", "a2b")), make_task(N=8, H=14, C=256, K=256, layers=("a3",))]
    b = [make_task(N=8, H=28, C=128, K=128, layers=("b2",)), make_task(N=8, H=7, C=512, K=512, layers=("b4",))]
    alone = [copy.deepcopy(a), copy.deepcopy(b)]
    for ts in alone:
        set_shares(ts, measured=False)
    tasks = merge_models([a, b], ["A.onnx", "B.onnx"])
    assert [t.layers for t in tasks] == [["a2", "a2b"], ["a3"], ["b4"]]
    assert tasks[0].extra["others"] == [b[0]] and members(tasks[1]) == [a[1]]
    assert [t.extra["model"] for t in tasks] == ["A.onnx", "A.onnx", "B.onnx"]
    tasks[0].default_ms = 0.5
    set_shares(tasks, measured=False)
    assert b[0].default_ms == 0.5  # (the shared kernel's measured time is every model's)
    for got, ref in ((a[0], alone[0][0]), (a[1], alone[0][1]), (b[0], alone[1][0]), (b[1], alone[1][1])):
        assert got.extra["model_share"] == pytest.approx(ref.share)
    assert tasks[0].share == pytest.approx((alone[0][0].share + alone[1][0].share) / 2)
    assert tasks[1].share == pytest.approx(alone[0][1].share / 2) and sum(t.share for t in tasks) == pytest.approx(1)
    one = copy.deepcopy(alone[0])
    set_shares(one, measured=False)
    assert [t.share for t in one] == [t.share for t in alone[0]]  # (one model: the same again; fixed numbers:
    # test_shares_use_measured_defaults_once_known)
