"""Measured tuning logs (``<arch>.json``) for qcompile.schedules; see README.md beside this file."""
