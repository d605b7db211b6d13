"""Write the cost model's packaged training measurements for one arch: ``tuning_logs/<arch>.train.jsonl.gz``.

Every OK, timed record of ``--arch`` in the given tuning logs (default: the committed measurement runs -- qtune's
logs, the ablation pools and the cost model's test data), one record per (GPU, task, strategy, effective knobs): the
fastest where a point was measured twice. ``qtune`` trains its cost model on this file first (``--no-pretrained``:
not), so that a task's first rounds are ranked by what other shapes measured, as a ``--tuning-log`` of other runs
would. Only the records' identifying fields and their time are kept. The output is deterministic (sorted, gzip
without a time stamp).

    python scripts/make_train_log.py --arch sm_90            # -> tuning_logs/sm_90.train.jsonl.gz
"""
from __future__ import annotations

import argparse
import glob
import gzip
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCES = ("tests/tune/data/*.jsonl", "docs/bench/**/*.jsonl")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("logs", nargs="*", help=f"tuning logs to take (default: {' '.join(SOURCES)} under the checkout)")
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("-o", "--output", help="default: tuning_logs/ARCH.train.jsonl.gz")
    a = ap.parse_args(argv)

    from qcompile.schedules.space import SPACES
    from qcompile.schedules.tuning import TRAIN_SUFFIX, format_record, make_record, read_log, spec_from_key

    paths = a.logs or sorted({p for s in SOURCES for p in glob.glob(os.path.join(ROOT, s), recursive=True)})
    best: dict = {}
    for p in paths:
        for r in read_log(p):  # (stale lines are skipped, with a warning naming the file)
            sp = SPACES.get(r.strategy)
            if r.arch != a.arch or not r.ok or not r.ms or sp is None:
                continue
            try:
                ident = (r.device, r.key, r.strategy, sp.point_id(spec_from_key(r.key), r.arch, r.knobs))
            except Exception:  # noqa: BLE001  (knobs the shape's space cannot normalise: not a point it builds)
                continue
            if ident not in best or r.ms < best[ident].ms:
                best[ident] = r
    lines = sorted(format_record(make_record(r.arch, r.device, r.sms, r.key, r.strategy, r.knobs, r.status, r.ms))
                   for r in best.values())
    out = a.output or os.path.join(ROOT, "tuning_logs", a.arch + TRAIN_SUFFIX)
    with open(out, "wb") as f, gzip.GzipFile(fileobj=f, mode="wb", filename="", mtime=0) as g:
        g.write(("\n".join(lines) + "\n").encode())
    devices = sorted({r.device for r in best.values()})
    print(f"wrote {out}: {len(lines)} records of {len({r.key for r in best.values()})} keys on "
          f"{', '.join(devices)}, from {len(paths)} logs ({os.path.getsize(out) // 1024} KiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
