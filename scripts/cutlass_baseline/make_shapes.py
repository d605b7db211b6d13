"""Write shapes_r50.json: ResNet-50's distinct conv shapes as qcompile builds them, for conv_s8.

1. Read the per-layer list of the 8-bit batch-256 entry of docs/bench/roofline_resnet50_h100.json (the layers
   ``scripts/roofline.py collect`` recorded from the qcompile build: NHWC in_shape, OHWI w_shape, out_shape).
2. Derive stride = H // P and pad = R // 2 for every conv2d layer and check that they reproduce the recorded output
   (P = (H + 2 pad - R) // stride + 1); a layer that does not is an error.
3. Group the layers by shape (batch 256 and the same shapes at batch 1), first-use order, keeping the layer names.
4. The stem (C = 3) stays as it is, and a copy with C padded to 16 is added (TMA im2col needs 16-byte channel
   rows); its ops count the padded channels.

Usage: python3 scripts/cutlass_baseline/make_shapes.py [--roofline PATH] [-o PATH]
"""
import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
DEFAULT_ROOFLINE = ROOT / "docs" / "bench" / "roofline_resnet50_h100.json"


@dataclass
class Shape:
    H: int
    W: int
    C: int
    K: int
    R: int
    S: int
    stride: int
    pad: int
    layers: list = field(default_factory=list)

    def key(self) -> tuple:
        return (self.H, self.W, self.C, self.K, self.R, self.S, self.stride, self.pad)

    def record(self, batch: int, suffix: str = "") -> dict:
        name = f"b{batch}_{self.H}x{self.W}_c{self.C}_k{self.K}_r{self.R}_s{self.stride}{suffix}"
        return {"name": name, "layers": self.layers, "N": batch, "H": self.H, "W": self.W, "C": self.C,
                "K": self.K, "R": self.R, "S": self.S, "stride": self.stride, "pad": self.pad, "dilation": 1}


def conv_layers(path: Path) -> list:
    """Step 1: the conv2d layers of the 8-bit batch-256 ResNet-50 entry."""
    doc = json.loads(path.read_text())
    entries = [e for e in doc.get("entries", []) if str(e.get("bits")) == "8" and e.get("batch") == 256]
    if not entries:
        sys.exit(f"error: {path}: no entry with bits 8 and batch 256")
    layers = [layer for layer in entries[0]["layers"] if layer["op"] == "conv2d"]
    if not layers:
        sys.exit(f"error: {path}: the bits-8 batch-256 entry lists no conv2d layer")
    return layers


def shape_of(layer: dict) -> Shape:
    """Step 2: stride and pad of one NHWC/OHWI layer, checked against its recorded output shape."""
    n, h, w, c = layer["in_shape"]
    k, r, s, wc = layer["w_shape"]
    on, p, q, ok = layer["out_shape"]
    if wc != c or ok != k or on != n or r != s or h != w:
        sys.exit(f"error: layer {layer['name']}: unexpected shapes {layer['in_shape']} {layer['w_shape']} "
                 f"{layer['out_shape']}")
    stride, pad = h // p, r // 2
    if (h + 2 * pad - r) // stride + 1 != p or (w + 2 * pad - s) // stride + 1 != q:
        sys.exit(f"error: layer {layer['name']}: stride {stride} pad {pad} do not give output {p}x{q}")
    return Shape(h, w, c, k, r, s, stride, pad, [layer["name"]])


def distinct(layers: list) -> list:
    """Step 3: one Shape per distinct geometry, in first-use order, with every layer name using it."""
    by_key: dict = {}
    for layer in layers:
        sh = shape_of(layer)
        if sh.key() in by_key:
            by_key[sh.key()].layers.append(layer["name"])
        else:
            by_key[sh.key()] = sh
    return list(by_key.values())


def shape_records(shapes: list) -> list:
    """Steps 3-4: records at batch 256 then batch 1, the stem also with C padded to 16."""
    out = []
    for batch in (256, 1):
        for sh in shapes:
            out.append(sh.record(batch))
            if sh.C % 16:
                padded = Shape(sh.H, sh.W, 16, sh.K, sh.R, sh.S, sh.stride, sh.pad, list(sh.layers))
                out.append(padded.record(batch, suffix=f"_cpad_from{sh.C}"))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--roofline", type=Path, default=DEFAULT_ROOFLINE)
    ap.add_argument("-o", "--out", type=Path, default=HERE / "shapes_r50.json")
    args = ap.parse_args()
    shapes = distinct(conv_layers(args.roofline))
    doc = {"format": "qcompile-conv-shapes/1", "model": "resnet50", "layout": "NHWC activations, KRSC (OHWI) weights",
           "source": str(args.roofline.relative_to(ROOT)) if args.roofline.is_relative_to(ROOT) else str(args.roofline),
           "shapes": shape_records(shapes)}
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"{args.out}: {len(doc['shapes'])} shapes", file=sys.stderr)


if __name__ == "__main__":
    main()
