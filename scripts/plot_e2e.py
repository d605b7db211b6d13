#!/usr/bin/env python
"""Plot bench_e2e.py results: images/s per batch size, qcompile INT8/INT4/mixed vs PyTorch fp16 (same run).

    python scripts/plot_e2e.py docs/bench/e2e_resnet_h100.json -o docs/e2e_h100.png
"""
import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+")
    ap.add_argument("-o", "--out", default="docs/e2e_h100.png")
    ap.add_argument("--title", help="default: the results' device and date")
    a = ap.parse_args()
    rows, meta = [], {}
    for f in a.results:
        d = json.load(open(f))
        rows += d["results"] if isinstance(d, dict) else d
        meta = meta or (d if isinstance(d, dict) else {})
    title = a.title or f"{meta.get('device', '')}, {meta.get('date', '')}".strip(", ")
    nets = sorted({r["net"] for r in rows})
    fig, axes = plt.subplots(1, len(nets), figsize=(6 * len(nets), 4.5), squeeze=False)
    for ax, net in zip(axes[0], nets):
        rs = [r for r in rows if r["net"] == net and "img_s" in r]
        batches = sorted({r["batch"] for r in rs})
        xs = range(len(batches))
        series = [("PyTorch fp16 (cuDNN, CUDA graph)", lambda r: r["torch_img_s"], None)]
        series += [(f"qcompile {n}", lambda r: r["img_s"], b)
                   for b, n in (("8", "INT8"), ("4", "INT4"), ("mixed", "mixed"))]
        width = 0.8 / len(series)
        for i, (label, get, bits) in enumerate(series):
            vals = []
            for b in batches:
                m = [r for r in rs if r["batch"] == b and (bits is None or r["bits"] == bits)]
                vals.append(get(m[0]) if m else 0)
            ax.bar([x + i * width for x in xs], vals, width, label=label)
        ax.set_xticks([x + 0.4 - width / 2 for x in xs], [str(b) for b in batches])
        ax.set_xlabel("batch size")
        ax.set_ylabel("images / s")
        ax.set_title(f"{net} — {title}")
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)
    print("wrote", a.out)


if __name__ == "__main__":
    main()
