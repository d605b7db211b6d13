"""qbench: a compiled module timed with the runtime alone (here an llvm build of resnet_tiny on the CPU): the table,
the JSON with the device, date and command, and one-line errors."""
import json
import subprocess
import sys

import pytest

from qcompile.bench import percentiles, qbench_main


@pytest.fixture(scope="module")
def tiny_so(tmp_path_factory):
    from qcompile.cli import qcompile_main

    d = tmp_path_factory.mktemp("qbench")
    onnx_path = str(d / "t.onnx")
    r = subprocess.run([sys.executable, "-m", "qcompile.models.cli", "resnet_tiny", "--bits", "8", "--input-size", "16",
                        "--batch", "2", "-q", "-o", onnx_path], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    so = str(d / "t.so")
    assert qcompile_main([onnx_path, "-q", "-o", so]) == 0
    return so


def test_percentiles_nearest_rank():
    p = percentiles([i / 1000 for i in range(1, 101)])  # 1..100 ms
    assert (p["p50_ms"], p["p90_ms"], p["p99_ms"], p["max_ms"]) == pytest.approx((50, 90, 99, 100))


def test_qbench_table_and_json(tiny_so, tmp_path, capsys):
    out = tmp_path / "r.json"
    assert qbench_main([tiny_so, "--calls", "20", "--repeat", "3", "--number", "3", "--warm", "0", "--host-io",
                        "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "| qcompile |" in table and "| qcompile, NumPy in/out |" in table and "batch 2" in table
    r = json.loads(out.read_text())
    assert r["batch"] == 2 and r["command"].startswith("qbench ") and r["date"]
    for k in ("qcompile", "qcompile_host_io"):
        t = r[k]
        assert 0 < t["p50_ms"] <= t["p90_ms"] <= t["p99_ms"] <= t["max_ms"] and t["ms"] > 0


def test_qbench_errors(tiny_so, capsys):
    with pytest.raises(SystemExit) as e:  # (usage errors: argparse's exit, as in qcompile)
        qbench_main([tiny_so, "--calls", "0"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("qbench: error: argument --calls") and "\n" not in err
    assert qbench_main([tiny_so, "--warm", "0", "--torch", "resnet18"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("qbench: error: --torch compares on the GPU") and "\n" not in err


def test_qbench_missing_module(tmp_path, capsys):
    assert qbench_main([str(tmp_path / "none.so")]) == 2
    assert "does not exist" in capsys.readouterr().err
