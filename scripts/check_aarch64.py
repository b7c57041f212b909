"""Resolve LogicPipe's runtime dependencies for an aarch64 box and name the wheel each one gets, without
installing anything or downloading a wheel whole.

    .venv/bin/python scripts/check_aarch64.py [--python-version 3.10] [--glibc 2.35] [--extras convert,quant]
                                               [--torch VERSION] [--find-links DIR] [--no-index] [--json] [REQ ...]

The target is a Jetson on JetPack 6 by default: CPython 3.10 (Ubuntu 22.04's, the one JetPack's torch is
built for) and glibc 2.35, i.e. wheels tagged manylinux2014 / manylinux_2_17 .. manylinux_2_35 for
aarch64 (`--python-version 3.11 --glibc 2.36` is a Debian 12 box such as Raspberry Pi OS). The
requirements are pyproject.toml's dependencies and the extras used at run time (`convert`: GGUF files;
`quant`: --quantize nf4|fp4), or the REQs given. What it does:

1. pip resolves them (`pip install --dry-run --report -`, `--only-binary=:all:`, one `--platform` per
   manylinux tag) with `--use-feature=fast-deps`: a wheel whose index entry carries no metadata (none
   does on the index this was written against) is read by HTTP range requests — its central directory
   and METADATA, 1 MiB a request (pip's 10 KiB took some 200 requests, 40 s, for torch's) — never
   downloaded whole.
2. pip runs in a throwaway virtualenv that holds pip (a link to this one's) and a stand-in for torch (a
   dist-info of the version scripts/setup.sh installs, no files), so torch counts as installed and its
   own dependency tree is not walked: on Linux aarch64 the index's torch is its CUDA 13 build, whose
   nvidia-* wheels are torch's business; a Jetson uses JetPack's torch; a CPU box may take PyTorch's
   CPU build. pip evaluates environment markers (`platform_machine == "x86_64"`, `python_version <
   "3.11"`) against the interpreter it runs in, not `--platform`: there `platform.machine()` says
   aarch64 and `platform.python_version()` the target's.
3. At the same time, torch alone (`--no-deps`): which torch wheel the index has for the target.

Prints each package, its version and the wheel chosen (aarch64, or pure: py3-none-any), then OK, or
FAIL naming the first requirement with no such wheel (pip stops at it). Exit 0 / 1; 2 when pip fails
otherwise (a conflict). An index that cannot be reached reads as packages without wheels: ask
`index_unreachable()` first, as tests/unit/test_aarch64_wheels.py does. `--json` prints one object
instead. Measured here: 18-24 s, most of it pip parsing some 60 index pages (the CPU) and waiting on
~200 requests one at a time.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import re
import subprocess
import sys
import tempfile
import tomllib
import urllib.error
import urllib.request
import venv
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import parse_wheel_filename
from pip._internal.models.index import PyPI

ROOT = Path(__file__).resolve().parents[1]
RUNTIME_EXTRAS = ("convert", "quant")  # `dev` is the test suite's, `bench` a benchmark peer's
MISSING = re.compile(r"No matching distribution found for ([A-Za-z0-9._-]+)")
LAZY_CHUNK = 1 << 20  # bytes a range request of a lazy wheel reads (pip's 10 KiB took 200 requests for torch's)
# pip as the target sees it: markers read aarch64 and the target's Python; lazy wheels in bigger ranges
PIP = """import platform, sys
platform.machine = lambda: "aarch64"
platform.python_version_tuple = lambda: {version!r}
platform.python_version = lambda: ".".join({version!r})
import pip._vendor.requests.models as m
m.CONTENT_CHUNK_SIZE = {chunk}
from pip._internal.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


def runtime_requirements(extras=RUNTIME_EXTRAS, pyproject: Path = ROOT / "pyproject.toml") -> list[str]:
    """pyproject.toml's dependencies plus those of `extras`."""
    project = tomllib.loads(pyproject.read_text())["project"]
    reqs = list(project["dependencies"])
    for extra in extras:
        reqs += project["optional-dependencies"][extra]
    return reqs


def setup_torch_version(setup: Path = ROOT / "scripts" / "setup.sh") -> str:
    """The torch version scripts/setup.sh installs by default (its TORCH_SPEC)."""
    m = re.search(r"TORCH_SPEC:-torch==([0-9][0-9.]*)", setup.read_text())
    if not m:
        raise SystemExit(f"no `TORCH_SPEC:-torch==VERSION` in {setup}: pass --torch")
    return m.group(1)


def index_url() -> str:
    """The index pip reads first: its index-url setting (environment or configuration), else its default."""
    listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
    for line in listed.splitlines():
        key, _, value = line.partition("=")
        if key.endswith(".index-url") and value.strip("'\" "):
            return value.strip("'\" ").split()[0]
    return PyPI.simple_url


def index_unreachable(timeout_s: float = 10.0) -> str:
    """Why the index cannot be reached ('' when it answers a project page)."""
    url = index_url().rstrip("/") + "/pip/"
    try:
        urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout_s).close()
    except urllib.error.HTTPError:  # it answered
        return ""
    except OSError as exc:  # URLError, a timeout, a refused connection
        return f"{url}: {exc}"
    return ""


def platforms(glibc: str) -> list[str]:
    """The manylinux tags an aarch64 box with this glibc installs (pip takes no range: one tag each)."""
    major, minor = (int(x) for x in glibc.split("."))
    if major != 2 or minor < 17:
        raise SystemExit(f"--glibc {glibc}: manylinux for aarch64 starts at 2.17")
    return ["manylinux2014_aarch64"] + [f"manylinux_2_{m}_aarch64" for m in range(17, minor + 1)]


def wheel_kind(filename: str) -> str:
    """"aarch64", "pure" (any platform) or the wheel's platform tags when neither."""
    if not filename.endswith(".whl"):
        return "sdist"
    platforms_ = {t.platform for t in parse_wheel_filename(filename)[3]}
    if platforms_ == {"any"}:
        return "pure"
    if all(p.endswith("_aarch64") for p in platforms_):
        return "aarch64"
    return ".".join(sorted(platforms_))


def target_env(where: Path, provided: dict[str, str]) -> Path:
    """A virtualenv without pip of its own whose site-packages holds pip (a link to this one's) and a
    stand-in dist-info for each of `provided` (name -> version). Returns its python."""
    venv.create(where, with_pip=False, symlinks=True)
    python = where / "bin" / "python"
    site = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    (site / "pip").symlink_to(importlib.util.find_spec("pip").submodule_search_locations[0])
    for name, version in provided.items():
        info = site / f"{name}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        (info / "INSTALLER").write_text("check_aarch64\n")
        (info / "RECORD").write_text("")
    return python


def pip_command(reqs: list[str], args, python: Path, *, alone: bool = False) -> list[str]:
    """`pip install --dry-run --report -` for the target, run by `python` (alone: --no-deps, and what is
    installed there ignored)."""
    major, minor = args.python_version.split(".")[:2]
    cmd = [str(python), "-c", PIP.format(version=(major, minor, "0"), chunk=LAZY_CHUNK)]
    cmd += ["install", "--dry-run", "--report", "-", "-q", "--only-binary=:all:", "--use-feature=fast-deps",
            "--python-version", f"{major}.{minor}", "--implementation", "cp"]
    for tag in platforms(args.glibc):
        cmd += ["--platform", tag]
    if alone:
        cmd += ["--no-deps", "--ignore-installed"]
    for d in args.find_links:
        cmd += ["--find-links", d]
    if args.no_index:
        cmd.append("--no-index")
    return cmd + reqs


def finished(proc: subprocess.Popen) -> subprocess.CompletedProcess:
    stdout, stderr = proc.communicate()
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def read_report(proc: subprocess.CompletedProcess) -> dict:
    """pip's outcome: {"packages": [{name, version, wheel, kind}], "missing": [...], "error": str}."""
    if proc.returncode == 0:
        report = json.loads(proc.stdout)
        packages = [{"name": i["metadata"]["name"], "version": i["metadata"]["version"],
                     "wheel": i["download_info"]["url"].rsplit("/", 1)[-1]} for i in report["install"]]
        for p in packages:
            p["kind"] = wheel_kind(p["wheel"])
        return {"packages": packages, "missing": [], "error": ""}
    err = "\n".join(line for line in proc.stderr.splitlines() if "is ignored" not in line and "fast-deps" not in line)
    return {"packages": [], "missing": MISSING.findall(err), "error": err.strip() or f"pip exited {proc.returncode}"}


def check(args) -> dict:
    """Resolve args' requirements (and torch alone) for the target; the outcome as `--json` prints it."""
    reqs = args.reqs or runtime_requirements([e for e in args.extras.split(",") if e])
    torch = args.torch if args.torch is not None else setup_torch_version()
    provided = {"torch": torch} if torch else {}
    reqs = [r for r in reqs if Requirement(r).name not in provided]  # stood in for; resolved alone below
    with tempfile.TemporaryDirectory(prefix="lp-aarch64-") as tmp:
        python = target_env(Path(tmp) / "env", provided)
        pipe = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        runs = [subprocess.Popen(pip_command(reqs, args, python), **pipe)]
        if torch and not args.no_index:  # at once: each waits on the index most of its time
            runs.append(subprocess.Popen(pip_command([f"torch=={torch}"], args, python, alone=True), **pipe))
        out, *alone = [read_report(finished(p)) for p in runs]
    for t in alone:
        for p in t["packages"]:
            p["note"] = "alone (--no-deps): its own dependency tree is torch's"
        out["packages"] += t["packages"]
        out["missing"] += t["missing"]
        if t["error"] and not t["missing"]:
            out["error"] = (out["error"] + "\n" + t["error"]).strip()
    out["target"] = {"python": args.python_version, "glibc": args.glibc, "platforms": platforms(args.glibc),
                     "requirements": reqs, "torch": torch}
    out["ok"] = not out["error"] and all(p["kind"] in ("aarch64", "pure") for p in out["packages"])
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("reqs", nargs="*", metavar="REQ", help="requirements (default: pyproject's runtime ones)")
    ap.add_argument("--python-version", default="3.10", help="target CPython (default 3.10: JetPack 6's)")
    ap.add_argument("--glibc", default="2.35", help="target glibc (default 2.35: JetPack 6, Ubuntu 22.04)")
    ap.add_argument("--extras", default=",".join(RUNTIME_EXTRAS), help="extras added to the dependencies")
    ap.add_argument("--torch", default=None, help="torch version stood in for and checked alone (default: "
                                                  "setup.sh's; '' for none)")
    ap.add_argument("--find-links", action="append", default=[], metavar="DIR", help="also look here (pip's)")
    ap.add_argument("--no-index", action="store_true", help="only --find-links (pip's)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    out = check(args)
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        t = out["target"]
        print(f"aarch64 check: CPython {t['python']}, glibc {t['glibc']} ({t['platforms'][-1]}), "
              f"torch {t['torch'] or '-'}")
        for p in out["packages"]:
            print(f"  {p['name']:<24} {p['version']:<18} {p['kind']:<8} {p['wheel']}"
                  + (f"  ({p['note']})" if p.get("note") else ""))
        if out["ok"]:
            print(f"OK: {len(out['packages'])} packages, each an aarch64 or pure-Python wheel")
        elif out["missing"]:
            print(f"FAIL: no aarch64 or pure-Python wheel for {', '.join(out['missing'])} "
                  f"(CPython {t['python']}, glibc {t['glibc']})")
            print("\n".join(f"  pip: {line.removeprefix('ERROR: ')}" for line in out["error"].splitlines()
                             if "Could not find a version" in line))
        elif out["error"]:
            print("FAIL: pip could not resolve:\n" + out["error"])
        else:
            print("FAIL: not for aarch64: " + ", ".join(f"{p['name']} ({p['wheel']})" for p in out["packages"]
                                                         if p["kind"] not in ("aarch64", "pure")))
    if out["ok"]:
        return 0
    return 1 if out["missing"] or not out["error"] else 2


if __name__ == "__main__":
    sys.exit(main())
