"""cpu_quant.c's NEON path (aarch64), run under qemu-aarch64 user emulation by scripts/check_neon.py:
lp_int4_mm / lp_int8_mm within test_cpu_kernels' bound() and a row's bits the same among 1 to 8 rows,
lp_layers within 1e-4 of this host's build and a row's bits the same however its steps are cut.

Runs only where zig (the `ziglang` package importable, or `zig` on PATH) and qemu-aarch64 (Debian's
qemu-user) are both present, and skips saying which is missing otherwise: CI has neither, so there
it always skips, and the NEON path is checked on a machine that has them (`pip install ziglang`,
`apt-get install qemu-user`). zig's first cross build of musl for aarch64 takes a minute or two;
after that the check takes some 10 s.
"""
from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "check_neon.py"
ZIG = importlib.util.find_spec("ziglang") is not None or shutil.which("zig") is not None
QEMU = shutil.which("qemu-aarch64") is not None
MISSING = [name for name, have in (("zig (ziglang or zig on PATH)", ZIG), ("qemu-aarch64", QEMU)) if not have]


@pytest.mark.skipif(bool(MISSING), reason=f"NEON check needs {' and '.join(MISSING)}")
def test_the_neon_path_computes_the_hosts_numbers_under_emulation():
    proc = subprocess.run([sys.executable, str(SCRIPT)], check=False, capture_output=True, text=True,
                          timeout=600)
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.rstrip().splitlines()[-1].startswith("PASS")
