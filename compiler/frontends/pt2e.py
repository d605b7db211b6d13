"""PT2E frontend: a saved ``torch.export`` program after ``convert_pt2e`` (``quantized_decomposed`` ops).

The program's ``quantized_decomposed.quantize_per_tensor`` / ``dequantize_per_tensor`` /
``dequantize_per_channel`` nodes map one to one onto the QDQ form (``qcompile.qdq``); their
``quant_min``/``quant_max`` give the bit width (``-8, 7`` on int8 is INT4, ``0, 15`` on uint8 is
UINT4); int32 ``dequantize_per_channel`` of a constant is a bias. Float ATen ops between them:
conv2d (grouped, depthwise), linear, relu, hardtanh (ReLU6), add, mul (of two tensors: squeeze-excitation; or by a
constant), cat, max_pool2d, avg_pool2d (k x k), adaptive_avg_pool2d (global, or an output size that divides the
input's: VGG's 7x7), mean (global), flatten, view / reshape, batch norm (inference), dropout / clone (identity), and
the element-wise functions hardswish, hardsigmoid, silu, sigmoid, tanh (torch's formulas in float ops; the integer
lowering makes each a lookup table over its quantized input); in-place variants (``relu_``, ``hardswish_``,
``silu_``, ``add_``, ...) alike. X86InductorQuantizer fuses hardswish / SiLU into the conv before them and leaves
their input in float (as it leaves squeeze-excitation's product and DenseNet's last BN + ReLU before the pool): the
integer lowering puts such a float value on a 16-bit grid first (``LowerQDQToInteger.fine_lookup``, ``_fine``).

torchao's standard quantizers (``X86InductorQuantizer``, ``XNNPACKQuantizer``; see
``qcompile.models.pt2e_quantizers``) write the same ops with: asymmetric uint8 / int8 activations (zero
points), float biases (not quantized), float classifier outputs (X86), and narrow-range weights
(``[-127, 127]`` on int8): a constant weight's range only bounds its values, so it is the weight type of its
storage that holds the range (:meth:`_Importer._weight_qt`). An activation quantized to a range that is no
supported type (``[-127, 127]``, 2-bit, ...), an asymmetric weight or a per-channel axis other than 0 stops
with the node, the op and the reason.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from ..errors import QCompileError, UnsupportedOpError
from ..qdq import QTYPES, QDQBuilder, check_scale, check_zero_point, qtype_from_range


def _import_torch():
    import logging
    import warnings

    import torch

    # torchao warns about its optional GPU kernels (not needed here) while importing
    lg = logging.getLogger("torchao")
    level, lg.level = lg.level, logging.ERROR
    logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)  # a deprecation note torchao triggers
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import torchao.quantization.pt2e  # noqa: F401  registers torch.ops.quantized_decomposed.*
    except Exception:
        pass
    finally:
        lg.level = level
    return torch


def load_pt2(path: str):
    _import_torch()
    from ..checks import torch_export_load

    return torch_export_load(path, "PT2 program")


def _target_name(t) -> str:
    s = str(t)
    return s.split(".default")[0] if s.endswith(".default") else s


class _Importer:
    def __init__(self, ep, batch: Optional[int], log):
        self.ep, self.batch, self.log = ep, batch, log
        self.b = QDQBuilder()
        self.vals: dict = {}
        self.consts: dict = {}

    def const(self, n, node) -> np.ndarray:
        if hasattr(n, "name") and n.name in self.consts:
            return self.consts[n.name]
        raise QCompileError(f"node '{node.name}' ({_target_name(node.target)}): argument '{n}' must be a constant")

    def val(self, n, node):
        if n.name in self.vals:
            return self.vals[n.name]
        if n.name in self.consts:
            raise UnsupportedOpError(_target_name(node.target), node.name, f"constant float operand '{n.name}' is not quantized")
        raise QCompileError(f"node '{node.name}': operand '{n.name}' was not produced")

    def run(self):
        torch = _import_torch()
        ep = self.ep
        sig = ep.graph_signature
        kinds = {s.arg.name: s for s in sig.input_specs}
        user = []
        for node in ep.graph_module.graph.nodes:
            if node.op == "placeholder":
                spec = kinds.get(node.name)
                if spec is not None and str(spec.kind).endswith("USER_INPUT"):
                    user.append(node)
                    continue
                t = ep.state_dict.get(spec.target) if spec is not None else None
                if t is None and spec is not None:
                    t = ep.constants.get(spec.target)
                if t is None:
                    raise QCompileError(f"placeholder '{node.name}' has no value in the program")
                self.consts[node.name] = t.detach().cpu().numpy()
            elif node.op == "get_attr":
                self.consts[node.name] = getattr(ep.graph_module, node.target).detach().cpu().numpy()
        if len(user) != 1:
            raise QCompileError(f"expected one user input (an image batch), found {len(user)}")
        x = user[0]
        shape = list(x.meta["val"].shape)
        shape = [int(s) if isinstance(s, int) or str(s).isdigit() else None for s in shape]
        if shape[0] is None or self.batch:
            if shape[0] is None and not self.batch:
                self.log(f"note: input '{x.name}' has a dynamic batch dimension; compiling for batch 1 (use --batch N)")
            shape[0] = self.batch or 1
        if any(s is None for s in shape):
            raise QCompileError(f"input '{x.name}' has a dynamic non-batch dimension: {list(x.meta['val'].shape)}")
        if x.meta["val"].dtype != torch.float32:
            raise QCompileError(f"input '{x.name}' has dtype {x.meta['val'].dtype}; expected torch.float32")
        self.input_name, self.input_shape = x.name, shape
        self.vals[x.name] = self.b.input(x.name, shape)
        outputs = None
        for node in ep.graph_module.graph.nodes:
            if node.op == "call_function":
                self.call(node)
            elif node.op == "output":
                outputs = node.args[0]
        outs = [self.val(o, o) for o in (outputs if isinstance(outputs, (list, tuple)) else [outputs])]
        return self.b.finish(outs)

    # ------------------------------------------------------------------------------------------
    def call(self, node):
        name = _target_name(node.target)
        short = name.split("::")[-1].split(".")
        ns, op = (short[0], short[1]) if len(short) > 1 else ("aten", short[0])
        if "quantized_decomposed" in name:
            op = name.split("quantized_decomposed.")[-1].split(".")[0]
            fn = getattr(self, "q_" + op, None)
        else:
            op = name.split("aten.")[-1].split(".")[0] if "aten." in name else name
            fn = getattr(self, "op_" + op, None)
        if fn is None:
            if name == "<built-in function getitem>" or "getitem" in name:
                src = node.args[0]
                if src.name in self.vals and isinstance(self.vals[src.name], tuple):
                    self.vals[node.name] = self.vals[src.name][node.args[1]]
                    return
            raise UnsupportedOpError(name, node.name)
        out = fn(node, *node.args, **node.kwargs)
        if out is not None:
            if isinstance(out, np.ndarray):
                self.consts[node.name] = out
            else:
                self.vals[node.name] = out

    # -- quantized_decomposed ------------------------------------------------------------------
    def _qt(self, node, qmin, qmax, dtype):
        dt = str(dtype).replace("torch.", "")
        return qtype_from_range(dt, int(qmin), int(qmax), f"node '{node.name}' ({_target_name(node.target)})")

    def _weight_qt(self, node, qmin, qmax, dtype):
        """The type of a constant weight quantized to ``[qmin, qmax]``: the narrowest supported type of the same
        storage that holds the range. A narrow range such as XNNPACK's symmetric ``[-127, 127]`` only restricts the
        constant's values (its dequantize is exact either way), so it is the int8 weight it holds."""
        dt = str(dtype).replace("torch.", "")
        for qt in sorted(QTYPES.values(), key=lambda t: t.bits):
            if qt.storage == dt and qt.qmin <= int(qmin) and int(qmax) <= qt.qmax:
                return qt
        return self._qt(node, qmin, qmax, dtype)

    def q_quantize_per_tensor(self, node, x, scale, zp, qmin, qmax, dtype, **kw):
        qt = self._qt(node, qmin, qmax, dtype)
        s, z = self._sz(node, scale, zp, qt)
        if x.name in self.consts:
            return np.clip(np.round(self.consts[x.name] / s) + z, qt.qmin, qt.qmax).astype(qt.storage)
        return self.b.quantize(self.val(x, node), s, z, qt, name=node.name)

    def _sz(self, node, scale, zp, qt):
        """The checked scalar scale and zero point of a per-tensor (de)quantize node."""
        what = f"node '{node.name}' ({_target_name(node.target)})"
        s = float(check_scale(self._scalar(scale, node), what))
        z = int(check_zero_point(self._scalar(zp, node), qt.qmin, qt.qmax, what, qt.name))
        return s, z

    def q_dequantize_per_tensor(self, node, q, scale, zp, qmin, qmax, dtype, **kw):
        weight = q.name in self.consts  # a per-tensor quantized weight
        qt = (self._weight_qt if weight else self._qt)(node, qmin, qmax, dtype)
        s, z = self._sz(node, scale, zp, qt)
        if weight:
            if z != 0:
                raise UnsupportedOpError("dequantize_per_tensor", node.name,
                                         f"asymmetric weights (zero point {z}) are not supported")
            return self.b.qweight(self.consts[q.name], np.float32(s), qt, axis=0, name=node.name)
        return self.b.dequantize(self.val(q, node), s, z, name=node.name)

    def _scalar(self, v, node):
        if hasattr(v, "name"):
            return np.asarray(self.const(v, node)).reshape(())
        return v

    def q_quantize_per_channel(self, node, w, scales, zps, axis, qmin, qmax, dtype, **kw):
        qt = self._weight_qt(node, qmin, qmax, dtype)
        wv = self.const(w, node).astype(np.float64)
        s = check_scale(self.const(scales, node), f"node '{node.name}' ({_target_name(node.target)})")
        shp = [1] * wv.ndim
        shp[axis] = -1
        return np.clip(np.round(wv / s.reshape(shp)), int(qmin), int(qmax)).astype(qt.storage)

    def q_dequantize_per_channel(self, node, w, scales, zps, axis, qmin, qmax, dtype, **kw):
        q = self.const(w, node)
        s = self.const(scales, node).astype(np.float32)
        z = self.const(zps, node) if hasattr(zps, "name") else np.zeros_like(s)
        if np.any(z != 0):
            raise UnsupportedOpError("dequantize_per_channel", node.name, "asymmetric weights are not supported")
        if str(dtype).endswith("int32"):
            return self.b.qbias(q.astype(np.int32), s, node.name)
        if axis != 0:
            raise UnsupportedOpError("dequantize_per_channel", node.name, f"per-channel axis {axis} (expected 0, output channels)")
        return self.b.qweight(q, s, self._weight_qt(node, qmin, qmax, dtype), axis=0, name=node.name)

    # -- aten -----------------------------------------------------------------------------------
    def op_conv2d(self, node, x, w, b=None, stride=(1, 1), padding=(0, 0), dilation=(1, 1), groups=1):
        if isinstance(padding, str):
            raise UnsupportedOpError("conv2d", node.name, f"padding='{padding}' is not supported")
        stride, padding, dilation = [list(v) if isinstance(v, (list, tuple)) else [v, v] for v in (stride, padding, dilation)]
        bias = None
        if b is not None:
            bias = self.vals.get(b.name)
            if bias is None:
                bias = self.b.const(self.const(b, node).astype(np.float32))
        return self.b.conv2d(self.val(x, node), self.val(w, node), bias, stride,
                             (padding[0], padding[1], padding[0], padding[1]), dilation, groups, node.name)

    op_convolution = None

    def op_linear(self, node, x, w, b=None):
        bias = None
        if b is not None:
            bias = self.vals.get(b.name)
            if bias is None:
                bias = self.b.const(self.const(b, node).astype(np.float32))
        return self.b.dense(self.val(x, node), self.val(w, node), bias, node.name)

    def op_relu(self, node, x):
        return self.b.relu(self.val(x, node), node.name)

    op_relu_ = op_relu

    def op_hardtanh(self, node, x, lo=-1.0, hi=1.0):
        return self.b.clip(self.val(x, node), lo, hi, node.name)

    op_hardtanh_ = op_hardtanh

    def op_add(self, node, a, b, alpha=1):
        if alpha != 1:
            raise UnsupportedOpError("add", node.name, "alpha != 1")
        return self.b.add(self.val(a, node), self.val(b, node), node.name)

    op_add_ = op_add

    # element-wise functions: tables over the quantized input where a quantize/dequantize pair surrounds them
    # (see LowerQDQToInteger); torch's own formulas in float ops
    def _f32(self, v):
        from tvm import relax

        return relax.const(np.float32(v), "float32")

    def _hardsigmoid(self, x, name):
        """``relu6(x + 3) / 6`` (torch's hardsigmoid)."""
        from tvm import relax

        t = self.b.emit(relax.op.add(x, self._f32(3.0)), name + "_add3")
        t = self.b.emit(relax.op.clip(t, 0.0, 6.0), name + "_relu6")
        return self.b.emit(relax.op.divide(t, self._f32(6.0)), name)

    def op_hardsigmoid(self, node, x):
        return self._hardsigmoid(self.val(x, node), node.name)

    def op_hardswish(self, node, x):
        """``x * hardsigmoid(x)``."""
        from tvm import relax

        v = self.val(x, node)
        return self.b.emit(relax.op.multiply(v, self._hardsigmoid(v, node.name + "_hardsigmoid")), node.name)

    def op_sigmoid(self, node, x):
        from tvm import relax

        return self.b.emit(relax.op.sigmoid(self.val(x, node)), node.name)

    def op_tanh(self, node, x):
        from tvm import relax

        return self.b.emit(relax.op.tanh(self.val(x, node)), node.name)

    def op_silu(self, node, x):
        from tvm import relax

        return self.b.emit(relax.op.nn.silu(self.val(x, node)), node.name)

    op_hardsigmoid_, op_hardswish_, op_sigmoid_, op_tanh_, op_silu_ = (op_hardsigmoid, op_hardswish, op_sigmoid,
                                                                      op_tanh, op_silu)

    def op_mul(self, node, a, b):
        """The product of two tensors (squeeze-and-excitation's channel scaling) or of a tensor and a constant."""
        from tvm import relax

        ins = []
        for v in (a, b):
            if isinstance(v, (int, float)):
                ins.append(self._f32(v))
            elif v.name in self.consts and v.name not in self.vals:
                ins.append(self.b.const(np.asarray(self.consts[v.name], np.float32)))
            else:
                ins.append(self.val(v, node))
        return self.b.emit(relax.op.multiply(ins[0], ins[1]), node.name)

    op_mul_ = op_mul

    def op_cat(self, node, xs, dim=0):
        """Concatenation (DenseNet); of one tensor, the tensor itself."""
        from tvm import relax

        vs = [self.val(x, node) for x in xs]
        if len(vs) == 1:
            return vs[0]
        return self.b.emit(relax.op.concat(vs, axis=int(dim)), node.name)

    op_concat = op_cat

    def op_avg_pool2d(self, node, x, k, stride=None, padding=(0, 0), ceil_mode=False, count_include_pad=True,
                      divisor_override=None):
        """A k x k average pool (DenseNet's 2x2 transition pool)."""
        from tvm import relax

        if divisor_override is not None:
            raise UnsupportedOpError("avg_pool2d", node.name, f"divisor_override={divisor_override} is not supported")
        pair = lambda v: [int(i) for i in v] * (2 // len(v)) if isinstance(v, (list, tuple)) else [int(v)] * 2  # noqa: E731
        k = pair(k)
        stride = pair(stride) if stride else k
        p = pair(padding)
        return self.b.emit(relax.op.nn.avg_pool2d(self.val(x, node), k, stride, [p[0], p[1], p[0], p[1]], [1, 1],
                                                  bool(ceil_mode), bool(count_include_pad)), node.name)

    def op_max_pool2d(self, node, x, k, stride=None, padding=(0, 0), dilation=(1, 1), ceil_mode=False):
        k = list(k) if isinstance(k, (list, tuple)) else [k, k]
        stride = list(stride) if stride else k
        stride = stride if len(stride) == 2 else stride * 2
        padding = list(padding) if isinstance(padding, (list, tuple)) else [padding, padding]
        dilation = list(dilation) if isinstance(dilation, (list, tuple)) else [dilation, dilation]
        return self.b.max_pool2d(self.val(x, node), k, stride, (padding[0], padding[1], padding[0], padding[1]),
                                 dilation, ceil_mode, node.name)

    def op_adaptive_avg_pool2d(self, node, x, size):
        """1x1: the global average; an output size that divides the input's (VGG's 7x7 adaptive pool): the fixed
        average pool of kernel = stride = input / output."""
        from tvm import relax

        v = self.val(x, node)
        size = [int(s) for s in (size if isinstance(size, (list, tuple)) else (size, size))]
        if size == [1, 1]:
            return self.b.global_avg_pool(v, node.name)
        h, w = int(v.ty.shape[2]), int(v.ty.shape[3])
        if len(size) != 2 or h % size[0] or w % size[1]:
            raise UnsupportedOpError("adaptive_avg_pool2d", node.name, f"output size {size} of a {h}x{w} input (only "
                                     f"1x1 or a size that divides the input's: a fixed pool)")
        k = [h // size[0], w // size[1]]
        return self.b.emit(relax.op.nn.avg_pool2d(v, k, k, [0, 0, 0, 0]), node.name)

    def op_mean(self, node, x, dims, keepdim=False, **kw):
        v = self.val(x, node)
        if sorted(d % 4 for d in dims) != [2, 3]:
            raise UnsupportedOpError("mean", node.name, f"over dims {list(dims)} (only H and W)")
        y = self.b.global_avg_pool(v, node.name)
        return y if keepdim else self.b.flatten(y, node.name + "_squeeze")

    def op_flatten(self, node, x, start=0, end=-1):
        v = self.val(x, node)
        if start != 1 or end not in (-1, 3):
            raise UnsupportedOpError("flatten", node.name, f"start_dim={start}, end_dim={end} (only 1, -1)")
        return self.b.flatten(v, node.name)

    def op_view(self, node, x, shape):
        v = self.val(x, node)
        n = int(np.prod([int(s) for s in v.ty.shape]))
        shape = [int(s) for s in shape]
        if -1 in shape:
            shape[shape.index(-1)] = n // int(np.prod([s for s in shape if s != -1]))
        return self.b.reshape(v, shape, node.name)

    op_reshape = op_view
    op__unsafe_view = op_view

    def op_clone(self, node, x, **kw):
        return self.val(x, node)

    def op_dropout(self, node, x, *a, **kw):
        return self.val(x, node)

    op_contiguous = op_clone
    op_dropout_ = op_dropout

    def op__native_batch_norm_legit_no_training(self, node, x, w, b, mean, var, momentum, eps):
        y = self.b.batch_norm(self.val(x, node), self.const(w, node), self.const(b, node), self.const(mean, node),
                              self.const(var, node), eps, node.name)
        return (y, None, None)

    def op_batch_norm(self, node, x, w, b, mean, var, training=False, momentum=0.1, eps=1e-5, *a):
        return self.b.batch_norm(self.val(x, node), self.const(w, node), self.const(b, node), self.const(mean, node),
                                 self.const(var, node), eps, node.name)


def from_pt2(path: str, batch: Optional[int] = None, log=print):
    """Import a saved PT2E program into the QDQ-form Relax module."""
    ep = load_pt2(path)
    imp = _Importer(ep, batch, log)
    try:
        mod = imp.run()
    except BaseException:
        imp.b.discard()
        raise
    return mod, {"input_name": imp.input_name, "input_shape": imp.input_shape, "format": "pt2"}
