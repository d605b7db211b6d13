"""Small QDQ-form models built directly with QDQBuilder (no exporter involved), for pass tests."""
import numpy as np

from qcompile.qdq import QDQBuilder, qtype


def tiny_resnet_qdq(seed=0, w_bits=8, a_bits=8, shape=(2, 3, 12, 12), c=8, classes=5):
    """stem conv+relu -> maxpool -> basic block (conv-relu-conv + residual, relu) -> avgpool -> fc."""
    rng = np.random.default_rng(seed)
    b = QDQBuilder()
    x = b.input("x", shape)
    a_in, a_relu, a_sig = qtype(8, True), qtype(a_bits, False), qtype(a_bits, True)
    wq = qtype(w_bits, True)

    def conv(xf, cin, cout, k, stride, pad, name, w_qt=wq):
        q = rng.integers(w_qt.qmin, w_qt.qmax + 1, (cout, cin, k, k))
        s = rng.uniform(0.5, 1.5, cout) / (k * k * cin * max(abs(w_qt.qmin), 1))
        bias = rng.integers(-50, 50, cout)
        return b.conv2d(xf, b.qweight(q, s, w_qt, name=name + "_w"), b.qbias(bias, s * 0.05, name + "_b"),
                        (stride, stride), (pad,) * 4, name=name)

    q0 = b.quantize(x, 0.05, 0, a_in, name="q_in")
    h = conv(b.dequantize(q0, 0.05, 0), shape[1], c, 3, 1, 1, "stem", qtype(8, True))
    h = b.relu(h)
    q1 = b.quantize(h, 0.04, 0, a_relu, name="q_stem")
    p = b.max_pool2d(b.dequantize(q1, 0.04, 0), (3, 3), (2, 2), (1, 1, 1, 1), name="pool")
    q2 = b.quantize(p, 0.04, 0, a_relu, name="q_pool")
    d2 = b.dequantize(q2, 0.04, 0)
    h = b.relu(conv(d2, c, c, 3, 1, 1, "c1"))
    q3 = b.quantize(h, 0.03, 0, a_relu, name="q_c1")
    h = conv(b.dequantize(q3, 0.03, 0), c, c, 3, 1, 1, "c2")
    # BN left unfolded on purpose
    h = b.batch_norm(h, rng.uniform(0.5, 2, c), rng.uniform(-0.1, 0.1, c), rng.uniform(-0.1, 0.1, c), rng.uniform(0.5, 2, c), name="bn")
    q4 = b.quantize(h, 0.05, 0, a_sig, name="q_c2")
    s = b.relu(b.add(b.dequantize(q4, 0.05, 0), d2, name="res"))
    q5 = b.quantize(s, 0.05, 0, a_relu, name="q_res")
    g = b.global_avg_pool(b.dequantize(q5, 0.05, 0), name="gap")
    q6 = b.quantize(g, 0.02, 0, qtype(8, False), name="q_gap")
    f = b.flatten(b.dequantize(q6, 0.02, 0), name="flat")
    wf = rng.integers(-128, 128, (classes, c))
    sf = rng.uniform(0.5, 1.5, classes) / 1000
    y = b.dense(f, b.qweight(wf, sf, qtype(8, True), name="fc_w"), b.qbias(rng.integers(-99, 99, classes), 0.02 * sf, "fc_b"), name="fc")
    q7 = b.quantize(y, 0.01, 0, qtype(8, True), name="q_fc")
    return b.finish([b.dequantize(q7, 0.01, 0, name="out")]), shape
