"""logicpipe.sdnotify against a socket the test binds; the unit files under `systemd-analyze verify` and
`systemd-analyze security` (exposure at most 3.0, "OK", for both units and for the stage with its GPU drop-in)."""
from __future__ import annotations

import asyncio
import os
import re
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

import pytest

from logicpipe.common import sdnotify

SYSTEMD_DIR = Path(__file__).resolve().parents[2] / "systemd"
UNITS = {"controller": SYSTEMD_DIR / "logicpipe-controller.service", "stage": SYSTEMD_DIR / "logicpipe-stage.service"}
SPARE_UNIT = SYSTEMD_DIR / "logicpipe-stage-spare.service"  # the stage's spare process (--spare)
GPU_DROP_IN = SYSTEMD_DIR / "logicpipe-stage.service.d" / "gpu.conf"
KEEP_DROP_IN = SYSTEMD_DIR / "logicpipe-stage.service.d" / "keep-spare.conf"
MAX_EXPOSURE = 3.0  # systemd-analyze security's "OK" band ends here
VENV_BIN = "/opt/logicpipe/.venv/bin/"


@pytest.fixture
def notify_socket(monkeypatch):
    """A bound AF_UNIX datagram socket standing in for systemd's; $NOTIFY_SOCKET points at it.
    (A short temp dir: AF_UNIX paths are limited to 108 bytes.)"""
    with tempfile.TemporaryDirectory(prefix="lp-sd-") as d:
        path = os.path.join(d, "notify")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.bind(path)
        sock.setblocking(False)
        monkeypatch.setenv("NOTIFY_SOCKET", path)
        yield sock
        sock.close()


def drain(sock: socket.socket) -> list[bytes]:
    """Every datagram queued on `sock` now, without waiting."""
    got = []
    while True:
        try:
            got.append(sock.recv(4096))
        except BlockingIOError:
            return got


# --- notify -------------------------------------------------------------------------------------

def test_notify_sends_the_fields_as_one_datagram(notify_socket):
    assert sdnotify.notify("READY=1", "STATUS=serving on 0.0.0.0:50061")
    assert sdnotify.notify("STOPPING=1")
    assert drain(notify_socket) == [b"READY=1\nSTATUS=serving on 0.0.0.0:50061", b"STOPPING=1"]


def test_notify_reaches_an_abstract_namespace_socket(monkeypatch):
    name = f"logicpipe-test-{os.getpid()}-{os.urandom(4).hex()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.setblocking(False)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        assert sdnotify.notify("WATCHDOG=1")
        assert drain(sock) == [b"WATCHDOG=1"]


def test_notify_is_a_no_op_outside_systemd(monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert sdnotify.notify("READY=1") is False


def test_notify_returns_false_when_nobody_listens(monkeypatch, tmp_path):
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "gone"))
    assert sdnotify.notify("READY=1") is False
    monkeypatch.setenv("NOTIFY_SOCKET", "vsock:2:1234")  # not an AF_UNIX address
    assert sdnotify.notify("READY=1") is False


# --- watchdog_interval --------------------------------------------------------------------------

def test_watchdog_interval_is_half_of_watchdog_usec_for_this_process(monkeypatch):
    monkeypatch.setenv("WATCHDOG_USEC", "30000000")
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    assert sdnotify.watchdog_interval() == 15.0
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    assert sdnotify.watchdog_interval() == 15.0
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid() + 1))  # meant for another process
    assert sdnotify.watchdog_interval() is None


@pytest.mark.parametrize("usec", [None, "", "0", "-5", "soon"])
def test_watchdog_interval_is_none_without_a_usable_watchdog_usec(monkeypatch, usec):
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    if usec is None:
        monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    else:
        monkeypatch.setenv("WATCHDOG_USEC", usec)
    assert sdnotify.watchdog_interval() is None


# --- watchdog -----------------------------------------------------------------------------------

def test_watchdog_returns_at_once_when_not_configured(monkeypatch):
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    asyncio.run(asyncio.wait_for(sdnotify.watchdog(), timeout=5))


def test_watchdog_pings_only_while_alive(monkeypatch, notify_socket):
    monkeypatch.setenv("WATCHDOG_USEC", "20000")  # a ping every 10 ms
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    state = {"alive": True, "checks": 0}

    def alive() -> bool:
        state["checks"] += 1
        return state["alive"]

    async def checks_pass(n: int) -> None:
        start = state["checks"]
        while state["checks"] < start + n:
            await asyncio.sleep(0.005)

    async def main():
        loop = asyncio.get_running_loop()
        task = asyncio.create_task(sdnotify.watchdog(alive))
        try:
            assert await asyncio.wait_for(loop.sock_recv(notify_socket, 4096), timeout=10) == b"WATCHDOG=1"
            await asyncio.wait_for(checks_pass(2), timeout=10)
            assert set(drain(notify_socket)) <= {b"WATCHDOG=1"}

            # Wedged: pings stop. notify() sends synchronously on this loop, so every ping of the
            # alive period is already queued when the flag flips; drain them, then expect none.
            state["alive"] = False
            drain(notify_socket)
            await asyncio.wait_for(checks_pass(3), timeout=10)
            assert drain(notify_socket) == []

            state["alive"] = True  # recovered: pings resume
            assert await asyncio.wait_for(loop.sock_recv(notify_socket, 4096), timeout=10) == b"WATCHDOG=1"
        finally:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(main())


def test_watchdog_survives_an_alive_check_that_raises(monkeypatch, notify_socket):
    monkeypatch.setenv("WATCHDOG_USEC", "20000")
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    calls = []

    def alive() -> bool:
        calls.append(1)
        if len(calls) <= 3:
            raise RuntimeError("liveness probe broke")
        return True

    async def main():
        loop = asyncio.get_running_loop()
        task = asyncio.create_task(sdnotify.watchdog(alive))
        try:
            assert await asyncio.wait_for(loop.sock_recv(notify_socket, 4096), timeout=10) == b"WATCHDOG=1"
            assert len(calls) >= 4  # the first ping came only once alive() stopped raising
        finally:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(main())


# --- unit files ---------------------------------------------------------------------------------

def directives(text: str) -> dict[str, list[str]]:
    """KEY -> values of a unit file's (non-comment) lines."""
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith(("#", ";", "[")):
            key, _, value = line.partition("=")
            out.setdefault(key.strip(), []).append(value.strip())
    return out


def env_example(kind: str) -> Path:
    return SYSTEMD_DIR / f"{kind}.env.example"


@pytest.mark.parametrize("kind", sorted(UNITS))
def test_unit_is_a_notify_service_with_watchdog_state_and_hardening(kind):
    text = UNITS[kind].read_text()
    d = directives(text)
    for key, value in {
        "Type": "notify", "NotifyAccess": "main", "WatchdogSec": "30",
        # the controller restarts whatever its exit: a replaced one exits 75 to come back as the standby
        "Restart": {"controller": "always", "stage": "on-failure"}[kind],
        "RestartSec": "1", "StateDirectory": "logicpipe", "CacheDirectory": "logicpipe",
        "RestartPreventExitStatus": "2",  # a start-up mistake (one line naming the fix) is not retried
        "NoNewPrivileges": "true", "ProtectSystem": "strict", "ProtectHome": "true", "PrivateTmp": "true",
        "ReadOnlyPaths": "/opt/logicpipe", "TimeoutStopSec": {"controller": "20", "stage": "40"}[kind],
        # the sandbox: no capabilities, no devices (the stage's GPU drop-in gives them back), no
        # kernel knobs, the address families gRPC, mDNS, sd_notify and getifaddrs() need
        "CapabilityBoundingSet": "", "AmbientCapabilities": "", "UMask": "0077", "PrivateDevices": "true",
        "ProtectKernelTunables": "true", "ProtectKernelModules": "true", "ProtectKernelLogs": "true",
        "ProtectControlGroups": "true", "ProtectClock": "true", "ProtectHostname": "true",
        "RestrictAddressFamilies": "AF_INET AF_INET6 AF_UNIX AF_NETLINK", "RestrictNamespaces": "true",
        "RestrictRealtime": "true", "RestrictSUIDSGID": "true", "LockPersonality": "true",
        "SystemCallArchitectures": "native", "SystemCallFilter": "@system-service", "SystemCallErrorNumber": "EPERM",
        # torch's oneDNN JITs bfloat16 CPU kernels ("could not create a primitive" under it); the
        # controller runs torch only to convert GGUF files, which needs no JIT
        "MemoryDenyWriteExecute": {"controller": ["true"], "stage": None}[kind],
    }.items():
        value = [value] if isinstance(value, str) else value
        assert d.get(key) == value, (kind, key, d.get(key))
    assert "--nodes" not in text  # the controller finds nodes by mDNS
    assert "DevicePolicy" not in d  # PrivateDevices closes it; the GPU drop-in opens it again (auto)
    exec_start = d["ExecStart"][0]
    assert "--node-id" not in exec_start  # the stage keeps its id in $STATE_DIRECTORY
    assert exec_start.startswith(f"{VENV_BIN}logicpipe-{kind} --listen ${{LISTEN}} ")
    assert exec_start.endswith(" $EXTRA_ARGS")


def test_the_base_stage_unit_names_no_group_and_the_gpu_drop_in_gives_devices_back():
    """A group the host lacks fails the start with 216/GROUP (stock Debian has no `render`), so the
    base unit (a CPU node) names none; the drop-in gives GPU nodes the host's /dev, the default
    device policy (ProtectClock's implied DeviceAllow=char-rtc would make it an allow-list that cuts
    Jetson's nvhost/nvmap off) and the video group every host has."""
    d = directives(UNITS["stage"].read_text())
    assert "SupplementaryGroups" not in d and "Group" in d and d["Group"] == ["logicpipe"]
    assert "DeviceAllow" not in d
    assert "--device ${DEVICE}" in d["ExecStart"][0]
    text = GPU_DROP_IN.read_text()
    assert [line for line in text.splitlines() if line.startswith("[")] == ["[Service]"]
    gpu = directives(text)
    assert gpu == {"PrivateDevices": ["false"], "ProtectClock": ["false"], "SupplementaryGroups": ["video"]}, gpu
    assert "DEVICE=cpu" in env_example("stage").read_text().splitlines()  # the base unit has no GPU
    assert "gpu.conf" in (SYSTEMD_DIR.parent / "docs" / "deploy.md").read_text()


@pytest.mark.parametrize("kind", sorted(UNITS))
def test_env_example_documents_exactly_the_variables_execstart_uses(kind):
    used = set(re.findall(r"\$\{?([A-Z_][A-Z0-9_]*)\}?", directives(UNITS[kind].read_text())["ExecStart"][0]))
    lines = env_example(kind).read_text().splitlines()
    defined = {}
    for i, line in enumerate(lines):
        if line.strip() and not line.startswith("#"):
            name = line.split("=", 1)[0]
            assert re.fullmatch(r"[A-Z_][A-Z0-9_]*", name), line
            assert i > 0 and lines[i - 1].startswith("# "), f"{name} has no comment line above it"
            defined[name] = line.split("=", 1)[1]
    assert set(defined) == used
    assert "--nodes" not in defined.get("EXTRA_ARGS", "")


def opt_in_lines(text: str) -> list[str]:
    """Directives the unit documents as commented-out opt-ins ("#   Key=value")."""
    return [m.group(1) for m in re.finditer(r"^#\s{2,}([A-Z][A-Za-z]+=.*)$", text, re.M)]


def with_drop_in(unit_text: str, drop_in_text: str) -> str:
    """The unit as one file with the drop-in's [Service] lines at the end of its [Service] section
    (for `verify`, which is given single files)."""
    body = drop_in_text.split("[Service]", 1)[1]
    return unit_text.replace("\n[Install]", body + "\n[Install]")


needs_systemd_analyze = pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                                           reason="systemd-analyze (systemd) is not installed on this host")


@needs_systemd_analyze
def test_units_pass_systemd_analyze_verify(tmp_path):
    """verify wants ExecStart's binary to exist: point it at a stub, and EnvironmentFile at the
    example. Warnings (unknown keys, bad values) leave the exit code at 0, so any output line
    that names one of our files counts as a failure too. The stage is verified as shipped, with
    its GPU drop-in, and with the drop-in's documented opt-in lines (desktop NVIDIA's DeviceAllow=)."""
    stub = tmp_path / "stub"
    stub.write_text("#!/bin/sh\nexit 0\n")
    stub.chmod(0o755)
    files = []
    for kind, unit in UNITS.items():
        text = unit.read_text()
        assert VENV_BIN in text and "EnvironmentFile=" in text
        text = re.sub(re.escape(VENV_BIN) + r"\S+", str(stub), text)
        text = re.sub(r"^EnvironmentFile=.*$", f"EnvironmentFile={env_example(kind)}", text, flags=re.M)
        files.append(tmp_path / unit.name)
        files[-1].write_text(text)
        if kind == "stage":
            spare = re.sub(re.escape(VENV_BIN) + r"\S+", str(stub), SPARE_UNIT.read_text())
            files.append(tmp_path / SPARE_UNIT.name)
            files[-1].write_text(re.sub(r"^EnvironmentFile=.*$", f"EnvironmentFile={env_example(kind)}", spare,
                                        flags=re.M))
            files.append(tmp_path / "logicpipe-stage-keep.service")
            files[-1].write_text(with_drop_in(text, KEEP_DROP_IN.read_text()))
            drop_in = GPU_DROP_IN.read_text()
            files.append(tmp_path / "logicpipe-stage-gpu.service")
            files[-1].write_text(with_drop_in(text, drop_in))
            extra = opt_in_lines(drop_in)
            assert any(line.startswith("DeviceAllow=") for line in extra), extra
            files.append(tmp_path / "logicpipe-stage-gpu-optin.service")
            files[-1].write_text(with_drop_in(text, drop_in).replace("\n[Install]", "\n" + "\n".join(extra) + "\n\n[Install]"))
    proc = subprocess.run(["systemd-analyze", "verify", *map(str, files)],
                          capture_output=True, text=True, timeout=60)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    complaints = [line for line in output.splitlines()
                  if str(tmp_path) in line or any(f.name in line for f in files)]
    assert complaints == [], output


def exposure(unit: Path) -> tuple[float, str]:
    """`systemd-analyze security --offline=true --threshold=30 UNIT`: the overall exposure and the
    report. --threshold is the exposure times ten (0..100) above which the command exits non-zero
    (8.5 passes --threshold=85 and fails 84), so 30 is "at most 3.0". --offline reads the unit file
    and the drop-ins in UNIT.d/ beside it, nothing of PID 1's, and (unlike verify) does not look for
    ExecStart's binary, so the units need no stub here."""
    proc = subprocess.run(["systemd-analyze", "security", "--offline=true", f"--threshold={round(MAX_EXPOSURE * 10)}",
                           "--no-pager", str(unit)], capture_output=True, text=True, timeout=60)
    output = proc.stdout + proc.stderr
    m = re.search(rf"Overall exposure level for {re.escape(unit.name)}: (\d+\.\d+)", output)
    assert m, output
    assert proc.returncode == 0, f"{unit.name}: exposure {m.group(1)} over {MAX_EXPOSURE}\n{output}"
    return float(m.group(1)), output


@needs_systemd_analyze
@pytest.mark.parametrize("case", ["controller", "stage", "stage+gpu"])
def test_units_score_ok_in_systemd_analyze_security(tmp_path, case):
    """Each unit, copied under a name no host has (so no drop-in of an installed LogicPipe in /etc
    is read), alone or with the GPU drop-in in its .d/ directory."""
    kind = case.split("+")[0]
    unit = tmp_path / f"lptest-{kind}.service"
    unit.write_text(UNITS[kind].read_text())
    if case == "stage+gpu":
        (tmp_path / f"{unit.name}.d").mkdir()
        (tmp_path / f"{unit.name}.d" / "gpu.conf").write_text(GPU_DROP_IN.read_text())
    score, report = exposure(unit)
    assert score <= MAX_EXPOSURE
    # the drop-in was read: the GPU stage has the host's devices and one supplementary group
    gpu_marks = ("Service potentially has access to hardware devices", "Service runs with supplementary groups")
    assert all((mark in report) == (case == "stage+gpu") for mark in gpu_marks), report


def test_a_stage_comes_back_a_second_after_a_crash_and_is_never_given_up_on():
    """A restarted stage reads its KV back from disk; each second of its restart is a second its
    replays wait (issue 34). systemd's start limit (5 starts in 10 s) would stop a node restarted
    every second for good, so the stage's unit has none."""
    d = directives(UNITS["stage"].read_text())
    assert d["RestartSec"] == ["1"] and d["StartLimitIntervalSec"] == ["0"]


def test_the_spare_unit_is_the_stage_unit_with_spare_stopped_with_it():
    """The spare's unit runs the stage's command line with --spare, under the same settings and sandbox
    (line for line: a change to one unit that the other lacks fails here), and is stopped and
    restarted with the stage unit (PartOf=): an operator stopping the node stops its spare too."""
    stage, spare = directives(UNITS["stage"].read_text()), directives(SPARE_UNIT.read_text())
    assert spare.pop("PartOf") == ["logicpipe-stage.service"]
    assert spare.pop("ExecStart") == [stage.pop("ExecStart")[0] + " --spare"]
    assert spare.pop("Description") == [stage.pop("Description")[0] + " (its spare process)"]
    assert spare == stage


def test_the_keep_spare_drop_in_lets_the_keepers_children_notify():
    """--keep-spare: the serving process is the keeper's child, so its READY=1 and watchdog pings need
    NotifyAccess=all (the base unit keeps main); nothing else changes."""
    text = KEEP_DROP_IN.read_text()
    assert [line for line in text.splitlines() if line.startswith("[")] == ["[Service]"]
    assert directives(text) == {"NotifyAccess": ["all"]}
    assert "--keep-spare" in text and "keep-spare.conf" in (SYSTEMD_DIR.parent / "docs" / "deploy.md").read_text()
