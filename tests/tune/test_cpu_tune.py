"""``qtune --target llvm``: the CPU kernels of a model tuned on this machine's CPU, end to end (task extraction from the
llvm build, candidates built for the host's target, measured bit-exact then timed by the local runner on the CPU,
records keyed by the CPU kernel and the CPU model), then used by ``qcompile --target llvm --tuning-log``; resume; the
option errors."""
from __future__ import annotations

import json

import numpy as np
import pytest

from qcompile.schedules import cpu_conv
from qcompile.schedules import tuning as TU
from qcompile.tune import cli


def _host_kernel():
    from qcompile.tune.tasks import cpu_arch

    return cpu_arch()


pytestmark = pytest.mark.skipif(not cpu_conv.host_has_avx2(), reason="no x86-64 AVX2 CPU: the CPU kernels do not run")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from qcompile.models.cli import main as qmodel_main

    d = tmp_path_factory.mktemp("cpu_tune")
    assert qmodel_main(["resnet_tiny", "--input-size", "16", "-q", "-o", str(d / "tiny.onnx")]) == 0
    return d / "tiny.onnx"


@pytest.fixture
def no_default_logs(monkeypatch, tmp_path):
    monkeypatch.setenv("QCOMPILE_TUNING_DIR", str(tmp_path / "no_default_logs"))
    TU.clear_cache()
    yield
    TU.clear_cache()


def _summary(out: str) -> dict:
    """layer -> (kernel, knobs) from qcompile's summary table."""
    lines = out[out.index("layer  "):].splitlines()
    rows = {}
    for ln in lines[2:]:
        parts = ln.split()
        if len(parts) < 9 or parts[1] not in ("conv2d", "dense"):
            break
        rows[parts[0]] = (parts[8], parts[9] if len(parts) > 9 else "")
    return rows


def test_qtune_llvm_end_to_end_and_resume(tiny, tmp_path, capsys, no_default_logs):
    from qcompile.cli import qcompile_main
    from qcompile.runtime import Module

    kernel = _host_kernel()
    log = tmp_path / "cpu.jsonl"
    args = [str(tiny), "--target", "llvm", "-o", str(log), "--jobs", "1", "--per-round", "3", "--search", "random",
            "--repeat", "2", "--min-repeat-ms", "1"]
    assert cli.qtune_main(args + ["--trials", "6"]) == 0
    out = capsys.readouterr().out
    assert f"for {kernel} (NHWC, batch 1)" in out and "10 tasks, 10 layers" in out, out
    recs = [json.loads(ln) for ln in log.read_text().splitlines()]
    assert len(recs) == 6
    assert {(r["arch"], r["device"], r["strategy"], r["status"]) for r in recs} == {
        (kernel, cpu_conv.cpu_model_name(), "cpu_direct", "ok")}
    assert all(r["ms"] > 0 and r["variant"] == "default" for r in recs)

    # qcompile with the log: the layers whose keys the log holds take them ("device"), the others the automatic tile
    so, so0 = tmp_path / "tuned.so", tmp_path / "auto.so"
    assert qcompile_main([str(tiny), "--target", "llvm", "--tuning-log", str(log), "-o", str(so)]) == 0
    tuned = _summary(capsys.readouterr().out)
    assert qcompile_main([str(tiny), "--target", "llvm", "-o", str(so0)]) == 0
    auto = _summary(capsys.readouterr().out)
    assert {k for k, _ in tuned.values()} == {kernel}
    assert sorted(v for _, v in tuned.values()) == ["default"] * 4 + ["device"] * 6, tuned
    assert {v for _, v in auto.values()} == {"default"}
    # the key of each record is one the llvm build looks up: the tasks' layers are the "device" ones
    from qcompile.tune.tasks import extract_tasks

    tasks = extract_tasks(str(tiny), kernel, (1,), target="llvm", log=lambda s: None)
    by_key = {t.key: t.layers for t in tasks}
    assert {r["key"] for r in recs} <= set(by_key)
    assert {layer for r in recs for layer in by_key[r["key"]]} == {n for n, (_, v) in tuned.items() if v == "device"}
    # the tuned build computes what the automatic one does, bit for bit
    x = np.random.default_rng(0).standard_normal((1, 3, 16, 16)).astype(np.float32)
    assert np.array_equal(Module(str(so))(x), Module(str(so0))(x))

    # resume: the 6 records are measurements already made; 4 more, none measured twice
    assert cli.qtune_main(args + ["--trials", "4"]) == 0
    out = capsys.readouterr().out
    assert "6 measurements resumed" in out, out
    recs = [json.loads(ln) for ln in log.read_text().splitlines()]
    keys = [(r["key"], json.dumps(r["knobs"], sort_keys=True)) for r in recs]
    assert len(recs) == 10 and len(set(keys)) == 10


@pytest.mark.parametrize("extra,frag", [
    (["--arch", "sm_90"], "with --target llvm, --arch names the CPU kernel"),
    (["--layout", "HWNC"], "--target llvm tunes the CPU kernels of NHWC builds"),
    (["--runner", "offline", "--export", "{tmp}/x"], "--runner local only"),
])
def test_llvm_option_errors(tiny, tmp_path, capsys, extra, frag):
    rc = cli.qtune_main([str(tiny), "--target", "llvm", "-o", str(tmp_path / "t.jsonl")]
                        + [a.format(tmp=tmp_path) for a in extra])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("qtune: error: ") and frag in err[0], err
    assert not (tmp_path / "t.jsonl").exists()


def test_llvm_host_kernel_is_accepted_as_arch(tiny, tmp_path, capsys, monkeypatch):
    """``--arch`` naming the host's CPU kernel passes the option checks (the run itself stood in for)."""
    seen = {}

    def checked(a, log, factories):
        cli._check_args(a)
        seen["a"] = a
        return 0

    monkeypatch.setattr(cli, "_run", checked)
    assert cli.qtune_main([str(tiny), "--target", "llvm", "--arch", _host_kernel(), "-o", str(tmp_path / "t.jsonl")]) == 0
    assert seen["a"].arch == _host_kernel() and seen["a"].measure_device == "cpu"
