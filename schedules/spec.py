"""Conv2d problem description, per-architecture MMA table, and the tuning knobs."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

_BITS = {"int8": 8, "uint8": 8, "int4": 4, "uint4": 4, "int32": 32}
_SIGNED = {"int8": True, "uint8": False, "int4": True, "uint4": False, "int32": True}


@dataclass(frozen=True)
class ConvSpec:
    """One quantized conv2d layer (see docs/SCHEDULES.md for the exact math).

    Tensors (PrimFunc params, in this order): x, w, bias int32[K], M int32[K], S int32[K],
    [res, rq2 int32[5, K]], [lut], out.
      NHWC: x[N,H,W,Cs], w OHWI [K,R,S,Cs], out/res [N,P,Q,Ks]
      HWNC: x[H,W,N,Cs], w HWOI [R,S,K,Cs], out/res [P,Q,N,Ks]
    With ``lut`` (entries of a lookup table, 0: none) the table is one more input, ``lut[lut]`` of the output's
    storage type, after [res, rq2]: the kernel writes ``lut[y - lut_min]`` in place of the final value y (the
    element-wise activation of the graph that follows the conv, ``take(table, y - lut_min)``); y's clip range lies in
    the table's domain ``lut_min .. lut_min + lut - 1`` and the output is 8-bit. Not part of the tuning key.
    4-bit tensors are packed two per byte along the innermost (channel) axis (Cs = C/2): element 2i in
    the low nibble, 2i+1 in the high nibble; signed nibbles are sign-extended. Storage dtypes:
    int8/int4 -> "int8" buffers, uint8/uint4 -> "uint8" buffers. Padding positions read ``pad_value``
    (the input zero point; the caller folds -zp*sum(w) into bias).

    Epilogue, all in int64 (stage 1 is the conv's own requantize):
        y1  = clip(((acc + bias) * M + 2^(S-1)) >> S) + zo, lo, hi)
    and with ``has_residual`` a second stage, the quantized residual add of the QDQ graph
    (``quantize(dequantize(y1) + dequantize(res))``), rq2 rows = (c1, M1, c2, M2, S2) per channel:
        out = clip((((y1 + c1) * M1 + (res + c2) * M2 + 2^(S2-1)) >> S2) + zo2, lo2, hi2)
    (in int32 with ``res_i32``: the caller guarantees no intermediate overflows), else out = y1.
    With ``shift_ge33`` (the caller guarantees every S[k] >= 33) stage 1 is computed as
    ``(hi32(t * M) + 2^(S-33)) >> (S-32)``, which equals the formula above exactly. ``res`` has type ``res_dtype`` (packed when 4-bit)."""

    N: int
    H: int
    W: int
    C: int
    K: int
    R: int
    S: int
    stride: tuple[int, int] | int = 1
    padding: tuple[int, int, int, int] | int = 0  # top, left, bottom, right
    dilation: tuple[int, int] | int = 1
    layout: str = "NHWC"  # or "HWNC"
    x_dtype: str = "int8"  # int8 | uint8 | int4 | uint4
    w_bits: int = 8  # 8 | 4 (weights are signed)
    out_dtype: str = "int8"  # int8 | uint8 | int4 | uint4 | int32
    has_residual: bool = False
    zo: int = 0
    lo: int = -128
    hi: int = 127
    pad_value: int = 0
    res_dtype: str = "int8"  # int8 | uint8 | int4 | uint4 (the residual input, with has_residual)
    zo2: int = 0  # residual stage: output zero point and clip range
    lo2: int = -128
    hi2: int = 127
    res_i32: bool = False  # the residual stage fits int32 (the graph's own residual requantize is int32)
    shift_ge33: bool = False  # every S[k] >= 33: stage 1 in int32 from the product's high word (mul.hi)
    rq2_uniform: tuple = ()  # (c1, M1, c2, M2, S2) when rq2 is the same for every channel: compiled in
    groups: int = 1  # conv groups (> 1: the CUDA-core ``depthwise`` / ``grouped`` kernels; w is [K, R, S, C / groups])
    lut: int = 0  # entries of the output lookup table (0: none; see above)
    lut_min: int = 0  # the final value that indexes the table's first entry

    def __post_init__(self):
        if self.lut:
            lo, hi = (self.lo2, self.hi2) if self.has_residual else (self.lo, self.hi)
            if self.out_dtype not in ("int8", "uint8") or not self.lut_min <= lo <= hi < self.lut_min + self.lut:
                raise ValueError(f"ConvSpec: a {self.lut}-entry output table from {self.lut_min} needs an 8-bit output "
                                 f"and the final clip range [{lo}, {hi}] inside its domain (out_dtype {self.out_dtype})")

    # ---- derived -------------------------------------------------------------------------
    @property
    def strides(self):
        s = self.stride
        return (s, s) if isinstance(s, int) else tuple(s)

    @property
    def pads(self):
        p = self.padding
        if isinstance(p, int):
            return (p, p, p, p)
        if len(p) == 2:
            return (p[0], p[1], p[0], p[1])
        return tuple(p)

    @property
    def dilations(self):
        d = self.dilation
        return (d, d) if isinstance(d, int) else tuple(d)

    @property
    def P(self):
        pt, _, pb, _ = self.pads
        return (self.H + pt + pb - self.dilations[0] * (self.R - 1) - 1) // self.strides[0] + 1

    @property
    def Q(self):
        _, pl, _, pr = self.pads
        return (self.W + pl + pr - self.dilations[1] * (self.S - 1) - 1) // self.strides[1] + 1

    @property
    def x_bits(self):
        return _BITS[self.x_dtype]

    @property
    def x_signed(self):
        return _SIGNED[self.x_dtype]

    @property
    def out_bits(self):
        return _BITS[self.out_dtype]

    @property
    def out_signed(self):
        return _SIGNED[self.out_dtype]

    @staticmethod
    def storage(dtype: str) -> str:
        return {"int8": "int8", "int4": "int8", "uint8": "uint8", "uint4": "uint8", "int32": "int32"}[dtype]

    @property
    def res_bits(self):
        return _BITS[self.res_dtype]

    @property
    def res_signed(self):
        return _SIGNED[self.res_dtype]

    def macs(self) -> int:
        return self.N * self.P * self.Q * self.K * self.R * self.S * self.C

    def gemm_shape(self):
        """(M, N, K) of the equivalent GEMM."""
        return self.N * self.P * self.Q, self.K, self.R * self.S * self.C

    def shapes(self):
        """Logical storage shapes of (x, w, out) for this spec's layout (packed for 4-bit)."""
        cx = (self.C * self.x_bits + 7) // 8
        cw = (self.C * self.w_bits + 7) // 8
        ko = (self.K + 1) // 2 if self.out_bits == 4 else self.K  # elements of the storage dtype
        if self.layout == "NHWC":
            return (self.N, self.H, self.W, cx), (self.K, self.R, self.S, cw), (self.N, self.P, self.Q, ko)
        return (self.H, self.W, self.N, cx), (self.R, self.S, self.K, cw), (self.P, self.Q, self.N, ko)

    def res_shape(self):
        """Storage shape of the residual input (packed for 4-bit)."""
        kr = (self.K + 1) // 2 if self.res_bits == 4 else self.K
        if self.layout == "NHWC":
            return (self.N, self.P, self.Q, kr)
        return (self.P, self.Q, self.N, kr)

    def replace(self, **kw) -> "ConvSpec":
        return dataclasses.replace(self, **kw)


def operand_plan(C: int, x_dtype: str, w_bits: int, dense: bool = False) -> tuple[int, str, int]:
    """(channel padding, x dtype, weight bits) a compiled conv runs with for C input channels: a few channels (the
    RGB stem) are zero-padded to a multiple of 4 (zero weights too: the sum is unchanged) so the GEMM loads 4-byte
    vectors instead of single bytes, with 8-bit inputs; 4-bit operands need an even C to be packed two per byte."""
    c_pad = 0
    if not dense and x_dtype in ("int8", "uint8", "int4", "uint4") and C % 4:
        if x_dtype in ("int4", "uint4"):
            x_dtype = "int8" if x_dtype == "int4" else "uint8"
        c_pad = -C % 4
    if x_dtype in ("int4", "uint4") and C % 2:
        x_dtype = "int8" if x_dtype == "int4" else "uint8"
    return c_pad, x_dtype, (w_bits if (w_bits == 8 or C % 2 == 0) else 8)


def space_to_depth(spec: ConvSpec) -> ConvSpec | None:
    """The stride-2 conv ``spec`` as a stride-1 conv over its input rearranged 2x2 space-to-depth, or None where
    that does not apply (NHWC, 8-bit input, stride 2, no dilation, a kernel wider than 1 and a channel vector of 4,
    8 or 12 bytes, which becomes a 16-byte multiple: the RGB stem's 4 channels -> 16).

        x2[n, i, j, (dr*2 + ds)*C + c] = x[n, 2i + dr, 2j + ds, c]        (pad_value past an odd H / W)
        w2[k, R', S', (dr*2 + ds)*C + c] = w[k, 2R' + dr - eh, 2S' + ds - ew, c]   (0 outside the kernel)

    ``eh, ew = pt % 2, pl % 2`` zero taps are put in front so that every kernel row / column pair starts at an even
    input row / column; R' = ceil((R + eh) / 2), padding ((pt + eh) / 2, (pl + ew) / 2, bottom / right so that P, Q
    are unchanged). Every output reads the same input values (or pad_value) against the same weights, and the zero
    taps add nothing: the integer sums, and so the outputs, are identical. The 7x7/2 stem on 224x224x4 becomes a
    4x4/1 conv on 112x112x16 whose im2col rows load as 16 cp.async of 16 bytes instead of 49 of 4 bytes."""
    cb = spec.C * spec.x_bits // 8
    if (spec.layout != "NHWC" or spec.x_bits != 8 or spec.strides != (2, 2) or spec.dilations != (1, 1)
            or spec.R * spec.S == 1 or cb % 16 == 0 or 4 * cb % 16):
        return None
    pt, pl, _, _ = spec.pads
    eh, ew = pt % 2, pl % 2
    R2, S2 = -(-(spec.R + eh) // 2), -(-(spec.S + ew) // 2)
    H2, W2 = -(-spec.H // 2), -(-spec.W // 2)
    pt2, pl2 = (pt + eh) // 2, (pl + ew) // 2
    pb2, pr2 = spec.P - 1 + R2 - H2 - pt2, spec.Q - 1 + S2 - W2 - pl2
    if pb2 < 0 or pr2 < 0:
        return None
    return spec.replace(H=H2, W=W2, C=4 * spec.C, R=R2, S=S2, stride=(1, 1), padding=(pt2, pl2, pb2, pr2))


def space_to_depth_weights(w, spec: ConvSpec):
    """OHWI weights of ``spec`` [K, R, S, C] -> those of ``space_to_depth(spec)`` [K, R', S', 4C] (NumPy)."""
    import numpy as np

    s2 = space_to_depth(spec)
    K, R, S, C = w.shape
    eh, ew = spec.pads[0] % 2, spec.pads[1] % 2
    wp = np.zeros((K, 2 * s2.R, 2 * s2.S, C), w.dtype)
    wp[:, eh:eh + R, ew:ew + S] = w
    return np.ascontiguousarray(wp.reshape(K, s2.R, 2, s2.S, 2, C).transpose(0, 1, 3, 2, 4, 5).reshape(K, s2.R, s2.S, 4 * C))


def space_to_depth_input(x, pad_value: int = 0):
    """NHWC input [N, H, W, C] -> [N, ceil(H/2), ceil(W/2), 4C] (NumPy; an odd H / W padded with ``pad_value``)."""
    import numpy as np

    N, H, W, C = x.shape
    H2, W2 = -(-H // 2), -(-W // 2)
    xp = np.full((N, 2 * H2, 2 * W2, C), pad_value, x.dtype)
    xp[:, :H, :W] = x
    return np.ascontiguousarray(xp.reshape(N, H2, 2, W2, 2, C).transpose(0, 1, 3, 2, 4, 5).reshape(N, H2, W2, 4 * C))


# ---------------------------------------------------------------------------------------------
# MMA shapes per architecture (a table, not branches).
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MMAShape:
    m: int
    n: int
    k: int
    a_bits: int  # operand width of the instruction

    @property
    def k_bytes(self):
        return self.k * self.a_bits // 8

    @property
    def ptx(self):
        return f"m{self.m}n{self.n}k{self.k}"


@dataclass(frozen=True)
class ArchMMA:
    arch: str
    s8: MMAShape
    s4: MMAShape  # the instruction 4-bit operands are fed to
    s4_native: bool  # False: 4-bit stored/moved packed, unpacked to s8 in registers (Hopper)
    smem_per_block: int = 48 * 1024
    has_cp_async: bool = True
    sms: int = 132  # SMs of the reference part (split-K sizing): T4 40, A100 108, A10/3090 84, L4 58, H100 132
    wgmma: bool = False  # warpgroup MMA from shared-memory descriptors (sm_90a: 8-bit m64nNk32)


MMA_SHAPES: dict[str, ArchMMA] = {
    "sm_75": ArchMMA("sm_75", MMAShape(8, 8, 16, 8), MMAShape(8, 8, 32, 4), True, 64 * 1024, False, 40),
    "sm_80": ArchMMA("sm_80", MMAShape(16, 8, 32, 8), MMAShape(16, 8, 64, 4), True, 163 * 1024, True, 108),
    "sm_86": ArchMMA("sm_86", MMAShape(16, 8, 32, 8), MMAShape(16, 8, 64, 4), True, 99 * 1024, True, 84),
    "sm_89": ArchMMA("sm_89", MMAShape(16, 8, 32, 8), MMAShape(16, 8, 64, 4), True, 99 * 1024, True, 58),
    # Hopper: s4 mma.sync is emulated (51 vs 1284 TOPS measured on our H100): unpack to s8.
    "sm_90": ArchMMA("sm_90", MMAShape(16, 8, 32, 8), MMAShape(16, 8, 32, 8), False, 227 * 1024, wgmma=True),
}


def arch_info(arch: str) -> ArchMMA:
    if arch in MMA_SHAPES:
        return MMA_SHAPES[arch]
    base = "sm_90" if arch.startswith("sm_9") else arch
    if base not in MMA_SHAPES:
        raise KeyError(f"no MMA table entry for {arch}")
    return MMA_SHAPES[base]


# ---------------------------------------------------------------------------------------------
# Knobs: the search space a tuner samples; defaults per architecture.
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GemmKnobs:
    BM: int = 128  # block tile rows (output pixels x batch)
    BN: int = 128  # block tile cols (output channels; wgmma: 96 / 112 too, where 128 leaves a wave of SMs part idle)
    BK: int = 64  # K-chunk in BYTES per pipeline stage (64 B = 64 int8 or 128 int4 elements)
    WM: int = 2  # warps along M
    WN: int = 2  # warps along N
    stages: int = 3  # shared-memory pipeline depth (cp.async multi-buffering when >= 2)
    vec: int = 16  # global load width in bytes (16/8/4 use cp.async; 2/1 use plain loads)
    ev: int = 8  # epilogue elements per thread per store
    pipe: int = 0  # mma.sync main loop: 0 = loads issued before the wait, two barriers per chunk; 1 = one barrier
    #                per K-chunk (the load of chunk k+STG-1 issued after it). Measured a wash on average (the log
    #                keeps whichever won per layer). wgmma: 1 + pipe MMA groups (K-chunks) in flight (-1: none, the
    #                loads run stages-1 chunks ahead)
    fdb: bool = False  # double-buffered fragments: ldmatrix of k-step s+1 issued before the MMAs of step s
    split_k: int = 0  # K split over blocks (schedules/splitk.py); 0 = auto (only where the grid is small)
    mma: str = "sync"  # "sync": warp mma.sync (WM x WN warps); "wgmma": warpgroup wgmma.mma_async (sm_90a; WM x WN
    #                    warpgroups of 128 threads, each a (BM/WM) x (BN/WN) tile, rows a multiple of 64; 4-bit
    #                    tiles are unpacked to 8-bit on their way into shared memory, BK counts packed bytes)
    pstages: int = 0  # 4-bit wgmma tiles: 0 = packed vectors loaded into registers one chunk ahead; n > 0 = an
    #                   n-deep ring of packed tiles filled by cp.async, each thread unpacking the vectors it copied
    areg: bool = False  # 4-bit wgmma with pstages >= 2, pipe -1 or 0: the A tile stays packed in shared memory and is
    #                     unpacked into wgmma's register A operand (only the B tile is stored unpacked)
    minb: int = 0  # __launch_bounds__ minimum blocks per SM (nvcc caps registers to fit them); 0 = none
    wsp: int = 0  # 4-bit wgmma, warp-specialized: wsp extra producer warpgroups fill a pstages-deep packed ring
    #               (cp.async) and unpack A and B into the ``stages`` shared stages (named barriers full/empty per
    #               stage); the WM x WN consumer warpgroups only wait, issue wgmma and run the epilogue
    awarp: bool = False  # areg with pipe -1 and one warpgroup along N: each warp copies the packed A rows its own
    #                      fragments read, so chunk kc+1's fragments are loaded (after a __syncwarp, no block barrier)
    #                      into a second register set while chunk kc's MMAs run, off the barrier-to-MMA path
    erq: bool = False  # requantize in the accumulator registers and stage the 8-bit intermediate (not int32) through
    #                    shared memory: a quarter of the epilogue's shared traffic and staging tile (where the
    #                    intermediate does not fit 8 bits, or split-K, the int32 staging runs: same bits)
    persist: int = 0  # wgmma: a persistent grid of persist x SMs blocks walking the output tiles; the K-chunk
    #                   stream runs on across tiles, so the next tile's loads are in flight during a tile's epilogue
    #                   (staging tile beside the ring instead of on it); 8-bit operands, or the 4-bit register-A
    #                   loader with w8 and awarp; 0 = one block per tile (also what split-K pairs get)
    sk: int = 0  # 8-bit wgmma, stream-K: a grid of sk x SMs blocks splits the (tile, K-chunk) iterations evenly; a
    #              tile's later parts go to a workspace as int32 partials, counted per tile, and its owner (the block
    #              holding its first chunk) waits for them, sums and runs the epilogue -- one kernel where split-K
    #              needs two; exact, but no robust gain on ResNet-50 on the H100 (docs/SCHEDULES.md); 0 = off
    w8: bool = False  # 4-bit areg wgmma: the kernel takes the weights expanded to 8 bits at compile time (x16, in the
    #                   nibble-split k order: schedules.reference.expand_w4) and copies them into the swizzled B stages
    #                   with cp.async like 8-bit ones -- no B unpack in the kernel; the activations stay 4-bit in
    #                   memory and are unpacked into the register A operand (weights take 8 bits of storage instead of 4)
    agl: bool = False  # w8 + awarp, not persist, NHWC, K-chunks whole (R*S*C/2 % BK == 0): each thread loads its own
    #                    wgmma A fragments straight from global memory into a register ring pstages-1 chunks deep
    #                    (one 8/16-byte load per row and 16 packed bytes: the k order inside a K-chunk is permuted so
    #                    that a thread's words of every k-step are adjacent, and the expanded weights take the same
    #                    permutation: reference.expand_w4(w, kperm=BK)); no shared-memory round trip for A. Takes
    #                    pipe 0 too (one MMA group left in flight; three A-fragment register sets). On 8-bit operands
    #                    (with the same areg / awarp / w8 / pstages knobs; R*S*C % BK == 0): the same loader without
    #                    the unpack, the 8-bit weights k-permuted alike (reference.permute_k8); one m64 row block per
    #                    warpgroup keeps it within the registers (two spill). With pp (the register-A ping-pong):
    #                    A still through the shared ring, each thread reading its row bytes in agl's k order (one
    #                    8/16-byte ld.shared per row and chunk instead of one 4-byte load per k-step)
    pp: bool = False  # wgmma, "ping-pong": a persistent grid of one block per SM, each a producer warpgroup (cp.async
    #                   of the K-chunk stream into the ring, named barriers full/empty per stage) and two consumer
    #                   warpgroups taking the block's tiles in turn, each a whole BM x BN tile (WM = WN = 1): one
    #                   consumer's epilogue runs while the other's MMAs do (CUTLASS's ping-pong kernel). 8-bit
    #                   operands; 4-bit either with pstages >= 2 (no areg: the producer unpacks A and B from its
    #                   packed ring into the shared stages, like wsp; with w8 the expanded weights go straight into
    #                   the B stages and only A is unpacked, pstages >= stages - 1 - pipe) or as the register-A
    #                   kernel with w8 (areg, pipe -1 or 0, pstages == stages: the packed A chunk in the ring slot of
    #                   its B stage; each consumer reads and unpacks its own fragments, with pipe 0 into one of two
    #                   register sets while the previous chunk's MMAs run)

    SPACE = {
        "BM": (32, 64, 128, 256),
        "BN": (32, 64, 96, 112, 128, 256),
        "BK": (32, 64, 128, 256),
        "WM": (1, 2, 4),
        "WN": (1, 2, 4),
        "stages": (2, 3, 4, 5, 6, 7, 8),
        "vec": (16, 8, 4, 2, 1),
        "ev": (4, 8, 16),
        "pipe": (-1, 0, 1),
        "fdb": (False, True),
        "split_k": (0, 1, 2, 4, 8, 16),
        "mma": ("sync", "wgmma"),
        "pstages": (0, 2, 3, 4, 5, 6, 7, 8),
        "areg": (False, True),
        "minb": (0, 2, 3, 4),
        "awarp": (False, True),
        "wsp": (0, 1, 2),
        "erq": (False, True),
        "persist": (0, 1, 2),
        "sk": (0, 1, 2),
        "w8": (False, True),
        "agl": (False, True),
        "pp": (False, True),
    }

    def replace(self, **kw) -> "GemmKnobs":
        return dataclasses.replace(self, **kw)

    @property
    def threads(self) -> int:
        if self.pp:  # two consumer warpgroups and the producer
            return 384
        return (128 if self.mma == "wgmma" else 32) * self.WM * self.WN + 128 * self.wsp

    @property
    def load_threads(self) -> int:
        """Threads that load the tiles (wsp, pp: the producer warpgroups)."""
        nprod = self.wsp or int(self.pp)
        return 128 * nprod if nprod else self.threads

    def valid(self) -> bool:
        return self.why_invalid() is None

    def why_invalid(self) -> str | None:
        """None where the knobs are valid together (independently of a shape), else the first rule they break."""
        for ok, why in self._rules():
            if not ok:
                return why
        return None

    def _rules(self):
        """(holds, the rule) pairs; every one must hold."""
        wtm, wtn = self.BM // self.WM, self.BN // self.WN
        yield self.BM % self.WM == 0 and self.BN % self.WN == 0, f"BM {self.BM} / WM {self.WM} and BN {self.BN} / " \
                                                                  f"WN {self.WN} must divide"
        if self.mma == "wgmma":  # warpgroup tiles: 64-row multiples, one m64nN instruction per 128 (or fewer) cols
            # (N per warpgroup: one m64nN instruction up to 128 columns -- 96 / 112 for the tile counts of narrow grids
            # -- or 256 as two of 128)
            yield wtm % 64 == 0, f"wgmma: a warpgroup tile of {wtm} rows is no multiple of 64"
            yield wtn in (64, 96, 112, 128, 256), f"wgmma: a warpgroup tile {wtn} wide (64, 96, 112, 128 or 256)"
            yield self.vec == 16, "wgmma: vec 16"
            yield (16 * wtn) % (32 * self.ev) == 0, f"epilogue: ev {self.ev} does not divide the {wtn}-wide tile rows"
            yield self.stages >= 3 + self.pipe, "wgmma: stages >= 3 + pipe"
            yield (not self.areg or (self.pstages >= 2 and self.pipe in (-1, 0))), \
                "areg needs pstages >= 2 and pipe -1 or 0"
            yield (not self.awarp or (self.areg and self.WN == 1 and (self.pipe == -1 or (self.agl and self.pipe == 0)))), \
                "awarp needs areg, WN 1 and pipe -1 (agl: or 0)"
            yield (not self.w8 or (self.areg and not self.pp and self.stages >= self.pstages + 1 + self.pipe)
                   or (self.pp and self.areg and self.pstages == self.stages)
                   or (self.pp and not self.areg and self.pstages >= self.stages - 1 - self.pipe)), \
                "w8 needs areg with stages >= pstages + 1 + pipe, or ping-pong stages"
            yield (not self.agl or (self.w8 and self.awarp and not self.persist) or (self.pp and self.areg and self.w8)), \
                "agl needs w8 + awarp (no persist) or the register-A ping-pong"
            yield (not self.wsp or (not self.areg and self.pstages >= 2 and self.stages >= 2 and self.pipe in (-1, 0))), \
                "wsp needs pstages >= 2, stages >= 2, pipe -1 or 0, no areg"
            yield (not self.sk or (self.pstages == 0 and not self.areg and not self.wsp)), \
                "stream-K (sk) takes 8-bit tiles only (no pstages, areg, wsp)"
            yield (not self.persist or (self.pstages == 0 and not self.areg and not self.wsp) or (self.w8 and self.awarp)), \
                "persist takes 8-bit tiles (no pstages, areg, wsp) or w8 + awarp"
            yield not (self.persist and self.sk) and (not self.sk or self.split_k in (0, 1)), \
                "stream-K (sk) takes no persist and no split-K"
            yield (not self.pp or (self.WM == 1 and self.WN == 1 and not self.wsp and not self.persist
                                   and not self.sk and (not self.agl or self.areg) and self.split_k in (0, 1)
                                   and self.stages <= 5
                                   and (self.BK >= 64 or self.pstages > 0)  # (8-bit BK 32 hung, H100)
                                   and ((self.pstages == 0 and not self.areg)  # 8-bit
                                        or (self.pstages >= 2 and not self.areg and self.pipe in (-1, 0))
                                        or (self.areg and self.w8 and not self.awarp and self.pipe in (-1, 0)
                                            and self.pstages == self.stages)))), \
                "pp: one warpgroup tile (WM = WN = 1), stages <= 5, no wsp / persist / sk / split-K, 8-bit BK >= 64"
        else:
            yield wtm % 16 == 0 and wtn % 16 == 0, f"mma.sync: a {wtm}x{wtn} warp tile is no multiple of 16x16"
            yield self.pipe in (0, 1), "mma.sync: pipe 0 or 1"
            yield (self.pstages == 0 and not self.areg and not self.w8 and not self.awarp and not self.wsp
                   and not self.persist and not self.sk and not self.agl and not self.pp), \
                "mma.sync takes none of the wgmma loader knobs (pstages, areg, w8, awarp, wsp, persist, sk, agl, pp)"
        yield self.BK % 32 == 0, f"BK {self.BK} is no multiple of 32"
        yield self.whole_vectors(), "the tiles are no whole number of vectors per loading thread"
        yield self.threads <= 1024, f"{self.threads} threads per block (at most 1024)"

    def whole_vectors(self, bk: int | None = None) -> bool:
        """Whether every loading thread copies whole vectors of the A and B tiles of a K-chunk of ``bk`` (default BK)
        bytes (agl: B only, A goes straight into registers -- and B's 8-bit expansion is 2 bk bytes per row)."""
        bk, n = bk or self.BK, self.vec * self.load_threads
        if self.agl:
            return (self.BN * 2 * bk) % n == 0
        return (self.BM * bk) % n == 0 and (self.BN * bk) % n == 0

    @classmethod
    def sample(cls, rng, **fixed) -> "GemmKnobs":
        """Draw a valid random point (for a tuner)."""
        while True:
            kw = {k: rng.choice(v) for k, v in cls.SPACE.items()}
            kw.update(fixed)
            k = cls(**kw)
            if k.valid():
                return k


DEFAULT_KNOBS = {
    "sm_75": GemmKnobs(BM=128, BN=128, BK=64, WM=2, WN=2, stages=2),
    "sm_80": GemmKnobs(BM=128, BN=128, BK=64, WM=2, WN=2, stages=3),
    "sm_86": GemmKnobs(BM=128, BN=128, BK=64, WM=2, WN=2, stages=3),
    "sm_89": GemmKnobs(BM=128, BN=128, BK=64, WM=2, WN=2, stages=3),
    "sm_90": GemmKnobs(BM=128, BN=128, BK=64, WM=2, WN=2, stages=4),
}
# Untuned shapes on an arch with warpgroup MMA (no record for the shape, none for its layer at another batch size:
# tuning.nearest_knobs): wgmma tiles where the operands take them (NHWC, 16-byte channel vectors, zero padding) --
# the tiles most tuned records chose: 128x128 where the grid of them fills the SMs, 64x64 where it does not; 4-bit as
# the register-A kernel with its weights expanded to 8 bits, A read from the shared ring (the form of many tuned 4-bit
# records). Key: (operand bits, grid of 128x128 tiles >= SMs). BK counts bytes (4-bit: packed).
WGMMA_DEFAULT_KNOBS = {
    (8, True): GemmKnobs(BM=128, BN=128, BK=128, WM=2, WN=1, stages=3, pipe=-1, mma="wgmma"),
    (8, False): GemmKnobs(BM=64, BN=64, BK=128, WM=1, WN=1, stages=3, pipe=-1, mma="wgmma"),
    (4, True): GemmKnobs(BM=128, BN=128, BK=64, WM=2, WN=1, stages=4, pipe=-1, mma="wgmma", pstages=4, areg=True,
                         w8=True),
    (4, False): GemmKnobs(BM=64, BN=64, BK=64, WM=1, WN=1, stages=4, pipe=-1, mma="wgmma", pstages=4, areg=True,
                          w8=True),
}


def tile_grid(spec: ConvSpec, bm: int, bn: int) -> int:
    """Blocks of a ``bm x bn`` tiling of the conv's GEMM output (N*P*Q rows, K columns)."""
    return -(-spec.N * spec.P * spec.Q // bm) * -(-spec.K // bn)


def packed_weight_knobs(kn: GemmKnobs) -> GemmKnobs:
    """``kn`` for 4-bit weights kept packed (``qcompile --packed-int4-weights``): a ``w8`` / ``agl`` kernel becomes the
    register-A kernel that unpacks B itself (pipe -1 where ``agl`` had pipe 0, which warp-owned rows need); a ping-pong
    ``w8`` kernel the ping-pong kernel whose producer unpacks A and B (``pp`` without ``areg``)."""
    if not kn.w8:
        return kn
    k = kn.replace(w8=False, agl=False, areg=kn.areg and not kn.pp)
    return k if k.valid() else k.replace(pipe=-1)


def default_knobs(spec: ConvSpec, arch: str, sms: int | None = None) -> GemmKnobs:
    """Knobs for a shape no tuning record covers: WGMMA_DEFAULT_KNOBS where the arch has wgmma and the operands take
    it, else ``DEFAULT_KNOBS[arch]`` (mma.sync). Not adapted (the kernel builder shrinks tiles for small problems).
    ``sms``: the device's SM count (default: the arch table's)."""
    ai = arch_info(arch)
    if (ai.wgmma and spec.layout == "NHWC" and spec.pad_value == 0 and spec.C * spec.x_bits // 8 % 16 == 0
            and spec.x_bits in (4, 8)):
        return WGMMA_DEFAULT_KNOBS[(spec.x_bits, tile_grid(spec, 128, 128) >= (sms or ai.sms))]
    return DEFAULT_KNOBS.get(arch, DEFAULT_KNOBS["sm_90"])
