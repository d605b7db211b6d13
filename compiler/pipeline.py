"""The compilation pipeline: QDQ form -> integer Relax -> packed INT4 -> TVM executable.

    phase 1  frontend            ONNX QDQ / PT2E / HAWQ  ->  float NCHW graph with quantize/dequantize
    phase 2  integer lowering    LowerQDQToInteger(layout): int8/int4 conv/dense with int32 accumulation,
                                 fixed-point requantize, BN/bias/ReLU/residual folded, layout applied
    phase 3  bit packing         PackInt4: 4-bit weights and activations stored two per byte
    phase 4  backend             TVM's Relax pipeline for the target (legalize, fuse, schedule, codegen)

``QCOMPILE_DUMP_IR=dir`` (or ``dump_dir=``) writes the module after each phase.
"""
from __future__ import annotations

import os
from typing import Optional

import tvm
from tvm import relax

from qcompile.errors import run_pass
from qcompile.relay_passes import LowerQDQToInteger, PackInt4


def _dump(mod, dump_dir, name):
    if dump_dir:
        os.makedirs(dump_dir, exist_ok=True)
        with open(os.path.join(dump_dir, f"{name}.py"), "w") as f:
            f.write(mod.script(show_meta=False))


def integer_pipeline(layout: str = "NCHW", pack_int4: bool = True) -> tvm.transform.Pass:
    """Phases 2-3 as one Sequential."""
    passes = [
        # phase 2: QDQ -> integer compute, emitted in the target layout
        LowerQDQToInteger(layout),
    ]
    if pack_int4:
        # phase 3: 4-bit tensors two per byte, unpacked where consumed
        passes.append(PackInt4())
    return tvm.transform.Sequential(passes, name="qcompile.integer")


def lower_to_integer(mod_qdq: tvm.IRModule, layout: str = "NCHW", pack_int4: bool = True,
                     dump_dir: Optional[str] = None) -> tvm.IRModule:
    dump_dir = dump_dir or os.environ.get("QCOMPILE_DUMP_IR")
    _dump(mod_qdq, dump_dir, "1_qdq")
    with tvm.transform.PassContext(opt_level=3):
        mod = run_pass(LowerQDQToInteger(layout), mod_qdq)
        _dump(mod, dump_dir, "2_integer")
        if pack_int4:
            mod = run_pass(PackInt4(), mod)
            _dump(mod, dump_dir, "3_packed")
    return mod


def build(mod_int: tvm.IRModule, target="llvm", cuda_graph: bool = True):
    """Phase 4: TVM's Relax pipeline for ``target`` (a JSON-dict target); returns a VM executable.

    On CUDA the whole forward pass is captured once and replayed as a CUDA graph
    (``relax.backend.use_cuda_graph``), so batch-1 latency is not dominated by kernel launches.
    """
    tgt = tvm.target.Target(target if not isinstance(target, str) else {"kind": target})
    if tgt.kind.name != "cuda":
        with tvm.transform.PassContext(opt_level=3):
            return tvm.compile(mod_int, target=tgt)
    with tvm.transform.PassContext(opt_level=3, config={"relax.backend.use_cuda_graph": cuda_graph}):
        return tvm.compile(mod_int, target=tgt, relax_pipeline=cuda_pipeline(tgt))


def cuda_pipeline(target) -> tvm.transform.Pass:
    """TVM's CUDA Relax pipeline with qcompile's glue schedules tried before dlight's generic rules."""
    from tvm.relax.backend.cuda import pipeline as cp
    from tvm.s_tir import dlight as dl

    from qcompile.schedules.glue import ChannelsLastWindowReduction, GatherRowElementwise, VectorizedElementwise

    @tvm.transform.module_pass(opt_level=0, name="qcompile.cuda_pipeline")
    def _pipeline(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        with target:
            legalize = cp.legalize_passes(target)
            # the last legalize pass is dlight's ApplyDefaultSchedule: put our glue rules first (element-wise, pools)
            legalize[-1] = dl.ApplyDefaultSchedule(GatherRowElementwise(), VectorizedElementwise(),
                                                   ChannelsLastWindowReduction(),
                                                   dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(),
                                                   dl.gpu.GeneralReduction(), dl.gpu.Fallback())
            seq = tvm.transform.Sequential(cp.library_dispatch_passes(target) + legalize
                                           + cp.dataflow_lower_passes(target) + cp.finalize_passes(target))
            return seq(mod)

    return _pipeline
