"""Reading the GPU code inside a compiled ``.so``.

TVM stores the fatbin inside its own serialized module blob, where ``cuobjdump`` does not look;
:func:`extract_fatbins` cuts each fatbin out (by its header: magic ``0xBA55ED50``, version,
header size, payload size) so that ``cuobjdump --list-elf`` / ``--dump-sass`` can read it.
"""
from __future__ import annotations

import os
import re
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


def sass_by_kernel(so_path: str) -> dict:
    """{kernel name: its SASS listing} over every fatbin of ``so_path`` (``cuobjdump -sass``), with runs of blanks
    made one space (cuobjdump pads its columns to the widest line of each file) so that listings of the same code
    compare equal whichever image they come from. Empty where cuobjdump is not installed."""
    if not find_tool("cuobjdump"):
        return {}
    out, cur = {}, None
    for line in cuobjdump(so_path, "-sass").splitlines():
        m = re.search(r"Function\s*:\s*(\S+)", line)
        if m:
            cur = m.group(1)
            out[cur] = []
            continue
        if line.startswith(("Fatbin ", "=====", "arch =", "code version", "host =", "compile_size", "compressed",
                            "identifier", "ptxasOptions")) or not line.strip():
            cur = None if line.startswith("Fatbin ") else cur
            continue
        if cur is not None and not line.strip().startswith("....."):
            out[cur].append(re.sub(r"[ \t]+", " ", line.strip()))
    return {k: "\n".join(v) for k, v in out.items()}


def ptx_entries(so_path: str) -> list:
    """The ``.entry`` names of the PTX embedded in ``so_path`` (``cuobjdump -ptx``; empty without cuobjdump)."""
    if not find_tool("cuobjdump"):
        return []
    return re.findall(r"\.entry\s+(\w+)\s*\(", cuobjdump(so_path, "-ptx"))


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


_SASS_INS = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Za-z0-9_.]*)\s*([^;]*);")


def _sass_dest(op: str, args: str):
    """Registers an SASS instruction writes in its first operand (none for stores, branches, barriers)."""
    m = re.match(r"(R\d+)\b(?!\.)", args.strip())
    if not m or op.startswith(("ST", "RED", "BRA", "BRX", "JMP", "CALL", "RET", "BAR", "BSSY", "BSYNC", "WARPSYNC",
                               "LDGSTS", "IGMMA", "HGMMA")):  # (stores, control flow: their registers are read)
        return ()
    n = 4 if ".128" in op or op.startswith("LDSM") and op.endswith(".4") else (
        2 if ".64" in op or ".WIDE" in op or op.startswith("LDSM") and op.endswith(".2") else 1)
    r = int(m.group(1)[1:])
    return tuple(range(r, r + n))


def wgmma_a_hazards_by_kernel(so_path: str) -> dict:
    """{kernel name: wgmma_a_hazards' lines} for the sm_90 SASS in ``so_path`` (kernels without any left out; empty
    where cuobjdump is not installed): what ``qcompile.tune``'s LocalBuilder checks for every register-A candidate (a
    hazard makes it a build_error)."""
    if not find_tool("cuobjdump"):
        return {}
    out = {}
    for h in wgmma_a_hazards(cuobjdump(so_path, "-sass")):
        out.setdefault(h.split()[0], []).append(h)
    return out


def wgmma_a_hazards(sass: str) -> list:
    """Instructions of an SASS listing that write a register-A wgmma's fragment registers (``IGMMA ... Ra, gdesc``:
    Ra..Ra+3) while that wgmma may still be reading them: after it issues and before the ``WARPGROUP.DEPBAR.LE gsb0,
    N`` that retires its group (groups end at the ``gsb0`` IGMMA; DEPBAR N leaves the newest N pending). The listing is
    walked in address order (a loop's body once). PTX makes such reuse the program's fault only for the PTX registers
    it names; ptxas has been seen to give other PTX registers the same physical ones (schedules/igemm.py, KEEP), so a
    kernel is checked in its SASS. Returns "[function ]addr: instruction (fragment of IGMMA at addr)" strings."""
    pending, group, out, fn = [], [], [], ""
    for line in sass.splitlines():
        f = re.search(r"Function\s*:\s*(\S+)", line)
        if f:  # (a listing of several kernels: each walked on its own)
            pending, group, fn = [], [], f.group(1) + " "
            continue
        m = _SASS_INS.search(line)
        if not m:
            continue
        op, args = m.group(1), m.group(2)
        addr = re.search(r"/\*([0-9a-f]{4,})\*/", line).group(1)
        if op.startswith("IGMMA") or op.startswith("HGMMA"):
            a = re.match(r"\s*R\d+\s*,\s*R(\d+)\s*,", args)
            if a:
                group.append((addr, set(range(int(a.group(1)), int(a.group(1)) + 4))))
            if re.search(r"\bgsb0\s*$", args.strip()):
                pending.append(group)
                group = []
            continue
        if op == "WARPGROUP.DEPBAR.LE":
            keep = int(args.split(",")[-1].strip(), 0)
            pending = pending[len(pending) - keep:] if keep else []
            continue
        dest = set(_sass_dest(op, args))
        for g in pending + [group]:
            for gaddr, regs in g:
                if dest & regs:
                    out.append(f"{fn}{addr}: {op} {args.strip()} (fragment of IGMMA at {gaddr})")
    return out
