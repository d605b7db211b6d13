#!/usr/bin/env python3
"""Latency table of `qbench` results files (one per module: ``qbench m.so ... --json FILE``).

    qbench m.so --torch resnet50 --host-io --calls 10000 --json docs/bench/qbench_NAME.json      # GPU host
    python scripts/bench_latency.py table docs/bench/qbench_*.json --write docs/BENCHMARKS.md      # the table

One row per results file and timing (qcompile with the input on the GPU, qcompile with NumPy in and out, PyTorch
fp16 of the same network measured in the same process): ms per batch of queued calls, images per second, and the
latency percentiles of single synchronized calls; then the device, dates and commands.
"""
import argparse
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from e2e_table import add_table_command, write_block  # noqa: E402

ROWS = (("qcompile", "qcompile, input on the GPU"), ("qcompile_host_io", "qcompile, NumPy in and out"),
        ("torch_fp16", "PyTorch fp16"))


def table(paths) -> str:
    lines = ["| module | batch | timing | ms per batch | img/s | p50 ms | p90 ms | p99 ms | max ms | host ms | calls |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    notes = []
    for p in paths:
        r = json.loads(pathlib.Path(p).read_text())
        b = r["batch"]
        mod = "/".join(pathlib.Path(r["module"]).parts[-2:])
        calls = next((int(a) for k, a in zip(r["command"].split(), r["command"].split()[1:]) if k == "--calls"), 1000)
        for key, label in ROWS:
            if key not in r:
                continue
            t = r[key]  # (host ms: the median time until a call returns, before the synchronization)
            name = label + (f" ({t['net']})" if key == "torch_fp16" else "")
            host = f"{t['host_p50_ms']:.3f}" if "host_p50_ms" in t else "-"
            lines.append(f"| `{mod}` | {b} | {name} | {t['ms']:.3f} | {b / t['ms'] * 1e3:,.0f} | {t['p50_ms']:.3f} "
                         f"| {t['p90_ms']:.3f} | {t['p99_ms']:.3f} | {t['max_ms']:.3f} | {host} | {calls} |")
        notes.append(f"`{mod}`: {r['device']}, {r['date']}; `{r['command']}`; results "
                     f"`{p}`.")
    return "\n".join(lines) + "\n\n" + "\n".join(notes) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    add_table_command(sub, "latency", many=True)
    a = ap.parse_args(argv)
    write_block(a.name, table(a.results), a.write)


if __name__ == "__main__":
    main()
