"""PackInt4 (placeholder replaced below)."""
import tvm


@tvm.transform.module_pass(opt_level=0, name="PackInt4")
class PackInt4:
    def transform_module(self, mod, ctx):
        return mod
