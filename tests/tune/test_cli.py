"""The qtune command (qcompile.tune.cli): one-line errors with exit status 2 before any work; a whole run with a fake
builder / runner (the factories and the task extraction stood in for: no TVM pipeline, no GPU)."""
from __future__ import annotations

import json
import types

import pytest
from fakes import FakeBuilder, FakeRunner, Pending, fake_space, make_task

from qcompile.schedules import tuning as TU
from qcompile.tune import cli


@pytest.fixture
def fakes(monkeypatch, tmp_path):
    monkeypatch.setenv("QCOMPILE_TUNING_DIR", str(tmp_path / "no_default_logs"))
    TU.clear_cache()
    made = {}

    def add_runner_args(ap):
        ap.add_argument("--runner", default="local")
        ap.add_argument("--jobs", type=int, default=2)

    def make_runner(a):
        made["runner"] = FakeRunner(defer_after=0 if a.runner == "offline" else None)
        return made["runner"]

    build = types.SimpleNamespace(add_arguments=lambda ap: None, make_builder=lambda a: FakeBuilder())
    runners = types.SimpleNamespace(add_arguments=add_runner_args, make_runner=make_runner,
                                    OfflineBatchPending=Pending)
    monkeypatch.setattr(cli, "_factories", lambda: (build, runners))
    import qcompile.tune.tasks as T

    tasks = lambda *a, **k: [make_task(N=8, H=28, C=128, K=128, layers=("l2a", "l2b")),
                             make_task(N=8, H=14, C=256, K=256, layers=("l3",))]
    monkeypatch.setattr(T, "extract_tasks", tasks)
    monkeypatch.setitem(__import__("qcompile.schedules.space", fromlist=["SPACES"]).SPACES, "implicit_gemm",
                        fake_space())
    model = tmp_path / "m.onnx"
    model.write_bytes(b"x")
    yield model, made
    TU.clear_cache()


def _err(capsys):
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("qtune: error: ") and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("args,frag", [
    (["{missing}", "-o", "{log}"], "does not exist"),
    (["{model}", "-o", "{log}", "--target", "rocm"], "qtune tunes --target cuda (tensor-core kernels) or llvm"),
    (["{model}", "-o", "{log}", "--arch", "cpu_direct_vnni"], "names a CPU kernel: it goes with --target llvm"),
    (["{model}", "-o", "{log}", "--trials", "0"], "--trials must be a positive integer"),
    (["{model}", "-o", "{log}", "--minutes", "-1"], "--minutes must be a positive number"),
    (["{model}", "-o", "{log}", "--trials", "5", "--minutes", "2"], "not allowed with argument"),
    (["{model}", "-o", "{log}", "--batch", "8", "8"], "names a batch size twice"),
    (["{model}", "-o", "{tmp}"], "is a folder"),
    (["{model}", "-o", "{tmp}/t.json"], "must end with .jsonl"),
    (["{model}", "-o", "{log}", "--tuning-log", "{tmp}/nope.jsonl"], "does not exist"),
    (["{model}", "-o", "{log}", "--arch", "sm_70"], "invalid choice"),
    (["{model}", "-o", "{log}", "--net", "resnet18"], "HAWQ checkpoints only"),
])
def test_bad_input_is_one_line_and_exit_2(fakes, tmp_path, capsys, args, frag):
    model, _ = fakes
    sub = dict(model=str(model), missing=str(tmp_path / "no.onnx"), log=str(tmp_path / "t.jsonl"), tmp=str(tmp_path))
    with pytest.raises(SystemExit) if frag in ("not allowed with argument", "invalid choice") else _nothing():
        rc = cli.qtune_main([a.format(**sub) for a in args])
        assert rc == 2
    assert frag in _err(capsys)
    assert not (tmp_path / "t.jsonl").exists()


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def test_missing_runners_module_is_named(monkeypatch, tmp_path, capsys):
    model = tmp_path / "m.onnx"
    model.write_bytes(b"x")
    monkeypatch.setattr(cli, "_factories", lambda: (None, None))
    assert cli.qtune_main([str(model), "-o", str(tmp_path / "t.jsonl")]) == 2
    assert "qcompile.tune.build and qcompile.tune.runners not installed" in _err(capsys)


def test_a_whole_run_progress_table_and_resume(fakes, tmp_path, capsys):
    model, made = fakes
    log = tmp_path / "t.jsonl"
    assert cli.qtune_main([str(model), "-o", str(log), "--trials", "20", "--search", "random"]) == 0
    out = capsys.readouterr().out
    assert "2 tasks, 3 layers" in out and "baseline" in out and "round 1" in out
    table = out[out.index("task  "):]
    assert table.splitlines()[0].split()[:4] == ["task", "strategy", "share", "default"]
    assert "l2a +1 b8" in table and "batch 8: estimated whole-model gain" in table
    recs = [json.loads(ln) for ln in log.read_text().splitlines()]
    assert len(recs) == 20 and {r["device"] for r in recs} == {"Fake GPU"}
    # again, the same log: nothing measured twice; with the cost model (XGBoost) when installed
    search = "model" if _have_xgboost() else "random"
    assert cli.qtune_main([str(model), "-o", str(log), "--trials", "12", "--search", search, "-q"]) == 0
    assert capsys.readouterr().out == ""
    keys = [(r["key"], json.dumps(r["knobs"], sort_keys=True)) for r in map(json.loads, log.read_text().splitlines())]
    assert len(keys) == 32 and len(set(keys)) == 32
    # an offline export: the run stops, says so, exit 0
    assert cli.qtune_main([str(model), "-o", str(log), "--trials", "12", "--runner", "offline"]) == 0
    out = capsys.readouterr().out
    assert "0 candidates measured" in out and "exported" in out and "rerun this command" in out


def _have_xgboost() -> bool:
    try:
        import xgboost  # noqa: F401
    except ImportError:
        return False
    return True


def test_several_models_in_one_run(fakes, tmp_path, capsys, monkeypatch):
    """qtune A B: each model's tasks extracted, a task both have tuned once, a gain line per model; a model named
    twice is one clear error."""
    import qcompile.tune.tasks as T

    model, _ = fakes
    other = tmp_path / "n.onnx"
    other.write_bytes(b"x")
    by_model = {str(model): [make_task(N=8, H=28, C=128, K=128, layers=("m2a", "m2b")),
                             make_task(N=8, H=14, C=256, K=256, layers=("m3",))],
                str(other): [make_task(N=8, H=28, C=128, K=128, layers=("n2",)),
                             make_task(N=8, H=7, C=512, K=512, layers=("n4",))]}
    monkeypatch.setattr(T, "extract_tasks", lambda m, *a, **k: by_model[m])
    log = tmp_path / "t.jsonl"
    assert cli.qtune_main([str(model), str(other), "-o", str(log), "--trials", "12", "--search", "random"]) == 0
    out = capsys.readouterr().out
    assert "3 tasks, 5 layers (4 tasks in the 2 models; 1 shared)" in out
    assert f"{model} batch 8: estimated whole-model gain" in out and f"{other} batch 8: estimated" in out
    assert "m2a +1 b8 (2 models)" in out
    recs = [json.loads(ln) for ln in log.read_text().splitlines()]
    assert sum(r["variant"] == "default" for r in recs) == 3
    for twice in (str(model), str(tmp_path / "." / model.name)):
        assert cli.qtune_main([str(model), twice, "-o", str(tmp_path / "u.jsonl")]) == 2
        assert "named twice" in _err(capsys)


def test_the_cost_model_is_pretrained_on_the_packaged_measurements(fakes, tmp_path, capsys, monkeypatch):
    """With the cost model, qtune trains it first on ARCH.train.jsonl.gz of the tuning folder (one line says how
    many measurements); --no-pretrained, or random search, does not read it."""
    import gzip
    import pathlib

    if not _have_xgboost():
        pytest.skip("xgboost not installed")
    import qcompile.tune.scheduler as S

    model, _ = fakes
    src = pathlib.Path(__file__).resolve().parents[2] / "tuning_logs" / "sm_90.train.jsonl.gz"
    lines = gzip.decompress(src.read_bytes()).decode().splitlines()[:40]
    folder = tmp_path / "no_default_logs"
    folder.mkdir()
    (folder / "sm_90.train.jsonl.gz").write_bytes(gzip.compress(("\n".join(lines) + "\n").encode()))
    seen = []

    class Spy(S.Tuner):
        def __init__(self, *a, **k):
            seen.append(k.get("transfer"))
            super().__init__(*a, **k)

    monkeypatch.setattr(S, "Tuner", Spy)
    log = tmp_path / "t.jsonl"
    assert cli.qtune_main([str(model), "-o", str(log), "--trials", "4"]) == 0
    out = capsys.readouterr().out
    assert "cost model: trained first on 40 packaged measurements of sm_90 (sm_90.train.jsonl.gz" in out
    assert seen[-1] == (str(folder / "sm_90.train.jsonl.gz"),)
    for flags in (["--no-pretrained"], ["--search", "random"]):
        assert cli.qtune_main([str(model), "-o", str(tmp_path / f"{flags[-1]}.jsonl"), "--trials", "4"] + flags) == 0
        assert "packaged measurements" not in capsys.readouterr().out and seen[-1] == ()
    (folder / "sm_90.train.jsonl.gz").write_bytes(b"damaged")  # (a warning names it; the model starts empty)
    TU.clear_cache()
    assert cli.qtune_main([str(model), "-o", str(tmp_path / "d.jsonl"), "--trials", "4"]) == 0
    got = capsys.readouterr()
    assert "holds no measurement it can read; the model starts empty" in got.out and seen[-1] == ()
    assert "qtune: warning:" in got.err and "unreadable" in got.err and "make_train_log.py" in got.err
