"""Measured tuning logs (``<arch>.jsonl``, JSON lines) for qcompile.schedules; see README.md beside this file."""
