"""Distinct conv shapes of ResNet-18/50 (224x224 input) and the odd shapes we test."""
from __future__ import annotations

# (name, C, H(=W), K, R, stride, pad)
RESNET18 = [
    ("r18_stem", 3, 224, 64, 7, 2, 3),
    ("r18_l1_3x3", 64, 56, 64, 3, 1, 1),
    ("r18_l2_3x3s2", 64, 56, 128, 3, 2, 1),
    ("r18_l2_3x3", 128, 28, 128, 3, 1, 1),
    ("r18_l2_ds", 64, 56, 128, 1, 2, 0),
    ("r18_l3_3x3s2", 128, 28, 256, 3, 2, 1),
    ("r18_l3_3x3", 256, 14, 256, 3, 1, 1),
    ("r18_l3_ds", 128, 28, 256, 1, 2, 0),
    ("r18_l4_3x3s2", 256, 14, 512, 3, 2, 1),
    ("r18_l4_3x3", 512, 7, 512, 3, 1, 1),
    ("r18_l4_ds", 256, 14, 512, 1, 2, 0),
    ("r18_fc", 512, 1, 1000, 1, 1, 0),
]
RESNET50 = [
    ("r50_stem", 3, 224, 64, 7, 2, 3),
    ("r50_l1_1x1a", 64, 56, 64, 1, 1, 0),
    ("r50_l1_3x3", 64, 56, 64, 3, 1, 1),
    ("r50_l1_1x1b", 64, 56, 256, 1, 1, 0),
    ("r50_l1_1x1c", 256, 56, 64, 1, 1, 0),
    ("r50_l2_1x1a", 256, 56, 128, 1, 1, 0),
    ("r50_l2_3x3s2", 128, 56, 128, 3, 2, 1),
    ("r50_l2_1x1b", 128, 28, 512, 1, 1, 0),
    ("r50_l2_ds", 256, 56, 512, 1, 2, 0),
    ("r50_l2_1x1c", 512, 28, 128, 1, 1, 0),
    ("r50_l2_3x3", 128, 28, 128, 3, 1, 1),
    ("r50_l3_1x1a", 512, 28, 256, 1, 1, 0),
    ("r50_l3_3x3s2", 256, 28, 256, 3, 2, 1),
    ("r50_l3_1x1b", 256, 14, 1024, 1, 1, 0),
    ("r50_l3_ds", 512, 28, 1024, 1, 2, 0),
    ("r50_l3_1x1c", 1024, 14, 256, 1, 1, 0),
    ("r50_l3_3x3", 256, 14, 256, 3, 1, 1),
    ("r50_l4_1x1a", 1024, 14, 512, 1, 1, 0),
    ("r50_l4_3x3s2", 512, 14, 512, 3, 2, 1),
    ("r50_l4_1x1b", 512, 7, 2048, 1, 1, 0),
    ("r50_l4_ds", 1024, 14, 2048, 1, 2, 0),
    ("r50_l4_1x1c", 2048, 7, 512, 1, 1, 0),
    ("r50_l4_3x3", 512, 7, 512, 3, 1, 1),
    ("r50_fc", 2048, 1, 1000, 1, 1, 0),
]
# (name, N, C, H, K, R, stride, pad)
ODD = [
    ("odd_stem_c3_b1", 1, 3, 57, 64, 7, 2, 3),
    ("odd_stem_c3_b3", 3, 3, 33, 64, 7, 2, 3),
    ("odd_s2_oddhw", 3, 64, 15, 64, 3, 2, 1),
    ("odd_c24_c40", 3, 24, 17, 40, 3, 1, 1),
    ("odd_c40_c72_1x1", 1, 40, 13, 72, 1, 1, 0),
    ("odd_c72_c24_s2", 8, 72, 11, 24, 3, 2, 1),
]


def distinct(layers):
    seen, out = set(), []
    for l in layers:
        key = l[1:]
        if key not in seen:
            seen.add(key)
            out.append(l)
    return out


ALL_RESNET = distinct(RESNET18 + RESNET50)


# the second stage's per-tensor constants (c1, M1, c2, M2, S2) of ResNet-50 INT4's first residual conv as the
# dispatcher compiles it (build_e2e.py's model): what the tuner's residual specs and the GPU checks compile in.
# Constants whose sum cannot reach the top of the output range (e.g. (1, 3 << 14, -2, 5 << 13, 16)) let TVM drop the
# upper clip and leave nvcc a mask in the 4-bit pack: a kernel tuned with them is not the model's
RQ2_RESNET50 = (0, 1787590, 0, 760277, 20)
