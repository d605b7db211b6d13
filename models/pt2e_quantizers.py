"""torchao's standard PT2E quantizers, run on a float model as a user runs them, and saved as a ``.pt2`` program.

    from qcompile.models.pt2e_quantizers import export_pt2e
    export_pt2e(float_model, "x86", "m.pt2", example, calib)      # X86InductorQuantizer, default config

Flow (torchao's documented PT2E flow)::

    gm = torch.export.export(model, (x,), dynamic_shapes=..., strict=True).module()
    gm = prepare_pt2e(gm, quantizer)        # quantizer: one entry of QUANTIZERS
    gm(calib)                               # calibration (MinMax / per-channel observers of the quantizer's config)
    gm = convert_pt2e(gm)
    torch.export.save(torch.export.export(gm, (x,)), "m.pt2")

``strict=True``: torchvision's ResNet blocks call one ``nn.ReLU`` module twice; a non-strict capture (torch 2.13) gives
both calls one source partition, and ``X86InductorQuantizer`` then stops at "Input partition has more than one output
node". A strict (dynamo) capture keeps one partition per call.

The registry (:data:`QUANTIZERS`) imports neither torch nor torchao: ``qmodel --help`` lists its names.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Optional

__all__ = ["PT2EQuantizer", "QUANTIZERS", "QUANTIZER_NAMES", "DEFAULT_QUANTIZER", "make_quantizer", "export_pt2e",
           "quantizer_bits_error"]

DEFAULT_QUANTIZER = "qcompile"


@dataclass(frozen=True)
class PT2EQuantizer:
    """One PT2E quantizer ``qmodel --format pt2 --quantizer NAME`` can run.

    ``module``/``cls`` name the torchao quantizer class; ``config``/``config_kwargs`` the function giving its global
    quantization config. The ``qcompile`` entry has no class: it is :func:`~.export_pt2.export_pt2` (our own
    quantizer on the network :func:`~.quantize.quantize_model` calibrated, any ``--bits``)."""

    name: str
    help: str
    module: str = ""
    cls: str = ""
    config: str = ""
    config_kwargs: tuple = ()
    bits: tuple = ("8",)  # the --bits it can give

    @property
    def standard(self) -> bool:
        return bool(self.cls)


QUANTIZERS: dict[str, PT2EQuantizer] = {q.name: q for q in (
    PT2EQuantizer("qcompile", "qcompile's own quantizer (models/export_pt2.py) on quantize_model's calibration; "
                              "any --bits", bits=("8", "4", "mixed")),
    PT2EQuantizer("x86", "torchao X86InductorQuantizer, get_default_x86_inductor_quantization_config() (uint8 "
                         "asymmetric activations, int8 per-channel weights, float output of the classifier)",
                  "torchao.quantization.pt2e.quantizer.x86_inductor_quantizer", "X86InductorQuantizer",
                  "get_default_x86_inductor_quantization_config"),
    PT2EQuantizer("xnnpack", "torchao XNNPACKQuantizer (torchao.testing.pt2e), get_symmetric_quantization_config("
                             "is_per_channel=True) (int8 asymmetric activations, int8 [-127, 127] per-channel "
                             "weights)",
                  "torchao.testing.pt2e._xnnpack_quantizer", "XNNPACKQuantizer", "get_symmetric_quantization_config",
                  (("is_per_channel", True),)),
)}
QUANTIZER_NAMES = tuple(QUANTIZERS)


def _quiet_import(name: str):
    """Import ``name`` with torchao's notes about its optional GPU kernels muted."""
    import logging
    import warnings

    lg = logging.getLogger("torchao")
    old = lg.level
    lg.setLevel(logging.ERROR)
    logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return importlib.import_module(name)
    finally:
        lg.setLevel(old)


def make_quantizer(name: str):
    """A configured torchao quantizer of the standard entry ``name``."""
    entry = QUANTIZERS.get(name)
    if entry is None or not entry.standard:
        raise ValueError(f"unknown standard PT2E quantizer {name!r}; choose from: "
                         f"{', '.join(n for n, q in QUANTIZERS.items() if q.standard)}")
    mod = _quiet_import(entry.module)
    config = getattr(mod, entry.config)(**dict(entry.config_kwargs))
    return getattr(mod, entry.cls)().set_global(config)


def export_pt2e(model, quantizer: str, path: str, example, calib=None, dynamic_batch: bool = False,
                calib_batch: int = 64):
    """Quantize the float ``model`` with the standard quantizer ``quantizer`` and ``torch.export.save`` it to ``path``.

    1. capture (strict, dynamic batch so that calibration may use any batch size);
    2. ``prepare_pt2e`` with the quantizer, calibrate on ``calib`` (default: ``example``) in chunks of ``calib_batch``;
    3. ``convert_pt2e``; export with ``example``'s static batch (or a dynamic one) and save (all or nothing).

    Returns the saved ``ExportedProgram``."""
    import torch

    from qcompile.checks import atomic_output

    q = make_quantizer(quantizer)
    qpt2e = _quiet_import("torchao.quantization.pt2e.quantize_pt2e")
    model = model.eval()
    ex = (example.float(),)
    ex2 = (torch.cat([ex[0]] * 2),) if ex[0].shape[0] == 1 else ex  # (a batch of 1 would be specialized)
    dyn = ({0: torch.export.Dim("N", min=1, max=4096)},)
    gm = torch.export.export(model, ex2, dynamic_shapes=dyn, strict=True).module()
    gm = qpt2e.prepare_pt2e(gm, q)
    data = calib if calib is not None else ex[0]
    with torch.no_grad():
        for i in range(0, data.shape[0], calib_batch):
            gm(data[i:i + calib_batch].float())
    gm = qpt2e.convert_pt2e(gm)
    ep = torch.export.export(gm, ex2 if dynamic_batch else ex, dynamic_shapes=dyn if dynamic_batch else None)
    with atomic_output(path) as tmp:
        torch.export.save(ep, tmp)
    return ep


def quantizer_bits_error(name: str, bits: str) -> Optional[str]:
    """Why ``--bits bits`` cannot go with ``--quantizer name`` (None where it can)."""
    entry = QUANTIZERS[name]
    if bits in entry.bits:
        return None
    return (f"--quantizer {name} quantizes to {' or '.join(entry.bits)} bits (its own config); --bits {bits} needs "
            f"--quantizer {DEFAULT_QUANTIZER}")
