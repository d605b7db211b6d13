"""DispatchTensorCore on a CPU: the same rewrite, with the kernels' own TE compute (same epilogue, same
INT4 packing, same operand layouts) standing in for the CUDA kernels, must stay bit-exact."""
import numpy as np
import pytest
import tvm
from tvm import relax

from qcompile.errors import run_pass
from qcompile.pipeline import build, lower_to_integer
from qcompile.reference import Reference
from qcompile.relay_passes import DispatchTensorCore

from qdq_models import tiny_resnet_qdq


@pytest.mark.parametrize("bits", [(8, 8), (4, 4), (4, 8)])
@pytest.mark.parametrize("layout", ["NHWC", "HWNC"])
def test_dispatch_exact_on_cpu(bits, layout):
    mod, shape = tiny_resnet_qdq(seed=2, w_bits=bits[0], a_bits=bits[1])
    x = np.random.default_rng(9).standard_normal(shape).astype("float32")
    mi = lower_to_integer(mod, layout, pack_int4=False)
    p = DispatchTensorCore(target_kind="llvm")
    md = run_pass(p, mi)
    # every conv and the dense went to a kernel call; no relax conv2d/matmul is left
    assert [s for _, s in p.chosen] == ["te-compute"] * 4
    # the block's residual add (q_c2 + pool -> q_res) is the second epilogue stage of conv c2's kernel
    assert p.fused == [("q_c2", "q_res")]
    ops = [b.value.op.name for blk in md["main"].body.blocks for b in blk.bindings
           if isinstance(b.value, relax.Call) and hasattr(b.value.op, "name")]
    assert "relax.nn.conv2d" not in ops and "relax.matmul" not in ops
    assert ops.count("relax.right_shift") == 1  # the average pool's requantize is the only one left outside
    text = md.script(show_meta=False)
    assert "_cpad" in text  # the 3-channel stem is padded to 4 channels
    if bits[1] == 4:
        assert "_packed" in text  # 4-bit activations reach the kernels packed
    vm = relax.VirtualMachine(build(md, "llvm"), tvm.cpu())
    y = vm["main"](tvm.runtime.tensor(x)).numpy()
    assert np.array_equal(y, Reference(mi)(x))


def _stem_model(hw, zp=117, seed=5, k=16):
    """A 3-channel 7x7 stride-2 stem (the ResNet one), uint8 input with zero point ``zp`` (the padding reads it)."""
    from qcompile.qdq import QDQBuilder, qtype

    rng = np.random.default_rng(seed)
    b = QDQBuilder()
    x = b.input("x", (2, 3) + hw)
    u8, s8 = qtype(8, False), qtype(8, True)
    d0 = b.dequantize(b.quantize(x, 0.03, zp, u8, name="q_in"), 0.03, zp)
    w = b.qweight(rng.integers(-127, 128, (k, 3, 7, 7)), np.full(k, 2e-3), s8, name="w")
    h = b.relu(b.conv2d(d0, w, b.qbias(rng.integers(-999, 999, k), 6e-5, "bias"), (2, 2), (3, 3, 3, 3), name="stem"))
    return b.finish([b.dequantize(b.quantize(h, 0.02, 0, u8, name="q_stem"), 0.02, 0, name="out")])


@pytest.mark.parametrize("hw", [(13, 13), (12, 15)])
def test_dispatch_space_to_depth_stem_exact_on_cpu(hw):
    """The stem as CUDA builds run it (4x4 stride-1 conv over the 2x2 space-to-depth input, 16 channels), forced on
    the CPU kernels: bit-exact against the integer reference, odd sizes (pad-value row / column) included."""
    mi = lower_to_integer(_stem_model(hw), "NHWC", pack_int4=False)
    p = DispatchTensorCore(target_kind="llvm", space_to_depth=True)
    md = run_pass(p, mi)
    assert p.chosen == [("q_stem", "te-compute+s2d")]
    text = md["main"].script(show_meta=False)
    assert f'R.Tensor((2, {(hw[0] + 1) // 2}, {(hw[1] + 1) // 2}, 16), dtype="uint8")' in text
    assert ("_s2dpad" in text) == (hw[0] % 2 or hw[1] % 2)
    x = np.random.default_rng(8).standard_normal((2, 3) + hw).astype("float32") * 2
    vm = relax.VirtualMachine(build(md, "llvm"), tvm.cpu())
    y = vm["main"](tvm.runtime.tensor(x)).numpy()
    assert np.array_equal(y, Reference(mi)(x)) and y.std() > 0


def test_dispatch_cuda_space_to_depth_stem():
    """On CUDA (IR only) the stem's kernel is the 16-channel 4x4 stride-1 conv; CPU builds keep the 7x7 one. With
    ResNet's 64 output channels it is the direct kernel from a shared-memory halo tile (schedules/stem.py), with 16
    the implicit GEMM."""
    p = DispatchTensorCore("sm_90")
    run_pass(p, lower_to_integer(_stem_model((224, 224), k=64), "NHWC", pack_int4=False))
    assert p.chosen == [("q_stem", "direct_halo+s2d")]
    mi = lower_to_integer(_stem_model((224, 224)), "NHWC", pack_int4=False)
    p = DispatchTensorCore("sm_90")
    md = run_pass(p, mi)
    assert p.chosen == [("q_stem", "implicit_gemm+s2d")]
    assert 'q_stem_s2d: R.Tensor((2, 112, 112, 16), dtype="uint8")' in md["main"].script(show_meta=False)
    assert [c.shape for c in _constants(md["main"]) if c.ndim == 4] == [(16, 4, 4, 16)]
    p = DispatchTensorCore(target_kind="llvm")
    run_pass(p, mi)
    assert p.chosen == [("q_stem", "te-compute")]


def test_dispatch_cuda_splits_small_grids_and_fuses_the_residual():
    """On CUDA (IR only, no nvcc): a 7x7 batch-1 conv with a long reduction runs as a split-K pair (partial
    sums, then the epilogue kernel), and the residual add after it is that epilogue's second stage."""
    from qcompile.qdq import QDQBuilder, qtype

    rng = np.random.default_rng(3)
    b = QDQBuilder()
    x = b.input("x", (1, 256, 7, 7))
    u8, s8 = qtype(8, False), qtype(8, True)
    q0 = b.quantize(x, 0.02, 0, u8, name="q_in")
    d0 = b.dequantize(q0, 0.02, 0)
    w = b.qweight(rng.integers(-127, 128, (256, 256, 3, 3)), np.full(256, 1e-3), s8, name="w")
    h = b.conv2d(d0, w, b.qbias(rng.integers(-99, 99, 256), 2e-5, "bias"), (1, 1), (1, 1, 1, 1), name="conv")
    q1 = b.quantize(h, 0.05, 0, s8, name="q_conv")
    s = b.relu(b.add(b.dequantize(q1, 0.05, 0), d0, name="res"))
    q2 = b.quantize(s, 0.05, 0, u8, name="q_res")
    mod = b.finish([b.dequantize(q2, 0.05, 0, name="out")])
    mi = lower_to_integer(mod, "NHWC", pack_int4=False)
    p = DispatchTensorCore("sm_90")
    md = run_pass(p, mi)
    assert p.fused == [("q_conv", "q_res")]
    (name, strategy), = p.chosen
    assert strategy.startswith("implicit_gemm+splitk")
    funcs = {gv.name_hint: f for gv, f in md.functions.items() if isinstance(f, tvm.tirx.PrimFunc)}
    assert "qconv_q_conv_resadd" in funcs and "qconv_q_conv_resadd_splitk_epilogue" in funcs
    split = int(funcs["qconv_q_conv_resadd"].attrs["qcompile.split_k"])
    # the partial kernel's workspace is [split, M, K] int32; the epilogue takes ws, bias, M, S, res, rq2 -> out
    text = md["main"].script(show_meta=False)
    assert f"R.Tensor(({split}, 49, 256), dtype=\"int32\")" in text
    assert len(funcs["qconv_q_conv_resadd_splitk_epilogue"].params) == 7


def test_dispatch_cuda_stream_k(monkeypatch):
    """A stream-K kernel (GemmKnobs.sk, from the tuning log) gets its tile counters as a zero constant (state the kernel
    leaves zero, kept in the .so when the weights are lifted) and its workspace as a second output of the call."""
    import qcompile.schedules as S
    from qcompile.qdq import QDQBuilder, qtype
    from qcompile.relay_passes.lift_weights import LiftWeights
    from qcompile.schedules import GemmKnobs

    kn = GemmKnobs(BM=128, BN=128, BK=128, WM=2, WN=1, stages=3, mma="wgmma", pipe=-1, sk=1)
    monkeypatch.setattr(S, "knobs_for", lambda spec, arch, *_, **__: (kn, "arch"))
    rng = np.random.default_rng(4)
    b = QDQBuilder()
    x = b.input("x", (8, 512, 7, 7))
    u8, s8 = qtype(8, False), qtype(8, True)
    d0 = b.dequantize(b.quantize(x, 0.02, 0, u8, name="q_in"), 0.02, 0)
    w = b.qweight(rng.integers(-127, 128, (512, 512, 3, 3)), np.full(512, 1e-3), s8, name="w")
    h = b.relu(b.conv2d(d0, w, b.qbias(rng.integers(-99, 99, 512), 2e-5, "bias"), (1, 1), (1, 1, 1, 1), name="conv"))
    mod = b.finish([b.dequantize(b.quantize(h, 0.05, 0, u8, name="q_conv"), 0.05, 0, name="out")])
    mi = lower_to_integer(mod, "NHWC", pack_int4=False)
    p = DispatchTensorCore("sm_90")
    md = run_pass(p, mi)
    (_, strategy), = p.chosen
    assert strategy == "implicit_gemm+streamk"  # (no split-K pair: stream-K fills the GPU itself)
    f = md["qconv_q_conv"]
    ntiles, words = (int(v) for v in f.attrs["qcompile.streamk"])
    assert ntiles == (8 * 7 * 7 // 128 + 1) * (512 // 128) and [p.name for p in f.params][-3:] == ["skc", "out", "skw"]
    text = md["main"].script(show_meta=False)
    assert f'R.Tensor(({words},), dtype="int32")' in text  # the workspace: the call's second output
    counters = [c for c in _constants(md["main"]) if c.shape == (ntiles,) and c.dtype == np.int32]
    assert len(counters) == 1 and not counters[0].any()
    lift = LiftWeights(min_bytes=64)
    lifted = run_pass(lift, md)
    assert all(v.shape != (ntiles,) for v in lift.values) and len(lift.values) >= 1  # counters stay; weights go
    assert len([c for c in _constants(lifted["main"]) if c.shape == (ntiles,)]) == 1


def _constants(func):
    out = []
    from tvm.ir.expr import Constant

    relax.analysis.post_order_visit(func, lambda e: out.append(e.value.numpy())
                                    if isinstance(e, Constant) and hasattr(e.value, "numpy") else None)
    return out


@pytest.mark.nvcc
def test_dispatch_pools_cuda():
    """On CUDA (IR only) the 8-bit NHWC max pool runs qcompile's pool kernel (4-channel SIMD max on 32-bit words,
    16-byte loads); an NCHW graph keeps the Relax op (legalized, scheduled by the glue rules)."""
    from qcompile.relay_passes import DispatchPools
    from qcompile.schedules.build import build_cuda, cuda_source
    from qcompile.schedules.pool import max_pool_nhwc_kernel

    mod, _ = tiny_resnet_qdq(seed=2, w_bits=8, a_bits=8)
    p = DispatchPools()
    md = run_pass(p, run_pass(DispatchTensorCore("sm_90"), lower_to_integer(mod, "NHWC", pack_int4=False)))
    assert p.replaced == [((2, 12, 12, 8), "uint8", (3, 3), (2, 2), (1, 1, 1, 1))]
    assert "R.nn.max_pool2d" not in md["main"].script(show_meta=False)
    assert "qpool_max_0" in {gv.name_hint for gv in md.get_global_vars()}
    relax.transform.RewriteDataflowReshape()(md)  # (TVM's CUDA pipeline inspects single-input calls: a root block)
    p = DispatchPools()
    run_pass(p, lower_to_integer(mod, "NCHW", pack_int4=False))
    assert p.replaced == []
    # 16 channels per thread (one 16-byte load per window position) where that leaves >= 32768 threads, else 4
    for N, dtype, C, ins, v16 in ((256, "uint8", 64, "__vmaxu4", True), (2, "uint8", 64, "__vmaxu4", False),
                                  (256, "int8", 8, "__vmaxs4", False)):
        f = max_pool_nhwc_kernel(N, 15, 15, C, dtype).with_attr("global_symbol", "mp")
        src = cuda_source(build_cuda(f, "sm_90", mode="ptx"))
        assert ins in src and ("*(uint4*)(xw_ptr" in src) == v16


def test_dispatch_packed_4bit_pool_cuda():
    """INT4 model on CUDA (IR only): the stem kernel writes its 4-bit output packed, the max pool runs on the packed
    bytes (``qpool_max4``: even and odd nibbles reduced apart) and the convs after it -- data and residual operand
    -- take its packed output as it is: no unpack before the pool, no pack kernel after it. The CPU dispatch (no
    such pool kernel) and 8-bit models keep the pool on unpacked bytes."""
    from qcompile.relay_passes import DispatchPools

    mod, _ = tiny_resnet_qdq(seed=2, w_bits=4, a_bits=4)
    p, q = DispatchTensorCore("sm_90"), DispatchPools()
    md = run_pass(q, run_pass(p, lower_to_integer(mod, "NHWC", pack_int4=False)))
    assert p.pooled4 == [((2, 12, 12, 8), "uint8", (3, 3), (2, 2), (1, 1, 1, 1))] and q.replaced == []
    main = md["main"].script(show_meta=False)
    assert "R.nn.max_pool2d" not in main and "strided_slice" not in main and "bitwise" not in main
    assert "R.call_tir(qpool_max4_0, (q_stem_tc,), out_ty=R.Tensor((2, 6, 6, 4), dtype=\"uint8\"))" in main
    assert "R.call_tir(qconv_q_c1, (pool_packed," in main and ", pool_packed, " in main  # (the residual too)
    stem = [ln for ln in main.splitlines() if "q_stem_tc = R.call_tir(" in ln]
    assert len(stem) == 1 and stem[0].endswith('out_ty=R.Tensor((2, 12, 12, 4), dtype="uint8"))')  # (8 channels packed)
    mod8, _ = tiny_resnet_qdq(seed=2, w_bits=8, a_bits=8)
    p8 = DispatchTensorCore("sm_90")
    run_pass(p8, lower_to_integer(mod8, "NHWC", pack_int4=False))
    pc = DispatchTensorCore("sm_90", target_kind="llvm")
    run_pass(pc, lower_to_integer(mod, "NHWC", pack_int4=False))
    assert p8.pooled4 == [] and pc.pooled4 == []


def _one_conv(bits: int, seed: int):
    """A QDQ model of one 3x3 conv (64 -> 64 channels, batch 8, 14x14) with ``bits``-bit unsigned activations and signed
    weights, lowered to integer NHWC (4-bit: unpacked); returns (module, the weights' values [K, C, R, S]). The weights
    follow a pattern, so the tests can write parts of the buffers the kernels take out by hand: w[k, c, r, s] =
    (c + 16 k + 3 r + s) wrapped into the signed range (4-bit: ``(c + k + 3 r + s) % 16 - 8``)."""
    from qcompile.qdq import QDQBuilder, qtype

    rng = np.random.default_rng(seed)
    k, c, r, s = np.meshgrid(*(np.arange(n) for n in (64, 64, 3, 3)), indexing="ij")
    wv = (c + k + 3 * r + s) % 16 - 8 if bits == 4 else (c + 16 * k + 3 * r + s + 128) % 256 - 128
    b = QDQBuilder()
    x = b.input("x", (8, 64, 14, 14))
    ua, sw = qtype(bits, False), qtype(bits, True)
    ws = 1e-2 if bits == 4 else 1e-3
    d0 = b.dequantize(b.quantize(x, 0.02, 0, ua, name="q_in"), 0.02, 0)
    w = b.qweight(wv, np.full(64, ws), sw, name="w")
    h = b.relu(b.conv2d(d0, w, b.qbias(rng.integers(-99, 99, 64), 0.02 * ws, "bias"), (1, 1), (1, 1, 1, 1), name="conv"))
    mod = b.finish([b.dequantize(b.quantize(h, 0.05, 0, ua, name="q_conv"), 0.05, 0, name="out")])
    return lower_to_integer(mod, "NHWC", pack_int4=False), wv


def test_dispatch_cuda_int4_weights_expanded_for_w8_kernels(monkeypatch):
    """A 4-bit conv whose tuned knobs take the weights expanded (GemmKnobs.w8) gets them as the int8 constant
    ``expand_w4(w)`` ([K, R, S, C], x16, nibble-split order); the same conv without w8, or with w8 and
    ``expand_w4=False``, gets them packed ([K, R, S, C/2]) and a kernel that unpacks them."""
    import qcompile.schedules as S
    from qcompile.schedules import GemmKnobs
    from qcompile import int4
    from qcompile.schedules.reference import expand_w4

    mi, wv = _one_conv(4, 5)
    ohwi = np.transpose(wv, (0, 2, 3, 1))
    # by hand: output channel 0, tap (0, 0) holds c % 16 - 8, so expanded (x16, per 32 channels the 16 even values,
    # then the 16 odd ones) and packed (element 2i in the low nibble); channel 1, tap (0, 1): (c + 2) % 16 - 8
    ev, od = [-128, -96, -64, -32, 0, 32, 64, 96] * 2, [-112, -80, -48, -16, 16, 48, 80, 112] * 2
    ev1, od1 = [-96, -64, -32, 0, 32, 64, 96, -128] * 2, [-80, -48, -16, 16, 48, 80, 112, -112] * 2
    lit_w8 = {(0, 0, 0): (ev + od) * 2, (1, 0, 1): (ev1 + od1) * 2}
    lit_packed = {(0, 0, 0): [-104, -70, -36, -2, 16, 50, 84, 118] * 4}  # 0x98 0xBA 0xDC 0xFE 0x10 0x32 0x54 0x76
    aw = GemmKnobs(BM=128, BN=64, BK=64, WM=1, WN=1, stages=3, mma="wgmma", pipe=-1, pstages=3, areg=True, awarp=True)
    packed = int4.pack(ohwi).view(np.int8)
    # (the record's knobs, DispatchTensorCore's expand_w4 -- False: `qcompile --packed-int4-weights`, the weights)
    for w8, expand, want in ((True, True, expand_w4(ohwi)), (False, True, packed), (True, False, packed)):
        monkeypatch.setattr(S, "knobs_for", lambda spec, arch, *_, kn=aw.replace(w8=w8), **__: (kn, "arch"))
        md = run_pass(DispatchTensorCore("sm_90", expand_w4=expand), mi)
        f = md["qconv_q_conv"]
        assert ("qcompile.w8" in f.attrs) == (w8 and expand)
        assert str(f.attrs["qcompile.knobs_source"]) == "arch"  # (packed: the record's knobs in their packed form)
        assert "w: T.Buffer((%s), \"int8\")" % ", ".join(map(str, want.shape)) in f.script()
        ws = [c for c in _constants(md["main"]) if c.dtype == np.int8 and c.shape == want.shape]
        assert len(ws) == 1 and np.array_equal(ws[0], want)
        for idx, row in (lit_w8 if w8 and expand else lit_packed).items():
            assert ws[0][idx].tolist() == row, idx


def test_dispatch_cuda_int8_weights_kpermuted_for_agl_kernels(monkeypatch):
    """An 8-bit conv whose tuned knobs load A straight into registers (GemmKnobs.agl on 8-bit operands) gets its weights
    as the int8 constant ``permute_k8(w, BK)`` ([K, R, S, C], the reduction k-permuted per K-chunk) and a kernel that
    says so (w8_kperm); the same knobs without agl, and ``expand_w4=False`` (a 4-bit option) with them, leave
    ``permute_k8`` to agl alone: the plain [K, R, S, C] weights, resp. the permuted ones."""
    import qcompile.schedules as S
    from qcompile.schedules import GemmKnobs
    from qcompile.schedules.igemm import w8_kperm
    from qcompile.schedules.reference import permute_k8

    mi, wv = _one_conv(8, 6)
    ohwi = np.transpose(wv, (0, 2, 3, 1)).astype(np.int8)
    agl = GemmKnobs(BM=64, BN=64, BK=64, WM=1, WN=1, stages=3, mma="wgmma", pipe=-1, pstages=3, areg=True,
                    awarp=True, w8=True, agl=True)
    assert not np.array_equal(permute_k8(ohwi, 64), ohwi)
    # by hand: output channel 0's first 64-byte chunk (tap (0, 0), w = c): out word 8 ks + 4 h + q = word 4 q + 2 ks + h,
    # 16-bit halves swapped; without agl the plain values
    lit_k64 = [2, 3, 0, 1, 18, 19, 16, 17, 34, 35, 32, 33, 50, 51, 48, 49, 6, 7, 4, 5, 22, 23, 20, 21, 38, 39, 36, 37,
               54, 55, 52, 53, 10, 11, 8, 9, 26, 27, 24, 25, 42, 43, 40, 41, 58, 59, 56, 57, 14, 15, 12, 13, 30, 31,
               28, 29, 46, 47, 44, 45, 62, 63, 60, 61]
    for kn, expand, want, kp in ((agl, True, permute_k8(ohwi, 64), 64), (agl.replace(agl=False), True, ohwi, 0),
                                 (agl, False, permute_k8(ohwi, 64), 64)):
        monkeypatch.setattr(S, "knobs_for", lambda spec, arch, *_, kn=kn, **__: (kn, "arch"))
        md = run_pass(DispatchTensorCore("sm_90", expand_w4=expand), mi)
        f = md["qconv_q_conv"]
        assert w8_kperm(f) == kp and "qcompile.w8" not in f.attrs
        ws = [c for c in _constants(md["main"]) if c.dtype == np.int8 and c.shape == ohwi.shape]
        assert len(ws) == 1 and np.array_equal(ws[0], want)
        assert ws[0][0, 0, 0].tolist() == (lit_k64 if kp else list(range(64)))
