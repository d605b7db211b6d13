"""qcompile: ahead-of-time compiler for quantized CNNs (INT8/INT4) on NVIDIA tensor cores."""
__version__ = "0.1.0"
