#!/usr/bin/env python
"""Markdown tables from bench_e2e.py JSON files: results, and the per-kernel breakdown of the profiles.

    python scripts/e2e_table.py docs/bench/e2e_*.json
"""
import json
import sys


def category(name: str) -> str:
    if name.startswith("qconv_conv1"):
        return "stem conv 7x7 (tensor cores, C padded 3->4)"
    if name.startswith("qconv_") and "splitk_epilogue" in name:
        return "split-K epilogues (sum of partials + requantize)"
    if name.startswith("qconv_") and "_resadd" in name:
        return "convs with the residual add fused (tensor cores)"
    if name.startswith("qconv_"):
        return "other convs + fc (tensor cores)"
    if "max_pool" in name:
        return "max pool"
    if "divide" in name:
        return "input quantize + NHWC + channel pad"
    if "bitwise" in name:
        return "INT4 pack/unpack (+ fused glue)"
    if "sum" in name:
        return "global average pool"
    if "right_shift" in name:
        return "average-pool requantize (glue)"
    return "other"


def main():
    results, profiles = [], {}
    for f in sys.argv[1:]:
        d = json.load(open(f))
        results += d["results"]
        profiles.update(d.get("profiles", {}))
    order = {"8": 0, "4": 1, "mixed": 2}
    results.sort(key=lambda r: (r["net"], order.get(r["bits"], 9), r["batch"], r.get("weights", "beside")))
    print("| net | bits | batch | GPU = llvm, bit for bit | qcompile ms | img/s | PyTorch fp16 ms | img/s | speed-up |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        ex = {True: "yes", False: "**NO**"}.get(r.get("exact"), "")
        b = f"{r['batch']} (weights in .so)" if r.get("weights") == "embedded" else r["batch"]
        print(f"| {r['net']} | {r['bits']} | {b} | {ex} | {r['ms']:.3f} | {r['img_s']:,.0f} | "
              f"{r['torch_fp16_ms']:.3f} | {r['torch_img_s']:,.0f} | {r['speedup']:.2f}x |")
    for tag, p in profiles.items():
        cats = {}
        for n, t in p["all"]:
            cats[category(n)] = cats.get(category(n), 0.0) + t
        print(f"\n**{tag}**: {p['kernels_us'] / 1e3:.2f} ms of GPU work in {p['n_kernels']} kernels "
              f"({p['n_conv']} tensor-core conv/dense kernels)\n")
        print("| part | ms | share |")
        print("|---|---|---|")
        for c, t in sorted(cats.items(), key=lambda kv: -kv[1]):
            print(f"| {c} | {t / 1e3:.3f} | {100 * t / p['kernels_us']:.1f}% |")


if __name__ == "__main__":
    main()
