"""PT2E programs made by torchao's standard quantizers, as users run them (models/pt2e_quantizers.py), compile for llvm.

Each quantizer of ``QUANTIZERS`` (X86InductorQuantizer with its default config; XNNPACKQuantizer, symmetric
per-channel) on the example families (torchvision-shaped, BN unfolded, ReLU / ReLU6 = hardtanh; :data:`CASES`):
``torch.export`` -> ``prepare_pt2e`` -> calibrate -> ``convert_pt2e`` -> ``torch.export.save``; then ``qcompile``:

1. bit-exact against the NumPy integer reference on fresh random inputs;
2. within ONE output step of PyTorch's output of the converted program (the fake-quantized float graph). The step is
   the output dequantize's scale (XNNPACK quantizes the classifier's output); where the classifier's output is float
   (X86) it is one step of the classifier's quantized input carried through it, ``s_in * max_o sum_i |w_oi|``, and
   the pooled integers the classifier reads must be within one step of PyTorch's too. The two differ in rounding
   only: PyTorch computes in float32 and rounds ties to even; qcompile accumulates exactly in integers, adds a float
   bias in accumulator steps (``s_x * s_w``, rounded) and requantizes with 31-bit fixed-point multipliers, rounding
   ties up. A value moves by one step only where it lands within those errors of a rounding boundary, and later
   layers carry such a step on. The average pool divides a sum of integers by H*W, so exact ties are frequent there
   (1 in H*W values), and PyTorch's float32 mean decides them by its summation noise: the one-step comparison runs
   PyTorch's program with each pool's quantize deciding exact ties up (its value snapped to a multiple of 1/(H*W));
3. within one output step plus one carried step of the classifier's input of PyTorch's program as it is: one pooled
   value moved by a tie moves several outputs by a part of a step each.

The families: resnet_tiny, mobilenet_v2_tiny, mobilenet_v3_tiny (hardswish, hardsigmoid, squeeze-excitation),
efficientnet_tiny (SiLU, sigmoid) and densenet_tiny (concat, pre-activation BN, 2x2 average pool) with both
quantizers; with XNNPACKQuantizer (int8 activations with zero points, which pad grouped convs too) resnext_tiny
(grouped conv) and vgg_tiny (64x64: its five max pools leave 2x2). XNNPACKQuantizer quantizes every element-wise
function's input and output: each is a lookup table over the quantized input, exact in the QDQ float semantics.
X86InductorQuantizer applies those functions to a conv's float output, multiplies two such float values
(squeeze-excitation) and pools DenseNet's last BN + ReLU in float: the lowering requantizes each float value to a
grid of 2^16 steps over the inputs where the quantized output varies (a function: then a table over the grid) or of
2^15-2^23 steps over its whole range (a product's or a pool's operand), so a value within half a grid step of a
rounding boundary can land one step from PyTorch's. Its resnext_tiny compiles and passes the same checks (left out
of the cases to keep this file's time small; vgg_tiny: see below). :func:`test_x86_float_values_gpu_equal_llvm`
runs X86's MobileNetV3, EfficientNet and DenseNet on a GPU against their llvm builds.

vgg_tiny is compared with PyTorch with its float biases set to 0 (``ZERO_BIAS``): qcompile adds a float bias in whole
accumulator steps (``s_x * s_w``, rounded), a difference of up to half an accumulator step per output value that
moves about 1 in 1,000 values of the first conv by one step, and VGG's 13 convs carry and grow such steps (a moved
input value moves the 3x3 outputs around it): with its biases, 2-3 steps at the output (XNNPACK). With zero biases
(exact in accumulator steps) every layer equals PyTorch's on this file's inputs. A single step from float32 rounding
grows the same way: with X86InductorQuantizer one value in 16,384 of the 6th conv moves by one (seed 301) and the
pooled tensor ends 2 steps off, so vgg_tiny with X86 is not among the cases (its float output stays within 0.3
output steps). Bit-exactness against the NumPy reference does not depend on any of it.
"""
import functools
import logging
import warnings

import numpy as np
import pytest
import torch
import tvm
from tvm import relax

from qcompile.driver import CompileOptions, compile_model
from qcompile.errors import QCompileError
from qcompile.reference import Reference

pytestmark = pytest.mark.filterwarnings("ignore")
STANDARD = ("x86", "xnnpack")
SIZES = {"resnet_tiny": 32, "mobilenet_v2_tiny": 32, "resnext_tiny": 32, "vgg_tiny": 64, "mobilenet_v3_tiny": 16,
         "efficientnet_tiny": 16, "densenet_tiny": 16}
CASES = [(q, n) for n in ("resnet_tiny", "mobilenet_v2_tiny", "mobilenet_v3_tiny", "efficientnet_tiny", "densenet_tiny")
         for q in STANDARD] + [("xnnpack", n) for n in ("resnext_tiny", "vgg_tiny")]
ZERO_BIAS = {("xnnpack", "vgg_tiny")}  # compared with PyTorch with zero float biases (see the module docstring)


def _shape(net: str) -> tuple:
    return (2, 3, SIZES[net], SIZES[net])


def _quiet(*a):
    pass


@functools.lru_cache(maxsize=None)
def _program(quantizer: str, net: str, tmp: str):
    from qcompile.models.pt2e_quantizers import export_pt2e
    from qcompile.models.resnet import build_model

    logging.getLogger("torchao").setLevel(logging.ERROR)
    model = build_model(net, num_classes=10, seed=3)
    if (quantizer, net) in ZERO_BIAS:
        with torch.no_grad():
            for m in model.modules():
                if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear)) and m.bias is not None:
                    m.bias.zero_()
    shape = _shape(net)
    calib = torch.randn(16, *shape[1:], generator=torch.Generator().manual_seed(4))
    path = f"{tmp}/{net}_{quantizer}.pt2"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ep = export_pt2e(model, quantizer, path, torch.randn(shape), calib)
    return path, ep


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return str(tmp_path_factory.mktemp("pt2e_q"))


POOLS = ("adaptive_avg_pool2d", "mean")


def _pool_quantize_exact(window: int):
    """The quantize after an average pool whose input has the same scale (the standard quantizers share it): the
    pooled value in steps is a multiple of 1/window; snapped to it (undoing float32 noise) and rounded half up."""
    def quantize(v, scale, zero_point, quant_min, quant_max, dtype):
        r = torch.round(v.double() / float(scale) * window) / window
        return torch.clamp(torch.floor(r + 0.5) + int(zero_point), quant_min, quant_max).to(dtype)
    return quantize


_RECORDED: dict = {}


def _recording(name, fn):
    def quantize(*a):
        _RECORDED[name] = q = fn(*a)
        return q
    return quantize


class _NamedReference(Reference):
    """The NumPy integer reference, keeping every binding's value by its var name in ``named``."""

    def __call__(self, *inputs):
        env = {p: np.asarray(x) for p, x in zip(self.func.params, inputs)}
        self.named = {}
        for block in self.func.body.blocks:
            for b in block.bindings:
                env[b.var] = self.named[b.var.name] = self.eval(b.value, env)
        return self.eval(self.func.body.body, env)


def _pool_of(n):
    """The average pool a quantize node reads (directly or through a flatten), else None."""
    src = n.args[0] if n.args else None
    if src is not None and "flatten" in str(getattr(src, "target", "")):
        src = src.args[0]
    return src if src is not None and any(p in str(getattr(src, "target", "")) for p in POOLS) else None


def _pooled(ep) -> str:
    """The quantize of the last average pool: the pooled integers the classifier reads (its scale is the pool
    input's; later requantizes to other scales would count one step of it as several of theirs)."""
    return [n.name for n in ep.graph.nodes if "quantized_decomposed.quantize_per_tensor" in str(n.target)
            and _pool_of(n) is not None][-1]


def _run_torch(ep, x: np.ndarray, exact_pool_ties: bool, record: tuple = ()) -> np.ndarray:
    """PyTorch's output of the converted program; ``exact_pool_ties``: each average pool's quantize decides exact
    ties as qcompile's integer pool does (up) instead of by float32 noise. The outputs of the quantize nodes named in
    ``record`` go to ``_RECORDED``."""
    qpt = torch.ops.quantized_decomposed.quantize_per_tensor.default
    gm = ep.module()
    pools = 0
    floats = 0  # (pools of a float value: X86InductorQuantizer's DenseNet pools its last BN + ReLU)
    for n in gm.graph.nodes if exact_pool_ties else ():
        if n.target is qpt and _pool_of(n) is not None:
            pool_in = _pool_of(n).args[0]
            if "dequantize_per_tensor" not in str(pool_in.target):
                floats += 1  # (no integer sums: ties no more frequent than elsewhere)
                continue
            if float(pool_in.args[1]) != float(n.args[1]):
                continue  # (a pool requantized to another scale: its ties are no more frequent than a conv's)
            h, w = pool_in.meta["val"].shape[2:]
            oh, ow = _pool_of(n).meta["val"].shape[2:] if len(_pool_of(n).meta["val"].shape) == 4 else (1, 1)
            n.target = _pool_quantize_exact(int(h) * int(w) // (int(oh) * int(ow)))  # the window: input / output
            pools += 1
    assert pools or floats or not exact_pool_ties, "no average pool quantize found"
    for n in gm.graph.nodes:
        if n.name in record:
            n.target = _recording(n.name, n.target)
    gm.recompile()
    with torch.no_grad():
        return gm(torch.from_numpy(x)).numpy()


def _steps(ep):
    """(one output step, one step of the classifier's input carried through it) of the program's output."""
    consts = {**{k: v for k, v in ep.state_dict.items()}, **{k: v for k, v in ep.constants.items()}}
    spec = {s.arg.name: s.target for s in ep.graph_signature.input_specs}
    out = [n for n in ep.graph.nodes if n.op == "output"][0].args[0][0]
    lin = out.args[0].args[0] if "dequantize_per_tensor" in str(out.target) else out
    assert "linear" in str(lin.target), lin
    x_dq, w_dq = lin.args[0], lin.args[1]
    q_w, s_w = (consts[spec[a.name]].double() for a in w_dq.args[:2])
    carried = float(x_dq.args[1]) * float((q_w * s_w.reshape(-1, 1)).abs().sum(1).max())
    step = float(out.args[1]) if lin is not out else carried
    return step, carried


def _vm_run(res, x):
    return relax.VirtualMachine(res.executable, tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy()


@pytest.mark.parametrize("quantizer,net", CASES)
def test_standard_quantizer_compiles_and_matches_pytorch(tmp, quantizer, net):
    path, ep = _program(quantizer, net, tmp)
    res = compile_model(path, CompileOptions(), log=_quiet)
    shape = _shape(net)
    assert res.meta["input_shape"] == list(shape)
    ref = _NamedReference(res.integer_mod)
    step, carried = _steps(ep)
    for seed in range(2):
        x = np.random.default_rng(300 + seed).standard_normal(shape).astype("float32")
        y = _vm_run(res, x)
        assert np.array_equal(y, ref(x)), "compiled output differs from the NumPy integer reference"
        assert len(np.unique(y)) > 5
        pooled = _pooled(ep)
        err = np.abs(y.astype(np.float64) - _run_torch(ep, x, exact_pool_ties=True, record=(pooled,))).max()
        assert err <= step * (1 + 1e-5), f"{err} > one output step {step} (pool ties rounded up)"
        q_ref, q_torch = ref.named[pooled].astype(np.int64), _RECORDED[pooled].numpy().astype(np.int64)
        if q_ref.ndim == 4 and q_ref.shape != q_torch.shape:  # (the lowering's layout: NHWC)
            q_ref = q_ref.transpose(0, 3, 1, 2)
        q_ref, q_torch = q_ref.reshape(shape[0], -1), q_torch.reshape(shape[0], -1)
        assert np.abs(q_ref - q_torch).max() <= 1, f"the pooled tensor '{pooled}' is more than one step off"
        err = np.abs(y.astype(np.float64) - _run_torch(ep, x, exact_pool_ties=False)).max()
        assert err <= (step + carried) * (1 + 1e-5), f"{err} > one output step {step} + a carried step {carried}"


@pytest.mark.gpu
@pytest.mark.nvcc
@pytest.mark.parametrize("net", ["mobilenet_v3_tiny", "efficientnet_tiny", "densenet_tiny"])
def test_x86_float_values_gpu_equal_llvm(tmp, net):
    """X86InductorQuantizer's float values (hardswish / SiLU on a conv's output, squeeze-excitation's product, the
    last BN + ReLU before the pool) on their grids: int32 kernel outputs, 16- and 32-bit glue and the grids' tables.
    The cuda build equals the llvm build bit for bit."""
    from test_gpu import _arch

    from qcompile.runtime import Module

    path, _ = _program("x86", net, tmp)
    cpu_so, gpu_so = f"{tmp}/{net}_x86_cpu.so", f"{tmp}/{net}_x86_gpu.so"
    compile_model(path, CompileOptions(layout="NHWC"), log=_quiet).export(cpu_so)
    compile_model(path, CompileOptions(target="cuda", arch=_arch(), layout="NHWC"), log=_quiet).export(gpu_so)
    cpu, gpu = Module(cpu_so), Module(gpu_so, "cuda")
    for seed in range(2):
        x = np.random.default_rng(310 + seed).standard_normal(_shape(net)).astype("float32")
        want, got = cpu(x), gpu(x)
        assert len(np.unique(want)) > 5
        assert np.array_equal(got, want), f"GPU output differs from the llvm build in {np.sum(got != want)} elements"


def test_pt2_frontend_reads_standard_forms(tmp):
    """What the standard quantizers write and the frontend takes: uint8 asymmetric activations (X86), int8 ones
    with a zero point (XNNPACK), [-127, 127] per-channel weights, float biases, hardtanh_ for ReLU6."""
    from qcompile.models.export_pt2 import quantized_ops

    _, x86 = _program("x86", "mobilenet_v2_tiny", tmp)
    _, xnn = _program("xnnpack", "mobilenet_v2_tiny", tmp)
    q = [n for n in x86.graph.nodes if "quantize_per_tensor" in str(n.target)]
    assert {n.args[-1] for n in q} == {torch.uint8} and any(n.args[2] != 0 for n in q)
    w = [n for n in xnn.graph.nodes if "dequantize_per_channel" in str(n.target)]
    assert {(n.args[4], n.args[5]) for n in w} == {(-127, 127)}
    assert any("hardtanh_" in str(n.target) for n in x86.graph.nodes)
    assert quantized_ops(xnn)["dequantize_per_channel.default"] == len(w)


def test_unsupported_op_names_node(tmp_path):
    """A standard-quantized program with an op the frontend does not know: the error names the op and the node."""
    from torch import nn

    from qcompile.models.pt2e_quantizers import export_pt2e

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3)

        def forward(self, x):
            return torch.erf(self.conv(x))

    path = str(tmp_path / "erf.pt2")
    export_pt2e(Net(), "xnnpack", path, torch.randn(2, 3, 8, 8))
    with pytest.raises(QCompileError, match=r"aten\.erf.*node 'erf'"):
        compile_model(path, CompileOptions(), log=_quiet)


def test_qmodel_quantizer_flag(tmp_path):
    from qcompile.models.cli import main as qmodel_main
    from qcompile.models.export_pt2 import load_pt2

    out = str(tmp_path / "r.pt2")
    assert qmodel_main(["resnet_tiny", "--format", "pt2", "--quantizer", "xnnpack", "--input-size", "16", "-q",
                        "--batch", "2", "-o", out]) == 0
    ep = load_pt2(out)
    assert any("dequantize_per_channel" in str(n.target) and n.args[4] == -127 for n in ep.graph.nodes)
    assert qmodel_main(["resnet_tiny", "--format", "onnx", "--quantizer", "x86", "-q",
                        "-o", str(tmp_path / "r.onnx")]) == 2
    assert qmodel_main(["resnet_tiny", "--format", "pt2", "--quantizer", "x86", "--bits", "4", "-q",
                        "-o", str(tmp_path / "r4.pt2")]) == 2


def test_unsupported_activation_range_names_node(tmp_path):
    """XNNPACK's config with activations on the narrow range [-127, 127] (no qcompile type): one error naming the
    node, the op and the range."""
    import dataclasses

    from torch import nn

    from qcompile.models.pt2e_quantizers import _quiet_import

    xnn = _quiet_import("torchao.testing.pt2e._xnnpack_quantizer")
    qpt2e = _quiet_import("torchao.quantization.pt2e.quantize_pt2e")
    cfg = xnn.get_symmetric_quantization_config(is_per_channel=True)
    narrow = dataclasses.replace(cfg.input_activation, quant_min=-127)
    cfg = dataclasses.replace(cfg, input_activation=narrow, output_activation=narrow)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()).eval()
    x = torch.randn(2, 3, 8, 8)
    gm = qpt2e.prepare_pt2e(torch.export.export(model, (x,), strict=True).module(), xnn.XNNPACKQuantizer().set_global(cfg))
    gm(x)
    path = str(tmp_path / "narrow.pt2")
    torch.export.save(torch.export.export(qpt2e.convert_pt2e(gm), (x,)), path)
    with pytest.raises(QCompileError, match=r"node 'quantize_per_tensor' \(quantized_decomposed\.quantize_per_tensor\)"
                                            r": range \[-127, 127\] of int8 is not a supported quantized type"):
        compile_model(path, CompileOptions(), log=_quiet)
