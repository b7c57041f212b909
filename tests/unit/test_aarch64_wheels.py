"""Every runtime dependency resolves to an aarch64 or pure-Python wheel for a Jetson on JetPack 6
(CPython 3.10, glibc 2.35) by scripts/check_aarch64.py; and the check fails for a package that has
x86-64 wheels only and reads environment markers as the target would (wheels made here, in a folder,
no index).

The first test asks the package index (pip reads some 60 index pages and each chosen wheel's METADATA
by range requests: about 20 s); it skips, saying so, only when the index cannot be reached. A new
release of a dependency with no aarch64 wheel (an sdist only) fails it: that is what it is for.
"""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "check_aarch64.py"
_spec = importlib.util.spec_from_file_location("check_aarch64", SCRIPT)
check_aarch64 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_aarch64)


def run_check(*args: str) -> tuple[int, dict]:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--json", *args], capture_output=True, text=True,
                          timeout=300, check=False)
    return proc.returncode, json.loads(proc.stdout)


def fake_wheel(folder: Path, name: str, tag: str, requires: tuple[str, ...] = ()) -> None:
    """A minimal wheel `name`-1.0 tagged `tag` (py3-none-PLATFORM) whose METADATA requires `requires`."""
    dist = name.replace("-", "_")
    meta = "".join(["Metadata-Version: 2.1\n", f"Name: {name}\n", "Version: 1.0\n",
                    *(f"Requires-Dist: {r}\n" for r in requires)])
    wheel = f"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: {tag}\n"
    with zipfile.ZipFile(folder / f"{dist}-1.0-{tag}.whl", "w") as z:
        z.writestr(f"{dist}/__init__.py", "")
        z.writestr(f"{dist}-1.0.dist-info/METADATA", meta)
        z.writestr(f"{dist}-1.0.dist-info/WHEEL", wheel)
        z.writestr(f"{dist}-1.0.dist-info/RECORD", "")


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("wheels")
    fake_wheel(folder, "lpfake-x86only", "py3-none-manylinux_2_17_x86_64")
    fake_wheel(folder, "lpfake-armonly", "py3-none-manylinux_2_17_aarch64")
    fake_wheel(folder, "lpfake-old", "py3-none-any")
    fake_wheel(folder, "lpfake-app", "py3-none-any", ('lpfake-x86only; platform_machine == "x86_64"',
                                                      'lpfake-armonly; platform_machine == "aarch64"',
                                                      'lpfake-old; python_version < "3.11"'))
    return folder


def offline(wheels: Path, *args: str) -> tuple[int, dict]:
    return run_check("--no-index", "--find-links", str(wheels), "--torch", "", *args)


def test_every_runtime_dependency_resolves_to_an_aarch64_or_pure_wheel():
    unreachable = check_aarch64.index_unreachable()
    if unreachable:
        pytest.skip(f"the package index cannot be reached: {unreachable}")
    code, out = run_check()
    assert code == 0, out["error"] or out["missing"] or out["packages"]
    kinds = {p["name"]: p["kind"] for p in out["packages"]}
    assert set(kinds.values()) <= {"aarch64", "pure"}, kinds
    resolved = {canonicalize_name(n) for n in kinds}
    wanted = {canonicalize_name(Requirement(r).name) for r in check_aarch64.runtime_requirements()}
    assert "torch" in wanted and wanted <= resolved, wanted - resolved  # torch by its own (--no-deps) run
    assert len(resolved) > len(wanted)  # their dependencies too
    assert kinds["torch"] == "aarch64" and kinds["xgrammar"] == "aarch64"


def test_a_package_with_x86_64_wheels_only_fails_the_check(wheels):
    code, out = offline(wheels, "lpfake-x86only")
    assert code == 1 and out["missing"] == ["lpfake-x86only"] and not out["ok"]
    code, out = offline(wheels, "lpfake-armonly", "lpfake-old")
    assert code == 0 and {p["name"]: p["kind"] for p in out["packages"]} == {"lpfake-armonly": "aarch64",
                                                                             "lpfake-old": "pure"}


def test_markers_are_read_as_the_target_reads_them(wheels):
    """lpfake-app needs lpfake-x86only on x86-64 only (this host), lpfake-armonly on aarch64 and
    lpfake-old below Python 3.11: for the target, the last two."""
    code, out = offline(wheels, "lpfake-app")
    assert code == 0, out["error"]
    assert sorted(p["name"] for p in out["packages"]) == ["lpfake-app", "lpfake-armonly", "lpfake-old"]
    code, out = offline(wheels, "--python-version", "3.11", "lpfake-app")
    assert code == 0 and sorted(p["name"] for p in out["packages"]) == ["lpfake-app", "lpfake-armonly"]


def test_wheel_kinds_and_the_platform_tags():
    kind = check_aarch64.wheel_kind
    assert kind("grpcio-1.85.3-cp310-cp310-manylinux2014_aarch64.manylinux_2_17_aarch64.whl") == "aarch64"
    assert kind("gguf-0.19.0-py3-none-any.whl") == "pure"
    assert kind("torch-2.13.0-cp310-cp310-manylinux_2_28_x86_64.whl") == "manylinux_2_28_x86_64"
    tags = check_aarch64.platforms("2.35")
    assert tags[0] == "manylinux2014_aarch64" and tags[-1] == "manylinux_2_35_aarch64" and len(tags) == 20
