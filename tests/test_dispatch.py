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
    ops = [b.value.op.name for blk in md["main"].body.blocks for b in blk.bindings
           if isinstance(b.value, relax.Call) and hasattr(b.value.op, "name")]
    assert "relax.nn.conv2d" not in ops and "relax.matmul" not in ops
    text = md.script(show_meta=False)
    assert "_cpad" in text  # the 3-channel stem is padded to 4 channels
    if bits[1] == 4:
        assert "_packed" in text  # 4-bit activations reach the kernels packed
    vm = relax.VirtualMachine(build(md, "llvm"), tvm.cpu())
    y = vm["main"](tvm.runtime.tensor(x)).numpy()
    assert np.array_equal(y, Reference(mi)(x))
