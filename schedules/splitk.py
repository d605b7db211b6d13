"""Split-K for GEMMs whose output tile grid cannot fill the GPU (batch 1-8, 14x14 and 7x7 layers).

With ``split`` > 1 a conv runs as two kernels:

  1. the tensor-core GEMM (``igemm.make_gemm_conv(..., allow_split=True)``), grid (N tiles, M tiles, split):
     block z reduces K-chunks [z*cps, min((z+1)*cps, NK)) and writes its int32 partial sums to
     ``ws[z, m, k]`` (no epilogue; INT4-on-Hopper partials are shifted back exactly, each is 256 x an integer);
  2. this module's epilogue kernel: ``acc[m, k] = sum_z ws[z, m, k]`` (int32, the same wrap-around as
     the single kernel), then exactly the single kernel's epilogue (ConvSpec: requantize, clip, the
     residual-add stage, cast/pack), one thread per output byte.

Integer addition is associative, so the result is bit-identical to the unsplit kernel.
"""
from __future__ import annotations

from tvm import te

from .fallback import epilogue_value, output_compute, residual_value
from .spec import ConvSpec, arch_info


def auto_split(spec: ConvSpec, arch: str, grid_blocks: int, n_chunks: int, sms: int | None = None) -> int:
    """Split factor for a grid of ``grid_blocks`` output tiles with ``n_chunks`` K-chunks each: 1 when the
    grid fills half the SMs; else the largest power of two <= 16 keeping the grid within two waves and at
    least 4 K-chunks per split. ``sms``: the device's SM count (default: the arch table's)."""
    sms = sms or arch_info(arch).sms
    if grid_blocks * 2 >= sms:
        return 1
    s = 1
    while s < 16 and grid_blocks * s * 2 <= 2 * sms and n_chunks // (s * 2) >= 4:
        s *= 2
    return s


def workspace_shape(spec: ConvSpec, split: int):
    M = spec.N * spec.P * spec.Q
    return (split, M, spec.K)


def make_splitk_epilogue(spec: ConvSpec, split: int, target_kind: str = "cuda", threads: int = 256):
    """PrimFunc (ws int32[split, M, K], bias, M, S, [res, rq2], [lut], out) -> out, ConvSpec's epilogue of sum_z ws
    (``plan_only``: a placeholder)."""
    from .planned import placeholder_kernel, planning_only

    if planning_only():
        return placeholder_kernel("splitk_epilogue")
    _, _, os_ = spec.shapes()
    K = spec.K
    ws = te.placeholder(workspace_shape(spec, split), "int32", name="ws")
    bias = te.placeholder((K,), "int32", name="bias")
    Mq = te.placeholder((K,), "int32", name="M")
    Sq = te.placeholder((K,), "int32", name="S")
    res = te.placeholder(spec.res_shape(), ConvSpec.storage(spec.res_dtype), name="res") if spec.has_residual else None
    rq2 = te.placeholder((5, K), "int32", name="rq2") if spec.has_residual else None
    d1, d2 = os_[1], os_[2]  # output rows are the GEMM rows m = (i0 * d1 + i1) * d2 + i2 in either layout
    z = te.reduce_axis((0, split), "z")
    acc = te.compute((os_[0], d1, d2, K), lambda a, b, c, k: te.sum(ws[z, (a * d1 + b) * d2 + c, k], axis=z),
                     name="acc")

    def y_f(a, b, c, k):
        return epilogue_value(spec, acc[a, b, c, k], k, bias, Mq, Sq, residual_value(spec, res, (a, b, c), k), rq2)

    y = te.compute(acc.shape, y_f, name="y")
    lut = te.placeholder((spec.lut,), ConvSpec.storage(spec.out_dtype), name="lut") if spec.lut else None
    if lut is not None:  # the output lookup table's entry of each final value (ConvSpec.lut)
        y0 = y
        y = te.compute(acc.shape, lambda a, b, c, k: lut[y0[a, b, c, k] - spec.lut_min].astype("int32"), name="y_lut")
    out = output_compute(spec, y, os_)
    args = [ws, bias, Mq, Sq] + ([res, rq2] if res is not None else []) + ([lut] if lut is not None else []) + [out]
    func = te.create_prim_func(args)
    if target_kind != "cuda":
        return func.with_attr("qcompile.strategy", "splitk_epilogue")
    from tvm import s_tir

    # 1. y inlined into out; 2. out's loops fused and bound one thread per output element;
    # 3. the split reduction computed per thread in registers
    sch = s_tir.Schedule(func)
    sch.compute_inline(sch.get_sblock("y"))
    if lut is not None:
        sch.compute_inline(sch.get_sblock("y_lut"))
    out_b = sch.get_sblock("out")
    fused = sch.fuse(*sch.get_loops(out_b))
    bx, tx = sch.split(fused, [None, threads])
    sch.bind(bx, "blockIdx.x")
    sch.bind(tx, "threadIdx.x")
    acc_b = sch.get_sblock("acc")
    sch.compute_at(acc_b, tx)
    sch.set_scope(acc_b, 0, "local")
    return sch.mod["main"].with_attr("qcompile.strategy", "splitk_epilogue")


__all__ = ["auto_split", "make_splitk_epilogue", "workspace_shape"]
