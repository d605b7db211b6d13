"""Reading the GPU code inside a compiled ``.so``.

TVM stores the fatbin inside its own serialized module blob, where ``cuobjdump`` does not look;
:func:`extract_fatbins` cuts each fatbin out (by its header: magic ``0xBA55ED50``, version,
header size, payload size) so that ``cuobjdump --list-elf`` / ``--dump-sass`` can read it.
"""
from __future__ import annotations

import os
import struct
import subprocess

FATBIN_MAGIC = struct.pack("<I", 0xBA55ED50)


def extract_fatbins(so_path: str, out_dir: str) -> list:
    data = open(so_path, "rb").read()
    os.makedirs(out_dir, exist_ok=True)
    paths, i = [], data.find(FATBIN_MAGIC)
    while i >= 0:
        _, version, hsize, fsize = struct.unpack_from("<IHHQ", data, i)
        if version == 1 and 0 < fsize < len(data):
            p = os.path.join(out_dir, f"{os.path.basename(so_path)}.{len(paths)}.fatbin")
            with open(p, "wb") as f:
                f.write(data[i: i + hsize + fsize])
            paths.append(p)
            i = data.find(FATBIN_MAGIC, i + hsize + fsize)
        else:
            i = data.find(FATBIN_MAGIC, i + 4)
    return paths


def cuobjdump(so_path: str, *flags: str, work_dir: str | None = None) -> str:
    """``cuobjdump FLAGS`` over every fatbin of ``so_path`` (e.g. ``"--dump-sass"``, ``"--list-elf"``)."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        out = []
        for fb in extract_fatbins(so_path, work_dir or d):
            r = subprocess.run([find_tool("cuobjdump") or "cuobjdump", *flags, fb], capture_output=True, text=True)
            out.append(r.stdout + r.stderr)
        return "\n".join(out)


def find_tool(name: str):
    """Path of a CUDA binary tool: on PATH, or from the PyPI wheels (nvidia-cuda-cuobjdump, nvidia-cuda-nvdisasm)."""
    import glob
    import shutil
    import sysconfig

    p = shutil.which(name)
    if p:
        return p
    for cand in glob.glob(os.path.join(sysconfig.get_paths()["purelib"], "nvidia", "*", "bin", name)):
        if os.access(cand, os.X_OK):
            return cand
    return None
