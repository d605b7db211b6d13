"""Plot qtune's measured curves (docs/TUNING.md "Measured"): end-to-end img/s of ResNet-50 INT8 at batch 256 over
the GPU-minutes of tuning, against the hand-tuned and the defaults' builds; and the tuner's estimated whole-model
gain over candidates for the XGBoost-ranked and the random search.

    python scripts/plot_qtune.py [DIR] [--plain PLAIN] [-o docs/qtune_r50_h100.png]

DIR (default docs/bench/qtune_r50_int8_b256_h100_configs: qtune as it runs by default) holds e2e.json and
model.jsonl; PLAIN (default docs/bench/qtune_r50_int8_b256_h100_local: the same from ``--no-configs``) holds e2e.json,
model.jsonl and random.jsonl (``--no-configs --search random``).
"""
from __future__ import annotations

import argparse
import json
import os


def estimated_gain(path: str) -> list:
    """Per candidate (in log order, from the last default of the baseline on), the estimated whole-model gain
    ``1 / sum(share x best / default)``, the shares from the measured defaults (the tuner's estimate)."""
    recs = [json.loads(ln) for ln in open(path)]
    dflt = {r["key"]: (r["ms"], r["layers"]) for r in recs if r.get("variant") == "default" and r["status"] == "ok"}
    total = sum(ms * n for ms, n in dflt.values())
    best = {k: v[0] for k, v in dflt.items()}
    out = []
    for i, r in enumerate(recs, 1):
        if r["status"] == "ok" and r["key"] in best:
            best[r["key"]] = min(best[r["key"]], r["ms"])
        if i >= len(dflt):
            out.append((i, total / sum(best[k] * dflt[k][1] for k in dflt)))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", nargs="?", default="docs/bench/qtune_r50_int8_b256_h100_configs")
    ap.add_argument("--plain", default="docs/bench/qtune_r50_int8_b256_h100_local")
    ap.add_argument("-o", "--output", default="docs/qtune_r50_h100.png")
    a = ap.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ips = lambda r: 256e3 / (sum(r["ms"]) / len(r["ms"]))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for d, label, style in ((a.dir, "qtune", "o-"), (a.plain, "qtune --no-configs (another run)", "s--")):
        e2e = json.load(open(os.path.join(d, "e2e.json")))
        hand = next(ips(r) for r in e2e["rows"] if r["build"] == "hand-tuned")
        # (each run's points as a percentage of the hand-tuned build measured in its own session)
        pts = [(r["gpu_minutes"], ips(r) / hand) for r in e2e["rows"] if r["gpu_minutes"] is not None]
        ax1.plot([p[0] for p in pts], [100 * p[1] for p in pts], style, label=label)
    e2e = json.load(open(os.path.join(a.dir, "e2e.json")))
    ax1.axhline(100, color="k", ls="--", label="hand-tuned log (same session)")
    ax1.axhline(95, color="gray", ls=":", label="95% of hand-tuned")
    ax1.axvline(10, color="r", lw=0.5)
    ax1.axvline(20, color="r", lw=0.5)
    ax1.set_xlabel("GPU-minutes of tuning (builds on the GPU host's 16 cores included)")
    ax1.set_ylabel("% of the hand-tuned build's img/s (R50 INT8 b256)")
    ax1.set_title(f"{e2e['device']}, {e2e['date']}")
    ax1.legend(fontsize=8)
    for path, label, style in ((os.path.join(a.dir, "model.jsonl"), "default (start points + XGBoost)", "-"),
                               (os.path.join(a.plain, "model.jsonl"), "--no-configs (XGBoost)", "-."),
                               (os.path.join(a.plain, "random.jsonl"), "--no-configs --search random", "--")):
        c = estimated_gain(path)
        ax2.plot([i for i, _ in c], [g for _, g in c], style, label=label)
    ax2.set_xlabel("candidates measured (the 25-candidate baseline included)")
    ax2.set_ylabel("estimated whole-model gain (tensor-core kernels)")
    ax2.set_title("the search's estimate, from an empty log")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(a.output, dpi=90)
    print(f"wrote {a.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
