"""The CPU integer conv2d kernel on Intel AMX-INT8 tiles (``cpu_direct_amx``), the requantize epilogue fused.

Same calling convention and math as :mod:`.cpu_conv` (``x, w, bias, M, S, [res, rq2], out``; the epilogue is
:func:`qcompile.schedules.fallback.epilogue_value`). The conv is a sum over taps (r, s) and channel chunks of
matrix products ``pixels x channels`` by ``channels x output channels``, each one AMX tile instruction:
``tdpbusd`` (unsigned activation bytes x signed weight bytes) for a uint8 input, ``tdpbssd`` (signed x signed) for
an int8 input -- so, unlike ``cpu_direct_vnni``'s ``vpdpbusd``, no input flip and no bias fold: the bias is the
graph's. Both add four byte products and the accumulator in int32, wrapping: the accumulators equal the conv's
exactly.

The weights are ``cpu_conv_vnni.prepack``'s int8 form with 16 lanes (the bias left as is)::

    w8[kb, r, s, c4, 4 j + i] = w[16 kb + j, r, s, 4 c4 + i]       (0 past K or C)

which is AMX's "VNNI" B-tile layout: row ``c4`` holds 4 input channels of 16 output channels, so the B tile of
channel chunk ``ch`` is ``kc / 4`` consecutive rows of 64 bytes.

The tile program (one :class:`AmxPlan` per layer; the test's NumPy emulation runs the same plan):

* tiles: ``mt x nt`` C tiles of ``m`` output pixels x 16 output channels (int32), ``mt`` A tiles of ``m`` pixels x
  ``kc`` input bytes, ``nt`` B tiles of ``kc / 4`` rows x 64 bytes -- at most 8 tile registers; the 64-byte tile
  configuration (palette 1; per tile its rows and bytes per row) is :meth:`AmxPlan.config`;
* a "run" is a sequence of output pixels whose input addresses are equally spaced: an output row (pixel ``q`` of
  row ``p`` reads padded position ``(p sh + r dh, q sw + s dw)``, rows ``sw * cpad`` bytes apart), or, for a 1x1
  stride-1 conv without padding, the whole image (``cpad`` bytes apart). An A tile is ``m`` consecutive pixels of a
  run at one tap and chunk, loaded straight from the (padded) input with that row stride.

Steps:

0. the prologue asks Linux for the AMX tile state (``syscall(SYS_arch_prctl = 158, ARCH_REQ_XCOMP_PERM = 0x1023,
   XFEATURE_XTILEDATA = 18)``, libc's ``syscall``; once per call of the kernel, a no-op once granted), so the
   .so needs no setup by its loader; a refusal (a kernel or CPU without AMX) stops the call with an error instead
   of an illegal instruction;
1. ``xp``: the input as bytes, padded once (``pad_value`` in the halo, 0 past C up to ``cpad``): step 1 of
   ``cpu_conv_vnni``, unflipped. An NHWC input without padding whose C is a multiple of the chunk is read in place;
2. the conv, parallel on TVM's thread pool: each task (batch, run, block of ``nt x 16`` output channels, group of
   ``bpt`` pixel blocks) loads the tile configuration (``ldtilecfg``: per thread) and, per block of ``mt x m``
   pixels, zeroes the C tiles, then for every tap (r, s) and chunk ``ch`` loads the A and B tiles
   (``tileloadd``) and issues the ``mt x nt`` tile products; it stores the C tiles to a small int32 buffer
   (``tilestored``), runs the epilogue on it, 16 channels at a time, and stores the output bytes (NHWC or NCHW);
   ``tilerelease`` ends the task.

A run whose length is not a multiple of the pixel block ends with a block shifted back onto the previous one (the
overlap is computed twice and stored with the same values); the same for the channel blocks.

Constraints:
    * the build target enables AMX-TILE and AMX-INT8, and AVX-512 VNNI and BW for the layers this kernel does not
      take (``schedules.cpu_conv.target_kernel``: e.g. ``llvm -mcpu=sapphirerapids``); Linux 5.16 or later (the
      permission request);
    * 8-bit activation storage (int8 / uint8; 4-bit values one per byte), 8-bit signed weights, int8 / uint8 / int32
      output, NCHW or NHWC (no packed 4-bit operands);
    * at least 16 output channels, C a multiple of 64 (full 64-byte tile rows) and 8-bit weights: other layers run
      ``cpu_direct_vnni`` (:func:`applies_amx`, the one check, used by the
      dispatcher);
    * ``acc + bias`` of the graph fits int32 (the dispatcher checks it).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import tvm
from tvm import tirx
from tvm.script import tirx as T

from .cpu_conv import applies, io_buffers, output_fns
from .cpu_conv_vnni import _fill_xp, prepack
from .spec import ConvSpec

STRATEGY = "cpu_direct_amx"
FALLBACK = "cpu_direct_vnni"   # the kernel of the layers this one does not take (and its weight packing)
TILES = 8                      # AMX tile registers
TILE_ROWS, TILE_BYTES = 16, 64  # a tile's most rows and bytes per row
LANES = 16                     # int32 output channels per C tile row
SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA = 158, 0x1023, 18


def _min(a, b):
    """min of two ints, or of PrimExprs (the plan's index expressions serve the TIR and the NumPy emulation)."""
    if isinstance(a, int) and isinstance(b, int):
        return min(a, b)
    return tirx.min(a, b)


def chunk_bytes(C: int) -> int:
    """The bytes per A-tile row: the largest multiple of 4 up to 64 that divides C rounded up to 4."""
    cpad = -(-C // 4) * 4
    return next(d for d in range(TILE_BYTES, 0, -4) if cpad % d == 0)


def applies_amx(spec: ConvSpec) -> str | None:
    """Why the AMX kernel does not take ``spec`` (None: it does): ``cpu_conv.applies``'s rules, groups 1, at least 16
    output channels, C a multiple of 64 and 8-bit weights. THE check, made by the builder and the dispatcher
    (``dispatch_cpu.layer_kernel``), whose refused layers run ``cpu_direct_vnni``."""
    why = applies(spec)
    if why is not None:
        return why
    if spec.groups != 1:
        return f"groups {spec.groups}"
    if spec.K < LANES:
        return f"{spec.K} output channels (a tile holds {LANES})"
    if spec.C % TILE_BYTES:
        return (f"{spec.C} input channels, not a multiple of {TILE_BYTES} (full {TILE_BYTES}-byte tile rows only: "
                "a 16-byte-chunk layer did not match the reference on AMX hardware)")
    if spec.w_bits != 8:
        return f"{spec.w_bits}-bit weights (8-bit weights only: a 4-bit layer did not match on AMX hardware)"
    return None


@dataclass(frozen=True)
class AmxPlan:
    """The tile program of one layer (the module docstring's names). Its index methods take ints or PrimExprs:
    the kernel and the NumPy emulation (tests/test_cpu_amx.py) compute every address from them."""

    N: int
    P: int
    Q: int
    K: int
    R: int
    S: int
    sh: int
    sw: int
    dh: int
    dw: int
    cpad: int      # bytes per pixel of the buffer the A tiles read (C in place, else xp's channels)
    kc: int        # bytes per A-tile row: a channel chunk
    m: int         # pixels per tile (rows of the A and C tiles)
    mt: int        # C tiles along the pixels
    nt: int        # C tiles along the output channels
    flat: bool     # a run is the whole image (1x1, stride 1, no padding), else one output row
    direct: bool   # the A tiles read x in place (NHWC, no padding, C a multiple of kc)
    bpt: int       # pixel blocks per task
    kb_outer: bool  # tasks walk the rows of one channel block (weights larger than the input)
    signed: bool   # int8 input: tdpbssd, else tdpbusd

    # ---- sizes ----------------------------------------------------------------------------------------------
    @property
    def run(self) -> int:
        return self.P * self.Q if self.flat else self.Q

    @property
    def runs(self) -> int:
        return 1 if self.flat else self.P

    @property
    def chunks(self) -> int:
        return self.cpad // self.kc

    @property
    def kb16(self) -> int:
        return -(-self.K // LANES)

    @property
    def block(self) -> int:
        return self.mt * self.m

    @property
    def n_pblk(self) -> int:
        return -(-self.run // self.block)

    @property
    def n_kblk(self) -> int:
        return -(-self.kb16 // self.nt)

    @property
    def n_grp(self) -> int:
        return -(-self.n_pblk // self.bpt)

    @property
    def tasks(self) -> int:
        return self.N * self.runs * self.n_kblk * self.n_grp

    # ---- tiles -----------------------------------------------------------------------------------------------
    def c_tile(self, mi, ni):
        return mi * self.nt + ni

    def a_tile(self, mi):
        return self.mt * self.nt + mi

    def b_tile(self, ni):
        return self.mt * self.nt + self.mt + ni

    def shapes(self) -> dict:
        """tile -> (rows, bytes per row)."""
        out = {}
        for mi in range(self.mt):
            out[self.a_tile(mi)] = (self.m, self.kc)
            for ni in range(self.nt):
                out[self.c_tile(mi, ni)] = (self.m, 4 * LANES)
        for ni in range(self.nt):
            out[self.b_tile(ni)] = (self.kc // 4, 4 * LANES)
        return out

    def config(self) -> bytes:
        """The 64-byte tile configuration: palette 1 (byte 0), start row 0 (byte 1), bytes per row of tile t as
        uint16 at 16 + 2 t, rows of tile t at 48 + t (0 for unused tiles)."""
        cfg = bytearray(64)
        cfg[0] = 1
        for t, (rows, colsb) in self.shapes().items():
            cfg[16 + 2 * t:18 + 2 * t] = colsb.to_bytes(2, "little")
            cfg[48 + t] = rows
        return bytes(cfg)

    # ---- strides (bytes) -------------------------------------------------------------------------------------
    @property
    def a_stride(self) -> int:
        return self.cpad if self.flat else self.sw * self.cpad

    b_stride = 4 * LANES

    @property
    def c_stride(self) -> int:
        return self.nt * 4 * LANES

    # ---- indices ---------------------------------------------------------------------------------------------
    def task_coords(self, task):
        """(n, run, channel block, pixel-block group) of a task."""
        inner = self.N * self.runs * self.n_grp
        if self.kb_outer:
            kblk, rest = task // inner, task % inner
        else:
            kblk, rest = task % self.n_kblk, task // self.n_kblk
        return rest // (self.runs * self.n_grp), rest // self.n_grp % self.runs, kblk, rest % self.n_grp

    def kblock_start(self, kblk):
        """The first 16-channel group of a channel block (the last one shifted back onto the one before it)."""
        return _min(kblk * self.nt, self.kb16 - self.nt)

    def block_start(self, blk):
        """The first pixel (index in the run) of a pixel block (the last one shifted back)."""
        return _min(blk * self.block, self.run - self.block)

    def pixel(self, run, j):
        """(p, q) of pixel ``j`` of a run."""
        return (j // self.Q, j % self.Q) if self.flat else (run, j)

    def a_index(self, n, run, j, r, s, ch):
        """The (n, h, w, c) element of the A source buffer (x in place, or xp) where an A tile's row of pixel ``j``
        at tap (r, s), chunk ``ch`` starts."""
        if self.flat:
            return n, j // self.Q, j % self.Q, ch * self.kc
        return n, run * self.sh + r * self.dh, j * self.sw + s * self.dw, ch * self.kc

    def b_index(self, kb, r, s, ch):
        """The (kb, r, s, c4, byte) element of ``w8`` where the B tile of chunk ``ch`` starts."""
        return kb, r, s, ch * (self.kc // 4), 0


def _pixel_tiles(run: int, nt: int) -> tuple:
    """(m, mt) for runs of ``run`` pixels: the least work per run and step by a simple count -- a tile product
    weighs 16, a tile load 8, whatever their rows (a model of their relative cost, not a measurement) --, then the
    least recomputed overlap, then more C tiles; ``mt x nt`` C tiles, ``mt`` A and ``nt`` B tiles within 8
    registers."""
    best = None
    for mt in range(1, 4):
        if mt * nt + mt + nt > TILES:
            continue
        for m in range(1, min(TILE_ROWS, run // mt) + 1):
            blocks = -(-run // (mt * m))
            key = (blocks * (16 * mt * nt + 8 * (mt + nt)), blocks * mt * m - run, -mt, -m)
            if best is None or key < best[0]:
                best = (key, m, mt)
    return best[1], best[2]


def make_plan(spec: ConvSpec, io_layout: str = "NHWC") -> AmxPlan:
    """The tile program of ``spec`` (NHWC geometry; x in ``io_layout``)."""
    why = applies_amx(spec)
    if why is not None:
        raise ValueError(f"cpu amx conv kernel: {why}")
    if io_layout not in ("NHWC", "NCHW"):
        raise ValueError(f"cpu amx conv kernel: layout {io_layout}")
    kc = chunk_bytes(spec.C)
    cpad = -(-spec.C // 4) * 4
    flat = spec.R == spec.S == 1 and spec.strides == (1, 1) and not any(spec.pads)
    direct = io_layout == "NHWC" and not any(spec.pads) and spec.C % kc == 0
    nt = min(2, -(-spec.K // LANES))
    run = spec.P * spec.Q if flat else spec.Q
    m, mt = _pixel_tiles(run, nt)
    n_pblk = -(-run // (mt * m))
    bpt = min(n_pblk, 4) if flat else n_pblk  # (a flat run: groups of 4 blocks a task, else the row)
    kb_outer = spec.K * spec.R * spec.S * spec.C > spec.N * spec.H * spec.W * spec.C
    return AmxPlan(spec.N, spec.P, spec.Q, spec.K, spec.R, spec.S, *spec.strides, *spec.dilations, cpad, kc, m, mt,
                   nt, flat, direct, bpt, kb_outer, ConvSpec.storage(spec.x_dtype) == "int8")


def prepack_amx(spec: ConvSpec, w: np.ndarray, bias: np.ndarray):
    """Logical weights [K, R, S, C] and bias [K] -> (int8 [ceil(K/16), R, S, ceil(C/4), 64]: the B tiles' rows,
    ``cpu_conv_vnni.prepack``'s 16-lane form; the bias as int32, unchanged: the tile products read the input as it
    is stored)."""
    return prepack(spec, w, bias, FALLBACK, flip=False)


def _cfg_word(words, i):
    """The int64 word ``i`` (a PrimExpr) of the configuration: a select chain the unrolled loop folds."""
    v = tirx.const(words[-1], "int64")
    for k in range(len(words) - 2, -1, -1):
        v = tirx.Select(i == k, tirx.const(words[k], "int64"), v)
    return v


def make_cpu_conv_amx(spec: ConvSpec, io_layout: str = "NHWC", plan: AmxPlan | None = None) -> tvm.tirx.PrimFunc:
    """The kernel for ``spec`` (its NHWC geometry; x, res and out in ``io_layout``, NHWC or NCHW); weights and bias
    from :func:`prepack_amx`; ``plan``: :func:`make_plan` by default."""
    pl = plan or make_plan(spec, io_layout)
    N, H, W, K, R, S_ = spec.N, spec.H, spec.W, spec.K, spec.R, spec.S
    pt, pleft, pb, pr = spec.pads
    Hp, Wp = H + pt + pb, W + pleft + pr
    C4, KB = pl.cpad // 4, pl.kb16
    nchw = io_layout == "NCHW"
    x_shape, o_shape, res_shape, (x_st, o_st, r_st) = io_buffers(spec, nchw)
    resid, whole_k = spec.has_residual, K % LANES == 0
    xfill = _fill_xp(spec, nchw, False)
    xp_shape = (1, 1, 1, 4) if pl.direct else (N, Hp, Wp, pl.cpad)
    words = [int.from_bytes(pl.config()[8 * i:8 * i + 8], "little", signed=True) for i in range(8)]
    dot = "llvm.x86.tdpbssd" if pl.signed else "llvm.x86.tdpbusd"
    mt, nt, m, CH, bpt, n_pblk = pl.mt, pl.nt, pl.m, pl.chunks, pl.bpt, pl.n_pblk
    tile = lambda t: T.int8(t)  # (an immediate once the unrolled loops are folded)

    def a_ptr(x, xp, n, run, j, r, s, ch):
        idx = pl.a_index(n, run, j, r, s, ch)
        return T.address_of(x[idx]) if pl.direct else T.address_of(xp[idx])

    out_index, epi = output_fns(spec, nchw)

    @T.prim_func(private=True)
    def kernel(x: T.Buffer(x_shape, x_st), w8: T.Buffer((KB, R, S_, C4, 4 * LANES), "int8"),
               bias: T.Buffer((K,), "int32"), M: T.Buffer((K,), "int32"), S: T.Buffer((K,), "int32"),
               res: T.Buffer(res_shape, r_st), rq2: T.Buffer((5, K), "int32"), out: T.Buffer(o_shape, o_st)):
        T.func_attr({"tirx.noalias": True})
        assert T.call_extern("int64", "syscall", T.int64(SYS_ARCH_PRCTL), T.int64(ARCH_REQ_XCOMP_PERM),
                             T.int64(XFEATURE_XTILEDATA)) == T.int64(0), (
            "cpu_direct_amx: Linux refused the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM): this CPU or kernel "
            "has no AMX; build for a target without amx-tile")
        xp = T.alloc_buffer(xp_shape, "uint8", scope="local" if pl.direct else "global")
        if not pl.direct and not nchw:
            for nh in T.parallel(N * Hp):
                for wp, c in T.grid(Wp, pl.cpad):
                    xp[nh // Hp, nh % Hp, wp, c] = xfill(x, nh // Hp, nh % Hp, wp, c)
        if nchw:  # (channel outer: the reads run along a row of x)
            for nh in T.parallel(N * Hp):
                for c, wp in T.grid(pl.cpad, Wp):
                    xp[nh // Hp, nh % Hp, wp, c] = xfill(x, nh // Hp, nh % Hp, wp, c)
        for task in T.parallel(pl.tasks):
            n = T.meta_var(pl.task_coords(task)[0])
            run = T.meta_var(pl.task_coords(task)[1])
            kb0 = T.meta_var(pl.kblock_start(pl.task_coords(task)[2]))
            grp = T.meta_var(pl.task_coords(task)[3])
            cfg = T.alloc_buffer((8,), "int64", scope="local")
            cb = T.alloc_buffer((mt * m, nt * LANES), "int32", scope="local")
            for i in T.unroll(8):
                cfg[i] = _cfg_word(words, i)
            T.evaluate(T.call_llvm_intrin("void", "llvm.x86.ldtilecfg", T.address_of(cfg[0])))
            for bi in range(bpt):
                if grp * bpt + bi < n_pblk:
                    j0 = T.meta_var(pl.block_start(grp * bpt + bi))
                    for t in T.unroll(mt * nt):
                        T.evaluate(T.call_llvm_intrin("void", "llvm.x86.tilezero", tile(t)))
                    for r, s, ch in T.grid(R, S_, CH):
                        for mi in T.unroll(mt):
                            T.evaluate(T.call_llvm_intrin(
                                "void", "llvm.x86.tileloadd64", tile(pl.a_tile(mi)),
                                a_ptr(x, xp, n, run, j0 + mi * m, r, s, ch), T.int64(pl.a_stride)))
                        for ni in T.unroll(nt):
                            T.evaluate(T.call_llvm_intrin(
                                "void", "llvm.x86.tileloadd64", tile(pl.b_tile(ni)),
                                T.address_of(w8[pl.b_index(kb0 + ni, r, s, ch)]), T.int64(pl.b_stride)))
                        for mi in T.unroll(mt):
                            for ni in T.unroll(nt):
                                T.evaluate(T.call_llvm_intrin("void", dot, tile(pl.c_tile(mi, ni)),
                                                              tile(pl.a_tile(mi)), tile(pl.b_tile(ni))))
                    for mi in T.unroll(mt):
                        for ni in T.unroll(nt):
                            T.evaluate(T.call_llvm_intrin(
                                "void", "llvm.x86.tilestored64", tile(pl.c_tile(mi, ni)),
                                T.address_of(cb[mi * m, ni * LANES]), T.int64(pl.c_stride)))
                    for i, ni in T.grid(mt * m, nt):
                        p = T.meta_var(pl.pixel(run, j0 + i)[0])
                        q = T.meta_var(pl.pixel(run, j0 + i)[1])
                        if whole_k:
                            for l in T.vectorized(LANES):
                                out[out_index(n, p, q, (kb0 + ni) * LANES + l)] = epi(
                                    cb[i, ni * LANES + l], (kb0 + ni) * LANES + l, bias, M, S, res, rq2, n, p, q)
                        else:
                            for l in range(LANES):
                                if (kb0 + ni) * LANES + l < K:
                                    out[out_index(n, p, q, (kb0 + ni) * LANES + l)] = epi(
                                        cb[i, ni * LANES + l], (kb0 + ni) * LANES + l, bias, M, S, res, rq2,
                                        n, p, q)
            T.evaluate(T.call_llvm_intrin("void", "llvm.x86.tilerelease"))

    f = kernel
    if not resid:  # drop the residual parameters
        f = tvm.tirx.PrimFunc([f.params[i] for i in (0, 1, 2, 3, 4, 7)], f.body, f.ret_type, f.attrs)
    return f.with_attr("qcompile.strategy", STRATEGY)
