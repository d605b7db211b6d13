"""qcompile's graph passes. TVM removed Relay in 0.20; these are Relax passes (the folder keeps its name)."""
from .lower_qdq_to_integer import LowerQDQToInteger
from .pack_int4 import PackInt4
from .dispatch_tensor_core import DispatchTensorCore
from .dispatch_pools import DispatchPools

__all__ = ["LowerQDQToInteger", "PackInt4", "DispatchTensorCore", "DispatchPools"]
