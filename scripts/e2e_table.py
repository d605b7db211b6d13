#!/usr/bin/env python
"""Markdown tables of end-to-end results (scripts/bench_e2e.py's JSON), and the block writer every benchmark script
uses to put its table into docs/BENCHMARKS.md (or README.md).

    python scripts/e2e_table.py docs/bench/e2e_resnet_h100.json                       # print the table
    python scripts/e2e_table.py docs/bench/e2e_resnet_h100.json --write docs/BENCHMARKS.md README.md
    python scripts/e2e_table.py RESULTS.json --profile                                  # per-kernel breakdown

A table lives in a Markdown file between ``<!-- table:NAME -->`` and ``<!-- /table:NAME -->``; ``--write`` replaces
what is between the two markers (they must be there) and leaves the rest of the file as it is. The block is made
only from the results file: its date, device, commands and the PyTorch baseline measured in the same run.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import re
import sys

BITS_ORDER = ("8", "4", "mixed")
BITS_NAME = {"8": "INT8", "4": "INT4", "mixed": "mixed"}
NET_NAME = {"resnet18": "ResNet-18", "resnet50": "ResNet-50"}


def _version(key, v):
    """cuDNN's version number as torch reports it (91900) in the usual form (9.19.0)."""
    return f"{int(v) // 10000}.{int(v) // 100 % 100}.{int(v) % 100}" if key == "cudnn" and str(v).isdigit() else v


# ---------------- the marker blocks (shared by every benchmark script) ----------------

def replace_block(text: str, name: str, block: str) -> str:
    """``text`` with what lies between ``<!-- table:NAME -->`` and ``<!-- /table:NAME -->`` replaced by ``block``."""
    pat = re.compile(r"(<!-- table:%s -->\n).*?(<!-- /table:%s -->)" % (re.escape(name), re.escape(name)), re.S)
    if len(pat.findall(text)) != 1:
        raise KeyError(f"no single '<!-- table:{name} -->' ... '<!-- /table:{name} -->' pair")
    return pat.sub(lambda m: m.group(1) + block.rstrip("\n") + "\n" + m.group(2), text)


def write_block(name: str, block: str, paths) -> None:
    """Put ``block`` between NAME's markers in each file of ``paths``; with no paths, print it."""
    if not paths:
        sys.stdout.write(block.rstrip("\n") + "\n")
        return
    for p in map(pathlib.Path, paths):
        old = p.read_text()
        try:
            new = replace_block(old, name, block)
        except KeyError as e:
            sys.exit(f"{p}: {e.args[0]}")
        if new != old:
            p.write_text(new)
        print(f"{p}: table {name} {'updated' if new != old else 'unchanged'}", file=sys.stderr)


def add_table_command(sub, default_name: str, what: str = "the Markdown table of a results file", many=False):
    """The ``table RESULTS [--write FILE ...] [--name NAME]`` subcommand every benchmark script has."""
    t = sub.add_parser("table", help=what)
    t.add_argument("results", nargs="+" if many else None)
    add_write_args(t, default_name)
    return t


def add_gpu_host_commands(sub, build_dir, build_help: str):
    """``build [--dir]`` (build host) and ``device [--dir] [--out]`` (GPU host) of the check scripts."""
    b = sub.add_parser("build", help=f"{build_help} (build host)")
    b.add_argument("--dir", default=str(build_dir), help="output folder (default: %(default)s)")
    d = sub.add_parser("device", help="check and time them (GPU host)")
    d.add_argument("--dir", default=str(build_dir), help="the build folder (default: %(default)s)")
    d.add_argument("--out", help="results folder (default: --dir)")


def add_write_args(ap: argparse.ArgumentParser, default_name: str) -> None:
    """The options every ``table`` command takes."""
    ap.add_argument("--write", nargs="+", metavar="FILE",
                    help="replace the table's marked block in these files (e.g. docs/BENCHMARKS.md README.md) "
                         "instead of printing it")
    ap.add_argument("--name", default=default_name, help=f"the block's NAME in the markers (default: {default_name})")


def load(paths):
    """Results files, merged: (rows, profiles, list of the files' metadata)."""
    rows, profiles, metas = [], {}, []
    for f in paths:
        d = json.loads(pathlib.Path(f).read_text())
        rows += d["results"]
        profiles.update(d.get("profiles", {}))
        metas.append({k: v for k, v in d.items() if k not in ("results", "profiles")})
    return rows, profiles, metas


def run_line(metas, paths) -> str:
    """The caption: device, date, software versions, the build and GPU-host commands (from the results files)."""
    def uniq(key):
        return list(dict.fromkeys(v for m in metas for v in (m.get(key) if isinstance(m.get(key), list)
                                                             else [m.get(key)]) if v))

    soft = ", ".join(f"{name} {' / '.join(_version(k, v) for v in uniq(k))}"
                     for k, name in (("torch", "PyTorch"), ("cudnn", "cuDNN"), ("tvm", "TVM")) if uniq(k))
    files = ", ".join(f"`{pathlib.PurePath(p).as_posix()}`" for p in paths)
    out = f"{' / '.join(uniq('device'))}, {' / '.join(uniq('date'))}" + (f" ({soft})" if soft else "")
    out += f". Results: {files}."
    built = " and ".join(f"`{c}`" for c in uniq("build_commands"))
    run = " and ".join(f"`{c}`" for c in uniq("command"))
    if built:
        out += f" Built with {built}" + (f"; measured on the GPU host with {run}." if run else ".")
    elif run:
        out += f" Measured on the GPU host with {run}."
    out += "".join(" " + n for n in uniq("note"))
    return out


# ---------------- the end-to-end table ----------------

def e2e_table(paths) -> str:
    """One table per net: rows are batch sizes, columns PyTorch fp16 and each bit width (time per batch at batch 1,
    images/s above it), each qcompile cell with its speed-up over the PyTorch fp16 run of the same process."""
    rows, _, metas = load(paths)
    rows = [r for r in rows if r["bits"] in BITS_ORDER and "ms" in r]
    bits = [b for b in BITS_ORDER if any(r["bits"] == b for r in rows)]
    out = []
    for net in sorted({r["net"] for r in rows}, key=lambda n: int(re.sub(r"\D", "", n) or 0)):
        cols = " | ".join(f"qcompile {BITS_NAME[b]}" for b in bits)
        out += [f"| {NET_NAME.get(net, net)} | PyTorch fp16 | {cols} |",
                "|---|" + "---|" * (1 + len(bits))]
        for batch in sorted({r["batch"] for r in rows if r["net"] == net}):
            rs = {r["bits"]: r for r in rows if r["net"] == net and r["batch"] == batch}
            lat = batch == 1
            emb = {r.get("weights") for r in rs.values()} == {"embedded"}
            label = f"batch {batch}" + (", latency" if lat else "") + (" (weights in the .so)" if emb else "")

            def cell(ms, img_s):
                return f"{ms:.3f} ms" if lat else f"{img_s:,.0f} img/s"

            base = sorted({round(r["torch_fp16_ms"], 4) for r in rs.values()})
            ref = rs[bits[0]] if bits[0] in rs else next(iter(rs.values()))
            tc = cell(ref["torch_fp16_ms"], ref["torch_img_s"])
            if len(base) > 1:  # (rows of one batch size from different processes)
                tc += " (per-column runs differ)"
            cells = []
            for b in bits:
                r = rs.get(b)
                if r is None:
                    cells.append("--")
                    continue
                ex = {True: "", False: ", **output differs from llvm**"}.get(r.get("exact"), "")
                cells.append(f"{cell(r['ms'], r['img_s'])} ({r['speedup']:.2f}x{ex})")
            out.append(f"| {label} | {tc} | " + " | ".join(cells) + " |")
        out.append("")
    checked = [r for r in rows if "exact" in r]
    if checked:
        bs = sorted({r["batch"] for r in checked})
        ok = sum(r["exact"] for r in checked)
        out.append(f"GPU output equal to the llvm build's output bit for bit: {ok} of the {len(checked)} builds "
                   f"checked (batch {', '.join(map(str, bs))}).")
        out.append("")
    out.append(run_line(metas, paths))
    return "\n".join(out) + "\n"


# ---------------- the per-kernel breakdown of a profile build (bench_e2e.py, prof*.so) ----------------

def category(name: str) -> str:
    if name.startswith("qconv_conv1"):
        return "stem conv (tensor cores)"
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


def profile_tables(paths) -> str:
    _, profiles, _ = load(paths)
    out = []
    for tag, p in profiles.items():
        cats = {}
        for n, t in p["all"]:
            cats[category(n)] = cats.get(category(n), 0.0) + t
        out += [f"**{tag}**: {p['kernels_us'] / 1e3:.2f} ms of GPU work in {p['n_kernels']} kernels "
                f"({p['n_conv']} tensor-core conv/dense kernels)", "", "| part | ms | share |", "|---|---|---|"]
        out += [f"| {c} | {t / 1e3:.3f} | {100 * t / p['kernels_us']:.1f}% |"
                for c, t in sorted(cats.items(), key=lambda kv: -kv[1])]
        out.append("")
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+", help="bench_e2e.py results files (merged)")
    ap.add_argument("--profile", action="store_true", help="print the per-kernel breakdown of the profiles instead")
    add_write_args(ap, "e2e")
    a = ap.parse_args(argv)
    if a.profile:
        print(profile_tables(a.results))
        return
    write_block(a.name, e2e_table(a.results), a.write)


if __name__ == "__main__":
    main()
